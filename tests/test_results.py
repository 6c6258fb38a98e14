"""results/ holds what a command regenerates: at most 100 tracked files, each named in its
folder's README (or the nearest one above it under results/) in a `| file | command |` table row beside the command
that makes it. Campaign outputs go to the results store or stay out of the repository."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
MAX_FILES = 100
# A code span that runs something: kvbench, a python (any env's), a script of scripts/, maybe
# under nice or with environment assignments before it.
COMMAND = re.compile(r"`(?:[A-Z_]+=\S+ )*(?:nice -n \d+ )?(?:kvbench |python |\S*/bin/(?:python|kvbench) |scripts/)[^`]*`")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if line]


def table(readme: Path) -> dict[str, str]:
    """The README's `| `file` | ... |` rows: file (relative to the README's folder) -> the rest."""
    rows = {}
    for line in readme.read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def by_readme(files: list[str]) -> dict[str, list[str]]:
    """Each tracked file under the nearest folder above it (results/ excluded) whose README.md is
    tracked: that folder -> its files, relative to it (None: no README above the file)."""
    readmes = {f.rsplit("/", 1)[0] for f in files if f.endswith("/README.md")}
    out: dict[str, list[str]] = {}
    for f in files:
        if f.endswith("/README.md"):
            continue
        folder = f.rsplit("/", 1)[0]
        while folder not in readmes and folder.count("/"):
            folder = folder.rsplit("/", 1)[0]
        key = folder if folder in readmes else None
        out.setdefault(key, []).append(f[len(folder) + 1:] if key else f)
    return out


def test_results_holds_at_most_100_files():
    files = tracked()
    assert len(files) <= MAX_FILES, (
        f"results/ holds {len(files)} tracked files, more than {MAX_FILES}: campaign outputs go to "
        "the results store (kvbench sweep) or out of the repository")


def test_each_result_is_named_beside_the_command_that_makes_it():
    files = tracked()
    groups = by_readme(files)
    problems = [f"{f}: no README.md in its folder or above it (under results/) names it"
                for f in groups.pop(None, [])]
    for folder, names in sorted(groups.items()):
        rows = table(ROOT / folder / "README.md")
        for f in names:
            if f not in rows:
                problems.append(f"{folder}/README.md: no `| `{f}` | command |` row")
            elif not COMMAND.search(rows[f]):
                problems.append(f"{folder}/README.md: the row of {f} names no command "
                                "(a code span running kvbench, python or scripts/)")
    for f in files:
        if f.endswith("/README.md"):
            folder = f.rsplit("/", 1)[0]
            # A row naming something else (a backend, a label) has no dot: only file names are held.
            problems += [f"{f}: row `{name}` names a file the tree does not hold"
                         for name in table(ROOT / f) if "." in name and f"{folder}/{name}" not in files]
    assert not problems, "\n".join(problems)


def test_the_table_check_can_fail(tmp_path):
    # The parser itself: a file left out of the table, and a row without a command, are both seen.
    readme = tmp_path / "README.md"
    readme.write_text("| file | command |\n|---|---|\n| `a.csv` | `python scripts/x.py` |\n"
                      "| `b.csv` | by hand |\n")
    rows = table(readme)
    assert set(rows) == {"a.csv", "b.csv"}
    assert COMMAND.search(rows["a.csv"]) and not COMMAND.search(rows["b.csv"])
