"""Array frameworks at the boundary: CuPy arrays and torch tensors, zero-copy.

Kernels only ever see raw device pointers, so a torch tensor is never converted: the host code asks
the tensor's own framework for its pointer, strides, outputs (allocated by that framework, so
torch's caching allocator and CUDA-graph capture keep working) and current stream. Any other object
with ``__dlpack__`` goes through ``cupy.from_dlpack`` and comes back through its namespace's
``from_dlpack``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")


def torch_module() -> Any:
    """The torch module if it was imported by anyone, else None (never imports torch itself)."""
    return sys.modules.get("torch")


def is_torch_tensor(x: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


class TorchBackend:
    """Host operations on torch CUDA tensors."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.array_type = torch.Tensor
        self.to_name = {
            torch.float32: "float32",
            torch.float64: "float64",
            torch.float16: "float16",
            torch.bfloat16: "bfloat16",
        }
        self.from_name = {v: k for k, v in self.to_name.items()}
        self.from_name["uint8"] = torch.uint8  # allocated only (a ReLU mask), never an input
        # torch's private accessor returns the handle without building a Stream object (7.7 us
        # vs well under 1 us per call on the H200 machine's CPU); the public path is the fallback
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_stream = raw or (lambda d: torch.cuda.current_stream(d).cuda_stream)

    def dtype_name(self, x: Any) -> str | None:
        return self.to_name.get(x.dtype)

    @staticmethod
    def signature(x: Any) -> tuple:
        """What the kernels' plan depends on: shape, strides, dtype, 16-byte alignment."""
        return (x.shape, x.stride(), x.dtype, x.data_ptr() % 16)

    @staticmethod
    def layout(x: Any) -> tuple:
        """A tensor's signature but its alignment, and its device."""
        return (x.dtype, x.shape, x.stride(), x.device)

    def call_key(self, key: list, args: tuple) -> tuple[list, list[int]]:
        """Append what a call's plan depends on to ``key`` (every argument, a tensor as its
        :meth:`signature`); return the tensors and their pointers. Flat, without a tuple per
        tensor (the key is built on every call): a tensor's entries open with its dtype, which
        equals no other argument, so two argument lists never give the same key."""
        tensors, pointers = [], []
        tensor = self.array_type
        for a in args:
            if isinstance(a, tensor):
                tensors.append(a)
                p = a.data_ptr()
                pointers.append(p)
                key += (a.dtype, a.shape, a.stride(), p % 16)
            else:
                key.append(a)
        return tensors, pointers

    @staticmethod
    def ptr(x: Any) -> int:
        return x.data_ptr()

    @staticmethod
    def pointers(xs: list) -> list[int]:
        return [x.data_ptr() for x in xs]

    @staticmethod
    def on_device(xs: list, device_id: int) -> bool:
        """Whether every tensor of ``xs`` is on CUDA device ``device_id`` (no device objects:
        two attribute reads per tensor, in C)."""
        for x in xs:
            if not x.is_cuda or x.get_device() != device_id:
                return False
        return True

    @staticmethod
    def strides(x: Any) -> tuple[int, ...]:
        return x.stride()

    @staticmethod
    def device_id(x: Any) -> int:
        """The CUDA device index (-1 on the CPU)."""
        return x.get_device()

    def stream(self, device_id: int) -> int:
        """Handle of torch's current stream, read per call: autograd runs backward on another
        thread and users switch streams."""
        return self._raw_stream(device_id)

    def empty(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        return self.torch.empty(shape, dtype=self.from_name[dtype], device=like.device)

    def zeros_int32(self, n: int, like: Any) -> Any:
        return self.torch.zeros(n, dtype=self.torch.int32, device=like.device)

    def empty_strided_like(self, x: Any, dtype: str | None = None) -> Any:
        """x's shape and strides, in x's dtype or ``dtype``."""
        dtype = x.dtype if dtype is None else self.from_name[dtype]
        return self.torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=x.device)

    def empty_like(self, x: Any) -> Any:
        """Same shape, dtype and (for dense tensors) strides as x; the cheapest allocation."""
        return self.torch.empty_like(x)

    def allocator(self, method: str, args: tuple, like: Any) -> Callable[..., Any]:
        """A replay's allocation, arguments resolved once: ``empty_like`` takes the tensor, the
        others nothing (the device is the recorded call's; shapes are passed as separate ints,
        which torch parses faster than a tuple)."""
        torch, device = self.torch, like.device
        if method == "empty_like":
            return torch.empty_like
        if method == "empty":
            shape, dtype = args
            dtype = self.from_name[dtype]
            return functools.partial(torch.empty, *shape, dtype=dtype, device=device)
        if method == "zeros_int32":
            return functools.partial(torch.zeros, args[0], dtype=torch.int32, device=device)
        shape, strides, dtype = args  # empty_strided
        return functools.partial(
            torch.empty_strided, shape, strides, dtype=self.from_name[dtype], device=device
        )

    def empty_strided(
        self, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, like: Any
    ) -> Any:
        return self.torch.empty_strided(
            shape, strides, dtype=self.from_name[dtype], device=like.device
        )

    @staticmethod
    def contiguous(x: Any) -> Any:
        return x.contiguous()

    def fill_nan(self, x: Any) -> None:
        x.fill_(float("nan"))

    def fill_zero(self, x: Any) -> None:
        x.zero_()

    @staticmethod
    def increment(x: Any) -> None:
        x.add_(1)

    @staticmethod
    def copy_into(dst: Any, src: Any) -> None:
        dst.copy_(src)

    def update_running(self, running: Any, batch_stat: Any, momentum: float) -> None:
        running.mul_(1.0 - momentum).add_(batch_stat.to(running.dtype), alpha=momentum)

    def rsqrt_plus(self, var: Any, eps: float, dtype: str) -> Any:
        return self.torch.rsqrt(var.to(self.from_name[dtype]) + eps)

    def astype(self, x: Any, dtype: str) -> Any:
        return x.to(self.from_name[dtype])

    def mean0(self, x: Any) -> Any:
        return x.mean(0)


class CupyBackend:
    """Host operations on CuPy arrays."""

    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.array_type = cupy.ndarray
        # numpy's dtype.name is a Python property (~2 us): looked up by dtype once
        self._names: dict[Any, str | None] = {}

    def dtype_name(self, x: Any) -> str | None:
        dtype = x.dtype
        try:
            return self._names[dtype]
        except KeyError:
            name = self._names[dtype] = dtype.name if dtype.name in DTYPE_NAMES else None
            return name

    @staticmethod
    def signature(x: Any) -> tuple:
        """What the kernels' plan depends on: shape, strides, dtype, 16-byte alignment."""
        return (x.shape, x.strides, x.dtype.char, x.data.ptr % 16)

    @staticmethod
    def layout(x: Any) -> tuple:
        """An array's signature but its alignment, and its device."""
        return (x.dtype.char, x.shape, x.strides, x.device.id)

    def call_key(self, key: list, args: tuple) -> tuple[list, list[int]]:
        """Append every argument to ``key``, an array as its :meth:`signature`; return the
        arrays and their pointers (see :meth:`TorchBackend.call_key`)."""
        arrays = []
        array, signature = self.array_type, self.signature
        for a in args:
            if isinstance(a, array):
                arrays.append(a)
                key.append(signature(a))
            else:
                key.append(a)
        return arrays, self.pointers(arrays)

    @staticmethod
    def ptr(x: Any) -> int:
        return x.data.ptr

    @staticmethod
    def pointers(xs: list) -> list[int]:
        return [x.data.ptr for x in xs]

    @staticmethod
    def on_device(xs: list, device_id: int) -> bool:
        """Whether every array of ``xs`` is on device ``device_id`` (its memory's device id: an
        attribute, where ``x.device`` builds a Device object)."""
        for x in xs:
            if x.data.device_id != device_id:
                return False
        return True

    @staticmethod
    def strides(x: Any) -> tuple[int, ...]:
        item = x.itemsize
        return tuple(s // item for s in x.strides)

    @staticmethod
    def device_id(x: Any) -> int:
        return x.data.device_id

    def stream(self, device_id: int) -> int:
        return self.cupy.cuda.get_current_stream(device_id).ptr

    def empty(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        with like.device:
            return self.cupy.empty(shape, dtype=dtype)

    def zeros_int32(self, n: int, like: Any) -> Any:
        with like.device:
            return self.cupy.zeros(n, dtype="int32")

    def empty_strided_like(self, x: Any, dtype: str | None = None) -> Any:
        """x's shape and strides, in x's dtype or ``dtype``."""
        return self.empty_strided(x.shape, self.strides(x), dtype or x.dtype.name, x)

    def empty_like(self, x: Any) -> Any:
        """Same shape, dtype and (for dense arrays) strides as x (order 'K'), on x's device."""
        with x.device:
            return self.cupy.empty_like(x)

    def allocator(self, method: str, args: tuple, like: Any) -> Callable[..., Any]:
        """A replay's allocation (see :meth:`TorchBackend.allocator`). A replay makes the
        recorded call's device current before it allocates (``_Program.run``), so these
        allocate on the current device, without a device context each."""
        cupy = self.cupy
        if method == "empty_like":
            if like.flags.c_contiguous:
                # the key fixes the source's shape, dtype and strides: a C-ordered array of that
                # shape, without empty_like's look at the source's layout (~2 us less per call)
                return functools.partial(_new_array, cupy.ndarray, like.shape, like.dtype)
            return cupy.empty_like
        if method == "empty_strided":
            shape, strides, dtype = args
            return lambda: self.empty_strided(shape, strides, dtype, cupy.cuda.Device())
        make = cupy.empty if method == "empty" else cupy.zeros
        shape, dtype = args if method == "empty" else (args, "int32")
        return functools.partial(make, shape, dtype=dtype)

    def empty_strided(
        self, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, like: Any
    ) -> Any:
        """An array laid out like one of these strides (the order of its axes in memory);
        ``like``: an array on the device, or the device itself."""
        # allocate in the order of decreasing strides, then view back into the given axis order
        order = sorted(range(len(shape)), key=lambda d: (-strides[d], d))
        with getattr(like, "device", like):
            base = self.cupy.empty(tuple(shape[d] for d in order), dtype=dtype)
        inverse = [order.index(d) for d in range(len(shape))]
        return base.transpose(inverse)

    def contiguous(self, x: Any) -> Any:
        with x.device:
            return self.cupy.ascontiguousarray(x)

    def fill_nan(self, x: Any) -> None:
        x.fill(float("nan"))

    def fill_zero(self, x: Any) -> None:
        x.fill(0)

    @staticmethod
    def increment(x: Any) -> None:
        with x.device:
            x += 1

    @staticmethod
    def copy_into(dst: Any, src: Any) -> None:
        with dst.device:
            dst[...] = src

    def update_running(self, running: Any, batch_stat: Any, momentum: float) -> None:
        with running.device:
            running *= 1.0 - momentum
            running += momentum * batch_stat.astype(running.dtype)

    def rsqrt_plus(self, var: Any, eps: float, dtype: str) -> Any:
        with var.device:
            return 1.0 / self.cupy.sqrt(var.astype(dtype) + eps)

    def astype(self, x: Any, dtype: str) -> Any:
        with x.device:
            return x.astype(dtype)

    def mean0(self, x: Any) -> Any:
        with x.device:
            return x.mean(0)


def _new_array(ndarray: type, shape: tuple[int, ...], dtype: Any, _source: Any) -> Any:
    """A replay's ``empty_like(_source)`` for a C-contiguous source (its shape and dtype fixed by
    the call's key): the array built directly, on the current device."""
    return ndarray(shape, dtype)


_backends: dict[str, Any] = {}
_backend_of_type: dict[type, Any] = {}  # whether x is a torch tensor depends on its type alone


def backend_of(x: Any) -> Any:
    """The backend for a torch tensor or a CuPy array (constructed once per process)."""
    backend = _backend_of_type.get(type(x))
    if backend is None:
        kind = "torch" if is_torch_tensor(x) else "cupy"
        backend = _backends.get(kind)
        if backend is None:
            backend = _backends[kind] = TorchBackend() if kind == "torch" else CupyBackend()
        _backend_of_type[type(x)] = backend
    return backend
