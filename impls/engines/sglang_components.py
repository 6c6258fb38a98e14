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

- per component, SPEC §10: evictable + protected + free + what running requests hold outside the
  tree = the component's pool (the tree's ``full_/swa_/mamba_evictable_size`` and
  ``_protected_size``, the allocator's free slots, and SGLang's "uncached": a request's KV past
  ``cache_protected_len``, less the SWA slots its window has left, and its active Mamba state);
- per component, the lock balance: no ``lock_ref`` below 0, and with no request running none
  above 0, on the paths each step locked or unlocked; over every node (after each step of a
  hand trace, at the end of a replay) the protected size is the value length of the nodes whose
  ``lock_ref`` is positive, the evictable size that of the unlocked ones.

Everything is SGLang's: the pools and the allocator are built as SGLang's own CPU tests build them
(``test_unified_radix_cache.py``'s ``build_fixture``, page size 1, the SWA pool 0.8 of the full
one as the server sizes it: ``SWAKVPool`` and
``SWATokenToKVPoolAllocator`` with a ``ReqToTokenPool``; or ``HybridReqToTokenPool`` with its
``MambaPool``, ``HybridLinearKVPool`` and a ``TokenToKVPoolAllocator``), the tree with the
component set ``create_unified_radix_cache`` gives such a model. A request runs as the scheduler
runs one: admitted (``match_prefix``, the rest allocated after an eviction of each pool's
shortfall, ``evict_to_free_tokens``; on a
Mamba model room for its active state and the checkpoint, else refused), its prompt inserted
(``cache_unfinished_req``: a Mamba checkpoint from ``MambaComponent._alloc_mamba_slot``) and its
node locked; decoded (``extend``: the window's old SWA slots freed as
``free_swa_out_of_window_slots`` frees them, ``release_swa`` once the window has passed the
prompt); finished (``cache_finished_req``: the whole sequence inserted with its window's floor,
the Mamba active state donated; ``unlock``). ``replay`` runs a committed trace through a tree.
The Mamba component reads its caching granularity from the model
config (``mamba_cache_chunk_size``); with no model here it is set to FLA's chunk of 64, the value a
model config without ``mamba_chunk_size`` gives. The tree core is SGLang's Python ``UnifiedTreeCore`` (``"python"``, one of
the two it registers; the server picks the Rust one where it can): its component code is Python,
so a fault can be planted in it (impls/engines/faults_engines.py). ``campaign`` runs kvbench
fuzz's seeded histories through the trees, checked the same way: the components are no kvbench
backend (docs/engines.md says why), so ``kvbench fuzz`` cannot drive them.

Over 500 lines: one adapter, the scheduler's glue for both component sets, with the two ways
traces reach it (a committed trace, a seeded campaign) beside the checks they share.
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


class _Request:
    """What the scheduler's ``Req`` holds for the tree: its tokens, its KV row (full indices),
    its lock, ``cache_protected_len`` (the tokens the tree holds for it), the SWA eviction
    cursor (``swa_evicted_seqlen``) and, on a Mamba model, its active state slot."""

    def __init__(self, tokens, kv, lock, protected, active, extra):
        self.tokens, self.kv, self.lock, self.protected = tokens, kv, lock, protected
        self.evicted = 0
        self.active = active
        self.extra = extra


class ComponentTree:
    """``UnifiedRadixCache(FULL, SWA)`` (``window`` tokens) or ``(FULL, MAMBA)`` (``mamba``
    state slots) over a token pool of ``size`` slots (page size 1); requests by id."""

    # Mamba state slots admission makes room for: the request's active state and the
    # checkpoint cache_unfinished_req donates to the tree (SGLang PR #33773's headroom).
    state_headroom = 2
    # SWA slots per full slot: --swa-full-tokens-ratio's fallback (arg_groups/fields/schedule.py),
    # the SWA pool int(full * ratio) tokens (model_executor/pool_configurator.py's _solve_pool_sizes)
    swa_full_tokens_ratio = 0.8

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
            self.size_swa = int(size * self.swa_full_tokens_ratio)
            kv = v.SWAKVPool(size=size, size_swa=self.size_swa, page_size=1, dtype=torch.bfloat16,
                             head_num=1, head_dim=4, swa_attention_layer_ids=list(layers),
                             full_attention_layer_ids=list(full_layers), device="cpu")
            self.alloc = v.SWATokenToKVPoolAllocator(size=size, size_swa=self.size_swa, page_size=1,
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
        self.component = self.tree.tree_core.components_by_type[self.second]
        self.second_name = str(self.second)  # "swa" or "mamba"
        self.reqs: dict = {}  # request id -> _Request
        self.touched: list = []  # the nodes locked or unlocked since the last check
        # what running requests hold outside the tree, per component, kept as each step changes
        # it (held()): a sum over the running requests at every check would follow how many run
        self._held = {"full": 0, "swa": 0, "mamba": 0}
        self.hits = 0
        self._fresh = 1 << 40  # token ids for decoded tokens, unique per request

    @property
    def locks(self) -> dict:
        return {rid: r.lock for rid, r in self.reqs.items()}

    def _free_tokens(self) -> int:
        a = self.alloc
        if self.states is None:
            return min(a.full_available_size(), a.swa_available_size())
        return a.available_size()

    def _key(self, tokens, extra=None):
        s = self._v.s
        return s.RadixKey(s.array("q", tokens), extra_key=extra)

    def _make_room(self, need: int, states: int = 0) -> None:
        """Evict the shortfall of ``need`` token slots (and ``states`` Mamba slots) from the tree,
        as the allocator's ``evict_to_free_tokens`` and ``ensure_mamba_capacity`` do."""
        v = self._v
        if self.states is None:  # each pool's own shortfall (SWATokenToKVPoolAllocator's)
            self.alloc.evict_to_free_tokens(self.tree, need)
            return
        short = need - self._free_tokens()
        states_short = states - self.states.available_size()
        if short > 0 or states_short > 0:
            self.tree.evict(v.EvictParams(num_tokens=max(short, 0),
                                          mamba_num=max(states_short, 0)))

    def _alloc(self, n: int):
        s = self._v.s
        return self.alloc.alloc(n) if n else s.torch.empty(0, dtype=s.torch.int64)

    def _checkpoint(self):
        """The state slot ``cache_unfinished_req`` donates to the tree (no extra buffer: a
        copy of the request's active state): SGLang's ``MambaComponent._alloc_mamba_slot``,
        which evicts one cached state where the pool is short and asserts where it cannot."""
        return self.component._alloc_mamba_slot()

    def run(self, rid, tokens, extra=None) -> bool:
        """A request of these token ids admitted and prefilled: matched, the rest allocated,
        the prompt inserted (``cache_unfinished_req``) and its node locked; False (nothing
        changed but an eviction) where the pools cannot hold the rest."""
        s, tree = self._v.s, self.tree
        key = self._key(tokens, extra)
        match = tree.match_prefix(s.MatchPrefixParams(key=key))
        hit = match.device_prefix_len
        need = len(tokens) - hit
        lock = tree.lock(match.last_device_node)  # the scheduler locks the hit first
        self._make_room(need, self.state_headroom)
        new = self._alloc(need)
        admitted = self.states is None or self.states.available_size() >= self.state_headroom
        active = self.states.alloc(1) if self.states is not None and admitted else None
        if new is None or (self.states is not None and active is None):
            if new is not None and len(new):
                self.alloc.free(new)
            if active is not None:
                self.states.free(active)
            tree.unlock(lock)
            return False
        prefix = tree.path_device_indices(match.last_device_node)[:hit]
        value = s.torch.cat([prefix.to(new.dtype), new])
        state = self._checkpoint() if self.states is not None else None
        result = tree.insert(s.InsertParams(key=key, value=value, prev_prefix_len=hit,
                                            mamba_value=state))
        if state is not None and result.mamba_exist:  # the tree holds this state already
            self.states.free(state)
        self.reqs[rid] = r = _Request(list(tokens), value, tree.lock(result.last_device_node),
                                      len(tokens), active, extra)
        self._hold(r, 1)
        tree.unlock(lock)
        self.touched += (lock.node, result.last_device_node)
        self.hits += hit
        return True

    def extend(self, rid, n: int) -> bool:
        """``n`` decoded tokens: their slots allocated (after an eviction of the shortfall);
        on an SWA model the slots the window has left freed (``free_swa_out_of_window_slots``:
        the request's own, above ``cache_protected_len``) and, once the window has passed the
        prompt, its SWA lock released (``release_swa_prefix_lock``). False where the pools
        cannot hold them (nothing allocated)."""
        s, r = self._v.s, self.reqs[rid]
        self._make_room(n)
        new = self._alloc(n)
        if new is None:
            return False
        self._hold(r, -1)
        r.tokens += range(self._fresh, self._fresh + n)
        self._fresh += n
        r.kv = s.torch.cat([r.kv, new.to(r.kv.dtype)])
        if self.window is not None:
            pre_len = len(r.tokens) - 1  # the last committed position
            lo, hi = max(r.evicted, r.protected), pre_len - self.window
            if hi > lo:
                self.alloc.free_swa_segment(r.kv[lo:hi], start_pos=lo)
                r.evicted = hi
            if pre_len - self.window >= r.protected:
                self.release_window(rid)
        self._hold(r, 1)
        return True

    def accept(self, rid, n: int, drafted: int) -> None:
        """Speculative decoding's verify: of the ``drafted`` draft tokens the last ``extend``
        wrote (the request's last ones) the first ``n`` kept, the rejected ones' slots freed as
        the EAGLE worker frees ``out_cache_loc[evict_mask]`` (page size 1); on an SWA model the
        full slot alone of a rejected position whose SWA slot the window already freed."""
        r = self.reqs[rid]
        keep = len(r.tokens) - (drafted - n)
        if keep >= len(r.tokens):
            return
        assert keep >= r.protected, "drafts are written after the prompt"
        self._hold(r, -1)
        live = keep
        if self.window is not None and r.evicted > keep:
            self.alloc.free_full(r.kv[keep:r.evicted])
            live, r.evicted = r.evicted, keep
        self.alloc.free(r.kv[live:])
        r.kv, r.tokens = r.kv[:keep], r.tokens[:keep]
        self._hold(r, 1)

    def _insert_params(self, r):
        s = self._v.s
        params = s.InsertParams(key=self._key(r.tokens, r.extra), value=r.kv,
                                prev_prefix_len=r.protected, mamba_value=r.active)
        if self.window is not None:
            params.set_evicted_seqlen(s.ComponentType.SWA, r.evicted)
        return params

    def release_window(self, rid) -> None:
        """The request's decode has moved its window past its prompt (``release_swa_prefix_lock``)."""
        self.tree.release_swa(self.reqs[rid].lock)
        self.touched.append(self.reqs[rid].lock.node)

    def finish(self, rid) -> None:
        """``cache_finished_req``: the whole sequence inserted (the Mamba active state donated,
        given back where the tree holds that state already), the request's lock dropped."""
        r = self.reqs.pop(rid)
        self._hold(r, -1)
        result = self.tree.insert(self._insert_params(r))
        if r.active is not None and result.mamba_exist:
            self.states.free(r.active)
        self.tree.unlock(r.lock)
        self.touched += (r.lock.node, result.last_device_node)

    def evict(self, tokens: int) -> None:
        if self.states is None:
            self.tree.evict(self._v.EvictParams(num_tokens=tokens, swa_num_tokens=tokens))
        else:
            self.tree.evict(self._v.EvictParams(num_tokens=tokens, mamba_num=1))

    # --- the figures ----------------------------------------------------------------------

    @staticmethod
    def _held_by(r) -> tuple:
        """What one running request holds outside the tree (SGLang's "uncached"): the KV of its
        tokens past ``cache_protected_len``; for SWA, less those its window has left, already
        freed; its active Mamba state."""
        full = len(r.tokens) - r.protected
        return full, full - max(r.evicted - r.protected, 0), int(r.active is not None)

    def _hold(self, r, sign: int) -> None:
        for name, n in zip(("full", "swa", "mamba"), self._held_by(r)):
            self._held[name] += sign * n

    def held(self, recount: bool = False) -> dict:
        """Per component, the slots running requests hold outside the tree, as the steps kept
        it; ``recount``: summed over the running requests instead."""
        held = self._held
        if recount:
            sums = [sum(col) for col in zip((0, 0, 0), *map(self._held_by, self.reqs.values()))]
            held = dict(zip(("full", "swa", "mamba"), sums))
        return {"full": held["full"], self.second_name: held[self.second_name]}

    def figures(self) -> dict:
        """Per component: (evictable, protected, free, pool)."""
        t, a = self.tree, self.alloc
        if self.states is None:
            return {"full": (t.full_evictable_size(), t.full_protected_size(),
                             a.full_available_size(), self.size),
                    "swa": (t.swa_evictable_size(), t.swa_protected_size(),
                            a.swa_available_size(), self.size_swa)}
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

    def _paths(self):
        """The nodes on the paths from the root to the nodes touched since the last check."""
        seen, root = set(), self.tree.tree_core.root_node
        nodes = self.tree.tree_core._node_arena  # id -> node: one evicted since is not there
        for handle in self.touched:
            node = nodes.get(handle) if isinstance(handle, int) else handle
            while node is not None and node is not root and node.id not in seen:
                seen.add(node.id)
                yield node
                node = node.parent

    def violations(self, full: bool = True) -> list:
        """What disagrees with SPEC §10 and the lock balance now (empty: nothing). ``full=False``
        walks only the paths the step locked or unlocked (no lock below 0, none above 0 when
        idle) and leaves out the sums of locked and unlocked values, which need every node: a
        check whose cost follows the step's paths, not the tree or the pool."""
        out = []
        held = self.held()
        if full:
            assert held == self.held(recount=True), "the adapter's tally of held slots drifted"
        figures = self.figures()
        for name, (evictable, protected, free, pool) in figures.items():
            if evictable + protected + free + held[name] != pool:
                out.append(f"{name}: evictable {evictable} + protected {protected} + free {free} "
                           f"+ held by requests {held[name]} != pool {pool}")
        ct = self._v.s.ComponentType
        nodes = list(self._nodes() if full else self._paths())
        self.touched = []
        idle = not self.reqs
        for name, c in (("full", ct.FULL), (self.second_name, self.second)):
            locked = unlocked = 0
            for node in nodes:
                data = node.component_data[c]
                ref = data.lock_ref
                if ref < 0:
                    out.append(f"{name}: node {node.id} lock_ref {ref}")
                if idle and ref:
                    out.append(f"{name}: node {node.id} lock_ref {ref} with no request running")
                if full and data.value is not None:
                    if ref > 0:
                        locked += len(data.value)
                    else:
                        unlocked += len(data.value)
            evictable, protected = figures[name][:2]
            if full and (locked, unlocked) != (protected, evictable):
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


# --- committed workloads through a component tree -------------------------------------------

SKIPPED_OPS = ("store", "done", "lookup")  # no host tier driven


def _tree_for(kind: str, header, size: int | None = None, window: int | None = None,
              states: int | None = None, tree_cls=None) -> "ComponentTree":
    """The tree a trace's settings give: the pool of ``num_blocks * block_size`` tokens (page
    size 1; 4096 where the trace names no pool), the window of its ``sliding(W)`` group (32, the
    tiny-hybrid model's, where it has none), 16 Mamba state slots."""
    from kvbench.contract.formulas import parse_kind
    B = header.settings.get("block_size") or 16
    blocks = header.settings.get("num_blocks")
    size = size or (blocks * B if blocks else 4096)
    if kind == "swa":
        if window is None:
            windows = [parse_kind(g).get("window") for g in header.groups]
            window = next((w for w in windows if w), 32)
        return (tree_cls or SwaTree)(size, window)
    return (tree_cls or MambaTree)(size, states or 16)


def _prompt_ids(op, B: int, names: dict, fresh) -> list:
    """A prefill's token ids: its ``token_ids``; else one id run per named block (a block hash
    names the same ``B`` ids wherever it recurs) and fresh ids for the rest; else fresh ids."""
    if op.token_ids is not None:
        return list(op.token_ids)
    out = []
    for h in op.block_hashes or ():
        base = names.setdefault(h, len(names) * B + 1)
        out += range(base, base + B)
    return out + [next(fresh) for _ in range(op.tokens - len(out))]


def _raised_in_sglang(e: BaseException) -> bool:
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and "/sglang/" in frames[-1].filename.replace("\\", "/")


def replay(kind: str, path, *, stop_at_first: bool = True, check: bool = True, **tree_kw) -> dict:
    """A committed trace (or a ``Trace``) through a ``kind`` ("swa" or "mamba") component tree, its figures
    checked after every operation: ``{"steps", "violations": [(step, [...]), ...], "hits",
    "refused", "skipped"}``. An engine exception is a violation at its step, and ends the run.
    ``check=False``: the engine alone (what the checking costs is the difference)."""
    import itertools

    from kvbench.traces.format import Trace, load
    trace = path if isinstance(path, Trace) else load(str(path))
    tree = _tree_for(kind, trace.header, **tree_kw)
    B = trace.header.settings.get("block_size") or 16
    names: dict = {}
    fresh = itertools.count(1 << 30)
    live, refused, skipped, found, steps = {}, 0, 0, [], 0
    drafts: dict = {}  # seq -> the draft tokens its last append wrote
    for op in trace.ops:
        name = type(op).__name__.lower()
        steps += 1
        try:
            if name in ("prefill", "load", "resume", "fork"):
                if name == "resume":
                    tokens, extra = live.pop(("preempted", op.seq), (None, None))
                    if tokens is None:
                        continue
                elif name == "fork":
                    if op.src not in live:
                        continue
                    tokens, extra = list(tree.reqs[op.src].tokens), tree.reqs[op.src].extra
                else:
                    tokens = _prompt_ids(op, B, names, fresh)
                    extra = f"{op.salt}|{op.adapter}" if (op.salt or op.adapter) else None
                if tree.run(op.seq, tokens, extra):
                    live[op.seq] = True
                else:
                    refused += 1
            elif name == "append":
                for i, (seq, n) in enumerate(zip(op.seqs, op.tokens)):
                    drafts.pop(seq, None)
                    if seq in live and not tree.extend(seq, n):
                        refused += 1  # retracted: cached and released
                        tree.finish(seq)
                        del live[seq]
                    elif seq in live and op.draft:
                        drafts[seq] = op.draft[i]
            elif name == "accept":
                if op.seq in drafts and op.seq in live:
                    tree.accept(op.seq, op.n, drafts.pop(op.seq))
            elif name in ("free", "abort"):
                if live.pop(op.seq, None):
                    tree.finish(op.seq)
            elif name == "preempt":
                if live.pop(op.seq, None):
                    r = tree.reqs[op.seq]
                    live[("preempted", op.seq)] = (list(r.tokens), r.extra)
                    tree.finish(op.seq)
            else:
                skipped += 1
                continue
            v = tree.violations(full=False) if check else []
        except Exception as e:  # the engine's own assertion: the scheduler would stop here
            if not _raised_in_sglang(e):
                raise  # the adapter's, never reported as the engine's
            found.append((op.step, [f"SGLang raised {type(e).__name__}: {e}"]))
            break
        if v:
            found.append((op.step, v))
            if stop_at_first:
                break
    else:
        if check and (v := tree.violations()):  # every node, once, at the end
            found.append(("end", v))
    return {"steps": steps, "violations": found, "hits": tree.hits, "refused": refused,
            "skipped": skipped, "tree": tree}


# --- seeded campaigns: kvbench fuzz's histories through a component tree -------------------------

# What a component tree takes of kvbench's history generator (kvbench.search.histories): hybrid
# models (sliding windows, or state groups for Mamba), prefix caching with salts and adapters,
# forks, preemption and drafts (the generator draws none beside sliding windows); no chunked
# prefill or tiers (replay does not drive them).
CAMPAIGN_CAPS = {"swa": dict(kinds=("full", "sliding")), "mamba": dict(kinds=("full", "state"))}


def campaign(kind: str, *, seed: int = 0, minutes: float | None = None,
             histories: int | None = None, out=None, tree_cls=None, store=None) -> dict:
    """History after history of ``kvbench fuzz``'s generator (seed ``seed``: the same seed, the
    same histories) through a fresh ``kind`` tree each, checked after every operation as
    ``replay`` checks a committed trace; until ``minutes`` or ``histories``. Each history's
    pool is the generator's budget against its peak (``num_blocks * block_size`` tokens); a
    Mamba tree gets 3 to 16 state slots, drawn per history. A finding is a class of first
    violation (its message, numbers left out), with the first history that showed it; ``out``:
    a folder where each class's first history is written, replayable by ``replay``;
    ``tree_cls``: another tree (a planted fault of impls/engines/faults_engines.py); ``store``: a
    results store the record also goes to, as ``kvbench fuzz --store`` writes one (sweep "fuzz",
    backend ``sglang-<kind>-components``: ``kvbench results fuzz``). Returns ``kvbench fuzz``'s
    summary fields (histories, operations, seconds, findings, errors: the adapter's own
    exceptions, kvbench's side)."""
    import dataclasses
    import re
    import time
    from pathlib import Path

    import numpy as np

    from kvbench.contract.protocol import Capabilities
    from kvbench.search.fuzz import budget_for
    from kvbench.search.histories import random_history
    from kvbench.traces.builder import peak_blocks

    assert minutes is not None or histories is not None, "a bound: minutes or histories"
    if store is not None:  # the code the campaign runs, read before it runs
        from kvbench.bench.grid import code_version
        commit = code_version()
    caps = Capabilities(holds_kv=False, prefix_caching=True, cache_salt=True, groups=True,
                        rules="sglang", **CAMPAIGN_CAPS[kind])
    findings, errors, ops, n, start = {}, [], 0, 0, time.monotonic()
    reached = {"hit tokens": 0, "refused": 0, "histories with a refusal": 0}
    while (histories is None or n < histories) and (
            minutes is None or time.monotonic() - start < minutes * 60):
        trace, settings, _ = random_history(seed, n, caps, ("preempt", "speculative"))
        B = settings.block_size
        peak = peak_blocks(trace.ops, B)
        blocks = budget_for(settings.budget, peak, settings.tight, settings.own_blocks or peak)
        trace = dataclasses.replace(trace, header=dataclasses.replace(
            trace.header, settings={**trace.header.settings, "num_blocks": blocks}))
        states = int(np.random.default_rng([seed, n, 3]).integers(3, 17)) if kind == "mamba" else None
        try:
            r = replay(kind, trace, states=states, tree_cls=tree_cls)
        except Exception as e:  # the adapter's (replay re-raises all but SGLang's own)
            errors.append({"history": n, "error": f"{type(e).__name__}: {e}"})
            r = None
        n += 1
        if r is None:
            continue
        ops += r["steps"]
        reached["hit tokens"] += r["hits"]
        reached["refused"] += r["refused"]
        reached["histories with a refusal"] += bool(r["refused"])
        if r["violations"]:
            step, found = r["violations"][0]
            key = re.sub(r"[0-9]+", "N", found[0])
            if key in findings:
                findings[key]["count"] += 1
                continue
            site = next((type(op).__name__.lower() for op in trace.ops if op.step == step), "end")
            f = findings[key] = {"name": f"{len(findings) + 1:02d}-{kind}", "kind": key,
                                 "site": site, "history": n - 1, "count": 1, "ops_after": None,
                                 "divergence": {"step": step, "quantity": found[0].split(":")[0]},
                                 "first": found, "pool": blocks * B, "states": states}
            if out is not None:
                Path(out).mkdir(parents=True, exist_ok=True)
                path = Path(out) / f"{f['name']}.jsonl"
                path.write_text(trace.to_jsonl())
                f["file"] = str(path)
    seconds = time.monotonic() - start
    summary = {"backend": f"sglang-{kind}-components", "seed": seed, "model_shapes": True,
               "stopped": "max-histories" if n == histories else "time", "histories": n,
               "operations": ops, "seconds": round(seconds, 1),
               "histories_per_minute": round(n / seconds * 60, 1),
               "reached": reached, "findings": list(findings.values()), "errors": errors}
    if store is not None:
        import types as _types

        from kvbench.cli.fuzz import store_campaign
        summary["stored"] = store_campaign(store, summary, _types.SimpleNamespace(
            max_histories=histories), minutes, commit)
    return summary
