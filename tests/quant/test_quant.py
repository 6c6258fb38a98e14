"""KV quantization (SPEC section 4): the reference formulas, packing, statistics, bad input, and
the NumPy and torch quantizers under the checker. Expected values are worked out inline."""
from __future__ import annotations

import numpy as np
import pytest

from impls import quant_numpy
from kvbench import quant as Q
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import kv_values


def torch_impl():
    pytest.importorskip("torch")
    from impls import quant_torch

    return quant_torch


@pytest.fixture(params=["reference", "numpy", "torch"])
def impl(request):
    if request.param == "torch":
        return torch_impl()
    return {"reference": Q, "numpy": quant_numpy}[request.param]


def dequantized(impl, x, scheme):
    qt = impl.quantize(x, scheme)
    return qt, Q.to_numpy(impl.dequantize(qt))[0].astype(np.float64)


# --- the scheme ------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [0, 1, 9, 16, True, 2.5, "8"])
def test_bit_widths_outside_2_to_8_are_refused(bits):
    with pytest.raises(ValueError, match="bits must be an int in 2..8"):
        Q.QuantScheme(bits=bits)


def test_scheme_refuses_bad_granularity_and_group_size():
    with pytest.raises(ValueError, match="granularity must be one of"):
        Q.QuantScheme(granularity="block")
    with pytest.raises(ValueError, match="positive int group_size"):
        Q.QuantScheme(granularity="group")
    with pytest.raises(ValueError, match="only for granularity 'group'"):
        Q.QuantScheme(granularity="token", group_size=32)


@pytest.mark.parametrize("bits, symmetric, qmin, qmax", [
    (8, True, -127, 127),  # qmax = 2^7 - 1; symmetric codes are [-qmax, qmax]
    (8, False, -128, 127),  # qmin = -2^7
    (4, False, -8, 7),
    (4, True, -7, 7),
    (2, True, -1, 1),
    (2, False, -2, 1),
])
def test_code_range(bits, symmetric, qmin, qmax):
    scheme = Q.QuantScheme(bits, symmetric)
    assert (scheme.qmin, scheme.qmax) == (qmin, qmax)


# --- the reference formulas -------------------------------------------------------------------

def test_symmetric_per_channel_codes():
    x = np.array([[-2.0], [1.2], [0.5], [0.0]])  # one channel, four rows
    qt = Q.quantize(x, Q.QuantScheme(8))
    # scale = max|x| / qmax = 2 / 127 (stored one ulp up)
    assert qt.scale[0, 0] == pytest.approx(2 / 127, rel=1e-15)
    # -127 = -2 / (2/127); 76 = round(76.2) = round(1.2 * 63.5); 32 = round(31.75)
    assert Q.unpack_codes(qt).ravel().tolist() == [-127, 76, 32, 0]


def test_asymmetric_channel_in_10_to_20_has_a_wide_zero_point(impl):
    x = np.linspace(10.0, 20.0, 101, dtype=np.float32).reshape(-1, 1)
    qt, x_hat = dequantized(impl, x, Q.QuantScheme(8, symmetric=False))
    scale = float(Q.to_numpy(qt.scale)[0].ravel()[0])
    zero = float(Q.to_numpy(qt.zero_point)[0].ravel()[0])
    assert scale == pytest.approx(10 / 255, rel=1e-6)  # (20 - 10) / (127 - (-128))
    assert zero == -383  # round(-128 - 10 / (10/255)) = -128 - 255: far outside int8
    assert np.abs(x_hat - x).max() <= 0.02  # scale / 2 = 0.0196
    # 10 -> round(255) - 383 = -128 and 20 -> round(510) - 383 = 127: the whole code range
    codes = Q.to_numpy(impl.unpack_codes(qt) if qt.packed else qt.codes)[0].ravel()
    assert (codes[0], codes[-1]) == (-128, 127)


@pytest.mark.parametrize("symmetric", [True, False])
def test_constant_channel_reconstructs_exactly(impl, symmetric):
    x = np.full((5, 1), 3.5, dtype=np.float32)
    qt, x_hat = dequantized(impl, x, Q.QuantScheme(8, symmetric))
    # asymmetric: scale |v| = 3.5, zero point 0, code 1; symmetric: scale 3.5/127, code 127
    assert np.abs(x_hat - 3.5).max() <= 4 * 2.0**-24 * 3.5
    if not symmetric:
        assert float(Q.to_numpy(qt.scale)[0].ravel()[0]) == 3.5
        assert float(Q.to_numpy(qt.zero_point)[0].ravel()[0]) == 0
    assert Q.check_quantizer(impl, x, Q.QuantScheme(8, symmetric)).valid


@pytest.mark.parametrize("scheme", [Q.QuantScheme(8), Q.QuantScheme(4, False),
                                    Q.QuantScheme(2, False, "token")])
def test_all_zero_channel_gives_zeros_not_nan(impl, scheme):
    x = np.zeros((4, 3), dtype=np.float32)
    qt, x_hat = dequantized(impl, x, scheme)
    assert np.isfinite(Q.to_numpy(qt.scale)[0]).all()
    assert (x_hat == 0).all()


@pytest.mark.parametrize("gran, group, axis, meta", [
    ("channel", None, -1, (1, 4)),  # x (6, 4): one scale per channel
    ("token", None, -1, (6, 1)),  # one per row
    ("group", 2, -1, (6, 2)),  # 4 channels / G=2 per row
    ("channel", None, 0, (1, 6)),  # axis 0 moved last: (4, 6), 6 channels
    ("token", None, 0, (4, 1)),
])
def test_scale_layout(impl, gran, group, axis, meta):
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    qt = impl.quantize(x, Q.QuantScheme(8, False, gran, axis, group))
    assert Q.to_numpy(qt.scale)[0].shape == meta
    assert Q.to_numpy(qt.zero_point)[0].shape == meta


def test_group_scales_follow_their_channels():
    x = np.array([[1.0, 2.0, 100.0, 200.0]])
    qt = Q.quantize(x, Q.QuantScheme(8, True, "group", group_size=2))
    # groups (1, 2) and (100, 200): scales 2/127 and 200/127
    np.testing.assert_allclose(qt.scale.ravel(), [2 / 127, 200 / 127], rtol=1e-15)


# --- packing ----------------------------------------------------------------------------------

def test_pack_4_bit_two_per_byte_first_code_low():
    # -8 & 15 = 0x8 | 7 << 4 = 0x70 -> 0x78; -1 & 15 = 0xF, 0 -> 0x0F
    assert Q.pack_bits([-8, 7, -1, 0], 4).tolist() == [0x78, 0x0F]
    # odd count: the last byte's high nibble is padding
    assert Q.pack_bits([1, -1, 3], 4).tolist() == [0xF1, 0x03]


def test_pack_2_bit_four_per_byte():
    # -2 & 3 = 2, 1 << 2 = 4, (-1 & 3) << 4 = 48, 0 << 6 = 0 -> 54
    assert Q.pack_bits([-2, 1, -1, 0], 2).tolist() == [54]


@pytest.mark.parametrize("slot", [2, 4])
def test_unpack_sign_extends_every_code(slot):
    codes = np.arange(-(2 ** (slot - 1)), 2 ** (slot - 1), dtype=np.int8)
    codes = np.concatenate([codes, codes[::-1]])
    packed = Q.pack_bits(codes, slot)
    assert Q.unpack_bits(packed, slot, codes.size).tolist() == codes.tolist()


@pytest.mark.parametrize("slot", [2, 4])
def test_fast_packers_match_the_reference_on_every_byte(slot):
    per = 8 // slot
    every_byte = np.arange(256, dtype=np.uint8)
    codes = Q.unpack_bits(every_byte, slot, 256 * per)
    out = np.empty(256, dtype=np.uint8)
    quant_numpy._pack_into(codes.copy(), slot, out)
    assert out.tolist() == every_byte.tolist()
    back = np.empty(256 * per, dtype=np.int8)
    quant_numpy._unpack_into(every_byte, slot, back)
    assert back.tolist() == codes.tolist()


@pytest.mark.parametrize("slot", [2, 4])
def test_torch_packers_match_the_reference_on_every_byte(slot):
    torch = pytest.importorskip("torch")
    from impls import quant_torch

    per = 8 // slot
    every_byte = np.arange(256, dtype=np.uint8)
    codes = Q.unpack_bits(every_byte, slot, 256 * per)
    packed = quant_torch._pack(torch.from_numpy(codes.copy()), slot, per)
    assert packed.tolist() == every_byte.tolist()
    assert quant_torch._unpack(torch.from_numpy(every_byte), slot, 256 * per).tolist() == codes.tolist()


# --- statistics -------------------------------------------------------------------------------

def test_error_statistics():
    qt = Q.quantize(np.zeros((1, 4)), Q.QuantScheme(8))
    stats = Q.error_stats(np.array([[0.0, 1, 2, 3]]), np.array([[0.0, 1, 2, 5]]), qt)
    # errors 0, 0, 0, 2: max 2, mean 2/4, rmse sqrt(4/4)
    assert (stats.max_abs_error, stats.mean_abs_error, stats.rmse) == (2.0, 0.5, 1.0)
    assert stats.mean_abs_error <= stats.rmse <= stats.max_abs_error


@pytest.mark.parametrize("shape, dtype, scheme, ratio", [
    # 64*128*4 = 32768 B over 8192 codes + 128 float32 scales: 32768 / (8192 + 512)
    ((64, 128), np.float32, Q.QuantScheme(8), 32768 / 8704),
    # 4-bit packed: 4096 B; 64 rows * 4 groups * (scale 4 + zero point 4) = 2048 B
    ((64, 128), np.float32, Q.QuantScheme(4, False, "group", group_size=32), 32768 / 6144),
    # float16: 16384 B; 2-bit: 2048 B; 64 tokens * 8 B = 512 B
    ((64, 128), np.float16, Q.QuantScheme(2, False, "token"), 16384 / 2560),
    # 3-bit codes take a nibble: 4096 B; 128 channels * 8 B = 1024 B
    ((64, 128), np.float32, Q.QuantScheme(3, False), 32768 / 5120),
])
def test_compression_ratio_counts_every_scale_and_zero_point(impl, shape, dtype, scheme, ratio):
    if impl is Q:
        pytest.skip("the float64 reference stores 8-byte scales, not a storage format")
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    qt = impl.quantize(x, scheme)
    stats = impl.error_stats(x, impl.dequantize(qt), qt)
    assert stats.compression_ratio == pytest.approx(ratio, rel=1e-12)
    assert Q.expected_compression_ratio(shape, np.dtype(dtype).name, scheme, scheme.packed, 4, 4)[0] == \
        pytest.approx(ratio, rel=1e-12)


def test_rmse_ratio_is_near_one_on_spread_data(impl):
    x = np.random.default_rng(1).uniform(-1, 1, (4096, 4)).astype(np.float32)
    verdict = Q.check_quantizer(impl, x, Q.QuantScheme(6))
    assert verdict.valid, verdict.explain()
    # uniform rounding error: rmse = scale / sqrt(12)
    assert verdict.rmse_ratio["groups"] == 4
    assert 0.9 <= verdict.rmse_ratio["median"] <= 1.1


def test_rmse_ratio_is_skipped_where_meaningless():
    x = np.random.default_rng(1).uniform(-1, 1, (64, 4))
    verdict = Q.check_quantizer(Q, x, Q.QuantScheme(2))
    assert verdict.rmse_ratio is None
    assert any("needs 3+ bits and 128+ elements" in n for n in verdict.notes)


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused_naming_the_element(impl, bad):
    x = np.ones((3, 4), dtype=np.float32)
    x[1, 2] = bad
    with pytest.raises(ValueError, match=r"x\[1, 2\] = .* is not finite"):
        impl.quantize(x, Q.QuantScheme(8))
    verdict = Q.check_quantizer(impl, x, Q.QuantScheme(8))
    assert verdict.valid and "refused as required" in verdict.notes[0]


def test_non_float_input_and_bad_axes_are_refused(impl):
    with pytest.raises(TypeError, match="must be float16, bfloat16, float32 or float64"):
        impl.quantize(np.ones((2, 2), dtype=np.int32), Q.QuantScheme(8))
    with pytest.raises(ValueError, match="0-d"):
        impl.quantize(np.float32(1.0), Q.QuantScheme(8))
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        impl.quantize(np.ones((2, 2), dtype=np.float32), Q.QuantScheme(8, axis=2))
    with pytest.raises(ValueError, match="group_size 3 does not divide the 4 channels"):
        impl.quantize(np.ones((2, 4), dtype=np.float32), Q.QuantScheme(8, granularity="group", group_size=3))


@pytest.mark.parametrize("shape", [(0, 8), (5, 0), (0,), (2, 0, 3)])
@pytest.mark.parametrize("scheme", [Q.QuantScheme(8), Q.QuantScheme(4, False, "token"),
                                    Q.QuantScheme(2, False, "group", group_size=1)])
def test_empty_tensors(impl, shape, scheme):
    x = np.zeros(shape, dtype=np.float32)
    verdict = Q.check_quantizer(impl, x, scheme)
    assert verdict.valid, verdict.explain()
    assert (verdict.stats.max_abs_error, verdict.stats.rmse) == (0.0, 0.0)


def test_one_element_channels_are_constant_channels(impl):
    x = np.array([3.0, -7.5, 0.0, 1e-3, 250.0], dtype=np.float32)  # 1-D: five channels of one row
    for symmetric in (True, False):
        qt, x_hat = dequantized(impl, x, Q.QuantScheme(8, symmetric))
        np.testing.assert_allclose(x_hat, x, rtol=4 * 2.0**-24)
        assert Q.check_quantizer(impl, x, Q.QuantScheme(8, symmetric)).valid


@pytest.mark.parametrize("lo, hi", [(10.0, 20.0), (-20.0, -10.0), (1000.0, 1000.5), (-3.0, 5.0)])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_channels_that_miss_zero(impl, lo, hi, bits):
    x = np.random.default_rng(2).uniform(lo, hi, (200, 3)).astype(np.float32)
    scheme = Q.QuantScheme(bits, symmetric=False)
    verdict = Q.check_quantizer(impl, x, scheme)
    assert verdict.valid, verdict.explain()
    # every element within scale/2 (+ rounding) of itself: (hi - lo) / (2^bits - 1) / 2
    assert verdict.stats.max_abs_error <= (hi - lo) / (2**bits - 1) / 2 * (1 + 1e-5) + 4e-7 * abs(hi)


def test_float16_range_that_overflows_float16_arithmetic(impl):
    # hi - lo = 65504 - (-65504) = 131008 > 65504: inf if computed in float16
    x = np.array([[65504, 65504], [-65504, 65000], [1, 60000], [0, 65504]], dtype=np.float16)
    for scheme in (Q.QuantScheme(8), Q.QuantScheme(8, False), Q.QuantScheme(4, False, "token")):
        qt, x_hat = dequantized(impl, x, scheme)
        assert np.isfinite(x_hat).all()
        verdict = Q.check_quantizer(impl, x, scheme)
        assert verdict.valid, verdict.explain()


def test_float16_subnormals(impl):
    tiny = 2.0**-24  # the smallest float16 subnormal
    x = (np.array([[1, 3, 1000, -512], [2, 7, 1023, 5]]) * tiny).astype(np.float16)
    for scheme in (Q.QuantScheme(8), Q.QuantScheme(8, False), Q.QuantScheme(3, False, "token")):
        verdict = Q.check_quantizer(impl, x, scheme)
        assert verdict.valid, verdict.explain()


@pytest.mark.parametrize("view", ["rows", "transpose", "reversed", "swapaxes"])
def test_non_contiguous_inputs_give_the_codes_of_their_copy(impl, view):
    base = np.random.default_rng(3).standard_normal((12, 10, 8)).astype(np.float32)
    x = {"rows": base[::2, ::3], "transpose": base.T, "reversed": base[::-1, :, ::-1],
         "swapaxes": np.swapaxes(base, 0, 1)}[view]
    assert not x.flags.c_contiguous
    for scheme in (Q.QuantScheme(8, axis=0), Q.QuantScheme(4, False, "group", -1, 2)):
        verdict = Q.check_quantizer(impl, x, scheme)
        assert verdict.valid, verdict.explain()
        got = Q.to_numpy(impl.quantize(x, scheme).codes)[0]
        want = Q.to_numpy(impl.quantize(np.ascontiguousarray(x), scheme).codes)[0]
        assert np.array_equal(got, want)


def test_external_scale_saturates(impl):
    x = np.array([[0.0], [0.25], [0.5], [2.0], [-3.0]], dtype=np.float32)
    # scale 1/254: codes reach +-127 at +-0.5; 2.0 and -3.0 saturate there
    qt = impl.quantize(x, Q.QuantScheme(8), scale=1 / 254)
    x_hat = Q.to_numpy(impl.dequantize(qt))[0].ravel()
    np.testing.assert_allclose(x_hat, [0.0, 0.25, 0.5, 0.5, -0.5], atol=1 / 508)
    assert Q.check_quantizer(impl, x, Q.QuantScheme(8), scale=1 / 254).valid


def test_numpy_out_buffers_are_reused():
    x = np.random.default_rng(4).standard_normal((64, 32)).astype(np.float32)
    scheme = Q.QuantScheme(4, False, "group", group_size=8)
    qt = quant_numpy.quantize(x, scheme)
    again = quant_numpy.quantize(2 * x, scheme, out=qt)
    assert again.codes is qt.codes and again.scale is qt.scale
    out = np.empty_like(x)
    assert quant_numpy.dequantize(again, out=out) is out
    assert Q.check_quantization(2 * x, again, out).valid
    with pytest.raises(ValueError, match="out: expected"):
        quant_numpy.quantize(x[:32], scheme, out=qt)


@pytest.mark.parametrize("chunk", [4, 24, 64])
@pytest.mark.parametrize("scheme", [Q.QuantScheme(8), Q.QuantScheme(3, False, "token"),
                                    Q.QuantScheme(2, True, "group", group_size=5)])
def test_numpy_chunking_does_not_change_the_result(chunk, scheme):
    # rows of 35 channels: tiles of whole rows (35 <= chunk) or split rows (35 > chunk)
    x = np.random.default_rng(5).standard_normal((9, 35)).astype(np.float32)
    small = quant_numpy.quantize(x, scheme, chunk=chunk)
    whole = quant_numpy.quantize(x, scheme)
    assert np.array_equal(small.codes, whole.codes) and np.array_equal(small.scale, whole.scale)
    np.testing.assert_array_equal(quant_numpy.dequantize(small, chunk=chunk), quant_numpy.dequantize(whole))


# --- torch specifics --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_torch_dtypes(dtype):
    torch = pytest.importorskip("torch")
    T = torch_impl()
    x = (torch.randn(256, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4 + 1)
    x = x.to(getattr(torch, dtype))
    for scheme in (Q.QuantScheme(8), Q.QuantScheme(4, False, "token"), Q.QuantScheme(2, False, "group", -1, 4)):
        verdict = Q.check_quantizer(T, x, scheme)
        assert verdict.valid, verdict.explain()
        assert T.dequantize(T.quantize(x, scheme)).dtype == x.dtype


def test_torch_refuses_a_narrower_output_it_cannot_round_once():
    torch = pytest.importorskip("torch")
    T = torch_impl()
    qt = T.quantize(torch.randn(8, 4), Q.QuantScheme(8))
    with pytest.raises(ValueError, match="narrower than the float32 arithmetic"):
        T.dequantize(qt, torch.float16)


def test_torch_available_says_why_not():
    T = torch_impl()
    ok, why = T.available("cuda")
    import torch

    assert ok == torch.cuda.is_available()
    assert ok or "CUDA" in why


# --- fp8 e4m3 ---------------------------------------------------------------------------------

def test_fp8_reference_rounding():
    got = Q.fp8_e4m3_round([0.3, 448, 500, -1000, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 1.9375, 0.0])
    # 0.3 = 1.2 * 2^-2 -> 1.25 * 2^-2 = 0.3125 (mantissa steps of 1/8); 448 = 1.75 * 2^8 is the
    # largest; past it saturates; 2^-9 is the smallest subnormal; 2^-10 is a tie -> 0 (even);
    # 3 * 2^-10 -> 2 * 2^-9 (tie to even); 1.9375 -> 2.0 (carry into the next binade)
    assert got.tolist() == [0.3125, 448, 448, -448, 2.0**-9, 0.0, 2.0**-8, 2.0, 0.0]


def test_fp8_error_bound_is_relative_then_absolute():
    assert Q.fp8_e4m3_error_bound(1.0) == 2.0**-4  # half a mantissa step of 1/8
    assert Q.fp8_e4m3_error_bound(2.0**-8) == 2.0**-10  # subnormal: half of 2^-9


def test_torch_fp8_saturates_at_448_and_meets_the_bound():
    torch = pytest.importorskip("torch")
    T = torch_impl()
    x = torch.tensor([0.0, 0.3, -1.7, 447.0, 448.0, 500.0, -1e4, 2.0**-9, 1e-5])
    ft = T.quantize_fp8(x)
    assert ft.codes.dtype == torch.float8_e4m3fn
    assert T.dequantize_fp8(ft)[[4, 5, 6]].tolist() == [448.0, 448.0, -448.0]
    for data, scale in ((x, 1.0), (x.half(), 0.5), (torch.randn(1000) * 1e3, 1e3 / 448)):
        verdict = Q.check_fp8_quantizer(T, data, scale)
        assert verdict.valid, verdict.explain()
    bad = x.clone()
    bad[2] = float("nan")
    with pytest.raises(ValueError, match=r"x\[2\] = nan is not finite"):
        T.quantize_fp8(bad)


# --- capacity ---------------------------------------------------------------------------------

def test_capacity_table_counts_metadata_per_block():
    model = get_model("llama-2-7b")  # 32 layers, 32 KV heads, head 128, fp16: 512 KiB per token
    table = Q.capacity_table(model, 2**30, block_size=16).set_index("format")
    # fp16: 2 * 32 * 32 * 128 * 2 = 524288 B per token; 1 GiB / (16 * 524288) = 128 blocks
    assert table.loc["fp16", "tokens"] == 128 * 16
    # int8 per token: codes 16 * 2 * 32*32*128 = 4194304 B + scales 2 * 32*32*16 * 4 = 131072 B
    assert table.loc["int8-token-sym", "block_bytes"] == 4325376
    assert table.loc["int8-token-sym", "blocks"] == 2**30 // 4325376 == 248
    # fp8: 4194304 B per block, and 2 * 32 per-layer float32 scales = 256 B once: 255 blocks
    assert table.loc["fp8-e4m3", "blocks"] == (2**30 - 256) // 4194304 == 255
    # KIVI int4: keys per channel over the block's 16 tokens: 32*32*128 scale+zero (8 B) =
    # 1048576 B, as much as their codes (32*32*128*16 / 2); values per token 32*32*16 * 8 B
    assert table.loc["int4-kivi", "block_bytes"] == 1048576 + 1048576 + 1048576 + 131072
    assert table.loc["int4-kivi", "tokens"] == 2**30 // 3276800 * 16 == 5232


def test_capacity_table_measures_error_on_a_sample():
    model = get_model("tiny")
    sample = kv_values(writer=1, start=0, count=64, model=model)  # float16 integers in [-1001, 1001]
    table = Q.capacity_table(model, 2**20, sample, block_size=16, group_size=4).set_index("format")
    assert table.loc["fp16", "key_rmse"] == 0.0  # the sample is exact in float16
    assert table.loc["int8-kivi", "key_rmse"] < table.loc["int4-kivi", "key_rmse"] < table.loc["int2-kivi", "key_rmse"]
    assert table.loc["int8-token-sym", "value_max_abs_error"] <= 1001 / 127 / 2  # scale / 2 at most
    with pytest.raises(ValueError, match="kv_sample must be"):
        Q.capacity_table(model, 2**20, sample[:, 0])
