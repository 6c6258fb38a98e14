"""The results store of `kvbench sweep`: a Parquet dataset, one file per cell, partitioned by sweep
and backend (hive style, so pyarrow, pandas, DuckDB or Spark read it as it is)::

    STORE/sweep=<name>/_grid.toml                     the grid the sweep was run from
    STORE/sweep=<name>/backend=<name>/<cell id>.parquet

``STORE`` is a local folder or any fsspec URL (``s3://bucket/kv``, ``gs://...``, ``memory://...``)
that every worker of a cluster can reach: each worker writes its own cells there, so nothing has to
be copied back. A file is written under a hidden name and then moved into place, so a reader (or a
resumed sweep) never sees half a cell. A cell's file name is its id, a content hash of what it ran
(kvbench.bench.sweep): a cell whose file exists is done.
"""
from __future__ import annotations

import io
import json
import os
import uuid
from urllib.parse import quote, unquote

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from kvbench.bench import records

DEFAULT_STORE = records.RESULTS_DIR / "sweeps" / "store"
GRID_FILE = "_grid.toml"
INFO_FILE = "_sweep.json"
PARTITIONS = ("sweep", "backend")


def _filesystem(url: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, root path inside it): a local folder, or an fsspec URL."""
    if "://" not in url:
        return pafs.LocalFileSystem(), os.path.abspath(url)
    import fsspec
    fs, root = fsspec.core.url_to_fs(url)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), root.rstrip("/")


def _segment(key: str, value: str) -> str:
    return f"{key}={quote(str(value), safe='')}"


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

    # --- writing -------------------------------------------------------------------------------

    def write_cell(self, sweep: str, backend: str, cell_id: str, row: dict) -> str:
        """Write one cell's record (a flat dict; the partition columns are left to the path)."""
        folder = f"{self._sweep_dir(sweep)}/{_segment('backend', backend)}"
        self.fs.create_dir(folder, recursive=True)
        table = pa.Table.from_pylist([{k: v for k, v in row.items() if k not in PARTITIONS}])
        buf = io.BytesIO()
        pq.write_table(table, buf)
        path = f"{folder}/{cell_id}.parquet"
        tmp = f"{folder}/.{cell_id}.{uuid.uuid4().hex[:8]}.tmp"
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
        """A file beside the dataset (a chart): ``relative`` to the store's parent folder."""
        path = f"{self.root.rpartition('/')[0]}/{relative}"
        self.fs.create_dir(path.rpartition("/")[0], recursive=True)
        with self.fs.open_output_stream(path) as f:
            f.write(data)
        return path if "://" not in self.url else f"{self.url.rpartition('/')[0]}/{relative}"

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
        """Ids of the cells stored for ``sweep`` (file names only: nothing is read)."""
        return {p.rpartition("/")[2][:-len(".parquet")] for p in self._files(sweep)}

    def read(self, sweep: str, columns=None) -> pd.DataFrame:
        """Every cell of ``sweep`` as one frame (sweep and backend from the partition folders).

        Cells written by different commits may carry different columns: their schemas are
        unified (a column missing from a cell reads as null).
        """
        files = self._files(sweep)
        if not files:
            return pd.DataFrame()
        schema = pa.unify_schemas([pq.read_schema(f, filesystem=self.fs) for f in files],
                                  promote_options="permissive")
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


__all__ = ["Store", "DEFAULT_STORE"]
