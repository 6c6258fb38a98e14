"""KV quantization (SPEC section 4): the float64 reference, the error statistics and the checker.

Layout. The chosen axis moves last and the tensor is read as rows x channels, ``(R, C)``:

- ``channel``: one scale per channel, over the R rows (keys in KIVI);
- ``token``: one scale per row, over its C channels (values in KIVI);
- ``group``: one scale per G consecutive channels of a row (``C % G == 0``).

Codes are signed: symmetric ``[-qmax, qmax]``, asymmetric ``[qmin, qmax]`` with
``qmin = -2^(bits-1)``, ``qmax = 2^(bits-1) - 1``. Codes of 2 bits are packed four to a byte,
3 and 4 bits two to a byte (two's complement in the slot, first code in the low bits, over the
row-major ``(R, C)`` codes), 5 to 8 bits one int8 each.

Decisions where the SPEC formula is silent (an engineer's choice, written down here):

- The zero point is stored in the scale's float dtype, never int8: it is an integer-valued float
  that cannot wrap (SPEC's sound alternative "store the zero point wider than int8").
- A constant channel ``v`` (zero range) stores scale ``|v|`` and zero point 0: codes ``+-1``
  reconstruct ``v`` exactly. An all-zero (or empty) channel stores scale 1: codes 0, output 0.
- The stored scale is rounded up (one ulp of its dtype) so that ``scale * (qmax - qmin)`` covers
  the range: every element then lies within ``scale/2`` of a code, and no clipping error appears.
- Asymmetric scales have a floor ``8u * max|x_c|``: a range narrower than that cannot be resolved
  by arithmetic of unit roundoff ``u`` anyway, and the floor keeps ``|zero_point| <= 2^21`` (exact
  in float32, and small enough for float32 rounding tricks).
- The reconstruction bound of SPEC section 4 assumes normal numbers. Each rounding into the
  subnormal range can add half the dtype's smallest subnormal ``eta`` (Higham, *Accuracy and
  Stability of Numerical Algorithms*, section 2.1), so the checker adds ``eta_out/2 +
  eta*(1 + scale)``; with a float16 output that is 2^-25, visible only for tiny values.
- With an external (calibrated) scale, values beyond the codes saturate: the checker compares
  the output with the input clipped to the representable interval.

Implementations follow a small duck-typed protocol (``kvbench.quant`` itself is the reference
one): ``name``, ``available() -> (bool, why)``, ``quantize(x, scheme, *, scale=None,
zero_point=None) -> QuantizedTensor``, ``dequantize(qt, out_dtype=None)``, and optionally
``error_stats(x, x_hat, qt) -> QuantStats`` and ``unpack_codes(qt) -> (R, C) int codes``.
:func:`check_quantizer` drives one and returns a :class:`QuantVerdict`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .formulas import ModelSpec, get_model

name = "reference"
GRANULARITIES = ("channel", "token", "group")

# Unit roundoff u and smallest positive subnormal eta of each float dtype, by name.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53,
                 "float8_e4m3fn": 2.0**-4}
SMALLEST_SUBNORMAL = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149,
                      "float64": 2.0**-1074, "float8_e4m3fn": 2.0**-9}
# The dtype of the arithmetic and of the stored scale and zero point, by input dtype.
SCALE_DTYPE = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}

FP8_E4M3_MAX = 448.0  # 1.75 * 2^8: the largest finite e4m3fn value
FP8_E4M3_MIN_NORMAL = 2.0**-6
FP8_E4M3_MANTISSA_BITS = 3


def available() -> tuple[bool, str]:
    return True, ""


def unit_roundoff(dtype) -> float:
    return UNIT_ROUNDOFF[_dtype_name(dtype)]


def _dtype_name(dtype) -> str:
    text = str(dtype)
    text = text.removeprefix("torch.")
    if text not in UNIT_ROUNDOFF:
        text = np.dtype(dtype).name
    return text


# --------------------------------------------------------------------------------------------
# Scheme and layout


@dataclass(frozen=True)
class QuantScheme:
    """How to quantize: bit width, symmetric or not, and which elements share a scale."""

    bits: int = 8
    symmetric: bool = True
    granularity: str = "channel"  # channel | token | group
    axis: int = -1  # the channel axis
    group_size: int | None = None  # G, for granularity "group"

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, np.integer)) \
                or not 2 <= self.bits <= 8:
            raise ValueError(f"QuantScheme: bits must be an int in 2..8, got {self.bits!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"QuantScheme: granularity must be one of {GRANULARITIES}, "
                             f"got {self.granularity!r}")
        if self.granularity == "group":
            g = self.group_size
            if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g <= 0:
                raise ValueError(f"QuantScheme: granularity 'group' needs a positive int group_size, "
                                 f"got {g!r}")
        elif self.group_size is not None:
            raise ValueError(f"QuantScheme: group_size is only for granularity 'group' "
                             f"(got group_size={self.group_size!r} with {self.granularity!r})")
        if isinstance(self.axis, bool) or not isinstance(self.axis, (int, np.integer)):
            raise ValueError(f"QuantScheme: axis must be an int, got {self.axis!r}")

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def qmin(self) -> int:
        return -self.qmax if self.symmetric else -(2 ** (self.bits - 1))

    @property
    def steps(self) -> int:
        """Scale steps across a group's range: qmax for symmetric (half range), qmax - qmin."""
        return self.qmax if self.symmetric else self.qmax - self.qmin

    @property
    def slot_bits(self) -> int:
        """Bits each stored code takes: 2, 4 (two's complement nibble) or 8."""
        return 2 if self.bits <= 2 else 4 if self.bits <= 4 else 8

    @property
    def packed(self) -> bool:
        return self.slot_bits < 8

    def describe(self) -> str:
        kind = "sym" if self.symmetric else "asym"
        gran = f"group{self.group_size}" if self.granularity == "group" else f"per-{self.granularity}"
        return f"int{self.bits}-{kind}-{gran}"


@dataclass(frozen=True)
class Layout:
    """Where each element of a tensor of ``shape`` goes in the ``(R, C)`` view, and its group."""

    shape: tuple
    axis: int  # normalized, >= 0
    scheme: QuantScheme

    @property
    def channels(self) -> int:
        return self.shape[self.axis]

    @property
    def rows(self) -> int:
        return math.prod(s for i, s in enumerate(self.shape) if i != self.axis)

    @property
    def size(self) -> int:
        return self.rows * self.channels

    @property
    def meta_shape(self) -> tuple:
        g = self.scheme.granularity
        if g == "channel":
            return (1, self.channels)
        if g == "token":
            return (self.rows, 1)
        return (self.rows, self.channels // self.scheme.group_size)

    @property
    def groups(self) -> int:
        return math.prod(self.meta_shape)

    @property
    def group_elements(self) -> int:
        g = self.scheme.granularity
        return self.rows if g == "channel" else self.channels if g == "token" else self.scheme.group_size

    @property
    def moved_shape(self) -> tuple:
        return tuple(s for i, s in enumerate(self.shape) if i != self.axis) + (self.channels,)

    def to_rows(self, x):
        """The ``(R, C)`` view of x (a copy only when x's strides need one)."""
        return np.moveaxis(x, self.axis, -1).reshape(self.rows, self.channels)

    def from_rows(self, y):
        return np.moveaxis(y.reshape(self.moved_shape), -1, self.axis)

    def expand(self, meta):
        """Per-group values ``meta_shape`` -> one per element ``(R, C)``."""
        meta = np.asarray(meta).reshape(self.meta_shape)
        if self.scheme.granularity == "group":
            meta = np.repeat(meta, self.scheme.group_size, axis=1)
        return np.broadcast_to(meta, (self.rows, self.channels))

    def group_view(self, rows2d):
        """``(groups, elements)`` of an (R, C) array: one row per scale (transposed for 'channel')."""
        g = self.scheme.granularity
        if g == "channel":
            return rows2d.T
        if g == "token":
            return rows2d
        return rows2d.reshape(self.rows * (self.channels // self.scheme.group_size), self.scheme.group_size)

    def element_index(self, r: int, c: int) -> tuple:
        """The index in the original tensor of element (r, c) of the (R, C) view."""
        moved = np.unravel_index(r * self.channels + c, self.moved_shape) if self.size else ()
        moved = [int(i) for i in moved]
        return tuple(moved[:self.axis] + [moved[-1]] + moved[self.axis:-1])

    def group_index(self, flat: int) -> tuple:
        return tuple(int(i) for i in np.unravel_index(flat, self.meta_shape))

    def describe_group(self, index: tuple) -> str:
        g = self.scheme.granularity
        if g == "channel":
            return f"channel {index[1]} (axis {self.axis})"
        if g == "token":
            return f"row {index[0]}"
        gs = self.scheme.group_size
        return f"row {index[0]}, group {index[1]} (channels {index[1] * gs}..{(index[1] + 1) * gs - 1})"


def layout(shape, scheme: QuantScheme) -> Layout:
    """The (R, C) layout of a tensor of ``shape``; refuses what the scheme cannot apply to."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise ValueError("quantize: x is a scalar (0-d); it needs at least one axis to hold channels")
    if not -len(shape) <= scheme.axis < len(shape):
        raise ValueError(f"quantize: axis {scheme.axis} is out of range for x of shape {shape}")
    axis = scheme.axis % len(shape)
    if scheme.granularity == "group" and shape[axis] % scheme.group_size:
        raise ValueError(f"quantize: group_size {scheme.group_size} does not divide the "
                         f"{shape[axis]} channels of axis {axis} (shape {shape})")
    return Layout(shape, axis, scheme)


def check_float_dtype(dtype) -> str:
    name_ = _dtype_name(dtype)
    if name_ not in SCALE_DTYPE:
        raise TypeError(f"quantize: x must be float16, bfloat16, float32 or float64, got {name_}")
    return name_


def raise_non_finite(x, where: str = "quantize") -> None:
    """Raise a ValueError naming the first NaN/inf element of x (numpy array)."""
    bad = np.argwhere(~np.isfinite(np.asarray(x, dtype=np.float64)))
    if len(bad):
        idx = tuple(int(i) for i in bad[0])
        raise ValueError(f"{where}: x{list(idx)} = {np.asarray(x)[idx]} is not finite "
                         f"({len(bad)} non-finite element(s)); NaN and +-inf are refused (SPEC section 4)")


def validate_input(x, scheme: QuantScheme) -> Layout:
    """Refuse what SPEC section 4 refuses: non-float dtypes, bad axes, NaN and +-inf."""
    x = np.asarray(x)
    check_float_dtype(x.dtype)
    lay = layout(x.shape, scheme)
    if x.size and not np.isfinite(x).all():
        raise_non_finite(x)
    return lay


# --------------------------------------------------------------------------------------------
# Quantized tensors, scale and zero point


@dataclass
class QuantizedTensor:
    """What a backend stores: codes, per-group scale and zero point, and how to read them.

    ``codes``: (R, C) int8 when not packed, else a flat uint8 array of ``ceil(R*C*slot/8)`` bytes.
    ``scale``, ``zero_point``: ``layout.meta_shape`` (zero_point None when symmetric).
    Arrays may be NumPy or torch tensors (the torch backend keeps them on its device).
    """

    codes: object
    scale: object
    zero_point: object | None
    shape: tuple
    dtype: str  # the input's dtype name
    scheme: QuantScheme
    packed: bool
    compute_dtype: str  # the dtype the arithmetic ran in (sets u in the bound)

    @property
    def layout(self) -> Layout:
        return layout(self.shape, self.scheme)


def stored_bytes(qt: QuantizedTensor) -> int:
    """Bytes of codes + scale + zero point as they are stored."""
    return sum(_nbytes(a) for a in (qt.codes, qt.scale, qt.zero_point) if a is not None)


def _nbytes(a) -> int:
    if hasattr(a, "element_size"):  # torch
        return int(a.numel() * a.element_size())
    return int(np.asarray(a).nbytes)


def group_min_max(rows2d, lay: Layout):
    """Per-group min and max (meta_shape, input dtype); empty groups read as 0."""
    if lay.size == 0:
        zeros = np.zeros(lay.meta_shape, dtype=rows2d.dtype)
        return zeros, zeros
    g = lay.scheme.granularity
    if g == "channel":
        return rows2d.min(axis=0, keepdims=True), rows2d.max(axis=0, keepdims=True)
    if g == "token":
        return rows2d.min(axis=1, keepdims=True), rows2d.max(axis=1, keepdims=True)
    grouped = rows2d.reshape(lay.rows, -1, lay.scheme.group_size)
    return grouped.min(axis=2), grouped.max(axis=2)


def scale_and_zero_point(lo, hi, scheme: QuantScheme, scale_dtype: str = "float64"):
    """Per-group scale and zero point from the group's min and max (SPEC section 4).

    Computed in float64 (no overflow for float16/float32 ranges) and stored in ``scale_dtype``
    one ulp above the nearest value, so that ``scale * steps`` covers the range despite the
    rounding of the computation. Returns (scale, zero_point or None).
    """
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    dt = np.dtype(scale_dtype)
    u = UNIT_ROUNDOFF[dt.name]
    steps = scheme.steps
    amax = np.maximum(-lo, hi)  # max |x| (lo <= hi)
    if scheme.symmetric:
        scale = np.where(amax == 0, 1.0, amax / steps)  # one rounding: one ulp up covers it
        return _round_up(scale, dt, where=amax > 0), None
    constant = hi == lo
    # hi/steps - lo/steps cannot overflow; its three roundings are each <= 2^-53 amax/steps
    # (cancellation when lo and hi are close), so add 6 of those before rounding up.
    scale = hi / steps - lo / steps + 6 * 2.0**-53 * amax / steps
    scale = np.maximum(scale, 8 * u * amax)
    scale = np.where(constant, np.where(lo == 0, 1.0, np.abs(lo)), scale)
    scale = _round_up(scale, dt, where=~constant)
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(constant, 0.0, np.rint(scheme.qmin - lo / scale.astype(np.float64)))
    return scale, zero.astype(dt)


def _round_up(scale, dt: np.dtype, where) -> np.ndarray:
    """scale stored in dt, one ulp above the nearest value where ``where`` (but never past the
    largest finite value, which covers any range once times steps >= 1)."""
    stored = scale.astype(dt)
    with np.errstate(over="ignore"):
        up = np.nextafter(stored, dt.type(np.inf))
    return np.where(where & np.isfinite(up), up, stored).astype(dt)


# --------------------------------------------------------------------------------------------
# Packing (the reference: plain and obviously right; backends have their own fast versions)


def pack_bits(codes, slot_bits: int) -> np.ndarray:
    """Signed codes -> uint8, ``8/slot_bits`` per byte, two's complement, first code lowest."""
    per = 8 // slot_bits
    flat = np.asarray(codes).ravel().astype(np.int64) & ((1 << slot_bits) - 1)
    flat = np.concatenate([flat, np.zeros(-len(flat) % per, dtype=np.int64)])
    shifts = np.arange(per, dtype=np.int64) * slot_bits
    return (flat.reshape(-1, per) << shifts).sum(axis=1).astype(np.uint8)


def unpack_bits(packed, slot_bits: int, count: int) -> np.ndarray:
    """uint8 -> the first ``count`` signed codes (sign-extended from ``slot_bits``), as int8."""
    per = 8 // slot_bits
    shifts = np.arange(per, dtype=np.int64) * slot_bits
    raw = (np.asarray(packed).astype(np.int64).reshape(-1, 1) >> shifts) & ((1 << slot_bits) - 1)
    raw = raw.ravel()[:count]
    return np.where(raw >= 1 << (slot_bits - 1), raw - (1 << slot_bits), raw).astype(np.int8)


# --------------------------------------------------------------------------------------------
# The float64 reference quantizer (also a valid implementation of the protocol)


def quantize(x, scheme: QuantScheme, *, scale=None, zero_point=None) -> QuantizedTensor:
    """Reference quantization in float64. ``scale`` (and ``zero_point``) given: a calibrated
    scale, broadcast to the groups; values beyond the codes saturate."""
    x = np.asarray(x)
    lay = validate_input(x, scheme)
    xr = lay.to_rows(x).astype(np.float64)
    if scale is None:
        lo, hi = group_min_max(xr, lay)
        s, z = scale_and_zero_point(lo, hi, scheme, "float64")
    else:
        s, z = external_scale(scale, zero_point, xr, lay)
    q = np.rint(xr / lay.expand(s))
    if z is not None:
        q = q + lay.expand(z)
    codes = np.clip(q, scheme.qmin, scheme.qmax).astype(np.int8)
    if scheme.packed:
        codes = pack_bits(codes, scheme.slot_bits)
    return QuantizedTensor(codes, s, z, x.shape, x.dtype.name, scheme, scheme.packed, "float64")


def external_scale(scale, zero_point, rows2d, lay: Layout, dtype="float64"):
    """A calibrated scale (and zero point) broadcast to the groups, checked positive and finite."""
    s = np.broadcast_to(np.asarray(scale, dtype=np.float64), lay.meta_shape).astype(dtype)
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"quantize: an external scale must be positive and finite, got {scale!r}")
    if lay.scheme.symmetric:
        if zero_point is not None:
            raise ValueError("quantize: a symmetric scheme takes no zero_point")
        return s, None
    if zero_point is None:
        lo, _ = group_min_max(rows2d, lay)
        z = np.rint(lay.scheme.qmin - np.asarray(lo, np.float64) / s.astype(np.float64))
    else:
        z = np.broadcast_to(np.asarray(zero_point, dtype=np.float64), lay.meta_shape)
        if not (np.isfinite(z).all() and (z == np.rint(z)).all()):
            raise ValueError(f"quantize: zero_point must be integer-valued, got {zero_point!r}")
    return s, np.asarray(z, dtype=dtype)


def unpack_codes(qt: QuantizedTensor) -> np.ndarray:
    """The (R, C) signed codes of a NumPy quantized tensor."""
    lay = qt.layout
    if qt.packed:
        return unpack_bits(qt.codes, qt.scheme.slot_bits, lay.size).reshape(lay.rows, lay.channels)
    return np.asarray(qt.codes).reshape(lay.rows, lay.channels)



def dequantize(qt: QuantizedTensor, out_dtype=np.float64) -> np.ndarray:
    """Reference x_hat = (q - zero_point) * scale, in float64."""
    lay = qt.layout
    q = unpack_codes(qt).astype(np.float64)
    if qt.zero_point is not None:
        q = q - lay.expand(np.asarray(qt.zero_point, dtype=np.float64))
    with np.errstate(over="ignore"):
        x_hat = q * lay.expand(np.asarray(qt.scale, dtype=np.float64))
    top = np.finfo(out_dtype).max  # a value just past the top of the range stays finite
    return lay.from_rows(np.clip(x_hat, -top, top)).astype(out_dtype)


# --------------------------------------------------------------------------------------------
# Error statistics


@dataclass(frozen=True)
class QuantStats:
    max_abs_error: float
    mean_abs_error: float
    rmse: float
    compression_ratio: float  # original bytes / (code bytes + metadata bytes)
    original_bytes: int = 0
    stored_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def error_stats(x, x_hat, qt: QuantizedTensor | None = None) -> QuantStats:
    """max |x - x_hat|, mean |x - x_hat|, RMSE (float64; 0 for an empty tensor) and the
    compression ratio of ``qt`` as stored (1.0 when nothing is stored at all)."""
    xa, _ = to_numpy(x)
    xh, _ = to_numpy(x_hat)
    mx, mean, rmse = error_moments(np.abs(xa.astype(np.float64) - xh.astype(np.float64)))
    original = int(xa.size * np.dtype(_numpy_dtype_for(qt.dtype if qt else xa.dtype.name)).itemsize)
    stored = stored_bytes(qt) if qt is not None else original
    ratio = original / stored if stored else 1.0
    return QuantStats(mx, mean, rmse, ratio, original, stored)


def error_moments(err) -> tuple[float, float, float]:
    """(max, mean, rmse) of absolute errors, scaled by the max so that neither the sum nor the
    squares overflow or underflow (errors near 1e308 or 1e-310 in float64)."""
    err = np.asarray(err, dtype=np.float64).ravel()
    if err.size == 0:
        return 0.0, 0.0, 0.0
    m = float(err.max())
    if m == 0 or not math.isfinite(m):
        return m, (float(err.mean()) if m == 0 else m), m
    r = err / m
    return m, m * float(r.mean()), m * math.sqrt(float(np.mean(r * r)))


def _numpy_dtype_for(name_: str):
    return {"bfloat16": np.uint16}.get(name_, name_)  # bfloat16: 2 bytes, as uint16


def expected_compression_ratio(shape, dtype: str, scheme: QuantScheme, packed: bool,
                               scale_itemsize: int, zero_point_itemsize: int) -> tuple[float, int, int]:
    """SPEC: original bytes / (code bytes + every scale and zero point). Returns (ratio,
    original, stored). Code bytes: ceil(n * slot / 8) packed, n unpacked (int8)."""
    lay = layout(shape, scheme)
    n = lay.size
    original = n * np.dtype(_numpy_dtype_for(dtype)).itemsize
    code_bytes = -(-n * scheme.slot_bits // 8) if packed else n
    meta = lay.groups * (scale_itemsize + (0 if scheme.symmetric else zero_point_itemsize))
    stored = code_bytes + meta
    return (original / stored if stored else 1.0), original, stored


# --------------------------------------------------------------------------------------------
# The checker


@dataclass(frozen=True)
class QuantFailure:
    """One anomaly: what, where (index in the input, or in the scale array), expected, actual."""

    quantity: str
    index: tuple | None
    expected: object
    actual: object
    detail: str = ""

    def __str__(self) -> str:
        where = f" at {list(self.index)}" if self.index is not None else ""
        return (f"{self.quantity}{where}: expected {self.expected!r}, got {self.actual!r}"
                + (f" ({self.detail})" if self.detail else ""))


@dataclass
class QuantVerdict:
    """The checker's verdict as data: valid, and the first failure of each kind in check order."""

    valid: bool
    failures: tuple = ()
    stats: QuantStats | None = None  # recomputed by the checker
    rmse_ratio: dict | None = None  # rmse / (scale / sqrt 12) over the groups where it means something
    notes: tuple = ()  # checks skipped and why, refusals observed
    scheme: str = ""

    @property
    def first(self) -> QuantFailure | None:
        return self.failures[0] if self.failures else None

    def quantities(self) -> list:
        return [f.quantity for f in self.failures]

    def failure(self, quantity: str) -> QuantFailure | None:
        return next((f for f in self.failures if f.quantity == quantity), None)

    def explain(self) -> str:
        if self.valid:
            return f"valid ({self.scheme})" + (f"; {'; '.join(self.notes)}" if self.notes else "")
        return f"INVALID ({self.scheme}): " + "; ".join(str(f) for f in self.failures)

    def as_dict(self) -> dict:
        return {"valid": self.valid, "scheme": self.scheme,
                "failures": [asdict(f) for f in self.failures],
                "stats": self.stats.as_dict() if self.stats else None,
                "rmse_ratio": self.rmse_ratio, "notes": list(self.notes)}


def to_numpy(a) -> tuple[np.ndarray, str]:
    """(a NumPy array, the dtype name it had). torch tensors: to CPU; bfloat16 and float8 to
    float32 (exact)."""
    if hasattr(a, "detach") and hasattr(a, "dtype"):  # torch, without importing it
        dname = str(a.dtype).removeprefix("torch.")
        t = a.detach()
        if dname == "bfloat16" or dname.startswith("float8"):
            t = t.float()
        return t.cpu().numpy(), dname
    arr = np.asarray(a)
    return arr, arr.dtype.name


class _Failures:
    def __init__(self):
        self.items: dict[str, QuantFailure] = {}

    def add(self, quantity, index, expected, actual, detail=""):
        if quantity not in self.items:
            self.items[quantity] = QuantFailure(quantity, index, _py(expected), _py(actual), detail)

    def first_bad(self, quantity, bad, expected, actual, index_of, detail=None):
        """Record the first True of the boolean array ``bad`` (flat order)."""
        flat = np.flatnonzero(np.asarray(bad).ravel())
        if len(flat) and quantity not in self.items:
            k = int(flat[0])
            exp = np.asarray(expected).ravel()[k] if np.ndim(expected) else expected
            act = np.asarray(actual).ravel()[k] if np.ndim(actual) else actual
            d = detail(k) if callable(detail) else (detail or "")
            self.add(quantity, index_of(k), exp, act, f"{d}; {len(flat)} such" if d else f"{len(flat)} such")


def _py(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v


def check_quantization(x, qt: QuantizedTensor, x_hat, *, reported=None, unpacked=None,
                       scale=None, zero_point=None, sanity: bool = True) -> QuantVerdict:
    """Check what a backend stored and returned against SPEC section 4.

    ``x``: the input; ``qt``: the stored codes, scale and zero point; ``x_hat``: the backend's
    dequantized output; ``reported``: its QuantStats (or dict); ``unpacked``: its own unpacking
    of packed codes; ``scale``/``zero_point``: the external ones the backend was given, if any.
    """
    scheme = qt.scheme
    fails = _Failures()
    notes = []
    xa, in_dtype = to_numpy(x)
    lay = layout(xa.shape, scheme)
    if tuple(qt.shape) != tuple(xa.shape):
        fails.add("shape", None, tuple(xa.shape), tuple(qt.shape))
        return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme.describe())
    xh_raw, out_dtype = to_numpy(x_hat)
    if tuple(xh_raw.shape) != tuple(xa.shape):
        fails.add("x_hat shape", None, tuple(xa.shape), tuple(xh_raw.shape))
        return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme.describe())
    u = UNIT_ROUNDOFF[qt.compute_dtype]
    eta = SMALLEST_SUBNORMAL[qt.compute_dtype]
    u_out = UNIT_ROUNDOFF[out_dtype]
    eta_out = SMALLEST_SUBNORMAL[out_dtype]
    X = lay.to_rows(xa).astype(np.float64)
    XH = lay.to_rows(xh_raw).astype(np.float64)
    R, C = lay.rows, lay.channels
    qmin, qmax = scheme.qmin, scheme.qmax
    elem = lambda k: lay.element_index(k // C, k % C) if C else ()  # noqa: E731
    grp = lay.group_index

    # --- metadata as stored
    s_raw, _ = to_numpy(qt.scale)
    if s_raw.size != lay.groups:
        fails.add("scale size", None, lay.groups, int(s_raw.size), f"one per group, meta shape {lay.meta_shape}")
        return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme.describe())
    s = s_raw.astype(np.float64).reshape(lay.meta_shape)
    fails.first_bad("scale", ~(np.isfinite(s) & (s > 0)), "positive finite", s, grp)
    if scheme.symmetric:
        z = np.zeros(lay.meta_shape)
        if qt.zero_point is not None and np.any(to_numpy(qt.zero_point)[0] != 0):
            fails.add("zero_point", None, "none (symmetric)", "nonzero zero point")
    else:
        if qt.zero_point is None:
            fails.add("zero_point", None, "a zero point per group", None)
            return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme.describe())
        z_raw, _ = to_numpy(qt.zero_point)
        if z_raw.size != lay.groups:
            fails.add("zero_point size", None, lay.groups, int(z_raw.size))
            return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme.describe())
        z = z_raw.astype(np.float64).reshape(lay.meta_shape)
        fails.first_bad("zero_point", ~np.isfinite(z) | (z != np.rint(z)), "finite integer", z, grp)
    if fails.items:
        return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme.describe())

    # --- codes: stored size, independent unpacking, range
    codes_raw, _ = to_numpy(qt.codes)
    n = lay.size
    if qt.packed:
        want = -(-n * scheme.slot_bits // 8)
        if codes_raw.size != want or codes_raw.dtype.itemsize != 1:
            fails.add("codes size", None, f"{want} bytes", f"{codes_raw.size} x {codes_raw.dtype}",
                      f"{n} codes of {scheme.slot_bits} bits")
            return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme.describe())
        q = unpack_bits(codes_raw.view(np.uint8), scheme.slot_bits, n).astype(np.int64).reshape(R, C)
    else:
        if codes_raw.size != n or codes_raw.dtype.kind not in "iu":
            fails.add("codes size", None, f"{n} integer codes", f"{codes_raw.size} x {codes_raw.dtype}")
            return QuantVerdict(False, tuple(fails.items.values()), scheme=scheme.describe())
        q = codes_raw.astype(np.int64).reshape(R, C)
    fails.first_bad("code range", (q < qmin) | (q > qmax), f"[{qmin}, {qmax}]", q, elem)
    if unpacked is not None and qt.packed:
        mine, _ = to_numpy(unpacked)
        mine = mine.astype(np.int64).reshape(R, C) if mine.size == n else None
        if mine is None:
            fails.add("unpacked codes", None, f"{n} codes", "wrong size")
        else:
            fails.first_bad("unpacked codes", mine != q, q, mine, elem,
                            f"{scheme.slot_bits}-bit two's complement, sign-extended")

    # --- the groups: min, max, and which are constant or all zero
    if n:
        GX = lay.group_view(X)
        lo = GX.min(axis=1).reshape(lay.meta_shape)
        hi = GX.max(axis=1).reshape(lay.meta_shape)
    else:
        lo = hi = np.zeros(lay.meta_shape)
    ge = lay.group_elements
    nonempty = ge > 0
    constant = (hi == lo) & nonempty
    zero = constant & (lo == 0)
    amax = np.maximum(-lo, hi)
    external = scale is not None

    # --- the scale against the formula (or the external one), the zero point against it
    if external:
        s_ext = np.broadcast_to(np.asarray(scale, dtype=np.float64), lay.meta_shape)
        fails.first_bad("scale", np.abs(s - s_ext) > 4 * u * s_ext + eta, s_ext, s, grp,
                        "the external scale, stored")
    elif nonempty:
        if scheme.symmetric:
            s_ref = amax / qmax
            ok = _close(s, s_ref, u, amax / qmax, eta)
            alt = None
        else:
            steps = qmax - qmin
            s_ref = hi / steps - lo / steps
            floor = 8 * u * amax
            widened = np.maximum(hi, 0) / steps - np.minimum(lo, 0) / steps  # range taken to include 0
            near = _close(s, s_ref, u, amax / steps, eta)
            ok = near | ((s >= s_ref * (1 - 4 * u)) & (s <= floor * (1 + 16 * u)))
            alt = _close(s, widened, u, amax / steps, eta)
            ok = ok | alt
        formula = "max|x|/qmax" if scheme.symmetric else "(max - min)/(qmax - qmin)"
        fails.first_bad("scale", ~ok & ~constant, s_ref, s, grp,
                        lambda k: f"{lay.describe_group(grp(k))}: {formula}, stored rounding allowed "
                                  f"16u (scale + max|x|/steps), u={u:.3g}")
        if not scheme.symmetric:
            lo_used = np.where(alt & ~near, np.minimum(lo, 0), lo)
            with np.errstate(divide="ignore", invalid="ignore"):
                z_ref = np.rint(qmin - lo_used / s)
            slack = 1 + 2 * u * np.abs(lo_used / s)
            fails.first_bad("zero_point", (np.abs(z - z_ref) > slack) & ~constant, z_ref, z, grp,
                            lambda k: f"{lay.describe_group(grp(k))}: round(qmin - min/scale) with the "
                                      f"stored scale; must not wrap")
    if zero_point is not None and not scheme.symmetric:
        z_ext = np.broadcast_to(np.asarray(zero_point, dtype=np.float64), lay.meta_shape)
        fails.first_bad("zero_point", z != z_ext, z_ext, z, grp, "external zero point")

    # --- reconstruction
    S, Z = lay.expand(s), lay.expand(z)
    fails.first_bad("non-finite output", ~np.isfinite(XH), "finite", XH, elem)
    ax = np.abs(X)
    with np.errstate(invalid="ignore", over="ignore"):
        target = np.clip(X, (qmin - Z) * S, (qmax - Z) * S) if external else X
        err = np.abs(XH - target)
        bound = (S / 2 + 2 * u * ax + u * S + u_out * np.abs(XH) + eta_out / 2 + eta * (1 + S))
    over = ~(err <= bound)

    def recon_detail(k):
        worst = int(np.nanargmax(np.where(over, err, -1.0).ravel()))
        return (f"|x - x_hat| = {err.ravel()[k]:.6g} > bound {bound.ravel()[k]:.6g} "
                f"(scale {S.ravel()[k]:.6g}, zero point {Z.ravel()[k]:.6g}, code {q.ravel()[k]}, "
                f"u={u:.3g}, u_out={u_out:.3g}); worst |x - x_hat| = {err.ravel()[worst]:.6g} "
                f"at {list(elem(worst))}")

    fails.first_bad("reconstruction", over, target, XH, elem, recon_detail)
    if n and not external:
        const_e = lay.expand(constant)
        zero_e = lay.expand(zero)
        # a subnormal scale carries an absolute error up to eta, times the code
        ctol = 4 * u * ax + u_out * ax + eta_out / 2 + 2 * eta * (qmax - qmin + 1)
        fails.first_bad("constant channel", const_e & ~zero_e & ~(np.abs(XH - X) <= ctol), X, XH, elem,
                        "a constant channel reconstructs within float rounding")
        fails.first_bad("zero channel", zero_e & (XH != 0), 0.0, XH, elem, "an all-zero channel gives zeros")

    # --- codes against the float64 formula with the stored scale and zero point
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        exact = X / S + Z
        tol = 3 * u * ax / S + 2.0**-50 * (ax / S + np.abs(Z))
        q_ref = np.clip(np.rint(exact), qmin, qmax)
        off = np.abs(q - np.clip(exact, qmin - 0.5, qmax + 0.5))
    fails.first_bad("code", (q != q_ref) & ~(off <= 0.5 + tol), q_ref, q, elem,
                    lambda k: f"x/scale + zero_point = {exact.ravel()[k]:.9g}")

    # --- statistics, recomputed independently
    with np.errstate(over="ignore", invalid="ignore"):
        mx, mean, rmse = error_moments(np.abs(X - XH))
    s_item = s_raw.dtype.itemsize
    z_item = 0 if qt.zero_point is None else to_numpy(qt.zero_point)[0].dtype.itemsize
    ratio, original, stored = expected_compression_ratio(xa.shape, in_dtype, scheme, qt.packed, s_item, z_item)
    mine = QuantStats(float(mx), float(mean), float(rmse), ratio, original, stored)
    if not (mean <= rmse * (1 + 1e-12) and rmse <= mx * (1 + 1e-12)):
        fails.add("stats order", None, "mean_abs_error <= rmse <= max_abs_error", (mean, rmse, mx))
    if reported is not None:
        rep = reported if isinstance(reported, dict) else asdict(reported)
        for key, tol_rel in (("max_abs_error", 1e-5), ("mean_abs_error", 1e-5), ("rmse", 1e-5),
                             ("compression_ratio", 1e-9)):
            want, got = getattr(mine, key), rep.get(key)
            if got is None or not math.isclose(float(got), want, rel_tol=tol_rel, abs_tol=1e-30):
                fails.add(f"reported {key}", None, want, got,
                          "ratio counts codes + every scale and zero point" if key == "compression_ratio" else "")
        r_mean, r_rmse, r_max = (float(rep.get(k, 0)) for k in ("mean_abs_error", "rmse", "max_abs_error"))
        if not (r_mean <= r_rmse * (1 + 1e-9) and r_rmse <= r_max * (1 + 1e-9)):
            fails.add("reported stats order", None, "mean_abs_error <= rmse <= max_abs_error",
                      (r_mean, r_rmse, r_max))

    # --- statistical sanity: rmse / (scale / sqrt 12) near 1 where the uniform-error model holds
    ratio_info = None
    if scheme.bits < 3 or ge < 128:
        notes.append(f"rmse ratio not checked: needs 3+ bits and 128+ elements per group "
                     f"(have {scheme.bits} bits, {ge} elements)")
    elif n:
        GQ = lay.group_view(q)
        GE = lay.group_view(XH - X)
        distinct = 1 + (np.diff(np.sort(GQ, axis=1), axis=1) != 0).sum(axis=1)
        usable = (distinct >= min(2 ** (scheme.bits - 1), 16)) & ~constant.ravel()
        if usable.any():
            with np.errstate(over="ignore"):
                g_rmse = np.sqrt(np.mean(GE[usable] ** 2, axis=1))
            r = g_rmse / (s.ravel()[usable] / math.sqrt(12))
            ratio_info = {"groups": int(usable.sum()), "median": float(np.median(r)),
                          "min": float(r.min()), "max": float(r.max())}
            if sanity and not 0.5 <= ratio_info["median"] <= 1.5:
                fails.add("rmse ratio", None, "median in [0.5, 1.5]", ratio_info["median"],
                          f"over {ratio_info['groups']} groups")
        else:
            notes.append("rmse ratio not checked: no group spreads over enough codes")
    return QuantVerdict(not fails.items, tuple(fails.items.values()), mine, ratio_info, tuple(notes),
                        scheme.describe())


def _close(s, ref, u, magnitude, eta):
    """Stored scale within rounding of the formula: relative to it, to max|x|/steps (the
    formula's own rounding when max and min nearly cancel), and to eta (subnormal scales)."""
    return np.abs(s - ref) <= 16 * u * ref + 16 * u * magnitude + 2 * eta


def check_quantizer(impl, x, scheme: QuantScheme, *, scale=None, zero_point=None,
                    sanity: bool = True) -> QuantVerdict:
    """Drive an implementation (module or object of the protocol above) on x and check it.

    Input the reference refuses (NaN, +-inf, a bad axis or group size) must be refused by the
    implementation too, with ValueError or TypeError.
    """
    desc = scheme.describe()
    try:
        xa, dname = to_numpy(x)
        check_float_dtype(dname)
        layout(xa.shape, scheme)
        if xa.size and not np.isfinite(xa.astype(np.float64)).all():
            raise_non_finite(xa)
        refusal = None
    except (ValueError, TypeError) as e:
        refusal = e
    kwargs = {} if scale is None else {"scale": scale, "zero_point": zero_point}
    try:
        qt = impl.quantize(x, scheme, **kwargs)
    except (ValueError, TypeError) as e:
        if refusal is not None:
            return QuantVerdict(True, notes=(f"refused as required: {e}",), scheme=desc)
        return QuantVerdict(False, (QuantFailure("quantize", None, "a result", f"{type(e).__name__}: {e}"),),
                            scheme=desc)
    if refusal is not None:
        return QuantVerdict(False, (QuantFailure("refusal", None, f"an error ({refusal})", "accepted"),),
                            scheme=desc)
    x_hat = impl.dequantize(qt)
    reported = impl.error_stats(x, x_hat, qt) if hasattr(impl, "error_stats") else None
    unpacked = impl.unpack_codes(qt) if hasattr(impl, "unpack_codes") and qt.packed else None
    return check_quantization(x, qt, x_hat, reported=reported, unpacked=unpacked,
                              scale=scale, zero_point=zero_point, sanity=sanity)


# --------------------------------------------------------------------------------------------
# fp8 e4m3 (torch.float8_e4m3fn): 4 exponent bits (bias 7), 3 mantissa bits, no inf, max 448


def fp8_e4m3_round(y) -> np.ndarray:
    """Nearest e4m3fn value of each y (ties to even), saturating at +-448. float64 in and out."""
    y = np.asarray(y, dtype=np.float64)
    if not np.isfinite(y).all():
        raise ValueError("fp8_e4m3_round: NaN/inf input")
    a = np.abs(y)
    _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): leading bit 2^(e-1)
    quantum = np.ldexp(1.0, np.maximum(e - 1, -6) - FP8_E4M3_MANTISSA_BITS)
    r = np.minimum(np.rint(a / quantum) * quantum, FP8_E4M3_MAX)
    return np.copysign(r, y)


def fp8_e4m3_error_bound(y) -> np.ndarray:
    """|y - fp8(y)| for |y| <= 448: half a quantum, <= 2^-4 |y| (normal) or 2^-10 (subnormal)."""
    return np.maximum(2.0**-(FP8_E4M3_MANTISSA_BITS + 1) * np.abs(y), FP8_E4M3_MIN_NORMAL * 2.0**-4)


@dataclass
class Fp8Tensor:
    codes: object  # float8_e4m3fn (or float values that are e4m3 values)
    scale: float  # one per tensor: x_hat = code * scale
    shape: tuple
    dtype: str
    compute_dtype: str = "float32"


def check_fp8(x, t: Fp8Tensor, x_hat) -> QuantVerdict:
    """e4m3: codes are e4m3 values; |x/scale| >= 448 saturates to +-448; otherwise the code is
    within half a quantum of x/scale, and x_hat within scale times that plus float rounding."""
    fails = _Failures()
    xa, _ = to_numpy(x)
    codes, _ = to_numpy(t.codes)
    xh, out_dtype = to_numpy(x_hat)
    if codes.shape != xa.shape or xh.shape != xa.shape:
        fails.add("shape", None, xa.shape, (codes.shape, xh.shape))
        return QuantVerdict(False, tuple(fails.items.values()), scheme="fp8-e4m3")
    u = UNIT_ROUNDOFF[t.compute_dtype]
    u_out, eta_out = UNIT_ROUNDOFF[out_dtype], SMALLEST_SUBNORMAL[out_dtype]
    X, Cd, XH = (a.astype(np.float64).ravel() for a in (xa, codes, xh))
    s = float(t.scale)
    idx = lambda k: tuple(int(i) for i in np.unravel_index(k, xa.shape))  # noqa: E731
    if not (math.isfinite(s) and s > 0):
        fails.add("scale", None, "positive finite", s)
        return QuantVerdict(False, tuple(fails.items.values()), scheme="fp8-e4m3")
    finite = np.isfinite(Cd)
    fails.first_bad("fp8 code", ~finite | (np.abs(np.where(finite, Cd, 0)) > FP8_E4M3_MAX), "finite, |code| <= 448",
                    Cd, idx)
    cd = np.where(finite, Cd, 0.0)
    fails.first_bad("fp8 code", fp8_e4m3_round(np.clip(cd, -FP8_E4M3_MAX, FP8_E4M3_MAX)) != cd,
                    "an e4m3 value", Cd, idx)
    y = X / s
    y_sat = np.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    sat = np.abs(y) >= FP8_E4M3_MAX
    fails.first_bad("saturation", sat & (Cd != np.sign(y) * FP8_E4M3_MAX), np.sign(y) * FP8_E4M3_MAX, Cd, idx,
                    "|x/scale| >= 448 saturates to +-448")
    code_tol = fp8_e4m3_error_bound(y_sat) + 2 * u * np.abs(y)
    fails.first_bad("fp8 code", ~(np.abs(Cd - y_sat) <= code_tol), y_sat, Cd, idx, "x/scale rounded to e4m3")
    fails.first_bad("non-finite output", ~np.isfinite(XH), "finite", XH, idx)
    bound = s * fp8_e4m3_error_bound(y_sat) + 2 * u * np.abs(X) + u_out * np.abs(XH) + eta_out / 2
    err = np.abs(XH - s * y_sat)
    fails.first_bad("reconstruction", ~(err <= bound), s * y_sat, XH, idx,
                    lambda k: f"|x_sat - x_hat| = {err[k]:.6g} > bound {bound[k]:.6g}")
    e = np.abs(X - XH)
    stats = QuantStats(float(e.max()) if e.size else 0.0, float(e.mean()) if e.size else 0.0,
                       float(np.sqrt(np.mean(e * e))) if e.size else 0.0,
                       (xa.size * xa.dtype.itemsize) / (xa.size + 4) if xa.size else 1.0,
                       int(xa.nbytes), int(xa.size + 4))
    return QuantVerdict(not fails.items, tuple(fails.items.values()), stats, scheme="fp8-e4m3")


def check_fp8_quantizer(impl, x, scale: float = 1.0) -> QuantVerdict:
    try:
        xa, _ = to_numpy(x)
        if xa.size and not np.isfinite(xa.astype(np.float64)).all():
            raise_non_finite(xa)
        refusal = None
    except ValueError as e:
        refusal = e
    try:
        t = impl.quantize_fp8(x, scale=scale)
    except (ValueError, TypeError) as e:
        if refusal is not None:
            return QuantVerdict(True, notes=(f"refused as required: {e}",), scheme="fp8-e4m3")
        return QuantVerdict(False, (QuantFailure("quantize", None, "a result", repr(e)),), scheme="fp8-e4m3")
    if refusal is not None:
        return QuantVerdict(False, (QuantFailure("refusal", None, f"an error ({refusal})", "accepted"),),
                            scheme="fp8-e4m3")
    return check_fp8(x, t, impl.dequantize_fp8(t))


# --------------------------------------------------------------------------------------------
# Capacity: tokens that fit in a byte budget at each KV format, beside the error it costs


@dataclass(frozen=True)
class KVFormat:
    """How a paged cache stores K and V: a scheme for each (None: fp16 / fp8 per-tensor)."""

    name: str
    bits: int
    keys: QuantScheme | None = None
    values: QuantScheme | None = None
    fp8: bool = False


def kv_formats(group_size: int = 32) -> list[KVFormat]:
    """fp16, fp8-e4m3 (per-tensor scale, as vLLM's k_scale/v_scale), int8 per token, int4
    group-wise, and KIVI (keys per channel, values per token) at 8, 4 and 2 bits."""
    tok = lambda b, sym: QuantScheme(b, sym, "token")  # noqa: E731
    chan = lambda b: QuantScheme(b, False, "channel")  # noqa: E731
    grp = QuantScheme(4, False, "group", group_size=group_size)
    return [
        KVFormat("fp16", 16),
        KVFormat("fp8-e4m3", 8, fp8=True),
        KVFormat("int8-token-sym", 8, tok(8, True), tok(8, True)),
        KVFormat("int8-kivi", 8, chan(8), tok(8, False)),
        KVFormat(f"int4-group{group_size}", 4, grp, grp),
        KVFormat("int4-kivi", 4, chan(4), tok(4, False)),
        KVFormat("int2-kivi", 2, chan(2), tok(2, False)),
    ]


def _meta_entries_per_block(scheme: QuantScheme, model: ModelSpec, block_size: int) -> int:
    """Scales one block holds for K (or V): per channel over the block's tokens, per token, or
    per group of G channels of a token; for every layer and KV head."""
    heads = model.layers * model.kv_heads
    if scheme.granularity == "channel":
        return heads * model.head_dim
    if scheme.granularity == "token":
        return heads * block_size
    return heads * block_size * (model.head_dim // scheme.group_size)


def format_block_bytes(fmt: KVFormat, model: ModelSpec, block_size: int, scale_bytes: int = 4) -> tuple[int, int]:
    """(bytes of one block, of which metadata). Scales and zero points take ``scale_bytes`` each
    (float32, as kvbench.quant stores them)."""
    elements = model.layers * model.kv_heads * model.head_dim * block_size  # per K (or V)
    if fmt.keys is None:
        elem_bytes = model.dtype_bytes if not fmt.fp8 else 1
        return 2 * elements * elem_bytes, 0
    total = meta = 0
    for scheme in (fmt.keys, fmt.values):
        code = -(-elements * scheme.slot_bits // 8)
        m = _meta_entries_per_block(scheme, model, block_size) * scale_bytes * (1 if scheme.symmetric else 2)
        total += code + m
        meta += m
    return total, meta


def capacity_table(model: ModelSpec | str, budget_bytes: int, kv_sample=None, *, block_size: int = 16,
                   group_size: int = 32, formats: list | None = None):
    """For a byte budget: blocks and tokens that fit at each KV format (metadata counted per
    block; fp8's per-layer K and V scales once), and, given a K/V sample
    ``[tokens, 2, layers, kv_heads, head_dim]``, the error each format makes on it."""
    import pandas as pd

    model = get_model(model) if isinstance(model, str) else model
    formats = formats or kv_formats(group_size)
    sample = None if kv_sample is None else np.asarray(kv_sample)
    if sample is not None:
        want = (2, model.layers, model.kv_heads, model.head_dim)
        if sample.ndim != 5 or sample.shape[1:] != want:
            raise ValueError(f"capacity_table: kv_sample must be [tokens, {', '.join(map(str, want))}], "
                             f"got {sample.shape}")
    rows = []
    fp16_tokens = None
    for fmt in formats:
        block, meta = format_block_bytes(fmt, model, block_size)
        fixed = 2 * model.layers * 4 if fmt.fp8 else 0  # k_scale, v_scale per layer
        blocks = max(0, budget_bytes - fixed) // block
        tokens = blocks * block_size
        if fmt.name == "fp16":
            fp16_tokens = tokens
        row = {"format": fmt.name, "bits": fmt.bits,
               "keys": fmt.keys.describe() if fmt.keys else ("per-tensor scale" if fmt.fp8 else "-"),
               "values": fmt.values.describe() if fmt.values else ("per-tensor scale" if fmt.fp8 else "-"),
               "block_bytes": block, "metadata_fraction": meta / block, "blocks": blocks, "tokens": tokens}
        if sample is not None:
            for side, part in (("key", sample[:, 0]), ("value", sample[:, 1])):
                err = _format_error(fmt, part, block_size, side)
                row[f"{side}_max_abs_error"], row[f"{side}_rmse"] = err
        rows.append(row)
    df = pd.DataFrame(rows)
    if fp16_tokens:
        df["tokens_vs_fp16"] = df["tokens"] / fp16_tokens
    return df


def _format_error(fmt: KVFormat, part, block_size: int, side: str) -> tuple[float, float]:
    """(max abs error, rmse) of one format on K or V ``[tokens, layers, heads, head_dim]``."""
    x = np.asarray(part, dtype=np.float64)
    if x.size == 0:
        return 0.0, 0.0
    if fmt.fp8:
        x_hat = np.empty_like(x)
        for layer in range(x.shape[1]):  # one scale per layer for K (V)
            amax = np.abs(x[:, layer]).max()
            s = amax / FP8_E4M3_MAX if amax > 0 else 1.0
            x_hat[:, layer] = fp8_e4m3_round(x[:, layer] / s) * s
    elif fmt.keys is None:
        x_hat = np.asarray(part).astype(np.float16).astype(np.float64)
    else:
        scheme = fmt.keys if side == "key" else fmt.values
        if scheme.granularity == "channel":
            # Per channel over each block's tokens: (blocks, B, L, H, d) -> (B, blocks * L * H * d).
            t = x.shape[0]
            b = block_size if t >= block_size else t
            t_used = t - t % b
            x = x[:t_used]
            blocked = x.reshape(t_used // b, b, -1).transpose(1, 0, 2).reshape(b, -1)
            x_hat_b = dequantize(quantize(blocked, scheme))
            x_hat = x_hat_b.reshape(b, t_used // b, -1).transpose(1, 0, 2).reshape(x.shape)
        else:
            x_hat = dequantize(quantize(x, scheme))
    e = np.abs(x - x_hat)
    return float(e.max()), float(np.sqrt(np.mean(e * e)))


__all__ = [
    "QuantScheme", "Layout", "layout", "QuantizedTensor", "QuantStats", "QuantFailure", "QuantVerdict",
    "validate_input", "raise_non_finite", "check_float_dtype", "scale_and_zero_point", "group_min_max",
    "pack_bits", "unpack_bits", "quantize", "dequantize", "unpack_codes", "error_stats", "stored_bytes",
    "expected_compression_ratio", "error_moments", "check_quantization", "check_quantizer", "to_numpy", "unit_roundoff",
    "UNIT_ROUNDOFF", "SMALLEST_SUBNORMAL", "SCALE_DTYPE", "FP8_E4M3_MAX", "fp8_e4m3_round",
    "fp8_e4m3_error_bound", "Fp8Tensor", "check_fp8", "check_fp8_quantizer", "KVFormat", "kv_formats",
    "format_block_bytes", "capacity_table", "external_scale",
]
