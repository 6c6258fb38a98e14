"""vLLM's whole KVCacheManager behind the protocol (impls/engines/vllm_kvmanager.py).

vLLM is opt-in (docs/engines.md's recipe builds /work/vllm-env); CI does not install it, so every test
that needs it is skipped there with the reason. Run them with::

    /work/vllm-env/bin/python -m pytest tests/engines/test_vllm_kvmanager.py

Expected values come from the formulas and from vLLM's documented rules (the adapter declares
them as capabilities): a fork is a new request through the prefix cache, a whole prefix hit
computes its last block again, every full block is cached, duplicates are kept; at the serving
default a sliding group caches only the window runs a later hit can end on (sparse retention).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import P, X, make_config, make_trace

from kvbench.model.rules import rule_set
from kvbench.analyses import prefix
from kvbench.checking.checker import check
from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig, OutOfMemory, Prompt
from kvbench.model.oracle import Oracle
from kvbench.traces.format import Free, Header, Prefill, Trace, validate
from kvbench.traces.ops import Accept, Append, Fork
from kvbench.traces.loaders import load_requests

SKIP_REASON = "vLLM is not installed (opt-in, not in CI): see docs/engines.md for its recipe"
TRACES = Path(os.environ.get("KVBENCH_TRACES", Path(__file__).resolve().parents[3] / "shared" / "traces"))
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
B = 16

# Makes `import vllm` / `import sglang` fail as they do where they are not installed.
NO_ENGINES = textwrap.dedent("""
    import sys

    class NoEngines:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("vllm", "sglang"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name.split(".")[0])

    sys.meta_path.insert(0, NoEngines())
    from kvbench.cli import main
    main(["list"])
""")


def test_without_the_engines_both_adapters_are_listed_unavailable_with_the_recipe(tmp_path):
    got = subprocess.run([sys.executable, "-c", NO_ENGINES], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert got.returncode == 0, got.stderr
    lines = {ln.split()[0]: ln for ln in got.stdout.splitlines() if ln.strip()}
    for name, engine in (("vllm-kvmanager", "vllm"), ("vllm-kvmanager-dense", "vllm"),
                         ("sglang", "sglang"), ("sglang-radix", "sglang"),
                         ("sglang-radix-lfu", "sglang")):
        assert lines[name].split()[1:3] == ["built-in", "no"], lines[name]
        assert f"{engine} is not installed: its opt-in recipe is in docs/engines.md" in lines[name]


@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm", reason=SKIP_REASON)


def manager(num_blocks=8, caching=False):
    from impls.engines.vllm_kvmanager import VllmKVManager
    return VllmKVManager(make_config(block_size=B, num_blocks=num_blocks, store_kv=False,
                                     prefix_caching=caching))


HB, W = 8, 32  # tiny-hybrid: groups sliding(32) (layers 0, 2) then full (layers 1, 3)


def hybrid(num_blocks=40, caching=False):
    """Dense retention of window checkpoints, held to SPEC's rule of every full block cached (vLLM
    serves with sparse retention, ``prefix_cache_retention_interval = 0``, its declared rule: see
    the sparse-retention tests)."""
    from impls.engines.vllm_kvmanager import VllmKVManagerDense
    return VllmKVManagerDense(CacheConfig(model=get_model("tiny-hybrid"), block_size=HB,
                                     num_blocks=num_blocks, store_kv=False, prefix_caching=caching))


def refs(be, seq):
    return [b.ref_cnt for b in be.table(seq)]


# --- the adapter under the checker ------------------------------------------------------------

@pytest.mark.parametrize("dense", [False, True], ids=["serving-default", "dense"])
@pytest.mark.parametrize("caching", [None, True], ids=["trace-default", "prefix-caching"])
@pytest.mark.parametrize("path", committed_workloads(), ids=lambda p: p.stem)
def test_checks_clean_on_every_committed_workload(vllm, path, caching, dense):
    """Both retentions pass everything: vLLM's serving default (sparse retention) under its
    declared rule, dense retention under SPEC's."""
    import impls.engines.vllm_kvmanager as adapters
    VllmKVManager = adapters.VllmKVManagerDense if dense else adapters.VllmKVManager
    trace = load_traces([path])[0]
    config = config_for(trace, policy=None, prefix_caching=caching)
    if {g.family for g in config.model.kv_groups} - set(VllmKVManager.capabilities.kinds):
        with pytest.raises(NotImplementedError, match="does not run"):  # SPEC §12: not mapped yet
            VllmKVManager(config)
        return
    if dense and config.prefix_caching and any(g.state_bytes is not None
                                                for g in config.model.kv_groups):
        with pytest.raises(NotImplementedError, match="dense retention"):  # docs/engines.md
            VllmKVManager(config)
        return
    v = check(trace, VllmKVManager(config))
    if trace.header.tiers:  # the adapter runs no lower tiers (SPEC §11)
        assert v.valid is None and "does not declare tiers" in v.not_applicable
        return
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(trace.ops)


def test_an_eviction_policy_is_not_applicable(vllm):
    from impls.engines.vllm_kvmanager import VllmKVManager
    trace = load_traces([committed_workloads()[0]])[0]
    v = check(trace, VllmKVManager(config_for(trace, policy="lru")))
    assert v.not_applicable == ("vllm-kvmanager does not implement eviction policy 'lru' "
                                "(SPEC §5), and the run evicts under it")


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"shared trace not found: {MOONCAKE}")
def test_mooncake_prefix_cache_checks_clean(vllm):
    from impls.engines.vllm_kvmanager import VllmKVManager
    trace = prefix.cache_trace(load_requests(str(MOONCAKE), "mooncake")[:300], 512)
    cfg = make_config(block_size=512, num_blocks=300, store_kv=False, prefix_caching=True)
    v = check(trace, VllmKVManager(cfg), gather="none")
    assert v.valid is True, str(v.divergence)
    assert v.final_ledger["prefix_hit_blocks"] > 0


# --- vLLM's rules, hand-worked ----------------------------------------------------------------

def test_null_block_is_added_so_that_n_blocks_are_usable(vllm):
    be = manager(num_blocks=4)
    assert be.pool.num_gpu_blocks == 5  # 5 = 4 + 1: vLLM keeps block 0 as its null block
    be.prefill(0, Prompt(64))  # 64 = 4 * 16: every usable block
    assert (be.ledger().blocks_used, be.ledger().blocks_free) == (4, 0)
    with pytest.raises(OutOfMemory):
        be.prefill(1, Prompt(1))


def test_without_prefix_caching_a_fork_computes_every_block_again(vllm):
    be = manager(num_blocks=6)
    be.prefill(0, Prompt(40))  # ceil(40/16) = 3 blocks
    be.fork(1, 0)
    led = be.ledger()
    assert (led.blocks_used, led.shared_blocks) == (6, 0)  # 2 * 3, nothing shared
    assert set(b.block_id for b in be.table(0)).isdisjoint(b.block_id for b in be.table(1))
    before = led.as_dict()
    with pytest.raises(OutOfMemory):  # a third copy needs 3 blocks, 0 are free
        be.fork(2, 0)
    assert be.ledger().as_dict() == before


def test_with_prefix_caching_a_fork_shares_the_full_blocks(vllm):
    be = manager(caching=True)
    be.prefill(0, Prompt(40))
    be.fork(1, 0)
    assert be.table(1)[:2] == be.table(0)[:2]  # 40 // 16 = 2 full blocks, hit in the cache
    assert refs(be, 0) == [2, 2, 1]  # the tail of 40 - 32 = 8 tokens is computed again
    assert be.ledger().blocks_used == 4


def test_a_whole_prefix_hit_computes_its_last_block_again_and_caches_it_twice(vllm):
    be = manager(caching=True)
    be.prefill(0, Prompt(32, block_hashes=["a", "b"]))
    be.free(0)
    assert be.ledger().cached_blocks == 2
    be.prefill(1, Prompt(32, block_hashes=["a", "b"]))
    led = be.ledger()
    assert led.prefix_hit_blocks == 1  # (32 - 1) // 16: vLLM's cap of num_tokens - 1 hit tokens
    assert led.blocks_used == 2 and led.cached_blocks == 1  # the first "b" block stays cached
    be.free(1)
    assert be.ledger().cached_blocks == 3  # "a", and "b" twice: no de-duplication


def test_blocks_filled_by_decode_are_cached(vllm):
    be = manager(caching=True)
    be.prefill(0, Prompt(20))  # 1 full block, 4 tokens in the tail
    be.append([0], [12])  # the tail fills: 32 = 2 * 16
    be.free(0)
    assert be.ledger().cached_blocks == 2


def test_a_batched_append_that_does_not_fit_changes_nothing(vllm):
    be = manager(num_blocks=4)
    be.prefill(0, Prompt(16))
    be.prefill(1, Prompt(16))
    before = be.ledger().as_dict()
    with pytest.raises(OutOfMemory):  # 1 + 2 new blocks (17 = 16 + 1 tokens), 2 free
        be.append([0, 1], [1, 17])
    assert be.ledger().as_dict() == before
    assert [r.num_tokens for r in be.requests.values()] == [16, 16]  # no token id went in


def test_the_free_queue_evicts_in_the_oracles_order(vllm):
    """vLLM's own eviction order, read back from its free queue, is the oracle's: cached blocks
    least recently freed first, a sequence's tail first."""
    from impls.engines.vllm_kvmanager import VllmKVManager
    ops = [Prefill(0, 0, "a", 40, ("x1", "x2")), Prefill(1, 1, "a", 56, ("y1", "y2")),
           Free(2, 1), Prefill(3, 2, "a", 20, ("x1",)), Free(4, 0), Free(5, 2)]
    trace = validate(Trace(Header(family="test", settings={"block_size": B}), ops, name="order"))
    cfg = make_config(block_size=B, num_blocks=12, store_kv=False, prefix_caching=True)
    be = VllmKVManager(cfg)
    assert check(trace, be).valid is True
    oracle = Oracle(cfg, capabilities=be.capabilities)
    check(trace, None, model=oracle)
    keys = [oracle.hash_of[b][1] for b in oracle.evictable]  # hash_of: block -> (group, key)
    want = [k if isinstance(k, str) else None for k in keys]
    # Sequence 1 goes first (its third full block, unhashed, then y2, y1), then sequence 0's x2,
    # then x1, released last by sequence 2.
    assert want == [None, "y2", "y1", "x2", "x1"]
    assert be.cached_order() == want


# --- hybrid models: one KVCacheGroupSpec per group, windows released at the next allocation ---

def test_hybrid_config_has_one_group_spec_per_kvbench_group(vllm):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    be = hybrid()
    groups = be.manager.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec) for g in groups] == [SlidingWindowSpec, FullAttentionSpec]
    assert groups[0].kv_cache_spec.sliding_window == W
    assert [len(g.layer_names) for g in groups] == [2, 2]  # 4 layers, alternating kinds
    assert be.capabilities.groups and rule_set(be.capabilities).window_release == "next_allocation"


def test_a_window_is_released_at_the_next_allocation_on_the_length_before_it(vllm):
    be = hybrid()
    be.prefill(0, Prompt(71))
    led = be.ledger()
    # 9 = ceil(71 / 8) per group: vLLM releases nothing at the prefill (SPEC would keep 4)
    assert led.group_blocks == (9, 9) and led.blocks_used == 18
    be.append([0], [1])
    led = be.ledger()
    # remove_skipped_blocks on the 71 tokens before the append: 71 - 32 + 1 = 40 tokens skipped,
    # 40 // 8 = 5 blocks released; token 72 fills the tail (71 - 64 = 7 of 8), no new block.
    assert led.group_blocks == (9 - 5, 9) and led.blocks_used == 13
    assert [b.is_null for b in be.table(0, group=0)] == [True] * 5 + [False] * 4
    assert led.seq_blocks == {0: 13}  # 4 + 9: a released block is not held
    assert led.bytes_in_use == 13 * HB * get_model("tiny-hybrid").slot_bytes


def test_an_append_may_use_the_blocks_its_window_releases(vllm):
    be = hybrid(num_blocks=18)
    be.prefill(0, Prompt(71))  # 2 * 9 = 18 blocks: the pool is full
    be.append([0], [2])
    # 73 tokens: ceil(73 / 8) = 10 blocks per group, one new each; 5 released before (as above)
    assert be.ledger().group_blocks == (9 - 5 + 1, 10)
    assert be.ledger().blocks_free == 18 - 15  # 15 = 5 + 10


def test_a_refused_hybrid_append_releases_nothing(vllm):
    be = hybrid(num_blocks=18)
    be.prefill(0, Prompt(71))
    before = be.ledger().as_dict()
    with pytest.raises(OutOfMemory):  # ceil(121 / 8) = 16 blocks per group: 2 * 7 new, 0 + 5 free
        be.append([0], [50])
    assert be.ledger().as_dict() == before
    assert not any(b.is_null for b in be.table(0, group=0))  # the window blocks are still held


def test_a_hybrid_hit_takes_the_full_prefix_and_the_window_below_it(vllm):
    be = hybrid(caching=True)
    ids = list(range(100, 164))  # 64 = 8 * 8 tokens, every block full
    be.prefill(0, Prompt(64, token_ids=ids))
    be.free(0)
    assert be.ledger().cached_blocks == 16  # 8 blocks per group, each cached when full
    be.prefill(1, Prompt(72, token_ids=ids + list(range(500, 508))))
    led = be.ledger()
    # The hit: (72 - 1) // 8 = 8 blocks of the full group, and of the sliding group those that
    # cover [64 - 32 + 1, 64) = [33, 64): blocks 33 // 8 = 4 .. 7, so 4 + 8 = 12 hit blocks.
    assert led.prefix_hit_blocks == 12
    assert led.group_blocks == (4 + 1, 8 + 1)  # one new block each for tokens 64..71
    assert led.cached_blocks == 16 - 12  # the sliding group's blocks 0..3 stay cached, free


def test_salt_and_adapter_of_the_same_name_never_share(vllm):
    """SPEC §9 (vLLM issue 44701): vLLM's extra keys are tagged ("cache_salt", x), ("lora", x, path)."""
    be = hybrid(caching=True)
    ids = list(range(100, 124))  # 24 = 3 * 8
    be.prefill(0, Prompt(24, token_ids=ids, salt="x"))
    be.prefill(1, Prompt(24, token_ids=ids, adapter="x"))
    be.prefill(2, Prompt(24, token_ids=ids, salt="x"))
    # Sequence 1 hits nothing; sequence 2 hits sequence 0's (24 - 1) // 8 = 2 blocks in each group
    # (the sliding group's window below the hit, [max(0, 16 - 32 + 1), 16), starts at block 0).
    assert be.ledger().prefix_hit_blocks == 2 * 2


def test_under_specs_window_rule_vllm_diverges_at_the_first_prefill(vllm):
    """The declared rule is what holds vLLM: reset to SPEC's, hybrid-windows fails at once."""
    import dataclasses
    from impls.engines.vllm_kvmanager import VllmKVManager
    trace = load_traces([p for p in committed_workloads() if p.stem == "hybrid-windows"])[0]
    be = VllmKVManager(config_for(trace, policy=None))
    be.capabilities = dataclasses.replace(be.capabilities, rule_params={
        **be.capabilities.rule_params, "window_release": "end_of_operation"})
    assert trace.ops[0].tokens == 71 and trace.header.settings["block_size"] == HB
    v = check(trace, be)
    d = v.divergence
    assert v.valid is False and d.step == 0 and d.quantity == "blocks_used"
    # A 71-token prompt at B = 8: 9 = ceil(71 / 8) blocks per group; SPEC keeps the sliding
    # group's blocks from 5 = (71 - 32 + 1) // 8 on, 9 + (9 - 5) = 13; vLLM holds 9 + 9 = 18.
    assert (d.expected, d.actual) == (13, 18)


def test_the_serving_default_is_held_to_its_sparse_retention_and_fails_specs_rule(vllm):
    """tests/checking/test_oracle_window_retention.py counts the trace: sequence 0 (64 tokens) leaves its
    sliding blocks 3..6 cached only; sequence 1 diverges after 5 blocks and keeps the window
    below that junction; sequence 2 hits through it."""
    from impls.engines.vllm_kvmanager import VllmKVManager
    from test_oracle_window_retention import config, retention_trace
    trace = retention_trace()
    be = VllmKVManager(config())
    assert rule_set(be.capabilities).sparse_window_retention
    v = check(trace, be)
    assert v.valid is True, str(v.divergence)
    assert be.ledger().cached_blocks == 31 and be.ledger().prefix_hit_blocks == 9
    spec = VllmKVManager(config())
    spec.capabilities = dataclasses.replace(spec.capabilities, rule_params={
        **spec.capabilities.rule_params, "sparse_window_retention": False})
    d = check(trace, spec).divergence
    # At the first free: SPEC caches 8 + 8 = 16 blocks, vLLM the full group's 8 and 4 of the window.
    assert (d.step, d.quantity, d.expected, d.actual) == (1, "cached_blocks", 16, 8 + 4)


def test_dense_retention_is_held_to_specs_rule_on_the_same_trace(vllm):
    from impls.engines.vllm_kvmanager import VllmKVManagerDense
    from test_oracle_window_retention import config, retention_trace
    be = VllmKVManagerDense(config())
    assert not rule_set(be.capabilities).sparse_window_retention
    assert check(retention_trace(), be).valid is True


@pytest.mark.parametrize("dense", [False, True], ids=["serving-default", "dense"])
@pytest.mark.parametrize("B", [4, 16])
@pytest.mark.parametrize("pattern", [(5, None), (17,), (40, 83, None), (9, 33)],
                         ids=["mix", "sliding-only", "two-windows", "two-windows-no-full"])
def test_hybrid_traces_check_clean_over_windows_and_block_sizes(vllm, pattern, B, dense):
    """Windows below, at and across block boundaries, models with and without a full group,
    under each retention and its rule."""
    import impls.engines.vllm_kvmanager as adapters
    VllmKVManager = adapters.VllmKVManagerDense if dense else adapters.VllmKVManager
    from kvbench.contract.formulas import ModelSpec, hybrid_groups
    from kvbench.traces.hybrid import hybrid_windows
    layers = 2 * len(pattern)
    model = ModelSpec("windows", layers=layers, kv_heads=1, head_dim=4,
                      groups=hybrid_groups(layers, pattern))
    trace = hybrid_windows(0, num_requests=20, block_size=B, budget_fraction=0.5)
    cfg = CacheConfig(model=model, block_size=B, store_kv=False, prefix_caching=True,
                      num_blocks=trace.header.settings["num_blocks"] * len(pattern) // 2 + 8)
    v = check(trace, VllmKVManager(cfg))
    assert v.valid is True, str(v.divergence)


def test_bug_candidate_a_one_token_window_turns_off_every_prefix_hit(vllm):
    """results/engines/vllm-kvmanager, bug candidate 1, pinned: vLLM caches no block of a
    sliding(1) group (reachable_block_mask: a hit needs cdiv(1 - 1, B) = 0 blocks, so none is
    reachable) yet its hit search needs one cached block at the hit's end, so a model with such a
    group never hits. SPEC §8: the group needs no block, the full group's 2 blocks hit."""
    from impls.engines.vllm_kvmanager import VllmKVManager
    from kvbench.contract.formulas import ModelSpec, hybrid_groups
    model = ModelSpec("w1", layers=2, kv_heads=1, head_dim=4, groups=hybrid_groups(2, (1, None)))
    be = VllmKVManager(CacheConfig(model=model, block_size=4, num_blocks=16, store_kv=False,
                                   prefix_caching=True))
    ids = list(range(100, 108))
    be.prefill(0, Prompt(8, token_ids=ids))
    be.free(0)
    assert be.ledger().cached_blocks == 2  # SPEC: 2 * 8 // 4 = 4, vLLM: the full group's 2
    be.prefill(1, Prompt(12, token_ids=ids + [200, 201, 202, 203]))
    led = be.ledger()
    assert led.prefix_hit_blocks == 0  # SPEC: 2 = 8 // 4 (the full group's), sliding(1): none
    assert led.group_blocks == (3, 3)  # SPEC: (12 // 4 - 2, 12 // 4) = (1, 3)


# --- SPEC §12's kinds: vLLM's specs through its hybrid coordinator ---------------------------

def variant(name):
    return load_traces([p for p in committed_workloads() if p.stem == name])[0]


@pytest.mark.parametrize("name,caching", [("variant-chunked", True), ("variant-chunked", False),
                                          ("variant-mla", True), ("variant-mla", False),
                                          ("variant-mamba", False)])
def test_chunked_mla_and_mamba_groups_check_clean_through_the_hybrid_coordinator(vllm, name, caching):
    from impls.engines.vllm_kvmanager import VllmKVManager
    trace = variant(name)
    be = VllmKVManager(config_for(trace, policy=None, prefix_caching=caching))
    managers = [type(m).__name__ for m in be.manager.coordinator.single_type_managers]
    kinds = {"variant-chunked": ["ChunkedLocalAttentionManager"] * 3 + ["FullAttentionManager"],
             "variant-mla": ["FullAttentionManager"],  # MLAAttentionSpec: full attention
             "variant-mamba": ["MambaManager"] * 3 + ["FullAttentionManager"]}[name]
    assert managers == kinds
    v = check(trace, be)
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(trace.ops)


def _manager_of(specs, num_blocks=64, caching=True):
    """vLLM's KVCacheManager over groups of these specs, one layer each, block size 8."""
    from impls.engines import vllm_kvmanager as VK
    v = VK._vllm()
    groups = [v.KVCacheGroupSpec([f"model.layers.{i}.self_attn"], spec) for i, spec in enumerate(specs)]
    config = v.KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=groups)
    return v.KVCacheManager(config, max_model_len=VK.MAX_MODEL_LEN, scheduler_block_size=8,
                            hash_block_size=8, enable_caching=caching)


def _admit(mgr, rid, ids):
    from impls.engines import vllm_kvmanager as VK
    v = VK._vllm()
    req = v.Request(request_id=rid, prompt_token_ids=ids, sampling_params=v.SamplingParams(max_tokens=8),
                    pooling_params=None, block_hasher=v.utils.get_request_block_hasher(8, v.sha256))
    computed, hit, _ = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, len(ids) - hit, hit, computed) is not None
    return req, hit


def test_mamba_align_mode_caches_no_state_from_a_prefill_in_one_allocation(vllm):
    """Why the adapter computes a prompt in the chunks vLLM's scheduler splits it into: vLLM's
    "align" mode allocates only the block of the last token, so a prompt computed in one
    allocate_slots leaves no state at a block boundary, and the same prompt again hits nothing.
    SPEC §12: the states at 8 .. 56 cached, a hit of (61 - 1) // 8 = 7 blocks."""
    from impls.engines.vllm_kvmanager import group_spec
    cfg = CacheConfig(model=get_model("tiny-mamba"), block_size=8, num_blocks=64, store_kv=False,
                      prefix_caching=True)
    state, full = (group_spec(cfg, g) for g in cfg.model.kv_groups[2:])
    assert state.mamba_cache_mode == "align"  # vLLM 0.33's only mode with prefix caching
    mgr = _manager_of([state, full])
    ids = list(range(1000, 1061))
    req, _ = _admit(mgr, "0", ids)
    table = mgr.coordinator.single_type_managers[0].req_to_blocks["0"]
    assert [b.is_null for b in table] == [True] * 7 + [False]  # ceil(61 / 8) = 8: the last alone
    mgr.free(req)
    _, hit = _admit(mgr, "1", ids)
    assert hit == 0


def test_vllm_refuses_mamba_prefix_caching_in_any_mode_but_align(vllm):
    """mamba_cache_mode "all" (a state at every block) is not in vLLM 0.33: MambaCacheMode is
    "align" | "none", and MambaManager asserts align whenever prefix caching is on."""
    import typing
    from vllm.config.cache import MambaCacheMode
    from impls.engines.vllm_kvmanager import group_spec
    assert set(typing.get_args(MambaCacheMode)) == {"align", "none"}
    cfg = CacheConfig(model=get_model("tiny-mamba"), block_size=8, num_blocks=64, store_kv=False)
    state = group_spec(cfg, cfg.model.kv_groups[0])
    for mode in ("none", "all"):
        with pytest.raises(AssertionError, match="requires mamba_cache_mode='align'"):
            _manager_of([dataclasses.replace(state, mamba_cache_mode=mode)])


def _mamba_backend(num_blocks=64, cls=None):
    from impls.engines.vllm_kvmanager import VllmKVManager
    return (cls or VllmKVManager)(CacheConfig(model=get_model("tiny-mamba"), block_size=8,
                                              num_blocks=num_blocks, store_kv=False,
                                              prefix_caching=True))


def _state_positions(be, seq):
    """The positions of a sequence's first state group that hold a block."""
    return [i for i, b in enumerate(be.table(seq, 0)) if not b.is_null]


def test_align_mode_caches_the_state_at_the_prompts_last_boundary_and_a_resend_hits_it(vllm):
    """tiny-mamba (3 state groups, 1 full), B = 8, a 61-token prompt. vLLM's scheduler ends the
    first chunk at c = (61 - 1) // 8 = 7 blocks (56 tokens) and the second at 61: the state
    groups hold positions c - 1 = 6 and ceil(61 / 8) - 1 = 7 only, the state at 56 cached. The
    same prompt again hits 7 blocks: the full group's 0..6 and each state group's block 6,
    7 + 3 = 10 hit blocks."""
    be = _mamba_backend()
    ids = list(range(1000, 1061))
    be.prefill(0, Prompt(61, token_ids=ids))
    assert _state_positions(be, 0) == [6, 7]
    # full: ceil(61 / 8) = 8 blocks; each state group 2: 8 + 3 * 2 = 14
    assert be.ledger().blocks_used == 14
    be.free(0)
    be.prefill(1, Prompt(61, token_ids=ids))
    assert be.ledger().prefix_hit_blocks == 7 + 3


def test_align_mode_caches_the_junction_state_for_the_next_sibling(vllm):
    """A 70-token prompt sharing its first 40 tokens with a cached 61-token one: the full group
    hits 40 // 8 = 5 blocks, the state groups (states cached at 56 only) none, so the hit is 0
    and the junction is 40: the scheduler stops a chunk there, caching the state at 40. A third
    prompt sharing those 40 tokens then hits 5 blocks in every group: 5 + 3 = 8 hit blocks."""
    be = _mamba_backend()
    ids = list(range(1000, 1061))
    be.prefill(0, Prompt(61, token_ids=ids))
    be.prefill(1, Prompt(70, token_ids=ids[:40] + list(range(3000, 3030))))
    assert be.ledger().prefix_hit_blocks == 0
    # c = (70 - 1) // 8 = 8 and ceil(70 / 8) = 9: positions 7 and 8; the junction's 4 released
    assert _state_positions(be, 1) == [7, 8]
    be.prefill(2, Prompt(70, token_ids=ids[:40] + list(range(4000, 4030))))
    assert be.ledger().prefix_hit_blocks == 5 + 3


def test_align_mode_checks_clean_through_the_checker_on_hand_traces(vllm):
    """The hand traces above, under the oracle's ``state_checkpoints="align"``: every ledger
    figure after every operation, the junction's state included."""
    ids = list(range(1000, 1061))
    trace = validate(Trace(Header(family="test", settings={"block_size": 8, "model": "tiny-mamba",
                                                            "num_blocks": 64, "prefix_caching": True}), [
        Prefill(0, 0, "a", 61, token_ids=tuple(ids)), Free(1, 0),
        Prefill(2, 1, "a", 61, token_ids=tuple(ids)),
        Prefill(3, 2, "a", 70, token_ids=tuple(ids[:40] + list(range(3000, 3030)))),
        Prefill(4, 3, "a", 70, token_ids=tuple(ids[:40] + list(range(4000, 4030)))),
        Append(5, (1, 2, 3), (1, 6, 9)), Fork(6, 4, 3), Free(7, 1), Free(8, 2)], name="hand"))
    from impls.engines.vllm_kvmanager import VllmKVManager
    be = VllmKVManager(config_for(trace, policy=None, prefix_caching=True))
    v = check(trace, be)
    assert v.valid is True, str(v.divergence)
    assert be.capabilities.rule_params.get("fork_via") == "prefix"
    assert rule_set(be.capabilities).state_checkpoints == "align"


def test_bug_candidate_vllms_sink_attention_manager_cannot_be_built(vllm):
    """Why sinks(S, W) is not mapped. vLLM's SinkFullAttentionSpec (static sinks, K/V outside the
    request's blocks: static_sink_attention.py) runs SinkFullAttentionManager, a
    FullAttentionManager that releases nothing, where sinks(8, 24) at 100 tokens holds 5 blocks;
    and at the pinned version vLLM's own get_manager_for_kv_cache_spec cannot build it (its
    __init__ takes no needs_kv_cache_zeroing)."""
    import torch
    from vllm.v1.core.single_type_kv_cache_manager import (FullAttentionManager,
                                                           SinkFullAttentionManager)
    from vllm.v1.kv_cache_interface import SinkFullAttentionSpec
    from kvbench.contract import formulas as F
    assert issubclass(SinkFullAttentionManager, FullAttentionManager)
    assert "remove_skipped_blocks" not in vars(SinkFullAttentionManager)
    # 5: the sinks' block 0 and the window's from (100 - 24 + 1) // 8 = 9 to 12; full: 13
    assert F.held_blocks(100, F.KVGroup((0,), sinks=(8, 24)), 8) == [0, 9, 10, 11, 12]
    spec = SinkFullAttentionSpec(block_size=8, num_kv_heads=2, head_size=8, dtype=torch.float16,
                                 sink_len=8)
    with pytest.raises(TypeError, match="needs_kv_cache_zeroing"):
        _manager_of([spec], caching=False)


def _page(spec_name, **kw):
    import torch
    from vllm.v1 import kv_cache_interface as K
    kw.setdefault("dtype", torch.bfloat16)
    return getattr(K, spec_name)(block_size=16, **kw).page_size_bytes


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "deepseek-v3-fp8", "llama-4-scout",
                                  "gpt-oss-20b", "gpt-oss-120b", "qwen3-next-80b-a3b", "jamba-v0.1",
                                  "gemma-3-12b", "llama-3-8b-fp8", "llama-3-8b-fp8-token-head",
                                  "tiny-mamba", "tiny-chunked", "tiny-mla"])
def test_vllms_page_size_bytes_of_each_preset_are_kvbenchs_block_over_a_groups_layers(vllm, name):
    """vLLM's own page_size_bytes of each group's spec (as its attention layers build them) times
    L_group is kvbench's block bytes at B = 16; a state group's page is its state's bytes."""
    import torch
    from impls.engines.vllm_kvmanager import group_spec
    from kvbench.contract import formulas as F
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec
    m = get_model(name)
    cfg = CacheConfig(model=m, block_size=16, num_blocks=8, store_kv=False)
    for g in m.kv_groups:
        if g.state_bytes is not None:
            spec = group_spec(cfg, g)
            if name == "qwen3-next-80b-a3b":  # Gated DeltaNet: conv (3, 8192), ssm (32, 128, 128)
                spec = dataclasses_replace(spec, shapes=((3, 8192), (32, 128, 128)),
                                           dtypes=(torch.bfloat16,) * 2)
            elif name == "jamba-v0.1":  # Mamba: conv (8192, 3), ssm (8192, 16)
                spec = dataclasses_replace(spec, shapes=((8192, 3), (8192, 16)),
                                           dtypes=(torch.bfloat16,) * 2)
            assert spec.page_size_bytes == g.state_bytes, g.kind
            continue
        if m.kv_encoding == "fp8-per-token-head":  # Triton's inline fp32 scale per head
            spec = TritonAttentionBackend.customize_spec(FullAttentionSpec(
                block_size=16, num_kv_heads=m.kv_heads, head_size=m.head_dim,
                dtype=torch.float8_e4m3fn, kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD))
        elif g.latent_bytes is not None:  # as MLAAttention builds fp8_ds_mla's spec
            spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=g.latent,
                                    dtype=torch.uint8, cache_dtype_str="fp8_ds_mla",
                                    state_content_bytes=656)
        elif m.kv_encoding == "fp8":
            spec = FullAttentionSpec(block_size=16, num_kv_heads=m.kv_heads, head_size=m.head_dim,
                                     dtype=torch.float8_e4m3fn)
        else:
            spec = group_spec(cfg, g)
        assert len(g.layers) * spec.page_size_bytes == F.block_bytes(16, m), (g.kind, type(spec).__name__)


def dataclasses_replace(spec, **kw):
    import dataclasses
    return dataclasses.replace(spec, **kw)


# --- scheduler lifecycles (SPEC §13) ----------------------------------------------------------

def test_a_rollback_keeps_the_blocks_past_the_length_for_the_next_drafts(vllm):
    be = manager(num_blocks=8)
    be.prefill(0, Prompt(20))  # ceil(20 / 16) = 2 blocks
    be.append([0], [17], draft=[16])  # 37 tokens: 3 blocks
    be.accept(0, 2, drafted=16)  # 37 - (16 - 2) = 23 tokens; vLLM frees nothing
    led = be.ledger()
    assert (led.tokens, led.seq_blocks, led.blocks_used, led.token_states) == ({0: 23}, {0: 3}, 3, 23)
    be.append([0], [12])  # 35 tokens: ceil(35 / 16) = 3 blocks, the kept one written
    assert (be.ledger().blocks_used, be.ledger().token_states) == (3, 35)


def test_a_chunked_prompt_is_one_request_its_blocks_cached_once_computed(vllm):
    be = manager(num_blocks=8, caching=True)
    be.prefill(0, Prompt(24, block_hashes=("h0", "h1"), prompt_tokens=40))  # 24 of 40 computed
    be.prefill(1, Prompt(40, block_hashes=("h0", "h1")))  # between the chunks: h0 alone is complete
    assert be.ledger().prefix_hit_blocks == 1


def test_a_block_completed_by_kept_drafts_is_cached_at_the_next_allocation(vllm):
    # 0: 14 + 5 = 19 tokens, ceil(19 / 16) = 2 blocks, drafts at 15 .. 18; the accept keeps all
    # 4, so block 0 (positions 0 .. 15) is full of kept tokens. vLLM caches it at the request's
    # next allocate_slots (the append's caps what it caches at num_tokens = 14 + 1 = 15 < 16, and
    # the accept allocates nothing): declared, kept_drafts_cached_at_next_append. The fork, a
    # new request of 19 tokens through the prefix cache, then computes both blocks: 2 + 2 = 4 in
    # use. Held to SPEC's rule instead (cached at the accept), it would hit block 0: 2 + 1 = 3.
    trace = make_trace(P(0, 14), Append(0, (0,), (5,), (4,)), Accept(0, 0, 4), Fork(0, 1, 0), X(1), X(0))
    assert check(trace, manager(num_blocks=8, caching=True)).valid is True
    undeclared = manager(num_blocks=8, caching=True)
    undeclared.capabilities = dataclasses.replace(undeclared.capabilities, rule_params={
        **undeclared.capabilities.rule_params, "kept_drafts_cached_at_next_append": False})
    v = check(trace, undeclared)
    d = v.divergence
    assert (v.valid, d.step, d.quantity, d.expected, d.actual) == (False, 3, "blocks_used", 3, 4)
    # with another append first (its allocate_slots caches block 0) the fork hits it
    trace = make_trace(P(0, 14), Append(0, (0,), (5,), (4,)), Accept(0, 0, 4), Append(0, (0,), (1,)),
                       Fork(0, 1, 0), X(1), X(0))
    assert check(trace, manager(num_blocks=8, caching=True)).valid is True


def test_align_mode_fuzz_findings_check_clean_and_a_chunked_prompt_is_not_applicable(vllm):
    """Two kvbench fuzz findings (seed 0, --model-shapes), fixed in the oracle's align rule
    (tests/checking/test_oracle_mamba_align.py has their figures): the later chunks of a split
    prefill release a chunked group's blocks too, and an append across several blocks takes one
    state block. A chunked prompt on a Mamba model with prefix caching is n/a: the scheduler's
    split of one is not driven."""
    from test_oracle_mamba_align import long_append_trace, split_prefill_trace
    from impls.engines.vllm_kvmanager import VllmKVManager
    for trace in (split_prefill_trace(), long_append_trace()):
        v = check(trace, VllmKVManager(config_for(trace, policy=None)))
        assert v.valid is True, str(v.divergence)
    chunked = validate(Trace(Header(family="test", settings={
        "model": "tiny-hybrid", "block_size": 1, "num_blocks": 40, "prefix_caching": True},
        groups=("full", "state(192)")), [Prefill(0, 0, "a", 1, token_ids=tuple(range(18)),
                                                 prompt_tokens=18)], name="hand"))
    v = check(chunked, VllmKVManager(config_for(chunked, policy=None)))
    assert v.valid is None and "chunk" in v.not_applicable, v.not_applicable


@pytest.mark.xfail(strict=True, reason="the oracle takes a split prefill's blocks before its later "
                                       "chunks' releases; vLLM after them (docs/engines.md)")
def test_gap_a_tight_pool_evicts_a_cached_block_vllm_keeps_in_a_split_prefill(vllm):
    """kvbench fuzz --model-shapes --seed 1, finding 07, shrunk: groups sliding(6), two states,
    chunked(4), B = 3, 21 blocks. Request 1 (10 tokens) runs as chunks [0, 9) and [9, 10); the
    second chunk's releases (the window's block 0, the chunk's 0 and 1) go back before it
    allocates, so vLLM needs no eviction and keeps request 0's cached chunked block: 3 cached
    blocks. The oracle takes all 12 new blocks first, 12 free counting that cached one, evicts
    it, then releases: 2."""
    from impls.engines.vllm_kvmanager import VllmKVManager
    trace = validate(Trace(Header(family="test", settings={
        "model": "tiny-hybrid", "block_size": 3, "num_blocks": 21, "prefix_caching": True},
        groups=("sliding(6)", "state(191)", "state(191)", "chunked(4)")), [
        Prefill(0, 0, "b", 7, token_ids=tuple(range(7)), salt="s1", adapter="a1"),
        Prefill(1, 1, "a", 10, ("p2.0", "p2.1", "r2.2"))], name="hand"))
    v = check(trace, VllmKVManager(config_for(trace, policy=None)))
    assert v.valid is True, str(v.divergence)
