"""Prefix caching by block hash: hit counts confirmed by the oracle, against counts made apart."""
import os
from pathlib import Path

import pytest

from kvbench.analyses import prefix
from kvbench.traces.loaders import (
    Request,
    load_requests,
    prefix_hit_rate_unbounded,
    rehash_requests,
)

TRACES = Path(os.environ.get("KVBENCH_TRACES", Path(__file__).resolve().parents[3] / "shared" / "traces"))
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"


def req(tokens, hashes):
    return Request(arrival=0.0, prompt_tokens=tokens, output_tokens=1, block_hashes=tuple(hashes),
                   hash_block_size=512)


HAND = [req(1024, [1, 2]), req(1536, [1, 2, 3]), req(1024, [1, 4])]


def test_hits_by_hand():
    trace = prefix.cache_trace(HAND, 512)
    # Request 2 finds blocks 1 and 2, request 3 finds block 1: 3 hits of 2 + 3 + 2 = 7 hashed blocks.
    got = prefix.hit_rate(trace, num_blocks=3)
    assert (got["hit_blocks"], got["hashed_blocks"], got["refused"]) == (3, 7, 0)


def test_small_cache_evicts_the_oldest_freed_tail_first():
    trace = prefix.cache_trace([req(1024, [1, 2]), req(512, [9]), req(1024, [1, 2])], 512)
    # 2 blocks: request 2 needs one block and none is uncached, so it evicts the first freed
    # block, which is request 1's tail (block 2, freed tail first). Request 3 then finds block 1
    # only: 1 hit.
    assert prefix.hit_rate(trace, num_blocks=2)["hit_blocks"] == 1
    # 3 blocks: nothing is evicted, request 3 finds both.
    assert prefix.hit_rate(trace, num_blocks=3)["hit_blocks"] == 2


def test_cache_smaller_than_a_prompt_refuses_it():
    got = prefix.hit_rate(prefix.cache_trace(HAND, 512), num_blocks=2)
    assert got["refused"] == 1  # request 2 needs 3 blocks; its free is then dropped, not refused


def test_blocks_hashes_per_block_size():
    # 1536 tokens at 256-token blocks: 6 full blocks, each 512-id split in two.
    trace = prefix.cache_trace([req(1536, [1, 2, 3])], 256)
    assert prefix.hashed_blocks(trace) == 6


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"shared trace not found: {MOONCAKE}")
def test_mooncake_unbounded_hits_equal_the_repeat_count():
    requests = load_requests(str(MOONCAKE), "mooncake")[:400]
    trace = prefix.cache_trace(requests, 512)
    got = prefix.hit_rate(trace, num_blocks=prefix.unique_blocks(trace) + 200)
    # An unbounded cache hits every full block whose hash was seen before (counted apart).
    hits, refs, _, _ = prefix_hit_rate_unbounded(rehash_requests(requests, 512))
    assert (got["hit_blocks"], got["hashed_blocks"]) == (hits, refs)


def test_each_cache_size_reports_its_operations_done(monkeypatch):
    # A long curve is not silent: one progress report per cache size, named by the size, that
    # counts every operation of the trace (a prefill and a free per request: 2 * 3 = 6).
    reports = []

    class Recorder:
        def __init__(self, total, desc, unit):
            self.total, self.desc, self.unit, self.done = total, desc, unit, 0
            reports.append(self)

        def update(self, n=1):
            self.done += n

        def close(self):
            pass

    monkeypatch.setattr(prefix, "Progress", Recorder)
    prefix.hit_rate_curve(prefix.cache_trace(HAND, 512), sizes=[3, 5], progress=True)
    assert [(r.desc, r.total, r.done, r.unit) for r in reports] == [
        ("cache of 3 blocks (1 of 2)", 6, 6, "ops"), ("cache of 5 blocks (2 of 2)", 6, 6, "ops")]
