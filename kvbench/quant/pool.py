"""Quantized KV pools: the formats a paged pool can store, their bytes per block, and the bound
the checker holds a pool's gathered K/V to.

A pool writes tokens one at a time as they are decoded, so its scales are per token: for every
(token, K/V, layer, head) one row of ``head_dim`` channels shares a scale (and a zero point when
asymmetric), as vLLM's per-token-head KV scales do. Per-channel keys (KIVI) need a whole block's
tokens before they can be quantized and are offered by ``kvbench.quant.capacity_table`` only.
"""
from __future__ import annotations

import numpy as np

from kvbench import quant as Q
from kvbench.contract import formulas as F
from kvbench.contract.formulas import ModelSpec
from kvbench.quant.reference import (
    E2M1_MAX,
    NVFP4_BLOCK,
    e2m1_error_bound,
    e2m1_round,
    fp8_e4m3_round,
    fp8_half_ulp,
    fp8_scale,
    nvfp4_block_scales,
    nvfp4_tensor_scale,
    reference_scale,
)

# name -> the scheme of every (token, K/V, layer, head) row
POOL_FORMATS = {
    "int8": Q.QuantScheme(8, True, "token"),
    "int4": Q.QuantScheme(4, False, "token"),
}
META_BYTES = 4  # a float32 scale, and a float32 zero point when asymmetric
# SPEC §12's float formats (docs/quantization.md): fp8 e4m3 codes with one scale per tensor (K or V
# of a layer) or per token-head row; NVFP4's e2m1 codes with an e4m3 scale per 16 and a tensor scale.
FLOAT_FORMATS = ("fp8-tensor", "fp8-token-head", "nvfp4")
# A per-tensor scale is calibrated, as vLLM's k_scale / v_scale: the amax of every K/V tensor
# kvbench writes is that of kv_tokens, (...) mod 2003 - 1001.
KV_AMAX = 1001.0


def scheme_of(name: str) -> Q.QuantScheme:
    try:
        return POOL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown pool format {name!r}; known: "
                         f"{', '.join((*POOL_FORMATS, *FLOAT_FORMATS))}") from None


def row_bytes(name: str, head_dim: int) -> int:
    """Bytes one (token, K/V, layer, head) row of ``head_dim`` channels takes in the blocks."""
    if name == "fp8-tensor":
        return head_dim  # one e4m3 code a channel; the tensor scales live outside the blocks
    if name == "fp8-token-head":
        return head_dim + META_BYTES  # and the row's float32 scale
    if name == "nvfp4":
        return head_dim // 2 + head_dim // NVFP4_BLOCK  # 4-bit codes, an e4m3 scale per 16
    scheme = scheme_of(name)
    return -(-head_dim * scheme.slot_bits // 8) + META_BYTES * (1 if scheme.symmetric else 2)


def block_bytes(name: str, model: ModelSpec, block_size: int) -> int:
    """Code bytes + metadata bytes of one block (one KV cache group's layers):
    B * 2 * L_group * H * (ceil(d_head * slot_bits / 8) + scale [+ zero point]) (1 for MLA's latent);
    SPEC §12's float formats: d (fp8 per tensor), d + 4 (fp8 per token-head), d/2 + d/16 (NVFP4)
    bytes a row."""
    rows = block_size * model.kv_pair * model.group_layers * model.kv_heads
    if name == "nvfp4":  # blocks of 16 run over a (token, K/V, layer)'s heads and channels
        elements = rows * model.head_dim
        return elements // 2 + elements // NVFP4_BLOCK
    return rows * row_bytes(name, model.head_dim)


def pool_block_bytes(config) -> int:
    """The bytes of one block of the pool ``config`` (a CacheConfig) sets up: a quantized
    format's code + metadata, else B * 2 * L_group * H_kv * d_head * s."""
    if config.kv_format:
        return block_bytes(config.kv_format, config.model, config.block_size)
    return F.block_bytes(config.block_size, config.model)


def bound_violation(expected: np.ndarray, got: np.ndarray, name: str, first_position: int = 0) -> str:
    """'' when every gathered element is within SPEC §4's bound of the exact K/V, else where not
    (positions counted from ``first_position``, that of the first token given).

    The bound per element, with the reference (float64) scale of its row:
    ``scale/2 + 2u|x| + u*scale + u_out*|x_hat|``, u = u_out = 2^-24 (float32 arithmetic and
    output); a row whose range is zero must come back within float rounding of its value.
    """
    x = np.asarray(expected, dtype=np.float64)
    x_hat = np.asarray(got, dtype=np.float64)
    if x.shape != x_hat.shape:
        return f"shape {x_hat.shape} instead of {x.shape}"
    if x.size == 0:
        return ""
    if name in FLOAT_FORMATS:
        return float_violation(x, x_hat, name, first_position)
    scheme = scheme_of(name)
    rows = x.reshape(-1, x.shape[-1])
    scale = np.asarray(reference_scale(rows, scheme), dtype=np.float64).reshape(-1, 1)
    u = Q.unit_roundoff("float32")
    hat = x_hat.reshape(rows.shape)
    bound = scale / 2 + 2 * u * np.abs(rows) + u * scale + u * np.abs(hat)
    bad = np.abs(rows - hat) > bound
    if not bad.any():
        return ""
    r, c = map(int, np.argwhere(bad)[0])
    token, row = divmod(r, rows.shape[0] // x.shape[0])
    return (f"position {first_position + token}, row {row}, channel {c}: |{rows[r, c]} - {hat[r, c]}| = "
            f"{abs(rows[r, c] - hat[r, c]):.6g} > bound {bound[r, c]:.6g} (scale {scale[r, 0]:.6g})")


def float_read_back(rows, name: str, stretch: float = 1.0) -> tuple:
    """(the value every element of ``rows`` (R, d) reads back as, the scale it was rounded at):
    SPEC §12's round-to-nearest-even of x / scale in the format, times the scale. ``stretch``
    scales x / scale (and each block's amax for NVFP4) to try the other side of a tie."""
    if name == "nvfp4":
        ts = nvfp4_tensor_scale(KV_AMAX)
        bs = nvfp4_block_scales(rows * stretch, ts)
        s = np.repeat(bs, NVFP4_BLOCK, axis=1) * ts
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(s > 0, rows * stretch / s, 0.0)
        return e2m1_round(np.clip(y, -E2M1_MAX, E2M1_MAX)) * s, s
    amax = KV_AMAX if name == "fp8-tensor" else np.abs(rows).max(axis=1, keepdims=True)
    s = np.broadcast_to(np.float32(fp8_scale(amax)).astype(np.float64), rows.shape)
    return fp8_e4m3_round(rows * stretch / s) * s, s


def float_violation(x, x_hat, name: str, first_position: int = 0) -> str:
    """'' when every gathered element of a float-format pool reads back as SPEC §12 says
    (:func:`float_read_back`, within float32 rounding of the product code * scale; x / scale
    within float rounding of a tie may round either way), else where not."""
    # NVFP4's blocks of 16 run over a (token, K/V, layer)'s heads and channels
    rows = x.reshape(-1, x.shape[-1] * (x.shape[-2] if name == "nvfp4" else 1))
    hat = x_hat.reshape(rows.shape)
    u = Q.unit_roundoff("float32")
    want, s = float_read_back(rows, name)
    ok = np.abs(hat - want) <= 2 * u * np.abs(want)
    for stretch in (1 - 4 * u, 1 + 4 * u):
        if not ok.all():
            other, _ = float_read_back(rows, name, stretch)
            ok |= np.abs(hat - other) <= 2 * u * np.abs(other)
    if ok.all():
        return ""
    r, c = map(int, np.argwhere(~ok)[0])
    token, row = divmod(r, rows.shape[0] // x.shape[0])
    half_ulp = (e2m1_error_bound if name == "nvfp4" else fp8_half_ulp)(want[r, c] / s[r, c])
    return (f"position {first_position + token}, row {row}, channel {c}: read back {float(hat[r, c]):.9g}, "
            f"{name} gives {float(want[r, c]):.9g} = RNE({float(rows[r, c]):.9g} / scale {s[r, c]:.6g}) "
            f"* scale (half-ulp bound {float(half_ulp) * s[r, c]:.6g})")
