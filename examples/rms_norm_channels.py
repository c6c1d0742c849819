"""KernelBench level 1, 36 (RMS normalization over the channels of NCHW): `Model` in torch,
`ModelNew` on cupynorm.

Every pixel of each sample is divided by the root mean square of its 64 channel values
(`x / sqrt(mean(x**2, dim=1, keepdim=True) + eps)`). The tensor is 112 x 64 x 512 x 512 fp32
(7.5 GB): cupynorm reads it once and writes it once (`channel_norm.cu`: each thread holds a
pack of adjacent pixels of 16 channels in registers, 4 threads share a pixel's 64 channels).

Run it (CUDA GPU): `python examples/rms_norm_channels.py [--batch N] [--reps N]` prints the max abs
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
    """RMS normalization over dim 1 in torch operations (the problem's own formula)."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features = num_features
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + self.eps)
        return x / rms


class ModelNew(nn.Module):
    """The same on cupynorm's rms_norm2d (no weight: the problem has none)."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features = num_features
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cupynorm.torch.rms_norm2d(x, eps=self.eps)


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
