"""`kvbench gates`: the exact gates (CI runs these too) and the ratio gates (on demand)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from pathlib import Path

from kvbench.bench.gates import (
    EXPECTED_PATH,
    GATED_BACKENDS,
    ExactReport,
    exact_gates,
    merge_measured,
    read_expected,
    replay_cases,
    write_expected,
)
from kvbench.cli.options import UsageError, positive_float, positive_int
from kvbench.outputs import check_writable
from kvbench.bench.ratios import (
    BASELINE_PATH,
    CI_FACTOR,
    FACTOR,
    RATIO_GATES,
    merge_baseline,
    read_baseline,
    ratio_gates,
    record_baseline,
    write_baseline,
)
from kvbench.provenance import commit_info, machine_info


def cmd_gates(args) -> int:
    narrowed = bool(args.backend or args.case)
    if narrowed and (args.update or args.update_ratios):
        raise UsageError("--update records the whole set; run it without --backend/--case")
    if args.skip_exact and (args.skip_ratios or narrowed):
        raise UsageError("--skip-exact: nothing left to check (the ratio gates are skipped too, "
                         "or narrowed away by --backend/--case)")
    for name in args.ratio or ():
        if name not in RATIO_GATES:
            raise UsageError(f"--ratio {name}: no such ratio gate; of {', '.join(RATIO_GATES)}")
    if args.ratio and args.skip_ratios:
        raise UsageError("--ratio names ratio gates: it cannot go with --skip-ratios")
    if args.ratio and narrowed:  # a narrowed run skips the ratio gates: --ratio would do nothing
        raise UsageError("--ratio runs ratio gates, which --backend/--case skip: run them apart "
                         "(`kvbench gates --skip-exact --ratio NAME`)")
    if args.skip_ratios and args.update_ratios:
        raise UsageError("--update-ratios records the ratio gates' baseline: it cannot go with "
                         "--skip-ratios")
    if args.skip_exact and args.update:
        raise UsageError("--update records the exact values: it cannot go with --skip-exact")
    for name in args.backend or ():
        if name not in GATED_BACKENDS:
            raise UsageError(f"--backend {name}: not a gated backend; gated (as `kvbench list` "
                             f"names them): {', '.join(GATED_BACKENDS)}")
    cases = replay_cases(args.case) if args.case else None
    if not Path(args.expected).exists() and not args.update and not args.skip_exact:
        raise UsageError(f"--expected {args.expected}: no such file (`kvbench gates --update` "
                         f"records one)")
    if args.update:
        check_writable(args.expected, option="--expected")
    if args.update_ratios:
        check_writable(args.baseline, option="--baseline")
    expected = read_expected(args.expected)
    code = 0
    tally = Tally()
    if not args.skip_exact:
        report = exact_gates(expected, backends=args.backend, cases=cases,
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
            if not report.checked:
                raise UsageError("the exact gates checked nothing: every case was skipped here")
            code = max(code, 0 if report.ok else 1)
            tally.exact = report
    if args.update_ratios:
        baseline = record_baseline(args.ratio)
        if args.ratio:
            baseline = merge_baseline(read_baseline(args.baseline), baseline)
        for name, why in baseline["skipped"].items():
            print(f"ratio {name}: skipped ({why})")
        print(f"ratio baseline ({sum(g['blocks'] for g in baseline['gates'].values())} blocks) "
              f"written to {write_baseline(baseline, args.baseline)}")
    elif not args.skip_ratios and not narrowed:
        results = ratio_gates(read_baseline(args.baseline), args.ratio, blocks=args.blocks,
                              factor=args.factor)
        for r in results:
            print(r)
        if not all(r.ok for r in results):
            code = 1
        tally.ratios = results
    if tally.exact or tally.ratios:
        print(tally.line(code))
    return code


@dataclass
class Tally:
    """The one summary line ending `kvbench gates`: what passed, failed, drifted, was skipped."""

    exact: ExactReport | None = None  # the exact gates' report, when they ran
    ratios: list = field(default_factory=list)  # the ratio gates' results, when they ran

    def line(self, code: int) -> str:
        parts = []
        if self.exact is not None:
            e = self.exact
            parts.append(f"exact: {e.checked} quantities, {len(e.drifts)} drifted, "
                         f"{len(e.skipped)} cases skipped")
        if self.ratios:
            skipped = [r for r in self.ratios if r.skipped]
            unjudged = [r for r in self.ratios if not r.skipped and not r.baseline]
            failed = [r for r in self.ratios if not r.ok]
            passed = len(self.ratios) - len(skipped) - len(unjudged) - len(failed)
            names = lambda rs: f" ({', '.join(r.name for r in rs)})" if rs else ""  # noqa: E731
            parts.append(f"ratio: {passed} passed, {len(failed)} failed{names(failed)}, "
                         f"{len(skipped)} skipped{names(skipped)}"
                         + (f", {len(unjudged)} without a baseline{names(unjudged)}" if unjudged else ""))
        verdict = "pass" if code == 0 else "FAIL"
        return f"gates {verdict} (exit {code}): " + "; ".join(parts)


ABOUT = ("kvbench regression gates (kvbench/bench/gates.py). replay/pool/quant: exact lower-is-better "
         "values; any change fails until recorded with `kvbench gates --update`. The ratio gates' "
         "baseline is results/gates/ratios.json (`kvbench gates --update-ratios`).")


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("gates", help="regression gates: exact memory/error figures, speed ratios",
                       description="The regression gates: exact memory and error figures against "
                                   "results/gates/expected.json (CI runs these), and same-run "
                                   "speed ratios against results/gates/ratios.json.")
    p.add_argument("--update", action="store_true",
                   help="record the measured exact values in expected.json (an intended change)")
    p.add_argument("--update-ratios", action="store_true",
                   help="re-measure the ratio gates' baseline and record it (--baseline)")
    p.add_argument("--backend", action="append",
                   help=f"exact gates of this backend only (repeatable; of {', '.join(GATED_BACKENDS)}: "
                        f"the names of `kvbench list`)")
    p.add_argument("--case", action="append",
                   help="exact gates of this replay case only (workload, or workload@policy)")
    p.add_argument("--skip-exact", action="store_true", help="only the speed ratio gates")
    p.add_argument("--skip-ratios", action="store_true", help="only the exact gates")
    p.add_argument("--ratio", action="append", metavar="GATE",
                   help=f"this ratio gate only (repeatable; of {', '.join(RATIO_GATES)}); with "
                        f"--update-ratios its baseline is re-recorded and the others' kept")
    p.add_argument("--blocks", type=positive_int,
                   help="blocks per ratio gate (default: each gate's own count, sized for CI)")
    p.add_argument("--expected", default=str(EXPECTED_PATH), help="expected values file")
    p.add_argument("--baseline", default=str(BASELINE_PATH), help="the ratio gates' baseline")
    p.add_argument("--factor", type=positive_float, default=FACTOR,
                   help=f"a ratio gate fails on a significant slowdown above this (default {FACTOR:g}; "
                        f"the test suite uses {CI_FACTOR:g}, as a shared CI machine needs)")
    p.set_defaults(func=cmd_gates)
    return p


def main(argv=None) -> int:
    """``python -m kvbench.cli.gates``: the same as ``kvbench gates``."""
    from kvbench.cli import main as kvbench
    return kvbench(["gates", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
