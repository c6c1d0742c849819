r"""torch adapter: custom ops, autograd and the functional API on torch tensors.

Layers, bottom to top (each calls only the one below it):

1. **Kernels per device** -- ``_<op>_fwd_cuda`` / ``_<op>_bwd_cuda`` call the framework-neutral host
   code :mod:`cupynorm._ops` (imported lazily, so ``import cupynorm.torch`` works without CuPy);
   ``_<op>_fwd_reference`` / ``_<op>_bwd_reference`` (:mod:`._reference`, with the math) are the
   same math in plain torch on float32 (float64 for float64 input). The reference kernels back the
   ops on the CPU: CI uses them to check the op plumbing (schemas, fake kernels, autograd,
   ``torch.compile``) without a GPU, and their backward is the readable derivation of the
   gradients. Argument checks of the kernel route live in :mod:`._checks`.
2. **Custom ops** in the ``cupynorm`` namespace (``torch.library``), with fake (meta) kernels and
   registered autograd, so ``torch.compile(fullgraph=True)`` keeps them in the graph::

       group_norm_fwd(x, num_groups, weight?, bias?, eps) -> (y, mean, rstd)
       group_norm_bwd(dy, x, mean, rstd, weight?, num_groups, output_mask)
           -> (dx?, dweight?, dbias?)
       instance_norm_fwd(x, weight?, bias?, running_mean, running_var, momentum, eps)
           -> (y, mean, rstd, new_running_mean, new_running_var)   # group norm with G = C
       batch_norm_fwd(x, weight?, bias?, running_mean?, running_var?, training, momentum, eps)
           -> (y, save_mean, save_rstd, new_running_mean?, new_running_var?)
       batch_norm_bwd(dy, x, save_mean, save_rstd, weight?, training, output_mask)
           -> (dx?, dweight?, dbias?)
       row_norm_add_mul_fwd(x, y, eps) -> (out, mean, rstd)
       row_norm_add_mul_bwd(dout, x, y, mean, rstd) -> (dx, dy)

   Running statistics: ``torch.library`` refuses ``register_autograd`` on an op that mutates an
   input ("Cannot register autograd formula for non-functional operator"), so the forward ops
   with running statistics are functional: they return the updated statistics (computed on
   copies; None where nothing is updated) and the functional layer writes them back with
   ``copy_``, an ordinary in-place op that ``torch.compile`` functionalizes like torch's own
   buffer updates. The eager fast path (3.) updates them in place inside the kernel, no copies.

   Layouts: ``y``/``dx`` keep the input's memory format when it is contiguous or channels_last
   (channels_last_3d for 5-D); any other strides are computed on a contiguous copy and the result
   is contiguous. Statistics are float32 (float64 for float64 input): ``mean``/``rstd`` are
   ``(N, G)`` for group norm, ``(C,)`` for batch norm, ``x.shape[:-1]`` for the row norm.
3. **Eager fast path.** A call through the dispatcher into a Python kernel with Python autograd is
   expensive. Measured on the CPU of the dev machine (torch 2.13, a trivial kernel taking 3.7 us
   when called directly): ``torch.library`` op with autograd 26 us per call, the same op with no
   input requiring grad 9.7 us, a plain :class:`torch.autograd.Function` 8.3 us (one that defines
   ``setup_context`` 21 us: ``apply`` binds the signature with :mod:`inspect` on every call). So
   eager calls on plain CUDA tensors go through ``_*Function`` (an old-style
   ``autograd.Function`` sharing the op's kernels, setup and backward code), or straight to the
   kernel when no gradient is needed; the custom op is used whenever something traces:
   ``torch.compile``/export, tensor subclasses (FakeTensor, ...), an active
   ``TorchDispatchMode``. With a 3 us stub kernel, a whole module call then costs 9 us
   (InstanceNorm2d, nothing needs grad), 17 us (GroupNorm, affine, parameters need grad) and
   21 us (BatchNorm2d training). To re-measure on a GPU::

       import torch, torch.utils.benchmark as B
       import cupynorm.torch as cnt
       from cupynorm.torch import _ops
       x = torch.randn(8, 64, 32, 32, device="cuda", requires_grad=True)
       m, ref = cnt.InstanceNorm2d(64).cuda(), torch.nn.InstanceNorm2d(64).cuda()
       op = torch.ops.cupynorm.group_norm_fwd.default
       for stmt in ("ref(x)", "m(x)",                                          # modules
                    "op(x, 64, None, None, 1e-5)",                             # dispatcher
                    "_ops._GroupNormFunction.apply(x, 64, None, None, 1e-5)",  # fast path
                    "_ops._group_norm_fwd(x, 64, None, None, 1e-5)"):          # kernel only
           t = B.Timer(stmt, globals=globals()).blocked_autorange(min_run_time=1)
           print(f"{stmt:60s} {t.median * 1e6:7.1f} us")

4. **Functional API** (:func:`group_norm`, :func:`instance_norm`, :func:`batch_norm`,
   :func:`row_norm_add_mul`): ``torch.nn.functional`` semantics and argument names; CUDA tensors
   run on cupynorm's kernels after :mod:`._checks` (bad arguments raise torch's own error for
   them), any other device through :mod:`torch.nn.functional`, so a converted model still runs on
   the CPU.

Not supported: double backward (the backward is a kernel without a derivative) and functorch
transforms (``torch.func.grad``/``vmap``: ops registered through ``torch.library`` with
``register_autograd`` refuse them, and so does the eager Function).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _checks
from ._reference import (
    _batch_norm_bwd_reference,
    _batch_norm_fwd_reference,
    _group_norm_bwd_reference,
    _group_norm_fwd_reference,
    _instance_norm_fwd_reference,
    _instance_norm_update,
    _layout,
    _param_dtype,
    _row_norm_add_mul_bwd_reference,
    _row_norm_add_mul_fwd_reference,
    _stat_dtype,
)

__all__ = ["batch_norm", "group_norm", "instance_norm", "row_norm_add_mul"]


# ---------------------------------------------------------------------------------------------
# dtypes and layouts
# ---------------------------------------------------------------------------------------------
def _dense(x: Tensor) -> tuple[Tensor, torch.memory_format]:
    """``x`` in a layout the kernels take (contiguous copy for other strides) and its format."""
    fmt = _layout(x)
    if fmt is None:
        return x.contiguous(), torch.contiguous_format
    return x, fmt


def _vec(t: Tensor | None) -> Tensor | None:
    """A per-channel vector the kernels can index directly (they take raw pointers)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _write_back(running: Tensor | None, updated: Tensor | None) -> None:
    """Copy a running statistic updated on a contiguous copy back into the original."""
    if updated is not running:
        running.copy_(updated)


def _empty_out(x: Tensor) -> Tensor:
    """Output/dx allocation matching what the kernels return for input ``x`` (fake kernels)."""
    return torch.empty_like(x, memory_format=_layout(x) or torch.contiguous_format)


_host_module = None


def _host():
    """The host code :mod:`cupynorm._ops`, imported on first use (it needs CuPy)."""
    global _host_module
    if _host_module is None:
        from cupynorm import _ops as host

        _host_module = host
    return _host_module


# ---------------------------------------------------------------------------------------------
# group norm (instance norm is group norm with G = C)
#   x viewed as (N, G, M) with M = C/G * prod(spatial); per (n, g):
#     mean = sum(x) / M,  var = sum((x - mean)^2) / M,  rstd = 1 / sqrt(var + eps)
#     xhat = (x - mean) * rstd,  y = xhat * weight[c] + bias[c]
#   backward, with gx = dy * weight[c] and <.> the mean over the group:
#     dx = rstd * (gx - <gx> - xhat * <gx * xhat>)
#     dweight[c] = sum_{n, spatial} dy * xhat,  dbias[c] = sum_{n, spatial} dy
# ---------------------------------------------------------------------------------------------
def _group_norm_fwd_cuda(
    x: Tensor,
    num_groups: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    want_stats: bool = True,
):
    """(y, mean, rstd); without ``want_stats`` (no autograd) mean and rstd are None and the
    kernels skip them where they can."""
    x, fmt = _dense(x)
    y, mean, rstd = _host().group_norm_fwd(
        x, num_groups, _vec(weight), _vec(bias), eps, want_stats=want_stats
    )
    return y.contiguous(memory_format=fmt), mean, rstd


def _group_norm_bwd_cuda(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    num_groups: int,
    output_mask: Sequence[bool],
):
    x, fmt = _dense(x)
    dy = dy.contiguous(memory_format=fmt)
    dx, dweight, dbias = _host().group_norm_bwd(
        dy, x, mean, rstd, _vec(weight), num_groups, tuple(output_mask)
    )
    return _finish_bwd(dx, dweight, dbias, x, weight, fmt, output_mask)


def _finish_bwd(dx, dweight, dbias, x, weight, fmt, output_mask):
    """Give the host code's gradients exactly the layout and dtypes the fake kernels promise."""
    pdtype = _param_dtype(x, weight)
    dx = dx.contiguous(memory_format=fmt) if output_mask[0] else None
    dweight = dweight.to(pdtype) if output_mask[1] else None
    dbias = dbias.to(pdtype) if output_mask[2] else None
    return dx, dweight, dbias


def _group_norm_fwd(x, num_groups, weight, bias, eps):
    if x.is_cuda:
        return _group_norm_fwd_cuda(x, num_groups, weight, bias, eps)
    return _group_norm_fwd_reference(x, num_groups, weight, bias, eps)


def _group_norm_output(x, num_groups, weight, bias, eps) -> Tensor:
    """y alone (no autograd)."""
    if x.is_cuda:
        return _group_norm_fwd_cuda(x, num_groups, weight, bias, eps, want_stats=False)[0]
    return _group_norm_fwd_reference(x, num_groups, weight, bias, eps)[0]


def _group_norm_bwd(dy, x, mean, rstd, weight, num_groups, output_mask):
    if x.is_cuda:
        return _group_norm_bwd_cuda(dy, x, mean, rstd, weight, num_groups, output_mask)
    return _group_norm_bwd_reference(dy, x, mean, rstd, weight, num_groups, output_mask)


def _group_norm_fwd_fake(x, num_groups, weight, bias, eps):
    stats = x.new_empty((x.shape[0], num_groups), dtype=_stat_dtype(x.dtype))
    return _empty_out(x), stats, torch.empty_like(stats)


def _norm_bwd_fake(dy, x, mean, rstd, weight, _arg, output_mask):
    c = x.shape[1]
    pdtype = _param_dtype(x, weight)
    return (
        _empty_out(x) if output_mask[0] else None,
        x.new_empty((c,), dtype=pdtype) if output_mask[1] else None,
        x.new_empty((c,), dtype=pdtype) if output_mask[2] else None,
    )


# ---------------------------------------------------------------------------------------------
# instance norm with running statistics (training): group norm with G = C, then, like torch
# (batch norm over the (1, N*C, *) view with the running stats repeated N times, averaged over N):
#   running_mean = (1 - momentum) * running_mean + momentum * mean_n(mean[n, c])
#   running_var  = (1 - momentum) * running_var  + momentum * mean_n(var[n, c]) * M / (M - 1)
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
# batch norm: per channel c over the M = N * prod(spatial) values x[:, c, ...]
#   training: mean, var (biased) of the batch; running stats get the unbiased var * M / (M - 1)
#   eval:     mean = running_mean, var = running_var
#   rstd = 1 / sqrt(var + eps),  y = (x - mean) * rstd * weight + bias
#   backward: training as group norm (the sums over n and spatial); eval dx = dy * weight * rstd
# ---------------------------------------------------------------------------------------------
def _batch_norm_fwd_cuda(x, weight, bias, running_mean, running_var, training, momentum, eps):
    x, fmt = _dense(x)
    mean, var = _vec(running_mean), _vec(running_var)
    y, save_mean, save_rstd = _host().batch_norm_fwd(
        x, _vec(weight), _vec(bias), mean, var, training, momentum, eps
    )
    if training:
        _write_back(running_mean, mean)
        _write_back(running_var, var)
    return y.contiguous(memory_format=fmt), save_mean, save_rstd


def _batch_norm_bwd_cuda(dy, x, save_mean, save_rstd, weight, training, output_mask):
    x, fmt = _dense(x)
    dy = dy.contiguous(memory_format=fmt)
    dx, dweight, dbias = _host().batch_norm_bwd(
        dy, x, save_mean, save_rstd, _vec(weight), training, tuple(output_mask)
    )
    return _finish_bwd(dx, dweight, dbias, x, weight, fmt, output_mask)


def _batch_norm_fwd(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if x.is_cuda:
        return _batch_norm_fwd_cuda(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
    return _batch_norm_fwd_reference(
        x, weight, bias, running_mean, running_var, training, momentum, eps
    )


def _batch_norm_bwd(dy, x, save_mean, save_rstd, weight, training, output_mask):
    if x.is_cuda:
        return _batch_norm_bwd_cuda(dy, x, save_mean, save_rstd, weight, training, output_mask)
    return _batch_norm_bwd_reference(dy, x, save_mean, save_rstd, weight, training, output_mask)


def _batch_norm_fwd_op_kernel(fwd):
    """The op's kernel: ``fwd`` updating copies of the running stats, returned as outputs."""

    def kernel(x, weight, bias, running_mean, running_var, training, momentum, eps):
        if not training:
            y, save_mean, save_rstd = fwd(
                x, weight, bias, running_mean, running_var, False, momentum, eps
            )
            if save_mean.data_ptr() == running_mean.data_ptr():
                # the host code may hand back running_mean itself as save_mean (fine in eager,
                # like torch's own eval backward); an op's output must not alias an input
                save_mean = save_mean.clone()
            return y, save_mean, save_rstd, None, None
        new_mean = None if running_mean is None else running_mean.clone()
        new_var = None if running_var is None else running_var.clone()
        y, save_mean, save_rstd = fwd(x, weight, bias, new_mean, new_var, True, momentum, eps)
        return y, save_mean, save_rstd, new_mean, new_var

    return kernel


def _batch_norm_fwd_fake(x, weight, bias, running_mean, running_var, training, momentum, eps):
    stats = x.new_empty((x.shape[1],), dtype=_stat_dtype(x.dtype))
    new_mean = torch.empty_like(running_mean) if training and running_mean is not None else None
    new_var = torch.empty_like(running_var) if training and running_var is not None else None
    return _empty_out(x), stats, torch.empty_like(stats), new_mean, new_var


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
# autograd: setup_context + backward, shared by the custom ops and the eager Functions.
# `bwd` is the backward op (traceable, for the custom ops) or the kernel itself (eager).
# ---------------------------------------------------------------------------------------------
def _group_norm_setup(ctx, inputs, output) -> None:
    x, num_groups, weight, _bias, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.num_groups = num_groups
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _instance_norm_setup(ctx, inputs, output) -> None:
    # output: (y, mean, rstd) from the eager Function, plus the new running stats from the op
    x, weight = inputs[0], inputs[1]
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.num_groups = x.shape[1]
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _batch_norm_setup(ctx, inputs, output) -> None:
    # output: (y, save_mean, save_rstd) from the eager Function, plus the new running stats
    # (or None) from the op
    x, weight, training = inputs[0], inputs[1], inputs[5]
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.training = training
    ctx.mark_non_differentiable(*(t for t in output[1:] if t is not None))
    ctx.set_materialize_grads(False)


def _row_norm_add_mul_setup(ctx, inputs, output) -> None:
    x, y, _eps = inputs
    _out, mean, rstd = output
    ctx.save_for_backward(x, y, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _make_group_norm_backward(bwd, n_inputs: int, affine_at: int):
    """Backward of an op whose inputs hold x at 0 and weight, bias at affine_at, affine_at + 1."""
    none_grads = (None,) * n_inputs

    def backward(ctx, dy, *_stat_grads):
        if dy is None:
            return none_grads
        x, weight, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = [needs[0], needs[affine_at], needs[affine_at + 1]]
        dx, dweight, dbias = bwd(dy, x, mean, rstd, weight, ctx.num_groups, mask)
        grads = [None] * n_inputs
        grads[0], grads[affine_at], grads[affine_at + 1] = dx, dweight, dbias
        return tuple(grads)

    return backward


def _make_batch_norm_backward(bwd):
    def backward(ctx, dy, *_stat_grads):
        if dy is None:
            return (None,) * 8
        x, weight, save_mean, save_rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = [needs[0], needs[1], needs[2]]
        dx, dweight, dbias = bwd(dy, x, save_mean, save_rstd, weight, ctx.training, mask)
        return dx, dweight, dbias, None, None, None, None, None

    return backward


def _make_row_norm_add_mul_backward(bwd):
    def backward(ctx, dout, _dmean, _drstd):
        if dout is None:
            return None, None, None
        x, y, mean, rstd = ctx.saved_tensors
        dx, dy = bwd(dout, x, y, mean, rstd)
        needs = ctx.needs_input_grad
        return (dx if needs[0] else None), (dy if needs[1] else None), None

    return backward


# ---------------------------------------------------------------------------------------------
# custom op registration
# ---------------------------------------------------------------------------------------------
_lib = torch.library.Library("cupynorm", "FRAGMENT")

_SCHEMAS = {
    "group_norm_fwd": (
        "group_norm_fwd(Tensor x, int num_groups, Tensor? weight, Tensor? bias, float eps)"
        " -> (Tensor, Tensor, Tensor)"
    ),
    "group_norm_bwd": (
        "group_norm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? weight,"
        " int num_groups, bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)"
    ),
    "instance_norm_fwd": (
        "instance_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor running_mean,"
        " Tensor running_var, float momentum, float eps)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "batch_norm_fwd": (
        "batch_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean,"
        " Tensor? running_var, bool training, float momentum, float eps)"
        " -> (Tensor, Tensor, Tensor, Tensor?, Tensor?)"
    ),
    "batch_norm_bwd": (
        "batch_norm_bwd(Tensor dy, Tensor x, Tensor save_mean, Tensor save_rstd, Tensor? weight,"
        " bool training, bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)"
    ),
    "row_norm_add_mul_fwd": (
        "row_norm_add_mul_fwd(Tensor x, Tensor y, float eps) -> (Tensor, Tensor, Tensor)"
    ),
    "row_norm_add_mul_bwd": (
        "row_norm_add_mul_bwd(Tensor dout, Tensor x, Tensor y, Tensor mean, Tensor rstd)"
        " -> (Tensor, Tensor)"
    ),
}

# name: (CUDA kernel, CPU kernel, fake kernel)
_KERNELS = {
    "group_norm_fwd": (_group_norm_fwd_cuda, _group_norm_fwd_reference, _group_norm_fwd_fake),
    "group_norm_bwd": (_group_norm_bwd_cuda, _group_norm_bwd_reference, _norm_bwd_fake),
    "instance_norm_fwd": (
        _instance_norm_fwd_op_kernel(_instance_norm_fwd_cuda),
        _instance_norm_fwd_op_kernel(_instance_norm_fwd_reference),
        _instance_norm_fwd_fake,
    ),
    "batch_norm_fwd": (
        _batch_norm_fwd_op_kernel(_batch_norm_fwd_cuda),
        _batch_norm_fwd_op_kernel(_batch_norm_fwd_reference),
        _batch_norm_fwd_fake,
    ),
    "batch_norm_bwd": (_batch_norm_bwd_cuda, _batch_norm_bwd_reference, _norm_bwd_fake),
    "row_norm_add_mul_fwd": (
        _row_norm_add_mul_fwd_cuda,
        _row_norm_add_mul_fwd_reference,
        _row_norm_add_mul_fwd_fake,
    ),
    "row_norm_add_mul_bwd": (
        _row_norm_add_mul_bwd_cuda,
        _row_norm_add_mul_bwd_reference,
        _row_norm_add_mul_bwd_fake,
    ),
}

for _name, _schema in _SCHEMAS.items():
    _cuda_kernel, _cpu_kernel, _fake_kernel = _KERNELS[_name]
    _lib.define(_schema)
    _lib.impl(_name, _cuda_kernel, "CUDA")
    _lib.impl(_name, _cpu_kernel, "CPU")
    torch.library.register_fake(f"cupynorm::{_name}", _fake_kernel, lib=_lib)

_torch_ops = torch.ops.cupynorm
group_norm_fwd_op = _torch_ops.group_norm_fwd.default
group_norm_bwd_op = _torch_ops.group_norm_bwd.default
instance_norm_fwd_op = _torch_ops.instance_norm_fwd.default
batch_norm_fwd_op = _torch_ops.batch_norm_fwd.default
batch_norm_bwd_op = _torch_ops.batch_norm_bwd.default
row_norm_add_mul_fwd_op = _torch_ops.row_norm_add_mul_fwd.default
row_norm_add_mul_bwd_op = _torch_ops.row_norm_add_mul_bwd.default

torch.library.register_autograd(
    "cupynorm::group_norm_fwd",
    _make_group_norm_backward(group_norm_bwd_op, 5, 2),
    setup_context=_group_norm_setup,
    lib=_lib,
)
torch.library.register_autograd(
    "cupynorm::instance_norm_fwd",
    _make_group_norm_backward(group_norm_bwd_op, 7, 1),
    setup_context=_instance_norm_setup,
    lib=_lib,
)
torch.library.register_autograd(
    "cupynorm::batch_norm_fwd",
    _make_batch_norm_backward(batch_norm_bwd_op),
    setup_context=_batch_norm_setup,
    lib=_lib,
)
torch.library.register_autograd(
    "cupynorm::row_norm_add_mul_fwd",
    _make_row_norm_add_mul_backward(row_norm_add_mul_bwd_op),
    setup_context=_row_norm_add_mul_setup,
    lib=_lib,
)


# ---------------------------------------------------------------------------------------------
# eager fast path: autograd.Functions over the same kernels, setup_context and backward math
# ---------------------------------------------------------------------------------------------
# Old-style forward(ctx, ...): a Function that defines setup_context pays for an
# inspect.signature() bind on every apply (measured: +13 us per call on the dev machine's CPU).
class _GroupNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps):
        output = _group_norm_fwd(x, num_groups, weight, bias, eps)
        _group_norm_setup(ctx, (x, num_groups, weight, bias, eps), output)
        return output

    backward = staticmethod(once_differentiable(_make_group_norm_backward(_group_norm_bwd, 5, 2)))


class _InstanceNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        inputs = (x, weight, bias, running_mean, running_var, momentum, eps)
        output = _instance_norm_fwd(*inputs)
        _instance_norm_setup(ctx, inputs, output)
        return output

    backward = staticmethod(once_differentiable(_make_group_norm_backward(_group_norm_bwd, 7, 1)))


class _BatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
        inputs = (x, weight, bias, running_mean, running_var, training, momentum, eps)
        output = _batch_norm_fwd(*inputs)
        _batch_norm_setup(ctx, inputs, output)
        return output

    backward = staticmethod(once_differentiable(_make_batch_norm_backward(_batch_norm_bwd)))


class _RowNormAddMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, eps):
        output = _row_norm_add_mul_fwd(x, y, eps)
        _row_norm_add_mul_setup(ctx, (x, y, eps), output)
        return output

    backward = staticmethod(
        once_differentiable(_make_row_norm_add_mul_backward(_row_norm_add_mul_bwd))
    )


_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def _traced(x: Tensor) -> bool:
    """True when the call must go through the dispatcher (the custom op) rather than eager:
    compiling/exporting, a tensor subclass (FakeTensor, ...) or a TorchDispatchMode."""
    return _is_compiling() or type(x) is not Tensor or _dispatch_stack_len() != 0


def _wants_grad(x: Tensor, a: Tensor | None, b: Tensor | None) -> bool:
    return torch.is_grad_enabled() and (
        x.requires_grad
        or (a is not None and a.requires_grad)
        or (b is not None and b.requires_grad)
    )


def _apply_group_norm(x, num_groups, weight, bias, eps) -> Tensor:
    if _traced(x):
        return group_norm_fwd_op(x, num_groups, weight, bias, eps)[0]
    if _wants_grad(x, weight, bias):
        return _GroupNormFunction.apply(x, num_groups, weight, bias, eps)[0]
    return _group_norm_output(x, num_groups, weight, bias, eps)


def _apply_instance_norm(x, weight, bias, running_mean, running_var, momentum, eps) -> Tensor:
    args = (x, weight, bias, running_mean, running_var, momentum, eps)
    if _traced(x):
        y, _mean, _rstd, new_mean, new_var = instance_norm_fwd_op(*args)
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
        return y
    if _wants_grad(x, weight, bias):
        return _InstanceNormFunction.apply(*args)[0]
    return _instance_norm_fwd(*args)[0]


def _apply_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    args = (x, weight, bias, running_mean, running_var, training, momentum, eps)
    if _traced(x):
        y, _mean, _rstd, new_mean, new_var = batch_norm_fwd_op(*args)
        if new_mean is not None:
            running_mean.copy_(new_mean)
        if new_var is not None:
            running_var.copy_(new_var)
        return y
    if _wants_grad(x, weight, bias):
        return _BatchNormFunction.apply(*args)[0]
    return _batch_norm_fwd(*args)[0]


def _apply_row_norm_add_mul(x, y, eps) -> Tensor:
    if _traced(x):
        return row_norm_add_mul_fwd_op(x, y, eps)[0]
    if _wants_grad(x, y, None):
        return _RowNormAddMulFunction.apply(x, y, eps)[0]
    return _row_norm_add_mul_fwd(x, y, eps)[0]


# ---------------------------------------------------------------------------------------------
# routing (the host code validates nothing: _checks does, on the kernel route)
# ---------------------------------------------------------------------------------------------
def _use_kernels(x: Tensor) -> bool:
    """Whether the functional API runs cupynorm's kernels on ``x`` (else torch.nn.functional).

    CUDA tensors only; CPU tests patch this to run the whole stack on the reference kernels.
    """
    return x.is_cuda


# ---------------------------------------------------------------------------------------------
# functional API
# ---------------------------------------------------------------------------------------------
def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Group normalization (:func:`torch.nn.functional.group_norm`) on cupynorm's kernels.

    The ``C`` channels are split into ``num_groups`` groups; each group of each sample is
    normalized over its ``C / G * prod(spatial)`` values:

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    with the biased variance; :math:`\gamma` (``weight``) and :math:`\beta` (``bias``) are per
    channel. Statistics are accumulated in float32 (float64 for float64 input). Under CUDA
    autocast the computation runs in float32, as torch's ``group_norm`` does.

    Args:
        input: tensor of shape :math:`(N, C, *)`; CUDA tensors (float16, bfloat16, float32,
            float64; contiguous or channels_last, other strides are copied) run on cupynorm's
            kernels, tensors on other devices through :func:`torch.nn.functional.group_norm`.
        num_groups: number of groups ``G``; must divide ``C``.
        weight: per-channel scale :math:`\gamma` of shape :math:`(C,)`, or None.
        bias: per-channel shift :math:`\beta` of shape :math:`(C,)`, or None.
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)`, same memory format as the input (contiguous or
          channels_last)

    Example::

        >>> x = torch.randn(2, 6, 5, 7, device="cuda", requires_grad=True)
        >>> y = cupynorm.torch.group_norm(x, 3)
        >>> y.sum().backward()
    """
    _checks.check_tensor("group_norm", "input", input)
    if not _use_kernels(input):
        return F.group_norm(input, num_groups, weight, bias, eps)
    _checks.check_group_norm(input, num_groups, weight, bias, eps)
    if torch.is_autocast_enabled():  # torch's autocast runs group_norm in float32
        input = input.float()
        weight = None if weight is None else weight.float()
        bias = None if bias is None else bias.float()
    return _apply_group_norm(input, num_groups, weight, bias, eps)


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
    if not _use_kernels(input):
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


def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    r"""Batch normalization (:func:`torch.nn.functional.batch_norm`) on cupynorm's kernels.

    Each channel is normalized over the batch and spatial dimensions
    (``N * prod(spatial)`` values):

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    In training the batch statistics are used (biased variance) and the running statistics, if
    given, are updated in place with the unbiased variance:
    :math:`r \leftarrow (1 - \text{momentum})\, r + \text{momentum} \cdot \text{stat}`. In eval
    the running statistics are used.

    Args:
        input: tensor of shape :math:`(N, C, *)`; CUDA tensors run on cupynorm's kernels,
            tensors on other devices through :func:`torch.nn.functional.batch_norm`.
        running_mean: running mean of shape :math:`(C,)`, or None (training only).
        running_var: running variance of shape :math:`(C,)`, or None (training only).
        weight: per-channel scale :math:`\gamma` of shape :math:`(C,)`, or None.
        bias: per-channel shift :math:`\beta` of shape :math:`(C,)`, or None.
        training: use batch statistics and update the running ones. Default: ``False``
        momentum: weight of the batch statistics in the running update. Default: 0.1
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)`, same memory format as the input

    Example::

        >>> x = torch.randn(8, 3, 7, 7, device="cuda")
        >>> mean, var = torch.zeros(3, device="cuda"), torch.ones(3, device="cuda")
        >>> y = cupynorm.torch.batch_norm(x, mean, var, training=True)
    """
    _checks.check_tensor("batch_norm", "input", input)
    if not _use_kernels(input):
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    _checks.check_batch_norm(
        input, running_mean, running_var, weight, bias, training, momentum, eps
    )
    return _apply_batch_norm(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )


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
    if not _use_kernels(x):
        xhat = F.layer_norm(x, (x.shape[-1],), eps=eps)
        return (xhat + y) * y
    _checks.check_kernel_inputs("row_norm_add_mul", x, y)
    return _apply_row_norm_add_mul(x, y, eps)
