"""Traces as columns: the same operations, the same validation verdicts and messages as the op
objects, and a few dozen bytes per operation."""
from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from conftest import A, K, P, X, make_trace
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.traces import columns as C
from kvbench.traces import format as T
from kvbench.traces import generators as G
from kvbench.traces.columns import OpTable
from kvbench.traces.ops import Append, Fork, Free, Prefill

HEADER = T.Header(family="test", generator="tests")


def verdict(trace: T.Trace):
    try:
        T.validate(trace)
        return "valid"
    except T.TraceError as e:
        return str(e)


# Histories over a handful of ids, with the mistakes validation exists for: steps out of order,
# ids reused, negative ids, empty or zero-token batches, a sequence twice in a batch, appends,
# forks and frees of unknown or freed sequences, empty tenants.
ids = st.integers(-1, 4)
steps = st.integers(-1, 3)
ops = st.one_of(
    st.builds(Prefill, steps, ids, st.sampled_from(["a", "b", ""]), st.integers(-1, 40)),
    st.builds(lambda s, pairs: Append(s, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)),
              steps, st.lists(st.tuples(ids, st.integers(-1, 3)), max_size=3)),
    st.builds(Fork, steps, ids, ids),
    st.builds(Free, steps, ids),
)


def history(deltas_and_ops):
    """Steps made mostly increasing: each op's step is the previous one plus its drawn delta."""
    out, step = [], -1
    for op in deltas_and_ops:
        step += op.step
        out.append(type(op)(step, *[getattr(op, f) for f in op.__dataclass_fields__ if f != "step"]))
    return out


@settings(max_examples=400, deadline=None)
@given(st.lists(ops, max_size=12))
def test_columns_validate_like_the_op_by_op_validator(drawn):
    hist = history(drawn)
    as_ops = T.Trace(HEADER, hist, name="h")
    as_columns = T.Trace(HEADER, OpTable.from_ops(hist), name="h")
    assert verdict(as_columns) == verdict(as_ops)


@contextlib.contextmanager
def members_at_a_time(n):
    """Validation and lengths a few batch members (and operations) at a time: every chunk edge
    reached."""
    saved = C.VALIDATE_CHUNK_MEMBERS, C.VALIDATE_CHUNK_OPS
    C.VALIDATE_CHUNK_MEMBERS = C.VALIDATE_CHUNK_OPS = n
    try:
        yield
    finally:
        C.VALIDATE_CHUNK_MEMBERS, C.VALIDATE_CHUNK_OPS = saved


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=12), st.integers(1, 3))
def test_columns_validate_alike_a_few_batch_members_at_a_time(drawn, members):
    hist = history(drawn)
    expected = verdict(T.Trace(HEADER, hist, name="h"))
    with members_at_a_time(members):
        assert verdict(T.Trace(HEADER, OpTable.from_ops(hist), name="h")) == expected


def test_a_history_error_before_a_bad_field_is_the_one_named():
    lines = [json.dumps(HEADER.to_dict() | {"kvbench_trace": 1}),
             json.dumps({"step": 0, "op": "append", "seqs": [7], "tokens": [1]}),  # unknown 7
             json.dumps({"step": 1, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 0})]
    with pytest.raises(T.TraceError, match="^t.jsonl:2: append to unknown sequence 7"):
        T.loads("\n".join(lines), path="t.jsonl")


TRACES = [
    make_trace(P(0, 40, "a"), P(1, 7, "b"), A((0, 1), (1, 3)), K(2, 0), A((2, 16), (0, 2), (1, 1)),
               K(3, 2), X(0), A((2, 1), (3, 5)), X(2), name="forks"),
    G.generate("fork_trees", 3, mode="parallel"),
    G.generate("fork_trees", 4, mode="beam"),
    G.generate("tenant_mixes", 1),
    G.generate("decode_streams", 2),
]


@pytest.mark.parametrize("trace", TRACES, ids=lambda t: t.name)
def test_columns_know_what_the_ops_know(trace):
    table = trace.columnar()
    assert list(table.ops) == list(trace.ops) and table.ops == trace.ops
    assert table.final_lengths() == trace.final_lengths()
    with members_at_a_time(3):
        assert table.ops.final_lengths() == trace.final_lengths()
    assert table.tenant_of() == trace.tenant_of()
    assert T.loads(table.to_jsonl()).ops == trace.ops
    assert table.ops[3] == trace.ops[3] and table.ops[-1] == trace.ops[-1]
    assert table.ops[1:4] == trace.ops[1:4]


@pytest.mark.parametrize("trace", TRACES, ids=lambda t: t.name)
def test_columns_built_a_few_rows_at_a_time_hold_the_same_ops(trace):
    saved = C._CHUNK, C._CHUNK_MEMBERS
    C._CHUNK, C._CHUNK_MEMBERS = 3, 2  # every column grown in place several times, read back in chunks
    try:
        table = OpTable.from_ops(trace.ops)
        assert list(table) == list(trace.ops)
        assert len(table.flat_seq) == sum(len(op.seqs) for op in trace.ops if isinstance(op, Append))
    finally:
        C._CHUNK, C._CHUNK_MEMBERS = saved


def test_a_value_beyond_int32_widens_its_column_and_loads_whole(tmp_path):
    big_id, big_step = 2**40 + 5, 2**33
    ops = [Prefill(0, 0, "a", 5), Prefill(1, 1, "b", 3), Append(2, (0, 1), (1, 1)),  # a chunk: int32
           Append(3, (0,), (1,)), Prefill(big_step, big_id, "a", 7),
           Append(big_step + 1, (big_id, 0), (1, 2)), Free(big_step + 2, big_id)]
    saved, C._CHUNK = C._CHUNK, 3
    try:
        table = OpTable.from_ops(ops)
        path = tmp_path / "t.jsonl"
        T.save(T.Trace(HEADER, ops, name="t"), str(path))
        loaded = T.load(str(path)).ops
    finally:
        C._CHUNK = saved
    for t in (table, loaded):
        assert list(t) == ops
        assert t.step.dtype == t.seq.dtype == t.flat_seq.dtype == np.int64  # widened
        assert t.src.dtype == t.tokens.dtype == t.flat_tok.dtype == np.int32  # still narrow
        assert t.final_lengths() == {0: 5 + 1 + 1 + 2, 1: 3 + 1, big_id: 7 + 1}


@pytest.mark.parametrize("members", [1, 2, 3])
def test_chunked_validation_names_the_first_bad_line_at_a_chunk_edge(members):
    # Ops (line = index + 2): prefills of 0, 1, 2; append (0, 1, 2); free 1; append (0, 2);
    # append (0, 1): 1 is freed, the error is op 6, line 8, whatever the chunk edges.
    lines = [json.dumps(HEADER.to_dict() | {"kvbench_trace": 1})]
    lines += [json.dumps({"step": i, "op": "prefill", "seq": i, "tenant": "a", "tokens": 4}) for i in range(3)]
    lines += [json.dumps({"step": 3, "op": "append", "seqs": [0, 1, 2], "tokens": [1, 1, 1]}),
              json.dumps({"step": 4, "op": "free", "seq": 1}),
              json.dumps({"step": 5, "op": "append", "seqs": [0, 2], "tokens": [1, 1]}),
              json.dumps({"step": 6, "op": "append", "seqs": [0, 1], "tokens": [1, 1]})]
    with members_at_a_time(members), pytest.raises(T.TraceError, match="^t.jsonl:8: append to freed sequence 1"):
        T.loads("\n".join(lines), path="t.jsonl")


@pytest.mark.parametrize("ops", [1, 2, 3, 4])
def test_chunked_validation_sees_a_step_out_of_order_across_a_chunk_edge(ops):
    # Steps 0, 1, 2, 2: op 3 (line 5) repeats op 2's step, in the same chunk or the next one.
    lines = [json.dumps(HEADER.to_dict() | {"kvbench_trace": 1})]
    lines += [json.dumps({"step": step, "op": "prefill", "seq": i, "tenant": "a", "tokens": 4})
              for i, step in enumerate([0, 1, 2, 2])]
    with members_at_a_time(ops), pytest.raises(T.TraceError, match="^t.jsonl:5: step 2 is out of order"):
        T.loads("\n".join(lines), path="t.jsonl")


def test_bytes_per_operation():
    trace = G.generate("decode_streams", 0, num_requests=64, max_batch=16).columnar()
    t = trace.ops
    n, flat = len(t), int(t.batch[-1])
    # kind 1 byte, step / seq / src / tokens 4 each (int32: the values fit), tenant 4, batch
    # offsets 8 (n + 1 of them); each (sequence, tokens) of a batch 8 bytes.
    assert t.nbytes == n * (1 + 4 * 4 + 4 + 8) + 8 + 8 * flat
    assert t.nbytes / n < 16 * 16 + 64  # batches of up to 16: a few hundred bytes at most


def test_a_file_streams_into_columns(tmp_path):
    trace = TRACES[0]
    path = tmp_path / "t.jsonl"
    T.save(trace, str(path))
    loaded = T.load(str(path))
    assert isinstance(loaded.ops, OpTable) and loaded.ops == trace.ops
    csv_path = tmp_path / "t.csv"
    T.save(loaded, str(csv_path))
    back = T.load(str(csv_path))
    assert isinstance(back.ops, OpTable) and back.ops == trace.ops
    assert np.array_equal(back.ops.flat_tok, loaded.ops.flat_tok)


@pytest.mark.parametrize("prefill, named", [
    (Prefill(0, 0, "a", 32), False),
    (Prefill(0, 0, "a", 32, block_hashes=()), False),  # no full block named
    (Prefill(0, 0, "a", 32, block_hashes=(7, 8)), True),
    (Prefill(0, 0, "a", 3, token_ids=(1, 2, 3)), True),
    (Prefill(0, 0, "a", 32, salt="s"), False),  # a salt alone names no block
])
def test_names_prompt_blocks_from_objects_and_from_columns(prefill, named):
    ops = [prefill, Append(1, (0,), (1,)), Free(2, 0)]
    header = T.Header(family="t")
    assert T.Trace(header, ops).names_prompt_blocks() is named
    assert T.Trace(header, OpTable.from_ops(ops)).names_prompt_blocks() is named
