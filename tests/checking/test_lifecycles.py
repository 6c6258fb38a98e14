"""Scheduler lifecycles (SPEC §13): speculative decoding (draft tokens, accept), chunked prefill,
preemption by recompute. The trace format refuses what cannot follow (file and line), the oracle
derives the ledger from the formulas, and every kvbench backend that declares a lifecycle passes
the checker on it."""
from __future__ import annotations

import json

import pytest
from conftest import P, X, make_config, make_trace

from impls.object_model import ObjectModel
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.protocol import Backend
from kvbench.model.oracle import Oracle
from kvbench.traces.format import TraceError, final_lengths, loads, op_to_dict, to_csv
from kvbench.traces.ops import Accept, Append, Preempt, Prefill, Resume

HEADER = {"kvbench_trace": 1, "family": "test", "generator": "tests", "params": {}, "seed": 0}


def jsonl(*ops) -> str:
    return "\n".join(json.dumps(d) for d in (HEADER, *ops))


def refused(*ops) -> TraceError:
    with pytest.raises(TraceError) as e:
        loads(jsonl(*ops), "bad.jsonl")
    return e.value


PREFILL = {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 20}
DRAFT = {"step": 1, "op": "append", "seqs": [0], "tokens": [5], "draft": [4]}


# --- loading -------------------------------------------------------------------------------

@pytest.mark.parametrize("ops, line, reason", [
    # line 1 is the header: the third operation is line 4
    ([PREFILL, {"step": 1, "op": "accept", "seq": 0, "n": 0}], 3,
     "accept of sequence 0 without a pending speculative append"),
    ([PREFILL, DRAFT, {"step": 2, "op": "accept", "seq": 0, "n": 5}], 4,
     "accept keeps n = 5 draft tokens of sequence 0, which has only k = 4 (n <= k)"),
    ([PREFILL, DRAFT, {"step": 2, "op": "accept", "seq": 0, "n": 1},
      {"step": 3, "op": "accept", "seq": 0, "n": 0}], 5, "without a pending speculative append"),
    ([PREFILL, {"step": 1, "op": "append", "seqs": [0], "tokens": [3], "draft": [4]}], 3,
     "draft[0] = 4 draft tokens, more than the 3 tokens it appends"),
    ([PREFILL, DRAFT, {"step": 2, "op": "append", "seqs": [0], "tokens": [1]}], 4,
     "append to sequence 0, whose 4 draft tokens wait for an accept"),
    ([PREFILL, DRAFT, {"step": 2, "op": "fork", "seq": 1, "src": 0}], 4,
     "fork from sequence 0, whose 4 draft tokens wait for an accept"),
    ([PREFILL, {"step": 1, "op": "resume", "seq": 0}], 3, "resume of sequence 0, which is not preempted"),
    ([PREFILL, {"step": 1, "op": "preempt", "seq": 0, "mode": "recompute"},
      {"step": 2, "op": "append", "seqs": [0], "tokens": [1]}], 4,
     "append to preempted sequence 0 (resume it first)"),
    ([PREFILL, {"step": 1, "op": "preempt", "seq": 0, "mode": "swap"}], 3,
     "preempt of sequence 0 by swap in a trace whose header declares no 'tiers'"),
    ([PREFILL, {"step": 1, "op": "preempt", "seq": 0, "tier": "host"}], 3,
     "got tier 'host' with mode 'recompute'"),
    ([PREFILL, {"step": 1, "op": "preempt", "seq": 0, "mode": "later"}], 3,
     "preempt mode 'later' is not known (recompute, swap)"),
    ([dict(PREFILL, prompt_tokens=30), {"step": 1, "op": "append", "seqs": [0], "tokens": [11]}], 3,
     "append of 11 tokens to sequence 0, whose chunked prompt has 10 left"),
    ([dict(PREFILL, prompt_tokens=30), {"step": 1, "op": "append", "seqs": [0], "tokens": [5],
                                        "draft": [1]}], 3,
     "draft tokens for sequence 0 before its chunked prompt is complete"),
    ([dict(PREFILL, prompt_tokens=19)], 2, "field 'prompt_tokens' must be >= 20, got 19"),
    ([dict(PREFILL, prompt_tokens=40, block_hashes=[1, 2, 3])], 2,
     "3 block_hashes for 40 tokens: a prompt of 40 tokens has 2 full blocks of 16"),
])
def test_loading_refuses_what_cannot_follow_with_its_line(ops, line, reason):
    e = refused(*ops)
    assert (e.path, e.line) == ("bad.jsonl", line) and reason in e.reason, str(e)


def test_a_chunked_prompt_hashes_its_whole_length_and_round_trips():
    # 40 of a 48-token prompt: 48 // 16 = 3 hashes, of which the chunk completes 40 // 16 = 2.
    t = loads(jsonl(dict(PREFILL, tokens=40, prompt_tokens=48, block_hashes=[1, 2, 3]),
                    {"step": 1, "op": "append", "seqs": [0], "tokens": [8]}))
    assert t.ops[0] == Prefill(0, 0, "a", 40, (1, 2, 3), prompt_tokens=48)
    assert loads(t.to_jsonl()).ops == t.ops
    assert final_lengths(t.ops) == {0: 48}  # 40 + 8


def test_lifecycle_operations_keep_their_fields_through_the_columns():
    ops = [Prefill(0, 0, "a", 20), Append(1, (0,), (5,), (4,)), Accept(2, 0, 1),
           Preempt(3, 0), Resume(4, 0), Append(5, (0,), (1,)), Prefill(6, 1, "b", 3)]
    t = loads(jsonl(*map(op_to_dict, ops)))
    assert list(t.ops) == ops and t.ops.count("accept") == 1
    assert t.tenant_of() == {0: "a", 1: "b"}
    # 0: 20 + 5 = 25 at its peak, 1 of 4 drafts kept: 22, + 1 = 23; the slab holds the peak 25.
    assert t.final_lengths() == {0: 25, 1: 3}
    with pytest.raises(TraceError, match="CSV holds no append draft operation"):
        to_csv(t)


# --- the oracle ------------------------------------------------------------------------------

def test_an_accept_releases_the_blocks_past_the_new_length_and_shrinks_the_tail():
    o = Oracle(make_config(num_blocks=8))
    o.prefill(0, 20, "a", 40, 0)  # ceil(20 / 16) = 2 blocks
    o.append([0], [17], 1, drafts=[16])  # 37 tokens: ceil(37 / 16) = 3 blocks, tail fill 5
    assert (o.blocks_used, o.filled) == (3, 37)
    o.accept(0, 16, 2, 2)  # 37 - (16 - 2) = 23 tokens: ceil(23 / 16) = 2 blocks, tail 23 - 16 = 7
    led = o.expected_ledger()
    assert (led.blocks_used, led.token_states, led.tokens) == (2, 23, {0: 23})
    assert o.blocks[o.seqs[0].table[-1]][1] == 7
    # The released block is the next one taken (pushed on the free stack).
    assert o.free_list(1).tolist() == [2]
    # Positions 21 .. 22 read the kept drafts, nothing from 23 on.
    writers = [w for w, start, count in o.expected_content(0)]
    assert [(start, count) for _, start, count in o.expected_content(0)] == [(0, 20), (20, 1), (21, 2)]
    assert writers[:2] == [0, 0] and writers[2] != 0


def test_a_chunk_block_is_cached_only_once_its_last_token_is_written():
    o = Oracle(make_config(num_blocks=16, prefix_caching=True))
    o.prefill(0, 24, "a", 48, 0, hashes=("h0", "h1", "h2"), prompt_tokens=48)
    o.prefill(1, 48, "a", 48, 1, hashes=("h0", "h1", "h2"))  # between chunks: h0 only
    assert o.hit_blocks == 1
    o.append([0], [24], 2)  # 0 completes h1 (positions 16 .. 31) and h2 (32 .. 47), but 1
    # cached them first: the keys keep 1's blocks
    o.prefill(2, 48, "a", 48, 3, hashes=("h0", "h1", "h2"))
    assert o.hit_blocks == 1 + 3
    assert o.seqs[2].table == o.seqs[1].table


def test_a_preempted_sequence_resumes_with_prefix_hits_and_the_content_it_had():
    o = Oracle(make_config(num_blocks=8, prefix_caching=True))
    o.prefill(0, 40, "a", 40, 0, hashes=("h0", "h1"))  # 3 blocks, 2 hashed
    before = o.expected_content(0)
    o.preempt(0)
    assert (o.blocks_used, len(o.evictable)) == (0, 2)  # the hashed ones wait in the cache
    o.recompute(0, 1)
    assert o.hit_blocks == 2 and o.blocks_used == 3 and o.expected_content(0) == before


# --- the backends ----------------------------------------------------------------------------

LIFECYCLE_TRACE = make_trace(
    Prefill(0, 0, "a", 30, ("h0",)), Append(0, (0,), (5,), (4,)), Accept(0, 0, 1),
    P(1, 18), Append(0, (0, 1), (3, 5), (3, 4)), Accept(0, 1, 4), Accept(0, 0, 0),
    Prefill(0, 2, "a", 20, ("h0", "h1", "h2"), prompt_tokens=50),
    Prefill(0, 3, "a", 40, ("h0", "h1")), Append(0, (2,), (20,)),
    Prefill(0, 4, "a", 40, ("h0", "h1")), Append(0, (2,), (10,)),
    Preempt(0, 0), Append(0, (2,), (1,)), Resume(0, 0), X(1), X(0))


@pytest.mark.parametrize("name", ["numpy", "torch", "numpy-int8", "numpy-int4", "contiguous-max",
                                  "contiguous-oracle", "python-objects"])
def test_each_kvbench_backend_passes_every_lifecycle(name):
    entry = registry.resolve(name)
    ok, why = entry.available()
    if not ok:
        pytest.skip(why)
    v = check(LIFECYCLE_TRACE, entry.create(make_config(num_blocks=32, prefix_caching=True,
                                                        max_context=128)), gather="all")
    assert v.valid is True, str(v.divergence)
    # 0's resume re-prefills 30 + 5 - (4 - 1) + 3 - 3 = 32 tokens
    assert (v.preemptions, v.recomputed_tokens) == (1, 32)


def test_a_backend_without_accept_is_not_applicable_with_the_reason():
    class NoAccept(ObjectModel):  # as a plug-in written before SPEC §13
        name = "no-accept"
        accept = Backend.accept

    v = check(LIFECYCLE_TRACE, NoAccept(make_config(num_blocks=32)))
    assert v.valid is None
    assert v.not_applicable == ("no-accept does not roll back draft tokens with accept (SPEC §13), "
                                "and the trace accepts drafts (speculative decoding)")
    # Preemption asks nothing new of a backend: free, then prefill again.
    preempt_only = make_trace(P(0, 20), Preempt(0, 0), Resume(0, 0), X(0))
    assert check(preempt_only, NoAccept(make_config(num_blocks=32))).valid is True


# Two chunked prompts complete one key in one batched append, in the order the cache learnt of
# them reversed; a window then releases the later writer's block (seq 0 first, batch [1, 0]).
TWO_WRITERS_ONE_KEY = "\n".join(json.dumps(line) for line in [
    {"kvbench_trace": 1, "family": "test", "generator": "tests", "groups": ["sliding(2)"],
     "settings": {"model": "tiny", "block_size": 1, "num_blocks": 8, "prefix_caching": True}},
    {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 1,
     "block_hashes": ["k0", "k1", "k2"], "prompt_tokens": 3},
    {"step": 1, "op": "prefill", "seq": 1, "tenant": "a", "tokens": 1,
     "block_hashes": ["k0", "k1", "k2"], "prompt_tokens": 3},  # hits k0
    {"step": 2, "op": "append", "seqs": [1, 0], "tokens": [1, 1]},  # both write k1: 1's is cached
    {"step": 3, "op": "append", "seqs": [0], "tokens": [1]}]) + "\n"


def test_two_writers_of_one_key_cache_the_first_in_batch_order():
    """The first writer in the batch keeps the key (SPEC §13, docs/writing-a-backend.md); the
    other's copy is freed uncached when the window passes it. At step 3 sliding(2) holds
    positions from max(0, 3 - 2 + 1) // 1 = 2 on, so 0 releases its position 1: uncached, the
    cache holds k0 alone (both released it at step 2: max(0, 2 - 2 + 1) = 1). It could be
    false: a backend caching its writers in the order it learnt of their prompts (0 before 1)
    keeps 0's block of k1 cached as well, 2 cached blocks."""
    from kvbench.analyses.settings import RunSettings as Settings
    trace = loads(TWO_WRITERS_ONE_KEY)
    o = Oracle(Settings().config(trace))
    v = check(trace, None, model=o)
    assert v.valid is None or v.valid, v
    assert o.expected_ledger().cached_blocks == 1  # k0's block alone
    for name in ("numpy", "torch"):
        entry = registry.resolve(name)
        if not entry.available()[0]:
            continue
        v = check(trace, entry.create(Settings().config(trace)), gather="all")
        assert v.valid is True, (name, str(v.divergence))
