"""`kvbench sweep GRID`: run a grid's cells (kvbench.bench.grid) on a local process pool or on Ray.

Every cell is one ``suite.run_one`` (the checker beside the oracle, the replay the rest of kvbench
uses) and yields one flat record: the cell's parameters, the verdict and ledger figures of
``suite.verdict_row``, timings, machine and commit, written by the process that ran it into the
results store (kvbench.bench.store), so nothing is copied back from a cluster. A cell whose id is
in the store is not run again: an interrupted sweep resumes where it stopped. An exception in a
cell is recorded (status ``ERROR``, its message in ``error``) and the sweep goes on.

Executors: ``local`` (a process pool over the machine's cores, optionally one core pinned per
worker) and ``ray`` (a Ray task per cell with its resources; each trace put once into the object
store). Progress: cells done / total, failures and ETA, as a tqdm bar on a terminal and as a plain
line every few seconds otherwise.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import datetime as _dt
import json
import multiprocessing as mp
import os
import pickle
import select
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

from kvbench.bench import records
from kvbench.bench.grid import Cell, Grid, check_cells, code_version, expand, known_settings
from kvbench.bench.store import Store
from kvbench import provenance
from kvbench.progress import Progress
from kvbench.quant.pool import pool_block_bytes
from kvbench.analyses import suite
from kvbench.routing.route import routed_policy, routed_row
from kvbench.traces.format import Trace

# The status of a cell another sweep of the same grid into the same store ran (or is running).
ELSEWHERE = "another sweep"

# Columns of a record that depend on where and when it ran, not on what it ran.
RUN_COLUMNS = ("wall_s", "backend_ms", "ops_per_s", "started", "worker_pid", "worker_cores")
MACHINE_PREFIX = "machine_"

# --- one cell ------------------------------------------------------------------------------------


_MACHINE: dict = {}


def _machine() -> dict:
    """This process's machine, once (and again once a cell has imported torch: then the GPU is
    named too); torch is not imported for it, which would cost every worker a second or two."""
    key = "torch" in sys.modules
    if key not in _MACHINE:
        _MACHINE[key] = {MACHINE_PREFIX + k: v for k, v in provenance.machine_info().items()}
    return _MACHINE[key]


def run_cell(cell: Cell, trace: Trace, store: Store, commit: dict) -> dict:
    """Replay one cell, write its record into ``store``; a small summary for the progress.
    ``commit``: the driver's code_version(). A cell claimed by another sweep, or stored by one
    since this sweep listed the store, is left to it (status ELSEWHERE)."""
    if not store.claim(cell.sweep, cell.backend, cell.id):
        return {"id": cell.id, "status": ELSEWHERE, "wall_s": 0.0, "error": ""}
    try:
        if store.status(cell.sweep, cell.backend, cell.id) not in (None, "ERROR"):  # ERROR: a retry
            return {"id": cell.id, "status": ELSEWHERE, "wall_s": 0.0, "error": ""}
        return _run_claimed(cell, trace, store, commit)
    finally:
        store.release(cell.sweep, cell.backend, cell.id)


def _run_claimed(cell: Cell, trace: Trace, store: Store, commit: dict) -> dict:
    where = known_settings()
    kwargs = {k: (None if k == "policy" and v == "none" else v) for k, v in cell.settings.items()}
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")
    t0 = time.perf_counter()
    cfg = None
    try:
        cfg = suite.config_for(trace, **{k: v for k, v in kwargs.items() if where[k] == "config"})
        if routed_policy(cell.backend) is not None:  # the trace routed over replicas
            row = routed_row(trace, cfg, cell.backend, kwargs.get("replicas", 1))
        else:
            row = suite.run_one(trace, cell.backend, cfg,
                                **{k: v for k, v in kwargs.items() if where[k] == "run"})
        error = ""
    except Exception as e:  # recorded; the sweep goes on
        frame = traceback.extract_tb(e.__traceback__)[-1]
        row = {"status": "ERROR"}
        error = f"{type(e).__name__}: {e} ({Path(frame.filename).name}:{frame.lineno})"
    wall = time.perf_counter() - t0
    rec = {k: v for k, v in row.items() if k != "series"}
    if "tenant_metrics" in rec:
        rec["tenant_metrics"] = json.dumps(rec["tenant_metrics"], default=records._default)
    rec.update(cell.columns())
    # The pool the cell ran, in both units (the grid's ``budget`` may be either).
    rec["budget_blocks"] = cfg.num_blocks if cfg else None
    rec["budget_bytes"] = cfg.num_blocks * pool_block_bytes(cfg) if cfg else None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    rec.update({"cell_id": cell.id, "parameters": ",".join(cell.columns()), "error": error,
                "code": cell.code, "commit": commit["commit"], "dirty": commit["dirty"], "wall_s": wall,
                "started": started, "worker_pid": os.getpid(), "worker_cores": ",".join(map(str, cores)),
                **_machine()})
    store.write_cell(cell.sweep, cell.backend, cell.id, rec)
    return {"id": cell.id, "status": rec["status"], "wall_s": wall, "error": error}


# --- progress ------------------------------------------------------------------------------------


class CellProgress(Progress):
    """Cells done / total with the FAIL, ERROR and lost counts beside them; a last line at close."""

    def __init__(self, name: str, total: int, done: int, *, stream=None, interval: float = 5.0,
                 tty: bool | None = None, enabled: bool = True):
        super().__init__(total, name, "cells", stream=stream, every=interval, done=done, tty=tty,
                         enabled=enabled)
        self.counts: Counter = Counter()

    @property
    def interval(self) -> float:  # how long the executors wait between ticks
        return self.every

    def failures(self) -> str:
        return ", ".join(f"{self.counts[k]} {k}" for k in ("FAIL", "ERROR", "lost") if self.counts[k]) or "no failures"

    def update(self, status: str) -> None:
        self.counts[status] += 1
        self.note(self.failures())
        super().update(1)

    def close(self) -> None:
        super().close()
        self.say(self.line())


def _stored_or_lost(store: Store, cell: Cell, why: str, lost: list, wait: float = 2.0) -> str:
    """The status of a cell whose task failed: the one stored if its worker wrote the cell before
    dying (a file a remote store may show a moment later), else "lost" (noted in ``lost``)."""
    deadline = time.monotonic() + wait
    while (status := store.status(cell.sweep, cell.backend, cell.id)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if status is None:
        lost.append((cell, why))
        return "lost"
    return status


# --- executors -----------------------------------------------------------------------------------


_TRACES: dict = {}


def _exit_with(driver: int) -> None:
    """End this process when the process ``driver`` ends, ``kill -9`` included. A pool worker's
    parent is the forkserver, which outlives a killed driver as long as a worker holds its pipe:
    so each worker watches the driver itself."""
    def watch():
        try:
            select.select([os.pidfd_open(driver)], [], [])
        except (AttributeError, OSError):  # no pidfd here (or the driver is gone already): poll
            while True:
                try:
                    os.kill(driver, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="kvbench-driver-watch", daemon=True).start()


def _init_worker(traces_file: str, counter, cores, driver: int) -> None:
    import pickle
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt stops
    _exit_with(driver)
    with open(traces_file, "rb") as f:
        _TRACES.update(pickle.load(f))
    if cores:
        with counter.get_lock():
            k = counter.value
            counter.value += 1
        os.sched_setaffinity(0, {cores[k % len(cores)]})


def _pool_cell(cell: Cell, store: Store, commit: dict) -> dict:
    return run_cell(cell, _TRACES[cell.trace_key], store, commit)


def run_local(cells, traces, store, commit, progress, *, workers: int | None = None,
              pin: bool = False) -> dict:
    """A process pool; ``pin``: each worker on a core of its own. Returns lost cells and whether
    the stop (Ctrl-C or SIGTERM) that interrupted the run, if one did."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    workers = workers or len(cores)
    # Workers fork from a server that imported kvbench once (spawn where there is no forkserver).
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
    else:
        ctx = mp.get_context("spawn")
    lost, interrupted = [], None
    # The traces go through a file: in the start arguments, a worker would be started only once
    # the one before had read them all.
    with tempfile.NamedTemporaryFile(prefix="kvbench-traces-", suffix=".pickle", delete=False) as tf:
        pickle.dump(traces, tf, protocol=pickle.HIGHEST_PROTOCOL)
    pool = cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                  initargs=(tf.name, ctx.Value("i", 0) if pin else None, cores if pin else None,
                                            os.getpid()))
    pending = {}

    def collect(finished) -> None:
        for f in finished:
            cell = pending.pop(f)
            try:
                progress.update(f.result()["status"])
            except Exception as e:  # the worker died (BrokenProcessPool): recorded, or lost
                progress.update(_stored_or_lost(store, cell, f"{type(e).__name__}: {e}", lost))
    try:
        pending = {pool.submit(_pool_cell, c, store, commit): c for c in cells}
        while pending:
            collect(cf.wait(pending, timeout=progress.interval, return_when=cf.FIRST_COMPLETED)[0])
            progress.tick()
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the command re-raises it, once reported
        interrupted = e
    finally:
        # Cells already running finish (and are recorded); queued ones are dropped.
        pool.shutdown(wait=True, cancel_futures=True)
        os.unlink(tf.name)
    collect([f for f in pending if f.done() and not f.cancelled()])
    return {"lost": lost, "interrupted": interrupted}


def run_ray(cells, traces, store, commit, progress, *, address: str | None = None,
            max_retries: int = 2, runtime_env: dict | None = None) -> dict:
    """One Ray task per cell, with the cell's resources; each trace put into the object store once.

    Uses the Ray session of the process when there is one, else connects to ``address``
    ('auto', 'HOST:PORT', 'ray://HOST:10001'), or starts a local Ray when ``address`` is None.
    """
    import ray
    owned = not ray.is_initialized()
    if owned:
        ray.init(address=address, runtime_env=runtime_env, logging_level="WARNING",
                 configure_logging=True)
    lost, interrupted = [], None
    task = ray.remote(run_cell)
    pending = {}
    try:
        refs = {key: ray.put(trace) for key, trace in traces.items()}
        for c in cells:
            res = {"num_cpus": 1, **c.resources}
            pending[task.options(max_retries=max_retries, **res).remote(c, refs[c.trace_key], store, commit)] = c
        while pending:
            finished, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(progress.interval, 1.0),
                                   fetch_local=True)
            for ref in finished:
                cell = pending.pop(ref)
                try:
                    progress.update(ray.get(ref)["status"])
                except ray.exceptions.RayError as e:  # its worker or node died: recorded, or lost
                    progress.update(_stored_or_lost(store, cell, f"{type(e).__name__}: "
                                                    f"{str(e).splitlines()[0]}", lost))
            progress.tick()
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the command re-raises it, once reported
        interrupted = e
        for ref in pending:
            ray.cancel(ref)
    finally:
        if owned:
            ray.shutdown()
    return {"lost": lost, "interrupted": interrupted}


def ship_code_env() -> dict:
    """A runtime_env that uploads this checkout to every worker of a cluster (--ship-code)."""
    return {"working_dir": str(records.REPO_ROOT),
            "excludes": [".venv", ".git", ".asv", "results", "*.egg-info", "__pycache__", ".hypothesis"]}


EXECUTORS = {"local": run_local, "ray": run_ray}


@dataclasses.dataclass
class SweepRun:
    grid: Grid
    cells: list
    skipped: int  # cells already in the store
    summary: Counter
    lost: list
    interrupted: BaseException | None  # the Ctrl-C or SIGTERM that stopped it
    wall_s: float


def run_sweep(grid: Grid, store: Store, *, executor: str = "local", retry_errors: bool = False,
              progress: dict | None = None, **options) -> SweepRun:
    """Run the cells of ``grid`` that ``store`` lacks on ``executor`` (its ``options``);
    ``progress``: options of :class:`CellProgress` (interval, enabled, stream, tty)."""
    commit = code_version()
    cells, traces = expand(grid, commit["code"])
    check_cells(grid, cells, traces)
    store.write_grid(grid.name, grid.text, {"cells": len(cells), "code": commit["code"]})
    store.remove_stale_temps(grid.name)  # what a sweep killed mid-write left
    done = store.done(grid.name)
    if retry_errors and done:
        stored = store.read(grid.name, columns=["cell_id", "status"])
        done -= set(stored.loc[stored.status == "ERROR", "cell_id"])
    todo = [c for c in cells if c.id not in done]
    progress = CellProgress(grid.name, len(cells), len(cells) - len(todo), **(progress or {}))
    progress.say(f"{grid.name}: {len(cells)} cells, {len(cells) - len(todo)} already in {store.url}, "
                 f"{len(todo)} to run ({executor})")
    used = {c.trace_key for c in todo}
    t0 = time.perf_counter()
    out = EXECUTORS[executor](todo, {k: v for k, v in traces.items() if k in used}, store, commit,
                              progress, **options)
    wall = time.perf_counter() - t0
    progress.close()
    return SweepRun(grid, cells, len(cells) - len(todo), progress.counts, out["lost"], out["interrupted"], wall)


__all__ = ["run_cell", "run_sweep", "run_local", "run_ray", "CellProgress", "SweepRun", "RUN_COLUMNS", "ELSEWHERE",
           "EXECUTORS", "ship_code_env"]
