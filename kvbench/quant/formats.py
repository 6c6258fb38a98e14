"""KV formats and capacity: tokens that fit in a byte budget at each format (fp16, fp8, NVFP4,
int8, int4, int2, KIVI), metadata counted, beside the error each makes on a K/V sample."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbench.contract.formulas import ModelSpec, get_model
from kvbench.quant.layouts import QuantScheme
from kvbench.quant.reference import (
    FP8_E4M3_MAX,
    NVFP4_BLOCK,
    dequantize,
    fp8_e4m3_round,
    nvfp4_round,
    nvfp4_tensor_scale,
    quantize,
)


@dataclass(frozen=True)
class KVFormat:
    """How a paged cache stores K and V: a scheme for each (None: fp16 / fp8 per-tensor / NVFP4)."""

    name: str
    bits: int
    keys: QuantScheme | None = None
    values: QuantScheme | None = None
    fp8: bool = False
    nvfp4: bool = False  # e2m1 codes, an e4m3 scale per 16 elements, a float32 scale per tensor


def kv_formats(group_size: int = 32) -> list[KVFormat]:
    """fp16, fp8-e4m3 (per-tensor scale, as vLLM's k_scale/v_scale), NVFP4, int8 per token, int4
    group-wise, and KIVI (keys per channel, values per token) at 8, 4 and 2 bits."""
    tok = lambda b, sym: QuantScheme(b, sym, "token")  # noqa: E731
    chan = lambda b: QuantScheme(b, False, "channel")  # noqa: E731
    grp = QuantScheme(4, False, "group", group_size=group_size)
    return [
        KVFormat("fp16", 16),
        KVFormat("fp8-e4m3", 8, fp8=True),
        KVFormat("nvfp4", 4, nvfp4=True),
        KVFormat("int8-token-sym", 8, tok(8, True), tok(8, True)),
        KVFormat("int8-kivi", 8, chan(8), tok(8, False)),
        KVFormat(f"int4-group{group_size}", 4, grp, grp),
        KVFormat("int4-kivi", 4, chan(4), tok(4, False)),
        KVFormat("int2-kivi", 2, chan(2), tok(2, False)),
    ]


def _meta_entries_per_block(scheme: QuantScheme, model: ModelSpec, block_size: int) -> int:
    """Scales one block holds for K (or V): per channel over the block's tokens, per token, or
    per group of G channels of a token; for every layer and KV head."""
    heads = model.layers * model.kv_heads
    if scheme.granularity == "channel":
        return heads * model.head_dim
    if scheme.granularity == "token":
        return heads * block_size
    return heads * block_size * (model.head_dim // scheme.group_size)


def format_block_bytes(fmt: KVFormat, model: ModelSpec, block_size: int, scale_bytes: int = 4) -> tuple[int, int]:
    """(bytes of one block, of which metadata). Scales and zero points take ``scale_bytes`` each
    (float32, as kvbench.quant stores them)."""
    elements = model.layers * model.kv_heads * model.head_dim * block_size  # per K (or V)
    if fmt.nvfp4:  # 4-bit codes and an e4m3 scale per 16 elements, for K and for V
        meta = 2 * (elements // NVFP4_BLOCK)
        return 2 * (elements // 2) + meta, meta
    if fmt.keys is None:
        elem_bytes = model.dtype_bytes if not fmt.fp8 else 1
        return 2 * elements * elem_bytes, 0
    total = meta = 0
    for scheme in (fmt.keys, fmt.values):
        code = -(-elements * scheme.slot_bits // 8)
        m = _meta_entries_per_block(scheme, model, block_size) * scale_bytes * (1 if scheme.symmetric else 2)
        total += code + m
        meta += m
    return total, meta


def capacity_table(model: ModelSpec | str, budget_bytes: int, kv_sample=None, *, block_size: int = 16,
                   group_size: int = 32, formats: list | None = None):
    """For a byte budget: blocks and tokens that fit at each KV format (metadata counted per
    block; fp8's per-layer K and V scales once), and, given a K/V sample
    ``[tokens, 2, layers, kv_heads, head_dim]``, the error each format makes on it."""
    import pandas as pd

    model = get_model(model) if isinstance(model, str) else model
    formats = formats or kv_formats(group_size)
    sample = None if kv_sample is None else np.asarray(kv_sample)
    if sample is not None:
        want = (2, model.layers, model.kv_heads, model.head_dim)
        if sample.ndim != 5 or sample.shape[1:] != want:
            raise ValueError(f"capacity_table: kv_sample must be [tokens, {', '.join(map(str, want))}], "
                             f"got {sample.shape}")
    rows = []
    fp16_tokens = None
    for fmt in formats:
        block, meta = format_block_bytes(fmt, model, block_size)
        fixed = 2 * model.layers * 4 if fmt.fp8 or fmt.nvfp4 else 0  # K and V scales per layer
        blocks = max(0, budget_bytes - fixed) // block
        tokens = blocks * block_size
        if fmt.name == "fp16":
            fp16_tokens = tokens
        row = {"format": fmt.name, "bits": fmt.bits,
               "keys": fmt.keys.describe() if fmt.keys else _float_scales(fmt),
               "values": fmt.values.describe() if fmt.values else _float_scales(fmt),
               "block_bytes": block, "metadata_fraction": meta / block, "blocks": blocks, "tokens": tokens}
        if sample is not None:
            for side, part in (("key", sample[:, 0]), ("value", sample[:, 1])):
                err = _format_error(fmt, part, block_size, side)
                row[f"{side}_max_abs_error"], row[f"{side}_rmse"] = err
        rows.append(row)
    df = pd.DataFrame(rows)
    if fp16_tokens:
        df["tokens_vs_fp16"] = df["tokens"] / fp16_tokens
    return df


def _float_scales(fmt: KVFormat) -> str:
    return "per-tensor scale" if fmt.fp8 else "e4m3 per 16, per-tensor scale" if fmt.nvfp4 else "-"


def _format_error(fmt: KVFormat, part, block_size: int, side: str) -> tuple[float, float]:
    """(max abs error, rmse) of one format on K or V ``[tokens, layers, heads, head_dim]``."""
    x = np.asarray(part, dtype=np.float64)
    if x.size == 0:
        return 0.0, 0.0
    if fmt.nvfp4:
        x_hat = np.empty_like(x)
        for layer in range(x.shape[1]):  # one tensor scale per layer for K (V); blocks of 16
            xl = x[:, layer]
            if xl.size % NVFP4_BLOCK:
                return float("nan"), float("nan")
            ts = nvfp4_tensor_scale(float(np.abs(xl).max()))
            x_hat[:, layer] = nvfp4_round(xl.reshape(-1, NVFP4_BLOCK), ts).reshape(xl.shape)
    elif fmt.fp8:
        x_hat = np.empty_like(x)
        for layer in range(x.shape[1]):  # one scale per layer for K (V)
            amax = np.abs(x[:, layer]).max()
            s = amax / FP8_E4M3_MAX if amax > 0 else 1.0
            x_hat[:, layer] = fp8_e4m3_round(x[:, layer] / s) * s
    elif fmt.keys is None:
        x_hat = np.asarray(part).astype(np.float16).astype(np.float64)
    else:
        scheme = fmt.keys if side == "key" else fmt.values
        if scheme.granularity == "channel":
            # Per channel over each block's tokens: (blocks, B, L, H, d) -> (B, blocks * L * H * d).
            t = x.shape[0]
            b = block_size if t >= block_size else t
            t_used = t - t % b
            x = x[:t_used]
            blocked = x.reshape(t_used // b, b, -1).transpose(1, 0, 2).reshape(b, -1)
            x_hat_b = dequantize(quantize(blocked, scheme))
            x_hat = x_hat_b.reshape(b, t_used // b, -1).transpose(1, 0, 2).reshape(x.shape)
        else:
            x_hat = dequantize(quantize(x, scheme))
    e = np.abs(x - x_hat)
    return float(e.max()), float(np.sqrt(np.mean(e * e)))
