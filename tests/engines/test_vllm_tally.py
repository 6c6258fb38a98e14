"""The vLLM adapters' ledgers come from a tally of the blocks operations touched (BlockTally), not a
scan of the pool: after every operation of the committed workloads, the tally's pool-wide figures
are those a scan of every vLLM block gives.

Opt-in: needs vLLM (docs/engines.md); skipped elsewhere. Run::

    PYTHONPATH=$PWD /work/vllm-env/bin/python -m pytest tests/engines/test_vllm_tally.py
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvbench.analyses.suite import config_for, load_traces
from kvbench.checking.checker import check

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"
# Shared prefixes, forks, copy-on-write, sliding windows, lookahead slots, preemption, refusals.
NAMES = ("prefix-reuse", "fork-wide", "fork-beam", "hybrid-windows", "hybrid-decode",
         "lifecycle-speculative", "lifecycle-preempt", "lifecycle-chunked", "edge-refusals")


@pytest.fixture(scope="module")
def vllm():
    from impls.engines.vllm_blockpool import NOT_INSTALLED
    from impls.engines.vllm_kvmanager import available
    ok, why = available()
    if not ok and why == NOT_INSTALLED:
        pytest.skip("vLLM is not installed (opt-in): see docs/engines.md for its recipe")
    assert ok, why


def scanned(be) -> dict:
    """The pool-wide figures from every block of vLLM's pool, and the tables' fills."""
    B = be.block_size
    tables = be.tally.tables
    fill, held, reservation = {}, [set() for _ in be.tally.group_refs], 0
    for s in list(be.tally.copy):
        now = tables(s)
        if now is None:
            continue
        for g, table in enumerate(now[0]):
            for i, b in enumerate(table):
                if not b.is_null:
                    fill[b.block_id] = max(0, min(B, now[1] - i * B))
                    held[g].add(b.block_id)
        reservation += be._reservation_of(s)[0]
    used = [b for b in be.pool.blocks if b.ref_cnt > 0 and not b.is_null]
    return {"blocks_used": len(used), "shared_blocks": sum(1 for b in used if b.ref_cnt > 1),
            "cached_blocks": sum(1 for b in be.pool.blocks
                                 if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None),
            "token_states": sum(fill.get(b.block_id, 0) for b in used),
            "reservation": reservation, "group_blocks": tuple(len(h) for h in held)}


def scanning(cls):
    """The adapter, its every ledger checked against the scan."""

    class Scanned(cls):
        def ledger(self, seqs=None):
            led = super().ledger(seqs)
            want = scanned(self)
            got = {k: getattr(led, k) for k in want}
            if not got["group_blocks"]:  # one group: the ledger reports none
                want.pop("group_blocks"), got.pop("group_blocks")
            assert got == want, (got, want)
            return led

    return Scanned


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("adapter", ["VllmKVManager", "VllmBlockPool"])
def test_the_tally_is_the_scan(vllm, name, adapter):
    import impls.engines.vllm_blockpool as bp
    import impls.engines.vllm_kvmanager as km
    cls = {"VllmKVManager": km.VllmKVManager, "VllmBlockPool": bp.VllmBlockPool}[adapter]
    trace = load_traces([WORKLOADS / f"{name}.jsonl"])[0]
    cfg = config_for(trace, policy=None, prefix_caching=True)
    be = scanning(cls)(cfg)
    v = check(trace, be)
    if v.not_applicable:
        pytest.skip(v.not_applicable)
    # A divergence the unscanned adapter shares is the engine's, not the tally's.
    plain = check(trace, cls(cfg))
    assert (v.valid, str(v.divergence)) == (plain.valid, str(plain.divergence)), v.error or v.traceback
    assert not v.error, v.traceback
    assert v.ops == len(trace.ops) or not v.valid


def test_a_copy_on_write_gives_the_sharer_its_reservation_back(vllm):
    """B = 4. Sequence 0: 6 tokens, final 8; its fork 1 shares its tail (2 free slots), so
    neither reserves them. Sequence 1's append copies the tail: sequence 0's is its own again,
    an operation on sequence 1 alone that moves sequence 0's reservation."""
    from conftest import make_config

    from impls.engines.vllm_blockpool import VllmBlockPool
    from kvbench.contract.protocol import Prompt
    be = VllmBlockPool(make_config(4, 8, store_kv=False))
    be.prefill(0, Prompt(6, final_tokens=8))
    be.fork(1, 0, final_tokens=7)
    assert be.ledger().reservation == 0  # the shared tail: no one's
    be.append([1], [1])
    # seq 0: min(2 free, 8 - 6) = 2; seq 1's copy: 7 tokens, min(1 free, 7 - 7 = 0) = 0
    assert be.ledger().reservation == 2
    assert be.ledger().reservation == scanned(be)["reservation"]


# --- a sweep reads the blocks operations took (FreeQueueState._split_at_untaken) ----------------

def walked(structures) -> tuple:
    """vLLM's free queue walked whole and every block's ref_cnt, in kvbench's ids: what a sweep
    read before it skipped the blocks no operation took."""
    free, cached = [], []
    for b in structures._queue():
        (free if b.block_hash is None else cached).append(b.block_id - 1)
    return free, cached, [b.ref_cnt for b in structures.pool.blocks[1:]]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("adapter", ["VllmKVManager", "VllmBlockPool"])
def test_a_sweep_reads_what_a_walk_of_the_whole_queue_reads(vllm, name, adapter):
    """Every whole block_state of a replay, at 8 times the trace's pool (a long run no
    operation took), is the whole walk's, read past the untaken run (never the fallback).
    Could be false: vLLM's queue not laid out as freed uncached, untaken run, cached (a run
    that did not start at top + 1, or a cached block inside it)."""
    import impls.engines.vllm_blockpool as bp
    import impls.engines.vllm_kvmanager as km
    cls = {"VllmKVManager": km.VllmKVManager, "VllmBlockPool": bp.VllmBlockPool}[adapter]
    trace = load_traces([WORKLOADS / f"{name}.jsonl"])[0]
    cfg = config_for(trace, policy=None, prefix_caching=True)
    cfg = dataclasses.replace(cfg, num_blocks=cfg.num_blocks * 8)
    reads = []

    class Compared(cls):
        def block_state(self, seqs=None, *, changed_since=None):
            state = super().block_state(seqs, changed_since=changed_since)
            if state.changes is None:
                reads.append(self.structures._split_at_untaken() is not None)
                assert (list(state.free), list(state.cached), list(state.refcount)) == \
                    walked(self.structures)
            return state

    v = check(trace, Compared(cfg))
    if v.not_applicable:
        pytest.skip(v.not_applicable)
    assert v.valid is True, str(v.divergence)
    assert reads and all(reads), reads


def test_a_block_leaked_from_the_untaken_run_falls_back_to_the_walk_and_fails_there(vllm):
    """A planted leak: after the first prefill (2 blocks of 4 tokens: vLLM's 1 and 2 taken),
    block 6 of the untaken run 3 .. 16 leaves vLLM's free queue, its ref_cnt left 0, in no
    table. The queue then counts 16 - 2 - 1 = 13 free, the run's 14 less one: the read past the
    run finds the head out of line and walks the whole queue; the checker FAILs at that
    prefill (op 0), where the walk of every block always did. Could be false: a read that
    trusted the run's ends without the queue's count (block 6 listed free, the leak unseen
    until the free count came short)."""
    from conftest import make_config

    from impls.engines.vllm_blockpool import VllmBlockPool
    from kvbench.contract.protocol import Prompt
    from kvbench.traces.format import Free, Header, Prefill, Trace, validate

    class Leaking(VllmBlockPool):
        def prefill(self, seq, prompt, kv=None, **kw):
            out = super().prefill(seq, prompt, kv, **kw)
            if seq == 0:
                self.pool.free_block_queue.remove(self.pool.blocks[6])
            return out

    trace = validate(Trace(Header(family="test", settings={"block_size": 4}),
                           [Prefill(0, 0, "a", 8), Prefill(1, 1, "a", 4), Free(2, 0)], name="leak"))
    cfg = make_config(4, 16, store_kv=False)
    be = Leaking(cfg)
    be.prefill(0, Prompt(8))
    be.block_state()
    assert be.structures.top == 2 and be.structures._split_at_untaken() is None  # the whole walk
    d = check(trace, Leaking(cfg)).divergence
    assert d is not None and d.index == 0, str(d)
    walk = Leaking(cfg)
    walk.structures._split_at_untaken = lambda: None  # every sweep the whole walk, as before
    assert str(check(trace, walk).divergence) == str(d)


def test_the_order_fault_fails_hybrid_windows_at_step_5_in_a_pool_64_times_larger(vllm):
    """The planted free queue that appends cached blocks reversed (faults_engines) FAILs
    hybrid-windows at step 5 at the trace's pool (test_engine_faults.py); at 64 times it, where
    the sweeps read past a run of untaken blocks 63 times the pool the trace uses, at the same
    step and on the same quantity. Could be false: a sweep that lost the cached tail's order."""
    from impls.engines.faults_engines import VllmKVManagerCachedReversed
    trace = load_traces([WORKLOADS / "hybrid-windows.jsonl"])[0]
    cfg = config_for(trace, policy=None)
    big = dataclasses.replace(cfg, num_blocks=cfg.num_blocks * 64)
    d = check(trace, VllmKVManagerCachedReversed(big)).divergence
    assert (d.step, d.quantity) == (5, "cached blocks (next evicted first)"), str(d)
