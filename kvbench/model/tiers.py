"""The lower tiers of SPEC §11 as a pure model: tiers 1..n below the device pool, each holding up
to ``capacity`` full, hashed blocks by their block key (§9, with the group), and the transfers
between them and the device (store and load, each a begin and a completion).

It knows device blocks by id only: those a store copies from (leased until it completes) and
those a load writes into (the loader's alone until it completes). A block in a tier is
``storing`` (a store began: not loadable, not evictable) or ``stored`` (loadable, evictable by
the tier's policy unless a load reads it: then it is also ``loading``).
A request's lookup (SPEC §11: LMCache's read locks, SGLang's sessions) pins the stored entries its
load would read, as a load does (in ``loading``, not evictable); the load takes the pins over and
releases them at its completion, ok or failed, and an abort before it releases them, each once. A
failed store leaves no trace; a failed load leaves what it read as its tier declares
(``TierSpec.failed_load``): kept (loadable again), or dropped: not loadable from then on, removed
once no load reads it, so no hit is served again from a block the tier could not read (vLLM issue
49176). Policies (tier_policies.py): ``lru`` (vLLM's LRUCachePolicy) and ``arc`` (vLLM's
ARCCachePolicy as 0.33 ships it).

A backend may declare rules of its own (``Capabilities.tier_rules``, TIER_RULES), and the model
runs them: ``whole_store_refused`` (vLLM's ``prepare_store``: the victims for every new block are
found first, together, or the store is refused whole), ``request_recency`` (vLLM's connector:
recency per request, LRU ranks ``(request, -position)`` and ARC promotions applied when the
request finishes, no touch at a load; the rules are in impls/engines/vllm_offload.py);
LMCache's ``store_evicts_skipped`` (the policy may evict a store's skipped blocks for its new ones:
vLLM keeps them), ``store_ranked_at_completion`` (a block's recency dates from its store's
completion) and ``store_skips_when_reached`` (a block is skipped if held when the store reaches it,
so one its own store evicted is stored again). ``drops_failed_loads``: it runs tiers whose header
declares ``failed_load`` "drop" (what a failed load read is removed) besides SPEC's default "keep"
(:func:`failed_load_modes`). ``failed_load_drops_unannounced`` (vLLM's file tier):
KV events (SPEC §14) announce no removal of what a failed load dropped (``Tier.dropped``).
``drop_tiers_evict_nothing`` (vLLM's file tier, a file a block): its "drop" tiers evict nothing.
``failed_read_removes_at_once`` (vLLM's file tier): a failed load removes what it read from its
"drop" tiers at its completion, lost to the other loads reading it (tier_removal.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kvbench.model.tier_policies import POLICY_CLASSES, REQUEST_POLICY_CLASSES, Access
from kvbench.model.tier_removal import remove_at_once
from kvbench.traces.tier_ops import TierSpec

STORING, STORED = "storing", "stored"
TIER_RULES = ("whole_store_refused", "request_recency", "store_evicts_skipped", "drops_failed_loads",
              "store_ranked_at_completion", "failed_load_drops_unannounced", "drop_tiers_evict_nothing",
              "failed_read_removes_at_once", "store_skips_when_reached")


def failed_load_modes(tier_rules) -> tuple:
    """The trace tiers' ``failed_load`` values a backend declaring ``tier_rules`` runs."""
    return ("keep", "drop") if "drops_failed_loads" in tier_rules else ("keep",)


def evictless_modes(tier_rules) -> tuple:
    """The ``failed_load`` values whose tiers a backend declaring ``tier_rules`` never evicts from."""
    return ("drop",) if "drop_tiers_evict_nothing" in tier_rules else ()


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


@dataclass
class Entry:
    state: str
    loads: int = 0  # loads in flight reading it
    unreadable: bool = False  # a failed load read it, in a tier that drops such entries


@dataclass
class Tier:
    spec: TierSpec
    entries: dict = field(default_factory=dict)  # key -> Entry
    policy: object = None
    bytes_down: int = 0
    bytes_up: int = 0
    hits: int = 0
    by_request: bool = False  # request_recency
    requests: dict = field(default_factory=dict)  # seq -> Access
    # SPEC §13's swap: sequence -> blocks of it the tier holds (stored, by no key: never a hit,
    # never a victim of the policy, dropped at the resume or the free)
    swapped: dict = field(default_factory=dict)
    dropped: set = field(default_factory=set)  # failed_load_drops_unannounced's, till stored again
    # Counted as entries change, so that the ledger reads no entry: STORING ones, read ones.
    storing: int = 0
    loading: int = 0

    def __post_init__(self):
        classes = REQUEST_POLICY_CLASSES if self.by_request else POLICY_CLASSES
        self.policy = classes[self.spec.policy](self.spec.capacity)

    def access(self, seq) -> Access:
        return self.requests.setdefault(seq, Access())

    def evictable(self, key, mine) -> bool:
        e = self.entries[key]
        return key not in mine and e.state == STORED and not e.loads

    def held(self) -> int:
        return len(self.entries) + sum(self.swapped.values())

    def ledger(self) -> TierLedger:
        stored = self.held() - self.storing
        return TierLedger(self.spec.name, self.spec.capacity, stored, self.storing, self.loading,
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
    pins: list = field(default_factory=list)  # a load's: its lookup's [(key, tier)], released with it
    lost: set = field(default_factory=set)  # a load's (key, tier) removed under it (tier_removal.py)


class TransferError(ValueError):
    """An ill-formed transfer history (a completion with no begin, twice, an id reused)."""


class Tiers:
    """Tiers 1..n and the transfers in flight; ``leases`` counts, per device block, the stores
    in flight that copy from it, and ``load_targets`` the device blocks loads are writing."""

    def __init__(self, specs, block_bytes: int = 0, rules=()):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must differ, got {names}")
        unknown = sorted(set(rules) - set(TIER_RULES))
        if unknown:
            raise ValueError(f"unknown tier rule {unknown[0]!r} (known: {', '.join(TIER_RULES)})")
        self.whole_store = "whole_store_refused" in rules
        self.by_request = "request_recency" in rules
        self.own_evictable = "store_evicts_skipped" in rules
        self.when_reached = "store_skips_when_reached" in rules
        self.ranked_at_completion = "store_ranked_at_completion" in rules
        self.drops_unannounced = "failed_load_drops_unannounced" in rules
        self.removes_at_once = "failed_read_removes_at_once" in rules
        self.tiers = [Tier(s, by_request=self.by_request) for s in specs]
        self.block_bytes = block_bytes
        self.transfers: dict = {}  # id -> Transfer, in flight
        self.finished: set = set()
        self.leases: dict = {}  # device block -> stores in flight copying it
        self.load_targets: dict = {}  # device block -> load id writing it
        self.pins: dict = {}  # seq -> [(key, tier)] its lookup pinned, its load not begun

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
            if e is not None and e.state == STORED and not e.unreadable:
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

    def _read(self, key, tier: int) -> None:
        t = self.tiers[tier]
        e = t.entries[key]
        e.loads += 1
        t.loading += e.loads == 1

    def _unread(self, key, tier: int) -> None:
        t = self.tiers[tier]
        e = t.entries[key]
        e.loads -= 1
        t.loading -= not e.loads
        if e.unreadable and not e.loads:  # the last reader gone: the entry goes
            self._drop(t, key)

    def _drop(self, t: Tier, key) -> None:
        """An entry a failed load read leaves its tier."""
        del t.entries[key]
        t.policy.remove(key)
        if self.drops_unannounced:
            t.dropped.add(key)

    def pin(self, seq: int, keys) -> list:
        """A lookup of ``keys`` for ``seq``: pins the run :meth:`load_run` finds; returns it as
        [(key, tier)]."""
        pins = list(zip(keys, self.load_run(keys)))
        for key, tier in pins:
            self._read(key, tier)
        self.pins[seq] = pins
        return pins

    def unpin(self, seq: int) -> list:
        """Release the pins of ``seq``'s lookup (none: nothing); returns them."""
        pins = self.pins.pop(seq, [])
        for key, tier in pins:
            self._unread(key, tier)
        return pins

    # --- store ---------------------------------------------------------------------------

    def store_begin(self, tid, seq: int, tier: int, blocks, positions=None) -> StorePlan:
        """Begin copying ``blocks`` = [(key, device block)] (at ``positions`` of ``seq``) down to
        tier ``tier``, block by block: a key held there (stored or storing) at the begin is skipped
        (store_skips_when_reached: held when the store reaches it); without room the policy evicts
        a stored block that no load reads and that is not one of this store's; if none, the block
        is refused (whole_store_refused: every victim the new blocks need is found first, or all of
        them are refused). Each begun block's device block is leased until completion."""
        self._new_id(tid)
        t = self.tiers[tier]
        plan = StorePlan()
        mine = {k for k, _ in blocks if not (self.own_evictable and k in t.entries)}
        where = dict(zip([k for k, _ in blocks], positions or [None] * len(blocks)))
        new = [(k, b) for k, b in blocks if k not in t.entries or self.when_reached]
        plan.skipped = [k for k, _ in blocks if k in t.entries and not self.when_reached]
        misses = [k for k, _ in new if k not in t.entries]
        if self.by_request:  # a request's misses adapt ARC once; its offers are accesses
            acc = t.access(seq)
            misses = [k for k in misses if k not in acc.store_misses]
            acc.store_misses.update(misses)
            ready = [k for k in plan.skipped if t.entries[k].state == STORED]
            offered = {k for k, _ in new} | set(ready)
            t.policy.on_store_miss(misses)
            t.policy.on_request_access(acc.record([(k, where[k]) for k, _ in blocks if k in offered],
                                                  reused=ready), seq)
        else:
            t.policy.on_store_miss(misses)
        evictable = functools.partial(t.evictable, mine=mine)
        if self.whole_store:
            short = len(new) - (t.spec.capacity - t.held())
            victims = t.policy.victims(short, evictable) if short > 0 else []
            if victims is None:
                plan.refused, new, victims = [k for k, _ in new], [], []
            for victim in victims:
                self._evict(t, victim, plan)
        for key, block in new:
            if key in t.entries:  # store_skips_when_reached: held when the store reaches it
                plan.skipped.append(key)
                continue
            if t.held() >= t.spec.capacity:
                victim = t.policy.victims(1, evictable)
                if victim is None:
                    plan.refused.append(key)
                    continue
                self._evict(t, victim[0], plan)
            t.entries[key] = Entry(STORING)
            t.storing += 1
            t.policy.insert(key, seq, where[key])
            if self.by_request:
                t.access(seq).inserted.add(key)
            plan.begun.append((key, block))
            if block is not None:  # None: a model without device blocks
                self.leases[block] = self.leases.get(block, 0) + 1
        self.transfers[tid] = Transfer("store", seq, tier, plan.begun)
        return plan

    @staticmethod
    def _evict(t: Tier, key, plan: StorePlan) -> None:
        t.policy.evict(key)
        del t.entries[key]
        plan.evicted.append(key)

    # --- swap (SPEC §13) --------------------------------------------------------------------

    def swap_out(self, seq: int, tier: int, blocks: int) -> list | None:
        """Move ``blocks`` blocks of ``seq`` to tier ``tier`` at once: the policy evicts stored
        blocks no load reads until they fit; None (nothing changed) when even that is not enough.
        Returns the keys evicted."""
        t = self.tiers[tier]
        evictable = functools.partial(t.evictable, mine=())
        short = blocks - (t.spec.capacity - t.held())
        victims = t.policy.victims(short, evictable) if short > 0 else []
        if victims is None:
            return None
        evicted = []
        for victim in victims:
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

    def load_begin(self, tid, seq: int, blocks, positions=None) -> None:
        """Begin loading ``blocks`` = [(key, tier, device target)] (from :meth:`load_run`, at
        ``positions`` of ``seq``): each tier entry is read until completion, and touched by its
        policy (request_recency: an access of the request)."""
        self._new_id(tid)
        positions = positions or [None] * len(blocks)
        for key, tier, target in blocks:
            entry = self.tiers[tier].entries[key]
            if entry.state != STORED or entry.unreadable:
                raise TransferError(f"load of block {key!r} from tier {self.tiers[tier].spec.name}, "
                                    f"where it is {'unreadable' if entry.unreadable else entry.state}")
            self._read(key, tier)
            if target is not None:
                self.load_targets[target] = tid
            self.tiers[tier].hits += 1
        for i, t in enumerate(self.tiers):
            mine = [(k, p) for (k, tier, _), p in zip(blocks, positions) if tier == i]
            if self.by_request:
                if mine:
                    t.policy.on_request_access(t.access(seq).record(mine, [k for k, _ in mine]), seq)
            else:
                t.policy.touch([k for k, _ in mine])
        self.transfers[tid] = Transfer("load", seq, blocks=list(blocks), pins=self.pins.pop(seq, []))

    def finish(self, seq) -> None:
        """``seq`` is freed: each tier's policy takes its accesses (request_recency)."""
        for t in self.tiers:
            acc = t.requests.pop(seq, None)
            if acc is not None:
                t.policy.on_request_finished(acc.ordered(), acc.inserted - acc.reused, acc.reused, seq)

    # --- completion and abort --------------------------------------------------------------

    def complete(self, tid, ok: bool) -> Transfer:
        """Complete transfer ``tid``: a store's blocks become stored (ok) or vanish; a load's
        tier entries are read no more (the caller makes its targets readable, or frees them), and
        a failed one's are dropped where their tier declares ``failed_load`` "drop"."""
        tr = self.transfers.pop(tid, None)
        if tr is None:
            raise TransferError(f"completion of transfer {tid}, "
                                + ("which already completed" if tid in self.finished else "which never began"))
        self.finished.add(tid)
        if tr.kind == "store":
            t = self.tiers[tr.tier]
            t.storing -= len(tr.blocks)
            for key, block in tr.blocks:
                if ok:
                    t.entries[key].state = STORED
                    t.dropped.discard(key)  # announced stored again
                    if self.ranked_at_completion:  # its place in the order is taken now
                        t.policy.remove(key)
                        t.policy.insert(key, tr.seq)
                    t.policy.ready(key)
                else:
                    del t.entries[key]
                    t.policy.remove(key)
                if block is not None:
                    self._unlease(block)
            if ok:
                t.bytes_down += len(tr.blocks) * self.block_bytes
        else:
            self._end_load(tr, moved=ok, failed=not ok)
        return tr

    def _unlease(self, block) -> None:
        self.leases[block] -= 1
        if not self.leases[block]:
            del self.leases[block]

    def _end_load(self, tr: Transfer, moved: bool, failed: bool = False) -> None:
        if failed and self.removes_at_once:
            remove_at_once(self, tr)
        for key, tier, target in tr.blocks:
            t = self.tiers[tier]
            self.load_targets.pop(target, None)
            if (key, tier) in tr.lost:  # removed under it: it read none of it
                continue
            if moved:
                t.bytes_up += self.block_bytes
            t.entries[key].unreadable |= failed and t.spec.failed_load == "drop"
            self._unread(key, tier)
        for key, tier in tr.pins:
            self._unread(key, tier)

    def abort(self, seq: int) -> list:
        """Cancel the loads of ``seq`` (returned as [(id, transfer)]: their device targets are to
        be freed) and its lookup's pins; its stores stay in flight and complete or fail later."""
        self.unpin(seq)
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

