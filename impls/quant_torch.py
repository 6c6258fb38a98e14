"""The KV quantizer of ``kvbench.quant`` in torch (CPU or CUDA), plus fp8 e4m3 with saturation.

Same schemes, codes, packing and float steps as ``impls.quant_numpy`` (the scale and zero point,
and the decision to clip, come from its :class:`~impls.quant_numpy.Params`, computed on the host
from each group's min and max); the element-wise work runs in torch on the tensor's device, a
chunk of rows at a time, with broadcasting (torch vectorizes it, NumPy does not). torch is
imported lazily: :func:`available` says why not when it is missing.

The host computes the clip decision with NumPy's float ops on the group extremes; the device
must round the same way (IEEE multiply / add, no fused multiply-add, no flush of subnormals):
true of torch's CPU kernels and of CUDA's default (non fast-math) ones.

On the CPU, float16 / float32 input with scales from the data goes through the compiled kernels
of :mod:`impls.quant_kernels` when numba is installed (over the tensor's own memory, the same
codes); elsewhere, and on CUDA, the torch steps below.

fp8: ``x / scale`` clamped to +-448, then cast to ``torch.float8_e4m3fn`` (round to nearest
even). The clamp is the saturation: some torch versions turn values past 448 into NaN.
"""
from __future__ import annotations

import math

import numpy as np

from impls.quant_numpy import Params, divides, quantize_compiled
from kvbench import quant as Q

name = "torch"
# Elements per chunk of rows. CPU: 1 MiB of float32, measured best on 2 cores (smaller pay
# torch's per-op overhead, larger miss L2). CUDA: large, to launch few kernels.
CHUNK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 26}


def _chunk(device, chunk):
    return chunk or CHUNK_ELEMENTS.get(getattr(device, "type", str(device)), 1 << 22)


def available(device: str | None = None) -> tuple[bool, str]:
    try:
        import torch
    except ImportError as e:
        return False, f"torch is not installed ({e}); pip install 'kvbench[torch]'"
    if device and device.startswith("cuda") and not torch.cuda.is_available():
        return False, "CUDA is not available to torch here"
    return True, ""


def _torch():
    import torch

    return torch


def _as_tensor(x, device=None):
    torch = _torch()
    if not torch.is_tensor(x):
        arr = np.asarray(x)
        if any(s < 0 for s in arr.strides):
            arr = np.ascontiguousarray(arr)
        x = torch.from_numpy(arr)
    return x.to(device) if device is not None else x


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _group_view(t, lay: Q.Layout):
    """(rows, C) -> a view whose last axis is the elements of one group (scales broadcast)."""
    if lay.scheme.granularity == "group":
        return t.reshape(t.shape[0], -1, lay.scheme.group_size)
    return t


def _meta(values, lay: Q.Layout, dtype, device):
    """Per-group values (meta layout) as a tensor that broadcasts against _group_view."""
    torch = _torch()
    t = torch.as_tensor(np.asarray(values), device=device).to(dtype)
    return t.unsqueeze(-1) if lay.scheme.granularity == "group" else t


def _min_max(X, lay: Q.Layout):
    torch = _torch()
    if lay.size == 0:
        z = np.zeros(lay.meta_shape)
        return z, z
    g = lay.scheme.granularity
    if g == "channel":  # aminmax over dim 0 is ~10x slower than amin and amax apart on CPU
        lo, hi = X.amin(dim=0, keepdim=True), X.amax(dim=0, keepdim=True)
    elif g == "token":
        lo, hi = torch.aminmax(X, dim=1, keepdim=True)
    else:
        lo, hi = torch.aminmax(X.reshape(lay.rows, -1, lay.scheme.group_size), dim=2)
    # to float32 first: exact for float16 / bfloat16 (numpy has no bfloat16)
    as_np = lambda t: t.float().cpu().numpy() if t.dtype != torch.float64 else t.cpu().numpy()  # noqa: E731
    return as_np(lo), as_np(hi)


def _rows_per_chunk(lay: Q.Layout, chunk: int, device) -> int:
    rc = max(1, _chunk(device, chunk) // max(1, lay.channels))
    return -(-rc // 4) * 4  # rows * C a multiple of 4 codes: packed chunks start on a byte


def quantize(x, scheme: Q.QuantScheme, *, scale=None, zero_point=None, device=None,
             out: Q.QuantizedTensor | None = None, chunk: int | None = None) -> Q.QuantizedTensor:
    """Codes, scale and zero point of x (NumPy array or tensor) on x's device (or ``device``).
    ``out``: a QuantizedTensor of the same shape and scheme whose codes are overwritten."""
    torch = _torch()
    t = _as_tensor(x, device)
    dname = Q.check_float_dtype(_dtype_name(t))
    lay = Q.layout(tuple(t.shape), scheme)
    ar = np.dtype(Q.SCALE_DTYPE[dname])
    if t.device.type == "cpu" and scale is None and dname in ("float16", "float32"):
        done = _compiled_on_cpu(t, scheme, out)
        if done is not None:
            return done
    cdt = getattr(torch, Q.SCALE_DTYPE[dname])
    X = t.movedim(lay.axis, -1).reshape(lay.rows, lay.channels).contiguous()
    lo, hi = _min_max(X, lay)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        Q.raise_non_finite(t.float().cpu().numpy() if dname == "bfloat16" else t.cpu().numpy())
    if scale is None:
        s, z = Q.scale_and_zero_point(lo, hi, scheme, ar.name)
    else:
        s, z = Q.external_scale(scale, zero_point, X.float().cpu().numpy() if dname == "bfloat16" else X.cpu().numpy(),
                                lay, ar)
    P = Params(s, z, lo, hi, scheme, ar, divides(_itemsize(dname), ar))
    factor = _meta(P.factor, lay, cdt, t.device)
    add = float(P.add) if np.ndim(P.add) == 0 else _meta(P.add, lay, cdt, t.device)
    R, C = lay.rows, lay.channels
    per = 8 // scheme.slot_bits
    reuse = out is not None and not scheme.packed
    if out is not None and (tuple(out.shape) != tuple(t.shape) or out.scheme != scheme):
        raise ValueError(f"out: a QuantizedTensor of shape {tuple(t.shape)} and {scheme.describe()} is needed")
    codes = out.codes.view(R, C) if reuse else torch.empty((R, C), dtype=torch.int8, device=t.device)
    rc = _rows_per_chunk(lay, chunk, t.device)
    buf = torch.empty((min(R, rc), C), dtype=cdt, device=t.device)
    for r0 in range(0, R, rc):
        r1 = min(R, r0 + rc)
        xt = _group_view(X[r0:r1], lay)
        b = _group_view(buf[:r1 - r0], lay)
        f = factor if scheme.granularity == "channel" else factor[r0:r1]
        (torch.div if P.divide else torch.mul)(xt, f, out=b)
        if not P.magic:
            b.round_()  # ties to even, like np.rint
        b.add_(add if np.ndim(P.add) == 0 or scheme.granularity == "channel" else add[r0:r1])
        if P.clip:
            b.clamp_(P.low, P.high)
        flat = buf[:r1 - r0]
        # magic: the code is the low byte of the float's bits (int32 -> int8 keeps it)
        codes[r0:r1].copy_(flat.view(torch.int32 if cdt == torch.float32 else torch.int64) if P.magic else flat)
    if scheme.packed:
        codes = _pack(codes.reshape(-1), scheme.slot_bits, per)
        if out is not None:
            codes = out.codes.copy_(codes)
    return Q.QuantizedTensor(codes, torch.as_tensor(P.s, device=t.device), None if P.z is None else
                             torch.as_tensor(P.z, device=t.device), tuple(t.shape), dname, scheme,
                             scheme.packed, ar.name)


def _compiled_on_cpu(t, scheme: Q.QuantScheme, out):
    """On the CPU, the compiled kernels of impls.quant_kernels (the same codes as these steps,
    in one fused pass per tile) over the tensor's memory; None where they do not apply."""
    torch = _torch()
    np_out = None
    if out is not None:
        if tuple(out.shape) != tuple(t.shape) or out.scheme != scheme:
            return None
        np_out = Q.QuantizedTensor(out.codes.numpy(), out.scale.numpy(),
                                   None if out.zero_point is None else out.zero_point.numpy(),
                                   out.shape, out.dtype, scheme, out.packed, out.compute_dtype)
    try:
        qt = quantize_compiled(t.detach().numpy(), scheme, out=np_out)
    except ValueError:
        if np_out is None:
            raise  # non-finite input: the same refusal
        return None  # an out= of another layout than the kernels write: the torch steps
    if qt is None:
        return None
    as_t = lambda a: None if a is None else torch.from_numpy(a)  # noqa: E731
    return Q.QuantizedTensor(as_t(qt.codes), as_t(qt.scale), as_t(qt.zero_point), tuple(t.shape),
                             qt.dtype, scheme, qt.packed, qt.compute_dtype)


def _itemsize(dname: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[dname]


def _pack(flat, slot: int, per: int):
    """int8 codes -> uint8, first code in the low bits (bytes of a wider int, little-endian)."""
    torch = _torch()
    pad = -flat.numel() % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if slot == 4:
        t = flat.view(torch.int16) & 0x0F0F
        t = t | (t >> 4)
    else:
        t = flat.view(torch.int32) & 0x03030303
        t = t | (t >> 6)
        t = t | (t >> 12)
    return t.to(torch.uint8)  # the low byte


def _unpack(packed, slot: int, count: int):
    """uint8 -> int8 codes sign-extended from the slot (arithmetic shifts of int8)."""
    torch = _torch()
    parts = [((packed << (8 - slot - slot * i)).view(torch.int8) >> (8 - slot)) for i in range(8 // slot)]
    return torch.stack(parts, dim=-1).reshape(-1)[:count]


def unpack_codes(qt: Q.QuantizedTensor):
    lay = qt.layout
    if not qt.packed:
        return qt.codes.reshape(lay.rows, lay.channels)
    return _unpack(qt.codes, qt.scheme.slot_bits, lay.size).reshape(lay.rows, lay.channels)


def dequantize(qt: Q.QuantizedTensor, out_dtype=None, *, out=None, chunk: int | None = None):
    """x_hat = (q - zero_point) * scale, in the input's layout and dtype (or ``out_dtype``).
    ``out``: a tensor of the input's shape to write into (its dtype is the output's)."""
    torch = _torch()
    lay = qt.layout
    scheme = qt.scheme
    if out is not None:
        out_dtype = out.dtype
        if tuple(out.shape) != tuple(qt.shape):
            raise ValueError(f"dequantize: out has shape {tuple(out.shape)}, the tensor {tuple(qt.shape)}")
    out_dt = getattr(torch, out_dtype) if isinstance(out_dtype, str) else (out_dtype or getattr(torch, qt.dtype))
    cdt = getattr(torch, qt.compute_dtype)
    ar = np.dtype(qt.compute_dtype)
    out_name = str(out_dt).removeprefix("torch.")
    same = out_dt == cdt or (divides(_itemsize(qt.dtype), ar) and out_name == qt.dtype)
    if not same and _itemsize(out_name) < _itemsize(qt.compute_dtype):
        raise ValueError(f"dequantize: out_dtype {out_name} is narrower than the {qt.compute_dtype} "
                         f"arithmetic of a {qt.dtype} input; torch would round the product twice "
                         f"past the bound. Dequantize to {qt.dtype} and cast.")
    work = cdt if same else torch.float64
    device = qt.codes.device
    R, C = lay.rows, lay.channels
    s = qt.scale.to(device=device, dtype=work)
    z = None if qt.zero_point is None else qt.zero_point.to(device=device, dtype=work)
    if scheme.granularity == "group":
        s = s.unsqueeze(-1)
        z = None if z is None else z.unsqueeze(-1)
    top = torch.finfo(out_dt).max
    reach = (qt.scale.double().abs() * max(abs(scheme.qmin), scheme.qmax))
    if qt.zero_point is not None:
        reach = reach + qt.zero_point.double().abs() * qt.scale.double().abs()
    clip_out = (not same) or (reach.numel() > 0 and bool((reach >= top).any()))
    target = out
    rows_out = None
    if out is not None and out.is_contiguous() and lay.axis == len(qt.shape) - 1:
        rows_out = out.view(R, C)
    if rows_out is None:
        rows_out = torch.empty((R, C), dtype=out_dt, device=device)
    q_all = unpack_codes(qt)
    rc = _rows_per_chunk(lay, chunk, device)
    buf = torch.empty((min(R, rc), C), dtype=work, device=device)
    for r0 in range(0, R, rc):
        r1 = min(R, r0 + rc)
        b = buf[:r1 - r0]
        b.copy_(q_all[r0:r1])
        bg = _group_view(b, lay)
        st = s if scheme.granularity == "channel" else s[r0:r1]
        if z is not None:
            bg.sub_(z if scheme.granularity == "channel" else z[r0:r1])
        if clip_out:
            bg.mul_(st)
            b.clamp_(-top, top)  # never round to inf: x lies within the dtype's range
            rows_out[r0:r1].copy_(b)
        else:
            torch.mul(bg, st, out=_group_view(rows_out[r0:r1], lay))
    result = rows_out.reshape(lay.moved_shape).movedim(-1, lay.axis)
    if target is None:
        return result
    if result.data_ptr() != target.data_ptr() or result.stride() != target.stride():
        target.copy_(result)
    return target


def error_stats(x, x_hat, qt: Q.QuantizedTensor, *, chunk: int = 1 << 22) -> Q.QuantStats:
    """Errors in float64 on the device, a chunk at a time, scaled by the max error."""
    xt = _as_tensor(x).reshape(-1)
    xh = _as_tensor(x_hat).reshape(-1).to(xt.device)
    n = xt.numel()
    pieces = range(0, n, chunk)
    diff = lambda i: (xt[i:i + chunk].double() - xh[i:i + chunk].double()).abs()  # noqa: E731
    mx = max((float(diff(i).max()) for i in pieces), default=0.0)
    if mx == 0 or not math.isfinite(mx):
        mean = rmse = mx
    else:
        total = sq = 0.0
        for i in pieces:
            d = diff(i) / mx
            total += float(d.sum())
            sq += float((d * d).sum())
        mean, rmse = mx * (total / n), mx * math.sqrt(sq / n)
    original = n * xt.element_size()
    stored = Q.stored_bytes(qt)
    return Q.QuantStats(mx, mean, rmse, original / stored if stored else 1.0, original, stored)


# --------------------------------------------------------------------------------------------
# fp8 e4m3


def quantize_fp8(x, scale: float = 1.0, *, device=None) -> Q.Fp8Tensor:
    """x / scale saturated to +-448 and rounded to float8_e4m3fn (one scale for the tensor)."""
    torch = _torch()
    t = _as_tensor(x, device)
    dname = Q.check_float_dtype(_dtype_name(t))
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"quantize_fp8: scale must be a positive finite number, got {scale!r}")
    if t.numel() and not bool(torch.isfinite(t).all()):
        Q.raise_non_finite(t.float().cpu().numpy(), "quantize_fp8")
    cdt = torch.float64 if dname == "float64" else torch.float32
    y = (t.to(cdt) / scale).clamp_(-Q.FP8_E4M3_MAX, Q.FP8_E4M3_MAX)
    return Q.Fp8Tensor(y.to(torch.float8_e4m3fn), float(scale), tuple(t.shape), dname, str(cdt)[6:])


def dequantize_fp8(ft: Q.Fp8Tensor, out_dtype=None):
    torch = _torch()
    out_dt = out_dtype or getattr(torch, ft.dtype)
    cdt = getattr(torch, ft.compute_dtype)
    return (ft.codes.to(cdt) * ft.scale).to(out_dt)
