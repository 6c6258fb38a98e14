"""What a history reached (`kvbench fuzz`'s coverage): :class:`Watch`, a progress sink for an
oracle-only check() that after each operation looks at the oracle and counts the edge conditions
of :data:`EDGES` the operation reached. An edge counts only where the operation acted on it (an
abort of a load reading tier blocks, a rollback that released a block), so that "reached" means
"tested"."""
from __future__ import annotations

from kvbench.model.oracle import Oracle
from kvbench.traces.format import Append, Fork, Prefill, Trace

WIDE_DECODE = 9  # sequences in a one-token step: a pool's vectorized decode path
MANY_SHARERS, MANY_LIVE, LONG_PROMPT_BLOCKS = 128, 65, 17

# The edge conditions a campaign reports reached or not, in the order of the summary.
REFUSAL, POLICY_REFUSAL = "refusal", "refusal under a policy (evicting all would not do)"
STATE_HIT = "prefix hit on a state model (its state at a cached boundary)"
# Reached only when the operation acted: the aborted load had blocks to read from a tier, the
# rollback released a block (SPEC §13's edges: ending on a block edge, or on a block a fork or
# the prefix cache shares).
ABORT_LOADING = "abort of a load in flight (reading 1+ blocks from a tier)"
ROLLBACK = "rollback releasing a block"
SHARED_ROLLBACK = "rollback releasing a block, ending on a block shared (a fork, the prefix cache)"
ZERO_OP = "operation of zero tokens (an empty prompt, an append member of none)"
# SPEC §11's lookups, reached only where the lookup pinned 1+ tier entries
LOOKUP_PINNED = "lookup pinning tier entries"
LOOKUP_CANCELLED = "abort or free between a lookup and its load (its pins released)"
LOOKUP_FAILED = "failed load of a looked-up prompt, its tier {} them"  # keeps, drops
# SPEC §11's drop: the failed load's entry read by another load in flight (held till it ends;
# vLLM's file tier removes it at once: failed_read_removes_at_once)
SHARED_DROP = "failed load of a block another load reads, its tier dropping it"
EDGES = ("exact fit (every block in use)", REFUSAL, POLICY_REFUSAL, "eviction",
         "recompute after eviction", "prefix hit", "hit on a block-aligned prompt",
         "cached block reused for new content", "window release", "copy-on-write",
         "fork at a partial tail", "wide decode (9+ sequences)", "128+ sharers of a block",
         "65+ live sequences", "prompt of 17+ blocks", "full block of 256+ tokens",
         # SPEC §11 and §13, for a backend that declares them
         "load served from a tier", "store into a full tier",
         "store into a full tier while a load reads it", "failed transfer",
         ABORT_LOADING, "free while its store is in flight",
         ROLLBACK, SHARED_ROLLBACK, "rollback ending on a block edge",
         "resume with a prefix hit", "preempt by swap to a tier", ZERO_OP,
         LOOKUP_PINNED, LOOKUP_CANCELLED, LOOKUP_FAILED.format("keeping"),
         LOOKUP_FAILED.format("dropping"), SHARED_DROP,
         # SPEC §12's state groups: a hit needs the state cached at its block boundary, a fork
         # copies the state, an eviction takes a cached state's block
         STATE_HIT, "fork of a state model", "eviction on a state model")


class Watch:
    """A progress sink for an oracle-only check(): after each operation it looks at the oracle
    and counts the edge conditions of :data:`EDGES` the operation reached (at most once per
    history each)."""

    def __init__(self, oracle: Oracle, trace: Trace):
        self.o, self.ops, self.i = oracle, list(trace.ops), 0
        self.B, self.paged = oracle.B, oracle.layout == "paged"
        self.sliding = [g for g, w in enumerate(g.window for g in oracle.groups) if w is not None]
        self.reached: set = set()
        self.tokens: dict = {}
        self.shared_tails: set = set()
        self.released: dict = {}
        self.stats = (0, 0, 0, 0)  # evictions, recomputed tokens, hit blocks, cached blocks
        self.tiers = getattr(oracle, "tiers", None)  # a TieredOracle's (SPEC §11)
        self.tier_hits = 0
        self.loading: set = set()  # sequences with a load in flight of 1+ tier blocks
        self.storing: set = set()  # and with a store in flight
        self.pinned: set = set()  # sequences looked up with 1+ pins, their load not begun
        self.pinned_loads: dict = {}  # load in flight whose lookup pinned -> its tiers' failed_load
        self.drop_reads: dict = {}  # load in flight -> the (key, tier) it reads in "drop" tiers
        self.before: list = []  # the block tables of the next operation's sequence (an accept's)
        self.states = any(g.state_bytes is not None for g in oracle.groups)

    def update(self, _n: int = 1) -> None:
        o, op, B = self.o, self.ops[self.i], self.B
        self.i += 1
        hit = self._counts(op)
        if self.paged and o.blocks_used == o.config.num_blocks:
            self.reached.add("exact fit (every block in use)")
        refused = self._refused(op)
        if refused:
            self.reached.add(POLICY_REFUSAL if o.config.policy else REFUSAL)
        if isinstance(op, Prefill) and op.seq in o.seqs:
            if hit and op.tokens % B == 0:
                self.reached.add("hit on a block-aligned prompt")
            if -(-op.tokens // B) >= LONG_PROMPT_BLOCKS:
                self.reached.add("prompt of 17+ blocks")
        if (isinstance(op, Prefill) and op.tokens == 0) or (isinstance(op, Append) and 0 in op.tokens):
            self.reached.add(ZERO_OP)
        if isinstance(op, Append):
            if len(op.seqs) >= WIDE_DECODE and set(op.tokens) == {1}:
                self.reached.add("wide decode (9+ sequences)")
            if self.shared_tails.intersection(op.seqs) and not refused:
                self.reached.add("copy-on-write")
        if isinstance(op, Fork):
            if self.tokens.get(op.src, 0) % B:
                self.reached.add("fork at a partial tail")
            if self.paged and int(o.refs.max(initial=0)) >= MANY_SHARERS:
                self.reached.add("128+ sharers of a block")
        if len(o.seqs) >= MANY_LIVE:
            self.reached.add("65+ live sequences")
        if B >= 256 and any(st.tokens >= B for st in o.seqs.values()):
            self.reached.add("full block of 256+ tokens")
        self._lifecycle(op, hit)
        if self.states:
            self._states(op, hit)
        self._remember()

    def _states(self, op, hit: bool) -> None:
        """The edges of a model with state groups (SPEC §12) the operation reached."""
        if hit:
            self.reached.add(STATE_HIT)
        if isinstance(op, Fork) and op.seq in self.o.seqs:
            self.reached.add("fork of a state model")
        if "eviction" in self.reached:
            self.reached.add("eviction on a state model")

    def _lifecycle(self, op, hit: bool) -> None:
        """The edges of transfers and lifecycles (SPEC §11, §13) the operation reached."""
        kind = op.kind
        if kind == "accept" and op.seq in self.o.seqs:
            self._rollback(self.o.seqs[op.seq])
        if kind == "resume" and hit:
            self.reached.add("resume with a prefix hit")
        if kind == "preempt" and op.seq in getattr(self.o, "swapped", ()):
            self.reached.add("preempt by swap to a tier")
        if self.tiers is None:
            return
        hits = sum(t.hits for t in self.tiers.tiers)
        if hits > self.tier_hits:
            self.reached.add("load served from a tier")
        self.tier_hits = hits
        full = [t for t in self.tiers.tiers if t.spec.name == op.tier and len(t.entries) >= t.spec.capacity] \
            if kind == "store" else []
        if full:
            self.reached.add("store into a full tier")
        if any(e.loads for t in full for e in t.entries.values()):  # its room only the read blocks'
            self.reached.add("store into a full tier while a load reads it")
        if kind == "done" and not op.ok:
            self.reached.add("failed transfer")
        if kind == "abort" and op.seq in self.loading:
            self.reached.add(ABORT_LOADING)
        if kind in ("free", "abort") and op.seq in self.storing:
            self.reached.add("free while its store is in flight")
        if kind == "lookup" and self.tiers.pins.get(op.seq):
            self.reached.add(LOOKUP_PINNED)
        if kind in ("free", "abort") and op.seq in self.pinned:
            self.reached.add(LOOKUP_CANCELLED)
        if kind == "done" and not op.ok:
            for mode in self.pinned_loads.get(op.id, ()):
                self.reached.add(LOOKUP_FAILED.format({"keep": "keeping", "drop": "dropping"}[mode]))
            mine = self.drop_reads.get(op.id, set())
            if any(mine & self.drop_reads.get(tid, set()) for tid in self.tiers.transfers):
                self.reached.add(SHARED_DROP)

    def _rollback(self, st) -> None:
        """What an accept's rollback did, if it released a block of any group: whether the
        sequence now ends on a block edge, and on a block another sequence or the prefix cache
        holds too."""
        o = self.o
        if not any(b is not None for g, table in enumerate(self.before) for b in table[len(st.tables[g]):]):
            return
        self.reached.add(ROLLBACK)
        if st.tokens % self.B == 0:
            self.reached.add("rollback ending on a block edge")
        tails = [t[-1] for t in st.tables if t and t[-1] is not None]
        if any(o.blocks[b][0] > 1 or b in o.hash_of for b in tails):
            self.reached.add(SHARED_ROLLBACK)

    def _counts(self, op) -> bool:
        """Evictions, recomputes, hits and cache reuse since the last operation; whether it hit."""
        o = self.o
        stats = (sum(t.evictions for t in o.tenant_stats.values()),
                 sum(t.recomputed_tokens for t in o.tenant_stats.values()), o.hit_blocks,
                 len(o.hash_of))
        before, self.stats = self.stats, stats
        for name, old, new in zip(("eviction", "recompute after eviction", "prefix hit"), before, stats):
            if new > old:
                self.reached.add(name)
        if stats[3] < before[3] and not isinstance(op, Fork):
            self.reached.add("cached block reused for new content")
        return stats[2] > before[2]

    def _refused(self, op) -> bool:
        o = self.o
        if isinstance(op, (Prefill, Fork)):
            return op.seq not in o.seqs and op.seq not in o.preempted
        if isinstance(op, Append):
            return any(s in o.seqs and o.seqs[s].tokens == self.tokens.get(s) for s in op.seqs)
        return False

    def _remember(self) -> None:
        """What the next operation is judged against: lengths, shared partial tails, windows."""
        o, B = self.o, self.B
        self.tokens = {s: st.tokens for s, st in o.seqs.items()}
        nxt = self.ops[self.i] if self.i < len(self.ops) else None
        self.before = []
        if self.paged and nxt is not None and nxt.kind == "accept" and nxt.seq in o.seqs:
            self.before = [list(t) for t in o.seqs[nxt.seq].tables]
        if self.tiers is not None:
            flying = self.tiers.transfers.values()
            self.loading = {tr.seq for tr in flying if tr.kind == "load" and tr.blocks}
            self.storing = {tr.seq for tr in flying if tr.kind == "store"}
            self.pinned = {s for s, pins in self.tiers.pins.items() if pins}
            self.pinned_loads = {tid: {self.tiers.tiers[i].spec.failed_load for _, i in tr.pins}
                                 for tid, tr in self.tiers.transfers.items() if tr.kind == "load"}
            self.drop_reads = {tid: {(k, i) for k, i, _ in tr.blocks
                                     if self.tiers.tiers[i].spec.failed_load == "drop"}
                               for tid, tr in self.tiers.transfers.items() if tr.kind == "load"}
        if not self.paged:
            return
        self.shared_tails = {s for s, st in o.seqs.items() if st.tokens % B and any(
            t and t[-1] is not None and o.blocks[t[-1]][0] > 1 for t in st.tables)}
        for s, st in o.seqs.items():
            gone = sum(st.tables[g].count(None) for g in self.sliding if g < len(st.tables))
            if gone > self.released.get(s, 0):
                self.reached.add("window release")
            self.released[s] = gone
