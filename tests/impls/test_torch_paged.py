"""The torch paged backend against the NumPy one and the checker.

``Tandem`` drives a TorchPaged (on cpu) and a NumpyPaged with the same calls, in step, and asserts
after every call that both had the same outcome (victims, or out of memory), the same ledger, and
return the same K/V for every sequence the checker gathers. The checker drives the tandem, so the
torch backend is also checked against the oracle on the same run.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import TINY, A, K, P, X, make_config, make_trace  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402
from test_hybrid_properties import HybridHistory  # noqa: E402
from test_properties import SETTINGS, History  # noqa: E402

from impls.numpy_paged import NumpyPaged  # noqa: E402
from impls.torch_paged import TorchPaged  # noqa: E402
from kvbench.analyses import suite  # noqa: E402
from kvbench.checking.checker import check  # noqa: E402
from kvbench.contract.protocol import Backend, OutOfMemory, Prompt, gathered_range, kv_values  # noqa: E402
from kvbench.traces.format import load  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# long-history (10^4 operations, ledger-only) takes half a minute in tandem; the default run and
# the exact gates replay torch through it.
WORKLOADS = sorted(p for p in (REPO / "workloads").glob("*.jsonl") if p.stem != "long-history")


class Tandem(Backend):
    """TorchPaged and NumpyPaged in step; answers with torch's results once they agree."""

    def __init__(self, config):
        self.t, self.n = TorchPaged(config), NumpyPaged(config)
        super().__init__(self.t.config)
        self.name, self.capabilities = "torch", TorchPaged.capabilities
        self.calls = 0

    def _both(self, what, call):
        self.calls += 1
        outcomes = []
        for b in (self.t, self.n):
            try:
                outcomes.append(tuple(call(b) or ()))
            except OutOfMemory:
                outcomes.append("out of memory")
        where = f"call #{self.calls} {what}"
        assert outcomes[0] == outcomes[1], f"{where}: torch {outcomes[0]}, numpy {outcomes[1]}"
        lt, ln = self.t.ledger().as_dict(), self.n.ledger().as_dict()
        diff = [f"{k}: torch {lt[k]!r}, numpy {ln[k]!r}" for k in lt if lt[k] != ln[k]]
        assert not diff, f"{where}: ledgers differ: " + "; ".join(diff)
        if outcomes[0] == "out of memory":
            raise OutOfMemory(f"{where}: both backends refused it")
        return outcomes[0]

    def prefill(self, seq, prompt, kv=None, **kw):
        return self._both(f"prefill({seq}, {prompt.tokens})", lambda b: b.prefill(seq, prompt, kv, **kw))

    def append(self, seqs, tokens, kv=None, *, step=0):
        return self._both(f"append({list(seqs)}, {list(tokens)})",
                          lambda b: b.append(seqs, tokens, kv, step=step))

    def fork(self, seq, src, **kw):
        return self._both(f"fork({seq}, {src})", lambda b: b.fork(seq, src, **kw))

    def accept(self, seq, n, **kw):
        return self._both(f"accept({seq}, {n})", lambda b: b.accept(seq, n, **kw))

    def free(self, seq, *, step=0):
        return self._both(f"free({seq})", lambda b: b.free(seq, step=step))

    def ledger(self, seqs=None):
        return self.t.ledger(seqs)

    def block_state(self, seqs=None):
        got, want = self.t.block_state(seqs), self.n.block_state(seqs)
        for f in ("free", "cached", "refcount", "tables"):
            g, w = getattr(got, f), getattr(want, f)
            same = (g.keys() == w.keys() and all(np.array_equal(x, y) for k in g for x, y in zip(g[k], w[k]))
                    if f == "tables" else np.array_equal(np.asarray(g), np.asarray(w)))
            assert same, f"after call #{self.calls}: {f} differ: torch {g}, numpy {w}"
        return got

    def gather(self, seq, start=0, stop=None, *, out=None):
        got, want = self.t.gather(seq, start, stop), self.n.gather(seq, start, stop)
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, type(got)
        assert np.array_equal(got, want), f"after call #{self.calls}: K/V of sequence {seq} differ"
        return gathered_range(got, out=out)

    def read_state(self, seq):
        got, want = self.t.read_state(seq), self.n.read_state(seq)
        assert np.array_equal(got, want), f"after call #{self.calls}: states of sequence {seq} differ"
        return got


def tandem_check(trace, config, gather="touched"):
    v = check(trace, Tandem(config), gather=gather)
    assert v.valid is True, str(v.divergence)
    return v


# --- committed workloads, every policy they run under (all three for tenant mixes) ----------

# torch has no lower tiers (SPEC §11): n/a on a tier workload, as any backend without them.
WORKLOAD_CASES = [(p, pol) for p in WORKLOADS if not load(str(p)).header.tiers
                  for pol in suite.policies_for(load(str(p)), "auto")]


@pytest.mark.parametrize("path,policy", WORKLOAD_CASES,
                         ids=[f"{p.stem}-{pol or 'none'}" for p, pol in WORKLOAD_CASES])
def test_committed_workload_matches_numpy(path, policy):
    trace = load(str(path))
    v = tandem_check(trace, suite.config_for(trace, policy=policy))
    assert v.ops == len(trace)
    if trace.header.tenants:  # tenant mixes are committed with a budget that forces eviction
        assert v.evictions > 0


def test_ledger_only_mode_matches_numpy():
    trace = load(str(WORKLOADS[0])) if WORKLOADS else make_trace(P(0, 40), K(1, 0), A((0, 3), (1, 20)))
    v = tandem_check(trace, dataclasses.replace(suite.config_for(trace), store_kv=False))
    assert "kv content" in v.skipped


# --- hand-written cases, expected values from the formulas ---------------------------------------

@pytest.mark.parametrize("tokens,blocks,free_slots", [
    # One token each (the decode step's path): 0 and 1 copy the partial tail, 2 (the last
    # reference left) writes in place. 4 = ceil(20/16) + 2 copies; 33 = 3 tails * (16 - 5).
    ((1, 1, 1), 4, 33),
    # 3, 20 and 1 tokens: 0 and 1 copy the tail, 1 spills 20 - 12 = 8 tokens into a new block,
    # 2 writes in place. 5 = 2 + 2 copies + 1; 28 = 5 * 16 - (16 + 7 + 16 + 8 + 5).
    ((3, 20, 1), 5, 28),
])
def test_batched_writers_of_one_shared_tail(tokens, blocks, free_slots):
    # 20 tokens = 16 + 4: 2 blocks, shared by three sequences that all append in one batch.
    trace = make_trace(P(0, 20), K(1, 0), K(2, 0), A(*zip((0, 1, 2), tokens)))
    b = TorchPaged(make_config())
    v = check(trace, b, gather="all")
    assert v.valid, str(v.divergence)
    led = b.ledger()
    assert (led.blocks_used, led.free_slots) == (blocks, free_slots)
    assert led.shared_blocks == 1  # the full first block, 3 references
    assert led.tokens == {s: 20 + t for s, t in zip((0, 1, 2), tokens)}


def test_append_spanning_blocks_in_one_batch():
    b = TorchPaged(make_config(block_size=4, num_blocks=16))
    b.prefill(0, Prompt(3), kv_values(0, 0, 3, TINY))
    b.prefill(1, Prompt(4), kv_values(1, 0, 4, TINY))
    kv = np.concatenate([kv_values(0, 3, 9, TINY), kv_values(1, 4, 1, TINY)])
    b.append([0, 1], [9, 1], kv)
    led = b.ledger()
    # 0: 12 tokens, 3 blocks = ceil(12/4); 1: 5 tokens, 2 blocks = ceil(5/4).
    assert led.seq_blocks == {0: 3, 1: 2} and led.blocks_used == 5
    assert led.free_slots == 3  # 3 = 5 * 4 - (12 + 5)
    assert np.array_equal(b.gather(0), kv_values(0, 0, 12, TINY))
    assert np.array_equal(b.gather(1), kv_values(1, 0, 5, TINY))


def test_kv_as_torch_tensor():
    b = TorchPaged(make_config())
    kv = kv_values(3, 0, 20, TINY)
    b.prefill(3, Prompt(20), torch.from_numpy(kv))
    b.append([3], [2], torch.from_numpy(kv_values(3, 20, 2, TINY)))
    assert np.array_equal(b.gather(3), kv_values(3, 0, 22, TINY))


def test_pool_layout_and_dtype():
    b = TorchPaged(make_config(block_size=16, num_blocks=8))
    # [num_blocks, block_size, 2, layers, kv_heads, head_dim], fp16 for 2-byte elements.
    assert tuple(b.pool.shape) == (8, 16, 2, 2, 2, 8) and b.pool.dtype == torch.float16
    for t in (b.table, b.fill, b.refcount):
        assert t.device == b.pool.device


def test_bad_kv_shape_is_refused_and_changes_nothing():
    b = TorchPaged(make_config())
    b.prefill(0, Prompt(5), kv_values(0, 0, 5, TINY))
    before = b.ledger()
    with pytest.raises(ValueError, match=r"kv has shape \(2, 2, 2, 2, 8\), expected \(3, 2, 2, 2, 8\)"):
        b.append([0], [3], kv_values(0, 5, 2, TINY))
    assert b.ledger() == before


def test_memory_report_counts_the_pool():
    rep = TorchPaged(make_config(block_size=16, num_blocks=8)).memory_report()
    # 16384 = 8 blocks * 16 tokens * 128 B per token (2 * 2 layers * 2 heads * 8 * 2 B)
    assert rep["formula_pool_bytes"] == 16384 == rep["pool_bytes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="device 'cuda' was asked for, but CUDA is not available"):
        TorchPaged(make_config(device="cuda"))


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match="runs on 'cpu' or 'cuda', not 'meta'"):
        TorchPaged(make_config(device="meta"))


def test_import_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    ok, why = TorchPaged.available()
    assert not ok and "torch is not installed" in why
    with pytest.raises(RuntimeError, match="needs PyTorch"):
        TorchPaged(make_config())


# --- random histories ----------------------------------------------------------------------------

class TandemHistory(History):
    """The random histories of test_properties, replayed through torch and numpy in step."""

    backends = (Tandem,)


def test_random_histories_match_numpy():
    run_state_machine_as_test(TandemHistory, settings=settings(SETTINGS, max_examples=40))


class TandemHybridHistory(HybridHistory):
    """Hybrid models, sliding windows, salted prefix caching: torch and numpy in step, their
    block structures compared id for id after every call."""

    backends = (Tandem,)


def test_random_hybrid_histories_match_numpy():
    run_state_machine_as_test(TandemHybridHistory, settings=settings(SETTINGS, max_examples=60))


# --- planted faults: the same cases as tests/impls/test_faults.py, on torch ---------------------------

class NoCopyOnWrite(TorchPaged):
    """(a) Writes into a shared tail in place."""

    def _append_plan(self, *args, **kw):
        tails, cow, new = super()._append_plan(*args, **kw)
        return tails, torch.zeros_like(cow), new


class CopyWithoutData(TorchPaged):
    """(a') Copy-on-write takes a block and copies the fill count, but not the K/V."""

    def append(self, seqs, tokens, kv=None, *, step=0):
        rows = [self.row_of[s] for s in seqs]
        last = [int(self.nblocks[r]) - 1 for r in rows]
        old = [int(self.table[r, i]) for r, i in zip(rows, last)]
        old_fill = [int(self.fill[t]) for t in old]
        victims = super().append(seqs, tokens, kv, step=step)
        for r, i, t, n in zip(rows, last, old, old_fill):
            new = int(self.table[r, i])
            if new != t:  # this writer copied its tail: forget the data it should have brought
                self.pool[new, :n] = 0
        return victims


class FloorBlocks(TorchPaged):
    """(b) floor instead of ceil in blocks needed."""

    def _blocks_needed(self, tokens):
        return tokens // self.B


class PoolFragmentation(TorchPaged):
    """(c) Fragmentation over the whole pool instead of the blocks in use."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        total = self.config.num_blocks * self.B
        led.fragmentation = int((self.B - self.fill).sum()) / total
        return led


class SharedCountedTwice(TorchPaged):
    """(d) blocks_used summed over block tables: a shared block counts once per sharer."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        led.blocks_used = int(self.nblocks[self._dev(np.flatnonzero(self.live))].sum())
        led.capacity_slots = led.blocks_used * self.B
        return led


class LeakyOOM(TorchPaged):
    """(e) Out of memory after taking the free blocks it found: they stay taken."""

    def _make_room(self, need_fn, protect_rows, need=None):
        try:
            return super()._make_room(need_fn, protect_rows, need)
        except OutOfMemory:
            self._take(self.free_top)
            raise


@dataclass
class Case:
    fault: type
    config: dict
    trace: object
    step: int  # equal to the operation number in these traces
    quantity: str
    expected: object
    actual: object


CASES = {
    # Prefill 40 = 16 + 16 + 8, fork: 3 shared blocks. Step 2: 1 writes into the shared tail,
    # which must first be copied: ceil(40/16) + 1 = 4 blocks. In place keeps 3.
    "a-no-copy-on-write": Case(NoCopyOnWrite, {}, make_trace(P(0, 40), K(1, 0), A((1, 1),)),
                               2, "blocks_used", 4, 3),
    # Same trace; the ledger is right, but 1's copy of the tail lacks positions 32..39.
    "a-copy-without-data": Case(CopyWithoutData, {}, make_trace(P(0, 40), K(1, 0), A((1, 1),)),
                                2, "kv of sequence 1", "what it wrote or inherited", "different values"),
    # 20 tokens need ceil(20/16) = 2 blocks; floor gives 1. (Ledger only: with K/V, 20 tokens
    # do not fit the 16 slots it took and the write itself fails.)
    "b-floor": Case(FloorBlocks, {"store_kv": False}, make_trace(P(0, 20)), 0, "blocks_used", 2, 1),
    # 20 tokens in 2 blocks of 16: 12 free of 32 in use. Over the 8-block pool: 108 of 128.
    "c-pool-fragmentation": Case(PoolFragmentation, {"num_blocks": 8}, make_trace(P(0, 20)),
                                 0, "fragmentation", 12 / 32, 108 / 128),
    # Step 0 agrees (3 = 3); the fork at step 1 shares 3 blocks: 3 in use, 6 counted per table,
    # and 6 used + 61 free is not the pool of 64 (SPEC §10: used + free = total).
    "d-shared-twice": Case(SharedCountedTwice, {}, make_trace(P(0, 40), K(1, 0)), 1,
                           "blocks_used + blocks_free", 64, 67),
    # 4 blocks: 0 holds 2; P(1, 48) needs 3 of 2 free: refused at step 1, and the 2 it took leak.
    "e-leaky-prefill": Case(LeakyOOM, {"num_blocks": 4}, make_trace(P(0, 32), P(1, 48)),
                            1, "blocks_used after a refused prefill", 2, 4),
    # 4 blocks: 0 and 1 hold one full block each; the append needs 1 + ceil(17/16) = 3 of 2 free:
    # refused at step 2, and the 2 free blocks it took leak: 2 + 2 in use.
    "e-leaky-append": Case(LeakyOOM, {"num_blocks": 4},
                           make_trace(P(0, 16), P(1, 16), A((0, 16), (1, 17))),
                           2, "blocks_used after a refused append", 2, 4),
    # Under eviction: 4 blocks, 0 holds 2 and is being served, 1 holds 1, 1 is free. The append
    # of 0 needs ceil(33/16) = 3 blocks; evicting 1 brings only 1 + 1: refused at step 2 (no
    # victim either), and the free block it took leaks.
    "e-leaky-under-eviction": Case(LeakyOOM, {"num_blocks": 4, "policy": "lru"},
                                   make_trace(P(0, 32), P(1, 16), A((0, 33),)),
                                   2, "blocks_used after a refused append", 3, 4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fault_is_caught_at_its_step(name):
    case = CASES[name]
    v = check(case.trace, case.fault(make_config(**case.config)), gather="all")
    assert v.valid is False, f"{name} went unnoticed"
    d = v.divergence
    assert (d.index, d.step, d.quantity) == (case.step, case.step, case.quantity), str(d)
    assert d.expected == case.expected and d.actual == case.actual, str(d)
    assert v.ops == case.step  # every operation before it passed


@pytest.mark.parametrize("name", sorted(CASES))
def test_control_passes_the_same_trace(name):
    case = CASES[name]
    v = check(case.trace, TorchPaged(make_config(**case.config)), gather="all")
    assert v.valid is True, str(v.divergence)


def test_free_returns_every_block():
    # 40 + fork + append: 4 blocks; freeing both returns all of them (8 = the whole pool).
    trace = make_trace(P(0, 40), K(1, 0), A((1, 1),), X(0), X(1))
    b = TorchPaged(make_config(num_blocks=8))
    assert check(trace, b, gather="all").valid
    led = b.ledger()
    assert (led.blocks_used, led.blocks_free, led.shared_blocks) == (0, 8, 0)
    assert int(b.refcount.abs().sum()) == 0 and int(b.fill.sum()) == 0
