"""Kernels of the cupynorm ops on each device, and the layout rules between them.

``_<op>_fwd_cuda`` / ``_<op>_bwd_cuda`` call the framework-neutral host code
:mod:`cupynorm._ops` (imported lazily, so ``import cupynorm.torch`` works without CuPy); the
reference kernels (:mod:`._reference`) are the same math in plain torch and back the ops on the
CPU; ``_<op>_fake`` are the fake (meta) kernels ``torch.compile`` traces with. ``_<op>_fwd`` /
``_<op>_bwd`` pick the CUDA or the reference kernel by the input's device.

Layouts: ``y``/``dx`` keep the input's memory format when it is contiguous or channels_last
(channels_last_3d for 5-D); any other strides are computed on a contiguous copy and the result
is contiguous. Statistics are float32 (float64 for float64 input): ``mean``/``rstd`` are
``(N, G)`` for group norm, ``(C,)`` for batch norm, ``x.shape[:-1]`` for the row norm.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._reference import (
    _channel_norm_bwd_reference,
    _channel_norm_fwd_reference,
    _param_dtype,
    _row_norm_add_mul_bwd_reference,
    _row_norm_add_mul_fwd_reference,
    _row_norm_bwd_reference,
    _row_norm_fwd_reference,
    _stat_dtype,
)
from ._tensors import (
    _cast,
    _dense,
    _empty_out,
    _host,
    _vec,
)


# ---------------------------------------------------------------------------------------------
# row norm + add + mul (the seed-002 tail): per row of D values
#   xhat = (x - mean) * rstd,  out = (xhat + y) * y
#   backward: gx = dout * y;  dx = rstd * (gx - <gx> - xhat * <gx * xhat>)
#             dy = dout * (xhat + 2 y)
# ---------------------------------------------------------------------------------------------
def _row_norm_add_mul_fwd_cuda(x, y, eps):
    x, y = x.contiguous(), y.contiguous()
    out, mean, rstd = _host().row_norm_add_mul_fwd(x, y, eps)
    rows = x.shape[:-1]
    return out, mean.reshape(rows), rstd.reshape(rows)


def _row_norm_add_mul_bwd_cuda(dout, x, y, mean, rstd):
    dout, x, y = dout.contiguous(), x.contiguous(), y.contiguous()
    dx, dy = _host().row_norm_add_mul_bwd(dout, x, y, mean, rstd)
    return dx.reshape(x.shape), dy.reshape(y.shape)


def _row_norm_add_mul_fwd(x, y, eps):
    if x.is_cuda:
        return _row_norm_add_mul_fwd_cuda(x, y, eps)
    return _row_norm_add_mul_fwd_reference(x, y, eps)


def _row_norm_add_mul_bwd(dout, x, y, mean, rstd):
    if x.is_cuda:
        return _row_norm_add_mul_bwd_cuda(dout, x, y, mean, rstd)
    return _row_norm_add_mul_bwd_reference(dout, x, y, mean, rstd)


def _row_norm_add_mul_fwd_fake(x, y, eps):
    stats = x.new_empty(x.shape[:-1], dtype=_stat_dtype(x.dtype))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, stats, torch.empty_like(stats)


def _row_norm_add_mul_bwd_fake(dout, x, y, mean, rstd):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(y, memory_format=torch.contiguous_format),
    )


# ---------------------------------------------------------------------------------------------
# row norms: LayerNorm / RMSNorm over the trailing ``ndim`` dims of x, optionally after a
# residual add (the math is in _reference.py). Outputs are contiguous; mean/rstd have the shape
# of the leading dims (mean is None for RMSNorm); dweight/dbias have the normalized shape.
# ---------------------------------------------------------------------------------------------
def _split(x: Tensor, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(leading dims, normalized dims) of x."""
    return tuple(x.shape[: x.dim() - ndim]), tuple(x.shape[x.dim() - ndim :])


def _row_norm_fwd_op_args(x, residual, weight, bias, row_len, eps, rms, cast, want_stats,
                          out_float32=False):  # fmt: skip
    """(args, kwargs) of the host op row_norm_fwd (its call key: cupynorm.torch._replay)."""
    kwargs = {"want_stats": want_stats, "cast": True} if cast else {"want_stats": want_stats}
    if out_float32:
        kwargs["out_dtype"] = "float32"
    return (x, residual, weight, bias, row_len, eps, rms), kwargs


def _row_norm_fwd_cuda(x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False,
                       want_stats=True):  # fmt: skip
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    batch, row = _split(x, ndim)
    # fmt: off
    args, kwargs = _row_norm_fwd_op_args(x, residual, _vec(weight), _vec(bias), math.prod(row),
                                         eps, rms, cast, want_stats, out_float32)
    # fmt: on
    y, total, mean, rstd = _host().row_norm_fwd(*args, **kwargs)
    mean = None if mean is None else mean.reshape(batch)
    rstd = None if rstd is None else rstd.reshape(batch)
    return y, total, mean, rstd


def _row_norm_bwd_cuda(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast=False):
    _batch, row = _split(x, ndim)
    dsum = None if dsum is None else dsum.contiguous()
    mean = None if mean is None else mean.contiguous()
    dx, dweight, dbias = _host().row_norm_bwd(
        dy.contiguous(),
        dsum,
        x.contiguous(),
        mean,
        rstd.contiguous(),
        _vec(weight),
        math.prod(row),
        tuple(output_mask),
        **({"cast": True} if cast else {}),
    )
    pdtype = _param_dtype(x, weight)
    dx = dx.reshape(x.shape) if output_mask[0] else None
    dweight = _cast(dweight.reshape(row), pdtype) if output_mask[1] else None
    dbias = _cast(dbias.reshape(row), pdtype) if output_mask[2] else None
    return dx, dweight, dbias


def _row_norm_fwd(x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False):
    """``out_float32``: y in float32 from a float16 / bfloat16 x (layer_norm under autocast), with
    no residual; the backward then takes dy in float32 and gives dx in x's dtype."""
    args = (x, residual, weight, bias, ndim, eps, rms, cast)
    if x.is_cuda:
        return _row_norm_fwd_cuda(*args, out_float32)
    return _row_norm_fwd_reference(*args, out_float32)


def _row_norm_output(x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False):
    """(y, sum) alone (no autograd)."""
    args = (x, residual, weight, bias, ndim, eps, rms, cast)
    if x.is_cuda:
        return _row_norm_fwd_cuda(*args, out_float32, want_stats=False)[:2]
    return _row_norm_fwd_reference(*args, out_float32)[:2]


def _row_norm_bwd(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast=False):
    if x.is_cuda:
        return _row_norm_bwd_cuda(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast)
    return _row_norm_bwd_reference(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast)


def _row_norm_fwd_fake(x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False):
    batch, _row = _split(x, ndim)
    rstd = x.new_empty(batch, dtype=_stat_dtype(x.dtype))
    mean = None if rms else torch.empty_like(rstd)
    dtype = torch.float32 if out_float32 else x.dtype
    y = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    total = None if residual is None else torch.empty_like(y)
    return y, total, mean, rstd


def _row_norm_bwd_fake(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast=False):
    _batch, row = _split(x, ndim)
    pdtype = _param_dtype(x, weight)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else None,
        x.new_empty(row, dtype=pdtype) if output_mask[1] else None,
        x.new_empty(row, dtype=pdtype) if output_mask[2] else None,
    )


# ---------------------------------------------------------------------------------------------
# channel norms: LayerNorm / RMSNorm over dim 1 of (N, C, *spatial) (math in _reference.py).
# y and dx keep x's memory format (contiguous, channels_last / channels_last_3d; other strides:
# contiguous); mean/rstd are (N, *spatial), mean None for RMSNorm; dweight/dbias are (C,).
# ---------------------------------------------------------------------------------------------
def _channel_norm_fwd_op_args(x, weight, bias, eps, rms, want_stats):
    """(args, kwargs) of the host op _channel_norm_fwd, the channels family's (NCHW input whose
    channels one CTA holds), as channel_norm_fwd calls it (its call key: cupynorm.torch._replay)."""
    return (x, weight, bias, eps, rms), {"want_stats": want_stats}


def _channel_norm_fwd_cuda(x, weight, bias, eps, rms, out_float32=False, want_stats=True):
    x, _fmt = _dense(x)
    out_dtype = "float32" if out_float32 else None
    # fmt: off
    return _host().channel_norm_fwd(x, _vec(weight), _vec(bias), eps, rms, want_stats=want_stats,
                                    out_dtype=out_dtype)
    # fmt: on


def _channel_norm_bwd_cuda(dy, x, mean, rstd, weight, output_mask):
    x, fmt = _dense(x)
    dy = dy.contiguous(memory_format=fmt)
    mean = None if mean is None else mean.contiguous()
    dx, dweight, dbias = _host().channel_norm_bwd(
        dy, x, mean, rstd.contiguous(), _vec(weight), tuple(output_mask)
    )
    pdtype = _param_dtype(x, weight)
    dx = dx if output_mask[0] else None
    dweight = _cast(dweight, pdtype) if output_mask[1] else None
    dbias = _cast(dbias, pdtype) if output_mask[2] else None
    return dx, dweight, dbias


def _channel_norm_fwd(x, weight, bias, eps, rms, out_float32=False):
    """``out_float32``: as _row_norm_fwd's (layer_norm2d under autocast)."""
    if x.is_cuda:
        return _channel_norm_fwd_cuda(x, weight, bias, eps, rms, out_float32)
    return _channel_norm_fwd_reference(x, weight, bias, eps, rms, out_float32)


def _channel_norm_output(x, weight, bias, eps, rms, out_float32=False):
    """y alone (no autograd)."""
    if x.is_cuda:
        return _channel_norm_fwd_cuda(x, weight, bias, eps, rms, out_float32, want_stats=False)[0]
    return _channel_norm_fwd_reference(x, weight, bias, eps, rms, out_float32)[0]


def _channel_norm_bwd(dy, x, mean, rstd, weight, output_mask):
    if x.is_cuda:
        return _channel_norm_bwd_cuda(dy, x, mean, rstd, weight, output_mask)
    return _channel_norm_bwd_reference(dy, x, mean, rstd, weight, output_mask)


def _channel_norm_stats_shape(x: Tensor) -> tuple[int, ...]:
    return (x.shape[0], *x.shape[2:])


def _channel_norm_fwd_fake(x, weight, bias, eps, rms, out_float32=False):
    rstd = x.new_empty(_channel_norm_stats_shape(x), dtype=_stat_dtype(x.dtype))
    mean = None if rms else torch.empty_like(rstd)
    return _empty_out(x, out_float32), mean, rstd


def _channel_norm_bwd_fake(dy, x, mean, rstd, weight, output_mask):
    pdtype = _param_dtype(x, weight)
    C = x.shape[1]
    return (
        _empty_out(x) if output_mask[0] else None,
        x.new_empty((C,), dtype=pdtype) if output_mask[1] else None,
        x.new_empty((C,), dtype=pdtype) if output_mask[2] else None,
    )
