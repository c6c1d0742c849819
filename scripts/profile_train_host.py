"""Host time of one norm layer's training step (forward + backward), cupynorm against torch.

A training step of a host-bound model costs what its layers take to *issue*, so this times the
issuing alone: many forward+backward steps of one layer on a small tensor back to back with no
synchronization (the GPU work of a step is a few microseconds and never the bottleneck), per
step; then the forward alone and the backward alone, the kernel launches and the tensors
allocated per step, and a cProfile of the cupynorm step (functions by own time).

Usage: python scripts/profile_train_host.py [--layer bn|gn] [--steps N]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _compile  # noqa: E402


def _layers(kind: str):
    if kind == "bn":
        return torch.nn.BatchNorm2d(64), cnt.BatchNorm2d(64), (8, 64, 14, 14)
    return torch.nn.GroupNorm(32, 64), cnt.GroupNorm(32, 64), (8, 64, 14, 14)


def per_step_us(fn, steps: int) -> float:
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", choices=("bn", "gn"), default="bn")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    theirs, ours, shape = _layers(args.layer)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x = x.to(memory_format=torch.channels_last)  # a conv output under bf16 autocast
    x.requires_grad_(True)
    dy = torch.randn_like(x)
    print(f"== {args.layer} {tuple(shape)} channels_last bf16, fp32 params, autocast, train")
    for name, module in (("torch", theirs.cuda()), ("cupynorm", ours.cuda())):

        def step(module=module):
            with torch.autocast("cuda", torch.bfloat16):
                y = module(x)
            y.backward(dy)

        def forward(module=module):
            with torch.autocast("cuda", torch.bfloat16), torch.no_grad():
                module(x)

        full = per_step_us(step, args.steps)
        fwd = per_step_us(forward, args.steps)
        print(f"{name:9s} fwd+bwd {full:7.1f} us   fwd (no grad) {fwd:7.1f} us")

    launches = []
    original = _compile.Launcher.launch

    def counting(self, *a, **k):
        launches.append(1)
        return original(self, *a, **k)

    _compile.Launcher.launch = counting
    allocations_before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(10):
        with torch.autocast("cuda", torch.bfloat16):
            y = ours(x)
        y.backward(dy)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_stats()["allocation.all.allocated"] - allocations_before
    _compile.Launcher.launch = original
    print(f"cupynorm per step: {len(launches) / 10:.1f} launches, {allocated / 10:.1f} allocations")

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        with torch.autocast("cuda", torch.bfloat16):
            y = ours(x)
        y.backward(dy)
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(28)


if __name__ == "__main__":
    main()
