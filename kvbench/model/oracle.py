"""The oracle: what a KV cache's ledger, victims, blocks and content must be, from the formulas alone.

Each operation (``prefill``, ``append``, ``fork``, ``accept``, ``free``, ...) advances the model by
one backend call and returns the victims it evicted, or raises ``ModelOOM`` having changed
nothing; ``expected_ledger()`` is the ledger every correct backend of the layout reports, and
``step(state, op)`` the same as a pure function over a copy. Two layouts: ``paged`` (SPEC §2:
pool.py's blocks, reference counts, copy-on-write) and ``contiguous`` (SPEC §3: arena.py's slabs).
Each group's kind is kinds.py's (SPEC §8), the block keys, the hit and the cache entries are
rules/spec.py's (SPEC §8-9), an engine's declared differences its rule set's (``self.rules``:
rules/vllm.py, rules/sglang.py), the victims eviction.py's (SPEC §5). Over 500 lines: what is
left is the order in which each operation asks them, which it needs whole, and which fixes the
block order (docs/writing-a-backend.md):

- a free or an eviction releases group by group, each table from the tail; a window group by
  group, writers in batch order, each writer's highest position first;
- a prefill takes its hits (every group) first, then new blocks group by group in position order;
  an append, group by group, the copies of shared tails, then the new blocks (writers in batch
  order, positions in order).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kvbench.contract import formulas as F
from kvbench.contract.protocol import (BlockChanges, BlockState, CacheConfig, Capabilities, Ledger,
                                       hash_writer)
from kvbench.model import eviction
from kvbench.model.arena import Arena
from kvbench.model.kinds import oracle_kinds
from kvbench.model.pool import BlockPool
from kvbench.model.rules import rule_set
from kvbench.model.rules.sglang import SGLangSteps
from kvbench.model.rules.spec import SpecSteps
from kvbench.model.rules.vllm import VLLMSteps
from kvbench.quant import pool as quant_pool


class ModelOOM(Exception):
    """The model cannot serve the call even after evicting every candidate."""


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
        """The block table of a model of one group."""
        return self.tables[0] if self.tables else []

    @property
    def slab(self):
        """The slab of a model of one group."""
        return self.slabs[0] if self.slabs else None

    def held(self) -> list:
        """Every block the sequence holds, over all groups (kept lookahead slots too)."""
        return [b for t in self.tables for b in t if b is not None] + [b for a in self.ahead for b in a]


@dataclass
class TenantStats:
    evictions: int = 0
    recomputed_tokens: int = 0


class Oracle(BlockPool, Arena, SpecSteps, VLLMSteps, SGLangSteps):
    def __init__(self, config: CacheConfig, layout="paged", capabilities: Capabilities | None = None):
        if layout not in ("paged", "contiguous"):
            raise ValueError(f"unknown layout {layout!r}")
        self.config, self.layout, self.caps = config, layout, capabilities or Capabilities()
        self.rules = rule_set(self.caps)  # the engine's rules, SPEC's by default
        self.window_release = self.rules.window_release
        self.groups = config.model.kv_groups
        self.kinds = oracle_kinds(config.model, config.block_size)
        self.windows = [g.window for g in self.groups]
        self.releasing = [kind.releases for kind in self.kinds]  # sliding, chunked, sinks, state
        self._init_pool(config.num_blocks, config.block_size, len(self.groups))
        self.seqs: dict[int, SeqState] = {}
        self.preempted: dict[int, SeqState] = {}  # evicted, content kept for the recompute
        self.tenant_stats: dict[str, TenantStats] = {}
        self.caching = bool(config.prefix_caching) and layout == "paged"
        self.hit_blocks = 0
        # Per sequence (reservation, blocks held, tenant), settled for the sequences changed
        # since and those that may share a tail (forks): expected_ledger() walks no block.
        self._per_seq, self._dirty, self._sharing, self._res_total = {}, set(), set(), 0
        self._usage: dict = {}  # tenant -> [blocks (slots) held, live sequences]
        self._nodes: dict = {}  # token-id prefixes -> node number (keys exact, never hashed)
        self.writers: dict = {}  # untagged block content -> {extra keys: first sequence}
        self._spec_from: dict = {}  # during an append: sequence -> its first draft position
        self._chunk_done: list = []  # during an append: (block, group, key) its chunks completed
        self._lives: dict = {}  # sequence -> times preempted (its resume writes blocks anew)
        self._init_tree()  # an engine's radix tree (rules/sglang.py), None under other rules

    @property
    def block_bytes(self) -> int:
        """B * 2 * L_group * H_kv * d_head * s, or a quantized pool's code + metadata bytes."""
        return quant_pool.pool_block_bytes(self.config)

    # --- room for a call, and eviction (SPEC §5) -------------------------------------------

    def _append_need(self, seqs, tokens, drop=None) -> int:
        """Blocks a batched append takes over every group, copy-on-write copies included
        (``drop``: per block, the references sequences about to be evicted would release)."""
        need = 0
        for g in range(len(self.groups)):
            refs = {b: -d for b, d in (drop or {}).items()}
            for s, dt in zip(seqs, tokens):
                st, room = self.seqs[s], 0
                tail = st.tables[g][-1] if st.tables[g] else None
                if tail is not None:
                    ref, fill = self.blocks[tail]
                    room = self.B - fill
                    if room > 0 and dt > 0 and ref + refs.get(tail, 0) > 1:
                        need += 1  # the writer gets its own copy of the shared tail
                        refs[tail] = refs.get(tail, 0) - 1
                new = self._appended_blocks(g, F.append_new_blocks(dt, room, self.B))
                need += max(0, new - (len(st.ahead[g]) if st.ahead else 0))
        return need

    def _fits(self, call, exclude=()) -> bool:
        """Would the call fit if the sequences in ``exclude`` were gone?"""
        if self.layout == "contiguous":
            return self._place(call[-1], exclude) is not None
        drop: dict[int, int] = {}
        for v in exclude:
            for b in self.seqs[v].held():
                drop[b] = drop.get(b, 0) + 1
        freed = sum(1 for b, d in drop.items() if self.blocks[b][0] == d)
        return call[1](drop) <= self.blocks_free + freed

    def _candidates(self, protect) -> list:
        return [s for s in self.seqs if s not in protect]

    def _pick_victim(self, candidates) -> int:
        return eviction.pick_victim(self, candidates)

    def _make_room(self, call, protect) -> list:
        """Evict until the call fits; raise ModelOOM (changing nothing) when it cannot."""
        if self._fits(call):
            return []
        candidates = self._candidates(protect) if self.config.policy else []
        if not candidates or not self._fits(call, exclude=candidates):
            raise ModelOOM()
        victims = []
        while not self._fits(call):
            victims.append(self._pick_victim(self._candidates(protect)))
            tenant = self.seqs[victims[-1]].tenant
            self.preempt(victims[-1])
            self.tenant_stats.setdefault(tenant, TenantStats()).evictions += 1
        return victims

    # --- what a sequence gives back --------------------------------------------------------

    def _release(self, st: SeqState) -> None:
        """Drop every reference of a sequence: group by group, each tail first (its kept
        lookahead slots before it)."""
        for g, table in enumerate(st.tables):
            for b in reversed(table + st.ahead[g] if st.ahead else table):
                if b is not None:
                    self._drop_ref(b)
        st.ahead = []

    def _release_windows(self, seqs, when: str = "end_of_operation") -> None:
        """Under the rule set's ``window_release`` ``when``: release the blocks of ``seqs`` each
        group no longer holds at their lengths (SPEC §8): group by group, writers in batch order."""
        for g, kind in enumerate(self.kinds) if self.window_release == when else ():
            if kind.releases:
                self._dirty.update(seqs)
                for st in (self.seqs[s] for s in seqs):
                    self._drop_positions(st, g, kind.releasing(st.tables[g], st.tokens))

    def _drop_positions(self, st: SeqState, g: int, positions) -> None:
        """Release group ``g``'s blocks of ``st`` at ``positions``, in that order (a fork through the
        prefix cache still names a cached one by its key)."""
        for i in positions:
            b = st.tables[g][i]
            if b in self.hash_of:
                st.released_keys[i] = self.hash_of[b][1]
            self._drop_ref(b)
            st.tables[g][i] = None

    # --- the operations --------------------------------------------------------------------

    def prefill(self, seq, tokens, tenant, final, step, protect=(), hashes=(), *, salt=None,
                adapter=None, token_ids=None, prompt_tokens=None) -> list:
        """A new sequence of ``tokens`` tokens; ``hashes`` (or ``token_ids``) name its full
        blocks, ``salt`` and ``adapter`` are their extra keys. ``prompt_tokens``: the whole
        prompt's length, of which this is the first chunk (SPEC §13): the keys cover the whole
        prompt, and a block becomes a cache entry only once an append completes it."""
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
        """A new request's ``n`` blocks (paged): its hits (every group) first, then new blocks
        group by group in position order, each cached under ``keys`` where its group keeps it;
        ``hit``: its prefix hit counts (a fork served as a request is no prompt)."""
        T = st.tokens
        L, hits, counted = self._cache_hits(keys, T)
        st.retained = self._retention(keys, prompt_tokens, T, L)
        self._take_hits(hits)
        self.hit_blocks += counted if hit else 0
        self._evict_before_alloc(self._new_blocks(keys, prompt_tokens, T, L, n), [T - L * self.B])
        st.tables = [[hits[g].get(i) for i in range(L)]
                     + [self._new_block(min(self.B, T - i * self.B), g)
                        if self._allocates(st, g, i, n) else None for i in range(L, n)]
                     for g in range(len(self.groups))]
        self.seqs[seq] = st  # first: a full block's caching reads its retention
        self._cache_prompt(seq, st, keys, L, n)
        self._settle_states(seq, T, L)
        self._tree_checkpoint(seq, prompt=T // self.B)
        self._release_windows([seq])

    def recompute(self, seq, step, protect=()) -> list:
        """Re-prefill an evicted sequence to its current length, with the content it had."""
        victims = self.reprefill(seq, step, protect)
        self.tenant_stats[self.seqs[seq].tenant].recomputed_tokens += self.seqs[seq].tokens
        return victims

    def reprefill(self, seq, step, protect=()) -> list:
        """A preempted sequence back on the device: a prefill of its tokens (its prompt's hits
        first) with the content it had."""
        st = self.preempted[seq]
        p = st.prompt
        victims = self.prefill(seq, st.tokens, st.tenant, st.final, step, protect, p.get("hashes"),
                               salt=p.get("salt"), adapter=p.get("adapter"), token_ids=p.get("token_ids"),
                               **({"prompt_tokens": p["prompt_tokens"]} if "prompt_tokens" in p else {}))
        self.seqs[seq].segments = list(st.segments)
        del self.preempted[seq]
        return victims

    def append(self, seqs, tokens, step, drafts=None) -> list:
        """``drafts``: per sequence, how many of its tokens (the last) are draft tokens (SPEC §13):
        their K/V are their own (see append_segments), and no block they complete is cached."""
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
            self._paged_write(seqs, tokens)
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

    def _paged_write(self, seqs, tokens) -> None:
        """Group by group: the copies of shared tails (writers in batch order), then the writes."""
        for g in range(len(self.groups)):
            for s, dt in zip(seqs, tokens):
                table = self.seqs[s].tables[g]
                if table and table[-1] is not None and dt > 0:
                    ref, fill = self.blocks[table[-1]]
                    if fill < self.B and ref > 1:  # the writer gets a private copy of the tail
                        self._drop_ref(table[-1])
                        table[-1] = self._new_block(fill, g)
            for s, dt in zip(seqs, tokens):
                table = self.seqs[s].tables[g]
                if table and table[-1] is not None:
                    fill = self.blocks[table[-1]][1]
                    take = min(dt, self.B - fill)
                    self.blocks[table[-1]][1] += take
                    self.filled += take
                    dt -= take
                    if take and fill + take == self.B:
                        self._completed(table[-1], g, s, len(table) - 1)
                while dt > 0:
                    take = min(dt, self.B)
                    dt -= take
                    if self._skips_block(g, last=dt <= 0):  # align mode: a state's null position
                        table.append(None)
                        continue
                    table.append(self._next_block(s, take, g))
                    if take == self.B:
                        self._completed(table[-1], g, s, len(table) - 1)

    def append_segments(self, seq, count: int, draft: int = 0, step: int = 0) -> list:
        """[(writer, start, count)]: who writes the next ``count`` positions of ``seq`` (before
        they are written): a block of its chunked prompt holds its key's K/V, as if a prefill
        wrote it; of the rest, the last ``draft`` are a draft's (a writer of their own, one per
        step, so that a rolled-back position written again reads differently); the others the
        sequence's own."""
        st = self.seqs[seq]
        start, stop = st.tokens, st.tokens + count
        chunk = st.prompt.get("chunk_keys")
        segments = content_segments(seq, stop - draft, chunk, self.B, start) if chunk else \
            [(seq, start, count - draft)] if count > draft else []
        if draft:
            segments.append((draft_writer(seq, step), stop - draft, draft))
        return segments

    def accept(self, seq, drafted: int, n: int, step: int) -> list:
        """Keep the first ``n`` of the ``drafted`` draft tokens ``seq``'s last append wrote
        (SPEC §13): the length drops by drafted - n, every block wholly past it is released (as
        a free would, or kept for the next drafts: ``_drop_drafts``), the tail's fill shrinks,
        and a block the kept drafts completed may now be cached."""
        st = self.seqs[seq]
        first_draft, new = st.tokens - drafted, st.tokens - (drafted - n)
        st.segments = _cut(st.segments, new)
        self._dirty.add(seq)
        keep = F.blocks_needed(new, self.B)
        for g, table in enumerate(st.tables):  # paged
            self._drop_drafts(st, g, table[keep:])
            del table[keep:]
            if keep and table[-1] is not None:
                fill = new - (keep - 1) * self.B
                self.filled += fill - self.blocks[table[-1]][1]
                self.blocks[table[-1]][1] = fill
            for i in range(first_draft // self.B, new // self.B):  # full now, drafts kept
                if table[i] is not None:
                    self._drafts_filled(st, g, seq, i)
        st.tokens = new
        return []

    def preempt(self, seq) -> None:
        """Preemption by recompute (SPEC §13): the sequence's blocks are released as a free
        releases them, its content kept for its resume (a prefill of all its tokens)."""
        self._dirty.add(seq)
        self._tree_checkpoint(seq, release=True)
        self._lives[seq] = self._lives.get(seq, 0) + 1
        st = self.seqs.pop(seq)
        self._release(st)
        st.tables, st.slabs = [], []
        self.preempted[seq] = st

    def fork(self, seq, src, final, step) -> list:
        """A child with ``src``'s tokens: its blocks shared (SPEC §2; a state's copied, SPEC §12),
        or served as a new request (``fork_via``, rules/spec.py), or its own slabs (contiguous)."""
        parent = self.seqs[src]
        via = self.rules.fork_via if self.layout == "paged" else "share"
        n = len(parent.tables[0]) if parent.tables else 0
        sizes = self._slab_sizes(final) if self.layout == "contiguous" else []
        states = [g for g, kind in enumerate(self.kinds) if kind.copied_at_fork and n]
        if via != "share":
            victims, keys = self._fork_room(seq, src, via)
        else:
            victims = self._make_room(("fork", lambda drop: len(states), sizes), {seq, src})
        child = SeqState(tenant=parent.tenant, tokens=parent.tokens, final=final,
                         segments=list(parent.segments), last_access=step, use_count=1)
        self.seqs[seq] = child
        self._dirty.update((seq, src))
        if self.layout == "contiguous":
            child.slabs = self._place(sizes)
        elif via == "share":
            child.tables = [list(t) for t in parent.tables]
            for b in child.held():
                self._add_ref(b)
            for g in states:  # the state's block copied: the branches diverge at the next token
                b = child.tables[g][n - 1]
                self._drop_ref(b)
                child.tables[g][n - 1] = self._new_block(self.blocks[b][1], g)
            self.edits += 1
            self._sharing.update((seq, src))  # a shared partial tail: each one's reservation
        else:  # a new request with the parent's tokens: cached blocks taken, the rest computed
            self._admit(seq, child, keys, parent.tokens, n, hit=False)
        return victims

    def free(self, seq) -> None:
        if seq in self.preempted:
            del self.preempted[seq]
            return
        self._dirty.add(seq)
        self._tree_checkpoint(seq, release=True)
        self._release(self.seqs.pop(seq))

    # --- the expected ledger ---------------------------------------------------------------

    def _settle(self) -> None:
        """Bring the per-sequence figures (reservation, blocks or slots held, tenant) of the
        sequences changed since the last call, and of those sharing a tail (whose reservation a
        copy-on-write elsewhere changes), up to date."""
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
            if self.layout == "paged":  # a full group's table holds every position's block
                held = sum(k.held_count(t) for t, k in zip(st.tables, self.kinds)) + sum(map(len, st.ahead))
                res = sum(F.tail_reservation(self.B - self.blocks[t[-1]][1], st.final - st.tokens)
                          for t in st.tables if t and t[-1] is not None and self.blocks[t[-1]][0] == 1)
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
        """Blocks (slots, contiguous) in the tables of each tenant with a live sequence."""
        self._settle()
        return {t: u for t, (u, n) in self._usage.items() if n}

    def expected_ledger(self, seqs=None) -> Ledger:
        """The ledger every correct backend reports; ``seqs``: the per-sequence figures of these
        sequences only (None: every live one). Paged: from the sums kept as blocks change."""
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
        """[(writer, start, count)] segments whose K/V the sequence must read back."""
        return list(self.seqs[seq].segments)

    def released_spans(self, seq) -> tuple:
        """Per group, the positions ``(lo, hi)`` whose K/V the sequence no longer holds, which
        read 0 (its kind's ``released_span``, or what its slab no longer holds)."""
        st = self.seqs[seq]
        if self.layout == "contiguous":
            return tuple((0, st.tokens - kind.slab_held(st.tokens, size))
                         for (_, size), kind in zip(st.slabs, self.kinds))
        return tuple(kind.released_span(table, st.tokens) for table, kind in zip(st.tables, self.kinds))

    def block_state(self, seqs=None, *, changed_since=None) -> BlockState:
        """The block structures every backend declaring ``block_ids`` must have, id for id.
        ``seqs``: the tables of these sequences only (None: every live one). ``changed_since``:
        the ``mark`` of the last state, for its changes only (as a backend gives them)."""
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


def content_segments(seq: int, tokens: int, keys, block_size: int, start: int = 0) -> list:
    """Who "wrote" each position ``start .. tokens-1`` of a prompt: a keyed block (``keys`` by
    position) holds what its prefix (and extra keys) determine, the same for every sequence with
    that key, written whole or in chunks; the rest is the sequence's own."""
    B, segments = block_size, []
    for i in range(start // B, min(len(keys), -(-tokens // B))):
        lo, hi = max(start, i * B), min(tokens, (i + 1) * B)
        segments.append((hash_writer(keys[i]), lo, hi - lo))
    done = max(start, len(keys) * B)
    if tokens > done:
        segments.append((seq, done, tokens - done))
    return segments


def draft_writer(seq: int, step: int) -> int:
    """The pseudo-writer of the draft tokens ``seq`` wrote at ``step``."""
    return hash_writer(("draft", seq, step))


def _cut(segments, length: int) -> list:
    """[(writer, start, count)] cut to the positions below ``length``."""
    return [(w, start, min(count, length - start)) for w, start, count in segments if start < length]


def step(oracle: Oracle, call: tuple) -> tuple[Oracle, list | None]:
    """Pure form: a new model after ``call`` = (method, kwargs), and its victims (None on OOM)."""
    nxt = copy.deepcopy(oracle)
    method, kwargs = call
    try:
        return nxt, getattr(nxt, method)(**kwargs)
    except ModelOOM:
        return oracle, None
