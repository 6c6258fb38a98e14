"""The oracle: a pure model of what a KV cache's ledger must be, derived from the formulas alone.

It imports no backend code. ``Oracle.apply(op)`` advances the model by one backend call and either
returns the victims it evicted or raises ``ModelOOM`` having changed nothing; ``expected_ledger()``
gives the ledger every correct backend of that layout reports. ``step(state, op)`` is the same as a
pure function over a copied state, for tests and property checks.

Two layouts are modelled: ``paged`` (SPEC §2: blocks, reference counts, copy-on-write) and
``contiguous`` (SPEC §3: one slab per sequence in a first-fit arena). Eviction follows SPEC §5.
A real engine's documented rules that differ from SPEC's (its ``Capabilities``: fork through the
prefix cache, the last prompt token computed again, every full block cached, duplicates kept)
are followed when the engine declares them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from fractions import Fraction

from kvbench.contract import formulas as F
from kvbench.contract.protocol import CacheConfig, Capabilities, Ledger, hash_writer
from kvbench.quant import pool as quant_pool


class ModelOOM(Exception):
    """The model cannot serve the call even after evicting every candidate."""


@dataclass
class SeqState:
    tenant: str
    tokens: int
    final: int
    table: list = field(default_factory=list)  # paged: model block ids
    slab: tuple | None = None  # contiguous: (start, size)
    segments: list = field(default_factory=list)  # [(writer, start, count)]: who wrote each position
    last_access: int = 0
    use_count: int = 0
    hashes: tuple = ()  # block hashes of the prompt (prefix caching)


@dataclass
class TenantStats:
    evictions: int = 0
    recomputed_tokens: int = 0


class Oracle:
    def __init__(self, config: CacheConfig, layout: str = "paged",
                 capabilities: Capabilities | None = None):
        if layout not in ("paged", "contiguous"):
            raise ValueError(f"unknown layout {layout!r}")
        self.config = config
        self.layout = layout
        self.B = config.block_size
        self.seqs: dict[int, SeqState] = {}
        self.preempted: dict[int, SeqState] = {}  # evicted, content kept for the recompute
        # paged model: block id -> [refcount, fill]
        self.blocks: dict[int, list] = {}
        self._next_block = 0
        self.tenant_stats: dict[str, TenantStats] = {}
        # Prefix caching: full blocks registered by hash; a freed one stays cached (evictable,
        # first in first evicted) until its space is needed.
        self.caching = bool(config.prefix_caching) and layout == "paged"
        self.caps = capabilities or Capabilities()
        self.by_hash: dict = {}  # hash -> [cached blocks], first registered first
        self.hash_of: dict = {}
        self.evictable: dict = {}  # block -> None, in eviction order
        self.hit_blocks = 0

    # --- capacity --------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """B * bytes_per_token, or a quantized pool's code + metadata bytes per block."""
        if self.config.kv_format:
            return quant_pool.block_bytes(self.config.kv_format, self.config.model, self.B)
        return F.block_bytes(self.B, self.config.model)

    @property
    def blocks_used(self) -> int:
        return len(self.blocks)

    @property
    def blocks_free(self) -> int:
        return self.config.num_blocks - len(self.blocks)

    def _new_block(self, fill: int) -> int:
        if self.config.num_blocks - len(self.blocks) - len(self.evictable) == 0:
            old = next(iter(self.evictable))  # reuse the least recently freed cached block
            del self.evictable[old]
            h = self.hash_of.pop(old)
            self.by_hash[h].remove(old)
            if not self.by_hash[h]:
                del self.by_hash[h]
        b = self._next_block
        self._next_block += 1
        self.blocks[b] = [1, fill]
        return b

    def _drop_ref(self, b: int) -> None:
        self.blocks[b][0] -= 1
        if self.blocks[b][0] == 0:
            del self.blocks[b]
            if b in self.hash_of:
                self.evictable[b] = None

    def _release(self, table) -> None:
        """Drop a table's references tail first, so a freed prefix's tail is evicted first."""
        for b in reversed(table):
            self._drop_ref(b)

    def _hits(self, hashes) -> list:
        """Cached blocks for the leading run of ``hashes`` (a prefix hit stops at the first miss)."""
        hits = []
        for h in hashes:
            if h not in self.by_hash:
                break
            hits.append(self.by_hash[h][0])
        return hits

    def _cache_hits(self, keys, tokens: int) -> tuple[list, int]:
        """(cached blocks a request of ``tokens`` tokens takes, how many count as hits).

        An engine that computes the last prompt token again counts at most (T - 1) // B; one
        that keeps duplicates also computes those blocks again, into new blocks.
        """
        hits = self._hits(keys)
        counted = len(hits)
        if self.caps.hit_leaves_last_token:
            counted = min(counted, max(0, tokens - 1) // self.B)
        if self.caps.keeps_duplicate_blocks:
            hits = hits[:counted]
        return hits, counted

    def _take(self, hits) -> None:
        """One more reference to each hit, taking a freed one back out of the cache's free side."""
        for b in hits:
            if b in self.blocks:
                self.blocks[b][0] += 1
            else:
                del self.evictable[b]
                self.blocks[b] = [1, self.B]

    def _taken_need(self, n: int, hits, drop) -> int:
        """New blocks for an n-block request, plus cached blocks it takes back from the free pool."""
        return n - len(hits) + sum(1 for b in hits if b not in self.blocks
                                   or self.blocks[b][0] == drop.get(b, 0))

    def _register(self, b: int, key) -> None:
        """Cache block ``b`` under ``key``; a key already cached gets a second block only in an
        engine that keeps duplicates."""
        if key in self.by_hash and not self.caps.keeps_duplicate_blocks:
            return
        self.by_hash.setdefault(key, []).append(b)
        self.hash_of[b] = key

    def _filled(self, b: int) -> None:
        """Block ``b`` just became full: an engine that caches every full block caches it."""
        if self.caching and self.caps.caches_every_full_block and b not in self.hash_of:
            self._register(b, ("block", b))  # a key no other block has: never hit

    # --- what a call needs -----------------------------------------------------------------

    def _append_need(self, seqs, tokens, drop=None) -> int:
        """Blocks a batched append takes, copy-on-write copies included, writers in batch order.

        ``drop``: references that sequences about to be evicted would release, per block.
        """
        ref_delta: dict[int, int] = {b: -d for b, d in (drop or {}).items()}
        need = 0
        for s, dt in zip(seqs, tokens):
            st = self.seqs[s]
            free_last = 0
            if st.table:
                tail = st.table[-1]
                ref, fill = self.blocks[tail]
                free_last = self.B - fill
                if free_last > 0 and dt > 0 and ref + ref_delta.get(tail, 0) > 1:
                    need += 1  # the writer gets its own copy of the shared tail
                    ref_delta[tail] = ref_delta.get(tail, 0) - 1
            need += F.append_new_blocks(dt, free_last, self.B)
        return need

    def _slab_size(self, final: int) -> int:
        policy = self.config.reservation
        if policy == "max":
            if final > self.config.max_context:
                raise ValueError(f"sequence reaches {final} tokens, beyond max_context "
                                 f"{self.config.max_context} of the `max` reservation")
            return self.config.max_context
        if policy == "pow2":
            return F.next_pow2(final)
        if policy == "oracle":
            return final
        raise ValueError(f"unknown reservation policy {policy!r} (max, pow2, oracle)")

    def _first_fit(self, size: int, exclude=(), placed=()) -> int | None:
        """Lowest arena offset with ``size`` free slots, ignoring ``exclude``, counting ``placed``."""
        slabs = sorted([st.slab for s, st in self.seqs.items() if st.slab and s not in exclude]
                       + list(placed))
        pos = 0
        for start, sz in slabs:
            if start - pos >= size:
                return pos
            pos = max(pos, start + sz)
        return pos if self.config.arena_slots - pos >= size else None

    def _fits(self, call, exclude=()) -> bool:
        """Would the call fit if the sequences in ``exclude`` were gone?"""
        if self.layout == "contiguous":
            sizes = call[-1]
            placed = []
            for size in sizes:
                pos = self._first_fit(size, exclude, placed)
                if pos is None:
                    return False
                placed.append((pos, size))
            return True
        drop: dict[int, int] = {}
        for v in exclude:
            for b in self.seqs[v].table:
                drop[b] = drop.get(b, 0) + 1
        freed = sum(1 for b, d in drop.items() if self.blocks[b][0] == d)
        return call[1](drop) <= self.blocks_free + freed

    # --- eviction (SPEC §5) ----------------------------------------------------------------

    def _candidates(self, protect) -> list:
        return [s for s in self.seqs if s not in protect]

    def _pick_victim(self, candidates) -> int:
        policy = self.config.policy
        if policy == "lru":
            return min(candidates, key=lambda s: (self.seqs[s].last_access, s))
        if policy == "lfu":
            return min(candidates, key=lambda s: (self.seqs[s].use_count, self.seqs[s].last_access, s))
        if policy == "fair":
            return self._pick_fair(candidates)
        raise ValueError(f"unknown eviction policy {policy!r} (lru, lfu, fair)")

    def tenant_usage(self) -> dict:
        usage: dict[str, int] = {}
        for st in self.seqs.values():
            usage[st.tenant] = usage.get(st.tenant, 0) + (
                len(st.table) if self.layout == "paged" else st.slab[1])
        return usage

    def weights(self) -> dict:
        tenants = {st.tenant for st in self.seqs.values()} | set(self.config.tenant_weights)
        # Decimal text, not binary: weight 0.1 is exactly 1/10.
        return {t: Fraction(str(self.config.tenant_weights.get(t, 1))) for t in tenants}

    def _pick_fair(self, candidates) -> int:
        w = self.weights()
        total_w = sum(w.values())
        budget = self.config.num_blocks if self.layout == "paged" else self.config.arena_slots
        usage = self.tenant_usage()
        # quota_t = w_t / W * B_total, compared exactly.
        excess = {t: Fraction(u) - w[t] / total_w * budget for t, u in usage.items()}
        over = [t for t in usage if usage[t] * total_w > w[t] * budget]
        for t in sorted(over, key=lambda t: (excess[t], t), reverse=True):
            mine = [s for s in candidates if self.seqs[s].tenant == t]
            if mine:
                return min(mine, key=lambda s: (self.seqs[s].last_access, s))
        return min(candidates, key=lambda s: (self.seqs[s].last_access, s))

    def _evict(self, victim: int) -> None:
        st = self.seqs.pop(victim)
        self._release(st.table)
        st.table, st.slab = [], None
        self.preempted[victim] = st
        self.tenant_stats.setdefault(st.tenant, TenantStats()).evictions += 1

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

    # --- the operations --------------------------------------------------------------------

    def prefill(self, seq, tokens, tenant, final, step, protect=(), hashes=()) -> list:
        """A new sequence of ``tokens`` tokens; ``hashes`` name its full blocks."""
        n = F.blocks_needed(tokens, self.B)
        hashes = tuple(hashes or ())[:tokens // self.B]
        lookup = hashes if self.caching else ()
        sizes = [self._slab_size(final)] if self.layout == "contiguous" else None

        def need(drop):
            return self._taken_need(n, self._cache_hits(lookup, tokens)[0], drop)

        victims = self._make_room(("prefill", need, sizes), set(protect) | {seq})
        st = SeqState(tenant=tenant, tokens=tokens, final=final, last_access=step, use_count=1,
                      segments=content_segments(seq, tokens, hashes, self.B), hashes=hashes)
        if self.layout == "paged":
            hits, counted = self._cache_hits(lookup, tokens)
            self._take(hits)
            self.hit_blocks += counted
            st.table = hits + [self._new_block(min(self.B, tokens - i * self.B))
                               for i in range(len(hits), n)]
            for i in range(len(hits), n):
                if i < len(lookup):
                    self._register(st.table[i], lookup[i])
                elif self.blocks[st.table[i]][1] == self.B:
                    self._filled(st.table[i])
        else:
            st.slab = (self._first_fit(sizes[0]), sizes[0])
        self.seqs[seq] = st
        self.tenant_stats.setdefault(tenant, TenantStats())
        return victims

    def recompute(self, seq, step, protect=()) -> list:
        """Re-prefill an evicted sequence to its current length, with the content it had."""
        st = self.preempted[seq]
        victims = self.prefill(seq, st.tokens, st.tenant, st.final, step, protect, st.hashes)
        self.seqs[seq].segments = list(st.segments)
        del self.preempted[seq]
        self.tenant_stats[st.tenant].recomputed_tokens += st.tokens
        return victims

    def append(self, seqs, tokens, step) -> list:
        for s, dt in zip(seqs, tokens):
            st = self.seqs[s]
            if self.layout == "contiguous" and st.tokens + dt > st.slab[1]:
                raise ValueError(f"sequence {s} grows to {st.tokens + dt} tokens, beyond its "
                                 f"{st.slab[1]}-slot reservation")
        call = ("append", lambda drop: self._append_need(seqs, tokens, drop), [])
        victims = self._make_room(call, set(seqs))
        for s, dt in zip(seqs, tokens):
            st = self.seqs[s]
            if self.layout == "paged":
                self._paged_write(st, dt)
            st.segments.append((s, st.tokens, dt))
            st.tokens += dt
            st.last_access = step
            st.use_count += 1
        return victims

    def _paged_write(self, st: SeqState, dt: int) -> None:
        if st.table:
            tail = st.table[-1]
            ref, fill = self.blocks[tail]
            if fill < self.B:
                if ref > 1:  # copy-on-write: the writer gets a private copy of the tail
                    self._drop_ref(tail)
                    tail = self._new_block(fill)
                    st.table[-1] = tail
                take = min(dt, self.B - fill)
                self.blocks[tail][1] += take
                dt -= take
                if self.blocks[tail][1] == self.B:
                    self._filled(tail)
        while dt > 0:
            take = min(dt, self.B)
            st.table.append(self._new_block(take))
            dt -= take
            if take == self.B:
                self._filled(st.table[-1])

    def fork(self, seq, src, final, step) -> list:
        parent = self.seqs[src]
        via = self.caps.fork_via if self.layout == "paged" else "share"
        victims = []
        if self.layout == "contiguous":
            size = self._slab_size(final)
            call = ("fork", None, [size])
            victims = self._make_room(call, {seq, src})
        elif via != "share":
            keys = self._fork_keys(parent, via)
            n = len(parent.table)
            call = ("fork", lambda drop: self._taken_need(
                n, self._cache_hits(keys, parent.tokens)[0], drop), [])
            victims = self._make_room(call, {seq, src})
        child = SeqState(tenant=parent.tenant, tokens=parent.tokens, final=final,
                         segments=list(parent.segments), last_access=step, use_count=1)
        if self.layout == "contiguous":
            child.slab = (self._first_fit(size), size)
        elif via == "share":
            child.table = list(parent.table)
            for b in child.table:
                self.blocks[b][0] += 1
        else:  # a new request with the parent's tokens: cached blocks taken, the rest computed
            hits = self._cache_hits(keys, parent.tokens)[0]
            self._take(hits)
            child.table = hits + [self._new_block(self.blocks[b][1]) for b in parent.table[len(hits):]]
            for b, pb in zip(child.table[len(hits):], parent.table[len(hits):]):
                if self.caching and pb in self.hash_of and self.blocks[b][1] == self.B:
                    self._register(b, self.hash_of[pb])  # the same content as the parent's
        self.seqs[seq] = child
        return victims

    def _fork_keys(self, parent: SeqState, via: str) -> list:
        """Cache keys a fork served as a new request looks up: the parent's full blocks' (none
        with ``copy``, or without a prefix cache)."""
        if via == "copy" or not self.caching:
            return []
        keys = []
        for b in parent.table[:parent.tokens // self.B]:
            if b not in self.hash_of:
                break
            keys.append(self.hash_of[b])
        return keys

    def free(self, seq) -> None:
        if seq in self.preempted:
            del self.preempted[seq]
            return
        self._release(self.seqs.pop(seq).table)

    # --- the expected ledger ---------------------------------------------------------------

    def expected_ledger(self) -> Ledger:
        B = self.B
        bpt = self.config.model.bytes_per_token
        tokens = {s: st.tokens for s, st in self.seqs.items()}
        if self.layout == "paged":
            cap = len(self.blocks) * B
            free_slots = sum(B - fill for _, fill in self.blocks.values())
            token_states = cap - free_slots
            reservation = 0
            for st in self.seqs.values():
                if st.table:
                    ref, fill = self.blocks[st.table[-1]]
                    if ref == 1:
                        reservation += min(B - fill, max(0, st.final - st.tokens))
            return Ledger(
                blocks_used=len(self.blocks), blocks_free=self.blocks_free, tokens=tokens,
                seq_blocks={s: len(st.table) for s, st in self.seqs.items()},
                capacity_slots=cap, free_slots=free_slots,
                fragmentation=F.fragmentation(free_slots, cap),
                bytes_in_use=len(self.blocks) * self.block_bytes,
                shared_blocks=sum(1 for ref, _ in self.blocks.values() if ref > 1),
                token_states=token_states, reservation=reservation,
                internal_fragmentation=free_slots - reservation, external_fragmentation=0,
                free=self.blocks_free * B, cached_blocks=len(self.evictable),
                prefix_hit_blocks=self.hit_blocks)
        slabs = sorted(st.slab for st in self.seqs.values())
        cap = sum(size for _, size in slabs)
        token_states = sum(tokens.values())
        reservation = sum(min(st.slab[1], st.final) - st.tokens for st in self.seqs.values())
        high = max((start + size for start, size in slabs), default=0)
        external = high - cap
        return Ledger(
            blocks_used=None, blocks_free=None, tokens=tokens,
            seq_blocks={s: st.slab[1] for s, st in self.seqs.items()},
            capacity_slots=cap, free_slots=cap - token_states,
            fragmentation=F.fragmentation(cap - token_states, cap),
            bytes_in_use=cap * bpt, shared_blocks=None,
            token_states=token_states, reservation=reservation,
            internal_fragmentation=cap - token_states - reservation,
            external_fragmentation=external, free=self.config.arena_slots - high)

    def expected_content(self, seq) -> list:
        """[(writer, start, count)] segments whose K/V the sequence must read back."""
        return list(self.seqs[seq].segments)

    def family_of(self, seq) -> set:
        """Live sequences that share a block with ``seq`` (whose reads a bad write could change)."""
        table = self.seqs[seq].table if self.layout == "paged" else ()
        if not any(self.blocks[b][0] > 1 for b in table):
            return {seq}
        mine = set(table)
        return {s for s, st in self.seqs.items() if mine.intersection(st.table)} | {seq}


def content_segments(seq: int, tokens: int, hashes, block_size: int) -> list:
    """Who "wrote" each position of a prefill: a hashed full block holds what its prefix
    determines (the same for every sequence with that hash), the rest is the sequence's own."""
    segments = [(hash_writer(h), i * block_size, block_size) for i, h in enumerate(hashes)]
    done = len(hashes) * block_size
    if tokens > done:
        segments.append((seq, done, tokens - done))
    return segments


def step(oracle: Oracle, call: tuple) -> tuple[Oracle, list | None]:
    """Pure form: a new model after ``call`` = (method, kwargs), and its victims (None on OOM)."""
    nxt = copy.deepcopy(oracle)
    method, kwargs = call
    try:
        return nxt, getattr(nxt, method)(**kwargs)
    except ModelOOM:
        return oracle, None
