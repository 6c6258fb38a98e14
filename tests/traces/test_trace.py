"""The trace format: round trips and every validation error, with the line that has it."""
from __future__ import annotations

import json

import pytest
from conftest import A, K, P, X, make_trace

from kvbench.traces import format as T

HEADER = json.dumps({"kvbench_trace": 1, "family": "test", "generator": "g", "params": {}, "seed": 7})


def sample() -> T.Trace:
    t = make_trace(P(0, 40, "a"), P(1, 7, "b"), A((0, 1), (1, 3)), K(2, 0), A((2, 16), (0, 2), (1, 1)),
                   X(0), A((2, 1),), X(2), name="sample", tenants={"a": 1, "b": 2})
    t.header.params = {"n": 3}
    t.header.seed = 11
    t.header.settings = {"block_size": 16}
    return t


def jsonl(*ops) -> str:
    return "\n".join([HEADER] + [json.dumps(op) for op in ops]) + "\n"


def test_jsonl_round_trip(tmp_path):
    t = sample()
    path = tmp_path / "sample.jsonl"
    T.save(t, str(path))
    back = T.load(str(path))
    assert back.ops == t.ops
    assert back.header.to_dict() == t.header.to_dict()
    assert back.name == "sample"
    assert back.to_jsonl() == path.read_text()


def test_block_hashes_survive_jsonl():
    text = jsonl({"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 32,
                  "block_hashes": ["h0", "h1"]})
    back = T.loads(text)
    assert back.ops[0].block_hashes == ("h0", "h1")
    assert T.loads(back.to_jsonl()).ops == back.ops


def test_csv_round_trip_keeps_batched_appends(tmp_path):
    t = sample()
    path = tmp_path / "sample.csv"
    T.save(t, str(path))
    text = path.read_text()
    # One row per sequence and step: the 3-way append at step 4 is three rows with step 4.
    assert sum(1 for line in text.splitlines() if line.startswith("4,append,")) == 3
    back = T.load(str(path))
    assert back.ops == t.ops
    assert back.ops[4] == T.Append(4, (2, 0, 1), (16, 2, 1))
    assert back.header.to_dict() == t.header.to_dict()


def test_final_lengths_and_tenants():
    t = sample()
    # 0: 40 + 1 + 2 = 43 when freed; 1: 7 + 3 + 1 = 11; 2: forked at 41, + 16 + 1 = 58
    assert t.final_lengths() == {0: 43, 1: 11, 2: 58}
    assert t.tenant_of() == {0: "a", 1: "b", 2: "a"}  # the fork inherits its source's tenant


PREFILL0 = {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 4}


# (operation lines after the header, line of the error, words of the message)
BAD_OPS = [
    ([{"step": 0, "op": "evict", "seq": 0}], 2, "unknown op 'evict'"),
    ([{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": -1}], 2, "'tokens' must be >= 0, got -1"),
    ([{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": -3}], 2, "'tokens' must be >= 0"),
    ([PREFILL0, {"step": 1, "op": "append", "seqs": [0], "tokens": [-1]}], 3, "'tokens[0]' must be >= 0"),
    ([PREFILL0, {"step": 1, "op": "append", "seqs": [5], "tokens": [1]}], 3, "append to unknown sequence 5"),
    ([PREFILL0, {"step": 1, "op": "free", "seq": 0}, {"step": 2, "op": "append", "seqs": [0], "tokens": [1]}],
     4, "append to freed sequence 0"),
    ([PREFILL0, {"step": 1, "op": "fork", "seq": 1, "src": 9}], 3, "fork from unknown sequence 9"),
    ([PREFILL0, {"step": 1, "op": "free", "seq": 0}, {"step": 2, "op": "fork", "seq": 1, "src": 0}],
     4, "fork from freed sequence 0"),
    ([PREFILL0, {"step": 1, "op": "free", "seq": 3}], 3, "free of unknown sequence 3"),
    ([PREFILL0, {"step": 1, "op": "free", "seq": 0}, {"step": 2, "op": "free", "seq": 0}],
     4, "free of freed sequence 0"),
    ([PREFILL0, {"step": 1, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 1}], 3, "duplicate sequence id 0"),
    ([PREFILL0, {"step": 1, "op": "fork", "seq": 0, "src": 0}], 3, "duplicate sequence id 0"),
    # a freed id may not come back either
    ([PREFILL0, {"step": 1, "op": "free", "seq": 0},
      {"step": 2, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 1}], 4, "duplicate sequence id 0"),
    ([{**PREFILL0, "step": 5}, {"step": 5, "op": "free", "seq": 0}], 3, "step 5 is out of order (previous step 5)"),
    ([{**PREFILL0, "step": 5}, {"step": 2, "op": "free", "seq": 0}], 3, "step 2 is out of order"),
    ([PREFILL0, {"step": 1, "op": "append", "seqs": [0, 0], "tokens": [1, 1]}], 3,
     "append names a sequence twice"),
    ([PREFILL0, {"step": 1, "op": "append", "seqs": [0], "tokens": [1, 2]}], 3,
     "append has 1 seqs but 2 token counts"),
    ([PREFILL0, {"step": 1, "op": "append", "seqs": [], "tokens": []}], 3, "empty batch"),
    ([{"op": "free", "seq": 0}], 2, "missing field 'step'"),
    ([{"step": "0", "op": "free", "seq": 0}], 2, "'step' must be an integer"),
    ([{"step": 0, "op": "prefill", "seq": 0, "tokens": 4}], 2, "non-empty string 'tenant'"),
]


@pytest.mark.parametrize("ops, line, message", BAD_OPS, ids=[m for _, _, m in BAD_OPS])
def test_validation_errors_name_the_line(ops, line, message):
    with pytest.raises(T.TraceError, match="^bad.jsonl:%d: .*" % line) as err:
        T.loads(jsonl(*ops), path="bad.jsonl")
    assert message in err.value.reason
    assert err.value.line == line and err.value.path == "bad.jsonl"


def test_bad_json_names_the_line():
    text = HEADER + "\n" + json.dumps(PREFILL0) + "\n{\"step\": 1, \"op\": \n"
    with pytest.raises(T.TraceError, match="not valid JSON") as err:
        T.loads(text, path="x.jsonl")
    assert err.value.line == 3


@pytest.mark.parametrize("first_line, message", [
    (json.dumps(PREFILL0), "first line must be a header"),
    (json.dumps({"kvbench_trace": 2, "family": "test"}), "version 2 is not known"),
    (json.dumps({"kvbench_trace": 1}), "non-empty 'family'"),
    (json.dumps({"kvbench_trace": 1, "family": "t", "tenants": {"a": 0}}), "tenant 'a' weight"),
    (json.dumps([1, 2]), "first line must be a header"),
])
def test_header_errors_are_on_line_1(first_line, message):
    with pytest.raises(T.TraceError, match=message) as err:
        T.loads(first_line + "\n" + json.dumps(PREFILL0) + "\n")
    assert err.value.line == 1


def test_empty_trace_has_no_header():
    with pytest.raises(T.TraceError, match="no header"):
        T.loads("\n\n")


def test_blank_lines_keep_line_numbers():
    text = HEADER + "\n\n" + json.dumps(PREFILL0) + "\n\n" + json.dumps({"step": 1, "op": "free", "seq": 4})
    with pytest.raises(T.TraceError) as err:
        T.loads(text)
    assert err.value.line == 5  # header 1, blank 2, prefill 3, blank 4, bad free 5


def test_validate_in_memory_ops_counts_the_header_as_line_1():
    t = T.Trace(T.Header("test"), [T.Prefill(0, 0, "a", 4), T.Free(1, 0), T.Free(2, 0)], name="mem")
    with pytest.raises(T.TraceError, match="^mem:4: free of freed sequence 0"):
        T.validate(t)


CSV_HEAD = "# " + HEADER + "\nstep,op,seq,tenant,tokens,src\n"


@pytest.mark.parametrize("rows, line, message", [
    # line 1 is the header, line 2 the column names: the first row is line 3
    ("0,prefill,0,a,4,\n1,append,0,,1,\n1,append,0,,2,\n", 4, "append names a sequence twice"),
    ("0,prefill,0,a,4,\n1,append,7,,1,\n", 4, "append to unknown sequence 7"),
    ("0,prefill,0,a,4,\n1,fork,1,,,3\n", 4, "fork from unknown sequence 3"),
    ("0,prefill,0,a,x,\n", 3, "not an integer"),
    ("0,prefill,0,a,4,\n1,copy,0,,,\n", 4, "unknown op 'copy'"),
    ("3,prefill,0,a,4,\n2,free,0,,,\n", 4, "out of order"),
])
def test_csv_errors_name_the_line(rows, line, message):
    with pytest.raises(T.TraceError, match=message) as err:
        T.loads_csv(CSV_HEAD + rows, path="bad.csv")
    assert err.value.line == line


def test_csv_needs_its_header_and_columns():
    with pytest.raises(T.TraceError, match="first line must be") as err:
        T.loads_csv("step,op,seq,tenant,tokens,src\n0,prefill,0,a,4,\n")
    assert err.value.line == 1
    with pytest.raises(T.TraceError, match="columns must be") as err:
        T.loads_csv("# " + HEADER + "\nstep,op,seq\n0,free,0\n")
    assert err.value.line == 2
    with pytest.raises(T.TraceError, match="header is not valid JSON"):
        T.loads_csv("# {nope\nstep,op,seq,tenant,tokens,src\n")
