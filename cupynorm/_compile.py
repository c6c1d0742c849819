"""Finding, hashing and compiling the CUDA sources (NVRTC through ``cupy.RawModule``).

A module is one ``.cu`` file compiled for one element type (``-DSCALAR_T``), one weight/bias
type (``-DPARAM_T``) and one output type of the row norms (``-DOUT_T``: float32 beside a
half-precision input under autocast): only the variants a call needs are ever compiled. Compiled
modules and their functions are cached per device. CuPy's on-disk cache keys on the main source
text and the options only, so a hash of *every* file in ``cuda_src`` goes into the options: a
changed header recompiles instead of loading a stale binary.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import struct
import threading
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
SOURCE_FILES: tuple[str, ...] = (
    "segment_norm.cu",
    "strided_norm.cu",
    "single_launch_norm.cu",
    "fused_norm.cu",
    "channel_norm.cu",
    "row_norm.cu",
    "sync_norm.cu",
)
#: the source whose kernels are launched cooperatively (every CTA resident: grid barriers inside)
COOPERATIVE_SOURCE = "single_launch_norm.cu"
#: the pseudo-source of a launch that zeroes memory on the stream (cudaMemsetAsync)
MEMSET = "memset"


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


def compile_options(
    dtype: str, param_dtype: str | None = None, out_dtype: str | None = None
) -> tuple[str, ...]:
    """NVRTC options for one module variant (CuPy adds ``-arch`` itself).

    ``param_dtype`` is the weight/bias element type and ``out_dtype`` a row norm's output (and
    output gradient) type, each when it differs from the input's.
    """
    return (
        "--std=c++17",
        f"-I{source_dir()}",
        f"-DSCALAR_T={CTYPES[dtype]}",
        f"-DPARAM_T={CTYPES[param_dtype or dtype]}",
        f"-DOUT_T={CTYPES[out_dtype or dtype]}",
        f"-DCUPYNORM_SOURCE_HASH=0x{source_hash()}",
    )


def read_source(name: str) -> str:
    return (source_dir() / name).read_text()


@functools.cache
def _module(
    device_id: int, name: str, dtype: str, param_dtype: str | None, out_dtype: str | None
) -> Any:
    import cupy

    options = compile_options(dtype, param_dtype, out_dtype)
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=read_source(name), options=options, backend="nvrtc")


# attribute numbers of CUDA's driver API (CUfunction_attribute in cuda.h)
_MAX_THREADS_PER_BLOCK = 0
_SHARED_SIZE_BYTES = 1
_LOCAL_SIZE_BYTES = 3
_NUM_REGS = 4
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CUDA_ERROR_INVALID_CONTEXT = 201
#: cuLaunchCooperativeKernel: the grid cannot be resident at once
CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720


@functools.cache
def get_kernel(
    device_id: int,
    name: str,
    kernel: str,
    dtype: str,
    param_dtype: str | None = None,
    out_dtype: str | None = None,
) -> Any:
    """The compiled function ``kernel`` of source ``name`` on one device, cached per variant.

    Returned as CuPy's low-level ``Function`` (its call takes an explicit ``stream``). Its dynamic
    shared memory limit is raised to all the block may opt into, once, here.
    """
    import cupy
    from cupy.cuda import driver

    with cupy.cuda.Device(device_id):
        module = _module(device_id, name, dtype, param_dtype, out_dtype)
        function = module.get_function(kernel).kernel
        optin = cupy.cuda.runtime.getDeviceProperties(device_id)["sharedMemPerBlockOptin"]
        static = driver.funcGetAttribute(_SHARED_SIZE_BYTES, function.ptr)
        driver.funcSetAttribute(function.ptr, _MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - static)
    return function


# ---- launching ---------------------------------------------------------------------------------
# Kernel arguments are packed with struct into one buffer and handed to cuLaunchKernel as an array
# of pointers into it: a fraction of the host time of CuPy's generic per-argument launch path for
# these 10-17 arguments. The driver copies the arguments during the call, so each thread reuses one
# buffer per kernel signature.
#: struct codes of the argument types: pointers and int64 are 8 bytes, int32 and float32 4
_CODES = {np.uint64: "Q", np.int64: "q", np.int32: "i", np.float32: "f", np.float64: "d"}


def argument_codes(args: tuple) -> str:
    """The struct codes of an argument list of numpy scalars (np.uint64 for pointers)."""
    return "".join([_CODES[type(a)] for a in args])


class Launcher:
    """One compiled kernel and the packer of its argument list (struct ``codes``), ready to
    launch; ``launch`` takes plain Python ints and floats (or numpy scalars) in that order.
    """

    __slots__ = (
        "function",
        "name",
        "device_id",
        "ptr",
        "cooperative",
        "_packer",
        "_pack",
        "_offsets",
        "_local",
        "_launch",
        "_error",
    )

    def __init__(
        self,
        function: Any,
        device_id: int,
        codes: str,
        cooperative: bool = False,
        name: str = "",
    ) -> None:
        self.function = function  # keeps the module (and so the function pointer) alive
        self.name = name  # the kernel's and its element types' (the bench's kernel table)
        self.device_id = device_id
        self.cooperative = cooperative
        self.ptr = function.ptr
        self._packer = struct.Struct("@" + codes)
        self._pack = self._packer.pack_into
        self._offsets = [
            struct.calcsize("@" + codes[: i + 1]) - struct.calcsize("@" + codes[i])
            for i in range(len(codes))
        ]
        self._local = threading.local()
        # resolved once: a launch is on every replay's path (~1 us of Python each, of which
        # packing the arguments is half)
        driver = _driver()
        self._launch = _cooperative(driver) if cooperative else driver.launchKernel
        self._error = driver.CUDADriverError

    def _buffers(self) -> tuple[Any, int, Any]:
        """This thread's argument buffer, the address of its array of argument pointers, and
        that array (the driver copies the arguments during the call, so they are reused)."""
        buffer = ctypes.create_string_buffer(max(1, self._packer.size))
        base = ctypes.addressof(buffer)
        pointers = (ctypes.c_void_p * max(1, len(self._offsets)))(
            *[base + offset for offset in self._offsets]
        )
        self._local.buffers = (buffer, ctypes.addressof(pointers), pointers)
        return self._local.buffers

    def launch(
        self,
        grid: int | tuple[int, int],
        block: tuple[int, ...],
        smem: int,
        stream: int,
        args: tuple | list,
    ) -> None:
        """Launch on the stream with handle ``stream`` in the calling thread's current context;
        ``grid`` is a CTA count or (x, y) CTA counts."""
        try:
            buffer, address, _pointers = self._local.buffers
        except AttributeError:
            buffer, address, _pointers = self._buffers()
        self._pack(buffer, 0, *args)
        gx, gy = grid if type(grid) is tuple else (grid, 1)
        bx, by, bz = block if len(block) == 3 else (*block, 1, 1)[:3]
        try:
            self._launch(self.ptr, gx, gy, 1, bx, by, bz, smem, stream, address, 0)
        except self._error as error:
            # a thread that has not used CUDA yet has no current context: make the device's
            # primary context current (cudaSetDevice) and launch again
            if error.status != _CUDA_ERROR_INVALID_CONTEXT:
                raise
            _runtime().setDevice(self.device_id)
            self._launch(self.ptr, gx, gy, 1, bx, by, bz, smem, stream, address, 0)


def _cooperative(driver: Any) -> Any:
    """cuLaunchCooperativeKernel with cuLaunchKernel's arguments (it takes no ``extra``)."""

    def launch(f, gx, gy, gz, bx, by, bz, smem, stream, args, _extra) -> None:
        driver.launchCooperativeKernel(f, gx, gy, gz, bx, by, bz, smem, stream, args)

    return launch


class Memset:
    """A "launch" that zeroes ``args[1]`` 32-bit words at pointer ``args[0]`` on the stream
    (recorded and replayed like a kernel launch; grid, block and shared memory are ignored)."""

    def launch(
        self, grid: int, block: tuple[int, ...], smem: int, stream: int, args: tuple | list
    ) -> None:
        _runtime().memsetAsync(int(args[0]), 0, 4 * int(args[1]), stream)


@functools.cache
def _driver() -> Any:
    from cupy.cuda import driver

    return driver


@functools.cache
def has_cooperative_launch() -> bool:
    """Whether this CuPy exposes cuLaunchCooperativeKernel (the single-launch family needs it)."""
    try:
        return hasattr(_driver(), "launchCooperativeKernel")
    except ImportError:  # no CUDA
        return False


@functools.cache
def _runtime() -> Any:
    from cupy.cuda import runtime

    return runtime


@functools.cache
def launcher(
    device_id: int,
    name: str,
    kernel: str,
    dtype: str,
    param_dtype: str | None,
    out_dtype: str | None,
    codes: str,
) -> Launcher:
    """The Launcher of one kernel variant for arguments of type ``codes``, cached (``name``
    MEMSET: the memory-zeroing launch)."""
    if name == MEMSET:
        return Memset()
    function = get_kernel(device_id, name, kernel, dtype, param_dtype, out_dtype)
    types = "/".join([dtype, *(t for t in (param_dtype, out_dtype) if t and t != dtype)])
    cooperative = name == COOPERATIVE_SOURCE
    return Launcher(function, device_id, codes, cooperative, f"{kernel}<{types}>")


@functools.cache
def max_block_threads(
    device_id: int,
    name: str,
    kernel: str,
    dtype: str,
    param_dtype: str | None,
    out_dtype: str | None = None,
) -> int:
    """The most threads a block of this kernel variant may have (its registers decide)."""
    function = get_kernel(device_id, name, kernel, dtype, param_dtype, out_dtype)
    return _driver().funcGetAttribute(_MAX_THREADS_PER_BLOCK, function.ptr)


@functools.cache
def resident_ctas(
    device_id: int,
    name: str,
    kernel: str,
    dtype: str,
    param_dtype: str | None,
    threads: int,
    smem: int,
    out_dtype: str | None = None,
) -> int:
    """How many CTAs of ``threads`` threads and ``smem`` bytes of dynamic shared memory of one
    kernel variant an SM holds at once (registers, shared memory and thread limits)."""
    function = get_kernel(device_id, name, kernel, dtype, param_dtype, out_dtype)
    return max(1, _driver().occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, threads, smem))


class recorded_launches:
    """Context manager: every kernel launch made inside, in order, as (launcher, grid, block,
    dynamic shared memory bytes) in the list it returns (the bench's kernel table; a memset is
    left out). The launch is swapped on the class for the duration: nothing on the hot path."""

    def __enter__(self) -> list[tuple[Launcher, Any, tuple, int]]:
        self.launches: list[tuple[Launcher, Any, tuple, int]] = []
        self.original = launch = Launcher.launch
        record = self.launches.append

        def recording(launcher, grid, block, smem, stream, args):
            record((launcher, grid, block, smem))
            launch(launcher, grid, block, smem, stream, args)

        Launcher.launch = recording  # type: ignore[method-assign]
        return self.launches

    def __exit__(self, *exc: object) -> None:
        Launcher.launch = self.original  # type: ignore[method-assign]


def launch_attributes(launcher: Launcher, block: tuple[int, ...], smem: int) -> dict[str, int]:
    """A launch's kernel attributes: registers per thread, local memory per thread (spills),
    static shared memory per CTA, and how many CTAs of ``block`` threads and ``smem`` dynamic
    shared memory bytes an SM holds at once."""
    driver, ptr = _driver(), launcher.ptr
    threads = math.prod(block)
    return {
        "registers": driver.funcGetAttribute(_NUM_REGS, ptr),
        "local_bytes": driver.funcGetAttribute(_LOCAL_SIZE_BYTES, ptr),
        "static_smem_bytes": driver.funcGetAttribute(_SHARED_SIZE_BYTES, ptr),
        "ctas_per_sm": driver.occupancyMaxActiveBlocksPerMultiprocessor(ptr, threads, smem),
    }


def switch_device(device_id: int) -> int | None:
    """Make ``device_id`` the calling thread's current device (the driver launches in the
    current context: tensors on cuda:1 while cuda:0 is current); return the device to restore
    after, or None when it was current already (the usual case: one cudaGetDevice)."""
    runtime = _runtime()
    previous = runtime.getDevice()
    if previous == device_id:
        return None
    runtime.setDevice(device_id)
    return previous


def restore_device(previous: int) -> None:
    _runtime().setDevice(previous)


class current_device:
    """Context manager: ``device_id`` is the calling thread's current device inside (see
    :func:`switch_device`)."""

    __slots__ = ("device_id", "previous")

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id

    def __enter__(self) -> None:
        self.previous = switch_device(self.device_id)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            restore_device(self.previous)
