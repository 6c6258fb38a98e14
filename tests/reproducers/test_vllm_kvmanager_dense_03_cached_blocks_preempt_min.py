"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 51 (43 ops, first divergence at step 2)

2 operations; vllm-kvmanager-dense fails at step 1: cached_blocks expected 4, actual 3.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed.
"""
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Preempt, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(31)', 'sliding(1)', 'sliding(16)', 'full']), num_blocks=4, max_context=128, prefix_caching=True, tenant_weights={'a': 2})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=16, block_hashes=('p1.0',)),  # blocks_used 4, blocks_free 0, tokens {0: 16}, shared_blocks 0, cached_blocks 0
    Preempt(step=1, seq=0),  # FAILS: cached_blocks expected 4, actual 3
]


def test_fuzz_0_51_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(31)', 'sliding(1)', 'sliding(16)', 'full')), OPS, name='fuzz-0-51.min'))
    verdict = check(trace, registry.create('vllm-kvmanager-dense', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
