"""Host side of the strided family (``strided_norm.cu``): partial Welford triples over rows or
columns (channels innermost), their deterministic merge (finalize), the elementwise apply, and the
backward's sums, merge and dx passes. Serves BatchNorm, every norm on channels_last data, and
segments too long for an on-chip team. With an :class:`Epilogue` (a residual add and an
activation after the norm), the apply and the backward sums run the fused family's kernels
(``fused_norm.cu``) and every other pass stays the same.

Per-sample statistics may normalize ``x + shift[n, c]`` instead of x (``shift``: (N, C),
contiguous, x's dtype, or None), a diffusion block's time embedding added before its GroupNorm:
every pass takes it as its last argument (null when None) and folds it into what it subtracts
from x (strided_norm.cu).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _compile, _plan
from ._launch import (
    _FUSED,
    _ITEMSIZE,
    _NULL,
    _STRIDED,
    _Call,
    _scalar,
)


class Epilogue(NamedTuple):
    """A fused epilogue: ``y = act(norm(x) + residual)``.

    The forward needs ``act`` and ``residual`` (None: no add). The backward recomputes the
    activation's input t = norm(x) + residual, so it also needs ``bias``; with a residual, ``dt``
    (x's layout) receives dL/dt, the residual's gradient, which the plain dx pass then reads;
    without one (``dt`` None) the sums and the dx pass each turn dy into dL/dt themselves.
    ``mask``: the ReLU mask the forward kept (:func:`_apply`), which the backward's sums pass reads
    instead of recomputing t (``residual`` is then not needed).
    """

    act: str
    residual: Any = None
    bias: Any = None
    dt: Any = None
    mask: Any = None

    def apply_kernel(self, rows: bool) -> str | None:
        """The fused apply kernel, or None when the plain one computes the same thing."""
        if self.residual is None and self.act == "identity":
            return None
        add = "add_" if self.residual is not None else ""
        return f"fused_norm_apply_{'rows' if rows else 'cols'}_{add}{self.act}"

    @property
    def fused_backward(self) -> bool:
        """Whether dy must become dt first (an activation with a gradient other than 1)."""
        return self.act != "identity"


class _Partials(NamedTuple):
    """Partial (count, mean, M2) triples of statistic sets, and where each set's shift is: the
    triples' means are relative to the set's first value K, read back by the finalize at
    x[(k // shift_div) * shift_a + (k % shift_div) * shift_b]."""

    triples: Any
    per_set: int
    shift_div: int
    shift_a: int
    shift_b: int


def _stats_rows(
    call: _Call,
    x: Any,
    num_sets: int,
    n_runs: int,
    run_len: int,
    run_stride: int,
    set_stride: int,
    shift: Any = None,
) -> _Partials:
    """Partial triples of sets of contiguous runs (strided_norm_stats_rows); with a shift, run r
    of set k must be one channel, whose shift is shift's element k * n_runs + r."""
    aligned = call.aligned(x, strides=(run_stride, set_stride))
    plan = _plan.plan_rows_stats(
        num_sets, n_runs * run_len, run_len, call.itemsize, aligned, call.info
    )
    triples = call.stats((num_sets * plan.ctas_per_set * 3,), x)
    i64 = np.int64
    # fmt: off
    call.launch(_STRIDED, "strided_norm_stats_rows", num_sets * plan.ctas_per_set,
                (plan.threads,), (
        call.ptr(x), call.ptr(triples), i64(n_runs), i64(run_len), i64(run_stride),
        i64(set_stride), i64(plan.chunk), i64(plan.ctas_per_set), np.int32(plan.vectorized),
        call.ptr(shift)))
    # fmt: on
    return _Partials(triples, plan.ctas_per_set, 1, set_stride, 0)


def _stats_cols(
    call: _Call,
    x: Any,
    samples: int,
    rows: int,
    channels: int,
    sample_stride: int,
    groups: int,
    chans_per_group: int,
    shift: Any = None,
) -> _Partials:
    """Partial triples over channel-innermost data (strided_norm_stats_cols)."""
    aligned = call.aligned(x, strides=(sample_stride,))
    acc_size = np.dtype(call.acc).itemsize

    def smem_bytes(threads: int, vec: int, staged: bool) -> int:
        return _plan.stats_cols_smem(threads, vec, staged, acc_size)

    resident = _compile.resident_ctas(
        call.device, _STRIDED, "strided_norm_stats_cols", call.dtype, call.param_dtype,
        _plan.COLS_THREADS, smem_bytes(_plan.COLS_THREADS, call.vec, True), call.out_dtype,
    )  # fmt: skip
    plan = _plan.plan_cols(samples, rows, channels, call.itemsize, aligned, call.info, resident)
    vec = _plan.vec_width(call.itemsize) if plan.vectorized else 1
    triples = call.stats((samples * plan.ctas_per_sample * channels * 3,), x)
    smem = smem_bytes(plan.tx * plan.ty, vec, plan.vectorized)
    i64 = np.int64
    # fmt: off
    call.launch(_STRIDED, "strided_norm_stats_cols", plan.grid(samples), (plan.tx, plan.ty), (
        call.ptr(x), call.ptr(triples), i64(samples), i64(rows), i64(channels), i64(channels),
        i64(sample_stride), i64(plan.ctas_per_sample), np.int32(groups), i64(chans_per_group),
        np.int32(plan.vectorized), call.ptr(shift)), smem=smem)
    # fmt: on
    if groups > 0:  # set (n, g) starts at sample n, channel g * Cg
        return _Partials(
            triples, plan.ctas_per_sample * chans_per_group, groups, sample_stride, chans_per_group
        )
    return _Partials(triples, samples * plan.ctas_per_sample, 1, 1, 0)  # set c starts at c


def _finalize(
    call: _Call,
    x: Any,
    partials: _Partials,
    num_sets: int,
    count: int,
    eps: float,
    mean: Any,
    rstd: Any,
    var: Any,
    running_mean: Any = None,
    running_var: Any = None,
    momentum: float = 0.0,
    batches_tracked: Any = None,
    new_running_mean: Any = None,
    new_running_var: Any = None,
) -> None:
    """Merge the partial triples into mean, rstd (and var); running statistics given are updated
    in the same kernel (batch norm, with the unbiased variance) -- in place, or into
    ``new_running_*`` when given -- and ``batches_tracked`` (a module's int64 batch counter)
    incremented."""
    grid, threads = _plan.finalize_grid(num_sets)
    unbias = count / (count - 1) if count > 1 else float("nan")
    # fmt: off
    call.launch(_STRIDED, "strided_norm_finalize", grid, (threads,), (
        call.ptr(partials.triples), np.int64(num_sets), np.int64(partials.per_set),
        np.float64(count), _scalar(call.acc, eps), call.ptr(mean), call.ptr(rstd), call.ptr(var),
        call.ptr(x), np.int64(partials.shift_div), np.int64(partials.shift_a),
        np.int64(partials.shift_b), call.ptr(running_mean), call.ptr(running_var),
        _scalar(call.acc, momentum), _scalar(call.acc, unbias), call.ptr(batches_tracked),
        call.ptr(running_mean if new_running_mean is None else new_running_mean),
        call.ptr(running_var if new_running_var is None else new_running_var)))
    # fmt: on


class _Elementwise(NamedTuple):
    """Grid of the elementwise passes (apply, backward sums, backward dx) over one layout."""

    rows: bool  # rows (NCHW) or columns (channels innermost) kernels
    grid: int | tuple[int, int]
    block: tuple[int, ...]
    tail: tuple  # the layout arguments every such kernel takes last
    tiles: int  # T: partials per (n, c) of the backward sums
    samples: int  # NP: samples the partials keep apart (1 when the batch is folded into rows)
    vec: int


def _elementwise(
    call: _Call,
    layout: str,
    N: int,
    C: int,
    S: int,
    groups: int,
    cpg: int,
    aligned: bool,
    cols_ctas_per_sm: int | None = None,
) -> _Elementwise:
    """The grid of an elementwise pass; columns passes aim at ``cols_ctas_per_sm`` CTAs per SM
    (COLS_APPLY_CTAS_PER_SM by default; fewer for the backward sums, whose partials per channel
    grow with the grid)."""
    i64 = np.int64
    if layout == "contiguous":
        plan = _plan.plan_rows_apply(S, call.itemsize, aligned and S % call.vec == 0)
        tail = (
            i64(C),
            i64(S),
            i64(C * S),
            i64(S),
            np.int32(groups),
            i64(cpg),
            i64(plan.tiles_per_plane),
            i64(plan.tile_len),
            np.int32(plan.vectorized),
        )
        return _Elementwise(
            True,
            N * C * plan.tiles_per_plane,
            (plan.threads,),
            tail,
            plan.tiles_per_plane,
            N,
            call.vec if plan.vectorized else 1,
        )
    # per-sample statistics keep samples apart; per-channel ones fold the batch into the rows
    samples, rows = (N, S) if groups > 0 else (1, N * S)
    plan = _plan.plan_cols(
        samples,
        rows,
        C,
        call.itemsize,
        aligned and (S * C) % call.vec == 0,
        call.info,
        cols_ctas_per_sm or _plan.COLS_APPLY_CTAS_PER_SM,
        _plan.COLS_APPLY_THREADS,
        # the backward sums write partials per CTA; the apply and dx passes do not
        _plan.COLS_MIN_ROWS_PER_THREAD
        if cols_ctas_per_sm
        else _plan.COLS_APPLY_MIN_ROWS_PER_THREAD,
    )
    tail = (
        i64(rows),
        i64(C),
        i64(C),
        i64(S * C),
        np.int32(groups),
        i64(cpg),
        i64(plan.ctas_per_sample),
        np.int32(plan.vectorized),
    )
    return _Elementwise(
        False,
        plan.grid(samples),
        (plan.tx, plan.ty),
        tail,
        plan.ctas_per_sample,
        samples,
        call.vec if plan.vectorized else 1,
    )


def _apply(
    call: _Call,
    x: Any,
    y: Any,
    weight: Any,
    bias: Any,
    mean: Any,
    rstd: Any,
    layout: str,
    N: int,
    C: int,
    S: int,
    groups: int,
    cpg: int,
    epilogue: Epilogue | None = None,
    shift: Any = None,
    keep_mask: bool = False,
) -> Any:
    """y = (x - mean) * rstd * weight + bias over either layout (groups == 0: per channel),
    then the epilogue's residual add and activation when one is given.

    ``keep_mask`` (ReLU with a residual): keep the ReLU's mask for the backward where its layout
    exists -- channels innermost, on 16-byte packs of 8 elements: one bit per element of x's
    layout, bit e of byte j for element 8j + e (strided_norm.cu, "Fused epilogue"). Returns the
    mask (uint8, 1/16 of a 16-bit x) or None."""
    residual = epilogue.residual if epilogue is not None else None
    geo = _elementwise(call, layout, N, C, S, groups, cpg, call.aligned(x, y, residual))
    source, kernel = _STRIDED, "strided_norm_apply_rows" if geo.rows else "strided_norm_apply_cols"
    fused = epilogue.apply_kernel(geo.rows) if epilogue is not None else None
    if fused is not None:
        source, kernel = _FUSED, fused
    mask = None
    # the mask's layout: channels-innermost packs of 8 (16-bit x, vectorized)
    if (
        keep_mask
        and residual is not None
        and epilogue.act == "relu"
        and geo.vec == 8
        and not geo.rows
    ):
        kernel, mask = f"{kernel}_mask", call.bk.empty((N * S * C // 8,), "uint8", x)
    args = (
        call.ptr(x),
        _NULL,
        call.ptr(y),
        call.ptr(weight),
        call.ptr(bias),
        call.ptr(mean),
        call.ptr(rstd),
        _NULL,
        _NULL,
    )
    tail = geo.tail + (call.ptr(residual), call.ptr(shift))
    if mask is not None:
        tail += (call.ptr(mask),)
    call.launch(source, kernel, geo.grid, geo.block, args + tail)
    return mask


def _backward_outputs(
    call: _Call, x: Any, weight: Any, C: int, needs_input_grad: tuple[bool, bool, bool]
) -> tuple:
    """(dx, dweight, dbias) of a backward, each None where not needed (dweight also without a
    weight): dx laid out as x, dweight and dbias (C,) in the weight's dtype."""
    need_dx, need_dw, need_db = needs_input_grad
    dx = call.bk.empty_strided_like(x) if need_dx else None
    dweight = call.grads((C,), weight, x) if need_dw and weight is not None else None
    dbias = call.grads((C,), weight, x) if need_db else None
    return dx, dweight, dbias


def _backward(
    call: _Call,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    layout: str,
    N: int,
    C: int,
    S: int,
    groups: int,
    cpg: int,
    training: bool,
    needs_input_grad: tuple[bool, bool, bool],
    epilogue: Epilogue | None = None,
    shift: Any = None,
    outputs: tuple | None = None,
) -> tuple:
    """(dx, dweight, dbias) of y = (x - mean) * rstd * weight + bias; see strided_norm.cu.

    With an epilogue whose activation has a gradient (``fused_backward``), the sums pass first
    turns dy into ``epilogue.dt`` and everything after it works on dt. ``outputs``: the
    gradients as :func:`_backward_outputs` allocated them (by a caller that tried another
    family first), else allocated here.
    """
    if outputs is None:
        outputs = _backward_outputs(call, x, weight, C, needs_input_grad)
    dx, dweight, dbias = outputs
    if N * C * S == 0:  # before any plan: an empty batch has no grid (samples: N)
        for grad in (dweight, dbias):
            if grad is not None:
                call.bk.fill_zero(grad)
        return dx, dweight, dbias
    fused = epilogue if epilogue is not None and epilogue.fused_backward else None
    extra = (fused.dt, fused.residual) if fused is not None else ()
    aligned = call.aligned(x, dy, dx, *extra)
    geo = _elementwise(call, layout, N, C, S, groups, cpg, aligned, _plan.SPLIT_CTAS_PER_SM)
    num_sets = N * groups if groups > 0 else C
    count = cpg * S if groups > 0 else N * S
    need_dx = dx is not None
    u, v = (call.stats((num_sets,), x) for _ in range(2)) if need_dx else (None, None)
    # pass 1: per (n, c, tile) sums of dy and dy * (x - mean) (of dt, with the epilogue)
    partials = _bwd_sums(call, dy, x, mean, geo, C, weight, rstd, fused, shift)
    if fused is not None and fused.dt is not None:
        dy, fused = fused.dt, None  # written by pass 1: the plain norm backward from here on
    # pass 2: dweight, dbias and the dx coefficients, merged in a fixed order
    _bwd_finalize(
        call,
        partials,
        geo.samples,
        C,
        geo.tiles,
        rstd,
        weight,
        groups,
        cpg,
        num_sets,
        count,
        training,
        dweight,
        dbias,
        u,
        v,
    )
    # pass 3: dx
    if need_dx:
        # fmt: off
        _bwd_dx(call, dy, x, dx, weight, mean, rstd, u, v, layout, N, C, S, groups, cpg, aligned,
                fused, shift)
        # fmt: on
    return dx, dweight, dbias


def _bwd_sums(
    call: _Call,
    dy: Any,
    x: Any,
    mean: Any,
    geo: _Elementwise,
    C: int,
    weight: Any = None,
    rstd: Any = None,
    epilogue: Epilogue | None = None,
    shift: Any = None,
) -> Any:
    """Pass 1 of the backward over ``geo``'s grid: the partials (sdy, sdx) per (n, c, tile).
    With a fused epilogue, dy becomes dL/dt first (written to ``epilogue.dt`` when given) and the
    sums are of it; weight and rstd are the forward's (t is recomputed)."""
    partials = call.stats((geo.samples * C * geo.tiles * 2,), x)
    smem = 0 if geo.rows else geo.block[0] * geo.block[1] * geo.vec * 2 * _ITEMSIZE[call.acc]
    layout_name = "rows" if geo.rows else "cols"
    args = (call.ptr(x), call.ptr(dy), call.ptr(mean), call.ptr(partials)) + geo.tail
    if epilogue is None:
        kernel = f"strided_norm_bwd_sums_{layout_name}"
        call.launch(_STRIDED, kernel, geo.grid, geo.block, args + (call.ptr(shift),), smem=smem)
        return partials
    # fmt: off
    # the rows entries take the residual's presence at compile time (fused_norm.cu)
    add = "add_" if geo.rows and epilogue.residual is not None else ""
    kernel = f"fused_norm_bwd_sums_{layout_name}_{add}{epilogue.act}"
    last = (call.ptr(epilogue.residual), call.ptr(epilogue.dt), call.ptr(weight),
            call.ptr(epilogue.bias), call.ptr(rstd), call.ptr(shift))
    # fmt: on
    if epilogue.mask is not None:  # the forward's ReLU mask instead of the residual
        kernel, last = f"{kernel}_mask", (_NULL, *last[1:], call.ptr(epilogue.mask))
    call.launch(_FUSED, kernel, geo.grid, geo.block, args + last, smem=smem)
    return partials


def _bwd_dx(
    call: _Call,
    dy: Any,
    x: Any,
    dx: Any,
    weight: Any,
    mean: Any,
    rstd: Any,
    u: Any,
    v: Any,
    layout: str,
    N: int,
    C: int,
    S: int,
    groups: int,
    cpg: int,
    aligned: bool,
    epilogue: Epilogue | None = None,
    shift: Any = None,
) -> None:
    """Pass 3 of the backward: dx = (x - mean) * u + v + dt * rstd * weight, where dt is dy, or
    dL/dt computed from dy here with an epilogue (one without a residual: see Epilogue)."""
    geo = _elementwise(call, layout, N, C, S, groups, cpg, aligned)
    layout_name = "rows" if geo.rows else "cols"
    source, kernel, bias = _STRIDED, f"strided_norm_bwd_dx_{layout_name}", None
    if epilogue is not None:
        source, bias = _FUSED, epilogue.bias
        kernel = f"fused_norm_bwd_dx_{layout_name}_{epilogue.act}"
    # fmt: off
    args = (call.ptr(x), call.ptr(dy), call.ptr(dx), call.ptr(weight), call.ptr(bias),
            call.ptr(mean), call.ptr(rstd), call.ptr(u), call.ptr(v))
    # fmt: on
    call.launch(source, kernel, geo.grid, geo.block, args + geo.tail + (_NULL, call.ptr(shift)))


def _bwd_finalize(
    call: _Call,
    partials: Any,
    samples: int,
    C: int,
    tiles: int,
    rstd: Any,
    weight: Any,
    groups: int,
    cpg: int,
    num_sets: int,
    count: int,
    training: bool,
    dweight: Any,
    dbias: Any,
    u: Any,
    v: Any,
) -> None:
    """strided_norm_bwd_finalize: partials[(n*C + c)*tiles + t] (sdy, sdx) -> dweight, dbias
    (warps 0..C-1) and the dx coefficients u, v of num_sets statistic sets (the next warps)."""
    # fmt: off
    call.launch(_STRIDED, "strided_norm_bwd_finalize", -(-(C + num_sets) // 8), (256,), (
        call.ptr(partials), np.int64(samples), np.int64(C), np.int64(tiles), call.ptr(rstd),
        call.ptr(weight), np.int32(groups), np.int64(cpg), np.int64(num_sets),
        np.float64(count), np.int32(training), call.ptr(dweight), call.ptr(dbias), call.ptr(u),
        call.ptr(v)))
    # fmt: on
