"""Autograd of the cupynorm ops: setup_context and backward, shared by the custom ops
(:mod:`._library`) and the eager ``autograd.Function`` fast path defined here.

The backward makers take ``bwd``: the backward op (traceable, for the custom ops) or the kernel
itself (eager). Old-style ``forward(ctx, ...)`` Functions: one that defines ``setup_context``
pays for an ``inspect.signature()`` bind on every ``apply`` (measured: +13 us per call on the dev
machine's CPU). Double backward is not supported: the backward is a kernel without a derivative
(``once_differentiable``).
"""

from __future__ import annotations

import functools

import torch
from torch._functorch.utils import unwrap_dead_wrappers
from torch.autograd.function import once_differentiable

from cupynorm import _program

from ._kernels import (
    _channel_norm_bwd,
    _channel_norm_fwd,
    _row_norm_add_mul_bwd,
    _row_norm_add_mul_fwd,
    _row_norm_bwd,
    _row_norm_fwd,
)
from ._tensors import _host

# ---------------------------------------------------------------------------------------------
# autograd: setup_context + backward, shared by the custom ops and the eager Functions.
# `bwd` is the backward op (traceable, for the custom ops) or the kernel itself (eager).
# ---------------------------------------------------------------------------------------------


# ---- the backward bound at forward time (eager Functions) ------------------------------------
# Everything in the backward's recorded-call key but dy is fixed by the forward: its input,
# weight and statistics are the tensors the backward gets (cupynorm._program.call_bound). The
# forward keeps its program and the tensors it saved; the backward binds when ctx.saved_tensors
# gives back those very objects (a saved-tensor hook gives others: then the full key), and drops
# them. The references are those the saved tensors hold anyway; none are kept while saved-tensor
# hooks are active (a checkpoint, offloading: the hooks exist to let the tensors go).
_default_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _hooks_active() -> bool:
    """Whether saved-tensor hooks are active (or torch cannot say)."""
    return _default_hooks is None or _default_hooks(False) is not None


def _keep_forward(ctx, program, saved: tuple) -> None:
    """Keep the forward's recorded program and saved tensors for the backward, if any (the
    eager backwards: :func:`_batch_norm_backward_eager`)."""
    ctx.bound = None if program is None or _hooks_active() else (program, *saved)


def _bound_forward(ctx, saved: tuple):
    """The forward's program :func:`_keep_forward` kept, when ``saved`` (``ctx.saved_tensors``)
    are the tensors it kept with it; else None. The kept references are dropped: a second
    backward (retain_graph) takes the full path."""
    kept, ctx.bound = ctx.bound, None
    if kept is not None and all(a is b for a, b in zip(kept[1:], saved, strict=True)):
        return kept[0]
    return None


def _row_norm_add_mul_setup(ctx, inputs, output) -> None:
    x, y, _eps = inputs
    _out, mean, rstd = output
    ctx.save_for_backward(x, y, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _row_norm_setup(ctx, inputs, output) -> None:
    # inputs: (x, residual, weight, bias, ndim, eps, rms[, cast[, out_float32]]); output: (y, sum,
    # mean, rstd). A float32 y beside a half x changes nothing here: dy's dtype tells the backward
    x, residual, weight, _bias, ndim, _eps, _rms = inputs[:7]
    _y, total, mean, rstd = output
    # the rows that were normalized: the sum when there is a residual
    ctx.save_for_backward(x if residual is None else total, weight, mean, rstd)
    ctx.ndim = ndim
    ctx.cast = bool(inputs[7]) if len(inputs) > 7 else False
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(*(t for t in (mean, rstd) if t is not None))
    ctx.set_materialize_grads(False)


def _make_row_norm_backward(bwd):
    """Backward of the row norm op: the gradient of the normalized rows (plus that of the sum,
    when the sum is an output) goes to x and to the residual alike."""

    def backward(ctx, dy, dsum, _dmean, _drstd):
        needs = ctx.needs_input_grad
        want_x = needs[0] or needs[1]
        normalized, weight, mean, rstd = ctx.saved_tensors
        dx = dweight = dbias = None
        if dy is not None:
            mask = [want_x, needs[2], needs[3]]
            if any(mask):
                dsum_x = dsum if want_x else None
                args = (dy, dsum_x, normalized, mean, rstd, weight, ctx.ndim, mask)
                dx, dweight, dbias = bwd(*args, ctx.cast) if ctx.cast else bwd(*args)
        elif want_x:
            dx = dsum
        return (
            dx if needs[0] else None,
            dx if needs[1] else None,
            dweight,
            dbias,
            None,
            None,
            None,
            None,
            None,
        )[: ctx.n_inputs]

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
# eager fast path: autograd.Functions over the same kernels, setup_context and backward math
# ---------------------------------------------------------------------------------------------
# Host time per call: torch's ``Function.apply`` is a Python classmethod that, before the C++
# apply, checks for a setup_context, asks whether a functorch transform is active and unwraps
# dead functorch wrappers; ``once_differentiable`` opens a no_grad context around a backward
# that autograd already runs with grad mode off. ``_EagerFunction.run`` calls the C++ apply
# itself (after the same unwrapping) when no transform is active, and ``_once_differentiable``
# calls the backward directly when grad mode is off; otherwise both are torch's own.
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_transforms_active = torch._C._are_functorch_transforms_active


class _EagerFunction(torch.autograd.Function):
    """Base of the eager Functions: ``Cls.run(*args)`` is ``Cls.apply(*args)``;
    ``Cls.c_apply(*args)`` is torch's C++ apply, for callers that checked for transforms and
    unwrapped dead wrappers themselves."""

    run: staticmethod
    c_apply: staticmethod

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        c_apply = _C_APPLY.__get__(None, cls)
        cls.c_apply = staticmethod(c_apply)
        apply = cls.apply

        def run(*args):
            if _transforms_active():
                return apply(*args)
            return c_apply(*unwrap_dead_wrappers(args))

        cls.run = staticmethod(run)


def _once_differentiable(fn):
    """torch's ``once_differentiable(fn)``, without its no_grad context when grad mode is off
    (every backward but one run with ``create_graph=True``, which gets torch's own)."""
    checked = once_differentiable(fn)

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        if torch.is_grad_enabled():
            return checked(ctx, *args)
        return fn(ctx, *args)

    return wrapper


# ---- replayed eager calls (cupynorm.torch._replay) --------------------------------------------
# A family's ``save(ctx, call, x, a, b, c, outputs)`` saves what its full Function saves (for the
# same backward), binds the backward to the forward's program (the replay's condition: no
# saved-tensor hooks) and returns the Function's outputs; ``ctx.grads(ctx, *grad_outputs)``
# gives the gradients of x, a, b, c. ``call.info``: the family's constants of the call.
class _ReplayFunction(_EagerFunction):
    """A replayed eager norm call: ``forward(ctx, x, a, b, c, call)`` runs ``call``'s recorded
    program and hands its outputs to ``call.save``, its family's (:mod:`._replay`)."""

    @staticmethod
    def forward(ctx, x, a, b, c, call):
        outputs = call.program.run(call.bk, call.device, call.tensors, call.pointers)
        return call.save(ctx, call, x, a, b, c, outputs)

    @staticmethod
    @_once_differentiable
    def backward(ctx, *grad_outputs):
        return (*ctx.grads(ctx, *grad_outputs), None)


def _channel_norm_replay_save(ctx, call, x, weight, bias, _none, outputs):
    """Channel norm of NCHW input (the channels family): y; saved as
    :class:`_ChannelNormFunction` saves. Its backward is the full path's (the backward's route
    may differ from the forward's: channel_norm_bwd)."""
    y, mean, rstd = outputs
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.grads = _channel_norm_replay_grads
    return y


def _channel_norm_replay_grads(ctx, dy):
    """(dx, dweight, dbias, None) of a replayed channel norm."""
    x, weight, mean, rstd = ctx.saved_tensors
    needs = ctx.needs_input_grad
    return (*_channel_norm_bwd(dy, x, mean, rstd, weight, [needs[0], needs[1], needs[2]]), None)


def _row_norm_replay_save(ctx, call, x, residual, weight, bias, outputs):
    """Row norm (LayerNorm / RMSNorm, after a residual add when ``residual`` is given),
    ``call.info`` (row length, cast, normalized shape): y, or (y, sum) with a residual; saved
    as :class:`_RowNormFunction` saves."""
    y, total, mean, rstd = outputs
    saved = (x if residual is None else total, weight, mean, rstd)
    ctx.save_for_backward(*saved)
    ctx.row = call.info
    ctx.bound = (call.program, *saved)
    ctx.grads = _row_norm_replay_grads
    if residual is None:
        return y
    ctx.set_materialize_grads(False)
    return y, total


def _row_norm_replay_grads(ctx, dy, dsum=None):
    """(dx, dresidual, dweight, dbias) of a replayed row norm: the gradient of the normalized
    rows (plus that of the sum) goes to x and the residual alike."""
    saved = ctx.saved_tensors
    forward = _bound_forward(ctx, saved)
    needs = ctx.needs_input_grad
    want_x = needs[0] or needs[1]
    dx = dweight = dbias = None
    if dy is not None:
        normalized, weight, mean, rstd = saved
        row_len, cast, dims = ctx.row
        mask = (want_x, needs[2], needs[3])
        dsum = dsum if want_x else None
        if forward is None or dsum is not None:  # a bound call's tensors are the forward's
            # fmt: off
            dx, dweight, dbias = _row_norm_bwd(dy, dsum, normalized, mean, rstd, weight, len(dims),
                                               mask, cast)
            # fmt: on
        else:
            args = (dy, dsum, normalized, mean, rstd, weight, row_len, mask, cast)
            dx, dweight, dbias = _program.call_bound(forward, _host().row_norm_bwd, args)
            if len(dims) > 1:  # the host op's are (row_len,)
                dweight = None if dweight is None else dweight.view(dims)
                dbias = None if dbias is None else dbias.view(dims)
    elif want_x:
        dx = dsum
    return (dx if needs[0] else None), (dx if needs[1] else None), dweight, dbias


class _RowNormAddMulFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, y, eps):
        output = _row_norm_add_mul_fwd(x, y, eps)
        _row_norm_add_mul_setup(ctx, (x, y, eps), output)
        return output

    backward = staticmethod(
        _once_differentiable(_make_row_norm_add_mul_backward(_row_norm_add_mul_bwd))
    )


class _RowNormFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False):
        inputs = (x, residual, weight, bias, ndim, eps, rms, cast, out_float32)
        output = _row_norm_fwd(*inputs)
        _row_norm_setup(ctx, inputs, output)
        return output

    backward = staticmethod(_once_differentiable(_make_row_norm_backward(_row_norm_bwd)))


# ---- channel norms (LayerNorm / RMSNorm over dim 1) ------------------------------------------
def _channel_norm_setup(ctx, inputs, output) -> None:
    # inputs: (x, weight, bias, eps, rms); output: (y, mean, rstd)
    x, weight = inputs[0], inputs[1]
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.mark_non_differentiable(*(t for t in (mean, rstd) if t is not None))
    ctx.set_materialize_grads(False)


def _make_channel_norm_backward(bwd):
    def backward(ctx, dy, _dmean, _drstd):
        needs = ctx.needs_input_grad
        nones = (None,) * (len(needs) - 3)  # eps, rms[, out_float32]
        if dy is None:
            return None, None, None, *nones
        x, weight, mean, rstd = ctx.saved_tensors
        mask = [needs[0], needs[1], needs[2]]
        if not any(mask):
            return None, None, None, *nones
        dx, dweight, dbias = bwd(dy, x, mean, rstd, weight, mask)
        return dx, dweight, dbias, *nones

    return backward


class _ChannelNormFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, out_float32=False):
        output = _channel_norm_fwd(x, weight, bias, eps, rms, out_float32)
        _channel_norm_setup(ctx, (x, weight, bias, eps, rms), output)
        return output

    backward = staticmethod(_once_differentiable(_make_channel_norm_backward(_channel_norm_bwd)))
