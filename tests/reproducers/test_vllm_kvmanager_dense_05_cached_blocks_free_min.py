"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 103 (25 ops, first divergence at step 2)

2 operations; vllm-kvmanager-dense fails at step 1: cached_blocks expected 4, actual 2.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager-dense/05-cached-blocks-free{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Free, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(1)', 'sliding(1)', 'full', 'chunked(1)']), block_size=1, num_blocks=4, max_context=256, prefix_caching=True, tenant_weights={'a': 0.2})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=1),  # blocks_used 4, blocks_free 0, tokens {0: 1}, shared_blocks 0, cached_blocks 0
    Free(step=1, seq=0),  # FAILS: cached_blocks expected 4, actual 2
]

# vllm-kvmanager-dense is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager-dense').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


@pytest.mark.xfail(strict=True, reason='vLLM bug candidate 1 (results/engines/vllm-kvmanager/README.md): a sliding window of one token turns off every prefix hit')
def test_fuzz_0_103_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(1)', 'sliding(1)', 'full', 'chunked(1)')), OPS, name='fuzz-0-103.min'))
    verdict = check(trace, registry.create('vllm-kvmanager-dense', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
