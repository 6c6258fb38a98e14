"""Regression gates that hold on a noisy shared machine.

Two kinds, both run by ``kvbench gates``; CI (``tests/bench/test_gates.py``) runs the exact
ones, and the ratio gates only with ``KVBENCH_RATIO_GATES=1`` (docs/benchmarks.md):

* **Exact gates** on deterministic quantities. Every committed workload is replayed through every
  gated backend (no oracle: the backend's own ledger after each operation) and the quantization
  schemes of the asv suite run on a fixed-seed sample. The figures (peak blocks and bytes, final
  and mean fragmentation, peak and mean wasted slots, evictions, recomputed tokens, refused
  operations; bytes per token slot of each paged pool, quantized ones included; max / mean abs
  error, RMSE and stored bytes) are all lower-is-better and must equal
  ``results/gates/expected.json``. Any change fails, an improvement too, until it is recorded on
  purpose with ``kvbench gates --update`` (the diff of expected.json then shows it in review).
  Floats compare with a relative tolerance of 1e-9: exact up to summation order, while a single
  slot more in a mean over a few hundred operations moves it by ~1e-4.

* **Ratio gates** on speed. Never an absolute time: a ratio of two CPU timings taken in the same
  run, interleaved (reference, subject, reference, subject, ...), higher is better, over repeated
  blocks (the gates taking turns), compared with a recorded baseline distribution by a
  Mann-Whitney test: a gate fails on a slowdown estimated above 1.12x (the Hodges-Lehmann shift)
  whose lower confidence bound at 99% is above 1. See
  :mod:`kvbench.bench.ratios`; scripts/gate_power.py measures how often a planted 1.1x-2x
  slowdown fails them and how often an unchanged tree does (results/gates/power.md).

The cases, their settings and their backends are the asv suite's fixtures
(:mod:`kvbench.bench.fixtures`, which asv_bench/benchmarks/common.py loads: the suite's own lists,
which stored results are keyed by), and each case replays through kvbench's one driver (:func:`kvbench.checking.driver.replay_figures`,
which the fixtures call too), so the gates and the ``track_`` benchmarks measure the same thing.

The ratio gates are in :mod:`kvbench.bench.ratios`; `kvbench gates` in :mod:`kvbench.cli.gates`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.bench import fixtures
from kvbench.bench.records import RESULTS_DIR
from kvbench.checking.driver import replay_figures
from kvbench.contract import registry
from kvbench.outputs import write_text
from kvbench.progress import Progress

EXPECTED_PATH = RESULTS_DIR / "gates" / "expected.json"

# Backends by their `kvbench list` names, and each one's name in the asv suite (common.BACKENDS),
# where torch on the CPU and the per-object model have benchmark names of their own.
GATED_BACKENDS = list(registry.tagged("gated"))
ASV_NAMES = {e.name: e.asv_name for e in registry.BUILTIN if e.asv_name}
LIST_NAMES = {v: k for k, v in ASV_NAMES.items()}
GATED_QUANTIZERS = ["reference", "numpy", "numpy-steps", "torch-cpu"]  # numpy: compiled where installed
REPLAY_QUANTITIES = ("peak_blocks", "peak_bytes", "final_fragmentation", "mean_fragmentation",
                     "peak_wasted_slots", "mean_wasted_slots", "evictions", "recomputed_tokens",
                     "ooms")
QUANT_QUANTITIES = ("max_abs_error", "mean_abs_error", "rmse", "stored_bytes")
REL_TOL = 1e-9


def bench_common():
    """The asv suite's fixtures (:mod:`kvbench.bench.fixtures`, its common.py), the gates' too."""
    return fixtures


# --- exact gates ---------------------------------------------------------------------------------


@dataclass
class Drift:
    """One gated quantity that moved (or a case with no expected values, or a stale one)."""

    group: str  # replay | quant
    key: str  # "backend / case" or "quantizer / scheme"
    quantity: str
    expected: object
    actual: object

    @property
    def improved(self) -> bool | None:
        """Lower is better for every gated quantity; None when either side is missing."""
        if self.expected is None or self.actual is None or isinstance(self.actual, str) \
                or isinstance(self.expected, str):
            return None
        return self.actual < self.expected

    def __str__(self) -> str:
        if self.expected is None:
            return (f"{self.group} {self.key}: no expected values (a new case): record them with "
                    f"`kvbench gates --update`")
        if self.actual is None:
            return (f"{self.group} {self.key}: expected values for a case that no longer runs here "
                    f"(removed?): `kvbench gates --update` drops them")
        verdict = "improved" if self.improved else "WORSE"
        return (f"{self.group} {self.key}: {self.quantity} moved from {self.expected!r} to "
                f"{self.actual!r} ({verdict}; lower is better)"
                + ("; if on purpose, record it with `kvbench gates --update`" if self.improved else ""))


@dataclass
class ExactReport:
    drifts: list = field(default_factory=list)
    checked: int = 0  # quantities compared
    skipped: dict = field(default_factory=dict)  # key -> why it cannot run here
    values: dict = field(default_factory=dict)  # what was measured, as expected.json stores it

    @property
    def ok(self) -> bool:
        return not self.drifts

    def explain(self) -> str:
        lines = [str(d) for d in self.drifts]
        lines += [f"skipped {k}: {why}" for k, why in sorted(self.skipped.items())]
        lines.append(f"exact gates: {self.checked} quantities checked, {len(self.drifts)} drifted, "
                     f"{len(self.skipped)} cases skipped")
        return "\n".join(lines)


def measure_replay(backends=None, factories: dict | None = None, cases=None) -> tuple[dict, dict]:
    """{backend: {case: figures}} over the replay cases (default: all of the asv suite's), and
    {key: why} for what cannot run here.

    ``factories`` maps a backend name to ``callable(CacheConfig) -> Backend`` that replaces the
    registry's (a planted regression in a test).
    """
    common = bench_common()
    factories = factories or {}
    values, skipped = {}, {}
    names, cases = backends or GATED_BACKENDS, cases or common.REPLAY_CASES
    bar = Progress(len(names) * len(cases), "exact gates", "cases")
    for name in names:
        for case in cases:
            bar.update()
            try:
                if name in factories:
                    workload, policy = common.split_case(case)
                    trace = common.load_workload(workload)
                    backend = factories[name](common.replay_config(trace, policy))
                    try:
                        figures = replay_figures(backend, trace)
                    finally:
                        backend.close()
                else:
                    figures = common.case_stats(ASV_NAMES.get(name, name), case)
            except NotImplementedError as e:
                skipped[f"{name} / {case}"] = str(e)
                continue
            values.setdefault(name, {})[case] = {q: figures[q] for q in REPLAY_QUANTITIES}
    bar.close()
    return values, skipped


def measure_quant(quantizers=None) -> tuple[dict, dict]:
    """{quantizer: {scheme: error figures}} on the suite's fixed-seed sample."""
    common = bench_common()
    values, skipped = {}, {}
    for name in quantizers or GATED_QUANTIZERS:
        for scheme in common.QUANT_SCHEMES:
            try:
                impl = common.quantizer(name)
                stats = common.quant_stats(impl, common.kv_sample(), common.quant_scheme(scheme))
            except NotImplementedError as e:
                skipped[f"{name} / {scheme}"] = str(e)
                continue
            values.setdefault(name, {})[scheme] = {q: stats[q] for q in QUANT_QUANTITIES}
    return values, skipped


def pool_backends() -> list[str]:
    """The paged pools whose bytes per token are gated, by their `kvbench list` names."""
    return [LIST_NAMES.get(p, p) for p in bench_common().POOLS]


def replay_cases(names) -> list[str]:
    """The replay cases ``names`` name (a case, or a workload: all of its cases); a ValueError
    naming the one that matches nothing."""
    known = bench_common().REPLAY_CASES
    out = []
    for name in names:
        found = [c for c in known if c == name or c.split("@")[0] == name]
        if not found:
            workloads = sorted({c.split("@")[0] for c in known})
            raise ValueError(f"--case {name}: no such replay case; workloads: {', '.join(workloads)} "
                             f"(a tenant mix as workload@lru, @lfu or @fair)")
        out += [c for c in found if c not in out]
    return out


def measure_pools(backends=None) -> tuple[dict, dict]:
    """{backend: {"asv-1k": {"bytes_per_token": ...}}}: each paged pool's bytes per token slot
    from its own ledger (quantized pools: codes plus scales)."""
    common = bench_common()
    values, skipped = {}, {}
    for name in pool_backends() if backends is None else backends:
        try:
            values[name] = {"asv-1k": {"bytes_per_token": common.pool_bytes_per_token(
                ASV_NAMES.get(name, name))}}
        except NotImplementedError as e:
            skipped[f"{name} / asv-1k"] = str(e)
    return values, skipped


def _same(expected, actual) -> bool:
    if isinstance(expected, float) or isinstance(actual, float):
        if expected is None or actual is None:
            return expected is actual
        return math.isclose(expected, actual, rel_tol=REL_TOL, abs_tol=1e-15)
    return expected == actual


def compare_exact(group: str, expected: dict, actual: dict, skipped: dict,
                  only: set | None = None, cases: set | None = None) -> tuple[list, int]:
    """Drifts between ``expected`` and ``actual`` ({name: {case: {quantity: value}}}).

    A case skipped here (its backend cannot run) is not a drift. ``only`` / ``cases``: compare
    just these names / cases (expected entries of others are left alone).
    """
    drifts, checked = [], 0
    names = set(expected) | set(actual)
    if only is not None:
        names &= only
    for name in sorted(names):
        exp, act = expected.get(name, {}), actual.get(name, {})
        keys = set(exp) | set(act)
        for case in sorted(keys if cases is None else keys & cases):
            key = f"{name} / {case}"
            if case not in act:
                if key not in skipped:
                    drifts.append(Drift(group, key, "(all)", exp[case], None))
                continue
            if case not in exp:
                drifts.append(Drift(group, key, "(all)", None, act[case]))
                continue
            for q in sorted(set(exp[case]) | set(act[case])):
                checked += 1
                e, a = exp[case].get(q), act[case].get(q)
                if not _same(e, a):
                    drifts.append(Drift(group, key, q, e, a))
    return drifts, checked


def read_expected(path: Path | str = EXPECTED_PATH) -> dict:
    path = Path(path)
    if not path.exists():
        return {"replay": {}, "quant": {}}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not an expected-values file (not JSON: {e})") from None


def write_expected(expected: dict, path: Path | str = EXPECTED_PATH) -> Path:
    return write_text(path, json.dumps(expected, indent=1, sort_keys=True) + "\n")


def exact_gates(expected: dict | None = None, *, backends=None, cases=None, quantizers=None,
                factories: dict | None = None, quant: bool = True) -> ExactReport:
    """Measure and compare with expected.json (or ``expected``); ``backends``, ``cases`` and
    ``quantizers`` narrow the run (default: everything), ``factories`` plants backends."""
    expected = read_expected() if expected is None else expected
    report = ExactReport()
    replay, skipped = measure_replay(backends, factories, cases)
    report.skipped.update(skipped)
    only = set(backends) if backends else None
    drifts, checked = compare_exact("replay", expected.get("replay", {}), replay, skipped, only,
                                    set(cases) if cases else None)
    report.drifts += drifts
    report.checked += checked
    report.values["replay"] = replay
    if quant:
        pools = None if backends is None else [b for b in backends if b in pool_backends()]
        pvalues, pskipped = measure_pools(pools)
        report.skipped.update(pskipped)
        drifts, checked = compare_exact("pool", expected.get("pool", {}), pvalues, pskipped, only)
        report.drifts += drifts
        report.checked += checked
        report.values["pool"] = pvalues
        qvalues, qskipped = measure_quant(quantizers)
        report.skipped.update(qskipped)
        only = set(quantizers) if quantizers else None
        drifts, checked = compare_exact("quant", expected.get("quant", {}), qvalues, qskipped, only)
        report.drifts += drifts
        report.checked += checked
        report.values["quant"] = qvalues
    return report


def merge_measured(expected: dict, measured: dict, skipped: dict) -> dict:
    """expected.json with the measured groups in place of the old; entries of a backend that
    could not run here are kept as they were (recorded on a machine where it runs)."""
    out = dict(expected)
    for group, values in measured.items():
        old = expected.get(group, {})
        merged = {}
        for name in set(old) | set(values):
            cases = dict(values.get(name, {}))
            for case, figs in old.get(name, {}).items():
                if case not in cases and f"{name} / {case}" in skipped:
                    cases[case] = figs
            if cases:
                merged[name] = cases
        out[group] = merged
    return out
