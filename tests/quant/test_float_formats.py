"""SPEC §12's float KV formats: e4m3 and e2m1 rounding, NVFP4's two-level scale, check_nvfp4,
the pools that store real fp8 / NVFP4 codes (impls/numpy_float_paged.py), their bytes, and
the checker's hold on what they read back."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from impls import faults
from impls.numpy_float_paged import (
    E2M1,
    E2M1_VALUES,
    E4M3,
    E4M3_VALUES,
    NumpyFp8Tensor,
    NumpyFp8TokenHead,
    NumpyNvfp4,
    encode,
)
from kvbench import quant as Q
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.quant import pool

# --- e2m1 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("y, want", [
    (0.25, 0.0),  # 0.25 rounds to 0 or 0.5: RNE picks 0 (even mantissa)
    (0.75, 1.0),  # 0.75 rounds to 0.5 or 1.0: RNE picks 1.0 (0.5 is mantissa 1, odd)
    (1.25, 1.0),  # 1.0 = 1.0 * 2^0 (mantissa 0) beats 1.5 (mantissa 1)
    (1.75, 2.0),  # 1.5 (mantissa 1) or 2.0 (mantissa 0)
    (2.5, 2.0),  # step 1 in [2, 4): 2 (mantissa 0) or 3 (mantissa 1)
    (3.5, 4.0),  # 3 (mantissa 1) or 4 (mantissa 0)
    (5.0, 4.0),  # step 2 in [4, 6]: 4 (mantissa 0) or 6 (mantissa 1)
    (5.1, 6.0), (0.3, 0.5), (2.9, 3.0),
    (7.0, 6.0), (1e9, 6.0),  # saturation at 6 = 1.5 * 2^2
    (-0.75, -1.0), (-7.0, -6.0), (-0.2, 0.0),
    (0.0, 0.0),
])
def test_e2m1_rounds_to_nearest_even(y, want):
    assert Q.e2m1_round(y) == want


def test_every_e2m1_value_rounds_to_itself_and_the_half_ulp_bound_holds():
    values = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert np.array_equal(Q.e2m1_round(values), values)
    assert np.array_equal(Q.e2m1_round(-values), -values)
    y = np.linspace(-6, 6, 4801)
    err = np.abs(Q.e2m1_round(y) - y)
    assert (err <= Q.e2m1_error_bound(y)).all()
    # the half ulps: 0.5 / 2 below 2, 1 / 2 in [2, 4), 2 / 2 in [4, 6]
    assert Q.e2m1_error_bound([1.9, 2, 3.9, 4, 6]).tolist() == [0.25, 0.5, 0.5, 1.0, 1.0]


# --- e4m3 (the reference's, reused) ---------------------------------------------------------


@pytest.mark.parametrize("y, want", [
    (2.0**-9, 2.0**-9),  # the smallest subnormal: 1 * 2^-6 * 2^-3
    (2.0**-10, 0.0),  # halfway between 0 and 2^-9: 0 (even)
    (1.5 * 2.0**-9, 2.0**-8),  # between 1 * 2^-9 (odd) and 2 * 2^-9 (even)
    (7 * 2.0**-9, 7 * 2.0**-9),  # the largest subnormal
    (2.0**-6, 2.0**-6),  # the smallest normal
    (1.0625, 1.0),  # 1 + 1/16, halfway between 1 (mantissa 000) and 1.125 (001)
    (1.1875, 1.25),  # 1 + 3/16, between 1.125 (001) and 1.25 (010)
    (464.0, 448.0), (1000.0, 448.0),  # 448 = 1.75 * 2^8, the largest finite; beyond saturates
    (-1.0625, -1.0), (-1000.0, -448.0), (0.0, 0.0),
])
def test_e4m3_rounds_to_nearest_even(y, want):
    assert Q.fp8_e4m3_round(y) == want


def _float32_around_every_midpoint(mags: np.ndarray) -> np.ndarray:
    """Every value, every midpoint between neighbours (exact in float32) and the float32 either
    side of it, past the top too, both signs."""
    mid = ((mags[1:] + mags[:-1]) / 2).astype(np.float32)
    top = np.float32(mags[-1] + (mags[-1] - mags[-2]) / 2)  # the tie above the largest value
    y = np.concatenate([mags.astype(np.float32), mid, [top, np.float32(mags[-1] * 1e6)]])
    y = np.concatenate([y, np.nextafter(y, np.float32(0)), np.nextafter(y, np.float32(np.inf))])
    return np.concatenate([y, -y])


def _float32_sweep(top: float) -> np.ndarray:
    """Every float32 in [0, top] whose low 9 mantissa bits are 0 (16384 a binade, subnormals
    included), both signs: a dense sweep between the midpoints."""
    bits = np.arange(0, np.float32(top).view(np.uint32) + 1, 1 << 9, dtype=np.uint32)
    y = bits.view(np.float32)
    return np.concatenate([y, -y])


@pytest.mark.parametrize("fmt, mags, sign_bit", [
    (ml_dtypes.float8_e4m3fn, E4M3, 0x80),
    (ml_dtypes.float4_e2m1fn, E2M1, 0x8),
])
def test_the_pools_rounding_is_ml_dtypes_at_every_midpoint_and_between(fmt, mags, sign_bit):
    # The pool's table look-up against ml_dtypes' cast (round to nearest even): the same code byte
    # (sign of zero included) for every float32 where the rounding decides, and a dense sweep.
    # ml_dtypes makes e4m3fn NaN past 464, where SPEC §12 saturates: the clip stands for that.
    y = np.concatenate([_float32_around_every_midpoint(mags), _float32_sweep(2 * mags[-1])])
    want = np.clip(y, -mags[-1], mags[-1]).astype(fmt).view(np.uint8)
    got = encode(y.astype(np.float64), mags, sign_bit)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{fmt.__name__}: y = {y[bad[:5]]}: pool codes {got[bad[:5]]}, ml_dtypes {want[bad[:5]]}"
    assert y.size > 4_000_000  # the sweep ran: 16384 a binade over some 130 binades, both signs


def test_the_reference_rounds_a_float64_once():
    # 1.0625 + 2^-40 is a hair above the e4m3 tie 1 + 1/16 between 1 and 1.125: it rounds up to
    # 1.125. Through float32 first it would become the tie itself and round to 1 (even).
    assert Q.fp8_e4m3_round(1.0625 + 2.0**-40) == 1.125
    # e2m1: 0.25 + 2^-40 is above the tie 0.25 between 0 and 0.5: 0.5
    assert Q.e2m1_round(0.25 + 2.0**-40) == 0.5
    assert Q.fp8_e4m3_round(464 + 2.0**-40) == 448  # past 464 ml_dtypes alone gives NaN


def test_every_code_decodes_within_range():
    # e4m3fn: 0x7F and 0xFF are NaN, every other code finite and at most 448; e2m1: 16 codes.
    finite = E4M3_VALUES[np.isfinite(E4M3_VALUES)]
    assert len(finite) == 254 and np.abs(finite).max() == 448
    assert np.isnan(E4M3_VALUES[[0x7F, 0xFF]]).all()
    assert sorted(set(np.abs(E2M1_VALUES).tolist())) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert E4M3_VALUES[0x38] == 1.0  # 0 0111 000: 2^(7 - 7)
    assert E4M3_VALUES[0x01] == 2.0**-9  # 0 0000 001: subnormal 1/8 * 2^-6


# --- NVFP4's two-level scale and check_nvfp4 ------------------------------------------------


def test_nvfp4_scales():
    ts = Q.nvfp4_tensor_scale(1001.0)
    assert ts == np.float32(1001 / 2688)  # 2688 = 448 * 6
    rows = np.zeros((1, 32))
    rows[0, 0], rows[0, 16] = 1001.0, 6 * 3 * ts  # block 0 holds the tensor's amax
    # 448 = 1001 / 6 / (1001 / 2688); block 1: 3 = 6 * 3 * ts / 6 / ts
    assert np.allclose(Q.nvfp4_block_scales(rows, ts), [[448.0, 3.0]], rtol=2**-20)
    x = Q.nvfp4_round(rows, ts)
    assert np.isclose(x[0, 0], 6 * 448 * ts) and np.isclose(x[0, 16], 6 * 3 * ts)
    assert (x[0, 1:16] == 0).all()


def test_nvfp4_block_scales_follow_vllms_recipe():
    # vLLM (ref_nvfp4_quant, cvt_warp_fp16_to_fp4) encodes with global_scale = 448 * 6 / amax and
    # block scale e4m3(min(global_scale * block amax / 6, 448)); kvbench divides by the tensor
    # scale amax / (448 * 6) instead. amax 1001: block amax 1001 -> 2688 / 1001 * 1001 / 6 = 448;
    # block amax 500 -> 2688 / 1001 * 500 / 6 = 223.78, between e4m3's 208 and 224 (step 16 in
    # [128, 256)): 224.
    rows = np.zeros((1, 32))
    rows[0, 3], rows[0, 16] = -1001.0, 500.0
    assert Q.nvfp4_block_scales(rows, Q.nvfp4_tensor_scale(1001.0)).tolist() == [[448.0, 224.0]]


def test_check_nvfp4_accepts_vllms_float32_arithmetic():
    # vLLM's reference quantizer step by step in float32 (its rounding, not kvbench's): the checker
    # must not be narrower than the rule as NVIDIA's and vLLM's code computes it.
    f32 = np.float32
    x = np.random.default_rng(7).integers(-1001, 1002, (8, 64)).astype(f32)
    x[0, 0] = 1001
    g = f32(448 * 6) / f32(1001)  # global_scale
    blocks = x.reshape(8, 4, 16)
    bs = np.minimum(g * (np.abs(blocks).max(axis=-1) * f32(1 / 6)), f32(448))
    bs = bs.astype(ml_dtypes.float8_e4m3fn).astype(f32)
    with np.errstate(divide="ignore"):
        out_scale = np.where(bs > 0, f32(1) / (bs * (f32(1) / g)), f32(0))
    codes = np.clip(blocks * out_scale[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(f32)
    x_hat = (codes * (bs / g)[..., None]).reshape(8, 64)
    t = Q.Nvfp4Tensor(codes.reshape(8, 64), bs, float(f32(1) / g), x.shape, "float32")
    verdict = Q.check_nvfp4(x, t, x_hat, amax=1001.0)
    assert verdict.valid, verdict.first


def _nvfp4(x, amax):
    ts = Q.nvfp4_tensor_scale(amax)
    bs = Q.nvfp4_block_scales(x, ts)
    S = np.repeat(bs, 16, axis=1) * ts
    codes = Q.e2m1_round(np.clip(np.where(S > 0, x / np.where(S > 0, S, 1), 0), -6, 6))
    return Q.Nvfp4Tensor(codes, bs, ts, x.shape, "float32"), codes, bs, ts


def test_check_nvfp4_holds_codes_scales_and_read_back():
    x = np.random.default_rng(1).integers(-1001, 1002, (6, 64)).astype(np.float64)
    t, codes, bs, ts = _nvfp4(x, 1001.0)
    S = np.repeat(bs, 16, axis=1) * ts
    assert Q.check_nvfp4(x, t, (codes * S).astype(np.float32), amax=1001.0).valid
    no_blocks = Q.check_nvfp4(x, t, (codes * ts).astype(np.float32), amax=1001.0)
    assert not no_blocks.valid and no_blocks.first.quantity == "reconstruction"
    no_tensor = Q.check_nvfp4(x, t, (codes * np.repeat(bs, 16, axis=1)).astype(np.float32), amax=1001.0)
    assert not no_tensor.valid
    # truncation toward zero instead of round-to-nearest-even: the codes themselves are wrong
    y = np.clip(x / S, -6, 6)
    trunc = np.sign(y) * np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[
        np.searchsorted([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.abs(y), side="right") - 1]
    bad = Q.check_nvfp4(x, Q.Nvfp4Tensor(trunc, bs, ts, x.shape, "float32"), (trunc * S).astype(np.float32),
                        amax=1001.0)
    assert not bad.valid and bad.first.quantity == "e2m1 code"
    wrong_ts = Q.check_nvfp4(x, Q.Nvfp4Tensor(codes, bs, 1.0, x.shape, "float32"), codes * S, amax=1001.0)
    assert wrong_ts.first.quantity == "tensor scale"


def test_check_nvfp4_zeros_and_negatives():
    x = np.zeros((2, 16))
    x[1] = -np.arange(16)
    t, codes, bs, ts = _nvfp4(x, 15.0)
    assert bs[0, 0] == 0 and (codes[0] == 0).all()  # an all-zero block: scale 0, codes 0
    assert Q.check_nvfp4(x, t, codes * np.repeat(bs, 16, axis=1) * ts, amax=15.0).valid


# --- bytes ----------------------------------------------------------------------------------


def test_row_bytes_of_each_format():
    assert pool.row_bytes("nvfp4", 128) == 72  # 72 = 128/2 + 128/16 bytes per head per token
    assert pool.row_bytes("fp8-token-head", 128) == 132  # 132 = 128 codes + a float32 scale
    assert pool.row_bytes("fp8-tensor", 128) == 128  # the tensor scales live outside the blocks


@pytest.mark.parametrize("cls, want", [
    # tiny: 2 layers, 2 KV heads, head_dim 8, blocks of 16: 16 * 2 * 2 * 2 = 128 rows of 8
    (NumpyFp8Tensor, 1024),  # 1024 = 128 * 8
    (NumpyFp8TokenHead, 1536),  # 1536 = 128 * (8 + 4)
    (NumpyNvfp4, 576),  # 576 = 1024 / 2 + 1024 / 16
])
def test_the_pools_hold_the_formats_real_bytes(cls, want):
    trace = suite.load_traces([suite.WORKLOADS_DIR / "decode-stream.jsonl"])[0]
    cfg = suite.config_for(trace)
    assert cfg.model.name == "tiny" and cfg.block_size == 16
    b = cls(cfg)
    assert pool.block_bytes(b.kv_format, get_model("tiny"), 16) == want
    assert b.block_bytes() == want  # the arrays' bytes, before and after the pool is touched
    assert check(trace, b).valid is True
    assert b.block_bytes() == want


def test_the_default_run_replays_the_float_pools():
    assert {"numpy-fp8", "numpy-fp8-token-head", "numpy-nvfp4"} <= set(registry.DEFAULT_BACKENDS)


# --- the checker's hold on a pool's read-back -----------------------------------------------


@pytest.mark.parametrize("name", pool.FLOAT_FORMATS)
def test_a_read_back_off_by_one_code_is_caught(name):
    x = np.random.default_rng(2).integers(-1001, 1002, (3, 2, 2, 2, 8)).astype(np.float64)
    rows = x.reshape(-1, 16) if name == "nvfp4" else x.reshape(-1, 8)
    want, s = pool.float_read_back(rows, name)
    assert pool.bound_violation(x, want.reshape(x.shape), name) == ""
    bumped = want.copy()
    bumped[0, 0] += s[0, 0] * (2 if name == "nvfp4" else 0.5)  # far more than float rounding
    why = pool.bound_violation(x, bumped.reshape(x.shape), name)
    assert why.startswith("position 0, row 0, channel 0: read back")


@pytest.mark.parametrize("fault, detail", [
    # decode-stream's first prefill: sequence 0 writes (3 mod 2003) - 1001 = -998 at position 0,
    # channel 0; its block's amax is 1001: scale 448 * 1001/2688 and -998 / that = -5.98 -> -6,
    # so NVFP4 gives -6 * 448 * 1001 / 2688 = -1001.
    (faults.Nvfp4BlockScalesDropped, "nvfp4 gives -1001.00003"),
    (faults.Nvfp4TensorScaleDropped, "nvfp4 gives -1001.00003"),
    # fp8 per tensor: scale 1001/448 in float32, -998 / scale = -446.7 -> -448 (step 32 above 256)
    (faults.Fp8DividedByScale, "fp8-tensor gives -1001"),
])
def test_each_float_format_fault_fails_at_the_first_prefill(fault, detail):
    trace = suite.load_traces([suite.WORKLOADS_DIR / "decode-stream.jsonl"])[0]
    v = check(trace, fault(suite.config_for(trace)))
    d = v.divergence
    assert v.valid is False and (d.step, d.quantity) == (0, "kv of sequence 0"), str(d)
    assert d.detail.startswith("position 0, row 0, channel 0: read back") and detail in d.detail, d.detail


def test_the_capacity_table_counts_nvfp4s_real_bytes():
    model = get_model("llama-2-7b")  # 32 layers, 32 KV heads, head 128
    table = Q.capacity_table(model, 2**30, block_size=16).set_index("format")
    # per K (V) and block: 32 * 32 * 128 * 16 = 2097152 elements: 2097152 / 2 = 1048576 B of
    # codes + 2097152 / 16 = 131072 B of e4m3 scales; twice that for K and V
    assert table.loc["nvfp4", "block_bytes"] == 2 * (1048576 + 131072) == 2359296
    assert table.loc["nvfp4", "metadata_fraction"] == 2 * 131072 / 2359296
    # 2 * 32 per-layer float32 tensor scales = 256 B once: (2^30 - 256) // 2359296 = 455 blocks
    assert table.loc["nvfp4", "blocks"] == (2**30 - 256) // 2359296 == 455


def test_the_capacity_table_measures_nvfp4s_error():
    from kvbench.contract.protocol import kv_tokens
    model = get_model("tiny")
    sample = kv_tokens(np.ones(64), np.arange(64), model)  # float16 integers in [-1001, 1001]
    table = Q.capacity_table(model, 2**20, sample, block_size=16, group_size=4).set_index("format")
    # half an e2m1 ulp at most, at its largest (1 in [4, 6]) times the largest scale, 448 * ts
    assert 0 < table.loc["nvfp4", "key_max_abs_error"] <= 448 * Q.nvfp4_tensor_scale(1001.0)
    assert table.loc["fp8-e4m3", "key_rmse"] < table.loc["nvfp4", "key_rmse"]


@pytest.mark.parametrize("cls", [NumpyFp8Tensor, NumpyFp8TokenHead, NumpyNvfp4])
def test_the_pools_bytes_without_kv_arrays(cls):
    from conftest import make_config
    b = cls(make_config(store_kv=False))  # no arrays: the bytes come off their shapes
    assert b.config.kv_format == cls.kv_format
    assert b.block_bytes() == pool.block_bytes(cls.kv_format, b.config.model, b.config.block_size)


@pytest.mark.parametrize("cls", [NumpyFp8TokenHead, NumpyNvfp4])
def test_copy_on_write_without_the_scales_is_caught(cls):
    from conftest import A, K, P, X, make_config, make_trace

    class CowCodesOnly(cls):
        def _copy_blocks(self, src, dst):
            kept, self.scale = self.scale, None  # the codes move, the scales stay behind
            try:
                super()._copy_blocks(src, dst)
            finally:
                self.scale = kept

    # Sequence 0 writes 20 tokens (a full block of 16 and 4 in its tail); its fork 1 appends 3:
    # the shared tail is copied, and position 16 of sequence 1 reads the copy's (zero) scales.
    trace = make_trace(P(0, 20), K(1, 0), A((1, 3), (0, 2)), A((0, 1), (1, 1)), X(0), X(1), name="fork-cow")
    assert check(trace, cls(make_config())).valid is True
    v = check(trace, CowCodesOnly(make_config()))
    assert v.valid is False and v.divergence.quantity == "kv of sequence 1", str(v.divergence)
    assert v.divergence.detail.startswith("position 16,"), v.divergence.detail


@pytest.mark.parametrize("name, dropped", [
    ("nvfp4", 576 - 512),  # the e4m3 block scales: 1024 / 16 = 64 bytes of the 576
    ("fp8-token-head", 1536 - 1024),  # the float32 row scales: 128 rows * 4
])
def test_a_bytes_formula_without_the_scales_fails_at_the_first_prefill(monkeypatch, name, dropped):
    # The ledger's bytes are read off the pool's arrays: a formula that forgets the scales is off.
    real = pool.block_bytes
    monkeypatch.setattr(pool, "block_bytes", lambda n, m, b: real(n, m, b) - (dropped if n == name else 0))
    trace = suite.load_traces([suite.WORKLOADS_DIR / "decode-stream.jsonl"])[0]
    cls = NumpyNvfp4 if name == "nvfp4" else NumpyFp8TokenHead
    d = check(trace, cls(suite.config_for(trace))).divergence
    assert (d.step, d.quantity, d.actual - d.expected) == (0, "bytes_in_use", dropped), str(d)
