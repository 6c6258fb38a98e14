"""Stored results: every record names the machine, the commit, the backend, the workload and the
parameters it was measured with."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "results"


def commit_info(root: Path = REPO_ROOT) -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    sha = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": sha or "unknown", "dirty": dirty}


def machine_info(device: str | None = None, probe_torch: bool = True) -> dict:
    """This machine. ``probe_torch=False``: torch's version from its metadata, without importing
    torch (a second or two) to ask for CUDA, unless something imported it already."""
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    if not probe_torch and "torch" not in sys.modules:
        from importlib.metadata import PackageNotFoundError, version
        try:
            info["torch"] = version("torch")
        except PackageNotFoundError:
            info["torch"] = None
    else:
        try:
            import torch
            info["torch"] = torch.__version__
            if torch.cuda.is_available():
                info["cuda"] = torch.version.cuda
                info["gpu"] = torch.cuda.get_device_name(0)
        except ImportError:
            info["torch"] = None
    if device:
        info["device"] = device
    return info


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


def record(kind: str, rows: list, params: dict, device: str | None = None) -> dict:
    return {
        "kind": kind,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        **commit_info(),
        "params": params,
        "rows": rows,
    }


def write(rec: dict, path: str | Path | None = None) -> Path:
    """Write a record; by default under results/runs/ (kept out of git: scratch runs)."""
    if path is None:
        stamp = rec["created"].replace(":", "").replace("-", "")[:15]
        path = RESULTS_DIR / "runs" / f"{rec['kind']}-{stamp}-{rec['commit'][:8]}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1, default=_default) + "\n")
    return path


def read(path: str | Path) -> dict:
    with open(path) as f:
        rec = json.load(f)
    for key in ("kind", "machine", "commit", "rows"):
        if key not in rec:
            raise ValueError(f"{path}: not a kvbench result record (no {key!r})")
    return rec
