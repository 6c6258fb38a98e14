"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 44 (58 ops, first divergence at step 3)

2 operations; sglang-radix fails at step 1: outcome of fork expected 'success', actual 'out-of-memory'.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/earlier/sglang-radix/05-outcome-success-expected-out-of-memory-a-fork{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Fork, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny'), block_size=1, num_blocks=6, max_context=32, prefix_caching=True, tenant_weights={'a': 0.1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=6),  # blocks_used 6, blocks_free 0, tokens {0: 6}, shared_blocks 0
    Fork(step=1, seq=1, src=0),  # FAILS: outcome of fork expected 'success', actual 'out-of-memory'
]

# sglang-radix is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('sglang-radix').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_44_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}), OPS, name='fuzz-0-44.min'))
    verdict = check(trace, registry.create('sglang-radix', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
