"""Routed runs over a grid of replica counts and cache sizes, and their charts: reuse available,
captured and delivered (fractions of the prompt tokens) against N, one line per cache size, and
against the cache size, one line per N."""
from __future__ import annotations

import dataclasses
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvbench.charts import finish  # noqa: E402
from kvbench.routing.route import route  # noqa: E402

FIGURES = ("available_frac", "captured_frac", "delivered_frac")
STYLES = {"available_frac": "-", "captured_frac": "--", "delivered_frac": ":"}


def grid(jobs, config, replica_counts, block_counts, policy: str, **opts) -> list:
    """One routed run per (N, cache size): their totals, in grid order."""
    rows = []
    for blocks in block_counts:
        cfg = dataclasses.replace(config, num_blocks=blocks)
        for n in replica_counts:
            rows.append(route(jobs, cfg, n, policy, **opts).totals())
    return rows


def _lines(rows, x: str, by: str, path, title: str):
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for k, value in enumerate(sorted({r[by] for r in rows})):  # a colour per line, a style per figure
        mine = sorted((r for r in rows if r[by] == value), key=lambda r: r[x])
        for f in FIGURES:
            ax.plot([r[x] for r in mine], [r[f] for r in mine], STYLES[f], marker="o", color=f"C{k}",
                    label=f"{f.removesuffix('_frac')}, {by.replace('num_', '')} {value}")
    ax.set_xlabel({"replicas": "replicas (N)", "num_blocks": "cache size per replica (blocks)"}[x])
    ax.set_ylabel("prompt tokens from a prefix cache (fraction)")
    ax.set_title(title, fontsize=9)
    if x == "num_blocks":
        ax.set_xscale("log", base=2)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    try:
        return finish(fig, path)
    finally:
        plt.close(fig)


def charts(rows, out, name: str) -> list:
    """The charts of a grid's rows under ``out``: against N (when it has more than one N) and
    against the cache size (more than one size)."""
    paths = []
    policy = rows[0]["policy"] if rows else ""
    if len({r["replicas"] for r in rows}) > 1:
        paths.append(_lines(rows, "replicas", "num_blocks", os.path.join(out, f"{name}-vs-replicas.png"),
                            f"{name}: reuse against N ({policy})"))
    if len({r["num_blocks"] for r in rows}) > 1:
        paths.append(_lines(rows, "num_blocks", "replicas", os.path.join(out, f"{name}-vs-cache.png"),
                            f"{name}: reuse against cache size ({policy})"))
    return paths

