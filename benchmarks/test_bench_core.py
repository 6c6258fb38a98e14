"""One decode step at batch 256 (one token per sequence): NumPy block pool vs per-object model.

    .venv/bin/python -m pytest benchmarks/test_bench_core.py --benchmark-enable

Both run in the same session on the same state: 256 sequences with prompts of 1..511 tokens
(seed 0), blocks of 16, the tiny model. The NumPy backend stores K/V (the step writes 256 tokens'
K/V, pre-generated); the per-object model keeps the ledger only. Each timed call is the next
decode step on a pool large enough for every round, so every call does the same kind of work
(about one sequence in 16 crosses into a new block). The median ratio is stored in the NumPy
row's ``extra_info`` as ``speedup_vs_python_objects``.
"""
from __future__ import annotations

import numpy as np
import pytest

from impls.numpy_paged import NumpyPaged
from impls.object_model import ObjectModel
from kvbench.contract.formulas import blocks_needed, get_model
from kvbench.contract.protocol import CacheConfig, kv_tokens

BATCH = 256
BLOCK = 16
ROUNDS, WARMUP = 300, 20
MODEL = get_model("tiny")
PROMPTS = np.random.default_rng(0).integers(1, 512, BATCH).tolist()
STEPS = ROUNDS + WARMUP + 1  # + the single call of a disabled run
NUM_BLOCKS = sum(blocks_needed(p + STEPS, BLOCK) for p in PROMPTS)

BACKENDS = {  # per-object first: the NumPy row then carries the ratio
    "python-objects": (ObjectModel, False),
    "numpy": (NumpyPaged, True),
}
MEDIANS: dict = {}


def prepared(name):
    factory, store_kv = BACKENDS[name]
    backend = factory(CacheConfig(model=MODEL, block_size=BLOCK, num_blocks=NUM_BLOCKS, store_kv=store_kv))
    for seq, tokens in enumerate(PROMPTS):
        kv = np.zeros((tokens, 2, MODEL.layers, MODEL.kv_heads, MODEL.head_dim), np.float16) if store_kv else None
        backend.prefill(seq, tokens, kv, final_tokens=tokens + STEPS, step=0)
    return backend


@pytest.mark.parametrize("name", list(BACKENDS))
def test_decode_step_batch256(benchmark, name):
    backend = prepared(name)
    seqs, ones = list(range(BATCH)), [1] * BATCH
    kv = kv_tokens(seqs, PROMPTS, MODEL) if backend.config.store_kv else None
    calls = [0]

    def decode_step():
        calls[0] += 1
        backend.append(seqs, ones, kv, step=calls[0])

    benchmark.group = "decode step, batch 256"
    benchmark.pedantic(decode_step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)

    # Both did the same work: every sequence grew by one token per call.
    led = backend.ledger()
    assert led.tokens == {s: p + calls[0] for s, p in enumerate(PROMPTS)}
    assert led.blocks_used == sum(blocks_needed(p + calls[0], BLOCK) for p in PROMPTS)

    if benchmark.stats is None:  # --benchmark-disable: one call, nothing measured
        return
    median = benchmark.stats.stats.median
    MEDIANS[name] = median
    benchmark.extra_info["tokens_per_s"] = BATCH / median
    if name == "numpy" and "python-objects" in MEDIANS:
        benchmark.extra_info["speedup_vs_python_objects"] = MEDIANS["python-objects"] / median
