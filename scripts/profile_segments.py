"""The kernels of the small seed workloads (development tool): the on-chip segment kernels under
forced team sizes (GroupNorm(32) fp16 16x320x64x64 forward and backward, the fused row epilogue
1024x8192 fp32; a team splits each segment over more CTAs: more loads in flight, one exchange per
segment), and InstanceNorm fp32 32x64x256x256 forward and backward by team slice size. The
channels_last passes: scripts/profile_cols.py.
Usage: python scripts/profile_segments.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_passes import replan, report  # noqa: E402
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

    # InstanceNorm fp32 32x64x256x256 (256 KiB planes), forward and on-chip backward, by team size
    x = torch.randn(32, 64, 256, 256, device="cuda")
    wi, bi = torch.rand(64, device="cuda") + 0.5, torch.rand(64, device="cuda")
    dyi = torch.randn_like(x)
    gb_i = x.numel() * 4 / 1e9
    ref_i = torch.nn.functional.instance_norm(x, weight=wi, bias=bi)
    for target in (32, 48, 64, 96, 128):
        _plan.TEAM_SLICE_TARGET_BYTES = target * 1024
        replan()
        y, m, r = _ops.group_norm_fwd(x, 64, wi, bi, 1e-5)
        err = (y - ref_i).abs().max().item()
        fwd = _plan.plan_segment(65536, 4, True, _plan.device_info(0))
        bwd = _plan.plan_segment(65536, 4, True, _plan.device_info(0), tensors=2)
        ms = time_ms(lambda: _ops.group_norm_fwd(x, 64, wi, bi, 1e-5))
        report(f"IN fwd {target} KiB slices team={fwd.team} err={err:.1e}", ms, 2 * gb_i)
        ms = time_ms(lambda m=m, r=r: _ops.group_norm_bwd(dyi, x, m, r, wi, 64, (True, True, True)))
        report(f"IN bwd {target} KiB slices team={bwd.team}", ms, 3 * gb_i)
    _plan.TEAM_SLICE_TARGET_BYTES = 64 * 1024
    replan()


if __name__ == "__main__":
    main()
