"""SGLang's rule set: its prefix cache's declared differences from SPEC, modelled.

- ``evicts_whole_leaves``, ``leaf_order``: a radix tree over the oracle's cached blocks, whose
  whole unlocked leaves are evicted (``RadixTree`` below);
- ``eviction_demand``: eviction before the allocation, for its shortfall, or (``page_per_request``)
  for the new tokens plus one page per request;
- ``capped_hit_recomputed``: the block a capped hit computes again goes back when the cache still
  holds its key, and the cached one is shared instead;
- ``events_from_tree``: KV events announce the tree's keys (``RadixTree.keys``, logged as inserts
  make leaves and evictions take them), not the cache's (kvbench/model/events.py).

The cached blocks, next evicted first, are ``RadixTree.eviction_order``: the order an eviction
of everything would take them (an engine's ``block_state`` is held to it).

An engine whose rule set has ``evicts_whole_leaves`` (SGLang's ``RadixCache`` and
``UnifiedRadixCache``) keeps its cached blocks as the nodes of a radix tree and evicts whole
unlocked leaves. Which blocks form a node depends on where the engine's walks ended, so the model
replays the walks the engine makes (sglang/srt/mem_cache/radix_cache.py, 0.5.23):

- ``match`` (``_match_prefix_helper``, :651): touches the root and every node it walks; a match
  that ends inside a node splits it there (``_split_node``, :677: the new upper part is touched
  now, the lower keeps its times; the upper keeps the node's creation time as the serving tree's
  Rust core does, where RadixCache's Python split stamps a new one: only ``fifo`` tells them
  apart, and no backend runs RadixCache under fifo);
- ``insert`` (``_insert_helper``, :705): touches the nodes it walks, splits where the key ends or
  diverges inside one, and adds one new leaf for the rest (created now); ``hit_count`` grows on the
  nodes past what the request inserted before (``inserted_len``), ``priority`` is the max over the
  inserts that walked it;
- ``evict`` (:552): a heap of the unlocked leaves by the policy's priority; the first goes whole,
  its parent joins the heap when its last child goes and nothing holds it, until the tokens freed
  reach the request.

A node is locked while any of its blocks is in use (a running request's lock covers its path).
Time is a counter: one tick per walk, and one for each node created during it, so that a node
made by a split or an insert is later than what that walk touched.

The tree knows keys and blocks only; the oracle owns the blocks (``evict`` returns the keys of
the leaves it took, in order, and the oracle frees their blocks).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from kvbench.model.rules.base import LEAF_ORDERS  # noqa: F401 (SGLang's get_priority's)
from kvbench.model.rules.spec import SpecRules

SLRU_PROTECTED_HITS = 2  # SLRUStrategy's protected_threshold default


@dataclass(eq=False)
class Node:
    keys: list  # block keys along the path, in order
    parent: Node | None
    created: int
    last_access: int
    children: dict = field(default_factory=dict)  # first key -> child
    hit_count: int = 0
    priority: int = 0
    id: int = 0


class RadixTree:
    def __init__(self, order: str):
        if order not in LEAF_ORDERS:
            raise ValueError(f"leaf eviction order must be one of {LEAF_ORDERS}, got {order!r}")
        self.order = order
        self.clock = 0
        self._ids = itertools.count()
        self.root = self._node([], None)
        self.keys: set = set()  # the keys of every node
        self.log: dict | None = None  # keys inserted or evicted since the last look, when a dict

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _node(self, keys, parent, priority=0) -> Node:
        t = self._tick()
        return Node(list(keys), parent, created=t, last_access=t, priority=priority, id=next(self._ids))

    def _split(self, child: Node, m: int) -> Node:
        """``_split_node``: a new node for ``child``'s first ``m`` blocks, above it."""
        upper = self._node(child.keys[:m], child.parent, child.priority)
        upper.hit_count = child.hit_count
        upper.created = child.created  # the Rust core's (RadixCache's Python split stamps it new)
        upper.children = {child.keys[m]: child}
        child.parent.children[child.keys[0]] = upper
        child.keys = child.keys[m:]
        child.parent = upper
        return upper

    @staticmethod
    def _common(a, b) -> int:
        n = 0
        while n < len(a) and n < len(b) and a[n] == b[n]:
            n += 1
        return n

    def match(self, keys) -> int:
        """``match_prefix`` on the keys given (already capped by the caller): blocks matched."""
        now = self._tick()
        node, at = self.root, 0
        node.last_access = now
        while at < len(keys) and keys[at] in node.children:
            child = node.children[keys[at]]
            child.last_access = now
            m = self._common(child.keys, keys[at:])
            at += m
            if m < len(child.keys):
                self._split(child, m)
                break
            node = child
        return at

    def insert(self, keys, inserted: int = 0, priority: int = 0) -> None:
        """``insert`` of a request's full blocks; ``inserted``: blocks it inserted before."""
        now = self._tick()
        node, at = self.root, 0
        node.last_access = now
        node.priority = max(node.priority, priority)
        while at < len(keys) and keys[at] in node.children:
            node = node.children[keys[at]]
            node.last_access = now
            m = self._common(node.keys, keys[at:])
            at += m
            if m < len(node.keys):
                node = self._split(node, m)
            node.priority = max(node.priority, priority)
            if at > inserted:
                node.hit_count += 1
        if at < len(keys):
            leaf = self._node(keys[at:], node, priority)
            leaf.hit_count += len(keys) > inserted
            node.children[keys[at]] = leaf
            self._note(leaf.keys, True)

    def _note(self, keys, present: bool) -> None:
        (self.keys.update if present else self.keys.difference_update)(keys)
        if self.log is not None:
            self.log.update(dict.fromkeys(keys))

    def _rank(self, n: Node):
        o = self.order
        if o == "lru":
            key = (n.last_access,)
        elif o == "lfu":
            key = (n.hit_count, n.last_access)
        elif o == "fifo":
            key = (n.created,)
        elif o == "mru":
            key = (-n.last_access,)
        elif o == "priority":
            key = (n.priority, n.last_access)
        else:  # slru: the probationary segment first
            key = (int(n.hit_count >= SLRU_PROTECTED_HITS), n.last_access)
        return key + (n.id,)

    def _leaves(self, locked) -> list:
        out, todo = [], [self.root]
        while todo:
            for child in todo.pop().children.values():
                if child.children:
                    todo.append(child)
                elif not locked(child.keys):
                    out.append(child)
        return out

    def evict(self, blocks: int, locked) -> list:
        """``evict``: whole unlocked leaves until ``blocks`` or more are freed (``locked(keys)``:
        whether any of those blocks is in use). The evicted keys, in order."""
        heap = [(self._rank(n), n) for n in self._leaves(locked)]
        heapq.heapify(heap)
        out = []
        while len(out) < blocks and heap:
            _, leaf = heapq.heappop(heap)
            out += leaf.keys
            self._note(leaf.keys, False)
            parent = leaf.parent
            del parent.children[leaf.keys[0]]
            if parent is not self.root and not parent.children and not locked(parent.keys):
                heapq.heappush(heap, (self._rank(parent), parent))
        return out

    def eviction_order(self, locked) -> list:
        """The keys ``evict`` would take were it to take every unlocked leaf, in order (the tree
        unchanged): the cached blocks, next evicted first, as an engine's block_state lists them."""
        heap = [(self._rank(n), n) for n in self._leaves(locked)]
        heapq.heapify(heap)
        left: dict = {}  # node -> its children not yet taken
        out = []
        while heap:
            _, leaf = heapq.heappop(heap)
            out += leaf.keys
            parent = leaf.parent
            left[parent] = left.get(parent, len(parent.children)) - 1
            if parent is not self.root and not left[parent] and not locked(parent.keys):
                heapq.heappush(heap, (self._rank(parent), parent))
        return out


class SGLangRules(SpecRules):
    """SGLang's rules (its RadixCache): the defaults are the serving engine's
    (--radix-eviction-policy lru, a page size above 1)."""

    name = "sglang"
    PARAMS = {"fork_via": "prefix", "hit_leaves_last_token": True, "caches_every_full_block": True,
              "evicts_whole_leaves": True, "leaf_order": "lru",
              "eviction_demand": "page_per_request", "capped_hit_recomputed": True,
              "events_from_tree": True}


class SGLangSteps:
    """The oracle's steps under SGLang's rules (a mixin of kvbench.model.oracle.Oracle): each is a
    no-op under SPEC's."""

    def _init_tree(self) -> None:
        """The radix tree over the cached blocks (``evicts_whole_leaves``), and per live request
        [its prompt's full blocks, the blocks it inserted] (one group)."""
        self.tree = RadixTree(self.rules.leaf_order) if (
            self.caching and self.rules.evicts_whole_leaves) else None
        self._tree_reqs: dict = {}

    def _tree_match(self, keys, tokens: int) -> None:
        """The engine's match at admission (refused or not): it walks the blocks it may hit."""
        if self.tree is not None:
            cap = max(0, tokens - 1) // self.B if self.rules.hit_leaves_last_token else len(keys)
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

    def _eviction_order(self) -> list:
        """The cached blocks, next evicted first: the tree's leaves in its order (``evicts_whole_leaves``),
        else the pool's queue."""
        if self.tree is None:
            return list(self.evictable)
        return [self.by_hash[(0, k)][0] for k in self.tree.eviction_order(self._locked)]

    def _locked(self, keys) -> bool:
        return any(self.by_hash[(0, k)][0] in self.blocks for k in keys)

    def _evict_before_alloc(self, need: int, new_tokens: list, decode: bool = False) -> None:
        """An engine that evicts before it allocates: for ``need`` blocks, or (page_per_request)
        for the new tokens plus one page per request (a decode step: a page per request), beyond
        the uncached free blocks; whole leaves of its tree, or cached blocks first released first."""
        new_tokens = [t for t in new_tokens if t > 0]  # a request allocating nothing
        if not self.caching or not new_tokens or (
                self.tree is None and self.rules.eviction_demand == "need"):
            return  # SPEC: a cached block goes only when a block is taken
        if self.rules.eviction_demand == "page_per_request" and self.B > 1:
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
        if not self.rules.capped_hit_recomputed or (g, key) not in self.by_hash:
            return
        cached = self.by_hash[(g, key)][0]
        if cached != table[i]:
            self._drop_ref(table[i])
            self._take_hits([{i: cached}])
            table[i] = cached
