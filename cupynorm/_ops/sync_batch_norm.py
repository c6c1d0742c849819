"""The synchronised batch norm's rank-local steps, around the collectives.

A batch norm whose statistics span several processes splits batch_norm_fwd / batch_norm_bwd at
their merges: each rank computes its partial statistics (or gradient sums), the caller sums them
across ranks (cupynorm/torch/sync_batchnorm.py), and the elementwise pass runs with the merged
values. One recorded call on each side of a collective; the passes over the tensor are the
strided family's, the per-channel steps between them sync_norm.cu's. Nothing here communicates.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _plan
from .._launch import _SYNC, _Call, _prepare
from .._program import _programmed
from .._strided import (
    _apply,
    _bwd_dx,
    _bwd_finalize,
    _bwd_sums,
    _elementwise,
    _finalize,
    _stats_cols,
    _stats_rows,
)
from ._common import _match_layout, _per_channel_layout


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
