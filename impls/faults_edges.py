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

import numpy as np

from impls.numpy_paged import NumpyPaged
from impls.numpy_quant_paged import NumpyQuantPaged
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
