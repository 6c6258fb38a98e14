"""request_recency's victim search (kvbench.model.tier_policies.RequestLRUPolicy) keeps a heap
rather than sorting the tier per search: on random histories of its operations it must give the
victims the sorted order gives, the same keys in the same order, and keep its heap bounded."""
import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.model.tier_policies import RequestLRUPolicy

KEYS = range(8)


def sorted_victims(policy: RequestLRUPolicy, n: int, evictable) -> list | None:
    """The definition: every evictable key of the tier sorted by rank (the sort is stable, so
    equal ranks in the order the keys entered the tier), the first ``n``."""
    found = sorted((k for k in policy.rank if evictable(k)), key=policy.rank.__getitem__)[:n]
    return found if len(found) == n else None


def test_equal_ranks_go_in_arrival_order():
    lru = RequestLRUPolicy(4)
    lru.insert("a", seq=0, position=1)
    lru.insert("b", seq=0, position=1)  # the same request and position: both (1, -1)
    lru.insert("c", seq=1, position=0)  # request 1 draws rank 2: (2, 0)
    assert lru.victims(3, lambda k: True) == ["a", "b", "c"]
    lru.remove("a")
    lru.insert("a", seq=0, position=1)  # back with (1, -1), now after b
    assert lru.victims(2, lambda k: True) == ["b", "a"]
    assert lru.victims(2, lambda k: k != "b") == ["a", "c"]
    assert lru.victims(4, lambda k: True) is None  # 3 held


KEY = st.sampled_from(list(KEYS))
POSITION = st.sampled_from([None, 0, 1, 2, 3])
SEQ = st.integers(0, 3)
# Operations as the tier model calls them: an insert (by a request at a position, or by none;
# of a key absent, else skipped), a removal (of a key held, else skipped), a touch, a request's
# accesses and its finish, a victim search over a drawn evictable set (its victims evicted or
# not), a copy (the pure oracle step deep-copies the model).
OPERATION = st.one_of(
    st.tuples(st.just("insert"), KEY, SEQ, POSITION),
    st.tuples(st.just("remove"), KEY),
    st.tuples(st.just("touch"), st.lists(KEY, max_size=5)),
    st.tuples(st.just("access"), st.lists(st.tuples(KEY, POSITION), max_size=5), SEQ),
    st.tuples(st.just("finish"), st.lists(KEY, max_size=5), SEQ),
    st.tuples(st.just("victims"), st.integers(1, 4), st.frozensets(KEY), st.booleans()),
    st.tuples(st.just("copy")),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPERATION, max_size=60))
def test_heap_victims_equal_the_sorted_order(ops):
    lru = RequestLRUPolicy(8)
    for op in ops:
        if op[0] == "insert" and op[1] not in lru.rank:
            lru.insert(op[1], seq=op[2], position=op[3])
        elif op[0] == "remove" and op[1] in lru.rank:
            lru.remove(op[1])
        elif op[0] == "touch":
            lru.touch(op[1])
        elif op[0] == "access":
            lru.on_request_access(op[1], op[2])
        elif op[0] == "finish":
            lru.on_request_finished(op[1], set(), set(), op[2])
        elif op[0] == "copy":
            lru = copy.deepcopy(lru)
        elif op[0] == "victims":
            _, n, allowed, evict = op
            expected = sorted_victims(lru, n, allowed.__contains__)
            assert lru.victims(n, allowed.__contains__) == expected
            assert lru.victims(n, allowed.__contains__) == expected  # a search changes nothing
            for key in (expected or []) if evict else []:
                lru.evict(key)
        assert len(lru.heap) <= 2 * len(lru.rank) + 32  # stale entries are dropped
        assert lru.victims(len(lru.rank), lambda k: True) == lru.order_of()
