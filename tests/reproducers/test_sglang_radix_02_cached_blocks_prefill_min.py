"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 7 (49 ops, first divergence at step 30)

3 operations; sglang-radix fails at step 2: cached_blocks expected 1, actual 0.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/sglang-radix/02-cached-blocks-prefill{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Free, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny'), num_blocks=5, max_context=64, prefix_caching=True, tenant_weights={'a': 1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=16, block_hashes=('p1.0',)),  # blocks_used 1, blocks_free 4, tokens {0: 16}, shared_blocks 0, cached_blocks 0
    Free(step=1, seq=0),  # blocks_used 0, blocks_free 5, tokens {}, shared_blocks 0, cached_blocks 1
    Prefill(step=2, seq=1, tenant='a', tokens=49),  # FAILS: cached_blocks expected 1, actual 0
]

# sglang-radix is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('sglang-radix').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_7_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}), OPS, name='fuzz-0-7.min'))
    verdict = check(trace, registry.create('sglang-radix', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
