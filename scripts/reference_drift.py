"""How check_vs_replay's ratio moves with what runs beside it, for candidate references.

Each block is one checked replay of the gate's 170-operation decode trace (the subject), with
one or two reference replays stepped after each of its operations, in lockstep, as
kvbench.bench.ratios.check_vs_replay times them: the NumPy backend alone (`np`, the gate's
reference), the per-object Python model (`obj`), or both (`np+obj`: the NumPy one first). Prints
the median of each reference's CPU time / the subject's over the blocks, with the load average:
run it alone, then beside a neighbour, and compare the lines.

    nice -n 10 .venv/bin/python scripts/reference_drift.py --blocks 20
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "scripts"]

from kvbench.analyses import suite  # noqa: E402
from kvbench.bench import ratios as R  # noqa: E402
from kvbench.checking.checker import check  # noqa: E402
from kvbench.checking.driver import replay_steps  # noqa: E402
from kvbench.contract import registry  # noqa: E402

VARIANTS = {"np": ("np",), "obj": ("obj",), "np+obj": ("np", "obj")}


def block(sides, trace, cfg, kv) -> dict:
    """CPU seconds of each side over one lockstep replay."""
    clock = time.process_time
    spent = dict.fromkeys(sides + ("subject",), 0.0)
    steps = {}
    gc.disable()
    try:
        for side in sides:
            c = clock()
            steps[side] = (replay_steps(registry.create("numpy", cfg), trace, kv) if side == "np" else
                           replay_steps(registry.create("python-objects",
                                                        dataclasses.replace(cfg, store_kv=False)), trace))
            next(steps[side])
            spent[side] += clock() - c

        class Lockstep:
            def __init__(self):
                self.mark = clock()

            def update(self, _):
                c = clock()
                spent["subject"] += c - self.mark
                for side in sides:
                    next(steps[side])
                    spent[side] += clock() - c
                    c = clock()
                self.mark = c

        hook = Lockstep()
        verdict = check(trace, registry.create("numpy", cfg), progress=hook)
        spent["subject"] += clock() - hook.mark
    finally:
        gc.enable()
    if not verdict.valid:
        raise AssertionError(f"the checker failed the gate's trace: {verdict.divergence or verdict.error}")
    return spent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=20, help="blocks per variant (default 20)")
    args = ap.parse_args(argv)
    trace = R._decode_trace()
    cfg = suite.config_for(trace)
    kv = R.bench_common().kv_buffer(trace, cfg)
    for sides in VARIANTS.values():  # warm-up: the first block in a process builds its caches
        block(sides, trace, cfg, kv)
    ratios = {(name, side): [] for name, sides in VARIANTS.items() for side in sides}
    for _ in range(args.blocks):  # the variants in turn, so that they see the same minutes
        for name, sides in VARIANTS.items():
            spent = block(sides, trace, cfg, kv)
            for side in sides:
                ratios[name, side].append(spent[side] / spent["subject"])
    print(f"load {os.getloadavg()[0]:.2f}  " + "  ".join(
        f"{name}:{side} {statistics.median(r):.4f}" for (name, side), r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
