"""What the default `kvbench run` catches of the single-line bugs of impls/faults_edges.py,
before the edge workloads and after: docs/workloads.md's table ("What the default run reaches").

    python scripts/default_reach.py

"Before" replays the workloads committed before them through the default backends of then (no
`numpy-int4`); "after" every committed workload. A bug counts as caught when some run of the
default suite FAILs it; the step is the first such run's first divergence.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from impls.faults import CATALOGUE  # noqa: E402
from impls.faults_edges import EDGE_BUGS  # noqa: E402
from kvbench.analyses import suite  # noqa: E402
from kvbench.cli.faults import catalogue  # noqa: E402

EDGE_WORKLOADS = {"edge-refusals", "edge-eviction", "fork-wide", "long-history"}
DEFAULT_BEFORE = {"numpy", "torch", "numpy-int8", "contiguous-max", "contiguous-pow2",
                  "contiguous-oracle"}


def main() -> None:
    every = suite.committed_workloads()
    before_paths = [p for p in every if p.stem not in EDGE_WORKLOADS]
    bugs = {b.fault: b for b in CATALOGUE}
    print("| bug | caught before | caught after | first caught after (workload, step: quantity) |")
    print("|---|---|---|---|")
    counts = [0, 0]
    for name, fault, base in EDGE_BUGS:
        bug = bugs[fault]
        before = catalogue([bug], before_paths)[0] if base in DEFAULT_BEFORE else {"caught": "no"}
        after = catalogue([bug], every)[0]
        counts[0] += before["caught"] == "yes"
        counts[1] += after["caught"] == "yes"
        where = (f"{after['workload']}, step {after['step']}: {after['divergence'].quantity}"
                 if after["caught"] == "yes" else "")
        print(f"| {name} | {before['caught']} | {after['caught']} | {where} |")
    print(f"| **caught** | **{counts[0]} of {len(EDGE_BUGS)}** | **{counts[1]} of {len(EDGE_BUGS)}** | |")


if __name__ == "__main__":
    main()
