"""Device check of the torch backend: the checker on every committed workload on the device, and
GPU benchmarks, written as JSON result records.

    scripts/gpu_check.sh [OUTDIR]                         # on a CUDA machine (OUTDIR: $OUT)
    python -m kvbench.cli.gpu --device cpu --size tiny --out /tmp/check   # anywhere, ~1 min

What it writes under OUTDIR:

- ``run-torch-<device>.json``: the same record ``kvbench run --backend torch --device <device>``
  writes (one row per workload x policy: verdict, first divergence, evictions, time).
- ``gpu_check-<device>.json``: a ``gpu_check`` record: machine (GPU name, torch and CUDA
  versions), parameters, and rows, one per figure:

  - ``check``: per workload and policy, the checker's verdict for the torch backend on the device;
  - ``decode``: one batched decode step (one token per sequence) at each batch size, for numpy,
    torch with the K/V already on the device (``kv=device``), and torch handed NumPy K/V
    (``kv=host``, the copy included); tokens/s, K/V bytes written/s, and ``torch_vs_numpy``;
  - ``bandwidth``: a prefill's K/V write and a whole-sequence gather against a plain copy of the
    same bytes (device to device for torch, host for numpy; gather to NumPy against a device to
    host copy): ``fraction_of_copy`` = copy time / its time;
  - ``memory``: bytes the formula gives the pool (num_blocks * block_size * bytes_per_token)
    against what the allocator reports (CUDA: ``memory_allocated`` before and after building
    the pool; cpu: the pool tensor's own size).

Timing: on CUDA every torch figure is the median of CUDA-event intervals after warm-up rounds (an
event pair around the call, then synchronize: no host clock around asynchronous work); numpy and
every cpu figure use the host clock around synchronous calls. Exit status: 0 when every check
passed and the memory figures agree, 1 otherwise, 2 for bad arguments.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvbench.analyses import suite
from kvbench.analyses.settings import RunSettings
from kvbench.bench import records
from kvbench.contract import registry
from kvbench.contract.formulas import ModelSpec, blocks_needed
from kvbench.contract.protocol import CacheConfig, Prompt

# full: for a GPU. tiny: the same code paths in seconds, on any machine.
SIZES = {
    "full": dict(model=ModelSpec("bench-8x8x128", layers=8, kv_heads=8, head_dim=128),  # 32 KiB/token
                 batches=(1, 4, 16, 64, 256, 1024), rounds=50, warmup=5, seq_tokens=8192,
                 bw_rounds=30, memory_blocks=4096),
    "tiny": dict(model=ModelSpec("tiny-2x2x16", layers=2, kv_heads=2, head_dim=16),  # 256 B/token
                 batches=(1, 16), rounds=5, warmup=1, seq_tokens=256, bw_rounds=5, memory_blocks=64),
}
BLOCK = 16
MEMORY_SLACK = 2 << 20  # allocator rounding allowed on top of the pool and its index tensors


class Clock:
    """Median seconds of a call: CUDA events on a CUDA device, else the host clock."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def median(self, fn, rounds: int, warmup: int, setup=None, host: bool = False,
               max_seconds: float = 10.0) -> float:
        """``setup`` runs untimed before every call; ``host``: time with the host clock anyway
        (for NumPy, whose calls are synchronous). Stops early, after 3 or more rounds, once the
        timed calls add up to ``max_seconds`` (a slow NumPy case must not eat the device time)."""
        events = self.cuda and not host
        for _ in range(warmup):
            if setup:
                setup()
            fn()
        if events:
            self.torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            if setup:
                setup()
            if events:
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            if len(times) >= 3 and sum(times) > max_seconds:
                break
        return statistics.median(times)


def kv_array(tokens: int, model: ModelSpec, seed: int = 0) -> np.ndarray:
    shape = (tokens, 2, model.layers, model.kv_heads, model.head_dim)
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(np.float16)


def run_checks(traces, device: str, out: Path) -> list[dict]:
    """The checker on every trace (every policy it runs under) with the torch backend."""
    loaded = suite.load_traces(traces)
    rows = suite.run_suite(loaded, ["torch"], RunSettings(device=device), policy="auto")
    rec = records.record("run", rows, {"traces": [str(p) for p in traces], "backends": ["torch"],
                                       "device": device, "policy": "auto"}, device=device)
    records.write(rec, out / f"run-torch-{device.replace(':', '')}.json")
    return [{"bench": "check", "workload": r["workload"], "policy": r["policy"], "status": r["status"],
             "ops": r["ops"], "divergence": r["divergence"], "error": r["error"],
             "not_applicable": r["not_applicable"],
             "evictions": r["evictions"], "backend_ms": r["backend_ms"]} for r in rows]


def bench_decode(torch, device, size: dict, clock: Clock) -> list[dict]:
    model, rounds, warmup = size["model"], size["rounds"], size["warmup"]
    rows = []
    for batch in size["batches"]:
        # Sequence i starts with i % 16 + 1 tokens: every step sends one sequence in 16 into a
        # new block, so each timed call does the same work. The pool holds every round.
        prompts = [i % BLOCK + 1 for i in range(batch)]
        steps = rounds + warmup
        num_blocks = sum(blocks_needed(p + steps, BLOCK) for p in prompts)
        kv_host = kv_array(batch, model)
        medians = {}
        for impl, kv_where in (("numpy", "host"), ("torch", "device"), ("torch", "host")):
            backend = registry.create(impl, CacheConfig(
                model=model, block_size=BLOCK, num_blocks=num_blocks,
                device=str(device) if impl == "torch" else "cpu"))
            for seq, p in enumerate(prompts):
                backend.prefill(seq, Prompt(p), kv_array(p, model, seq))
            kv = torch.from_numpy(kv_host).to(device) if kv_where == "device" else kv_host
            seqs, ones, calls = list(range(batch)), [1] * batch, [0]

            def step():
                calls[0] += 1
                backend.append(seqs, ones, kv, step=calls[0])

            m = clock.median(step, rounds, warmup, host=impl == "numpy")
            led = backend.ledger()
            assert led.tokens == {s: p + calls[0] for s, p in enumerate(prompts)}, "decode lost tokens"
            key = f"{impl}-kv={kv_where}" if impl == "torch" else impl
            medians[key] = m
            rows.append({"bench": "decode", "impl": key, "batch": batch, "median_s": m,
                         "tokens_per_s": batch / m, "write_bytes_per_s": batch * model.bytes_per_token / m,
                         "blocks_used": led.blocks_used, "fragmentation": led.fragmentation,
                         "torch_vs_numpy": medians["numpy"] / m if impl == "torch" else None})
            backend.close()
    return rows


def bench_bandwidth(torch, device, size: dict, clock: Clock) -> list[dict]:
    model, T, rounds = size["model"], size["seq_tokens"], size["bw_rounds"]
    nbytes = T * model.bytes_per_token
    kv_host = kv_array(T, model)
    rows = []

    def row(what, impl, m, copy_m, copy_kind):
        rows.append({"bench": "bandwidth", "what": what, "impl": impl, "bytes": nbytes, "median_s": m,
                     "bytes_per_s": nbytes / m, "copy": copy_kind, "copy_median_s": copy_m,
                     "copy_bytes_per_s": nbytes / copy_m, "fraction_of_copy": copy_m / m})

    cfg = CacheConfig(model=model, block_size=BLOCK, num_blocks=blocks_needed(T, BLOCK))
    # numpy: host copy of the same bytes.
    dst = np.empty_like(kv_host)
    host_copy = clock.median(lambda: np.copyto(dst, kv_host), rounds, 2, host=True)
    nb = registry.create("numpy", cfg)

    def numpy_fresh():
        if 0 in nb.row_of:
            nb.free(0)

    whole = Prompt(T)
    row("write", "numpy", clock.median(lambda: nb.prefill(0, whole, kv_host), rounds, 2, numpy_fresh,
                                       host=True),
        host_copy, "np.copyto")
    row("gather", "numpy", clock.median(lambda: nb.gather(0), rounds, 2, host=True), host_copy, "np.copyto")

    # torch: device-to-device copy of the same bytes; gather to NumPy against device-to-host.
    src = torch.from_numpy(kv_host).to(device)
    dst = torch.empty_like(src)
    dev_copy = clock.median(lambda: dst.copy_(src), rounds, 3)
    if device.type == "cuda":
        to_host, to_host_kind = clock.median(lambda: src.cpu(), rounds, 2), "Tensor.cpu (device to host)"
    else:  # gather's .cpu() is free on cpu: the yardstick is the plain copy
        to_host, to_host_kind = dev_copy, "Tensor.copy_"
    tb = registry.create("torch", dataclasses.replace(cfg, device=str(device)))

    def torch_fresh():
        if 0 in tb.row_of:
            tb.free(0)

    copy_kind = "Tensor.copy_ (device to device)" if device.type == "cuda" else "Tensor.copy_"
    row("write", f"torch-{device.type}", clock.median(lambda: tb.prefill(0, whole, src), rounds, 2, torch_fresh),
        dev_copy, copy_kind)
    got = tb.gather(0)
    assert np.array_equal(got, kv_host), "gather after prefill differs from what was written"
    row("gather_tensor", f"torch-{device.type}", clock.median(lambda: tb.gather_tensor(0), rounds, 3),
        dev_copy, copy_kind)
    row("gather", f"torch-{device.type}", clock.median(lambda: tb.gather(0), rounds, 2),
        to_host, to_host_kind)
    tb.close()
    return rows


def memory_check(torch, device, size: dict) -> list[dict]:
    model = size["model"]
    cfg = CacheConfig(model=model, block_size=BLOCK, num_blocks=size["memory_blocks"], device=str(device))
    formula = cfg.num_blocks * cfg.block_size * model.bytes_per_token
    row = {"bench": "memory", "num_blocks": cfg.num_blocks, "block_size": BLOCK,
           "bytes_per_token": model.bytes_per_token, "formula_pool_bytes": formula}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        b = registry.create("torch", cfg)
        torch.cuda.synchronize(device)
        rep = b.memory_report()
        delta = torch.cuda.memory_allocated(device) - before
        extra = delta - formula
        row.update(rep, allocated_delta=delta, allocated_over_formula=delta / formula,
                   ok=0 <= extra <= rep["index_bytes"] + MEMORY_SLACK)
    else:
        b = registry.create("torch", cfg)
        rep = b.memory_report()
        row.update(rep, ok=rep["pool_bytes"] == formula)
    b.close()
    return [row]


if __name__ == "__main__":  # the program is kvbench.cli.gpu's: importing it from here made a loop
    print("python -m kvbench.bench.gpu: error: the device check is now `python -m kvbench.cli.gpu` "
          "(the same options)", file=sys.stderr)
    sys.exit(2)
