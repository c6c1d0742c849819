"""Eager norm calls replayed: the host path of a norm layer after its first call.

A training step calls each norm layer with the same shapes, strides, dtypes and arguments step
after step. The full path of such a call -- torch's argument checks, the autograd Function, the
dense layouts, the recorded call's key and replay, the Function's saved tensors and its backward's
layers -- costs ~55 us of Python per BatchNorm + ReLU layer (forward + backward) on the
development CPU, ~3x that on the GPU machines' hosts, where torch's own layer takes ~126 us
(benchmarks/NOTES.md). Everything the checks and the plan decide depends only on the kernel
op's call key (shapes, strides, dtypes, 16-byte alignments, scalar arguments), on the devices
of the tensors and on an *origin*: what of the caller's arguments is not in the key (the
normalized shape of a row norm; under autocast the dtypes the float32 copies were made from).
So a call whose key and origin passed the full path once -- torch's checks, then a recorded
program of the op with the arguments as given (dense, nothing copied) -- is replayed when it
comes again with its tensors on the input's device: the key, one lookup, the program, and an
``autograd.Function`` that keeps just what its backward needs (the backward is bound to the
forward's program, :func:`cupynorm._program.call_bound`).

Families: batch norm (plain and fused), group norm (plain and fused), row norms (LayerNorm,
RMSNorm, their residual forms, Llama's RMSNorm), channel norms (LayerNorm2d / RMSNorm2d: NCHW
input by the channels family; channels_last input replayed as the row norm of its (N, *spatial,
C) view, under the function's name as origin). What is a family's is in its module: its entry
``_replay_<family>`` (the host op's arguments built as its full path builds them, handed to
:func:`run` with the rest), its ``_<family>_replay_save`` and ``_<family>_replay_grads``. This
module imports no family: it is the generic part, :func:`run` and :func:`validated`.

Replayed: CUDA tensors, no tracing (``torch.compile``, tensor subclasses, dispatch modes), no
functorch transform nor forward-AD level (the route sends those to torch before any replay:
``_route._use_kernels``), and, when a gradient is needed, no saved-tensor hooks (a checkpoint or
offloading gets the full path, whose Function saves through them). Anything else -- the first call
of a key, a call torch's checks reject, a layout that needs a copy -- takes the full path.
"""

from __future__ import annotations

from typing import Any

import torch

from cupynorm import _program

from ._autograd import _hooks_active, _ReplayFunction

#: a functorch wrapper of a dead transform level unwrapped (what ``Function.apply`` does)
unwrap = torch._C._functorch.unwrap_if_dead

#: what :func:`validated` takes: (the call key, the origin), or None
Token = tuple | None


class _Replayed:
    """A replayed forward: its program, what it was called with, its family's save and
    constants (``info``)."""

    __slots__ = ("program", "bk", "device", "tensors", "pointers", "save", "info")

    def __init__(self, program, bk, device, tensors, pointers, save, info) -> None:
        self.program, self.bk, self.device = program, bk, device
        self.tensors, self.pointers = tensors, pointers
        self.save, self.info = save, info


def run(name, args, kwargs, origin, grad, save, info, tensors) -> tuple[Any, Token]:
    """The host op call ``name(*args, **kwargs)`` replayed: (its outputs (no ``grad``) or the
    replay Function's, None); or (None, the token to hand :func:`validated`) when its program
    was not validated for ``origin``; or (None, None) when something besides the call decides
    (a recording, saved-tensor hooks when the call needs autograd) or a
    tensor is on another device. What the family gives: ``save`` and ``info``, its save
    function and the call's constants (:class:`._autograd._ReplayFunction`); ``tensors``: the
    Function's inputs (x, a, b, c)."""
    if _program._active.recording is not None:
        return None, None
    if grad and _hooks_active():
        return None, None
    bk, key, arrays, pointers = _program._call_key(name, args, kwargs)
    program = _program._PROGRAMS.get(key)
    if type(program) is not _program._Program or origin not in program.validated:
        return None, (key, origin)
    x = tensors[0]
    device = x.get_device()
    for t in arrays:
        if t.get_device() != device:  # not in the key: the full path raises torch's error
            return None, None
    if not grad:
        return program.run(bk, key[2], arrays, pointers), None
    call = _Replayed(program, bk, key[2], arrays, pointers, save, info)
    return _ReplayFunction.c_apply(*tensors, call), None


def validated(token: Token, as_given: bool, vectors: tuple) -> None:
    """The full path ran the call of ``token`` (a family's ``_replay_<family>``) to the end:
    replay its program for that origin from now on, when the op was called with the arguments
    as given (``as_given``: the input and any other full-size tensor taken without a copy; the
    ``vectors`` contiguous) and recorded it."""
    if token is None or not as_given:
        return
    key, origin = token
    program = _program._PROGRAMS.get(key)
    if type(program) is not _program._Program:
        return
    if all(t is None or t.is_contiguous() for t in vectors):
        program.validated.add(origin)
