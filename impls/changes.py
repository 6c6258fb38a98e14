"""What a pool's free structures changed since the checker last read them (``BlockChanges``).

A pool whose uncached free blocks are a stack (``free_stack[:free_top]``, the top taken next) and
whose cached free blocks are a :class:`CachedQueue` reports, from the structures themselves, the
top of the stack below which nothing moved (the lowest ``free_top`` since the mark) and the
queue's log, so that the checker reads per operation what it changed, never the whole pool.
"""
from __future__ import annotations

from collections import OrderedDict

from kvbench.contract.protocol import BlockChanges


class CachedQueue(OrderedDict):
    """Cached free blocks, oldest first (``popitem(last=False)`` evicts), logging every block
    that enters or leaves while a reader holds a mark (``log`` is None until one asks)."""

    def __init__(self):
        super().__init__()
        self.log = None

    def __setitem__(self, block, value):
        if self.log is not None and block not in self:
            self.log.append((block, True))
        super().__setitem__(block, value)

    def __delitem__(self, block):
        super().__delitem__(block)
        if self.log is not None:
            self.log.append((block, False))

    def popitem(self, last=True):
        block, value = super().popitem(last)
        if self.log is not None:
            self.log.append((block, False))
        return block, value

    def pop(self, block, *default):
        there = block in self
        value = super().pop(block, *default)
        if there and self.log is not None:
            self.log.append((block, False))
        return value

    def clear(self):
        if self.log is not None:
            self.log.extend((b, False) for b in self)
        super().clear()

    def __reduce__(self):  # a copy starts with the same log, not one of its own insertions
        return _rebuilt, (type(self), list(self), None if self.log is None else list(self.log))


def _rebuilt(cls, blocks, log):
    q = cls()
    for b in blocks:
        q[b] = None
    q.log = log
    return q


class StackChanges:
    """The mark a paged pool hands out with its block state, and what changed since: mixed into
    a pool that keeps ``free_stack``, ``free_top`` and ``evictable`` (a :class:`CachedQueue`)."""

    _free_top = 0
    _free_low = 0
    _mark = None

    @property
    def free_top(self) -> int:
        return self._free_top

    @free_top.setter
    def free_top(self, n: int) -> None:
        self._free_top = n
        if n < self._free_low:
            self._free_low = n

    def _changes(self, changed_since, head):
        """A new mark, and the changes since ``changed_since`` (None when it is not the last
        mark handed out: the caller gives the whole state). ``head(low)``: the free list's
        entries from stack position ``low`` to the top, next taken first."""
        changes = None
        if changed_since is not None and changed_since is self._mark and self.evictable.log is not None:
            changes = BlockChanges(free_head=head(self._free_low), free_size=self.free_top,
                                   cached=self.evictable.log)
        self._mark = object()
        self._free_low = self.free_top
        self.evictable.log = []
        return self._mark, changes
