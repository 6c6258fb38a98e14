"""KV quantization (SPEC section 4), one module per part:

- ``layouts``: schemes, the (R, C) view of a tensor, stored tensors, bit packing;
- ``reference``: the float64 reference quantizer (and fp8 e4m3, e2m1 and NVFP4 rounding);
- ``stats``: error statistics and compression ratios;
- ``check``: the checker that holds an implementation to SPEC's bounds;
- ``check_float``: the checker of SPEC §12's fp8 and NVFP4 formats;
- ``formats``: KV formats and the capacity table;
- ``pool``: the formats of the quantized paged pools.

The package itself is the reference quantizer: it implements the quantizer protocol (``name``,
``available``, ``quantize``, ``dequantize``, ``error_stats``, ``unpack_codes``), so
``kvbench.quant`` is checked and benchmarked like any other implementation, and it re-exports
the public names of its modules.
"""
from kvbench.quant.check import (
                                 QuantFailure,
                                 QuantVerdict,
                                 check_quantization,
                                 check_quantizer,
)
from kvbench.quant.check_float import check_fp8, check_fp8_quantizer, check_nvfp4
from kvbench.quant.formats import (
                                 KVFormat,
                                 capacity_table,
                                 format_block_bytes,
                                 kv_formats,
)
from kvbench.quant.layouts import (
                                 GRANULARITIES,
                                 SCALE_DTYPE,
                                 SMALLEST_SUBNORMAL,
                                 UNIT_ROUNDOFF,
                                 Layout,
                                 QuantizedTensor,
                                 QuantScheme,
                                 check_float_dtype,
                                 layout,
                                 pack_bits,
                                 raise_non_finite,
                                 stored_bytes,
                                 to_numpy,
                                 unit_roundoff,
                                 unpack_bits,
                                 unpack_codes,
                                 validate_input,
)
from kvbench.quant.reference import (
                                 E2M1_MAX,
                                 FP8_E4M3_MAX,
                                 NVFP4_BLOCK,
                                 Fp8Tensor,
                                 Nvfp4Tensor,
                                 available,
                                 dequantize,
                                 e2m1_error_bound,
                                 e2m1_round,
                                 external_scale,
                                 fp8_e4m3_error_bound,
                                 fp8_e4m3_round,
                                 fp8_half_ulp,
                                 fp8_scale,
                                 group_min_max,
                                 name,
                                 nvfp4_block_scales,
                                 nvfp4_round,
                                 nvfp4_tensor_scale,
                                 quantize,
                                 scale_and_zero_point,
)
from kvbench.quant.stats import (
                                 QuantStats,
                                 error_moments,
                                 error_stats,
                                 expected_compression_ratio,
)

__all__ = [
    "QuantScheme", "Layout", "layout", "QuantizedTensor", "QuantStats", "QuantFailure", "QuantVerdict",
    "validate_input", "raise_non_finite", "check_float_dtype", "scale_and_zero_point", "group_min_max",
    "pack_bits", "unpack_bits", "quantize", "dequantize", "unpack_codes", "error_stats", "stored_bytes",
    "expected_compression_ratio", "error_moments", "check_quantization", "check_quantizer", "to_numpy",
    "unit_roundoff", "UNIT_ROUNDOFF", "SMALLEST_SUBNORMAL", "SCALE_DTYPE", "GRANULARITIES",
    "FP8_E4M3_MAX", "fp8_e4m3_round", "fp8_e4m3_error_bound", "Fp8Tensor", "check_fp8",
    "check_fp8_quantizer", "KVFormat", "kv_formats", "format_block_bytes", "capacity_table",
    "external_scale", "name", "available", "E2M1_MAX", "NVFP4_BLOCK", "Nvfp4Tensor", "e2m1_round",
    "e2m1_error_bound", "fp8_half_ulp", "fp8_scale", "nvfp4_tensor_scale", "nvfp4_block_scales",
    "nvfp4_round", "check_nvfp4",
]
