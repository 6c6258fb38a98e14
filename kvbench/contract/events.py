"""KV events (SPEC §14): what a backend announces about its prefix cache, and residency replayed
from them alone.

A backend that publishes events returns them from ``events()``: those emitted since the last call,
in order. ``key`` is the block key of SPEC §9 as the backend's prefill received it (the block hash,
with the salt and adapter where it takes them); ``parent`` the key of the block before it in the
same sequence and group (None for the first); ``group`` the KV cache group; ``tier`` 0 for the
device pool, 1.. for the lower tiers of SPEC §11.
"""
from __future__ import annotations

from dataclasses import dataclass

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: str  # STORED | REMOVED | CLEARED
    key: object = None
    parent: object = None
    group: int = 0
    tier: int = 0

    def __post_init__(self):
        if self.kind not in (STORED, REMOVED, CLEARED):
            raise ValueError(f"a KV event is stored, removed or cleared, got {self.kind!r}")


class EventOrderError(ValueError):
    """An event stream breaks SPEC §14's order rules (the message says which and where)."""


class Residency:
    """The keys present per (group, tier), replayed from events alone, with SPEC §14's order rules:
    a key is stored at most once while present, nothing is removed that was not stored, and a
    stored block's parent is present or None."""

    def __init__(self):
        self.present: dict[tuple, set] = {}  # (group, tier) -> keys
        self.count = 0  # events applied

    def apply(self, event: KVEvent) -> None:
        keys = self.present.setdefault((event.group, event.tier), set())
        if event.kind == CLEARED:
            self.present.clear()
        elif event.kind == STORED:
            if event.key in keys:
                raise EventOrderError(f"{self._where(event)}: the key is already present")
            if event.parent is not None and event.parent not in keys:
                raise EventOrderError(f"{self._where(event)}: its parent {event.parent!r} is not present")
            keys.add(event.key)
        else:
            if event.key not in keys:
                raise EventOrderError(f"{self._where(event)}: removes a key that is not present")
            keys.remove(event.key)
        self.count += 1

    def _where(self, event: KVEvent) -> str:
        # only for an error: a routed run applies millions of events
        return f"event {self.count} ({event.kind} {event.key!r}, group {event.group}, tier {event.tier})"

    def extend(self, events) -> None:
        for event in events:
            self.apply(event)

    def keys(self, group: int = 0, tier: int = 0) -> frozenset:
        return frozenset(self.present.get((group, tier), ()))
