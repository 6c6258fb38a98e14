"""The `kvbench` command: run, check, gen, list, compare."""
from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from kvbench.analyses import eviction

from kvbench.contract import registry

from kvbench.bench import records

from kvbench.analyses import serving

from kvbench.checking import suite
from kvbench.bench.compare import add_compare_parser
from kvbench.bench.gates import add_gates_parser
from kvbench.traces.format import TraceError

RUN_COLUMNS = ["workload", "backend", "policy", "status", "ops", "peak_blocks",
               "final_fragmentation", "evictions", "recomputed_tokens", "hit_rate", "jain",
               "backend_ms", "ops_per_s"]


def add_cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cache settings (default: the trace header's, else tiny model, B=16, 256 blocks)")
    g.add_argument("--model", help="model preset (kvbench list shows them)")
    g.add_argument("--block-size", type=int)
    g.add_argument("--budget", help="budget in blocks ('1024') or bytes ('12GiB')")
    g.add_argument("--max-context", type=int, help="contiguous `max` reservation (default: next pow2 of the longest sequence)")
    g.add_argument("--device", default="cpu", help="device for the torch backend: cpu or cuda")
    g.add_argument("--policy", default="auto",
                   help="eviction policy: lru, lfu, fair, all, none, auto (all three for tenant mixes)")
    g.add_argument("--prefix-caching", default=None, action=argparse.BooleanOptionalAction,
                   help="reuse cached blocks by block hash (default: on when the trace has hashes)")
    g.add_argument("--gather", default="touched", choices=["touched", "all", "end", "none"],
                   help="which sequences' K/V to verify after each operation")


def settings(args) -> dict:
    return dict(model=args.model, block_size=args.block_size, budget=args.budget,
                max_context=args.max_context, device=args.device,
                prefix_caching=args.prefix_caching)


def default_backends() -> list[str]:
    return [n for n in registry.DEFAULT_BACKENDS if registry.resolve(n).available()[0]]


def print_table(df: pd.DataFrame, columns) -> None:
    """A plain table: text left-aligned, numbers right-aligned, floats to 4 significant digits."""
    cols = [c for c in columns if c in df.columns]

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[cell(v) for v in row] for row in df[cols].itertuples(index=False)]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in cols]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    print(line(cols))
    for r in cells:
        print(line(r))


def print_eviction(trace, rows, cache_settings) -> list[str]:
    """A tenant mix: per-tenant figures, and Belady's offline replay beside the online policies.

    Returns the runs whose hit rate beats Belady's where that is impossible (unit-size paging).
    """
    table = eviction.tenant_table(trace, rows)
    if table.empty:
        return []
    print(f"\n{trace.name}: per tenant (usage and quota in blocks; slots for contiguous backends)")
    print_table(table, eviction.TENANT_COLUMNS)
    cfg = suite.config_for(trace, **cache_settings)
    ref = eviction.policy_table(trace, cfg)
    print(f"\n{trace.name}: the oracle's replay under each policy, paged layout; "
          f"Belady is a {ref.belady.iloc[0]}")
    print_table(ref, ["policy", "evictions", "recomputed_tokens", "hits", "misses", "hit_rate", "jain"])
    paged = {f"{r['backend']} {r['policy']}": r for r in rows
             if r["workload"] == trace.name and r["layout"] == "paged" and r["status"] == "pass"}
    return eviction.belady_violations(trace, cfg, paged)


def cmd_run(args) -> int:
    if serving.wants_serving(args):
        return serving.run_serving(args)
    paths = args.traces or suite.committed_workloads()
    if not paths:
        print("no workloads: run `kvbench gen` first", file=sys.stderr)
        return 2
    traces = suite.load_traces(paths)
    backends = args.backend or default_backends()
    rows = suite.run_suite(traces, backends, policy=args.policy, progress=not args.quiet,
                           gather=args.gather, **settings(args))
    df = pd.DataFrame(rows)
    print_table(df, RUN_COLUMNS)
    print_capacity(traces[0], args)
    failed = df[df.status == "FAIL"]
    for _, r in failed.iterrows():
        print(f"FAIL {r.backend} on {r.workload}: {r.divergence}")
    na = df[df.status == "n/a"]
    for _, r in na.drop_duplicates(["backend", "not_applicable"]).iterrows():
        print(f"n/a  {r.backend} on {r.workload}: {r.not_applicable}")
    beyond_optimum = [msg for t in traces if t.header.tenants
                      for msg in print_eviction(t, rows, settings(args))]
    for msg in beyond_optimum:
        print(f"FAIL {msg}")
    rec = records.record("run", rows, {"traces": [str(p) for p in paths], "backends": backends,
                                       **{k: v for k, v in settings(args).items()},
                                       "policy": args.policy}, device=args.device)
    path = records.write(rec, args.output)
    print(f"{len(df)} runs: {int((df.status == 'pass').sum())} pass, {len(failed)} fail, "
          f"{len(na)} n/a; results in {path}")
    return 1 if len(failed) or beyond_optimum else 0


def print_capacity(trace, args) -> None:
    """Tokens a byte budget holds at each KV format, beside the error each makes on the K/V the
    trace's sequences write (its first 256 tokens' worth)."""
    from kvbench import quant
    from kvbench.checking.oracle import content_segments
    from kvbench.contract.protocol import kv_tokens
    cfg = suite.config_for(trace, **settings(args))
    budget = cfg.num_blocks * cfg.block_size * cfg.model.bytes_per_token
    writers, positions = [], []
    for op in trace.ops:
        if getattr(op, "tokens", None) and hasattr(op, "tenant") and len(writers) < 256:
            for w, start, count in content_segments(op.seq, op.tokens, (), cfg.block_size):
                writers += [w] * count
                positions += range(start, start + count)
    sample = kv_tokens(writers[:256], positions[:256], cfg.model, np.float32)
    table = quant.capacity_table(cfg.model, budget, sample, block_size=cfg.block_size,
                                 group_size=min(32, cfg.model.head_dim))
    print(f"\nKV formats for a {budget:,}-byte budget ({cfg.model.name}, blocks of {cfg.block_size}), "
          f"error on {len(sample)} tokens of {trace.name}'s K/V:")
    print_table(table, ["format", "keys", "values", "block_bytes", "metadata_fraction", "tokens",
                        "tokens_vs_fp16", "key_max_abs_error", "key_rmse", "value_max_abs_error",
                        "value_rmse"])


def cmd_check(args) -> int:
    trace = suite.load_traces([args.trace])[0]
    code = 0
    for name in args.backend or default_backends():
        for pol in suite.policies_for(trace, args.policy):
            cfg = suite.config_for(trace, policy=pol, **settings(args))
            row = suite.run_one(trace, name, cfg, args.gather)
            line = f"{row['status']:4} {name} policy={row['policy']} ops={row['ops']}"
            if row["divergence"]:
                line += f"\n     first divergence: {row['divergence']}"
            if row["not_applicable"]:
                line += f"\n     not applicable: {row['not_applicable']}"
            if row["skipped"]:
                line += f"\n     not checked: {row['skipped']}"
            print(line)
            code = max(code, 1 if row["status"] == "FAIL" else 0)
    return code


def cmd_gen(args) -> int:
    from kvbench.traces import generators
    if args.family:
        trace = generators.generate(args.family, seed=args.seed)
        out = args.out or f"{args.family}-{args.seed}.jsonl"
        from kvbench.traces.format import save
        save(trace, out)
        print(f"wrote {out} ({len(trace)} ops)")
        return 0
    written = generators.write_canonical(args.out or suite.WORKLOADS_DIR)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="check every workload on every backend and time them")
    p.add_argument("traces", nargs="*", help="trace files (default: every committed workload)")
    p.add_argument("--backend", action="append", help="backend name or package.module:Factory (repeatable)")
    p.add_argument("--output", help="results file (default results/runs/run-<time>-<commit>.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_cache_args(p)
    serving.add_serve_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="check one trace, print the first divergence")
    p.add_argument("trace")
    p.add_argument("--backend", action="append")
    add_cache_args(p)
    p.set_defaults(func=cmd_check)

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

    add_compare_parser(sub)
    add_gates_parser(sub)

    p = sub.add_parser("list", help="backends (with where they come from and whether they run here)")
    p.set_defaults(func=cmd_list)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (TraceError, ValueError, KeyError, OSError) as e:
        print(f"kvbench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
