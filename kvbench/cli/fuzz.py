"""`kvbench fuzz --backend B`: random histories over random settings against one backend, every
failure shrunk to NAME.min.jsonl and a pytest case in --out, with a summary (summary.json,
summary.md) of what was found and what was reached; with --store, the campaign's record also
goes to the results store (sweep "fuzz", one cell per campaign: `kvbench results fuzz`).

Exit status: 0 when nothing was found, 1 when something was (or the harness could not check a
history), 2 for bad input or a backend that cannot run, 130 when interrupted (143 terminated)
with nothing found.
Ctrl-C keeps every finding and the summary so far.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import sys

from kvbench.bench import records
from kvbench.cli import options
from kvbench.outputs import check_writable
from kvbench.progress import Progress
from kvbench.search.fuzz import DEFAULT_SHRINK_ATTEMPTS, DEFAULT_SHRINK_SECONDS, Campaign

DEFAULT_MINUTES = 5.0


def cmd_fuzz(args) -> int:
    entry = options.runnable_backend(args.backend)
    out = check_writable(args.out, option="--out", folder=True)
    minutes = args.minutes if args.minutes is not None or args.max_histories else DEFAULT_MINUTES
    if args.model_shapes:
        print("kvbench fuzz: --model-shapes is the default now (the flag does nothing and will go); "
              "--base-model-only draws tiny and tiny-hybrid alone", file=sys.stderr)
    commit = None
    if args.store is not None:  # the code the campaign runs, read before it runs
        from kvbench.bench.grid import code_version
        commit = code_version()
    bar = None if args.quiet else Progress(args.max_histories, "fuzz", "histories")
    try:
        c = Campaign(entry, out, seed=args.seed, max_histories=args.max_histories,
                     seconds=None if minutes is None else minutes * 60,
                     shrink_seconds=args.shrink_seconds, shrink_attempts=args.shrink_attempts,
                     gather=args.gather, first=args.first, model_shapes=not args.base_model_only,
                     progress=bar).run()
    finally:
        if bar is not None:
            bar.close()
    s = c.summary()
    print(f"{args.backend}: {s['histories']} histories, {s['operations']:,} operations, "
          f"{s['histories_per_minute']} histories per minute ({c.stopped})")
    for f in s["findings"]:
        d = f["divergence"]
        print(f"FAIL {f['name']}: {f['kind']} at {f['site']} (x{f['count']}), shrunk "
              f"{f['ops_before']} -> {f['ops_after']} ops: step {d['step']} {d['quantity']} "
              f"expected {d['expected']!r}, got {d['actual']!r}")
    for e in s["errors"][:3]:
        print(f"ERROR history {e['history']}: {e['error']}", file=sys.stderr)
    missed = s["coverage"]["edges not reached"]
    print(f"reached {len(s['coverage']['edges']) - len(missed)} of {len(s['coverage']['edges'])} "
          f"edge conditions (counted where they acted)"
          + (f"; not reached, so not tested: {', '.join(missed)}" if missed else ""))
    print(f"wrote {out / 'summary.md'}")
    if args.store is not None:
        print(f"stored {store_campaign(args.store, s, args, minutes, commit)}")
    if s["findings"] or s["errors"]:
        return options.EXIT_FAIL
    if c.stop is not None:
        raise c.stop  # the one message and exit code of a stop (kvbench.cli.options)
    return options.EXIT_OK


FUZZ_SWEEP = "fuzz"


def store_campaign(url: str, s: dict, args, minutes, commit: dict) -> str:
    """The campaign's record as one cell of sweep "fuzz" in the results store: what it ran (backend,
    seed, bound), what it did (histories, operations, time) and what it found (each finding's
    name, kind and first divergence, as JSON). The cell's id is a hash of what it ran and the
    code (``commit``: kvbench.bench.grid.code_version() before the campaign), so the same
    campaign of the same code is one cell, stored again."""
    from kvbench.bench.store import Store
    ran = {"backend": s["backend"], "seed": s["seed"], "max_histories": args.max_histories,
           "minutes": minutes, "model_shapes": s["model_shapes"], "code": commit["code"]}
    cell_id = hashlib.sha256(json.dumps(ran, sort_keys=True).encode()).hexdigest()[:16]
    findings = [{"name": f["name"], "kind": f["kind"], "site": f["site"], "count": f["count"],
                 "ops": f["ops_after"], "step": f["divergence"]["step"],
                 "quantity": f["divergence"]["quantity"]} for f in s["findings"]]
    row = {**ran, "status": "FAIL" if findings or s["errors"] else "pass", "stopped": s["stopped"],
           "histories": s["histories"], "operations": s["operations"], "seconds": s["seconds"],
           "histories_per_minute": s["histories_per_minute"], "findings": len(findings),
           "errors": len(s["errors"]), "finding_names": ";".join(f["name"] for f in findings),
           "findings_json": json.dumps(findings), "commit": commit["commit"],
           "dirty": commit["dirty"], "cell_id": cell_id,
           "started": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)}
    return Store(url).write_cell(FUZZ_SWEEP, s["backend"], cell_id, row)


def register(sub) -> None:
    p = sub.add_parser("fuzz", help="random histories against a backend, each failure shrunk to a "
                                    "reproducer", description=__doc__)
    p.add_argument("--backend", required=True, help="backend name or package.module:Factory")
    p.add_argument("--minutes", type=options.positive_float,
                   help=f"stop after this long (default {DEFAULT_MINUTES:g}, unless "
                        f"--max-histories is given); a shrink in progress finishes")
    p.add_argument("--max-histories", type=options.positive_int,
                   help="stop after this many histories (deterministic under --seed)")
    p.add_argument("--seed", type=options.nonnegative_int, default=0,
                   help="the campaign's seed: the same seed makes the same histories (default 0)")
    p.add_argument("--out", default=str(records.RESULTS_DIR / "scratch" / "fuzz"),
                   help="folder for the findings and the summary (default results/scratch/fuzz, "
                        "out of git)")
    p.add_argument("--shrink-seconds", type=options.positive_float, default=DEFAULT_SHRINK_SECONDS,
                   help=f"time for shrinking one finding (default {DEFAULT_SHRINK_SECONDS:g})")
    p.add_argument("--shrink-attempts", type=options.positive_int, default=DEFAULT_SHRINK_ATTEMPTS,
                   help=f"replays for shrinking one finding (default {DEFAULT_SHRINK_ATTEMPTS})")
    p.add_argument("--gather", choices=["touched", "all", "end", "none"], default="touched",
                   help="which K/V the checker reads back (check()'s gather; default touched)")
    p.add_argument("--first", action="store_true", help="stop at the first finding")
    p.add_argument("--base-model-only", action="store_true",
                   help="draw tiny and tiny-hybrid's full / sliding mixes alone; by default models "
                        "come from the presets' patterns of group kinds (kvbench list-models) and "
                        "random mixes of the kinds the backend declares, scaled down to "
                        "tiny-hybrid's and tiny-mla's layers, besides")
    p.add_argument("--model-shapes", action="store_true",
                   help="deprecated, does nothing: model shapes are drawn by default")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--store", nargs="?", const=str(records.RESULTS_DIR / "sweeps" / "store"),
                   help="also record the campaign in this results store (sweep 'fuzz'; no value: "
                        "results/sweeps/store, out of git), read by `kvbench results fuzz`")
    p.set_defaults(func=cmd_fuzz)
