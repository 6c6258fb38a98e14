"""SPEC §10: figures a backend reports about its own memory must agree with each other.

Checked after every operation, before the ledger is compared with the oracle: each function
returns the first identity that fails as ``(quantity, expected, actual, detail)``, or None.
They read only what the backend reports (its ledger, and its block structures when it exposes
them), so they hold any backend, engines included, to the same arithmetic. Also here: the
explanation of a hit across salts (SPEC §9), which names both requests.
"""
from __future__ import annotations

import numbers

import numpy as np

from kvbench.checking.raised import BackendRaised, guarded
from kvbench.contract.ledger import named
from kvbench.contract.protocol import BlockState, CacheConfig, Ledger

COUNT_FIELDS = named(count=True)  # never negative: numbers, each entry of a dict or a tuple


class Figures:
    """The checks of one replay: the ledger's identities after every operation; the block
    structures while the backend exposes them (else ``skipped`` says so), the whole pool after
    every operation and the tables of the sequences it changed (all of them when ``seqs`` is
    None); and, for a backend declaring ``block_ids``, those tables (and, whole, the free and
    cached order) block id for block id against the oracle's."""

    def __init__(self, backend, oracle, paged: bool, skipped: dict):
        self.backend, self.oracle, self.paged, self.skipped = backend, oracle, paged, skipped
        self.structures = backend is not None and paged  # until block_state() says otherwise
        self.exact = self.structures and backend.capabilities.block_ids
        self.edits, self.state = -1, None

    def check(self, led: Ledger, seqs=None):
        config = self.backend.config
        why = ledger_identities(led, config, self.paged)
        self.state = None
        if why is not None or not self.structures:
            return why
        if seqs is not None and self.oracle.edits == self.edits:
            return None  # no reference moved: the ledger comparison covers the rest
        self.edits = self.oracle.edits
        try:
            state = guarded("block_state", self.backend.block_state, seqs)
        except BackendRaised as e:
            if not isinstance(e.error, NotImplementedError):
                raise
            self.structures = self.exact = False
            self.skipped["block structures"] = f"{self.backend.name} does not expose block_state()"
            return None
        self.state = state
        if seqs is not None:  # the pool-wide identities with the whole ledger (amortised O(1))
            return table_identities(state, config)
        return structure_identities(state, led, config, whole=True)

    def block_ids(self, seqs=None):
        """After the ledger agreed with the oracle: the block ids of the last ``check``."""
        if not self.exact or self.state is None:
            return None
        return compare_structures(self.oracle.block_state(seqs), self.state, whole=seqs is None)


def cross_salt(oracle, seq, quantity, expected, actual) -> str:
    """Name both requests when a prefill found more in the cache than its own extra keys allow,
    and another request wrote the same prompt under other ones (SPEC §9); '' otherwise."""
    more = (quantity == "prefix_hit_blocks" and actual > expected) or (
        quantity in ("blocks_used", "blocks_free", "free") and actual != expected)
    writers = oracle.cross_key_writers(seq) if more else []
    if not writers:
        return ""
    st = oracle.seqs.get(seq) or oracle.preempted.get(seq)
    other, extra = writers[0]
    return (f"a hit across salts: sequence {seq} ({_extra_text(st.prompt.get('extra', ()))}) may "
            f"share no block with sequence {other} ({_extra_text(extra)}), which wrote the same "
            f"prompt blocks")


def _extra_text(extra) -> str:
    return ", ".join(f"{kind} {v!r}" for kind, v in extra) or "no salt, no adapter"


def ledger_identities(led: Ledger, config: CacheConfig, paged: bool):
    """used + free = total; no count negative; cached blocks on the free side once; the
    per-group blocks add up; token capacity and the two usages from the same counts."""
    why = _negative_count(led)
    if why is not None:
        return why
    N, B = config.num_blocks, config.block_size
    if paged:
        if led.blocks_used + led.blocks_free != N:
            return ("blocks_used + blocks_free", N, led.blocks_used + led.blocks_free,
                    f"used {led.blocks_used} + free {led.blocks_free} must be the pool "
                    f"(cached blocks counted once, on the free side)")
        if led.cached_blocks > led.blocks_free:
            return ("cached_blocks", f"<= blocks_free ({led.blocks_free})", led.cached_blocks,
                    "evictable + protected + free must be the pool: a cached block is free")
        if led.group_blocks and sum(led.group_blocks) != led.blocks_used:
            return ("sum of group_blocks", led.blocks_used, sum(led.group_blocks),
                    "every block in use serves one group")
    slots = N * B
    if led.token_capacity is not None and led.token_capacity != slots:
        return ("token_capacity", slots, led.token_capacity,
                f"num_blocks * block_size = {N} * {B} per group")
    if paged and led.block_usage is not None and not _close(led.block_usage, led.blocks_used / N if N else 0.0):
        return "block_usage", led.blocks_used / N if N else 0.0, led.block_usage, "blocks_used / num_blocks"
    if led.slot_usage is not None and not _close(led.slot_usage, led.token_states / slots if slots else 0.0):
        return ("slot_usage", led.token_states / slots if slots else 0.0, led.slot_usage,
                "token_states / (num_blocks * block_size): usage by slots, beside usage by blocks")
    return None


def _negative_count(led: Ledger):
    """The first count below 0: numbers first, then per-sequence entries, then tuple entries."""
    values = [(f, getattr(led, f)) for f in COUNT_FIELDS]
    for f, v in values:
        if isinstance(v, numbers.Real) and v < 0:
            return f, ">= 0", v, "no count is ever negative"
    for f, v in values:
        if isinstance(v, dict):
            bad = next(((s, n) for s, n in v.items() if n < 0), None)
            if bad:
                return f"{f} of sequence {bad[0]}", ">= 0", bad[1], "no count is ever negative"
    for f, v in values:
        if isinstance(v, tuple) and any(n < 0 for n in v):
            return f, ">= 0 each", v, "no count is ever negative"
    return None


def structure_identities(state: BlockState, led: Ledger, config: CacheConfig, whole: bool = True):
    """No block twice in the free structure, nor free and in use (or in a table) at once; the
    structures agree with the ledger's counts (evictable + protected + free = pool); a held
    block has a reference, and (``whole``: every table given) one per table that holds it and
    serves one group. Vectorized over the pool: O(num_blocks) array work per call."""
    N = config.num_blocks
    free = np.asarray(state.free, dtype=np.int64).reshape(-1)
    cached = np.asarray(state.cached, dtype=np.int64).reshape(-1)
    pooled = np.concatenate([free, cached])
    ref = np.asarray(state.refcount, dtype=np.int64).reshape(-1)
    if len(ref) != N:
        return "reference counts", f"{N} (one per block)", len(ref), "block_state().refcount covers the pool"
    out = pooled[(pooled < 0) | (pooled >= N)]
    if len(out):
        return "block ids", f"in 0..{N - 1}", int(out[0]), "a free block id outside the pool"
    seen = np.bincount(pooled, minlength=N)
    if len(pooled) and seen.max() > 1:
        b = int(seen.argmax())
        return ("free blocks", "each block once", f"block {b} {seen[b]} times",
                "a block appears twice in the free structure: the free count runs high")
    neg = np.flatnonzero(ref < 0)
    if len(neg):
        return f"reference count of block {neg[0]}", ">= 0", int(ref[neg[0]]), "no count is ever negative"
    both = np.flatnonzero((seen > 0) & (ref > 0))
    if len(both):
        return (f"block {both[0]}", "free or in use", "both",
                f"in the free structure with {ref[both[0]]} reference(s)")
    if len(pooled) != led.blocks_free:
        return ("blocks_free", len(pooled), led.blocks_free,
                f"the free structure holds {len(free)} + {len(cached)} cached blocks")
    if len(cached) != led.cached_blocks:
        return "cached_blocks", len(cached), led.cached_blocks, "the cached (evictable) blocks listed"
    used = int(np.count_nonzero(ref))
    if len(pooled) + used != N:
        return ("evictable + protected + free", N, len(pooled) + used,
                f"{len(cached)} evictable + {used} in use + {len(free)} free")
    holders = np.zeros(N, dtype=np.int64)
    group = np.full(N, -1, dtype=np.int64)
    for g, (ids, owner) in enumerate(_flatten(state.tables)):
        held = ids != -1
        ids, owner = ids[held], owner[held]
        bad = np.flatnonzero((ids < 0) | (ids >= N))
        if len(bad):
            return "block ids", f"in 0..{N - 1}", int(ids[bad[0]]), f"in the table of sequence {owner[bad[0]]}"
        unheld = np.flatnonzero((ref[ids] < 1) | (seen[ids] > 0))
        if len(unheld):
            b, s = int(ids[unheld[0]]), int(owner[unheld[0]])
            return (f"block {b}", "in use while a table holds it",
                    "free" if seen[b] else f"{ref[b]} references", f"sequence {s} holds it in group {g}")
        other = np.flatnonzero(group[ids] != -1)
        if len(other):
            b, s = int(ids[other[0]]), int(owner[other[0]])
            return (f"block {b}", f"in tables of group {group[b]} only", f"also in group {g}",
                    f"sequence {s} holds in group {g} a block that serves group {group[b]}")
        np.add.at(holders, ids, 1)
        group[ids] = g
    if whole:
        wrong = np.flatnonzero(holders != ref)
        if len(wrong):
            b = int(wrong[0])
            return (f"reference count of block {b}", int(holders[b]), int(ref[b]),
                    "one reference per table that holds it (a free call drops one per sequence)")
    return None


def table_identities(state: BlockState, config: CacheConfig):
    """The tables given (the sequences an operation changed): every held block id lies in the
    pool and has a reference. O(blocks of those tables)."""
    N = config.num_blocks
    ref = state.refcount
    for g, (ids, owner) in enumerate(_flatten(state.tables)):
        held = ids != -1
        ids, owner = ids[held], owner[held]
        bad = np.flatnonzero((ids < 0) | (ids >= N))
        if len(bad):
            return "block ids", f"in 0..{N - 1}", int(ids[bad[0]]), f"in the table of sequence {owner[bad[0]]}"
        unheld = np.flatnonzero(np.asarray(ref)[ids] < 1) if len(ids) else []
        if len(unheld):
            b, s = int(ids[unheld[0]]), int(owner[unheld[0]])
            return (f"block {b}", "in use while a table holds it", f"{ref[b]} references",
                    f"sequence {s} holds it in group {g}")
    return None


def _flatten(tables: dict) -> list:
    """Per group: every table entry of the given sequences (in sequence order) and its owner."""
    seqs = sorted(tables)
    if not seqs:
        return []
    out = []
    for g in range(len(tables[seqs[0]])):
        parts = [np.asarray(tables[s][g], dtype=np.int64).reshape(-1) for s in seqs]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        out.append((ids, np.repeat(np.asarray(seqs, dtype=np.int64), [len(p) for p in parts])))
    return out


def compare_structures(expected: BlockState, actual: BlockState, whole: bool = True):
    """Block ids one by one (a backend declaring ``block_ids``): the tables of the sequences
    ``expected`` covers and, ``whole``, the free order and the cached order."""
    same = set(expected.tables) <= set(actual.tables) and all(
        np.array_equal(e_ids, a_ids) and np.array_equal(e_own, a_own) for (e_ids, e_own), (a_ids, a_own)
        in zip(_flatten(expected.tables), _flatten({s: actual.tables[s] for s in expected.tables})))
    if not same:  # which sequence and group
        for s in sorted(expected.tables):
            e, a = expected.tables[s], actual.tables.get(s)
            for g in range(len(e)):
                want = [int(b) for b in e[g]]
                got = None if a is None or g >= len(a) else [int(b) for b in a[g]]
                if want != got:
                    return f"block table of sequence {s}, group {g}", want, got, ""
    if whole:
        for name, e, a in (("free blocks (next taken first)", expected.free, actual.free),
                           ("cached blocks (next evicted first)", expected.cached, actual.cached)):
            e, a = [int(b) for b in e], [int(b) for b in a]
            if e != a:
                return name, e, a, _first_difference(e, a)
    return None
def _first_difference(e, a) -> str:
    e, a = list(e), list(a)
    i = next((i for i, (x, y) in enumerate(zip(e, a)) if x != y), min(len(e), len(a)))
    return f"first difference at position {i} of {len(e)} expected, {len(a)} listed"


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12
