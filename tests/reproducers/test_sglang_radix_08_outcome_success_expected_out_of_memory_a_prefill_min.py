"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 279 (26 ops, first divergence at step 9)

2 operations; sglang-radix fails at step 1: outcome of prefill expected 'success', actual 'out-of-memory'.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed.
"""
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny'), block_size=4, num_blocks=1, max_context=8, prefix_caching=True, tenant_weights={'a': 1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=4, block_hashes=('p2.0',)),  # blocks_used 1, blocks_free 0, tokens {0: 4}, shared_blocks 0
    Prefill(step=1, seq=1, tenant='a', tokens=4, block_hashes=('p2.0',)),  # FAILS: outcome of prefill expected 'success', actual 'out-of-memory'
]


def test_fuzz_0_279_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}), OPS, name='fuzz-0-279.min'))
    verdict = check(trace, registry.create('sglang-radix', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
