"""Lower tiers of a paged pool (SPEC §11), whatever its arrays are: the slots, states and LRU
order of a tier (TierSlots), and the tier operations (PoolTiers, a mixin of the pool) written
once over a few array hooks that the NumPy pool (impls/numpy_tiers.py) and the torch pool
(impls/torch_tiers.py) each implement.

A tier holds full, hashed blocks by the pool's own block key (salt and adapter included), in
slots of the same layout as the pool's blocks (every storage array the pool keeps: a quantized
pool's codes and scales alike). Eviction is LRU: a store puts a block at the recent end, a load
touches its blocks so that the first is the most recent, the least recent stored block no load
reads and not one of the store's own goes first. A store's source blocks get one more reference
(the lease) until it completes; a load's target blocks stay out of the prefix cache until it
completes. A lookup pins the tier run a load of its prompt would read (one reader more each,
counted in ``loading``); the sequence's load takes the pins over until it completes, an abort or
free before the load, or the load refused, releases them. The data moves at ``TRANSFER_AT``:
"begin" or "completion" (the default: the copy a lease exists for).

Preemption by swap (SPEC §13): every block of the sequence is copied to slots of the tier pinned
to it (keyed ("swap", seq, position): stored, never a hit nor a victim; LRU makes room by
evicting stored blocks), then the sequence is freed; a tier that cannot hold them all frees it
only (a recompute). The resume is a prefill whose blocks past the device hit are copied up.

The pool's hooks: ``_tier_arrays(spec, storage)`` (a tier's slots, one array per storage
array), ``_copy_rows(src, rows, dst, into)`` (``dst[into] = src[rows]``), ``_lease(blocks)``
and ``_end_lease(blocks)`` (one reference more / less per block), ``_tokens_of(row)``,
``_row_blocks_at(row, lo, hi)`` (group 0's blocks of positions lo..hi-1, a host array),
``_rewrite_block(block, kv)`` (a failed load's block computed again) and
``_slot_kv(tier, slot)`` (a tier block's K/V as the pool reads it); besides the pool's own
``prefill``, ``_storage``, ``_extra_keys``, ``_hit_plan``, ``block_bytes``, ``free``,
``row_of``, ``by_hash``, ``hash_of`` and ``hit_blocks``.
"""
from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict

import numpy as np

from impls.prefix_keys import prompt_keys


def slot_runs(slots) -> list:
    """[(start, stop)] index ranges of ``slots`` over which the slots are consecutive: each run
    is one slice of a tier, so a copy moves it in one call (a gather or a scatter on the pool's
    side) instead of one call per block."""
    s = np.asarray(slots, dtype=np.int64)
    if not len(s):
        return []
    cuts = np.flatnonzero(np.diff(s) != 1) + 1
    edges = [0, *cuts.tolist(), len(s)]
    return list(zip(edges[:-1], edges[1:]))


def run_count(slots) -> int:
    """How many runs :func:`slot_runs` would give, without building them (a copy asks first
    whether its runs are few: for scattered blocks there are as many runs as blocks)."""
    s = np.asarray(slots, dtype=np.int64)
    return 1 + int(np.count_nonzero(np.diff(s) != 1)) if len(s) else 0


class TierSlots:
    """One tier: its arrays (one per pool storage array), slots, states and LRU order."""

    def __init__(self, spec, arrays):
        self.name, self.capacity = spec.name, spec.capacity
        self.arrays = arrays
        self.unreadable: set = set()  # keys a failed load read (failed_load "drop"): never loaded again
        self.free = list(range(spec.capacity - 1, -1, -1))  # pop() gives slot 0 first
        self.slot: dict = {}  # key -> slot
        self.ready: dict = {}  # key -> True once stored, False while storing
        self.readers: dict = {}  # key -> loads in flight reading it
        self.pinned: set = set()  # keys of swapped sequences' blocks: never evicted
        self.recency: OrderedDict = OrderedDict()  # least recent first
        self.bytes_down = self.bytes_up = self.hits = 0

    def take(self, key, keep) -> int | None:
        """A slot for ``key``, evicting the least recent stored block no load reads and not in
        ``keep``; None when there is none."""
        if not self.free:
            victim = next((k for k in self.recency if self.evictable(k) and k not in keep), None)
            if victim is None:
                return None
            self.drop(victim)
        s = self.free.pop()
        self.slot[key], self.ready[key] = s, False
        self.recency[key] = None
        return s

    def evictable(self, key) -> bool:
        return self.ready[key] and not self.readers.get(key) and key not in self.pinned

    def drop(self, key) -> None:
        self.free.append(self.slot.pop(key))
        del self.ready[key]
        del self.recency[key]
        self.readers.pop(key, None)
        self.pinned.discard(key)
        self.unreadable.discard(key)

    def touch(self, keys) -> None:
        for k in reversed(keys):
            self.recency.move_to_end(k)

    # --- what PoolTiers asks of a tier (an engine's tier implements the same) --------------

    def loadable(self, key, seq) -> bool:
        return bool(self.ready.get(key)) and key not in self.unreadable

    def begin_store(self, items, seq) -> list:
        """Slots for ``items`` = [(position, device block, key)]: [(position, block, key, slot)]
        for those begun (held keys skipped, a block without room refused)."""
        keep = {k for _, _, k in items}
        moved = []
        for p, b, key in items:
            if key in self.slot:
                continue  # stored or storing here already
            s = self.take(key, keep)
            if s is not None:
                moved.append((p, b, key, s))
        return moved

    def end_store(self, keys, ok, seq) -> None:
        for key in keys:
            if ok:
                self.ready[key] = True
            else:
                self.drop(key)

    def begin_load(self, keys, seq, positions) -> None:
        for key in keys:
            self.readers[key] = self.readers.get(key, 0) + 1
        self.hits += len(keys)
        self.touch(keys)

    def end_load(self, keys, seq) -> None:
        for key in keys:
            self.readers[key] -= 1
            if key in self.unreadable and not self.readers[key]:
                self.drop(key)

    def pin(self, keys, seq) -> None:
        """A lookup for ``seq`` pins ``keys``: read as a load reads them, no hit, no touch."""
        for key in keys:
            self.readers[key] = self.readers.get(key, 0) + 1

    def load_failed(self, keys, seq) -> None:
        """A load of ``keys`` failed, in a tier whose ``failed_load`` is "drop" (called before its
        end_load): none of them is loaded again, each goes once no load reads it."""
        self.unreadable.update(keys)

    def finish(self, seq) -> None:
        """``seq`` is freed (its stores may still be in flight)."""

    def figures(self) -> dict:
        storing = sum(1 for r in self.ready.values() if not r)
        return {"name": self.name, "capacity": self.capacity, "stored": len(self.slot) - storing,
                "storing": storing, "loading": sum(1 for n in self.readers.values() if n),
                "free": len(self.free), "bytes_down": self.bytes_down, "bytes_up": self.bytes_up,
                "hits": self.hits}


def _blocks(ids) -> np.ndarray:
    return np.array(ids, dtype=np.intp)


class PoolTiers:
    """The tier operations of a paged pool (a mixin: the pool gives the hooks the module names)."""

    TRANSFER_AT = "completion"

    def attach_tiers(self, specs) -> None:
        self.close_tiers()
        self._tier_folder = tempfile.mkdtemp(prefix="kvbench-tiers-")
        storage = self._storage() if self.pool is not None else []
        self._tiers = [self._make_tier(s, storage) for s in specs]
        self._tier_specs = tuple(specs)
        self._transfers: dict = {}
        self._stored_last: tuple = (None, [])
        self._swapped: dict = {}  # seq -> (its tier, the slots of its blocks by position)
        self._pins: dict = {}  # seq -> [(tier, tier key)] its lookup pinned, until its load
        self._load_pins: dict = {}  # load id -> the pins it took over

    def _make_tier(self, spec, storage):
        return TierSlots(spec, self._tier_arrays(spec, storage))

    def close_tiers(self) -> None:
        folder = getattr(self, "_tier_folder", None)
        self._tiers = []
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
            self._tier_folder = None

    def close(self) -> None:
        self.close_tiers()
        super().close()

    def _tier(self, name: str) -> int:
        for i, t in enumerate(self._tiers):
            if t.name == name:
                return i
        raise KeyError(f"{self.name}: no tier {name!r}")

    # --- copies ----------------------------------------------------------------------------

    def _copy_down(self, t: TierSlots, blocks, slots) -> None:
        if self.pool is not None and len(blocks):
            for src, dst in zip(self._storage(), t.arrays):
                self._copy_rows(src, blocks, dst, slots)

    def _copy_up(self, t: TierSlots, slots, blocks) -> None:
        if self.pool is not None and len(blocks):
            for dst, src in zip(self._storage(), t.arrays):
                self._copy_rows(src, slots, dst, blocks)

    def _block_bytes_moved(self, n: int) -> int:
        return n * self.block_bytes()

    def _tier_key(self, key):
        """The key a tier holds a device block's content under: its prefix-cache key."""
        return key

    # --- the operations --------------------------------------------------------------------

    def store(self, tid, seq, tier, blocks=None, *, step=0) -> None:
        r = self._row(seq)
        full = self._tokens_of(r) // self.B
        table = self._row_blocks_at(r, 0, full)
        positions = range(full) if blocks is None else [p for p in blocks if p < full]
        items = []
        for p in positions:
            b = int(table[p])
            if b in self.hash_of:
                items.append((p, b, self._tier_key(self.hash_of[b])))
        t = self._tiers[self._tier(tier)]
        moved = t.begin_store(items, seq)
        src = _blocks([b for _, b, _, _ in moved])
        if len(src):
            self._lease(src)
        if self.TRANSFER_AT == "begin":
            self._copy_down(t, src, [s for *_, s in moved])
        self._transfers[tid] = ("store", seq, t, moved)

    def _tier_run(self, seq, prompt) -> tuple:
        """(the prompt's keys, its device hit L, the tier of each block of the run after it)."""
        keys = prompt_keys(prompt, self.B, self._extra_keys(prompt.salt, prompt.adapter)) \
            if self.config.prefix_caching else []
        L = self._hit_plan(keys)[0] if keys else 0
        run = []
        for k in keys[L:]:
            t = next((t for t in self._tiers if t.loadable(self._tier_key((0, k)), seq)), None)
            if t is None:
                break
            run.append(t)
        return keys, L, run

    def lookup(self, seq, prompt, *, step=0) -> None:
        keys, L, run = self._tier_run(seq, prompt)
        pins = [(t, self._tier_key((0, k))) for k, t in zip(keys[L:], run)]
        for t, tkey in pins:
            t.pin([tkey], seq)
        self._pins[seq] = pins

    def _unpin(self, pins, seq) -> None:
        for t, tkey in pins:
            t.end_load([tkey], seq)

    def load(self, tid, seq, prompt, kv=None, *, step=0, protect=()) -> tuple:
        keys, L, run = self._tier_run(seq, prompt)
        try:
            victims = self.prefill(seq, prompt, kv, step=step, protect=protect)
        except Exception:  # refused: the request fails, its lookup's pins go
            self._unpin(self._pins.pop(seq, []), seq)
            raise
        self._load_pins[tid] = self._pins.pop(seq, [])
        table = self._row_blocks_at(self.row_of[seq], L, L + len(run))
        moved = []  # (position, device block, its prefix-cache key, tier key, tier)
        for i, t in enumerate(run):
            p = L + i
            b, key = int(table[i]), (0, keys[p])
            if self.hash_of.get(b) == key:  # no hit from it until the load completes
                del self.by_hash[key]
                del self.hash_of[b]
            moved.append((p, b, key, self._tier_key(key), t))
        for t in self._tiers:
            mine = [(p, tkey) for p, _, _, tkey, u in moved if u is t]
            if mine:
                t.begin_load([k for _, k in mine], seq, [p for p, _ in mine])
        if self.TRANSFER_AT == "begin":
            self._load_data(seq, moved)
        self._transfers[tid] = ("load", seq, None, moved)
        return victims

    def _load_data(self, seq, moved) -> None:
        """Copy the tier blocks of a load into its target blocks."""
        for t in self._tiers:
            mine = [(b, t.slot[tkey]) for _, b, _, tkey, u in moved if u is t]
            self._copy_up(t, [s for _, s in mine], _blocks([b for b, _ in mine]))

    def complete(self, tid, ok, kv=None, *, step=0) -> None:
        kind, seq, t, moved = self._transfers.pop(tid)
        if kind == "store":
            if ok:
                if self.TRANSFER_AT == "completion":
                    self._copy_down(t, _blocks([b for _, b, _, _ in moved]), [s for *_, s in moved])
                t.end_store([key for _, _, key, _ in moved], True, seq)
                t.bytes_down += self._block_bytes_moved(len(moved))
                self._stored_last = (tid, [(p, t, s) for p, _, _, s in moved])
            else:
                t.end_store([key for _, _, key, _ in moved], False, seq)
            self._end_lease(_blocks([b for _, b, _, _ in moved]))
            return
        if ok and self.TRANSFER_AT == "completion":
            self._load_data(seq, moved)
        if not ok:
            for t, spec in zip(self._tiers, self._tier_specs):
                keys = [tkey for *_, tkey, u in moved if u is t]
                if keys and spec.failed_load == "drop":
                    t.load_failed(keys, seq)
        self._end_loads(seq, moved)
        self._unpin(self._load_pins.pop(tid), seq)
        for i, (p, b, key, tkey, u) in enumerate(moved):
            if ok:
                u.bytes_up += self._block_bytes_moved(1)
            elif self.pool is not None:  # computed again, into the same block
                self._rewrite_block(b, kv[i * self.B:(i + 1) * self.B])
            if key not in self.by_hash:
                self.by_hash[key] = b
                self.hash_of[b] = key

    def abort(self, seq, *, step=0) -> None:
        if seq in self._pins:  # looked up, never loaded: the request ends here
            self._unpin(self._pins.pop(seq), seq)
            return
        for tid, (kind, s, _, moved) in list(self._transfers.items()):
            if kind == "load" and s == seq:
                del self._transfers[tid]
                self._end_loads(seq, moved)
                self._unpin(self._load_pins.pop(tid), seq)
        self.free(seq, step=step)

    def _end_loads(self, seq, moved) -> None:
        for t in self._tiers:
            keys = [tkey for *_, tkey, u in moved if u is t]
            if keys:
                t.end_load(keys, seq)

    # --- preemption by swap (SPEC §13) -------------------------------------------------------

    def swap_out(self, seq, tier, *, step=0) -> None:
        r = self._row(seq)
        t = self._tiers[self._tier(tier)]
        n = -(-self._tokens_of(r) // self.B)
        slots = None
        if len(t.free) + sum(map(t.evictable, t.recency)) >= n:
            slots = []
            for i in range(n):
                key = ("swap", seq, i)
                slots.append(t.take(key, ()))
                t.ready[key] = True
                t.pinned.add(key)
            self._copy_down(t, self._row_blocks_at(r, 0, n), slots)
            t.bytes_down += self._block_bytes_moved(n)
        self.free(seq, step=step)
        if slots is not None:
            self._swapped[seq] = (t, slots)

    def _swap_source(self, seq) -> tuple:
        """The tier and slots a swapped sequence's resume copies up from."""
        return self._swapped[seq]

    def swap_in(self, seq, prompt, kv=None, *, step=0, protect=()) -> tuple:
        hits = self.hit_blocks
        victims = self.prefill(seq, prompt, kv, step=step, protect=protect)  # out of memory: still swapped
        self._swapped_up(seq, self.hit_blocks - hits)
        return victims

    def _swapped_up(self, seq, hit: int) -> None:
        """A swapped sequence back on the device with ``hit`` blocks hit there: the rest of its
        blocks copied up from its tier, which then drops them."""
        r = self.row_of[seq]
        n = -(-self._tokens_of(r) // self.B)
        t, slots = self._swap_source(seq)
        self._copy_up(t, slots[hit:n], self._row_blocks_at(r, hit, n))
        t.bytes_up += self._block_bytes_moved(n - hit)
        self._drop_swapped(seq)

    def _drop_swapped(self, seq) -> bool:
        """Drop a swapped sequence's blocks from its tier; False when none holds it."""
        held = getattr(self, "_swapped", {}).pop(seq, None)
        if held is None:
            return False
        for i in range(len(held[1])):
            held[0].drop(("swap", seq, i))
        return True

    def _drop_preempted(self, seq) -> bool:
        """What a preempted sequence holds (blocks of a tier, a kept request) dropped at its
        free; False when it is not preempted (it holds device blocks)."""
        kept = getattr(self, "preempted", {}).pop(seq, None)
        return self._drop_swapped(seq) or kept is not None

    def tier_ledgers(self) -> list:
        return [t.figures() for t in self._tiers]

    def read_stored(self, tid) -> dict:
        last, blocks = self._stored_last
        if last != tid:
            raise KeyError(f"{self.name}: store {tid} is not the last one completed")
        return {p: self._slot_kv(t, s) for p, t, s in blocks}
