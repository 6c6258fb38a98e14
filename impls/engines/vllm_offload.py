"""vLLM's ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``) as the lower tiers of
the NumPy pool (SPEC §11), with its ``lru`` and ``arc`` policies: the scheduler side of vLLM's
KV offloading under the checker.

Opt-in: vLLM is not a dependency of kvbench; the module imports without it, and
:meth:`VllmOffload.available` says why it cannot run.

Each tier of a trace is one manager (``num_chunks`` = the tier's capacity, ``cache_policy`` =
its policy), driven the way vLLM's offloading connector drives it
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``): a ``ReqContext`` per
sequence and tier, each key's end-token position set on it (``update_offload_keys``, scheduler.py
:412-428), ``prepare_store`` / ``complete_store(success)``, ``lookup`` / ``prepare_load`` /
``complete_load``, and ``on_request_finished`` when the sequence is freed (scheduler.py
:2175-2182). The connector calls no ``touch`` (its recency comes from the request accesses those
calls record). Everything a tier decides is vLLM's: which blocks a store begins or skips, what it
evicts, whether it refuses, which blocks are loadable, the chunk each block lives in (its
``CPULoadStoreSpec`` chunk ids, for a store and for a load), and the tier's counts, read back
from its chunks' ``ref_cnt`` (-1 storing, 0 stored, n > 0 read by n loads).

The adapter's own part: the device pool (kvbench's NumPy pool, with its leases), the keys (a
kvbench block key, salt and adapter included, becomes an ``OffloadKey`` of its own, group 0),
the nearest tier first for a load (one manager per tier; vLLM's tiering layer is not driven),
and the copies between the pool and the chunk arrays at the chunk ids vLLM gives: vLLM's worker
side (``cpu/gpu_worker.py``, its CUDA streams and ``swap_blocks``) needs CUDA, so the checker
reads back vLLM's addressing, not vLLM's copies (a skip the verdict names).

Where vLLM's rules differ from SPEC §11 the adapter declares it (``Capabilities.tier_rules``)
and the oracle holds vLLM to the declaration:

- ``whole_store_refused``: a store that cannot evict room for every new block is refused whole
  (``prepare_store`` returns None when ``num_chunks_to_evict`` exceeds the evictable chunks or
  the policy cannot find them, manager.py:321-336), where SPEC refuses block by block.
- ``request_recency``: recency is per request. A store's blocks enter the policy with the
  request's rank, earlier positions more recent (lru.py:267-277: ``(rank, -position)``); a load
  and a store's offer of a block already stored are accesses of the request (manager.py:239-240,
  :305-311); when the request finishes, every block it accessed becomes the most recent, its
  first block most recent of all (manager.py:421-448, lru.py:314-323); an ARC block reused by the
  request moves to T2 then, not at the load (arc.py:509-532). A tier's ``"policy"`` in the trace
  names vLLM's policy of that name under these rules.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import numpy as np

from impls.engines.engine_tiers import EngineTiers
from impls.engines.vllm_blockpool import importable
from impls.numpy_paged import NumpyPaged
from impls.numpy_tiers import tier_arrays

WORKER_SKIP = ("vLLM's worker-side copies (vllm/v1/kv_offload/cpu/gpu_worker.py) need CUDA: the "
               "adapter copies at the chunk ids vLLM's CPULoadStoreSpec gives, so the content "
               "checks hold vLLM's addressing, not its copies")


@functools.lru_cache(maxsize=1)
def _vllm():
    """vLLM's offloading manager and its key and request types, imported once."""
    import importlib.util
    if importlib.util.find_spec("vllm") is None:  # before torch: `kvbench list` must stay quick
        raise ImportError("No module named 'vllm'", name="vllm")
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    return types.SimpleNamespace(CPUOffloadingManager=CPUOffloadingManager, ReqContext=ReqContext,
                                 LookupResult=LookupResult, make_offload_key=make_offload_key)


def available() -> tuple[bool, str]:
    return importable(_vllm)


def _chunk_count(policy) -> int:
    """How many chunks a vLLM cache policy holds: its own maps' sizes (ARC's ghost lists hold
    keys, no chunk)."""
    if hasattr(policy, "chunks"):  # LRUCachePolicy
        return len(policy.chunks)
    return len(policy.t1) + len(policy.t2)  # ARCCachePolicy


class _VllmTier:
    """One tier run by a ``CPUOffloadingManager``; its arrays are the chunks, by chunk id."""

    def __init__(self, spec, storage, folder, block_size: int):
        v = self.v = _vllm()
        self.name, self.capacity, self.B = spec.name, spec.capacity, block_size
        self.manager = v.CPUOffloadingManager(spec.capacity, cache_policy=spec.policy)
        self.arrays = tier_arrays(spec, storage, folder)
        self.slot: dict = {}  # kvbench key -> the chunk vLLM last gave it
        self.offload_key: dict = {}  # kvbench key -> its OffloadKey
        self.contexts: dict = {}  # seq -> its ReqContext for this tier
        self.finished: dict = {}  # seq -> its ReqContext once finished (its stores may be in flight)
        self.bytes_down = self.bytes_up = self.hits = 0

    def _key(self, key):
        k = self.offload_key.get(key)
        if k is None:
            k = self.offload_key[key] = self.v.make_offload_key(
                len(self.offload_key).to_bytes(8, "big"), 0)
        return k

    def _context(self, seq):
        ctx = self.contexts.get(seq)
        if ctx is None:
            ctx = self.contexts[seq] = self.v.ReqContext(req_id=f"seq-{seq}")
            self.manager.on_new_request(ctx)
        return ctx

    def _keys(self, keys, seq, positions) -> list:
        """The OffloadKeys of ``keys``, each block's end token recorded on the request's context
        as the connector records it."""
        ctx = self._context(seq)
        out = [self._key(key) for key in keys]
        for k, p in zip(out, positions):
            ctx.set_offload_key_position(k, (p + 1) * self.B)
        return out

    # --- what PoolTiers asks of a tier -------------------------------------------------------

    def loadable(self, key, seq) -> bool:
        k = self.offload_key.get(key)
        return k is not None and self.manager.lookup(k, self._context(seq)) == self.v.LookupResult.HIT

    def begin_store(self, items, seq) -> list:
        keys = self._keys([k for _, _, k in items], seq, [p for p, _, _ in items])
        out = self.manager.prepare_store(keys, self._context(seq))
        if out is None:  # refused whole
            return []
        by_key = dict(zip(keys, items))
        moved = []
        for k, chunk in zip(out.keys_to_store, np.asarray(out.store_spec.block_ids).tolist()):
            p, b, key = by_key[k]
            self.slot[key] = chunk
            moved.append((p, b, key, chunk))
        return moved

    def _transfer_context(self, seq):
        """The context a completion is reported with: the request's own, finished or not."""
        return self.contexts.get(seq) or self.finished.get(seq) or self._context(seq)

    def end_store(self, keys, ok, seq) -> None:
        self.manager.complete_store([self._key(k) for k in keys], self._transfer_context(seq),
                                    success=ok)

    def begin_load(self, keys, seq, positions) -> None:
        spec = self.manager.prepare_load(self._keys(keys, seq, positions), self._context(seq))
        for key, chunk in zip(keys, np.asarray(spec.block_ids).tolist()):
            self.slot[key] = chunk
        self.hits += len(keys)

    def end_load(self, keys, seq) -> None:
        self.manager.complete_load([self._key(k) for k in keys], self._transfer_context(seq))

    def finish(self, seq) -> None:
        ctx = self.contexts.pop(seq, None)
        if ctx is not None:
            self.manager.on_request_finished(ctx)
            self.finished[seq] = ctx

    def figures(self) -> dict:
        """From the manager's own counters (cpu/manager.py:82-85, :100-101), no walk of its
        chunks: a chunk is storing (ref_cnt -1), evictable (0) or read by loads (> 0)."""
        m = self.manager
        held, storing = _chunk_count(m._policy), m._num_write_pending_chunks
        return {"name": self.name, "capacity": self.capacity, "stored": held - storing,
                "storing": storing, "loading": held - storing - m._num_evictable_cache_chunks,
                "free": m._get_num_free_chunks(), "bytes_down": self.bytes_down,
                "bytes_up": self.bytes_up, "hits": self.hits}


class VllmOffload(EngineTiers):
    """The NumPy pool whose lower tiers are vLLM's ``CPUOffloadingManager``s."""

    name = "vllm-offload"
    # No swap (SPEC §13): vLLM's V1 scheduler preempts by recompute; its offloading connector
    # stores and loads prefix blocks, not a preempted request's whole state.
    capabilities = dataclasses.replace(NumpyPaged.capabilities, tiers=("lru", "arc"),
                                       tier_rules=("whole_store_refused", "request_recency"),
                                       failed_loads=("keep",), swap=False)
    tier_skips = {"tier copies": WORKER_SKIP}
    probe = staticmethod(available)

    def _make_tier(self, spec, storage):
        return _VllmTier(spec, storage, self._tier_folder, self.B)
