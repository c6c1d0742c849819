"""The Python host path of one norm layer's training step, without a GPU (development tool).

CPU tensors stand in for device arrays and a launcher that does nothing stands in for the
driver (as in tests/test_programs_cpu.py), so a ``BatchNormAct2d`` (or ``BatchNorm2d``) forward +
backward runs cupynorm's whole CUDA host code -- module, checks, autograd.Function, the recorded
calls' replays -- with no kernels. Prints the time per step and a cProfile by own time: what is
left of the step's host time once launches and allocations are cheap. The device's numbers
(launches ~4 us each, allocations ~3-4 us) come on top; scripts/profile_train_host.py measures
those on a GPU.

Usage: python scripts/profile_host_cpu.py [act|bn] [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from test_programs_cpu import H200, _CpuTorchBackend  # noqa: E402

import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _compile, _interop, _plan, _program  # noqa: E402
from cupynorm.torch import _autograd, _kernels, functional  # noqa: E402


class _NoLaunch:
    def launch(self, grid, block, smem, stream, args) -> None:
        pass


def _cuda_host_code_on_cpu() -> None:
    """Route CPU tensors through the CUDA host code with launches that do nothing."""
    backend = _CpuTorchBackend()
    _interop.backend_of = lambda x: backend
    _plan.device_info = lambda device: H200
    _compile.launcher = lambda *args: _NoLaunch()
    _compile.max_block_threads = lambda *a: 1024
    _compile.resident_ctas = lambda *a: 2
    _compile.current_device = lambda device: contextlib.nullcontext()
    _compile.has_cooperative_launch = lambda: True
    _program.check_replay = None
    functional._use_kernels = lambda x: True
    _autograd._batch_norm_fwd = _kernels._batch_norm_fwd_cuda
    bwd = _autograd._make_batch_norm_act_backward(_kernels._batch_norm_act_bwd_cuda)
    _autograd._BatchNormActFunction.backward = staticmethod(once_differentiable(bwd))
    bwd = _autograd._make_batch_norm_backward(_kernels._batch_norm_bwd_cuda)
    _autograd._BatchNormFunction.backward = staticmethod(once_differentiable(bwd))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("layer", nargs="?", choices=("act", "bn"), default="act")
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    _cuda_host_code_on_cpu()
    act = args.layer == "act"
    module = cnt.BatchNormAct2d(64) if act else cnt.BatchNorm2d(64)
    x = torch.randn(8, 64, 14, 14).to(memory_format=torch.channels_last).requires_grad_()
    residual = torch.randn_like(x).requires_grad_()
    dy = torch.randn_like(x)

    def step() -> None:
        y = module(x, residual) if act else module(x)
        y.backward(dy)

    for _ in range(50):
        step()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    per_step = (time.perf_counter() - started) / args.steps * 1e6
    print(f"{type(module).__name__} forward + backward: {per_step:.1f} us per step (no kernels)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps // 2):
        step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
