"""What vLLM's sparse retention of window blocks costs against SPEC's rule, on the same traces.

    python scripts/retention_cost.py [--out DIR]

Each committed workload with a sliding group, prefix caching on, replayed by two oracles that
differ in one declared rule: vllm-kvmanager's capabilities at its serving default
(``sparse_window_retention``: a sliding group caches only the window runs a later hit can end on)
and the same with dense retention (SPEC §8: every full block cached). Both are what vLLM does
under the setting (the adapter passes these workloads under each), so the figures are vLLM's.
Prints a markdown table; ``--out DIR`` also writes DIR/retention-cost.csv. No vLLM needed.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

from impls.engines.vllm_kvmanager import capabilities_for
from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.checking.checker import check
from kvbench.model.oracle import Oracle
from kvbench.traces.format import Prefill

RULES = (("sparse (vLLM's default)", 0), ("dense (SPEC)", None))  # retention interval
COLUMNS = ["workload", "rule", "prompt_blocks", "hit_blocks", "hit_rate", "peak_blocks",
           "mean_blocks", "final_cached_blocks", "refused"]


def cost_rows(traces) -> list[dict]:
    """Per trace with a sliding group and per rule: prefix hit blocks (every group's, as the
    ledger counts them) over the prompts' full blocks in every group, peak and mean blocks in
    use, cached blocks at the end, operations refused for memory. A fork is a request through
    the prefix cache too, but counts no hit (kvbench's rule): what it takes shows in the blocks."""
    rows = []
    for trace in traces:
        config = config_for(trace, policy=None, prefix_caching=True)
        if not any(g.family == "sliding" for g in config.model.kv_groups):
            continue
        G, B = len(config.model.kv_groups), config.block_size
        prompt_blocks = G * sum(op.tokens // B for op in trace.ops if isinstance(op, Prefill))
        for rule, interval in RULES:
            oracle = Oracle(config, capabilities=capabilities_for(True, interval))
            v = check(trace, None, model=oracle, series=True)
            used = v.series.column("blocks_used")
            hits = v.final_ledger["prefix_hit_blocks"]
            rows.append({"workload": trace.name, "rule": rule, "prompt_blocks": prompt_blocks,
                         "hit_blocks": hits, "hit_rate": round(hits / prompt_blocks, 4),
                         "peak_blocks": int(used.max()), "mean_blocks": round(float(used.mean()), 2),
                         "final_cached_blocks": v.final_ledger["cached_blocks"],
                         "refused": v.ooms})
    return rows


def markdown(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="write DIR/retention-cost.csv")
    args = p.parse_args(argv)
    rows = cost_rows(load_traces(committed_workloads()))
    print(markdown(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "retention-cost.csv", "w", newline="") as f:
            w = csv.DictWriter(f, COLUMNS)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out / 'retention-cost.csv'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
