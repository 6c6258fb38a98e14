"""Lower tiers for the NumPy paged pool (SPEC §11): a host tier of NumPy arrays, and a disk tier
(any tier whose name starts with "disk") of real files, one per storage array, memory-mapped
(np.memmap) in a temporary folder removed at close. The tier operations are impls/pool_tiers.py's;
this module gives them NumPy arrays and copies.
"""
from __future__ import annotations

import os

import numpy as np

from impls.pool_tiers import PoolTiers, slot_runs


def copy_rows(src, rows, dst, into) -> None:
    """dst[into] = src[rows] in one pass over rows of the arrays (each flattened past its first
    axis), without the temporary a fancy-indexed read makes: where ``into`` runs over consecutive
    rows (a store into a tier's free slots) each run is one gather written in place (np.take with
    ``out``; "clip": no buffered copy, and the indices are the pool's own); otherwise each run of
    consecutive ``rows`` is one scatter from a slice."""
    src, dst = _rows_view(src), _rows_view(dst)
    rows, into = np.asarray(rows, dtype=np.intp), np.asarray(into, dtype=np.intp)
    runs = slot_runs(into)
    if 2 * len(runs) <= len(into):
        for a, b in runs:
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


def tier_arrays(spec, storage, folder) -> list:
    """A tier's slots, one array per pool storage array: a file memory-mapped in ``folder`` for
    a tier whose name starts with "disk", NumPy arrays otherwise."""
    arrays = []
    for i, a in enumerate(storage):
        shape = (spec.capacity,) + a.shape[1:]
        if spec.name.startswith("disk") and spec.capacity:
            path = os.path.join(folder, f"{spec.name}-{i}.bin")
            arrays.append(np.memmap(path, dtype=a.dtype, mode="w+", shape=shape))
        else:
            arrays.append(np.zeros(shape, dtype=a.dtype))
    return arrays


class NumpyTiers(PoolTiers):
    """The tier operations of a NumPy pool (a mixin of NumpyPaged): PoolTiers' array hooks."""

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
