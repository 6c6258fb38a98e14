"""The block pool alone (kvbench/model/pool.py): which block is taken next and where a released
one goes, by the rules its docstring states (docs/writing-a-backend.md's block order)."""
from __future__ import annotations

from kvbench.model.pool import BlockPool


class Pool(BlockPool):
    def __init__(self, num_blocks: int, block_size: int = 4, groups: int = 1):
        self._init_pool(num_blocks, block_size, groups)


def test_blocks_come_from_the_stack_then_the_never_used_then_the_oldest_cached():
    p = Pool(4)
    assert [p._new_block(4, 0) for _ in range(3)] == [0, 1, 2]  # never used, in order
    p._cache(1, 0, "k1")
    for b in (0, 1, 2):
        p._drop_ref(b)
    # 0 and 2 hold no key: pushed on the stack, 2 last so on top; 1 is hashed: queued
    assert list(p.free_list()) == [2, 0, 3]
    assert list(p.evictable) == [1]
    assert p.uncached_free == 3  # 2 on the stack + block 3 never used
    # the stack top first, then the never used, then the oldest cached, its key forgotten
    assert [p._new_block(1, 0) for _ in range(4)] == [2, 0, 3, 1]
    assert p.by_hash == {} and p.hash_of == {}


def test_the_cached_queue_is_first_released_first_taken():
    p = Pool(3)
    for b in range(3):
        p._new_block(4, 0)
        p._cache(b, 0, f"k{b}")
    for b in (2, 0, 1):  # released in this order: queued in this order
        p._drop_ref(b)
    assert list(p.evictable) == [2, 0, 1]
    assert p._new_block(4, 0) == 2
    p._take_hits([{0: 0}])  # a hit takes 0 back out of the middle of the queue
    assert list(p.evictable) == [1] and p.blocks[0] == [1, 4]


def test_a_key_cached_twice_keeps_the_first_block_unless_duplicates_are_kept():
    p = Pool(3)
    for _ in range(3):
        p._new_block(4, 0)
    p._cache(0, 0, "k")
    p._cache(1, 0, "k")
    assert p.by_hash[(0, "k")] == [0] and 1 not in p.hash_of
    p._cache(2, 0, "k", duplicates=True)
    assert p.by_hash[(0, "k")] == [0, 2]


def test_the_sums_follow_references_and_fills():
    p = Pool(4, groups=2)
    a = p._new_block(3, 0)
    b = p._new_block(4, 1)
    p._add_ref(a)
    # filled 7 = 3 + 4; one block with 2 references; one block in use per group
    assert (p.filled, p.shared, p.group_used, list(p.refs)) == (7, 1, [1, 1], [2, 1, 0, 0])
    p._drop_ref(a)
    p._drop_ref(b)
    assert (p.filled, p.shared, p.group_used, p.blocks_used, p.blocks_free) == (3, 0, [1, 0], 1, 3)
