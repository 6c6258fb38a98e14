"""The NumPy pool whose lower tiers (SPEC §11) an engine's own tier manager runs: what the opt-in
tier adapters share (impls/engines/vllm_offload.py, impls/engines/lmcache_cpu.py). A subclass
gives ``probe`` (whether its engine imports, and why not) and ``_make_tier``; each tier it makes
answers what PoolTiers asks of a tier (impls/pool_tiers.py's TierSlots), ``finish(seq)`` when
the sequence is freed included."""
from __future__ import annotations

from impls.numpy_paged import NumpyPaged
from kvbench.contract.protocol import Backend, CacheConfig


class EngineTiers(NumpyPaged):
    # No KV events (SPEC §14) unless the adapter reads its engine's tier managers' own (vllm-offload
    # does: vLLM's OffloadingEvents): the pool's would cover the device alone.
    events = Backend.events

    @staticmethod
    def probe() -> tuple[bool, str]:
        raise NotImplementedError

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return cls.probe()

    def __init__(self, config: CacheConfig):
        ok, why = self.available()
        if not ok:
            raise RuntimeError(f"{self.name}: {why}")
        super().__init__(config)

    # No trace lookup (SPEC §11's pins): the engine's tier pins at the load (lmcache-cpu: its
    # connector's lookup), not at a lookup of its own; a trace with lookups is n/a here.
    lookup = None

    # A preemption stays a free and a prefill (each finishing the request in the engine's tier
    # manager once), not the NumPy pool's own preempt and resume.
    preempt, resume = Backend.preempt, Backend.resume

    def free(self, seq, *, step=0):
        super().free(seq, step=step)
        for t in getattr(self, "_tiers", ()):
            t.finish(seq)
