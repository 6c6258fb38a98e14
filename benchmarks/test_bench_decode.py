"""Decode-step throughput, K/V write and gather bandwidth: NumPy and torch (cpu) paged backends.

    .venv/bin/python -m pytest benchmarks/test_bench_decode.py --benchmark-enable

Model: 2 layers x 8 KV heads x 128, fp16 (8 KiB of K/V per token, one contiguous row per token
in both pools). Blocks of 16.

- ``decode``: one batched decode step (one token per sequence) at batch 1, 64, 256, 1024. Sequence
  i starts with ``i % 16 + 1`` tokens, so every step (batch 1 aside) sends exactly one sequence in
  16 into a new block: each timed call is the next decode step and does the same work. The pool
  holds every round. ``extra_info``: tokens/s, bytes of K/V written per second, and in the torch
  row ``torch_vs_numpy`` = numpy's median step time / torch's (above 1: torch is faster).
- ``copy``: a plain copy of 16 MiB (``np.copyto`` / ``Tensor.copy_``), the bandwidth yardstick.
- ``write``: prefill of one 2048-token sequence (16 MiB of K/V), freed again in the untimed setup;
  ``gather``: the whole sequence read back. Both report ``fraction_of_copy`` = copy's median time
  for the same bytes / theirs (1.0: as fast as a plain copy).

Inputs are built outside the timed functions; each test keeps its backend to itself. torch runs
on one intra-op thread, as NumPy does: on a shared 2-core machine a second thread mostly waits for
a core (a 16 KiB index_copy_ then takes milliseconds), and the ratio would measure the thread pool.
"""
from __future__ import annotations

import numpy as np
import pytest

from impls.numpy_paged import NumpyPaged
from kvbench.contract.formulas import ModelSpec, blocks_needed
from kvbench.contract.protocol import CacheConfig

torch = pytest.importorskip("torch")
from impls.torch_paged import TorchPaged  # noqa: E402

MODEL = ModelSpec("bench-2x8x128", layers=2, kv_heads=8, head_dim=128)  # 8 KiB per token
BLOCK = 16
TOKEN_SHAPE = (2, MODEL.layers, MODEL.kv_heads, MODEL.head_dim)
IMPLS = {"numpy": NumpyPaged, "torch": TorchPaged}
BATCHES = (1, 64, 256, 1024)
ROUNDS = {1: 200, 64: 100, 256: 50, 1024: 30}
WARMUP = 3
SEQ_TOKENS = 2048  # write / gather: 2048 * 8 KiB = 16 MiB
MEDIANS: dict = {}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(num_blocks: int) -> CacheConfig:
    return CacheConfig(model=MODEL, block_size=BLOCK, num_blocks=num_blocks)


def kv_array(tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens,) + TOKEN_SHAPE, dtype=np.float32).astype(np.float16)


def median(benchmark, key) -> float | None:
    """The benchmark's median (s), remembered under ``key``; None when benchmarks are disabled."""
    if benchmark.stats is None:
        return None
    MEDIANS[key] = benchmark.stats.stats.median
    return MEDIANS[key]


def add_ledger(benchmark, backend) -> None:
    led = backend.ledger()
    benchmark.extra_info.update(blocks_used=led.blocks_used, bytes_in_use=led.bytes_in_use,
                                fragmentation=led.fragmentation)


# --- decode throughput -----------------------------------------------------------------------

DECODE_CASES = [(b, impl) for b in BATCHES for impl in IMPLS]  # numpy first: torch's row has the ratio


@pytest.mark.parametrize("batch,impl", DECODE_CASES, ids=[f"{b}-{i}" for b, i in DECODE_CASES])
def test_decode(benchmark, batch, impl):
    prompts = [i % BLOCK + 1 for i in range(batch)]
    steps = ROUNDS[batch] + WARMUP + 1  # + the one call of a disabled run
    backend = IMPLS[impl](config(sum(blocks_needed(p + steps, BLOCK) for p in prompts)))
    for seq, p in enumerate(prompts):
        backend.prefill(seq, p, kv_array(p, seq), final_tokens=p + steps)
    seqs, ones = list(range(batch)), [1] * batch
    kv = kv_array(batch)
    calls = [0]

    def decode_step():
        calls[0] += 1
        backend.append(seqs, ones, kv, step=calls[0])

    benchmark.group = f"decode step, batch {batch}"
    benchmark.pedantic(decode_step, rounds=ROUNDS[batch], warmup_rounds=WARMUP, iterations=1)
    # Every sequence grew by one token per call; its blocks follow ceil(T/B).
    led = backend.ledger()
    assert led.tokens == {s: p + calls[0] for s, p in enumerate(prompts)}
    assert led.blocks_used == sum(blocks_needed(p + calls[0], BLOCK) for p in prompts)
    add_ledger(benchmark, backend)
    m = median(benchmark, ("decode", batch, impl))
    if m is None:
        return
    benchmark.extra_info["tokens_per_s"] = batch / m
    benchmark.extra_info["write_bytes_per_s"] = batch * MODEL.bytes_per_token / m
    if impl == "torch" and ("decode", batch, "numpy") in MEDIANS:
        benchmark.extra_info["torch_vs_numpy"] = MEDIANS[("decode", batch, "numpy")] / m


# --- bandwidth: a plain copy, a prefill's write, a whole-sequence gather ----------------------

NBYTES = SEQ_TOKENS * MODEL.bytes_per_token


@pytest.mark.parametrize("impl", list(IMPLS))
def test_copy(benchmark, impl):
    src = kv_array(SEQ_TOKENS)
    dst = np.empty_like(src)
    if impl == "torch":
        src, dst = torch.from_numpy(src).clone(), torch.empty(src.shape, dtype=torch.float16)
        fn = lambda: dst.copy_(src)  # noqa: E731
    else:
        fn = lambda: np.copyto(dst, src)  # noqa: E731
    benchmark.group = f"bandwidth, {NBYTES >> 20} MiB"
    benchmark.pedantic(fn, rounds=50, warmup_rounds=3, iterations=1)
    m = median(benchmark, ("copy", impl))
    if m is not None:
        benchmark.extra_info["bytes_per_s"] = NBYTES / m


def with_copy_ratio(benchmark, impl, key):
    m = median(benchmark, key)
    if m is None:
        return
    benchmark.extra_info["bytes_per_s"] = NBYTES / m
    if ("copy", impl) in MEDIANS:
        benchmark.extra_info["fraction_of_copy"] = MEDIANS[("copy", impl)] / m


@pytest.mark.parametrize("impl", list(IMPLS))
def test_write(benchmark, impl):
    backend = IMPLS[impl](config(blocks_needed(SEQ_TOKENS, BLOCK)))
    kv = kv_array(SEQ_TOKENS)

    def fresh():
        if 0 in backend.ledger().tokens:
            backend.free(0)

    benchmark.group = f"bandwidth, {NBYTES >> 20} MiB"
    benchmark.pedantic(lambda: backend.prefill(0, SEQ_TOKENS, kv), setup=fresh, rounds=30,
                       warmup_rounds=2, iterations=1)
    assert np.array_equal(backend.gather(0), kv)
    add_ledger(benchmark, backend)
    with_copy_ratio(benchmark, impl, ("write", impl))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_gather(benchmark, impl):
    backend = IMPLS[impl](config(blocks_needed(SEQ_TOKENS, BLOCK)))
    kv = kv_array(SEQ_TOKENS)
    backend.prefill(0, SEQ_TOKENS, kv)
    benchmark.group = f"bandwidth, {NBYTES >> 20} MiB"
    out = benchmark.pedantic(lambda: backend.gather(0), rounds=50, warmup_rounds=3, iterations=1)
    assert np.array_equal(out, kv)
    add_ledger(benchmark, backend)
    with_copy_ratio(benchmark, impl, ("gather", impl))
