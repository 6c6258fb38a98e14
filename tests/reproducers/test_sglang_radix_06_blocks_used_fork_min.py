"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 94 (60 ops, first divergence at step 55)

4 operations; sglang-radix fails at step 3: blocks_used expected 2, actual 1.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/sglang-radix/06-blocks-used-fork{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Fork, Preempt, Prefill, Resume, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny'), block_size=1, num_blocks=2, max_context=32, prefix_caching=True, tenant_weights={'a': 2})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=1),  # blocks_used 1, blocks_free 1, tokens {0: 1}, shared_blocks 0
    Preempt(step=1, seq=0),  # blocks_used 0, blocks_free 2, tokens {}, shared_blocks 0
    Resume(step=2, seq=0),  # blocks_used 1, blocks_free 1, tokens {0: 1}, shared_blocks 0
    Fork(step=3, seq=1, src=0),  # FAILS: blocks_used expected 2, actual 1
]

# sglang-radix is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('sglang-radix').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_94_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}), OPS, name='fuzz-0-94.min'))
    verdict = check(trace, registry.create('sglang-radix', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
