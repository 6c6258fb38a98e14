"""The edge workloads (kvbench/traces/edges.py) reach the edges they are built for: replayed
through the oracle alone (no backend), each refusal, exact fit and eviction happens where the
generator's arithmetic says it does."""
from __future__ import annotations

import pytest

from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.model.oracle import ModelOOM, Oracle
from kvbench.traces.format import load

WORKLOADS = suite.WORKLOADS_DIR


class Watch(Oracle):
    """The oracle, noting each refused call, each eviction and the figures at their peak."""

    def __init__(self, config):
        super().__init__(config)
        self.refused, self.evicted, self.exact, self.batch_refused = [], [], [], []
        self.depth, self.peak_refs, self.peak_live, self.taken = {}, 0, 0, 0
        self.inside = False

    def _new_block(self, fill, group):
        self.taken += 1
        return super()._new_block(fill, group)

    def _make_room(self, call, protect):
        candidates = self._candidates(protect) if self.config.policy else []
        before = self.blocks_free
        victims = super()._make_room(call, protect)
        if victims:
            self.evicted.append((sorted(candidates), victims, before))
        return victims

    def _watched(self, what, fn, *args, **kw):
        try:
            out = fn(*args, **kw)
        except ModelOOM:
            self.refused.append((what, args, self.blocks_free))
            if what == "append" and len(args[0]) > 2:
                self.batch_refused.append((self.first_two, self.blocks_free))
            raise
        if self.blocks_free == 0:
            self.exact.append((what, args))
        self.peak_refs = max(self.peak_refs, int(self.refs.max()))
        self.peak_live = max(self.peak_live, len(self.seqs))
        return out

    def prefill(self, seq, prompt, *args, **kw):
        if self.inside:
            return super().prefill(seq, prompt, *args, **kw)
        return self._watched("prefill", super().prefill, seq, prompt, *args, **kw)

    def append(self, seqs, tokens, step):
        # what the first two writers alone would take, before the call
        self.first_two = self._append_need(list(seqs)[:2], list(tokens)[:2])
        return self._watched("append", super().append, list(seqs), list(tokens), step)

    def recompute(self, seq, step, protect=()):
        self.inside = True  # its own prefill is not a trace prefill
        try:
            return self._watched("recompute", super().recompute, seq, step, protect)
        finally:
            self.inside = False

    def fork(self, seq, src, final, step):
        self.depth[seq] = self.depth.get(src, 0) + 1
        return self._watched("fork", super().fork, seq, src, final, step)


def replay(name, policy=None):
    trace = load(str(WORKLOADS / name))
    model = Watch(suite.config_for(trace, policy=policy))
    v = check(trace, None, model=model)
    assert v.valid is True
    return trace, model


def test_refusals_refuse_each_kind_of_call_and_fit_exactly():
    trace, m = replay("edge-refusals.jsonl")
    rounds = trace.header.params["rounds"]
    assert (trace.header.settings["block_size"], m.B) == (256, 256)
    # Per round: the 2-block prefill, the batch [b, a1, a], a's extra token, a111's copy, the
    # prefill of b's blocks + 1, the pair of copies.
    assert [w for w, _, _ in m.refused] == ["prefill", "append", "append", "append", "prefill",
                                            "append"] * rounds
    assert all(free in (0, 1) for _, _, free in m.refused[:4])
    # [b, a1, a] refused at its third writer: b (0 blocks) and a1 (its copy) fit the 1 free block.
    assert m.batch_refused == [(0 + 1, 1)] * rounds
    # Exact fits per round: a1's copy into the last block, a's tail filled, c3 taking b's blocks.
    assert sum(w == "prefill" for w, _ in m.exact) >= rounds
    assert sum(w == "append" for w, _ in m.exact) >= 2 * rounds
    assert max(op.tokens for op in trace.ops if op.kind == "prefill") > 16 * 256
    assert max(m.depth.values()) == 3  # a -> a1 -> a11 -> a111


@pytest.mark.parametrize("policy", ["lru", "lfu", "fair"])
def test_eviction_edges_take_every_candidate_and_just_fit(policy):
    trace, m = replay("edge-eviction.jsonl", policy)
    rounds = trace.header.params["rounds"]
    assert m.B == 512
    # Every candidate evicted, and the pool then exactly full: x's append (y1..y3), r (p, q).
    whole = [(c, v) for c, v, _ in m.evicted if sorted(v) == c and len(c) > 1]
    assert len(whole) == 2 * rounds
    # Refused with candidates present (r0: one block short) and a recompute refused (no candidate).
    assert [w for w, _, _ in m.refused] == ["prefill", "recompute"] * rounds
    recomputed = [args[0] for w, args in m.exact if w == "recompute"] + \
        [a[0] for w, a, _ in m.refused if w == "recompute"]
    assert len(set(recomputed)) >= rounds
    if policy != "fair":  # LRU and LFU take u2 (oldest, used once): the need drops to 0 at once
        single = [v for c, v, _ in m.evicted if len(c) == 2 and len(v) == 1]
        assert len(single) == rounds


def test_wide_forks_have_more_than_127_sharers_and_64_live_sequences():
    trace, m = replay("fork-wide.jsonl")
    p = trace.header.params
    sharers = p["width"] + p["depth"] - 1  # 132 = 130 branches + 2 forks of forks
    assert m.peak_refs == sharers > 127 and m.peak_live == sharers > 64
    assert max(m.depth.values()) == p["depth"]
    # The first step over every branch copies the tail for all but the last: the last free block.
    first = next(args for w, args in m.exact if w == "append")
    assert len(first[0]) == sharers
    assert [w for w, _, _ in m.refused] == ["append"]
    assert max(op.tokens for op in trace.ops if op.kind == "prefill") > 16 * 16


@pytest.mark.parametrize("policy", ["lru", "lfu", "fair"])
def test_decode_edges_evict_after_a_wide_step_and_a_fork_and_refuse_a_spill(policy):
    trace, m = replay("edge-decode.jsonl", policy)
    rounds = trace.header.params["rounds"]
    wide = [op for op in trace.ops if op.kind == "append" and len(op.seqs) > 8]
    assert len(wide) == rounds and all(set(op.tokens) == {1} for op in wide)
    # Per round: after the wide step, z (one victim); after the fork, x (which frees nothing:
    # x' shares it) and one more; in the spill, v (the only candidate).
    victims = [len(v) for _, v, _ in m.evicted]
    if policy != "fair":  # Fair takes the over-quota tenant's oldest first: its own counts
        assert victims == [1, 2, 1] * rounds
    assert len(victims) == 3 * rounds
    # The spill: every live sequence decodes one token, k >= 2 tails full (k + 2 writers with g
    # and v), 0 < free <= k - 1: refused with no candidate, once a round.
    spills = [(args, free) for w, args, free in m.refused if w == "append"]
    assert len(spills) == rounds and all(0 < free <= len(args[0]) - 3 for args, free in spills)


def test_long_history_reuses_every_block_many_times():
    trace, m = replay("long-history.jsonl")
    assert len(trace.ops) >= 10_000
    assert m.taken >= 50 * m.config.num_blocks
    assert max(m.depth.values()) == 3
    assert len(m.refused) > 0 and len(m.exact) > 0
    assert max(op.seq for op in trace.ops if op.kind == "prefill") > 1024
    assert suite.config_for(trace).store_kv is False  # its header: ledger-only
    assert suite.config_for(trace, store_kv=True).store_kv is True  # the caller's word first


def test_every_default_backend_passes_the_edge_workloads():
    for name in ("edge-refusals.jsonl", "edge-eviction.jsonl", "fork-wide.jsonl"):
        trace = load(str(WORKLOADS / name))
        for policy in suite.policies_for(trace, "auto")[:1]:
            cfg = suite.config_for(trace, policy=policy)
            for backend in ("numpy", "numpy-int4", "contiguous-oracle"):
                v = check(trace, registry.create(backend, cfg))
                assert v.valid is True, f"{name} {backend}: {v.divergence}"
                assert v.ooms > 0


def test_a_backend_leaking_a_block_on_a_refused_prefill_fails_the_default_run(tmp_path, capsys):
    # `kvbench run` over the committed workloads, as CI runs it, with no trace named.
    from kvbench.cli import main
    out = tmp_path / "r.json"
    code = main(["run", "--backend", "planted:LeaksOnRefusal", "--quiet", "--output", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    fails = [line for line in text.splitlines() if line.startswith("FAIL planted:LeaksOnRefusal")]
    assert any(" on edge-refusals: " in line and "after a refused prefill" in line for line in fails), fails


def test_a_batch_applied_writer_by_writer_fails_naming_a_writer_it_changed():
    from impls.faults_edges import BatchWriterByWriter
    trace = load(str(WORKLOADS / "edge-refusals.jsonl"))
    d = check(trace, BatchWriterByWriter(suite.config_for(trace))).divergence
    a, a1, batch = trace.ops[0], trace.ops[1], trace.ops[4]
    assert batch.seqs == (2, a1.seq, a.seq)  # [b, a1, a]
    assert (d.index, d.quantity) == (4, "blocks_used after a refused append")
    T, n = a.tokens, -(-a.tokens // 256)  # a1 is a's fork: a's prompt, ceil(T / 256) blocks
    # a1's copy-on-write took the one free block; a was refused. Sorted by id, a1 differs first.
    assert d.detail.endswith(f"sequence {a1.seq}: {T} tokens in {n} blocks before, "
                             f"{T + 1} tokens in {n} blocks after")
