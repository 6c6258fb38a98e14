"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 51 (43 ops, first divergence at step 2)

2 operations; vllm-kvmanager fails at step 1: cached_blocks expected 4, actual 1.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager/06-cached-blocks-preempt{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Preempt, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(31)', 'sliding(1)', 'sliding(16)', 'full']), num_blocks=4, max_context=128, prefix_caching=True, tenant_weights={'a': 2})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=16, block_hashes=('p1.0',)),  # blocks_used 4, blocks_free 0, tokens {0: 16}, shared_blocks 0, cached_blocks 0
    Preempt(step=1, seq=0),  # FAILS: cached_blocks expected 4, actual 1
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


@pytest.mark.xfail(strict=True, reason='vLLM bug candidate 1 (results/engines/vllm-kvmanager/README.md): a sliding window of one token turns off every prefix hit')
def test_fuzz_0_51_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(31)', 'sliding(1)', 'sliding(16)', 'full')), OPS, name='fuzz-0-51.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
