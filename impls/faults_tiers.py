"""Planted faults of tiers and transfers (SPEC §11): each a small subclass of the NumPy pool with
its host and disk tiers, reproducing an upstream offloading bug in kvbench's terms. The
catalogue (impls/faults.py) lists them; the default run catches each on tier-agentic,
tier-races, tier-turns or boundary-tiers (the preemption faults on lifecycle-swap or
lifecycle-preempt)."""
from __future__ import annotations

import dataclasses

import numpy as np

from impls.numpy_paged import NumpyPaged
from impls.pool_tiers import TierSlots
from impls.prefix_keys import NO_EXTRA, prompt_keys
from kvbench.contract.protocol import OutOfMemory, Prompt


class LeaseEndsAtFree(NumpyPaged):
    """A store's source blocks go back to the pool when their sequence is freed, not when the
    store completes; the copy at completion then reads blocks another sequence may own."""

    def free(self, seq, *, step=0):
        ended = getattr(self, "_ended", set())
        for tid, (kind, s, _, moved) in getattr(self, "_transfers", {}).items():
            if kind == "store" and s == seq and moved and tid not in ended:
                self._release_blocks(np.array([b for _, b, _, _ in moved], dtype=np.intp))
                ended.add(tid)
        self._ended = ended
        super().free(seq, step=step)

    def _release_blocks(self, blocks):
        if getattr(self, "_completing", None) in getattr(self, "_ended", ()):
            return  # its lease ended at the free
        super()._release_blocks(blocks)

    def complete(self, tid, ok, kv=None, *, step=0):
        self._completing = tid
        try:
            super().complete(tid, ok, kv, step=step)
        finally:
            self._completing = None


class StoreReadsRowAtCompletion(NumpyPaged):
    """A store leases its source blocks, but its copy at completion looks them up again in its
    sequence's table row: a free before the completion gave the row to the next request, and
    the store copies that request's blocks."""

    TRANSFER_AT = "completion"

    def store(self, tid, seq, tier, blocks=None, *, step=0):
        super().store(tid, seq, tier, blocks, step=step)
        self._store_rows = {**getattr(self, "_store_rows", {}), tid: self.row_of[seq]}

    def complete(self, tid, ok, kv=None, *, step=0):
        kind, _, _, moved = self._transfers[tid]
        self._reading = (self._store_rows.pop(tid), [p for p, *_ in moved]) if kind == "store" else None
        try:
            super().complete(tid, ok, kv, step=step)
        finally:
            self._reading = None

    def _copy_down(self, t, blocks, slots):
        if getattr(self, "_reading", None) is not None:
            r, positions = self._reading
            blocks = self.tables[0][r, positions]
        super()._copy_down(t, blocks, slots)


class LeaseEndsAtBegin(NumpyPaged):
    """A store copies at its begin and ends its lease there (the bytes are down, so the blocks
    seem free to go): a freed sequence's blocks go back to the pool while the store is still
    in flight, and the device ledger counts them free before the completion."""

    TRANSFER_AT = "begin"

    def _lease(self, blocks) -> None:
        pass

    def _end_lease(self, blocks) -> None:
        pass


class LoadTargetHitEarly(NumpyPaged):
    """A load's target blocks enter the prefix cache at its begin, not its completion: a prefill
    of the same prefix before the completion hits blocks whose K/V is not there yet."""

    def load(self, tid, seq, prompt, kv=None, **kw):
        victims = super().load(tid, seq, prompt, kv, **kw)
        for _, b, key, _, _ in self._transfers[tid][3]:
            if key not in self.by_hash:
                self.by_hash[key] = b
                self.hash_of[b] = key
        return victims


class LoadIntoBlockBefore(NumpyPaged):
    """A load copies each block into the device block of the position before its own: the
    first lands on the device hit's last block, which another sequence is reading."""

    def _load_data(self, seq, moved):
        r = self.row_of[seq]
        shifted = [(p, int(self.tables[0][r, p - 1]) if p else b, key, tkey, t)
                   for p, b, key, tkey, t in moved]
        super()._load_data(seq, shifted)


class AbortLeaksLoadBlocks(NumpyPaged):
    """An abort cancels the sequence's loads but keeps a reference to their target blocks: they
    never return to the pool."""

    def abort(self, seq, *, step=0):
        for kind, s, _, moved in self._transfers.values():
            if kind == "load" and s == seq and moved:
                self._add_refs(np.array([b for _, b, *_ in moved], dtype=np.intp), 1)
        super().abort(seq, step=step)


class FailedStoreVisible(NumpyPaged):
    """A store that fails still marks its blocks stored: lookups find blocks never written."""

    def complete(self, tid, ok, kv=None, *, step=0):
        if self._transfers[tid][0] == "store":
            ok = True
        super().complete(tid, ok, kv, step=step)


class TierKeyIgnoresSalt(NumpyPaged):
    """The tiers key blocks on their tokens alone (the prompt's hashes without salt or adapter),
    so a salted request loads another tenant's blocks."""

    def _note_raw(self, prompt) -> None:
        if self.config.prefix_caching:
            salted = prompt_keys(prompt, self.B, self._extra_keys(prompt.salt, prompt.adapter))
            raw = prompt_keys(prompt, self.B, NO_EXTRA)
            self._raw = getattr(self, "_raw", {})
            self._raw.update({(0, s): (0, k) for s, k in zip(salted, raw)})

    def prefill(self, seq, prompt, kv=None, **kw):
        self._note_raw(prompt)
        return super().prefill(seq, prompt, kv, **kw)

    def load(self, tid, seq, prompt, kv=None, **kw):
        self._note_raw(prompt)  # looked up first
        return super().load(tid, seq, prompt, kv, **kw)

    def _tier_key(self, key):
        return getattr(self, "_raw", {}).get(key, key)


class _FlagPins(TierSlots):
    def end_load(self, keys, seq) -> None:
        for key in keys:
            self.readers[key] = 0


class PinIsAFlag(NumpyPaged):
    """A tier block's readers kept as a flag, not a count: when the first of two loads reading a
    shared prefix completes, its blocks are evictable again while the second still reads them."""

    def _make_tier(self, spec, storage):
        return _FlagPins(spec, self._tier_arrays(spec, storage))


class PinsReleasedWithoutSalt(NumpyPaged):
    """A lookup's pins released by the block key without its salt (LMCache issue 3770): a salted
    request's entries stay pinned after its load, never evictable again, and an unsalted entry
    of the same tokens, if pinned, loses a pin it never took."""

    def lookup(self, seq, prompt, *, step=0):
        salted = prompt_keys(prompt, self.B, self._extra_keys(prompt.salt, prompt.adapter))
        raw = prompt_keys(prompt, self.B, NO_EXTRA)
        self._raw = getattr(self, "_raw", {})
        self._raw.update({(0, s): (0, k) for s, k in zip(salted, raw)})
        super().lookup(seq, prompt, step=step)

    def _unpin(self, pins, seq):
        raw = getattr(self, "_raw", {})
        super()._unpin([(t, raw.get(k, k)) for t, k in pins if t.readers.get(raw.get(k, k))], seq)


class _FailedLoadServed(TierSlots):
    def load_failed(self, keys, seq) -> None:
        pass  # the tier deleted what it could not read; its lookups still find it


class FailedLoadReserved(NumpyPaged):
    """vLLM issue 49176's behaviour in kvbench's pool: a tier that drops what a failed load could
    not read (``failed_load`` "drop") still finds those blocks at the next lookup, and serves the
    same failed hit again."""

    def _make_tier(self, spec, storage):
        return _FailedLoadServed(spec, self._tier_arrays(spec, storage))


class _DroppedUnderReaders(TierSlots):
    def load_failed(self, keys, seq) -> None:
        for key in keys:  # removed at the failure, whoever else still reads it
            self.drop(key)

    def end_load(self, keys, seq) -> None:
        super().end_load([k for k in keys if k in self.slot], seq)


class FailedLoadDropsUnderReaders(NumpyPaged):
    """vLLM's file tier's removal (docs/upstream-reports.md) in kvbench's pool: a tier that drops
    what a failed load could not read removes it at the failure, while another load still reads
    it, where SPEC §11 removes it once no load reads it."""

    def _make_tier(self, spec, storage):
        return _DroppedUnderReaders(spec, self._tier_arrays(spec, storage))


class HitCountedBeforeAllocation(NumpyPaged):
    """LMCache PR 4520's behaviour in kvbench's pool: a load counts its tier hits at the lookup,
    before the device allocation, so a load that runs out of memory and is retried counts the
    same hit twice. Not in the catalogue: no default workload retries a load refused for memory
    (tests/checking/test_tier_check.py catches it on its own trace)."""

    def load(self, tid, seq, prompt, kv=None, **kw):
        try:
            return super().load(tid, seq, prompt, kv, **kw)
        except OutOfMemory:
            keys = prompt_keys(prompt, self.B, self._extra_keys(prompt.salt, prompt.adapter))
            L = self._hit_plan(keys)[0] if keys else 0
            for k in keys[L:]:  # the run the lookup found, counted although nothing loads
                t = next((t for t in self._tiers if t.loadable(self._tier_key((0, k)), seq)), None)
                if t is None:
                    break
                t.hits += 1
            raise


class SwapInReadsAnother(NumpyPaged):
    """A swap-in copies up the slots of the sequence swapped out last (a stale "last swapped"
    index), not its own: while another is still swapped, the resumed sequence reads its K/V."""

    def _swap_source(self, seq):
        t, slots = self._swapped[seq]
        last = next(reversed(self._swapped))
        if last == seq or self._swapped[last][0] is not t:
            return t, slots
        theirs = self._swapped[last][1]
        return t, theirs[:len(slots)] + slots[len(theirs):]


class ResumeForgetsHashes(NumpyPaged):
    """A preemption drops the request's block hashes with its blocks, as a free does: its resume
    is a prefill of its length with no hashes, so it hits none of its blocks still cached and
    computes them into new ones."""

    def _resumed_prompt(self, seq):
        prompt = super()._resumed_prompt(seq)
        return Prompt(prompt.tokens, prompt.tenant, prompt.final_tokens)


class LeasesOutOfRefcounts(NumpyPaged):
    """The pool keeps a store's leases in a count of its own, beside the blocks' reference
    counts (as an offloading connector holds blocks beside its engine's block pool): it holds
    a leased block all the same, but the counts block_state() reports leave the leases out, so
    a leased block whose sequence was freed reads as in use with no reference. Only the block
    structures show it: the ledger, the tiers and the K/V are right."""

    def block_state(self, seqs=None, *, changed_since=None):
        state = super().block_state(seqs, changed_since=changed_since)
        leased = [b for kind, _, _, moved in getattr(self, "_transfers", {}).values()
                  if kind == "store" for _, b, _, _ in moved]
        if not leased:
            return state
        refcount = np.array(state.refcount)
        np.subtract.at(refcount, leased, 1)
        return dataclasses.replace(state, refcount=refcount)


# (name, upstream, fault): each caught by the default run (tier-agentic, tier-races or tier-turns;
# FailedLoadReserved on boundary-tiers-1, PinsReleasedWithoutSalt on boundary-tiers-2,
# FailedLoadDropsUnderReaders on boundary-shared-reads-1: the committed workloads' tiers keep failed loads)
TIER_BUGS = [
    ("a store's lease ends at the free: the copy at completion reads a reused block",
     "vLLM #45704, PR #46278", LeaseEndsAtFree),
    ("a load writes the block another request is reading", "vLLM PR #47291", LoadIntoBlockBefore),
    ("aborted loads leak their device blocks", "vLLM #46283", AbortLeaksLoadBlocks),
    ("a failed store stays visible to lookups", "LMCache #4991", FailedStoreVisible),
    ("the tiers key blocks on raw tokens: salted requests match", "vLLM #53495", TierKeyIgnoresSalt),
    ("a tier block's readers kept as a flag: the first of two loads to complete unpins it",
     "kvbench #24", PinIsAFlag),
    ("the reference counts leave a store's leases out: a leased block reads as held by none",
     "kvbench §10, §11", LeasesOutOfRefcounts),
    ("a store's copy at completion reads its blocks from its sequence's row, reused by then",
     "kvbench #47", StoreReadsRowAtCompletion),
    ("a store copies at its begin and ends its lease there", "kvbench #47", LeaseEndsAtBegin),
    ("a load's targets hit before it completes", "kvbench #47", LoadTargetHitEarly),
    ("a failed load's blocks served again from a tier that dropped them", "vLLM #49176",
     FailedLoadReserved),
    ("a lookup's pins released by the block key without its salt: salted entries stay pinned",
     "LMCache #3770", PinsReleasedWithoutSalt),
    ("a failed load's blocks removed from a dropping tier while another load reads them",
     "vLLM file tier (kvbench #48)", FailedLoadDropsUnderReaders),
]

# (name, upstream, fault): caught by the default run on lifecycle-swap or lifecycle-preempt
SWAP_BUGS = [
    ("a swapped sequence resumes with another's K/V", "kvbench §13", SwapInReadsAnother),
    ("a preemption drops the request's hashes: its resume hits none of its cached blocks",
     "kvbench §13", ResumeForgetsHashes),
]
