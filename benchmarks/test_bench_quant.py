"""Quantize and dequantize throughput (GB/s of float32 input) beside ``np.copyto`` of the same
bytes, timed before each round of the same test: ``extra_info["ratio_vs_copy"]`` is copy time /
operation time (medians).

Both write into memory they already hold (``out=``), as the copy does: a fresh 256 MiB output
costs about as much as the copy itself in page faults.

    pytest benchmarks/test_bench_quant.py --benchmark-enable                   # 16 MiB
    KVBENCH_BENCH_FULL=1 pytest benchmarks/test_bench_quant.py --benchmark-enable   # 256 MiB
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from impls import quant_numpy
from kvbench import quant as Q

FULL = os.environ.get("KVBENCH_BENCH_FULL") == "1"
MIB = 256 if FULL else 16
HEAD_DIM = 128  # channels: a KV head
ROUNDS = 7

SCHEMES = {
    "int8-sym-channel": Q.QuantScheme(8),
    "int8-asym-token": Q.QuantScheme(8, False, "token"),
    "int4-asym-group32": Q.QuantScheme(4, False, "group", group_size=32),
    "int4-asym-channel": Q.QuantScheme(4, False, "channel"),  # KIVI's keys
}
# numpy; torch at its default threads and at one (a fairer match for the one-thread copy);
# the float64 reference: the naive whole-array, many-pass version.
IMPLS = ["numpy", "torch", "torch-1-thread", "reference"]


@pytest.fixture(scope="module")
def data():
    rows = MIB * 2**20 // 4 // HEAD_DIM
    return np.random.default_rng(0).standard_normal((rows, HEAD_DIM), dtype=np.float32)


class CopyClock:
    """Times ``np.copyto(dst, x)`` once before each benchmark round (pedantic's ``setup``), so
    copy and operation alternate and share the machine's state of the moment."""

    def __init__(self, x):
        self.x, self.dst, self.times = x, np.empty_like(x), []

    def __call__(self):
        t0 = time.perf_counter()
        np.copyto(self.dst, self.x)
        self.times.append(time.perf_counter() - t0)

    @property
    def median(self) -> float:
        if not self.times:
            self()
        return float(np.median(self.times))


class Impl:
    """One implementation with its input converted and its thread setting applied."""

    def __init__(self, which: str, data):
        self.which = which
        self.threads = None
        if which == "reference":
            self.mod, self.x, self.out_kw = Q, data, False
            return
        if which == "numpy":
            self.mod, self.x, self.out_kw = quant_numpy, data, True
            return
        torch = pytest.importorskip("torch")
        from impls import quant_torch

        self.mod, self.x, self.out_kw = quant_torch, torch.from_numpy(data), True
        if which == "torch-1-thread":
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def close(self):
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)


@pytest.fixture(params=IMPLS)
def impl(request, data):
    if request.param == "reference" and FULL:
        pytest.skip("the float64 reference takes minutes at 256 MiB")
    it = Impl(request.param, data)
    yield it
    it.close()


def record(benchmark, nbytes: int, clock: CopyClock, impl: Impl | None = None) -> None:
    copy_s = clock.median
    benchmark.extra_info.update(input_bytes=nbytes, copy_gbps=nbytes / copy_s / 1e9)
    if impl is not None and impl.which.startswith("torch"):
        import torch

        benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    if benchmark.disabled:  # --benchmark-disable (the default): one run as a smoke test
        return
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(gbps=nbytes / median / 1e9, ratio_vs_copy=copy_s / median)


def test_copy(benchmark, data):
    clock = CopyClock(data)
    benchmark.pedantic(np.copyto, (np.empty_like(data), data), setup=clock, rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, data.nbytes, clock)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantize(benchmark, data, impl, scheme):
    s = SCHEMES[scheme]
    qt = impl.mod.quantize(impl.x, s)
    kwargs = {"out": qt} if impl.out_kw else {}
    clock = CopyClock(data)
    benchmark.pedantic(impl.mod.quantize, (impl.x, s), kwargs, setup=clock, rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, data.nbytes, clock, impl)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_dequantize(benchmark, data, impl, scheme):
    s = SCHEMES[scheme]
    qt = impl.mod.quantize(impl.x, s)
    out = impl.mod.dequantize(qt)
    kwargs = {"out": out} if impl.out_kw else {}
    clock = CopyClock(data)
    benchmark.pedantic(impl.mod.dequantize, (qt,), kwargs, setup=clock, rounds=ROUNDS, warmup_rounds=1)
    record(benchmark, data.nbytes, clock, impl)
