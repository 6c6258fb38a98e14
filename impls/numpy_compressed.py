"""The NumPy paged pool with compressed(r) groups (SPEC §12, DeepSeek-V4's compressed KV): a
NumpyPaged whose group g's table has a position per B * r_g tokens (r = 1 but for compressed(r)),
each block holding B entries, entry k written with token k * r (the K/V of that token, which
the entry reads back at each of its r positions: docs/cache-kinds.md).

NumpyPaged's fast paths (the compiled decode step, the scalar rows, the vectorized append) take
a position per B tokens in every group; this subclass replaces the operations that place
blocks by position with per-entry loops, so that they stay as they are in NumpyPaged. On a model
without compressed groups it is NumpyPaged (each replaced operation hands over to it, its
scalar fast paths aside); on one with them it runs full and mla groups beside them, without
tiers (a sliding, chunked, sinks or state group beside a compressed one is refused, n/a).

Prefix caching: group g's block i is keyed by the prompt's key at B-block (i + 1) * r_g - 1 (the
key of its B * r_g tokens), cached once those tokens are written; a lookup takes the same key
(``_lookup_key``: vLLM-Ascend issue 10296 is a lookup at another granularity), and the hit is
the longest prefix every group hits, a multiple of B * r tokens.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from impls.numpy_paged import NumpyPaged
from kvbench.contract import formulas as F
from kvbench.contract.protocol import Refusal


def _ceil(a, b):
    """ceil(a / b) of ints or NumPy arrays (formulas.blocks_needed takes one int)."""
    return -(-a // b)


class NumpyCompressed(NumpyPaged):
    name = "numpy-compressed"
    capabilities = dataclasses.replace(NumpyPaged.capabilities,
                                       kinds=NumpyPaged.capabilities.kinds + ("compressed",))

    def __init__(self, config):
        super().__init__(config)
        self.ratio = [g.ratio for g in self.groups]
        self.unit = math.lcm(*self.ratio)  # a hit is a multiple of this many B-blocks
        self.plain = self.unit == 1  # no compressed group: NumpyPaged's operations
        others = [g.kind for g in self.groups if g.family not in ("full", "mla", "compressed")]
        if not self.plain and others:
            raise NotImplementedError(Refusal(self.name, f"run {', '.join(others)} groups beside "
                                              f"compressed ones", "SPEC §12",
                                              f"model {config.model.name} has them"))

    def attach_tiers(self, specs) -> None:
        if not self.plain:
            raise NotImplementedError(Refusal(self.name, "keep compressed groups in tiers", "SPEC §11",
                                              "the trace attaches tiers"))
        super().attach_tiers(specs)

    def _positions(self, g: int, nblocks):
        """Table positions of group g for ``nblocks`` B-blocks: ceil(ceil(T / B) / r) =
        ceil(T / (B * r))."""
        return _ceil(nblocks, self.ratio[g])

    def _store_key(self, keys, g: int, i: int):
        """The key position ``i`` of group g is cached under: the prompt's key of its B * r_g
        tokens, B-block (i + 1) * r_g - 1's (None: the prompt keys no such block)."""
        k = (i + 1) * self.ratio[g] - 1
        return keys[k] if k < len(keys) else None

    def _lookup_key(self, keys, g: int, i: int):
        """The key a lookup takes for position ``i`` of group g: the one its store took."""
        return self._store_key(keys, g, i)

    def _cache_at(self, g: int, key, b: int) -> None:
        """Block ``b`` of group g becomes ``key``'s cache entry, unless another block is."""
        if key is not None and (g, key) not in self.by_hash and b >= 0:
            self.by_hash[(g, key)] = b
            self.hash_of[b] = (g, key)

    # --- prefix hit and prefill ------------------------------------------------------------

    def _hit_plan(self, keys) -> tuple[int, list]:
        if self.plain:
            return super()._hit_plan(keys)
        top = len(keys)
        for g, r in enumerate(self.ratio):
            run = 0
            while (run + 1) * r <= top and (g, self._lookup_key(keys, g, run)) in self.by_hash:
                run += 1
            top = run * r
        L = top // self.unit * self.unit
        return L, [np.array([self.by_hash[(g, self._lookup_key(keys, g, i))] for i in range(L // r)],
                            dtype=np.intp) for g, r in enumerate(self.ratio)]

    def _prefill(self, seq, tokens, kv, tenant, final_tokens, step, protect, n, keys):
        if self.plain:
            return super()._prefill(seq, tokens, kv, tenant, final_tokens, step, protect, n, keys)
        npos = [self._positions(g, n) for g in range(self.G)]

        def need(refcount):  # new blocks, plus cached blocks taken back from the free pool
            L, hits = self._hit_plan(keys)
            return (sum(p - L // r for p, r in zip(npos, self.ratio))
                    + sum(int(np.count_nonzero(refcount[h] == 0)) for h in hits))

        r, victims, L, hits = self._admit_row(seq, n, need, protect, keys)
        B, skip = self.B, L * self.B
        for g, (h, p, ratio) in enumerate(zip(hits, npos, self.ratio)):
            fresh = self._take(p - len(h))
            self.block_group[fresh] = g
            self.group_used[g] += len(fresh)
            self.tables[g][r, :p] = np.concatenate([h, fresh])
            self.first[g][r] = 0
            E = _ceil(tokens, ratio)
            self._set_fill(fresh, np.minimum(B, E - np.arange(len(h), p) * B))
            for i in range(len(h), p):
                self._cache_at(g, self._store_key(keys, g, i), int(self.tables[g][r, i]))
            if self.pool is not None and tokens > skip:
                e = np.arange(skip // ratio, E)  # the entries past the hit, each its first token's K/V
                self._write_group(g, self.tables[g][r, e // B] * B + e % B, kv[e * ratio])
        self._row_figures(r, n, tokens, tenant, final_tokens, step)
        return tuple(victims)

    def _cache_chunks(self, seqs) -> None:
        """A chunked prompt's blocks the last append completed (SPEC §13): group g's position i
        once B-block (i + 1) * r_g - 1 of the prompt is written."""
        if self.plain:
            return super()._cache_chunks(seqs)
        for s in seqs:
            if s not in self.chunking:
                continue
            r, (keys, done) = self.row_of[s], self.chunking[s]
            upto = min(len(keys), int(self.tokens[r]) // self.B)
            for g, ratio in enumerate(self.ratio):
                for i in range(done // ratio, upto // ratio):
                    self._cache_at(g, self._store_key(keys, g, i), int(self.tables[g][r, i]))
            if upto == len(keys):
                del self.chunking[s]
            else:
                self.chunking[s] = (keys, upto)

    # --- append and accept -----------------------------------------------------------------

    def _append_need(self, g, rows, dts, refcount) -> int:
        """Blocks group g takes for an append: copies of shared tails it writes entries into
        (writers in batch order), then new blocks."""
        B, ratio, need, dropped = self.B, self.ratio[g], 0, {}
        for row, dt in zip(rows.tolist(), dts.tolist()):
            T = int(self.tokens[row])
            e0, e1 = _ceil(T, ratio), _ceil(T + dt, ratio)
            p, room = _ceil(e0, B), 0
            if p:
                tail = int(self.tables[g][row, p - 1])
                room = B - int(self.fill[tail])
                if room and e1 > e0 and refcount[tail] - dropped.get(tail, 0) > 1:
                    need += 1
                    dropped[tail] = dropped.get(tail, 0) + 1
            need += _ceil(max(0, e1 - e0 - room), B)
        return need

    def _append(self, seqs, tokens, kv, step):
        if self.plain:
            return super()._append(seqs, tokens, kv, step)
        rows = self._rows(seqs)
        dts = np.asarray(tokens, dtype=np.int64)
        self._check_kv(kv, int(dts.sum()))

        def need(refcount):
            return sum(self._append_need(g, rows, dts, refcount) for g in range(self.G))

        victims = self._make_room(need, rows) if need(self.refcount) > self.n_free else []
        starts = self.tokens[rows].copy()
        kv_first = np.cumsum(dts) - dts  # each writer's first row of kv
        B = self.B
        for g, ratio in enumerate(self.ratio):
            for row, T, dt in zip(rows.tolist(), starts.tolist(), dts.tolist()):
                e0, e1 = _ceil(T, ratio), _ceil(T + dt, ratio)
                p = _ceil(e0, B)
                tail = int(self.tables[g][row, p - 1]) if p else -1
                if e1 > e0 and tail >= 0 and self.fill[tail] < B and self.refcount[tail] > 1:
                    copy = self._take(1)  # the writer's private copy of the shared tail
                    self.block_group[copy] = g
                    self.group_used[g] += 1
                    self._add_refs(np.array([tail]), -1)
                    self._set_fill(copy, self.fill[tail])
                    if self.pool is not None:
                        self._copy_blocks(np.array([tail]), copy)
                    self.tables[g][row, p - 1] = copy[0]
            slots, firsts = [], []
            for i, (row, T, dt) in enumerate(zip(rows.tolist(), starts.tolist(), dts.tolist())):
                for e in range(_ceil(T, ratio), _ceil(T + dt, ratio)):
                    if e % B == 0:  # a new block at position e // B
                        self._grow_cols(e // B + 1)
                        b = self._take(1)
                        self.block_group[b] = g
                        self.group_used[g] += 1
                        self.tables[g][row, e // B] = b[0]
                    b = int(self.tables[g][row, e // B])
                    self.fill[b] = e % B + 1
                    self.filled += 1
                    slots.append(b * B + e % B)
                    firsts.append(kv_first[i] + e * ratio - T)
            if self.pool is not None and slots:
                self._write_group(g, np.array(slots, dtype=np.intp), kv[np.array(firsts)])
        end = starts + dts
        self.tokens[rows] = end
        self.nblocks[rows] = _ceil(end, B)
        self.last_access[rows] = step
        self.use_count[rows] += 1
        self.dirty.update(rows.tolist())
        return tuple(victims)

    def accept(self, seq, n, *, drafted, step=0):
        """Roll back the rejected drafts: per group the blocks wholly past the new length
        released (group by group, each from the tail), the tail's entries cut."""
        if self.plain:
            return super().accept(seq, n, drafted=drafted, step=step)
        r = self._row(seq)
        new = int(self.tokens[r]) - (drafted - n)
        nb, B = int(self.nblocks[r]), self.B
        gone, keep = [], []
        for g, t in enumerate(self.tables):
            keep.append(_ceil(new, B * self.ratio[g]))
            gone.append(t[r, keep[g]:self._positions(g, nb)].copy())
            t[r, keep[g]:self._positions(g, nb)] = -1
        self._past_length(r, gone)
        for g, t in enumerate(self.tables):
            if keep[g]:
                self._set_fill(np.array([t[r, keep[g] - 1]]), _ceil(new, self.ratio[g]) - (keep[g] - 1) * B)
        self.nblocks[r] = _ceil(new, B)
        self.tokens[r] = new
        self.dirty.add(r)
        return ()

    # --- what a row holds --------------------------------------------------------------------

    def _row_blocks(self, r: int) -> np.ndarray:
        if self.plain:
            return super()._row_blocks(r)
        nb = int(self.nblocks[r])
        return np.concatenate([t[r, :self._positions(g, nb)][::-1] for g, t in enumerate(self.tables)])

    def _held(self, rows: np.ndarray) -> np.ndarray:
        if self.plain:
            return super()._held(rows)
        return sum(self._positions(g, self.nblocks[rows]) for g in range(self.G))

    def _reservation(self) -> int:
        """Entries of private tails that later tokens of their sequence will write, summed
        (recounted: this pool is for checking, not speed)."""
        if self.plain:
            return super()._reservation()
        self.dirty = set()
        total = 0
        for r in np.flatnonzero(self.live).tolist():
            T, final = int(self.tokens[r]), int(self.final[r])
            for g, ratio in enumerate(self.ratio):
                p = self._positions(g, int(self.nblocks[r]))
                tail = int(self.tables[g][r, p - 1]) if p else -1
                if tail >= 0 and self.refcount[tail] == 1:
                    total += F.tail_reservation(self.B - int(self.fill[tail]),
                                                _ceil(final, ratio) - _ceil(T, ratio))
        return total

    def scanned_ledger(self):
        if self.plain:
            return super().scanned_ledger()
        return dataclasses.replace(super().scanned_ledger(), reservation=self._reservation())

    def gather(self, seq, start=0, stop=None, *, out=None) -> np.ndarray:
        """Positions ``start .. stop-1``: per group, position p reads entry p // r (a full
        group's entry is its token)."""
        if self.plain:
            return super().gather(seq, start, stop, out=out)
        r, stop = self._gather_row(seq, start, stop)
        result = np.zeros((stop - start,) + self.kv_shape, dtype=self.slots.dtype)
        p = np.arange(start, stop)
        for g, (group, ratio) in enumerate(zip(self.groups, self.ratio)):
            e = p // ratio
            slots = self.tables[g][r, e // self.B] * self.B + e % self.B
            data = self.slots[slots].reshape((len(p),) + self.token_shape)
            if self.G == 1:
                result[...] = data
            else:
                result[:, :, list(group.layers)] = data
        if out is not None:
            out[...] = result
            return out
        return result
