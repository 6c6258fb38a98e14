"""The eviction policies of a lower tier (SPEC §11), as vLLM ships them
(``vllm/v1/kv_offload/cpu/policies/``): ``lru`` and ``arc``, and vLLM's LRU as its connector
drives it (``request_recency``: RequestLRUPolicy, over each request's ``Access``). A policy
orders a tier's keys and picks victims among those the tier says are evictable; the tier model
(tiers.py) keeps their states.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Access:
    """A request's accesses of one tier, as vLLM's manager records them (request_recency)."""

    positions: dict = field(default_factory=dict)  # key -> position, in the order first seen
    inserted: set = field(default_factory=set)  # keys its stores put here
    reused: set = field(default_factory=set)  # stored keys it loaded or offered, not its own
    store_misses: set = field(default_factory=set)  # keys its stores offered absent

    def record(self, items, reused=()) -> list:
        """Note [(key, position)] accessed; returns those first seen now."""
        new = [(k, p) for k, p in items if k not in self.positions]
        self.positions.update(new)
        self.reused.update(k for k in reused if k not in self.inserted)
        return new

    def ordered(self) -> list:
        keys = list(self.positions)
        if all(p is not None for p in self.positions.values()):
            keys.sort(key=self.positions.__getitem__)
        return keys


class LRUPolicy:
    """Least recently used first (vLLM's LRUCachePolicy): a store inserts at the most recent end,
    a load touches its blocks so that the first is the most recent; the order of every block in
    the tier (storing ones included, which are never chosen)."""

    def __init__(self, capacity: int):
        self.order: OrderedDict = OrderedDict()

    def insert(self, key, seq=None, position=None) -> None:
        self.order[key] = None

    def remove(self, key) -> None:
        del self.order[key]

    def ready(self, key) -> None:
        """A store of ``key`` completed."""

    def touch(self, keys) -> None:
        for key in reversed(list(keys)):  # the first block ends the most recent
            if key in self.order:
                self.order.move_to_end(key)

    def victims(self, n: int, evictable) -> list | None:
        """The ``n`` next victims, least recent first, or None when fewer are evictable."""
        found = list(itertools.islice((k for k in self.order if evictable(k)), n))
        return found if len(found) == n else None

    def evict(self, key) -> None:
        del self.order[key]

    def order_of(self) -> list:
        return list(self.order)

    def on_store_miss(self, keys) -> None:
        """A store offers ``keys``, absent here (ARC adapts to its ghosts)."""

    def on_request_access(self, items, seq) -> None:
        """Request ``seq`` first accesses [(key, position)] (request_recency)."""

    def on_request_finished(self, ordered, insertion_only, reused, seq) -> None:
        """Request ``seq`` finished: the keys it accessed, first position first (request_recency)."""


class RequestLRUPolicy(LRUPolicy):
    """vLLM's LRUCachePolicy as its connector drives it (request_recency): each key has a rank,
    the least evicted first. A store inserts a key with its request's rank, earlier positions
    more recent: ``(rank, -position)``, the request's rank drawn at its first access; a request's
    first access of a key held here raises the key to that rank; when the request finishes, each
    key it accessed gets a new rank, its last position first (so its first ends the most recent)."""

    def __init__(self, capacity: int):
        self.rank: dict = {}  # key -> (rank, -position)
        self.request_rank: dict = {}  # seq -> its rank
        self.next = 0
        # The victim order without a sort per search: a heap of (rank, arrival, key), an entry
        # stale once its key's rank changed or it left. ``arrival`` (when the key entered
        # ``rank``) breaks equal ranks as sorting the dict in its own order does.
        self.heap: list = []
        self.arrival: dict = {}  # key -> its arrival
        self.arrivals = 0

    def _bump(self) -> int:
        self.next += 1
        return self.next

    def _request(self, seq) -> int:
        if seq not in self.request_rank:
            self.request_rank[seq] = self._bump()
        return self.request_rank[seq]

    def _set(self, key, rank) -> None:
        if self.rank.get(key) == rank:
            return
        if key not in self.rank:
            self.arrivals += 1
            self.arrival[key] = self.arrivals
        self.rank[key] = rank
        heapq.heappush(self.heap, (rank, self.arrival[key], key))
        if len(self.heap) > 2 * len(self.rank) + 32:  # stale entries at most half, amortised
            self.heap = [(r, self.arrival[k], k) for k, r in self.rank.items()]
            heapq.heapify(self.heap)

    def _current(self, entry) -> bool:
        rank, arrival, key = entry
        return self.rank.get(key) == rank and self.arrival.get(key) == arrival

    def insert(self, key, seq=None, position=None) -> None:
        self._set(key, (self._bump(), 0) if position is None else (self._request(seq), -position))

    def remove(self, key) -> None:
        del self.rank[key]
        del self.arrival[key]

    evict = remove

    def touch(self, keys) -> None:
        for key in reversed(list(keys)):
            if key in self.rank:
                self._set(key, (self._bump(), 0))

    def victims(self, n: int, evictable) -> list | None:
        """The ``n`` evictable keys of least rank, in rank order (the tier sorted by rank, equal
        ranks in arrival order), popping the heap as far as the last of them; the current
        entries popped go back, the stale ones not."""
        found, popped, seen = [], [], set()
        while self.heap and len(found) < n:
            entry = heapq.heappop(self.heap)
            if self._current(entry) and entry[2] not in seen:  # a rank set twice: one entry back
                seen.add(entry[2])
                popped.append(entry)
                if evictable(entry[2]):
                    found.append(entry[2])
        for entry in popped:
            heapq.heappush(self.heap, entry)
        return found if len(found) == n else None

    def order_of(self) -> list:
        return sorted(self.rank, key=self.rank.__getitem__)

    def on_request_access(self, items, seq) -> None:
        rank = self._request(seq)
        for key, position in items:
            if position is not None and key in self.rank and self.rank[key] < (rank, -position):
                self._set(key, (rank, -position))

    def on_request_finished(self, ordered, insertion_only, reused, seq) -> None:
        self.touch(ordered)
        self.request_rank.pop(seq, None)


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

    def insert(self, key, seq=None, position=None) -> None:
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
            else:
                self._ghost_hit(key)

    def _ghost_hit(self, key) -> None:
        if key in self.b1:
            self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys) -> None:
        for key in reversed(list(keys)):
            self._ghost_hit(key)

    def on_request_access(self, items, seq) -> None:
        """ARC learns nothing from an access until the request finishes."""

    def on_request_finished(self, ordered, insertion_only, reused, seq) -> None:
        for key in reversed(list(ordered)):
            if key in insertion_only:  # a store is no reuse: recency only
                for part in (self.t1, self.t2):
                    if key in part:
                        part.move_to_end(key)
                        break
            elif key in reused and key in self.t1:
                self.t2[key] = self.t1.pop(key)
            elif key in reused and key in self.t2:
                self.t2.move_to_end(key)

    def victims(self, n: int, evictable) -> list | None:
        """vLLM's batch eviction: while the T1 left (less those chosen) holds at least the
        target, T1's least recent evictable; else T2's; else T1's after all."""
        t1 = (k for k in self.t1 if evictable(k))
        t2 = (k for k in self.t2 if evictable(k))
        size, found = len(self.t1), []
        for _ in range(n):
            key = next(t1, None) if size >= int(self.target) else None
            if key is None:
                key = next(t2, None)
            if key is None:
                key = next(t1, None)
            if key is None:
                return None
            size -= key in self.t1
            found.append(key)
        return found

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
REQUEST_POLICY_CLASSES = {"lru": RequestLRUPolicy, "arc": ARCPolicy}  # request_recency
