"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 294 (54 ops, first divergence at step 24)

6 operations; vllm-kvmanager-dense fails at step 5: shared_blocks expected 2, actual 4.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/vllm-kvmanager-dense/09-shared-blocks-fork{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Fork, Preempt, Prefill, Resume, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['full', 'sliding(47)']), block_size=1, num_blocks=12, max_context=64, prefix_caching=True, tenant_weights={'a': 2})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=2),  # blocks_used 4, blocks_free 8, tokens {0: 2}, shared_blocks 0
    Fork(step=1, seq=1, src=0),  # blocks_used 6, blocks_free 6, tokens {0: 2, 1: 2}, shared_blocks 2
    Preempt(step=2, seq=0),  # blocks_used 4, blocks_free 8, tokens {1: 2}, shared_blocks 0
    Fork(step=3, seq=2, src=1),  # blocks_used 6, blocks_free 6, tokens {1: 2, 2: 2}, shared_blocks 2
    Resume(step=4, seq=0),  # blocks_used 10, blocks_free 2, tokens {1: 2, 2: 2, 0: 2}, shared_blocks 2
    Fork(step=5, seq=3, src=0),  # FAILS: shared_blocks expected 2, actual 4
]

# vllm-kvmanager-dense is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager-dense').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_294_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('full', 'sliding(47)')), OPS, name='fuzz-0-294.min'))
    verdict = check(trace, registry.create('vllm-kvmanager-dense', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
