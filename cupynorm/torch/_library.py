"""The library of the cupynorm custom ops (``torch.ops.cupynorm.*``) and the two calls every family
registers its ops with: schema, a kernel per device and a fake kernel (:func:`define`), then the
forward op's autograd (:func:`register_autograd`), so ``torch.compile(fullgraph=True)`` keeps
them in the graph. Each op is defined in its family's module, with its schema in that module's
docstring::

    group_norm_fwd, group_norm_bwd, group_norm_act_fwd, group_norm_act_bwd    _group_norm
    instance_norm_fwd (its backward: group_norm_bwd)                          _instance_norm
    batch_norm_fwd, batch_norm_bwd, batch_norm_act_fwd, batch_norm_act_bwd    _batch_norm
    row_norm_fwd, row_norm_bwd (LayerNorm / RMSNorm, Llama's with cast)       _row_norm
    row_norm_add_mul_fwd, row_norm_add_mul_bwd                                _row_norm_add_mul
    channel_norm_fwd, channel_norm_bwd                                        _channel_norm

Running statistics: ``torch.library`` refuses ``register_autograd`` on an op that mutates an
input ("Cannot register autograd formula for non-functional operator"), so the forward ops with
running statistics are functional: they return the updated statistics (None where nothing is
updated; batch norm's CUDA kernels write them into new tensors, the other kernels update copies)
and the functional layer writes them back with ``copy_``, an ordinary in-place op that
``torch.compile`` functionalizes like torch's own buffer updates. The eager fast path updates them
in place inside the kernel, no copies.
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("cupynorm", "FRAGMENT")


def define(
    schema: str, cuda_kernel, cpu_kernel, fake_kernel, any_layout: bool = False
) -> torch._ops.OpOverload:
    """Define the op ``torch.ops.cupynorm.<name>`` of ``schema`` with its CUDA and CPU kernels
    (``Library.impl`` on the device keys: no ``custom_op`` wrapper on the call) and its fake
    kernel; returns the op's default overload.

    ``any_layout``: the kernels take their tensors in any strides and return what the fake
    kernel says for those strides (the input's memory format, :func:`._tensors._empty_out`), so
    Inductor may hand the op its tensors in the layout it chose for them. Without the tag a
    custom op gets the strides it was traced with: in an NCHW model, whose convolutions Inductor
    runs channels_last, that is a copy of the input to NCHW and of the output back for every
    call."""
    name = schema[: schema.index("(")]
    _lib.define(schema, tags=(torch._C.Tag.flexible_layout,) if any_layout else ())
    _lib.impl(name, cuda_kernel, "CUDA")
    _lib.impl(name, cpu_kernel, "CPU")
    torch.library.register_fake(f"cupynorm::{name}", fake_kernel, lib=_lib)
    return getattr(torch.ops.cupynorm, name).default


def register_autograd(op: torch._ops.OpOverload, backward, setup_context) -> None:
    """A forward op's autograd: ``backward`` (which calls the backward op) and ``setup_context``."""
    torch.library.register_autograd(op.name(), backward, setup_context=setup_context, lib=_lib)
