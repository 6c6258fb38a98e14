"""scripts/gpu_check.sh on cpu, tiny size, one workload: what a GPU session will get, in seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvbench.bench.gpu import SIZES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "workloads" / "fork-beam.jsonl"


@pytest.fixture(scope="module")
def outdir(tmp_path_factory):
    if not TRACE.exists():
        pytest.skip(f"{TRACE} is not committed")
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable, OUT="")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), "--device", "cpu",
                           "--size", "tiny", "--traces", str(TRACE)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_writes_the_run_and_the_gpu_check_record(outdir):
    assert sorted(p.name for p in outdir.iterdir()) == ["gpu_check-cpu.json", "run-torch-cpu.json"]
    run = json.loads((outdir / "run-torch-cpu.json").read_text())
    assert run["kind"] == "run" and [r["status"] for r in run["rows"]] == ["pass"]


def test_gpu_check_record_has_every_figure(outdir):
    rec = json.loads((outdir / "gpu_check-cpu.json").read_text())
    assert rec["kind"] == "gpu_check"
    assert {"hostname", "torch", "numpy", "device"} <= set(rec["machine"])
    assert {"device", "gpu_name", "torch", "cuda", "model", "block_size"} <= set(rec["params"])
    assert rec["params"]["device"] == "cpu" and rec["params"]["gpu_name"] is None
    by = {}
    for r in rec["rows"]:
        by.setdefault(r["bench"], []).append(r)
    assert set(by) == {"check", "memory", "decode", "bandwidth"}

    assert [(r["workload"], r["status"]) for r in by["check"]] == [("fork-beam", "pass")]

    (mem,) = by["memory"]
    m = SIZES["tiny"]["model"]
    # 262144 = 64 blocks * 16 tokens * 256 B (2 * 2 layers * 2 heads * 16 * 2 B)
    assert mem["formula_pool_bytes"] == 64 * 16 * (2 * m.layers * m.kv_heads * m.head_dim * 2) == 262144
    assert mem["pool_bytes"] == mem["formula_pool_bytes"] and mem["ok"] is True

    impls = {"numpy", "torch-kv=device", "torch-kv=host"}
    batches = SIZES["tiny"]["batches"]
    assert {(r["batch"], r["impl"]) for r in by["decode"]} == {(b, i) for b in batches for i in impls}
    for r in by["decode"]:
        assert r["tokens_per_s"] > 0 and r["write_bytes_per_s"] > 0
        assert (r["torch_vs_numpy"] is None) == (r["impl"] == "numpy")

    assert {(r["what"], r["impl"]) for r in by["bandwidth"]} == {
        ("write", "numpy"), ("gather", "numpy"), ("write", "torch-cpu"), ("gather_tensor", "torch-cpu"),
        ("gather", "torch-cpu")}
    for r in by["bandwidth"]:
        assert r["bytes"] == SIZES["tiny"]["seq_tokens"] * m.bytes_per_token
        assert r["fraction_of_copy"] > 0 and r["copy_bytes_per_s"] > 0


def test_cuda_on_a_machine_without_it_is_refused(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from kvbench.cli.gpu import main
    assert main(["--device", "cuda", "--out", str(tmp_path), "--skip-check"]) == 2
    assert not list(tmp_path.iterdir())


def test_the_old_program_name_says_where_the_program_went(tmp_path):
    # `python -m kvbench.bench.gpu` ran kvbench.cli.gpu's program (an import loop); now it says
    # where the program is and exits 2, writing nothing.
    proc = subprocess.run([sys.executable, "-m", "kvbench.bench.gpu", "--device", "cpu", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "python -m kvbench.cli.gpu" in proc.stderr and not list(tmp_path.iterdir())
