"""The hybrid family: prompts over sliding windows, forks at the window's edge, prefix reuse
under several salts and adapters (SPEC §8, §9). A pure function of a seed, like the others.

Requests draw a tenant (each with a cache salt and a LoRA adapter, or none: by default one
tenant's salt is another tenant's adapter name, vLLM issue 44701), one of a few base prompts
(token ids), and a prompt that is the base prompt's first ``m`` tokens (block-aligned with
``aligned_rate``), then ``own`` tokens of its own with ``own_rate``. Prompts run well past the
model's windows and decode past them; a fork (``fork_rate``) happens at a random point of the
decoding, so it falls on either side of a window edge. Over a budget of ``num_blocks`` (default
``ceil(budget_fraction * peak)``, the peak counted with every group's blocks), cached blocks
are evicted and reused: later prompts find their full groups' blocks cached and their sliding
groups' windows gone, or the reverse.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from kvbench.contract import formulas as F
from kvbench.traces.builder import _Builder, _recorded, _walk
from kvbench.traces.format import Free, Prefill, Trace
from kvbench.traces.laws import _pair, _positive_int, _probability

TENANTS = [{"name": "alice", "salt": "x"}, {"name": "bob", "adapter": "x"},
           {"name": "carol", "salt": "y", "adapter": "x"}, {"name": "dave"}]
VOCAB = 32000


def hybrid_windows(seed: int = 0, *, model: str = "tiny-hybrid", num_requests: int = 36,
                   prompts: int = 3, prompt_tokens=(24, 120), aligned_rate: float = 0.3,
                   own_rate: float = 0.4, own_tokens=(1, 24), output=(8, 48),
                   fork_rate: float = 0.25, concurrency: int = 4, max_batch: int = 3,
                   decode_chunk: int = 6, block_size: int = 8, num_blocks: int | None = None,
                   budget_fraction: float = 0.6, tenants=None) -> Trace:
    """Requests on a model of KV cache groups with sliding windows (see the module docstring)."""
    params = _recorded(dict(locals()))
    spec = F.get_model(model)
    tenants = params["tenants"] = _tenants(tenants if tenants is not None else TENANTS)
    n = _positive_int("num_requests", num_requests)
    k_max = _positive_int("prompts", prompts)
    p_lo, p_hi = _pair("prompt_tokens", prompt_tokens)
    own_lo, own_hi = _pair("own_tokens", own_tokens)
    out_lo, out_hi = _pair("output", output)
    for name, v in (("concurrency", concurrency), ("max_batch", max_batch),
                    ("decode_chunk", decode_chunk), ("block_size", block_size)):
        _positive_int(name, v)
    for name, v in (("aligned_rate", aligned_rate), ("own_rate", own_rate), ("fork_rate", fork_rate)):
        _probability(name, v)
    B = block_size
    rng = np.random.default_rng(seed)
    base = rng.integers(0, VOCAB, size=(k_max, p_hi))
    own_ids = iter(range(VOCAB, VOCAB + n * own_hi))  # ids no base prompt has

    b, left, order, arrived, forks = _Builder(), {}, deque(), 0, {}
    while arrived < n or left:
        while arrived < n and len(left) < concurrency:
            t = tenants[int(rng.integers(len(tenants)))]
            k = int(rng.integers(k_max))
            m = int(rng.integers(p_lo, p_hi, endpoint=True))
            if rng.random() < aligned_rate:
                m = max(B, m // B * B)
            ids = list(base[k, :m])
            if rng.random() < own_rate:
                ids += [next(own_ids) for _ in range(int(rng.integers(own_lo, own_hi, endpoint=True)))]
            seq = b.prefill(len(ids), t["name"], salt=t.get("salt"), adapter=t.get("adapter"),
                            token_ids=ids)
            left[seq] = int(rng.integers(out_lo, out_hi, endpoint=True))
            if rng.random() < fork_rate:  # forks after a random share of the decoding
                forks[seq] = int(rng.integers(0, left[seq]))
            order.append(seq)
            arrived += 1
        batch = [order.popleft() for _ in range(min(max_batch, len(order)))]
        chunk = [min(decode_chunk, left[s]) for s in batch]
        b.append(batch, chunk)
        for s, c in zip(batch, chunk):
            left[s] -= c
            if s in forks and left[s] <= forks[s]:
                del forks[s]
                child = b.fork(s)
                left[child] = int(rng.integers(out_lo, out_hi, endpoint=True))
                order.append(child)
            if left[s] == 0:
                del left[s]
                b.free(s)
            else:
                order.append(s)

    num_blocks = _budget("hybrid_windows", b.ops, spec, B, num_blocks, budget_fraction)
    return b.trace("hybrid_windows", params, seed, name="hybrid_windows",
                   groups=tuple(g.kind for g in spec.kv_groups),
                   settings={"model": model, "block_size": B, "num_blocks": num_blocks,
                             "prefix_caching": True})


def window_decode(seed: int = 0, *, model: str = "tiny-hybrid", rounds: int = 2,
                  block_size: int = 8, num_blocks: int | None = None) -> Trace:
    """Decoding on a model with a sliding window W, one token and several at a time, across
    block and window edges (SPEC §8). Each round, with B = ``block_size``:

    a (W - B .. W - 1 tokens: its window not yet full), b (W + 1 .. W + B: its first positions
    already out of it) and c (2W + 1 .. 2W + B); B + 2 one-token steps over [a, b, c] (each
    crosses a block edge, and b's and c's windows release a block); one step of B + 1 .. 2B - 1,
    2B .. 3B - 1 and 2 .. B - 1 tokens (a's window fills and slides, b releases two blocks or
    more at once); a fork a' of a, then 3 one-token steps over [a, a', b] (the shared tail
    copied in every group, a window sliding over blocks a and a' share); a' appends W tokens
    (its whole window released, each block still a's); everything freed in a random order.
    The budget (default: the most blocks the live sequences hold, every group counted,
    sharing ignored) refuses nothing.
    """
    params = _recorded(dict(locals()))
    spec = F.get_model(model)
    windows = [g.window for g in spec.kv_groups if g.window is not None]
    if not windows:
        raise ValueError(f"window_decode: model {model!r} has no sliding window")
    W = min(windows)
    # a step of 2 .. B - 1 tokens needs B >= 3; a prompt of W - B .. W - 1 tokens, B < W
    B = _positive_int("block_size", block_size, 3)
    if B >= W:
        raise ValueError(f"window_decode: block_size must be below the window ({W} on {model!r}), "
                         f"got {B}: prompts of W - B .. W - 1 tokens start inside the window")
    _positive_int("rounds", rounds)
    rng = np.random.default_rng(seed)
    b = _Builder()

    def draw(lo, hi):
        return int(rng.integers(lo, hi, endpoint=True))

    for _ in range(rounds):
        a = b.prefill(draw(W - B, W - 1))
        bb = b.prefill(draw(W + 1, W + B))
        c = b.prefill(draw(2 * W + 1, 2 * W + B))
        for _ in range(B + 2):
            b.append([a, bb, c], [1, 1, 1])
        b.append([a, bb, c], [draw(B + 1, 2 * B - 1), draw(2 * B, 3 * B - 1), draw(2, B - 1)])
        a2 = b.fork(a)
        for _ in range(3):
            b.append([a, a2, bb], [1, 1, 1])
        b.append([a2], [W])
        live = [a, bb, c, a2]
        for i in rng.permutation(len(live)).tolist():
            b.free(live[i])

    num_blocks = _budget("window_decode", b.ops, spec, B, num_blocks, 1.0)
    return b.trace("window_decode", params, seed, name="window_decode",
                   groups=tuple(g.kind for g in spec.kv_groups),
                   settings={"model": model, "block_size": B, "num_blocks": num_blocks})


def window_hits(seed: int = 0, *, model: str = "tiny-hybrid", rounds: int = 3,
                block_size: int = 8) -> Trace:
    """Prefix hits cut short by a sliding window, then older cached blocks reused (SPEC §8).

    On a model of full groups and one sliding group (window W), with B = ``block_size`` and K
    prompt blocks named by block hashes (new ones each round). Each round: a prefill of the
    whole budget's blocks of its own tokens, freed (every block free, none cached: the counts
    below hold in every round); a prefills the K blocks (its window releases the first ones
    into the cache) and decodes W tokens, B at a time (every prompt block of its sliding group
    released, hashed: cached); b prefills the first K - 1 blocks, a whole-prompt hit that takes
    back the sliding blocks of its window, and is freed (they go back to the cache, the most
    recent); c, of its own tokens, takes the G oldest cached blocks (G groups; no free one is
    left), among them the sliding group's block K - 1, and is freed. d prefills all K blocks:
    the full groups have every one (a holds them), the sliding group lacks block K - 1, so the
    hit is cut to K - 1 blocks, taking back the h older cached blocks of its window (K = h + G:
    the budget is what a holds plus its K cached blocks, and d's G new blocks and h cached ones
    are an exact fit). One of a and d (drawn from the seed) is freed, and e prefills the K blocks
    and 0 .. B - 1 tokens of its own: a whole hit, the full groups' block K - 1 the one a wrote
    (held or cached), the sliding group's the one d wrote; the other two are freed.
    """
    params = _recorded(dict(locals()))
    spec = F.get_model(model)
    groups = spec.kv_groups
    sliding = [g for g in groups if g.window is not None]
    if len(sliding) != 1 or any(g.releases for g in groups if g.window is None):
        raise ValueError(f"window_hits: model {model!r} must have one sliding group beside full ones")
    W, G = sliding[0].window, len(groups)
    B = _positive_int("block_size", block_size, 2)
    _positive_int("rounds", rounds)
    rng = np.random.default_rng(seed)
    h = len(F.held_blocks(W + B * (W // B + 2), sliding[0], B))  # a hit past the window needs h
    K = h + G
    steps = -(-W // B)  # a's decode: W tokens or more, B at a time
    num_blocks = sum(len(F.held_blocks((K + steps) * B, g, B)) for g in groups) + K
    if num_blocks % G:
        raise ValueError(f"window_hits: a budget of {num_blocks} blocks is no multiple of the "
                         f"{G} groups of model {model!r}: no prefill takes it all")
    b = _Builder()
    for r in range(rounds):
        b.free(b.prefill(num_blocks // G * B))
        hashes = [f"w{r}.{i}" for i in range(K)]
        a = b.prefill(K * B, block_hashes=hashes)
        for _ in range(steps):
            b.append([a], [B])
        b.free(b.prefill((K - 1) * B, block_hashes=hashes[:-1]))
        b.free(b.prefill(B))  # G blocks: the cache's G oldest
        d = b.prefill(K * B, block_hashes=hashes)
        first, second = rng.permutation([a, d]).tolist()
        b.free(first)
        e = b.prefill(K * B + int(rng.integers(B)), block_hashes=hashes)
        b.free(second)
        b.free(e)
    return b.trace("window_hits", params, seed, name="window_hits",
                   groups=tuple(g.kind for g in groups),
                   settings={"model": model, "block_size": B, "num_blocks": num_blocks,
                             "prefix_caching": True})  # as every replay of it (asv's too) runs


def _budget(family: str, ops, model, block_size: int, num_blocks, budget_fraction: float) -> int:
    """``num_blocks``, by default ``ceil(budget_fraction * peak)``, and never below what one
    operation takes (see :func:`_peak_and_demand`)."""
    peak, need = _peak_and_demand(ops, model, block_size)
    if num_blocks is None:
        if not 0 < budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction!r}")
        num_blocks = max(need, math.ceil(budget_fraction * peak))
    _positive_int("num_blocks", num_blocks)
    if num_blocks < need:
        raise ValueError(f"{family}: num_blocks={num_blocks} must be >= {need} (the most "
                         f"one operation takes)")
    return num_blocks


def _peak_and_demand(ops, model, block_size: int) -> tuple[int, int]:
    """Upper bounds, sharing ignored: the most blocks the live sequences hold over every group
    (sum_g blocks_g(T)), and the most one operation takes before its windows slide (a prefill
    writes every position in every group)."""
    G = len(model.kv_groups)
    held, peak, need = {}, 0, 0
    for op, length, touched in _walk(ops):
        if isinstance(op, Prefill):
            need = max(need, G * F.blocks_needed(op.tokens, block_size))
        elif isinstance(op, Free):
            del held[op.seq]
        for s in touched:
            held[s] = F.request_blocks(length[s], model, block_size)
        peak = max(peak, sum(held.values()))
    return peak, need


def _tenants(tenants) -> list:
    if not isinstance(tenants, (list, tuple)) or not tenants:
        raise ValueError(f"tenants must be a non-empty list of dicts, got {tenants!r}")
    out = []
    for i, t in enumerate(tenants):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise ValueError(f"tenants[{i}] must be a dict with a non-empty string 'name', got {t!r}")
        unknown = set(t) - {"name", "salt", "adapter"}
        if unknown:
            raise ValueError(f"tenants[{i}] ({t['name']!r}) has unknown key(s) {sorted(unknown)}; "
                             f"known: name, salt, adapter")
        for key in ("salt", "adapter"):
            if t.get(key) is not None and (not isinstance(t[key], str) or not t[key]):
                raise ValueError(f"tenants[{i}] ({t['name']!r}): {key} must be a non-empty string")
        out.append({k: t[k] for k in ("name", "salt", "adapter") if t.get(k) is not None})
    return out


__all__ = ["hybrid_windows", "window_decode", "window_hits", "TENANTS"]
