"""The quantization checker: what a backend stored and returned, against SPEC section 4's bounds.

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

from kvbench.quant.layouts import (
    SMALLEST_SUBNORMAL,
    UNIT_ROUNDOFF,
    QuantizedTensor,
    QuantScheme,
    check_float_dtype,
    layout,
    raise_non_finite,
    to_numpy,
    unpack_bits,
)
from kvbench.quant.stats import QuantStats, error_moments, expected_compression_ratio


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
    """The checker's verdict as data: valid, and the first failure of each kind in check order
    (the shape of kvbench.checking.verdict.Verdict: valid, status, failures, first, explain())."""

    valid: bool
    failures: tuple = ()
    stats: QuantStats | None = None  # recomputed by the checker
    rmse_ratio: dict | None = None  # rmse / (scale / sqrt 12) over the groups where it means something
    notes: tuple = ()  # checks skipped and why, refusals observed
    scheme: str = ""

    @property
    def status(self) -> str:
        return "pass" if self.valid else "FAIL"

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
    c = _QuantCheck(x, qt, x_hat, external=scale is not None)
    # The stored shapes, metadata and codes first: nothing else can be read without them.
    if not (c.shapes() and c.metadata() and c.codes(unpacked)):
        return QuantVerdict(False, tuple(c.fails.items.values()), scheme=c.scheme.describe())
    c.groups()
    c.scale_formula(scale, zero_point)
    c.reconstruction()
    c.code_formula()
    mine = c.statistics(reported)
    ratio_info = c.rmse_sanity(sanity)
    return QuantVerdict(not c.fails.items, tuple(c.fails.items.values()), mine, ratio_info,
                        tuple(c.notes), c.scheme.describe())


class _QuantCheck:
    """The stages of :func:`check_quantization`, over the (R, C) view of the input and output."""

    def __init__(self, x, qt: QuantizedTensor, x_hat, external: bool):
        self.qt, self.scheme, self.external = qt, qt.scheme, external
        self.fails = _Failures()
        self.notes = []
        self.xa, self.in_dtype = to_numpy(x)
        self.xh_raw, self.out_dtype = to_numpy(x_hat)
        self.lay = lay = layout(self.xa.shape, self.scheme)
        self.u = UNIT_ROUNDOFF[qt.compute_dtype]
        self.eta = SMALLEST_SUBNORMAL[qt.compute_dtype]
        C = lay.channels
        self.elem = lambda k: lay.element_index(k // C, k % C) if C else ()
        self.grp = lay.group_index

    def shapes(self) -> bool:
        xa, fails = self.xa, self.fails
        if tuple(self.qt.shape) != tuple(xa.shape):
            fails.add("shape", None, tuple(xa.shape), tuple(self.qt.shape))
            return False
        if tuple(self.xh_raw.shape) != tuple(xa.shape):
            fails.add("x_hat shape", None, tuple(xa.shape), tuple(self.xh_raw.shape))
            return False
        self.u_out = UNIT_ROUNDOFF[self.out_dtype]
        self.eta_out = SMALLEST_SUBNORMAL[self.out_dtype]
        self.X = self.lay.to_rows(xa).astype(np.float64)
        self.XH = self.lay.to_rows(self.xh_raw).astype(np.float64)
        return True

    def metadata(self) -> bool:
        """The scale and zero point as stored: one per group, positive finite, integer zero points."""
        qt, lay, fails, grp = self.qt, self.lay, self.fails, self.grp
        self.s_raw, _ = to_numpy(qt.scale)
        if self.s_raw.size != lay.groups:
            fails.add("scale size", None, lay.groups, int(self.s_raw.size),
                      f"one per group, meta shape {lay.meta_shape}")
            return False
        s = self.s = self.s_raw.astype(np.float64).reshape(lay.meta_shape)
        fails.first_bad("scale", ~(np.isfinite(s) & (s > 0)), "positive finite", s, grp)
        if self.scheme.symmetric:
            self.z = np.zeros(lay.meta_shape)
            if qt.zero_point is not None and np.any(to_numpy(qt.zero_point)[0] != 0):
                fails.add("zero_point", None, "none (symmetric)", "nonzero zero point")
        else:
            if qt.zero_point is None:
                fails.add("zero_point", None, "a zero point per group", None)
                return False
            z_raw, _ = to_numpy(qt.zero_point)
            if z_raw.size != lay.groups:
                fails.add("zero_point size", None, lay.groups, int(z_raw.size))
                return False
            z = self.z = z_raw.astype(np.float64).reshape(lay.meta_shape)
            fails.first_bad("zero_point", ~np.isfinite(z) | (z != np.rint(z)), "finite integer", z, grp)
        return not fails.items

    def codes(self, unpacked) -> bool:
        """Stored size, independent unpacking, range."""
        qt, scheme, lay, fails, elem = self.qt, self.scheme, self.lay, self.fails, self.elem
        R, C, n = lay.rows, lay.channels, lay.size
        codes_raw, _ = to_numpy(qt.codes)
        if qt.packed:
            want = -(-n * scheme.slot_bits // 8)
            if codes_raw.size != want or codes_raw.dtype.itemsize != 1:
                fails.add("codes size", None, f"{want} bytes", f"{codes_raw.size} x {codes_raw.dtype}",
                          f"{n} codes of {scheme.slot_bits} bits")
                return False
            q = unpack_bits(codes_raw.view(np.uint8), scheme.slot_bits, n).astype(np.int64).reshape(R, C)
        else:
            if codes_raw.size != n or codes_raw.dtype.kind not in "iu":
                fails.add("codes size", None, f"{n} integer codes", f"{codes_raw.size} x {codes_raw.dtype}")
                return False
            q = codes_raw.astype(np.int64).reshape(R, C)
        self.q = q
        qmin, qmax = scheme.qmin, scheme.qmax
        fails.first_bad("code range", (q < qmin) | (q > qmax), f"[{qmin}, {qmax}]", q, elem)
        if unpacked is not None and qt.packed:
            mine, _ = to_numpy(unpacked)
            mine = mine.astype(np.int64).reshape(R, C) if mine.size == n else None
            if mine is None:
                fails.add("unpacked codes", None, f"{n} codes", "wrong size")
            else:
                fails.first_bad("unpacked codes", mine != q, q, mine, elem,
                                f"{scheme.slot_bits}-bit two's complement, sign-extended")
        return True

    def groups(self) -> None:
        """Each group's min and max, and which groups are constant or all zero."""
        lay = self.lay
        if lay.size:
            GX = lay.group_view(self.X)
            self.lo = GX.min(axis=1).reshape(lay.meta_shape)
            self.hi = GX.max(axis=1).reshape(lay.meta_shape)
        else:
            self.lo = self.hi = np.zeros(lay.meta_shape)
        self.nonempty = lay.group_elements > 0
        self.constant = (self.hi == self.lo) & self.nonempty
        self.zero = self.constant & (self.lo == 0)
        self.amax = np.maximum(-self.lo, self.hi)

    def scale_formula(self, scale, zero_point) -> None:
        """The scale against the formula (or the external one), the zero point against it."""
        scheme, lay, fails, grp = self.scheme, self.lay, self.fails, self.grp
        s, z, u, eta = self.s, self.z, self.u, self.eta
        lo, hi, amax, constant = self.lo, self.hi, self.amax, self.constant
        qmin, qmax = scheme.qmin, scheme.qmax
        if self.external:
            s_ext = np.broadcast_to(np.asarray(scale, dtype=np.float64), lay.meta_shape)
            fails.first_bad("scale", np.abs(s - s_ext) > 4 * u * s_ext + eta, s_ext, s, grp,
                            "the external scale, stored")
        elif self.nonempty:
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
                                lambda k: f"{lay.describe_group(grp(k))}: round(qmin - min/scale) with "
                                          f"the stored scale; must not wrap")
        if zero_point is not None and not scheme.symmetric:
            z_ext = np.broadcast_to(np.asarray(zero_point, dtype=np.float64), lay.meta_shape)
            fails.first_bad("zero_point", z != z_ext, z_ext, z, grp, "external zero point")

    def reconstruction(self) -> None:
        """Every element within SPEC's bound; constant channels exact, zero channels zero."""
        lay, fails, elem, q = self.lay, self.fails, self.elem, self.q
        X, XH, u, u_out, eta, eta_out = self.X, self.XH, self.u, self.u_out, self.eta, self.eta_out
        qmin, qmax = self.scheme.qmin, self.scheme.qmax
        S, Z = self.S, self.Z = lay.expand(self.s), lay.expand(self.z)
        fails.first_bad("non-finite output", ~np.isfinite(XH), "finite", XH, elem)
        ax = self.ax = np.abs(X)
        with np.errstate(invalid="ignore", over="ignore"):
            target = np.clip(X, (qmin - Z) * S, (qmax - Z) * S) if self.external else X
            err = np.abs(XH - target)
            bound = (S / 2 + 2 * u * ax + u * S + u_out * np.abs(XH) + eta_out / 2 + eta * (1 + S))
        over = ~(err <= bound)

        def detail(k):
            worst = int(np.nanargmax(np.where(over, err, -1.0).ravel()))
            return (f"|x - x_hat| = {err.ravel()[k]:.6g} > bound {bound.ravel()[k]:.6g} "
                    f"(scale {S.ravel()[k]:.6g}, zero point {Z.ravel()[k]:.6g}, code {q.ravel()[k]}, "
                    f"u={u:.3g}, u_out={u_out:.3g}); worst |x - x_hat| = {err.ravel()[worst]:.6g} "
                    f"at {list(elem(worst))}")

        fails.first_bad("reconstruction", over, target, XH, elem, detail)
        if lay.size and not self.external:
            const_e = lay.expand(self.constant)
            zero_e = lay.expand(self.zero)
            # a subnormal scale carries an absolute error up to eta, times the code
            ctol = 4 * u * ax + u_out * ax + eta_out / 2 + 2 * eta * (qmax - qmin + 1)
            fails.first_bad("constant channel", const_e & ~zero_e & ~(np.abs(XH - X) <= ctol), X, XH,
                            elem, "a constant channel reconstructs within float rounding")
            fails.first_bad("zero channel", zero_e & (XH != 0), 0.0, XH, elem,
                            "an all-zero channel gives zeros")

    def code_formula(self) -> None:
        """Codes against the float64 formula with the stored scale and zero point."""
        S, Z, q, ax, u = self.S, self.Z, self.q, self.ax, self.u
        qmin, qmax = self.scheme.qmin, self.scheme.qmax
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            exact = self.X / S + Z
            tol = 3 * u * ax / S + 2.0**-50 * (ax / S + np.abs(Z))
            q_ref = np.clip(np.rint(exact), qmin, qmax)
            off = np.abs(q - np.clip(exact, qmin - 0.5, qmax + 0.5))
        self.fails.first_bad("code", (q != q_ref) & ~(off <= 0.5 + tol), q_ref, q, self.elem,
                             lambda k: f"x/scale + zero_point = {exact.ravel()[k]:.9g}")

    def statistics(self, reported) -> QuantStats:
        """The statistics recomputed independently, and the backend's own against them."""
        qt, fails = self.qt, self.fails
        with np.errstate(over="ignore", invalid="ignore"):
            mx, mean, rmse = error_moments(np.abs(self.X - self.XH))
        s_item = self.s_raw.dtype.itemsize
        z_item = 0 if qt.zero_point is None else to_numpy(qt.zero_point)[0].dtype.itemsize
        ratio, original, stored = expected_compression_ratio(self.xa.shape, self.in_dtype, self.scheme,
                                                             qt.packed, s_item, z_item)
        mine = QuantStats(float(mx), float(mean), float(rmse), ratio, original, stored)
        if not (mean <= rmse * (1 + 1e-12) and rmse <= mx * (1 + 1e-12)):
            fails.add("stats order", None, "mean_abs_error <= rmse <= max_abs_error", (mean, rmse, mx))
        if reported is None:
            return mine
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
        return mine

    def rmse_sanity(self, sanity: bool) -> dict | None:
        """rmse / (scale / sqrt 12) near 1 where the uniform-error model holds."""
        scheme, lay = self.scheme, self.lay
        ge = lay.group_elements
        if scheme.bits < 3 or ge < 128:
            self.notes.append(f"rmse ratio not checked: needs 3+ bits and 128+ elements per group "
                              f"(have {scheme.bits} bits, {ge} elements)")
            return None
        if not lay.size:
            return None
        GQ = lay.group_view(self.q)
        GE = lay.group_view(self.XH - self.X)
        distinct = 1 + (np.diff(np.sort(GQ, axis=1), axis=1) != 0).sum(axis=1)
        usable = (distinct >= min(2 ** (scheme.bits - 1), 16)) & ~self.constant.ravel()
        if not usable.any():
            self.notes.append("rmse ratio not checked: no group spreads over enough codes")
            return None
        with np.errstate(over="ignore"):
            g_rmse = np.sqrt(np.mean(GE[usable] ** 2, axis=1))
        r = g_rmse / (self.s.ravel()[usable] / math.sqrt(12))
        info = {"groups": int(usable.sum()), "median": float(np.median(r)),
                "min": float(r.min()), "max": float(r.max())}
        if sanity and not 0.5 <= info["median"] <= 1.5:
            self.fails.add("rmse ratio", None, "median in [0.5, 1.5]", info["median"],
                           f"over {info['groups']} groups")
        return info


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
