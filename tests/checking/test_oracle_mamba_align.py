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


def hand(groups, block_size, num_blocks, ops):
    from kvbench.traces.format import Header, Trace, validate
    header = Header(family="test", settings={"model": "tiny-hybrid", "block_size": block_size,
                                             "num_blocks": num_blocks, "prefix_caching": True},
                    groups=groups)
    return validate(Trace(header, ops, name="hand"))


def used_after_each(trace) -> list:
    from kvbench.analyses.suite import config_for
    o = Oracle(config_for(trace, policy=None), capabilities=SERVING)
    out = []
    for op in trace.ops:
        if op.kind == "prefill":
            o.prefill(op.seq, op.tokens, op.tenant, op.tokens, op.step, hashes=op.block_hashes)
        else:
            o.append(op.seqs, op.tokens, op.step)
        out.append(o.expected_ledger().blocks_used)
    return out


def split_prefill_trace():
    """state(59) beside chunked(1), B = 1: a 2-token prompt runs as chunks [0, 1) and [1, 2)."""
    from kvbench.traces.format import Prefill
    return hand(("state(59)", "chunked(1)"), 1, 4, [Prefill(0, 0, "a", 2)])


def long_append_trace():
    """state(117) beside full, B = 3: a 3-token prompt, then an append of 4 tokens."""
    from kvbench.traces.format import Prefill
    from kvbench.traces.ops import Append
    return hand(("state(117)", "full"), 3, 6, [Prefill(0, 0, "a", 3, ("p0.0",)),
                                               Append(1, (0,), (4,))])


def test_the_later_chunks_of_a_split_prefill_release_every_releasing_groups_blocks():
    """The second chunk's allocate_slots releases, as of its start (1 token), the chunked(1)
    group's block 0 too: the prefill ends with the state's 2 blocks (c - 1 = 0 and 1) and the
    chunked group's 1, 3 blocks; released only at the next allocation it would hold 4."""
    assert used_after_each(split_prefill_trace()) == [2 + 1]


def test_an_append_across_several_blocks_takes_one_state_block():
    """At 3 tokens the state holds block 0 (one chunk: c = (3 - 1) // 3 = 0), the full group
    1 block; appending 4 tokens crosses into blocks 1 and 2 (7 tokens): the full group takes
    both, the state only the last (MambaManager's align mode), 0 released at the next
    allocation: 3 + 2 blocks, not 3 + 3."""
    assert used_after_each(long_append_trace()) == [1 + 1, 3 + 2]
