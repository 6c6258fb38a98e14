"""SGLang 0.5.23's ``UnifiedRadixCache`` with its SWA or MAMBA component (``ComponentType.FULL``
and ``SWA``: a Gemma-style model of full and sliding-window layers; ``FULL`` and ``MAMBA``: a
Qwen3-Next / Nemotron-H style hybrid of full-attention and Mamba layers) on CPU pools, driven as
its scheduler drives it, and the figures SPEC §10 holds each component to.

Opt-in like the other SGLang adapter (impls/engines/sglang_radix.py's recipe and import). This is
no kvbench backend: SGLang keeps one pool per component (``SWAKVPool``: the full layers' and the
sliding layers' slots, a full slot mapped to its SWA peer; a Mamba pool of request states beside
the token pool), where SPEC §8's hybrid model shares
one pool among its groups, so the checker's oracle does not model it. What is checked instead is
the engine against its own ledger, after every step (``violations``):

- per component, SPEC §10: evictable + protected + free = the component's pool (the tree's
  ``full_/swa_evictable_size``, ``_protected_size`` and the allocator's ``full_/swa_available_size``);
- per component, the lock balance: the protected size is the value length of the nodes whose
  ``lock_ref`` is positive, the evictable size that of the unlocked ones, no ``lock_ref`` below 0,
  and with no request running none above 0.

Everything is SGLang's: the pools and the allocator are built as SGLang's own CPU tests build them
(``test_unified_radix_cache.py``'s ``build_fixture``, page size 1: ``SWAKVPool`` and
``SWATokenToKVPoolAllocator`` with a ``ReqToTokenPool``; or ``HybridReqToTokenPool`` with its
``MambaPool``, ``HybridLinearKVPool`` and a ``TokenToKVPoolAllocator``), the tree with the
component set ``create_unified_radix_cache`` gives such a model. A request runs as the scheduler
runs one: ``match_prefix``, the rest allocated (after ``evict`` for the shortfall where a pool is
short), ``insert`` of the whole prompt (with a Mamba state slot, given back where the tree already
holds that state), ``lock`` of its node; ``release_swa`` once its window has moved past the
prompt; ``unlock`` at the end. The Mamba component reads its caching granularity from the model
config (``mamba_cache_chunk_size``); with no model here it is set to FLA's chunk of 64, the value a
model config without ``mamba_chunk_size`` gives. The tree core is SGLang's Python ``UnifiedTreeCore`` (``"python"``, one of
the two it registers; the server picks the Rust one where it can): its component code is Python,
so a fault can be planted in it (impls/engines/faults_engines.py).
"""
from __future__ import annotations

import functools
import types

from impls.engines.sglang_radix import _sglang, available  # noqa: F401  (available: the probe)

TREE_CORE = "python"


@functools.lru_cache(maxsize=1)
def _swa():
    s = _sglang()
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.memory_pool import (HybridLinearKVPool, HybridReqToTokenPool,
                                                  ReqToTokenPool)
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1))
    get_server_args()._mamba_cache_chunk_size = 64  # FLA's CHUNK_SIZE: no model config here
    return types.SimpleNamespace(
        s=s, SWAKVPool=SWAKVPool, EvictParams=EvictParams, ReqToTokenPool=ReqToTokenPool,
        SWATokenToKVPoolAllocator=SWATokenToKVPoolAllocator, envs=envs,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator, HybridLinearKVPool=HybridLinearKVPool,
        HybridReqToTokenPool=HybridReqToTokenPool, Mamba2CacheParams=Mamba2CacheParams,
        Mamba2StateShape=Mamba2StateShape)


class ComponentTree:
    """``UnifiedRadixCache(FULL, SWA)`` (``window`` tokens) or ``(FULL, MAMBA)`` (``mamba``
    state slots) over a token pool of ``size`` slots (page size 1); requests by id."""

    def __init__(self, size: int, *, window: int | None = None, mamba: int | None = None,
                 layers=(0, 1, 2), full_layers=(3,), tree_core: str = TREE_CORE):
        assert (window is None) != (mamba is None), "an SWA window or a Mamba pool, one of them"
        v = self._v = _swa()
        s = v.s
        torch = s.torch
        self.size, self.window = size, window
        ct = s.ComponentType
        self.second = ct.SWA if window is not None else ct.MAMBA
        if window is not None:
            kv = v.SWAKVPool(size=size, size_swa=size, page_size=1, dtype=torch.bfloat16,
                             head_num=1, head_dim=4, swa_attention_layer_ids=list(layers),
                             full_attention_layer_ids=list(full_layers), device="cpu")
            self.alloc = v.SWATokenToKVPoolAllocator(size=size, size_swa=size, page_size=1,
                                                     dtype=torch.bfloat16, device="cpu",
                                                     kvcache=kv, need_sort=False)
            pool = v.ReqToTokenPool(size=8, max_context_len=1 << 12, device="cpu",
                                    enable_memory_saver=False)
            self.states = None
        else:
            with v.envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
                shape = v.Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1,
                                                  num_heads=2, head_dim=16, state_size=8,
                                                  conv_kernel=4)
                params = v.Mamba2CacheParams(shape=shape, layers=list(layers))
            pool = v.HybridReqToTokenPool(
                size=8, mamba_size=mamba, mamba_spec_state_size=8, max_context_len=1 << 12,
                device="cpu", enable_memory_saver=False, cache_params=params,
                mamba_layer_ids=list(layers), enable_mamba_extra_buffer=False,
                speculative_num_draft_tokens=3)
            kv = v.HybridLinearKVPool(size=size, dtype=torch.bfloat16, page_size=1, head_num=1,
                                      head_dim=4, full_attention_layer_ids=list(full_layers),
                                      device="cpu", enable_memory_saver=False,
                                      mamba_pool=pool.mamba_pool)
            self.alloc = v.TokenToKVPoolAllocator(size=size, dtype=torch.bfloat16, device="cpu",
                                                  kvcache=kv, need_sort=False)
            self.states = pool.mamba_allocator
        self.tree = s.UnifiedRadixCache(s.CacheInitParams(
            disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=self.alloc,
            page_size=1, sliding_window_size=window, tree_core_backend=tree_core,
            tree_components=(ct.FULL, self.second), enable_mamba_extra_buffer=False))
        self.locks: dict = {}  # request -> its TreeLock
        self.hits = 0

    def _free_tokens(self) -> int:
        a = self.alloc
        if self.states is None:
            return min(a.full_available_size(), a.swa_available_size())
        return a.available_size()

    def run(self, rid, tokens) -> bool:
        """A request of these token ids: matched, the rest allocated, inserted, its node
        locked; False (nothing changed but an eviction) where the pools cannot hold the rest."""
        s, tree, v = self._v.s, self.tree, self._v
        key = s.RadixKey(s.array("q", tokens))
        match = tree.match_prefix(s.MatchPrefixParams(key=key))
        hit = match.device_prefix_len
        need = len(tokens) - hit
        lock = tree.lock(match.last_device_node)  # the scheduler locks the hit first
        short = need - self._free_tokens()
        if self.states is None:
            if short > 0:
                tree.evict(v.EvictParams(num_tokens=short, swa_num_tokens=short))
        elif short > 0 or not self.states.available_size():
            tree.evict(v.EvictParams(num_tokens=max(short, 0),
                                     mamba_num=0 if self.states.available_size() else 1))
        new = self.alloc.alloc(need) if need else s.torch.empty(0, dtype=s.torch.int64)
        state = self.states.alloc(1) if self.states is not None else None
        if new is None or (self.states is not None and state is None):
            if new is not None and len(new):
                self.alloc.free(new)
            if state is not None:
                self.states.free(state)
            tree.unlock(lock)
            return False
        prefix = tree.path_device_indices(match.last_device_node)[:hit]
        value = s.torch.cat([prefix.to(new.dtype), new])
        result = tree.insert(s.InsertParams(key=key, value=value, prev_prefix_len=hit,
                                            mamba_value=state))
        if state is not None and result.mamba_exist:  # the tree holds this state already
            self.states.free(state)
        # the scheduler's cache_unfinished_req: the new node locked, the hit's lock dropped
        self.locks[rid] = tree.lock(result.last_device_node)
        tree.unlock(lock)
        self.hits += hit
        return True

    def release_window(self, rid) -> None:
        """The request's decode has moved its window past its prompt (``release_swa_prefix_lock``)."""
        self.tree.release_swa(self.locks[rid])

    def finish(self, rid) -> None:
        self.tree.unlock(self.locks.pop(rid))

    def evict(self, tokens: int) -> None:
        if self.states is None:
            self.tree.evict(self._v.EvictParams(num_tokens=tokens, swa_num_tokens=tokens))
        else:
            self.tree.evict(self._v.EvictParams(num_tokens=tokens, mamba_num=1))

    # --- the figures ----------------------------------------------------------------------

    def figures(self) -> dict:
        """Per component: (evictable, protected, free, pool)."""
        t, a = self.tree, self.alloc
        if self.states is None:
            return {"full": (t.full_evictable_size(), t.full_protected_size(),
                             a.full_available_size(), self.size),
                    "swa": (t.swa_evictable_size(), t.swa_protected_size(),
                            a.swa_available_size(), self.size)}
        return {"full": (t.full_evictable_size(), t.full_protected_size(), a.available_size(),
                         self.size),
                "mamba": (t.mamba_evictable_size(), t.mamba_protected_size(),
                          self.states.available_size(), self.states.size)}

    def _nodes(self):
        core = self.tree.tree_core
        stack = list(core.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def violations(self) -> list:
        """What disagrees with SPEC §10 and the lock balance now (empty: nothing)."""
        out = []
        for name, (evictable, protected, free, pool) in self.figures().items():
            if evictable + protected + free != pool:
                out.append(f"{name}: evictable {evictable} + protected {protected} + free {free} "
                           f"!= pool {pool}")
        ct = self._v.s.ComponentType
        for name, c in (("full", ct.FULL), (str(self.second), self.second)):
            locked = unlocked = 0
            for node in self._nodes():
                data = node.component_data[c]
                if data.lock_ref < 0:
                    out.append(f"{name}: node {node.id} lock_ref {data.lock_ref}")
                if not self.locks and data.lock_ref:
                    out.append(f"{name}: node {node.id} lock_ref {data.lock_ref} with no request "
                               f"running")
                if data.value is not None:
                    if data.lock_ref > 0:
                        locked += len(data.value)
                    else:
                        unlocked += len(data.value)
            evictable, protected = self.figures()[name][:2]
            if (locked, unlocked) != (protected, evictable):
                out.append(f"{name}: nodes locked {locked} / unlocked {unlocked} tokens, the tree "
                           f"counts protected {protected} / evictable {evictable}")
        return out


class SwaTree(ComponentTree):
    """FULL + SWA: a sliding window of ``window`` tokens."""

    def __init__(self, size: int, window: int, **kw):
        super().__init__(size, window=window, **kw)


class MambaTree(ComponentTree):
    """FULL + MAMBA: ``states`` Mamba state slots."""

    def __init__(self, size: int, states: int, **kw):
        super().__init__(size, mamba=states, **kw)
