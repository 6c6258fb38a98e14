"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 41 (31 ops, first divergence at step 3)

2 operations; vllm-kvmanager fails at step 1: cached_blocks expected 2, actual 1.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager/04-cached-blocks-append{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny-hybrid'), block_size=1, num_blocks=68, max_context=128, prefix_caching=True, tenant_weights={'a': 2})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=33),  # blocks_used 66, blocks_free 2, tokens {0: 33}, shared_blocks 0, cached_blocks 0
    Append(step=1, seqs=(0,), tokens=(1,)),  # FAILS: cached_blocks expected 2, actual 1
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_41_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(32)', 'full')), OPS, name='fuzz-0-41.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
