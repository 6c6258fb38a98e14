"""`kvbench compare A.json B.json [C.json ...]`: result records side by side, with ratios and charts.

Records are those of kvbench.bench.records (``kvbench run``, ``kvbench.bench.gpu``, ``kvbench serve``...):
each names its machine, commit and parameters. A sweep's cells in the results store are a record
too: ``sweep:NAME`` (its newest code version) or ``sweep:NAME@COMMIT`` (``--store`` says which
store), matched on the sweep's parameters, so two commits of one sweep line up cell by cell. The first record is the baseline ``A``; every
other one gets a ratio column (``B/A``, ``C/A``). Rows are matched on what identifies a
measurement (workload, backend, policy, bench, impl, batch, ...), never on the device, so a CPU
run here lines up with the same rows of a GPU run.

Charts (PNG, matplotlib's Agg backend, no display needed), each drawn when the records hold its
figures:

- ``memory_breakdown.png``: per workload, a stacked bar per backend and record: the replay's mean
  share of the budget in token states, reservation, internal and external fragmentation, free;
- ``blocks_over_replay.png`` / ``fragmentation_over_replay.png``: blocks in use and fragmentation
  after every operation (rows that carry a per-operation ``series``);
- ``throughput.png``: operations per second of the backend calls per backend (run records),
  decode tokens per second against the batch size and gather/write bandwidth as a fraction of a
  plain copy (gpu_check records).
"""
from __future__ import annotations

import argparse
import json
import math
import string
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench.bench import records
from kvbench.charts import CATEGORY_COLORS
from kvbench.contract.ledger import MEMORY_CATEGORIES
from kvbench.outputs import check_writable, save_figure, staged
from kvbench.progress import Progress

# What identifies a row across records (whichever a record has); the device is left out on purpose.
KEY_COLUMNS = ["bench", "workload", "backend", "impl", "policy", "what", "batch", "format",
               "scheme", "quantizer", "budget"]
# Columns shown by default, by record kind (others: every numeric column).
DEFAULT_METRICS = {
    "run": ["status", "peak_blocks", "mean_fragmentation", "evictions", "recomputed_tokens",
            "backend_ms", "ops_per_s"],
    "gpu_check": ["status", "backend_ms", "median_s", "tokens_per_s", "torch_vs_numpy",
                  "fraction_of_copy", "pool_bytes"],
    "sweep": ["status", "peak_blocks", "mean_fragmentation", "evictions", "recomputed_tokens",
              "hit_rate", "backend_ms", "ops_per_s"],
    "serve": [*(c for c in MEMORY_CATEGORIES if c != "free"), "preemptions", "ops_per_s"],
}
BREAKDOWN = list(MEMORY_CATEGORIES)
BREAKDOWN_COLORS = [CATEGORY_COLORS[c] for c in BREAKDOWN]  # the same colours as every chart


def labels(n: int) -> list[str]:
    return list(string.ascii_uppercase[:n]) if n <= 26 else [f"R{i}" for i in range(n)]


def describe(label: str, path, rec: dict) -> str:
    """One legend line: what a record is and where it was measured."""
    m = rec.get("machine", {})
    where = m.get("gpu") or m.get("device") or m.get("processor") or "?"
    return (f"{label} = {path}: {rec['kind']}, commit {str(rec.get('commit', '?'))[:8]}"
            f"{' (dirty)' if rec.get('dirty') else ''}, {m.get('hostname', '?')} "
            f"({where}, {m.get('cpus', '?')} cpus), {rec.get('created', '?')}")


def sweep_record(spec: str, store_url=None) -> dict:
    """``sweep:NAME[@COMMIT]``: the sweep's cells in the store as a record (kind 'sweep')."""
    from kvbench.bench.grid import parameter_columns
    from kvbench.bench.store import Store
    name, _, commit = spec[len("sweep:"):].partition("@")
    df, _ = Store(store_url).cells(name, commit or None)
    first = df.sort_values("started").iloc[-1]
    machine = {k[len("machine_"):]: first[k] for k in df.columns if k.startswith("machine_")}
    return {"kind": "sweep", "created": first["started"], "machine": machine,
            "commit": first["code"], "dirty": bool(first["dirty"]), "params": {"sweep": name},
            "key_columns": parameter_columns(df), "rows": df.to_dict("records")}


def read_record(path, store_url=None) -> dict:
    return sweep_record(str(path), store_url) if str(path).startswith("sweep:") else records.read(path)


def frame(rec: dict) -> pd.DataFrame:
    df = pd.DataFrame(rec["rows"])
    for k in KEY_COLUMNS + [k for k in rec.get("key_columns", []) if k not in KEY_COLUMNS]:
        if k in df.columns:
            df[k] = df[k].map(lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v))
                              else (str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)))
    return df


def keys_of(frames, extra=()) -> list[str]:
    known = KEY_COLUMNS + [k for k in extra if k not in KEY_COLUMNS]
    return [k for k in known if any(k in f.columns for f in frames)]


def side_by_side(frames: list, names: list, metrics=None, extra_keys=()) -> pd.DataFrame:
    """One row per measurement, columns (metric, record) and (metric, 'X/A') ratios;
    ``extra_keys``: columns that identify a row beside KEY_COLUMNS (a sweep's parameters)."""
    keys = keys_of(frames, extra_keys)
    if not keys:
        raise ValueError("the records have no column that identifies a row "
                         f"(looked for {', '.join(KEY_COLUMNS)})")
    if metrics is None:
        metrics = []
        for f in frames:
            for c in f.columns:
                if c not in keys and c not in metrics and (pd.api.types.is_numeric_dtype(f[c])
                                                           or c == "status"):
                    metrics.append(c)
    parts = []
    for f, name in zip(frames, names):
        f = f.copy()
        for k in keys:
            if k not in f.columns:
                f[k] = "-"
        cols = [m for m in metrics if m in f.columns]
        if f.duplicated(keys).any():
            dup = f[f.duplicated(keys, keep=False)][keys].drop_duplicates().head(3)
            raise ValueError(f"record {name}: several rows share {keys}: "
                             f"{dup.to_dict('records')}")
        part = f.set_index(keys)[cols]
        part.columns = pd.MultiIndex.from_product([cols, [name]])
        parts.append(part)
    table = pd.concat(parts, axis=1)
    out = {}
    for m in metrics:
        present = [n for n in names if (m, n) in table.columns]
        if not present:
            continue
        for n in present:
            out[(m, n)] = table[(m, n)]
        base = names[0]
        if (m, base) in table.columns and pd.api.types.is_numeric_dtype(table[(m, base)]):
            for n in present:
                if n != base and pd.api.types.is_numeric_dtype(table[(m, n)]):
                    a, b = table[(m, base)].astype(float), table[(m, n)].astype(float)
                    out[(m, f"{n}/{base}")] = (b / a).where(a != 0)
    result = pd.DataFrame(out)
    result.columns = pd.MultiIndex.from_tuples(result.columns)
    return result


# --- charts --------------------------------------------------------------------------------------


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _case(row) -> str:
    pol = row.get("policy", "-")
    return row["workload"] + ("" if pol in ("-", None) or pol != pol else f" @{pol}")


def _grid(n: int, ncols: int = 4):
    ncols = min(ncols, n)
    return math.ceil(n / ncols), ncols


def _footer(fig, legend) -> None:
    """The records' legend lines (commit, machine, date of each) at the figure's foot."""
    fig.subplots_adjust(bottom=max(fig.subplotpars.bottom, 0.04 + 0.035 * len(legend)))
    fig.text(0.01, 0.005, "\n".join(legend), ha="left", va="bottom", fontsize=6, color="#555555")


def chart_memory(frames, names, out: Path, legend=()):
    cols = [f"mean_{c}" for c in BREAKDOWN]
    data = []
    for f, name in zip(frames, names):
        if not set(cols) <= set(f.columns) or "backend" not in f.columns:
            continue
        for _, row in f.iterrows():
            vals = [row[c] for c in cols]
            if any(v is None or v != v for v in vals) or sum(vals) <= 0:
                continue
            data.append({"case": _case(row), "backend": row["backend"], "record": name,
                         **{c: v / sum(vals) for c, v in zip(BREAKDOWN, vals)}})
    if not data:
        return None
    df = pd.DataFrame(data)
    # Bars of one backend side by side (A, B, ...), backends in the order they first appear.
    order = {b: i for i, b in enumerate(dict.fromkeys(df["backend"]))}
    df = df.assign(o=df["backend"].map(order), r=df["record"].map(names.index))
    df = df.sort_values(["o", "r"], kind="stable")
    cases = list(dict.fromkeys(df["case"]))
    plt = _plt()
    nr, nc = _grid(len(cases))
    fig, axes = plt.subplots(nr, nc, figsize=(4.2 * nc, 3.6 * nr + 0.8), squeeze=False, sharey=True)
    for ax, case in zip(axes.flat, cases):
        sub = df[df["case"] == case]
        x = sub["o"].to_numpy() * (len(names) + 0.6) + sub["r"].to_numpy()  # a gap between backends
        bottom = np.zeros(len(sub))
        for part, color in zip(BREAKDOWN, BREAKDOWN_COLORS):
            ax.bar(x, sub[part], bottom=bottom, color=color, label=part.replace("_", " "),
                   edgecolor="white", linewidth=0.4)
            bottom += sub[part].to_numpy()
        ax.set_xticks(x, sub["backend"] + " " + sub["record"], rotation=60, ha="right", fontsize=7)
        ax.set_title(case, fontsize=9)
        ax.set_ylim(0, 1)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    for row in axes:
        row[0].set_ylabel("mean share of the budget")
    handles, lbls = axes[0][0].get_legend_handles_labels()
    fig.suptitle("Memory breakdown, mean over the replay (records " + ", ".join(names) + ")",
                 fontsize=11)
    fig.legend(handles, lbls, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.35 / fig.get_figheight()),
               ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.7 / fig.get_figheight()))
    path = out / "memory_breakdown.png"
    _footer(fig, legend)
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def chart_series(frames, names, out: Path, quantity: str, ylabel: str, legend=()):
    lines = []
    for f, name in zip(frames, names):
        if "series" not in f.columns:
            continue
        for _, row in f.iterrows():
            s = row["series"]
            if isinstance(s, dict) and any(v is not None for v in s.get(quantity) or []):
                lines.append((_case(row), row.get("backend", row.get("impl", "?")), name,
                              s[quantity]))
    if not lines:
        return None
    cases = list(dict.fromkeys(c for c, *_ in lines))
    plt = _plt()
    nr, nc = _grid(len(cases))
    fig, axes = plt.subplots(nr, nc, figsize=(4.2 * nc, 3.0 * nr), squeeze=False)
    styles = ["-", "--", ":", "-."]  # one per record; one color per backend
    colors = {b: f"C{k % 10}" for k, b in enumerate(dict.fromkeys(b for _, b, _, _ in lines))}
    for ax, case in zip(axes.flat, cases):
        for c, backend, name, ys in lines:
            if c == case:
                ax.plot(np.arange(1, len(ys) + 1), [np.nan if y is None else y for y in ys],
                        styles[names.index(name) % 4], color=colors[backend],
                        label=f"{backend} {name}", linewidth=1)
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("operation", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    fig.tight_layout()
    path = out / f"{quantity}_over_replay.png".replace("blocks_used", "blocks")
    _footer(fig, legend)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def chart_throughput(frames, names, out: Path, legend=()):
    plt = _plt()
    panels = []
    runs = [(f, n) for f, n in zip(frames, names) if {"backend", "ops_per_s"} <= set(f.columns)]
    decode = [(f[f["bench"] == "decode"], n) for f, n in zip(frames, names)
              if "bench" in f.columns and "tokens_per_s" in f.columns and (f["bench"] == "decode").any()]
    bandwidth = [(f[f["bench"] == "bandwidth"], n) for f, n in zip(frames, names)
                 if "bench" in f.columns and "fraction_of_copy" in f.columns
                 and (f["bench"] == "bandwidth").any()]
    panels = [p for p, have in (("runs", runs), ("decode", decode), ("bandwidth", bandwidth)) if have]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "runs":
            # Median over workloads of each backend's ops/s (backend calls only, the checker excluded).
            table = pd.DataFrame({n: f[f.get("status", "pass") != "n/a"].groupby("backend")["ops_per_s"].median()
                                  for f, n in runs})
            table.plot.bar(ax=ax, logy=True, rot=30)
            ax.set_ylabel("operations / s (median over workloads)")
            ax.set_title("Replay throughput per backend", fontsize=10)
        elif panel == "decode":
            styles = ["-o", "--s", ":^", "-.v"]  # one per record; one color per impl
            impls = list(dict.fromkeys(i for f, _ in decode for i in f["impl"]))
            colors = {i: f"C{k % 10}" for k, i in enumerate(impls)}
            for f, n in decode:
                for impl, sub in f.groupby("impl", sort=False):
                    sub = sub.assign(b=sub["batch"].astype(float)).sort_values("b")
                    ax.plot(sub["b"], sub["tokens_per_s"], styles[names.index(n) % 4],
                            color=colors[impl], label=f"{impl} {n}", markersize=4)
            ax.set_xscale("log", base=2)
            batches = sorted({float(b) for f, _ in decode for b in f["batch"]})
            ax.set_xticks(batches, [f"{b:g}" for b in batches])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("batch (sequences, one token each)")
            ax.set_ylabel("decode tokens / s")
            ax.set_title("One decode step", fontsize=10)
            ax.legend(fontsize=7)
        else:
            table = pd.DataFrame({n: f.set_index(f["impl"] + " " + f["what"])["fraction_of_copy"]
                                  for f, n in bandwidth})
            table.plot.bar(ax=ax, rot=30)
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_ylabel("copy time / its time (1 = copy speed)")
            ax.set_title("Write and gather against a plain copy", fontsize=10)
    fig.tight_layout()
    path = out / "throughput.png"
    _footer(fig, legend)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def charts(frames, names, out: Path, legend=(), progress: bool = False) -> list[Path]:
    """The charts the records have figures for, in ``out``. ``progress``: a line on stderr when
    drawing starts and each chart as it is drawn (the reporter of kvbench.progress)."""
    out.mkdir(parents=True, exist_ok=True)
    drawings = [("memory breakdown", lambda: chart_memory(frames, names, out, legend)),
                ("blocks in use", lambda: chart_series(frames, names, out, "blocks_used",
                                                       "blocks in use", legend)),
                ("fragmentation", lambda: chart_series(frames, names, out, "fragmentation",
                                                       "fragmentation", legend)),
                ("throughput", lambda: chart_throughput(frames, names, out, legend))]
    made = []
    with Progress(len(drawings), "compare: drawing charts", "charts", enabled=progress) as bar:
        bar.say(f"compare: drawing up to {len(drawings)} charts in {out}")
        for what, draw in drawings:
            bar.note(what)
            made.append(draw())
            bar.update(1)
    return [p for p in made if p is not None]


# --- command -------------------------------------------------------------------------------------


# Settings that make two records' figures incomparable when they differ (the device, the commit
# and the machine are what a comparison is for).
SETTINGS = ("model", "block_size", "budget", "max_context", "gather", "prefix_caching", "policy")


def differences(recs: list, names: list) -> list[str]:
    """What differs between the records besides the machine, the device and the commit: their
    kind, a setting of their runs, the set of workloads or of backends. One line each."""
    def spread(values):
        return None if len({json.dumps(v, sort_keys=True, default=str) for v in values}) <= 1 else \
            ", ".join(f"{n} {v if v is not None else '(default)'}" for n, v in zip(names, values))

    found = {"kind": spread([r["kind"] for r in recs])}
    for s in SETTINGS:
        if any(s in r.get("params", {}) for r in recs):
            found[s] = spread([r.get("params", {}).get(s) for r in recs])
    for col, what in (("workload", "workloads"), ("backend", "backends")):
        sets = [sorted({str(row[col]) for row in r["rows"] if col in row}) for r in recs]
        if any(sets):
            found[what] = spread([" ".join(x) or "-" for x in sets])
    return [f"{k}: {v}" for k, v in found.items() if v]


def compare(paths, metrics=None, out: str | Path | None = None, store=None, force: bool = False):
    """(legend lines, side-by-side table, charts written). Records that differ in what they
    measured (``differences``) are refused, a ValueError listing each, unless ``force``."""
    legend, table, frames, names = prepare(paths, metrics, store, force)
    made = charts(frames, names, Path(out), legend) if out else []
    return legend, table, made


def prepare(paths, metrics=None, store=None, force: bool = False):
    """compare()'s records read and lined up, before any chart: (legend lines, side-by-side
    table, the records' frames, their names)."""
    if len(paths) < 2:
        raise ValueError("compare needs two or more result records")
    recs = [read_record(p, store) for p in paths]
    names = labels(len(recs))
    legend = [describe(n, p, r) for n, p, r in zip(names, paths, recs)]

    frames = [frame(r) for r in recs]
    if metrics is not None:
        known = sorted({c for f in frames for c in f.columns} - set(KEY_COLUMNS))
        for m in metrics:
            if m not in known:
                raise ValueError(f"--metric {m}: not a column of these records; valid: "
                                 f"{', '.join(known)}")
    if metrics is None:
        metrics = []
        for r in recs:
            for m in DEFAULT_METRICS.get(r["kind"], []):
                if m not in metrics:
                    metrics.append(m)
        metrics = metrics or None
    extra = list(dict.fromkeys(k for r in recs for k in r.get("key_columns", [])))
    table = side_by_side(frames, names, metrics, extra)
    differ = differences(recs, names)
    if differ and not force:
        raise ValueError(f"the records did not measure the same thing ({'; '.join(differ)}): "
                         f"--force compares them anyway")
    legend += [f"WARNING: not comparable: {d}" for d in differ]
    return legend, table, frames, names


def sections(table: pd.DataFrame) -> list:
    """[(title, table)]: one part per ``bench`` when rows carry one (a gpu_check record mixes
    checks, decode steps, bandwidth and memory), without the columns and index levels that are
    empty in that part."""
    names = list(table.index.names)
    parts = ([(f"bench = {b}", t) for b, t in table.groupby(level="bench", sort=False)]
             if "bench" in names else [("", table)])
    out = []
    for title, t in parts:
        t = t.dropna(axis=1, how="all")
        drop = [n for n in t.index.names
                if len(t.index.names) > 1 and (t.index.get_level_values(n) == "-").all()]
        for n in drop:
            if len(t.index.names) > 1:
                t = t.droplevel(n)
        out.append((title, t))
    return out


def number(x: float) -> str:
    """Whole numbers in full (17140, not 1.714e+04), others to 4 significant digits."""
    if math.isfinite(x) and x == int(x) and abs(x) < 1e15:
        return f"{int(x)}"
    return f"{x:.4g}"


def cmd_compare(args) -> int:
    if not args.no_charts:
        check_writable(args.out, option="--out", folder=True)
    if args.csv:
        check_writable(args.csv, option="--csv")
    legend, table, frames, names = prepare(args.records, args.metric, args.store, force=args.force)
    print("\n".join(legend))
    with pd.option_context("display.width", 250, "display.max_columns", 60, "display.max_rows", 1000,
                           "display.float_format", number):
        for title, part in sections(table):
            if title:
                print(f"\n{title}")
            print(part.to_string())
    if args.csv:
        with staged(args.csv) as (tmp,):
            table.to_csv(tmp)
        print(f"table: {args.csv}")
    sys.stdout.flush()  # the table is read while the charts are drawn
    made = [] if args.no_charts else charts(frames, names, Path(args.out), legend, progress=True)
    for p in made:
        print(f"chart: {p}")
    return 0


def add_compare_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help="result records side by side (ratios to the first), charts",
                       description="Result records side by side (ratios to the first), charts.")
    p.add_argument("records", nargs="+", help="two or more result records (JSON files, or sweep:NAME[@COMMIT] "
                                              "from the results store); the first is A")
    p.add_argument("--store", help="results store of sweep: records (default results/sweeps/store)")
    p.add_argument("--metric", action="append",
                   help="column to show (repeatable; default by kind; an unknown one lists the valid)")
    p.add_argument("--out", default=str(records.RESULTS_DIR / "scratch" / "compare"),
                   help="directory for the PNG charts (default results/scratch/compare)")
    p.add_argument("--no-charts", action="store_true", help="print the table only")
    p.add_argument("--csv", help="also write the table as CSV")
    p.add_argument("--force", action="store_true",
                   help="compare records that differ in kind, model, block size, budget, gather, "
                        "policy, workloads or backends (each difference is printed as a warning)")
    p.set_defaults(func=cmd_compare)
    return p


if __name__ == "__main__":  # ``python -m kvbench.bench.compare``: the same as ``kvbench compare``
    from kvbench.cli import main
    sys.exit(main(["compare", *sys.argv[1:]]))
