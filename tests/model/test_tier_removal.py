"""Tier rule ``failed_read_removes_at_once`` (kvbench/model/tier_removal.py, vLLM 0.33's file
tier): a failed load removes each entry it read from its "drop" tier at its completion, lost to
every other load and lookup reading it, where SPEC §11 keeps it until no load reads it."""
import pytest

from kvbench.model.tiers import TIER_RULES, Tiers
from kvbench.traces.tier_ops import TierSpec

BB = 1024  # block bytes
RULE = "failed_read_removes_at_once"


def stored_ab(rules=(RULE,), failed_load="drop"):
    """A host of 4 holding a and b stored."""
    t = Tiers([TierSpec("host", 4, "lru", failed_load)], BB, rules)
    t.store_begin(1, 0, 0, [("a", 10), ("b", 11)])
    t.complete(1, True)
    return t


def counts(t):
    led = t.ledgers()[0]
    assert led.stored + led.storing + led.free == led.capacity and led.loading <= led.stored
    assert led.loading == sum(e.loads > 0 for e in t.tiers[0].entries.values())
    return led.stored, led.storing, led.loading, led.free


def test_the_rule_is_one_the_model_knows():
    assert RULE in TIER_RULES
    Tiers([TierSpec("host", 4)], BB, (RULE,))  # no "unknown tier rule"


@pytest.mark.parametrize("rules, at_failure, bytes_up", [
    # SPEC §11: a stays, unreadable, read by load 3 (2 stored, 1 loading, 2 free = 4 - 2); at
    # load 3's end it goes (1 = b); load 3 moved it up (1 block)
    ((), (2, 0, 1, 2), 1 * BB),
    # the rule: a leaves at load 2's failure (1 stored = b, 0 loading, 3 free = 4 - 1); load 3,
    # completed ok, moved none of it up
    ((RULE,), (1, 0, 0, 3), 0),
])
def test_a_failed_load_removes_what_another_load_reads_only_under_the_rule(rules, at_failure, bytes_up):
    t = stored_ab(rules)
    t.load_begin(2, seq=5, blocks=[("a", 0, 30)])
    t.load_begin(3, seq=6, blocks=[("a", 0, 40)])
    assert counts(t) == (2, 0, 1, 2)  # a read by two loads: one loading block
    t.complete(2, ok=False)
    assert counts(t) == at_failure and t.load_run(["a"]) == []
    assert t.transfers[3].lost == ({("a", 0)} if rules else set())
    t.complete(3, ok=True)
    assert counts(t) == (1, 0, 0, 3) and t.ledgers()[0].bytes_up == bytes_up
    assert t.load_targets == {} and t.ledgers()[0].hits == 1 + 1  # both loads began on a


def test_a_keep_tier_keeps_what_a_failed_load_read_under_the_rule():
    t = stored_ab(failed_load="keep")
    t.load_begin(2, seq=5, blocks=[("a", 0, 30)])
    t.load_begin(3, seq=6, blocks=[("a", 0, 40)])
    t.complete(2, ok=False)
    assert counts(t) == (2, 0, 1, 2) and t.load_run(["a", "b"]) == [0, 0]
    t.complete(3, ok=True)
    assert t.ledgers()[0].bytes_up == 1 * BB


def test_a_lookups_pin_on_a_removed_entry_is_released_with_nothing_to_release():
    t = stored_ab()
    assert t.pin(7, ["a", "b"]) == [("a", 0), ("b", 0)]
    t.load_begin(2, seq=5, blocks=[("a", 0, 30)])
    assert counts(t) == (2, 0, 2, 2)  # a and b read (by the pins, a by the load too)
    t.complete(2, ok=False)
    assert counts(t) == (1, 0, 1, 3) and t.pins[7] == [("b", 0)]  # b still pinned
    t.unpin(7)
    assert counts(t) == (1, 0, 0, 3)


def test_a_lost_load_leaves_the_entry_stored_again_under_it_alone():
    t = stored_ab()
    t.load_begin(2, seq=5, blocks=[("a", 0, 30)])
    t.load_begin(3, seq=6, blocks=[("a", 0, 40)])
    t.complete(2, ok=False)
    t.store_begin(4, 0, 0, [("a", 12)])  # a stored again while load 3, which lost it, reads on
    t.complete(4, True)
    t.load_begin(5, seq=8, blocks=[("a", 0, 50)])
    assert counts(t) == (2, 0, 1, 2)  # a read by load 5 alone
    t.complete(3, ok=True)  # reads nothing of the new a
    assert counts(t) == (2, 0, 1, 2) and t.tiers[0].entries["a"].loads == 1
    t.complete(5, ok=True)
    assert counts(t) == (2, 0, 0, 2) and t.ledgers()[0].bytes_up == 1 * BB  # load 5's alone


def test_two_failed_loads_of_one_entry_remove_it_once_and_an_abort_after_ends_clean():
    t = stored_ab(rules=(RULE, "failed_load_drops_unannounced"))
    for tid, seq in ((2, 5), (3, 6), (4, 7)):
        t.load_begin(tid, seq=seq, blocks=[("a", 0, 30 + tid), ("b", 0, 40 + tid)])
    t.complete(2, ok=False)
    assert counts(t) == (0, 0, 0, 4) and t.tiers[0].dropped == {"a", "b"}
    t.complete(3, ok=False)  # lost both already: nothing more goes
    t.abort(7)
    assert counts(t) == (0, 0, 0, 4) and t.load_targets == {} and t.transfers == {}
    assert t.load_run(["a", "b"]) == []
