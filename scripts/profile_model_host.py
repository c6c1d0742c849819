"""Host time of a whole model's training step, torch's norm layers against cupynorm's, and where
cupynorm's goes (cProfile by own time, and how the norm calls were served).

A host-bound step (small batch) costs what its layers take to issue; this runs torchvision's
resnet50 (bf16 autocast, channels_last) and reports the issue time of a step (zero_grad, forward,
backward, SGD step) starting with the device idle, for each, the difference per norm layer, the
caching allocator's cudaMalloc calls, and a cProfile of the cupynorm step. Needs torchvision.

Usage: python scripts/profile_model_host.py [--batch N] [--steps N]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _program  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import torchvision

    torch.manual_seed(0)
    theirs = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    ours = cnt.replace_norms(copy.deepcopy(theirs))
    layers = sum(isinstance(m, torch.nn.BatchNorm2d) for m in theirs.modules())
    x = torch.randn(args.batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (args.batch,), device="cuda")

    optimizers = {
        id(m): torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (theirs, ours)
    }

    def step(model) -> None:
        optimizer = optimizers[id(model)]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        optimizer.step()

    def issue_ms(model) -> float:
        for _ in range(5):
            step(model)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(args.steps):
            start = time.perf_counter()
            step(model)
            best = min(best, time.perf_counter() - start)
            torch.cuda.synchronize()
        return best * 1e3

    def device_mallocs() -> int:
        return torch.cuda.memory_stats().get("num_device_alloc", 0)

    before = device_mallocs()
    t_ms = issue_ms(theirs)
    middle = device_mallocs()
    c_ms = issue_ms(ours)
    print(f"cudaMalloc calls: torch {middle - before}, cupynorm {device_mallocs() - middle}")
    print(
        f"resnet50 batch {args.batch} bf16 cl, host ms to issue a step: torch {t_ms:.2f}, "
        f"cupynorm {c_ms:.2f}; +{(c_ms - t_ms) * 1e3 / layers:.0f} us per norm layer "
        f"({layers} layers)"
    )
    unrecordable = sum(p is _program._UNRECORDABLE for p in _program._PROGRAMS.values())
    print(f"programs: {len(_program._PROGRAMS)} recorded signatures, {unrecordable} unrecordable")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(5):
        step(ours)
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats("cupynorm", 25)


if __name__ == "__main__":
    main()
