"""`kvbench gen`, `kvbench prefix` and `kvbench list`: workloads, prefix-cache curves, backends."""
from __future__ import annotations

import pandas as pd

from kvbench.checking import suite
from kvbench.cli.tables import print_table
from kvbench.contract import registry


def cmd_gen(args) -> int:
    from kvbench.traces import generators
    if args.family:
        trace = generators.generate(args.family, seed=args.seed)
        out = args.out or f"{args.family}-{args.seed}.jsonl"
        from kvbench.traces.format import save
        save(trace, out)
        print(f"wrote {out} ({len(trace)} ops)")
        return 0
    from kvbench.traces.canonical import write_canonical
    written = write_canonical(args.out or suite.WORKLOADS_DIR)
    for p in written:
        print(f"wrote {p}")
    return 0


def cmd_prefix(args) -> int:
    from pathlib import Path

    from kvbench.analyses import prefix
    from kvbench.traces.loaders import load_requests, prefix_hit_rate_unbounded
    requests = load_requests(args.trace, args.format)[:args.max_requests]
    trace = prefix.cache_trace(requests, args.block_size)
    curve = prefix.hit_rate_curve(trace, backend=args.backend)
    ids = prefix_hit_rate_unbounded(requests)
    print_table(curve, ["backend", "cache_blocks", "hit_blocks", "hashed_blocks", "hit_rate", "refused"])
    print(f"unbounded cache, counted by the trace's own block ids (partial last blocks included): "
          f"{ids[0]}/{ids[1]} = {ids[0] / ids[1]:.1%}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"{Path(args.trace).stem}-B{args.block_size}"
        curve.to_csv(out / f"{stem}.csv", index=False)
        prefix.plot_curve(curve, out / f"{stem}.png",
                          f"{Path(args.trace).stem}: prefix cache hit rate, {args.block_size}-token blocks")
        print(f"wrote {out / stem}.csv and .png")
    return 0


def cmd_list(args) -> int:
    rows = []
    for name, e in registry.entries().items():
        ok, why = e.available()
        rows.append({"backend": name, "from": e.origin, "target": e.target,
                     "available": "yes" if ok else "no", "why not": why})
    print_table(pd.DataFrame(rows), ["backend", "from", "available", "why not", "target"])
    from kvbench.contract.formulas import PRESETS
    print("\nmodels: " + ", ".join(f"{m.name} ({m.bytes_per_token} B/token)" for m in PRESETS.values()))
    print("workloads: " + ", ".join(p.stem for p in suite.committed_workloads()))
    return 0


def register_gen_prefix(sub) -> None:
    p = sub.add_parser("gen", help="regenerate the committed workloads (or one family)")
    p.add_argument("--family")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    p.set_defaults(func=cmd_gen)

    p = sub.add_parser("prefix", help="prefix-cache hit rate over cache sizes, checked by the oracle")
    p.add_argument("trace")
    p.add_argument("--format", default="mooncake", help="a loader with block hashes (mooncake)")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--backend", default="numpy")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--out", help="folder for the curve's CSV and PNG")
    p.set_defaults(func=cmd_prefix)


def register_list(sub) -> None:
    p = sub.add_parser("list", help="backends (with where they come from and whether they run here)")
    p.set_defaults(func=cmd_list)
