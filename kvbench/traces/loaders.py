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

:func:`load_trace` is the one way to read a trace file of any supported format: kvbench's own
(``kvbench``: JSONL or CSV operations, :mod:`kvbench.traces.format`) as it is, a public one through
its loader here, its requests replayed one after another (:func:`requests_trace`).

Every loader refuses a bad row with :class:`kvbench.traces.format.TraceError` naming the file, the line
and the reason. Blank lines (trailing or not) are skipped, a last line without a newline is read,
an output of 0 tokens is allowed; a public request's prompt needs at least one token (kvbench's
own format takes a prefill of 0 tokens, an edge a fuzz campaign writes; a logged request of none
is a malformed row).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from kvbench.contract.formulas import blocks_needed
from kvbench.traces.format import Header, Trace, TraceError, load
from kvbench.traces.ops import Append, Free, Prefill
from kvbench.traces.requests import (
    Request,
    _counts,
    _is_count,
    _note_backwards,
    _number_col,
    _numbered_lines,
    _read_csv,
    _requests,
    interarrival_gaps,
)
from kvbench.traces.servegen import load_servegen

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake traces


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
    position = {}  # hash id -> (its block index, the line that first gave it)
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
        for i, h in enumerate(ids):  # an id names its block's whole prefix, so one position
            at, first = position.setdefault(h, (i, lineno))
            if at != i:
                fail(f"hash id {h} names block {i} here but block {at} on line {first}: an id "
                     f"names a block with its whole prefix, so it stands at one position")
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


NATIVE = "kvbench"  # kvbench's own JSONL / CSV of operations
DEFAULT_BLOCK_SIZE = 16  # a request trace's block hashes are cut at this size unless told


def trace_formats() -> list[str]:
    """Every format :func:`load_trace` reads: kvbench's own, then each public loader."""
    return [NATIVE, *LOADERS]


def request_options(format: str, *, block_size: int | None = None, seed: int = 0,
                    rate: float = 1.0, max_requests: int | None = None) -> dict:
    """The options of ``format``'s loader among those a command line gives: arrivals drawn for
    ``lengths`` (rate, seed), clients drawn for ``servegen`` (seed), hashes cut at
    ``block_size`` for ``mooncake``."""
    if format == "lengths":
        return {"rate": rate, "seed": seed, "max_requests": max_requests}
    if format == "servegen":
        return {"seed": seed, "max_requests": max_requests}
    if format == "mooncake":
        return {"block_size": block_size or DEFAULT_BLOCK_SIZE}
    return {}


def requests_trace(requests: Sequence[Request], block_size: int, *, name: str = "requests",
                   source: dict | None = None) -> Trace:
    """Requests as operations, one after another in arrival order: each prompt prefilled (with
    its full blocks' hashes at ``block_size`` where the trace names them), its output appended
    in one step, then freed; the cache keeps what a freed request cached, so a later request
    with the same prefix hits it (SPEC §6's request model, replayed without a scheduler)."""
    ops = []
    hashed = any(r.block_hashes is not None for r in requests)
    for i, r in enumerate(requests):
        hashes = None
        if r.block_hashes is not None and r.hash_block_size is not None:
            hashes = split_block_hashes(r.block_hashes, r.prompt_tokens, block_size, r.hash_block_size)
        ops.append(Prefill(len(ops), i, r.tenant, r.prompt_tokens, hashes))
        if r.output_tokens:
            ops.append(Append(len(ops), (i,), (r.output_tokens,)))
        ops.append(Free(len(ops), i))
    header = Header(family="requests", generator="kvbench.traces.loaders.requests_trace",
                    params={**(source or {}), "requests": len(requests)},
                    settings={"block_size": block_size, **({"prefix_caching": True} if hashed else {})})
    return Trace(header, ops, name=name)


def load_trace(path, format: str | None = None, *, block_size: int | None = None, seed: int = 0,
               rate: float = 1.0, max_requests: int | None = None) -> Trace:
    """A trace file of any supported format as a Trace: ``kvbench`` (or None) is kvbench's own
    JSONL / CSV; a public format (:data:`LOADERS`) is loaded (:func:`request_options` of the rest)
    and replayed by :func:`requests_trace` at ``block_size`` (default 16), its first
    ``max_requests`` requests."""
    path = os.fspath(path)
    if format in (None, NATIVE):
        return load(path)
    opts = request_options(format, block_size=block_size, seed=seed, rate=rate,
                           max_requests=max_requests)
    requests = load_requests(path, format, **opts)[:max_requests]
    return requests_trace(requests, block_size or DEFAULT_BLOCK_SIZE,
                          name=os.path.splitext(os.path.basename(path))[0],
                          source={"trace": path, "format": format})


__all__ = [
    "Request", "load_requests", "load_azure", "load_vidur", "load_lengths", "load_mooncake",
    "load_servegen", "split_block_hashes", "rehash_requests", "prefix_hit_rate_unbounded",
    "interarrival_gaps", "LOADERS", "MOONCAKE_BLOCK_SIZE", "NATIVE", "trace_formats",
    "request_options", "requests_trace", "load_trace",
]
