"""Stored results: every record names the machine, the commit, the backend, the workload and the
parameters it was measured with."""
from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

import numpy as np

from kvbench.outputs import write_text
from kvbench.provenance import commit_info, machine_info

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "results"


def _default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def record(kind: str, rows: list, params: dict, device: str | None = None, *,
           partial: str = "") -> dict:
    """A record of ``rows``; ``partial``: why it holds only some of the planned rows (an
    interrupt), kept in the record as ``"partial"``."""
    rec = {
        "kind": kind,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        **commit_info(),
        "params": params,
        "rows": rows,
    }
    if partial:
        rec["partial"] = partial
    return rec


def default_path(rec: dict) -> Path:
    """results/runs/KIND-TIME-PID-COMMIT.json: the time to the microsecond and the process id, so
    that two runs started together never get the same name."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%f")
    return RESULTS_DIR / "runs" / f"{rec['kind']}-{stamp}-{os.getpid()}-{rec['commit'][:8]}.json"


def write(rec: dict, path: str | Path | None = None, stdout=None) -> Path:
    """Write a record (under a temporary name, renamed when complete; ``-``: to ``stdout``); by
    default under results/runs/ (kept out of git: scratch runs)."""
    return write_text(path or default_path(rec), json.dumps(rec, indent=1, default=_default) + "\n",
                      stdout=stdout)


def read(path: str | Path) -> dict:
    """A result record, or a ValueError naming the file and what it is not."""
    try:
        with open(path, "rb") as f:
            rec = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a kvbench result record (not a JSON document: "
                         f"{getattr(e, 'msg', None) or e.reason}; a trace? compare takes the "
                         f"records `kvbench run` writes)") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: not a kvbench result record (a JSON {type(rec).__name__})")
    for key in ("kind", "machine", "commit", "rows"):
        if key not in rec:
            raise ValueError(f"{path}: not a kvbench result record (no {key!r})")
    if not isinstance(rec["rows"], list) or not all(isinstance(r, dict) for r in rec["rows"]):
        raise ValueError(f"{path}: not a kvbench result record ('rows' is not a list of objects)")
    return rec
