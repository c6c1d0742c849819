"""The channels family (``cuda_src/channel_norm.cu``): LayerNorm / RMSNorm over the C channels of
each pixel of NCHW data, per (sample, pixel).

Two forwards. Thin tiles (C up to ``THIN_MAX_C``): a thread holds 8 packs of 16 bytes (4 with
``THIN_CPT4_MAX_C``; 16 single elements when unaligned), a CTA of at most 256 threads sums a column
by warp shuffles and one pass through shared memory, and many small CTAs share an SM. Register tiles
(more channels, and the backward): a CTA of (PX, CY) threads owns PX packs of adjacent pixels of one
sample; thread (tx, ty) keeps the packs of channels ty, ty + CY, ... in registers (at most ``cpt``
of them); the plan picks CY = ceil(C / cpt) and as many pixel packs per CTA as keep it near
``TILE_THREADS`` threads and within what the kernel's registers allow; a C too large for that has no
plan (the caller takes another route). channels_last data is the row norm on the (N * S, C) view,
not this family.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _compile, _plan, _program
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

#: Thin-tile forward (channel_fwd_thin) for C up to this. The register tiles ran KernelBench
#: L1-36 (C = 64, fp32) at 67% of copy bandwidth with 96 registers and ~2 CTAs per SM; thin tiles
#: keep few values per thread, as torch.compile's kernel does. Measured (H200, 2026-11-27): L1-36
#: 5.37 -> 3.98 ms (66% -> 90% of copy bandwidth; torch.compile 4.23 ms in the same run),
#: LayerNorm2d(96) bf16 64x96x56x56 0.081 -> 0.036 ms (compile 0.071). 256: a CTA of 256
#: threads of 8 packs. More channels keep the register tiles (their column sums read fewer
#: partials).
THIN_MAX_C = 256
#: the thin kernels' __launch_bounds__ (threads per CTA, at most)
THIN_MAX_THREADS = 256
#: packs per thread: 4 of 16 bytes up to this many channels, 8 above; unaligned data: 16 single
#: elements (the _thin_scalar kernels). 0: 8 everywhere. Measured (H200, 2026-11-27): equal on
#: L1-36 (3.980 / 3.979 ms), 8 packs 1.6x faster on LayerNorm2d(96) bf16 (0.058 / 0.036 ms)
THIN_CPT4_MAX_C = 0
#: contiguous bytes of one channel row a warp reads per access: a full 128-byte line
THIN_ROW_BYTES = 128
#: narrowest thin tile in packs (a warp of 8 channel rows of 4 packs)
THIN_MIN_PX = 4
#: A grid that keeps at least this many CTAs with tiles twice as wide gets them, up to 32 packs
#: (512 bytes of a channel row per access: fewer, longer runs of each DRAM page). Measured (H200,
#: 2026-11-28, thin8, CUDA events, L2 flushed, three rounds): KernelBench L1-36 (fp32
#: 112x64x512x512; 917,504 tiles of 8 packs) 3.975 ms at 8 packs, 3.677 at 16, **3.674 at 32**
#: (a copy of the tensor 3.509: 95.5% of it; torch.compile 3.95 in the 11-27 bench);
#: LayerNorm2d(96) bf16 64x96x56x56 (3,136 tiles) 0.038 ms at 8 packs, 0.0525 at 16: small
#: grids keep the narrow tile.
#: Streaming cache hints on x and y (ld/st.global.cs; tried, removed) were slower: 4.18 / 3.79 ms.
THIN_WIDE_MIN_CTAS = 1 << 16
#: None: thin tiles for C <= THIN_MAX_C; True: wherever they have a plan; False: never
#: (set by :func:`enable_thin`: the GPU tests and the bench run both forwards)
thin: bool | None = None


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
    if uses_thin(C) and forward_thin(call, x, y, weight, bias, mean, rstd, C, S, eps, rms):
        return
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


def uses_thin(C: int) -> bool:
    """Whether the forward of C channels tries the thin tiles first (see ``thin``)."""
    return thin is True or (thin is None and C <= THIN_MAX_C)


def enable_thin(on: bool | None) -> None:
    """Thin tiles wherever they have a plan (True), never (False), or for C <= THIN_MAX_C (None).
    Recorded calls are forgotten, since a replay repeats the path its recording took."""
    global thin
    thin = on
    _program._PROGRAMS.clear()


@dataclass(frozen=True)
class ThinPlan:
    kernel: str
    px: int  # pixel packs per tile (blockDim.x): a power of two <= 32
    cy: int  # thread rows over the channels (blockDim.y): a multiple of 32 // px
    tiles: int  # tiles per sample
    smem: int  # dynamic shared memory, bytes (0: one warp, shuffles only)


def thin_kernel(C: int, rms: bool, vectorized: bool, cpt: int | None = None):
    """(kernel name, packs per thread) of the thin forward; ``cpt`` 4 or 8 (vectorized only)."""
    op = "rms" if rms else "layer"
    if not vectorized:
        return f"channel_norm_fwd_{op}_thin_scalar", 16
    cpt = cpt or (4 if C <= THIN_CPT4_MAX_C else 8)
    return f"channel_norm_fwd_{op}_thin{cpt}", cpt


def plan_thin(
    N: int,
    C: int,
    S: int,
    itemsize: int,
    vectorized: bool,
    rms: bool,
    kernel: str,
    cpt: int,
    max_threads: int,
    px: int | None = None,
) -> ThinPlan | None:
    """The thin tile for N samples of C channels of S pixels, or None when C needs more than
    ``max_threads`` threads or the tiles overflow the kernel's 32-bit tile index. ``px``: the
    tile's width in packs (a power of two <= 32), by default a 128-byte row per warp access,
    widened when there are few channel rows or very many tiles (``THIN_WIDE_MIN_CTAS``),
    narrowed when there are few pixels."""
    unit = _plan.vec_width(itemsize) if vectorized else 1
    packs = S // unit
    rows = -(-C // cpt)
    if px is None:
        px = max(THIN_MIN_PX, min(32, THIN_ROW_BYTES // (unit * itemsize)))
        while px < 32 and rows < 32 // px:  # few channel rows: more lanes along the pixels
            px *= 2
        while px > THIN_MIN_PX and px // 2 >= packs:  # few pixels: a narrower tile
            px //= 2
        while px < 32 and N * -(-packs // (2 * px)) >= THIN_WIDE_MIN_CTAS:  # huge: wider
            px *= 2
    cy = _plan.round_up(rows, 32 // px)
    while px * cy > max_threads and px > THIN_MIN_PX:
        px //= 2
        cy = _plan.round_up(rows, 32 // px)
    tiles = -(-packs // px)
    if px * cy > max_threads or N * tiles >= 2**31:
        return None
    warps = px * cy // 32
    acc = 8 if itemsize == 8 else 4
    slots = unit if rms else 2 * unit  # the sums per pixel of the kernel's widest column sum
    smem = 0 if warps == 1 else 2 * warps * px * slots * acc
    return ThinPlan(kernel, px, cy, tiles, smem)


def forward_thin(
    call: _Call,
    x,
    y,
    weight,
    bias,
    mean,
    rstd,
    C: int,
    S: int,
    eps: float,
    rms: bool,
    *,
    cpt: int | None = None,
    px: int | None = None,
) -> ThinPlan | None:
    """The thin forward's launch (as :func:`forward`), or None (nothing launched) when it has no
    plan. ``cpt``, ``px``: the plan's choices, for measurements."""
    N = x.shape[0]
    vectorized = call.vec > 1 and S % call.vec == 0 and call.aligned(x, y)
    kernel, cpt = thin_kernel(C, rms, vectorized, cpt)
    most = min(THIN_MAX_THREADS, max_threads(call, kernel))
    plan = plan_thin(N, C, S, call.itemsize, vectorized, rms, kernel, cpt, most, px)
    if plan is None:
        return None
    total = N * plan.tiles
    # fmt: off
    call.launch(_CHANNEL, kernel, total, (plan.px, plan.cy), (
        call.ptr(x), call.ptr(y), call.ptr(weight), call.ptr(bias), call.ptr(mean),
        call.ptr(rstd), np.int32(C), np.int64(S), np.int32(plan.tiles), np.int32(total),
        _scalar(call.acc, eps)), plan.smem)
    # fmt: on
    return plan


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
