"""Framework-neutral host code: the entry of each op, which picks a kernel family and runs it.

(Past 600 lines because it holds one short entry per op -- group/instance, batch, fused batch,
row norms, the seed-002 tail, the synchronised batch norm's passes -- each a few lines of
choosing a family and allocating outputs; the families' own code is in their modules.)

The families mirror ``cuda_src/``: the on-chip segment family (:mod:`._segment`), the strided
rows/columns family (:mod:`._strided`); what every launch shares is in :mod:`._launch` and the
recording/replay of calls in :mod:`._program`.

Arguments are CuPy arrays or torch CUDA tensors (all of one kind per call), already validated by
the public layer. Outputs are allocated by the caller's framework and kernels run on that
framework's current stream. Statistics are float32 (float64 for float64 inputs). See
docs/internal-api.md for the contract.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _channel, _interop, _plan, _single
from ._launch import (
    _ITEMSIZE,
    _ROWS,
    _SEGMENT,
    _STRIDED,
    _SYNC,
    _Call,
    _prepare,
    _resident_grid,
    _scalar,
    _weight_grads,
)
from ._program import (
    _programmed,
)
from ._segment import (
    _instance_bwd_on_chip,
    _segment_launch,
)
from ._strided import (
    Epilogue,
    _apply,
    _backward,
    _bwd_dx,
    _bwd_finalize,
    _bwd_sums,
    _elementwise,
    _finalize,
    _stats_cols,
    _stats_rows,
)


# ---- group norm (instance norm is group norm with one channel per group) ----------------------
@_programmed
def group_norm_fwd(
    x: Any,
    num_groups: int,
    weight: Any,
    bias: Any,
    eps: float,
    shift: Any = None,
    *,
    want_var: bool = False,
    want_stats: bool = True,
    act: str = "identity",
    out_dtype: str | None = None,
) -> tuple:
    """y, mean (N, G), rstd (N, G)[, var (N, G)] of GroupNorm over x (N, C, *spatial).

    ``want_stats=False`` (inference): mean and rstd come back as None, and the on-chip kernels
    skip writing them (two allocations fewer per call). ``act`` ("relu", "silu"): y =
    act(group_norm(x)) in the same write (the on-chip segment kernel for SiLU, the fused apply
    pass of the strided family otherwise; see group_norm_act_bwd). ``shift`` ((N, C),
    contiguous, x's dtype): the norm is of s = x + shift[n, c] (a diffusion block's time
    embedding), the sum formed in float32 inside the kernels and never stored; the statistics
    are s's. ``out_dtype`` ("float32" beside a float16 / bfloat16 x): y in that dtype, the float32
    norm of x's values (GroupNorm under autocast), x read as it is by every kernel; the backward
    then takes dy in that dtype and gives dx in x's.
    """
    call = _Call(x, weight if weight is not None else bias)
    _set_out_dtype(call, out_dtype)
    x, layout = _prepare(x, call.bk)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    G, Cg = num_groups, x.shape[1] // num_groups
    y = call.bk.empty_strided_like(x, call.out_dtype)
    mean = rstd = None
    if want_stats:
        mean, rstd = call.stats((N, G), x), call.stats((N, G), x)
    var = call.stats((N, G), x) if want_var else None
    outputs = (y, mean, rstd, var) if want_var else (y, mean, rstd)
    if N * C * S == 0:
        for stat in outputs[1:]:
            if stat is not None:
                call.bk.fill_nan(stat)
        return outputs
    if layout == "contiguous":
        seg_len = Cg * S
        aligned = call.aligned(x, y)
        plan = _plan.plan_segment(seg_len, call.itemsize, aligned, call.info)
        if plan is not None and act in _SEGMENT_ACT_KERNELS:
            kernel = _SEGMENT_ACT_KERNELS[act] + ("_shift" if shift is not None else "")
            # fmt: off
            _segment_launch(call, plan, N * G, x, kernel, (
                call.ptr(x), call.ptr(y), call.ptr(weight), call.ptr(bias), call.ptr(mean),
                call.ptr(rstd), call.ptr(var), np.int32(seg_len), np.int32(plan.slice_len),
                np.int32(S), np.int32(Cg), np.int32(G), _scalar(call.acc, eps)),
                (call.ptr(shift),))
            # fmt: on
            return outputs
        if shift is None:
            partials = _stats_rows(call, x, N * G, 1, seg_len, 0, seg_len)
        else:  # runs of one channel each: the shift is per run
            partials = _stats_rows(call, x, N * G, Cg, S, S, seg_len, shift)
    else:
        partials = _stats_cols(call, x, N, S, C, S * C, G, Cg, shift)
    if mean is None:  # the apply pass reads them
        mean, rstd = call.stats((N, G), x), call.stats((N, G), x)
    _finalize(call, x, partials, N * G, Cg * S, eps, mean, rstd, var)
    epilogue = Epilogue(act) if act != "identity" else None
    _apply(call, x, y, weight, bias, mean, rstd, layout, N, C, S, G, Cg, epilogue, shift)
    return outputs


#: group_norm_fwd's on-chip segment kernel per activation (others take the strided passes)
_SEGMENT_ACT_KERNELS = {
    "identity": "segment_norm_fwd_affine",
    "silu": "segment_norm_fwd_affine_silu",
}


def _set_out_dtype(call: _Call, out_dtype: str | None) -> None:
    """The call's y (forward) or dy (backward) dtype: x's (None), or float32 beside a float16 /
    bfloat16 x (autocast's float32 norm of the half-precision values)."""
    if out_dtype is None or out_dtype == call.dtype:
        return
    if out_dtype != "float32" or call.itemsize != 2:
        raise ValueError(f"y and dy in {out_dtype} beside x in {call.dtype}: only float32 beside "
                         "a float16 or bfloat16 x (wider than x)")  # fmt: skip
    call.out_dtype = out_dtype


def _match_layout(call: _Call, t: Any, ref: Any) -> Any:
    """t laid out with ref's strides (a copy only when they differ), in t's dtype."""
    if tuple(call.bk.strides(t)) == tuple(call.bk.strides(ref)):
        return t
    out = call.bk.empty_strided_like(ref, call.bk.dtype_name(t))
    call.bk.copy_into(out, t)
    return out


@_programmed
def group_norm_bwd(
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    num_groups: int,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple:
    """(dx, dweight, dbias) of group_norm_fwd; mean/rstd are its (N, G) statistics.

    dweight and dbias come in the weight's dtype (float32/float64 accumulators when weight is None).
    dy in float32 beside a half-precision x: of the forward with that ``out_dtype``.
    """
    call = _Call(x, weight)
    _set_out_dtype(call, call.bk.dtype_name(dy))
    x, layout = _prepare(x, call.bk)
    dy = _match_layout(call, dy, x)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    G = num_groups
    same_dtype = call.out_dtype is None  # the on-chip instance kernel reads dy in x's dtype
    if same_dtype and layout == "contiguous" and G == C and needs_input_grad[0] and N * C * S > 0:
        on_chip = _instance_bwd_on_chip(call, dy, x, mean, rstd, weight, N, C, S, needs_input_grad)
        if on_chip is not None:
            return on_chip
    return _backward(
        call, dy, x, mean, rstd, weight, layout, N, C, S, G, C // G, True, needs_input_grad
    )


@_programmed
def group_norm_act_bwd(
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    bias: Any,
    num_groups: int,
    needs_input_grad: tuple[bool, bool, bool],
    act: str,
    shift: Any = None,
) -> tuple:
    """(dx, dweight, dbias) of group_norm_fwd with an activation ``act``: the strided backward
    with the fused epilogue, whose sums and dx passes each recompute t = group_norm(x) from x,
    the statistics, weight and bias and turn dy into dt = dy * act'(t) (rounded to x's dtype, as
    the unfused activation's backward hands it over); nothing of the forward's output is kept.

    With the forward's ``shift``, dx is the gradient of s = x + shift (also x's); the shift's
    own gradient, dx summed over the spatial dims, is the caller's to take. dy as in
    group_norm_bwd."""
    call = _Call(x, weight if weight is not None else bias)
    _set_out_dtype(call, call.bk.dtype_name(dy))
    x, layout = _prepare(x, call.bk)
    dy = _match_layout(call, dy, x)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    G = num_groups
    epilogue = Epilogue(act, None, bias) if act != "identity" else None
    # fmt: off
    return _backward(call, dy, x, mean, rstd, weight, layout, N, C, S, G, C // G, True,
                     needs_input_grad, epilogue, shift)
    # fmt: on


# ---- batch norm ---------------------------------------------------------------------------
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
    # fmt: off
    dx, dweight, dbias = _backward(call, dy, x, save_mean, save_rstd, weight, layout, N, C, S, 0,
                                   1, training, needs_input_grad, epilogue)
    # fmt: on
    return dx, dweight, dbias, dt


def _per_channel_layout(x: Any, layout: str) -> tuple[int, int, int, str]:
    """N, C, S of x (N, C, *spatial) and the layout of its per-channel passes ((N, C) and
    S == 1 data are channels innermost, one row per sample)."""
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    return N, C, S, "channels_last" if S == 1 else layout


# ---- the seed-002 tail: row norm, then (xhat + y) * y ---------------------------------------
@_programmed
def row_norm_add_mul_fwd(x: Any, other: Any, eps: float) -> tuple:
    """out = (xhat + other) * other with xhat the row-normalized x; returns (out, mean, rstd)."""
    call = _Call(x)
    x = call.bk.contiguous(x)
    other = call.bk.contiguous(other)
    D = x.shape[-1]
    rows = _plan.prod(tuple(x.shape[:-1]))
    out = call.bk.empty_strided_like(x)
    mean, rstd = call.stats(tuple(x.shape[:-1]), x), call.stats(tuple(x.shape[:-1]), x)
    if rows * D == 0:
        call.bk.fill_nan(mean)
        call.bk.fill_nan(rstd)
        return out, mean, rstd
    plan = _plan.plan_segment(D, call.itemsize, call.aligned(x, other, out), call.info)
    if plan is not None:
        # fmt: off
        _segment_launch(call, plan, rows, x, "segment_norm_fwd_add_mul", (
            call.ptr(x), call.ptr(other), call.ptr(out), call.ptr(mean), call.ptr(rstd),
            np.int32(D), np.int32(plan.slice_len), _scalar(call.acc, eps)))
        # fmt: on
        return out, mean, rstd
    # rows too long for chip memory: strided statistics, normalize, then the epilogue elementwise
    partials = _stats_rows(call, x, rows, 1, D, 0, D)
    _finalize(call, x, partials, rows, D, eps, mean, rstd, None)
    _apply(
        call,
        x.reshape(rows, 1, D),
        out.reshape(rows, 1, D),
        None,
        None,
        mean,
        rstd,
        "contiguous",
        rows,
        1,
        D,
        1,
        1,
    )
    call.opaque()
    out += other
    out *= other
    return out, mean, rstd


@_programmed
def row_norm_add_mul_bwd(dout: Any, x: Any, other: Any, mean: Any, rstd: Any) -> tuple:
    """(dx, dother) of row_norm_add_mul_fwd: out = xhat * r + r^2 with r = other, so
    dother = dout * (xhat + 2 r) and dxhat = dout * r, taken through the row norm's backward.

    One kernel when a row's (dxhat, xhat) fit in one CTA's shared memory; otherwise composed
    from elementwise operations and the strided backward.
    """
    call = _Call(x)
    bk = call.bk
    x, other, dout = bk.contiguous(x), bk.contiguous(other), bk.contiguous(dout)
    D = x.shape[-1]
    rows = _plan.prod(tuple(x.shape[:-1]))
    smem = 2 * D * _ITEMSIZE[call.acc]
    if rows * D > 0 and smem <= call.info.smem_optin - 1024:
        dx, dother = bk.empty_strided_like(x), bk.empty_strided_like(x)
        vectorized = D % call.vec == 0 and call.aligned(x, other, dout, dx, dother)
        packs = D // call.vec if vectorized else D
        wanted = min(1024, max(32, _plan.round_up(-(-packs // 4), 32)))
        threads = call.threads(_SEGMENT, "segment_norm_bwd_add_mul", wanted)
        # fmt: off
        call.launch(_SEGMENT, "segment_norm_bwd_add_mul", rows, (threads,), (
            call.ptr(x), call.ptr(other), call.ptr(dout), call.ptr(mean), call.ptr(rstd),
            call.ptr(dx), call.ptr(dother), np.int32(D), np.int32(vectorized)), smem=smem)
        # fmt: on
        return dx, dother
    xhat = (bk.astype(x, call.acc) - mean[..., None]) * rstd[..., None]
    dother = bk.astype(dout * (xhat + 2 * bk.astype(other, call.acc)), call.dtype)
    dxhat = bk.astype(bk.astype(dout, call.acc) * bk.astype(other, call.acc), call.dtype)
    dx = _backward(
        call,
        dxhat.reshape(rows, 1, D),
        x.reshape(rows, 1, D),
        mean,
        rstd,
        None,
        "contiguous",
        rows,
        1,
        D,
        1,
        1,
        True,
        (True, False, False),
    )[0]
    return dx.reshape(x.shape), dother


# ---- row norms: LayerNorm and RMSNorm over the last dims, optionally after a residual add -------
@_programmed
def row_norm_fwd(
    x: Any,
    residual: Any,
    weight: Any,
    bias: Any,
    row_len: int,
    eps: float,
    rms: bool,
    *,
    want_stats: bool = True,
    cast: bool = False,
    out_dtype: str | None = None,
) -> tuple:
    """(y, sum, mean, rstd) of LayerNorm (``rms=False``) or RMSNorm over rows of ``row_len``.

    x (and residual): contiguous, numel a multiple of row_len. With a residual, the normalized
    rows are s = x + residual (rounded to x's dtype) and ``sum`` is s, else None. weight/bias:
    row_len values (by position in the row) or None. mean, rstd: (rows,) in the accumulator's
    dtype; mean is None for RMSNorm, both None without ``want_stats`` (inference).
    ``cast`` (RMSNorm without bias): Hugging Face's LlamaRMSNorm numerics, the normalized value
    rounded to x's dtype before the weight multiplies it (the ROW_CAST epilogue).
    ``out_dtype`` ("float32" beside a float16 / bfloat16 x, no residual): y in that dtype, the
    norm of x's values as a float32 copy of x would give it (LayerNorm under autocast), in one
    pass over rows the short-row kernels take, on a copy otherwise. row_norm_bwd then takes dy
    in that dtype and gives dx in x's.
    """
    call = _Call(x, weight if weight is not None else bias)
    x = call.bk.contiguous(x)
    if out_dtype is not None and out_dtype != call.dtype:
        if residual is not None:
            raise ValueError("row_norm_fwd: out_dtype is wider than x's, with no residual")
        _set_out_dtype(call, out_dtype)
        if _plan.plan_short_rows(row_len, call.itemsize, call.aligned(x)) is None:
            x = _converted(call, x, out_dtype)  # the float32 path on a copy of x
            call = _Call(x, weight if weight is not None else bias)
    return _row_norm_fwd(call, x, residual, weight, bias, row_len, eps, rms, want_stats, cast)


def _converted(call: _Call, src: Any, dtype: str, into: Any = None) -> Any:
    """``src`` converted to ``dtype`` (into ``into`` when given): call.out_dtype from call.dtype
    (row_norm_to_out) or back (row_norm_from_out)."""
    out = call.bk.empty(tuple(src.shape), dtype, src) if into is None else into
    n = _plan.prod(tuple(src.shape))
    if n:
        kernel = "row_norm_to_out" if dtype == call.out_dtype else "row_norm_from_out"
        grid = min(-(-n // 256), 8 * call.info.sm_count)
        call.launch(_ROWS, kernel, grid, (256,), (call.ptr(src), call.ptr(out), np.int64(n)))
    return out


def _row_norm_fwd(
    call: _Call,
    x: Any,
    residual: Any,
    weight: Any,
    bias: Any,
    row_len: int,
    eps: float,
    rms: bool,
    want_stats: bool,
    cast: bool,
) -> tuple:
    """row_norm_fwd on contiguous x, whose ``call`` sets the output dtype."""
    bk = call.bk
    if residual is not None:
        residual = bk.contiguous(residual)
    D = row_len
    rows = _plan.prod(tuple(x.shape)) // D if D else 0
    if call.out_dtype is None:
        y = bk.empty_strided_like(x)
    else:
        y = bk.empty(tuple(x.shape), call.out_dtype, x)
    total = bk.empty_strided_like(x) if residual is not None else None
    need_mean = want_stats and not rms
    mean = call.stats((rows,), x) if need_mean else None
    rstd = call.stats((rows,), x) if want_stats else None
    if rows * D == 0:
        for stat in (mean, rstd):
            if stat is not None:
                bk.fill_nan(stat)
        return y, total, mean, rstd
    aligned = call.aligned(x, residual, total, y)
    short = _plan.plan_short_rows(D, call.itemsize, aligned)
    if short is not None:  # a group of lanes per row (row_norm.cu)
        kind = "rms_cast" if cast else "rms" if rms else "layer"
        # fmt: off
        call.launch(_ROWS, f"row_norm_fwd_short_{kind}_{short.lanes}",
                    -(-rows // short.rows_per_cta), (_plan.SHORT_ROW_THREADS,), (
            call.ptr(x), call.ptr(residual), call.ptr(total), call.ptr(y), call.ptr(weight),
            call.ptr(bias), call.ptr(mean), call.ptr(rstd), np.int64(rows), np.int32(D),
            _scalar(call.acc, eps)))
        # fmt: on
        return y, total, mean, rstd
    assert call.out_dtype is None, "row_norm_fwd planned a mixed output off the short rows"
    kernel = "segment_norm_fwd_rms" if rms else "segment_norm_fwd_layer"
    if cast:
        kernel = "segment_norm_fwd_rms_cast"
    plan = _plan.plan_segment(D, call.itemsize, aligned, call.info)
    if plan is not None:
        # fmt: off
        _segment_launch(call, plan, rows, x, kernel, (
            call.ptr(x), call.ptr(residual), call.ptr(total), call.ptr(y), call.ptr(weight),
            call.ptr(bias), call.ptr(mean), call.ptr(rstd), np.int32(D),
            np.int32(plan.slice_len), _scalar(call.acc, eps)))
        # fmt: on
        return y, total, mean, rstd
    # rows too long for a team: the sum by the framework, strided statistics, then the apply pass
    source = x
    if residual is not None:
        call.opaque()
        bk.copy_into(total, x + residual)
        source = total
    row_mean = mean if mean is not None else call.stats((rows,), x)
    row_rstd = rstd if rstd is not None else call.stats((rows,), x)
    var = call.stats((rows,), x) if rms else None
    partials = _stats_rows(call, source, rows, 1, D, 0, D)
    _finalize(call, source, partials, rows, D, eps, row_mean, row_rstd, var)
    if rms:
        # fmt: off
        call.launch(_SEGMENT, "segment_norm_rms_rstd", -(-rows // 256), (256,), (
            call.ptr(row_mean), call.ptr(var), call.ptr(row_rstd), np.int64(rows),
            _scalar(call.acc, eps)))
        # fmt: on
    tiles = _plan.plan_rows_tiles(D, call.itemsize, call.aligned(source, y))
    # fmt: off
    apply = "segment_norm_apply_rows_cast" if cast else "segment_norm_apply_rows"
    call.launch(_SEGMENT, apply, rows * tiles.tiles, (tiles.threads,), (
        call.ptr(source), call.ptr(y), call.ptr(weight), call.ptr(bias),
        call.ptr(None if rms else row_mean), call.ptr(row_rstd), np.int64(D),
        np.int64(tiles.tiles), np.int64(tiles.tile_len), np.int32(tiles.vectorized)))
    # fmt: on
    return y, total, mean, rstd


@_programmed
def row_norm_bwd(
    dy: Any,
    dsum: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    row_len: int,
    needs_input_grad: tuple[bool, bool, bool],
    cast: bool = False,
) -> tuple:
    """(dx, dweight, dbias) of row_norm_fwd over rows of ``row_len``; ``mean`` None: RMSNorm;
    ``cast``: of the forward with ``cast`` (dweight sums dy times xhat rounded to x's dtype).

    x: the normalized input (the sum s with a residual); dsum: the incoming gradient of s, added
    to dx, or None. dx is then the gradient of both x and residual. dweight and dbias come in the
    weight's dtype (the accumulator's when weight is None). dy in float32 beside a half-precision
    x: of the forward with that ``out_dtype``, dx in x's dtype.
    """
    call = _Call(x, weight)
    bk = call.bk
    x, dy = bk.contiguous(x), bk.contiguous(dy)
    args = (row_len, needs_input_grad, cast)
    out_dtype = bk.dtype_name(dy)
    if out_dtype == call.dtype:
        return _row_norm_bwd(call, dy, dsum, x, mean, rstd, weight, *args)
    if dsum is not None:
        raise ValueError("row_norm_bwd: a float32 dy takes no dsum")
    _set_out_dtype(call, out_dtype)
    if _plan.plan_short_rows(row_len, call.itemsize, call.aligned(x, dy)) is not None:
        return _row_norm_bwd(call, dy, dsum, x, mean, rstd, weight, *args)
    # the float32 path on a copy of x, dx converted back
    x_out = _converted(call, x, out_dtype)
    dx_out, dweight, dbias = _row_norm_bwd(_Call(x_out, weight), dy, dsum, x_out, mean, rstd,
                                           weight, *args)  # fmt: skip
    dx = None if dx_out is None else _converted(call, dx_out, call.dtype, bk.empty_strided_like(x))
    return dx, dweight, dbias


def _row_norm_bwd(
    call: _Call,
    dy: Any,
    dsum: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    row_len: int,
    needs_input_grad: tuple[bool, bool, bool],
    cast: bool,
) -> tuple:
    """row_norm_bwd on contiguous x and dy, whose ``call`` sets dy's dtype."""
    bk = call.bk
    if dsum is not None:
        dsum = bk.contiguous(dsum)
    D = row_len
    rows = _plan.prod(tuple(x.shape)) // D if D else 0
    want_dx, want_dw, want_db = needs_input_grad
    dx = bk.empty_strided_like(x) if want_dx else None
    dweight = call.grads((D,), weight, x) if want_dw else None
    dbias = call.grads((D,), weight, x) if want_db else None
    if rows * D == 0:
        for grad in (dweight, dbias):
            if grad is not None:
                bk.fill_zero(grad)
        return dx, dweight, dbias
    aligned = call.aligned(x, dy, dsum, dx)
    # one pass over rows held in registers (row_norm.cu): a group of lanes per short row, else
    # a CTA per row; (kernel, threads, rows to cover) or None
    one_pass = None
    cast_ = "cast_" if cast else ""
    short = _plan.plan_short_rows(D, call.itemsize, aligned)
    regs = _plan.plan_row_bwd(D, call.itemsize, aligned) if short is None else None
    if short is not None:
        work = -(-rows // short.rows_per_cta)
        one_pass = f"row_norm_bwd_short_{cast_}{short.lanes}", _plan.SHORT_ROW_THREADS, work
    elif regs is not None and call.out_dtype is None:
        one_pass = f"row_norm_bwd_{cast_}{regs.packs}", regs.threads, rows
    if one_pass is not None:
        kernel, threads, work = one_pass
        grid = _resident_grid(call, _ROWS, kernel, threads, work)
        dweight_part = call.stats((grid * D,), x) if want_dw else None
        dbias_part = call.stats((grid * D,), x) if want_db else None
        # fmt: off
        call.launch(_ROWS, kernel, grid, (threads,), (
            call.ptr(x), call.ptr(dy), call.ptr(dsum), call.ptr(weight), call.ptr(mean),
            call.ptr(rstd), call.ptr(dx), call.ptr(dweight_part), call.ptr(dbias_part),
            np.int64(rows), np.int32(D)))
        # fmt: on
        if want_dw or want_db:
            as_param = weight is not None
            _weight_grads(call, dweight_part, dbias_part, dweight, dbias, grid, D, as_param)
        return dx, dweight, dbias
    assert call.out_dtype is None, "row_norm_bwd planned a mixed dy off the short rows"
    row_sums = None
    if want_dx:
        tiles = _plan.plan_rows_tiles(D, call.itemsize, aligned)
        tile_sums = call.stats((rows * tiles.tiles * 2,), x)
        # fmt: off
        call.launch(_SEGMENT, "segment_norm_bwd_rows_sums", rows * tiles.tiles, (tiles.threads,), (
            call.ptr(x), call.ptr(dy), call.ptr(weight), call.ptr(mean), call.ptr(rstd),
            call.ptr(tile_sums), np.int64(D), np.int64(tiles.tiles), np.int64(tiles.tile_len),
            np.int32(tiles.vectorized)))
        # fmt: on
        row_sums = tile_sums
        if tiles.tiles > 1:
            row_sums = call.stats((rows * 2,), x)
            warps = _plan.FINALIZE_WARPS
            # fmt: off
            call.launch(_SEGMENT, "segment_norm_bwd_rows_merge", -(-rows // warps), (32 * warps,),
                        (call.ptr(tile_sums), call.ptr(row_sums), np.int64(rows),
                         np.int64(tiles.tiles)))
            # fmt: on
    dx_kernel = "segment_norm_bwd_rows_dx_cast" if cast else "segment_norm_bwd_rows_dx"
    most = call.threads(_SEGMENT, dx_kernel, _plan.BLOCK_THREADS)
    plan = _plan.plan_rows_backward(rows, D, call.itemsize, aligned, call.info, most)
    dweight_part = call.stats((plan.groups * D,), x) if want_dw else None
    dbias_part = call.stats((plan.groups * D,), x) if want_db else None
    if want_dx or want_dw or want_db:
        # fmt: off
        call.launch(_SEGMENT, dx_kernel, plan.col_tiles * plan.groups,
                    (plan.threads,), (
            call.ptr(x), call.ptr(dy), call.ptr(dsum), call.ptr(weight), call.ptr(mean),
            call.ptr(rstd), call.ptr(row_sums), call.ptr(dx), call.ptr(dweight_part),
            call.ptr(dbias_part), np.int64(rows), np.int64(D), np.int64(plan.col_tiles),
            np.int64(plan.rows_per_group), np.int32(plan.vectorized)))
        # fmt: on
    if want_dw or want_db:
        as_param = weight is not None
        _weight_grads(call, dweight_part, dbias_part, dweight, dbias, plan.groups, D, as_param)
    return dx, dweight, dbias


# ---- synchronised batch norm: the rank-local passes around the collectives ------------------
# A batch norm whose statistics span several processes splits batch_norm_fwd / batch_norm_bwd at
# their merges: each rank computes its partial statistics (or gradient sums), the caller sums
# them across ranks (cupynorm/torch/sync_batchnorm.py), and the elementwise pass runs with the
# merged values. One recorded call on each side of a collective; the passes over the tensor are
# the strided family's, the per-channel steps between them sync_norm.cu's. Nothing here
# communicates.
@_programmed
def sync_batch_norm_rows(x: Any, rank: int, world: int) -> tuple:
    """(rows,): a (world, 2C + 1) float64 buffer whose row ``rank`` is this rank's (count, mean
    (C,), biased var (C,)) over its N * prod(spatial) values per channel, every other row zero.
    Summed over the ranks (all_reduce), it holds every rank's triple (count, mean, M2 = var *
    count) for :func:`sync_batch_norm_merge_apply`. Empty x: a row of zeros (count 0 weighs
    nothing)."""
    call = _Call(x)
    x, layout = _prepare(x, call.bk)
    N, C, S, layout = _per_channel_layout(x, layout)
    rows = call.bk.empty((world, 2 * C + 1), "float64", x)
    mean = var = None
    if N * C * S:
        if layout == "contiguous":
            partials = _stats_rows(call, x, C, N, S, C * S, S)
        else:
            partials = _stats_cols(call, x, 1, N * S, C, 0, 0, 1)
        mean, rstd, var = (call.stats((C,), x) for _ in range(3))  # rstd: scratch
        _finalize(call, x, partials, C, N * S, 0.0, mean, rstd, var)
    total = world * (2 * C + 1)
    # fmt: off
    call.launch(_SYNC, "sync_norm_pack_row", min(-(-total // 256), 4096), (256,), (
        call.ptr(mean), call.ptr(var), call.ptr(rows), np.int64(C), np.int64(world),
        np.int64(rank), np.float64(N * S if mean is not None else 0)))
    # fmt: on
    return (rows,)


@_programmed
def sync_batch_norm_merge_apply(
    x: Any,
    rows: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    eps: float,
    momentum: float,
) -> tuple:
    """(y, mean (C,), rstd (C,), count (1,) float64): Chan's merge of the all-reduced ``rows``
    of :func:`sync_batch_norm_rows` (rank order, float64), the running statistics (either may
    be None) updated in place as torch does, then y = (x - mean[c]) * rstd[c] * weight[c] +
    bias[c] over this rank's x. One recorded call: the merge kernel and the strided apply."""
    merge = _Call(x, running_mean if running_mean is not None else running_var)
    C, world = x.shape[1], rows.shape[0]
    mean, rstd = merge.stats((C,), x), merge.stats((C,), x)
    count = merge.bk.empty((1,), "float64", x)
    if running_mean is not None or running_var is not None:
        merge.mutates_inputs()
    # fmt: off
    merge.launch(_SYNC, "sync_norm_merge", max(1, -(-C // 256)), (256,), (
        merge.ptr(rows), np.int64(C), np.int64(world), np.float64(eps), np.float64(momentum),
        merge.ptr(mean), merge.ptr(rstd), merge.ptr(count), merge.ptr(running_mean),
        merge.ptr(running_var)))
    # fmt: on
    call = _Call(x, weight if weight is not None else bias)
    x, layout = _prepare(x, call.bk)
    N, C, S, layout = _per_channel_layout(x, layout)
    y = call.bk.empty_strided_like(x)
    if N * C * S:
        _apply(call, x, y, weight, bias, mean, rstd, layout, N, C, S, 0, 1)
    return y, mean, rstd, count


@_programmed
def batch_norm_bwd_sums(dy: Any, x: Any, mean: Any, rstd: Any) -> tuple:
    """(sum_dy (C,), sum_dy_xhat (C,)) over this rank's values of each channel, with
    xhat = (x - mean) * rstd: the rank's own dbias and dweight (before any cast to the weight's
    dtype), and the sums whose totals over ranks give the input gradient. Fixed-order merges:
    bitwise reproducible. Empty x: zeros."""
    call = _Call(x)
    x, layout = _prepare(x, call.bk)
    dy = _match_layout(call, dy, x)
    N, C, S, layout = _per_channel_layout(x, layout)
    sum_dy, sum_dy_xhat = call.stats((C,), x), call.stats((C,), x)
    if N * C * S == 0:
        call.bk.fill_zero(sum_dy)
        call.bk.fill_zero(sum_dy_xhat)
        return sum_dy, sum_dy_xhat
    geo = _elementwise(call, layout, N, C, S, 0, 1, call.aligned(x, dy), _plan.SPLIT_CTAS_PER_SM)
    # pass 1 of the strided backward: per (n, c, tile) sums of dy and dy * (x - mean)
    partials = _bwd_sums(call, dy, x, mean, geo, C)
    # pass 2 without a weight and without dx coefficients: dweight = sum dy * xhat, dbias = sum dy
    # in the accumulator's type
    # fmt: off
    _bwd_finalize(call, partials, geo.samples, C, geo.tiles, rstd, None, 0, 1, C, N * S, False,
                  sum_dy_xhat, sum_dy, None, None)
    # fmt: on
    return sum_dy, sum_dy_xhat


@_programmed
def sync_batch_norm_bwd_dx(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, totals: Any, count: Any
) -> tuple:
    """(dx,) with dx = (x - mean[c]) * u[c] + v[c] + dy * rstd[c] * weight[c], the strided
    family's dx pass, its coefficients from the sums over every rank, ``totals`` (2, C) =
    (P = sum dy, Q = sum dy * xhat), and the global count (1,) float64 of
    :func:`sync_batch_norm_merge_apply`: u = -rstd^2 w Q / n, v = -rstd w P / n (one kernel,
    into scratch). One recorded call."""
    coeffs = _Call(rstd, weight)
    C = rstd.shape[0]
    u, v = coeffs.stats((C,), rstd), coeffs.stats((C,), rstd)
    # fmt: off
    coeffs.launch(_SYNC, "sync_norm_bwd_coeffs", max(1, -(-C // 256)), (256,), (
        coeffs.ptr(totals), coeffs.ptr(rstd), coeffs.ptr(weight), coeffs.ptr(count),
        np.int64(C), coeffs.ptr(u), coeffs.ptr(v)))
    # fmt: on
    call = _Call(x, weight)
    x, layout = _prepare(x, call.bk)
    dy = _match_layout(call, dy, x)
    N, C, S, layout = _per_channel_layout(x, layout)
    dx = call.bk.empty_strided_like(x)
    if N * C * S:
        aligned = call.aligned(x, dy, dx)
        _bwd_dx(call, dy, x, dx, weight, mean, rstd, u, v, layout, N, C, S, 0, 1, aligned)
    return (dx,)


# ---- channel norms: LayerNorm / RMSNorm over dim 1 of (N, C, *spatial), per (sample, pixel) ---
# channels_last data is the row norm on its (N, *spatial, C) view (a contiguous permutation, no
# copy); contiguous (NCHW) data takes the channels family (channel_norm.cu). These two entries
# only pick the route and reshape: the work is in recorded entries (row_norm_fwd/bwd and the
# _channel_norm_* below), whose outputs must be their own allocations, not views.
def _to_rows(x: Any) -> Any:
    """The (N, *spatial, C) view of x (N, C, *spatial)."""
    order = (0, *range(2, x.ndim), 1)
    return x.permute(*order) if _interop.is_torch_tensor(x) else x.transpose(order)


def _to_channels(t: Any) -> Any:
    """The (N, C, *spatial) view of t (N, *spatial, C)."""
    order = (0, t.ndim - 1, *range(1, t.ndim - 1))
    return t.permute(*order) if _interop.is_torch_tensor(t) else t.transpose(order)


#: (device, dtype, parameter dtype, C, backward) -> whether the channels family has a plan
_CHANNEL_FITS: dict[tuple, bool] = {}


def _channel_fits(x: Any, param: Any, C: int, backward: bool) -> bool:
    """_channel.fits, asked once per signature: the routers below are not recorded, so they
    run on every call and would otherwise set up a _Call and query the kernel each time."""
    bk = _interop.backend_of(x)
    dtype = bk.dtype_name(param) if param is not None else None
    key = (bk.device_id(x), bk.dtype_name(x), dtype, C, backward)
    fits = _CHANNEL_FITS.get(key)
    if fits is None:
        fits = _CHANNEL_FITS[key] = _channel.fits(_Call(x, param), C, backward)
    return fits


def channel_norm_fwd(
    x: Any,
    weight: Any,
    bias: Any,
    eps: float,
    rms: bool,
    *,
    want_stats: bool = True,
    out_dtype: str | None = None,
) -> tuple:
    """(y, mean, rstd) of LayerNorm (``rms=False``) or RMSNorm over dim 1 of x (N, C, *spatial).

    y keeps x's layout (contiguous or channels_last; other strides: contiguous). mean, rstd:
    (N, *spatial) in the accumulator's dtype; mean None for RMSNorm, both None without
    ``want_stats``. weight/bias: (C,) or None. ``out_dtype``: as row_norm_fwd's (y in float32
    beside a half-precision x: read as is on channels_last data, a float32 copy otherwise).
    """
    bk = _interop.backend_of(x)
    layout = _plan.classify_layout(tuple(x.shape), tuple(bk.strides(x)))
    N, C, spatial = x.shape[0], x.shape[1], tuple(x.shape[2:])
    if layout == "other":
        x = bk.contiguous(x)
    if layout == "channels_last" or _plan.prod(spatial) == 1:
        # keyword arguments as a row norm's call passes them (a replay of these rows builds
        # its key: cupynorm/torch/_replay.py)
        extra = {"out_dtype": out_dtype} if out_dtype else {}
        # fmt: off
        y, _sum, mean, rstd = row_norm_fwd(_to_rows(x), None, weight, bias, C, eps, rms,
                                           want_stats=want_stats, **extra)
        # fmt: on
        y = _to_channels(y)
    else:
        if out_dtype not in (None, bk.dtype_name(x)):  # the channels family: on a float32 copy
            x = bk.astype(x, out_dtype)
        if _channel_fits(x, weight if weight is not None else bias, C, backward=False):
            # as the replay of NCHW channel norms keys it (cupynorm/torch/_replay.py)
            y, mean, rstd = _channel_norm_fwd(x, weight, bias, eps, rms, want_stats=want_stats)
        else:  # more channels than one CTA holds: the row norm on a channels-last copy
            rows = bk.contiguous(_to_rows(x))
            y, _sum, mean, rstd = row_norm_fwd(
                rows, None, weight, bias, C, eps, rms, want_stats=want_stats
            )
            y = bk.contiguous(_to_channels(y))
    stats = (N, *spatial)
    mean = None if mean is None else mean.reshape(stats)
    rstd = None if rstd is None else rstd.reshape(stats)
    return y, mean, rstd


def channel_norm_bwd(
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple:
    """(dx | None, dweight | None, dbias | None) of channel_norm_fwd; ``mean`` None: RMSNorm.

    dx takes x's layout (contiguous or channels_last; other strides: contiguous); dy may have any
    strides (copied to x's layout when they differ). dweight/dbias: (C,) in the weight's dtype
    (the accumulator's when weight is None). dy in float32 beside a half-precision x: of the
    forward with that ``out_dtype``, dx in x's dtype.
    """
    bk = _interop.backend_of(x)
    layout = _plan.classify_layout(tuple(x.shape), tuple(bk.strides(x)))
    C = x.shape[1]
    mean = None if mean is None else mean.reshape(-1)
    rstd = rstd.reshape(-1)
    if layout == "other":
        x = bk.contiguous(x)
    if layout == "channels_last" or _plan.prod(tuple(x.shape[2:])) == 1:
        rows_dy = _to_rows(dy)
        dx, dweight, dbias = row_norm_bwd(
            rows_dy, None, _to_rows(x), mean, rstd, weight, C, needs_input_grad
        )
        return (None if dx is None else _to_channels(dx)), dweight, dbias
    dtype = bk.dtype_name(x)
    if bk.dtype_name(dy) != dtype:  # a float32 dy beside half x: on a float32 copy of x
        x = bk.astype(x, bk.dtype_name(dy))
    dy = bk.contiguous(dy)
    if _channel_fits(x, weight, C, backward=True):
        dx, dweight, dbias = _channel_norm_bwd(dy, x, mean, rstd, weight, needs_input_grad)
    else:
        # fmt: off
        dx, dweight, dbias = row_norm_bwd(bk.contiguous(_to_rows(dy)), None,
                                          bk.contiguous(_to_rows(x)), mean, rstd, weight, C,
                                          needs_input_grad)
        # fmt: on
        dx = None if dx is None else bk.contiguous(_to_channels(dx))
    if dx is not None and bk.dtype_name(dx) != dtype:
        dx = bk.astype(dx, dtype)
    return dx, dweight, dbias


@_programmed
def _channel_norm_fwd(
    x: Any, weight: Any, bias: Any, eps: float, rms: bool, *, want_stats: bool = True
) -> tuple:
    """(y, mean (N, S), rstd (N, S)) of x (N, C, *spatial) contiguous: channel_norm.cu."""
    call = _Call(x, weight if weight is not None else bias)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    y = call.bk.empty_strided_like(x)
    mean = call.stats((N, S), x) if want_stats and not rms else None
    rstd = call.stats((N, S), x) if want_stats else None
    if N * C * S == 0:
        for stat in (mean, rstd):
            if stat is not None:
                call.bk.fill_nan(stat)
        return y, mean, rstd
    _channel.forward(call, x, y, weight, bias, mean, rstd, C, S, eps, rms)
    return y, mean, rstd


@_programmed
def _channel_norm_bwd(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, needs_input_grad: tuple[bool, bool, bool]
) -> tuple:
    """(dx, dweight, dbias) of _channel_norm_fwd; x, dy (N, C, *spatial) contiguous, mean/rstd
    N * S values (mean None: RMSNorm)."""
    call = _Call(x, weight)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    want_dx, want_dw, want_db = needs_input_grad
    dx = call.bk.empty_strided_like(x) if want_dx else None
    dweight = call.grads((C,), weight, x) if want_dw else None
    dbias = call.grads((C,), weight, x) if want_db else None
    if N * C * S == 0:
        for grad in (dweight, dbias):
            if grad is not None:
                call.bk.fill_zero(grad)
        return dx, dweight, dbias
    if want_dx or want_dw or want_db:
        _channel.backward(call, dy, x, mean, rstd, weight, dx, dweight, dbias, C, S)
    return dx, dweight, dbias
