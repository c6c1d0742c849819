"""What the profiler's subcommands share: the markdown table, a cProfile printout, the floor of a
norm layer written in Python, and why a GPU subcommand cannot run here."""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable, Sequence
from typing import Any


class ProfileError(Exception):
    """What a profile cannot run with (an unknown row, a missing package): exit 2."""


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """A markdown table: the first `left` columns left-aligned, the others right-aligned; a
    float is written with one decimal, None as "-"."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.1f}"
        return str(value).replace("|", "\\|")

    align = ["---"] * left + ["---:"] * (len(columns) - left)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def print_cprofile(fn: Callable[[], object], calls: int, title: str, top: int = 25) -> None:
    """`calls` calls of `fn` under cProfile; the functions by own time."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    print(f"\ncProfile, {title}, {calls} calls, by own time:")
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)


_FLOOR: dict[str, type] = {}


def floor_layer_class() -> type:
    """`FloorLayer(features)`: a norm layer's autograd in Python with no kernels, the floor of any
    norm written as a Python `autograd.Function`: the output, the statistics and the gradients
    allocated as a norm allocates them, the tensors saved for backward, nothing computed."""
    if _FLOOR:
        return _FLOOR["FloorLayer"]
    import torch

    class _Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> Any:
            y = torch.empty_like(x)
            mean = x.new_empty(weight.shape[0], dtype=torch.float32)
            rstd = x.new_empty(weight.shape[0], dtype=torch.float32)
            ctx.save_for_backward(x, weight, mean, rstd)
            ctx.mark_non_differentiable(mean, rstd)
            ctx.set_materialize_grads(False)
            return y, mean, rstd

        @staticmethod
        def backward(ctx: Any, dy: torch.Tensor, *_stats: Any) -> Any:
            x, weight, _mean, _rstd = ctx.saved_tensors
            return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)

    class FloorLayer(torch.nn.Module):
        def __init__(self, features: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(features))
            self.bias = torch.nn.Parameter(torch.zeros(features))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Floor.apply(x, self.weight, self.bias)[0]

    _FLOOR["FloorLayer"] = FloorLayer
    return FloorLayer


def cupy_cuda_problem() -> str | None:
    """Why a subcommand that needs only CuPy and a GPU cannot run here, or None."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is needed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no runtime: the same answer
        return f"a CUDA GPU is needed ({type(exc).__name__}: {exc})"
    return None if count else "a CUDA GPU is needed (CuPy sees none)"


def cuda_problem() -> str | None:
    """Why a GPU subcommand cannot run here, or None."""
    try:
        import torch
    except ImportError as exc:
        return f"PyTorch is needed ({exc})"
    if not torch.cuda.is_available():
        return "a CUDA GPU is needed (torch.cuda.is_available() is False); `profile cpu` runs here"
    return None
