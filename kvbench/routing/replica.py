"""A replica of a routed run: the oracle's paged pool and prefix cache, publishing its KV events
(SPEC §14) and its load.

Events come from the replica's own ``events()`` where it has one; the oracle has none yet, so
:class:`EventingOracle` derives them from the two places a prefix-cache entry starts and ends
(``_cache``, ``_uncache``; a failed operation's restore is diffed whole): ``stored`` for a key that
became an entry, ``removed`` for one that stopped being one, ``cleared`` on a reset. A stored key's
parent is the key before it in the prompt that stored it when that key is present, else none (a
sliding group's sparse entries).

A replica is ledger-only: nothing reads its blocks' content, so it keeps no map of who wrote
each block (the oracle's ``writers``, for a leak check of the content, grows with every prompt
it ever served: a gigabyte over the Mooncake trace's 8 replicas), and the parents it knows are
those of the prompt it serves now, the only one whose keys an operation stores.
"""
from __future__ import annotations

from kvbench.contract.events import CLEARED, REMOVED, STORED, KVEvent
from kvbench.contract.protocol import Capabilities, CacheConfig
from kvbench.model.oracle import ModelOOM, Oracle
from kvbench.model.rules.spec import extra_keys
from kvbench.routing.policies import Load


class EventingOracle(Oracle):
    """The oracle, noting each (group, key) that enters or leaves its prefix cache."""

    def __init__(self, config: CacheConfig, capabilities: Capabilities | None = None):
        super().__init__(config, "paged", capabilities)
        self.changes: list = []  # (entered, group, key), in order
        self.parent_of: dict = {}  # key -> the key before it in the prompt being served

    def _note_writers(self, seq, tokens, hashes, token_ids, salt, adapter) -> dict:
        return {"extra": extra_keys(salt, adapter), "untagged": ()}  # no cross_key_writers

    def _cache(self, b, g, key, duplicates=False):
        new = (g, key) not in self.by_hash
        super()._cache(b, g, key, duplicates)
        if new and (g, key) in self.by_hash:
            self.changes.append((True, g, key))

    def _uncache(self, b):
        key = self.hash_of[b]
        super()._uncache(b)
        if key not in self.by_hash:
            self.changes.append((False, *key))

    def _restore(self, snap):
        before = set(self.by_hash)
        super()._restore(snap)
        after = set(self.by_hash)
        self.changes += [(False, g, k) for g, k in before - after]
        self.changes += [(True, g, k) for g, k in after - before]


class Replica:
    """One replica: its pool, its live requests (sequence -> finish time), its events."""

    def __init__(self, config: CacheConfig, capabilities: Capabilities | None = None):
        self.config, self.caps = config, capabilities
        self.oracle = EventingOracle(config, capabilities)
        self.live: dict = {}
        self._pending: list = []  # events not yet drained (a reset's cleared)
        self._present: set = set()  # (group, key) announced present

    def events(self) -> list:
        """The events since the last call, in order."""
        out, self._pending = self._pending, []
        own = getattr(self.oracle, "events", None)
        if callable(own):
            return out + list(own())
        parents = self.oracle.parent_of
        for entered, g, key in self.oracle.changes:
            if entered:
                if (g, key) in self._present:
                    continue  # left and came back within one operation: no change to announce
                parent = parents.get(key)
                self._present.add((g, key))
                out.append(KVEvent(STORED, key, parent if (g, parent) in self._present else None, g))
            elif (g, key) in self._present:
                self._present.discard((g, key))
                out.append(KVEvent(REMOVED, key, None, g))
        self.oracle.changes = []
        return out

    def load(self) -> Load:
        return Load(len(self.live), self.oracle.blocks_used)

    def reset(self) -> None:
        """The whole prefix cache reset (its live requests finished first): ``cleared``."""
        for seq in list(self.live):
            self.finish(seq)
        self.events()  # what finishing them announced comes before the reset
        self.oracle = EventingOracle(self.config, self.caps)
        self._present = set()
        self._pending.append(KVEvent(CLEARED))

    def finish(self, seq) -> None:
        self.oracle.free(seq)
        del self.live[seq]

    def serve(self, seq, job, keys, step: int) -> tuple[int, int]:
        """Prefill ``job`` (its prompt's ``keys``) and append its output; while it does not fit,
        the live request finishing first finishes early (the request waits for it). Returns
        (prompt tokens the engine took from its prefix cache, requests it waited for)."""
        o, waited = self.oracle, 0
        o.parent_of = dict(zip(keys, (None,) + tuple(keys[:-1])))
        while True:
            try:
                L, _, _ = o._cache_hits(keys, job.tokens) if o.caching else (0, None, 0)
                o.prefill(seq, job.tokens, job.tenant, job.tokens + job.output, step,
                          hashes=job.hashes, salt=job.salt, adapter=job.adapter)
                break
            except ModelOOM:
                waited += self._wait(job)
        delivered = min(L * o.B, o.rules.most_hit_tokens(job.tokens) // o.B * o.B)
        self.live[seq] = job.finish
        while job.output:
            try:
                o.append([seq], [job.output], step)
                break
            except ModelOOM:
                waited += self._wait(job, seq)
        return delivered, waited

    def _wait(self, job, keep=None) -> int:
        others = [s for s in self.live if s != keep]
        if not others:
            raise ValueError(f"{job.where}: a request of {job.tokens} + {job.output} tokens does "
                             f"not fit a replica of {self.config.num_blocks} blocks of "
                             f"{self.config.block_size} tokens (give more --blocks)")
        self.finish(min(others, key=lambda s: (self.live[s], s)))
        return 1
