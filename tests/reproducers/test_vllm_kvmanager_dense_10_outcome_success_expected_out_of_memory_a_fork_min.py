"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 443 (26 ops, first divergence at step 2)

2 operations; vllm-kvmanager-dense fails at step 1: outcome of fork expected 'success', actual 'out-of-memory'.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager-dense/10-outcome-success-expected-out-of-memory-a-fork{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Fork, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(1)', 'chunked(4)']), block_size=4, num_blocks=6, max_context=16, prefix_caching=True, tenant_weights={'a': 0.1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=5),  # blocks_used 4, blocks_free 2, tokens {0: 5}, shared_blocks 0
    Fork(step=1, seq=1, src=0),  # FAILS: outcome of fork expected 'success', actual 'out-of-memory'
]

# vllm-kvmanager-dense is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager-dense').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


@pytest.mark.xfail(strict=True, reason='vLLM bug candidate 1 (results/engines/vllm-kvmanager/README.md): a sliding window of one token turns off every prefix hit')
def test_fuzz_0_443_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(1)', 'chunked(4)')), OPS, name='fuzz-0-443.min'))
    verdict = check(trace, registry.create('vllm-kvmanager-dense', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
