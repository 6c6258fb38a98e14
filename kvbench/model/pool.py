"""The block pool of the paged model, which a backend declaring ``block_ids`` matches block by
block (docs/writing-a-backend.md). Uncached free blocks form a stack (0 on top, then 1, 2, ...),
cached free blocks (hashed, no reference) a queue: a block is taken from the stack, else the
oldest cached one, its key forgotten; a block whose last reference goes is pushed on the stack,
or appended to the queue if hashed. ``BlockPool.STATE``: what a refused operation restores.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np


class BlockPool:
    """The free stack, the cached queue, the prefix cache's keys and every block's references."""
    STATE = ("blocks", "group_of", "free_stack", "fresh", "evictable", "by_hash", "hash_of",
             "filled", "shared", "group_used", "refs")

    def _init_pool(self, num_blocks: int, block_size: int, groups: int) -> None:
        self.num_blocks, self.B = num_blocks, block_size
        self.blocks: dict[int, list] = {}  # block in use -> [refcount, fill]
        self.group_of: dict[int, int] = {}  # block in use -> the group it serves
        # The uncached free blocks: a stack (top = end) over those never handed out (fresh ..
        # num_blocks - 1, fresh taken first): no list as long as the pool.
        self.free_stack: list = []
        self.fresh = 0
        # Prefix caching: full blocks registered by (group, key); a freed one stays cached
        # (evictable, first in first evicted) until its space is needed.
        self.by_hash: dict = {}  # (group, key) -> [cached blocks], first registered first
        self.hash_of: dict = {}  # block -> (group, key)
        self.evictable: OrderedDict = OrderedDict()  # block -> None, in eviction order
        # The ledger's sums: slots filled in blocks in use, blocks with 2+ references, blocks in
        # use per group, each block's references.
        self.filled = self.shared = 0
        self.group_used = [0] * groups
        self.refs = np.zeros(num_blocks, dtype=np.int64)
        self.edits = 0  # changes of any reference count: what block structures a check must reread
        # Since the last block_state() (its mark): the fewest uncached free blocks, and the
        # cached queue's entries and exits in order; free_list()'s buffer.
        self._mark, self._free_low, self._cached_log, self._ids = None, 0, None, None
        self.key_log: dict | None = None  # (group, key) the cache gained or lost (model/events.py)

    @property
    def blocks_used(self) -> int:
        return len(self.blocks)

    @property
    def blocks_free(self) -> int:
        return self.num_blocks - len(self.blocks)

    @property
    def uncached_free(self) -> int:
        """Free blocks that hold no cached prefix."""
        return len(self.free_stack) + self.num_blocks - self.fresh

    def _new_block(self, fill: int, group: int) -> int:
        """The top of the free stack, else the next never used, else the oldest cached one."""
        if self.free_stack:
            b = self.free_stack.pop()
        elif self.fresh < self.num_blocks:
            b, self.fresh = self.fresh, self.fresh + 1
        else:  # reuse the least recently freed cached block
            b = next(iter(self.evictable))
            self._uncache(b)
        self._use(b, fill, group)
        self._free_low = min(self._free_low, self.uncached_free)
        return b

    def _use(self, b: int, fill: int, group: int) -> None:
        """A free block in use, with one reference."""
        self.blocks[b], self.group_of[b], self.refs[b] = [1, fill], group, 1
        self.filled += fill
        self.group_used[group] += 1
        self.edits += 1

    def _unqueue(self, b: int) -> None:
        """A cached free block out of the queue."""
        del self.evictable[b]
        if self._cached_log is not None:
            self._cached_log.append((b, False))

    def _uncache(self, b: int) -> None:
        """A cached free block forgets its key."""
        self._unqueue(b)
        key = self.hash_of.pop(b)
        self.by_hash[key].remove(b)
        if not self.by_hash[key]:
            del self.by_hash[key]
            if self.key_log is not None:
                self.key_log[key] = None

    def _drop_ref(self, b: int) -> None:
        """One reference less; at 0 to the cached queue's end if hashed, else the stack's top."""
        self.edits += 1
        self.blocks[b][0] -= 1
        self.refs[b] -= 1
        self.shared -= self.blocks[b][0] == 1
        if self.blocks[b][0] == 0:
            self.filled -= self.blocks.pop(b)[1]
            self.group_used[self.group_of.pop(b)] -= 1
            if b in self.hash_of:
                self.evictable[b] = None
                if self._cached_log is not None:
                    self._cached_log.append((b, True))
            else:
                self.free_stack.append(b)

    def _add_ref(self, b: int) -> None:
        self.blocks[b][0] += 1
        self.refs[b] += 1
        self.shared += self.blocks[b][0] == 2

    def _taken_back(self, hits, drop) -> int:
        """Cached blocks of ``hits`` a request takes back from the free pool, ``drop`` gone."""
        return sum(1 for per in hits for b in per.values()
                   if b not in self.blocks or self.blocks[b][0] == drop.get(b, 0))

    def _take_hits(self, hits) -> None:
        """One more reference to each hit; a freed one leaves the cached queue, wherever it is."""
        for b in (b for per in hits for b in per.values()):
            if b in self.blocks:
                self._add_ref(b)
                self.edits += 1
            else:
                self._unqueue(b)
                self._use(b, self.B, self.hash_of[b][0])

    def _cache(self, b: int, g: int, key, duplicates: bool = False) -> None:
        """Cache block ``b`` of group ``g`` under ``key``; a second block only with ``duplicates``
        (the first registered stays the one a hit takes)."""
        if (g, key) in self.by_hash and not duplicates:
            return
        if self.key_log is not None:
            self.key_log[(g, key)] = None
        self.by_hash.setdefault((g, key), []).append(b)
        self.hash_of[b] = (g, key)

    def free_list(self, count: int | None = None) -> np.ndarray:
        """The first ``count`` uncached free blocks, next taken first (None: all, as a read-only
        view valid until the next call)."""
        stack, fresh = self.free_stack, self.fresh
        if count is not None:
            top = stack[::-1] if count >= len(stack) else stack[len(stack) - count:][::-1]
            rest = max(0, min(self.num_blocks - fresh, count - len(top)))
            return np.concatenate([np.array(top, dtype=np.int64),
                                   np.arange(fresh, fresh + rest, dtype=np.int64)])
        if self._ids is None:  # the never used blocks in order; the pushed ones go just before
            self._ids = np.arange(self.num_blocks, dtype=np.int64)
        ids = self._ids  # below fresh only pushed blocks (each once, so at most fresh of them)
        ids[fresh - len(stack):fresh] = stack[::-1]  # (fresh only grows: ids[fresh:] are intact)
        view = ids[fresh - len(stack):]
        view.flags.writeable = False
        return view
