"""The reference index of a routed run (SPEC §14), and the block keys a router computes.

:class:`ReferenceIndex` keeps, per replica, the keys each KV cache group holds, replayed from that
replica's events alone through :class:`kvbench.contract.events.Residency` (so a stream that breaks
the order rules is the replica's fault, named with its event), and answers a request's longest
cached prefix on each replica with SPEC §8's hybrid hit: the longest L blocks such that every full
group holds the request's blocks below L and every releasing group (sliding, chunked, sinks) those
its kind holds at L * B tokens (kvbench.model.kinds: the oracle's own rule). A sliding group's
entries are sparse, and only the blocks its window needs at L are asked for.

The router's own key function is :func:`engine_keys` unless a planted fault replaces it
(:data:`ROUTER_KEYS`); the planted indexes (:data:`INDEXES`) are the reference's with one bug each.
"""
from __future__ import annotations

from kvbench.contract.events import CLEARED, REMOVED, STORED, KVEvent, Residency
from kvbench.model.kinds import kind_of
from kvbench.model.rules.spec import extra_keys

_EMPTY = frozenset()


def engine_keys(hashes, tokens: int, block_size: int, salt=None, adapter=None) -> tuple:
    """The keys of a prompt's full blocks as the engine's prefill takes them (SPEC §9): each
    block hash with the prompt's tagged extra keys; ``Oracle.prompt_keys`` of the same prompt
    (tests/routing holds the two equal)."""
    hashes = tuple(hashes or ())[:tokens // block_size]
    extra = extra_keys(salt, adapter)
    return tuple((extra, h) for h in hashes) if extra else hashes


def keys_without_salt(hashes, tokens, block_size, salt=None, adapter=None) -> tuple:
    """Planted: a router that drops the salt from its keys (the adapter kept)."""
    return engine_keys(hashes, tokens, block_size, None, adapter)


def keys_own_block_size(hashes, tokens, block_size, salt=None, adapter=None) -> tuple:
    """Planted (TensorRT-LLM issue 14882): a router that hashes blocks of its own size, twice the
    engine's: its keys name other blocks, and match none the engine announces."""
    own = 2 * block_size
    keys = engine_keys(hashes, tokens, block_size, salt, adapter)
    return tuple(("router-block", own, keys[2 * i + 1]) for i in range(tokens // own))


ROUTER_KEYS = {"engine": engine_keys, "drop-salt": keys_without_salt,
               "own-block-size": keys_own_block_size}


class ReferenceIndex:
    """Per replica, the keys present per group (device tier), from events; a request's longest
    cached prefix on each replica, in blocks."""

    strict = True  # the order rules of SPEC §14 hold the replicas' streams

    def __init__(self, replicas: int, groups, block_size: int):
        self.B = block_size
        self.kinds = [kind_of(g, block_size) for g in groups]
        self.residency = [Residency() for _ in range(replicas)]

    def apply(self, replica: int, event: KVEvent) -> None:
        if self.strict:
            self.residency[replica].apply(event)
            return
        present = self.residency[replica].present  # a lenient index: no order rule held
        if event.kind == CLEARED:
            present.clear()
        elif event.kind == STORED:
            present.setdefault((event.group, event.tier), set()).add(event.key)
        elif event.kind == REMOVED:
            present.get((event.group, event.tier), set()).discard(event.key)

    def extend(self, replica: int, events) -> None:
        for event in events:
            self.apply(replica, event)

    def _sets(self, replica: int) -> list:
        present = self.residency[replica].present
        return [present.get((g, 0), _EMPTY) for g in range(len(self.kinds))]

    def overlap(self, replica: int, keys) -> int:
        """The longest prefix of ``keys`` (blocks) the replica holds, SPEC §8's hybrid hit."""
        sets = self._sets(replica)
        top = len(keys)
        for held, kind in zip(sets, self.kinds):
            if not kind.releases:
                run = 0
                while run < top and keys[run] in held:
                    run += 1
                top = run
        if not any(kind.releases for kind in self.kinds):
            return top
        for L in range(top, 0, -1):
            if all(keys[i] in held for held, kind in zip(sets, self.kinds) if kind.releases
                   for i in kind.held(L * self.B)):
                return L
        return 0

    def overlaps(self, keys) -> list:
        return [self.overlap(r, keys) for r in range(len(self.residency))]

    def keys(self, replica: int, group: int = 0) -> frozenset:
        return frozenset(self._sets(replica)[group])


class MissesCleared(ReferenceIndex):
    """Planted: an index that never applies ``cleared``: after a replica's reset it still believes
    in every block the replica held before."""

    strict = False

    def apply(self, replica, event):
        if event.kind != CLEARED:
            super().apply(replica, event)


class SparseAsPrefix(ReferenceIndex):
    """Planted (llm-d-router issue 2362): a sliding group's sparse entries read as a contiguous
    prefix: a block present there vouches for every block before it, released ones included."""

    strict = False

    def overlap(self, replica, keys) -> int:
        sets = self._sets(replica)
        top = len(keys)
        for held, kind in zip(sets, self.kinds):
            if kind.releases:  # the last block present, and (it believes) all before it
                last = max((i for i, k in enumerate(keys) if k in held), default=-1)
                top = min(top, last + 1)
            else:
                run = 0
                while run < top and keys[run] in held:
                    run += 1
                top = run
        return top


INDEXES = {"reference": ReferenceIndex, "misses-cleared": MissesCleared,
           "sparse-as-prefix": SparseAsPrefix}
