"""`kvbench serve` with speculative decoding (SPEC §13): drafts, accepts and rollbacks in the
simulation, counted by hand on one request, and the logged trace replayed by the checker."""
from __future__ import annotations

import json

import pytest
from conftest import make_config

from impls.object_model import ObjectModel
from kvbench.analyses import serving as S
from kvbench.checking.checker import check
from kvbench.cli import main as cli_main
from kvbench.contract import registry
from kvbench.contract.protocol import Backend
from kvbench.traces.loaders import Request


def serve(acceptance: float):
    # One request: a prompt of 14 tokens, 10 output tokens (final 24), blocks of 16, 4 drafts.
    return S.simulate([Request(0.0, 14, 10)], "numpy", make_config(block_size=16, num_blocks=8),
                      speculative_k=4, acceptance=acceptance, seed=0)


def accepts(r) -> int:
    return sum(op.kind == "accept" for op in r.trace.ops)


def test_every_draft_rejected():
    r = serve(0.0)
    # The step admitting it, then one token a step, T = 14 .. 23: 1 + 10 steps. Drafts
    # min(4, 24 - T - 1): 4 for T = 14 .. 19, then 3, 2, 1, 0: 6 * 4 + 3 + 2 + 1 = 30 drafted,
    # all rejected, in 9 rollbacks.
    assert (r.steps, r.output_tokens) == (11, 10)
    assert (r.drafted_tokens, r.rejected_tokens, r.rollbacks) == (30, 30, 9)
    assert accepts(r) == 9  # one per step with drafts, T = 14 .. 22
    # Blocks only the drafts took: ceil((T + 1 + 4) / 16) - ceil((T + 1) / 16) = 2 - 1 at
    # T = 14 and 15 (lengths 15 and 16 fit one block), 2 - 2 from T = 16 on: 2, both rolled back.
    assert (r.draft_blocks, r.rollback_blocks) == (2, 2)


def test_every_draft_accepted():
    r = serve(1.0)
    # Admitted, then T = 14: 1 + 4 kept -> 19; T = 19: min(4, 24 - 19 - 1) = 4 drafts, kept
    # -> 24: 1 + 2 steps.
    assert (r.steps, r.output_tokens) == (3, 10)
    assert (r.drafted_tokens, r.rejected_tokens, r.rollbacks) == (8, 0, 0)
    assert accepts(r) == 2
    # ceil(19 / 16) - ceil(15 / 16) = 1 at T = 14, ceil(24 / 16) - ceil(20 / 16) = 0 at T = 19.
    assert (r.draft_blocks, r.rollback_blocks) == (1, 0)


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 1.0])
def test_the_logged_trace_replays_clean(acceptance):
    r = serve(acceptance)
    v = check(r.trace, registry.resolve("numpy").create(r.config), gather="all")
    assert v.valid is True, str(v.divergence)


class NoAccept(ObjectModel):  # a plug-in written before SPEC §13
    name = "no-accept"
    accept = Backend.accept


def test_a_backend_without_accept_is_refused_up_front():
    with pytest.raises(ValueError, match="'no-accept' does not roll back draft tokens"):
        S.simulate([Request(0.0, 14, 10)], NoAccept, make_config(), speculative_k=4)


def test_the_command_reports_blocks_for_drafts_and_rollbacks(tmp_path, capsys):
    # The same request as above, from a lengths file: the record's row has the hand counts.
    csv = tmp_path / "lengths.csv"
    csv.write_text("num_prefill_tokens,num_decode_tokens\n14,10\n")
    code = cli_main(["serve", "--trace", str(csv), "--format", "lengths", "--model", "tiny",
                     "--budget", "8", "--block-size", "16", "--backend", "numpy",
                     "--speculative-k", "4", "--acceptance", "0", "--check", "--quiet",
                     "--output", str(tmp_path / "r.json")])
    assert code == 0  # the logged trace passed the checker
    assert "rollbacks" in capsys.readouterr().out
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert {k: row[k] for k in ("drafted_tokens", "rejected_tokens", "rollbacks", "draft_blocks",
                                "rollback_blocks")} == {"drafted_tokens": 30, "rejected_tokens": 30,
                                                        "rollbacks": 9, "draft_blocks": 2,
                                                        "rollback_blocks": 2}
