"""The model's core (docs/architecture.md): the operations, the blocks, the slabs, the ledger
and the content, which every backend is checked against, held to a line count. The kinds, the
rule sets, the eviction policies and the tiers are not core: each is where a new kind, engine,
policy or tier goes. Every module of kvbench/model/ is one or the other."""
from __future__ import annotations

from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "kvbench" / "model"
CORE = ("oracle.py", "pool.py", "arena.py", "__init__.py")
NOT_CORE = ("kinds.py", "rules/", "eviction.py", "tiers.py", "tier_policies.py", "tier_removal.py",
            "tiered.py", "events.py")  # SPEC §14: the events the cache's changes announce, derived beside it
# Issue 46's bound. Each group's table operations are its kind's (kinds.py, as vLLM's
# SingleTypeKVCacheManager owns a group's), eviction and preemption eviction.py's, the fork and
# the windows' release the rule set's, the content's writers the contract's.
CORE_LINES = 500


def test_every_module_of_the_model_is_core_or_named_outside_it():
    found = {p.name for p in MODEL.glob("*.py")} | {f"{p.parent.name}/" for p in MODEL.glob("*/__init__.py")}
    assert found == set(CORE) | set(NOT_CORE)


def test_the_core_stays_within_its_line_count():
    # as `wc -l` counts them
    lines = sum((MODEL / name).read_text(encoding="utf-8").count("\n") for name in CORE)
    assert lines <= CORE_LINES
