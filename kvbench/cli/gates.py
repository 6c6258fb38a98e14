"""`kvbench gates`: the exact gates and the ratio gates, as CI runs them."""
from __future__ import annotations

import argparse
import sys

from pathlib import Path

from kvbench.bench.gates import (
    EXPECTED_PATH,
    GATED_BACKENDS,
    exact_gates,
    merge_measured,
    read_expected,
    replay_cases,
    write_expected,
)
from kvbench.cli.options import UsageError, positive_int
from kvbench.outputs import check_writable
from kvbench.bench.ratios import MARGIN, RATIO_GATES, REPEATS, ratio_gates
from kvbench.provenance import commit_info, machine_info


def cmd_gates(args) -> int:
    narrowed = bool(args.backend or args.case)
    if narrowed and (args.update or args.update_ratios):
        raise UsageError("--update records the whole set; run it without --backend/--case")
    if args.skip_exact and (args.skip_ratios or narrowed):
        raise UsageError("--skip-exact: nothing left to check (the ratio gates are skipped too, "
                         "or narrowed away by --backend/--case)")
    if args.skip_exact and args.update:
        raise UsageError("--update records the exact values: it cannot go with --skip-exact")
    for name in args.backend or ():
        if name not in GATED_BACKENDS:
            raise UsageError(f"--backend {name}: not a gated backend; gated (as `kvbench list` "
                             f"names them): {', '.join(GATED_BACKENDS)}")
    cases = replay_cases(args.case) if args.case else None
    if not Path(args.expected).exists() and not (args.update or args.update_ratios):
        raise UsageError(f"--expected {args.expected}: no such file (`kvbench gates --update` "
                         f"records one)")
    if args.update or args.update_ratios:
        check_writable(args.expected, option="--expected")
    expected = read_expected(args.expected)
    code = 0
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


ABOUT = ("kvbench regression gates (kvbench/bench/gates.py, ratios.py). replay/quant: exact lower-is-better values; "
         "any change fails until recorded with `kvbench gates --update`. ratios: typical "
         "reference/subject speed ratios; a gate fails below typical / margin; re-measure with "
         "`kvbench gates --update-ratios`.")


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("gates", help="regression gates: exact memory/error figures, speed ratios",
                       description="The regression gates CI runs: exact memory and error figures "
                                   "against results/gates/expected.json, and same-run speed ratios.")
    p.add_argument("--update", action="store_true",
                   help="record the measured exact values in expected.json (an intended change)")
    p.add_argument("--update-ratios", action="store_true",
                   help="re-measure the typical speed ratios and record them")
    p.add_argument("--backend", action="append",
                   help=f"exact gates of this backend only (repeatable; of {', '.join(GATED_BACKENDS)}: "
                        f"the names of `kvbench list`)")
    p.add_argument("--case", action="append",
                   help="exact gates of this replay case only (workload, or workload@policy)")
    p.add_argument("--skip-exact", action="store_true", help="only the speed ratio gates")
    p.add_argument("--skip-ratios", action="store_true", help="only the exact gates")
    p.add_argument("--repeats", type=positive_int, default=REPEATS, help="repeats per ratio (median)")
    p.add_argument("--expected", default=str(EXPECTED_PATH), help="expected values file")
    p.set_defaults(func=cmd_gates)
    return p


def main(argv=None) -> int:
    """``python -m kvbench.cli.gates``: the same as ``kvbench gates``."""
    from kvbench.cli import main as kvbench
    return kvbench(["gates", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
