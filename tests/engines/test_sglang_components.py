"""SGLang's UnifiedRadixCache with its SWA or MAMBA component (impls/engines/sglang_components.py): each
component's SPEC §10 figures and lock balance after every step, and the planted SWA lock bugs of
impls/engines/faults_engines.py caught by them.

Opt-in: needs SGLang's environment (docs/engines.md), skipped elsewhere with the reason::

    PYTHONPATH=$PWD $S/bin/python -m pytest tests/engines/test_sglang_components.py

A full pool of 64 slots and an SWA pool of 51 (SGLang's serving default: 0.8 SWA slots per full
slot), page size 1, a sliding window of 4 tokens. Token runs of 8: A, B, D and C (2 tokens).
"""
from __future__ import annotations

import random

import pytest

A, B, D, C = list(range(1, 9)), list(range(11, 19)), list(range(21, 29)), [31, 32]
SIZE, WINDOW = 64, 4
SWA_SIZE = int(SIZE * 0.8)  # 51: --swa-full-tokens-ratio's fallback 0.8


def drive(tree, steps) -> list:
    """Each step's violations (SwaTree.violations), in order."""
    out = []
    for op, *args in steps:
        {"run": tree.run, "window": tree.release_window, "finish": tree.finish,
         "evict": tree.evict, "extend": tree.extend}[op](*args)
        out.append(tree.violations())
    return out


def first_violation(tree, steps):
    for i, v in enumerate(drive(tree, steps)):
        if v:
            return i, v
    return None


def test_the_swa_lock_protects_the_window_and_its_early_release_frees_it(sglang):
    from impls.engines.sglang_components import SwaTree
    t = SwaTree(SIZE, WINDOW)
    assert t.run(0, A + B)
    # full: the whole 16-token path locked; SWA: only the window's 4 tokens of it
    assert t.figures() == {"full": (0, 16, SIZE - 16, SIZE),
                           "swa": (16 - 4, 4, SWA_SIZE - 16, SWA_SIZE)}
    t.release_window(0)
    assert t.figures()["swa"] == (16, 0, SWA_SIZE - 16, SWA_SIZE)
    t.finish(0)
    assert t.figures()["full"] == (16, 0, SIZE - 16, SIZE)
    assert t.violations() == []
    assert t.run(1, A + B + C) and t.hits == 16  # the cached 16 tokens hit


def test_a_mamba_state_is_cached_with_its_prompt_and_protected_while_its_request_runs(sglang):
    from impls.engines.sglang_components import MambaTree
    t = MambaTree(SIZE, 8)
    states = t.figures()["mamba"][2]  # the state slots SGLang's MambaPool lends (its size)
    assert t.run(0, A + B)
    # full: the 16-token path locked; mamba: the prompt's checkpoint, locked with it, and the
    # request's active state (held outside the tree): states - 2 free
    assert t.figures() == {"full": (0, 16, SIZE - 16, SIZE), "mamba": (0, 1, states - 2, states)}
    assert t.held() == {"full": 0, "mamba": 1}
    t.finish(0)
    # the finished state is the checkpoint's node's: the tree keeps its own, the active goes back
    assert t.figures()["mamba"] == (1, 0, states - 1, states)
    assert t.run(1, A + B + C) and t.hits == 16  # the cached prefix and its state hit
    assert t.violations() == []


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_a_request_stream_keeps_every_components_figures_and_locks_balanced(sglang, kind):
    """300 steps of requests sharing prefixes of a few roots (runs, early window releases,
    decode steps, finishes, evictions, refusals where the pools are full): SGLang's own ledger
    agrees with its nodes and SPEC §10 after every one, and at the end, idle, nothing is
    locked."""
    from impls.engines.sglang_components import MambaTree, SwaTree
    rng = random.Random(0)
    t = SwaTree(SIZE, WINDOW) if kind == "swa" else MambaTree(SIZE, 6)
    roots = [list(range(1000 * r, 1000 * r + 12)) for r in range(3)]
    running, released, rid = [], set(), 0
    for step in range(300):
        roll = rng.random()
        if roll < 0.45 or not running:
            tokens = rng.choice(roots)[:rng.randint(1, 12)] + [rng.randint(5000, 9000)
                                                            for _ in range(rng.randint(0, 10))]
            if t.run(rid, tokens):
                running.append(rid)
            rid += 1
        elif roll < 0.52:
            r = rng.choice(running)
            if r not in released and kind == "swa":
                t.release_window(r)
                released.add(r)
        elif roll < 0.6:
            r = rng.choice(running)
            if not t.extend(r, rng.randint(1, 8)):  # decode; a retraction where pools are full
                t.finish(r)
                running.remove(r)
        elif roll < 0.9:
            t.finish(running.pop(rng.randrange(len(running))))
        else:
            t.evict(rng.randint(1, 16))
        assert t.violations() == [], f"step {step}"
        assert t.held() == t.held(recount=True), f"step {step}"  # the tally each step moves
    for r in running:
        t.finish(r)
    assert t.violations() == []
    assert all(protected == 0 for _, protected, _, _ in t.figures().values())
    assert t.hits > 0


def test_an_accept_frees_the_rejected_drafts_slots_the_window_kept_or_not(sglang):
    """Request 0 (A, 8 tokens) decodes 5 tokens, 4 of them drafts, and keeps 1: the 3 rejected
    slots go back to both pools (the window of 4 freed none: pre_len 12 - 4 = 8, the prompt's
    end). Request 1 (B) decodes 8 drafts and keeps none: at pre_len 15 the window had freed
    positions 8..10's SWA slots (11 = 15 - 4), so those give back their full slot alone."""
    from impls.engines.sglang_components import SwaTree
    t = SwaTree(SIZE, WINDOW)
    assert t.run(0, A) and t.extend(0, 5)
    t.accept(0, 1, drafted=4)
    # 10 = 8 + 5 - 3 tokens: 8 in the tree, 2 held by the request; the window has passed the
    # prompt (12 - 4 >= 8), so the SWA lock went: the prompt's 8 SWA slots evictable
    assert t.figures() == {"full": (0, 8, SIZE - 10, SIZE), "swa": (8, 0, SWA_SIZE - 10, SWA_SIZE)}
    assert t.held() == {"full": 2, "swa": 2} and t.violations() == []
    assert t.run(1, B) and t.extend(1, 8)
    assert t.held()["swa"] == 2 + 8 - 3  # positions 8..10 of B left the window
    t.accept(1, 0, drafted=8)
    assert t.held() == {"full": 2, "swa": 2} and t.violations() == []
    assert t.figures()["swa"][2] == SWA_SIZE - 10 - 8  # B's 8 prompt slots, nothing of its drafts


# --- planted SGLang bugs ------------------------------------------------------------------------

def test_pr_27038_a_release_past_the_swa_boundary_is_caught_at_its_first_unlock(sglang):
    """Request 0 (A + B) and request 1 (A + D) split the tree at A. Request 0's SWA lock covers
    its window, node B (8 >= 4 tokens: the boundary); its release, walking past B, decrements A,
    which no SWA lock took: lock_ref -1 at step 2."""
    from impls.engines.faults_engines import SwaLockPastBoundary, SwaTree
    steps = [("run", 0, A + B), ("run", 1, A + D), ("finish", 0), ("finish", 1),
             ("run", 2, A + B + C), ("finish", 2)]
    assert first_violation(SwaTree(SIZE, WINDOW), steps) is None
    step, found = first_violation(SwaLockPastBoundary(SIZE, WINDOW), steps)
    assert step == 2 and any("swa" in v and "lock_ref -1" in v for v in found), found


def test_pr_28161_a_skipped_window_release_leaves_the_window_locked_when_idle(sglang):
    """release_swa marked done without dec_swa_lock_only: after the request ends, its window's
    node still has an SWA lock and SWA's protected size stays 4 (the window) with nothing
    running, caught at step 2."""
    from impls.engines.faults_engines import SwaReleaseSkipped, SwaTree
    steps = [("run", 0, A + B), ("window", 0), ("finish", 0)]
    assert first_violation(SwaTree(SIZE, WINDOW), steps) is None
    bad = SwaReleaseSkipped(SIZE, WINDOW)
    step, found = first_violation(bad, steps)
    assert step == 2 and any("with no request running" in v for v in found), found
    assert bad.figures()["swa"] == (16 - 4, 4, SWA_SIZE - 16, SWA_SIZE)


# --- the committed workloads through each component, and the plants they catch -------------

WORKLOADS = ("hybrid-windows", "hybrid-decode", "hybrid-cut-hits", "tier-agentic", "tier-races",
             "tier-turns", "lifecycle-chunked", "lifecycle-preempt", "lifecycle-speculative",
             "lifecycle-swap")


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_each_component_passes_the_committed_hybrid_tier_and_lifecycle_workloads(sglang, kind):
    """Every operation of each workload (the tier ops' device side: a load runs as a prefill;
    store and done are not driven; an accept frees the rejected drafts), SGLang's figures
    checked after each."""
    from impls.engines.sglang_components import replay
    for name in WORKLOADS:
        r = replay(kind, f"workloads/{name}.jsonl")
        assert r["violations"] == [], (name, r["violations"])
        assert r["hits"] > 0 or name.startswith("tier") and kind == "mamba", name


def test_pr_27586_a_stale_swa_mapping_freed_by_the_recovery_is_caught_at_hybrid_windows_45(sglang):
    """The recovery of an SWA tombstone (a prompt re-inserted over a node whose SWA was evicted)
    frees the tombstone's old base through free_swa, which reads the stale mapping and gives
    back SWA slots the tombstone no longer owns: the SWA allocator's free count exceeds what the
    tree and the requests leave, first at hybrid-windows step 45 (seq 13's prefill, the first
    overlap with a tombstone whose slots went back to the free list; the SWA pool of
    550 = int(86 x 8 x 0.8) tokens evicts SWA before full)."""
    from impls.engines.faults_engines import SwaStaleMappingFreed
    from impls.engines.sglang_components import replay
    assert replay("swa", "workloads/hybrid-windows.jsonl")["violations"] == []
    r = replay("swa", "workloads/hybrid-windows.jsonl", tree_cls=SwaStaleMappingFreed)
    step, found = r["violations"][0]
    assert step == 45 and found[0].startswith("swa: "), found
    evictable, protected, free, pool = r["tree"].figures()["swa"]
    assert evictable + protected + free + r["tree"].held()["swa"] > pool  # slots freed twice
    assert r["tree"].figures()["full"][3] == 86 * 8  # the pool: num_blocks 86 x block_size 8
    assert r["tree"].figures()["swa"][3] == int(86 * 8 * 0.8)

    class StaleOnly(SwaStaleMappingFreed):  # the stale half alone: SGLang's own recovery
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            del self.component._recover_from_incoming

    assert replay("swa", "workloads/hybrid-windows.jsonl", tree_cls=StaleOnly)["violations"] == []


def test_pr_27770_the_window_floor_dropped_at_insert_is_caught_when_a_request_ends(sglang):
    """Request 0 (A, 8 tokens) decodes 8 more: at pre_len 15 the window of 4 has left
    positions 8..10 (11 = 15 - 4; the prompt's 8 are the tree's), whose SWA slots go back.
    Its finish inserts the 16 tokens; without the floor the tree takes those 3 freed slots
    as live SWA: idle, SWA's evictable + free = 51 + 3."""
    from impls.engines.faults_engines import SwaWindowFloorDropped
    from impls.engines.sglang_components import SwaTree
    steps = [("run", 0, A), ("extend", 0, 8), ("finish", 0)]
    good = SwaTree(SIZE, WINDOW)
    assert first_violation(good, steps) is None
    # 13 = 8 (A) + 5 (positions 11..15): what SWA keeps of the 16 tokens
    assert good.figures()["swa"] == (13, 0, SWA_SIZE - 13, SWA_SIZE)
    bad = SwaWindowFloorDropped(SIZE, WINDOW)
    step, found = first_violation(bad, steps)
    assert step == 2 and any(v.startswith("swa: ") for v in found), found
    evictable, protected, free, pool = bad.figures()["swa"]
    assert (evictable + free, protected) == (SWA_SIZE + 3, 0)  # 3 = 15 - 4 - 8


def test_pr_27770_caught_at_hybrid_decode_step_20(sglang):
    """On the committed hybrid-decode (sliding(32) beside full): the first finish of a request
    that decoded past its window (step 20, seq 3's free) over-counts SWA."""
    from impls.engines.faults_engines import SwaWindowFloorDropped
    from impls.engines.sglang_components import replay
    r = replay("swa", "workloads/hybrid-decode.jsonl", tree_cls=SwaWindowFloorDropped)
    step, found = r["violations"][0]
    assert step == 20 and found[0].startswith("swa: "), found
    evictable, protected, free, pool = r["tree"].figures()["swa"]
    assert evictable + protected + free + r["tree"].held()["swa"] > pool


def test_pr_33773_no_checkpoint_headroom_fails_the_checkpoint_of_an_admitted_request(sglang):
    """3 state slots: request 0 (A) holds its active state and A's checkpoint (locked while
    it runs): 1 free. Request 1 needs 2 (its active state and its checkpoint): with the
    headroom it is refused; without, admitted on the 1 free slot, its checkpoint finds none
    free and none evictable, and SGLang's _alloc_mamba_slot asserts."""
    from impls.engines.faults_engines import MambaNoCheckpointHeadroom
    from impls.engines.sglang_components import MambaTree
    good = MambaTree(SIZE, 3)
    assert good.run(0, A)
    assert good.figures()["mamba"] == (0, 1, 3 - 2, 3)
    assert not good.run(1, A + B) and good.violations() == []
    bad = MambaNoCheckpointHeadroom(SIZE, 3)
    assert bad.run(0, A)
    with pytest.raises(AssertionError, match="Can not alloc mamba cache"):
        bad.run(1, A + B)


def test_pr_33773_caught_at_fork_wide_step_14(sglang):
    """fork-wide at 16 state slots: 14 requests running on one prompt hold 14 active states
    and its 1 checkpoint (locked): 16 - 14 - 1 = 1 free; the 15th (step 14, a fork) is
    admitted on it without the headroom, and its checkpoint finds nothing."""
    from impls.engines.faults_engines import MambaNoCheckpointHeadroom
    from impls.engines.sglang_components import replay
    assert replay("mamba", "workloads/fork-wide.jsonl")["violations"] == []
    r = replay("mamba", "workloads/fork-wide.jsonl", tree_cls=MambaNoCheckpointHeadroom)
    assert r["violations"] == [(14, ["SGLang raised AssertionError: Can not alloc mamba cache"])]
    assert r["tree"].held()["mamba"] == 14 and r["tree"].figures()["mamba"] == (0, 1, 0, 16)


def test_the_swa_lock_plants_are_caught_on_committed_workloads_too(sglang):
    """PR #27038's release past the boundary: at hybrid-windows step 6 (seq 5, a fork of seq 1)
    a node's SWA lock_ref reads -1. PR #28161's skipped release: at lifecycle-preempt
    step 29 (seq 4's free, the first moment no request runs) the windows released early are
    still locked."""
    from impls.engines.faults_engines import SwaLockPastBoundary, SwaReleaseSkipped
    from impls.engines.sglang_components import replay
    r = replay("swa", "workloads/hybrid-windows.jsonl", tree_cls=SwaLockPastBoundary)
    step, found = r["violations"][0]
    assert step == 6 and all(v.startswith("swa: ") and v.endswith("lock_ref -1") for v in found)
    r = replay("swa", "workloads/lifecycle-preempt.jsonl", tree_cls=SwaReleaseSkipped)
    step, found = r["violations"][0]
    assert step == 29 and not r["tree"].reqs
    assert all(v.startswith("swa: ") and "with no request running" in v for v in found), found


# --- seeded campaigns: kvbench fuzz's histories through each component ---------------------

@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_a_campaign_of_the_correct_engine_finds_nothing_and_stores_its_record(sglang, kind, tmp_path):
    """20 histories of kvbench fuzz's generator (seed 0) through each component: SGLang's
    figures and locks hold after every operation; the record goes to the results store as
    ``kvbench fuzz --store`` writes one."""
    from impls.engines.sglang_components import campaign
    r = campaign(kind, seed=0, histories=20, store=str(tmp_path))
    assert (r["histories"], r["findings"], r["errors"]) == (20, [], [])
    assert r["operations"] >= 20 * 8  # the generator draws 8 to 60 operations a history
    assert r["stored"].endswith(".parquet") and f"backend=sglang-{kind}-components" in r["stored"]


@pytest.mark.parametrize("kind, plant, says", [
    ("swa", "SwaLockPastBoundary", "lock_ref -1"),  # PR 27038
    ("swa", "SwaReleaseSkipped", "with no request running"),  # PR 28161
    ("swa", "SwaWindowFloorDropped", "!= pool"),  # PR 27770
    ("mamba", "MambaNoCheckpointHeadroom", "Can not alloc mamba cache"),  # PR 33773
])
def test_a_campaign_finds_the_planted_component_bugs_within_40_histories(sglang, kind, plant, says):
    """PR 27586's stale mapping needs a tombstone's recovery over freed slots, which 40 random
    histories do not reach (hybrid-windows does, at step 179); the other four show within 40."""
    from impls.engines import faults_engines
    from impls.engines.sglang_components import campaign
    r = campaign(kind, seed=0, histories=40, tree_cls=getattr(faults_engines, plant))
    assert r["errors"] == [] and len(r["findings"]) >= 1, r
    assert any(says in v for v in r["findings"][0]["first"]), r["findings"][0]
