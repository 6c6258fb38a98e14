"""The checker tested against itself: for every check it makes (kvbench/checking/checks.py), a
backend wrong in that respect alone, which the checker must FAIL at the operation where it goes
wrong, naming the quantity. Each case is a correct pool (impls.numpy_paged) with one defect: its
report corrupted (a ledger figure, a block structure, a tier's figures) or one slot of its K/V
overwritten after a chosen operation. The same trace passes the correct pool (the control), so
what the checker reports is the defect; and a check removed makes its case fail (the step moves
on, the quantity changes, or the trace passes).

The last tests hold the table to the checker: every site and quantity template in the checker's
modules is named in checks.CHECKS, and every entry there has a case here (or, for the ledger's
fields, in test_ledger_quantities.py)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from conftest import A, K, P, X, counting_calls, make_config, make_trace
from planted import raising_in
from test_events import MergedCopies, UnsaltedTierEvents, two_tenants_one_prefix
from test_ledger_quantities import PAGED

from impls.faults import CopyWithoutData, LruTiesWrongWay, StateNotZeroed
from impls.faults_edges import ExactFitRefused, Int4CopyWithoutZeroPoint, PrefillKeepsBlockOnRefusal
from impls.faults_events import ParentNeverStored
from impls.faults_tiers import LeasesOutOfRefcounts
from impls.numpy_paged import NumpyPaged
from kvbench.checking import checks
from kvbench.checking.checker import check
from kvbench.checking.verdict import OOM, SUCCESS
from kvbench.contract import formulas as F
from kvbench.contract.events import REMOVED, KVEvent
from kvbench.contract.protocol import BlockChanges, BlockState, OutOfMemory
from kvbench.traces.format import Append, Free, Header, Prefill, Trace, validate
from kvbench.traces.ops import Preempt
from kvbench.traces.tier_ops import Done, Load, Store, TierSpec

ROOT = Path(__file__).resolve().parents[2]
N = 8  # blocks in the pools below, of 16 tokens

# P(0, 40) takes blocks 0, 1, 2 (40 = 16 + 16 + 8); the fork shares them; sequence 1 copies the
# shared tail (block 3) and appends 3, sequence 0 appends 2 in place; and so on.
TRACE = make_trace(P(0, 40), K(1, 0), A((1, 3), (0, 2)), P(2, 20), X(0), A((2, 5),), X(1), X(2),
                   name="selftest")


@dataclasses.dataclass
class Case:
    backend: Callable  # config -> backend
    trace: Trace
    index: int | None  # the operation (0-based) where the checker must stop; None: before the last
    quantity: str
    expected: object = None  # compared when not None
    actual: object = None
    detail: str = ""  # a part of the divergence's detail, when not ""
    config: dict = dataclasses.field(default_factory=dict)
    control: type = NumpyPaged  # the correct pool the defect was planted in


# --- the defects -----------------------------------------------------------------------------

def misreports(field: str, value: Callable, base=NumpyPaged, from_call: int = 1):
    """A pool whose ledger reports ``value(ledger)`` as ``field`` from its ``from_call``-th
    mutating call on."""
    class Misreports(counting_calls(base)):
        name = f"misreports-{field}"

        def ledger(self, *a, **kw):
            led = super().ledger(*a, **kw)
            if self.calls >= from_call:
                setattr(led, field, value(led))
            return led
    return Misreports


class PrefillReturnsACount(NumpyPaged):
    """Its prefill returns how many blocks it took instead of the sequences it evicted."""

    def prefill(self, seq, prompt, kv=None, **kw):
        super().prefill(seq, prompt, kv, **kw)
        return -(-prompt.tokens // self.config.block_size)


class NoStructures(NumpyPaged):
    """Exposes no block structures: the ledger's figures are checked against the oracle alone."""

    def block_state(self, seqs=None, *, changed_since=None):
        raise NotImplementedError


def reports_state(corrupt: Callable, *, whole: bool = True, at_call: int = 1):
    """A pool whose block_state() is ``corrupt(state)`` after its ``at_call``-th mutating call:
    the whole states (``whole``) or the states of changes between the sweeps."""
    class ReportsState(counting_calls(NumpyPaged)):
        name = "reports-state"

        def block_state(self, seqs=None, *, changed_since=None):
            state = super().block_state(seqs, changed_since=changed_since)
            if self.calls == at_call and (state.changes is None) == whole:
                state = corrupt(_copy(state))
            return state
    return ReportsState


def _copy(state: BlockState) -> BlockState:
    c = state.changes
    return dataclasses.replace(
        state, free=None if state.free is None else list(map(int, state.free)),
        cached=None if state.cached is None else list(map(int, state.cached)),
        refcount=np.array(state.refcount), tables={s: [list(map(int, t)) for t in per]
                                                   for s, per in state.tables.items()},
        changes=None if c is None else BlockChanges(list(map(int, np.asarray(c.free_head).reshape(-1))),
                                                    c.free_size, list(c.cached)))


class OwnIds(NumpyPaged):
    """NumPy's pool naming each block b as N - 1 - b, without ``block_ids`` and reporting whole
    states only, as an engine with ids of its own may: its order compared through the tables."""

    name = "own-ids"
    capabilities = dataclasses.replace(NumpyPaged.capabilities, block_ids=False)

    def block_state(self, seqs=None):  # whole states only: read after every operation
        s = super().block_state(seqs)
        own = lambda ids: [-1 if b == -1 else self.config.num_blocks - 1 - int(b) for b in ids]
        return BlockState(own(s.free), own(s.cached), np.array(s.refcount)[::-1],
                          {q: [own(t) for t in per] for q, per in s.tables.items()})


def own_ids_reporting(corrupt, at_call: int):
    """OwnIds whose block_state() is ``corrupt(state)`` after its ``at_call``-th mutating call."""
    class Reports(counting_calls(OwnIds)):
        def block_state(self, seqs=None):
            state = super().block_state(seqs)
            return corrupt(_copy(state)) if self.calls == at_call else state
    return Reports


def edit(**fields):
    """A corruption replacing the given fields of a whole state (each a function of it)."""
    return lambda s: dataclasses.replace(s, **{k: f(s) for k, f in fields.items()})


def refcount(block: int, value: int):
    def set_it(s):
        s.refcount[block] = value
        return s
    return set_it


def own_ids(cls):
    """``cls`` declaring no ``block_ids``, as an engine with ids of its own: its cached queue's
    order is checked through the pairing of its blocks with the oracle's."""
    return type(f"OwnIds{cls.__name__}", (cls,),
                {"capabilities": dataclasses.replace(cls.capabilities, block_ids=False)})


def changes(fn):
    """A corruption of a state of changes: ``fn(changes, state)`` edits them."""
    def apply(s):
        fn(s.changes, s)
        return s
    return apply


def overwrites(seq: int, position: int, at_call: int, base=NumpyPaged):
    """A pool that overwrites the K/V of ``seq`` at ``position`` after its ``at_call``-th mutating
    call: one slot wrong, no figure."""
    class Overwrites(counting_calls(base)):
        name = "overwrites-a-slot"

        def _counted(self, result):
            result = super()._counted(result)
            if self.calls == at_call:
                r = self.row_of[seq]
                block = int(self.tables[0][r, position // self.B])
                self.pool[block, position % self.B] += 1
            return result
    return Overwrites


class TakesWhatCannotFit(NumpyPaged):
    """A prefill it has no room for reports success and holds nothing."""

    def prefill(self, seq, prompt, kv=None, **kw):
        try:
            return super().prefill(seq, prompt, kv, **kw)
        except OutOfMemory:
            return ()


class StateOneTooMany(NumpyPaged):
    """read_state gives its state groups' states and one more."""

    def read_state(self, seq):
        got = super().read_state(seq)
        return np.concatenate([got, got[:1]])


class ReadsOneShort(NumpyPaged):
    """Every read gives one position fewer than asked."""

    def gather(self, seq, start=0, stop=None, *, out=None):
        got = super().gather(seq, start, stop)
        if out is not None:
            out[:len(got) - 1] = got[:-1]
            return out
        return got[:-1]


def tier_reports(corrupt: Callable, at_call: int = 1):
    """A tiered pool whose tier_ledgers() are ``corrupt(ledgers)`` from its ``at_call``-th call of
    tier_ledgers() on."""
    class TierReports(NumpyPaged):
        name = "tier-reports"
        asked = 0

        def tier_ledgers(self):
            self.asked += 1
            ledgers = [dict(t) for t in super().tier_ledgers()]
            return corrupt(ledgers) if self.asked >= at_call else ledgers
    return TierReports


def reads_stored(corrupt: Callable):
    class ReadsStored(NumpyPaged):
        name = "reads-stored"

        def read_stored(self, tid):
            return corrupt(dict(super().read_stored(tid)))
    return ReadsStored


class SharesALoadTarget(NumpyPaged):
    """Its whole states show a table of sequence 99 holding the first target of each load in
    flight, with its reference: every count agrees, but the target is not its loader's alone."""

    def block_state(self, seqs=None, *, changed_since=None):
        state = super().block_state(seqs, changed_since=changed_since)
        targets = [b for kind, _, _, moved in getattr(self, "_transfers", {}).values()
                   if kind == "load" for _, b, *_ in moved[:1]]
        if state.changes is not None or not targets:
            return state
        state = _copy(state)
        state.refcount[targets] += 1
        state.tables[99] = [targets]
        return state


def tier_field(f: str):
    """Each tier's ``f`` one more than it is; for capacity, stored and storing, free moved so
    that stored + storing + free = capacity still holds (loading one above stored breaks
    loading <= stored, and free cannot move alone: see IMPLIED)."""
    def corrupt(ledgers):
        for t in ledgers:
            t[f] += 1
            if f in ("stored", "storing"):
                t["free"] -= 1
            elif f == "capacity":
                t["free"] += 1
        return ledgers
    return corrupt


# --- the traces --------------------------------------------------------------------------------

HYBRID = F.get_model("tiny-hybrid")
# Sequence s writes 100 tokens (7 blocks: 6 * 16 + 4) for s = 0 .. 5: the random window (4
# blocks of one live sequence) seldom reads a given slot, so a slot wrong is found where the
# check under test reads it.
WIDE = [P(s, 100) for s in range(6)]
ROOMY = {"num_blocks": 64}  # 6 * 7 = 42 blocks and more
MAMBA = {"model": F.get_model("tiny-mamba"), "block_size": 8, "num_blocks": 64}
# Tiers: sequence 0's two hashed blocks stored to host (transfer 1) and completed at op 2.
TIERS = (TierSpec("host", 4),)
TIER_TRACE = validate(Trace(Header("tiers", tiers=TIERS),
                            [Prefill(0, 0, "a", 40, [1, 2]), Store(1, 1, 0, "host", None),
                             Done(2, 1, True), Free(3, 0)], name="tiers"))
# A load (op 7, a sweep) into 4 blocks: 0's blocks 0, 1 (hashes 1, 2) stored to host and cached
# at its free (tail first: [1, 0]); 1 takes 2, 3 and evicts 1 then 0 (table [2, 3, 1, 0]), and
# its free pushes them tail first, so the load takes 2, 3 from the top: targets of load 2.
LOAD_TRACE = validate(Trace(Header("tiers", tiers=TIERS), [
    Prefill(0, 0, "a", 32, [1, 2]), Store(1, 1, 0, "host", None), Done(2, 1, True), Free(3, 0),
    Prefill(4, 1, "a", 48), Append(5, (1,), (16,)), Free(6, 1),
    Load(7, 2, "a", 32, [1, 2], id=2)], name="load"))
# Prefix caching: 0's three full hashed blocks (48 = 3 * 16) are cached when it is freed at op 4;
# the others' at the end.
CACHED = make_trace(*[Prefill(0, s, "a", n, list(range(10 * s, 10 * s + n // 16)))
                      for s, n in enumerate((48, 16, 16, 16))],
                    X(0), Prefill(0, 4, "a", 16, [40]), X(1), X(2), X(3), X(4), name="cached")
# A preemption (SPEC §13) of a sequence no operation touched since op 1.
PREEMPT = Trace(Header("preempt"), [Prefill(i, s, "a", 100) for i, s in enumerate(range(6))]
                + [Preempt(6, 1)], name="preempt")


# Checks that no backend can fail alone: what they compare follows from checks made before them.
IMPLIED = {
    "tier: free": "free = capacity - stored - storing, each compared before it "
                  "(tier: stored + storing + free = capacity)",
    "ledger: blocks_free": "blocks_free = num_blocks - blocks_used, compared before it "
                           "(identity: used + free = pool)",
    "ledger: token_capacity": "num_blocks * block_size (identity: token capacity)",
    "ledger: block_usage": "blocks_used / num_blocks, blocks_used compared before it "
                           "(identity: usage by blocks)",
    "ledger: slot_usage": "token_states / (num_blocks * block_size), token_states compared before "
                          "it (identity: usage by slots)",
}

CASES = {
    # --- a call's outcome ---
    # The fork (op 1) raises: the checker names the call.
    "outcome: a call raises": Case(raising_in("fork"), make_trace(P(0, 40), K(1, 0)), 1,
                                   "outcome of fork", SUCCESS, "RuntimeError: planted: fork raises"),
    # The prefill (op 0) returns an int where its victims go.
    "a call returns what it must not": Case(PrefillReturnsACount, make_trace(P(0, 40)), 0,
                                            "what prefill returned",
                                            "the sequences it evicted (an iterable of ids, or None)",
                                            "3 (an int)"),  # 3 = ceil(40 / 16) blocks
    # 64 tokens in 4 blocks of 16: an exact fit, refused.
    "outcome: refused what fits": Case(ExactFitRefused, make_trace(P(0, 64)), 0, "outcome of prefill",
                                       SUCCESS, OOM, config={"num_blocks": 4}),
    # 48 tokens need 3 blocks of the 2: the oracle refuses, the backend says it took them.
    "outcome: took what cannot fit": Case(TakesWhatCannotFit, make_trace(P(0, 48)), 0,
                                          "outcome of prefill", OOM, SUCCESS, config={"num_blocks": 2}),
    # 0 holds 2 of 4 blocks; 48 tokens need 3 of the 2 free: refused, and one block stays taken.
    "a refused call leaves the ledger": Case(PrefillKeepsBlockOnRefusal,
                                             make_trace(P(0, 32), P(1, 48)), 1,
                                             "blocks_used after a refused prefill", 2, 3,
                                             config={"num_blocks": 4}),
    # LRU over 4 full blocks, 0 and 1 last used at op 2: the tie goes to the smaller id, 0.
    "victims": Case(LruTiesWrongWay, make_trace(P(1, 16), P(0, 16), A((1, 16), (0, 16)), P(2, 16)), 3,
                    "victims", [0], [1], config={"num_blocks": 4, "policy": "lru"}),

    # --- the ledger's figures that an identity would otherwise catch first: wrong together
    # with what the identity reads (after op 0: 3 blocks of 8 used, 40 tokens) ---
    # Used 4 (4 + 4 = 8, usage by blocks 4 / 8), as reported.
    "ledger: blocks_used": Case(
        misreports("block_usage", lambda led: led.blocks_used / 8, base=misreports(
            "blocks_used", lambda led: led.blocks_used + 1,
            base=misreports("blocks_free", lambda led: led.blocks_free - 1, base=NoStructures))),
        TRACE, 0, "blocks_used", 3, 4, control=NoStructures),
    "ledger: token_states": Case(misreports("slot_usage", lambda led: led.token_states / 128,
                                            base=misreports("token_states", lambda led: led.token_states + 1)),
                                 TRACE, 0, "token_states", 40, 41),  # 41 / (8 * 16), as reported
    "ledger: cached_blocks": Case(misreports("cached_blocks", lambda led: 1, base=NoStructures), TRACE, 0,
                                  "cached_blocks", 0, 1, control=NoStructures),  # 1 <= 5 free
    # Hybrid: 3 + 3 blocks, reported 4 + 2 (the sum still blocks_used).
    "ledger: group_blocks": Case(misreports("group_blocks", lambda led: (led.group_blocks[0] + 1,
                                                                        led.group_blocks[1] - 1)),
                                 TRACE, 0, "group_blocks", (3, 3), (4, 2), config={"model": HYBRID}),

    # --- SPEC §10 from the ledger (after op 0: 3 blocks used, 5 free of 8; 40 tokens) ---
    "identity: no negative number": Case(
        misreports("blocks_used", lambda led: -1, base=misreports("blocks_free", lambda led: N + 1)),
        TRACE, 0, "blocks_used", ">= 0", -1),  # -1 + 9 = 8: used + free still the pool
    "identity: no negative per-sequence count": Case(
        misreports("tokens", lambda led: {**led.tokens, 0: -1}), TRACE, 0, "tokens of sequence 0",
        ">= 0", -1),
    # Hybrid: 40 tokens, 3 blocks in each of the two groups; group 0 reported -1 and group 1 7.
    "identity: no negative entry of a tuple": Case(
        misreports("group_blocks", lambda led: (-1, sum(led.group_blocks) + 1)), TRACE, 0,
        "group_blocks", ">= 0 each", config={"model": HYBRID}),
    "identity: used + free = pool": Case(misreports("blocks_free", lambda led: led.blocks_free + 1),
                                         TRACE, 0, "blocks_used + blocks_free", N, N + 1),  # 3 + 6
    "identity: cached <= free": Case(misreports("cached_blocks", lambda led: led.blocks_free + 1),
                                     TRACE, 0, "cached_blocks", "<= blocks_free (5)", 6),
    "identity: group blocks add up": Case(
        misreports("group_blocks", lambda led: (led.group_blocks[0] + 1, *led.group_blocks[1:])),
        TRACE, 0, "sum of group_blocks", 6, 7, config={"model": HYBRID}),  # 3 + 3 used, 4 + 3 listed
    "identity: token capacity": Case(misreports("token_capacity", lambda led: 64), TRACE, 0,
                                     "token_capacity", 128, 64, "num_blocks * block_size"),  # 8 * 16
    "identity: usage by blocks": Case(misreports("block_usage", lambda led: 0.5), TRACE, 0,
                                      "block_usage", 3 / 8, 0.5, "blocks_used / num_blocks"),
    "identity: usage by slots": Case(misreports("slot_usage", lambda led: 0.5), TRACE, 0,
                                     "slot_usage", 40 / 128, 0.5, "token_states /"),

    # --- SPEC §10 from block_state(), whole at the first sweep (op 0): free [3 .. 7] next
    # taken first, refcount 1 for blocks 0, 1, 2, table {0: [[0, 1, 2]]} ---
    "structure: a count per block": Case(reports_state(edit(refcount=lambda s: s.refcount[:-1])),
                                         TRACE, 0, "reference counts", f"{N} (one per block)", N - 1),
    "structure: free ids in the pool": Case(reports_state(edit(free=lambda s: s.free[:-1] + [N])),
                                            TRACE, 0, "block ids", f"in 0..{N - 1}", N),
    "structure: each free block once": Case(reports_state(edit(free=lambda s: s.free[:-1] + [6])),
                                            TRACE, 0, "free blocks", "each block once", "block 6 2 times"),
    "structure: no negative reference count": Case(reports_state(refcount(3, -1)), TRACE, 0,
                                                   "reference count of block 3", ">= 0", -1),
    "structure: free or in use": Case(reports_state(refcount(3, 1)), TRACE, 0, "block 3",
                                      "free or in use", "both"),
    # Block 0: one table holds it, its count says 2.
    "structure: one reference per table": Case(reports_state(refcount(0, 2)), TRACE, 0,
                                               "reference count of block 0", 1, 2),
    # Block 7 out of the free list and counted in use: 4 listed free, the ledger's 5.
    "structure: free count": Case(reports_state(lambda s: refcount(7, 1)(edit(free=lambda s: s.free[:-1])(s))),
                                  TRACE, 0, "blocks_free", 4, 5),
    # Block 7 listed as cached: 4 + 1 free still 5, but the ledger has no cached block.
    "structure: cached count": Case(reports_state(edit(free=lambda s: s.free[:-1], cached=lambda s: [7])),
                                    TRACE, 0, "cached_blocks", 1, 0),
    # Block 0 with no reference: 5 free + 0 cached + 2 in use = 7 of 8.
    "structure: evictable + protected + free = pool": Case(reports_state(refcount(0, 0)), TRACE, 0,
                                                           "evictable + protected + free", N, 7),
    "structure: table ids in the pool": Case(reports_state(edit(tables=lambda s: {0: [[0, 1, N + 1]]})),
                                             TRACE, 0, "block ids", f"in 0..{N - 1}", N + 1,
                                             "in the table of sequence 0"),
    "structure: a held block is in use": Case(reports_state(edit(tables=lambda s: {0: [[0, 1, 3]]})),
                                              TRACE, 0, "block 3", "in use while a table holds it", "free"),
    "structure: a block serves one group": Case(reports_state(edit(tables=lambda s: {0: [[0, 1, 2], [2]]})),
                                                TRACE, 0, "block 2", "in tables of group 0 only",
                                                "also in group 1"),

    # TIER_TRACE's store begins at op 1 (a sweep): block 0 held by 0's table and leased, 2
    # references; reported without the lease.
    "structure: a store's lease, one reference more": Case(
        LeasesOutOfRefcounts, TIER_TRACE, 1, "reference count of block 0", 1 + 1, 1,
        "store(s) in flight", config={"prefix_caching": True, "num_blocks": 16}),
    "structure: a load's target, its sequence's alone": Case(
        SharesALoadTarget, LOAD_TRACE, 7, "block 2", "the target of load 2 alone (1 reference)",
        "2 references", config={"prefix_caching": True, "num_blocks": 4}),

    # --- the same between the sweeps: op 2 (sweeps after ops 1, 2, 4, ...: indices 0, 1, 3) ---
    # op 2 copies the shared tail into block 3 (the top of the free list [3 .. 7]): 4 stay free.
    "mirror: the free list continues": Case(
        reports_state(changes(lambda c, s: setattr(c, "free_size", 99)), whole=False, at_call=3),
        TRACE, 2, "free blocks", "a changed head above 5 entries at most", 99),  # no entry changed
    "mirror: free ids in the pool": Case(
        reports_state(changes(lambda c, s: (c.free_head.insert(0, 99), setattr(c, "free_size", c.free_size + 1))),
                      whole=False, at_call=3), TRACE, 2, "block ids", f"in 0..{N - 1}", 99),
    # Block 7, at the bottom of the free list, reported again at its top.
    "mirror: each free block once": Case(
        reports_state(changes(lambda c, s: (c.free_head.insert(0, 7), setattr(c, "free_size", c.free_size + 1))),
                      whole=False, at_call=3), TRACE, 2, "free blocks", "each block once", "block 7 2 times"),
    "mirror: no negative reference count": Case(
        reports_state(refcount(3, -1), whole=False, at_call=3), TRACE, 2,
        "reference count of block 3", ">= 0", -1),
    # op 4 frees sequence 0: its blocks 0, 1 stay (1 shares them), block 2 goes back to the free
    # list; reported with a reference.
    "mirror: free or in use": Case(reports_state(refcount(2, 1), whole=False, at_call=5), TRACE, 4,
                                   "block 2", "free or in use", "both"),
    # Block 3, the copy op 2 took, held by sequence 1's table alone, its count says 2.
    "mirror: one reference per table": Case(reports_state(refcount(3, 2), whole=False, at_call=3),
                                            TRACE, 2, "reference count of block 3", 1, 2),

    # --- block ids one by one (NumPy declares block_ids) ---
    "order: block tables": Case(reports_state(edit(tables=lambda s: {0: [[1, 0, 2]]})), TRACE, 0,
                                "block table of sequence 0, group 0", [0, 1, 2], [1, 0, 2]),
    "order: free, whole": Case(reports_state(edit(free=lambda s: s.free[::-1])), TRACE, 0,
                               "free blocks (next taken first)", [3, 4, 5, 6, 7], [7, 6, 5, 4, 3]),
    # The last op (9, X(4), a sweep) leaves the 7 prompt blocks cached (3 + 1 + 1 + 1 + 1 of the
    # 8), reported newest first.
    "order: cached, whole": Case(reports_state(edit(cached=lambda s: s.cached[::-1]), at_call=10),
                                 CACHED, 9, "cached blocks (next evicted first)",
                                 config={"prefix_caching": True}),
    # X(0) at op 4 gives back 0's three blocks (no prefix caching), reported in the other
    # order. Op 4 is between the sweeps at 3 and 7, which find the state as it is (right).
    "order: free, at the step": Case(
        reports_state(changes(lambda c, s: c.free_head.reverse()), whole=False, at_call=5), CACHED, 4,
        "free blocks (next taken first)"),
    # X(0) at op 4 caches 0's three full blocks, oldest first; reported the other way round.
    "order: cached, at the step": Case(
        reports_state(changes(lambda c, s: c.cached.reverse()), whole=False, at_call=5), CACHED, 4,
        "cached blocks (next evicted first)", config={"prefix_caching": True}),
    # The same X(0), through ids of the pool's own (7 - b): its blocks [0, 1, 2] are [7, 6, 5]
    # in its table at op 0; it caches [2, 1, 0] (tail first), reported as [7, 6, 5] (reversed),
    # which the tables pair with the oracle's [0, 1, 2].
    "order: cached, by the rule set": Case(
        own_ids_reporting(edit(cached=lambda s: s.cached[::-1]), at_call=5), CACHED, 4,
        "cached blocks (next evicted first)", [2, 1, 0], [0, 1, 2],
        config={"prefix_caching": True}, control=OwnIds),

    # The same X(0) without block ids: 0's blocks 0, 1, 2 paired with the oracle's 0, 1, 2 by
    # table position at ops 0 .. 3; cached tail first, 2, 1, 0; reported 0, 1, 2.
    "order: cached, paired by table position": Case(
        own_ids(reports_state(changes(lambda c, s: c.cached.reverse()), whole=False, at_call=5)),
        CACHED, 4, "cached blocks (next evicted first)", [2, 1, 0], [0, 1, 2],
        "paired with the oracle's by table position", config={"prefix_caching": True}),

    # --- K/V read back: one slot overwritten after a chosen operation ---
    # The append of op 6 writes 0's position 100 (the tail block's, 6 * 16 + 4); overwritten.
    "kv: the positions written": Case(overwrites(0, 100, at_call=7), make_trace(*WIDE, A((0, 1),), X(0)),
                                      6, "kv of sequence 0", config=ROOMY),
    # 0, 1 and 2 share 0's tail (positions 96 .. 99); 1 copies it to append at op 6, and 0's
    # slot 97 is overwritten then: read there as a sharer's (a random window of 64 of 0's 100
    # positions holds 97 only when it starts at 36).
    "kv: the sharers of a written tail": Case(
        overwrites(0, 97, at_call=7), make_trace(P(0, 100), K(1, 0), K(2, 0), *WIDE[3:], A((1, 1),),
                                                 *[X(s) for s in (1, 0, 2, 3, 4, 5)]), 6,
        "kv of sequence 0", config=ROOMY),
    "kv: a new sequence whole": Case(overwrites(2, 0, at_call=3), make_trace(*WIDE, X(0)), 2,
                                     "kv of sequence 2", config=ROOMY),
    # 1's slot 90, overwritten at op 5 (P(5, 100)), is read whole at its free (op 6).
    "kv: whole before a free": Case(overwrites(1, 90, at_call=6), make_trace(*WIDE, X(1), X(0)), 6,
                                    "kv of sequence 1", config=ROOMY),
    "kv: whole before a preemption": Case(overwrites(1, 90, at_call=6), PREEMPT, 6, "kv of sequence 1",
                                          config=ROOMY),
    # 1's slot 50, overwritten at op 2 (P(2, 100); 1 was read whole at op 1), is read by no
    # operation of the trace but the random window (a window of 4 * 16 = 64 of 100 positions
    # starts at 0 .. 36: it always holds 50), before the end's check: read into its buffer.
    "kv: the random window": Case(overwrites(1, 50, at_call=3), make_trace(*WIDE, *[A((0, 1),)] * 40),
                                  None, "kv of sequence 1", detail="into the caller's buffer",
                                  config=ROOMY),
    # The last op touches 0 only: sequence 5's slot 99 is read by the end's check alone.
    "kv: every sequence at the end": Case(overwrites(5, 99, at_call=7), make_trace(*WIDE, A((0, 1),)), 6,
                                          "kv of sequence 5", config=ROOMY),
    "kv: equal to what was written": Case(CopyWithoutData, make_trace(P(0, 40), K(1, 0), A((1, 1),)), 2,
                                          "kv of sequence 1", "what it wrote or inherited",
                                          "different values", "first wrong position"),
    "kv: the shape read back": Case(ReadsOneShort, make_trace(P(0, 40)), 0, "kv of sequence 0",
                                    "what it wrote or inherited", "different values", "shape"),
    # The int4 pool's copy of the shared tail lacks its zero points: outside SPEC §4's bound.
    "kv: within the quantization bound": Case(Int4CopyWithoutZeroPoint,
                                              make_trace(P(0, 40), K(1, 0), A((1, 1),)), 2,
                                              "kv of sequence 1", "within the quantization bound",
                                              "outside", control=Int4CopyWithoutZeroPoint.__mro__[1]),

    # --- states (SPEC §12), tiny-mamba in blocks of 8: 0 frees its blocks, 1's prefill takes
    # 0's last block back (the free stack), whose state is 0's ---
    "state: equal to the recurrence": Case(StateNotZeroed, make_trace(P(0, 20), X(0), P(1, 20)), 2,
                                           "state of sequence 1", "the state after its 20 tokens",
                                           config=MAMBA),
    "state: the shape read back": Case(StateOneTooMany, make_trace(P(0, 20)), 0, "state of sequence 0",
                                       detail="one state per state group", config=MAMBA),

    # --- tiers (SPEC §11): op 1 begins the store, op 2 completes it ---
    "tier: the blocks a store stored": Case(reads_stored(lambda got: {p: got[p] for p in list(got)[:1]}),
                                            TIER_TRACE, 2, "blocks stored by transfer 1", [0, 1], [0],
                                            config={"prefix_caching": True, "num_blocks": 16}),
    "tier: the content a store stored": Case(
        reads_stored(lambda got: {p: np.asarray(v) + 1 for p, v in got.items()}), TIER_TRACE, 2,
        "tier content of transfer 1", "the K/V of position 0",
        config={"prefix_caching": True, "num_blocks": 16}),
    "tier: one ledger per tier": Case(tier_reports(lambda ls: ls + ls), TIER_TRACE, 1, "tiers", 1, 2,
                                      config={"prefix_caching": True, "num_blocks": 16}),
    "tier: no negative count": Case(tier_reports(lambda ls: [{**t, "bytes_up": -1} for t in ls]),
                                    TIER_TRACE, 1, "tier host bytes_up", ">= 0", -1,
                                    config={"prefix_caching": True, "num_blocks": 16}),
    # While storing (op 1): capacity 4, 2 storing, 2 free; free reported 3.
    "tier: stored + storing + free = capacity": Case(
        tier_reports(lambda ls: [{**t, "free": t["free"] + 1} for t in ls]), TIER_TRACE, 1,
        "tier host stored + storing + free", 4, 5, config={"prefix_caching": True, "num_blocks": 16}),
    "tier: loading <= stored": Case(tier_reports(lambda ls: [{**t, "loading": t["stored"] + 1} for t in ls]),
                                    TIER_TRACE, 1, "tier host loading", "<= stored (0)", 1,
                                    config={"prefix_caching": True, "num_blocks": 16}),
    **{f"tier: {f}": Case(tier_reports(tier_field(f)), TIER_TRACE, 1, f"tier host {f}",
                          config={"prefix_caching": True, "num_blocks": 16})
       for f in checks.TIER_FIELDS if f"tier: {f}" not in IMPLIED and f != "loading"},
    # After the store completed (op 2): 2 stored, 0 loading, reported 1 (still <= stored).
    "tier: loading": Case(tier_reports(tier_field("loading"), at_call=2), TIER_TRACE, 2, "tier host loading",
                          0, 1, config={"prefix_caching": True, "num_blocks": 16}),
}

# --- KV events (SPEC §14): CACHED's op 0 stores hashes 0, 1, 2 (1's parent 0, 2's parent 1) --
class DropsLastStored(NumpyPaged):
    """Its events leave out the stored of key 2."""

    def events(self):
        return [e for e in super().events() if e.key != 2]


class RemovesUnheld(UnsaltedTierEvents):
    """Announces, with its first tier store, the removal of a key no tier ever held."""

    def events(self):
        out = super().events()
        return out + [KVEvent(REMOVED, "never", None, 0, 1)] if any(e.tier for e in out) else out


CASES.update({
    # two_tenants_one_prefix: the host's first store completes at op 2, the second tenant's at 5
    "events: order rules, copies": Case(RemovesUnheld, two_tenants_one_prefix(), 2, "event order",
                                        "nothing is removed that was not stored",
                                        detail="removes a key of which no copy is present",
                                        config={"prefix_caching": True, "num_blocks": 8},
                                        control=UnsaltedTierEvents),
    "events: copies per salt-less key": Case(MergedCopies, two_tenants_one_prefix(), 5,
                                             "residency of group 0, tier 1",
                                             {"stored": ["a", "b"], "removed": []},
                                             {"stored": [], "removed": []}, "'a' 2 against 1",
                                             config={"prefix_caching": True, "num_blocks": 8},
                                             control=UnsaltedTierEvents),
    "events: order rules": Case(ParentNeverStored, CACHED, 0, "event order",
                                "a stored block's parent is present or none",
                                config={"prefix_caching": True}),
    "events: residency": Case(DropsLastStored, CACHED, 0, "residency of group 0, tier 0",
                              {"stored": [0, 1, 2], "removed": []}, {"stored": [0, 1], "removed": []},
                              "in the model's cache, not in the events' residency: [2]",
                              config={"prefix_caching": True}),
})

# Checks whose cases live in another file: the ledger's fields, one case per field.
ELSEWHERE = {f"ledger: {f}": "test_ledger_quantities.py::test_paged_backend_wrong_in_one_quantity_fails_there"
             for f in PAGED if f"ledger: {f}" not in CASES and f"ledger: {f}" not in IMPLIED}
# reached past the per-operation "tier: loading" only with keep_going
ELSEWHERE["tier: no pin left at the end"] = (
    "test_tier_check.py::test_pins_left_at_the_end_of_a_kept_going_trace_fail_naming_the_key_and_salt")


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_backend_wrong_in_one_respect_fails_that_check(name):
    case = CASES[name]
    overrides = {"num_blocks": N, **case.config}
    model = overrides.pop("model", None)
    config = make_config(**overrides)
    config = dataclasses.replace(config, model=model) if model else config
    assert check(case.trace, case.control(config)).valid is True, "the control"
    v = check(case.trace, case.backend(config))
    d = v.divergence
    assert v.valid is False, name
    index = case.index if case.index is not None else min(d.index, len(case.trace) - 2)
    assert (d.index, d.quantity) == (index, case.quantity), str(d)
    if case.expected is not None:
        assert d.expected == case.expected, str(d)
    if case.actual is not None:
        assert d.actual == case.actual, str(d)
    assert case.detail in d.detail, str(d)


def test_every_check_has_a_case():
    named = {c.name for c in checks.CHECKS}
    assert named - set(CASES) - set(ELSEWHERE) - set(IMPLIED) == set(), "checks without a case"
    assert set(CASES) - named == set(), "cases of no check"
    assert set(ELSEWHERE) | set(IMPLIED) <= named
    assert not set(CASES) & set(IMPLIED) and not set(CASES) & set(ELSEWHERE)


def _template(node) -> str | None:
    """A quantity as the table writes it: a literal; a format string with ``{}`` for each field;
    ``{name}`` for a variable."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.Name):
        return "{" + node.id + "}"
    return None


def checks_in_source() -> set:
    """(module, site, template) of each check the checker's modules make: each ``diverge(q, ...)``
    call, and each check a function of identities and content returns (or assigns)."""
    found = set()
    for path in checks.MODULES:
        module = Path(path).stem
        tree = ast.parse((ROOT / path).read_text())
        for site, fn in _functions(tree):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "diverge" and node.args \
                        and not isinstance(node.args[0], ast.Starred):  # *why: passed on
                    found.add((module, site, _template(node.args[0])))
                if module in ("identities", "content") and (isinstance(node, ast.Return) or (
                        isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "why")):
                    template = _reported(node.value)
                    if template is not None:
                        found.add((module, site, template))
    return found


def _reported(value) -> str | None:
    """The quantity of a returned (or assigned) check: ``(quantity, expected, actual, detail)``
    with a variable quantity, or 3 or more entries with a written one; ``((...), counts)``."""
    value = value.body if isinstance(value, ast.IfExp) else value
    if not isinstance(value, ast.Tuple):
        return None
    elts = value.elts
    if len(elts) == 2 and isinstance(elts[0], ast.Tuple):
        elts = elts[0].elts
    first = elts[0] if elts else None
    if isinstance(first, ast.Name) and len(elts) >= 4 or \
            isinstance(first, (ast.Constant, ast.JoinedStr)) and len(elts) >= 3:
        return _template(first)
    return None


def _functions(tree):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, ast.FunctionDef):
                    yield f"{node.name}.{m.name}", m


def test_the_table_names_every_check_the_checker_makes():
    source = checks_in_source()
    table = {(c.module, c.site, c.template) for c in checks.CHECKS}
    assert source - table == set(), "checks the checker makes that checks.CHECKS does not name"
    assert table - source == set(), "checks.CHECKS names checks the checker no longer makes"
