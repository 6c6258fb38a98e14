"""The compiled quantizer kernels (impls/quant_kernels.py, numba) give exactly what the NumPy
steps give: the same codes, packed bytes, scales and zero points, bit for bit, and the same
refusals."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impls import quant_kernels, quant_numpy
from kvbench import quant as Q

pytestmark = pytest.mark.skipif(not quant_kernels.available()[0], reason=quant_kernels.available()[1])


def both(x, scheme):
    return (quant_numpy.quantize(x, scheme, compiled=False),
            quant_numpy.quantize(x, scheme, compiled=True))


def assert_same(a, b):
    for f in ("codes", "scale", "zero_point"):
        va, vb = getattr(a, f), getattr(b, f)
        if va is None:
            assert vb is None
            continue
        va, vb = np.asarray(va), np.asarray(vb)
        assert va.dtype == vb.dtype and va.shape == vb.shape
        # bit for bit: -0.0 and 0.0 differ, NaN would differ from itself
        assert np.array_equal(va.view(np.uint8), vb.view(np.uint8)), f


@st.composite
def cases(draw):
    granularity = draw(st.sampled_from(["channel", "token", "group"]))
    bits = draw(st.integers(2, 8))
    symmetric = draw(st.booleans())
    channels = draw(st.sampled_from([4, 8, 16, 24, 32, 64, 96, 128]))
    rows = draw(st.integers(1, 70))
    group = draw(st.sampled_from([g for g in (2, 4, 8, 16, 32) if channels % g == 0])) \
        if granularity == "group" else None
    kind = draw(st.sampled_from(["normal", "tiny", "huge", "positive", "constant", "zeros", "mixed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    x = rng.standard_normal((rows, channels))
    if kind == "tiny":
        x *= 1e-40  # subnormal float32: reciprocals overflow, the steps divide instead
    elif kind == "huge":
        x *= 1e37
    elif kind == "positive":
        x = np.abs(x) + 10
    elif kind == "constant":
        x[:] = rng.choice([-3.5, 0.25, 7.0])
    elif kind == "zeros":
        x[:] = 0.0
    elif kind == "mixed":
        x[rng.random(x.shape) < 0.3] = 0.0
        x[:, 0] = -0.0
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    with np.errstate(over="ignore"):
        x = x.astype(dtype)
    if not np.isfinite(x).all():
        x = np.nan_to_num(x, posinf=1.0, neginf=-1.0)
    return x, Q.QuantScheme(bits, symmetric, granularity, group_size=group)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_kernels_equal_the_numpy_steps(case):
    x, scheme = case
    assert_same(*both(x, scheme))


@pytest.mark.parametrize("scheme", [Q.QuantScheme(8), Q.QuantScheme(8, False, "token"),
                                    Q.QuantScheme(4, False, "group", group_size=32),
                                    Q.QuantScheme(2, False, "channel")])
def test_kv_shaped_input_and_another_axis(scheme):
    x = np.random.default_rng(3).standard_normal((40, 2, 2, 2, 64)).astype(np.float32)
    assert_same(*both(x, scheme))
    moved = Q.QuantScheme(scheme.bits, scheme.symmetric, scheme.granularity, axis=0,
                          group_size=scheme.group_size and 8)
    assert_same(*both(x, moved))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("scheme", [Q.QuantScheme(8), Q.QuantScheme(8, False, "token"),
                                    Q.QuantScheme(4, True, "group", group_size=8)])
def test_non_finite_input_is_refused_the_same_way(bad, scheme):
    x = np.ones((6, 16), np.float32)
    x[4, 9] = bad
    with pytest.raises(ValueError) as plain:
        quant_numpy.quantize(x, scheme, compiled=False)
    with pytest.raises(ValueError) as compiled:
        quant_numpy.quantize(x, scheme, compiled=True)
    assert str(plain.value) == str(compiled.value)
    assert "x[4, 9]" in str(compiled.value)


def test_the_checker_passes_the_compiled_quantizer():
    x = np.random.default_rng(5).standard_normal((256, 128)).astype(np.float32)
    for scheme in (Q.QuantScheme(8, False, "token"), Q.QuantScheme(4, False, "group", group_size=32)):
        qt = quant_numpy.quantize(x, scheme, compiled=True)
        v = Q.check_quantization(x, qt, quant_numpy.dequantize(qt))
        assert v.valid, v
