"""What every rule set is: its parameters, each with the set's default, and the rules the
oracle asks it for. ``RuleSet`` holds SPEC's value of every rule; a rule set declares which of
them a backend may set (``PARAMS``, with the set's defaults) and may override a decision.
"""
from __future__ import annotations

FORK_VIA = ("share", "prefix", "copy")
EVICTION_DEMANDS = ("need", "page_per_request")
WINDOW_RELEASE_RULES = ("end_of_operation", "next_allocation")
STATE_CHECKPOINTS = ("every_block", "align")
LEAF_ORDERS = ("lru", "lfu", "fifo", "mru", "priority", "slru")  # SGLang's get_priority's
CHOICES = {"fork_via": FORK_VIA, "eviction_demand": EVICTION_DEMANDS,
           "window_release": WINDOW_RELEASE_RULES, "leaf_order": LEAF_ORDERS,
           "state_checkpoints": STATE_CHECKPOINTS, "event_keys": ("trace", "own"),
           "tier_event_keys": ("salted", "unsalted")}


class RuleSet:
    """SPEC's rules (Capabilities.rule_params names the ones a backend changes).

    - ``fork_via``: how a fork is served: "share" (SPEC §2: every block shared, copy-on-write at
      the first write), "prefix" (a new request whose prompt is the parent's tokens, served by
      the prefix cache), "copy" (a new request with no prefix cache: every block computed again).
    - ``hit_leaves_last_token``: the last prompt token is always computed again, for its logits:
      a hit stops at (T - 1) // B blocks (vLLM's get_computed_blocks, SGLang's
      _compute_max_prefix_len).
    - ``caches_every_full_block``: every full block is cached, not only those the trace hashes,
      under a key of its own, never hit by another prompt.
    - ``keeps_duplicate_blocks``: a block computed again under a hash already cached stays
      cached as a second copy (vLLM: "we don't de-duplicate the blocks in the cache").
    - ``window_release``: when a sliding group's out-of-window blocks go back:
      "end_of_operation" (SPEC §8) or "next_allocation" (vLLM: when the request next allocates).
    - ``lookahead_slots``: an accept that rejects drafts keeps their blocks for the next step's
      drafts (vLLM's lookahead slots, SPEC §13).
    - ``hit_drops_last_block``: EAGLE / MTP drafting: a hit drops the last block it matched.
    - ``kept_drafts_cached_at_next_append``: a block an accept's kept drafts completed is cached
      at the sequence's next append of at least one token, not at the accept (vLLM's cache_blocks).
    - ``sparse_window_retention``: a sliding group caches only the blocks a later hit can end on
      (vLLM's prefix_cache_retention_interval = 0; rules/vllm.py).
    - ``state_checkpoints``: where a state group caches its state with prefix caching:
      "every_block" (SPEC §12: at every hashed boundary) or "align" (vLLM's Mamba align mode:
      only where the scheduler ends a prefill chunk; rules/vllm.py).
    - ``chunk_start_hit``: on chunked groups alone, a lookup counts the blocks left of the hit's
      last chunk as computed (vLLM's ChunkedLocalAttentionManager; rules/vllm.py).
    - ``cached_queue_order``: the free blocks that hold a cached prefix are one queue, evicted
      from its head; a block joins its tail when its last reference goes, a freed table's tail
      first (SPEC's "first released, first evicted"). A backend that exposes ``block_state``
      with its changes but not kvbench's block ids is held to the oracle's order of that queue
      at every operation, its blocks paired with the oracle's by table position
      (kvbench.checking.identities.Pairing). False: the order is not checked.
    - ``evicts_whole_leaves``, ``leaf_order``: cached blocks are the nodes of a radix tree whose
      whole unlocked leaves are evicted in that order (SGLang; rules/sglang.py).
    - ``eviction_demand``: what an allocation evicts for: "need" or "page_per_request" (SGLang's
      paged allocator).
    - ``capped_hit_recomputed``: a hit that hit_leaves_last_token capped computes the capped
      block again, and the insert after the call shares the cached one (SGLang's checkpoint).
    - ``event_keys``: whose keys its KV events name (SPEC §14). "trace": the block keys its
      prefill received, so a key equal to the oracle's is that key; "own": an engine's hash
      space, each key paired with the oracle's in the order announced whatever its value
      (vLLM's int 48 is its hash of the trace's key 0; kvbench.checking.event_replay).
    - ``tier_event_keys``: what the KV events of its lower tiers (SPEC §11) name an entry by.
      "salted": the block key, salt included (SPEC §14); "unsalted": the key without its salt,
      one event per entry, so two tenants' copies of one prefix are one key announced twice and
      the checker counts each key's copies (LMCache's controller messages carry
      ``key.chunk_hash`` alone; impls/engines/lmcache_cpu.py).
    - ``events_from_tree``: KV events (SPEC §14) announce the radix tree's pages: stored when a
      checkpoint's insert makes their node, not when a decode fills them, removed when an
      eviction takes their leaf (SGLang; rules/sglang.py).
    """

    name = "base"
    PARAMS: dict = {}  # the parameters a backend may set, with this set's defaults

    fork_via = "share"
    hit_leaves_last_token = False
    caches_every_full_block = False
    keeps_duplicate_blocks = False
    window_release = "end_of_operation"
    lookahead_slots = False
    hit_drops_last_block = False
    kept_drafts_cached_at_next_append = False
    sparse_window_retention = False
    chunk_start_hit = False
    cached_queue_order = True
    state_checkpoints = "every_block"
    evicts_whole_leaves = False
    leaf_order = "lru"
    eviction_demand = "need"
    capped_hit_recomputed = False
    events_from_tree = False
    event_keys = "trace"
    tier_event_keys = "salted"

    def __init__(self, **params):
        unknown = sorted(set(params) - set(self.PARAMS))
        if unknown:
            raise ValueError(f"rule set {self.name!r} has no parameter {', '.join(unknown)}; its "
                             f"parameters: {', '.join(self.PARAMS) or 'none'}")
        for key, value in {**self.PARAMS, **params}.items():
            if key in CHOICES and value not in CHOICES[key]:
                raise ValueError(f"rule set {self.name!r}: {key} must be one of {CHOICES[key]}, "
                                 f"got {value!r}")
            setattr(self, key, value)

    def most_hit_tokens(self, tokens: int) -> int:
        """The most tokens of a ``tokens``-token prompt a prefix hit may cover."""
        return max(0, tokens - 1) if self.hit_leaves_last_token else tokens

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self.PARAMS)})"
