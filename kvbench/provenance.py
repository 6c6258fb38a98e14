"""Where and when a figure was measured: the commit of the checkout and this machine. Shared by the
result records and every chart's provenance line."""
from __future__ import annotations

import importlib.metadata
import datetime as _dt
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]


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


def commit_date(root: Path = REPO_ROOT) -> str:
    """The committer date of HEAD (ISO 8601, UTC), or '' outside a git checkout."""
    try:
        out = subprocess.run(["git", "show", "-s", "--format=%cI", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    if not out:
        return ""
    return _dt.datetime.fromisoformat(out).astimezone(_dt.timezone.utc).isoformat(timespec="seconds")


def machine_info(device: str | None = None) -> dict:
    """This machine. torch is never imported here (a second or two): its version comes from its
    metadata unless a torch backend already imported it."""
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    # torch costs seconds to import: its GPU is named only when a torch backend ran (imported it).
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["cuda"] = torch.version.cuda
            info["gpu"] = torch.cuda.get_device_name(0)
    else:
        try:
            info["torch"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            info["torch"] = None
    if device:
        info["device"] = device
    return info


def peak_rss_mb() -> float:
    """This process's peak resident set, in MiB: VmHWM, the high-water mark of its own address
    space, where Linux has it. Not ``ru_maxrss``: a process started by a large one (fork, then
    exec) reports its parent's resident set as its own peak there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
