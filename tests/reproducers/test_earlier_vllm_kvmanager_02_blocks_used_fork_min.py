"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 19 (43 ops, first divergence at step 1)

2 operations; vllm-kvmanager fails at step 1: blocks_used expected 6, actual 8.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/earlier/vllm-kvmanager/02-blocks-used-fork{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Fork, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(1)', 'full']), block_size=1, num_blocks=8, max_context=64, prefix_caching=True, tenant_weights={'a': 3})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=2),  # blocks_used 4, blocks_free 4, tokens {0: 2}, shared_blocks 0
    Fork(step=1, seq=1, src=0),  # FAILS: blocks_used expected 6, actual 8
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


@pytest.mark.xfail(strict=True, reason='vLLM bug candidate 1 (results/engines/vllm-kvmanager/README.md): a sliding window of one token turns off every prefix hit')
def test_fuzz_0_19_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(1)', 'full')), OPS, name='fuzz-0-19.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
