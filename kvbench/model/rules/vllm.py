"""vLLM's rule set: the declared differences of its KV cache manager from SPEC, modelled.

- ``chunk_start_hit``: on a model of chunked groups alone, a lookup counts the blocks left of
  the hit's last chunk as computed (``chunk_lookup``, the groups' fixed point);
- ``sparse_window_retention``: a sliding group caches only the window runs a hit can end on
  (below);
- ``state_checkpoints="align"``: a state group caches its state only at the block boundaries
  its scheduler ends a prefill chunk on, and holds no other block of the prefill (below);
- ``window_release="next_allocation"``, ``lookahead_slots``, ``kept_drafts_cached_at_next_append``:
  the steps below (``VLLMSteps``) that the oracle's append and accept call;
- ``keeps_duplicate_blocks``: read where the cache registers a block (rules/spec.py);
- ``cached_queue_order``: SPEC's order of cached blocks, declared because vLLM states it
  (below) and kvbench checks it on vLLM's own free queue (rules/base.py).

The cached blocks' order, as vLLM's docstrings state it. ``FreeKVCacheBlockQueue``: "the least
recent used block is at the front (LRU)", and of blocks freed together "the one with more hash
tokens (the tail of a block chain) is at the front", kept "by reversing the block order when
free blocks of a request" (``KVCacheManager.free`` frees each group's blocks reversed);
``BlockPool.free_blocks``: blocks "ordered by their eviction priority, where the first block
will be evicted first", the hashed ones appended to the queue's end ("FIFO reuse of cached
blocks for LRU eviction behavior"), the others prepended ("LIFO reuse of non-cached blocks").
``get_new_blocks`` pops the head, so an uncached free block is taken before any cached one is
evicted: SPEC's free stack over its cached queue (kvbench/model/pool.py).

Sparse retention, in detail. SPEC §8 caches every full block of every group. vLLM at its
serving default (``prefix_cache_retention_interval = 0``) caches a sliding group's block only
where a later hit can end on it (``SlidingWindowManager.reachable_block_mask``): a hit of L
blocks needs the group's ceil((W - 1) / B) blocks below L cached (SPEC §8's window below the
hit), and vLLM keeps that run below two ends only:

- the replay boundary, block (P - 1) // B of a P-token prompt (``replay_boundaries``: a resend of
  the prompt hits at most P - 1 tokens);
- the junction, where the prefill's hit stopped short of the full groups' (the full groups hit J
  blocks, a sliding group fewer): ``get_computed_blocks``' ``shared_prefix_boundary``, which the
  scheduler keeps on the request, so that the next request sharing the prefix hits all of it.

The request's other blocks of the group (its decode blocks included) go back uncached when a
window or a free releases them. Chunked-local groups keep every block (vLLM's base mask).

Mamba's "align" mode (``MambaSpec.mamba_cache_mode``; vLLM 0.33 has only "align" and "none", and
its MambaManager refuses prefix caching in any other: single_type_kv_cache_manager.py:1442). The
scheduler ends a prefill's chunks at the block boundaries a state can be cached at
(``Scheduler._mamba_block_aligned_split``): the prompt's last boundary before its last token,
``c = (P - 1) // B`` blocks (``get_mamba_prefill_checkpoint_position``), and the junction ``J``
above. Each chunk's ``allocate_slots`` takes one block per state group, at the chunk's last
position (the positions between stay null: ``MambaManager.allocate_new_blocks``), and releases
the state blocks below the one before (``remove_skipped_blocks``, ``last_state_block_idx``). So a
prefill with a hit of L blocks takes, per state group, the blocks at positions ``J - 1``,
``c - 1`` and ``n - 1`` that lie at or past L, and ends holding ``c - 1`` and ``n - 1`` (the hit's
block and ``J - 1`` go back, cached, lowest first); with sparse retention only ``c - 1`` and
``J - 1`` are cached (``MambaManager.reachable_block_mask``: the same two ends as a window's,
each needing one block), so no decode block's state is.
"""
from __future__ import annotations

import copy

from kvbench.contract import formulas as F
from kvbench.model.rules.spec import SpecRules


def retained_positions(prompt_tokens: int, junction: int, group: F.KVGroup, block_size: int):
    """Positions of a request's blocks that ``group`` caches under sparse retention (a frozenset),
    or None where it caches every full block (not a sliding group). ``junction``: the full
    groups' hit in blocks where the request's own hit was shorter, else 0."""
    if group.family not in ("sliding", "state"):
        return None
    ends = {max(0, prompt_tokens - 1) // block_size} | ({junction} if junction else set())
    return frozenset(i for end in ends for i in F.held_blocks(end * block_size, group, block_size))


FULL_SPECS = ("full", "mla")  # vLLM's FullAttentionSpec and its subclass MLAAttentionSpec


def first_group_hit(by_hash, groups, keys, cap: int, block_size: int,
                    max_tokens: int | None = None) -> int:
    """The hit of vLLM's first attention group alone, at most ``cap`` blocks: the groups of one
    kind (equal specs are one attention group), the first full-attention kind if there is one
    (vLLM sorts those first, stably), else the first group's. Each of its groups needs the blocks
    it holds at the hit cached. ``max_tokens`` (``chunk_start_hit``): a chunked first group's
    lookup of at most that many tokens counts the blocks left of that token's chunk as hit (null)
    and looks up from there."""
    first = next((g for g in groups if g.family in FULL_SPECS), groups[0])
    members = [g for g, group in enumerate(groups) if group.kind == first.kind]
    top = min(cap, len(keys))
    if first.family == "chunked" and max_tokens is not None:
        return chunk_lookup(by_hash, keys, members, first.chunk, max_tokens, block_size)[1]
    if first.family in FULL_SPECS:  # every block below the hit: the cached run from the first
        run = 0
        while run < top and all((g, keys[run]) in by_hash for g in members):
            run += 1
        return run
    for L in range(top, 0, -1):
        if all((g, keys[i]) in by_hash for g in members
               for i in F.held_blocks(L * block_size, groups[g], block_size)):
            return L
    return 0


def chunk_lookup(by_hash, keys, members, chunk: int, max_tokens: int, block_size: int):
    """vLLM's ``ChunkedLocalAttentionManager.find_longest_cache_hit`` for the groups ``members``
    (one attention group): the blocks left of the chunk of token ``max_tokens`` count as hit
    (null, none taken), then the blocks every member has cached, up to ``max_tokens // B``.
    Returns (the chunk's first block, the hit's end in blocks)."""
    start = run = max_tokens // chunk * chunk // block_size
    while run < min(max_tokens // block_size, len(keys)) and all((g, keys[run]) in by_hash
                                                                  for g in members):
        run += 1
    return start, run


class VLLMRules(SpecRules):
    """vLLM's rules (its KVCacheManager, v1): the defaults are the serving engine's; a fork is
    served through the prefix cache ("prefix"), or computed again ("copy") without one."""

    name = "vllm"
    PARAMS = {"fork_via": "prefix", "hit_leaves_last_token": True, "caches_every_full_block": True,
              "keeps_duplicate_blocks": True, "window_release": "next_allocation",
              "lookahead_slots": True, "hit_drops_last_block": False,
              "kept_drafts_cached_at_next_append": True, "sparse_window_retention": True,
              "chunk_start_hit": True, "state_checkpoints": "align", "cached_queue_order": True}


class VLLMSteps:
    """The oracle's steps under vLLM's rules (a mixin of kvbench.model.oracle.Oracle)."""

    def _make_room_released(self, call, seqs) -> list:
        """An append's room (``_make_room``); under ``window_release`` "next_allocation" the
        request's allocation first drops what slid out of its windows, undone if it is refused."""
        if self.layout != "paged" or not any(self.releasing) or self.rules.window_release == "end_of_operation":
            return self._make_room(call, set(seqs))
        snap = self._snapshot()
        self._release_windows(seqs, "next_allocation")
        try:
            return self._make_room(call, set(seqs))
        except Exception:  # ModelOOM: the refused call changes nothing
            self._restore(snap)
            raise

    def _drop_drafts(self, st, g: int, blocks: list) -> None:
        """An accept's blocks of group ``g`` past the new length: released from the tail (SPEC
        §13), or, under ``lookahead_slots``, kept unwritten for the next drafts (never shared:
        drafts wrote them)."""
        if not self.rules.lookahead_slots:
            for b in reversed(blocks):
                if b is not None:
                    self._drop_ref(b)
            return
        if not st.ahead:
            st.ahead = [[] for _ in st.tables]
        for b in blocks:
            self.filled -= self.blocks[b][1]
            self.blocks[b][1] = 0
        st.ahead[g][:0] = blocks
        self.edits += 1

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

    def _drafts_filled(self, st, g: int, seq, i: int) -> None:
        """An accept's kept drafts filled block ``i``: cached now, or under
        ``kept_drafts_cached_at_next_append`` at the sequence's next append (``_cache_later``)."""
        if self.rules.kept_drafts_cached_at_next_append:
            st.later.append((g, i))
        else:
            self._filled(st.tables[g][i], g, seq, i)

    def _cache_later(self, seqs) -> None:
        """The blocks the sequences' last accepts filled with kept drafts, cached now."""
        for s in seqs:
            st = self.seqs[s]
            for g, i in st.later:
                self._filled(st.tables[g][i], g, s, i)
            st.later = []

    def _snapshot(self):
        """What ``_restore`` puts back: only this rule changes the model before a call that may
        yet be refused."""
        marks = (self._free_low, None if self._cached_log is None else len(self._cached_log))
        return copy.deepcopy((self.seqs, {k: getattr(self, k) for k in self.STATE})), marks

    def _restore(self, snap) -> None:
        (self.seqs, pool), (self._free_low, logged) = snap
        self.__dict__.update(pool)
        if logged is not None:  # the changes undone are no changes
            del self._cached_log[logged:]
        self._dirty.update(self.seqs)  # sequences are new objects: settle them again

    def _chunk_rule(self) -> bool:
        """``chunk_start_hit`` applies: a prefix cache and a model of chunked groups alone."""
        return (self.caching and self.rules.chunk_start_hit
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
                start, end = chunk_lookup(self.by_hash, keys, [g], group.chunk, cur, self.B)
                starts.append(start)
                cur = end * self.B
            if cur >= M or len(self.groups) == 1:
                break
            M = cur
        L = cur // self.B  # every group's lookup of the last round ended at L
        return L, [{i: self.by_hash[(g, keys[i])][0] for i in range(starts[g], L)}
                   for g in range(len(self.groups))]

    def _retention(self, keys, prompt_tokens: int, tokens: int, L: int) -> list:
        """Per group, the positions of a new request's blocks a sparse window retention (or
        Mamba's align mode) caches, given its prompt, its hit's keys and its hit of L blocks; []
        without those rules. Read before the request takes a block (its new blocks may evict a
        cached one)."""
        families = {f for f, on in (
            ("sliding", self.rules.sparse_window_retention and self.caching
             and any(g.family == "sliding" for g in self.groups)),
            ("state", self._align_states())) if on}
        if not families:
            return []
        cap = max(0, tokens - 1) // self.B if self.rules.hit_leaves_last_token else len(keys)
        top = first_group_hit(
            self.by_hash, self.groups, keys, cap, self.B,
            self._most_hit_tokens(tokens) if self.rules.chunk_start_hit else None)
        junction = top if top > L else 0
        return [retained_positions(prompt_tokens, junction, group, self.B)
                if group.family in families else None for group in self.groups]

    def _align_states(self) -> bool:
        """``state_checkpoints="align"`` applies: a prefix cache and a state group (read once:
        the append path asks per block)."""
        on = self.__dict__.get("_align_on")
        if on is None:
            on = self._align_on = bool(self.caching and self.rules.state_checkpoints == "align"
                                       and any(g.family == "state" for g in self.groups))
        return on

    def _allocates(self, st, g: int, i: int, n: int) -> bool:
        """Whether a request's prefill of n blocks takes a block at position ``i`` of group ``g``
        (align mode: a state group only at its chunks' ends, the retained ones and the last)."""
        return (not self._align_states() or self.groups[g].family != "state" or i == n - 1
                or i in st.retained[g])

    def _new_blocks(self, keys, prompt_tokens: int, tokens: int, L: int, n: int) -> int:
        """Blocks a request of ``tokens`` tokens (n blocks, a hit of L) takes new, every group's."""
        if not self._align_states():  # a compressed group's positions: ceil(n / r) - L / r
            return sum(-(-n // kind.r) - L // kind.r for kind in self.kinds)
        retained = self._retention(keys, prompt_tokens, tokens, L)
        return sum(n - L if group.family != "state"
                   else sum(1 for i in range(L, n) if i == n - 1 or i in retained[g])
                   for g, group in enumerate(self.groups))

    def _settle_states(self, seq, tokens: int, L: int) -> None:
        """Align mode, after a prefill of ``tokens`` tokens with a hit of L blocks: what the
        allocate_slots of its later chunks released before allocating, each as of its chunk's
        start (the junction's boundary, then the checkpoint's): every releasing group's blocks
        it no longer holds there (a state group's below the state before, a window's below its
        window), chunk after chunk, group after group, each group's highest position first."""
        if not self._align_states():
            return
        st = self.seqs[seq]
        states = [g for g, group in enumerate(self.groups) if group.family == "state"]
        starts = sorted({(i + 1) * self.B for i in st.retained[states[0]]}
                        & set(range((L + 1) * self.B, tokens, self.B)))
        for start in starts:
            for g, kind in enumerate(self.kinds):
                if kind.releases:
                    kind.drop(self, st, g, kind.releasing(st.tables[g], start))

    def _appended_blocks(self, g: int, new: int) -> int:
        """Blocks an append that crosses ``new`` block boundaries takes in group ``g``: align
        mode's state group takes the last one only (MambaManager.allocate_new_blocks)."""
        if new and self._align_states() and self.groups[g].family == "state":
            return 1
        return new

    def _skips_block(self, g: int, last: bool) -> bool:
        """Whether an append leaves this new position of group ``g`` null (align mode: a state
        group's positions before the append's last)."""
        return not last and self._align_states() and self.groups[g].family == "state"

    @staticmethod
    def _keeps(st, g: int, i: int) -> bool:
        """Whether group ``g`` caches position ``i`` of ``st`` once full (sparse retention)."""
        return not st.retained or st.retained[g] is None or i in st.retained[g]
