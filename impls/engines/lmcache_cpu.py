"""LMCache's CPU storage backend (``LocalCPUBackend``, lmcache/v1/storage_backend/
local_cpu_backend.py) as the lower tiers of the NumPy pool (SPEC §11): each tier of a trace is
one LocalCPUBackend over LMCache's paged allocator (``PagedTensorMemoryAllocator``, one page per
block), its cache policy the tier's.

Opt-in: LMCache is not a dependency of kvbench; the module imports without it, and
:meth:`LMCacheCPU.available` says why it cannot run.

Everything a tier holds is LMCache's: the page a store's block goes to (``allocate``, which
evicts by the policy when no page is free and returns None when nothing can go), the blocks a
lookup finds (``contains``), the page a load reads (``get_blocking``, a reference on its object
until the load completes, and a pin from the lookup), the recency a load gives its blocks
(``touch_cache``, the first block most recent), and the tier's counts (the hot cache's entries,
the allocator's free pages). The copies land in LMCache's own pages: the tier's array is the
allocator's buffer, page by page, so the content checks read back what LMCache holds.

The adapter's own part, as LMCache's storage manager does it: a store is ``allocate`` at its
begin and ``submit_put_task`` at its completion (a failed store gives its pages back, never put:
LMCache issue 4991's rule), so a block is ``storing`` between the two; the keys; the nearest tier
first for a load. A block is checked (``contains``) when the store reaches it, after the
allocations for the blocks before it, as LMCache's ``store_layer`` and
``allocate_and_copy_objects`` check each chunk.

Keys: a block's ``CacheEngineKey`` names its prefix without the salt (``chunk_hash``) and carries
the salt as a tag (``request_configs={"lmcache.tag.cache_salt": salt}``; a key's tags take part in
its hash and equality), so two tenants' copies of one prefix are two entries, as the MP server's
``ObjectKey.cache_salt`` keeps them (LocalCPUBackend's key has no salt field in 0.5.6).

Lookups (SPEC §11's pins): a load's lookup pins each block it finds (``contains(key, pin=True)``)
and records the key under the request, as ``LMCacheEngine.lookup`` records ``lookup_pins`` by
lookup id; the pins are released by key (``LMCacheEngine.lookup_unpin``: ``unpin(key)`` per key,
``StorageManager.batched_unpin``'s loop) when the load completes, or, for a load an abort
cancelled, by the abort's cleanup when the sequence is freed (SGLang's
``release_aborted_request``). The tier's ``loading`` figure counts LMCache's pinned entries, so a
pin never released shows there; its ``hits`` are counted once the device allocation succeeded.

KV events (SPEC §14): the device's are the NumPy pool's; a tier's are LMCache's messages to its
cache controller (``ADMIT`` at ``submit_put_task``, ``EVICT`` at ``remove``), recorded by a
``BatchedMessageSender`` whose worker end keeps them. They name an entry without its salt,
declared as ``tier_event_keys`` "unsalted".
"""
from __future__ import annotations

import dataclasses
import functools
import types

import numpy as np

from impls.engines.engine_tiers import EngineTiers
from kvbench.contract.events import REMOVED, STORED, KVEvent
from impls.numpy_paged import NumpyPaged
from impls.pool_events import PoolEvents
from impls.prefix_keys import prompt_keys

NOT_INSTALLED = ("lmcache is not installed: it is opt-in, "
                 "see the LMCache recipe in docs/tiers-and-lifecycles.md")
CONNECTOR_SKIP = ("LMCache's GPU connector (lmcache/v1/gpu_connector/gpu_connectors.py, its "
                  "lmcache_native transfers) copies between an engine's device cache and LMCache's "
                  "pages: the adapter copies the NumPy pool's blocks into those pages itself, so the "
                  "content checks hold LMCache's pages and their addressing, not its connector")


@functools.lru_cache(maxsize=1)
def _lmcache():
    """LMCache's CPU backend, its allocator, config and key, imported once."""
    import importlib.util
    if importlib.util.find_spec("lmcache") is None:  # before torch: `kvbench list` must stay quick
        raise ImportError("No module named 'lmcache'", name="lmcache")
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.paged_tensor_memory_allocator import PagedTensorMemoryAllocator
    from lmcache.v1.cache_controller.message import OpType
    from lmcache.v1.pin_monitor import PinMonitor
    from lmcache.v1.storage_backend.batched_message_sender import BatchedMessageSender
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    return types.SimpleNamespace(torch=torch, CacheEngineKey=CacheEngineKey, PinMonitor=PinMonitor,
                                 LMCacheEngineConfig=LMCacheEngineConfig,
                                 PagedTensorMemoryAllocator=PagedTensorMemoryAllocator,
                                 LocalCPUBackend=LocalCPUBackend, OpType=OpType,
                                 BatchedMessageSender=BatchedMessageSender)


def available() -> tuple[bool, str]:
    try:
        _lmcache()
    except ImportError as e:
        if e.name == "lmcache":
            return False, NOT_INSTALLED
        return False, f"lmcache cannot be imported ({type(e).__name__}: {e})"
    except Exception as e:  # a broken install fails in odd ways
        return False, f"lmcache cannot be imported ({type(e).__name__}: {e})"
    return True, ""


class _LMCacheTier:
    """One tier run by a LocalCPUBackend; its array is the allocator's buffer, by page."""

    def __init__(self, spec, storage, salts):
        lm = self.lm = _lmcache()
        torch = lm.torch
        (pool,) = storage  # the NumPy pool's one K/V array: [blocks, *block]
        self.name, self.capacity = spec.name, spec.capacity
        self.dtype = torch.from_numpy(pool[:0]).dtype
        self.shape = torch.Size(pool.shape[1:])
        block = int(np.prod(pool.shape[1:])) * pool.itemsize
        self.buffer = torch.zeros(spec.capacity * block, dtype=torch.uint8)
        allocator = lm.PagedTensorMemoryAllocator(self.buffer, [self.shape], [self.dtype])
        # torch.split of an empty buffer gives one empty page: a tier of no capacity holds it
        # out (kept, as a collected page frees itself back into its allocator)
        self.held_out = [allocator.free_blocks.popleft()] if not spec.capacity else []
        config = lm.LMCacheEngineConfig.from_defaults(local_cpu=True, cache_policy=spec.policy.upper(),
                                                      max_local_cpu_size=len(self.buffer) / 2 ** 30)
        lm.PinMonitor.GetOrCreate(config)  # the pins' watchdog, which LMCache's engine starts
        self.backend = lm.LocalCPUBackend(config, memory_allocator=allocator)
        self.allocator = allocator
        self.arrays = [self.buffer.numpy().view(pool.dtype).reshape((spec.capacity,) + pool.shape[1:])]
        self.salts = salts  # kvbench key -> (its key without the salt, the salt): the adapter's
        self.hashes: dict = {}  # kvbench key without the salt -> its chunk_hash
        self.unhashed: list = []  # chunk_hash -> the kvbench key without the salt
        self.messages: list | None = None  # LMCache's controller messages, once events are asked
        self.storing: dict = {}  # kvbench key -> the object allocated for it, not yet put
        self.reading: dict = {}  # kvbench key -> [objects loads in flight got for it]
        self.slot: dict = {}  # kvbench key -> the page it was last given
        self.lookup_pins: dict = {}  # seq -> kvbench keys its lookups pinned (LMCacheEngine's)
        self.cancelled: set = set()  # sequences whose load an abort cancelled (no retrieve ran)
        self.bytes_down = self.bytes_up = self.hits = 0

    def _key(self, key, salted: bool = True):
        """The CacheEngineKey of a kvbench key: its prefix without the salt, the salt a tag."""
        plain, salt = self.salts.get(key, (key, None))
        h = self.hashes.get(plain)
        if h is None:
            h = self.hashes[plain] = len(self.unhashed)
            self.unhashed.append(plain)
        tags = {"lmcache.tag.cache_salt": salt} if salted and salt is not None else None
        return self.lm.CacheEngineKey("kvbench", 1, 0, h, self.dtype, tags)

    def _release_key(self, key):
        """The key a lookup's pin is released by: the one it was taken by."""
        return self._key(key)

    def lookup_unpin(self, seq) -> None:
        """LMCacheEngine.lookup_unpin: the pins of ``seq``'s lookups released, key by key."""
        for key in self.lookup_pins.pop(seq, ()):
            self.backend.unpin(self._release_key(key))

    # --- what PoolTiers asks of a tier -------------------------------------------------------

    def loadable(self, key, seq) -> bool:
        return self.backend.contains(self._key(key))

    def begin_store(self, items, seq) -> list:
        moved = []
        for p, b, key in items:
            if key in self.storing or self.backend.contains(self._key(key)):
                continue  # stored or storing here already (a check, not a lookup)
            obj = self.backend.allocate(self.shape, self.dtype, eviction=True, busy_loop=False)
            if obj is None:  # nothing evictable: refused
                continue
            self.storing[key] = obj
            self.slot[key] = obj.metadata.address
            moved.append((p, b, key, self.slot[key]))
        return moved

    def end_store(self, keys, ok, seq) -> None:
        for key in keys:
            obj = self.storing.pop(key)
            if ok:
                self.backend.submit_put_task(self._key(key), obj)
            obj.ref_count_down()  # the allocation's reference: a failed store's page goes back

    def begin_load(self, keys, seq, positions) -> None:
        for key in keys:
            k = self._key(key)
            self.backend.contains(k, pin=True)  # the lookup of LMCache's connector pins
            self.lookup_pins.setdefault(seq, []).append(key)
            obj = self.backend.get_blocking(k)
            self.reading.setdefault(key, []).append(obj)
            self.slot[key] = obj.metadata.address
        self.backend.touch_cache()
        self.hits += len(keys)  # once: the device allocation succeeded (LMCache PR 4520)

    def end_load(self, keys, seq) -> None:
        for key in keys:
            obj = self.reading[key].pop()
            if not self.reading[key]:
                del self.reading[key]
            obj.ref_count_down()
        if seq not in self.cancelled:  # retrieved: the lookup's pins go with it
            self.lookup_unpin(seq)

    def finish(self, seq) -> None:
        """``seq`` is freed: an aborted load's lookup is released here, the abort's cleanup."""
        self.cancelled.discard(seq)
        self.lookup_unpin(seq)

    def figures(self) -> dict:
        stored = len(self.backend.hot_cache)
        pinned = sum(1 for obj in self.backend.hot_cache.values() if obj.is_pinned)
        return {"name": self.name, "capacity": self.capacity, "stored": stored,
                "storing": len(self.storing), "loading": pinned,
                "free": len(self.allocator.free_blocks), "bytes_down": self.bytes_down,
                "bytes_up": self.bytes_up, "hits": self.hits}

    def events(self, tier: int) -> list:
        """SPEC §14's events of this tier, as LMCache announces its entries to its controller:
        ``ADMIT`` and ``EVICT`` operations on a ``BatchedMessageSender`` (flushed here), each
        naming the entry by ``chunk_hash`` alone, so an event's key is the block's key without its
        salt. The first call announces the entries held so far, then listens."""
        lm = self.lm
        if self.messages is None:
            self.messages = []
            worker = types.SimpleNamespace(put_msg=self.messages.append)  # the controller's end
            metadata = types.SimpleNamespace(worker_id=0, model_name="kvbench", role="worker",
                                             served_model_name="kvbench")
            with self.backend.cpu_lock:
                held = [k.chunk_hash for k in self.backend.hot_cache]
                self.backend.batched_msg_sender = lm.BatchedMessageSender(
                    metadata, self.backend.config, str(self.backend), worker)
            ops = [(lm.OpType.ADMIT, h) for h in held]
        else:
            self.backend.batched_msg_sender.flush()
            ops = []
        messages, self.messages[:] = list(self.messages), []
        ops += [(op.op_type, op.key) for m in messages for op in m.operations]
        return [KVEvent(STORED if kind == lm.OpType.ADMIT else REMOVED, self.unhashed[h][1],
                        None, self.unhashed[h][0], tier) for kind, h in ops]

    def close(self) -> None:
        self.backend.close()
        # LMCache's closed allocator keeps its pages valid, and a collected page frees itself
        # under LMCache's shared observability lock, which the collecting thread may hold: a
        # self-deadlock (docs/upstream-reports.md). Closed, they free nothing.
        in_flight = [*self.storing.values(), *(o for objs in self.reading.values() for o in objs)]
        for obj in [*self.allocator.free_blocks, *self.held_out, *in_flight]:
            obj.invalidate()


class LMCacheCPU(EngineTiers):
    """The NumPy pool whose lower tiers are LMCache's ``LocalCPUBackend``s."""

    name = "lmcache-cpu"
    # LRU only (LMCache's LFU, FIFO and MRU are not SPEC policies); no swap (SPEC §13): LMCache
    # stores and retrieves prefix chunks, not a preempted request's whole state.
    # LMCache's allocate evicts by its policy alone: a store's own blocks already stored go too,
    # and as it checks each chunk when it reaches it (contains, then allocate: cache_engine.py
    # :696-706, storage_manager.py:89-92), one its own allocation evicted is stored again.
    # A stored block enters the LRU's order at its put (submit_put_task: ``hot_cache[key] =``,
    # local_cpu_backend.py:168), the store's completion; the allocate at its begin holds a page.
    # Its tiers' KV events are LMCache's controller messages, which name an entry by chunk_hash
    # alone (add_kv_op(op_type=OpType.ADMIT, key=key.chunk_hash), local_cpu_backend.py:174-177;
    # KVOpEvent.key: int, cache_controller/message.py:134): the salt never reaches them.
    capabilities = dataclasses.replace(NumpyPaged.capabilities, tiers=("lru",), swap=False,
                                       tier_rules=("store_evicts_skipped",
                                                   "store_ranked_at_completion",
                                                   "store_skips_when_reached"),
                                       rule_params={"tier_event_keys": "unsalted"})
    tier_skips = {"tier copies": CONNECTOR_SKIP}
    probe = staticmethod(available)

    tier_class = _LMCacheTier

    def __init__(self, config):
        super().__init__(config)
        self._salts: dict = {}  # a salted block's tier key -> (its key without the salt, salt)

    def _make_tier(self, spec, storage):
        return self.tier_class(spec, storage, self._salts)

    def _note_salts(self, prompt) -> None:
        """Each salted prompt block's key without its salt, for LMCache's keys."""
        if prompt.salt is None or not self.config.prefix_caching:
            return
        salted = prompt_keys(prompt, self.B, self._extra_keys(prompt.salt, prompt.adapter))
        plain = prompt_keys(prompt, self.B, self._extra_keys(None, prompt.adapter))
        for s, p in zip(salted, plain):
            self._salts[self._tier_key((0, s))] = (self._tier_key((0, p)), prompt.salt)

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        self._note_salts(prompt)
        return super().prefill(seq, prompt, kv, step=step, protect=protect)

    def load(self, tid, seq, prompt, kv=None, *, step=0, protect=()):
        self._note_salts(prompt)  # before the tiers' lookups
        return super().load(tid, seq, prompt, kv, step=step, protect=protect)

    def abort(self, seq, *, step=0):
        for t in getattr(self, "_tiers", ()):
            t.cancelled.add(seq)  # its loads' retrieves never run
        super().abort(seq, step=step)

    def events(self) -> list:
        """KV events (SPEC §14): the device pool's (kvbench's NumPy pool, tier 0), then each
        tier's as LMCache announces it to its cache controller."""
        out = PoolEvents._device_events(self)
        for t, tier in enumerate(getattr(self, "_tiers", ())):
            out += tier.events(t + 1)
        return out

    def close_tiers(self) -> None:
        for t in getattr(self, "_tiers", ()):
            t.close()
        super().close_tiers()
