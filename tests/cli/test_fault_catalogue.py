"""The engine-bug catalogue (`kvbench faults`): every engine bug as shipped upstream, planted into a copy
of a backend, is caught by the default suite, the committed workloads `kvbench run` checks, not
only by a trace written for it; and the suite passes the backends the faults were planted into."""
from __future__ import annotations

from pathlib import Path

import pytest

from impls.faults import CATALOGUE
from impls.faults_edges import BOUNDARY_BUGS, EDGE_BUGS
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.cli import faults as cli
from kvbench.cli import main
from kvbench.contract import registry
from kvbench.contract.protocol import Backend


@pytest.fixture(scope="module")
def table():
    return {r["bug"]: r for r in cli.catalogue()}


@pytest.mark.parametrize("bug", [b for b in CATALOGUE if b.why], ids=lambda b: b.upstream)
def test_every_engine_bug_is_caught_by_the_default_suite(table, bug):
    row = table[bug.name]
    assert row["caught"] == "yes", f"{bug.name} ({bug.upstream}) passes every committed workload"
    assert row["workload"] and isinstance(row["step"], int)
    assert row["first divergence"].startswith(row["divergence"].quantity)


def test_the_faults_document_is_the_catalogue(table):
    doc = Path(__file__).resolve().parents[2] / "docs" / "faults.md"
    assert doc.read_text() == cli.markdown(list(table.values())), \
        "docs/faults.md is stale: kvbench faults --markdown docs/faults.md"


def test_the_planted_faults_of_the_tests_are_caught_too(table):
    missed = [b.name for b in CATALOGUE if not b.why and table[b.name]["caught"] != "yes"]
    assert missed == []


def test_a_salt_leak_names_both_requests(table):
    # The pool's KV events show the leak first: a key announced for a block of another salt
    # that stood for the first salt's block.
    row = table["salt and adapter name untagged in the block hash"]
    d = row["divergence"]
    assert d.quantity == "residency of group 0, tier 0" and "one key for two blocks" in d.detail
    # Without events, the hit across salts names both requests.
    from impls.faults import UntaggedExtraKeys
    trace = suite.load_traces([suite.WORKLOADS_DIR / f"{row['workload']}.jsonl"])[0]
    silent = type("Silent", (UntaggedExtraKeys,), {"events": Backend.events})
    d = check(trace, silent(suite.config_for(trace))).divergence
    assert "a hit across salts" in d.detail and "salt 'x'" in d.detail and "adapter 'x'" in d.detail


@pytest.mark.parametrize("base", sorted({b.fault.__mro__[1] for b in CATALOGUE}, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_the_backends_the_faults_are_planted_into_pass_the_suite(base):
    # The control: what the catalogue reports is the fault, not the suite or the backend.
    for trace in suite.default_traces():
        for policy in suite.policies_for(trace, "auto"):
            try:
                backend = base(suite.config_for(trace, policy=policy))
            except NotImplementedError:  # a group kind the pool does not run (SPEC §12), said so
                continue
            v = check(trace, backend)
            if trace.header.tiers and not base.capabilities.tiers:  # n/a, with the reason
                assert v.valid is None and "does not declare tiers" in v.not_applicable
                continue
            if backend.config.model.hybrid and not base.capabilities.groups:  # n/a, said so
                assert v.valid is None and "does not run KV cache groups" in v.not_applicable
                continue
            assert v.valid is True, f"{trace.name}@{policy}: {v.divergence}"


def test_the_command_prints_the_table_and_says_what_it_missed(capsys):
    # One workload: the table, and exit status 1 exactly when an engine bug went unnoticed.
    code = main(["faults", "--quiet", "--width", "40", str(suite.WORKLOADS_DIR / "fork-beam.jsonl")])
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split()[:4] == ["bug", "upstream", "caught", "workload"]
    assert len(out.splitlines()) == 1 + len(CATALOGUE) + 1
    assert code == (1 if "MISSED" in err else 0)
    assert f"of {sum(b.why for b in CATALOGUE)} engine bugs the default suite must catch" in out


@pytest.mark.parametrize("name, fault, base", EDGE_BUGS, ids=[n for n, _, _ in EDGE_BUGS])
def test_each_single_line_bug_of_a_pool_is_caught_by_the_default_suite(table, name, fault, base):
    # Issue 12: the default run catches what the tests catch. Each of these slips shows only at
    # an edge (a refusal, an exact fit, 128 sharers, 65 live sequences, blocks of 256, 17+ block
    # prompts, the int4 pool) or is a control; docs/workloads.md's table says which the suite missed
    # before the edge workloads (measured when they were added).
    row = table[name]
    assert row["caught"] == "yes", f"{name}: passes every committed workload"
    assert base in registry.DEFAULT_BACKENDS  # the pool it is planted into runs by default


def test_a_salt_dropped_for_hashed_prompts_fails_the_default_run(table):
    # The cross-tenant leak no workload caught before prefix-salts: the salt kept on the token-id
    # path only. prefix-salts opens with alice (salt "a") prefilling 32 tokens named by 4 block
    # hashes, then bob (salt "b") the same 4 hashes.
    ops = suite.load_traces([suite.WORKLOADS_DIR / "prefix-salts.jsonl"])[0].ops
    assert [(op.seq, op.salt, op.tokens, op.block_hashes) for op in ops[:2]] == [
        (0, "a", 32, ("s0.0", "s0.1", "s0.2", "s0.3")), (1, "b", 32, ("s0.0", "s0.1", "s0.2", "s0.3"))]
    row = table["salt and adapter dropped from a prompt named by block hashes"]
    d = row["divergence"]
    # Bob's 32 tokens must miss and take ceil(32 / 8) = 4 new blocks: 8 = 4 + 4 in use. Keyed
    # by the hashes alone, bob hits alice's 4: 4 in use.
    assert (row["caught"], row["workload"], d.step, d.quantity) == ("yes", "prefix-salts", 1, "blocks_used")
    assert (d.expected, d.actual) == (8, 4)
    assert "a hit across salts: sequence 1 (salt 'b')" in d.detail and "sequence 0 (salt 'a')" in d.detail


def _edge_decode_ops():
    return suite.load_traces([suite.WORKLOADS_DIR / "edge-decode.jsonl"])[0].ops


def _kinds(ops):
    return [(type(op).__name__, getattr(op, "seq", None)) for op in ops]


def test_edge_decode_opens_as_its_faults_assume():
    # The figures the next test expects, read off the trace (16 blocks of 16 tokens).
    ops = _edge_decode_ops()
    # Steps 0..12: z (seq 0), then 12 one-block sequences; step 13 z decodes one token; step 14
    # the other 12 decode one each (12 > 8: the vectorized step); step 15 a prefill of
    # ceil(49 / 16) = 4 blocks, with 16 - 13 = 3 free: one victim of one block.
    assert _kinds(ops[:13]) == [("Prefill", s) for s in range(13)]
    assert all(op.tokens <= 16 for op in ops[:13])
    assert (ops[13].seqs, ops[14].seqs, ops[14].tokens) == ((0,), tuple(range(1, 13)), (1,) * 12)
    assert _kinds(ops[15:16]) == [("Prefill", 13)] and ops[15].tokens == 49
    # Steps 30..34: x (seq 14, 26 tokens: 2 blocks), y (15, 1 block), y decodes, x' (16) forks
    # x, a prefill of ceil(214 / 16) = 14 blocks with 16 - 3 = 13 free: x frees nothing (x'
    # shares both blocks), then one more victim.
    assert _kinds(ops[30:35]) == [("Prefill", 14), ("Prefill", 15), ("Append", None), ("Fork", 16),
                                  ("Prefill", 17)]
    assert (ops[30].tokens, ops[31].tokens, ops[32].seqs, ops[33].src, ops[34].tokens) == (26, 9, (15,), 14, 214)
    # Steps 39..45: four prompts of exactly 16 tokens, v (54: 4 blocks), g (66: 5 blocks):
    # 16 - 4 - 4 - 5 = 3 free; step 45 decodes every live sequence one token: 4 full tails need
    # 4 blocks, 3 are free, and nothing may be evicted.
    assert [op.tokens for op in ops[39:45]] == [16, 16, 16, 16, 54, 66]
    assert sorted(ops[45].seqs) == list(range(18, 24)) and ops[45].tokens == (1,) * 6


@pytest.mark.parametrize("bug, workload, step, quantity, expected, actual", [
    # z last used at step 13, the wide batch at 14: LRU evicts z (0). Left at their prefill
    # steps 1..12, the wide batch's sequences look older: 1 goes.
    ("a wide decode step leaves last_access", "edge-decode@lru", 15, "victims", [0], [1]),
    # LFU: z (2 uses, last 13) before the batch (2 uses, last 14). Counted 1 use, 1 goes.
    ("a wide decode step leaves use_count", "edge-decode@lfu", 15, "victims", [0], [1]),
    # LRU: x (30) first, then y (32) before x' (33). Inheriting x's step 30, x' goes instead.
    ("a fork's child inherits its source's access and use", "edge-decode@lru", 34, "victims",
     [14, 15], [14, 16]),
    # 4 blocks needed, 3 free, no candidate: refused. "Some room" takes 4 of 3.
    ("a decode step's room: any block free, not enough", "edge-decode@lru", 45, "outcome of append",
     "out-of-memory", "KeyError"),
])
def test_each_decode_edge_fault_fails_the_default_run_at_edge_decode(table, bug, workload, step,
                                                                    quantity, expected, actual):
    row = table[bug]
    d = row["divergence"]
    assert (row["caught"], row["workload"], d.step, d.quantity) == ("yes", workload, step, quantity), str(d)
    assert d.expected == expected and str(d.actual).split(":")[0] == str(actual).split(":")[0], str(d)


def test_hybrid_decode_faults_fail_the_default_run_at_hybrid_decode(table):
    trace = suite.load_traces([suite.WORKLOADS_DIR / "hybrid-decode.jsonl"])[0]
    ops = trace.ops
    # tiny-hybrid in blocks of 8: a sliding(32) group, then a full one. Prefills of 30, 38 and
    # 69 tokens, then one-token steps over all three.
    assert trace.header.groups == ("sliding(32)", "full") and trace.header.settings["block_size"] == 8
    assert [op.tokens for op in ops[:3]] == [30, 38, 69]
    assert all(op.seqs == (0, 1, 2) and op.tokens == (1, 1, 1) for op in ops[3:6])
    # Step 3: 31, 39, 70 tokens. Full group: ceil(31/8) + ceil(39/8) + ceil(70/8) = 4 + 5 + 9.
    # Sliding: blocks from (T - 31) // 8: 0, (39 - 31) // 8 = 1, (70 - 31) // 8 = 4, so
    # 4 + (5 - 1) + (9 - 4) = 13; 31 = 18 + 13 in use. Not sliding, b keeps its block 0: 32.
    d = table["a one-token hybrid decode step never slides its windows"]["divergence"]
    assert (d.trace, d.step, d.quantity, d.expected, d.actual) == ("hybrid-decode", 3, "blocks_used", 31, 32)
    # Step 5: 33, 41, 72 tokens; a and b each cross a block edge: one new block in each group.
    # Full: 5 + 6 + 9 = 20. Sliding: 5 + (6 - 1) + (9 - (72 - 31) // 8) = 5 + 5 + 4 = 14.
    # Counting the 2 new full blocks in group 0 instead: (14 + 2, 20 - 2).
    d = table["a hybrid decode step counts new blocks in group 0"]["divergence"]
    assert (d.trace, d.step, d.quantity, d.expected, d.actual) == ("hybrid-decode", 5, "group_blocks",
                                                                    (14, 20), (16, 18))


def test_a_wrong_block_read_into_a_buffer_fails_the_default_run(table):
    # decode-stream, blocks of 16: of the first eight prompts (7, 5, 11, 6, 3, 8, 21, 15 tokens)
    # only sequence 6 holds a partial block after a whole one; each operation's random window
    # covers a whole sequence while none holds more than 4 blocks, read into a buffer. The first
    # time it draws 6, 6's partial block, read from block 0, is wrong from position 16.
    ops = suite.load_traces([suite.WORKLOADS_DIR / "decode-stream.jsonl"])[0].ops
    assert [op.tokens for op in ops[:8]] == [7, 5, 11, 6, 3, 8, 21, 15]
    row = table["gather(out=) reads the last partial block from the block before"]
    d = row["divergence"]
    assert (row["caught"], row["workload"], d.quantity) == ("yes", "decode-stream", "kv of sequence 6")
    # Sequence 6's length at step s >= 7: 21 + s - 7 (one token per decode step from step 8).
    length = 21 + max(0, d.step - 7)
    assert 16 < length < 32  # one whole block, then the partial one
    assert d.detail == (f"first wrong position 16 (should hold what sequence 6 wrote there); "
                        f"read by gather(6, 0, {length}, out=) into the caller's buffer")


def test_a_fault_in_the_quantizers_numpy_steps_fails_the_default_run(table):
    from impls import quant_kernels
    from impls.faults import StepsPackHighNibbleFirst
    # numpy-int4-steps runs by default: the NumPy steps, where numpy-int4 has the compiled kernels.
    assert {"numpy-int4", "numpy-int4-steps"} <= set(registry.DEFAULT_BACKENDS)
    # decode-stream's first prefill: sequence 0 writes value ((0 * 7919 + 0 * 131 + 3) + 17 * 0)
    # mod 2003 - 1001 = -998 at position 0, channel 0, read back from swapped nibbles.
    row = table["int4 NumPy steps pack the first code high"]
    d = row["divergence"]
    assert (row["caught"], row["workload"], d.step, d.quantity) == ("yes", "decode-stream", 0, "kv of sequence 0")
    assert d.detail.startswith("position 0, row 0, channel 0: |-998.0 - ")
    if quant_kernels.available()[0]:  # the same pool by the compiled kernels never meets the fault
        compiled = type("Compiled", (StepsPackHighNibbleFirst,), {"compiled": None})
        trace = suite.load_traces([suite.WORKLOADS_DIR / "decode-stream.jsonl"])[0]
        assert check(trace, compiled(suite.config_for(trace))).valid is True


# Where the default run must catch each scheduler-lifecycle fault (SPEC §13), and why there:
LIFECYCLE_CATCHES = {
    # the first accept that rejects a draft: 0's 63 + 5 = 68 tokens, 3 of 4 kept: 67, its tail
    # holds 67 - 64 = 3 tokens, not 4;
    "a rollback leaves the tail's fill": ("lifecycle-speculative", 4),
    # the first rollback across a block edge: 2 grows 63 -> 68 -> 71 -> 76 (5 written, 4, 2, 4 of
    # the 4 drafts kept), then 81 with 3 kept: 80 = 5 * 16, so block 5 lies wholly past it;
    "a block of rejected drafts stays in the prefix cache": ("lifecycle-speculative", 18),
    # 1 writes 24 of its 38-token prompt: p0.1 holds 24 - 16 = 8 of 16 tokens, and the pool's KV
    # events (SPEC §14) announce it at once, before 3's prompt arrives to hit a half-written p1.1;
    "a chunked prompt's block cached before it is complete": ("lifecycle-chunked", 1),
    # 2, preempted at step 8, resumes after 0 and 1 took the blocks it released.
    "a resumed sequence reads the blocks it held before (another's by then)": ("lifecycle-preempt", 12),
    # host holds 8 blocks: 9 (27 tokens, ceil(27 / 16) = 2 blocks) swaps out at step 27, 8 (45
    # tokens, 3 blocks) at 29, leaving 8 - 5 = 3, too few for 7's 72 tokens (5 blocks: recomputed);
    # 9 resumes at step 35 while 8 is still swapped, swapped out last.
    "a swapped sequence resumes with another's K/V": ("lifecycle-swap", 35),
    # 0 prefills 80 tokens, 80 / 16 = 5 full blocks (p2.0 .. p2.3, r0.0), the last left uncached:
    # its KV events store 4 of them, not 5 (without events, its free at step 6 shows it).
    "an EAGLE hit's lookahead block left out of the caching mask": ("lifecycle-chunked", 0),
}


@pytest.mark.parametrize("name", LIFECYCLE_CATCHES)
def test_each_lifecycle_fault_fails_the_default_run_at_its_step(table, name):
    row = table[name]
    assert (row["caught"], row["workload"], row["step"]) == ("yes", *LIFECYCLE_CATCHES[name])


# KV events (SPEC §14): each on hybrid-cut-hits (blocks of 8), the first committed workload that
# caches, whose first hashed prefill is step 2 (1: 48 tokens, w0.0 .. w0.5).
EVENT_CATCHES = {
    # 1's first decode step (3): its last cached prompt block, w0.5, removed and stored again;
    "a cached block registered again at every step: a stored follows its removed": 3,
    # step 2's first stored block, w0.0, names a parent never stored;
    "a stored names a parent that was never stored": 2,
    # step 9's prefill of 8 tokens takes one block per group, evicting the oldest cached ones
    # (w0.0 and w0.5 of the sliding group); the fault announces neither;
    "an eviction announced by no removed": 9,
    # step 13's prompt is the first with a partial last block: 53 = 6 * 8 + 5.
    "a prompt's partial last block announced as stored": 13,
}


@pytest.mark.parametrize("name", EVENT_CATCHES)
def test_each_event_fault_fails_the_default_run_at_its_step(table, name):
    row = table[name]
    assert (row["caught"], row["workload"], row["step"]) == ("yes", "hybrid-cut-hits", EVENT_CATCHES[name])
    quantity = "event order" if "parent" in name else "residency of group 0, tier 0"
    assert row["divergence"].quantity == quantity


def test_each_tier_fault_fails_the_default_run_at_its_step(table):
    from impls import faults_tiers as T
    # tier-races (replayed after tier-agentic, before tier-turns), blocks of 8, 24 of them.
    # Step 0 prefills 31 = 3 * 8 + 7 tokens (hashes r0.0..r0.2: 3 hashed blocks of 4); step 1
    # stores them to host, leasing the 3; step 2 frees the sequence: the 3 leased blocks stay in
    # use until step 5 completes the store; a lease ended at the free leaves block 0 with 0
    # references, not 0 + 1. Step 3 flushes 168 = (24 - 3) * 8 tokens into the row step 2 freed;
    # a copy at completion (step 5) that reads the blocks from that row copies the flush's K/V.
    # Step 17: round 2's store fails; host holds round 0's 3 blocks, not 3 + 3.
    # tier-turns, blocks of 8. Step 5 completes conversation 0's store of hashes 1000, 1001
    # under salt "a": host announces them keyed by the raw hash (SPEC §14's tier events), where
    # the model holds them under salt "a"; no device key stands for them.
    # Step 107: conversation 2's last load is aborted; nothing else is live and no store is in
    # flight (store 29 completed at step 106): 0 blocks in use. The fault keeps its 3 targets
    # (3000..3002 from disk; 3003 has left host's LRU of 8 blocks): a reference no table and no
    # store holds.
    # tier-agentic (replayed first), step 10: agent 0's load completes (the second
    # agent's still reads the 6 prefix blocks on host: both loads take them from host, the
    # nearest tier); a copy one block early puts prefix block 1's K/V at position 0.
    # tier-agentic, step 1: the prefix's 6 hashed blocks (0 .. 5 of ceil(49 / 8) = 7) are stored
    # to disk; block 0, held by one table and one store, reported with 1 reference, not 1 + 1
    # (a lease out of the counts, or ended at the begin). Step 9: agent 1 loads the 6 prefix
    # blocks after agent 0's load (step 8) of the same 6 began: its targets are no hit, so host
    # serves 6 + 6 = 12 hits; hitting them, agent 1 takes none from host: 6.
    where = {T.LeaseEndsAtFree: ("tier-races", 2, "reference count of block 0", 1, 0),
             T.TierKeyIgnoresSalt: ("tier-turns", 5, "residency of group 0, tier 1",
                                    {"stored": [((("salt", "a"),), 1000), ((("salt", "a"),), 1001)],
                                     "removed": []},
                                    {"stored": ["backend key 1000", "backend key 1001"], "removed": []}),
             T.LoadIntoBlockBefore: ("tier-agentic", 10, "kv of sequence 2",
                                     "what it wrote or inherited", "different values"),
             T.FailedStoreVisible: ("tier-races", 17, "tier host stored", 3, 3 + 3),
             T.AbortLeaksLoadBlocks: ("tier-turns", 107, "reference count of block", 0, 1),  # one of the 3
             T.PinIsAFlag: ("tier-agentic", 10, "tier host loading", 6, 0),
             T.LeasesOutOfRefcounts: ("tier-agentic", 1, "reference count of block 0", 1 + 1, 1),
             T.LeaseEndsAtBegin: ("tier-agentic", 1, "reference count of block 0", 1 + 1, 1),
             T.StoreReadsRowAtCompletion: ("tier-races", 5, "tier content of transfer 0", None, None),
             # step 8: agent 0's load of the 6 prefix blocks begins; their targets announced as
             # cache entries at the begin (SPEC §14), before the load completes
             T.LoadTargetHitEarly: ("tier-agentic", 8, "residency of group 0, tier 0", None, None),
             # boundary-tiers-1 (host declares failed_load "drop"), step 8 (after its lookup at 6,
             # the load at 7): the load of host's 2 blocks fails; host drops both (0 stored), the
             # fault keeps them (2). The committed workloads' tiers keep a failed load's blocks,
             # where the fault is right.
             T.FailedLoadReserved: ("boundary-tiers-1", 8, "tier host stored", 0, 2),
             # boundary-tiers-2 (a salted lookup at 6, its load at 7), step 11: the load's done
             # releases its 2 pins by the keys without the salt, which pin nothing: host's 2
             # entries stay pinned (loading 2, not 0)
             T.PinsReleasedWithoutSalt: ("boundary-tiers-2", 11, "tier host loading", 0, 2),
             # boundary-shared-reads-1 (host drops failed loads), step 8: the load begun at 6
             # fails while the load begun at 7 still reads host's 2 blocks; SPEC keeps both
             # until that reader ends (stored 2), the fault removes them at once (0)
             T.FailedLoadDropsUnderReaders: ("boundary-shared-reads-1", 8, "tier host stored", 2, 0)}
    for name, upstream, fault in T.TIER_BUGS:
        row = table[name]
        d = row["divergence"]
        workload, step, quantity, expected, actual = where[fault]
        assert (row["caught"], row["workload"]) == ("yes", workload), name
        assert d.step == step, (name, str(d))
        if expected is not None:
            assert (d.expected, d.actual) == (expected, actual), (name, str(d))
        assert d.quantity == quantity or (quantity.endswith("block")
                                          and d.quantity.startswith(quantity + " ")), (name, str(d))
    assert "first wrong position 0" in table[T.TIER_BUGS[1][0]]["divergence"].detail


def test_a_cut_hit_fault_fails_the_default_run_at_hybrid_cut_hits(table):
    trace = suite.load_traces([suite.WORKLOADS_DIR / "hybrid-cut-hits.jsonl"])[0]
    ops = trace.ops
    # tiny-hybrid in blocks of 8: sliding(32), then full. A hit of L blocks needs the sliding
    # blocks covering [8L - 31, 8L): h = 4 of them, so K = h + 2 groups = 6 prompt blocks. After
    # 4 decode steps of 8, a holds 6 + 4 = 10 full blocks and 4 sliding: a budget of
    # 14 + 6 cached = 20 blocks, which the first prefill (80 = 10 * 8 tokens, both groups) takes.
    assert trace.header.groups == ("sliding(32)", "full") and trace.header.settings["block_size"] == 8
    assert trace.header.settings["num_blocks"] == 20
    assert [(op.kind, getattr(op, "seq", None), getattr(op, "tokens", None)) for op in ops[:12]] == [
        ("prefill", 0, 80), ("free", 0, None), ("prefill", 1, 48), *[("append", None, (8,))] * 4,
        ("prefill", 2, 40), ("free", 2, None), ("prefill", 3, 8), ("free", 3, None), ("prefill", 4, 48)]
    # Step 11: sequence 4's 6 blocks; the full group has all 6 (sequence 1's), the sliding group
    # lost block 5 (step 9 evicted the 2 oldest cached: sliding blocks 0 and 5), so the hit is
    # cut to 5 blocks: 2 new (block 5 in each group) + the 4 cached sliding blocks 1 .. 4 taken
    # back = 6, and 2 free + 4 cached = 6: an exact fit. The fault adds the cached blocks of a
    # 6-block hit's window (2 .. 5: 2, 3, 4 cached): 6 + 3 = 9 > 6, refused.
    d = table["a hybrid hit cut short by the window: its room counts the longer hit's window too"]["divergence"]
    assert (d.trace, d.step, d.quantity, d.expected, d.actual) == (
        "hybrid-cut-hits", 11, "outcome of prefill", "success", "out-of-memory")


# A boundary fault whose events announce what its figures hide: the partial block cached at the
# append is announced stored on lifecycle-chunked already (its figures alone pass there).
EVENTS_SHOW_FIRST = {"a chunked append caches the block it left partly written"}


@pytest.mark.parametrize("name", [n for n, _, _, _ in BOUNDARY_BUGS])
def test_each_boundary_fault_passes_the_committed_workloads_and_fails_a_boundary_one(table, name):
    # The default suite replays the committed workloads first: a fault first caught on a
    # boundary workload passed every committed one (tests/traces/test_boundaries.py names the step).
    row = table[name]
    if name in EVENTS_SHOW_FIRST:  # its KV events (SPEC §14) show it on a committed workload
        assert row["caught"] == "yes" and row["divergence"].quantity.startswith("residency"), row
        return
    assert row["caught"] == "yes" and row["workload"].startswith("boundary-"), row["workload"]
