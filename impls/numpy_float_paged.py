"""NumPy paged KV caches whose blocks hold SPEC §12's float formats: real fp8 (e4m3) and NVFP4
codes, and their scales.

- ``fp8-tensor``: one e4m3 byte a channel; one float32 scale per tensor (K or V of a layer),
  calibrated as vLLM's k_scale / v_scale: the amax of kvbench's K/V (1001) / 448, outside the blocks.
- ``fp8-token-head``: one e4m3 byte a channel and a float32 scale per (token, K/V, layer, head)
  row: the row's amax / 448.
- ``nvfp4``: two e2m1 codes a byte (the first in the low nibble), an e4m3 scale per 16
  consecutive elements of a (token, K/V, layer)'s heads and channels (block amax / 6 / tensor
  scale: per head when head_dim is a multiple of 16, as NVIDIA's blocks along the innermost
  dimension; two heads of 8 in kvbench's tiny models), and a float32 tensor scale (calibrated
  amax / (448 * 6)).

Codes are rounded to nearest, ties to the even code, by looking each magnitude up among the
format's values (its bit patterns are in increasing order), so this shares no arithmetic with
the checker's reference (kvbench.quant.reference). Blocks, tables, copy-on-write and eviction
are the NumPy paged backend's; only the storage differs.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from impls.numpy_paged import NumpyPaged, lazy_zeros
from impls.numpy_quant_paged import NumpyQuantPaged
from kvbench.contract.protocol import Refusal

CALIBRATED_AMAX = 1001.0  # max |K/V| kvbench writes: (...) mod 2003 - 1001


def _e4m3_magnitudes() -> np.ndarray:
    """The values of e4m3fn bit patterns 0x00 .. 0x7E (0x7F is NaN): exponent bias 7, 3 mantissa
    bits, exponent field 0 subnormal."""
    bits = np.arange(0x7F)
    e, m = bits >> 3, bits & 7
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))


E4M3 = _e4m3_magnitudes()
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # bit patterns 0 .. 7


def _decode_table(magnitudes: np.ndarray, sign_bit: int) -> np.ndarray:
    """float32 value of every code: the magnitudes, then NaN up to the sign bit, then negatives."""
    half = np.full(sign_bit, np.nan)
    half[:len(magnitudes)] = magnitudes
    return np.concatenate([half, -half]).astype(np.float32)


E4M3_VALUES = _decode_table(E4M3, 0x80)
E2M1_VALUES = _decode_table(E2M1, 0x8)


def encode(y, magnitudes: np.ndarray, sign_bit: int) -> np.ndarray:
    """The code of the format value nearest each y (float64), ties to the even code (the even
    mantissa), saturating at the largest magnitude."""
    y = np.asarray(y, dtype=np.float64)
    a = np.minimum(np.abs(y), magnitudes[-1])
    hi = np.minimum(np.searchsorted(magnitudes, a), len(magnitudes) - 1)  # magnitudes[hi] >= a
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - magnitudes[lo], magnitudes[hi] - a
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return (code | np.where(np.signbit(y), sign_bit, 0)).astype(np.uint8)  # -0 keeps its sign, as a cast does


class NumpyFloatPaged(NumpyQuantPaged):
    """The pool of one float format (``config.kv_format``)."""

    name = "numpy-float"
    kv_format = "fp8-token-head"

    def __init__(self, config):
        config = dataclasses.replace(config, kv_format=self.kv_format)
        m = config.model
        d = m.head_dim
        self.rows_per_slot = m.kv_pair * m.group_layers * m.kv_heads
        nvfp4 = self.kv_format == "nvfp4"
        if nvfp4 and m.kv_heads * d % 16:
            raise NotImplementedError(Refusal(
                self.name, "store K/V whose rows do not split into NVFP4's 16-element blocks",
                "SPEC §12", f"model {m.name} has kv_heads * head_dim = {m.kv_heads * d}"))
        self.nvfp4_blocks = m.kv_heads * d // 16  # per (token, K/V, layer)
        # Per token slot: its codes, and its scales (per row, or per 16 channels of a row).
        self.code_shape = (self.rows_per_slot * (d // 2 if nvfp4 else d),)
        self.scale_shape = {"fp8-tensor": None, "fp8-token-head": (self.rows_per_slot,),
                            "nvfp4": (self.rows_per_slot * d // 16,)}[self.kv_format]
        self.scale_dtype = np.dtype(np.uint8 if nvfp4 else np.float32)  # e4m3 bytes for NVFP4
        amax = CALIBRATED_AMAX / (448.0 * 6.0 if nvfp4 else 448.0)
        self.tensor_scale = np.full((m.kv_pair, m.group_layers, 1, 1), amax, np.float32)  # per K/V, layer
        self.codes = self.scale = self.zero = None
        NumpyPaged.__init__(self, config)

    def _make_pool(self, n: int, B: int):
        codes = lazy_zeros((n, B) + self.code_shape, np.uint8)
        scale = None if self.scale_shape is None else lazy_zeros((n, B) + self.scale_shape, self.scale_dtype)
        self._by_block = [a for a in (codes, scale) if a is not None]
        self.codes = codes.reshape(n * B, -1)
        self.scale = None if scale is None else scale.reshape(n * B, -1)
        return self.codes

    def _row_shape(self, per_slot) -> tuple:
        m = self.config.model
        return (per_slot, m.kv_pair, m.group_layers, m.kv_heads)

    def _write_slots(self, slots, kv) -> None:
        if len(slots) == 0:  # an operation of zero tokens writes nothing (reshape(0, -1) cannot)
            return
        d = self.config.model.head_dim
        x = np.asarray(kv, dtype=np.float64).reshape(self._row_shape(len(slots)) + (d,))
        ts = self.tensor_scale.astype(np.float64)
        if self.kv_format == "fp8-tensor":
            self.codes[slots] = encode(x / ts, E4M3, 0x80).reshape(len(slots), -1)
        elif self.kv_format == "fp8-token-head":
            amax = np.abs(x).max(axis=-1, keepdims=True)
            s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
            self.codes[slots] = encode(x / s, E4M3, 0x80).reshape(len(slots), -1)
            self.scale[slots] = s.reshape(len(slots), -1)
        else:
            blocks = x.reshape(x.shape[:-2] + (self.nvfp4_blocks, 16))  # 16 of a (token, K/V, layer)'s elements
            bs_code = encode(np.abs(blocks).max(axis=-1) / 6.0 / ts[..., 0], E4M3, 0x80)
            s = E4M3_VALUES[bs_code].astype(np.float64)[..., None] * ts
            with np.errstate(divide="ignore", invalid="ignore"):
                y = np.where(s > 0, blocks / s, 0.0)
            q = encode(y, E2M1, 0x8).reshape(len(slots), -1, 2)
            self.codes[slots] = q[..., 0] | (q[..., 1] << 4)
            self.scale[slots] = bs_code.reshape(len(slots), -1)

    def _read_blocks(self, blocks, tokens: int) -> np.ndarray:
        slots = (np.asarray(blocks)[:, None] * self.B + np.arange(self.B)).reshape(-1)[:tokens]
        return self._dequantized(self.codes[slots], None if self.scale is None else self.scale[slots], None)

    def _dequantized(self, codes, scale, zero) -> np.ndarray:
        """The K/V of token slots held as ``codes`` and ``scale``, one row a slot."""
        d = self.config.model.head_dim
        n = len(codes)
        if self.kv_format == "nvfp4":
            pairs = np.stack([codes & 0xF, codes >> 4], axis=-1)
            x = E2M1_VALUES[pairs].reshape(self._row_shape(n)[:-1] + (self.nvfp4_blocks, 16))
            x = x * self._block_scale(scale, n) * self.tensor_scale
        else:
            x = E4M3_VALUES[codes].reshape(self._row_shape(n) + (d,))
            x = self._scaled(x, self.tensor_scale if scale is None else scale.reshape(self._row_shape(n) + (1,)))
        return x.reshape((-1,) + self.token_shape)

    def _block_scale(self, scale, n) -> np.ndarray:
        return E4M3_VALUES[scale].reshape(self._row_shape(n)[:-1] + (self.nvfp4_blocks, 1))

    def _scaled(self, codes, scale) -> np.ndarray:
        """An fp8 code's value: code * scale."""
        return codes * scale

    def _slot_kv(self, t, s) -> np.ndarray:
        codes, *scale = (np.asarray(a[s]) for a in t.arrays)
        return self._dequantized(codes, scale[0] if scale else None, None)

    def _copy_blocks(self, src, dst) -> None:
        B = self.B
        s = (np.asarray(src)[:, None] * B + np.arange(B)).reshape(-1)
        t = (np.asarray(dst)[:, None] * B + np.arange(B)).reshape(-1)
        for a in (self.codes, self.scale):
            if a is not None:
                a[t] = a[s]

    def block_bytes(self) -> int:
        """Bytes one block holds: read off the arrays where they exist, else off their shapes."""
        n = self.config.num_blocks
        if self.codes is not None and n:
            return sum(a.nbytes for a in (self.codes, self.scale) if a is not None) // n
        scale = 0 if self.scale_shape is None else self.scale_shape[0] * self.scale_dtype.itemsize
        return self.B * (self.code_shape[0] + scale)


class NumpyFp8Tensor(NumpyFloatPaged):
    name = "numpy-fp8"
    kv_format = "fp8-tensor"


class NumpyFp8TokenHead(NumpyFloatPaged):
    name = "numpy-fp8-token-head"
    kv_format = "fp8-token-head"


class NumpyNvfp4(NumpyFloatPaged):
    name = "numpy-nvfp4"
    kv_format = "nvfp4"
