"""Writing outputs: every file goes to a temporary name beside it and is renamed into place once
complete, so an interrupted or failed run leaves no partial file; files that belong together (a
table's CSV, Markdown and chart) are renamed together, after all of them are written. Where an
output goes is checked before the work starts (``check_writable``), so a run does not find out at
its end that it cannot keep its results.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would have given the file (mkstemp gives 0600)


def check_writable(path, *, option: str = "", folder: bool = False) -> Path:
    """``path`` (a file, or a folder with ``folder``), its folder created and proven writable by
    creating a file in it; ValueError naming ``option`` and the reason otherwise."""
    p = Path(path)
    where = f"{option}: {p}" if option else str(p)
    if not folder and p.is_dir():
        raise ValueError(f"{where} is a folder; give a file name")
    if folder and p.exists() and not p.is_dir():
        raise ValueError(f"{where} is a file; give a folder")
    target = p if folder else p.parent
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target, prefix=".kvbench-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{where} cannot be written ({e.strerror or e})") from None
    return p


def _temporary(path: Path) -> Path:
    """A new empty file beside ``path`` with the same suffix (matplotlib reads the format off it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".part{path.suffix}")
    os.close(fd)
    os.chmod(tmp, FILE_MODE)
    return Path(tmp)


@contextlib.contextmanager
def staged(*paths):
    """Temporary paths for ``paths``, renamed onto them when the block succeeds; removed, with
    nothing renamed, when it fails or is interrupted::

        with staged(csv_path, png_path) as (csv_tmp, png_tmp):
            table.to_csv(csv_tmp)
            fig.savefig(png_tmp)
    """
    finals = [Path(p) for p in paths]
    temps = []
    try:
        for p in finals:
            temps.append(_temporary(p))
        yield temps
        for tmp, final in zip(temps, finals):
            os.replace(tmp, final)
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def write_text(path, text: str) -> Path:
    """Write ``text`` (UTF-8, ``\\n`` line ends) to ``path`` atomically."""
    with staged(path) as (tmp,):
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    return Path(path)


def save_figure(fig, path, **kwargs) -> Path:
    """``fig.savefig(path)`` atomically."""
    with staged(path) as (tmp,):
        fig.savefig(tmp, **kwargs)
    return Path(path)
