"""`kvbench gen`, `kvbench prefix`, `kvbench list` and `kvbench list-models`: workloads,
prefix-cache curves, backends, model presets."""
from __future__ import annotations

import argparse

import pandas as pd

from kvbench.analyses import suite
from kvbench.cli import options
from kvbench.cli.tables import print_table
from kvbench.contract import registry
from kvbench.outputs import check_writable


def cmd_gen(args) -> int:
    from kvbench.traces import generators
    if args.family:
        out = args.out or f"{args.family}-{args.seed}.jsonl"
        check_writable(out, option="--out")
        trace = generators.generate(args.family, seed=args.seed)
        from kvbench.traces.format import save
        save(trace, out)
        print(f"wrote {out} ({len(trace)} ops)")
        return 0
    from kvbench.traces.canonical import write_canonical
    out = args.out or suite.WORKLOADS_DIR
    check_writable(out, option="--out", folder=True)
    for p in write_canonical(str(out)):
        print(f"wrote {p}")
    return 0


def cache_sizes(text: str) -> list:
    """``--sizes 64,256,1024`` (blocks) or ``--sizes 32768t,65536t`` (tokens: whole blocks of them)."""
    sizes = []
    for item in text.split(","):
        item = item.strip().lower()
        unit = "tokens" if item.endswith("t") else "blocks"
        number = item.rstrip("tb")
        if not number.isdigit() or int(number) <= 0:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a positive size (give blocks, as 256, or tokens, as 4096t)")
        sizes.append((int(number), unit))
    return sizes


def cmd_prefix(args) -> int:
    from pathlib import Path

    from kvbench.analyses import prefix
    from kvbench.outputs import staged
    from kvbench.traces.loaders import load_requests, prefix_hit_rate_unbounded
    if args.out:
        check_writable(args.out, option="--out", folder=True)
    requests = load_requests(args.trace, args.format)
    if args.max_requests is not None:
        requests = requests[:args.max_requests]
    trace = prefix.cache_trace(requests, args.block_size)
    sizes = None if args.sizes is None else sorted(
        {n if unit == "blocks" else n // args.block_size for n, unit in args.sizes})
    if sizes is not None and min(sizes) < 1:
        raise options.UsageError(f"--sizes: less than one block of {args.block_size} tokens")
    options.runnable_backend(args.backend)
    curve = prefix.hit_rate_curve(trace, sizes=sizes, backend=args.backend, progress=True,
                                  keep_going=args.keep_going)
    print(f"{Path(args.trace).name}: {len(requests)} requests, blocks of {args.block_size} tokens. "
          f"hit_rate = full blocks found in the cache / full blocks looked up (the backend's own "
          f"count, confirmed by the oracle after every operation)")
    print_table(curve, ["backend", "cache_blocks", "status", "hit_blocks", "hashed_blocks",
                        "hit_rate", "refused"])
    bad = curve[curve.status != "pass"]
    for r in bad.itertuples():  # the backend's verdict, by the checker: the step it diverged at
        print(f"{r.status} {r.backend} with a cache of {r.cache_blocks} blocks: {r.divergence}"
              + (f"\n     divergences: {r.divergences}" if r.divergences else ""))
    if len(bad) and not args.keep_going:
        print("stopped at the first size that does not pass (--keep-going checks every size)")
    hits, refs, *_ = prefix_hit_rate_unbounded(requests)
    if refs:
        print(f"hit rate by the trace's own block ids (an unbounded cache, partial last blocks "
              f"included): {hits}/{refs} = {hits / refs:.1%}")
    if args.out:
        stem = f"{Path(args.trace).stem}-B{args.block_size}"
        csv_path, png_path = Path(args.out) / f"{stem}.csv", Path(args.out) / f"{stem}.png"
        with staged(csv_path, png_path) as (csv_tmp, png_tmp):
            curve.to_csv(csv_tmp, index=False)
            prefix.plot_curve(curve, png_tmp, f"{Path(args.trace).stem}: prefix cache hit rate "
                                              f"(full blocks), {args.block_size}-token blocks")
        print(f"wrote {csv_path} and {png_path}")
    if (curve.status == "FAIL").any():
        return options.EXIT_FAIL
    return options.EXIT_ERROR if len(bad) else options.EXIT_OK


def cmd_list(args) -> int:
    rows, departing = [], {}
    for name, e in registry.entries().items():
        ok, why = e.available()
        departures = registry.serving_departures(name)
        if departures:
            departing[name] = departures
        rows.append({"backend": name, "from": e.origin, "tags": " ".join(sorted(e.tags)) or "-",
                     "target": e.target, "available": "yes" if ok else "no", "why not": why,
                     "engine setting": "-" if departures is None
                     else "non-default" if departures else "serving default"})
    print_table(pd.DataFrame(rows), ["backend", "from", "available", "why not", "engine setting",
                                     "target", "tags"])
    if departing:  # an engine backend named for a setting its engine does not serve with
        print("\nnot the engine's serving default:")
        for name, departures in departing.items():
            print(f"  {name}: " + "; ".join(departures))
    from kvbench.contract.formulas import PRESETS
    print("\nmodels: " + ", ".join(f"{m.name} ({m.bytes_per_token} B/token)" for m in PRESETS.values()))
    print("workloads: " + ", ".join(p.stem for p in suite.committed_workloads()))
    return 0


LIST_LENGTHS = (8192, 32768, 131072)


def cmd_list_models(args) -> int:
    """Every preset's bytes per token, block bytes and largest concurrency (SPEC §1, §8, §12)."""
    from kvbench.contract import formulas as F
    budget = F.parse_bytes(args.budget)
    names = args.models.split(",") if args.models else list(F.PRESETS)
    models = [F.get_model(n.strip()) for n in names]
    rows = [F.model_capacity(m, budget, args.block_size, args.lengths) for m in models]
    print(f"budget {args.budget} ({budget} bytes), block size {args.block_size}; max_at_X: "
          f"requests of X tokens that fit, floor((budget - per-tensor scales) / bytes a request holds)")
    print_table(pd.DataFrame(rows), list(rows[0]))
    return 0


def lengths_list(text: str) -> list:
    """``--lengths 8192,32768``: request lengths in tokens, each positive."""
    return [options.positive_int(t.strip()) for t in text.split(",")]


def register_gen_prefix(sub) -> None:
    from kvbench.traces.generators import FAMILIES
    families = ", ".join(FAMILIES)
    p = sub.add_parser("gen", help="regenerate the committed workloads (or one family)",
                       description=f"Regenerate the committed workloads byte for byte, or write one "
                                   f"trace of a family. Families: {families}.")
    p.add_argument("--family", choices=list(FAMILIES), metavar="FAMILY",
                   help=f"write one trace of this family instead ({families})")
    p.add_argument("--seed", type=int, default=0, help="seed of --family's trace (default 0)")
    p.add_argument("--out", help="file for --family (default FAMILY-SEED.jsonl), else the folder "
                                 "of the canonical workloads (default workloads/)")
    p.set_defaults(func=cmd_gen)

    p = sub.add_parser("prefix", help="prefix-cache hit rate over cache sizes, checked by the oracle")
    p.add_argument("trace", help="a request trace with block hashes")
    options.add_format_arg(p, native=False, default="mooncake", of="TRACE (one with block hashes)")
    p.add_argument("--keep-going", action="store_true",
                   help="go on past a figure the backend gets wrong (check's --keep-going), and "
                        "on to every cache size; each FAIL names the step of its first divergence")
    p.add_argument("--block-size", type=options.block_size, default=512,
                   help="tokens per block (default 512, Mooncake's)")
    p.add_argument("--sizes", type=cache_sizes,
                   help="cache sizes to evaluate, comma-separated, in blocks (256) or tokens "
                        "(4096t); default: from the largest prompt up to an unbounded cache")
    p.add_argument("--backend", default="numpy", help="backend whose prefix cache is measured")
    p.add_argument("--max-requests", type=options.positive_int, help="only the first N requests")
    p.add_argument("--out", help="folder for the curve's CSV and PNG")
    p.set_defaults(func=cmd_prefix)


def register_list(sub) -> None:
    p = sub.add_parser("list", help="backends (with where they come from and whether they run here)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("list-models", help="each model preset's bytes per token, block bytes and "
                                           "largest concurrency at 8k / 32k / 128k for a budget")
    p.add_argument("--budget", default="80GiB", help="KV cache bytes (default 80GiB)")
    p.add_argument("--block-size", type=options.block_size, default=16, help="tokens per block (default 16)")
    p.add_argument("--models", help="comma-separated presets (default: every one)")
    p.add_argument("--lengths", type=lengths_list, default=list(LIST_LENGTHS),
                   help="request lengths in tokens, comma-separated (default 8192,32768,131072)")
    p.set_defaults(func=cmd_list_models)
