"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 265 (17 ops, first divergence at step 10)

1 operations; vllm-kvmanager-dense fails at step 0: blocks_used expected 9, actual 1.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager-dense/07-blocks-used-resume{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['chunked(8)']), block_size=1, num_blocks=9, max_context=32, prefix_caching=True, tenant_weights={'a': 2})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=9),  # FAILS: blocks_used expected 9, actual 1
]

# vllm-kvmanager-dense is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager-dense').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_265_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('chunked(8)',)), OPS, name='fuzz-0-265.min'))
    verdict = check(trace, registry.create('vllm-kvmanager-dense', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
