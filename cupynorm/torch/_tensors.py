"""What every family's kernels do to tensors around the host code, and the host code itself.

The CUDA kernels of each op (``_<op>_fwd_cuda`` / ``_<op>_bwd_cuda``, in the family modules) call
the framework-neutral host code :mod:`cupynorm._ops`, imported on first use (:func:`_host`), so
``import cupynorm.torch`` works without CuPy.

Layouts: ``y``/``dx`` keep the input's memory format when it is contiguous or channels_last
(channels_last_3d for 5-D); any other strides are computed on a contiguous copy
(:func:`_dense`) and the result is contiguous. Statistics are float32 (float64 for float64
input); gradients of per-channel parameters have the weight's dtype (:func:`_finish_bwd`, and
the fake kernels' :func:`_norm_bwd_fake`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._reference import _layout, _param_dtype


def _dense(x: Tensor) -> tuple[Tensor, torch.memory_format]:
    """``x`` in a layout the kernels take (contiguous copy for other strides) and its format."""
    fmt = _layout(x)
    if fmt is None:
        return x.contiguous(), torch.contiguous_format
    return x, fmt


def _vec(t: Tensor | None) -> Tensor | None:
    """A per-channel vector the kernels can index directly (they take raw pointers)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``; a tensor already of that dtype as it is, without the call (``.to`` with
    nothing to do costs ~1 us of argument parsing; the kernels usually wrote the right dtype)."""
    return t if t.dtype == dtype else t.to(dtype)


def _write_back(running: Tensor | None, updated: Tensor | None) -> None:
    """Copy a running statistic updated on a contiguous copy back into the original."""
    if updated is not running:
        running.copy_(updated)


def _empty_out(x: Tensor, out_float32: bool = False) -> Tensor:
    """Output/dx allocation matching what the kernels return for input ``x`` (fake kernels);
    ``out_float32``: a float32 y (autocast's norm of a half-precision x)."""
    dtype = torch.float32 if out_float32 else x.dtype
    return torch.empty_like(x, dtype=dtype, memory_format=_layout(x) or torch.contiguous_format)


def _finish_bwd(dx, dweight, dbias, x, weight, fmt, output_mask):
    """Give the host code's gradients exactly the layout and dtypes the fake kernels promise
    (:func:`_norm_bwd_fake`)."""
    pdtype = _param_dtype(x, weight)
    dx = dx.contiguous(memory_format=fmt) if output_mask[0] else None
    dweight = _cast(dweight, pdtype) if output_mask[1] else None
    dbias = _cast(dbias, pdtype) if output_mask[2] else None
    return dx, dweight, dbias


def _norm_bwd_fake(dy, x, mean, rstd, weight, _arg, output_mask):
    """Fake kernel of a backward with per-channel parameters (group norm's, batch norm's):
    dx like x, dweight and dbias of shape (C,)."""
    c = x.shape[1]
    pdtype = _param_dtype(x, weight)
    return (
        _empty_out(x) if output_mask[0] else None,
        x.new_empty((c,), dtype=pdtype) if output_mask[1] else None,
        x.new_empty((c,), dtype=pdtype) if output_mask[2] else None,
    )


_host_module = None


def _host():
    """The host code :mod:`cupynorm._ops`, imported on first use (it needs CuPy)."""
    global _host_module
    if _host_module is None:
        from cupynorm import _ops as host

        _host_module = host
    return _host_module
