"""Models the bench builds itself (torch imported on first use).

- seed 002's reference models (KernelBench level 2, 28) for the `row_norm_add_mul_fp32` and
  `seed002_model_fp32` rows.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_SEED002_CLASSES: dict[str, type] = {}


def seed002_module_classes() -> dict[str, type]:
    """Seed002Tail (eager tail), Seed002Model (eager model), Seed002ModelCupynorm."""
    if _SEED002_CLASSES:
        return _SEED002_CLASSES
    from torch import nn

    class Seed002Tail(nn.Module):
        """Seed 002's epilogue in eager torch: instance norm over each row, then (x + y) * y."""

        def __init__(self, features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
            super().__init__()
            self.instance_norm = nn.InstanceNorm2d(features, eps=eps, momentum=momentum)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = self.instance_norm(x.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
            x = x + y
            return x * y

    class Seed002Model(nn.Module):
        """Seed 002 (KernelBench level 2, 28): Linear, row instance norm, + y, * y."""

        def __init__(
            self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1
        ) -> None:
            super().__init__()
            self.bmm = nn.Linear(in_features, out_features)
            self.instance_norm = nn.InstanceNorm2d(out_features, eps=eps, momentum=momentum)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = self.bmm(x)
            x = self.instance_norm(x.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
            x = x + y
            return x * y

    class Seed002ModelCupynorm(nn.Module):
        """Seed 002 with the tail fused by `cupynorm.torch.row_norm_add_mul`."""

        def __init__(
            self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1
        ) -> None:
            super().__init__()
            cupynorm_torch = importlib.import_module("cupynorm.torch")
            self.bmm = nn.Linear(in_features, out_features)
            self.eps = eps
            self._row_norm_add_mul = cupynorm_torch.row_norm_add_mul

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self._row_norm_add_mul(self.bmm(x), y, eps=self.eps)

    _SEED002_CLASSES.update(
        Seed002Tail=Seed002Tail,
        Seed002Model=Seed002Model,
        Seed002ModelCupynorm=Seed002ModelCupynorm,
    )
    return _SEED002_CLASSES
