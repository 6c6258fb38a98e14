"""Ratio gates: speed as a ratio of two timings taken in the same run, interleaved, never an
absolute time (see :mod:`kvbench.bench.gates` for why), higher is better; a gate fails below a
third of the typical ratio committed in results/gates/expected.json."""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvbench.bench.gates import bench_common, read_expected

MARGIN = 3.0  # a ratio gate fails below typical / MARGIN
REPEATS = 7


def _timed(fn) -> float:
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        if gc_was:
            gc.enable()


DECODE_BATCH = 256
TRIALS = 7  # interleaved timings per repeat, of which the fastest counts
GATHER_TOKENS = 4096  # 4 MiB of K/V in the suite's 1 KiB-per-token model


def _fastest(reference, subject, trials: int = TRIALS) -> tuple[float, float]:
    """Time ``reference(i)`` and ``subject(i)`` alternately for i = 1..trials after an untimed
    warm-up (i = 0); the fastest of each. Noise on a shared machine only adds time, so the
    minimum is the estimate least moved by it (a context switch lasts milliseconds)."""
    reference(0), subject(0)
    ref, subj = [], []
    for i in range(1, trials + 1):
        ref.append(_timed(lambda: reference(i)))
        subj.append(_timed(lambda: subject(i)))
    return min(ref), min(subj)


def _subject(factory, num_blocks: int, store_kv: bool):
    """The backend under test: the NumPy backend, or ``factory(config)`` (a planted one)."""
    common = bench_common()
    if factory is None:
        return common.make_backend("numpy", num_blocks=num_blocks, store_kv=store_kv)
    from kvbench.contract.protocol import CacheConfig
    return factory(CacheConfig(model=common.model(), block_size=common.BLOCK_SIZE,
                               num_blocks=num_blocks, store_kv=store_kv))


def decode_vs_scatter(factory=None) -> tuple[float, float]:
    """(seconds of the floor of a decode step over 256 sequences: their 256 new tokens of K/V
    written into a pool of the same shape at one slot per sequence, a single fancy-indexed
    assignment as vLLM's reshape_and_cache does; of the subject's decode step, K/V written).
    Step i is trial i (common.decode_batch has room for 16)."""
    common = bench_common()
    seqs, kv = list(range(DECODE_BATCH)), common.zeros_kv(DECODE_BATCH)
    subj = common.fill_decode_batch(_subject(factory, DECODE_BATCH * 9, True), DECODE_BATCH)
    pool = common.zeros_kv(DECODE_BATCH * 9 * common.BLOCK_SIZE)
    slots = np.arange(DECODE_BATCH) * 9 * common.BLOCK_SIZE  # one per sequence, far apart

    def floor(step):
        pool[slots + step] = kv

    return _fastest(floor, lambda step: subj.append(seqs, [1] * DECODE_BATCH, kv, step=step + 1))


def decode_vs_object(factory=None, batch: int = DECODE_BATCH) -> tuple[float, float]:
    """(seconds of one decode step over ``batch`` sequences in the per-object Python model
    impls/object_model.py, in the subject), ledger only on both sides."""
    common = bench_common()
    seqs = list(range(batch))
    ref, _ = common.decode_batch("object", batch, store_kv=False)
    subj = common.fill_decode_batch(_subject(factory, batch * 9, False), batch, store_kv=False)
    return _fastest(lambda step: ref.append(seqs, [1] * batch, None, step=step + 1),
                    lambda step: subj.append(seqs, [1] * batch, None, step=step + 1))


def decode1_vs_object(factory=None) -> tuple[float, float]:
    """decode_vs_object at batch 1: the fixed cost of a call, where NumPy's array steps cost
    more than the object model's few attribute updates (the backend's small-batch path)."""
    return decode_vs_object(factory, batch=1)


def gather_vs_copy(factory=None) -> tuple[float, float]:
    """(seconds of np.copy of 4 MiB, of gathering the same 4 MiB from 256 scattered blocks)."""
    common = bench_common()
    blocks = 2 * -(-GATHER_TOKENS // common.BLOCK_SIZE)
    subj = common.fill_interleaved_pair(_subject(factory, blocks, True), GATHER_TOKENS)
    src = common.zeros_kv(GATHER_TOKENS) + np.float16(1)
    return _fastest(lambda i: np.copy(src), lambda i: np.asarray(subj.gather(0)))


def gather_into_vs_copyto(factory=None) -> tuple[float, float]:
    """(seconds of np.copyto of 4 MiB into a buffer; of gathering the same 4 MiB from 256
    scattered blocks into a buffer of the same shape, reused from call to call)."""
    common = bench_common()
    blocks = 2 * -(-GATHER_TOKENS // common.BLOCK_SIZE)
    subj = common.fill_interleaved_pair(_subject(factory, blocks, True), GATHER_TOKENS)
    src = common.zeros_kv(GATHER_TOKENS) + np.float16(1)
    dst, into = np.empty_like(src), np.empty_like(src)
    return _fastest(lambda i: np.copyto(dst, src), lambda i: subj.gather(0, out=into))


CHECK_REQUESTS = 200  # a decode trace of ~1,150 operations: batches of up to 32, Alpaca lengths


def _decode_trace():
    from kvbench.traces import generators as G
    from kvbench.traces.builder import peak_blocks
    t = G.decode_streams(0, num_requests=CHECK_REQUESTS, max_batch=32, arrival_rate=2, law="alpaca")
    t.header.settings = {"block_size": 16, "num_blocks": peak_blocks(t.ops, 16) + 64}
    return t.columnar()


def check_vs_replay(factory=None, gather: str = "touched") -> tuple[float, float]:
    """(seconds of the NumPy backend replaying a ~1,150-operation decode trace alone, K/V
    zeros; of the checker replaying it beside the oracle, every K/V it could change read back).
    A checker whose cost grows with sequence length drops the ratio many times."""
    from kvbench.analyses import suite
    from kvbench.checking.checker import check
    from kvbench.contract import registry
    common = bench_common()
    trace = _decode_trace()
    cfg = suite.config_for(trace)
    kv = common.kv_buffer(trace, cfg)
    make = factory or (lambda: registry.create("numpy", cfg))

    def checked(_):
        v = check(trace, make(), gather=gather)
        if not v.valid:
            raise AssertionError(f"check_vs_replay: the checker failed its own trace: {v.divergence}")

    return _fastest(lambda _: common.replay(make(), trace, kv), checked, trials=2)


QUANT_ROWS = 8192  # 4 MiB of float32 rows of 128 channels (one KV head per row)


def quantize_vs_copy(factory=None) -> tuple[float, float]:
    """(seconds of np.copyto of 4 MiB of float32; of the NumPy quantizer's int8 per-token codes,
    scales and zero points of the same 4 MiB, into arrays it already holds)."""
    from impls import quant_kernels, quant_numpy
    from kvbench import quant as Q
    ok, why = quant_kernels.available()
    if not ok:  # the typical ratio is the compiled kernels'
        raise NotImplementedError(why)
    x = np.random.default_rng(0).standard_normal((QUANT_ROWS, 128), dtype=np.float32)
    dst = np.empty_like(x)
    scheme = Q.QuantScheme(8, False, "token")
    quantize = factory or quant_numpy.quantize
    qt = quantize(x, scheme)
    return _fastest(lambda _: np.copyto(dst, x), lambda _: quantize(x, scheme, out=qt))


@dataclass(frozen=True)
class RatioGate:
    name: str
    about: str
    measure: Callable  # (factory) -> (reference seconds, subject seconds)


RATIO_GATES = {g.name: g for g in (
    RatioGate("decode_vs_scatter", "decode step over 256 sequences, K/V written: one scatter of "
              "the same 256 tokens into a pool / NumPy", decode_vs_scatter),
    RatioGate("decode_vs_object", "decode step over 256 sequences, ledger only: per-object Python "
              "model (impls/object_model.py) / NumPy", decode_vs_object),
    RatioGate("decode1_vs_object", "decode step of one sequence, ledger only: per-object Python "
              "model / NumPy (its small-batch path)", decode1_vs_object),
    RatioGate("gather_vs_copy", "np.copy of 4 MiB / NumPy gather of the same 4 MiB from 256 "
              "scattered blocks", gather_vs_copy),
    RatioGate("gather_into_vs_copyto", "np.copyto of 4 MiB into a buffer / NumPy gather of the "
              "same 4 MiB from 256 scattered blocks into a reused buffer", gather_into_vs_copyto),
    RatioGate("check_vs_replay", "a ~1,150-operation decode trace: the NumPy backend's replay "
              "alone / the checker's replay of it, K/V read back", check_vs_replay),
    RatioGate("quantize_vs_copy", "np.copyto of 4 MiB of float32 / the NumPy quantizer's int8 "
              "per-token codes of the same 4 MiB (compiled kernels)", quantize_vs_copy),
)}


@dataclass
class RatioResult:
    name: str
    ratios: list  # reference / subject per repeat
    typical: float | None
    skipped: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    @property
    def floor(self) -> float | None:
        return None if self.typical is None else self.typical / MARGIN

    @property
    def ok(self) -> bool:
        return bool(self.skipped) or self.typical is None or self.median >= self.floor

    def __str__(self) -> str:
        if self.skipped:
            return f"ratio {self.name}: skipped ({self.skipped})"
        spread = f"{min(self.ratios):.3g}..{max(self.ratios):.3g}"
        if self.typical is None:
            return (f"ratio {self.name}: median {self.median:.3g} ({spread} over {len(self.ratios)}) "
                    f"- no typical value recorded (`kvbench gates --update-ratios`)")
        state = "ok" if self.ok else "FAIL"
        return (f"ratio {self.name}: median {self.median:.3g} ({spread} over {len(self.ratios)} "
                f"repeats), typical {self.typical:.3g}, floor {self.floor:.3g} = typical / "
                f"{MARGIN:g}: {state}"
                + ("" if self.ok else f" - the subject is {self.typical / self.median:.3g}x slower "
                   f"relative to its reference than usual"))


def ratio_gate(name: str, expected: dict | None = None, *, factory=None,
               repeats: int = REPEATS) -> RatioResult:
    """Median over ``repeats`` of reference / subject seconds; ``factory`` builds the subject
    (default: the NumPy backend)."""
    gate = RATIO_GATES[name]
    expected = read_expected() if expected is None else expected
    typical = expected.get("ratios", {}).get(name, {}).get("typical")
    ratios = []
    try:
        for _ in range(repeats):
            ref, subj = gate.measure(factory)
            ratios.append(ref / subj)
    except NotImplementedError as e:
        return RatioResult(name, [], typical, skipped=str(e))
    return RatioResult(name, ratios, typical)


def ratio_gates(expected: dict | None = None, names=None, repeats: int = REPEATS) -> list:
    expected = read_expected() if expected is None else expected
    return [ratio_gate(n, expected, repeats=repeats) for n in names or RATIO_GATES]
