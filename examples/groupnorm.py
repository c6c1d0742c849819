"""KernelBench level 1, 35 (GroupNorm), heavy size: `Model` in torch, `ModelNew` on cupynorm.

Run it (CUDA GPU): `python examples/groupnorm.py [--batch N] [--reps N]` prints the max abs error
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
    """Group normalization with torch.nn (affine weight and bias per channel)."""

    def __init__(self, num_features: int, num_groups: int):
        super().__init__()
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(x)


class ModelNew(nn.Module):
    """The same model on cupynorm's drop-in GroupNorm (same parameter names, same order)."""

    def __init__(self, num_features: int, num_groups: int):
        super().__init__()
        self.gn = cupynorm.torch.GroupNorm(num_groups=num_groups, num_channels=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(x)


batch_size = 112
features = 64
num_groups = 8
dim1 = 512
dim2 = 512


def get_inputs() -> list[torch.Tensor]:
    x = torch.rand(batch_size, features, dim1, dim2, device="cuda")
    return [x]


def get_init_inputs() -> list[int]:
    return [features, num_groups]


if __name__ == "__main__":
    from cupynorm.bench import run_example_cli

    sys.exit(run_example_cli(sys.modules[__name__]))
