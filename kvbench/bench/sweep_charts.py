"""Charts of a sweep's cells (PNG, matplotlib's Agg backend): a metric as a heatmap over two
settings, one panel per backend (fragmentation over block size x budget, hit rate over cache size x
salts), or as lines against one setting, one line per backend.

Cells are those that passed the checker (a failed replay's figures stop at its divergence); the
axes neither drawn nor faceted (seeds, traces, ...) are averaged, and the title says over what.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kvbench.bench.grid import parameter_columns
from kvbench.contract.formulas import parse_bytes
from kvbench.outputs import figure_png

AGGREGATIONS = ("mean", "median", "min", "max", "count", "sum")  # how cells in one place combine
CHART_KEYS = {"heatmap": ("kind", "x", "y", "metric", "facet", "agg", "where", "name"),
              "lines": ("kind", "x", "metric", "hue", "facet", "agg", "where", "name")}


def natural_order(values) -> list:
    """Setting values in their natural order: numbers, byte sizes ('4KiB'), then text."""
    def key(v):
        if isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
            return (0, float(v), "")
        if str(v).strip().isdigit():  # a count (of blocks), as text in the store
            return (0, float(v), str(v))
        try:
            return (0, float(parse_bytes(str(v))), str(v))
        except (ValueError, TypeError):
            return (1, 0.0, str(v))
    return sorted(pd.unique(pd.Series(list(values)).dropna()), key=key)


def _label(v) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _usable(df: pd.DataFrame, metric: str, needed) -> pd.DataFrame:
    missing = [c for c in (metric, *needed) if c not in df.columns]
    if missing:
        raise ValueError(f"the sweep's cells have no column(s) {missing}; "
                         f"columns: {', '.join(sorted(df.columns))}")
    if "status" in df.columns:
        df = df[df["status"] == "pass"]
    return df[pd.to_numeric(df[metric], errors="coerce").notna()]


def _averaged(df: pd.DataFrame, used) -> str:
    over = [c for c in parameter_columns(df) if c not in used and df[c].astype(str).nunique() > 1]
    return f" (mean over {', '.join(over)})" if over else ""


def _facets(df: pd.DataFrame, facet) -> list:
    cols = [facet] if isinstance(facet, str) else list(facet or [])
    if not cols:
        return [("", df)]
    return [(" ".join(map(str, k if isinstance(k, tuple) else (k,))), part)
            for k, part in df.groupby(cols, sort=True)]


def _panels(n: int, size):
    """A figure of ``n`` panels, three to a row; ``size(rows, cols)`` is its size in inches."""
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    return _plt().subplots(nrows, ncols, figsize=size(nrows, ncols), squeeze=False, layout="constrained")


def heatmap(df: pd.DataFrame, x: str, y: str, metric: str, *, facet="backend", agg: str = "mean",
            title: str = ""):
    df = _usable(df, metric, [x, y])
    facets = _facets(df, facet)
    xs, ys = natural_order(df[x]), natural_order(df[y])
    fig, axes = _panels(len(facets), lambda nr, nc: (0.9 * len(xs) * nc + 2.5, 0.6 * len(ys) * nr + 2))
    tables = [part.assign(**{metric: part[metric].astype(float)})
              .pivot_table(index=y, columns=x, values=metric, aggfunc=agg).reindex(index=ys, columns=xs)
              for _, part in facets]
    lo = min(float(np.nanmin(t.to_numpy(dtype=float))) for t in tables)
    hi = max(float(np.nanmax(t.to_numpy(dtype=float))) for t in tables)
    for ax, (name, _), table in zip(axes.flat, facets, tables):
        im = ax.imshow(table.to_numpy(dtype=float), aspect="auto", origin="lower", cmap="viridis",
                       vmin=lo, vmax=hi)
        ax.set_xticks(range(len(xs)), [_label(v) for v in xs], fontsize=7)
        ax.set_yticks(range(len(ys)), [_label(v) for v in ys], fontsize=7)
        ax.set_xlabel(x, fontsize=8)
        ax.set_ylabel(y, fontsize=8)
        ax.set_title(name, fontsize=9)
        for (i, j), v in np.ndenumerate(table.to_numpy(dtype=float)):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=6,
                        color="white" if hi > lo and (v - lo) / (hi - lo) < 0.5 else "black")
    for ax in list(axes.flat)[len(facets):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label=metric)
    fig.suptitle(title or f"{metric} over {x} x {y}{_averaged(df, [x, y, metric, *_cols(facet)])}",
                 fontsize=10)
    return fig


def lines(df: pd.DataFrame, x: str, metric: str, *, hue: str = "backend", facet=None,
          agg: str = "mean", title: str = ""):
    df = _usable(df, metric, [x, hue])
    facets = _facets(df, facet)
    xs = natural_order(df[x])
    fig, axes = _panels(len(facets), lambda nr, nc: (5 * nc, 3.5 * nr))
    for ax, (name, part) in zip(axes.flat, facets):
        table = part.pivot_table(index=x, columns=hue, values=metric, aggfunc=agg).reindex(xs)
        for col in table.columns:
            ax.plot(range(len(xs)), table[col].to_numpy(dtype=float), "-o", markersize=3, label=str(col))
        ax.set_xticks(range(len(xs)), [_label(v) for v in xs], fontsize=7)
        ax.set_xlabel(x, fontsize=8)
        ax.set_ylabel(metric, fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(facets):]:
        ax.axis("off")
    fig.suptitle(title or f"{metric} against {x}{_averaged(df, [x, hue, metric, *_cols(facet)])}",
                 fontsize=10)
    return fig


def _cols(facet) -> list:
    return [facet] if isinstance(facet, str) else list(facet or [])


def chart_name(spec: dict) -> str:
    if spec.get("name"):
        return spec["name"]
    if spec["kind"] == "heatmap":
        return f"heatmap-{spec['metric']}-{spec['y']}-by-{spec['x']}"
    return f"lines-{spec['metric']}-by-{spec['x']}"


def check_spec(spec: dict, where: str = "chart") -> None:
    kind = spec.get("kind")
    if kind not in CHART_KEYS:
        raise ValueError(f"{where}: kind must be one of {', '.join(CHART_KEYS)}, got {kind!r}")
    unknown = sorted(set(spec) - set(CHART_KEYS[kind]))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} for a {kind}; known: {', '.join(CHART_KEYS[kind])}")
    needed = ("x", "y", "metric") if kind == "heatmap" else ("x", "metric")
    missing = [k for k in needed if k not in spec]
    if missing:
        raise ValueError(f"{where}: a {kind} needs {', '.join(missing)}")


def select(df: pd.DataFrame, where: dict) -> pd.DataFrame:
    """The cells whose column ``k`` is ``v`` (or one of the list ``v``) for each item of ``where``."""
    for k, v in (where or {}).items():
        if k not in df.columns:
            raise ValueError(f"where: no column {k!r} in the cells")
        df = df[df[k].astype(str).isin([str(x) for x in (v if isinstance(v, list) else [v])])]
    return df


def draw(df: pd.DataFrame, spec: dict) -> tuple[str, bytes]:
    """(file name, PNG bytes) of one chart spec (a grid's [[charts]] entry)."""
    check_spec(spec)
    df = select(df, spec.get("where"))
    opts = {k: spec[k] for k in ("facet", "agg") if k in spec}
    if spec["kind"] == "heatmap":
        fig = heatmap(df, spec["x"], spec["y"], spec["metric"], **opts)
    else:
        fig = lines(df, spec["x"], spec["metric"], **opts, **({"hue": spec["hue"]} if "hue" in spec else {}))
    data = figure_png(fig, dpi=100, bbox_inches="tight")
    _plt().close(fig)
    return chart_name(spec) + ".png", data


__all__ = ["heatmap", "lines", "draw", "select", "check_spec", "chart_name", "natural_order"]
