"""Property tests: random arrays and schemes -> the checker passes the NumPy and torch
quantizers (and the reference), with data-derived and with external (saturating) scales."""
from __future__ import annotations

import functools
import os
import types

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from impls import quant_numpy
from kvbench import quant as Q

# KVBENCH_HYPOTHESIS_EXAMPLES=5000 for a long hunt; the default keeps the suite quick
SETTINGS = settings(max_examples=int(os.environ.get("KVBENCH_HYPOTHESIS_EXAMPLES", 150)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
WIDTH = {np.float16: 16, np.float32: 32, np.float64: 64}


@st.composite
def schemes_for(draw, shape):
    ndim = len(shape)
    axis = draw(st.integers(-ndim, ndim - 1))
    granularity = draw(st.sampled_from(Q.GRANULARITIES))
    channels = shape[axis]
    group = None
    if granularity == "group":
        group = draw(st.sampled_from([d for d in range(1, channels + 1) if channels % d == 0] or [1]))
    return Q.QuantScheme(draw(st.integers(2, 8)), draw(st.booleans()), granularity, axis, group)


@st.composite
def cases(draw):
    """(x, scheme): any finite floats of the dtype (subnormals and the largest included), or
    spread data with an offset (channels that miss 0), or few distinct values (constant and
    all-zero channels); sometimes a transposed, non-contiguous view."""
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9))
    kind = draw(st.sampled_from(["any", "spread", "few"]))
    if kind == "any":
        x = draw(hnp.arrays(dtype, shape, elements=st.floats(allow_nan=False, allow_infinity=False,
                                                             width=WIDTH[dtype])))
    elif kind == "spread":
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        magnitude = 10.0 ** draw(st.integers(-4, 4))
        offset = draw(st.sampled_from([0.0, 1.0, -1.0, 20.0, -300.0])) * magnitude
        with np.errstate(over="ignore"):
            x = (rng.standard_normal(shape) * magnitude + offset).astype(dtype)
        x = np.where(np.isfinite(x), x, 0).astype(dtype)  # float16 overflows past 65504
    else:
        x = draw(hnp.arrays(dtype, shape, elements=st.sampled_from([0.0, 1.5, -2.25, 1e-3, 300.0])))
    if draw(st.booleans()) and x.ndim > 1:
        x = x.T
    return x, draw(schemes_for(x.shape))


def numpy_with_chunk(chunk):
    """quant_numpy with small tiles, so that tiling (split rows, packed tile edges) runs."""
    return types.SimpleNamespace(
        quantize=functools.partial(quant_numpy.quantize, chunk=chunk),
        dequantize=lambda qt: quant_numpy.dequantize(qt, chunk=chunk),
        error_stats=quant_numpy.error_stats, unpack_codes=quant_numpy.unpack_codes)


@SETTINGS
@given(cases(), st.sampled_from([4, 16, quant_numpy.CHUNK_ELEMENTS]))
def test_numpy_quantizer_passes_the_checker(case, chunk):
    x, scheme = case
    verdict = Q.check_quantizer(numpy_with_chunk(chunk), x, scheme, sanity=False)
    assert verdict.valid, verdict.explain()


@SETTINGS
@given(cases())
def test_reference_passes_the_checker(case):
    x, scheme = case
    verdict = Q.check_quantizer(Q, x, scheme, sanity=False)
    assert verdict.valid, verdict.explain()


@SETTINGS
@given(cases(), st.booleans())
def test_torch_quantizer_passes_the_checker(case, bfloat16):
    torch = pytest.importorskip("torch")
    from impls import quant_torch

    x, scheme = case
    t = torch.from_numpy(np.ascontiguousarray(x))
    if bfloat16 and x.dtype == np.float32:
        t = t.to(torch.bfloat16)
    verdict = Q.check_quantizer(quant_torch, t, scheme, sanity=False)
    assert verdict.valid, verdict.explain()


@SETTINGS
@given(cases(), st.floats(0.1, 4.0))
def test_external_scales_saturate_within_the_bound(case, factor):
    x, scheme = case
    if not np.isfinite(x).all():
        return
    with np.errstate(over="ignore"):
        scale = np.asarray(Q.quantize(x, scheme).scale) * factor  # calibrated elsewhere: off by factor
    # a scale the arithmetic (float32 below float64 input) can hold
    scale = np.clip(scale, *((1e-300, 1e300) if x.dtype == np.float64 else (1e-30, 1e30)))
    for impl in (Q, numpy_with_chunk(16)):
        verdict = Q.check_quantizer(impl, x, scheme, scale=scale, sanity=False)
        assert verdict.valid, verdict.explain()


@SETTINGS
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.sampled_from([2, 4]), st.just(n))),
       st.randoms(use_true_random=False))
def test_packed_codes_unpack_exactly(slot_n, rnd):
    slot, n = slot_n
    per = 8 // slot
    lo, hi = -(2 ** (slot - 1)), 2 ** (slot - 1) - 1
    codes = np.array([rnd.randint(lo, hi) for _ in range(n)], dtype=np.int8)
    padded = np.concatenate([codes, np.zeros(-n % per, np.int8)])
    packed = np.empty(padded.size // per, np.uint8)
    quant_numpy._pack_into(padded, slot, packed)
    assert packed.tolist() == Q.pack_bits(codes, slot).tolist()
    back = np.empty(padded.size, np.int8)
    quant_numpy._unpack_into(packed, slot, back)
    assert back[:n].tolist() == codes.tolist()
