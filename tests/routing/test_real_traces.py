"""Real traces through the existing loaders, routed: Mooncake's shared prefixes and Azure's lengths
(../shared/traces, or KVBENCH_TRACES; skipped where absent)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvbench.contract.protocol import CacheConfig
from kvbench.routing.route import jobs_of_requests, route
from kvbench.traces.loaders import load_azure, load_mooncake

TRACES = Path(os.environ.get("KVBENCH_TRACES") or Path(__file__).resolve().parents[3] / "shared" / "traces")
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
AZURE = TRACES / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
CONFIG = CacheConfig(block_size=16, num_blocks=16384, store_kv=False, prefix_caching=True)


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"no {MOONCAKE}")
@pytest.mark.parametrize("replicas", [1, 4])
def test_mooncake_routed_keeps_its_figures_in_order(replicas):
    jobs = jobs_of_requests(load_mooncake(MOONCAKE)[:120], 16)
    r = route(jobs, CONFIG, replicas, "longest-prefix")
    assert r.findings == {}
    assert np.all(r.available >= r.captured) and np.all(r.captured >= r.delivered)
    assert r.available.sum() > 0  # the trace shares prefixes (64 % of its block references)
    if replicas == 1:
        assert np.array_equal(r.available, r.captured)


@pytest.mark.skipif(not AZURE.exists(), reason=f"no {AZURE}")
def test_azure_names_no_prefix_so_nothing_is_available():
    jobs = jobs_of_requests(load_azure(AZURE)[:200], 16)
    r = route(jobs, CONFIG, 4, "dynamo")
    assert r.available.sum() == 0 and r.events == 0 and r.findings == {}
