"""The checker passes correct backends on hand-made traces, and its verdict is data."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import A, K, P, X, backends, make_config, make_trace

from impls.numpy_paged import NumpyPaged
from impls.object_model import ObjectModel
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.protocol import Capabilities

BACKENDS = backends()  # every registered backend but the engines
POLICIES = [None, "lru", "lfu", "fair"]


def create(name, **config):
    config.setdefault("max_context", 64)  # `max` reservation: no sequence below is longer
    return registry.create(name, make_config(**config))


FORK_COW = make_trace(
    P(0, 40), K(1, 0), K(2, 0),
    A((0, 1), (1, 1), (2, 1)),  # three sharers of one tail: two copies, one in place
    A((1, 20),),
    X(0), K(3, 1),              # fork of a fork
    A((3, 2), (1, 2)),          # 3 copies the tail it shares with 1; 1 then writes in place
    X(1), A((2, 3), (3, 1)), X(2), X(3),
    name="fork-cow")

OOM = make_trace(
    P(0, 40), P(1, 30),
    P(2, 40),                   # paged: 3 blocks needed, 1 free: refused
    A((2, 1), (0, 1)),          # 2 was refused: only 0 appends
    K(3, 0), A((3, 8), (0, 8)),  # copy-on-write plus a spill: refused in a full pool
    X(1), P(4, 20), A((4, 5),), X(0), X(4),
    name="oom")

TENANTS = make_trace(
    P(0, 30, "a"), P(1, 20, "b"), A((0, 2), (1, 2)), P(2, 25, "a"),
    K(3, 1), A((3, 4), (1, 1)),
    P(4, 40, "c"),              # over the budget: someone is evicted
    A((0, 3), (2, 1)),          # an evicted sequence is recomputed first
    P(5, 12, "b"), A((4, 2), (5, 2), (3, 1)), X(0), K(6, 4), A((6, 9),), X(4), X(1),
    name="tenants", tenants={"a": 1, "b": 2, "c": 1})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trace", [FORK_COW, OOM, TENANTS], ids=lambda t: t.name)
@pytest.mark.parametrize("policy", POLICIES)
def test_correct_backends_pass(backend, trace, policy):
    b = create(backend, block_size=16, num_blocks=6, policy=policy,
               tenant_weights=dict(trace.header.tenants))
    v = check(trace, b, gather="all")
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(trace) and v.divergence is None and v.status == "pass"


@pytest.mark.parametrize("backend", ["numpy", "python-objects"])
def test_paged_oom_trace_counts_refusals(backend):
    v = check(OOM, create(backend, num_blocks=6))
    # 6 blocks: 0 holds 3 (40 tokens), 1 holds 2 (30): P(2, 40) needs 3 of 1 free (refused).
    # 0 appends 1 (41 tokens, in its tail). Fork: 0 and 3 share 3 blocks (tail 9 of 16).
    # A(3: 8, 0: 8): 3 copies the tail and both spill 1 token: 3 blocks, 1 free (refused).
    assert v.valid and v.ooms == 2 and v.evictions == 0


def test_eviction_counts_on_the_tenant_trace():
    v = check(TENANTS, create("numpy", num_blocks=6, policy="lru", tenant_weights={"a": 1, "b": 2, "c": 1}))
    assert v.valid and v.evictions > 0 and v.recomputed_tokens > 0 and v.ooms == 0


@pytest.mark.parametrize("gather", ["touched", "all", "end", "none"])
def test_gather_modes(gather):
    v = check(FORK_COW, create("numpy"), gather=gather)
    assert v.valid
    if gather == "none":
        assert v.gathers == 0 and v.skipped == {"kv content": "gather='none'"}
    elif gather == "end":
        assert v.gathers == 0  # the trace ends with every sequence freed
    else:
        assert v.gathers > 0


def test_skipped_checks_are_named():
    assert check(FORK_COW, create("python-objects")).skipped == {"kv content": "backend holds no K/V"}
    assert check(FORK_COW, create("numpy", store_kv=False)).skipped == {"kv content": "store_kv is off"}
    skipped = check(FORK_COW, create("contiguous-oracle")).skipped
    assert skipped == {"blocks": "contiguous layout has no blocks"}


def test_series_has_one_row_per_operation():
    v = check(FORK_COW, create("numpy"), series=True)
    assert [r["step"] for r in v.series] == list(range(len(FORK_COW)))
    assert v.series[1]["blocks_used"] == 3  # after the first fork: ceil(40/16), shared


class NoFork(NumpyPaged):
    name = "numpy-nofork"
    capabilities = dataclasses.replace(NumpyPaged.capabilities, fork=False)


class NoEviction(ObjectModel):
    name = "objects-noevict"
    capabilities = Capabilities(layout="paged", holds_kv=False, eviction=())


def test_not_applicable_without_fork():
    v = check(FORK_COW, NoFork(make_config()))
    assert v.valid is None and v.status == "n/a" and v.ops == 0
    assert v.not_applicable == "numpy-nofork does not support fork (SPEC §2), and the trace forks"
    v = check(make_trace(P(0, 4), A((0, 1),)), NoFork(make_config()))
    assert v.valid is True  # no fork in this trace


def test_not_applicable_without_the_policy():
    v = check(OOM, NoEviction(make_config(num_blocks=6, policy="lfu")))
    assert v.valid is None and "does not implement eviction policy 'lfu'" in v.not_applicable


class WrongTokens(NumpyPaged):
    """Reports one token too many for sequence 1."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        if 1 in led.tokens:
            led.tokens[1] += 1
        return led


def test_verdict_is_data():
    v = check(FORK_COW, WrongTokens(make_config()))
    assert v.valid is False and v.status == "FAIL"
    d = v.divergence
    # The fork at op #1 (step 1) creates sequence 1 with 40 tokens.
    assert (d.trace, d.index, d.step, d.quantity, d.expected, d.actual) == \
        ("fork-cow", 1, 1, "tokens", {0: 40, 1: 40}, {0: 40, 1: 41})
    assert d.op == {"step": 1, "op": "fork", "seq": 1, "src": 0}
    assert d.detail == "sequence 1: expected 40, got 41"
    assert v.ops == 1  # operations that passed before the divergence
    record = v.as_dict()
    assert record["status"] == "FAIL" and record["divergence"]["quantity"] == "tokens"
    assert "series" not in record
    assert str(d).startswith("fork-cow: step 1 (op #1 ")


def test_more_sequences_than_the_initial_rows():
    # 100 prompts and 100 forks: more rows than the NumPy backend starts with (64).
    specs = [P(s, 1 + s % 40) for s in range(100)]
    specs += [K(100 + s, s) for s in range(100)]
    specs += [A(*[(s, 1) for s in range(0, 200, 3)])]
    trace = make_trace(*specs, name="many")
    for name in BACKENDS:
        v = check(trace, create(name, num_blocks=400, max_context=64), gather="end")
        assert v.valid, f"{name}: {v.divergence}"


HUGE_ID = 2**62  # a legal trace id (any int >= 0), e.g. a hashed request id


@pytest.mark.parametrize("backend", ["numpy", "contiguous-oracle", "python-objects"])
def test_large_sequence_ids(backend):
    trace = make_trace(P(HUGE_ID, 20), K(HUGE_ID + 1, HUGE_ID), A((HUGE_ID + 1, 1),), X(HUGE_ID),
                       name="huge-ids")
    v = check(trace, create(backend))
    assert v.valid, str(v.divergence)


def test_the_random_window_is_read_into_a_buffer_of_the_checkers():
    from impls.faults import WrongTailIntoBuffer
    # One live sequence of 21 tokens, at most 4 blocks of 16: the window is all of it, 0 .. 21,
    # read by gather(0, 0, 21, out=). Its last block, positions 16 .. 20 (21 // 16 * 16 = 16),
    # comes from block 0 when read into the buffer.
    trace = make_trace(P(0, 21), X(0))
    d = check(trace, WrongTailIntoBuffer(make_config())).divergence
    assert (d.index, d.quantity) == (0, "kv of sequence 0")
    assert d.detail == ("first wrong position 16 (should hold what sequence 0 wrote there); "
                        "read by gather(0, 0, 21, out=) into the caller's buffer")
    # Read without a buffer (every sequence whole after every operation), it reads right.
    assert check(trace, WrongTailIntoBuffer(make_config()), gather="all").valid is True


def test_a_gather_without_out_is_read_as_before():
    # A plug-in written before ranges and buffers: its window is sliced from a whole gather.
    with pytest.warns(DeprecationWarning, match=r"WholeOnly\.gather\(seq\) is the old form"):
        class WholeOnly(NumpyPaged):
            def gather(self, seq):
                return super().gather(seq)

    v = check(FORK_COW, WholeOnly(make_config(num_blocks=6)))
    assert v.valid is True and v.gathers > 0
