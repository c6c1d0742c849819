"""Host time per norm layer inside a stack of layers, as a model pays it (development tool).

A chain of ``L`` norm layers on a small bf16 channels_last tensor under bf16 autocast (a
resnet50 layer's form), forward + ``backward()`` issued back to back with no synchronization:
the backward engine's fixed cost is paid once per step, as in a model, so the time per layer is
what each layer adds. Rows: torch's layer, cupynorm's, torch's BatchNorm2d + ReLU against
cupynorm's ``BatchNormAct2d``, a bare Python ``autograd.Function`` with the same allocations
(no kernels: the floor of any norm written in Python) and ``nn.Identity``. Then a cProfile of
the cupynorm BatchNorm2d stack, by own time.

Usage: python scripts/profile_layer_stack.py [--layers L] [--steps N] [--profile]
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


class _Floor(torch.autograd.Function):
    """A batch norm's autograd with no kernels: its allocations, saved tensors and grads."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        y = torch.empty_like(x)
        mean = torch.empty(x.shape[1], device=x.device)
        rstd = torch.empty(x.shape[1], device=x.device)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.mark_non_differentiable(mean, rstd)
        ctx.set_materialize_grads(False)
        return y, mean, rstd

    @staticmethod
    def backward(ctx, dy, _mean, _rstd):
        x, weight, _m, _r = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


class _FloorLayer(torch.nn.BatchNorm2d):
    def forward(self, x):
        return _Floor.apply(x, self.weight, self.bias)[0]


def _stack(kind: str, layers: int, channels: int) -> torch.nn.Module:
    def one() -> torch.nn.Module:
        if kind == "torch bn":
            return torch.nn.BatchNorm2d(channels)
        if kind == "cupynorm bn":
            return cnt.BatchNorm2d(channels)
        if kind == "torch bn+relu":
            return torch.nn.Sequential(torch.nn.BatchNorm2d(channels), torch.nn.ReLU(inplace=True))
        if kind == "cupynorm bn+relu":
            return cnt.BatchNormAct2d(channels)
        if kind == "floor":
            return _FloorLayer(channels)
        return torch.nn.Identity()

    return torch.nn.Sequential(*(one() for _ in range(layers))).cuda()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    shape = (8, 64, 14, 14)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x = x.to(memory_format=torch.channels_last).requires_grad_()
    kinds = ("identity", "floor", "torch bn", "cupynorm bn", "torch bn+relu", "cupynorm bn+relu")
    stacks = {k: _stack(k, args.layers, shape[1]) for k in kinds}

    def step(model):
        with torch.autocast("cuda", torch.bfloat16):
            y = model(x)
        y.float().sum().backward()

    print(
        f"{args.layers} layers, input {shape} bf16 channels_last, bf16 autocast; "
        "issue time per step / per layer (best of 5)"
    )
    base = None
    for kind in kinds:
        model = stacks[kind]
        for _ in range(20):
            step(model)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.steps // 5):
                step(model)
            best = min(best, (time.perf_counter() - start) / (args.steps // 5))
            torch.cuda.synchronize()
        base = best if kind == "identity" else base
        extra = "" if kind == "identity" else f", {(best - base) / args.layers * 1e6:.1f} us/layer"
        print(f"  {kind:18s} {best * 1e6:8.0f} us/step{extra}")
    if args.profile:
        for kind in ("cupynorm bn", "cupynorm bn+relu"):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(50):
                step(stacks[kind])
            profile.disable()
            torch.cuda.synchronize()
            print(f"cProfile, {kind}, 50 steps:")
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
