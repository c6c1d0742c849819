"""Layout classification and strategy planning (pure functions of shapes and device limits)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cupynorm import _compile, _plan

H200 = _plan.DeviceInfo(sm_count=132, compute_capability=90, smem_optin=232448)
A100 = _plan.DeviceInfo(sm_count=108, compute_capability=80, smem_optin=166912)


@pytest.mark.parametrize(
    "shape,memory_format,expected",
    [
        ((2, 3, 4, 5), torch.contiguous_format, "contiguous"),
        ((2, 3, 4, 5), torch.channels_last, "channels_last"),
        ((2, 3, 4, 5, 6), torch.channels_last_3d, "channels_last"),
        ((2, 3, 1, 1), torch.channels_last, "contiguous"),  # the two layouts coincide
        ((2, 3), torch.contiguous_format, "contiguous"),
        ((2, 3, 7), torch.contiguous_format, "contiguous"),
    ],
)
def test_classify_layout(shape, memory_format, expected) -> None:
    x = torch.empty(shape).to(memory_format=memory_format)
    assert _plan.classify_layout(tuple(x.shape), x.stride()) == expected


def test_classify_strided_is_other() -> None:
    x = torch.empty(2, 6, 4, 5)[:, ::2]
    assert _plan.classify_layout(tuple(x.shape), x.stride()) == "other"
    t = torch.empty(2, 5, 4).transpose(1, 2)  # (N, C, L) with C innermost: channels last 1d
    assert _plan.classify_layout(tuple(t.shape), t.stride()) == "channels_last"


def test_segment_plan_block() -> None:
    plan = _plan.plan_segment(8192, 4, True, H200)  # one seed-002 row, fp32: 32 KiB
    assert plan is not None and plan.team == 1 and plan.vectorized
    assert plan.smem == 8192 * 4 and plan.threads % 32 == 0


@pytest.mark.parametrize("device", [H200, A100], ids=["sm90", "sm80"])
def test_segment_plan_team(device) -> None:
    plan = _plan.plan_segment(512 * 512, 4, True, device)  # an InstanceNorm plane, 1 MiB
    assert plan is not None and plan.team == 16
    assert plan.slice_len * plan.team >= 512 * 512 > plan.slice_len * (plan.team - 1)
    assert plan.smem <= device.smem_optin


def test_segment_plan_too_large() -> None:
    # GroupNorm(8) of 64 channels of 512 x 512: 8 MiB segments, more than TEAM_MAX slices
    assert _plan.plan_segment(8 * 512 * 512, 4, True, H200) is None


def test_segment_plan_unaligned_is_scalar() -> None:
    plan = _plan.plan_segment(7 * 13, 4, True, H200)
    assert plan is not None and not plan.vectorized and plan.slice_len == 91


def test_rows_stats_plan_covers_set() -> None:
    plan = _plan.plan_rows_stats(64, 64 * 512 * 512, 512 * 512, 4, True, H200)
    assert plan.chunk * plan.ctas_per_set >= 64 * 512 * 512
    assert plan.chunk % 4 == 0 and plan.ctas_per_set * 64 >= H200.sm_count


@pytest.mark.parametrize("num_sets", [1, 16, 64, 896, 5000])
def test_rows_stats_plan_stays_within_one_wave(num_sets) -> None:
    """At most SPLIT_CTAS_PER_SM CTAs per SM in all (one CTA per set when there are more sets),
    one more per set would overflow: no second wave of a few long CTAs."""
    plan = _plan.plan_rows_stats(num_sets, 1 << 24, 1 << 24, 4, True, H200)
    slots = H200.sm_count * _plan.SPLIT_CTAS_PER_SM
    assert num_sets * plan.ctas_per_set <= max(slots, num_sets)
    assert num_sets * (plan.ctas_per_set + 1) > slots  # and fills it up to less than a set's


@pytest.mark.parametrize("threads", [_plan.COLS_THREADS, _plan.COLS_APPLY_THREADS])
@pytest.mark.parametrize("ctas_per_sm", [1, 2, 8, 32])
def test_cols_plan(ctas_per_sm, threads) -> None:
    plan = _plan.plan_cols(16, 64 * 64, 320, 2, True, H200, ctas_per_sm, threads)
    assert plan.vectorized and plan.tx == 40 and threads - 40 < plan.tx * plan.ty <= threads
    # every CTA gets whole blocks of COLS_STATS_ROWS rows per thread (no empty CTA)
    block_rows = _plan.COLS_STATS_ROWS * plan.ty
    assert plan.ctas_per_sample <= (64 * 64) // block_rows


def test_cols_plan_constants_match_the_kernels() -> None:
    source = (Path(_compile.source_dir()) / "strided_norm.cu").read_text()
    assert f"#define COLS_STATS_ROWS {_plan.COLS_STATS_ROWS}\n" in source
    assert f"#define COLS_THREADS_MAX {_plan.COLS_THREADS}\n" in source


def test_cols_plan_aims_at_ctas_per_sm() -> None:
    rows = 256 * 112 * 112  # BatchNorm channels_last: the batch folded into the rows
    for ctas_per_sm in (2, 16):  # (at 32, COLS_MIN_ROWS_PER_THREAD caps the grid)
        plan = _plan.plan_cols(1, rows, 64, 2, True, H200, ctas_per_sm)
        target = H200.sm_count * ctas_per_sm  # within the rounding of rows per CTA
        assert target - target // 100 <= plan.ctas_per_sample <= target


@pytest.mark.parametrize("samples", [1, 3, 16, 100, 1000])
def test_cols_plan_stays_in_one_wave(samples) -> None:
    """The statistics grid asks for one wave of resident CTAs: never more CTAs than slots."""
    resident = 2
    plan = _plan.plan_cols(samples, 64 * 64, 320, 2, True, H200, resident)
    assert samples * plan.ctas_per_sample <= max(samples, H200.sm_count * resident)
    grid_x, tiles = plan.grid(samples)
    assert grid_x * tiles <= max(samples, H200.sm_count * resident)


@pytest.mark.parametrize("channels,itemsize", [(2048, 2), (2048, 4), (1031, 2), (512, 2)])
def test_cols_plan_deals_channel_tiles_when_rows_are_few(channels, itemsize) -> None:
    """resnet50's last stage at batch 64 (3136 rows): the rows alone give few CTAs, so the
    channels' tiles of tx packs spread over the grid's y dimension, within the one wave."""
    resident = 2
    plan = _plan.plan_cols(1, 64 * 7 * 7, channels, itemsize, True, H200, resident)
    packs = channels // _plan.vec_width(itemsize) if plan.vectorized else channels
    tiles_of_channels = -(-packs // plan.tx)
    grid_x, tiles = plan.grid(1)
    assert grid_x == plan.ctas_per_sample and tiles == plan.col_tiles
    assert 1 <= tiles <= tiles_of_channels
    assert grid_x * tiles <= H200.sm_count * resident
    # as many tiles as the channels have, or as the wave has room for
    assert tiles == tiles_of_channels or grid_x * (tiles + 1) > H200.sm_count * resident
    if channels >= 1024:
        assert tiles > 1
    # many rows: the rows fill the grid and every CTA walks all the channels
    assert _plan.plan_cols(1, 256 * 56 * 56, channels, itemsize, True, H200, 2).col_tiles == 1


def test_cols_apply_passes_take_fewer_rows_per_thread() -> None:
    """The apply and dx passes write no partials: one unrolled block of rows per thread is enough
    (resnet50's 256 x 14 x 14 layer at batch 64: 98 -> 392 CTAs)."""
    args = (1, 64 * 14 * 14, 256, 2, True, H200, _plan.COLS_APPLY_CTAS_PER_SM)
    sums = _plan.plan_cols(*args, _plan.COLS_APPLY_THREADS)
    apply = _plan.plan_cols(*args, _plan.COLS_APPLY_THREADS, _plan.COLS_APPLY_MIN_ROWS_PER_THREAD)
    assert apply.ctas_per_sample == 4 * sums.ctas_per_sample
    assert apply.ctas_per_sample * _plan.COLS_APPLY_MIN_ROWS_PER_THREAD * apply.ty >= 64 * 14 * 14
    source = (Path(_compile.source_dir()) / "strided_norm.cu").read_text()
    assert f"#define COLS_APPLY_UNROLL {_plan.COLS_APPLY_MIN_ROWS_PER_THREAD}\n" in source
