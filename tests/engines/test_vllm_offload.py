"""vLLM's ``CPUOffloadingManager`` as the lower tiers of the NumPy pool, under the checker
(impls/engines/vllm_offload.py).

vLLM is opt-in (docs/engines.md's recipe builds /work/vllm-env); CI does not install it, so every test
that needs it is skipped there with the reason. Run them from the repository root with::

    PYTHONPATH=$PWD /work/vllm-env/bin/python -m pytest tests/engines/test_vllm_offload.py

The adapter declares the rules where vLLM differs from SPEC §11 and §14 (``tier_rules``); each has a
small trace here on which vLLM passes as declared and diverges, at the step named, when held to
SPEC's rule instead: evidence that the declaration is what vLLM does, and that the checker holds
vLLM to it.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tier_properties import histories
from test_vllm_kvmanager import NO_ENGINES

from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.checking.checker import check
from kvbench.contract.protocol import Backend
from kvbench.contract.registry import entries
from kvbench.traces.format import Free, Header, Prefill, Trace, validate
from kvbench.traces.tier_ops import Done, Load, Store, TierSpec

SKIP_REASON = "vLLM is not installed (opt-in, not in CI): see docs/engines.md for its recipe"
B = 4
ROOT = Path(__file__).resolve().parents[2]
TIER_WORKLOADS = [p for p in committed_workloads() if load_traces([p])[0].header.tiers]


@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm", reason=SKIP_REASON)


def offload(num_blocks=8, rules=None, block_size=B, events=True):
    """The adapter; ``rules``: the tier rules it is held to instead of those it declares;
    ``events`` False: its KV events unread (the checker holds its ledgers alone)."""
    from impls.engines.vllm_offload import VllmOffload
    cls = VllmOffload if events else type("VllmOffloadQuiet", (VllmOffload,), {"events": Backend.events})
    backend = cls(make_config(block_size=block_size, num_blocks=num_blocks,
                                      prefix_caching=True))
    if rules is not None:
        backend.capabilities = dataclasses.replace(  # its file tier drops failed loads still
            backend.capabilities, tier_rules=(*rules, "drops_failed_loads"))
    return backend


def with_policy(trace: Trace, policy: str) -> Trace:
    tiers = tuple(dataclasses.replace(t, policy=policy) for t in trace.header.tiers)
    return Trace(dataclasses.replace(trace.header, tiers=tiers), trace.ops, name=trace.name)


def checked(trace, backend, **kw):
    try:
        return check(trace, backend, **kw)
    finally:
        backend.close()


def test_registered_as_an_engine():
    entry = entries()["vllm-offload"]
    assert "engine" in entry.tags and entry.target == "impls.engines.vllm_offload:VllmOffload"


def test_without_vllm_it_is_listed_unavailable_with_the_recipe(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's kvbench, not an installed one
    got = subprocess.run([sys.executable, "-c", NO_ENGINES], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, env=env)
    assert got.returncode == 0, got.stderr
    line = next(ln for ln in got.stdout.splitlines() if ln.split()[:1] == ["vllm-offload"])
    assert line.split()[1:3] == ["built-in", "no"], line
    assert "vllm is not installed: its opt-in recipe is in docs/engines.md" in line


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("path", TIER_WORKLOADS, ids=lambda p: p.stem)
def test_passes_the_tier_workloads(vllm, path, policy):
    from impls.engines.vllm_offload import VllmOffload
    trace = with_policy(load_traces([path])[0], policy)
    v = checked(trace, VllmOffload(config_for(trace)), gather="all")
    if any(op.kind == "preempt" and op.mode == "swap" for op in trace.ops):  # SPEC §13 over §11
        assert v.valid is None and "does not preempt by swap" in v.not_applicable, v.not_applicable
        return
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(trace.ops)
    assert v.events > 0  # its KV events checked at every operation: the device's and vLLM's tiers'
    # the content checks read vLLM's chunk ids; its copies need CUDA, and the verdict says so
    assert "CUDA" in v.skipped["tier copies"]


@pytest.mark.parametrize("policy", ["lru", "arc"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(4, 6).flatmap(lambda n: st.tuples(st.just(n), histories(n))),
       host=st.integers(0, 3))
def test_passes_random_histories(vllm, policy, case, host):
    blocks, ops = case
    tiers = (TierSpec("host", host, policy), TierSpec("disk", 4, policy))
    trace = validate(Trace(Header("random", tiers=tiers), ops, name="random"))
    v = checked(trace, offload(blocks), gather="all")
    assert v.valid is True, (v.divergence, v.error)


# --- the rules vLLM declares, each shown by a trace that needs it --------------------------------

def store_two_into_one() -> Trace:
    """``kvbench shrink`` of a 46-operation random history held to SPEC's refusal: a store of 2
    new blocks to a host tier of 1 with nothing to evict."""
    ops = [Prefill(0, 0, "a", 2 * B, (1, 2), "x"), Store(1, 0, 0, "host")]
    return validate(Trace(Header("whole-store", tiers=(TierSpec("host", 1),)), ops, name="whole-store"))


def test_a_store_without_room_for_every_block_is_refused_whole(vllm):
    """vLLM's prepare_store returns None when it cannot evict room for all the new blocks
    (manager.py:321-336): nothing begins. SPEC begins the one that fits."""
    v = checked(store_two_into_one(), offload(2))
    assert v.valid is True, str(v.divergence)
    spec = checked(store_two_into_one(), offload(2, rules=("request_recency",)))
    d = spec.divergence
    assert spec.valid is False and d.step == 1 and d.quantity == "tier host storing"
    assert (d.expected, d.actual) == (1, 0)  # SPEC: min(2 blocks, capacity 1); vLLM: none


def recency_by_request() -> Trace:
    """Blocks 1, 2 stored to a host tier of 2 by one request, which is freed; block 3 stored by
    another needs one victim; the device then forgets everything, and a load asks for 1, 2."""
    H = (TierSpec("host", 2),)
    ops = [Prefill(0, 0, "a", 2 * B, (1, 2)), Store(1, 0, 0, "host"), Done(2, 0, True), Free(3, 0),
           Prefill(4, 1, "a", B, (3,)), Store(5, 1, 1, "host"), Done(6, 1, True), Free(7, 1),
           Prefill(8, 2, "flush", 8 * B), Free(9, 2),
           Load(10, 3, "a", 2 * B, (1, 2), id=2), Done(11, 2, True), Free(12, 3)]
    return validate(Trace(Header("recency", tiers=H), ops, name="recency"))


def test_recency_is_the_requests_first_block_most_recent_at_its_finish(vllm):
    """vLLM ranks a request's blocks (rank, -position) and, when it finishes, makes each most
    recent, its first block last (lru.py:267-277, :314-323): block 2 is the victim of block 3's
    store, so the load finds block 1 on the host. SPEC's LRU (a store's last block the most
    recent) evicts block 1, and the load finds nothing."""
    v = checked(recency_by_request(), offload(), gather="all")
    assert v.valid is True, str(v.divergence)
    assert v.final_ledger["prefix_hit_blocks"] == 0  # the flush left the device no hit
    spec = checked(recency_by_request(), offload(rules=("whole_store_refused",)), gather="all")
    d = spec.divergence
    # vLLM's events show the victim at once: block 3's store at step 5 evicts block 2 (SPEC: 1)
    assert spec.valid is False and d.step == 5 and d.quantity == "residency of group 0, tier 1"
    assert (d.expected["removed"], d.actual["removed"]) == ([1], [2])
    quiet = offload(rules=("whole_store_refused",), events=False)  # its ledgers alone
    d = checked(recency_by_request(), quiet, gather="all").divergence
    assert d.step == 10 and d.quantity == "tier host loading"
    assert (d.expected, d.actual) == (0, 1)  # SPEC: block 1 evicted, nothing loads; vLLM: 1 block


# --- failure paths (SPEC §11): a tier that drops a failed load's blocks is vLLM's file tier --------

def failed_reload(failed_load: str) -> Trace:
    """A prompt of 2 hashed blocks stored to disk and forgotten by the device; a load of it from
    disk fails (its 2 blocks computed again); the device forgets them again and the prompt is
    loaded again: disk's 2 blocks where it keeps them, none where it dropped them."""
    ops = [Prefill(0, 0, "a", 10 * B, (1, 2)), Store(1, 1, 0, "disk"), Done(2, 1),
           Free(3, 0), Prefill(4, 1, "a", 16 * B), Free(5, 1),       # 16 blocks: the device's all
           Load(6, 2, "a", 10 * B, (1, 2), id=2), Done(7, 2, False), Free(8, 2),
           Prefill(9, 3, "a", 16 * B), Free(10, 3),
           Load(11, 4, "a", 10 * B, (1, 2), id=3), Done(12, 3), Free(13, 4)]
    tiers = (TierSpec("host", 4), TierSpec("disk", 64, failed_load=failed_load))
    return validate(Trace(Header("failed-reload", tiers=tiers), ops, name="failed-reload"))


@pytest.mark.parametrize("failed_load, disk_stored, disk_hits", [
    ("keep", 2, 2 + 2),  # vLLM's CPU manager: both loads take disk's 2 blocks
    ("drop", 0, 2),      # vLLM's file tier: the short read removed both files; the reload misses
])
def test_a_failed_load_leaves_vllms_tier_as_declared(vllm, failed_load, disk_stored, disk_hits):
    backend = offload(16, events=False)  # its ledgers alone; its events: the next test
    try:
        v = check(failed_reload(failed_load), backend, gather="all")
        assert v.valid is True, str(v.divergence)
        disk = backend.tier_ledgers()[1]
        assert (disk["stored"], disk["hits"]) == (disk_stored, disk_hits)
    finally:
        backend.close()


def announcing_file_tier(num_blocks=16):
    """vllm-offload whose file tier also announces a removed event for each file a failed
    load's short read removed: what SPEC §14 asks, not what vLLM does."""
    from impls.engines.vllm_offload import VllmOffload, _VllmFileTier
    from impls.pool_events import _group_key
    from kvbench.contract.events import REMOVED, KVEvent

    class AnnouncingFileTier(_VllmFileTier):
        gone: list = []

        def read(self, keys, seq, ok) -> None:
            there = [k for k in keys if os.path.exists(self._path(k))]
            super().read(keys, seq, ok)
            self.gone = self.gone + [k for k in there if not os.path.exists(self._path(k))]

        def events(self, tier):
            gone, self.gone = self.gone, []
            return super().events(tier) + [KVEvent(REMOVED, _group_key(k)[1], None, _group_key(k)[0], tier)
                                           for k in gone]

    class AnnouncesDrops(VllmOffload):
        def _make_tier(self, spec, storage):
            if spec.failed_load == "drop":
                return AnnouncingFileTier(spec, storage, self._tier_folder, self.B)
            return super()._make_tier(spec, storage)

    return AnnouncesDrops(make_config(block_size=B, num_blocks=num_blocks, prefix_caching=True))


def test_vllms_file_tier_announces_no_removal_of_a_failed_loads_files_as_declared(vllm):
    """vLLM 0.33's FileSystemTierManager emits an OffloadingEvent for a store job that succeeds
    and none when its short read removes a file (fs/manager.py:286-295, fs/io.py:161): declared
    as failed_load_drops_unannounced, so the checker expects no removal at the failed load
    (step 7), and disk's blocks 1, 2 stay in the events' residency."""
    assert "failed_load_drops_unannounced" in offload().capabilities.tier_rules
    v = checked(failed_reload("drop"), offload(16))
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(failed_reload("drop").ops)
    # held to SPEC §14 (a removed event for each dropped entry): FAILs at the failed load
    spec = checked(failed_reload("drop"), offload(16, rules=("whole_store_refused", "request_recency")))
    d = spec.divergence
    assert (spec.valid, d.step, d.quantity) == (False, 7, "residency of group 0, tier 2")
    assert (d.expected["removed"], d.actual["removed"]) == ([1, 2], [])
    # a file tier that does announce them, held to vLLM's declared rule: FAILs there too
    said = checked(failed_reload("drop"), announcing_file_tier())
    d = said.divergence
    assert (said.valid, d.step, d.quantity) == (False, 7, "residency of group 0, tier 2")
    assert (d.expected["removed"], d.actual["removed"]) == ([], [1, 2])
    # and passes where held to SPEC: the plant announces what SPEC asks
    plant = announcing_file_tier()
    plant.capabilities = dataclasses.replace(plant.capabilities, tier_rules=(
        "whole_store_refused", "request_recency", "drops_failed_loads"))
    assert checked(failed_reload("drop"), plant).valid is True


def test_a_file_dropped_unannounced_then_stored_again_is_announced_again(vllm):
    """After the failed load (step 7: its 2 blocks computed again on the device) sequence 3's
    prompt hits them and is stored to disk (steps 9-11): vLLM writes both files again and
    announces them stored (fs/manager.py:286-295) while an index fed its events still holds
    them. Under the declared rule that is no second store of a present key; disk holds 2 again."""
    ops = list(failed_reload("drop").ops[:9]) + [Prefill(9, 3, "a", 10 * B, (1, 2)),
                                                 Store(10, 4, 3, "disk"), Done(11, 4), Free(12, 3)]
    trace = validate(Trace(dataclasses.replace(failed_reload("drop").header), ops, name="stored-again"))
    backend = offload(16)
    try:
        v = check(trace, backend)
        assert v.valid is True, str(v.divergence)
        assert v.ops == len(ops) and backend.tier_ledgers()[1]["stored"] == 2
    finally:
        backend.close()


def test_vllm_issue_49176_a_failed_loads_hit_served_again_fails_at_the_failure(vllm):
    """PR #49328 reverted in vLLM's file tier: the failed load's lookup verdicts stay "found",
    so the request's retry (vLLM reschedules it and looks its blocks up again) is served the
    2 blocks whose files are gone. It could pass: the fixed tier marks them a miss."""
    from impls.engines.faults_engines import VllmFailedLoadHitKept
    backend = VllmFailedLoadHitKept(make_config(block_size=B, num_blocks=16, prefix_caching=True))
    v = checked(failed_reload("drop"), backend)
    d = v.divergence
    # step 7: the load of disk's 2 blocks fails; the retry finds none (2 hits in all), the
    # reverted tier finds both again: 2 + 2
    assert (v.valid, d.step, d.quantity, d.expected, d.actual) == (False, 7, "tier disk hits", 2, 2 + 2)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(4, 6).flatmap(lambda n: st.tuples(st.just(n), histories(n))),
       host=st.integers(0, 3))
def test_passes_random_histories_over_its_file_tier(vllm, case, host):
    blocks, ops = case
    # a disk tier larger than any history's blocks: vLLM's file tier evicts nothing
    tiers = (TierSpec("host", host), TierSpec("disk", 64, failed_load="drop"))
    trace = validate(Trace(Header("random", tiers=tiers), ops, name="random"))
    # its events read too: a failed load's files removed unannounced, as declared
    v = checked(trace, offload(blocks), gather="all")
    assert v.valid is True, (v.divergence, v.error)


def test_a_drop_tier_the_fuzzer_draws_is_one_vllms_file_tier_can_run(vllm, tmp_path):
    """`kvbench fuzz --backend vllm-offload` (seed 0) drew at history 9 a host tier of capacity
    1 dropping failed loads, and a store of a 4-token prompt's 2 full blocks (B = 2) into it:
    vLLM's file tier, which evicts nothing, made that the adapter's RuntimeError. The adapter
    declares it (tier rule ``drop_tiers_evict_nothing``): such a trace is n/a with the reason, and the fuzzer draws
    the tier as large as the history may store. It could fail: the campaign's first 10 histories
    are checked against vLLM, history 9 storing into its file tier, two loads reading one of its
    blocks and one failing (the test below: declared as failed_read_removes_at_once)."""
    from kvbench.contract import registry
    from kvbench.search.fuzz import Campaign
    from kvbench.search.watch import SHARED_DROP
    ops = [Prefill(0, 0, "a", 4, ("c2.0", "c2.1"), "s1", "a1"), Store(1, 2, 0, "host")]
    trace = validate(Trace(Header("fuzz-0-9", tiers=(TierSpec("host", 1, failed_load="drop"),)), ops,
                           name="fuzz-0-9"))
    v = checked(trace, offload(2, block_size=2))
    assert v.valid is None and v.not_applicable == (
        "vllm-offload does not evict from its tiers of failed_load 'drop' (SPEC §11), and the trace "
        "may store 2 blocks into tier host, of capacity 1"), (v.error, v.not_applicable)
    s = Campaign(registry.resolve("vllm-offload"), tmp_path, seed=0, max_histories=10).run().summary()
    assert s["errors"] == [] and s["not_applicable"] == {}
    assert s["findings"] == [] and s["coverage"]["edges"][SHARED_DROP] >= 1  # history 9's


def test_vllms_file_tier_removes_a_failed_reads_file_while_another_load_reads_it(vllm):
    """Declared as failed_read_removes_at_once: two loads read disk's block, the second fails.
    vLLM's file tier removes the file at the failed (short) read (``tiering/fs/io.py``
    ``_load_block``'s ``os.remove``, :161) while the first still reads it, and the first's read
    then opens no file (:156, FileNotFoundError): its job fails and the block is computed again
    (nothing moved up). SPEC §11 keeps the dropped entry until no load reads it. Seed 0's
    history 9 of `kvbench fuzz --backend vllm-offload`, shrunk, the first load completed. It
    could pass held to SPEC: a tier keeping the file until its last reader ends."""
    assert "failed_read_removes_at_once" in offload().capabilities.tier_rules
    ops = [Prefill(0, 0, "a", 2, ("c4.0",)), Store(1, 0, 0, "disk"), Done(2, 0), Free(3, 0),
           Prefill(4, 1, "b", 27), Free(5, 1),  # the device forgets the block: the loads read disk
           Load(6, 2, "a", 2, ("c4.0",), id=1), Load(7, 3, "a", 2, ("c4.0",), id=2), Done(8, 2, False),
           Done(9, 1)]
    trace = validate(Trace(Header("t", tiers=(TierSpec("disk", 16, failed_load="drop"),)), ops, name="t"))
    backend = offload(14, block_size=2)
    try:
        v = check(trace, backend, gather="all")
        assert v.valid is True and v.ops == len(ops), (v.divergence, v.error)
        disk = backend.tier_ledgers()[0]
        # both loads began on the block (1 + 1 hits), neither moved it up, its file is gone
        assert (disk["stored"], disk["loading"], disk["hits"], disk["bytes_up"]) == (0, 0, 1 + 1, 0)
    finally:
        backend.close()
    # held to SPEC §11 (the entry kept while load 1 reads it): FAILs at the failed load
    spec = checked(trace, offload(14, block_size=2, rules=(
        "whole_store_refused", "request_recency", "failed_load_drops_unannounced", "drop_tiers_evict_nothing")))
    d = spec.divergence
    # SPEC's disk holds the block, unreadable, for load 1 (stored 1); vLLM's file is gone (0)
    assert (spec.valid, d.step, d.quantity, d.expected, d.actual) == (False, 8, "tier disk stored", 1, 0)


def test_the_shared_reads_boundary_passes_as_declared_and_fails_held_to_spec(vllm):
    """The default run's shared-reads traces (a load fails while another load of its host blocks
    is in flight): both pass under vLLM's rules; under a dropping host (its file tier) held to
    SPEC §11 (the entry kept for the other reader) it FAILs at the failure, step 8 (the traces'
    steps: store 1, its done 2, the loads 6 and 7, the failed one's done 8). It could pass held
    to SPEC: a tier keeping the file until its last reader ends."""
    from kvbench.traces.boundaries import SHARED_READS
    for trace in SHARED_READS.build(SHARED_READS.cases()):
        v = checked(trace, offload(8, block_size=4))
        assert v.valid is True, (trace.name, v.divergence, v.error, v.not_applicable)
        if trace.header.tiers[0].failed_load == "drop":
            spec = checked(trace, offload(8, block_size=4, rules=(
                "whole_store_refused", "request_recency", "failed_load_drops_unannounced",
                "drop_tiers_evict_nothing")))
            d = spec.divergence
            # SPEC's host keeps the 2 blocks for the second load; vLLM's files are gone
            assert (spec.valid, d.step, d.quantity, d.expected, d.actual) == (False, 8, "tier host stored", 2, 0)


def test_its_tier_events_are_vllms_offloading_events(vllm):
    import numpy as np

    from kvbench.contract.events import STORED, KVEvent
    from kvbench.contract.protocol import Prompt, kv_tokens
    b = offload(8)
    kv = kv_tokens(np.zeros(2 * B, int), np.arange(2 * B), b.config.model)
    try:
        b.attach_tiers((TierSpec("host", 4),))
        b.prefill(0, Prompt(2 * B, "a", block_hashes=(1, 2)), kv)
        assert b.events() == [KVEvent(STORED, 1, None, 0, 0), KVEvent(STORED, 2, 1, 0, 0)]
        b.store(1, 0, "host")
        assert b.events() == []  # storing: vLLM announces a block when its store completes
        b.complete(1, True)
        # CPUOffloadingManager.complete_store's one OffloadingEvent (medium CPU), no parent
        assert b.events() == [KVEvent(STORED, 1, None, 0, 1), KVEvent(STORED, 2, None, 0, 1)]
        b.prefill(1, Prompt(2 * B, "a", block_hashes=(3, 4)), kv)
        b.events()
        b.store(2, 1, "host")
        b.complete(2, False)
        assert b.events() == []  # its metadata-only release, which vLLM's connector publishes as nothing
    finally:
        b.close()


def test_a_load_out_of_memory_then_retried_counts_vllms_hits_once(vllm):
    """The load's lookups run before the device allocation; refused for memory, it begins no
    load in vLLM (no prepare_load), and the retry's hits are counted once."""
    ops = [Prefill(0, 0, "a", 10 * B, (1, 2)), Store(1, 1, 0, "host"), Done(2, 1), Free(3, 0),
           Prefill(4, 1, "a", 16 * B), Free(5, 1),  # the device forgets 1 and 2
           Prefill(6, 2, "a", 14 * B),              # 14 of 16 blocks
           Load(7, 3, "a", 10 * B, (1, 2), id=2),   # ceil(40 / 4) = 10 blocks > 16 - 14: refused
           Free(8, 2),
           Load(9, 4, "a", 10 * B, (1, 2), id=3), Done(10, 3), Free(11, 4)]
    trace = validate(Trace(Header("retry", tiers=(TierSpec("host", 4),)), ops, name="retry"))
    backend = offload(16)
    try:
        v = check(trace, backend)
        assert v.valid is True, str(v.divergence)
        assert backend.tier_ledgers()[0]["hits"] == 2  # the retry's 2 blocks, not 2 + 2
    finally:
        backend.close()
