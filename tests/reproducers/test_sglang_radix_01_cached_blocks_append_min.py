"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 2 (51 ops, first divergence at step 28)

7 operations; sglang-radix fails at step 6: cached_blocks expected 1, actual 0.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/sglang-radix/01-cached-blocks-append{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Free, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny'), block_size=32, num_blocks=9, max_context=64, prefix_caching=True, tenant_weights={'a': 3})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=33),  # blocks_used 2, blocks_free 7, tokens {0: 33}, shared_blocks 0, cached_blocks 0
    Prefill(step=1, seq=1, tenant='a', tokens=1, block_hashes=()),  # blocks_used 3, blocks_free 6, tokens {0: 33, 1: 1}, shared_blocks 0, cached_blocks 0
    Prefill(step=2, seq=2, tenant='a', tokens=33),  # blocks_used 5, blocks_free 4, tokens {0: 33, 1: 1, 2: 33}, shared_blocks 0, cached_blocks 0
    Prefill(step=3, seq=3, tenant='a', tokens=32, block_hashes=('p1.0',)),  # blocks_used 6, blocks_free 3, tokens {0: 33, 1: 1, 2: 33, 3: 32}, shared_blocks 0, cached_blocks 0
    Prefill(step=4, seq=4, tenant='a', tokens=1),  # blocks_used 7, blocks_free 2, tokens {0: 33, 1: 1, 2: 33, 3: 32, 4: 1}, shared_blocks 0, cached_blocks 0
    Free(step=5, seq=3),  # blocks_used 6, blocks_free 3, tokens {0: 33, 1: 1, 2: 33, 4: 1}, shared_blocks 0, cached_blocks 1
    Prefill(step=6, seq=5, tenant='a', tokens=33, block_hashes=('p2.0',)),  # FAILS: cached_blocks expected 1, actual 0
]

# sglang-radix is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('sglang-radix').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_2_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}), OPS, name='fuzz-0-2.min'))
    verdict = check(trace, registry.create('sglang-radix', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
