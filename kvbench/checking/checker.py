"""The checker: replay a trace through a backend and the oracle side by side.

After every trace operation it compares the backend's ledger, the victims it chose and the K/V it
returns with what the oracle derives from the formulas. Its verdict is data: valid or not, and the
first divergence (trace, step, operation, quantity, expected, actual), small enough to reproduce.

One trace operation may take several backend calls: a sequence that was evicted is recomputed
(re-prefilled to its current length, with the content it had) in the same step before the
operation touches it. Each call is atomic on its own. A prefill or fork that fails for lack of
memory leaves its sequence refused, and later operations on it are dropped, on both sides.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from kvbench.quant import pool as quant_pool
from kvbench.checking.oracle import ModelOOM, Oracle, content_segments
from kvbench.contract.protocol import LEDGER_FIELDS, Backend, OutOfMemory, kv_tokens
from kvbench.traces.format import Append, Fork, Free, Prefill, Trace, op_to_dict

BLOCK_FIELDS = ("blocks_used", "blocks_free", "shared_blocks")


@dataclass
class Divergence:
    trace: str
    index: int  # 0-based operation number in the trace
    step: int
    op: dict
    quantity: str
    expected: object
    actual: object
    detail: str = ""

    def __str__(self) -> str:
        return (f"{self.trace}: step {self.step} (op #{self.index} {self.op}): {self.quantity} "
                f"expected {self.expected!r}, got {self.actual!r}" + (f" ({self.detail})" if self.detail else ""))


@dataclass
class Verdict:
    trace: str
    backend: str
    valid: bool | None  # None: not applicable
    ops: int = 0  # operations checked
    divergence: Divergence | None = None
    not_applicable: str = ""
    skipped: dict = field(default_factory=dict)  # what was not checked, and why
    ooms: int = 0
    evictions: int = 0
    recomputed_tokens: int = 0
    gathers: int = 0
    hits: int = 0  # operations that found the sequence they touch still resident
    misses: int = 0  # ... that found it evicted, and recomputed it
    tenants: dict = field(default_factory=dict)  # tenant -> {evictions, recomputed_tokens, hits, misses}
    backend_seconds: float = 0.0
    final_ledger: dict = field(default_factory=dict)
    series: list = field(default_factory=list)  # ledger figures after each operation

    @property
    def status(self) -> str:
        return {True: "pass", False: "FAIL", None: "n/a"}[self.valid]

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("series", "divergence")}
        d["divergence"] = None if self.divergence is None else dict(self.divergence.__dict__)
        d["status"] = self.status
        return d


class _Stop(Exception):
    def __init__(self, divergence: Divergence):
        self.divergence = divergence


def applicable(trace: Trace, backend: Backend) -> str:
    """'' when the backend can run the trace, else why not."""
    caps = backend.capabilities
    if not caps.fork and any(isinstance(op, Fork) for op in trace.ops):
        return f"{backend.name} does not support fork and the trace forks"
    policy = backend.config.policy
    if policy and policy not in caps.eviction:
        return f"{backend.name} does not implement eviction policy {policy!r}"
    return ""


def check(trace: Trace, backend: Backend | None, *, gather: str = "touched", series: bool = False,
          progress=None, model: Oracle | None = None) -> Verdict:
    """Replay ``trace`` through ``backend`` and the oracle; the verdict names the first divergence.

    ``gather``: 'touched' verifies the K/V of every sequence an operation touched and of those
    sharing a block with it; 'all' verifies every live sequence after every operation; 'end'
    only at the end; 'none' never.

    With ``backend=None`` it replays the ``model`` (an Oracle, or a subclass such as the offline
    Belady policy) alone, by the same rules: its evictions, hits and usage, nothing compared.
    """
    if backend is None:
        return _replay(trace, None, model, Verdict(trace=trace.name, backend=f"model:{type(model).__name__}",
                                                   valid=True), gather="none", series=series,
                       progress=progress, writes_kv=False, quantized=False)
    verdict = Verdict(trace=trace.name, backend=backend.name, valid=True)
    reason = applicable(trace, backend)
    if reason:
        verdict.valid, verdict.not_applicable = None, reason
        return verdict
    caps = backend.capabilities
    writes_kv = caps.holds_kv and backend.config.store_kv  # K/V go in whenever it stores them
    do_gather = gather != "none" and writes_kv  # ... and are read back unless told not to
    if not do_gather:
        verdict.skipped["kv content"] = ("backend holds no K/V" if not caps.holds_kv
                                         else "store_kv is off" if not backend.config.store_kv
                                         else "gather='none'")
    quantized = bool(backend.config.kv_format)
    if quantized and not caps.quantized:
        verdict.valid, verdict.not_applicable = None, f"{backend.name} does not store quantized K/V"
        return verdict
    if caps.layout != "paged":
        verdict.skipped["blocks"] = f"{caps.layout} layout has no blocks"
    if not caps.copy_on_write and caps.layout == "paged":
        verdict.skipped["copy-on-write"] = "declared unsupported"
    caching = backend.config.prefix_caching and caps.prefix_caching
    if backend.config.prefix_caching and not caps.prefix_caching:
        verdict.skipped["prefix caching"] = f"{backend.name} does not declare it: replayed without"
    oracle = Oracle(dataclasses.replace(backend.config, prefix_caching=caching),
                    layout="paged" if caps.layout == "paged" else "contiguous")
    return _replay(trace, backend, oracle, verdict, gather=gather, series=series, progress=progress,
                   writes_kv=writes_kv, quantized=quantized)


def _replay(trace, backend, oracle, verdict, *, gather, series, progress, writes_kv, quantized):
    """The replay loop of check(): ``backend`` None drives the oracle alone."""
    do_gather = gather != "none" and writes_kv
    layout = oracle.layout
    fields_checked = [f for f in LEDGER_FIELDS if layout == "paged" or f not in BLOCK_FIELDS]
    model, dtype = oracle.config.model, oracle.config.kv_dtype
    final = trace.final_lengths()
    tenant_of = trace.tenant_of()
    touches: dict = {}  # tenant -> [hits, misses]
    refused: set = set()
    index = -1
    op = None

    def diverge(quantity, expected, actual, detail=""):
        raise _Stop(Divergence(trace.name, index, op.step, op_to_dict(op), quantity, expected,
                               actual, detail))

    def content(seq, segments):
        writers = np.concatenate([np.full(c, w) for w, _, c in segments]) if segments else []
        positions = np.concatenate([np.arange(s, s + c) for _, s, c in segments]) if segments else []
        return kv_tokens(writers, positions, model, dtype)

    def call(what, backend_call, oracle_call):
        """One backend call beside the same oracle call; returns victims, None on OOM."""
        try:
            expected = oracle_call()
        except ModelOOM:
            expected = None
        if backend is None:
            verdict.ooms += expected is None
            verdict.evictions += len(expected or ())
            return None if expected is None else tuple(expected)
        before = backend.ledger() if expected is None else None
        t0 = time.perf_counter()
        try:
            actual = tuple(backend_call() or ())
        except OutOfMemory:
            actual = None
        except Exception as e:  # a crash is a verdict, not a crash of the checker
            diverge(f"outcome of {what}", "success", f"{type(e).__name__}: {e}")
        verdict.backend_seconds += time.perf_counter() - t0
        if (expected is None) != (actual is None):
            diverge(f"outcome of {what}", "out of memory" if expected is None else "success",
                    "out of memory" if actual is None else "success",
                    "the oracle finds no room even after evicting every candidate"
                    if expected is None else "the backend refused an operation that fits")
        if expected is None:
            verdict.ooms += 1
            after = backend.ledger()
            for f in fields_checked:
                if getattr(after, f) != getattr(before, f):
                    diverge(f"{f} after a refused {what}", getattr(before, f), getattr(after, f),
                            "an operation that fails must leave the cache exactly as it was")
            return None
        if list(expected) != list(actual):
            diverge("victims", list(expected), list(actual))
        verdict.evictions += len(actual)
        return actual

    def touch(seq):
        """Count a re-touch: a hit if the sequence is resident, a miss if it was evicted."""
        miss = seq in oracle.preempted
        verdict.misses += miss
        verdict.hits += not miss
        touches.setdefault(tenant_of[seq], [0, 0])[miss] += 1

    def restore(seq, protect):
        """Recompute an evicted sequence (its old content, its current length) before the op."""
        st = oracle.preempted[seq]
        kv = content(seq, st.segments) if writes_kv else None
        got = call("recompute",
                   lambda: backend.prefill(seq, st.tokens, kv, tenant=st.tenant, final_tokens=st.final,
                                           step=op.step, protect=tuple(protect),
                                           block_hashes=st.hashes or None),
                   lambda: oracle.recompute(seq, op.step, protect))
        if got is not None:
            verdict.recomputed_tokens += st.tokens
        return got

    try:
        for index, op in enumerate(trace.ops):
            touched: set = set()
            victims: list = []
            if isinstance(op, Prefill):
                # The prompt's K/V as the oracle sees them (a hashed block holds its prefix's).
                kv = (lambda: None if not writes_kv else content(
                    op.seq, oracle.seqs[op.seq].segments if op.seq in oracle.seqs else content_segments(
                        op.seq, op.tokens, (op.block_hashes or ())[:op.tokens // oracle.B], oracle.B)))
                got = call("prefill",
                           lambda: backend.prefill(op.seq, op.tokens, kv(), tenant=op.tenant,
                                                   final_tokens=final[op.seq], step=op.step,
                                                   block_hashes=op.block_hashes),
                           lambda: oracle.prefill(op.seq, op.tokens, op.tenant, final[op.seq], op.step,
                                                  hashes=op.block_hashes))
                if got is None:
                    refused.add(op.seq)
                else:
                    victims += got
                    touched.add(op.seq)
            elif isinstance(op, Append):
                pairs = [(s, t) for s, t in zip(op.seqs, op.tokens) if s not in refused]
                seqs = [s for s, _ in pairs]
                ok = True
                for s in seqs:
                    touch(s)
                    if s in oracle.preempted:
                        got = restore(s, set(seqs))
                        if got is None:
                            ok = False
                            break
                        victims += got
                if ok and seqs:
                    toks = [t for _, t in pairs]
                    kv = None
                    if writes_kv:
                        writers = np.repeat(seqs, toks)
                        starts = [oracle.seqs[s].tokens for s in seqs]
                        positions = np.concatenate([np.arange(a, a + t) for a, t in zip(starts, toks)])
                        kv = kv_tokens(writers, positions, model, dtype)
                    got = call("append", lambda: backend.append(seqs, toks, kv, step=op.step),
                               lambda: oracle.append(seqs, toks, op.step))
                    if got is not None:
                        victims += got
                        touched.update(seqs)
            elif isinstance(op, Fork):
                if op.src in refused:
                    refused.add(op.seq)
                else:
                    ok = True
                    touch(op.src)
                    if op.src in oracle.preempted:
                        got = restore(op.src, {op.src, op.seq})
                        ok = got is not None
                        victims += got or []
                    got = call("fork",
                               lambda: backend.fork(op.seq, op.src, final_tokens=final[op.seq],
                                                    step=op.step),
                               lambda: oracle.fork(op.seq, op.src, final[op.seq], op.step)) if ok else None
                    if got is None:
                        refused.add(op.seq)
                    else:
                        victims += got
                        touched.update((op.seq, op.src))
            elif isinstance(op, Free) and op.seq not in refused:
                evicted = op.seq in oracle.preempted  # the backend dropped it when it evicted it
                oracle.free(op.seq)
                if backend is not None and not evicted:
                    t0 = time.perf_counter()
                    try:
                        backend.free(op.seq, step=op.step)
                    except Exception as e:
                        diverge("outcome of free", "success", f"{type(e).__name__}: {e}")
                    verdict.backend_seconds += time.perf_counter() - t0
            expected = oracle.expected_ledger()
            actual = backend.ledger() if backend is not None else expected
            for f in fields_checked:
                e, a = getattr(expected, f), getattr(actual, f)
                if f == "fragmentation":
                    if abs(e - a) > 1e-12:
                        diverge(f, e, a)
                elif e != a:
                    diverge(f, e, a, _dict_diff(e, a) if isinstance(e, dict) else "")
            if do_gather:
                if gather == "all" or (gather == "end" and index == len(trace.ops) - 1):
                    to_check = set(oracle.seqs)
                elif gather == "touched":
                    to_check = set().union(*(oracle.family_of(s) for s in touched if s in oracle.seqs)) \
                        if touched else set()
                    if index == len(trace.ops) - 1:
                        to_check = set(oracle.seqs)
                else:
                    to_check = set()
                for s in sorted(to_check):
                    want = content(s, oracle.seqs[s].segments)
                    got = np.asarray(backend.gather(s))
                    verdict.gathers += 1
                    if quantized:  # within SPEC §4's bound of what was written
                        why = quant_pool.bound_violation(want, got, backend.config.kv_format)
                        if why:
                            diverge(f"kv of sequence {s}", "within the quantization bound", "outside", why)
                    elif got.shape != want.shape or not np.array_equal(got, want):
                        diverge(f"kv of sequence {s}", "what it wrote or inherited",
                                "different values", _first_kv_mismatch(s, want, got, oracle))
            if series:
                verdict.series.append({"step": op.step, **{f: getattr(expected, f) for f in
                                       ("blocks_used", "fragmentation", "token_states", "reservation",
                                        "internal_fragmentation", "external_fragmentation", "free")},
                                       "usage": oracle.tenant_usage()})
            verdict.ops = index + 1
            if progress is not None:
                progress.update(1)
    except _Stop as stop:
        verdict.valid = False
        verdict.divergence = stop.divergence
    verdict.tenants = {t: dict(st.__dict__) for t, st in sorted(oracle.tenant_stats.items())}
    for t, (hits, misses) in touches.items():
        verdict.tenants.setdefault(t, {"evictions": 0, "recomputed_tokens": 0}).update(hits=hits,
                                                                                        misses=misses)
    final_ledger = oracle.expected_ledger() if verdict.valid else backend.ledger()
    verdict.final_ledger = {k: v for k, v in final_ledger.as_dict().items()
                            if k not in ("tokens", "seq_blocks")}
    return verdict


def _dict_diff(e: dict, a: dict) -> str:
    keys = sorted(set(e) | set(a))
    for k in keys:
        if e.get(k) != a.get(k):
            return f"sequence {k}: expected {e.get(k)}, got {a.get(k)}"
    return ""


def _first_kv_mismatch(seq, want, got, oracle) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    bad = np.flatnonzero(~np.all((want == got).reshape(len(want), -1), axis=1))
    p = int(bad[0])
    writer = next(w for w, s, c in oracle.seqs[seq].segments if s <= p < s + c)
    return f"first wrong position {p} (should hold what sequence {writer} wrote there)"
