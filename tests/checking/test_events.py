"""KV events (SPEC §14): the order rules, the residency replayed from a pool's events against the
oracle's prefix cache, and each planted event fault caught at its step.

Keys are the traces' block hashes (a pool without salt keys its blocks by them), so the expected
events are written out: ``stored(key, parent, group)``.
"""
from __future__ import annotations

import dataclasses

import pytest
from conftest import A, X, make_config, make_trace

from impls.faults_events import (
    AnnouncedAgainEveryStep,
    DraftBlockAnnounced,
    EvictsSilently,
    IndexMissesCleared,
    ParentNeverStored,
    PartialBlockAnnounced,
)
from impls.numpy_paged import NumpyPaged
from impls.prefix_keys import prompt_keys, tagged_extra
from impls.torch_paged import TorchPaged
from kvbench.checking.checker import check
from kvbench.contract import formulas as F
from kvbench.contract.events import CLEARED, REMOVED, STORED, EventOrderError, KVEvent, Residency
from kvbench.contract.protocol import Backend, CacheConfig, Prompt, publishes_events
from kvbench.model.events import ExpectedEvents
from kvbench.model.oracle import Oracle
from kvbench.traces.format import Header, Trace, validate
from kvbench.traces.ops import Append, Prefill
from kvbench.traces.tier_ops import Done, Store, TierSpec


def stored(key, parent=None, group=0, tier=0):
    return KVEvent(STORED, key, parent, group, tier)


def removed(key, group=0, tier=0):
    return KVEvent(REMOVED, key, None, group, tier)


# 4 blocks of 16. Op 0: 0 prefills 40 = 16 + 16 + 8 tokens, hashes a, b of its 2 full blocks:
# a and b stored (b's parent a), the partial third block nothing. Op 1: 0 appends 8, filling
# block 2 (unhashed: not cached). Op 2: 0 is freed, a and b stay cached (3 blocks to the pool:
# 2 cached, 1 free). Op 3: 1 prefills 64 = 4 blocks, hashes c, d, e, f: 2 free blocks, then the
# 2 oldest cached, b then a (released tail first): a and b removed, c .. f stored.
TRACE = make_trace(Prefill(0, 0, "a", 40, ("a", "b")), A((0, 8),), X(0),
                   Prefill(0, 1, "a", 64, ("c", "d", "e", "f")), X(1), name="events")
CONFIG = make_config(num_blocks=4, prefix_caching=True)


def events_by_op(backend_cls, trace=TRACE, config=CONFIG) -> list:
    """The pool's events after each operation of ``trace`` (driven by hand, no checker)."""
    be, out = backend_cls(dataclasses.replace(config, store_kv=False)), []
    for op in trace.ops:
        if op.kind == "prefill":
            be.prefill(op.seq, Prompt(op.tokens, op.tenant, block_hashes=op.block_hashes), step=op.step)
        elif op.kind == "append":
            be.append(list(op.seqs), list(op.tokens), step=op.step)
        else:
            be.free(op.seq, step=op.step)
        out.append(be.events())
    return out


@pytest.mark.parametrize("pool", [NumpyPaged, TorchPaged])
def test_a_pool_announces_what_its_cache_gains_and_loses(pool):
    assert publishes_events(pool(CONFIG))
    assert events_by_op(pool) == [
        [stored("a"), stored("b", "a")],
        [],  # block 2 is full now, but unhashed: no entry
        [],  # freed: a and b stay entries, evictable
        [stored("c"), stored("d", "c"), stored("e", "d"), stored("f", "e"), removed("b"), removed("a")],
        [],
    ]
    assert check(TRACE, pool(CONFIG)).valid is True


def test_the_oracle_expects_the_same_changes():
    o = Oracle(CONFIG)
    expected = ExpectedEvents(o)
    o.prefill(0, 40, "a", 48, 0, hashes=("a", "b"))
    assert expected.changes() == {(0, 0): (["a", "b"], set())}
    o.append([0], [8], 1)
    o.free(0)
    assert expected.changes() == {}
    o.prefill(1, 64, "a", 64, 3, hashes=("c", "d", "e", "f"))
    assert expected.changes() == {(0, 0): (["c", "d", "e", "f"], {"a", "b"})}
    assert expected.keys(0, 0) == {"c", "d", "e", "f"}


# --- the order rules: each broken by one stream, a FAIL naming the rule and the event --------

def announcing(extra_at: int, extra: list, base=NumpyPaged):
    """A correct pool that adds ``extra`` to its events after its ``extra_at``-th mutating call."""
    class Announcing(base):
        name = "announcing"
        calls = 0

        def prefill(self, *a, **kw):
            self.calls += 1
            return super().prefill(*a, **kw)

        def append(self, *a, **kw):
            self.calls += 1
            return super().append(*a, **kw)

        def free(self, *a, **kw):
            self.calls += 1
            return super().free(*a, **kw)

        def events(self):
            out = super().events()
            return out + list(extra) if self.calls == extra_at else out
    return Announcing


@pytest.mark.parametrize("extra, rule, shown", [
    # After op 0, a and b are present: a stored again breaks "once while present".
    ([stored("a")], "a key is stored at most once while present", "stored 'a' (group 0, tier 0)"),
    # z was never stored.
    ([removed("z")], "nothing is removed that was not stored", "removed 'z' (group 0, tier 0)"),
    # y names x as its parent, and x is not present.
    ([stored("y", "x")], "a stored block's parent is present or none",
     "stored 'y', parent 'x' (group 0, tier 0)"),
])
def test_each_order_rule_broken_fails_at_its_operation(extra, rule, shown):
    v = check(TRACE, announcing(1, extra)(CONFIG))
    d = v.divergence
    assert (v.valid, d.index, d.quantity, d.expected, d.actual) == (False, 0, "event order", rule, shown)


def test_the_order_rules_of_the_residency_alone():
    r = Residency()
    r.extend([stored("a"), stored("b", "a"), removed("a"), stored("a")])
    assert r.keys() == {"a", "b"} and r.count == 4
    with pytest.raises(EventOrderError, match="event 4 .*already present"):
        r.apply(stored("b"))
    with pytest.raises(EventOrderError, match="not present"):
        r.apply(removed("c"))
    with pytest.raises(EventOrderError, match="parent 'x' is not present"):
        r.apply(stored("c", "x"))
    r.apply(KVEvent(CLEARED))
    assert r.keys() == frozenset()


def test_an_index_that_misses_a_cleared_parts_from_the_residency():
    # Stored a, cleared, stored a again: the residency takes it; an index that kept a after the
    # clear finds a stored twice while present at event 2.
    stream = [stored("a"), KVEvent(CLEARED), stored("a")]
    good = Residency()
    good.extend(stream)
    assert good.keys() == {"a"}
    with pytest.raises(EventOrderError, match="event 2 .*already present"):
        IndexMissesCleared().extend(stream)


# --- residency against the oracle's prefix cache ------------------------------------------

def test_events_that_leave_a_key_out_fail_naming_it():
    # Op 0 stores a and b; a pool that leaves b out: the residency lacks b.
    class DropsB(NumpyPaged):
        def events(self):
            return [e for e in super().events() if e.key != "b"]
    d = check(TRACE, DropsB(CONFIG)).divergence
    assert (d.index, d.quantity) == (0, "residency of group 0, tier 0")
    assert d.expected == {"stored": ["a", "b"], "removed": []}
    assert d.actual == {"stored": ["a"], "removed": []}
    assert "in the model's cache, not in the events' residency: ['b']" in d.detail


def test_a_salted_pool_keys_its_events_by_its_own_hash_and_still_passes():
    # With a salt the pool keys blocks by a SHA-256 of the salt and the hash: the checker pairs
    # each with the oracle's key the first time it is stored, and holds it to that pairing.
    salted = make_trace(Prefill(0, 0, "a", 32, ("a", "b"), salt="s"), X(0),
                        Prefill(0, 1, "a", 32, ("a", "b"), salt="s"),
                        Prefill(0, 2, "a", 32, ("a", "b"), salt="t"), X(1), X(2), name="salted")
    be = NumpyPaged(make_config(num_blocks=8, prefix_caching=True, store_kv=False))
    be.prefill(0, Prompt(32, block_hashes=("a", "b"), salt="s"))
    keys = [e.key for e in be.events()]
    assert len(keys) == 2 and all(isinstance(k, bytes) for k in keys)
    assert check(salted, NumpyPaged(make_config(num_blocks=8, prefix_caching=True))).valid is True


def own_int(key) -> int:
    """vLLM's event hash of a trace key (maybe_convert_block_hash: the int of the hash's bytes)."""
    return int.from_bytes(str(key).encode(), "big")


class OwnIntKeys(NumpyPaged):
    """Announces each key in its own hash space, as vLLM does: trace key 0 as 48 (b"0")."""

    capabilities = dataclasses.replace(NumpyPaged.capabilities, rule_params={"event_keys": "own"})

    def events(self):
        return [dataclasses.replace(e, key=own_int(e.key) if e.key is not None else None,
                                    parent=None if e.parent is None else own_int(e.parent))
                for e in super().events()]


def test_a_backend_key_equal_to_another_trace_key_is_not_paired_with_it():
    # Trace keys 0 and 48 (ints); the backend announces them as 48 and 13368 (b"48"). Paired by
    # value its 48 would stand for the trace's 48, and at op 3, where the trace's 48 is evicted
    # (its 13368 removed), the events would say the trace's 0 went. Its keys are its own space
    # (event_keys): paired in order, 48 -> 0 and 13368 -> 48, and the run passes.
    # 4 blocks: op 0 stores 0 and 48; op 1 frees them (cached); op 2 hits 0 and stores 7 in the
    # free block (1 free left); op 3 needs 2 blocks: the free one and the cached 48, evicted.
    trace = make_trace(Prefill(0, 0, "a", 32, (0, 48)), X(0), Prefill(0, 1, "a", 32, (0, 7)),
                       Prefill(0, 2, "a", 32, (9, 10)), X(1), X(2), name="own-keys")
    assert own_int(0) == 48 and own_int(48) == 13368
    v = check(trace, OwnIntKeys(CONFIG))
    assert v.valid is True, v.divergence
    assert v.events == 2 + 1 + 3  # op 0: stored 0, 48; op 2: stored 7; op 3: removed 48, stored 9, 10


def test_a_sliding_groups_sparse_entries_pass():
    # tiny-hybrid with windows of 6 positions over blocks of 4: group 0 sliding(6), group 1 full;
    # 14 blocks. Op 0: 24 tokens, hashes h0 .. h5, stored in both groups; the sliding group keeps
    # the blocks of [24 - 6 + 1, 24) = 4 and 5, and releases 0 .. 3 to the cached queue, 3 first.
    # Op 1 frees 0. Op 2: 8 tokens (o0, o1), 2 blocks per group: the 2 uncached blocks, then the 2
    # oldest cached, the sliding group's positions 3 and 2: h3, h2 removed from group 0 alone, which
    # keeps h0, h1, h4, h5: no prefix. Op 3: the prompt again hits 6 full blocks + the sliding 4, 5.
    model = dataclasses.replace(F.get_model("tiny-hybrid"), groups=F.hybrid_groups(4, (6, None)))
    config = CacheConfig(model=model, block_size=4, num_blocks=14, prefix_caching=True)
    hs = tuple(f"h{i}" for i in range(6))
    trace = make_trace(Prefill(0, 0, "a", 24, hs), X(0), Prefill(0, 1, "a", 8, ("o0", "o1")),
                       Prefill(0, 2, "a", 24, hs), X(1), X(2), name="sliding")
    got = events_by_op(NumpyPaged, trace, config)
    assert got[0] == [stored(h, hs[i - 1] if i else None, g) for g in (0, 1) for i, h in enumerate(hs)]
    assert got[2] == [stored("o0", None, 0), stored("o1", "o0", 0), stored("o0", None, 1),
                      stored("o1", "o0", 1), removed("h3", 0), removed("h2", 0)]
    assert got[3] == []  # a hit: nothing new
    assert check(trace, NumpyPaged(config)).valid is True


# --- a lower tier whose events name entries without the salt (tier_event_keys "unsalted") -----

class UnsaltedTierEvents(NumpyPaged):
    """Announces its tiers' entries by their keys without the salt, one event per entry, as
    LMCache's controller messages do (impls/engines/lmcache_cpu.py), and declares it."""

    name = "unsalted-tier-events"
    capabilities = dataclasses.replace(NumpyPaged.capabilities,
                                       rule_params={"tier_event_keys": "unsalted"})

    def prefill(self, seq, prompt, kv=None, **kw):
        plain = prompt_keys(prompt, self.B, tagged_extra(None, prompt.adapter))
        self.__dict__.setdefault("plain", {}).update(zip(prompt_keys(prompt, self.B), plain))
        return super().prefill(seq, prompt, kv, **kw)

    def events(self):
        plain = self.__dict__.get("plain", {})
        return [dataclasses.replace(e, key=plain.get(e.key, e.key), parent=None) if e.tier else e
                for e in super().events()]


class MergedCopies(UnsaltedTierEvents):
    """Announces a salt-less key once while any copy is held, as an index of keys (a set)
    would: the second tenant's copy is never said."""

    def events(self):
        held, out = self.__dict__.setdefault("held", {}), []
        for e in super().events():
            gk = (e.group, e.tier, e.key)
            if e.tier and e.kind == STORED:
                held[gk] = held.get(gk, 0) + 1
                if held[gk] > 1:
                    continue
            elif e.tier and e.kind == REMOVED:
                held[gk] -= 1
                if held[gk]:
                    continue
            out.append(e)
        return out


def two_tenants_one_prefix():
    """Host of 4. Tenants s and t each prefill 32 tokens of hashes a, b (2 blocks of 16) and
    store them to the host (steps 0-5): 2 copies of a and of b, the host full. A third prompt
    (c, d) is stored at step 7: the 2 least recent, s's a and b, are evicted, 1 copy of each
    left."""
    ops = [Prefill(0, 0, "s", 32, ("a", "b"), salt="s"), Store(1, 1, 0, "host"), Done(2, 1, True),
           Prefill(3, 1, "t", 32, ("a", "b"), salt="t"), Store(4, 2, 1, "host"), Done(5, 2, True),
           Prefill(6, 2, "u", 32, ("c", "d")), Store(7, 3, 2, "host"), Done(8, 3, True)]
    return validate(Trace(Header("tenants", tiers=(TierSpec("host", 4),)), ops, name="tenants"))


def test_tier_events_without_the_salt_are_counted_per_key_where_declared():
    config = make_config(num_blocks=8, prefix_caching=True)
    v = check(two_tenants_one_prefix(), UnsaltedTierEvents(config))
    assert v.valid is True, v.divergence
    # device: 3 prompts x 2 blocks stored; host: a, b twice, then a, b removed and c, d stored
    assert v.events == 3 * 2 + (2 + 2 + 2 + 2)
    # held to salted keys (SPEC §14), its first tier events name no salted entry
    salted = UnsaltedTierEvents(config)
    salted.capabilities = NumpyPaged.capabilities
    d = check(two_tenants_one_prefix(), salted).divergence
    assert (d.step, d.quantity) == (2, "residency of group 0, tier 1")


def test_an_index_that_merges_two_tenants_copies_fails_at_the_second():
    d = check(two_tenants_one_prefix(), MergedCopies(make_config(num_blocks=8, prefix_caching=True))).divergence
    # step 5: t's copies of a and b stored, 2 of each where the events say 1
    assert (d.step, d.quantity) == (5, "residency of group 0, tier 1")
    assert d.expected["stored"] == ["a", "b"] and d.actual["stored"] == []
    assert "'a' 2 against 1" in d.detail


def test_the_oracles_unsalted_key_leaves_out_the_salt_and_keeps_the_adapter():
    o = Oracle(make_config(block_size=4, num_blocks=8, prefix_caching=True))
    u = lambda keys: [o.unsalted_key(k) for k in keys]  # noqa: E731
    assert u(o.prompt_keys(8, hashes=(1, 2), salt="s")) == [1, 2]
    assert u(o.prompt_keys(8, hashes=(1, 2), salt="s", adapter="l")) == list(o.prompt_keys(8, hashes=(1, 2), adapter="l"))
    ids = list(range(12))
    plain = u(o.prompt_keys(12, token_ids=ids))
    assert u(o.prompt_keys(12, token_ids=ids, salt="s")) == u(o.prompt_keys(12, token_ids=ids, salt="t")) == plain
    assert len(set(plain)) == 3  # 12 // 4 blocks, each its own prefix
    lora = u(o.prompt_keys(12, token_ids=ids, salt="s", adapter="l"))
    assert lora == u(o.prompt_keys(12, token_ids=ids, adapter="l")) and not set(lora) & set(plain)


# --- backends without events ---------------------------------------------------------------

def test_a_backend_without_events_is_reported_not_checked():
    class Silent(NumpyPaged):
        name = "silent"
        events = Backend.events
    v = check(TRACE, Silent(CONFIG))
    assert v.valid is True and v.skipped == {"events": "silent publishes no KV events"}
    # Without a prefix cache there is nothing to announce, and nothing is said.
    assert check(TRACE, Silent(make_config(num_blocks=4))).skipped == {}


# --- the planted faults, each at its step ---------------------------------------------------

def test_a_block_announced_again_at_every_step():
    # Op 1 appends to 0, whose last cached prompt block is b: removed b, stored b, though b never
    # left the cache (vLLM #49125).
    d = check(TRACE, AnnouncedAgainEveryStep(CONFIG)).divergence
    assert (d.index, d.quantity) == (1, "residency of group 0, tier 0")
    assert d.actual == {"stored": ["b"], "removed": ["b"]} and "stored again" in d.detail


def test_a_parent_never_stored():
    # Op 0's first block a names a parent nobody stored (vLLM PR #58121).
    d = check(TRACE, ParentNeverStored(CONFIG)).divergence
    assert (d.index, d.quantity, d.expected) == (0, "event order", "a stored block's parent is present or none")


def test_an_eviction_announced_by_nothing():
    # Op 3 evicts b and a from the cache; the pool says nothing: a and b stay in the residency.
    d = check(TRACE, EvictsSilently(CONFIG)).divergence
    assert (d.index, d.quantity) == (3, "residency of group 0, tier 0")
    assert d.expected["removed"] == ["a", "b"] and d.actual["removed"] == []


def test_a_partial_block_announced():
    # Op 0's third block holds 40 - 2 * 16 = 8 of 16 tokens: partial, never an entry.
    d = check(TRACE, PartialBlockAnnounced(CONFIG)).divergence
    assert (d.index, d.quantity) == (0, "residency of group 0, tier 0")
    assert "backend key ('partial', 0, 40)" in d.detail


def test_a_draft_block_announced():
    # Op 1 appends 24 tokens to 0 (16 -> 40), the last 20 drafts: block 1 (positions 16 .. 31)
    # is full and holds drafts 20 .. 31: no entry (SPEC §13); the fault announces it.
    trace = make_trace(Prefill(0, 0, "a", 16, ("a",)), Append(0, (0,), (24,), (20,)), X(0),
                       name="drafts")
    assert check(trace, NumpyPaged(CONFIG)).valid is True
    d = check(trace, DraftBlockAnnounced(CONFIG)).divergence
    assert (d.index, d.quantity) == (1, "residency of group 0, tier 0")
    assert "backend key ('draft', 0, 1)" in d.detail


def test_a_tier_announces_the_blocks_a_store_stored():
    # Host of 4 blocks. 0 prefills 32 tokens (a, b); a store to host begins (nothing announced:
    # storing is not stored, SPEC §11), then completes: a and b stored in tier 1, b's parent a.
    from kvbench.traces.tier_ops import TierSpec
    be = NumpyPaged(make_config(num_blocks=8, prefix_caching=True, store_kv=False))
    be.attach_tiers([TierSpec("host", 4)])
    be.prefill(0, Prompt(32, block_hashes=("a", "b")))
    assert be.events() == [stored("a"), stored("b", "a")]
    be.store(1, 0, "host")
    assert be.events() == []
    be.complete(1, True)
    assert be.events() == [stored("a", None, 0, 1), stored("b", "a", 0, 1)]
    # A failed store leaves nothing to announce.
    be.prefill(1, Prompt(16, block_hashes=("c",)))
    assert be.events() == [stored("c")]
    be.store(2, 1, "host")
    be.complete(2, False)
    assert be.events() == []
