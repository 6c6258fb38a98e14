"""The request model of served workloads, and the line-numbered reading every loader shares:
a bad row is refused with :class:`kvbench.traces.format.TraceError` naming the file, the line and
the reason."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from kvbench.traces.format import TraceError
from kvbench.traces.inputs import open_input


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a served workload.

    ``block_hashes`` names the prompt's blocks of ``hash_block_size`` tokens, each id standing
    for the block together with its whole prefix (equal ids mean a shared prefix). Mooncake files
    hash every block including a partial last one; :func:`rehash_requests` keeps full blocks only.
    """

    arrival: float
    prompt_tokens: int
    output_tokens: int
    tenant: str = "default"
    block_hashes: tuple | None = None
    hash_block_size: int | None = None


# --- reading text files with line numbers --------------------------------------------------------

def _numbered_lines(path: str) -> list[tuple[int, str]]:
    """Non-blank lines with their 1-based line numbers (CRLF, BOM and a missing final newline ok)."""
    def fail(reason, line):
        raise TraceError(reason, path, line)
    with open_input(path, fail) as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceError(f"not UTF-8 text (byte 0x{data[e.start]:02x}): is this a {path.rsplit('.', 1)[-1]} "
                         f"trace?", path, data.count(b"\n", 0, e.start) + 1) from None
    lines = [(i, line) for i, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise TraceError("empty file", path, 1)
    return lines


class _FirstError:
    """Collects row problems from several column checks and raises the one on the earliest line."""

    def __init__(self, path: str, linenos: np.ndarray):
        self.path, self.linenos = path, linenos
        self.first: tuple[int, str] | None = None

    def note(self, bad: np.ndarray, reason: Callable[[int], str]) -> None:
        idx = np.flatnonzero(bad)
        if idx.size and (self.first is None or idx[0] < self.first[0]):
            self.first = (int(idx[0]), reason(int(idx[0])))

    def raise_first(self) -> None:
        if self.first is not None:
            row, reason = self.first
            raise TraceError(reason, self.path, int(self.linenos[row]))


def _read_csv(path: str, required: Sequence[str], names: Sequence[str] | None = None):
    """Read a CSV as strings: (frame, line number of each row, error collector).

    With ``names`` the file has no header line and must have exactly those columns.
    """
    lines = _numbered_lines(path)
    rows = list(csv.reader(text for _, text in lines))
    linenos = np.array([n for n, _ in lines])
    if names is None:
        header = [h.strip() for h in rows[0]]
        header_line = lines[0][0]
        rows, linenos = rows[1:], linenos[1:]
        for col in required:
            if col not in header:
                raise TraceError(f"missing column {col!r} (the header has {header})", path, header_line)
        dup = sorted({h for h in header if header.count(h) > 1})
        if dup:
            raise TraceError(f"duplicate column {dup[0]!r}", path, header_line)
    else:
        header = list(names)
    for row, lineno in zip(rows, linenos):
        if len(row) != len(header):
            raise TraceError(f"expected {len(header)} fields ({', '.join(header)}), got {len(row)}",
                             path, int(lineno))
    if not rows:
        raise TraceError("no requests: the file has a header only", path, int(lines[-1][0]))
    frame = pd.DataFrame(rows, columns=header, dtype=str)
    return frame, linenos, _FirstError(path, linenos)


def _number_col(frame: pd.DataFrame, col: str, errors: _FirstError, minimum: float | None = None,
                integer: bool = False) -> np.ndarray:
    """A numeric column; bad rows are noted in ``errors`` (values there are NaN or garbage)."""
    raw = frame[col].str.strip()
    num = pd.to_numeric(raw, errors="coerce").to_numpy(dtype=float)
    with np.errstate(invalid="ignore"):
        missing = (raw == "").to_numpy()
        errors.note(missing, lambda i: f"{col} is empty")
        errors.note(np.isnan(num) & ~missing, lambda i: f"{col} = {raw.iat[i]!r} is not a number")
        errors.note(np.isinf(num), lambda i: f"{col} = {raw.iat[i]!r} is not finite")
        if integer:
            errors.note(np.isfinite(num) & (num != np.floor(num)),
                        lambda i: f"{col} = {raw.iat[i]!r} is not an integer count")
        if minimum is not None:
            what = "negative" if minimum == 0 else f"below {minimum:g}"
            errors.note(num < minimum, lambda i: f"{col} = {raw.iat[i]!r} is {what}")
    return num


def _counts(frame, col, errors, minimum) -> np.ndarray:
    num = _number_col(frame, col, errors, minimum=minimum, integer=True)
    with np.errstate(invalid="ignore"):  # past 2**53 a float no longer holds every integer
        errors.note(np.isfinite(num) & (num >= 2.0 ** 53), lambda i: f"{col} = {num[i]:g} is too large")
    return num


def _note_backwards(arrival: np.ndarray, linenos: np.ndarray, col: str, errors: _FirstError) -> None:
    """Arrivals must not go back in time: a shuffled file is more likely broken than meant."""
    with np.errstate(invalid="ignore"):
        back = np.zeros(len(arrival), dtype=bool)
        back[1:] = arrival[1:] < arrival[:-1]
    errors.note(back, lambda i: f"{col} goes back in time (earlier than line {linenos[i - 1]})")


def _requests(arrival, prompt, output, tenant: str) -> list[Request]:
    prompt, output = np.asarray(prompt, dtype=np.int64).tolist(), np.asarray(output, dtype=np.int64).tolist()
    arrival = np.asarray(arrival, dtype=float).tolist()
    return [Request(a, p, o, tenant) for a, p, o in zip(arrival, prompt, output)]


def interarrival_gaps(rng: np.random.Generator, n: int, rate: float, law: str = "poisson",
                      shape: float | None = None) -> np.ndarray:
    """``n`` gaps between arrivals with mean ``1 / rate`` seconds.

    ``poisson``: exponential gaps. ``gamma``: shape k (CV = 1 / sqrt(k)). ``weibull``: shape k.
    The scale is set from the rate, so the law's shape carries the burstiness and the rate is kept.
    """
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    law = law.lower()
    if law in ("poisson", "exponential"):
        return rng.exponential(1.0 / rate, size=n)
    if shape is None or not (shape > 0 and math.isfinite(shape)):
        raise ValueError(f"law {law!r} needs a positive shape, got {shape!r}")
    if law == "gamma":
        return rng.gamma(shape, 1.0 / (rate * shape), size=n)
    if law == "weibull":
        return rng.weibull(shape, size=n) / (rate * math.gamma(1.0 + 1.0 / shape))
    raise ValueError(f"unknown arrival law {law!r} (known: poisson, gamma, weibull)")


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
