"""Stored expectations: a check that reads the oracle's expected figures from the cache gives the
verdict the oracle computing them gives, on every committed workload and on a failing backend;
a changed trace, setting or oracle code never reads them; a stored figure the oracle does not
give is an ERROR, never a verdict on the backend."""
from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import A, K, P, X, make_config, make_trace

from impls.contiguous import Contiguous
from impls.faults import SharedCountedTwice
from impls.numpy_paged import NumpyPaged
from kvbench.analyses import suite
from kvbench.checking import expectations
from kvbench.checking.checker import check
from kvbench.contract import registry

ROOT = Path(__file__).resolve().parents[2]
FORKS = make_trace(P(0, 40), K(1, 0), A((0, 1), (1, 1)), A((0, 16), (1, 3)), X(0), P(2, 33), X(1),
                   X(2), name="forks")


def verdict_facts(v) -> tuple:
    """What a check reports, the series whole."""
    return (v.status, v.ops, v.divergence, v.divergences, list(v.series), v.final_ledger, v.tenants,
            v.evictions, v.hits, v.misses, v.ooms, v.error)


def twice(trace, make_backend, folder, **kw):
    first = check(trace, make_backend(), series=True, cache=folder, **kw)
    second = check(trace, make_backend(), series=True, cache=folder, **kw)
    return first, second


@pytest.mark.parametrize("path", suite.committed_workloads(), ids=lambda p: p.stem)
def test_stored_expectations_give_the_computed_verdict_on_every_committed_workload(path, tmp_path):
    trace = suite.load_traces([path])[0]
    cfg = suite.config_for(trace, policy=suite.policies_for(trace, "auto")[0])
    ran = 0
    for name in ("numpy", "contiguous-max"):
        try:
            entry = registry.resolve(name)
            entry.create(cfg).close()
        except registry.BackendUnavailable:
            continue
        first, second = twice(trace, lambda: entry.create(cfg), tmp_path, gather="none")
        if first.status == "n/a":
            continue
        ran += 1
        assert (first.expectations, second.expectations) == ("stored", "reused"), name
        assert verdict_facts(second) == verdict_facts(first), name
    assert ran, "no backend ran the workload"


def test_a_failing_backend_diverges_where_it_does_with_computed_expectations(tmp_path):
    cfg = make_config()
    computed = check(FORKS, SharedCountedTwice(cfg), series=True)
    assert computed.status == "FAIL"
    check(FORKS, NumpyPaged(cfg), series=True, cache=tmp_path)  # stores them
    reused = check(FORKS, SharedCountedTwice(cfg), series=True, cache=tmp_path)
    assert reused.expectations == "reused"
    assert verdict_facts(reused) == verdict_facts(computed)


def test_a_changed_trace_setting_or_oracle_code_never_reads_them(tmp_path, monkeypatch):
    cfg = make_config()
    assert check(FORKS, NumpyPaged(cfg), cache=tmp_path).expectations == "stored"
    assert check(FORKS, NumpyPaged(cfg), cache=tmp_path).expectations == "reused"
    longer = make_trace(P(0, 41), K(1, 0), A((0, 1), (1, 1)), A((0, 16), (1, 3)), X(0), P(2, 33),
                        X(1), X(2), name="forks")  # one prefill one token longer
    assert check(longer, NumpyPaged(cfg), cache=tmp_path).expectations == "stored"
    fewer_blocks = make_config(num_blocks=63)
    assert check(FORKS, NumpyPaged(fewer_blocks), cache=tmp_path).expectations == "stored"
    assert check(FORKS, Contiguous(cfg), cache=tmp_path).expectations == "stored"  # another layout
    assert check(FORKS, NumpyPaged(cfg), gather="all", cache=tmp_path).expectations == "stored"
    monkeypatch.setattr(expectations, "oracle_version", lambda: "another oracle")
    assert check(FORKS, NumpyPaged(cfg), cache=tmp_path).expectations == "stored"


def test_a_trace_changed_in_place_after_a_check_is_never_read_with_its_old_key(tmp_path):
    trace = make_trace(P(0, 40), K(1, 0), A((0, 1), (1, 1)), X(0), X(1), name="in-place")
    assert check(trace, NumpyPaged(make_config()), cache=tmp_path).expectations == "stored"
    trace.ops[0] = dataclasses.replace(trace.ops[0], tokens=41)  # the same operations, one longer
    v = check(trace, NumpyPaged(make_config()), cache=tmp_path)
    assert (v.status, v.expectations) == ("pass", "stored")


def test_the_oracle_version_follows_its_sources(tmp_path, monkeypatch):
    expectations.oracle_version.cache_clear()
    before = expectations.oracle_version()
    src = tmp_path / "kvbench" / "checking"
    src.mkdir(parents=True)
    for name in expectations.ORACLE_MODULES:
        path = ROOT / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            (tmp_path / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / f.relative_to(ROOT)).write_bytes(f.read_bytes())
    monkeypatch.setattr(expectations, "ROOT", tmp_path)
    expectations.oracle_version.cache_clear()
    assert expectations.oracle_version() == before  # the same sources
    oracle = tmp_path / "kvbench" / "model" / "oracle.py"
    oracle.write_text(oracle.read_text() + "\n# a change\n")
    expectations.oracle_version.cache_clear()
    assert expectations.oracle_version() != before
    monkeypatch.undo()
    expectations.oracle_version.cache_clear()


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvbench"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("kvbench"))
    return names


def test_the_version_covers_every_module_the_oracle_imports():
    listed = [ROOT / m for m in expectations.ORACLE_MODULES]
    seen, todo = set(), ["kvbench.model.oracle", "kvbench.model.tiered"]
    while todo:
        name = todo.pop()
        base = ROOT / name.replace(".", "/")
        path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)
        if path is None or path in seen:
            continue
        seen.add(path)
        todo.extend(_imports(path))
    assert len(seen) > 5
    missing = [str(p.relative_to(ROOT)) for p in seen
               if not any(p == m or m in p.parents for m in listed)]
    assert not missing


def _alter(path, change) -> None:
    """Rewrite the stored file with ``change(data)`` applied to its arrays."""
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    change(data)
    np.savez(path, **data)


BLOCKS_USED = [f for f in expectations.SCALARS if f not in expectations.FLOATS].index("blocks_used")


def _one_more_block(data) -> None:
    data["ints"][3, BLOCKS_USED] += 1  # after operation #3, one block more than the oracle says


def test_a_stored_file_altered_by_one_is_not_read_but_computed_anew(tmp_path):
    cfg = make_config()
    assert check(FORKS, NumpyPaged(cfg), cache=tmp_path).expectations == "stored"
    (path,) = tmp_path.glob("*.npz")
    _alter(path, _one_more_block)  # the digest stored with the figures no longer matches
    with pytest.warns(expectations.CacheWarning, match="do not match the digest"):
        v = check(FORKS, NumpyPaged(cfg), cache=tmp_path)
    assert (v.status, v.expectations) == ("pass", "stored")
    assert check(FORKS, NumpyPaged(cfg), cache=tmp_path).expectations == "reused"


def test_a_stored_figure_the_oracle_does_not_give_is_removed_and_the_check_run_again(tmp_path):
    cfg = make_config()
    assert check(FORKS, NumpyPaged(cfg), cache=tmp_path).expectations == "stored"
    (path,) = tmp_path.glob("*.npz")

    def stale(data):  # the figure changed and its digest with it: as an oracle that changed
        _one_more_block(data)
        data["digest"] = np.array(expectations.payload_digest(data))
    _alter(path, stale)
    v = check(FORKS, NumpyPaged(cfg), cache=tmp_path)  # the check alone: an ERROR, never a FAIL
    assert (v.status, v.expectations) == ("ERROR", "stale")
    assert "disagree with the oracle" in v.error and "operation #3" in v.error
    assert not path.exists()
    assert check(FORKS, NumpyPaged(cfg), cache=tmp_path).expectations == "stored"  # anew
    _alter(path, stale)
    with pytest.warns(expectations.CacheWarning, match="disagree with the oracle"):
        row = suite.run_one(FORKS, "numpy", cfg, cache=tmp_path)
    assert (row["status"], row["expectations"]) == ("pass", "recomputed")
    assert check(FORKS, NumpyPaged(cfg), cache=tmp_path).expectations == "reused"


def test_an_unwritable_cache_folder_is_one_warning_and_no_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(expectations.CacheWarning, match="expectations cache off: .*cannot be written"):
        assert expectations.usable_dir(blocker / "expectations") is None
    assert expectations.usable_dir(tmp_path / "fine") == tmp_path / "fine"


def test_a_folder_it_cannot_write_leaves_the_check_uncached(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    v = check(FORKS, NumpyPaged(make_config()), cache=blocker / "expectations")
    assert v.status == "pass" and v.expectations == ""


def test_a_save_removes_the_temporaries_of_writers_killed_mid_save(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    dead, alive = int(ended.stdout), os.getppid()  # the first has exited; pytest's parent lives
    folder = tmp_path / "expectations"
    check(FORKS, NumpyPaged(make_config()), cache=folder)
    (stored,) = folder.glob("*.npz")
    orphan = stored.with_name(f"{stored.stem}.{dead}.tmp.npz")
    busy = stored.with_name(f"{stored.stem}.{alive}.tmp.npz")
    orphan.write_bytes(b"half")
    busy.write_bytes(b"half")
    expectations.remove_orphans(stored)
    assert not orphan.exists() and busy.exists()
