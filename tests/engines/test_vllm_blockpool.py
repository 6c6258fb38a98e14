"""vLLM's own v1 BlockPool behind the protocol (impls/engines/vllm_blockpool.py), and where vLLM differs.

vLLM is opt-in (a separate venv, see docs/engines.md for its recipe); CI does not install it, so every test
that needs it is skipped there. Run them with::

    /work/vllm-env/bin/python -m pytest tests/engines/test_vllm_blockpool.py

The first test needs no vLLM: without it the backend is listed unavailable, with the recipe.
The last ones drive vLLM's KVCacheManager (the layer above the pool, which the adapter does not
use) to pin down the two behaviours kvbench's traces cannot express: the T - 1 cap on a prefix
hit and the caching of blocks filled by decode.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import engine_lifecycle_na, make_config

from impls.engines.vllm_blockpool import NOT_INSTALLED, VllmBlockPool
from kvbench.analyses import prefix
from kvbench.checking.checker import check
from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.contract.protocol import Backend, OutOfMemory, Prompt
from kvbench.traces.format import Free, Header, Prefill, Trace, validate
from kvbench.traces.loaders import Request, load_requests

SKIP_REASON = "vLLM is not installed (opt-in, not in CI): see docs/engines.md for its recipe"
TRACES = Path(os.environ.get("KVBENCH_TRACES", Path(__file__).resolve().parents[3] / "shared" / "traces"))
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
B = 16


@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm", reason=SKIP_REASON)


def pool(num_blocks=8, caching=False):
    return VllmBlockPool(make_config(block_size=B, num_blocks=num_blocks, store_kv=False,
                                     prefix_caching=caching))


def refs(backend, seq):
    return [b.ref_cnt for b in backend.tables[seq]]


def hashed_trace(*ops, name="hashed"):
    """Prefill (seq, tokens, hashes) / free seq, numbered 0, 1, 2, ..."""
    out = []
    for step, op in enumerate(ops):
        out.append(Prefill(step, op[0], "a", op[1], tuple(op[2])) if isinstance(op, tuple)
                   else Free(step, op))
    return validate(Trace(Header(family="test", settings={"block_size": B}), out, name=name))


# --- without vLLM ----------------------------------------------------------------------------

# Makes `import vllm` fail as it does where vLLM is not installed, in either venv.
NO_VLLM = textwrap.dedent("""
    import sys

    class NoVllm:
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoVllm())
    from kvbench.cli import main
    main(["list"])
    print("exit", main(["check", sys.argv[1], "--backend", "vllm-blockpool", "--policy", "none"]))
    print("exit", main(["check", sys.argv[1], "--backend", "vllm-blockpool", "--policy", "none",
                        "--allow-unavailable"]))
""")


def test_without_vllm_the_backend_is_listed_unavailable_with_the_recipe(tmp_path):
    got = subprocess.run([sys.executable, "-c", NO_VLLM, str(committed_workloads()[0])],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert got.returncode == 0, got.stderr
    line = next(ln for ln in got.stdout.splitlines() if ln.startswith("vllm-blockpool"))
    assert line.split()[1:4] == ["built-in", "no", "vllm"]
    assert NOT_INSTALLED in line  # "vllm is not installed: its opt-in recipe is in docs/engines.md"
    # Named, it is an error (exit 2) that says why; allowed, it is not applicable, never passed.
    assert f"kvbench: error: --backend vllm-blockpool: {NOT_INSTALLED}" in got.stderr
    assert [ln for ln in got.stdout.splitlines() if ln.startswith("exit")] == ["exit 2", "exit 2"]
    assert "n/a  vllm-blockpool policy=- ops=0" in got.stdout
    assert f"not applicable: {NOT_INSTALLED}" in got.stdout


# --- the adapter under the checker ------------------------------------------------------------

@pytest.mark.parametrize("path", committed_workloads(), ids=lambda p: p.stem)
def test_checks_clean_on_every_committed_workload(vllm, path):
    trace = load_traces([path])[0]
    config = config_for(trace, policy=None)
    v = check(trace, VllmBlockPool(config))
    if config.model.hybrid:  # the pool adapter declares one full-attention group
        assert v.valid is None and "does not run KV cache groups" in v.not_applicable
        return
    if trace.header.tiers:  # nor lower tiers (SPEC §11)
        assert v.valid is None and "does not declare tiers" in v.not_applicable
        return
    if engine_lifecycle_na(trace, v):  # nor chunked prompts or drafts (SPEC §13)
        return
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(trace.ops)
    # What the pool adapter cannot show the checker, each named (SPEC §10's figures); its block
    # structures are vLLM's free queue and reference counts, checked.
    assert v.skipped == {"kv content": "backend holds no K/V",
                         "figures": "not reported: block_usage, slot_usage, token_capacity"}


def test_an_eviction_policy_is_not_applicable(vllm):
    trace = load_traces([committed_workloads()[0]])[0]
    v = check(trace, VllmBlockPool(config_for(trace, policy="lru")))
    assert v.valid is None
    assert v.not_applicable == ("vllm-blockpool does not implement eviction policy 'lru' "
                                "(SPEC §5), and the run evicts under it")


def test_prefix_cache_trace_checks_clean_and_counts_hits(vllm):
    hand = [Request(arrival=0.0, prompt_tokens=tokens, output_tokens=1, block_hashes=tuple(ids),
                    hash_block_size=512) for tokens, ids in
            [(1024, [1, 2]), (1536, [1, 2, 3]), (1024, [1, 4])]]
    trace = prefix.cache_trace(hand, 512)
    cfg = make_config(block_size=512, num_blocks=3, store_kv=False, prefix_caching=True)
    v = check(trace, VllmBlockPool(cfg), gather="none")
    assert v.valid is True, str(v.divergence)
    # Request 2 finds blocks 1 and 2, request 3 finds block 1: 2 + 1 = 3 hits.
    assert v.final_ledger["prefix_hit_blocks"] == 3


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"shared trace not found: {MOONCAKE}")
@pytest.mark.parametrize("cache_blocks", [300, 1000])
def test_mooncake_prefix_cache_checks_clean(vllm, cache_blocks):
    trace = prefix.cache_trace(load_requests(str(MOONCAKE), "mooncake")[:300], 512)
    cfg = make_config(block_size=512, num_blocks=cache_blocks, store_kv=False, prefix_caching=True)
    v = check(trace, VllmBlockPool(cfg), gather="none")
    assert v.valid is True, str(v.divergence)
    assert v.final_ledger["prefix_hit_blocks"] > 0


# --- hand-worked ledgers ----------------------------------------------------------------------

def test_null_block_is_added_so_that_n_blocks_are_usable(vllm):
    from vllm.v1.core.block_pool import BlockPool
    raw = BlockPool(num_gpu_blocks=4, enable_caching=False, hash_block_size=B)
    assert raw.get_num_free_blocks() == 3  # 3 = 4 - 1: vLLM keeps block 0 as its null block
    be = pool(num_blocks=4)
    assert be.pool.num_gpu_blocks == 5  # 5 = 4 + 1: the adapter adds the null block
    assert be.ledger().blocks_free == 4
    be.prefill(0, Prompt(64))  # 64 = 4 * 16: every usable block
    led = be.ledger()
    assert (led.blocks_used, led.blocks_free, led.capacity_slots) == (4, 0, 64)
    assert 0 not in [b.block_id for b in be.tables[0]]  # the null block is never handed out
    with pytest.raises(OutOfMemory):
        be.prefill(1, Prompt(1))
    be.free(0)
    assert be.ledger().blocks_free == 4


def test_fork_is_touch(vllm):
    be = pool()
    be.prefill(0, Prompt(40))  # 3 blocks: 40 = 2 * 16 + 8
    be.fork(1, 0)
    assert refs(be, 0) == refs(be, 1) == [2, 2, 2]
    assert be.tables[1] == be.tables[0]
    led = be.ledger()
    assert (led.blocks_used, led.shared_blocks, led.tokens) == (3, 3, {0: 40, 1: 40})
    be.free(0)
    assert refs(be, 1) == [1, 1, 1]
    assert (be.ledger().blocks_used, be.ledger().shared_blocks) == (3, 0)


def test_copy_on_write_in_a_batch(vllm):
    be = pool()
    be.prefill(0, Prompt(40, final_tokens=41))
    be.fork(1, 0, final_tokens=41)
    be.fork(2, 0, final_tokens=41)
    shared_tail = be.tables[0][-1]
    be.append([0, 1, 2], [1, 1, 1])
    # The tail has 3 sharers: writers 0 and 1 copy it (ref 3 -> 2 -> 1), writer 2 writes in place.
    assert be.tables[2][-1] is shared_tail and shared_tail.ref_cnt == 1
    assert be.tables[0][-1] is not shared_tail and be.tables[1][-1] is not shared_tail
    assert refs(be, 0) == [3, 3, 1]  # the two full blocks stay shared by all three
    led = be.ledger()
    assert led.blocks_used == 5  # 5 = 3 + 2 copies
    assert led.shared_blocks == 2
    assert led.token_states == 59  # 59 = 2 * 16 shared + 3 tails * (40 + 1 - 32)
    assert led.free_slots == 21  # 21 = 5 * 16 - 59
    assert led.reservation == 0  # every sequence is at its final length


def test_out_of_memory_is_atomic(vllm):
    be = pool(num_blocks=4)
    be.prefill(0, Prompt(40))  # 3 of 4 blocks
    be.fork(1, 0)
    before, counts = be.ledger().as_dict(), [b.ref_cnt for b in be.pool.blocks]
    # Writer 0 copies the shared tail (1 block); writer 1, then its only holder, fills its 8 free
    # slots and spills 17 - 8 = 9 tokens into 1 new block: 2 blocks needed, 1 free.
    with pytest.raises(OutOfMemory):
        be.append([0, 1], [1, 17])
    assert be.ledger().as_dict() == before
    assert [b.ref_cnt for b in be.pool.blocks] == counts
    be.append([1], [8])  # fits: 8 free slots in a shared tail, 1 copy
    assert be.ledger().blocks_used == 4


def test_prefix_cache_hits(vllm):
    be = pool(num_blocks=4, caching=True)
    be.prefill(0, Prompt(40, block_hashes=[1, 2]))  # 3 blocks, the 2 full ones hashed
    be.free(0)
    led = be.ledger()
    assert (led.blocks_free, led.cached_blocks) == (4, 2)  # freed hashed blocks stay cached
    # 48 tokens = 3 full blocks: 1 and 2 hit, 3 is new. Hits on freed blocks take them back out of
    # the free queue: 2 hits + 1 new = 3 of 4 free.
    be.prefill(1, Prompt(48, block_hashes=[1, 2, 3]))
    led = be.ledger()
    assert (led.blocks_used, led.prefix_hit_blocks, led.cached_blocks) == (3, 2, 0)
    be.prefill(2, Prompt(20, block_hashes=[1]))  # 2 blocks: 1 hit (shared), 1 new
    led = be.ledger()
    assert (led.blocks_used, led.shared_blocks, led.prefix_hit_blocks) == (4, 1, 3)
    assert refs(be, 2) == [2, 1]
    # Hits on freed cached blocks take them out of the free queue, so they count against it.
    be.free(1)
    be.free(2)
    led = be.ledger()
    assert (led.blocks_free, led.cached_blocks) == (4, 3)  # hashes 1, 2, 3 cached; 1 block plain
    before = led.as_dict()
    with pytest.raises(OutOfMemory):
        be.prefill(3, Prompt(80, block_hashes=[1, 2, 3, 4, 5]))  # 3 hits + 2 new = 5 > 4 free
    assert be.ledger().as_dict() == before
    be.prefill(3, Prompt(64, block_hashes=[1, 2, 3, 4]))  # 3 hits + 1 new = 4: fits
    led = be.ledger()
    assert (led.blocks_free, led.cached_blocks, led.prefix_hit_blocks) == (0, 0, 6)  # 6 = 3 + 3


# --- the known divergence: vLLM does not deduplicate block hashes -----------------------------

def test_checker_reports_a_hash_registered_twice(vllm):
    # Hash 7 names seq 0's block; seq 1's prompt misses on 9 (a hit stops at the first miss), so
    # its block under 7 is a new one. vLLM registers it under 7 as well (BlockHashToBlockMap keeps
    # both, "we don't de-duplicate"); kvbench's model keeps one block per hash.
    trace = hashed_trace((0, 16, [7]), (1, 32, [9, 7]), 1, 0, name="hash-twice")
    cfg = make_config(block_size=B, num_blocks=8, store_kv=False, prefix_caching=True)
    from impls.numpy_paged import NumpyPaged
    assert check(trace, NumpyPaged(cfg)).valid is True  # the formulas' model
    v = check(trace, VllmBlockPool(cfg))
    assert v.valid is False
    d = v.divergence
    # Its KV events (SPEC §14) show it first: at seq 1's prefill (op #1) vLLM announces a
    # BlockStored of 7 while 7 is present.
    assert (d.index, d.op["op"], d.quantity, d.expected) == (
        1, "prefill", "event order", "a key is stored at most once while present")
    # Without them, at the free of seq 1 (op #2): the oracle caches 9's block only (1); vLLM
    # caches 9's and its second block under 7 (2). Nothing else differs: same blocks used, free
    # and hit.
    silent = type("Silent", (VllmBlockPool,), {"events": Backend.events})
    d = check(trace, silent(cfg)).divergence
    assert (d.index, d.op["op"], d.quantity, d.expected, d.actual) == (2, "free", "cached_blocks", 1, 2)


def test_chained_hashes_never_register_twice(vllm):
    # Hashes as kvbench's loaders define them (an id names its block and its whole prefix): a
    # cached block's prefix is freed after it (tables are freed tail first), so it is evicted
    # after it, and a prompt never misses a block and then finds a later one cached. Random
    # prefix trees, small caches with eviction of cached blocks: vLLM agrees with the oracle.
    import random
    for seed in range(100):
        rng = random.Random(seed)
        ops, live, seq = [], [], 0
        for step in range(60):
            if live and rng.random() < 0.45:
                ops.append(Free(step, live.pop(rng.randrange(len(live)))))
                continue
            path = tuple(rng.randint(0, 2) for _ in range(rng.randint(1, 5)))
            hashes = tuple(hash(path[:i + 1]) for i in range(len(path)))
            ops.append(Prefill(step, seq, "a", len(path) * 4 + rng.randint(0, 3), hashes))
            live.append(seq)
            seq += 1
        trace = validate(Trace(Header(family="test"), ops, name=f"chained-{seed}"))
        cfg = make_config(block_size=4, num_blocks=rng.randint(6, 20), store_kv=False, prefix_caching=True)
        v = check(trace, VllmBlockPool(cfg), gather="none")
        assert v.valid is True, str(v.divergence)


# --- vLLM's KVCacheManager: what the adapter (and kvbench's traces) leave out ------------------

@pytest.fixture
def manager(vllm):
    """vLLM's KVCacheManager over 10 usable blocks of 16 tokens, prefix caching on (vLLM 0.33)."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.request import Request as VllmRequest

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=11, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    m = KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=B, hash_block_size=B,
                       enable_caching=True)
    hasher = get_request_block_hasher(B, sha256)

    def admit(rid, token_ids):
        """A request's prefill as the scheduler does it: look up the cache, allocate the rest."""
        r = VllmRequest(str(rid), token_ids, SamplingParams(max_tokens=64), None, block_hasher=hasher)
        blocks, hit_tokens, _ = m.get_computed_blocks(r)
        m.allocate_slots(r, r.num_tokens - hit_tokens, hit_tokens, blocks)
        r.num_computed_tokens = r.num_tokens
        return r, hit_tokens

    m.admit = admit
    m.cached = lambda: sum(1 for b in m.block_pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
    return m


def test_vllm_caps_a_full_prefix_hit_at_t_minus_1_and_caches_the_last_block_twice(manager):
    r0, hit = manager.admit(0, list(range(32)))  # 2 full blocks
    manager.free(r0)
    assert (hit, manager.cached()) == (0, 2)
    r1, hit = manager.admit(1, list(range(32)))  # the same prompt, wholly cached
    # vLLM: at most 32 - 1 = 31 tokens may hit (the last token is recomputed for its logits),
    # and hits are whole blocks: 16 tokens. kvbench's oracle would count both blocks (32).
    assert hit == 16
    # The recomputed last block is registered under the hash already cached: two blocks, one hash.
    dupes = [v for v in manager.block_pool.cached_block_hash_to_block._cache.values() if isinstance(v, dict)]
    assert [len(v) for v in dupes] == [2]
    manager.free(r1)
    assert manager.cached() == 3  # 3 = 2 blocks of request 0 + the duplicate; kvbench: 2


def test_vllm_caches_blocks_filled_by_decode(manager):
    r, _ = manager.admit(0, list(range(100, 120)))  # 20 tokens: 1 full block + 4 tokens
    for t in range(12):  # 12 decode tokens: 32 = 2 full blocks
        r.append_output_token_ids(500 + t)
        manager.allocate_slots(r, 1, 0, None)
        r.num_computed_tokens += 1
    assert len(r.block_hashes) == 2  # the block filled by decode got a hash too
    manager.free(r)
    # Both stay cached; a kvbench trace names prompt blocks only (appends carry no hashes), so
    # kvbench would cache 1.
    assert manager.cached() == 2


# --- KV events (SPEC §14): vLLM's own, from BlockPool.take_events ---------------------------

def test_vllm_announces_its_cache_as_kv_events(vllm):
    from kvbench.contract.events import REMOVED, STORED
    be = VllmBlockPool(make_config(block_size=B, num_blocks=4, store_kv=False, prefix_caching=True))
    # 40 tokens = 2 full blocks (hashes 1, 2) + 8: one BlockStored of 2 hashes, 2's parent 1.
    be.prefill(0, Prompt(40, block_hashes=[1, 2]))
    got = be.events()
    assert [(e.kind, e.parent is None) for e in got] == [(STORED, True), (STORED, False)]
    assert got[1].parent == got[0].key
    # vLLM's events carry int(b"1") = 49 and int(b"2") = 50; read back as the trace's keys (the
    # checker would otherwise pair vLLM's 49 with a trace's hash 49)
    assert [e.key for e in got] == [1, 2]
    first = [e.key for e in got]
    be.free(0)
    assert be.events() == []  # freed: still cached
    # 4 new blocks of 4: the never used one, then the 3 freed, the 2 cached among them evicted
    # (2 BlockRemoved); 4 hashes stored.
    be.prefill(1, Prompt(64, block_hashes=[5, 6, 7, 8]))
    got = be.events()
    assert sorted(e.key for e in got if e.kind == REMOVED) == sorted(first)
    assert len([e for e in got if e.kind == STORED]) == 4


def test_the_checker_checks_vllms_events(vllm):
    trace = load_traces([p for p in committed_workloads() if p.stem == "prefix-reuse"])[0]
    v = check(trace, VllmBlockPool(config_for(trace, policy=None)))
    assert v.valid is True and v.events > 0 and "events" not in v.skipped
