"""`kvbench route TRACE`: one trace served by N replicas behind a router (SPEC §14), every decision
checked by the reference index; reuse available, captured and delivered, per request and overall;
lists of N or cache sizes run the grid and chart it (docs/routing.md)."""
from __future__ import annotations

import argparse
import json
import os

from kvbench.analyses.settings import RunSettings
from kvbench.cli import options
from kvbench.contract.protocol import Capabilities
from kvbench.model.rules import RULE_SETS
from kvbench.outputs import check_writable, write_text
from kvbench.routing import report
from kvbench.routing.policies import POLICIES
from kvbench.routing.route import PLANTED, jobs_of_requests, jobs_of_trace, route
from kvbench.traces import loaders
from kvbench.traces.format import load

DEFAULT_OUT = os.path.join("results", "scratch", "route")


def _counts(option: str):
    def parse(text: str) -> list:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(
                f"must be positive integers separated by commas, got {text!r}")
        return values
    parse.__name__ = option
    return parse


def _reset(text: str) -> tuple:
    replica, _, at = text.partition("@")
    try:
        pair = (int(at) - 1, int(replica))
    except ValueError:
        pair = None
    if pair is None or pair[0] < 0 or pair[1] < 0:
        raise argparse.ArgumentTypeError(
            f"must be REPLICA@REQUEST (replica from 0, request from 1), got {text!r}")
    return pair


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0: load alone), got {text!r}")
    return value


def _jobs(args):
    """The trace's requests and the replicas' CacheConfig (RunSettings: the one place)."""
    fmt = args.format or loaders.NATIVE
    settings = RunSettings(model=args.model, block_size=args.block_size,
                           budget=args.blocks[0] if args.blocks else None, store_kv=False,
                           prefix_caching=True)
    if fmt == loaders.NATIVE:
        trace = load(args.trace)
        config = settings.config(trace)
        jobs, left_out = jobs_of_trace(trace, config.block_size)
        if left_out:
            print(f"note: left out (they route nothing): "
                  f"{', '.join(f'{n} {kind}' for kind, n in sorted(left_out.items()))}")
        return jobs[:args.max_requests], config, trace.name
    bs = args.block_size or loaders.DEFAULT_BLOCK_SIZE
    opts = loaders.request_options(fmt, block_size=bs, max_requests=args.max_requests)
    requests = loaders.load_requests(args.trace, fmt, **opts)[:args.max_requests]
    jobs = jobs_of_requests(requests, bs, tpot=args.tpot, prefill_tps=args.prefill_tps,
                            where=args.trace)
    longest = max((j.tokens + j.output for j in jobs), default=1)
    config = settings.resolve({"block_size": bs, "num_blocks": 4096}, longest=longest, hashed=True)
    return jobs, config, os.path.splitext(os.path.basename(args.trace))[0]


def cmd_route(args) -> int:
    check_writable(args.out, option="--out", folder=True)
    jobs, config, name = _jobs(args)
    if not any(j.hashes for j in jobs):
        print(f"note: {args.trace} names no prompt blocks (no block hashes or token ids): no "
              f"prefix is shared, so nothing is available to route to")
    caps = Capabilities(prefix_caching=True, rules=args.rules)
    opts = dict(capabilities=caps, plant=args.plant, resets=args.reset,
                overlap_weight=args.overlap_weight, dynamo=args.dynamo)
    counts, sizes = args.replicas, args.blocks or [config.num_blocks]
    if len(counts) > 1 or len(sizes) > 1:
        rows = report.grid(jobs, config, counts, sizes, args.router, **opts)
        path = write_text(os.path.join(args.out, f"{name}-grid.json"), json.dumps(rows, indent=1) + "\n")
        for r in rows:
            print(_line(r))
        print(path)
        for chart in report.charts(rows, args.out, name):
            print(chart)
        return options.EXIT_FAIL if any(r["findings"] for r in rows) else options.EXIT_OK
    result = route(jobs, config, counts[0], args.router, **opts)
    totals = result.totals()
    print(_line(totals))
    for kind, (count, first) in result.findings.items():
        print(f"FAIL {kind}: {count} request(s); first: {first}")
    if args.plant == "own-block-size" and "keys" in result.findings and "index" not in result.findings:
        print("key parity: captured < available while the router's index agrees with the "
              "reference on the engine's keys: the router's keys are at fault, not its index")
    record = {"trace": args.trace, "totals": totals,
              "findings": {k: {"count": c, "first": f} for k, (c, f) in result.findings.items()},
              "requests": result.rows()}
    print(write_text(os.path.join(args.out, f"{name}-route.json"), json.dumps(record, indent=1) + "\n"))
    return options.EXIT_FAIL if result.findings else options.EXIT_OK


def _line(t: dict) -> str:
    return (f"N={t['replicas']} {t['policy']} cache {t['num_blocks']} blocks x {t['block_size']}: "
            f"{t['requests']} requests, {t['prompt_tokens']:,} prompt tokens; reuse available "
            f"{t['available']:,} ({t['available_frac']:.1%}), captured {t['captured']:,} "
            f"({t['captured_frac']:.1%}), delivered {t['delivered']:,} ({t['delivered_frac']:.1%}); "
            f"gap: routing {t['routing_gap']:,}, engine {t['engine_gap']:,}; {t['events']:,} events, "
            f"{t['waited']} waits, {t['seconds']:.1f} s")


def register(sub) -> None:
    p = sub.add_parser("route", help="a trace served by N replicas behind a router that sees only "
                                     "their events and load; reuse available, captured, delivered")
    p.add_argument("trace", help="a trace: kvbench's own, or a public one with --format")
    options.add_format_arg(p)
    p.add_argument("--replicas", type=_counts("--replicas"), default=[4],
                   help="replicas N, or a list (1,2,4,8,16) to chart against N (default 4)")
    p.add_argument("--router", choices=list(POLICIES), default="longest-prefix",
                   help="routing policy (default longest-prefix; dynamo: Dynamo's overlap and "
                        "load cost)")
    p.add_argument("--blocks", type=_counts("--blocks"),
                   help="blocks per replica, or a list to chart against cache size (default: the "
                        "trace header's, else 4096 for a public trace)")
    p.add_argument("--block-size", type=options.block_size, help="tokens per block (default 16)")
    p.add_argument("--model", help="model preset (default: the trace header's, else tiny)")
    p.add_argument("--rules", choices=list(RULE_SETS), default="spec",
                   help="the replicas' engine rules (vllm: a hit leaves the last prompt token, "
                        "the engine's share of the gap); default spec")
    p.add_argument("--max-requests", type=options.positive_int, help="the trace's first requests only")
    p.add_argument("--tpot", type=options.positive_float, default=0.05,
                   help="a public trace's seconds per output token (default 0.05): with "
                        "--prefill-tps, how long a request stays live, so the load")
    p.add_argument("--prefill-tps", type=options.positive_float, default=10000.0,
                   help="a public trace's prompt tokens per second (default 10000)")
    p.add_argument("--overlap-weight", type=_weight, default=1.0,
                   help="the dynamo policy's kv_overlap_score_weight (default 1)")
    p.add_argument("--plant", choices=list(PLANTED),
                   help="a planted router fault, which the checks must catch (exit 1)")
    p.add_argument("--reset", type=_reset, action="append", default=[], metavar="REPLICA@REQUEST",
                   help="reset that replica's prefix cache before that request (a `cleared` event); "
                        "repeatable")
    p.add_argument("--dynamo", action="store_true",
                   help="also feed NVIDIA Dynamo's RadixTree the events and check its matches "
                        "(its environment: scripts/engine_env.sh dynamo)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="folder for <trace>-route.json, or <trace>-grid.json and charts "
                        "(default results/scratch/route, out of git)")
    p.set_defaults(func=cmd_route)
