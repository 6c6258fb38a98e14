"""The model's core (docs/architecture.md): the operations, the blocks, the slabs, the ledger
and the content, which every backend is checked against, held to a line count. The kinds, the
rule sets, the eviction policies and the tiers are not core: each is where a new kind, engine,
policy or tier goes. Every module of kvbench/model/ is one or the other."""
from __future__ import annotations

from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "kvbench" / "model"
CORE = ("oracle.py", "pool.py", "arena.py", "__init__.py")
NOT_CORE = ("kinds.py", "rules/", "eviction.py", "tiers.py", "tier_policies.py", "tiered.py",
            "events.py")  # SPEC §14: the events the cache's changes announce, derived beside it
# Issue 46 asks for 500; 1,014 before the kinds' and engines' steps and the policies moved out,
# 867 before the operations were compacted and a fork served as a request shared the prefill's
# admission (_admit). What is left is the operations of both layouts, the pool, the arena, the
# ledger and the content; below 500 only with the layouts' or the groups' table operations
# moved out of the core (docs/architecture.md says why they stay).
CORE_LINES = 782


def test_every_module_of_the_model_is_core_or_named_outside_it():
    found = {p.name for p in MODEL.glob("*.py")} | {f"{p.parent.name}/" for p in MODEL.glob("*/__init__.py")}
    assert found == set(CORE) | set(NOT_CORE)


def test_the_core_stays_within_its_line_count():
    # as `wc -l` counts them
    lines = sum((MODEL / name).read_text(encoding="utf-8").count("\n") for name in CORE)
    assert lines <= CORE_LINES
