"""Row norm entries: LayerNorm and RMSNorm over the last dims of contiguous rows, optionally after
a residual add (the sum kept as the new residual stream), with Hugging Face's LlamaRMSNorm cast,
or with y in float32 beside a half-precision x (autocast); and the seed-002 tail
``(row_norm(x) + y) * y``.

Short rows take a group of lanes per row (row_norm.cu), longer ones a CTA or a team per row (the
segment family), rows too long for chip memory the strided family's statistics then an apply
pass; the backward likewise: one pass over rows held in registers where they fit, else sums, a
merge and a dx pass with fp32 partial rows for dweight and dbias.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _plan
from .._launch import (
    _ITEMSIZE,
    _ROWS,
    _SEGMENT,
    _Call,
    _resident_grid,
    _scalar,
    _weight_grads,
)
from .._program import _programmed
from .._segment import _segment_launch
from .._strided import _apply, _backward, _finalize, _stats_rows
from ._common import _set_out_dtype


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
    cta = _plan.plan_row_fwd(D, call.itemsize, aligned)
    if cta is not None:  # a CTA per row, in registers (row_norm.cu)
        kind = "rms_cast" if cast else "rms" if rms else "layer"
        # fmt: off
        call.launch(_ROWS, f"row_norm_fwd_cta_{kind}_{cta.packs}", rows, (cta.threads,), (
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
