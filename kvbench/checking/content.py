"""The K/V the checker reads back: what a sequence must hold over a range of positions, read
from the oracle's segments, compared with what the backend returns for that range.

Verifying a range costs what the range holds, never the whole sequence: the checker asks each
operation for the positions it could have changed (see :mod:`kvbench.checking.checker`).
"""
from __future__ import annotations

import bisect

import numpy as np

from kvbench.checking.raised import BadReturn, guarded
from kvbench.contract.protocol import Backend, advance_state, group_view, kv_tokens
from kvbench.quant import pool as quant_pool


class Runs:
    """A sequence's writers as maximal runs (writer, first position), kept up to date from the
    oracle's segments as they grow: a decode appends one segment per token, and reading any
    range must not walk them all. Rebuilt when the sequence gets a new segment list (a fork or
    a recompute copies one)."""

    __slots__ = ("source", "seen", "last", "writers", "starts", "end")

    def __init__(self):
        self.source, self.seen, self.last, self.writers, self.starts, self.end = None, 0, None, [], [], 0

    def update(self, segments) -> None:
        if segments is not self.source or len(segments) < self.seen:
            self.source, self.seen, self.last, self.writers, self.starts, self.end = \
                segments, 0, None, [], [], 0
        if self.seen and segments[self.seen - 1] is not self.last:  # the last one grew in place
            w, s, c = self.last = segments[self.seen - 1]
            self.end = s + c
        for k in range(self.seen, len(segments)):
            w, s, c = self.last = segments[k]
            if not (self.writers and self.writers[-1] == w and self.end == s):
                self.writers.append(w)
                self.starts.append(s)
            self.end = s + c
        self.seen = len(segments)

    def over(self, start: int, stop: int, ws: list, counts: list) -> None:
        """Append who wrote positions ``start .. stop-1`` to ``ws``/``counts``, as runs."""
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        n = len(self.starts)
        while i < n and self.starts[i] < stop:
            hi = self.starts[i + 1] if i + 1 < n else self.end
            lo, hi = max(self.starts[i], start), min(hi, stop)
            if hi > lo:
                ws.append(self.writers[i])
                counts.append(hi - lo)
            i += 1


KV_RETURN = "an array of K/V, one row per position"


def read_array(what: str, value, wanted: str = KV_RETURN) -> np.ndarray:
    """What a backend's read returned, as an array; BadReturn for anything but a numeric array of
    at least one dimension (a str, a number, None)."""
    try:
        a = np.asarray(value)
    except Exception:  # an object numpy cannot read: what it is, not why numpy could not
        raise BadReturn(what, value, wanted) from None
    if a.ndim == 0 or a.dtype.kind not in "biuf":
        raise BadReturn(what, value, wanted)
    return a


def writers_over(segments, start: int, stop: int) -> np.ndarray:
    """The writer of each position ``start .. stop-1``, from ``[(writer, start, count)]``
    segments that cover the sequence in order."""
    runs, ws, counts = Runs(), [], []
    runs.update(segments)
    runs.over(start, stop, ws, counts)
    return np.repeat(np.asarray(ws, dtype=np.int64), counts)


class Content:
    """Expected K/V of the oracle's sequences, and their comparison with a backend's."""

    def __init__(self, backend, oracle, quantized: bool):
        self.backend, self.oracle, self.quantized = backend, oracle, quantized
        self.model, self.dtype = oracle.config.model, oracle.config.kv_dtype
        self.kv_format = backend.config.kv_format if backend is not None else None
        self.runs: dict = {}  # sequence -> Runs
        self.hybrid = any(g.releases for g in self.model.kv_groups)  # positions a window released
        self.state_groups = [g for g in self.model.kv_groups if g.state_bytes is not None]
        self.compressed = [g for g in self.model.kv_groups if g.ratio > 1]

    def _runs(self, seq) -> Runs:
        runs = self.runs.get(seq)
        if runs is None:
            runs = self.runs[seq] = Runs()
        runs.update(self.oracle.seqs[seq].segments)
        return runs

    def forget(self, seq) -> None:
        self.runs.pop(seq, None)

    def mismatch(self, ranges, into=None):
        """Verify ``[(seq, start, stop)]`` (stop None: to the end) with one expected array and one
        comparison. None when all are right, else (seq, expected, actual, detail) of the first
        wrong one. Returns the number of ranges read as well. ``into``: one more range, read
        through ``gather(..., out=)`` into a buffer where the backend's gather takes ``out``."""
        todo = [r for r in map(self._span, ranges) if r]
        buffered = self._span(into) if into else None
        if buffered:
            todo.append(buffered)  # last, so that the plain ranges go in one call before it
        if not todo:
            return None, 0
        ws, counts = [], []
        for seq, start, stop in todo:
            self._runs(seq).over(start, stop, ws, counts)
        lengths = np.array([b - a for _, a, b in todo], dtype=np.int64)
        firsts = np.array([a for _, a, _ in todo], dtype=np.int64)
        positions = np.arange(int(lengths.sum())) + np.repeat(firsts - (np.cumsum(lengths) - lengths), lengths)
        want = kv_tokens(np.repeat(np.asarray(ws, dtype=np.int64), counts), positions, self.model,
                         self.dtype)
        if self.hybrid:
            self._mask_released(want, todo, lengths)
        if self.compressed:
            self._entries(want, todo, lengths)
        token_shape = want.shape[1:]
        plain = todo[:-1] if buffered else todo
        if not self.quantized:  # one call and one comparison; the ranges apart only to say where
            parts = self._read_ranges(plain) if plain else []
            if buffered:
                parts.append(self._read_into(*buffered, token_shape))
            if all(p.shape[1:] == token_shape for p in parts):  # else the ranges apart say which
                together = parts[0] if len(parts) == 1 else np.concatenate(parts)
                if together.shape == want.shape and np.array_equal(together, want):
                    return None, len(todo)
        got, offset = [], 0
        for i, (seq, start, stop) in enumerate(todo):
            g = self._read_into(seq, start, stop, token_shape) if buffered and i == len(plain) \
                else read_array("gather", guarded("gather", self.backend.gather, seq, start, stop))
            if g.shape[1:] != token_shape or len(g) != stop - start:
                return (seq, "what it wrote or inherited", "different values",
                        f"shape {tuple(g.shape)} instead of {(stop - start,) + token_shape}"), len(got) + 1
            got.append(g)
        got_all = got[0] if len(got) == 1 else np.concatenate(got)
        if (not quant_pool.bound_violation(want, got_all, self.kv_format) if self.quantized
                else np.array_equal(got_all, want)):  # per row: the ranges apart only to say where
            return None, len(todo)
        for i, ((seq, start, stop), g) in enumerate(zip(todo, got)):  # which one, and where
            w = want[offset:offset + len(g)]
            offset += len(g)
            bad = self._wrong(seq, start, w, g)
            if bad and buffered and i == len(plain):
                bad = (*bad[:2], f"{bad[2]}; read by gather({seq}, {start}, {stop}, out=) into the "
                                 f"caller's buffer")
            if bad:
                return (seq, *bad), len(todo)
        return None, len(todo)

    def _read_ranges(self, ranges) -> list:
        """The K/V of ``[(seq, start, stop)]``: in one gather_ranges call where the backend has its
        own, else one gather a range (the protocol's default, each return checked as gather's)."""
        backend = self.backend
        if type(backend).gather_ranges is Backend.gather_ranges:
            return [read_array("gather", guarded("gather", backend.gather, *r)) for r in ranges]
        return [read_array("gather", guarded("gather", backend.gather_ranges,
                                                    *(list(c) for c in zip(*ranges))))]

    def state_mismatch(self, seqs):
        """SPEC §12: each state group's state of each sequence (``read_state``) against the state
        after every token it wrote or inherited, from a fresh (zero) state. None when all are
        right, else (seq, expected, actual, detail) of the first wrong one."""
        if not self.state_groups:
            return None
        for seq in seqs:
            n = self.oracle.seqs[seq].tokens
            ws, counts = [], []
            self._runs(seq).over(0, n, ws, counts)
            kv = kv_tokens(np.repeat(np.asarray(ws, dtype=np.int64), counts), np.arange(n),
                           self.model, self.dtype)
            want = [advance_state(None, group_view(kv, g.layers, self.model)) for g in self.state_groups]
            got = read_array("read_state", guarded("read_state", self.backend.read_state, seq),
                             "an array of states, one per state group")
            for i, (g, w) in enumerate(zip(self.state_groups, want)):
                if got.shape[1:] != w.shape or len(got) != len(want):
                    return (seq, f"{len(want)} states of shape {w.shape}", f"shape {got.shape}",
                            "read_state gives one state per state group")
                if not np.array_equal(got[i].astype(np.int64), w):
                    what = "a fresh state (zeros)" if not got[i].any() else "other values"
                    return (seq, f"the state after its {n} tokens", what,
                            f"state group {g.kind} of layers {g.layers}: the sum of the K/V of "
                            f"positions 0..{n - 1} mod 2003 from a fresh (zero) state")
        return None

    def _span(self, r):
        """``(seq, start, stop)`` with stop within the sequence, None when that is empty."""
        seq, start, stop = r
        n = self.oracle.seqs[seq].tokens
        stop = n if stop is None else min(stop, n)
        return (seq, start, stop) if stop > start else None

    def _read_into(self, seq, start: int, stop: int, token_shape) -> np.ndarray:
        """``gather(seq, start, stop, out=buf)``, and what ``buf`` then holds: NaN where nothing
        was written. The pool's read dtype: the K/V's, float32 dequantized."""
        buf = np.full((stop - start,) + token_shape, np.nan, np.float32 if self.quantized else self.dtype)
        guarded("gather", self.backend.gather, seq, start, stop, out=buf)
        return buf

    def _mask_released(self, want, todo, lengths) -> None:
        """Zeros where a sliding group no longer holds a position, in that group's layers."""
        offset = 0
        for (seq, start, stop), n in zip(todo, lengths.tolist()):
            for group, (lo, hi) in zip(self.model.kv_groups, self.oracle.released_spans(seq)):
                lo, hi = max(lo, start), min(hi, stop)
                if hi > lo:
                    want[offset + lo - start:offset + hi - start, :, list(group.layers)] = 0
            offset += n

    def _entries(self, want, todo, lengths) -> None:
        """A compressed(r) group's layers at position p hold its entry's K/V, written with the
        entry's first token: position p - p % r's (docs/cache-kinds.md)."""
        offset = 0
        for (seq, start, stop), n in zip(todo, lengths.tolist()):
            for group in self.compressed:
                r, lo = group.ratio, start - start % group.ratio
                ws, counts = [], []
                self._runs(seq).over(lo, stop, ws, counts)
                writers = np.repeat(np.asarray(ws, dtype=np.int64), counts)
                first = np.arange(start, stop) // r * r
                kv = kv_tokens(writers[first - lo], first, self.model, self.dtype)
                layers = list(group.layers)
                want[offset:offset + n, :, layers] = kv[:, :, layers]
            offset += n

    def _wrong(self, seq, start, want, got):
        if self.quantized:  # within SPEC §4's bound of what was written
            why = quant_pool.bound_violation(want, got, self.kv_format, start)
            return ("within the quantization bound", "outside", why) if why else None
        if np.array_equal(got, want):
            return None
        bad = np.flatnonzero(~np.all((want == got).reshape(len(want), -1), axis=1))
        p = start + int(bad[0])
        writer = int(writers_over(self.oracle.seqs[seq].segments, p, p + 1)[0])
        released = [g for g, (lo, hi) in enumerate(self.oracle.released_spans(seq)) if lo <= p < hi] \
            if self.hybrid else []
        if released:
            return ("what it wrote or inherited", "different values",
                    f"first wrong position {p} (should hold what sequence {writer} wrote there, "
                    f"and zeros in the layers of group(s) {released}, whose window released it)")
        entries = "".join(f"; group {g.kind}'s layers: its entry's, written with token "
                          f"{p - p % g.ratio}" for g in self.compressed)
        return ("what it wrote or inherited", "different values",
                f"first wrong position {p} (should hold what sequence {writer} wrote there{entries})")


class LiveSet:
    """The live sequences in a list with O(1) add, remove and uniform random choice."""

    def __init__(self, seed: int = 0):
        self.items: list = []
        self.index: dict = {}
        self.rng = np.random.default_rng(seed)

    def add(self, seq) -> None:
        if seq not in self.index:
            self.index[seq] = len(self.items)
            self.items.append(seq)

    def discard(self, seq) -> None:
        i = self.index.pop(seq, None)
        if i is None:
            return
        last = self.items.pop()
        if i < len(self.items):
            self.items[i] = last
            self.index[last] = i

    def __len__(self) -> int:
        return len(self.items)

    def choice(self):
        return self.items[int(self.rng.integers(len(self.items)))]

    def window(self, tokens: int, width: int) -> tuple[int, int]:
        """A random range of up to ``width`` positions of a sequence of ``tokens``."""
        start = int(self.rng.integers(max(1, tokens - width + 1)))
        return start, min(tokens, start + width)
