"""scripts/ holds the maintainers' commands the docs and results/ READMEs name: each one starts
(its --help) and imports nothing private of kvbench. What they measure is held elsewhere: the
coverage report by tests/analyses/test_coverage.py, gpu_check.sh by tests/bench/test_gpu_bench.py,
scaling.py's figures by tests/bench/test_scaling_calls.py and test_peak_rss.py."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_starts(script):
    got = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.startswith("usage:"), got.stdout[:200]


def private_imports(source: str) -> list[str]:
    """`from kvbench... import _name` in ``source``: a script leaning on what kvbench may change."""
    return [f"{node.module}.{a.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvbench")
            for a in node.names if a.name.startswith("_")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_imports_nothing_private_of_kvbench(script):
    assert private_imports(script.read_text()) == []


def test_the_private_import_check_can_fail():
    assert private_imports("def f():\n    from kvbench.bench.ratios import _fastest, ratio_gates\n") \
        == ["kvbench.bench.ratios._fastest"]


def test_engine_env_names_its_usage_when_called_without_arguments():
    got = subprocess.run(["bash", "scripts/engine_env.sh"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert got.returncode != 0 and "usage: scripts/engine_env.sh vllm|sglang|dynamo|lmcache DIR" in got.stderr
