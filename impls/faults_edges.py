"""Single-line bugs of a paged pool, planted to measure what the default run reaches.

Each is the kind of slip a pool's author makes once: an off-by-one at the budget's last block, a
refusal that keeps a block, a batch applied writer by writer, a counter one byte wide. Most show
only at an edge the first committed workloads never reached (a refusal, an exact fit, 128
sharers, 65 live sequences, a block of 256 tokens, a prompt over 16 blocks, the int4 pool); the
rest are controls every workload catches. `impls.faults.CATALOGUE` lists them with the others;
docs/workloads.md's table says which the default run caught before the edge workloads and after.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from impls.numpy_paged import NumpyPaged
from impls.numpy_quant_paged import NumpyQuantPaged
from impls.pool_tiers import TierSlots
from impls.prefix_keys import cache_completed_chunk
from kvbench.contract.protocol import OutOfMemory


class PrefillKeepsBlockOnRefusal(NumpyPaged):
    """A refused prefill keeps one block it took before finding out."""

    def prefill(self, seq, prompt, kv=None, **kw):
        try:
            return super().prefill(seq, prompt, kv, **kw)
        except OutOfMemory:
            if self.free_top:
                self._take(1)
            raise


class AppendKeepsBlockOnRefusal(NumpyPaged):
    """A refused append keeps one block it took before finding out."""

    def append(self, seqs, tokens, kv=None, **kw):
        try:
            return super().append(seqs, tokens, kv, **kw)
        except OutOfMemory:
            if self.free_top:
                self._take(1)
            raise


class BatchWriterByWriter(NumpyPaged):
    """A batched append done writer by writer: refused at its third writer, the first two keep
    their tokens."""

    def append(self, seqs, tokens, kv=None, *, step=0):
        victims, at = [], 0
        for s, t in zip(seqs, tokens):
            victims += super().append([s], [t], None if kv is None else kv[at:at + t], step=step)
            at += t
        return tuple(victims)


class ExactFitRefused(NumpyPaged):
    """``need < free`` where ``need <= free`` is meant: a call taking exactly the free blocks
    is refused (with no policy to evict under)."""

    def _make_room(self, need_fn, protect_rows):
        if self.config.policy is None and need_fn(self.refcount) == self.n_free > 0:
            raise OutOfMemory(f"{self.name}: needs {self.n_free} blocks, {self.n_free} free")
        return super()._make_room(need_fn, protect_rows)

    def prefill(self, seq, prompt, kv=None, **kw):
        n = -(-prompt.tokens // self.B) * self.G
        if self.config.policy is None and n == self.n_free > 0:
            raise OutOfMemory(f"{self.name}: needs {n} blocks, {n} free")
        return super().prefill(seq, prompt, kv, **kw)


class EvictsBeforeCheckingAll(NumpyPaged):
    """Evicts victims one by one and only then finds that even all of them are not enough: the
    refused call has evicted them (no check of every candidate first)."""

    def _make_room(self, need_fn, protect_rows):
        victims = []
        while need_fn(self.refcount) > self.n_free:
            cand = np.flatnonzero(self.live) if self.config.policy is not None else np.array([], int)
            cand = cand[~np.isin(cand, protect_rows)]
            if not len(cand):
                raise OutOfMemory(f"{self.name}: needs {need_fn(self.refcount)}, {self.n_free} free")
            r = self._victim(cand)
            victims.append(int(self.seq_of_row[r]))
            self._drop_row(r)
        return victims


class NeedComputedOnce(NumpyPaged):
    """The need computed once, before the first victim: a victim that shared the writer's tail
    (its eviction spares a copy) is followed by more victims than needed."""

    def _make_room(self, need_fn, protect_rows):
        need = need_fn(self.refcount)
        return super()._make_room(lambda refcount: need, protect_rows)


class FreeKeepsTail(NumpyPaged):
    """Free returns every block of a sequence but its last."""

    def _row_blocks(self, r):
        return super()._row_blocks(r)[1:] if getattr(self, "_freeing", False) else super()._row_blocks(r)

    def free(self, seq, *, step=0):
        self._freeing = True
        try:
            super().free(seq, step=step)
        finally:
            self._freeing = False


class ForkChildNotSharing(NumpyPaged):
    """A fork marks only the source as sharing: freeing the child takes the path for blocks a
    row owns alone and gives back the blocks it shares, references and all."""

    def fork(self, seq, src, **kw):
        out = super().fork(seq, src, **kw)
        self.sharing_rows.discard(self.row_of[seq])
        return out


class BlocksNeededPlusOne(NumpyPaged):
    """``tokens // B + 1`` blocks for a prefill: one too many at an exact multiple of B."""

    def prefill(self, seq, prompt, kv=None, **kw):
        if prompt.tokens % self.B or not prompt.tokens or self.config.prefix_caching:
            return super().prefill(seq, prompt, kv, **kw)
        out = super().prefill(seq, prompt, kv, **kw)
        r = self.row_of[seq]
        extra = self._take(1)  # the block after the last full one, empty
        self.block_group[extra] = 0
        self.group_used[0] += 1
        self._grow_cols(int(self.nblocks[r]) + 1)
        self.tables[0][r, self.nblocks[r]] = extra[0]
        self.nblocks[r] += 1
        return out


class ReservesSharedTails(NumpyPaged):
    """Reservation counted on every tail, shared ones too (``refcount >= 1`` for ``== 1``)."""

    def _reservation(self):
        rows = np.flatnonzero(self.live)
        tails = self.tables[0][rows, self.nblocks[rows] - 1]
        held = tails >= 0
        reserve = np.minimum(self.B - self.fill[tails], np.maximum(0, self.final[rows] - self.tokens[rows]))
        self.dirty = set()
        return int(reserve[held].sum())


class RowsGrowWithoutUseCount(NumpyPaged):
    """The per-sequence arrays grow past 64 rows, all but ``use_count``."""

    def _grow_rows(self):
        keep = self.use_count
        super()._grow_rows()
        self.use_count = keep


class RefcountInt8(NumpyPaged):
    """Reference counts in one signed byte: the 128th sharer wraps the count negative."""

    def __init__(self, config):
        super().__init__(config)
        self.refcount = self.refcount.astype(np.int8)


class FillInUint8(NumpyPaged):
    """Fill counts in one unsigned byte: a full block of 256 tokens reads as empty."""

    def __init__(self, config):
        super().__init__(config)
        self.fill = self.fill.astype(np.uint8)


class TableNotGrownOnPrefill(NumpyPaged):
    """A prefill with nothing to look up or evict writes its block table without growing it
    past its first 16 columns: a prompt of 17 blocks or more fails."""

    def _grow_cols(self, width):
        if getattr(self, "_in_prefill", False):
            return
        super()._grow_cols(width)

    def prefill(self, seq, prompt, kv=None, **kw):
        self._in_prefill = True
        try:
            return super().prefill(seq, prompt, kv, **kw)
        finally:
            self._in_prefill = False


class Int4Pool(NumpyQuantPaged):
    """The `numpy-int4` backend as a class (the registry makes it with ``kv_format="int4"``)."""

    def __init__(self, config):
        super().__init__(dataclasses.replace(config, kv_format="int4"))


class Int4CopyWithoutZeroPoint(Int4Pool):
    """The int4 pool's copy-on-write copies codes and scales, not the zero points (int8 has
    none, so only the int4 pool shows it)."""

    def _copy_blocks(self, src, dst):
        B = self.B
        s = (np.asarray(src)[:, None] * B + np.arange(B)).reshape(-1)
        t = (np.asarray(dst)[:, None] * B + np.arange(B)).reshape(-1)
        self.codes[t] = self.codes[s]
        self.scale[t] = self.scale[s]


# (name, fault, the default backend it is planted into)
EDGE_BUGS = [
    ("a refused prefill keeps a block", PrefillKeepsBlockOnRefusal, "numpy"),
    ("a refused append keeps a block", AppendKeepsBlockOnRefusal, "numpy"),
    ("a batched append applied writer by writer", BatchWriterByWriter, "numpy"),
    ("an exact fit refused (need < free)", ExactFitRefused, "numpy"),
    ("victims evicted before checking every candidate suffices", EvictsBeforeCheckingAll, "numpy"),
    ("the need not recomputed after each victim", NeedComputedOnce, "numpy"),
    ("free keeps the last block", FreeKeepsTail, "numpy"),
    ("fork-free: the child's shared blocks given back", ForkChildNotSharing, "numpy"),
    ("tokens // B + 1 blocks for a prefill", BlocksNeededPlusOne, "numpy"),
    ("reservation counted on shared tails", ReservesSharedTails, "numpy"),
    ("use_count not grown past 64 sequences", RowsGrowWithoutUseCount, "numpy"),
    ("reference counts in int8 (128 sharers)", RefcountInt8, "numpy"),
    ("fill counts in uint8 (blocks of 256)", FillInUint8, "numpy"),
    ("block table not grown on a prefill (17+ blocks)", TableNotGrownOnPrefill, "numpy"),
    ("int4 copy-on-write without the zero points", Int4CopyWithoutZeroPoint, "numpy-int4"),
]


# --- bugs at SPEC §13's boundaries: each passes every committed workload; the boundary workloads
# the default run generates (kvbench.traces.boundaries) catch it. Written as a backend's author
# outside the project would, from the docs: a subclass of a correct pool and one slip.

class SinkBlocksFloored(NumpyPaged):
    """A sinks(S, W) group keeps ``S // B`` blocks for its sinks, not ``ceil(S / B)``: right when
    S is a multiple of B (the one committed sinks model, S = B = 8), one block short otherwise."""

    def __init__(self, config):
        super().__init__(config)
        self.kept = [g.sinks[0] // self.B if g.sinks else 0 for g in self.groups]


class RollbackCopiesSharedTail(NumpyPaged):
    """A rollback makes the tail it leaves private, as a write would (copy-on-write at the
    truncation): a copy no write asked for, taken only where the new tail is still shared, which
    is a rollback ending on the edge of a block a fork or a prefix hit shares."""

    def accept(self, seq, n, *, drafted, step=0):
        out = super().accept(seq, n, drafted=drafted, step=step)
        r = self._row(seq)
        nb = int(self.nblocks[r])
        for g, t in enumerate(self.tables):
            tail = int(t[r, nb - 1]) if nb else -1
            if tail >= 0 and self.refcount[tail] > 1 and self.n_free:
                copy = self._take(1)
                self.block_group[copy] = g
                self.group_used[g] += 1
                self._set_fill(copy, self.fill[tail])
                if self.pool is not None:
                    self._copy_blocks(np.array([tail]), copy)
                self._add_refs(np.array([tail]), -1)
                t[r, nb - 1] = copy[0]
        return out


class RollbackInFirstBlockDropsIt(NumpyPaged):
    """A rollback keeps the blocks it completes, ``new // B``, when the new length lies inside
    the first block (``ceil`` elsewhere): block 0, partly written, is released with the drafts."""

    def accept(self, seq, n, *, drafted, step=0):
        r = self._row(seq)
        new = int(self.tokens[r]) - (drafted - n)
        out = super().accept(seq, n, drafted=drafted, step=step)
        if 0 < new < self.B:
            gone = [t[r, 0:1].copy() for t in self.tables]
            for t in self.tables:
                t[r, 0] = -1
            self._past_length(r, gone)
            self.nblocks[r] = 0
        return out


class ChunkAppendCachesPartial(NumpyPaged):
    """An append of a chunked prompt caches the blocks it reached, ``ceil(T / B)``, not those it
    completed, ``floor``: a request arriving before the next chunk hits a block half written (the
    prefill's own chunk is cached right)."""

    def _cache_chunks(self, seqs) -> None:
        for s in seqs:
            if s in self.chunking:
                r = self.row_of[s]
                cache_completed_chunk(self.chunking, s, -(-int(self.tokens[r]) // self.B),
                                      lambda lo, hi: [t[r, lo:hi].tolist() for t in self.tables],
                                      self.by_hash, self.hash_of)


class TokenKeysUnchained(NumpyPaged):
    """A prompt named by token ids keys each block by its own ids (and extra keys), not chained
    to its parent: a block whose ids repeat after another prefix hits."""

    def _unchained(self, prompt):
        ids, B = prompt.token_ids, self.B
        if ids is None:
            return prompt
        own = tuple(hashlib.sha256(np.asarray(ids[i * B:(i + 1) * B], "<i8").tobytes()).hexdigest()
                    for i in range(len(ids) // B))
        return dataclasses.replace(prompt, token_ids=None, block_hashes=own)

    def prefill(self, seq, prompt, kv=None, **kw):
        return super().prefill(seq, self._unchained(prompt), kv, **kw)


class GroupsDecodeSkipsClock(NumpyPaged):
    """The decode step of a model of several groups (one token each) leaves ``last_access`` and
    ``use_count`` as they were: LRU and LFU then pick a sequence that just decoded."""

    def _decode_one(self, rows, dts, kv, step):
        last, uses = self.last_access[rows].copy(), self.use_count[rows].copy()
        done = super()._decode_one(rows, dts, kv, step)
        if done and self.G > 1:
            self.last_access[rows], self.use_count[rows] = last, uses
        return done


class _EvictsLoading(TierSlots):
    def evictable(self, key) -> bool:
        return self.ready[key] and key not in self.pinned  # the loads reading it forgotten


class TierEvictsLoading(NumpyPaged):
    """A lower tier's eviction picks its least recent stored block even while a load reads it:
    a store into a full tier during a load overwrites the slot the load copies up from."""

    def _make_tier(self, spec, storage):
        return _EvictsLoading(spec, self._tier_arrays(spec, storage))


class SwapRefusedOnExactFit(NumpyPaged):
    """A swap needs more room than its blocks (``>`` for ``>=``): into a tier with exactly the
    room it needs, the sequence is preempted by recompute instead."""

    def swap_out(self, seq, tier, *, step=0):
        t = self._tiers[self._tier(tier)]
        n = -(-self._tokens_of(self._row(seq)) // self.B)
        if len(t.free) + sum(map(t.evictable, t.recency)) == n:
            self.free(seq, step=step)  # no room, as it counts: recomputed at its resume
            return
        super().swap_out(seq, tier, step=step)


class KvEncodingIgnored(NumpyPaged):
    """Block bytes at the model's dtype whatever its KV encoding: an fp8 (1 byte an element),
    fp8 per token-head (1 byte and a 4-byte scale a head) or NVFP4 model counted as bf16."""

    def block_bytes(self) -> int:
        m = self.config.model
        if m.kv_encoding == "native":
            return super().block_bytes()
        return self.B * 2 * m.group_layers * m.kv_heads * m.head_dim * m.dtype_bytes


class ZeroAppendCopiesSharedTail(NumpyPaged):
    """An append member of 0 tokens counted as writing its tail: a tail it shares with a fork is
    copied for nothing."""

    def _append_plan(self, rows, dts, refcount, group=0):
        tails, free_last, cow, _ = super()._append_plan(rows, np.maximum(dts, 1), refcount, group)
        new = super()._append_plan(rows, dts, refcount, group)[3]
        return tails, free_last, cow, new


# (name, fault, the default backend it is planted into, the boundary it needs)
BOUNDARY_BUGS = [
    ("a sinks group keeps S // B blocks, not ceil(S / B)", SinkBlocksFloored, "numpy",
     "S not a multiple of B"),
    ("a rollback copies the tail it leaves shared", RollbackCopiesSharedTail, "numpy",
     "a rollback ending on the edge of a shared block"),
    ("a rollback inside block 0 releases it", RollbackInFirstBlockDropsIt, "numpy",
     "a rollback ending in block 0"),
    ("a chunked append caches the block it left partly written", ChunkAppendCachesPartial, "numpy",
     "an append cutting a chunk mid-block, a request after it"),
    ("token-id block keys not chained to their prefix", TokenKeysUnchained, "numpy",
     "a block's ids repeated after another prefix"),
    ("the multi-group decode step skips the LRU clock", GroupsDecodeSkipsClock, "numpy",
     "a hybrid model under an eviction policy"),
    ("a tier evicts a block a load is reading", TierEvictsLoading, "numpy",
     "a store into a full tier during a load"),
    ("a swap refused when the tier fits exactly", SwapRefusedOnExactFit, "numpy",
     "a swap into exactly the room it needs"),
    ("block bytes at the model's dtype, not its KV encoding", KvEncodingIgnored, "numpy",
     "an fp8, fp8 per token-head or NVFP4 model"),
    ("an append of 0 tokens copies the tail it shares", ZeroAppendCopiesSharedTail, "numpy",
     "an append of 0 tokens to a fork"),
]
