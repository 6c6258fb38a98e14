"""A fast NumPy KV quantizer: the schemes of ``kvbench.quant``, chunked, in float32.

Over 500 lines: the NumPy steps and the glue that hands the same layouts, Params and output
arrays to the compiled kernels (impls/quant_kernels.py) belong together; apart, each would
import the other.

Speed comes from (the naive whole-array float64 version, ``kvbench.quant.quantize``, reaches
~1-10% of a copy):

- Tiles of ``CHUNK_ELEMENTS`` (512 KiB of float32): every pass after a tile's first hits L2.
- Only contiguous same-shape operands: per-channel / per-token / per-group factors are laid out
  over a tile (``np.tile`` / ``np.repeat``, once per tile shape for channels), which runs at SIMD
  speed where a 2-D broadcast runs an inner loop per row.
- Three passes: ``x * (1/scale)``, ``+ (zero_point + magic)`` (rounds, see :class:`Params`),
  cast the float's bits to int8. The clip is skipped when every group's extremes, run through
  the same (monotone) float steps, round inside the codes: always, unless the scale is external.
- Column min / max over a (rows/k, k*C) view of each tile: k times fewer inner loops than
  ``min(axis=0)``, accumulated in place (each small NumPy call costs microseconds).

With numba importable (a core dependency), float16 / float32 input with scales from the data is
quantized by the compiled kernels of :mod:`impls.quant_kernels` instead: the same codes, scales
and zero points (tests/quant/test_quant_kernels.py), at 0.3-0.6 of a copy where these steps reach
0.03-0.26 (a min and max per token or group is a NumPy reduction over a short inner axis, one
inner loop per group). ``quantize(..., compiled=False)`` runs these steps.

Arithmetic: float32 for float16 / float32 input, float64 for float64. ``x / scale`` is computed as
``x * (1/scale)``: at most ``2u|x|`` off, which the bound of SPEC section 4 allows. A float16
input is divided instead (one rounding, see :func:`divides`), so that its output can be rounded
twice (float32, then float16) within the bound. For other output dtypes the product
``(q - z) * scale``, exact in float64, is rounded once.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from kvbench import quant as Q

name = "numpy"
CHUNK_ELEMENTS = 1 << 17
LITTLE_ENDIAN = sys.byteorder == "little"


def available() -> tuple[bool, str]:
    return True, ""


def _arith_for(dname: str) -> np.dtype:
    """float32 arithmetic for float16 / float32 input, float64 for float64."""
    return np.dtype(Q.SCALE_DTYPE[dname])


def _whole_rows(lay: Q.Layout, chunk: int) -> bool:
    """Do tiles hold whole rows? Yes when a row fits a chunk, or when a packed row does not
    end on a byte (a tile must start on one)."""
    return lay.channels <= chunk or lay.channels % (8 // lay.scheme.slot_bits) != 0


def _tiles(lay: Q.Layout, chunk: int):
    """(r0, r1, c0, c1) tiles of the (R, C) view: contiguous in row-major order, whole groups,
    starting at a multiple of 4 codes (so packed tiles start on a byte)."""
    R, C = lay.rows, lay.channels
    if R * C == 0:
        return
    if _whole_rows(lay, chunk):
        rc = -(-max(1, chunk // C) // 4) * 4  # rc * C is a multiple of 4
        for r0 in range(0, R, rc):
            yield r0, min(R, r0 + rc), 0, C
    else:
        unit = lay.scheme.group_size if lay.scheme.granularity == "group" else 1
        unit = unit * 4 // math.gcd(unit, 4)
        step = unit * max(1, chunk // unit)
        for r in range(R):
            for c0 in range(0, C, step):
                yield r, r + 1, c0, min(C, c0 + step)


def _min_max(rows2d, lay: Q.Layout, chunk: int):
    """Per-group min and max over the whole tensor, a tile at a time (the min brings the tile
    into cache for the max)."""
    if lay.size == 0:
        z = np.zeros(lay.meta_shape, dtype=rows2d.dtype)
        return z, z
    if lay.scheme.granularity == "channel":
        return _column_min_max(rows2d, lay, chunk)
    lo = np.empty(lay.meta_shape, dtype=rows2d.dtype)
    hi = np.empty(lay.meta_shape, dtype=rows2d.dtype)
    gs = lay.scheme.group_size or 1
    for r0, r1, c0, c1 in _tiles(lay, chunk):
        t = rows2d[r0:r1, c0:c1]
        if lay.scheme.granularity == "group":
            grouped = t.reshape(r1 - r0, -1, gs)
            grouped.min(axis=2, out=lo[r0:r1, c0 // gs:c1 // gs])
            grouped.max(axis=2, out=hi[r0:r1, c0 // gs:c1 // gs])
        elif c0 == 0 and c1 == lay.channels:
            t.min(axis=1, out=lo[r0:r1, 0])
            t.max(axis=1, out=hi[r0:r1, 0])
        else:  # a row split over tiles
            tl, th = t.min(axis=1), t.max(axis=1)
            lo[r0:r1, 0] = tl if c0 == 0 else np.minimum(lo[r0:r1, 0], tl)
            hi[r0:r1, 0] = th if c0 == 0 else np.maximum(hi[r0:r1, 0], th)
    return lo, hi


def _column_min_max(rows2d, lay: Q.Layout, chunk: int):
    """Column min and max. ``min(axis=0)`` runs one inner loop per row (C elements); a tile
    viewed as (rows/k, k*C) runs k times fewer, longer ones into k partial rows, folded at the
    end. Partials accumulate in place: a few calls per tile, as small ones cost ~us each."""
    C = lay.channels
    k = 1
    first = next(_tiles(lay, chunk))
    if first[3] - first[2] == C:
        while k < 64 and k * C < 8192 and (first[1] - first[0]) % (2 * k) == 0:
            k *= 2
    acc_lo = np.full((k, C), np.inf, dtype=rows2d.dtype)
    acc_hi = np.full((k, C), -np.inf, dtype=rows2d.dtype)
    part = np.empty(k * C, dtype=rows2d.dtype)
    flat_lo, flat_hi = acc_lo.reshape(-1), acc_hi.reshape(-1)
    for r0, r1, c0, c1 in _tiles(lay, chunk):
        t = rows2d[r0:r1, c0:c1]
        if c1 - c0 == C and (r1 - r0) % k == 0:
            wide = t.reshape(-1, k * C)
            np.minimum.reduce(wide, axis=0, out=part)
            np.minimum(flat_lo, part, out=flat_lo)
            np.maximum.reduce(wide, axis=0, out=part)
            np.maximum(flat_hi, part, out=flat_hi)
        else:  # the last rows, or a row split over tiles
            np.minimum(acc_lo[0, c0:c1], t.min(axis=0), out=acc_lo[0, c0:c1])
            np.maximum(acc_hi[0, c0:c1], t.max(axis=0), out=acc_hi[0, c0:c1])
    return acc_lo.min(axis=0, keepdims=True), acc_hi.max(axis=0, keepdims=True)


def _require_finite(lo, hi, x):
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        Q.raise_non_finite(x)


class Params:
    """Scale and zero point of some groups, in the float forms the element-wise steps use.

    Rounding rides on an add: for ``|y| < 2^(p-2)`` (p = 24 or 53 mantissa bits),
    ``fl(y + 1.5 * 2^(p-1))`` is ``round(y)`` (ties to even) held in the low bits of the float, so
    ``x * (1/scale) + (z + magic)`` rounds ``x/scale + z`` once, exactly, and the code is the low
    byte of the float's bits: multiply, add, cast. It differs from ``round(x/scale) + z`` only at
    exact ties (z is an integer). A zero point too large for that (external scales) takes the
    plain steps: round, then add z.
    """

    def __init__(self, s, z, lo, hi, scheme: Q.QuantScheme, dtype, divide: bool = False):
        dtype = np.dtype(dtype)
        self.s, self.z = s, z  # stored dtype (meta layout)
        with np.errstate(over="ignore", divide="ignore"):
            inv = (1.0 / np.asarray(s, dtype=np.float64)).astype(dtype)
        # Divide when asked (see divides()) or when a subnormal scale has no finite reciprocal.
        self.divide = divide or not np.isfinite(inv).all()
        self.factor = np.asarray(s, dtype) if self.divide else inv
        mant = np.finfo(dtype).nmant + 1
        magic = 1.5 * 2.0 ** (mant - 1)
        self.int_view = np.int32 if dtype == np.float32 else np.int64
        self.magic = z is None or bool((np.abs(np.asarray(z, np.float64)) < 2.0 ** (mant - 2)).all())
        if self.magic:
            self.add = dtype.type(magic) if z is None else (np.asarray(z, np.float64) + magic).astype(dtype)
            self.low, self.high = magic + scheme.qmin, magic + scheme.qmax
        else:
            self.add = np.asarray(z, dtype)
            self.low, self.high = scheme.qmin, scheme.qmax
        # The group extremes through the same float steps (monotone, so every element's code
        # lies between theirs): clip only when one leaves the codes. With a scale from the data
        # that never happens; with an external one, values saturate.
        with np.errstate(over="ignore", invalid="ignore"):
            y_lo, y_hi = (self.apply(np.asarray(v).astype(dtype)) for v in (lo, hi))
        self.clip = bool((y_lo < self.low).any() or (y_hi > self.high).any())

    def apply(self, x, factor=None, add=None, out=None):
        """x * (1/scale) (or x / scale), then + (z + magic), or round and + z."""
        factor = self.factor if factor is None else factor
        add = self.add if add is None else add
        out = (np.divide if self.divide else np.multiply)(x, factor, out=out)
        if not self.magic:
            np.rint(out, out=out)
        return np.add(out, add, out=out)

    def codes_of(self, y):
        """The int view whose low byte is the code (magic), or the integer-valued floats."""
        return y.view(self.int_view) if self.magic else y


def divides(input_itemsize: int, ar: np.dtype) -> bool:
    """Quantize with x / scale (one rounding) rather than x * (1/scale) (two) when the input is
    narrower than the arithmetic: the spare u|x| then pays for rounding the output product in
    the arithmetic dtype before it is rounded again into the input's dtype."""
    return input_itemsize < ar.itemsize


def _params_for(lo, hi, lay: Q.Layout, ar: np.dtype, scale, zero_point, rows2d, divide) -> Params:
    if scale is None:
        s, z = Q.scale_and_zero_point(lo, hi, lay.scheme, ar.name)
    else:
        s, z = Q.external_scale(scale, zero_point, rows2d, lay, ar)
    return Params(s, z, lo, hi, lay.scheme, ar, divide)


def _per_element(values, lay: Q.Layout, r0, r1, c0, c1):
    """Per-group values (meta layout, or a scalar) laid out over tile (r0:r1, c0:c1), flat."""
    if np.ndim(values) == 0:
        return values
    v = np.asarray(values).reshape(lay.meta_shape)
    g = lay.scheme.granularity
    rows, cols = r1 - r0, c1 - c0
    if g == "channel":
        return np.tile(v[0, c0:c1], rows)
    if g == "token":
        return np.repeat(v[r0:r1, 0], cols)
    gs = lay.scheme.group_size
    return np.repeat(v[r0:r1, c0 // gs:c1 // gs].ravel(), gs)


def quantize(x, scheme: Q.QuantScheme, *, scale=None, zero_point=None, out: Q.QuantizedTensor | None = None,
             chunk: int = CHUNK_ELEMENTS, compiled: bool | None = None) -> Q.QuantizedTensor:
    """Codes, scale and zero point of x. ``out``: a QuantizedTensor of the same shape and scheme
    whose arrays are reused (a cache writes into memory it already holds). ``compiled``: use the
    compiled kernels of impls.quant_kernels (None: where numba is installed and they apply;
    the result is the same either way)."""
    x = np.asarray(x)
    dname = Q.check_float_dtype(x.dtype)
    lay = Q.layout(x.shape, scheme)
    ar = _arith_for(dname)
    narrow = divides(x.dtype.itemsize, ar)
    X = np.ascontiguousarray(lay.to_rows(x))
    R, C, n = lay.rows, lay.channels, lay.size
    slot = scheme.slot_bits
    per = 8 // slot
    codes_arr = _reuse(out and out.codes, (-(-n // per),) if scheme.packed else (R, C),
                       np.uint8 if scheme.packed else np.int8)
    codes = codes_arr.reshape(-1)
    s_all = _reuse(out and out.scale, lay.meta_shape, ar)
    z_all = None if scheme.symmetric else _reuse(out and out.zero_point, lay.meta_shape, ar)
    if compiled is not False and scale is None and ar == np.float32 and n:
        from impls import quant_kernels as K
        ok, why = K.available()
        if compiled and not ok:
            raise RuntimeError(f"quantize(compiled=True): {why}")
        if ok and _quantize_compiled(x, X, lay, narrow, codes, s_all, z_all):
            return Q.QuantizedTensor(codes_arr, s_all, z_all, x.shape, dname, scheme,
                                     scheme.packed, ar.name)
    return _quantize_steps(x, X, lay, scheme, ar, narrow, dname, codes_arr, codes, s_all, z_all,
                           scale, zero_point, chunk)


def quantize_compiled(x, scheme: Q.QuantScheme, *, out: Q.QuantizedTensor | None = None):
    """quantize() by the compiled kernels, or None where they do not apply here (numba missing,
    float64 input, a zero point too large for them): for callers with a path of their own."""
    from impls import quant_kernels as K
    x = np.asarray(x)
    if not K.available()[0] or x.dtype not in (np.float16, np.float32) or x.size == 0:
        return None
    lay = Q.layout(x.shape, scheme)
    R, C, n = lay.rows, lay.channels, lay.size
    per = 8 // scheme.slot_bits
    codes_arr = _reuse(out and out.codes, (-(-n // per),) if scheme.packed else (R, C),
                       np.uint8 if scheme.packed else np.int8)
    s_all = _reuse(out and out.scale, lay.meta_shape, np.float32)
    z_all = None if scheme.symmetric else _reuse(out and out.zero_point, lay.meta_shape, np.float32)
    X = np.ascontiguousarray(lay.to_rows(x))
    if not _quantize_compiled(x, X, lay, divides(x.dtype.itemsize, np.dtype(np.float32)),
                              codes_arr.reshape(-1), s_all, z_all):
        return None
    return Q.QuantizedTensor(codes_arr, s_all, z_all, x.shape, x.dtype.name, scheme, scheme.packed,
                             "float32")


def _quantize_steps(x, X, lay, scheme, ar, narrow, dname, codes_arr, codes, s_all, z_all, scale,
                    zero_point, chunk):
    """The NumPy steps of quantize()."""
    C, n = lay.channels, lay.size
    slot = scheme.slot_bits
    per = 8 // slot
    # Pass 1: every group's min and max, then all scales at once. Pass 2: the codes.
    lo, hi = _min_max(X, lay, chunk)
    _require_finite(lo, hi, x)
    P = _params_for(lo, hi, lay, ar, scale, zero_point, X, narrow)
    s_all[...] = P.s
    if z_all is not None:
        z_all[...] = P.z
    buf = np.empty(min(max(n, 1), _max_tile(lay, chunk)), dtype=ar)
    cbuf = np.empty(buf.size + 4, dtype=np.int8) if scheme.packed else None
    cached = {}  # per-channel tiles are the same for every full tile: lay them out once
    for r0, r1, c0, c1 in _tiles(lay, chunk):
        xt = X[r0:r1, c0:c1].reshape(-1)
        m = xt.size
        if scheme.granularity == "channel":
            key = (r1 - r0, c0, c1)
            if key not in cached:
                cached.clear()
                cached[key] = (_per_element(P.factor, lay, r0, r1, c0, c1), _per_element(P.add, lay, r0, r1, c0, c1))
            factor, add = cached[key]
        else:
            factor, add = _per_element(P.factor, lay, r0, r1, c0, c1), _per_element(P.add, lay, r0, r1, c0, c1)
        b = buf[:m]
        P.apply(xt, factor, add, out=b)
        if P.clip:
            np.clip(b, P.low, P.high, out=b)
        k0 = r0 * C + c0
        if not scheme.packed:
            np.copyto(codes[k0:k0 + m], P.codes_of(b), casting="unsafe")
        else:
            cb = cbuf[:-(-m // per) * per]
            cb[m:] = 0
            np.copyto(cb[:m], P.codes_of(b), casting="unsafe")
            _pack_into(cb, slot, codes[k0 // per:k0 // per + cb.size // per])
    return Q.QuantizedTensor(codes_arr, s_all, z_all, x.shape,
                             dname, scheme, scheme.packed, ar.name)


def _quantize_compiled(x, X, lay: Q.Layout, narrow: bool, codes, s_all, z_all) -> bool:
    """Quantize with the compiled kernels into codes / s_all / z_all: the same values as the
    NumPy steps. False (nothing written) where they do not apply: a zero point too large for
    the rounding trick."""
    from impls import quant_kernels as K
    scheme = lay.scheme
    X32 = X if X.dtype == np.float32 else X.astype(np.float32)  # float16: exact
    f32 = np.float32
    if scheme.packed and lay.channels * scheme.slot_bits % 8:
        return False  # a row that ends inside a byte: the NumPy steps pack it
    if scheme.granularity == "channel":
        lo, hi = np.empty(lay.channels, f32), np.empty(lay.channels, f32)
        if K.column_min_max(X32, lo, hi):
            Q.raise_non_finite(x)
        P = _params_for(lo.reshape(1, -1), hi.reshape(1, -1), lay, np.dtype(f32), None, None, X, narrow)
        if not P.magic:
            return False
        factor = np.ascontiguousarray(np.broadcast_to(P.factor, lay.meta_shape).reshape(-1), f32)
        add = np.ascontiguousarray(np.broadcast_to(P.add, lay.meta_shape).reshape(-1), f32)
        args = (X32, factor, add, P.divide, P.clip, f32(P.low), f32(P.high))
        if scheme.packed:
            K.channel_codes_packed(*args, scheme.slot_bits, codes)
        else:
            K.channel_codes(*args, codes.reshape(lay.rows, lay.channels))
        s_all[...] = P.s
        if z_all is not None:
            z_all[...] = P.z
        return True
    G = lay.channels if scheme.granularity == "token" else scheme.group_size
    if scheme.packed and G * scheme.slot_bits % 8:
        return False  # a group that ends inside a byte: the NumPy steps pack it
    X2 = X32.reshape(-1, G)  # one row per group
    s, z, inv, add = (np.empty(len(X2), f32) for _ in range(4))
    low, high = f32(K.MAGIC32 + scheme.qmin), f32(K.MAGIC32 + scheme.qmax)
    bad, inv_bad, zmax, clip_mul, clip_div = K.group_params(
        X2, scheme.symmetric, float(scheme.steps), float(scheme.qmin), 8 * Q.unit_roundoff("float32"),
        low, high, s, z, inv, add)
    if bad:
        Q.raise_non_finite(x)
    if not zmax < 2.0 ** 22:
        return False
    divide = narrow or inv_bad
    factor = s if divide else inv
    clip = clip_div if divide else clip_mul  # as Params.clip: the extremes through the same steps
    args = (X2, factor, add, divide, clip, low, high)
    if scheme.packed:
        K.group_codes_packed(*args, scheme.slot_bits, codes)
    else:
        K.group_codes(*args, codes.reshape(X2.shape))
    s_all[...] = s.reshape(lay.meta_shape)
    if z_all is not None:
        z_all[...] = z.reshape(lay.meta_shape)
    return True


def _reuse(array, shape, dtype):
    """``array`` when it has this shape and dtype (to be overwritten), else a new one."""
    if array is None:
        return np.empty(shape, dtype=dtype)
    if not (isinstance(array, np.ndarray) and array.shape == tuple(shape) and array.dtype == dtype
            and array.flags.c_contiguous and array.flags.writeable):
        raise ValueError(f"out: expected a writeable contiguous {np.dtype(dtype).name} array of shape "
                         f"{tuple(shape)}, got {getattr(array, 'dtype', type(array))} {getattr(array, 'shape', '')}")
    return array


def _max_tile(lay: Q.Layout, chunk: int) -> int:
    """Elements of the largest tile (the first one)."""
    r0, r1, c0, c1 = next(_tiles(lay, chunk), (0, 1, 0, 1))
    return (r1 - r0) * (c1 - c0)


def _pack_into(cb, slot: int, out) -> None:
    """int8 codes (length a multiple of 8/slot) -> bytes, first code in the low bits."""
    if not LITTLE_ENDIAN:
        out[...] = Q.pack_bits(cb, slot)
        return
    if slot == 4:
        w = cb.view(np.uint16)
        t = np.bitwise_and(w, 0x0F0F)
        t |= t >> 4  # byte 1's nibble moves to bits 4-7 of byte 0
    else:
        w = cb.view(np.uint32)
        t = np.bitwise_and(w, 0x03030303)
        t |= t >> 6  # bytes 1 and 3 -> bits 2-3 and 18-19
        t |= t >> 12  # bytes 2 and 3 -> bits 4-7
    np.copyto(out, t, casting="unsafe")  # the low byte


def _unpack_into(packed, slot: int, out) -> None:
    """bytes -> int8 codes, sign-extended from the slot (out's length = len(packed) * 8/slot).

    Each byte is spread over a wider int, one slot per byte (two's complement nibbles or
    crumbs, first code lowest), then sign-extended as ``(v ^ 8) - 8`` (``(v ^ 2) - 2``):
    contiguous ops, where interleaving two strided outputs runs at a third of the speed.
    """
    if not LITTLE_ENDIAN:
        out[...] = Q.unpack_bits(packed, slot, out.size)
        return
    if slot == 4:
        w = packed.astype(np.uint16)
        w |= w << 4  # high nibble -> bits 8-11
        w &= 0x0F0F
        w ^= 0x0808
    else:
        w = packed.astype(np.uint32)
        w |= w << 6  # crumb 1 -> bits 8-9
        w |= w << 12  # crumbs 2 and 3 -> bits 16-17 and 24-25
        w &= 0x03030303
        w ^= 0x02020202
    np.subtract(w.view(np.int8), 8 if slot == 4 else 2, out=out)


def unpack_codes(qt: Q.QuantizedTensor) -> np.ndarray:
    lay = qt.layout
    if not qt.packed:
        return np.asarray(qt.codes).reshape(lay.rows, lay.channels)
    per = 8 // qt.scheme.slot_bits
    out = np.empty(np.asarray(qt.codes).size * per, dtype=np.int8)
    _unpack_into(np.asarray(qt.codes), qt.scheme.slot_bits, out)
    return out[:lay.size].reshape(lay.rows, lay.channels)


def dequantize(qt: Q.QuantizedTensor, out_dtype=None, *, out: np.ndarray | None = None,
               chunk: int = CHUNK_ELEMENTS) -> np.ndarray:
    """x_hat = (q - zero_point) * scale in the input's layout and dtype (or ``out_dtype``).
    ``out``: an array of the input's shape to write into (its dtype is the output's)."""
    lay = qt.layout
    scheme = qt.scheme
    out_dt = np.dtype(out.dtype if out is not None else (out_dtype or qt.dtype))
    ar = np.dtype(qt.compute_dtype)
    # The product (q - z) * scale in the arithmetic dtype when that is the output's, or when the
    # output is the narrow input's dtype (quantize divided, see divides()); else in float64,
    # where it is exact, so the output takes one rounding.
    same = out_dt == ar or (divides(np.dtype(qt.dtype).itemsize, ar) and out_dt == np.dtype(qt.dtype))
    work = ar if same else np.dtype(np.float64)
    R, C, n = lay.rows, lay.channels, lay.size
    target = out
    if out is not None and tuple(out.shape) != tuple(qt.shape):
        raise ValueError(f"dequantize: out has shape {out.shape}, the tensor {tuple(qt.shape)}")
    rows_out = lay.to_rows(out) if out is not None else None
    if rows_out is None or not np.shares_memory(rows_out, out) or not rows_out.flags.c_contiguous:
        rows_out = np.empty((R, C), dtype=out_dt)  # written here, then copied into out
    flat_out = rows_out.reshape(-1)
    s = np.asarray(qt.scale).astype(work)
    z = None if qt.zero_point is None else np.asarray(qt.zero_point).astype(work)
    codes = np.asarray(qt.codes).reshape(-1)
    per = 8 // scheme.slot_bits
    top = np.finfo(out_dt).max
    # Can (q - z) * scale pass the top of the output's range? Then clip (inf -> max).
    with np.errstate(over="ignore"):
        reach = np.abs(s.astype(np.float64)) * max(abs(scheme.qmin), scheme.qmax)
        if z is not None:
            reach = reach + np.abs(z.astype(np.float64)) * np.abs(s.astype(np.float64))
    clip_out = work != out_dt or bool((reach >= top).any())
    buf = np.empty(min(max(n, 1), _max_tile(lay, chunk)), dtype=work)
    cbuf = np.empty(buf.size + 4, dtype=np.int8) if qt.packed else None
    cached = {}
    for r0, r1, c0, c1 in _tiles(lay, chunk):
        m = (r1 - r0) * (c1 - c0)
        k0 = r0 * C + c0
        if qt.packed:
            nbytes = -(-m // per)
            cb = cbuf[:nbytes * per]
            _unpack_into(codes[k0 // per:k0 // per + nbytes], scheme.slot_bits, cb)
            q = cb[:m]
        else:
            q = codes[k0:k0 + m]
        key = (r0, r1, c0, c1) if scheme.granularity != "channel" else (r1 - r0, c0, c1)
        if key not in cached:
            cached.clear()
            cached[key] = (_per_element(s, lay, r0, r1, c0, c1),
                           None if z is None else _per_element(z, lay, r0, r1, c0, c1))
        st, zt = cached[key]
        b = buf[:m]
        np.copyto(b, q)
        if zt is not None:
            np.subtract(b, zt, out=b)
        dst = flat_out[k0:k0 + m]
        if not clip_out:
            np.multiply(b, st, out=dst)
        else:
            with np.errstate(over="ignore"):
                np.multiply(b, st, out=b)
            np.clip(b, -top, top, out=b)  # never round to inf: x lies within the dtype's range
            np.copyto(dst, b, casting="unsafe")
    if target is None:
        return lay.from_rows(rows_out)
    if not np.shares_memory(rows_out, target):
        target[...] = lay.from_rows(rows_out)
    return target


def error_stats(x, x_hat, qt: Q.QuantizedTensor, *, chunk: int = CHUNK_ELEMENTS) -> Q.QuantStats:
    """Errors over all elements in float64, a chunk at a time (sums scaled by the max error,
    so that they neither overflow nor underflow); the ratio from the stored arrays."""
    xa = np.asarray(x).reshape(-1)
    xh = np.asarray(x_hat).reshape(-1)
    n = xa.size

    def errors():
        for i in range(0, n, chunk):
            with np.errstate(over="ignore"):
                yield np.abs(xa[i:i + chunk].astype(np.float64) - xh[i:i + chunk])

    mx = max((float(d.max()) for d in errors()), default=0.0)
    if mx == 0 or not math.isfinite(mx):
        mean = rmse = mx
    else:
        total = sq = 0.0
        for d in errors():
            d /= mx
            total += float(d.sum())
            sq += float(np.dot(d, d))
        mean, rmse = mx * (total / n), mx * math.sqrt(sq / n)
    original = n * np.asarray(x).dtype.itemsize
    stored = sum(np.asarray(a).nbytes for a in (qt.codes, qt.scale, qt.zero_point) if a is not None)
    return Q.QuantStats(mx, mean, rmse, original / stored if stored else 1.0, original, stored)
