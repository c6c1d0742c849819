r"""LayerNorm and RMSNorm over the channels (dim 1) of (N, C, *), per sample and position (timm's
and torchvision's ``LayerNorm2d``, timm's ``RmsNorm2d``): everything of the family from its
kernels on each device to :func:`layer_norm2d` and :func:`rms_norm2d`.

The math is the row norm's over the C values of one sample and position (:mod:`._reference`).
y and dx keep x's memory format (contiguous, channels_last / channels_last_3d; other strides:
contiguous); mean/rstd are (N, *spatial), mean None for RMSNorm; dweight/dbias are (C,). On
channels_last input the host code normalizes the rows of the (N, *spatial, C) view, and a call
is replayed as the row norm of that view (:func:`._row_norm._replay_row_norm`); on NCHW input
as the channels family's call.

Custom ops (``torch.ops.cupynorm.*``)::

    channel_norm_fwd(x, weight?, bias?, eps, rms, out_float32=False)
        -> (y, mean?, rstd)          # LayerNorm / RMSNorm over dim 1, stats (N, *spatial)
    channel_norm_bwd(dy, x, mean?, rstd, weight?, output_mask) -> (dx?, dweight?, dbias?)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks, _higher_order, _library, _replay
from ._autograd import _EagerFunction, _kernel_backward
from ._policy import inductor_takes
from ._reference import (
    _channel_norm_bwd_reference,
    _channel_norm_fwd_reference,
    _layout,
    _param_dtype,
    _stat_dtype,
)
from ._replay import Token, unwrap
from ._route import (
    _AUTOCAST_RMS_NORM,
    _HALF,
    _default_rms_eps,
    _kernel_tensors,
    _replay_candidate,
    _traced,
    _use_kernels,
    _wants_grad,
)
from ._row_norm import _replay_row_norm
from ._tensors import _cast, _dense, _empty_out, _host, _vec


# ---------------------------------------------------------------------------------------------
# kernels on each device
# ---------------------------------------------------------------------------------------------
def _channel_norm_fwd_op_args(x, weight, bias, eps, rms, want_stats):
    """(args, kwargs) of the host op _channel_norm_fwd, the channels family's (NCHW input whose
    channels one CTA holds), as channel_norm_fwd calls it (its call key:
    :func:`_replay_channel_norm`)."""
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


# ---------------------------------------------------------------------------------------------
# custom ops and their autograd
# ---------------------------------------------------------------------------------------------
channel_norm_fwd_op = _library.define(
    "channel_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps, bool rms,"
    " bool out_float32=False) -> (Tensor, Tensor?, Tensor)",
    _channel_norm_fwd_cuda,
    _channel_norm_fwd_reference,
    _channel_norm_fwd_fake,
    any_layout=True,
)
channel_norm_bwd_op = _library.define(
    "channel_norm_bwd(Tensor dy, Tensor x, Tensor? mean, Tensor rstd, Tensor? weight,"
    " bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)",
    _channel_norm_bwd_cuda,
    _channel_norm_bwd_reference,
    _channel_norm_bwd_fake,
    any_layout=True,
)


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


_channel_norm_backward_composite = _make_channel_norm_backward(_higher_order.channel_norm_bwd)
_library.register_autograd(
    channel_norm_fwd_op,
    _kernel_backward(
        _make_channel_norm_backward(channel_norm_bwd_op), _channel_norm_backward_composite
    ),
    _channel_norm_setup,
)


# ---------------------------------------------------------------------------------------------
# eager Function
# ---------------------------------------------------------------------------------------------
class _ChannelNormFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, out_float32=False):
        output = _channel_norm_fwd(x, weight, bias, eps, rms, out_float32)
        _channel_norm_setup(ctx, (x, weight, bias, eps, rms), output)
        return output

    backward = staticmethod(
        _kernel_backward(
            _make_channel_norm_backward(_channel_norm_bwd), _channel_norm_backward_composite
        )
    )


# ---------------------------------------------------------------------------------------------
# replayed eager calls of NCHW input (cupynorm.torch._replay)
# ---------------------------------------------------------------------------------------------
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


_channel_norm_replay_grads.composite = _higher_order.channel_norm_replay_grads


def _replay_channel_norm(x, weight, bias, eps, rms, origin, grad) -> tuple[Tensor | None, Token]:
    """LayerNorm / RMSNorm over dim 1 of contiguous (NCHW) x by the channels family, replayed
    as :func:`._batch_norm._replay_batch_norm`. (channels_last input is the row norm of its
    channels-last view: :func:`._row_norm._replay_row_norm`.)"""
    x = unwrap(x)
    if grad:
        weight, bias = (t if t is None else unwrap(t) for t in (weight, bias))
    args, kwargs = _channel_norm_fwd_op_args(x, weight, bias, eps, rms, grad)
    # fmt: off
    y, token = _replay.run("_channel_norm_fwd", args, kwargs, origin, grad,
                           _channel_norm_replay_save, None, (x, weight, bias, None))
    # fmt: on
    return (y[0] if y is not None and not grad else y), token


# ---------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------
def _apply_channel_norm(x, weight, bias, eps, rms, out_float32=False) -> Tensor:
    if _traced(x):
        return channel_norm_fwd_op(x, weight, bias, eps, rms, out_float32)[0]
    if _wants_grad(x, weight, bias):
        return _ChannelNormFunction.run(x, weight, bias, eps, rms, out_float32)[0]
    return _channel_norm_output(x, weight, bias, eps, rms, out_float32)


def _over_channels(fn, input: Tensor, *args) -> Tensor:
    """``fn`` (F.layer_norm / F.rms_norm) over the last dim of the channels-last view, as timm's
    and torchvision's LayerNorm2d compute it, returned in the input's memory format."""
    rows = input.movedim(1, -1)
    y = fn(rows, (input.shape[1],), *args).movedim(-1, 1)
    fmt = _layout(input) or torch.contiguous_format
    return y.contiguous(memory_format=fmt)


def _size_kind(input: Tensor, row_kind: str) -> str:
    """The kind whose eager and capture sizes decide a channel norm call
    (:mod:`._policy`): on channels_last (or one-pixel) input the call is the row norm of the
    channels-last view on the kernels, and torch's route is that same single op
    (:func:`_over_channels`), so the row norm's (``row_kind``) decides; NCHW input, where torch
    has no single op, is the channel norms' own. (The view, not ``is_contiguous(memory_format=
    ...)``, which a ``vmap`` refuses: the check runs before the route knows of transforms.)"""
    if input.dim() >= 2 and input.movedim(1, -1).is_contiguous():
        return row_kind
    return "channel_norm"


def _channel_norm_route(name, torch_fn, input, weight, bias, eps, rms, to_float32) -> Tensor:
    """The route of a channel norm call on cupynorm's kernels (``eps`` None: RMSNorm's default).
    On channels_last (or one-pixel) input the kernels normalize the contiguous (N, *spatial, C)
    view's rows: such a call is replayed as that row norm's (:mod:`._replay`; the origin is the
    function's name: its checks are not layer_norm's over the same rows) once the full path --
    the checks, then the channel norm Function -- ran it; on NCHW input, as the channels
    family's call. Under autocast (``to_float32``) as layer_norm: a half-precision input whose
    rows the kernels read is read as is, y in float32; NCHW input takes float32 copies, made
    by torch's cast kernels (by Inductor's when traced), as torch's autocast does: measured
    faster than the conversions inside the host op (benchmarks/NOTES.md)."""
    rows = input.permute(0, *range(2, input.dim()), 1) if input.dim() >= 2 else input
    out_float32 = to_float32 and input.dtype in _HALF and rows.is_contiguous()
    token = None
    if input.dim() >= 2 and _replay_candidate((input, weight, bias)):
        key_eps = _default_rms_eps(input) if eps is None else eps
        if rows.is_contiguous():
            tensors = (rows, None, weight, bias)
            tensors, origin = _kernel_tensors(tensors, name, to_float32, int(out_float32))
            x, _r, w, b = tensors
            # fmt: off
            y, token = _replay_row_norm(x, None, w, b, (x.shape[-1],), key_eps, rms, False,
                                        origin, _wants_grad(x, w, b), out_float32)
            # fmt: on
            if y is not None:
                return y.permute(0, y.dim() - 1, *range(1, y.dim() - 1))
        elif input.is_contiguous():  # NCHW: the channels family
            tensors = (input, None, weight, bias)
            tensors, origin = _kernel_tensors(tensors, name, to_float32)
            x, _r, w, b = tensors
            grad = _wants_grad(x, w, b)
            y, token = _replay_channel_norm(x, w, b, key_eps, rms, origin, grad)
            if y is not None:
                return y
    _checks.check_channel_norm(name, torch_fn, input, weight, bias, eps, to_float32)
    if eps is None:
        eps = _default_rms_eps(input)
    tensors = _kernel_tensors((input, None, weight, bias), None, to_float32, int(out_float32))[0]
    input, _r, weight, bias = tensors
    y = _apply_channel_norm(input, weight, bias, eps, rms, out_float32)
    _replay.validated(token, True, (weight, bias))
    return y


# ---------------------------------------------------------------------------------------------
# functional API
# ---------------------------------------------------------------------------------------------
def layer_norm2d(
    input: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Layer normalization over the channels of :math:`(N, C, *)`, per sample and position:
    what timm's and torchvision's ``LayerNorm2d`` (ConvNeXt) compute.

    Each of the ``C`` values at one sample and spatial position is normalized over the channels:

    .. math::
        y_{n,c,s} = \frac{x_{n,c,s} - \mathrm{E}_c[x_{n,:,s}]}
            {\sqrt{\mathrm{Var}_c[x_{n,:,s}] + \epsilon}} * \gamma_c + \beta_c

    with the biased variance, accumulated in float32 (float64 for float64 input). That is
    :func:`torch.nn.functional.layer_norm` over ``(C,)`` of ``input.movedim(1, -1)``, moved back.
    Under CUDA autocast the computation runs in float32, as torch's ``layer_norm`` does.

    Args:
        input: tensor of shape :math:`(N, C, *)`; CUDA tensors (float16, bfloat16, float32,
            float64; contiguous or channels_last, other strides are copied) run on cupynorm's
            kernels, tensors on other devices through :func:`torch.nn.functional.layer_norm`.
        weight: per-channel scale :math:`\gamma` of shape :math:`(C,)` (the input's dtype or
            float32), or None.
        bias: per-channel shift :math:`\beta` of shape :math:`(C,)`, or None.
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)`, same memory format as the input (contiguous or
          channels_last)

    Example::

        >>> x = torch.randn(8, 96, 56, 56, device="cuda", requires_grad=True)
        >>> y = cupynorm.torch.layer_norm2d(x, torch.ones(96, device="cuda"))
        >>> y.sum().backward()
    """
    _checks.check_tensor("layer_norm2d", "input", input)
    if not _use_kernels(input, _size_kind(input, "layer_norm")) or inductor_takes(
        "channel_norm", input
    ):
        return _over_channels(F.layer_norm, input, weight, bias, eps)
    # fmt: off
    return _channel_norm_route("layer_norm2d", F.layer_norm, input, weight, bias, eps, False,
                               torch.is_autocast_enabled())  # as torch's autocast
    # fmt: on


def rms_norm2d(
    input: Tensor,
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    r"""Root-mean-square normalization over the channels of :math:`(N, C, *)`, per sample and
    position (timm's ``RmsNorm2d``; KernelBench level 1 problem 36 without a weight):

    .. math::
        y_{n,c,s} = \frac{x_{n,c,s}}{\sqrt{\mathrm{E}_c[x_{n,:,s}^2] + \epsilon}} * \gamma_c

    accumulated in float32 (float64 for float64 input): :func:`torch.nn.functional.rms_norm`
    over ``(C,)`` of ``input.movedim(1, -1)``, moved back. Under CUDA autocast the computation
    runs in float32, as :func:`rms_norm`'s.

    Args:
        input: tensor of shape :math:`(N, C, *)` (CUDA tensors as :func:`layer_norm2d`).
        weight: per-channel scale :math:`\gamma` of shape :math:`(C,)`, or None.
        eps: added to the mean square. Default: None, as torch: the machine epsilon of the type
            the norm computes in (float32; float64 for float64 input).

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)`, same memory format as the input

    Example::

        >>> x = torch.randn(16, 64, 256, 256, device="cuda")
        >>> y = cupynorm.torch.rms_norm2d(x, eps=1e-5)
    """
    _checks.check_tensor("rms_norm2d", "input", input)
    autocast = torch.is_autocast_enabled()
    if (
        not _use_kernels(input, _size_kind(input, "rms_norm"))
        or (autocast and not _AUTOCAST_RMS_NORM)
        or inductor_takes("channel_norm", input)
    ):
        return _over_channels(F.rms_norm, input, weight, eps)
    # fmt: off
    return _channel_norm_route("rms_norm2d", F.rms_norm, input, weight, None, eps, True,
                               autocast)  # as torch's autocast
    # fmt: on
