"""The oracle's model of vLLM's sparse retention of window blocks (Capabilities.sparse_window_retention,
kvbench/model/rules/vllm.py), on a hand-counted trace.

tiny-hybrid at B = 8: groups sliding(32), full. A hit of L blocks needs the sliding group's
cdiv(32 - 1, 8) = 4 blocks below L; sparse retention caches only such runs, below block
(P - 1) // 8 of a P-token prompt and below the hit's junction. The same trace runs vLLM's manager
in tests/engines/test_vllm_kvmanager.py.
"""
from __future__ import annotations

from kvbench.model.oracle import Oracle
from kvbench.model.rules import rule_set
from kvbench.model.rules.vllm import retained_positions
from kvbench.contract.formulas import get_model, with_group_kinds
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Free, Header, Prefill, Trace, validate

from impls.engines.vllm_kvmanager import capabilities_for  # importable without vLLM

B, NUM_BLOCKS = 8, 64
A = [f"a{i}" for i in range(8)]


def retention_trace() -> Trace:
    """Sequence 0 (64 tokens) caches its prompt; sequence 1 (80 tokens) shares its first 5 blocks
    and diverges; sequence 2 (48 tokens) shares the same 5 and hits them through the window
    sequence 1 kept at its junction."""
    ops = [Prefill(0, 0, "default", 64, tuple(A)),
           Free(1, 0),
           Prefill(2, 1, "default", 80, tuple(A[:5]) + tuple(f"b{i}" for i in range(5, 10))),
           Free(3, 1),
           Prefill(4, 2, "default", 48, tuple(A[:5]) + ("c5",)),
           Free(5, 2)]
    header = Header(family="test", settings={"model": "tiny-hybrid", "block_size": B,
                                             "num_blocks": NUM_BLOCKS, "prefix_caching": True},
                    groups=("sliding(32)", "full"))
    return validate(Trace(header, ops, name="window-retention"))


def config() -> CacheConfig:
    return CacheConfig(model=get_model("tiny-hybrid"), block_size=B, num_blocks=NUM_BLOCKS,
                       store_kv=False, prefix_caching=True)


SERVING = capabilities_for(caching=True, retention_interval=0)  # vLLM's serving default


def ledgers(caps) -> list:
    """(blocks_used, cached_blocks, prefix_hit_blocks) after each operation of the trace."""
    oracle = Oracle(config(), capabilities=caps)
    out = []
    for op in retention_trace().ops:
        if isinstance(op, Prefill):
            oracle.prefill(op.seq, op.tokens, op.tenant, op.tokens, op.step, hashes=op.block_hashes)
        else:
            oracle.free(op.seq)
        led = oracle.expected_ledger()
        out.append((led.blocks_used, led.cached_blocks, led.prefix_hit_blocks))
    return out


def test_the_retained_window_runs_end_at_the_replay_boundary_and_the_junction():
    sliding = get_model("tiny-hybrid").kv_groups[0]
    # P = 64: the run of 4 below (64 - 1) // 8 = 7 is blocks 3..6.
    assert retained_positions(64, 0, sliding, B) == {3, 4, 5, 6}
    # P = 80, junction 5: below (80 - 1) // 8 = 9, blocks 5..8; below 5, blocks 1..4.
    assert retained_positions(80, 5, sliding, B) == set(range(1, 9))
    # A run below block 2 is cut at block 0: [max(0, 16 - 32 + 1) // 8, 2).
    assert retained_positions(20, 0, sliding, B) == {0, 1}
    assert retained_positions(80, 5, get_model("tiny-hybrid").kv_groups[1], B) is None  # full


def test_the_declared_rule_gives_the_hand_counted_ledgers():
    assert rule_set(SERVING).sparse_window_retention
    assert ledgers(SERVING) == [
        (8 + 8, 0, 0),  # 64 // 8 = 8 blocks per group; vLLM releases no window at a prefill
        # The full group caches its 8 blocks, the sliding group blocks 3..6 only.
        (0, 8 + 4, 0),
        # 80 tokens, cap (80 - 1) // 8 = 9: the full group has a0..a4 (5 blocks), but a hit of 5
        # needs sliding blocks 1..4 ([40 - 32 + 1, 40) // 8), and 1, 2 are not cached; no
        # shorter hit either (each needs block 0): no hit, 10 + 10 new blocks. The junction is 5.
        (10 + 10, 12, 0),
        # Full: its 10 blocks (a0..a4 a second time: vLLM keeps duplicates); sliding: blocks 1..4
        # (below the junction) and 5..8 (below (80 - 1) // 8 = 9).
        (0, 12 + 10 + 8, 0),
        # 48 tokens, cap (48 - 1) // 8 = 5: the full group's a0..a4 and sequence 1's sliding
        # blocks 1..4 hit, 5 + 4 = 9; one new block per group for c5 (sliding: 0 is below it).
        ((5 + 1) + (4 + 1), 30 - 9, 9),
        # Back: the 9 hits and the full group's c5; the sliding c5 block is past 1..4, uncached.
        (0, 21 + 9 + 1, 9),
    ]


def test_without_the_rule_the_same_trace_caches_every_window_block():
    """SPEC's rule: every full block of both groups is cached, so sequence 1 hits 5 + 4 blocks."""
    dense = capabilities_for(caching=True, retention_interval=None)
    got = ledgers(dense)
    assert got[1] == (0, 8 + 8, 0)
    # Sequence 1: a hit of 5 full blocks and sliding 1..4; 5 + 5 new blocks per group.
    assert got[2] == ((5 + 5) + (4 + 5), 16 - 9, 9)


def test_the_cost_script_reports_both_rules_on_the_same_trace():
    """scripts/retention_cost.py on the hand trace: under SPEC's rule sequence 1 hits 5 + 4 = 9
    blocks and sequence 2 the same 9 (a0..a4 and sliding 1..4, cached by either); under vLLM's,
    only sequence 2's 9. Prompt blocks: 2 groups * (64 + 80 + 48) // 8 = 48."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "retention_cost.py"
    spec = importlib.util.spec_from_file_location("retention_cost", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = {r["rule"]: r for r in script.cost_rows([retention_trace()])}
    sparse, dense = rows["sparse (vLLM's default)"], rows["dense (SPEC)"]
    assert sparse["prompt_blocks"] == dense["prompt_blocks"] == 2 * (64 + 80 + 48) // 8
    assert (sparse["hit_blocks"], dense["hit_blocks"]) == (9, 9 + 9)
    # Peaks at sequence 1: 10 + 10 new blocks (sparse), (5 + 5) + (4 + 5) (dense, as above).
    assert (sparse["peak_blocks"], dense["peak_blocks"]) == (20, 19)
    # Dense: 16 cached, 9 taken by sequence 1 and back with its 10 new, 9 taken by sequence 2
    # and back with its 2 new (c5 in each group), every one of them full.
    assert (sparse["final_cached_blocks"], dense["final_cached_blocks"]) == (
        31, 16 - 9 + (9 + 10) - 9 + (9 + 2))


def test_a_fork_names_the_content_of_blocks_sparse_retention_left_uncached():
    """Found by `kvbench fuzz --backend vllm-kvmanager` (seed 0): one sliding(2) group, B = 1,
    4 blocks. A 3-token prompt keeps the run of cdiv(2 - 1, 1) = 1 block below (3 - 1) // 1 = 2:
    block 1 only. Its fork (a new request of the 3 tokens) still hashes blocks 0 and 2 as vLLM
    does, so it hits 2 = (3 - 1) // 1 blocks: block 1 shared, block 0 below the window, one new
    block; 3 + 1 = 4 fit. The oracle once stopped the fork's keys at the uncached block 0."""
    from kvbench.contract.formulas import with_group_kinds
    model = with_group_kinds(get_model("tiny-hybrid"), ("sliding(2)",))
    oracle = Oracle(CacheConfig(model=model, block_size=1, num_blocks=4, store_kv=False,
                                prefix_caching=True), capabilities=SERVING)
    oracle.prefill(0, 3, "a", 3, 0)
    assert oracle.expected_ledger().blocks_used == 3  # no window released at a prefill
    oracle.fork(1, 0, 3, 1)
    led = oracle.expected_ledger()
    assert (led.blocks_used, led.shared_blocks, led.blocks_free) == (3 + 1, 1, 0)


def test_the_junction_is_the_hit_of_vllms_first_attention_group():
    """vLLM sorts full attention (MLA included) first; equal specs are one group. With the full
    group's a0..a2 cached and no sliding block, a 4-block prompt's junction is the full hit, 3;
    without a full group it is the first group's own hit."""
    from kvbench.model.rules.vllm import first_group_hit
    from kvbench.contract.formulas import with_group_kinds
    keys = ["a0", "a1", "a2", "a3"]
    groups = with_group_kinds(get_model("tiny-hybrid"), ("sliding(8)", "mla(12)")).kv_groups
    cached = {(1, k) for k in keys[:3]}  # group 1 (mla) holds a0..a2
    assert first_group_hit(cached, groups, keys, cap=4, block_size=4) == 3
    sliding = with_group_kinds(get_model("tiny-hybrid"), ("sliding(8)", "sliding(16)")).kv_groups
    # sliding(8) at B = 4: a hit of L needs cdiv(8 - 1, 4) = 2 blocks below L: a1, a2 give L = 3.
    assert first_group_hit({(0, "a1"), (0, "a2")}, sliding, keys, cap=4, block_size=4) == 3


def test_a_chunked_first_group_puts_the_junction_at_its_chunk_start():
    """vLLM's first attention group is the first group's kind where no full group is present; a
    chunked one hits every block left of its chunk (null), so the junction of a prompt nothing
    else hits is that chunk's start (the seed 4242 campaign's 06 and 07 on vllm-kvmanager)."""
    config = CacheConfig(model=with_group_kinds(get_model("tiny-hybrid"), ("chunked(8)", "sliding(4)")),
                         block_size=1, num_blocks=NUM_BLOCKS, store_kv=False, prefix_caching=True)
    oracle = Oracle(config, capabilities=SERVING)
    oracle.prefill(0, 10, "default", 10, 0)
    # the junction: (10 - 1) // 8 * 8 = 8; the replay boundary (10 - 1) // 1 = 9; sliding(4)
    # keeps ceil((4 - 1) / 1) = 3 blocks below each: 5, 6, 7 and 6, 7, 8
    assert oracle.seqs[0].retained[1] == frozenset({5, 6, 7, 8})
    oracle.free(0)
    # 14 = 10 full blocks of the chunked group (it keeps every block) + 4 of the sliding group
    assert oracle.expected_ledger().cached_blocks == 14
