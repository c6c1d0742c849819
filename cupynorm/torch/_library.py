"""The cupynorm custom ops (``torch.ops.cupynorm.*``): schemas, kernels per device, fake kernels
and registered autograd, so ``torch.compile(fullgraph=True)`` keeps them in the graph::

    group_norm_fwd(x, num_groups, weight?, bias?, eps, out_float32=False) -> (y, mean, rstd)
        # out_float32: y in float32 beside a half-precision x (autocast's float32 norm)
    group_norm_bwd(dy, x, mean, rstd, weight?, num_groups, output_mask)
        -> (dx?, dweight?, dbias?)
    group_norm_act_fwd(x, num_groups, weight?, bias?, eps, act, shift?=None, out_float32=False)
        -> (y, mean, rstd)
        # y = act(group_norm(x + shift[n, c]))
    group_norm_act_bwd(dy, x, mean, rstd, weight?, bias?, num_groups, output_mask, act,
                       shift?=None) -> (dx?, dweight?, dbias?)
    instance_norm_fwd(x, weight?, bias?, running_mean, running_var, momentum, eps)
        -> (y, mean, rstd, new_running_mean, new_running_var)   # group norm with G = C
    batch_norm_fwd(x, weight?, bias?, running_mean?, running_var?, training, momentum, eps)
        -> (y, save_mean, save_rstd, new_running_mean?, new_running_var?)
    batch_norm_bwd(dy, x, save_mean, save_rstd, weight?, training, output_mask)
        -> (dx?, dweight?, dbias?)
    batch_norm_act_fwd(x, weight?, bias?, running_mean?, running_var?, training, momentum, eps,
                       residual?, act) -> as batch_norm_fwd         # y = act(norm(x) + residual)
    batch_norm_act_bwd(dy, x, save_mean, save_rstd, weight?, training, output_mask, residual?,
                       bias?, act) -> (dx?, dweight?, dbias?, dresidual?)
    row_norm_add_mul_fwd(x, y, eps) -> (out, mean, rstd)
    row_norm_add_mul_bwd(dout, x, y, mean, rstd) -> (dx, dy)
    row_norm_fwd(x, residual?, weight?, bias?, ndim, eps, rms, cast=False, out_float32=False)
        -> (y, sum?, mean?, rstd)   # LayerNorm / RMSNorm (mean None) over the last ndim dims
                                    # cast: LlamaRMSNorm's rounding of xhat before the weight
    row_norm_bwd(dy, dsum?, x, mean?, rstd, weight?, ndim, output_mask, cast=False)
        -> (dx?, dweight?, dbias?)  # x: the normalized rows (the sum with a residual)
    channel_norm_fwd(x, weight?, bias?, eps, rms, out_float32=False)
        -> (y, mean?, rstd)          # LayerNorm / RMSNorm over dim 1, stats (N, *spatial)
    channel_norm_bwd(dy, x, mean?, rstd, weight?, output_mask) -> (dx?, dweight?, dbias?)

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

from ._autograd import (
    _channel_norm_setup,
    _make_channel_norm_backward,
)
from ._kernels import (
    _channel_norm_bwd_cuda,
    _channel_norm_bwd_fake,
    _channel_norm_fwd_cuda,
    _channel_norm_fwd_fake,
)
from ._reference import (
    _channel_norm_bwd_reference,
    _channel_norm_fwd_reference,
)

# ---------------------------------------------------------------------------------------------
# custom op registration
# ---------------------------------------------------------------------------------------------
_lib = torch.library.Library("cupynorm", "FRAGMENT")


def define(schema: str, cuda_kernel, cpu_kernel, fake_kernel) -> torch._ops.OpOverload:
    """Define the op ``torch.ops.cupynorm.<name>`` of ``schema`` with its CUDA and CPU kernels
    (``Library.impl`` on the device keys: no ``custom_op`` wrapper on the call) and its fake
    kernel; returns the op's default overload."""
    name = schema[: schema.index("(")]
    _lib.define(schema)
    _lib.impl(name, cuda_kernel, "CUDA")
    _lib.impl(name, cpu_kernel, "CPU")
    torch.library.register_fake(f"cupynorm::{name}", fake_kernel, lib=_lib)
    return getattr(torch.ops.cupynorm, name).default


def register_autograd(op: torch._ops.OpOverload, backward, setup_context) -> None:
    """A forward op's autograd: ``backward`` (which calls the backward op) and ``setup_context``."""
    torch.library.register_autograd(op.name(), backward, setup_context=setup_context, lib=_lib)


_SCHEMAS = {
    "channel_norm_fwd": (
        "channel_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps, bool rms,"
        " bool out_float32=False) -> (Tensor, Tensor?, Tensor)"
    ),
    "channel_norm_bwd": (
        "channel_norm_bwd(Tensor dy, Tensor x, Tensor? mean, Tensor rstd, Tensor? weight,"
        " bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)"
    ),
}

# name: (CUDA kernel, CPU kernel, fake kernel)
_KERNELS = {
    "channel_norm_fwd": (
        _channel_norm_fwd_cuda,
        _channel_norm_fwd_reference,
        _channel_norm_fwd_fake,
    ),
    "channel_norm_bwd": (
        _channel_norm_bwd_cuda,
        _channel_norm_bwd_reference,
        _channel_norm_bwd_fake,
    ),
}

for _name, _schema in _SCHEMAS.items():
    define(_schema, *_KERNELS[_name])

_torch_ops = torch.ops.cupynorm
channel_norm_fwd_op = _torch_ops.channel_norm_fwd.default
channel_norm_bwd_op = _torch_ops.channel_norm_bwd.default

# each forward op's autograd: (op, backward, setup_context)
for _name, _backward, _setup in (
    ("channel_norm_fwd", _make_channel_norm_backward(channel_norm_bwd_op), _channel_norm_setup),
):
    register_autograd(getattr(_torch_ops, _name).default, _backward, _setup)
