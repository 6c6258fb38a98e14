"""LMCache's CPU storage backend (``LocalCPUBackend``) as the lower tiers of the NumPy pool, under
the checker (impls/engines/lmcache_cpu.py).

LMCache is opt-in (scripts/engine_env.sh lmcache DIR builds it); CI does not
install it, so every test that needs it is skipped there with the reason. Run them from the
repository root with::

    LMCACHE_LOG_LEVEL=ERROR PYTHONPATH=$PWD /work/envs/lmcache/bin/python -m pytest -n 0 tests/engines/test_lmcache_cpu.py
"""
from __future__ import annotations

import pytest
from conftest import make_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tier_properties import histories
from test_vllm_offload import checked

from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.checking.checker import check
from kvbench.contract.registry import entries
from kvbench.traces.format import Free, Header, Prefill, Trace, validate
from kvbench.traces.ops import Abort, Load
from kvbench.traces.tier_ops import Done, Store, TierSpec

SKIP_REASON = "LMCache is not installed (opt-in, not in CI): see docs/tiers-and-lifecycles.md"
B = 4
TIER_WORKLOADS = [p for p in committed_workloads() if load_traces([p])[0].header.tiers]


@pytest.fixture(scope="module")
def lmcache():
    return pytest.importorskip("lmcache", reason=SKIP_REASON)


def adapter(num_blocks=8):
    from impls.engines.lmcache_cpu import LMCacheCPU
    return LMCacheCPU(make_config(block_size=B, num_blocks=num_blocks, prefix_caching=True))


def test_registered_as_an_engine():
    entry = entries()["lmcache-cpu"]
    assert "engine" in entry.tags and entry.target == "impls.engines.lmcache_cpu:LMCacheCPU"


@pytest.mark.parametrize("path", TIER_WORKLOADS, ids=lambda p: p.stem)
def test_passes_the_tier_workloads(lmcache, path):
    from impls.engines.lmcache_cpu import LMCacheCPU
    trace = load_traces([path])[0]
    v = checked(trace, LMCacheCPU(config_for(trace)), gather="all")
    if any(op.kind == "preempt" and op.mode == "swap" for op in trace.ops):  # SPEC §13 over §11
        assert v.valid is None and "does not preempt by swap" in v.not_applicable, v.not_applicable
        return
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(trace.ops)
    assert v.events > 0  # its KV events checked at every operation: the device's and LMCache's
    assert "block structures" not in v.skipped  # its leases counted (SPEC §10 during §11)
    assert "GPU connector" in v.skipped["tier copies"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(4, 6).flatmap(lambda n: st.tuples(st.just(n), histories(n))),
       host=st.integers(0, 3))
def test_passes_random_histories(lmcache, case, host):
    blocks, ops = case
    tiers = (TierSpec("host", host), TierSpec("disk", 4))
    trace = validate(Trace(Header("random", tiers=tiers), ops, name="random"))
    v = checked(trace, adapter(blocks), gather="all")
    assert v.valid is True, (v.divergence, v.error)


def test_a_failed_store_leaves_no_trace_in_lmcache(lmcache):
    # 2 full blocks stored to a host tier of 4 pages; the store fails: LMCache's hot cache finds
    # neither, and both pages are back in its allocator (4 free of 4).
    ops = [Prefill(0, 0, "a", 2 * B, (1, 2)), Store(1, 1, 0, "host"), Done(2, 1, False)]
    trace = validate(Trace(Header("failed", tiers=(TierSpec("host", 4),)), ops, name="failed"))
    backend = adapter()
    try:
        assert check(trace, backend).valid is True
        tier = backend._tiers[0]
        assert len(tier.backend.hot_cache) == 0 and len(tier.allocator.free_blocks) == 4
        assert not any(tier.loadable(k, 1) for k in ((0, 1), (0, 2)))
    finally:
        backend.close()


def test_a_store_evicts_its_own_stored_block_as_lmcache_declares(lmcache):
    # Found by test_passes_random_histories, cut down by hand. A host tier of 1 page holds block
    # key 1; sequence 1's store offers keys 1 and 2: 1 is skipped (stored), and LMCache's
    # allocate for 2 evicts 1 by its LRU, the store's own block or not. The adapter declares it
    # (store_evicts_skipped): after the store, 1 stored + 0 storing + 0 free = 1 page, block 2.
    ops = [Prefill(0, 0, "t", B, (1,)), Store(1, 0, 0, "host"), Done(2, 0, True),
           Free(3, 0), Prefill(4, 1, "t", 2 * B, (1, 2)), Store(5, 1, 1, "host"),
           Done(6, 1, True)]
    trace = validate(Trace(Header("own-evicted", tiers=(TierSpec("host", 1),)), ops,
                           name="own-evicted"))
    backend = adapter()
    try:
        assert "store_evicts_skipped" in backend.capabilities.tier_rules
        v = check(trace, backend, gather="all")
        assert v.valid is True, str(v.divergence)
        assert v.ops == len(ops)
    finally:
        backend.close()


def test_a_store_checks_each_block_when_it_reaches_it_as_lmcache_declares(lmcache):
    # Found by test_passes_random_histories. Host tier of 2 pages: sequence 0 (salt x) stores its
    # blocks at positions 1, 2 (keys x.2, x.3; x.2 the least recent). Sequence 1's store offers
    # x.1, x.2: LMCache's allocate for x.1 evicts x.2, and x.2, not held when the store reaches
    # it (contains, then allocate, chunk by chunk: cache_engine.py:696-706, storage_manager.py:
    # 89-92), is allocated again, evicting x.3: 0 stored + 2 storing. As declared
    # (store_skips_when_reached) the run passes; held to SPEC's skip at the store's begin, x.2 is
    # skipped: 1 stored (x.3) + 1 storing (x.1), and the ledger differs at the store (step 5).
    import dataclasses
    ops = [Prefill(0, 0, "t", 3 * B, (1, 2, 3), "x"), Store(1, 0, 0, "host", (1, 2)), Done(2, 0, True),
           Free(3, 0), Prefill(4, 1, "t", 2 * B, (1, 2), "x"), Store(5, 1, 1, "host"),
           Done(6, 1, True), Free(7, 1)]
    trace = validate(Trace(Header("restored", tiers=(TierSpec("host", 2), TierSpec("disk", 4))), ops,
                           name="restored"))
    verdicts = []
    for declared in (True, False):
        backend = adapter(4)
        if not declared:
            rules = tuple(r for r in backend.capabilities.tier_rules if r != "store_skips_when_reached")
            backend.capabilities = dataclasses.replace(backend.capabilities, tier_rules=rules)
        try:
            verdicts.append(check(trace, backend, gather="all"))
        finally:
            backend.close()
    ok, held = verdicts
    assert ok.valid is True and ok.ops == len(ops), str(ok.divergence)
    d = held.divergence
    assert held.valid is False and d.index == 5, str(d)
    assert (d.quantity, d.expected, d.actual) == ("tier host stored", 1, 0), str(d)


def test_a_closed_tier_frees_nothing_when_collected(lmcache):
    # Found by test_passes_random_histories run long: a hang. LMCache 0.5.6's paged allocator
    # keeps its pages valid after the backend's close (MemoryAllocatorInterface.close does
    # nothing, memory_management.py:1284-1289); a collected page frees itself (MemoryObj.__del__,
    # :700-713), and the free takes LMCache's shared observability lock (update_local_cache_usage
    # is @thread_safe, observability.py:518; a threading.Lock, utils.py:715), so a collection
    # inside a @thread_safe call waited on itself. Here a thread collects a closed adapter while
    # this one holds the lock: it must end without the lock (before the fix it waited for it).
    import gc
    import threading
    import weakref

    from lmcache.utils import _shared_observability_lock
    ops = [Prefill(0, 0, "a", 2 * B, (1, 2)), Store(1, 1, 0, "host"), Done(2, 1, True)]
    backend = adapter()
    assert check(_tier_trace(*ops), backend, gather="all").valid is True  # its events asked too
    allocator = weakref.ref(backend._tiers[0].allocator)
    backend.close()
    gc.disable()  # collected by the thread below, not before
    try:
        del backend
        collector = threading.Thread(target=gc.collect, daemon=True)
        with _shared_observability_lock:
            collector.start()
            collector.join(10)
            ended = not collector.is_alive()
        collector.join()
    finally:
        gc.enable()
    assert allocator() is None  # the tier was collected: the check is not vacuous
    assert ended, "a collected page of a closed tier waited for LMCache's observability lock"


# --- planted upstream bugs (impls/engines/faults_lmcache.py) -------------------

def _tier_trace(*ops):
    return validate(Trace(Header("lookups", tiers=(TierSpec("host", 4),)), list(ops), name="lookups"))


def _stored_then_evicted(salt):
    """Device of 2 blocks, host tier of 4 pages: sequence 0's 2 blocks (keys 1, 2) stored to the
    host, then pushed out of the device by sequence 1's 2 blocks (keys 3, 4), both freed: the
    host holds 1 and 2, the device neither."""
    return [Prefill(0, 0, "a", 2 * B, (1, 2), salt=salt), Store(1, 1, 0, "host"), Done(2, 1, True),
            Free(3, 0), Prefill(4, 1, "a", 2 * B, (3, 4)), Free(5, 1)]


def _caught(ops, fault, step: int):
    """The adapter passes; ``fault`` FAILs at ``step``, in the host tier's ledger."""
    from impls.engines import faults_lmcache
    trace = _tier_trace(*ops)
    good = adapter(2)
    try:
        v = check(trace, good, gather="all")
        assert v.valid is True and v.ops == len(ops), str(v.divergence)
        assert good.tier_ledgers()[0]["loading"] == 0  # every pin released by the end
    finally:
        good.close()
    bad = getattr(faults_lmcache, fault)(make_config(block_size=B, num_blocks=2, prefix_caching=True))
    try:
        w = check(trace, bad)
        assert w.valid is False and w.divergence is not None, w.status
        assert w.divergence.index == step, str(w.divergence)
        return w.divergence
    finally:
        bad.close()


def test_issue_3770_a_salted_lookups_pins_released_without_the_salt_stay(lmcache):
    # Sequence 2 loads tenant a's salted blocks 1, 2 from the host (device hit 0: evicted), so
    # its lookup pins 2 entries; at the load's completion (step 7) the release by salt-less keys
    # finds neither entry: 2 stay pinned where SPEC §11 has 0 loading.
    ops = _stored_then_evicted("s") + [Load(6, 2, "a", 2 * B, (1, 2), salt="s", id=2),
                                       Done(7, 2, True), Free(8, 2)]
    d = _caught(ops, "LmcacheSaltlessUnpin", 7)
    assert (d.quantity, d.expected, d.actual) == ("tier host loading", 0, 2), str(d)


def test_issue_3770_unsalted_lookups_are_released_either_way(lmcache):
    # Without a salt the key with and without it is one key: the planted release finds it, and
    # the same trace passes (the bug needs a salt to show, as upstream's multi-tenant report).
    from impls.engines.faults_lmcache import LmcacheSaltlessUnpin
    ops = _stored_then_evicted(None) + [Load(6, 2, "a", 2 * B, (1, 2), id=2),
                                        Done(7, 2, True), Free(8, 2)]
    bad = LmcacheSaltlessUnpin(make_config(block_size=B, num_blocks=2, prefix_caching=True))
    try:
        v = check(_tier_trace(*ops), bad)
        assert v.valid is True, str(v.divergence)
    finally:
        bad.close()


def test_sglang_40360_an_abort_between_lookup_and_load_leaks_the_pins(lmcache):
    # Sequence 2's load looks up and pins blocks 1, 2 (step 6) and is aborted before it
    # completes (step 7): the abort's cleanup must release both (loading 0); without it they
    # stay pinned, 2 where SPEC §11 has 0.
    ops = _stored_then_evicted("s") + [Load(6, 2, "a", 2 * B, (1, 2), salt="s", id=2),
                                       Abort(7, 2)]
    d = _caught(ops, "LmcacheAbortLeaks", 7)
    assert (d.quantity, d.expected, d.actual) == ("tier host loading", 0, 2), str(d)


def test_pr_4520_a_load_refused_for_room_then_retried_counts_its_hit_once(lmcache):
    # Sequence 3 holds both device blocks, so sequence 2's load of blocks 1, 2 (in the host) is
    # refused for room at step 7; its retry, once 3 is freed, loads both: host hits 2 in all.
    # Accounted at the lookup, the refused load already counts 2 (hits expected 0, got 2) and
    # the retry 2 more.
    ops = _stored_then_evicted("s") + [Prefill(6, 3, "b", 2 * B, (5, 6)),
                                       Load(7, 2, "a", 2 * B, (1, 2), salt="s", id=2),
                                       Free(8, 3),
                                       Load(9, 4, "a", 2 * B, (1, 2), salt="s", id=3),
                                       Done(10, 3, True), Free(11, 4)]
    d = _caught(ops, "LmcacheHitAtLookup", 7)
    assert (d.quantity, d.expected, d.actual) == ("tier host hits", 0, 2), str(d)


# --- LMCache's multi-process L1 controller (the MP server's StorageManager) on a CPU -------------

def _mp_server_with_two_chunks(salt: str):
    """The MP server's context (StorageManager over one CPU L1Manager, token hasher, sessions)
    and its LookupModule, as lmcache/v1/multiprocess/server.py builds them, with chunk size 4
    and one 8-token prompt of ``salt`` stored: 8 // 4 = 2 chunks."""
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ipc_key_to_object_keys
    from lmcache.v1.distributed.config import (EvictionConfig, L1ManagerConfig,
                                               L1MemoryManagerConfig, StorageManagerConfig)
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.engine_context import MPCacheServerContext
    from lmcache.v1.multiprocess.modules.lookup import LookupModule
    memory = L1MemoryManagerConfig(size_in_bytes=1 << 20, use_lazy=False, shm_name="")
    ctx = MPCacheServerContext(StorageManagerConfig(L1ManagerConfig(memory), EvictionConfig("LRU")),
                               chunk_size=4)
    layout = MemoryLayoutDesc([torch.Size([2, 4, 8])], [torch.float32])
    ctx.layout_desc_registry.register("m", 1, layout)

    def key(request, salt=salt, worker=None):
        return IPCCacheServerKey("m", 1, worker, tuple(range(8)), 0, 8, request, cache_salt=salt,
                                 num_kv_readers=1)

    writer = key("writer", worker=0)
    chunks = ctx.token_hasher.compute_chunk_hashes(list(writer.token_ids), end=8)
    objects = ipc_key_to_object_keys(writer, chunks, [0])[0]
    assert len(ctx.storage_manager.reserve_write(objects, layout)) == 2
    ctx.storage_manager.finish_write(objects)
    return ctx, LookupModule(ctx), key, objects


@pytest.mark.parametrize("released_with", ["its salt", "no salt (issue 3770)"])
def test_the_mp_l1_controller_releases_a_salted_lookups_locks_by_its_salt_only(lmcache, released_with):
    # The MP server runs on a CPU. Tenant "alice"'s lookup read-locks both stored chunks (none
    # evictable); free_lookup_locks with her salt releases both. Issue 3770's connector called it
    # without cache_salt: the server builds ObjectKeys of salt "" that name no entry, and both
    # chunks stay locked (not evictable) until the read lock's TTL (300 s by default).
    ctx, lookup, key, objects = _mp_server_with_two_chunks("alice")
    try:
        lookup.lookup(key("r1"), 1)
        assert lookup.wait_prefetch_status("r1", 30.0) == 2  # 8 // 4 chunks hit
        l1 = ctx.storage_manager._l1_manager
        assert [l1.is_key_evictable(o) for o in objects] == [False, False]
        lookup.free_lookup_locks(key("r1", salt="alice" if released_with == "its salt" else ""), 1)
        stays = released_with != "its salt"
        assert [l1.is_key_evictable(o) for o in objects] == [not stays, not stays]
        lookup.end_session("r1")
    finally:
        ctx.close()


# --- KV events (SPEC §14): LMCache's controller messages for its tiers ---------------------------

def _events_verdict(name, tier_rules=None, rule_params=None):
    """The adapter on the committed workload ``name``; held to ``tier_rules`` and
    ``rule_params`` instead of those it declares where given."""
    import dataclasses

    from impls.engines.lmcache_cpu import LMCacheCPU
    trace = load_traces([p for p in TIER_WORKLOADS if p.stem == name])[0]
    backend = LMCacheCPU(config_for(trace))
    caps = backend.capabilities
    backend.capabilities = dataclasses.replace(
        caps, tier_rules=caps.tier_rules if tier_rules is None else tier_rules,
        rule_params=caps.rule_params if rule_params is None else rule_params)
    try:
        v = check(trace, backend)
    finally:
        backend.close()
    assert "events" not in v.skipped  # checked after every operation
    return v


def test_lmcache_ranks_a_stored_block_at_its_put_as_declared(lmcache):
    # tier-races, host of 8: r0's 3 blocks stored (1 evicted at r4's store), r3's 3 stored (done
    # at step 24); r4's 3 begin at step 27 and complete at 33; the load at step 31 touches r3.
    # LMCache ranks r4 at its put (submit_put_task at 33, after the touch: local_cpu_backend.py
    # :168), as declared (store_ranked_at_completion). Held to a rank at the store's begin (27,
    # before the touch), the store of r6's 3 at step 44 evicts r0.1, r0.2 and then r4.0 in the
    # model, r3.2 in LMCache: the ledger's counts agree, the events name the victims.
    from impls.engines.lmcache_cpu import LMCacheCPU
    assert _events_verdict("tier-races").valid is True
    assert "store_ranked_at_completion" in LMCacheCPU.capabilities.tier_rules
    d = _events_verdict("tier-races", tier_rules=("store_evicts_skipped",)).divergence
    assert d.index == 44 and d.quantity == "residency of group 0, tier 1", str(d)
    assert d.expected["removed"] == ["r0.1", "r0.2", "r4.0"], str(d)
    assert d.actual["removed"] == ["r0.1", "r0.2", "r3.2"], str(d)


def test_lmcache_events_name_a_salted_entry_without_its_salt_as_declared(lmcache):
    # tier-turns' first store (tenant a, salt "a", 2 blocks) completes at step 5: LMCache's ADMIT
    # messages name each entry by chunk_hash alone (local_cpu_backend.py:174-177). Declared
    # (tier_event_keys "unsalted"), the checker counts copies per salt-less key and the run
    # passes (test_passes_the_tier_workloads); held to salted keys, the messages' keys are not the salted entries'.
    d = _events_verdict("tier-turns", rule_params={}).divergence
    assert d.index == 5 and d.quantity == "residency of group 0, tier 1", str(d)
    assert len(d.expected["stored"]) == len(d.actual["stored"]) == 2, str(d)
    assert all("salt" in repr(k) for k in d.expected["stored"]), str(d)
    assert not any("salt" in repr(k) for k in d.actual["stored"]), str(d)


def test_lmcaches_controller_keeps_a_set_and_forgets_a_prefix_one_tenant_still_holds(lmcache):
    # Host of 4 pages. Tenants s and t each store 2 blocks of hashes 1, 2 (steps 0-5): 2 copies of
    # each, as LMCache's 4 ADMIT messages say; tenant u's store of 3, 4 (step 8) evicts s's two
    # (LRU), 1 copy of 1 and 2 left, t's. The messages pass the checker's count per key; LMCache's
    # own controller index (WorkerNode.handle_batched_kv_operations, cache_controller/utils.py:
    # 118-124: a set per location, add at admit, discard at evict) fed them holds neither 1 nor 2:
    # an LMCache bug, reported in docs/upstream-reports.md.
    import time

    from lmcache.v1.cache_controller.utils import WorkerNode

    from impls.engines.lmcache_cpu import LMCacheCPU, _LMCacheTier
    node = WorkerNode(0, "", 0, None, None, time.time(), time.time())

    class Controlled(_LMCacheTier):
        def events(self, tier):
            out = super().events(tier)
            worker = self.backend.batched_msg_sender.lmcache_worker
            if not getattr(worker, "teed", False):  # the controller's end sees each message too
                worker.put_msg = lambda m: (self.messages.append(m), node.handle_batched_kv_operations(m))
                worker.teed = True
            return out

    ops = [Prefill(0, 0, "s", 2 * B, (1, 2), salt="s"), Store(1, 1, 0, "host"), Done(2, 1, True),
           Prefill(3, 1, "t", 2 * B, (1, 2), salt="t"), Store(4, 2, 1, "host"), Done(5, 2, True),
           Prefill(6, 2, "u", 2 * B, (3, 4)), Store(7, 3, 2, "host"), Done(8, 3, True)]
    trace = _tier_trace(*ops)
    backend = type("ControlledLMCache", (LMCacheCPU,), {"tier_class": Controlled})(
        make_config(block_size=B, num_blocks=8, prefix_caching=True))
    try:
        v = check(trace, backend)
        assert v.valid is True and v.ops == len(ops), str(v.divergence)
        tier = backend._tiers[0]
        held = sorted(tier.unhashed[k.chunk_hash][1] for k in tier.backend.hot_cache)
        assert held == [1, 2, 3, 4]  # t's copies of 1 and 2, u's 3 and 4
        (index,) = node.kv_store.values()
        assert sorted(tier.unhashed[h][1] for h in index) == [3, 4]  # 1 and 2 forgotten
    finally:
        backend.close()
