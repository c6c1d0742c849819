"""`profile cpu`: cupynorm's host path without a GPU.

CPU tensors stand in for device arrays and a driver that does nothing stands in for CUDA (as the
CPU tests of the recorded calls do, tests/test_programs_cpu.py), so a layer's forward + backward
runs cupynorm's whole CUDA host code -- module, checks, autograd.Function, the recorded calls'
replays, the launchers' argument packing -- with no kernels: what is left of a step's host time
once launches and allocations are cheap. The device adds its own (a launch ~4 µs, an allocation
3-4 µs): `profile stack` measures those on a GPU.

The stacks are `profile stack`'s families on small float32 inputs; `--launches none` replaces the
launchers by no-ops (the replay alone); `--model` runs a resnet50-shaped network instead (53
BatchNorm2d on a 2x3x32x32 input) with torch's CPU norms, cupynorm's (`fuse`) and none, for the
host time per norm layer inside a model's step. Needs the source checkout: the routing of the
modules' eager path to the host code comes from the tests (tests/test_programs_cpu.py), which
keep it in step with the package. Everything is restored on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any

from . import stack
from .common import ProfileError, format_table, print_cprofile

if TYPE_CHECKING:
    import torch


class _NoLaunch:
    def launch(self, grid: Any, block: Any, smem: int, stream: int, args: Any) -> None:
        pass


class _NoDriver:
    """cupy.cuda.driver / runtime with calls that do nothing (the real Launcher packs its
    arguments and makes the call; only the driver's own work is missing)."""

    CUDADriverError = RuntimeError

    @staticmethod
    def launchKernel(*args: Any) -> None:
        pass

    @staticmethod
    def launchCooperativeKernel(*args: Any) -> None:
        pass

    @staticmethod
    def memsetAsync(*args: Any) -> None:
        pass

    @staticmethod
    def getDevice() -> int:
        return 0

    @staticmethod
    def setDevice(device: int) -> None:
        pass


def _tests_helpers() -> ModuleType:
    """tests/test_programs_cpu.py of the source checkout (its device stand-ins and routing)."""
    tests = Path(__file__).resolve().parents[3] / "tests"
    if not (tests / "test_programs_cpu.py").is_file():
        raise ProfileError(
            f"`profile cpu` needs the source checkout's tests/ (not found at {tests})"
        )
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    import test_programs_cpu

    return test_programs_cpu


@contextlib.contextmanager
def fake_device(launches: str = "driver") -> Iterator[None]:
    """CPU tensors through the CUDA host code with launches that do nothing: the real launchers
    on a driver that does nothing (`"driver"`) or no launchers at all (`"none"`); no recorded
    call of the real device is seen or kept. Every attribute set is restored on exit."""
    from cupynorm import _compile, _interop, _plan, _program

    helpers = _tests_helpers()
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    backend = helpers._CpuTorchBackend()
    try:
        patch(_interop, "backend_of", lambda x: backend)
        patch(_plan, "device_info", lambda device: helpers.H200)
        patch(_compile, "_runtime", lambda: _NoDriver)
        if launches == "none":
            patch(_compile, "launcher", lambda *args: _NoLaunch())
        else:
            patch(_compile, "get_kernel", lambda *args: SimpleNamespace(ptr=0))
            patch(_compile, "_driver", lambda: _NoDriver)
            # the real launchers, uncached: a cached one would keep the faked kernel and driver
            # for the real device's later calls in this process (a GPU machine's test run)
            patch(_compile, "launcher", _compile.launcher.__wrapped__)
        patch(_compile, "max_block_threads", lambda *a: 1024)
        patch(_compile, "resident_ctas", lambda *a: 2)
        patch(_compile, "has_cooperative_launch", lambda: True)
        patch(_program, "check_replay", None)
        patch(_program, "_PROGRAMS", {})
        helpers.route_eager_to_host_code(patch)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _resnet50_shaped(base: int = 8) -> torch.nn.Module:
    """torchvision's resnet50 layout (bottlenecks 3-4-6-3, 53 BatchNorm2d) with `base` channels
    in the stem instead of 64 (cheap CPU convolutions), written out: no torchvision needed."""
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

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            return self.relu(self.bn3(self.conv3(out)) + identity)

    layers: list[nn.Module] = [
        nn.Conv2d(3, base, 7, 2, 3, bias=False),
        nn.BatchNorm2d(base),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = base
    for scale, blocks, stride in ((1, 3, 1), (2, 4, 2), (4, 6, 2), (8, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, base * scale, stride if i == 0 else 1))
            cin = base * scale * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


def model_rows(steps: int, cprofile: bool = False) -> tuple[int, dict[str, float]]:
    """(norm layers, {model: best µs per training step}) of the resnet50-shaped model: torch's
    CPU norms, cupynorm's (`fuse`), no norms; rounds alternate them (the CPU is shared)."""
    import torch

    import cupynorm.torch as cnt
    from cupynorm.bench import models

    torch.manual_seed(0)
    theirs = _resnet50_shaped().to(memory_format=torch.channels_last)
    layers = models.count_norm_layers(theirs)
    variants = {
        "torch (CPU kernels)": theirs,
        "cupynorm (fuse)": cnt.fuse(copy.deepcopy(theirs)),
        "no norms": models.strip_norms(copy.deepcopy(theirs)),
    }
    x = torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last)

    def step_of(model: torch.nn.Module) -> Any:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            optimizer.step()

        return step

    steps_of = {name: step_of(m) for name, m in variants.items()}
    best: dict[str, float] = {}
    for _ in range(3):
        for name, step in steps_of.items():
            for _ in range(3):
                step()
            started = time.perf_counter()
            for _ in range(steps):
                step()
            us = (time.perf_counter() - started) / steps * 1e6
            best[name] = min(best.get(name, us), us)
    if cprofile:
        print_cprofile(steps_of["cupynorm (fuse)"], steps, "cupynorm (fuse) model steps")
    return layers, best


def run(args: argparse.Namespace) -> int:
    """`profile cpu`."""
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the faked kernels leave their outputs uninitialized
    with fake_device(args.launches):
        if args.model:
            layers, best = model_rows(max(1, args.steps // 100), args.cprofile)
            base = best["no norms"]
            rows = [
                [name, us, None if name == "no norms" else (us - base) / layers]
                for name, us in best.items()
            ]
            print(f"resnet50-shaped model ({layers} BatchNorm2d), 2x3x32x32, CPU, launches faked")
            print(format_table(["model", "µs per step", "µs per norm layer"], rows))
            return 0
        bench = stack.Bench("cpu", lambda: None, steps=args.steps, warmup=10)
        rows: list[stack.LayerRow] = []
        for family in stack.chosen_families(args.family):
            rows += stack.profile_family(
                family, args.layers, bench, ("floor", "cupynorm"), cpu=True, cprofile=args.cprofile
            )
    setup = (
        f"{args.layers} layers in a stack on the CPU (float32, launches faked: {args.launches}); "
        "per layer over an nn.Identity stack"
    )
    print(setup)
    print(stack.format_rows(rows, gpu=False))
    if args.json:
        stack.write_json(args.json, setup, args.layers, rows)
    return 0
