r"""Instance norm: group norm with G = C (:mod:`._group_norm`), with running statistics.

Training with running statistics, like torch (batch norm over the (1, N*C, *) view with the
running stats repeated N times, averaged over N)::

    running_mean = (1 - momentum) * running_mean + momentum * mean_n(mean[n, c])
    running_var  = (1 - momentum) * running_var  + momentum * mean_n(var[n, c]) * M / (M - 1)

Without running statistics an instance norm call is group norm's (G = C); with
``use_input_stats=False`` it is batch norm's in eval (:mod:`._batch_norm`). So this module sits
above both families and takes their route, kernels and backward.

Custom op (``torch.ops.cupynorm.*``; its backward is ``group_norm_bwd``)::

    instance_norm_fwd(x, weight?, bias?, running_mean, running_var, momentum, eps)
        -> (y, mean, rstd, new_running_mean, new_running_var)

The op is functional (:mod:`._library`): it returns the updated running statistics, which the
route writes back with ``copy_``; the eager Function updates them in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks, _higher_order, _library
from ._autograd import _EagerFunction, _kernel_backward
from ._batch_norm import _apply_batch_norm
from ._group_norm import (
    _apply_group_norm,
    _group_norm_bwd,
    _group_norm_fwd_fake,
    _make_group_norm_backward,
    group_norm_bwd_op,
)
from ._policy import inductor_takes
from ._reference import _instance_norm_fwd_reference, _instance_norm_update
from ._route import _traced, _use_kernels, _wants_grad
from ._tensors import _dense, _host, _vec


# ---------------------------------------------------------------------------------------------
# kernels on each device
# ---------------------------------------------------------------------------------------------
def _instance_norm_fwd_cuda(x, weight, bias, running_mean, running_var, momentum, eps):
    x, fmt = _dense(x)
    y, mean, rstd, var = _host().group_norm_fwd(
        x, x.shape[1], _vec(weight), _vec(bias), eps, want_var=True
    )
    _instance_norm_update(running_mean, running_var, mean, var, math.prod(x.shape[2:]), momentum)
    return y.contiguous(memory_format=fmt), mean, rstd


def _instance_norm_fwd(x, weight, bias, running_mean, running_var, momentum, eps):
    if x.is_cuda:
        return _instance_norm_fwd_cuda(x, weight, bias, running_mean, running_var, momentum, eps)
    return _instance_norm_fwd_reference(x, weight, bias, running_mean, running_var, momentum, eps)


def _instance_norm_fwd_op_kernel(fwd):
    """The op's kernel: ``fwd`` updating copies of the running stats, returned as outputs."""

    def kernel(x, weight, bias, running_mean, running_var, momentum, eps):
        new_mean, new_var = running_mean.clone(), running_var.clone()
        y, mean, rstd = fwd(x, weight, bias, new_mean, new_var, momentum, eps)
        return y, mean, rstd, new_mean, new_var

    return kernel


def _instance_norm_fwd_fake(x, weight, bias, running_mean, running_var, momentum, eps):
    y, mean, rstd = _group_norm_fwd_fake(x, x.shape[1], weight, bias, eps)
    return y, mean, rstd, torch.empty_like(running_mean), torch.empty_like(running_var)


# ---------------------------------------------------------------------------------------------
# custom op and its autograd (group norm's backward)
# ---------------------------------------------------------------------------------------------
instance_norm_fwd_op = _library.define(
    "instance_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor running_mean,"
    " Tensor running_var, float momentum, float eps)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _instance_norm_fwd_op_kernel(_instance_norm_fwd_cuda),
    _instance_norm_fwd_op_kernel(_instance_norm_fwd_reference),
    _instance_norm_fwd_fake,
    any_layout=True,
)


def _instance_norm_setup(ctx, inputs, output) -> None:
    # output: (y, mean, rstd) from the eager Function, plus the new running stats from the op
    x, weight = inputs[0], inputs[1]
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.num_groups = x.shape[1]
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


_instance_norm_backward_composite = _make_group_norm_backward(_higher_order.group_norm_bwd, 7, 1)
_library.register_autograd(
    instance_norm_fwd_op,
    _kernel_backward(
        _make_group_norm_backward(group_norm_bwd_op, 7, 1), _instance_norm_backward_composite
    ),
    _instance_norm_setup,
)


# ---------------------------------------------------------------------------------------------
# eager Function, route, functional API
# ---------------------------------------------------------------------------------------------
class _InstanceNormFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        inputs = (x, weight, bias, running_mean, running_var, momentum, eps)
        output = _instance_norm_fwd(*inputs)
        _instance_norm_setup(ctx, inputs, output)
        return output

    backward = staticmethod(
        _kernel_backward(
            _make_group_norm_backward(_group_norm_bwd, 7, 1), _instance_norm_backward_composite
        )
    )


def _apply_instance_norm(x, weight, bias, running_mean, running_var, momentum, eps) -> Tensor:
    args = (x, weight, bias, running_mean, running_var, momentum, eps)
    if _traced(x):
        y, _mean, _rstd, new_mean, new_var = instance_norm_fwd_op(*args)
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
        return y
    if _wants_grad(x, weight, bias):
        return _InstanceNormFunction.run(*args)[0]
    return _instance_norm_fwd(*args)[0]


def instance_norm(
    input: Tensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    r"""Instance normalization (:func:`torch.nn.functional.instance_norm`) on cupynorm's kernels.

    Each channel of each sample is normalized over its ``prod(spatial)`` values (group norm with
    ``G = C``):

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    With ``use_input_stats`` and running statistics given, they are updated in place with the
    mean over the batch of the per-instance mean and unbiased variance:
    :math:`r \leftarrow (1 - \text{momentum})\, r + \text{momentum} \cdot \text{stat}`.
    With ``use_input_stats=False`` the running statistics are used instead (as batch norm in
    eval mode).

    Args:
        input: tensor of shape :math:`(N, C, *)`; CUDA tensors run on cupynorm's kernels,
            tensors on other devices through :func:`torch.nn.functional.instance_norm`.
        running_mean: running mean of shape :math:`(C,)`, or None.
        running_var: running variance of shape :math:`(C,)`, or None.
        weight: per-channel scale :math:`\gamma` of shape :math:`(C,)`, or None.
        bias: per-channel shift :math:`\beta` of shape :math:`(C,)`, or None.
        use_input_stats: normalize with the statistics of each instance. Default: ``True``
        momentum: weight of the new statistics in the running-statistics update. Default: 0.1
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)`, same memory format as the input

    Example::

        >>> x = torch.randn(4, 3, 7, 9, device="cuda")
        >>> y = cupynorm.torch.instance_norm(x)
    """
    _checks.check_tensor("instance_norm", "input", input)
    if not _use_kernels(input, "instance_norm") or inductor_takes("instance_norm", input):
        return F.instance_norm(
            input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
        )
    _checks.check_instance_norm(
        input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
    )
    c = input.shape[1]
    if not use_input_stats:
        return _apply_batch_norm(input, weight, bias, running_mean, running_var, False, 0.0, eps)
    if running_mean is None:
        return _apply_group_norm(input, c, weight, bias, eps)
    return _apply_instance_norm(input, weight, bias, running_mean, running_var, momentum, eps)
