"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 155 (36 ops, first divergence at step 31)

3 operations; numpy fails at step 2: seq_blocks of sequence 0 expected '>= 0', actual -4.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/earlier/numpy/02-seq-blocks-of-sequence-accept{,.min}.jsonl.
"""
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Accept, Append, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['chunked(1)']), block_size=1, num_blocks=4, max_context=16, policy='lfu', prefix_caching=True, tenant_weights={'a': 3})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=1, block_hashes=(), adapter='s0'),  # blocks_used 0, blocks_free 4, tokens {0: 1}, shared_blocks 0, seq_blocks {0: 0}
    Append(step=1, seqs=(0,), tokens=(4,), draft=(4,)),  # blocks_used 0, blocks_free 4, tokens {0: 5}, shared_blocks 0, seq_blocks {0: 0}
    Accept(step=2, seq=0, n=0),  # FAILS: seq_blocks of sequence 0 expected '>= 0', actual -4
]


def test_fuzz_0_155_min():
    trace = validate(Trace(Header(family='fuzz', tenants={'a': 3}, groups=('chunked(1)',)), OPS, name='fuzz-0-155.min'))
    verdict = check(trace, registry.create('numpy', CONFIG), gather='touched')
    # The fix (2cdf9ad) is the checker's: a rollback under a group that releases blocks is not
    # applicable, so the history is n/a rather than a pass.
    assert verdict.valid is None and "chunked(1)" in verdict.not_applicable, verdict
