"""The serving simulation: FCFS admission by the backend's own memory, recompute preemption, the
logged trace under the checker, the contiguous baselines' capacity, and the OPT-13B arithmetic."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import backends, make_config

from kvbench.contract.ledger import MEMORY_CATEGORIES
from kvbench.analyses import breakdown as BD
from kvbench.analyses import serving as S
from kvbench.checking.checker import check
from kvbench.cli import main as cli_main
from kvbench.contract import registry
from kvbench.contract.formulas import budget_blocks, get_model
from kvbench.traces.format import Append, Free, Prefill, validate
from kvbench.traces.loaders import Request, load_requests

GiB = 2 ** 30


def replay(result, gather="touched"):
    """The logged trace through the checker on a fresh backend of the same config."""
    fresh = registry.create(result.backend, result.config)
    try:
        return check(result.trace, fresh, gather=gather)
    finally:
        fresh.close()


def mixed_requests(n=24, seed=3):
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(0.1, n))
    prompt = rng.integers(1, 41, n)
    output = rng.integers(0, 25, n)  # 0 included: prefill then free
    return [Request(float(a), int(p), int(o), tenant=f"t{i % 2}")
            for i, (a, p, o) in enumerate(zip(arrival, prompt, output))]


@pytest.mark.parametrize("backend", ["numpy", *backends("contiguous"), "torch"])
def test_logged_trace_passes_the_checker(backend):
    if backend == "torch":
        pytest.importorskip("torch")
    # 96 slots for requests up to 64 tokens: admission blocks and (paged) decode preempts.
    cfg = make_config(block_size=4, num_blocks=24, max_context=64)
    r = S.simulate(mixed_requests(), backend, cfg, max_batch=6, max_steps=40)
    validate(r.trace)
    assert r.trace.header.family == "serving"
    assert r.samples["waiting_for_memory"].any()  # memory, not the batch cap, held requests back
    assert r.admitted == r.finished  # the horizon stops admission; admitted requests finish
    assert r.finished + r.unserved + sum(r.rejected.values()) == 24
    v = replay(r)
    assert v.status == "pass", v.divergence
    assert v.ooms == 0  # refused prefills are retried, never logged
    assert v.ops == len(r.trace)


def test_fcfs_head_of_the_queue_blocks():
    # 8 blocks of 4. r0 takes ceil(20/4) = 5 blocks; r1 needs 4 > 8 - 5 = 3 free and blocks the
    # queue, so r2 (1 block, it would fit) waits behind it. r0 finishes at step 4 (20 + 4 = 24
    # tokens, one per step 1..4) and frees its blocks; r1 and r2 then join in that same step.
    cfg = make_config(block_size=4, num_blocks=8)
    reqs = [Request(0.0, 20, 4), Request(0.0, 16, 4), Request(0.0, 4, 4)]
    r = S.simulate(reqs, "numpy", cfg)
    assert r.admissions == [(0, 0, 0), (4, 1, 1), (4, 2, 2)]
    assert list(r.samples["waiting_for_memory"][:4]) == [True, True, True, True]
    assert replay(r).status == "pass"


def test_fcfs_follows_arrival_time_then_list_order():
    cfg = make_config(block_size=4, num_blocks=64)
    # eligible steps: ceil(1.0 / 0.05) = 20, 0, 0 -> order 1, 2, 0
    reqs = [Request(1.0, 4, 1), Request(0.0, 4, 1), Request(0.0, 4, 1)]
    r = S.simulate(reqs, "numpy", cfg, step_seconds=0.05)
    assert [(step, i) for step, i, _ in r.admissions] == [(0, 1), (0, 2), (20, 0)]
    assert [seq for _, _, seq in r.admissions] == [0, 1, 2]  # ids in admission order


def test_contiguous_max_admits_at_most_slots_over_max_context():
    cfg = make_config(block_size=16, num_blocks=9, max_context=32)
    reqs = [Request(0.0, 8, 8) for _ in range(12)]
    r = S.simulate(reqs, "contiguous-max", cfg)
    assert r.max_running == 4  # 4 = floor(9 * 16 / 32) = floor(144 / 32)
    bd = BD.breakdown(r)
    assert bd["averaged_over"] == "saturated"
    # paper-style: the 16-slot tail (16 = 144 - 4 * 32) cannot take a 32-slot reservation
    assert bd["external_fragmentation"] == pytest.approx(16 / 144)
    assert bd["free"] == 0
    # oracle reservation: exactly the final 16 tokens, floor(144 / 16) = 9 at once
    assert S.simulate(reqs, "contiguous-oracle", cfg).max_running == 9
    assert r.finished == 12 and replay(r).status == "pass"


def test_decode_oom_preempts_the_latest_admitted_and_recomputes():
    # 4 blocks of 4. Two requests of prompt 4 (1 block each), 8 output tokens (final 12 tokens,
    # 3 blocks each: together 6 > 4). Steps 1..4 take them to 8 tokens = 2 blocks each: full.
    # Step 5: both need a 3rd block, none free: seq 1 (admitted last) is preempted, seq 0 grows.
    # seq 0 reaches 12 at step 8 (9, 10, 11, 12 at steps 5..8) and frees 3 blocks; request 1
    # comes back as seq 2 with 8 = 4 + 4 tokens (prompt + generated), then 9..12 at steps 9..12.
    cfg = make_config(block_size=4, num_blocks=4, max_context=16)
    r = S.simulate([Request(0.0, 4, 8), Request(0.0, 4, 8)], "numpy", cfg)
    assert r.preemptions == 1
    assert r.recomputed_tokens == 8  # 8 = 4 prompt + 4 generated before the preemption
    assert r.finished == 2 and r.steps == 13  # steps 0..12
    assert r.admissions == [(0, 0, 0), (0, 1, 1), (8, 1, 2)]
    ops = r.trace.ops
    free1 = next(k for k, op in enumerate(ops) if isinstance(op, Free) and op.seq == 1)
    assert ops[free1 - 1] == Append(free1 - 1, (0, 1), (1, 1))  # the last append that fit
    assert ops[free1 + 1] == Append(free1 + 1, (0,), (1,))  # the retried one, without seq 1
    assert Prefill(12, 2, "default", 8) in ops
    assert list(r.samples["waiting_for_memory"][5:8]) == [True, True, True]
    assert replay(r, gather="all").status == "pass"


def test_requests_that_can_never_run_are_rejected():
    cfg = make_config(block_size=4, num_blocks=2, max_context=16)  # 8 slots
    reqs = [Request(0.0, 12, 0),  # ceil(12 / 4) = 3 blocks > 2: never fits
            Request(0.0, 10, 7),  # 17 tokens > max_context 16
            Request(0.0, 4, 8),  # grows to 8 = 2 blocks, the 9th token needs a 3rd: alone
            Request(0.0, 4, 2)]
    r = S.simulate(reqs, "numpy", cfg)
    assert r.rejected == {"longer than max_context 16": 1, "does not fit in an empty cache": 1,
                          "cannot grow even alone in the cache": 1}
    assert r.finished == 1
    assert replay(r).status == "pass"


def test_bad_requests_and_settings_are_refused_clearly():
    cfg = make_config()
    with pytest.raises(ValueError, match="request 1: prompt_tokens must be >= 1"):
        S.simulate([Request(0.0, 4, 1), Request(0.0, 0, 1)], "numpy", cfg)
    with pytest.raises(ValueError, match="eviction policy"):
        S.simulate([Request(0.0, 4, 1)], "numpy", make_config(policy="lru"))
    with pytest.raises(ValueError, match="max_batch"):
        S.simulate([Request(0.0, 4, 1)], "numpy", cfg, max_batch=0)


def test_opt13b_arithmetic():
    model = get_model("opt-13b")
    assert model.bytes_per_token == 819_200  # 2 * 40 layers * 40 heads * 128 * 2 bytes = 800 KiB
    assert 12 * GiB // model.bytes_per_token == 15_728  # 12 GiB / 800 KiB = 15,728.64
    assert budget_blocks("12GiB", 16, model) == 983  # floor(12 GiB / (16 * 800 KiB)) = floor(983.04)
    cfg = BD.opt13b_config()
    assert cfg.arena_slots == 15_728  # 983 * 16: the byte budget loses no slot to blocks
    assert not cfg.store_kv and cfg.max_context == 2048
    assert 15_728 // 2048 == 7
    r = S.simulate(BD.opt13b_requests(30), "contiguous-max", cfg, max_steps=200)
    assert r.max_running == 7  # 7 = floor(15,728 / 2,048)
    bd = BD.breakdown(r)
    assert bd["steps_averaged"] == 200 and bd["mean_running"] == 7
    # (15,728 - 7 * 2,048) / 15,728 = 1,392 / 15,728 = 8.85%: the leftover too small for a slab
    assert bd["external_fragmentation"] == pytest.approx((15_728 - 7 * 2048) / 15_728)
    assert round(100 * bd["external_fragmentation"], 2) == 8.85


def test_opt13b_requests_fit_the_context_with_sharegpt_means():
    reqs = BD.opt13b_requests(400)
    total = np.array([r.prompt_tokens + r.output_tokens for r in reqs])
    assert total.max() <= 2048 and all(r.arrival == 0 for r in reqs)
    prompt = np.mean([r.prompt_tokens for r in reqs])
    assert 161 * 0.8 < prompt < 161 * 1.2  # ShareGPT: 161 prompt tokens on average


def test_block_hashes_pass_through_into_prefill_ops(tmp_path):
    # Mooncake ids name 512-token blocks; at B = 16 each id becomes 512 / 16 = 32 sub-block ids
    # h * 32 + j, and only full blocks keep one: 600 // 16 = 37 and 530 // 16 = 33.
    path = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]},
            {"timestamp": 10, "input_length": 530, "output_length": 2, "hash_ids": [7, 9]},
            {"timestamp": 20, "input_length": 20, "output_length": 1, "hash_ids": [11]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    want = {0: tuple(range(7 * 32, 7 * 32 + 32)) + tuple(8 * 32 + j for j in range(5)),
            1: tuple(range(7 * 32, 7 * 32 + 32)) + (9 * 32,),
            2: (11 * 32,)}  # 20 // 16 = 1 full block
    cfg = make_config(block_size=16, num_blocks=128, max_context=1024)
    for reqs in (load_requests(path, "mooncake"),  # 512-token ids: the simulation splits them
                 load_requests(path, "mooncake", block_size=16)):
        r = S.simulate(reqs, "numpy", cfg)
        prefills = [op for op in r.trace.ops if isinstance(op, Prefill)]
        assert {op.seq: op.block_hashes for op in prefills} == want
        assert {op.tenant for op in prefills} == {"mooncake"}
        assert replay(r).status == "pass"
    plain = S.simulate([Request(0.0, 40, 1)], "numpy", cfg)
    assert plain.trace.ops[0].block_hashes is None
    # With prefix caching, request 1 (eligible at step ceil(0.010 / 0.05) = 1, while request 0
    # still decodes) finds source block 7, i.e. its 32 sub-blocks, in the cache; 11 is new.
    cached = make_config(block_size=16, num_blocks=128, max_context=1024, prefix_caching=True)
    r = S.simulate(load_requests(path, "mooncake", block_size=16), "numpy", cached)
    assert r.prefix_hit_blocks == 32
    assert replay(r).status == "pass"


def test_breakdown_table_plot_and_cli(tmp_path):
    table, results = BD.run_opt13b(["contiguous-max", "numpy"], num_requests=12, max_steps=50)
    assert list(table["paper_token_states"]) == [0.204, 0.963]
    shares = table[list(MEMORY_CATEGORIES)].sum(axis=1)
    assert np.allclose(shares, 1.0)  # the five categories cover the whole budget
    png = BD.plot_breakdown(table, tmp_path / "b.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv = tmp_path / "lengths.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{p},{o}\n" for p, o in
                                                                   [(30, 10), (50, 0), (12, 40)] * 4))
    code = cli_main(["serve", "--trace", str(csv), "--format", "lengths", "--rate", "50", "--model", "tiny",
                   "--budget", "16", "--block-size", "8", "--backend", "numpy", "--backend",
                   "contiguous-oracle", "--check", "--quiet", "--output", str(tmp_path / "r.json"),
                   "--save-traces", str(tmp_path / "traces")])
    assert code == 0
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["kind"] == "serve" and [row["backend"] for row in rec["rows"]] == ["numpy", "contiguous-oracle"]
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "serving-contiguous-oracle.jsonl", "serving-numpy.jsonl"]


def test_run_with_serving_options_serves_and_says_the_command_moved(tmp_path, capsys):
    csv = tmp_path / "lengths.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n30,10\n12,40\n")
    args = ["--trace", str(csv), "--format", "lengths", "--model", "tiny", "--budget", "16",
            "--block-size", "8", "--backend", "numpy", "--quiet"]
    with pytest.warns(FutureWarning, match="`kvbench run --trace` is `kvbench serve --trace` now"):
        assert cli_main(["run", *args, "--output", str(tmp_path / "old.json")]) == 0
    assert cli_main(["serve", *args, "--output", str(tmp_path / "new.json")]) == 0
    rows = [json.loads((tmp_path / f"{n}.json").read_text())["rows"] for n in ("old", "new")]
    assert [r["backend"] for r in rows[0]] == [r["backend"] for r in rows[1]] == ["numpy"]
    assert cli_main(["serve"]) == 2  # nothing to serve
    assert "give --trace PATH --format F, or --scenario opt13b" in capsys.readouterr().err


def test_cli_scenario_writes_the_paper_files(tmp_path, capsys):
    code = cli_main(["serve", "--scenario", "opt13b", "--max-requests", "20", "--max-steps", "100", "--backend",
                   "contiguous-max", "--quiet", "--paper-out", str(tmp_path / "paper"),
                   "--output", str(tmp_path / "r.json")])
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "paper").iterdir()) == [
        "breakdown.csv", "breakdown.md", "breakdown.png"]
    md = (tmp_path / "paper" / "breakdown.md").read_text()
    assert "| contiguous-max | Orca (Max) | 20.4% |" in md
    assert "8.9%" in md  # 1,392 / 15,728 external fragmentation of `max`
