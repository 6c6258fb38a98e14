"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 90 (53 ops, first divergence at step 4)

3 operations; numpy fails at step 2: outcome of abort expected 'success', actual "KeyError: 'numpy: unknown sequence 0'".
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/earlier/numpy/01-raises-keyerror-abort{,.min}.jsonl.
"""
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Abort, Preempt, Prefill, Header, Trace, validate
from kvbench.traces.tier_ops import TierSpec

CONFIG = CacheConfig(model=get_model('tiny'), block_size=1, num_blocks=1, max_context=2, prefix_caching=True, tenant_weights={'a': 1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=1),  # blocks_used 1, blocks_free 0, tokens {0: 1}, shared_blocks 0
    Preempt(step=1, seq=0),  # blocks_used 0, blocks_free 1, tokens {}, shared_blocks 0
    Abort(step=2, seq=0),  # FAILS: outcome of abort expected 'success', actual "KeyError: 'numpy: unknown sequence 0'"
]


def test_fuzz_0_90_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, tiers=(TierSpec(name='host', capacity=16, policy='lru'),)), OPS, name='fuzz-0-90.min'))
    verdict = check(trace, registry.create('numpy', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
