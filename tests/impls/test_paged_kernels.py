"""The NumPy pool's compiled decode step (impls/paged_kernels.py) does what its NumPy step does:
the same pools, called alike, one with the compiled step and one without, hold the same tables,
fills, counts, free lists, ledgers and K/V after every call, and refuse the same calls."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import make_config

from impls import paged_kernels
from impls.numpy_paged import SMALL_BATCH, NumpyPaged
from impls.numpy_quant_paged import NumpyQuantPaged
from kvbench.contract.protocol import Prompt

pytest.importorskip("numba")


class Counting:
    """A pool counting the decode steps its compiled step took."""

    compiled_steps = 0

    def _decode_compiled(self, seqs, tokens, kv, step):
        done = super()._decode_compiled(seqs, tokens, kv, step)
        self.compiled_steps += done
        return done


class Counted(Counting, NumpyPaged):
    pass


class NumpyStep(NumpyPaged):
    compiled_decode = False


class CountedInt8(Counting, NumpyQuantPaged):
    pass


class Int8Step(NumpyQuantPaged):
    compiled_decode = False


def same_state(a, b) -> bool:
    """Both pools hold the same ledgers, free lists, tables, counts per block and per sequence,
    and the same bytes of K/V storage (a slot written by one and not the other shows)."""
    sa, sb = a.block_state(), b.block_state()
    if not (a.ledger() == b.ledger() and a.scanned_ledger() == b.scanned_ledger()
            and sa.free.tolist() == sb.free.tolist() and list(sa.cached) == list(sb.cached)
            and sorted(sa.tables) == sorted(sb.tables) and a.row_of == b.row_of):
        return False
    if any(not np.array_equal(x, y) for s in sa.tables for x, y in zip(sa.tables[s], sb.tables[s])):
        return False
    arrays = ("refcount", "fill", "block_group", "tokens", "last_access", "use_count", "nblocks", "live")
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in arrays) and \
        all(np.array_equal(x, y) for x, y in zip(a._storage(), b._storage()))


def call(b, name, *args, **kw):
    try:
        return ("ok", getattr(b, name)(*args, **kw))
    except Exception as e:  # the same refusal, said the same way, is part of what must agree
        return (type(e).__name__, str(e))


def drive(seed: int, compiled, reference, **config) -> int:
    """Random prefills, forks (shared tails: the NumPy step's copy-on-write), decode steps of
    wide batches (now and then a sequence twice, an unknown one, two tokens, a block crossed),
    frees, on a pool small enough to run out; returns how many steps were compiled."""
    rng = np.random.default_rng(seed)
    a, b = compiled(make_config(**config)), reference(make_config(**config))
    live, next_id = [], 0

    def kv(n):
        return rng.standard_normal((n,) + a.kv_shape).astype(np.float16)

    for step in range(1, 120):
        r = rng.random()
        if r < 0.2 or len(live) <= SMALL_BATCH:
            n = int(rng.integers(1, 50))
            p = Prompt(n, final_tokens=n + int(rng.integers(0, 40)))
            x = kv(n)
            got = [call(p_, "prefill", next_id, p, x, step=step) for p_ in (a, b)]
            if got[0][0] == "ok":
                live.append(next_id)
            next_id += 1
        elif r < 0.3:
            src = int(rng.choice(live))
            got = [call(p_, "fork", next_id, src, step=step) for p_ in (a, b)]
            if got[0][0] == "ok":
                live.append(next_id)
            next_id += 1
        elif r < 0.4:
            s = live.pop(int(rng.integers(len(live))))
            got = [call(p_, "free", s, step=step) for p_ in (a, b)]
        else:
            k = int(rng.integers(SMALL_BATCH + 1, len(live) + 1))
            seqs = [int(s) for s in rng.choice(live, size=k, replace=False)]
            odd = rng.random()
            if odd < 0.03:
                seqs.append(seqs[0])  # a sequence twice: not the compiled step's to decide
            elif odd < 0.06:
                seqs.append(next_id + 1000)  # unknown: both refuse it alike
            tokens = [1] * len(seqs)
            if odd > 0.95:
                tokens[-1] = 2
            x = kv(sum(tokens))
            batch = tuple(seqs) if rng.random() < 0.5 else seqs
            got = [call(p_, "append", batch, tokens, x, step=step) for p_ in (a, b)]
            evicted = [s for s in live if s not in a.row_of]
            live = [s for s in live if s in a.row_of]
            assert evicted == [s for s in evicted if s not in b.row_of]
        assert got[0] == got[1], f"seed {seed} step {step}"
        assert same_state(a, b), f"seed {seed} step {step}"
    return a.compiled_steps


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size, num_blocks, policy, caching", [
    (16, 40, None, False), (4, 120, "lru", False), (16, 60, "lfu", True), (1, 400, "lru", True)])
def test_the_compiled_decode_step_is_the_numpy_one(seed, block_size, num_blocks, policy, caching):
    steps = drive(seed, Counted, NumpyStep, block_size=block_size, num_blocks=num_blocks,
                  policy=policy, prefix_caching=caching)
    assert steps > 0  # the compiled step ran (the comparison is not of two NumPy steps)


@pytest.mark.parametrize("seed", range(3))
def test_the_compiled_decode_step_of_a_quantized_pool_is_its_numpy_one(seed):
    assert drive(seed, CountedInt8, Int8Step, block_size=16, num_blocks=60, policy="lru",
                 kv_format="int8") > 0


def test_the_compiled_step_declines_what_it_does_not_decide():
    b = Counted(make_config(block_size=4, num_blocks=64))
    for s in range(10):
        b.prefill(s, Prompt(3), np.zeros((3,) + b.kv_shape, np.float16))
    b.fork(10, 0)  # sequence 0's tail (3 of 4 slots) is now shared: copy-on-write
    ones = np.zeros((10,) + b.kv_shape, np.float16)
    b.append(list(range(10)), [1] * 10, ones, step=1)
    assert b.compiled_steps == 0
    b.append(list(range(1, 11)), [1] * 10, ones, step=2)  # no shared tail with room: compiled
    assert b.compiled_steps == 1
    b.append(np.arange(1, 11), [1] * 10, ones, step=3)  # ids as an array: the NumPy step
    assert b.compiled_steps == 1
    assert paged_kernels.kernels() is not None


def test_the_quantized_pools_keep_their_own_quantizer_choice():
    # The decode step's flag is its own: numpy-int4-steps quantizes by the NumPy steps (its
    # class's compiled = False), the compiled kernels or not, and still takes the compiled step.
    from kvbench.contract import registry
    steps = registry.create("numpy-int4-steps", make_config(block_size=4, num_blocks=16))
    assert steps.compiled is False and steps.decode_step_compiled
    fast = registry.create("numpy-int4", make_config(block_size=4, num_blocks=16))
    assert fast.compiled is None and fast.decode_step_compiled
