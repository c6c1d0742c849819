"""The single-launch family (``cuda_src/single_launch_norm.cu``): BatchNorm training on
channel-innermost data in one cooperative launch per direction, for tensors where the three
launches of the strided family and the gaps between them are a large part of the time.

The grid is one wave of the kernel's resident CTAs (planned by :func:`._plan.plan_cols` with the
fused kernel's own occupancy), so every CTA can wait at the grid barriers; the launch is
cooperative, so a grid that cannot be resident is refused by the driver instead of hanging, and
the call then runs the strided family's three passes. Each launch is preceded by a memset of its
barrier counter on the same stream (recorded and replayed with it).

When it runs (:data:`enabled`, measured on an H200 over resnet50's BatchNorm inputs at batches 8,
64 and 256, benchmarks/NOTES.md 2026-11-26): the backward, where its planned grid fills most of the
GPU and has a warp per channel for the merges (a BatchNorm backward of 64 channels of 112x112 at
batch 64: 167 -> 139 us; -6% / -7% of the plain BatchNorm forward + backward time over resnet50's
inputs at batches 64 / 256); never the forward by default (as fast as the three passes at best,
slower where the grid is small).

:func:`batch_norm_fwd_cols` and :func:`batch_norm_bwd_cols` return False when the single launch
does not apply; the caller then runs the strided passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _compile, _plan, _program
from ._launch import _ITEMSIZE, _SINGLE, _Call, _scalar

#: Largest input (bytes of x; the backward also reads dy) run in one launch: the grid decides,
#: not the size; the gain held up to the largest measured (411 MB, benchmarks/NOTES.md).
MAX_BYTES = 1 << 30
#: None: the measured choice (the backward where :func:`_backward_pays`, never the forward);
#: True: wherever it applies (the tests compare both paths); False: never. A model test that once
#: differed with it on was traced to a different (equally accurate) summation order, not a bug.
enabled: bool | None = None  # see enable()
_refused: set[tuple] = set()  # launches the driver refused: (device, kernel, dtypes, grid, smem)


def enable(on: bool | None) -> None:
    """Turn the single launch on (True), off (False) or back to the measured choice (None).
    Recorded calls are forgotten, since a replay repeats the path its recording took."""
    global enabled
    enabled = on
    _program._PROGRAMS.clear()


def _fits(call: _Call, x: Any) -> bool:
    return (
        enabled is not False
        and 0 < _plan.prod(tuple(x.shape)) * call.itemsize <= MAX_BYTES
        and _compile.has_cooperative_launch()
    )


def _backward_pays(call: _Call, plan: _plan.ColsPlan, channels: int) -> bool:
    """Whether the backward's single launch beats its three passes: a grid of at least 2/3 of
    the SMs' count in CTAs (one wave; fewer leave the sums pass short of bandwidth) with a warp
    for each channel in its merge phase. Measured (H200, bf16, resnet50's inputs): it won on every
    input with 98 or more CTAs and at most 8 channels per CTA, and lost on all others (49 CTAs:
    256 x 14x14 at batch 64, 18.5 -> 21.7 us; 1024 channels on 98 CTAs, 56.7 -> 63.2 us)."""
    ctas = plan.ctas_per_sample
    warps = plan.tx * plan.ty // 32
    return 3 * ctas >= 2 * call.info.sm_count and channels <= ctas * warps


def _grid(
    call: _Call, kernel: str, rows: int, channels: int, aligned: bool, smem_of: Callable
) -> tuple[_plan.ColsPlan, int]:
    """One wave of the kernel's resident CTAs of COLS_THREADS threads, and its shared memory."""
    threads = _plan.COLS_THREADS
    resident = _compile.resident_ctas(
        call.device, _SINGLE, kernel, call.dtype, call.param_dtype, threads,
        smem_of(threads, call.vec, True),
    )  # fmt: skip
    plan = _plan.plan_cols(1, rows, channels, call.itemsize, aligned, call.info, resident, threads)
    vec = call.vec if plan.vectorized else 1
    return plan, smem_of(plan.tx * plan.ty, vec, plan.vectorized)


def _key(call: _Call, kernel: str, plan: _plan.ColsPlan, smem: int) -> tuple:
    return (call.device, kernel, call.dtype, call.param_dtype, plan, smem)


def _launch(call: _Call, kernel: str, plan: _plan.ColsPlan, smem: int, args: tuple) -> bool:
    try:
        call.launch(_SINGLE, kernel, plan.ctas_per_sample, (plan.tx, plan.ty), args, smem=smem)
    except Exception as error:  # cupy's CUDADriverError (cupy.cuda.driver needs a GPU to import)
        if getattr(error, "status", None) != _compile.CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE:
            raise
        _refused.add(_key(call, kernel, plan, smem))
        call.opaque()  # the recorded launch failed: this call is never replayed
        return False
    return True


def batch_norm_fwd_cols(
    call: _Call,
    x: Any,
    y: Any,
    weight: Any,
    bias: Any,
    mean: Any,
    rstd: Any,
    running_mean: Any,
    running_var: Any,
    batches_tracked: Any,
    momentum: float,
    eps: float,
    rows: int,
    channels: int,
    new_running_mean: Any = None,
    new_running_var: Any = None,
) -> bool:
    """y, mean, rstd (and the running statistics and batch counter, updated in the kernel: in
    place, or into ``new_running_*`` when given) of BatchNorm training over x viewed as (rows,
    channels), channels innermost; False when it does not apply (unless :data:`enabled` is
    True)."""
    if enabled is not True or not _fits(call, x):
        return False
    kernel = "single_launch_batch_norm_fwd_cols"
    acc_size = _ITEMSIZE[call.acc]

    def smem_of(threads: int, vec: int, staged: bool) -> int:
        return _plan.stats_cols_smem(threads, vec, staged, acc_size)

    plan, smem = _grid(call, kernel, rows, channels, call.aligned(x, y), smem_of)
    if _key(call, kernel, plan, smem) in _refused:
        return False
    partials = call.stats((plan.ctas_per_sample * channels * 3,), x)
    arrived = call.stats((1,), x)
    call.zero(arrived, 1)
    unbias = rows / (rows - 1) if rows > 1 else float("nan")
    i64 = np.int64
    # fmt: off
    return _launch(call, kernel, plan, smem, (
        call.ptr(x), call.ptr(y), call.ptr(weight), call.ptr(bias), call.ptr(partials),
        call.ptr(arrived), call.ptr(mean), call.ptr(rstd), call.ptr(running_mean),
        call.ptr(running_var), call.ptr(batches_tracked), i64(rows), i64(channels),
        np.float64(rows), _scalar(call.acc, eps), _scalar(call.acc, momentum),
        _scalar(call.acc, unbias), np.int32(plan.vectorized),
        call.ptr(running_mean if new_running_mean is None else new_running_mean),
        call.ptr(running_var if new_running_var is None else new_running_var)))
    # fmt: on


def batch_norm_bwd_cols(
    call: _Call,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    dx: Any,
    dweight: Any,
    dbias: Any,
    rows: int,
    channels: int,
    training: bool,
) -> bool:
    """dx, dweight, dbias (each may be None) of BatchNorm over x viewed as (rows, channels),
    channels innermost, given its (channels,) mean and rstd; False when it does not apply."""
    if not _fits(call, x):
        return False
    kernel = "single_launch_batch_norm_bwd_cols"
    acc_size = _ITEMSIZE[call.acc]

    def smem_of(threads: int, vec: int, staged: bool) -> int:
        return threads * vec * 2 * acc_size  # bwd_sums_cols' block sums

    plan, smem = _grid(call, kernel, rows, channels, call.aligned(x, dy, dx), smem_of)
    if enabled is None and not _backward_pays(call, plan, channels):
        return False
    if _key(call, kernel, plan, smem) in _refused:
        return False
    partials = call.stats((channels * plan.ctas_per_sample * 2,), x)
    u, v = (call.stats((channels,), x) for _ in range(2)) if dx is not None else (None, None)
    arrived = call.stats((1,), x)
    call.zero(arrived, 1)
    i64 = np.int64
    # fmt: off
    return _launch(call, kernel, plan, smem, (
        call.ptr(x), call.ptr(dy), call.ptr(dx), call.ptr(weight), call.ptr(mean), call.ptr(rstd),
        call.ptr(partials), call.ptr(arrived), call.ptr(u), call.ptr(v), call.ptr(dweight),
        call.ptr(dbias), i64(rows), i64(channels), np.float64(rows), np.int32(training),
        np.int32(plan.vectorized)))
    # fmt: on
