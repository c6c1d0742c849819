"""Swap the torch.nn normalization modules of a model for cupynorm's, in place.

Each cupynorm module subclasses its torch.nn counterpart, adds no state and overrides only
``forward``, so a module is converted by reassigning its class (``module.__class__ = ...``, as
:mod:`torch.nn.utils.parametrize` does). The module object stays the same: its parameters and
buffers are the same tensor objects (optimizers and EMA copies still hold them), device, dtype,
training mode and hooks are kept, a module shared by several parents is converted once, and the
root module itself can be converted.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import modules

__all__ = ["replace_norms"]

# Exact torch.nn types only: subclasses (SyncBatchNorm, lazy modules, cupynorm's own modules) are
# left alone.
_REPLACEMENTS: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
    torch.nn.InstanceNorm1d: modules.InstanceNorm1d,
    torch.nn.InstanceNorm2d: modules.InstanceNorm2d,
    torch.nn.InstanceNorm3d: modules.InstanceNorm3d,
    torch.nn.GroupNorm: modules.GroupNorm,
    torch.nn.BatchNorm1d: modules.BatchNorm1d,
    torch.nn.BatchNorm2d: modules.BatchNorm2d,
    torch.nn.BatchNorm3d: modules.BatchNorm3d,
}


def _classes(arg: str, classes: Iterable[type] | None) -> set[type]:
    if classes is None:
        return set()
    if isinstance(classes, type):
        classes = (classes,)
    chosen = set()
    for cls in classes:
        if cls not in _REPLACEMENTS:
            names = ", ".join(f"torch.nn.{c.__name__}" for c in _REPLACEMENTS)
            raise ValueError(f"replace_norms: {arg} takes classes among {names}; got {cls!r}")
        chosen.add(cls)
    return chosen


def replace_norms(
    model: torch.nn.Module,
    *,
    include: Iterable[type[torch.nn.Module]] | None = None,
    exclude: Iterable[type[torch.nn.Module]] | None = None,
) -> torch.nn.Module:
    """Convert every torch.nn normalization submodule of ``model`` to cupynorm's, in place.

    Modules of exactly the types ``torch.nn.InstanceNorm1d/2d/3d``, ``GroupNorm`` and
    ``BatchNorm1d/2d/3d`` become :class:`cupynorm.torch.InstanceNorm2d` etc.; subclasses such
    as ``SyncBatchNorm`` are left alone. The converted modules keep their parameters and buffers
    (the same tensor objects), device, dtype, training mode and hooks. On the CPU they compute
    exactly as before; on CUDA they run cupynorm's kernels.

    Args:
        model: the model; ``model`` itself is converted too if it is a normalization module.
        include: torch.nn classes to convert (default: all seven).
        exclude: torch.nn classes to leave alone (applied after ``include``).

    Returns:
        ``model``, converted in place.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``include``/``exclude`` name a class other than the seven above.

    Example::

        >>> model = torchvision.models.resnet18().cuda()
        >>> cupynorm.torch.replace_norms(model, exclude=[torch.nn.BatchNorm1d])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"replace_norms: expected a torch.nn.Module, got {type(model).__name__}")
    kinds = _classes("include", include) if include is not None else set(_REPLACEMENTS)
    kinds -= _classes("exclude", exclude)
    for module in model.modules():  # each module once, even when shared
        cls = type(module)
        if cls in kinds:
            module.__class__ = _REPLACEMENTS[cls]
    return model
