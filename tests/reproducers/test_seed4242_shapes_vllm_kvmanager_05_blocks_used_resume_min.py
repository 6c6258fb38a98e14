"""Shrunk by `kvbench shrink` from kvbench fuzz seed 4242 history 1524 (14 ops, first divergence at step 10)

3 operations; vllm-kvmanager fails at step 2: blocks_used expected 3, actual 4.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/seed4242-shapes/vllm-kvmanager/05-blocks-used-resume{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Preempt, Prefill, Resume, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(1)', 'full']), block_size=32, num_blocks=4, max_context=256, prefix_caching=True, tenant_weights={'a': 1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=33, block_hashes=('p2.0',)),  # blocks_used 4, blocks_free 0, tokens {0: 33}, shared_blocks 0
    Preempt(step=1, seq=0),  # blocks_used 0, blocks_free 4, tokens {}, shared_blocks 0
    Resume(step=2, seq=0),  # FAILS: blocks_used expected 3, actual 4
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


@pytest.mark.xfail(strict=True, reason='vLLM bug candidate 1 (results/engines/vllm-kvmanager/README.md): a sliding window of one token turns off every prefix hit')
def test_fuzz_4242_1524_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(1)', 'full')), OPS, name='fuzz-4242-1524.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
