"""`python -m cupynorm profile SUBCOMMAND`: where the time of cupynorm's norm layers goes, beside
torch's (development tool; the bench measures, this explains).

  stack    host µs per layer in a stack of N (default 50) layers of one family, torch's module
           beside cupynorm's and a Python floor: forward and backward apart, with the GPU time,
           launches and allocations per layer (--family all: one table of every family)
  model    where a model row's training step spends its host time: the issue time per step and
           per norm layer, its phases, the norm layers' forward and backward nodes, the CUDA API
           calls, synchronizing operations; --compile: the compiled step's graph breaks and
           heaviest kernels
  calls    µs per call of each public function (cupynorm.*) on CuPy arrays, torch tensors and
           JAX arrays, small and large inputs, beside cupynorm.torch's module and torch's own
           call; GPU µs per call beside the same norm written by hand in CuPy (runs without
           torch)
  cpu      the stacks (or a resnet50-shaped model) on the CPU with faked launches: cupynorm's
           host path measured without a GPU
  kernels  a torch.profiler kernel table of one bench workload: each kernel's µs and launches
           per call, torch eager, torch.compile and cupynorm

Every subcommand but `cpu` needs a CUDA GPU, and all but `calls` PyTorch. Numbers come with no
pass or fail: the findings go to benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import sys

from ..cli import positive_int

SUBCOMMANDS = ("stack", "model", "calls", "cpu", "kernels")


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommands of `python -m cupynorm profile` and their options."""
    from . import stack

    commands = parser.add_subparsers(dest="profile_command", metavar="SUBCOMMAND")
    commands.required = True

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=text, description=text)

    stack.add_arguments(
        command("stack", "host µs per norm layer in a stack, torch beside cupynorm (GPU)"),
        compiled=True,
    )
    cpu = command("cpu", "the stacks (or --model) on the CPU with faked launches (no GPU)")
    stack.add_arguments(cpu, steps=2000)
    cpu.add_argument(
        "--launches",
        choices=("driver", "none"),
        default="driver",
        help="driver: the real launchers on a driver that does nothing (default); none: no "
        "launchers (the replay alone)",
    )
    cpu.add_argument("--model", action="store_true", help="a resnet50-shaped model's step")

    model = command("model", "where a model row's training step spends its host time (GPU)")
    model.add_argument(
        "--row",
        default="resnet50_b64_bf16_cl",
        help="a model row of `python -m cupynorm bench --list` (default resnet50_b64_bf16_cl)",
    )
    model.add_argument("--batch", type=positive_int, help="batch size (default: the row's)")
    model.add_argument("--steps", type=positive_int, default=20, help="timed steps (default 20)")
    model.add_argument("--compile", action="store_true", help="also the torch.compile'd step")
    model.add_argument("--top", type=positive_int, default=12, help="kernels listed (default 12)")
    model.add_argument(
        "--cprofile",
        action="store_true",
        help="cProfile of the steps (eager; compiled too with --compile)",
    )

    calls = command(
        "calls",
        "µs per public functional call on CuPy / torch / JAX, GPU µs beside CuPy by hand (GPU; "
        "torch and JAX optional)",
    )
    calls.add_argument(
        "--calls", type=positive_int, default=2000, help="calls per small case (default 2000)"
    )
    calls.add_argument("--json", metavar="PATH", help="also write the rows as JSON")

    kernels = command("kernels", "kernel table of one bench workload, torch.profiler (GPU)")
    kernels.add_argument(
        "workload", help="a kernel row of `python -m cupynorm bench --list`, e.g. layernorm_bf16"
    )
    kernels.add_argument("--quick", action="store_true", help="the row's --quick shapes")
    kernels.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    kernels.add_argument(
        "--calls", type=positive_int, default=10, help="profiled calls (default 10)"
    )


def run_profile(args: argparse.Namespace) -> int:
    """Run a parsed `profile` command; 0 done, 2 no GPU (or torch) or a bad name."""
    from .common import ProfileError, cuda_problem, cupy_cuda_problem

    name = args.profile_command
    if name != "cpu":
        problem = cupy_cuda_problem() if name == "calls" else cuda_problem()
        if problem is not None:
            print(f"cupynorm profile {name}: {problem}", file=sys.stderr)
            return 2
    try:
        if name == "stack":
            from .stack import run
        elif name == "cpu":
            from .cpu import run
        elif name == "model":
            from .model import run
        elif name == "calls":
            from .calls import run
        else:
            from .kernels import run
        return run(args)
    except ProfileError as exc:
        print(f"cupynorm profile {name}: {exc}", file=sys.stderr)
        return 2
