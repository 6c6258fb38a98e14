"""Loaders of real public request traces into kvbench's request model (SPEC section 6).

Each loader turns one public format into a list of :class:`Request`, sorted by arrival:

============  =======================================================  ==============================
format        file                                                     arrival (seconds)
============  =======================================================  ==============================
``azure``     Azure LLM inference trace CSV                            since the first request
              (``TIMESTAMP, ContextTokens, GeneratedTokens``)
``vidur``     vidur CSV (``arrived_at, num_prefill_tokens,             as the file says
              num_decode_tokens``)
``lengths``   length-only CSV (``num_prefill_tokens,                   drawn from a law and a seed,
              num_decode_tokens, ...``)                                first request at 0
``mooncake``  Mooncake JSONL (``timestamp`` ms, ``input_length``,      as the file says (ms / 1000)
              ``output_length``, ``hash_ids``)
``servegen``  ServeGen per-client windows (``*-trace.csv`` and         since ``start``, generated
              ``*-dataset.json``), one tenant per client               from a seed
============  =======================================================  ==============================

Every loader refuses a bad row with :class:`kvbench.traces.format.TraceError` naming the file, the line
and the reason. Blank lines (trailing or not) are skipped, a last line without a newline is read,
an output of 0 tokens is allowed; a prompt needs at least one token (a prefill of 0 tokens is not
an operation, see ``kvbench.traces.format``).
"""
from __future__ import annotations

import ast
import csv
import heapq
import json
import math
import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from kvbench.contract.formulas import blocks_needed
from kvbench.traces.format import TraceError

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake traces
SERVEGEN_WINDOW_S = 600.0  # each ServeGen trace row describes 600 s (or less, up to the next row)


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
    with open(path, encoding="utf-8-sig", newline="") as f:
        text = f.read()
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


# --- Azure, vidur, lengths -----------------------------------------------------------------------

def load_azure(path, tenant: str = "azure") -> list[Request]:
    """Azure LLM inference trace CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``.

    Timestamps are ISO 8601 with or without a fraction (the 2023 files carry 7 digits, parsed to
    the nanosecond; digits past 9 are dropped) and with or without a UTC offset (``+00:00``,
    ``Z``); a timestamp without an offset is taken as UTC. Arrival = seconds since the first row.
    """
    path = str(path)
    frame, linenos, errors = _read_csv(path, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
    raw = frame["TIMESTAMP"].str.strip()
    stamps = pd.to_datetime(raw, format="ISO8601", utc=True, errors="coerce").dt.as_unit("ns")
    bad = stamps.isna().to_numpy()
    errors.note(bad, lambda i: f"TIMESTAMP {raw.iat[i]!r} is not an ISO 8601 date-time")
    ns = stamps.to_numpy(dtype="datetime64[ns]").view(np.int64)
    first = ns[np.argmax(~bad)] if not bad.all() else 0
    arrival = np.where(bad, np.nan, (ns - first) / 1e9)  # integer ns first: no float cancellation
    _note_backwards(arrival, linenos, "TIMESTAMP", errors)
    prompt = _counts(frame, "ContextTokens", errors, 1)
    output = _counts(frame, "GeneratedTokens", errors, 0)
    errors.raise_first()
    return _requests(arrival, prompt, output, tenant)


def load_vidur(path, tenant: str = "vidur") -> list[Request]:
    """vidur trace CSV: ``arrived_at`` (seconds, kept as in the file), ``num_prefill_tokens``,
    ``num_decode_tokens``."""
    path = str(path)
    frame, linenos, errors = _read_csv(path, ["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
    arrival = _number_col(frame, "arrived_at", errors, minimum=0)
    _note_backwards(arrival, linenos, "arrived_at", errors)
    prompt = _counts(frame, "num_prefill_tokens", errors, 1)
    output = _counts(frame, "num_decode_tokens", errors, 0)
    errors.raise_first()
    return _requests(arrival, prompt, output, tenant)


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


def load_lengths(path, rate: float = 1.0, law: str = "poisson", cv: float | None = None,
                 seed: int = 0, max_requests: int | None = None, tenant: str = "lengths") -> list[Request]:
    """Length-only CSV (``num_prefill_tokens, num_decode_tokens[, num_total_tokens, pd_ratio]``).

    Rows keep the file's order (the first ``max_requests`` of them). Arrivals follow a renewal
    process at ``rate`` requests/s: ``law="poisson"`` (exponential gaps) or ``law="gamma"`` with
    coefficient of variation ``cv``; the first request arrives at 0. Same file and seed, same list.
    ``num_total_tokens``, where present, must equal prefill + decode.
    """
    path = str(path)
    law = law.lower()
    if law == "gamma":
        if cv is None or not cv > 0:
            raise ValueError(f"law 'gamma' needs a positive cv, got {cv!r}")
        shape = 1.0 / cv ** 2
    elif law == "poisson":
        if cv is not None and cv != 1:
            raise ValueError(f"a Poisson process has cv 1; use law='gamma' for cv={cv}")
        shape = None
    else:
        raise ValueError(f"unknown arrival law {law!r} for lengths (known: poisson, gamma)")
    frame, linenos, errors = _read_csv(path, ["num_prefill_tokens", "num_decode_tokens"])
    prompt = _counts(frame, "num_prefill_tokens", errors, 1)
    output = _counts(frame, "num_decode_tokens", errors, 0)
    if "num_total_tokens" in frame:
        total = _counts(frame, "num_total_tokens", errors, 0)
        errors.note(total != prompt + output,
                    lambda i: f"num_total_tokens = {total[i]:.0f} is not num_prefill_tokens + "
                              f"num_decode_tokens = {prompt[i]:.0f} + {output[i]:.0f}")
    errors.raise_first()
    if max_requests is not None:
        prompt, output = prompt[:max_requests], output[:max_requests]
    gaps = interarrival_gaps(np.random.default_rng(seed), len(prompt), rate, law, shape)
    arrival = np.cumsum(gaps) - (gaps[0] if len(gaps) else 0.0)
    return _requests(arrival, prompt, output, tenant)


# --- Mooncake: prefix block hashes ---------------------------------------------------------------

def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def load_mooncake(path, tenant: str = "mooncake", block_size: int | None = None,
                  source_block_size: int = MOONCAKE_BLOCK_SIZE) -> list[Request]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

    Each hash id names a ``source_block_size``-token block with its whole prefix, one per block
    including a partial last one: ``len(hash_ids) == ceil(input_length / 512)`` is checked.
    Arrival = timestamp / 1000. ``block_hashes`` are the file's ids (``hash_block_size`` 512)
    unless ``block_size`` is given: then full blocks of that size (:func:`split_block_hashes`).
    """
    path = str(path)
    out: list[Request] = []
    prev_ms, prev_line = None, None
    for lineno, text in _numbered_lines(path):
        def fail(reason, _line=lineno):
            raise TraceError(reason, path, _line)
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"not valid JSON: {e.msg} (column {e.colno})")
        if not isinstance(rec, dict):
            fail(f"a request must be a JSON object, got {type(rec).__name__}")
        for key in ("timestamp", "input_length", "output_length", "hash_ids"):
            if key not in rec:
                fail(f"missing field {key!r}")
        ms = rec["timestamp"]
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            fail(f"timestamp must be a non-negative number of milliseconds, got {ms!r}")
        if prev_ms is not None and ms < prev_ms:
            fail(f"timestamp goes back in time (earlier than line {prev_line})")
        prompt, output, ids = rec["input_length"], rec["output_length"], rec["hash_ids"]
        if not _is_count(prompt) or prompt < 1:
            fail(f"input_length must be an integer >= 1, got {prompt!r}")
        if not _is_count(output) or output < 0:
            fail(f"output_length must be a non-negative integer, got {output!r}")
        if not isinstance(ids, list) or not all(_is_count(h) for h in ids):
            fail("hash_ids must be a list of integers")
        want = blocks_needed(prompt, source_block_size)
        if len(ids) != want:
            fail(f"hash_ids has {len(ids)} ids but input_length {prompt} needs "
                 f"ceil({prompt} / {source_block_size}) = {want}")
        hashes, size = tuple(ids), source_block_size
        if block_size is not None:
            hashes, size = split_block_hashes(ids, prompt, block_size, source_block_size), block_size
        out.append(Request(ms / 1000.0, prompt, output, tenant, hashes, size))
        prev_ms, prev_line = ms, lineno
    return out


def split_block_hashes(hash_ids: Sequence[int], input_length: int, block_size: int,
                       source_block_size: int = MOONCAKE_BLOCK_SIZE) -> tuple:
    """Map prefix hash ids of ``source_block_size`` blocks onto full blocks of ``block_size``.

    ``block_size`` must divide ``source_block_size``; each source id h becomes k = S / B ids
    ``h * k + j`` (j = 0..k-1), so equal source prefixes give equal sub-block ids and different
    ones never collide. Sub-blocks inside a block whose id differs stay distinct even where the
    real tokens might agree (the id does not say where the blocks part): a lower bound on sharing.
    Only the ``input_length // B`` full blocks are kept; a partial last block has no id.
    """
    if not (_is_count(block_size) and block_size > 0 and source_block_size % block_size == 0):
        raise ValueError(f"block_size {block_size!r} must be a positive divisor of {source_block_size}")
    k = source_block_size // block_size
    full = input_length // block_size
    if full > len(hash_ids) * k:
        raise ValueError(f"{len(hash_ids)} ids of {source_block_size} tokens cannot cover "
                         f"{input_length} tokens")
    ids = list(hash_ids[: blocks_needed(full, k)])
    small = all(abs(h) < 2 ** 62 // k for h in ids)  # int64 is exact here and much faster
    ids = np.asarray(ids, dtype=np.int64 if small else object).reshape(-1)
    sub = (ids[:, None] * k + np.arange(k)).ravel()[:full]
    return tuple(sub.tolist())


def rehash_requests(requests: Iterable[Request], block_size: int) -> list[Request]:
    """The same requests with ``block_hashes`` over full blocks of ``block_size`` tokens."""
    out = []
    for i, r in enumerate(requests):
        if r.block_hashes is None or r.hash_block_size is None:
            raise ValueError(f"request {i} has no block hashes to split")
        hashes = split_block_hashes(r.block_hashes, r.prompt_tokens, block_size, r.hash_block_size)
        out.append(replace(r, block_hashes=hashes, hash_block_size=block_size))
    return out


def prefix_hit_rate_unbounded(requests: Iterable[Request]) -> tuple[int, int, int, int]:
    """Hits of an infinite prefix cache: (block_hits, block_refs, token_hits, token_refs).

    Requests in list order; each block id referenced is a hit when an earlier reference named it.
    Block i of a request holds min(B, prompt - i * B) tokens; a token hit counts at most the tokens
    an earlier reference of that id held (a partial block may have been cached shorter).
    """
    ids, tokens = [], []
    for i, r in enumerate(requests):
        if r.block_hashes is None or not r.hash_block_size:
            raise ValueError(f"request {i} has no block hashes: its prefix sharing is unknown")
        size, n = r.hash_block_size, len(r.block_hashes)
        if n and r.prompt_tokens <= (n - 1) * size:
            raise ValueError(f"request {i}: {n} blocks of {size} tokens overrun its "
                             f"{r.prompt_tokens} prompt tokens")
        if n:
            ids += r.block_hashes
            tokens += [size] * (n - 1) + [min(size, r.prompt_tokens - (n - 1) * size)]
    if not ids:
        return 0, 0, 0, 0
    try:
        keys = np.array(ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):  # ids that are not machine integers
        keys = pd.factorize(np.array(ids, dtype=object))[0]
    size = np.asarray(tokens, dtype=np.int64)
    # Stable sort by id keeps each id's references in request order.
    order = np.argsort(keys, kind="stable")
    sorted_keys, sorted_size = keys[order], size[order]
    first = np.r_[True, sorted_keys[1:] != sorted_keys[:-1]]
    # Running max of tokens within each id's run: offset by the run index so runs do not mix.
    offset = (np.cumsum(first) - 1) * (int(sorted_size.max()) + 1)
    most = np.maximum.accumulate(offset + sorted_size) - offset
    earlier = np.r_[0, most[:-1]]  # the most tokens an earlier reference of the id held
    hit = ~first
    block_hits, block_refs = int(hit.sum()), len(size)
    token_hits = int(np.minimum(earlier, sorted_size)[hit].sum())
    token_refs = int(size.sum())
    return block_hits, block_refs, token_hits, token_refs


# --- ServeGen: per-client windows into a tenant mix ----------------------------------------------

SERVEGEN_COLUMNS = ["window_start", "rate", "cv", "law", "shape", "scale"]
SERVEGEN_LAWS = ("gamma", "weibull", "exponential")


@dataclass
class _ServegenClient:
    name: str
    trace_path: str
    dataset_path: str
    start: np.ndarray
    end: np.ndarray
    rate: np.ndarray
    law: list
    shape: np.ndarray
    linenos: np.ndarray
    _dataset: dict | None = None
    _pdfs: dict | None = None

    def pdf(self, window: int, field: str) -> tuple[np.ndarray, np.ndarray]:
        """The ``field`` PDF (values, probabilities) in force at trace window ``window``."""
        if self._dataset is None:
            with open(self.dataset_path, encoding="utf-8") as f:
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise TraceError(f"not valid JSON: {e.msg}", self.dataset_path, e.lineno) from None
            if not isinstance(data, dict):
                raise TraceError("must be an object keyed by window start", self.dataset_path, 1)
            try:  # float key -> (key as written, entry)
                self._dataset = {float(k): (k, v) for k, v in data.items()}
            except ValueError as e:
                raise TraceError(f"a key is not a window start in seconds: {e}",
                                 self.dataset_path, 1) from None
            self._pdfs = {}
        t = float(self.start[window])
        keys = [k for k in self._dataset if k <= t]
        trace_line = int(self.linenos[window])
        if not keys:
            raise TraceError(f"no length distribution in {self.dataset_path} covers the window "
                             f"starting at {t:g} s", self.trace_path, trace_line)
        key = max(keys)
        if (key, field) not in self._pdfs:
            self._pdfs[key, field] = self._parse_pdf(key, field, trace_line)
        return self._pdfs[key, field]

    def _parse_pdf(self, key: float, field: str, trace_line: int):
        def fail(reason):
            raise TraceError(f"window {key:g} {field}: {reason} (needed by {self.trace_path}:{trace_line})",
                             self.dataset_path, self._line_of(key, field))
        entry = self._dataset[key][1]
        if not isinstance(entry, dict) or field not in entry:
            fail("missing")
        text = entry[field]
        try:  # ServeGen stores PDFs as Python dict literals, '{224: 0.0003, ...}'
            pdf = ast.literal_eval(text) if isinstance(text, str) else text
        except (ValueError, SyntaxError):
            fail("not a {tokens: probability} dict")
        if not isinstance(pdf, dict) or not pdf:
            fail("empty PDF")
        values = np.array(list(pdf.keys()), dtype=object)
        probs = np.array(list(pdf.values()), dtype=float)
        if not all(_is_count(v) and v >= 0 for v in values):
            fail("token counts must be non-negative integers")
        if field == "input_tokens" and any(v == 0 and p > 0 for v, p in zip(values, probs)):
            fail("puts mass on prompts of 0 tokens")
        if not (np.isfinite(probs).all() and (probs >= 0).all() and probs.sum() > 0):
            fail("probabilities must be non-negative with a positive sum")
        return values.astype(np.int64), probs / probs.sum()

    def _line_of(self, key: float, field: str) -> int:
        """The line of ``field`` inside window ``key`` of the dataset file (1 if not found)."""
        with open(self.dataset_path, encoding="utf-8") as f:
            text = f.read()
        at = text.find(f'"{self._dataset[key][0]}"')
        if at >= 0 and text.find(f'"{field}"', at) >= 0:
            at = text.find(f'"{field}"', at)
        return text.count("\n", 0, at) + 1 if at >= 0 else 1


def _servegen_files(path: str) -> list[tuple[str, str, str]]:
    """(client name, trace csv, dataset json) for a directory or one ``*-trace.csv``."""
    p = Path(path)
    if not p.exists():
        raise TraceError("no ServeGen trace here: no such file or directory", str(p))
    traces = sorted(p.glob("*-trace.csv")) if p.is_dir() else [p]
    if not traces:
        raise TraceError("no ServeGen '*-trace.csv' files", str(p))
    out = []
    for t in traces:
        if not t.name.endswith("-trace.csv"):
            raise TraceError("a ServeGen trace file is named '<client>-trace.csv'", str(t))
        name = t.name[: -len("-trace.csv")]
        dataset = t.with_name(f"{name}-dataset.json")
        if not dataset.is_file():
            raise TraceError(f"its length distributions {dataset.name} are missing", str(t))
        out.append((name, str(t), str(dataset)))
    return out


def _read_servegen_trace(name: str, trace_path: str, dataset_path: str) -> _ServegenClient:
    frame, linenos, errors = _read_csv(trace_path, SERVEGEN_COLUMNS, names=SERVEGEN_COLUMNS)
    start = _number_col(frame, "window_start", errors, minimum=0)
    rate = _number_col(frame, "rate", errors, minimum=0)
    shape = _number_col(frame, "shape", errors)
    law = frame["law"].str.strip().str.lower()
    active = rate > 0
    errors.note(active & ~law.isin(SERVEGEN_LAWS).to_numpy(),
                lambda i: f"arrival law {frame['law'].iat[i]!r} is not known "
                          "(known: Gamma, Weibull, Exponential)")
    errors.note(active & law.isin(["gamma", "weibull"]).to_numpy() & ~(shape > 0),
                lambda i: f"shape = {frame['shape'].iat[i]!r} must be positive for law {frame['law'].iat[i]}")
    with np.errstate(invalid="ignore"):
        ahead = np.zeros(len(start), dtype=bool)
        ahead[1:] = start[1:] <= start[:-1]
    errors.note(ahead, lambda i: f"window_start does not increase "
                                 f"(line {linenos[i - 1]} starts at {start[i - 1]:g})")
    errors.raise_first()
    end = np.minimum(start + SERVEGEN_WINDOW_S, np.append(start[1:], math.inf))
    return _ServegenClient(name, trace_path, dataset_path, start, end, rate, law.tolist(), shape, linenos)


def _servegen_window(client: _ServegenClient, w: int, seed: int):
    """Arrivals (absolute seconds), prompt and output tokens of one client's window ``w``."""
    # One generator per (seed, client, window): any cap or start picks the same requests.
    rng = np.random.default_rng([seed, zlib.crc32(client.name.encode()), int(round(client.start[w] * 1000))])
    t0, t1, rate = float(client.start[w]), float(client.end[w]), float(client.rate[w])
    batch = max(16, int(2 * rate * (t1 - t0)))
    times, last = [], t0
    while last < t1:
        gaps = interarrival_gaps(rng, batch, rate, client.law[w], client.shape[w])
        chunk = last + np.cumsum(gaps)
        times.append(chunk[chunk < t1])
        last = chunk[-1]
    arrival = np.concatenate(times)
    n = len(arrival)
    in_values, in_probs = client.pdf(w, "input_tokens")
    out_values, out_probs = client.pdf(w, "output_tokens")
    prompt = rng.choice(in_values, size=n, p=in_probs)  # the PDFs are marginals: drawn independently
    output = rng.choice(out_values, size=n, p=out_probs)
    return arrival, prompt, output


def load_servegen(path, seed: int = 0, start: float = 0.0, duration: float | None = None,
                  max_requests: int | None = None) -> list[Request]:
    """A tenant mix from ServeGen per-client distributions: one tenant per client.

    ``path`` is a directory of ``<client>-trace.csv`` / ``<client>-dataset.json`` pairs or one
    trace file. Each trace row is a window (start s, rate req/s, CV, law, shape, scale). In each
    window with rate > 0, arrivals are a renewal process of the row's law with its fitted shape,
    its scale set so the mean gap is 1 / rate (the fitted scale is ignored: ServeGen's Weibull fits
    do not match the window's rate). Lengths are drawn from the dataset's input and output PDFs
    of the latest dataset window at or before the trace window. Arrival = seconds since
    ``start``; requests in [start, start + duration), the first ``max_requests`` of them.
    A window's requests depend only on (seed, client, window), so caps select, never reshuffle.
    """
    clients = [_read_servegen_trace(*files) for files in _servegen_files(str(path))]
    stop = math.inf if duration is None else start + duration
    windows = sorted((float(c.start[w]), ci, w) for ci, c in enumerate(clients)
                     for w in range(len(c.start))
                     if c.rate[w] > 0 and c.end[w] > start and c.start[w] < stop)
    found: list[tuple[float, str, int, int]] = []
    pending: list[float] = []  # heap of arrivals not yet known to be among the first ones
    final = 0
    for k, (t0, ci, w) in enumerate(windows):
        client = clients[ci]
        arrival, prompt, output = _servegen_window(client, w, seed)
        keep = (arrival >= start) & (arrival < stop)
        found += zip(arrival[keep].tolist(), [client.name] * int(keep.sum()),
                     prompt[keep].tolist(), output[keep].tolist())
        if max_requests is not None:
            # Windows come in start order: arrivals before the next window's start are final.
            for a in arrival[keep].tolist():
                heapq.heappush(pending, a)
            horizon = windows[k + 1][0] if k + 1 < len(windows) else math.inf
            while pending and pending[0] < horizon:
                heapq.heappop(pending)
                final += 1
            if final >= max_requests:
                break
    found.sort()
    if max_requests is not None:
        found = found[:max_requests]
    return [Request(a - start, p, o, name) for a, name, p, o in found]


# --- dispatcher ------------------------------------------------------------------------------------

LOADERS: dict[str, Callable[..., list[Request]]] = {
    "azure": load_azure,
    "vidur": load_vidur,
    "lengths": load_lengths,
    "mooncake": load_mooncake,
    "servegen": load_servegen,
}


def load_requests(path, format: str, **opts) -> list[Request]:
    """Load a public trace: ``format`` is one of :data:`LOADERS`; ``opts`` go to its loader."""
    try:
        loader = LOADERS[format]
    except KeyError:
        raise ValueError(f"unknown trace format {format!r}; known: {', '.join(LOADERS)}") from None
    return loader(os.fspath(path), **opts)


__all__ = [
    "Request", "load_requests", "load_azure", "load_vidur", "load_lengths", "load_mooncake",
    "load_servegen", "split_block_hashes", "rehash_requests", "prefix_hit_rate_unbounded",
    "interarrival_gaps", "LOADERS", "MOONCAKE_BLOCK_SIZE",
]
