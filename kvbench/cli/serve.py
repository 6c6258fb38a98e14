"""`kvbench serve`: the serving simulation from the command line, `kvbench serve --trace PATH
--format F` and `kvbench serve --scenario opt13b` (kvbench.analyses.serving,
kvbench.analyses.breakdown), with its own defaults (OPT-13B, 12 GiB, blocks of 16)."""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from kvbench.analyses.breakdown import (
    OPT13B,
    available_backends,
    memory_breakdown,
    opt13b_config,
    plot_breakdown,
    run_opt13b,
    write_paper_files,
)
from kvbench.analyses.serving import DEFAULT_MAX_BATCH, PREEMPTION_MODES, STEP_SECONDS, VICTIM_ORDERS
from kvbench.bench import records
from kvbench.analyses.settings import RunSettings
from kvbench.cli.options import UsageError, add_format_arg, block_size, positive_float, positive_int
from kvbench.outputs import check_writable, stdout_for
from kvbench.cli.tables import print_table
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.contract.ledger import MEMORY_CATEGORIES
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import save
from kvbench.traces.loaders import LOADERS, Request, load_requests, request_options
from kvbench.traces.tier_ops import TierSpec

SCENARIOS = ("opt13b",)


def offload_tiers(text: str) -> tuple:
    """``host=N[,disk=M]``: the lower tiers, nearest first, each NAME=BLOCKS (LRU)."""
    tiers = []
    for part in text.split(","):
        name, eq, blocks = part.strip().partition("=")
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"each tier is NAME=BLOCKS (host=64,disk=512), got {part!r}")
        try:
            tiers.append(TierSpec(name, positive_int(blocks)))
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"tier {name!r}: {e}") from None
    names = [t.name for t in tiers]
    if len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"a tier is named twice in {text!r}")
    return tuple(tiers)


def runs_tiers(name: str, tiers) -> bool:
    """Whether backend ``name`` declares lower tiers of every policy ``tiers`` name (SPEC §11)."""
    caps = getattr(registry.resolve(name).load(), "capabilities", None)
    return {t.policy for t in tiers} <= set(getattr(caps, "tiers", ()))


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
    try:
        add_format_arg(g, native=False, of="--trace")
    except argparse.ArgumentError:  # the host parser defines it already (kvbench run's)
        pass
    add("--scenario", choices=SCENARIOS,
        help="opt13b: the PagedAttention paper's setting (OPT-13B, 12 GiB, ShareGPT lengths)")
    add("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH, help="most running sequences")
    add("--max-steps", type=positive_int, help="admission horizon in steps (running requests then finish)")
    add("--step-seconds", type=positive_float, default=STEP_SECONDS,
        help="simulated seconds per step: maps trace arrivals onto steps")
    add("--max-requests", type=positive_int, help="serve only the first N requests")
    add("--speculative-k", type=int, default=0,
        help="speculative decoding: draft tokens per sequence and step (default 0: none)")
    add("--acceptance", type=float, default=0.6,
        help="--speculative-k: the share of drafts kept (each accept keeps Binomial(k, this))")
    add("--token-budget", type=positive_int,
        help="tokens one step computes at most (vLLM's max_num_batched_tokens): prompts written "
             "in chunks of what is left after the decode step (default: none, prompts whole)")
    add("--victim", choices=VICTIM_ORDERS, default="newest",
        help="which running sequence a step that does not fit preempts: newest (vLLM's FCFS) or "
             "fewest-output (SGLang's retraction order: fewest tokens generated, longest prompt)")
    add("--preemption", choices=PREEMPTION_MODES, default="recompute",
        help="how a step that does not fit preempts: recompute (free, prefill again) or swap (its "
             "blocks to a host tier of --swap-blocks, back at its resume)")
    add("--swap-blocks", type=positive_int, default=0, help="--preemption swap: the host tier's blocks")
    add("--offload", type=offload_tiers, metavar="host=N[,disk=M]",
        help="lower tiers (SPEC §11, LRU, nearest first): a freed sequence's hashed blocks are "
             "stored to each, an admission loads what they hold after the device's hit; the "
             "table reports the blocks each served")
    add("--seed", type=int, default=0, help="seed of generated arrivals / lengths")
    add("--rate", type=positive_float, default=1.0, help="--format lengths: arrivals per second")
    add("--prefix-caching", default=None, action=argparse.BooleanOptionalAction,
        help="reuse prompt blocks by their hashes (default: on when the trace carries block hashes)")
    add("--store-kv", action="store_true", help="hold real K/V arrays (default: ledger only)")
    add("--check", action="store_true", help="replay each backend's logged trace through the checker")
    add("--save-traces", metavar="DIR", help="write each backend's logged trace there")
    add("--plot", metavar="PNG", help="write the stacked-bar breakdown there")
    add("--paper-out", metavar="DIR",
        help="--scenario opt13b: write breakdown.csv/.md/.png there (e.g. results/paper)")
    add("--backend", action="append", help="backend name (repeatable)")
    add("--model", help="model preset (default opt-13b)")
    add("--block-size", type=block_size, help="default 16")
    add("--budget", help="blocks ('1024') or bytes (default '12GiB')")
    add("--max-context", type=positive_int, help="default: next pow2 of the longest request")
    add("--device", default="cpu", help="device of the torch backend: cpu or cuda")
    add("--output", help="results file, - for stdout (default "
                         "results/runs/serve-<time>-<pid>-<commit>.json)")
    add("--quiet", action="store_true", help="no progress")


class MovedToServe(FutureWarning):
    """`kvbench run --trace/--scenario`, which `kvbench serve` took over (shown to users, once)."""


def register(sub) -> None:
    p = sub.add_parser("serve", help="the serving simulation: a request trace (or the paper's "
                                     "OPT-13B scenario) served by continuous batching per backend")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    if not (args.trace or args.scenario):
        raise UsageError("kvbench serve: give --trace PATH --format F, or --scenario opt13b")
    with stdout_for(args.output) as stdout:  # `--output -`: the record alone on stdout
        return run_serving(args, stdout)


def warn_moved(args) -> None:
    """`kvbench run` given serving options: serve, saying where the command went."""
    option = "--trace" if getattr(args, "trace", None) else "--scenario"
    warnings.warn(f"`kvbench run {option}` is `kvbench serve {option}` now; `run` will refuse "
                  f"it in the next release", MovedToServe, stacklevel=2)


def wants_serving(args) -> bool:
    """True when ``kvbench run`` was asked for a serving simulation."""
    return bool(getattr(args, "trace", None) or getattr(args, "scenario", None))


SERVE_COLUMNS = ["backend", *MEMORY_CATEGORIES, "averaged_over", "steps_averaged", "max_running", "finished",
                 "rejected", "unserved", "preemptions", "steps", "output_tokens_per_step", "steps_per_s"]


# What the serving simulation runs without options: OPT-13B's 12 GiB, ledger only.
SERVE_DEFAULTS = {"model": OPT13B["model"], "budget": OPT13B["budget"], "store_kv": False}


def _serve_config(args, requests) -> CacheConfig:
    store_kv = bool(getattr(args, "store_kv", False))
    run = RunSettings(model=getattr(args, "model", None), block_size=getattr(args, "block_size", None),
                      budget=getattr(args, "budget", None),
                      max_context=getattr(args, "max_context", None),
                      device=getattr(args, "device", "cpu") or "cpu", store_kv=store_kv,
                      prefix_caching=getattr(args, "prefix_caching", None))
    # Prefix caching is on for a trace that names its prompts' blocks, as the help says.
    cfg = run.resolve(SERVE_DEFAULTS, hashed=any(r.block_hashes for r in requests),
                      longest=max((r.prompt_tokens + r.output_tokens for r in requests), default=1))
    if store_kv and not cfg.store_kv:
        print(f"note: {cfg.num_blocks:,} blocks of K/V are more than this machine's memory: "
              f"--store-kv is dropped (ledger only)")
    return cfg


def settings_line(cfg: CacheConfig, requests: int) -> str:
    """What a serving run uses: model, budget, block size, context, prefix caching."""
    budget = cfg.num_blocks * F.block_bytes(cfg.block_size, cfg.model)
    return (f"serving {requests} requests: model {cfg.model.name}, budget {cfg.num_blocks:,} blocks "
            f"({budget / 2**30:.2f} GiB), blocks of {cfg.block_size} tokens, max context "
            f"{cfg.max_context}, prefix caching {'on' if cfg.prefix_caching else 'off'}"
            f"{'' if cfg.store_kv else ', ledger only'}")


def _load(args) -> list[Request]:
    opts = request_options(args.format, block_size=getattr(args, "block_size", None)
                           or OPT13B["block_size"], seed=args.seed, rate=args.rate,
                           max_requests=args.max_requests)
    reqs = load_requests(args.trace, args.format, **opts)
    return reqs[:args.max_requests] if args.max_requests is not None else reqs


def run_serving(args, stdout=None) -> int:
    """Run the simulation the options ask for; print the table; 1 if a checked trace failed.
    ``stdout``: where a record for ``--output -`` goes."""
    policy = getattr(args, "policy", None)
    if policy not in (None, "auto", "none"):
        raise ValueError(f"the serving simulation preempts by itself; --policy {policy} does not apply")
    if args.trace and args.scenario:
        raise UsageError("give --trace or --scenario, not both")
    if getattr(args, "output", None):
        check_writable(args.output, option="--output", stdout=True)
    for option, folder in (("--save-traces", True), ("--paper-out", True), ("--plot", False)):
        value = getattr(args, option[2:].replace("-", "_"), None)
        if value:
            check_writable(value, option=option, folder=folder)
    backends = getattr(args, "backend", None) or available_backends(getattr(args, "device", "cpu") or "cpu")
    sim = {"max_batch": args.max_batch, "max_steps": args.max_steps, "seed": args.seed}
    speculative = getattr(args, "speculative_k", 0)
    if speculative:
        if args.scenario:
            raise UsageError("--speculative-k applies to --trace runs, not --scenario")
        sim.update(speculative_k=speculative, acceptance=args.acceptance)
    if getattr(args, "victim", "newest") != "newest":
        if args.scenario:
            raise UsageError("--victim applies to --trace runs, not --scenario")
        sim["victim"] = args.victim
    if getattr(args, "preemption", "recompute") == "swap":
        if args.scenario:
            raise UsageError("--preemption swap applies to --trace runs, not --scenario")
        if not args.swap_blocks:
            raise UsageError("--preemption swap needs --swap-blocks N (the host tier's blocks)")
        sim.update(preemption="swap", swap_blocks=args.swap_blocks)
    offload = getattr(args, "offload", None)
    if offload:
        if args.scenario:
            raise UsageError("--offload applies to --trace runs, not --scenario")
        sim["offload"] = offload
        if not getattr(args, "backend", None):  # the default backends, less those with no lower tier
            backends = [n for n in backends if runs_tiers(n, offload)]
            print(f"--offload: serving on {', '.join(backends)} (the default backends that run "
                  f"lower tiers; the contiguous baselines have none)")
    budget = getattr(args, "token_budget", None)
    if budget is not None:
        if args.scenario:
            raise UsageError("--token-budget applies to --trace runs, not --scenario")
        sim["token_budget"] = budget
    progress = not getattr(args, "quiet", False)
    for name in backends:
        try:
            registry.resolve(name)
        except ValueError as e:
            raise UsageError(f"--backend {name}: {e}") from None
    if args.scenario == "opt13b":
        n = args.max_requests or OPT13B["num_requests"]
        steps = args.max_steps if args.max_steps is not None else OPT13B["max_steps"]
        print(settings_line(opt13b_config(getattr(args, "device", "cpu") or "cpu"), n))
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
        print(settings_line(cfg, len(reqs)))
        source = {"trace": str(args.trace), "format": args.format}
        table, sims = memory_breakdown(reqs, cfg, backends, step_seconds=args.step_seconds,
                                       source=source, progress=progress, **sim)
        params = {**source, "model": cfg.model.name, "block_size": cfg.block_size,
                  "num_blocks": cfg.num_blocks, "max_context": cfg.max_context,
                  **sim, **({"offload": {t.name: t.capacity for t in offload}} if offload else {}),
                  "step_seconds": args.step_seconds, "prefix_caching": cfg.prefix_caching}
    paper = ["paper_token_states"] if "paper_token_states" in table else []
    cols = ["backend", *paper, *SERVE_COLUMNS[1:]]
    if speculative:  # blocks held for drafts, and what rollbacks gave back
        cols += ["drafted_tokens", "rejected_tokens", "rollbacks", "draft_blocks", "rollback_blocks"]
    if budget is not None:  # prompts written in chunks
        cols += ["tokens_per_step", "chunked_prompts", "prompt_chunks"]
    if "preemption" in sim:
        cols += ["swapped_out", "swapped_in"]
    if offload:  # prompt blocks each level served
        cols += ["prefix_hit_blocks", *(f"{t.name}_hit_blocks" for t in offload), "computed_blocks"]
    print_table(table, cols)
    for r in table.itertuples():
        if r.requests and not r.finished:
            print(f"warning: {r.backend} refused every request ({r.rejected} rejected, {r.unserved} "
                  f"unserved): is the budget smaller than one request?")
    code = 0
    if args.check:
        from kvbench.checking.checker import check
        from kvbench.checking.raised import make
        for name, r in sims.items():
            fresh = make(name, r.config)
            try:
                v = check(r.trace, fresh, gather="touched")
            finally:
                fresh.close()
            print(f"{v.status:4} {name}: replay of {len(r.trace)} logged ops"
                  + (f"\n     first divergence: {v.divergence}" if v.divergence else "")
                  + (f"\n     error: {v.error}" if v.error else ""))
            code = max(code, {"FAIL": 1, "ERROR": 2}.get(v.status, 0))
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
    print(f"results in {records.write(rec, getattr(args, 'output', None), stdout=stdout)}")
    return code
