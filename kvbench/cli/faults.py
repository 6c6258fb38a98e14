"""`kvbench faults`: the engine-bug catalogue. Each planted fault (impls/faults.py: the bugs of
issue 14's list, as upstream engines had them, and the faults the tests plant) replays the
default suite, the committed workloads `kvbench run` checks, under the checker; the table says
whether the suite caught it, on which workload and step, and the first divergence."""
from __future__ import annotations

import sys

import pandas as pd

from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.cli.tables import print_table

COLUMNS = ["bug", "upstream", "caught", "workload", "step", "first divergence"]


def catalogue(bugs=None, paths=None, progress: bool = False) -> list[dict]:
    """One row per planted fault: the first run of the default suite that fails it."""
    from impls.faults import CATALOGUE
    traces = suite.load_traces(paths or suite.committed_workloads())
    runs = [(t, suite.config_for(t, policy=p)) for t in traces for p in suite.policies_for(t, "auto")]
    bugs = list(bugs or CATALOGUE)
    if progress:
        from tqdm import tqdm
        bugs = tqdm(bugs, desc="faults", unit="fault", leave=False)
    rows = []
    for bug in bugs:
        row = {"bug": bug.name, "upstream": bug.upstream, "why": bug.why, "caught": "no",
               "workload": "", "step": "", "first divergence": "", "divergence": None}
        for trace, cfg in runs:
            try:
                backend = bug.fault(cfg)
            except NotImplementedError:  # a group kind the pool does not run (SPEC §12)
                continue
            v = check(trace, backend)
            if v.valid is False:
                d = v.divergence
                row.update(caught="yes", workload=trace.name + (f"@{cfg.policy}" if cfg.policy else ""),
                           step=d.step, divergence=d,
                           **{"first divergence": f"{d.quantity}: expected {d.expected!r}, "
                                                  f"got {d.actual!r}"})
                break
        rows.append(row)
    return rows


def cmd_faults(args) -> int:
    rows = catalogue(paths=args.traces or None, progress=not args.quiet)
    df = pd.DataFrame(rows)
    clipped = df.assign(**{"first divergence": df["first divergence"].str.slice(0, args.width)})
    print_table(clipped, COLUMNS)
    missed = df[(df.caught == "no") & df.why]
    for _, r in missed.iterrows():
        print(f"MISSED {r.bug} ({r.upstream}): no workload of the suite catches it", file=sys.stderr)
    print(f"{int((df.caught == 'yes').sum())} of {len(df)} faults caught; "
          f"{int(df.why.sum()) - len(missed)} of {int(df.why.sum())} engine bugs of issue 14")
    return 1 if len(missed) else 0


def register(sub) -> None:
    p = sub.add_parser("faults", help="plant each catalogued engine bug, replay the default suite, "
                                      "say where the checker caught it")
    p.add_argument("traces", nargs="*", help="trace files (default: every committed workload)")
    p.add_argument("--width", type=int, default=90, help="first divergence clipped to this many characters")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_faults)
