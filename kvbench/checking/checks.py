"""Every check the checker makes, named: where it is made and the quantity it reports.

One entry per check: the function that makes it (``site``, as ``Class.method`` or ``function``
of its module) and the template of the quantity it reports (``{}`` for what a format string
fills in; ``{name}`` where the whole quantity is a variable, such as the ledger field ``f``).
Several checks may share a site and a template (a call that raises, and one that refuses what
fits, both report ``outcome of {}``); the self-tests (tests/checking/test_checker_selftest.py) tell them
apart by the step and the figures. tests/checking/test_checker_selftest.py reads the checker's modules
and asserts that each site and template there is named here, and that each entry here has a
self-test: a new check without an entry, or an entry without a test, fails.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.checking.tier_replay import TIER_FIELDS
from kvbench.contract.ledger import LEDGER_FIELDS

# The modules whose checks are named here, relative to the repository root.
MODULES = ("kvbench/checking/checker.py", "kvbench/checking/identities.py",
           "kvbench/checking/content.py", "kvbench/checking/tier_replay.py",
           "kvbench/checking/event_replay.py")


@dataclass(frozen=True)
class Check:
    name: str
    module: str  # one of MODULES, without the directory and .py
    site: str
    template: str
    doc: str


def _c(name, module, site, template, doc) -> Check:
    return Check(name, module, site, template, doc)


CALLS = (
    _c("outcome: a call raises", "checker", "_Replay.raised", "outcome of {}",
       "any backend call that raises is a FAIL naming the call"),
    _c("a call returns what it must not", "checker", "_Replay.raised", "what {} returned",
       "a ledger that is no Ledger, victims that are no iterable, K/V that is no array: a FAIL "
       "naming the call and what it returned"),
    _c("outcome: refused what fits", "checker", "_Replay.call", "outcome of {}",
       "the backend refuses an operation the oracle fits"),
    _c("outcome: took what cannot fit", "checker", "_Replay.call", "outcome of {}",
       "the backend takes an operation the oracle cannot fit even after evicting"),
    _c("a refused call leaves the ledger", "checker", "_Replay.call", "{} after a refused {}",
       "every ledger figure after a refused call is as before it"),
    _c("victims", "checker", "_Replay.call", "victims", "the sequences evicted, in order"),
)

LEDGER = tuple(_c(f"ledger: {f}", "checker", "_Replay.compare_ledger", "{f}",
                  f"the ledger's {f} against the oracle's") for f in LEDGER_FIELDS)

IDENTITIES = (  # SPEC §10, from the ledger alone
    _c("identity: no negative number", "identities", "_negative_count", "{f}", "a count below 0"),
    _c("identity: no negative per-sequence count", "identities", "_negative_count",
       "{} of sequence {}", "a sequence's count below 0"),
    _c("identity: no negative entry of a tuple", "identities", "_negative_count", "{f}",
       "a group's count below 0"),
    _c("identity: used + free = pool", "identities", "ledger_identities",
       "blocks_used + blocks_free", "cached blocks counted once, on the free side"),
    _c("identity: cached <= free", "identities", "ledger_identities", "cached_blocks",
       "a cached block is a free block"),
    _c("identity: group blocks add up", "identities", "ledger_identities", "sum of group_blocks",
       "every block in use serves one group"),
    _c("identity: token capacity", "identities", "ledger_identities", "token_capacity",
       "num_blocks * block_size"),
    _c("identity: usage by blocks", "identities", "ledger_identities", "block_usage",
       "blocks_used / num_blocks"),
    _c("identity: usage by slots", "identities", "ledger_identities", "slot_usage",
       "token_states / (num_blocks * block_size)"),
)

STRUCTURES = (  # SPEC §10, from block_state(): the whole pool at the sweeps
    _c("structure: a count per block", "identities", "_pool_identities", "reference counts",
       "refcount covers the pool"),
    _c("structure: free ids in the pool", "identities", "_pool_identities", "block ids",
       "a free block id outside 0 .. num_blocks - 1"),
    _c("structure: each free block once", "identities", "_pool_identities", "free blocks",
       "a block twice in the free structure"),
    _c("structure: no negative reference count", "identities", "_pool_identities",
       "reference count of block {}", "a block's count below 0"),
    _c("structure: free or in use", "identities", "_pool_identities", "block {}",
       "a free block with references"),
    _c("structure: one reference per table", "identities", "_reference_identities",
       "reference count of block {}", "a block's count is the tables holding it"),
    _c("structure: a store's lease, one reference more", "identities", "_reference_identities",
       "reference count of block {}", "SPEC §11: each store in flight copying a block holds it"),
    _c("structure: a load's target, its sequence's alone", "identities", "_reference_identities",
       "block {}", "SPEC §11: one reference, the loading sequence's table's"),
    _c("structure: free count", "identities", "_count_identities", "blocks_free",
       "the free structure's length is the ledger's blocks_free"),
    _c("structure: cached count", "identities", "_count_identities", "cached_blocks",
       "the cached blocks listed are the ledger's cached_blocks"),
    _c("structure: evictable + protected + free = pool", "identities", "_count_identities",
       "evictable + protected + free", "no block neither free nor in use"),
    _c("structure: table ids in the pool", "identities", "_group_identities", "block ids",
       "a table entry outside the pool"),
    _c("structure: a held block is in use", "identities", "_group_identities", "block {}",
       "a table holds a free block"),
    _c("structure: a block serves one group", "identities", "_group_identities", "block {}",
       "two groups' tables hold one block"),
)

MIRROR = (  # the same identities between sweeps, at the blocks an operation moved
    _c("mirror: the free list continues", "identities", "Mirror.apply", "free blocks",
       "block_state(changed_since=) changes a head deeper than the list"),
    _c("mirror: free ids in the pool", "identities", "Mirror.apply", "block ids",
       "a changed free block id outside the pool"),
    _c("mirror: one reference per table", "identities", "_reference_identities",
       "reference count of block {}", "at the blocks the operation moved"),
    _c("mirror: each free block once", "identities", "Mirror._free_identities", "free blocks",
       "at the blocks the operation moved"),
    _c("mirror: no negative reference count", "identities", "Mirror._free_identities",
       "reference count of block {}", "at the blocks the operation moved"),
    _c("mirror: free or in use", "identities", "Mirror._free_identities", "block {}",
       "at the blocks the operation moved"),
)

ORDERS = (  # a backend declaring block_ids: its ids one by one against the oracle's
    _c("order: block tables", "identities", "compare_structures",
       "block table of sequence {}, group {}", "each sequence's table, each group"),
    _c("order: free, whole", "identities", "compare_structures", "{name}",
       "the free list, next taken first, at the sweeps"),
    _c("order: cached, whole", "identities", "compare_structures", "{name}",
       "the cached queue, next evicted first, at the sweeps"),
    _c("order: cached, by the rule set", "identities", "compare_cached_order",
       "cached blocks (next evicted first)", "a backend with ids of its own, whole states only or "
       "evicts_whole_leaves: its cached blocks in its rule set's eviction order, its ids paired with the oracle's through the tables, "
       "after every operation"),
    _c("order: free, at the step", "identities", "Mirror._differs", "free blocks (next taken first)",
       "the free list's changed entries at the operation that changed them"),
    _c("order: cached, at the step", "identities", "Mirror._differs",
       "cached blocks (next evicted first)", "the cached queue's changes at that operation"),
    # a backend with ids of its own (an engine's) under cached_queue_order
    _c("order: cached, paired by table position", "identities", "Pairing.order",
       "cached blocks (next evicted first)",
       "the blocks an operation cached, in queue order, each paired with the oracle's block "
       "held at the same table position"),
)

CONTENT = (  # K/V read back (the checker's verify, reporting 'kv of sequence {}')
    _c("kv: the positions written", "checker", "_Replay.verify", "kv of sequence {}",
       "an append's positions, from its tail block on"),
    _c("kv: the sharers of a written tail", "checker", "_Replay.verify", "kv of sequence {}",
       "a write into a shared tail must not show in its sharers' reads"),
    _c("kv: a new sequence whole", "checker", "_Replay.verify", "kv of sequence {}",
       "a prefill, a prefix hit, a fork, a recompute"),
    _c("kv: whole before a free", "checker", "_Replay.verify", "kv of sequence {}",
       "while it is still there to read"),
    _c("kv: whole before a preemption", "checker", "_Replay.verify", "kv of sequence {}",
       "while it is still there to read"),
    _c("kv: the random window", "checker", "_Replay.verify", "kv of sequence {}",
       "a seeded window of one live sequence per operation, read through gather(out=)"),
    _c("kv: every sequence at the end", "checker", "_Replay.verify", "kv of sequence {}",
       "what no operation touched since"),
    _c("kv: equal to what was written", "content", "Content._wrong", "what it wrote or inherited",
       "a read-back's values, position by position"),
    _c("kv: the shape read back", "content", "Content.mismatch", "{seq}",
       "as many positions as asked, each of the model's K/V shape"),
    _c("kv: within the quantization bound", "content", "Content._wrong",
       "within the quantization bound", "a quantized pool's read-back, SPEC §4's bound"),
    _c("state: equal to the recurrence", "checker", "_Replay.verify", "state of sequence {}",
       "each state group's state (read_state) is the recurrence over every token from zeros"),
    _c("state: the shape read back", "content", "Content.state_mismatch", "{seq}",
       "one state per state group, each of the group's state shape"),
)

TIERS = (  # SPEC §11
    _c("tier: the blocks a store stored", "tier_replay", "TierReplay.read_back",
       "blocks stored by transfer {}", "read back at the store's completion"),
    _c("tier: the content a store stored", "tier_replay", "TierReplay.read_back",
       "tier content of transfer {}", "each stored block's K/V"),
    _c("tier: one ledger per tier", "tier_replay", "TierReplay.compare", "tiers",
       "tier_ledgers() has one entry per tier"),
    _c("tier: no negative count", "tier_replay", "TierReplay.compare", "tier {} {}",
       "a tier's count below 0"),
    _c("tier: stored + storing + free = capacity", "tier_replay", "TierReplay.compare",
       "tier {} stored + storing + free", "SPEC §11"),
    _c("tier: loading <= stored", "tier_replay", "TierReplay.compare", "tier {} loading",
       "a load reads stored blocks"),
    _c("tier: no pin left at the end", "tier_replay", "TierReplay.end",
       "tier {} pins at the end of the trace", "each lookup's pins released once by the trace's "
       "end: the pins left, named by block key and salt"),
) + tuple(_c(f"tier: {f}", "tier_replay", "TierReplay.compare", "tier {} {}",
             f"each tier's {f} against the oracle's") for f in TIER_FIELDS)

EVENTS = (  # SPEC §14, for a backend that publishes events()
    _c("events: order rules", "event_replay", "EventReplay.apply", "event order",
       "a key stored at most once while present, nothing removed that was not stored, a stored "
       "block's parent present or none: the rule and the event that breaks it"),
    _c("events: residency", "event_replay", "EventReplay.compare_group", "residency of group {}, tier {}",
       "the keys the events stored and removed in the operation, net, are those the oracle's prefix "
       "cache gained and lost: the residency replayed from them equals the oracle's"),
    _c("events: order rules, copies", "event_replay", "EventReplay.count_copy", "event order",
       "tier_event_keys \"unsalted\": nothing removed of which no copy was stored"),
    _c("events: copies per salt-less key", "event_replay", "EventReplay.compare_copies",
       "residency of group {}, tier {}",
       "tier_event_keys \"unsalted\": each lower tier's copies per key, replayed from the events, "
       "are the oracle's entries per key with the salt left out"),
)

CHECKS = CALLS + LEDGER + IDENTITIES + STRUCTURES + MIRROR + ORDERS + CONTENT + TIERS + EVENTS
BY_NAME = {c.name: c for c in CHECKS}
