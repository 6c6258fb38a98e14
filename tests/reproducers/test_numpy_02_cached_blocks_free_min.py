"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 361 (73 ops, first divergence at step 67)

3 operations; numpy fails at step 2: cached_blocks expected 2, actual 4.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/numpy/02-cached-blocks-free{,.min}.jsonl.
"""
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['state(89)', 'chunked(7)', 'sliding(3)', 'sliding(5)']), block_size=3, num_blocks=18, max_context=64, prefix_caching=True, tenant_weights={'a': 1})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=2, block_hashes=('p0.0', 'p0.1', 'p0.2', 'p0.3'), prompt_tokens=12),  # blocks_used 4, blocks_free 14, tokens {0: 2}, shared_blocks 0, cached_blocks 0
    Prefill(step=1, seq=1, tenant='a', tokens=5, block_hashes=('p0.0',)),  # blocks_used 10, blocks_free 8, tokens {0: 2, 1: 5}, shared_blocks 0, cached_blocks 2
    Append(step=2, seqs=(0,), tokens=(5,)),  # FAILS: cached_blocks expected 2, actual 4
]


def test_fuzz_0_361_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('state(89)', 'chunked(7)', 'sliding(3)', 'sliding(5)')), OPS, name='fuzz-0-361.min'))
    verdict = check(trace, registry.create('numpy', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
