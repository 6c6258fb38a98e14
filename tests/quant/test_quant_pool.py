"""Quantized pools: bytes per block by hand, gathered K/V within SPEC §4's bound, planted faults."""
from pathlib import Path

import numpy as np
import pytest
from conftest import A, K, P, X, make_config, make_trace

from impls.numpy_quant_paged import NumpyQuantPaged
from kvbench.checking.checker import check
from kvbench.contract.formulas import get_model
from kvbench.quant import pool as quant_pool
from kvbench.traces.format import load

WORKLOADS = sorted((Path(__file__).resolve().parents[2] / "workloads").glob("*.jsonl"))
FORK_COW = make_trace(P(0, 20), K(1, 0), A((1, 3), (0, 2)), A((0, 1), (1, 1)), X(0), X(1), name="fork-cow")


def quant(fmt, **kw):
    return NumpyQuantPaged(make_config(kv_format=fmt, **kw))


def test_block_bytes_by_hand():
    tiny = get_model("tiny")  # 2 layers, 2 heads, head_dim 8
    # int8: 16 tokens * 2 (K, V) * 2 layers * 2 heads = 128 rows of 8 one-byte codes + a 4-byte scale
    assert quant_pool.block_bytes("int8", tiny, 16) == 128 * (8 + 4)
    # int4: 128 rows of 8 codes packed in 4 bytes + a scale and a zero point of 4 bytes each
    assert quant_pool.block_bytes("int4", tiny, 16) == 128 * (4 + 8)
    # Llama-3-8B: 16 * 2 * 32 * 8 = 8192 rows of 128 channels; fp16 holds 256 bytes a row.
    llama = get_model("llama-3-8b")
    assert quant_pool.block_bytes("int8", llama, 16) == 8192 * (128 + 4)
    assert quant_pool.block_bytes("int4", llama, 16) == 8192 * (64 + 8)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_ledger_bytes_read_off_the_arrays(fmt):
    # Both with and without K/V arrays the pool reports the formula's bytes per block.
    for store in (True, False):
        b = quant(fmt, store_kv=store)
        assert b.block_bytes() == quant_pool.block_bytes(fmt, b.config.model, 16)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("path", WORKLOADS[:5], ids=lambda p: p.stem)
def test_pool_checks_clean(fmt, path):
    v = check(load(str(path)), quant(fmt))
    assert v.valid, str(v.divergence)


def test_unknown_format_refused():
    with pytest.raises(ValueError, match="unknown pool format 'int3'"):
        quant("int3")


class CowWithoutScales(NumpyQuantPaged):
    """Copy-on-write that copies the codes but not the scales."""

    def _copy_blocks(self, src, dst):
        B = self.B
        s = (np.asarray(src)[:, None] * B + np.arange(B)).reshape(-1)
        t = (np.asarray(dst)[:, None] * B + np.arange(B)).reshape(-1)
        self.codes[t] = self.codes[s]


class BytesWithoutMetadata(NumpyQuantPaged):
    """A ledger that counts code bytes only."""

    def block_bytes(self):
        return self.codes.nbytes // self.config.num_blocks


def test_cow_without_scales_is_caught():
    v = check(FORK_COW, CowWithoutScales(make_config(kv_format="int8")))
    # Step 2: sequence 1 writes into the shared 20-token tail first and copies it; its copy has
    # zero scales, so tokens 16..19 read back as 0.
    assert not v.valid and v.divergence.step == 2 and v.divergence.quantity == "kv of sequence 1"
    assert "position 16" in v.divergence.detail


def test_bytes_without_metadata_is_caught():
    v = check(FORK_COW, BytesWithoutMetadata(make_config(kv_format="int8")))
    # Step 0: 2 blocks of 128 * (8 + 4) bytes expected, 128 * 8 reported.
    d = v.divergence
    assert (d.step, d.quantity, d.expected, d.actual) == (0, "bytes_in_use", 2 * 128 * 12, 2 * 128 * 8)


def test_bound_names_the_element():
    x = np.zeros((2, 2, 2, 2, 8))
    x[1, 0, 0, 0, :] = np.arange(8)  # scale 7 / 127 for that row
    bad = x.copy()
    bad[1, 0, 0, 0, 3] += 0.5  # far outside scale / 2
    assert quant_pool.bound_violation(x, x, "int8") == ""
    assert quant_pool.bound_violation(x, bad, "int8").startswith("position 1, row 0, channel 3")
