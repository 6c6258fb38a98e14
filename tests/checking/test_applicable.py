"""Whether a backend can run a trace, decided in one place (kvbench/checking/applicable.py)
from what the trace uses and what the backend declares."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from impls.numpy_paged import NumpyPaged
from kvbench.checking.applicable import applicable, trace_uses
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.columns import OpTable
from kvbench.traces.format import Trace, load

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"


@pytest.mark.parametrize("name, uses", [
    ("fork-beam", {"fork"}),
    ("prefix-salts", {"salted"}),
    ("lifecycle-speculative", {"speculative", "fork"}),
    ("lifecycle-chunked", {"chunked"}),
    ("lifecycle-swap", {"preempt", "swap"}),
    ("tier-turns", {"transfers"}),
])
def test_a_trace_uses_the_same_in_columns_as_in_operations(name, uses):
    trace = load(str(WORKLOADS / f"{name}.jsonl"))
    found = trace_uses(trace)
    assert uses <= found
    table = Trace(trace.header, OpTable.from_ops(list(trace.ops)), name=trace.name)
    assert trace_uses(table) == found


def test_a_rule_set_a_backend_cannot_build_is_named_as_its_declaration():
    backend = NumpyPaged(CacheConfig(prefix_caching=True))
    backend.capabilities = dataclasses.replace(backend.capabilities, rules="vllm",
                                               rule_params={"leaf_order": "lru"})
    trace = load(str(WORKLOADS / "fork-beam.jsonl"))
    with pytest.raises(ValueError, match="numpy's Capabilities: rule set 'vllm' has no parameter "
                                         "leaf_order"):
        applicable(trace, backend)
