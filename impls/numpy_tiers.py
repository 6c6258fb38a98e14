"""Lower tiers for the NumPy paged pool (SPEC §11): a host tier of NumPy arrays, and a disk tier
(any tier whose name starts with "disk") of real files, one per storage array, memory-mapped
(np.memmap) in a temporary folder removed at close. The tier operations are impls/pool_tiers.py's;
this module gives them NumPy arrays and copies.
"""
from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from impls.pool_tiers import PoolTiers, run_count, slot_runs
from kvbench.contract.protocol import Prompt

PAGE = 4096


def copy_rows(src, rows, dst, into) -> None:
    """dst[into] = src[rows] in one pass over rows of the arrays (each flattened past its first
    axis), without the temporary a fancy-indexed read makes: where ``into`` runs over consecutive
    rows (a store into a tier's free slots) each run is one gather written in place (np.take with
    ``out``; "clip": no buffered copy, and the indices are the pool's own); otherwise each run of
    consecutive ``rows`` is one scatter from a slice."""
    src, dst = _rows_view(src), _rows_view(dst)
    rows, into = np.asarray(rows, dtype=np.intp), np.asarray(into, dtype=np.intp)
    if 2 * run_count(into) <= len(into):
        for a, b in slot_runs(into):
            j = int(into[a])
            np.take(src, rows[a:b], axis=0, out=dst[j:j + b - a], mode="clip")
        return
    for a, b in slot_runs(rows):
        i = int(rows[a])
        if b - a == 1:
            dst[int(into[a])] = src[i]
        else:
            dst[into[a:b]] = src[i:i + b - a]


def _rows_view(a: np.ndarray) -> np.ndarray:
    """``a`` as [rows, bytes of a row]: a view, so that a write lands in ``a`` (its first axis
    indexes blocks; numpy scatters and gathers whole rows fastest), a plain ndarray (a disk
    tier's np.memmap subclass made its loads 1.45x slower)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"tier copies need C-contiguous arrays, got strides {a.strides}")
    return a.reshape(len(a), -1).view(np.uint8).view(np.ndarray)


def tier_arrays(spec, storage, folder, offsets=None) -> list:
    """A tier's slots, one array per pool storage array: a file memory-mapped in ``folder`` for
    a tier whose name starts with "disk", NumPy arrays otherwise.

    A mapped file starts on a page; the view of it starts where the pool's array does within a
    page (``offsets``: those of the arrays, by default their own addresses'), so that a block
    and its slot lie alike in their pages. A copy between two buffers 16 bytes apart within
    their pages ran at a third of the speed here for rows of 16 to 256 KiB (memcpy's string
    moves; from 512 KiB it streams), and a pool's array from malloc starts 16 bytes in."""
    arrays = []
    if offsets is None:
        offsets = [a.ctypes.data % PAGE if a.size else 0 for a in storage]
    for i, (a, shift) in enumerate(zip(storage, offsets)):
        shape = (spec.capacity,) + a.shape[1:]
        if spec.name.startswith("disk") and spec.capacity:
            path = os.path.join(folder, f"{spec.name}-{i}.bin")
            size = int(np.prod(shape)) * a.itemsize
            mapped = np.memmap(path, dtype=np.uint8, mode="w+", shape=(shift + size,))
            arrays.append(mapped[shift:].view(a.dtype).reshape(shape))
        else:
            arrays.append(np.zeros(shape, dtype=a.dtype))
    return arrays


class NumpyTiers(PoolTiers):
    """The tier operations of a NumPy pool (a mixin of NumpyPaged): PoolTiers' array hooks; and
    preemption told as itself (SPEC §13): the pool keeps a preempted sequence's request (the
    Prompt of its prefill, its length) and its resume prefills from it."""

    def preempt(self, seq, mode, *, tier=None, step=0) -> None:
        r = self._row(seq)
        kept = (self.requests.get(seq), int(self.tokens[r]), self.tenants[self.tenant_idx[r]],
                int(self.final[r]))
        if mode == "swap":
            self.swap_out(seq, tier or self._tiers[0].name, step=step)
        elif mode == "recompute":
            self.free(seq, step=step)
        else:
            raise ValueError(f"{self.name}: unknown preemption mode {mode!r}")
        self.preempted[seq] = kept

    def resume(self, seq, kv=None, *, step=0, protect=()) -> tuple:
        prompt = self._resumed_prompt(seq)
        hits = self.hit_blocks
        victims = self.prefill(seq, prompt, kv, step=step, protect=protect)  # out of memory: still preempted
        del self.preempted[seq]
        if seq in getattr(self, "_swapped", {}):
            self._swapped_up(seq, self.hit_blocks - hits)
        return victims

    def _resumed_prompt(self, seq) -> Prompt:
        """The prefill of a resume: the kept request at the length the sequence had (a fork's
        child has no request of its own, so no hashes to look up)."""
        request, tokens, tenant, final = self.preempted[seq]
        if request is None:
            return Prompt(tokens, tenant, final)
        return replace(request, tokens=tokens, final_tokens=final)

    _copy_rows = staticmethod(copy_rows)

    def _tier_arrays(self, spec, storage) -> list:
        return tier_arrays(spec, storage, self._tier_folder)

    def _lease(self, blocks) -> None:
        self._add_refs(blocks, 1)

    def _end_lease(self, blocks) -> None:
        self._release_blocks(blocks)

    def _tokens_of(self, r) -> int:
        return int(self.tokens[r])

    def _row_blocks_at(self, r, lo, hi) -> np.ndarray:
        return self.tables[0][r, lo:hi]

    def _rewrite_block(self, block, kv) -> None:
        self._write_group(0, block * self.B + np.arange(self.B), kv)

    def _slot_kv(self, t, s) -> np.ndarray:
        return np.asarray(t.arrays[0][s]).reshape((self.B,) + self.kv_shape)
