"""Shrunk by `kvbench shrink` from kvbench fuzz seed 4242 history 4927 (31 ops, first divergence at step 5)

2 operations; vllm-kvmanager fails at step 1: cached_blocks expected 117, actual 118.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/seed4242-shapes/vllm-kvmanager/07-cached-blocks-free{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Free, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['chunked(32)', 'chunked(9)', 'chunked(17)', 'sliding(16)']), block_size=1, num_blocks=136, max_context=64, prefix_caching=True, tenant_weights={'a': 1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=34),  # blocks_used 136, blocks_free 0, tokens {0: 34}, shared_blocks 0, cached_blocks 0
    Free(step=1, seq=0),  # FAILS: cached_blocks expected 117, actual 118
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_4242_4927_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('chunked(32)', 'chunked(9)', 'chunked(17)', 'sliding(16)')), OPS, name='fuzz-4242-4927.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
