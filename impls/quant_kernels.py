"""Compiled kernels for the NumPy quantizer (numba, a core dependency; where it
cannot be imported the NumPy steps run).

NumPy cannot quantize near the speed of a copy: a per-token or per-group min and max is a
reduction over a short inner axis, which NumPy runs as one inner loop per group (4x a copy of
the same bytes for rows of 128, 20x for groups of 32), and the float64 scale formulas then run
over arrays with one entry per group. Here a row's groups are done where they are read:

- ``group_params``: one pass over x: each group's min and max, and from them its scale and
  zero point, by the float64 formulas of :func:`kvbench.quant.reference.scale_and_zero_point`,
  and the float32 factor and addend of :class:`impls.quant_numpy.Params` (one rounding trick:
  ``x * (1/scale) + (z + 1.5 * 2^23)`` rounds once, the code is the float minus the constant);
- ``group_codes``: a second pass: each code, clipped only where a group needs it, packed two or
  four to a byte when the scheme packs;
- ``column_min_max`` / ``channel_codes``: the same for per-channel scales (the scale formula
  then runs in NumPy, over one entry per channel).

The kernels compute exactly what the NumPy path computes (IEEE float32 and float64 steps in the
same order, no fused multiply-add, no fast-math): tests/quant/test_quant_kernels.py holds the two to
identical codes, scales and zero points. Where they do not apply (float64 input, an external
scale, a zero point too large for the rounding trick) the NumPy path runs.
"""
from __future__ import annotations

import numpy as np

try:
    import numba
    _IMPORT_ERROR = ""
except ImportError as e:  # a dependency, but an install may lack it
    numba = None
    _IMPORT_ERROR = str(e)

MAGIC32 = 1.5 * 2.0 ** 23  # float32: round(y) held in the low bits of y + MAGIC32, |y| < 2^22


def available() -> tuple[bool, str]:
    if numba is None:
        return False, f"numba cannot be imported ({_IMPORT_ERROR}); pip install numba (a kvbench dependency)"
    return True, ""


def _jit(fn):
    return numba.njit(cache=True, nogil=True, boundscheck=False)(fn) if numba is not None else fn


def _inline(fn):
    """A helper compiled into its callers (a call per group would cost more than its work)."""
    return numba.njit(nogil=True, boundscheck=False, inline="always")(fn) if numba is not None else fn


TILE_GROUPS = 1 << 11  # groups per tile: 2048 x 32 floats = 256 KiB, read once, then in cache


@_inline
def _key(b):
    """float32 bits -> an int32 in the same order (negatives flipped): integer min and max
    vectorize where float ones do not (IEEE compares are not reassociable)."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


KEY_NEG_INF = -8388608 ^ 0x7FFFFFFF  # the key of -inf (bits 0xFF800000); NaNs lie beyond +-inf
KEY_POS_INF = 0x7F800000


@_inline
def _tile_min_max(B, g0, g1, lo, hi):
    """Min and max keys of groups g0..g1-1 of B ((groups, G) int32 bits), as float32 bits;
    whether any element is inf or NaN (a key at or beyond an infinity's)."""
    bad = False
    for g in range(g0, g1):
        row = B[g]
        a = np.int32(0x7FFFFFFF)
        b = np.int32(-0x80000000)
        for i in range(row.size):
            k = _key(row[i])
            a = min(a, k)
            b = max(b, k)
        bad |= a <= KEY_NEG_INF or b >= KEY_POS_INF
        lo[g - g0] = _key(a)
        hi[g - g0] = _key(b)
    return bad


@_inline
def _tile_params(lo_b, hi_b, n, symmetric, steps, qmin, u8, low, high, s, z, f, a, up):
    """Scale and zero point of n groups from their min / max bits, by the float64 steps of
    reference.scale_and_zero_point (rounded one ulp up as its _round_up does), and the float32
    reciprocal and addend of Params. Returns (any reciprocal not finite, max |zero point|,
    whether an extreme leaves [low, high] through x * (1/s) + a, and through x / s + a: Params.clip
    for each of its two ways to divide)."""
    lo32 = lo_b[:n].view(np.float32)
    hi32 = hi_b[:n].view(np.float32)
    six = 6.0 * 2.0 ** -53
    if symmetric:
        for i in range(n):
            amax = max(-np.float64(lo32[i]), np.float64(hi32[i]))
            up[i] = amax > 0.0
            s[i] = np.float32(amax / steps if amax > 0.0 else 1.0)
    else:
        for i in range(n):
            lo = np.float64(lo32[i])
            hi = np.float64(hi32[i])
            amax = max(-lo, hi)
            sc = max(hi / steps - lo / steps + six * amax / steps, u8 * amax)
            constant = hi == lo
            up[i] = not constant
            s[i] = np.float32(sc if not constant else (abs(lo) if lo != 0.0 else 1.0))
    sb = s[:n].view(np.int32)
    for i in range(n):  # one ulp up: the next float32 of a positive finite one, where finite
        nxt = sb[i] + 1
        ok = up[i] and (nxt & 0x7F800000) != 0x7F800000 and (sb[i] & 0x7F800000) != 0x7F800000
        sb[i] = nxt if ok else sb[i]
    if symmetric:
        for i in range(n):
            z[i] = np.float32(0.0)
    else:
        for i in range(n):
            zi = np.rint(qmin - np.float64(lo32[i]) / np.float64(s[i]))
            z[i] = np.float32(zi if up[i] else 0.0)
    inv_bad = False
    clip_mul = False
    clip_div = False
    zmax = 0.0
    for i in range(n):
        inv = np.float32(1.0 / np.float64(s[i]))
        inv_bad |= not abs(inv) <= np.float32(3.4028235e38)
        f[i] = inv
        a[i] = np.float32(np.float64(z[i]) + MAGIC32)
        zmax = max(zmax, abs(np.float64(z[i])))
    for i in range(n):
        clip_mul |= lo32[i] * f[i] + a[i] < low or hi32[i] * f[i] + a[i] > high
        clip_div |= lo32[i] / s[i] + a[i] < low or hi32[i] / s[i] + a[i] > high
    return inv_bad, zmax, clip_mul, clip_div


@_jit
def group_params(X, symmetric, steps, qmin, u8, low, high, s, z, f, a):
    """Per group (row of X: (groups, G) float32): scale and zero point as stored (float32),
    the float32 reciprocal and addend of the rounding trick, a tile of groups at a time.
    Returns (any element non-finite, any reciprocal not finite, max |zero point|, clip when
    multiplying, clip when dividing)."""
    ng = X.shape[0]
    B = X.view(np.int32)
    T = min(TILE_GROUPS, ng)
    lo = np.empty(T, np.int32)
    hi = np.empty(T, np.int32)
    up = np.empty(T, np.bool_)
    bad = False
    inv_bad = False
    clip_mul = False
    clip_div = False
    zmax = 0.0
    for g0 in range(0, ng, T):
        g1 = min(ng, g0 + T)
        bad |= _tile_min_max(B, g0, g1, lo, hi)
        ib, zm, cm, cd = _tile_params(lo, hi, g1 - g0, symmetric, steps, qmin, u8, low, high,
                                      s[g0:g1], z[g0:g1], f[g0:g1], a[g0:g1], up)
        inv_bad |= ib
        clip_mul |= cm
        clip_div |= cd
        zmax = max(zmax, zm)
    return bad, inv_bad, zmax, clip_mul, clip_div


@_inline
def _tile_codes(X, f, a, g0, g1, divide, clip, low, high, out):
    """Codes of groups g0..g1-1 of X into rows 0.. of out: round(x * f + a) - magic (or x / f),
    clipped to [low, high] (bounds shifted by magic) where ``clip``. One loop nest per variant,
    the branch outside it, so that each inner loop vectorizes."""
    magic = np.float32(MAGIC32)
    G = X.shape[1]
    if not divide and not clip:
        for g in range(g0, g1):
            x, o, fg, ag = X[g], out[g - g0], f[g], a[g]
            for i in range(G):
                o[i] = np.int8(np.int32(x[i] * fg + ag - magic))
    elif not divide:
        for g in range(g0, g1):
            x, o, fg, ag = X[g], out[g - g0], f[g], a[g]
            for i in range(G):
                o[i] = np.int8(np.int32(min(max(x[i] * fg + ag, low), high) - magic))
    elif not clip:
        for g in range(g0, g1):
            x, o, fg, ag = X[g], out[g - g0], f[g], a[g]
            for i in range(G):
                o[i] = np.int8(np.int32(x[i] / fg + ag - magic))
    else:
        for g in range(g0, g1):
            x, o, fg, ag = X[g], out[g - g0], f[g], a[g]
            for i in range(G):
                o[i] = np.int8(np.int32(min(max(x[i] / fg + ag, low), high) - magic))


@_jit
def group_codes(X, f, a, divide, clip, low, high, codes):
    """codes (groups, G) int8 of X (groups, G)."""
    _tile_codes(X, f, a, 0, X.shape[0], divide, clip, low, high, codes)


@_jit
def _pack(q, slot, o):
    """The first ``len(o) * 8 / slot`` codes of q into o, ``8 / slot`` to a byte, first code in
    the low bits."""
    if slot == 4:
        for j in range(len(o)):
            o[j] = np.uint8((q[2 * j] & 15) | ((q[2 * j + 1] & 15) << 4))
    else:
        for j in range(len(o)):
            o[j] = np.uint8((q[4 * j] & 3) | ((q[4 * j + 1] & 3) << 2)
                            | ((q[4 * j + 2] & 3) << 4) | ((q[4 * j + 3] & 3) << 6))


@_jit
def group_codes_packed(X, f, a, divide, clip, low, high, slot, out):
    """The same codes packed ``8 / slot`` to a byte (G * slot a multiple of 8), first code in
    the low bits, over the groups in order: a tile of codes, then the tile packed in one loop."""
    ng, G = X.shape
    T = min(TILE_GROUPS, ng)
    q2 = np.empty((T, G), np.int8)
    q = q2.reshape(-1)
    per = 8 // slot
    for g0 in range(0, ng, T):
        g1 = min(ng, g0 + T)
        _tile_codes(X, f, a, g0, g1, divide, clip, low, high, q2)
        m = (g1 - g0) * G // per
        _pack(q, slot, out[g0 * G // per:g0 * G // per + m])


@_jit
def column_min_max(X, lo, hi):
    """Column min and max of X (R, C); returns whether any element is non-finite."""
    R, C = X.shape
    chk = np.zeros(C, np.float32)
    for c in range(C):
        lo[c] = X[0, c]
        hi[c] = X[0, c]
    for r in range(R):
        for c in range(C):
            v = X[r, c]
            lo[c] = v if v < lo[c] else lo[c]
            hi[c] = v if v > hi[c] else hi[c]
            chk[c] += v * np.float32(0.0)
    for c in range(C):
        if chk[c] != 0.0:
            return True
    return False


@_jit
def channel_codes(X, f, a, divide, clip, low, high, codes):
    """codes (R, C) of X (R, C) with a factor and addend per column."""
    magic = np.float32(MAGIC32)
    R, C = X.shape
    for r in range(R):
        x, o = X[r], codes[r]
        if not divide and not clip:
            for c in range(C):
                o[c] = np.int8(np.int32(x[c] * f[c] + a[c] - magic))
        elif not divide:
            for c in range(C):
                o[c] = np.int8(np.int32(min(max(x[c] * f[c] + a[c], low), high) - magic))
        elif not clip:
            for c in range(C):
                o[c] = np.int8(np.int32(x[c] / f[c] + a[c] - magic))
        else:
            for c in range(C):
                o[c] = np.int8(np.int32(min(max(x[c] / f[c] + a[c], low), high) - magic))


@_jit
def channel_codes_packed(X, f, a, divide, clip, low, high, slot, out):
    """The same codes packed ``8 / slot`` to a byte over the row-major order (C * slot a
    multiple of 8), first code in the low bits."""
    R, C = X.shape
    per = 8 // slot
    T = max(1, min(R, (1 << 16) // C))
    q2 = np.empty((T, C), np.int8)
    q = q2.reshape(-1)
    for r0 in range(0, R, T):
        r1 = min(R, r0 + T)
        channel_codes(X[r0:r1], f, a, divide, clip, low, high, q2)
        m = (r1 - r0) * C // per
        _pack(q, slot, out[r0 * C // per:r0 * C // per + m])
