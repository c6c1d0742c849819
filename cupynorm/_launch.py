"""What every launch of one call shares (:class:`_Call`: backend, device, stream, dtypes, device
limits) and the helpers of all kernel families: element types, scalars, layouts.

A call records its launches when a recording is active (:mod:`._program`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _compile, _interop, _plan
from ._program import (
    _active,
    _RecordingBackend,
)

_SEGMENT = "segment_norm.cu"
_STRIDED = "strided_norm.cu"
_SINGLE = "single_launch_norm.cu"
_FUSED = "fused_norm.cu"
_ROWS = "row_norm.cu"
_SYNC = "sync_norm.cu"

_NULL = np.uint64(0)
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


def _acc(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def _scalar(dtype: str, value: float) -> Any:
    return np.float64(value) if dtype == "float64" else np.float32(value)


class _Call:
    """What every launch of one call shares: backend, device, stream, dtype."""

    __slots__ = (
        "bk",
        "device",
        "stream",
        "dtype",
        "param_dtype",
        "out_dtype",
        "acc",
        "itemsize",
        "vec",
        "info",
        "recording",
    )

    def __init__(self, x: Any, weight: Any = None) -> None:
        bk = _interop.backend_of(x)
        self.recording = _active.recording
        self.bk = bk if self.recording is None else _RecordingBackend(bk, self.recording)
        self.device = bk.device_id(x)
        self.stream = bk.stream(self.device)
        self.dtype = bk.dtype_name(x)
        self.acc = _acc(self.dtype)
        # weight/bias in float32 beside a half-precision input: a module variant of its own
        param = bk.dtype_name(weight) if weight is not None else None
        self.param_dtype = param if param not in (None, self.dtype) else None
        # a row norm's y / dy in float32 beside a half-precision x (autocast): set by the op
        self.out_dtype: str | None = None
        self.itemsize = _ITEMSIZE[self.dtype]
        self.vec = _plan.vec_width(self.itemsize)
        self.info = _plan.device_info(self.device)

    def ptr(self, t: Any) -> np.uint64:
        return _NULL if t is None else np.uint64(self.bk.ptr(t))

    def aligned(self, *arrays: Any, strides: tuple[int, ...] = ()) -> bool:
        """Whether 16-byte accesses are possible: pointers 16-byte aligned, strides whole packs."""
        return all(t is None or self.bk.ptr(t) % 16 == 0 for t in arrays) and all(
            s % self.vec == 0 for s in strides
        )

    def launch(
        self,
        source: str,
        kernel: str,
        grid: int | tuple[int, int],
        block: tuple[int, ...],
        args: tuple,
        smem: int = 0,
    ) -> None:
        """Launch with numpy-scalar arguments (np.uint64 for pointers); recorded when recording."""
        # fmt: off
        launcher = _compile.launcher(self.device, source, kernel, self.dtype, self.param_dtype,
                                     self.out_dtype, _compile.argument_codes(args))
        # fmt: on
        if self.recording is not None:
            self.recording.step(launcher, grid, block, smem, args)
        with _compile.current_device(self.device):
            launcher.launch(grid, block, smem, self.stream, args)

    def zero(self, t: Any, words: int) -> None:
        """Zero the first ``words`` 32-bit words of ``t`` on the stream (a recorded step)."""
        self.launch(_compile.MEMSET, "memset", 1, (1,), (self.ptr(t), np.int64(words)))

    def stats(self, shape: tuple[int, ...], like: Any) -> Any:
        return self.bk.empty(shape, self.acc, like)

    def threads(self, source: str, kernel: str, wanted: int) -> int:
        """``wanted`` threads for a 1-D block-strided kernel, within what its registers allow."""
        # fmt: off
        most = _compile.max_block_threads(self.device, source, kernel, self.dtype,
                                          self.param_dtype, self.out_dtype)
        # fmt: on
        return min(wanted, most // 32 * 32)

    def mutates_inputs(self) -> None:
        """Mark the call as writing to some of its inputs (running statistics)."""
        if self.recording is not None:
            self.recording.mutating = True

    def opaque(self) -> None:
        """Mark the call as doing work outside the backend and launches (not recordable)."""
        if self.recording is not None:
            self.recording.ok = False

    def grads(self, shape: tuple[int, ...], weight: Any, like: Any) -> Any:
        """dweight/dbias: in the weight's dtype (the kernels convert), else the accumulator's."""
        dtype = self.acc if weight is None else self.bk.dtype_name(weight)
        return self.bk.empty(shape, dtype, like)


def _resident_grid(call: _Call, source: str, kernel: str, threads: int, work: int) -> int:
    """A grid of at most the CTAs of ``threads`` threads the GPU holds at once, and at most
    ``work`` (for kernels that walk their work grid-stride)."""
    per_sm = _compile.resident_ctas(
        call.device, source, kernel, call.dtype, call.param_dtype, threads, 0, call.out_dtype
    )
    return max(1, min(work, per_sm * call.info.sm_count))


def _weight_grads(
    call: _Call,
    dweight_part: Any,
    dbias_part: Any,
    dweight: Any,
    dbias: Any,
    groups: int,
    length: int,
    as_param: bool,
) -> None:
    """dweight / dbias (``length`` values each) as the column sums of ``groups`` fp32 partial
    rows, added in row order (row_norm_bwd_params); a None part is skipped."""
    # fmt: off
    call.launch(_ROWS, "row_norm_bwd_params", -(-length // 32), (32, 8), (
        call.ptr(dweight_part), call.ptr(dbias_part), call.ptr(dweight), call.ptr(dbias),
        np.int64(groups), np.int64(length), np.int32(as_param)))
    # fmt: on


def _prepare(x: Any, bk: Any) -> tuple[Any, str]:
    """x in a layout the kernels read in place (contiguous or channels_last), copying otherwise."""
    layout = _plan.classify_layout(tuple(x.shape), tuple(bk.strides(x)))
    if layout == "other":
        x = bk.contiguous(x)
        layout = "contiguous"
    return x, layout
