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
from kvbench.checking import suite
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.traces.format import load


def cmd_eviction(args) -> int:
    trace = load(args.trace)
    verdicts = {}
    for policy in ONLINE_POLICIES:
        config = suite.config_for(trace, policy=policy)
        v = check(trace, registry.create(args.backend, config), series=True)
        if not v.valid:
            print(f"kvbench: error: {args.backend} {policy}: {v.divergence or v.not_applicable}")
            return 1
        verdicts[policy] = v
    with pd.option_context("display.width", 200, "display.max_columns", 30,
                           "display.float_format", "{:.3g}".format):
        print(tenant_table(trace, verdicts).to_string(index=False))
        print()
        print(policy_table(trace, suite.config_for(trace)).to_string(index=False))
    os.makedirs(args.out, exist_ok=True)
    print(plot_usage(trace, verdicts, os.path.join(args.out, f"{trace.name}-usage.png")))
    return 0


def register(sub) -> None:
    p = sub.add_parser("eviction", help="a tenant mix under LRU, LFU and Fair: per-tenant tables and "
                                        "a usage-against-quota chart")
    p.add_argument("trace")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--out", default=str(suite.WORKLOADS_DIR.parent / "results" / "eviction"),
                   help="folder for <trace>-usage.png")
    p.set_defaults(func=cmd_eviction)
