"""What `kvbench fuzz` found (results/fuzz/campaigns.md), each minimal trace as a test: these
pass on the fixed backends."""
from __future__ import annotations

import pytest

from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Header, Prefill, Trace, validate


def _chunk_past_the_window():
    """One-token blocks, sliding(3) beside full: a chunked prompt of 4 tokens written 1 + 3.
    The append completes the block of position 1 and the window slides past it in the same
    operation (4 - 3 + 1 = 2: positions 0 and 1 released)."""
    groups = ("sliding(3)", "full")
    config = CacheConfig(model=with_group_kinds(get_model("tiny-hybrid"), groups), block_size=1,
                         num_blocks=16, prefix_caching=True, max_context=8)
    hashes = ("h0", "h1", "h2", "h3")
    ops = [Prefill(0, 0, "a", 1, hashes, prompt_tokens=4), Append(1, (0,), (3,))]
    trace = validate(Trace(Header("fuzz-finding", groups=groups), ops, name="chunk_past_the_window"))
    return trace, config


@pytest.mark.parametrize("pool", ["numpy", "torch"])
def test_a_chunk_block_the_window_passes_in_the_same_append_stays_cached(pool):
    # Found by `kvbench fuzz --backend numpy` (seed 0, history 4): the pool cached a chunk's
    # completed blocks after the window released them, so the block of position 1 went back
    # uncached (cached_blocks 1, the oracle 2).
    trace, config = _chunk_past_the_window()
    if pool == "torch":
        pytest.importorskip("torch")
        from impls.torch_paged import TorchPaged as Pool
    else:
        Pool = NumpyPaged
    backend = Pool(config)
    v = check(trace, backend)
    assert v.valid, v.divergence
    # 2 = the sliding group's blocks of positions 0 and 1, both complete, both released
    assert backend.ledger().cached_blocks == 2
