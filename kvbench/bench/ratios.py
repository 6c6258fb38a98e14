"""Ratio gates: speed as a ratio of two timings taken in the same run, never an absolute time
(see :mod:`kvbench.bench.gates` for why), higher is better.

Each gate times a reference and a subject (the path it guards) alternately. A *block* times
``trials`` interleaved pairs, on fresh fixtures warmed up (or, for a subject that changes
nothing, on those of the block before, ``reuse`` blocks a set); the fastest of each side gives
the block's log ratio (check_vs_replay's block is one replay each side, in lockstep: see
:func:`check_vs_replay`). A gate takes ``blocks`` of them and compares them with the baseline's
blocks, recorded on purpose (``kvbench gates --update-ratios``) in results/gates/ratios.json
with its commit and machine, by the Mann-Whitney test asv's comparisons use: the slowdown is
estimated by the Hodges-Lehmann shift (the median of every baseline block's log ratio less every
run block's), and bounded below by the shift's distribution-free confidence bound at ``ALPHA``
(the Mann-Whitney U's normal approximation; scipy is not a dependency). A gate fails when the
estimate is above ``FACTOR`` *and* the bound above 1: asv's rule for ``asv continuous
--factor``, a factor and a significance test. ``FACTOR`` is the geometric midpoint of 1x and
1.25x: on this loaded 2-core machine a run's estimate moved by a standard deviation of 1-9%
(results/gates/power.md), so that a threshold halfway gives either side the same margin.

A gate that fails is sampled once more, on fresh fixtures, and decided again on both samples'
blocks together (twice the blocks: a narrower bound, and a burst of load over one sample weighs
half). One run in 20 of an unchanged tree read 1.12-1.13x on one of the eight gates when a
neighbour's burst fell on its blocks, while a regression is in every block
(results/gates/power.md tables the verdicts of the first sample alone and of both).

Times are CPU times of this process (``time.process_time``: user and system, all threads), not
wall times: on a shared machine the wall time of a step counts the time other processes held
the core, which moved block ratios by 10-30% here; the CPU time does not. What the gates guard
is computation, so nothing they should catch hides from that clock.

``KVBENCH_GATE_SLOWDOWN`` is a measurement hook, off unless set: a factor (``1.25``) by which
every subject is slowed, or ``name=factor,...`` for some gates only. Each timed subject call is
followed, inside the timed region, by a busy wait of (factor - 1) times its own duration: CPU
work, as a real regression's would be. scripts/gate_power.py plants 1.1x to 2x with it to
measure how often the gates catch each slowdown, and how often an unchanged tree fails.

Over 500 lines: the eight gates' fixtures, the table naming them, their sampler, decision and
baseline are one unit; each fixture is a few lines that only the table uses.
"""
from __future__ import annotations

import datetime as _dt
import functools
import gc
import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Callable

import numpy as np

from kvbench.bench.gates import bench_common
from kvbench.bench.records import RESULTS_DIR
from kvbench.contract import registry
from kvbench.outputs import write_text

BASELINE_PATH = RESULTS_DIR / "gates" / "ratios.json"
# The backends' code the gates time, reached by name as a plug-in's is (kvbench imports no impls/).
PAGED_KERNELS = "impls.paged_kernels:kernels"  # the NumPy pool's compiled steps, None without numba
QUANT_KERNELS_AVAILABLE = "impls.quant_kernels:available"
NUMPY_QUANTIZE = "impls.quant_numpy:quantize"
FACTOR = 1.12  # a gate fails on a slowdown estimated above this (sqrt(1.25) = 1.118) ...
# ... in the test suite, above this: a neighbour on a CI machine's cores moves one run by more
# than the gates' own margin, and a red main for no change costs more than a slowdown seen later
CI_FACTOR = 1.5
ALPHA = 0.01  # ... when its one-sided lower confidence bound at this level is above 1
BASELINE_RUNS = 4  # --update-ratios records this many times a gate's blocks
SLOWDOWN_ENV = "KVBENCH_GATE_SLOWDOWN"


def _timed(fn, clock=time.perf_counter) -> float:
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = clock()
        fn()
        return clock() - t0
    finally:
        if gc_was:
            gc.enable()


DECODE_BATCH = 256
TRIALS = 7  # interleaved timings per block, of which the fastest counts
# a gate whose fixtures or timings are cheap takes the fastest of more: the fastest of 7 of a
# memory-bound copy still moved with the neighbours' load
MANY_TRIALS = 15
GATHER_TOKENS = 4096  # 4 MiB of K/V in the suite's 1 KiB-per-token model


def _fastest(reference, subject, trials: int = TRIALS, warm: bool = True,
             clock=time.perf_counter) -> tuple[float, float]:
    """Time ``reference(i)`` and ``subject(i)`` alternately for i = 1..trials after an untimed
    warm-up (i = 0; unless not ``warm``) by ``clock`` (the gates: the CPU clock); the fastest of
    each. Noise only adds time (a cache another process evicted, an interrupt), so the minimum
    is the estimate least moved by it."""
    if warm:
        reference(0), subject(0)
    ref, subj = [], []
    for i in range(1, trials + 1):
        ref.append(_timed(lambda: reference(i), clock))
        subj.append(_timed(lambda: subject(i), clock))
    # Under heavy load the CPU clock was seen not to move across a call of ~20 us: such a
    # reading measured nothing
    ref, subj = [t for t in ref if t > 0], [t for t in subj if t > 0]
    if not ref or not subj:
        raise RuntimeError(f"the clock {clock.__name__} did not move in any of {trials} trials")
    return min(ref), min(subj)


def planted_slowdowns(spec: str | None = None) -> dict:
    """{gate: factor} from ``KVBENCH_GATE_SLOWDOWN`` (or ``spec``): "1.25" slows every gate,
    "decode_vs_object=1.5,gather_vs_copy=2" those named; a ValueError says what is wrong."""
    spec = os.environ.get(SLOWDOWN_ENV, "") if spec is None else spec
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.rpartition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = float("nan")
        if not factor >= 1:
            raise ValueError(f"{SLOWDOWN_ENV}={spec!r}: {part!r} is not a factor >= 1 "
                             f"(write 1.25, or gate=1.25)")
        if name and name not in RATIO_GATES:
            raise ValueError(f"{SLOWDOWN_ENV}={spec!r}: no ratio gate {name!r}; gates: "
                             f"{', '.join(RATIO_GATES)}")
        for gate in [name] if name else RATIO_GATES:
            out[gate] = factor
    return out


def _cpu_read_cost(reads: int = 2000) -> float:
    """Seconds one turn of a busy wait on the CPU clock takes (a read and a compare): its reads
    cost microseconds here, as much as a tenth of the shortest subject."""
    until = float("inf")
    t0 = time.process_time()  # by the CPU clock too: a preempted loop took no more of it
    for _ in range(reads):
        if time.process_time() >= until:
            break
    return (time.process_time() - t0) / (reads + 1)


def slowed(subject, factor: float):
    """``subject`` followed by a busy wait of (factor - 1) times its own CPU time: the planted
    slowdown of ``KVBENCH_GATE_SLOWDOWN`` (a measurement hook, never on by default).

    The wait runs by the CPU clock the gates time with: a wait by the wall clock spent less CPU
    whenever the scheduler took the core away, and the fastest trials a block keeps are those,
    so that a 2x plant measured 1.46-1.61x on the memory-bound gates under load. The plant's
    own reads of the clock are taken off the wait, so that the gate times ``factor`` times the
    subject's CPU time and one read, as it would a subject that much slower."""
    if factor == 1:
        return subject
    read = _cpu_read_cost()

    def run(i):
        c0 = time.process_time()
        subject(i)
        _planted_wait(factor, c0, time.process_time(), read)

    return run


def _planted_wait(factor: float, c0: float, c1: float, read: float) -> None:
    """The busy wait of :func:`slowed` after a subject call that spent c0 -> c1 of CPU time."""
    if factor == 1:
        return
    # c1 - c0 = the subject and one read; the gate's span holds two reads more (c0, c1)
    # and the wait's last, which overshoots by half a read on average
    until = c1 + (factor - 1) * (c1 - c0 - read) - 2.5 * read
    while time.process_time() < until:
        pass


def _subject(factory, num_blocks: int, store_kv: bool):
    """The backend under test: the NumPy backend, or ``factory(config)`` (a planted one)."""
    common = bench_common()
    if factory is None:
        return common.make_backend("numpy", num_blocks=num_blocks, store_kv=store_kv)
    from kvbench.contract.protocol import CacheConfig
    return factory(CacheConfig(model=common.model(), block_size=common.BLOCK_SIZE,
                               num_blocks=num_blocks, store_kv=store_kv))


def compiled_decode() -> str:
    """Why the decode gates cannot run as designed here ("" when they can): their baselines time
    the NumPy pool's compiled decode step, and without numba the vectorized step runs, 2-5x
    slower: a reading of another path, not a regression."""
    if registry.load(PAGED_KERNELS)() is None:
        return ("numba cannot be imported, so the NumPy pool's decode step runs uncompiled; the "
                "baseline times the compiled one (impls/paged_kernels.py): install numba, a "
                "kvbench dependency")
    return ""


def compiled_quantizer() -> str:
    """Why quantize_vs_steps cannot run here ("" when it can): its subject is the compiled kernels."""
    ok, why = registry.load(QUANT_KERNELS_AVAILABLE)()
    return "" if ok else why


def decode_vs_scatter(factory=None) -> tuple[Callable, Callable]:
    """(reference, subject) for trial i: the floor of a decode step over 256 sequences (their
    256 new tokens of K/V written into a pool of the same shape at one slot per sequence, a
    single fancy-indexed assignment as vLLM's reshape_and_cache does); the subject's decode
    step, K/V written.
    Step i + 1 is trial i (common.decode_batch has room for 16: MANY_TRIALS + 1)."""
    common = bench_common()
    seqs, kv = list(range(DECODE_BATCH)), common.zeros_kv(DECODE_BATCH)
    subj = common.fill_decode_batch(_subject(factory, DECODE_BATCH * 9, True), DECODE_BATCH)
    pool = common.zeros_kv(DECODE_BATCH * 9 * common.BLOCK_SIZE)
    slots = np.arange(DECODE_BATCH) * 9 * common.BLOCK_SIZE  # one per sequence, far apart

    def floor(step):
        pool[slots + step] = kv

    return floor, lambda step: subj.append(seqs, [1] * DECODE_BATCH, kv, step=step + 1)


def decode_vs_object(factory=None, batch: int = DECODE_BATCH, steps: int = 1,
                     trials: int = MANY_TRIALS) -> tuple[Callable, Callable]:
    """(reference, subject): ``steps`` decode steps over ``batch`` sequences in the per-object
    Python model impls/object_model.py, in the subject; ledger only on both sides. Trial i
    (0..``trials``) takes steps i * steps + 1 .. (i + 1) * steps (common.fill_decode_batch
    leaves room for 64 tokens a sequence; the pools get a block a sequence for each 16 steps)."""
    common = bench_common()
    seqs, ones = list(range(batch)), [1] * batch
    if (trials + 1) * steps > 64:
        raise ValueError(f"decode_vs_object: {trials} trials of {steps} steps outgrow the 64 "
                         f"tokens of room a sequence has")
    blocks = batch * (8 + -(-(trials + 1) * steps // common.BLOCK_SIZE))
    ref = common.fill_decode_batch(common.make_backend("object", num_blocks=blocks, store_kv=False),
                                   batch, store_kv=False)
    subj = common.fill_decode_batch(_subject(factory, blocks, False), batch, store_kv=False)

    def stepper(backend):
        def run(i):
            for k in range(i * steps + 1, (i + 1) * steps + 1):
                backend.append(seqs, ones, None, step=k)
        return run

    return stepper(ref), stepper(subj)


DECODE1_STEPS = 8  # a one-sequence step takes ~4 us, the CPU clock ~3.6 us to read: time 8 in a row


def decode1_vs_object(factory=None) -> tuple[Callable, Callable]:
    """decode_vs_object at batch 1, 8 steps a trial: the fixed cost of a call, where NumPy's
    array steps cost more than the object model's few attribute updates (the backend's
    small-batch path)."""
    return decode_vs_object(factory, batch=1, steps=DECODE1_STEPS, trials=TRIALS)


def gather_fixture(factory=None) -> tuple:
    """(subject, source): the pool holding two sequences of 4 MiB in alternate blocks (256
    scattered blocks each), and the reference's source, 4 MiB of that pool's own storage as one
    contiguous range. Both sides read the one allocation: a reference copying an array of its
    own timed other pages (huge or not, placed where they fell), which moved the ratio by more
    than a gate's margin from one machine, or one fixture, to the next."""
    common = bench_common()
    blocks = 2 * -(-GATHER_TOKENS // common.BLOCK_SIZE)
    subj = common.fill_interleaved_pair(_subject(factory, blocks, True), GATHER_TOKENS)
    shape = common.zeros_kv(0).shape[1:]
    return subj, subj.slots[:GATHER_TOKENS].reshape((GATHER_TOKENS, *shape))


def gather_vs_copy(factory=None) -> tuple[Callable, Callable]:
    """(reference, subject): np.copy of 4 MiB of the pool's storage; gathering 4 MiB from 256
    scattered blocks of it."""
    subj, src = gather_fixture(factory)
    return lambda i: np.copy(src), lambda i: np.asarray(subj.gather(0))


def gather_into_vs_copyto(factory=None) -> tuple[Callable, Callable]:
    """(reference, subject): 4 MiB of the pool's storage copied into a buffer as 256 consecutive
    blocks; the NumPy pool's gather of its 256 scattered blocks into the same buffer (reused
    from call to call). The reference copies by the primitive the gather copies with (np.take
    of whole blocks, mode "clip"): against one np.copyto of 4 MiB from an array of its own the
    ratio was 0.88 on the VM its baseline was recorded on, 0.93 on another and 0.72-0.77 on a
    third (issue 45), the same tree on each. One 4 MiB memcpy (whose strategy for a large copy
    follows the cache sizes the machine reports) and 256 copies of 16 KiB, on other pages, need
    not move together from machine to machine (a likely cause, not one measured there)."""
    subj, src = gather_fixture(factory)
    into = np.empty_like(src)
    blocks = subj.slots.reshape(-1, subj.B * subj.slots.shape[1])
    order = np.arange(GATHER_TOKENS // subj.B)
    rows = into.reshape(len(order), -1)
    return (lambda i: np.take(blocks, order, axis=0, mode="clip", out=rows),
            lambda i: subj.gather(0, out=into))


CHECK_REQUESTS = 16  # a decode trace of 170 operations: batches of up to 32, Alpaca lengths


@functools.lru_cache(maxsize=1)
def _decode_trace():  # read only: built once per process
    from kvbench.traces import generators as G
    from kvbench.traces.builder import peak_blocks
    t = G.decode_streams(0, num_requests=CHECK_REQUESTS, max_batch=32, arrival_rate=2, law="alpaca")
    t.header.settings = {"block_size": 16, "num_blocks": peak_blocks(t.ops, 16) + 64}
    return t.columnar()


def check_vs_replay(factory=None, slowdown: float = 1.0, gather: str = "touched") -> tuple[float, float]:
    """CPU seconds (reference, subject) of one block: the NumPy backend replaying a 170-operation
    decode trace alone, K/V zeros; the checker replaying it beside the oracle, every K/V it
    could change read back. A checker whose cost grows with sequence length drops the ratio
    many times.

    The two replays go in lockstep, an operation of the checker's then the same of the
    backend's (the checker's progress hook steps the other), and each side's time is the sum of
    its operations': a replay by the checker takes ~0.2 s, over which the CPU's speed moved by up
    to 2x under load here, so that a reference timed before or after it saw another machine.
    ``slowdown`` plants a busy wait of (slowdown - 1) times the checker's time, paid once after
    its last operation: a wait after each one (:func:`slowed`) reads the CPU clock hundreds of
    times a millisecond, which slowed the backend's operation run just after it by 12-18% (a
    planted 1.25x read as 1.12x)."""
    from kvbench.analyses import suite
    from kvbench.checking.checker import check
    from kvbench.checking.driver import replay_steps
    from kvbench.contract import registry
    trace = _decode_trace()
    cfg = suite.config_for(trace)
    kv = bench_common().kv_buffer(trace, cfg)
    make = factory or (lambda: registry.create("numpy", cfg))
    read = _cpu_read_cost() if slowdown != 1 else 0.0
    clock = time.process_time
    spent = {"reference": 0.0, "subject": 0.0}

    class Lockstep:  # check()'s progress: called after each of its operations
        def __init__(self):
            self.mark = clock()

        def update(self, _):
            c = clock()
            spent["subject"] += c - self.mark
            next(reference)
            self.mark = clock()
            spent["reference"] += self.mark - c

    gc_was = gc.isenabled()  # no collection inside the block (as timeit does)
    gc.disable()
    try:
        c = clock()
        reference = replay_steps(make(), trace, kv)
        next(reference)  # its backend built, as the checker's is inside its timed span
        spent["reference"] += clock() - c
        hook = Lockstep()
        verdict = check(trace, make(), gather=gather, progress=hook)
        c = clock()
        spent["subject"] += c - hook.mark
        _planted_wait(slowdown, c - spent["subject"], c, read)
        spent["subject"] += clock() - c
    finally:
        if gc_was:
            gc.enable()
    if not verdict.valid:
        raise AssertionError(f"check_vs_replay: the checker failed its own trace: "
                             f"{verdict.divergence or verdict.error}")
    if next(reference, None) is not None:
        raise AssertionError("check_vs_replay: the checker stopped before the trace's end")
    return spent["reference"], spent["subject"]


# 512 KiB of float32 rows of 128 channels (one KV head per row), within a core's 1 MiB of L2
# here: 4 MiB, streamed from the shared L3, moved the kernels' time by the neighbours' traffic and
# by where each fixture's pages fell (the ratio 3.41..3.92 from one process to the next)
QUANT_ROWS = 1024
QUANT_CALLS = 8  # calls a trial, each side: one of the kernels' takes ~0.1 ms


def quantize_vs_steps(factory=None) -> tuple[Callable, Callable]:
    """(reference, subject): the NumPy quantizer's own steps (uncompiled) making the int8
    per-token codes, scales and zero points of 512 KiB of float32, 8 times; its compiled kernels
    making the same, both into arrays they already hold.

    The reference does the subject's work on the same data: against np.copyto of 4 MiB (the
    reference before) the ratio moved 0.30..0.55 from one process to the next, a copy being
    bound by the memory the neighbours share and the kernel by its arithmetic; against the
    steps, on data within the core's cache, the four quarters of the baseline's recording came
    within 2.7% of each other (results/gates/power.md: the estimates of the campaign's runs)."""
    from kvbench import quant as Q
    numpy_quantize = registry.load(NUMPY_QUANTIZE)
    x = np.random.default_rng(0).standard_normal((QUANT_ROWS, 128), dtype=np.float32)
    scheme = Q.QuantScheme(8, False, "token")
    quantize = factory or numpy_quantize
    # glibc's malloc serves a block this large from fresh pages (mmap) until one as large was
    # freed (its threshold then rises to it): freed here, the steps' temporaries come from the
    # heap whatever ran before (from fresh pages, faults and all, the ratio was 8.0, not 3.8)
    np.empty(4 << 20, np.uint8)  # freed at once
    qt, qs = quantize(x, scheme), numpy_quantize(x, scheme, compiled=False)
    def steps(_):
        for _ in range(QUANT_CALLS):
            numpy_quantize(x, scheme, out=qs, compiled=False)

    def kernels(_):
        for _ in range(QUANT_CALLS):
            quantize(x, scheme, out=qt)

    return steps, kernels


TIER_KIB = 256  # the smallest block of the tiers' bandwidth goal (0.8 of a copy from 256 KiB)
TIER_BYTES = 32 << 20  # past the caches: both sides copy memory to memory


def tier_copy_vs_copy(factory=None) -> tuple[Callable, Callable]:
    """(reference, subject): two np.copyto of 32 MiB; the NumPy pool's store of the same 32 MiB
    (128 scattered blocks of 256 KiB) to its host tier, then its load back (its own copies).
    Within the caches (4 MiB) the ratio moved from 0.8 to 0.2 from one fixture to the next."""
    if factory is not None:
        raise NotImplementedError("tier_copy_vs_copy times the NumPy pool's own tier copies")
    from kvbench.bench.tier_copies import tier_copies
    tc = tier_copies("numpy", TIER_KIB, TIER_BYTES, tiers=("host",))
    buf = np.empty_like(tc.flat)

    def copies(_):
        np.copyto(buf, tc.flat)
        np.copyto(tc.flat, buf)

    def store_load(_):
        tc.store("host")
        tc.load("host")

    return copies, store_load


@dataclass(frozen=True)
class RatioGate:
    name: str
    about: str
    pair: Callable  # (factory) -> (reference(i), subject(i)) on fresh fixtures
    blocks: int  # blocks per decision, sized so that the gates fit CI's time
    trials: int = TRIALS
    reuse: int = 1  # blocks timed on one set of fixtures (a subject that changes nothing)
    # pair times a whole block itself: (factory, slowdown) -> (reference, subject) CPU seconds
    times_blocks: bool = False
    # () -> why the gate cannot run as designed in this install ("" when it can): it is then
    # skipped, never failed, as its baseline times a path this install does not have
    needs: Callable = lambda: ""


RATIO_GATES = {g.name: g for g in (
    RatioGate("decode_vs_scatter", "decode step over 256 sequences, K/V written: one scatter of "
              "the same 256 tokens into a pool / NumPy", decode_vs_scatter, 31, trials=MANY_TRIALS,
              needs=compiled_decode),
    RatioGate("decode_vs_object", "decode step over 256 sequences, ledger only: per-object Python "
              "model (impls/object_model.py) / NumPy", decode_vs_object, 41, trials=MANY_TRIALS,
              needs=compiled_decode),
    RatioGate("decode1_vs_object", "decode step of one sequence, ledger only: per-object Python "
              "model / NumPy (its small-batch path)", decode1_vs_object, 61),
    RatioGate("gather_vs_copy", "np.copy of 4 MiB of the pool's storage / NumPy gather of 4 MiB "
              "from 256 scattered blocks of it", gather_vs_copy, 40, trials=MANY_TRIALS, reuse=5),
    RatioGate("gather_into_vs_copyto", "4 MiB of the pool's storage copied into a buffer as 256 "
              "consecutive blocks (np.take) / NumPy gather of 256 scattered blocks of it into the "
              "same buffer",
              gather_into_vs_copyto, 40,
              trials=MANY_TRIALS, reuse=5),
    RatioGate("check_vs_replay", "a 170-operation decode trace: the NumPy backend's replay "
              "alone / the checker's replay of it, K/V read back, op by op in lockstep",
              check_vs_replay, 30, trials=1, times_blocks=True),
    RatioGate("quantize_vs_steps", "the NumPy quantizer's steps (uncompiled) / its compiled "
              "kernels, int8 per-token codes of 512 KiB of float32, 8 times", quantize_vs_steps, 35,
              trials=MANY_TRIALS, reuse=5, needs=compiled_quantizer),
    RatioGate("tier_copy_vs_copy", "two np.copyto of 32 MiB / the NumPy pool's store of the same "
              "32 MiB (128 scattered blocks of 256 KiB) to its host tier and its load back",
              tier_copy_vs_copy, 25, reuse=5),
)}


def _blocks(name: str, factory=None, slowdown: float = 1.0):
    """Gate ``name``'s blocks one at a time, as log ratios (ln reference / subject seconds), on
    fixtures built afresh every ``reuse`` blocks; NotImplementedError when it cannot run here."""
    gate = RATIO_GATES[name]
    why = gate.needs()
    if why:
        raise NotImplementedError(why)
    if gate.times_blocks:
        gate.pair(factory, slowdown)  # warm-up: the first block in a process builds its caches
        while True:
            ref, subj = gate.pair(factory, slowdown)
            yield math.log(ref / subj)
    for b in itertools.count():
        if b % gate.reuse == 0:
            reference, subject = gate.pair(factory)
            subject = slowed(subject, slowdown)
        ref, subj = _fastest(reference, subject, gate.trials, warm=b % gate.reuse == 0,
                             clock=time.process_time)
        yield math.log(ref / subj)


def sample_in_turn(counts: dict, *, factory=None, slowdowns: dict | None = None) -> tuple[dict, dict]:
    """({gate: log ratios}, {gate: why it cannot run here}): ``counts[gate]`` blocks of each
    gate, the gates taking turns block by block (the one furthest behind its count next), so
    that each gate's blocks span the whole run: the neighbours' load moved a gate's ratio by
    5-15% from one minute to the next, and a gate timed in one stretch drew one such minute.
    ``factory`` builds the subjects, ``slowdowns`` plants slowdowns ({gate: factor})."""
    slowdowns = slowdowns or {}
    streams = {n: _blocks(n, factory, slowdowns.get(n, 1.0)) for n in counts}
    logs, skipped = {n: [] for n in counts}, {}
    order = list(counts)
    while True:
        behind = [n for n in order if n in logs and len(logs[n]) < counts[n]]
        if not behind:
            return logs, skipped
        name = min(behind, key=lambda n: len(logs[n]) / counts[n])
        try:
            logs[name].append(next(streams[name]))
        except NotImplementedError as e:
            skipped[name] = str(e)
            del logs[name]


def compare(baseline, candidate, *, alpha: float = ALPHA) -> tuple[float, float]:
    """(slowdown, lower bound): the candidate's slowdown against the baseline, exp of the
    Hodges-Lehmann shift (the median of every baseline log ratio less every candidate's), and
    exp of the shift's one-sided lower confidence bound at ``alpha``: the k-th smallest of those
    differences, k = mn/2 - z sqrt(mn(m + n + 1)/12) of the Mann-Whitney U's normal
    approximation (0 when k < 1: too few blocks to say)."""
    b, c = np.asarray(baseline, float), np.asarray(candidate, float)
    if not len(b) or not len(c):
        raise ValueError("compare: both the baseline and the candidate need at least one block")
    diffs = np.sort(np.subtract.outer(b, c), axis=None)
    m, n = len(b), len(c)
    z = NormalDist().inv_cdf(1 - alpha)
    k = math.floor(m * n / 2 - z * math.sqrt(m * n * (m + n + 1) / 12))
    return math.exp(np.median(diffs)), math.exp(diffs[k - 1]) if k >= 1 else 0.0


@dataclass
class RatioResult:
    name: str
    log_ratios: list  # one per block, ln(reference / subject)
    baseline: list | None  # the recorded blocks' log ratios (None: nothing recorded)
    skipped: str = ""
    slowdown: float = float("nan")
    lower: float = float("nan")
    planted: float = 1.0
    factor: float = FACTOR
    # both samples' blocks together, decided again, when the first sample failed
    recheck: "RatioResult | None" = None

    def __post_init__(self):
        if self.log_ratios and self.baseline:
            self.slowdown, self.lower = compare(self.baseline, self.log_ratios)

    @property
    def median(self) -> float:
        return math.exp(float(np.median(self.log_ratios))) if self.log_ratios else float("nan")

    @property
    def typical(self) -> float | None:
        return math.exp(float(np.median(self.baseline))) if self.baseline else None

    @property
    def first_ok(self) -> bool:
        """Whether the first sample passed (a failing one is decided again by ``recheck``)."""
        return bool(self.skipped) or not self.baseline or not (
            self.slowdown > self.factor and self.lower > 1)

    @property
    def ok(self) -> bool:
        return self.first_ok if self.recheck is None else self.recheck.ok

    def __str__(self) -> str:
        if self.skipped:
            return f"ratio {self.name}: SKIPPED, cannot run as designed here ({self.skipped})"
        planted = f" [planted slowdown {self.planted:g}x]" if self.planted != 1 else ""
        ratios = np.exp(self.log_ratios)
        spread = f"{ratios.min():.3g}..{ratios.max():.3g} over {len(ratios)} blocks"
        if not self.baseline:
            return (f"ratio {self.name}: median {self.median:.3g} ({spread}) - no baseline "
                    f"recorded (`kvbench gates --update-ratios`){planted}")
        state = "ok" if self.ok else "FAIL"
        again = self.recheck
        if again is not None:
            state = (f"over it; sampled again, both samples' {len(again.log_ratios)} blocks: "
                     f"{again.slowdown:.3g}x slower, >= {again.lower:.3g}x: {state}")
        return (f"ratio {self.name}: median {self.median:.3g} ({spread}), baseline "
                f"{self.typical:.3g} ({len(self.baseline)} blocks): {self.slowdown:.3g}x slower, "
                f">= {self.lower:.3g}x at {1 - ALPHA:.0%}; fails above {self.factor:g}x: {state}"
                + (f" - the subject is {self.slowdown:.3g}x slower relative to its reference "
                   f"than in the baseline" if not self.ok else "") + planted)


def read_baseline(path: Path | str = BASELINE_PATH) -> dict:
    """results/gates/ratios.json ({} when absent): {"gates": {name: {"log_ratios": [...]}}, ...}."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a ratio baseline (not JSON: {e})") from None
    if not isinstance(data.get("gates"), dict):
        raise ValueError(f"{path}: not a ratio baseline (no \"gates\" object)")
    return data


def baseline_of(baseline: dict, name: str) -> list | None:
    return baseline.get("gates", {}).get(name, {}).get("log_ratios") or None


def ratio_gate(name: str, baseline: dict | None = None, *, factory=None,
               blocks: int | None = None, slowdown: float | None = None,
               factor: float = FACTOR, confirm: bool = True) -> RatioResult:
    """Gate ``name`` against ``baseline`` (default: results/gates/ratios.json); ``factory``
    builds the subject (default: the NumPy backend); ``slowdown`` plants one (default: from
    ``KVBENCH_GATE_SLOWDOWN``, a measurement hook); ``factor``: the slowdown it fails above;
    ``confirm``: a failing first sample is sampled again, and decided on both."""
    planted = {name: planted_slowdowns().get(name, 1.0) if slowdown is None else slowdown}
    return ratio_gates(baseline, [name], blocks, factor, factory=factory, slowdowns=planted,
                       confirm=confirm)[0]


def ratio_gates(baseline: dict | None = None, names=None, blocks: int | None = None,
                factor: float = FACTOR, *, factory=None, slowdowns: dict | None = None,
                confirm: bool = True) -> list:
    """Every gate (or those ``names`` names) against ``baseline``, timed in turn block by block
    (:func:`sample_in_turn`); ``blocks`` per gate (default: each one's own count); ``slowdowns``
    planted ({gate: factor}; default: ``KVBENCH_GATE_SLOWDOWN``'s). With ``confirm``, the gates
    that fail are sampled again, in turn, and decided again on both samples' blocks."""
    baseline = read_baseline() if baseline is None else baseline
    names = list(names or RATIO_GATES)
    planted = planted_slowdowns() if slowdowns is None else slowdowns

    def judged(name, logs):
        return RatioResult(name, logs, baseline_of(baseline, name), planted=planted.get(name, 1.0),
                           factor=factor)

    counts = {n: blocks or RATIO_GATES[n].blocks for n in names}
    logs, skipped = sample_in_turn(counts, factory=factory, slowdowns=planted)
    results = {n: RatioResult(n, [], baseline_of(baseline, n), skipped=skipped[n], factor=factor)
               if n in skipped else judged(n, logs[n]) for n in names}
    failed = {n: counts[n] for n, r in results.items() if not r.ok}
    if confirm and failed:
        more, _ = sample_in_turn(failed, factory=factory, slowdowns=planted)
        for n, second in more.items():
            results[n].recheck = judged(n, results[n].log_ratios + second)
    return [results[n] for n in names]


def record_baseline(names=None, runs: int = BASELINE_RUNS) -> dict:
    """A fresh baseline: each gate's blocks ``runs`` times over (a baseline with less noise than
    the run it judges), the gates timed in turn as a run times them, so that each one's blocks
    span the whole recording; with the commit, machine, load and date it was measured on."""
    from kvbench.provenance import commit_info, machine_info
    logs, skipped = sample_in_turn({n: RATIO_GATES[n].blocks * runs for n in names or RATIO_GATES})
    gates = {name: {"about": RATIO_GATES[name].about, "blocks": len(got),
                    "trials": RATIO_GATES[name].trials,
                    "median_ratio": round(math.exp(float(np.median(got))), 4),
                    "log_ratios": [round(x, 5) for x in got]} for name, got in logs.items()}
    machine = machine_info()
    return {"about": "Baseline of the ratio gates (kvbench/bench/ratios.py): per gate, the log "
                     "ratios ln(reference / subject CPU seconds) of its blocks. A gate fails when "
                     f"a run's blocks are more than {FACTOR:g}x slower than this baseline's (the "
                     f"Hodges-Lehmann shift) and the Mann-Whitney lower bound of the shift at "
                     f"{1 - ALPHA:.0%} is above 1. Re-record with `kvbench gates --update-ratios`.",
            "recorded": {**commit_info(), "machine": machine["platform"], "cpus": machine["cpus"],
                         "load_average": [round(x, 2) for x in os.getloadavg()],
                         "nice": os.nice(0),
                         "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")},
            "factor": FACTOR, "alpha": ALPHA, "gates": gates, "skipped": skipped}


def merge_baseline(old: dict, new: dict) -> dict:
    """``old`` with the gates ``new`` recorded (or found unable to run) replaced by ``new``'s,
    each of those with its own provenance (``recorded``); the other gates' kept as they were."""
    redone = set(new["gates"]) | set(new["skipped"])
    gates = {n: g for n, g in old.get("gates", {}).items() if n not in redone}
    gates.update({n: {**g, "recorded": new["recorded"]} for n, g in new["gates"].items()})
    skipped = {n: why for n, why in old.get("skipped", {}).items() if n not in redone}
    return {**old, "about": new["about"], "gates": gates, "skipped": {**skipped, **new["skipped"]}}


def write_baseline(baseline: dict, path: Path | str = BASELINE_PATH) -> Path:
    return write_text(path, json.dumps(baseline, indent=1, sort_keys=True) + "\n")
