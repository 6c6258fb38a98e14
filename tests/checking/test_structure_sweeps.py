"""SPEC §10's structure identities cost what an operation changed: the checker checks the blocks
each operation moved, from the changes the backend reports, and sweeps the whole pool after
operations 1, 2, 4, 8, ... and the last, so that a corruption no operation touches is still
caught, at the next sweep."""
from __future__ import annotations

import copy

import numpy as np
from conftest import P, X, counting_calls, make_config, make_trace

from impls.numpy_paged import NumpyPaged
from impls.object_model import ObjectModel
from kvbench.checking.checker import check
from kvbench.model.oracle import Oracle

# One sequence stays (block 0); then sequences 1, 2, ... of one block each come and go, each
# taking block 1 and giving it back: 1 + 2 * 9 = 19 operations.
ONE_BLOCK_EACH = [P(0, 16)] + [op for s in range(1, 10) for op in (P(s, 16), X(s))]


class CorruptsTheBottom(NumpyPaged):
    """During operation 5 (0-based) writes block 62 over block 63 at the bottom of the free
    stack, where no operation of the trace reaches (they take and give back blocks 0 and 1 at
    the top): block 62 is twice in the free structure, 63 nowhere. The ledger's counters
    still add up."""

    def prefill(self, seq, prompt, kv=None, **kw):
        victims = super().prefill(seq, prompt, kv, **kw)
        if seq == 3:  # operation 5: P(3, 16)
            self.free_stack[0] = self.free_stack[1]
        return victims


def test_a_corruption_no_operation_touches_is_caught_at_the_next_sweep():
    trace = make_trace(*ONE_BLOCK_EACH)
    assert check(trace, NumpyPaged(make_config())).valid  # the control
    v = check(trace, CorruptsTheBottom(make_config()))
    d = v.divergence
    # Sweeps after operations 1, 2, 4, 8, ...: indices 0, 1, 3, 7. Planted at index 5 (after
    # P(3, 16) took block 1), operation 6 checks block 1 only; the sweep at index 7 finds it.
    assert (d.index, d.quantity, d.expected, d.actual) == (7, "free blocks", "each block once",
                                                          "block 62 2 times"), str(d)


class PushesTwice(NumpyPaged):
    """Frees sequence 3's block onto the free stack twice, counting one full block less in use
    so that the ledger's counters still add up (vLLM 42571: a block twice in the free queue)."""

    def free(self, seq, *, step=0):
        block = int(self.table[self.row_of[seq], 0])
        super().free(seq, step=step)
        if seq == 3:
            self.free_stack[self.free_top] = block
            self.free_top += 1
            self.n_used -= 1
            self.filled -= self.B


def test_a_block_an_operation_releases_twice_is_caught_at_that_operation():
    v = check(make_trace(*ONE_BLOCK_EACH), PushesTwice(make_config()))
    d = v.divergence
    # X(3) is operation 6 (0-based), between the sweeps at 3 and 7: block 1, which it
    # released, is checked after it.
    assert (d.index, d.quantity, d.actual) == (6, "free blocks", "block 1 2 times"), str(d)


class Reads(counting_calls(NumpyPaged)):
    """Records each block_state() call: the operations done before it, and for a state of
    changes how many entries it carries (the changed head of the free list, the cached log)."""

    def __init__(self, config):
        super().__init__(config)
        self.whole, self.changed = [], []

    def block_state(self, seqs=None, *, changed_since=None):
        state = super().block_state(seqs, changed_since=changed_since)
        if state.changes is None:
            self.whole.append(self.calls)
        else:
            self.changed.append(len(state.changes.free_head) + len(state.changes.cached))
        return state


def test_the_pool_is_read_whole_only_at_the_sweeps_and_the_changes_do_not_grow_with_it():
    trace = make_trace(*ONE_BLOCK_EACH)
    small = Reads(make_config(num_blocks=2 ** 6))
    large = Reads(make_config(num_blocks=2 ** 16, store_kv=False))
    for b in (small, large):
        assert check(trace, b, gather="none").valid
        # After operations 1, 2, 4, 8, 16 and the last (19).
        assert b.whole == [1, 2, 4, 8, 16, 19]
    # Per operation at most the block it took or gave back: the same entries at 2^6 as at 2^16.
    assert small.changed == large.changed and max(small.changed) == 1


class CountsReads(counting_calls(ObjectModel)):
    """A backend whose block_state() takes no ``changed_since`` (the protocol before it)."""

    def __init__(self, config):
        super().__init__(config)
        self.reads = []

    def block_state(self, seqs=None):
        self.reads.append(self.calls)
        return super().block_state(seqs)


def test_a_backend_without_changes_is_read_whole_at_the_sweeps_only():
    b = CountsReads(make_config())
    assert check(make_trace(*ONE_BLOCK_EACH), b, gather="none").valid
    assert b.reads == [1, 2, 4, 8, 16, 19]


def test_the_oracle_changes_rebuild_its_whole_structures():
    # Prefix caching: freed hashed blocks join the cached queue, hits take them out again, a
    # full pool evicts the oldest. Each state of changes, applied to the last whole lists,
    # gives the whole lists again.
    o = Oracle(make_config(num_blocks=6, prefix_caching=True))
    state = o.block_state()
    free, cached = state.free.tolist(), list(state.cached)
    calls = [("prefill", 0, 32, (1, 2)), ("free", 0), ("prefill", 1, 48, (1, 2, 3)),
             ("prefill", 2, 32, (7, 8)), ("free", 1), ("free", 2), ("prefill", 3, 64, (9, 10, 11, 12)),
             ("free", 3)]
    for step, call in enumerate(calls):
        if call[0] == "prefill":
            o.prefill(call[1], call[2], "a", call[2], step, hashes=call[3])
        else:
            o.free(call[1])
        state = o.block_state(changed_since=state.mark)
        c = state.changes
        free = list(c.free_head) + free[len(free) - (c.free_size - len(c.free_head)):]
        for b, entered in c.cached:
            cached = cached + [b] if entered else [x for x in cached if x != b]
        whole = copy.deepcopy(o).block_state()
        assert (np.asarray(free).tolist(), cached) == (whole.free.tolist(), list(whole.cached)), step


def test_tables_flattened_in_one_call_hold_what_each_table_holds():
    """The mirror flattens a group's tables in one call where they are 1-D integer arrays or
    lists, and piece by piece otherwise; each sequence's held ids must be its own table's
    entries but the -1 of released blocks, whatever the form."""
    from kvbench.checking.identities import _flatten_counted, _held, _held_pieces
    tables = {7: [np.array([3, -1, 4], np.int32), [5]],
              2: [[], np.array([-1, -1], np.int64)],
              9: [np.array([[8, 9]]), np.array(6)],  # a 2-D table and a 0-d one: piece by piece
              4: [[10, 11], []]}
    flat = _flatten_counted(tables)
    assert [n for _, _, n in flat] == [[0, 2, 3, 2], [2, 0, 1, 1]]  # sequences 2, 4, 7, 9
    assert flat[0][0].tolist() == [10, 11, 3, -1, 4, 8, 9]
    assert flat[0][1].tolist() == [4, 4, 7, 7, 7, 9, 9]  # the owner of each entry
    for g, (ids, _, lengths) in enumerate(flat):
        pieces = _held_pieces(ids, lengths)
        for s, piece in zip(sorted(tables), pieces):
            assert piece.tolist() == _held(tables[s][g]).tolist(), (s, g)
