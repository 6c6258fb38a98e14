"""`kvbench run` and `kvbench check`: committed workloads (or given traces) through backends under
the checker; a serving simulation when `run` is given --trace or --scenario (kvbench/cli/serve.py)."""
from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from kvbench.analyses import eviction
from kvbench.bench import records
from kvbench.checking import suite
from kvbench.cli import serve
from kvbench.cli.tables import print_table
from kvbench.contract import registry

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
    if serve.wants_serving(args):
        return serve.run_serving(args)
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


def register(sub) -> None:
    p = sub.add_parser("run", help="check every workload on every backend and time them")
    p.add_argument("traces", nargs="*", help="trace files (default: every committed workload)")
    p.add_argument("--backend", action="append", help="backend name or package.module:Factory (repeatable)")
    p.add_argument("--output", help="results file (default results/runs/run-<time>-<commit>.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_cache_args(p)
    serve.add_serve_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="check one trace, print the first divergence")
    p.add_argument("trace")
    p.add_argument("--backend", action="append")
    add_cache_args(p)
    p.set_defaults(func=cmd_check)
