"""The forward logic of torch.nn's norm base classes on cupynorm's functional: the mixins
:mod:`.modules` (and :class:`~cupynorm.torch.SyncBatchNorm`) put before their ``torch.nn`` base.

``_BatchNormForward`` repeats ``torch.nn.modules.batchnorm._BatchNorm.forward`` (the exponential
average factor, the ``num_batches_tracked`` update, which buffers are passed), with the batch
counter left to the kernels where they can increment it; ``_InstanceNormForward`` repeats
``torch.nn.modules.instancenorm._InstanceNorm.forward`` (its warnings and errors, unbatched
input). No ``super()`` chains, no per-call allocation beyond the output and the statistics.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ._batch_norm import _batch_norm_route
from ._instance_norm import instance_norm
from ._reference import ACTIVATIONS

_TENSOR_NAMES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
_ANSWERED_ELSEWHERE: dict[type, bool] = {}  # class -> something but the dicts may answer


def _module_tensors(module: torch.nn.Module) -> list:
    """``module.weight``, ``.bias``, ``.running_mean``, ``.running_var``,
    ``.num_batches_tracked`` as attribute access gives them. ``Module.__getattr__`` finds them in
    ``_parameters`` or ``_buffers`` (~0.4 us each, five per training call); they are read there
    directly unless something else may answer: a class attribute (a parametrization's
    property, a subclass's), an instance attribute of the name, a class's own ``__getattr__``."""
    if torch.compiler.is_compiling():  # traced once: no shortcut, and no guard on the cache
        return [getattr(module, name) for name in _TENSOR_NAMES]
    cls = type(module)
    elsewhere = _ANSWERED_ELSEWHERE.get(cls)
    if elsewhere is None:
        elsewhere = any(hasattr(cls, n) for n in _TENSOR_NAMES)
        elsewhere = _ANSWERED_ELSEWHERE[cls] = (
            elsewhere or cls.__getattr__ is not torch.nn.Module.__getattr__
        )
    state = module.__dict__
    params, buffers = state["_parameters"], state["_buffers"]
    tensors = []
    for name in _TENSOR_NAMES:
        if not elsewhere and name not in state:
            if name in params:
                tensors.append(params[name])
                continue
            if name in buffers:
                tensors.append(buffers[name])
                continue
        tensors.append(getattr(module, name))
    return tensors


class _BatchNormForward:
    """``forward`` of ``torch.nn.modules.batchnorm._BatchNorm`` on :func:`batch_norm`."""

    def forward(self, input: Tensor) -> Tensor:
        args = self._batch_norm_args(input, count_in_kernel=True)
        return _batch_norm_route("batch_norm", *args, None, None)

    def _batch_norm_args(
        self, input: Tensor, check: bool = True, count_in_kernel: bool = False
    ) -> tuple:
        """The arguments torch's ``_BatchNorm.forward`` hands ``F.batch_norm``, and its
        ``num_batches_tracked`` update: done here, or with ``count_in_kernel`` left to the
        kernels (the counter is the last item, else None; the factor of ``momentum=None`` needs
        the count here). ``check=False``: the caller checked ``input``."""
        if check:
            self._check_input_dim(input)
        weight, bias, running_mean, running_var, tracked = _module_tensors(self)
        # The exponential average factor exactly as torch's _BatchNorm.forward computes it.
        if self.momentum is None:
            exponential_average_factor = 0.0
        else:
            exponential_average_factor = self.momentum
        counter = None
        if self.training and self.track_running_stats and tracked is not None:
            # the kernels add to an int64 beside the input (torch's buffer, unless replaced)
            in_kernel = tracked.dtype == torch.long and tracked.device == input.device
            if count_in_kernel and self.momentum is not None and in_kernel:
                counter = tracked
            else:
                tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                exponential_average_factor = 1.0 / float(tracked)
        # Batch statistics in training, and in eval when there are no running statistics.
        if self.training:
            bn_training = True
        else:
            bn_training = running_mean is None and running_var is None
        # The running statistics are passed when they are updated (training and tracked) or used
        # (eval and present).
        use_buffers = not self.training or self.track_running_stats
        return (
            input,
            running_mean if use_buffers else None,
            running_var if use_buffers else None,
            weight,
            bias,
            bn_training,
            exponential_average_factor,
            self.eps,
            counter,
        )


def _batch_norm_act_forward(
    module: _BatchNormForward, input: Tensor, residual: Tensor | None, activation: str
) -> Tensor:
    """``activation(module's batch norm(input) + residual)``: :class:`BatchNormAct2d`'s forward,
    and that of a norm-act subclass :func:`cupynorm.torch.fuse` runs on the fused op."""
    args = module._batch_norm_args(input, count_in_kernel=True)
    if residual is not None and (residual.shape != input.shape or residual.dtype != input.dtype):
        # an add that broadcasts or promotes (fuse() cannot see shapes): the add and the
        # activation as torch ops after cupynorm's batch norm. Under torch.compile the fused op
        # stays (resnet50 compiled, H100: batch 256 48.8 -> 45.8 ms per step with it, torch
        # 45.2; benchmarks/NOTES.md 2026-11-26 evening)
        y = _batch_norm_route("batch_norm", *args, None, None)
        return ACTIVATIONS[activation](y if residual is None else y + residual)
    return _batch_norm_route("batch_norm_act", *args, residual, activation)


class _InstanceNormForward:
    """``forward`` of ``torch.nn.modules.instancenorm._InstanceNorm`` on :func:`instance_norm`."""

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        no_batch_dim = self._get_no_batch_dim()
        feature_dim = input.dim() - no_batch_dim
        if input.size(feature_dim) != self.num_features:
            if self.affine:
                raise ValueError(
                    f"expected input's size at dim={feature_dim} to match num_features"
                    f" ({self.num_features}), but got: {input.size(feature_dim)}."
                )
            warnings.warn(
                f"input's size at dim={feature_dim} does not match num_features. "
                "You can silence this warning by not passing in num_features, "
                "which is not used because affine=False",
                stacklevel=2,
            )
        unbatched = input.dim() == no_batch_dim
        if unbatched:
            input = input.unsqueeze(0)
        out = instance_norm(
            input,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training or not self.track_running_stats,
            self.momentum if self.momentum is not None else 0.0,
            self.eps,
        )
        return out.squeeze(0) if unbatched else out
