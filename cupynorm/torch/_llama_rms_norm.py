r"""Hugging Face's RMSNorm layers of Llama's formula (``LlamaRMSNorm``, ``Qwen2RMSNorm``,
``MistralRMSNorm``, ...): :func:`llama_rms_norm`, on the row norm's kernels and op
(:mod:`._row_norm`) with ``cast``, xhat rounded to the input's dtype before the weight; the
layer's own torch formula (:func:`_llama_rms_norm_torch`) for what the kernels do not take.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks
from ._policy import inductor_takes
from ._route import _use_kernels
from ._row_norm import _row_norm_route

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
        not _use_kernels(x, "llama_rms_norm")
        or inductor_takes("rms_norm", x, "llama_rms_norm")
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
