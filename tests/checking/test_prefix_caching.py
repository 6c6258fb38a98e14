"""Prefix caching by block hash, through the paths a trace can reach: a prompt whose
every block is a hit, operations that write no token or take no block, and the committed
workloads that put these paths into the default `kvbench run`."""
from __future__ import annotations

import pytest
from conftest import make_config

from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.model.rules import rule_set
from kvbench.contract import registry
from kvbench.model.oracle import Oracle
from kvbench.traces.format import Append, Fork, Free, Header, Prefill, Trace, loads

# The trace: a block-aligned prompt seen before, every one of its blocks a hit.
ALL_HIT = """\
{"kvbench_trace": 1, "family": "demo", "generator": "hand", "params": {}, "seed": 0, "settings": {"block_size": 4, "num_blocks": 6, "prefix_caching": true}}
{"step": 0, "op": "prefill", "seq": 0, "tenant": "default", "tokens": 8, "block_hashes": ["x", "y"]}
{"step": 1, "op": "free", "seq": 0}
{"step": 2, "op": "prefill", "seq": 1, "tenant": "default", "tokens": 8, "block_hashes": ["x", "y"]}
{"step": 3, "op": "free", "seq": 1}
"""

CACHING = [n for n, e in registry.entries().items()
           if e.available()[0] and getattr(e.load(), "capabilities", None) is not None
           and e.load().capabilities.prefix_caching]
RUNNABLE = [n for n, e in registry.entries().items() if e.available()[0]]


def test_some_backend_here_declares_prefix_caching():
    assert {"numpy", "numpy-int8", "numpy-int4"} <= set(CACHING)


@pytest.mark.parametrize("name", CACHING)
def test_a_prompt_whose_every_block_is_cached(name):
    trace = loads(ALL_HIT, path="all-hit.jsonl")
    backend = registry.create(name, suite.config_for(trace))
    v = check(trace, backend)
    assert v.status == "pass", v.divergence
    # 2 = 8 tokens / 4 per block: both blocks of the second prompt were hits (1 = 2 - 1 for a
    # backend that declares EAGLE's rule, a hit of L blocks taken as L - 1).
    assert v.final_ledger["prefix_hit_blocks"] == 2 - rule_set(backend.capabilities).hit_drops_last_block
    # After the last free both blocks stay cached (counted free): 6 = 6 - 0 in use.
    assert v.final_ledger["cached_blocks"] == 2 and v.final_ledger["blocks_free"] == 6


def _ops(*ops):
    """An in-memory trace that the loader would refuse (0-token operations): the protocol allows
    them, the trace format does not, and a backend must still serve them."""
    return Trace(Header(family="zero"), list(ops), name="zero")


ZERO_SIZED = {
    "prefill of 0 tokens": _ops(Prefill(0, 0, "a", 0), Free(1, 0)),
    "fork of an empty sequence, then written": _ops(
        Prefill(0, 0, "a", 0), Fork(1, 1, 0), Append(2, (1,), (3,)), Free(3, 0), Free(4, 1)),
    "append of 0 tokens": _ops(Prefill(0, 0, "a", 5), Append(1, (0,), (0,)), Free(2, 0)),
    "a batch of zeros": _ops(Prefill(0, 0, "a", 5), Prefill(1, 1, "a", 4), Append(2, (0, 1), (0, 0)),
                             Free(3, 0), Free(4, 1)),
    "0 tokens beside a copy-on-write": _ops(Prefill(0, 0, "a", 5), Fork(1, 1, 0),
                                            Append(2, (0, 1), (0, 2)), Free(3, 0), Free(4, 1)),
    "an all-hit prompt while its first holder lives": _ops(
        Prefill(0, 0, "a", 8, ("x", "y")), Prefill(1, 1, "a", 8, ("x", "y")), Fork(2, 2, 1),
        Append(3, (2,), (1,)), Free(4, 0), Free(5, 1), Free(6, 2)),
    "an all-hit prompt with a partial tail of its own": _ops(
        Prefill(0, 0, "a", 9, ("x", "y")), Free(1, 0), Prefill(2, 1, "a", 9, ("x", "y")),
        Append(3, (1,), (4,)), Free(4, 1)),
    "free of a sequence whose blocks are all cached": _ops(
        Prefill(0, 0, "a", 8, ("x", "y")), Prefill(1, 1, "a", 8, ("x", "y")), Free(2, 1), Free(3, 0)),
}


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "caching"])
@pytest.mark.parametrize("case", list(ZERO_SIZED))
@pytest.mark.parametrize("name", RUNNABLE)
def test_operations_that_write_or_take_nothing(name, case, caching):
    config = make_config(4, 8, prefix_caching=caching, max_context=32)
    v = check(ZERO_SIZED[case], registry.create(name, config))
    assert v.status == "pass", v.divergence


class Counting(Oracle):
    """The oracle, counting the prefix-cache events a trace drives it through."""

    def __init__(self, config):
        super().__init__(config)
        self.events = dict(all_hit=0, partial_hit=0, miss_after_hit=0, cached_block_reused=0,
                           recompute_hit=0)
        self._recomputing = False

    def _new_block(self, fill, group):
        if not self.uncached_free:  # no uncached free block left: a cached one is reused
            self.events["cached_block_reused"] += 1
        return super()._new_block(fill, group)

    def prefill(self, seq, tokens, tenant, final, step, protect=(), hashes=(), **keys):
        lookup = self.prompt_keys(tokens, hashes, **keys) if self.caching else ()
        hits = self._hit_plan(lookup)[0]
        victims = super().prefill(seq, tokens, tenant, final, step, protect, hashes, **keys)
        full = tokens // self.B
        if hits and hits == -(-tokens // self.B):
            self.events["all_hit"] += 1
        elif hits:
            self.events["partial_hit"] += 1
            self.events["miss_after_hit"] += hits < len(lookup) or hits < full
        if hits and self._recomputing:
            self.events["recompute_hit"] += 1
        return victims

    def recompute(self, seq, step, protect=()):
        self._recomputing = True
        try:
            return super().recompute(seq, step, protect)
        finally:
            self._recomputing = False


def events(workload: str, policy=None) -> dict:
    trace = suite.load_traces([suite.WORKLOADS_DIR / f"{workload}.jsonl"])[0]
    config = suite.config_for(trace, policy=policy)
    assert config.prefix_caching  # on by the header's settings (the trace carries hashes)
    model = Counting(config)
    check(trace, None, model=model)
    return model.events


def test_the_default_run_replays_prefix_caching_workloads():
    names = {p.stem for p in suite.committed_workloads()}
    assert {"prefix-reuse", "prefix-tenants"} <= names


def test_prefix_reuse_reaches_every_prefix_cache_path():
    e = events("prefix-reuse")
    assert e["all_hit"] >= 1  # a block-aligned prompt seen before (it once crashed the oracle)
    assert e["partial_hit"] >= 1 and e["miss_after_hit"] >= 1
    assert e["cached_block_reused"] >= 1  # a cached block evicted to make room, then reused


@pytest.mark.parametrize("policy", ["lru", "lfu", "fair"])
def test_prefix_tenants_hits_after_recompute(policy):
    e = events("prefix-tenants", policy)
    assert e["recompute_hit"] >= 1  # an evicted sequence re-prefilled onto its cached prefix
    assert e["all_hit"] + e["partial_hit"] >= 1


class HitsPerPrefill(Oracle):
    """The oracle, noting the prefix-hit blocks each prefill adds (by step)."""

    def __init__(self, config):
        super().__init__(config)
        self.hits_at = {}

    def prefill(self, seq, tokens, tenant, final, step, *args, **kw):
        before = self.hit_blocks
        victims = super().prefill(seq, tokens, tenant, final, step, *args, **kw)
        self.hits_at[step] = self.hit_blocks - before
        return victims


def test_prefix_salts_shares_within_a_salt_only_by_hashes_and_by_token_ids():
    trace = suite.load_traces([suite.WORKLOADS_DIR / "prefix-salts.jsonl"])[0]
    config = suite.config_for(trace)
    assert config.prefix_caching and config.block_size == 8
    model = HitsPerPrefill(config)
    check(trace, None, model=model)
    prefills = [op for op in trace.ops if isinstance(op, Prefill)]
    for naming in ("block_hashes", "token_ids"):
        # Each pass opens with the same whole prompt under alice (salt a), bob (salt b), carol
        # (salt a), dave (none) and erin (adapter a): only carol may hit, all of alice's blocks.
        first = next(i for i, op in enumerate(prefills) if getattr(op, naming))
        opening = prefills[first:first + 5]
        assert [(op.tenant, op.salt, op.adapter) for op in opening] == [
            ("alice", "a", None), ("bob", "b", None), ("carol", "a", None), ("dave", None, None),
            ("erin", None, "a")]
        assert len({op.tokens for op in opening}) == 1 and all(getattr(op, naming) for op in opening)
        m, tail = divmod(opening[0].tokens, 8)
        assert tail == 0  # an exact multiple of the block size: every block can be a hit
        # alice's blocks are new in this pass (the other naming's keys are other keys): 0 hits
        assert [model.hits_at[op.step] for op in opening] == [0, 0, m, 0, 0]
    # Later rounds find the pool full of cached blocks: some are evicted and their ids reused,
    # and salted prompts still hit (the prefixes of the second half of each pass).
    e = events("prefix-salts")
    assert e["cached_block_reused"] >= 1 and e["partial_hit"] >= 1
    assert any(op.salt and op.block_hashes and model.hits_at[op.step] for op in prefills[5:])
