"""Shrunk by `kvbench shrink` from kvbench fuzz seed 4242 history 1773 (44 ops, first divergence at step 28)

3 operations; vllm-kvmanager fails at step 2: cached_blocks expected 5, actual 4.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/seed4242-shapes/vllm-kvmanager/06-cached-blocks-append{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=with_group_kinds(get_model('tiny-hybrid'), ['chunked(15)', 'sliding(32)']), num_blocks=12, max_context=128, prefix_caching=True, tenant_weights={'a': 1, 'b': 3})
OPS = [
    Prefill(step=0, seq=0, tenant='a', tokens=16, block_hashes=('p1.0',)),  # blocks_used 2, blocks_free 10, tokens {0: 16}, shared_blocks 0, cached_blocks 0
    Prefill(step=1, seq=1, tenant='b', tokens=76, block_hashes=('p1.0', 'p1.1', 'p1.2', 'r6.3')),  # blocks_used 12, blocks_free 0, tokens {0: 16, 1: 76}, shared_blocks 0, cached_blocks 0
    Append(step=2, seqs=(1,), tokens=(1,)),  # FAILS: cached_blocks expected 5, actual 4
]

# vllm-kvmanager is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('vllm-kvmanager').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_4242_1773_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}, groups=('chunked(15)', 'sliding(32)')), OPS, name='fuzz-4242-1773.min'))
    verdict = check(trace, registry.create('vllm-kvmanager', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
