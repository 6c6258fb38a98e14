"""Trace families at the edges of a cache: the budget's last block, wide forks, long histories.

The other families keep their requests inside the budget, or evict under a tenant mix where
evicting everyone always suffices; a backend's refusal path and its bookkeeping at scale then go
untested. These are built so that the default suite reaches them:

- ``refusals``: a pool filled to its last free block (block sizes of Mooncake, 256 and 512;
  prompts over 16 blocks); prefills, copy-on-write appends and batched appends refused for lack
  of a block (one batch refused at its third writer, after two that alone would fit), appends
  and prefills that take exactly the blocks that are free, forks three levels deep.
- ``eviction_edges``: a tenant mix (so runs use every policy) where an append and a prefill need
  exactly what evicting every candidate frees, a prefill one block short of that (refused, no
  victim), a victim whose eviction lowers the need (it shared the writer's tail), and an evicted
  sequence whose recompute is refused, then done once room is made.
- ``wide_forks``: parallel sampling with more than 127 sharers of every prompt block and more
  than 64 live sequences, from a prompt of more than 16 blocks; the first decode step copies the
  shared tail for every writer but the last, taking the pool's last free block.
- ``decode_edges``: eviction right after a decode step of more sequences than a scalar fast path
  takes (9 or more), and right after a fork; a decode step whose writers spill several full
  tails while some, but too few, blocks are free (refused with no candidate, then one victim).
- ``long_history``: thousands of operations over a small pool, so block ids are reused many
  times and sequence ids pass a thousand; forks of forks of forks; refusals along the way
  (checked ledger-only: its header says so).

The block arithmetic below is SPEC §2's with no prefix caching: each planned figure is stated
where it is set, and tests replay the traces through the oracle to confirm each edge is met.
"""
from __future__ import annotations

import numpy as np

from kvbench.traces.builder import _Builder, _recorded
from kvbench.traces.format import Trace
from kvbench.traces.laws import _pair, _positive_int


def _tokens(rng, blocks: int, B: int, room: int = 2) -> int:
    """Tokens filling ``blocks`` blocks with a partial tail that has at least ``room`` free slots."""
    return (blocks - 1) * B + int(rng.integers(1, B - room, endpoint=True))


def refusals(seed: int = 0, *, block_size: int = 256, num_blocks: int = 40, rounds: int = 3,
             prompt_blocks=(17, 20)) -> Trace:
    """Rounds over an empty pool of ``num_blocks`` blocks (no eviction policy: what does not fit
    is refused). In each round, with N blocks and a prompt ``a`` of ``prompt_blocks``:

    ``a`` is prefilled and forked (``a1``); ``b`` takes every block but one; a prefill of 2
    blocks is refused; a batch [b, a1, a] is refused (b fits its tail, a1 copies the shared tail
    into the last block, a then needs one more); a1 alone copies into the last block (exact);
    a fills its tail exactly, then one more token is refused; a1 forks a11, a11 forks a111,
    whose copy-on-write is refused; b is freed; a prefill of one block more than b had is
    refused and one of exactly as many fits; a batch of two copies is refused, then fits once
    that prefill is freed; everything is freed in random order.
    """
    params = _recorded(locals())
    B = _positive_int("block_size", block_size, 4)
    N = _positive_int("num_blocks", num_blocks)
    _positive_int("rounds", rounds)
    lo, hi = _pair("prompt_blocks", prompt_blocks)
    if N < hi + 3:
        raise ValueError(f"refusals: num_blocks={N} must be >= {hi + 3} (the longest prompt, "
                         f"2 blocks of b's and the last free one)")
    rng = np.random.default_rng(seed)
    b = _Builder()
    for _ in range(rounds):
        n_a = int(rng.integers(lo, hi, endpoint=True))
        a = b.prefill(_tokens(rng, n_a, B))
        fill_a = b.length[a] - (n_a - 1) * B
        a1 = b.fork(a)
        n_b = N - n_a - 1
        bb = b.prefill(_tokens(rng, n_b, B))  # free: 1 block
        fill_b = b.length[bb] - (n_b - 1) * B
        c = b.prefill(B + int(rng.integers(1, B)))  # 2 blocks: refused
        # b: within its tail (0 blocks); a1: a copy of the shared tail (1); a: 1 new block.
        b.append([bb, a1, a], [int(rng.integers(1, B - fill_b, endpoint=True)), 1,
                               B - fill_a + int(rng.integers(1, B, endpoint=True))])
        b.append([a1], [1])  # the copy takes the last free block
        b.append([a], [B - fill_a])  # a's tail, now private, filled exactly: 0 blocks
        b.append([a], [1])  # 1 block, none free: refused
        a11 = b.fork(a1)
        a111 = b.fork(a11)
        b.append([a111], [1])  # a copy of the tail a1, a11, a111 share: none free, refused
        b.free(bb)  # free: n_b blocks
        c2 = b.prefill(n_b * B + int(rng.integers(1, B, endpoint=True)))  # n_b + 1: refused
        c3 = b.prefill(_tokens(rng, n_b, B, room=0))  # exactly n_b
        b.append([a111, a11], [1, 1])  # two copies, none free: refused
        b.free(c3)
        b.append([a111, a11, a1], [1, 1, 1])  # two copies (n_b >= 2 free), a1 in place
        rest = [c, c2, a, a1, a11, a111]
        for i in rng.permutation(len(rest)).tolist():
            b.free(rest[i])
    return b.trace("refusals", params, seed, name="refusals",
                   settings={"block_size": B, "num_blocks": N})


def eviction_edges(seed: int = 0, *, block_size: int = 512, num_blocks: int = 24,
                   rounds: int = 3, tenants=None) -> Trace:
    """Rounds of eviction at the budget's edge, under a tenant mix (every policy runs it).

    Each round: x and three candidates y1..y3 (y2 touched again); x appends exactly the free
    blocks plus all the candidates hold: every candidate goes, and that is just enough. Then
    p and q; a prefill of one block more than the pool (refused, nothing evicted); one of exactly
    the pool (p and q evicted); a batch [p, r] whose recompute of p finds no candidate (refused,
    the append dropped); r freed, p and q recomputed. Then u, its fork u' sharing u's partial
    tail, and v filling the pool: u's append needs one copy, and evicting u' (the oldest)
    removes that need: it is the only victim.
    """
    if tenants is None:
        tenants = {"fg": 2, "bg": 1}
    params = _recorded(dict(locals(), tenants=dict(tenants)))
    B = _positive_int("block_size", block_size, 4)
    N = _positive_int("num_blocks", num_blocks, 16)
    _positive_int("rounds", rounds)
    names = sorted(tenants)
    rng = np.random.default_rng(seed)
    b = _Builder()

    def tenant():
        return names[int(rng.integers(len(names)))]

    for _ in range(rounds):
        n_x = int(rng.integers(2, 4, endpoint=True))
        x = b.prefill(_tokens(rng, n_x, B), tenant())
        fill_x = b.length[x] - (n_x - 1) * B
        ys, held = [], 0
        for _ in range(3):
            n_y = int(rng.integers(1, 3, endpoint=True))
            ys.append(b.prefill(_tokens(rng, n_y, B), tenant()))
            held += n_y
        b.append([ys[1]], [1])  # y2 used twice, last: the policies order the victims differently
        free = N - n_x - held
        # free + held new blocks exactly: (free + held) * B - k tokens past x's tail, 0 <= k < B
        b.append([x], [B - fill_x + (free + held) * B - int(rng.integers(0, B))])
        b.free(x)
        n_p, n_q = int(rng.integers(1, 4, endpoint=True)), int(rng.integers(1, 4, endpoint=True))
        p = b.prefill(_tokens(rng, n_p, B), tenant())
        q = b.prefill(_tokens(rng, n_q, B), tenant())
        r0 = b.prefill(N * B + int(rng.integers(1, B, endpoint=True)), tenant())  # N + 1: refused
        r = b.prefill(_tokens(rng, N, B, room=0), tenant())  # exactly N: p and q evicted
        b.append([p, r], [1, 1])  # p's recompute: r is protected, no candidate: refused
        b.free(r)
        b.append([p], [1])  # recomputed now
        b.append([q], [1])
        b.free(p)
        b.free(q)
        n_u = int(rng.integers(2, 4, endpoint=True))
        u = b.prefill(_tokens(rng, n_u, B), tenant())
        u2 = b.fork(u)
        v = b.prefill(_tokens(rng, N - n_u, B), tenant())  # the pool full
        b.append([u], [1])  # a copy of the shared tail: u2 (oldest) evicted, the need is 0
        rest = ys + [r0, u, u2, v]
        for i in rng.permutation(len(rest)).tolist():
            b.free(rest[i])
    return b.trace("eviction_edges", params, seed, name="eviction_edges",
                   tenants={t: tenants[t] for t in names},
                   settings={"block_size": B, "num_blocks": N})


def wide_forks(seed: int = 0, *, block_size: int = 16, prompt_blocks=(17, 24), width: int = 130,
               depth: int = 3) -> Trace:
    """Parallel sampling, wide: a prompt of ``prompt_blocks`` forked into ``width`` branches,
    and a chain of ``depth`` forks of forks from the first branch; every prompt block then has
    ``width + depth - 1`` sharers. The pool holds the prompt and one block per branch but one:
    the first decode step (every branch, 1 token) copies the shared tail for every writer but
    the last and takes the last free block. Branches decode until their tails are full; the next
    step is refused (no block free); half the branches are freed and the other half takes
    exactly the blocks they held. Then everything is freed, in random order.
    """
    params = _recorded(locals())
    B = _positive_int("block_size", block_size, 4)
    lo, hi = _pair("prompt_blocks", prompt_blocks)
    _positive_int("width", width, 2)
    _positive_int("depth", depth)
    rng = np.random.default_rng(seed)
    b = _Builder()
    n = int(rng.integers(lo, hi, endpoint=True))
    root = b.prefill(n * B - int(rng.integers(2, 3, endpoint=True)))  # 2 or 3 free tail slots
    branches = [root] + [b.fork(root) for _ in range(width - 1)]
    parent = branches[1]
    for _ in range(depth - 1):
        parent = b.fork(parent)
        branches.append(parent)
    live = len(branches)
    fill = b.length[root] - (n - 1) * B
    for _ in range(B - fill):  # the first step copies the tail; the rest fill the copies
        b.append(branches, [1] * live)
    b.append(branches, [1] * live)  # every tail full, no block free: refused
    gone = set(rng.permutation(live)[:live // 2].tolist())
    for i in sorted(gone):
        b.free(branches[i])
    # Each freed branch gave back its private tail (the prompt's blocks stay shared): the
    # same number of branches takes exactly those blocks.
    kept = [s for i, s in enumerate(branches) if i not in gone][:live // 2]
    b.append(kept, [1] * len(kept))
    for i in rng.permutation(live).tolist():
        if i not in gone:
            b.free(branches[i])
    return b.trace("wide_forks", params, seed, name="wide_forks",
                   settings={"block_size": B, "num_blocks": n + live - 1})


def decode_edges(seed: int = 0, *, block_size: int = 16, num_blocks: int = 16, rounds: int = 2,
                 width=(9, 12), spill=(2, 4), tenants=None) -> Trace:
    """Rounds over an empty pool of ``num_blocks`` blocks, under a tenant mix (every policy runs
    it), each of three parts that free everything they made:

    - a wide decode step: z, then ``width`` one-block sequences, z decodes one token, then the
      wide batch (one token each, into tails with room: no block taken); a prefill of the free
      blocks plus one evicts one victim, chosen on what the wide step just recorded: z, last
      used before it and used as often (LRU and LFU).
    - a fork: x (1 or 2 blocks), y (1 block, touched again), x' forked from x; a prefill of the
      free blocks plus one: x goes first and frees nothing (x' shares it all), then y (LRU),
      whose block is enough.
    - a spill: ``spill`` sequences with full tails, g and v filling the pool but ``f`` blocks,
      0 < f < spill; a decode step of every live sequence needs ``spill`` blocks: refused (no
      candidate); then the same step without v: v is the only victim, and its blocks suffice.
    """
    if tenants is None:
        tenants = {"fg": 2, "bg": 1}
    params = _recorded(dict(locals(), tenants=dict(tenants)))
    B = _positive_int("block_size", block_size, 4)
    N = _positive_int("num_blocks", num_blocks)
    _positive_int("rounds", rounds)
    w_lo, w_hi = _pair("width", width)
    k_lo, k_hi = _pair("spill", spill)
    if k_lo < 2 or N < max(w_hi + 2, 3 * k_hi):
        raise ValueError(f"decode_edges: spill must start at 2 or more and num_blocks={N} hold the "
                         f"widest batch, z and a free block ({w_hi + 2}), and the largest spill "
                         f"k={k_hi} with as many blocks for v, k - 1 free and one for g ({3 * k_hi})")
    names = sorted(tenants)
    rng = np.random.default_rng(seed)
    b = _Builder()

    def tenant():
        return names[int(rng.integers(len(names)))]

    def free_all(seqs):
        for i in rng.permutation(len(seqs)).tolist():
            b.free(seqs[i])

    for _ in range(rounds):
        w = int(rng.integers(w_lo, w_hi, endpoint=True))
        z = b.prefill(_tokens(rng, 1, B), tenant())
        wide = [b.prefill(_tokens(rng, 1, B), tenant()) for _ in range(w)]
        b.append([z], [1])
        b.append(wide, [1] * w)  # every tail has room (2+ free slots): no block taken
        r = b.prefill(_tokens(rng, N - w, B), tenant())  # free N - 1 - w, plus 1: z's block
        free_all([z, r] + wide)

        n_x = int(rng.integers(1, 2, endpoint=True))
        x = b.prefill(_tokens(rng, n_x, B), tenant())
        y = b.prefill(_tokens(rng, 1, B), tenant())
        b.append([y], [1])
        x2 = b.fork(x)
        r = b.prefill(_tokens(rng, N - n_x, B), tenant())  # free N - n_x - 1, plus 1: y's block
        free_all([x, y, x2, r])

        k = int(rng.integers(k_lo, k_hi, endpoint=True))
        f = int(rng.integers(1, k - 1, endpoint=True))
        full = [b.prefill(B, tenant()) for _ in range(k)]  # tails full: each writer spills
        n_v = k  # k - f <= n_v: v's blocks cover what is missing
        v = b.prefill(_tokens(rng, n_v, B), tenant())
        g = b.prefill(_tokens(rng, N - f - k - n_v, B), tenant())  # f blocks left free
        b.append(full + [g, v], [1] * (k + 2))  # k blocks, f free, no candidate: refused
        b.append(full + [g], [1] * (k + 1))  # v evicted (the only candidate): f + n_v >= k
        free_all(full + [g, v])
    return b.trace("decode_edges", params, seed, name="decode_edges",
                   tenants={t: tenants[t] for t in names},
                   settings={"block_size": B, "num_blocks": N})


def long_history(seed: int = 0, *, num_ops: int = 10000, block_size: int = 16,
                 num_blocks: int = 48, max_live: int = 10, prompt_tokens=(1, 64),
                 max_tokens: int = 160, fork_depth: int = 3) -> Trace:
    """A long random history over a small pool: at least ``num_ops`` operations (then every
    live sequence is freed). Each step prefills a new sequence (up to ``max_live``), forks one
    (up to ``fork_depth`` forks of forks), frees one, or appends 1 to ``block_size + 3`` tokens
    to each of a few; a sequence past ``max_tokens`` is freed. With no eviction policy, what
    does not fit is refused, and later operations on a refused sequence are dropped. The header
    asks for a ledger-only check (``store_kv: false``): the point is the bookkeeping of a long
    history (every figure and block id after each operation), at a cost the default run bears.
    """
    params = _recorded(locals())
    B = _positive_int("block_size", block_size)
    _positive_int("num_ops", num_ops)
    _positive_int("num_blocks", num_blocks)
    _positive_int("max_live", max_live)
    p_lo, p_hi = _pair("prompt_tokens", prompt_tokens)
    _positive_int("max_tokens", max_tokens)
    _positive_int("fork_depth", fork_depth)
    rng = np.random.default_rng(seed)
    b, depth = _Builder(), {}
    while len(b.ops) < num_ops:
        live = list(b.length)
        u = rng.random()
        if len(live) < max_live and (u < 0.2 or not live):
            depth[b.prefill(int(rng.integers(p_lo, p_hi, endpoint=True)))] = 0
        elif u < 0.3:
            src = live[int(rng.integers(len(live)))]
            if depth[src] < fork_depth:
                depth[b.fork(src)] = depth[src] + 1
        elif u < 0.4:
            b.free(live.pop(int(rng.integers(len(live)))))
        else:
            k = int(rng.integers(1, min(4, len(live)), endpoint=True))
            pick = sorted(rng.choice(len(live), size=k, replace=False).tolist())
            seqs = [live[i] for i in pick]
            b.append(seqs, rng.integers(1, B + 3, size=k, endpoint=True).tolist())
            for s in seqs:
                if b.length[s] > max_tokens:
                    b.free(s)
    for s in list(b.length):
        b.free(s)
    return b.trace("long_history", params, seed, name="long_history",
                   settings={"block_size": B, "num_blocks": num_blocks, "store_kv": False})


__all__ = ["refusals", "eviction_edges", "wide_forks", "decode_edges", "long_history"]
