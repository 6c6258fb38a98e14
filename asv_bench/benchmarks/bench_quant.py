"""KV quantization: quantize / dequantize timings, the error each quantizer makes on a fixed
sample and the bytes per token of each KV format (track_, lower is better).

Timings compare with bench_paged.CopySameBytes at 4096 tokens: the same 4 MiB of float16.
"""
from . import common
from .common import QUANT_SCHEMES, QUANTIZERS


class _Quant:
    version = "1"
    params = [QUANTIZERS, list(QUANT_SCHEMES)]
    param_names = ["quantizer", "scheme"]

    def setup(self, name, scheme):
        self.impl = common.quantizer(name)
        self.scheme = common.quant_scheme(scheme)
        self.x = common.kv_sample()


class Quantize(_Quant):
    def time_quantize(self, name, scheme):
        self.impl.quantize(self.x, self.scheme)


class Dequantize(_Quant):
    def setup(self, name, scheme):
        super().setup(name, scheme)
        self.qt = self.impl.quantize(self.x, self.scheme)

    def time_dequantize(self, name, scheme):
        self.impl.dequantize(self.qt)


class QuantError(_Quant):
    """Errors on common.kv_sample(), recomputed by the reference kvbench.quant.error_stats."""

    def setup(self, name, scheme):
        super().setup(name, scheme)
        self.stats = common.quant_stats(self.impl, self.x, self.scheme)

    def track_max_abs_error(self, name, scheme):
        return self.stats["max_abs_error"]
    track_max_abs_error.unit = "abs error"

    def track_rmse(self, name, scheme):
        return self.stats["rmse"]
    track_rmse.unit = "abs error"

    def track_stored_bytes(self, name, scheme):
        return self.stats["stored_bytes"]
    track_stored_bytes.unit = "bytes"


class FormatBytes:
    """Bytes per token of a paged pool in each KV format (metadata included), asv-1k model."""
    version = "1"
    params = [common.KV_FORMATS]
    param_names = ["format"]

    def setup(self, fmt):
        self.bytes_per_token = common.format_bytes_per_token(fmt)

    def track_bytes_per_token(self, fmt):
        return self.bytes_per_token
    track_bytes_per_token.unit = "bytes"



class PoolBytes:
    """Bytes per token of each paged backend's pool, read from its own ledger (quantized pools:
    codes plus scales), asv-1k model."""
    version = "1"
    params = [common.POOLS]
    param_names = ["backend"]

    def setup(self, name):
        self.bytes_per_token = common.pool_bytes_per_token(name)

    def track_pool_bytes_per_token(self, name):
        return self.bytes_per_token
    track_pool_bytes_per_token.unit = "bytes"
