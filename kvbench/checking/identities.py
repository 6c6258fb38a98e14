"""SPEC §10: figures a backend reports about its own memory must agree with each other.

Checked after every operation, before the ledger is compared with the oracle: each function
returns the first identity that fails as ``(quantity, expected, actual, detail)``, or None.
They read only what the backend reports (its ledger, and its block structures when it exposes
them), so they hold any backend, engines included, to the same arithmetic. Also here: the
explanation of a hit across salts (SPEC §9), which names both requests.

Over 500 lines: the identities over the whole pool, the Mirror that checks the same identities
at an operation's blocks, and the references a tier's leases add are one arithmetic (each reads
the others' counts); split, every part would import the rest.
"""
from __future__ import annotations

import numbers
from collections import OrderedDict

import numpy as np

from kvbench.checking.raised import BackendRaised, guarded
from kvbench.contract.ledger import named
from kvbench.contract.protocol import BlockChanges, BlockState, CacheConfig, Ledger, _takes

COUNT_FIELDS = named(count=True)  # never negative: numbers, each entry of a dict or a tuple


class Figures:
    """The checks of one replay: the ledger's identities after every operation; and, while the
    backend exposes its block structures (else ``skipped`` says so), SPEC §10's structure
    identities and, for a backend declaring ``block_ids``, its tables and free and cached order
    block id for block id against the oracle's; for a backend whose ids are its own (an
    engine's), the order its cached queue takes blocks in against the oracle's, its blocks paired
    with the oracle's by table position (:class:`Pairing`), where its rule set declares
    ``cached_queue_order``.

    The structures are checked whole at sweeps, after operations 1, 2, 4, 8, ... and the last.
    In between, a backend that reports what changed (``block_state(changed_since=...)``) is
    checked at the blocks each operation took, released, cached, evicted or shared, against a
    copy of its structures kept from those changes (:class:`Mirror`): the cost follows the work,
    not the pool, and a corruption no operation touches shows at the next sweep. A backend that
    gives whole states only is read at the sweeps only (O(pool) each, O(log ops) of them), but
    one with ids of its own (:attr:`ordered`: a radix tree's engine, or no changes to follow) is
    read whole after every operation, its cached order compared with the oracle's, each id paired
    with the oracle's through the tables (:func:`compare_cached_order`).

    A tier replay (SPEC §11) sets ``leases``: a callable giving the transfers in flight by device
    block, ``({block: stores copying it}, {block: the load writing it})``. A store's lease is one
    reference beside the tables' (a block may stay leased after its sequence is freed); a load's
    target is its sequence's alone, so its one reference is that table's."""

    def __init__(self, backend, oracle, paged: bool, skipped: dict):
        self.backend, self.oracle, self.paged, self.skipped = backend, oracle, paged, skipped
        self.structures = backend is not None and paged  # until block_state() says otherwise
        self.exact = self.structures and backend.capabilities.block_ids
        self.changes = self.structures and _takes(type(backend), "block_state", "changed_since")
        rules = getattr(oracle, "rules", None)
        caching = rules is not None and getattr(oracle, "caching", False)
        # The cached queue's order by pairing: at each operation's changes, so with them only.
        self.order = (self.changes and not self.exact and caching and rules.cached_queue_order
                      and not rules.evicts_whole_leaves)
        # Otherwise, its own ids and a radix tree's order (evicts_whole_leaves) or no changes to
        # follow: its cached blocks, next evicted first, read whole after every operation.
        self.ordered = (self.structures and not self.exact and caching and not self.order
                        and (rules.evicts_whole_leaves or rules.cached_queue_order))
        self.pairing = Pairing() if self.order or self.ordered else None
        self.ops, self.edits = 0, -1
        self.mark = self.oracle_mark = None  # of the last states read, to ask what changed since
        self.mirror: Mirror | None = None
        self.found = None  # what block_ids() reports: the last check's block-id divergence
        self.leases = None  # () -> (store leases, load targets) by device block: a tier replay's

    def _leases(self) -> tuple:
        return self.leases() if self.leases is not None else NO_LEASES

    def check(self, led: Ledger, seqs=None, *, last: bool = False):
        """After an operation: ``seqs`` the sequences it changed (None: every live one)."""
        why = ledger_identities(led, self.backend.config, self.paged)
        self.found = None
        if why is not None or not self.structures:
            return why
        self.ops += 1
        sweep = last or self.ops & (self.ops - 1) == 0 or (self.changes and self.mirror is None) \
            or self.ordered
        if not sweep and (not self.changes or (seqs is not None and self.oracle.edits == self.edits)):
            return None  # nothing read between sweeps, or no reference moved since the last read
        self.edits = self.oracle.edits
        try:
            if self.mirror is not None:  # what changed since the last read
                state = self._read(seqs, self.mark)
                if state.changes is None:  # it could not say: the whole pool below
                    self.mirror = None
                else:
                    self.mark = state.mark
                    why = self._follow(state, led, seqs)
                    if why is not None or not sweep:
                        return why
            whole = self._read(None, None)
        except BackendRaised as e:
            if not isinstance(e.error, NotImplementedError):
                raise
            self.structures = self.exact = self.order = False
            self.skipped["block structures"] = f"{self.backend.name} does not expose block_state()"
            return None
        self.mark = whole.mark
        why = self._sweep(whole, led, last)
        if why is None and self.ordered:
            self.found = self._cached_order(whole)
        return why

    def block_ids(self, seqs=None):
        """After the ledger agreed with the oracle: the block-id divergence of the last ``check``."""
        return self.found

    def _read(self, seqs, mark) -> BlockState:
        if self.changes:
            return guarded("block_state", self.backend.block_state, seqs, changed_since=mark)
        return guarded("block_state", self.backend.block_state, seqs)

    def _follow(self, state: BlockState, led: Ledger, seqs):
        """An operation's changes: the identities at the blocks it moved; its block ids."""
        expected = self._expected(seqs)
        why, differs = self.mirror.apply(state, led, seqs, expected if self.exact else None,
                                         self._leases())
        if why is None and self.order and expected is not None and expected.changes is not None:
            changes = state.changes
            self.found = self.pairing.order(changes.cached, expected.changes.cached)
            self.pairing.forget(np.asarray(changes.free_head).reshape(-1).tolist()
                                + [b for b, e in changes.cached if e])
            self.pairing.learn(state.tables, expected.tables)
        if why is None and self.exact:
            keys, flat = self.mirror.flat
            self.found = compare_structures(expected, state, whole=False,
                                            actual_flat=flat if keys == expected.tables.keys() else None)
            if self.found is None and differs is not None:  # the whole lists name where
                self.found = compare_structures(self.oracle.block_state(), self._read(None, None)) \
                    or differs
        return why

    def _sweep(self, state: BlockState, led: Ledger, last: bool):
        """The whole pool. Equal to the mirror, it holds every identity (the mirror did at the
        last sweep, and at every block each operation since moved); else it is checked whole,
        and a new mirror follows the changes from it. Block ids: whole at the last operation."""
        N = self.backend.config.num_blocks
        if self.mirror is not None and self.mirror.same(state):
            if last and self.exact and self.found is None:
                self.found = compare_structures(self._expected_whole(), state, whole=True)
            return None
        leases = self._leases()
        why, counts = _pool_identities(state, led, N, whole=True, leases=leases)
        self.mirror = Mirror(state, N, *counts, leases) \
            if why is None and self.changes and state.mark is not None else None
        if why is None and self.order:  # the pairs of every table, from the oracle's mark on
            self.pairing.learn(state.tables, self._expected_whole().tables)
        if why is None and self.exact and self.found is None:
            self.found = compare_structures(self._expected_whole(), state, whole=True)
        return why

    def _cached_order(self, state: BlockState):
        """The backend's cached order against the oracle's (its rule set's), its ids paired with
        the oracle's at each table position first."""
        expected = self.oracle.block_state()
        self.pairing.learn(state.tables, expected.tables)  # freed blocks keep their pairs
        return compare_cached_order(expected.cached, state.cached, self.pairing.of)

    def _expected_whole(self) -> BlockState:
        expected = self.oracle.block_state()
        self.oracle_mark = expected.mark
        return expected

    def _expected(self, seqs):
        """The oracle's changes since its last state, for a backend declaring ``block_ids`` or
        checked by :class:`Pairing`."""
        if not (self.exact or self.order):
            return None
        expected = self.oracle.block_state(seqs, changed_since=self.oracle_mark)
        self.oracle_mark = expected.mark
        if expected.changes is None:  # read by someone else since: the next check sweeps
            self.mirror = None
            return BlockState(None, None, expected.refcount, expected.tables)
        return expected


class Pairing:
    """A backend's block ids paired with the oracle's, for a backend whose ids are its own: the
    block each holds at the same table position (sequence, group, position) is one block. From
    the pairs, the order its cached queue took blocks in at an operation against the oracle's
    (the rule set's ``cached_queue_order``): both queues append at their end, so the blocks each
    appended since the last check, in order, must pair one by one. Learnt from the tables each
    check reads (the changed sequences'), so a block freed at an operation was paired before it;
    forgotten once the block is free, so a block taken and given back within one operation
    (never in a table read) pairs with nothing and matches any."""

    def __init__(self):
        self.of: dict = {}  # backend block id -> oracle block id

    def forget(self, blocks) -> None:
        """Blocks now free: their next table pairs them anew."""
        for b in blocks:
            self.of.pop(int(b), None)

    def learn(self, actual: dict, expected: dict) -> None:
        for s, theirs in expected.items():
            for a, e in zip(actual.get(s, ()), theirs):
                a = np.asarray(a, dtype=np.int64).reshape(-1)
                e = np.asarray(e, dtype=np.int64).reshape(-1)
                n = min(len(a), len(e))
                held = (a[:n] != -1) & (e[:n] != -1)
                self.of.update(zip(a[:n][held].tolist(), e[:n][held].tolist()))

    def order(self, log, theirs_log):
        """The first difference of the blocks appended to the cached queue, or None (also where
        a block appended was never held by a table read: it cannot be paired)."""
        mine = _appended([(int(b), bool(e)) for b, e in log])
        theirs = _appended([(int(b), bool(e)) for b, e in theirs_log])
        named = [self.of.get(b) for b in mine]
        if len(named) == len(theirs) and all(a in (b, None) for a, b in zip(named, theirs)):
            return None
        return ("cached blocks (next evicted first)", theirs, named,
                f"the blocks the operation cached, in the order the cached queue took them "
                f"(the backend's {mine}, paired with the oracle's by table position); "
                f"{_first_difference(theirs, named)} (rule cached_queue_order: a freed "
                f"table's tail first)")


class Mirror:
    """The checker's copy of a backend's free structures and tables: from the whole state of the
    last sweep, then from the changes it reports, so that an operation's blocks are checked alone
    (every identity of :func:`structure_identities` at those blocks, and the counts as counters)."""

    def __init__(self, state: BlockState, num_blocks: int, count, holders, group, leases=None):
        """From a whole state that passed :func:`_pool_identities`, and its counts: the times
        each block is in the free structure, the table entries holding it, their group; and the
        transfers in flight then (``leases``, as :class:`Figures` takes them)."""
        self.N = num_blocks
        free = np.asarray(state.free, dtype=np.int64).reshape(-1)
        # The free list bottom first (the top is taken next), in 4 bytes an id where they fit.
        self.stack = np.empty(num_blocks, dtype=np.int32 if num_blocks < 2 ** 31 else np.int64)
        self.stack[:len(free)] = free[::-1]
        self.size = len(free)
        self.cached = OrderedDict.fromkeys(int(b) for b in state.cached)
        self.count, self.holders, self.group = count, holders, group
        self.ref = np.array(state.refcount).reshape(-1)  # as last read, in the backend's dtype
        self.used = int(np.count_nonzero(self.ref))
        self.tables = {s: [_held(t) for t in per] for s, per in state.tables.items()}
        self.leases = _copy_leases(leases or NO_LEASES)

    def same(self, state: BlockState) -> bool:
        """Whether a whole state is the one this mirror holds: O(pool) compares, no counting."""
        free = np.asarray(state.free).reshape(-1)
        ref = np.asarray(state.refcount).reshape(-1)
        cached = np.asarray(state.cached, dtype=np.int64).reshape(-1)
        if len(free) != self.size or len(ref) != self.N or len(cached) != len(self.cached) \
                or set(state.tables) != set(self.tables):
            return False
        mine = np.fromiter(self.cached, dtype=np.int64, count=len(self.cached))
        return (np.array_equal(free, self.stack[:self.size][::-1]) and np.array_equal(ref, self.ref)
                and np.array_equal(cached, mine) and all(
                    len(per) == len(self.tables[s]) and all(
                        np.array_equal(_held(t), m) for t, m in zip(per, self.tables[s]))
                    for s, per in state.tables.items()))

    def apply(self, state: BlockState, led: Ledger, seqs, expected: BlockState | None,
              leases=None):
        """Follow the changes of ``state`` (tables of ``seqs``, None: all) and check the blocks
        they moved, and those whose transfers in flight (``leases``) changed. Returns (the identity that fails, or None; with ``expected``, the oracle's
        changes, a block-id divergence of the free or cached order, or None)."""
        N, c = self.N, state.changes
        head = np.asarray(c.free_head, dtype=np.int64).reshape(-1)
        low = c.free_size - len(head)
        if not 0 <= low <= self.size:
            return ("free blocks", f"a changed head above {self.size} entries at most", low,
                    "block_state(changed_since=) reports a free list that does not continue the "
                    "last one"), None
        log = [(int(b), bool(e)) for b, e in c.cached]
        moved = np.fromiter((b for b, _ in log), dtype=np.int64, count=len(log))
        pooled = np.concatenate([head, moved])
        out = pooled[(pooled < 0) | (pooled >= N)]
        if len(out):
            return ("block ids", f"in 0..{N - 1}", int(out[0]), "a free block id outside the pool"), None
        differs = None if expected is None else self._differs(expected.changes, low, head, log)
        removed = self.stack[low:self.size].copy()
        np.subtract.at(self.count, removed, 1)
        self.stack[low:c.free_size] = head[::-1]
        self.size = c.free_size
        np.add.at(self.count, head, 1)
        for b, entered in log:
            if entered and b not in self.cached:
                self.cached[b] = None
                self.count[b] += 1
            elif not entered and b in self.cached:
                del self.cached[b]
                self.count[b] -= 1
        seqs = sorted(set(self.tables) | set(state.tables)) if seqs is None else seqs
        # All the sequences' tables in one array each way: a call per table costs more than its entries.
        old = [ids for s in seqs for ids in self.tables.pop(s, ())]
        old = np.concatenate(old) if old else np.zeros(0, np.int64)
        tables = {s: state.tables[s] for s in seqs if s in state.tables}
        flat = _flatten_counted(tables)
        self.flat = (tables.keys(), flat)  # the block-id comparison after this reads them too
        new = np.concatenate([ids for ids, _, _ in flat]) if flat else np.zeros(0, np.int64)
        leases = _copy_leases(leases or NO_LEASES)
        leased = np.fromiter(_moved_leases(self.leases, leases), dtype=np.int64)
        self.leases = leases
        touched = np.unique(np.concatenate([removed, pooled, leased, old, new[(new >= 0) & (new < N)]]))
        ref = np.asarray(state.refcount[touched], dtype=np.int64).reshape(-1) if len(touched) \
            else np.zeros(0, np.int64)
        why = self._free_identities(touched, ref, led)
        if why is None:
            np.subtract.at(self.holders, old, 1)
            self.group[old[self.holders[old] == 0]] = -1  # holders only fall here: once is enough
            why = self._add_tables(tables, flat)
        if why is None:
            why = _reference_identities(touched, self.holders[touched], ref, leases)
        return why, differs

    def _free_identities(self, touched, ref, led: Ledger):
        """No block twice in the free structure, none negative, none free and held, and the
        counts (evictable + protected + free = pool): at the blocks an operation moved."""
        count = self.count[touched]
        if len(count) and count.max() > 1:
            i = int(count.argmax())
            return ("free blocks", "each block once", f"block {touched[i]} {count[i]} times",
                    "a block appears twice in the free structure: the free count runs high")
        neg = np.flatnonzero(ref < 0)
        if len(neg):
            return (f"reference count of block {touched[neg[0]]}", ">= 0", int(ref[neg[0]]),
                    "no count is ever negative")
        both = np.flatnonzero((count > 0) & (ref > 0))
        if len(both):
            return (f"block {touched[both[0]]}", "free or in use", "both",
                    f"in the free structure with {ref[both[0]]} reference(s)")
        self.used += int(np.count_nonzero(ref)) - int(np.count_nonzero(self.ref[touched]))
        self.ref[touched] = ref
        return _count_identities(self.size, len(self.cached), self.used, led, self.N)

    def _add_tables(self, tables: dict, flat: list):
        """Count the tables' entries in (``flat``: :func:`_flatten_counted` of them); the first
        table identity that fails, or None."""
        pieces = [_held_pieces(ids, lengths) for ids, _, lengths in flat]
        for i, s in enumerate(sorted(tables)):
            self.tables[s] = [p[i] for p in pieces]
        for g, (ids, owner, _) in enumerate(flat):
            why = _group_identities(g, ids, owner, self.ref, self.count, self.holders, self.group, self.N)
            if why:
                return why
        return None

    def _differs(self, theirs: BlockChanges | None, low: int, head, log):
        """Whether the free list and the cached queue, changed by ``head`` above ``low`` and by
        ``log``, differ from the oracle's, changed by ``theirs``: both were equal before (the
        last sweep compared them whole), so the entries that changed on either side decide."""
        if theirs is None:
            return None
        t_head = np.asarray(theirs.free_head, dtype=np.int64).reshape(-1)
        t_low = theirs.free_size - len(t_head)
        lo = min(low, t_low)
        mine = np.concatenate([self.stack[lo:low], head[::-1]])[::-1]
        other = np.concatenate([self.stack[lo:t_low], t_head[::-1]])[::-1]
        if theirs.free_size != low + len(head) or not np.array_equal(mine, other):
            return ("free blocks (next taken first)", other.tolist(), mine.tolist(),
                    f"{_first_difference(other, mine)}, among the entries above the "
                    f"{lo} that stayed")
        t_log = [(int(b), bool(e)) for b, e in theirs.cached]
        now, t_now = dict(log), dict(t_log)  # cached after the changes: each block's last entry
        moved = set(now) | set(t_now)
        if _appended(log) != _appended(t_log) or any(
                now.get(b, b in self.cached) != t_now.get(b, b in self.cached) for b in moved):
            return ("cached blocks (next evicted first)", _appended(t_log), _appended(log),
                    "the blocks cached or taken out since the last check differ")
        return None


def _held(table) -> np.ndarray:
    """The block ids a table (one group's) holds: its entries but the -1 of released ones."""
    ids = np.asarray(table, dtype=np.int64).reshape(-1)
    return ids[ids != -1]


def _appended(log) -> list:
    """The blocks a cached queue's log appended that are still there, in order."""
    tail: dict = {}
    for b, entered in log:
        if entered:
            tail.pop(b, None)
            tail[b] = None
        else:
            tail.pop(b, None)
    return list(tail)


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


NO_LEASES = ({}, {})


def _copy_leases(leases) -> tuple:
    stores, loads = leases
    return dict(stores), dict(loads)


def _moved_leases(old, new):
    """The blocks whose store leases or load targets differ between two ``leases``."""
    for a, b in zip(old, new):
        yield from (k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _reference_identities(blocks, holders, ref, leases):
    """At ``blocks`` (their table entries ``holders``, reference counts ``ref``): one reference
    per table that holds a block and one per store in flight copying it (SPEC §11's lease);
    a load's target held by its loading sequence's table alone."""
    stores, loads = leases
    extra = np.array([stores.get(int(b), 0) for b in blocks], dtype=np.int64) if stores \
        else np.zeros(len(blocks), np.int64)
    wrong = np.flatnonzero(holders + extra != ref)
    if len(wrong):
        i = wrong[0]
        b, n = int(blocks[i]), int(extra[i])
        lease = f" and {n} for the store(s) in flight copying it (SPEC §11: a lease)" if n else ""
        return (f"reference count of block {b}", int(holders[i] + n), int(ref[i]),
                f"one reference per table that holds it{lease} (a free call drops one per sequence)")
    if loads:
        target = np.array([int(b) in loads for b in blocks], dtype=bool)
        shared = np.flatnonzero(target & (ref != 1))
        if len(shared):
            i = shared[0]
            b = int(blocks[i])
            return (f"block {b}", f"the target of load {loads[b]} alone (1 reference)",
                    f"{int(ref[i])} references", "SPEC §11: until a load completes its target "
                    "blocks belong to the loading sequence")
    return None


def structure_identities(state: BlockState, led: Ledger, config: CacheConfig, whole: bool = True):
    """No block twice in the free structure, nor free and in use (or in a table) at once; the
    structures agree with the ledger's counts (evictable + protected + free = pool); a held
    block has a reference, and (``whole``: every table given) one per table that holds it and
    serves one group. Vectorized over the pool: O(num_blocks) array work per call (the sweeps)."""
    return _pool_identities(state, led, config.num_blocks, whole)[0]


def _pool_identities(state: BlockState, led: Ledger, N: int, whole: bool, leases=NO_LEASES):
    """structure_identities, and when they hold the counts a :class:`Mirror` starts from: the
    times each block is in the free structure, the table entries holding it, their group.
    ``leases``: the transfers in flight, as :class:`Figures` takes them."""
    free = np.asarray(state.free, dtype=np.int64).reshape(-1)
    cached = np.asarray(state.cached, dtype=np.int64).reshape(-1)
    pooled = np.concatenate([free, cached]) if len(cached) else free
    ref = np.asarray(state.refcount).reshape(-1)
    if len(ref) != N:
        return ("reference counts", f"{N} (one per block)", len(ref),
                "block_state().refcount covers the pool"), None
    if len(pooled) and (pooled.min() < 0 or pooled.max() >= N):
        out = pooled[(pooled < 0) | (pooled >= N)]
        return ("block ids", f"in 0..{N - 1}", int(out[0]), "a free block id outside the pool"), None
    seen = np.zeros(N, dtype=np.int32)
    seen[pooled] = 1
    if np.count_nonzero(seen) < len(pooled):  # which block, how many times: counted only then
        seen = np.bincount(pooled, minlength=N)
        b = int(seen.argmax())
        return ("free blocks", "each block once", f"block {b} {seen[b]} times",
                "a block appears twice in the free structure: the free count runs high"), None
    neg = np.flatnonzero(ref < 0)
    if len(neg):
        return (f"reference count of block {neg[0]}", ">= 0", int(ref[neg[0]]),
                "no count is ever negative"), None
    both = pooled[ref[pooled] > 0]
    if len(both):
        b = int(both.min())
        return (f"block {b}", "free or in use", "both",
                f"in the free structure with {ref[b]} reference(s)"), None
    why = _count_identities(len(free), len(cached), int(np.count_nonzero(ref)), led, N)
    if why:
        return why, None
    holders = np.zeros(N, dtype=np.int32)
    group = np.full(N, -1, dtype=np.int8)
    for g, (ids, owner) in enumerate(_flatten(state.tables)):
        why = _group_identities(g, ids, owner, ref, seen, holders, group, N)
        if why:
            return why, None
    if whole:
        stores, loads = leases
        expect = holders.astype(np.int64)
        if stores:
            np.add.at(expect, np.fromiter(stores, dtype=np.int64),
                      np.fromiter(stores.values(), dtype=np.int64))
        at = np.flatnonzero(expect != ref)
        at = np.union1d(at[:1], np.fromiter(loads, dtype=np.int64))  # the first wrong, the targets
        why = _reference_identities(at, holders[at], ref[at], leases)
        if why:
            return why, None
    return None, (seen, holders, group)


def _count_identities(free: int, cached: int, used: int, led: Ledger, N: int):
    """The free structure's counts against the ledger's, and evictable + protected + free = pool."""
    if free + cached != led.blocks_free:
        return ("blocks_free", free + cached, led.blocks_free,
                f"the free structure holds {free} + {cached} cached blocks")
    if cached != led.cached_blocks:
        return "cached_blocks", cached, led.cached_blocks, "the cached (evictable) blocks listed"
    if free + cached + used != N:
        return ("evictable + protected + free", N, free + cached + used,
                f"{cached} evictable + {used} in use + {free} free")
    return None


def _group_identities(g: int, ids, owner, ref, seen, holders, group, N: int):
    """One group's table entries (``owner``: the sequence of each): in the pool, in use and not
    free, serving this group only; counted into ``holders`` and ``group``."""
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
    other = np.flatnonzero((group[ids] != -1) & (group[ids] != g))
    if len(other):
        b, s = int(ids[other[0]]), int(owner[other[0]])
        return (f"block {b}", f"in tables of group {group[b]} only", f"also in group {g}",
                f"sequence {s} holds in group {g} a block that serves group {group[b]}")
    np.add.at(holders, ids, 1)
    group[ids] = g
    return None


def _flatten(tables: dict) -> list:
    """Per group: every table entry of the given sequences (in sequence order) and its owner."""
    return [(ids, owner) for ids, owner, _ in _flatten_counted(tables)]


def _flatten_counted(tables: dict) -> list:
    """Per group: (entries, owners, entries per sequence), the sequences in order."""
    seqs = sorted(tables)
    if not seqs:
        return []
    owners = np.asarray(seqs, dtype=np.int64)
    out = []
    for g in range(len(tables[seqs[0]])):
        column = [tables[s][g] for s in seqs]
        try:  # one call over 1-D tables of integers, the usual case; anything else piece by piece
            ids = np.concatenate(column, dtype=np.int64, casting="same_kind")
            lengths = [len(t) for t in column]
            if ids.ndim != 1 or len(ids) != sum(lengths):
                raise ValueError
        except (ValueError, TypeError):
            parts = [np.asarray(t, dtype=np.int64).reshape(-1) for t in column]
            ids = np.concatenate(parts)
            lengths = [len(p) for p in parts]
        out.append((ids, np.repeat(owners, lengths), lengths))
    return out


def _held_pieces(ids, lengths) -> list:
    """A group's entries (``ids``, ``lengths`` of them per sequence) as each sequence's held ids,
    as :func:`_held` gives them: views into one array."""
    held = ids != -1
    if not held.all():
        ids = ids[held]
        lengths = np.bincount(np.repeat(np.arange(len(lengths)), lengths)[held], minlength=len(lengths))
    ends = np.cumsum(lengths).tolist()
    return [ids[a:b] for a, b in zip([0] + ends, ends)]  # np.split costs microseconds a piece


def compare_structures(expected: BlockState, actual: BlockState, whole: bool = True,
                       actual_flat=None):
    """Block ids one by one (a backend declaring ``block_ids``): the tables of the sequences
    ``expected`` covers and, ``whole``, the free order and the cached order. ``actual_flat``:
    :func:`_flatten_counted` of ``actual``'s tables of those sequences, where already made."""
    same = set(expected.tables) <= set(actual.tables)
    if same:
        theirs = actual_flat if actual_flat is not None else \
            _flatten_counted({s: actual.tables[s] for s in expected.tables})
        same = all(np.array_equal(e_ids, a_ids) and e_n == a_n for (e_ids, _, e_n), (a_ids, _, a_n)
                   in zip(_flatten_counted(expected.tables), theirs))
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
            e = np.asarray(e, dtype=np.int64).reshape(-1)
            a = np.asarray(a, dtype=np.int64).reshape(-1)
            if not np.array_equal(e, a):
                return name, e.tolist(), a.tolist(), _first_difference(e, a)
    return None


def compare_cached_order(expected, actual, pairs: dict):
    """A backend with ids of its own read whole (:attr:`Figures.ordered`): its cached blocks, next evicted first, each read as
    the oracle's block it is paired with (``pairs``), against the oracle's order."""
    e = [int(b) for b in np.asarray(expected, dtype=np.int64).reshape(-1)]
    a = [pairs.get(int(b)) for b in np.asarray(actual, dtype=np.int64).reshape(-1)]
    if e == a:
        return None
    unpaired = [int(b) for b, p in zip(np.asarray(actual).reshape(-1), a) if p is None]
    never = f"; backend block(s) {unpaired[:6]} never in a table (None)" if unpaired else ""
    return ("cached blocks (next evicted first)", e, a,
            f"in the order the rule set evicts them, the backend's ids read as the oracle's "
            f"through the tables: {_first_difference(e, a)}{never}")


def _first_difference(e, a) -> str:
    e, a = list(e), list(a)
    i = next((i for i, (x, y) in enumerate(zip(e, a)) if x != y), min(len(e), len(a)))
    return f"first difference at position {i} of {len(e)} expected, {len(a)} listed"


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12
