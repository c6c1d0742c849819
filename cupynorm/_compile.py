"""Finding, hashing and compiling the CUDA sources (NVRTC through ``cupy.RawModule``).

A module is one ``.cu`` file compiled for one element type (``-DSCALAR_T``) and one weight/bias
type (``-DPARAM_T``): only the variants a call needs are ever compiled. Compiled
modules and their functions are cached per device. CuPy's on-disk cache keys on the main source
text and the options only, so a hash of *every* file in ``cuda_src`` goes into the options: a
changed header recompiles instead of loading a stale binary.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import struct
from pathlib import Path
from typing import Any

import numpy as np

#: element type name -> the C type the kernels see (fp16/bf16 are raw 16-bit storage structs)
CTYPES: dict[str, str] = {
    "float32": "float",
    "float64": "double",
    "float16": "half_t",
    "bfloat16": "bf16_t",
}

#: the kernel source files; each compiles for every element type
SOURCE_FILES: tuple[str, ...] = ("segment_norm.cu", "strided_norm.cu")


def source_dir() -> Path:
    """The ``cuda_src`` folder: inside the installed package, else at the source checkout's root."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        f"cupynorm's CUDA sources were not found next to {here} (looked for cuda_src/common.cuh "
        "in the package and in the source checkout)"
    )


@functools.cache
def source_hash() -> str:
    """SHA-256 over the names and bytes of every file in ``cuda_src`` (first 16 hex digits)."""
    digest = hashlib.sha256()
    for path in sorted(source_dir().iterdir()):
        if path.suffix in (".cu", ".cuh"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def compile_options(dtype: str, param_dtype: str | None = None) -> tuple[str, ...]:
    """NVRTC options for one module variant (CuPy adds ``-arch`` itself).

    ``param_dtype`` is the weight/bias element type when it differs from the input's.
    """
    return (
        "--std=c++17",
        f"-I{source_dir()}",
        f"-DSCALAR_T={CTYPES[dtype]}",
        f"-DPARAM_T={CTYPES[param_dtype or dtype]}",
        f"-DCUPYNORM_SOURCE_HASH=0x{source_hash()}",
    )


def read_source(name: str) -> str:
    return (source_dir() / name).read_text()


@functools.cache
def _module(device_id: int, name: str, dtype: str, param_dtype: str | None) -> Any:
    import cupy

    options = compile_options(dtype, param_dtype)
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=read_source(name), options=options, backend="nvrtc")


# attribute numbers of CUDA's driver API (CUfunction_attribute in cuda.h)
_SHARED_SIZE_BYTES = 1
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


@functools.cache
def get_kernel(
    device_id: int,
    name: str,
    kernel: str,
    dtype: str,
    param_dtype: str | None = None,
) -> Any:
    """The compiled function ``kernel`` of source ``name`` on one device, cached per variant.

    Returned as CuPy's low-level ``Function`` (its call takes an explicit ``stream``). Its dynamic
    shared memory limit is raised to all the block may opt into, once, here.
    """
    import cupy
    from cupy.cuda import driver

    with cupy.cuda.Device(device_id):
        module = _module(device_id, name, dtype, param_dtype)
        function = module.get_function(kernel).kernel
        optin = cupy.cuda.runtime.getDeviceProperties(device_id)["sharedMemPerBlockOptin"]
        static = driver.funcGetAttribute(_SHARED_SIZE_BYTES, function.ptr)
        driver.funcSetAttribute(function.ptr, _MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - static)
    return function


# ---- launching ---------------------------------------------------------------------------------
# Kernel arguments are numpy scalars whose type is the C parameter type. They are packed with
# struct into one buffer and handed to cuLaunchKernel as an array of pointers into it: about a
# third of the host time of CuPy's generic per-argument launch path for these 10-17 arguments.
_CODES = {np.uint64: "Q", np.int64: "q", np.int32: "i", np.float32: "f", np.float64: "d"}


@functools.cache
def _argument_layout(codes: str) -> tuple[struct.Struct, np.ndarray]:
    """The packer of an argument list and each argument's offset in the packed buffer."""
    offsets = [
        struct.calcsize("@" + codes[: i + 1]) - struct.calcsize("@" + codes[i])
        for i in range(len(codes))
    ]
    return struct.Struct("@" + codes), np.asarray(offsets, dtype=np.uint64)


def launch(
    function: Any,
    device_id: int,
    grid: int,
    block: tuple[int, ...],
    args: tuple,
    smem: int,
    stream: int,
) -> None:
    """Launch ``function`` (a CuPy ``Function`` of device ``device_id``) on the stream with
    handle ``stream``. The driver launches in the calling thread's current context, so the
    device is made current for the launch when it is another one (tensors on cuda:1 while
    cuda:0 is current)."""
    from cupy.cuda import driver, runtime

    packer, offsets = _argument_layout("".join([_CODES[type(a)] for a in args]))
    buffer = ctypes.create_string_buffer(packer.size)
    packer.pack_into(buffer, 0, *args)
    pointers = offsets + np.uint64(ctypes.addressof(buffer))
    bx, by, bz = (*block, 1, 1)[:3]
    previous = runtime.getDevice()
    if previous != device_id:
        runtime.setDevice(device_id)
    try:
        driver.launchKernel(
            function.ptr, grid, 1, 1, bx, by, bz, smem, stream, pointers.ctypes.data, 0
        )
    finally:
        if previous != device_id:
            runtime.setDevice(previous)
