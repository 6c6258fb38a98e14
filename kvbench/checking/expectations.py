"""The oracle's expected figures of a replay, stored on disk and reused by the next check of the
same trace under the same settings and the same oracle code.

What a check compares after each operation (the expected ledger, whole or for the sequences the
operation touched) and the series it keeps (the tenants' usage) depend only on the trace, the
settings the oracle is built from and the oracle's code, never on the backend. A check that
finds them stored reads them instead of settling the oracle's sums after every operation; the
oracle still steps (its tables give the K/V to read back, its victims the replay's calls).

Keys: the trace's content, the oracle's settings (configuration, layout, capabilities, tiers),
the check's mode, and the source of every module that decides the expectations
(:data:`ORACLE_MODULES`, held to the oracle's imports by a test) with NumPy's version. A stored
figure is never the only word: where a backend's figure differs from it, and at the end, the
check computes the oracle's own; if the two differ the file is removed and the check is run again
with the oracle computing every figure (kvbench.analyses.suite.run_one), which stores them anew.

Files are NumPy archives read without pickle: a cache directory holds data, never code. Each holds
a digest of its figures, verified on reading: a file whose content was altered is a miss (a
warning says so), computed anew and rewritten.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
import warnings
import zipfile
from array import array
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvbench.contract.ledger import LEDGER_FIELDS, QUANTITIES, Ledger
from kvbench.traces.format import op_to_dict

MAX_FIGURES = 1 << 24  # a replay with more (128 MiB of them) is not stored
FORMAT = 2  # of the files (2: with a digest): a change of layout makes every older file a miss
# The modules whose code decides the expected figures (tests/checking/test_expectations.py holds
# this list to the oracle's imports within kvbench).
ORACLE_MODULES = (
    "kvbench/__init__.py", "kvbench/checking/__init__.py", "kvbench/checking/checker.py",
    "kvbench/checking/driver.py", "kvbench/checking/expectations.py",
    "kvbench/checking/tier_replay.py", "kvbench/contract", "kvbench/model", "kvbench/quant",
    "kvbench/traces",
)
ROOT = Path(__file__).resolve().parents[2]
SCALARS = [f for f in LEDGER_FIELDS if not QUANTITIES[f].per_sequence and f != "group_blocks"]
PER_SEQ = [f for f in LEDGER_FIELDS if QUANTITIES[f].per_sequence]
FLOATS = {f for f in SCALARS if QUANTITIES[f].tolerance}  # the others are integers
RAGGED = 1 + 2 * len(PER_SEQ) + 2  # rows of integers an operation keeps: group_blocks, the
# per-sequence dicts' keys and values, the usage's tenants and blocks


class StaleExpectations(Exception):
    """A stored figure that the oracle, computed, does not give: the file is removed."""


class CacheWarning(UserWarning):
    """The expectations cache is off, or a stored file was not used: one line, the check goes on."""


def usable_dir(folder: Path) -> Path | None:
    """``folder`` when it can be created and written; else None, with one warning saying that the
    expectations cache is off and why (checks then compute every figure, as without the cache)."""
    folder = Path(folder)
    probe = folder / f".probe-{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        warnings.warn(f"expectations cache off: {folder} cannot be written "
                      f"({e.strerror or e}); set KVBENCH_CACHE to a folder that can be, or give "
                      f"--no-expectations-cache", CacheWarning, stacklevel=2)
        return None
    return folder


def payload_digest(arrays: dict) -> str:
    """A digest of a file's figures (every array but the digest itself, by name, dtype, shape)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        if name == "digest":
            continue
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def cache_dir() -> Path:
    """``$KVBENCH_CACHE/expectations``, else the user's cache folder's kvbench/expectations."""
    base = os.environ.get("KVBENCH_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvbench"
    return Path(base) / "expectations"


@lru_cache(maxsize=None)
def oracle_version() -> str:
    """A digest of the source of :data:`ORACLE_MODULES` and NumPy's version."""
    h = hashlib.sha256(np.__version__.encode())
    for name in ORACLE_MODULES:
        path = ROOT / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(str(f.relative_to(ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _canonical(x):
    """A JSON-able form of settings whose text does not depend on set order or hash seeds."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__type__": type(x).__qualname__,
                **{f.name: _canonical(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, dict):
        return sorted(([_canonical(k), _canonical(v)] for k, v in x.items()), key=repr)
    if isinstance(x, (set, frozenset)):
        return sorted((_canonical(v) for v in x), key=repr)
    if isinstance(x, (list, tuple)):
        return [_canonical(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def trace_digest(trace) -> str:
    """A digest of the trace's header and operations, as they are now (a trace changed in place
    gets another: it is never kept on the trace)."""
    h = hashlib.sha256(json.dumps(_canonical(trace.header.to_dict())).encode())
    for op in trace.ops:
        h.update(json.dumps(op_to_dict(op)).encode())
    return h.hexdigest()


def key(trace, oracle, gather: str) -> str:
    """The file name of a check's expectations: what they depend on, digested."""
    settings = [FORMAT, oracle_version(), trace_digest(trace), type(oracle).__qualname__,
                _canonical(oracle.config), oracle.layout, _canonical(oracle.caps),
                _canonical(trace.header.tiers), gather]
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:32]


class Recorder:
    """Collects a replay's expected ledgers and usages as they come, in flat arrays (8 bytes a
    figure); ``save`` writes them once the replay has gone through every operation. Past
    :data:`MAX_FIGURES` figures it stops collecting and stores nothing."""

    def __init__(self, path: Path):
        self.path = path
        self.ints, self.floats, self.flat, self.lengths = array("q"), array("d"), array("q"), array("q")
        self.none = bytearray()
        self.tenants: dict = {}  # name -> index
        self.ops = 0
        self.seconds = 0.0  # what computing them took: what a reuse saves
        self.failed = ""  # why nothing is stored

    def add(self, ledger: Ledger, usage: dict, seconds: float) -> None:
        self.seconds += seconds
        if self.failed:
            return
        try:
            for f in SCALARS:
                v = getattr(ledger, f)
                self.none.append(v is None)
                if f in FLOATS:
                    self.floats.append(0.0 if v is None else v)
                elif v is None or isinstance(v, (int, np.integer)) and not isinstance(v, bool):
                    self.ints.append(0 if v is None else v)
                else:
                    raise TypeError(f"{f} = {v!r} is not an integer")
            rows = [ledger.group_blocks]
            for f in PER_SEQ:
                d = getattr(ledger, f)
                rows += [list(d), list(d.values())]
            index = self.tenants
            rows += [[index.setdefault(t, len(index)) for t in usage], list(usage.values())]
            for r in rows:
                self.flat.extend(r)  # a float or a name raises TypeError
                self.lengths.append(len(r))
            if not all(isinstance(t, str) for t in usage):
                raise TypeError("a tenant that is not a name")
        except (TypeError, OverflowError) as e:
            self.failed = str(e)
            return
        self.ops += 1
        if len(self.flat) + len(self.ints) > MAX_FIGURES:
            self.failed = f"over {MAX_FIGURES} figures"
            self.ints = self.floats = self.flat = self.lengths = None

    def save(self) -> bool:
        """Write the file (atomically); False, writing nothing, when a figure was not one the
        format holds (a sequence id that is not an integer, say) or there were too many."""
        if self.failed:
            return False
        n = self.ops
        arrays = dict(
            seconds=np.array(self.seconds), tenants=np.array(list(self.tenants), dtype=str),
            none=np.frombuffer(bytes(self.none), np.uint8).astype(bool).reshape(n, len(SCALARS)),
            ints=np.frombuffer(self.ints, np.int64).reshape(n, len(SCALARS) - len(FLOATS)),
            floats=np.frombuffer(self.floats, np.float64).reshape(n, len(FLOATS)),
            flat=np.frombuffer(self.flat, np.int64),
            lengths=np.frombuffer(self.lengths, np.int64).reshape(n, RAGGED))
        arrays["digest"] = np.array(payload_digest(arrays))
        tmp = self.path.with_name(f"{self.path.stem}.{os.getpid()}.tmp.npz")
        try:  # a folder it cannot write leaves the check as it was, uncached
            self.path.parent.mkdir(parents=True, exist_ok=True)
            remove_orphans(self.path)
            np.savez(tmp, **arrays)
            os.replace(tmp, self.path)
        except OSError as e:
            self.failed = f"{self.path.parent}: {e}"
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return False
        return True


def remove_orphans(path: Path) -> None:
    """Remove the temporary files of ``path`` whose writer has ended without renaming them (a
    process killed mid-save): a live writer's, this process's included, are left alone."""
    for tmp in path.parent.glob(f"{path.stem}.*.tmp.npz"):
        pid = tmp.name[len(path.stem) + 1:-len(".tmp.npz")]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                tmp.unlink()
        except (PermissionError, OverflowError):
            pass  # another user's live process, or not a pid: not ours to remove


class Tape:
    """Stored expectations, read back as the Ledger and usage of each operation."""

    def __init__(self, path: Path, ops: int):
        t0 = time.perf_counter()
        self.path = path
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
        if "digest" not in data or str(data["digest"]) != payload_digest(data):
            raise ValueError(f"{path}: its figures do not match the digest stored with them "
                             f"(the file was altered or damaged)")
        if len(data["none"]) != ops:
            raise ValueError(f"{path}: {len(data['none'])} operations stored, the trace has {ops}")
        self.recorded_seconds = float(data["seconds"])
        self.none, self.ints, self.floats = (data[k].tolist() for k in ("none", "ints", "floats"))
        self.flat = data["flat"].tolist()
        lengths = data["lengths"]
        self.lengths = lengths.tolist()
        self.starts = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))[:-1]]).tolist()
        self.tenants = data["tenants"].tolist()
        self.seconds = time.perf_counter() - t0  # what reading them took

    def _rows(self, i: int) -> list:
        at, flat, out = self.starts[i], self.flat, []
        for n in self.lengths[i]:
            out.append(flat[at:at + n])
            at += n
        return out

    def ledger(self, i: int) -> Ledger:
        t0 = time.perf_counter()
        ints, floats, none = iter(self.ints[i]), iter(self.floats[i]), self.none[i]
        scalars = {f: next(floats if f in FLOATS else ints) for f in SCALARS}
        for f, gone in zip(SCALARS, none):
            if gone:
                scalars[f] = None
        groups, *per_seq = self._rows(i)[:1 + 2 * len(PER_SEQ)]
        led = Ledger(**scalars, group_blocks=tuple(groups),
                     **{f: dict(zip(per_seq[2 * k], per_seq[2 * k + 1])) for k, f in enumerate(PER_SEQ)})
        self.seconds += time.perf_counter() - t0
        return led

    def usage(self, i: int) -> dict:
        t0 = time.perf_counter()
        tenant, blocks = self._rows(i)[-2:]
        u = {self.tenants[j]: b for j, b in zip(tenant, blocks)}
        self.seconds += time.perf_counter() - t0
        return u

    def stale(self, what: str) -> StaleExpectations:
        """The file is removed: the next check computes its figures anew."""
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
        return StaleExpectations(f"the stored expectations {self.path} disagree with the oracle: "
                                 f"{what} (removed: the check is run again, computing them)")


def open_for(trace, oracle, gather: str, folder: Path | None):
    """(Tape, None) when the expectations of this check are stored in ``folder``, else
    (None, Recorder) to store them; (None, None) with no folder."""
    if folder is None:
        return None, None
    path = Path(folder) / f"{key(trace, oracle, gather)}.npz"
    if path.exists():
        try:
            return Tape(path, len(trace.ops)), None
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:  # unreadable, altered or of
            # another layout: computed and stored anew
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            warnings.warn(f"stored expectations not used: {e}: computing them anew",
                          CacheWarning, stacklevel=2)
    return None, Recorder(path)
