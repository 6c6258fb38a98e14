"""Eviction metrics (SPEC §5): per-run and per-tenant figures, Belady's offline policy, the plot.

Everything here reads a :class:`~kvbench.checking.checker.Verdict` made with ``series=True`` (each
operation's ``usage``: tenant -> blocks in its sequences' tables, or slab slots for the contiguous
layout) and its trace. Definitions, as a serving engineer reads them:

- ``quota_t = w_t / sum_j w_j * B_total``, exact (Fractions), over the header's weighted tenants
  plus any other tenant with a resident sequence (weight 1): the very set the Fair policy
  compares against at that step. ``B_total`` is blocks (paged) or arena slots (contiguous).
- A tenant is *present* at a step when it has a sequence the trace started and has not freed
  yet (resident or evicted, even refused): it has demand. Means over time are over the steps
  where the tenant is present; a tenant with no request is not starved.
- ``jain``: Jain's index ``(sum x)^2 / (n sum x^2)`` of ``x_t = usage_t / quota_t`` over the
  tenants present at a step, averaged over the steps where two or more are present (one tenant
  alone is trivially fair). Instantaneous, then averaged: a tenant starved early and one starved
  late do not cancel out, as they would in the index of time-averaged usage. Caveat (SPEC's
  metric, kept as written): a tenant whose demand is below its quota lowers the index even when
  every request of it is served.
- Hit rate: re-touches (an append or a fork of an existing sequence) that found the sequence
  resident, ``hits / (hits + misses)``; NaN when nothing was re-touched.

Belady's policy (evict the sequence whose next touch is farthest in the future, never-touched-
again first, ties on the sequence id) is replayed offline over the oracle. Farthest-next-use is
provably optimal only for classic paging, which a trace is when :func:`unit_paging_reason`
returns ``''`` (paged layout, every sequence one block all its life, one sequence per append, no
fork). Only there is "an online policy's hit rate never exceeds Belady's" asserted
(:func:`belady_violations`); elsewhere Belady is a reference, labelled as not a bound.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from fractions import Fraction
from typing import TYPE_CHECKING

from kvbench.charts import finish
from kvbench.checking.checker import Verdict, check
from kvbench.contract.formulas import blocks_needed, jain_index
from kvbench.contract.ledger import MEMORY_CATEGORIES
from kvbench.contract.protocol import CacheConfig
from kvbench.model.oracle import Oracle
from kvbench.traces.format import Append, Fork, Free, Prefill, Trace

if TYPE_CHECKING:  # imported where a table is made: a run that only checks skips its ~70 MB
    import pandas as pd

ONLINE_POLICIES = ("lru", "lfu", "fair")


# --- Belady's offline policy ----------------------------------------------------------------

class BeladyOracle(Oracle):
    """The oracle model with Belady's victim choice: it knows when each sequence is next touched.

    A touch is what the checker counts as a hit or a miss: an append naming the sequence, or a
    fork from it. A free is not a touch: a sequence freed before its next touch is never touched
    again, and goes first.
    """

    def __init__(self, config: CacheConfig, layout: str = "paged", *, trace: Trace):
        super().__init__(config, layout)
        self.touches: dict[int, list] = {}  # seq -> sorted steps that touch it
        for op in trace.ops:
            if isinstance(op, Append):
                for s in op.seqs:
                    self.touches.setdefault(s, []).append(op.step)
            elif isinstance(op, Fork):
                self.touches.setdefault(op.src, []).append(op.step)
        self.now = -1

    def next_touch(self, seq: int) -> float:
        """Step of the first touch after the current step; inf if none."""
        steps = self.touches.get(seq, [])
        i = bisect.bisect_right(steps, self.now)
        return steps[i] if i < len(steps) else math.inf

    def _pick_victim(self, candidates) -> int:
        return min(candidates, key=lambda s: (-self.next_touch(s), s))

    # Every call that can evict learns the step first (recompute goes through prefill).
    def prefill(self, seq, tokens, tenant, final, step, *args, **kwargs) -> list:
        self.now = step
        return super().prefill(seq, tokens, tenant, final, step, *args, **kwargs)

    def append(self, seqs, tokens, step, *args, **kwargs) -> list:
        self.now = step
        return super().append(seqs, tokens, step, *args, **kwargs)

    def fork(self, seq, src, final, step, *args, **kwargs) -> list:
        self.now = step
        return super().fork(seq, src, final, step, *args, **kwargs)


def replay_model(trace: Trace, config: CacheConfig, layout: str = "paged",
                 model: Oracle | None = None) -> Verdict:
    """Replay ``trace`` through the oracle alone (no backend): its evictions, hits and usage.

    :func:`kvbench.checking.checker.check` without a backend, so the rules are the checker's (an evicted
    sequence is recomputed before the operation touches it; a refused prefill or fork drops later
    operations on its sequence) and the figures compare one for one with a checker's verdict.
    ``model``: the oracle to drive (default ``Oracle(config, layout)``, whose victims follow
    ``config.policy``); pass a :class:`BeladyOracle` for the offline optimum.
    """
    return check(trace, None, model=model if model is not None else Oracle(config, layout),
                 series=True)


def belady(trace: Trace, config: CacheConfig, layout: str = "paged") -> Verdict:
    """Belady's offline replay of ``trace`` under ``config``'s budget (its policy is ignored)."""
    config = dataclasses.replace(config, policy="belady")  # any name: eviction on, victims ours
    return replay_model(trace, config, layout, BeladyOracle(config, layout, trace=trace))


def unit_paging_reason(trace: Trace, config: CacheConfig, layout: str = "paged") -> str:
    """'' when farthest-next-use is provably optimal on this trace, else the first reason why not.

    The theorem (Belady 1966; Mattson et al. 1970) is about classic paging: items of one size,
    one request at a time, an eviction frees exactly what a miss needs. A trace is that when
    the layout is paged, every sequence stays within one block all its life (so each miss needs
    one block and each eviction frees one), every append names one sequence (a batch pins its
    members together: several requests at once), and nothing forks (a shared block frees
    nothing when one of its owners is evicted, and a copy-on-write needs a block on a hit), nor
    shares blocks by prefix caching. Frees are allowed: a freed sequence is one never requested again.
    """
    if layout != "paged":
        return f"{layout} layout: slabs of different sizes in a first-fit arena"
    if config.prefix_caching:
        return "prefix caching: sequences with one prompt share its cached blocks"
    B = config.block_size
    for seq, tokens in sorted(trace.final_lengths().items()):
        if tokens > B:
            return (f"sequence {seq} reaches {tokens} tokens, {blocks_needed(tokens, B)} blocks of {B}: "
                    f"items of different sizes")
    for index, op in enumerate(trace.ops):
        where = f"op #{index} (step {op.step})"
        if isinstance(op, Fork):
            return f"{where} forks: shared blocks, an eviction may free nothing"
        if isinstance(op, Append) and len(op.seqs) > 1:
            return f"{where} appends to {len(op.seqs)} sequences at once, pinned together"
    return ""


def hit_rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else math.nan


def belady_violations(trace: Trace, config: CacheConfig, runs: dict,
                      reference: Verdict | None = None) -> list[str]:
    """The checker-side bound: online hit rates above Belady's, where the theorem applies.

    ``runs``: label -> a Verdict, or a row of :func:`kvbench.analyses.suite.verdict_row` (with ``hits``
    and ``misses``), of the paged layout under ``config``'s budget. Returns one message per
    violation; empty when the bound holds or does not apply (see :func:`unit_paging_reason`:
    then Belady is only a reference).
    """
    if unit_paging_reason(trace, config):
        return []
    best = reference if reference is not None else belady(trace, config)
    out = []
    for label, run in runs.items():
        hits, misses = (run["hits"], run["misses"]) if isinstance(run, dict) else (run.hits, run.misses)
        # h/(h+m) > H/(H+M), compared in integers.
        if hits * (best.hits + best.misses) > best.hits * (hits + misses):
            out.append(f"{trace.name}: {label} hit rate {hits}/{hits + misses} exceeds "
                       f"Belady's {best.hits}/{best.hits + best.misses}, the optimum on a unit-size "
                       f"trace: its victims or its hit count are wrong")
    return out


# --- metrics --------------------------------------------------------------------------------

def layout_of(verdict: Verdict) -> str | None:
    """'paged' or 'contiguous' (a ledger without blocks); None for a verdict that never ran."""
    if not verdict.final_ledger:
        return None
    return "paged" if verdict.final_ledger.get("blocks_used") is not None else "contiguous"


def _budget(verdict: Verdict) -> int:
    """B_total from the final ledger: blocks (paged) or arena slots (the five categories' sum)."""
    led = verdict.final_ledger
    if not led:
        raise ValueError(f"{verdict.backend} on {verdict.trace}: the verdict has no ledger "
                         f"({verdict.not_applicable or 'not run'})")
    if layout_of(verdict) == "paged":
        return led["blocks_used"] + led["blocks_free"]
    return sum(led[k] for k in MEMORY_CATEGORIES)


def _weights(trace: Trace) -> dict:
    # Decimal text, not binary: weight 0.1 is exactly 1/10 (as the oracle reads it).
    return {t: Fraction(str(w)) for t, w in trace.header.tenants.items()}


def _present(trace: Trace, n_ops: int) -> list[set]:
    """Per operation, the tenants with a started and not yet freed sequence after it."""
    tenant_of, live, out = trace.tenant_of(), {}, []
    for op in trace.ops[:n_ops]:
        if isinstance(op, (Prefill, Fork)):
            live[op.seq] = tenant_of[op.seq]
        elif isinstance(op, Free):
            live.pop(op.seq, None)
        out.append(set(live.values()))
    return out


def usage_frame(trace: Trace, verdict: Verdict) -> pd.DataFrame:
    """One row per (operation, tenant present): step, usage, exact quota, usage/quota, over."""
    import pandas as pd
    if not verdict.series or "usage" not in verdict.series[0]:
        raise ValueError(f"{verdict.backend} on {verdict.trace}: no usage series; "
                         f"make the verdict with check(..., series=True)")
    budget, weights = _budget(verdict), _weights(trace)
    rows = []
    for index, (point, present) in enumerate(zip(verdict.series, _present(trace, len(verdict.series)))):
        usage = point["usage"]
        w = {t: weights.get(t, Fraction(1)) for t in set(weights) | set(usage)}
        total = sum(w.values())
        for t in sorted(present | set(usage)):
            wt = w.get(t, Fraction(1))
            quota = wt / (total if t in w else total + wt) * budget
            u = usage.get(t, 0)
            rows.append({"index": index, "step": point["step"], "tenant": t, "usage": u,
                         "quota": quota, "ratio": u / quota, "over": u > quota})
    return pd.DataFrame(rows, columns=["index", "step", "tenant", "usage", "quota", "ratio", "over"])


def jain_over_time(trace: Trace, verdict: Verdict) -> pd.Series:
    """Jain's index of usage/quota over the tenants present, per step with two or more present."""
    frame = usage_frame(trace, verdict)
    per_step = frame.groupby("step")["ratio"].agg(list)
    per_step = per_step[per_step.map(len) >= 2]
    return per_step.map(jain_index).astype(float).rename("jain")


def run_metrics(trace: Trace, verdict: Verdict) -> dict:
    """Per-run figures: evictions, recomputed tokens, re-touch hit rate, mean Jain index."""
    jain = jain_over_time(trace, verdict)
    return {"evictions": verdict.evictions, "recomputed_tokens": verdict.recomputed_tokens,
            "hits": verdict.hits, "misses": verdict.misses,
            "hit_rate": hit_rate(verdict.hits, verdict.misses), "ooms": verdict.ooms,
            "jain": float(jain.mean()) if len(jain) else math.nan}


def tenant_metrics(trace: Trace, verdict: Verdict) -> list[dict]:
    """Per tenant: weight, quota, evictions, recomputed tokens, usage against quota, hits.

    ``quota`` is the tenant's quota with every tenant of the trace counted (constant when the
    header weights them all, as tenant mixes do). ``mean_usage`` and ``mean_ratio`` (usage /
    quota, per step, then averaged) are over the steps where the tenant is present;
    ``over_quota`` is the share of those steps with usage strictly above quota. ``hits`` and
    ``misses`` are per tenant where the verdict has them (None otherwise).
    """
    frame = usage_frame(trace, verdict)
    weights, budget = _weights(trace), _budget(verdict)
    tenants = sorted(set(trace.tenant_of().values()) | set(weights))
    w = {t: weights.get(t, Fraction(1)) for t in tenants}
    total = sum(w.values())
    out = []
    for t in tenants:
        mine = frame[frame.tenant == t]
        stats = verdict.tenants.get(t, {})
        hits, misses = stats.get("hits"), stats.get("misses")
        out.append({
            "tenant": t, "weight": float(w[t]), "quota": float(w[t] / total * budget),
            "evictions": stats.get("evictions", 0),
            "recomputed_tokens": stats.get("recomputed_tokens", 0),
            "steps_present": len(mine),
            "mean_usage": float(mine.usage.mean()) if len(mine) else math.nan,
            "peak_usage": int(mine.usage.max()) if len(mine) else 0,
            "mean_ratio": float(mine.ratio.map(float).mean()) if len(mine) else math.nan,
            "over_quota": float(mine.over.mean()) if len(mine) else math.nan,
            "hits": hits, "misses": misses,
            "hit_rate": hit_rate(hits, misses) if hits is not None else math.nan,
        })
    return out


TENANT_COLUMNS = ["workload", "backend", "policy", "tenant", "weight", "quota", "evictions",
                  "recomputed_tokens", "mean_usage", "peak_usage", "mean_ratio", "over_quota",
                  "hits", "misses", "hit_rate"]


def tenant_table(trace: Trace, runs) -> pd.DataFrame:
    """Rows tenant x policy, for `kvbench run` to print on a tenant-mix trace.

    ``runs``: a dict ``{policy: Verdict}`` (series=True), or rows of
    :func:`kvbench.analyses.suite.verdict_row` that carry ``tenant_metrics`` (rows of other workloads are
    skipped).
    """
    import pandas as pd
    rows = []
    if isinstance(runs, dict):
        for policy, v in runs.items():
            for m in tenant_metrics(trace, v):
                rows.append({"workload": trace.name, "backend": v.backend, "policy": policy, **m})
    else:
        for r in runs:
            if r.get("workload") != trace.name:
                continue
            for m in r.get("tenant_metrics") or []:
                rows.append({"workload": r["workload"], "backend": r["backend"],
                             "policy": r["policy"], **m})
    return pd.DataFrame(rows, columns=TENANT_COLUMNS)


def policy_table(trace: Trace, config: CacheConfig, layout: str = "paged") -> pd.DataFrame:
    """LRU, LFU, Fair and Belady replayed by the oracle on one budget, one row each.

    The ``belady`` column says whether Belady's hit rate is a bound on this trace or only a
    reference (and why).
    """
    import pandas as pd
    reason = unit_paging_reason(trace, config, layout)
    rows = []
    for policy in (*ONLINE_POLICIES, "belady"):
        if policy == "belady":
            v = belady(trace, config, layout)
        else:
            v = replay_model(trace, dataclasses.replace(config, policy=policy), layout)
        rows.append({"workload": trace.name, "layout": layout, "budget": _budget(v),
                     "policy": policy, **run_metrics(trace, v)})
    df = pd.DataFrame(rows)
    df["belady"] = "bound (unit-size paging)" if not reason else f"reference, not a bound: {reason}"
    return df


# --- the plot -------------------------------------------------------------------------------

def plot_usage(trace: Trace, verdicts_by_policy: dict, path) -> str:
    """Per-tenant usage (solid) against quota (dashed) over the replay, one panel per policy.

    ``verdicts_by_policy``: {policy: Verdict made with series=True}, drawn left to right.
    Writes a PNG at ``path`` (headless: Agg backend) and returns the path.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    n = len(verdicts_by_policy)
    fig, axes = plt.subplots(1, n, figsize=(5.4 * n, 5.0), sharey=True, squeeze=False)
    tenants = sorted(set(trace.tenant_of().values()) | set(trace.header.tenants))
    colors = {t: plt.get_cmap("tab10")(i % 10) for i, t in enumerate(tenants)}
    budget = _budget(next(iter(verdicts_by_policy.values())))
    unit = "blocks"
    for ax, (policy, v) in zip(axes[0], verdicts_by_policy.items()):
        frame = usage_frame(trace, v)
        unit = "blocks" if layout_of(v) == "paged" else "slots"
        steps = [p["step"] for p in v.series]
        for t in tenants:
            # Absent steps (no request of the tenant) stay NaN: a gap, not a starved zero.
            mine = frame[frame.tenant == t].set_index("step").reindex(steps)
            ax.step(steps, mine.usage.astype(float), where="post", color=colors[t], lw=1.4)
            ax.step(steps, mine.quota.map(lambda q: float(q) if isinstance(q, Fraction) else math.nan),
                    where="post", color=colors[t], lw=1.3, ls="--")
        ax.axhline(budget, color="black", lw=0.8, ls=":")
        m = run_metrics(trace, v)
        name = policy.upper() if policy in ("lru", "lfu") else policy.capitalize()
        ax.set_title(f"{name}: {m['evictions']} evictions, hit rate {m['hit_rate']:.2f}, "
                     f"Jain {m['jain']:.2f}", fontsize=10)
        ax.set_xlabel("trace step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{unit} held by the tenant")
    handles = [Line2D([], [], color=colors[t], lw=1.4) for t in tenants]
    labels = [f"{t} (weight {trace.header.tenants.get(t, 1)})" for t in tenants]
    handles += [Line2D([], [], color="gray", ls="--"), Line2D([], [], color="black", ls=":", lw=0.8)]
    labels += ["quota (dashed, tenant's colour)", f"budget ({budget} {unit})"]
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle(f"{trace.name}: {unit} held against quota per tenant "
                 f"(gaps: the tenant has no request in flight)", fontsize=12)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    finish(fig, path, dpi=110)
    plt.close(fig)
    return str(path)
