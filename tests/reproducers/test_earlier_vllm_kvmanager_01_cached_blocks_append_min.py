"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 11 (14 ops, first divergence at step 2)

3 operations; vllm-kvmanager fails at step 2: cached_blocks expected 1, actual 0.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/earlier/vllm-kvmanager/01-cached-blocks-append{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Fork, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(2)', 'sliding(3)', 'sliding(1)', 'full']), block_size=1, num_blocks=12, max_context=8, prefix_caching=True, tenant_weights={'a': 2})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=1),  # blocks_used 4, blocks_free 8, tokens {0: 1}, shared_blocks 0, cached_blocks 0
    Fork(step=1, seq=1, src=0),  # blocks_used 8, blocks_free 4, tokens {0: 1, 1: 1}, shared_blocks 0, cached_blocks 0
    Append(step=2, seqs=(1,), tokens=(1,)),  # FAILS: cached_blocks expected 1, actual 0
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_11_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(2)', 'sliding(3)', 'sliding(1)', 'full')), OPS, name='fuzz-0-11.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
