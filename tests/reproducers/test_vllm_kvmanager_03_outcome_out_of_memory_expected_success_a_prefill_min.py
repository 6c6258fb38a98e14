"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 38 (41 ops, first divergence at step 0)

1 operations; vllm-kvmanager fails at step 0: outcome of prefill expected 'out-of-memory', actual 'success'.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager/03-outcome-out-of-memory-expected-success-a-prefill{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['chunked(13)']), block_size=1, num_blocks=1, max_context=64, prefix_caching=True, tenant_weights={'a': 3})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=14),  # FAILS: outcome of prefill expected 'out-of-memory', actual 'success'
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_38_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('chunked(13)',)), OPS, name='fuzz-0-38.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
