"""Shrunk by `kvbench shrink` from kvbench fuzz seed 0 history 2 (49 ops, first divergence at step 15)

12 operations; sglang-radix fails at step 15: cached_blocks expected 1, actual 0.
Each comment is the ledger after the operation (the backend agreed with the formulas up to the
failing one). The test passes once the backend is fixed. In the suite (tests/reproducers/,
docs/fuzzing.md) a bug still open in an engine is marked xfail(strict=True), so a fix shows.
Its traces: results/fuzz/campaigns/earlier/sglang-radix/01-cached-blocks-append{,.min}.jsonl.
"""
import pytest

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Preempt, Prefill, Header, Trace, validate

CONFIG = CacheConfig(model=get_model('tiny'), block_size=32, num_blocks=20, max_context=64, prefix_caching=True, tenant_weights={'t0': 3})
OPS = [
    Prefill(step=0, seq=0, tenant='t0', tokens=32),  # blocks_used 1, blocks_free 19, tokens {0: 32}, shared_blocks 0, cached_blocks 0
    Prefill(step=2, seq=2, tenant='t0', tokens=1),  # blocks_used 2, blocks_free 18, tokens {0: 32, 2: 1}, shared_blocks 0, cached_blocks 0
    Prefill(step=4, seq=3, tenant='t0', tokens=32, adapter='s0', token_ids=(10666, 10667, 10668, 10669, 10670, 10671, 10672, 10673, 10674, 10675, 10676, 10677, 10678, 10679, 10680, 10681, 10682, 10683, 10684, 10685, 10686, 10687, 10688, 10689, 10690, 10691, 10692, 10693, 10694, 10695, 10696, 10697)),  # blocks_used 3, blocks_free 17, tokens {0: 32, 2: 1, 3: 32}, shared_blocks 0, cached_blocks 0
    Prefill(step=5, seq=4, tenant='t0', tokens=33, block_hashes=('p2.0',)),  # blocks_used 5, blocks_free 15, tokens {0: 32, 2: 1, 3: 32, 4: 33}, shared_blocks 0, cached_blocks 0
    Prefill(step=6, seq=5, tenant='t0', tokens=33),  # blocks_used 7, blocks_free 13, tokens {0: 32, 2: 1, 3: 32, 4: 33, 5: 33}, shared_blocks 0, cached_blocks 0
    Prefill(step=7, seq=6, tenant='t0', tokens=33),  # blocks_used 9, blocks_free 11, tokens {0: 32, 2: 1, 3: 32, 4: 33, 5: 33, 6: 33}, shared_blocks 0, cached_blocks 0
    Preempt(step=8, seq=0),  # blocks_used 8, blocks_free 12, tokens {2: 1, 3: 32, 4: 33, 5: 33, 6: 33}, shared_blocks 0, cached_blocks 1
    Append(step=11, seqs=(3,), tokens=(1,)),  # blocks_used 9, blocks_free 11, tokens {2: 1, 3: 33, 4: 33, 5: 33, 6: 33}, shared_blocks 0, cached_blocks 1
    Prefill(step=12, seq=8, tenant='t0', tokens=33),  # blocks_used 11, blocks_free 9, tokens {2: 1, 3: 33, 4: 33, 5: 33, 6: 33, 8: 33}, shared_blocks 0, cached_blocks 1
    Prefill(step=13, seq=9, tenant='t0', tokens=4, token_ids=(0, 1, 2, 3)),  # blocks_used 12, blocks_free 8, tokens {2: 1, 3: 33, 4: 33, 5: 33, 6: 33, 8: 33, 9: 4}, shared_blocks 0, cached_blocks 1
    Prefill(step=14, seq=10, tenant='t0', tokens=32, block_hashes=('p1.0',)),  # blocks_used 13, blocks_free 7, tokens {2: 1, 3: 33, 4: 33, 5: 33, 6: 33, 8: 33, 9: 4, 10: 32}, shared_blocks 0, cached_blocks 1
    Append(step=15, seqs=(2, 3, 8, 9), tokens=(12, 1, 31, 32)),  # FAILS: cached_blocks expected 1, actual 0
]

# sglang-radix is a serving engine's own classes, installed in its opt-in environment (docs/engines.md).
AVAILABLE, WHY_NOT = registry.resolve('sglang-radix').available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY_NOT)


def test_fuzz_0_2_min():
    trace = validate(Trace(Header(family='fuzz', tenants={}), OPS, name='fuzz-0-2.min'))
    verdict = check(trace, registry.create('sglang-radix', CONFIG), gather='touched')
    assert verdict.valid, str(verdict.divergence)
