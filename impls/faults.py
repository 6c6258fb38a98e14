"""The engine-bug catalogue: planted faults, each a small subclass of a correct backend.

`kvbench faults` replays the default suite (every committed workload, as `kvbench run` does)
through each of them and reports where the checker first parts ways with it: each bug of issue
14's list (an upstream engine bug, reproduced in kvbench's terms), and the faults the tests plant
at a hand-picked step (tests/impls/test_faults.py). A fault is a subclass, never a flag in a backend:
the backends stay what they are.

Over 500 lines: one flat list of small planted bugs, each beside the report it reproduces and
the catalogue entry that names it; the edge-workload faults live apart (faults_edges.py).
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from impls.contiguous import Contiguous
from impls.faults_edges import BOUNDARY_BUGS, EDGE_BUGS
from impls.faults_events import EVENT_BUGS, EVENT_SLIPS
from impls.faults_tiers import SWAP_BUGS, TIER_BUGS
from impls.numpy_compressed import NumpyCompressed
from impls.numpy_float_paged import NumpyFp8Tensor, NumpyNvfp4
from impls.numpy_lookahead import NumpyEagle
from impls.numpy_paged import NumpyPaged
from impls.numpy_quant_paged import NumpyQuantSteps
from kvbench.contract import formulas as F
from kvbench.contract.protocol import OutOfMemory

# --- the faults tests/impls/test_faults.py plants at a chosen step --------------------------------

class NoCopyOnWrite(NumpyPaged):
    """(a) Writes into a shared tail in place."""

    def _append_plan(self, rows, dts, refcount, group=0):
        tails, free_last, cow, new = super()._append_plan(rows, dts, refcount, group)
        return tails, free_last, np.zeros_like(cow), new


class CopyWithoutData(NumpyPaged):
    """(a') Copy-on-write takes a block and copies the fill count, but not the K/V."""

    def append(self, seqs, tokens, kv=None, *, step=0):
        rows = np.array([self.row_of[s] for s in seqs])
        tail_index = self.nblocks[rows] - 1
        old_tails, old_fill = self.table[rows, tail_index].copy(), self.fill[self.table[rows, tail_index]]
        victims = super().append(seqs, tokens, kv, step=step)
        for r, i, old, n in zip(rows, tail_index, old_tails, old_fill):
            new = self.table[r, i]
            if new != old:  # this writer copied: forget the data it should have brought along
                self.pool[new, :n] = 0
        return victims


class FloorBlocks(NumpyPaged):
    """(b) floor instead of ceil for the new blocks of an append."""

    def _append_plan(self, rows, dts, refcount, group=0):
        tails, free_last, cow, new = super()._append_plan(rows, dts, refcount, group)
        return tails, free_last, cow, np.maximum(0, dts - free_last) // self.B


class PoolFragmentation(NumpyPaged):
    """(c) Fragmentation over the whole pool instead of the blocks in use."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        total = self.config.num_blocks * self.B
        led.fragmentation = (total - led.token_states) / total
        return led


class SharedCountedTwice(NumpyPaged):
    """(d) blocks_used and capacity summed over block tables: a shared block counts per sharer."""

    def ledger(self, seqs=None):
        led = super().ledger()  # every table: it sums them all
        led.blocks_used = sum(led.seq_blocks.values())
        led.capacity_slots = led.blocks_used * self.B
        return led


class LeakyPrefill(NumpyPaged):
    """(e) Out of memory after grabbing blocks one at a time: those it took stay taken."""

    def prefill(self, seq, prompt, kv=None, **kw):
        try:
            return super().prefill(seq, prompt, kv, **kw)
        except OutOfMemory:
            self._take(self.free_top)
            raise


class LeakyAppend(NumpyPaged):
    """(e') Out of memory in an append pops the free blocks it found off the free stack and
    loses them: never referenced, never returned."""

    def append(self, seqs, tokens, kv=None, **kw):
        try:
            return super().append(seqs, tokens, kv, **kw)
        except OutOfMemory:
            self.free_top = 0
            raise


class LruTiesWrongWay(NumpyPaged):
    """(f) LRU that breaks a tie on last access towards the larger sequence id."""

    def _victim(self, candidates):
        if self.config.policy != "lru":
            return super()._victim(candidates)
        order = np.lexsort((-self.seq_of_row[candidates], self.last_access[candidates]))
        return int(candidates[order[0]])


class LfuWithoutRecency(NumpyPaged):
    """(g) LFU on (use_count, id), ignoring recency."""

    def _victim(self, candidates):
        order = np.lexsort((self.seq_of_row[candidates], self.use_count[candidates]))
        return int(candidates[order[0]])


def _lru_row(backend, rows):
    return int(rows[np.lexsort((backend.seq_of_row[rows], backend.last_access[rows]))[0]])


class FairInFloat(NumpyPaged):
    """(h) Fair with quotas in floating point: w_t / sum(w) * B_total."""

    def _fair_victim(self, candidates):
        live = np.flatnonzero(self.live)
        usage = np.bincount(self.tenant_idx[live], weights=self.nblocks[live], minlength=len(self.tenants))
        present = {self.tenants[i] for i in self.tenant_idx[live].tolist()}
        weights = {t: float(w) for t, w in self.config.tenant_weights.items()}
        weights.update({t: 1.0 for t in sorted(present - set(weights))})
        total = sum(weights.values())  # 0.1 + 0.2 + 0.3 = 0.6000000000000001
        over = []
        for t in present:
            quota = weights[t] / total * self.config.num_blocks
            u = usage[self.tenant_ids[t]]
            if u > quota:
                over.append((u - quota, t))
        for _, t in sorted(over, reverse=True):
            mine = candidates[self.tenant_idx[candidates] == self.tenant_ids[t]]
            if len(mine):
                return _lru_row(self, mine)
        return None


class FairByUsage(NumpyPaged):
    """(i) Fair that takes the tenant using the most blocks, over its quota or not."""

    def _fair_victim(self, candidates):
        live = np.flatnonzero(self.live)
        usage = np.bincount(self.tenant_idx[live], weights=self.nblocks[live], minlength=len(self.tenants))
        for t in np.argsort(-usage, kind="stable"):
            mine = candidates[self.tenant_idx[candidates] == t]
            if len(mine):
                return _lru_row(self, mine)
        return None


class EvictsServed(NumpyPaged):
    """(j) Eviction that does not protect the sequences being served."""

    def _make_room(self, need_fn, protect_rows):
        return super()._make_room(need_fn, np.array([], dtype=np.int64))


class BestFit(Contiguous):
    """Contiguous baseline placing a slab in the smallest hole that fits, not the first."""

    def _hole(self, size, skip=frozenset(), placed=()):
        holes, pos = [], 0
        for start, slab_size, seq in sorted(self.starts + [(a, n, -1) for a, n in placed]):
            if seq in skip:
                continue
            if start - pos >= size:
                holes.append((start - pos, pos))
            pos = max(pos, start + slab_size)
        if self.capacity - pos >= size:
            holes.append((self.capacity - pos, pos))
        return min(holes)[1] if holes else None


class ForkWithoutData(Contiguous):
    """Contiguous fork that reserves and accounts the child's slab but copies no K/V."""

    def fork(self, seq, src, **kw):
        victims = super().fork(seq, src, **kw)
        st = self.seqs[seq]
        start = st["slabs"][0][0]
        self.arena[start:start + st["tokens"]] = 0
        return victims



# --- engine bugs, as upstream shipped them -----------------------------------------------------

class DoubleWindowRelease(NumpyPaged):
    """A sliding window's release names its first block twice, and the free path drops one
    reference per mention, giving a block back each time its count is at or below zero."""

    def _release_window(self, blocks):
        for b in np.concatenate([blocks, blocks[:1]]).tolist():
            self.refcount[b] -= 1
            if self.refcount[b] <= 0:
                self._give_back(np.array([b], dtype=np.intp))


class GroupsReversedAsOne(NumpyPaged):
    """A freed sequence's blocks, every group's in one list, reversed once: the last group's
    tail goes back first, and the first group's head last (not each group tail first)."""

    def _row_blocks(self, r):
        nb = self.nblocks[r]
        return np.concatenate([t[r, f[r]:nb] for t, f in zip(self.tables, self.first)])[::-1]


class FifoReuse(NumpyPaged):
    """Freed uncached blocks go to the bottom of the free stack: reuse cycles through every id."""

    def _give_back(self, dead):
        cached = np.array([b in self.hash_of for b in dead.tolist()], dtype=bool)
        for b in dead[cached].tolist():
            self.evictable[b] = None
        dead = dead[~cached]
        self.fill[dead] = 0
        k = len(dead)
        self.free_stack[k:self.free_top + k] = self.free_stack[:self.free_top].copy()
        self.free_stack[:k] = dead[::-1]
        self.free_top += k


class PartialBlocksInLru(NumpyPaged):
    """With prefix caching on, every freed block joins the cache's eviction queue, unhashed
    (partial) ones too, so they count as cached and are reused after older real entries."""

    def _give_back(self, dead):
        if not self.config.prefix_caching:
            return super()._give_back(dead)
        for b in dead.tolist():
            self.evictable[b] = None
        self.fill[dead[[b not in self.hash_of for b in dead.tolist()]]] = 0

    def _take(self, n):
        k = min(n, self.free_top)
        ids = self.free_stack[self.free_top - k:self.free_top][::-1].copy()
        self.free_top -= k
        if n > k:
            old = list(self.evictable)[:n - k]
            for b in old:
                del self.evictable[b]
                key = self.hash_of.pop(b, None)
                if key is not None:
                    del self.by_hash[key]
            ids = np.concatenate([ids, np.array(old, dtype=np.intp)])
        self.refcount[ids] = 1
        return ids


def _full_run(backend, keys) -> int:
    run = len(keys)
    for g, w in enumerate(backend.windows):
        if w is None:
            k = 0
            while k < run and (g, keys[k]) in backend.by_hash:
                k += 1
            run = k
    return run


class HitPastMissingWindow(NumpyPaged):
    """A hybrid hit as long as the full groups' cached run, whether or not each sliding group
    has its window's blocks cached: where one is missing a fresh block stands in, unwritten."""

    def _hit_plan(self, keys):
        L = _full_run(self, keys)
        hits = []
        for g, w in enumerate(self.windows):
            lo = 0 if w is None else max(0, L * self.B - w + 1) // self.B
            found = [self.by_hash.get((g, keys[i])) for i in range(lo, L)]
            if any(b is None for b in found):
                cut = max(i for i, b in enumerate(found) if b is None) + 1
                found = found[cut:]  # the blocks after the last missing one
            hits.append(np.array(found, dtype=np.intp))
        return L, hits


class CutHitRoomCountsLongerWindow(NumpyPaged):
    """The room a hybrid hit needs, when the sliding window cuts it short, adds the cached blocks
    the longer hit's window would have taken back: those both windows hold count twice, and an
    exact fit is refused."""

    _keys = ()  # the prompt's block keys, while its prefill makes room

    def _prefill(self, seq, tokens, kv, tenant, final_tokens, step, protect, n, keys):
        self._keys = keys
        try:
            return super()._prefill(seq, tokens, kv, tenant, final_tokens, step, protect, n, keys)
        finally:
            self._keys = ()

    def _make_room(self, need_fn, protect_rows):
        keys = self._keys

        def need(refcount):
            L, top = self._hit_plan(keys)[0], _full_run(self, keys)
            longer = [self.by_hash.get((g, keys[i])) for g, group in enumerate(self.groups)
                      if group.releases for i in F.held_blocks(top * self.B, group, self.B)] \
                if 0 < L < top else []
            return need_fn(refcount) + sum(b is not None and refcount[b] == 0 for b in longer)
        return super()._make_room(need, protect_rows)


class SlidingHitLikeFull(NumpyPaged):
    """A sliding group held to a full group's rule: every block below the hit cached, not only
    those of its window (hits end at the first sliding block the cache lost)."""

    def _hit_plan(self, keys):
        run = len(keys)
        for g in range(self.G):
            k = 0
            while k < run and (g, keys[k]) in self.by_hash:
                k += 1
            run = k
        return super()._hit_plan(keys[:run])


class LcmHitGranularity(NumpyPaged):
    """The hit rounded down to the least common multiple of the block size and the windows: no
    hit shorter than that (vllm-ascend: under 4096 tokens, none)."""

    def _hit_plan(self, keys):
        unit = math.lcm(self.B, *[w for w in self.windows if w is not None]) // self.B
        L, _ = super()._hit_plan(keys)
        return super()._hit_plan(keys[:L // unit * unit])


class UntaggedExtraKeys(NumpyPaged):
    """The salt and the adapter name enter the block hash untagged: salt "x" = adapter "x"."""

    def _extra_keys(self, salt, adapter):
        return repr(tuple(v for v in (salt, adapter) if v is not None)).encode()


class SaltDroppedWithHashes(NumpyPaged):
    """A prompt the trace names by block hashes is keyed by the hashes alone: its salt and adapter
    enter only the token-id path, so every tenant shares hashed blocks with every other."""

    def prefill(self, seq, prompt, kv=None, **kw):
        if prompt.block_hashes:
            prompt = dataclasses.replace(prompt, salt=None, adapter=None)
        return super().prefill(seq, prompt, kv, **kw)


class WideDecodeWithoutAccess(NumpyPaged):
    """The vectorized decode step (9+ sequences, or a tail crossing a block) leaves
    ``last_access`` as it was: LRU then evicts a sequence it has just served."""

    def _decode_one(self, rows, dts, kv, step):
        before = self.last_access[rows].copy()
        done = super()._decode_one(rows, dts, kv, step)
        if done:
            self.last_access[rows] = before
        return done


class WideDecodeWithoutUseCount(NumpyPaged):
    """The vectorized decode step does not add to ``use_count`` (LFU sees it unused)."""

    def _decode_one(self, rows, dts, kv, step):
        done = super()._decode_one(rows, dts, kv, step)
        if done:
            self.use_count[rows] -= 1
        return done


class ForkInheritsAccess(NumpyPaged):
    """A fork gives the child its source's (last_access, use_count), not (step, 1)."""

    def fork(self, seq, src, **kw):
        out = super().fork(seq, src, **kw)
        r, rs = self.row_of[seq], self.row_of[src]
        self.last_access[r], self.use_count[r] = self.last_access[rs], self.use_count[rs]
        return out


@contextmanager
def _flagged(backend, name: str):
    """``backend.<name>`` is True inside the block: a fault that acts within one call only."""
    setattr(backend, name, True)
    try:
        yield
    finally:
        setattr(backend, name, False)


class DecodeRoomAsAnyFree(NumpyPaged):
    """The vectorized decode step asks whether any block is free, not whether as many as its
    full tails need: several tails spilling into fewer free blocks overrun the pool."""

    _deciding = False

    @property
    def n_free(self):
        n = super().n_free
        return 1 << 40 if self._deciding and n else n  # "some room" read as "room enough"

    def _decode_one(self, rows, dts, kv, step):
        with _flagged(self, "_deciding"):
            return super()._decode_one(rows, dts, kv, step)


class DecodeNeverSlides(NumpyPaged):
    """The vectorized decode step (every one-token step of a hybrid model) never slides its
    windows: blocks below ``T - W + 1`` stay held until a longer append or a prefill."""

    _deciding = False

    def _slide(self, rows, lengths):
        if not self._deciding:
            super()._slide(rows, lengths)

    def _decode_one(self, rows, dts, kv, step):
        with _flagged(self, "_deciding"):
            return super()._decode_one(rows, dts, kv, step)


class DecodeCountsGroupZero(NumpyPaged):
    """The vectorized decode step counts every group's new blocks in group 0's ledger."""

    _taken = None

    def _take(self, n):
        ids = super()._take(n)
        if self._taken is not None:
            self._taken.append(ids)
        return ids

    def _decode_one(self, rows, dts, kv, step):
        self._taken = []
        try:
            done = super()._decode_one(rows, dts, kv, step)
        finally:
            taken, self._taken = self._taken, None
        if done:
            for ids in taken:
                np.subtract.at(self.group_used, self.block_group[ids], 1)
                self.group_used[0] += len(ids)
        return done


class EvictableCountsShared(NumpyPaged):
    """The evictable (cached) count adds the shared blocks once more per extra reference."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        led.cached_blocks += int(np.maximum(0, self.refcount - 1).sum())
        return led


class WrongBlockOnAlignedHit(NumpyPaged):
    """A whole-prompt hit at an exact multiple of the block size takes its last block from
    another prompt's cache entry (one as busy as the right one)."""

    def prefill(self, seq, prompt, kv=None, **kw):
        self._aligned = prompt.tokens % self.B == 0 and prompt.tokens > 0
        return super().prefill(seq, prompt, kv, **kw)

    def _hit_plan(self, keys):
        L, hits = super()._hit_plan(keys)
        if not getattr(self, "_aligned", False) or L * self.B == 0 or L != len(keys):
            return L, hits
        g = self.G - 1
        right = int(hits[g][-1])
        wrong = next((b for (grp, _), b in self.by_hash.items() if grp == g and b not in hits[g]
                      and (self.refcount[b] > 0) == (self.refcount[right] > 0)), None)
        if wrong is not None:
            hits[g] = hits[g].copy()
            hits[g][-1] = wrong
        return L, hits


class TokenCapacityPerGroup(NumpyPaged):
    """Token capacity with the pool split evenly among the groups: num_blocks // G * B."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        led.token_capacity = self.config.num_blocks // self.G * self.B
        return led


class BlockUsageAsSlotUsage(NumpyPaged):
    """Usage by slots reported as usage by blocks (66.7% of blocks, 36.5% of slots filled)."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        led.slot_usage = led.block_usage
        return led


class UsedFromFreeAndCached(NumpyPaged):
    """Blocks in use as the pool minus the free and the cached ones (cached counted twice):
    too low, negative once the cache is large."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        led.blocks_used = self.config.num_blocks - led.blocks_free - led.cached_blocks
        return led


class WrongTailIntoBuffer(NumpyPaged):
    """gather(..., out=) reads a range's last, partial block from the block before it in the
    table (``table_row[hi // B - 1]`` for ``table_row[hi // B]``); a gather without ``out``
    reads the right one."""

    def _read_range(self, table_row, start, stop, out):
        got = super()._read_range(table_row, start, stop, out)
        B = self.B
        tail = max(stop // B * B, start)  # the first position of the partial last block
        if out is not None and stop % B and stop // B:
            prev = int(table_row[stop // B - 1]) * B
            out.reshape(stop - start, -1)[tail - start:] = self.slots[prev + tail % B:prev + (stop - 1) % B + 1]
        return got


class Int4StepsPool(NumpyQuantSteps):
    """The `numpy-int4-steps` backend as a class (the registry makes it with ``kv_format="int4"``)."""

    def __init__(self, config):
        super().__init__(dataclasses.replace(config, kv_format="int4"))


class StepsPackHighNibbleFirst(Int4StepsPool):
    """The NumPy steps pack each pair of int4 codes first code in the high nibble; the compiled
    kernels, and the unpacking, put it in the low one."""

    def _quantize(self, rows):
        qt = super()._quantize(rows)
        if self.compiled is False:  # the NumPy path only
            c = qt.codes
            np.bitwise_or(c >> 4, c << 4, out=c)
        return qt


# --- scheduler lifecycles (SPEC §13) -----------------------------------------------------------

class RollbackKeepsTailFill(NumpyPaged):
    """An accept releases the blocks past the new length but leaves the tail's fill as the
    drafts left it: the rejected slots still count as written, and the next append writes after
    them."""

    def accept(self, seq, n, *, drafted, step=0):
        fill = self.fill.copy()
        super().accept(seq, n, drafted=drafted, step=step)
        r = self._row(seq)
        tails = np.array([t[r, self.nblocks[r] - 1] for t in self.tables], dtype=np.intp)
        self._set_fill(tails, fill[tails])
        return ()


class RejectedDraftsCached(NumpyPaged):
    """A block holding draft tokens enters the prefix cache when they are written, so the
    rollback of its drafts leaves it cached (evictable), not free."""

    def accept(self, seq, n, *, drafted, step=0):
        r = self._row(seq)
        new = int(self.tokens[r]) - (drafted - n)
        for g, t in enumerate(self.tables):
            for i in range(-(-new // self.B), int(self.nblocks[r])):
                key = (g, ("draft", seq, i, step))
                self.by_hash[key], self.hash_of[int(t[r, i])] = int(t[r, i]), key
        return super().accept(seq, n, drafted=drafted, step=step)


class ChunkCachedBeforeComplete(NumpyPaged):
    """A chunked prompt's block enters the prefix cache when its first chunk is written, not
    when its last token is: a request arriving between the chunks hits a block half written."""

    def prefill(self, seq, prompt, kv=None, **kw):
        victims = super().prefill(seq, prompt, kv, **kw)
        if seq in self.chunking:
            keys, done = self.chunking[seq]
            r = self.row_of[seq]
            if done < len(keys) and done < self.nblocks[r]:  # the chunk's partial last block
                self.sharing_rows.add(r)  # a hit may share its tail: its reservation is kept right
                for g in range(self.G):
                    b = int(self.tables[g][r, done])
                    if (g, keys[done]) not in self.by_hash:
                        self.by_hash[(g, keys[done])], self.hash_of[b] = b, (g, keys[done])
                self.chunking[seq] = (keys, done + 1)
        return victims


class ResumeIntoOldBlocks(NumpyPaged):
    """A preempted sequence's resume reads back the blocks it held before its preemption (as a
    swap-in that trusts stale block ids), though another sequence may hold them by then."""

    def __init__(self, config):
        super().__init__(config)
        self.held_before: dict = {}

    def free(self, seq, *, step=0):
        r = self._row(seq)
        self.held_before[seq] = self.tables[0][r, :self.nblocks[r]].copy()
        super().free(seq, step=step)

    def prefill(self, seq, prompt, kv=None, **kw):
        victims = super().prefill(seq, prompt, kv, **kw)
        old = self.held_before.pop(seq, None)
        if old is not None and self.pool is not None:
            new = self.tables[0][self._row(seq), :len(old)]
            self._copy_blocks(old[:len(new)], new)
        return victims


class EagleBlockUncached(NumpyEagle):
    """The caching mask leaves out each prompt's last full block, the block above the boundary
    that an EAGLE hit matches and drops back from: a later prompt extending it matches a block
    less and, dropping one, hits a block short."""

    def _prefill(self, seq, tokens, kv, tenant, final_tokens, step, protect, n, keys):
        hits = self.hit_blocks
        victims = super()._prefill(seq, tokens, kv, tenant, final_tokens, step, protect, n, keys)
        if len(keys) > (self.hit_blocks - hits) // self.G:  # this prefill cached its last block
            r = self.row_of[seq]
            for g in range(self.G):
                b = int(self.tables[g][r, len(keys) - 1])
                if self.hash_of.get(b) == (g, keys[-1]):
                    del self.by_hash[(g, keys[-1])], self.hash_of[b]
        return victims


class SinkReleasedEarly(NumpyPaged):
    """A sinks(S, W) group slides like sliding(W): the blocks holding the first S tokens go
    back with the window's, though the sequence still attends to them (SPEC §12)."""

    def __init__(self, config):
        super().__init__(config)
        self.kept = [0] * self.G


class ChunkSlidesAsWindow(NumpyPaged):
    """A chunked(C) group held to sliding(C)'s rule: it keeps the C - 1 positions before each
    token instead of only the current chunk's, so it holds (and hits on) blocks of the chunk
    before (SPEC §12)."""

    def __init__(self, config):
        super().__init__(config)
        self.groups = tuple(dataclasses.replace(g, chunk=None, window=g.chunk) if g.chunk else g
                            for g in self.groups)


class StateNotZeroed(NumpyPaged):
    """A new sequence's state starts from what its block last held, not from zeros: a reused
    block carries its previous owner's state into the recurrence (SPEC §12)."""

    def _initial_state(self, g, r, start):
        if start == 0:
            return self._state_in(int(self.tables[g][r, 0]))
        return super()._initial_state(g, r, start)


class StateHitsNever(NumpyPaged):
    """A model with a state group never finds a prefix hit: the lookup gives up on it, and the
    prompt is computed again from zeros (hybrid hits silently 0%)."""

    def _hit_plan(self, keys):
        if self.state_groups:
            return 0, [np.zeros(0, dtype=np.intp) for _ in self.groups]
        return super()._hit_plan(keys)


class StateOneBoundaryEarly(NumpyPaged):
    """A prefix hit of L blocks restores its state groups from the state cached at the boundary
    one block before (L - 1 blocks: the state's block index counted in the wrong units), so the
    recurrence goes on from the wrong length."""

    def _hit_plan(self, keys):
        L, hits = super()._hit_plan(keys)
        for g in self.state_groups:
            earlier = self.by_hash.get((g, keys[L - 2])) if L >= 2 else None
            if earlier is not None:
                hits[g] = np.array([earlier], dtype=np.intp)
        return L, hits


class CompressedKeysAtBlockSize(NumpyCompressed):
    """vLLM-Ascend #10296, planted in kvbench's own pool: a compressed(r) group's block is stored
    under the key of its B * r tokens (the prompt's key at B-block (i + 1) * r - 1) but looked
    up under the key at B granularity (B-block i), so a lookup misses its own prompt's blocks
    and may take a block stored for another prompt's longer prefix."""

    def _lookup_key(self, keys, g, i):
        return keys[i]


# --- the catalogue ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Bug:
    name: str
    upstream: str  # the engine bug it reproduces, or "kvbench" for a fault the tests plant
    fault: type
    why: bool  # an engine bug as shipped upstream: the default suite must catch it


CATALOGUE = [
    Bug("window release names a block twice: its count drops twice, the free count runs high",
        "vLLM #42571", DoubleWindowRelease, True),
    Bug("deferred free reverses every group's blocks as one list", "vLLM #48489",
        GroupsReversedAsOne, True),
    Bug("freed blocks reused first in, first out (LIFO flipped to FIFO)", "vLLM PR #51482",
        FifoReuse, True),
    Bug("partial (unhashed) blocks join the cache's LRU and push out real entries", "vLLM #42656",
        PartialBlocksInLru, True),
    Bug("hybrid hit past a sliding window the cache lacks", "vLLM #50457", HitPastMissingWindow, True),
    Bug("hybrid hit: the sliding group held to a full group's rule", "vLLM #50457",
        SlidingHitLikeFull, True),
    Bug("a hybrid hit cut short by the window: its room counts the longer hit's window too",
        "kvbench #30", CutHitRoomCountsLongerWindow, False),
    Bug("hit length rounded to an LCM of the groups' units", "vllm-ascend #16270",
        LcmHitGranularity, True),
    Bug("salt and adapter name untagged in the block hash", "vLLM #44701", UntaggedExtraKeys, True),
    Bug("evictable count adds shared blocks twice", "SGLang #35270", EvictableCountsShared, True),
    Bug("aligned whole-prompt hit returns another prompt's K/V", "LMCache #5151, TensorRT-LLM #8813",
        WrongBlockOnAlignedHit, True),
    Bug("token capacity split evenly among groups", "vLLM #40691, #51163", TokenCapacityPerGroup, True),
    Bug("usage by slots reported as usage by blocks", "vLLM PR #57336", BlockUsageAsSlotUsage, True),
    Bug("blocks in use = pool - free - cached (negative)", "TensorRT-LLM #11879",
        UsedFromFreeAndCached, True),
    Bug("salt and adapter dropped from a prompt named by block hashes", "kvbench #30",
        SaltDroppedWithHashes, False),
    Bug("a wide decode step leaves last_access", "kvbench #30", WideDecodeWithoutAccess, False),
    Bug("a wide decode step leaves use_count", "kvbench #30", WideDecodeWithoutUseCount, False),
    Bug("a fork's child inherits its source's access and use", "kvbench #30", ForkInheritsAccess,
        False),
    Bug("a decode step's room: any block free, not enough", "kvbench #30", DecodeRoomAsAnyFree,
        False),
    Bug("a sink block released with the window", "kvbench #25", SinkReleasedEarly, True),
    Bug("a new sequence's state not zeroed: a reused block's state carried over", "vLLM PR #56524",
        StateNotZeroed, True),
    Bug("a model with a state group never hits the prefix cache", "vLLM #45238", StateHitsNever,
        True),
    Bug("a hit's state read at the block boundary before (index in the wrong block units)",
        "vLLM #55600", StateOneBoundaryEarly, True),
    Bug("compressed-group blocks stored keyed by B * r tokens, looked up keyed by B",
        "vLLM-Ascend #10296", CompressedKeysAtBlockSize, True),
    Bug("a chunked group held to a sliding window of its chunk", "kvbench #25", ChunkSlidesAsWindow,
        False),
    Bug("a one-token hybrid decode step never slides its windows", "kvbench #30", DecodeNeverSlides,
        False),
    Bug("a hybrid decode step counts new blocks in group 0", "kvbench #30", DecodeCountsGroupZero,
        False),
    Bug("gather(out=) reads the last partial block from the block before", "kvbench #30",
        WrongTailIntoBuffer, False),
    Bug("int4 NumPy steps pack the first code high", "kvbench #30", StepsPackHighNibbleFirst, False),
    Bug("(a) no copy-on-write", "kvbench", NoCopyOnWrite, False),
    Bug("(a') copy-on-write without the data", "kvbench", CopyWithoutData, False),
    Bug("(b) floor instead of ceil", "kvbench", FloorBlocks, False),
    Bug("(c) fragmentation over the whole pool", "kvbench", PoolFragmentation, False),
    Bug("(d) shared blocks counted per table", "kvbench", SharedCountedTwice, False),
    Bug("(e) out of memory leaks a prefill's blocks", "kvbench", LeakyPrefill, False),
    Bug("(e') out of memory loses an append's free blocks", "kvbench", LeakyAppend, False),
    Bug("(f) LRU ties towards the larger id", "kvbench", LruTiesWrongWay, False),
    Bug("(g) LFU without recency", "kvbench", LfuWithoutRecency, False),
    Bug("(h) Fair quotas in floating point", "kvbench", FairInFloat, False),
    Bug("(i) Fair by usage, not excess over quota", "kvbench", FairByUsage, False),
    Bug("(j) eviction of the sequence being served", "kvbench", EvictsServed, False),
    Bug("contiguous: best fit instead of first fit", "kvbench", BestFit, False),
    Bug("contiguous: fork without the K/V", "kvbench", ForkWithoutData, False),
    Bug("a rollback leaves the tail's fill", "kvbench §13", RollbackKeepsTailFill, False),
    Bug("a block of rejected drafts stays in the prefix cache", "kvbench §13", RejectedDraftsCached,
        False),
    Bug("a chunked prompt's block cached before it is complete", "kvbench §13",
        ChunkCachedBeforeComplete, False),
    Bug("a resumed sequence reads the blocks it held before (another's by then)", "kvbench §13",
        ResumeIntoOldBlocks, False),
    Bug("an EAGLE hit's lookahead block left out of the caching mask", "vLLM PR #44082",
        EagleBlockUncached, False),
] + [Bug(name, "kvbench #12", fault, False) for name, fault, _ in EDGE_BUGS] \
  + [Bug(name, upstream, fault, True) for name, upstream, fault in TIER_BUGS] \
  + [Bug(name, upstream, fault, False) for name, upstream, fault in SWAP_BUGS] \
  + [Bug(name, upstream, fault, True) for name, upstream, fault in EVENT_BUGS] \
  + [Bug(name, "kvbench §14", fault, False) for name, fault in EVENT_SLIPS]


# --- SPEC §12's float formats: real fp8 and NVFP4 codes, read back wrong (issue 47) -------------

class Nvfp4BlockScalesDropped(NumpyNvfp4):
    """NVFP4 read back without its e4m3 block scales: code * tensor scale."""

    def _block_scale(self, scale, n):
        return np.float32(1.0)


class Nvfp4TensorScaleDropped(NumpyNvfp4):
    """NVFP4 read back without its float32 tensor scale: code * block scale."""

    def _dequantized(self, codes, scale, zero):
        kept, self.tensor_scale = self.tensor_scale, np.ones_like(self.tensor_scale)
        try:
            return super()._dequantized(codes, scale, zero)
        finally:
            self.tensor_scale = kept


class Fp8DividedByScale(NumpyFp8Tensor):
    """fp8 dequantized as code / scale (the scale taken as vLLM's inverse one), not code * scale."""

    def _scaled(self, codes, scale):
        return codes / scale


FLOAT_FORMAT_BUGS = [
    ("NVFP4 block scales dropped: read back as code * tensor scale", Nvfp4BlockScalesDropped),
    ("NVFP4 tensor scale dropped: read back as code * block scale", Nvfp4TensorScaleDropped),
    ("fp8 dequantized by dividing by the scale", Fp8DividedByScale),
]
CATALOGUE += [Bug(name, "kvbench #47", fault, False) for name, fault in FLOAT_FORMAT_BUGS]
# Bugs at SPEC §13's boundaries, which only the generated boundary workloads reach.
CATALOGUE += [Bug(name, "kvbench #47", fault, False) for name, fault, _, _ in BOUNDARY_BUGS]
