"""KernelBench level 2, 28 (BMM_InstanceNorm_Sum_ResidualAdd_Multiply), heavy size ("seed 002").

`Model`: Linear, then InstanceNorm2d over each row's features (through unsqueeze/squeeze), then
`(x + y) * y`. `ModelNew` keeps the same Linear (`bmm`, created first, so seeded construction and
`state_dict` loading give identical weights) and fuses the tail into one cupynorm kernel,
`cupynorm.torch.row_norm_add_mul`.

`nn.InstanceNorm2d(out_features)` defaults to `affine=False, track_running_stats=False`: it has
no parameters and no buffers, so ModelNew needs no `instance_norm` submodule and both models have
the state_dict keys `bmm.weight`, `bmm.bias`. (`momentum` is unused there, as in the original.)

Run it (CUDA GPU): `python examples/linear_instancenorm_residual.py [--batch N] [--reps N]` prints
the max abs error of ModelNew against Model and the median time of both (CUDA events, L2 flushed).
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
    """Linear, instance norm over the features of each row, residual add, multiply."""

    def __init__(
        self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1
    ):
        super().__init__()
        self.bmm = nn.Linear(in_features, out_features)
        self.instance_norm = nn.InstanceNorm2d(out_features, eps=eps, momentum=momentum)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.bmm(x)
        x = self.instance_norm(x.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
        x = x + y
        x = x * y
        return x


class ModelNew(nn.Module):
    """The same Linear, then norm + add + mul fused: `(normalize_rows(x) + y) * y`."""

    def __init__(
        self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1
    ):
        super().__init__()
        self.bmm = nn.Linear(in_features, out_features)
        self.eps = eps

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cupynorm.torch.row_norm_add_mul(self.bmm(x), y, eps=self.eps)


batch_size = 1024
in_features = 8192
out_features = 8192


def get_inputs() -> list[torch.Tensor]:
    x = torch.rand(batch_size, in_features, device="cuda")
    y = torch.rand(batch_size, out_features, device="cuda")
    return [x, y]


def get_init_inputs() -> list[int]:
    return [in_features, out_features]


if __name__ == "__main__":
    from cupynorm.bench import run_example_cli

    sys.exit(run_example_cli(sys.modules[__name__]))
