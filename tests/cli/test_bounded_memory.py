"""Memory follows the work, not a number in the trace: a prefill of 2**31 tokens is one operation,
and each command that reads it runs in a fixed address space (RLIMIT_AS in the child)."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import default_sigint

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 2 * 2**30  # bytes of address space: the interpreter, numpy and pandas, with room to spare
TOKENS = 2**31  # one list entry a token would be 8 bytes each: 16 GiB of pointers alone


def limited() -> None:
    default_sigint()
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def kvbench(*args, cwd):
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, preexec_fn=limited)


@pytest.fixture
def huge_prefill(tmp_path) -> str:
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"kvbench_trace": 1, "family": "t"}) + "\n"
                    + json.dumps({"step": 0, "op": "prefill", "seq": 0, "tenant": "a",
                                  "tokens": TOKENS}) + "\n")
    return str(path)


def test_run_of_one_huge_prefill_stays_in_bounded_memory(huge_prefill, tmp_path):
    # The default budget (256 blocks of 16) refuses it: the pool and the oracle agree on OOM.
    out = tmp_path / "run.json"
    got = kvbench("run", huge_prefill, "--backend", "numpy", "--quiet", "--output", str(out),
                  cwd=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["status"], row["ooms"]) == ("pass", 1)
    # The KV formats table measures its error on the trace's first 256 tokens, not on all of them.
    assert "error on 256 tokens of huge's K/V" in got.stdout


@pytest.mark.parametrize("command", [["check", "--backend", "numpy"], ["shrink", "--backend", "numpy"],
                                     ["eviction", "--out", "{tmp}"]])
def test_other_commands_of_one_huge_prefill_stay_in_bounded_memory(command, huge_prefill, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    got = kvbench(args[0], huge_prefill, *args[1:], cwd=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
