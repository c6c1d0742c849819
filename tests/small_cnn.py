"""A small CNN with every torch.nn norm the cupynorm.torch modules replace (shared by the CPU and
GPU tests of the torch layer)."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)  # a bias before BN is moot
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.gn = nn.GroupNorm(3, 6)
        self.inorm = nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
        self.head = nn.Linear(6, 3, bias=False)  # a bias before BN is moot
        self.bn1d = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inorm(torch.relu(self.bn(self.conv1(x))))
        x = torch.relu(self.gn(self.conv2(x)))
        return self.bn1d(self.head(x.mean(dim=(2, 3))))
