"""Planning: which kernel strategy, grid and block a call gets from shape, layout, dtype, device.

Every decision lives here as a named threshold with the reason for it, and every plan is a frozen
dataclass cached per signature, so the launch code only reads numbers.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

# ---- thresholds ---------------------------------------------------------------------------------
#: A segment of at most this many bytes is normalized by one CTA holding it in shared memory
#: (one read, one write). 96 KiB leaves room for two such CTAs per SM on sm_90 (227 KiB opt-in)
#: and on sm_80 (163 KiB), so one CTA's load overlaps another's store.
SEGMENT_BLOCK_MAX_BYTES = 96 * 1024
#: Team slices aim at this size: three 64 KiB CTAs fit on an SM of sm_80 and sm_90. InstanceNorm
#: fp32 112x64x512x512 on an H200: 16 KiB slices 5.62 ms, 32 KiB 4.66 ms, 64 KiB 4.56-4.77 ms.
TEAM_SLICE_TARGET_BYTES = 64 * 1024
#: Largest team. GroupNorm(8) fp32 112x64x512x512 (8 MiB segments) on an H200: a team of 128
#: 5.52-5.67 ms vs the split path's 5.45-5.58 ms, so long segments go to the split path.
TEAM_MAX = 32
#: Split path: CTAs per SM to aim for, so every SM has loads in flight from several CTAs.
SPLIT_CTAS_PER_SM = 8
#: Split path: the fewest elements a statistics CTA reduces (below this, launch cost dominates).
SPLIT_MIN_ELEMENTS_PER_CTA = 4096
#: Threads of the 1-D kernels; packs each thread of an on-chip segment kernel moves.
BLOCK_THREADS = 256
PACKS_PER_THREAD = 8
#: Packs each thread moves per tile of the rows apply/backward passes. Small tiles balance the
#: SMs best (BatchNorm fp32 64x64x512x512 apply on an H200, 2 / 4 / 8 / 16 / 32 / 64 packs:
#: 2.01 / 2.10-2.12 / 2.14 / 2.18 / 2.19 / 2.21 ms; a copy of the tensor: 2.01 ms).
APPLY_PACKS_PER_THREAD = 2
#: Threads of a columns-layout statistics CTA (TX channel packs x TY rows); COLS_THREADS_MAX of
#: the kernels. The apply/dx/backward-sums CTAs have COLS_APPLY_THREADS (BatchNorm fp16
#: channels_last apply, 8 rows per thread in flight: 128 threads 206 us, 256 threads 213 us).
COLS_THREADS = 256
COLS_APPLY_THREADS = 128
#: Rows per channel a columns-statistics thread reduces exactly per merge (the kernels' define);
#: its 16-byte packs are double-buffered in shared memory, this many per thread per stage.
COLS_STATS_ROWS = 8
#: Columns apply/dx passes: CTAs per SM to aim for. Many short chunks balance the SMs (BatchNorm
#: fp16 channels_last 256x64x112x112 apply on an H200: 8/SM 232 us, 32/SM 211 us). The columns
#: statistics pass instead runs one wave, as many CTAs as are resident at once (2/SM: 117 us,
#: 4/SM: 130 us, 8/SM: 157 us): each extra wave adds a tail and a block merge per CTA.
COLS_APPLY_CTAS_PER_SM = 32
COLS_MAX_TX = 64
#: Fewest rows a columns-layout thread walks: fewer means more partial triples to write, merge in
#: the CTA and merge again in finalize than rows of data (see benchmarks/NOTES.md).
COLS_MIN_ROWS_PER_THREAD = 32
#: The same for the apply and dx passes, which write no partials: one unrolled block of rows
#: (COLS_APPLY_UNROLL of the kernels) per thread.
COLS_APPLY_MIN_ROWS_PER_THREAD = 8
#: Warps per CTA of the finalize kernel (one statistic set per warp).
FINALIZE_WARPS = 8


@dataclass(frozen=True)
class DeviceInfo:
    sm_count: int
    compute_capability: int  # major * 10 + minor
    smem_optin: int  # dynamic + static shared memory one block may opt into, bytes


@functools.cache
def device_info(device_id: int) -> DeviceInfo:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return DeviceInfo(
        sm_count=props["multiProcessorCount"],
        compute_capability=props["major"] * 10 + props["minor"],
        smem_optin=props["sharedMemPerBlockOptin"],
    )


def vec_width(itemsize: int) -> int:
    """Elements per 16-byte access."""
    return 16 // itemsize


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---- layouts ------------------------------------------------------------------------------------
def classify_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    """'contiguous', 'channels_last' (channel innermost, then spatial, batch outermost) or 'other'.

    Strides of size-1 dimensions are ignored, as torch does. Shapes whose two layouts coincide
    (C == 1 or a single spatial element) are 'contiguous'.
    """

    def matches(order: list[int]) -> bool:
        expected = 1
        for d in reversed(order):  # order lists dims outermost -> innermost
            if shape[d] != 1 and strides[d] != expected:
                return False
            expected *= shape[d]
        return True

    ndim = len(shape)
    if matches(list(range(ndim))):
        return "contiguous"
    if ndim >= 3 and matches([0, *range(2, ndim), 1]):
        return "channels_last"
    return "other"


# ---- plans ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentPlan:
    """On-chip normalization of contiguous segments (segment_norm.cu)."""

    team: int  # CTAs per segment exchanging statistics through global memory (1: none)
    slice_len: int
    threads: int
    smem: int
    vectorized: bool


@functools.cache
def plan_segment(
    seg_len: int, itemsize: int, aligned: bool, device: DeviceInfo, tensors: int = 1
) -> SegmentPlan | None:
    """The on-chip plan for segments of ``seg_len`` elements, or None when a segment doesn't fit.

    A segment larger than one CTA's shared memory is split over a team of CTAs (slices of about
    TEAM_SLICE_TARGET_BYTES) that exchange statistics through global memory; a team is kept small
    enough to fit on the GPU at once with room to spare. (Splitting the segments of small problems
    for more CTAs in flight was measured and did not help: GroupNorm(32) fp16 16x320x64x64
    35 -> 38 us on an H200; benchmarks/NOTES.md.)
    """
    vec = vec_width(itemsize)
    vectorized = aligned and seg_len % vec == 0
    unit = vec if vectorized else 1
    seg_bytes = seg_len * itemsize * tensors  # ``tensors`` arrays of the segment held on chip
    smem_budget = device.smem_optin - 1024  # static shared memory of the kernel
    team = 1
    if seg_bytes > min(SEGMENT_BLOCK_MAX_BYTES, smem_budget):
        team = -(-seg_bytes // TEAM_SLICE_TARGET_BYTES)
        if team > TEAM_MAX:
            return None
    slice_len = round_up(-(-seg_len // team), unit)
    team = -(-seg_len // slice_len)
    packs = -(-slice_len // unit)
    threads = min(1024, max(32, round_up(-(-packs // PACKS_PER_THREAD), 32)))
    smem = tensors * round_up(slice_len * itemsize, 16)
    # a team must fit on the GPU at once: count the CTAs each SM can hold by shared memory and
    # threads, and leave half of them for other work sharing the GPU
    per_sm = min((device.smem_optin + 1024) // (smem + 1024), 2048 // threads)
    if team > 1 and 2 * team > per_sm * device.sm_count:
        return None
    return SegmentPlan(team, slice_len, threads, smem, vectorized)


@dataclass(frozen=True)
class RowsStatsPlan:
    """Partial statistics over sets of contiguous runs (strided_norm_stats_rows)."""

    chunk: int
    ctas_per_set: int
    threads: int
    vectorized: bool


@functools.cache
def plan_rows_stats(
    num_sets: int, set_len: int, run_len: int, itemsize: int, aligned: bool, device: DeviceInfo
) -> RowsStatsPlan:
    vec = vec_width(itemsize)
    vectorized = aligned and run_len % vec == 0
    unit = vec if vectorized else 1
    # at most one wave of SPLIT_CTAS_PER_SM per SM (rounded down): rounded up, 64 sets took
    # 17 CTAs each, 1088 CTAs on 1056 slots, and a second wave of 32 long CTAs that no longer
    # kept the DRAM busy (BatchNorm fp32 64x64x512x512: 3.023 -> 2.973 ms; NOTES.md)
    want = max(1, device.sm_count * SPLIT_CTAS_PER_SM // num_sets)
    most = max(1, set_len // SPLIT_MIN_ELEMENTS_PER_CTA)
    ctas = min(want, most)
    chunk = round_up(-(-set_len // ctas), unit)
    return RowsStatsPlan(chunk, -(-set_len // chunk), BLOCK_THREADS, vectorized)


@dataclass(frozen=True)
class RowsApplyPlan:
    tile_len: int
    tiles_per_plane: int
    threads: int
    vectorized: bool


@functools.cache
def plan_rows_apply(plane_len: int, itemsize: int, aligned: bool) -> RowsApplyPlan:
    vec = vec_width(itemsize)
    vectorized = aligned and plane_len % vec == 0
    unit = vec if vectorized else 1
    packs = -(-plane_len // unit)
    threads = min(BLOCK_THREADS, max(32, round_up(packs, 32)))
    tile_len = threads * unit * APPLY_PACKS_PER_THREAD
    return RowsApplyPlan(tile_len, max(1, -(-plane_len // tile_len)), threads, vectorized)


@dataclass(frozen=True)
class ColsPlan:
    """Channel-innermost passes (strided_norm_stats_cols / _apply_cols). Each sample's rows are
    dealt to its ``ctas_per_sample`` CTAs in interleaved blocks, and the channels' tiles of ``tx``
    packs to the ``col_tiles`` CTAs of the grid's y dimension (see strided_norm.cu)."""

    tx: int
    ty: int
    ctas_per_sample: int
    vectorized: bool
    col_tiles: int = 1

    def grid(self, samples: int) -> tuple[int, int]:
        return samples * self.ctas_per_sample, self.col_tiles


@functools.cache
def plan_cols(
    samples: int,
    rows: int,
    channels: int,
    itemsize: int,
    aligned: bool,
    device: DeviceInfo,
    ctas_per_sm: int,
    threads: int = COLS_THREADS,
    min_rows: int = COLS_MIN_ROWS_PER_THREAD,
) -> ColsPlan:
    """Grid of a channel-innermost pass of CTAs of about ``threads`` threads, aiming at
    ``ctas_per_sm`` CTAs per SM: the statistics pass asks for one wave (what its registers leave
    resident), the apply passes for COLS_APPLY_CTAS_PER_SM; each thread walks at least
    ``min_rows`` rows."""
    vec = vec_width(itemsize)
    vectorized = aligned and channels % vec == 0
    packs = channels // vec if vectorized else channels
    tx = min(packs, COLS_MAX_TX)
    ty = max(1, threads // tx)
    # rounded down: one CTA over a full wave is a second wave (GroupNorm(32) fp16 channels_last
    # 16x320x64x64 statistics: 17 CTAs per sample on 264 resident slots was 272 CTAs)
    want = max(1, device.sm_count * ctas_per_sm // samples)
    ctas = max(1, min(want, -(-rows // (min_rows * ty))))
    # Few rows of many channels (a resnet50 layer4 BatchNorm: 3136 rows of 2048 at batch 64) leave
    # the rows alone too few CTAs (24 of 264): the channel tiles fill the rest of the grid, with the
    # same partials per channel.
    col_tiles = max(1, min(-(-packs // tx), want // ctas))
    return ColsPlan(tx, ty, ctas, vectorized, col_tiles)


def stats_cols_smem(threads: int, vec: int, staged: bool, acc_size: int) -> int:
    """Dynamic shared memory of a columns statistics block: its triples, overlaying (16-byte
    packs) the two stages of staged rows."""
    ring = 2 * COLS_STATS_ROWS * threads * 16 if staged else 0
    return max(threads * vec * 3 * acc_size, ring)


def finalize_grid(num_sets: int) -> tuple[int, int]:
    """(CTAs, threads) of the finalize kernel."""
    return -(-num_sets // FINALIZE_WARPS), 32 * FINALIZE_WARPS


def prod(values: tuple[int, ...]) -> int:
    return math.prod(values)


# ---- row norms (LayerNorm / RMSNorm over the last dims) ------------------------------------------
#: Packs each thread of the long-row apply pass and of the backward sums pass moves per CTA tile.
ROWS_TILE_PACKS_PER_THREAD = 8
#: Packs of a column tile each thread of segment_norm_bwd_rows_dx owns (the kernel's
#: ROWS_BWD_PACKS): their weight and dweight/dbias partials live in registers.
ROWS_BWD_PACKS_PER_THREAD = 2
#: CTAs per SM the backward dx pass aims at; each CTA keeps one fp32 partial row of dweight and
#: dbias over its group of rows, so more CTAs mean more partial rows for the final column sums.
#: Not yet measured on a GPU: two per SM keeps the partials at 2 * SMs rows.
ROWS_BWD_CTAS_PER_SM = 2


@dataclass(frozen=True)
class RowsTilePlan:
    """Rows cut into tiles of ``tile_len`` elements, one CTA each (apply, backward sums)."""

    tile_len: int
    tiles: int
    threads: int
    vectorized: bool


@functools.cache
def plan_rows_tiles(row_len: int, itemsize: int, aligned: bool) -> RowsTilePlan:
    vec = vec_width(itemsize)
    vectorized = aligned and row_len % vec == 0
    unit = vec if vectorized else 1
    packs = -(-row_len // unit)
    threads = min(BLOCK_THREADS, max(32, round_up(-(-packs // ROWS_TILE_PACKS_PER_THREAD), 32)))
    tile_len = threads * unit * ROWS_TILE_PACKS_PER_THREAD
    return RowsTilePlan(tile_len, -(-row_len // tile_len), threads, vectorized)


@dataclass(frozen=True)
class RowsBackwardPlan:
    """segment_norm_bwd_rows_dx: column tiles x groups of rows (one partial row per group)."""

    col_tiles: int
    groups: int
    rows_per_group: int
    threads: int
    vectorized: bool


@functools.cache
def plan_rows_backward(
    rows: int,
    row_len: int,
    itemsize: int,
    aligned: bool,
    device: DeviceInfo,
    max_threads: int = BLOCK_THREADS,
) -> RowsBackwardPlan:
    """``max_threads``: what the kernel's registers allow (a multiple of 32)."""
    vec = vec_width(itemsize)
    vectorized = aligned and row_len % vec == 0
    unit = vec if vectorized else 1
    packs = -(-row_len // unit)
    wanted = max(32, round_up(-(-packs // ROWS_BWD_PACKS_PER_THREAD), 32))
    threads = min(BLOCK_THREADS, max_threads, wanted)
    col_tiles = -(-packs // (threads * ROWS_BWD_PACKS_PER_THREAD))
    groups = max(1, min(rows, device.sm_count * ROWS_BWD_CTAS_PER_SM // col_tiles))
    rows_per_group = -(-rows // groups)
    groups = -(-rows // rows_per_group)
    return RowsBackwardPlan(col_tiles, groups, rows_per_group, threads, vectorized)


#: row_norm.cu's short rows: a group of SHORT_ROW_LANES lanes of a warp per row, each lane holding
#: up to SHORT_ROW_PACKS packs of 16 bytes (its kernels' SHORT_PACKS), SHORT_ROW_THREADS threads per
#: CTA (SHORT_THREADS), rows of up to SHORT_ROW_MAX_PACKS packs (1024 bf16 values) in both
#: directions. A CTA per row (segment_norm.cu) is a 32-thread CTA for any row of up to 256 packs and
#: at most 32 of them per SM: ~6 KB in flight per SM for rows of 96 bf16 channels. LayerNorm2d
#: bf16 channels_last 64x96x56x56 forward + backward on an H200: 0.852 -> 0.074 ms of GPU time
#: (torch 0.443); the group backward also beat the CTA-per-row one for 32-128 packs (rows of 1024
#: bf16: 0.485 -> 0.388 ms per 256 MiB), so it takes every short row (benchmarks/NOTES.md).
SHORT_ROW_LANES = (4, 8, 16, 32)
SHORT_ROW_PACKS = 4
SHORT_ROW_THREADS = 256
SHORT_ROW_MAX_PACKS = SHORT_ROW_PACKS * max(SHORT_ROW_LANES)


@dataclass(frozen=True)
class ShortRowPlan:
    lanes: int  # lanes per row: the kernels' LANES template value
    rows_per_cta: int


@functools.cache
def plan_short_rows(row_len: int, itemsize: int, aligned: bool) -> ShortRowPlan | None:
    """The short-row kernels' plan for rows of ``row_len``, or None (unaligned, not whole packs,
    or longer than SHORT_ROW_MAX_PACKS)."""
    vec = vec_width(itemsize)
    if not aligned or row_len % vec or row_len // vec > SHORT_ROW_MAX_PACKS:
        return None
    packs = row_len // vec
    lanes = next(n for n in SHORT_ROW_LANES if packs <= SHORT_ROW_PACKS * n)
    return ShortRowPlan(lanes, SHORT_ROW_THREADS // lanes)


#: row_norm.cu's backward: a CTA of at most ROW_BWD_THREADS threads per row (its launch bound),
#: each thread holding up to 4 packs of 16 bytes of x and of dy and its weight-gradient sums (8
#: would be over 255 registers for bf16), for whole-pack rows longer than the short rows.
ROW_BWD_THREADS = 256
ROW_BWD_PACKS = (1, 2, 4)
ROW_BWD_MIN_PACKS = SHORT_ROW_MAX_PACKS + 1


@dataclass(frozen=True)
class RowCtaPlan:
    """A CTA per row held in registers (row_norm.cu's forward and one-pass backward)."""

    packs: int  # the kernel's PACKS template value (packs per thread, at most)
    threads: int


#: rows of 129 to 1024 whole packs: the forward on a CTA per row in registers
#: (row_norm_fwd_cta_*), else one CTA per row staged through shared memory (segment_norm_fwd_*)
ROW_FWD_CTA = True
ROW_FWD_PACKS = 4  # packs per thread of the forward's CTA, at most (its PACKS template values)


def plan_row_fwd(row_len: int, itemsize: int, aligned: bool) -> RowCtaPlan | None:
    """The forward's CTA per row for the rows plan_row_bwd takes: the fewest threads that hold
    the row at ROW_FWD_PACKS packs each (small CTAs: more rows in flight per SM); or None."""
    if not ROW_FWD_CTA or plan_row_bwd(row_len, itemsize, aligned) is None:
        return None
    packs = row_len // vec_width(itemsize)
    threads = round_up(-(-packs // ROW_FWD_PACKS), 32)
    per_thread = -(-packs // threads)
    return RowCtaPlan(next(p for p in ROW_BWD_PACKS if p >= per_thread), threads)


@functools.cache
def plan_row_bwd(row_len: int, itemsize: int, aligned: bool) -> RowCtaPlan | None:
    """The one-pass backward's plan for rows of ``row_len``, or None when it does not take them
    (unaligned, not whole packs, too short or too long)."""
    vec = vec_width(itemsize)
    if not aligned or row_len % vec:
        return None
    packs = row_len // vec
    if packs < ROW_BWD_MIN_PACKS:
        return None
    for per_thread in ROW_BWD_PACKS:
        threads = round_up(-(-packs // per_thread), 32)
        if threads <= ROW_BWD_THREADS:
            return RowCtaPlan(per_thread, threads)
    return None
