"""The Python host path of one norm layer's training step, without a GPU (development tool).

CPU tensors stand in for device arrays and a driver that does nothing stands in for CUDA (as in
tests/test_programs_cpu.py), so a ``BatchNormAct2d`` (or another layer of ``_LAYERS``) forward
+ backward runs cupynorm's whole CUDA host code -- module, checks, autograd.Function, the
recorded calls' replays, the launchers' argument packing -- with no kernels. Prints the time
per step and a cProfile by own time: what is left of the step's host time once launches and
allocations are cheap. The device's numbers (cuLaunchKernel ~4 us each, allocations ~3-4 us)
come on top; scripts/profile_train_host.py measures those on a GPU.

``--stack L`` runs L layers in a chain (one backward per step, as in a model) and reports the
time per layer; ``--launches none`` replaces the launchers themselves by no-ops (the replay
alone). ``--no-profile`` skips the cProfile.

``--model`` runs a resnet50-shaped network instead (torchvision's bottleneck layout, 53
BatchNorm2d, on a tiny 2x3x32x32 input) as torch's, converted by ``cupynorm.torch.fuse`` and
with its norm layers removed: the host time per norm layer inside a model's step, to set beside
the chain's.

Usage: python scripts/profile_host_cpu.py [act|bn|gn|gnact|ln|ln2d] [--steps N] [--stack L]
       [--launches driver|none] [--model]
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
from test_programs_cpu import H200, _CpuTorchBackend, route_eager_to_host_code  # noqa: E402

import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _compile, _interop, _plan, _program  # noqa: E402


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
    route_eager_to_host_code()


def _resnet50_shaped(base: int = 8) -> torch.nn.Module:
    """torchvision's resnet50 layout (bottlenecks 3-4-6-3, 53 BatchNorm2d) with ``base`` channels
    in the stem instead of 64 (cheap CPU convolutions), written out so that the script needs no
    torchvision."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * 4
            self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            out += identity
            return self.relu(out)

    layers: list[nn.Module] = [
        nn.Conv2d(3, base, 7, 2, 3, bias=False),
        nn.BatchNorm2d(base),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = base
    for scale, blocks, stride in ((1, 3, 1), (2, 4, 2), (4, 6, 2), (8, 3, 2)):
        width = base * scale
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def _model_steps(steps: int, profile: bool) -> None:
    """Host time per norm layer of a resnet50-shaped model's training step (see the docstring)."""
    import copy

    torch.set_flush_denormal(True)  # the fake kernels leave their outputs uninitialized
    torch.manual_seed(0)
    theirs = _resnet50_shaped().to(memory_format=torch.channels_last)
    ours = cnt.fuse(copy.deepcopy(theirs))
    stripped = copy.deepcopy(theirs)
    for parent in list(stripped.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.BatchNorm2d):
                setattr(parent, name, torch.nn.Identity())
    layers = sum(isinstance(m, torch.nn.BatchNorm2d) for m in theirs.modules())
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)

    def step_of(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            optimizer.step()

        return step

    models = {"torch (CPU kernels)": theirs, "cupynorm (fuse)": ours, "no norms": stripped}
    steps_of = {name: step_of(m) for name, m in models.items()}
    best = {}
    for _ in range(3):  # rounds alternate: the CPU is shared
        for name, step in steps_of.items():
            for _ in range(5):
                step()
            started = time.perf_counter()
            for _ in range(steps):
                step()
            us = (time.perf_counter() - started) / steps * 1e6
            best[name] = min(best.get(name, us), us)
    for name, us in best.items():
        print(f"{name:20s} {us:9.0f} us per step")
    base = best["no norms"]
    for name in ("torch (CPU kernels)", "cupynorm (fuse)"):
        print(f"{name}: {(best[name] - base) / layers:.1f} us per norm layer ({layers} layers)")
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            steps_of["cupynorm (fuse)"]()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


# the layer of a step: BatchNormAct2d with a residual, BatchNorm2d, GroupNorm(32),
# GroupNormAct(32) (SiLU), LayerNorm over 64 features
_LAYERS = {
    "act": lambda: cnt.BatchNormAct2d(64),
    "bn": lambda: cnt.BatchNorm2d(64),
    "gn": lambda: cnt.GroupNorm(32, 64),
    "gnact": lambda: cnt.GroupNormAct(32, 64),
    "ln": lambda: cnt.LayerNorm(64),
    "ln2d": lambda: cnt.LayerNorm2d(64),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("layer", nargs="?", choices=sorted(_LAYERS), default="act")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--stack", type=int, default=1, help="layers in a chain (default 1)")
    parser.add_argument("--launches", choices=("driver", "none"), default="driver")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--model", action="store_true", help="a resnet50-shaped model's step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _cuda_host_code_on_cpu(args.launches)
    if args.model:
        _model_steps(max(1, args.steps // 100), not args.no_profile)
        return
    act = args.layer == "act"
    layers = [_LAYERS[args.layer]() for _ in range(args.stack)]
    shape = (8, 64, 14, 14) if args.stack == 1 else (8, 64, 2, 2)  # small: no CPU copies
    if args.layer == "ln":
        shape = (8, 196, 64) if args.stack == 1 else (8, 4, 64)
    x = torch.randn(shape)
    if x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
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
