"""`kvbench serve --offload` (SPEC §11 under the serving simulation): a freed sequence's hashed
blocks stored to every tier, each admission a load of what the tiers hold after the device's
hit; the hits by level counted by hand, and the logged trace replayed by the checker."""
from __future__ import annotations

import json

import pytest
from conftest import make_config

from kvbench.analyses import serving as S
from kvbench.checking.checker import check
from kvbench.cli import main as cli_main
from kvbench.contract import registry
from kvbench.traces.loaders import Request
from kvbench.traces.tier_ops import TierSpec

# One at a time (max_batch 1), 4 device blocks of 16, host 4, disk 8; each prompt is whole
# blocks and generates 1 token (one block more), so every request ends holding a block it
# cannot hash. r0 and r2 ask for blocks a b c, r1 and r3 for d e.
REQUESTS = [Request(0.0, 48, 1, block_hashes=("a", "b", "c")), Request(0.0, 32, 1, block_hashes=("d", "e")),
            Request(0.0, 48, 1, block_hashes=("a", "b", "c")), Request(0.0, 32, 1, block_hashes=("d", "e"))]
OFFLOAD = (TierSpec("host", 4), TierSpec("disk", 8))


def serve(backend="numpy", **kw):
    return S.simulate(REQUESTS, backend, make_config(block_size=16, num_blocks=4, prefix_caching=True,
                                                     **kw), max_batch=1, offload=OFFLOAD)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_hits_by_level_counted_by_hand(backend):
    r = serve(backend)
    # r0: nothing anywhere, a b c computed; its decode takes the 4th block. Freed: host a b c,
    #   disk a b c; device cached, oldest first: c b a (a sequence releases from its tail).
    # r1: d e take the free block and evict c; its decode evicts b. Freed: host a b c + d, then e
    #   evicts a (the least recent) -> b c d e; disk a b c d e; device cached a e d.
    # r2: device a (1); b c on host (2). Its 2 new blocks are the free one and e's; its decode
    #   evicts d. Freed: host keeps b c, a evicts d (least recent after the load touched c b):
    #   host e c b a.
    # r3: no device hit; d on disk only (1), e on host (1).
    # device 1, host 2 + 1 = 3, disk 1; computed 3 + 2 + 0 + 0 = 10 - 1 - 3 - 1 = 5
    assert r.prefix_hit_blocks == 1
    assert r.tier_hits == {"host": 3, "disk": 1}
    assert r.prompt_blocks == 3 + 2 + 3 + 2
    assert (r.finished, r.steps) == (4, 5)  # one admission per step, the last decoded at step 4
    kinds = [op.kind for op in r.trace.ops]
    assert kinds.count("load") == 4 and kinds.count("store") == 2 * 4  # every free stores to both


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_logged_trace_replays_clean_with_its_content(backend):
    r = serve(backend, store_kv=True)
    v = check(r.trace, registry.resolve(backend).create(r.config), gather="all")
    assert v.valid is True, str(v.divergence)


def test_offload_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="'python-objects' runs no lower tier of policy 'lru'"):
        S.simulate(REQUESTS, "python-objects", make_config(prefix_caching=True), offload=OFFLOAD)
    with pytest.raises(ValueError, match="needs prefix caching on"):
        S.simulate(REQUESTS, "numpy", make_config(), offload=OFFLOAD)
    with pytest.raises(ValueError, match="give one"):
        S.simulate(REQUESTS, "numpy", make_config(prefix_caching=True), offload=OFFLOAD,
                   preemption="swap", swap_blocks=2)
    with pytest.raises(ValueError, match="token budget"):
        S.simulate(REQUESTS, "numpy", make_config(prefix_caching=True), offload=OFFLOAD, token_budget=16)


def test_the_command_reports_hits_by_level(tmp_path, capsys):
    # Mooncake names blocks of 512 tokens: the same requests in blocks of 512
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 512 * len(r.block_hashes),
                                         "output_length": 1, "hash_ids": [ord(h) for h in r.block_hashes]})
                             + "\n" for r in REQUESTS))
    code = cli_main(["serve", "--trace", str(trace), "--format", "mooncake", "--model", "tiny",
                     "--budget", "4", "--block-size", "512", "--backend", "numpy", "--max-batch", "1",
                     "--offload", "host=4,disk=8", "--check", "--quiet", "--output", str(tmp_path / "r.json")])
    assert code == 0  # the logged trace passed the checker
    out = capsys.readouterr().out
    assert "host_hit_blocks" in out and "disk_hit_blocks" in out
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    # the same requests as above: device 1, host 3, disk 1, computed 5
    assert (row["prefix_hit_blocks"], row["host_hit_blocks"], row["disk_hit_blocks"],
            row["computed_blocks"]) == (1, 3, 1, 5)


@pytest.mark.parametrize("text, why", [("host", "NAME=BLOCKS"), ("host=0", "positive integer"),
                                       ("host=4,host=8", "named twice")])
def test_a_bad_offload_option_is_refused(text, why, capsys):
    assert cli_main(["serve", "--trace", "x", "--format", "mooncake", "--offload", text]) == 2
    err = capsys.readouterr().err
    assert "--offload: " in err and why in err
