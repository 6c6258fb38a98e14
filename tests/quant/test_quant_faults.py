"""Planted faults: quantizers with the defects SPEC section 4 names (and a few more), each of
which the checker must catch, naming the quantity, where, expected and actual.

The faulty quantizers live here, not in impls/: each is the reference with one step replaced.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvbench import quant as Q


class Reference:
    """The float64 reference as an object, so a fault can override one step."""

    name = "reference"

    def quantize(self, x, scheme, **kw):
        return Q.quantize(x, scheme, **kw)

    def dequantize(self, qt, out_dtype=np.float64):
        return Q.dequantize(qt, out_dtype)

    def unpack_codes(self, qt):
        return Q.unpack_codes(qt)

    def error_stats(self, x, x_hat, qt):
        return Q.error_stats(x, x_hat, qt)


class ZeroPointInt8(Reference):
    """The reference page's asymmetric quantizer: the zero point is cast to int8 and wraps."""

    name = "zero-point-int8"

    def quantize(self, x, scheme, **kw):
        x = np.asarray(x, dtype=np.float64)
        lay = Q.layout(x.shape, scheme)
        flat = lay.to_rows(x)
        c_min, c_max = flat.min(axis=0), flat.max(axis=0)
        scale = np.clip(c_max - c_min, 1e-8, None) / (scheme.qmax - scheme.qmin)
        # int64 first, then the C-style wrap the page's .astype(np.int8) gives on x86 / ARM
        zero_point = np.round(scheme.qmin - c_min / scale).astype(np.int64).astype(np.int8)
        codes = np.round(flat / scale).astype(np.int32) + zero_point.astype(np.int32)
        codes = np.clip(codes, scheme.qmin, scheme.qmax).astype(np.int8)
        return Q.QuantizedTensor(codes, scale.reshape(1, -1), zero_point.reshape(1, -1), x.shape,
                                 "float64", scheme, False, "float64")


class CastBeforeClip(Reference):
    """Codes cast to int8 before they are clipped: with an external (calibrated) scale, values
    past 127 * scale wrap to negative codes instead of saturating."""

    name = "cast-before-clip"

    def quantize(self, x, scheme, *, scale=None, zero_point=None):
        x = np.asarray(x, dtype=np.float64)
        lay = Q.layout(x.shape, scheme)
        s = np.broadcast_to(np.asarray(scale, dtype=np.float64), lay.meta_shape)
        q = np.rint(lay.to_rows(x) / lay.expand(s)).astype(np.int64).astype(np.int8)  # wraps
        codes = np.clip(q, scheme.qmin, scheme.qmax).astype(np.int8)  # too late
        return Q.QuantizedTensor(codes, s.copy(), None, x.shape, "float64", scheme, False, "float64")


class NoSignExtension(Reference):
    """4-bit codes unpacked as unsigned nibbles: -1 comes back as 15."""

    name = "no-sign-extension"

    def unpack_codes(self, qt):
        lay = qt.layout
        packed = np.asarray(qt.codes).astype(np.int64)
        nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).ravel()[:lay.size]
        return nibbles.reshape(lay.rows, lay.channels)

    def dequantize(self, qt, out_dtype=np.float64):
        lay = qt.layout
        q = self.unpack_codes(qt).astype(np.float64)
        if qt.zero_point is not None:
            q = q - lay.expand(qt.zero_point)
        return lay.from_rows(q * lay.expand(qt.scale)).astype(out_dtype)


class RatioWithoutMetadata(Reference):
    """Compression ratio over the code bytes only: scales and zero points left out."""

    name = "ratio-without-metadata"

    def error_stats(self, x, x_hat, qt):
        stats = Q.error_stats(x, x_hat, qt)
        return dataclasses.replace(stats, compression_ratio=stats.original_bytes / np.asarray(qt.codes).nbytes)


class SwappedMeanAndRmse(Reference):
    name = "swapped-mean-rmse"

    def error_stats(self, x, x_hat, qt):
        s = Q.error_stats(x, x_hat, qt)
        return dataclasses.replace(s, mean_abs_error=s.rmse, rmse=s.mean_abs_error)


class RoundHalfAway(Reference):
    """Rounds ties away from zero (C's round) instead of to even: differs only at exact ties."""

    def quantize(self, x, scheme, *, scale=None, zero_point=None):
        x = np.asarray(x, dtype=np.float64)
        lay = Q.layout(x.shape, scheme)
        s = np.broadcast_to(np.asarray(scale, dtype=np.float64), lay.meta_shape)
        y = lay.to_rows(x) / lay.expand(s)
        q = np.sign(y) * np.floor(np.abs(y) + 0.5)
        codes = np.clip(q, scheme.qmin, scheme.qmax).astype(np.int8)
        return Q.QuantizedTensor(codes, s.copy(), None, x.shape, "float64", scheme, False, "float64")


class OffByOne(RoundHalfAway):
    """Adds one to every positive code."""

    def quantize(self, x, scheme, **kw):
        qt = super().quantize(x, scheme, **kw)
        qt.codes = np.where(qt.codes > 0, np.minimum(qt.codes + 1, scheme.qmax), qt.codes).astype(np.int8)
        return qt


def channel_10_to_20():
    return np.linspace(10.0, 20.0, 64).reshape(-1, 1)


def test_reference_passes_its_own_checker():
    for x, scheme in ((channel_10_to_20(), Q.QuantScheme(8, False)),
                      (np.random.default_rng(0).standard_normal((64, 8)), Q.QuantScheme(4, False, "group", -1, 4))):
        verdict = Q.check_quantizer(Reference(), x, scheme)
        assert verdict.valid, verdict.explain()


def test_int8_zero_point_wraps_and_is_caught():
    verdict = Q.check_quantizer(ZeroPointInt8(), channel_10_to_20(), Q.QuantScheme(8, False))
    assert not verdict.valid
    first = verdict.first
    assert first.quantity == "zero_point" and first.index == (0, 0)
    # round(-128 - 10 / (10/255)) = -383; int8 keeps -383 mod 256 = 129 -> -127
    assert first.expected == -383 and first.actual == -127
    recon = verdict.failure("reconstruction")
    # every code clips to 127: x_hat = (127 + 127) * 10/255 = 9.96, 10.04 off for x = 20,
    # where the bound is scale/2 = 0.0196
    assert recon is not None and "bound 0.0196" in recon.detail
    assert "worst |x - x_hat| = 10.0392 at [63, 0]" in recon.detail


def test_cast_to_int8_before_clipping_wraps_and_is_caught():
    x = np.array([[0.0], [0.25], [0.5], [0.75], [-1.0]])
    scale = 1 / 254  # codes reach +-127 at +-0.5: 0.75 -> 190.5 wraps to -66, -1.0 -> -254 -> 2
    verdict = Q.check_quantizer(CastBeforeClip(), x, Q.QuantScheme(8), scale=scale)
    assert not verdict.valid
    recon = verdict.failure("reconstruction")
    assert recon.index == (3, 0)
    assert recon.expected == pytest.approx(0.5)  # saturated: 127 * 1/254
    assert recon.actual == pytest.approx(-66 / 254)  # 190 (round half even of 190.5) - 256
    assert verdict.failure("code").expected == 127 and verdict.failure("code").actual == -66
    # the sound quantizers saturate
    assert Q.check_quantizer(Reference(), x, Q.QuantScheme(8), scale=scale).valid


def test_unpacking_without_sign_extension_is_caught():
    x = np.random.default_rng(1).standard_normal((32, 8))
    verdict = Q.check_quantizer(NoSignExtension(), x, Q.QuantScheme(4, False, "group", -1, 4))
    assert not verdict.valid
    first = verdict.first
    assert first.quantity == "unpacked codes"
    assert first.expected < 0 and first.actual == first.expected + 16  # -k read back as 16 - k
    assert verdict.failure("reconstruction") is not None


def test_compression_ratio_without_metadata_is_caught():
    x = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)
    verdict = Q.check_quantizer(RatioWithoutMetadata(), x, Q.QuantScheme(8))
    assert verdict.quantities() == ["reported compression_ratio"]
    f = verdict.first
    # 32768 B / (8192 B of codes + 128 scales * 8 B of the reference's float64) vs 32768 / 8192
    assert f.expected == pytest.approx(32768 / (8192 + 1024)) and f.actual == pytest.approx(4.0)


def test_reported_statistics_out_of_order_are_caught():
    x = np.random.default_rng(3).standard_normal((64, 4))
    verdict = Q.check_quantizer(SwappedMeanAndRmse(), x, Q.QuantScheme(4))
    assert "reported stats order" in verdict.quantities()


def test_ties_are_recognized_and_other_differences_are_not():
    # scale 1 (external): x/scale = 0.5, 1.5, 2.5, -0.5 are exact ties; 0.3 is not
    x = np.array([[0.5], [1.5], [2.5], [-0.5], [0.3]])
    scheme = Q.QuantScheme(8)
    verdict = Q.check_quantizer(RoundHalfAway(), x, scheme, scale=1.0)  # 1, 2, 3, -1 vs 0, 2, 2, 0
    assert verdict.valid, verdict.explain()
    verdict = Q.check_quantizer(OffByOne(), x, scheme, scale=1.0)
    assert not verdict.valid
    code = verdict.failure("code")
    assert code.index == (0, 0)  # 0.5 -> 1 + 1 = 2, beyond the tie {0, 1}
    assert (code.expected, code.actual) == (0, 2)


def test_fp8_without_saturation_is_caught():
    torch = pytest.importorskip("torch")
    from impls import quant_torch

    class NaNPast448:
        """A cast that turns values past 448 into NaN, as some torch versions do without the clamp."""

        def quantize_fp8(self, x, scale=1.0):
            ft = quant_torch.quantize_fp8(x, scale)
            y = x.float() / scale
            ft.codes = torch.where(y.abs() > 448, torch.nan, ft.codes.float()).to(torch.float8_e4m3fn)
            return ft

        def dequantize_fp8(self, ft):
            return quant_torch.dequantize_fp8(ft)

    x = torch.tensor([1.0, 500.0, -2.0])
    verdict = Q.check_fp8_quantizer(NaNPast448(), x)
    assert not verdict.valid
    assert verdict.first.quantity == "fp8 code" and verdict.first.index == (1,)
    assert verdict.failure("saturation").expected == 448.0
