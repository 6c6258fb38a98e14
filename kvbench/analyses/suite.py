"""Run workloads through backends under the checker, each verdict a row with its analyses (hit
rates, per-tenant fairness): the engine behind `kvbench run` and `check`."""
from __future__ import annotations

import os
from pathlib import Path

from kvbench.analyses import eviction
from kvbench.checking.checker import BackendRaised, Divergence, Verdict, check, guarded
from kvbench.checking.series import MEANS
from kvbench.checking.verdict import divergence_classes
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.contract.protocol import CacheConfig
from kvbench.progress import Progress
from kvbench.traces.format import Trace, TraceError, load

WORKLOADS_DIR = Path(__file__).resolve().parents[2] / "workloads"
POLICIES = ("lru", "lfu", "fair")
INDEX_BYTES_PER_BLOCK = 64  # a pool's arrays per block without K/V: ids, counts, tables (generous)


def committed_workloads() -> list[Path]:
    return sorted(WORKLOADS_DIR.glob("*.jsonl"))


def blocks_of_budget(budget: str, block_size: int, spec) -> int:
    """The blocks a ``--budget`` of bytes holds; a ValueError naming the option for a budget that
    does not parse or holds less than one block."""
    try:
        blocks = F.budget_blocks(budget, block_size, spec)
    except ValueError as e:
        raise ValueError(f"--budget: {e}") from None
    if blocks < 1:
        raise ValueError(f"--budget {budget}: less than one block (a block of {block_size} tokens of "
                         f"{spec.name} is {F.block_bytes(block_size, spec):,} bytes)")
    return blocks


def config_for(trace: Trace, *, model: str | None = None, block_size: int | None = None,
               budget: str | None = None, max_context: int | None = None, device: str = "cpu",
               policy: str | None = None, store_kv: bool | None = None,
               prefix_caching: bool | None = None) -> CacheConfig:
    """Settings: command line first, then the trace header's suggestions, then defaults.

    A header whose settings say ``store_kv: false`` (a long history, whose point is the
    bookkeeping) is checked ledger-only unless the caller says otherwise.

    Prefix caching is on by default for a trace whose prefills carry block hashes or token ids.
    A header that names KV cache groups re-shapes the model's layers into them.

    The default ``max_context`` of the contiguous baseline is the next power of two of the
    trace's longest sequence, so that `max` reservation can run every trace.
    """
    s = trace.header.settings
    spec = F.get_model(model or s.get("model", "tiny"))
    if trace.header.groups:  # the trace names the model's KV cache groups (SPEC §8)
        try:
            spec = F.with_group_kinds(spec, trace.header.groups)
        except ValueError as e:  # the header's groups, for the model of this run
            raise TraceError(f"'groups': {e}", trace.path or trace.name, 1) from None
    bs = int(block_size or s.get("block_size", 16))
    if bs <= 0:
        raise ValueError(f"--block-size: must be a positive integer, got {bs}")
    blocks = blocks_of_budget(budget, bs, spec) if budget is not None else int(s.get("num_blocks", 256))
    finals = trace.final_lengths().values()
    mc = max_context or s.get("max_context") or F.next_pow2(max(finals, default=1))
    if int(mc) <= 0:
        raise ValueError(f"--max-context: must be a positive integer, got {mc}")
    hashed = trace.names_prompt_blocks()
    if prefix_caching is None:
        prefix_caching = bool(s.get("prefix_caching", hashed))
    if prefix_caching and hashed and s.get("block_size", bs) != bs:
        raise ValueError(f"{trace.name}: block hashes are for block size {s['block_size']}, "
                         f"not {bs}")
    if blocks * INDEX_BYTES_PER_BLOCK > machine_memory() // 4:
        raise ValueError(f"--budget {budget}: {blocks:,} blocks of {bs} tokens of {spec.name}: even "
                         f"a ledger-only pool's own bookkeeping (about {INDEX_BYTES_PER_BLOCK} B a "
                         f"block) would not fit this machine's {machine_memory() / 2**30:,.1f} GiB")
    if store_kv is None:
        store_kv = bool(s.get("store_kv", True))
    if store_kv and blocks * F.block_bytes(bs, spec) > machine_memory():
        store_kv = False  # ledger only: memory_note() says so
    return CacheConfig(model=spec, block_size=bs, num_blocks=blocks, store_kv=store_kv,
                       device=device, max_context=int(mc), policy=policy,
                       tenant_weights=dict(trace.header.tenants), prefix_caching=prefix_caching)


def machine_memory() -> int:
    """Bytes of memory this machine has (the most K/V a pool here can hold)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no limit known
        return 1 << 62


def memory_note(config: CacheConfig) -> str:
    """One line when ``config`` runs ledger-only because its budget exceeds this machine's memory."""
    need = config.num_blocks * F.block_bytes(config.block_size, config.model)
    if config.store_kv or need <= machine_memory():
        return ""
    return (f"note: a budget of {config.num_blocks:,} blocks is {need / 2**30:,.1f} GiB of K/V, more "
            f"than this machine's {machine_memory() / 2**30:,.1f} GiB: running ledger-only (no K/V "
            f"stored or checked)")


def policies_for(trace: Trace, policy: str | None) -> list:
    """'auto': the policy the trace's header settings name (a shrunk or saved failure), else all
    three for a tenant mix (a trace that names tenant weights), else none."""
    if policy in (None, "auto"):
        named = trace.header.settings.get("policy")
        if named and named not in (*POLICIES, "none"):
            raise TraceError(f"setting 'policy': {named!r} is not a policy ({', '.join(POLICIES)}, "
                             f"none)", trace.path or trace.name, 1)
        if named:
            return [None if named == "none" else named]
        return list(POLICIES) if trace.header.tenants else [None]
    if policy == "none":
        return [None]
    if policy == "all":
        return list(POLICIES)
    return [policy]


def hashed_blocks(trace: Trace) -> int:
    """Prompt blocks the trace names by hash (what a prefix-cache hit rate is out of)."""
    table = getattr(trace.ops, "hashes", None)  # a columnar trace keeps them apart
    hashes = table.values() if table is not None else (getattr(op, "block_hashes", None) for op in trace.ops)
    return sum(len(h or ()) for h in hashes)


def verdict_row(trace: Trace, backend_name: str, config: CacheConfig, v: Verdict,
                unavailable: str = "") -> dict:
    series = v.series
    hashed = hashed_blocks(trace)
    mean = {k: float(series.column(k).mean()) for k in MEANS} if series else {}
    row = {
        "workload": trace.name, "family": trace.header.family, "backend": backend_name,
        "policy": config.policy or "-", "device": config.device, "model": config.model.name,
        "block_size": config.block_size, "num_blocks": config.num_blocks,
        "status": v.status, "ops": v.ops,
        "divergence": str(v.divergence) if v.divergence else "",
        "divergence_classes": divergence_classes(v), "error": v.error,
        "traceback": v.traceback, "unavailable": unavailable,
        "not_applicable": v.not_applicable, "skipped": "; ".join(f"{k}: {r}" for k, r in v.skipped.items()),
        "ooms": v.ooms, "evictions": v.evictions, "recomputed_tokens": v.recomputed_tokens,
        "peak_blocks": max(0, int(series.column("blocks_used").max())) if series else 0,
        "final_fragmentation": v.final_ledger.get("fragmentation"),
        **{f"mean_{k}": val for k, val in mean.items()},
        "series": {"step": series.column("step").tolist(),
                   "blocks_used": [None if b < 0 else b for b in series.column("blocks_used").tolist()],
                   "fragmentation": series.column("fragmentation").tolist()},
        "backend_ms": v.backend_seconds * 1e3,
        "ops_per_s": v.ops / v.backend_seconds if v.backend_seconds else float("nan"),
        "hits": v.hits, "misses": v.misses, "hit_rate": eviction.hit_rate(v.hits, v.misses),
        # Prefix caching: prompt blocks found cached, of all the trace's hashed prompt blocks.
        "prefix_hit_blocks": v.final_ledger.get("prefix_hit_blocks", 0),
        "prefix_hit_rate": (v.final_ledger.get("prefix_hit_blocks", 0) / hashed) if hashed else float("nan"),
        "layout": eviction.layout_of(v),
        # An engine backend's settings that its engine does not serve with (empty: its default).
        "serving_departures": "; ".join(registry.serving_departures(backend_name) or ()),
    }
    if trace.header.tenants and series:  # a tenant mix: fairness and per-tenant figures
        row["jain"] = eviction.run_metrics(trace, v)["jain"]
        row["tenant_metrics"] = eviction.tenant_metrics(trace, v)
    return row


def run_one(trace: Trace, backend_name: str, config: CacheConfig, gather: str = "touched",
            keep_going: bool = False, *, progress=None) -> dict:
    """One backend on one trace under the checker, as a row. A backend that cannot be made here
    is n/a with the reason (``unavailable``); one that raises in any call, close included, FAILs.
    ``keep_going``: past the divergences that leave the states comparable (check's keep_going).
    ``progress``: a :class:`kvbench.progress.Progress` of the operations checked."""
    try:
        backend = registry.resolve(backend_name).create(config)
    except registry.BackendUnavailable as e:
        v = Verdict(trace=trace.name, backend=backend_name, valid=None, not_applicable=str(e))
        return verdict_row(trace, backend_name, config, v, unavailable=str(e))
    v = check(trace, backend, gather=gather, series=True, keep_going=keep_going, progress=progress)
    try:
        guarded("close", backend.close)
    except BackendRaised as e:
        if v.valid:
            v.valid, v.traceback = False, e.traceback
            v.divergence = Divergence(trace.name, len(trace.ops), trace.ops[-1].step if trace.ops
                                      else 0, {"op": "close"}, "outcome of close", "success",
                                      f"{type(e.error).__name__}: {e.error}")
    return verdict_row(trace, backend_name, backend.config, v)


def run_suite(traces: list, backends: list, *, policy: str | None = "auto", progress: bool = False,
              gather: str = "touched", rows: list | None = None, default_run: bool = False,
              **settings) -> list[dict]:
    """One row per trace, policy and backend. ``rows``: a list each row is appended to as its run
    finishes (a caller interrupted part way keeps the finished ones). ``default_run``: the
    committed workloads through the default backends, each on its ``default_workloads``."""
    entries = registry.entries()
    jobs = []
    for trace in traces:
        for pol in policies_for(trace, policy):
            cfg = config_for(trace, policy=pol, **settings)
            for name in backends:
                only = entries[name].default_workloads if default_run and name in entries else ()
                if not only or trace.name in only:
                    jobs.append((trace, name, cfg))
    rows = [] if rows is None else rows
    bar = Progress(len(jobs), "replaying", "runs") if progress else None
    for t, n, c in jobs:
        rows.append(run_one(t, n, c, gather))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return rows


def load_traces(paths) -> list[Trace]:
    """The traces to check; a TraceError for one with no operations (checking nothing must not
    pass)."""
    traces = [load(str(p)) for p in paths]
    for path, trace in zip(paths, traces):
        if not len(trace):
            raise TraceError("no operations after the header: nothing to check", str(path))
    return traces


__all__ = ["committed_workloads", "config_for", "policies_for", "run_suite", "run_one",
           "load_traces"]
