"""NumPy paged KV cache: a real block pool with block tables, fill and reference counts as arrays.

Over 500 lines: the pool, its per-group tables, prefix caching, sliding windows and eviction are
one data structure; the vectorized paths (decode step, batched append) touch all of them.

Pool layout ``[num_blocks, block_size, 2, layers_per_group, kv_heads, head_dim]``: one token's K
and V for every layer of a group are one contiguous row, so a decode step over a batch is a single
fancy-indexed write into the flat slot view (slot = block * block_size + offset), as vLLM's
``reshape_and_cache`` does. One pool serves every KV cache group (SPEC §8): a sequence has one
row in each group's 2-D block table (``-1`` past the end, and where a sliding group released a
block), indexed by a row map. Blocks are handed out and released in the oracle's order (its
module docstring), so the checker compares block ids one by one.
"""
from __future__ import annotations

from array import array
from fractions import Fraction

import numpy as np

from impls import paged_kernels
from impls.changes import CachedQueue, StackChanges
from impls.numpy_tiers import NumpyTiers
from impls.pool_events import PoolEvents
from impls.prefix_keys import cache_completed_chunk, hit_plan, prompt_keys, tagged_extra
from impls.states import advance_states, initial_state, read_states
from kvbench.contract import formulas as F
from kvbench.contract.protocol import (
    Backend,
    BlockState,
    CacheConfig,
    Capabilities,
    Ledger,
    OutOfMemory,
    group_view,
)

POLICIES = ("lru", "lfu", "fair")
DENSE_IDS = 1 << 20  # sequence ids below this are looked up in an array, others in a dict
SMALL_BATCH = 8  # decode steps of at most this many sequences take the scalar path
SMALL_PREFILL = 8  # prefills and frees of at most this many blocks (of one group) too
# What the scalar prefill and release paths stand in for: a subclass overriding one (a planted
# fault) takes the vector paths, where its override is
SCALAR_PATH_OF = ("_prefill", "_take", "_fill_row", "_set_fill", "_new_row", "_grow_cols",
                  "_release_row", "_row_blocks", "_release_blocks", "_give_back")


COMMIT_BYTES = 16 << 20  # a pool commits its memory at least this much at a time


def lazy_zeros(shape, dtype) -> np.ndarray:
    """Zeros whose memory the OS gives only when written (calloc: untouched pages are shared zero
    pages), so that a pool costs the memory of the blocks it has used, not of its whole budget.
    The pool writes its blocks' pages itself, in chunks, as it first hands them out (``_commit``),
    so that no page fault lands in a timed decode step."""
    return np.zeros(shape, dtype=dtype)


class NumpyPaged(NumpyTiers, StackChanges, PoolEvents, Backend):
    name = "numpy"
    capabilities = Capabilities(layout="paged", holds_kv=True, fork=True, copy_on_write=True,
                                prefix_caching=True, eviction=POLICIES, chunked_prefill=True,
                                groups=True, cache_salt=True, block_ids=True, tiers=("lru",), swap=True,
                                tier_rules=("drops_failed_loads",),
                                kinds=("full", "sliding", "chunked", "sinks", "mla", "state"))

    compiled_decode = True  # the one-token decode step by impls.paged_kernels where numba is installed

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        n, B = config.num_blocks, config.block_size
        self.B = B
        if config.policy is not None and config.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {config.policy!r} (known: {', '.join(POLICIES)})")
        m = config.model
        self.groups = m.kv_groups
        self.G = len(self.groups)
        self.windows = [g.window for g in self.groups]
        # SPEC §12: groups that give blocks back (sliding, chunked, sinks), and per group the
        # sinks' blocks kept below its released run (table -1 exactly at kept <= i < first).
        self.releasing = any(g.releases for g in self.groups)
        self.kept = [F.sink_blocks(g, B) for g in self.groups]
        self.kv_shape = m.kv_shape  # one token, every layer ([1, L, 1, d] for MLA)
        self.token_shape = m.slot_shape  # one slot of one group
        self.state_groups = F.one_block_states(self.name, m, B)
        self.pool = self._make_pool(n, B) if config.store_kv else None
        self.ready = 0  # blocks below this have their storage's memory written (committed)
        self.refcount = np.zeros(n, dtype=np.int32)
        self.fill = np.zeros(n, dtype=np.int32)
        self.block_group = np.zeros(n, dtype=np.int8)
        # Free blocks as a stack; popping from the top hands out low ids first.
        self.free_stack = np.arange(n - 1, -1, -1, dtype=np.intp)
        self.free_top = n
        rows = 64
        self.tables = [np.full((rows, 16), -1, dtype=np.intp) for _ in self.groups]
        self.first = [np.zeros(rows, dtype=np.intp) for _ in self.groups]  # first held block
        self.nblocks = np.zeros(rows, dtype=np.intp)  # positions' blocks: ceil(tokens / B)
        self.tokens = np.zeros(rows, dtype=np.int64)
        self.final = np.zeros(rows, dtype=np.int64)
        self.last_access = np.zeros(rows, dtype=np.int64)
        self.use_count = np.zeros(rows, dtype=np.int64)
        self.tenant_idx = np.zeros(rows, dtype=np.int32)
        self.live = np.zeros(rows, dtype=bool)
        self.seq_of_row = np.full(rows, -1, dtype=np.int64)
        self.free_rows = list(range(rows - 1, -1, -1))  # pop() gives the lowest
        self.sharing_rows: set = set()  # rows that may hold a block with another reference
        self.row_of: dict[int, int] = {}
        self.row_index = np.full(1024, -1, dtype=np.int64)  # seq id -> row, for batch lookups
        self.tenants: list[str] = []
        self.tenant_ids: dict[str, int] = {}
        # Prefix caching: (group, key) -> block; freed hashed blocks wait in `evictable` (oldest
        # first) and are reused only when the uncached free blocks run out.
        self.by_hash: dict = {}
        self.hash_of: dict = {}
        self._init_events()  # SPEC §14: events() from by_hash
        self.evictable = CachedQueue()  # popitem(last=False): the oldest, O(1)
        self.hit_blocks = 0
        # Chunked prompts (SPEC §13): sequence -> (its whole prompt's keys, blocks cached so far)
        self.chunking: dict = {}
        # Preemption (SPEC §13): sequence -> the Prompt of its prefill (its block hashes), and a
        # preempted one -> (that Prompt, its length, tenant, final length): its resume's request.
        self.requests: dict = {}
        self.preempted: dict = {}
        # The ledger's figures, kept as blocks change hands (ledger() scans nothing): blocks in
        # use, blocks with 2+ references, slots filled in blocks in use, blocks in use per
        # group; reservation per row, recomputed for the rows an operation touched.
        self.n_used = self.n_shared = self.filled = 0
        self.group_used = np.zeros(self.G, dtype=np.int64)
        self.res_row = np.zeros(rows, dtype=np.int64)
        self.res_total = 0
        self.dirty: set = set()
        self.dirty_rows = np.zeros(rows, dtype=bool)  # rows the compiled decode step touched
        self.marked = False  # whether it touched any since the last reservation
        # The compiled decode step (impls.paged_kernels): one group, nothing released, no
        # states, and no subclass's own vectorized step (a planted fault's) to bypass.
        self.decode_step_compiled = (self.compiled_decode and self.G == 1 and not self.releasing
                                     and not self.state_groups
                                     and type(self)._decode_one is NumpyPaged._decode_one
                                     and paged_kernels.kernels() is not None)
        self.scratch = np.zeros((4, 0), dtype=np.int64)  # its rows, tails, fills and slots
        self.scalar_rows = (self.G == 1 and not self.releasing and not any(self.kept)
                            and not self.state_groups
                            and all(getattr(type(self), m) is getattr(NumpyPaged, m)
                                    for m in SCALAR_PATH_OF))
        self.no_blocks = np.zeros(0, dtype=np.intp)
        self.last_batch = None  # (the last compiled step's ids, as given, and as an array)

    @property
    def table(self) -> np.ndarray:
        """The block table of a model of one group."""
        return self.tables[0]

    @property
    def n_free(self) -> int:
        return self.free_top + len(self.evictable)

    # --- K/V storage: every read and write goes through these (a quantized pool overrides them)

    def _make_pool(self, n: int, B: int):
        pool = lazy_zeros((n, B) + self.token_shape, self.config.kv_dtype)
        # One row per token slot: fancy-indexed writes on a 2-D view are many times faster.
        self.slots = pool.reshape(n * B, -1)
        return pool

    def _storage(self) -> list:
        """The arrays holding K/V, each indexed by block along its first axis."""
        return [self.pool]

    def _commit(self, blocks: int) -> None:
        """Write the memory of the storage of blocks below ``blocks``, and some beyond (an eighth
        of what is committed, COMMIT_BYTES at least): the pool grows with the blocks it uses, in
        chunks, and a block's first write finds its pages already there."""
        arrays = self._storage()
        n = self.config.num_blocks
        per_block = sum(a.nbytes for a in arrays) // max(1, n)
        chunk = max(self.ready // 8, COMMIT_BYTES // max(1, per_block), 1)
        hi = min(n, max(blocks, self.ready + chunk))
        for a in arrays:
            a[self.ready:hi] = 0
        self.ready = hi

    def _write_slots(self, slots: np.ndarray, kv) -> None:
        self.slots[slots] = np.asarray(kv).reshape(len(slots), self.slots.shape[1])

    def _read_blocks(self, blocks: np.ndarray, tokens: int) -> np.ndarray:
        """The K/V of the first ``tokens`` slots of ``blocks``, block by block."""
        return self.pool[blocks].reshape((-1,) + self.token_shape)[:tokens]

    def _copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.pool[dst] = self.pool[src]

    def _write_group(self, g: int, slots: np.ndarray, kv) -> None:
        """Write the layers of group ``g`` of ``kv`` (every layer) into ``slots`` (a state
        group keeps no K/V: _advance_states writes its state)."""
        if g not in self.state_groups:
            self._write_slots(slots, group_view(kv, self.groups[g].layers, self.config.model))

    # --- states (SPEC §12, impls.states): slot 0 of a state group's block holds its state

    def _block_at(self, g: int, r: int, i: int) -> int:
        return int(self.tables[g][r, i])

    def _state_in(self, block: int) -> np.ndarray:
        return self.pool[block, 0]

    def _put_state(self, block: int, state) -> None:
        self.pool[block, 0] = state

    def _initial_state(self, g: int, r: int, start: int):
        return initial_state(self, g, r, start)

    def _advance_states(self, rows, starts, dts, kv) -> None:
        if self.state_groups and self.pool is not None:
            advance_states(self, rows, starts, dts, kv)

    def read_state(self, seq) -> np.ndarray:
        if self.pool is None:
            raise NotImplementedError(f"{self.name} was built with store_kv=False")
        r = self._row(seq)
        return read_states(self, r, int(self.tokens[r]))

    # --- bookkeeping -----------------------------------------------------------------------

    def _grow_rows(self):
        old = len(self.nblocks)
        extra = old
        self.tables = [np.vstack([t, np.full((extra, t.shape[1]), -1, np.intp)]) for t in self.tables]
        self.first = [np.concatenate([f, np.zeros(extra, f.dtype)]) for f in self.first]
        for name in ("nblocks", "tokens", "final", "last_access", "use_count", "tenant_idx", "res_row",
                     "dirty_rows"):
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.zeros(extra, arr.dtype)]))
        self.live = np.concatenate([self.live, np.zeros(extra, bool)])
        self.seq_of_row = np.concatenate([self.seq_of_row, np.full(extra, -1, np.int64)])
        self.free_rows.extend(range(old + extra - 1, old - 1, -1))

    def _grow_cols(self, width: int):
        cols = self.tables[0].shape[1]
        while cols < width:
            cols *= 2
        if cols > self.tables[0].shape[1]:
            self.tables = [np.hstack([t, np.full((t.shape[0], cols - t.shape[1]), -1, np.intp)])
                           for t in self.tables]

    def _new_row(self, seq: int) -> int:
        if not self.free_rows:
            self._grow_rows()
        r = self.free_rows.pop()
        self.row_of[seq] = r
        if len(self.row_index) <= seq < DENSE_IDS:
            grown = np.full(max(2 * len(self.row_index), seq + 1), -1, dtype=np.int64)
            grown[:len(self.row_index)] = self.row_index
            self.row_index = grown
        if seq < len(self.row_index):
            self.row_index[seq] = r
        self.seq_of_row[r] = seq
        self.live[r] = True
        return r

    def _row(self, seq: int) -> int:
        try:
            return self.row_of[seq]
        except KeyError:
            raise KeyError(f"{self.name}: unknown sequence {seq}") from None

    def _tenant(self, tenant: str) -> int:
        """The tenant's index in ``self.tenants`` (a dict lookup: a trace may name 10^5 tenants)."""
        i = self.tenant_ids.get(tenant)
        if i is None:
            i = self.tenant_ids[tenant] = len(self.tenants)
            self.tenants.append(tenant)
        return i

    def _take(self, n: int) -> np.ndarray:
        """n blocks at one reference, fill 0 (their group is the caller's to count)."""
        k = min(n, self.free_top)
        ids = self.free_stack[self.free_top - k:self.free_top][::-1].copy()
        self.free_top -= k
        if n > k:  # reuse the least recently freed cached blocks
            old = [self.evictable.popitem(last=False)[0] for _ in range(n - k)]
            for b in old:
                del self.by_hash[self.hash_of.pop(b)]
            ids = np.concatenate([ids, np.array(old, dtype=np.intp)])
            self.fill[ids[k:]] = 0
        self.refcount[ids] = 1
        if self.pool is not None and len(ids) and ids.max() >= self.ready:
            self._commit(int(ids.max()) + 1)
        self.n_used += n
        return ids

    def _add_refs(self, blocks: np.ndarray, delta: int) -> None:
        """``delta`` references per mention of a block in use (it stays in use), keeping the
        count of shared blocks."""
        u = np.unique(blocks)
        before = int(np.count_nonzero(self.refcount[u] > 1))
        np.add.at(self.refcount, blocks, delta)
        self.n_shared += int(np.count_nonzero(self.refcount[u] > 1)) - before

    def _set_fill(self, blocks: np.ndarray, values) -> None:
        """fill of blocks in use (each named once), keeping the count of filled slots."""
        values = np.asarray(values, dtype=np.int64)  # a scalar or one per block: no broadcast_to,
        # which costs more than the rest at a block or two
        used = self.refcount[blocks] > 0  # as a recount would see them
        self.filled += int(((values - self.fill[blocks]) * used).sum())
        self.fill[blocks] = values

    def _give_back(self, dead: np.ndarray) -> None:
        """Blocks at zero references, in release order: cached ones to the end of the evictable
        queue, the others pushed on the free stack."""
        self.n_used -= len(dead)
        self.filled -= int(self.fill[dead].sum())
        if self.G == 1:  # every block is group 0's
            self.group_used[0] -= len(dead)
        elif len(dead):
            self.group_used -= np.bincount(self.block_group[dead], minlength=self.G)
        if self.hash_of:
            cached = np.array([b in self.hash_of for b in dead.tolist()], dtype=bool)
            for b in dead[cached].tolist():
                self.evictable[b] = None
            dead = dead[~cached]
        self.fill[dead] = 0
        self.free_stack[self.free_top:self.free_top + len(dead)] = dead
        self.free_top += len(dead)

    def _release_blocks(self, blocks: np.ndarray) -> None:
        """Drop one reference per mention, in order; a block dies at its last mention."""
        if not len(blocks):
            return
        self._add_refs(blocks, -1)
        dead = blocks[self.refcount[blocks] == 0]
        if len(dead) > 1:
            rev = dead[::-1]
            _, last = np.unique(rev, return_index=True)
            dead = rev[np.sort(last)][::-1]
        self._give_back(dead)

    def _row_blocks(self, r: int) -> np.ndarray:
        """The blocks a row holds, in release order: group by group, each from the tail."""
        nb = self.nblocks[r]
        parts = [t[r, f[r]:nb][::-1] for t, f in zip(self.tables, self.first)]
        if any(self.kept):  # then the sinks' blocks below the released run
            parts = [x for p, t, f, k in zip(parts, self.tables, self.first, self.kept)
                     for x in (p, t[r, :min(k, f[r])][::-1])]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _release_row(self, r: int) -> None:
        """Drop one reference per block of the row; blocks at zero go back to the pool."""
        if (self.scalar_rows and not self.hash_of and r not in self.sharing_rows
                and self.nblocks.item(r) <= SMALL_PREFILL and self._arrays_as_built()):
            self._release_small(r)
        else:
            blocks = self._row_blocks(r)
            if r in self.sharing_rows or self.hash_of:
                self.sharing_rows.discard(r)
                self._release_blocks(blocks)
            else:  # every block of the row is its own: all of them go back
                self.refcount[blocks] = 0
                self._give_back(blocks)
            nb = self.nblocks[r]
            for t, f in zip(self.tables, self.first):
                t[r, :nb] = -1
                f[r] = 0
        self.nblocks[r] = 0
        self.res_total -= int(self.res_row[r])
        self.res_row[r] = 0
        self.dirty.discard(r)
        self.dirty_rows[r] = False
        self.live[r] = False
        self.seq_of_row[r] = -1
        self.free_rows.append(r)

    def _arrays_as_built(self) -> bool:
        """Fills and counts of the dtype __init__ gave them: a planted fault's narrower one takes
        the vector paths, as it is (a scalar write out of its range raises; a vector one wraps)."""
        return self.fill.dtype == np.int32 and self.refcount.dtype == np.int32

    def _release_small(self, r: int) -> None:
        """_release_row's blocks of a row of a few blocks, each its own and uncached (one group,
        nothing released): pushed back on the free stack from the tail, by scalar reads and
        writes (the vector path costs ~15 NumPy calls whatever the row holds)."""
        table, first, refcount, fill, stack = self.tables[0], self.first[0], self.refcount, self.fill, self.free_stack
        nb, lo, top, filled = self.nblocks.item(r), first.item(r), self.free_top, 0
        for i in range(nb - 1, lo - 1, -1):
            b = table.item(r, i)
            refcount[b] = 0
            filled += fill.item(b)
            fill[b] = 0
            stack[top] = b
            top += 1
        table[r, :nb] = -1
        first[r] = 0
        self.free_top = top
        self.n_used -= nb - lo
        self.group_used[0] -= nb - lo
        self.filled -= filled

    def _drop_row(self, r: int) -> None:
        seq = int(self.seq_of_row[r])
        self.chunking.pop(seq, None)
        self.requests.pop(seq, None)
        self._release_row(r)
        del self.row_of[seq]
        if seq < len(self.row_index):
            self.row_index[seq] = -1

    def _held(self, rows: np.ndarray) -> np.ndarray:
        """Blocks each row holds over every group."""
        held = np.zeros(len(rows), dtype=np.int64)
        for f, k in zip(self.first, self.kept):
            held += self.nblocks[rows] - f[rows] + np.minimum(k, f[rows])
        return held

    # --- sliding windows (SPEC §8) ---------------------------------------------------------

    def _slide(self, rows: np.ndarray, lengths: np.ndarray) -> None:
        """Release the blocks of ``rows`` a group no longer holds at T tokens (T from
        ``lengths``; F.released_blocks: below ``T - W + 1``, below the current chunk, or between
        the sinks and the window): group by group, rows in order, each row's highest first."""
        if self.chunking:  # blocks a chunk completed are cached before the window passes them,
            # writers in batch order (two completing one key: the first one's block is the entry)
            self._cache_chunks(self.seq_of_row[rows].tolist())
        for g, group in enumerate(self.groups):
            if not group.releases:
                continue
            first, kept = self.first[g], self.kept[g]
            new_first = np.minimum(F.trailing_first_block(lengths, group, self.B), self.nblocks[rows])
            moving = np.flatnonzero(new_first > first[rows])
            if not len(moving):
                continue
            table = self.tables[g]
            order = []
            for i in moving.tolist():
                r = rows[i]
                lo = max(first[r], kept)  # the sinks' blocks stay
                order.append(table[r, lo:new_first[i]][::-1].copy())
                table[r, lo:new_first[i]] = -1
                first[r] = new_first[i]
            blocks = np.concatenate(order)
            self._release_window(blocks[blocks >= 0])

    def _release_window(self, blocks: np.ndarray) -> None:
        """The blocks a window slid past, in release order: one reference each."""
        self._release_blocks(blocks)

    # --- block arithmetic, vectorized over a batch ----------------------------------------

    def _append_plan(self, rows: np.ndarray, dts: np.ndarray, refcount: np.ndarray, group: int = 0):
        """Per writer: free slots in its tail, whether it copies the tail, new blocks it takes."""
        tails = self.tables[group][rows, self.nblocks[rows] - 1]
        # No tail to write into: a sequence of no block, or a window of 1 past a full block.
        free_last = np.where(tails >= 0, self.B - self.fill[tails], 0)
        writes_tail = (free_last > 0) & (dts > 0)
        spill = np.maximum(0, dts - free_last)
        new = -(-spill // self.B)
        shared = writes_tail & (refcount[tails] > 1)
        if not shared.any():  # the common decode step: nothing to copy
            return tails, free_last, shared, new
        # Writers sharing one tail copy it in batch order until one reference is left.
        order = np.argsort(tails, kind="stable")
        sorted_tails = tails[order]
        first = np.searchsorted(sorted_tails, sorted_tails, side="left")
        w_sorted = writes_tail[order].astype(np.int64)
        before = np.cumsum(w_sorted) - w_sorted
        rank = np.empty_like(before)
        rank[order] = before - before[first]  # tail writers ahead of me on the same block
        cow = writes_tail & (refcount[tails] - rank > 1)
        return tails, free_last, cow, new

    def _victim(self, candidates: np.ndarray) -> int:
        """The row the policy evicts among candidate rows (SPEC §5)."""
        policy = self.config.policy
        seqs = self.seq_of_row[candidates]
        la = self.last_access[candidates]
        if policy == "lfu":
            return int(candidates[np.lexsort((seqs, la, self.use_count[candidates]))[0]])
        if policy == "fair":
            r = self._fair_victim(candidates)
            if r is not None:
                return r
        return int(candidates[np.lexsort((seqs, la))[0]])

    def _fair_victim(self, candidates: np.ndarray):
        """LRU row of the most over-quota tenant that has a candidate; None if none is over."""
        live = np.flatnonzero(self.live)
        usage = np.bincount(self.tenant_idx[live], weights=self._held(live),
                            minlength=len(self.tenants)).astype(np.int64)
        present = {self.tenants[i] for i in self.tenant_idx[live].tolist()}
        # Decimal text, not binary: weight 0.1 is exactly 1/10.
        weights = {t: Fraction(str(self.config.tenant_weights.get(t, 1)))
                   for t in present | set(self.config.tenant_weights)}
        total_w = sum(weights.values())
        budget = self.config.num_blocks
        over = []
        for t in present:
            u = int(usage[self.tenant_ids[t]])
            if u * total_w > weights[t] * budget:
                over.append((u - weights[t] / total_w * budget, t))
        for _, t in sorted(over, reverse=True):
            mine = candidates[self.tenant_idx[candidates] == self.tenant_ids[t]]
            if len(mine):
                return int(mine[np.lexsort((self.seq_of_row[mine], self.last_access[mine]))[0]])
        return None

    def _make_room(self, need_fn, protect_rows: np.ndarray) -> list:
        """Evict until ``need_fn(refcount)`` blocks are free; atomic OOM when impossible."""
        need = need_fn(self.refcount)
        if need <= self.n_free:
            return []
        cand = np.flatnonzero(self.live) if self.config.policy is not None else ()
        if len(cand):
            cand = cand[~np.isin(cand, protect_rows)]
        if len(cand) == 0:  # no policy, or nothing it may evict
            raise OutOfMemory(f"{self.name}: needs {need} blocks, {self.n_free} free")
        # Would evicting every candidate be enough? If not, fail before touching anything.
        blocks = np.concatenate([self._row_blocks(r) for r in cand])
        drop = np.bincount(blocks, minlength=len(self.refcount)).astype(np.int32)
        after = self.refcount - drop
        if need_fn(after) > self.n_free + int(np.count_nonzero((after == 0) & (self.refcount > 0))):
            raise OutOfMemory(f"{self.name}: needs {need_fn(self.refcount)} blocks, "
                              f"{self.n_free} free even after evicting every candidate")
        victims = []
        while need_fn(self.refcount) > self.n_free:
            cand = np.flatnonzero(self.live)
            cand = cand[~np.isin(cand, protect_rows)]
            r = self._victim(cand)
            victims.append(int(self.seq_of_row[r]))
            self._drop_row(r)
        return victims

    def _extra_keys(self, salt, adapter) -> bytes:
        return tagged_extra(salt, adapter)

    def _hit_plan(self, keys) -> tuple[int, list]:
        L, hits = hit_plan(keys, self.by_hash, self.groups, self.B)
        return L, [np.array(h, dtype=np.intp) for h in hits]

    # --- the protocol ----------------------------------------------------------------------

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        if seq in self.row_of:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        tokens, tenant, final_tokens = prompt.tokens, prompt.tenant, prompt.final_tokens
        self._check_kv(kv, tokens)
        n = -(-tokens // self.B)
        keys = []
        if self.config.prefix_caching:
            keys = prompt_keys(prompt, self.B, self._extra_keys(prompt.salt, prompt.adapter))
            self.note_prompt(keys)
            if len(keys) > tokens // self.B:  # a chunked prompt: its later blocks once written
                keys, later = keys[:tokens // self.B], keys
                victims = self._prefill(seq, tokens, kv, tenant, final_tokens, step, protect, n, keys)
                self.chunking[seq] = (later, len(keys))
                self.requests[seq] = prompt
                return victims
        victims = self._prefill(seq, tokens, kv, tenant, final_tokens, step, protect, n, keys)
        self.requests[seq] = prompt  # dropped with its row
        return victims

    def _prefill(self, seq, tokens, kv, tenant, final_tokens, step, protect, n, keys):
        if not keys and self.G * n <= self.free_top:  # nothing to look up or evict
            if self.scalar_rows and n <= SMALL_PREFILL and self._arrays_as_built():
                return self._prefill_small(seq, tokens, kv, tenant, final_tokens, step, n)
            r = self._new_row(seq)
            self._grow_cols(n)
            ids = self._take(self.G * n)
            return self._fill_row(r, ids.reshape(self.G, n), [0] * self.G, tokens, kv, tenant,
                                  final_tokens, step)

        def need(refcount):  # new blocks, plus cached blocks taken back from the free pool
            L, hits = self._hit_plan(keys)
            return self.G * (n - L) + sum(int(np.count_nonzero(refcount[h] == 0)) for h in hits)

        r, victims, L, hits = self._admit_row(seq, n, need, protect, keys)
        fresh = self._take(self.G * (n - L)).reshape(self.G, n - L)
        ids = [np.concatenate([np.full(L - len(h), -1, np.intp), h, f]) for h, f in zip(hits, fresh)]
        first = [L - len(h) for h in hits]
        for g, k in enumerate(self.kept):
            if k and len(hits[g]):  # the sinks' blocks, then the window's
                ids[g][:L] = -1
                ids[g][F.held_blocks(L * self.B, self.groups[g], self.B)] = hits[g]
                first[g] = min(L, int(F.trailing_first_block(L * self.B, self.groups[g], self.B)))
        for g in range(self.G):
            for i in range(L, len(keys)):
                if (g, keys[i]) not in self.by_hash:
                    self.by_hash[(g, keys[i])] = int(ids[g][i])
                    self.hash_of[int(ids[g][i])] = (g, keys[i])
        return self._fill_row(r, ids, first, tokens, kv, tenant, final_tokens, step, L, victims)

    def _admit_row(self, seq, n: int, need, protect, keys) -> tuple:
        """A prefill's room (``need(refcount)``: the blocks it takes; victims evicted, ``protect``
        spared), its new row of ``n`` columns and its prefix hit's blocks referenced, cached ones
        back in use: (row, victims, L, hits)."""
        protect_rows = np.array([self.row_of[s] for s in protect if s in self.row_of], dtype=np.int64)
        victims = self._make_room(need, protect_rows)
        r = self._new_row(seq)
        self._grow_cols(n)
        L, hits = self._hit_plan(keys)
        for h in hits:
            back = h[self.refcount[h] == 0]  # cached blocks back in use, full
            for b in back.tolist():
                del self.evictable[b]
            self.n_used += len(back)
            self.filled += int(self.fill[back].sum())
            if len(back):
                self.group_used += np.bincount(self.block_group[back], minlength=self.G)
            self.n_shared += int(np.count_nonzero(self.refcount[h] == 1))
            self.refcount[h] += 1
            self.hit_blocks += len(h)
        return r, victims, L, hits

    def _prefill_small(self, seq, tokens, kv, tenant, final_tokens, step, n):
        """_prefill's row of a few blocks of one group from the free stack, nothing to look up or
        evict, by scalar reads and writes (the vector path costs ~25 NumPy calls whatever the
        size); the same blocks, in the same order, as _take and _fill_row give."""
        r = self._new_row(seq)
        self._grow_cols(n)
        table, stack, refcount, fill, group = self.tables[0], self.free_stack, self.refcount, self.fill, self.block_group
        top, B, filled, ids = self.free_top, self.B, 0, []
        for i in range(n):
            b = stack.item(top - 1 - i)
            ids.append(b)
            table[r, i] = b
            refcount[b] = 1
            f = B if i < n - 1 else tokens - (n - 1) * B
            filled += f - fill.item(b)
            fill[b] = f
            group[b] = 0
        self.free_top = top - n
        self.first[0][r] = 0
        self.n_used += n
        self.group_used[0] += n
        self.filled += filled
        if self.pool is not None and n and max(ids) >= self.ready:
            self._commit(max(ids) + 1)
        return self._row_filled(r, n, None if self.pool is None else [np.array(ids, dtype=np.intp)],
                                tokens, kv, tenant, final_tokens, step)

    def _fill_row(self, r, ids, first, tokens, kv, tenant, final_tokens, step, n_hit=0, victims=()):
        """A new row: per group its blocks by position (-1 below ``first``), filled in order."""
        n = len(ids[0])
        for g in range(self.G):
            held = ids[g][first[g]:]
            self.tables[g][r, :n] = ids[g]
            self.first[g][r] = first[g]
            fresh = ids[g][n_hit:]
            self.block_group[fresh] = g
            self.group_used[g] += len(fresh)
            if len(held):  # full blocks; the last holds what is left
                fills = np.empty(len(held), dtype=np.int64)
                fills[:] = self.B
                fills[-1] = tokens - (n - 1) * self.B
                self._set_fill(held, fills)
        return self._row_filled(r, n, ids, tokens, kv, tenant, final_tokens, step, n_hit, victims)

    def _row_figures(self, r, n, tokens, tenant, final_tokens, step) -> None:
        """A new row's figures: ``n`` blocks of ``tokens`` tokens, its tenant, final length and clock."""
        self.dirty.add(r)
        self.nblocks[r] = n
        self.tokens[r] = tokens
        self.final[r] = final_tokens if final_tokens is not None else tokens
        self.last_access[r], self.use_count[r] = step, 1
        self.tenant_idx[r] = self._tenant(tenant)

    def _row_filled(self, r, n, ids, tokens, kv, tenant, final_tokens, step, n_hit=0, victims=()):
        """A new row of ``n`` blocks: its figures, and its K/V written into its blocks ``ids``
        (per group; None when the pool keeps no K/V)."""
        self._row_figures(r, n, tokens, tenant, final_tokens, step)
        if self.pool is not None and tokens > n_hit * self.B:  # hits hold their prefix's K/V
            skip = n_hit * self.B
            for g in range(self.G):
                slots = (ids[g][n_hit:, None] * self.B + np.arange(self.B)).reshape(-1)[:tokens - skip]
                self._write_group(g, slots, kv[skip:])
            self._advance_states(np.array([r]), np.array([skip]), np.array([tokens - skip]), kv[skip:])
        if self.releasing:
            self._slide(np.array([r]), self.tokens[[r]])
        return tuple(victims)

    def _check_kv(self, kv, tokens: int):
        """Refuse K/V of the wrong shape before anything changes."""
        if self.pool is None:
            return
        want = (tokens,) + self.kv_shape
        if kv is None or tuple(np.shape(kv)) != want:
            raise ValueError(f"{self.name}: kv must have shape {want}, got "
                             f"{None if kv is None else tuple(np.shape(kv))}")

    def _rows(self, seqs) -> np.ndarray:
        ids = np.asarray(seqs, dtype=np.int64)
        if len(ids) and 0 <= ids.min() and ids.max() < len(self.row_index):
            rows = self.row_index[ids]
            if (rows >= 0).all():
                return rows
        try:  # ids beyond the dense index, or an unknown one
            return np.fromiter(map(self.row_of.__getitem__, seqs), dtype=np.int64, count=len(ids))
        except KeyError as e:
            raise KeyError(f"{self.name}: unknown sequence {e.args[0]}") from None

    def append(self, seqs, tokens, kv=None, *, step=0):
        victims = self._append(seqs, tokens, kv, step)
        if self.chunking:
            self._cache_chunks(seqs)
        return victims

    def _cache_chunks(self, seqs) -> None:
        """Cache the blocks of chunked prompts that the last append completed (SPEC §13)."""
        for s in seqs:
            if s in self.chunking:
                r = self.row_of[s]
                cache_completed_chunk(self.chunking, s, int(self.tokens[r]) // self.B,
                                      lambda lo, hi: [t[r, lo:hi].tolist() for t in self.tables],
                                      self.by_hash, self.hash_of)

    def accept(self, seq, n, *, drafted, step=0):
        """Roll back the drafted - n rejected draft tokens: blocks wholly past the new length
        released (group by group, each from the tail), the tail's fill shrunk."""
        r = self._row(seq)
        new = int(self.tokens[r]) - (drafted - n)
        keep, nb = -(-new // self.B), int(self.nblocks[r])
        gone = [t[r, keep:nb].copy() for t in self.tables]
        for t in self.tables:
            t[r, keep:nb] = -1
        self._past_length(r, gone)
        self.nblocks[r] = keep
        if keep:
            tails = np.array([t[r, keep - 1] for t in self.tables], dtype=np.intp)
            self._set_fill(tails[tails >= 0], new - (keep - 1) * self.B)
        self.tokens[r] = new
        self.dirty.add(r)
        return ()

    def _past_length(self, r, gone) -> None:
        """The blocks an accept left wholly past row ``r``'s length (per group, by position):
        released, group by group, each from the tail."""
        gone = np.concatenate([g[::-1] for g in gone])
        self._release_blocks(gone[gone >= 0])

    def _append(self, seqs, tokens, kv, step):
        if len(seqs) <= SMALL_BATCH and self._decode_small(seqs, tokens, kv, step):
            return ()
        if self.decode_step_compiled and self._decode_compiled(seqs, tokens, kv, step):
            return ()
        rows = self._rows(seqs)
        dts = np.asarray(tokens, dtype=np.int64)
        self._check_kv(kv, int(dts.sum()))
        if self._decode_one(rows, dts, kv, step):
            return ()

        def need(refcount):
            return sum(int(cow.sum() + new.sum()) for _, _, cow, new in
                       (self._append_plan(rows, dts, refcount, g) for g in range(self.G)))

        victims = []
        if need(self.refcount) > self.n_free:
            victims = self._make_room(need, rows)
        nb_old = self.nblocks[rows].copy()
        writer = np.repeat(np.arange(len(rows)), dts)
        tstarts = np.cumsum(dts) - dts
        pos = self.tokens[rows][writer] + np.arange(int(dts.sum())) - tstarts[writer]
        off = pos % self.B
        end = self.tokens[rows] + dts
        last_in_block = (off == self.B - 1) | (pos == end[writer] - 1)
        for g in range(self.G):
            table = self.tables[g]
            tails, free_last, cow, new = self._append_plan(rows, dts, self.refcount, g)
            ids = self._take(int(cow.sum() + new.sum()))
            self.block_group[ids] = g
            self.group_used[g] += len(ids)
            # Copy-on-write: each copying writer gets a private copy of its tail (data and fill).
            n_cow = int(cow.sum())
            if n_cow:
                src, dst = tails[cow], ids[:n_cow]
                self._add_refs(src, -1)
                self._set_fill(dst, self.fill[src])
                if self.pool is not None:
                    self._copy_blocks(src, dst)
                table[rows[cow], nb_old[cow] - 1] = dst
            # New blocks go to the end of each writer's table.
            fresh = ids[n_cow:]
            self._grow_cols(int((nb_old + new).max()))
            table = self.tables[g]
            owner = np.repeat(np.arange(len(rows)), new)
            starts = np.cumsum(new) - new
            logical = nb_old[owner] + np.arange(len(fresh)) - starts[owner]
            table[rows[owner], logical] = fresh
            # Every new token: its block and offset.
            phys = table[rows[writer], pos // self.B]
            self._set_fill(phys[last_in_block], off[last_in_block] + 1)
            if self.pool is not None:
                self._write_group(g, phys * self.B + off, kv)
            if g == self.G - 1:
                self.nblocks[rows] = nb_old + new
        self._advance_states(rows, end - dts, dts, kv)
        self.tokens[rows] = end
        self.last_access[rows] = step
        self.use_count[rows] += 1
        self.dirty.update(rows.tolist())
        if self.releasing:
            self._slide(rows, end)
        return tuple(victims)

    def _decode_small(self, seqs, tokens, kv, step) -> bool:
        """A decode step of a few sequences, one token each into a private tail with room:
        scalar reads and writes (a vectorized step costs ~20 NumPy calls whatever the batch).
        False, having changed nothing, where the vectorized path is needed."""
        if self.G != 1 or self.releasing:
            return False
        B, table, fill, refcount = self.B, self.tables[0], self.fill, self.refcount
        plan = []
        for s, t in zip(seqs, tokens):  # .item(): a Python int without a NumPy scalar between
            r = self.row_of.get(s)
            if r is None or t != 1:
                return False
            nb = self.nblocks.item(r)
            tail = table.item(r, nb - 1) if nb else -1
            if tail < 0:
                return False
            f = fill.item(tail)
            if f >= B or refcount.item(tail) != 1:
                return False
            plan.append((r, tail, f))
        if len(plan) > 1 and len({r for r, _, _ in plan}) != len(plan):
            return False
        if self.pool is not None:
            self._check_kv(kv, len(plan))
            self._write_slots(np.array([tail * B + f for _, tail, f in plan]), kv)
        tokens_, last, uses, dirty = self.tokens, self.last_access, self.use_count, self.dirty
        for r, tail, f in plan:
            fill[tail] = f + 1
            tokens_[r] = tokens_.item(r) + 1
            last[r] = step
            uses[r] = uses.item(r) + 1
            dirty.add(r)
        self.filled += len(plan)
        return True

    def _decode_compiled(self, seqs, tokens, kv, step) -> bool:
        """The one-token decode step of a batch given as lists by the compiled kernels; False,
        having changed nothing, where they do not apply (or numba is not installed)."""
        if type(tokens) not in (list, tuple) or type(seqs) not in (list, tuple) \
                or tokens.count(1) != len(tokens):
            return False
        table, n = self.tables[0], len(seqs)
        rows = len(self.nblocks)
        if not (len(self.tokens) == len(self.last_access) == len(self.use_count) == len(self.dirty_rows)
                == table.shape[0] == rows) or self.fill.dtype != np.int32 or self.refcount.dtype != np.int32:
            return False  # (arrays a planted fault changed: the NumPy step, as it is)
        ids = self._batch_ids(seqs)
        if ids is None:
            return False
        if self.scratch.shape[1] < n:
            self.scratch = np.zeros((4, 2 * n), dtype=np.int64)
        plan, apply = paged_kernels.kernels()
        need, widest = plan(ids, self.row_index, self.nblocks, table, self.fill, self.refcount, self.B,
                            self.scratch)
        if need == paged_kernels.NOT_HERE:
            return False
        self._check_kv(kv, n)
        if need > self.n_free:
            return False
        taken = self.no_blocks
        if need:
            if widest >= table.shape[1]:
                self._grow_cols(widest + 1)
                table = self.tables[0]
            taken = self._take(need)
            self.block_group[taken] = 0
            self.group_used[0] += need
        apply(n, taken, self.nblocks, table, self.fill, self.tokens, self.last_access, self.use_count,
              self.dirty_rows, self.B, step, self.scratch)
        self.marked = True
        self.filled += n
        if self.pool is not None:
            self._write_group(0, self.scratch[3, :n], kv)
        return True

    def _batch_ids(self, seqs):
        """A batch's ids as an int64 array (None: not all fit), the last one's again when this
        batch names the same ids (a decode batch is mostly the same sequences step to step)."""
        last = self.last_batch
        if last is not None and type(seqs) is type(last[0]) and seqs == last[0]:
            return last[1]
        try:
            ids = np.frombuffer(array("q", seqs), dtype=np.int64)
        except (TypeError, OverflowError):
            return None
        self.last_batch = (seqs if type(seqs) is tuple else list(seqs), ids)
        return ids

    def _decode_one(self, rows, dts, kv, step) -> bool:
        """The common decode step (one token each, no shared tail, room free): few array ops.

        Returns False, having changed nothing, when the general path is needed.
        """
        if dts.max() != 1 or dts.min() != 1:
            return False
        nb = self.nblocks[rows]
        plans = []
        for g in range(self.G):
            tails = self.tables[g][rows, nb - 1]
            fill = np.where(tails >= 0, self.fill[tails], self.B)  # no tail: as if it were full
            full = fill == self.B
            if (self.refcount[tails][~full] > 1).any():
                return False
            plans.append((tails, fill, full))
        n_new = sum(int(full.sum()) for _, _, full in plans)
        if n_new > self.n_free:
            return False
        if n_new and int(nb.max()) >= self.tables[0].shape[1]:
            self._grow_cols(int(nb.max()) + 1)
        grew = plans[0][2]
        for g, (tails, fill, full) in enumerate(plans):
            if full.any():
                ids = self._take(int(full.sum()))
                self.block_group[ids] = g
                self.group_used[g] += len(ids)
                self.tables[g][rows[full], nb[full]] = ids
                tails[full] = ids
                fill[full] = 0
            if self.pool is not None:
                self._write_group(g, tails * self.B + fill, kv)
            self.fill[tails] = fill + 1
            self.filled += len(tails)
        if grew.any():
            self.nblocks[rows[grew]] += 1
        self._advance_states(rows, self.tokens[rows], dts, kv)
        self.tokens[rows] += 1
        self.last_access[rows] = step
        self.use_count[rows] += 1
        self.dirty.update(rows.tolist())
        if self.releasing:
            self._slide(rows, self.tokens[rows])
        return True

    def fork(self, seq, src, *, final_tokens=None, step=0):
        if seq in self.row_of:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        rs = self._row(src)
        nb = int(self.nblocks[rs])
        states = self.state_groups if nb else []
        victims = self._make_room(lambda rc: len(states), np.array([rs])) if states else []
        r = self._new_row(seq)
        for t, f in zip(self.tables, self.first):
            t[r, :nb] = t[rs, :nb]
            f[r] = f[rs]
        self.nblocks[r] = nb
        copies = self._take(len(states))  # SPEC §12: the states copied, the rest shared
        for g, b in zip(states, copies.tolist()):
            src_b = self.tables[g][r, nb - 1]
            self.block_group[b] = g
            self.group_used[g] += 1
            self._set_fill(np.array([b]), self.fill[src_b])
            if self.pool is not None:
                self._copy_blocks(np.array([src_b]), np.array([b]))
            self.tables[g][r, nb - 1] = b
        shared = self._row_blocks(r)
        self._add_refs(shared[~np.isin(shared, copies)], 1)
        self.sharing_rows.update((r, rs))
        self.dirty.update((r, rs))
        self.tokens[r] = self.tokens[rs]
        self.final[r] = final_tokens if final_tokens is not None else self.tokens[rs]
        self.last_access[r], self.use_count[r] = step, 1
        self.tenant_idx[r] = self.tenant_idx[rs]
        return tuple(victims)

    def free(self, seq, *, step=0):
        if not self._drop_preempted(seq):  # a preempted sequence holds no device block
            self._drop_row(self._row(seq))

    def _reservation(self) -> int:
        """Slots of private tails that later tokens of their sequence will fill, summed; each
        row's share recomputed only if the row was touched or may share a block."""
        rows = self.dirty | self.sharing_rows
        self.dirty = set()
        marked = None
        if self.marked:
            self.marked = False
            marked = np.flatnonzero(self.dirty_rows)
            self.dirty_rows[marked] = False
        if rows or marked is not None:
            rows = np.fromiter(rows, dtype=np.int64, count=len(rows))
            if marked is not None:
                rows = np.union1d(rows, marked) if len(rows) else marked
            rows = rows[self.live[rows]]
            B = self.B
            res = np.zeros(len(rows), dtype=np.int64)
            for table in self.tables:
                tails = table[rows, self.nblocks[rows] - 1]
                private = (self.refcount[tails] == 1) & (tails >= 0)
                reserve = F.tail_reservation(B - self.fill[tails], self.final[rows] - self.tokens[rows])
                res += np.where(private, reserve, 0)
            self.res_total += int(res.sum() - self.res_row[rows].sum())
            self.res_row[rows] = res
        return self.res_total

    def ledger(self, seqs=None) -> Ledger:
        """The ledger from the counters kept as blocks change hands; ``seqs``: the per-sequence
        figures of these sequences only (None: every live one)."""
        if seqs is None:
            rows = np.flatnonzero(self.live)
        else:
            rows = np.array([self.row_of[s] for s in seqs if s in self.row_of], dtype=np.int64)
        ids = self.seq_of_row[rows].tolist()
        return self._ledger(
            blocks_used=self.n_used, tokens=dict(zip(ids, self.tokens[rows].tolist())),
            seq_blocks=dict(zip(ids, self._held(rows).tolist())), token_states=self.filled,
            reservation=self._reservation(), shared_blocks=self.n_shared,
            group_blocks=tuple(self.group_used.tolist()))

    def block_bytes(self) -> int:
        return self.B * self.config.model.slot_bytes

    def _ledger(self, **facts) -> Ledger:
        return Ledger.paged(num_blocks=self.config.num_blocks, block_size=self.B,
                            block_bytes=self.block_bytes(),
                            blocks_free=self.n_free, cached_blocks=len(self.evictable),
                            prefix_hit_blocks=self.hit_blocks, **facts)

    def scanned_ledger(self) -> Ledger:
        """The same figures recounted from the arrays (O(pool)): what the counters must equal."""
        B = self.B
        used = self.refcount > 0
        n_used = int(used.sum())
        rows = np.flatnonzero(self.live)
        reservation = 0
        for table in self.tables:
            tails = table[rows, self.nblocks[rows] - 1]
            private = (self.refcount[tails] == 1) & (tails >= 0)
            reserve = F.tail_reservation(B - self.fill[tails], self.final[rows] - self.tokens[rows])
            reservation += int(reserve[private].sum())
        led = NumpyPaged.ledger(self)
        return self._ledger(
            blocks_used=n_used, tokens=led.tokens, seq_blocks=led.seq_blocks,
            token_states=int(self.fill[used].sum()), reservation=reservation,
            shared_blocks=int((self.refcount > 1).sum()),
            group_blocks=tuple(np.bincount(self.block_group[used], minlength=self.G).tolist()))

    def _positions(self, g: int, nblocks: int) -> int:
        """Table positions of group ``g`` for ``nblocks`` blocks of B tokens (one each here)."""
        return nblocks

    def block_state(self, seqs=None, *, changed_since=None) -> BlockState:
        rows = np.flatnonzero(self.live) if seqs is None else [self.row_of[s] for s in seqs
                                                               if s in self.row_of]
        tables = {int(self.seq_of_row[r]): [t[r, :self._positions(g, int(self.nblocks[r]))]
                                            for g, t in enumerate(self.tables)] for r in rows}
        mark, changes = self._changes(changed_since, lambda low: self.free_stack[low:self.free_top][::-1])
        if changes is not None:
            return BlockState(None, None, self.refcount, tables, mark, changes)
        return BlockState(free=self.free_stack[:self.free_top][::-1], cached=list(self.evictable),
                          refcount=self.refcount, tables=tables, mark=mark)

    def _gather_row(self, seq, start: int, stop):
        """The row of ``seq`` and the end of a read of ``start .. stop-1`` (None: its length),
        the range checked against its tokens."""
        if self.pool is None:
            raise NotImplementedError(f"{self.name} was built with store_kv=False")
        r = self._row(seq)
        T = int(self.tokens[r])
        stop = T if stop is None else stop
        if not 0 <= start <= stop <= T:
            raise IndexError(f"{self.name}: positions {start}..{stop} of sequence {seq} ({T} tokens)")
        return r, stop

    def gather(self, seq, start=0, stop=None, *, out=None) -> np.ndarray:
        """Positions ``start .. stop-1`` of the sequence: the blocks that hold them and no
        others (a range costs what it holds), into ``out`` when given."""
        r, stop = self._gather_row(seq, start, stop)
        if self.G == 1 and int(self.first[0][r]) * self.B <= start:
            return self._read_range(self.tables[0][r], start, stop, out)
        result = out if out is not None else None
        for g, group in enumerate(self.groups):
            lo = max(start, int(self.first[g][r]) * self.B)  # below: released by the window
            if g in self.state_groups:  # no K/V: zeros in its layers
                lo = stop
            data = self._read_range(self.tables[g][r], lo, stop, None) if lo < stop else None
            sinks = min(self.kept[g] * self.B, lo, stop)  # a sinks group's kept head
            head = self._read_range(self.tables[g][r], start, sinks, None) if start < sinks else None
            if result is None:  # the pool's read dtype (a quantized pool dequantizes to float32)
                dtype = data.dtype if data is not None else self._read_range(self.tables[g][r], 0, 0, None).dtype
                result = np.zeros((stop - start,) + self.kv_shape, dtype=dtype)
            elif out is not None and g == 0:
                result[...] = 0
            layers = slice(None) if self.G == 1 else list(group.layers)
            if data is not None:
                result[lo - start:, :, layers] = data
            if self.G > 1 and lo > start:
                result[:lo - start, :, layers] = 0
            if head is not None:
                result[:sinks - start, :, layers] = head
        return result

    def gather_ranges(self, seqs, starts, stops) -> np.ndarray:
        """Several ranges in one fancy-indexed read of their slots (one group, nothing released
        by a window, the plain pool); else a gather per range."""
        cls = type(self)
        if self.pool is None or self.G != 1 or cls._read_range is not NumpyPaged._read_range \
                or cls.gather is not NumpyPaged.gather:  # a subclass's gather is what it reads
            return super().gather_ranges(seqs, starts, stops)
        rows = self._rows(seqs)
        a = np.asarray(starts, dtype=np.int64)
        b = np.asarray(stops, dtype=np.int64)
        if ((a < self.first[0][rows] * self.B) | (a > b) | (b > self.tokens[rows]) | (a < 0)).any():
            return super().gather_ranges(seqs, starts, stops)
        n = b - a
        owner = np.repeat(np.arange(len(rows)), n)
        p = np.arange(int(n.sum())) + np.repeat(a - (np.cumsum(n) - n), n)
        slots = self.tables[0][rows[owner], p // self.B] * self.B + p % self.B
        return self.slots[slots].reshape((len(p),) + self.token_shape)

    def _read_range(self, table_row: np.ndarray, start: int, stop: int, out) -> np.ndarray:
        """Slots ``start .. stop-1`` of a table row, whole blocks at a time into ``out`` (a fresh
        array when None: a slot-by-slot gather ran at 0.41 of a copy of the same bytes, this at
        0.72); a slot-by-slot gather only into a caller's non-contiguous ``out``. np.take with an
        ``out`` buffers every row unless mode is not 'raise': the table's block ids are in range
        by construction."""
        B = self.B
        if out is None:  # a fresh output read whole blocks at a time, as into a buffer
            out = np.empty((stop - start,) + self.token_shape, self.slots.dtype)
        elif not out.flags.c_contiguous:
            p = np.arange(start, stop)
            out[...] = self.slots[table_row[p // B] * B + p % B].reshape((stop - start,) + self.token_shape)
            return out
        rows = out.reshape(stop - start, self.slots.shape[1])  # a view: out is contiguous
        lo, hi = min(-(-start // B) * B, stop), max(stop // B * B, start)  # whole blocks: lo .. hi
        if lo > start:  # the head, inside one block
            first = int(table_row[start // B]) * B
            rows[:lo - start] = self.slots[first + start % B:first + (lo - 1) % B + 1]
        if hi > lo:
            blocks = self.slots.reshape(-1, B * self.slots.shape[1])
            np.take(blocks, table_row[lo // B:hi // B], axis=0, mode="clip",
                    out=rows[lo - start:hi - start].reshape(-1, blocks.shape[1]))
        if stop > max(hi, lo):  # the tail, inside one block
            last = int(table_row[hi // B]) * B
            rows[max(hi, lo) - start:] = self.slots[last + max(hi, lo) % B:last + (stop - 1) % B + 1]
        return out
