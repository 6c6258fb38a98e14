"""SPEC §10: figures a backend reports about its own memory must agree with each other.

Checked after every operation, before the ledger is compared with the oracle: each function
returns the first identity that fails as ``(quantity, expected, actual, detail)``, or None.
They read only what the backend reports (its ledger, and its block structures when it exposes
them), so they hold any backend, engines included, to the same arithmetic. Also here: the
explanation of a hit across salts (SPEC §9), which names both requests.
"""
from __future__ import annotations

from collections import Counter

from kvbench.contract.protocol import BlockState, CacheConfig, Ledger

COUNT_FIELDS = ("blocks_used", "blocks_free", "capacity_slots", "free_slots", "bytes_in_use",
                "shared_blocks", "token_states", "reservation", "internal_fragmentation",
                "external_fragmentation", "free", "cached_blocks", "prefix_hit_blocks")


class Figures:
    """The checks of one replay: the ledger's identities always; the block structures' while
    the backend exposes them (else ``skipped`` says so); block ids one by one when it declares
    ``block_ids``."""

    def __init__(self, backend, paged: bool, skipped: dict):
        self.backend, self.paged, self.skipped = backend, paged, skipped
        self.structures = backend is not None and paged  # until block_state() says otherwise
        self.exact = self.structures and backend.capabilities.block_ids

    def check(self, led: Ledger):
        config = self.backend.config
        why = ledger_identities(led, config, self.paged)
        if why is None and self.structures:
            try:
                state = self.backend.block_state()
            except NotImplementedError:
                self.structures = self.exact = False
                self.skipped["block structures"] = f"{self.backend.name} does not expose block_state()"
                return None
            why = structure_identities(state, led, config)
        return why

    def block_ids(self, oracle):
        if not self.exact:
            return None
        return compare_structures(oracle.block_state(), self.backend.block_state())


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
    for f in COUNT_FIELDS:
        v = getattr(led, f)
        if v is not None and v < 0:
            return f, ">= 0", v, "no count is ever negative"
    for f in ("tokens", "seq_blocks"):
        bad = next(((s, v) for s, v in getattr(led, f).items() if v < 0), None)
        if bad:
            return f"{f} of sequence {bad[0]}", ">= 0", bad[1], "no count is ever negative"
    if any(v < 0 for v in led.group_blocks):
        return "group_blocks", ">= 0 each", led.group_blocks, "no count is ever negative"
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


def structure_identities(state: BlockState, led: Ledger, config: CacheConfig):
    """No block twice in the free structure, nor free and in a table at once; the structures
    agree with the ledger's counts (evictable + protected + free = pool); a block in use has
    one reference per table that holds it, and serves one group."""
    N = config.num_blocks
    free = list(state.free) + list(state.cached)
    seen = Counter(free)
    twice = sorted(b for b, c in seen.items() if c > 1)
    if twice:
        return ("free blocks", "each block once", f"block {twice[0]} {seen[twice[0]]} times",
                "a block appears twice in the free structure: the free count runs high")
    out = [b for b in free if not 0 <= b < N]
    holders: Counter = Counter()
    group: dict = {}
    for s, tables in state.tables.items():
        for g, table in enumerate(tables):
            for b in table:
                if b == -1:
                    continue
                holders[b] += 1
                if group.setdefault(b, g) != g:
                    return (f"block {b}", f"in tables of group {group[b]} only", f"also in group {g}",
                            f"sequence {s} holds in group {g} a block that serves group {group[b]}")
    out += [b for b in holders if not 0 <= b < N]
    if out:
        return "block ids", f"in 0..{N - 1}", out[0], "a block id outside the pool"
    both = sorted(set(seen) & set(holders))
    if both:
        owners = sorted(s for s, ts in state.tables.items() if any(both[0] in t for t in ts))
        return (f"block {both[0]}", "free or in a table", "both",
                f"free while sequences {owners} hold it")
    if len(free) != led.blocks_free:
        return ("blocks_free", len(free), led.blocks_free,
                f"the free structure holds {len(state.free)} + {len(state.cached)} cached blocks")
    if len(state.cached) != led.cached_blocks:
        return "cached_blocks", len(state.cached), led.cached_blocks, "the cached (evictable) blocks listed"
    if len(free) + len(holders) != N:
        return ("evictable + protected + free", N, len(free) + len(holders),
                f"{len(state.cached)} evictable + {len(holders)} in tables + {len(state.free)} free")
    for b, n in sorted(holders.items()):
        ref = state.refcount.get(b, 0)
        if ref != n:
            return (f"reference count of block {b}", n, ref,
                    f"one reference per table that holds it (a free call drops one per sequence)")
    stray = sorted(set(state.refcount) - set(holders))
    if stray:
        return (f"reference count of block {stray[0]}", 0, state.refcount[stray[0]],
                "a block no table holds has no reference")
    return None


def compare_structures(expected: BlockState, actual: BlockState):
    """Block ids one by one (a backend declaring ``block_ids``): free order, cached order,
    every table."""
    for name, e, a in (("free blocks (next taken first)", expected.free, actual.free),
                       ("cached blocks (next evicted first)", expected.cached, actual.cached)):
        if list(e) != list(a):
            return name, list(e), list(a), _first_difference(e, a)
    for s in sorted(expected.tables):
        e, a = expected.tables[s], actual.tables.get(s)
        if a is None or [list(t) for t in a] != [list(t) for t in e]:
            g = next((g for g in range(len(e)) if a is None or g >= len(a) or list(a[g]) != list(e[g])), 0)
            return (f"block table of sequence {s}, group {g}", list(e[g]),
                    None if a is None or g >= len(a) else list(a[g]), "")
    return None


def _first_difference(e, a) -> str:
    e, a = list(e), list(a)
    i = next((i for i, (x, y) in enumerate(zip(e, a)) if x != y), min(len(e), len(a)))
    return f"first difference at position {i} of {len(e)} expected, {len(a)} listed"


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12
