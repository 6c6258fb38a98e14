"""The trace format's tiers and transfers (SPEC §11): header tiers, store / load / done / abort
lines that round-trip, old traces unchanged, and ill-formed transfer histories refused with the
file, the line and the reason."""
import json

import pytest

from kvbench.traces.tier_ops import TierSpec
from kvbench.traces import format as F
from kvbench.traces.tier_ops import Abort, Done, Load, Lookup, Store

HEADER = {"kvbench_trace": 1, "family": "tiers",
          "tiers": [{"name": "host", "capacity": 8}, {"name": "disk", "capacity": 32, "policy": "arc"}]}
P0 = {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 32, "block_hashes": [1, 2]}


def text(*ops, header=HEADER):
    return "".join(json.dumps(x) + "\n" for x in (header,) + ops)


LU1 = {"step": 1, "op": "lookup", "seq": 1, "tenant": "a", "tokens": 40, "block_hashes": [1, 2],
       "salt": "s"}


def test_lookup_round_trips_and_ends_at_its_load_abort_or_free():
    t = F.loads(text(P0, LU1, {"step": 2, "op": "load", "id": 1, "seq": 1, "tenant": "a",
                               "tokens": 40, "block_hashes": [1, 2], "salt": "s"},
                     {"step": 3, "op": "done", "id": 1},
                     {**LU1, "step": 4, "seq": 2}, {"step": 5, "op": "abort", "seq": 2},
                     {**LU1, "step": 6, "seq": 3}, {"step": 7, "op": "free", "seq": 3}), "l.jsonl")
    ops = list(t.ops)
    assert ops[1] == Lookup(1, 1, "a", 40, (1, 2), "s")
    assert list(F.loads(t.to_jsonl(), "again.jsonl").ops) == ops
    assert t.final_lengths() == {0: 32, 1: 40}  # a request aborted before its load had no length


def test_lookup_needs_declared_tiers():
    with pytest.raises(F.TraceError, match="op 'lookup' in a trace whose header declares no 'tiers'"):
        F.loads(text(P0, LU1, header={"kvbench_trace": 1, "family": "x"}), "n.jsonl")


def test_round_trip_and_ops():
    t = F.loads(text(P0,
                     {"step": 1, "op": "store", "id": 1, "seq": 0, "tier": "host", "blocks": [1]},
                     {"step": 2, "op": "free", "seq": 0},
                     {"step": 3, "op": "done", "id": 1, "ok": False},
                     {"step": 4, "op": "load", "id": 2, "seq": 1, "tenant": "a", "tokens": 40,
                      "block_hashes": [1, 2]},
                     {"step": 5, "op": "done", "id": 2},
                     {"step": 6, "op": "abort", "seq": 1}), "t.jsonl")
    assert t.header.tiers == (TierSpec("host", 8, "lru"), TierSpec("disk", 32, "arc"))
    ops = list(t.ops)
    assert ops[1] == Store(1, 1, 0, "host", (1,))
    assert ops[3] == Done(3, 1, False)
    assert isinstance(ops[4], Load) and ops[4].id == 2 and ops[4].block_hashes == (1, 2)
    assert ops[6] == Abort(6, 1)
    again = F.loads(t.to_jsonl(), "again.jsonl")
    assert list(again.ops) == ops and again.header.tiers == t.header.tiers
    assert t.final_lengths() == {0: 32, 1: 40}
    assert F.validate(F.Trace(t.header, ops)) is not None  # the same rules on a list of ops


def test_a_tier_declares_what_a_failed_load_leaves():
    header = {**HEADER, "tiers": [{"name": "host", "capacity": 8, "failed_load": "drop"},
                                  {"name": "disk", "capacity": 32}]}
    t = F.loads(text(P0, header=header), "f.jsonl")
    assert [s.failed_load for s in t.header.tiers] == ["drop", "keep"]  # keep when absent
    # written back only where it is not the default: a trace without it reads as before
    assert t.header.to_dict()["tiers"] == [{"name": "host", "capacity": 8, "policy": "lru",
                                            "failed_load": "drop"},
                                           {"name": "disk", "capacity": 32, "policy": "lru"}]
    assert F.loads(t.to_jsonl(), "again.jsonl").header.tiers == t.header.tiers


def test_old_trace_has_no_tiers():
    t = F.loads(text(P0, {"step": 1, "op": "free", "seq": 0},
                     header={"kvbench_trace": 1, "family": "x"}))
    assert t.header.tiers == () and "tiers" not in t.header.to_dict()
    assert t.ops.side == {}


@pytest.mark.parametrize("ops, line, reason", [
    ([{"step": 1, "op": "done", "id": 4}], 3, "completion of transfer 4, which never began"),
    ([{"step": 1, "op": "store", "id": 1, "seq": 0, "tier": "host"},
      {"step": 2, "op": "done", "id": 1}, {"step": 3, "op": "done", "id": 1}], 5,
     "completion of transfer 1, which already completed"),
    ([{"step": 1, "op": "store", "id": 1, "seq": 0, "tier": "host"},
      {"step": 2, "op": "store", "id": 1, "seq": 0, "tier": "disk"}], 4, "transfer id 1 is already used"),
    ([{"step": 2, "op": "store", "id": 1, "seq": 0, "tier": "host"},
      {"step": 1, "op": "done", "id": 1}], 4, "step 1 is out of order"),
    ([{"step": 1, "op": "store", "id": 1, "seq": 0, "tier": "tape"}], 3, "tier 'tape', which the header"),
    ([{"step": 1, "op": "free", "seq": 0}, {"step": 2, "op": "store", "id": 1, "seq": 0, "tier": "host"}],
     4, "store of sequence 0, which is not live"),
    ([{"step": 1, "op": "load", "id": 1, "seq": 1, "tenant": "a", "tokens": 16},
      {"step": 2, "op": "append", "seqs": [1], "tokens": [1]}], 4, "append of sequence 1 while its load 1"),
    ([{"step": 1, "op": "load", "id": 1, "seq": 1, "tenant": "a", "tokens": 16},
      {"step": 2, "op": "free", "seq": 1}], 4, "free of sequence 1 while its load 1"),
    ([{"step": 1, "op": "load", "id": 1, "seq": 1, "tenant": "a", "tokens": 16},
      {"step": 2, "op": "abort", "seq": 1}, {"step": 3, "op": "done", "id": 1}], 5,
     "already completed (or was aborted)"),
    ([{"step": 1, "op": "abort", "seq": 3}], 3, "abort of unknown sequence 3"),  # not "free of"
    ([{"step": 1, "op": "free", "seq": 0}, {"step": 2, "op": "abort", "seq": 0}], 4,
     "abort of freed sequence 0"),
    ([{"step": 1, "op": "store", "id": 1, "seq": 0, "tier": "host", "blocks": [0, 0]}], 3,
     "'blocks' names a position twice"),
    ([{"step": 1, "op": "done", "id": 1, "ok": "yes"}], 3, "field 'ok' must be true or false"),
    ([{"step": 1, "op": "store", "id": 1, "seq": 0, "tier": "host", "block": [0]}], 3,
     "unknown field 'block' of op 'store'"),
    ([LU1, {**LU1, "step": 2}], 4, "lookup of sequence 1, whose lookup at step 1 has no load yet"),
    ([{**LU1, "seq": 0}], 3, "lookup of live sequence 0"),
    ([{"step": 1, "op": "free", "seq": 0}, {**LU1, "step": 2, "seq": 0}], 4,
     "lookup of freed sequence 0"),
    ([LU1, {"step": 2, "op": "prefill", "seq": 1, "tenant": "a", "tokens": 16}], 4,
     "prefill of sequence 1, looked up at step 1"),
    ([LU1, {"step": 2, "op": "abort", "seq": 1}, {"step": 3, "op": "abort", "seq": 1}], 5,
     "abort of unknown sequence 1"),  # the lookup's abort ended the request
])
def test_ill_formed_history(ops, line, reason):
    with pytest.raises(F.TraceError) as e:
        F.loads(text(P0, *ops), "bad.jsonl")
    assert (e.value.path, e.value.line) == ("bad.jsonl", line)
    assert reason in e.value.reason


def test_transfers_need_declared_tiers():
    with pytest.raises(F.TraceError, match="declares no 'tiers'") as e:
        F.loads(text(P0, {"step": 1, "op": "store", "id": 1, "seq": 0, "tier": "host"},
                     header={"kvbench_trace": 1, "family": "x"}), "n.jsonl")
    assert e.value.line == 3


@pytest.mark.parametrize("tiers, reason", [
    ([], "'tiers' must be a non-empty list"),
    ([{"name": "host", "capacity": -1}], "capacity must be an integer >= 0"),
    ([{"name": "host", "capacity": 4, "policy": "fifo"}], "unknown policy 'fifo'"),
    ([{"name": "host", "capacity": 4}, {"name": "host", "capacity": 8}], "a name given twice"),
    ([{"name": "device", "capacity": 4}], "a name other than 'device'"),
    ([{"name": "host", "size": 4}], "unknown field 'size'"),
    ([{"name": "host", "capacity": 4, "failed_load": "retry"}],
     "'failed_load' must be one of keep, drop, got 'retry'"),
])
def test_bad_tiers_header(tiers, reason):
    with pytest.raises(F.TraceError, match=reason) as e:
        F.loads(text(P0, header={"kvbench_trace": 1, "family": "x", "tiers": tiers}), "h.jsonl")
    assert e.value.line == 1


def test_csv_refuses_transfers():
    plain = {k: v for k, v in P0.items() if k != "block_hashes"}  # CSV refuses hashes too
    t = F.loads(text(plain, {"step": 1, "op": "store", "id": 1, "seq": 0, "tier": "host"}))
    with pytest.raises(F.TraceError, match="CSV holds no store operation"):
        F.to_csv(t)
