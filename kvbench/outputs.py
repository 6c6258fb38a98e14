"""Writing outputs: every file goes to a temporary name beside it and is renamed into place once
complete, so an interrupted or failed run leaves no partial file; files that belong together (a
table's CSV, Markdown and chart) are renamed together, after all of them are written. Where an
output goes is checked before the work starts (``check_writable``), so a run does not find out at
its end that it cannot keep its results. Only a regular file or a new path is ever written or
renamed over (never a device such as ``/dev/null``, a FIFO or a socket); ``-`` means stdout.
"""
from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path, PurePosixPath


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would have given the file (mkstemp gives 0600)
STDOUT = "-"  # as an output file: standard output


def _special(path) -> str:
    """'' when ``path`` is absent, a regular file or a folder; else what it is: a rename would
    replace a device node, a FIFO or a symbolic link (``/dev/stdout``) with a file."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return ""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return ""
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


@contextlib.contextmanager
def stdout_for(path):
    """The stream a record written to ``path`` goes to when ``path`` is ``-``: the real stdout,
    with everything else the block prints sent to stderr (stdout holds the record alone)."""
    stream = sys.stdout
    if str(path) != STDOUT:
        yield stream
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield stream


def check_writable(path, *, option: str = "", folder: bool = False, stdout: bool = False) -> Path:
    """``path`` (a file, or a folder with ``folder``), its folder created and proven writable by
    creating a file in it; ValueError naming ``option`` and the reason otherwise. ``stdout``: the
    option takes ``-`` for standard output."""
    p = Path(path)
    where = f"{option}: {p}" if option else str(p)
    if stdout and str(path) == STDOUT:
        return p
    if _special(p) and not (folder and p.is_dir()):  # a link to a folder holds files
        raise ValueError(f"{where} is {_special(p)}: kvbench writes only regular files (give the "
                         f"file itself{', or - for stdout' if stdout else ''})")
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

    A path that is a device, FIFO or socket is refused (ValueError) before anything is written;
    an I/O error that names no file (a full disk) is raised again naming ``paths``.
    """
    finals = [Path(p) for p in paths]
    for p in finals:
        if _special(p):
            raise ValueError(f"{p} is {_special(p)}: kvbench writes only regular files")
    temps = []
    try:
        for p in finals:
            temps.append(_temporary(p))
        yield temps
        for tmp, final in zip(temps, finals):
            os.replace(tmp, final)
    except OSError as e:
        if e.filename is not None or not e.strerror:
            raise
        raise OSError(e.errno, e.strerror, ", ".join(map(str, finals))) from e
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def write_text(path, text: str, stdout=None) -> Path:
    """Write ``text`` (UTF-8, ``\\n`` line ends) to ``path`` atomically; ``-``: to ``stdout``
    (default sys.stdout)."""
    if str(path) == STDOUT:
        (stdout or sys.stdout).write(text)
        return Path(path)
    with staged(path) as (tmp,):
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    return Path(path)


def write_bytes(path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with staged(path) as (tmp,):
        Path(tmp).write_bytes(data)
    return Path(path)


# matplotlib writes its own version into every PNG: left out, the same figure is the same bytes
# under any matplotlib, so drawing a committed chart again leaves it as it is.
PNG_METADATA = {"Software": None}


def save_figure(fig, path, **kwargs) -> Path:
    """``fig.savefig(path)`` atomically, with no metadata that changes between drawings."""
    with staged(path) as (tmp,):
        fig.savefig(tmp, **{"metadata": PNG_METADATA} if Path(path).suffix == ".png" else {}, **kwargs)
    return Path(path)


def figure_png(fig, **kwargs) -> bytes:
    """The PNG bytes of ``fig`` (for a store that is not a local folder), as ``save_figure``
    writes them."""
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata=PNG_METADATA, **kwargs)
    return buf.getvalue()


def name_problem(name) -> str:
    """Why ``name`` (read from a file: a sweep's, a chart's) cannot name a file below a folder
    ('' when it can): empty, absolute, or with a ``..`` segment that climbs out."""
    text = str(name)
    parts = PurePosixPath(text.replace("\\", "/")).parts
    if not text.strip() or "\0" in text:
        return "is empty" if not text.strip() else "holds a NUL byte"
    if text.startswith(("/", "\\")):
        return "is an absolute path"
    if ".." in parts:
        return "climbs out of its folder (a '..' segment)"
    return ""


def inside(folder, name, where: str = "") -> Path:
    """``folder / name`` for a ``name`` read from a file, proven to stay below ``folder``, links
    followed; ValueError naming ``where`` (the file and line it came from) otherwise."""
    at = f"{where}: " if where else ""
    why = name_problem(name)
    if why:
        raise ValueError(f"{at}the name {str(name)!r} {why}: give a plain name")
    base = Path(folder).resolve()
    path = Path(folder) / str(name)
    if not path.resolve().is_relative_to(base):
        raise ValueError(f"{at}the name {str(name)!r} leads outside {folder} "
                         f"(to {path.resolve()}, through a symbolic link)")
    return path
