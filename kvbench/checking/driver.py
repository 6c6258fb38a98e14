"""The replay rules, stated once: which backend calls each trace operation makes.

One trace operation may take several calls. A sequence that was evicted is recomputed
(re-prefilled to its current length) in the same step, before the operation touches it. A prefill
or fork refused for lack of memory leaves its sequence refused, and later operations on it are
dropped. A preempted sequence (SPEC §13) is told to a backend with its own preempt and resume
(``takes_lifecycle(backend, "preempt")``) as a preempt, and its resume, or the first operation
that touches it, is that backend's resume; to any other backend the preemption is a free and the
resume a prefill of all its tokens (a recompute). A free of an evicted sequence calls nothing:
the backend dropped it when it evicted it; a free of a sequence preempted by the backend's own
preempt is its free (it drops what it kept). An accept settles the drafts of its sequence's last append; where that append
was dropped, so is the accept.

Two sides replay by these rules. :func:`replay` drives a backend alone and follows the victims it
reports; the asv suite and the exact gates time and measure it. The checker (checker.py) drives
the backend beside the oracle and follows the oracle's victims, to which it holds the backend's.
"""
from __future__ import annotations

from math import fsum

from kvbench.contract.protocol import OutOfMemory, Prompt, takes_lifecycle


class Driver:
    """The rules of :mod:`this module <kvbench.checking.driver>`, one method per trace operation
    (named as the operation). A side supplies the calls (``call_*``), ``restore`` and what it knows
    of a sequence (``needs_restore``, ``dropped``); the hooks (``touch``, ``releasing``) default to
    nothing."""

    def __init__(self, trace):
        self.final = trace.final_lengths()
        self.refused: set = set()  # sequences whose prefill or fork was refused
        self.drafted: dict = {}  # sequence -> draft tokens its last append wrote, not yet accepted
        self.told: set = set()  # preempted through the backend's own preempt: it keeps their requests

    # --- what a side supplies ---------------------------------------------------------------------

    def needs_restore(self, seq) -> bool:
        """Whether ``seq`` is evicted or preempted: recomputed (or swapped in) before its next use."""
        raise NotImplementedError

    def dropped(self, seq) -> bool:
        """Whether the backend no longer holds ``seq`` at all (so a free calls nothing)."""
        return self.needs_restore(seq) and seq not in self.told

    def restore(self, seq, protect):
        """Recompute ``seq``; its victims, or None when it does not fit."""
        raise NotImplementedError

    def touch(self, seq) -> None:
        """An operation re-touches ``seq`` (before restoring it)."""

    def releasing(self, seq) -> None:
        """``seq`` is about to be freed or preempted while the backend still holds it."""

    # --- the rules ----------------------------------------------------------------------------------

    def apply(self, op) -> None:
        getattr(self, op.kind)(op)

    def prefill(self, op) -> None:
        if self.call_prefill(op) is None:
            self.refused.add(op.seq)

    def append(self, op) -> None:
        drafts = op.draft or (0,) * len(op.seqs)
        pairs = [(s, t, d) for s, t, d in zip(op.seqs, op.tokens, drafts) if s not in self.refused]
        seqs = [s for s, _, _ in pairs]
        for s in seqs:
            self.touch(s)
            if self.needs_restore(s) and self.restore(s, set(seqs)) is None:
                return
        if not seqs:
            return
        if self.call_append(op, pairs) is None:
            return
        self.drafted.update((s, d) for s, _, d in pairs if d)

    def fork(self, op) -> None:
        if op.src in self.refused:
            self.refused.add(op.seq)
            return
        self.touch(op.src)
        if self.needs_restore(op.src) and self.restore(op.src, {op.src, op.seq}) is None:
            self.refused.add(op.seq)
            return
        if self.call_fork(op) is None:
            self.refused.add(op.seq)

    def free(self, op) -> None:
        if op.seq in self.refused:
            return
        if not self.needs_restore(op.seq):  # still there to read
            self.releasing(op.seq)
        self.drafted.pop(op.seq, None)
        self.call_free(op, self.dropped(op.seq))
        self.told.discard(op.seq)

    def accept(self, op) -> None:
        drafted = self.drafted.pop(op.seq, None)
        if drafted is None:  # its speculative append was refused or dropped: so is this
            return
        if self.needs_restore(op.seq) and self.restore(op.seq, {op.seq}) is None:
            return  # evicted since, and no room to recompute it with its drafts
        self.call_accept(op, drafted)

    def preempt(self, op) -> None:
        if op.seq in self.refused or self.needs_restore(op.seq):
            return  # refused, or already evicted: nothing left to free
        self.releasing(op.seq)
        self.call_preempt(op)

    def resume(self, op) -> None:
        if op.seq in self.refused or not self.needs_restore(op.seq):
            return  # refused; or recomputed already (an operation before needed it)
        self.restore(op.seq, {op.seq})  # no room: the next use recomputes it


class _Alone(Driver):
    """The backend alone: what it evicted is what its calls returned."""

    def __init__(self, backend, trace, kv):
        super().__init__(trace)
        self.backend, self.kv = backend, kv
        self.length, self.tenant, self.hashes = {}, {}, {}
        self.evicted: set = set()
        self.counts = {"evictions": 0, "recomputed_tokens": 0, "ooms": 0}

    def data(self, n):
        return None if self.kv is None else self.kv[:n]

    def run(self, call):
        """``call()``'s victims, recorded; None when it ran out of memory."""
        try:
            victims = tuple(call() or ())
        except OutOfMemory:
            self.counts["ooms"] += 1
            return None
        self.counts["evictions"] += len(victims)
        self.evicted.update(victims)
        return victims

    def needs_restore(self, seq) -> bool:
        return seq in self.evicted

    def restore(self, seq, protect):
        n, protect = self.length[seq], tuple(protect)
        if seq in self.told:  # the backend kept its request
            got = self.run(lambda: self.backend.resume(seq, self.data(n), step=self.step,
                                                       protect=protect))
        else:
            prompt = Prompt(n, self.tenant[seq], self.final[seq], self.hashes.get(seq))
            got = self.run(lambda: self.backend.prefill(seq, prompt, self.data(n), step=self.step,
                                                        protect=protect))
        if got is not None:
            self.evicted.discard(seq)
            self.told.discard(seq)
            self.counts["recomputed_tokens"] += n
        return got

    def call_prefill(self, op):
        prompt = Prompt(op.tokens, op.tenant, self.final[op.seq], op.block_hashes,
                        prompt_tokens=op.prompt_tokens)
        got = self.run(lambda: self.backend.prefill(op.seq, prompt, self.data(op.tokens),
                                                    step=op.step))
        if got is not None:
            self.length[op.seq], self.tenant[op.seq] = op.tokens, op.tenant
            if op.block_hashes:  # a recompute hits the prompt's cached blocks, as the checker's
                self.hashes[op.seq] = op.block_hashes
        return got

    def call_append(self, op, pairs):
        seqs, toks = [s for s, _, _ in pairs], [t for _, t, _ in pairs]
        got = self.run(lambda: self.backend.append(seqs, toks, self.data(sum(toks)), step=op.step))
        if got is not None:
            for s, t in zip(seqs, toks):
                self.length[s] += t
        return got

    def call_fork(self, op):
        got = self.run(lambda: self.backend.fork(op.seq, op.src, final_tokens=self.final[op.seq],
                                                 step=op.step))
        if got is not None:
            self.length[op.seq], self.tenant[op.seq] = self.length[op.src], self.tenant[op.src]
        return got

    def call_free(self, op, dropped) -> None:
        if not dropped:
            self.backend.free(op.seq, step=op.step)
        self.evicted.discard(op.seq)
        self.length.pop(op.seq, None)

    def call_accept(self, op, drafted) -> None:
        if self.run(lambda: self.backend.accept(op.seq, op.n, drafted=drafted, step=op.step)) is not None:
            self.length[op.seq] -= drafted - op.n

    def call_preempt(self, op) -> None:
        if takes_lifecycle(self.backend, "preempt"):
            self.backend.preempt(op.seq, op.mode, tier=op.tier, step=op.step)
            self.told.add(op.seq)
        else:  # by recompute: its resume prefills it again
            self.backend.free(op.seq, step=op.step)
        self.evicted.add(op.seq)


def replay(backend, trace, kv=None, after_op=None) -> dict:
    """Drive ``backend`` through ``trace`` by the replay rules, with no oracle beside it.

    ``kv``: a buffer (zeros) sliced for each call, at least as long as the largest, or None for a
    ledger-only backend. ``after_op(op)`` is called after every operation. Returns counts:
    evictions, recomputed_tokens, ooms. Tier operations (SPEC §11) are the checker's alone.
    """
    steps = replay_steps(backend, trace, kv)
    counts = next(steps)
    for op, _ in zip(trace.ops, steps):
        if after_op is not None:
            after_op(op)
    return counts


def replay_steps(backend, trace, kv=None):
    """:func:`replay` one operation at a time, a generator: it yields its counts (one dict,
    updated in place) before the first operation and after each (the ratio gates time it op by
    op beside the checker's replay)."""
    if trace.header.tiers:
        raise ValueError(f"{trace.name}: the replay without oracle does not drive tiers")
    side = _Alone(backend, trace, kv)
    yield side.counts
    for op in trace.ops:
        side.step = op.step
        side.apply(op)
        yield side.counts


def replay_figures(backend, trace, kv=None) -> dict:
    """:func:`replay`, reading the backend's own ledger after every operation: lower-is-better
    figures (the asv suite tracks them and the exact gates hold them).

    Wasted slots are internal plus external fragmentation (slots that will never hold a token;
    reservation, the slots later tokens of the same sequence will fill, is not waste). Means are
    over operations, summed with math.fsum so that they do not depend on summation order.
    ``peak_blocks`` is None for a layout without blocks.
    """
    rows = []

    def sample(op):
        led = backend.ledger()
        rows.append((led.blocks_used, led.bytes_in_use, led.fragmentation,
                     led.internal_fragmentation + led.external_fragmentation))

    counts = replay(backend, trace, kv, sample)
    n = len(rows) or 1
    blocks = [r[0] for r in rows if r[0] is not None]
    return {
        "peak_blocks": max(blocks) if blocks else None,
        "peak_bytes": max((r[1] for r in rows), default=0),
        "final_fragmentation": rows[-1][2] if rows else 0.0,
        "mean_fragmentation": fsum(r[2] for r in rows) / n,
        "peak_wasted_slots": max((r[3] for r in rows), default=0),
        "mean_wasted_slots": fsum(r[3] for r in rows) / n,
        **counts,
    }
