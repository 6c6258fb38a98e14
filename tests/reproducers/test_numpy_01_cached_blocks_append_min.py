"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 348 (83 ops, first divergence at step 12)

3 operations; numpy fails at step 2: cached_blocks expected 0, actual 1.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/numpy/01-cached-blocks-append{,.min}.jsonl.
"""
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['state(127)', 'full']), block_size=2, num_blocks=4, max_context=64, policy='lru', prefix_caching=True, tenant_weights={'a': 1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=1, block_hashes=('p1.0', 'p1.1', 'p1.2', 'p1.3', 'p1.4', 'p1.5', 'p1.6', 'p1.7', 'r2.8', 'r2.9'), prompt_tokens=20),  # blocks_used 2, blocks_free 2, tokens {0: 1}, shared_blocks 0, cached_blocks 0
    Prefill(step=1, seq=1, tenant='a', tokens=2, block_hashes=('p1.0',)),  # blocks_used 4, blocks_free 0, tokens {0: 1, 1: 2}, shared_blocks 0, cached_blocks 0
    Append(step=2, seqs=(0,), tokens=(2,)),  # FAILS: cached_blocks expected 0, actual 1
]


def test_fuzz_0_348_min():
    trace = validate(Trace(Header(family='fuzz', tenants={'a': 1}, groups=('state(127)', 'full')), OPS, name='fuzz-0-348.min'))
    verdict = check(trace, registry.create('numpy', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
