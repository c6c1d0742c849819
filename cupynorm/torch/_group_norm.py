r"""Group norm, plain and fused with an activation (``act(group_norm(x + shift))``):
everything of the family from its kernels on each device to the public functionals.

Math, x viewed as (N, G, M) with M = C/G * prod(spatial); per (n, g)::

    mean = sum(x) / M,  var = sum((x - mean)^2) / M,  rstd = 1 / sqrt(var + eps)
    xhat = (x - mean) * rstd,  y = xhat * weight[c] + bias[c]
    backward, with gx = dy * weight[c] and <.> the mean over the group:
    dx = rstd * (gx - <gx> - xhat * <gx * xhat>)
    dweight[c] = sum_{n, spatial} dy * xhat,  dbias[c] = sum_{n, spatial} dy

The fused op: y = act(t), t = group_norm(x) in float32, one rounding; the backward recomputes t
from x and the statistics: dt = dy * act'(t) (rounded to x's dtype), then the group norm
backward on dt. With a shift (N, C) (a diffusion block's time embedding), x + shift[n, c] is
normalized (the sum in float32 inside the kernels, never stored) and dx is its gradient; the
shift's own gradient is dx summed over the spatial dims (the backwards here).

Custom ops (``torch.ops.cupynorm.*``)::

    group_norm_fwd(x, num_groups, weight?, bias?, eps, out_float32=False) -> (y, mean, rstd)
        # out_float32: y in float32 beside a half-precision x (autocast's float32 norm)
    group_norm_bwd(dy, x, mean, rstd, weight?, num_groups, output_mask)
        -> (dx?, dweight?, dbias?)
    group_norm_act_fwd(x, num_groups, weight?, bias?, eps, act, shift?=None, out_float32=False)
        -> (y, mean, rstd)
    group_norm_act_bwd(dy, x, mean, rstd, weight?, bias?, num_groups, output_mask, act,
                       shift?=None) -> (dx?, dweight?, dbias?)

Top to bottom: the kernels (``_*_cuda`` call the host code :mod:`cupynorm._ops`, the reference
kernels of :mod:`._reference` run on the CPU, ``_*_fake`` are the fake kernels), the ops, their
autograd (setup_context and backward), the eager Functions (``autograd.Function``), the
replay's save, grads and entry (:mod:`._replay`), the route, the public functionals. Instance
norm (group norm with G = C, plus running statistics) is :mod:`._instance_norm`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from cupynorm import _program

from . import _checks, _higher_order, _library, _replay
from ._autograd import _bound_forward, _EagerFunction, _made_backward
from ._policy import inductor_takes
from ._reference import (
    ACTIVATIONS,
    _group_norm_act_bwd_reference,
    _group_norm_bwd_reference,
    _group_norm_fwd_reference,
    _layout,
    _stat_dtype,
)
from ._replay import Token, unwrap
from ._route import (
    _HALF,
    _kernel_tensors,
    _replay_candidate,
    _traced,
    _use_kernels,
    _wants_grad,
)
from ._tensors import _dense, _empty_out, _finish_bwd, _host, _norm_bwd_fake, _vec


# ---------------------------------------------------------------------------------------------
# kernels on each device
# ---------------------------------------------------------------------------------------------
def _group_norm_fwd_op_args(x, num_groups, weight, bias, eps, act, shift, want_stats,
                            out_float32=False) -> tuple:  # fmt: skip
    """(args, kwargs) of the host op group_norm_fwd: plain group norm (``act`` None) or the
    fused op (also the replay's call key: :func:`_replay_group_norm`); ``out_float32``: y in
    float32 beside a half-precision x (autocast)."""
    kwargs = {"want_stats": want_stats}
    if out_float32:
        kwargs["out_dtype"] = "float32"
    if act is None:
        return (x, num_groups, weight, bias, eps), kwargs
    kwargs["act"] = act
    return (x, num_groups, weight, bias, eps, shift), kwargs


def _group_norm_fwd_cuda(
    x: Tensor,
    num_groups: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    out_float32: bool = False,
    want_stats: bool = True,
):
    """The op's CUDA kernel: (y, mean, rstd); ``out_float32``: y in float32 beside a half x;
    without ``want_stats`` (no autograd) mean and rstd are None and the kernels skip them where
    they can."""
    return _group_norm_act_fwd_cuda(x, num_groups, weight, bias, eps, None, None, out_float32,
                                    want_stats)  # fmt: skip


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


def _group_norm_act_fwd_cuda(x, num_groups, weight, bias, eps, act, shift=None, out_float32=False,
                             want_stats=True):  # fmt: skip
    """(y, mean, rstd) of the fused op (``act`` None: plain group norm, the host op's plain
    call); ``out_float32``: y in float32 beside a half-precision x; without ``want_stats`` mean
    and rstd may be None."""
    x, fmt = _dense(x)
    # fmt: off
    args, kwargs = _group_norm_fwd_op_args(x, num_groups, _vec(weight), _vec(bias), eps, act,
                                           _vec(shift), want_stats, out_float32)
    # fmt: on
    y, mean, rstd = _host().group_norm_fwd(*args, **kwargs)
    return y.contiguous(memory_format=fmt), mean, rstd


def _group_norm_act_bwd_cuda(
    dy, x, mean, rstd, weight, bias, num_groups, output_mask, act, shift=None
):
    x, fmt = _dense(x)
    dy = dy.contiguous(memory_format=fmt)
    mask = tuple(output_mask)
    # fmt: off
    dx, dweight, dbias = _host().group_norm_act_bwd(dy, x, mean, rstd, _vec(weight), _vec(bias),
                                                    num_groups, mask, act, _vec(shift))
    # fmt: on
    return _finish_bwd(dx, dweight, dbias, x, weight, fmt, mask)


def _group_norm_fwd(x, num_groups, weight, bias, eps, out_float32=False):
    if x.is_cuda:
        return _group_norm_act_fwd_cuda(x, num_groups, weight, bias, eps, None, None, out_float32)
    return _group_norm_fwd_reference(x, num_groups, weight, bias, eps, out_float32=out_float32)


def _group_norm_output(x, num_groups, weight, bias, eps, out_float32=False) -> Tensor:
    """y alone (no autograd)."""
    if x.is_cuda:
        # fmt: off
        return _group_norm_act_fwd_cuda(x, num_groups, weight, bias, eps, None, None,
                                        out_float32, False)[0]
        # fmt: on
    return _group_norm_fwd_reference(x, num_groups, weight, bias, eps, out_float32=out_float32)[0]


def _group_norm_bwd(dy, x, mean, rstd, weight, num_groups, output_mask):
    if x.is_cuda:
        return _group_norm_bwd_cuda(dy, x, mean, rstd, weight, num_groups, output_mask)
    return _group_norm_bwd_reference(dy, x, mean, rstd, weight, num_groups, output_mask)


def _group_norm_act_fwd(x, num_groups, weight, bias, eps, act, shift=None, out_float32=False):
    if x.is_cuda:
        return _group_norm_act_fwd_cuda(x, num_groups, weight, bias, eps, act, shift, out_float32)
    return _group_norm_fwd_reference(x, num_groups, weight, bias, eps, act=act, shift=shift,
                                     out_float32=out_float32)  # fmt: skip


def _group_norm_act_output(x, num_groups, weight, bias, eps, act, shift=None,
                           out_float32=False) -> Tensor:  # fmt: skip
    """y alone (no autograd)."""
    if x.is_cuda:
        # fmt: off
        return _group_norm_act_fwd_cuda(x, num_groups, weight, bias, eps, act, shift,
                                        out_float32, False)[0]
        # fmt: on
    return _group_norm_fwd_reference(x, num_groups, weight, bias, eps, act=act, shift=shift,
                                     out_float32=out_float32)[0]  # fmt: skip


def _group_norm_act_bwd(dy, x, mean, rstd, weight, bias, num_groups, output_mask, act, shift=None):
    args = (dy, x, mean, rstd, weight, bias, num_groups, output_mask, act, shift)
    if x.is_cuda:
        return _group_norm_act_bwd_cuda(*args)
    return _group_norm_act_bwd_reference(*args)


def _group_norm_fwd_reference_op(x, num_groups, weight, bias, eps, out_float32=False):
    """The op's CPU kernel."""
    return _group_norm_fwd_reference(x, num_groups, weight, bias, eps, out_float32=out_float32)


def _group_norm_act_fwd_reference_op(x, num_groups, weight, bias, eps, act, shift=None,
                                     out_float32=False):  # fmt: skip
    """The op's CPU kernel."""
    # fmt: off
    return _group_norm_fwd_reference(x, num_groups, weight, bias, eps, act=act, shift=shift,
                                     out_float32=out_float32)
    # fmt: on


def _group_norm_fwd_fake(x, num_groups, weight, bias, eps, out_float32=False):
    stats = x.new_empty((x.shape[0], num_groups), dtype=_stat_dtype(x.dtype))
    return _empty_out(x, out_float32), stats, torch.empty_like(stats)


def _group_norm_act_fwd_fake(x, num_groups, weight, bias, eps, act, shift=None, out_float32=False):
    return _group_norm_fwd_fake(x, num_groups, weight, bias, eps, out_float32)


def _group_norm_act_bwd_fake(
    dy, x, mean, rstd, weight, bias, num_groups, output_mask, act, shift=None
):
    return _norm_bwd_fake(dy, x, mean, rstd, weight, num_groups, output_mask)


# ---------------------------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------------------------
group_norm_fwd_op = _library.define(
    "group_norm_fwd(Tensor x, int num_groups, Tensor? weight, Tensor? bias, float eps,"
    " bool out_float32=False) -> (Tensor, Tensor, Tensor)",
    _group_norm_fwd_cuda,
    _group_norm_fwd_reference_op,
    _group_norm_fwd_fake,
    any_layout=True,
)
group_norm_bwd_op = _library.define(
    "group_norm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? weight,"
    " int num_groups, bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)",
    _group_norm_bwd_cuda,
    _group_norm_bwd_reference,
    _norm_bwd_fake,
    any_layout=True,
)
group_norm_act_fwd_op = _library.define(
    "group_norm_act_fwd(Tensor x, int num_groups, Tensor? weight, Tensor? bias, float eps,"
    " str act, Tensor? shift=None, bool out_float32=False) -> (Tensor, Tensor, Tensor)",
    _group_norm_act_fwd_cuda,
    _group_norm_act_fwd_reference_op,
    _group_norm_act_fwd_fake,
    any_layout=True,
)
group_norm_act_bwd_op = _library.define(
    "group_norm_act_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? weight,"
    " Tensor? bias, int num_groups, bool[3] output_mask, str act, Tensor? shift=None)"
    " -> (Tensor?, Tensor?, Tensor?)",
    _group_norm_act_bwd_cuda,
    _group_norm_act_bwd_reference,
    _group_norm_act_bwd_fake,
    any_layout=True,
)


# ---------------------------------------------------------------------------------------------
# autograd: setup_context + backward, shared by the custom ops and the eager Functions.
# `bwd` is the backward op (traceable, for the custom ops) or the kernel itself (eager).
# ---------------------------------------------------------------------------------------------
def _group_norm_setup(ctx, inputs, output) -> None:
    x, num_groups, weight = inputs[:3]  # [..., bias, eps, out_float32]
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.num_groups = num_groups
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _group_norm_act_setup(ctx, inputs, output) -> None:
    # the activation's gradient recomputes its input from x (+ shift), the statistics, weight
    # and bias
    x, num_groups, weight, bias, _eps, act, *rest = inputs
    shift = rest[0] if rest else None
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias if act != "identity" else None, mean, rstd, shift)
    ctx.num_groups, ctx.act = num_groups, act
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


def _make_group_norm_act_backward(bwd):
    def backward(ctx, dy, *_stat_grads):
        needs = ctx.needs_input_grad
        if dy is None:
            return (None,) * len(needs)
        x, weight, bias, mean, rstd, shift = ctx.saved_tensors
        # the shift's gradient is that of x + shift summed over the spatial dims
        dshift_needed = len(needs) > 6 and needs[6]
        mask = [needs[0] or dshift_needed, needs[2], needs[3]]
        # fmt: off
        dx, dweight, dbias = bwd(dy, x, mean, rstd, weight, bias, ctx.num_groups, mask,
                                 ctx.act, shift)
        # fmt: on
        grads = [dx if needs[0] else None, None, dweight, dbias, None, None]
        if len(needs) > 6:
            grads.append(dx.sum(dim=tuple(range(2, dx.dim()))) if dshift_needed else None)
        return (*grads, *(None,) * (len(needs) - len(grads)))  # [out_float32]

    return backward


_library.register_autograd(
    group_norm_fwd_op,
    _made_backward(
        _make_group_norm_backward, group_norm_bwd_op, _higher_order.group_norm_bwd, 6, 2
    ),
    _group_norm_setup,
)
_library.register_autograd(
    group_norm_act_fwd_op,
    _made_backward(
        _make_group_norm_act_backward, group_norm_act_bwd_op, _higher_order.group_norm_act_bwd
    ),
    _group_norm_act_setup,
)


# ---------------------------------------------------------------------------------------------
# eager Functions
# ---------------------------------------------------------------------------------------------
# Old-style forward(ctx, ...): a Function that defines setup_context pays for an
# inspect.signature() bind on every apply (measured: +13 us per call on the dev machine's CPU).
class _GroupNormFunction(_EagerFunction):
    # out_float32: y in float32 beside a half x (autocast); dy's dtype tells the backward
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps, out_float32=False):
        output = _group_norm_fwd(x, num_groups, weight, bias, eps, out_float32)
        _group_norm_setup(ctx, (x, num_groups, weight, bias, eps), output)
        return output

    backward = staticmethod(
        _made_backward(
            _make_group_norm_backward, _group_norm_bwd, _higher_order.group_norm_bwd, 6, 2
        )
    )


class _GroupNormActFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps, act, shift, out_float32=False):
        output = _group_norm_act_fwd(x, num_groups, weight, bias, eps, act, shift, out_float32)
        _group_norm_act_setup(ctx, (x, num_groups, weight, bias, eps, act, shift), output)
        return output

    backward = staticmethod(
        _made_backward(
            _make_group_norm_act_backward, _group_norm_act_bwd, _higher_order.group_norm_act_bwd
        )
    )


# ---------------------------------------------------------------------------------------------
# replayed eager calls (cupynorm.torch._replay)
# ---------------------------------------------------------------------------------------------
def _group_norm_replay_save(ctx, call, x, weight, bias, shift, outputs):
    """Group norm, ``call.info`` (num_groups, act: None for plain group norm, else the fused
    op's activation): y; saved as :class:`_GroupNormActFunction` saves."""
    y, mean, rstd = outputs
    ctx.num_groups, ctx.act = call.info
    needs_bias = ctx.act is not None and ctx.act != "identity"
    saved = (x, weight, bias if needs_bias else None, mean, rstd, shift)
    ctx.save_for_backward(*saved)
    ctx.bound = (call.program, *saved)
    ctx.grads = _group_norm_replay_grads
    return y


def _group_norm_replay_grads(ctx, dy):
    """(dx, dweight, dbias, dshift) of a replayed group norm: the backward op bound to the
    forward's program (the full path's when the saved tensors are not the forward's own)."""
    saved = ctx.saved_tensors
    forward = _bound_forward(ctx, saved)
    x, weight, bias, mean, rstd, shift = saved
    needs = ctx.needs_input_grad
    mask = (needs[0] or needs[3], needs[1], needs[2])  # the shift's gradient sums dx
    if ctx.act is None:
        args = (dy, x, mean, rstd, weight, ctx.num_groups, mask)
        full = _group_norm_bwd
    else:
        args = (dy, x, mean, rstd, weight, bias, ctx.num_groups, mask, ctx.act, shift)
        full = _group_norm_act_bwd
    if forward is None:
        dx, dweight, dbias = full(*args)
    else:
        host = _host()
        op = host.group_norm_bwd if ctx.act is None else host.group_norm_act_bwd
        dx, dweight, dbias = _program.call_bound(forward, op, args)
    dshift = dx.sum(dim=tuple(range(2, dx.dim()))) if needs[3] else None
    return (dx if needs[0] else None), dweight, dbias, dshift


_group_norm_replay_grads.composite = _higher_order.group_norm_replay_grads  # double backward


def _replay_group_norm(x, num_groups, weight, bias, eps, act, shift, origin, grad,
                       out_float32=False) -> tuple[Tensor | None, Token]:  # fmt: skip
    """Group norm (``act`` None) or ``act(group_norm(x + shift))`` replayed, as
    :func:`._batch_norm._replay_batch_norm`: the arguments those of the kernels (under autocast
    float32 copies of the parameters, of x too unless ``out_float32`` (y in float32 beside a
    half-precision x); the ``origin`` saying of what)."""
    x = unwrap(x)
    if grad:
        weight, bias, shift = (t if t is None else unwrap(t) for t in (weight, bias, shift))
    # fmt: off
    args, kwargs = _group_norm_fwd_op_args(x, num_groups, weight, bias, eps, act, shift, grad,
                                           out_float32)
    y, token = _replay.run("group_norm_fwd", args, kwargs, origin, grad, _group_norm_replay_save,
                           (num_groups, act), (x, weight, bias, shift))
    # fmt: on
    return (y[0] if y is not None and not grad else y), token


# ---------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------
def _apply_group_norm(x, num_groups, weight, bias, eps, out_float32=False) -> Tensor:
    if _traced(x):
        return group_norm_fwd_op(x, num_groups, weight, bias, eps, out_float32)[0]
    if _wants_grad(x, weight, bias):
        return _GroupNormFunction.run(x, num_groups, weight, bias, eps, out_float32)[0]
    return _group_norm_output(x, num_groups, weight, bias, eps, out_float32)


def _apply_group_norm_act(x, num_groups, weight, bias, eps, act, shift, out_float32=False):
    args = (x, num_groups, weight, bias, eps, act, shift)
    if _traced(x):
        return group_norm_act_fwd_op(*args, out_float32)[0]
    if _wants_grad(x, weight, bias) or (shift is not None and _wants_grad(shift, None, None)):
        return _GroupNormActFunction.run(*args, out_float32)[0]
    return _group_norm_act_output(*args, out_float32)


def _group_norm_route(input, num_groups, weight, bias, eps, activation, shift) -> Tensor:
    """The route of a group norm call on cupynorm's kernels, plain (``activation`` None) or
    fused: a replay of the same call checked before (:mod:`._replay`), else the checks, then
    the kernels, whose call may be replayed from then on. Under autocast the kernels take
    float32 copies of the parameters, as torch's autocast runs group_norm in float32: a
    half-precision input (and shift) is read as it is, y comes in float32 and dx in the input's
    dtype, traced calls too (the op takes the half input: no cast kernel before it, none after
    its backward)."""
    tensors = (input, shift, weight, bias)  # the first two: what the kernels may read as is
    autocast = torch.is_autocast_enabled()
    out_float32 = autocast and input.dtype in _HALF
    keep = 2 if out_float32 else 0
    replay = _replay_candidate(tensors)
    token = None
    if replay:
        tensors, origin = _kernel_tensors(tensors, None, autocast, keep)
        x, s, w, b = tensors
        # fmt: off
        y, token = _replay_group_norm(x, num_groups, w, b, eps, activation, s, origin,
                                      _wants_grad(x, w, b, s), out_float32)
        # fmt: on
        if y is not None:
            return y
    if activation is not None:
        _checks.check_epilogue("group_norm_act", input, None, activation)
        _checks.check_shift("group_norm_act", input, shift)
    _checks.check_group_norm(input, num_groups, weight, bias, eps)
    if not replay:
        tensors = _kernel_tensors(tensors, None, autocast, keep)[0]
    x, s, w, b = tensors
    if activation is None:
        y = _apply_group_norm(x, num_groups, w, b, eps, out_float32)
    else:
        y = _apply_group_norm_act(x, num_groups, w, b, eps, activation, s, out_float32)
    _replay.validated(token, _layout(x) is not None, (w, b, s))
    return y


# ---------------------------------------------------------------------------------------------
# functional API
# ---------------------------------------------------------------------------------------------
def _on_kernels(input: Tensor, kind: str) -> bool:
    """:func:`._route._use_kernels`, but dense channels_last input stays on the kernels at any
    size: torch's group norm would give it a contiguous output, the next layer a copy back.
    (Other strides are copied and come out contiguous either way: the size decides.)"""
    return _use_kernels(input, kind) or (
        input.is_cuda
        and _layout(input) not in (None, torch.contiguous_format)
        and not _higher_order.composite_only()
    )


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
    if not _on_kernels(input, "group_norm") or inductor_takes("group_norm", input):
        return F.group_norm(input, num_groups, weight, bias, eps)
    return _group_norm_route(input, num_groups, weight, bias, eps, None, None)


def group_norm_act(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    activation: str = "silu",
    shift: Tensor | None = None,
) -> Tensor:
    r"""Group normalization and an activation in one pass: ``activation(group_norm(input, ...))``,
    the norm-activation pair of the diffusion ResNet block.

    The arguments before ``activation`` are :func:`group_norm`'s. The activation runs in the
    normalize pass on the float32 value (one rounding, of the output); the backward recomputes
    the activation's input from ``input`` and the saved statistics and turns the incoming
    gradient into its gradient (rounded to the input's dtype, as the unfused activation's
    backward hands it to the norm) in the passes it makes anyway. On contiguous (NCHW) input
    whose groups fit on chip the forward reads ``input`` once and writes once; channels_last
    input and longer groups take the strided passes with the activation in the last one. Under
    CUDA autocast the computation runs in float32, as torch's ``group_norm`` then ``silu`` do.

    ``shift`` folds in the add before the norm of diffusers' ResnetBlock2D, its projected time
    embedding: ``activation(group_norm(input + shift[:, :, None, None], ...))`` for 4-D input
    (``shift[n, c]`` is added to every value of ``input[n, c]``, whatever the spatial dims). The
    kernels form the sum in float32 and never store it; torch's unfused add rounds it to the
    input's dtype and keeps it for the backward, so results agree within that rounding. The
    shift's gradient is the input gradient summed over the spatial dims.

    Args:
        activation: ``"silu"``, ``"relu"`` or ``"identity"``. Default: ``"silu"``
        shift: tensor of shape :math:`(N, C)` and the input's dtype and device, or None.
            Default: None

    Example::

        >>> x = torch.randn(2, 320, 64, 64, device="cuda", requires_grad=True)
        >>> y = cupynorm.torch.group_norm_act(x, 32)        # F.silu(F.group_norm(x, 32))
        >>> y.sum().backward()
        >>> temb = torch.randn(2, 320, device="cuda")
        >>> y = cupynorm.torch.group_norm_act(x, 32, shift=temb)  # of x + temb[:, :, None, None]
    """
    _checks.check_tensor("group_norm_act", "input", input)
    kernels = _on_kernels(input, "group_norm_act")
    if kernels and not inductor_takes("group_norm", input, "group_norm_act"):
        return _group_norm_route(input, num_groups, weight, bias, eps, activation, shift)
    _checks.check_epilogue("group_norm_act", input, None, activation)
    _checks.check_shift("group_norm_act", input, shift)
    if shift is not None:
        input = input + shift.reshape(*shift.shape, *([1] * (input.dim() - 2)))
    return ACTIVATIONS[activation](F.group_norm(input, num_groups, weight, bias, eps))
