"""SPEC's rule set: the block keys (salted, tagged: SPEC §9), the prefix hit (SPEC §8, §12) and
what the cache keeps (SPEC §9), with the
caps both engines' rule sets put on them where a backend declares them (``hit_leaves_last_token``,
``hit_drops_last_block``, ``caches_every_full_block``, ``keeps_duplicate_blocks``,
``capped_hit_recomputed``; all off: SPEC's), and a fork served as a new request (``fork_via``
"prefix" or "copy", as both engines serve one; SPEC's "share" is the oracle's own).
"""
from __future__ import annotations

import math

from kvbench.model.rules.base import RuleSet

SPEC_PARAMS = {k: getattr(RuleSet, k) for k in (
    "fork_via", "hit_leaves_last_token", "caches_every_full_block", "keeps_duplicate_blocks",
    "window_release", "lookahead_slots", "hit_drops_last_block",
    "kept_drafts_cached_at_next_append", "sparse_window_retention", "chunk_start_hit",
    "evicts_whole_leaves", "leaf_order", "eviction_demand", "capped_hit_recomputed",
    "cached_queue_order", "event_keys", "tier_event_keys")}


def extra_keys(salt=None, adapter=None) -> tuple:
    """A prefill's extra keys, each tagged with its kind: a salt "x" and an adapter "x" differ."""
    return tuple((kind, v) for kind, v in (("salt", salt), ("adapter", adapter)) if v is not None)


class SpecRules(RuleSet):
    """SPEC's rules; each engine rule (RuleSet's docstring) may be switched on one by one, as a
    backend that follows SPEC but for a few of them declares (and as the old flags did)."""

    name = "spec"
    PARAMS = SPEC_PARAMS


class SpecSteps:
    """The block keys, the hit, the cache entries, the windows' release and the fork (a mixin of
    kvbench.model.oracle.Oracle)."""

    def _init_keys(self) -> None:
        self._nodes: dict = {}  # token-id prefixes -> node number (keys exact, never hashed)
        self.writers: dict = {}  # untagged block content -> {extra keys: first sequence}
        self._spec_from: dict = {}  # during an append: sequence -> its first draft position
        self._chunk_done: list = []  # during an append: (block, group, key) its chunks completed
        self._lives: dict = {}  # sequence -> times preempted (its resume writes blocks anew)
        # unsalted_key's: key -> its unsalted key, trie node number -> its node, unsalted nodes
        self._unsalted_memo, self._node_of, self._unsalted_nodes = {}, {}, {}
        # B-token blocks a hit comes in multiples of: a compressed(r) group's r (its blocks are
        # B * r tokens), 1 without one
        self._hit_unit = math.lcm(*(kind.r for kind in self.kinds))

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

    def unsalted_key(self, key):
        """``key`` (a key :meth:`prompt_keys` made) with its salt left out and its adapter kept:
        what an engine whose KV events carry no salt names the entry by (the rule
        ``tier_event_keys`` "unsalted"). A token-id key becomes a node of a trie of its own, the
        same for every salt."""
        memo = self._unsalted_memo
        if key in memo:
            return memo[key]
        if isinstance(key, tuple) and len(key) == 2 and key[0] == "ids":  # a token-id trie node
            rev, nodes = self._node_of, self._unsalted_nodes
            if key[1] not in rev:  # nodes are only added, numbered in order: the new ones
                for node, n in reversed(self._nodes.items()):
                    if n in rev:
                        break
                    rev[n] = node
            chain = [key]  # up to the root or a node projected before, then down: no recursion
            while rev[chain[-1][1]][0][0] != "root" and rev[chain[-1][1]][0] not in memo:
                chain.append(rev[chain[-1][1]][0])
            for k in reversed(chain):
                parent, tokens = rev[k[1]]
                base = (("root", tuple(x for x in parent[1] if x[0] != "salt"))
                        if parent[0] == "root" else memo[parent])
                memo[k] = ("unsalted ids", nodes.setdefault((base, tokens), len(nodes)))
            return memo[key]
        out = key
        if (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], tuple) and key[0]
                and all(isinstance(x, tuple) and x[:1] in (("salt",), ("adapter",)) for x in key[0])):
            kept = tuple(x for x in key[0] if x[0] != "salt")  # hashed: (extra keys, hash)
            out = key if kept == key[0] else ((kept, key[1]) if kept else key[1])
        memo[key] = out
        return out

    def _note_writers(self, seq, tokens: int, hashes, token_ids, salt, adapter) -> dict:
        """Note ``seq`` as a writer of its prompt's blocks under its extra keys; what
        ``cross_key_writers`` reads of its prompt."""
        untagged = self.prompt_keys(tokens, hashes, token_ids, tagged=False)
        extra = extra_keys(salt, adapter)
        for key in untagged:
            self.writers.setdefault(key, {}).setdefault(extra, seq)
        return {"extra": extra, "untagged": untagged}

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

    def _hit_plan(self, keys) -> tuple[int, list]:
        """The hit (SPEC §8, §12): the longest prefix of L blocks such that every full group has
        its blocks below L cached and every releasing group those it would hold at LB tokens
        (its kind's ``held``: sliding, covering [max(0, LB - W + 1), LB); chunked, the current
        chunk's; sinks, the sinks' and the window's); L a multiple of each compressed(r)
        group's r, whose block j is keyed by the prompt's key ``(j + 1) * r - 1``. Returns L
        and, per group, {position: cached block}."""
        if not keys:
            return 0, [{} for _ in self.groups]
        unit = self._hit_unit
        for L in range(self.full_run(keys) // unit * unit, 0, -unit):
            need = [kind.held(L * self.B) for kind in self.kinds]
            if all((g, keys[i]) in self.by_hash for g, kind in enumerate(self.kinds) if kind.releases
                   for i in need[g]):
                return L, [{i: self.by_hash[(g, keys[kind.key_index(i)])][0] for i in need[g]}
                           for g, kind in enumerate(self.kinds)]
        return 0, [{} for _ in self.groups]

    def full_run(self, keys) -> int:
        """How many of the prompt's blocks, from the first, every full group has cached (a
        compressed(r) group's block j covers the prompt's blocks below (j + 1) * r)."""
        top = len(keys)
        for g, kind in enumerate(self.kinds):
            if not kind.releases:
                run = 0
                while kind.key_index(run) < top and (g, keys[kind.key_index(run)]) in self.by_hash:
                    run += 1
                top = run * kind.r
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
        if self.rules.hit_drops_last_block and L:  # EAGLE: the last matched block computed again
            L, hits = self._hit_plan(keys[:L - 1])
        counted = min(L, self._most_hit_tokens(tokens) // self.B)
        if (self.rules.keeps_duplicate_blocks or self.rules.capped_hit_recomputed) and counted < L:
            L, hits = self._hit_plan(keys[:counted])
            counted = L
        return L, hits, sum(1 for per, kind in zip(hits, self.kinds) for i in per
                            if kind.key_index(i) < counted)

    def _most_hit_tokens(self, tokens: int) -> int:
        """The most tokens of a ``tokens``-token prompt a hit may cover (``hit_leaves_last_token``:
        the last one is computed again)."""
        return self.rules.most_hit_tokens(tokens)

    def _register(self, b: int, g: int, key) -> None:
        """Cache block ``b`` of group ``g`` under ``key``; a key already cached gets a second
        block only in an engine that keeps duplicates."""
        self._cache(b, g, key, self.rules.keeps_duplicate_blocks)

    def _filled(self, b: int, g: int, seq, i: int) -> None:
        """Block ``b`` (position ``i`` of ``seq``, group ``g``) just became full: an engine that
        caches every full block caches it, under a key no other sequence's block has (never hit
        by another prompt) and that every group of ``seq`` shares at that position (so a fork
        served through the prefix cache finds the parent's blocks in every group)."""
        st = self.seqs.get(seq)
        if st is not None and not self._keeps(st, g, i):
            if self.caching and self.rules.caches_every_full_block:  # a fork still names it
                st.released_keys.setdefault(i, ("filled", seq, i))
            return
        if self.caching and self.rules.caches_every_full_block and b not in self.hash_of:
            self._register(b, g, self._filled_key(seq, i))

    def _filled_key(self, seq, i: int) -> tuple:
        """The key of ``seq``'s block ``i`` cached once full (``_filled``): a resumed sequence's
        blocks are new content to the cache."""
        life = self._lives.get(seq, 0)
        return ("filled", seq, i) + ((life,) if life else ())

    def _cache_prompt(self, seq, st, keys, L: int, n: int) -> None:
        """A new request's blocks ``L .. n - 1``: a keyed one (``keys`` by position) becomes its
        key's cache entry where the group keeps it; a full one past the keys is ``_filled``. The
        keys of its blocks a group does not keep, or may release (below L), name them for its
        own fork."""
        for g, (table, kind) in enumerate(zip(st.tables, self.kinds)):
            for i in range(L // kind.r, len(table)):
                if table[i] is None:  # a state group's position align mode skips
                    continue
                if kind.key_index(i) < len(keys):
                    key = keys[kind.key_index(i)]
                    if self._keeps(st, g, i):
                        self._share_cached(table, g, i, key)
                        self._register(table[i], g, key)
                    else:
                        st.released_keys[i] = key
                elif (i + 1) * kind.key_tokens <= st.tokens:
                    self._filled(table[i], g, seq, i)
        st.released_keys.update({i: keys[i] for i in range(min(L, len(keys)))})

    def _completed(self, b: int, g: int, seq, i: int) -> None:
        """An append wrote the last slot of block ``b`` (position ``i`` of ``seq``, group ``g``):
        a block of a chunked prompt becomes the cache entry of its key once the append has taken
        its blocks (as an engine caches after allocating); a block holding a draft
        token is cached by no engine (its accept may still roll it back)."""
        chunk, kind = self.seqs[seq].prompt.get("chunk_keys"), self.kinds[g]
        if chunk is not None and kind.key_index(i) < len(chunk):  # keyed as _cache_prompt keys it
            if self.caching and self._keeps(self.seqs[seq], g, i):
                self._chunk_done.append((b, g, chunk[kind.key_index(i)]))
        elif (i + 1) * kind.key_tokens <= self._spec_from.get(seq, (i + 1) * kind.key_tokens):
            self._filled(b, g, seq, i)

    def _cache_chunks(self) -> None:
        """The chunked prompts' blocks an append completed become their keys' cache entries,
        after every block the append takes (a cached copy its allocations evicted is gone)."""
        for b, g, key in self._chunk_done:
            self._register(b, g, key)
        self._chunk_done = []

    def _release_windows(self, seqs, when: str = "end_of_operation") -> None:
        """Under the rule set's ``window_release`` ``when``: release the blocks of ``seqs`` each
        group no longer holds at their lengths (SPEC §8): group by group, writers in batch order."""
        for g, kind in enumerate(self.kinds) if self.rules.window_release == when else ():
            if kind.releases:
                self._dirty.update(seqs)
                for st in (self.seqs[s] for s in seqs):
                    kind.drop(self, st, g, kind.releasing(st.tables[g], st.tokens))

    def fork(self, seq, src, final, step) -> list:
        """A child with ``src``'s blocks shared (SPEC §2), or served as a new request (the rule
        set's ``fork_via``), or with its own slabs (contiguous)."""
        parent = self.seqs[src]
        via = self.rules.fork_via if self.layout == "paged" else "share"
        n = len(parent.tables[0]) if parent.tables else 0
        sizes = self._slab_sizes(final) if self.layout == "contiguous" else []
        copies = sum(1 for kind in self.kinds if kind.copied_at_fork and n)
        if via != "share":
            victims, keys = self._fork_room(seq, src, via)
        else:
            victims = self._make_room(("fork", lambda drop: copies, sizes), {seq, src})
        child = type(parent)(tenant=parent.tenant, tokens=parent.tokens, final=final,
                         segments=list(parent.segments), last_access=step, use_count=1)
        self.seqs[seq] = child
        self._dirty.update((seq, src))
        if self.layout == "contiguous":
            child.slabs = self._place(sizes)
        elif via == "share":
            child.tables = [list(t) for t in parent.tables]
            for b in child.held():
                self._add_ref(b)
            for g, kind in enumerate(self.kinds) if n else ():
                kind.forked(self, g, child.tables[g])
            self.edits += 1
            self._sharing.update((seq, src))  # a shared partial tail: each one's reservation
        else:  # a new request with the parent's tokens: cached blocks taken, the rest computed
            self._admit(seq, child, keys, parent.tokens, n, hit=False)
        return victims

    def _fork_room(self, seq, src, via: str) -> tuple[list, list]:
        """A fork served as a new request: the engine's walks, the keys it looks up
        (``_fork_keys``) and the room its blocks need. Returns (victims, keys)."""
        parent = self.seqs[src]
        n = len(parent.tables[0]) if parent.tables else 0
        self._tree_checkpoint(src)  # the child finds the parent's blocks in the tree
        keys = self._fork_keys(src, via)
        self._tree_match(keys, parent.tokens)

        def need(drop):
            L, hits, _ = self._cache_hits(keys, parent.tokens)
            return self._new_blocks(keys, parent.tokens, parent.tokens, L, n) + self._taken_back(hits, drop)

        return self._make_room(("fork", need, []), {seq, src}), keys

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
