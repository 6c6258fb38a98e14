"""`kvbench eviction TRACE`: replay a tenant mix under LRU, LFU and Fair, print the per-tenant
tables, and draw usage against quota per tenant for each policy."""
from __future__ import annotations

import os

import pandas as pd

from kvbench.analyses.eviction import (
    ONLINE_POLICIES,
    plot_usage,
    policy_table,
    tenant_table,
)
from kvbench.analyses import suite
from kvbench.bench import records
from kvbench.checking.checker import check
from kvbench.checking.raised import make
from kvbench.cli import options
from kvbench.contract import registry
from kvbench.outputs import check_writable
from kvbench.traces.loaders import load_trace


def cmd_eviction(args) -> int:
    trace = load_trace(args.trace, args.format)
    check_writable(args.out, option="--out", folder=True)
    try:
        registry.resolve(args.backend)
    except ValueError as e:
        raise options.UsageError(f"--backend {args.backend}: {e}") from None
    verdicts = {}
    for policy in ONLINE_POLICIES:
        config = suite.config_for(trace, policy=policy)
        try:
            backend = make(args.backend, config)
        except registry.BackendUnavailable as e:
            raise options.UsageError(f"--backend {args.backend}: {e}") from None
        try:
            v = check(trace, backend, series=True)
        finally:
            backend.close()
        if v.status != "pass":
            print(f"{v.status} {args.backend} {policy} on {trace.name}: "
                  f"{v.divergence or v.error or v.not_applicable}")
            return options.EXIT_FAIL if v.status == "FAIL" else options.EXIT_ERROR
        verdicts[policy] = v
    with pd.option_context("display.width", 200, "display.max_columns", 30,
                           "display.float_format", "{:.3g}".format):
        print(tenant_table(trace, verdicts).to_string(index=False))
        print()
        print(policy_table(trace, suite.config_for(trace)).to_string(index=False))
    print(plot_usage(trace, verdicts, os.path.join(args.out, f"{trace.name}-usage.png")))
    return 0


def register(sub) -> None:
    p = sub.add_parser("eviction", help="a tenant mix under LRU, LFU and Fair: per-tenant tables and "
                                        "a usage-against-quota chart")
    p.add_argument("trace", help="a tenant-mix trace (its header names tenant weights)")
    options.add_format_arg(p)
    p.add_argument("--backend", default="numpy", help="backend replayed under each policy (default numpy)")
    p.add_argument("--out", default=str(records.RESULTS_DIR / "scratch" / "eviction"),
                   help="folder for <trace>-usage.png (default results/scratch/eviction, out of git; "
                        "results/eviction holds the committed chart)")
    p.set_defaults(func=cmd_eviction)
