"""KernelBench level 1, 40 (LayerNorm over (64, 256, 256)): `Model` in torch, `ModelNew` on
cupynorm.

Each of the 16 rows holds 4M values (16 MiB in fp32), longer than one CTA or a team of CTAs holds
on chip: cupynorm takes a statistics pass, then normalizes.

Run it (CUDA GPU): `python examples/layernorm.py [--batch N] [--reps N]` prints the max abs error
of ModelNew against Model and the median time of both (CUDA events, L2 flushed).
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn as nn

if importlib.util.find_spec("cupynorm") is None:  # a source checkout without cupynorm installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm.torch  # noqa: E402


class Model(nn.Module):
    """Layer normalization with torch.nn (elementwise weight and bias)."""

    def __init__(self, normalized_shape: tuple):
        super().__init__()
        self.ln = nn.LayerNorm(normalized_shape=normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


class ModelNew(nn.Module):
    """The same model on cupynorm's drop-in LayerNorm (same parameter names, same order)."""

    def __init__(self, normalized_shape: tuple):
        super().__init__()
        self.ln = cupynorm.torch.LayerNorm(normalized_shape=normalized_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


batch_size = 16
features = 64
dim1 = 256
dim2 = 256


def get_inputs() -> list[torch.Tensor]:
    x = torch.rand(batch_size, features, dim1, dim2, device="cuda")
    return [x]


def get_init_inputs() -> list[tuple]:
    return [(features, dim1, dim2)]


if __name__ == "__main__":
    from cupynorm.bench import run_example_cli

    sys.exit(run_example_cli(sys.modules[__name__]))
