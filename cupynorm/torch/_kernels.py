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

import torch
from torch import Tensor

from ._reference import (
    _channel_norm_bwd_reference,
    _channel_norm_fwd_reference,
    _param_dtype,
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


# ---------------------------------------------------------------------------------------------
# row norms: LayerNorm / RMSNorm over the trailing ``ndim`` dims of x, optionally after a
# residual add (the math is in _reference.py). Outputs are contiguous; mean/rstd have the shape
# of the leading dims (mean is None for RMSNorm); dweight/dbias have the normalized shape.
# ---------------------------------------------------------------------------------------------


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
