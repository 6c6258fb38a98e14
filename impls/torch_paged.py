"""PyTorch paged KV cache: the NumPy backend's semantics with the pool and its tables on a device.

The pool ``[num_blocks, block_size, 2, layers, kv_heads, head_dim]``, the block table, fill counts,
reference counts and the free-block stack are tensors on ``config.device`` (cpu or cuda). A batched
decode step is planned and written with tensor operations over the whole batch (copy-on-write
copies, new blocks, one scatter of the new tokens into the flat slot view); the host reads back
only the few counts it needs for the out-of-memory check (one sync per call). Eviction metadata
(last access, use count, tenant) and the sequence -> row map stay on the host, where the policies
read them; they change only with host-side values, so keeping them there costs no sync.

torch is imported lazily: ``import impls.torch_paged`` works without it, and ``available()`` says
why it cannot run.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

from kvbench.contract.protocol import (
    Backend,
    CacheConfig,
    Capabilities,
    Ledger,
    OutOfMemory,
)

POLICIES = ("lru", "lfu", "fair")


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


class TorchPaged(Backend):
    name = "torch"
    capabilities = Capabilities(layout="paged", holds_kv=True, fork=True, copy_on_write=True,
                                eviction=POLICIES, devices=("cpu", "cuda"))

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import torch  # noqa: F401
        except ImportError as e:
            return False, f"torch is not installed ({e})"
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
        self.token_shape = (2, m.layers, m.kv_heads, m.head_dim)
        self.kv_dtype = getattr(torch, np.dtype(config.kv_dtype).name)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.pool = (torch.zeros((n, B) + self.token_shape, dtype=self.kv_dtype, device=self.device)
                     if config.store_kv else None)
        self.refcount = torch.zeros(n, **i64)
        self.fill = torch.zeros(n, **i64)
        # Free blocks as a stack; popping from the top hands out low ids first.
        self.free_stack = torch.arange(n - 1, -1, -1, **i64)
        self.free_top = n  # host mirror: how many entries of free_stack are free blocks
        rows = 64
        self.table = torch.full((rows, 16), -1, **i64)
        self.nblocks = torch.zeros(rows, **i64)
        self.tokens = torch.zeros(rows, **i64)
        self.final = torch.zeros(rows, **i64)
        # Host side: the row map and what the eviction policies read.
        self.tokens_host = np.zeros(rows, dtype=np.int64)
        self.last_access = np.zeros(rows, dtype=np.int64)
        self.use_count = np.zeros(rows, dtype=np.int64)
        self.tenant_idx = np.zeros(rows, dtype=np.int64)
        self.live = np.zeros(rows, dtype=bool)
        self.seq_of_row = np.full(rows, -1, dtype=np.int64)
        self.row_of: dict[int, int] = {}
        self.tenants: list[str] = []

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
        want = (count,) + self.token_shape
        if tuple(t.shape) != want:
            raise ValueError(f"{self.name}: kv has shape {tuple(t.shape)}, expected {want}")
        return t.to(device=self.device, dtype=self.kv_dtype, non_blocking=True)

    def _flat_pool(self):
        return self.pool.view((-1,) + self.token_shape)

    # --- bookkeeping -----------------------------------------------------------------------

    def _grow_rows(self):
        torch = self.torch
        extra = len(self.live)
        self.table = torch.cat([self.table, torch.full((extra, self.table.shape[1]), -1,
                                                       dtype=torch.int64, device=self.device)])
        for name in ("nblocks", "tokens", "final"):
            t = getattr(self, name)
            setattr(self, name, torch.cat([t, torch.zeros_like(t[:extra])]))
        for name in ("tokens_host", "last_access", "use_count", "tenant_idx"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros(extra, a.dtype)]))
        self.live = np.concatenate([self.live, np.zeros(extra, bool)])
        self.seq_of_row = np.concatenate([self.seq_of_row, np.full(extra, -1, np.int64)])

    def _grow_cols(self, width: int):
        cols = self.table.shape[1]
        while cols < width:
            cols *= 2
        if cols > self.table.shape[1]:
            pad = self.torch.full((self.table.shape[0], cols - self.table.shape[1]), -1,
                                  dtype=self.torch.int64, device=self.device)
            self.table = self.torch.cat([self.table, pad], dim=1)

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
        if tenant not in self.tenants:
            self.tenants.append(tenant)
        return self.tenants.index(tenant)

    def _blocks_needed(self, tokens):
        """ceil(tokens / B), for an int or an integer tensor."""
        return -(-tokens // self.B)

    def _take(self, n: int):
        ids = self.free_stack[self.free_top - n:self.free_top].flip(0)
        self.free_top -= n
        self.refcount[ids] = 1
        return ids

    def _release_row(self, r: int) -> None:
        """Drop one reference per block of the row; blocks at zero go back to the pool."""
        row = self.table[r]
        valid = row >= 0
        idx = row.clamp(min=0)
        self.refcount.index_add_(0, idx, -valid.long())
        dead = row[valid & (self.refcount[idx] == 0)]  # the one sync: how many blocks come back
        k = dead.numel()
        self.fill[dead] = 0
        self.free_stack[self.free_top:self.free_top + k] = dead.flip(0)
        self.free_top += k
        self.table[r] = -1
        self.nblocks[r] = 0
        self.tokens[r] = 0
        self.tokens_host[r] = 0
        self.live[r] = False
        self.seq_of_row[r] = -1

    def _drop_row(self, r: int) -> None:
        seq = int(self.seq_of_row[r])
        self._release_row(r)
        del self.row_of[seq]

    # --- block arithmetic, vectorized over a batch ----------------------------------------

    def _append_plan(self, rows, dts, refcount, nb_old=None, one_token=False):
        """Per writer (device tensors): its tail block, whether it copies it, new blocks it takes.

        ``one_token``: every writer appends exactly one token (a decode step), which spills into
        one new block exactly when its tail is full: fewer kernels for the same plan."""
        torch = self.torch
        if nb_old is None:
            nb_old = self.nblocks[rows]
        tails = self.table[rows, nb_old - 1]
        # A row with no block yet (0 tokens) has no tail to write into: as if it were full.
        fill = torch.where(nb_old > 0, self.fill[tails], self.B)
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

    def _append_need(self, rows, dts, refcount, one_token=False) -> int:
        _, cow, new = self._append_plan(rows, dts, refcount, one_token=one_token)
        return int(cow.sum() + new.sum())

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
        blocks = self.nblocks[self._dev(live)].cpu().numpy()
        usage = np.bincount(self.tenant_idx[live], weights=blocks, minlength=len(self.tenants))
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
        if need <= self.free_top:
            return []
        cand = self._candidates(protect_rows)
        if self.config.policy is None or len(cand) == 0:
            raise OutOfMemory(f"{self.name}: needs {need} blocks, {self.free_top} free")
        # Would evicting every candidate be enough? If not, fail before touching anything.
        blocks = self.table[self._dev(cand)].reshape(-1)
        drop = self.torch.zeros_like(self.refcount).index_add_(0, blocks.clamp(min=0),
                                                              (blocks >= 0).long())
        after = self.refcount - drop
        freed = int(((after == 0) & (self.refcount > 0)).sum())
        if need_fn(after) > self.free_top + freed:
            raise OutOfMemory(f"{self.name}: needs {need} blocks, {self.free_top} free "
                              f"even after evicting every candidate")
        victims = []
        while need > self.free_top:
            r = self._victim(self._candidates(protect_rows))
            victims.append(int(self.seq_of_row[r]))
            self._drop_row(r)
            need = need_fn(self.refcount)
        return victims

    # --- the protocol ----------------------------------------------------------------------

    def prefill(self, seq, tokens, kv=None, *, tenant="default", final_tokens=None, step=0,
                protect=(), block_hashes=None):
        if seq in self.row_of:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        torch = self.torch
        kv_t = self._kv(kv, tokens)
        n = self._blocks_needed(tokens)
        protect_rows = np.array([self.row_of[s] for s in protect if s in self.row_of], dtype=np.int64)
        victims = self._make_room(lambda rc: n, protect_rows, n)
        r = self._new_row(seq)
        self._grow_cols(n)
        ids = self._take(n)
        self.table[r, :n] = ids
        self.nblocks[r] = n
        # Every block full but the last.
        self.fill[ids] = (tokens - torch.arange(n, device=self.device) * self.B).clamp(max=self.B)
        self.tokens[r] = tokens
        self.tokens_host[r] = tokens
        self.final[r] = final_tokens if final_tokens is not None else tokens
        self.last_access[r], self.use_count[r] = step, 1
        self.tenant_idx[r] = self._tenant(tenant)
        if kv_t is not None:
            slots = (ids[:, None] * self.B + torch.arange(self.B, device=self.device)).reshape(-1)
            self._flat_pool().index_copy_(0, slots[:tokens], kv_t)
        return tuple(victims)

    def append(self, seqs, tokens, kv=None, *, step=0):
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
        tails, cow, new = self._append_plan(rows, dts, self.refcount, nb_old, one_token)
        # The one sync of a decode step: blocks to take and the widest table row after it.
        n_cow, n_new, width = torch.stack([cow.sum(), new.sum(), (nb_old + new).max()]).tolist()
        victims = []
        if n_cow + n_new > self.free_top:
            victims = self._make_room(lambda rc: self._append_need(rows, dts, rc, one_token), rows_h,
                                      n_cow + n_new)
            # Evicted sequences may have shared a writer's tail: plan again.
            tails, cow, new = self._append_plan(rows, dts, self.refcount, nb_old, one_token)
            n_cow, n_new, width = torch.stack([cow.sum(), new.sum(), (nb_old + new).max()]).tolist()
        ids = self._take(n_cow + n_new) if n_cow + n_new else None
        # Copy-on-write: each copying writer gets a private copy of its tail (data and fill).
        if n_cow:
            # The copying writers, in batch order: their count is known, so no sync here.
            which = torch.sort((~cow).to(torch.uint8), stable=True).indices[:n_cow]
            src, dst, wrows = tails[which], ids[:n_cow], rows[which]
            self.refcount.index_add_(0, src, torch.full_like(src, -1))
            self.fill[dst] = self.fill[src]
            if self.pool is not None:
                self.pool.index_copy_(0, dst, self.pool.index_select(0, src))
            self.table[wrows, self.nblocks[wrows] - 1] = dst
        # New blocks go to the end of each writer's table.
        self._grow_cols(width)
        if n_new:
            owner, starts = self._owners(new, n_new)
            logical = nb_old[owner] + torch.arange(n_new, device=self.device) - starts[owner]
            self.table[rows[owner], logical] = ids[n_cow:]
            self.nblocks[rows] = nb_old + new
        # Every new token: its block and offset; a block's fill is its highest written offset + 1.
        tok_old = self.tokens[rows]
        if one_token:
            pos = tok_old
            phys = self.table[rows, pos // self.B]
        else:
            writer, tstarts = self._owners(dts, total)
            pos = tok_old[writer] + torch.arange(total, device=self.device) - tstarts[writer]
            phys = self.table[rows[writer], pos // self.B]
        off = pos % self.B
        self.fill.scatter_reduce_(0, phys, off + 1, reduce="amax")
        if kv_t is not None:
            self._flat_pool().index_copy_(0, phys * self.B + off, kv_t)
        self.tokens[rows] = tok_old + dts
        self.tokens_host[rows_h] += dts_h
        self.last_access[rows_h] = step
        self.use_count[rows_h] += 1
        return tuple(victims)

    def fork(self, seq, src, *, final_tokens=None, step=0):
        if seq in self.row_of:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        rs = self._row(src)
        r = self._new_row(seq)
        row = self.table[rs]
        self.table[r] = row
        self.nblocks[r] = self.nblocks[rs]
        self.refcount.index_add_(0, row.clamp(min=0), (row >= 0).long())
        self.tokens[r] = self.tokens[rs]
        self.tokens_host[r] = self.tokens_host[rs]
        self.final[r] = final_tokens if final_tokens is not None else self.tokens[rs]
        self.last_access[r], self.use_count[r] = step, 1
        self.tenant_idx[r] = self.tenant_idx[rs]
        return ()

    def free(self, seq, *, step=0):
        self._drop_row(self._row(seq))

    def ledger(self) -> Ledger:
        torch = self.torch
        B = self.B
        rows_h = np.flatnonzero(self.live)
        rows = self._dev(rows_h)
        used = self.refcount > 0
        tails = self.table[rows, self.nblocks[rows] - 1]
        private = (self.refcount[tails] == 1) & (self.nblocks[rows] > 0)
        reserve = torch.minimum(B - self.fill[tails], (self.final[rows] - self.tokens[rows]).clamp(min=0))
        head = torch.stack([used.sum(), ((B - self.fill) * used).sum(), (self.refcount > 1).sum(),
                            (reserve * private).sum()])
        # One read-back for the whole ledger.
        vals = torch.cat([head, self.tokens[rows], self.nblocks[rows]]).tolist()
        n_used, free_slots, shared, reservation = vals[:4]
        k = len(rows_h)
        seqs = self.seq_of_row[rows_h].tolist()
        cap = n_used * B
        return Ledger(
            blocks_used=n_used, blocks_free=int(self.free_top),
            tokens=dict(zip(seqs, vals[4:4 + k])),
            seq_blocks=dict(zip(seqs, vals[4 + k:])),
            capacity_slots=cap, free_slots=free_slots,
            fragmentation=free_slots / cap if cap else 0.0,
            bytes_in_use=n_used * B * self.config.model.bytes_per_token,
            shared_blocks=shared,
            token_states=cap - free_slots, reservation=reservation,
            internal_fragmentation=free_slots - reservation, external_fragmentation=0,
            free=int(self.free_top) * B)

    def gather_tensor(self, seq):
        """The sequence's K/V as a tensor on the device, ``[tokens, 2, layers, kv_heads, head_dim]``."""
        if self.pool is None:
            raise NotImplementedError(f"{self.name} was built with store_kv=False")
        r = self._row(seq)
        T = int(self.tokens_host[r])
        blocks = self.table[r, :self._blocks_needed(T)]
        return self.pool.index_select(0, blocks).view((-1,) + self.token_shape)[:T]

    def gather(self, seq) -> np.ndarray:
        return self.gather_tensor(seq).cpu().numpy()

    def memory_report(self) -> dict:
        """Pool bytes by the formula beside what the pool tensor holds and, on CUDA, what the
        caching allocator has handed out to the whole process (``memory_allocated``: compare
        its growth across building the pool, as kvbench.bench.gpu does)."""
        torch = self.torch
        c = self.config
        formula = c.num_blocks * c.block_size * c.model.bytes_per_token if c.store_kv else 0
        index = sum(t.numel() * t.element_size() for t in
                    (self.refcount, self.fill, self.free_stack, self.table, self.nblocks,
                     self.tokens, self.final))
        report = {"device": str(self.device), "formula_pool_bytes": formula,
                  "pool_bytes": 0 if self.pool is None else self.pool.numel() * self.pool.element_size(),
                  "index_bytes": index}
        if self.device.type == "cuda":
            report["memory_allocated"] = torch.cuda.memory_allocated(self.device)
            report["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def close(self) -> None:
        self.pool = None
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
