"""Operations between a transfer's begin and its completion (SPEC §11: the backend moves the
bytes at a moment of its choosing in between): tier-races puts frees, aborts, a second store, a
flush that takes every block the leases leave, a load and a prefill of its prompt there; the
pools pass it whichever moment they copy at, and a pool whose copy or lease depends on the
moment fails at the step the race shows it."""
from __future__ import annotations

import dataclasses

import pytest

from impls.faults_tiers import LeaseEndsAtBegin, LoadTargetHitEarly, StoreReadsRowAtCompletion
from impls.numpy_paged import NumpyPaged
from impls.torch_paged import TorchPaged
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.contract.protocol import Backend
from kvbench.traces.tier_ops import Done, Load, Store

B, N = 8, 24  # tier-races' blocks of 8, 24 of them


@pytest.fixture(scope="module")
def races():
    return suite.load_traces([suite.WORKLOADS_DIR / "tier-races.jsonl"])[0]


def between(trace):
    """{store id: the operations between its begin and its completion}."""
    begun = {op.id: i for i, op in enumerate(trace.ops) if isinstance(op, Store)}
    return {op.id: (trace.ops[begun[op.id]], trace.ops[begun[op.id] + 1:i])
            for i, op in enumerate(trace.ops) if isinstance(op, Done) and op.id in begun}


def test_every_store_has_its_sequence_released_and_every_free_block_taken_before_it_completes(races):
    assert (races.header.settings["block_size"], races.header.settings["num_blocks"]) == (B, N)
    seen = set()
    for store, ops in between(races).values():
        kinds = [op.kind for op in ops]
        # its sequence freed or aborted; a flush of every block but the 3 leased: (24 - 3) * 8
        assert any(op.kind in ("free", "abort") and op.seq == store.seq for op in ops)
        assert any(op.kind == "prefill" and op.tokens == (N - 3) * B and op.tenant == "flush"
                   for op in ops)
        seen.update(kinds)
        seen.update(f"store of {op.seq}" for op in ops if isinstance(op, Store) and op.seq == store.seq)
        seen.update("load" for op in ops if isinstance(op, Load))
    assert {"abort", "done", "load"} <= seen  # an abort, another completion, a load in between
    assert any(s.startswith("store of") for s in seen)  # a second store of the same blocks
    assert any(not op.ok for op in races.ops if isinstance(op, Done))  # one fails


def flush_counting(base):
    class FlushCounting(base):
        """Notes the free blocks after each flush: none, when it took all the leases leave."""

        def prefill(self, seq, prompt, kv=None, **kw):
            victims = super().prefill(seq, prompt, kv, **kw)
            if prompt.tenant == "flush":
                self.after_flush = getattr(self, "after_flush", []) + [self.ledger().blocks_free]
            return victims
    return FlushCounting


@pytest.mark.parametrize("pool", [NumpyPaged, TorchPaged])
@pytest.mark.parametrize("when", ["begin", "completion"])
def test_the_pools_pass_it_copying_at_begin_or_at_completion(races, pool, when, monkeypatch):
    monkeypatch.setattr(pool, "TRANSFER_AT", when)
    backend = flush_counting(pool)(suite.config_for(races))
    try:
        v = check(races, backend, gather="all")
    finally:
        backend.close()
    assert v.valid is True, str(v.divergence)
    assert backend.after_flush == [0] * 10  # 10 rounds, each flush an exact fit beside 3 leases


def test_a_copy_at_completion_from_the_reused_row_fails_at_the_completion(races):
    # Step 0 prefills 31 = 3 * 8 + 7 tokens (3 hashed blocks of 4), step 1 stores them, step 2
    # frees the sequence, step 3's flush takes its row; the copy at step 5 reads the flush's
    # blocks there. The same fault copying at begin reads the row before the race: it passes.
    v = check(races, StoreReadsRowAtCompletion(suite.config_for(races)))
    assert (v.valid, v.divergence.step, v.divergence.quantity) == (False, 5, "tier content of transfer 0")
    at_begin = type("AtBegin", (StoreReadsRowAtCompletion,), {"TRANSFER_AT": "begin"})
    assert check(races, at_begin(suite.config_for(races))).valid is True


def test_a_lease_ended_at_the_begin_fails_there_on_the_structures_or_else_on_the_ledger(races):
    # Step 1 stores the 3 hashed blocks: each held by the table and the store, 1 + 1
    # references; the fault's are 1. Without block structures the ledger shows it: the 3
    # blocks with 2 references are shared_blocks, 3 expected, 0 reported.
    d = check(races, LeaseEndsAtBegin(suite.config_for(races))).divergence
    assert (d.step, d.quantity, d.expected, d.actual) == (1, "reference count of block 0", 1 + 1, 1)
    no_ids = type("NoIds", (LeaseEndsAtBegin,), {"capabilities": dataclasses.replace(
        LeaseEndsAtBegin.capabilities, block_ids=False)})
    d = check(races, no_ids(suite.config_for(races))).divergence
    assert (d.step, d.quantity, d.expected, d.actual) == (1, "shared_blocks", 3, 0)


def test_a_load_target_hit_before_completion_fails_at_the_hit(races):
    # Round 4 (steps 26..36): after the flush (steps 29, 30) a load of round 3's prompt begins
    # at step 31, its 3 blocks from host; step 32 prefills that prompt's first 2 blocks before
    # the load completes (step 34): no hit on the targets, which the fault gives it.
    silent = type("Silent", (LoadTargetHitEarly,), {"events": Backend.events})  # figures alone
    d = check(races, silent(suite.config_for(races))).divergence
    assert (d.step, d.op["op"]) == (32, "prefill")
    assert "the target of load 6 alone" in str(d.expected)
    # Its KV events (SPEC §14) show it at the load's begin: the 3 targets announced as cache
    # entries (r3.0 .. r3.2) before the load completes, beside the flush's r4.x.
    d = check(races, LoadTargetHitEarly(suite.config_for(races))).divergence
    assert (d.step, d.quantity) == (31, "residency of group 0, tier 0")
    assert d.expected == {"stored": ["r4.x"], "removed": []}
    assert d.actual == {"stored": ["r3.0", "r3.1", "r3.2", "r4.x"], "removed": []}
