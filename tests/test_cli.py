"""The `kvbench` command end to end, in process."""
from pathlib import Path

from kvbench.cli import main

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"


def test_run_on_a_tenant_mix_prints_the_tenant_tables(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main(["run", "--quiet", str(WORKLOADS / "tenant-fractional.jsonl"), "--backend", "numpy",
                 "--output", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "per tenant" in text and "the oracle's replay under each policy" in text
    assert "KV formats for a" in text  # the capacity table
    assert "3 runs: 3 pass, 0 fail, 0 error, 0 n/a" in text  # lru, lfu, fair
    assert out.exists()


def test_check_refuses_a_bad_trace_naming_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kvbench_trace": 1, "family": "t"}\n'
                   '{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 4}\n'
                   '{"step": 1, "op": "append", "seqs": [7], "tokens": [1]}\n')
    assert main(["check", str(bad), "--backend", "numpy"]) == 2
    assert f"{bad}:3: append to unknown sequence 7" in capsys.readouterr().err


def test_list_names_every_builtin(capsys):
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    for name in ("numpy", "numpy-int8", "torch", "contiguous-max", "vllm-blockpool", "python-objects"):
        assert name in text
