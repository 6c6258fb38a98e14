"""SGLang's radix trees and token allocator behind the kvbench protocol: ledger, KV events and
(``RadixCache``) block structures.

Which tree: SGLang's server builds its tree cache in ``mem_cache/registry.py``
(``create_tree_cache``: with ``--radix-cache-backend`` unset, ``default_radix_cache_factory``, which
for a full-attention model without LMCache, FlexKV or an external linker ends in
``create_unified_radix_cache``: ``UnifiedRadixCache`` with the one component ``FULL``, its tree core
the Rust one, ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``'s default) under
``--radix-eviction-policy``, default ``lru`` (``arg_groups/fields/memory.py``). That is ``sglang``,
the serving default. ``RadixCache``, which the server builds only for its simulated waiting queue
(``RadixCache.create_simulated``), and the other policies are separate backends, each naming how
it departs from the serving default (``serving_departures``, shown by ``kvbench list`` and
written in every record).

Opt-in: SGLang is not a dependency of kvbench (docs/engines.md has the recipe). The module imports without
SGLang; :meth:`SglangRadix.available` says why it cannot run.

What is SGLang's (0.5.23), called as its scheduler calls it:

- the pool: ``TokenToKVPoolAllocator`` (page size 1) or ``PagedTokenToKVPoolAllocator`` (page
  size = kvbench's block size), on the CPU, with no K/V tensors behind it (``kvcache=None``);
- allocation through ``sglang.srt.mem_cache.allocation`` (``alloc_token_slots``,
  ``alloc_paged_token_slots_extend`` / ``_decode``), which first evict from the tree what the
  allocation may need (``evict_from_tree_cache``);
- the tree: ``RadixCache`` (what ``RadixCache.create_simulated`` builds, with the eviction policy
  given), its ``match_prefix`` (keys capped at ``T - 1`` tokens as ``Req._compute_max_prefix_len``
  does), ``insert``, ``lock`` / ``unlock`` (``inc_lock_ref`` / ``dec_lock_ref``) and ``evict``,
  and its own figures ``evictable_size`` / ``protected_size``.

What is the adapter's (the scheduler's glue, each step cited):

- token ids for the trace: a hashed block's ids are a function of its hash, every other token new;
- admission: a call is refused (out of memory) when SGLang's own figures, ``available_size() +
  evictable_size()``, do not cover the pages it needs; that is the bound SGLang's ``PrefillAdder``
  admits against (it also reserves room for the running requests' future tokens, which a trace
  replay does not need), so SGLang's allocator never fails mid-call;
- ``_checkpoint``: ``RadixCache.checkpoint`` for a request (``_insert_cache``: insert the
  page-aligned tokens, free the duplicates the tree already had, point the request at the
  tree's copy, move the lock), written against the public tree API because SGLang's needs a
  scheduler ``Req`` and ``ReqToTokenPool``; run after a prefill (``checkpoint_kv_cache`` after
  each extend) and at free (``release_kv_cache(checkpoint=True)``, which then frees the
  unaligned tail and unlocks);
- fork: SGLang has none. Parallel sampling is served as new requests whose prompt is the
  parent's tokens, found in the tree: the parent is checkpointed first (what SGLang does after
  each extend), then the child is admitted like a prompt. Declared ``fork_via="prefix"``.

With ``prefix_caching`` off the tree is built ``disable=True`` (matches, inserts and evictions do
nothing), and a fork computes every block again (``fork_via="copy"``).

Over 500 lines: one adapter, the scheduler's glue its eight backends share (the tree class and
its policy are all that differ), with SGLang's rules cited beside the calls that follow them.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import types

import numpy as np

from impls.engines.block_tally import BlockTally
from impls.engines.sglang_events import kv_events
from kvbench.contract import formulas as F
from kvbench.contract.protocol import Backend, BlockState, Capabilities, CacheConfig, Ledger, OutOfMemory

NOT_INSTALLED = "sglang is not installed: its opt-in recipe is in docs/engines.md"
VERSION = "0.5.23"

# SGLang's rules that differ from SPEC's, each read off 0.5.23's source (sglang/srt/mem_cache/):
# - evicts_whole_leaves: RadixCache.evict (radix_cache.py:552-577) pops whole unlocked leaves off a
#   heap of get_priority (evict_policy.py) and frees each leaf's whole value, pushing its parent
#   once childless, until num_evicted >= num_tokens; nodes are split where match_prefix
#   (_match_prefix_helper, :651-675) or insert (_insert_helper, :705-760) end inside one.
#   UnifiedRadixCache walks the same tree in its Rust core (evict_device_next_node,
#   unified_radix_cache.py:869).
# - leaf_order: the heap's key, --radix-eviction-policy (lru: last_access_time, set by every match
#   and insert that walks the node, evict_policy.py:16-18).
# - eviction_demand page_per_request: allocation.py:186-201 ("Over estimate the number of tokens:
#   assume each request needs a new page": extend_num_tokens + len(seq_lens) * page_size) and
#   :583-585 (decode: len(seq_lens) * page_size); evict_to_free_tokens (allocator/base.py:166-168)
#   evicts that minus available_size() before allocating; page size 1 allocates exactly
#   (alloc_token_slots, allocation.py:152-157).
# - capped_hit_recomputed: the hit is capped at T - 1 tokens (Req._compute_max_prefix_len,
#   managers/schedule_batch.py:1766-1768), the allocation takes pages for everything past it, and
#   the checkpoint's insert frees the pages the tree already had (RadixCache._insert_cache,
#   radix_cache.py:451-510; the unified insert's prev_prefix_len), so a page-aligned prompt, or a
#   fork, needs a free page for its last page although the tree holds it.
# - events_from_tree: the tree announces a page when an insert makes its node (_insert_helper's
#   record_store, radix_cache.py:758: one BlockStored per page, events.py:213-271, the first
#   page's parent the parent node's last page hash, None under the root, events.py:180-198); an
#   insert runs at a checkpoint (after a prefill, at a fork's parent, at free), so a page a decode
#   fills is announced at its request's free. evict announces each leaf whole (record_remove,
#   radix_cache.py:577, events.py:273-308); _split_node (:677-700) and inc / dec_lock_ref
#   (:582-616) announce nothing; reset (:343-362) announces AllBlocksCleared when the tree is
#   built. The Rust core's events are the same (rust_tree_core/adapter.py:103-153).
CAPABILITIES = Capabilities(layout="paged", holds_kv=False, fork=True, copy_on_write=True,
                            prefix_caching=True, eviction=(),
                            cache_salt=True,
                            # hit_leaves_last_token, caches_every_full_block, evicts_whole_leaves,
                            # eviction_demand="page_per_request", capped_hit_recomputed,
                            # events_from_tree: the
                            # sglang rule set's defaults (kvbench/model/rules/sglang.py)
                            rules="sglang")


def _torchvision_importable() -> None:
    """SGLang's ``mem_cache`` imports ``sglang.srt.configs``, whose ``__init__`` imports every model
    config; InternVL's imports ``torchvision.transforms``. PyPI's torchvision wheels are CUDA
    builds: on a CPU torch their C++ ops fail to load (torchvision guards that), and torchvision
    0.28 then stops at two fake-kernel registrations it does not guard (``nms``, ``qnms``).
    Declaring those two schemas lets torchvision's Python part import; neither op is ever run."""
    import torch

    try:
        import torchvision  # noqa: F401
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        for op in ("nms", "qnms"):
            if not hasattr(torch.ops.torchvision, op):
                torch.library.define(f"torchvision::{op}",
                                     "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision  # noqa: F401,F811


@functools.lru_cache(maxsize=1)
def _sglang():
    """SGLang's allocator, tree and allocation modules, imported once."""
    import importlib.metadata
    import logging
    import warnings
    from array import array

    import importlib.util

    if importlib.util.find_spec("sglang") is None:  # "not installed" names sglang itself
        raise ImportError("No module named 'sglang'", name="sglang")
    _torchvision_importable()  # before anything of SGLang's: its __init__ imports it already
    import torch

    with warnings.catch_warnings():  # "Only CUDA ... support AWQ/GGUF": this is a CPU
        warnings.simplefilter("ignore")
        from sglang.srt.mem_cache import allocation
        from sglang.srt.mem_cache.allocator import (PagedTokenToKVPoolAllocator,
                                                    TokenToKVPoolAllocator)
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.events import KvEventLoraNames
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    logging.getLogger("sglang").setLevel(logging.ERROR)
    return types.SimpleNamespace(
        torch=torch, array=array, allocation=allocation, RadixCache=RadixCache, RadixKey=RadixKey,
        UnifiedRadixCache=UnifiedRadixCache, ComponentType=ComponentType,
        CacheInitParams=CacheInitParams, InsertParams=InsertParams, KvEventLoraNames=KvEventLoraNames,
        MatchPrefixParams=MatchPrefixParams, TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
        version=importlib.metadata.version("sglang"))


def available() -> tuple[bool, str]:
    try:
        _sglang()
    except ImportError as e:
        if e.name == "sglang":
            return False, NOT_INSTALLED
        return False, f"sglang cannot be imported ({type(e).__name__}: {e}): its opt-in recipe is in docs/engines.md"
    except Exception as e:  # a broken install fails in odd ways
        return False, f"sglang cannot be imported ({type(e).__name__}: {e}): its opt-in recipe is in docs/engines.md"
    return True, ""


@dataclasses.dataclass
class _Req:
    """The scheduler's view of one request: its token ids and KV slots (SGLang's ``Req`` and
    its ``req_to_token`` row), how much of it the tree owns, and its lock on the tree."""

    ids: object  # array('q')
    kv: object  # int64 tensor, one slot per token
    prompt: int  # origin_input_ids length
    final: int
    lock: object = None
    protected: int = 0  # cache_protected_len: the tree-owned prefix
    inserted: int = 0  # cache_inserted_len
    adapter: str | None = None  # Req.extra_key (its LoRA): a namespace of the tree
    salt: str | None = None  # Req.cache_salt: another namespace

    def key(self, n: int, **kw):
        """``RadixKey`` of the first ``n`` token ids, in this request's namespaces."""
        return _sglang().RadixKey(self.ids[:n], extra_key=self.adapter, cache_salt=self.salt, **kw)


SERVING_POLICY = "lru"  # --radix-eviction-policy's default
SERVER_POLICIES = ("lru", "lfu", "slru", "priority", "tlru")  # its choices (arg_groups/choices.py)


class SglangRadix(Backend):
    """SGLang's ``RadixCache``: not what its server serves with (see the module's docstring)."""

    name = "sglang-radix"
    capabilities = CAPABILITIES
    radix_policy = "lru"  # SGLang's --radix-eviction-policy (which cached leaf goes first)
    unified = False  # True: UnifiedRadixCache, the class SGLang's server picks
    # No kvbench eviction policy: SGLang's tree evicts cached, unlocked prefixes only; running
    # requests are retracted by its scheduler, so a config with a policy is reported n/a.

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return available()

    def __init__(self, config: CacheConfig):
        super().__init__(config)
        ok, why = self.available()
        if not ok:
            raise RuntimeError(f"{self.name}: {why}")
        s = self._s = _sglang()
        self.page = P = config.block_size
        self.caching = bool(config.prefix_caching)
        self.capabilities = dataclasses.replace(CAPABILITIES, rule_params={
            "leaf_order": self.radix_policy, "fork_via": "prefix" if self.caching else "copy"})
        size = config.num_blocks * P
        if P == 1:
            self.alloc = s.TokenToKVPoolAllocator(size=size, dtype=s.torch.float16, device="cpu",
                                                  kvcache=None, need_sort=False)
        else:
            self.alloc = s.PagedTokenToKVPoolAllocator(size=size, page_size=P, dtype=s.torch.float16,
                                                       device="cpu", kvcache=None, need_sort=False)
        # KV events on (SGLang's --kv-events-config; they change nothing the tree does), with the
        # table of LoRA names the scheduler keeps for them (see events()).
        self.lora_names = s.KvEventLoraNames()
        self.tree = self._make_tree(s.CacheInitParams(
            disable=not self.caching, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc,
            page_size=P, eviction_policy=self.radix_policy, enable_kv_cache_events=self.caching,
            kv_event_lora_names=self.lora_names))
        self.reqs: dict[int, _Req] = {}
        self._ids = itertools.count(1 << 48)  # token ids made up here: above any a trace gives
        self._hash_ids: dict = {}
        self.hit_blocks = 0
        # Only the requests an operation names change their tables (an eviction takes unlocked
        # tree nodes, which no table holds), so the ledger recounts their pages alone; SGLang
        # counts no holders per page (its tree locks nodes): the tally counts the tables' entries.
        self.tally = BlockTally(P, 1, self._tables_of, self._reservation_of)

    @classmethod
    def serving_departures(cls) -> tuple:
        """How this backend departs from SGLang's serving default, one setting each."""
        out = []
        if not cls.unified:
            out.append("tree RadixCache (SGLang serves with UnifiedRadixCache)")
        if cls.radix_policy not in SERVER_POLICIES:
            out.append(f"eviction policy {cls.radix_policy} (not a --radix-eviction-policy choice: "
                       f"built in Python only; the server's default is {SERVING_POLICY})")
        elif cls.radix_policy != SERVING_POLICY:
            out.append(f"--radix-eviction-policy {cls.radix_policy} (default {SERVING_POLICY})")
        return tuple(out)

    def _make_tree(self, params):
        """The tree cache, as ``create_unified_radix_cache`` builds it (``unified``) or the
        plain ``RadixCache``."""
        s = self._s
        if self.unified:
            params.tree_components = (s.ComponentType.FULL,)
            return s.UnifiedRadixCache(params)
        return s.RadixCache(params)

    # --- helpers ---------------------------------------------------------------------------

    def _req(self, seq) -> _Req:
        try:
            return self.reqs[seq]
        except KeyError:
            raise KeyError(f"{self.name}: unknown sequence {seq}") from None

    def _new_ids(self, n: int) -> list:
        return [next(self._ids) for _ in range(n)]

    def _t(self, *values):
        return self._s.torch.tensor(values, dtype=self._s.torch.int64)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page)

    def _room(self) -> int:
        """Tokens an allocation can get: free, or held only by the tree and unlocked."""
        return self.alloc.available_size() + self.tree.evictable_size()

    def _refuse(self, what: str, pages: int) -> None:
        room = self._room() // self.page
        if pages > room:
            raise OutOfMemory(f"{self.name}: {what} needs {pages} pages, "
                              f"{room} free or evictable")

    def _extend(self, reqs, new_tokens, decode: bool = False) -> list:
        """SGLang's allocation for a batch: a decode step (one token each) or an extend."""
        s, torch = self._s, self._s.torch
        lens = [len(r.kv) for r in reqs]
        if self.page == 1:
            out = s.allocation.alloc_token_slots(self.tree, sum(new_tokens))
        elif decode and all(n == 1 for n in new_tokens):
            seq_lens = self._t(*(n + 1 for n in lens))
            out = s.allocation.alloc_paged_token_slots_decode(
                self.tree, seq_lens, seq_lens, self._t(*(int(r.kv[-1]) for r in reqs)))
        else:
            prefix, seq_lens = self._t(*lens), self._t(*(n + d for n, d in zip(lens, new_tokens)))
            last = self._t(*(int(r.kv[-1]) if len(r.kv) else -1 for r in reqs))
            out = s.allocation.alloc_paged_token_slots_extend(
                self.tree, prefix, prefix, seq_lens, seq_lens, last, sum(new_tokens))
        parts, at = [], 0
        for n in new_tokens:
            parts.append(out[at:at + n])
            at += n
        for r, part in zip(reqs, parts):
            r.kv = torch.cat((r.kv, part))
        return parts

    def _checkpoint(self, r: _Req) -> None:
        """SGLang's RadixCache.checkpoint (radix_cache.py, ``_insert_cache`` and ``checkpoint``)."""
        s = self._s
        key = r.key(len(r.kv)).page_aligned(self.page)
        n = len(key)
        result = self.tree.insert(s.InsertParams(key=key, value=r.kv[:n].clone(),
                                                 inserted_len=r.inserted, priority=0))
        r.inserted = max(r.inserted, n)
        prompt_key = r.key(r.prompt).page_aligned(self.page)
        if 0 < len(prompt_key) < n:  # split at the prompt so the output can go on its own
            self.tree.insert(s.InsertParams(key=prompt_key, value=r.kv[:len(prompt_key)].clone(),
                                            inserted_len=len(prompt_key), priority=1))
        # The tree already held [protected, prefix_len): this request's copies are duplicates.
        self.alloc.free_segment(r.kv[r.protected:result.prefix_len], start_pos=r.protected)
        node = self.tree.match_prefix(s.MatchPrefixParams(key=key)).last_device_node
        tree_kv = self.tree.path_device_indices(node)
        assert len(tree_kv) == n, (len(tree_kv), n)
        r.kv[r.protected:n] = tree_kv[r.protected:]
        r.protected = n
        self.tree.unlock(r.lock)
        r.lock = self.tree.lock(node)

    def _admit(self, seq, ids: list, prompt: int, final: int, what: str, adapter=None, salt=None) -> int:
        """A new request with these token ids (in the namespaces of ``adapter`` and ``salt``):
        match, lock, allocate, checkpoint. Hit tokens."""
        s = self._s
        ids = s.array("q", ids)
        T = len(ids)
        if adapter is not None:  # Scheduler._record_kv_event_lora_name (scheduler.py:2889-2896)
            self.lora_names.register(types.SimpleNamespace(extra_key=adapter, lora_id=adapter), adapter)
        probe = _Req(ids=ids, kv=None, prompt=prompt, final=final, adapter=adapter, salt=salt)
        # Req._compute_max_prefix_len: at most T - 1 tokens, for the last token's logits.
        match = self.tree.match_prefix(s.MatchPrefixParams(key=probe.key(T, limit=max(0, T - 1))))
        hit = match.device_prefix_len
        lock = self.tree.lock(match.last_device_node)  # PrefillAdder: the hit stays put
        try:
            self._refuse(what, self._pages(T) - hit // self.page)
        except OutOfMemory:
            self.tree.unlock(lock)
            raise
        r = dataclasses.replace(probe, kv=self.tree.path_device_indices(match.last_device_node)[:hit].clone(),
                                lock=lock, protected=hit)
        if T > hit:
            self._extend([r], [T - hit])
        if self.caching:
            self._checkpoint(r)
        self.reqs[seq] = r
        return hit

    # --- the protocol ----------------------------------------------------------------------

    def prefill(self, seq, prompt, kv=None, *, step=0, protect=()):
        tokens, token_ids = prompt.tokens, prompt.token_ids
        self.tally.touch(seq)
        if seq in self.reqs:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        if tokens < 0:
            raise ValueError(f"{self.name}: prefill of sequence {seq} with {tokens} tokens")
        P = self.page
        if token_ids is not None and self.caching:  # SGLang keys its tree on the tokens themselves
            ids = [int(t) for t in token_ids[:tokens]]
        else:
            ids = []
            for h in tuple(prompt.block_hashes or ())[:tokens // P] if self.caching else ():
                if h not in self._hash_ids:
                    self._hash_ids[h] = self._new_ids(P)
                ids += self._hash_ids[h]
        ids += self._new_ids(tokens - len(ids))
        final = prompt.final_tokens if prompt.final_tokens is not None else tokens
        hit = self._admit(seq, ids, tokens, final, f"prefill of sequence {seq} ({tokens} tokens)",
                          prompt.adapter, prompt.salt)
        self.hit_blocks += hit // P
        return ()

    def append(self, seqs, tokens, kv=None, *, step=0):
        seqs, tokens = list(seqs), list(tokens)
        self.tally.touch(*seqs)
        reqs = [self._req(s) for s in seqs]
        pages = sum(self._pages(len(r.kv) + d) - self._pages(len(r.kv)) for r, d in zip(reqs, tokens))
        self._refuse(f"append of {tokens} tokens to sequences {seqs}", pages)
        grow = [(r, d) for r, d in zip(reqs, tokens) if d > 0]
        if grow:
            self._extend([r for r, _ in grow], [d for _, d in grow], decode=True)
            for r, d in grow:
                r.ids.extend(self._new_ids(d))
        return ()

    def fork(self, seq, src, *, final_tokens=None, step=0):
        self.tally.touch(seq, src)  # the parent's checkpoint repoints its table
        if seq in self.reqs:
            raise ValueError(f"{self.name}: sequence {seq} already exists")
        parent = self._req(src)
        if self.caching:
            self._checkpoint(parent)  # the child finds the parent's tokens in the tree
        T = len(parent.kv)
        final = final_tokens if final_tokens is not None else T
        self._admit(seq, list(parent.ids[:T]), T, final,
                    f"fork of sequence {src} into {seq} ({T} tokens)", parent.adapter, parent.salt)
        return ()

    def free(self, seq, *, step=0):
        self.tally.touch(seq)
        r = self._req(seq)
        if self.caching:
            self._checkpoint(r)
        # release_kv_cache: what the tree does not own (the unaligned tail), then the lock.
        if len(r.kv) > r.protected:
            self.alloc.free_segment(r.kv[r.protected:], start_pos=r.protected)
        self.tree.unlock(r.lock)
        del self.reqs[seq]

    def events(self) -> list:
        """SPEC §14: SGLang's own KV events (``take_events``, base_prefix_cache.py:673; the Rust
        core's through its adapter), read by impls/engines/sglang_events.py. How they differ from
        SPEC's is the sglang rule set's ``events_from_tree``."""
        return kv_events(self.tree)

    def figures(self) -> dict:
        """SGLang's own account, in tokens: free, evictable and protected, and the pool's size."""
        return {"available": self.alloc.available_size(), "evictable": self.tree.evictable_size(),
                "protected": self.tree.protected_size(), "pool": self.alloc.size}

    def table(self, seq) -> list:
        """The sequence's pages, in order."""
        return [x // self.page for x in self._req(seq).kv[::self.page].tolist()]

    def block_state(self, seqs=None) -> BlockState:
        """SGLang's own structures, as ``RadixCache`` keeps them (block ``b`` is SGLang's page
        ``b + 1``: slot 0 is its padding, ``clear``): the allocator's free pages
        (``get_all_free_pages``); the evictable pages in the order its eviction takes them
        (``evict``, radix_cache.py:552-577: a heap of ``evictable_leaves`` by the policy's
        ``get_priority``, a parent pushed once childless and unlocked), here run to the end on
        a copy of the counts, the tree untouched; each tree page's references its node's
        ``lock_ref`` (a request's lock counts on every node of its path, ``inc_lock_ref``
        :582-595), a page a request holds outside the tree (past its ``cache_protected_len``) 1.
        ``UnifiedRadixCache``'s Rust core exposes neither its nodes nor its locks
        (``node_by_id`` raises NotImplementedError in 0.5.23): the serving tree has none."""
        if self.unified:
            raise NotImplementedError(f"{self.name}: SGLang's Rust tree core exposes no nodes")
        P, tree = self.page, self.tree
        # Through NumPy (the tensors' own memory): a torch op per node costs ten times more.
        page = lambda value: value.numpy()[::P] // P - 1  # noqa: E731
        ref = np.zeros(self.config.num_blocks, dtype=np.int64)
        todo = [tree.root_node]
        while todo:
            for child in todo.pop().children.values():
                ref[page(child.value)] = child.lock_ref
                todo.append(child)
        for r in self.reqs.values():
            ref[page(r.kv[r.protected:])] += 1
        heap = [(tree.eviction_strategy.get_priority(n), n) for n in tree.evictable_leaves]
        heapq.heapify(heap)
        cached, left = [], {}
        while heap:
            _, leaf = heapq.heappop(heap)
            cached.append(page(leaf.value))
            parent = leaf.parent
            left[parent] = left.get(parent, len(parent.children)) - 1
            if not left[parent] and parent.lock_ref == 0:
                heapq.heappush(heap, (tree.eviction_strategy.get_priority(parent), parent))
        live = self.reqs if seqs is None else [s for s in seqs if s in self.reqs]
        cached = np.concatenate(cached) if cached else np.zeros(0, np.int64)
        return BlockState(free=(self.alloc.get_all_free_pages() - 1).numpy(), cached=cached,
                          refcount=ref, tables={s: [page(self.reqs[s].kv)] for s in live})

    def _tables_of(self, seq):
        """The tally's view of ``seq``: its one table of pages and its tokens; None once gone."""
        if seq not in self.reqs:
            return None
        return [self.tally.uncounted(self.table(seq))], len(self.reqs[seq].kv)

    def _reservation_of(self, seq) -> tuple:
        """SPEC §10's reservation of ``seq``: the free slots of its tail page, when no other
        table holds that page, that its later tokens will use; and the page it read."""
        r, P = self.reqs[seq], self.page
        n = len(r.kv)
        if not n % P:
            return 0, ()
        tail = int(r.kv[(n - 1) // P * P]) // P
        own = self.tally.group_refs[0].get(tail, 0) == 1
        return (F.tail_reservation(P - n % P, r.final - n) if own else 0), (tail,)

    def ledger(self, seqs=None) -> Ledger:
        """From the tally (the pages of the tables operations changed) and SGLang's figures."""
        tally, P, f = self.tally, self.page, self.figures()
        tally.sync()
        live = self.reqs if seqs is None else [s for s in seqs if s in self.reqs]
        return Ledger.paged(
            num_blocks=self.config.num_blocks, block_size=P,
            block_bytes=P * self.config.model.bytes_per_token,
            blocks_used=tally.used, blocks_free=(f["available"] + f["evictable"]) // P,
            tokens={s: len(self.reqs[s].kv) for s in live},
            seq_blocks={s: self._pages(len(self.reqs[s].kv)) for s in live},
            token_states=tally.token_states, reservation=tally.reservation,
            shared_blocks=tally.shared, cached_blocks=f["evictable"] // P,
            prefix_hit_blocks=self.hit_blocks, self_report={})


class SglangRadixLFU(SglangRadix):
    """SGLang's ``RadixCache`` under its ``lfu`` radix policy: hit count, then last access."""

    name = "sglang-radix-lfu"
    radix_policy = "lfu"


class Sglang(SglangRadix):
    """SGLang's serving default: ``UnifiedRadixCache`` (Rust tree core), policy ``lru``."""

    name = "sglang"
    unified = True

    def _checkpoint(self, r: _Req) -> None:
        """``UnifiedRadixCache.checkpoint_into_tree`` for a full-attention request: its insert
        frees the duplicates itself (``prev_prefix_len``: what the request's lock already
        protects), then the prompt split, the repoint and the lock moved."""
        s = self._s
        key = r.key(len(r.kv)).page_aligned(self.page)
        n = len(key)
        values = r.kv[:n].clone()
        params = s.InsertParams(key=key, value=values, prev_prefix_len=r.protected,
                                inserted_len=r.inserted, priority=0)
        result = self.tree.insert(params)
        r.inserted = max(r.inserted, n)
        prompt_key = r.key(r.prompt).page_aligned(self.page)
        if 0 < len(prompt_key) < n:
            m = len(prompt_key)
            self.tree.insert(dataclasses.replace(params, key=prompt_key, value=values[:m],
                                                 prev_prefix_len=m, inserted_len=m, priority=1))
        tree_kv = self.tree.path_device_indices(result.last_device_node)
        assert len(tree_kv) == n, (len(tree_kv), n)
        r.kv[r.protected:n] = tree_kv[r.protected:]
        r.protected = n
        self.tree.unlock(r.lock)
        r.lock = self.tree.lock(result.last_device_node)


# The other policies get_eviction_strategy builds (mem_cache/utils.py). The server's
# --radix-eviction-policy takes lru, lfu, slru, priority and tlru; fifo and mru are reachable only
# by building the cache in Python. tlru is left out: the server refuses it without its
# threshold and next_prompt_estimate (arg_groups/kv_cache_hook.py), which have no default.
class SglangLFU(Sglang):
    name, radix_policy = "sglang-lfu", "lfu"


class SglangSLRU(Sglang):
    name, radix_policy = "sglang-slru", "slru"


class SglangPriority(Sglang):
    name, radix_policy = "sglang-priority", "priority"


class SglangFIFO(Sglang):
    name, radix_policy = "sglang-fifo", "fifo"


class SglangMRU(Sglang):
    name, radix_policy = "sglang-mru", "mru"
