"""Tier replays (SPEC §11) through the checker: the NumPy and torch pools with a host and a disk
tier pass; leases, loads, aborts and failed stores as the oracle derives them; backends without
tiers are n/a with the reason."""
from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
from conftest import make_config

from impls.contiguous import Contiguous
from impls.faults_tiers import (FailedLoadReserved, HitCountedBeforeAllocation, LeaseEndsAtFree,
                                 PinsReleasedWithoutSalt)
from impls.numpy_paged import NumpyPaged
from impls.numpy_quant_paged import NumpyQuantPaged
from impls.torch_paged import TorchPaged
from kvbench.checking.checker import check
from kvbench.contract.protocol import Prompt, kv_tokens
from kvbench.traces.tier_ops import TierSpec
from kvbench.traces.format import Append, Free, Header, Prefill, Trace, validate
from kvbench.traces.tier_ops import Abort, Done, Load, Lookup, Store

TIERS = (TierSpec("host", 4), TierSpec("disk", 8))
POOLS = [NumpyPaged, pytest.param(TorchPaged, marks=pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"))]


def steps(*makers):
    """Operations from makers taking their step: lambda s: Prefill(s, ...)."""
    return [m(i) for i, m in enumerate(makers)]


def P(seq, tokens, hashes=None, salt=None):
    return lambda s: Prefill(s, seq, "a", tokens, hashes, salt)


def LD(tid, seq, tokens, hashes, salt=None):
    return lambda s: Load(s, seq, "a", tokens, hashes, salt, id=tid)


def ST(tid, seq, tier="host", blocks=None):
    return lambda s: Store(s, tid, seq, tier, blocks)


def D(tid, ok=True):
    return lambda s: Done(s, tid, ok)


def F(seq):
    return lambda s: Free(s, seq)


def AB(seq):
    return lambda s: Abort(s, seq)


def AP(seq, n):
    return lambda s: Append(s, (seq,), (n,))


def run(ops, backend_cls=NumpyPaged, num_blocks=16, **kw):
    t = validate(Trace(Header("tiers", tiers=kw.pop("tiers", TIERS)), ops, name="t"))
    backend = backend_cls(make_config(num_blocks=num_blocks, prefix_caching=True))
    try:
        return check(t, backend, **kw)
    finally:
        backend.close()


ROUND_TRIP = steps(
    P(0, 40, [1, 2]),            # blocks 0, 1 (hashed), 2
    ST(1, 0, "host"),            # blocks 0, 1 leased
    F(0),                        # 0 and 1 stay in use until the store completes
    P(1, 13 * 16),               # 13 blocks: 3..15 but 0, 1 (leased), and 2 freed
    D(1),                        # 0, 1 to the cached queue
    F(1),
    P(2, 16 * 16),               # every block: the cached 0 and 1 are taken (their hashes forgotten)
    F(2),
    LD(2, 3, 40, [1, 2]),        # no device hit, 2 blocks from host, 1 computed
    D(2),
    ST(3, 3, "disk"),
    D(3, ok=False),              # a failed store leaves no trace on disk
    AB(3),
)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("when", ["begin", "completion"])
def test_round_trip_passes(when, pool, monkeypatch):
    monkeypatch.setattr(pool, "TRANSFER_AT", when)
    v = run(ROUND_TRIP, pool)
    assert v.valid, v.divergence
    assert v.ops == len(ROUND_TRIP)


@pytest.mark.parametrize("pool", POOLS)
def test_gather_all_passes(pool):
    v = run(ROUND_TRIP, pool, gather="all")
    assert v.valid, v.divergence


def stores_the_next_block(pool):
    class StoresTheNextBlock(pool):
        """The copy down reads the block after the one it stores."""

        def _copy_down(self, t, blocks, slots):
            super()._copy_down(t, np.asarray(blocks) + 1, slots)
    return StoresTheNextBlock


def test_lease_ending_at_the_free_fails_there():
    v = run(ROUND_TRIP, LeaseEndsAtFree)
    assert v.valid is False
    d = v.divergence
    # The free drops block 0's lease with its table's reference: 0 + 1 (the store in flight)
    # expected, 0 held; the ledger (2 in use: blocks 0 and 1, leased) would part ways next.
    assert (d.step, d.quantity) == (2, "reference count of block 0")
    assert (d.expected, d.actual) == (1, 0)
    assert "store(s) in flight copying it" in d.detail


@pytest.mark.parametrize("pool", POOLS)
def test_a_wrong_copy_down_fails_at_the_completion(pool):
    v = run(ROUND_TRIP, stores_the_next_block(pool))
    assert v.valid is False
    d = v.divergence
    assert (d.step, d.quantity) == (4, "tier content of transfer 1")


# Prompt [1, 2] stored to host and pushed off the device: where both traces below begin.
OFFLOADED = (
    P(0, 40, [1, 2]),            # blocks 0, 1 (hashed), 2
    ST(1, 0, "host"),
    D(1),                        # host holds 1 and 2
    F(0),
    P(1, 16 * 16),               # every block: the device forgets 1 and 2
    F(1),
)
FAILED_RELOAD = steps(
    *OFFLOADED,
    LD(2, 2, 40, [1, 2]),        # 2 blocks from host
    D(2, ok=False),              # the load fails: its 2 blocks computed again
    F(2),
    P(3, 16 * 16),               # the device forgets them again
    F(3),
    LD(3, 4, 40, [1, 2]),        # host's 2 blocks again where it keeps them, none if it dropped them
    D(3),
    F(4),
)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("failed_load, stored, hits", [
    ("keep", 2, 2 + 2),  # both loads took host's 2 blocks
    ("drop", 0, 2),      # the failed load's 2, then none: host holds nothing to serve
])
def test_a_failed_load_leaves_the_tier_as_it_declares(pool, failed_load, stored, hits):
    tiers = (TierSpec("host", 4, failed_load=failed_load), TierSpec("disk", 8))
    b = pool(make_config(num_blocks=16, prefix_caching=True))
    try:
        v = check(validate(Trace(Header("tiers", tiers=tiers), FAILED_RELOAD, name="t")), b)
        assert v.valid, v.divergence  # the pool's ledgers are the oracle's at every operation
        host = b.tier_ledgers()[0]
    finally:
        b.close()
    assert (host["stored"], host["hits"]) == (stored, hits)


def test_a_tier_that_serves_a_failed_load_again_fails_at_the_failure():
    v = run(FAILED_RELOAD, FailedLoadReserved, tiers=(TierSpec("host", 4, failed_load="drop"),))
    d = v.divergence
    # step 7: the load of host's 2 blocks fails; host drops them (0 stored), the fault keeps 2
    assert (v.valid, d.step, d.quantity, d.expected, d.actual) == (False, 7, "tier host stored", 0, 2)


def test_a_backend_keeping_failed_loads_only_is_not_applicable_to_a_drop_tier():
    class KeepsOnly(NumpyPaged):
        capabilities = dataclasses.replace(NumpyPaged.capabilities, tier_rules=())

    v = run(FAILED_RELOAD, KeepsOnly, tiers=(TierSpec("host", 4, failed_load="drop"),))
    assert v.valid is None and "failed_load 'drop'" in v.not_applicable


RETRIED_LOAD = steps(
    *OFFLOADED,
    P(2, 14 * 16),               # 14 of the 16 blocks
    LD(2, 3, 40, [1, 2]),        # ceil(40 / 16) = 3 blocks > 16 - 14 = 2: out of memory
    F(2),
    LD(3, 4, 40, [1, 2]),        # the retry: host's 2 blocks
    D(3),
    F(4),
)


@pytest.mark.parametrize("pool", POOLS)
def test_a_load_out_of_memory_then_retried_counts_its_hits_once(pool):
    b = pool(make_config(num_blocks=16, prefix_caching=True))
    try:
        v = check(validate(Trace(Header("tiers", tiers=TIERS), RETRIED_LOAD, name="t")), b)
        assert v.valid, v.divergence
        assert b.tier_ledgers()[0]["hits"] == 2  # the retry's 2; the refused load took none
    finally:
        b.close()


def test_a_retry_counting_its_failed_allocations_hits_fails_at_the_refusal():
    d = run(RETRIED_LOAD, HitCountedBeforeAllocation).divergence
    # step 7: the load is refused (out of memory); the fault counts host's 2 blocks anyway
    assert (d.step, d.quantity, d.expected, d.actual) == (7, "tier host hits", 0, 2)


def test_backend_without_tiers_is_not_applicable():
    t = validate(Trace(Header("tiers", tiers=TIERS), ROUND_TRIP, name="t"))
    v = check(t, Contiguous(make_config(num_blocks=16)))
    assert v.valid is None and "does not declare tiers" in v.not_applicable


@pytest.mark.parametrize("pool", POOLS)
def test_round_trip_figures_by_hand(pool):
    b = pool(make_config(num_blocks=16, prefix_caching=True))
    t = validate(Trace(Header("tiers", tiers=TIERS), ROUND_TRIP, name="t"))
    try:
        assert check(t, b).valid
        host, disk = b.tier_ledgers()
    finally:
        b.close()
    bb = 16 * 2 * 2 * 2 * 8 * 2  # 1024 = block_size * 2 * layers * kv_heads * head_dim * 2 bytes
    # store 1: the 2 hashed blocks of sequence 0 down to host; load 2: both back up (no device hit:
    # sequence 2 took every block, the cached ones included); store 3 to disk fails
    assert (host["stored"], host["free"], host["hits"]) == (2, 4 - 2, 2)
    assert (host["bytes_down"], host["bytes_up"]) == (2 * bb, 2 * bb)
    assert (disk["stored"], disk["storing"], disk["free"], disk["bytes_down"]) == (0, 0, 8, 0)


# --- quantized pools: their codes and scales go down the tiers (SPEC §4, §11) ----------------

def quantized(fmt):
    return lambda config: NumpyQuantPaged(dataclasses.replace(config, kv_format=fmt))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_pool_passes_the_round_trip(fmt):
    v = run(ROUND_TRIP, quantized(fmt), gather="all")
    assert v.valid, v.divergence


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_pool_loads_back_exactly_the_codes_and_scales_it_stored(fmt):
    b = NumpyQuantPaged(make_config(num_blocks=4, prefix_caching=True, kv_format=fmt))
    b.attach_tiers((TierSpec("host", 2),))
    model = b.config.model
    try:
        b.prefill(0, Prompt(32, block_hashes=[1, 2]), kv_tokens(np.zeros(32, int), np.arange(32), model))
        before = [a[[0, 1]].copy() for a in b._storage()]  # sequence 0's two blocks: 0 and 1
        b.store(0, 0, "host")
        b.complete(0, True)
        b.free(0)
        # 64 tokens = 4 blocks: the 2 free ones, then the cached 0 and 1 (their hashes forgotten)
        b.prefill(1, Prompt(64), kv_tokens(np.ones(64, int), np.arange(64), model))
        b.free(1)
        assert b.hit_blocks == 0
        # no device hit: both blocks from host; the K/V handed over is another writer's
        b.load(1, 2, Prompt(32, block_hashes=[1, 2]), kv_tokens(np.full(32, 2), np.arange(32), model))
        b.complete(1, True)
        loaded = b.tables[0][b.row_of[2], :2]
        for array, stored in zip(b._storage(), before):  # codes, scales (int4: zero points)
            assert np.array_equal(array[loaded], stored)
    finally:
        b.close()


class StoresCodesOnly(NumpyQuantPaged):
    """A tier that keeps the codes but not their scales."""

    def _copy_down(self, t, blocks, slots):
        if len(blocks):
            self._copy_rows(self._storage()[0], blocks, t.arrays[0], slots)


def test_a_tier_without_the_scales_fails_at_the_stores_completion():
    v = run(ROUND_TRIP, lambda config: StoresCodesOnly(dataclasses.replace(config, kv_format="int8")))
    assert v.valid is False
    d = v.divergence
    assert (d.step, d.quantity) == (4, "tier content of transfer 1")  # 4: D(1), the store's completion


def LU(seq, tokens, hashes, salt=None):
    return lambda s: Lookup(s, seq, "a", tokens, hashes, salt)


PINNED = steps(
    P(0, 40, [1, 2], salt="s"),  # blocks 0, 1 (hashed under salt s), 2
    ST(1, 0, "host"),
    D(1),                        # host (capacity 2) holds both: full
    F(0),
    P(1, 16 * 16),               # every block: the device forgets them
    F(1),
    LU(2, 40, [1, 2], "s"),      # step 6: pins host's 2 entries (loading 2)
    P(3, 40, [3, 4]),
    ST(2, 3, "host"),            # host full, both entries pinned: nothing to evict, refused
    D(2),
    F(3),
    LD(3, 2, 40, [1, 2], "s"),   # the looked-up request: host's 2 blocks, the pins taken over
    D(3),                        # step 12: the load's pins released (loading 0)
    F(2),
    LU(4, 40, [1, 2], "s"),      # pinned again, then the request cancelled before its load
    AB(4),
)


@pytest.mark.parametrize("pool", POOLS)
def test_a_lookup_pins_until_its_load_completes_or_its_abort(pool):
    b = pool(make_config(num_blocks=16, prefix_caching=True))
    try:
        v = check(validate(Trace(Header("tiers", tiers=(TierSpec("host", 2),)), PINNED, name="t")), b)
        assert v.valid, v.divergence
        host = b.tier_ledgers()[0]
        # the pinned entries survived the refused store: the load took both (2 hits), and no
        # pin is left (the load's released at its done, the second lookup's at its abort)
        assert (host["stored"], host["hits"], host["loading"]) == (2, 2, 0)
    finally:
        b.close()


def test_pins_released_by_a_key_without_its_salt_fail_at_the_loads_completion():
    d = run(PINNED, PinsReleasedWithoutSalt, tiers=(TierSpec("host", 2),)).divergence
    # step 12: the load completes; its 2 salted pins are released by their unsalted keys, which
    # no entry has: host's 2 entries stay pinned
    assert (d.step, d.quantity, d.expected, d.actual) == (12, "tier host loading", 0, 2)


def test_a_backend_without_lookup_is_not_applicable_to_a_trace_with_lookups():
    class NoLookup(NumpyPaged):
        lookup = None

    v = run(PINNED, NoLookup, tiers=(TierSpec("host", 2),))
    assert v.valid is None and "lookup" in v.not_applicable


def test_pins_left_at_the_end_of_a_kept_going_trace_fail_naming_the_key_and_salt():
    v = run(PINNED, PinsReleasedWithoutSalt, tiers=(TierSpec("host", 2),), keep_going=True)
    assert v.divergence.step == 12  # the first: the load's done, kept going past it
    d = v.divergences[-1]["first"]  # the last: the trace's end (step 15), host's 2 still pinned
    assert v.divergences[-1]["stopped"] and (v.valid, d.step, d.quantity, d.expected, d.actual) == (
        False, 15, "tier host pins at the end of the trace", 0, 2)
    assert "block 0 (hash 1, salt 's') looked up at step 6" in d.detail
