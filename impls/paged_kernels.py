"""The NumPy paged pool's one-token decode step, compiled by numba (a core dependency; without it
the vectorized NumPy step runs).

A vectorized step costs ~20 NumPy calls of a few microseconds each whatever the batch, and
turning the batch's id list into an array as much again: at batch 256 that is ~170 us, where
the work is a few loads and stores per sequence. Here the step is two loops over the batch:

- ``decode_plan``: each id's row (the pool's dense index), its tail and the tail's fill before
  the step, kept in ``scratch``; the blocks the step takes (one per full tail) and the widest
  row, or ``NOT_HERE`` where the NumPy step must run (an id outside the dense index or unknown,
  a row twice, a row of no block, a shared tail with room: copy-on-write);
- ``decode_apply``: after the pool took those blocks (``_take``, in Python, in batch order),
  each row's new token: a full tail's row gets the next taken block, every tail its fill + 1
  (from the fill before the step, as the vectorized write does), tokens, last access, use count
  and the row marked for the reservation; each token's slot in ``scratch``.

Nothing is changed where the plan says ``NOT_HERE``. tests/impls/test_paged_kernels.py holds the
compiled step to the NumPy one on random histories (tables, fills, counts, ledgers, free lists).
"""
from __future__ import annotations

import numpy as np

NOT_HERE = -1
_KERNELS = []  # [(decode_plan, decode_apply)] once compiled, [None] where numba is missing


def kernels():
    """(decode_plan, decode_apply) compiled, or None where numba is not installed; imported on
    first use (a process that makes no NumPy pool does not pay for numba's import), and called
    once on a pool's array types, so that loading them from numba's cache lands in the pool's
    construction, not in its first timed step."""
    if not _KERNELS:
        try:
            import numba
        except Exception:  # not installed, or its import broken (a module shadowing one it imports)
            _KERNELS.append(None)
        else:
            jit = numba.njit(cache=True, nogil=True, boundscheck=False)
            plan, apply = jit(decode_plan), jit(decode_apply)
            i64, ip, i32 = np.int64, np.intp, np.int32
            scratch = np.zeros((4, 1), i64)
            table = np.zeros((1, 1), ip)
            plan(np.zeros(1, i64), np.zeros(1, i64), np.ones(1, ip), table, np.zeros(1, i32),
                 np.zeros(1, i32), 1, scratch)
            apply(0, np.zeros(0, ip), np.ones(1, ip), table, np.zeros(1, i32), np.zeros(1, i64),
                  np.zeros(1, i64), np.zeros(1, i64), np.zeros(1, np.bool_), 1, 0, scratch)
            _KERNELS.append((plan, apply))
    return _KERNELS[0]


def decode_plan(ids, row_index, nblocks, table, fill, refcount, B, scratch):
    """(blocks to take, widest row's blocks) of a one-token step over ``ids``, or
    (NOT_HERE, 0); rows, tails and fills before the step into ``scratch[0:3]``."""
    n = ids.shape[0]
    seen = np.zeros(nblocks.shape[0], np.bool_)
    need = 0
    widest = 0
    for i in range(n):
        s = ids[i]
        if s < 0 or s >= row_index.shape[0]:
            return NOT_HERE, 0
        r = row_index[s]
        if r < 0 or seen[r]:
            return NOT_HERE, 0
        seen[r] = True
        nb = nblocks[r]
        if nb <= 0:
            return NOT_HERE, 0
        widest = max(widest, nb)
        t = table[r, nb - 1]
        f = fill[t] if t >= 0 else B  # no tail (a window released it): as if it were full
        if f == B:
            need += 1
        elif refcount[t] > 1:
            return NOT_HERE, 0
        scratch[0, i] = r
        scratch[1, i] = t
        scratch[2, i] = f
    return need, widest


def decode_apply(n, taken, nblocks, table, fill, tokens, last_access, use_count, dirty, B, step,
                 scratch):
    """The planned step of ``n`` rows, ``taken`` the new blocks in batch order; each token's
    slot into ``scratch[3]``."""
    k = 0
    for i in range(n):
        r = scratch[0, i]
        t = scratch[1, i]
        f = scratch[2, i]
        if f == B:
            t = taken[k]
            k += 1
            table[r, nblocks[r]] = t
            nblocks[r] += 1
            f = 0
        scratch[3, i] = t * B + f
        fill[t] = f + 1
        tokens[r] += 1
        last_access[r] = step
        use_count[r] += 1
        dirty[r] = True
