"""The workload generators: determinism, canonical files, length laws, the shape of each family."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.traces import canonical as C
from kvbench.traces import laws
from kvbench.traces import generators as g
from kvbench.traces.format import Append, Fork, Free, Prefill, load, loads

WORKLOADS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "workloads")
CANONICAL = {fname: (family, params, seed) for fname, family, params, seed in C.CANONICAL}
BLOCK = 16  # the default run: block_size 16, num_blocks 256, tiny model
DEFAULT_BLOCKS = 256
# Families built at the edge of their own budget (header settings), small and pointed:
# tests/traces/test_edges.py, the isolation family (tests/checking/test_prefix_caching.py) and hybrid decode
# (tests/cli/test_fault_catalogue.py).
EDGE_FAMILIES = {"refusals", "eviction_edges", "wide_forks", "decode_edges", "long_history",
                 "salted_prefixes", "window_decode", "window_hits", "tier_races"}
# Scheduler lifecycles (SPEC §13), as small: tests/checking/test_lifecycles.py, tests/cli/test_fault_catalogue.py.
LIFECYCLE_FAMILIES = {"chunked_prefill", "speculative_forks", "preemption", "swap_preemption"}


def canonical(fname):
    return load(os.path.join(WORKLOADS, fname))


def lengths_over_time(ops):
    """The test's own replay: after each op, {live seq: tokens} (no generator code); a preempted
    sequence is not live until its resume."""
    length, drafted, preempted = {}, {}, {}
    for op in ops:
        if isinstance(op, Prefill):
            length[op.seq] = op.tokens
        elif isinstance(op, Append):
            for i, (s, t) in enumerate(zip(op.seqs, op.tokens)):
                length[s] += t
                drafted[s] = op.draft[i] if op.draft else 0
        elif isinstance(op, Fork):
            length[op.seq] = length[op.src]
        elif op.kind == "accept":
            length[op.seq] -= drafted[op.seq] - op.n
        elif op.kind == "preempt":
            preempted[op.seq] = length.pop(op.seq)
        elif op.kind == "resume":
            length[op.seq] = preempted.pop(op.seq)
        elif isinstance(op, Free):  # an abort too; a store or a completion changes no length
            del length[op.seq]
        yield op, dict(length)


def peak(ops, block=BLOCK):
    return max(sum(math.ceil(t / block) for t in live.values()) for _, live in lengths_over_time(ops))


# --- canonical files ----------------------------------------------------------------------------

def test_write_canonical_regenerates_every_committed_trace_byte_for_byte(tmp_path):
    paths = C.write_canonical(str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == sorted(CANONICAL)
    for fname in CANONICAL:
        with open(os.path.join(WORKLOADS, fname), "rb") as committed, open(tmp_path / fname, "rb") as fresh:
            assert fresh.read() == committed.read(), f"workloads/{fname} differs from write_canonical"


@pytest.mark.parametrize("fname", sorted(CANONICAL))
def test_header_alone_rebuilds_the_trace(fname):
    trace = canonical(fname)
    h = trace.header
    family, _, seed = CANONICAL[fname]
    assert (h.family, h.seed) == (family, seed)
    assert h.generator == f"kvbench.generators.{family} v{g.GENERATOR_VERSION}"
    with open(os.path.join(WORKLOADS, fname), encoding="utf-8") as f:
        assert g.generate(h.family, h.seed, **h.params).to_jsonl() == f.read()


def test_canonical_covers_every_family():
    assert {family for family, _, _ in CANONICAL.values()} == set(g.FAMILIES)


@pytest.mark.parametrize("fname", sorted(f for f, (fam, _, _) in CANONICAL.items()
                                          if fam != "tenant_mixes" and fam not in EDGE_FAMILIES))
def test_non_tenant_traces_fit_the_default_run_without_eviction(fname):
    # upper bound, sharing ignored: sum over live sequences of ceil(T / 16) <= 256 blocks
    assert peak(canonical(fname).ops) <= DEFAULT_BLOCKS


@pytest.mark.parametrize("fname", sorted(CANONICAL))
def test_canonical_traces_are_small_and_end_with_nothing_live(fname):
    ops = canonical(fname).ops
    if CANONICAL[fname][0] == "long_history":
        assert 10_000 <= len(ops) <= 10_100
    else:
        small = CANONICAL[fname][0] in EDGE_FAMILIES | LIFECYCLE_FAMILIES
        assert (40 if small else 100) <= len(ops) <= 400
    _, live = list(lengths_over_time(ops))[-1]
    assert live == {}


# --- determinism and validity -------------------------------------------------------------------

def small_params(family):
    p = next(p for _, fam, p, _ in C.CANONICAL if fam == family)
    return dict(p, num_ops=300) if family == "long_history" else p


@pytest.mark.parametrize("family", list(g.FAMILIES))
def test_same_seed_same_trace_other_seed_other_trace(family):
    p = small_params(family)
    assert g.generate(family, 7, **p).to_jsonl() == g.generate(family, 7, **p).to_jsonl()
    assert g.generate(family, 7, **p).ops != g.generate(family, 8, **p).ops


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), family=st.sampled_from(list(g.FAMILIES)))
def test_every_family_validates_and_frees_everything(seed, family):
    trace = g.generate(family, seed, **small_params(family))
    reloaded = loads(trace.to_jsonl())  # parses and validates every line
    assert reloaded.ops == trace.ops
    assert reloaded.header.seed == seed
    assert [op.step for op in trace.ops] == list(range(len(trace.ops)))
    assert list(lengths_over_time(trace.ops))[-1][1] == {}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), mode=st.sampled_from(["beam", "parallel"]), width=st.integers(2, 5),
       depth_hi=st.integers(0, 20), prune_every=st.integers(1, 5), sub_width=st.integers(1, 3))
def test_fork_trees_validate_over_their_parameters(seed, mode, width, depth_hi, prune_every, sub_width):
    trace = g.generate("fork_trees", seed, mode=mode, num_trees=2, width=width, depth=[0, depth_hi],
                       prune_every=prune_every, sub_width=sub_width)
    assert loads(trace.to_jsonl()).ops == trace.ops
    assert any(isinstance(op, Fork) for op in trace.ops)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), max_batch=st.integers(1, 8), rate=st.floats(0, 3),
       law=st.sampled_from(["alpaca", "fixed", "uniform"]))
def test_decode_streams_validate_over_their_parameters(seed, max_batch, rate, law):
    trace = g.generate("decode_streams", seed, num_requests=10, law=law, max_prompt=128, max_output=64,
                       max_batch=max_batch, arrival_rate=rate)
    assert loads(trace.to_jsonl()).ops == trace.ops
    assert sum(isinstance(op, Prefill) for op in trace.ops) == 10


@pytest.mark.parametrize("family", list(g.FAMILIES))
def test_every_family_runs_on_its_defaults(family):
    for seed in range(3):
        trace = g.generate(family, seed, **({"num_ops": 300} if family == "long_history" else {}))
        assert loads(trace.to_jsonl()).ops == trace.ops


def test_generate_rejects_unknown_family_and_parameter():
    with pytest.raises(ValueError, match="unknown trace family 'forks'.*fork_trees"):
        g.generate("forks")
    with pytest.raises(ValueError, match=r"decode_streams has no parameter\(s\) \['batch'\].*max_batch"):
        g.generate("decode_streams", batch=4)
    with pytest.raises(ValueError, match="unknown length law 'lmsys'"):
        g.generate("prefill_lengths", law="lmsys")
    with pytest.raises(ValueError, match="mean 338.*cannot be clipped to \\[1, 128\\]"):
        g.generate("prefill_lengths", law="sharegpt", max_output=128)
    with pytest.raises(ValueError, match="fork_trees mode must be 'beam' or 'parallel'"):
        g.generate("fork_trees", mode="greedy")


# --- length laws --------------------------------------------------------------------------------

@pytest.mark.parametrize("law, cap, prompt_mean, output_mean", [
    ("sharegpt", 2048, 161, 338),  # PagedAttention paper, section 6.1
    ("alpaca", 2048, 19, 58),
    # 40.25 = 161 * 0.25, 84.5 = 338 * 0.25: the fit keeps the scaled mean under a clip at 128
    ({"name": "sharegpt", "scale": 0.25}, 128, 40.25, 84.5),
])
def test_length_law_sample_means_match_the_published_means(law, cap, prompt_mean, output_mean):
    prompt_law, output_law = laws.request_laws(law, cap, cap)
    rng = np.random.default_rng(0)
    prompts, outputs = prompt_law.sample(rng, 20_000), output_law.sample(rng, 20_000)
    assert prompts.mean() == pytest.approx(prompt_mean, rel=0.03)
    assert outputs.mean() == pytest.approx(output_mean, rel=0.03)
    assert prompts.min() >= 1 and max(prompts.max(), outputs.max()) <= cap


def test_uniform_and_fixed_laws_stay_in_range():
    rng = np.random.default_rng(0)
    p, o = laws.request_laws({"name": "uniform", "prompt": [17, 20], "output": [3, 3]})
    assert set(p.sample(rng, 1000).tolist()) == {17, 18, 19, 20}
    assert set(o.sample(rng, 100).tolist()) == {3}
    p, o = laws.request_laws("fixed")
    assert (p.sample(rng, 5).tolist(), o.sample(rng, 5).tolist()) == ([64] * 5, [32] * 5)


def test_header_names_the_law_and_its_parameters():
    h = canonical("prefill-sharegpt.jsonl").header
    assert h.params["law"] == {"name": "sharegpt", "dist": "lognormal", "prompt_mean": 161,
                               "output_mean": 338, "sigma": 1.0, "scale": 0.25}
    assert (h.params["max_prompt"], h.params["max_output"]) == (128, 128)
    prompts = [op.tokens for op in canonical("prefill-sharegpt.jsonl").ops if isinstance(op, Prefill)]
    assert len(prompts) == h.params["num_requests"] and max(prompts) <= 128


# --- the shape of each family -------------------------------------------------------------------

def test_decode_stream_appends_one_token_to_the_whole_running_batch():
    trace = canonical("decode-stream.jsonl")
    max_batch = trace.header.params["max_batch"]
    joins_while_decoding = 0
    previous = {}
    for op, live in lengths_over_time(trace.ops):
        if isinstance(op, Append):
            assert set(op.seqs) == set(live), f"step {op.step}: append leaves out running sequences"
            assert set(op.tokens) == {1} and len(op.seqs) <= max_batch
        if isinstance(op, Prefill) and op.step > max_batch and previous:
            joins_while_decoding += 1
        previous = live
    appends = [op for op in trace.ops if isinstance(op, Append)]
    assert max(len(op.seqs) for op in appends) == max_batch  # the batch fills up
    assert sum(len(op.seqs) > 1 for op in appends) > len(appends) // 2
    assert joins_while_decoding > 0


def fork_lengths(ops):
    """(fork op, length of its source at the fork, whether the source was itself forked)."""
    forked, out = set(), []
    for op, live in lengths_over_time(ops):
        if isinstance(op, Fork):
            out.append((op, live[op.src], op.src in forked))
            forked.add(op.seq)
    return out


@pytest.mark.parametrize("fname", ["fork-beam.jsonl", "fork-parallel.jsonl"])
def test_fork_trees_fork_at_partial_blocks_and_fork_forks(fname):
    ops = canonical(fname).ops
    forks = fork_lengths(ops)
    roots = {op.seq for op in ops if isinstance(op, Prefill)}
    # the first fork of every tree comes at an odd length: partial tail for block size 16 (and 2, 4, 8 ...)
    root_forks = [t for op, t, _ in forks if op.src in roots]
    assert root_forks and all(t % 2 == 1 for t in root_forks)
    assert sum(t % BLOCK != 0 for _, t, _ in forks) >= len(roots)
    assert any(of_fork for _, _, of_fork in forks), "no fork of a fork"
    # every branch writes after its fork (the copy-on-write) before it is freed
    written = set()
    for op in ops:
        if isinstance(op, Append):
            written.update(op.seqs)
        if isinstance(op, Free):
            assert op.seq in written, f"step {op.step}: seq {op.seq} freed without a write"


def frees_mid_way(ops):
    """Frees after which a sequence live at that moment still appends: pruned / finished early."""
    count, steps = 0, list(lengths_over_time(ops))
    for i, (op, live) in enumerate(steps):
        if isinstance(op, Free) and any(isinstance(o, Append) and set(o.seqs) & set(live)
                                        for o, _ in steps[i + 1:]):
            count += 1
    return count


def test_beam_search_keeps_the_width_and_prunes_mid_way():
    trace = canonical("fork-beam.jsonl")
    width = trace.header.params["width"]
    appends = [op for op in trace.ops if isinstance(op, Append) and len(op.seqs) > 1]
    assert {len(op.seqs) for op in appends} == {width}
    assert frees_mid_way(trace.ops) > 0


def test_parallel_sampling_branches_end_at_their_own_lengths():
    trace = canonical("fork-parallel.jsonl")
    assert frees_mid_way(trace.ops) > 0
    sub = trace.header.params["sub_width"]
    of_forks = [op for op, _, of_fork in fork_lengths(trace.ops) if of_fork]
    assert len(of_forks) == (sub - 1) * trace.header.params["num_trees"]  # 6 = (3 - 1) * 3


def demand_of_one_op(ops):
    return max(sum(math.ceil(live[s] / BLOCK) for s in (op.seqs if isinstance(op, Append) else (op.seq,)))
               for op, live in lengths_over_time(ops) if not isinstance(op, Free))


@pytest.mark.parametrize("fname", ["tenant-flood.jsonl", "tenant-fractional.jsonl", "tenant-late.jsonl"])
def test_tenant_mixes_need_eviction_but_every_op_fits(fname):
    trace = canonical(fname)
    s = trace.header.settings
    assert s["block_size"] == BLOCK
    assert demand_of_one_op(trace.ops) <= s["num_blocks"] < peak(trace.ops)
    assert set(trace.tenant_of().values()) == set(trace.header.tenants)


def test_tenant_weights_are_kept_exactly_as_given():
    assert canonical("tenant-fractional.jsonl").header.tenants == {"a": 0.1, "b": 0.2, "c": 0.3}
    assert canonical("tenant-fractional.jsonl").header.settings["num_blocks"] == 10
    assert canonical("tenant-flood.jsonl").header.tenants == {"heavy": 1, "light": 1}
    assert canonical("tenant-late.jsonl").header.tenants == {"early": 1, "steady": 2, "late": 1}


def test_heavy_tenant_floods_the_light_one():
    count = {}
    for op in canonical("tenant-flood.jsonl").ops:
        if isinstance(op, Prefill):
            count[op.tenant] = count.get(op.tenant, 0) + 1
    assert count["heavy"] >= 4 * count["light"] > 0  # arrival rates 0.9 / 0.1


def test_late_tenant_arrives_after_its_start():
    prefills = [op for op in canonical("tenant-late.jsonl").ops if isinstance(op, Prefill)]
    first_late = next(i for i, op in enumerate(prefills) if op.tenant == "late")
    assert first_late >= 24  # start: 24 requests come before its first
    assert sum(op.tenant == "late" for op in prefills[first_late:]) > 1


def test_tenant_mix_budget_that_would_not_evict_is_rejected():
    p = dict(small_params("tenant_mixes"), num_blocks=10_000)
    with pytest.raises(ValueError, match="num_blocks=10000 must be .* and < .*no eviction"):
        g.generate("tenant_mixes", 0, **p)


@pytest.mark.parametrize("block_size, why", [(2, "block_size must be an integer >= 3"),
                                             (32, "block_size must be below the window \\(32")])
def test_window_decode_refuses_block_sizes_its_steps_cannot_take(block_size, why):
    # tiny-hybrid's window is 32: a prompt of W - B .. W - 1 tokens needs B < 32, a step of
    # 2 .. B - 1 tokens needs B >= 3.
    from kvbench.traces.hybrid import window_decode
    with pytest.raises(ValueError, match=why):
        window_decode(0, block_size=block_size)


@pytest.mark.parametrize("block_size", [3, 16, 31])
def test_window_decode_builds_a_valid_trace_at_every_block_size_it_takes(block_size):
    from kvbench.traces.hybrid import window_decode
    trace = window_decode(0, block_size=block_size)  # validated on build: lengths >= 1
    assert trace.header.settings["block_size"] == block_size
