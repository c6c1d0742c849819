"""Argument checks of :mod:`cupynorm.torch` on the kernel route: torch's errors, word for word.

A drop-in must fail like the module it replaces. On CUDA tensors a few Python comparisons decide
whether the arguments can be bad (no device work, no synchronization: this runs on every call).
Only when they can, the exception is taken from torch itself: its functional is called on meta
copies of the tensors (shapes and dtypes only, no data), and whatever it raises is raised with
torch's message -- the installed torch's wording, whichever version -- as
:class:`~cupynorm.errors.InvalidInputError` (torch's ``ValueError``/``RuntimeError``: it is both) or
:class:`~cupynorm.errors.InvalidTypeError` (``TypeError``). Other exception types are raised as
torch raised them. When torch accepts the arguments on meta (or has no meta kernel to tell), the
call goes on, unless cupynorm's kernels cannot take them (a parameter of the wrong length,
another device, an integer dtype): then cupynorm's own message says so.

Tensors on the CPU never come here: the functional API hands them to :mod:`torch.nn.functional`,
which raises its own errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cupynorm.errors import InvalidInputError, InvalidTypeError

from ._reference import ACTIVATIONS

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _to_meta(value: Any) -> Any:
    return value.detach().to("meta") if isinstance(value, Tensor) else value


def raise_like_torch(
    torch_fn: Callable[..., Any], args: tuple, kwargs: dict | None = None, ours: str | None = None
) -> None:
    """Raise what ``torch_fn(*args, **kwargs)`` raises, found on meta copies of the tensors.

    If torch accepts the arguments, raise :class:`InvalidInputError` with ``ours`` when given
    (cupynorm's kernels cannot take them), else return (torch's checks were the only ones).
    """
    meta_args = tuple(_to_meta(a) for a in args)
    meta_kwargs = {k: _to_meta(v) for k, v in (kwargs or {}).items()}
    try:
        torch_fn(*meta_args, **meta_kwargs)
    except NotImplementedError:
        pass  # no meta kernel for what torch would run: torch cannot tell here, cupynorm says
    except (ValueError, RuntimeError) as error:
        raise InvalidInputError(str(error)) from None
    except TypeError as error:
        raise InvalidTypeError(str(error)) from None
    if ours is not None:
        raise InvalidInputError(ours)


def check_tensor(fn: str, name: str, value: Any) -> None:
    if not isinstance(value, Tensor):
        raise InvalidTypeError(
            f"{fn}: expected {name} to be a torch.Tensor, got {type(value).__name__}"
        )


def _vectors_problem(
    fn: str,
    c: int,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    running_needed: str | None = None,
) -> str | None:
    """What is wrong with the per-channel vectors for cupynorm's kernels, or None.
    ``running_needed``: when the running statistics must be given (the words of the message)."""
    vectors = (("weight", weight), ("bias", bias), ("running_mean", running_mean))
    for name, t in (*vectors, ("running_var", running_var)):
        if t is not None and (t.dim() != 1 or t.shape[0] != c):
            return (
                f"{fn}: expected {name} of shape ({c},) (the number of channels of the input), "
                f"got {name} of shape {tuple(t.shape)}"
            )
    if (running_mean is None) != (running_var is None):
        return f"{fn}: expected running_mean and running_var to be both None or both tensors"
    if running_needed is not None and running_mean is None:
        return f"{fn}: expected running_mean and running_var {running_needed}"
    return None


def _check_ndim(fn: str, torch_fn: Callable[..., Any], args: tuple) -> None:
    input = args[0]
    if input.dim() < 2:
        raise_like_torch(
            torch_fn,
            args,
            ours=f"{fn}: expected input of shape (N, C, *), got {input.dim()}D input",
        )


def check_kernel_inputs(fn: str, input: Tensor, *others: Tensor | None) -> None:
    """What cupynorm's kernels need beyond torch's own checks: a float dtype and one device."""
    if input.dtype not in _FLOAT_DTYPES:
        raise InvalidTypeError(
            f"{fn}: expected input of dtype float16, bfloat16, float32 or float64, "
            f"got {input.dtype}"
        )
    device = input.device
    for t in others:
        if t is not None and t.device != device:
            raise InvalidInputError(
                f"{fn}: expected all tensors to be on the same device as the input ({device}), "
                f"but found one on {t.device}"
            )


def check_group_norm(
    input: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None, eps: float
) -> None:
    args = (input, num_groups, weight, bias, eps)
    _check_ndim("group_norm", F.group_norm, args)
    c = input.shape[1]
    if num_groups <= 0 or c % num_groups != 0:
        raise_like_torch(
            F.group_norm,
            args,
            ours=f"group_norm: expected the number of channels ({c}) to be divisible by "
            f"num_groups, got num_groups={num_groups}",
        )
    problem = _vectors_problem("group_norm", c, weight, bias)
    if problem is not None or input.numel() == num_groups:
        raise_like_torch(F.group_norm, args, ours=problem)
    check_kernel_inputs("group_norm", input, weight, bias)


def check_instance_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    use_input_stats: bool,
    momentum: float,
    eps: float,
) -> None:
    args = (input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
    _check_ndim("instance_norm", F.instance_norm, args)
    needed = None if use_input_stats else "when use_input_stats=False"
    problem = _vectors_problem(
        "instance_norm", input.shape[1], weight, bias, running_mean, running_var, needed
    )
    if problem is not None or (use_input_stats and math.prod(input.shape[2:]) == 1):
        raise_like_torch(F.instance_norm, args, ours=problem)
    check_kernel_inputs("instance_norm", input, weight, bias, running_mean, running_var)


def check_batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> None:
    args = (input, running_mean, running_var, weight, bias, training, momentum, eps)
    _check_ndim("batch_norm", F.batch_norm, args)
    c = input.shape[1]
    needed = None if training else "in evaluation mode"
    problem = _vectors_problem("batch_norm", c, weight, bias, running_mean, running_var, needed)
    # eps <= 0: torch's own rule (it changed between versions), nothing the kernels need
    suspect = eps <= 0.0 or (training and c != 0 and input.numel() == c)
    if suspect or problem is not None:
        raise_like_torch(F.batch_norm, args, ours=problem)
    check_kernel_inputs("batch_norm", input, weight, bias, running_mean, running_var)


def check_epilogue(fn: str, input: Tensor, residual: Tensor | None, activation: str) -> None:
    """The residual add and activation of a fused op: a tensor like ``input``, a known name."""
    if activation not in ACTIVATIONS:
        raise InvalidInputError(
            f"{fn}: expected activation to be one of {', '.join(map(repr, ACTIVATIONS))}, "
            f"got {activation!r}"
        )
    _check_operand(fn, "residual", residual, input, input.shape, "of the input's shape")


def check_shift(fn: str, input: Tensor, shift: Tensor | None) -> None:
    """The (N, C) values a group norm adds to ``input[n, c]`` before normalizing: a tensor of
    the input's dtype and device."""
    shape = input.shape[:2]
    _check_operand(fn, "shift", shift, input, shape, f"of shape (N, C) = {tuple(shape)}")


def _check_operand(
    fn: str, name: str, t: Tensor | None, input: Tensor, shape: tuple, expected: str
) -> None:
    """A second tensor operand of a fused op (None: absent): ``shape``, input's dtype and device."""
    if t is None:
        return
    check_tensor(fn, name, t)
    if t.shape != shape:
        raise InvalidInputError(
            f"{fn}: expected {name} {expected} for an input of shape {tuple(input.shape)}, "
            f"got {tuple(t.shape)}"
        )
    if t.dtype != input.dtype or t.device != input.device:
        raise InvalidTypeError(
            f"{fn}: expected {name} of the input's dtype and device ({input.dtype}, "
            f"{input.device}), got {t.dtype}, {t.device}"
        )


def check_row_norm_add_mul(x: Tensor, y: Tensor, eps: float) -> None:
    check_tensor("row_norm_add_mul", "y", y)
    if x.dim() < 1:
        raise InvalidInputError("row_norm_add_mul: expected x of shape (*, D), got a 0-d tensor")
    if x.shape != y.shape:
        raise InvalidInputError(
            "row_norm_add_mul: expected x and y of the same shape, "
            f"got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.dtype != y.dtype:
        raise InvalidTypeError(
            f"row_norm_add_mul: expected x and y of the same dtype, got {x.dtype} and {y.dtype}"
        )


def _cpu_shell(t: Tensor | None) -> Tensor | None:
    """A CPU tensor of t's shape and dtype that holds one element (all strides 0)."""
    return None if t is None else torch.zeros((), dtype=t.dtype).expand(t.shape)


def normalized_dims(normalized_shape: Any) -> tuple[int, ...]:
    """``normalized_shape`` as torch takes it (an int, a list or a torch.Size) as a tuple."""
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(normalized_shape)


def check_row_norm(
    fn: str,
    torch_fn: Callable[..., Any],
    input: Tensor,
    residual: Tensor | None,
    normalized_shape: Any,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    autocast: bool = False,
) -> tuple[int, ...]:
    """Checks of layer_norm / rms_norm (``torch_fn``) and their residual forms; returns the
    normalized shape as a tuple. ``bias`` is None for rms_norm. ``autocast``: the call runs under
    CUDA autocast, which runs the norm on float32 copies (float64 stays): the dtypes are checked
    as those copies', so that what torch's autocast accepts (a float32 weight beside a bfloat16
    bias) is accepted."""
    dims = normalized_dims(normalized_shape)
    affine = (weight,) if torch_fn is F.rms_norm else (weight, bias)
    args = (input, dims, *affine, eps)
    k = len(dims)
    bad_shape = k == 0 or input.dim() < k or tuple(input.shape[input.dim() - k :]) != dims
    bad_params = any(t is not None and tuple(t.shape) != dims for t in (weight, bias))
    if bad_shape or bad_params:
        # asked on CPU stand-ins (zero-stride, no memory), not on meta: the meta functions of
        # these norms word their errors differently from the CUDA/CPU kernels'. A weight problem
        # alone is asked with a single row, so nothing large is computed if torch accepts.
        x = input if bad_shape else input[(0,) * (input.dim() - k)]
        shells = [_cpu_shell(t) for t in (x, *affine)]
        raise_like_torch(
            lambda *_meta: torch_fn(shells[0], dims, *shells[1:], eps),
            args,
            ours=f"{fn}: expected input of shape (*, {', '.join(map(str, dims))}) and weight/bias "
            f"of shape {dims}, got input of shape {tuple(input.shape)}",
        )
    if residual is not None:
        check_tensor(fn, "residual", residual)
        if residual.shape != input.shape or residual.dtype != input.dtype:
            raise InvalidInputError(
                f"{fn}: expected residual of the input's shape and dtype "
                f"({tuple(input.shape)}, {input.dtype}), got {tuple(residual.shape)}, "
                f"{residual.dtype}"
            )
    check_kernel_inputs(fn, input, residual, weight, bias)
    params = [t for t in (weight, bias) if t is not None]
    dtypes = {t.dtype for t in params}
    input_dtype = input.dtype
    if autocast:
        dtypes = {_autocast_dtype(d) for d in dtypes}
        input_dtype = _autocast_dtype(input_dtype)
    if len(dtypes) > 1 or any(d not in (input_dtype, torch.float32) for d in dtypes):
        raise_like_torch(
            torch_fn,
            args,
            ours=f"{fn}: expected weight and bias of one dtype, the input's ({input.dtype}) or "
            f"float32, got {', '.join(str(t.dtype) for t in params)}",
        )
    return dims


def _autocast_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a floating tensor's copy for a norm under CUDA autocast (its float32 list)."""
    return dtype if dtype == torch.float64 else torch.float32


def check_channel_norm(
    fn: str,
    torch_fn: Callable[..., Any],
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float | None,
    autocast: bool = False,
) -> None:
    """Checks of layer_norm2d / rms_norm2d: those of ``torch_fn`` (layer_norm / rms_norm) over
    the last dimension of the channels-last view (N, *spatial, C), which is what timm's and
    torchvision's LayerNorm2d compute."""
    if input.dim() < 2:
        raise InvalidInputError(
            f"{fn}: expected input of shape (N, C, *), got a {input.dim()}-d tensor"
        )
    rows = input.movedim(1, -1)
    check_row_norm(fn, torch_fn, rows, None, (input.shape[1],), weight, bias, eps, autocast)
