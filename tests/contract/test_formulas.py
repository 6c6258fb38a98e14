"""The formulas of SPEC §1-2 against hand arithmetic."""
from __future__ import annotations

import pytest

from kvbench.contract import formulas as F


@pytest.mark.parametrize("name, expected", [
    ("tiny", 128),              # 2 * 2 layers * 2 heads * 8 * 2 B
    ("llama-2-7b", 524_288),    # 2 * 32 * 32 * 128 * 2 = 512 KiB
    ("llama-3-8b", 131_072),    # 2 * 32 * 8 * 128 * 2 = 128 KiB (GQA: 8 KV heads)
    ("llama-2-70b", 327_680),   # 2 * 80 * 8 * 128 * 2 = 320 KiB
    ("mistral-7b", 131_072),    # 2 * 32 * 8 * 128 * 2 = 128 KiB
    ("qwen2.5-7b", 57_344),     # 2 * 28 * 4 * 128 * 2 = 56 KiB
    ("opt-13b", 819_200),       # 2 * 40 * 40 * 128 * 2 = 800 KiB
])
def test_bytes_per_token_of_each_preset(name, expected):
    assert F.get_model(name).bytes_per_token == expected


def test_opt13b_matches_the_pagedattention_paper():
    # The paper: 800 KB per token for OPT-13B (40 layers, hidden 5120 = 40 heads of 128, fp16).
    assert F.bytes_per_token(40, 40, 128, 2) == 819_200 == 800 * 1024
    opt = F.get_model("opt-13b")
    assert F.kv_bytes(2048, opt) == 1_677_721_600  # 2048 * 819200 = 1.5625 GiB
    assert F.block_bytes(16, opt) == 13_107_200     # 16 * 819200


def test_gqa_only_changes_kv_heads():
    # Llama-2-7B and Llama-3-8B differ in KV heads only (32 vs 8): a factor of 4.
    assert F.get_model("llama-2-7b").bytes_per_token == 4 * F.get_model("llama-3-8b").bytes_per_token


def test_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'gpt-5'.*llama-2-7b"):
        F.get_model("gpt-5")


@pytest.mark.parametrize("field, value", [("layers", 0), ("kv_heads", -1), ("head_dim", 1.5)])
def test_model_spec_rejects_bad_shapes(field, value):
    kwargs = dict(layers=2, kv_heads=2, head_dim=8)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        F.ModelSpec("bad", **kwargs)


@pytest.mark.parametrize("tokens, block_size, expected", [
    (-5, 16, 0), (0, 16, 0),
    (1, 16, 1), (16, 16, 1), (17, 16, 2),
    (45, 16, 3),   # 45 = (3 - 1) * 16 + 13
    (10**18 + 1, 1, 10**18 + 1),  # integer arithmetic: no float rounding
    (2**60 + 1, 2**4, 2**56 + 1),
])
def test_blocks_needed_is_ceil(tokens, block_size, expected):
    assert F.blocks_needed(tokens, block_size) == expected


def test_blocks_needed_rejects_a_zero_block_size():
    with pytest.raises(ValueError, match="block_size"):
        F.blocks_needed(10, 0)


@pytest.mark.parametrize("tokens, expected", [
    (0, 0), (16, 0), (32, 0),
    (1, 15),    # (16 - 1) % 16
    (45, 3),    # (16 - 13) % 16
    (17, 15),
])
def test_tail_waste(tokens, expected):
    assert F.tail_waste(tokens, 16) == expected


@pytest.mark.parametrize("delta, free_in_last, expected", [
    (1, 3, 0),    # fits in the tail
    (3, 3, 0),    # exactly fills the tail
    (4, 3, 1),    # ceil((4 - 3) / 16)
    (35, 3, 2),   # ceil(32 / 16)
    (36, 3, 3),   # ceil(33 / 16)
    (16, 0, 1), (17, 0, 2),
])
def test_append_new_blocks(delta, free_in_last, expected):
    assert F.append_new_blocks(delta, free_in_last, 16) == expected


def test_fragmentation():
    assert F.fragmentation(0, 0) == 0.0  # nothing in use
    assert F.fragmentation(3, 48) == 0.0625  # 45 tokens in 3 blocks of 16: 3 / 48
    assert F.fragmentation(0, 32) == 0.0


def test_sharing_saving_counts_whole_shared_blocks():
    tiny = F.get_model("tiny")
    # 40-token prefix, B = 16: 2 whole blocks = 32 tokens stay shared; 4 branches save 3 copies.
    assert F.sharing_saving(40, 4, tiny, 16) == 3 * 32 * 128
    # A prefix shorter than a block shares nothing once every branch has written.
    assert F.sharing_saving(15, 8, tiny, 16) == 0
    assert F.sharing_saving(48, 1, tiny, 16) == 0  # one branch: nothing saved
    opt = F.get_model("opt-13b")
    assert F.sharing_saving(1024, 2, opt, 16) == 1024 * 819_200  # exactly 64 blocks shared once


def test_budget_blocks_in_blocks_and_bytes():
    opt = F.get_model("opt-13b")
    # floor(12 * 2^30 / (16 * 819200)) = floor(12884901888 / 13107200) = floor(983.04) = 983
    assert F.budget_blocks("12GiB", 16, opt) == 983
    assert F.budget_blocks("12 GiB", 16, opt) == 983
    # 1 GB (decimal) of the tiny model in blocks of 16 tokens: 10^9 // 2048 = 488281
    assert F.budget_blocks("1GB", 16, F.get_model("tiny")) == 488_281
    assert F.budget_blocks(1024, 16, opt) == 1024
    assert F.budget_blocks("1024", 16, opt) == 1024
    assert F.budget_blocks("1024 blocks", 16, opt) == 1024
    assert F.budget_blocks("1 block", 16, opt) == 1
    # Less than a block of bytes holds no block.
    assert F.budget_blocks("12MiB", 16, opt) == 0  # 12582912 < 13107200
    with pytest.raises(ValueError, match=">= 0"):
        F.budget_blocks(-1, 16, opt)


@pytest.mark.parametrize("text, expected", [
    ("4096B", 4096), ("512MiB", 512 * 2**20), ("12GiB", 12 * 2**30),
    ("1.5 GB", 1_500_000_000), ("2tib", 2 * 2**40), ("3 kB", 3000),
])
def test_parse_bytes(text, expected):
    assert F.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12G", "12 XB", "-1GiB", "1e9", "GiB", "12 GiB extra"])
def test_parse_bytes_errors_name_the_input(text):
    with pytest.raises(ValueError, match=f"not a byte size: {text!r}"):
        F.parse_bytes(text)


@pytest.mark.parametrize("text", ["4096", " 12 ", "1.5"])
def test_a_plain_number_is_no_byte_size_it_counts_blocks(text):
    # One size grammar: bytes need a unit, a plain number is blocks (budget_blocks("4096") == 4096).
    with pytest.raises(ValueError, match="bytes need a unit"):
        F.parse_bytes(text)


def test_next_pow2_and_ceil_div():
    assert [F.next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == \
        [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    assert F.ceil_div(45, 16) == 3 and F.ceil_div(48, 16) == 3


def test_jain_index():
    assert F.jain_index([1, 1, 1]) == 1.0
    assert F.jain_index([1, 0, 0, 0]) == 0.25  # 1^2 / (4 * 1)
    assert F.jain_index([]) == 1.0 and F.jain_index([0, 0]) == 1.0
