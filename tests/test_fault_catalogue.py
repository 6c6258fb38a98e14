"""The engine-bug catalogue (`kvbench faults`): every bug of issue 14's list, planted into a copy
of a backend, is caught by the default suite, the committed workloads `kvbench run` checks, not
only by a trace written for it; and the suite passes the backends the faults were planted into."""
from __future__ import annotations

import pytest

from impls.faults import CATALOGUE
from impls.faults_edges import EDGE_BUGS
from kvbench.checking import suite
from kvbench.checking.checker import check
from kvbench.cli import faults as cli
from kvbench.cli import main
from kvbench.contract import registry


@pytest.fixture(scope="module")
def table():
    return {r["bug"]: r for r in cli.catalogue()}


@pytest.mark.parametrize("bug", [b for b in CATALOGUE if b.why], ids=lambda b: b.upstream)
def test_every_engine_bug_is_caught_by_the_default_suite(table, bug):
    row = table[bug.name]
    assert row["caught"] == "yes", f"{bug.name} ({bug.upstream}) passes every committed workload"
    assert row["workload"] and isinstance(row["step"], int)
    assert row["first divergence"].startswith(row["divergence"].quantity)


def test_the_planted_faults_of_the_tests_are_caught_too(table):
    missed = [b.name for b in CATALOGUE if not b.why and table[b.name]["caught"] != "yes"]
    assert missed == []


def test_a_salt_leak_names_both_requests(table):
    d = table["salt and adapter name untagged in the block hash"]["divergence"]
    assert "a hit across salts" in d.detail and "salt 'x'" in d.detail and "adapter 'x'" in d.detail


@pytest.mark.parametrize("base", sorted({b.fault.__mro__[1] for b in CATALOGUE}, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_the_backends_the_faults_are_planted_into_pass_the_suite(base):
    # The control: what the catalogue reports is the fault, not the suite or the backend.
    for trace in suite.load_traces(suite.committed_workloads()):
        for policy in suite.policies_for(trace, "auto"):
            v = check(trace, base(suite.config_for(trace, policy=policy)))
            assert v.valid is True, f"{trace.name}@{policy}: {v.divergence}"


def test_the_command_prints_the_table_and_says_what_it_missed(capsys):
    # One workload: the table, and exit status 1 exactly when an engine bug went unnoticed.
    code = main(["faults", "--quiet", "--width", "40", str(suite.WORKLOADS_DIR / "fork-beam.jsonl")])
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split()[:4] == ["bug", "upstream", "caught", "workload"]
    assert len(out.splitlines()) == 1 + len(CATALOGUE) + 1
    assert code == (1 if "MISSED" in err else 0)
    assert f"of {sum(b.why for b in CATALOGUE)} engine bugs of issue 14" in out


@pytest.mark.parametrize("name, fault, base", EDGE_BUGS, ids=[n for n, _, _ in EDGE_BUGS])
def test_each_single_line_bug_of_a_pool_is_caught_by_the_default_suite(table, name, fault, base):
    # Issue 12: the default run catches what the tests catch. Each of these slips shows only at
    # an edge (a refusal, an exact fit, 128 sharers, 65 live sequences, blocks of 256, 17+ block
    # prompts, the int4 pool) or is a control; the README's table says which the suite missed
    # before the edge workloads (scripts/default_reach.py).
    row = table[name]
    assert row["caught"] == "yes", f"{name}: passes every committed workload"
    assert base in registry.DEFAULT_BACKENDS  # the pool it is planted into runs by default


def test_a_salt_dropped_for_hashed_prompts_fails_the_default_run(table):
    # The cross-tenant leak no workload caught before prefix-salts: the salt kept on the token-id
    # path only. prefix-salts opens with alice (salt "a") prefilling 32 tokens named by 4 block
    # hashes, then bob (salt "b") the same 4 hashes.
    ops = suite.load_traces([suite.WORKLOADS_DIR / "prefix-salts.jsonl"])[0].ops
    assert [(op.seq, op.salt, op.tokens, op.block_hashes) for op in ops[:2]] == [
        (0, "a", 32, ("s0.0", "s0.1", "s0.2", "s0.3")), (1, "b", 32, ("s0.0", "s0.1", "s0.2", "s0.3"))]
    row = table["salt and adapter dropped from a prompt named by block hashes"]
    d = row["divergence"]
    # Bob's 32 tokens must miss and take ceil(32 / 8) = 4 new blocks: 8 = 4 + 4 in use. Keyed
    # by the hashes alone, bob hits alice's 4: 4 in use.
    assert (row["caught"], row["workload"], d.step, d.quantity) == ("yes", "prefix-salts", 1, "blocks_used")
    assert (d.expected, d.actual) == (8, 4)
    assert "a hit across salts: sequence 1 (salt 'b')" in d.detail and "sequence 0 (salt 'a')" in d.detail
