"""KV events (SPEC §14) checked after every operation, for a backend that publishes them
(kvbench.contract.protocol.publishes_events).

The backend's events of the operation are applied to a Residency (kvbench.contract.events): an
event that breaks an order rule (a key stored twice while present, a removal of a key not
present, a parent not present) FAILs naming the rule and the event. What they changed, net per
group and tier, must be what the oracle's prefix cache changed (kvbench.model.events): the keys
that differ are named, and since both start empty, the residency replayed from the events alone
equals the oracle's prefix cache after every operation.

A backend names blocks by its own keys (its hash of the salt, adapter or token ids), the oracle
by its own: the first time a key is stored it is paired with the oracle's key stored in that
group and tier at that operation, and from then on each side's key stands for the other's. A key
is paired by its identity, its value in its namespace: a backend whose keys are the trace's
(its rule set's ``event_keys`` "trace") has a key equal to the oracle's paired with it first; the
rest, and every key of a backend in its own hash space, are paired in the order announced (vLLM's
int 48, its hash of the trace's key 0, is not the trace's key 48). A backend key paired with
one oracle key and announced for another diverges there, as an isolation bug would.

A backend whose lower tiers' events name an entry without its salt (rule ``tier_event_keys``
"unsalted": LMCache's controller messages) has those tiers replayed as copies per key: each
stored event adds one, each removed one takes one, and after every operation the copies per key
equal the oracle's entries per key with the salt left out (its ``unsalted_key``), paired in a
namespace of their own.
"""
from __future__ import annotations

from collections import Counter

from kvbench.checking.raised import BackendRaised, BadReturn, guarded
from kvbench.contract.events import CLEARED, STORED, EventOrderError, KVEvent, Residency
from kvbench.model.events import ExpectedEvents

SHOWN = 6  # keys named per side in a divergence


class EventReplay:
    """The events of one replay (``replay``: the checker's _Replay), checked op by op."""

    def __init__(self, replay, expected=None):
        self.replay = replay
        self.expected = expected if expected is not None else ExpectedEvents(replay.oracle)
        self.residency = Residency()
        self.to_model: dict = {}  # backend key -> oracle key
        self.to_backend: dict = {}  # oracle key -> backend key
        rules = getattr(getattr(replay, "oracle", None), "rules", None)
        self.trace_keys = getattr(rules, "event_keys", "trace") == "trace"  # the backend's namespace
        # tier_event_keys "unsalted": (group, tier) -> Counter of backend keys, the pairs of
        # those keys with the oracle's unsalted keys, the copies the oracle held after the last
        # operation, and the keys first stored in this one
        self.unsalted = getattr(rules, "tier_event_keys", "salted") == "unsalted"
        self.copies: dict = {}
        self.copy_to_model: dict = {}
        self.copy_to_backend: dict = {}
        self.copies_before: dict = {}
        self.fresh_copies: dict = {}
        self.checked = 0  # events applied
        self.again: dict = {}  # (group, tier) -> keys removed and stored again in this operation

    def compare(self) -> None:
        """After an operation: the backend's events, by the order rules, then their net change
        against the oracle's."""
        replay = self.replay
        try:
            got = guarded("events", self.replay.backend.events)
            got = list(got) if got is not None else []
        except BackendRaised as e:
            replay.raised(e)
        except TypeError:
            replay.raised(BadReturn("events", got, "a list of KVEvent"))
        bad = next((e for e in got if not isinstance(e, KVEvent)), None)
        if bad is not None:
            replay.raised(BadReturn("events", bad, "a list of KVEvent"))
        self.verify(got, self.expected.changes())
        replay.verdict.events = self.checked

    def verify(self, events, expected: dict) -> None:
        """``events`` of one operation against ``expected`` (ExpectedEvents.changes())."""
        changed = self.apply(events)
        for gt in sorted(set(changed) | set(expected)):
            if not (self.unsalted and gt[1]):
                self.compare_group(gt, *changed.get(gt, ([], set())), *expected.get(gt, ([], set())))
        if self.unsalted:
            self.compare_copies(expected)

    def apply(self, events) -> dict:
        """Apply ``events`` to the residency; {(group, tier): (keys stored, in order; keys
        removed)}, net, with each stored key's parent noted."""
        res, net = self.residency, {}
        self.again, self.fresh_copies = {}, {}
        for event in events:
            gt = (event.group, event.tier)
            if self.unsalted and event.tier and event.kind != CLEARED:
                self.count_copy(event)
                continue
            if event.kind == CLEARED:
                self.copies.clear()
            elif (event.kind == STORED and event.key in res.present.get(gt, ())
                  and self.to_model.get(event.key) in self.expected.restored.get(gt, ())):
                # failed_load_drops_unannounced: dropped with no removal said, now stored again
                res.present[gt].discard(event.key)
                res.apply(event)
                self.checked += 1
                continue
            before = {w: set(keys) for w, keys in res.present.items()} if event.kind == CLEARED else {}
            try:
                res.apply(event)
            except EventOrderError as e:
                self.replay.diverge("event order", _rule(str(e)), _shown_event(event), str(e))
            self.checked += 1
            for where, keys in before.items():  # a reset: everything present before is gone
                stored, removed = net.setdefault(where, ({}, set()))
                for k in keys:
                    if k in stored:
                        del stored[k]
                    else:
                        removed.add(k)
            if event.kind == CLEARED:
                continue
            stored, removed = net.setdefault(gt, ({}, set()))
            if event.kind == STORED:
                if event.key in removed:  # gone and back: an entry announced again (vLLM #49125)
                    removed.discard(event.key)
                    self.again.setdefault(gt, []).append(event.key)
                else:
                    stored[event.key] = event.parent
            elif event.key in stored:
                del stored[event.key]  # came and went within the operation
            else:
                removed.add(event.key)
        return {gt: (list(s), r) for gt, (s, r) in net.items() if s or r or gt in self.again}

    def compare_group(self, gt, stored, removed, want_stored, want_removed) -> None:
        """One group and tier: the backend's net change (its keys) against the oracle's."""
        pairs = self.pair(stored, want_stored)
        got_stored = {pairs.get(a, Unpaired(a)) for a in stored}
        got_removed = {self.to_model.get(a, Unpaired(a)) for a in removed}
        again = [self.to_model.get(a, Unpaired(a)) for a in self.again.get(gt, ())]
        want_s, want_r = set(want_stored), set(want_removed)
        if got_stored == want_s and got_removed == want_r and not again:
            return
        group, tier = gt
        held = sorted(want_s - got_stored, key=repr) + sorted(got_removed - want_r, key=repr)
        extra = sorted(got_stored - want_s, key=repr) + sorted(want_r - got_removed, key=repr)
        reused = [o for o in sorted(got_stored - want_s, key=repr) if o in self.to_backend]
        detail = "; ".join(x for x in (
            held and f"in the model's cache, not in the events' residency: {_keys(held)}",
            extra and f"in the events' residency, not in the model's cache: {_keys(extra)}",
            reused and f"stored under the backend keys that stood for {_keys(reused)} when first "
                       f"stored: one key for two blocks (a salt or adapter left out?)",
            again and f"removed and stored again in one operation, never out of the model's "
                      f"cache: {_keys(again)}") if x)
        self.replay.diverge(f"residency of group {group}, tier {tier}",
                            {"stored": _keys(sorted(want_s, key=repr)),
                             "removed": _keys(sorted(want_r, key=repr))},
                            {"stored": _keys(sorted(got_stored, key=repr) + again),
                             "removed": _keys(sorted(got_removed, key=repr) + again)}, detail)

    def count_copy(self, event) -> None:
        """One event of a lower tier whose keys carry no salt: a copy more or less of its key."""
        gt = (event.group, event.tier)
        copies = self.copies.setdefault(gt, Counter())
        if event.kind == STORED:
            copies[event.key] += 1
            if event.key not in self.copy_to_model:
                self.fresh_copies.setdefault(gt, []).append(event.key)
        else:
            if not copies[event.key]:
                self.replay.diverge("event order", "nothing is removed that was not stored",
                                    _shown_event(event), "removes a key of which no copy is present")
            copies[event.key] -= 1
            if not copies[event.key]:
                del copies[event.key]
        self.checked += 1

    def compare_copies(self, expected: dict) -> None:
        """Each lower tier's copies per key without the salt, the events' against the oracle's."""
        unsalted = self.replay.oracle.unsalted_key
        gts = {gt for gt in self.expected.present if gt[1]} | set(self.copies)
        for gt in sorted(gts):
            want = Counter(unsalted(k) for k in self.expected.keys(*gt))
            order = [unsalted(k) for k in expected.get(gt, ([], set()))[0]]
            self.pair(self.fresh_copies.get(gt, []), list(dict.fromkeys(order)),
                      self.copy_to_model, self.copy_to_backend)
            got = Counter()
            for a, n in self.copies.get(gt, {}).items():
                got[self.copy_to_model.get(a, Unpaired(a))] += n
            before = self.copies_before.get(gt, Counter())
            self.copies_before[gt] = want
            if got == want:
                continue
            differ = sorted((k for k in set(got) | set(want) if got[k] != want[k]), key=repr)
            self.replay.diverge(
                f"residency of group {gt[0]}, tier {gt[1]}",
                {"stored": _keys(sorted((want - before).elements(), key=repr)),
                 "removed": _keys(sorted((before - want).elements(), key=repr))},
                {"stored": _keys(sorted((got - before).elements(), key=repr)),
                 "removed": _keys(sorted((before - got).elements(), key=repr))},
                "copies per key without its salt, the model's against the events': "
                + ", ".join(f"{k!r} {want[k]} against {got[k]}" for k in differ[:SHOWN]))

    def pair(self, stored, want_stored, to_model=None, to_backend=None) -> dict:
        """The oracle key of each backend key ``stored`` names: known ones from before, new ones
        paired with the oracle's new keys (equal keys first where both are the trace's, then in
        order). ``to_model``, ``to_backend``: the pairs to read and extend (the residency's by
        default; the unsalted copies' for tier_event_keys "unsalted")."""
        to_model = self.to_model if to_model is None else to_model
        to_backend = self.to_backend if to_backend is None else to_backend
        out = {a: to_model[a] for a in stored if a in to_model}
        fresh = [a for a in stored if a not in to_model]
        if not fresh:
            return out
        open_ = [o for o in want_stored if o not in to_backend]
        left = set(open_)
        for a in fresh if self.trace_keys else ():
            if a in left:
                out[a] = a
                left.discard(a)
        rest = [o for o in open_ if o in left]
        for a, o in zip([a for a in fresh if a not in out], rest):
            out[a] = o
        for a in fresh:
            if a in out:
                to_model[a], to_backend[out[a]] = out[a], a
        return out


def _rule(message: str) -> str:
    """The order rule a Residency message says was broken."""
    if "already present" in message:
        return "a key is stored at most once while present"
    if "parent" in message:
        return "a stored block's parent is present or none"
    return "nothing is removed that was not stored"


def _shown_event(event: KVEvent) -> str:
    parent = "" if event.parent is None else f", parent {event.parent!r}"
    return f"{event.kind} {event.key!r}{parent} (group {event.group}, tier {event.tier})"


class Unpaired:
    """A backend key no oracle key stands for."""

    def __init__(self, key):
        self.key = key

    def __eq__(self, other):
        return isinstance(other, Unpaired) and other.key == self.key

    def __hash__(self):
        return hash(("unpaired", self.key))

    def __repr__(self):
        return f"backend key {self.key!r}"


def _keys(keys) -> list:
    """Keys as a divergence shows them: the first few."""
    shown = [repr(k) if isinstance(k, Unpaired) else k for k in keys[:SHOWN]]
    return shown + [f"... {len(keys) - SHOWN} more"] if len(keys) > SHOWN else shown
