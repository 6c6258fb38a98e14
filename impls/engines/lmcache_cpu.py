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
LMCache issue 4991's rule), so a block is ``storing`` between the two; the keys (a kvbench block
key, salt and adapter included, becomes a ``CacheEngineKey`` of its own); the nearest tier first
for a load.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import numpy as np

from impls.engines.engine_tiers import EngineTiers
from impls.numpy_paged import NumpyPaged

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
    from lmcache.v1.pin_monitor import PinMonitor
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    return types.SimpleNamespace(torch=torch, CacheEngineKey=CacheEngineKey, PinMonitor=PinMonitor,
                                 LMCacheEngineConfig=LMCacheEngineConfig,
                                 PagedTensorMemoryAllocator=PagedTensorMemoryAllocator,
                                 LocalCPUBackend=LocalCPUBackend)


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

    def __init__(self, spec, storage):
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
        self.keys: dict = {}  # kvbench key -> its CacheEngineKey
        self.storing: dict = {}  # kvbench key -> the object allocated for it, not yet put
        self.reading: dict = {}  # kvbench key -> [objects loads in flight got for it]
        self.slot: dict = {}  # kvbench key -> the page it was last given
        self.bytes_down = self.bytes_up = self.hits = 0

    def _key(self, key):
        k = self.keys.get(key)
        if k is None:
            k = self.keys[key] = self.lm.CacheEngineKey("kvbench", 1, 0, len(self.keys), self.dtype)
        return k

    # --- what PoolTiers asks of a tier -------------------------------------------------------

    def loadable(self, key, seq) -> bool:
        return key in self.keys and self.backend.contains(self.keys[key])

    def begin_store(self, items, seq) -> list:
        moved = []
        for p, b, key in items:
            if key in self.storing or self.loadable(key, seq):
                continue  # stored or storing here already
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
            obj = self.backend.get_blocking(k)
            self.reading.setdefault(key, []).append(obj)
            self.slot[key] = obj.metadata.address
        self.backend.touch_cache()
        self.hits += len(keys)

    def end_load(self, keys, seq) -> None:
        for key in keys:
            obj = self.reading[key].pop()
            if not self.reading[key]:
                del self.reading[key]
            obj.unpin()
            obj.ref_count_down()

    def finish(self, seq) -> None:
        """``seq`` is freed: LMCache keeps no per-request state here."""

    def figures(self) -> dict:
        stored = len(self.backend.hot_cache)
        return {"name": self.name, "capacity": self.capacity, "stored": stored,
                "storing": len(self.storing), "loading": len(self.reading),
                "free": len(self.allocator.free_blocks), "bytes_down": self.bytes_down,
                "bytes_up": self.bytes_up, "hits": self.hits}

    def close(self) -> None:
        self.backend.close()


class LMCacheCPU(EngineTiers):
    """The NumPy pool whose lower tiers are LMCache's ``LocalCPUBackend``s."""

    name = "lmcache-cpu"
    # LRU only (LMCache's LFU, FIFO and MRU are not SPEC policies); no swap (SPEC §13): LMCache
    # stores and retrieves prefix chunks, not a preempted request's whole state.
    # LMCache's allocate evicts by its policy alone: a store's own blocks already stored go too.
    capabilities = dataclasses.replace(NumpyPaged.capabilities, tiers=("lru",), swap=False,
                                       tier_rules=("store_evicts_skipped",), failed_loads=("keep",))
    tier_skips = {"tier copies": CONNECTOR_SKIP}
    probe = staticmethod(available)

    def _make_tier(self, spec, storage):
        return _LMCacheTier(spec, storage)

    def close_tiers(self) -> None:
        for t in getattr(self, "_tiers", ()):
            t.close()
        super().close_tiers()
