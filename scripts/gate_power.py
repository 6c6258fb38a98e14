"""How often the ratio gates catch a planted slowdown, and how often an unchanged tree fails them.

Each run is a fresh process running every ratio gate (or those --gates names) once (as
`kvbench gates --skip-exact` does) with the measurement hook KVBENCH_GATE_SLOWDOWN set to one
level: 1 (the unchanged tree: a failure is a false alarm), 1.1, 1.25, 1.5 or 2 (every gated
subject that many times slower: a failure is a detection). Levels are interleaved run by run,
so that the machine's load drifts over all of them alike. Round i runs levels 1 and 1.25 (the goal: 1.25x caught in >= 19 of 20
runs, no false alarm in 20) and one of 1.1, 1.5, 2 in turn.

    nice -n 10 .venv/bin/python scripts/gate_power.py              # 20 rounds: 60 runs
    nice -n 10 .venv/bin/python scripts/gate_power.py --rounds 5
    nice -n 10 .venv/bin/python scripts/gate_power.py --levels 1,1.1,1.25,1.5,2   # 100 runs
    nice -n 10 .venv/bin/python scripts/gate_power.py --gates check_vs_replay --levels 1,1.25

A gate's verdict is the gates' own: a failing first sample is sampled again, and the gate is
decided again on both samples' blocks. power.md gives that verdict and, beside it, the first
sample's alone; power_runs.jsonl keeps every block's log ratio, so that another rule can be
judged on the same runs.

Writes results/gates/power.csv and power.md (rewritten after every run, so a stopped campaign
leaves what it measured) and power_runs.jsonl (its provenance, then every gate's verdict in
every run; `--report` rewrites the tables from it).
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the repository in place of scripts/, whose coverage.py would shadow the package numba imports
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "scripts"]

from kvbench.bench import ratios as R  # noqa: E402
from kvbench.outputs import write_text  # noqa: E402
from kvbench.provenance import commit_info, machine_info  # noqa: E402

OUT = ROOT / "results" / "gates"
GOAL_LEVEL = 1.25
SIDE_LEVELS = (1.1, 1.5, 2.0)


def one_run(names=None) -> None:
    """Child: every ratio gate once, under the slowdown in the environment; one JSON line."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = {}
    for r in R.ratio_gates(names=names):
        out[r.name] = {"failed": not r.ok, "failed_first": not r.first_ok, "skipped": r.skipped,
                       "slowdown": r.slowdown, "lower": r.lower, "median_ratio": r.median,
                       "blocks": len(r.log_ratios), "log_ratios": [round(x, 5) for x in r.log_ratios]}
        if r.recheck is not None:
            out[r.name]["recheck"] = {"slowdown": r.recheck.slowdown, "lower": r.recheck.lower,
                                      "log_ratios": [round(x, 5) for x in
                                                     r.recheck.log_ratios[len(r.log_ratios):]]}
    print(json.dumps({"gates": out, "wall_s": time.perf_counter() - t0,
                      "cpu_s": time.process_time() - c0, "load_average": os.getloadavg()}))


def baseline_provenance(names=None) -> dict:
    """Where the baseline of the gates run was recorded: a gate re-recorded alone
    (`kvbench gates --ratio NAME --update-ratios`) carries its own provenance."""
    baseline = R.read_baseline()
    own = [baseline["gates"].get(n, {}).get("recorded") for n in names or ()]
    return own[0] if own and all(r and r == own[0] for r in own) else baseline.get("recorded", {})


def schedule(rounds: int, side_every: int, every: list[float] | None = None) -> list[float]:
    """Levels 1 and 1.25 in every round; one of 1.1, 1.5, 2 in turn every ``side_every`` rounds.
    With ``every``: each of those levels in every round, the order turned by one each round (so
    that no level always follows another)."""
    if every:
        return [every[(i + k) % len(every)] for i in range(rounds) for k in range(len(every))]
    levels = []
    for i in range(rounds):
        levels += [1.0, GOAL_LEVEL]
        if i % side_every == 0:
            levels.append(SIDE_LEVELS[i // side_every % len(SIDE_LEVELS)])
    return levels


def table(runs: list[dict], verdict: str = "failed") -> list[dict]:
    """One row per gate and one for "any gate": per level, failures / runs and the median
    estimated slowdown (of the first sample). ``verdict``: "failed", the gate's decision (a
    failing first sample decided again with a second), or "failed_first", the first sample's."""
    levels = sorted({r["level"] for r in runs})
    names = [n for n in R.RATIO_GATES if any(n in r["gates"] for r in runs)]
    rows = []
    for name in names + ["any gate"]:
        row = {"gate": name}
        for level in levels:
            at = [r for r in runs if r["level"] == level]
            if name == "any gate":
                fails = sum(any(g.get(verdict, g["failed"]) for g in r["gates"].values())
                            for r in at)
                est = ""
            else:
                got = [r["gates"][name] for r in at if not r["gates"][name]["skipped"]]
                fails = sum(g.get(verdict, g["failed"]) for g in got)
                ests = sorted(g["slowdown"] for g in got)
                est = f"{ests[len(ests) // 2]:.3f}" if ests else ""
            row[f"failed at {level:g}x"] = f"{fails}/{len(at)}"
            row[f"median estimate at {level:g}x"] = est
        unchanged = [r["gates"][name]["slowdown"] for r in runs
                     if r["level"] == 1 and name in r["gates"] and not r["gates"][name]["skipped"]]
        row["estimates at 1x"] = f"{min(unchanged):.2f}..{max(unchanged):.2f}" if unchanged else ""
        rows.append(row)
    return rows


def markdown_table(rows: list[dict], levels: list[float]) -> list[str]:
    lines = [
        "| gate | " + " | ".join(f"failed at {v:g}x" for v in levels) + " | "
        + " | ".join(f"median estimate at {v:g}x" for v in levels) + " | estimates at 1x |",
        "|---|" + "---|" * (2 * len(levels) + 1),
    ]
    for row in rows:
        lines.append(f"| {row['gate']} | "
                     + " | ".join(row[f"failed at {v:g}x"] for v in levels) + " | "
                     + " | ".join(row[f"median estimate at {v:g}x"] for v in levels)
                     + f" | {row['estimates at 1x']} |")
    return lines


def write(runs: list[dict], prov: dict, stem: str = "power") -> None:
    rows = table(runs)
    both = ([{"verdict": "both samples", **row} for row in rows]
            + [{"verdict": "first sample", **row} for row in table(runs, "failed_first")])
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(both[0]))
    w.writeheader()
    w.writerows(both)
    write_text(OUT / f"{stem}.csv", buf.getvalue())
    levels = sorted({r["level"] for r in runs})
    walls = sorted(r["wall_s"] for r in runs)
    cpus = sorted(r["cpu_s"] for r in runs if "cpu_s" in r)
    cpu = (f"; its CPU time (the neighbours' use of the caches inflates it) median "
           f"{cpus[len(cpus) // 2]:.1f} s"
           if cpus else "")
    loads = [r["load_average"][0] for r in runs]
    lines = [
        "# Ratio gates: detection and false-alarm rates",
        "",
        f"Runs of the ratio gates tabled below (as `kvbench gates --skip-exact` runs them, a "
        f"fresh process each) with a "
        f"planted slowdown of every gated subject (`{R.SLOWDOWN_ENV}`, a busy wait by the CPU "
        f"clock after each subject call, of (factor - 1) times its CPU time). At 1x (the "
        f"unchanged tree) a failure is a false alarm; above, a detection. A gate fails when its "
        f"blocks are estimated more than {R.FACTOR:g}x slower than results/gates/ratios.json's "
        f"(the Hodges-Lehmann shift of the log ratios) and the Mann-Whitney lower bound of the "
        f"shift at {1 - R.ALPHA:.0%} is above 1: in a first sample, then (sampled again on fresh "
        f"fixtures) in both samples' blocks together.",
        "",
        *markdown_table(rows, levels),
    ]
    if any("failed_first" in g for r in runs for g in r["gates"].values()):
        lines += ["", "The same runs judged on their first sample alone (no second sample: "
                      "`ratio_gates(confirm=False)`):", "",
                  *markdown_table(table(runs, "failed_first"), levels)]
    lines += [
        "",
        f"{len(runs)} runs; a run's wall time (all {len(rows) - 1} gates, the process's start excluded): "
        f"median {walls[len(walls) // 2]:.1f} s, {walls[0]:.1f}..{walls[-1]:.1f} s{cpu}. "
        f"1-minute load average during the runs {min(loads):.1f}..{max(loads):.1f} on "
        f"{prov['machine']['cpus']} cores: other jobs were running throughout (the machine is "
        f"shared), and the runs were started with nice {prov['nice']}.",
        "",
        f"Measured by `{prov['command']}` on commit {prov['commit']}"
        f"{' (uncommitted changes)' if prov['dirty'] else ''}"
        + "".join(f", resumed with --resume on {c[:7]}" for c in prov.get("resumed", []))
        + f", {prov['machine']['platform']}, "
        f"{prov['started']} to {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}. "
        f"Baseline: results/gates/ratios.json, recorded on commit "
        f"{prov['baseline'].get('commit', '?')} at {prov['baseline'].get('date', '?')} (load "
        f"{prov['baseline'].get('load_average', '?')}).",
    ]
    write_text(OUT / f"{stem}.md", "\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="rounds (default 20)")
    ap.add_argument("--side-every", type=int, default=1,
                    help="run one of 1.1x, 1.5x, 2x every this many rounds (default: every round)")
    ap.add_argument("--levels", type=lambda v: [float(x) for x in v.split(",")],
                    help="comma-separated levels, each run in every round (e.g. 1,1.1,1.25,1.5,2)")
    ap.add_argument("--resume", action="store_true",
                    help="go on with the campaign in power_runs.jsonl (its schedule, its provenance)")
    ap.add_argument("--report", action="store_true",
                    help="only rewrite power.csv and power.md from power_runs.jsonl")
    ap.add_argument("--gates", type=lambda v: v.split(","),
                    help="comma-separated ratio gates to run (default: all); the files are then "
                         "power-<gates>.md, .csv and _runs.jsonl")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in args.gates or ():
        if name not in R.RATIO_GATES:
            ap.error(f"--gates: no ratio gate {name!r}; of {', '.join(R.RATIO_GATES)}")
    stem = "power" if not args.gates else "power-" + "-".join(args.gates)
    raw = OUT / f"{stem}_runs.jsonl"
    if args.one:
        one_run(args.gates)
        return 0
    if args.report:
        lines = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
        write([r for r in lines if "level" in r], lines[0]["provenance"], stem)
        print((OUT / f"{stem}.md").read_text())
        return 0
    prov = {**commit_info(), "machine": machine_info(), "nice": os.nice(0),
            "command": "scripts/gate_power.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "baseline": baseline_provenance(args.gates)}
    runs = []
    if args.resume:
        lines = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
        prov, runs = lines[0]["provenance"], [r for r in lines if "level" in r]
        prov["resumed"] = prov.get("resumed", []) + [commit_info()["commit"]]
    else:
        raw.write_text(json.dumps({"provenance": prov}) + "\n")
    for i, level in enumerate(schedule(args.rounds, args.side_every, args.levels)):
        if i < len(runs):
            assert runs[i]["level"] == level, f"run {i + 1}: not the schedule of --resume's campaign"
            continue
        env = {**os.environ, R.SLOWDOWN_ENV: f"{level:g}"}
        child = [sys.executable, __file__, "--one", *(["--gates", ",".join(args.gates)] if args.gates else [])]
        out = subprocess.run(child, cwd=ROOT, env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        run = {"level": level, **json.loads(out.stdout.strip().splitlines()[-1])}
        runs.append(run)
        with open(raw, "a", encoding="utf-8") as f:
            f.write(json.dumps(run) + "\n")
        failed = [n for n, g in run["gates"].items() if g["failed"]]
        print(f"run {i + 1} at {level:g}x: {run['wall_s']:.1f} s, load {run['load_average'][0]:.1f}, "
              f"failed: {', '.join(failed) or 'none'}", flush=True)
        write(runs, prov, stem)
    print((OUT / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
