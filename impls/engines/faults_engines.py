"""Planted regressions over the real engine classes: each a subclass of an engine adapter whose
engine object (SGLang's allocator, vLLM's manager) does one thing its code must not.

Opt-in like the adapters (each needs its engine's environment); never registered as backends:
tests/engines/test_engine_faults.py builds them and says at which workload and step each FAILs.

- ``SglangWholeRequirement``: the eviction SGLang PR #32016 removed. Before it an allocation
  evicted its whole requirement from the tree whenever the pool was short; since, only the
  shortfall (``BaseTokenToKVPoolAllocator.evict_to_free_tokens``: ``num_tokens -
  available_size()``).
- ``SglangEvictsLocked``: an eviction that takes nodes running requests hold locked (the lock is
  dropped for the eviction and taken again on whatever is left of the request's path).
- ``VllmFreedTwice``: a finished request's blocks handed to ``BlockPool.free_blocks`` a second
  time, so a block another request still holds goes back to the free queue.
- ``VllmWindowEarly``: ``SlidingWindowManager.remove_skipped_blocks`` run one block past the
  tokens computed, so a block still inside the window is released.
- ``VllmMambaEagleCheckpoint``: vLLM issue #54360 (speculative decoding on a Mamba hybrid in
  align mode: every prefix hit silently 0), by the mechanism issue #53504 traced: the
  scheduler's chunk split backs the prompt's checkpoint off one block for an EAGLE / MTP
  drafter (``Scheduler._mamba_block_aligned_split`` with ``use_eagle_block_drop``) while the
  manager's sparse retention keeps the boundary without the drop, so the state written is
  never cached and the state cached is never written. vLLM 0.33 keeps the two in step (its
  ``replay_boundaries`` take ``use_eagle``); planted by running the split with the drop and the
  manager without it.

SGLang's ``UnifiedRadixCache`` with its SWA component (impls/engines/sglang_components.py's
``SwaTree``, SGLang's Python tree core), each caught by the per-component figures
(tests/engines/test_sglang_components.py says at which step):

- ``SwaLockPastBoundary``: SGLang PR #27038 reverted: ``SWAComponent.release_component_lock``
  walks past the window's boundary node (its uuid unread) to the root, so a release
  decrements the SWA locks of ancestors its acquire never took.
- ``SwaReleaseSkipped``: SGLang PR #28161's missing ``dec_swa_lock_only``: ``release_swa`` marks
  the lock's SWA part released without releasing it, and the ``unlock`` that follows skips it,
  so the window's nodes stay locked after every request ended (planted: 0.5.23 releases it).

LMCache 0.5.6's ``LocalCPUBackend`` as the NumPy pool's tiers (impls/engines/lmcache_cpu.py), each
caught by the tier ledgers (tests/engines/test_lmcache_cpu.py says at which step). The three bugs'
code is in LMCache's multi-process connectors, which need vLLM's or SGLang's scheduler; each is
planted in the adapter's lookup over LocalCPUBackend, the nearest real class:

- ``LmcacheSaltlessUnpin``: LMCache issue #3770 (fixed by PR #3771): the lookup's pins released
  by keys built without the request's salt (``free_lookup_locks`` without ``cache_salt``), so a
  salted lookup's pins are never released: ``unpin`` finds no such entry.
- ``LmcacheHitAtLookup``: LMCache PR #4520 / issue #4508 (0.5.6 assigns the lookup result once,
  ``lmcache_mp_connector.py``'s ``tracker.num_stored_tokens = ret``): the hit accounted at each
  lookup, before the device allocation, so a load refused for room counts its hit and its
  retry counts it again.
- ``LmcacheAbortLeaks``: SGLang issue #40360: an abort between the lookup and the load runs no
  cleanup of LMCache's (``LMCRadixCache`` has no ``release_aborted_request``): the aborted
  request's lookup state and its pins stay.
"""
from __future__ import annotations

import types

from impls.engines.lmcache_cpu import LMCacheCPU, _LMCacheTier
from impls.engines.sglang_components import SwaTree
from impls.engines.sglang_radix import Sglang
from impls.engines.vllm_kvmanager import VllmKVManager


def _evict_params():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    return EvictParams


class _SglangAllocatorFault(Sglang):
    """The adapter with its allocator's ``evict_to_free_tokens`` replaced by ``_evict``."""

    def __init__(self, config):
        super().__init__(config)
        base = type(self.alloc)
        backend = self

        def evict_to_free_tokens(alloc, tree_cache, num_tokens):
            if tree_cache is None or not tree_cache.supports_prefix_sharing():
                return None
            return backend._evict(alloc, tree_cache, num_tokens)

        self.alloc.__class__ = type(f"Faulty{base.__name__}", (base,),
                                    {"evict_to_free_tokens": evict_to_free_tokens})

    def _evict(self, alloc, tree, num_tokens):
        raise NotImplementedError


class SglangWholeRequirement(_SglangAllocatorFault):
    name = "sglang-fault-whole-requirement"

    def _evict(self, alloc, tree, num_tokens):
        if num_tokens > alloc.available_size():  # the whole requirement, not the shortfall
            tree.evict(_evict_params()(num_tokens=num_tokens))


class SglangEvictsLocked(_SglangAllocatorFault):
    name = "sglang-fault-evicts-locked"

    def _evict(self, alloc, tree, num_tokens):
        shortfall = num_tokens - alloc.available_size()
        if shortfall <= 0:
            return
        for r in self.reqs.values():
            tree.unlock(r.lock)
        tree.evict_for_alloc(_evict_params()(num_tokens=shortfall))
        s = self._s
        for r in self.reqs.values():  # locked again on what is left of its path
            match = tree.match_prefix(s.MatchPrefixParams(key=r.key(r.protected)))
            r.lock = tree.lock(match.last_device_node)


class VllmFreedTwice(VllmKVManager):
    name = "vllm-fault-freed-twice"

    def free(self, seq, *, step=0):
        req = self._request(seq)
        blocks = [b for g in self._groups for b in g.req_to_blocks.get(req.request_id, ())
                  if not b.is_null]
        super().free(seq, step=step)
        self.pool.free_blocks(b for b in blocks if b.ref_cnt > 0)  # the second free


class VllmWindowEarly(VllmKVManager):
    """Over the serving default (sparse retention, the declared rule the oracle holds it to)."""

    name = "vllm-fault-window-early"

    def append(self, seqs, tokens, kv=None, *, step=0):
        for manager in self._sliding:
            for s in seqs:
                req = self._request(s)
                manager.remove_skipped_blocks(req.request_id,
                                              req.num_computed_tokens + self.block_size)
        return super().append(seqs, tokens, kv, step=step)


class VllmMambaEagleCheckpoint(VllmKVManager):
    """Over the serving default's align mode (a model with Mamba groups, prefix caching on)."""

    name = "vllm-fault-mamba-eagle-checkpoint"
    eagle = True  # the split's EAGLE block drop; the manager is built without use_eagle


def _release_component_lock_past_boundary(comp, node, params, lock_host: bool = False):
    """SWAComponent.release_component_lock before PR #27038: no boundary, no guard."""
    ct, root = comp.component_type, comp.tree_core.root_node
    cur = node
    while cur is not root:
        data = cur.component_data[ct]
        ref = data.lock_ref
        if ref == 1 and data.value is not None:
            size = comp.reclaimable_value_len(cur)
            comp.tree_core.component_evictable_size_[ct] += size
            comp.tree_core.component_protected_size_[ct] -= size
        data.lock_ref = ref - 1
        if ref == 1:
            comp.tree_core._update_evictable_leaf_sets(cur)
        cur = cur.parent


class SwaLockPastBoundary(SwaTree):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        comp = self.tree.tree_core.components_by_type[self._v.s.ComponentType.SWA]
        comp.release_component_lock = types.MethodType(_release_component_lock_past_boundary, comp)


class SwaReleaseSkipped(SwaTree):
    def release_window(self, rid) -> None:
        self.locks[rid].swa_released = True  # dec_swa_lock_only never called


class _SaltlessUnpinTier(_LMCacheTier):
    def _release_key(self, key):
        return self._key(key, salted=False)  # free_lookup_locks without cache_salt


class LmcacheSaltlessUnpin(LMCacheCPU):
    name = "lmcache-fault-saltless-unpin"
    tier_class = _SaltlessUnpinTier


class _HitAtLookupTier(_LMCacheTier):
    def loadable(self, key, seq) -> bool:
        found = super().loadable(key, seq)
        self.hits += found  # at every lookup, a refused allocation's too
        return found

    def begin_load(self, keys, seq, positions) -> None:
        super().begin_load(keys, seq, positions)
        self.hits -= len(keys)  # already counted at the lookup


class LmcacheHitAtLookup(LMCacheCPU):
    name = "lmcache-fault-hit-at-lookup"
    tier_class = _HitAtLookupTier


class _AbortLeaksTier(_LMCacheTier):
    def finish(self, seq) -> None:
        if seq in self.cancelled:  # release_aborted_request: the base class's no-op
            self.cancelled.discard(seq)
            return
        super().finish(seq)


class LmcacheAbortLeaks(LMCacheCPU):
    name = "lmcache-fault-abort-leaks"
    tier_class = _AbortLeaksTier
