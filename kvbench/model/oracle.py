"""The oracle: what a KV cache's ledger, victims, blocks and content must be, from the formulas alone.

Each operation is one backend call: it returns its victims, or raises ``ModelOOM`` having changed
nothing. Paged (SPEC §2): pool.py's blocks, each group's table run by its kind (kinds.py);
contiguous (SPEC §3): arena.py's slabs. Keys, hits and cache entries are the rule set's (rules/),
eviction eviction.py's. Here is the order an operation asks them in, which fixes the block order
(docs/writing-a-backend.md): hits first, then group by group, positions in order.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kvbench.contract import formulas as F
from kvbench.contract.protocol import (BlockChanges, BlockState, CacheConfig, Capabilities, Ledger,
                                       appended_segments, content_segments, cut_segments)
from kvbench.model.arena import Arena
from kvbench.model.eviction import Eviction, ModelOOM, TenantStats
from kvbench.model.kinds import oracle_kinds
from kvbench.model.pool import BlockPool
from kvbench.model.rules import rule_set
from kvbench.model.rules.sglang import SGLangSteps
from kvbench.model.rules.spec import SpecSteps
from kvbench.model.rules.vllm import VLLMSteps
from kvbench.quant import pool as quant_pool


@dataclass
class SeqState:
    tenant: str
    tokens: int
    final: int
    tables: list = field(default_factory=list)  # paged, per group: block ids by position (None: not held)
    slabs: list = field(default_factory=list)  # contiguous, per group: (start, size)
    segments: list = field(default_factory=list)  # [(writer, start, count)]: who wrote each position
    last_access: int = 0
    use_count: int = 0
    prompt: dict = field(default_factory=dict)  # what a recompute re-prefills with (hashes, salt, ...)
    released_keys: dict = field(default_factory=dict)  # position -> key of a block released uncached
    ahead: list = field(default_factory=list)  # per group, blocks kept for the next drafts (SPEC §13)
    later: list = field(default_factory=list)  # (group, position) kept drafts filled: cached next append
    retained: list = field(default_factory=list)  # per group, positions a sparse retention caches (None: all)

    @property
    def table(self) -> list:
        return self.tables[0] if self.tables else []

    def held(self) -> list:
        """Every block the sequence holds (kept lookahead slots too)."""
        return [b for t in self.tables for b in t if b is not None] + [b for a in self.ahead for b in a]


class Oracle(BlockPool, Arena, Eviction, SpecSteps, VLLMSteps, SGLangSteps):
    def __init__(self, config: CacheConfig, layout="paged", capabilities: Capabilities | None = None):
        if layout not in ("paged", "contiguous"):
            raise ValueError(f"unknown layout {layout!r}")
        self.config, self.layout, self.caps = config, layout, capabilities or Capabilities()
        self.rules = rule_set(self.caps)  # the engine's rules, SPEC's by default
        self.groups = config.model.kv_groups
        self.kinds = oracle_kinds(config.model, config.block_size, self.rules)
        self.releasing = [kind.releases for kind in self.kinds]  # sliding, chunked, sinks, state
        self._init_pool(config.num_blocks, config.block_size, len(self.groups))
        self.seqs: dict[int, SeqState] = {}
        self.preempted: dict[int, SeqState] = {}  # evicted, content kept for the recompute
        self.tenant_stats: dict[str, TenantStats] = {}
        self.caching = bool(config.prefix_caching) and layout == "paged"
        self.hit_blocks = 0
        # Per sequence (reservation, blocks held, tenant), settled as they change (_settle).
        self._per_seq, self._dirty, self._sharing, self._res_total = {}, set(), set(), 0
        self._usage: dict = {}  # tenant -> [blocks (slots) held, live sequences]
        self._init_keys()  # rules/spec.py's
        self._init_tree()  # an engine's radix tree (rules/sglang.py), None under other rules

    @property
    def block_bytes(self) -> int:
        return quant_pool.pool_block_bytes(self.config)

    def _append_need(self, seqs, tokens, drop=None) -> int:
        """Blocks a batched append takes (``drop``: references evictions would release)."""
        return sum(kind.append_need(self, g, seqs, tokens, {b: -d for b, d in (drop or {}).items()})
                   for g, kind in enumerate(self.kinds))

    def _release(self, st: SeqState) -> None:
        for g in range(len(st.tables)):
            self.kinds[g].release(self, st, g)
        st.ahead = []

    # --- the operations --------------------------------------------------------------------

    def prefill(self, seq, tokens, tenant, final, step, protect=(), hashes=(), *, salt=None,
                adapter=None, token_ids=None, prompt_tokens=None) -> list:
        """``hashes`` (or ``token_ids``) key its full blocks, with ``salt`` and ``adapter``;
        ``prompt_tokens``: the whole prompt, of which this is the first chunk (SPEC §13)."""
        n, P = F.blocks_needed(tokens, self.B), prompt_tokens or tokens
        whole = self.prompt_keys(P, hashes, token_ids, salt, adapter)
        lookup = whole[:tokens // self.B] if self.caching else ()
        sizes = self._slab_sizes(final) if self.layout == "contiguous" else None

        def need(drop):  # new blocks, plus cached blocks it takes back from the free pool
            L, hits, _ = self._cache_hits(lookup, tokens)
            return self._new_blocks(lookup, P, tokens, L, n) + self._taken_back(hits, drop)

        self._tree_match(lookup, tokens)
        victims = self._make_room(("prefill", need, sizes), set(protect) | {seq})
        st = SeqState(tenant=tenant, tokens=tokens, final=final, last_access=step, use_count=1,
                      segments=content_segments(seq, tokens, whole, self.B),
                      prompt={"hashes": tuple(hashes or ()) or None, "salt": salt, "adapter": adapter,
                              "token_ids": token_ids,
                              **self._note_writers(seq, tokens, hashes, token_ids, salt, adapter)})
        if P > tokens:  # the chunks still to come
            st.prompt.update(prompt_tokens=P, chunk_keys=whole)
        if self.layout == "paged":
            self._admit(seq, st, lookup, P, n)
        else:
            st.slabs = self._place(sizes)
            self.seqs[seq] = st
        self._dirty.add(seq)
        self.tenant_stats.setdefault(tenant, TenantStats())
        return victims

    def _admit(self, seq, st: SeqState, keys, prompt_tokens: int, n: int, hit: bool = True) -> None:
        """A new request's ``n`` blocks (paged), cached under ``keys`` where its groups keep them;
        ``hit``: its prefix hit counts (a fork served as a request is no prompt)."""
        T = st.tokens
        L, hits, counted = self._cache_hits(keys, T)
        st.retained = self._retention(keys, prompt_tokens, T, L)
        self._take_hits(hits)
        self.hit_blocks += counted if hit else 0
        self._evict_before_alloc(self._new_blocks(keys, prompt_tokens, T, L, n), [T - L * self.B])
        st.tables = [kind.admitted(self, st, g, hits[g], L, n) for g, kind in enumerate(self.kinds)]
        self.seqs[seq] = st  # first: a full block's caching reads its retention
        self._cache_prompt(seq, st, keys, L, n)
        self._settle_states(seq, T, L)
        self._tree_checkpoint(seq, prompt=T // self.B)
        self._release_windows([seq])

    def append(self, seqs, tokens, step, drafts=None) -> list:
        """``drafts``: per sequence, how many of its last tokens are drafts (SPEC §13)."""
        if self.layout == "contiguous":
            self._check_growth(seqs, tokens)
        call = ("append", lambda drop: self._append_need(seqs, tokens, drop), [])
        victims = self._make_room_released(call, seqs)
        self._spec_from = {s: self.seqs[s].tokens + dt - d for s, dt, d in zip(seqs, tokens, drafts)
                           if d} if drafts else {}
        if self.layout == "paged":
            grow = [dt for dt in tokens if dt > 0]
            self._evict_before_alloc(self._append_need(seqs, tokens), grow,
                                     decode=all(dt == 1 for dt in grow))
            for g, kind in enumerate(self.kinds):
                kind.write(self, g, seqs, tokens)
            self._cache_chunks()
            self._cache_later([s for s, dt in zip(seqs, tokens) if dt > 0])  # no empty step
        self._dirty.update(seqs)
        for i, (s, dt) in enumerate(zip(seqs, tokens)):
            st = self.seqs[s]
            if drafts or "chunk_keys" in st.prompt:
                st.segments.extend(self.append_segments(s, dt, drafts[i] if drafts else 0, step))
                if st.tokens + dt >= st.prompt.get("prompt_tokens", 0):  # the prompt is complete
                    st.prompt.pop("chunk_keys", None)
                    st.prompt.pop("prompt_tokens", None)
            else:
                st.segments.append((s, st.tokens, dt))
            st.tokens += dt
            st.last_access = step
            st.use_count += 1
        if self.layout == "paged":
            self._release_windows(seqs)
        return victims

    def append_segments(self, seq, count: int, draft: int = 0, step: int = 0) -> list:
        st = self.seqs[seq]
        return appended_segments(seq, st.tokens, count, st.prompt.get("chunk_keys"), self.B, draft, step)

    def accept(self, seq, drafted: int, n: int, step: int) -> list:
        """Keep the first ``n`` of the ``drafted`` drafts of ``seq``'s last append (SPEC §13)."""
        st = self.seqs[seq]
        new = st.tokens - (drafted - n)
        st.segments = cut_segments(st.segments, new)
        self._dirty.add(seq)
        for g in range(len(st.tables)):  # paged
            self.kinds[g].rollback(self, st, g, seq, st.tokens - drafted, new)
        st.tokens = new
        return []

    def free(self, seq) -> None:
        if self.preempted.pop(seq, None) is not None:
            return
        self._dirty.add(seq)
        self._tree_checkpoint(seq, release=True)
        self._release(self.seqs.pop(seq))

    # --- the expected ledger ---------------------------------------------------------------

    def _settle(self) -> None:
        """The per-sequence figures of the sequences changed since, and of those sharing a tail
        (a copy-on-write elsewhere changes their reservation), up to date."""
        todo, self._dirty = self._dirty | self._sharing, set()
        left = set()  # tenants whose live sequences may all be gone
        for s in todo:
            old = self._per_seq.pop(s, None)
            if old is not None:
                self._res_total -= old[0]
                self._usage[old[2]][0] -= old[1]
                self._usage[old[2]][1] -= 1
                left.add(old[2])
            st = self.seqs.get(s)
            if st is None:
                self._sharing.discard(s)
                continue
            if self.layout == "paged":
                held = sum(k.held_count(t) for t, k in zip(st.tables, self.kinds)) + sum(map(len, st.ahead))
                res = sum(k.reservation(self, t, st) for t, k in zip(st.tables, self.kinds))
            else:
                held, res = sum(size for _, size in st.slabs), 0
            self._per_seq[s] = (res, held, st.tenant)
            self._res_total += res
            u = self._usage.setdefault(st.tenant, [0, 0])
            u[0] += held
            u[1] += 1
        for t in left:  # only tenants with a live sequence stay: usage costs what is live
            if not self._usage[t][1]:
                del self._usage[t]

    def tenant_usage(self) -> dict:
        """Blocks (slots) held by each tenant with a live sequence."""
        self._settle()
        return {t: u for t, (u, n) in self._usage.items() if n}

    def expected_ledger(self, seqs=None) -> Ledger:
        """The ledger every correct backend reports (``seqs``: the sequences it covers)."""
        live = self.seqs if seqs is None else [s for s in seqs if s in self.seqs]
        if self.layout != "paged":
            return self._arena_ledger(live)
        self._settle()
        return Ledger.paged(
            num_blocks=self.num_blocks, block_size=self.B, block_bytes=self.block_bytes,
            blocks_used=len(self.blocks), blocks_free=self.blocks_free,
            tokens={s: self.seqs[s].tokens for s in live},
            seq_blocks={s: self._per_seq[s][1] for s in live}, token_states=self.filled,
            reservation=self._res_total, shared_blocks=self.shared,
            cached_blocks=len(self.evictable), prefix_hit_blocks=self.hit_blocks,
            group_blocks=self.group_used)

    def expected_content(self, seq) -> list:
        """[(writer, start, count)]: the K/V the sequence must read back."""
        return list(self.seqs[seq].segments)

    def released_spans(self, seq) -> tuple:
        """Per group, the positions ``(lo, hi)`` the sequence no longer holds, which read 0."""
        st = self.seqs[seq]
        if self.layout == "contiguous":
            return tuple((0, st.tokens - kind.slab_held(st.tokens, size))
                         for (_, size), kind in zip(st.slabs, self.kinds))
        return tuple(kind.released_span(table, st.tokens) for table, kind in zip(st.tables, self.kinds))

    def block_state(self, seqs=None, *, changed_since=None) -> BlockState:
        """The block structures a backend declaring ``block_ids`` must have, id for id (only the
        changes since ``changed_since``, a mark, when it is the last)."""
        live = self.seqs if seqs is None else [s for s in seqs if s in self.seqs]
        tables = {s: [[-1 if b is None else b for b in t] for t in self.seqs[s].tables] for s in live}
        size, changes = self.uncached_free, None
        if changed_since is not None and changed_since is self._mark:
            changes = BlockChanges(self.free_list(size - self._free_low), size, self._cached_log)
        self._mark, self._free_low, self._cached_log = object(), size, []
        if changes is not None:
            return BlockState(None, None, self.refs, tables, self._mark, changes)
        return BlockState(free=self.free_list(), cached=self._eviction_order(), refcount=self.refs,
                          tables=tables, mark=self._mark)


def step(oracle: Oracle, call: tuple) -> tuple[Oracle, list | None]:
    """Pure form: a new model after ``call`` = (method, kwargs), and its victims (None on OOM)."""
    nxt = copy.deepcopy(oracle)
    method, kwargs = call
    try:
        return nxt, getattr(nxt, method)(**kwargs)
    except ModelOOM:
        return oracle, None
