"""Quantization layouts (SPEC section 4): schemes, the (R, C) view of a tensor, stored tensors,
bit packing, and the float constants every part of the quantization wing shares.

Layout. The chosen axis moves last and the tensor is read as rows x channels, ``(R, C)``:

- ``channel``: one scale per channel, over the R rows (keys in KIVI);
- ``token``: one scale per row, over its C channels (values in KIVI);
- ``group``: one scale per G consecutive channels of a row (``C % G == 0``).

Codes are signed: symmetric ``[-qmax, qmax]``, asymmetric ``[qmin, qmax]`` with
``qmin = -2^(bits-1)``, ``qmax = 2^(bits-1) - 1``. Codes of 2 bits are packed four to a byte,
3 and 4 bits two to a byte (two's complement in the slot, first code in the low bits, over the
row-major ``(R, C)`` codes), 5 to 8 bits one int8 each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GRANULARITIES = ("channel", "token", "group")

# Unit roundoff u and smallest positive subnormal eta of each float dtype, by name.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53,
                 "float8_e4m3fn": 2.0**-4}
SMALLEST_SUBNORMAL = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149,
                      "float64": 2.0**-1074, "float8_e4m3fn": 2.0**-9}
# The dtype of the arithmetic and of the stored scale and zero point, by input dtype.
SCALE_DTYPE = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}


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


def unpack_codes(qt: QuantizedTensor) -> np.ndarray:
    """The (R, C) signed codes of a NumPy quantized tensor."""
    lay = qt.layout
    if qt.packed:
        return unpack_bits(qt.codes, qt.scheme.slot_bits, lay.size).reshape(lay.rows, lay.channels)
    return np.asarray(qt.codes).reshape(lay.rows, lay.channels)



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
