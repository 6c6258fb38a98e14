"""KV events (SPEC §14) of the paged pools: ``events()`` read from the prefix cache itself.

A pool keeps its prefix cache in ``by_hash``, (group, key) -> block. As a :class:`KeyIndex` it
notes each key it gains or loses once ``events()`` was called, so each call costs what changed
since the last: a key
now cached and not yet announced is ``stored``, one announced and no longer cached ``removed``
(net since the last call). Each stored key names its parent, the key before it in its prompt,
when that key is cached in the same group and tier (announced first when both are new), else
None. The lower tiers (impls/pool_tiers.py) are compared whole: they are small.
"""
from __future__ import annotations

from kvbench.contract.events import REMOVED, STORED, KVEvent


class KeyIndex(dict):
    """A dict that notes the keys it gains and loses (``touched``, in order), once asked to
    (``touched`` a dict): a pool nobody asks for events pays nothing and keeps no list."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.touched: dict | None = None

    def __setitem__(self, key, value):
        if self.touched is not None:
            self.touched[key] = None
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        if self.touched is not None:
            self.touched[key] = None

    def pop(self, key, *default):
        if self.touched is not None:
            self.touched[key] = None
        return dict.pop(self, key, *default)

    def clear(self):
        if self.touched is not None:
            self.touched.update(dict.fromkeys(self))
        dict.clear(self)


class PoolEvents:
    """``events()`` of a pool (a mixin) whose ``by_hash`` is a KeyIndex; ``note_prompt(keys)``
    records the parents of a prompt's keys."""

    def _init_events(self) -> None:
        self.by_hash = KeyIndex(self.by_hash)
        self._parent_of: dict = {}  # key -> the key before it in its prompt
        self._announced: dict = {}  # (group, tier) -> keys announced present

    def note_prompt(self, keys) -> None:
        self._parent_of.update(zip(keys[1:], keys[:-1]))

    def events(self) -> list:
        return self._device_events() + self._tier_events()

    def _device_events(self) -> list:
        """The device pool's (tier 0), from its prefix cache."""
        out: list = []
        touched = self.by_hash.touched
        if touched is None:  # the first call: every key cached so far
            touched = self.by_hash.touched = dict.fromkeys(self.by_hash)
        if touched:
            self._announce(out, 0, [gk for gk in touched if gk in self.by_hash],
                           [gk for gk in touched if gk not in self.by_hash])
            touched.clear()
        return out

    def _tier_events(self) -> list:
        """The lower tiers' (1..), each compared whole with what was announced."""
        out: list = []
        for t, tier in enumerate(getattr(self, "_tiers", ())):
            now = {_group_key(k) for k, ready in tier.ready.items() if ready and k not in tier.pinned}
            was = {(g, k) for (g, i), keys in self._announced.items() if i == t + 1 for k in keys}
            if now != was:
                self._announce(out, t + 1, sorted(now - was, key=repr), sorted(was - now, key=repr))
        return out

    def _announce(self, out, tier, present, absent) -> None:
        """Stored events for the keys of ``present`` not announced yet (a parent before its
        child), then removed events for those of ``absent`` announced."""
        new = {}
        for g, key in present:
            if key not in self._announced.get((g, tier), ()):
                new[(g, key)] = None
        done: set = set()

        def store(gk):
            if gk in done:
                return
            done.add(gk)
            g, key = gk
            parent = self._parent_of.get(key)
            if parent is not None and (g, parent) in new:
                store((g, parent))
            keys = self._announced.setdefault((g, tier), set())
            out.append(KVEvent(STORED, key, parent if parent in keys else None, g, tier))
            keys.add(key)

        for gk in new:
            store(gk)
        for g, key in absent:
            keys = self._announced.get((g, tier))
            if keys and key in keys:
                keys.discard(key)
                out.append(KVEvent(REMOVED, key, None, g, tier))
                if tier == 0:  # a prefill that caches it again names its parent again
                    self._parent_of.pop(key, None)


def _group_key(key) -> tuple:
    """A tier's key as (group, key): the pool's prefix-cache key, group 0 for any other form."""
    return key if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int) else (0, key)
