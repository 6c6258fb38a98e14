"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 275 (37 ops, first divergence at step 18)

4 operations; vllm-kvmanager fails at step 3: outcome of fork expected 'out-of-memory', actual 'success'.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager/08-outcome-out-of-memory-expected-success-a-fork{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Fork, Preempt, Prefill, Resume, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny'), block_size=1, num_blocks=4, max_context=128, prefix_caching=True, tenant_weights={'a': 3})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=3),  # blocks_used 3, blocks_free 1, tokens {0: 3}, shared_blocks 0
    Preempt(step=1, seq=0),  # blocks_used 0, blocks_free 4, tokens {}, shared_blocks 0
    Resume(step=2, seq=0),  # blocks_used 3, blocks_free 1, tokens {0: 3}, shared_blocks 0
    Fork(step=3, seq=1, src=0),  # FAILS: outcome of fork expected 'out-of-memory', actual 'success'
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_275_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}), OPS, name='fuzz-0-275.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
