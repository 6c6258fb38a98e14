"""SPEC §12 "Compressed groups": compressed(r) stores one entry per r tokens (DeepSeek-V4's
compress_ratio = r); a block of B entries covers B * r tokens, and its prefix-cache keys are
taken at every B * r tokens (vLLM-Ascend issue 10296: keyed by B on lookup, B * r on store)."""
from __future__ import annotations

import pytest

from kvbench.analyses import suite
from kvbench.contract import formulas as F
from kvbench.contract.protocol import CacheConfig
from kvbench.model import kinds
from kvbench.model.oracle import Oracle
from kvbench.traces.format import Header, Prefill, Trace

B = 16
MODEL = F.get_model("tiny-compressed")  # layer 0 full, layer 1 compressed(4)
FULL, COMPRESSED = MODEL.kv_groups


def test_the_preset_is_full_beside_compressed_4():
    assert [g.kind for g in MODEL.kv_groups] == ["full", "compressed(4)"]
    assert COMPRESSED.family == "compressed" and COMPRESSED.ratio == 4 and FULL.ratio == 1
    assert not COMPRESSED.releases and COMPRESSED.per_token


@pytest.mark.parametrize("tokens,blocks", [
    (0, 0),
    (1, 1),  # ceil(ceil(1/4)/16) = ceil(1/16) = 1
    (63, 1),  # ceil(ceil(63/4)/16) = ceil(16/16) = 1
    (64, 1),  # B * r = 16 * 4: one full block of 16 entries
    (65, 2),  # ceil(ceil(65/4)/16) = ceil(17/16) = 2
    (100, 2),  # ceil(ceil(100/4)/16) = ceil(25/16) = 2
    (129, 3),  # ceil(ceil(129/4)/16) = ceil(33/16) = 3
])
def test_a_compressed_group_holds_ceil_of_ceil_t_over_r_over_b_blocks(tokens, blocks):
    kind = kinds.kind_of(COMPRESSED, B)
    assert kind.blocks(tokens) == blocks
    assert F.kind_blocks(tokens, COMPRESSED, B, F.block_bytes(B, MODEL)) == blocks
    assert F.held_blocks(tokens, COMPRESSED, B) == list(range(blocks))
    assert list(kind.released(tokens)) == []  # kept as long as the sequence lives


def test_request_blocks_and_bytes_count_the_full_group_and_the_entries():
    # 100 tokens: full ceil(100/16) = 7 blocks, compressed 2 (above): 9
    assert F.request_blocks(100, MODEL, B) == 9
    # one slot of one layer: 2 * 2 heads * 8 * 2 bytes = 64; the full group 100 tokens of 64,
    # the compressed one ceil(100/4) = 25 entries of 64: 6,400 + 1,600 = 8,000
    assert F.kv_bytes(100, MODEL) == 8_000
    # 9 blocks of 16 slots of 64 bytes = 9,216 (the compressed block's 7 empty entries included)
    assert F.request_bytes(100, MODEL, B) == 9_216


def test_bytes_per_token_of_a_compressed_group_are_its_entrys_over_r():
    assert MODEL.group_slot_bytes(COMPRESSED) == 64  # an entry: 2 * 2 * 8 * 2
    assert MODEL.group_token_bytes(COMPRESSED) == 16  # 64 / 4
    assert MODEL.bytes_per_token == 80  # 64 (full) + 16 (compressed)
    assert MODEL.slot_bytes == 64  # a block's slot holds an entry, not a token
    # r not dividing the entry: 64 / 3 rounds up to 22 per token; kv_bytes counts whole
    # entries: 10 tokens are 10 * 64 + ceil(10/3) * 64 = 640 + 256 = 896
    three = F.with_group_kinds(MODEL, ["full", "compressed(3)"])
    assert three.bytes_per_token == 64 + 22
    assert F.kv_bytes(10, three) == 896


@pytest.mark.parametrize("tokens,cached", [
    (63, 0),  # B * r - 1: the first block's 64 tokens are not all written
    (64, 64),  # B * r: its block is cached
    (65, 64),  # B * r + 1: the second block holds one entry
    (127, 64), (128, 128),
])
def test_keys_are_taken_at_every_b_times_r_tokens(tokens, cached):
    kind = kinds.kind_of(COMPRESSED, B)
    assert kind.key_tokens == F.key_tokens(COMPRESSED, B) == 64  # 16 * 4
    assert kind.cached_tokens(tokens) == cached
    # the full group beside it keys every 16 tokens: floor(T/16) * 16
    assert kinds.kind_of(FULL, B).cached_tokens(tokens) == tokens // 16 * 16


def test_a_hit_is_the_longest_prefix_every_group_hits():
    model_kinds = [kinds.kind_of(g, B) for g in MODEL.kv_groups]
    # full hits 5 blocks (80 tokens), compressed 1 block (64 tokens): 64
    assert kinds.hit_tokens(model_kinds, [5, 1]) == 64
    # full hits 3 blocks (48 tokens), compressed 1 (64): 48
    assert kinds.hit_tokens(model_kinds, [3, 1]) == 48
    # keyed by B instead of B * r (issue 10296), one compressed block would claim 16 tokens of
    # entries that cover 64: the hit a correct pool reports differs
    assert kinds.hit_tokens(model_kinds, [5, 1]) != min(5 * 16, 1 * 16)


def test_the_oracle_refuses_compressed_groups_naming_them():
    with pytest.raises(ValueError, match=r"tiny-compressed: the oracle has no block tables of "
                                         r"compressed\(4\) groups"):
        Oracle(CacheConfig(model=MODEL, block_size=B, num_blocks=32))


def test_a_trace_header_names_the_kind():
    m = F.with_group_kinds(F.get_model("tiny"), ["full", "compressed(128)"])
    assert [g.kind for g in m.kv_groups] == ["full", "compressed(128)"]
    with pytest.raises(ValueError, match="a compressed entry covers at least 1 token"):
        F.parse_kind("compressed(0)")


def test_backends_are_not_applicable_to_a_compressed_model():
    t = Trace(Header(family="compressed"), [Prefill(0, 0, "t", 70)], name="compressed")
    row = suite.run_one(t, "numpy", CacheConfig(model=MODEL, block_size=B, num_blocks=32))
    assert row["status"] == "n/a"
    assert row["not_applicable"] == ("numpy does not run compressed groups (SPEC §12), and model "
                                     "tiny-compressed has full, compressed(4)")
