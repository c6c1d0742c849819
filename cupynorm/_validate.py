"""Argument checks of the public API: an error that says expected vs got.

Bad values and shapes raise :class:`~cupynorm.errors.InvalidInputError` (a ValueError and a
RuntimeError), bad types and dtypes :class:`~cupynorm.errors.InvalidTypeError` (a TypeError and a
RuntimeError), so CuPy-style and torch-style ``except`` clauses both catch them.

The checks read only shapes, dtypes and devices (no device work, no synchronization) and work on
CuPy arrays and torch tensors alike.
"""

from __future__ import annotations

from typing import Any

from ._interop import DTYPE_NAMES, is_torch_tensor
from .errors import InvalidInputError, InvalidTypeError

_SUPPORTED = "float32, float64, float16 or bfloat16"


def _kind(x: Any) -> str:
    if is_torch_tensor(x):
        return "torch"
    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        return "cupy"
    if module == "numpy":
        return "numpy"
    return "other"


def _dtype_name(x: Any) -> str:
    name = str(x.dtype)
    return name.removeprefix("torch.")


def _device(x: Any) -> tuple[str, int]:
    if is_torch_tensor(x):
        return (x.device.type, x.device.index if x.device.index is not None else -1)
    return ("cuda", x.device.id)


def _describe_device(device: tuple[str, int]) -> str:
    return device[0] if device[1] < 0 else f"{device[0]}:{device[1]}"


def check_array(x: Any, what: str = "input") -> None:
    """x is a CUDA array of a supported floating dtype."""
    kind = _kind(x)
    if kind == "numpy":
        raise InvalidTypeError(
            f"{what} is a numpy.ndarray in host memory; cupynorm runs on the GPU: pass a CuPy "
            "array (cupy.asarray(a)) or a CUDA torch tensor"
        )
    if kind == "other":
        raise InvalidTypeError(
            f"{what} must be a CuPy array, a torch CUDA tensor or an object with __dlpack__, "
            f"got {type(x).__name__}"
        )
    if kind == "torch" and x.device.type != "cuda":
        raise InvalidTypeError(
            f"{what} is a torch tensor on {x.device}; cupynorm's functional API needs CUDA tensors "
            "(the cupynorm.torch modules fall back to torch.nn.functional on the CPU)"
        )
    if _dtype_name(x) not in DTYPE_NAMES:
        raise InvalidTypeError(f"{what} must have dtype {_SUPPORTED}, got {_dtype_name(x)}")


def check_param(
    p: Any,
    x: Any,
    what: str,
    num_channels: int,
    *,
    any_float: bool = False,
    shape: tuple[int, ...] | None = None,
) -> None:
    """A per-channel vector beside input x: same framework and device, shape (C,) (or ``shape``),
    float dtype."""
    if p is None:
        return
    if _kind(p) != _kind(x):
        raise InvalidTypeError(
            f"{what} must be the same kind of array as the input ({type(x).__name__}), "
            f"got {type(p).__name__}"
        )
    if _device(p) != _device(x):
        raise InvalidInputError(
            f"{what} is on {_describe_device(_device(p))} but the input is on "
            f"{_describe_device(_device(x))}"
        )
    if _dtype_name(p) not in DTYPE_NAMES:
        raise InvalidTypeError(f"{what} must have dtype {_SUPPORTED}, got {_dtype_name(p)}")
    if not any_float and _dtype_name(p) != _dtype_name(x) and _dtype_name(p) != "float32":
        raise InvalidTypeError(
            f"{what} must have the input's dtype ({_dtype_name(x)}) or float32, "
            f"got {_dtype_name(p)}"
        )
    if shape is not None:
        if tuple(p.shape) != shape:
            of = "(N, C) of the input" if what == "shift" else "normalized_shape"
            raise InvalidInputError(
                f"expected {what} of shape {shape} ({of}), got shape {tuple(p.shape)}"
            )
    elif tuple(p.shape) != (num_channels,):
        raise InvalidInputError(
            f"expected {what} of shape ({num_channels},) (one value per channel of an input of "
            f"shape {tuple(x.shape)}), got shape {tuple(p.shape)}"
        )


def _check_affine(
    x: Any, weight: Any, bias: Any, num_channels: int, shape: tuple[int, ...] | None = None
) -> None:
    check_param(weight, x, "weight", num_channels, shape=shape)
    check_param(bias, x, "bias", num_channels, shape=shape)
    if weight is not None and bias is not None and _dtype_name(weight) != _dtype_name(bias):
        raise InvalidTypeError(
            f"weight and bias must have the same dtype, got {_dtype_name(weight)} and "
            f"{_dtype_name(bias)}"
        )


def _check_ndim(x: Any, least: int) -> None:
    if x.ndim < least:
        raise InvalidInputError(
            f"expected an input of shape (N, C, *spatial) with at least {least} dimensions, "
            f"got shape {tuple(x.shape)}"
        )


def _check_number(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidTypeError(f"{what} must be a number, got {type(value).__name__}")


def check_group_norm(x: Any, num_groups: Any, weight: Any, bias: Any, eps: Any) -> None:
    check_array(x)
    _check_ndim(x, 2)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise InvalidTypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
    if num_groups <= 0:
        raise InvalidInputError(f"num_groups must be positive, got {num_groups}")
    C = x.shape[1]
    if C % num_groups != 0:
        raise InvalidInputError(
            "expected the number of channels in the input to be divisible by num_groups, got "
            f"input of shape {tuple(x.shape)} and num_groups={num_groups}"
        )
    _check_affine(x, weight, bias, C)
    _check_number(eps, "eps")


def check_shift(x: Any, shift: Any) -> None:
    """The (N, C) values a group norm adds to its input (N, C, *) before normalizing (a diffusion
    block's time embedding): the input's kind of array, device and dtype."""
    if shift is None:
        return
    check_param(shift, x, "shift", 0, any_float=True, shape=tuple(x.shape[:2]))
    if _dtype_name(shift) != _dtype_name(x):
        raise InvalidTypeError(
            f"shift must have the input's dtype ({_dtype_name(x)}), got {_dtype_name(shift)}"
        )


def _spatial_size(x: Any) -> int:
    size = 1
    for d in x.shape[2:]:
        size *= d
    return size


def check_instance_norm(
    x: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any,
    bias: Any,
    use_input_stats: bool,
    momentum: Any,
    eps: Any,
) -> None:
    check_array(x)
    _check_ndim(x, 2)
    C = x.shape[1]
    _check_affine(x, weight, bias, C)
    check_running(x, running_mean, running_var, C)
    if not use_input_stats and (running_mean is None or running_var is None):
        raise InvalidInputError("use_input_stats=False needs running_mean and running_var")
    if use_input_stats and _spatial_size(x) == 1:
        raise InvalidInputError(
            "expected more than 1 spatial element when training, got input of shape "
            f"{tuple(x.shape)}"
        )
    _check_number(momentum, "momentum")
    _check_number(eps, "eps")


def check_running(x: Any, running_mean: Any, running_var: Any, num_channels: int) -> None:
    for name, stat in (("running_mean", running_mean), ("running_var", running_var)):
        if stat is not None and _kind(stat) not in ("torch", "cupy"):
            raise InvalidTypeError(
                f"{name} must be a CuPy array or a torch tensor (it is updated in place), "
                f"got {type(stat).__name__}"
            )
        check_param(stat, x, name, num_channels, any_float=True)


def check_batch_norm(
    x: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any,
    bias: Any,
    training: bool,
    momentum: Any,
    eps: Any,
) -> None:
    check_array(x)
    _check_ndim(x, 2)
    C = x.shape[1]
    _check_affine(x, weight, bias, C)
    check_running(x, running_mean, running_var, C)
    if (running_mean is None) != (running_var is None):
        raise InvalidInputError(
            "running_mean and running_var must be given together or both be None"
        )
    if not training and running_mean is None:
        raise InvalidInputError("running_mean and running_var are required when training=False")
    if training and x.shape[0] * _spatial_size(x) == 1:
        raise InvalidInputError(
            f"expected more than 1 value per channel when training, got input of shape "
            f"{tuple(x.shape)}"
        )
    _check_number(momentum, "momentum")
    _check_number(eps, "eps")


def check_row_norm_add_mul(x: Any, y: Any, eps: Any) -> None:
    check_array(x, "x")
    check_array(y, "y")
    if _kind(x) != _kind(y):
        raise InvalidTypeError(
            f"x and y must be the same kind of array, got {type(x).__name__} and {type(y).__name__}"
        )
    if _device(x) != _device(y):
        raise InvalidInputError(
            f"x is on {_describe_device(_device(x))} but y is on {_describe_device(_device(y))}"
        )
    if x.ndim < 1:
        raise InvalidInputError("x must have at least one dimension (the features of a row)")
    if tuple(x.shape) != tuple(y.shape):
        raise InvalidInputError(
            f"x and y must have the same shape, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if _dtype_name(x) != _dtype_name(y):
        raise InvalidTypeError(
            f"x and y must have the same dtype, got {_dtype_name(x)} and {_dtype_name(y)}"
        )
    _check_number(eps, "eps")


def normalized_shape_tuple(normalized_shape: Any) -> tuple[int, ...]:
    """``normalized_shape`` as torch takes it (an int or a sequence of ints) as a tuple."""
    if isinstance(normalized_shape, bool):
        raise InvalidTypeError("normalized_shape must be an int or a sequence of ints, got bool")
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    try:
        dims = tuple(normalized_shape)
    except TypeError:
        raise InvalidTypeError(
            "normalized_shape must be an int or a sequence of ints, "
            f"got {type(normalized_shape).__name__}"
        ) from None
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise InvalidTypeError(f"normalized_shape must hold ints, got {dims}")
    return dims


def check_row_norm(
    x: Any,
    residual: Any,
    normalized_shape: tuple[int, ...],
    weight: Any,
    bias: Any,
    eps: Any,
) -> None:
    """LayerNorm / RMSNorm over the trailing ``normalized_shape`` of x (and of a residual)."""
    check_array(x)
    if residual is not None:
        check_array(residual, "residual")
        if _kind(residual) != _kind(x):
            raise InvalidTypeError(
                "residual must be the same kind of array as the input "
                f"({type(x).__name__}), got {type(residual).__name__}"
            )
        if _device(residual) != _device(x):
            raise InvalidInputError(
                f"residual is on {_describe_device(_device(residual))} but the input is on "
                f"{_describe_device(_device(x))}"
            )
        if tuple(residual.shape) != tuple(x.shape) or _dtype_name(residual) != _dtype_name(x):
            raise InvalidInputError(
                "residual must have the input's shape and dtype, got "
                f"{tuple(residual.shape)} {_dtype_name(residual)} beside "
                f"{tuple(x.shape)} {_dtype_name(x)}"
            )
    k = len(normalized_shape)
    if k == 0 or any(d <= 0 for d in normalized_shape):
        raise InvalidInputError(
            f"normalized_shape must be a non-empty shape of positive sizes, got {normalized_shape}"
        )
    if x.ndim < k or tuple(x.shape[x.ndim - k :]) != tuple(normalized_shape):
        raise InvalidInputError(
            f"expected an input whose last dimensions are normalized_shape={normalized_shape}, "
            f"got shape {tuple(x.shape)}"
        )
    shape = tuple(normalized_shape)
    _check_affine(x, weight, bias, _prod(shape), shape)
    if eps is not None:
        _check_number(eps, "eps")


def _prod(dims: tuple[int, ...]) -> int:
    size = 1
    for d in dims:
        size *= d
    return size


def check_channel_norm(x: Any, weight: Any, bias: Any, eps: Any) -> None:
    """LayerNorm / RMSNorm over dim 1 (the C channels) of x (N, C, *spatial)."""
    check_array(x)
    if x.ndim < 2:
        raise InvalidInputError(f"expected an input of shape (N, C, *), got shape {tuple(x.shape)}")
    C = x.shape[1]
    if C <= 0:
        raise InvalidInputError(f"expected at least one channel, got shape {tuple(x.shape)}")
    _check_affine(x, weight, bias, C)
    if eps is not None:
        _check_number(eps, "eps")
