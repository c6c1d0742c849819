"""KernelBench level 1, 34 (InstanceNorm), heavy size: `Model` in torch, `ModelNew` on cupynorm.

Run it (CUDA GPU): `python examples/instancenorm2d.py [--batch N] [--reps N]` prints the max abs
error of ModelNew against Model and the median time of both (CUDA events, L2 flushed).
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
    """Instance normalization with torch.nn (no affine parameters, no running statistics)."""

    def __init__(self, num_features: int):
        super().__init__()
        self.inorm = nn.InstanceNorm2d(num_features=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inorm(x)


class ModelNew(nn.Module):
    """The same model on cupynorm's drop-in InstanceNorm2d (same submodule name, same state)."""

    def __init__(self, num_features: int):
        super().__init__()
        self.inorm = cupynorm.torch.InstanceNorm2d(num_features=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inorm(x)


batch_size = 112
features = 64
dim1 = 512
dim2 = 512


def get_inputs() -> list[torch.Tensor]:
    x = torch.rand(batch_size, features, dim1, dim2, device="cuda")
    return [x]


def get_init_inputs() -> list[int]:
    return [features]


if __name__ == "__main__":
    from cupynorm.bench import run_example_cli

    sys.exit(run_example_cli(sys.modules[__name__]))
