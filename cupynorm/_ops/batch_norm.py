"""BatchNorm entries: the forward (training with the running statistics updated in the kernels,
or eval), optionally with a residual add and an activation fused into its apply pass; the backward,
plain or through that epilogue.

Training on channels-innermost data may take the single-launch family (:mod:`.._single`: the
forward when turned on, the backward where it pays), chosen here for both directions; everything
else is the strided family's passes. The synchronised batch norm's steps are in
:mod:`.sync_batch_norm`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _plan, _single
from .._launch import _STRIDED, _Call, _prepare, _scalar
from .._program import _programmed
from .._strided import (
    Epilogue,
    _apply,
    _backward,
    _backward_outputs,
    _finalize,
    _stats_cols,
    _stats_rows,
)
from ._common import _match_layout, _per_channel_layout


@_programmed
def batch_norm_fwd(
    x: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    training: bool,
    momentum: float,
    eps: float,
    residual: Any = None,
    act: str = "identity",
    batches_tracked: Any = None,
    keep_relu_mask: bool = False,
    running_mean_out: Any = None,
    running_var_out: Any = None,
) -> tuple:
    """y, save_mean (C,), save_rstd (C,) of BatchNorm over x (N, C, *spatial); with a residual
    and/or an activation ("relu", "silu") y = act(batch_norm(x) + residual), fused into the apply
    pass (residual: x's shape and dtype). In training, ``batches_tracked`` (a module's int64
    batch counter, one element, or None) is incremented by the kernel that updates the running
    statistics. ``keep_relu_mask`` (ReLU with a residual): a fourth output, the ReLU's mask for
    :func:`batch_norm_act_bwd` where the layout has one (``_strided._apply``), else None.
    ``running_mean_out`` / ``running_var_out`` (training; contiguous, the running statistics'
    shape and dtype): the updated statistics go there, the inputs stay as they are (a
    functional op's outputs, with no copy of the old statistics made first); default in
    place."""
    call = _Call(x, weight if weight is not None else bias)
    x, layout = _prepare(x, call.bk)
    epilogue = None
    if residual is not None or act != "identity":
        if residual is not None:
            residual = _match_layout(call, residual, x)
        epilogue = Epilogue(act, residual)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    y = call.bk.empty_strided_like(x)

    def outputs(mean: Any, rstd: Any, mask: Any = None) -> tuple:
        return (y, mean, rstd, mask) if keep_relu_mask else (y, mean, rstd)

    # running statistics the kernels update (or read) in place: those of the weight's type
    running = tuple(t for t in (running_mean, running_var) if t is not None)
    in_kernel = all(call.bk.dtype_name(t) == (call.param_dtype or call.dtype) for t in running)
    if training and not in_kernel:  # updated in place by torch/CuPy ops: on the copies
        for source, out in ((running_mean, running_mean_out), (running_var, running_var_out)):
            if out is not None:
                call.bk.copy_into(out, source)
        running_mean = running_mean if running_mean_out is None else running_mean_out
        running_var = running_var if running_var_out is None else running_var_out
        running_mean_out = running_var_out = None
    if not training:
        if in_kernel:
            mean, rstd = call.stats((C,), x), call.stats((C,), x)
            if C:
                # fmt: off
                call.launch(_STRIDED, "strided_norm_running_stats", -(-C // 256), (256,), (
                    call.ptr(running_mean), call.ptr(running_var), np.int64(C),
                    _scalar(call.acc, eps), call.ptr(mean), call.ptr(rstd)))
                # fmt: on
        else:
            mean = call.bk.astype(running_mean, call.acc)
            rstd = call.bk.rsqrt_plus(running_var, eps, call.acc)
        if _plan.prod(tuple(x.shape)):
            _apply(call, x, y, weight, bias, mean, rstd, layout, N, C, S, 0, 1, epilogue)
        return outputs(mean, rstd)
    mean, rstd = call.stats((C,), x), call.stats((C,), x)
    count = N * S
    if count * C == 0:
        call.bk.fill_nan(mean)
        call.bk.fill_nan(rstd)
        for source, out in ((running_mean, running_mean_out), (running_var, running_var_out)):
            if out is not None:  # nothing to update: the statistics as they were
                call.bk.copy_into(out, source)
        if batches_tracked is not None:
            call.bk.increment(batches_tracked)
        return outputs(mean, rstd)
    if batches_tracked is not None:
        call.mutates_inputs()  # a kernel below increments it
    if S == 1:
        layout = "channels_last"  # (N, C): channels innermost, one row per sample
    # fmt: off
    if layout != "contiguous" and in_kernel and epilogue is None and _single.batch_norm_fwd_cols(
            call, x, y, weight, bias, mean, rstd, running_mean, running_var, batches_tracked,
            momentum, eps, count, C, running_mean_out, running_var_out):
        if running:
            call.mutates_inputs()  # the kernel updated the running statistics
        return outputs(mean, rstd)
    # fmt: on
    var = call.stats((C,), x)
    if layout == "contiguous":
        partials = _stats_rows(call, x, C, N, S, C * S, S)
    else:
        partials = _stats_cols(call, x, 1, N * S, C, 0, 0, 1)
    if in_kernel:
        call.mutates_inputs()
        # fmt: off
        _finalize(call, x, partials, C, count, eps, mean, rstd, var, running_mean, running_var,
                  momentum, batches_tracked, running_mean_out, running_var_out)
        # fmt: on
    else:
        _finalize(call, x, partials, C, count, eps, mean, rstd, var,
                  batches_tracked=batches_tracked)  # fmt: skip
        if running_mean is not None:
            call.bk.update_running(running_mean, mean, momentum)
        if running_var is not None:
            unbiased = var * (count / (count - 1)) if count > 1 else var * float("nan")
            call.bk.update_running(running_var, unbiased, momentum)
    # fmt: off
    mask = _apply(call, x, y, weight, bias, mean, rstd, layout, N, C, S, 0, 1, epilogue,
                  keep_mask=keep_relu_mask)
    # fmt: on
    return outputs(mean, rstd, mask)


@_programmed
def batch_norm_bwd(
    dy: Any,
    x: Any,
    save_mean: Any,
    save_rstd: Any,
    weight: Any,
    training: bool,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple:
    """(dx, dweight, dbias) of batch_norm_fwd given its saved (C,) mean and rstd.

    In eval mode the statistics are constants, so dx = dy * rstd * weight.
    """
    # fmt: off
    return _batch_norm_backward(dy, x, save_mean, save_rstd, weight, training, needs_input_grad,
                                None, None, "identity")[:3]
    # fmt: on


@_programmed
def batch_norm_act_bwd(
    dy: Any,
    x: Any,
    save_mean: Any,
    save_rstd: Any,
    weight: Any,
    training: bool,
    needs_input_grad: tuple[bool, bool, bool, bool],
    residual: Any,
    bias: Any,
    act: str,
    relu_mask: Any = None,
) -> tuple:
    """(dx, dweight, dbias, dresidual) of batch_norm_fwd with a residual and/or an activation;
    needs_input_grad in that order.

    residual and bias are the forward's: the activation's input t = norm(x) + residual is
    recomputed. dt = dL/dt is the residual's gradient (written by the backward's first pass;
    with the identity it is dy itself); without a residual it is never stored. ``relu_mask``:
    the mask batch_norm_fwd kept (ReLU with a residual), read instead of recomputing t; residual
    may then be None.
    """
    # fmt: off
    dx, dweight, dbias, dt = _batch_norm_backward(dy, x, save_mean, save_rstd, weight, training,
                                                  needs_input_grad[:3], residual, bias, act,
                                                  relu_mask)
    # fmt: on
    return dx, dweight, dbias, dt if needs_input_grad[3] else None


def _batch_norm_backward(
    dy: Any,
    x: Any,
    save_mean: Any,
    save_rstd: Any,
    weight: Any,
    training: bool,
    needs_input_grad: tuple[bool, bool, bool],
    residual: Any,
    bias: Any,
    act: str,
    relu_mask: Any = None,
) -> tuple:
    """(dx, dweight, dbias, dt) of batch norm with the epilogue (act, residual, or the forward's
    ReLU mask); dt is dL/dt (dy itself for the identity, None when nothing stores it)."""
    call = _Call(x, weight)
    x, layout = _prepare(x, call.bk)
    dy = _match_layout(call, dy, x)
    N, C, S, layout = _per_channel_layout(x, layout)
    epilogue, dt = None, dy
    if act != "identity":
        dt = None
        if relu_mask is not None:  # the forward's mask stands for the residual (never read)
            if layout == "contiguous" or act != "relu":
                raise ValueError("a ReLU mask is kept for channels-innermost data with a ReLU")
            residual = None
            dt = call.bk.empty_strided_like(x)
        elif residual is not None:
            residual = _match_layout(call, residual, x)
            dt = call.bk.empty_strided_like(x)
        epilogue = Epilogue(act, residual, bias, dt, relu_mask)
    outputs = None
    if epilogue is None and layout != "contiguous" and N * C * S:
        # channels innermost: the single-launch family where it applies (_single), chosen here
        # as in the forward
        outputs = dx, dweight, dbias = _backward_outputs(call, x, weight, C, needs_input_grad)
        # fmt: off
        if _single.batch_norm_bwd_cols(call, dy, x, save_mean, save_rstd, weight, dx, dweight,
                                       dbias, N * S, C, training):
            return dx, dweight, dbias, dt
        # fmt: on
    # fmt: off
    dx, dweight, dbias = _backward(call, dy, x, save_mean, save_rstd, weight, layout, N, C, S, 0,
                                   1, training, needs_input_grad, epilogue, outputs=outputs)
    # fmt: on
    return dx, dweight, dbias, dt
