"""The results store of `kvbench sweep`: a Parquet dataset, one file per cell, partitioned by sweep
and backend (hive style, so pyarrow, pandas, DuckDB or Spark read it as it is)::

    STORE/sweep=<name>/_grid.toml                     the grid the sweep was run from
    STORE/sweep=<name>/backend=<name>/<cell id>.parquet
    STORE/_charts/<name>/<chart>.png                  the charts drawn from its cells

``STORE`` is a local folder or any fsspec URL (``s3://bucket/kv``, ``gs://...``, ``memory://...``)
that every worker of a cluster can reach: each worker writes its own cells there, so nothing has to
be copied back. A file is written under a hidden name and then moved into place, so a reader (or a
resumed sweep) never sees half a cell. A cell's file name is its id, a content hash of what it ran
(kvbench.bench.sweep): a cell whose file is a readable Parquet file is done. A file that is not (a
truncated copy, a disk that filled up) is named in a warning, skipped by every reader and run again
by a resumed sweep, which writes the cell over it. A worker claims a cell before running it (a
hidden claim file beside it), so two sweeps of one grid into one store never run a cell twice.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import io
import json
import os
import socket
import uuid
import warnings
from urllib.parse import quote, unquote

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from kvbench.bench import records
from kvbench.outputs import inside, name_problem

DEFAULT_STORE = records.RESULTS_DIR / "sweeps" / "store"
GRID_FILE = "_grid.toml"
CHARTS_DIR = "_charts"  # STORE/_charts/<sweep>/<chart>.png: charts drawn from the cells
INFO_FILE = "_sweep.json"
PARTITIONS = ("sweep", "backend")

# The columns whose type a value alone does not fix (a trace file's cell has no seed; a grid may give
# a budget as 1024 or as "12GiB"): every cell stores them with these types, so that plain readers
# (pandas.read_parquet, DuckDB) see one schema. Sizes carry their unit in the name.
CELL_TYPES = {"seed": pa.int64(), "block_size": pa.int64(), "num_blocks": pa.int64(),
              "budget": pa.string(), "budget_blocks": pa.int64(), "budget_bytes": pa.int64(),
              "final_fragmentation": pa.float64(), "worker_pid": pa.int64(),
              "started": pa.timestamp("ms", tz="UTC")}


def cell_table(row: dict) -> pa.Table:
    """One cell's record as a one-row table, the columns of CELL_TYPES typed by it."""
    columns = {}
    for name, value in row.items():
        if name == "started" and isinstance(value, str):
            value = _dt.datetime.fromisoformat(value)
        elif name == "budget" and value is not None:
            value = str(value)
        columns[name] = pa.array([value], type=CELL_TYPES.get(name))
    return pa.table(columns)


def _filesystem(url: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, root path inside it): a local folder, or an fsspec URL."""
    if "://" not in url:
        return pafs.LocalFileSystem(), os.path.abspath(url)
    import fsspec
    fs, root = fsspec.core.url_to_fs(url)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), root.rstrip("/")


def _segment(key: str, value: str) -> str:
    return f"{key}={quote(str(value), safe='')}"


def _stale_claim(path: str) -> bool:
    """Whether a claim file was left by a process of this machine that no longer runs."""
    try:
        with open(path) as f:
            owner = json.load(f)
    except FileNotFoundError:
        return True
    except (OSError, ValueError):  # being written this instant
        return False
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, KeyError, ValueError):  # alive under another user, or an unreadable claim
        pass
    return False


class CorruptCell(UserWarning):
    """A cell file of the store that is not readable Parquet."""


class Store:
    """One results store; cheap to make, and picklable (a Ray task or a pool worker rebuilds it)."""

    def __init__(self, url=None):
        self.url = str(url if url is not None else DEFAULT_STORE)
        self.fs, self.root = _filesystem(self.url)

    def __reduce__(self):
        return Store, (self.url,)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _sweep_dir(self, sweep: str) -> str:
        return f"{self.root}/{_segment('sweep', sweep)}"

    def _files(self, sweep: str) -> list[str]:
        base = self._sweep_dir(sweep)
        if self.fs.get_file_info(base).type == pafs.FileType.NotFound:
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File
                      and i.base_name.endswith(".parquet") and not i.base_name.startswith((".", "_")))

    def _readable(self, sweep: str) -> dict:
        """The cell files of ``sweep`` whose Parquet footer reads, each with its schema (read
        from that footer); each other one is named in a warning (its cell counts as not done)."""
        good = {}
        for path in self._files(sweep):
            try:
                good[path] = pq.read_schema(path, filesystem=self.fs)
            except (OSError, pa.ArrowException) as e:
                warnings.warn(f"{path}: not a readable Parquet cell ({type(e).__name__}: {e}); "
                              f"skipped, and run again by the next `kvbench sweep` of {sweep!r}",
                              CorruptCell, stacklevel=3)
        return good

    def _cell_path(self, sweep: str, backend: str, cell_id: str, prefix: str = "", suffix: str = ".parquet") -> str:
        return f"{self._sweep_dir(sweep)}/{_segment('backend', backend)}/{prefix}{cell_id}{suffix}"

    def status(self, sweep: str, backend: str, cell_id: str) -> str | None:
        """The stored status of one cell; None when it is not stored (or not readable)."""
        try:
            return pq.read_table(self._cell_path(sweep, backend, cell_id), columns=["status"],
                                 filesystem=self.fs)["status"][0].as_py()
        except (OSError, pa.ArrowException, KeyError):
            return None

    # --- claims: two sweeps of one grid into one store never run a cell twice ------------------

    def claim(self, sweep: str, backend: str, cell_id: str) -> bool:
        """Take the claim on a cell before running it; False when another process holds it. A
        claim is a file created exclusively beside the cell; one left by a process of this machine
        that is gone is taken over. In a store at a URL (no exclusive create) every claim is taken."""
        if "://" in self.url:
            return True
        path = self._cell_path(sweep, backend, cell_id, ".", ".claim")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not _stale_claim(path):
                    return False
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
            return True
        return False

    def remove_stale_temps(self, sweep: str) -> list[str]:
        """Remove the temporary cell files (``.ID.XXXXXXXX.tmp``) a writer killed before its
        rename left (kill -9: no handler runs), each only while no live claim holds its cell, so a
        sweep of the same grid writing now keeps its own. Returns the paths removed."""
        if "://" in self.url or not os.path.isdir(self._sweep_dir(sweep)):
            return []
        removed = []
        for folder, _, names in os.walk(self._sweep_dir(sweep)):
            for name in names:
                if not (name.startswith(".") and name.endswith(".tmp")):
                    continue
                claim = os.path.join(folder, f".{name[1:].split('.')[0]}.claim")
                if os.path.exists(claim) and not _stale_claim(claim):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
                    removed.append(os.path.join(folder, name))
        return removed

    def release(self, sweep: str, backend: str, cell_id: str) -> None:
        if "://" not in self.url:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._cell_path(sweep, backend, cell_id, ".", ".claim"))

    # --- writing -------------------------------------------------------------------------------

    def write_cell(self, sweep: str, backend: str, cell_id: str, row: dict) -> str:
        """Write one cell's record (a flat dict; the partition columns are left to the path)."""
        folder = f"{self._sweep_dir(sweep)}/{_segment('backend', backend)}"
        self.fs.create_dir(folder, recursive=True)
        table = cell_table({k: v for k, v in row.items() if k not in PARTITIONS})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        path = self._cell_path(sweep, backend, cell_id)
        tmp = self._cell_path(sweep, backend, cell_id, ".", f".{uuid.uuid4().hex[:8]}.tmp")
        with self.fs.open_output_stream(tmp) as f:
            f.write(buf.getvalue())
        self.fs.move(tmp, path)
        return path

    def write_grid(self, sweep: str, text: str, info: dict) -> None:
        """The grid a sweep was last run from, and ``info`` about that run (its cell count)."""
        self.fs.create_dir(self._sweep_dir(sweep), recursive=True)
        for name, data in ((GRID_FILE, text), (INFO_FILE, json.dumps(info))):
            with self.fs.open_output_stream(f"{self._sweep_dir(sweep)}/{name}") as f:
                f.write(data.encode())

    def write_bytes(self, relative: str, data: bytes) -> str:
        """A file kept with the dataset (a chart), ``relative`` to ``STORE/_charts/``, where
        Parquet readers do not look (a leading ``_``); a ``relative`` that climbs out of it is
        refused (ValueError)."""
        why = name_problem(relative)
        if why:
            raise ValueError(f"{self.url}: the chart path {relative!r} {why}")
        if "://" not in self.url:
            path = str(inside(f"{self.root}/{CHARTS_DIR}", relative))
        else:
            path = f"{self.root}/{CHARTS_DIR}/{relative}"
        self.fs.create_dir(path.rpartition("/")[0], recursive=True)
        with self.fs.open_output_stream(path) as f:
            f.write(data)
        return path if "://" not in self.url else f"{self.url.rstrip('/')}/{CHARTS_DIR}/{relative}"

    # --- reading -------------------------------------------------------------------------------

    def sweeps(self) -> list[str]:
        if self.fs.get_file_info(self.root).type == pafs.FileType.NotFound:
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(self.root))
        return sorted(unquote(i.base_name.split("=", 1)[1]) for i in infos
                      if i.type == pafs.FileType.Directory and i.base_name.startswith("sweep="))

    def _text(self, sweep: str, name: str) -> str | None:
        path = f"{self._sweep_dir(sweep)}/{name}"
        if self.fs.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        with self.fs.open_input_stream(path) as f:
            return f.read().decode()

    def grid_text(self, sweep: str) -> str | None:
        return self._text(sweep, GRID_FILE)

    def info(self, sweep: str) -> dict:
        text = self._text(sweep, INFO_FILE)
        return json.loads(text) if text else {}

    def done(self, sweep: str) -> set[str]:
        """Ids of the cells stored for ``sweep`` (their files' footers read, nothing more)."""
        return {p.rpartition("/")[2][:-len(".parquet")] for p in self._readable(sweep)}

    def read(self, sweep: str, columns=None) -> pd.DataFrame:
        """Every cell of ``sweep`` as one frame (sweep and backend from the partition folders).

        Cells written by different commits may carry different columns: their schemas are
        unified (a column missing from a cell reads as null), the columns of CELL_TYPES read as
        those types (cells written before they were typed included).
        """
        schemas = self._readable(sweep)
        if not schemas:
            return pd.DataFrame()
        files = list(schemas)
        schema = pa.unify_schemas([pa.schema([pa.field(f.name, CELL_TYPES.get(f.name, f.type)) for f in one])
                                   for one in schemas.values()], promote_options="permissive")
        for name in PARTITIONS:
            schema = schema.append(pa.field(name, pa.string()))
        dataset = ds.dataset(files, schema=schema, format="parquet", filesystem=self.fs,
                             partitioning=ds.partitioning(pa.schema([(p, pa.string()) for p in PARTITIONS]),
                                                          flavor="hive"),
                             partition_base_dir=self.root)
        # Integers stay integers where some cells lack them (a trace file's cells have no seed).
        df = dataset.to_table(columns=columns).to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
        for name in PARTITIONS:
            if name in df.columns:
                df[name] = df[name].map(lambda v: unquote(v) if isinstance(v, str) else v)
        return df

    def cells(self, sweep: str, commit: str | None = None) -> tuple[pd.DataFrame, str]:
        """(cells, note): the cells of one code version of ``sweep``: ``commit`` (a prefix of it,
        or 'all' for every version), else the newest one run; the note says what was left out."""
        df = self.read(sweep)
        if df.empty:
            raise ValueError(f"no cells of sweep {sweep!r} in {self.url} "
                             f"(sweeps: {', '.join(self.sweeps()) or 'none'})")
        if commit == "all":
            return df, ""
        codes = df.groupby("code")["started"].max().sort_values()
        if commit:
            chosen = [c for c in codes.index if c.startswith(commit)]
            if not chosen:
                raise ValueError(f"{sweep}: no cells of commit {commit!r}; commits: "
                                 f"{', '.join(c[:12] for c in codes.index)}")
            return df[df["code"].isin(chosen)], ""
        note = (f"note: {len(codes)} code versions in {sweep}; showing the newest ({codes.index[-1][:12]}); "
                f"--commit PREFIX or --commit all for others") if len(codes) > 1 else ""
        return df[df["code"] == codes.index[-1]], note


__all__ = ["Store", "DEFAULT_STORE", "CorruptCell"]
