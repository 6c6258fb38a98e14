"""The trace operations of tiers and transfers (SPEC §11), their JSON and their history rules.

Header: ``"tiers": [{"name": "host", "capacity": 64, "policy": "lru"}, ...]`` (tier 1 first;
policy ``lru`` when absent). Operations::

    {"step": 5, "op": "store", "id": 1, "seq": 0, "tier": "host"}             every full block
    {"step": 6, "op": "store", "id": 2, "seq": 0, "tier": "disk", "blocks": [0, 1]}  by position
    {"step": 7, "op": "load", "id": 3, "seq": 4, "tenant": "a", "tokens": 40, "block_hashes": [...]}
    {"step": 8, "op": "done", "id": 1, "ok": true}
    {"step": 9, "op": "abort", "seq": 4}

``load`` is a prefill (every field of one) served from the lower tiers after the device's own
hit; ``done`` completes a store or a load, ``ok`` false for a failure; ``abort`` frees a
sequence, cancelling its loads in flight (its stores still complete). A load's sequence is its
own until the load completes: no append, fork, store or free of it (abort it instead).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.checking.tiers import TierSpec
from kvbench.traces.ops import Free, Prefill


@dataclass(frozen=True)
class Store:
    step: int
    id: int
    seq: int
    tier: str
    blocks: tuple | None = None  # block positions; None: every full block
    kind = "store"


@dataclass(frozen=True)
class Load(Prefill):
    id: int = -1
    kind = "load"


@dataclass(frozen=True)
class Done:
    step: int
    id: int
    ok: bool = True
    kind = "done"


@dataclass(frozen=True)
class Abort(Free):
    kind = "abort"


TIER_OPS = (Store, Load, Done, Abort)
TIER_OP_FIELDS = {"store": {"step", "op", "id", "seq", "tier", "blocks"},
                  "done": {"step", "op", "id", "ok"},
                  "abort": {"step", "op", "seq"}}


def tier_op_to_dict(op) -> dict:
    if isinstance(op, Store):
        d = {"step": op.step, "op": "store", "id": op.id, "seq": op.seq, "tier": op.tier}
        if op.blocks is not None:
            d["blocks"] = list(op.blocks)
        return d
    if isinstance(op, Done):
        return {"step": op.step, "op": "done", "id": op.id, "ok": op.ok}
    return {"step": op.step, "op": "abort", "seq": op.seq}


def parse_tier_op(d: dict, fail, integer, parse_prefill):
    """A ``store``, ``done`` or ``abort`` line (``load``: a prefill's fields and an id), or None
    for another kind. ``integer(d, key, fail, minimum)`` reads an integer field;
    ``parse_prefill(d)`` a prefill's fields."""
    kind = d.get("op")
    if kind == "load":
        fields = dict(d, op="prefill")
        tid = integer(fields, "id", fail, 0)
        del fields["id"]
        p = parse_prefill(fields)
        return Load(p.step, p.seq, p.tenant, p.tokens, p.block_hashes, p.salt, p.adapter,
                    p.token_ids, id=tid)
    if kind not in TIER_OP_FIELDS:
        return None
    unknown = sorted(set(d) - TIER_OP_FIELDS[kind])
    if unknown:
        fail(f"unknown field {unknown[0]!r} of op {kind!r} (its fields: "
             f"{', '.join(sorted(TIER_OP_FIELDS[kind]))})")
    step = integer(d, "step", fail, 0)
    if kind == "abort":
        return Abort(step, integer(d, "seq", fail, 0))
    tid = integer(d, "id", fail, 0)
    if kind == "done":
        ok = d.get("ok", True)
        if not isinstance(ok, bool):
            fail(f"field 'ok' must be true or false, got {ok!r}")
        return Done(step, tid, ok)
    tier = d.get("tier")
    if not isinstance(tier, str) or not tier:
        fail(f"store needs the name of a tier, 'tier', got {tier!r}")
    blocks = d.get("blocks")
    if blocks is not None:
        if not isinstance(blocks, list) or not blocks:
            fail("'blocks' must be a non-empty list of block positions")
        for i, b in enumerate(blocks):
            integer({f"blocks[{i}]": b}, f"blocks[{i}]", fail, 0)
        if len(set(blocks)) != len(blocks):
            fail("'blocks' names a position twice")
        blocks = tuple(blocks)
    return Store(step, tid, integer(d, "seq", fail, 0), tier, blocks)


def parse_tiers(value, fail) -> tuple:
    """The header's ``tiers``: a list of {name, capacity, policy}."""
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        fail("'tiers' must be a non-empty list of {\"name\", \"capacity\", \"policy\"}")
    specs = []
    for i, t in enumerate(value):
        if not isinstance(t, dict):
            fail(f"'tiers'[{i}] must be an object, got {t!r}")
        unknown = sorted(set(t) - {"name", "capacity", "policy"})
        if unknown:
            fail(f"'tiers'[{i}]: unknown field {unknown[0]!r} (its fields: capacity, name, policy)")
        try:
            specs.append(TierSpec(t.get("name"), t.get("capacity"), t.get("policy", "lru")))
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

    def _begin(self, tid, kind, seq, fail) -> None:
        if tid in self.begun or tid in self.done:
            fail(f"transfer id {tid} is already used")
        self.begun[tid] = (kind, seq)

    def check(self, op, live, fail) -> bool:
        seq = getattr(op, "seq", None)
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
        elif isinstance(op, Free) or isinstance(op, Store) or hasattr(op, "seqs") or hasattr(op, "src"):
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
