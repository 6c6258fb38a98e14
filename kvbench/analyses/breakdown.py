"""The memory breakdown of SPEC section 3 over a serving simulation, and the PagedAttention
paper's setting (OPT-13B, 12 GiB, ShareGPT lengths) reproduced with it.

The breakdown (:func:`breakdown`) averages, over *saturated* steps, each category as a share of
the whole budget. A step is saturated when a request was waiting for memory at its end: its
admission was refused by the backend, or skipped because the step preempted. That is the state
the PagedAttention paper's figure describes (memory is what keeps requests out); steps with an
empty queue measure the arrival rate, not the allocator, and the final drain measures neither.
Paper-style categories: on a saturated step of the contiguous layout, the free tail of the arena
(which the ledger calls ``free``) was too small for the waiting request's reservation (first fit
would have placed it otherwise), so it counts as external fragmentation, as the paper counts
Orca's leftover; a paged pool's free blocks stay ``free`` (any request can use any block; the
waiting one needs more of them).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.analyses.settings import RunSettings
from kvbench.analyses.serving import DEFAULT_MAX_BATCH, LIFECYCLE_COUNTS, SimResult, simulate
from kvbench.charts import CATEGORY_COLORS, CATEGORY_LABELS, finish
from kvbench.contract import registry
from kvbench.contract.ledger import MEMORY_CATEGORIES
from kvbench.contract.protocol import CacheConfig
from kvbench.outputs import staged
from kvbench.progress import Progress
from kvbench.traces.loaders import Request

BREAKDOWN_BACKENDS = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "numpy", "torch")


def paper_categories(result: SimResult) -> pd.DataFrame:
    """Per-step slots in the paper's categories (see the module docstring for the rule)."""
    s = result.samples[list(MEMORY_CATEGORIES)].copy()
    if result.layout == "contiguous":
        tail = result.samples["waiting_for_memory"].to_numpy()
        s.loc[tail, "external_fragmentation"] += s.loc[tail, "free"]
        s.loc[tail, "free"] = 0
    return s


def breakdown(result: SimResult, over: str = "saturated") -> dict:
    """Each category's mean share of the budget, over ``saturated`` steps (a request waited for
    memory) or ``all`` steps the simulation recorded; falls back to ``all`` when none saturated."""
    if over not in ("saturated", "all"):
        raise ValueError(f"over must be 'saturated' or 'all', got {over!r}")
    cats = paper_categories(result)
    mask = result.samples["waiting_for_memory"].to_numpy()
    if over == "all" or not mask.any():
        over, mask = "all", np.ones(len(cats), dtype=bool)
    total = result.config.arena_slots
    shares = (cats[mask].mean() / total) if mask.any() else pd.Series(0.0, index=list(MEMORY_CATEGORIES))
    return {**{c: float(shares[c]) for c in MEMORY_CATEGORIES}, "averaged_over": over,
            "steps_averaged": int(mask.sum()),
            "mean_running": float(result.samples["running"][mask].mean()) if mask.any() else 0.0}


def summary_row(result: SimResult, over: str = "saturated") -> dict:
    return {"backend": result.backend, "layout": result.layout, **breakdown(result, over),
            "max_running": result.max_running, "requests": result.requests,
            "admitted": result.admitted, "finished": result.finished, "unserved": result.unserved,
            "rejected": sum(result.rejected.values()), "preemptions": result.preemptions,
            "recomputed_tokens": result.recomputed_tokens, "prefix_hit_blocks": result.prefix_hit_blocks,
            "steps": result.steps, "ops": len(result.trace),
            **{f: getattr(result, f) for f in LIFECYCLE_COUNTS},
            **{f"{name}_hit_blocks": n for name, n in result.tier_hits.items()},
            **({"computed_blocks": result.prompt_blocks - result.prefix_hit_blocks
                - sum(result.tier_hits.values())} if result.tier_hits else {}),
            **result.throughput(), "wall_s": result.wall_seconds, "backend_s": result.backend_seconds}


def available_backends(device: str = "cpu") -> list[str]:
    """The breakdown's backends that run here. torch only on CUDA: on CPU it must report the very
    ledger numpy does (the checker holds both to the oracle), at a fraction of the speed; name it
    explicitly to include it anyway."""
    names = [n for n in BREAKDOWN_BACKENDS if n != "torch" or str(device).startswith("cuda")]
    return [n for n in names if registry.resolve(n).available()[0]]


def memory_breakdown(requests, config: CacheConfig, backends=None, *, over: str = "saturated",
                     progress: bool = False, **sim) -> tuple[pd.DataFrame, dict]:
    """Simulate each backend on the same requests: (one row per backend, {backend: SimResult})."""
    names = list(backends) if backends else available_backends(config.device)
    results = {}
    for n in names:
        bar = Progress(len(requests), f"serving on {n}", "requests") if progress else None
        try:
            results[n] = simulate(requests, n, config, progress=bar, **sim)
        finally:
            if bar is not None:
                bar.close()
    return pd.DataFrame([summary_row(r, over) for r in results.values()]), results


LABELS, COLORS = CATEGORY_LABELS, CATEGORY_COLORS


def plot_breakdown(table: pd.DataFrame, path, title: str = "KV cache memory breakdown") -> Path:
    """A stacked bar per backend (shares of the budget), written as PNG with the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.6 * len(table) + 3.2, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(table))
    bottom = np.zeros(len(table))
    for c in MEMORY_CATEGORIES:
        vals = table[c].to_numpy(dtype=float) * 100
        ax.bar(x, vals, bottom=bottom, color=COLORS[c], label=LABELS[c], width=0.6)
        bottom += vals
    for xi, v in zip(x, table["token_states"].to_numpy(dtype=float) * 100):
        ax.text(xi, v / 2, f"{v:.1f}%", ha="center", va="center", color="white", fontsize=9)
    if "paper_token_states" in table:
        for xi, v in zip(x, table["paper_token_states"].to_numpy(dtype=float) * 100):
            if np.isfinite(v):
                ax.plot([xi - 0.3, xi + 0.3], [v, v], color="black", lw=1.5, ls="--")
        ax.plot([], [], color="black", lw=1.5, ls="--", label="paper: token states")
    ax.set_xticks(x, table["backend"].tolist(), fontsize=9)
    ax.set_ylabel("share of the KV budget (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return finish(fig, path, dpi=120)


# --- the paper's setting: OPT-13B, 12 GiB of KV cache, ShareGPT lengths -------------------------

OPT13B = {
    "model": "opt-13b",  # 819,200 B/token = 800 KiB
    "budget": "12GiB",  # floor(12 GiB / (16 * 800 KiB)) = 983 blocks = 15,728 slots
    "block_size": 16,
    "max_context": 2048,
    "law": "sharegpt",  # lognormal, means 161 prompt / 338 output tokens (kvbench.traces.laws)
    "num_requests": 400,
    "max_steps": 3000,  # admission horizon; the running requests then finish
    "seed": 0,
}
# Token-state shares reported by the PagedAttention paper (Kwon et al., SOSP'23, Figure 2).
PAPER_TOKEN_STATES = {"contiguous-max": 0.204, "contiguous-pow2": 0.268, "contiguous-oracle": 0.382,
                      "numpy": 0.963, "torch": 0.963}
PAPER_SYSTEM = {"contiguous-max": "Orca (Max)", "contiguous-pow2": "Orca (Pow2)",
                "contiguous-oracle": "Orca (Oracle)", "numpy": "vLLM", "torch": "vLLM"}


def opt13b_config(device: str = "cpu") -> CacheConfig:
    """Ledger only: with K/V arrays the pool would take the whole 12 GiB."""
    return RunSettings(device=device, store_kv=False).resolve(
        OPT13B, longest=OPT13B["max_context"], hashed=False)


def opt13b_requests(num_requests: int = OPT13B["num_requests"], seed: int = OPT13B["seed"]) -> list[Request]:
    """ShareGPT-like lengths, all waiting at time 0 (a saturated server).

    Prompt and output are drawn from the ``sharegpt`` law clipped to the 2,048-token context; the
    output is then cut so that prompt + output fits the context (OPT-13B cannot go further).
    """
    from kvbench.traces.laws import request_laws
    ctx = OPT13B["max_context"]
    prompt_law, output_law = request_laws(OPT13B["law"], max_prompt=ctx, max_output=ctx)
    rng = np.random.default_rng(seed)
    prompts, outputs = prompt_law.sample(rng, num_requests), output_law.sample(rng, num_requests)
    outputs = np.minimum(outputs, ctx - prompts)
    return [Request(0.0, int(p), int(o), "sharegpt") for p, o in zip(prompts, outputs)]


def run_opt13b(backends=None, *, num_requests: int = OPT13B["num_requests"],
               max_steps: int | None = OPT13B["max_steps"], seed: int = OPT13B["seed"],
               max_batch: int = DEFAULT_MAX_BATCH, device: str = "cpu",
               progress: bool = False) -> tuple[pd.DataFrame, dict]:
    """The breakdown table of the paper's setting, with the paper's token-state shares beside it."""
    reqs = opt13b_requests(num_requests, seed)
    table, results = memory_breakdown(
        reqs, opt13b_config(device), backends, max_batch=max_batch, max_steps=max_steps, seed=seed,
        progress=progress, source={"scenario": "opt13b", **{k: v for k, v in OPT13B.items()
                                                             if k not in ("max_steps", "seed")},
                                   "num_requests": num_requests})
    table.insert(1, "paper_system", table["backend"].map(PAPER_SYSTEM).fillna("-"))
    table.insert(2, "paper_token_states", table["backend"].map(PAPER_TOKEN_STATES))
    return table, results


PAPER_COLUMNS = ["backend", "paper_system", "paper_token_states", *MEMORY_CATEGORIES, "averaged_over",
                 "steps_averaged", "mean_running", "max_running", "finished", "preemptions",
                 "recomputed_tokens", "steps", "output_tokens_per_step"]


def markdown_table(table: pd.DataFrame) -> str:
    """The breakdown as a markdown table, shares in percent."""
    cols = [c for c in PAPER_COLUMNS if c in table]
    df = table[cols].copy()
    for c in ("paper_token_states", *MEMORY_CATEGORIES):
        if c in df:
            df[c] = df[c].map(lambda v: "-" if pd.isna(v) else f"{100 * v:.1f}%")
    for c in ("mean_running", "output_tokens_per_step"):
        if c in df:
            df[c] = df[c].map(lambda v: f"{v:.2f}")
    head = "| " + " | ".join(cols) + " |"
    rule = "|" + "|".join("---" for _ in cols) + "|"
    rows = ["| " + " | ".join(str(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join([head, rule, *rows]) + "\n"


def write_paper_files(table: pd.DataFrame, directory="results/paper",
                      num_requests: int = OPT13B["num_requests"]) -> list[Path]:
    """``breakdown.csv``, ``breakdown.md`` and ``breakdown.png`` of a :func:`run_opt13b` table."""
    out = Path(directory)
    paths = [out / "breakdown.csv", out / "breakdown.md", out / "breakdown.png"]
    cols = [c for c in PAPER_COLUMNS if c in table] + [c for c in table if c not in PAPER_COLUMNS]
    with staged(*paths) as (csv_tmp, md_tmp, png_tmp):  # all three, or none of them
        table[cols].to_csv(csv_tmp, index=False, float_format="%.6g")
        md_tmp.write_text(
            "# OPT-13B, 12 GiB KV budget, ShareGPT-like lengths: memory breakdown\n\n"
            f"Generated by `kvbench.analyses.breakdown.write_paper_results` ({num_requests} requests, all waiting at "
            "time 0; shares of the 15,728-slot budget averaged over saturated steps).\n\n"
            + markdown_table(table), encoding="utf-8")
        plot_breakdown(table, png_tmp, title=f"OPT-13B, 12 GiB KV, ShareGPT-like ({num_requests} "
                                             "requests), saturated steps (dashed: paper)")
    return paths


def write_paper_results(directory="results/paper", backends=None, **opts) -> list[Path]:
    """Run the OPT-13B scenario (``opts`` go to :func:`run_opt13b`) and write its files."""
    table, _ = run_opt13b(backends, **opts)
    return write_paper_files(table, directory, opts.get("num_requests", OPT13B["num_requests"]))



__all__ = ["breakdown", "paper_categories", "memory_breakdown", "plot_breakdown", "opt13b_config",
           "opt13b_requests", "run_opt13b", "write_paper_results", "write_paper_files", "OPT13B",
           "PAPER_TOKEN_STATES"]
