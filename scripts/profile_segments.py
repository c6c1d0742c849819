"""The kernels of the small seed workloads (development tool): the on-chip segment kernels under
forced team sizes (GroupNorm(32) fp16 16x320x64x64 forward and backward, the fused row epilogue
1024x8192 fp32; a team splits each segment over more CTAs: more loads in flight, one exchange per
segment), then the channels_last passes of BatchNorm fp16 256x64x112x112 under several grids.
Usage: python scripts/profile_segments.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_passes import registers, replan, report  # noqa: E402
from quick_timing import time_ms  # noqa: E402

from cupynorm import _ops, _plan  # noqa: E402


def main() -> None:
    xg = torch.randn(16, 320, 64, 64, device="cuda", dtype=torch.float16)
    w = torch.rand(320, device="cuda", dtype=torch.float16) + 0.5
    b = torch.randn(320, device="cuda", dtype=torch.float16)
    xr = torch.randn(1024, 8192, device="cuda")
    yr = torch.randn(1024, 8192, device="cuda")
    ref_g = torch.nn.functional.group_norm(xg.float(), 32, w.float(), b.float())
    gb_g = 2 * xg.numel() * 2 / 1e9
    for block_max, slice_target in ((96, 64), (48, 40), (24, 20), (12, 10)):
        _plan.SEGMENT_BLOCK_MAX_BYTES = block_max * 1024
        _plan.TEAM_SLICE_TARGET_BYTES = slice_target * 1024
        replan()
        plan = _plan.plan_segment(10 * 4096, 2, True, _plan.device_info(0))
        out = _ops.group_norm_fwd(xg, 32, w, b, 1e-5)[0]
        err = (out.float() - ref_g).abs().max().item()
        ms = time_ms(lambda: _ops.group_norm_fwd(xg, 32, w, b, 1e-5))
        report(f"GN32 fp16 fwd team={plan.team} threads={plan.threads} err={err:.1e}", ms, gb_g)
        plan_r = _plan.plan_segment(8192, 4, True, _plan.device_info(0))
        ms = time_ms(lambda: _ops.row_norm_add_mul_fwd(xr, yr, 1e-5))
        report(f"row_norm_add_mul 1024x8192 team={plan_r.team}", ms, 3 * xr.numel() * 4 / 1e9)
    _plan.SEGMENT_BLOCK_MAX_BYTES, _plan.TEAM_SLICE_TARGET_BYTES = 96 * 1024, 64 * 1024
    replan()
    _y, mean, rstd = _ops.group_norm_fwd(xg, 32, w, b, 1e-5)
    dy = torch.randn_like(xg)
    ms = time_ms(lambda: _ops.group_norm_bwd(dy, xg, mean, rstd, w, 32, (True, True, True)))
    report("GN32 fp16 bwd (sums + finalize + dx)", ms, 5 * xg.numel() * 2 / 1e9)

    xc = torch.randn(256, 64, 112, 112, device="cuda", dtype=torch.float16)
    xc = xc.to(memory_format=torch.channels_last)
    yc = torch.empty_like(xc)
    call = _ops._Call(xc)
    gb = xc.numel() * 2 / 1e9
    rows = 256 * 112 * 112
    mean, rstd = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")
    t_stats = time_ms(lambda: _ops._stats_cols(call, xc, 1, rows, 64, 0, 0, 1))
    report("BN fp16 cl stats_cols (one wave of resident CTAs)", t_stats, gb)
    for ctas_per_sm in (8, 16, 32, 64):
        _plan.COLS_APPLY_CTAS_PER_SM = ctas_per_sm
        replan()
        t_apply = time_ms(
            lambda: _ops._apply(
                call, xc, yc, None, None, mean, rstd, "channels_last", 256, 64, 112 * 112, 0, 1
            )
        )
        report(f"BN fp16 cl apply_cols ctas/SM={ctas_per_sm}", t_apply, 2 * gb)
    _plan.COLS_APPLY_CTAS_PER_SM = 32
    replan()
    rm, rv = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")
    ms = time_ms(lambda: _ops.batch_norm_fwd(xc, None, None, rm, rv, True, 0.1, 1e-5))
    report("BN fp16 cl forward (training)", ms, 2 * gb)
    xgc = xg.to(memory_format=torch.channels_last)
    ms = time_ms(lambda: _ops.group_norm_fwd(xgc, 32, w, b, 1e-5))
    report("GN32 fp16 cl forward", ms, gb_g)
    for kernel in ("strided_norm_stats_cols", "strided_norm_apply_cols"):
        print(f"  {kernel} fp16: {registers('strided_norm.cu', kernel, 'float16')} registers")


if __name__ == "__main__":
    main()
