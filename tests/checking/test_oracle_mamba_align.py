"""The oracle's model of vLLM's Mamba align mode (``state_checkpoints="align"``,
kvbench/model/rules/vllm.py), on hand-counted traces, without vLLM.

tiny-mamba at B = 8: three state groups (one layer each) and a full group. A prefill of P tokens
with a hit of L blocks takes, per state group, a block at each of its chunks' last positions:
the junction's J - 1, the checkpoint's c - 1 (c = (P - 1) // 8) and ceil(P / 8) - 1, those at or
past L, and keeps c - 1 and the last. The same traces run vLLM's manager in
tests/engines/test_vllm_kvmanager.py.
"""
from __future__ import annotations

import dataclasses

from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.model.oracle import Oracle

from impls.engines.vllm_kvmanager import capabilities_for  # importable without vLLM

B = 8
A = tuple(f"a{i}" for i in range(10))
SERVING = capabilities_for(caching=True, retention_interval=0)


def oracle(caps=SERVING) -> Oracle:
    return Oracle(CacheConfig(model=get_model("tiny-mamba"), block_size=B, num_blocks=64,
                              store_kv=False, prefix_caching=True), capabilities=caps)


def prefill(o, seq, tokens, hashes):
    o.prefill(seq, tokens, "default", tokens, seq, hashes=hashes)
    return o.expected_ledger()


def held(o, seq, g=0) -> list:
    return [i for i, b in enumerate(o.seqs[seq].tables[g]) if b is not None]


def test_a_prefill_keeps_the_checkpoint_and_the_last_state_and_a_resend_hits_the_checkpoint():
    o = oracle()
    led = prefill(o, 0, 61, A[:7])
    assert held(o, 0) == [6, 7]  # c - 1 = (61 - 1) // 8 - 1 = 6; ceil(61 / 8) - 1 = 7
    assert held(o, 0, 3) == list(range(8))  # the full group: every block
    assert led.blocks_used == 8 + 3 * 2
    o.free(0)
    led = prefill(o, 1, 61, A[:7])
    assert led.prefix_hit_blocks == 7 + 3  # the full group's 0..6 and each state's block 6


def test_the_junction_state_is_cached_for_the_next_sibling_and_released_in_the_prefill():
    o = oracle()
    prefill(o, 0, 61, A[:7])
    led = prefill(o, 1, 70, A[:5] + ("b5", "b6", "b7"))
    # the full group finds 5 blocks, the states (cached at 56 only) none: no hit, junction 5
    assert led.prefix_hit_blocks == 0
    assert held(o, 1) == [7, 8]  # c - 1 = (70 - 1) // 8 - 1; the junction's 4 released, cached
    # 0's 8 + 3 * 2, 1's 9 + 3 * 2
    assert led.blocks_used == 14 + 15
    led = prefill(o, 2, 70, A[:5] + ("c5", "c6", "c7"))
    assert led.prefix_hit_blocks == 5 + 3


def test_under_spec_rules_every_state_block_is_taken_and_cached():
    """The same prefill under SPEC's every_block: a block per position in every group, kept
    until the next allocation (vLLM's window_release), the states at 8 .. 56 cached."""
    caps = dataclasses.replace(SERVING, rule_params={**SERVING.rule_params,
                                                     "state_checkpoints": "every_block"})
    o = oracle(caps)
    led = prefill(o, 0, 61, A[:7])
    assert held(o, 0) == list(range(8))
    assert led.blocks_used == 4 * 8
