"""Pools cost the memory of the blocks they use, not of their budget: the K/V storage is committed
(its pages written) in chunks as blocks are first handed out, and what is read back is right on
both sides of every chunk edge."""
from __future__ import annotations

import pytest
from conftest import A, K, P, X, make_config, make_trace

from impls import numpy_paged, torch_paged
from impls.numpy_paged import NumpyPaged
from impls.numpy_quant_paged import NumpyQuantPaged
from kvbench.checking.checker import check
from kvbench.contract.protocol import Prompt

torch = pytest.importorskip("torch")

# The tiny model: 128 B per token, 2 KiB per block of 16 (2048 = 16 * 128).
TINY_BLOCK = 16 * 128


def pools():
    return [("numpy", NumpyPaged, {}), ("numpy-int4", NumpyQuantPaged, {"kv_format": "int4"}),
            ("torch", torch_paged.TorchPaged, {})]


@pytest.mark.parametrize("name, cls, fixed", pools(), ids=lambda p: p if isinstance(p, str) else "")
def test_a_large_budget_commits_only_a_chunk(name, cls, fixed, monkeypatch):
    # 4 KiB commits (2 tiny blocks) at a time, so chunk edges fall inside the trace below.
    monkeypatch.setattr(numpy_paged, "COMMIT_BYTES", 2 * TINY_BLOCK)
    monkeypatch.setattr(torch_paged, "COMMIT_BYTES", 2 * TINY_BLOCK)
    b = cls(make_config(num_blocks=1 << 16, **fixed))
    assert b.ready == 0
    b.prefill(0, Prompt(40), _kv(40))  # 3 blocks: ids 0..2, committed to 3 (more than the 2 of a chunk)
    assert b.ready == 3
    b.prefill(1, Prompt(16), _kv(16))  # id 3: a new chunk of max(3 // 8, 2) = 2 blocks, to 5
    assert b.ready == 5


def _kv(n):
    import numpy as np
    return np.ones((n, 2, 2, 2, 8), np.float16)


# Blocks cross many chunk edges, copies on write land in fresh chunks, freed blocks are reused.
GROWING = make_trace(P(0, 40), K(1, 0), A((1, 1), (0, 30)), P(2, 100), X(0), A((1, 40), (2, 3)),
                     K(3, 2), A((3, 17),), X(2), P(4, 200), X(1), X(3), X(4), name="growing")


@pytest.mark.parametrize("name, cls, fixed", pools(), ids=lambda p: p if isinstance(p, str) else "")
def test_content_is_right_across_chunk_edges(name, cls, fixed, monkeypatch):
    monkeypatch.setattr(numpy_paged, "COMMIT_BYTES", TINY_BLOCK)  # one block per chunk at first
    monkeypatch.setattr(torch_paged, "COMMIT_BYTES", TINY_BLOCK)
    v = check(GROWING, cls(make_config(num_blocks=64, **fixed)), gather="all")
    assert v.status == "pass", str(v.divergence)


def test_a_ledger_only_pool_commits_nothing():
    b = NumpyPaged(make_config(num_blocks=1 << 16, store_kv=False))
    b.prefill(0, Prompt(40))
    assert b.pool is None and b.ready == 0
