r"""The fused row norm + add + multiply (seed 002's tail): everything of the op from its kernels
on each device to :func:`row_norm_add_mul`.

Per row of D values (mean and biased variance over the last dimension, no affine)::

    xhat = (x - mean) * rstd,  out = (xhat + y) * y
    backward: gx = dout * y;  dx = rstd * (gx - <gx> - xhat * <gx * xhat>)
              dy = dout * (xhat + 2 y)

Custom ops (``torch.ops.cupynorm.*``)::

    row_norm_add_mul_fwd(x, y, eps) -> (out, mean, rstd)
    row_norm_add_mul_bwd(dout, x, y, mean, rstd) -> (dx, dy)

Its calls are not replayed (:mod:`._replay`): the full path is the only one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks, _higher_order, _library
from ._autograd import _EagerFunction, _kernel_backward
from ._policy import inductor_takes
from ._reference import (
    _row_norm_add_mul_bwd_reference,
    _row_norm_add_mul_fwd_reference,
    _stat_dtype,
)
from ._route import _traced, _use_kernels, _wants_grad
from ._tensors import _host


# ---------------------------------------------------------------------------------------------
# kernels on each device
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
# custom ops and their autograd
# ---------------------------------------------------------------------------------------------
row_norm_add_mul_fwd_op = _library.define(
    "row_norm_add_mul_fwd(Tensor x, Tensor y, float eps) -> (Tensor, Tensor, Tensor)",
    _row_norm_add_mul_fwd_cuda,
    _row_norm_add_mul_fwd_reference,
    _row_norm_add_mul_fwd_fake,
)
row_norm_add_mul_bwd_op = _library.define(
    "row_norm_add_mul_bwd(Tensor dout, Tensor x, Tensor y, Tensor mean, Tensor rstd)"
    " -> (Tensor, Tensor)",
    _row_norm_add_mul_bwd_cuda,
    _row_norm_add_mul_bwd_reference,
    _row_norm_add_mul_bwd_fake,
)


def _row_norm_add_mul_setup(ctx, inputs, output) -> None:
    x, y, _eps = inputs
    _out, mean, rstd = output
    ctx.save_for_backward(x, y, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _make_row_norm_add_mul_backward(bwd):
    def backward(ctx, dout, _dmean, _drstd):
        if dout is None:
            return None, None, None
        x, y, mean, rstd = ctx.saved_tensors
        dx, dy = bwd(dout, x, y, mean, rstd)
        needs = ctx.needs_input_grad
        return (dx if needs[0] else None), (dy if needs[1] else None), None

    return backward


_row_norm_add_mul_backward_composite = _make_row_norm_add_mul_backward(
    _higher_order.row_norm_add_mul_bwd
)
_library.register_autograd(
    row_norm_add_mul_fwd_op,
    _kernel_backward(
        _make_row_norm_add_mul_backward(row_norm_add_mul_bwd_op),
        _row_norm_add_mul_backward_composite,
    ),
    _row_norm_add_mul_setup,
)


# ---------------------------------------------------------------------------------------------
# eager Function, route, functional API
# ---------------------------------------------------------------------------------------------
class _RowNormAddMulFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, y, eps):
        output = _row_norm_add_mul_fwd(x, y, eps)
        _row_norm_add_mul_setup(ctx, (x, y, eps), output)
        return output

    backward = staticmethod(
        _kernel_backward(
            _make_row_norm_add_mul_backward(_row_norm_add_mul_bwd),
            _row_norm_add_mul_backward_composite,
        )
    )


def _apply_row_norm_add_mul(x, y, eps) -> Tensor:
    if _traced(x):
        return row_norm_add_mul_fwd_op(x, y, eps)[0]
    if _wants_grad(x, y, None):
        return _RowNormAddMulFunction.run(x, y, eps)[0]
    return _row_norm_add_mul_fwd(x, y, eps)[0]


def row_norm_add_mul(x: Tensor, y: Tensor, eps: float = 1e-5) -> Tensor:
    r"""Normalize each row of ``x`` over its last dimension, add ``y``, multiply by ``y``.

    .. math::
        \hat{x} = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}}, \qquad
        \text{out} = (\hat{x} + y) \cdot y

    with mean and biased variance over the last dimension, no affine parameters; one fused
    kernel on CUDA (the norm + add + mul tail of seed 002), plain torch ops elsewhere.

    Args:
        x: tensor of shape :math:`(*, D)`.
        y: tensor of the same shape, dtype and device as ``x``.
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - x, y: :math:`(*, D)`
        - Output: :math:`(*, D)`, contiguous

    Example::

        >>> x = torch.randn(1024, 8192, device="cuda")
        >>> y = torch.randn(1024, 8192, device="cuda")
        >>> out = cupynorm.torch.row_norm_add_mul(x, y)
    """
    _checks.check_tensor("row_norm_add_mul", "x", x)
    _checks.check_row_norm_add_mul(x, y, eps)
    if not _use_kernels(x, "row_norm_add_mul") or inductor_takes("row_norm_add_mul", x):
        xhat = F.layer_norm(x, (x.shape[-1],), eps=eps)
        return (xhat + y) * y
    _checks.check_kernel_inputs("row_norm_add_mul", x, y)
    return _apply_row_norm_add_mul(x, y, eps)
