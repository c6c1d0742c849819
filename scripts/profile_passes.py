"""Time each pass of the forward strategies separately and try plan variants (development tool).

Prints, per kernel: ms, GB moved, TB/s, and registers per thread; then the on-chip segment kernel
under several team slice sizes. Usage: python scripts/profile_passes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quick_timing import time_ms  # noqa: E402  (scripts/ is on sys.path when run as a script)

from cupynorm import _compile, _launch, _ops, _plan, _program, _strided  # noqa: E402


def registers(source: str, kernel: str, dtype: str = "float32") -> int:
    from cupy.cuda import driver

    function = _compile.get_kernel(0, source, kernel, dtype)
    return driver.funcGetAttribute(4, function.ptr)  # CU_FUNC_ATTRIBUTE_NUM_REGS


def replan() -> None:
    """Forget every plan and recorded call, so changed thresholds take effect."""
    for plan in (_plan.plan_segment, _plan.plan_rows_stats, _plan.plan_rows_apply, _plan.plan_cols):
        plan.cache_clear()
    _program._PROGRAMS.clear()


def report(name: str, ms: float, gbytes: float) -> None:
    print(f"{name:58s} {ms:8.3f} ms {gbytes:7.2f} GB {gbytes / ms:6.2f} TB/s", flush=True)


def main() -> None:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    report("copy 1 GiB", time_ms(lambda: b.copy_(a)), 2 * a.numel() / 1e9)

    x = torch.randn(112, 64, 512, 512, device="cuda")
    gb = x.numel() * 4 / 1e9
    call = _launch._Call(x)
    N, C, S = 112, 64, 512 * 512
    y = torch.empty_like(x)
    # GroupNorm(8): split path, pass by pass
    G = 8
    mean, rstd = (torch.empty(N, G, device="cuda") for _ in range(2))
    L = C // G * S
    report("GN8 stats_rows", time_ms(lambda: _strided._stats_rows(call, x, N * G, 1, L, 0, L)), gb)
    partials = _strided._stats_rows(call, x, N * G, 1, L, 0, L)
    report(
        "GN8 finalize",
        time_ms(lambda: _strided._finalize(call, x, partials, N * G, L, 1e-5, mean, rstd, None)),
        0.0,
    )
    report(
        "GN8 apply_rows",
        time_ms(
            lambda: _strided._apply(
                call, x, y, None, None, mean, rstd, "contiguous", N, C, S, G, C // G
            )
        ),
        2 * gb,
    )
    # BatchNorm: split path on 64 x 64 x 512 x 512
    xb = x[:64]
    gbb = xb.numel() * 4 / 1e9
    report(
        "BN stats_rows", time_ms(lambda: _strided._stats_rows(call, xb, C, 64, S, C * S, S)), gbb
    )
    bm, br = torch.empty(C, device="cuda"), torch.rand(C, device="cuda")
    yb = y[:64]
    report(
        "BN apply_rows",
        time_ms(
            lambda: _strided._apply(call, xb, yb, None, None, bm, br, "contiguous", 64, C, S, 0, 1)
        ),
        2 * gbb,
    )
    for kernel in ("strided_norm_stats_rows", "strided_norm_apply_rows"):
        print(f"  {kernel}: {registers('strided_norm.cu', kernel)} registers")
    # the channels_last passes: scripts/profile_cols.py

    # on-chip segment kernels under several thread counts (packs per thread)
    y = None  # free the output of the split passes
    cases = [
        ("InstanceNorm fp32 112x64x512x512", x, 64),
        ("GroupNorm(8) fp32 112x64x512x512", x, 8),
    ]
    for name, t, groups in cases:
        ref = torch.nn.functional.group_norm(t[:2].float(), groups)
        for target, team_max in ((64, 32), (64, 128), (128, 64), (192, 64)):
            _plan.TEAM_SLICE_TARGET_BYTES, _plan.TEAM_MAX = target * 1024, team_max
            replan()
            out = _ops.group_norm_fwd(t, groups, None, None, 1e-5)[0]
            err = (out[:2].float() - ref).abs().max().item()
            ms = time_ms(
                lambda t=t, groups=groups: _ops.group_norm_fwd(t, groups, None, None, 1e-5)
            )
            plan = _plan.plan_segment(
                t.shape[1] // groups * t[0, 0].numel(),
                t.element_size(),
                True,
                call.info,
            )
            gbytes = 2 * t.numel() * t.element_size() / 1e9
            shape = "split" if plan is None else f"team={plan.team}"
            report(f"{name} {target}K slices: {shape} err={err:.1e}", ms, gbytes)
    regs = registers("segment_norm.cu", "segment_norm_fwd_affine")
    print(f"  segment_norm_fwd_affine: {regs} registers")


if __name__ == "__main__":
    main()
