"""The README and the pages under docs/: every relative link names a file that exists, every page
is reachable from the README, the README keeps the two commands CI reads, and every command they
show runs on a scratch copy of the repository and leaves its `git status` clean."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page):
    fence = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # code spans are not links
            if not re.match(r"[a-z]+:|#", target):
                yield number, target.split("#")[0]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_names_a_file_that_exists(page):
    broken = [f"{page.name}:{n}: {t}" for n, t in relative_links(page) if not (page.parent / t).exists()]
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t).resolve() for _, t in relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_readme_keeps_the_run_and_the_test_command_between_their_markers():
    readme = (ROOT / "README.md").read_text()
    for marker in ("run-command", "test-command"):
        block = re.search(rf"<!-- {marker} -->\n```\n(.+)\n```\n<!-- /{marker} -->", readme)
        assert block and block.group(1).startswith("python3 -m venv .venv"), marker


# --- every command the README and docs show, run on a scratch copy ------------------------------
#
# A command is a line of a fenced block that starts as a shell command does (kvbench, python,
# scripts/, asv, ...; a trailing backslash continues it, a `#` comment ends it), or a code span
# in the prose that is a kvbench command with arguments (`kvbench check TRACE --keep-going`;
# a bare `kvbench run` names the command, and the fenced blocks run it). Each runs, as
# written but for the placeholders below, in a copy of this tree committed to a scratch git
# repository: it must exit as documented, and `git status --porcelain` must be empty after it (a
# documented command never rewrites a tracked file, nor leaves a file git would see). Commands
# that cannot run here are listed in EXCLUDED with the reason.

COMMAND = re.compile(r"(?:[A-Z_]+=\S*\s+)*(?:(?:kvbench|python3?|asv|ray|git|nice)\s|"
                     r"(?:\.venv|\$[A-Z]+|/work/[\w-]+)/bin/|scripts/\S+)|[A-Z_]+=\S*$")


def shell_commands(page):
    """(line, command) of each command in ``page``'s fenced blocks."""
    fence, pending = False, None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence or (pending is None and not COMMAND.match(line)):
            continue
        start, text = pending if pending else (number, "")
        text = f"{text} {line.strip()}"
        if text.endswith("\\"):
            pending = (start, text[:-1])
            continue
        pending = None
        yield start, re.sub(r"\s+", " ", re.sub(r"\s#\s.*$", "", text)).strip()


def prose_commands(page):
    """(line, command) of each `kvbench SUBCOMMAND ARG...` code span outside the fenced blocks."""
    fence = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if not fence:
            for span in re.findall(r"`(kvbench [a-z-]+ [^`]+)`", line):
                yield number, span


ALL_COMMANDS = [(f"{p.relative_to(ROOT).as_posix()}:{n}", c) for p in PAGES
                for scan in (shell_commands, prose_commands) for n, c in scan(p)]

ASV = "asv builds a virtualenv per commit (pip, network) and times the suite: a pinned machine's job"
RAY = "needs a Ray cluster started by `ray start` (and a cloud bucket for s3:// / gs:// stores)"
RATIO_GATES = ("runs the timed ratio gates, which CI does not run (README); "
               "tests/bench/test_gates.py runs the exact gates")
MEASURES = ("times this machine and records it into the committed results/scaling/ on purpose "
            "(a maintainer's measurement, minutes to half an hour)")
EXCLUDED = {
    "kvbench gates": RATIO_GATES,
    "kvbench gates --update": RATIO_GATES + " (and --update rewrites results/gates/ on purpose)",
    "kvbench gates --skip-exact": RATIO_GATES,
    "kvbench faults": "plants each catalogued fault and replays the default suite for each (about 100 s "
                      "of CPU); tests/cli/test_fault_catalogue.py runs the catalogue",
    "kvbench sweep results/sweeps/block-budget/grid.toml":
        "540 cells, about 3 minutes on 2 cores; `kvbench sweep GRID` runs a 12-cell cut of the same "
        "grid, named the same, through the same code and charts",
    "kvbench fuzz --backend B --minutes 5": "runs five minutes by design; docs/fuzzing.md's "
                                             "--max-histories line runs the same campaign",
    "kvbench fuzz --backend numpy --minutes 5 --seed 0 --out /tmp/fuzz": "the same five minutes",
    "kvbench results fuzz --rows backend --metric findings --agg sum":
        "reads the cell the --store line above it writes, which the module's order may run later; "
        "tests/cli/test_cli.py runs the two in order",
    "kvbench run --backend torch --output results/runs/torch-cpu.json":
        "torch over every workload (tens of seconds of CPU); tests/impls hold torch to numpy op by op",
    'scripts/gpu_check.sh "$OUT"': "needs a CUDA machine",
    "kvbench compare results/runs/torch-cpu.json results/runs/gpu/run-torch-cuda.json":
        "compares with a CUDA machine's record",
    "kvbench compare results/runs/cpu-check/gpu_check-cpu.json results/runs/gpu/gpu_check-cuda.json":
        "compares with a CUDA machine's record",
    ".venv/bin/pip install -e '.[bench]'": ASV, "PATH=$PWD/.venv/bin:$PATH": ASV,
    "asv machine --yes": ASV, "asv run --quick HEAD~5..HEAD": ASV, "asv run HEAD~5..HEAD": ASV,
    "asv run -b 'Waste|BlocksInUse|QuantError' HEAD~20..HEAD": ASV, "python -m kvbench.bench.dashboard && asv preview":
        ASV + "; tests/bench/test_dashboard.py publishes a history and opens it in Chromium",
    "asv compare HEAD~1 HEAD": ASV, "asv continuous HEAD^ HEAD --factor 1.2": ASV,
    ".venv/bin/pip install uv && .venv/bin/uv pip compile pyproject.toml --extra test --extra torch "
    "--extra ray -c requirements/cpu-torch.txt --find-links /opt/wheels --python-version 3.11 --upgrade "
    "-o requirements/test.txt": "rewrites the committed lock on purpose, from the index's newest releases "
                                "(tests/test_ci.py holds the lock to pyproject's ranges)",
    "python scripts/scaling.py --breakdown": MEASURES,
    "python scripts/scaling.py --draw": "redraws the committed results/scaling/curve.png on purpose: the "
                                        "same bytes only under the matplotlib and FreeType that drew it",
    ".venv/bin/python benchmarks/shrink_deep.py": "shrinks a failure at step 51,031 of a long trace "
                                                  "(minutes, docs/shrinking.md)",
    "ray start --head --port=6379": RAY, "ray start --address=HEAD_IP:6379": RAY,
    "kvbench sweep GRID --executor ray --address auto": RAY,
    "kvbench sweep GRID --executor ray --address auto --store s3://bucket/kvbench/store": RAY,
    "kvbench sweep GRID --executor ray --address ray://HEAD_IP:10001 --ship-code --store gs://...": RAY,
    "kvbench results --store s3://bucket/kvbench/store": RAY,
    "kvbench gates --factor F": RATIO_GATES,
    "kvbench gates --skip-ratios": "the exact gates replay every gated workload (tens of seconds); "
                                   "tests/bench/test_gates.py runs them",
    "kvbench faults --markdown docs/faults.md": "the fault catalogue again (about 100 s of CPU): "
                                                "tests/cli/test_fault_catalogue.py holds the page to it",
    "kvbench run --trace": "names an option (deprecated), not a command to run",
    "kvbench run --backend my-pool": "needs the plug-in package installed, with its entry point",
}
# Commands whose placeholder needs a particular kind of input.
FILLED = {"kvbench eviction TRACE": "kvbench eviction workloads/tenant-flood.jsonl",
          "kvbench check NAME.min.jsonl --backend B": "kvbench check workloads/edge-decode.jsonl --backend B",
          "kvbench gen --family fork_trees --seed 7 --out t.jsonl":
              "kvbench gen --family fork_trees --seed 7 --out /tmp/t.jsonl"}
# Commands in an engine's own environment (vLLM, SGLang or LMCache: scripts/engine_env.sh, opt-in).
ENGINE_COMMAND = re.compile(r"(?:\S+=\S+ )*(?:\$[VS]/bin/|scripts/engine_env\.sh |[VS]=|"
                            r"(?:python3 -m venv )?/work/lmcache-env|"
                            r".* --backend (?:vllm|sglang|lmcache)-?)")
# The README's run and test commands (between their markers: .ci/run reads the second) set up a
# venv with pip (network); the first is then the default run, a minute of CPU, whose parts run
# here on single workloads; the second is the test suite, this test among it.
SETUP_COMMAND = re.compile(r"python3 -m venv \.venv && ")
# Exit statuses other than 0 that a page documents: the planted fault is found (docs/fuzzing.md).
EXIT = {"kvbench fuzz --backend impls.faults:NoCopyOnWrite --max-histories 100 --first": 1}

# A tiny grid named as the committed block-budget one: 2 x 2 x 2 paged cells + 2 x 2 contiguous.
GRID = """name = "block-budget"
backends = ["numpy", "python-objects"]
[[traces]]
workload = "fork-beam"
[settings]
block_size = [16, 32]
budget = ["8KiB", "16KiB"]
policy = "none"
store_kv = false
gather = "none"
[[include]]
backend = ["contiguous-pow2", "contiguous-oracle"]
block_size = 16
"""
# A correct pool under an ad hoc name, for the docs' my_pkg.pool:MyPool.
MY_POOL = "from impls.numpy_paged import NumpyPaged as MyPool  # noqa: F401\n"


def substituted(command: str, scratch: Path) -> str:
    """``command`` with its placeholders filled: T a Mooncake trace, TRACE a workload, B a backend,
    GRID a grid, A.json / B.json two records, OLD the store's code version; [optional] parts
    dropped; /tmp/ a scratch folder."""
    command = FILLED.get(command, command)
    fill = {"T": "../shared/traces/mooncake/synthetic_trace.jsonl", "TRACE": "workloads/fork-beam.jsonl",
            "B": "numpy", "GRID": str(scratch.parent / "grid.toml"),
            "A.json": str(scratch.parent / "A.json"), "B.json": str(scratch.parent / "B.json")}
    command = re.sub(r"\s*\[[^\]]*\]", "", command).replace("/tmp/", f"{scratch.parent}/out/")
    command = command.replace("host=N,disk=M", "host=64,disk=512")
    command = command.replace("@OLD", "@" + (scratch.parent / "code").read_text().strip()[:12])
    return " ".join(fill.get(word, word) for word in command.split(" "))


def mooncake_rows(n: int) -> str:
    """``n`` requests of one to four 512-token blocks, each starting with the same first block
    (Mooncake's synthetic trace has the same shape, 3,993 requests of up to 80 blocks; an id
    names a block with its prefix, so it stands at one position)."""
    rows, next_id = [], 1
    for i in range(n):
        blocks = 1 + i % 4
        ids = [0] + list(range(next_id, next_id + blocks - 1))
        next_id += blocks - 1
        rows.append(json.dumps({"timestamp": 100 * i, "input_length": 512 * blocks - 17 * (i % 3),
                                "output_length": 4 + i % 5, "hash_ids": ids}))
    return "\n".join(rows) + "\n"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A copy of this tree (tracked files and untracked ones git does not ignore) committed to a
    new repository; beside it small stand-ins for ../shared/traces, the docs' plug-in, the grid,
    and `kvbench` / `python` on PATH. The tiny sweep runs once first (`kvbench results
    block-budget` reads it)."""
    if shutil.which("git") is None or subprocess.run(["git", "rev-parse"], cwd=ROOT,
                                                     capture_output=True).returncode:
        pytest.skip("needs git and a git checkout (the copy is of the files git tracks)")
    base = tmp_path_factory.mktemp("docs")
    repo = base / "repo"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    git = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(base)}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "scratch"]):
        subprocess.run(["git", *args], cwd=repo, env={**os.environ, **git}, check=True)
    traces = base / "shared" / "traces"
    (traces / "mooncake").mkdir(parents=True)
    (traces / "mooncake" / "synthetic_trace.jsonl").write_text(mooncake_rows(24))
    (traces / "azure-llm-2023").mkdir()
    (traces / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
            f"2023-11-16 18:15:{i:02d}.1000000,{100 + 37 * i},{5 + i % 7}\n" for i in range(30)))
    (base / "plugins" / "my_pkg").mkdir(parents=True)
    (base / "plugins" / "my_pkg" / "__init__.py").write_text("")
    (base / "plugins" / "my_pkg" / "pool.py").write_text(MY_POOL)
    (base / "grid.toml").write_text(GRID)
    for name, blocks in (("A", 9), ("B", 12)):  # two result records of one workload
        (base / f"{name}.json").write_text(json.dumps(
            {"kind": "run", "machine": {}, "commit": name, "created": "2026-01-01T00:00:00+00:00",
             "rows": [{"workload": "fork-beam", "backend": "numpy", "policy": "-", "peak_blocks": blocks}]}))
    (base / "out").mkdir()
    bin_dir = base / "bin"
    bin_dir.mkdir()
    for name, target in (("kvbench", f'"{sys.executable}" -m kvbench.cli'),
                         ("python", f'"{sys.executable}"'), ("python3", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, **git, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": f"{repo}{os.pathsep}{base / 'plugins'}", "KVBENCH_CACHE": str(base / "cache"),
           "MPLBACKEND": "Agg"}
    env.pop("OUT", None)
    sweep = run_in(repo, env, f"kvbench sweep {base / 'grid.toml'} --quiet")
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    assert git_status(repo) == "", "the tiny sweep changed the tree"
    code = run_in(repo, env, "python -c 'from kvbench.bench.grid import code_version; "
                             "print(code_version()[\"code\"])'")
    (base / "code").write_text(code.stdout)
    return repo, env


def git_status(repo) -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout


def run_in(repo, env, command):
    return subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)


def test_every_documented_command_is_run_or_excluded_with_a_reason():
    documented = {c for _, c in ALL_COMMANDS}
    assert not set(EXCLUDED) - documented, f"excluded but in no page: {set(EXCLUDED) - documented}"
    assert not set(EXIT) - documented, f"an exit status for a command in no page: {set(EXIT) - documented}"
    assert not set(FILLED) - documented, f"filled but in no page: {set(FILLED) - documented}"
    assert len(documented) > 40, "the command scan is broken"


RUN = list({FILLED.get(c, c): (where, c) for where, c in reversed(ALL_COMMANDS)  # each once, at its first place
             if c not in EXCLUDED and not ENGINE_COMMAND.match(c) and not SETUP_COMMAND.match(c)}.values())[::-1]


@pytest.mark.parametrize("where, command", RUN, ids=[w for w, _ in RUN])
def test_a_documented_command_runs_and_leaves_git_status_clean(scratch, where, command):
    repo, env = scratch
    done = run_in(repo, env, substituted(command, repo))
    assert done.returncode == EXIT.get(command, 0), f"{where}: {command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    status = git_status(repo)
    assert status == "", f"{where}: {command} left:\n{status}"
