"""GroupNorm entries (InstanceNorm is GroupNorm with one channel per group): the forward, with
an optional activation and a per-(n, c) shift; the backward, plain or with the activation.

Contiguous groups that fit on chip take the segment family (one read, one write); longer groups
and channels_last data take the strided family's passes; the InstanceNorm backward holds each
plane's x and dy on chip where it fits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _plan
from .._launch import _Call, _prepare, _scalar
from .._program import _programmed
from .._segment import _instance_bwd_on_chip, _segment_launch
from .._strided import Epilogue, _apply, _backward, _finalize, _stats_cols, _stats_rows
from ._common import _match_layout, _set_out_dtype


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


def _backward_inputs(dy: Any, x: Any, param: Any) -> tuple:
    """(call, dy, x, layout, N, C, S) of a group norm backward: the call typed by x and
    ``param`` (weight, else bias) with dy's dtype as its out dtype, x prepared, dy laid out as x."""
    call = _Call(x, param)
    _set_out_dtype(call, call.bk.dtype_name(dy))
    x, layout = _prepare(x, call.bk)
    dy = _match_layout(call, dy, x)
    return call, dy, x, layout, x.shape[0], x.shape[1], _plan.prod(tuple(x.shape[2:]))


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
    call, dy, x, layout, N, C, S = _backward_inputs(dy, x, weight)
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
    call, dy, x, layout, N, C, S = _backward_inputs(dy, x, weight if weight is not None else bias)
    G = num_groups
    epilogue = Epilogue(act, None, bias) if act != "identity" else None
    # fmt: off
    return _backward(call, dy, x, mean, rstd, weight, layout, N, C, S, G, C // G, True,
                     needs_input_grad, epilogue, shift)
    # fmt: on
