"""`kvbench serve` with a token budget per step (chunked prefill, SPEC §13): the decode step's
tokens first, then the chunks of prompts in progress, then admission with what is left; the
steps and chunks counted by hand, and the logged trace replayed by the checker; and the order
in which a step that does not fit picks the sequence it preempts."""
from __future__ import annotations

import json

import pytest
from conftest import make_config

from kvbench.analyses import serving as S
from kvbench.checking.checker import check
from kvbench.cli import main as cli_main
from kvbench.contract import registry
from kvbench.traces.loaders import Request


def serve(requests, budget, **kw):
    return S.simulate(requests, "numpy", make_config(block_size=16, num_blocks=16), seed=0,
                      token_budget=budget, **kw)


def test_one_prompt_in_chunks_of_the_budget_then_decoded():
    r = serve([Request(0.0, 40, 3)], 16)
    # steps 0, 1, 2 write 16 + 16 + 8 = 40 prompt tokens; steps 3, 4, 5 decode 1 each: 6 steps
    assert (r.steps, r.prompt_tokens, r.output_tokens, r.finished) == (6, 40, 3, 1)
    assert (r.chunked_prompts, r.prompt_chunks) == (1, 2)  # one prompt, 2 chunks after its first
    assert r.throughput()["tokens_per_step"] == (40 + 3) / 6
    prefill = r.trace.ops[0]
    assert (prefill.tokens, prefill.prompt_tokens) == (16, 40)
    whole = serve([Request(0.0, 40, 3)], None)  # no budget: step 0 prefills 40, 3 decode steps
    assert (whole.steps, whole.chunked_prompts) == (4, 0)


def test_the_decode_step_comes_first_and_the_last_prompt_gets_what_is_left():
    r = serve([Request(0.0, 20, 4), Request(0.0, 30, 2)], 24)
    # step 0: A's 20 whole, 24 - 20 = 4 left: B's first chunk of 4;
    # step 1: A decodes 1, B's chunk min(23, 30 - 4) = 23 (27 written);
    # step 2: A decodes 1, B's chunk min(23, 3) = 3: complete;
    # steps 3, 4: both decode (A's 3rd and 4th, B's 1st and 2nd): 5 steps
    assert (r.steps, r.finished, r.output_tokens) == (5, 2, 4 + 2)
    assert (r.chunked_prompts, r.prompt_chunks) == (1, 2)
    assert [(op.kind, op.seqs, op.tokens) for op in r.trace.ops if op.kind == "append"][:4] == [
        ("append", (0,), (1,)), ("append", (1,), (23,)), ("append", (0,), (1,)), ("append", (1,), (3,))]


@pytest.mark.parametrize("budget", [1, 7, 24, 64])
def test_the_logged_trace_replays_clean(budget):
    reqs = [Request(0.0, p, o) for p, o in ((40, 3), (20, 9), (30, 2), (70, 5))]
    r = serve(reqs, budget, speculative_k=2, acceptance=0.5)
    assert r.finished == len(reqs)
    v = check(r.trace, registry.resolve("numpy").create(r.config), gather="all")
    assert v.valid is True, str(v.divergence)


def test_a_budget_of_no_tokens_is_refused():
    with pytest.raises(ValueError, match="token_budget must be an integer >= 1 or None, got 0"):
        serve([Request(0.0, 40, 3)], 0)


def test_the_command_reports_the_chunks(tmp_path, capsys):
    csv = tmp_path / "lengths.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n40,3\n")
    code = cli_main(["run", "--trace", str(csv), "--format", "lengths", "--model", "tiny",
                     "--budget", "16", "--block-size", "16", "--backend", "numpy",
                     "--token-budget", "16", "--check", "--quiet", "--output", str(tmp_path / "r.json")])
    assert code == 0  # the logged trace passed the checker
    assert "prompt_chunks" in capsys.readouterr().out
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert (row["steps"], row["chunked_prompts"], row["prompt_chunks"]) == (6, 1, 2)


# --- the preemption victim ---------------------------------------------------------------------

@pytest.mark.parametrize("victim, preempted", [("newest", 1), ("fewest-output", 0)])
def test_the_victim_order_names_the_sequence_preempted(victim, preempted):
    # 4 blocks of 16: A (32 tokens, 2 blocks) and B (17 tokens, 2 blocks) fill them at step 0.
    # Step 1: A's token needs a fifth block (32 + 1 > 2 * 16), B's fits its tail: out of memory.
    # newest: B (admitted last); fewest-output: both generated 0, A's prompt is the longer.
    r = S.simulate([Request(0.0, 32, 20), Request(0.0, 17, 20)], "numpy",
                   make_config(block_size=16, num_blocks=4), victim=victim)
    first_free = next(op for op in r.trace.ops if op.kind == "free")
    assert first_free.seq == preempted and r.preemptions >= 1
    v = check(r.trace, registry.resolve("numpy").create(r.config), gather="all")
    assert v.valid is True, str(v.divergence)


@pytest.mark.parametrize("swap_blocks, swapped, recomputed", [(2, 1, 0), (1, 0, 17)])
def test_preemption_by_swap_moves_the_victims_blocks_to_the_host_tier(swap_blocks, swapped, recomputed):
    # As above: step 1 does not fit and B (17 tokens, ceil(17 / 16) = 2 blocks), admitted last,
    # is preempted. A host tier of 2 blocks holds them: swapped out, and back (no token computed
    # again) once A (32 + 20 = 52 tokens) is freed at step 20; of 1 block it cannot: B is freed
    # and its resume recomputes its 17 tokens. B then decodes 20 tokens: steps 21 .. 40.
    r = S.simulate([Request(0.0, 32, 20), Request(0.0, 17, 20)], "numpy",
                   make_config(block_size=16, num_blocks=4), preemption="swap", swap_blocks=swap_blocks)
    assert (r.preemptions, r.swapped_out, r.swapped_in, r.recomputed_tokens) == (1, swapped, swapped, recomputed)
    assert (r.steps, r.finished) == (41, 2)
    assert [op.kind for op in r.trace.ops if op.kind in ("preempt", "resume")] == ["preempt", "resume"]
    v = check(r.trace, registry.resolve("numpy").create(r.config), gather="all")
    assert v.valid is True, str(v.divergence)
    assert v.recomputed_tokens == recomputed


def test_swap_needs_a_backend_that_swaps():
    with pytest.raises(ValueError, match="'python-objects' does not preempt by swap"):
        S.simulate([Request(0.0, 32, 2)], "python-objects", make_config(), preemption="swap",
                   swap_blocks=2)
