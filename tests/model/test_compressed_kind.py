"""SPEC §12 "Compressed groups": compressed(r) stores one entry per r tokens (DeepSeek-V4's
compress_ratio = r); a block of B entries covers B * r tokens, and its prefix-cache keys are
taken at every B * r tokens (vLLM-Ascend issue 10296: keyed by B on lookup, B * r on store)."""
from __future__ import annotations

import pytest

from kvbench.analyses import suite
from kvbench.contract import formulas as F
from kvbench.contract.protocol import CacheConfig, Capabilities
from kvbench.model import kinds
from kvbench.model.eviction import ModelOOM
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


def test_a_compressed_table_position_covers_b_times_r_tokens():
    assert kinds.kind_of(COMPRESSED, B).key_tokens == F.key_tokens(COMPRESSED, B) == 64  # 16 * 4
    assert kinds.kind_of(FULL, B).key_tokens == 16  # B


def test_the_oracle_refuses_compressed_groups_under_engine_rules_naming_them():
    with pytest.raises(ValueError, match=r"tiny-compressed: the oracle runs compressed\(4\) groups "
                                         r"under SPEC's rules only, not rule set 'vllm'"):
        Oracle(CacheConfig(model=MODEL, block_size=B, num_blocks=32),
               capabilities=Capabilities(rules="vllm"))
    with pytest.raises(ValueError, match=r"not rule set 'spec' with hit_leaves_last_token"):
        Oracle(CacheConfig(model=MODEL, block_size=B, num_blocks=32),
               capabilities=Capabilities(rule_params=(("hit_leaves_last_token", True),)))


# The oracle on tiny-compressed, B = 4, r = 4: a compressed block covers 16 = B * r tokens.
b4 = 4


def oracle(num_blocks=64, caching=True) -> Oracle:
    return Oracle(CacheConfig(model=MODEL, block_size=b4, num_blocks=num_blocks,
                              prefix_caching=caching, policy="lru"))


def keys(n: int, tag: str = "p") -> list:
    return [f"{tag}{i}" for i in range(n)]


@pytest.mark.parametrize("tokens,full,compressed,filled", [
    # T = k * B * r - 1, k * B * r, k * B * r + 1 for k = 1, 2 (B * r = 16)
    (15, 4, 1, 15 + 4),  # full ceil(15/4) = 4; compressed ceil(ceil(15/4)/4) = 1, ceil(15/4) = 4 entries
    (16, 4, 1, 16 + 4),  # 4 entries, one full compressed block
    (17, 5, 2, 17 + 5),  # ceil(17/4) = 5 entries: a second block of 1
    (31, 8, 2, 31 + 8), (32, 8, 2, 32 + 8), (33, 9, 3, 33 + 9),
])
def test_a_prefill_holds_a_compressed_block_per_b_times_r_tokens(tokens, full, compressed, filled):
    o = oracle()
    o.prefill(0, tokens, "t", tokens, 0)
    led = o.expected_ledger()
    assert led.group_blocks == (full, compressed)
    assert led.blocks_used == full + compressed
    assert led.token_states == filled  # the full group's T slots + ceil(T/r) entries
    assert led.seq_blocks == {0: full + compressed}


def test_an_append_writes_an_entry_at_each_rth_token_and_a_block_at_each_b_times_r():
    o = oracle(caching=False)
    o.prefill(0, 15, "t", 40, 0)  # 4 entries: the compressed block is full in entries
    o.append([0], [1], 1)  # token 15 begins no entry: T = 16, still 4 entries
    assert o.expected_ledger().group_blocks == (4, 1)
    assert o.expected_ledger().token_states == 16 + 4
    o.append([0], [1], 2)  # token 16 begins entry 4: a new compressed block (17 = 16 + 1)
    assert o.expected_ledger().group_blocks == (5, 2)
    assert o.expected_ledger().token_states == 17 + 5
    # reservation: full tail 17 - 16 = 1 of 4 filled, 3 free, 40 - 17 = 23 to come: 3; the
    # compressed tail 1 entry of 4, ceil(40/4) - ceil(17/4) = 10 - 5 = 5 entries to come: 3
    assert o.expected_ledger().reservation == 3 + 3


def test_a_hit_comes_in_whole_compressed_blocks():
    o = oracle()
    o.prefill(0, 40, "t", 40, 0, hashes=keys(10))  # 10 full blocks keyed, 2 compressed (32 tokens)
    o.free(0)
    for seq, (tokens, hit_tokens) in enumerate([
            (15, 0),  # B * r - 1: no whole compressed block
            (16, 16),  # B * r: one
            (20, 16),  # B * r + B: the full group has 5 blocks, the compressed one 1: 16
            (31, 16), (32, 32), (40, 32)], start=1):
        before = o.hit_blocks
        o.prefill(seq, tokens, "t", tokens, seq, hashes=keys(tokens // b4))
        # a hit of H tokens: H / B full blocks + H / (B * r) compressed ones
        assert o.hit_blocks - before == hit_tokens // b4 + hit_tokens // 16, tokens
        o.free(seq)


def test_a_compressed_block_is_keyed_by_the_prompts_key_at_its_last_b_block():
    o = oracle()
    o.prefill(0, 32, "t", 32, 0, hashes=keys(8))
    # compressed block j is keyed by key (j + 1) * r - 1: p3 and p7
    assert sorted(k for g, k in o.by_hash if g == 1) == ["p3", "p7"]
    assert sorted(k for g, k in o.by_hash if g == 0) == sorted(keys(8))
    o.free(0)
    # another prompt sharing p0..p2 only (its block 3 differs): no whole compressed block hit
    o.prefill(1, 16, "t", 16, 1, hashes=keys(3) + ["q3"])
    assert o.hit_blocks == 0


def test_a_chunked_prompt_caches_its_compressed_block_once_its_b_times_r_tokens_are_written():
    o = oracle()
    o.prefill(0, 12, "t", 20, 0, hashes=keys(5), prompt_tokens=20)
    assert not [k for g, k in o.by_hash if g == 1]  # 12 < 16 tokens written
    o.append([0], [3], 1)  # 15 = B * r - 1
    assert not [k for g, k in o.by_hash if g == 1]
    o.append([0], [1], 2)  # 16: the block's tokens are written (no entry was, token 15 begins none)
    assert [k for g, k in o.by_hash if g == 1] == ["p3"]


def test_a_fork_shares_the_compressed_tail_and_the_writer_of_an_entry_copies_it():
    o = oracle(caching=False)
    o.prefill(0, 18, "t", 30, 0)  # full 5 blocks, compressed 2 (5 entries: 4 + 1)
    o.fork(1, 0, 30, 1)
    led = o.expected_ledger()
    assert led.blocks_used == 5 + 2 and led.shared_blocks == 5 + 2
    o.append([1], [1], 2)  # token 18 begins no entry (entries begin at 16, 20): the full tail is copied
    led = o.expected_ledger()
    assert led.group_blocks == (5 + 1, 2)  # the full group's copy of its tail
    o.append([1], [2], 3)  # tokens 19, 20: 20 = 5 * 4 begins entry 5, in the shared compressed tail
    led = o.expected_ledger()
    # full: seq 0's 5, seq 1's copy and its block 5 (token 20); compressed: seq 1's copy of the tail
    assert led.group_blocks == (5 + 1 + 1, 2 + 1)
    # full: 16 shared (blocks 0..3) + 2 (seq 0's tail) + 4 (seq 1's copy, 16..19) + 1 (token 20);
    # compressed: 4 shared (block 0) + 1 (seq 0's entry 4) + 2 (seq 1's copy: entries 4, 5)
    assert led.token_states == (16 + 2 + 4 + 1) + (4 + 1 + 2)
    assert led.shared_blocks == 4 + 1


def test_an_accept_rolls_back_entries_and_blocks():
    o = oracle(caching=False)
    o.prefill(0, 15, "t", 40, 0)  # 4 entries in 1 compressed block
    o.append([0], [6], 1, drafts=[4])  # 21 tokens (17..20 drafts): ceil(21/4) = 6 entries, 2 blocks
    assert o.expected_ledger().group_blocks == (6, 2)
    o.accept(0, 4, 1, 2)  # keep 1 draft: 18 tokens, 5 entries, 2 compressed blocks
    assert o.expected_ledger().group_blocks == (5, 2)
    assert o.expected_ledger().token_states == 18 + 5
    o.accept(0, 1, 1, 3)  # nothing rolled back
    o.append([0], [1], 4, drafts=[1])
    o.accept(0, 1, 0, 5)  # 18 tokens again
    o.append([0], [0], 6)
    o.prefill(1, 15, "t", 15, 6)
    o.append([1], [2], 7, drafts=[2])  # 17: entry 4 in a new block
    o.accept(1, 2, 0, 8)  # back to 15: 4 entries, 1 block
    assert o.expected_ledger().group_blocks == (5 + 4, 2 + 1)


def test_an_evicted_compressed_block_is_no_longer_hit():
    o = oracle(num_blocks=6)
    o.prefill(0, 16, "t", 16, 0, hashes=keys(4))  # 4 + 1 blocks, all cached
    o.free(0)
    # released group by group, each table from its tail: the cached queue is full 3, 2, 1, 0,
    # then compressed 4
    assert o.expected_ledger().cached_blocks == 5
    assert o.block_state().cached == [3, 2, 1, 0, 4]
    o.prefill(1, 4, "t", 4, 1, hashes=["q0"])  # 1 + 1 blocks: the never used 5, then cached 3
    assert (0, "p3") not in o.by_hash and (1, "p3") in o.by_hash
    o.free(1)
    o.prefill(2, 16, "t", 16, 2, hashes=keys(4))  # the full group's p3 is gone: no hit of 16
    assert o.hit_blocks == 0
    o.free(2)
    with pytest.raises(ModelOOM):  # 5 + 2 = 7 > 6 blocks
        o.prefill(3, 20, "t", 20, 3, hashes=keys(5, "r"))
    o2 = oracle(num_blocks=5)
    o2.prefill(0, 16, "t", 16, 0, hashes=keys(4))
    o2.free(0)
    o2.prefill(1, 16, "t", 16, 1, hashes=keys(4, "q"))  # 5 blocks: every cached one evicted
    assert (1, "p3") not in o2.by_hash and o2.expected_ledger().cached_blocks == 0
    o2.free(1)
    o2.prefill(2, 16, "t", 16, 2, hashes=keys(4))
    assert o2.hit_blocks == 0


def test_a_preempted_sequence_resumes_with_the_hit_of_its_whole_compressed_blocks():
    o = oracle()
    o.prefill(0, 20, "t", 24, 0, hashes=keys(5))  # full 5 blocks, compressed 2 (block 0 keyed p3)
    o.preempt(0)
    assert o.expected_ledger().blocks_used == 0
    o.recompute(0, 1)
    # a hit of 16 = B * r tokens: 16 / 4 = 4 full blocks + 1 compressed; then full block 4 and
    # compressed block 1 (entries 4) anew
    assert o.hit_blocks == 4 + 1
    led = o.expected_ledger()
    assert led.group_blocks == (5, 2) and led.token_states == 20 + 5


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
