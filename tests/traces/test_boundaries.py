"""The boundary workloads (kvbench/traces/boundaries.py): the covering design holds every declared
edge, the generated traces reach each edge (read back from their operations and headers, not from
the cases they were made from), the default run checks them, and each planted boundary fault
(impls/faults_edges.py BOUNDARY_BUGS) fails on its boundary workload at a named step while the
pool it is planted into passes."""
from __future__ import annotations

import itertools

import pytest

from impls import faults_edges as E
from impls.numpy_paged import NumpyPaged
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.contract.protocol import Backend
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.traces import boundaries as bd
from kvbench.traces.ops import Accept, Append, Fork, Free, Load, Prefill, Preempt, Store
from kvbench.traces.format import Done

TRACES = {t.name: t for t in bd.boundary_traces()}


def by_rule(rule: str) -> list:
    return [t for name, t in TRACES.items() if name.startswith(f"boundary-{rule}-")]


# --- the covering design --------------------------------------------------------------------

def test_cover_holds_every_value_and_every_named_pair():
    params = {"a": (1, 2, 3), "b": ("x", "y"), "c": (True, False)}
    alone = bd.cover(params)
    assert len(alone) == 3  # the most values of one parameter: 3 of a
    for p, values in params.items():
        assert {c[p] for c in alone} == set(values)
    paired = bd.cover(params, interactions=(("a", "b"),))
    assert {(c["a"], c["b"]) for c in paired} == set(itertools.product((1, 2, 3), ("x", "y")))
    assert len(paired) == 6  # 3 * 2 pairs, each case one of them


def test_cover_asks_only_for_what_a_valid_case_holds():
    cases = bd.cover({"a": (1, 2), "b": (1, 2)}, interactions=(("a", "b"),),
                     valid=lambda c: c["a"] <= c["b"])
    assert sorted((c["a"], c["b"]) for c in cases) == [(1, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("rule", bd.RULES, ids=lambda r: r.name)
def test_every_rule_covers_its_declared_edges(rule):
    cases = rule.cases()
    valid = [dict(zip(rule.params, v)) for v in itertools.product(*rule.params.values())]
    valid = [c for c in valid if rule.valid(c)]
    for p in rule.params:
        assert {c[p] for c in cases} == {c[p] for c in valid}, p
    for together in rule.interactions:
        def combo(c):
            return tuple(c[p] for p in together)
        assert {combo(c) for c in cases} == {combo(c) for c in valid}, together
    assert len(cases) <= len(valid)


def test_a_covering_is_far_smaller_than_the_product():
    # windows: 2 block sizes * 5 ** 4 kinds' sizes = 1250 combinations; its edges alone take 5
    # cases (the most values of one parameter), one trace each
    assert len(bd.WINDOWS.cases()) == 5 and len(by_rule("windows")) == 5
    assert 2 * 5 ** 4 == 1250


def test_edges_are_offsets_of_the_block_size():
    assert [e(8) for e in bd.EDGES] == [1, 8 - 1, 8, 8 + 1, 2 * 8 + 1]
    assert [str(e) for e in bd.EDGES] == ["1", "B-1", "B", "B+1", "2B+1"]


# --- what the generated traces reach ----------------------------------------------------------

def _label(v: int, B: int) -> str:
    """v as an edge of B: 1, B-1, B, B+1, 2B, 2B+1."""
    names = {1: "1", B - 1: "B-1", B: "B", B + 1: "B+1", 2 * B: "2B", 2 * B + 1: "2B+1"}
    return names[v]


def test_window_kinds_take_every_size_against_the_block_size():
    seen = {"S": set(), "W_s": set(), "W": set(), "C": set(), "B": set()}
    for t in by_rule("windows"):
        B = t.header.settings["block_size"]
        seen["B"].add(B)
        sinks, sliding, chunked, full = (F.parse_kind(k) for k in t.header.groups)
        S, Ws = sinks["sinks"]
        for name, v in (("S", S), ("W_s", Ws), ("W", sliding["window"]), ("C", chunked["chunk"])):
            seen[name].add(_label(v, B))
        assert full == {}
        lengths = [op.tokens for op in t.ops if isinstance(op, Prefill)]
        # one-token steps from 1 to 3B + 2 tokens: every length up to past 2B + 1 is visited
        steps = sum(1 for op in t.ops if isinstance(op, Append) and op.tokens == (1,))
        assert lengths[0] == 1 and steps >= 3 * B + 2 - 1
    assert seen == {"S": {"1", "B-1", "B", "B+1", "2B+1"}, "W_s": {"1", "B-1", "B", "B+1", "2B"},
                    "W": {"1", "B-1", "B", "B+1", "2B+1"}, "C": {"1", "B-1", "B", "B+1", "2B+1"},
                    "B": {4, 8}}


def _rollbacks(t):
    """Each accept: (new length, k drafted, n kept, what shares the block the new length ends
    in: "fork", "cache" (a request of the same token ids holds it) or "none")."""
    B = t.header.settings["block_size"]
    length, ids, forked, drafted, before, out = {}, {}, set(), {}, {}, []
    for op in t.ops:
        if isinstance(op, Prefill):
            length[op.seq], ids[op.seq] = op.tokens, op.token_ids
        elif isinstance(op, Fork):
            length[op.seq] = length[op.src]
            forked |= {op.seq, op.src}
        elif isinstance(op, Append):
            for s, n, k in zip(op.seqs, op.tokens, op.draft or (0,) * len(op.seqs)):
                if k:
                    drafted[s], before[s] = k, length[s]
                length[s] += n
        elif isinstance(op, Accept):
            k = drafted.pop(op.seq)
            length[op.seq] -= k - op.n
            e = length[op.seq]
            # the end's block is one the sequence held before its drafts (n = 0), shared then
            held = op.n == 0 and e >= B
            cached = any(o != op.seq and o in length and ids[o] == ids[op.seq] for o in ids)
            shared = "none" if not held else "fork" if op.seq in forked else "cache" if cached else "none"
            out.append((e, k, op.n, shared))
        elif isinstance(op, Free):
            length.pop(op.seq)
            forked.discard(op.seq)
    return B, out


def test_rollbacks_end_on_every_edge_shared_or_not():
    B, rollbacks = _rollbacks(by_rule("rollback")[0])
    assert B == 4
    ends = {("edge0" if e == B else "block0" if e < B else "edge" if e % B == 0 else "mid", shared)
            for e, _, _, shared in rollbacks}
    # ending on a block edge (e = B, e = 2B) of a block shared by a fork or through the prefix
    # cache, and of one held alone; inside block 0 and mid-block
    assert {("edge", "fork"), ("edge", "cache"), ("edge", "none"), ("edge0", "fork"),
            ("edge0", "cache"), ("edge0", "none"), ("block0", "none"), ("mid", "none")} <= ends
    assert any(e < B and k > B for e, k, _, _ in rollbacks)  # drafts over a block, back into block 0
    assert any(k == 2 * B + 1 and n == 0 for _, k, n, _ in rollbacks)  # 2B + 1 = 9 drafts, none kept
    assert any(k == n for _, k, n, _ in rollbacks)  # all kept: no rollback


def test_chunk_cuts_fall_on_and_beside_block_edges_with_a_request_between():
    t = by_rule("chunks")[0]
    B = t.header.settings["block_size"]
    cuts, hits = set(), set()
    writer, written = None, 0
    for op in t.ops:
        if isinstance(op, Prefill) and op.prompt_tokens:
            writer, written = op.seq, op.tokens
            cuts.add(("first", _label(written, B)))
        elif isinstance(op, Append) and op.seqs == (writer,):
            written += op.tokens[0]
            if written < 3 * B:
                cuts.add(("second", {2 * B - 1: "2B-1", 2 * B: "2B", 2 * B + 1: "2B+1"}[written]))
        elif isinstance(op, Prefill):  # a request for the same prompt, with `written` complete
            hits.add((written % B == 0, written < 2 * B - 1))
        elif isinstance(op, Free) and op.seq == writer:
            writer = None
    assert cuts == {("first", "B-1"), ("first", "B"), ("first", "B+1"),
                    ("second", "2B-1"), ("second", "2B"), ("second", "2B+1")}
    # requests after a chunk that ends mid-block and on an edge, after the first chunk and later
    assert {(False, True), (True, True), (False, False), (True, False)} <= hits


def test_token_id_blocks_repeat_after_another_prefix():
    t = by_rule("chains")[0]
    B = t.header.settings["block_size"]
    prompts = [op.token_ids for op in t.ops if isinstance(op, Prefill)]
    repeats = set()
    for x, y in zip(prompts, prompts[1:]):
        blocks = len(x) // B
        for p in range(1, blocks):
            if x[p * B:(p + 1) * B] == y[p * B:(p + 1) * B] and x[:p * B] != y[:p * B]:
                repeats.add((p, len(x) % B))
    assert repeats >= {(1, 0), (2, 0), (1, 1), (2, 1)}


def test_hybrid_eviction_runs_under_every_policy_after_decode_steps_of_several_groups():
    traces = by_rule("hybrid-eviction")
    widths = set()
    for t in traces:
        assert suite.policies_for(t, "auto") == ["lru", "lfu", "fair"]
        assert len(F.get_model(t.header.settings["model"]).kv_groups) == 2
        widths |= {len(op.seqs) for op in t.ops if isinstance(op, Append)}
    assert {1, 2, 9} <= widths  # 9: past the pool's scalar path of 8


def test_tier_transfers_interleave_with_a_load_of_the_same_blocks():
    kinds = set()
    rooms = set()
    for t in by_rule("tiers"):
        loading, order = set(), []
        for op in t.ops:
            if isinstance(op, Load):
                loading.add(op.id)
                order.append("load" if len(loading) == 1 else "second load")
            elif isinstance(op, Store) and loading:
                order.append("store")
            elif isinstance(op, Done):
                loading.discard(op.id)
            elif op.kind == "abort" and loading:  # cancels the load: no longer in flight
                order.append("abort")
                loading.clear()
            elif isinstance(op, Preempt):
                rooms.add({0: "none", 3: "exact", 2: "short"}[[s.capacity for s in t.header.tiers
                                                               if s.name == "swap"][0]])
        kinds.add(tuple(order))
    # ("load", "load"): the failed load, then the same prompt loaded again once it completed
    assert kinds == {("load", "store"), ("load", "second load"), ("load", "abort"), ("load",),
                     ("load", "load")}
    assert rooms == {"none", "exact", "short"}
    # the swapped sequence: 2B + 2 = 10 tokens, ceil(10 / 4) = 3 blocks; "exact" is a tier of 3
    assert F.blocks_needed(2 * 4 + 2, 4) == 3


def test_tier_lookups_end_at_their_load_or_an_abort_salted_or_not():
    paths = set()
    for t in by_rule("tiers"):
        looked = {}  # seq -> its lookup's salt
        for op in t.ops:
            if op.kind == "lookup":
                looked[op.seq] = op.salt
            elif op.kind in ("load", "abort") and op.seq in looked:
                salt = looked.pop(op.seq)
                assert op.kind == "abort" or op.salt == salt  # the load keys as its lookup did
                paths.add((op.kind, salt))
        assert not looked  # every lookup ends
    # lookup, load, done (unsalted and salted); lookup, then abort before any load
    assert paths == {("load", None), ("load", "s"), ("abort", None)}


def test_a_failed_load_is_loaded_again_from_a_tier_that_keeps_and_one_that_drops():
    seen = set()
    for t in by_rule("tiers"):
        failed = [op.id for op in t.ops if isinstance(op, Done) and not op.ok]
        if not failed:
            assert t.header.tiers[0].failed_load == "keep"  # drop matters only where a load fails
            continue
        loads = [op for op in t.ops if isinstance(op, Load)]
        # the first load fails, the second asks for the same 2B + 1 = 9 token ids; then a store fails
        assert failed[0] == loads[0].id and loads[1].token_ids == loads[0].token_ids
        assert len(loads[0].token_ids) == 2 * 4 + 1 and len(failed) == 2
        seen.add(t.header.tiers[0].failed_load)
    assert seen == {"keep", "drop"}


def test_a_looked_up_load_fails_under_a_tier_that_keeps_and_one_that_drops_salted_or_not():
    seen = set()
    for t in by_rule("lookups"):
        looked = {op.seq: op.salt for op in t.ops if op.kind == "lookup"}
        loads = {op.id: op for op in t.ops if isinstance(op, Load)}
        failed = [loads[op.id] for op in t.ops if isinstance(op, Done) and not op.ok and op.id in loads]
        # the first load is the looked-up one, keyed as its lookup was, and it fails
        assert failed and failed[0].seq in looked and failed[0].salt == looked[failed[0].seq]
        seen.add((looked[failed[0].seq], t.header.tiers[0].failed_load))
    assert seen == {(None, "keep"), (None, "drop"), ("s", "keep"), ("s", "drop")}


def test_a_load_fails_while_another_load_of_its_blocks_reads_them_under_keep_and_drop():
    seen = set()
    for t in by_rule("shared-reads"):
        loads = {op.id: (i, op) for i, op in enumerate(t.ops) if isinstance(op, Load)}
        ends = {op.id: (i, op.ok) for i, op in enumerate(t.ops) if isinstance(op, Done) and op.id in loads}
        failed = [lid for lid, (_, ok) in ends.items() if not ok]
        first = failed[0]
        # another load of the same 2B + 1 = 9 token ids begins before the failure and ends after it, ok
        other = [lid for lid, (i, op) in loads.items() if lid != first and i < ends[first][0] < ends[lid][0]
                 and op.token_ids == loads[first][1].token_ids and ends[lid][1]]
        assert other and len(loads[first][1].token_ids) == 2 * 4 + 1
        seen.add(t.header.tiers[0].failed_load)
    assert seen == {"keep", "drop"}


def test_encodings_are_every_float_format():
    encodings = {F.get_model(t.header.settings["model"]).kv_encoding for t in by_rule("encodings")}
    assert encodings == {"fp8", "fp8-per-token-head", "nvfp4"}


def test_zero_token_operations_come_alone_and_batched_with_and_without_prefix_caching():
    from kvbench.traces.format import op_to_dict
    traces = by_rule("zero")
    assert [t.header.settings["prefix_caching"] for t in traces] == [False, True]
    for t in traces:
        ops = [op_to_dict(o) for o in t.ops]
        assert any(o["op"] == "prefill" and o["tokens"] == 0 for o in ops)
        zero_appends = [o for o in ops if o["op"] == "append" and 0 in o["tokens"]]
        assert any(len(o["seqs"]) == 1 for o in zero_appends)  # alone
        assert any(len(o["seqs"]) > 1 and set(o["tokens"]) != {0} for o in zero_appends)  # beside a writer
        assert any(o["op"] == "fork" for o in ops)
        # the first append of an empty sequence fills a block from nothing: B = 4 tokens
        empties = {o["seq"] for o in ops if o["op"] == "prefill" and o["tokens"] == 0}
        assert any(o["op"] == "append" and o["seqs"][0] in empties and o["tokens"][0] == bd.ZERO_B
                   for o in ops)


def test_compressed_prompts_hits_and_appends_fall_on_and_beside_b_times_r():
    from kvbench.traces.format import op_to_dict
    traces = by_rule("compressed")
    assert [t.header.settings["prefix_caching"] for t in traces] == [True, False]
    assert {t.header.settings["model"] for t in traces} == {"tiny-compressed"}
    S, B, r = 16, bd.COMPRESSED_B, bd.COMPRESSED_R  # 16 = 4 * 4: a compressed block's tokens
    ops = [op_to_dict(o) for o in traces[0].ops]
    prefills = [o["tokens"] for o in ops if o["op"] == "prefill"]
    # T = k * B * r - 1, k * B * r, k * B * r + 1 for k = 1, 2
    assert {S - 1, S, S + 1, 2 * S - 1, 2 * S, 2 * S + 1} <= set(prefills)
    # requests sharing S - 1, S, S + B tokens of a prompt, and one of their own: one more
    assert {S - 1 + 1, S + 1, S + B + 1} <= set(prefills)
    # a fork's appends of 1, r - 1, r and S tokens: across an entry's first token and a block's last
    assert {o["tokens"][1] for o in ops if o["op"] == "append" and len(o["seqs"]) == 2} == {1, r - 1, r, S}
    assert any(o["op"] == "preempt" for o in ops) and any(o["op"] == "accept" for o in ops)
    # the last prompt but one takes the whole pool: ceil(204 / 4) + ceil(204 / 16) = 51 + 13 = 64
    assert prefills[-2] == 204 and traces[0].header.settings["num_blocks"] == 51 + 13


def test_the_default_run_checks_the_boundary_workloads_after_the_committed_ones():
    traces = suite.default_traces()
    names = [t.name for t in traces]
    committed = [p.stem for p in suite.committed_workloads()]
    assert names[:len(committed)] == committed and names[len(committed):] == list(TRACES)
    # the backends limited to a few workloads take the boundaries of their own paths
    entries = registry.entries()
    assert "boundary-rollback-0" in entries["numpy-eagle"].default_workloads
    assert "boundary-encodings-2" in entries["numpy-nvfp4"].default_workloads


def test_the_boundary_traces_are_a_pure_function_of_the_rules():
    again = {t.name: t.to_jsonl() for t in bd.boundary_traces()}
    assert again == {n: t.to_jsonl() for n, t in TRACES.items()}


# --- planted faults, each at its boundary -----------------------------------------------------

# Where each fault must fail, and why there (each step read off the trace's operations):
CATCHES = {
    # boundary-windows-0: B = 4, groups sinks(1, 1), sliding(1), chunked(1), full; one token a
    # step from 1. At 4 tokens (step 3) block 0 lies wholly below the windows (4 - 1 + 1 = 4):
    # sliding(1) and chunked(1) hold no block, full holds ceil(4 / 4) = 1, sinks its sink's
    # ceil(1 / 4) = 1: 2 blocks. Floored, 1 // 4 = 0: the sink's block goes, 1.
    E.SinkBlocksFloored: ("boundary-windows-0", 3, "blocks_used", 1 + 1, 1),
    # Steps 57-60, the case (edge, fork, none kept): 13 prefills 2B = 8 tokens, forks 14,
    # drafts 1 and keeps none: it ends at 8 = 2 * 4, on the edge of block 1, which 14 shares.
    # 2 blocks in use (each counted once); the needless copy makes 3.
    E.RollbackCopiesSharedTail: ("boundary-rollback-0", 60, "blocks_used", 2, 2 + 1),
    # Steps 21-23, the case (block0, none): 5 prefills 1 token, drafts 5, keeps none: 1 token,
    # ceil(1 / 4) = 1 block held; 1 // 4 = 0 releases block 0.
    E.RollbackInFirstBlockDropsIt: ("boundary-rollback-0", 23, "blocks_used", 1, 0),
    # Steps 32-34: 8 writes a prompt of 3B = 12 tokens, a chunk of B - 1 = 3, an append of 6 up
    # to 9 = 2B + 1; 9 asks for the whole prompt: blocks 0 and 1 are complete, block 2 holds 1
    # token. Cached at ceil(9 / 4) = 3, block 2 is hit as if full, its free slots counted as
    # 1 - 4 = -3 (9 - 8 = 1 written of 4).
    E.ChunkAppendCachesPartial: ("boundary-chunks-0", 34, "internal_fragmentation", ">= 0", -3),
    # Steps 0-4: X (8 tokens, 2 blocks) cached at its free; Y (another first block, then X's
    # second block's ids) misses; X again hits its 2 blocks; Y's free leaves its 2 blocks cached.
    # Unchained, Y's second block has the key of X's, which X's block holds: it goes back
    # uncached, 1 of 2.
    E.TokenKeysUnchained: ("boundary-chains-0", 4, "cached_blocks", 2, 1),
    # boundary-hybrid-eviction-0 (w = 1) under LRU: 0 prefilled at step 0, z = 1 at step 1, z
    # decodes at step 2, 0 at step 3: the prefill at step 4 evicts z, the least recent (1), not 0.
    E.GroupsDecodeSkipsClock: ("boundary-hybrid-eviction-0@lru", 4, "victims", [1], [0]),
    # boundary-tiers-0 (store during a load): host (capacity 2) holds the prompt's 2 blocks,
    # both read by the load begun at step 6; the store at step 8 of another 2-block prompt
    # finds no block to evict (refused): host still holds 2 stored; evicting the loads' leaves 0.
    E.TierEvictsLoading: ("boundary-tiers-0", 8, "tier host stored", 2, 0),
    # boundary-tiers-1 (a load failing, room exact, looked up at 6): steps 8-18 fail the load
    # begun at 7, flush the device, load the prompt again and fail a store; 19 prefills
    # 2B + 2 = 10 tokens and 20 swaps them to the swap tier of 3 blocks: ceil(10 / 4) = 3, exactly.
    E.SwapRefusedOnExactFit: ("boundary-tiers-1", 20, "tier swap stored", 3, 0),
    # boundary-zero-0, steps 25-29 (fork, batched): 8 prefills B + 1 = 5 tokens, ceil(5 / 4) =
    # 2 blocks; 9 is empty (none); 10 forks 9, 11 forks 8 (sharing its 2); an append of 0
    # tokens to 10 and 11 writes nothing: still 2 blocks; copying 11's shared tail makes 3.
    E.ZeroAppendCopiesSharedTail: ("boundary-zero-0", 29, "blocks_used", 2, 2 + 1),
}


# Faults whose KV events (SPEC §14) show them before the figures above do, and where.
EVENT_CATCHES = {
    # boundary-chunks-0, steps 16-17 (P = 3B, cut at B + 1 = 5, append to 2B + 1 = 9): the
    # append completes block 1 (stored: ('ids', 7)) and leaves block 2 with 9 - 8 = 1 token of 4;
    # caching at ceil(9 / 4) = 3 announces block 2 too, a key the model never stored.
    E.ChunkAppendCachesPartial: ("boundary-chunks-0", 17, "residency of group 0, tier 0"),
}


def silent(fault):
    """The fault without its KV events: what the figures alone catch."""
    return type(f"Silent{fault.__name__}", (fault,), {"events": Backend.events})


@pytest.mark.parametrize("fault", list(EVENT_CATCHES), ids=lambda f: f.__name__)
def test_a_boundary_fault_its_events_show_fails_there_first(fault):
    workload, step, quantity = EVENT_CATCHES[fault]
    d = check(TRACES[workload], fault(suite.config_for(TRACES[workload]))).divergence
    assert (d.step, d.quantity) == (step, quantity), str(d)


@pytest.mark.parametrize("fault", list(CATCHES), ids=lambda f: f.__name__)
def test_each_boundary_fault_fails_at_its_step(fault):
    workload, step, quantity, expected, actual = CATCHES[fault]
    name, _, policy = workload.partition("@")
    trace = TRACES[name]
    v = check(trace, silent(fault)(suite.config_for(trace, policy=policy or None)))
    d = v.divergence
    assert v.valid is False, workload
    assert (d.step, d.quantity, d.expected, d.actual) == (step, quantity, expected, actual), str(d)
    assert check(trace, NumpyPaged(suite.config_for(trace, policy=policy or None))).valid is True


def test_an_fp8_model_counted_at_its_dtype_fails_at_the_first_prefill():
    t = by_rule("encodings")[0]  # tiny-fp8: 2 layers, 2 heads of 8, 1 byte an element
    assert t.header.settings["model"] == "tiny-fp8"
    v = check(t, E.KvEncodingIgnored(suite.config_for(t)))
    d = v.divergence
    # step 0 prefills 2B + 3 = 19 tokens: ceil(19 / 8) = 3 blocks of 8 slots of 2 (K, V) * 2
    # layers * 2 heads * 8 bytes; counted at bf16's 2 bytes an element, twice that
    assert (d.step, d.quantity, d.expected, d.actual) == (0, "bytes_in_use", 3 * 8 * 2 * 2 * 2 * 8,
                                                          3 * 8 * 2 * 2 * 2 * 8 * 2)
    assert check(t, NumpyPaged(suite.config_for(t))).valid is True


def test_every_boundary_fault_has_its_named_catch():
    assert {f for _, f, _, _ in E.BOUNDARY_BUGS} == set(CATCHES) | {E.KvEncodingIgnored}
