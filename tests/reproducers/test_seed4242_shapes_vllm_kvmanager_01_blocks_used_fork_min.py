"""Shrunk by `kvbench shrink` from kvbench fuzz seed 4242 history 0 (54 ops, first divergence at step 2)

2 operations; vllm-kvmanager fails at step 1: blocks_used expected 3, actual 4.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed.
"""
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Fork, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['sliding(1)']), block_size=1, num_blocks=4, max_context=64, prefix_caching=True, tenant_weights={'a': 3})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=2),  # blocks_used 2, blocks_free 2, tokens {0: 2}, shared_blocks 0
    Fork(step=1, seq=1, src=0),  # FAILS: blocks_used expected 3, actual 4
]


def test_fuzz_4242_0_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('sliding(1)',)), OPS, name='fuzz-4242-0.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
