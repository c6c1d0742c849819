"""The routing every norm family's functional shares: which calls run on cupynorm's kernels, which
go through the custom op, which may be replayed, and what the kernels take under autocast.

A functional call on a CUDA tensor (:func:`_use_kernels`) outside ``torch.func`` transforms and
forward-mode AD (those take torch's composite path: :mod:`._higher_order`) runs on the kernels:
through the custom op when something traces (:func:`_traced`), else eagerly through the
family's ``autograd.Function`` when a gradient is needed (:func:`_wants_grad`), else on the
kernel alone.
A call nothing traces on plain tensors may be a replay (:func:`_replay_candidate`,
:mod:`._replay`). The host code validates nothing: :mod:`._checks` does, on the kernel route.

CPU tests patch :func:`_use_kernels` (and :func:`_traced`) to run the whole stack on the
reference kernels: in every module that looks the name up (this one and each family's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._higher_order import composite_only
from ._policy import CAPTURE_MIN_BYTES, EAGER_ADAPTIVE, EAGER_MIN_BYTES, gpu_behind

_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


def _use_kernels(x: Tensor, kind: str) -> bool:
    """Whether the functional API runs cupynorm's kernels on ``x`` (else torch.nn.functional):
    CUDA tensors, but for an eager call of ``kind`` smaller than its size in the eager policy
    (:func:`cupynorm.torch.set_eager_min_bytes`) outside a CUDA graph capture, nor one at or
    above it while the GPU keeps up with the host (:func:`._policy.gpu_behind`), and none while
    a ``torch.func`` transform or a forward-AD level is active
    (:func:`._higher_order.composite_only`: the kernels' Functions have no batching rule nor
    forward derivative). Traced calls are the compile policy's
    (:func:`._policy.inductor_takes`); their size is never read (a guard).

    CPU tests patch this to run the whole stack on the reference kernels.
    """
    if not x.is_cuda or composite_only():
        return False
    least = EAGER_MIN_BYTES[kind]
    if not least and not CAPTURE_MIN_BYTES[kind]:  # the kernels at any size, however called
        return True
    if _traced(x):
        return True
    if _capturing():  # the host is paid once: GPU time decides
        least = CAPTURE_MIN_BYTES[kind]
        return not least or x.numel() * x.element_size() >= least
    if not least:
        return True
    if x.numel() * x.element_size() < least:
        return False
    return not EAGER_ADAPTIVE[0] or gpu_behind(x.get_device())


def _traced(x: Tensor) -> bool:
    """True when the call must go through the dispatcher (the custom op) rather than eager:
    compiling/exporting, a tensor subclass (FakeTensor, ...) or a TorchDispatchMode."""
    return _is_compiling() or type(x) is not Tensor or _dispatch_stack_len() != 0


def _wants_grad(x: Tensor, a: Tensor | None, b: Tensor | None, c: Tensor | None = None) -> bool:
    return torch.is_grad_enabled() and (
        x.requires_grad
        or (a is not None and a.requires_grad)
        or (b is not None and b.requires_grad)
        or (c is not None and c.requires_grad)
    )


def _replay_candidate(tensors: tuple) -> bool:
    """Whether a call on cupynorm's kernels may be a replay: the input a plain tensor nothing
    traces, the other arguments tensors or None (anything else gets the checks' error)."""
    input = tensors[0]
    return (
        type(input) is Tensor
        and not _traced(input)
        and all(t is None or isinstance(t, Tensor) for t in tensors[1:])
    )


# ---------------------------------------------------------------------------------------------
# autocast: the float32 norms of torch's CUDA autocast
# ---------------------------------------------------------------------------------------------
def _kernel_tensors(
    tensors: tuple, origin: Any, to_float32: bool, keep: int = 0
) -> tuple[tuple, Any]:
    """(the tensors the kernels take, the replay's origin): under autocast (``to_float32``)
    float32 copies but of the first ``keep`` tensors, which a kernel reads as they are (the
    input, and a group norm's shift in the input's dtype), and the dtypes they were made from
    joined to ``origin`` (the checks' verdict is on the tensors before the copies, whose key a
    call the checks reject may share: an integer input's copy, a bf16 input's)."""
    if not to_float32:
        return tensors, origin
    origin = (origin, *(None if t is None else t.dtype for t in tensors))
    return (*tensors[:keep], *_float32(*tensors[keep:])), origin


def _float32(*tensors: Tensor | None) -> tuple:
    """The tensors in float32 (None stays None): the CUDA autocast policy of torch's norms,
    which leaves float64 as it is. A float32 tensor is itself, as ``.float()`` would return it,
    without the call (~0.4 us of argument parsing on the dev CPU; a model's float32
    parameters, every call)."""
    keep = (torch.float32, torch.float64)
    return tuple(t if t is None or t.dtype in keep else t.float() for t in tensors)


#: the input dtypes whose float32 LayerNorm under autocast reads the input as is (row_norm.cu)
_HALF = (torch.float16, torch.bfloat16)

#: Whether the installed torch's CUDA autocast runs rms_norm in float32, as it runs layer_norm
#: (torch's autocast has a kernel for a norm only on its float32 list); where it does not, an
#: rms_norm under autocast is torch's own call, whose dtype rules are then torch's.
_AUTOCAST_RMS_NORM = torch._C._dispatch_has_kernel_for_dispatch_key(
    "aten::rms_norm", "AutocastCUDA"
)


def _default_rms_eps(x: Tensor) -> float:
    """``eps=None`` of rms_norm, as torch: the machine epsilon of the type it computes in
    (float32 for half-precision input, not the input's own type; float64 for float64)."""
    return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
