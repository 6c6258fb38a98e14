"""`kvbench run` and `kvbench check`: committed and boundary workloads (or given traces) through
backends under the checker; a serving simulation when `run` is given --trace or --scenario
(kvbench/cli/serve.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np
import pandas as pd

from kvbench.analyses import eviction, suite
from kvbench.analyses.settings import POLICIES, RunSettings
from kvbench.bench import records
from kvbench.checking import expectations
from kvbench.checking.raised import DEFAULT_OP_TIMEOUT, BackendRaised, guarded, make, watching
from kvbench.cli import options, serve
from kvbench.cli.tables import print_table
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.outputs import check_writable, stdout_for
from kvbench.progress import Progress

RUN_COLUMNS = ["workload", "backend", "policy", "status", "ops", "peak_blocks",
               "final_fragmentation", "evictions", "recomputed_tokens", "hit_rate", "jain",
               "backend_ms", "ops_per_s"]


def add_cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cache settings (default: the trace header's, else tiny model, B=16, 256 blocks)")
    g.add_argument("--model", help="model preset (kvbench list shows them)")
    g.add_argument("--block-size", type=options.block_size, help="tokens per block")
    g.add_argument("--budget", help="budget in blocks ('1024') or bytes ('12GiB'); at least one "
                                    "block; beyond this machine's memory, the run is ledger-only")
    g.add_argument("--max-context", type=options.positive_int,
                   help="contiguous `max` reservation (default: next pow2 of the longest sequence)")
    g.add_argument("--device", default="cpu", help="device for the torch backend: cpu or cuda")
    g.add_argument("--policy", default="auto", choices=["auto", *POLICIES, "all", "none"],
                   help="eviction policy: lru, lfu, fair, all, none, auto (all three for tenant mixes)")
    g.add_argument("--prefix-caching", default=None, action=argparse.BooleanOptionalAction,
                   help="reuse cached blocks by block hash (default: on when the trace has hashes)")
    g.add_argument("--gather", default="touched", choices=["touched", "all", "end", "none"],
                   help="which sequences' K/V to verify after each operation")


def add_expectations_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expectations-cache", default=True, action=argparse.BooleanOptionalAction,
                   help="read the oracle's expected figures where an earlier check of the same "
                        "trace, settings and oracle code stored them, and store those computed "
                        "(in $KVBENCH_CACHE/expectations, else ~/.cache/kvbench/expectations)")


def expectations_folder(args):
    """The run's expectations folder, decided once: None when off, or (one warning) when it
    cannot be written."""
    if not hasattr(args, "expectations_dir"):
        args.expectations_dir = (expectations.usable_dir(expectations.cache_dir())
                                 if args.expectations_cache else None)
    return args.expectations_dir


def print_expectations(df: pd.DataFrame, folder) -> None:
    """How many checks reused stored expectations, and the time that saved (never less than
    none: reading them can take longer than computing them on a short trace)."""
    if folder is None or "expectations" not in df:
        return
    reused = df[df.expectations == "reused"]
    if len(reused):
        saved = float(reused.expectations_saved_s.sum())
        what = (f"{saved:.1f} s of the oracle's work saved (reading them counted)" if saved >= 0.05
                else "no time saved (reading them took as long as computing them, or longer)")
        print(f"expectations: {len(reused)} of {len(df)} checks reused those stored in {folder}: "
              f"{what}")
    stored = int(df.expectations.isin(["stored", "recomputed"]).sum())
    if stored:
        print(f"expectations: {stored} checks stored theirs in {folder} for the next run")
    recomputed = int((df.expectations == "recomputed").sum())
    if recomputed:
        print(f"expectations: {recomputed} checks found stored ones the oracle disagrees with: "
              f"removed, checked again with the oracle computing them")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-unavailable", action="store_true",
                   help="a --backend that cannot run here is reported as n/a instead of an error")
    p.add_argument("--op-timeout", type=options.seconds, default=DEFAULT_OP_TIMEOUT,
                   metavar="SECONDS",
                   help=f"a backend call that takes longer is stopped, and the backend FAILs naming "
                        f"the trace, step and call (default {DEFAULT_OP_TIMEOUT:g}; 0: no limit)")


def settings(args) -> RunSettings:
    """The run's settings from its options, made once per run."""
    if getattr(args, "run_settings", None) is None:
        args.run_settings = RunSettings(model=args.model, block_size=args.block_size,
                                        budget=args.budget, max_context=args.max_context,
                                        device=args.device, prefix_caching=args.prefix_caching)
    return args.run_settings


def select_backends(args, trace) -> list[str]:
    """The backends to run, decided before any work. Named ones (--backend) must be known and able
    to run here with the run's settings, else a UsageError (unless --allow-unavailable: then they
    run as n/a with the reason). With none named: every default built-in that can run here; the
    others are named with the reason."""
    cfg = settings(args).config(trace)
    if not args.backend:
        chosen = []
        for name in registry.DEFAULT_BACKENDS:
            why = probe(name, cfg, args.op_timeout)
            if why:
                print(f"not run here: {name}: {why}")
            else:
                chosen.append(name)
        return chosen
    for name in args.backend:
        try:
            registry.resolve(name)
        except ValueError as e:
            raise options.UsageError(f"--backend {name}: {e}") from None
        why = probe(name, cfg, args.op_timeout)
        if why and not getattr(args, "allow_unavailable", False):
            raise options.UsageError(f"--backend {name}: {why} (--allow-unavailable runs the "
                                     f"others and reports it as n/a)")
        if why:
            print(f"not run here: {name}: {why}")
    return list(dict.fromkeys(args.backend))


def print_memory_note(trace, args) -> None:
    note = suite.memory_note(settings(args).config(trace))
    if note:
        print(note)


def probe(name: str, config, op_timeout: float | None = DEFAULT_OP_TIMEOUT) -> str:
    """'' when backend ``name`` can be made with ``config`` here, else why not (one line). One
    that crashes (raises other than a refusal, or hangs) runs: its FAIL is recorded there."""
    with watching(op_timeout):
        try:
            backend = make(name, config)
            guarded("close", backend.close)
        except registry.BackendUnavailable as e:
            return str(e)
        except BackendRaised:
            pass
    return ""


def exit_code(df: pd.DataFrame, extra_failures: int = 0) -> int:
    """0 when every check that ran passed and at least one did; 1 on a FAIL; 2 on an ERROR or
    when nothing passed (a gate that checked nothing must not pass)."""
    if (df.status == "FAIL").any() or extra_failures:
        return options.EXIT_FAIL
    if (df.status == "ERROR").any():
        return options.EXIT_ERROR
    if not (df.status == "pass").any():
        print("kvbench: error: nothing passed: every run was n/a (see the reasons above)",
              file=sys.stderr)
        return options.EXIT_ERROR
    return options.EXIT_OK


def verdict_lines(df: pd.DataFrame) -> list[str]:
    """FAIL, ERROR and n/a lines under the table; a FAIL names the backend, policy and workload."""
    lines = []
    for _, r in df[df.status.isin(["FAIL", "ERROR"])].iterrows():
        pol = "" if r.policy in ("-", None) else f" {r.policy}"
        what = r.divergence if r.status == "FAIL" else r.error
        lines.append(f"{r.status} {r.backend}{pol} on {r.workload}: {what}")
    na = df[df.status == "n/a"]
    for _, r in na.drop_duplicates(["backend", "not_applicable"]).iterrows():
        lines.append(f"n/a  {r.backend} on {r.workload}: {r.not_applicable}")
    return lines


def print_eviction(trace, rows, run_settings: RunSettings) -> list[str]:
    """A tenant mix: per-tenant figures, and Belady's offline replay beside the online policies.

    Returns the runs whose hit rate beats Belady's where that is impossible (unit-size paging).
    """
    table = eviction.tenant_table(trace, rows)
    if table.empty:
        return []
    print(f"\n{trace.name}: per tenant (usage and quota in blocks; slots for contiguous backends)")
    print_table(table, eviction.TENANT_COLUMNS)
    cfg = run_settings.config(trace)
    ref = eviction.policy_table(trace, cfg)
    print(f"\n{trace.name}: the oracle's replay under each policy, paged layout; "
          f"Belady is a {ref.belady.iloc[0]}")
    print_table(ref, ["policy", "evictions", "recomputed_tokens", "hits", "misses", "hit_rate", "jain"])
    paged = {f"{r['backend']} {r['policy']}": r for r in rows
             if r["workload"] == trace.name and r["layout"] == "paged" and r["status"] == "pass"}
    return eviction.belady_violations(trace, cfg, paged)


# Options of a request trace's loader (--format): they apply to TRACE files as to --trace.
LOADER_OPTIONS = ("seed", "rate", "max_requests")


def cmd_run(args) -> int:
    if serve.wants_serving(args) and args.traces:
        option = "--trace" if args.trace else "--scenario"
        raise options.UsageError(f"{option} runs the serving simulation and TRACE files "
                                 f"({' '.join(args.traces)}) are replayed: give one or the other")
    if not serve.wants_serving(args):
        refuse_serving_options(args)
    with stdout_for(args.output) as stdout:  # `--output -`: the record alone on stdout
        if serve.wants_serving(args):
            serve.warn_moved(args)
            return serve.run_serving(args, stdout)
        return run_workloads(args, stdout)


def refuse_serving_options(args) -> None:
    """A serving simulation's option given to a replay of trace files, which would ignore it."""
    loader = args.format not in (None, "kvbench")
    for dest, (flag, default) in args.serving_only.items():
        if getattr(args, dest) != default and not (loader and dest in LOADER_OPTIONS):
            raise options.UsageError(
                f"{flag} applies to the serving simulation (kvbench serve --trace PATH --format F, "
                f"or --scenario opt13b), not to replaying trace files")


def trace_options(args) -> dict:
    """What loading the command's trace files takes from its options (loaders.load_trace)."""
    return {"block_size": args.block_size,
            **{k: getattr(args, k) for k in LOADER_OPTIONS if hasattr(args, k)}}


def run_workloads(args, stdout) -> int:
    if args.traces:
        paths = args.traces
        traces = suite.load_traces(paths, args.format, **trace_options(args))
    else:  # the committed workloads and the generated boundary workloads
        traces = suite.default_traces()
        paths = [t.path or t.name for t in traces]
    if args.output:
        check_writable(args.output, option="--output", stdout=True)
    else:
        check_writable(records.RESULTS_DIR / "runs", option="results folder", folder=True)
    backends = select_backends(args, traces[0])
    print_memory_note(traces[0], args)
    params = {"traces": [str(p) for p in paths], "backends": backends,
              **dataclasses.asdict(settings(args)), "policy": args.policy}
    rows = []
    try:
        suite.run_suite(traces, backends, settings(args), policy=args.policy,
                        progress=not args.quiet, gather=args.gather, rows=rows,
                        default_run=not args.traces and not args.backend,
                        cache=expectations_folder(args), op_timeout=args.op_timeout)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: keep the runs that finished
        if rows:
            rec = records.record("run", rows, params, device=args.device,
                                 partial=f"{options.stop_word(e)} after {len(rows)} runs")
            path = records.write(rec, args.output, stdout=stdout)
            print(f"kvbench: the {len(rows)} runs finished are in {path} (a partial record)",
                  file=sys.stderr)
        raise
    df = pd.DataFrame(rows)
    print_table(df, RUN_COLUMNS)
    kv_traces = [t for t in traces if kv_formats_apply(settings(args).config(t).model)]
    if kv_traces:
        print_capacity(kv_traces[0], args)
    print_group_capacity(traces, args)
    for line in verdict_lines(df):
        print(line)
    beyond_optimum = [msg for t in traces if t.header.tenants
                      for msg in print_eviction(t, rows, settings(args))]
    for msg in beyond_optimum:
        print(f"FAIL {msg}")
    rec = records.record("run", rows, params, device=args.device)
    path = records.write(rec, args.output, stdout=stdout)
    print_expectations(df, expectations_folder(args))
    counts = df.status.value_counts()
    print(f"{len(df)} runs: {counts.get('pass', 0)} pass, {counts.get('FAIL', 0)} fail, "
          f"{counts.get('ERROR', 0)} error, {counts.get('n/a', 0)} n/a; results in {path}")
    return exit_code(df, len(beyond_optimum))


def kv_formats_apply(model) -> bool:
    """The KV formats table's K and V schemes fit a model of K/V groups only (full, sliding);
    SPEC §12's kinds have theirs in `kvbench list-models`."""
    return all(g.family in ("full", "sliding") for g in model.kv_groups)


CAPACITY_SAMPLE = 256  # tokens of the trace's K/V the capacity table measures each format's error on


def print_capacity(trace, args) -> None:
    """Tokens a byte budget holds at each KV format, beside the error each makes on the K/V the
    trace's sequences write (its first CAPACITY_SAMPLE tokens' worth)."""
    from kvbench import quant
    from kvbench.contract.protocol import content_segments
    from kvbench.contract.protocol import kv_tokens
    cfg = settings(args).config(trace)
    budget = cfg.num_blocks * F.block_bytes(cfg.block_size, cfg.model)
    writers, positions = [], []
    for op in trace.ops:
        if len(writers) == CAPACITY_SAMPLE:
            break
        if getattr(op, "tokens", None) and hasattr(op, "tenant"):
            for w, start, count in content_segments(op.seq, op.tokens, (), cfg.block_size):
                take = min(count, CAPACITY_SAMPLE - len(writers))  # never a prompt's every token
                writers += [w] * take
                positions += range(start, start + take)
    sample = kv_tokens(writers, positions, cfg.model, np.float32)
    table = quant.capacity_table(cfg.model, budget, sample, block_size=cfg.block_size,
                                 group_size=min(32, cfg.model.head_dim))
    print(f"\nKV formats for a {budget:,}-byte budget ({cfg.model.name}, blocks of {cfg.block_size}), "
          f"error on {len(sample)} tokens of {trace.name}'s K/V:")
    print_table(table, ["format", "keys", "values", "block_bytes", "metadata_fraction", "tokens",
                        "tokens_vs_fp16", "key_max_abs_error", "key_rmse", "value_max_abs_error",
                        "value_rmse"])


def print_group_capacity(traces, args) -> None:
    """For each hybrid model of the run (SPEC §8): requests of a few lengths, the blocks each
    holds over every group, the largest concurrency and the tokens that fit, beside the same
    layers as full attention in the same bytes: the formulas the checker holds backends to."""
    seen = set()
    for trace in traces:
        cfg = settings(args).config(trace)
        key = (cfg.model, cfg.num_blocks, cfg.block_size)
        if not cfg.model.hybrid or key in seen or not any(g.sliding for g in cfg.model.kv_groups):
            continue
        seen.add(key)
        kinds = ", ".join(g.kind for g in cfg.model.kv_groups)
        print(f"\nCapacity of {cfg.model.name} ({kinds}) in {cfg.num_blocks} blocks of {cfg.block_size} "
              f"({cfg.num_blocks * F.block_bytes(cfg.block_size, cfg.model):,} bytes), and of its "
              f"layers as full attention in the same bytes:")
        table = pd.DataFrame(F.capacity(cfg.model, cfg.num_blocks, cfg.block_size,
                                        F.capacity_lengths(cfg.model)))
        print_table(table, ["length", "blocks_per_request", "max_concurrency", "tokens_fit",
                            "full_blocks_per_request", "full_max_concurrency", "full_tokens_fit"])


def cmd_check(args) -> int:
    trace = suite.load_traces([args.trace], args.format, **trace_options(args))[0]
    rows = []
    backends = select_backends(args, trace)
    print_memory_note(trace, args)
    for name in backends:
        for pol in suite.policies_for(trace, args.policy):
            cfg = settings(args).config(trace, pol)
            with Progress(len(trace.ops), f"{name} on {trace.name}", "ops") as bar:
                row = suite.run_one(trace, name, cfg, args.gather, keep_going=args.keep_going,
                                    progress=bar, cache=expectations_folder(args),
                                    op_timeout=args.op_timeout)
            rows.append(row)
            line = f"{row['status']:4} {name} policy={row['policy']} ops={row['ops']}"
            if row["divergence"]:
                line += f"\n     first divergence: {row['divergence']}"
            if row["divergence_classes"]:
                line += "\n     divergences: " + row["divergence_classes"].replace("; ", "\n                  ")
            if row["error"]:
                line += f"\n     error: {row['error']}"
            if row["not_applicable"]:
                line += f"\n     not applicable: {row['not_applicable']}"
            if row["skipped"]:
                line += f"\n     not checked: {row['skipped']}"
            hits = hit_line(row)
            if hits:
                line += f"\n     {hits}"
            print(line)
    df = pd.DataFrame(rows) if rows else pd.DataFrame({"status": []})
    print_expectations(df, expectations_folder(args))
    return exit_code(df)


def hit_line(row) -> str:
    """Prompt blocks found cached by the end, where found (SPEC §11 "Hit accounting"), the
    backend's beside the oracle's; '' for a trace that names no prompt blocks by hash."""
    hits = row.get("hit_blocks") or {}
    if not hits or not row.get("hashed_blocks"):
        return ""
    if isinstance(hits, str):  # a row's: JSON text
        hits = json.loads(hits)

    def figure(backend, oracle):
        if backend is None:
            return f"? (oracle {oracle})"
        return f"{backend}" + ("" if backend == oracle else f" (oracle {oracle})")
    parts = [f"{where} {figure(*pair)}" for where, pair in hits.items()]
    computed = row["hashed_blocks"] - sum(oracle for _, oracle in hits.values())
    if computed >= 0:  # a model of several groups counts a hit in each (prefix_hit_blocks)
        parts.append(f"computed {computed}")
    return f"hit blocks (of {row['hashed_blocks']} hashed prompt blocks): {', '.join(parts)}"


def register(sub) -> None:
    p = sub.add_parser("run", help="check every workload on every backend and time them")
    p.add_argument("traces", nargs="*", help="trace files (default: every committed workload, then the "
                                             "boundary workloads generated from SPEC §13's edges)")
    p.add_argument("--backend", action="append", help="backend name or package.module:Factory (repeatable)")
    p.add_argument("--output", help="results file, - for stdout (default "
                                    "results/runs/run-<time>-<pid>-<commit>.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    options.add_format_arg(p, of="the TRACE files (or --trace)")
    add_backend_args(p)
    add_expectations_arg(p)
    add_cache_args(p)
    replay = {a.dest for a in p._actions}
    serve.add_serve_args(p)
    serving_only = {a.dest: (a.option_strings[0], a.default) for a in p._actions
                    if a.dest not in replay and a.dest not in ("trace", "scenario")}
    p.set_defaults(func=cmd_run, serving_only=serving_only)

    p = sub.add_parser("check", help="check one trace, print the first divergence")
    p.add_argument("trace", help="trace file (.jsonl or .csv; --format for a public request trace)")
    options.add_format_arg(p)
    p.add_argument("--keep-going", action="store_true",
                   help="go on past a ledger figure or block id that differs (the states still "
                        "comparable), and list every class of divergence with its first step and "
                        "count; it still stops at a wrong outcome, victim, K/V or broken identity")
    p.add_argument("--backend", action="append",
                   help="backend name or package.module:Factory (repeatable; default: every "
                        "default backend that can run here)")
    add_backend_args(p)
    add_expectations_arg(p)
    add_cache_args(p)
    p.set_defaults(func=cmd_check)
