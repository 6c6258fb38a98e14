"""What each of SGLang's declared prefix-cache rules costs against SPEC's, on the committed workloads.

    python scripts/sglang_rule_costs.py [--out results/engines/sglang/rule-costs.csv]

Replays each committed workload of one full-attention group with the prefix cache on through the
oracle alone (no SGLang needed: the rules are the adapter's declared capabilities), once under all
of SGLang's rules and once with each rule put back to SPEC's, then with all three: the same trace,
two oracles per comparison. Per run: prefix-hit blocks and hit rate (of the prompts' full blocks),
peak blocks in use, mean and final cached blocks, refusals. Prints a markdown table of the
workloads where any figure differs, writes every run to the CSV.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
from pathlib import Path

from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.checking.checker import check
from kvbench.contract.protocol import Capabilities
from kvbench.model.oracle import Oracle
from kvbench.traces.format import Prefill

SGLANG = Capabilities(layout="paged", holds_kv=False, prefix_caching=True, cache_salt=True,
                      rules="sglang")
SPEC_RULES = {"whole leaves": {"evicts_whole_leaves": False},
              "page per request": {"eviction_demand": "need"},
              "capped hit recomputed": {"capped_hit_recomputed": False}}
VARIANTS = {"sglang": {}, **{f"SPEC's for {k}": v for k, v in SPEC_RULES.items()},
            "SPEC": {k: v for rule in SPEC_RULES.values() for k, v in rule.items()}}
COLUMNS = ["workload", "rules", "block_size", "num_blocks", "hit_blocks", "hit_rate", "peak_blocks",
           "mean_cached", "final_cached", "ooms"]


def run(trace, config, rules: dict) -> dict:
    model = Oracle(config, capabilities=dataclasses.replace(SGLANG, **rules))
    used, cached = [], []

    class After:  # the oracle's figures after each operation
        @staticmethod
        def update(_):
            led = model.expected_ledger(())
            used.append(led.blocks_used)
            cached.append(led.cached_blocks)

    v = check(trace, None, model=model, progress=After)
    prompt = sum(op.tokens // config.block_size for op in trace.ops if isinstance(op, Prefill))
    hits = v.final_ledger["prefix_hit_blocks"]
    return {"hit_blocks": hits, "hit_rate": round(hits / prompt, 4) if prompt else 0.0,
            "peak_blocks": max(used), "mean_cached": round(sum(cached) / len(cached), 2),
            "final_cached": int(cached[-1]), "ooms": v.ooms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/engines/sglang/rule-costs.csv"))
    args = p.parse_args(argv)
    rows = []
    for path in committed_workloads():
        trace = load_traces([path])[0]
        config = dataclasses.replace(config_for(trace, policy=None, prefix_caching=True), store_kv=False)
        if config.model.hybrid or trace.header.tiers or any(
                getattr(op, "prompt_tokens", None) or op.kind == "accept" for op in trace.ops):
            continue  # what the SGLang adapter does not run (n/a on its page)
        for label, rules in VARIANTS.items():
            rows.append({"workload": path.stem, "rules": label, "block_size": config.block_size,
                         "num_blocks": config.num_blocks, **run(trace, config, rules)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print("| workload | rules | hit blocks | hit rate | peak blocks | mean cached | final cached | refusals |")
    print("|---|---|---|---|---|---|---|---|")
    by = {}
    for r in rows:
        by.setdefault(r["workload"], []).append(r)
    figures = ("hit_blocks", "peak_blocks", "mean_cached", "final_cached", "ooms")
    for name, runs in by.items():
        if len({tuple(r[f] for f in figures) for r in runs}) == 1:
            continue  # never evicts: every rule gives the same figures
        for r in runs:
            print(f"| {name} | {r['rules']} | {r['hit_blocks']} | {r['hit_rate']:.3f} | {r['peak_blocks']} | "
                  f"{r['mean_cached']} | {r['final_cached']} | {r['ooms']} |")
    print(f"\nwrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
