"""The regression gates (kvbench/bench/gates.py): CI runs them here on every submission.

Exact gates compare deterministic memory and error figures with results/gates/expected.json;
ratio gates compare speed ratios measured in the same run with a recorded baseline
(results/gates/ratios.json) by a Mann-Whitney test of the blocks.
Planted regressions show that each kind fails, and say why.
"""
import copy
import math
import os

import numpy as np
import pytest

from impls.numpy_paged import NumpyPaged
from kvbench.bench import gates as G
from kvbench.bench import ratios as R
from kvbench.checking import driver
from kvbench.analyses import suite
from kvbench.cli import gates as gates_cli
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Free, Header, Prefill, Trace

common = G.bench_common()


# --- planted regressions ---------------------------------------------------------------------------


class WastefulNumpy(NumpyPaged):
    """Takes one block more than each prefill needs and keeps it until the sequence goes."""

    def __init__(self, config):
        super().__init__(config)
        self.extra = {}

    def prefill(self, seq, prompt, kv=None, **kw):
        victims = super().prefill(seq, prompt, kv, **kw)
        if self.free_top > 0:
            self.extra[seq] = int(self._take(1)[0])
        return victims

    def _drop_row(self, r):
        seq = int(self.seq_of_row[r])
        super()._drop_row(r)
        block = self.extra.pop(seq, None)
        if block is not None:
            self.refcount[block] = 0
            self.free_stack[self.free_top] = block
            self.free_top += 1


class PerTokenNumpy(NumpyPaged):
    """Right answers, slowly: one call per sequence in a decode step, one token at a time in a
    gather."""

    def append(self, seqs, tokens, kv=None, *, step=0):
        victims, start = [], 0
        for s, t in zip(seqs, tokens):
            part = None if kv is None else kv[start:start + t]
            victims += super().append([s], [t], part, step=step)
            start += t
        return tuple(victims)

    def gather(self, seq, start=0, stop=None, *, out=None):
        r = self._row(seq)
        stop = int(self.tokens[r]) if stop is None else stop
        data = np.stack([self.pool[self.table[r, p // self.B], p % self.B] for p in range(start, stop)])
        if out is None:
            return data
        out[...] = data
        return out


# --- the replay driver the gates and the asv suite share -------------------------------------------


def test_ledger_stats_of_a_hand_trace():
    trace = Trace(Header("hand"), [Prefill(0, 0, "a", 40), Append(1, (0,), (1,)), Free(2, 0)])
    backend = NumpyPaged(CacheConfig(block_size=16, num_blocks=8, store_kv=False))
    stats = common.ledger_stats(backend, trace)
    assert stats["peak_blocks"] == 3  # ceil(40 / 16)
    assert stats["peak_bytes"] == 3 * 16 * 128  # tiny: 128 = 2 * 2 layers * 2 heads * 8 dims * 2 B
    # Wasted (internal) slots: after the prefill 48 - 40 = 8 free, of which 1 the append will
    # fill (reservation): 7; after the append 48 - 41 = 7, none reserved: 7; after the free 0.
    assert stats["peak_wasted_slots"] == 7
    assert stats["mean_wasted_slots"] == pytest.approx((7 + 7 + 0) / 3)
    assert stats["mean_fragmentation"] == pytest.approx((8 / 48 + 7 / 48 + 0) / 3)
    assert stats["final_fragmentation"] == 0.0
    assert (stats["evictions"], stats["recomputed_tokens"], stats["ooms"]) == (0, 0, 0)


def test_replay_steps_applies_one_operation_a_step():
    trace = Trace(Header("hand"), [Prefill(0, 0, "a", 40), Append(1, (0,), (1,)), Free(2, 0)])
    backend = NumpyPaged(CacheConfig(block_size=16, num_blocks=8, store_kv=False))
    steps = driver.replay_steps(backend, trace)
    assert next(steps) == {"evictions": 0, "recomputed_tokens": 0, "ooms": 0}
    assert backend.ledger().blocks_used == 0  # nothing applied before the first step
    used = [(next(steps), backend.ledger().blocks_used)[1] for _ in trace.ops]
    assert used == [3, 3, 0]  # ceil(40 / 16) = 3; 41 tokens still fit 3 * 16; freed
    assert next(steps, None) is None  # one step an operation, then done


def test_the_asv_suite_replays_through_the_harness_driver():
    assert common.replay is not driver.replay  # common's wrapper ...
    assert common._driver_replay is driver.replay  # ... calls the driver at this commit
    assert common._driver_figures is driver.replay_figures


@pytest.mark.parametrize("backend", ["numpy", "contiguous-max"])
def test_the_copy_for_commits_before_the_driver_replays_alike(backend):
    """asv replays commits from before kvbench's driver with common.py's own copy: on every
    replay case it makes the same calls, so its figures equal the driver's."""
    compared = 0
    for case in common.REPLAY_CASES:
        figures = []
        for measure in (driver.replay_figures, common.ledger_stats_before_driver):
            try:
                b, trace = common.replay_backend(backend, case, store_kv=False)
            except NotImplementedError:  # tiers, or a policy it lacks: neither replays it
                break
            try:
                figures.append(measure(b, trace))
            finally:
                b.close()
        if figures:
            assert figures[0] == figures[1], case
            compared += 1
    assert compared >= len(common.WORKLOADS) - 3  # all but the tier workloads


@pytest.mark.parametrize("workload", common.WORKLOADS)
def test_replay_config_is_the_one_kvbench_run_uses(workload):
    trace = common.load_workload(workload)
    for policy in suite.policies_for(trace, "auto"):
        assert common.replay_config(trace, policy) == suite.config_for(trace, policy=policy,
                                                                         store_kv=False)


@pytest.mark.parametrize("case", ["fork-parallel", "tenant-fractional@fair", "tenant-late@lru"])
def test_replay_without_oracle_matches_the_checker(case):
    """The driver recomputes evicted sequences and drops refused ones as the checker does: the
    same evictions, recomputed tokens and peak blocks as the oracle's replay."""
    workload, policy = common.split_case(case)
    trace = common.load_workload(workload)
    cfg = suite.config_for(trace, policy=policy, store_kv=False)
    row = suite.run_one(trace, "numpy", cfg, gather="none")
    assert row["status"] == "pass", row["divergence"]
    stats = common.case_stats("numpy", case)
    assert (stats["evictions"], stats["recomputed_tokens"], stats["peak_blocks"]) == \
        (row["evictions"], row["recomputed_tokens"], row["peak_blocks"])


# --- exact gates ---------------------------------------------------------------------------------


def test_exact_gates():
    report = G.exact_gates()
    assert report.ok, "\n" + report.explain()
    assert report.checked > 0


def test_expected_values_agree_with_the_formulas():
    """Peak bytes of a paged backend = peak blocks * B * a slot's bytes, B read off the
    workload's header (16 unless it says otherwise). A slot holds one group's layers:
    2 (K, V) * 2 layers * 2 heads * 8 * 2 bytes = 128 for tiny, tiny-hybrid and tiny-sinks;
    2 * 1 layer * 2 * 8 * 2 = 64 for tiny-chunked; 2 layers * a latent of 12 * 2 = 48 for tiny-mla;
    64 for tiny-mamba (its full group's one layer: 2 * 1 * 2 * 8 * 2; a state group's block of
    B = 8 slots holds its layer's 512-byte state, 512 = 8 * 64)."""
    expected = G.read_expected()
    slot = {"tiny": 128, "tiny-hybrid": 128, "tiny-sinks": 128, "tiny-chunked": 64, "tiny-mla": 48,
            "tiny-mamba": 64}
    for name in ("numpy", "python-objects", "torch"):
        for case, figs in expected["replay"][name].items():
            settings = common.load_workload(case.split("@")[0]).header.settings
            B, model = settings.get("block_size", 16), settings.get("model", "tiny")
            assert figs["peak_bytes"] == figs["peak_blocks"] * B * slot[model], (name, case)


def test_pool_bytes_per_token_agree_with_the_formulas():
    """asv-1k model: 2 layers x 2 KV heads x 64 dims; 2 * 2 * 2 = 8 rows of 64 channels a token."""
    pools = G.read_expected()["pool"]
    assert pools["numpy"]["asv-1k"]["bytes_per_token"] == 8 * 64 * 2  # fp16: 1024
    if "numpy-int8" in pools:  # int8 symmetric: 64 codes + one float32 scale per row
        assert pools["numpy-int8"]["asv-1k"]["bytes_per_token"] == 8 * (64 + 4)  # 544
    if "numpy-int4" in pools:  # int4 asymmetric: 32 bytes of codes + scale + zero point
        assert pools["numpy-int4"]["asv-1k"]["bytes_per_token"] == 8 * (32 + 4 + 4)  # 320


def test_planted_waste_fails_the_exact_gates():
    report = G.exact_gates(backends=["numpy"], cases=["prefill-alpaca", "tenant-fractional@lru"],
                           factories={"numpy": WastefulNumpy}, quant=False)
    assert not report.ok
    moved = {(d.key, d.quantity): d for d in report.drifts}
    peak = moved["numpy / prefill-alpaca", "peak_blocks"]
    assert peak.improved is False
    assert peak.actual > peak.expected
    assert "peak_blocks moved from" in str(peak) and "WORSE" in str(peak)
    print(report.explain())  # the reason, as CI shows it


def test_an_improvement_fails_until_recorded():
    expected = {"replay": {"numpy": {"prefill-alpaca": {"peak_blocks": 46}}}}
    drifts, checked = G.compare_exact("replay", expected["replay"],
                                      {"numpy": {"prefill-alpaca": {"peak_blocks": 45}}}, {})
    assert checked == 1 and len(drifts) == 1
    assert drifts[0].improved is True
    assert "moved from 46 to 45 (improved" in str(drifts[0])
    assert "kvbench gates --update" in str(drifts[0])


def test_new_stale_and_skipped_cases():
    expected = {"numpy": {"gone": {"peak_blocks": 1}}, "torch-cuda": {"w": {"peak_blocks": 2}}}
    actual = {"numpy": {"new": {"peak_blocks": 3}}}
    drifts, _ = G.compare_exact("replay", expected, actual, {"torch-cuda / w": "no CUDA device"})
    text = sorted(str(d) for d in drifts)
    assert len(text) == 2  # the skipped torch-cuda case is not a drift
    assert "numpy / gone: expected values for a case that no longer runs" in text[0]
    assert "numpy / new: no expected values (a new case)" in text[1]


def test_floats_compare_up_to_summation_noise():
    drifts, _ = G.compare_exact("replay", {"n": {"c": {"mean_wasted_slots": 6.6477272727272725}}},
                                {"n": {"c": {"mean_wasted_slots": 6.647727272727273}}}, {})
    assert drifts == []
    # one slot more in one of 176 operations: 6.6477... + 1/176
    drifts, _ = G.compare_exact("replay", {"n": {"c": {"mean_wasted_slots": 6.6477272727272725}}},
                                {"n": {"c": {"mean_wasted_slots": 6.6477272727272725 + 1 / 176}}},
                                {})
    assert len(drifts) == 1 and drifts[0].improved is False


def test_update_keeps_values_of_backends_that_cannot_run_here():
    old = {"replay": {"torch-cuda": {"w": {"peak_blocks": 2}}, "numpy": {"w": {"peak_blocks": 9}}}}
    merged = G.merge_measured(old, {"replay": {"numpy": {"w": {"peak_blocks": 8}}}},
                              {"torch-cuda / w": "no CUDA device"})
    assert merged["replay"] == {"torch-cuda": {"w": {"peak_blocks": 2}},
                                "numpy": {"w": {"peak_blocks": 8}}}


# --- ratio gates ---------------------------------------------------------------------------------


@pytest.mark.skipif(os.environ.get("KVBENCH_RATIO_GATES") != "1",
                    reason="timed: the ratio gates run in `kvbench gates` (KVBENCH_RATIO_GATES=1 "
                           "runs them here); a neighbour on the cores moves them past 1.5x")
@pytest.mark.parametrize("name", list(R.RATIO_GATES))
def test_ratio_gate(name):
    # CI's factor: kvbench gates' own (1.12) is sized for one machine's noise (ratios.py)
    result = R.ratio_gate(name, slowdown=1.0, factor=R.CI_FACTOR)
    assert result.baseline, f"no baseline for {name} in results/gates/ratios.json"
    assert result.ok, str(result)
    print(result)


@pytest.mark.parametrize("name", ["decode_vs_scatter", "decode_vs_object", "gather_vs_copy",
                                  "gather_into_vs_copyto"])
def test_planted_slowness_fails_the_ratio_gate(name):
    result = R.ratio_gate(name, factory=PerTokenNumpy, blocks=5, slowdown=1.0)
    if result.skipped:
        pytest.skip(result.skipped)
    assert not result.ok, f"a per-token Python loop passed: {result}"
    assert "FAIL" in str(result) and "slower" in str(result)
    print(result)


def test_the_vector_path_fails_the_batch_one_gate(monkeypatch):
    # Without its small-batch path a one-sequence decode step pays NumPy's array steps (the
    # issue measured 0.06x the object model there; the path brings it near 1x).
    import impls.numpy_paged as numpy_paged
    monkeypatch.setattr(numpy_paged, "SMALL_BATCH", 0)
    result = R.ratio_gate("decode1_vs_object", blocks=5, slowdown=1.0)
    assert not result.ok, f"the vector path passed at batch 1: {result}"


def test_the_baseline_covers_every_gate_with_provenance():
    baseline = R.read_baseline()
    assert set(baseline["gates"]) == set(R.RATIO_GATES)
    for name, g in baseline["gates"].items():
        # a baseline of fewer blocks than a run would be noisier than the run it judges
        assert len(g["log_ratios"]) == g["blocks"] >= R.RATIO_GATES[name].blocks, name
    recorded = baseline["recorded"]
    assert len(recorded["commit"]) == 40 and recorded["date"] and recorded["machine"]
    assert len(recorded["load_average"]) == 3


# --- the ratio gates' decision, on made-up samples ---------------------------------------------

SPREAD = [-0.02, -0.01, 0.0, 0.01, 0.02]  # log ratios around 0: a ratio of 1 +- 2%


def shifted(by: float, spread=SPREAD, times: int = 4) -> list:
    return [by + x for x in spread] * times


def test_compare_estimates_the_slowdown_by_the_median_difference():
    slowdown, lower = R.compare(shifted(0.0), shifted(-math.log(1.25)))
    # the differences are ln 1.25 + x - y over the spread's pairs, symmetric about ln 1.25
    assert slowdown == pytest.approx(1.25)
    # the bound is one of them, below the median: within the 0.04 of two spreads
    assert 1.25 * math.exp(-0.04) <= lower < 1.25


def test_the_lower_bound_is_the_mann_whitney_rank():
    # m = n = 10 blocks, the candidate's 0.1 .. 1.0 and the baseline's 1.1 .. 2.0 (log ratios):
    # the 100 differences b - c are 0.1 .. 1.9 by steps of 0.1, k/10 taken 10 - |10 - k| times
    base, cand = [1 + k / 10 for k in range(1, 11)], [k / 10 for k in range(1, 11)]
    slowdown, lower = R.compare(base, cand, alpha=0.05)
    assert slowdown == pytest.approx(math.exp(1.0))
    # k = floor(100 / 2 - 1.6449 * sqrt(100 * 21 / 12)) = floor(50 - 21.76) = 28; the 28th
    # smallest: 0.1 once, 0.2 twice, ... 0.6 six times (21), 0.7 seven times (28)
    assert lower == pytest.approx(math.exp(0.7))


def test_too_few_blocks_never_bound_the_slowdown_above_1():
    # m = n = 3: k = floor(4.5 - 2.326 * sqrt(9 * 7 / 12)) = floor(-0.83) < 1
    slowdown, lower = R.compare([0.0] * 3, [-1.0] * 3)
    assert slowdown == pytest.approx(math.e) and lower == 0


@pytest.mark.parametrize("factor, fails", [(1.0, False), (1.1, False), (1.25, True), (2.0, True)])
def test_a_gate_fails_above_the_factor(factor, fails):
    result = R.RatioResult("decode_vs_object", shifted(-math.log(factor)), shifted(0.0))
    assert result.slowdown == pytest.approx(factor)
    assert result.ok is not fails, str(result)
    assert ("FAIL" in str(result)) is fails


def test_a_slowdown_within_the_noise_passes():
    # ten blocks a side, spread over a factor e^1.4 = 4: the estimate says 1.25x slower, but
    # the differences spread over +-1.4 about ln 1.25 = 0.22, so the 99% bound is below 0
    wide = list(np.linspace(-0.7, 0.7, 10))
    result = R.RatioResult("decode_vs_object", [x - math.log(1.25) for x in wide], wide)
    assert result.slowdown == pytest.approx(1.25)
    assert result.lower < 1 and result.ok, str(result)


def test_no_baseline_never_fails():
    result = R.RatioResult("decode_vs_object", shifted(-math.log(2.0)), None)
    assert result.ok and "no baseline" in str(result)


def test_planted_slowdowns_from_the_environment(monkeypatch):
    monkeypatch.setenv(R.SLOWDOWN_ENV, "1.25")
    assert R.planted_slowdowns() == {name: 1.25 for name in R.RATIO_GATES}
    assert R.planted_slowdowns("gather_vs_copy=2, decode_vs_object=1.5") == {
        "gather_vs_copy": 2.0, "decode_vs_object": 1.5}
    monkeypatch.delenv(R.SLOWDOWN_ENV)
    assert R.planted_slowdowns() == {}
    with pytest.raises(ValueError, match="'0.5' is not a factor >= 1"):
        R.planted_slowdowns("0.5")
    with pytest.raises(ValueError, match="no ratio gate 'decode'"):
        R.planted_slowdowns("decode=2")


class FakeClock:
    """time.process_time and time.perf_counter both: each read advances it by ``tick``."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock(1e-4)
    monkeypatch.setattr(R.time, "process_time", c)
    monkeypatch.setattr(R.time, "perf_counter", c)
    return c


def test_slowed_busy_waits_in_proportion(clock):
    calls = []

    def subject(i):
        calls.append(i)
        clock.spend(1.0)

    assert R.slowed(subject, 1.0) is subject
    slow = R.slowed(subject, 1.5)
    plain = R._timed(lambda: subject(6), clock.__call__)
    timed = R._timed(lambda: slow(7), clock.__call__)
    assert calls == [6, 7]
    # a timing holds the subject's 1 s and one read of 1e-4; slowed, 1.5 times the subject's
    # 1 s and the same read (the plant's own reads taken off its wait), up to a read
    assert plain == pytest.approx(1.0 + 1e-4)
    assert timed == pytest.approx(1.5 * 1.0 + 1e-4, abs=1e-4)


def test_the_planted_wait_is_cpu_time(monkeypatch):
    # the wall clock runs 10 times faster than the CPU clock (other processes held the core):
    # the wait still spends its 0.5 s of CPU
    cpu, wall = FakeClock(1e-4), FakeClock(1e-3)
    monkeypatch.setattr(R.time, "process_time", cpu)
    monkeypatch.setattr(R.time, "perf_counter", wall)
    slow = R.slowed(lambda i: cpu.spend(1.0), 1.25)
    t0 = cpu()
    slow(1)
    assert cpu.now - t0 == pytest.approx(1.25 + 1e-4, abs=2e-4)


def test_a_timing_the_clock_did_not_see_is_left_out():
    # two readings a timing: reference 0 -> 2, subject 2 -> 2 (the clock did not move),
    # reference 2 -> 5, subject 5 -> 6
    readings = iter([0.0, 2.0, 2.0, 2.0, 2.0, 5.0, 5.0, 6.0])
    ref, subj = R._fastest(lambda i: None, lambda i: None, trials=2, warm=False,
                           clock=lambda: next(readings))
    assert (ref, subj) == (2.0, 1.0)  # min(2, 3); min(1), the 0 left out
    with pytest.raises(RuntimeError, match="did not move in any of 2 trials"):
        R._fastest(lambda i: None, lambda i: None, trials=2, warm=False, clock=lambda: 1.0)


def test_sample_times_blocks_and_reuses_fixtures(clock, monkeypatch):
    built = []

    def pair(factory):
        built.append(factory)
        return (lambda i: clock.spend(2.0)), (lambda i: clock.spend(1.0))

    monkeypatch.setitem(R.RATIO_GATES, "fake", R.RatioGate("fake", "2 s / 1 s", pair, 5, trials=3,
                                                          reuse=2))
    (logs,) = R.sample_in_turn({"fake": 5}, factory="f")[0].values()
    assert built == ["f"] * 3  # 3 = ceil(5 blocks / 2 a set)
    # ln(2 / 1) up to the clock's reads (2 of 1e-4 a timing)
    assert logs == pytest.approx([math.log(2.0)] * 5, abs=1e-3)
    (planted,) = R.sample_in_turn({"fake": 2}, slowdowns={"fake": 1.25})[0].values()
    # ln(2 / 1.25): the subject's second is followed by a quarter second's wait
    assert planted == pytest.approx([math.log(2.0 / 1.25)] * 2, abs=1e-3)


def test_sample_of_a_gate_that_times_its_own_blocks(monkeypatch):
    calls = []

    def block(factory, slowdown):
        calls.append((factory, slowdown))
        return 2.0, 1.0 * slowdown

    monkeypatch.setitem(R.RATIO_GATES, "fake", R.RatioGate("fake", "2 s / 1 s", block, 4,
                                                          times_blocks=True))
    (logs,) = R.sample_in_turn({"fake": 4}, factory="f", slowdowns={"fake": 1.25})[0].values()
    assert logs == pytest.approx([math.log(2.0 / 1.25)] * 4)
    assert calls == [("f", 1.25)] * 5  # a warm-up block, then the 4 it keeps


def slow_blocks(monkeypatch, slow_for: int, factor: float = 1.5) -> list:
    """Gate "fake", 10 blocks of 2 s / 1 s timed by itself, the subject ``factor`` times slower in
    its first ``slow_for`` blocks (the warm-up block of each sample counted); the calls made."""
    calls = []

    def block(factory, slowdown):
        calls.append(factory)
        return 2.0, factor if len(calls) <= slow_for else 1.0

    monkeypatch.setitem(R.RATIO_GATES, "fake", R.RatioGate("fake", "2 s / 1 s", block, 10,
                                                          times_blocks=True))
    return calls


FAKE_BASELINE = {"gates": {"fake": {"log_ratios": [math.log(2.0)] * 10}}}


def test_a_slowdown_in_both_samples_fails(monkeypatch):
    calls = slow_blocks(monkeypatch, slow_for=10 ** 6)
    result = R.ratio_gate("fake", FAKE_BASELINE, slowdown=1.0)
    # every block reads ln(2 / 1.5), the baseline's ln 2: a shift of ln 1.5 in the first sample
    # and in both together
    assert result.slowdown == pytest.approx(1.5) and result.recheck.slowdown == pytest.approx(1.5)
    assert not result.first_ok and not result.ok
    assert "both samples' 20 blocks: 1.5x slower" in str(result)
    assert str(result).count("FAIL") == 1
    assert len(calls) == 2 * 11  # two samples, each a warm-up block and its 10


def test_a_slowdown_in_the_first_sample_only_passes(monkeypatch):
    # a neighbour's burst over the first sample (its warm-up and 10 blocks), gone by the second
    calls = slow_blocks(monkeypatch, slow_for=11)
    result = R.ratio_gate("fake", FAKE_BASELINE, slowdown=1.0)
    assert result.slowdown == pytest.approx(1.5) and not result.first_ok
    # both together: 100 differences of ln 1.5 and 100 of 0 from the baseline's 10 blocks, the
    # median between them (sqrt(1.5) = 1.22x) but the bound 0 (exp: 1x), so the gate passes
    assert result.recheck.slowdown == pytest.approx(math.sqrt(1.5))
    assert result.recheck.lower == pytest.approx(1.0) and result.ok
    assert str(result).endswith("both samples' 20 blocks: 1.22x slower, >= 1x: ok")
    assert len(calls) == 22


def test_a_gate_that_passes_is_sampled_once(monkeypatch):
    calls = slow_blocks(monkeypatch, slow_for=0)
    result = R.ratio_gate("fake", FAKE_BASELINE, slowdown=1.0)
    assert result.ok and result.recheck is None and len(calls) == 11


def test_without_confirmation_one_failing_sample_fails(monkeypatch):
    slow_blocks(monkeypatch, slow_for=11)
    result = R.ratio_gate("fake", FAKE_BASELINE, slowdown=1.0, confirm=False)
    assert result.recheck is None and not result.ok


def test_the_checker_gate_refuses_a_checker_that_fails():
    # a backend taking a block too many per prefill: the checker stops at its ledger, and a
    # timing of a replay that stopped early would time less than the trace
    cfg = suite.config_for(R._decode_trace())
    with pytest.raises(AssertionError, match="check_vs_replay: the checker failed its own trace"):
        R.check_vs_replay(lambda: WastefulNumpy(cfg))


def test_gates_command_exit_code(tmp_path, capsys):
    """`kvbench gates` exits 1 on a drift and says what moved."""
    expected = G.read_expected()
    figs = expected["replay"]["numpy"]["prefill-alpaca"]
    expected = copy.deepcopy(expected)
    expected["replay"]["numpy"]["prefill-alpaca"] = {**figs, "peak_blocks": figs["peak_blocks"] - 1}
    path = G.write_expected(expected, tmp_path / "expected.json")
    code = gates_cli.main(["--skip-ratios", "--backend", "numpy", "--case", "prefill-alpaca",
                   "--expected", str(path)])
    out = capsys.readouterr().out
    assert code == 1
    assert f"peak_blocks moved from {figs['peak_blocks'] - 1} to {figs['peak_blocks']} (WORSE" in out


def test_the_numpy_steps_fail_the_quantize_gate():
    # the steps as the subject time what the reference times: a ratio near 1, the baseline's ~3.8
    from impls import quant_kernels, quant_numpy
    if not quant_kernels.available()[0]:
        pytest.skip(quant_kernels.available()[1])
    steps = lambda x, scheme, out=None: quant_numpy.quantize(x, scheme, out=out, compiled=False)  # noqa: E731
    result = R.ratio_gate("quantize_vs_steps", factory=steps, blocks=5, slowdown=1.0)
    assert not result.ok, f"the uncompiled steps passed: {result}"
    print(result)


def test_gates_command_without_a_baseline(tmp_path, capsys, monkeypatch):
    """No baseline recorded: the ratio gates say so and pass; --update-ratios cannot go with
    --skip-ratios."""
    monkeypatch.setattr(R, "RATIO_GATES", {"decode1_vs_object": R.RATIO_GATES["decode1_vs_object"]})
    code = gates_cli.main(["--skip-exact", "--blocks", "2", "--baseline", str(tmp_path / "none.json")])
    assert code == 0
    assert "no baseline recorded" in capsys.readouterr().out
    assert gates_cli.main(["--update-ratios", "--skip-ratios"]) != 0
    assert "--update-ratios records the ratio gates' baseline: it cannot go with --skip-ratios" \
        in capsys.readouterr().err


def test_a_tier_copy_through_a_temporary_fails_the_tier_gate(monkeypatch):
    # dst[into] = src[rows] reads the blocks into a temporary first: two passes over the bytes,
    # as the tiers copied before their rows were gathered in place (0.23..0.59 of a copy)
    from impls.numpy_tiers import NumpyTiers

    def through_a_temporary(src, rows, dst, into):
        dst[np.asarray(into)] = src[np.asarray(rows)]

    monkeypatch.setattr(NumpyTiers, "_copy_rows", staticmethod(through_a_temporary))
    result = R.ratio_gate("tier_copy_vs_copy", blocks=5, slowdown=1.0)
    assert not result.ok, f"a copy through a temporary passed: {result}"


def test_a_gate_re_recorded_alone_keeps_the_others_blocks():
    old = {"about": "old", "recorded": {"commit": "a" * 40}, "skipped": {"tier_copy_vs_copy": "no"},
           "gates": {"gather_vs_copy": {"blocks": 2, "log_ratios": [0.1, 0.2]},
                     "check_vs_replay": {"blocks": 2, "log_ratios": [-2.3, -2.4]}}}
    new = {"about": "new", "recorded": {"commit": "b" * 40}, "skipped": {},
           "gates": {"check_vs_replay": {"blocks": 3, "log_ratios": [-2.7, -2.8, -2.9]}}}
    merged = R.merge_baseline(old, new)
    assert merged["gates"]["gather_vs_copy"] == old["gates"]["gather_vs_copy"]
    assert merged["gates"]["check_vs_replay"]["log_ratios"] == [-2.7, -2.8, -2.9]
    assert merged["gates"]["check_vs_replay"]["recorded"] == {"commit": "b" * 40}
    assert merged["recorded"] == old["recorded"]  # the others' provenance
    assert merged["skipped"] == {"tier_copy_vs_copy": "no"}
    # a gate that cannot run where it is re-recorded loses its old blocks: they would judge a
    # reference of another machine
    gone = R.merge_baseline(old, {**new, "gates": {}, "skipped": {"gather_vs_copy": "no numba"}})
    assert "gather_vs_copy" not in gone["gates"] and gone["skipped"]["gather_vs_copy"] == "no numba"


def test_gates_command_names_its_ratio_gates(capsys):
    assert gates_cli.main(["--skip-exact", "--ratio", "decode_vs_nothing"]) != 0
    err = capsys.readouterr().err
    assert "--ratio decode_vs_nothing: no such ratio gate" in err and "check_vs_replay" in err
    assert gates_cli.main(["--skip-ratios", "--ratio", "gather_vs_copy"]) != 0
    assert "cannot go with --skip-ratios" in capsys.readouterr().err
    # --backend narrows the exact gates and skips the ratio gates: --ratio would run nothing
    assert gates_cli.main(["--backend", "numpy", "--ratio", "gather_vs_copy"]) != 0
    assert "--ratio runs ratio gates, which --backend/--case skip" in capsys.readouterr().err


def test_gates_command_runs_only_the_ratio_gates_it_names(tmp_path, capsys):
    code = gates_cli.main(["--skip-exact", "--ratio", "decode1_vs_object", "--blocks", "2",
                           "--baseline", str(tmp_path / "none.json")])
    out = capsys.readouterr().out
    assert code == 0 and "decode1_vs_object" in out
    assert not any(n in out for n in R.RATIO_GATES if n != "decode1_vs_object")


def test_a_gate_whose_compiled_path_is_missing_is_skipped_not_failed(tmp_path, capsys, monkeypatch):
    """Without numba the decode step and the quantizer run uncompiled, 2-5x slower than the
    baseline's compiled paths: those gates say why and are skipped, and the run passes."""
    from impls import paged_kernels, quant_kernels
    monkeypatch.setattr(paged_kernels, "kernels", lambda: None)
    monkeypatch.setattr(quant_kernels, "available", lambda: (False, "numba is missing (planted)"))
    gated = ["decode_vs_scatter", "decode_vs_object", "quantize_vs_steps"]
    code = gates_cli.main(["--skip-exact", "--blocks", "3", *(f"--ratio={n}" for n in gated)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    for name in gated:
        line = next(x for x in lines if x.startswith(f"ratio {name}:"))
        assert "SKIPPED" in line and "numba" in line, line
    assert lines[-1] == "gates pass (exit 0): ratio: 0 passed, 0 failed, 3 skipped " \
                        "(decode_vs_scatter, decode_vs_object, quantize_vs_steps)"


def test_gates_command_ends_with_a_summary_line(tmp_path, capsys):
    expected = copy.deepcopy(G.read_expected())
    figs = expected["replay"]["numpy"]["prefill-alpaca"]
    figs["ooms"] += 1  # one quantity moved: the summary counts one drift
    path = G.write_expected(expected, tmp_path / "expected.json")
    code = gates_cli.main(["--skip-ratios", "--backend", "numpy", "--case", "prefill-alpaca",
                           "--expected", str(path)])
    last = capsys.readouterr().out.splitlines()[-1]
    checked = len(G.REPLAY_QUANTITIES)  # one backend, one case, no quantizer or pool
    assert code == 1
    assert last == f"gates FAIL (exit 1): exact: {checked} quantities, 1 drifted, 0 cases skipped"


class RecordingNumpy(NumpyPaged):
    """The NumPy pool, its instances and the buffers its gathers write into kept."""

    made: list = []
    outs: list = []

    def __init__(self, config):
        super().__init__(config)
        RecordingNumpy.made.append(self)

    def gather(self, seq, start=0, stop=None, *, out=None):
        RecordingNumpy.outs.append(out)
        return super().gather(seq, start, stop, out=out)


def test_the_gather_into_gates_reference_copies_the_pools_own_blocks_into_the_same_buffer(monkeypatch):
    # A reference of another buffer, or of an array of its own, timed other pages than the
    # gather (the ratio moved 0.72..0.93 from one VM to the next, issue 45)
    monkeypatch.setattr(RecordingNumpy, "made", [])
    monkeypatch.setattr(RecordingNumpy, "outs", [])
    reference, subject = R.gather_into_vs_copyto(RecordingNumpy)
    pool = RecordingNumpy.made[-1]
    pool.slots[:] = (np.arange(len(pool.slots)) % 2048)[:, None]  # slot i holds i (exact in fp16)
    in_order = [i % 2048 for i in range(R.GATHER_TOKENS)]  # the pool's first 4096 slots
    subject(1)
    into = RecordingNumpy.outs[-1]
    assert into.reshape(R.GATHER_TOKENS, -1)[:, 0].tolist() != in_order  # the gather's blocks
    reference(1)
    assert into.reshape(R.GATHER_TOKENS, -1)[:, 0].tolist() == in_order
