"""Whether a backend can run a trace, decided in one place (kvbench/checking/applicable.py)
from what the trace uses and what the backend declares."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from impls.numpy_paged import NumpyPaged
from kvbench.analyses.suite import committed_workloads, config_for, policies_for
from kvbench.checking.applicable import applicable, trace_uses
from kvbench.contract import registry
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


# The one shape of an n/a's reason (kvbench.contract.protocol.Refusal): who does not do what
# (SPEC §N), and what the trace, the model or the run needs of it.
REASON = re.compile(r"^(?:[\w.:-]+|kvbench's model|kvbench's tier replay) does not \S.* "
                    r"\(SPEC §\d+\), and \S.*$")


def test_every_reason_over_the_committed_workloads_and_backends_has_one_shape():
    reasons = {}
    for path in committed_workloads():
        trace = load(str(path))
        for name, entry in registry.entries().items():
            if not entry.available()[0]:  # it cannot be made here (a missing engine), not n/a
                continue
            for policy in policies_for(trace, None):
                key = (trace.name, name, policy)
                try:
                    backend = entry.create(config_for(trace, policy=policy))
                except registry.BackendUnavailable as e:  # its refusal of the settings
                    reasons[key] = str(e)
                    continue
                reasons[key] = applicable(trace, backend)
                backend.close()
    refused = {k: r for k, r in reasons.items() if r}
    # the default run's n/a rows: contiguous backends on tier and hybrid workloads among them
    assert ("variant-mamba", "contiguous-max", None) in refused
    assert ("tier-turns", "contiguous-max", None) in refused
    assert {k: r for k, r in refused.items() if not REASON.match(r)} == {}


def test_a_refusal_of_a_kind_is_named_as_the_registry_entry():
    trace = load(str(WORKLOADS / "variant-mamba.jsonl"))
    with pytest.raises(registry.BackendUnavailable) as e:
        registry.resolve("numpy-int8").create(config_for(trace))
    # the quantized pool's class is numpy-quant; the run's row names the entry it made
    assert str(e.value).startswith("numpy-int8 does not run state groups (SPEC §12), and model ")
