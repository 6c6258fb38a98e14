"""The oracle: a pure model of what a KV cache's ledger must be, derived from the formulas alone.

Over 500 lines: one model of two layouts (paged and contiguous), each over KV cache groups, with
eviction, prefix caching and the block order; split, the rules that tie them (what an operation
needs, what it releases, which victims go) would be spread over modules that each need the rest.

It imports no backend code. ``Oracle.apply(op)`` advances the model by one backend call and either
returns the victims it evicted or raises ``ModelOOM`` having changed nothing; ``expected_ledger()``
gives the ledger every correct backend of that layout reports. ``step(state, op)`` is the same as a
pure function over a copied state, for tests and property checks.

Two layouts are modelled: ``paged`` (SPEC §2: blocks, reference counts, copy-on-write) and
``contiguous`` (SPEC §3: one slab per sequence and group in a first-fit arena). Eviction follows
SPEC §5; KV cache groups, sliding windows and hybrid prefix hits SPEC §8; salted, tagged block
keys SPEC §9. A real engine's documented rules that differ from SPEC's (its ``Capabilities``: fork
through the prefix cache, the last prompt token computed again, every full block cached,
duplicates kept, window blocks released at the next allocation, only the window runs a hit can
end on cached: window_retention; SGLang's radix tree: whole leaves evicted before an allocation,
for a page per request, the capped hit's block computed again) are followed when it declares them.

The paged model also fixes which physical block each operation takes (docs/writing-a-backend.md), so a backend that declares ``block_ids`` is compared with it block by block:

- Uncached free blocks form a stack (initially 0 on top, then 1, 2, ...); cached free blocks
  (hashed, no reference) a queue. A block is taken from the stack; when it is empty, the oldest
  cached block is taken and its hash forgotten.
- A released block that reaches 0 references is pushed on the stack, or appended to the cached
  queue if it is hashed. Freeing or evicting a sequence releases group by group, each group's
  blocks from the tail to the head; a sliding window releases group by group, writers in batch
  order, each writer's blocks from the highest position down.
- A prefill takes its prefix hits (every group) first, then new blocks group by group in position
  order; an append takes, group by group, the copies of shared tails (writers in batch order),
  then the new blocks (writers in batch order, positions in order).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from kvbench.checking import window_retention
from kvbench.contract import formulas as F
from kvbench.contract.protocol import (
    BlockChanges,
    BlockState,
    CacheConfig,
    Capabilities,
    Ledger,
    hash_writer,
)
from kvbench.checking.radix_tree import RadixTree
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


def extra_keys(salt=None, adapter=None) -> tuple:
    """A prefill's extra keys, each tagged with its kind: a salt "x" and an adapter "x" differ."""
    return tuple((kind, v) for kind, v in (("salt", salt), ("adapter", adapter)) if v is not None)


class Oracle:
    def __init__(self, config: CacheConfig, layout: str = "paged",
                 capabilities: Capabilities | None = None):
        if layout not in ("paged", "contiguous"):
            raise ValueError(f"unknown layout {layout!r}")
        self.config = config
        self.layout = layout
        self.caps = capabilities or Capabilities()
        self.window_release = self.caps.window_release
        self.B = config.block_size
        self.groups = config.model.kv_groups
        self.windows = [g.window for g in self.groups]
        self.releasing = [g.releases for g in self.groups]  # sliding, chunked, sinks (SPEC §12)
        self.seqs: dict[int, SeqState] = {}
        self.preempted: dict[int, SeqState] = {}  # evicted, content kept for the recompute
        # paged model: block id -> [refcount, fill]; the group each block in use serves
        self.blocks: dict[int, list] = {}
        self.group_of: dict[int, int] = {}
        # The uncached free blocks as a stack, top = end, on top of the blocks never handed out
        # (fresh .. num_blocks - 1, fresh taken first): no list as long as the pool.
        self.free_stack: list = []
        self.fresh = 0
        self.tenant_stats: dict[str, TenantStats] = {}
        # Prefix caching: full blocks registered by (group, key); a freed one stays cached
        # (evictable, first in first evicted) until its space is needed.
        self.caching = bool(config.prefix_caching) and layout == "paged"
        self.by_hash: dict = {}  # (group, key) -> [cached blocks], first registered first
        self.hash_of: dict = {}  # block -> (group, key)
        self.evictable: OrderedDict = OrderedDict()  # block -> None, in eviction order
        self.hit_blocks = 0
        # The ledger's sums, kept as references and fills change (expected_ledger() walks no
        # block): slots filled in blocks in use, blocks with 2+ references, blocks in use per
        # group, each block's references; and per sequence (reservation, blocks held, tenant),
        # settled for the sequences changed since and those that may share a tail (forks).
        self.filled = self.shared = 0
        self.group_used = [0] * len(self.groups)
        self.refs = np.zeros(config.num_blocks, dtype=np.int64)
        self._per_seq: dict = {}
        self._dirty: set = set()
        self._sharing: set = set()
        self._res_total = 0
        self._usage: dict = {}  # tenant -> [blocks (slots) held, live sequences]
        self.edits = 0  # changes of any reference count: what block structures a check must reread
        # What changed since the last block_state() (its mark): the fewest uncached free
        # blocks since, and the cached queue's entries and exits, in order.
        self._mark = None
        self._free_low = 0
        self._cached_log: list | None = None
        self._ids = None  # free_list()'s buffer
        self._nodes: dict = {}  # token-id prefixes -> node number (keys exact, never hashed)
        self.writers: dict = {}  # untagged block content -> {extra keys: first sequence}
        self._spec_from: dict = {}  # during an append: sequence -> its first draft position
        self._chunk_done: list = []  # during an append: (block, group, key) its chunks completed
        # An engine's radix tree over the cached blocks (Capabilities.evicts_whole_leaves), and
        # per live request [its prompt's full blocks, the blocks it inserted] (one group).
        self.tree = RadixTree(self.caps.leaf_order) if (
            self.caching and self.caps.evicts_whole_leaves) else None
        self._tree_reqs: dict = {}
        self._lives: dict = {}  # sequence -> times preempted (its resume writes blocks anew)

    # --- capacity --------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """B * 2 * L_group * H_kv * d_head * s, or a quantized pool's code + metadata bytes."""
        return quant_pool.pool_block_bytes(self.config)

    @property
    def blocks_used(self) -> int:
        return len(self.blocks)

    @property
    def blocks_free(self) -> int:
        return self.config.num_blocks - len(self.blocks)

    @property
    def uncached_free(self) -> int:
        """Free blocks that hold no cached prefix."""
        return len(self.free_stack) + self.config.num_blocks - self.fresh

    def _new_block(self, fill: int, group: int) -> int:
        self.edits += 1
        if self.free_stack:
            b = self.free_stack.pop()
        elif self.fresh < self.config.num_blocks:
            b = self.fresh
            self.fresh += 1
        else:  # reuse the least recently freed cached block
            b = next(iter(self.evictable))
            self._uncache(b)
        self.blocks[b] = [1, fill]
        self.group_of[b] = group
        self.filled += fill
        self.group_used[group] += 1
        self.refs[b] = 1
        self._free_low = min(self._free_low, self.uncached_free)
        return b

    def _uncache(self, b: int) -> None:
        """A cached free block forgets its key (it leaves the cache's free side)."""
        del self.evictable[b]
        self._log_cached(b, False)
        key = self.hash_of.pop(b)
        self.by_hash[key].remove(b)
        if not self.by_hash[key]:
            del self.by_hash[key]

    def _drop_ref(self, b: int) -> None:
        self.edits += 1
        self.blocks[b][0] -= 1
        self.refs[b] -= 1
        self.shared -= self.blocks[b][0] == 1
        if self.blocks[b][0] == 0:
            self.filled -= self.blocks[b][1]
            self.group_used[self.group_of[b]] -= 1
            del self.blocks[b]
            del self.group_of[b]
            if b in self.hash_of:
                self.evictable[b] = None
                self._log_cached(b, True)
            else:
                self.free_stack.append(b)

    def _release(self, st: SeqState) -> None:
        """Drop every reference of a sequence: group by group, each tail first (its kept
        lookahead slots before it)."""
        for g, table in enumerate(st.tables):
            for b in reversed(table if not st.ahead else table + st.ahead[g]):
                if b is not None:
                    self._drop_ref(b)
        st.ahead = []

    # --- block keys (SPEC §9) --------------------------------------------------------------

    def prompt_keys(self, tokens: int, hashes=None, token_ids=None, salt=None, adapter=None,
                    tagged: bool = True) -> tuple:
        """Keys of the prompt's full blocks: equal keys, equal prefix (and equal K/V).

        From block hashes (each already names its prefix): the hash, with the tagged extra keys.
        From token ids: the exact prefix, as a node of a trie whose root holds the extra keys.
        ``tagged=False``: the same without extra keys (what the content alone would share).
        """
        n = tokens // self.B
        extra = extra_keys(salt, adapter) if tagged else ()
        if token_ids is not None:
            keys, parent = [], ("root", extra)
            for i in range(min(n, len(token_ids) // self.B)):
                node = (parent, tuple(token_ids[i * self.B:(i + 1) * self.B]))
                parent = ("ids", self._nodes.setdefault(node, len(self._nodes)))
                keys.append(parent)
            return tuple(keys)
        hashes = tuple(hashes or ())[:n]
        return tuple((extra, h) for h in hashes) if extra else hashes

    def _hit_plan(self, keys) -> tuple[int, list]:
        """The hit (SPEC §8, §12): the longest prefix of L blocks such that every full group has
        its blocks below L cached and every releasing group those it would hold at LB tokens
        (sliding: covering [max(0, LB - W + 1), LB); chunked: the current chunk's; sinks: the
        sinks' and the window's). Returns L and, per group, {position: cached block}."""
        if not keys:
            return 0, [{} for _ in self.groups]
        for L in range(self.full_run(keys), 0, -1):
            need = [F.held_blocks(L * self.B, group, self.B) for group in self.groups]
            if all((g, keys[i]) in self.by_hash for g, rel in enumerate(self.releasing) if rel
                   for i in need[g]):
                return L, [{i: self.by_hash[(g, keys[i])][0] for i in need[g]}
                           for g in range(len(self.groups))]
        return 0, [{} for _ in self.groups]

    def full_run(self, keys) -> int:
        """How many of the prompt's blocks, from the first, every full group has cached."""
        top = len(keys)
        for g, rel in enumerate(self.releasing):
            if not rel:
                run = 0
                while run < top and (g, keys[run]) in self.by_hash:
                    run += 1
                top = run
        return top

    def _cache_hits(self, keys, tokens: int) -> tuple[int, list, int]:
        """(L, per group the cached blocks taken by position, how many count as hits).

        An engine running EAGLE drops the last block it matched; one that computes the last
        prompt token again counts positions below
        (T - 1) // B only; one that keeps duplicates also computes the rest again, into new
        blocks (its hit is then searched within the cap)."""
        if self._chunk_rule():
            L, hits = self._chunk_start_hit(keys, tokens)
            return L, hits, sum(1 for per in hits for i in per if i < L)
        L, hits = self._hit_plan(keys)
        if self.caps.hit_drops_last_block and L:  # EAGLE: the last matched block computed again
            L, hits = self._hit_plan(keys[:L - 1])
        counted = L
        if self.caps.hit_leaves_last_token:
            counted = min(L, max(0, tokens - 1) // self.B)
        if (self.caps.keeps_duplicate_blocks or self.caps.capped_hit_recomputed) and counted < L:
            L, hits = self._hit_plan(keys[:counted])
            counted = L
        return L, hits, sum(1 for per in hits for i in per if i < counted)

    def _most_hit_tokens(self, tokens: int) -> int:
        """The most tokens of a ``tokens``-token prompt a hit may cover (``hit_leaves_last_token``:
        the last one is computed again)."""
        return max(0, tokens - 1) if self.caps.hit_leaves_last_token else tokens

    def _chunk_rule(self) -> bool:
        """``chunk_start_hit`` applies: a prefix cache and a model of chunked groups alone."""
        return (self.caching and self.caps.chunk_start_hit
                and all(g.family == "chunked" for g in self.groups))

    def _chunk_start_hit(self, keys, tokens: int) -> tuple[int, list]:
        """``chunk_start_hit``'s hit of a ``tokens``-token prompt: (L, per group {position: cached
        block}). A group's lookup of at most M tokens counts its blocks left of the chunk of
        token M as computed (taking none, cached or not) and looks up from there; the hit is the
        length every group accepts, M lowered to each group's answer in turn until none lowers
        it (vLLM's fixed point: groups of two sizes agree where their chunk starts meet); one
        group answers once (vLLM's coordinator of one group asks it once)."""
        M = self._most_hit_tokens(tokens)
        while True:
            cur, starts = M, []
            for g, group in enumerate(self.groups):
                start, end = window_retention.chunk_lookup(self.by_hash, keys, [g], group.chunk,
                                                           cur, self.B)
                starts.append(start)
                cur = end * self.B
            if cur >= M or len(self.groups) == 1:
                break
            M = cur
        L = cur // self.B  # every group's lookup of the last round ended at L
        return L, [{i: self.by_hash[(g, keys[i])][0] for i in range(starts[g], L)}
                   for g in range(len(self.groups))]

    def _taken_back(self, hits, drop) -> int:
        """Cached blocks of ``hits`` a request takes back from the free pool."""
        return sum(1 for per in hits for b in per.values()
                   if b not in self.blocks or self.blocks[b][0] == drop.get(b, 0))

    def _take_hits(self, hits) -> None:
        """One more reference to each hit, taking a freed one back out of the cache's free side."""
        for per in hits:
            for b in per.values():
                if b in self.blocks:
                    self._add_ref(b)
                else:
                    del self.evictable[b]
                    self._log_cached(b, False)
                    self.blocks[b] = [1, self.B]
                    self.group_of[b] = self.hash_of[b][0]
                    self.filled += self.B
                    self.group_used[self.group_of[b]] += 1
                    self.refs[b] = 1
                self.edits += 1

    def _add_ref(self, b: int) -> None:
        self.blocks[b][0] += 1
        self.refs[b] += 1
        self.shared += self.blocks[b][0] == 2

    def _register(self, b: int, g: int, key) -> None:
        """Cache block ``b`` of group ``g`` under ``key``; a key already cached gets a second
        block only in an engine that keeps duplicates."""
        if (g, key) in self.by_hash and not self.caps.keeps_duplicate_blocks:
            return
        self.by_hash.setdefault((g, key), []).append(b)
        self.hash_of[b] = (g, key)

    def _filled(self, b: int, g: int, seq, i: int) -> None:
        """Block ``b`` (position ``i`` of ``seq``, group ``g``) just became full: an engine that
        caches every full block caches it, under a key no other sequence's block has (never hit
        by another prompt) and that every group of ``seq`` shares at that position (so a fork
        served through the prefix cache finds the parent's blocks in every group)."""
        st = self.seqs.get(seq)
        if st is not None and not self._keeps(st, g, i):
            if self.caching and self.caps.caches_every_full_block:  # a fork still names it
                st.released_keys.setdefault(i, ("filled", seq, i))
            return
        if self.caching and self.caps.caches_every_full_block and b not in self.hash_of:
            self._register(b, g, self._filled_key(seq, i))

    def _filled_key(self, seq, i: int) -> tuple:
        """The key of ``seq``'s block ``i`` cached once full (``_filled``): a resumed sequence's
        blocks are new content to the cache."""
        life = self._lives.get(seq, 0)
        return ("filled", seq, i) + ((life,) if life else ())

    def _note_writers(self, seq, untagged, extra) -> None:
        for key in untagged:
            self.writers.setdefault(key, {}).setdefault(extra, seq)

    def _retention(self, keys, prompt_tokens: int, tokens: int, L: int) -> list:
        """Per group, the positions of a new request's blocks a sparse window retention caches
        (window_retention), given its prompt, its hit's keys and its hit of L blocks; [] without
        that rule. Read before the request takes a block (its new blocks may evict a cached one)."""
        if not (self.caps.sparse_window_retention and self.caching
                and any(g.family == "sliding" for g in self.groups)):
            return []
        cap = max(0, tokens - 1) // self.B if self.caps.hit_leaves_last_token else len(keys)
        top = window_retention.first_group_hit(
            self.by_hash, self.groups, keys, cap, self.B,
            self._most_hit_tokens(tokens) if self.caps.chunk_start_hit else None)
        junction = top if top > L else 0
        return [window_retention.retained_positions(prompt_tokens, junction, group, self.B)
                for group in self.groups]

    @staticmethod
    def _keeps(st: SeqState, g: int, i: int) -> bool:
        """Whether group ``g`` caches position ``i`` of ``st`` once full (sparse retention)."""
        return not st.retained or st.retained[g] is None or i in st.retained[g]

    def cross_key_writers(self, seq) -> list:
        """Earlier sequences that wrote the same prompt blocks as ``seq`` under other extra keys
        (another salt or adapter): a block shared with one of them is a cross-tenant leak."""
        st = self.seqs.get(seq) or self.preempted.get(seq)
        if st is None or not st.prompt.get("untagged"):
            return []
        mine = st.prompt["extra"]
        found = {}
        for key in st.prompt["untagged"]:
            for extra, s in self.writers.get(key, {}).items():
                if extra != mine and s != seq:
                    found.setdefault(s, extra)
        # First those whose keys carry the same values under other kinds (a salt "x" and an
        # adapter "x"): what an untagged hash confuses.
        values = sorted(v for _, v in mine)
        return sorted(found.items(), key=lambda item: (sorted(v for _, v in item[1]) != values, item[0]))

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
                need += max(0, F.append_new_blocks(dt, free_last, self.B) - (len(ahead[g]) if ahead else 0))
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

    def _slab_sizes(self, final: int) -> list:
        """One slab per group; a sliding group's is a ring capped at its window."""
        size = self._slab_size(final)
        return [size if w is None else min(size, w) for w in self.windows]

    def _first_fit(self, size: int, exclude=(), placed=()) -> int | None:
        """Lowest arena offset with ``size`` free slots, ignoring ``exclude``, counting ``placed``."""
        slabs = sorted([slab for s, st in self.seqs.items() if s not in exclude for slab in st.slabs]
                       + list(placed))
        pos = 0
        for start, sz in slabs:
            if start - pos >= size:
                return pos
            pos = max(pos, start + sz)
        return pos if self.config.arena_slots - pos >= size else None

    def _place(self, sizes, exclude=()) -> list | None:
        """First-fit offsets for a sequence's slabs, in group order; None if one does not fit."""
        placed = []
        for size in sizes:
            pos = self._first_fit(size, exclude, placed)
            if pos is None:
                return None
            placed.append((pos, size))
        return placed

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
        policy = self.config.policy
        if policy == "lru":
            return min(candidates, key=lambda s: (self.seqs[s].last_access, s))
        if policy == "lfu":
            return min(candidates, key=lambda s: (self.seqs[s].use_count, self.seqs[s].last_access, s))
        if policy == "fair":
            return self._pick_fair(candidates)
        raise ValueError(f"unknown eviction policy {policy!r} (lru, lfu, fair)")

    def tenant_usage(self) -> dict:
        """Blocks (slots, contiguous) in the tables of each tenant with a live sequence."""
        self._settle()
        return {t: u for t, (u, n) in self._usage.items() if n}

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

    # --- an engine's radix tree and eager eviction (Capabilities.evicts_whole_leaves,
    # eviction_demand, capped_hit_recomputed) ----------------------------------------------

    def _tree_match(self, keys, tokens: int) -> None:
        """The engine's match at admission (refused or not): it walks the blocks it may hit."""
        if self.tree is not None:
            cap = max(0, tokens - 1) // self.B if self.caps.hit_leaves_last_token else len(keys)
            self.tree.match(list(keys[:cap]))

    def _tree_checkpoint(self, seq, prompt: int | None = None, release: bool = False) -> None:
        """The engine's checkpoint of a request: insert its full blocks, then split the path at
        its prompt's (``prompt``: a new request's prompt blocks; ``release``: its last one)."""
        if self.tree is None:
            return
        if prompt is not None:
            self._tree_reqs[seq] = [prompt, 0]
        st, (prompt, inserted) = self.seqs[seq], self._tree_reqs[seq]
        keys = []
        for b in st.tables[0][:st.tokens // self.B]:
            if b not in self.hash_of:
                break
            keys.append(self.hash_of[b][1])
        self.tree.insert(keys, inserted)
        if 0 < prompt < len(keys):
            self.tree.insert(keys[:prompt], prompt, priority=1)
        self._tree_reqs[seq][1] = max(inserted, len(keys))
        if release:
            del self._tree_reqs[seq]

    def _locked(self, keys) -> bool:
        return any(self.by_hash[(0, k)][0] in self.blocks for k in keys)

    def _evict_before_alloc(self, need: int, new_tokens: list, decode: bool = False) -> None:
        """An engine that evicts before it allocates: for ``need`` blocks, or (page_per_request)
        for the new tokens plus one page per request (a decode step: a page per request), beyond
        the uncached free blocks; whole leaves of its tree, or cached blocks first released first."""
        new_tokens = [t for t in new_tokens if t > 0]  # a request allocating nothing
        if not self.caching or not new_tokens or (
                self.tree is None and self.caps.eviction_demand == "need"):
            return  # SPEC: a cached block goes only when a block is taken
        if self.caps.eviction_demand == "page_per_request" and self.B > 1:
            need = len(new_tokens) if decode else -(-sum(new_tokens) // self.B) + len(new_tokens)
        short = need - self.uncached_free
        if short <= 0:
            return
        if self.tree is None:
            gone = list(self.evictable)[:short]
        else:
            gone = [self.by_hash[(0, k)][0] for k in self.tree.evict(short, self._locked)]
        for b in gone:
            self._uncache(b)
            self.free_stack.append(b)
            self.edits += 1

    def _share_cached(self, table, g: int, i: int, key) -> None:
        """capped_hit_recomputed: block ``i``, computed again, goes back if the cache still holds
        its key, and the cached block is shared instead (the insert frees the duplicate)."""
        if not self.caps.capped_hit_recomputed or (g, key) not in self.by_hash:
            return
        cached = self.by_hash[(g, key)][0]
        if cached != table[i]:
            self._drop_ref(table[i])
            self._take_hits([{i: cached}])
            table[i] = cached

    # --- sliding windows (SPEC §8) ---------------------------------------------------------

    def _release_windows(self, seqs, lengths) -> None:
        """Release every block of ``seqs`` a group no longer holds at T tokens (T from
        ``lengths``; F.released_blocks: below ``T - W + 1`` for a sliding group, below the
        current chunk for a chunked one, between the sinks and the window for sinks): group by
        group, writers in batch order, highest position first."""
        for g, group in enumerate(self.groups):
            if not group.releases:
                continue
            for s in seqs:
                self._dirty.add(s)
                st = self.seqs[s]
                table = st.tables[g]
                gone = F.released_blocks(lengths[s], group, self.B)
                for i in range(min(gone.stop, len(table)) - 1, gone.start - 1, -1):
                    if table[i] is not None:
                        if table[i] in self.hash_of:  # a fork through the prefix cache names it
                            st.released_keys[i] = self.hash_of[table[i]][1]
                        self._drop_ref(table[i])
                        table[i] = None

    def _snapshot(self):
        marks = (self._free_low, None if self._cached_log is None else len(self._cached_log))
        return copy.deepcopy((self.seqs, self.blocks, self.group_of, self.free_stack, self.fresh,
                              self.evictable, self.by_hash, self.hash_of, self.filled, self.shared,
                              self.group_used, self.refs)), marks

    def _restore(self, snap) -> None:
        snap, (self._free_low, logged) = snap
        (self.seqs, self.blocks, self.group_of, self.free_stack, self.fresh, self.evictable,
         self.by_hash, self.hash_of, self.filled, self.shared, self.group_used, self.refs) = snap
        if logged is not None:  # the changes undone are no changes
            del self._cached_log[logged:]
        self._dirty.update(self.seqs)  # sequences are new objects: settle them again

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
            return G * (n - L) + self._taken_back(hits, drop)

        self._tree_match(lookup, tokens)
        victims = self._make_room(("prefill", need, sizes), set(protect) | {seq})
        untagged = self.prompt_keys(tokens, hashes, token_ids, tagged=False) if keys else ()
        extra = extra_keys(salt, adapter)
        st = SeqState(tenant=tenant, tokens=tokens, final=final, last_access=step, use_count=1,
                      segments=content_segments(seq, tokens, whole, self.B),
                      prompt={"hashes": tuple(hashes or ()) or None, "salt": salt, "adapter": adapter,
                              "token_ids": token_ids, "extra": extra, "untagged": untagged})
        if prompt_tokens is not None and prompt_tokens > tokens:  # the chunks still to come
            st.prompt.update(prompt_tokens=prompt_tokens, chunk_keys=whole)
        self._note_writers(seq, untagged, extra)
        if self.layout == "paged":
            L, hits, counted = self._cache_hits(lookup, tokens)
            st.retained = self._retention(lookup, prompt_tokens or tokens, tokens, L)
            self._take_hits(hits)
            self.hit_blocks += counted
            self._evict_before_alloc(G * (n - L), [tokens - L * self.B])
            st.tables = [[hits[g].get(i) for i in range(L)]
                         + [self._new_block(min(self.B, tokens - i * self.B), g) for i in range(L, n)]
                         for g in range(G)]
            self.seqs[seq] = st  # first: a full block's caching reads its retention
            for g in range(G):
                for i in range(L, n):
                    if i < len(lookup):
                        if self._keeps(st, g, i):
                            self._share_cached(st.tables[g], g, i, lookup[i])
                            self._register(st.tables[g][i], g, lookup[i])
                    elif self.blocks[st.tables[g][i]][1] == self.B:
                        self._filled(st.tables[g][i], g, seq, i)
            self._dirty.add(seq)
            self._tree_checkpoint(seq, prompt=tokens // self.B)
            if self.window_release == "end_of_operation":
                self._release_windows([seq], {seq: tokens})
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
                    st.tokens + dt > size for (_, size), w in zip(st.slabs, self.windows) if w is None):
                raise ValueError(f"sequence {s} grows to {st.tokens + dt} tokens, beyond its "
                                 f"{st.slab[1]}-slot reservation")
        call = ("append", lambda drop: self._append_need(seqs, tokens, drop), [])
        lazy = self.layout == "paged" and self.window_release == "next_allocation"
        snap = self._snapshot() if lazy and any(self.releasing) else None
        if snap is not None:  # vLLM: the request's next allocation first drops what slid out
            self._release_windows(seqs, {s: self.seqs[s].tokens for s in seqs})
        try:
            victims = self._make_room(call, set(seqs))
        except ModelOOM:
            if snap is not None:
                self._restore(snap)
            raise
        self._spec_from = {s: self.seqs[s].tokens + dt - d for s, dt, d in zip(seqs, tokens, drafts)
                           if d} if drafts else {}
        if self.layout == "paged":
            grow = [dt for dt in tokens if dt > 0]
            self._evict_before_alloc(self._append_need(seqs, tokens), grow,
                                     decode=all(dt == 1 for dt in grow))
            self._paged_write(seqs, tokens)
            # after every block the append takes: a cached copy its allocations evicted is gone
            for b, g, key in self._chunk_done:
                self._register(b, g, key)
            self._chunk_done = []
            for s in seqs:  # blocks its last accept completed with kept drafts
                st = self.seqs[s]
                for g, i in st.later:
                    self._filled(st.tables[g][i], g, s, i)
                st.later = []
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
        if self.layout == "paged" and not lazy:
            self._release_windows(seqs, {s: self.seqs[s].tokens for s in seqs})
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
                    table.append(self._next_block(s, take, g))
                    dt -= take
                    if take == self.B:
                        self._completed(table[-1], g, s, len(table) - 1)

    def _next_block(self, seq, fill: int, g: int) -> int:
        """The block a write past ``seq``'s table takes: a lookahead slot it kept, else a new one."""
        ahead = self.seqs[seq].ahead
        if not ahead or not ahead[g]:
            return self._new_block(fill, g)
        b = ahead[g].pop(0)
        self.blocks[b][1] = fill
        self.filled += fill
        self.edits += 1
        return b

    def _completed(self, b: int, g: int, seq, i: int) -> None:
        """An append wrote the last slot of block ``b`` (position ``i`` of ``seq``, group ``g``):
        a block of a chunked prompt becomes the cache entry of its key once the append has taken
        its blocks (as an engine caches after allocating); a block holding a draft
        token is cached by no engine (its accept may still roll it back)."""
        chunk = self.seqs[seq].prompt.get("chunk_keys")
        if chunk is not None and i < len(chunk):
            if self.caching and self._keeps(self.seqs[seq], g, i):
                self._chunk_done.append((b, g, chunk[i]))
        elif (i + 1) * self.B <= self._spec_from.get(seq, (i + 1) * self.B):
            self._filled(b, g, seq, i)

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
            lookahead = self.caps.lookahead_slots
            if lookahead and not st.ahead:
                st.ahead = [[] for _ in st.tables]
            for g, table in enumerate(st.tables):
                if lookahead:  # kept, unwritten, for the next drafts (never shared: drafts wrote them)
                    for b in table[keep:]:
                        self.filled -= self.blocks[b][1]
                        self.blocks[b][1] = 0
                    st.ahead[g][:0] = table[keep:]
                    self.edits += 1
                else:
                    for b in reversed(table[keep:]):
                        if b is not None:
                            self._drop_ref(b)
                del table[keep:]
                if keep and table[-1] is not None:
                    b = table[-1]
                    fill = new - (keep - 1) * self.B
                    self.filled += fill - self.blocks[b][1]
                    self.blocks[b][1] = fill
                for i in range(first_draft // self.B, new // self.B):  # full now, drafts kept
                    if table[i] is not None and self.caps.kept_drafts_cached_at_next_append:
                        st.later.append((g, i))
                    elif table[i] is not None:
                        self._filled(table[i], g, seq, i)
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
        via = self.caps.fork_via if self.layout == "paged" else "share"
        G, n = len(self.groups), len(parent.tables[0]) if parent.tables else 0
        victims = []
        if self.layout == "contiguous":
            sizes = self._slab_sizes(final)
            victims = self._make_room(("fork", None, sizes), {seq, src})
        elif via != "share":
            self._tree_checkpoint(src)  # the child finds the parent's blocks in the tree
            keys = self._fork_keys(src, via)
            self._tree_match(keys, parent.tokens)

            def need(drop):
                L, hits, _ = self._cache_hits(keys, parent.tokens)
                return G * (n - L) + self._taken_back(hits, drop)

            victims = self._make_room(("fork", need, []), {seq, src})
        states = [g for g, group in enumerate(self.groups) if group.state_bytes is not None and n]
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
            L, hits, _ = self._cache_hits(keys, parent.tokens)
            child.retained = self._retention(keys, parent.tokens, parent.tokens, L)
            self._take_hits(hits)  # a fork is no prompt: no prefix hit counted
            self._evict_before_alloc(G * (n - L), [parent.tokens - L * self.B])
            child.tables = [[hits[g].get(i) for i in range(L)]
                            + [self._new_block(min(self.B, parent.tokens - i * self.B), g)
                               for i in range(L, n)] for g in range(G)]
            for g in range(G):
                for i in range(L, min(n, len(keys))):
                    if self.blocks[child.tables[g][i]][1] < self.B:
                        continue
                    if self._keeps(child, g, i):
                        self._share_cached(child.tables[g], g, i, keys[i])
                        self._register(child.tables[g][i], g, keys[i])  # the parent's content
                    else:  # left uncached: its own fork still names the parent's content
                        child.released_keys[i] = keys[i]
                # full past the parent's keys (its kept drafts'); below L (a chunk's start past
                # the keys: chunk_start_hit), no block
                for i in range(max(len(keys), L), n):
                    if self.blocks[child.tables[g][i]][1] == self.B:
                        self._filled(child.tables[g][i], g, seq, i)
            # The child's blocks below a window hold the parent's content: its own fork names them.
            child.released_keys.update({i: keys[i] for i in range(min(L, len(keys)))})
            self._tree_checkpoint(seq, prompt=parent.tokens // self.B)
            if self.window_release == "end_of_operation":
                self._release_windows([seq], {seq: child.tokens})
        return victims

    def _fork_keys(self, src, via: str) -> list:
        """Cache keys a fork of ``src`` served as a new request looks up: the parent's full
        blocks' (those its windows released included, in a model of sliding groups only, and
        those its kept drafts filled, which it caches at its next append; none with ``copy``,
        or without a prefix cache)."""
        if via == "copy" or not self.caching:
            return []
        parent = self.seqs[src]
        later = {i for _, i in parent.later}
        p = parent.prompt
        prompt = self.prompt_keys(parent.tokens, p.get("hashes"), p.get("token_ids"), p.get("salt"),
                                  p.get("adapter")) if p else ()
        keys = []
        for i in range(parent.tokens // self.B):
            held = [t[i] for t in parent.tables if t[i] is not None and t[i] in self.hash_of]
            if held:
                keys.append(self.hash_of[held[0]][1])
            elif i in parent.released_keys:
                keys.append(parent.released_keys[i])
            elif i in later:  # the child's block holds the content the parent's will be cached as
                keys.append(self._filled_key(src, i))
            elif i < len(prompt):
                keys.append(prompt[i])
            else:
                break
        return keys

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
        return sum(sum(1 for b in t if b is not None) if rel else len(t)
                   for t, rel in zip(st.tables, self.releasing)) + sum(map(len, st.ahead))

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
        B, N = self.B, self.config.num_blocks
        live = self.seqs if seqs is None else [s for s in seqs if s in self.seqs]
        tokens = {s: self.seqs[s].tokens for s in live}
        if self.layout == "paged":
            self._settle()
            return Ledger.paged(
                num_blocks=N, block_size=B, block_bytes=self.block_bytes,
                blocks_used=len(self.blocks), blocks_free=self.blocks_free, tokens=tokens,
                seq_blocks={s: self._per_seq[s][1] for s in live}, token_states=self.filled,
                reservation=self._res_total, shared_blocks=self.shared,
                cached_blocks=len(self.evictable), prefix_hit_blocks=self.hit_blocks,
                group_blocks=self.group_used)
        slabs = sorted(slab for st in self.seqs.values() for slab in st.slabs)
        token_states = reservation = 0
        for st in self.seqs.values():
            for (_, size), w in zip(st.slabs, self.windows):
                held = st.tokens if w is None else min(st.tokens, size)
                token_states += held
                reservation += F.slab_reservation(size, st.final, held)
        return Ledger.contiguous(
            arena_slots=self.config.arena_slots, slot_bytes=self.config.model.slot_bytes,
            tokens=tokens, seq_blocks={s: sum(size for _, size in self.seqs[s].slabs) for s in live},
            capacity_slots=sum(size for _, size in slabs), token_states=token_states,
            reservation=reservation,
            high_water=max((start + size for start, size in slabs), default=0))

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
            return tuple((0, 0 if w is None else st.tokens - min(st.tokens, size))
                         for (_, size), w in zip(st.slabs, self.windows))
        out = []
        for table, group in zip(st.tables, self.groups):
            if group.state_bytes is not None:
                out.append((0, st.tokens))
                continue
            lo = next((i for i, b in enumerate(table) if b is None), len(table))
            hi = next((i for i in range(lo, len(table)) if table[i] is not None), len(table))
            lo, hi = min(lo * self.B, st.tokens), min(hi * self.B, st.tokens)
            out.append((lo, hi) if hi > lo else (0, 0))
        return tuple(out)

    def _log_cached(self, block: int, entered: bool) -> None:
        if self._cached_log is not None:
            self._cached_log.append((block, entered))

    def free_list(self, count: int | None = None) -> np.ndarray:
        """The first ``count`` uncached free blocks, next taken first (None: all of them, as a
        read-only view valid until the next call: no array as long as the pool per call)."""
        stack, fresh = self.free_stack, self.fresh
        if count is not None:
            top = stack[::-1] if count >= len(stack) else stack[len(stack) - count:][::-1]
            rest = max(0, min(self.config.num_blocks - fresh, count - len(top)))
            return np.concatenate([np.array(top, dtype=np.int64),
                                   np.arange(fresh, fresh + rest, dtype=np.int64)])
        if self._ids is None:  # the never used blocks in order; the pushed ones go just before
            self._ids = np.arange(self.config.num_blocks, dtype=np.int64)
        ids = self._ids  # below fresh only pushed blocks (each once, so at most fresh of them)
        ids[fresh - len(stack):fresh] = stack[::-1]  # (fresh only grows: ids[fresh:] are intact)
        view = ids[fresh - len(stack):]
        view.flags.writeable = False
        return view

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
        return BlockState(free=self.free_list(), cached=list(self.evictable), refcount=self.refs,
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
