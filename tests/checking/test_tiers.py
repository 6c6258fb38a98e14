"""The tier model of SPEC §11 (kvbench.model.tiers): states, store skip / evict / refuse,
completion, leases, loads, abort, ledgers, LRU and ARC as vLLM ships them, and the hit rates of
a device LRU over a host tier against a two-level LRU written here independently."""
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.model.tiered import replay_prompts
from kvbench.model.tiers import Tiers, TransferError
from kvbench.traces.tier_ops import TierSpec

BB = 1024  # block bytes


def host(capacity, policy="lru"):
    return Tiers([TierSpec("host", capacity, policy)], block_bytes=BB)


def counts(tiers, i=0):
    led = tiers.ledgers()[i]
    assert led.stored + led.storing + led.free == led.capacity
    entries = tiers.tiers[i].entries.values()  # the counters kept as entries change, recounted
    assert led.storing == sum(e.state == "storing" for e in entries)
    assert led.loading == sum(e.loads > 0 for e in entries)
    return led.stored, led.storing, led.loading, led.free


def test_store_states_and_ledger():
    t = host(4)
    plan = t.store_begin(1, seq=0, tier=0, blocks=[("a", 10), ("b", 11), ("c", 12)])
    assert [k for k, _ in plan.begun] == ["a", "b", "c"] and not plan.skipped
    assert counts(t) == (0, 3, 0, 1)  # 1 = 4 - 3 storing
    assert t.lookup("a") is None  # storing: not loadable
    assert t.leases == {10: 1, 11: 1, 12: 1}
    t.complete(1, ok=True)
    assert counts(t) == (3, 0, 0, 1)
    assert t.lookup("a") == 0 and t.leases == {}
    assert t.ledgers()[0].bytes_down == 3 * BB  # each block once


def test_store_skips_held_blocks():
    t = host(4)
    t.store_begin(1, 0, 0, [("a", 10)])
    plan = t.store_begin(2, 1, 0, [("a", 20), ("b", 21)])  # a storing: skipped, not leased
    assert plan.skipped == ["a"] and [k for k, _ in plan.begun] == ["b"]
    assert t.leases == {10: 1, 21: 1}
    t.complete(1, True)
    t.complete(2, True)
    plan = t.store_begin(3, 1, 0, [("a", 20)])  # stored: skipped
    assert plan.skipped == ["a"] and not plan.begun
    assert counts(t) == (2, 0, 0, 2)


def test_failed_store_leaves_no_trace():
    t = host(2)
    t.store_begin(1, 0, 0, [("a", 10), ("b", 11)])
    t.complete(1, ok=False)
    assert counts(t) == (0, 0, 0, 2)
    assert t.lookup("a") is None and t.leases == {} and t.ledgers()[0].bytes_down == 0
    plan = t.store_begin(2, 0, 0, [("a", 10)])  # stored again from scratch
    assert [k for k, _ in plan.begun] == ["a"]


def test_full_tier_evicts_lru_and_refuses_per_block():
    t = host(3)
    t.store_begin(1, 0, 0, [("a", 1), ("b", 2), ("c", 3)])
    t.complete(1, True)
    # LRU order a, b, c; d evicts a, e evicts b
    plan = t.store_begin(2, 1, 0, [("d", 4), ("e", 5)])
    assert plan.evicted == ["a", "b"]
    assert counts(t) == (1, 2, 0, 0)  # c stored, d and e storing
    # nothing evictable: c is one of this store's own blocks, d and e storing
    plan = t.store_begin(3, 2, 0, [("c", 3), ("f", 6), ("g", 7)])
    assert plan.skipped == ["c"] and plan.refused == ["f", "g"] and not plan.begun
    assert counts(t) == (1, 2, 0, 0)  # refused blocks leave the tier as it was
    t.complete(3, True)  # an empty store completes


def test_load_touch_protects_and_orders():
    t = host(3)
    t.store_begin(1, 0, 0, [("a", 1), ("b", 2), ("c", 3)])
    t.complete(1, True)
    assert t.load_run(["a", "b", "x", "c"]) == [0, 0]  # the run stops at the first miss
    t.load_begin(2, seq=5, blocks=[("a", 0, 20), ("b", 0, 21)])
    assert counts(t) == (3, 0, 2, 0)
    assert t.load_targets == {20: 2, 21: 2}
    # touch [a, b] reversed: LRU order is now c, b, a; a and b are being read: c goes
    plan = t.store_begin(3, 1, 0, [("d", 4)])
    assert plan.evicted == ["c"]
    plan = t.store_begin(4, 1, 0, [("e", 5)])  # a, b loading, d storing: refused
    assert plan.refused == ["e"]
    t.complete(2, True)
    assert counts(t) == (2, 1, 0, 0) and t.load_targets == {}
    assert t.ledgers()[0].bytes_up == 2 * BB
    plan = t.store_begin(5, 1, 0, [("e", 5)])
    assert plan.evicted == ["b"]  # b before a: the first block of a load is the most recent
    assert t.ledgers()[0].hits == 2


def stored_ab(failed_load, policy="lru"):
    """A host of 4 holding a and b stored (``failed_load`` as declared)."""
    t = Tiers([TierSpec("host", 4, policy, failed_load)], block_bytes=BB)
    t.store_begin(1, 0, 0, [("a", 10), ("b", 11)])
    t.complete(1, True)
    return t


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_failed_load_keeps_its_blocks_stored_where_the_tier_keeps_them(policy):
    t = stored_ab("keep", policy)
    t.load_begin(2, seq=5, blocks=[("a", 0, 30), ("b", 0, 31)])
    assert counts(t) == (2, 0, 2, 2)  # 2 = 4 - 2 free
    t.complete(2, ok=False)
    # nothing moved up, the targets no longer written, both loadable again
    assert counts(t) == (2, 0, 0, 2) and t.ledgers()[0].bytes_up == 0 and t.load_targets == {}
    assert t.load_run(["a", "b"]) == [0, 0]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_failed_load_drops_its_blocks_where_the_tier_drops_them(policy):
    t = stored_ab("drop", policy)
    t.load_begin(2, seq=5, blocks=[("a", 0, 30)])
    t.complete(2, ok=False)
    # a gone (3 = 4 - 1 free), b untouched; the failed hit is served no more
    assert counts(t) == (1, 0, 0, 3) and t.load_run(["a", "b"]) == []
    assert t.load_run(["b"]) == [0] and t.ledgers()[0].hits == 1  # the failed load's one
    # stored again from scratch: loadable again
    t.store_begin(3, 0, 0, [("a", 12)])
    t.complete(3, True)
    assert t.load_run(["a", "b"]) == [0, 0] and counts(t) == (2, 0, 0, 2)


def test_a_dropped_block_another_load_reads_goes_when_that_load_ends():
    t = stored_ab("drop")
    t.load_begin(2, seq=5, blocks=[("a", 0, 30), ("b", 0, 31)])
    t.load_begin(3, seq=6, blocks=[("a", 0, 40)])
    t.complete(2, ok=False)
    # a: unreadable, still read by load 3 (held, not evictable, not loadable); b: gone (no reader)
    assert counts(t) == (1, 0, 1, 3) and t.load_run(["a"]) == []
    with pytest.raises(TransferError, match="unreadable"):
        t.load_begin(4, seq=7, blocks=[("a", 0, 50)])
    t.complete(3, ok=True)
    assert counts(t) == (0, 0, 0, 4)  # its last reader gone, a goes too


@pytest.mark.parametrize("rules, unannounced", [((), set()), (("failed_load_drops_unannounced",), {"a"})])
def test_a_dropped_block_stays_unannounced_until_stored_again_only_under_the_rule(rules, unannounced):
    t = Tiers([TierSpec("host", 4, "lru", "drop")], BB, rules)
    t.store_begin(1, 0, 0, [("a", 10), ("b", 11)])
    t.complete(1, True)
    t.load_begin(2, seq=5, blocks=[("a", 0, 30)])
    t.complete(2, ok=False)
    # a dropped either way (1 stored = b, 3 = 4 - 1 free); vLLM's file tier says nothing of it
    assert counts(t) == (1, 0, 0, 3) and t.tiers[0].dropped == unannounced
    t.store_begin(3, 0, 0, [("a", 12)])
    t.complete(3, False)  # a failed store writes nothing: still unannounced
    assert t.tiers[0].dropped == unannounced
    t.store_begin(4, 0, 0, [("a", 12)])
    assert t.tiers[0].dropped == unannounced  # storing: announced at its completion
    t.complete(4, True)
    assert t.tiers[0].dropped == set() and counts(t) == (2, 0, 0, 2)


def test_an_aborted_load_drops_nothing():
    t = stored_ab("drop")
    t.load_begin(2, seq=5, blocks=[("a", 0, 30)])
    t.abort(5)  # a cancel is no failure: the tier read nothing wrong
    assert counts(t) == (2, 0, 0, 2) and t.load_run(["a", "b"]) == [0, 0]


def test_abort_cancels_loads_not_stores():
    t = host(4)
    t.store_begin(1, 0, 0, [("a", 1)])
    t.complete(1, True)
    t.load_begin(2, seq=7, blocks=[("a", 0, 30)])
    t.store_begin(3, 7, 0, [("b", 31)])
    cancelled = t.abort(7)
    assert [(tid, tr.blocks) for tid, tr in cancelled] == [(2, [("a", 0, 30)])]
    assert t.load_targets == {} and t.leases == {31: 1}  # the store keeps its lease
    assert counts(t) == (1, 1, 0, 2) and t.ledgers()[0].bytes_up == 0  # nothing moved up
    t.complete(3, True)
    assert t.leases == {} and counts(t) == (2, 0, 0, 2)
    with pytest.raises(TransferError, match="already completed"):
        t.complete(2, True)  # the cancelled load


def test_ill_formed_completions():
    t = host(2)
    with pytest.raises(TransferError, match="never began"):
        t.complete(9, True)
    t.store_begin(1, 0, 0, [("a", 1)])
    with pytest.raises(TransferError, match="already used"):
        t.store_begin(1, 0, 0, [("b", 2)])
    t.complete(1, True)
    with pytest.raises(TransferError, match="already completed"):
        t.complete(1, False)


def test_leases_count_every_store_of_a_block():
    t = Tiers([TierSpec("host", 2), TierSpec("disk", 2)], BB)
    t.store_begin(1, 0, 0, [("a", 5)])
    t.store_begin(2, 0, 1, [("a", 5)])  # the same device block to both tiers
    assert t.leases == {5: 2}
    t.complete(1, True)
    assert t.leases == {5: 1}
    t.complete(2, False)
    assert t.leases == {} and t.lookup("a") == 0  # host holds it, disk does not


def test_nearest_tier_first():
    t = Tiers([TierSpec("host", 2), TierSpec("disk", 4)], BB)
    t.store_begin(1, 0, 1, [("a", 1), ("b", 2)])
    t.store_begin(2, 0, 0, [("b", 2)])
    t.complete(1, True)
    t.complete(2, True)
    assert t.load_run(["a", "b"]) == [1, 0]  # a only on disk, b on host and disk: host


def test_arc_as_vllm():
    t = host(2, "arc")
    arc = t.tiers[0].policy
    t.store_begin(1, 0, 0, [("a", 1), ("b", 2)])
    arc.touch(["a"])  # a storing: stays in T1, at its recent end
    assert list(arc.t1) == ["b", "a"] and not arc.t2
    t.complete(1, True)
    t.load_begin(2, 0, [("a", 0, 9)])
    t.complete(2, True)
    assert list(arc.t1) == ["b"] and list(arc.t2) == ["a"]  # a stored and touched: T2
    # |T1| = 1 >= int(target 0): T1's least recent (b) goes, remembered in B1
    plan = t.store_begin(3, 0, 0, [("c", 3)])
    assert plan.evicted == ["b"] and list(arc.b1) == ["b"]
    t.complete(3, True)
    arc.touch(["b"])  # a ghost hit in B1: target += max(1, |B2| / |B1|) = max(1, 0 / 1) = 1
    assert arc.target == 1
    # |T1| = 1 (c) >= int(1): c goes again from T1
    plan = t.store_begin(4, 0, 0, [("d", 4)])
    assert plan.evicted == ["c"] and list(arc.b1) == ["b", "c"]
    t.complete(4, True)
    arc.touch(["c"])  # target = min(1 + max(1, 0 / 2), capacity 2) = 2
    assert arc.target == 2
    # |T1| = 1 (d) < int(2): T2's least recent (a) goes, to B2
    plan = t.store_begin(5, 0, 0, [("e", 5)])
    assert plan.evicted == ["a"] and list(arc.b2) == ["a"]
    t.complete(5, False)  # a failed store: no ghost
    assert "e" not in arc.b1 and "e" not in arc.t1


def test_arc_falls_back_to_t1_below_target():
    """As vLLM 0.33 ships it (vllm/v1/kv_offload/cpu/policies/arc.py, evict: T1 while it holds
    the target, else T2, else T1 after all): below the T1 target with no T2 block, T1's goes."""
    t = host(1, "arc")
    arc = t.tiers[0].policy
    t.store_begin(1, 0, 0, [("a", 1)])
    t.complete(1, True)
    arc.target = 2.0  # beyond |T1| = 1, and T2 is empty
    plan = t.store_begin(2, 0, 0, [("b", 2)])
    assert plan.evicted == ["a"] and plan.refused == [] and list(arc.b1) == ["a"]


def vllm_rules(capacity, policy="lru"):
    """A host tier under the rules vLLM's adapter declares (impls/engines/vllm_offload.py)."""
    return Tiers([TierSpec("host", capacity, policy)], BB, ("whole_store_refused", "request_recency"))


def test_an_unknown_tier_rule_is_refused():
    with pytest.raises(ValueError, match="unknown tier rule 'fifo'"):
        Tiers([TierSpec("host", 2)], BB, ("fifo",))


def test_whole_store_refused_begins_nothing_without_room_for_all():
    t = vllm_rules(2)
    plan = t.store_begin(1, 0, 0, [("a", 1), ("b", 2), ("c", 3)], [0, 1, 2])
    assert plan.begun == [] and plan.refused == ["a", "b", "c"] and not plan.evicted
    assert counts(t) == (0, 0, 0, 2) and t.leases == {}  # nothing changed: 2 still free
    t.complete(1, True)
    t.store_begin(2, 1, 0, [("a", 1)], [0])
    t.complete(2, True)
    plan = t.store_begin(3, 2, 0, [("b", 2), ("c", 3)], [0, 1])  # needs 2 - 1 free = 1 victim: a
    assert plan.evicted == ["a"] and [k for k, _ in plan.begun] == ["b", "c"]


@pytest.mark.parametrize("rules, evicted, stored", [
    ((), [], ["a"]),  # the store's own "a" is kept: "b" finds no room and is refused
    (("store_evicts_skipped",), ["a"], ["b"]),  # LMCache's allocate: "a" goes for "b"
])
def test_a_store_evicts_its_own_skipped_blocks_only_under_the_rule(rules, evicted, stored):
    t = Tiers([TierSpec("host", 1)], BB, rules)
    t.store_begin(1, 0, 0, [("a", 1)])
    t.complete(1, True)
    plan = t.store_begin(2, 1, 0, [("a", 2), ("b", 3)])  # "a" stored there already: skipped
    assert plan.skipped == ["a"] and plan.evicted == evicted
    assert plan.refused == ([] if evicted else ["b"])
    t.complete(2, True)
    assert sorted(t.stored_keys(0)) == stored
    assert counts(t) == (1, 0, 0, 0)  # 1 = capacity: one stored either way, 0 free


@pytest.mark.parametrize("rules, begun, skipped, evicted, ledger", [
    # SPEC: "b", held at the begin, is skipped though "a" evicts it: 1 stored (c) + 1 storing (a)
    (("store_evicts_skipped",), ["a"], ["b"], ["b"], (1, 1, 0, 0)),
    # LMCache: "b" not held when the store reaches it, stored again: 0 stored + 2 storing (a, b)
    (("store_evicts_skipped", "store_skips_when_reached"), ["a", "b"], [], ["b", "c"], (0, 2, 0, 0)),
])
def test_a_store_skips_what_its_tier_held_at_its_begin_or_under_the_rule_when_it_reaches_it(
        rules, begun, skipped, evicted, ledger):
    t = Tiers([TierSpec("host", 2)], BB, rules)
    t.store_begin(1, 0, 0, [("b", 1), ("c", 2)])
    t.complete(1, True)  # b, then c: b the least recent
    plan = t.store_begin(2, 1, 0, [("a", 3), ("b", 4)])  # no room for a: b goes
    assert [k for k, _ in plan.begun] == begun and plan.skipped == skipped
    assert plan.evicted == evicted and counts(t) == ledger


@pytest.mark.parametrize("rules, victim", [
    ((), "a"),  # SPEC: a store's blocks take their place at the begin: a (begun first) goes
    (("store_ranked_at_completion",), "b"),  # LMCache's put at the completion: b completed first
])
def test_a_stored_blocks_recency_dates_from_its_begin_or_under_the_rule_its_completion(rules, victim):
    t = Tiers([TierSpec("host", 2)], BB, rules)
    t.store_begin(1, 0, 0, [("a", 10)])
    t.store_begin(2, 1, 0, [("b", 11)])
    t.complete(2, True)
    t.complete(1, True)
    assert t.tiers[0].policy.order_of() == (["a", "b"] if not rules else ["b", "a"])
    plan = t.store_begin(3, 2, 0, [("c", 12)])  # full: the least recent goes
    assert plan.evicted == [victim]
    assert counts(t) == (1, 1, 0, 0)  # 2 = capacity: 1 stored + 1 storing


def test_request_recency_ranks_and_finish():
    t = vllm_rules(3)
    lru = t.tiers[0].policy
    t.store_begin(1, 0, 0, [("a", 1), ("b", 2)], [0, 1])
    t.complete(1, True)
    # ranks (request, -position): the request's rank 1, so a (1, 0) is more recent than b (1, -1)
    assert lru.order_of() == ["b", "a"]
    t.store_begin(2, 1, 0, [("c", 3)], [5])  # request 1 draws rank 2: c (2, -5) is the most recent
    t.complete(2, True)
    assert lru.order_of() == ["b", "a", "c"]
    t.finish(0)  # each key request 0 accessed gets a new rank, last position first: b 3, a 4
    assert lru.order_of() == ["c", "b", "a"]
    t.load_begin(3, 2, [("c", 0, 9)], [0])  # request 2 (rank 5) reads c: c (5, 0)
    t.complete(3, True)
    assert lru.order_of() == ["b", "a", "c"]  # (3, 0) < (4, 0) < (5, 0)
    # a store offering a block already stored is an access too: b rises to request 3's rank
    t.store_begin(4, 3, 0, [("b", 2)], [0])
    assert lru.order_of() == ["a", "c", "b"]


def test_request_recency_arc_promotes_at_finish():
    t = vllm_rules(3, "arc")
    arc = t.tiers[0].policy
    t.store_begin(1, 0, 0, [("a", 1), ("b", 2)], [0, 1])
    t.complete(1, True)
    t.finish(0)  # stored by it, no reuse: recency only, tail first, so a ends the most recent
    assert list(arc.t1) == ["b", "a"] and not arc.t2
    t.load_begin(2, 1, [("b", 0, 9)], [0])
    t.complete(2, True)
    assert list(arc.t1) == ["b", "a"]  # a load alone moves nothing
    t.finish(1)  # b reused by request 1: to T2
    assert list(arc.t1) == ["a"] and list(arc.t2) == ["b"]


def test_arc_store_of_a_ghost_adapts_the_target():
    t = host(1, "arc")
    arc = t.tiers[0].policy
    t.store_begin(1, 0, 0, [("a", 1)])
    t.complete(1, True)
    t.store_begin(2, 0, 0, [("b", 2)])  # a evicted to B1
    t.complete(2, True)
    assert list(arc.b1) == ["a"]
    t.store_begin(3, 0, 0, [("a", 1)])  # a ghost hit in B1: target += max(1, 0 / 1) = 1
    assert arc.target == 1 and "a" not in arc.b1


def reference_two_level(prompts, c0, c1):
    """A plain device LRU of c0 blocks over a host LRU of c1, written apart from the model."""
    dev, hst = [], []  # least recent first
    out = {"device": 0, "host": 0, "computed": 0}
    for keys in prompts:
        d = 0
        while d < len(keys) and keys[d] in dev:
            d += 1
        h = d
        while h < len(keys) and keys[h] in hst:
            h += 1
        out["device"] += d
        out["host"] += h - d
        out["computed"] += len(keys) - h
        for k in reversed(keys[d:h]):  # a host hit makes the first block the most recent
            hst.remove(k)
            hst.append(k)
        for k in keys:
            if k in dev:
                dev.remove(k)
            dev.append(k)
        while len(dev) > c0:
            victim = next(k for k in dev if k not in keys)
            dev.remove(victim)
            if victim in hst:
                continue  # already stored: skipped, its place kept
            if len(hst) == c1:
                if c1 == 0:
                    continue
                hst.pop(0)
            hst.append(victim)
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(0, 8),
       st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), max_size=30))
def test_two_level_lru_hit_rates(c0, c1, raw):
    prompts = [list(dict.fromkeys(p))[:c0] for p in raw]  # distinct keys, at most c0 of them
    got = replay_prompts(prompts, c0, host(c1))
    assert got == reference_two_level(prompts, c0, c1)


def test_two_level_by_hand():
    # device 2 blocks over host 2: [a b] computes 2; [c] computes 1, evicts a to host;
    # [a b]: b? device holds b, c: the prefix starts with a, not on the device; a on host (1),
    # b on the device but after the miss: the run from host stops at b (not stored), computed 1
    prompts = [["a", "b"], ["c"], ["a", "b"]]
    got = replay_prompts(prompts, 2, host(2))
    assert got == {"device": 0, "host": 1, "computed": 4}  # 4 = 2 + 1 + 1


def test_a_lookups_pins_protect_until_its_load_ends_or_its_abort():
    t = host(2)
    t.store_begin(1, 0, 0, [("a", 1), ("b", 2)])
    t.complete(1, True)
    assert t.pin(5, ["a", "b", "c"]) == [("a", 0), ("b", 0)]  # the run stored: c is nowhere
    assert counts(t) == (2, 0, 2, 0)  # pinned entries count as read
    plan = t.store_begin(2, 1, 0, [("d", 3)])  # full, both pinned: refused, nothing evicted
    assert plan.refused == ["d"] and not plan.evicted
    t.complete(2, True)
    t.load_begin(3, 5, [("a", 0, 10)])  # the load takes over both pins, reads a once more
    assert t.pins == {} and t.tiers[0].entries["a"].loads == 2
    t.complete(3, False)  # failed: its read and both pins released, each once
    assert counts(t) == (2, 0, 0, 0)
    t.pin(6, ["b"])
    assert t.abort(6) == [] and counts(t) == (2, 0, 0, 0)  # cancelled before its load
