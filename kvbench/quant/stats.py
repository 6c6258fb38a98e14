"""Error statistics of a quantized tensor and its compression ratio (SPEC section 4)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from kvbench.quant.layouts import (
    QuantizedTensor,
    QuantScheme,
    layout,
    stored_bytes,
    to_numpy,
)


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
