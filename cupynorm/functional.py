"""The functional API: ``torch.nn.functional`` semantics on CuPy arrays, torch tensors and DLPack.

``input`` may be a CuPy array, a torch CUDA tensor or any object with ``__dlpack__`` (JAX, ...);
the result has the caller's type on the caller's device, with no copy at the boundary. Torch
tensors that require grad go through the autograd-aware ops of :mod:`cupynorm.torch`.
"""

from __future__ import annotations

from typing import Any

from . import _interop, _ops, _validate
from ._interop import is_torch_tensor
from ._program import _programmed, checked
from ._validate import _dtype_name
from .errors import InvalidInputError

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "batch_norm",
    "group_norm",
    "group_norm_act",
    "instance_norm",
    "layer_norm",
    "layer_norm2d",
    "rms_norm",
    "rms_norm2d",
    "row_norm_add_mul",
]


def _is_foreign(x: Any) -> bool:
    """Neither torch nor CuPy, but exchangeable through DLPack."""
    if x is None or is_torch_tensor(x):
        return False
    return type(x).__module__.split(".")[0] not in ("cupy", "numpy") and hasattr(x, "__dlpack__")


def _to_cupy(x: Any) -> Any:
    import cupy

    return cupy.from_dlpack(x)


def _from_cupy(result: Any, like: Any) -> Any:
    """Hand a CuPy result back in the type of ``like`` (its array namespace's from_dlpack)."""
    namespace = getattr(like, "__array_namespace__", None)
    if namespace is None:
        return result
    return namespace().from_dlpack(result)


def _cupy_contiguous(a: Any) -> Any:
    import cupy

    return cupy.ascontiguousarray(a)


def _wants_grad(*tensors: Any) -> bool:
    import torch

    return torch.is_grad_enabled() and any(
        t is not None and is_torch_tensor(t) and t.requires_grad for t in tensors
    )


# ---- the lean path ---------------------------------------------------------------------------
# A public call on a CuPy array (or a torch tensor that needs no autograd) whose arguments passed
# the checks once is replayed from then on: the whole call -- every launch and allocation of it --
# is one recorded program (a ``_programmed`` call below) keyed by the call's own arguments, so a
# later call with the same key (tensors on the input's device) builds the key, looks it up and
# launches; no checks, no layers. What the checks decide depends on nothing else.
def _replayed(call: Any, *args: Any) -> Any:
    """The outputs of ``call(*args)`` replayed, or None (the full path decides)."""
    x = args[0]
    bk = _interop._backend_of_type.get(type(x))
    if bk is None or type(x) is not bk.array_type:
        return None
    if bk.name == "torch" and bk.torch.is_grad_enabled():
        tensor = bk.array_type
        if any(type(a) is tensor and a.requires_grad for a in args):
            return None
    return call.replay_checked(*args)


@_programmed
def _group_norm_call(input, num_groups, weight, bias, eps, activation, shift):
    if shift is not None:  # the kernels index it as (N, C) contiguous
        shift = shift.contiguous() if is_torch_tensor(shift) else _cupy_contiguous(shift)
    # fmt: off
    return _ops.group_norm_fwd(input, num_groups, weight, bias, eps, shift, want_stats=False,
                               act=activation or "identity")[:1]
    # fmt: on


@_programmed
def _instance_norm_call(input, weight, bias, momentum, eps):  # momentum: checked, so keyed
    return _ops.group_norm_fwd(input, input.shape[1], weight, bias, eps, want_stats=False)[:1]


@_programmed
def _batch_norm_call(input, running_mean, running_var, weight, bias, training, momentum, eps):
    # fmt: off
    return _ops.batch_norm_fwd(input, weight, bias, running_mean, running_var, training, momentum,
                               eps)[:1]
    # fmt: on


@_programmed
def _row_norm_add_mul_call(x, y, eps):
    return _ops.row_norm_add_mul_fwd(x, y, eps)[:1]


@_programmed
def _row_norm_call(x, residual, normalized_shape, weight, bias, eps, rms):
    row_len = 1
    for d in _validate.normalized_shape_tuple(normalized_shape):
        row_len *= d
    if eps is None:
        eps = _machine_eps(x)
    return _ops.row_norm_fwd(x, residual, weight, bias, row_len, eps, rms, want_stats=False)[:2]


@_programmed
def _channel_norm_call(x, weight, bias, eps, rms):
    """(y,); or (y's rows, None) where the kernels normalize x as the rows of its (N, *spatial,
    C) view (channels_last): a replay hands back its allocations, and the caller views them
    (:func:`_channel_output`)."""
    if eps is None:
        eps = _machine_eps(x)
    rows = _ops.takes_rows(x)
    y = _ops.channel_norm_fwd(x, weight, bias, eps, rms, want_stats=False, rows_out=rows)[0]
    return (y, None) if rows else (y,)


def _channel_output(outputs: tuple) -> Any:
    return outputs[0] if len(outputs) == 1 else _ops.to_channels(outputs[0])


def group_norm(
    input: Any, num_groups: int, weight: Any = None, bias: Any = None, eps: float = 1e-5
) -> Any:
    r"""Group normalization over (N, C, \*spatial): statistics per sample and group of channels.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    with mean and biased variance over the C / num_groups channels and all spatial positions of
    each group, and per-channel weight :math:`\gamma` and bias :math:`\beta` (optional).

    Args:
        input: (N, C, \*spatial) array, float32/float64/float16/bfloat16, contiguous or
            channels_last (other strides are copied to contiguous first).
        num_groups: number of groups; must divide C.
        weight, bias: optional (C,) arrays, the input's dtype or float32.
        eps: added to the variance.

    Returns:
        The normalized array: same type, shape, dtype, device and memory format as ``input``.

    Example:
        >>> x = cupy.random.randn(8, 64, 32, 32, dtype=cupy.float32)
        >>> y = cupynorm.group_norm(x, 8)
    """
    args = (input, num_groups, weight, bias, eps, None, None)
    out = _replayed(_group_norm_call, *args)
    if out is not None:
        return out[0]
    if _is_foreign(input):
        w, b = (_to_cupy(t) if _is_foreign(t) else t for t in (weight, bias))
        return _from_cupy(group_norm(_to_cupy(input), num_groups, w, b, eps), input)
    _validate.check_group_norm(input, num_groups, weight, bias, eps)
    if is_torch_tensor(input) and _wants_grad(input, weight, bias):
        from . import torch as cn_torch

        return cn_torch.group_norm(input, num_groups, weight, bias, eps)
    return checked(_group_norm_call, *args)[0]


#: activations of group_norm_act (the fused kernels' names)
_ACTIVATIONS = ("identity", "relu", "silu")


def group_norm_act(
    input: Any,
    num_groups: int,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    activation: str = "silu",
    shift: Any = None,
) -> Any:
    r"""Group normalization and an activation in one pass: ``activation(group_norm(input))``.

    :func:`group_norm`'s arguments, then ``activation``: ``"silu"`` (:math:`t / (1 + e^{-t})`),
    ``"relu"`` or ``"identity"``, applied to the float32 normalized value before the output's
    single rounding. On contiguous input whose groups fit on chip the input is read once and
    the output written once.

    ``shift``: an (N, C) array of the input's dtype added to every value of ``input[n, c]``
    before the norm (a diffusion ResNet block's projected time embedding,
    ``group_norm(x + temb[:, :, None, None])``), in float32 inside the kernels: the sum is
    never stored nor rounded to the input's dtype.

    Returns:
        The result: same type, shape, dtype, device and memory format as ``input``.

    Example:
        >>> x = cupy.random.randn(16, 320, 64, 64, dtype=cupy.float32).astype(cupy.float16)
        >>> y = cupynorm.group_norm_act(x, 32)      # silu(group_norm(x, 32))
    """
    args = (input, num_groups, weight, bias, eps, activation, shift)
    out = _replayed(_group_norm_call, *args)
    if out is not None:
        return out[0]
    if _is_foreign(input):
        w, b, s = (_to_cupy(t) if _is_foreign(t) else t for t in (weight, bias, shift))
        out = group_norm_act(_to_cupy(input), num_groups, w, b, eps, activation, s)
        return _from_cupy(out, input)
    if activation not in _ACTIVATIONS:
        raise InvalidInputError(
            f"activation must be one of {', '.join(map(repr, _ACTIVATIONS))}, got {activation!r}"
        )
    _validate.check_group_norm(input, num_groups, weight, bias, eps)
    _validate.check_shift(input, shift)
    if is_torch_tensor(input) and _wants_grad(input, weight, bias, shift):
        from . import torch as cn_torch

        return cn_torch.group_norm_act(input, num_groups, weight, bias, eps, activation, shift)
    return checked(_group_norm_call, *args)[0]


def instance_norm(
    input: Any,
    running_mean: Any = None,
    running_var: Any = None,
    weight: Any = None,
    bias: Any = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Any:
    r"""Instance normalization: statistics per sample and channel over the spatial dimensions.

    ``use_input_stats=True`` normalizes with each instance's own mean and biased variance and, if
    running stats are given, updates them in place with the batch mean of the instance means and
    unbiased variances: ``r = (1 - momentum) * r + momentum * stat``. ``use_input_stats=False``
    normalizes with the running statistics.

    Args:
        input: (N, C, \*spatial) array with at least one spatial element per instance.
        running_mean, running_var: optional (C,) arrays, CuPy or torch (updated in place).
        weight, bias: optional (C,) arrays.
        use_input_stats: use the instance statistics (True) or the running ones (False).
        momentum: weight of the new statistics in the running update.
        eps: added to the variance.

    Returns:
        The normalized array, same type, shape, dtype and memory format as ``input``.
    """
    plain = running_mean is None and running_var is None and use_input_stats
    if plain:
        out = _replayed(_instance_norm_call, input, weight, bias, momentum, eps)
        if out is not None:
            return out[0]
    if _is_foreign(input):
        w, b = (_to_cupy(t) if _is_foreign(t) else t for t in (weight, bias))
        out = instance_norm(
            _to_cupy(input), running_mean, running_var, w, b, use_input_stats, momentum, eps
        )
        return _from_cupy(out, input)
    _validate.check_instance_norm(
        input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
    )
    if is_torch_tensor(input) and _wants_grad(input, weight, bias):
        from . import torch as cn_torch

        return cn_torch.instance_norm(
            input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps
        )
    if not use_input_stats:
        return _ops.batch_norm_fwd(
            input, weight, bias, running_mean, running_var, False, momentum, eps
        )[0]
    if plain:
        return checked(_instance_norm_call, input, weight, bias, momentum, eps)[0]
    C = input.shape[1]
    y, mean, _, var = _ops.group_norm_fwd(input, C, weight, bias, eps, want_var=True)
    update_instance_running_stats(input, mean, var, running_mean, running_var, momentum)
    return y


def update_instance_running_stats(
    input: Any, mean: Any, var: Any, running_mean: Any, running_var: Any, momentum: float
) -> None:
    """Running update from per-instance (N, C) mean and biased var, as torch's instance_norm."""
    from ._interop import backend_of

    if running_mean is None and running_var is None:
        return
    bk = backend_of(input)
    spatial = 1
    for d in input.shape[2:]:
        spatial *= d
    if running_mean is not None:
        bk.update_running(running_mean, bk.mean0(mean), momentum)
    if running_var is not None:
        bk.update_running(running_var, bk.mean0(var) * (spatial / (spatial - 1)), momentum)


def batch_norm(
    input: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Any:
    r"""Batch normalization: statistics per channel over the batch and spatial dimensions.

    ``training=True`` normalizes with the batch mean and biased variance and updates the running
    stats in place with the unbiased variance, ``r = (1 - momentum) * r + momentum * stat``;
    ``training=False`` normalizes with the running statistics.

    Args:
        input: (N, C, \*spatial) array.
        running_mean, running_var: (C,) arrays or None (None allowed only when training).
        weight, bias: optional (C,) arrays.
        training: batch statistics (True) or running statistics (False).
        momentum: weight of the batch statistics in the running update.
        eps: added to the variance.

    Returns:
        The normalized array, same type, shape, dtype and memory format as ``input``.
    """
    args = (input, running_mean, running_var, weight, bias, training, momentum, eps)
    out = _replayed(_batch_norm_call, *args)
    if out is not None:
        return out[0]
    if _is_foreign(input):
        w, b = (_to_cupy(t) if _is_foreign(t) else t for t in (weight, bias))
        out = batch_norm(_to_cupy(input), running_mean, running_var, w, b, training, momentum, eps)
        return _from_cupy(out, input)
    _validate.check_batch_norm(
        input, running_mean, running_var, weight, bias, training, momentum, eps
    )
    if is_torch_tensor(input) and _wants_grad(input, weight, bias):
        from . import torch as cn_torch

        return cn_torch.batch_norm(
            input, running_mean, running_var, weight, bias, training, momentum, eps
        )
    return checked(_batch_norm_call, *args)[0]


def row_norm_add_mul(x: Any, y: Any, eps: float = 1e-5) -> Any:
    r"""The fused tail of a Linear + InstanceNorm + residual block, in one kernel.

    For each row of the last dimension (D features):

    .. math::
        \hat x = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}}, \qquad
        \text{out} = (\hat x + y) \cdot y

    (biased variance). One read of x and y and one write of the output when a row fits on chip.

    Args:
        x, y: arrays of the same shape (..., D) and dtype.
        eps: added to the variance.

    Returns:
        ``out`` of x's shape, type and dtype.
    """
    out = _replayed(_row_norm_add_mul_call, x, y, eps)
    if out is not None:
        return out[0]
    if _is_foreign(x):
        other = _to_cupy(y) if _is_foreign(y) else y
        return _from_cupy(row_norm_add_mul(_to_cupy(x), other, eps), x)
    _validate.check_row_norm_add_mul(x, y, eps)
    if is_torch_tensor(x) and _wants_grad(x, y):
        from . import torch as cn_torch

        return cn_torch.row_norm_add_mul(x, y, eps)
    return checked(_row_norm_add_mul_call, x, y, eps)[0]


# ---- LayerNorm and RMSNorm over the last dims, with or without a residual add -----------------
def _machine_eps(x: Any) -> float:
    """``eps=None`` of rms_norm: as torch, the machine epsilon of the type the norm computes in
    (float32; float64 for float64 input), not of a half-precision input's own type."""
    import numpy

    return float(numpy.finfo(numpy.float64 if _dtype_name(x) == "float64" else numpy.float32).eps)


def _row_norm(
    x: Any,
    residual: Any,
    normalized_shape: Any,
    weight: Any,
    bias: Any,
    eps: float | None,
    rms: bool,
) -> tuple[Any, Any]:
    """(normalized output, sum or None): the shared path of the four row-norm functions."""
    if type(normalized_shape) is list:  # as a tuple: part of the call's key
        normalized_shape = tuple(normalized_shape)
    args = (x, residual, normalized_shape, weight, bias, eps, rms)
    out = _replayed(_row_norm_call, *args)
    if out is not None:
        return out
    if _is_foreign(x):
        r, w, b = (_to_cupy(t) if _is_foreign(t) else t for t in (residual, weight, bias))
        y, total = _row_norm(_to_cupy(x), r, normalized_shape, w, b, eps, rms)
        return _from_cupy(y, x), (None if total is None else _from_cupy(total, x))
    dims = _validate.normalized_shape_tuple(normalized_shape)
    _validate.check_row_norm(x, residual, dims, weight, bias, eps)
    if is_torch_tensor(x) and _wants_grad(x, residual, weight, bias):
        from . import torch as cn_torch

        if eps is None:
            eps = _machine_eps(x)
        if residual is None:
            fn = cn_torch.rms_norm if rms else cn_torch.layer_norm
            grad_args = (weight,) if rms else (weight, bias)
            return fn(x, dims, *grad_args, eps=eps), None
        if rms:
            return cn_torch.add_rms_norm(x, residual, dims, weight, eps=eps)
        return cn_torch.add_layer_norm(x, residual, dims, weight, bias, eps=eps)
    # keyed by the caller's arguments: the normalized shape and eps as given (None too)
    y, total = checked(_row_norm_call, *args)
    return y, total


def layer_norm(
    input: Any,
    normalized_shape: Any,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
) -> Any:
    r"""Layer normalization over the trailing ``normalized_shape`` dimensions of each row.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    with mean and biased variance over the ``prod(normalized_shape)`` trailing values of each row
    (float32 accumulation; float64 for float64 input) and :math:`\gamma`, :math:`\beta` of shape
    ``normalized_shape`` (element by element).

    Args:
        input: (\*, \*normalized_shape) array, float32/float64/float16/bfloat16 (non-contiguous
            input is copied to contiguous first).
        normalized_shape: an int or a sequence of ints, the trailing dimensions normalized over.
        weight, bias: optional arrays of shape ``normalized_shape``, the input's dtype or float32.
        eps: added to the variance.

    Returns:
        The normalized array, contiguous, of the input's type, shape and dtype.

    Example:
        >>> x = cupy.random.randn(8, 128, 768, dtype=cupy.float32)
        >>> y = cupynorm.layer_norm(x, 768)
    """
    return _row_norm(input, None, normalized_shape, weight, bias, eps, False)[0]


def rms_norm(
    input: Any, normalized_shape: Any, weight: Any = None, eps: float | None = None
) -> Any:
    r"""Root-mean-square normalization over the trailing ``normalized_shape`` dimensions.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot \gamma

    Args:
        input: (\*, \*normalized_shape) array.
        normalized_shape: an int or a sequence of ints, the trailing dimensions normalized over.
        weight: optional array of shape ``normalized_shape``, the input's dtype or float32.
        eps: added to the mean square; None (default) means the machine epsilon of the type the
            norm computes in (float32; float64 for float64 input), as
            :func:`torch.nn.functional.rms_norm`.

    Returns:
        The normalized array, contiguous, of the input's type, shape and dtype.
    """
    return _row_norm(input, None, normalized_shape, weight, None, eps, True)[0]


def add_layer_norm(
    x: Any,
    residual: Any,
    normalized_shape: Any,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
) -> tuple[Any, Any]:
    r"""The pre-norm step of a transformer block in one kernel: ``s = x + residual`` (in the
    input's dtype), then :func:`layer_norm` of ``s``.

    Args:
        x, residual: arrays of the same shape (\*, \*normalized_shape) and dtype.
        normalized_shape, weight, bias, eps: as :func:`layer_norm`.

    Returns:
        ``(layer_norm(s), s)``: the normalized output and the sum (the new residual stream).
    """
    return _row_norm(x, residual, normalized_shape, weight, bias, eps, False)


def add_rms_norm(
    x: Any,
    residual: Any,
    normalized_shape: Any,
    weight: Any = None,
    eps: float | None = None,
) -> tuple[Any, Any]:
    r"""``s = x + residual`` (in the input's dtype), then :func:`rms_norm` of ``s``, in one kernel.

    Args:
        x, residual: arrays of the same shape (\*, \*normalized_shape) and dtype.
        normalized_shape, weight, eps: as :func:`rms_norm`.

    Returns:
        ``(rms_norm(s), s)``: the normalized output and the sum (the new residual stream).
    """
    return _row_norm(x, residual, normalized_shape, weight, None, eps, True)


def _channel_norm(x: Any, weight: Any, bias: Any, eps: float | None, rms: bool) -> Any:
    """The shared path of layer_norm2d and rms_norm2d."""
    out = _replayed(_channel_norm_call, x, weight, bias, eps, rms)
    if out is not None:
        return _channel_output(out)
    if _is_foreign(x):
        w, b = (_to_cupy(t) if _is_foreign(t) else t for t in (weight, bias))
        return _from_cupy(_channel_norm(_to_cupy(x), w, b, eps, rms), x)
    _validate.check_channel_norm(x, weight, bias, eps)
    if is_torch_tensor(x) and _wants_grad(x, weight, bias):
        from . import torch as cn_torch

        if eps is None:
            eps = _machine_eps(x)
        if rms:
            return cn_torch.rms_norm2d(x, weight, eps=eps)
        return cn_torch.layer_norm2d(x, weight, bias, eps=eps)
    return _channel_output(checked(_channel_norm_call, x, weight, bias, eps, rms))


def layer_norm2d(input: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    r"""Layer normalization over the channels (dim 1) of (N, C, \*spatial), per sample and
    position: timm's / torchvision's ``LayerNorm2d`` (ConvNeXt).

    .. math::
        y_{n,c,s} = \frac{x_{n,c,s} - \mathrm{E}_c[x_{n,:,s}]}
            {\sqrt{\mathrm{Var}_c[x_{n,:,s}] + \epsilon}} \cdot \gamma_c + \beta_c

    with the biased variance over the C channels (float32 accumulation; float64 for float64
    input).

    Args:
        input: (N, C, \*spatial) array, float32/float64/float16/bfloat16, contiguous or
            channels_last (other strides are copied to contiguous first).
        weight, bias: optional (C,) arrays, the input's dtype or float32.
        eps: added to the variance.

    Returns:
        The normalized array: same type, shape, dtype, device and memory format as ``input``.

    Example:
        >>> x = cupy.random.randn(8, 96, 56, 56, dtype=cupy.float32)
        >>> y = cupynorm.layer_norm2d(x)
    """
    return _channel_norm(input, weight, bias, eps, False)


def rms_norm2d(input: Any, weight: Any = None, eps: float | None = None) -> Any:
    r"""Root-mean-square normalization over the channels (dim 1) of (N, C, \*spatial):
    ``x / sqrt(mean(x**2, dim=1, keepdim=True) + eps) * weight`` (KernelBench level 1 problem 36
    without a weight; timm's ``RmsNorm2d``).

    Args:
        input: (N, C, \*spatial) array (as :func:`layer_norm2d`).
        weight: optional (C,) array, the input's dtype or float32.
        eps: added to the mean square; None (default): the machine epsilon of the type the norm
            computes in (float32; float64 for float64 input), as torch's ``rms_norm``.

    Returns:
        The normalized array: same type, shape, dtype, device and memory format as ``input``.
    """
    return _channel_norm(input, weight, None, eps, True)
