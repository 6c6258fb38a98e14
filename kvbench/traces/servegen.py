"""ServeGen (Alibaba) per-client windows into a tenant mix of requests: each client's 600 s
windows of arrival rate, burstiness (CV) and arrival law, and its length distributions, drawn from
a seed; one tenant per client."""
from __future__ import annotations

import ast
import heapq
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvbench.traces.format import TraceError
from kvbench.traces.requests import (
    Request,
    _is_count,
    _number_col,
    _read_csv,
    interarrival_gaps,
)

SERVEGEN_WINDOW_S = 600.0  # each ServeGen trace row describes 600 s (or less, up to the next row)
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
