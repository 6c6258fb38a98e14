"""The checker's per-operation series: columns of the ledger, and per-tenant usage kept sparse
(what is live at each operation), read back as rows or as one dense matrix."""
from __future__ import annotations

import numpy as np
from conftest import A, P, X, make_config, make_trace

from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check
from kvbench.checking.series import Series
from kvbench.contract.ledger import Ledger


def led(blocks: int) -> Ledger:
    return Ledger.paged(num_blocks=8, block_size=16, block_bytes=1, blocks_used=blocks,
                        blocks_free=8 - blocks, tokens={}, seq_blocks={}, token_states=0,
                        reservation=0, shared_blocks=0)


def test_rows_and_matrix_agree_with_what_was_appended():
    s = Series(capacity=1)  # grows past its first row
    s.append(0, led(1), {"a": 1})
    s.append(1, led(3), {"b": 2, "a": 1})
    s.append(2, led(0), {})
    s.append(3, led(2), {"c": 2})
    assert [r["usage"] for r in s] == [{"a": 1}, {"a": 1, "b": 2}, {}, {"c": 2}]
    assert list(s.column("blocks_used")) == [1, 3, 0, 2]
    assert s.tenants == ["a", "b", "c"]
    # -1: the tenant had no live sequence at that operation.
    assert s.usage_matrix().tolist() == [[1, -1, -1], [1, 2, -1], [-1, -1, -1], [-1, -1, 2]]


def test_a_tenant_with_no_live_sequence_costs_nothing():
    # Four tenants one after the other: at each operation at most one is live.
    ops = []
    for i, t in enumerate("abcd"):
        ops += [P(i, 20, t), A((i, 1),), X(i)]
    v = check(make_trace(*ops, name="one-at-a-time"), NumpyPaged(make_config()), series=True)
    assert v.valid
    entries = np.diff(np.concatenate([[0], v.series.row_end[:len(v.series)]]))
    assert entries.tolist() == [1, 1, 0] * 4  # prefill and append: 1 live tenant; free: none
    # 2 = ceil(20 / 16) blocks, then ceil(21 / 16) = 2 after the one-token append.
    assert [r["usage"] for r in v.series][:3] == [{"a": 2}, {"a": 2}, {}]
