"""The incremental checker: what each operation reads back costs what the operation changed, and
a wrong slot anywhere is still caught."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import A, K, P, X, make_config, make_trace

from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import SAMPLE_WINDOW_BLOCKS, check
from kvbench.contract.protocol import Prompt


class Counting(NumpyPaged):
    """Counts the positions the checker reads back."""

    read = 0

    def gather(self, seq, start=0, stop=None, *, out=None):
        got = super().gather(seq)[start:stop]
        self.read += len(got)
        if out is not None:
            out[...] = got
        return got

    def gather_ranges(self, seqs, starts, stops):
        from kvbench.contract.protocol import Backend
        return Backend.gather_ranges(self, seqs, starts, stops)  # one counted gather per range


class PerOperation:
    """A progress hook (check calls update(1) after each operation): positions read in each."""

    def __init__(self, backend):
        self.backend, self.seen, self.reads = backend, 0, []

    def update(self, _):
        self.reads.append(self.backend.read - self.seen)
        self.seen = self.backend.read


def test_reads_per_decode_step_do_not_grow_with_the_sequence():
    # One sequence decodes 600 tokens one at a time: each step reads its tail block (at most
    # B = 16 positions, from the block's start to the new token) and one random window of at
    # most 4 blocks; the whole sequence is read only before the free.
    steps = 600
    trace = make_trace(P(0, 5), *[A((0, 1),)] * steps, X(0))
    b = Counting(make_config(num_blocks=64))
    per_op = PerOperation(b)
    v = check(trace, b, progress=per_op)
    assert v.valid, str(v.divergence)
    B = 16
    assert max(per_op.reads[1:steps + 1]) <= B + SAMPLE_WINDOW_BLOCKS * B  # 80 = 16 + 4 * 16
    assert per_op.reads[steps + 1] == 5 + steps  # the free reads the whole sequence, 605 tokens


class CorruptsAnOldSlot(NumpyPaged):
    """At step ``when``, writes zeros over position 3 of sequence 0, which that step does not
    touch (it appends to sequence 1): a write into a wrong slot."""

    when = 4

    def append(self, seqs, tokens, kv=None, *, step=0):
        victims = super().append(seqs, tokens, kv, step=step)
        if step == self.when:
            r = self.row_of[0]
            block = self.table[r, 0]
            self.pool[block, 3] = 0
        return victims


def test_a_wrong_slot_at_an_old_position_is_caught():
    # 0 holds 40 tokens and is never touched again until its free at the last step; 1 decodes.
    # The corruption at step 4 is found by a random window (seeded, 4 blocks = 64 positions,
    # more than 0 holds, so any window on 0 covers position 3), or by the free at the latest.
    ops = [P(0, 40), P(1, 20)] + [A((1, 1),)] * 30 + [X(1), X(0)]
    trace = make_trace(*ops)
    v = check(trace, CorruptsAnOldSlot(make_config()))
    assert v.valid is False
    d = v.divergence
    assert d.quantity == "kv of sequence 0"
    # The window reads all 40 of 0's positions into the checker's buffer; the free, without one.
    by_free = d.index == len(ops) - 1
    assert d.detail == "first wrong position 3 (should hold what sequence 0 wrote there)" + (
        "" if by_free else "; read by gather(0, 0, 40, out=) into the caller's buffer")
    assert CorruptsAnOldSlot.when <= d.index <= len(ops) - 1
    # The same seed finds it at the same step, and the correct backend passes.
    assert check(trace, CorruptsAnOldSlot(make_config())).divergence.index == d.index
    assert check(trace, NumpyPaged(make_config())).valid


def test_without_the_sample_the_free_still_catches_it(monkeypatch):
    # No random window at all: the free of 0 (its whole content read before it goes) catches it.
    import kvbench.checking.checker as checker
    monkeypatch.setattr(checker.LiveSet, "__len__", lambda self: 0)
    ops = [P(0, 40), P(1, 20)] + [A((1, 1),)] * 30 + [X(1), X(0)]
    d = check(make_trace(*ops), CorruptsAnOldSlot(make_config())).divergence
    assert (d.index, d.quantity) == (len(ops) - 1, "kv of sequence 0")


class CopiesBackwards(NumpyPaged):
    """Copy-on-write copies the fresh block over the shared one: the sharer's tail is lost."""

    def _copy_blocks(self, src, dst):
        self.pool[src] = self.pool[dst]


def test_sharers_of_a_copied_tail_are_read_back(monkeypatch):
    import kvbench.checking.checker as checker
    monkeypatch.setattr(checker.LiveSet, "__len__", lambda self: 0)  # no random window
    # 0 holds 40 tokens, its tail block 8 of 16; 1 forks it; 1's append at step 2 copies the
    # shared tail. Copied backwards, 0's positions 32..39 (= 2 * 16 ..) read the fresh block's.
    trace = make_trace(P(0, 40), K(1, 0), A((1, 1),), X(1), X(0))
    d = check(trace, CopiesBackwards(make_config())).divergence
    assert (d.index, d.quantity) == (2, "kv of sequence 0")
    assert d.detail == "first wrong position 32 (should hold what sequence 0 wrote there)"


def test_a_gather_of_the_old_form_is_warned_and_sliced_to_the_range():
    with pytest.warns(DeprecationWarning, match=r"WholeOnly\.gather\(seq\) is the old form"):
        class WholeOnly(NumpyPaged):
            def gather(self, seq):
                return super().gather(seq)

    b = WholeOnly(make_config())
    from kvbench.contract.protocol import kv_values
    b.prefill(0, Prompt(20), kv_values(0, 0, 20, make_config().model))
    assert np.array_equal(b.gather(0, 5, 9), kv_values(0, 5, 4, make_config().model))
    out = np.empty((4,) + make_config().model.kv_shape, np.float16)  # 4 = 9 - 5
    assert b.gather(0, 5, 9, out=out) is out and np.array_equal(out, kv_values(0, 5, 4, make_config().model))


@pytest.mark.parametrize("gather", ["touched", "all"])
def test_series_columns_are_arrays(gather):
    trace = make_trace(P(0, 40), K(1, 0), A((0, 1), (1, 1)), X(0), X(1))
    v = check(trace, NumpyPaged(make_config()), gather=gather, series=True)
    # 3 blocks for 40 tokens; the fork shares them; both writers copy or write the 8-token tail:
    # 0 copies (refcount 2), 1 writes in place: 4 blocks; free 0: 3 left; free 1: none.
    assert v.series.column("blocks_used").tolist() == [3, 3, 4, 3, 0]
    assert v.series.column("step").dtype == np.int64
    assert v.series[2]["usage"] == {"a": 6}  # 3 + 3 blocks in the two tables
    assert v.series[-1]["usage"] == {}


SCALAR = ("blocks_used", "blocks_free", "capacity_slots", "free_slots", "fragmentation",
          "bytes_in_use", "shared_blocks", "token_states", "reservation", "internal_fragmentation",
          "free", "cached_blocks", "group_blocks", "block_usage", "slot_usage")


class Recounted(NumpyPaged):
    """The NumPy backend whose counters are recounted from its arrays after every operation."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        scan = self.scanned_ledger()
        for f in SCALAR:
            assert getattr(led, f) == getattr(scan, f), (f, getattr(led, f), getattr(scan, f))
        return led


def _committed_cases():
    from kvbench.analyses import suite
    for path in suite.committed_workloads():
        trace = suite.load_traces([path])[0]
        for policy in suite.policies_for(trace, "auto"):
            yield pytest.param(trace, policy, id=f"{trace.name}-{policy}")


@pytest.mark.parametrize("trace,policy", list(_committed_cases()))
def test_ledger_counters_equal_a_recount(trace, policy):
    from kvbench.analyses import suite
    v = check(trace, Recounted(suite.config_for(trace, policy=policy)), gather="none")
    assert v.valid, str(v.divergence)


def test_ledger_of_some_sequences():
    b = NumpyPaged(make_config())
    b.prefill(0, Prompt(20), None if b.pool is None else np.zeros((20, 2, 2, 2, 8), np.float16))
    b.prefill(1, Prompt(5), np.zeros((5, 2, 2, 2, 8), np.float16))
    led = b.ledger(seqs=[1])
    # 20 tokens: 2 blocks; 5 tokens: 1 block. Only sequence 1's figures asked for.
    assert led.tokens == {1: 5} and led.seq_blocks == {1: 1} and led.blocks_used == 3


@pytest.mark.parametrize("start,stop", [(0, 0), (0, 5), (5, 9), (5, 16), (16, 48), (5, 40),
                                        (3, 57), (0, 57), (48, 57), (57, 57)])
def test_gather_into_a_buffer_reads_what_a_fresh_gather_reads(start, stop):
    # 57 tokens over 4 blocks of 16, placed out of order (another sequence takes blocks between
    # them): ranges inside one block, from or to a block boundary, and across whole blocks.
    model = make_config().model
    from kvbench.contract.protocol import kv_values
    b = NumpyPaged(make_config())
    b.prefill(0, Prompt(20), kv_values(0, 0, 20, model))
    b.prefill(1, Prompt(30), kv_values(1, 0, 30, model))
    b.append([0], [37], kv_values(0, 20, 37, model))
    expected = kv_values(0, start, stop - start, model)
    out = np.full_like(expected, 7)
    assert b.gather(0, start, stop, out=out) is out
    assert np.array_equal(out, expected)
    strided = np.full((2 * (stop - start),) + expected.shape[1:], 7, expected.dtype)[::2]
    b.gather(0, start, stop, out=strided)  # not contiguous: written through, not into a copy
    assert np.array_equal(strided, expected)
