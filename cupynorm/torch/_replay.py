"""Eager batch norm calls replayed: the host path of a norm layer after its first call.

A training step calls each norm layer with the same shapes, strides, dtypes and arguments step
after step. The full path of such a call -- torch's argument checks, the autograd Function, the
dense layouts, the recorded call's key and replay, the Function's saved tensors and its backward's
layers -- costs ~55 us of Python per BatchNorm + ReLU layer (forward + backward) on the
development CPU, ~3x that on the GPU machines' hosts, where torch's own layer takes ~126 us
(benchmarks/NOTES.md). Everything the checks and the plan decide depends only on the kernel
op's call key (shapes, strides, dtypes, 16-byte alignments, scalar arguments) and on the devices
of the tensors. So a call whose key passed the full path once -- torch's checks, then a recorded
program of the op with the arguments as given (dense, nothing copied) -- is replayed when it comes
again with its tensors on the input's device: the key, one lookup, the program, and an
``autograd.Function`` that keeps just what its backward needs (y is its only output; the backward
is bound to the forward's program, :func:`cupynorm._program.call_bound`).

Replayed: CUDA tensors, no tracing (``torch.compile``, tensor subclasses, dispatch modes), no
functorch transform, and, when a gradient is needed, no saved-tensor hooks (a checkpoint or
offloading gets the full path, whose Function saves through them). Anything else -- the first call
of a key, a call torch's checks reject, a layout that needs a copy -- takes the full path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cupynorm import _program

from ._autograd import _BatchNormReplayFunction, _hooks_active, _transforms_active
from ._kernels import _batch_norm_fwd_op_args
from ._reference import _layout

_unwrap = torch._C._functorch.unwrap_if_dead


class _Replayed:
    """A replayed forward: its program and what it was called with."""

    __slots__ = ("program", "bk", "device", "tensors", "pointers", "training", "act")

    def __init__(self, program, bk, key, tensors, pointers, training, act) -> None:
        self.program, self.bk, self.device = program, bk, key[2]
        self.tensors, self.pointers = tensors, pointers
        self.training, self.act = training, act


def batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, residual,
               act, batches_tracked, grad) -> tuple[Tensor | None, tuple | None]:  # fmt: skip
    """``act(batch_norm(x) + residual)`` replayed: (y, None); or (None, the call key to hand
    :func:`validated` once the full path ran it) or (None, None) when the call cannot be
    replayed. The arguments are :func:`cupynorm.torch.functional._batch_norm_act`'s (act
    "identity" and residual None: plain batch norm), on tensors the kernels take (CUDA), in a
    call nothing traces (``functional._traced``); ``grad``: whether the call needs autograd
    (``functional._wants_grad``)."""
    if _program._active.recording is not None or _transforms_active():
        return None, None
    if grad and _hooks_active():
        return None, None
    x = _unwrap(x)
    if residual is not None:
        residual = _unwrap(residual)
    keep = grad and act == "relu" and residual is not None
    # fmt: off
    args = _batch_norm_fwd_op_args(x, weight, bias, running_mean, running_var, training,
                                   momentum, eps, residual, act, batches_tracked, keep)
    # fmt: on
    bk, key, tensors, pointers = _program._call_key("batch_norm_fwd", args, {})
    program = _program._PROGRAMS.get(key)
    if type(program) is not _program._Program or not program.validated:
        return None, key
    device = x.get_device()
    for t in tensors:
        if t.get_device() != device:  # not in the key: the full path raises torch's error
            return None, None
    if not grad:
        return program.run(bk, key[2], tensors, pointers)[0], None
    call = _Replayed(program, bk, key, tensors, pointers, training, act)
    weight = weight if weight is None else _unwrap(weight)
    bias = bias if bias is None else _unwrap(bias)
    return _BatchNormReplayFunction.c_apply(x, weight, bias, residual, call), None


def validated(key: tuple | None, x: Tensor, vectors: tuple) -> None:
    """The full path ran the call of ``key`` (:func:`batch_norm`) to the end: replay its program
    from now on, when the op was called with the arguments as given (x dense, the per-channel
    ``vectors`` contiguous: nothing copied) and recorded it."""
    if key is None:
        return
    program = _program._PROGRAMS.get(key)
    if type(program) is not _program._Program or _layout(x) is None:
        return
    if all(t is None or t.is_contiguous() for t in vectors):
        program.validated = True
