"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 21 (61 ops, first divergence at step 2)

2 operations; vllm-kvmanager fails at step 1: cached_blocks expected 2, actual 1.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/earlier/vllm-kvmanager/03-cached-blocks-free{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Free, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['full', 'sliding(1)']), block_size=1, num_blocks=2, max_context=64, prefix_caching=True, tenant_weights={'a': 3})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=1),  # blocks_used 2, blocks_free 0, tokens {0: 1}, shared_blocks 0, cached_blocks 0
    Free(step=1, seq=0),  # FAILS: cached_blocks expected 2, actual 1
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_21_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('full', 'sliding(1)')), OPS, name='fuzz-0-21.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
