"""The checker's side of tiers and transfers (SPEC §11): each store, load, completion and abort
of a trace replayed through a backend that declares tiers, beside the TieredOracle.

A backend with tiers (``Capabilities.tiers``: the policies it runs) implements::

    attach_tiers(specs)                       the trace's tiers (TierSpec: name, capacity, policy)
    store(id, seq, tier, blocks=None, *, step)   begin a store (blocks: positions; None: all full)
    load(id, seq, prompt, kv, *, step, protect)
                                              a prefill served from the tiers; returns its victims
    complete(id, ok, kv=None, *, step)        a transfer's completion; kv: a failed load's blocks
                                              to compute again, [blocks * block_size, 2, L, H, D]
                                              (also an ok load's, one of whose tier entries a
                                              failed load removed under it: failed_read_removes_at_once)
    abort(seq, *, step)                       cancel seq's loads, free it (looked up, never
                                              loaded: release its lookup's pins)
    lookup(seq, prompt, *, step)              (a trace with lookups) pin the tier run a load of
                                              the prompt would read, for seq's coming load
    tier_ledgers()                            [{name, capacity, stored, storing, loading, free,
                                                bytes_down, bytes_up, hits}] tier 1 first
    read_stored(id)                           just after a store completed ok: {position: K/V of
                                              the block it stored, read back from the tier}

and, declaring ``Capabilities.swap``, preemption by swap (SPEC §13, as the TieredOracle models it)::

    swap_out(seq, tier, *, step)              every block of seq to the tier, then freed (or, if
                                              the tier cannot hold them, freed only)
    swap_in(seq, prompt, kv, *, step, protect)
                                              its resume: a prefill whose blocks past the device
                                              hit take the tier's K/V; returns its victims

(a backend with its own ``preempt`` and ``resume``, protocol.Backend's, is called
``preempt(seq, "swap", tier=tier)`` and ``resume(seq, kv)`` instead, and keeps the request).

When a transfer's bytes move is the backend's choice: at its begin, at its completion, or in
between. The trace orders other operations between a begin and its completion (a free of the
storing sequence, prefills and loads that take device blocks and evict cached ones, other
completions, aborts), and what is checked holds whatever the moment: a store's source blocks
are leased until it completes (a copy at completion reads what the sequence wrote), a load's
targets are its sequence's alone until it completes (no hit on them, nothing reads them).

What is checked: every per-tier figure against the oracle after each transfer operation, and
``stored + storing + free = capacity``, no count negative, ``loading <= stored``; at the end of
every store, the K/V of each block it stored, read back from the tier, against what the
sequence had written (so a copy made at completion from a block already reused shows); after
every load and swap-in, the sequence's K/V whole (the positions a tier holds were handed to the
backend as another writer's values, so one that writes those instead of the tier's shows); the device
ledger as after every operation (a leased block is in use); and, for a backend exposing its block
structures and declaring ``block_ids``, SPEC §10's structure identities with each store in flight
counted as one reference more on each block it copies, and each load's targets its sequence's
alone (identities.Figures' ``leases``).
"""
from __future__ import annotations

import numpy as np

from kvbench.contract.protocol import content_segments
from kvbench.checking.raised import BackendRaised, guarded
from kvbench.contract.protocol import kv_tokens
from kvbench.quant import pool as quant_pool
from kvbench.traces.ops import Free
from kvbench.traces.tier_ops import Done, Load, Lookup, Store

TIER_FIELDS = ("capacity", "stored", "storing", "loading", "free", "bytes_down", "bytes_up", "hits")


def segment_kv(segments, start: int, stop: int, model, dtype, shift: int = 0):
    """The K/V that ``segments`` [(writer, start, count)] put at positions start .. stop-1
    (``shift``: the same writers' values ``shift`` positions further on, a wrong copy's)."""
    writers = np.repeat([w for w, _, _ in segments], [c for _, _, c in segments])[start:stop]
    return kv_tokens(writers, np.arange(start, stop) + shift, model, dtype)


class TierReplay:
    """The transfer operations of one replay (``replay``: the checker's _Replay)."""

    def __init__(self, replay):
        self.r = replay
        self.dropped: set = set()  # transfer ids whose begin was refused or dropped on both sides
        self.loads: dict = {}  # load id -> (seq, first position, positions loaded)
        self.pinned: dict = {}  # (tier, key) a lookup pinned -> the block, its hash and salt, named
        if replay.backend is not None:
            if replay.backend.capabilities.block_ids:  # the oracle's block ids are the backend's
                tiers = replay.oracle.tiers
                replay.figures.leases = lambda: (tiers.leases, tiers.load_targets)
            elif replay.figures.structures:
                replay.figures.structures = False
                replay.verdict.skipped["block structures"] = (
                    f"tier replay: the leases are known by the oracle's block ids, and "
                    f"{replay.backend.name} does not declare block_ids")
            # what an engine's tiers cannot show here (its worker side needs CUDA, say)
            replay.verdict.skipped.update(getattr(replay.backend, "tier_skips", {}))

    def unreadable(self) -> set:
        """Sequences whose loads are in flight: their blocks are not readable yet."""
        return self.r.oracle.loading_seqs()

    def looked_up(self, op) -> bool:
        """A free of a sequence looked up and not loaded (the request cancelled in between)."""
        return isinstance(op, Free) and op.seq in self.r.oracle.tiers.pins

    def apply(self, op) -> None:
        if isinstance(op, Lookup):
            self.lookup(op)
        elif isinstance(op, Load):
            self.load(op)
        elif isinstance(op, Store):
            self.store(op)
        elif isinstance(op, Done):
            self.done(op)
        elif isinstance(op, Free):  # an abort, or a looked-up request's free
            self.abort(op)
        self.compare()

    def _backend(self, what, fn, *args, **kwargs):
        if self.r.backend is None:
            return None
        try:
            return guarded(what, fn, *args, **kwargs)
        except BackendRaised as e:
            self.r.raised(e)

    def load(self, op) -> None:
        r, oracle = self.r, self.r.oracle
        keys = dict(salt=op.salt, adapter=op.adapter, token_ids=op.token_ids)
        L, run, prompt = oracle.load_run(op.tokens, op.block_hashes, **keys)
        lo, hi = L * oracle.B, (L + len(run)) * oracle.B

        def kv():  # the loaded positions carry other values: a backend must take the tier's
            segments = content_segments(op.seq, op.tokens, prompt, oracle.B)
            return np.concatenate([segment_kv(segments, 0, lo, r.model, r.dtype),
                                   segment_kv(segments, lo, hi, r.model, r.dtype, shift=oracle.B),
                                   segment_kv(segments, hi, op.tokens, r.model, r.dtype)])

        told = r.told_prompt(op.tokens, op.tenant, r.final[op.seq], op.block_hashes, None, keys)
        got = r.call("load",
                     lambda kv: r.backend.load(op.id, op.seq, told, kv, step=op.step),
                     lambda: oracle.load(op.id, op.seq, op.tokens, op.tenant, r.final[op.seq], op.step,
                                         hashes=op.block_hashes, **keys),
                     op.tokens, kv)
        if got is None:
            r.refused.add(op.seq)
            self.dropped.add(op.id)
            return
        self.loads[op.id] = (op.seq, lo, hi)
        r.mark(op.seq, kv=False)  # its table is new; its K/V are read once the load completes

    def lookup(self, op) -> None:
        r = self.r
        keys = dict(salt=op.salt, adapter=op.adapter, token_ids=op.token_ids)
        prompt = r.oracle.prompt_keys(op.tokens, op.block_hashes, op.token_ids, op.salt, op.adapter)
        for key, tier in r.oracle.lookup(op.seq, op.tokens, op.block_hashes, **keys):
            p = prompt.index(key[1])
            h = op.block_hashes[p] if op.block_hashes else f"of token ids {p * r.oracle.B}.."
            self.pinned[(tier, key)] = f"block {p} (hash {h}, salt {op.salt!r}) looked up at step {op.step}"
        told = r.told_prompt(op.tokens, op.tenant, r.final.get(op.seq, op.tokens), op.block_hashes,
                             None, keys)
        self._backend("lookup", getattr(r.backend, "lookup", None), op.seq, told, step=op.step)

    def store(self, op) -> None:
        r, oracle = self.r, self.r.oracle
        if op.seq not in oracle.seqs:  # refused (or evicted) on both sides: nothing to store
            self.dropped.add(op.id)
            return
        oracle.store(op.id, op.seq, op.tier, op.blocks)
        self._backend("store", getattr(r.backend, "store", None), op.id, op.seq, op.tier, op.blocks,
                      step=op.step)
        r.mark(op.seq, kv=False)

    def done(self, op) -> None:
        r, oracle = self.r, self.r.oracle
        if op.id in self.dropped:
            return
        plan = oracle.store_plans.pop(op.id, None)
        kv = None
        if plan is None:
            seq, lo, hi = self.loads.pop(op.id)
            lost = oracle.tiers.transfers[op.id].lost  # tier rule failed_read_removes_at_once's
            if (not op.ok or lost) and r.writes_kv:  # computed again: the values the prompt has there
                kv = segment_kv(oracle.seqs[seq].segments, lo, hi, r.model, r.dtype)
        tr = oracle.done(op.id, op.ok)
        self._backend("complete", getattr(r.backend, "complete", None), op.id, op.ok, kv, step=op.step)
        if tr.kind == "load":
            r.mark(tr.seq)  # whole: the loaded blocks are readable now
            return
        if tr.seq in oracle.seqs:
            r.mark(tr.seq, kv=False)
        if op.ok and r.backend is not None and r.do_gather:
            self.read_back(op.id, *plan)

    def read_back(self, tid, positions, segments) -> None:
        """The K/V of each block store ``tid`` stored, read back from the tier."""
        r = self.r
        got = r.ask("read_stored", r.backend.read_stored, tid)
        if sorted(got) != sorted(positions):
            r.diverge(f"blocks stored by transfer {tid}", sorted(positions), sorted(got),
                      "the positions whose blocks the store copied down (held ones are skipped)")
        B = r.oracle.B
        for p in positions:
            want = segment_kv(segments, p * B, (p + 1) * B, r.model, r.dtype)
            have = np.asarray(got[p])
            if r.quantized:  # its codes dequantized: within SPEC §4's bound of what was written
                why = quant_pool.bound_violation(want, have, r.backend.config.kv_format, p * B)
                if why:
                    r.diverge(f"tier content of transfer {tid}", f"the K/V of position {p} within "
                              "the quantization bound", why, "read back from the tier at the "
                              "store's completion")
                continue
            if have.shape != want.shape or not np.array_equal(have, want):
                bad = "shape " + str(have.shape) if have.shape != want.shape else \
                    f"token {int(np.argwhere(have != want)[0][0])} of the block differs"
                r.diverge(f"tier content of transfer {tid}", f"the K/V of position {p}", bad,
                          "read back from the tier at the store's completion")

    def swap_out(self, op) -> None:
        r = self.r
        tier = op.tier or r.trace.header.tiers[0].name
        r.oracle.swap_out(op.seq, tier)
        if r.tells_preempt:
            self._backend("preempt", r.backend.preempt, op.seq, "swap", tier=tier, step=op.step)
        else:
            self._backend("swap_out", getattr(r.backend, "swap_out", None), op.seq, tier, step=op.step)
        self.compare()

    def swap_in(self, seq, protect):
        """The resume of a swapped sequence (before operation ``r.op``); its victims, None when
        it does not fit (it stays swapped)."""
        r, oracle = self.r, self.r.oracle
        st, step = oracle.preempted[seq], r.op.step
        segments = list(st.segments)

        def kv():  # past the device hit another writer's values: a backend must take the tier's
            lo = oracle.swap_hit * oracle.B
            return np.concatenate([segment_kv(segments, 0, lo, r.model, r.dtype),
                                   segment_kv(segments, lo, st.tokens, r.model, r.dtype,
                                              shift=oracle.B)])

        if seq in r.told:  # the backend kept its request
            what, backend_call = "resume", lambda kv: r.backend.resume(
                seq, kv, step=step, protect=tuple(protect))
        else:
            told = r.told_prompt(st.tokens, st.tenant, st.final, st.prompt.get("hashes"),
                                 st.prompt.get("prompt_tokens"), st.prompt)
            what, backend_call = "swap_in", lambda kv: r.backend.swap_in(
                seq, told, kv, step=step, protect=tuple(protect))
        got = r.call(what, backend_call, lambda: oracle.swap_in(seq, step, protect), st.tokens, kv)
        if got is not None:
            r.mark(seq)  # whole
        self.compare()
        return got

    def abort(self, op) -> None:
        r, oracle = self.r, self.r.oracle
        if op.seq in oracle.tiers.pins and op.seq not in oracle.seqs:  # looked up, not loaded
            oracle.abort(op.seq)
            self._backend("abort", getattr(r.backend, "abort", None), op.seq, step=op.step)
            return
        if op.seq in r.refused:
            return
        if op.seq in oracle.preempted:  # off the backend already, and no load in flight: a free
            return r.free(op)
        if op.seq not in self.unreadable() and r.gather == "touched" and op.seq in oracle.seqs:
            r.verify([(op.seq, 0, None)])
        for tid, _ in oracle.abort(op.seq):
            self.loads.pop(tid, None)
        r.mark(op.seq, kv=False)
        self._backend("abort", getattr(r.backend, "abort", None), op.seq, step=op.step)

    def compare(self) -> None:
        """Each tier's figures: its identities, then against the oracle's."""
        r = self.r
        if r.backend is None:
            return
        expected = [t.as_dict() for t in r.oracle.tiers.ledgers()]
        actual = r.ask("tier_ledgers", r.backend.tier_ledgers)
        if len(actual) != len(expected):
            r.diverge("tiers", len(expected), len(actual), "tier_ledgers() gives one per tier")
        for i, (e, a) in enumerate(zip(expected, actual)):
            name = e["name"]
            negative = [f for f in TIER_FIELDS if a.get(f, 0) < 0]
            if negative:
                r.diverge(f"tier {name} {negative[0]}", ">= 0", a[negative[0]], "no count is negative")
            if a["stored"] + a["storing"] + a["free"] != a["capacity"]:
                r.diverge(f"tier {name} stored + storing + free", a["capacity"],
                          a["stored"] + a["storing"] + a["free"], "SPEC §11: = capacity")
            if a["loading"] > a["stored"]:
                r.diverge(f"tier {name} loading", f"<= stored ({a['stored']})", a["loading"],
                          "a load reads stored blocks")
            for f in TIER_FIELDS:
                if e[f] != a.get(f):
                    r.diverge(f"tier {name} {f}", e[f], a.get(f),
                              self.released(i) if f == "loading" else "", soft=True)

    def released(self, tier: int) -> str:
        """The lookups' pins of ``tier`` released by now, named by key and salt."""
        entries = self.r.oracle.tiers.tiers[tier].entries
        gone = [name for (t, key), name in self.pinned.items()
                if t == tier and (key not in entries or not entries[key].loads)]
        return ("pins released by now: " + "; ".join(gone[:4])
                + (f" and {len(gone) - 4} more" if len(gone) > 4 else "")) if gone else ""

    def end(self) -> None:
        """At the end of the trace no pin is left held but the oracle's (SPEC §11)."""
        r = self.r
        if r.backend is None or not self.pinned:
            return
        actual = r.ask("tier_ledgers", r.backend.tier_ledgers)
        for i, (e, a) in enumerate(zip(r.oracle.tiers.ledgers(), actual)):
            if a.get("loading") != e.loading:
                r.diverge(f"tier {e.name} pins at the end of the trace", e.loading, a.get("loading"),
                          self.released(i))
