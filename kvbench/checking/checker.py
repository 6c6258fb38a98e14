"""The checker: replay a trace through a backend and the oracle side by side.

Over 500 lines: the replay's state (the oracle, the backend, what each operation changed, the
refused and evicted sequences) is shared by every backend call, comparison and K/V window;
what stands alone lives beside it (content.py, identities.py, series.py).

After every trace operation it compares the backend's ledger, the victims it chose and the K/V it
returns with what the oracle derives from the formulas. Its verdict is data: valid or not, and the
first divergence (trace, step, operation, quantity, expected, actual), small enough to reproduce.

K/V content is verified where an operation could have changed it, at a cost that does not
grow with sequence length: the positions it wrote (from the start of a tail block it may have
copied on write), the same block of every sequence that shared that tail, a whole sequence when
it is created (prefill, prefix hit, recompute, fork) and before it is freed, a seeded random
window of one live sequence per operation (so that a write into a wrong slot anywhere is caught),
and every live sequence at the end. The window is read through ``gather(..., out=)`` into a
buffer where the backend's gather takes ``out``. ``gather='all'`` verifies every live sequence
after every operation instead.

Which backend calls each trace operation makes (a recompute of an evicted sequence before the
operation touches it, the refused sequences whose later operations are dropped) are the replay
rules of driver.py, the same for the backend alone. A recompute gets the content the sequence
had. Each call is atomic on its own.

Three verdicts, never mixed up: pass; FAIL, the backend diverged from the oracle or raised in any
call (prefill, append, fork, free, ledger, gather, close); ERROR, the harness could not do its part
(its own memory, a setting the trace cannot run under). A FAIL or ERROR keeps the traceback. The
K/V of a call are built only once the oracle says it fits (a refused one gets a view of one row
of zeros, which takes no memory).
"""
from __future__ import annotations

import dataclasses
import re
import time
import traceback

import numpy as np

from kvbench.checking import expectations, identities, tier_replay
from kvbench.checking.event_replay import EventReplay
from kvbench.checking.content import Content, LiveSet
from kvbench.checking.driver import Driver
from kvbench.contract.protocol import content_segments
from kvbench.model.oracle import ModelOOM, Oracle
from kvbench.checking.raised import (DEFAULT_OP_TIMEOUT, BackendRaised, BadReturn, described, guarded,
                                     shown, watching)
from kvbench.checking.applicable import applicable
from kvbench.model.tiered import TieredOracle
from kvbench.checking.verdict import OOM, SUCCESS, Divergence, Verdict, dict_diff, refusal_detail
from kvbench.contract.ledger import LEDGER_FIELDS, QUANTITIES, Ledger, named
from kvbench.contract.protocol import (Backend, OutOfMemory, Prompt, Refusal, _takes, kv_tokens,
                                       publishes_events, takes_lifecycle)
from kvbench.traces.format import Prefill, Trace, op_to_dict
from kvbench.traces.tier_ops import TIER_OPS

BLOCK_FIELDS = named(blocks=True)  # compared only for a paged layout
SAMPLE_WINDOW_BLOCKS = 4  # the random window verified after each operation, in blocks


class _Stop(Exception):
    def __init__(self, divergence: Divergence):
        self.divergence = divergence


def check(trace: Trace, backend: Backend | None, *, gather: str = "touched", series: bool = False,
          progress=None, model: Oracle | None = None, keep_going: bool = False,
          cache=None, op_timeout: float | None = DEFAULT_OP_TIMEOUT) -> Verdict:
    """Replay ``trace`` through ``backend`` and the oracle; the verdict names the first divergence.

    ``gather``: 'touched' verifies the K/V each operation could have changed (the positions it
    wrote, blocks copied on write and their sharers, new sequences whole, a sequence whole
    before it is freed, a seeded random window per operation, everything at the end); 'all'
    verifies every live sequence whole after every operation; 'end' only at the end; 'none'
    never. The ledger's per-sequence figures are compared for the sequences an operation
    touched, and for all of them at intervals as long as the live set (and at the end).

    With ``backend=None`` it replays the ``model`` (an Oracle, or a subclass such as the offline
    Belady policy) alone, by the same rules: its evictions, hits and usage, nothing compared.

    ``keep_going``: a ledger figure or block id that differs from the oracle's is recorded (its
    class, first divergence and count in ``verdict.divergences``) and the replay goes on, the
    oracle as it was; it still stops where going on would not be sound: an operation's outcome,
    its victims, K/V content, an identity the backend breaks about itself, a call that raises.

    ``cache``: a folder of stored expectations (kvbench.checking.expectations): the oracle's
    expected ledgers and usages are read from there where this trace, these settings and this
    oracle code stored them, and stored there when not (``verdict.expectations`` says which).

    ``op_timeout``: seconds one backend call may take (0 or None: no limit), past which the call
    is stopped and the backend FAILs naming it (kvbench.checking.raised.watching).
    """
    with watching(op_timeout):
        return _check(trace, backend, gather=gather, series=series, progress=progress, model=model,
                      keep_going=keep_going, cache=cache)


def _check(trace, backend, *, gather, series, progress, model, keep_going, cache) -> Verdict:
    if backend is None:
        return _replay(trace, None, model, Verdict(trace=trace.name, backend=f"model:{type(model).__name__}",
                                                   valid=True), gather="none", series=series,
                       progress=progress, writes_kv=False, quantized=False, keep_going=False,
                       cache=None)
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
        verdict.valid, verdict.not_applicable = None, str(Refusal(
            backend.name, "store quantized K/V", "SPEC §4", f"the run asks for {backend.config.kv_format}"))
        return verdict
    if caps.layout != "paged":
        verdict.skipped["blocks"] = f"{caps.layout} layout has no blocks"
    if not caps.copy_on_write and caps.layout == "paged":
        verdict.skipped["copy-on-write"] = "declared unsupported"
    oracle = oracle_for(trace, backend, verdict.skipped)
    if trace.header.tiers:
        backend.attach_tiers(trace.header.tiers)
    return _replay(trace, backend, oracle, verdict, gather=gather, series=series, progress=progress,
                   writes_kv=writes_kv, quantized=quantized, keep_going=keep_going, cache=cache)


def oracle_for(trace: Trace, backend: Backend, skipped: dict | None = None) -> Oracle:
    """The oracle check() holds ``backend`` to on ``trace``: its settings and capabilities, prefix
    caching off where the backend does not declare it (or the salts the trace names); why goes
    into ``skipped``."""
    caps, skipped = backend.capabilities, {} if skipped is None else skipped
    caching = backend.config.prefix_caching and caps.prefix_caching
    if backend.config.prefix_caching and not caps.prefix_caching:
        skipped["prefix caching"] = f"{backend.name} does not declare it: replayed without"
    layout = "paged" if caps.layout == "paged" else "contiguous"
    config = dataclasses.replace(backend.config, prefix_caching=caching)
    if trace.header.tiers:
        return TieredOracle(config, layout, caps, trace.header.tiers)
    return Oracle(config, layout=layout, capabilities=caps)


def _replay(trace, backend, oracle, verdict, *, gather, series, progress, writes_kv, quantized,
            keep_going, cache):
    """The replay loop of check(): ``backend`` None drives the oracle alone."""
    replay = _Replay(trace, backend, oracle, verdict, gather=gather, series=series,
                     writes_kv=writes_kv, quantized=quantized, keep_going=keep_going, cache=cache)
    last = len(trace.ops) - 1
    try:
        for index, op in enumerate(trace.ops):
            replay.index, replay.op = index, op
            changed = replay.apply(op)
            expected = replay.compare_ledger(changed, last=index == last)
            replay.verify_kv(changed, last=index == last)
            if replay.events is not None:
                replay.events.compare()
            if index == last and replay.tiered is not None:
                replay.tiered.end()
            if series:
                replay.record(expected)
            verdict.ops = index + 1
            if progress is not None:
                progress.update(1)
    except _Stop as stop:
        verdict.valid = False
        if verdict.divergences:  # kept going until here: this one is the last, not the first
            replay.count(stop.divergence, stopped=True)
        verdict.divergence = verdict.divergence or stop.divergence
        verdict.traceback = replay.traceback
    except Exception as e:  # the harness's own failure (its memory, a setting): never the backend's
        if isinstance(e, expectations.StaleExpectations):
            verdict.expectations = "stale"  # the caller runs the check again without them
        verdict.valid = None
        verdict.error = (f"{trace.name}: op #{replay.index} {op_to_dict(replay.op)}: the checker "
                         f"could not do its part: {type(e).__name__}: {e}")
        verdict.traceback = "".join(traceback.format_exception(e))
    replay.finish()
    return verdict


class _Replay(Driver):
    """One replay of a trace: the backend beside the oracle, operation by operation, by the
    replay rules of driver.py (this side follows the oracle's victims).

    Each operation fills ``changed``: sequence -> (start, stop) of the positions whose K/V it
    may have changed (stop None: to the end), or None when only its ledger entries changed.
    """

    def __init__(self, trace, backend, oracle, verdict, *, gather, series, writes_kv, quantized,
                 keep_going=False, cache=None):
        super().__init__(trace)
        self.trace, self.backend, self.oracle, self.verdict = trace, backend, oracle, verdict
        self.keep_going = keep_going
        self.gather, self.series, self.writes_kv, self.quantized = gather, series, writes_kv, quantized
        self.do_gather = gather != "none" and writes_kv
        self.paged = oracle.layout == "paged"
        self.fields = [f for f in LEDGER_FIELDS if self.paged or f not in BLOCK_FIELDS]
        self.keyed_calls = backend is not None and backend.capabilities.cache_salt
        self.figures = identities.Figures(backend, oracle, self.paged, verdict.skipped)
        self.unreported: set = set()
        self.model, self.dtype = oracle.config.model, oracle.config.kv_dtype
        self.kv = Content(backend, oracle, quantized) if self.do_gather else None
        self.live = LiveSet(seed=0)  # the seeded sample of each operation draws from it
        self.next_full = 0  # the operation whose ledger is compared whole next
        self.changed: dict = {}
        self.tenant_of = trace.tenant_of()
        self.touches: dict = {}  # tenant -> [hits, misses]
        self.index, self.op = -1, None
        self.traceback = ""
        self.tiered = tier_replay.TierReplay(self) if trace.header.tiers else None
        self.tells_preempt = backend is not None and takes_lifecycle(backend, "preempt")
        self.tape, self.recorder = expectations.open_for(trace, oracle, gather, cache) \
            if backend is not None else (None, None)
        self.usage = None  # the tenants' usage after this operation
        self.events = None  # SPEC §14: the backend's KV events, where it publishes them
        if backend is not None and oracle.caching:
            if publishes_events(backend):
                self.events = EventReplay(self)
            else:
                verdict.skipped["events"] = f"{backend.name} publishes no KV events"

    def diverge(self, quantity, expected, actual, detail="", *, soft=False):
        """Stop at this divergence; with ``keep_going``, a ``soft`` one (a figure or block id that
        differs, the states still comparable) is counted and the replay goes on."""
        op = self.op
        if isinstance(op, Prefill):
            leak = identities.cross_salt(self.oracle, op.seq, quantity, expected, actual)
            detail = "; ".join(x for x in (detail, leak) if x)
        d = Divergence(self.trace.name, self.index, op.step, op_to_dict(op), quantity, expected,
                       actual, detail)
        if not (soft and self.keep_going):
            raise _Stop(d)
        self.count(d)

    def count(self, d: Divergence, stopped: bool = False) -> None:
        """One more divergence of its class (its quantity, sequence and block ids left out)."""
        verdict = self.verdict
        verdict.valid = False
        verdict.divergence = verdict.divergence or d
        kind = re.sub(r"\d+", "N", d.quantity)
        for c in verdict.divergences:
            if c["kind"] == kind:
                c["count"] += 1
                c["stopped"] = c["stopped"] or stopped
                return
        verdict.divergences.append({"kind": kind, "first": d, "count": 1, "stopped": stopped})

    def raised(self, e: BackendRaised | BadReturn, expected=SUCCESS):
        """A backend call that raised: the divergence names the call and what the oracle expected;
        or that returned what it must not: the call, what it returned and what it should have."""
        if isinstance(e, BadReturn):
            self.diverge(f"what {e.what} returned", e.wanted, shown(e.value))
        self.traceback = e.traceback
        self.diverge(f"outcome of {e.what}", expected, described(e.error))

    def ask(self, what: str, fn, *args):
        """A backend query (ledger, a tier's figures): its exception is the backend's FAIL."""
        try:
            return guarded(what, fn, *args)
        except BackendRaised as e:
            self.raised(e)

    def ask_ledger(self, *seqs) -> Ledger:
        """The backend's ledger (``ledger(*seqs)``); an exception or anything but a Ledger is the
        backend's FAIL."""
        led = self.ask("ledger", self.backend.ledger, *seqs)
        if not isinstance(led, Ledger):
            self.raised(BadReturn("ledger", led, "a Ledger"))
        return led

    @staticmethod
    def victims(what: str, got) -> tuple:
        """The sequences a call says it evicted: None or an iterable of ids, else BadReturn (its
        iteration is the backend's code: guarded)."""
        if got is None:
            return ()
        if isinstance(got, (str, bytes)) or not hasattr(got, "__iter__"):
            raise BadReturn(what, got, "the sequences it evicted (an iterable of ids, or None)")
        return guarded(what, tuple, got)

    def kv_for(self, tokens: int, fits: bool, build):
        """The K/V of a call of ``tokens`` tokens: ``build()`` when the oracle says it fits; a
        view of one row of zeros, taking no memory, when it says it does not (a correct backend
        refuses it before writing); None for a backend that stores no K/V."""
        if not self.writes_kv:
            return None
        if fits:
            return build()
        row = np.zeros((1,) + self.model.kv_shape, self.dtype)  # writable, so that torch takes it without a warning
        return np.lib.stride_tricks.as_strided(row, (tokens,) + row.shape[1:],
                                               (0,) + row.strides[1:], writeable=True)

    def content(self, seq, segments):
        """The K/V a sequence wrote or inherited, from its segments [(writer, start, count)]."""
        writers = np.repeat([w for w, _, _ in segments], [c for _, _, c in segments]) \
            if segments else np.zeros(0, np.int64)
        return kv_tokens(writers, np.arange(len(writers)), self.model, self.dtype)

    @staticmethod
    def chunked(prompt_tokens) -> dict:
        """A chunked prefill's whole-prompt length, to pass where there is one."""
        return {} if prompt_tokens is None else {"prompt_tokens": prompt_tokens}

    def told_prompt(self, tokens, tenant, final, hashes, prompt_tokens, keys) -> Prompt:
        """A prefill's (or a recompute's) Prompt as this backend is told it: the salt, adapter
        and token ids (``keys``) only where it declares ``cache_salt``."""
        told = {k: keys.get(k) for k in ("salt", "adapter", "token_ids")} if self.keyed_calls else {}
        return Prompt(tokens, tenant, final, hashes, prompt_tokens=prompt_tokens, **told)

    def mark(self, seq, start=0, stop=None, *, kv=True) -> None:
        """``seq``'s entries of the ledger, and (``kv``) its K/V over ``start .. stop-1``, may
        have changed in this operation."""
        new = (start, stop) if kv else None
        old = self.changed.get(seq)
        if old is None or new is None:
            self.changed[seq] = new or old
            return
        lo = min(old[0], start)
        hi = None if old[1] is None or stop is None else max(old[1], stop)
        self.changed[seq] = (lo, hi)

    # --- one backend call beside the same oracle call ------------------------------------------

    def call(self, what, backend_call, oracle_call, tokens: int = 0, build_kv=None):
        """Returns the victims, None on out-of-memory (on both sides, or it diverges).

        ``backend_call(kv)`` gets the call's K/V, built by ``build_kv()`` only if the oracle
        says the call fits (``tokens`` of them)."""
        backend, verdict = self.backend, self.verdict
        try:
            expected = oracle_call()
        except ModelOOM:
            expected = None
        for v in expected or ():
            self.mark(v, kv=False)
        if backend is None:
            verdict.ooms += expected is None
            verdict.evictions += len(expected or ())
            return None if expected is None else tuple(expected)
        kv = self.kv_for(tokens, expected is not None, build_kv) if build_kv else None
        outcome = OOM if expected is None else SUCCESS
        before = self.ask_ledger() if expected is None else None
        t0 = time.perf_counter()
        try:
            got = guarded(what, backend_call, kv)
            verdict.backend_seconds += time.perf_counter() - t0
            actual = self.victims(what, got)
        except OutOfMemory:
            verdict.backend_seconds += time.perf_counter() - t0
            actual = None
        except (BackendRaised, BadReturn) as e:
            self.raised(e, outcome)
        if (expected is None) != (actual is None):
            self.diverge(f"outcome of {what}", outcome, OOM if actual is None else SUCCESS,
                         "the oracle finds no room even after evicting every candidate"
                         if expected is None else "the backend refused an operation that fits")
        if expected is None:
            verdict.ooms += 1
            after = self.ask_ledger()
            for f in self.fields:
                if getattr(after, f) != getattr(before, f):
                    self.diverge(f"{f} after a refused {what}", getattr(before, f), getattr(after, f),
                                 refusal_detail(before, after))
            return None
        if list(expected) != list(actual):
            self.diverge("victims", list(expected), list(actual))
        verdict.evictions += len(actual)
        return actual

    def needs_restore(self, seq) -> bool:
        return seq in self.oracle.preempted

    def dropped(self, seq) -> bool:
        return seq in self.oracle.preempted and seq not in self.told and not (
            self.tiered is not None and seq in self.oracle.swapped)

    def releasing(self, seq) -> None:
        if self.gather == "touched":
            self.verify([(seq, 0, None)])  # whole, while it is still there to read

    def touch(self, seq):
        """Count a re-touch: a hit if the sequence is resident, a miss if it was evicted."""
        miss = seq in self.oracle.preempted
        self.verdict.misses += miss
        self.verdict.hits += not miss
        self.touches.setdefault(self.tenant_of[seq], [0, 0])[miss] += 1

    def restore(self, seq, protect):
        """Recompute an evicted sequence (its old content, its current length) before the op;
        swap a swapped one in."""
        if self.tiered is not None and seq in self.oracle.swapped:
            got = self.tiered.swap_in(seq, protect)
            if got is not None:
                self.told.discard(seq)
            return got
        st = self.oracle.preempted[seq]
        segments = list(st.segments)
        step = self.op.step
        if seq in self.told:  # the backend kept its request: its resume, told nothing more
            what, backend_call = "resume", lambda kv: self.backend.resume(
                seq, kv, step=step, protect=tuple(protect))
        else:
            prompt = self.told_prompt(st.tokens, st.tenant, st.final, st.prompt.get("hashes"),
                                      st.prompt.get("prompt_tokens"), st.prompt)
            what, backend_call = "recompute", lambda kv: self.backend.prefill(
                seq, prompt, kv, step=step, protect=tuple(protect))
        got = self.call(what, backend_call, lambda: self.oracle.recompute(seq, step, protect),
                        st.tokens, lambda: self.content(seq, segments))
        if got is not None:
            self.told.discard(seq)
            self.verdict.recomputed_tokens += st.tokens
            self.mark(seq)
        return got

    # --- the trace operations' calls: each marks what it may have changed -----------------------

    def apply(self, op) -> dict:
        self.changed = {}
        if isinstance(op, TIER_OPS) or (self.tiered and self.tiered.looked_up(op)):
            self.tiered.apply(op)  # SPEC §11's transfers, and a looked-up request's free: the tier replay's
        else:
            super().apply(op)
        for s in self.changed:
            if s in self.oracle.seqs:
                self.live.add(s)
            else:
                self.live.discard(s)
                if self.kv is not None:
                    self.kv.forget(s)
        return self.changed

    def call_prefill(self, op):
        oracle = self.oracle

        keys = dict(salt=op.salt, adapter=op.adapter, token_ids=op.token_ids)

        def kv():  # the prompt's K/V as the oracle sees them (a keyed block holds its prefix's)
            segments = content_segments(op.seq, op.tokens, oracle.prompt_keys(
                op.prompt_tokens or op.tokens, op.block_hashes, **keys), oracle.B)
            return self.content(op.seq, segments)

        chunked = self.chunked(op.prompt_tokens)
        prompt = self.told_prompt(op.tokens, op.tenant, self.final[op.seq], op.block_hashes,
                               op.prompt_tokens, keys)
        got = self.call("prefill",
                        lambda kv: self.backend.prefill(op.seq, prompt, kv, step=op.step),
                        lambda: oracle.prefill(op.seq, op.tokens, op.tenant, self.final[op.seq],
                                               op.step, hashes=op.block_hashes, **keys, **chunked),
                        op.tokens, kv)
        if got is not None:
            self.mark(op.seq)  # whole: a prefix hit reads blocks other sequences wrote
        return got

    def call_append(self, op, pairs):
        oracle = self.oracle
        seqs = [s for s, _, _ in pairs]
        toks = np.array([t for _, t, _ in pairs], dtype=np.int64)
        starts = np.array([oracle.seqs[s].tokens for s in seqs], dtype=np.int64)
        sharers = self._tail_sharers(seqs)
        drafts = [d for _, _, d in pairs] if op.draft else None
        # Draft tokens and a chunked prompt's blocks have writers of their own (the oracle's).
        special = drafts or any("chunk_keys" in oracle.seqs[s].prompt for s in seqs)
        segments = [seg for s, t, d in pairs for seg in oracle.append_segments(s, t, d, op.step)] \
            if special else None  # before the oracle writes them

        def kv():
            if special:
                writers = np.repeat([w for w, _, _ in segments], [c for _, _, c in segments])
                positions = np.concatenate([np.zeros(0, np.int64)]  # none: an append of zero tokens
                                           + [np.arange(a, a + c) for _, a, c in segments])
                return kv_tokens(writers, positions, self.model, self.dtype)
            writers = np.repeat(np.asarray(seqs, dtype=np.int64), toks)
            positions = np.arange(int(toks.sum())) + np.repeat(starts - (np.cumsum(toks) - toks), toks)
            return kv_tokens(writers, positions, self.model, self.dtype)

        toks_list = toks.tolist()
        told = {"draft": drafts} if drafts and self.backend is not None and \
            _takes(type(self.backend), "append", "draft") else {}  # to a backend that takes it
        got = self.call("append",
                        lambda kv: self.backend.append(seqs, toks_list, kv, step=op.step, **told),
                        lambda: oracle.append(seqs, toks_list, op.step,
                                              **({"drafts": drafts} if drafts else {})),
                        sum(toks_list), kv)
        if got is None:
            return None
        B = oracle.B if oracle.layout == "paged" else 1
        for s, start in zip(seqs, starts.tolist()):
            self.mark(s, start // B * B)  # from the tail block on: it may have been copied
        for s, start in sharers.items():  # a write into their block must not show in their reads
            self.mark(s, start, start + B)
        return got

    def _tail_sharers(self, seqs) -> dict:
        """Other live sequences that share the partial tail block a writer of ``seqs`` is about to
        write into: {sequence: first position of that block}."""
        oracle = self.oracle
        if oracle.layout != "paged" or not self.do_gather:
            return {}
        tails = {}
        for s in seqs:
            st = oracle.seqs[s]
            if st.table and st.table[-1] is not None and st.tokens % oracle.B \
                    and oracle.blocks[st.table[-1]][0] > 1:
                tails[st.table[-1]] = len(st.table) - 1
        if not tails:
            return {}
        return {t: i * oracle.B for t, st in oracle.seqs.items() for b, i in tails.items()
                if len(st.table) > i and st.table[i] == b}

    def call_fork(self, op):
        got = self.call("fork",
                        lambda kv: self.backend.fork(op.seq, op.src,
                                                     final_tokens=self.final[op.seq], step=op.step),
                        lambda: self.oracle.fork(op.seq, op.src, self.final[op.seq], op.step))
        if got is not None:
            self.mark(op.seq)
            self.mark(op.src, kv=False)
        return got

    def call_free(self, op, dropped) -> None:
        swapped = self.tiered is not None and op.seq in self.oracle.swapped  # a tier holds it
        self.oracle.free(op.seq)
        self.mark(op.seq, kv=False)
        if self.backend is not None and not dropped:
            self.free_call(op.seq, op.step)
        if swapped:  # its blocks left the tier
            self.tiered.compare()

    def free_call(self, seq, step) -> None:
        """The backend's free of ``seq``; its exception is the backend's FAIL."""
        self.releasing_call("free", self.backend.free, seq, step=step)

    def releasing_call(self, what, fn, *args, **kwargs) -> None:
        """A backend call that only gives back (a free, a preempt); its exception, out of memory
        included, is the backend's FAIL."""
        t0 = time.perf_counter()
        try:
            guarded(what, fn, *args, **kwargs)
        except OutOfMemory as e:
            self.raised(BackendRaised(what, e))
        except BackendRaised as e:
            self.raised(e)
        self.verdict.backend_seconds += time.perf_counter() - t0

    def call_accept(self, op, drafted) -> None:
        """Keep ``n`` of the drafts (SPEC §13); the rolled-back positions are gone from the
        sequence, its tail block is read again."""
        new = self.oracle.seqs[op.seq].tokens - (drafted - op.n)
        self.call("accept", lambda kv: self.backend.accept(op.seq, op.n, drafted=drafted, step=op.step),
                  lambda: self.oracle.accept(op.seq, drafted, op.n, op.step))
        B = self.oracle.B if self.paged else 1
        self.mark(op.seq, max(0, new - B))

    def call_preempt(self, op) -> None:
        """Preemption (SPEC §13): by recompute the backend frees the sequence (or, having its
        own preempt, is told the preemption), the oracle keeps its content for the resume; by
        swap both move it to a tier (the tier replay's)."""
        self.mark(op.seq, kv=False)
        self.verdict.preemptions += 1
        if self.tells_preempt:
            self.told.add(op.seq)
        if op.mode == "swap":
            self.tiered.swap_out(op)
            return
        self.oracle.preempt(op.seq)
        if self.tells_preempt:
            self.releasing_call("preempt", self.backend.preempt, op.seq, "recompute", step=op.step)
        elif self.backend is not None:
            self.free_call(op.seq, op.step)

    # --- what is compared after every operation ------------------------------------------------

    def compare_ledger(self, changed: dict, last: bool):
        """The ledger's figures; per-sequence ones for the sequences the operation changed, and
        for every sequence at the end and once per as many operations as there are live ones
        (amortised O(1) per operation). Returns the expected ledger."""
        if self.backend is None:
            self.usage = self.oracle.tenant_usage() if self.series else None
            return self.oracle.expected_ledger(())
        whole = self.gather == "all" or last or self.index >= self.next_full
        if whole:
            self.next_full = self.index + max(1, len(self.oracle.seqs))
        seqs = None if whole else sorted(changed)
        expected = self.expected(seqs)
        actual = self.ask_ledger(seqs)
        try:
            why = self.figures.check(actual, seqs, last=last)
        except BackendRaised as e:
            self.raised(e)
        if why:
            self.diverge(*why)
        for f in self.fields:
            e, a = getattr(expected, f), getattr(actual, f)
            q = QUANTITIES[f]
            if q.optional and a is None:
                self.unreported.add(f)
                continue
            if q.tolerance:
                if abs(e - a) > q.tolerance:
                    self.confirm(expected, seqs)
                    self.diverge(f, e, a, soft=True)
                continue
            if seqs is not None and q.per_sequence:
                e = {s: e[s] for s in seqs if s in e}
                a = {s: a[s] for s in seqs if s in a}
            if e != a:
                self.confirm(expected, seqs)
                self.diverge(f, e, a, dict_diff(e, a) if isinstance(e, dict) else "", soft=True)
        why = self.figures.block_ids(seqs)
        if why:
            self.diverge(*why, soft=True)
        return expected

    def expected(self, seqs):
        """The oracle's expected ledger after this operation (``seqs``: as expected_ledger's),
        stored where this check's are; the tenants' usage into ``usage``."""
        tape, recorder = self.tape, self.recorder
        if tape is not None:
            self.usage = tape.usage(self.index) if self.series else None
            return tape.ledger(self.index)
        t0 = time.perf_counter()
        led = self.oracle.expected_ledger(seqs)
        self.usage = self.oracle.tenant_usage() if self.series or recorder else None
        if recorder is not None:
            recorder.add(led, self.usage, time.perf_counter() - t0)
        return led

    def confirm(self, expected, seqs) -> None:
        """A backend's figure differs from a stored one: the oracle's own must be the same."""
        if self.tape is not None and self.oracle.expected_ledger(seqs) != expected:
            raise self.tape.stale(f"the expected ledger after operation #{self.index}")

    def verify(self, ranges, into=None) -> None:
        """Compare the K/V of ``[(seq, start, stop)]`` (stop None: to the end), and of ``into``,
        read into a buffer of the checker's (see Content.mismatch)."""
        if self.kv is None or not (ranges or into):
            return
        try:
            bad, read = self.kv.mismatch(ranges, into)
        except (BackendRaised, BadReturn) as e:
            self.raised(e)
        self.verdict.gathers += read
        if bad:
            seq, *what = bad
            self.diverge(f"kv of sequence {seq}", *what)
        try:
            bad = self.kv.state_mismatch(sorted({r[0] for r in ranges if r[0] in self.oracle.seqs}))
        except (BackendRaised, BadReturn) as e:
            self.raised(e)
        if bad:
            seq, *what = bad
            self.diverge(f"state of sequence {seq}", *what)

    def verify_kv(self, changed: dict, last: bool) -> None:
        """Gather and compare the K/V that the ``gather`` mode names."""
        if not self.do_gather:
            return
        oracle, gather = self.oracle, self.gather
        loading = self.tiered.unreadable() if self.tiered else ()
        if gather == "all" or (gather in ("end", "touched") and last):
            self.verify([(s, 0, None) for s in sorted(oracle.seqs) if s not in loading])
            return
        if gather != "touched":
            return
        ranges = [(s, *changed[s]) for s in sorted(changed)
                  if changed[s] is not None and s in oracle.seqs and s not in loading]
        window = None
        if len(self.live):  # a seeded random window: a wrong slot anywhere shows up in time
            s = self.live.choice()  # read into a buffer: the gather(out=) path gets checked too
            window = (s, *self.live.window(oracle.seqs[s].tokens, SAMPLE_WINDOW_BLOCKS * oracle.B))
            if s in loading:  # drawn all the same, so that the draws do not depend on loads
                window = None
        self.verify(ranges, window)

    def record(self, expected) -> None:
        self.verdict.series.append(self.op.step, expected, self.usage)

    def finish(self) -> None:
        """Per-tenant figures and the final ledger into the verdict."""
        verdict, oracle = self.verdict, self.oracle
        verdict.tenants = {t: dict(st.__dict__) for t, st in sorted(oracle.tenant_stats.items())}
        for t, (hits, misses) in self.touches.items():
            verdict.tenants.setdefault(t, {"evictions": 0, "recomputed_tokens": 0}).update(
                hits=hits, misses=misses)
        final_ledger = oracle.expected_ledger()
        self.settle_expectations(final_ledger)
        own = self.backend_says("ledger")
        own = own if isinstance(own, Ledger) else None  # a wrong return was failed where it came
        verdict.hit_blocks = self.hit_blocks(own, final_ledger)
        if verdict.valid is False and own is not None:  # what the failing backend says it holds
            final_ledger = own
        verdict.final_ledger = {k: v for k, v in final_ledger.as_dict().items()
                                if not QUANTITIES[k].per_sequence}
        if self.unreported:
            verdict.skipped["figures"] = f"not reported: {', '.join(sorted(self.unreported))}"

    def backend_says(self, query: str):
        """The backend's answer to ``query`` at the end (ledger, tier_ledgers), None when it
        cannot say (no backend, no such query, it raises)."""
        call = getattr(self.backend, query, None)
        if call is None:
            return None
        try:
            return guarded(query, call)
        except (BackendRaised, OutOfMemory):
            return None

    def hit_blocks(self, own, expected) -> dict:
        """Prompt blocks found cached by the end, by where they were found (SPEC §11 "Hit
        accounting": the device, then each tier): {where: (the backend's, the oracle's)}, the
        backend's None where it cannot say."""
        hits = {"device": (None if own is None else own.prefix_hit_blocks,
                           expected.prefix_hit_blocks)}
        if self.tiered is not None:
            theirs = self.backend_says("tier_ledgers") or []
            for i, tier in enumerate(self.oracle.tiers.ledgers()):
                said = theirs[i] if i < len(theirs) and isinstance(theirs[i], dict) else {}
                hits[tier.name] = (said.get("hits"), tier.hits)
        return hits

    def settle_expectations(self, final_ledger) -> None:
        """Store this replay's expectations once it has gone through every operation; those read
        from a file must end where the oracle ends (else the check is an ERROR)."""
        verdict = self.verdict
        done = verdict.ops == len(self.trace.ops) and not verdict.error
        if self.recorder is not None and done and self.recorder.save():
            verdict.expectations = "stored"
        if self.tape is None or verdict.expectations == "stale":
            return
        verdict.expectations = "reused"
        verdict.expectations_saved = self.tape.recorded_seconds - self.tape.seconds
        if done and self.tape.ledger(len(self.trace.ops) - 1) != final_ledger:
            verdict.valid, verdict.error = None, str(self.tape.stale("the final ledger"))
            verdict.expectations = "stale"
