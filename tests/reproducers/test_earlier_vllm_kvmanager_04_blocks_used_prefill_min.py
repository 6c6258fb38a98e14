"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 159 (22 ops, first divergence at step 2)

2 operations; vllm-kvmanager fails at step 1: blocks_used expected 8, actual 12.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/earlier/vllm-kvmanager/04-blocks-used-prefill{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['full', 'full', 'sliding(28)', 'sliding(1)']), block_size=8, num_blocks=12, max_context=32, prefix_caching=True, tenant_weights={'a': 0.1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=8, block_hashes=('p2.0',)),  # blocks_used 4, blocks_free 8, tokens {0: 8}, shared_blocks 0
    Prefill(step=1, seq=1, tenant='a', tokens=9, block_hashes=('p2.0',)),  # FAILS: blocks_used expected 8, actual 12
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_159_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('full', 'full', 'sliding(28)', 'sliding(1)')), OPS, name='fuzz-0-159.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
