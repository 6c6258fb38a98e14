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
from kvbench.quant.reference import reference_scale

# name -> the scheme of every (token, K/V, layer, head) row
POOL_FORMATS = {
    "int8": Q.QuantScheme(8, True, "token"),
    "int4": Q.QuantScheme(4, False, "token"),
}
META_BYTES = 4  # a float32 scale, and a float32 zero point when asymmetric


def scheme_of(name: str) -> Q.QuantScheme:
    try:
        return POOL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown pool format {name!r}; known: {', '.join(POOL_FORMATS)}") from None


def block_bytes(name: str, model: ModelSpec, block_size: int) -> int:
    """Code bytes + metadata bytes of one block (one KV cache group's layers):
    B * 2 * L_group * H * (ceil(d_head * slot_bits / 8) + scale [+ zero point]) (1 for MLA's latent)."""
    scheme = scheme_of(name)
    rows = block_size * model.kv_pair * model.group_layers * model.kv_heads
    code = -(-model.head_dim * scheme.slot_bits // 8)
    meta = META_BYTES * (1 if scheme.symmetric else 2)
    return rows * (code + meta)


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
    scheme = scheme_of(name)
    x = np.asarray(expected, dtype=np.float64)
    x_hat = np.asarray(got, dtype=np.float64)
    if x.shape != x_hat.shape:
        return f"shape {x_hat.shape} instead of {x.shape}"
    if x.size == 0:
        return ""
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
