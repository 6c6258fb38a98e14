"""The checker of SPEC §12's float formats: fp8 (e4m3) with a per-tensor scale, and NVFP4 (e2m1
codes, an e4m3 scale per 16 elements, a float32 tensor scale), held to the format's own rounding."""
from __future__ import annotations

import math

import numpy as np

from kvbench.quant.check import QuantFailure, QuantVerdict, _Failures
from kvbench.quant.layouts import SMALLEST_SUBNORMAL, UNIT_ROUNDOFF, raise_non_finite, to_numpy
from kvbench.quant.reference import (
    E2M1_MAX,
    FP8_E4M3_MAX,
    NVFP4_BLOCK,
    Fp8Tensor,
    Nvfp4Tensor,
    e2m1_error_bound,
    e2m1_round,
    fp8_e4m3_error_bound,
    fp8_e4m3_round,
    nvfp4_block_scales,
)
from kvbench.quant.stats import QuantStats


def check_fp8(x, t: Fp8Tensor, x_hat) -> QuantVerdict:
    """e4m3: codes are e4m3 values; |x/scale| >= 448 saturates to +-448; otherwise the code is
    within half a quantum of x/scale, and x_hat within scale times that plus float rounding."""
    fails = _Failures()
    xa, _ = to_numpy(x)
    codes, _ = to_numpy(t.codes)
    xh, out_dtype = to_numpy(x_hat)
    if codes.shape != xa.shape or xh.shape != xa.shape:
        fails.add("shape", None, xa.shape, (codes.shape, xh.shape))
        return QuantVerdict(False, tuple(fails.items.values()), scheme="fp8-e4m3")
    u = UNIT_ROUNDOFF[t.compute_dtype]
    u_out, eta_out = UNIT_ROUNDOFF[out_dtype], SMALLEST_SUBNORMAL[out_dtype]
    X, Cd, XH = (a.astype(np.float64).ravel() for a in (xa, codes, xh))
    s = float(t.scale)
    idx = lambda k: tuple(int(i) for i in np.unravel_index(k, xa.shape))  # noqa: E731
    if not (math.isfinite(s) and s > 0):
        fails.add("scale", None, "positive finite", s)
        return QuantVerdict(False, tuple(fails.items.values()), scheme="fp8-e4m3")
    finite = np.isfinite(Cd)
    fails.first_bad("fp8 code", ~finite | (np.abs(np.where(finite, Cd, 0)) > FP8_E4M3_MAX), "finite, |code| <= 448",
                    Cd, idx)
    cd = np.where(finite, Cd, 0.0)
    fails.first_bad("fp8 code", fp8_e4m3_round(np.clip(cd, -FP8_E4M3_MAX, FP8_E4M3_MAX)) != cd,
                    "an e4m3 value", Cd, idx)
    y = X / s
    y_sat = np.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    sat = np.abs(y) >= FP8_E4M3_MAX
    fails.first_bad("saturation", sat & (Cd != np.sign(y) * FP8_E4M3_MAX), np.sign(y) * FP8_E4M3_MAX, Cd, idx,
                    "|x/scale| >= 448 saturates to +-448")
    code_tol = fp8_e4m3_error_bound(y_sat) + 2 * u * np.abs(y)
    fails.first_bad("fp8 code", ~(np.abs(Cd - y_sat) <= code_tol), y_sat, Cd, idx, "x/scale rounded to e4m3")
    fails.first_bad("non-finite output", ~np.isfinite(XH), "finite", XH, idx)
    bound = s * fp8_e4m3_error_bound(y_sat) + 2 * u * np.abs(X) + u_out * np.abs(XH) + eta_out / 2
    err = np.abs(XH - s * y_sat)
    fails.first_bad("reconstruction", ~(err <= bound), s * y_sat, XH, idx,
                    lambda k: f"|x_sat - x_hat| = {err[k]:.6g} > bound {bound[k]:.6g}")
    e = np.abs(X - XH)
    stats = QuantStats(float(e.max()) if e.size else 0.0, float(e.mean()) if e.size else 0.0,
                       float(np.sqrt(np.mean(e * e))) if e.size else 0.0,
                       (xa.size * xa.dtype.itemsize) / (xa.size + 4) if xa.size else 1.0,
                       int(xa.nbytes), int(xa.size + 4))
    return QuantVerdict(not fails.items, tuple(fails.items.values()), stats, scheme="fp8-e4m3")


def check_fp8_quantizer(impl, x, scale: float = 1.0) -> QuantVerdict:
    try:
        xa, _ = to_numpy(x)
        if xa.size and not np.isfinite(xa.astype(np.float64)).all():
            raise_non_finite(xa)
        refusal = None
    except ValueError as e:
        refusal = e
    try:
        t = impl.quantize_fp8(x, scale=scale)
    except (ValueError, TypeError) as e:
        if refusal is not None:
            return QuantVerdict(True, notes=(f"refused as required: {e}",), scheme="fp8-e4m3")
        return QuantVerdict(False, (QuantFailure("quantize", None, "a result", repr(e)),), scheme="fp8-e4m3")
    if refusal is not None:
        return QuantVerdict(False, (QuantFailure("refusal", None, f"an error ({refusal})", "accepted"),),
                            scheme="fp8-e4m3")
    return check_fp8(x, t, impl.dequantize_fp8(t))


def check_nvfp4(x, t: Nvfp4Tensor, x_hat, *, amax: float | None = None) -> QuantVerdict:
    """NVFP4 (SPEC §12): rows ``(R, C)`` in blocks of 16. The tensor scale is amax / (448 * 6)
    (``amax``: a calibrated one, else max |x|), each block scale is e4m3(block amax / 6 / tensor
    scale), each code is e2m1(x / (block scale * tensor scale)) to nearest even, and x_hat is
    code * block scale * tensor scale: within half an e2m1 ulp of x at that magnitude, times
    the scale, plus float rounding."""
    fails = _Failures()
    xa, _ = to_numpy(x)
    xh, out_dtype = to_numpy(x_hat)
    codes, _ = to_numpy(t.codes)
    bs, _ = to_numpy(t.block_scale)
    scheme = "nvfp4"
    R, C = (xa.shape + (0,))[:2] if xa.ndim == 2 else (0, -1)
    if C % NVFP4_BLOCK or codes.shape != xa.shape or xh.shape != xa.shape or \
            bs.shape != (R, C // NVFP4_BLOCK):
        fails.add("shape", None, f"(R, C) rows, C a multiple of {NVFP4_BLOCK}, codes and x_hat "
                  f"alike, one block scale per {NVFP4_BLOCK}", (xa.shape, codes.shape, bs.shape, xh.shape))
        return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme)
    u = UNIT_ROUNDOFF[t.compute_dtype]
    u_out, eta_out = UNIT_ROUNDOFF[out_dtype], SMALLEST_SUBNORMAL[out_dtype]
    X, Cd, XH, BS = (a.astype(np.float64) for a in (xa, codes, xh, bs))
    amax = float(np.abs(X).max(initial=0.0)) if amax is None else float(amax)
    ts_ref = float(np.float32(amax / (FP8_E4M3_MAX * E2M1_MAX))) if amax > 0 else 1.0
    ts = float(t.tensor_scale)
    idx = lambda k: tuple(int(i) for i in np.unravel_index(k, xa.shape))  # noqa: E731
    bidx = lambda k: tuple(int(i) for i in np.unravel_index(k, BS.shape))  # noqa: E731
    if not (math.isfinite(ts) and abs(ts - ts_ref) <= u * ts_ref):
        fails.add("tensor scale", None, ts_ref, ts, f"amax {amax:.6g} / (448 * 6), float32")
        return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme)
    # A block amax whose amax / 6 / scale sits within float rounding of an e4m3 tie may go either way.
    lo, mid, hi = (nvfp4_block_scales(X * f, ts) for f in (1 - 4 * u, 1.0, 1 + 4 * u))
    fails.first_bad("block scale", (BS != mid) & (BS != lo) & (BS != hi), mid, BS, bidx,
                    "e4m3(block amax / 6 / tensor scale), nearest even")
    fails.first_bad("e2m1 code", (e2m1_round(np.clip(Cd, -E2M1_MAX, E2M1_MAX)) != Cd), "an e2m1 value",
                    Cd, idx)
    if fails.items:
        return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme)
    S = np.repeat(BS, NVFP4_BLOCK, axis=1) * ts
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.clip(np.where(S > 0, X / S, 0.0), -E2M1_MAX, E2M1_MAX)
    q_ref = e2m1_round(y)
    # x / scale within float rounding of an e2m1 tie may round either way
    q_lo, q_hi = e2m1_round(y * (1 - 4 * u)), e2m1_round(y * (1 + 4 * u))
    fails.first_bad("e2m1 code", (Cd != q_ref) & (Cd != q_lo) & (Cd != q_hi), q_ref, Cd, idx,
                    lambda k: f"x / scale = {y.ravel()[k]:.9g}, rounded to nearest even")
    fails.first_bad("non-finite output", ~np.isfinite(XH), "finite", XH, idx)
    want = Cd * S
    err = np.abs(XH - want)
    tol = 2 * u * np.abs(want) + u_out * np.abs(XH) + eta_out / 2
    fails.first_bad("reconstruction", ~(err <= tol), want, XH, idx,
                    lambda k: f"code {Cd.ravel()[k]} * scale {S.ravel()[k]:.6g}")
    bound = e2m1_error_bound(y) * S + 2 * u * np.abs(X) + tol
    fails.first_bad("half-ulp bound", ~(np.abs(XH - X) <= bound) & (np.abs(X) <= E2M1_MAX * S), X, XH, idx,
                    "half an e2m1 ulp at that magnitude, times the scale")
    e = np.abs(X - XH)
    n = xa.size
    stored = n // 2 + n // NVFP4_BLOCK + 4  # 4-bit codes, an e4m3 scale per block, a float32 tensor scale
    stats = QuantStats(float(e.max(initial=0.0)), float(e.mean()) if n else 0.0,
                       float(np.sqrt(np.mean(e * e))) if n else 0.0,
                       xa.nbytes / stored if n else 1.0, int(xa.nbytes), int(stored))
    return QuantVerdict(not fails.items, tuple(fails.items.values()), stats, scheme=scheme)
