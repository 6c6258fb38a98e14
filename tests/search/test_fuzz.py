"""`kvbench fuzz`: random histories find planted faults and shrink them, pass a correct backend,
come out the same under a seed, keep what they found on Ctrl-C, and report what they reached."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_config

from impls import faults, faults_edges
from impls.numpy_paged import NumpyPaged
from kvbench.analyses import suite
from kvbench.checking.checker import check, oracle_for
from kvbench.cli import main
from kvbench.contract import registry
from kvbench.contract.protocol import Capabilities
from kvbench.search import histories as R
from kvbench.search.fuzz import Campaign, Watch, budget_for
from kvbench.search.reproduce import divergence_kind
from kvbench.traces.format import Append, Fork, Header, Prefill, Trace, load, validate

SMALL = 40  # histories: every fault below shows within this many under seed 0


def campaign(target: str, out: Path, **kw) -> Campaign:
    kw = {"max_histories": SMALL, "shrink_attempts": 600, "shrink_seconds": 3600, **kw}
    return Campaign(registry.resolve(target), out, **kw).run()


@pytest.mark.parametrize("fault", [faults.FloorBlocks, faults.NoCopyOnWrite, faults.LfuWithoutRecency,
                                   faults.SaltDroppedWithHashes, faults_edges.ExactFitRefused],
                         ids=lambda f: f.__name__)
def test_a_planted_fault_is_found_and_shrunk(fault, tmp_path):
    c = campaign(f"{fault.__module__}:{fault.__name__}", tmp_path, first=True)
    assert c.stopped == "first finding", f"{fault} not found in {SMALL} histories"
    (f,) = c.findings.values()
    assert f.ops_after is not None and f.ops_after <= 20, (f.ops_before, f.ops_after)
    mini = load(str(tmp_path / f"{f.name}.min.jsonl"))
    assert len(mini) == f.ops_after
    # The shrunk trace fails on the fault the same way and passes on the pool it is planted in.
    config = suite.config_for(mini, policy=suite.policies_for(mini, None)[0])
    assert divergence_kind(check(mini, fault(config)).divergence) == f.kind
    assert check(mini, NumpyPaged(config)).valid
    assert (tmp_path / f"test_{f.name.replace('-', '_')}_min.py").read_text().count("def test_") == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [x["kind"] for x in summary["findings"]] == [f.kind]


def test_the_cli_writes_the_reproducer_and_exits_1(tmp_path, capsys):
    rc = main(["fuzz", "--backend", "impls.faults:FloorBlocks", "--max-histories", "10",
               "--shrink-attempts", "400", "--out", str(tmp_path), "--quiet"])
    assert rc == 1
    out = capsys.readouterr().out
    assert "FAIL 01-" in out and "blocks" in out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "summary.json" in names and "summary.md" in names
    mini = [n for n in names if n.endswith(".min.jsonl")]
    assert mini and all(f"test_{n[:-len('.min.jsonl')].replace('-', '_')}_min.py" in names for n in mini)
    # The shrunk trace replays as it failed: `kvbench check` reads its settings from the header.
    assert main(["check", str(tmp_path / mini[0]), "--backend", "impls.faults:FloorBlocks"]) == 1


def test_a_correct_backend_gives_exit_0_and_says_what_was_tried(tmp_path, capsys):
    rc = main(["fuzz", "--backend", "numpy", "--max-histories", "15", "--out", str(tmp_path),
               "--quiet"])
    assert rc == 0, capsys.readouterr().out
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["findings"] == [] and s["errors"] == [] and s["histories"] == 15
    edges = s["coverage"]["edges"]
    for edge in ("refusal", "eviction", "copy-on-write", "window release", "prefix hit"):
        assert edges[edge] > 0, (edge, edges)
    # model shapes by default: more kinds than tiny-hybrid's, only the declared ones
    assert {"full", "sliding"} < set(s["coverage"]["groups"]) <= set(NumpyPaged.capabilities.kinds)
    md = (tmp_path / "summary.md").read_text()
    assert "## Coverage" in md
    missed = s["coverage"]["edges not reached"]
    assert missed and f"Not reached, so not tested: {'; '.join(missed)}." in md


def test_the_same_seed_gives_the_same_histories_and_findings(tmp_path):
    caps = NumpyPaged.capabilities
    same = [R.random_history(7, i, caps)[0].to_jsonl() for i in range(5)]
    assert same == [R.random_history(7, i, caps)[0].to_jsonl() for i in range(5)]
    assert same != [R.random_history(8, i, caps)[0].to_jsonl() for i in range(5)]
    a = campaign("impls.faults:FloorBlocks", tmp_path / "a", max_histories=8, seed=3).summary()
    b = campaign("impls.faults:FloorBlocks", tmp_path / "b", max_histories=8, seed=3).summary()
    def timeless(findings):  # everything but how long each shrink took
        return [{**f, "shrink": {k: v for k, v in f["shrink"].items() if k != "seconds"}} for f in findings]
    assert a["findings"] and timeless(a["findings"]) == timeless(b["findings"])
    assert a["coverage"] == b["coverage"] and a["operations"] == b["operations"]
    shrunk = [f for f in a["findings"][0]["files"] if f.endswith(".min.jsonl")]
    ops_a, ops_b = (load(str(tmp_path / d / shrunk[0])).ops for d in "ab")  # the header says how long
    assert ops_a == ops_b


class _InterruptAfter:
    """A progress sink that presses Ctrl-C once ``n`` histories are done."""

    def __init__(self, n):
        self.n, self.done = n, 0

    def note(self, text):
        pass

    def update(self, k=1):
        self.done += k
        if self.done >= self.n:
            raise KeyboardInterrupt


def test_ctrl_c_keeps_what_was_found(tmp_path):
    c = campaign("impls.faults:FloorBlocks", tmp_path, max_histories=None,
                 progress=_InterruptAfter(6))
    assert c.stopped == "interrupted" and c.histories == 6  # Ctrl-C as the 6th was reported
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["stopped"] == "interrupted" and s["findings"]
    for f in s["findings"]:
        assert all((tmp_path / name).exists() for name in f["files"])


def test_only_what_the_backend_declares_is_drawn():
    bare = Capabilities(layout="paged", fork=False, prefix_caching=False, groups=False)
    full = NumpyPaged.capabilities
    def shapes(caps):
        traces = [R.random_history(0, i, caps)[0] for i in range(40)]
        return {"fork": any(isinstance(op, Fork) for t in traces for op in t.ops),
                "groups": any(t.header.groups or t.header.settings["model"] != "tiny" for t in traces),
                "hashes": any(getattr(op, "block_hashes", None) for t in traces for op in t.ops),
                "salt": any(getattr(op, "salt", None) for t in traces for op in t.ops),
                "policy": any("policy" in t.header.settings for t in traces)}
    assert shapes(bare) == dict.fromkeys(("fork", "groups", "hashes", "salt", "policy"), False)
    assert shapes(full) == dict.fromkeys(("fork", "groups", "hashes", "salt", "policy"), True)


def test_a_new_op_kind_plugs_in_behind_its_capability(monkeypatch):
    def mark(h):  # a stand-in for a tier or lifecycle operation: a one-token append
        h.append([h.pick()], [1]) if h.length else h.prefill(1, h.tenant())
    kind = R.OpKind("tier move", 50, mark, lambda caps, s: caps.copy_on_write)
    monkeypatch.setattr(R, "OP_KINDS", R.OP_KINDS + [kind])
    _, _, drawn = R.random_history(0, 0, NumpyPaged.capabilities)
    assert "tier move" in drawn
    _, _, drawn = R.random_history(0, 0, Capabilities(copy_on_write=False))
    assert "tier move" not in drawn


def _watched(ops, num_blocks, block_size=4):
    trace = validate(Trace(Header("t", tenants={"a": 1}), ops, name="t"))
    backend = NumpyPaged(make_config(block_size, num_blocks))
    watch = Watch(oracle_for(trace, backend), trace)
    check(trace, None, model=watch.o, progress=watch)
    return watch.reached


def test_the_watch_sees_exact_fits_refusals_and_copy_on_write():
    # 6 tokens in blocks of 4: 2 = ceil(6 / 4) blocks, the whole budget of 2; the fork shares
    # both; the child's write into the shared half-full tail needs a copy: a third block.
    ops = [Prefill(0, 0, "a", 6), Fork(1, 1, 0), Append(2, (1,), (1,))]
    tight = _watched(ops, num_blocks=2)
    assert {"exact fit (every block in use)", "fork at a partial tail", "refusal"} <= tight
    assert "copy-on-write" not in tight  # refused: there was no block to copy into
    roomy = _watched(ops, num_blocks=3)  # 3 = 2 + the copy: an exact fit again, after the copy
    assert {"exact fit (every block in use)", "copy-on-write"} <= roomy and "refusal" not in roomy
    assert not _watched([Prefill(0, 0, "a", 6)], num_blocks=3) & {"exact fit (every block in use)",
                                                                   "refusal"}


def test_budgets_sit_at_the_edges_of_the_peak():
    assert [budget_for(m, 10, 0.5) for m in R.BUDGETS] == [10, 9, 11, 6, 20]  # 6 = 1 + 0.5 * 10
    assert budget_for("one short", 1, 0.0) == 1  # never below one block


def test_a_bad_backend_is_refused_in_one_line(tmp_path, capsys):
    assert main(["fuzz", "--backend", "no-such-pool", "--max-histories", "1",
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--backend no-such-pool: unknown backend" in err and len(err.strip().splitlines()) == 1


def test_kvbench_families_come_in_with_random_parameters():
    caps = NumpyPaged.capabilities
    drawn = {}
    families = {name for name, _ in R.FAMILY_SOURCES}
    for i in range(1000):  # salted prompts come from keyed histories only: rarely
        trace, settings, kinds = R.random_history(0, i, caps, R.LIFECYCLES)
        if kinds and kinds[0].startswith("family "):
            drawn.setdefault(trace.header.params["family"], trace)
            assert settings.max_len == max(trace.final_lengths().values())
        if set(drawn) == families:
            break
    assert set(drawn) == families
    edges = drawn["eviction_edges"]  # run at the budget it was built for
    assert R.random_history(0, int(edges.name.rsplit("-", 1)[1]), caps, R.LIFECYCLES)[1].budget == "as generated"
    beams = drawn["fork_trees"]
    assert any(isinstance(op, Fork) for op in beams.ops) and beams.header.params["family_params"]
    # Without fork, no family that forks: a continuous-batching stream only.
    bare = Capabilities(fork=False)
    names = {R.random_history(0, i, bare)[0].header.params.get("family") for i in range(150)}
    assert names - {None} == {"decode_streams"}


def test_progress_lines_carry_the_note():
    import io

    from kvbench.progress import Progress
    stream = io.StringIO()  # not a terminal: plain lines
    p = Progress(None, "fuzz", "histories", stream=stream, every=0)
    p.note("12 ops/s, 1 found (blocks_used x3)")
    p.update(2)
    assert stream.getvalue().startswith("fuzz: 2 histories (")
    assert stream.getvalue().rstrip().endswith(", 12 ops/s, 1 found (blocks_used x3))")
