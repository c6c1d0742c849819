r"""The functional API of :mod:`cupynorm.torch` and the route of each call.

(Past 600 lines: one public function per op with its full docstring, and the routing each
shares; splitting it would separate a function from the route it takes.)

Layers, bottom to top (each calls only the one below it): kernels per device
(:mod:`._kernels`, :mod:`._reference`), custom ops (:mod:`._library`), autograd
(:mod:`._autograd`), and here the functional API, which the modules (:mod:`.modules`) call.

**Eager fast path.** A call through the dispatcher into a Python kernel with Python autograd is
expensive. Measured on the CPU of the dev machine (torch 2.13, a trivial kernel taking 3.7 us
when called directly): ``torch.library`` op with autograd 26 us per call, the same op with no
input requiring grad 9.7 us, a plain :class:`torch.autograd.Function` 8.3 us (one that defines
``setup_context`` 21 us: ``apply`` binds the signature with :mod:`inspect` on every call). So
eager calls on plain CUDA tensors go through ``_*Function`` (an old-style ``autograd.Function``
sharing the op's kernels, setup and backward code), or straight to the kernel when no gradient
is needed; the custom op is used whenever something traces: ``torch.compile``/export, tensor
subclasses (FakeTensor, ...), an active ``TorchDispatchMode``. With a 3 us stub kernel, a whole
module call then costs 9 us (InstanceNorm2d, nothing needs grad), 17 us (GroupNorm, affine,
parameters need grad) and 21 us (BatchNorm2d training). To re-measure on a GPU::

    import torch, torch.utils.benchmark as B
    import cupynorm.torch as cnt
    from cupynorm.torch import _autograd, _kernels
    x = torch.randn(8, 64, 32, 32, device="cuda", requires_grad=True)
    m, ref = cnt.InstanceNorm2d(64).cuda(), torch.nn.InstanceNorm2d(64).cuda()
    op = torch.ops.cupynorm.group_norm_fwd.default
    for stmt in ("ref(x)", "m(x)",                                               # modules
                 "op(x, 64, None, None, 1e-5)",                                  # dispatcher
                 "_autograd._GroupNormFunction.run(x, 64, None, None, 1e-5)",  # fast path
                 "_kernels._group_norm_fwd(x, 64, None, None, 1e-5)"):           # kernel only
        t = B.Timer(stmt, globals=globals()).blocked_autorange(min_run_time=1)
        print(f"{stmt:64s} {t.median * 1e6:7.1f} us")

**Functional API** (:func:`group_norm`, :func:`group_norm_act`, :func:`instance_norm`,
:func:`batch_norm`, :func:`batch_norm_act`,
:func:`row_norm_add_mul`, :func:`layer_norm`, :func:`rms_norm`, :func:`add_layer_norm`,
:func:`add_rms_norm`, over the channels of ``(N, C, *)`` :func:`layer_norm2d`,
:func:`rms_norm2d`; :func:`llama_rms_norm`, Hugging Face's LlamaRMSNorm formula):
``torch.nn.functional`` semantics and argument names; CUDA tensors run
on cupynorm's kernels after :mod:`._checks` (bad arguments raise torch's own error for them), any
other device through :mod:`torch.nn.functional`, so a converted model still runs on the CPU.

Not supported: double backward (the backward is a kernel without a derivative) and functorch
transforms (``torch.func.grad``/``vmap``: ops registered through ``torch.library`` with
``register_autograd`` refuse them, and so does the eager Function).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks, _replay
from ._autograd import (
    _ChannelNormFunction,
)
from ._batch_norm import batch_norm, batch_norm_act
from ._compile_policy import inductor_takes
from ._group_norm import group_norm, group_norm_act
from ._instance_norm import instance_norm
from ._kernels import (
    _channel_norm_output,
)
from ._library import (
    channel_norm_fwd_op,
)
from ._llama_rms_norm import llama_rms_norm
from ._reference import _layout
from ._route import (
    _AUTOCAST_RMS_NORM,
    _HALF,
    _default_rms_eps,
    _kernel_tensors,
    _replay_candidate,
    _traced,
    _use_kernels,
    _wants_grad,
)
from ._row_norm import _replay_row_norm, add_layer_norm, add_rms_norm, layer_norm, rms_norm
from ._row_norm_add_mul import row_norm_add_mul

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "batch_norm",
    "batch_norm_act",
    "group_norm",
    "group_norm_act",
    "instance_norm",
    "layer_norm",
    "layer_norm2d",
    "llama_rms_norm",
    "rms_norm",
    "rms_norm2d",
    "row_norm_add_mul",
]


def _apply_channel_norm(x, weight, bias, eps, rms, out_float32=False) -> Tensor:
    if _traced(x):
        return channel_norm_fwd_op(x, weight, bias, eps, rms, out_float32)[0]
    if _wants_grad(x, weight, bias):
        return _ChannelNormFunction.run(x, weight, bias, eps, rms, out_float32)[0]
    return _channel_norm_output(x, weight, bias, eps, rms, out_float32)


# ---------------------------------------------------------------------------------------------
# functional API
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# LayerNorm and RMSNorm over the last dims, alone or after a residual add
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# LayerNorm and RMSNorm over the channels (dim 1) of (N, C, *), per sample and pixel
# ---------------------------------------------------------------------------------------------
def _over_channels(fn, input: Tensor, *args) -> Tensor:
    """``fn`` (F.layer_norm / F.rms_norm) over the last dim of the channels-last view, as timm's
    and torchvision's LayerNorm2d compute it, returned in the input's memory format."""
    rows = input.movedim(1, -1)
    y = fn(rows, (input.shape[1],), *args).movedim(-1, 1)
    fmt = _layout(input) or torch.contiguous_format
    return y.contiguous(memory_format=fmt)


def _channel_norm_route(name, torch_fn, input, weight, bias, eps, rms, to_float32) -> Tensor:
    """The route of a channel norm call on cupynorm's kernels (``eps`` None: RMSNorm's default).
    On channels_last (or one-pixel) input the kernels normalize the contiguous (N, *spatial, C)
    view's rows: such a call is replayed as that row norm's (:mod:`._replay`; the origin is the
    function's name: its checks are not layer_norm's over the same rows) once the full path --
    the checks, then the channel norm Function -- ran it; on NCHW input, as the channels
    family's call. Under autocast (``to_float32``) as layer_norm: a half-precision input whose
    rows the kernels read is read as is, y in float32; NCHW input takes float32 copies, made
    by torch's cast kernels (by Inductor's when traced), as torch's autocast does: measured
    faster than the conversions inside the host op (benchmarks/NOTES.md)."""
    rows = input.permute(0, *range(2, input.dim()), 1) if input.dim() >= 2 else input
    out_float32 = to_float32 and input.dtype in _HALF and rows.is_contiguous()
    token = None
    if input.dim() >= 2 and _replay_candidate((input, weight, bias)):
        key_eps = _default_rms_eps(input) if eps is None else eps
        if rows.is_contiguous():
            tensors = (rows, None, weight, bias)
            tensors, origin = _kernel_tensors(tensors, name, to_float32, int(out_float32))
            x, _r, w, b = tensors
            # fmt: off
            y, token = _replay_row_norm(x, None, w, b, (x.shape[-1],), key_eps, rms, False,
                                        origin, _wants_grad(x, w, b), out_float32)
            # fmt: on
            if y is not None:
                return y.permute(0, y.dim() - 1, *range(1, y.dim() - 1))
        elif input.is_contiguous():  # NCHW: the channels family
            tensors = (input, None, weight, bias)
            tensors, origin = _kernel_tensors(tensors, name, to_float32)
            x, _r, w, b = tensors
            grad = _wants_grad(x, w, b)
            y, token = _replay.channel_norm(x, w, b, key_eps, rms, origin, grad)
            if y is not None:
                return y
    _checks.check_channel_norm(name, torch_fn, input, weight, bias, eps, to_float32)
    if eps is None:
        eps = _default_rms_eps(input)
    tensors = _kernel_tensors((input, None, weight, bias), None, to_float32, int(out_float32))[0]
    input, _r, weight, bias = tensors
    y = _apply_channel_norm(input, weight, bias, eps, rms, out_float32)
    _replay.validated(token, True, (weight, bias))
    return y


def layer_norm2d(
    input: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Layer normalization over the channels of :math:`(N, C, *)`, per sample and position:
    what timm's and torchvision's ``LayerNorm2d`` (ConvNeXt) compute.

    Each of the ``C`` values at one sample and spatial position is normalized over the channels:

    .. math::
        y_{n,c,s} = \frac{x_{n,c,s} - \mathrm{E}_c[x_{n,:,s}]}
            {\sqrt{\mathrm{Var}_c[x_{n,:,s}] + \epsilon}} * \gamma_c + \beta_c

    with the biased variance, accumulated in float32 (float64 for float64 input). That is
    :func:`torch.nn.functional.layer_norm` over ``(C,)`` of ``input.movedim(1, -1)``, moved back.
    Under CUDA autocast the computation runs in float32, as torch's ``layer_norm`` does.

    Args:
        input: tensor of shape :math:`(N, C, *)`; CUDA tensors (float16, bfloat16, float32,
            float64; contiguous or channels_last, other strides are copied) run on cupynorm's
            kernels, tensors on other devices through :func:`torch.nn.functional.layer_norm`.
        weight: per-channel scale :math:`\gamma` of shape :math:`(C,)` (the input's dtype or
            float32), or None.
        bias: per-channel shift :math:`\beta` of shape :math:`(C,)`, or None.
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)`, same memory format as the input (contiguous or
          channels_last)

    Example::

        >>> x = torch.randn(8, 96, 56, 56, device="cuda", requires_grad=True)
        >>> y = cupynorm.torch.layer_norm2d(x, torch.ones(96, device="cuda"))
        >>> y.sum().backward()
    """
    _checks.check_tensor("layer_norm2d", "input", input)
    if not _use_kernels(input) or inductor_takes("channel_norm"):
        return _over_channels(F.layer_norm, input, weight, bias, eps)
    # fmt: off
    return _channel_norm_route("layer_norm2d", F.layer_norm, input, weight, bias, eps, False,
                               torch.is_autocast_enabled())  # as torch's autocast
    # fmt: on


def rms_norm2d(
    input: Tensor,
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    r"""Root-mean-square normalization over the channels of :math:`(N, C, *)`, per sample and
    position (timm's ``RmsNorm2d``; KernelBench level 1 problem 36 without a weight):

    .. math::
        y_{n,c,s} = \frac{x_{n,c,s}}{\sqrt{\mathrm{E}_c[x_{n,:,s}^2] + \epsilon}} * \gamma_c

    accumulated in float32 (float64 for float64 input): :func:`torch.nn.functional.rms_norm`
    over ``(C,)`` of ``input.movedim(1, -1)``, moved back. Under CUDA autocast the computation
    runs in float32, as :func:`rms_norm`'s.

    Args:
        input: tensor of shape :math:`(N, C, *)` (CUDA tensors as :func:`layer_norm2d`).
        weight: per-channel scale :math:`\gamma` of shape :math:`(C,)`, or None.
        eps: added to the mean square. Default: None, as torch: the machine epsilon of the type
            the norm computes in (float32; float64 for float64 input).

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)`, same memory format as the input

    Example::

        >>> x = torch.randn(16, 64, 256, 256, device="cuda")
        >>> y = cupynorm.torch.rms_norm2d(x, eps=1e-5)
    """
    _checks.check_tensor("rms_norm2d", "input", input)
    autocast = torch.is_autocast_enabled()
    if (
        not _use_kernels(input)
        or (autocast and not _AUTOCAST_RMS_NORM)
        or inductor_takes("channel_norm")
    ):
        return _over_channels(F.rms_norm, input, weight, eps)
    # fmt: off
    return _channel_norm_route("rms_norm2d", F.rms_norm, input, weight, None, eps, True,
                               autocast)  # as torch's autocast
    # fmt: on


# ---------------------------------------------------------------------------------------------
# Hugging Face's RMSNorm layers of Llama's formula (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm...)
# ---------------------------------------------------------------------------------------------
