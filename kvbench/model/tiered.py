"""The oracle with lower tiers (SPEC §11): the device model of oracle.py beside the tier model of
tiers.py, joined by leases and load targets.

- A store's lease on a source device block is a reference: while the store is in flight the block
  stays in use (counted in ``blocks_used``, and in ``shared_blocks`` when a table holds it too),
  is never handed out nor evicted from the prefix cache, even if its sequence is freed; when the
  store completes the reference drops, and a block left with none goes back to the pool then
  (to the cached queue's end, as it is hashed).
- A load is a prefill: the device hit first, then the longest run of following blocks stored in
  a tier (the nearest first), then the rest computed; out of memory is decided over all of it.
  The run's device blocks are not in the prefix cache until the load completes (no hit is served
  from them); a load that fails computes them again into the same blocks.
- Abort cancels the sequence's loads and frees it; its stores still complete.
- A lookup pins the tier run a load of its prompt would read now (after the device hit); the load
  of its sequence takes the pins over, to its completion; an abort or free before the load, or
  the load refused (out of memory), releases them.
- Preemption by swap (SPEC §13) moves every block of the sequence (its partial tail too) to a
  tier at once, in blocks of its own there (stored, never a hit nor the policy's victim; the
  policy evicts stored blocks to make room), and frees it; a tier that cannot hold them all
  leaves it preempted by recompute instead. Its resume is a prefill of its tokens (device hits
  first), the blocks past the hit copied up; a free drops its blocks from the tier.

Models of one full-attention group only (the keys carry group 0). ``replay_prompts`` is the
plainer model of a device LRU over the tiers, every transfer completed at once: hits by tier.
"""
from __future__ import annotations

from collections import OrderedDict

from kvbench.model.oracle import ModelOOM, Oracle
from kvbench.model.tiers import Tiers


class TieredOracle(Oracle):
    def __init__(self, config, layout="paged", capabilities=None, tiers=()):
        super().__init__(config, layout, capabilities)
        self.tiers = Tiers(tiers, self.block_bytes, getattr(capabilities, "tier_rules", ()))
        self.pending: dict = {}  # load id -> [(position, block, key)] not yet in the prefix cache
        self.store_plans: dict = {}  # store id -> (positions begun, the sequence's segments then)
        self.swapped: set = set()  # preempted sequences whose blocks a tier holds
        self.swap_hit = 0  # the device hit (blocks) of the last swap-in

    # --- store ---------------------------------------------------------------------------

    def store(self, tid, seq, tier: str, positions=None):
        """Begin a store of ``seq``'s full, hashed blocks at ``positions`` (None: all of them)
        to tier ``tier``; returns the tier's StorePlan (keys), with the positions begun kept."""
        st = self.seqs[seq]
        table = st.tables[0]
        full = st.tokens // self.B
        wanted = range(full) if positions is None else [p for p in positions if p < full]
        items, where = [], {}
        for p in wanted:
            b = table[p] if p < len(table) else None
            if b is not None and b in self.hash_of:
                items.append((self.hash_of[b], b))
                where[self.hash_of[b]] = p
        plan = self.tiers.store_begin(tid, seq, self.tiers.index(tier), items,
                                      [where[k] for k, _ in items])
        for _, b in plan.begun:
            self._add_ref(b)  # the lease
            self.edits += 1
        self.store_plans[tid] = ([where[k] for k, _ in plan.begun], list(st.segments))
        return plan

    # --- load ----------------------------------------------------------------------------

    def load_run(self, tokens, hashes=None, *, salt=None, adapter=None, token_ids=None) -> tuple:
        """(device hit L, the tiers of the run that follows) a load of this prompt would get."""
        keys = self.prompt_keys(tokens, hashes, token_ids, salt, adapter) if self.caching else ()
        L = self._cache_hits(keys, tokens)[0] if keys else 0
        return L, self.tiers.load_run([(0, k) for k in keys[L:]]), keys

    def load(self, tid, seq, tokens, tenant, final, step, protect=(), hashes=None, *, salt=None,
             adapter=None, token_ids=None) -> list:
        L, run, keys = self.load_run(tokens, hashes, salt=salt, adapter=adapter, token_ids=token_ids)
        try:
            victims = self.prefill(seq, tokens, tenant, final, step, protect, hashes, salt=salt,
                                   adapter=adapter, token_ids=token_ids)
        except ModelOOM:  # the request fails: its lookup's pins go
            self.tiers.unpin(seq)
            raise
        table = self.seqs[seq].tables[0]
        blocks, pending = [], []
        for i, tier in enumerate(run):
            p = L + i
            b, key = table[p], (0, keys[p])
            if self.hash_of.get(b) == key:  # not in the prefix cache until the load completes
                self.by_hash[key].remove(b)
                if not self.by_hash[key]:
                    del self.by_hash[key]
                del self.hash_of[b]
            blocks.append((key, tier, b))
            pending.append((p, b, key))
        self.tiers.load_begin(tid, seq, blocks, [p for p, _, _ in pending])
        self.pending[tid] = pending
        return victims

    def lookup(self, seq, tokens, hashes=None, *, salt=None, adapter=None, token_ids=None) -> list:
        """Pin, for ``seq``'s coming load, the run of tier entries its load would read now;
        returns [(key, tier)]."""
        L, _, keys = self.load_run(tokens, hashes, salt=salt, adapter=adapter, token_ids=token_ids)
        return self.tiers.pin(seq, [(0, k) for k in keys[L:]])

    # --- completion and abort --------------------------------------------------------------

    def done(self, tid, ok: bool):
        """Complete a transfer; returns it (kind "store" or "load")."""
        tr = self.tiers.complete(tid, ok)
        if tr.kind == "store":
            for _, b in tr.blocks:
                self._drop_ref(b)  # the lease ends
        else:
            for p, b, key in self.pending.pop(tid):
                self._register(b, *key)  # key: (group, block key)
        return tr

    def abort(self, seq) -> list:
        """Cancel ``seq``'s loads and free it; returns the cancelled loads."""
        cancelled = self.tiers.abort(seq)
        for tid, _ in cancelled:
            del self.pending[tid]
        if seq in self.seqs or seq in self.preempted:
            self.free(seq)
        return cancelled

    # --- preemption by swap (SPEC §13) -------------------------------------------------------

    def swap_out(self, seq, tier: str) -> bool:
        """Preempt ``seq`` by swap to ``tier``; False: the tier cannot hold its blocks even after
        evicting, and it is preempted by recompute."""
        blocks = len(self.seqs[seq].tables[0])
        swapped = self.tiers.swap_out(seq, self.tiers.index(tier), blocks) is not None
        self.preempt(seq)
        if swapped:
            self.swapped.add(seq)
        return swapped

    def swap_in(self, seq, step, protect=()) -> list:
        """Resume a swapped sequence (ModelOOM: it stays swapped, nothing changed)."""
        hits = self.hit_blocks
        victims = self.reprefill(seq, step, protect)
        self.swap_hit = self.hit_blocks - hits
        self.tiers.swap_in(seq, len(self.seqs[seq].tables[0]) - self.swap_hit)
        self.swapped.discard(seq)
        return victims

    def free(self, seq) -> None:
        if seq not in self.seqs and seq not in self.preempted:  # looked up, never loaded
            self.tiers.unpin(seq)
            return
        if seq in self.swapped:
            self.tiers.swap_drop(seq)
            self.swapped.discard(seq)
        super().free(seq)
        self.tiers.finish(seq)

    def loading_seqs(self) -> set:
        return {tr.seq for tr in self.tiers.transfers.values() if tr.kind == "load"}


__all__ = ["TieredOracle", "ModelOOM", "replay_prompts"]


def replay_prompts(prompts, device_blocks: int, tiers: Tiers, tier: int = 0) -> dict:
    """Hits by tier of a stream of prompts (each a list of block keys) over a device LRU of
    ``device_blocks`` blocks above ``tiers``: a prompt hits the longest prefix held on the device,
    then loads the longest following run stored in a tier, and computes the rest; the device
    then holds all its blocks, most recent last, and each block the device evicts (least recent
    first, never one of the prompt's) is stored down to tier ``tier``. Every transfer completes
    at once. Returns {"device": blocks, <tier name>: blocks, ..., "computed": blocks}."""
    device: OrderedDict = OrderedDict()
    hits = {"device": 0, **{t.spec.name: 0 for t in tiers.tiers}, "computed": 0}
    tid = 0
    for keys in prompts:
        if len(keys) > device_blocks:
            raise ValueError(f"a prompt of {len(keys)} blocks does not fit {device_blocks} device blocks")
        d = 0
        while d < len(keys) and keys[d] in device:
            d += 1
        run = tiers.load_run(keys[d:])
        if run:
            tiers.load_begin(tid, 0, [(k, i, None) for k, i in zip(keys[d:], run)])
            tiers.complete(tid, True)
            tid += 1
        hits["device"] += d
        for i in run:
            hits[tiers.tiers[i].spec.name] += 1
        hits["computed"] += len(keys) - d - len(run)
        for k in keys:
            device[k] = None
            device.move_to_end(k)
        mine = set(keys)
        while len(device) > device_blocks:
            victim = next(k for k in device if k not in mine)
            del device[victim]
            tiers.store_begin(tid, 0, tier, [(victim, None)])
            tiers.complete(tid, True)
            tid += 1
    return hits
