"""The channels family (``cuda_src/channel_norm.cu``): LayerNorm / RMSNorm over the C channels of
each pixel of NCHW data, per (sample, pixel).

A CTA of (PX, CY) threads owns PX packs of adjacent pixels of one sample; thread (tx, ty) keeps
the packs of channels ty, ty + CY, ... in registers (at most ``cpt`` of them). The plan picks
CY = ceil(C / cpt) and as many pixel packs per CTA as keep it near ``TILE_THREADS`` threads and
within what the kernel's registers allow; a C too large for that has no plan (the caller takes
another route). channels_last data is the row norm on the (N * S, C) view, not this family.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _compile, _plan
from ._launch import _Call, _scalar, _weight_grads

_CHANNEL = "channel_norm.cu"

#: channels per thread in registers: cuda_src/channel_norm.cu's CHANNEL_FWD_CPT / CHANNEL_BWD_CPT
FWD_CPT = 16
BWD_CPT = 8
#: threads a CTA aims for (not measured yet: 256 keeps two fp32 forward CTAs of 96 registers
#: per SM, 16 loads of 16 bytes in flight per thread)
TILE_THREADS = 256
#: widest tile, in packs along the pixels (64 packs of 16 bytes: 1 KiB per channel row)
MAX_PX = 64
#: narrowest tile: 4 packs of 16 bytes (64 contiguous bytes, two full 32-byte sectors) per row
MIN_PX = 4
#: resident CTAs per SM the backward's grid-stride kernel is launched with, at most
BWD_CTAS_PER_SM = 4


@dataclass(frozen=True)
class ChannelPlan:
    px: int  # pixel packs per CTA (blockDim.x)
    cy: int  # thread rows over the channels (blockDim.y)
    tiles: int  # tiles per sample
    vectorized: bool  # packs of VEC pixels (16-byte accesses)
    smem: int  # dynamic shared memory, bytes


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def plan_channels(
    C: int, S: int, itemsize: int, aligned: bool, cpt: int, max_threads: int, slots: int
) -> ChannelPlan | None:
    """The CTA shape for C channels of S pixels, or None when C needs more threads than
    ``max_threads``. ``slots``: accumulators per thread in shared memory per pixel of a pack
    (the kernel's column sums), ``aligned``: 16-byte accesses possible for every tensor."""
    vec = _plan.vec_width(itemsize)
    vectorized = aligned and S % vec == 0 and vec > 1
    unit = vec if vectorized else 1
    packs = S // unit
    cy = -(-C // cpt)
    px = min(MAX_PX, _pow2_floor(TILE_THREADS // cy), _pow2_floor(2 * packs - 1))
    px = max(px, MIN_PX)
    while px * cy > max_threads and px > MIN_PX:
        px //= 2
    if px * cy > max_threads:
        return None
    acc = 8 if itemsize == 8 else 4
    smem = px * cy * max(unit, slots) * acc
    return ChannelPlan(px, cy, -(-packs // px), vectorized, smem)


def max_threads(call: _Call, kernel: str) -> int:
    return call.threads(_CHANNEL, kernel, 1024)


def fwd_kernel(rms: bool) -> str:
    return "channel_norm_fwd_rms" if rms else "channel_norm_fwd_layer"


def forward(call: _Call, x, y, weight, bias, mean, rstd, C: int, S: int, eps: float, rms: bool):
    """One launch: y, and mean / rstd (N, S) when given, of x (N, C, S) contiguous."""
    N = x.shape[0]
    kernel = fwd_kernel(rms)
    aligned = call.aligned(x, y)
    plan = plan_channels(C, S, call.itemsize, aligned, FWD_CPT, max_threads(call, kernel), 1)
    # fmt: off
    call.launch(_CHANNEL, kernel, N * plan.tiles, (plan.px, plan.cy), (
        call.ptr(x), call.ptr(y), call.ptr(weight), call.ptr(bias), call.ptr(mean),
        call.ptr(rstd), np.int32(C), np.int64(S), np.int64(plan.tiles), _scalar(call.acc, eps),
        np.int32(plan.vectorized)), plan.smem)
    # fmt: on


def backward(call: _Call, dy, x, mean, rstd, weight, dx, dweight, dbias, C: int, S: int):
    """dx (or None) and dweight / dbias (C,) (or None) of x (N, C, S) contiguous: one grid-stride
    launch with fp32 partial rows per CTA, then their ordered sum per channel."""
    N = x.shape[0]
    kernel = "channel_norm_bwd_dx"
    aligned = call.aligned(x, dy, dx)
    plan = plan_channels(C, S, call.itemsize, aligned, BWD_CPT, max_threads(call, kernel), 2)
    threads = plan.px * plan.cy
    resident = _compile.resident_ctas(
        call.device, _CHANNEL, kernel, call.dtype, call.param_dtype, threads, plan.smem
    )
    ctas = max(1, min(N * plan.tiles, call.info.sm_count * min(resident, BWD_CTAS_PER_SM)))
    dweight_part = call.stats((ctas * C,), x) if dweight is not None else None
    dbias_part = call.stats((ctas * C,), x) if dbias is not None else None
    # fmt: off
    call.launch(_CHANNEL, kernel, ctas, (plan.px, plan.cy), (
        call.ptr(x), call.ptr(dy), call.ptr(weight), call.ptr(mean), call.ptr(rstd),
        call.ptr(dx), call.ptr(dweight_part), call.ptr(dbias_part), np.int32(C), np.int64(S),
        np.int64(plan.tiles), np.int64(N), np.int32(plan.vectorized)), plan.smem)
    # fmt: on
    if dweight is not None or dbias is not None:
        _weight_grads(call, dweight_part, dbias_part, dweight, dbias, ctas, C, weight is not None)


def fits(call: _Call, C: int, backward: bool) -> bool:
    """Whether C channels have a plan (enough threads for ceil(C / cpt) rows of MIN_PX packs)."""
    cpt = BWD_CPT if backward else FWD_CPT
    kernel = "channel_norm_bwd_dx" if backward else fwd_kernel(False)
    return -(-C // cpt) * MIN_PX <= max_threads(call, kernel)
