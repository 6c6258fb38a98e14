"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 17 (15 ops, first divergence at step 4)

2 operations; vllm-kvmanager fails at step 1: cached_blocks expected 2, actual 1.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager/02-cached-blocks-free{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Free, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny-hybrid'), block_size=1, num_blocks=2, max_context=16, prefix_caching=True, tenant_weights={'a': 1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=1, token_ids=(10666,)),  # blocks_used 2, blocks_free 0, tokens {0: 1}, shared_blocks 0, cached_blocks 0
    Free(step=1, seq=0),  # FAILS: cached_blocks expected 2, actual 1
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_17_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}), OPS, name='fuzz-0-17.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
