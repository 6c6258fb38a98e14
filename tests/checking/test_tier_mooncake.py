"""A held-out check of the tiered oracle (SPEC §11) on the Mooncake trace: its hit rates by tier
agree with a plain two-level LRU written here apart from kvbench's models (a device LRU of C0
blocks over a host LRU of C1).

The Mooncake trace lives outside the repository (../shared/traces, or KVBENCH_TRACES); the test
is skipped where it is absent.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import pytest
from conftest import make_config

from kvbench.model.tiered import TieredOracle
from kvbench.traces.loaders import load_requests
from kvbench.traces.tier_ops import TierSpec

TRACES = Path(os.environ.get("KVBENCH_TRACES", Path(__file__).resolve().parents[3] / "shared" / "traces"))
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
B = 16
C0, C1 = 1000, 6000  # device and host blocks: both evict over the first 2000 requests
REQUESTS = 2000


def two_level_lru(prompts, c0: int, c1: int) -> dict:
    """Each prompt (its block keys, each naming its prefix) served one at a time: the longest
    prefix cached on the device, then the longest run after it on the host, the rest computed.
    Device: the hits are in use, the other blocks come from the uncached free ones first, then
    from the oldest cached; when the request ends its blocks are cached, the last first (so the
    last is evicted first). Host: a load makes its run the most recent, its first block last;
    then every block of the prompt is stored, one held already skipped, a new one put at the
    recent end after evicting the least recent block the prompt does not hold (or refused when
    there is none)."""
    dev, host = OrderedDict(), OrderedDict()  # least recent (next evicted) first
    got = {"device": 0, "host": 0, "computed": 0}
    for keys in prompts:
        n = len(keys)
        d = 0
        while d < n and keys[d] in dev:
            d += 1
        h = d
        while h < n and keys[h] in host:
            h += 1
        got["device"] += d
        got["host"] += h - d
        got["computed"] += n - h
        for k in keys[:d]:
            del dev[k]
        uncached = c0 - len(dev) - d
        for _ in range(max(0, n - d - uncached)):
            dev.popitem(last=False)
        for k in reversed(keys[d:h]):
            host.move_to_end(k)
        mine = set(keys)
        for k in keys:
            if k in host:
                continue
            if len(host) >= c1:
                victim = next((v for v in host if v not in mine), None)
                if victim is None:
                    continue
                del host[victim]
            host[k] = None
        for k in reversed(keys):
            dev[k] = None
    return got


def tiered_replay(prompts, c0: int, c1: int) -> dict:
    """The same prompts through the TieredOracle: each a load (completed at once), a store of
    every full block to host (completed at once), a free."""
    oracle = TieredOracle(make_config(block_size=B, num_blocks=c0, prefix_caching=True),
                          tiers=(TierSpec("host", c1),))
    got = {"device": 0, "host": 0, "computed": 0}
    for seq, keys in enumerate(prompts):
        tokens = len(keys) * B
        L, run, _ = oracle.load_run(tokens, keys)
        oracle.load(2 * seq, seq, tokens, "t", tokens, seq, hashes=keys)
        oracle.done(2 * seq, True)
        oracle.store(2 * seq + 1, seq, "host")
        oracle.done(2 * seq + 1, True)
        oracle.free(seq)
        got["device"] += L
        got["host"] += len(run)
        got["computed"] += len(keys) - L - len(run)
    assert oracle.tiers.ledgers()[0].hits == got["host"]
    return got


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"shared trace not found: {MOONCAKE}")
def test_mooncake_hits_by_tier_agree_with_a_two_level_lru():
    requests = load_requests(str(MOONCAKE), "mooncake")[:REQUESTS]
    prompts = [tuple(r.block_hashes) for r in requests if r.block_hashes and len(r.block_hashes) <= C0]
    want = two_level_lru(prompts, C0, C1)
    assert tiered_replay(prompts, C0, C1) == want
    # both levels serve hits, and some blocks are computed: a check with something to agree on
    assert min(want.values()) > 0 and want["host"] > 0.05 * sum(want.values())
