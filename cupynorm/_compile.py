"""Finding, hashing and compiling the CUDA sources (NVRTC through ``cupy.RawModule``).

A module is one ``.cu`` file compiled for one element type (``-DSCALAR_T``) and one weight/bias
type (``-DPARAM_T``): only the variants a call needs are ever compiled. Compiled
modules and their functions are cached per device. CuPy's on-disk cache keys on the main source
text and the options only, so a hash of *every* file in ``cuda_src`` goes into the options: a
changed header recompiles instead of loading a stale binary.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

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
