"""SPEC §12's state groups in kvbench's paged pools (NumPy and torch): one way to advance and
read the states, over the pool's own block reads and writes.

A state group's table is indexed by position like an attention group's, and holds only the
block of the sequence's last token (``F.trailing_first_block``); slot 0 of the block of position
``i`` holds the state after the tokens up to ``min(T, (i + 1) * B)``, so a full block's is the
state at that block boundary, which stays cached where the block is hashed. A pool gives
``_block_at(g, row, i)``, ``_state_in(block)`` (a NumPy array), ``_put_state(block, state)`` and
``_initial_state(g, row, start)``.
"""
from __future__ import annotations

import numpy as np

from kvbench.contract.protocol import advance_state, group_view


def initial_state(pool, g: int, r: int, start: int):
    """The state a row's tokens from ``start`` build on: the one in the block of position
    ``start - 1`` (a prefix hit's, or the row's own), a fresh one (None: zeros) at 0."""
    return pool._state_in(pool._block_at(g, r, (start - 1) // pool.B)) if start else None


def advance_states(pool, rows, starts, dts, kv) -> None:
    """Each row's state groups after its ``dts`` tokens of ``kv`` (NumPy, rows in order) from
    position ``starts``: the state in every block they reach (``advance_state``)."""
    B, model, off = pool.B, pool.config.model, 0
    for r, a, dt in zip(np.asarray(rows).tolist(), np.asarray(starts).tolist(),
                        np.asarray(dts).tolist()):
        for g in pool.state_groups:
            x = group_view(kv[off:off + dt], pool.groups[g].layers, model)
            state = pool._initial_state(g, r, a)
            for i in range(a // B, -(-(a + dt) // B)):
                lo, hi = max(a, i * B) - a, min(a + dt, (i + 1) * B) - a
                state = advance_state(state, x[lo:hi])
                pool._put_state(pool._block_at(g, r, i), state)
        off += dt


def read_states(pool, r: int, tokens: int) -> np.ndarray:
    """``Backend.read_state``: each state group's state, in the block of the last token (a
    sequence of no token holds no block: a fresh state, zeros)."""
    if tokens == 0:
        return np.zeros((len(pool.state_groups),) + tuple(pool.token_shape), np.int64)
    last = (tokens - 1) // pool.B
    return np.stack([pool._state_in(pool._block_at(g, r, last)) for g in pool.state_groups])
