"""The trace operations of tiers and transfers (SPEC §11), their JSON and their history rules.

Header: ``"tiers": [{"name": "host", "capacity": 64, "policy": "lru"}, ...]`` (tier 1 first;
policy ``lru`` when absent; ``"failed_load": "drop"`` for a tier that removes the entries a failed
load could not read, ``"keep"`` when absent: SPEC §11's failure paths). Operations::

    {"step": 5, "op": "store", "id": 1, "seq": 0, "tier": "host"}             every full block
    {"step": 6, "op": "store", "id": 2, "seq": 0, "tier": "disk", "blocks": [0, 1]}  by position
    {"step": 7, "op": "load", "id": 3, "seq": 4, "tenant": "a", "tokens": 40, "block_hashes": [...]}
    {"step": 8, "op": "done", "id": 1, "ok": true}
    {"step": 9, "op": "abort", "seq": 4}
    {"step": 10, "op": "lookup", "seq": 5, "tenant": "a", "tokens": 40, "salt": "s", ...}

The operations themselves are in kvbench.traces.ops (``Store``, ``Load``, ``Done``, ``Abort``,
registered with the others) and are parsed in format.py; this module holds the header's tiers and
the history rules of transfers. ``load`` is a prefill (every field of one) served from the lower
tiers after the device's own hit; ``done`` completes a store or a load, ``ok`` false for a failure; ``abort`` frees a
sequence, cancelling its loads in flight (its stores still complete). A load's sequence is its
own until the load completes: no append, fork, store or free of it (abort it instead).
``lookup`` (a prefill's fields) is a request's lookup before its load: it names a sequence not yet
made, once; that sequence's next operation is its ``load`` (which takes over the pins) or its
``abort`` / ``free`` (the request cancelled between lookup and load: the pins go).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.traces.ops import TIER_OPS, Abort, Done, Load, Lookup, Store  # noqa: F401 (TIER_OPS: re-exported)

TIER_POLICIES = ("lru", "arc")
# What a tier does with the entries a failed load read (SPEC §11): keeps them stored (a transient
# failure: loadable again) or removes them (a file it could not read: vLLM's file tier deletes it).
FAILED_LOAD = ("keep", "drop")


@dataclass(frozen=True)
class TierSpec:
    """One lower tier: its name (``host``, ``disk``, ...), capacity in blocks, policy, and what a
    failed load leaves of the entries it read."""

    name: str
    capacity: int
    policy: str = "lru"
    failed_load: str = "keep"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or self.name == "device":
            raise ValueError(f"a tier needs a name other than 'device', got {self.name!r}")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 0:
            raise ValueError(f"tier {self.name!r}: capacity must be an integer >= 0, got {self.capacity!r}")
        if self.policy not in TIER_POLICIES:
            raise ValueError(f"tier {self.name!r}: unknown policy {self.policy!r} "
                             f"(known: {', '.join(TIER_POLICIES)})")
        if self.failed_load not in FAILED_LOAD:
            raise ValueError(f"tier {self.name!r}: 'failed_load' must be one of "
                             f"{', '.join(FAILED_LOAD)}, got {self.failed_load!r}")

    def to_dict(self) -> dict:
        d = {"name": self.name, "capacity": self.capacity, "policy": self.policy}
        if self.failed_load != "keep":  # old traces stay as they were
            d["failed_load"] = self.failed_load
        return d


def parse_tiers(value, fail) -> tuple:
    """The header's ``tiers``: a list of {name, capacity, policy, failed_load}."""
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        fail("'tiers' must be a non-empty list of {\"name\", \"capacity\", \"policy\"}")
    specs = []
    for i, t in enumerate(value):
        if not isinstance(t, dict):
            fail(f"'tiers'[{i}] must be an object, got {t!r}")
        unknown = sorted(set(t) - {"name", "capacity", "policy", "failed_load"})
        if unknown:
            fail(f"'tiers'[{i}]: unknown field {unknown[0]!r} "
                 f"(its fields: capacity, failed_load, name, policy)")
        try:
            specs.append(TierSpec(t.get("name"), t.get("capacity"), t.get("policy", "lru"),
                                  t.get("failed_load", "keep")))
        except ValueError as e:
            fail(f"'tiers'[{i}]: {e}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        fail(f"'tiers': a name given twice ({', '.join(names)})")
    return tuple(specs)


class TransferHistory:
    """The history rules of transfers, op by op: ids unique, a completion after its begin and
    once, a store of a live sequence to a declared tier, nothing done to a sequence whose load is
    in flight but its abort. ``check`` returns True for an op it alone handles (store, done)."""

    def __init__(self, tiers: tuple = ()):
        self.tier_names = {t.name for t in tiers}
        self.begun: dict = {}  # id -> (kind, seq), in flight
        self.done: set = set()
        self.loading: dict = {}  # seq -> load id in flight
        self.looked_up: dict = {}  # seq -> step of its lookup, its load not begun yet

    def _begin(self, tid, kind, seq, fail) -> None:
        if tid in self.begun or tid in self.done:
            fail(f"transfer id {tid} is already used")
        self.begun[tid] = (kind, seq)

    def check(self, op, live, fail) -> bool:
        seq = getattr(op, "seq", None)
        if isinstance(op, Lookup):
            if not self.tier_names:
                fail("op 'lookup' in a trace whose header declares no 'tiers'")
            if seq in self.looked_up:
                fail(f"lookup of sequence {seq}, whose lookup at step {self.looked_up[seq]} has "
                     f"no load yet (one lookup per request)")
            if seq in live:
                fail(f"lookup of live sequence {seq} (a lookup comes before its load, which "
                     f"makes the sequence)")
            self.looked_up[seq] = op.step
            return False  # the validator's: a sequence id not used before
        if seq in self.looked_up and not isinstance(op, (Load, Abort)) and op.kind != "free":
            fail(f"{op.kind} of sequence {seq}, looked up at step {self.looked_up[seq]} (its "
                 f"next operation is its load, or an abort)")
        if isinstance(op, Load):
            self.looked_up.pop(seq, None)
        if isinstance(op, Done):
            if op.id not in self.begun:
                fail(f"completion of transfer {op.id}, which "
                     + ("already completed (or was aborted)" if op.id in self.done else "never began"))
            kind, s = self.begun.pop(op.id)
            self.done.add(op.id)
            if kind == "load":
                del self.loading[s]
            return True
        if isinstance(op, (Store, Load)) and not self.tier_names:
            fail(f"op {op.kind!r} in a trace whose header declares no 'tiers'")
        if isinstance(op, Store):
            if op.tier not in self.tier_names:
                fail(f"store to tier {op.tier!r}, which the header does not declare "
                     f"(tiers: {', '.join(sorted(self.tier_names))})")
            if op.seq not in live:
                fail(f"store of sequence {op.seq}, which is not live")
        if isinstance(op, Abort):
            for tid, (kind, s) in list(self.begun.items()):
                if kind == "load" and s == seq:  # cancelled: a completion of it is ill-formed
                    del self.begun[tid]
                    self.done.add(tid)
                    del self.loading[s]
        elif not isinstance(op, Load):  # an operation on a live sequence (a prefill makes a new one)
            busy = [s for s in (getattr(op, "seqs", None) or (getattr(op, "src", seq),))
                    if s in self.loading]
            if busy:
                fail(f"{op.kind} of sequence {busy[0]} while its load {self.loading[busy[0]]} is "
                     f"in flight (a load's sequence is its own until it completes; abort it)")
        if isinstance(op, Store):
            self._begin(op.id, "store", op.seq, fail)
            return True
        if isinstance(op, Load):
            self._begin(op.id, "load", op.seq, fail)
            self.loading[op.seq] = op.id
        return False
