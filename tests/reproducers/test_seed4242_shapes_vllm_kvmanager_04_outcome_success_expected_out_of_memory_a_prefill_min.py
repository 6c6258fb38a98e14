"""Shrunk by `kvbench shrink` from kvbench fuzz seed 4242 history 1326 (37 ops, first divergence at step 10)

1 operations; vllm-kvmanager fails at step 0: outcome of prefill expected 'success', actual 'out-of-memory'.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/seed4242-shapes/vllm-kvmanager/04-outcome-success-expected-out-of-memory-a-prefill{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(1)']), block_size=1, num_blocks=1, max_context=128, prefix_caching=True, tenant_weights={'a': 2})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=2, salt='s1', adapter='a1', token_ids=(21333, 21334)),  # FAILS: outcome of prefill expected 'success', actual 'out-of-memory'
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


@pytest.mark.xfail(strict=True, reason='vLLM bug candidate 1 (results/engines/vllm-kvmanager/README.md): a sliding window of one token turns off every prefix hit')
def test_fuzz_4242_1326_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(1)',)), OPS, name='fuzz-4242-1326.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
