"""Planted bugs at the edges `kvbench fuzz` must reach by default (issue 47): each a small
subclass of a correct pool, the kind of slip an out-of-tree pool makes at one edge of SPEC §9-13
(a sink count off a block multiple, a rollback to a block edge or to nothing, a chunk's partly
written block, a tier block a load still reads, an aborted load, an empty prompt, a swap that
fits exactly, token-id keys, a hybrid decode step under LRU) or in one KV format of a pool that
runs several (fp8 per tensor and per token-head, NVFP4).

They are not in `impls.faults.CATALOGUE`: that list is what the default run (`kvbench faults`)
must catch, and these are what a fuzz campaign must find: tests/search/test_fuzz_edges.py runs
each (:data:`FUZZ_BUGS`) and scripts/fuzz_catalogue.py --fuzz-bugs measures when it shows.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from impls.faults_edges import (ChunkAppendCachesPartial, SinkBlocksFloored, SwapRefusedOnExactFit,
                                TierEvictsLoading, TokenKeysUnchained)
from impls.faults_tiers import AbortLeaksLoadBlocks, TierKeyIgnoresSalt
from impls.numpy_float_paged import (E4M3, E4M3_VALUES, NumpyFp8Tensor, NumpyFp8TokenHead, NumpyNvfp4,
                                     encode)
from impls.numpy_paged import NumpyPaged
from impls.numpy_quant_paged import NumpyQuantPaged

# --- a pool of several KV formats, as a plug-in that takes CacheConfig.kv_format ----------------


class MultiFormat:
    """A pool of every KV format it lists, by ``config.kv_format`` (int8 when none is given):
    the pool `kvbench fuzz` must run in each format it declares. A fault replaces one format's
    pool and leaves the default one right, so only a campaign that draws formats finds it."""

    pools = {"int8": NumpyQuantPaged, "int4": NumpyQuantPaged, "fp8-tensor": NumpyFp8Tensor,
             "fp8-token-head": NumpyFp8TokenHead, "nvfp4": NumpyNvfp4}

    def __new__(cls, config):
        fmt = config.kv_format or "int8"
        if fmt not in cls.pools:
            raise ValueError(f"{cls.__name__}: no KV format {fmt!r} (it runs {', '.join(cls.pools)})")
        return cls.pools[fmt](dataclasses.replace(config, kv_format=fmt))


class _Fp8Truncating(NumpyFp8Tensor):
    def _write_slots(self, slots, kv) -> None:
        super()._write_slots(slots, kv)
        if len(slots):  # each code one step towards zero where rounding went up in magnitude
            d = self.config.model.head_dim
            x = np.abs(np.asarray(kv, np.float64).reshape(self._row_shape(len(slots)) + (d,))
                       / self.tensor_scale.astype(np.float64)).reshape(len(slots), -1)
            codes = self.codes[slots]
            up = (np.abs(E4M3_VALUES[codes]) > x) & ((codes & 0x7F) > 0)
            self.codes[slots] = np.where(up, codes - 1, codes).astype(np.uint8)


class Fp8Truncates(MultiFormat):
    """fp8 (per tensor) codes truncated towards zero, not rounded to nearest even: every value
    read back up to one unit in the last place low (its int8 default is right)."""

    pools = {**MultiFormat.pools, "fp8-tensor": _Fp8Truncating}


class _Fp8ScalePerToken(NumpyFp8TokenHead):
    def _write_slots(self, slots, kv) -> None:
        if len(slots) == 0:
            return
        # One scale per (token, K/V, layer) over all heads, stored for each head.
        d = self.config.model.head_dim
        x = np.asarray(kv, dtype=np.float64).reshape(self._row_shape(len(slots)) + (d,))
        amax = np.abs(x).max(axis=(-2, -1), keepdims=True)
        s = np.broadcast_to(np.where(amax > 0, amax / 448.0, 1.0), x.shape[:-1] + (1,)).astype(np.float32)
        self.codes[slots] = encode(x / s, E4M3, 0x80).reshape(len(slots), -1)
        self.scale[slots] = s.reshape(len(slots), -1)


class Fp8TokenHeadScalePerToken(MultiFormat):
    """fp8 per token-head scaled per token: one scale over every head of a (token, K/V, layer),
    so a head of small values keeps fewer bits than its own scale would give."""

    pools = {**MultiFormat.pools, "fp8-token-head": _Fp8ScalePerToken}


class _Nvfp4CopyWithoutScales(NumpyNvfp4):
    def _copy_blocks(self, src, dst) -> None:
        B = self.B
        s = (np.asarray(src)[:, None] * B + np.arange(B)).reshape(-1)
        t = (np.asarray(dst)[:, None] * B + np.arange(B)).reshape(-1)
        self.codes[t] = self.codes[s]  # the e4m3 block scales left behind


class Nvfp4ScalesNotCopied(MultiFormat):
    """NVFP4 blocks copied (copy on write, a fork's partial tail) with their codes but not their
    block scales: the copy reads back under whatever scales its block held before."""

    pools = {**MultiFormat.pools, "nvfp4": _Nvfp4CopyWithoutScales}


# --- block edges -------------------------------------------------------------------------------

class RollbackEdgeFillZero(NumpyPaged):
    """A rollback sets its new tail's fill to ``length % B``: 0 when it ends exactly on a block
    edge, so a full block (one a fork or the prefix cache may share) reads as empty."""

    def accept(self, seq, n, *, drafted, step=0):
        out = super().accept(seq, n, drafted=drafted, step=step)
        r = self._row(seq)
        new, keep = int(self.tokens[r]), int(self.nblocks[r])
        if keep and new % self.B == 0:
            tails = np.array([t[r, keep - 1] for t in self.tables], dtype=np.intp)
            self._set_fill(tails[tails >= 0], 0)
        return out


class RollbackKeepsBlockZero(NumpyPaged):
    """A rollback keeps at least one block, as if a sequence always held one: rolled back to no
    tokens (an empty prompt, then drafts alone, none accepted), it keeps block 0."""

    def accept(self, seq, n, *, drafted, step=0):
        r = self._row(seq)
        if int(self.tokens[r]) - (drafted - n) == 0 and self.nblocks[r]:
            first = [int(t[r, 0]) for t in self.tables]
            self._add_refs(np.array([b for b in first if b >= 0], dtype=np.intp), 1)
        return super().accept(seq, n, drafted=drafted, step=step)


class EmptyPromptCrashes(NumpyPaged):
    """A prefill reads its row's last block (to note its tail): an empty prompt has none, and the
    pool raises IndexError."""

    def prefill(self, seq, prompt, kv=None, **kw):
        victims = super().prefill(seq, prompt, kv, **kw)
        r = self.row_of[seq]
        self.last_tail = int(self.tables[0][r, :self.nblocks[r]][-1])
        return victims


# --- tiers and transfers (SPEC §11) -------------------------------------------------------------

class AbortKeepsTierReaders(NumpyPaged):
    """An abort cancels the sequence's loads on the device but not in the tiers: the tier blocks
    they read stay counted as read, so no store can ever evict them."""

    def abort(self, seq, *, step=0):
        if seq in self._pins:  # a request looked up, never loaded: the pool's own (its pins go)
            return super().abort(seq, step=step)
        for tid, (kind, s, _, moved) in list(self._transfers.items()):
            if kind == "load" and s == seq:
                del self._transfers[tid]
        self.free(seq, step=step)


class AbortCachesUnloadedBlocks(NumpyPaged):
    """An abort takes its loads down the completion path: the blocks they never finished loading
    enter the prefix cache, and a later prompt hits data never written."""

    def abort(self, seq, *, step=0):
        for kind, s, _, moved in self._transfers.values():
            if kind == "load" and s == seq:
                for _, b, key, _, _ in moved:
                    if key not in self.by_hash:
                        self.by_hash[key], self.hash_of[b] = b, key
        super().abort(seq, step=step)


# --- keys and eviction order -------------------------------------------------------------------

class TokenIdKeysUnchained(TokenKeysUnchained):
    """TokenKeysUnchained, its loads from a tier keyed the same way: two prompts that differ only
    in an earlier block share the later ones, on the device and in the tiers."""

    def load(self, tid, seq, prompt, kv=None, **kw):
        return super().load(tid, seq, self._unchained(prompt), kv, **kw)


class MultiGroupDecodeSkipsClock(NumpyPaged):
    """The one-token decode step of a model of several groups leaves ``last_access`` where it was:
    under LRU a sequence decoding on a hybrid model looks idle, and its blocks go first."""

    def _decode_one(self, rows, dts, kv, step) -> bool:
        if self.G == 1:
            return super()._decode_one(rows, dts, kv, step)
        before = self.last_access[rows].copy()
        done = super()._decode_one(rows, dts, kv, step)
        if done:
            self.last_access[rows] = before
        return done


# (name, fault): what a default campaign must find within 200 histories (tests/search/test_fuzz_edges.py)
FUZZ_BUGS = [
    ("a sink count off a block multiple: the last sinks' block released", SinkBlocksFloored),
    ("a rollback ending on a block edge empties its (shared) tail", RollbackEdgeFillZero),
    ("a rollback to no tokens keeps block 0", RollbackKeepsBlockZero),
    ("a chunk's partly written block cached", ChunkAppendCachesPartial),
    ("a tier evicts a block a load still reads", TierEvictsLoading),
    ("fp8 codes truncated (a pool of several formats)", Fp8Truncates),
    ("fp8 per token-head scaled per token (a pool of several formats)", Fp8TokenHeadScalePerToken),
    ("NVFP4 block scales not copied (a pool of several formats)", Nvfp4ScalesNotCopied),
    ("an aborted load leaks its device blocks", AbortLeaksLoadBlocks),
    ("an aborted load's tier blocks stay read", AbortKeepsTierReaders),
    ("an aborted load's blocks enter the prefix cache", AbortCachesUnloadedBlocks),
    ("a cross-salt hit through the tiers", TierKeyIgnoresSalt),
    ("an empty prompt crashes the pool", EmptyPromptCrashes),
    ("a swap refused when the tier fits it exactly", SwapRefusedOnExactFit),
    ("token-id keys not chained to their prefix", TokenIdKeysUnchained),
    ("a hybrid decode step leaves the LRU clock", MultiGroupDecodeSkipsClock),
]
