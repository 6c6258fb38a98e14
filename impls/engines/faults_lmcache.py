"""Planted upstream bugs over LMCache 0.5.6's ``LocalCPUBackend`` as the NumPy pool's tiers
(impls/engines/lmcache_cpu.py; opt-in, its environment), each caught by the tier ledgers (tests/engines/test_lmcache_cpu.py says at which step). The three bugs'
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

from impls.engines.lmcache_cpu import LMCacheCPU, _LMCacheTier


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
