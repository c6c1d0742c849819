r"""Higher-order autograd of the norms: double backward (``create_graph=True``) through every
Function, and the calls that forward-mode AD and ``torch.func`` transforms take.

**Double backward.** The first-order backward is a kernel without a derivative. Under
``create_graph=True`` (the only backward that runs with grad mode on) the Functions compute their
gradients instead with the backward formulas of :mod:`._reference` -- torch operations, hence
differentiable -- over statistics recomputed from the saved input. Each recomputed statistic is
*anchored* at the value the forward saved::

    stat_a(x) = saved + (stat(x) - stat(x).detach())

its value the saved one (the gradients match the kernel's first-order ones), its derivatives of
every order those of ``stat(x)``. The inverse standard deviation needs eps, which no Function
keeps (a first-order forward would pay for it); it is not needed: with ``s(x)`` the variance
(the mean square for RMSNorm), ``rstd = (s + eps)^-1/2`` and all its derivatives in s depend on
``s + eps`` alone, which is ``rstd0^-2`` at the saved point, so ``rsqrt(s - s.detach() +
rstd0^-2)`` has the right value and derivatives. A backward written so is its own derivative:
the gradient it returns is a differentiable function of the input, the parameters and dy (a
Hessian-vector product, a gradient penalty). Batch norm in eval reads the running statistics,
constants as in torch; ReLU's derivative is piecewise constant (relu'' = 0), SiLU's is
recomputed from its input (:func:`._reference._activation_grad`).

The functions here take the arguments of the families' backward kernels (``_<op>_bwd``), so a
family builds its create_graph backward with the backward maker it builds the first-order one
with (:func:`._autograd._kernel_backward` picks one by grad mode, a check the backward made
already); the replayed calls' (``ctx.grads.composite`` of :class:`._autograd._ReplayFunction`)
read the ctx their family's replay save filled, as its ``_<family>_replay_grads`` does.

**Transforms.** ``torch.func`` transforms (vmap, grad, jacrev, jvp, ...) and forward-mode AD
(``torch.autograd.forward_ad``) need every op to have a batching rule or a forward derivative;
the eager Functions and custom ops have neither. While one is active, the functional API takes
torch's own composite path, the one a CPU tensor takes (:func:`composite_only`, read by
:func:`._route._use_kernels`): torch's errors too (BatchNorm training under vmap wants
``torch.func.replace_all_batch_norm_modules_``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd import forward_ad as _forward_ad

from ._reference import (
    _batch_norm_act_bwd_reference,
    _batch_norm_bwd_reference,
    _channel_norm_bwd_reference,
    _channels_to_rows,
    _group_norm_act_bwd_reference,
    _group_norm_bwd_reference,
    _layout,
    _row_norm_add_mul_bwd_reference,
    _row_norm_bwd_reference,
    _shifted,
    _stat_dtype,
)

_transforms_active = torch._C._are_functorch_transforms_active


def composite_only() -> bool:
    """Whether a call must take torch's composite path: a ``torch.func`` transform is active or
    a forward-AD dual level is open (``torch.autograd.forward_ad.dual_level``)."""
    return _transforms_active() or _forward_ad._current_level >= 0


# ---------------------------------------------------------------------------------------------
# statistics anchored at the saved ones
# ---------------------------------------------------------------------------------------------
def _anchored(value: Tensor, saved: Tensor) -> Tensor:
    """``saved``'s value with ``value``'s derivatives."""
    saved = saved.reshape(value.shape).to(value.dtype)
    return saved + (value - value.detach())


def _anchored_rstd(spread: Tensor, saved_rstd: Tensor) -> Tensor:
    """``rsqrt(spread + eps)`` with its derivatives, eps unknown: ``spread + eps`` is
    ``saved_rstd^-2`` at the saved point (the variance, or the mean square)."""
    at_saved = saved_rstd.reshape(spread.shape).to(spread.dtype).pow(-2)
    return _anchored(torch.rsqrt(spread - spread.detach() + at_saved), saved_rstd)


def _stats(xs: Tensor, dims, mean: Tensor | None, rstd: Tensor) -> tuple[Tensor | None, Tensor]:
    """(mean, rstd) of ``xs`` over ``dims`` anchored at the saved ones, shaped as those (mean
    None: RMSNorm's mean square)."""
    if mean is None:
        return None, _anchored_rstd(xs.square().mean(dim=dims), rstd).reshape(rstd.shape)
    var, m = torch.var_mean(xs, dim=dims, correction=0)
    return _anchored(m, mean).reshape(mean.shape), _anchored_rstd(var, rstd).reshape(rstd.shape)


# ---------------------------------------------------------------------------------------------
# differentiable backwards, argument for argument the families' backward kernels
# ---------------------------------------------------------------------------------------------
def row_norm_bwd(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast=False):
    """:func:`._row_norm._row_norm_bwd`, differentiable."""
    rows = x.to(_stat_dtype(x.dtype)).reshape(-1, math.prod(x.shape[x.dim() - ndim :]))
    mean, rstd = _stats(rows, 1, mean, rstd)
    return _row_norm_bwd_reference(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast)


def channel_norm_bwd(dy, x, mean, rstd, weight, output_mask):
    """:func:`._channel_norm._channel_norm_bwd`, differentiable."""
    mean, rstd = _stats(_channels_to_rows(x.to(_stat_dtype(x.dtype))), -1, mean, rstd)
    return _channel_norm_bwd_reference(dy, x, mean, rstd, weight, output_mask)


def _group_stats(x, mean, rstd, num_groups, shift=None):
    groups = _shifted(x, shift).reshape(x.shape[0], num_groups, -1)
    return _stats(groups, -1, mean, rstd)


def group_norm_bwd(dy, x, mean, rstd, weight, num_groups, output_mask):
    """:func:`._group_norm._group_norm_bwd`, differentiable."""
    mean, rstd = _group_stats(x, mean, rstd, num_groups)
    return _group_norm_bwd_reference(dy, x, mean, rstd, weight, num_groups, output_mask)


def group_norm_act_bwd(dy, x, mean, rstd, weight, bias, num_groups, output_mask, act, shift=None):
    """:func:`._group_norm._group_norm_act_bwd`, differentiable (in the shift too)."""
    mean, rstd = _group_stats(x, mean, rstd, num_groups, shift)
    # fmt: off
    return _group_norm_act_bwd_reference(dy, x, mean, rstd, weight, bias, num_groups, output_mask,
                                         act, shift)
    # fmt: on


def _batch_stats(x, mean, rstd, training):
    """Batch norm's statistics: the batch's, anchored, in training; the running statistics the
    forward read (constants) in eval."""
    if not training:
        return mean, rstd
    return _stats(x.to(_stat_dtype(x.dtype)), [0, *range(2, x.dim())], mean, rstd)


def batch_norm_bwd(dy, x, save_mean, save_rstd, weight, training, output_mask, forward=None):
    """:func:`._batch_norm_kernels._batch_norm_bwd`, differentiable (``forward`` unused)."""
    mean, rstd = _batch_stats(x, save_mean, save_rstd, training)
    return _batch_norm_bwd_reference(dy, x, mean, rstd, weight, training, output_mask)


def batch_norm_act_bwd(dy, x, save_mean, save_rstd, weight, training, output_mask, residual, bias,
                       act, forward=None, relu_mask=None):  # fmt: skip
    """:func:`._batch_norm_kernels._batch_norm_act_bwd`, differentiable. With the ReLU's mask
    the forward kept (in place of the residual) dt is dy where the mask is set."""
    mean, rstd = _batch_stats(x, save_mean, save_rstd, training)
    if relu_mask is None:
        # fmt: off
        return _batch_norm_act_bwd_reference(dy, x, mean, rstd, weight, training, output_mask,
                                             residual, bias, act)
        # fmt: on
    dt = torch.where(unpack_relu_mask(relu_mask, x), dy, torch.zeros_like(dy))
    dx, dweight, dbias = _batch_norm_bwd_reference(dt, x, mean, rstd, weight, training,
                                                   output_mask[:3])  # fmt: skip
    return dx, dweight, dbias, dt if output_mask[3] else None


def unpack_relu_mask(mask: Tensor, x: Tensor) -> Tensor:
    """The fused batch norm's ReLU mask as booleans of x's shape: bit e of byte j is element
    8j + e of x's memory order (``cuda_src/strided_norm.cu``)."""
    n = x.numel()
    shifts = torch.arange(8, device=mask.device, dtype=torch.int32)
    bits = (mask.reshape(-1)[: (n + 7) // 8, None].to(torch.int32) >> shifts) & 1
    flat = bits.reshape(-1)[:n].bool()
    if _layout(x) in (torch.channels_last, torch.channels_last_3d):
        order = _channels_to_rows(x)  # N, *spatial, C: the memory order
        return flat.reshape(order.shape).permute(0, x.dim() - 1, *range(1, x.dim() - 1))
    return flat.reshape(x.shape)


def row_norm_add_mul_bwd(dout, x, y, mean, rstd):
    """:func:`._row_norm_add_mul._row_norm_add_mul_bwd`, differentiable."""
    mean, rstd = _stats(x.to(_stat_dtype(x.dtype)), -1, mean, rstd)
    return _row_norm_add_mul_bwd_reference(dout, x, y, mean, rstd)


# ---------------------------------------------------------------------------------------------
# the replayed calls' gradients (cupynorm.torch._replay), differentiable: ctx as each family's
# ``_<family>_replay_save`` left it, the gradients of (x, a, b, c) as its ``_replay_grads``
# ---------------------------------------------------------------------------------------------
def row_norm_replay_grads(ctx, dy, dsum=None):
    """:func:`._row_norm._row_norm_replay_grads`: the gradient of the normalized rows (plus
    that of the sum) goes to x and the residual alike."""
    needs = ctx.needs_input_grad
    want_x = needs[0] or needs[1]
    dx = dweight = dbias = None
    if dy is not None:
        normalized, weight, mean, rstd = ctx.saved_tensors
        _row_len, cast, dims = ctx.row
        mask = (want_x, needs[2], needs[3])
        dsum = dsum if want_x else None
        # fmt: off
        dx, dweight, dbias = row_norm_bwd(dy, dsum, normalized, mean, rstd, weight, len(dims),
                                          mask, cast)
        # fmt: on
    elif want_x:
        dx = dsum
    return (dx if needs[0] else None), (dx if needs[1] else None), dweight, dbias


def channel_norm_replay_grads(ctx, dy):
    """:func:`._channel_norm._channel_norm_replay_grads`."""
    x, weight, mean, rstd = ctx.saved_tensors
    return (*channel_norm_bwd(dy, x, mean, rstd, weight, list(ctx.needs_input_grad[:3])), None)


def group_norm_replay_grads(ctx, dy):
    """:func:`._group_norm._group_norm_replay_grads`: plain (``ctx.act`` None) or fused."""
    x, weight, bias, mean, rstd, shift = ctx.saved_tensors
    needs = ctx.needs_input_grad
    mask = (needs[0] or needs[3], needs[1], needs[2])  # the shift's gradient sums dx
    if ctx.act is None:
        dx, dweight, dbias = group_norm_bwd(dy, x, mean, rstd, weight, ctx.num_groups, mask)
    else:
        # fmt: off
        dx, dweight, dbias = group_norm_act_bwd(dy, x, mean, rstd, weight, bias, ctx.num_groups,
                                                mask, ctx.act, shift)
        # fmt: on
    dshift = dx.sum(dim=tuple(range(2, dx.dim()))) if needs[3] else None
    return (dx if needs[0] else None), dweight, dbias, dshift


def batch_norm_act_grads(ctx, dy, residual_at: int = 3) -> tuple:
    """:func:`._batch_norm._batch_norm_act_grads` (the replay's, and the eager fused
    Function's with ``residual_at`` 8): (dx, dweight, dbias, dresidual)."""
    x, weight, save_mean, save_rstd, residual, bias, relu_mask = ctx.saved_tensors
    needs = ctx.needs_input_grad
    mask = (needs[0], needs[1], needs[2], needs[residual_at])
    # fmt: off
    return batch_norm_act_bwd(dy, x, save_mean, save_rstd, weight, ctx.training, mask, residual,
                              bias, ctx.act, None, relu_mask)
    # fmt: on
