"""PyTorch paged KV cache: the NumPy backend's semantics with the pool and its tables on a device.

Over 500 lines: the same data structure as impls/numpy_paged.py (pool, per-group tables, prefix
caching, sliding windows, eviction), on tensors; the two are proven identical op by op.

The pool ``[num_blocks, block_size, 2, layers_per_group, kv_heads, head_dim]``, the block tables
(one per KV cache group), fill counts, reference counts and the free-block stack are tensors on
``config.device`` (cpu or cuda). A batched decode step is planned and written with tensor
operations over the whole batch (copy-on-write copies, new blocks, one scatter of the new tokens
into the flat slot view); the host reads back only the few counts it needs for the out-of-memory
check (one sync per call). Eviction metadata (last access, use count, tenant), the sequence -> row
map, each group's first held block (sliding windows) and the prefix cache's hash maps stay on the
host, where the policies and lookups read them; they change only with host-side values.

torch is imported lazily: ``import impls.torch_paged`` works without it, and ``available()`` says
why it cannot run.
"""
from __future__ import annotations

import importlib.util
from fractions import Fraction

import numpy as np

from impls.changes import CachedQueue, StackChanges
from impls.pool_events import PoolEvents
from impls.prefix_keys import cache_completed_chunk, hit_plan, prompt_keys
from impls.states import advance_states, initial_state, read_states
from impls.torch_tiers import TorchTiers
from kvbench.contract import formulas as F
from kvbench.contract.protocol import (
    Backend,
    BlockState,
    CacheConfig,
    Capabilities,
    Ledger,
    OutOfMemory,
    gathered_range,
)

POLICIES = ("lru", "lfu", "fair")
COMMIT_BYTES = 16 << 20  # the CPU pool commits its memory at least this much at a time


def _import_torch():
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(f"the torch backend needs PyTorch, which cannot be imported: {e}") from None
    return torch


def resolve_device(torch, name: str):
    """A torch.device for ``name``; a clear error for a device this machine cannot serve."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"torch backend: {name!r} is not a device name ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"torch backend: device {name!r} was asked for, but CUDA is not "
                             f"available here (torch {torch.__version__}, built with CUDA "
                             f"{torch.version.cuda or 'none'})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"torch backend: device {name!r} does not exist "
                             f"({torch.cuda.device_count()} CUDA device(s))")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"torch backend runs on 'cpu' or 'cuda', not {name!r}")
    return dev


class _Counts:
    """Reference counts read on the host only at the blocks asked for (``counts[ids]``)."""

    def __init__(self, refcount):
        self.refcount = refcount

    def __getitem__(self, ids):
        index = self.refcount.new_tensor(np.asarray(ids, dtype=np.int64))
        return self.refcount.index_select(0, index).cpu().numpy()


class TorchPaged(TorchTiers, StackChanges, PoolEvents, Backend):
    name = "torch"
    capabilities = Capabilities(layout="paged", holds_kv=True, fork=True, copy_on_write=True,
                                prefix_caching=True, eviction=POLICIES, chunked_prefill=True,
                                groups=True, cache_salt=True, block_ids=True, tiers=("lru",), swap=True,
                                tier_rules=("drops_failed_loads",),
                                kinds=("full", "sliding", "chunked", "sinks", "mla", "state"))

    @classmethod
    def available(cls) -> tuple[bool, str]:
        # Found, not imported: importing torch takes seconds, and `kvbench list` asks every backend.
        if importlib.util.find_spec("torch") is None:
            return False, "torch is not installed (pip install torch; see the README's Quick start for the CPU wheel)"
        return True, ""

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        if config.policy is not None and config.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {config.policy!r} (known: {', '.join(POLICIES)})")
        torch = self.torch = _import_torch()
        self.device = resolve_device(torch, config.device)
        n, B = config.num_blocks, config.block_size
        self.B = B
        m = config.model
        self.groups = m.kv_groups
        self.G = len(self.groups)
        self.windows = [g.window for g in self.groups]
        self.sliding = any(g.releases for g in self.groups)  # sliding, chunked, sinks (SPEC §12)
        # Per group the sinks' blocks kept below its released run (-1 exactly at kept <= i < first).
        self.kept = [F.sink_blocks(g, B) for g in self.groups]
        self.kv_shape = m.kv_shape  # one token, every layer ([1, L, 1, d] for MLA)
        self.token_shape = m.slot_shape  # one slot of one group
        self.state_groups = F.one_block_states(self.name, m, B)
        self.kv_dtype = getattr(torch, np.dtype(config.kv_dtype).name)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.layer_index = [torch.tensor(g.layers, **i64) for g in self.groups]
        # On a GPU the pool is reserved whole up front, as a serving engine's is. On the CPU its
        # pages are written as blocks are first handed out (_commit), so it costs the memory of
        # the blocks it has used, not of its whole budget.
        self.lazy = self.device.type == "cpu"
        self.ready = 0 if self.lazy else n  # blocks below this have their memory written
        if not config.store_kv:
            self.pool = None
        elif self.lazy:
            self.pool = torch.empty((n, B) + self.token_shape, dtype=self.kv_dtype)
        else:
            self.pool = torch.zeros((n, B) + self.token_shape, dtype=self.kv_dtype, device=self.device)
        self.refcount = torch.zeros(n, **i64)
        self.fill = torch.zeros(n, **i64)
        self.block_group = torch.zeros(n, **i64)
        # Free blocks as a stack; popping from the top hands out low ids first.
        self.free_stack = torch.arange(n - 1, -1, -1, **i64)
        self.free_top = n  # host mirror: how many entries of free_stack are free blocks
        rows = 64
        self.tables = [torch.full((rows, 16), -1, **i64) for _ in self.groups]
        self.nblocks = torch.zeros(rows, **i64)
        self.tokens = torch.zeros(rows, **i64)
        self.final = torch.zeros(rows, **i64)
        # Host side: the row map, what the eviction policies read, each group's first held block.
        self.tokens_host = np.zeros(rows, dtype=np.int64)
        self.last_access = np.zeros(rows, dtype=np.int64)
        self.use_count = np.zeros(rows, dtype=np.int64)
        self.tenant_idx = np.zeros(rows, dtype=np.int64)
        self.live = np.zeros(rows, dtype=bool)
        self.seq_of_row = np.full(rows, -1, dtype=np.int64)
        self.first = [np.zeros(rows, dtype=np.int64) for _ in self.groups]
        self.row_of: dict[int, int] = {}
        self.tenants: list[str] = []
        self.tenant_ids: dict[str, int] = {}
        # Prefix caching, on the host: (group, key) -> block; freed hashed blocks wait in
        # `evictable` (oldest first) and are reused only when the uncached free blocks run out.
        self.by_hash: dict = {}
        self.hash_of: dict = {}
        self._init_events()  # SPEC §14: events() from by_hash
        self.evictable = CachedQueue()
        self.hit_blocks = 0
        self.chunking: dict = {}  # chunked prompts: sequence -> (whole prompt's keys, blocks cached)

    @property
    def table(self):
        """The block table of a model of one group."""
        return self.tables[0]

    @property
    def n_free(self) -> int:
        return self.free_top + len(self.evictable)

    # --- host <-> device -------------------------------------------------------------------

    def _dev(self, arr):
        """A host index array on the device (zero-copy on cpu, one transfer on cuda)."""
        return self.torch.as_tensor(np.ascontiguousarray(arr, dtype=np.int64), device=self.device)

    def _kv(self, kv, count: int):
        """The operation's K/V as a pool-dtype tensor on the device; None when there is none to
        write (store_kv off, or a caller that does not check content passes no kv)."""
        if self.pool is None or kv is None:
            return None
        torch = self.torch
        t = kv if isinstance(kv, torch.Tensor) else torch.as_tensor(np.asarray(kv))
        want = (count,) + self.kv_shape
        if tuple(t.shape) != want:
            raise ValueError(f"{self.name}: kv has shape {tuple(t.shape)}, expected {want}")
        return t.to(device=self.device, dtype=self.kv_dtype, non_blocking=True)

    def _group_kv(self, kv_t, g: int):
        """The layers of group ``g`` of an operation's K/V."""
        return kv_t if self.G == 1 else kv_t.index_select(2, self.layer_index[g])

    def _flat_pool(self):
        return self.pool.view((-1,) + self.token_shape)

    # --- bookkeeping -----------------------------------------------------------------------

    def _grow_rows(self):
        torch = self.torch
        extra = len(self.live)
        self.tables = [torch.cat([t, torch.full((extra, t.shape[1]), -1, dtype=torch.int64,
                                                device=self.device)]) for t in self.tables]
        for name in ("nblocks", "tokens", "final"):
            t = getattr(self, name)
            setattr(self, name, torch.cat([t, torch.zeros_like(t[:extra])]))
        for name in ("tokens_host", "last_access", "use_count", "tenant_idx"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros(extra, a.dtype)]))
        self.first = [np.concatenate([f, np.zeros(extra, f.dtype)]) for f in self.first]
        self.live = np.concatenate([self.live, np.zeros(extra, bool)])
        self.seq_of_row = np.concatenate([self.seq_of_row, np.full(extra, -1, np.int64)])

    def _grow_cols(self, width: int):
        cols = self.tables[0].shape[1]
        while cols < width:
            cols *= 2
        if cols > self.tables[0].shape[1]:
            self.tables = [self.torch.cat([t, self.torch.full(
                (t.shape[0], cols - t.shape[1]), -1, dtype=self.torch.int64, device=self.device)], dim=1)
                for t in self.tables]

    def _new_row(self, seq: int) -> int:
        free_rows = np.flatnonzero(~self.live)
        if len(free_rows) == 0:
            self._grow_rows()
            free_rows = np.flatnonzero(~self.live)
        r = int(free_rows[0])
        self.row_of[seq] = r
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

    def _blocks_needed(self, tokens):
        """ceil(tokens / B), for an int or an integer array or tensor."""
        return -(-tokens // self.B)

    def _held(self, rows_h: np.ndarray) -> np.ndarray:
        """Blocks each row holds over every group (from host-side counts)."""
        nb = self._blocks_needed(self.tokens_host[rows_h])
        return sum(nb - f[rows_h] + np.minimum(k, f[rows_h]) for f, k in zip(self.first, self.kept))

    def _take(self, n: int):
        k = min(n, self.free_top)
        ids = self.free_stack[self.free_top - k:self.free_top].flip(0)
        self.free_top -= k
        if n > k:  # reuse the least recently freed cached blocks
            old = list(self.evictable)[:n - k]
            for b in old:
                del self.evictable[b]
                del self.by_hash[self.hash_of.pop(b)]
            ids = self.torch.cat([ids, self._dev(old)])
            self.fill[ids] = 0  # a cached block comes back full: the append below sets its fill
        self.refcount[ids] = 1
        if self.pool is not None and self.lazy and len(ids):
            top = int(ids.max()) + 1
            if top > self.ready:
                self._commit(top)
        return ids

    def _commit(self, blocks: int) -> None:
        """Zero the pool's blocks below ``blocks`` and some beyond (an eighth of what is
        committed, COMMIT_BYTES at least): the CPU pool grows with the blocks it uses, in chunks."""
        n = self.config.num_blocks
        per_block = self.pool[0].numel() * self.pool.element_size()
        chunk = max(self.ready // 8, COMMIT_BYTES // max(1, per_block), 1)
        hi = min(n, max(blocks, self.ready + chunk))
        self.pool[self.ready:hi].zero_()
        self.ready = hi

    def _give_back(self, dead: list) -> None:
        """Blocks at zero references, in release order: cached ones to the end of the evictable
        queue, the others pushed on the free stack."""
        if self.hash_of:
            for b in dead:
                if b in self.hash_of:
                    self.evictable[b] = None
            dead = [b for b in dead if b not in self.hash_of]
        if dead:
            t = self._dev(dead)
            self.fill[t] = 0
            self.free_stack[self.free_top:self.free_top + len(dead)] = t
            self.free_top += len(dead)

    def _release_blocks(self, blocks) -> None:
        """Drop one reference per mention, in order; a block dies at its last mention."""
        if blocks.numel() == 0:
            return
        self.refcount.index_add_(0, blocks, self.torch.full_like(blocks, -1))
        dead = blocks[self.refcount[blocks] == 0].tolist()  # the one sync: what comes back
        if len(set(dead)) != len(dead):
            seen: set = set()
            dead = [b for b in reversed(dead) if not (b in seen or seen.add(b))][::-1]
        self._give_back(dead)

    def _row_blocks(self, r: int):
        """The blocks a row holds, in release order: group by group, each from the tail."""
        nb = int(self._blocks_needed(self.tokens_host[r]))
        parts = [t[r, int(f[r]):nb].flip(0) for t, f in zip(self.tables, self.first)]
        if any(self.kept):  # then the sinks' blocks below the released run
            parts = [x for p, t, f, k in zip(parts, self.tables, self.first, self.kept)
                     for x in (p, t[r, :min(k, int(f[r]))].flip(0))]
        return parts[0] if len(parts) == 1 else self.torch.cat(parts)

    def _release_row(self, r: int) -> None:
        """Drop one reference per block of the row; blocks at zero go back to the pool."""
        self._release_blocks(self._row_blocks(r))
        for t, f in zip(self.tables, self.first):
            t[r] = -1
            f[r] = 0
        self.nblocks[r] = 0
        self.tokens[r] = 0
        self.tokens_host[r] = 0
        self.live[r] = False
        self.seq_of_row[r] = -1

    def _drop_row(self, r: int) -> None:
        seq = int(self.seq_of_row[r])
        self.chunking.pop(seq, None)
        self._release_row(r)
        del self.row_of[seq]

    # --- sliding windows (SPEC §8) ---------------------------------------------------------

    def _slide(self, rows_h: np.ndarray, lengths: np.ndarray) -> None:
        """Release the blocks of ``rows_h`` a group no longer holds at T tokens (T from
        ``lengths``: below ``T - W + 1``, or below the current chunk): group by group, rows in
        order, each row's highest position first."""
        if self.chunking:  # blocks a chunk completed are cached before the window passes them,
            # writers in batch order (two completing one key: the first one's block is the entry)
            self._cache_chunks(self.seq_of_row[rows_h].tolist())
        for g, group in enumerate(self.groups):
            if not group.releases:
                continue
            first = self.first[g]
            new_first = np.minimum(F.trailing_first_block(lengths, group, self.B),
                                   self._blocks_needed(self.tokens_host[rows_h]))
            moving = np.flatnonzero(new_first > first[rows_h])
            if not len(moving):
                continue
            table, parts = self.tables[g], []
            for i in moving.tolist():
                r, hi = int(rows_h[i]), int(new_first[i])
                lo = max(int(first[r]), self.kept[g])  # the sinks' blocks stay
                parts.append(table[r, lo:hi].flip(0).clone())
                table[r, lo:hi] = -1
                first[r] = hi
            blocks = self.torch.cat(parts)
            self._release_blocks(blocks[blocks >= 0])

    # --- block arithmetic, vectorized over a batch ----------------------------------------

    def _append_plan(self, rows, dts, refcount, nb_old=None, one_token=False, group=0):
        """Per writer (device tensors): its tail block, whether it copies it, new blocks it takes.

        ``one_token``: every writer appends exactly one token (a decode step), which spills into
        one new block exactly when its tail is full: fewer kernels for the same plan."""
        torch = self.torch
        if nb_old is None:
            nb_old = self.nblocks[rows]
        tails = self.tables[group][rows, nb_old - 1]
        # No tail to write into: a sequence of no block, or a window of 1 past a full block.
        fill = torch.where(tails >= 0, self.fill[tails], self.B)
        if one_token:
            writes_tail = fill < self.B
            new = (~writes_tail).long()
        else:
            free_last = self.B - fill
            writes_tail = (free_last > 0) & (dts > 0)
            new = self._blocks_needed((dts - free_last).clamp(min=0))
        if len(rows) == 1:
            cow = writes_tail & (refcount[tails] > 1)
        else:
            # Writers sharing one tail copy it in batch order until one reference is left.
            sorted_tails, order = torch.sort(tails, stable=True)
            first = torch.searchsorted(sorted_tails, sorted_tails, side="left")
            w_sorted = writes_tail[order].long()
            before = torch.cumsum(w_sorted, 0) - w_sorted
            rank = torch.empty_like(before)
            rank[order] = before - before[first]  # tail writers ahead of me on the same block
            cow = writes_tail & (refcount[tails] - rank > 1)
        return tails, cow, new

    def _owners(self, counts, total: int):
        """For ``total = sum(counts)`` items dealt out in order: each item's owner, and each
        owner's first item. (``repeat_interleave`` does this, but its CPU kernel wakes the whole
        thread pool for a handful of elements: milliseconds on a busy machine.)"""
        ends = self.torch.cumsum(counts, 0)
        items = self.torch.arange(total, device=self.device)
        return self.torch.searchsorted(ends, items, right=True), ends - counts

    def _plans(self, rows, dts, refcount, nb_old, one_token):
        """Every group's plan, and (one sync) each group's copies and new blocks and the widest
        table row after the append."""
        plans = [self._append_plan(rows, dts, refcount, nb_old, one_token, group=g)
                 for g in range(self.G)]
        sums = [x for _, cow, new in plans for x in (cow.sum(), new.sum())]
        counts = self.torch.stack(sums + [(nb_old + plans[0][2]).max()]).tolist()
        return plans, counts[:-1], counts[-1]

    def _append_need(self, rows, dts, refcount, one_token=False) -> int:
        return sum(int(cow.sum() + new.sum()) for _, cow, new in
                   (self._append_plan(rows, dts, refcount, one_token=one_token, group=g)
                    for g in range(self.G)))

    def _victim(self, candidates: np.ndarray) -> int:
        """The row the policy evicts among candidate rows (SPEC §5)."""
        policy = self.config.policy
        seqs, la = self.seq_of_row[candidates], self.last_access[candidates]
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
        usage = np.bincount(self.tenant_idx[live], weights=self._held(live), minlength=len(self.tenants))
        present = sorted(set(self.tenant_idx[live].tolist()))
        names = {self.tenants[i] for i in present} | set(self.config.tenant_weights)
        # Decimal text, not binary: weight 0.1 is exactly 1/10.
        weight = {t: Fraction(str(self.config.tenant_weights.get(t, 1))) for t in names}
        total_w = sum(weight.values())
        budget = self.config.num_blocks
        over = []
        for i in present:
            t, u = self.tenants[i], int(usage[i])
            if u * total_w > weight[t] * budget:  # usage_t > quota_t, exactly
                over.append((u - weight[t] / total_w * budget, t, i))
        for _, _, i in sorted(over, reverse=True):
            mine = candidates[self.tenant_idx[candidates] == i]
            if len(mine):
                return int(mine[np.lexsort((self.seq_of_row[mine], self.last_access[mine]))[0]])
        return None

    def _candidates(self, protect_rows) -> np.ndarray:
        cand = np.flatnonzero(self.live)
        return cand[~np.isin(cand, protect_rows)]

    def _make_room(self, need_fn, protect_rows, need: int | None = None) -> list:
        """Evict until ``need_fn(refcount)`` blocks are free; atomic OOM when impossible."""
        if need is None:
            need = need_fn(self.refcount)
        if need <= self.n_free:
            return []
        cand = self._candidates(protect_rows)
        if self.config.policy is None or len(cand) == 0:
            raise OutOfMemory(f"{self.name}: needs {need} blocks, {self.n_free} free")
        # Would evicting every candidate be enough? If not, fail before touching anything.
        rows = self._dev(cand)
        blocks = self.torch.cat([t[rows].reshape(-1) for t in self.tables])
        drop = self.torch.zeros_like(self.refcount).index_add_(0, blocks.clamp(min=0),
                                                              (blocks >= 0).long())
        after = self.refcount - drop
        freed = int(((after == 0) & (self.refcount > 0)).sum())
        if need_fn(after) > self.n_free + freed:
            raise OutOfMemory(f"{self.name}: needs {need} blocks, {self.n_free} free "
                              f"even after evicting every candidate")
        victims = []
        while need > self.n_free:
            r = self._victim(self._candidates(protect_rows))
            victims.append(int(self.seq_of_row[r]))
            self._drop_row(r)
            need = need_fn(self.refcount)
        return victims

    # --- the protocol ----------------------------------------------------------------------

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        if seq in self.row_of:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        tokens, tenant, final_tokens = prompt.tokens, prompt.tenant, prompt.final_tokens
        torch = self.torch
        kv_t = self._kv(kv, tokens)
        n = self._blocks_needed(tokens)
        keys = later = []
        if self.config.prefix_caching:
            later = prompt_keys(prompt, self.B)
            self.note_prompt(later)
            keys = later[:tokens // self.B]  # a chunked prompt's later blocks: once written
        L, hits = hit_plan(keys, self.by_hash, self.groups, self.B) if keys else (0, [[]] * self.G)
        hit_all = [b for h in hits for b in h]
        hit_t = self._dev(hit_all)
        # New blocks, plus cached blocks taken back from the free pool. Evicting a victim keeps
        # its hashed blocks cached: the hit does not change while victims go.
        new = self.G * (n - L)

        def need(rc):
            return new + (int((rc[hit_t] == 0).sum()) if hit_all else 0)

        protect_rows = np.array([self.row_of[s] for s in protect if s in self.row_of], dtype=np.int64)
        victims = self._make_room(need, protect_rows, need(self.refcount))
        r = self._new_row(seq)
        self._grow_cols(n)
        if hit_all:
            for b, idle in zip(hit_all, (self.refcount[hit_t] == 0).tolist()):
                if idle:
                    del self.evictable[b]
            self.refcount[hit_t] += 1
            self.hit_blocks += len(hit_all)
        fresh = self._take(new).view(self.G, n - L)
        if keys:
            fresh_h = fresh.tolist()
            for g in range(self.G):
                for i in range(L, len(keys)):
                    if (g, keys[i]) not in self.by_hash:
                        self.by_hash[(g, keys[i])] = fresh_h[g][i - L]
                        self.hash_of[fresh_h[g][i - L]] = (g, keys[i])
        fills = (tokens - torch.arange(L, n, device=self.device) * self.B).clamp(max=self.B)
        for g, h in enumerate(hits):
            f = fresh[g]
            if self.kept[g] and h:  # the sinks' blocks, then the window's
                self.tables[g][r, self._dev(F.held_blocks(L * self.B, self.groups[g], self.B))] = self._dev(h)
                self.first[g][r] = min(L, int(F.trailing_first_block(L * self.B, self.groups[g], self.B)))
            else:
                self.tables[g][r, L - len(h):L] = self._dev(h)
                self.first[g][r] = L - len(h)
            self.tables[g][r, L:n] = f
            self.block_group[f] = g
            self.fill[f] = fills
            if kv_t is not None and n > L and g not in self.state_groups:
                slots = (f[:, None] * self.B + torch.arange(self.B, device=self.device)).reshape(-1)
                self._flat_pool().index_copy_(0, slots[:tokens - L * self.B],
                                              self._group_kv(kv_t, g)[L * self.B:])
        self.nblocks[r] = n
        if kv_t is not None and tokens > L * self.B:
            self._advance_states([r], [L * self.B], [tokens - L * self.B], kv_t[L * self.B:])
        self.tokens[r] = tokens
        self.tokens_host[r] = tokens
        self.final[r] = final_tokens if final_tokens is not None else tokens
        self.last_access[r], self.use_count[r] = step, 1
        self.tenant_idx[r] = self._tenant(tenant)
        if self.sliding:
            self._slide(np.array([r]), self.tokens_host[[r]])
        if len(later) > len(keys):
            self.chunking[seq] = (later, len(keys))
        return tuple(victims)

    def _cache_chunks(self, seqs) -> None:
        """Cache the blocks of chunked prompts that the last append completed (SPEC §13)."""
        for s in seqs:
            if s in self.chunking:
                r = self.row_of[s]
                cache_completed_chunk(self.chunking, s, int(self.tokens_host[r]) // self.B,
                                      lambda lo, hi: [t[r, lo:hi].tolist() for t in self.tables],
                                      self.by_hash, self.hash_of)

    def accept(self, seq, n, *, drafted, step=0):
        """Roll back the drafted - n rejected draft tokens: blocks wholly past the new length
        released (group by group, each from the tail), the tail's fill shrunk."""
        r = self._row(seq)
        new = int(self.tokens_host[r]) - (drafted - n)
        keep, nb = self._blocks_needed(new), int(self._blocks_needed(self.tokens_host[r]))
        gone = self.torch.cat([t[r, keep:nb].flip(0) for t in self.tables])
        for t in self.tables:
            t[r, keep:nb] = -1
        self._release_blocks(gone[gone >= 0])
        if keep:
            tails = self.torch.stack([t[r, keep - 1] for t in self.tables])
            self.fill[tails[tails >= 0]] = new - (keep - 1) * self.B
        self.nblocks[r] = keep
        self.tokens[r] = new
        self.tokens_host[r] = new
        return ()

    def append(self, seqs, tokens, kv=None, *, step=0):
        victims = self._append(seqs, tokens, kv, step)
        if self.chunking:
            self._cache_chunks(seqs)
        return victims

    def _append(self, seqs, tokens, kv, step):
        torch = self.torch
        rows_h = np.array([self._row(s) for s in seqs], dtype=np.int64)
        dts_h = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(rows_h) != len(dts_h):
            raise ValueError(f"{self.name}: append of {len(rows_h)} sequences with {len(dts_h)} token counts")
        if len(rows_h) == 0:
            return ()
        total = int(dts_h.sum())
        kv_t = self._kv(kv, total)
        one_token = total == len(rows_h) and dts_h.min() == 1
        rows, dts = self._dev(np.stack([rows_h, dts_h])).unbind(0)  # one transfer for both
        nb_old = self.nblocks[rows]
        # The one sync of a decode step: blocks to take and the widest table row after it.
        plans, counts, width = self._plans(rows, dts, self.refcount, nb_old, one_token)
        victims = []
        if sum(counts) > self.n_free:
            victims = self._make_room(lambda rc: self._append_need(rows, dts, rc, one_token), rows_h,
                                      sum(counts))
            # Evicted sequences may have shared a writer's tail: plan again.
            plans, counts, width = self._plans(rows, dts, self.refcount, nb_old, one_token)
        self._grow_cols(width)
        # Every new token: its position and offset (the same in every group).
        tok_old = self.tokens[rows]
        if one_token:
            pos, owner_rows = tok_old, rows
        else:
            writer, tstarts = self._owners(dts, total)
            pos = tok_old[writer] + torch.arange(total, device=self.device) - tstarts[writer]
            owner_rows = rows[writer]
        off = pos % self.B
        for g, (tails, cow, new) in enumerate(plans):
            n_cow, n_new = counts[2 * g], counts[2 * g + 1]
            table = self.tables[g]
            ids = self._take(n_cow + n_new) if n_cow + n_new else None
            if ids is not None:
                self.block_group[ids] = g
            # Copy-on-write: each copying writer gets a private copy of its tail (data and fill).
            if n_cow:
                # The copying writers, in batch order: their count is known, so no sync here.
                which = torch.sort((~cow).to(torch.uint8), stable=True).indices[:n_cow]
                src, dst, wrows = tails[which], ids[:n_cow], rows[which]
                self.refcount.index_add_(0, src, torch.full_like(src, -1))
                self.fill[dst] = self.fill[src]
                if self.pool is not None:
                    self.pool.index_copy_(0, dst, self.pool.index_select(0, src))
                table[wrows, nb_old[which] - 1] = dst
            # New blocks go to the end of each writer's table.
            if n_new:
                owner, starts = self._owners(new, n_new)
                logical = nb_old[owner] + torch.arange(n_new, device=self.device) - starts[owner]
                table[rows[owner], logical] = ids[n_cow:]
            # A block's fill is its highest written offset + 1.
            phys = table[owner_rows, pos // self.B]
            self.fill.scatter_reduce_(0, phys, off + 1, reduce="amax")
            if kv_t is not None and g not in self.state_groups:
                self._flat_pool().index_copy_(0, phys * self.B + off, self._group_kv(kv_t, g))
        if counts[1]:
            self.nblocks[rows] = nb_old + plans[0][2]
        if kv_t is not None:
            self._advance_states(rows_h, self.tokens_host[rows_h], dts_h, kv_t)
        self.tokens[rows] = tok_old + dts
        self.tokens_host[rows_h] += dts_h
        self.last_access[rows_h] = step
        self.use_count[rows_h] += 1
        if self.sliding:
            self._slide(rows_h, self.tokens_host[rows_h])
        return tuple(victims)

    def fork(self, seq, src, *, final_tokens=None, step=0):
        if seq in self.row_of:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        rs = self._row(src)
        nb = int(self._blocks_needed(int(self.tokens_host[rs])))
        states = self.state_groups if nb else []
        victims = self._make_room(lambda rc: len(states), np.array([rs])) if states else []
        r = self._new_row(seq)
        for t, f in zip(self.tables, self.first):
            t[r] = t[rs]
            f[r] = f[rs]
        self.nblocks[r] = self.nblocks[rs]
        self.tokens[r] = self.tokens[rs]
        self.tokens_host[r] = self.tokens_host[rs]
        blocks = self._row_blocks(r)
        self.refcount.index_add_(0, blocks, self.torch.ones_like(blocks))
        copies = self._take(len(states))  # SPEC §12: the states copied, the rest shared
        for g, b in zip(states, copies.tolist()):
            src_b = int(self.tables[g][r, nb - 1])
            self.refcount[src_b] -= 1
            self.block_group[b] = g
            self.fill[b] = self.fill[src_b]
            if self.pool is not None:
                self.pool[b] = self.pool[src_b]
            self.tables[g][r, nb - 1] = b
        self.final[r] = final_tokens if final_tokens is not None else self.tokens[rs]
        self.last_access[r], self.use_count[r] = step, 1
        self.tenant_idx[r] = self.tenant_idx[rs]
        return tuple(victims)

    def free(self, seq, *, step=0):
        if not self._drop_preempted(seq):  # a swapped sequence holds blocks of a tier only
            self._drop_row(self._row(seq))

    def ledger(self, seqs=None) -> Ledger:
        torch = self.torch
        B, N = self.B, self.config.num_blocks
        rows_h = np.flatnonzero(self.live)
        rows = self._dev(rows_h)
        used = self.refcount > 0
        head = [used.sum(), ((B - self.fill) * used).sum(), (self.refcount > 1).sum()]
        for table in self.tables:
            tails = table[rows, self.nblocks[rows] - 1]
            private = (self.refcount[tails] == 1) & (tails >= 0)
            reserve = F.tail_reservation(B - self.fill[tails], self.final[rows] - self.tokens[rows])
            head.append((reserve * private).sum())
        per_group = [torch.bincount(self.block_group[used], minlength=self.G)] if self.G > 1 else []
        # One read-back for the whole ledger.
        vals = torch.cat([torch.stack(head)] + per_group + [self.tokens[rows]]).tolist()
        n_used, free_slots, shared = vals[:3]
        reservation = sum(vals[3:3 + self.G])
        k = 3 + self.G
        group_blocks = tuple(vals[k:k + self.G]) if self.G > 1 else ()
        k += len(group_blocks)
        seqs = self.seq_of_row[rows_h].tolist()
        return Ledger.paged(
            num_blocks=N, block_size=B, block_bytes=B * self.config.model.slot_bytes,
            blocks_used=n_used, blocks_free=self.n_free, tokens=dict(zip(seqs, vals[k:])),
            seq_blocks=dict(zip(seqs, self._held(rows_h).tolist())),
            token_states=n_used * B - free_slots, reservation=reservation, shared_blocks=shared,
            cached_blocks=len(self.evictable), prefix_hit_blocks=self.hit_blocks,
            group_blocks=group_blocks)

    def block_state(self, seqs=None, *, changed_since=None) -> BlockState:
        rows = np.flatnonzero(self.live) if seqs is None else [self.row_of[s] for s in seqs
                                                               if s in self.row_of]
        nb = self._blocks_needed(self.tokens_host)
        index = self._dev(list(rows))
        held = [t.index_select(0, index).cpu().numpy() for t in self.tables]  # the rows asked for
        tables = {int(self.seq_of_row[r]): [t[i, :nb[r]] for t in held] for i, r in enumerate(rows)}
        mark, changes = self._changes(
            changed_since, lambda low: self.free_stack[low:self.free_top].flip(0).cpu().numpy())
        if changes is not None:
            return BlockState(None, None, _Counts(self.refcount), tables, mark, changes)
        return BlockState(free=self.free_stack[:self.free_top].flip(0).cpu().numpy(),
                          cached=list(self.evictable), refcount=self.refcount.cpu().numpy(),
                          tables=tables, mark=mark)

    def gather_tensor(self, seq):
        """The sequence's K/V as a tensor on the device, ``[tokens, 2, layers, kv_heads, head_dim]``."""
        if self.pool is None:
            raise NotImplementedError(f"{self.name} was built with store_kv=False")
        r = self._row(seq)
        T = int(self.tokens_host[r])
        nb = self._blocks_needed(T)
        if self.G == 1 and not self.first[0][r]:
            return self.pool.index_select(0, self.tables[0][r, :nb]).view((-1,) + self.token_shape)[:T]
        out = self.torch.zeros((T,) + self.kv_shape, dtype=self.kv_dtype, device=self.device)
        for g in range(self.G):
            if g in self.state_groups:  # no K/V: zeros in its layers
                continue
            f, k = int(self.first[g][r]), min(self.kept[g], int(self.first[g][r]))
            data = self.pool.index_select(0, self.tables[g][r, f:nb]).view((-1,) + self.token_shape)
            out[f * self.B:].index_copy_(2, self.layer_index[g], data[:T - f * self.B])
            if k:  # a sinks group's kept head
                head = self.pool.index_select(0, self.tables[g][r, :k]).view((-1,) + self.token_shape)
                out[:k * self.B].index_copy_(2, self.layer_index[g], head[:min(T, k * self.B)])
        return out

    def gather(self, seq, start=0, stop=None, *, out=None) -> np.ndarray:
        return gathered_range(self.gather_tensor(seq).cpu().numpy(), start, stop, out)

    # --- states (SPEC §12, impls.states): slot 0 of a state group's block holds its state

    def _block_at(self, g: int, r: int, i: int) -> int:
        return int(self.tables[g][r, i])

    def _state_in(self, block: int) -> np.ndarray:
        return self.pool[block, 0].cpu().numpy()

    def _put_state(self, block: int, state) -> None:
        self.pool[block, 0] = self.torch.as_tensor(state).to(device=self.device, dtype=self.kv_dtype)

    def _initial_state(self, g: int, r: int, start: int):
        return initial_state(self, g, r, start)

    def _advance_states(self, rows, starts, dts, kv_t) -> None:
        if self.state_groups:
            advance_states(self, rows, starts, dts, kv_t.cpu().numpy())

    def read_state(self, seq) -> np.ndarray:
        if self.pool is None:
            raise NotImplementedError(f"{self.name} was built with store_kv=False")
        r = self._row(seq)
        return read_states(self, r, int(self.tokens_host[r]))

    def memory_report(self) -> dict:
        """Pool bytes by the formula beside what the pool tensor holds and, on CUDA, what the
        caching allocator has handed out to the whole process (``memory_allocated``: compare
        its growth across building the pool, as kvbench.bench.gpu does)."""
        torch = self.torch
        c = self.config
        formula = c.num_blocks * c.block_size * c.model.slot_bytes if c.store_kv else 0
        index = sum(t.numel() * t.element_size() for t in
                    [self.refcount, self.fill, self.free_stack, self.nblocks, self.tokens,
                     self.final, self.block_group] + self.tables)
        report = {"device": str(self.device), "formula_pool_bytes": formula,
                  "pool_bytes": 0 if self.pool is None else self.pool.numel() * self.pool.element_size(),
                  "index_bytes": index}
        if self.device.type == "cuda":
            report["memory_allocated"] = torch.cuda.memory_allocated(self.device)
            report["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def close(self) -> None:
        self.close_tiers()
        self.pool = None
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
