"""The oracle: a pure model of what a KV cache's ledger must be, derived from the formulas alone.

Over 500 lines: the operations of both layouts (paged and contiguous) over KV cache groups, with
eviction, prefix caching and the block order; the block pool (pool.py), the arena (arena.py),
each group kind (kinds.py), the rule sets (rules/: the block keys, the hit and every engine's
steps) and the eviction policies (eviction.py) are modules of their own, and what remains is the
order in which an operation asks them, which each operation needs whole.

It imports no backend code. Each operation (``prefill``, ``append``, ``fork``, ``free``, ...)
advances the model by one backend call and either returns the victims it evicted or raises
``ModelOOM`` having changed nothing; ``expected_ledger()`` gives the ledger every correct backend
of that layout reports. ``step(state, op)`` is the same as a pure function over a copied state,
for tests and property checks.

Two layouts are modelled: ``paged`` (SPEC §2: blocks, reference counts, copy-on-write) and
``contiguous`` (SPEC §3: one slab per sequence and group in a first-fit arena). Eviction follows
SPEC §5; KV cache groups, sliding windows and hybrid prefix hits SPEC §8 (each group's kind from
kinds.KINDS); salted, tagged block keys SPEC §9. A real engine's documented rules that differ
from SPEC's (its rule set, ``Capabilities.rules``; ``self.rules``) are followed when it declares
them: rules/vllm.py and rules/sglang.py name them.

The paged model fixes which physical block each operation takes (docs/writing-a-backend.md;
pool.py: the free stack and the cached queue), so a backend that declares ``block_ids`` is
compared with it block by block:

- Freeing or evicting a sequence releases group by group, each group's blocks from the tail to
  the head; a sliding window releases group by group, writers in batch order, each writer's
  blocks from the highest position down.
- A prefill takes its prefix hits (every group) first, then new blocks group by group in position
  order; an append takes, group by group, the copies of shared tails (writers in batch order),
  then the new blocks (writers in batch order, positions in order).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from kvbench.contract import formulas as F
from kvbench.contract.protocol import (
    BlockChanges,
    BlockState,
    CacheConfig,
    Capabilities,
    Ledger,
    hash_writer,
)
from kvbench.model import eviction
from kvbench.model.arena import Arena
from kvbench.model.kinds import kind_of
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
    # position -> cache key of a block a window released (or sparse retention left uncached)
    released_keys: dict = field(default_factory=dict)
    # Per group, blocks kept past the length for the next drafts (lookahead slots, SPEC §13)
    ahead: list = field(default_factory=list)
    later: list = field(default_factory=list)  # (group, position): full of kept drafts, cached at the next append
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
    def __init__(self, config: CacheConfig, layout: str = "paged",
                 capabilities: Capabilities | None = None):
        if layout not in ("paged", "contiguous"):
            raise ValueError(f"unknown layout {layout!r}")
        self.config = config
        self.layout = layout
        self.caps = capabilities or Capabilities()
        self.rules = rule_set(self.caps)  # the engine's rules, SPEC's by default
        self.window_release = self.rules.window_release
        self.groups = config.model.kv_groups
        self.kinds = [kind_of(g, config.block_size) for g in self.groups]
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
        self._per_seq: dict = {}
        self._dirty: set = set()
        self._sharing: set = set()
        self._res_total = 0
        self._usage: dict = {}  # tenant -> [blocks (slots) held, live sequences]
        self._nodes: dict = {}  # token-id prefixes -> node number (keys exact, never hashed)
        self.writers: dict = {}  # untagged block content -> {extra keys: first sequence}
        self._spec_from: dict = {}  # during an append: sequence -> its first draft position
        self._chunk_done: list = []  # during an append: (block, group, key) its chunks completed
        self._init_tree()  # an engine's radix tree (rules/sglang.py), None under other rules
        self._lives: dict = {}  # sequence -> times preempted (its resume writes blocks anew)

    # --- capacity --------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """B * 2 * L_group * H_kv * d_head * s, or a quantized pool's code + metadata bytes."""
        return quant_pool.pool_block_bytes(self.config)

    def _release(self, st: SeqState) -> None:
        """Drop every reference of a sequence: group by group, each tail first (its kept
        lookahead slots before it)."""
        for g, table in enumerate(st.tables):
            for b in reversed(table if not st.ahead else table + st.ahead[g]):
                if b is not None:
                    self._drop_ref(b)
        st.ahead = []

    # --- what a call needs -----------------------------------------------------------------

    def _append_need(self, seqs, tokens, drop=None) -> int:
        """Blocks a batched append takes over every group, copy-on-write copies included.

        ``drop``: references that sequences about to be evicted would release, per block.
        """
        need = 0
        for g in range(len(self.groups)):
            ref_delta: dict[int, int] = {b: -d for b, d in (drop or {}).items()}
            for s, dt in zip(seqs, tokens):
                table = self.seqs[s].tables[g]
                free_last = 0
                if table and table[-1] is not None:
                    tail = table[-1]
                    ref, fill = self.blocks[tail]
                    free_last = self.B - fill
                    if free_last > 0 and dt > 0 and ref + ref_delta.get(tail, 0) > 1:
                        need += 1  # the writer gets its own copy of the shared tail
                        ref_delta[tail] = ref_delta.get(tail, 0) - 1
                ahead = self.seqs[s].ahead
                new = self._appended_blocks(g, F.append_new_blocks(dt, free_last, self.B))
                need += max(0, new - (len(ahead[g]) if ahead else 0))
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

    # --- eviction (SPEC §5) ----------------------------------------------------------------

    def _candidates(self, protect) -> list:
        return [s for s in self.seqs if s not in protect]

    def _pick_victim(self, candidates) -> int:
        return eviction.pick_victim(self, candidates)

    def tenant_usage(self) -> dict:
        """Blocks (slots, contiguous) in the tables of each tenant with a live sequence."""
        self._settle()
        return {t: u for t, (u, n) in self._usage.items() if n}

    def _evict(self, victim: int) -> None:
        tenant = self.seqs[victim].tenant
        self.preempt(victim)
        self.tenant_stats.setdefault(tenant, TenantStats()).evictions += 1

    def _make_room(self, call, protect) -> list:
        """Evict until the call fits; raise ModelOOM (changing nothing) when it cannot."""
        if self._fits(call):
            return []
        candidates = self._candidates(protect) if self.config.policy else []
        if not candidates or not self._fits(call, exclude=candidates):
            raise ModelOOM()
        victims = []
        while not self._fits(call):
            v = self._pick_victim(self._candidates(protect))
            self._evict(v)
            victims.append(v)
        return victims

    # --- sliding windows (SPEC §8) ---------------------------------------------------------

    def _release_windows(self, seqs, when: str = "end_of_operation") -> None:
        """Under the rule set's ``window_release`` ``when``: release every block of ``seqs`` a
        group no longer holds at their current lengths (its kind's ``releasing``): group by
        group, writers in batch order, highest position first."""
        if self.window_release != when:
            return
        for g, kind in enumerate(self.kinds):
            for s in seqs if kind.releases else ():
                self._dirty.add(s)
                st = self.seqs[s]
                for i in kind.releasing(st.tables[g], st.tokens):
                    b = st.tables[g][i]
                    if b in self.hash_of:  # a fork through the prefix cache names it
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
        n = F.blocks_needed(tokens, self.B)
        whole = self.prompt_keys(prompt_tokens or tokens, hashes, token_ids, salt, adapter)
        keys = whole[:tokens // self.B]
        lookup = keys if self.caching else ()
        G = len(self.groups)
        sizes = self._slab_sizes(final) if self.layout == "contiguous" else None

        def need(drop):  # new blocks, plus cached blocks it takes back from the free pool
            L, hits, _ = self._cache_hits(lookup, tokens)
            return self._new_blocks(lookup, prompt_tokens or tokens, tokens, L, n) \
                + self._taken_back(hits, drop)

        self._tree_match(lookup, tokens)
        victims = self._make_room(("prefill", need, sizes), set(protect) | {seq})
        st = SeqState(tenant=tenant, tokens=tokens, final=final, last_access=step, use_count=1,
                      segments=content_segments(seq, tokens, whole, self.B),
                      prompt={"hashes": tuple(hashes or ()) or None, "salt": salt, "adapter": adapter,
                              "token_ids": token_ids,
                              **self._note_writers(seq, tokens, hashes, token_ids, salt, adapter)})
        if prompt_tokens is not None and prompt_tokens > tokens:  # the chunks still to come
            st.prompt.update(prompt_tokens=prompt_tokens, chunk_keys=whole)
        if self.layout == "paged":
            L, hits, counted = self._cache_hits(lookup, tokens)
            st.retained = self._retention(lookup, prompt_tokens or tokens, tokens, L)
            self._take_hits(hits)
            self.hit_blocks += counted
            self._evict_before_alloc(self._new_blocks(lookup, prompt_tokens or tokens, tokens, L, n),
                                     [tokens - L * self.B])
            st.tables = [[hits[g].get(i) for i in range(L)]
                         + [self._new_block(min(self.B, tokens - i * self.B), g)
                            if self._allocates(st, g, i, n) else None for i in range(L, n)]
                         for g in range(G)]
            self.seqs[seq] = st  # first: a full block's caching reads its retention
            self._cache_prompt(seq, st, lookup, L, n)
            self._settle_states(seq, tokens, L)
            self._dirty.add(seq)
            self._tree_checkpoint(seq, prompt=tokens // self.B)
            self._release_windows([seq])
        else:
            st.slabs = self._place(sizes)
            self.seqs[seq] = st
            self._dirty.add(seq)
        self.tenant_stats.setdefault(tenant, TenantStats())
        return victims

    def recompute(self, seq, step, protect=()) -> list:
        """Re-prefill an evicted sequence to its current length, with the content it had."""
        victims = self.reprefill(seq, step, protect)
        st = self.seqs[seq]
        self.tenant_stats[st.tenant].recomputed_tokens += st.tokens
        return victims

    def reprefill(self, seq, step, protect=()) -> list:
        """A preempted sequence back on the device: a prefill of its tokens (its prompt's hits
        first) with the content it had."""
        st = self.preempted[seq]
        p = st.prompt
        victims = self.prefill(seq, st.tokens, st.tenant, st.final, step, protect, p.get("hashes"),
                               salt=p.get("salt"), adapter=p.get("adapter"),
                               token_ids=p.get("token_ids"),
                               **({"prompt_tokens": p["prompt_tokens"]} if "prompt_tokens" in p else {}))
        self.seqs[seq].segments = list(st.segments)
        del self.preempted[seq]
        return victims

    def append(self, seqs, tokens, step, drafts=None) -> list:
        """``drafts``: per sequence, how many of its tokens (the last) are draft tokens (SPEC §13):
        their K/V are their own (see append_segments), and no block they complete is cached."""
        for s, dt in zip(seqs, tokens):
            st = self.seqs[s]
            if self.layout == "contiguous" and any(
                    st.tokens + dt > size for (_, size), kind in zip(st.slabs, self.kinds) if not kind.ring):
                raise ValueError(f"sequence {s} grows to {st.tokens + dt} tokens, beyond its "
                                 f"{st.slab[1]}-slot reservation")
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
                if st.tokens + dt >= st.prompt.get("prompt_tokens", 0):
                    st.prompt.pop("chunk_keys", None)  # the prompt is complete
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
                tail = table[-1] if table else None
                if tail is not None and dt > 0:
                    ref, fill = self.blocks[tail]
                    if fill < self.B and ref > 1:  # the writer gets a private copy of the tail
                        self._drop_ref(tail)
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
        (SPEC §13): the length drops by drafted - n, every block wholly past it is released (its
        reference dropped, group by group from the tail, as a free would), the tail's fill
        shrinks, and a block the kept drafts completed may now be cached. An engine declaring
        ``lookahead_slots`` keeps the blocks past the length instead, unwritten and held, and its
        next appends write into them before taking new ones."""
        st = self.seqs[seq]
        first_draft = st.tokens - drafted
        new = st.tokens - (drafted - n)
        st.segments = _cut(st.segments, new)
        self._dirty.add(seq)
        if self.layout == "paged":
            keep = F.blocks_needed(new, self.B)
            for g, table in enumerate(st.tables):
                self._drop_drafts(st, g, table[keep:])
                del table[keep:]
                if keep and table[-1] is not None:
                    b = table[-1]
                    fill = new - (keep - 1) * self.B
                    self.filled += fill - self.blocks[b][1]
                    self.blocks[b][1] = fill
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
        parent = self.seqs[src]
        via = self.rules.fork_via if self.layout == "paged" else "share"
        n = len(parent.tables[0]) if parent.tables else 0
        victims = []
        if self.layout == "contiguous":
            sizes = self._slab_sizes(final)
            victims = self._make_room(("fork", None, sizes), {seq, src})
        elif via != "share":
            victims, keys = self._fork_room(seq, src, via)
        states = [g for g, kind in enumerate(self.kinds) if kind.copied_at_fork and n]
        if via == "share" and states and self.layout == "paged":  # SPEC §12: a copy of each state
            victims = self._make_room(("fork", lambda drop: len(states), []), {seq, src})
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
            self._fork_as_request(seq, child, parent, keys)
        return victims

    def free(self, seq) -> None:
        if seq in self.preempted:
            del self.preempted[seq]
            return
        self._dirty.add(seq)
        self._tree_checkpoint(seq, release=True)
        self._release(self.seqs.pop(seq))

    # --- the expected ledger ---------------------------------------------------------------

    def _held_count(self, st: SeqState) -> int:
        """Blocks a sequence holds (slots of its slabs, contiguous); a full group's table holds
        every position's block."""
        if self.layout != "paged":
            return sum(size for _, size in st.slabs)
        return sum(kind.held_count(t) for t, kind in zip(st.tables, self.kinds)) + sum(map(len, st.ahead))

    def _reservation_of(self, st: SeqState) -> int:
        B, res = self.B, 0
        for table in st.tables:
            if table and table[-1] is not None:
                ref, fill = self.blocks[table[-1]]
                if ref == 1:
                    res += F.tail_reservation(B - fill, st.final - st.tokens)
        return res

    def _settle(self) -> None:
        """Bring the per-sequence figures of the sequences changed since the last call (and of
        those sharing a tail, whose reservation a copy-on-write elsewhere changes) up to date."""
        todo = self._dirty | self._sharing
        self._dirty = set()
        left = set()  # tenants whose live sequences may all be gone
        for s in todo:
            old = self._per_seq.pop(s, None)
            if old is not None:
                res, held, tenant = old
                self._res_total -= res
                u = self._usage[tenant]
                u[0] -= held
                u[1] -= 1
                left.add(tenant)
            st = self.seqs.get(s)
            if st is None:
                self._sharing.discard(s)
                continue
            res = self._reservation_of(st) if self.layout == "paged" else 0
            held = self._held_count(st)
            self._per_seq[s] = (res, held, st.tenant)
            self._res_total += res
            u = self._usage.setdefault(st.tenant, [0, 0])
            u[0] += held
            u[1] += 1
        for t in left:  # only tenants with a live sequence stay: usage costs what is live
            if not self._usage[t][1]:
                del self._usage[t]

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
        read 0 (a sliding or chunked group holds only the blocks, or the ring, of its window or
        chunk: lo = 0; a sinks group keeps its sinks' blocks below lo; a state group holds no
        K/V: every position)."""
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
        size = self.uncached_free
        changes = None
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
    out = []
    for w, start, count in segments:
        if start >= length:
            break
        out.append((w, start, min(count, length - start)))
    return out


def step(oracle: Oracle, call: tuple) -> tuple[Oracle, list | None]:
    """Pure form: a new model after ``call`` = (method, kwargs), and its victims (None on OOM)."""
    nxt = copy.deepcopy(oracle)
    method, kwargs = call
    try:
        return nxt, getattr(nxt, method)(**kwargs)
    except ModelOOM:
        return oracle, None
