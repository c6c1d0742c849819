"""Host time of one norm layer's training step (forward + backward), cupynorm against torch.

A training step of a host-bound model costs what its layers take to *issue*, so this times the
issuing alone: many forward+backward steps of one layer on a small tensor back to back with no
synchronization (the GPU work of a step is a few microseconds and never the bottleneck), per
step; then the forward alone and the backward alone, the kernel launches and the tensors
allocated per step, and a cProfile of the cupynorm step (functions by own time).

The breakdown (``--layer bn``) times each layer of the cupynorm call alone on the same
tensors, and a floor: a bare Python ``autograd.Function`` with the same inputs, outputs, saved
tensors and allocations but no kernels -- what any norm written as a Python Function pays.

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
from cupynorm import _compile, _interop  # noqa: E402

_BACKEND = _interop.TorchBackend()


def _layers(kind: str):
    if kind == "bn":
        return torch.nn.BatchNorm2d(64), cnt.BatchNorm2d(64), (8, 64, 14, 14)
    return torch.nn.GroupNorm(32, 64), cnt.GroupNorm(32, 64), (8, 64, 14, 14)


def per_step_us(fn, steps: int, repeats: int = 5) -> float:
    """Issue time per call: the best of ``repeats`` runs of ``steps // repeats`` calls."""
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    n = max(1, steps // repeats)
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
        torch.cuda.synchronize()
    return best * 1e6


class _Floor(torch.autograd.Function):
    """A norm layer's autograd with no kernels: the same allocations, saved tensors and grads."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        y = torch.empty_like(x)
        mean, rstd = x.new_empty(x.shape[1], dtype=torch.float32), x.new_empty(x.shape[1])
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.mark_non_differentiable(mean, rstd)
        ctx.set_materialize_grads(False)
        return y, mean, rstd

    @staticmethod
    def backward(ctx, dy, *_):
        x, weight, _mean, _rstd = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def breakdown(module, x, dy, steps: int) -> None:
    """Host us per call of each layer of the BatchNorm call, outermost first."""
    from cupynorm import _ops, _program
    from cupynorm.torch import _batch_norm, _batch_norm_kernels, functional

    w, b, rm, rv = module.weight, module.bias, module.running_mean, module.running_var
    xd = x.detach()
    fwd_args = (xd, w.detach(), b.detach(), rm, rv, True, 0.1, 1e-5)
    y, mean, rstd = _batch_norm_kernels._batch_norm_fwd_cuda(*fwd_args)
    bwd_args = (dy, xd, mean, rstd, w.detach(), True, (True, True, True))
    programs = {key[0]: p for key, p in _program._PROGRAMS.items() if key[0].startswith("batch")}
    fwd_program, bwd_program = programs["batch_norm_fwd"], programs["batch_norm_bwd"]
    fwd_tensors = [t for t in fwd_args if isinstance(t, torch.Tensor)]
    bwd_tensors = [t for t in bwd_args if isinstance(t, torch.Tensor)]
    launcher, grid, block, smem, template, _slots = fwd_program.steps[0]
    stream = torch.cuda.current_stream().cuda_stream

    def floor_step():
        _Floor.apply(x, w, b)[0].backward(dy)

    rows = {
        "floor: bare autograd.Function fwd+bwd (no kernels)": floor_step,
        "floor: bare autograd.Function fwd": lambda: _Floor.apply(x, w, b),
        "module forward (grad)": lambda: module(x),
        "functional.batch_norm (grad)": lambda: functional.batch_norm(
            x, rm, rv, w, b, True, 0.1, 1e-5
        ),
        "_BatchNormFunction.apply": lambda: _batch_norm._BatchNormFunction.apply(
            x, w, b, rm, rv, True, 0.1, 1e-5
        ),
        "_batch_norm_fwd_cuda": lambda: _batch_norm_kernels._batch_norm_fwd_cuda(*fwd_args),
        "_ops.batch_norm_fwd (key + replay)": lambda: _ops.batch_norm_fwd(*fwd_args),
        "replay of the forward program": lambda: fwd_program.run(_BACKEND, 0, fwd_tensors),
        "_batch_norm_bwd_cuda": lambda: _batch_norm_kernels._batch_norm_bwd_cuda(*bwd_args),
        "_ops.batch_norm_bwd (key + replay)": lambda: _ops.batch_norm_bwd(
            *bwd_args[:-1], (True, True, True)
        ),
        "replay of the backward program": lambda: bwd_program.run(_BACKEND, 0, bwd_tensors),
        "one launch (Launcher.launch)": lambda: launcher.launch(
            grid, block, smem, stream, template
        ),
        "torch.empty((64,))": lambda: torch.empty((64,), device="cuda"),
    }
    print(
        f"forward program: {len(fwd_program.allocations)} allocations, "
        f"{len(fwd_program.steps)} launches; backward: {len(bwd_program.allocations)}, "
        f"{len(bwd_program.steps)}"
    )
    for name, fn in rows.items():
        print(f"  {name:55s} {per_step_us(fn, steps):7.1f} us")


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

    if args.layer == "bn":
        breakdown(ours, x, dy, args.steps)

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
