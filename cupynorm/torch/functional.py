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

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks, _replay
from ._autograd import (
    _ChannelNormFunction,
    _RowNormAddMulFunction,
    _RowNormFunction,
)
from ._batch_norm import batch_norm, batch_norm_act
from ._compile_policy import inductor_takes
from ._group_norm import group_norm, group_norm_act
from ._instance_norm import instance_norm
from ._kernels import (
    _channel_norm_output,
    _row_norm_add_mul_fwd,
    _row_norm_output,
)
from ._library import (
    channel_norm_fwd_op,
    row_norm_add_mul_fwd_op,
    row_norm_fwd_op,
)
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


def _apply_row_norm_add_mul(x, y, eps) -> Tensor:
    if _traced(x):
        return row_norm_add_mul_fwd_op(x, y, eps)[0]
    if _wants_grad(x, y, None):
        return _RowNormAddMulFunction.run(x, y, eps)[0]
    return _row_norm_add_mul_fwd(x, y, eps)[0]


def _apply_row_norm(
    x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False
) -> tuple[Tensor, Tensor | None]:
    args = (x, residual, weight, bias, ndim, eps, rms, cast)
    if _traced(x):
        return row_norm_fwd_op(*args, out_float32)[:2]
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, residual, weight, bias)
    ):
        return _RowNormFunction.run(*args, out_float32)[:2]
    return _row_norm_output(*args, out_float32)


def _apply_channel_norm(x, weight, bias, eps, rms, out_float32=False) -> Tensor:
    if _traced(x):
        return channel_norm_fwd_op(x, weight, bias, eps, rms, out_float32)[0]
    if _wants_grad(x, weight, bias):
        return _ChannelNormFunction.run(x, weight, bias, eps, rms, out_float32)[0]
    return _channel_norm_output(x, weight, bias, eps, rms, out_float32)


# ---------------------------------------------------------------------------------------------
# functional API
# ---------------------------------------------------------------------------------------------


def row_norm_add_mul(x: Tensor, y: Tensor, eps: float = 1e-5) -> Tensor:
    r"""Normalize each row of ``x`` over its last dimension, add ``y``, multiply by ``y``.

    .. math::
        \hat{x} = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}}, \qquad
        \text{out} = (\hat{x} + y) \cdot y

    with mean and biased variance over the last dimension, no affine parameters; one fused
    kernel on CUDA (the norm + add + mul tail of seed 002), plain torch ops elsewhere.

    Args:
        x: tensor of shape :math:`(*, D)`.
        y: tensor of the same shape, dtype and device as ``x``.
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - x, y: :math:`(*, D)`
        - Output: :math:`(*, D)`, contiguous

    Example::

        >>> x = torch.randn(1024, 8192, device="cuda")
        >>> y = torch.randn(1024, 8192, device="cuda")
        >>> out = cupynorm.torch.row_norm_add_mul(x, y)
    """
    _checks.check_tensor("row_norm_add_mul", "x", x)
    _checks.check_row_norm_add_mul(x, y, eps)
    if not _use_kernels(x):
        xhat = F.layer_norm(x, (x.shape[-1],), eps=eps)
        return (xhat + y) * y
    _checks.check_kernel_inputs("row_norm_add_mul", x, y)
    return _apply_row_norm_add_mul(x, y, eps)


# ---------------------------------------------------------------------------------------------
# LayerNorm and RMSNorm over the last dims, alone or after a residual add
# ---------------------------------------------------------------------------------------------
def _dims(normalized_shape: Any) -> tuple | None:
    """``normalized_shape`` as a tuple when it is an int or a sequence (else the checks say
    what torch says of it)."""
    if type(normalized_shape) is int:
        return (normalized_shape,)
    if type(normalized_shape) in (tuple, list, torch.Size):
        return tuple(normalized_shape)
    return None


def _row_norm_route(fn, torch_fn, input, residual, normalized_shape, weight, bias, eps, rms,
                    cast=False, to_float32=False) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The route of a row norm call on cupynorm's kernels: a replay of the same call checked
    before (:mod:`._replay`), else the checks of ``fn`` against ``torch_fn`` (None: the caller
    checked; ``normalized_shape`` is then a tuple), then the kernels, whose call may be replayed
    from then on. ``eps`` None: RMSNorm's default; ``to_float32``: layer_norm under autocast, in
    float32 (a half-precision input read as is by the kernels, y in float32; float32 copies of
    the other tensors). Returns (y, the sum or None)."""
    tensors = (input, residual, weight, bias)
    dims = _dims(normalized_shape)
    # under autocast a half-precision input is read as is and y comes out in float32: as its
    # float32 copy would give, with none made (traced calls too: Inductor would run the copies
    # as kernels of their own before the op and after its backward)
    out_float32 = to_float32 and residual is None and input.dtype in _HALF
    replay = dims is not None and _replay_candidate(tensors)
    token = None
    if replay:
        tensors, origin = _kernel_tensors(tensors, dims, to_float32, int(out_float32))
        x, r, w, b = tensors
        key_eps = _default_rms_eps(x) if eps is None and rms else eps
        # fmt: off
        out, token = _replay.row_norm(x, r, w, b, dims, key_eps, rms, cast, origin,
                                      _wants_grad(x, w, b, r), out_float32)
        # fmt: on
        if out is not None:
            return (out, None) if r is None else out
    if fn is not None:
        # fmt: off
        dims = _checks.check_row_norm(fn, torch_fn, input, residual, normalized_shape, weight,
                                      bias, eps, to_float32)
        # fmt: on
    if not replay:
        tensors = _kernel_tensors(tensors, None, to_float32, int(out_float32))[0]
    x, r, w, b = tensors
    if eps is None and rms:
        eps = _default_rms_eps(x)
    out = _apply_row_norm(x, r, w, b, len(dims), eps, rms, cast, out_float32)
    _replay.validated(token, x.is_contiguous() and (r is None or r.is_contiguous()), (w, b))
    return out


def layer_norm(
    input: Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Layer normalization (:func:`torch.nn.functional.layer_norm`) on cupynorm's kernels.

    Each row of the trailing ``normalized_shape`` dimensions (``D`` values) is normalized:

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    with the biased variance, accumulated in float32 (float64 for float64 input), and
    :math:`\gamma` (``weight``), :math:`\beta` (``bias``) of shape ``normalized_shape``. Under
    CUDA autocast the computation runs in float32, as torch's ``layer_norm`` does.

    Args:
        input: tensor of shape :math:`(*, \text{normalized\_shape})`; CUDA tensors (float16,
            bfloat16, float32, float64) run on cupynorm's kernels (non-contiguous input is copied
            first), tensors on other devices through :func:`torch.nn.functional.layer_norm`.
        normalized_shape: the trailing dimensions normalized over (an int or a sequence).
        weight: scale :math:`\gamma` of shape ``normalized_shape`` (the input's dtype or
            float32), or None.
        bias: shift :math:`\beta` of shape ``normalized_shape``, or None.
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - Input: :math:`(*, \text{normalized\_shape})`
        - Output: same shape, contiguous

    Example::

        >>> x = torch.randn(8, 128, 768, device="cuda", requires_grad=True)
        >>> y = cupynorm.torch.layer_norm(x, (768,))
        >>> y.sum().backward()
    """
    _checks.check_tensor("layer_norm", "input", input)
    if not _use_kernels(input) or inductor_takes("layer_norm"):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    # fmt: off
    return _row_norm_route("layer_norm", F.layer_norm, input, None, normalized_shape, weight,
                           bias, eps, False,
                           to_float32=torch.is_autocast_enabled())[0]  # as torch's autocast
    # fmt: on


def rms_norm(
    input: Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    r"""Root-mean-square normalization (:func:`torch.nn.functional.rms_norm`) on cupynorm's
    kernels.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} * \gamma

    over the trailing ``normalized_shape`` dimensions, accumulated in float32 (float64 for float64
    input). Under CUDA autocast the computation runs in float32, as torch's ``rms_norm`` does
    (with a torch whose autocast passes rms_norm through, the call is torch's own).

    Args:
        input: tensor of shape :math:`(*, \text{normalized\_shape})`.
        normalized_shape: the trailing dimensions normalized over (an int or a sequence).
        weight: scale :math:`\gamma` of shape ``normalized_shape``, or None.
        eps: added to the mean square. Default: None, as torch: the machine epsilon of the type
            the norm computes in (float32; float64 for float64 input).

    Shape:
        - Input: :math:`(*, \text{normalized\_shape})`
        - Output: same shape, contiguous

    Example::

        >>> x = torch.randn(4, 2048, 4096, device="cuda", dtype=torch.bfloat16)
        >>> y = cupynorm.torch.rms_norm(x, 4096, torch.ones(4096, device="cuda"))
    """
    _checks.check_tensor("rms_norm", "input", input)
    autocast = torch.is_autocast_enabled()
    if (
        not _use_kernels(input)
        or (autocast and not _AUTOCAST_RMS_NORM)
        or inductor_takes("rms_norm")
    ):
        return F.rms_norm(input, normalized_shape, weight, eps)
    # fmt: off
    return _row_norm_route("rms_norm", F.rms_norm, input, None, normalized_shape, weight, None,
                           eps, True, to_float32=autocast)[0]
    # fmt: on


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    r"""``s = x + residual``, then :func:`layer_norm` of ``s``, in one kernel on CUDA.

    The pre-norm step of a transformer block, as flash-attn's and Liger's fused add + norm: the
    sum is rounded to the input's dtype (it is the residual stream the next block adds to) and
    normalized as :func:`layer_norm` does. Gradients reach ``x`` and ``residual`` alike (the
    gradient of ``s`` through the norm, plus that of the returned ``s``).

    Args:
        x, residual: tensors of the same shape :math:`(*, \text{normalized\_shape})` and dtype.
        normalized_shape, weight, bias, eps: as :func:`layer_norm`.

    Returns:
        ``(out, s)``: the normalized sum and the sum, both of x's shape, contiguous.

    Example::

        >>> out, h = cupynorm.torch.add_layer_norm(attn_out, h, 768, ln.weight, ln.bias)
    """
    _checks.check_tensor("add_layer_norm", "x", x)
    _checks.check_tensor("add_layer_norm", "residual", residual)
    if not _use_kernels(x) or torch.is_autocast_enabled() or inductor_takes("layer_norm"):
        total = x + residual
        return layer_norm(total, normalized_shape, weight, bias, eps), total
    # fmt: off
    return _row_norm_route("add_layer_norm", F.layer_norm, x, residual, normalized_shape, weight,
                           bias, eps, False)
    # fmt: on


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: Tensor | None = None,
    eps: float | None = None,
) -> tuple[Tensor, Tensor]:
    r"""``s = x + residual`` (in the input's dtype), then :func:`rms_norm` of ``s``, in one
    kernel on CUDA; gradients reach ``x`` and ``residual`` alike.

    Args:
        x, residual: tensors of the same shape :math:`(*, \text{normalized\_shape})` and dtype.
        normalized_shape, weight, eps: as :func:`rms_norm`.

    Returns:
        ``(out, s)``: the normalized sum and the sum, both of x's shape, contiguous.

    Example::

        >>> out, h = cupynorm.torch.add_rms_norm(mlp_out, h, 4096, norm.weight)
    """
    _checks.check_tensor("add_rms_norm", "x", x)
    _checks.check_tensor("add_rms_norm", "residual", residual)
    if not _use_kernels(x) or torch.is_autocast_enabled() or inductor_takes("rms_norm"):
        total = x + residual
        return rms_norm(total, normalized_shape, weight, eps), total
    # fmt: off
    return _row_norm_route("add_rms_norm", F.rms_norm, x, residual, normalized_shape, weight,
                           None, eps, True)
    # fmt: on


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
            y, token = _replay.row_norm(x, None, w, b, (x.shape[-1],), key_eps, rms, False,
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
_LLAMA_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _llama_rms_norm_torch(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """LlamaRMSNorm.forward of transformers, op for op (the reference and the fallback)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return h.to(input_dtype) if weight is None else weight * h.to(input_dtype)


def llama_rms_norm(hidden_states: Tensor, weight: Tensor | None, eps: float = 1e-6) -> Tensor:
    r"""RMSNorm as Hugging Face's ``LlamaRMSNorm`` computes it, on cupynorm's kernels.

    .. math::
        \hat{x} = \mathrm{round}_{x}\!\left(\frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}}\right),
        \quad y = \gamma * \hat{x}

    over the last dimension, in float32 whatever the input's dtype; :math:`\hat{x}` is rounded
    to the input's dtype *before* the weight multiplies it (two roundings in half precision,
    where :func:`rms_norm` has one), and the output has the dtype ``weight * xhat`` promotes to.
    ``weight`` of another dtype than the input (float32 weights, bfloat16 activations) is
    multiplied by torch after the kernel, as the layer does. The backward is the autograd of
    that formula: dweight sums ``dy * xhat`` with the rounded xhat, the rounding passes the
    gradient unchanged.

    Args:
        hidden_states: tensor of shape :math:`(*, H)`; CUDA tensors of float16, bfloat16 or
            float32 run on cupynorm's kernels. Other tensors (float64, which the layer normalizes
            in float32, or on other devices) and weights that are not a vector of H values run
            the layer's own torch formula.
        weight: scale :math:`\gamma` of shape :math:`(H,)`, or None.
        eps: added to the mean square (the layer's ``variance_epsilon``). Default: 1e-6

    Example::

        >>> y = cupynorm.torch.llama_rms_norm(h, layer.weight, layer.variance_epsilon)
    """
    _checks.check_tensor("llama_rms_norm", "hidden_states", hidden_states)
    x = hidden_states
    if (
        not _use_kernels(x)
        or inductor_takes("rms_norm")
        or x.dtype not in _LLAMA_KERNEL_DTYPES
        or x.dim() == 0
        or not isinstance(eps, (int, float))
        or (
            weight is not None
            and (
                not isinstance(weight, Tensor)
                or tuple(weight.shape) != (x.shape[-1],)
                or weight.dtype not in _LLAMA_KERNEL_DTYPES + (torch.float64,)
                or weight.device != x.device
            )
        )
    ):
        return _llama_rms_norm_torch(x, weight, eps)
    eps, dims = float(eps), (x.shape[-1],)  # checked above
    if weight is not None and weight.dtype != x.dtype:
        return weight * _row_norm_route(None, None, x, None, dims, None, None, eps, True, True)[0]
    return _row_norm_route(None, None, x, None, dims, weight, None, eps, True, True)[0]
