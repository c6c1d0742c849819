"""Where the host time of one GroupNorm fp16 forward+backward step goes (development tool).

Times single steps (synchronized before each) of the cupynorm module with time stamps at the host
layer's entries and exits, and torch's module step for scale. Usage: python scripts/profile_step.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _ops  # noqa: E402

STAMPS: dict[str, float] = {}


def stamped(name, fn):
    def wrapper(*args, **kwargs):
        STAMPS[name + " in"] = time.perf_counter()
        out = fn(*args, **kwargs)
        STAMPS[name + " out"] = time.perf_counter()
        return out

    return wrapper


def main() -> None:
    x = torch.rand(16, 320, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    dy = torch.rand_like(x)
    ours = cnt.GroupNorm(32, 320).cuda().half()
    theirs = torch.nn.GroupNorm(32, 320).cuda().half()
    _ops.group_norm_fwd = stamped("fwd", _ops.group_norm_fwd)
    _ops.group_norm_bwd = stamped("bwd", _ops.group_norm_bwd)
    for name, module in (("cupynorm", ours), ("torch", theirs)):
        params = list(module.parameters())
        rows: dict[str, list[float]] = {}
        for step in range(60):
            torch.cuda.synchronize()
            STAMPS.clear()
            t0 = time.perf_counter()
            y = module(x)
            t1 = time.perf_counter()
            torch.autograd.grad(y, [x, *params], grad_outputs=dy)
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            if step < 10:
                continue
            marks = {"forward call": (t0, t1), "autograd.grad call": (t1, t2), "step": (t0, t3)}
            if STAMPS:
                marks["  module -> _ops fwd"] = (t0, STAMPS["fwd in"])
                marks["  _ops fwd"] = (STAMPS["fwd in"], STAMPS["fwd out"])
                marks["  _ops fwd -> return"] = (STAMPS["fwd out"], t1)
                marks["  grad -> _ops bwd"] = (t1, STAMPS["bwd in"])
                marks["  _ops bwd"] = (STAMPS["bwd in"], STAMPS["bwd out"])
                marks["  _ops bwd -> grad returns"] = (STAMPS["bwd out"], t2)
            for key, (a, b) in marks.items():
                rows.setdefault(key, []).append((b - a) * 1e6)
        print(f"== {name} GroupNorm(32, 320) fp16 16x320x64x64 forward+backward, one step")
        for key, values in rows.items():
            print(f"  {key:34s} {statistics.median(values):8.1f} us")


if __name__ == "__main__":
    main()
