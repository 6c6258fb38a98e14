"""NumPy paged KV cache whose blocks hold quantized K/V: codes plus per-token scales.

Every (token, K/V, layer, head) row of ``head_dim`` channels is quantized on write with its own
scale (int8: symmetric; int4: asymmetric, two codes packed per byte), by the NumPy quantizer.
Blocks, tables, copy-on-write and eviction are the NumPy paged backend's; only the storage differs.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from impls import quant_numpy
from impls.numpy_paged import NumpyPaged, lazy_zeros
from kvbench import quant as Q
from kvbench.quant.pool import scheme_of


class NumpyQuantPaged(NumpyPaged):
    name = "numpy-quant"
    capabilities = dataclasses.replace(NumpyPaged.capabilities, quantized=True,
                                       kinds=("full", "sliding", "chunked", "sinks", "mla"))
    compiled = None  # quantize by the compiled kernels where numba is installed, else the NumPy steps

    def __init__(self, config):
        self.scheme = scheme_of(config.kv_format or "int8")
        m = config.model
        self.rows_per_slot = m.kv_pair * m.group_layers * m.kv_heads  # one slot: one group's layers
        per_byte = 8 // self.scheme.slot_bits
        if m.head_dim % per_byte:
            raise ValueError(f"{self.name}: head_dim {m.head_dim} does not pack into whole bytes "
                             f"at {self.scheme.bits} bits")
        # One row per token slot: its codes, and a scale (zero point) per K/V, layer and head.
        self.code_shape = (self.rows_per_slot * m.head_dim // per_byte,)
        self.code_dtype = np.dtype(np.uint8 if self.scheme.packed else np.int8)
        self.meta_count = 1 if self.scheme.symmetric else 2
        self.codes = self.scale = self.zero = None
        super().__init__(config)

    def _make_pool(self, n: int, B: int):
        codes = lazy_zeros((n, B) + self.code_shape, self.code_dtype)
        scale = lazy_zeros((n, B, self.rows_per_slot), np.float32)
        zero = None if self.scheme.symmetric else lazy_zeros(scale.shape, np.float32)
        self._by_block = [a for a in (codes, scale, zero) if a is not None]  # committed by block
        # One row per token slot for writes and reads.
        self.codes, self.scale = codes.reshape(n * B, -1), scale.reshape(n * B, -1)
        self.zero = None if zero is None else zero.reshape(n * B, -1)
        return self.codes  # "the pool": present when K/V are stored

    def _storage(self) -> list:
        return self._by_block

    def _write_slots(self, slots, kv) -> None:
        kv = np.asarray(kv, dtype=np.float32)
        qt = self._quantize(kv.reshape(-1, self.config.model.head_dim))
        self.codes[slots] = np.asarray(qt.codes).reshape(len(slots), self.code_shape[0])
        self.scale[slots] = np.asarray(qt.scale).reshape(len(slots), self.rows_per_slot)
        if self.zero is not None:
            self.zero[slots] = np.asarray(qt.zero_point).reshape(len(slots), self.rows_per_slot)

    def _quantize(self, rows):
        return quant_numpy.quantize(rows, self.scheme, compiled=self.compiled)

    def _read_blocks(self, blocks, tokens: int) -> np.ndarray:
        slots = (np.asarray(blocks)[:, None] * self.B + np.arange(self.B)).reshape(-1)[:tokens]
        return self._dequantized(self.codes[slots], self.scale[slots],
                                 None if self.zero is None else self.zero[slots])

    def _dequantized(self, codes, scale, zero) -> np.ndarray:
        """The K/V of token slots held as ``codes`` and ``scale`` (``zero``), one row a slot."""
        d = self.config.model.head_dim
        shape = (len(codes) * self.rows_per_slot, d)
        meta = (shape[0], 1)
        qt = Q.QuantizedTensor(
            codes=codes.reshape(-1) if self.scheme.packed else codes.reshape(shape),
            scale=scale.reshape(meta), zero_point=None if zero is None else zero.reshape(meta),
            shape=shape, dtype="float32", scheme=self.scheme, packed=self.scheme.packed,
            compute_dtype="float32")
        return quant_numpy.dequantize(qt, np.float32).reshape((-1,) + self.token_shape)

    def _slot_kv(self, t, s) -> np.ndarray:
        """A tier slot's K/V: its codes and scales (a block of the pool's layout), dequantized."""
        codes, scale, *zero = (np.asarray(a[s]) for a in t.arrays)
        return self._dequantized(codes, scale, zero[0] if zero else None)

    def _read_range(self, table_row, start: int, stop: int, out) -> np.ndarray:
        """Dequantized slots ``start .. stop-1``: the blocks that hold them, then the range."""
        b0, b1 = start // self.B, -(-stop // self.B)
        data = self._read_blocks(table_row[b0:b1], (b1 - b0) * self.B)[start - b0 * self.B:stop - b0 * self.B]
        if out is None:
            return data
        out[...] = data
        return out

    def _copy_blocks(self, src, dst) -> None:
        B = self.B
        s = (np.asarray(src)[:, None] * B + np.arange(B)).reshape(-1)
        t = (np.asarray(dst)[:, None] * B + np.arange(B)).reshape(-1)
        self.codes[t] = self.codes[s]
        self.scale[t] = self.scale[s]
        if self.zero is not None:
            self.zero[t] = self.zero[s]

    def block_bytes(self) -> int:
        """Bytes one block holds: read off the arrays where they exist, else off their shapes."""
        n = self.config.num_blocks
        if self.codes is not None and n:
            return sum(a.nbytes for a in (self.codes, self.scale, self.zero) if a is not None) // n
        row = self.code_shape[0] * self.code_dtype.itemsize + \
            self.meta_count * self.rows_per_slot * np.dtype(np.float32).itemsize
        return self.B * row



class NumpyQuantSteps(NumpyQuantPaged):
    """The same pool quantized by the NumPy steps even where the compiled kernels are installed:
    the default run checks both paths, which must give the same codes."""

    name = "numpy-quant-steps"
    compiled = False
