"""The float64 reference quantizer of SPEC section 4 (also a valid implementation of the
quantizer protocol: ``kvbench.quant`` re-exports it).

Decisions where the SPEC formula is silent (an engineer's choice, written down here):

- The zero point is stored in the scale's float dtype, never int8: it is an integer-valued float
  that cannot wrap (SPEC's sound alternative "store the zero point wider than int8").
- A constant channel ``v`` (zero range) stores scale ``|v|`` and zero point 0: codes ``+-1``
  reconstruct ``v`` exactly. An all-zero (or empty) channel stores scale 1: codes 0, output 0.
- The stored scale is rounded up (one ulp of its dtype) so that ``scale * (qmax - qmin)`` covers
  the range: every element then lies within ``scale/2`` of a code, and no clipping error appears.
- Asymmetric scales have a floor ``8u * max|x_c|``: a range narrower than that cannot be resolved
  by arithmetic of unit roundoff ``u`` anyway, and the floor keeps ``|zero_point| <= 2^21`` (exact
  in float32, and small enough for float32 rounding tricks).
- The reconstruction bound of SPEC section 4 assumes normal numbers. Each rounding into the
  subnormal range can add half the dtype's smallest subnormal ``eta`` (Higham, *Accuracy and
  Stability of Numerical Algorithms*, section 2.1), so the checker adds ``eta_out/2 +
  eta*(1 + scale)``; with a float16 output that is 2^-25, visible only for tiny values.
- With an external (calibrated) scale, values beyond the codes saturate: the checker compares
  the output with the input clipped to the representable interval.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kvbench.quant.layouts import (
    UNIT_ROUNDOFF,
    Layout,
    QuantizedTensor,
    QuantScheme,
    pack_bits,
    unpack_codes,
    validate_input,
)

name = "reference"

_E4M3 = ml_dtypes.finfo(ml_dtypes.float8_e4m3fn)
FP8_E4M3_MAX = float(_E4M3.max)  # 448 = 1.75 * 2^8: the largest finite e4m3fn value
FP8_E4M3_MIN_NORMAL = float(_E4M3.smallest_normal)  # 2^-6
FP8_E4M3_MANTISSA_BITS = _E4M3.nmant  # 3


def available() -> tuple[bool, str]:
    return True, ""


def group_min_max(rows2d, lay: Layout):
    """Per-group min and max (meta_shape, input dtype); empty groups read as 0."""
    if lay.size == 0:
        zeros = np.zeros(lay.meta_shape, dtype=rows2d.dtype)
        return zeros, zeros
    g = lay.scheme.granularity
    if g == "channel":
        return rows2d.min(axis=0, keepdims=True), rows2d.max(axis=0, keepdims=True)
    if g == "token":
        return rows2d.min(axis=1, keepdims=True), rows2d.max(axis=1, keepdims=True)
    grouped = rows2d.reshape(lay.rows, -1, lay.scheme.group_size)
    return grouped.min(axis=2), grouped.max(axis=2)


def scale_and_zero_point(lo, hi, scheme: QuantScheme, scale_dtype: str = "float64"):
    """Per-group scale and zero point from the group's min and max (SPEC section 4).

    Computed in float64 (no overflow for float16/float32 ranges) and stored in ``scale_dtype``
    one ulp above the nearest value, so that ``scale * steps`` covers the range despite the
    rounding of the computation. Returns (scale, zero_point or None).
    """
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    dt = np.dtype(scale_dtype)
    u = UNIT_ROUNDOFF[dt.name]
    steps = scheme.steps
    amax = np.maximum(-lo, hi)  # max |x| (lo <= hi)
    if scheme.symmetric:
        scale = np.where(amax == 0, 1.0, amax / steps)  # one rounding: one ulp up covers it
        return _round_up(scale, dt, where=amax > 0), None
    constant = hi == lo
    # hi/steps - lo/steps cannot overflow; its three roundings are each <= 2^-53 amax/steps
    # (cancellation when lo and hi are close), so add 6 of those before rounding up.
    scale = hi / steps - lo / steps + 6 * 2.0**-53 * amax / steps
    scale = np.maximum(scale, 8 * u * amax)
    scale = np.where(constant, np.where(lo == 0, 1.0, np.abs(lo)), scale)
    scale = _round_up(scale, dt, where=~constant)
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(constant, 0.0, np.rint(scheme.qmin - lo / scale.astype(np.float64)))
    return scale, zero.astype(dt)


def _round_up(scale, dt: np.dtype, where) -> np.ndarray:
    """scale stored in dt, one ulp above the nearest value where ``where`` (but never past the
    largest finite value, which covers any range once times steps >= 1)."""
    stored = scale.astype(dt)
    with np.errstate(over="ignore"):
        up = np.nextafter(stored, dt.type(np.inf))
    return np.where(where & np.isfinite(up), up, stored).astype(dt)


# --------------------------------------------------------------------------------------------
# The float64 reference quantizer (also a valid implementation of the protocol)


def quantize(x, scheme: QuantScheme, *, scale=None, zero_point=None) -> QuantizedTensor:
    """Reference quantization in float64. ``scale`` (and ``zero_point``) given: a calibrated
    scale, broadcast to the groups; values beyond the codes saturate."""
    x = np.asarray(x)
    lay = validate_input(x, scheme)
    xr = lay.to_rows(x).astype(np.float64)
    if scale is None:
        s, z = scale_and_zero_point(*group_min_max(xr, lay), scheme, "float64")
    else:
        s, z = external_scale(scale, zero_point, xr, lay)
    q = np.rint(xr / lay.expand(s))
    if z is not None:
        q = q + lay.expand(z)
    codes = np.clip(q, scheme.qmin, scheme.qmax).astype(np.int8)
    if scheme.packed:
        codes = pack_bits(codes, scheme.slot_bits)
    return QuantizedTensor(codes, s, z, x.shape, x.dtype.name, scheme, scheme.packed, "float64")


def reference_scale(x, scheme: QuantScheme) -> np.ndarray:
    """The scale quantize(x, scheme) stores per group (its meta_shape), without the codes: what
    the checker's bound needs, at a fraction of the cost."""
    x = np.asarray(x)
    lay = validate_input(x, scheme)
    return scale_and_zero_point(*group_min_max(lay.to_rows(x).astype(np.float64), lay), scheme,
                                "float64")[0]


def external_scale(scale, zero_point, rows2d, lay: Layout, dtype="float64"):
    """A calibrated scale (and zero point) broadcast to the groups, checked positive and finite."""
    s = np.broadcast_to(np.asarray(scale, dtype=np.float64), lay.meta_shape).astype(dtype)
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"quantize: an external scale must be positive and finite, got {scale!r}")
    if lay.scheme.symmetric:
        if zero_point is not None:
            raise ValueError("quantize: a symmetric scheme takes no zero_point")
        return s, None
    if zero_point is None:
        lo, _ = group_min_max(rows2d, lay)
        z = np.rint(lay.scheme.qmin - np.asarray(lo, np.float64) / s.astype(np.float64))
    else:
        z = np.broadcast_to(np.asarray(zero_point, dtype=np.float64), lay.meta_shape)
        if not (np.isfinite(z).all() and (z == np.rint(z)).all()):
            raise ValueError(f"quantize: zero_point must be integer-valued, got {zero_point!r}")
    return s, np.asarray(z, dtype=dtype)



def dequantize(qt: QuantizedTensor, out_dtype=np.float64) -> np.ndarray:
    """Reference x_hat = (q - zero_point) * scale, in float64."""
    lay = qt.layout
    q = unpack_codes(qt).astype(np.float64)
    if qt.zero_point is not None:
        q = q - lay.expand(np.asarray(qt.zero_point, dtype=np.float64))
    with np.errstate(over="ignore"):
        x_hat = q * lay.expand(np.asarray(qt.scale, dtype=np.float64))
    top = np.finfo(out_dtype).max  # a value just past the top of the range stays finite
    return lay.from_rows(np.clip(x_hat, -top, top)).astype(out_dtype)


# --------------------------------------------------------------------------------------------
# fp8 e4m3 (torch.float8_e4m3fn): 4 exponent bits (bias 7), 3 mantissa bits, no inf, max 448


def fp8_e4m3_round(y) -> np.ndarray:
    """Nearest e4m3fn value of each y (ties to even), saturating at +-448. float64 in and out."""
    y = np.asarray(y, dtype=np.float64)
    if not np.isfinite(y).all():
        raise ValueError("fp8_e4m3_round: NaN/inf input")
    # ml_dtypes rounds to nearest even, from float64 in one rounding (through float32 would round
    # twice). e4m3fn has no inf: past 464 (448 + half its last step) the cast gives NaN, so values
    # are clipped to +-448 first, SPEC §12's saturation.
    return np.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def fp8_e4m3_error_bound(y) -> np.ndarray:
    """|y - fp8(y)| for |y| <= 448: half a quantum, <= 2^-4 |y| (normal) or 2^-10 (subnormal)."""
    return np.maximum(2.0**-(FP8_E4M3_MANTISSA_BITS + 1) * np.abs(y), FP8_E4M3_MIN_NORMAL * 2.0**-4)


@dataclass
class Fp8Tensor:
    codes: object  # float8_e4m3fn (or float values that are e4m3 values)
    scale: float  # one per tensor: x_hat = code * scale
    shape: tuple
    dtype: str
    compute_dtype: str = "float32"


# --------------------------------------------------------------------------------------------
# e2m1 (NVFP4's element format): 2 exponent bits (bias 1), 1 mantissa bit, no inf/NaN, max 6.
# Its eight magnitudes: 0, 0.5, 1, 1.5 (step 0.5), 2, 3 (step 1), 4, 6 (step 2).

E2M1_MAX = float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max)  # 6 = 1.5 * 2^2
NVFP4_BLOCK = 16  # elements that share one e4m3 block scale


def e2m1_round(y) -> np.ndarray:
    """Nearest e2m1 value of each y (ties to even mantissa), saturating at +-6. float64 in and out."""
    y = np.asarray(y, dtype=np.float64)
    if not np.isfinite(y).all():
        raise ValueError("e2m1_round: NaN/inf input")  # ml_dtypes would make NaN -0
    # ml_dtypes' float4_e2m1fn rounds to nearest even and saturates; the clip says so explicitly.
    return np.clip(y, -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)


def e2m1_error_bound(y) -> np.ndarray:
    """Half a unit in the last place at |y|'s magnitude (|y| <= 6): 0.25 below 2, 0.5 in [2, 4),
    1 in [4, 6]."""
    a = np.abs(np.asarray(y, dtype=np.float64))
    return np.where(a < 2, 0.25, np.where(a < 4, 0.5, 1.0))


def fp8_half_ulp(y) -> np.ndarray:
    """Half a unit in the last place of e4m3 at |y|'s magnitude (|y| <= 448): 2^(e-5) for |y| in
    [2^e, 2^(e+1)), 2^-10 in the subnormal range (|y| < 2^-6)."""
    a = np.abs(np.asarray(y, dtype=np.float64))
    _, e = np.frexp(a)
    return np.ldexp(1.0, np.maximum(e - 1, -6) - FP8_E4M3_MANTISSA_BITS - 1)


def fp8_scale(amax) -> np.ndarray:
    """SPEC §12's fp8 scale of a group whose max |x| is ``amax``: amax / 448 (1 for a zero group)."""
    amax = np.asarray(amax, dtype=np.float64)
    return np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0)


# NVFP4's two-level scale, checked against NVIDIA's and vLLM's code (not a quote of either):
# - NVIDIA/TensorRT-Model-Optimizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py: tensor
#   scale ("weights_scaling_factor_2") amax / (6 * 448); block scale block amax / (6 * tensor
#   scale) cast to float8_e4m3fn; codes e2m1(x / (block scale * tensor scale)), ties to even.
# - vllm-project/vllm csrc/quantization/fp4/nvfp4_utils.cuh (cvt_warp_fp16_to_fp4, TensorRT-LLM's
#   kernel) and vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py
#   (ref_nvfp4_quant): the encode scale global_scale = 448 * 6 / amax (tests/kernels/quantization/
#   nvfp4_utils.py), block scale e4m3(min(global_scale * block amax / 6, 448)), elements times
#   1 / (block scale / global_scale), clipped to +-6, rounded to e2m1 (cvt.rn.satfinite), a zero
#   block scale gives codes 0; read back code * block scale / global_scale.
# The same rule (global_scale is 1 / tensor scale), but for float rounding; kvbench divides in
# float64 and the checker accepts either side of an e4m3 tie within float32 rounding.


def nvfp4_tensor_scale(amax: float) -> float:
    """NVFP4's per-tensor float32 scale: amax / (448 * 6), so that the largest block scale
    (block amax / 6 / tensor scale) is 448, e4m3's largest value (1 for a zero tensor)."""
    return float(np.float32(amax / (FP8_E4M3_MAX * E2M1_MAX))) if amax > 0 else 1.0


def nvfp4_block_scales(rows, tensor_scale: float) -> np.ndarray:
    """Each 16-element block's e4m3 scale (rows ``(R, C)``, C a multiple of 16 -> ``(R, C/16)``):
    e4m3(block amax / 6 / tensor_scale), rounded to nearest even and saturating at 448."""
    rows = np.asarray(rows, dtype=np.float64)
    blocks = np.abs(rows.reshape(rows.shape[0], -1, NVFP4_BLOCK)).max(axis=2)
    return fp8_e4m3_round(np.minimum(blocks / E2M1_MAX / tensor_scale, FP8_E4M3_MAX))


def nvfp4_round(rows, tensor_scale: float) -> np.ndarray:
    """The NVFP4 value of every element of ``rows`` (R, C): e2m1(x / s) * s with s = e4m3 block
    scale * tensor scale; a block whose scale rounds to 0 reads back 0."""
    rows = np.asarray(rows, dtype=np.float64)
    s = np.repeat(nvfp4_block_scales(rows, tensor_scale), NVFP4_BLOCK, axis=1) * tensor_scale
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s > 0, rows / s, 0.0)
    return e2m1_round(np.clip(y, -E2M1_MAX, E2M1_MAX)) * s


@dataclass
class Nvfp4Tensor:
    codes: object  # (R, C) e2m1 values (float), or C/2 bytes a row: two 4-bit codes, low nibble first
    block_scale: object  # (R, C/16) e4m3 values
    tensor_scale: float  # x_hat = code * block_scale * tensor_scale
    shape: tuple
    dtype: str
    compute_dtype: str = "float32"
