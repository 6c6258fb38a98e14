"""SPEC §12: cache kinds beyond K and V per layer, KV formats and pages of unequal groups.

Every expected figure is hand arithmetic from the presets' public configs (cited in formulas.py).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import backends
from test_hybrid import passes, trace

from impls.contiguous import Contiguous
from impls.faults import ChunkSlidesAsWindow, SinkReleasedEarly
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.cli import main
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.contract.protocol import CacheConfig, Prompt, kv_tokens
from kvbench.model.oracle import Oracle

GiB = 2**30


# --- bytes per token and block bytes of the 2026 presets --------------------------------

@pytest.mark.parametrize("name,per_token", [
    ("deepseek-v3", 70_272),  # 70,272 = 61 layers * 576 * 2 bytes
    ("deepseek-v3-fp8", 40_016),  # 40,016 = 61 layers * (512 + 4 * 4 + 64 * 2) bytes
    ("kimi-k2", 70_272),  # 70,272 = 61 layers * (512 + 64) * 2 bytes
    ("llama-4-scout", 196_608),  # 196,608 = 2 * 48 layers * 8 heads * 128 * 2 bytes
    ("gpt-oss-20b", 49_152),  # 49,152 = 2 * 24 * 8 * 64 * 2
    ("gpt-oss-120b", 73_728),  # 73,728 = 2 * 36 * 8 * 64 * 2
    ("qwen3-next-80b-a3b", 24_576),  # 24,576 = 2 * 12 full layers * 2 heads * 256 * 2 (state: none)
    ("jamba-v0.1", 16_384),  # 16,384 = 2 * 4 attention layers * 8 * 128 * 2
    ("gemma-3-12b", 393_216),  # 393,216 = 2 * 48 * 8 * 256 * 2
    ("llama-3-8b-fp8", 65_536),  # 65,536 = 2 * 32 * 8 * 128 * 1 byte
    ("llama-3-8b-fp8-token-head", 67_584),  # 67,584 = 2 * 32 * 8 * (128 + 4-byte scale)
    ("llama-3-8b-nvfp4", 36_864),  # 36,864 = 2 * 32 * 8 * (128/2 + 128/16)
])
def test_bytes_per_token_of_each_preset(name, per_token):
    assert F.get_model(name).bytes_per_token == per_token


@pytest.mark.parametrize("name,block", [
    ("deepseek-v3", 1_124_352),  # 1,124,352 = 16 * 70,272 (one group of all 61 layers)
    ("llama-4-scout", 786_432),  # 786,432 = 16 * 2 * 12 layers per group * 8 * 128 * 2
    ("gpt-oss-20b", 393_216),  # 393,216 = 16 * 2 * 12 * 8 * 64 * 2
    ("qwen3-next-80b-a3b", 393_216),  # 393,216 = 16 * 2 * 12 * 2 * 256 * 2
    ("jamba-v0.1", 262_144),  # 262,144 = 16 * 2 * 4 * 8 * 128 * 2
])
def test_block_bytes_of_each_preset(name, block):
    assert F.block_bytes(16, F.get_model(name)) == block


def test_state_bytes_and_blocks():
    qwen = F.get_model("qwen3-next-80b-a3b")
    # 1,097,728 = (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 2 bytes, per layer
    assert qwen.kv_groups[0].state_bytes == 1_097_728
    assert qwen.state_bytes == 39_518_208  # 36 layers * 1,097,728
    # 34 = ceil(12 * 1,097,728 / 393,216) = ceil(33.5)
    assert F.state_blocks(qwen.kv_groups[0], 393_216) == 34
    # 196,608 = 34 * 393,216 - 12 * 1,097,728: the last block's padding
    assert F.padding_bytes(16, qwen, qwen.kv_groups[0]) == 196_608
    jamba = F.get_model("jamba-v0.1")
    assert [g.family for g in jamba.kv_groups] == ["state"] * 7 + ["full"]
    assert jamba.kv_groups[-1].layers == (4, 12, 20, 28)  # attn_layer_period 8, offset 4
    # 5 = ceil(4 * 311,296 / 262,144) = ceil(4.75)
    assert F.state_blocks(jamba.kv_groups[0], 262_144) == 5


def test_per_tensor_scales_are_counted_once():
    # 256 = 2 (K, V) * 32 layers * 4 bytes
    assert F.get_model("llama-3-8b-fp8").tensor_scale_bytes == 256
    assert F.get_model("llama-3-8b-nvfp4").tensor_scale_bytes == 256
    assert F.get_model("llama-3-8b-fp8-token-head").tensor_scale_bytes == 0
    assert F.get_model("llama-3-8b").tensor_scale_bytes == 0


# --- the largest concurrency at 8k / 32k / 128k ------------------------------------------

@pytest.mark.parametrize("name,length,expected", [
    # 149 = floor(80 GiB / (8192 * 70,272)) = floor(85,899,345,920 / 575,668,224) = floor(149.2)
    ("deepseek-v3", 8192, 149),
    # 9 = floor(85,899,345,920 / (131,072 * 70,272)) = floor(9.33)
    ("deepseek-v3", 131072, 9),
    # Llama-4-Scout at 8k: 3 chunked groups * 512 blocks (ceil(8191/16) = 512, B divides C) +
    # 512 full = 2,048 blocks of 786,432: 53 = floor(85,899,345,920 / 1,610,612,736)
    ("llama-4-scout", 8192, 53),
    # at 128k: 3 * 512 + 8,192 = 9,728 blocks: 11 = floor(85,899,345,920 / 7,650,410,496)
    ("llama-4-scout", 131072, 11),
    # gpt-oss-20b at 32k: sliding ceil(127/16) + 1 = 9 blocks + full 2,048 = 2,057 blocks of
    # 393,216: 106 = floor(85,899,345,920 / 808,845,312) = floor(106.2)
    ("gpt-oss-20b", 32768, 106),
    # Qwen3-Next at 8k: 3 states * 34 blocks + 512 full = 614 blocks of 393,216:
    # 355 = floor(85,899,345,920 / 241,434,624) = floor(355.8)
    ("qwen3-next-80b-a3b", 8192, 355),
    # llama-3-8b-fp8 at 8k: (85,899,345,920 - 256) // (8192 * 65,536) = 159 (160 less the scales)
    ("llama-3-8b-fp8", 8192, 159),
])
def test_concurrency_from_the_formulas(name, length, expected):
    assert F.budget_concurrency(80 * GiB, length, F.get_model(name), 16) == expected


def test_padded_concurrency_is_the_block_count_formula():
    """With padded pages, floor(budget / (n * block_bytes)) = floor(floor(budget/block_bytes) / n)."""
    for name in ("llama-4-scout", "gpt-oss-120b", "jamba-v0.1"):
        m = F.get_model(name)
        blocks = 80 * GiB // F.block_bytes(16, m)
        for x in (8192, 32768, 131072):
            assert F.budget_concurrency(80 * GiB, x, m, 16) == F.max_concurrency(blocks, x, m, 16)


def test_pages_padded_vs_pools():
    """An mla(8) group beside a full group of 2 heads of 8: slots of 2 * 8 * 2 = 32 and 2 * 2 * 2
    * 8 * 2 = 128 bytes per token; padded, every page is 16 * 128 = 2,048 bytes."""
    groups = (F.KVGroup((0, 2), latent=8), F.KVGroup((1, 3)))
    padded = F.ModelSpec("m", 4, 2, 8, groups=groups)
    pools = F.ModelSpec("m", 4, 2, 8, groups=groups, pages="pools")
    assert padded.bytes_per_token == 160  # 32 + 128
    assert F.block_bytes(16, padded) == 2048
    assert F.padding_bytes(16, padded, groups[0]) == 1536  # 2,048 - 16 * 32
    assert F.padding_bytes(16, pools, groups[0]) == 0
    # 100 tokens: 7 blocks per group (ceil(100/16)). Padded: 14 * 2,048 = 28,672 bytes; pools:
    # 7 * 512 + 7 * 2,048 = 17,920.
    assert F.request_bytes(100, padded, 16) == 28_672
    assert F.request_bytes(100, pools, 16) == 17_920


# --- release rules and held blocks -------------------------------------------------------

def test_chunked_holds_only_the_current_chunk():
    g = F.KVGroup((0,), chunk=32)
    # 70 tokens, chunk 32: the chunk starts at 64 = floor(70/32) * 32: blocks 0..7 of 8 released
    assert F.released_blocks(70, g, 8) == range(8)
    assert F.held_blocks(70, g, 8) == [8]
    # exactly 64: the next token's chunk starts at 64, nothing of it written yet
    assert F.held_blocks(64, g, 8) == []
    # a chunk that is not a multiple of the block: C = 20, T = 45 -> start 40, block 5 (40..47)
    assert F.held_blocks(45, F.KVGroup((0,), chunk=20), 8) == [5]


def test_sinks_keep_their_blocks():
    g = F.KVGroup((0,), sinks=(8, 24))
    # 100 tokens: window starts at 100 - 24 + 1 = 77, block 9 (72..79); sinks in block 0
    assert F.released_blocks(100, g, 8) == range(1, 9)
    assert F.held_blocks(100, g, 8) == [0, 9, 10, 11, 12]
    # S = 9 spans 2 blocks of 8: both kept
    assert F.held_blocks(100, F.KVGroup((0,), sinks=(9, 24)), 8)[:2] == [0, 1]
    # short: nothing released while the window still reaches the sinks
    assert F.released_blocks(20, g, 8) == range(1, 1)


def test_kind_blocks_bounds():
    B, bb = 16, 2048
    # chunked(8192), B = 16 divides C: 512 = ceil(8191/16); chunked(100): ceil(99/16) + 1 = 8
    assert F.kind_blocks(10**6, F.KVGroup((0,), chunk=8192), B, bb) == 512
    assert F.kind_blocks(10**6, F.KVGroup((0,), chunk=100), B, bb) == 8
    assert F.kind_blocks(40, F.KVGroup((0,), chunk=8192), B, bb) == 3  # ceil(40/16), below a chunk
    # sinks(4, 128): 1 + ceil(127/16) + 1 = 10
    assert F.kind_blocks(10**6, F.KVGroup((0,), sinks=(4, 128)), B, bb) == 10
    # mla: every block, like full
    assert F.kind_blocks(100, F.KVGroup((0,), latent=576), B, bb) == 7


# --- parsing, with clear errors ----------------------------------------------------------

@pytest.mark.parametrize("text,fields", [
    ("full", {}), ("sliding(4096)", {"window": 4096}), ("chunked(8192)", {"chunk": 8192}),
    ("sinks(4, 1024)", {"sinks": (4, 1024)}), ("mla(576)", {"latent": 576}),
    ("state(1097728)", {"state_bytes": 1097728}), ("compressed(4)", {"compress": 4}),
])
def test_parse_kind(text, fields):
    assert F.parse_kind(text) == fields
    assert F.KVGroup((0,), **fields).kind == text.replace(" ", "")


@pytest.mark.parametrize("text,message", [
    ("chunked", r"not a KV cache group kind: 'chunked' \(chunked\(chunk\) takes 1"),
    ("sinks(4)", r"sinks\(S, W\) takes 2"),
    ("mla(x)", "not a KV cache group kind: 'mla\\(x\\)'"),
    ("state(0)", "a state is at least 1 byte"),
    ("chunked(0)", "a chunk is at least 1 token"),
    ("ring(3)", "not a KV cache group kind: 'ring\\(3\\)'"),
])
def test_bad_kinds_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        F.parse_kind(text)


def test_bad_models_are_refused():
    with pytest.raises(ValueError, match="one kind per group, got window, chunk"):
        F.KVGroup((0,), window=4, chunk=8)
    with pytest.raises(ValueError, match="sinks must be \\(S, W\\)"):
        F.KVGroup((0,), sinks=(4,))
    with pytest.raises(ValueError, match="kv_encoding must be one of"):
        F.ModelSpec("m", 1, 1, 16, kv_encoding="fp4")
    with pytest.raises(ValueError, match="head_dim 24 is not a multiple of 16"):
        F.ModelSpec("m", 1, 1, 24, kv_encoding="nvfp4")
    with pytest.raises(ValueError, match="state groups only"):
        F.ModelSpec("m", 1, 1, 16, groups=(F.KVGroup((0,), state_bytes=64),))


def test_group_kinds_from_a_header():
    m = F.with_group_kinds(F.get_model("tiny"), ["chunked(32)", "full"])
    assert [g.kind for g in m.kv_groups] == ["chunked(32)", "full"]
    kinds = ["chunked(32)"] * 3 + ["full"]
    assert F.with_group_kinds(F.get_model("tiny-chunked"), kinds) is F.get_model("tiny-chunked")


# --- kvbench list-models -----------------------------------------------------------------

def test_list_models_prints_the_formulas(capsys):
    assert main(["list-models", "--models", "deepseek-v3,llama-4-scout", "--budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    # deepseek-v3: 70,272 B/token, 1,124,352 B/block, 149 / 37 / 9 at 8k / 32k / 128k
    # (37 = floor(85,899,345,920 / (32,768 * 70,272)) = floor(37.3))
    assert rows["deepseek-v3"][-3:] == ["149", "37", "9"]
    assert "70272" in rows["deepseek-v3"] and "1124352" in rows["deepseek-v3"]
    # llama-4-scout at 32k: 3 * 512 + 2,048 = 3,584 blocks of 786,432: 30 = floor(30.5)
    assert rows["llama-4-scout"][-3:] == ["53", "30", "11"]


def test_list_models_names_a_bad_model(capsys):
    assert main(["list-models", "--models", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


# --- chunked and sinks groups in the oracle and the pools (SPEC §12) -----------------------

CHUNKED = F.get_model("tiny-chunked")  # chunked(32) on layers 0, 1, 2 (a group each), full on 3
SINKS = F.get_model("tiny-sinks")  # sinks(8, 24) on layers 0, 2; full on 1, 3
RELEASING = backends("paged", where=lambda caps: caps.groups)


def kinds_config(model, block_size=8, num_blocks=64, **kw) -> CacheConfig:
    return CacheConfig(model=model, block_size=block_size, num_blocks=num_blocks, **kw)


def runs(model):
    """The paged backends that declare the model's kinds (the rest are n/a, with the reason)."""
    return [n for n in RELEASING
            if {g.family for g in model.kv_groups} <= set(registry.resolve(n).load().capabilities.kinds)]


def test_a_chunked_group_holds_only_its_current_chunk():
    o = Oracle(kinds_config(CHUNKED))
    o.prefill(0, 70, "t", 80, step=0)
    # 70 tokens over blocks of 8: 9 blocks in the full group; each chunked group holds the
    # blocks of [64, 70) (the chunk from floor(70/32) * 32 = 64): block 8 only.
    assert o.expected_ledger().group_blocks == (1, 1, 1, 9)
    o.append([0], [26], step=1)  # 96 tokens: the chunk starts at 96, nothing of it written
    assert o.expected_ledger().group_blocks == (0, 0, 0, 12)
    o.append([0], [1], step=2)  # 97: a new block 12 in every group
    assert o.expected_ledger().group_blocks == (1, 1, 1, 13)
    assert o.released_spans(0)[0] == (0, 96)


def test_a_sinks_group_keeps_the_sinks_block():
    o = Oracle(kinds_config(SINKS))
    o.prefill(0, 100, "t", 120, step=0)
    # Full: ceil(100/8) = 13 blocks. Sinks: block 0 (the first 8 tokens) and the window's
    # [100 - 24 + 1, 100) = [77, 100): blocks 9..12; blocks 1..8 released.
    assert o.expected_ledger().group_blocks == (5, 13)
    assert [b is not None for b in o.seqs[0].tables[0]] == [True] + [False] * 8 + [True] * 4
    assert o.released_spans(0) == ((8, 72), (0, 0))
    o.fork(1, 0, 120, step=1)
    o.append([1], [8], step=2)  # the child at 108: window from 85 // 8 = 10; block 9 goes
    assert [b is not None for b in o.seqs[1].tables[0]] == [True] + [False] * 9 + [True] * 4


@pytest.mark.parametrize("model", [CHUNKED, SINKS], ids=lambda m: m.name)
def test_pools_replay_chunks_and_sinks(model):
    t = trace(("p", 0, 100), ("a", {0: 12}), ("p", 1, 40), ("k", 2, 1), ("a", {1: 30, 2: 5}),
              ("a", {0: 1, 1: 1, 2: 1}), ("x", 1), ("a", {0: 40, 2: 3}), ("x", 0), ("x", 2))
    names = runs(model)
    assert {"numpy", "torch"} <= set(names)
    for policy in (None, "lru"):
        passes(t, kinds_config(model, num_blocks=60, policy=policy), names)


def test_a_chunked_hit_needs_only_the_current_chunk():
    """A prompt of 40 tokens, then freed: a hit of L = 5 blocks needs the full group's 5 and
    the chunked groups' blocks of [32, 40) only (block 4), the chunk at floor(40/32) * 32."""
    ids = {"token_ids": tuple(range(40))}
    cfg = kinds_config(CHUNKED, num_blocks=24, prefix_caching=True)
    o = Oracle(cfg)
    o.prefill(0, 40, "t", 40, 0, token_ids=ids["token_ids"])
    o.free(0)
    o.prefill(1, 40, "t", 40, 2, token_ids=ids["token_ids"])
    assert o.hit_blocks == 8  # 5 full + 3 chunked groups * 1
    passes(trace(("p", 0, 40, ids), ("x", 0), ("p", 1, 40, ids)), cfg, runs(CHUNKED))


def test_a_sinks_hit_needs_the_sinks_block():
    """sinks(8, 24) over blocks of 8 and a prompt of 48: the hit of 6 blocks needs block 0 and
    the window's [25, 48) (blocks 3..5) cached in the sinks group."""
    ids = {"token_ids": tuple(range(48))}
    cfg = kinds_config(SINKS, num_blocks=16, prefix_caching=True)
    o = Oracle(cfg)
    o.prefill(0, 48, "t", 48, 0, token_ids=ids["token_ids"])
    # 12 blocks: sinks group 0..5, full 6..11; the prefill releases sinks blocks 1, 2 (the
    # window from (48 - 23) // 8 = 3), tail first
    assert o.block_state().cached == [2, 1]
    o.free(0)
    o.prefill(1, 48, "t", 48, 2, token_ids=ids["token_ids"])
    assert o.hit_blocks == 10  # 6 full + sinks blocks 0, 3, 4, 5
    assert o.seqs[1].tables[0][:3] == [0, None, None]
    passes(trace(("p", 0, 48, ids), ("x", 0), ("p", 1, 48, ids)), cfg, runs(SINKS))


def test_kinds_a_pool_does_not_run_are_not_applicable():
    why = "does not run sinks groups (SPEC §12), and model tiny-sinks has sinks(8,24), full"
    row = suite.run_one(trace(("p", 0, 10)), "contiguous-oracle", kinds_config(SINKS))
    # the run names the registry's entry; the class refuses under its own name
    assert row["status"] == "n/a" and row["not_applicable"] == f"contiguous-oracle {why}"
    with pytest.raises(NotImplementedError, match=re.escape(f"contiguous {why}")):  # direct use too
        Contiguous(kinds_config(SINKS))


@pytest.mark.parametrize("fault,model,expected,actual", [
    # 100 tokens over blocks of 8: 5 + 13 blocks (above); with the sinks' block released, 4 + 13
    (SinkReleasedEarly, SINKS, 18, 17),
    # 100 tokens: full ceil(100/8) = 13; each chunked group the chunk from 96: block 12, so
    # 3 + 13 = 16. Held to sliding(32): [69, 100), blocks 8..12, so 3 * 5 + 13 = 28.
    (ChunkSlidesAsWindow, CHUNKED, 16, 28),
])
def test_a_planted_release_fault_is_caught_and_its_control_passes(fault, model, expected, actual):
    t = trace(("p", 0, 100))
    v = check(t, fault(kinds_config(model)))
    assert (v.valid, v.divergence.quantity, v.divergence.expected, v.divergence.actual) == \
        (False, "blocks_used", expected, actual)
    passes(t, kinds_config(model), ["numpy"])


# --- mla(d): one latent per token per layer ----------------------------------------------

MLA = F.get_model("tiny-mla")


def test_an_mla_model_stores_one_latent_per_token_per_layer():
    assert MLA.bytes_per_token == 48  # 48 = 2 layers * 12 * 2 bytes: no factor 2, no H_kv
    assert F.block_bytes(8, MLA) == 384  # 384 = 8 * 48
    assert MLA.kv_shape == (1, 2, 1, 12)  # [1, layers, 1, d]: the K/V checks run unchanged
    assert F.get_model("deepseek-v3").kv_shape == (1, 61, 1, 576)
    assert F.get_model("llama-3-8b").kv_shape == (2, 32, 8, 128)
    mixed = F.ModelSpec("m", 4, 1, 8, groups=(F.KVGroup((0, 2), latent=8), F.KVGroup((1, 3))))
    with pytest.raises(ValueError, match="a model mixing them has formulas only"):
        mixed.kv_shape


@pytest.mark.parametrize("name", ["numpy", "torch", "contiguous-oracle"])
def test_pools_hold_the_latents(name):
    cfg = kinds_config(MLA, num_blocks=16)
    backend = registry.create(name, cfg)
    backend.prefill(0, Prompt(20, final_tokens=20), kv_tokens([0] * 20, range(20), MLA, np.float16))
    got = np.asarray(backend.gather(0))
    assert got.shape == (20, 1, 2, 1, 12)
    assert np.array_equal(got, kv_tokens([0] * 20, range(20), MLA, np.float16))
    if name != "contiguous-oracle":  # ceil(20/8) = 3 blocks of 384 bytes
        assert backend.ledger().bytes_in_use == 3 * 384
    passes(trace(("p", 0, 20), ("k", 1, 0), ("a", {1: 5, 0: 12}), ("x", 0), ("x", 1)), cfg, [name])


def test_the_2026_breakdown_leaves_out_what_a_pool_does_not_run():
    from kvbench.analyses.kinds_breakdown import model_breakdowns
    t = model_breakdowns(models=("tiny-chunked", "tiny-mla"), budget="64KiB", num_requests=12,
                         max_steps=50)
    rows = {(r["model"], r["backend"]): r for r in t.to_dict("records")}
    assert rows[("tiny-chunked", "contiguous-max")]["left_out"] == "contiguous-max does not run chunked groups"
    # tiny-chunked: 4 groups of one layer, 2 * 1 layer * 2 heads * 8 * 2 bytes = 64 B per slot;
    # blocks of 16 * 64 = 1,024 B: 65,536 / 1,024 = 64 blocks
    assert rows[("tiny-chunked", "numpy")]["num_blocks"] == 64
    shares = [rows[("tiny-mla", b)] for b in ("contiguous-max", "numpy")]
    for r in shares:  # the categories split the whole budget
        assert abs(sum(r[c] for c in ("token_states", "reservation", "internal_fragmentation",
                                      "external_fragmentation", "free")) - 1) < 1e-9


# --- vLLM's page sizes ------------------------------------------------------------------------
# vLLM (vllm/v1/kv_cache_interface.py, commit 001cabc1) sizes one layer's page of B tokens:
# AttentionSpec 2 * B * H_kv * head_size * dtype bytes, plus 2 * B * H_kv * 4 for per-token-head
# scales; FullAttentionSpec with nvfp4 B * H_kv * 2 * (head_size/2 + head_size/16) (one byte per
# packed pair and per fp8 block scale); MLAAttentionSpec B * 1 * head_size * dtype bytes, or
# B * 656 for "fp8_ds_mla"; MambaSpec the sum of its state tensors' bytes. A kvbench block holds
# one group's L_group layers: L_group vLLM pages.

def vllm_page_bytes(kind, B, heads=0, head_size=0, dtype_bytes=2):
    if kind == "attention":
        return 2 * B * heads * head_size * dtype_bytes
    if kind == "fp8_per_token_head":
        return 2 * B * heads * head_size * 1 + 2 * B * heads * 4
    if kind == "nvfp4":
        return B * heads * 2 * (head_size // 2 + head_size // 16)
    if kind == "mla":
        return B * head_size * dtype_bytes
    return B * 656  # fp8_ds_mla


@pytest.mark.parametrize("name,kind,heads,head_size,dtype_bytes", [
    ("deepseek-v3", "mla", 1, 576, 2),
    ("deepseek-v3-fp8", "fp8_ds_mla", 1, 576, 1),
    ("kimi-k2", "mla", 1, 576, 2),
    ("llama-4-scout", "attention", 8, 128, 2),  # ChunkedLocalAttentionSpec: AttentionSpec's page
    ("gpt-oss-20b", "attention", 8, 64, 2),  # SlidingWindowSpec and FullAttentionSpec alike
    ("qwen3-next-80b-a3b", "attention", 2, 256, 2),
    ("llama-3-8b-fp8", "attention", 8, 128, 1),
    ("llama-3-8b-fp8-token-head", "fp8_per_token_head", 8, 128, 1),
    ("llama-3-8b-nvfp4", "nvfp4", 8, 128, 1),
])
def test_block_bytes_are_vllms_pages_over_a_groups_layers(name, kind, heads, head_size, dtype_bytes):
    m = F.get_model(name)
    attention = [g for g in m.kv_groups if g.per_token]
    assert F.block_bytes(16, m) == len(attention[0].layers) * vllm_page_bytes(kind, 16, heads, head_size,
                                                                           dtype_bytes)


def test_state_bytes_are_vllms_mamba_page():
    # Qwen3-Next's Gated DeltaNet state in vLLM's MambaSpec: shapes (conv) (3, 2 * 16 * 128 + 32 *
    # 128) and (ssm) (32, 128, 128), bf16: (3 * 8,192 + 524,288) * 2 = 1,097,728 bytes per layer.
    assert F.get_model("qwen3-next-80b-a3b").kv_groups[0].state_bytes == (3 * 8192 + 32 * 128 * 128) * 2
