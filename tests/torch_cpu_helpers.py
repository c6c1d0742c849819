"""Shared cases and helpers of the CPU tests of cupynorm.torch: the module pairs (cupynorm's and
torch.nn's), constructor configurations the installed torch accepts, inputs, and a few SGD steps.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import cupynorm.torch as cnt

PAIRS = [
    (cnt.BatchNorm1d, nn.BatchNorm1d),
    (cnt.BatchNorm2d, nn.BatchNorm2d),
    (cnt.BatchNorm3d, nn.BatchNorm3d),
    (cnt.InstanceNorm1d, nn.InstanceNorm1d),
    (cnt.InstanceNorm2d, nn.InstanceNorm2d),
    (cnt.InstanceNorm3d, nn.InstanceNorm3d),
    (cnt.GroupNorm, nn.GroupNorm),
]
PAIR_IDS = [ours.__name__ for ours, _ in PAIRS]

# (N, C, *spatial) inputs per module kind: odd sizes, C = 3 (6 for two groups of 3)
SHAPES = {
    "BatchNorm1d": [(5, 3), (5, 3, 7)],
    "BatchNorm2d": [(4, 3, 7, 1), (2, 3, 5, 3)],
    "BatchNorm3d": [(2, 3, 1, 7, 1), (2, 3, 3, 1, 5)],
    "InstanceNorm1d": [(4, 3, 7), (3, 7)],
    "InstanceNorm2d": [(4, 3, 7, 1), (3, 5, 3)],
    "InstanceNorm3d": [(2, 3, 1, 7, 1), (3, 3, 1, 5)],
    "GroupNorm": [(4, 6, 7), (3, 6, 5, 3)],
}


def _takes_bias(torch_cls: type) -> bool:
    """Whether the installed torch's class has the ``bias`` argument (newer torch only)."""
    return "bias" in inspect.signature(torch_cls).parameters


def _configs(torch_cls: type) -> list[dict]:
    """Constructor kwargs covering affine/bias/track_running_stats/momentum (bias=False only
    where the installed torch has it)."""
    if torch_cls is nn.GroupNorm:
        configs = [dict(affine=True), dict(affine=False)]
        no_bias = dict(affine=True, bias=False)
    else:
        configs = [
            dict(affine=a, track_running_stats=t, momentum=m)
            for a in (True, False)
            for t in (True, False)
            for m in (0.1, None)
        ]
        no_bias = dict(affine=True, bias=False, track_running_stats=True)
    return configs + ([no_bias] if _takes_bias(torch_cls) else [])


def _make(cls: type, torch_cls: type, **kwargs) -> nn.Module:
    if torch_cls is nn.GroupNorm:
        return cls(3, 6, **kwargs)
    return cls(3, **kwargs)


def _cases():
    for ours, theirs in PAIRS:
        for i, cfg in enumerate(_configs(theirs)):
            for shape in SHAPES[ours.__name__]:
                yield pytest.param(ours, theirs, cfg, shape, id=f"{ours.__name__}-cfg{i}-{shape}")


def _randomize(m: nn.Module, seed: int = 0) -> None:
    """Non-default parameters and running statistics (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        if getattr(m, "running_mean", None) is not None:
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)


def _pair(ours: type, theirs: type, cfg: dict, dtype=torch.float32):
    a = _make(ours, theirs, dtype=dtype, **cfg)
    b = _make(theirs, theirs, dtype=dtype, **cfg)
    _randomize(b)
    a.load_state_dict(b.state_dict())
    return a, b


def _run_steps(m: nn.Module, xs: list[torch.Tensor], train: bool):
    """3 SGD steps: returns outputs, input grads and the module after training."""
    m.train(train)
    opt = torch.optim.SGD(m.parameters(), lr=0.1) if list(m.parameters()) else None
    outs, grads = [], []
    for x in xs:
        x = x.clone().requires_grad_()
        y = m(x)
        # a loss whose gradient is not constant (exercises the full backward formula)
        ramp = torch.linspace(-1, 2, y.numel(), dtype=y.dtype).reshape(y.shape)
        (y * ramp + y**2).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
        if opt is not None:
            opt.step()
            opt.zero_grad()
    return outs, grads


def _inputs(shape, n=3, dtype=torch.float32, seed=1, channels_last=False):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=g, dtype=dtype) * 2 + 0.5 for _ in range(n)]
    if channels_last:
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        xs = [x.to(memory_format=fmt) for x in xs]
    return xs


def patch_route(setattr, name: str, value) -> None:
    """Set a routing name of ``cupynorm.torch._route`` (``_use_kernels``, ``_traced``,
    ``_AUTOCAST_RMS_NORM``) to ``value`` in every module of ``cupynorm.torch`` that looks it
    up: ``_route`` itself and each family module that imports it (a module patched alone would
    leave the others on the real routing). ``setattr``: monkeypatch's, or the plain one."""
    import sys

    from cupynorm.torch import _route

    current = getattr(_route, name)
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("cupynorm.torch.") and getattr(module, name, None) is current:
            setattr(module, name, value)
