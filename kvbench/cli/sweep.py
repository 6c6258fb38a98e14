"""`kvbench sweep GRID` (run a grid of cells into the results store) and `kvbench results` (what the
store holds: the sweeps, a pivot of one, its charts)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.bench import grid as grids
from kvbench.bench import sweep_charts
from kvbench.bench.store import DEFAULT_STORE, Store
from kvbench.cli import options
from kvbench.cli.tables import print_table
from kvbench.outputs import check_writable, inside, name_problem, write_bytes, write_text


def charts_dir(store: Store, sweep: str, out, source: str = "", option: str = "--out"):
    """Where a sweep's charts go: ``out``, else into the store (``<store>/_charts/<sweep>/``,
    out of git with the default store). A chart's name comes from a grid file (``source``): one
    that leads out of the folder is refused."""
    if out:
        folder = Path(out)

        def write(name, data):
            path = inside(folder, name, source)
            check_writable(path, option=option)
            write_bytes(path, data)
            return str(path)
        return write

    def write_in_store(name, data):
        why = name_problem(name)
        if why:
            raise ValueError(f"{source + ': ' if source else ''}the chart name {name!r} {why}: give a plain name")
        return store.write_bytes(f"{sweep}/{name}", data)
    return write_in_store


def draw_charts(store: Store, sweep: str, specs, out=None, commit=None, source: str = "") -> list[str]:
    df, _ = store.cells(sweep, commit)
    write = charts_dir(store, sweep, out, source, option="--charts")
    made = []
    for spec in specs:
        name, data = sweep_charts.draw(df, spec)
        made.append(write(name, data))
    return made


def cmd_sweep(args) -> int:
    from kvbench.bench import sweep
    grid = grids.load_grid(args.grid)
    for i, spec in enumerate(grid.charts):
        sweep_charts.check_spec(spec, f"{args.grid}: charts[{i}]")
    store = Store(args.store)
    if args.charts and not args.dry_run:
        check_writable(args.charts, option="--charts", folder=True)
    if args.dry_run:
        cells, traces = grids.expand(grid, grids.code_version()["code"])
        grids.check_cells(grid, cells, traces)
        done = store.done(grid.name)
        rows = [{"cell": c.id[:12], **c.columns(), "done": "yes" if c.id in done else ""} for c in cells]
        print_table(pd.DataFrame(rows), list(rows[0]) if rows else ["cell"])
        ran = sum(c.id in done for c in cells)
        print(f"{grid.name}: {len(cells)} cells, {ran} already in {store.url}, {len(cells) - ran} to run")
        return 0
    executor_options = {"workers": args.workers, "pin": args.pin} if args.executor == "local" else {
        "address": args.address, "max_retries": args.max_retries,
        "runtime_env": sweep.ship_code_env() if args.ship_code else None}
    run = sweep.run_sweep(grid, store, executor=args.executor, retry_errors=args.retry_errors,
                          progress={"interval": args.progress_interval, "enabled": not args.quiet},
                          **executor_options)
    ran = {k: n for k, n in run.summary.items() if k != sweep.ELSEWHERE}
    elsewhere = run.summary.get(sweep.ELSEWHERE, 0)
    print(f"{grid.name}: {len(run.cells)} cells: {run.skipped} were in the store, ran {sum(ran.values())} "
          f"({', '.join(f'{n} {k}' for k, n in sorted(ran.items())) or 'none'}) in {run.wall_s:.1f}s"
          + (f", left {elsewhere} to another sweep of this grid" if elsewhere else "") + f"; store {store.url}")
    for cell, why in run.lost[:10]:
        print(f"lost {cell.id[:12]} {cell.columns()}: {why}")
    if run.interrupted or run.lost:
        stop = options.stop_word(run.interrupted) if run.interrupted else f"{len(run.lost)} cells lost"
        print(f"{stop}: run the same command again to resume (finished cells are kept)")
        if run.interrupted:
            raise run.interrupted  # the one message and exit code of a stop (kvbench.cli.options)
        return 1
    if grid.charts and not args.no_charts:
        for path in draw_charts(store, grid.name, grid.charts, args.charts, source=args.grid):
            print(f"chart: {path}")
    df = store.read(grid.name, columns=["cell_id", "status", "error", "code"])
    df = df[df["code"] == grids.code_version()["code"]]
    bad = df[df["status"].isin(["FAIL", "ERROR"])]
    if len(bad):
        print(f"{len(bad)} cells FAIL or ERROR: kvbench results {grid.name} --where status=FAIL (or ERROR)")
    return 1 if len(bad) else 0


def _where(df: pd.DataFrame, conditions) -> pd.DataFrame:
    where = {}
    for cond in conditions or []:
        key, sep, value = cond.partition("=")
        if not sep or key not in df.columns:
            raise ValueError(f"--where {cond!r}: expected COLUMN=VALUE with a column of the cells "
                             f"({', '.join(sorted(df.columns))})")
        where[key] = value.split(",")
    return sweep_charts.select(df, where)


def list_sweeps(store: Store) -> int:
    rows = []
    for name in store.sweeps():
        df = store.read(name, columns=["status", "code", "started", "backend"])
        info = store.info(name)
        counts = df["status"].value_counts() if len(df) else pd.Series(dtype=int)
        rows.append({"sweep": name, "stored": len(df), "grid_cells": info.get("cells", "?"),
                     **{k: int(counts.get(k, 0)) for k in ("pass", "FAIL", "n/a", "ERROR")},
                     "backends": ",".join(sorted(df["backend"].unique())) if len(df) else "",
                     "commits": df["code"].nunique() if len(df) else 0,
                     "last": df["started"].max() if len(df) else ""})
    if not rows:
        print(f"no sweeps in {store.url}")
        return 0
    print_table(pd.DataFrame(rows), list(rows[0]))
    return 0


def _parse(text: str) -> dict:
    try:
        import tomllib
    except ImportError:
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        import yaml
        return yaml.safe_load(text)


def cmd_results(args) -> int:
    store = Store(args.store)
    if not args.sweep:
        return list_sweeps(store)
    df, note = store.cells(args.sweep, args.commit)
    df = _where(df, args.where)
    if note:
        print(note)
    if args.csv:
        write_text(args.csv, df.to_csv(index=False))  # atomic: an interrupted write leaves the old file
        if args.csv != "-":
            print(f"cells: {args.csv}")
    specs = []
    if args.heatmap:
        specs.append({"kind": "heatmap", "x": args.heatmap[0], "y": args.heatmap[1], "metric": args.metric})
    if args.lines:
        specs.append({"kind": "lines", "x": args.lines, "metric": args.metric})
    if args.charts:
        text = store.grid_text(args.sweep)
        specs += list(_parse(text).get("charts", [])) if text else []
    for spec in specs:
        if spec.get("metric") is None:
            raise ValueError("--heatmap / --lines need --metric")
        name, data = sweep_charts.draw(df, spec)
        print(f"chart: {charts_dir(store, args.sweep, args.out, f'{args.sweep} (its grid in {store.url})')(name, data)}")
    rows = args.rows.split(",")
    missing = [c for c in rows + ([args.cols] if args.cols else []) + ([args.metric] if args.metric else [])
               if c not in df.columns]
    if missing:
        raise ValueError(f"no column(s) {missing} in the cells; columns: {', '.join(sorted(df.columns))}")
    keys = rows + ([args.cols] if args.cols else [])
    df = df.assign(**{k: df[k].astype(object).where(df[k].notna(), "-") for k in keys})  # a trace file has no seed
    if args.metric is None:
        table = pd.crosstab([df[r] for r in rows], df[args.cols or "status"])
    else:
        values = pd.to_numeric(df[args.metric], errors="coerce")
        table = df.assign(**{args.metric: values}).pivot_table(
            index=rows, columns=args.cols, values=args.metric, aggfunc=args.agg)
    if args.cols:  # settings in their natural order (8KiB before 16KiB)
        table = table.reindex(columns=sweep_charts.natural_order(table.columns))
    with pd.option_context("display.width", 250, "display.max_columns", 60, "display.max_rows", 2000):
        print(table.to_string(float_format=lambda v: f"{v:.4g}", sparsify=False))
    return 0


def register(sub) -> None:
    p = sub.add_parser("sweep", help="run a grid of traces x backends x settings x seeds into the results store")
    p.add_argument("grid", help="grid file (TOML; YAML with PyYAML)")
    p.add_argument("--dry-run", action="store_true", help="print the cells (and which are done), run nothing")
    p.add_argument("--store", default=str(DEFAULT_STORE),
                   help="results store: a folder or an fsspec URL every worker reaches (default results/sweeps/store)")
    p.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="local: a process pool on this machine (default); ray: a Ray cluster")
    p.add_argument("--workers", type=options.positive_int, help="local: processes (default: the cores this process may use)")
    p.add_argument("--pin", action="store_true", help="local: pin each worker to a core of its own (timed cells)")
    p.add_argument("--address", help="ray: 'auto' (the cluster `ray start` made here), HOST:PORT, or "
                                     "ray://HOST:10001 (default: start a local Ray)")
    p.add_argument("--ship-code", action="store_true",
                   help="ray: upload this checkout to the workers (runtime_env working_dir)")
    p.add_argument("--max-retries", type=options.nonnegative_int, default=2,
                   help="ray: reruns of a cell whose worker or node died (default 2)")
    p.add_argument("--retry-errors", action="store_true", help="run again the cells stored with status ERROR")
    p.add_argument("--charts", metavar="DIR", help="folder of the grid's charts (default: <store>/_charts/<sweep>/)")
    p.add_argument("--no-charts", action="store_true", help="draw no charts")
    p.add_argument("--quiet", action="store_true", help="no progress")
    p.add_argument("--progress-interval", type=options.positive_float, default=5.0,
                   help="seconds between progress lines when stderr is not a terminal")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("results", help="the sweeps in the results store, a pivot of one, its charts")
    p.add_argument("sweep", nargs="?", help="a sweep (none: list the sweeps)")
    p.add_argument("--store", default=str(DEFAULT_STORE), help="results store (default results/sweeps/store)")
    p.add_argument("--rows", default="backend", help="row columns, comma-separated (default backend)")
    p.add_argument("--cols", help="column of the pivot (default: status counts)")
    p.add_argument("--metric", help="the value shown (default: count of cells by status)")
    p.add_argument("--agg", default="mean", choices=sweep_charts.AGGREGATIONS,
                   help=f"how cells in one place combine: {', '.join(sweep_charts.AGGREGATIONS)}")
    p.add_argument("--where", action="append", metavar="COL=V[,V]", help="keep cells where COL is one of the values")
    p.add_argument("--commit", help="cells of this commit (prefix), or 'all' (default: the newest)")
    p.add_argument("--heatmap", nargs=2, metavar=("X", "Y"), help="draw --metric over X x Y")
    p.add_argument("--lines", metavar="X", help="draw --metric against X, a line per backend")
    p.add_argument("--charts", action="store_true", help="draw the charts the sweep's grid names")
    p.add_argument("--out", help="folder of the charts (default: <store>/_charts/<sweep>/)")
    p.add_argument("--csv", help="write the cells (after --where) as CSV")
    p.set_defaults(func=cmd_results)


__all__ = ["register", "draw_charts"]
