"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 10 (46 ops, first divergence at step 19)

3 operations; sglang fails at step 2: cached_blocks expected 1, actual 0.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/sglang/03-cached-blocks-fork{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Free, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny'), block_size=1, num_blocks=5, max_context=16, prefix_caching=True, tenant_weights={'a': 0.1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=2),  # blocks_used 2, blocks_free 3, tokens {0: 2}, shared_blocks 0, cached_blocks 0
    Free(step=1, seq=0),  # blocks_used 0, blocks_free 5, tokens {}, shared_blocks 0, cached_blocks 2
    Prefill(step=2, seq=1, tenant='a', tokens=4),  # FAILS: cached_blocks expected 1, actual 0
]

# sglang is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('sglang').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_10_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}), OPS, name='fuzz-0-10.min'))
    verdict = check(trace, registry.create('sglang', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
