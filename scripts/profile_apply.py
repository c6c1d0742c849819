"""The rows passes of the split path under several tile sizes (development tool): BatchNorm fp32
64x64x512x512 statistics and apply, GroupNorm(8) fp32 112x64x512x512 apply, against a plain copy.
Usage: python scripts/profile_apply.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_passes import replan, report  # noqa: E402
from quick_timing import time_ms  # noqa: E402

from cupynorm import _launch, _ops, _plan, _strided  # noqa: E402


def main() -> None:
    x = torch.randn(64, 64, 512, 512, device="cuda")
    y = torch.empty_like(x)
    gb = x.numel() * 4 / 1e9
    report("copy (the same tensor)", time_ms(lambda: y.copy_(x)), 2 * gb)
    call = _launch._Call(x)
    N, C, S = 64, 64, 512 * 512
    report("BN stats_rows", time_ms(lambda: _strided._stats_rows(call, x, C, N, S, C * S, S)), gb)
    mean, rstd = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")
    w, b = torch.rand(C, device="cuda"), torch.rand(C, device="cuda")
    default = _plan.APPLY_PACKS_PER_THREAD
    for packs in (2, 4, 8):
        _plan.APPLY_PACKS_PER_THREAD = packs
        replan()
        ms = time_ms(
            lambda: _strided._apply(call, x, y, w, b, mean, rstd, "contiguous", N, C, S, 0, 1)
        )
        report(f"BN apply_rows, {packs} packs per thread", ms, 2 * gb)
        rm, rv = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")
        ms = time_ms(lambda rm=rm, rv=rv: _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5))
        report(f"BN forward (training), {packs} packs per thread", ms, 2 * gb)
    _plan.APPLY_PACKS_PER_THREAD = default
    replan()


if __name__ == "__main__":
    main()
