"""The serving simulation from the command line: `kvbench run --trace PATH --format F` and
`kvbench run --scenario opt13b` (kvbench.analyses.serving, kvbench.analyses.breakdown)."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvbench.analyses.breakdown import (
    CATEGORIES,
    OPT13B,
    available_backends,
    memory_breakdown,
    plot_breakdown,
    run_opt13b,
    write_paper_files,
)
from kvbench.analyses.serving import DEFAULT_MAX_BATCH, STEP_SECONDS
from kvbench.bench import records
from kvbench.cli.tables import print_table
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import save
from kvbench.traces.loaders import LOADERS, Request, load_requests

SCENARIOS = ("opt13b",)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Options of the serving simulation. An option the parser already has (``kvbench run``'s
    --backend, --model, --block-size, --budget, --max-context, --device, --output, --quiet, ...)
    is kept as it is, so the same call serves `kvbench run` and a parser of its own."""
    g = parser.add_argument_group("serving simulation (--trace PATH --format F, or --scenario opt13b)")

    def add(*flags, **kw):
        try:
            g.add_argument(*flags, **kw)
        except argparse.ArgumentError:  # the host parser defines it already
            pass

    add("--trace", help="a public request trace to serve (see --format)")
    add("--format", choices=sorted(LOADERS), help="format of --trace")
    add("--scenario", choices=SCENARIOS,
        help="opt13b: the PagedAttention paper's setting (OPT-13B, 12 GiB, ShareGPT lengths)")
    add("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="most running sequences")
    add("--max-steps", type=int, help="admission horizon in steps (running requests then finish)")
    add("--step-seconds", type=float, default=STEP_SECONDS,
        help="simulated seconds per step: maps trace arrivals onto steps")
    add("--max-requests", type=int, help="serve only the first N requests")
    add("--seed", type=int, default=0, help="seed of generated arrivals / lengths")
    add("--rate", type=float, default=1.0, help="--format lengths: arrivals per second")
    add("--prefix-caching", action="store_true", help="reuse prompt blocks by their hashes")
    add("--store-kv", action="store_true", help="hold real K/V arrays (default: ledger only)")
    add("--check", action="store_true", help="replay each backend's logged trace through the checker")
    add("--save-traces", metavar="DIR", help="write each backend's logged trace there")
    add("--plot", metavar="PNG", help="write the stacked-bar breakdown there")
    add("--paper-out", metavar="DIR",
        help="--scenario opt13b: write breakdown.csv/.md/.png there (e.g. results/paper)")
    add("--backend", action="append", help="backend name (repeatable)")
    add("--model", help="model preset (default opt-13b)")
    add("--block-size", type=int, help="default 16")
    add("--budget", help="blocks ('1024') or bytes (default '12GiB')")
    add("--max-context", type=int, help="default: next pow2 of the longest request")
    add("--device", default="cpu")
    add("--output", help="results file")
    add("--quiet", action="store_true")


def wants_serving(args) -> bool:
    """True when ``kvbench run`` was asked for a serving simulation."""
    return bool(getattr(args, "trace", None) or getattr(args, "scenario", None))


SERVE_COLUMNS = ["backend", *CATEGORIES, "averaged_over", "steps_averaged", "max_running", "finished",
                 "rejected", "unserved", "preemptions", "steps", "output_tokens_per_step", "steps_per_s"]


def _serve_config(args, requests) -> CacheConfig:
    model = F.get_model(getattr(args, "model", None) or OPT13B["model"])
    bs = getattr(args, "block_size", None) or OPT13B["block_size"]
    blocks = F.budget_blocks(getattr(args, "budget", None) or OPT13B["budget"], bs, model)
    longest = max((r.prompt_tokens + r.output_tokens for r in requests), default=1)
    mc = getattr(args, "max_context", None) or F.next_pow2(longest)
    return CacheConfig(model=model, block_size=bs, num_blocks=blocks,
                       store_kv=bool(getattr(args, "store_kv", False)),
                       device=getattr(args, "device", "cpu") or "cpu", max_context=int(mc),
                       prefix_caching=bool(getattr(args, "prefix_caching", False)))


def _load(args) -> list[Request]:
    opts = {}
    if args.format == "lengths":
        opts = {"rate": args.rate, "seed": args.seed, "max_requests": args.max_requests}
    elif args.format == "servegen":
        opts = {"seed": args.seed, "max_requests": args.max_requests}
    elif args.format == "mooncake":
        opts = {"block_size": getattr(args, "block_size", None) or OPT13B["block_size"]}
    reqs = load_requests(args.trace, args.format, **opts)
    return reqs[:args.max_requests] if args.max_requests is not None else reqs


def run_serving(args) -> int:
    """Run the simulation the options ask for; print the table; 1 if a checked trace failed."""
    policy = getattr(args, "policy", None)
    if policy not in (None, "auto", "none"):
        raise ValueError(f"the serving simulation preempts by itself; --policy {policy} does not apply")
    if args.trace and args.scenario:
        raise ValueError("give --trace or --scenario, not both")
    backends = getattr(args, "backend", None) or available_backends(getattr(args, "device", "cpu") or "cpu")
    sim = {"max_batch": args.max_batch, "max_steps": args.max_steps, "seed": args.seed}
    progress = not getattr(args, "quiet", False)
    if args.scenario == "opt13b":
        n = args.max_requests or OPT13B["num_requests"]
        steps = args.max_steps if args.max_steps is not None else OPT13B["max_steps"]
        table, sims = run_opt13b(backends, num_requests=n, max_steps=steps, seed=args.seed,
                                 max_batch=args.max_batch, device=getattr(args, "device", "cpu"),
                                 progress=progress)
        if args.paper_out:
            for p in write_paper_files(table, args.paper_out, n):
                print(f"wrote {p}")
        params = {"scenario": "opt13b", **OPT13B, "num_requests": n, "max_steps": steps}
    else:
        if not args.trace or not args.format:
            raise ValueError("a serving run needs --trace PATH and --format "
                             f"({', '.join(sorted(LOADERS))}), or --scenario opt13b")
        reqs = _load(args)
        cfg = _serve_config(args, reqs)
        source = {"trace": str(args.trace), "format": args.format}
        table, sims = memory_breakdown(reqs, cfg, backends, step_seconds=args.step_seconds,
                                       source=source, progress=progress, **sim)
        params = {**source, "model": cfg.model.name, "block_size": cfg.block_size,
                  "num_blocks": cfg.num_blocks, "max_context": cfg.max_context, **sim,
                  "step_seconds": args.step_seconds, "prefix_caching": cfg.prefix_caching}
    paper = ["paper_token_states"] if "paper_token_states" in table else []
    cols = ["backend", *paper, *SERVE_COLUMNS[1:]]
    print_table(table, cols)
    code = 0
    if args.check:
        from kvbench.checking.checker import check
        for name, r in sims.items():
            fresh = registry.create(name, r.config)
            try:
                v = check(r.trace, fresh, gather="touched")
            finally:
                fresh.close()
            print(f"{v.status:4} {name}: replay of {len(r.trace)} logged ops"
                  + (f"\n     first divergence: {v.divergence}" if v.divergence else ""))
            code = max(code, 1 if v.valid is False else 0)
    if args.save_traces:
        out = Path(args.save_traces)
        out.mkdir(parents=True, exist_ok=True)
        for name, r in sims.items():
            save(r.trace, str(out / f"{r.trace.name}.jsonl"))
        print(f"logged traces in {out}")
    if args.plot:
        print(f"wrote {plot_breakdown(table, args.plot)}")
    rec = records.record("serve", table.to_dict("records"), {**params, "backends": backends},
                         device=getattr(args, "device", None))
    print(f"results in {records.write(rec, getattr(args, 'output', None))}")
    return code
