"""The Python host path of one norm layer's training step, without a GPU (development tool).

CPU tensors stand in for device arrays and a driver that does nothing stands in for CUDA (as in
tests/test_programs_cpu.py), so a ``BatchNormAct2d`` (or ``BatchNorm2d``) forward + backward runs
cupynorm's whole CUDA host code -- module, checks, autograd.Function, the recorded calls'
replays, the launchers' argument packing -- with no kernels. Prints the time per step and a
cProfile by own time: what is left of the step's host time once launches and allocations are
cheap. The device's numbers (cuLaunchKernel ~4 us each, allocations ~3-4 us) come on top;
scripts/profile_train_host.py measures those on a GPU.

``--stack L`` runs L layers in a chain (one backward per step, as in a model) and reports the
time per layer; ``--launches none`` replaces the launchers themselves by no-ops (the replay
alone). ``--no-profile`` skips the cProfile.

Usage: python scripts/profile_host_cpu.py [act|bn] [--steps N] [--stack L] [--launches driver|none]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

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


class _NoDriver:
    """cupy.cuda.driver / runtime with calls that do nothing (the real Launcher packs its
    arguments and makes the call; only the driver's own work is missing)."""

    CUDADriverError = RuntimeError

    @staticmethod
    def launchKernel(*args) -> None:
        pass

    @staticmethod
    def launchCooperativeKernel(*args) -> None:
        pass

    @staticmethod
    def getDevice() -> int:
        return 0

    @staticmethod
    def setDevice(device: int) -> None:
        pass


def _cuda_host_code_on_cpu(launches: str = "driver") -> None:
    """Route CPU tensors through the CUDA host code with launches that do nothing: the real
    launchers on a driver that does nothing (``"driver"``) or no launchers at all (``"none"``)."""
    backend = _CpuTorchBackend()
    _interop.backend_of = lambda x: backend
    _plan.device_info = lambda device: H200
    _compile._runtime = lambda: _NoDriver
    if launches == "none":
        _compile.launcher = lambda *args: _NoLaunch()
    else:
        _compile.get_kernel = lambda *args: SimpleNamespace(ptr=0)
        _compile._driver = lambda: _NoDriver
    _compile.max_block_threads = lambda *a: 1024
    _compile.resident_ctas = lambda *a: 2
    _compile.has_cooperative_launch = lambda: True
    _program.check_replay = None
    functional._use_kernels = lambda x: True
    _autograd._batch_norm_fwd_program = _kernels._batch_norm_fwd_cuda_program
    _autograd._batch_norm_bwd = _kernels._batch_norm_bwd_cuda
    _autograd._batch_norm_act_bwd = _kernels._batch_norm_act_bwd_cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("layer", nargs="?", choices=("act", "bn"), default="act")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--stack", type=int, default=1, help="layers in a chain (default 1)")
    parser.add_argument("--launches", choices=("driver", "none"), default="driver")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _cuda_host_code_on_cpu(args.launches)
    act = args.layer == "act"
    layers = [cnt.BatchNormAct2d(64) if act else cnt.BatchNorm2d(64) for _ in range(args.stack)]
    shape = (8, 64, 14, 14) if args.stack == 1 else (8, 64, 2, 2)  # small: no CPU copies
    x = torch.randn(shape).to(memory_format=torch.channels_last).requires_grad_()
    residual = torch.randn_like(x).requires_grad_()
    dy = torch.randn_like(x)

    def step() -> None:
        y = x
        for module in layers:
            y = module(y, residual) if act else module(y)
        y.backward(dy)

    for _ in range(50):
        step()
    steps = max(1, args.steps // args.stack)
    rounds = []
    for _ in range(steps):  # one step per round, the fastest reported: shared, noisy CPUs
        started = time.perf_counter()
        step()
        rounds.append((time.perf_counter() - started) / args.stack * 1e6)
    rounds.sort()
    name = type(layers[0]).__name__
    print(
        f"{name} forward + backward: {rounds[0]:.1f} us per layer (no kernels; fastest step, "
        f"median {rounds[len(rounds) // 2]:.1f})"
    )
    if args.no_profile:
        return
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps // 2):
        step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
