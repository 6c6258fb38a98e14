"""vLLM's whole v1 ``KVCacheManager`` behind the kvbench protocol: the request path, ledger only.

Opt-in: vLLM is not a dependency of kvbench (docs/engines.md has the recipe). The module imports without
vLLM; :meth:`VllmKVManager.available` says why it cannot run.

Everything that decides memory is vLLM's, driven the way its scheduler drives it and its own tests
build it (vLLM's tests/v1/core/test_prefix_caching.py: ``make_kv_cache_config`` for the
``KVCacheConfig``, ``make_request`` for the ``Request`` with vLLM's block hasher):

- prefill: a ``Request`` whose prompt is the sequence's token ids, ``get_computed_blocks`` (the
  prefix cache, with vLLM's cap of ``num_tokens - 1`` hit tokens), then ``allocate_slots`` for the
  rest; ``None`` from it is an out-of-memory refusal.
- append: the new token ids go into the request (``append_output_token_ids``, which runs vLLM's
  block hasher), then ``allocate_slots`` for them, as the scheduler does for each decode step.
- fork: vLLM v1 has no fork. It serves parallel sampling (and beam search, at its API layer) as new
  requests whose prompt is the parent's tokens: with prefix caching the child hits the parent's
  full blocks and computes the block holding its last token again; without it, the child computes
  every block again. The adapter declares which (``Capabilities.fork_via``) and the checker holds
  vLLM to it.
- free: ``KVCacheManager.free`` (tail first, so a freed prefix's tail is evicted first).
- hybrid models (SPEC §8): one ``KVCacheGroupSpec`` per kvbench group, ``FullAttentionSpec`` or
  ``SlidingWindowSpec(sliding_window=W)`` (vLLM's tests/v1/core/test_prefix_caching.py,
  ``make_kv_cache_config_hybrid_model``). vLLM frees a sliding group's out-of-window blocks in
  ``SlidingWindowManager.remove_skipped_blocks``, which ``allocate_slots`` runs before it
  allocates, on the tokens computed before that call: the adapter declares
  ``window_release="next_allocation"`` and the checker holds vLLM to it.
- sparse retention (``prefix_cache_retention_interval = 0``, the server's default:
  config/cache.py:275, copied into the KVCacheConfig at v1/core/kv_cache_planning.py:665): a
  sliding group caches only the ``cdiv(W - 1, B)`` blocks a hit ending at a reachable boundary
  needs (single_type_kv_cache_manager.py:1106-1146 ``reachable_block_mask``, the run's length
  at :956-966), the boundaries being the prompt's ``P - 1`` (kv_cache_coordinator.py:65
  ``replay_boundaries``, without EAGLE) and the request's ``shared_prefix_boundary``
  (single_type_kv_cache_manager.py:511-519), the full groups' hit where the sliding group's was
  shorter (kv_cache_coordinator.py:937, kv_cache_manager.py:323), which the scheduler stores on
  the request (sched/scheduler.py:1125) and the adapter does too. ``cache_full_blocks`` leaves the other blocks unhashed
  (block_pool.py:281), so their release gives them back uncached (block_pool.py:837-847).
  Declared: ``sparse_window_retention`` (kvbench/model/rules/vllm.py models it).
- SPEC §12's kinds: ``ChunkedLocalAttentionSpec`` (its manager releases the chunks before the
  current one at the next allocation, as a window; its hit search counts every block left of
  the chunk holding token ``max_length`` as computed, null blocks looked up in no cache, so a
  prompt on chunked groups alone computes only that chunk, its blocks named or not:
  single_type_kv_cache_manager.py:1350-1368; declared: ``chunk_start_hit``), ``MLAAttentionSpec`` (full attention over one
  latent), ``MambaSpec``: without prefix caching in mode "none" (a block per position, all but
  the last released at the next allocation: kvbench's state rule); with it in mode "align", the
  only mode vLLM 0.33's MambaManager takes with prefix caching (single_type_kv_cache_manager.py
  :1442; ``MambaCacheMode`` is "align" | "none", config/cache.py:176), a prefill computed in the
  chunks vLLM's scheduler splits it into (``Scheduler._mamba_block_aligned_split``, called on
  the adapter's scheduler settings, ``_AlignedSplit``): one ``allocate_slots`` per chunk, each a
  scheduler step (``new_step_starts`` first). Declared: ``state_checkpoints="align"``
  (kvbench/model/rules/vllm.py). Not with dense retention (``None``: not modelled). Not sinks(S, W):
  vLLM's ``SinkFullAttentionSpec`` is full attention (``CAPABILITIES``).
- salts, LoRA adapters, token ids (SPEC §9): the trace's ``salt`` is the request's
  ``cache_salt``, its ``adapter`` a ``LoRARequest`` of that name, its ``token_ids`` the prompt.
- scheduler lifecycles (SPEC §13), as vLLM's scheduler drives the manager: a chunked prompt is
  one request of the whole prompt whose first ``allocate_slots`` covers the first chunk (its hit
  looked up within that chunk: ``get_computed_blocks(max_cache_hit_length=chunk - 1)``; vLLM's own
  scheduler would look past it and start the chunk after the hit) and each append of the rest
  another ``allocate_slots`` of prompt tokens (a block cached once its last token is computed);
  a speculative append puts its drafts in ``spec_token_ids`` and allocates for them with
  ``num_lookahead_tokens=0`` (a drafter that writes no KV: n-gram, suffix), and the accept adds
  the kept ones to the output and lowers ``num_computed_tokens`` by the rejected ones, as the
  scheduler's update does, so the blocks past the length stay the request's for its next drafts
  (declared: ``lookahead_slots``), and a block the kept drafts completed is cached only by the
  request's next ``allocate_slots`` (declared: ``kept_drafts_cached_at_next_append``); preemption by recompute is a ``free`` and its resume a new
  request of every token, as ``Scheduler._preempt_request`` frees and recomputes.

The adapter's own part: token ids for a trace that gives none (a hashed block's ids are a
function of its hash, so equal hashes give equal vLLM hashes; every other token is new), the
atomic check of a batched append (vLLM's scheduler allocates request by request and preempts;
kvbench's append is one atomic operation, so the blocks every request of the batch needs are
counted with vLLM's own ``get_num_blocks_to_allocate`` first, against the free blocks plus those
the window releases would give back), the atomic check of a prefill vLLM's scheduler splits
for align mode (the blocks of all its chunks counted before the first: every full group's, one
per state group at each chunk's end, and the cached hits taken off the free queue), and
reading the ledger back from vLLM's blocks.

vLLM reserves block 0 as its null block: a config of ``num_blocks = N`` builds N + 1 blocks, as the
block-pool adapter does (results/vllm/README.md, point 1).

Over 500 lines: one adapter of vLLM's whole manager, every group kind and scheduler lifecycle it
drives, each step cited to the vLLM source it follows.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import types

from impls.engines.block_tally import BlockTally
from impls.engines.vllm_blockpool import FreeQueueState, importable
from kvbench.contract import formulas as F
from kvbench.contract.protocol import Backend, Capabilities, CacheConfig, Ledger, OutOfMemory

# Dense retention of Mamba checkpoints: vLLM caches every full state block of a request, decode
# blocks included, whose states in align mode depend on its scheduler's decode steps (one token
# each); kvbench appends several tokens at once.
MAMBA_DENSE = ("vllm-kvmanager-dense does not run state groups with prefix caching: Mamba align "
               "mode's dense retention (prefix_cache_retention_interval None) is not modelled "
               "(SPEC §12; docs/engines.md)")
MAX_MODEL_LEN = 1 << 30  # no trace is clipped by vLLM's max_model_len
FIRST_NEW_ID = 1 << 48  # token ids the adapter makes up: above any a trace gives (int64 ids in practice)

CAPABILITIES = Capabilities(layout="paged", holds_kv=False, fork=True, copy_on_write=True,
                            prefix_caching=True, eviction=(), chunked_prefill=True,
                            groups=True, cache_salt=True,
                            # SPEC §12. Not sinks(S, W): vLLM's SinkFullAttentionSpec is full
                            # attention whose sinks are static K/V outside the request's blocks
                            # (static_sink_attention.py); no manager of vLLM's releases a window
                            # beside kept sinks.
                            kinds=("full", "sliding", "chunked", "mla", "state"),
                            # hit_leaves_last_token, caches_every_full_block,
                            # keeps_duplicate_blocks, window_release="next_allocation",
                            # lookahead_slots, kept_drafts_cached_at_next_append,
                            # sparse_window_retention (the serving default's, 0), chunk_start_hit:
                            # the vllm rule set's defaults (kvbench/model/rules/vllm.py)
                            rules="vllm")


def capabilities_for(caching: bool, retention_interval) -> Capabilities:
    """What the adapter declares for a manager with or without prefix caching and with this
    ``prefix_cache_retention_interval``: a fork through the prefix cache (without one, computed
    again whole); sparse retention of window blocks at 0, dense at None."""
    return dataclasses.replace(CAPABILITIES, rule_params={
        "fork_via": "prefix" if caching else "copy",
        "sparse_window_retention": retention_interval == 0})


@functools.lru_cache(maxsize=1)
def _vllm():
    """vLLM's manager, request and config classes, imported once (importing vLLM takes seconds)."""
    import importlib.util
    if importlib.util.find_spec("vllm") is None:  # before torch: `kvbench list` must stay quick
        raise ImportError("No module named 'vllm'", name="vllm")
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.config import CacheConfig as VllmCacheConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                            KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                            MLAAttentionSpec, SlidingWindowSpec)
    from vllm.v1.request import Request, RequestStatus

    # vLLM's default prefix-caching hash (CacheConfig.prefix_caching_hash_algo = "sha256").
    kv_cache_utils.init_none_hash(sha256)
    return types.SimpleNamespace(
        torch=torch, SamplingParams=SamplingParams, sha256=sha256, utils=kv_cache_utils,
        LoRARequest=LoRARequest, KVCacheManager=KVCacheManager, FullAttentionSpec=FullAttentionSpec,
        SlidingWindowSpec=SlidingWindowSpec, ChunkedLocalAttentionSpec=ChunkedLocalAttentionSpec,
        MLAAttentionSpec=MLAAttentionSpec, MambaSpec=MambaSpec,
        KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec, Request=Request,
        RequestStatus=RequestStatus, VllmCacheConfig=VllmCacheConfig)


def available() -> tuple[bool, str]:
    return importable(_vllm)


def serving_retention_interval() -> int | None:
    """``prefix_cache_retention_interval`` as vLLM's server sets it: its ``CacheConfig``'s default,
    which ``kv_cache_planning.get_kv_cache_config_from_groups`` copies into the KVCacheConfig."""
    return _vllm().VllmCacheConfig().prefix_cache_retention_interval


def kv_cache_config(config: CacheConfig, retention_interval="serving"):
    """vLLM's ``KVCacheConfig`` for kvbench's model and budget: one ``KVCacheGroupSpec`` per
    kvbench group, in kvbench's order (vLLM's tests' ``make_kv_cache_config`` /
    ``make_kv_cache_config_hybrid_model``), plus vLLM's null block.
    ``retention_interval``: "serving" (the server's default), or the value to pass."""
    v = _vllm()
    groups = [v.KVCacheGroupSpec([f"model.layers.{i}.self_attn" for i in g.layers],
                                 group_spec(config, g))
              for g in config.model.kv_groups]
    if retention_interval == "serving":
        retention_interval = serving_retention_interval()
    return v.KVCacheConfig(num_blocks=config.num_blocks + 1, kv_cache_tensors=[],
                           kv_cache_groups=groups, prefix_cache_retention_interval=retention_interval)


def group_spec(config: CacheConfig, group: F.KVGroup):
    """vLLM's spec of one kvbench group (SPEC §8, §12): FullAttentionSpec, SlidingWindowSpec(W),
    ChunkedLocalAttentionSpec(C), MLAAttentionSpec (one latent of d: one head of d, no V), or
    MambaSpec (one state of the group's bytes per layer as a float16 tensor; cache mode "align"
    with prefix caching, "none" without: the two modes vLLM 0.33 has)."""
    v = _vllm()
    m = config.model
    dtype = {1: v.torch.int8, 2: v.torch.float16, 4: v.torch.float32}[m.dtype_bytes]
    shape = dict(block_size=config.block_size, num_kv_heads=m.kv_heads, head_size=m.head_dim,
                 dtype=dtype)
    if group.window is not None:
        return v.SlidingWindowSpec(sliding_window=group.window, **shape)
    if group.chunk is not None:
        return v.ChunkedLocalAttentionSpec(attention_chunk_size=group.chunk, **shape)
    if group.latent is not None:
        return v.MLAAttentionSpec(block_size=config.block_size, num_kv_heads=1,
                                  head_size=group.latent, dtype=dtype)
    if group.state_bytes is not None:
        return v.MambaSpec(block_size=config.block_size, shapes=((group.state_bytes // 2,),),
                           dtypes=(v.torch.float16,),
                           mamba_cache_mode="align" if config.prefix_caching else "none")
    return v.FullAttentionSpec(**shape)


class VllmKVManager(Backend):
    name = "vllm-kvmanager"
    capabilities = CAPABILITIES
    # No eviction policy: vLLM preempts requests in its scheduler (the last admitted first), not
    # in the manager, so a config with a policy is reported not applicable by the checker.
    retention_interval = "serving"  # KVCacheConfig.prefix_cache_retention_interval
    eagle = False  # the scheduler's EAGLE block drop (no drafter that writes KV: n-gram, suffix)

    @classmethod
    def serving_departures(cls) -> tuple:
        """How this backend departs from vLLM's serving default, one setting each."""
        if cls.retention_interval == "serving":
            return ()
        return (f"prefix_cache_retention_interval {cls.retention_interval} (the server's default "
                f"is CacheConfig's, 0: only semantic checkpoints)",)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return available()

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        ok, why = self.available()
        if not ok:
            raise RuntimeError(f"{self.name}: {why}")
        v = self._v = _vllm()
        self.block_size = B = config.block_size
        self.caching = bool(config.prefix_caching)
        # Mamba's align mode: the prefill in the chunks vLLM's scheduler splits it into.
        self.align = self.caching and any(g.state_bytes is not None for g in config.model.kv_groups)
        kv_config = kv_cache_config(config, self.retention_interval)
        interval = kv_config.prefix_cache_retention_interval
        if interval not in (0, None):
            raise NotImplementedError(f"{self.name}: prefix_cache_retention_interval {interval} "
                                      f"(a tail per segment) is not modelled; 0 and None are")
        if self.align and interval is None:
            raise NotImplementedError(MAMBA_DENSE)
        self.capabilities = capabilities_for(self.caching, interval)
        if self.align:  # the scheduler's split of a chunked prompt is not driven
            self.capabilities = dataclasses.replace(self.capabilities, chunked_prefill=False)
        self.manager = v.KVCacheManager(kv_config,
                                        max_model_len=MAX_MODEL_LEN,
                                        scheduler_block_size=B, hash_block_size=B,
                                        enable_caching=self.caching)
        self.pool = self.manager.block_pool
        self._groups = self.manager.coordinator.single_type_managers  # kvbench's group order
        # The managers whose remove_skipped_blocks gives blocks back (sliding, chunked, Mamba).
        self._sliding = [m for m, g in zip(self._groups, config.model.kv_groups) if g.releases]
        self._hasher = v.utils.get_request_block_hasher(B, v.sha256)
        self._split = _AlignedSplit(B, self.eagle) if self.align else None
        self._sampling = v.SamplingParams(max_tokens=1 << 20)
        self.requests: dict[int, object] = {}
        self.final: dict[int, int] = {}
        self._ids = itertools.count(FIRST_NEW_ID)  # token ids no trace block uses
        self._hash_ids: dict = {}  # trace block hash -> its block's token ids
        self._trace_hash: dict = {}  # vLLM block hash -> the trace's
        self._loras: dict = {}  # adapter name -> its LoRARequest
        self.hit_blocks = 0
        self.tally = BlockTally(B, len(self._groups), self._tables_of, self._reservation_of)
        self.structures = FreeQueueState(self.pool, self.tally)

    # --- helpers ---------------------------------------------------------------------------

    def _request(self, seq):
        try:
            return self.requests[seq]
        except KeyError:
            raise KeyError(f"{self.name}: unknown sequence {seq}") from None

    def _tables_of(self, seq):
        req = self.requests.get(seq)
        if req is None:
            return None
        return ([m.req_to_blocks.get(req.request_id, ()) for m in self._groups],
                req.num_computed_tokens)

    def _reservation_of(self, seq):
        """Per group, a private tail's free slots the sequence's later tokens will use (SPEC
        §10); the tail is the block of the last computed token (lookahead slots lie past it)."""
        req, B = self.requests[seq], self.block_size
        n = req.num_computed_tokens
        r, tails = 0, []
        for manager in self._groups:
            table = manager.req_to_blocks.get(req.request_id, ())
            tail = table[F.blocks_needed(n, B) - 1] if n and table else None
            if tail is not None and not tail.is_null:
                tails.append(tail.block_id)
                if tail.ref_cnt == 1:
                    r += F.tail_reservation((-n) % B, self.final[seq] - n)
        return r, tuple(tails)

    def _new_ids(self, n: int) -> list:
        return [next(self._ids) for _ in range(n)]

    def _prompt_ids(self, tokens: int, hashes, token_ids=None) -> list:
        """Token ids of a prompt of ``tokens`` tokens: the trace's, or a hashed block's its hash's
        (equal hashes, equal vLLM block hashes, since the trace's hashes name a block with its
        whole prefix); past them (a recompute writes more tokens than its prompt named), new ones."""
        if token_ids is not None:
            ids = list(token_ids)[:tokens]
        else:
            ids = []
            for h in hashes:
                if h not in self._hash_ids:
                    self._hash_ids[h] = self._new_ids(self.block_size)
                ids += self._hash_ids[h]
        return ids + self._new_ids(tokens - len(ids))

    def _lora(self, adapter):
        """The LoRARequest of an adapter name (one id per name): vLLM's block hashes key on its
        name and path."""
        if adapter is None:
            return None
        if adapter not in self._loras:
            self._loras[adapter] = self._v.LoRARequest(
                lora_name=adapter, lora_int_id=len(self._loras) + 1, lora_path=f"/adapters/{adapter}")
        return self._loras[adapter]

    def _admit(self, seq, token_ids, final_tokens, count_hits: bool, salt=None, lora=None,
               first=None):
        """A new request with these token ids, computed through vLLM's manager (``first``: the
        first chunk's tokens only); None if refused."""
        v = self._v
        req = v.Request(request_id=str(seq), prompt_token_ids=token_ids,
                        sampling_params=self._sampling, pooling_params=None,
                        lora_request=lora, cache_salt=salt, block_hasher=self._hasher)
        self.tally.touch(seq)
        if not token_ids:  # nothing to compute: vLLM has no empty request, and holds no block
            self.requests[seq] = req
            self.final[seq] = final_tokens
            return req
        first = len(token_ids) if first is None else first
        if self.align:
            self.manager.new_step_starts()
        # The scheduler keeps the junction on the request: sparse retention caches its window.
        computed, n_hit, req.shared_prefix_boundary = self.manager.get_computed_blocks(
            req, max_cache_hit_length=first - 1)
        if self.align:
            if first < len(token_ids):
                raise NotImplementedError(f"{self.name}: a chunked prompt on a model with Mamba "
                                          f"groups and prefix caching is not modelled")
            if not self._admit_aligned(req, n_hit, computed):
                return None
        else:
            got = self.manager.allocate_slots(req, first - n_hit, n_hit, computed)
            if got is None:
                return None
        req.num_computed_tokens = first
        req.status = v.RequestStatus.RUNNING
        if count_hits:
            # Every group's hit blocks (a sliding group's null below its window is none).
            self.hit_blocks += sum(1 for blocks in computed.blocks for b in blocks if not b.is_null)
        self.requests[seq] = req
        self.final[seq] = final_tokens
        return req

    def _admit_aligned(self, req, n_hit: int, computed) -> bool:
        """A prompt in the chunks vLLM's scheduler splits it into for Mamba's align mode, one
        ``allocate_slots`` per chunk, each a scheduler step; False (nothing allocated) if all
        its chunks' blocks do not fit (the adapter's atomic check)."""
        ends, start = [], n_hit
        while start < req.num_tokens:
            n = self._split(req, req.num_tokens - start, start)
            ends.append(start + n)
            start += n
        B, n_blocks = self.block_size, F.blocks_needed(req.num_tokens, self.block_size)
        L = n_hit // B
        need = 0
        for manager in self._groups:
            if type(manager).__name__ == "MambaManager":  # a block at each chunk's last position
                need += len({(e - 1) // B for e in ends if (e - 1) // B >= L})
            else:
                need += n_blocks - L
        taken = {b.block_id for blocks in computed.blocks for b in blocks
                 if not b.is_null and b.ref_cnt == 0}  # cached hits off the free queue
        if need + len(taken) > self.pool.get_num_free_blocks():
            return False
        for i, end in enumerate(ends):
            if i:
                self.manager.new_step_starts()
            got = (self.manager.allocate_slots(req, end - n_hit, n_hit, computed) if i == 0
                   else self.manager.allocate_slots(req, end - req.num_computed_tokens))
            assert got is not None, "vLLM refused a chunk the adapter's count said fits"
            req.num_computed_tokens = end
            self.tally.held_within(m.req_to_blocks.get(req.request_id, ()) for m in self._groups)
        return True

    # --- the protocol ----------------------------------------------------------------------

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        tokens = prompt.tokens
        if seq in self.requests:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        if tokens < 0:
            raise ValueError(f"{self.name}: prefill of sequence {seq} with {tokens} tokens")
        whole = prompt.prompt_length  # a chunked prompt: one request of all of it
        hashes = tuple(prompt.block_hashes or ())[:whole // self.block_size] if self.caching else ()
        final = prompt.final_tokens if prompt.final_tokens is not None else tokens
        req = self._admit(seq, self._prompt_ids(whole, hashes, prompt.token_ids), final,
                          count_hits=True, salt=prompt.salt, lora=self._lora(prompt.adapter),
                          first=tokens)
        if req is None:
            raise OutOfMemory(f"{self.name}: prefill of sequence {seq} ({tokens} tokens): "
                              f"allocate_slots found too few free blocks "
                              f"({self.pool.get_num_free_blocks()} free)")
        self._trace_hash.update(zip(req.block_hashes, hashes))
        return ()

    def _window_drops(self, reqs) -> dict:
        """The references ``remove_skipped_blocks`` would drop for these requests, per block:
        every block of a sliding group wholly below the window of the tokens computed so far."""
        drops: dict = {}  # block id -> [block, references dropped]
        for manager in self._sliding:
            for req in reqs:
                table = manager.req_to_blocks.get(req.request_id, ())
                skipped = manager.get_num_skipped_tokens(req.num_computed_tokens) // self.block_size
                for blk in reversed(table[:skipped]):
                    if blk.is_null:  # released by an earlier call, and everything below it
                        if self.align and type(manager).__name__ == "MambaManager":
                            continue  # align mode leaves null positions between states
                        break
                    drops.setdefault(blk.block_id, [blk, 0])[1] += 1
        return drops

    def append(self, seqs, tokens, kv=None, *, step=0, draft=None):
        seqs, tokens = list(seqs), list(tokens)
        reqs = [self._request(s) for s in seqs]
        self.tally.touch(*seqs)
        coordinator = self.manager.coordinator
        empty = self.manager.empty_kv_cache_blocks.blocks
        need = 0
        for req, dt in zip(reqs, tokens):
            n = req.num_computed_tokens
            need += coordinator.get_num_blocks_to_allocate(
                request_id=req.request_id, num_tokens=n + dt, new_computed_blocks=empty,
                num_encoder_tokens=0, total_computed_tokens=n, num_local_computed_tokens=n,
                num_tokens_main_model=n + dt)
        # vLLM frees what slid out of a window before it allocates (counted, not yet done, so
        # that a refusal changes nothing).
        released = sum(1 for blk, d in self._window_drops(reqs).values() if blk.ref_cnt == d)
        free = self.pool.get_num_free_blocks() + released
        if need > free:
            raise OutOfMemory(f"{self.name}: append of {tokens} tokens to sequences {seqs} needs "
                              f"{need} blocks, {free} free (window releases included)")
        # The releases of the whole batch first, group by group, in batch order: allocate_slots
        # would do each request's just before its allocation, and then finds nothing to free.
        for manager in self._sliding:
            for req in reqs:
                manager.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        for i, (req, dt) in enumerate(zip(reqs, tokens)):
            if dt <= 0:
                continue
            d = draft[i] if draft else 0
            if req.num_computed_tokens >= req.num_prompt_tokens:  # past a chunked prompt's tokens
                req.append_output_token_ids(self._new_ids(dt - d))  # runs vLLM's block hasher
            req.spec_token_ids = self._new_ids(d)  # never hashed, nor cached
            got = self.manager.allocate_slots(req, dt, num_lookahead_tokens=0)
            assert got is not None, "vLLM refused an append its own count said fits"
            req.num_computed_tokens += dt
        return ()

    def accept(self, seq, n, *, drafted, step=0):
        """The scheduler's update after verification: the kept drafts join the output, the
        computed tokens drop by the rejected ones; no block is freed."""
        req = self._request(seq)
        self.tally.touch(seq)
        kept, req.spec_token_ids = req.spec_token_ids[:n], []
        req.append_output_token_ids(kept)
        req.num_computed_tokens -= drafted - n
        return ()

    def fork(self, seq, src, *, final_tokens=None, step=0):
        if seq in self.requests:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        parent = self._request(src)
        self.tally.touch(src)  # the child's hits are the parent's blocks
        computed = parent.num_computed_tokens  # a chunked prompt's later chunks are not the child's
        final = final_tokens if final_tokens is not None else computed
        # Parallel sampling: children of one request, with its salt and LoRA adapter.
        if self._admit(seq, list(parent.all_token_ids)[:computed], final, count_hits=False,
                       salt=parent.cache_salt, lora=parent.lora_request) is None:
            raise OutOfMemory(f"{self.name}: fork of sequence {src} into {seq} "
                              f"({computed} tokens): allocate_slots found too few free "
                              f"blocks ({self.pool.get_num_free_blocks()} free)")
        return ()

    def free(self, seq, *, step=0):
        req = self._request(seq)
        self.tally.touch(seq)
        self.manager.free(req)
        del self.requests[seq], self.final[seq]

    def table(self, seq, group: int = 0) -> list:
        """The sequence's blocks in one group (vLLM's ``KVCacheBlock`` objects), in order; vLLM's
        null block where a sliding window released one."""
        return list(self._groups[group].req_to_blocks.get(self._request(seq).request_id, ()))

    def ledger(self, seqs=None) -> Ledger:
        """From the tally (the blocks operations touched) and vLLM's own counts: no pool scan."""
        tally = self.tally
        tally.sync()
        live = self.requests if seqs is None else [s for s in seqs if s in self.requests]
        return Ledger.paged(
            num_blocks=self.config.num_blocks, block_size=self.block_size,
            block_bytes=self.block_size * self.config.model.slot_bytes,
            # BlockPool.get_num_free_blocks: the free queue's own count (block_pool.py:912-919).
            blocks_used=tally.used, blocks_free=self.pool.get_num_free_blocks(),
            tokens={s: tally.tokens(s) for s in live},
            seq_blocks={s: tally.seq_blocks(s) for s in live},
            token_states=tally.token_states, reservation=tally.reservation,
            shared_blocks=tally.shared, cached_blocks=tally.cached,
            prefix_hit_blocks=self.hit_blocks,
            group_blocks=tuple(len(refs) for refs in tally.group_refs),
            # KVCacheManager.usage, vLLM's own (logged) figure: BlockPool.get_usage, from the
            # same free count (kv_cache_manager.py:229, block_pool.py:921-932).
            self_report={"block_usage": self.manager.usage})

    def cached_order(self) -> list:
        """vLLM's eviction order: the cached blocks of its free queue, the next one evicted first,
        each named by the trace hash it holds (None for a block the trace does not hash)."""
        get = self._v.utils.get_block_hash
        return [self._trace_hash.get(get(b.block_hash))
                for b in self.pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None]


    # --- block_state: vLLM's own structures -------------------------------------------------

    def block_state(self, seqs=None, *, changed_since=None):
        """vLLM's free block queue and reference counts (``FreeQueueState``), and each request's
        blocks per group (``req_to_blocks``, the null block where none is held)."""
        live = self.requests if seqs is None else [s for s in seqs if s in self.requests]
        return self.structures.state(
            {s: [m.req_to_blocks.get(self.requests[s].request_id, ()) for m in self._groups]
             for s in live}, changed_since)


class _AlignedSplit:
    """vLLM's scheduler's chunk split for Mamba's align mode (``Scheduler._mamba_block_aligned_split``,
    its own code) on the adapter's scheduler settings: one block size for every group and for
    the hash, no chunk budget (the adapter computes a prompt in as few chunks as the split
    allows), no internal prefill checkpoints (``num_prefill_checkpoint_blocks = 0``), no partial
    (sub-block) hits; ``eagle``: an EAGLE / MTP drafter's block drop."""

    def __init__(self, block_size: int, eagle: bool = False):
        self.cache_config = types.SimpleNamespace(block_size=block_size)
        self.block_size = self.hash_block_size = block_size
        self.use_eagle_block_drop = eagle
        self.num_hash_lookahead_tokens = 0
        self.mamba_partial_cache_hit = self.mamba_shared_prefix_checkpoint = False
        self.mamba_has_prefill_checkpoint_blocks = False
        self.mamba_prefill_checkpoint_alignment = None
        self.max_num_scheduled_tokens = MAX_MODEL_LEN
        self.scheduler_config = types.SimpleNamespace(long_prefill_token_threshold=0)

    def __call__(self, req, num_new_tokens: int, num_computed: int) -> int:
        """The next chunk's tokens of ``req`` from ``num_computed`` (its hit, or its chunks so far)."""
        from vllm.v1.core.sched.scheduler import Scheduler
        done, req.num_computed_tokens = req.num_computed_tokens, num_computed
        try:
            return Scheduler._mamba_block_aligned_split(self, req, num_new_tokens)
        finally:
            req.num_computed_tokens = done


class VllmKVManagerDense(VllmKVManager):
    """The manager with dense retention of sliding-window checkpoints (``None``): what this
    adapter ran before it took vLLM's serving default; not what vLLM serves with."""

    name = "vllm-kvmanager-dense"
    retention_interval = None
    capabilities = dataclasses.replace(CAPABILITIES,
                                       rule_params={"sparse_window_retention": False})


class VllmKVManagerMamba(VllmKVManager):
    """The same manager declaring only a Mamba hybrid's kinds (full attention and state), so
    that a fuzz campaign draws Mamba hybrids alone:
    ``kvbench fuzz --backend impls.engines.vllm_kvmanager:VllmKVManagerMamba``. Not registered:
    ``vllm-kvmanager`` runs every kind."""

    name = "vllm-kvmanager-mamba"
    capabilities = dataclasses.replace(CAPABILITIES, kinds=("full", "state"))

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, kinds=("full", "state"))
