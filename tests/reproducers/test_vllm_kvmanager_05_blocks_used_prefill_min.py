"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 50 (35 ops, first divergence at step 3)

2 operations; vllm-kvmanager fails at step 1: blocks_used expected 8, actual 12.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager/05-blocks-used-prefill{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(3)', 'full', 'sliding(4)', 'full']), block_size=2, num_blocks=12, max_context=16, prefix_caching=True, tenant_weights={'a': 3, 'b': 1})
OPS = [
    Prefill(step=0, seq=0, tenant='b', tokens=2, block_hashes=('p2.0', 'p2.1', 'r1.2'), prompt_tokens=6),  # blocks_used 4, blocks_free 8, tokens {0: 2}, shared_blocks 0
    Prefill(step=1, seq=1, tenant='a', tokens=3, block_hashes=('p2.0', 'p2.1'), prompt_tokens=4),  # FAILS: blocks_used expected 8, actual 12
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_50_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(3)', 'full', 'sliding(4)', 'full')), OPS, name='fuzz-0-50.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
