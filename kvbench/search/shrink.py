"""Shrink a failing trace to a small one that fails the same way (`kvbench shrink`).

:func:`shrink` replays a trace through a backend under the checker. If the backend fails, it cuts
the trace down, keeping every candidate that still fails with the same kind of divergence
(:func:`divergence_kind`: the same quantity, or the same exception type), and returns the
smallest it found with a header that records where it came from. A backend that passes gives
nothing to shrink; a trace the checker cannot judge (not applicable, or an error of the harness
itself) is refused with the reason.

The moves (edits in kvbench/search/edits.py), cheapest first and repeated until none helps:
cut after the failure; keep only the sequences touched in the last 1, 2, 4, ... operations before
it; ddmin over sequences, then over append members and frees; merge appends; shorten token
counts; lower the budget and the block size; renumber (docs/shrinking.md says more).

Every candidate is validated by the trace loader's rules (:func:`kvbench.traces.format.validate`)
before it runs, so a shrunk trace is always a legal one. The checker is used only through
``check()`` and its Verdict/Divergence; the backend comes as a factory, so this module imports no
backend (tests/test_architecture.py holds it to that).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from kvbench.checking.checker import check
from kvbench.checking.verdict import OOM, Divergence, Verdict
from kvbench.contract import formulas as F
from kvbench.contract.protocol import Backend, CacheConfig
from kvbench.progress import Deadline, OutOfTime
from kvbench.search import edits
from kvbench.search.reproduce import (
    divergence_kind,
    emit_pytest,
    failure_trace,
    jsonable,
    settings_of,
)
from kvbench.traces.format import Append, Fork, Free, Prefill, Trace, TraceError, validate

COLUMNS_FROM = 1000  # candidates this long run as columns (ops with fields of their own never)
BASE_OPS = (Prefill, Append, Fork, Free)
DEFAULT_MAX_SECONDS = 600.0
DEFAULT_MAX_ATTEMPTS = 20_000

BackendFactory = Callable[[CacheConfig], Backend]


# --- what counts as the same failure --------------------------------------------------------

@dataclass
class Outcome:
    """One replay: 'fail' (with the divergence and its kind), 'pass', 'n/a', 'error' (the harness
    failed, not the backend), 'setup' (the factory refused the settings), 'invalid' (not a
    legal trace; never run)."""

    status: str
    kind: str = ""
    divergence: Divergence | None = None
    reason: str = ""
    pressure: bool = False  # the replay evicted or refused something: the budget matters


clock = time.monotonic  # what deadlines are read from (a test may turn it)
CUT_GRACE = 0.1  # of max_seconds, the most the cut after the failure may run past the deadline


def replay(trace: Trace, factory: BackendFactory, config: CacheConfig,
           gather: str = "touched", deadline: float | None = None) -> Outcome:
    """Check ``trace`` on a fresh backend from ``factory(config)`` and classify the verdict.
    ``deadline`` (a ``clock()`` time): OutOfTime, the backend closed, when the replay passes it."""
    try:
        backend = factory(config)
    except Exception as e:
        return Outcome("setup", reason=f"the backend refused the settings: {type(e).__name__}: {e}")
    try:
        # lambda: the module's clock as it is when read (a test turns it)
        v = check(trace, backend, gather=gather,
                  progress=None if deadline is None else Deadline(deadline, lambda: clock()))
    except Exception as e:  # check() reports its own failures as ERROR; this is a last resort
        return Outcome("error", reason=f"the harness raised {type(e).__name__}: {e}")
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    return _classify(v)


def _classify(v: Verdict) -> Outcome:
    status = getattr(v, "status", "")
    if status == "ERROR":  # the harness could not do its part: nothing the backend did
        return Outcome("error", reason=v.error)
    if v.valid is None:
        return Outcome("n/a", reason=v.not_applicable)
    if v.valid:
        return Outcome("pass")
    kind = divergence_kind(v.divergence)
    return Outcome("fail", kind, v.divergence, pressure=bool(
        v.ooms or v.evictions or kind == "victims" or OOM in kind or "refused" in kind))


# --- the result ------------------------------------------------------------------------------

@dataclass
class ShrinkResult:
    """What :func:`shrink` found. ``status``: 'shrunk' (``trace`` fails like the original),
    'passes' (nothing to shrink), 'not-applicable' or 'error' (refused, ``reason`` says why).
    'out-of-time' (the first replay did not finish within max_seconds: ``reason``).
    ``stopped``: 'done' (no move helps any more), 'max-seconds', 'max-attempts', 'interrupted'."""

    status: str
    original: Trace
    config: CacheConfig
    backend: str
    reason: str = ""
    divergence: Divergence | None = None  # the original's first divergence
    kind: str = ""
    trace: Trace | None = None  # the shrunk trace, its header saying where it came from
    shrunk_config: CacheConfig | None = None  # the settings it fails under (budget lowered, ...)
    shrunk_divergence: Divergence | None = None
    attempts: int = 0  # replays run (memoized and invalid candidates not counted)
    seconds: float = 0.0
    stopped: str = ""
    gather: str = "touched"

    @property
    def ok(self) -> bool:
        return self.status == "shrunk"

    def summary(self) -> str:
        if self.status == "passes":
            return "passes: nothing to shrink"
        if not self.ok:
            return f"{self.status}: {self.reason}"
        return (f"shrunk {len(self.original)} ops to {len(self.trace)} ({self.attempts} attempts, "
                f"{self.seconds:.1f} s, {self.stopped}): {self.kind}")

    def pytest_source(self, factory: BackendFactory) -> str:
        """The shrunk trace as a pytest case (kvbench.search.reproduce.emit_pytest)."""
        title = (f"Shrunk by `kvbench shrink` from {self.trace.header.params['source']['trace']} "
                 f"({len(self.original)} ops, first divergence at step {self.divergence.step})")
        return emit_pytest(self.trace, factory, self.shrunk_config, self.backend,
                           gather=self.gather, title=title)

    def as_record(self) -> dict:
        """A JSON-able record to attach to a divergence (results pages, the fault catalogue)."""
        return {"status": self.status, "reason": self.reason, "backend": self.backend,
                "kind": self.kind, "ops_before": len(self.original),
                "ops_after": len(self.trace) if self.trace is not None else None,
                "attempts": self.attempts, "seconds": round(self.seconds, 3), "stopped": self.stopped,
                "divergence": jsonable(self.divergence),
                "shrunk_divergence": jsonable(self.shrunk_divergence),
                "trace": self.trace.to_jsonl() if self.trace is not None else None}


def _label(factory) -> str:
    if isinstance(factory, type):
        return f"{factory.__module__}:{factory.__qualname__}"
    return getattr(factory, "__name__", repr(factory))


# --- the search --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    ops: tuple
    tenants: tuple  # the header's tenant weights, as sorted items
    config: CacheConfig

    def key(self):
        k = (self.ops, self.tenants, self.config.num_blocks, self.config.block_size,
             tuple(sorted(self.config.tenant_weights.items())))
        try:
            hash(k)
            return k
        except TypeError:  # a field holding a list: compare by text
            return repr(k)


@dataclass
class ShrinkStatus:
    """Where a shrink stands, passed to the ``progress`` callback after every replay."""

    phase: str
    ops: int  # operations in the smallest failing trace so far
    original_ops: int
    attempts: int
    seconds: float
    extra: dict = field(default_factory=dict)


class _Stop(Exception):
    def __init__(self, why: str, replayed: int = 0):  # replayed: by a replay stopped part way
        self.why, self.replayed = why, replayed


class _Shrinker:
    def __init__(self, trace, factory, gather, max_seconds, max_attempts, progress):
        self.trace, self.factory, self.gather = trace, factory, gather
        self.max_seconds, self.max_attempts, self.progress = max_seconds, max_attempts, progress
        self.start = clock()
        self.attempts = 0
        self.seen: dict = {}
        self.phase = "first replay"
        self.best: Candidate | None = None
        self.best_outcome: Outcome | None = None
        self.kind = ""

    def elapsed(self) -> float:
        return clock() - self.start

    def outcome(self, cand: Candidate, limited: bool = True) -> Outcome:
        key = cand.key()
        if key in self.seen:
            return self.seen[key]
        if self.best is not None and limited:
            if self.elapsed() >= self.max_seconds:
                raise _Stop("max-seconds")
            if self.attempts >= self.max_attempts:
                raise _Stop("max-attempts")
        deadline = self.start + self.max_seconds * (1 if limited else 1 + CUT_GRACE)
        h = self.trace.header
        header = dataclasses.replace(h, tenants=dict(cand.tenants))
        trace = Trace(header, list(cand.ops), name=self.trace.name)
        if len(trace) >= COLUMNS_FROM and all(type(op) in BASE_OPS for op in cand.ops):
            trace = trace.columnar()  # validated by array operations, replayed a little faster
        try:
            validate(trace)
        except TraceError as e:
            out = Outcome("invalid", reason=str(e))
        else:
            self.attempts += 1
            try:
                out = replay(trace, self.factory, cand.config, self.gather, deadline)
            except OutOfTime as e:
                raise _Stop("max-seconds", replayed=e.args[0]) from None
        self.seen[key] = out
        if self.progress is not None:
            self.progress(ShrinkStatus(self.phase, len(self.best.ops) if self.best else len(cand.ops),
                                   len(self.trace), self.attempts, self.elapsed()))
        return out

    def fails(self, cand: Candidate, cut: bool = True) -> bool:
        """Whether ``cand`` fails the same way; if so it becomes the best, cut after its failure."""
        if not cand.ops:
            return False
        out = self.outcome(cand)
        if out.status != "fail" or out.kind != self.kind:
            return False
        self.best, self.best_outcome = cand, out
        if cut:
            self.cut()
        return True

    def cut(self, limited: bool = True) -> None:
        """Everything after the failure goes (a candidate of its own: the final lengths change).
        ``limited=False``: past max-attempts, and max-seconds by CUT_GRACE (the first cut
        replays at most as far as the first replay did)."""
        cand, index = self.best, self.best_outcome.divergence.index
        if index < len(cand.ops) - 1:
            short = dataclasses.replace(cand, ops=cand.ops[:index + 1])
            out = self.outcome(short, limited)
            if out.status == "fail" and out.kind == self.kind:
                self.best, self.best_outcome = short, out

    def fails_or_tighter(self, cand: Candidate) -> bool:
        """``fails(cand)``; else, when the failure came under memory pressure, ``cand`` with the
        budget lowered by the blocks its edit freed (ceil(T/B) of the sequences live at the
        end), so that dropping a sequence or tokens does not also take the pressure away."""
        if self.fails(cand):
            return True
        if not self.best_outcome.pressure or not cand.ops or self.outcome(cand).status == "invalid":
            return False
        B = cand.config.block_size
        freed = (sum(F.blocks_needed(n, B) for n in edits.live_lengths(self.best.ops).values())
                 - sum(F.blocks_needed(n, B) for n in edits.live_lengths(cand.ops).values()))
        blocks = cand.config.num_blocks - freed
        return freed > 0 and blocks >= 1 and self.fails(
            dataclasses.replace(cand, config=dataclasses.replace(cand.config, num_blocks=blocks)))

    def with_ops(self, ops) -> Candidate:
        return dataclasses.replace(self.best, ops=tuple(ops))

    # --- the moves ----------------------------------------------------------------------------

    def run(self) -> None:
        moves = (self.window, self.drop_sequences, self.drop_members, self.coalesce,
                 self.shorten_tokens, self.budget, self.block_size, self.renumber, self.tenants)
        while True:
            before = self.best.key()
            for move in moves:
                self.phase = move.__name__.replace("_", " ")
                move()
            if self.best.key() == before:
                return

    def window(self) -> None:
        """Runs on the original trace uncut (cutting it first would cost a replay as long as the
        first), so it drops the sequences born after the failure too; then cuts."""
        self.keep_recent()
        self.cut()

    def keep_recent(self) -> None:
        ops, k = self.best.ops, self.best_outcome.divergence.index
        last = {}
        for i, op in enumerate(ops[:k + 1]):
            for s in edits.sequences_of(op):
                last[s] = i
        w = 1
        while True:
            keep = edits.ancestors(ops, {s for s, i in last.items() if i >= k - w})
            drop = set(edits.sequences(ops)) - keep
            if not drop or len(keep) >= len(last):
                return
            if self.fails(self.with_ops(edits.drop_sequences(ops, drop))):
                return
            w *= 2

    def ddmin(self, units_of, remove) -> None:
        """Delta debugging over the units ``units_of(ops)`` lists: drop chunks of half of them,
        then of a quarter, ... down to one unit at a time. Each level is one scan that stays where
        a drop succeeded (Zeller's ddmin restarts there from the first chunk: O(n^2) replays);
        the last level repeats until it drops nothing, so no single unit can go (1-minimal)."""
        units = units_of(self.best.ops)
        size = max(1, len(units) // 2)
        while units:
            i, dropped = 0, False
            while i < len(units):
                chunk = units[i:i + size]
                if self.fails_or_tighter(self.with_ops(remove(self.best.ops, chunk))):
                    left = set(units) - set(chunk)
                    units = [u for u in units_of(self.best.ops) if u in left]
                    dropped = True
                else:
                    i += size
            if size == 1 and not dropped:
                return
            size = max(1, size // 2)

    def drop_sequences(self) -> None:
        self.ddmin(edits.sequences, edits.drop_sequences)

    def drop_members(self) -> None:
        self.ddmin(edits.members, edits.drop_members)

    def coalesce(self) -> None:
        """Fewer operations for the same tokens: adjacent appends merged, an append folded into
        its sequence's prefill."""
        i = 0
        while i + 1 < len(self.best.ops):
            merged = edits.merge_appends(self.best.ops, i)
            if merged is None or not self.fails(self.with_ops(merged)):
                i += 1
        for seq in edits.sequences(self.best.ops):
            while True:
                folded = edits.fold_into_prefill(self.best.ops, seq)
                if folded is None or not self.fails(self.with_ops(folded)):
                    break

    def shorten_tokens(self) -> None:
        B = self.best.config.block_size
        for unit, _ in edits.token_counts(self.best.ops):
            def tokens():
                return dict(edits.token_counts(self.best.ops)).get(unit, 1)

            def tries(n):
                return self.fails_or_tighter(self.with_ops(edits.set_tokens(self.best.ops, unit, n, B)))

            while tokens() > 1 and tries(tokens() // 2):  # halving
                pass
            lo, hi = tokens() // 2 + 1, tokens()  # then down by bisection, one by one at the end
            while lo < hi:
                mid = (lo + hi) // 2
                if tries(mid):
                    hi = mid
                else:
                    lo = mid + 1

    def renumber(self) -> None:
        ops = list(self.best.ops)
        for kw in ({}, {"seqs": False}, {"steps": False}):
            cand = edits.renumber(ops, **kw)
            if cand != ops and self.fails(self.with_ops(cand)):
                return

    def tenants(self) -> None:
        ops, cand = self.best.ops, self.best
        used = edits.tenants_used(ops)
        names = edits.dense_tenant_names(used)

        def under(rename: dict, new_ops) -> Candidate:
            weights = {rename.get(t, t): w for t, w in cand.tenants if t in used}
            config_w = {rename.get(t, t): w for t, w in cand.config.tenant_weights.items() if t in used}
            return Candidate(tuple(new_ops), tuple(sorted(weights.items())),
                             dataclasses.replace(cand.config, tenant_weights=config_w))

        renamed = under(names, edits.rename_tenants(ops, names))
        if renamed.key() != cand.key() and self.fails(renamed):
            return
        kept = under({}, ops)
        if kept.key() != cand.key():
            self.fails(kept)

    def budget(self) -> None:
        lo, hi = 1, self.best.config.num_blocks  # hi fails
        while lo < hi:
            mid = (lo + hi) // 2
            if self.fails(dataclasses.replace(
                    self.best, config=dataclasses.replace(self.best.config, num_blocks=mid))):
                hi = mid
            else:
                lo = mid + 1

    def block_size(self) -> None:
        if any(getattr(op, "block_hashes", None) for op in self.best.ops):
            return  # the hashes name blocks of this size
        config = self.best.config
        b = 1
        while b < config.block_size:
            slots = config.num_blocks * config.block_size
            smaller = dataclasses.replace(config, block_size=b, num_blocks=-(-slots // b))
            if self.fails(dataclasses.replace(self.best, config=smaller)):
                return
            b *= 2


def shrink(trace: Trace, backend_factory: BackendFactory, config: CacheConfig, *,
           gather: str = "touched", max_seconds: float = DEFAULT_MAX_SECONDS,
           max_attempts: int = DEFAULT_MAX_ATTEMPTS, progress: Callable[[ShrinkStatus], None] | None = None,
           backend: str | None = None, source: str | None = None) -> ShrinkResult:
    """Cut ``trace`` down to a small trace on which ``backend_factory(config)`` fails the same way.

    ``backend_factory`` makes a fresh backend from a CacheConfig (a Backend subclass, or e.g.
    ``lambda c: registry.create(name, c)``); ``backend`` names it in the records (default: the
    factory's ``module:Class``); ``source`` names the trace (a path) in the shrunk trace's header.
    ``gather`` is check()'s. The search stops when no move helps, after ``max_seconds`` (a
    replay under way stops there too; the cut after the failure may take CUT_GRACE more) or
    ``max_attempts`` replays, or on Ctrl-C, and returns the smallest failing trace found so far.
    This signature is stable: the results pages and the fault catalogue call it.
    """
    label = backend or _label(backend_factory)
    result = ShrinkResult("shrunk", trace, config, label, gather=gather)
    s = _Shrinker(trace, backend_factory, gather, max_seconds, max_attempts, progress)
    first = Candidate(tuple(trace.ops), tuple(sorted(trace.header.tenants.items())), config)
    try:
        out = s.outcome(first)
    except _Stop as stop:
        result.status, result.seconds = "out-of-time", s.elapsed()
        result.reason = (f"the first replay did not finish within {max_seconds:g} s ({stop.replayed} "
                         f"of {len(trace)} operations): nothing to shrink from; give more seconds")
        return result
    result.attempts, result.seconds = s.attempts, s.elapsed()
    if out.status == "pass":
        result.status = "passes"
        return result
    if out.status != "fail":
        result.status = "not-applicable" if out.status == "n/a" else "error"
        result.reason = out.reason if out.status != "invalid" else f"not a legal trace: {out.reason}"
        return result
    s.kind = result.kind = out.kind
    result.divergence = out.divergence
    try:
        s.fails(first, cut=False)
        s.run()
        result.stopped = "done"
    except _Stop as stop:
        result.stopped = stop.why
        try:  # the cut after the failure, even stopped at once, if it fits in the grace
            with contextlib.suppress(_Stop):
                s.cut(limited=False)
        except KeyboardInterrupt:
            result.stopped = "interrupted"
    except KeyboardInterrupt:
        result.stopped = "interrupted"
    best, d = s.best, s.best_outcome.divergence
    result.shrunk_config, result.shrunk_divergence = best.config, d
    result.attempts, result.seconds = s.attempts, s.elapsed()
    h = dataclasses.replace(trace.header, tenants=dict(best.tenants))
    origin = {"trace": source or trace.name, "family": trace.header.family,
              "generator": trace.header.generator, "seed": trace.header.seed, "ops": len(trace),
              "index": result.divergence.index, "step": result.divergence.step,
              "divergence": jsonable(result.divergence), "settings": settings_of(config),
              "gather": gather, "attempts": result.attempts, "seconds": round(result.seconds, 3),
              "stopped": result.stopped}
    result.trace = failure_trace(Trace(h, list(best.ops), trace.name), best.config, d,
                                 backend=label, source=origin, name=f"{trace.name}.min")
    return result


__all__ = ["shrink", "ShrinkResult", "ShrinkStatus", "Outcome", "replay", "divergence_kind",
           "DEFAULT_MAX_SECONDS", "DEFAULT_MAX_ATTEMPTS"]
