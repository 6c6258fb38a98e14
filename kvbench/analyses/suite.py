"""Run workloads through backends under the checker, each verdict a row with its analyses (hit
rates, per-tenant fairness): the engine behind `kvbench run` and `check`."""
from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

from kvbench.analyses import eviction
from kvbench.analyses.settings import POLICIES, RunSettings, machine_memory
from kvbench.checking import expectations
from kvbench.checking.checker import BackendRaised, Divergence, Verdict, check, guarded
from kvbench.checking.raised import DEFAULT_OP_TIMEOUT, described, make, watching
from kvbench.checking.series import MEANS
from kvbench.checking.verdict import divergence_classes
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.contract.protocol import CacheConfig
from kvbench.progress import Progress
from kvbench.traces.format import Trace, TraceError

WORKLOADS_DIR = Path(__file__).resolve().parents[2] / "workloads"


def committed_workloads() -> list[Path]:
    return sorted(WORKLOADS_DIR.glob("*.jsonl"))


def default_traces() -> list[Trace]:
    """What `kvbench run` with no argument checks: the committed workloads, then the boundary
    workloads generated from each rule's edges (kvbench.traces.boundaries; none is a file, so
    none drifts from its rule)."""
    from kvbench.traces.boundaries import boundary_traces
    return load_traces(committed_workloads()) + boundary_traces()


def config_for(trace: Trace, *, policy: str | None = None, **settings) -> CacheConfig:
    """``RunSettings(**settings).config(trace, policy)``: one trace's CacheConfig, for a caller
    that holds no RunSettings (a test, a script)."""
    return RunSettings(**settings).config(trace, policy)


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
        "expectations": v.expectations, "expectations_saved_s": v.expectations_saved,
        "ops_per_s": v.ops / v.backend_seconds if v.backend_seconds else float("nan"),
        "hits": v.hits, "misses": v.misses, "hit_rate": eviction.hit_rate(v.hits, v.misses),
        # Prefix caching: prompt blocks found cached, of all the trace's hashed prompt blocks.
        "prefix_hit_blocks": v.final_ledger.get("prefix_hit_blocks", 0),
        "hashed_blocks": hashed,
        # By where found: {where: [the backend's, the oracle's]}, as JSON text (a store's column)
        "hit_blocks": json.dumps(v.hit_blocks) if v.hit_blocks else "",
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
            keep_going: bool = False, *, progress=None, cache=None,
            op_timeout: float | None = DEFAULT_OP_TIMEOUT) -> dict:
    """One backend on one trace under the checker, as a row. A backend that cannot be made here
    is n/a with the reason (``unavailable``); one that raises in any call, its making and close
    included, FAILs. ``keep_going``: past the divergences that leave the states comparable
    (check's keep_going). ``progress``: a :class:`kvbench.progress.Progress` of the operations
    checked. ``cache``: the folder of stored expectations (check's). ``op_timeout``: seconds a
    backend call may take (check's)."""
    with watching(op_timeout):
        try:
            backend = make(backend_name, config)
        except registry.BackendUnavailable as e:
            v = Verdict(trace=trace.name, backend=backend_name, valid=None, not_applicable=str(e))
            return verdict_row(trace, backend_name, config, v, unavailable=str(e))
        except BackendRaised as e:
            v = Verdict(trace=trace.name, backend=backend_name, valid=False, traceback=e.traceback,
                        divergence=_lifecycle_failure(trace, e, before=True))
            return verdict_row(trace, backend_name, config, v)
        v = check(trace, backend, gather=gather, series=True, keep_going=keep_going,
                  progress=progress, cache=cache, op_timeout=op_timeout)
        if v.expectations == "stale":  # the stored figures were wrong (and are removed): check
            # again, on a fresh backend, with the oracle computing them (and storing them anew)
            warnings.warn(v.error, expectations.CacheWarning, stacklevel=2)
            with contextlib.suppress(BackendRaised):
                guarded("close", backend.close)
            backend = make(backend_name, config)  # it was made once already
            if progress is not None:
                progress.set(0)
            v = check(trace, backend, gather=gather, series=True, keep_going=keep_going,
                      progress=progress, cache=cache, op_timeout=op_timeout)
            v.expectations = "recomputed"
        try:
            guarded("close", backend.close)
        except BackendRaised as e:
            if v.valid:
                v.valid, v.traceback = False, e.traceback
                v.divergence = _lifecycle_failure(trace, e, before=False)
    return verdict_row(trace, backend_name, backend.config, v)


def _lifecycle_failure(trace: Trace, e: BackendRaised, before: bool) -> Divergence:
    """The divergence of a backend's making (``before`` the first operation) or close (after the
    last) that raised."""
    ops = trace.ops
    index, step = (-1, ops[0].step if len(ops) else 0) if before else \
        (len(ops), ops[-1].step if len(ops) else 0)
    return Divergence(trace.name, index, step, {"op": e.what}, f"outcome of {e.what}", "success",
                      described(e.error))


def run_suite(traces: list, backends: list, settings: RunSettings = RunSettings(), *,
              policy: str | None = "auto", progress: bool = False, gather: str = "touched",
              rows: list | None = None, default_run: bool = False, cache=None,
              op_timeout: float | None = DEFAULT_OP_TIMEOUT) -> list[dict]:
    """One row per trace, policy and backend. ``rows``: a list each row is appended to as its run
    finishes (a caller interrupted part way keeps the finished ones). ``default_run``: the
    committed workloads through the default backends, each on its ``default_workloads``.
    ``cache``: the folder of stored expectations (check's). ``op_timeout``: check's."""
    entries = registry.entries()
    jobs = []
    for trace in traces:
        for pol in policies_for(trace, policy):
            cfg = settings.config(trace, pol)
            for name in backends:
                only = entries[name].default_workloads if default_run and name in entries else ()
                if not only or trace.name in only:
                    jobs.append((trace, name, cfg))
    rows = [] if rows is None else rows
    bar = Progress(len(jobs), "replaying", "runs") if progress else None
    for t, n, c in jobs:
        rows.append(run_one(t, n, c, gather, cache=cache, op_timeout=op_timeout))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return rows


def load_traces(paths, format: str | None = None, **options) -> list[Trace]:
    """The traces to check, each file in ``format`` (kvbench.traces.loaders.load_trace, with its
    ``options``); a TraceError for one with no operations (checking nothing must not pass)."""
    from kvbench.traces.loaders import load_trace
    traces = [load_trace(p, format, **options) for p in paths]
    for path, trace in zip(paths, traces):
        if not len(trace):
            raise TraceError("no operations after the header: nothing to check", str(path))
    return traces


__all__ = ["committed_workloads", "config_for", "policies_for", "run_suite", "run_one",
           "load_traces"]
