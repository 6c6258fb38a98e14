"""`check(keep_going=True)` / `kvbench check --keep-going`: every class of divergence with its first
step and count, to the last operation where the states stay comparable, and a stop where not."""
from __future__ import annotations

import json

from conftest import A, K, P, X, counting_calls, make_config, make_trace

from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check
from kvbench.cli import main
from kvbench.traces.format import save

TRACE = make_trace(P(0, 40), K(1, 0), A((1, 3), (0, 2)), P(2, 20), X(0), A((2, 5),), X(1), X(2),
                   name="keep-going")


class HitsOneHigh(counting_calls(NumpyPaged)):
    """Reports one more prefix-hit block than it found, from its third call on: a figure that
    differs from the oracle's, no identity of its own broken (a cached-block count one high
    would be: its free structure lists one fewer)."""

    name = "hits-one-high"

    def ledger(self, *a, **kw):
        led = super().ledger(*a, **kw)
        if self.calls >= 3:
            led.prefix_hit_blocks += 1
        return led


class WrongKvAfterFork(NumpyPaged):
    """Returns the K/V of the wrong sequence for any sequence made by a fork."""

    name = "wrong-kv"
    forked: set = set()

    def fork(self, seq, src, **kw):
        self.forked = self.forked | {seq}
        return super().fork(seq, src, **kw)

    def gather(self, seq, start=0, stop=None, *, out=None):
        got = super().gather(seq, start, stop, out=out)
        if seq in self.forked:
            got = got + 1
        return got


def config():
    return make_config(block_size=16, num_blocks=8)


def test_without_keep_going_the_first_divergence_stops_the_replay():
    v = check(TRACE, HitsOneHigh(config()), gather="none")
    assert (v.status, v.divergence.quantity, v.divergence.step) == ("FAIL", "prefix_hit_blocks", 2)
    assert v.ops == 2 and v.divergences == []  # stopped in op #2, before it was counted


def test_keep_going_checks_to_the_last_operation_and_counts_the_class():
    v = check(TRACE, HitsOneHigh(config()), gather="none", keep_going=True)
    assert v.status == "FAIL" and v.ops == len(TRACE)
    # Wrong from op #2 on (its third call): ops #2 .. #7, 6 of them.
    assert [(c["kind"], c["count"], c["first"].step, c["stopped"]) for c in v.divergences] == \
        [("prefix_hit_blocks", len(TRACE) - 2, 2, False)]
    assert v.divergence is v.divergences[0]["first"]  # the first divergence is still the first


def test_keep_going_still_stops_at_wrong_kv():
    v = check(TRACE, WrongKvAfterFork(config()), gather="all", keep_going=True)
    assert v.status == "FAIL"
    assert v.divergence.quantity == "kv of sequence 1" and v.divergence.step == 1  # the fork
    assert v.ops == 1  # stopped there


def test_the_command_lists_every_class(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    save(TRACE, str(path))
    code = main(["check", str(path), "--backend", "test_keep_going:HitsOneHigh", "--keep-going",
                 "--gather", "none"])
    out = capsys.readouterr().out
    assert code == 1
    assert "divergences: prefix_hit_blocks x6 from step 2" in out  # 6 = ops #2 .. #7
    json.dumps(check(TRACE, HitsOneHigh(config()), gather="none", keep_going=True).as_dict(),
               default=str)  # a verdict that kept going is still data
