"""Which norm kinds run on cupynorm's kernels inside ``torch.compile``.

Eager, every CUDA call runs on cupynorm's kernels. Inside a compiled graph a cupynorm op is an
opaque call that Inductor cannot fuse with its neighbours (the residual add, the activation, a
cast, the ReLU mask and the residual gradient in the backward), and each such call costs host
time that Inductor's generated launcher does not. Where Inductor's own norm kernels plus the
fusion they allow beat that, the kind is traced as torch's own functional call instead, so that
Inductor compiles it. Measured (H200, torch 2.11, 2026-11-27, model training steps compiled,
cupynorm on its kernels against torch): resnet50 b64 0.89x and efficientnet_b0 0.51x (batch
norm), convnext_tiny 0.50x (layer norm over rows and channels), Llama 0.98x (RMSNorm); group
norm (diffusion UNet blocks) 1.04x: Inductor's group norm is the weak spot. See
benchmarks/RESULTS.md for the rows with this policy.

The default keeps the group norm family (GroupNorm, GroupNormAct, InstanceNorm) and the fused
row norm + add + multiply on the kernels. Change it before compiling with
:func:`set_compile_kernels` or the environment variable ``CUPYNORM_COMPILE_KERNELS``
(``all``, ``none``, ``default`` or a comma-separated list of kinds); a graph compiled under one
policy is recompiled when the policy changes (Dynamo guards on it).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

import torch

#: the norm kinds the policy decides, each the functional calls it covers
KINDS = {
    "batch_norm": "batch_norm, batch_norm_act (BatchNorm*d, BatchNormAct2d, fuse's fused blocks)",
    "group_norm": "group_norm, group_norm_act (GroupNorm, GroupNormAct)",
    "instance_norm": "instance_norm (InstanceNorm*d)",
    "layer_norm": "layer_norm, add_layer_norm (LayerNorm)",
    "rms_norm": "rms_norm, add_rms_norm, llama_rms_norm (RMSNorm, LlamaRMSNorm)",
    "channel_norm": "layer_norm2d, rms_norm2d (LayerNorm2d, RMSNorm2d)",
    "row_norm_add_mul": "row_norm_add_mul (RowNormAddMul)",
}
#: the kinds on cupynorm's kernels inside torch.compile by default (see above)
DEFAULT = frozenset({"group_norm", "instance_norm", "row_norm_add_mul"})
ENVIRONMENT = "CUPYNORM_COMPILE_KERNELS"


def _parse(kinds: str | Iterable[str]) -> frozenset[str]:
    if isinstance(kinds, str):
        word = kinds.strip().lower()
        if word == "all":
            return frozenset(KINDS)
        if word == "none":
            return frozenset()
        if word == "default":
            return DEFAULT
        kinds = [k.strip() for k in word.split(",") if k.strip()]
    chosen = frozenset(kinds)
    unknown = sorted(chosen - KINDS.keys())
    if unknown:
        raise ValueError(
            f"unknown norm kind(s) {', '.join(map(repr, unknown))}; expected 'all', 'none', "
            f"'default' or kinds among {', '.join(map(repr, KINDS))}"
        )
    return chosen


# kind -> on the kernels inside torch.compile; a dict Dynamo guards on, changed in place
_ON_KERNELS: dict[str, bool] = dict.fromkeys(KINDS, False)


def set_compile_kernels(kinds: str | Iterable[str]) -> frozenset[str]:
    """Choose the norm kinds that run on cupynorm's kernels inside ``torch.compile`` (the others
    are traced as torch's own functional calls, for Inductor to compile and fuse); returns the
    previous choice, which this function takes back.

    ``kinds``: ``"all"``, ``"none"``, ``"default"``, a comma-separated string or an iterable of
    the names in :data:`KINDS`. Eager calls are not affected.

    Example::

        >>> import cupynorm.torch as cnt
        >>> previous = cnt.set_compile_kernels("all")     # every norm on cupynorm's kernels
        >>> cnt.set_compile_kernels(previous)
    """
    chosen = _parse(kinds)
    previous = compile_kernels()
    for kind in KINDS:
        _ON_KERNELS[kind] = kind in chosen
    return previous


def compile_kernels() -> frozenset[str]:
    """The norm kinds that run on cupynorm's kernels inside ``torch.compile`` now."""
    return frozenset(kind for kind, on in _ON_KERNELS.items() if on)


def inductor_takes(kind: str) -> bool:
    """Whether a call of this kind is being compiled and is left to Inductor (traced as torch's
    own functional call)."""
    return torch.compiler.is_compiling() and not _ON_KERNELS[kind]


try:
    set_compile_kernels(os.environ.get(ENVIRONMENT, "default"))
except ValueError as error:
    warnings.warn(f"{ENVIRONMENT} ignored: {error}", stacklevel=1)
    set_compile_kernels(DEFAULT)
