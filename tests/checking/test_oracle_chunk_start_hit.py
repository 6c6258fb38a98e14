"""The oracle's model of vLLM's hit left of the current chunk (``Capabilities.chunk_start_hit``):
on a model of chunked groups alone a lookup counts every block left of the chunk that holds the
hit's last allowed token (P - 1 for vLLM) as computed, named by the trace or not; the oracle's
own hit covers only blocks the trace names. The vLLM campaign findings it explains run in
tests/engines/test_fuzz_findings.py."""
from __future__ import annotations

import dataclasses

import pytest

from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.model.oracle import Oracle

from impls.engines.vllm_kvmanager import CAPABILITIES as VLLM, capabilities_for  # without vLLM

SPEC_RULE = dataclasses.replace(VLLM, rule_params={  # the oracle's own hit
    **VLLM.rule_params, "chunk_start_hit": False})


def blocks_after_prefill(groups, block_size: int, tokens: int, declared: bool, caching=True) -> int:
    caps = VLLM if declared else SPEC_RULE
    config = CacheConfig(model=with_group_kinds(get_model("tiny-hybrid"), groups),
                         block_size=block_size, num_blocks=64, prefix_caching=caching)
    o = Oracle(config, capabilities=caps)
    o.prefill(0, tokens, "a", tokens, 0)  # no block hashes: no block the trace names
    return o.expected_ledger().blocks_used


@pytest.mark.parametrize("groups, block_size, tokens, declared, oracles", [
    # chunked(8), B = 1, 9 tokens: (9 - 1) // 8 * 8 = 8 blocks skipped, 9 - 8 = 1 taken;
    # the oracle's own rule takes all ceil(9 / 1) = 9 (released at the next allocation)
    (("chunked(8)",), 1, 9, 1, 9),
    # chunked(6), B = 4, 15 tokens: (15 - 1) // 6 * 6 = 12 tokens, 12 // 4 = 3 blocks skipped,
    # ceil(15 / 4) - 3 = 1 taken; the oracle's ceil(15 / 4) = 4
    (("chunked(6)",), 4, 15, 1, 4),
    # chunked(5), B = 4, 15 tokens: (15 - 1) // 5 * 5 = 10 tokens, 10 // 4 = 2 blocks skipped
    # (vLLM's null blocks: block 1, tokens 4 .. 7, is below the start), ceil(15 / 4) - 2 = 2
    (("chunked(5)",), 4, 15, 2, 4),
    # two groups of one chunk: 2 * (9 - 8) = 2; the oracle's 2 * 9 = 18
    (("chunked(8)", "chunked(8)"), 1, 9, 2, 18),
    # chunks of two sizes: each group's lookup starts below the other's chunk start, so vLLM
    # hits nothing (9 + 9 = 18, as vLLM takes)
    (("chunked(8)", "chunked(3)"), 1, 9, 18, 18),
    # chunks of two sizes whose starts meet: (13 - 1) // 3 * 3 = 12 = (13 - 1) // 4 * 4, so each
    # group accepts the other's 12 skipped: 2 * (13 - 12) = 2; the oracle's 2 * 13 = 26
    (("chunked(3)", "chunked(4)"), 1, 13, 2, 26),
    # beside a full group, whose blocks must all be cached: no hit either way, 2 * 9 = 18
    (("chunked(8)", "full"), 1, 9, 18, 18),
])
def test_a_chunked_model_computes_only_the_chunk_of_its_last_token_where_declared(
        groups, block_size, tokens, declared, oracles):
    assert blocks_after_prefill(groups, block_size, tokens, declared=True) == declared
    assert blocks_after_prefill(groups, block_size, tokens, declared=False) == oracles


def test_a_cached_block_left_of_the_chunk_is_not_taken():
    """vLLM's lookup starts at the chunk: blocks left of it are null, cached or not (the seed 4242
    campaign's 03: the oracle took a cached block there)."""
    config = CacheConfig(model=with_group_kinds(get_model("tiny-hybrid"), ("chunked(15)",)),
                         block_size=8, num_blocks=8, prefix_caching=True)
    for caps, seq_blocks in ((VLLM, 1), (SPEC_RULE, 2)):
        o = Oracle(config, capabilities=caps)
        o.prefill(0, 8, "a", 8, 0, (), ("h0",))  # block 0 full and cached
        o.prefill(1, 16, "a", 16, 1, (), ("h0", "h1"))
        # vLLM: (16 - 1) // 15 * 15 = 15 tokens, 15 // 8 = 1 block skipped, none looked up
        # (15 // 8 = 1), ceil(16 / 8) - 1 = 1 taken; SPEC: block 0 hit, 2 held
        assert o.expected_ledger().seq_blocks[1] == seq_blocks


def test_without_a_prefix_cache_a_chunked_prompt_takes_every_block():
    # no lookup, no hit: ceil(9 / 1) = 9 blocks, released at the next allocation
    assert blocks_after_prefill(("chunked(8)",), 1, 9, declared=True, caching=False) == 9


def test_a_fork_served_as_a_request_skips_the_chunk_start_past_its_parents_keys():
    """A fork is a new request of the parent's tokens: its hit starts at the chunk's start too,
    past every key the parent's unnamed blocks give (it crashed there: the fuzzer's history 82 of
    seed 4242 on vllm-kvmanager)."""
    config = CacheConfig(model=with_group_kinds(get_model("tiny-hybrid"), ("chunked(8)",)),
                         block_size=1, num_blocks=64, prefix_caching=True)
    o = Oracle(config, capabilities=capabilities_for(caching=True, retention_interval=0))
    o.prefill(0, 9, "a", 9, 0)
    o.fork(1, 0, 9, 1)  # through the prefix cache, as the adapter declares with caching on
    led = o.expected_ledger()
    # (9 - 1) // 8 * 8 = 8 blocks skipped: 9 - 8 = 1 block each, parent and child
    assert led.seq_blocks == {0: 1, 1: 1}
    assert led.blocks_used == 2
    assert led.tokens == {0: 9, 1: 9}
