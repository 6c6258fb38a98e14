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
- ``VllmMambaMargin``: vLLM issue #50630 / PR #48375 (A->B->A on a Mamba hybrid with prefix
  caching): ``MambaManager.find_longest_cache_hit`` takes ``drop_eagle_block`` and never reads
  it, so when the coordinator grants the Mamba group EAGLE's margin of one block past the
  candidate the Mamba hit grows past the full groups' and claims tokens whose KV the full group
  never held. vLLM 0.33 withholds the margin from Mamba groups in
  ``HybridKVCacheCoordinator.find_longest_cache_hit`` (the ``not isinstance(spec, MambaSpec)``
  carve-out); planted by reverting the carve-out (the module's ``MambaSpec`` swapped during the
  lookup) with the Mamba groups alone taking the margin (no drafter on the full groups: the
  serving default's rules hold for everything else).
- ``VllmCompressedKeys``: vLLM-Ascend issue #10296 (DeepSeek-V4's compressed groups: blocks
  written keyed by one granularity, looked up by another). vLLM 0.33 has no compressed
  manager (a compressed spec, ``tokens_per_state > 1``, is managed as full attention, one block
  size for writes and lookups); planted in the nearest real class (and in kvbench's own pool,
  where the model runs compressed groups: ``CompressedKeysAtBlockSize`` in impls/faults.py): ``FullAttentionManager.find_longest_cache_hit`` given the group's spec with the
  logical block size (``block_size * compress_ratio``, ratio 4) while ``cache_full_blocks``
  keys each block by its own ``block_size``. A logical block's hash (vLLM's
  ``BlockHashListWithBlockSize``: the last physical hash within it) then names the physical
  block of the logical block's last position, which the lookup serves as the first.

- ``VllmFailedLoadHitKept``: vLLM issue #49176 with PR #49328's fix reverted in vLLM's file tier
  (``FileSystemTierManager``, run by ``vllm-offload`` for a tier declaring ``failed_load``
  "drop"): a failed load no longer marks its blocks' lookup verdicts a miss, so the request's
  retry still finds the blocks whose files the short read removed, and is served the hit again.

SGLang's ``UnifiedRadixCache`` with its SWA component (impls/engines/sglang_components.py's
``SwaTree``, SGLang's Python tree core), each caught by the per-component figures
(tests/engines/test_sglang_components.py says at which step):

- ``SwaLockPastBoundary``: SGLang PR #27038 reverted: ``SWAComponent.release_component_lock``
  walks past the window's boundary node (its uuid unread) to the root, so a release
  decrements the SWA locks of ancestors its acquire never took.
- ``SwaReleaseSkipped``: SGLang PR #28161's missing ``dec_swa_lock_only``: ``release_swa`` marks
  the lock's SWA part released without releasing it, and the ``unlock`` that follows skips it,
  so the window's nodes stay locked after every request ended (planted: 0.5.23 releases it).
- ``SwaStaleMappingFreed``: SGLang PR #27586 reverted: the insert-overlap recovery of an SWA
  tombstone frees its old base through ``free_swa``, reading a stale full-to-SWA mapping.
- ``SwaWindowFloorDropped``: SGLang PR #27770's decode-side window floor dropped at insert:
  the SWA slots the window freed are taken by the tree as live (planted).
- ``MambaNoCheckpointHeadroom``: SGLang PR #33773 reverted: admission leaves no room for the
  Mamba checkpoint, which ``MambaComponent._alloc_mamba_slot`` then cannot allocate.
"""
from __future__ import annotations

import dataclasses
import types

from impls.engines.sglang_components import MambaTree, SwaTree
from impls.engines.sglang_radix import Sglang, SglangRadix
from impls.engines.vllm_blockpool import VllmBlockPool
from impls.engines.vllm_kvmanager import VllmKVManager
from impls.engines.vllm_offload import VllmOffload


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


class VllmMambaMargin(VllmKVManager):
    """Over the serving default's align mode (a model with Mamba groups, prefix caching on)."""

    name = "vllm-fault-mamba-margin"

    def __init__(self, config):
        super().__init__(config)
        from vllm.v1.core import kv_cache_coordinator
        coordinator, base = self.manager.coordinator, type(self.manager.coordinator)

        class NoSpec:  # the carve-out's isinstance(spec, MambaSpec) never holds
            pass

        def find_longest_cache_hit(self_, block_hashes, max_cache_hit_length):
            groups = self_.attention_groups
            # The margin is the EAGLE one; only the Mamba groups take it (no drafter's drop
            # on the full groups), and MambaManager's finder never gives it back.
            self_.attention_groups = [g._replace(use_eagle=True)
                                      if type(g.spec).__name__ == "MambaSpec" else g for g in groups]
            saved, kv_cache_coordinator.MambaSpec = kv_cache_coordinator.MambaSpec, NoSpec
            try:
                return base.find_longest_cache_hit(self_, block_hashes, max_cache_hit_length)
            finally:
                kv_cache_coordinator.MambaSpec = saved
                self_.attention_groups = groups

        coordinator.find_longest_cache_hit = types.MethodType(find_longest_cache_hit, coordinator)


class VllmMambaEagleCheckpoint(VllmKVManager):
    """Over the serving default's align mode (a model with Mamba groups, prefix caching on)."""

    name = "vllm-fault-mamba-eagle-checkpoint"
    eagle = True  # the split's EAGLE block drop; the manager is built without use_eagle


class VllmCompressedKeys(VllmKVManager):
    """Over the serving default, on a model of one full-attention group."""

    name = "vllm-fault-compressed-keys"
    compress_ratio = 4  # DeepSeek-V4's C4 layers

    def __init__(self, config):
        super().__init__(config)
        manager = self.manager.coordinator.single_type_managers[0]
        find, r = type(manager).find_longest_cache_hit, self.compress_ratio

        def find_longest_cache_hit(*, kv_cache_spec, **kw):
            # The lookup's blocks of the logical size, block_size * compress_ratio tokens.
            logical = dataclasses.replace(kv_cache_spec, block_size=kv_cache_spec.block_size * r)
            return find(kv_cache_spec=logical, **kw)

        manager.find_longest_cache_hit = find_longest_cache_hit


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
        self.reqs[rid].lock.swa_released = True  # dec_swa_lock_only never called



# --- vLLM's free block queue: the order its cached blocks are evicted in ------------------------

def _appends_reversed(pool) -> None:
    """``pool``'s ``FreeKVCacheBlockQueue.append_n`` planted to append in reverse."""
    queue = pool.free_block_queue
    base = type(queue)
    queue.__class__ = type(f"Reversed{base.__name__}", (base,), {
        "append_n": lambda q, blocks: base.append_n(q, list(blocks)[::-1])})


class VllmCachedReversed(VllmBlockPool):
    """vLLM's ``FreeKVCacheBlockQueue.append_n`` planted to append in reverse: the blocks a free
    gives back cached (``BlockPool.free_blocks``' "FIFO reuse of cached blocks") join the queue
    head of the request first, so a freed prefix's first block is evicted before its tail, where
    vLLM's docstring has "the tail of a block chain ... at the front". No count changes: only
    the order, and the hits it costs later (a chained prefix loses its head, so all of it)."""

    name = "vllm-fault-cached-reversed"

    def __init__(self, config):
        super().__init__(config)
        _appends_reversed(self.pool)


class VllmKVManagerCachedReversed(VllmKVManager):
    """The same plant in the whole manager's pool (every group's blocks)."""

    name = "vllm-fault-manager-cached-reversed"

    def __init__(self, config):
        super().__init__(config)
        _appends_reversed(self.pool)


# --- vLLM PR 52707: a negative external block count ---------------------------------------------

class VllmExternalAfterRejection(VllmKVManager):
    """Not a fault: after an accept, a KV connector's external hit on the request's last computed
    token, as the scheduler hands it to ``allocate_external_computed_blocks`` (``num_local`` +
    ``num_external`` = the tokens computed). The request holds every block those tokens need (and
    its lookahead slots), so vLLM 0.33 allocates nothing: ``max(0, cdiv(n, B) - len(blocks))``."""

    name = "vllm-external-after-rejection"

    def accept(self, seq, n, *, drafted, step=0):
        out = super().accept(seq, n, drafted=drafted, step=step)
        req = self._request(seq)
        computed = req.num_computed_tokens
        if computed:
            for manager in self._groups:
                manager.allocate_external_computed_blocks(req.request_id, computed - 1, 1)
        return out


def _external_blocks_unclamped(manager, request_id, num_local_computed_tokens,
                               num_external_computed_tokens, record_for_zeroing=True):
    """``SingleTypeKVCacheManager.allocate_external_computed_blocks`` before PR 52707: the count
    passed to ``get_new_blocks`` unclamped. After a rejection of drafts the request holds more
    blocks than its tokens need, the count is negative, ``get_new_blocks`` lets it pass (it
    checks only against the free count) and ``popleft_n`` adds it to ``num_free_blocks`` while
    its loop pops nothing: the queue counts blocks it does not hold."""
    total = num_local_computed_tokens + num_external_computed_tokens
    skipped = manager.get_num_skipped_tokens(total)
    if skipped > 0:
        num_external_computed_tokens = min(total - skipped, num_external_computed_tokens)
    if num_external_computed_tokens <= 0:
        return
    req_blocks = manager.req_to_blocks[request_id]
    allocated = manager.block_pool.get_new_blocks(-(-total // manager.block_size) - len(req_blocks))
    req_blocks.extend(allocated)
    if manager._record_new_block_ids and record_for_zeroing:
        manager.new_block_ids.extend(b.block_id for b in allocated)


class VllmExternalNegative(VllmExternalAfterRejection):
    """vLLM PR 52707 reverted (0.33 has the clamp): the same external hit, the count unclamped."""

    name = "vllm-fault-external-negative"

    def __init__(self, config):
        super().__init__(config)
        for manager in self._groups:
            manager.allocate_external_computed_blocks = types.MethodType(
                _external_blocks_unclamped, manager)


# --- SGLang's RadixCache, caught by its block structures (SglangRadix.block_state) -------------
# Each planted in the real tree (no upstream report): what its block_state exposes, its
# evictable leaves in eviction order and its nodes' lock counts, shows it at the operation it
# goes wrong (tests/engines/test_sglang_block_state.py says where, and where the ledger alone would).

class SglangRadixLeavesReversed(SglangRadix):
    """The lru tree's eviction heap keyed the wrong way round: its leaves given back most
    recently used first (RadixCache built under lru, its strategy MRUStrategy's
    ``-last_access_time``), while the backend declares lru."""

    name = "sglang-fault-leaves-reversed"

    def __init__(self, config):
        super().__init__(config)
        from sglang.srt.mem_cache.evict_policy import MRUStrategy
        self.tree.eviction_strategy = MRUStrategy()


def _dec_lock_ref_one_short(tree, node, params=None):
    """RadixCache.dec_lock_ref (radix_cache.py:597-616) with its walk's bound off by one: it
    stops below the root's child, which keeps the lock it was given."""
    from sglang.srt.mem_cache.base_prefix_cache import DecLockRefResult
    delta = 0
    while node is not tree.root_node and node.parent is not tree.root_node:
        if node.lock_ref == 1:
            tree.evictable_size_ += len(node.key)
            tree.protected_size_ -= len(node.key)
            delta += len(node.key)
        node.lock_ref -= 1
        tree._update_leaf_status(node)
        node = node.parent
    return DecLockRefResult(delta=delta)


class SglangRadixLockOneShort(SglangRadix):
    name = "sglang-fault-lock-one-short"

    def __init__(self, config):
        super().__init__(config)
        self.tree.dec_lock_ref = types.MethodType(_dec_lock_ref_one_short, self.tree)


def _split_node_stale_hashes(tree, key, child, split_len):
    """RadixCache._split_node (radix_cache.py:677-700) whose lower node keeps the page hashes of
    the whole node it was (``split_node_hash_value`` not applied to it): its BlockRemoved, at
    its eviction, names the upper node's pages."""
    hashes, event_hashes = child.hash_value, child.event_hash_value
    upper = type(tree)._split_node(tree, key, child, split_len)
    child.hash_value, child.event_hash_value = hashes, event_hashes
    return upper


class SglangRadixSplitStaleHashes(SglangRadix):
    """A KV-event bug: the index is told the wrong pages are gone (SPEC §14's residency)."""

    name = "sglang-fault-split-stale-hashes"

    def __init__(self, config):
        super().__init__(config)
        self.tree._split_node = types.MethodType(_split_node_stale_hashes, self.tree)


# --- SGLang's UnifiedRadixCache components: SWA mappings, the decode-side window, Mamba headroom
# (each caught by sglang_components.replay on a committed workload; docs/engines.md's bug table
# names the step, tests/engines/test_sglang_components.py asserts it)

def _recover_through_free_swa(comp, *, node, incoming_full, start, end, result, cache_actions):
    """SWAComponent._recover_from_incoming before PR #27586: the tombstone's old base freed
    through free_swa (FreeDeviceKV: free_swa, then free_full), its stale mapping not cleared."""
    from sglang.srt.mem_cache.unified_cache.cache_action import (FreeDeviceKV,
                                                                 RecoverSWAWithLockedFull)
    from sglang.srt.mem_cache.unified_cache.component_type import BASE_COMPONENT_TYPE
    full_cd = node.component_data[BASE_COMPONENT_TYPE]
    old_full = full_cd.value
    if full_cd.lock_ref > 0:
        cache_actions.append(RecoverSWAWithLockedFull(node.id, old_full, incoming_full))
        return
    result.record_adopted_range(BASE_COMPONENT_TYPE, start, end)
    full_cd.value = incoming_full.clone()
    cache_actions.append(FreeDeviceKV([old_full]))
    comp._publish_window(node=node, cache_actions=cache_actions)


class SwaStaleMappingFreed(SwaTree):
    """SGLang PR #27586 reverted. Its two halves: a tombstone's full-to-SWA mapping left stale
    (planted: 0.5.23's SWA eviction clears it; here ``FreeComponentDeviceSlot`` frees the SWA
    slots and puts the mapping back), and the insert-overlap recovery freeing the tombstone's
    old base through ``free_swa``, which reads that mapping and frees a SWA slot the tombstone
    no longer owns (free already, or lent since to a live request)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        from sglang.srt.mem_cache.unified_cache.cache_action import FreeComponentDeviceSlot
        comp, alloc = self.component, self.alloc
        apply = comp.apply_component_action

        def apply_component_action(action):
            if not isinstance(action, FreeComponentDeviceSlot):
                return apply(action)
            kept = [(full, alloc.full_to_swa_index_mapping[full].clone()) for full in action.indices]
            apply(action)
            for full, swa in kept:  # the mapping left pointing at the freed slots
                alloc.full_to_swa_index_mapping[full] = swa

        comp.apply_component_action = apply_component_action
        comp._recover_from_incoming = types.MethodType(_recover_through_free_swa, comp)


class SwaWindowFloorDropped(SwaTree):
    """SGLang PR #27770's decode-side radix for SWA hybrids, planted without the window's floor:
    the request's out-of-window SWA slots are freed as it decodes (``free_swa_out_of_window_
    slots``), but ``cache_finished_req`` inserts without ``swa_evicted_seqlen``, so the tree
    takes those freed slots as live SWA: at idle, SWA's available + evictable exceeds its pool
    (planted: 0.5.23 carries the floor into ``InsertParams``)."""

    def _insert_params(self, r):
        params = super()._insert_params(r)
        params.set_evicted_seqlen(self._v.s.ComponentType.SWA, 0)
        return params


class MambaNoCheckpointHeadroom(MambaTree):
    """SGLang PR #33773 reverted: admission makes room for the request's active Mamba state
    only (what ``ensure_mamba_capacity`` counts), none for the checkpoint
    ``cache_unfinished_req`` donates to the tree, so ``MambaComponent._alloc_mamba_slot``
    finds no free slot and, with every cached state locked by running requests, nothing to
    evict ("Can not alloc mamba cache")."""

    state_headroom = 1


class VllmFailedLoadHitKept(VllmOffload):
    """vLLM issue #49176 with PR #49328's fix reverted, in vLLM's own file tier
    (``FileSystemTierManager``): after a failed load its ``get_finished_jobs`` no longer marks
    the failed blocks' cached lookup verdicts a miss (``AsyncLookupManager.mark_miss`` does
    nothing), so the request's next lookup still finds the blocks whose files the short read
    removed, and the hit is served again."""

    def _make_tier(self, spec, storage):
        tier = super()._make_tier(spec, storage)
        lookups = getattr(tier.manager, "_lookup_manager", None)
        if lookups is not None:  # a file tier
            lookups.mark_miss = lambda keys: None
        return tier
