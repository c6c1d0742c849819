"""The channels_last (columns) passes alone, a copy of the same tensor, and whole calls under two
apply grids, with torch eager and torch.compile in the same run (development tool).
Usage: python scripts/profile_cols.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_passes import registers, replan, report  # noqa: E402
from quick_timing import time_ms  # noqa: E402

from cupynorm import _launch, _ops, _plan, _strided  # noqa: E402


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours.float() - ref.float()).abs().max().item()
    if not err < 2e-2:
        raise SystemExit(f"{name}: wrong result (max abs error vs torch {err:.2e})")


def over_apply_grids(name: str, fn, gbytes: float) -> None:
    """Time ``fn`` with the apply passes aiming at 8 and at 32 CTAs per SM."""
    default = _plan.COLS_APPLY_CTAS_PER_SM
    for per_sm in (8, 32):
        _plan.COLS_APPLY_CTAS_PER_SM = per_sm
        replan()
        report(f"{name}, apply {per_sm} CTAs/SM", time_ms(fn), gbytes)
    _plan.COLS_APPLY_CTAS_PER_SM = default
    replan()


def main() -> None:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    report("copy 1 GiB", time_ms(lambda: b.copy_(a)), 2 * a.numel() / 1e9)
    a = b = None
    for kernel in ("strided_norm_stats_cols", "strided_norm_apply_cols"):
        print(f"  {kernel} fp16: {registers('strided_norm.cu', kernel, 'float16')} registers")

    # BatchNorm2d fp16 channels_last 256x64x112x112 (the bench row), training forward
    x = torch.randn(256, 64, 112, 112, device="cuda", dtype=torch.float16)
    x = x.to(memory_format=torch.channels_last)
    gb = x.numel() * 2 / 1e9
    C, N, S = 64, 256, 112 * 112
    w = torch.rand(C, device="cuda", dtype=torch.float16) + 0.5
    bias = torch.rand(C, device="cuda", dtype=torch.float16)
    rm, rv = torch.zeros(C, device="cuda", dtype=torch.float16), torch.ones_like(w)
    call = _launch._Call(x)
    y = torch.empty_like(x)
    mean, rstd = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")
    report(
        "BN cl stats_cols alone",
        time_ms(lambda: _strided._stats_cols(call, x, 1, N * S, C, 0, 0, 1)),
        gb,
    )

    def bn():
        return _ops.batch_norm_fwd(x, w, bias, rm, rv, True, 0.1, 1e-5)[0]

    def bn_torch():
        return F.batch_norm(x, rm, rv, w, bias, True, 0.1, 1e-5)

    def apply():
        return _strided._apply(call, x, y, w, bias, mean, rstd, "channels_last", N, C, S, 0, 1)

    report("BN cl copy of the tensor", time_ms(lambda: y.copy_(x)), 2 * gb)
    report("BN cl apply_cols alone", time_ms(apply), 2 * gb)
    check("BN cl", bn(), bn_torch())
    over_apply_grids("BN cl forward", bn, 2 * gb)
    y = None
    report("BN cl forward, torch eager", time_ms(bn_torch), 2 * gb)
    compiled = torch.compile(bn_torch)
    compiled()
    report("BN cl forward, torch.compile", time_ms(compiled), 2 * gb)
    x = None

    # GroupNorm(32) fp16 channels_last 16x320x64x64 (the bench row)
    xg = torch.randn(16, 320, 64, 64, device="cuda", dtype=torch.float16)
    xg = xg.to(memory_format=torch.channels_last)
    wg = torch.rand(320, device="cuda", dtype=torch.float16) + 0.5
    bg = torch.rand(320, device="cuda", dtype=torch.float16)
    gbg = xg.numel() * 2 / 1e9

    def gn():
        return _ops.group_norm_fwd(xg, 32, wg, bg, 1e-5, want_stats=False)[0]

    def gn_torch():
        return F.group_norm(xg, 32, wg, bg, 1e-5)

    check("GN32 cl", gn(), gn_torch())
    for min_rows in (16, 32, 64):  # few rows per sample: the fewest rows a thread walks
        _plan.COLS_MIN_ROWS_PER_THREAD = min_rows
        replan()
        report(f"GN32 cl forward, >= {min_rows} rows per thread", time_ms(gn), 2 * gbg)
    _plan.COLS_MIN_ROWS_PER_THREAD = 32
    replan()
    callg = _launch._Call(xg)
    yg = torch.empty_like(xg)
    meang, rstdg = torch.zeros(16, 32, device="cuda"), torch.ones(16, 32, device="cuda")
    report(
        "GN32 cl stats_cols alone",
        time_ms(lambda: _strided._stats_cols(callg, xg, 16, 4096, 320, 4096 * 320, 32, 10)),
        gbg,
    )
    report(
        "GN32 cl apply_cols alone",
        time_ms(
            lambda: _strided._apply(
                callg, xg, yg, wg, bg, meang, rstdg, "channels_last", 16, 320, 4096, 32, 10
            )
        ),
        2 * gbg,
    )
    report("GN32 cl copy of the tensor", time_ms(lambda: yg.copy_(xg)), 2 * gbg)
    over_apply_grids("GN32 cl forward", gn, 2 * gbg)
    compiled = torch.compile(gn_torch)
    compiled()
    report("GN32 cl forward, torch.compile", time_ms(compiled), 2 * gbg)


if __name__ == "__main__":
    main()
