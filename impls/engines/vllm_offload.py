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
- ``drops_failed_loads``: a tier whose ``failed_load`` is "drop" is vLLM's file tier, whose short
  read removes the file (fs/io.py:161) and marks the lookup a miss (fs/manager.py:306).
- ``failed_load_drops_unannounced``: that file tier's KV events announce a store job that
  succeeded and nothing else (fs/manager.py:286-295: an ``OffloadingEvent`` only for
  ``success and keys`` of a store job; a failed load job appends none), so the files a failed
  load removed stay in an index fed its events until they are stored again.
- ``failed_read_removes_at_once``: that short read removes the file while other loads of the
  block are in flight (fs/io.py:161; the tier counts no readers), and each of them that opens it
  after gets ``FileNotFoundError`` (:156): its job fails and the block is computed again.
"""
from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import tempfile
import time
import types

import numpy as np

from impls.engines.engine_tiers import EngineTiers
from impls.engines.vllm_blockpool import importable
from impls.numpy_paged import NumpyPaged
from impls.numpy_tiers import tier_arrays
from impls.pool_events import PoolEvents, _group_key
from kvbench.contract.events import REMOVED, STORED, KVEvent

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
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
    return types.SimpleNamespace(CPUOffloadingManager=CPUOffloadingManager, ReqContext=ReqContext,
                                 LookupResult=LookupResult, make_offload_key=make_offload_key,
                                 FileSystemTierManager=FileSystemTierManager, TransferJob=TransferJob)


def available() -> tuple[bool, str]:
    return importable(_vllm)


def _chunk_count(policy) -> int:
    """How many chunks a vLLM cache policy holds: its own maps' sizes (ARC's ghost lists hold
    keys, no chunk)."""
    if hasattr(policy, "chunks"):  # LRUCachePolicy
        return len(policy.chunks)
    return len(policy.t1) + len(policy.t2)  # ARCCachePolicy


def _kv_events(tier, index: int) -> list:
    out = []
    for event in tier.manager.take_events():
        if event.metadata_only:
            continue
        for k in event.keys:
            g, key = _group_key(tier.key_of[k])
            out.append(KVEvent(REMOVED if event.removed else STORED, key, None, g, index))
    return out


class _OffloadKeys:
    """What both tiers keep of vLLM's names: each kvbench key's ``OffloadKey`` (made at its first
    use) and back, and each sequence's ``ReqContext`` (the manager told of it at its first use)."""

    def _init_keys(self) -> None:
        self.offload_key: dict = {}  # kvbench key -> its OffloadKey
        self.key_of: dict = {}  # OffloadKey -> kvbench key
        self.contexts: dict = {}  # seq -> its ReqContext for this tier

    def _key(self, key):
        k = self.offload_key.get(key)
        if k is None:
            k = self.offload_key[key] = self.v.make_offload_key(
                len(self.offload_key).to_bytes(8, "big"), 0)
            self.key_of[k] = key
        return k

    def _context(self, seq):
        ctx = self.contexts.get(seq)
        if ctx is None:
            ctx = self.contexts[seq] = self.v.ReqContext(req_id=f"seq-{seq}")
            self.manager.on_new_request(ctx)
        return ctx


class _VllmTier(_OffloadKeys):
    """One tier run by a ``CPUOffloadingManager``; its arrays are the chunks, by chunk id."""

    def __init__(self, spec, storage, folder, block_size: int):
        v = self.v = _vllm()
        self.name, self.capacity, self.B = spec.name, spec.capacity, block_size
        # events on, as vLLM's connector turns them on when KV events are enabled
        self.manager = v.CPUOffloadingManager(spec.capacity, cache_policy=spec.policy, enable_events=True)
        self.arrays = tier_arrays(spec, storage, folder)
        self.slot: dict = {}  # kvbench key -> the chunk vLLM last gave it
        self._init_keys()
        self.finished: dict = {}  # seq -> its ReqContext once finished (its stores may be in flight)
        self.bytes_down = self.bytes_up = self.hits = 0

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

    def events(self, tier: int) -> list:
        """vLLM's ``OffloadingEvent``s since the last call (``take_events``: stored at a store's
        completion, removed at an eviction), as KV events of tier ``tier``; those vLLM marks
        ``metadata_only`` (a failed store's release) its connector publishes as nothing
        (offloading/events.py), and neither does this. They name no parent."""
        return _kv_events(self, tier)

    def figures(self) -> dict:
        """From the manager's own counters (cpu/manager.py:82-85, :100-101), no walk of its
        chunks: a chunk is storing (ref_cnt -1), evictable (0) or read by loads (> 0)."""
        m = self.manager
        held, storing = _chunk_count(m._policy), m._num_write_pending_chunks
        return {"name": self.name, "capacity": self.capacity, "stored": held - storing,
                "storing": storing, "loading": held - storing - m._num_evictable_cache_chunks,
                "free": m._get_num_free_chunks(), "bytes_down": self.bytes_down,
                "bytes_up": self.bytes_up, "hits": self.hits}


STAGING = 256  # chunks of a file tier's CPU buffer: its transfers in flight (a store, a load)


def _file_spec(block_size: int):
    """The parts of vLLM's ``OffloadingSpec`` a ``FileSystemTierManager`` reads (its
    ``FileMapper``'s naming, a chunk per block, events on): one full-attention group, one rank."""
    config = types.SimpleNamespace(
        groups=[types.SimpleNamespace(tokens_per_block=block_size, layer_names=["kvbench"])],
        parallel=types.SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                                       is_parallelism_agnostic=True),
        model=types.SimpleNamespace(name="kvbench", dtype="float16"),
        cache=types.SimpleNamespace(tokens_per_hash=block_size),
        canonical_layout=False, kv_cache_layout=None, replicated_layout=False)
    return types.SimpleNamespace(config=config, blocks_per_chunk=1,
                                 kv_events_config=types.SimpleNamespace(enable_kv_cache_events=True))


class _VllmFileTier(_OffloadKeys):
    """A tier whose ``failed_load`` is "drop", run by vLLM's ``FileSystemTierManager``
    (``vllm/v1/kv_offload/tiering/fs/manager.py``, its pure-Python I/O: one file per block
    under a temporary folder, written by its own threads) as the tiering manager drives a
    secondary tier: ``submit_store`` / ``submit_load`` with a ``TransferJob`` over chunks of the
    CPU buffer it reads and writes (``primary_kv_view``; here the adapter's, a chunk a block,
    page-aligned for its O_DIRECT), ``get_finished_jobs``, ``lookup`` (asynchronous: RETRY until
    its lookup thread answers, ``on_schedule_end`` posting each step's batch), and
    ``on_request_finished``. vLLM decides what a lookup finds and what a failed load leaves (a
    short read removes the file and marks the lookup a miss, PR 49328); the tier's counts are
    its files. The adapter's part: the store is submitted at its completion (a failed one is
    never submitted: no file, as vLLM's temp-file rename leaves none), a load is read at its
    completion one block a job (vLLM keeps a batch's blocks before its first bad one), a
    failed load's files cut short first (the torn file of vLLM issue 49176), the copies between
    the pool and the buffer, and, for a block vLLM failed to read under an ok load
    (failed_read_removes_at_once), the K/V the checker gives to compute it again. The file tier
    evicts nothing (it has no capacity): the adapter declares it (tier rule
    ``drop_tiers_evict_nothing``), so a trace that may store more blocks into the tier than its
    capacity is n/a; a store past it here is the adapter's error."""

    def __init__(self, spec, storage, folder, block_size: int):
        v = self.v = _vllm()
        self.name, self.capacity, self.B = spec.name, spec.capacity, block_size
        n = min(spec.capacity, STAGING)
        self.arrays = tier_arrays(dataclasses.replace(spec, name="staging", capacity=n), storage, folder)
        self.row_bytes = [a[0].nbytes if len(a) else 0 for a in self.arrays]
        chunk = -(-max(sum(self.row_bytes), 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        self.buffer = mmap.mmap(-1, max(n, 1) * chunk)
        self.chunks = np.frombuffer(self.buffer, dtype=np.uint8).reshape(max(n, 1), chunk)
        self.manager = v.FileSystemTierManager(
            _file_spec(block_size), memoryview(self.buffer).cast("B", (max(n, 1), chunk)), spec.name,
            tempfile.mkdtemp(prefix=f"vllm-{spec.name}-", dir=folder),
            enable_kv_events=True)  # its own thread counts (16 and 16)
        self.free_chunks = list(range(n - 1, -1, -1))
        self.slot: dict = {}  # kvbench key -> its chunk while a transfer moves it
        self.readers: dict = {}  # kvbench key -> loads in flight reading it
        self.storing: set = set()
        self._init_keys()  # offload_key: every key a store began
        self.jobs = 0
        self.bytes_down = self.bytes_up = self.hits = 0

    def _path(self, key) -> str:
        return self.manager.file_mapper.get_file_name(self._key(key))

    def _chunk(self, key) -> int:
        if key not in self.slot:
            if not self.free_chunks:
                raise RuntimeError(f"vllm-offload: tier {self.name}: more than {STAGING} blocks "
                                   "in flight (the adapter's CPU buffer)")
            self.slot[key] = self.free_chunks.pop()
        return self.slot[key]

    def _unslot(self, key) -> None:
        self.free_chunks.append(self.slot.pop(key))

    def _run(self, keys, seq, promotion: bool) -> bool:
        """One job of vLLM's over ``keys`` at their chunks, waited for; whether it succeeded."""
        self.jobs += 1
        job = self.v.TransferJob(self.jobs, [self._key(k) for k in keys],
                                 np.array([self.slot[k] for k in keys], dtype=np.int64),
                                 promotion, self._context(seq))
        (self.manager.submit_load if promotion else self.manager.submit_store)(job)
        self.manager.drain_jobs()
        results = {r.job_id: r for r in self.manager.get_finished_jobs()}
        return results[self.jobs].success

    # --- what PoolTiers asks of a tier -------------------------------------------------------

    def loadable(self, key, seq) -> bool:
        if key not in self.offload_key:
            return False
        ctx, deadline = self._context(seq), time.monotonic() + 10
        while True:
            found = self.manager.lookup(self._key(key), ctx)
            if found != self.v.LookupResult.RETRY:
                return found == self.v.LookupResult.HIT
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm-offload: tier {self.name}: vLLM's lookup thread gave "
                                   "no answer in 10 s")
            self.manager.on_schedule_end(None)  # posts the batch; the next lookup drains it
            time.sleep(0.0005)

    def begin_store(self, items, seq) -> list:
        new = [(p, b, key) for p, b, key in items
               if key not in self.storing and not (key in self.offload_key and os.path.exists(self._path(key)))]
        if self.stored() + len(self.storing) + len(new) > self.capacity:
            raise RuntimeError(f"vllm-offload: tier {self.name} (vLLM's file tier) evicts nothing: "
                               f"a store of {len(new)} blocks past its {self.capacity}")
        moved = []
        for p, b, key in new:
            self._key(key)
            self.storing.add(key)
            moved.append((p, b, key, self._chunk(key)))
        return moved

    def _pack(self, key) -> None:
        """The pool's copy of ``key`` (in the staging arrays) into its chunk of vLLM's buffer."""
        row, at = self.chunks[self.slot[key]], 0
        for a, n in zip(self.arrays, self.row_bytes):
            row[at:at + n] = a[self.slot[key]].reshape(-1).view(np.uint8)
            at += n

    def _unpack(self, key) -> None:
        row, at = self.chunks[self.slot[key]], 0
        for a, n in zip(self.arrays, self.row_bytes):
            a[self.slot[key]].reshape(-1).view(np.uint8)[:] = row[at:at + n]
            at += n

    def end_store(self, keys, ok, seq) -> None:
        keys = list(keys)
        if ok and keys:
            for key in keys:
                self._pack(key)
            if not self._run(keys, seq, promotion=False):
                raise RuntimeError(f"vllm-offload: tier {self.name}: vLLM's file tier failed a store")
        for key in keys:
            self.storing.discard(key)
            self._unslot(key)

    def begin_load(self, keys, seq, positions) -> None:
        for key in keys:
            self._chunk(key)
            self.readers[key] = self.readers.get(key, 0) + 1
        self.hits += len(keys)

    def read(self, keys, seq, ok) -> list:
        """A load's completion: vLLM reads each block into its chunk (a failed load's files cut
        short first, so that vLLM's read is the one that fails); returns the keys vLLM failed.
        An ok load fails where a failed load's short read removed the file under it (its
        ``os.open`` finds none, fs/io.py:156: failed_read_removes_at_once). After a failure vLLM's
        scheduler puts the request back to wait and looks its blocks up again at its next step
        (``get_num_new_matched_tokens``), recomputing only what that lookup misses: a block it
        still finds is a hit served again (counted here; vLLM would load it again, forever:
        issue 49176)."""
        failed = []
        for key in keys:
            if not ok and os.path.exists(self._path(key)):
                os.truncate(self._path(key), 0)
            if self._run([key], seq, promotion=True):
                self._unpack(key)
            else:
                failed.append(key)
        self.hits += sum(1 for key in failed if self.loadable(key, seq))
        return failed

    def end_load(self, keys, seq) -> None:
        for key in keys:
            self.readers[key] -= 1
            if not self.readers[key]:
                del self.readers[key]
                self._unslot(key)

    def load_failed(self, keys, seq) -> None:
        """What a failed load leaves is vLLM's (the short read removed the file)."""

    def finish(self, seq) -> None:
        ctx = self.contexts.pop(seq, None)
        if ctx is not None:
            self.manager.on_request_finished(ctx)

    def events(self, tier: int) -> list:
        """vLLM's file tier's events: stored when a store job succeeds; it announces no removal
        (failed_load_drops_unannounced)."""
        return _kv_events(self, tier)

    def stored(self) -> int:
        return sum(1 for key in self.offload_key if key not in self.storing and os.path.exists(self._path(key)))

    def figures(self) -> dict:
        """Its files: a block a load reads whose file a failed load removed is not loading."""
        stored = self.stored()
        loading = sum(1 for key in self.readers if os.path.exists(self._path(key)))
        return {"name": self.name, "capacity": self.capacity, "stored": stored,
                "storing": len(self.storing), "loading": loading,
                "free": self.capacity - stored - len(self.storing), "bytes_down": self.bytes_down,
                "bytes_up": self.bytes_up, "hits": self.hits}

    def close(self) -> None:
        self.manager.shutdown()


class VllmOffload(EngineTiers):
    """The NumPy pool whose lower tiers are vLLM's ``CPUOffloadingManager``s."""

    name = "vllm-offload"
    # No swap (SPEC §13): vLLM's V1 scheduler preempts by recompute; its offloading connector
    # stores and loads prefix blocks, not a preempted request's whole state.
    capabilities = dataclasses.replace(NumpyPaged.capabilities, tiers=("lru", "arc"),
                                       tier_rules=("whole_store_refused", "request_recency",
                                                   "drops_failed_loads",
                                                   "failed_load_drops_unannounced",
                                                   "drop_tiers_evict_nothing",
                                                   "failed_read_removes_at_once"), swap=False)
    tier_skips = {"tier copies": WORKER_SKIP}
    probe = staticmethod(available)

    def _make_tier(self, spec, storage):
        if spec.failed_load == "drop":
            return _VllmFileTier(spec, storage, self._tier_folder, self.B)
        return _VllmTier(spec, storage, self._tier_folder, self.B)

    def complete(self, tid, ok, kv=None, *, step=0):
        kind, seq, _, moved = self._transfers[tid]
        lost = set()  # an ok load's blocks vLLM's file tier failed to read
        if kind == "load":  # vLLM's file tiers read at the completion, before the copy up
            for t in self._tiers:
                keys = [tkey for *_, tkey, u in moved if u is t]
                if keys and isinstance(t, _VllmFileTier):
                    failed = t.read(keys, seq, ok)
                    if ok:
                        lost.update(failed)
        super().complete(tid, ok, kv, step=step)
        for i, (p, b, key, tkey, u) in enumerate(moved if lost else ()):
            if tkey not in lost:
                continue
            if kv is None and self.pool is not None:
                raise RuntimeError(f"vllm-offload: tier {u.name}: vLLM's file tier failed the read of "
                                   f"position {p} of an ok load, with no K/V to compute it again")
            # vLLM's connector recomputes it (failed_read_removes_at_once): nothing moved up
            u.bytes_up -= self._block_bytes_moved(1)
            if self.pool is not None:
                self._rewrite_block(b, kv[i * self.B:(i + 1) * self.B])

    def events(self) -> list:
        """KV events (SPEC §14): the device pool's (kvbench's NumPy pool, tier 0), then each
        tier's as its vLLM manager announced them."""
        out = PoolEvents._device_events(self)
        for i, t in enumerate(getattr(self, "_tiers", ())):
            out += t.events(i + 1)
        return out

    def close_tiers(self) -> None:
        for t in getattr(self, "_tiers", ()):
            if isinstance(t, _VllmFileTier):
                t.close()
        super().close_tiers()
