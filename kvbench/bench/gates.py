"""Regression gates that CI can trust on a noisy shared machine.

Two kinds, run by ``tests/test_gates.py`` on every submission and by ``kvbench gates``:

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

* **Ratio gates** on speed. Never an absolute time: a ratio of two timings taken in the same run,
  interleaved (reference, subject, reference, subject, ...), the median over several repeats,
  higher is better. A gate fails only below a third of the typical ratio committed in
  expected.json (``MARGIN``): a shared machine's noise moves these ratios by tens of percent,
  the regressions they exist to catch (a per-token Python loop, a lost vectorization) by 10x.
  ``kvbench gates --update-ratios`` re-measures the typical ratios. Timing differences of 1.2x
  need a pinned machine: ``asv continuous HEAD^ HEAD --factor 1.2`` there (exits non-zero on a
  slowdown).

The figures come from the asv suite's fixtures and replay driver (asv_bench/benchmarks/common.py,
loaded by path), so the gates and the ``track_`` benchmarks measure the same thing.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kvbench.bench.records import REPO_ROOT, RESULTS_DIR, commit_info, machine_info

EXPECTED_PATH = RESULTS_DIR / "gates" / "expected.json"
COMMON_PATH = REPO_ROOT / "asv_bench" / "benchmarks" / "common.py"

GATED_BACKENDS = ["numpy", "torch-cpu", "object", "contiguous-max", "contiguous-pow2",
                  "contiguous-oracle"]
GATED_QUANTIZERS = ["reference", "numpy", "torch-cpu"]
REPLAY_QUANTITIES = ("peak_blocks", "peak_bytes", "final_fragmentation", "mean_fragmentation",
                     "peak_wasted_slots", "mean_wasted_slots", "evictions", "recomputed_tokens",
                     "ooms")
QUANT_QUANTITIES = ("max_abs_error", "mean_abs_error", "rmse", "stored_bytes")
REL_TOL = 1e-9
MARGIN = 3.0  # a ratio gate fails below typical / MARGIN
REPEATS = 7


def bench_common():
    """The asv suite's common.py (fixtures, replay driver), one copy shared with the gates."""
    mod = sys.modules.get("kvbench_asv_common")
    if mod is None:
        if not COMMON_PATH.exists():
            raise RuntimeError(f"{COMMON_PATH} is missing: the gates need the asv suite's fixtures")
        spec = importlib.util.spec_from_file_location("kvbench_asv_common", COMMON_PATH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["kvbench_asv_common"] = mod
    return mod


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
    for name in backends or GATED_BACKENDS:
        for case in cases or common.REPLAY_CASES:
            try:
                if name in factories:
                    workload, policy = common.split_case(case)
                    trace = common.load_workload(workload)
                    backend = factories[name](common.replay_config(trace, policy))
                    try:
                        figures = common.ledger_stats(backend, trace)
                    finally:
                        backend.close()
                else:
                    figures = common.case_stats(name, case)
            except NotImplementedError as e:
                skipped[f"{name} / {case}"] = str(e)
                continue
            values.setdefault(name, {})[case] = {q: figures[q] for q in REPLAY_QUANTITIES}
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


def measure_pools(backends=None) -> tuple[dict, dict]:
    """{backend: {"asv-1k": {"bytes_per_token": ...}}}: each paged pool's bytes per token slot
    from its own ledger (quantized pools: codes plus scales)."""
    common = bench_common()
    values, skipped = {}, {}
    for name in common.POOLS if backends is None else backends:
        try:
            values[name] = {"asv-1k": {"bytes_per_token": common.pool_bytes_per_token(name)}}
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
        return {"replay": {}, "quant": {}, "ratios": {}}
    with open(path) as f:
        return json.load(f)


def write_expected(expected: dict, path: Path | str = EXPECTED_PATH) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    return path


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
        pools = None if backends is None else [b for b in backends if b in bench_common().POOLS]
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


# --- ratio gates ---------------------------------------------------------------------------------


def _timed(fn) -> float:
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        if gc_was:
            gc.enable()


DECODE_BATCH = 256
TRIALS = 7  # interleaved timings per repeat, of which the fastest counts
GATHER_TOKENS = 4096  # 4 MiB of K/V in the suite's 1 KiB-per-token model


def _fastest(reference, subject, trials: int = TRIALS) -> tuple[float, float]:
    """Time ``reference(i)`` and ``subject(i)`` alternately for i = 1..trials after an untimed
    warm-up (i = 0); the fastest of each. Noise on a shared machine only adds time, so the
    minimum is the estimate least moved by it (a context switch lasts milliseconds)."""
    reference(0), subject(0)
    ref, subj = [], []
    for i in range(1, trials + 1):
        ref.append(_timed(lambda: reference(i)))
        subj.append(_timed(lambda: subject(i)))
    return min(ref), min(subj)


def _subject(factory, num_blocks: int, store_kv: bool):
    """The backend under test: the NumPy backend, or ``factory(config)`` (a planted one)."""
    common = bench_common()
    if factory is None:
        return common.make_backend("numpy", num_blocks=num_blocks, store_kv=store_kv)
    from kvbench.contract.protocol import CacheConfig
    return factory(CacheConfig(model=common.model(), block_size=common.BLOCK_SIZE,
                               num_blocks=num_blocks, store_kv=store_kv))


def decode_vs_scatter(factory=None) -> tuple[float, float]:
    """(seconds of the floor of a decode step over 256 sequences: their 256 new tokens of K/V
    written into a pool of the same shape at one slot per sequence, a single fancy-indexed
    assignment as vLLM's reshape_and_cache does; of the subject's decode step, K/V written).
    Step i is trial i (common.decode_batch has room for 16)."""
    common = bench_common()
    seqs, kv = list(range(DECODE_BATCH)), common.zeros_kv(DECODE_BATCH)
    subj = common.fill_decode_batch(_subject(factory, DECODE_BATCH * 9, True), DECODE_BATCH)
    pool = common.zeros_kv(DECODE_BATCH * 9 * common.BLOCK_SIZE)
    slots = np.arange(DECODE_BATCH) * 9 * common.BLOCK_SIZE  # one per sequence, far apart

    def floor(step):
        pool[slots + step] = kv

    return _fastest(floor, lambda step: subj.append(seqs, [1] * DECODE_BATCH, kv, step=step + 1))


def decode_vs_object(factory=None) -> tuple[float, float]:
    """(seconds of one decode step over 256 sequences in the per-object Python model
    impls/object_model.py, in the subject), ledger only on both sides."""
    common = bench_common()
    seqs = list(range(DECODE_BATCH))
    ref, _ = common.decode_batch("object", DECODE_BATCH, store_kv=False)
    subj = common.fill_decode_batch(_subject(factory, DECODE_BATCH * 9, False), DECODE_BATCH,
                                    store_kv=False)
    return _fastest(lambda step: ref.append(seqs, [1] * DECODE_BATCH, None, step=step + 1),
                    lambda step: subj.append(seqs, [1] * DECODE_BATCH, None, step=step + 1))


def gather_vs_copy(factory=None) -> tuple[float, float]:
    """(seconds of np.copy of 4 MiB, of gathering the same 4 MiB from 256 scattered blocks)."""
    common = bench_common()
    blocks = 2 * -(-GATHER_TOKENS // common.BLOCK_SIZE)
    subj = common.fill_interleaved_pair(_subject(factory, blocks, True), GATHER_TOKENS)
    src = common.zeros_kv(GATHER_TOKENS) + np.float16(1)
    return _fastest(lambda i: np.copy(src), lambda i: np.asarray(subj.gather(0)))


@dataclass(frozen=True)
class RatioGate:
    name: str
    about: str
    measure: Callable  # (factory) -> (reference seconds, subject seconds)


RATIO_GATES = {g.name: g for g in (
    RatioGate("decode_vs_scatter", "decode step over 256 sequences, K/V written: one scatter of "
              "the same 256 tokens into a pool / NumPy", decode_vs_scatter),
    RatioGate("decode_vs_object", "decode step over 256 sequences, ledger only: per-object Python "
              "model (impls/object_model.py) / NumPy", decode_vs_object),
    RatioGate("gather_vs_copy", "np.copy of 4 MiB / NumPy gather of the same 4 MiB from 256 "
              "scattered blocks", gather_vs_copy),
)}


@dataclass
class RatioResult:
    name: str
    ratios: list  # reference / subject per repeat
    typical: float | None
    skipped: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    @property
    def floor(self) -> float | None:
        return None if self.typical is None else self.typical / MARGIN

    @property
    def ok(self) -> bool:
        return bool(self.skipped) or self.typical is None or self.median >= self.floor

    def __str__(self) -> str:
        if self.skipped:
            return f"ratio {self.name}: skipped ({self.skipped})"
        spread = f"{min(self.ratios):.3g}..{max(self.ratios):.3g}"
        if self.typical is None:
            return (f"ratio {self.name}: median {self.median:.3g} ({spread} over {len(self.ratios)}) "
                    f"- no typical value recorded (`kvbench gates --update-ratios`)")
        state = "ok" if self.ok else "FAIL"
        return (f"ratio {self.name}: median {self.median:.3g} ({spread} over {len(self.ratios)} "
                f"repeats), typical {self.typical:.3g}, floor {self.floor:.3g} = typical / "
                f"{MARGIN:g}: {state}"
                + ("" if self.ok else f" - the subject is {self.typical / self.median:.3g}x slower "
                   f"relative to its reference than usual"))


def ratio_gate(name: str, expected: dict | None = None, *, factory=None,
               repeats: int = REPEATS) -> RatioResult:
    """Median over ``repeats`` of reference / subject seconds; ``factory`` builds the subject
    (default: the NumPy backend)."""
    gate = RATIO_GATES[name]
    expected = read_expected() if expected is None else expected
    typical = expected.get("ratios", {}).get(name, {}).get("typical")
    ratios = []
    try:
        for _ in range(repeats):
            ref, subj = gate.measure(factory)
            ratios.append(ref / subj)
    except NotImplementedError as e:
        return RatioResult(name, [], typical, skipped=str(e))
    return RatioResult(name, ratios, typical)


def ratio_gates(expected: dict | None = None, names=None, repeats: int = REPEATS) -> list:
    expected = read_expected() if expected is None else expected
    return [ratio_gate(n, expected, repeats=repeats) for n in names or RATIO_GATES]


# --- the `kvbench gates` command -----------------------------------------------------------------


def cmd_gates(args) -> int:
    expected = read_expected(args.expected)
    narrowed = bool(args.backend or args.case)
    if narrowed and (args.update or args.update_ratios):
        print("kvbench gates: --update records the whole set; run it without --backend/--case",
              file=sys.stderr)
        return 2
    code = 0
    if not args.skip_exact:
        report = exact_gates(expected, backends=args.backend, cases=args.case,
                             quant=not narrowed)
        if args.update:
            skipped = report.skipped
            expected = merge_measured(expected, report.values, skipped)
            expected["about"] = ABOUT
            expected["recorded"] = {**commit_info(), "machine": machine_info()["platform"]}
            path = write_expected(expected, args.expected)
            moved = [str(d) for d in report.drifts]
            print("\n".join(moved) if moved else "no exact value moved")
            print(f"exact values written to {path}")
        else:
            print(report.explain())
            code = max(code, 0 if report.ok else 1)
    if not args.skip_ratios and not narrowed:
        results = ratio_gates(expected, repeats=args.repeats)
        for r in results:
            print(r)
        if args.update_ratios:
            ratios = expected.setdefault("ratios", {})
            for r in results:
                if not r.skipped:
                    ratios[r.name] = {"typical": round(r.median, 3), "about": RATIO_GATES[r.name].about,
                                      "margin": MARGIN}
            expected["about"] = ABOUT
            expected["ratios_recorded"] = {**commit_info(), "machine": machine_info()["platform"],
                                           "cpus": machine_info()["cpus"]}
            print(f"typical ratios written to {write_expected(expected, args.expected)}")
        elif not all(r.ok for r in results):
            code = 1
    return code


ABOUT = ("kvbench regression gates (kvbench/bench/gates.py). replay/quant: exact lower-is-better values; "
         "any change fails until recorded with `kvbench gates --update`. ratios: typical "
         "reference/subject speed ratios; a gate fails below typical / margin; re-measure with "
         "`kvbench gates --update-ratios`.")


def add_gates_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("gates", help="regression gates: exact memory/error figures, speed ratios")
    p.add_argument("--update", action="store_true",
                   help="record the measured exact values in expected.json (an intended change)")
    p.add_argument("--update-ratios", action="store_true",
                   help="re-measure the typical speed ratios and record them")
    p.add_argument("--backend", action="append",
                   help=f"exact gates of this backend only (repeatable; of {', '.join(GATED_BACKENDS)})")
    p.add_argument("--case", action="append",
                   help="exact gates of this replay case only (workload or workload@policy)")
    p.add_argument("--skip-exact", action="store_true")
    p.add_argument("--skip-ratios", action="store_true")
    p.add_argument("--repeats", type=int, default=REPEATS, help="repeats per ratio (median)")
    p.add_argument("--expected", default=str(EXPECTED_PATH), help="expected values file")
    p.set_defaults(func=cmd_gates)
    return p


def main(argv=None) -> int:
    """``python -m kvbench.bench.gates``: the same as ``kvbench gates``."""
    parser = argparse.ArgumentParser(prog="kvbench")
    add_gates_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["gates", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
