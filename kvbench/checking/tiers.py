"""The lower tiers of SPEC §11 as a pure model: tiers 1..n below the device pool, each holding up
to ``capacity`` full, hashed blocks by their block key (§9, with the group), and the transfers
between them and the device (store and load, each a begin and a completion).

It knows no device block but by its id: the device oracle hands it the blocks a store copies from
(leased until the store completes) and the blocks a load writes into (the loader's alone until
the load completes). It imports no backend code.

A block in a tier is ``storing`` (a store began: not loadable, not evictable) or ``stored``
(loadable, evictable by the tier's policy unless a load reads it: then it is also ``loading``).
A store that fails leaves no trace. Policies: ``lru`` (vLLM's LRUCachePolicy: a store inserts at
the most recent end, a load touches its blocks so that the first is the most recent, the least
recent evictable block goes first) and ``arc`` (vLLM's ARCCachePolicy, T1/T2 with ghost lists
B1/B2 and an adaptive T1 target; as vLLM ships it, a victim is taken from T1 only while T1 holds
at least the target, else from T2 alone).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvbench.traces.tier_ops import TierSpec

STORING, STORED = "storing", "stored"


@dataclass(frozen=True)
class TierLedger:
    """One tier's account: ``stored + storing + free = capacity``; ``loading`` counts the stored
    blocks a load in flight reads; bytes moved by completed transfers, each block once."""

    name: str
    capacity: int
    stored: int
    storing: int
    loading: int
    free: int
    bytes_down: int = 0
    bytes_up: int = 0
    hits: int = 0  # blocks loads took from this tier so far

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class LRUPolicy:
    """Least recently used first; the order of every block in the tier (storing ones included,
    which are never chosen)."""

    def __init__(self, capacity: int):
        self.order: OrderedDict = OrderedDict()

    def insert(self, key) -> None:
        self.order[key] = None

    def remove(self, key) -> None:
        del self.order[key]

    def ready(self, key) -> None:
        """A store of ``key`` completed."""

    def touch(self, keys) -> None:
        for key in reversed(list(keys)):  # the first block ends the most recent
            if key in self.order:
                self.order.move_to_end(key)

    def victim(self, evictable):
        return next((k for k in self.order if evictable(k)), None)

    def evict(self, key) -> None:
        del self.order[key]

    def order_of(self) -> list:
        return list(self.order)


class ARCPolicy:
    """vLLM's ARC: new blocks enter T1; a touch of a stored T1 block moves it to T2 (a storing
    one stays in T1, at its recent end), of a T2 block to T2's recent end, of a ghost in B1 (B2)
    raises (lowers) the T1 target by max(1, |B2|/|B1|) (max(1, |B1|/|B2|)), bounded by 0 and
    the capacity. Eviction takes T1's least recent evictable block while |T1| >= int(target),
    else T2's, and remembers it in B1 (B2); each ghost list keeps at most ``capacity`` keys."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.target = 0.0
        self.t1: OrderedDict = OrderedDict()  # key -> stored (bool)
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()

    def insert(self, key) -> None:
        self.t1[key] = False
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key) -> None:  # a failed store: no ghost
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def ready(self, key) -> None:
        if key in self.t1:
            self.t1[key] = True
        elif key in self.t2:
            self.t2[key] = True

    def touch(self, keys) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                stored = self.t1.pop(key)
                (self.t2 if stored else self.t1)[key] = stored
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def victim(self, evictable):
        if len(self.t1) >= int(self.target):
            key = next((k for k in self.t1 if evictable(k)), None)
            if key is not None:
                return key
        return next((k for k in self.t2 if evictable(k)), None)

    def evict(self, key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)

    def order_of(self) -> list:
        return list(self.t1) + list(self.t2)


POLICY_CLASSES = {"lru": LRUPolicy, "arc": ARCPolicy}


@dataclass
class Entry:
    state: str
    loads: int = 0  # loads in flight reading it


@dataclass
class Tier:
    spec: TierSpec
    entries: dict = field(default_factory=dict)  # key -> Entry
    policy: object = None
    bytes_down: int = 0
    bytes_up: int = 0
    hits: int = 0
    # SPEC §13's swap: sequence -> blocks of it the tier holds (stored, by no key: never a hit,
    # never a victim of the policy, dropped at the resume or the free)
    swapped: dict = field(default_factory=dict)

    def __post_init__(self):
        self.policy = POLICY_CLASSES[self.spec.policy](self.spec.capacity)

    def held(self) -> int:
        return len(self.entries) + sum(self.swapped.values())

    def evictable(self, keep=()):
        """Whether a key may be evicted: stored, read by no load, not in ``keep``."""
        return lambda k: k not in keep and self.entries[k].state == STORED and not self.entries[k].loads

    def ledger(self) -> TierLedger:
        storing = sum(1 for e in self.entries.values() if e.state == STORING)
        loading = sum(1 for e in self.entries.values() if e.loads)
        stored = self.held() - storing
        return TierLedger(self.spec.name, self.spec.capacity, stored, storing, loading,
                          self.spec.capacity - self.held(), self.bytes_down, self.bytes_up,
                          self.hits)


@dataclass
class StorePlan:
    """What a store begin did: per block (by key) in order, begun, skipped (already stored or
    storing there) or refused (no room, nothing evictable), and the keys it evicted."""

    begun: list = field(default_factory=list)  # [(key, device block)]
    skipped: list = field(default_factory=list)
    refused: list = field(default_factory=list)
    evicted: list = field(default_factory=list)


@dataclass
class Transfer:
    kind: str  # "store" | "load"
    seq: int
    tier: int = 0  # a store's tier (index into Tiers.tiers)
    blocks: list = field(default_factory=list)  # store: [(key, source)]; load: [(key, tier, target)]


class TransferError(ValueError):
    """An ill-formed transfer history (a completion with no begin, twice, an id reused)."""


class Tiers:
    """Tiers 1..n and the transfers in flight; ``leases`` counts, per device block, the stores
    in flight that copy from it, and ``load_targets`` the device blocks loads are writing."""

    def __init__(self, specs, block_bytes: int = 0):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must differ, got {names}")
        self.tiers = [Tier(s) for s in specs]
        self.block_bytes = block_bytes
        self.transfers: dict = {}  # id -> Transfer, in flight
        self.finished: set = set()
        self.leases: dict = {}  # device block -> stores in flight copying it
        self.load_targets: dict = {}  # device block -> load id writing it

    def index(self, name: str) -> int:
        for i, t in enumerate(self.tiers):
            if t.spec.name == name:
                return i
        raise KeyError(f"no tier {name!r} (tiers: {', '.join(t.spec.name for t in self.tiers)})")

    def _new_id(self, tid) -> None:
        if tid in self.transfers or tid in self.finished:
            raise TransferError(f"transfer id {tid} is already used")

    # --- lookups ---------------------------------------------------------------------------

    def lookup(self, key) -> int | None:
        """The nearest tier holding ``key`` stored (loadable), or None."""
        for i, t in enumerate(self.tiers):
            e = t.entries.get(key)
            if e is not None and e.state == STORED:
                return i
        return None

    def load_run(self, keys) -> list:
        """The tier of each block of the longest run of ``keys`` stored in some tier."""
        run = []
        for key in keys:
            i = self.lookup(key)
            if i is None:
                break
            run.append(i)
        return run

    # --- store ---------------------------------------------------------------------------

    def store_begin(self, tid, seq: int, tier: int, blocks) -> StorePlan:
        """Begin copying ``blocks`` = [(key, device block)] down to tier ``tier``, block by block:
        a key held there (stored or storing) is skipped; without room the policy evicts a stored
        block that no load reads and that is not one of this store's; if none, the block is
        refused. Each begun block's device block is leased until completion."""
        self._new_id(tid)
        t = self.tiers[tier]
        plan = StorePlan()
        mine = {k for k, _ in blocks}
        for key, block in blocks:
            if key in t.entries:
                plan.skipped.append(key)
                continue
            if t.held() >= t.spec.capacity:
                victim = t.policy.victim(t.evictable(mine))
                if victim is None:
                    plan.refused.append(key)
                    continue
                t.policy.evict(victim)
                del t.entries[victim]
                plan.evicted.append(victim)
            t.entries[key] = Entry(STORING)
            t.policy.insert(key)
            plan.begun.append((key, block))
            if block is not None:  # None: a model without device blocks
                self.leases[block] = self.leases.get(block, 0) + 1
        self.transfers[tid] = Transfer("store", seq, tier, plan.begun)
        return plan

    # --- swap (SPEC §13) --------------------------------------------------------------------

    def swap_out(self, seq: int, tier: int, blocks: int) -> list | None:
        """Move ``blocks`` blocks of ``seq`` to tier ``tier`` at once: the policy evicts stored
        blocks no load reads until they fit; None (nothing changed) when even that is not enough.
        Returns the keys evicted."""
        t = self.tiers[tier]
        evictable = t.evictable()
        if t.spec.capacity - t.held() + sum(map(evictable, t.policy.order_of())) < blocks:
            return None
        evicted = []
        while t.spec.capacity - t.held() < blocks:
            victim = t.policy.victim(evictable)
            t.policy.evict(victim)
            del t.entries[victim]
            evicted.append(victim)
        t.swapped[seq] = blocks
        t.bytes_down += blocks * self.block_bytes
        return evicted

    def swap_in(self, seq: int, moved: int) -> None:
        """``seq``'s swapped blocks leave their tier, ``moved`` of them copied up (the others the
        device's prefix cache already held)."""
        t = self.swap_tier(seq)
        del t.swapped[seq]
        t.bytes_up += moved * self.block_bytes

    def swap_drop(self, seq: int) -> None:
        """A swapped sequence freed: its blocks leave the tier, moved nowhere."""
        t = self.swap_tier(seq)
        if t is not None:
            del t.swapped[seq]

    def swap_tier(self, seq: int):
        return next((t for t in self.tiers if seq in t.swapped), None)

    # --- load ----------------------------------------------------------------------------

    def load_begin(self, tid, seq: int, blocks) -> None:
        """Begin loading ``blocks`` = [(key, tier, device target)] (from :meth:`load_run`):
        each tier entry is read until completion, and touched by its policy."""
        self._new_id(tid)
        for key, tier, target in blocks:
            entry = self.tiers[tier].entries[key]
            if entry.state != STORED:
                raise TransferError(f"load of block {key!r} from tier {self.tiers[tier].spec.name}, "
                                    f"where it is {entry.state}")
            entry.loads += 1
            if target is not None:
                self.load_targets[target] = tid
            self.tiers[tier].hits += 1
        for i, t in enumerate(self.tiers):
            t.policy.touch([k for k, tier, _ in blocks if tier == i])
        self.transfers[tid] = Transfer("load", seq, blocks=list(blocks))

    # --- completion and abort --------------------------------------------------------------

    def complete(self, tid, ok: bool) -> Transfer:
        """Complete transfer ``tid``: a store's blocks become stored (ok) or vanish; a load's
        tier entries are read no more (the caller makes its targets readable, or frees them)."""
        tr = self.transfers.pop(tid, None)
        if tr is None:
            raise TransferError(f"completion of transfer {tid}, "
                                + ("which already completed" if tid in self.finished else "which never began"))
        self.finished.add(tid)
        if tr.kind == "store":
            t = self.tiers[tr.tier]
            for key, block in tr.blocks:
                if ok:
                    t.entries[key].state = STORED
                    t.policy.ready(key)
                else:
                    del t.entries[key]
                    t.policy.remove(key)
                if block is not None:
                    self._unlease(block)
            if ok:
                t.bytes_down += len(tr.blocks) * self.block_bytes
        else:
            self._end_load(tr, moved=ok)
        return tr

    def _unlease(self, block) -> None:
        self.leases[block] -= 1
        if not self.leases[block]:
            del self.leases[block]

    def _end_load(self, tr: Transfer, moved: bool) -> None:
        for key, tier, target in tr.blocks:
            t = self.tiers[tier]
            t.entries[key].loads -= 1
            self.load_targets.pop(target, None)
            if moved:
                t.bytes_up += self.block_bytes

    def abort(self, seq: int) -> list:
        """Cancel the loads of ``seq`` (returned as [(id, transfer)]: their device targets are to
        be freed); its stores stay in flight and complete or fail later."""
        cancelled = []
        for tid, tr in list(self.transfers.items()):
            if tr.kind == "load" and tr.seq == seq:
                del self.transfers[tid]
                self.finished.add(tid)
                self._end_load(tr, moved=False)
                cancelled.append((tid, tr))
        return cancelled

    def in_flight(self, seq: int, kind: str | None = None) -> list:
        return [tid for tid, tr in self.transfers.items()
                if tr.seq == seq and (kind is None or tr.kind == kind)]

    # --- ledgers ---------------------------------------------------------------------------

    def ledgers(self) -> list:
        return [t.ledger() for t in self.tiers]

    def stored_keys(self, tier: int) -> set:
        return {k for k, e in self.tiers[tier].entries.items() if e.state == STORED}


def replay_prompts(prompts, device_blocks: int, tiers: Tiers, tier: int = 0) -> dict:
    """Hits by tier of a stream of prompts (each a list of block keys) over a device LRU of
    ``device_blocks`` blocks above ``tiers``: a prompt hits the longest prefix held on the device,
    then loads the longest following run stored in a tier, and computes the rest; the device
    then holds all its blocks, most recent last, and each block the device evicts (least recent
    first, never one of the prompt's) is stored down to tier ``tier``. Every transfer completes
    at once. Returns {"device": blocks, <tier name>: blocks, ..., "computed": blocks}."""
    device: OrderedDict = OrderedDict()
    hits = {"device": 0, **{t.spec.name: 0 for t in tiers.tiers}, "computed": 0}
    tid = 0
    for keys in prompts:
        if len(keys) > device_blocks:
            raise ValueError(f"a prompt of {len(keys)} blocks does not fit {device_blocks} device blocks")
        d = 0
        while d < len(keys) and keys[d] in device:
            d += 1
        run = tiers.load_run(keys[d:])
        if run:
            tiers.load_begin(tid, 0, [(k, i, None) for k, i in zip(keys[d:], run)])
            tiers.complete(tid, True)
            tid += 1
        hits["device"] += d
        for i in run:
            hits[tiers.tiers[i].spec.name] += 1
        hits["computed"] += len(keys) - d - len(run)
        for k in keys:
            device[k] = None
            device.move_to_end(k)
        mine = set(keys)
        while len(device) > device_blocks:
            victim = next(k for k in device if k not in mine)
            del device[victim]
            tiers.store_begin(tid, 0, tier, [(victim, None)])
            tiers.complete(tid, True)
            tid += 1
    return hits
