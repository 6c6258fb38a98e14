"""The NumPy pool's scalar prefill and release of a few blocks (``_prefill_small``,
``_release_small``) do what its vector paths do: the same pools, called alike, one with the
scalar paths and one without, hold the same tables, fills, counts, free lists, ledgers and K/V
after every call, and refuse the same calls (``drive`` of test_paged_kernels)."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import make_config
from test_paged_kernels import Counting, drive

from impls import numpy_paged
from impls.numpy_paged import NumpyPaged
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig, Prompt


class ScalarCounted(Counting, NumpyPaged):
    """Counts the rows its scalar paths filled and released."""

    scalar_prefills = scalar_releases = 0

    def _prefill_small(self, *args):
        self.scalar_prefills += 1
        return super()._prefill_small(*args)

    def _release_small(self, r):
        self.scalar_releases += 1
        super()._release_small(r)


class VectorRows(NumpyPaged):
    def __init__(self, config):
        super().__init__(config)
        self.scalar_rows = False


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block_size, num_blocks, store_kv", [
    (16, 40, True), (4, 120, True), (4, 60, False), (2, 200, False)])
def test_the_scalar_rows_are_the_vector_ones(seed, block_size, num_blocks, store_kv, monkeypatch):
    made = []

    def counted(config):
        made.append(ScalarCounted(config))
        return made[-1]

    drive(seed, counted, VectorRows, block_size=block_size, num_blocks=num_blocks, policy="lru",
          store_kv=store_kv)
    (pool,) = made
    # prompts of 1..49 tokens: 1 block at most at 16 tokens a block, 13 = ceil(49 / 4) at 4 and
    # 25 at 2, past SMALL_PREFILL (8): both paths at the smaller blocks. At 2 tokens a block a
    # third of the prompts are small (16 tokens or fewer), and a drive may free none of them
    assert pool.scalar_prefills > 0 and (pool.scalar_releases > 0 or block_size == 2)


def test_a_prefill_past_the_small_size_takes_the_vector_path():
    pool = ScalarCounted(make_config(block_size=4, num_blocks=64, store_kv=False))
    small, past = numpy_paged.SMALL_PREFILL * 4, numpy_paged.SMALL_PREFILL * 4 + 1
    pool.prefill(0, Prompt(small))
    pool.prefill(1, Prompt(past))  # 9 blocks
    assert pool.scalar_prefills == 1
    # blocks 0..7 to sequence 0 (the stack hands out low ids first), 8..16 to sequence 1
    assert pool.table[0, :8].tolist() == list(range(8))
    assert pool.table[1, :9].tolist() == list(range(8, 17))
    pool.free(1)
    pool.free(0)
    assert pool.scalar_releases == 1
    # freed from the tail, sequence 1 first: 0 on top, taken next
    assert pool.free_stack[pool.free_top - 3:pool.free_top].tolist() == [2, 1, 0]


def test_what_the_scalar_paths_do_not_decide_takes_the_vector_paths():
    # a hybrid model (two groups), prefix caching (keys to look up), and a planted fault that
    # overrides a step the scalar paths stand in for
    hybrid = NumpyPaged(CacheConfig(model=get_model("tiny-hybrid"), block_size=16, num_blocks=64, store_kv=False))
    assert not hybrid.scalar_rows

    cached = ScalarCounted(make_config(prefix_caching=True, store_kv=False))
    cached.prefill(0, Prompt(40, block_hashes=(11, 12)))  # two full blocks to look up and cache
    cached.free(0)
    assert cached.scalar_rows and cached.scalar_prefills == cached.scalar_releases == 0

    # fills narrowed after __init__ (impls/faults_edges.FillInUint8): a scalar write past their
    # range raises where the vector path's wraps, as the fault means it to
    narrow = ScalarCounted(make_config(store_kv=False))
    narrow.fill = narrow.fill.astype(np.uint8)
    narrow.prefill(0, Prompt(20))
    narrow.free(0)
    assert narrow.scalar_prefills == narrow.scalar_releases == 0

    class TakesOwnBlocks(NumpyPaged):
        def _take(self, n):
            return super()._take(n)

    assert not TakesOwnBlocks(make_config()).scalar_rows
    assert NumpyPaged(make_config()).scalar_rows


def test_the_scalar_prefill_writes_the_prompts_kv():
    pool = ScalarCounted(make_config(block_size=4, num_blocks=16))
    kv = np.arange(6 * np.prod(pool.kv_shape), dtype=np.float16).reshape((6,) + pool.kv_shape)
    pool.prefill(0, Prompt(6), kv)
    assert pool.scalar_prefills == 1
    np.testing.assert_array_equal(np.asarray(pool.gather(0)), kv)
