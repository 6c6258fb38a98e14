"""Each check of the checker removed in turn, in a copy of the repository: its self-test must fail.

For every entry of kvbench/checking/checks.CHECKS, one edit of the checker's source that removes
that check alone (its condition made false, or what it reads left out), applied to a copy of
the tree in a temporary directory (the repository is never edited); then the check's self-test
(tests/checking/test_checker_selftest.py, or test_ledger_quantities.py for a ledger field) runs there
and must fail. Prints one line per check, ``check -> failing test`` (or ``NOT CAUGHT``), and the
checks whose removal no self-test notices; exits 1 if there are any but the IMPLIED ones.

    python scripts/checker_mutants.py [--only SUBSTRING]
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from kvbench.checking import checks  # noqa: E402
from kvbench.checking.tier_replay import TIER_FIELDS  # noqa: E402
from kvbench.contract.ledger import LEDGER_FIELDS  # noqa: E402

C, I, K, T = ("kvbench/checking/" + m for m in ("checker.py", "identities.py", "content.py",
                                                "tier_replay.py"))
OFF = "if False:"


def _ledger(f):
    return (C, "        for f in self.fields:\n            e, a = getattr(expected, f)",
            f"        for f in [x for x in self.fields if x != {f!r}]:\n            e, a = getattr(expected, f)", 1)


def _tier(f):
    return (T, "            for f in TIER_FIELDS:",
            f"            for f in [x for x in TIER_FIELDS if x != {f!r}]:", 1)


# check -> (file, text, replacement, occurrence of the text: 1 for the first)
REMOVALS = {
    "outcome: a call raises": (C, 'self.diverge(f"outcome of {e.what}"', '(lambda *a: None)(f"outcome of {e.what}"', 1),
    "outcome: refused what fits": (C, "if (expected is None) != (actual is None):",
                                   "if expected is None and actual is not None:", 1),
    "outcome: took what cannot fit": (C, "if (expected is None) != (actual is None):",
                                      "if expected is not None and actual is None:", 1),
    "a refused call leaves the ledger": (C, "if getattr(after, f) != getattr(before, f):", OFF, 1),
    "victims": (C, "if list(expected) != list(actual):", OFF, 1),
    **{f"ledger: {f}": _ledger(f) for f in LEDGER_FIELDS},
    "identity: no negative number": (I, "if isinstance(v, numbers.Real) and v < 0:", OFF, 1),
    "identity: no negative per-sequence count": (I, "bad = next(((s, n) for s, n in v.items() if n < 0), None)",
                                                 "bad = None", 1),
    "identity: no negative entry of a tuple": (I, "if isinstance(v, tuple) and any(n < 0 for n in v):", OFF, 1),
    "identity: used + free = pool": (I, "if led.blocks_used + led.blocks_free != N:", OFF, 1),
    "identity: cached <= free": (I, "if led.cached_blocks > led.blocks_free:", OFF, 1),
    "identity: group blocks add up": (I, "if led.group_blocks and sum(led.group_blocks) != led.blocks_used:", OFF, 1),
    "identity: token capacity": (I, "if led.token_capacity is not None and led.token_capacity != slots:", OFF, 1),
    "identity: usage by blocks": (I, "if paged and led.block_usage is not None and not _close(",
                                  "if False and led.block_usage is not None and not _close(", 1),
    "identity: usage by slots": (I, "if led.slot_usage is not None and not _close(",
                                 "if False and led.slot_usage is not None and not _close(", 1),
    "structure: a count per block": (I, "if len(ref) != N:", OFF, 1),
    "structure: free ids in the pool": (I, "if len(pooled) and (pooled.min() < 0 or pooled.max() >= N):", OFF, 1),
    "structure: each free block once": (I, "if np.count_nonzero(seen) < len(pooled):", OFF, 1),
    "structure: no negative reference count": (I, "neg = np.flatnonzero(ref < 0)", "neg = []", 2),
    "structure: free or in use": (I, "both = pooled[ref[pooled] > 0]", "both = pooled[:0]", 1),
    "structure: one reference per table": (I, "        wrong = np.flatnonzero(holders != ref)", "        wrong = []", 1),
    "structure: free count": (I, "if free + cached != led.blocks_free:", OFF, 1),
    "structure: cached count": (I, "if cached != led.cached_blocks:", OFF, 1),
    "structure: evictable + protected + free = pool": (I, "if free + cached + used != N:", OFF, 1),
    "structure: table ids in the pool": (I, "bad = np.flatnonzero((ids < 0) | (ids >= N))", "bad = []", 1),
    "structure: a held block is in use": (I, "unheld = np.flatnonzero((ref[ids] < 1) | (seen[ids] > 0))",
                                          "unheld = []", 1),
    "structure: a block serves one group": (I, "other = np.flatnonzero((group[ids] != -1) & (group[ids] != g))",
                                            "other = []", 1),
    "mirror: the free list continues": (I, "if not 0 <= low <= self.size:", OFF, 1),
    "mirror: free ids in the pool": (I, "out = pooled[(pooled < 0) | (pooled >= N)]", "out = pooled[:0]", 1),
    "mirror: one reference per table": (I, "wrong = np.flatnonzero(self.holders[touched] != ref)", "wrong = []", 1),
    "mirror: each free block once": (I, "if len(count) and count.max() > 1:", OFF, 1),
    "mirror: no negative reference count": (I, "neg = np.flatnonzero(ref < 0)", "neg = []", 1),
    "mirror: free or in use": (I, "both = np.flatnonzero((count > 0) & (ref > 0))", "both = []", 1),
    "order: block tables": (I, "    if not same:  # which sequence and group", "    if False:", 1),
    "order: free, whole": (I, "            if not np.array_equal(e, a):",
                           '            if not np.array_equal(e, a) and not name.startswith("free"):', 1),
    "order: cached, whole": (I, "            if not np.array_equal(e, a):",
                             '            if not np.array_equal(e, a) and not name.startswith("cached"):', 1),
    "order: free, at the step": (I, "if theirs.free_size != low + len(head) or not np.array_equal(mine, other):",
                                 OFF, 1),
    "order: cached, at the step": (I, 'return ("cached blocks (next evicted first)"',
                                   'return None and ("cached blocks (next evicted first)"', 1),
    "kv: the positions written": (C, "self.mark(s, start // B * B)", "self.mark(s, kv=False)", 1),
    "kv: the sharers of a written tail": (C, "for s, start in sharers.items():", "for s, start in {}.items():", 1),
    "kv: a new sequence whole": (C, "self.mark(op.seq)  # whole: a prefix hit", "self.mark(op.seq, kv=False)  #", 1),
    "kv: whole before a free": (C, "self.verify([(op.seq, 0, None)])  # whole, while", "pass  #", 1),
    "kv: whole before a preemption": (C, "self.verify([(op.seq, 0, None)])  # whole, while", "pass  #", 2),
    "kv: the random window": (C, "if len(self.live):", OFF, 1),
    "kv: every sequence at the end": (C, 'if gather == "all" or (gather in ("end", "touched") and last):',
                                      'if gather == "all" or (gather == "end" and last):', 1),
    "kv: equal to what was written": (K, '        return ("what it wrote or inherited", "different values",\n'
                                         '                f"first wrong position {p} (should hold what sequence {writer} wrote there)")',
                                      "        return None", 1),
    "kv: the shape read back": (K, 'return (seq, "what it wrote or inherited"', 'return None and (seq, "what it wrote or inherited"', 1),
    "kv: within the quantization bound": (K, 'return ("within the quantization bound", "outside", why) if why else None',
                                          "return None", 1),
    "state: equal to the recurrence": (K, "if not np.array_equal(got[i].astype(np.int64), w):", OFF, 1),
    "state: the shape read back": (K, "if got.shape[1:] != w.shape or len(got) != len(want):", OFF, 1),
    "tier: the blocks a store stored": (T, "if sorted(got) != sorted(positions):", OFF, 1),
    "tier: the content a store stored": (T, "if have.shape != want.shape or not np.array_equal(have, want):", OFF, 1),
    "tier: one ledger per tier": (T, "if len(actual) != len(expected):", OFF, 1),
    "tier: no negative count": (T, "            if negative:", "            " + OFF, 1),
    "tier: stored + storing + free = capacity": (T, 'if a["stored"] + a["storing"] + a["free"] != a["capacity"]:', OFF, 1),
    "tier: loading <= stored": (T, 'if a["loading"] > a["stored"]:', OFF, 1),
    **{f"tier: {f}": _tier(f) for f in TIER_FIELDS},
}


def tests_of(name: str) -> list:
    from test_checker_selftest import CASES
    if name.startswith("ledger: ") and name not in CASES:
        f = name.split(": ", 1)[1]
        return [f"tests/contract/test_ledger_quantities.py::test_paged_backend_wrong_in_one_quantity_fails_there[{f}]"]
    return [f"tests/checking/test_checker_selftest.py::test_a_backend_wrong_in_one_respect_fails_that_check[{name}]"]


def mutate(text: str, old: str, new: str, occurrence: int) -> str:
    at = -1
    for _ in range(occurrence):
        at = text.index(old, at + 1)  # ValueError: the source moved on, the removal is stale
    return text[:at] + new + text[at + len(old):]


def main(argv=None) -> int:
    sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="only the checks whose name holds this")
    args = ap.parse_args(argv)
    from test_checker_selftest import IMPLIED
    missing = {c.name for c in checks.CHECKS} - set(REMOVALS)
    if missing:
        print(f"no removal written for: {sorted(missing)}")
        return 1
    unnoticed = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "results", "__pycache__", ".venv"))
        for c in checks.CHECKS:
            if args.only not in c.name:
                continue
            path, old, new, occurrence = REMOVALS[c.name]
            original = (ROOT / path).read_text()
            (copy / path).write_text(mutate(original, old, new, occurrence))
            try:
                tests = [t for t in tests_of(c.name) if c.name not in IMPLIED]
                run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                                     cwd=copy, capture_output=True, text=True) if tests else None
            finally:
                (copy / path).write_text(original)
            if run is not None and run.returncode == 1:
                print(f"{c.name} -> {tests[0].split('::', 1)[1]} FAILS")
            elif run is None:
                print(f"{c.name} -> implied: {IMPLIED[c.name]}")
            else:
                unnoticed.append(c.name)
                print(f"{c.name} -> NOT CAUGHT (pytest exit {run.returncode})\n{run.stdout[-600:]}")
    print(f"{len(unnoticed)} removals no self-test notices: {unnoticed}")
    return 1 if unnoticed else 0


if __name__ == "__main__":
    sys.exit(main())
