"""`kvbench fuzz` against every planted fault of the catalogue, and its speed: which faults a
campaign finds within a history budget, after how many histories, shrunk to how many operations;
histories per minute against correct backends.

    python scripts/fuzz_catalogue.py [--histories 300] [--speed-histories 100] [--seed 0]
                                     [--base-model-only] [--fuzz-bugs] [--out results/fuzz]

--fuzz-bugs: the planted edge bugs of impls/faults_fuzz.py (FUZZ_BUGS, what a default campaign
must find) instead of the catalogue, written as edges.md / edges.json.

Each fault runs `Campaign(first=True)` (stop at the first finding) with shrinking bounded by
attempts, so the table is the same on every machine; the speed rows are wall time here.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# scripts/ off the path: its coverage.py would stand for the package numba imports at a compile
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "scripts"]

from impls.faults import CATALOGUE, Bug  # noqa: E402
from impls.faults_fuzz import FUZZ_BUGS  # noqa: E402
from kvbench.contract import registry  # noqa: E402
from kvbench.search.fuzz import Campaign  # noqa: E402

SPEED_BACKENDS = ("numpy", "python-objects")


def one(target: str, histories: int, seed: int, attempts: int, first: bool, shapes: bool) -> dict:
    with tempfile.TemporaryDirectory() as out:
        c = Campaign(registry.resolve(target), Path(out), seed=seed, max_histories=histories,
                     shrink_attempts=attempts, shrink_seconds=3600, first=first,
                     model_shapes=shapes).run()
    return c.summary()


def markdown(record: dict) -> str:
    rows = record["faults"]
    lines = [f"`{record['command']}`", "",
             f"{sum(r['found'] for r in rows)} of {len(rows)} planted faults found within "
             f"{record['histories']} histories (seed {record['seed']}, shrinking bounded at "
             f"{record['attempts']} replays).", "",
             "| fault | upstream | found at history | kind | at | ops | shrunk to | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        at = r["history"] if r["found"] else f"not in {r['histories_run']}"
        lines.append(f"| {r['fault']} | {r['upstream']} | {at} | {r['kind']} | {r['site']} | "
                     f"{r['ops_before'] or ''} | {r['ops_after'] or ''} | {r['seconds']:.1f} |")
    if record["speed"]:
        lines += ["", "| backend | histories | seconds | histories per minute | operations per second |",
                  "|---|---|---|---|---|"]
        lines += [f"| {s['backend']} | {s['histories']} | {s['seconds']:.1f} | "
                  f"{s['histories_per_minute']} | {s['ops_per_second']} |" for s in record["speed"]]
        edges = list(record["speed"][0]["edges"])
        lines += ["", "Edge conditions reached (histories): " + "; ".join(
            f"{e}: " + " / ".join(str(s["edges"][e]) for s in record["speed"]) for e in edges)
            + " (" + " / ".join(s["backend"] for s in record["speed"]) + ")"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--histories", type=int, default=300)
    p.add_argument("--speed-histories", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attempts", type=int, default=2000, help="shrink attempts per finding")
    p.add_argument("--only", help="faults whose class name contains this")
    p.add_argument("--base-model-only", action="store_true",
                   help="tiny and tiny-hybrid alone (kvbench fuzz --base-model-only)")
    p.add_argument("--model-shapes", action="store_true",
                   help="the default now: does nothing (kept so that recorded commands run)")
    p.add_argument("--fuzz-bugs", action="store_true",
                   help="impls/faults_fuzz.py's planted edge bugs instead of the catalogue")
    p.add_argument("--out", default=str(ROOT / "results" / "fuzz"))
    args = p.parse_args(argv)
    rows = []
    shapes = not args.base_model_only
    bugs = [Bug(name, "kvbench #47", fault, False) for name, fault in FUZZ_BUGS] if args.fuzz_bugs else CATALOGUE
    for bug in bugs:
        target = f"{bug.fault.__module__}:{bug.fault.__qualname__}"
        if args.only and args.only not in target:
            continue
        s = one(target, args.histories, args.seed, args.attempts, first=True, shapes=shapes)
        f = s["findings"][0] if s["findings"] else None
        row = {"fault": bug.fault.__qualname__, "bug": bug.name, "upstream": bug.upstream,
               "found": f is not None, "history": f["history"] if f else None,
               "histories_run": s["histories"], "kind": f["kind"] if f else "",
               "site": f["site"] if f else "", "ops_before": f["ops_before"] if f else None,
               "ops_after": f["ops_after"] if f else None, "seconds": s["seconds"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    speed = []
    for name in SPEED_BACKENDS if not args.only and args.speed_histories else ():
        s = one(name, args.speed_histories, args.seed, args.attempts, first=False, shapes=shapes)
        speed.append({"backend": name, "histories": s["histories"], "seconds": s["seconds"],
                      "histories_per_minute": s["histories_per_minute"],
                      "ops_per_second": s["ops_per_second"], "findings": len(s["findings"]),
                      "edges": s["coverage"]["edges"]})
        print(json.dumps(speed[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = ("edges" if args.fuzz_bugs else "catalogue") + (f"-{args.only}" if args.only else "")
    record = {"command": "python scripts/fuzz_catalogue.py " + " ".join(argv or sys.argv[1:]),
              "seed": args.seed, "model_shapes": shapes, "histories": args.histories, "attempts": args.attempts,
              "faults": rows, "speed": speed}
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(record))
    found = sum(r["found"] for r in rows)
    print(f"{found} of {len(rows)} faults found", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
