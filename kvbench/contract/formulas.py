"""The formulas of SPEC sections 1-2 and 8, as small pure functions.

Every backend and the oracle are checked against these; none of them holds state.

A model's layers form one or more KV cache groups (SPEC §8): every layer of a group has the same
attention kind, full or sliding(W), and every group holds the same number of layers, so one pool
of equal-size blocks serves them all (``block_bytes = B * 2 * L_group * H_kv * d_head * s``).
A model without ``groups`` is one full-attention group of all its layers.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

# Tokens a block at most: slot and token arithmetic (blocks * block_size) stays within int64 for
# any pool a machine can index.
MAX_BLOCK_SIZE = (1 << 31) - 1


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: the layers whose K/V its blocks hold, and their attention kind.

    ``window`` None is full attention; ``window = W`` is sliding(W): the token at position p
    attends to positions p - W + 1 .. p.
    """

    layers: tuple
    window: int | None = None

    @property
    def sliding(self) -> bool:
        return self.window is not None

    @property
    def kind(self) -> str:
        return "full" if self.window is None else f"sliding({self.window})"


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model's KV cache: layers, KV heads, head dim, bytes per element, and the
    KV cache groups its layers form (empty: one full-attention group of every layer)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # fp16 / bf16
    groups: tuple = ()

    def __post_init__(self):
        for field in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec {self.name!r}: {field} must be a positive int, got {value!r}")
        if self.groups:
            seen = sorted(layer for g in self.groups for layer in g.layers)
            if seen != list(range(self.layers)):
                raise ValueError(f"ModelSpec {self.name!r}: the groups must hold every layer "
                                 f"0..{self.layers - 1} exactly once, got {seen}")
            if len({len(g.layers) for g in self.groups}) != 1:
                raise ValueError(f"ModelSpec {self.name!r}: groups must hold the same number of "
                                 f"layers (one pool of equal blocks serves them all), got "
                                 f"{[len(g.layers) for g in self.groups]}")
            for g in self.groups:
                if g.window is not None and (not isinstance(g.window, int) or g.window < 1):
                    raise ValueError(f"ModelSpec {self.name!r}: a sliding window must be a "
                                     f"positive int, got {g.window!r}")

    @property
    def kv_groups(self) -> tuple:
        """The groups, one full group of every layer for a model that names none."""
        return self.groups or (KVGroup(tuple(range(self.layers))),)

    @property
    def hybrid(self) -> bool:
        """More than one group, or any sliding window: what a backend must declare it runs."""
        return len(self.kv_groups) > 1 or any(g.sliding for g in self.kv_groups)

    @property
    def group_layers(self) -> int:
        """L_group: layers per group."""
        return self.layers // len(self.kv_groups)

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes of one token over every layer."""
        return bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot of one group's block: 2 * L_group * H_kv * d_head * s."""
        return bytes_per_token(self.group_layers, self.kv_heads, self.head_dim, self.dtype_bytes)


def hybrid_groups(layers: int, pattern, per_group: int | None = None) -> tuple:
    """Groups of a model whose layer ``i`` has attention ``pattern[i % len(pattern)]`` (None for
    full, W for sliding(W)), as vLLM's hybrid allocator forms them: the layers of each kind, in
    order, cut into groups of ``per_group`` layers (default: the fewest layers of any kind).
    Kinds in order of first appearance; the groups of one kind in layer order."""
    kinds: dict = {}
    for i in range(layers):
        kinds.setdefault(pattern[i % len(pattern)], []).append(i)
    size = per_group or min(len(v) for v in kinds.values())
    out = []
    for window, members in kinds.items():
        if len(members) % size:
            raise ValueError(f"{len(members)} layers of kind {window!r} do not split into groups "
                             f"of {size}")
        out += [KVGroup(tuple(members[k:k + size]), window) for k in range(0, len(members), size)]
    return tuple(out)


def parse_kind(text: str) -> int | None:
    """'full' -> None; 'sliding(4096)' -> 4096 (a trace header names group kinds this way)."""
    m = re.fullmatch(r"\s*(full|sliding\((\d+)\))\s*", str(text))
    if not m:
        raise ValueError(f"not a KV cache group kind: {text!r} (full or sliding(W))")
    return None if m.group(2) is None else int(m.group(2))


def with_group_kinds(model: ModelSpec, kinds) -> ModelSpec:
    """``model`` with its layers re-shaped into groups of the given kinds (layer i in group
    i mod G): what a trace header's ``groups`` asks for. The same model when they already match."""
    windows = [parse_kind(k) for k in kinds]
    if [g.window for g in model.kv_groups] == windows:
        return model
    if not windows or model.layers % len(windows):
        raise ValueError(f"model {model.name!r}: {model.layers} layers do not split into "
                         f"{len(windows)} groups {list(kinds)}")
    groups = tuple(KVGroup(tuple(range(g, model.layers, len(windows))), w)
                   for g, w in enumerate(windows))
    return dataclasses.replace(model, groups=groups)


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
        # Hybrid models (SPEC §8). Gemma 2: layer i slides (W = 4096) when i is even, else full:
        # two groups of 21. Gemma 3: every 6th layer full, the rest slide (W = 1024): vLLM makes
        # 6 groups of 8 layers (5 sliding, 1 full). Mistral-7B v0.1: W = 4096 on every layer.
        ModelSpec("gemma-2-9b", layers=42, kv_heads=8, head_dim=256,
                  groups=hybrid_groups(42, (4096, None))),
        ModelSpec("gemma-3-12b", layers=48, kv_heads=8, head_dim=256,
                  groups=hybrid_groups(48, (1024,) * 5 + (None,), per_group=8)),
        ModelSpec("mistral-7b-v0.1", layers=32, kv_heads=8, head_dim=128,
                  groups=hybrid_groups(32, (4096,))),
        # Full-attention twins of the same size, for the capacity comparison.
        ModelSpec("gemma-2-9b-full", layers=42, kv_heads=8, head_dim=256),
        ModelSpec("gemma-3-12b-full", layers=48, kv_heads=8, head_dim=256),
        # Two groups of two layers, sliding(32) on the even layers: windows of 2-3 blocks of 16.
        ModelSpec("tiny-hybrid", layers=4, kv_heads=2, head_dim=8,
                  groups=hybrid_groups(4, (32, None))),
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
    """B * 2 * L_group * H_kv * d_head * s: one block holds one group's layers (every layer for
    a model of one group)."""
    return block_size * model.slot_bytes


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


def tail_reservation(tail_free, remaining):
    """Slots of a sequence's private tail block that its later tokens will fill:
    ``min(free slots of the tail, max(0, final_tokens - tokens))``. Python ints, NumPy arrays or
    torch tensors (on their own device) alike, so that every backend states it once."""
    if isinstance(tail_free, int) and isinstance(remaining, int):
        return min(tail_free, max(0, remaining))
    if hasattr(remaining, "clamp"):  # a torch tensor
        return remaining.clamp(min=0).minimum(tail_free)
    return np.minimum(tail_free, np.maximum(remaining, 0))


def slab_reservation(slab_slots: int, final_tokens: int, held_tokens: int) -> int:
    """Slots of a contiguous slab that later tokens of its sequence will fill: up to the slab's
    end or the sequence's final length, whichever comes first."""
    return min(slab_slots, final_tokens) - held_tokens


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


# --- sliding windows and capacity (SPEC §8) ------------------------------------------------

def window_start(tokens: int, window: int | None) -> int:
    """First position the next token attends to: max(0, T - W + 1); 0 for full attention."""
    return 0 if window is None else max(0, tokens - window + 1)


def first_held_block(tokens: int, window: int | None, block_size: int) -> int:
    """Index of the first block a group holds after an operation leaves ``tokens`` tokens: the
    blocks whose positions all lie below ``T - W + 1`` are released."""
    return window_start(tokens, window) // block_size


def group_blocks(tokens: int, window: int | None, block_size: int) -> int:
    """blocks_g(X): ceil(X/B) for a full group, min(ceil(X/B), ceil((W-1)/B) + 1) for a sliding
    one (the most blocks a window of W positions can intersect, whatever the alignment)."""
    full = blocks_needed(tokens, block_size)
    if window is None:
        return full
    return min(full, blocks_needed(window - 1, block_size) + 1)


def request_blocks(tokens: int, model: ModelSpec, block_size: int) -> int:
    """sum_g blocks_g(X): the blocks a request of X tokens holds over every group."""
    return sum(group_blocks(tokens, g.window, block_size) for g in model.kv_groups)


def max_concurrency(num_blocks: int, tokens: int, model: ModelSpec, block_size: int) -> int:
    """floor(num_blocks / sum_g blocks_g(X)): requests of X tokens that fit at once."""
    need = request_blocks(tokens, model, block_size)
    return num_blocks // need if need else 0


def full_attention_twin(model: ModelSpec) -> ModelSpec:
    """The same layers as one full-attention group (what the model costs without its windows)."""
    return dataclasses.replace(model, name=f"{model.name} as full attention", groups=())


def capacity(model: ModelSpec, num_blocks: int, block_size: int, lengths) -> list[dict]:
    """SPEC §8's capacity at each request length X: blocks per request (sum_g blocks_g(X)), the
    largest concurrency floor(num_blocks / that), tokens that fit (concurrency * X); beside them
    the full-attention twin's in the same bytes (its blocks hold every layer: num_blocks // G of
    them)."""
    twin = full_attention_twin(model)
    twin_blocks = num_blocks * block_bytes(block_size, model) // block_bytes(block_size, twin)
    rows = []
    for x in lengths:
        need, twin_need = request_blocks(x, model, block_size), request_blocks(x, twin, block_size)
        c, tc = max_concurrency(num_blocks, x, model, block_size), max_concurrency(twin_blocks, x, twin, block_size)
        rows.append({"length": x, "blocks_per_request": need, "max_concurrency": c, "tokens_fit": c * x,
                     "full_blocks_per_request": twin_need, "full_max_concurrency": tc,
                     "full_tokens_fit": tc * x})
    return rows


def capacity_lengths(model: ModelSpec) -> list[int]:
    """Lengths worth a capacity report: 1, 2, 4 and 8 times the largest window."""
    w = max(g.window for g in model.kv_groups if g.window is not None)
    return [w * k for k in (1, 2, 4, 8)]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


__all__ = [
    "KVGroup", "hybrid_groups", "parse_kind", "with_group_kinds", "window_start",
    "first_held_block", "group_blocks", "request_blocks", "max_concurrency", "capacity",
    "capacity_lengths", "full_attention_twin",
    "ModelSpec", "PRESETS", "get_model", "bytes_per_token", "kv_bytes", "block_bytes",
    "blocks_needed", "tail_waste", "append_new_blocks", "fragmentation", "sharing_saving",
    "jain_index", "parse_bytes", "budget_blocks", "ceil_div", "next_pow2",
]
