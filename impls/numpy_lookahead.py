"""The NumPy paged pool keeping rejected drafts' blocks as lookahead slots (SPEC §13, declared as
``Capabilities.lookahead_slots``), as vLLM's scheduler does: ``allocate_slots`` with
``num_lookahead_tokens`` gives a request blocks for its drafts, and a rollback only lowers
``num_computed_tokens``, so the blocks past the new length stay the request's, and its next step
writes into them before it takes new ones.

A kept block holds no token (fill 0) and is in use (blocks_used, the sequence's seq_blocks); a
free or an eviction releases the kept blocks before the tables'. An append lends the blocks it
will write past a tail back to the top of the free stack just before it takes its new blocks,
so that they are the ones it takes (out of memory: lent back). No block structures are exposed:
a kept block is held by no table position.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from impls.numpy_paged import NumpyPaged
from kvbench.contract import formulas as F
from kvbench.contract.protocol import OutOfMemory


class NumpyLookahead(NumpyPaged):
    name = "numpy-lookahead"
    capabilities = dataclasses.replace(NumpyPaged.capabilities, rule_params={"lookahead_slots": True},
                                       block_ids=False, tiers=(), swap=False)

    def __init__(self, config):
        super().__init__(config)
        self.ahead: dict = {}  # row -> per group, the blocks kept past its length, in position order

    def _past_length(self, r, gone) -> None:
        old = self.ahead.get(r)
        kept = [g[g >= 0] for g in gone]
        self._set_fill(np.concatenate(kept), 0)  # rejected drafts: nothing written counts
        self.ahead[r] = kept if old is None else [np.concatenate([k, o]) for k, o in zip(kept, old)]

    def append(self, seqs, tokens, kv=None, *, step=0):
        lent = self._lend(seqs, tokens)
        try:
            return super().append(seqs, tokens, kv, step=step)
        except OutOfMemory:
            self._lend_back(lent)
            raise

    def _lend(self, seqs, tokens) -> list:
        """Per writer with kept blocks, the first of them its append writes past its tail, moved
        to the top of the free stack: [(row, group, blocks)]."""
        lent = []
        for s, dt in zip(seqs, tokens):
            r = self.row_of.get(s)
            if r not in self.ahead:
                continue
            for g, kept in enumerate(self.ahead[r]):
                tail = self.tables[g][r, self.nblocks[r] - 1] if self.nblocks[r] else -1
                free_last = self.B - int(self.fill[tail]) if tail >= 0 else 0
                k = min(len(kept), F.append_new_blocks(int(dt), free_last, self.B))
                if k:
                    lent.append((r, g, kept[:k]))
                    self.ahead[r][g] = kept[k:]
        for _, _, blocks in lent:
            self.refcount[blocks] = 0
            self._give_back(blocks[::-1])  # the first kept on top: taken first
        return lent

    def _lend_back(self, lent) -> None:
        for r, g, blocks in reversed(lent):
            self.free_top -= len(blocks)
            self.refcount[blocks] = 1
            self.n_used += len(blocks)
            self.group_used[g] += len(blocks)
            self.ahead[r][g] = np.concatenate([blocks, self.ahead[r][g]])

    def _row_blocks(self, r: int) -> np.ndarray:
        blocks = super()._row_blocks(r)
        if r not in self.ahead:
            return blocks
        return np.concatenate([k[::-1] for k in self.ahead[r]] + [blocks])

    def _release_row(self, r: int) -> None:
        super()._release_row(r)
        self.ahead.pop(r, None)

    def _held(self, rows: np.ndarray) -> np.ndarray:
        held = super()._held(rows)
        if self.ahead:
            held += np.array([sum(map(len, self.ahead.get(r, ()))) for r in rows.tolist()], dtype=np.int64)
        return held

    def block_state(self, seqs=None, **kw):
        raise NotImplementedError(f"{self.name}: a kept lookahead block is held by no table position")


class NumpyEagle(NumpyLookahead):
    """The lookahead pool drafting with EAGLE (vLLM's ``use_eagle``): a prefix hit drops the last
    block it matched, computed again for the draft head's hidden states."""

    name = "numpy-eagle"
    # no group that releases blocks: an EAGLE drop beside a window is not modelled
    # EAGLE's dropped block is a full-attention rule: one full group
    capabilities = dataclasses.replace(NumpyLookahead.capabilities, rule_params={
        **NumpyLookahead.capabilities.rule_params, "hit_drops_last_block": True},
        kinds=("full",), groups=False)

    def _hit_plan(self, keys):
        L, hits = super()._hit_plan(keys)
        return super()._hit_plan(keys[:L - 1]) if L else (L, hits)
