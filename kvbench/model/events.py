"""The KV events the oracle expects (SPEC §14): what its prefix cache gained and lost per group
and tier since the last look, derived from the model alone.

Tier 0 is the oracle's prefix cache (``by_hash``: the keys a hit may find; under the rule
``events_from_tree``, its radix tree's keys: SGLang announces what its tree inserts and evicts),
tiers 1.. the keys stored in the lower tiers of kvbench.model.tiers (and, under the tier rule
``failed_load_drops_unannounced``, those a failed load dropped unannounced). The changes are
net over an operation: a key that entered and left within it (a load's target, cached then held
out of the cache until the load completes) is no change. Tier 0 is read from the pool's
``key_log`` (the keys it touched: O(changes) per look; a pool without one is compared whole);
the lower tiers, small, are compared whole.
"""
from __future__ import annotations


class ExpectedEvents:
    """The oracle's prefix cache per (group, tier), and its changes since the last ``changes()``."""

    def __init__(self, oracle):
        self.oracle = oracle
        # events_from_tree (SGLang): tier 0 is the radix tree's keys, logged by the tree.
        rules = getattr(oracle, "rules", None)
        self.tree = getattr(oracle, "tree", None) if getattr(rules, "events_from_tree", False) else None
        # A pool without the key log (an older or rewritten pool.py) is compared whole instead.
        self.logged = hasattr(oracle, "key_log") or self.tree is not None
        self.present: dict[tuple, set] = {}  # (group, tier) -> keys, as of the last look
        if self.tree is not None:
            self.tree.log = {}
            self.present[(0, 0)] = set(self.tree.keys)
        else:
            oracle.key_log = {}
            for g, key in oracle.by_hash:
                self.present.setdefault((g, 0), set()).add(key)
        self.tiers = getattr(oracle, "tiers", None)
        # failed_load_drops_unannounced: per tier, the keys a failed load dropped unannounced, as
        # of the last look (present still), and per (group, tier) those stored again since, which
        # the backend announces stored again while an index still holds them
        self.dropped: dict = {}
        self.restored: dict = {}
        for t in range(len(self.tiers.tiers) if self.tiers is not None else 0):
            for g, key in self.tiers.stored_keys(t):
                self.present.setdefault((g, t + 1), set()).add(key)

    def keys(self, group: int = 0, tier: int = 0) -> frozenset:
        return frozenset(self.present.get((group, tier), ()))

    def changes(self) -> dict:
        """{(group, tier): (keys stored, in the order the model cached them; keys removed)} since
        the last call, net; (group, tier) pairs without a change are left out."""
        out: dict = {}
        if self.tree is not None:  # O(keys it touched), as the pool's log
            tree = self.tree
            for key in tree.log:
                self._note(out, (0, 0), key, key in tree.keys)
            log, by_hash = {}, ()
            tree.log.clear()
        else:
            log, by_hash = self.oracle.key_log, self.oracle.by_hash
        if not self.logged:
            log.update(dict.fromkeys(gk for gk in by_hash if gk[1] not in self.present.get((gk[0], 0), ())))
            log.update(dict.fromkeys((g, k) for (g, t), keys in self.present.items() if t == 0
                                     for k in keys if (g, k) not in by_hash))
        for gk in log:
            g, key = gk
            self._note(out, (g, 0), key, gk in by_hash)
        log.clear()
        self.restored = {}
        if self.tiers is not None:
            for t in range(len(self.tiers.tiers)):
                now = self.tiers.stored_keys(t)
                dropped = self.tiers.tiers[t].dropped
                if dropped or self.dropped.get(t):  # failed_load_drops_unannounced
                    for g, key in self.dropped.get(t, set()) & now:  # stored again: said again
                        self.restored.setdefault((g, t + 1), set()).add(key)
                    self.dropped[t] = set(dropped)
                    now |= dropped
                was = {(g, k) for (g, tier), keys in self.present.items() if tier == t + 1 for k in keys}
                for g, key in sorted(now ^ was, key=repr):
                    self._note(out, (g, t + 1), key, (g, key) in now)
        return {gt: (stored, removed) for gt, (stored, removed) in out.items() if stored or removed}

    def _note(self, out, gt, key, now: bool) -> None:
        keys = self.present.setdefault(gt, set())
        if now == (key in keys):
            return
        stored, removed = out.setdefault(gt, ([], set()))
        if now:
            keys.add(key)
            stored.append(key)
        else:
            keys.discard(key)
            removed.add(key)
