"""Host time per norm layer inside a stack of layers, as a model pays it (development tool).

A chain of ``L`` norm layers on a small bf16 tensor under bf16 autocast, forward +
``backward()`` issued back to back with no synchronization: the backward engine's fixed cost is
paid once per step, as in a model, so the time per layer is what each layer adds. ``--norm``:
``bn`` (8x64x14x14 channels_last, a resnet50 layer's form): torch's BatchNorm2d and cupynorm's,
torch's BatchNorm2d + ReLU against cupynorm's ``BatchNormAct2d``; ``gn`` (the same input):
GroupNorm(32, 64), and GroupNorm + SiLU against ``GroupNormAct``; ``ln`` (8x196x96, a
convnext_tiny block's rows): LayerNorm(96); ``ln+cast``: LayerNorm(96), then back to bf16 (as the
Linear after a block's norm gives it: under autocast every layer then normalizes bf16 rows into
float32). Each with a bare Python ``autograd.Function`` with
the same allocations (no kernels: the floor of any norm written in Python) and
``nn.Identity``. ``--profile``: then a cProfile of the cupynorm stacks, by own time.

Usage: python scripts/profile_layer_stack.py [--norm bn|gn|ln|ln+cast] [--layers L] [--steps N]
       [--profile]
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
    """A norm's autograd with no kernels: its allocations, saved tensors and grads."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        y = torch.empty_like(x)
        mean = torch.empty(weight.shape[0], device=x.device)
        rstd = torch.empty(weight.shape[0], device=x.device)
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


class _ToBf16(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.bfloat16)


def _then_bf16(make):
    return lambda c: torch.nn.Sequential(make(c), _ToBf16())


# --norm -> (input shape, channels_last, {kind: maker of one layer of `channels` features})
_NORMS = {
    "bn": ((8, 64, 14, 14), True, {
        "torch bn": torch.nn.BatchNorm2d,
        "cupynorm bn": cnt.BatchNorm2d,
        "torch bn+relu": lambda c: torch.nn.Sequential(
            torch.nn.BatchNorm2d(c), torch.nn.ReLU(inplace=True)),
        "cupynorm bn+relu": cnt.BatchNormAct2d,
    }),
    "gn": ((8, 64, 14, 14), True, {
        "torch gn": lambda c: torch.nn.GroupNorm(32, c),
        "cupynorm gn": lambda c: cnt.GroupNorm(32, c),
        "torch gn+silu": lambda c: torch.nn.Sequential(torch.nn.GroupNorm(32, c), torch.nn.SiLU()),
        "cupynorm gn+silu": lambda c: cnt.GroupNormAct(32, c),
    }),
    "ln": ((8, 196, 96), False, {
        "torch ln": torch.nn.LayerNorm,
        "cupynorm ln": cnt.LayerNorm,
    }),
    "ln+cast": ((8, 196, 96), False, {
        "torch ln+cast": _then_bf16(torch.nn.LayerNorm),
        "cupynorm ln+cast": _then_bf16(cnt.LayerNorm),
    }),
}  # fmt: skip


def _stack(make, layers: int, channels: int) -> torch.nn.Module:
    return torch.nn.Sequential(*(make(channels) for _ in range(layers))).cuda()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--norm", choices=sorted(_NORMS), default="bn")
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    shape, channels_last, layers = _NORMS[args.norm]
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    features = shape[1] if channels_last else shape[-1]
    makers = {"identity": lambda c: torch.nn.Identity(), "floor": _FloorLayer, **layers}
    stacks = {k: _stack(make, args.layers, features) for k, make in makers.items()}

    def step(model):
        with torch.autocast("cuda", torch.bfloat16):
            y = model(x)
        y.float().sum().backward()

    layout = " channels_last" if channels_last else ""
    print(
        f"{args.layers} layers, input {shape} bf16{layout}, bf16 autocast; "
        "issue time per step / per layer (best of 5)"
    )
    base = None
    for kind in stacks:
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
        for kind in (k for k in stacks if k.startswith("cupynorm")):
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
