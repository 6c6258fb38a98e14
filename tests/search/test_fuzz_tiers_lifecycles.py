"""`kvbench fuzz` over SPEC §11's transfers, §13's lifecycles and --model-shapes: the histories
are ones the trace loader accepts, drawn only where the backend declares them, deterministic
under a seed, and they find the planted tier, lifecycle and cache-kind faults."""
from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest

from impls import faults, faults_tiers
from impls.numpy_paged import NumpyPaged
from kvbench.cli import main
from kvbench.contract import registry
from kvbench.contract.protocol import Capabilities
from kvbench.search import edits
from kvbench.search import histories as R
from kvbench.search import watch as F
from kvbench.search.fuzz import Campaign
from kvbench.traces.format import Append, Prefill, loads
from kvbench.traces.ops import Accept, Done, Free, Store

NUMPY = NumpyPaged.capabilities
TRANSFERS = {"store", "load", "done", "abort"}
LIFECYCLE_OPS = {"accept", "preempt", "resume"}


def histories(caps, n, lifecycles=R.LIFECYCLES, shapes=False, seed=0):
    return [R.random_history(seed, i, caps, lifecycles, shapes) for i in range(n)]


def test_every_history_is_one_the_loader_accepts():
    kinds = Counter()
    for trace, settings, _ in histories(NUMPY, 150, shapes=True):
        text = trace.to_jsonl()
        assert loads(text).to_jsonl() == text  # the loader's history rules: transfers, lifecycles
        kinds.update(op.kind for op in trace.ops)
        kinds.update(["chunked prefill"] * sum(1 for op in trace.ops if getattr(op, "prompt_tokens", None)))
        kinds.update(["draft"] * sum(1 for op in trace.ops if getattr(op, "draft", None)))
    for kind in (*TRANSFERS, *LIFECYCLE_OPS, "chunked prefill", "draft"):
        assert kinds[kind] > 0, (kind, kinds)


def test_transfers_and_lifecycles_only_where_declared():
    no_tiers = dataclasses.replace(NUMPY, tiers=())
    ops = {op.kind for t, _, _ in histories(no_tiers, 120) for op in t.ops}
    assert not ops & TRANSFERS and ops >= LIFECYCLE_OPS
    bare = {op.kind for t, _, _ in histories(NUMPY, 120, lifecycles=()) for op in t.ops}
    assert not bare & LIFECYCLE_OPS and bare >= TRANSFERS
    assert not any(getattr(op, "prompt_tokens", None) for t, _, _ in histories(NUMPY, 120, lifecycles=())
                   for op in t.ops)
    for trace, settings, _ in histories(NUMPY, 200):
        if trace.header.tiers:  # what a tier replay runs: one full group, caching, no policy
            assert settings.kinds() == ("full",) and settings.prefix_caching and settings.policy is None
        if any(op.kind == "accept" for op in trace.ops):  # a rollback where a group releases: n/a
            assert not any(g.releases for g in settings.spec().kv_groups), settings


def test_a_campaign_reads_the_lifecycles_the_backend_takes(tmp_path):
    class NoChunks(NumpyPaged):  # declares no chunked prefill
        capabilities = dataclasses.replace(NumpyPaged.capabilities, chunked_prefill=False)

    c = Campaign(SimpleNamespace(name="no-chunks", create=NoChunks), tmp_path)
    c.capabilities()
    assert c.lifecycles == ("speculative", "preempt")


@pytest.mark.parametrize("fault,within", [(faults_tiers.FailedStoreVisible, 30),
                                          (faults_tiers.LeaseEndsAtFree, 30),
                                          (faults.RollbackKeepsTailFill, 10),
                                          (faults.ResumeIntoOldBlocks, 10),
                                          (faults.SinkReleasedEarly, 10),
                                          (faults.StateNotZeroed, 10),
                                          (faults_tiers.SwapInReadsAnother, 30),
                                          (faults_tiers.PinIsAFlag, 30),
                                          (faults_tiers.FailedLoadReserved, 60)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_planted_tier_lifecycle_or_kind_fault_is_found_and_shrunk(fault, within, tmp_path):
    c = Campaign(registry.resolve(f"{fault.__module__}:{fault.__name__}"), tmp_path, seed=0,
                 max_histories=within, shrink_attempts=600, shrink_seconds=3600, first=True,
                 model_shapes=True).run()
    assert c.stopped == "first finding", f"{fault.__name__} not found in {within} histories"
    (f,) = c.findings.values()
    assert f.ops_after is not None and f.ops_after <= 20, (f.ops_before, f.ops_after)
    mini = loads((tmp_path / f"{f.name}.min.jsonl").read_text())
    assert len(mini) == f.ops_after


def test_model_shapes_are_the_same_under_a_seed_and_keep_to_the_declared_kinds():
    a = [t.to_jsonl() for t, _, _ in histories(NUMPY, 60, shapes=True, seed=5)]
    assert a == [t.to_jsonl() for t, _, _ in histories(NUMPY, 60, shapes=True, seed=5)]
    assert a != [t.to_jsonl() for t, _, _ in histories(NUMPY, 60, shapes=True, seed=6)]
    drawn = histories(NUMPY, 300, shapes=True)
    families = {k.split("(")[0] for _, s, _ in drawn for k in s.kinds()}
    assert families == {"full", "sliding", "chunked", "sinks", "mla", "state"}
    sources = {s.shape for _, s, _ in drawn} - {"", "random mix"}
    assert {"gemma-3-12b", "tiny-sinks", "deepseek-v3"} & sources and sources <= set(R.shape_presets(NUMPY))
    assert all(s.spec().layers <= 4 for _, s, _ in drawn)  # scaled down: tiny bases only
    # Without groups, only one full group; without the SPEC §12 kinds, only full and sliding.
    plain = Capabilities(prefix_caching=True)
    assert {s.kinds() for _, s, _ in histories(plain, 80, shapes=True)} == {("full",)}
    hybrid = Capabilities(prefix_caching=True, groups=True)
    assert {k.split("(")[0] for _, s, _ in histories(hybrid, 150, shapes=True)
            for k in s.kinds()} == {"full", "sliding"}


def test_a_drawn_state_fits_one_block_and_is_never_a_model_alone():
    states = 0
    for _, s, _ in histories(NUMPY, 300, shapes=True):
        spec = s.spec()
        assert any(g.per_token for g in spec.kv_groups), s.groups
        for g in spec.kv_groups:
            if g.state_bytes is not None:
                states += 1
                # a block's bytes over the group's layers: B tokens * 2 (K, V) * 2 heads * 8 dims
                # * 2 bytes per layer, as tiny-hybrid's
                assert len(g.layers) * g.state_bytes <= s.block_size * 2 * 2 * 8 * 2 * len(g.layers)
    assert states > 0
    assert R._with_token_group(["state", "state"], ["state", "chunked"]) == ["state", "chunked"]
    assert R._with_token_group(["state"], ["state"]) == ["full"]


def test_swaps_only_where_declared_and_resumed_first_come_first_served():
    swapped = [t for t, _, _ in histories(NUMPY, 300) if any(getattr(op, "mode", "") == "swap" for op in t.ops)]
    assert swapped
    no_swap = dataclasses.replace(NUMPY, swap=False)
    assert not any(getattr(op, "mode", "") == "swap" for t, _, _ in histories(no_swap, 300) for op in t.ops)
    for t in swapped:  # every preempted sequence is resumed, freed or aborted by the end
        waiting = set()
        for op in t.ops:
            if op.kind == "preempt":
                waiting.add(op.seq)
            elif op.kind in ("resume", "free", "abort"):
                waiting.discard(op.seq)
        assert not waiting, t.name


def test_a_preset_pattern_is_cut_down_keeping_each_kind():
    # gemma-3-12b: 5 sliding groups and 1 full -> 4 groups: the full one stays, the commonest
    # kind (sliding) fills the other 3, in the preset's order.
    assert R._pattern(["sliding"] * 5 + ["full"], 4) == ["sliding", "sliding", "sliding", "full"]
    assert R._pattern(["chunked"] * 3 + ["full"], 2) == ["chunked", "full"]
    assert R._pattern(["full"], 1) == ["full"]


def test_model_shapes_are_the_default_and_the_old_flag_is_a_no_op(tmp_path, capsys):
    assert main(["fuzz", "--backend", "numpy", "--max-histories", "6", "--model-shapes",
                 "--out", str(tmp_path / "a"), "--quiet"]) == 0, capsys.readouterr().out
    assert "--model-shapes is the default now" in capsys.readouterr().err
    assert '"model_shapes": true' in (tmp_path / "a" / "summary.json").read_text()
    assert main(["fuzz", "--backend", "numpy", "--max-histories", "6", "--base-model-only",
                 "--out", str(tmp_path / "b"), "--quiet"]) == 0, capsys.readouterr().out
    assert '"model_shapes": false' in (tmp_path / "b" / "summary.json").read_text()


def test_shrinking_drops_a_transfer_with_its_sequence_and_its_completion():
    ops = [Prefill(0, 0, "a", 8, ("h0", "h1")), Prefill(1, 1, "a", 4), Store(2, 0, 0, "host"),
           Store(3, 1, 1, "host"), Free(4, 0), Done(5, 0, True), Append(6, (1,), (1,)), Done(7, 1, False)]
    assert [op.step for op in edits.drop_sequences(ops, {0})] == [1, 3, 6, 7]  # store 0 and its done go
    units = edits.members(ops)
    assert (3, 1) in units and (5, None) in units
    assert [op.step for op in edits.drop_members(ops, [(3, 1)])] == [0, 1, 2, 4, 5, 6]  # with done 1
    assert [op.step for op in edits.drop_members(ops, [(5, None)])] == [0, 1, 2, 3, 4, 6, 7]


def test_shrinking_drops_a_draft_with_its_accept():
    ops = [Prefill(0, 0, "a", 4), Append(1, (0,), (3,), (2,)), Accept(2, 0, 1), Append(3, (0,), (1,))]
    assert [op.step for op in edits.drop_members(ops, [(1, 0)])] == [0, 3]


def test_a_campaign_reaches_the_edges_of_transfers_and_lifecycles(tmp_path):
    s = Campaign(registry.resolve("numpy"), tmp_path, seed=0, max_histories=120).run().summary()
    assert s["findings"] == [] and s["errors"] == []
    edges = s["coverage"]["edges"]
    for edge in ("load served from a tier", "store into a full tier", "failed transfer",
                 F.ABORT_LOADING, "free while its store is in flight", F.ROLLBACK,
                 "rollback ending on a block edge", F.SHARED_ROLLBACK, F.ZERO_OP, "resume with a prefix hit",
                 "store into a full tier while a load reads it"):
        assert edges[edge] > 0, (edge, edges)



