"""The formulas of SPEC sections 1-2, as small pure functions.

Every backend and the oracle are checked against these; none of them holds state.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model's KV cache: layers, KV heads, head dim, bytes per element."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # fp16 / bf16

    def __post_init__(self):
        for field in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec {self.name!r}: {field} must be a positive int, got {value!r}")

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)


# Public model configs (config.json: num_hidden_layers, num_key_value_heads, head_dim), fp16.
PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("tiny", layers=2, kv_heads=2, head_dim=8),
        ModelSpec("llama-2-7b", layers=32, kv_heads=32, head_dim=128),
        ModelSpec("llama-3-8b", layers=32, kv_heads=8, head_dim=128),
        ModelSpec("llama-2-70b", layers=80, kv_heads=8, head_dim=128),
        ModelSpec("mistral-7b", layers=32, kv_heads=8, head_dim=128),
        ModelSpec("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128),
        # The PagedAttention paper's model: 40 layers, 40 heads of 128, 800 KiB per token.
        ModelSpec("opt-13b", layers=40, kv_heads=40, head_dim=128),
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 (K and V) * L * H_kv * d_head * s."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_bytes(tokens: int, model: ModelSpec) -> int:
    """M_KV(T) = T * bytes_per_token."""
    return tokens * model.bytes_per_token


def block_bytes(block_size: int, model: ModelSpec) -> int:
    return block_size * model.bytes_per_token


def blocks_needed(tokens: int, block_size: int) -> int:
    """ceil(T / B), 0 for T <= 0. Integer arithmetic: no float rounding at large T."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if tokens <= 0:
        return 0
    return -(-tokens // block_size)


def tail_waste(tokens: int, block_size: int) -> int:
    """Free slots in the last block: (B - T mod B) mod B."""
    return (block_size - tokens % block_size) % block_size


def append_new_blocks(delta_tokens: int, free_in_last: int, block_size: int) -> int:
    """ceil(max(0, dT - f_last) / B): new blocks an append takes after filling the tail."""
    return blocks_needed(max(0, delta_tokens - free_in_last), block_size)


def fragmentation(free_slots: int, capacity_slots: int) -> float:
    """sum(free_slots) / sum(capacity) over physical blocks in use; 0.0 when none is in use."""
    if capacity_slots == 0:
        return 0.0
    return free_slots / capacity_slots


def sharing_saving(prefix_tokens: int, branches: int, model: ModelSpec, block_size: int) -> int:
    """Bytes saved by k branches sharing a T_p-token prefix: (k - 1) * M_KV of whole shared blocks.

    Only whole blocks stay shared: the partial tail block is copied at the first write of all
    but one branch.
    """
    whole = (prefix_tokens // block_size) * block_size
    return (branches - 1) * kv_bytes(whole, model)


def jain_index(values) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2); 1.0 for an empty or all-zero list."""
    xs = [Fraction(v) if not isinstance(v, float) else v for v in values]
    n = len(xs)
    sq = sum(x * x for x in xs)
    if n == 0 or sq == 0:
        return 1.0
    return float(sum(xs) ** 2 / (n * sq))


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNIT = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'12GiB' -> 12 * 2**30; '1.5 GB' -> 1.5e9; a plain number is bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a byte size: {text!r} (try 512MiB, 12GiB, 4096)")
    unit = (m.group(2) or "B").lower()
    return int(Fraction(m.group(1)) * _UNIT[unit])


def budget_blocks(budget: str | int, block_size: int, model: ModelSpec) -> int:
    """A budget given in blocks (an int, or '1024' / '1024 blocks') or in bytes ('12GiB').

    A byte budget holds floor(bytes / block_bytes) whole blocks.
    """
    if isinstance(budget, int):
        if budget < 0:
            raise ValueError(f"budget must be >= 0 blocks, got {budget}")
        return budget
    text = str(budget).strip()
    m = re.fullmatch(r"(\d+)\s*(blocks?)?", text, re.IGNORECASE)
    if m:
        return int(m.group(1))
    return parse_bytes(text) // block_bytes(block_size, model)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


__all__ = [
    "ModelSpec", "PRESETS", "get_model", "bytes_per_token", "kv_bytes", "block_bytes",
    "blocks_needed", "tail_waste", "append_new_blocks", "fragmentation", "sharing_saving",
    "jain_index", "parse_bytes", "budget_blocks", "ceil_div", "next_pow2",
]
