"""A per-object Python model of a paged KV cache: one ``Block`` object per physical block.

The shape of the reference page's ``BlockAllocator`` / ``PagedKVCacheManager`` (block objects with
``ref_count`` and ``filled``, Python lists as block tables), with what that page leaves out:
copy-on-write on a shared tail, out of memory that changes nothing, and eviction under the block
budget (SPEC §5). It keeps the ledger only (no K/V). It is the per-object baseline the NumPy
backend is benchmarked against; it is registered nowhere by default. It models one group of
full-attention layers, no prefix caching: a hybrid model is not applicable (SPEC §8).
"""
from __future__ import annotations

from fractions import Fraction

from kvbench.contract import formulas as F
from kvbench.contract.protocol import (
    Backend,
    BlockState,
    CacheConfig,
    Capabilities,
    Ledger,
    OutOfMemory,
    refuse_model,
)

POLICIES = ("lru", "lfu", "fair")


class Block:
    __slots__ = ("block_id", "capacity", "ref_count", "filled")

    def __init__(self, block_id: int, capacity: int):
        self.block_id = block_id
        self.capacity = capacity
        self.ref_count = 0
        self.filled = 0

    @property
    def free_slots(self) -> int:
        return self.capacity - self.filled


class Sequence:
    __slots__ = ("seq_id", "tenant", "block_table", "num_tokens", "final_tokens",
                 "last_access_step", "use_count")

    def __init__(self, seq_id, tenant, block_table, num_tokens, final_tokens, step):
        self.seq_id = seq_id
        self.tenant = tenant
        self.block_table = block_table
        self.num_tokens = num_tokens
        self.final_tokens = final_tokens
        self.last_access_step = step
        self.use_count = 1


class ObjectModel(Backend):
    name = "python-objects"
    capabilities = Capabilities(layout="paged", holds_kv=False, fork=True, copy_on_write=True,
                                eviction=POLICIES, chunked_prefill=True)

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        if config.policy is not None and config.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {config.policy!r} (known: {', '.join(POLICIES)})")
        refused = refuse_model(self.name, self.capabilities, config.model)
        if refused:  # declared in its capabilities; refused here for direct use
            raise NotImplementedError(refused)
        self.block_size = config.block_size
        self.blocks = [Block(i, config.block_size) for i in range(config.num_blocks)]
        self.free_blocks = self.blocks[::-1]  # a stack: pop() hands out low ids first
        self.sequences: dict[int, Sequence] = {}

    # --- allocation ------------------------------------------------------------------------

    def _blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size) if tokens > 0 else 0

    def _allocate(self, fill: int) -> Block:
        blk = self.free_blocks.pop()
        blk.ref_count = 1
        blk.filled = fill
        return blk

    def _release(self, seq: Sequence) -> None:
        for blk in seq.block_table:
            blk.ref_count -= 1
            if blk.ref_count == 0:
                blk.filled = 0
                self.free_blocks.append(blk)
        seq.block_table = []

    def _append_need(self, batch, dropped) -> int:
        """Blocks a batched append takes, copies included, with ``dropped[block]`` references gone."""
        need = 0
        copied: dict[int, int] = {}
        for seq, delta in batch:
            if not seq.block_table:
                need += self._blocks_needed(delta)
                continue
            tail = seq.block_table[-1]
            room = tail.free_slots
            refs = tail.ref_count - dropped.get(tail.block_id, 0) - copied.get(tail.block_id, 0)
            if room > 0 and refs > 1 and delta > 0:  # writing nothing copies nothing
                need += 1  # this writer gets a private copy of the shared tail
                copied[tail.block_id] = copied.get(tail.block_id, 0) + 1
            need += self._blocks_needed(delta - room)
        return need

    # --- eviction --------------------------------------------------------------------------

    def _make_room(self, need_fn, protect) -> list:
        """Evict until ``need_fn(dropped)`` blocks are free; atomic OOM when impossible."""
        if need_fn({}) <= len(self.free_blocks):
            return []
        candidates = [s for s in self.sequences if s not in protect]
        if self.config.policy is None or not candidates:
            raise OutOfMemory(f"{self.name}: needs {need_fn({})} blocks, {len(self.free_blocks)} free")
        dropped: dict[int, int] = {}
        for s in candidates:
            for blk in self.sequences[s].block_table:
                dropped[blk.block_id] = dropped.get(blk.block_id, 0) + 1
        freed = sum(1 for b, d in dropped.items() if self.blocks[b].ref_count == d)
        if need_fn(dropped) > len(self.free_blocks) + freed:
            raise OutOfMemory(f"{self.name}: needs {need_fn({})} blocks, {len(self.free_blocks)} free "
                              f"even after evicting every candidate")
        victims = []
        while need_fn({}) > len(self.free_blocks):
            victim = self._pick_victim([s for s in self.sequences if s not in protect])
            self._release(self.sequences.pop(victim))
            victims.append(victim)
        return victims

    def _pick_victim(self, candidates: list) -> int:
        seqs = self.sequences
        lru = lambda s: (seqs[s].last_access_step, s)  # noqa: E731
        if self.config.policy == "lfu":
            return min(candidates, key=lambda s: (seqs[s].use_count, seqs[s].last_access_step, s))
        if self.config.policy == "fair":
            usage: dict[str, int] = {}
            for seq in seqs.values():
                usage[seq.tenant] = usage.get(seq.tenant, 0) + len(seq.block_table)
            weights = {t: Fraction(str(self.config.tenant_weights.get(t, 1)))
                       for t in set(usage) | set(self.config.tenant_weights)}
            total = sum(weights.values())
            budget = self.config.num_blocks
            # Exact: usage_t * W > w_t * B_total. Most over quota first.
            over = [(u - weights[t] / total * budget, t) for t, u in usage.items()
                    if u * total > weights[t] * budget]
            for _, tenant in sorted(over, reverse=True):
                mine = [s for s in candidates if seqs[s].tenant == tenant]
                if mine:
                    return min(mine, key=lru)
        return min(candidates, key=lru)

    # --- the protocol ----------------------------------------------------------------------

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        """A chunked prompt's whole length changes nothing here: no prefix cache, so the
        appends that write the rest of the prompt are appends."""
        if seq in self.sequences:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        tokens, tenant, final_tokens = prompt.tokens, prompt.tenant, prompt.final_tokens
        n = self._blocks_needed(tokens)
        victims = self._make_room(lambda dropped: n, set(protect))
        table = []
        remaining = tokens
        for _ in range(n):
            fill = min(remaining, self.block_size)
            table.append(self._allocate(fill))
            remaining -= fill
        self.sequences[seq] = Sequence(seq, tenant, table, tokens,
                                       final_tokens if final_tokens is not None else tokens, step)
        return tuple(victims)

    def append(self, seqs, tokens, kv=None, *, step=0):
        batch = []
        for s, delta in zip(seqs, tokens):
            if s not in self.sequences:
                raise KeyError(f"{self.name}: unknown sequence {s}")
            batch.append((self.sequences[s], delta))
        victims = self._make_room(lambda dropped: self._append_need(batch, dropped), set(seqs))
        for seq, delta in batch:
            remaining = delta
            tail = seq.block_table[-1] if seq.block_table else None
            if tail is not None and tail.free_slots > 0 and delta > 0:
                if tail.ref_count > 1:  # copy-on-write: never change what a sharer reads
                    tail.ref_count -= 1
                    tail = self._allocate(tail.filled)
                    seq.block_table[-1] = tail
                take = min(remaining, tail.free_slots)
                tail.filled += take
                remaining -= take
            while remaining > 0:
                take = min(remaining, self.block_size)
                seq.block_table.append(self._allocate(take))
                remaining -= take
            seq.num_tokens += delta
            seq.last_access_step = step
            seq.use_count += 1
        return tuple(victims)

    def accept(self, seq, n, *, drafted, step=0):
        """Roll back drafted - n draft tokens: blocks wholly past the new length released (from
        the tail), the tail's fill shrunk."""
        q = self.sequences[seq]
        q.num_tokens -= drafted - n
        keep = self._blocks_needed(q.num_tokens)
        for blk in reversed(q.block_table[keep:]):
            blk.ref_count -= 1
            if blk.ref_count == 0:
                blk.filled = 0
                self.free_blocks.append(blk)
        del q.block_table[keep:]
        if keep:
            q.block_table[-1].filled = q.num_tokens - (keep - 1) * self.block_size
        return ()

    def fork(self, seq, src, *, final_tokens=None, step=0):
        if seq in self.sequences:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        parent = self.sequences[src]
        for blk in parent.block_table:
            blk.ref_count += 1
        self.sequences[seq] = Sequence(
            seq, parent.tenant, list(parent.block_table), parent.num_tokens,
            final_tokens if final_tokens is not None else parent.num_tokens, step)
        return ()

    def free(self, seq, *, step=0):
        if seq not in self.sequences:
            raise KeyError(f"{self.name}: unknown sequence {seq}")
        self._release(self.sequences.pop(seq))

    def ledger(self, seqs=None) -> Ledger:
        B = self.block_size
        used = [b for b in self.blocks if b.ref_count > 0]
        reservation = 0
        for seq in self.sequences.values():
            tail = seq.block_table[-1] if seq.block_table else None
            if tail is not None and tail.ref_count == 1:
                reservation += F.tail_reservation(tail.free_slots, seq.final_tokens - seq.num_tokens)
        return Ledger.paged(
            num_blocks=len(self.blocks), block_size=B, block_bytes=B * self.config.model.bytes_per_token,
            blocks_used=len(used), blocks_free=len(self.free_blocks),
            tokens={s: q.num_tokens for s, q in self.sequences.items()},
            seq_blocks={s: len(q.block_table) for s, q in self.sequences.items()},
            token_states=sum(B - b.free_slots for b in used), reservation=reservation,
            shared_blocks=sum(1 for b in used if b.ref_count > 1))

    def block_state(self, seqs=None) -> BlockState:
        return BlockState(free=[b.block_id for b in reversed(self.free_blocks)], cached=[],
                          refcount=[b.ref_count for b in self.blocks],
                          tables={s: [[b.block_id for b in q.block_table]]
                                  for s, q in self.sequences.items() if seqs is None or s in seqs})
