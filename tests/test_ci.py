"""CI: the README's test command, which .ci/run runs, installs requirements/test.txt, a lock in
which each dependency that pyproject.toml names for kvbench and its test, torch and ray extras is
pinned with ``==`` at a version inside pyproject's range, and the README says how to refresh it:
so a new release elsewhere cannot turn the tests red, nor the lock fall behind pyproject unseen.
.ci/run fails when the command does, and pytest finds every test module."""
from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "test.txt"
EXTRAS = ("test", "torch", "ray")  # those the test command installs: `.[test,torch,ray]`


def lock_pins() -> dict[str, Requirement]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            pins[canonicalize_name(r.name)] = r
    return pins


def pinned_version(r: Requirement) -> str | None:
    """The version of an ``==`` pin, else None."""
    specs = list(r.specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None


def lock_environment() -> dict:
    """The markers' environment the lock was compiled for (its header's --python-version)."""
    header = LOCK.read_text().split("\n", 3)[:3]
    version = re.search(r"--python-version (\S+)", "\n".join(header)).group(1)
    return {"python_version": version, "python_full_version": f"{version}.0", "extra": ""}


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *(r for e in EXTRAS for r in extras[e])]]


def test_every_line_of_the_lock_is_an_exact_pin():
    loose = [str(r) for r in lock_pins().values() if pinned_version(r) is None]
    assert not loose, f"{LOCK.name} pins these loosely: {loose}"


def test_the_lock_pins_each_declared_dependency_within_its_range():
    pins, env = lock_pins(), lock_environment()
    missing, outside = [], []
    for r in declared():
        if r.marker is not None and not r.marker.evaluate(env):
            continue  # e.g. tomli, for Pythons before the lock's
        pin = pins.get(canonicalize_name(r.name))
        if pin is None:
            missing.append(str(r))
        elif not r.specifier.contains(pinned_version(pin), prereleases=True):
            outside.append(f"{r} (locked {pinned_version(pin)})")
    refresh = "refresh it with the command under the README's test command"
    assert not missing, f"pyproject.toml names these, {LOCK.name} does not ({refresh}): {missing}"
    assert not outside, f"{LOCK.name} pins these outside pyproject.toml's range ({refresh}): {outside}"


def test_the_lock_holds_what_its_installed_packages_require():
    """Checked on the packages installed here at their locked version (all of them, in the venv
    the test command makes): a dependency left out of the lock would be installed at whatever
    release is newest."""
    pins, env = lock_pins(), lock_environment()
    checked, left_out = 0, []
    for name, pin in pins.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if canonicalize_name(dist.version) != canonicalize_name(pinned_version(pin)):
            continue
        checked += 1
        for text in dist.requires or ():
            r = Requirement(text)
            if (r.marker is None or r.marker.evaluate(env)) and canonicalize_name(r.name) not in pins:
                left_out.append(f"{r.name} (for {name})")
    assert checked, "no package of the lock is installed here at its locked version"
    assert not left_out, f"{LOCK.name} leaves out: {sorted(set(left_out))}"


def test_the_readme_test_command_installs_the_lock_and_says_how_to_refresh_it():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"<!-- test-command -->\n```\n(.+)\n```\n<!-- /test-command -->", readme).group(1)
    assert f"pip install -r {LOCK.relative_to(ROOT)}" in command
    assert "pip install --no-deps -e ." in command  # kvbench itself, its dependencies from the lock
    refresh = re.search(r"^#    (uv pip compile .+)$", LOCK.read_text(), re.M).group(1)
    assert refresh in readme, f"the README does not show the command that made {LOCK.name}: {refresh}"


def run_ci_with(tmp_path, command: str) -> int:
    """.ci/run's exit status in a copy of the repository whose README's test command is ``command``."""
    (tmp_path / ".ci").mkdir(exist_ok=True)
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(f"<!-- test-command -->\n```\n{command}\n```\n<!-- /test-command -->\n")
    return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, timeout=60).returncode


def test_ci_fails_when_the_test_command_fails_or_runs_no_test(tmp_path):
    assert run_ci_with(tmp_path, "true && true") == 0
    assert run_ci_with(tmp_path, "true && false && true") != 0  # a step of the chain failing
    assert run_ci_with(tmp_path, "true && (exit 5)") == 5  # pytest's status when it collects no test


def test_no_test_module_lies_outside_tests():
    """pytest collects tests/ alone (testpaths): a case left under results/ (where a fuzz campaign
    writes its reproducers beside its traces) would never run."""
    stray = [str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("test_*.py")]
    assert not stray, f"move these to tests/reproducers/ (docs/fuzzing.md): {stray}"
