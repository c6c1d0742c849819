"""Framework-neutral host code: plan and launch the kernels for one normalization call.

Arguments are CuPy arrays or torch CUDA tensors (all of one kind per call), already validated by
the public layer. Outputs are allocated by the caller's framework and kernels run on that
framework's current stream. Statistics are float32 (float64 for float64 inputs). See
docs/internal-api.md for the contract.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _compile, _plan
from ._compile import argument_codes, current_device
from ._interop import backend_of

_SEGMENT = "segment_norm.cu"
_STRIDED = "strided_norm.cu"

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
        "acc",
        "itemsize",
        "vec",
        "info",
        "recording",
    )

    def __init__(self, x: Any, weight: Any = None) -> None:
        bk = backend_of(x)
        self.recording = _active.recording
        self.bk = bk if self.recording is None else _RecordingBackend(bk, self.recording)
        self.device = bk.device_id(x)
        self.stream = bk.stream(self.device)
        self.dtype = bk.dtype_name(x)
        self.acc = _acc(self.dtype)
        # weight/bias in float32 beside a half-precision input: a module variant of its own
        param = bk.dtype_name(weight) if weight is not None else None
        self.param_dtype = param if param not in (None, self.dtype) else None
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
        grid: int,
        block: tuple[int, ...],
        args: tuple,
        smem: int = 0,
    ) -> None:
        """Launch with numpy-scalar arguments (np.uint64 for pointers); recorded when recording."""
        launcher = _compile.launcher(
            self.device, source, kernel, self.dtype, self.param_dtype, argument_codes(args)
        )
        if self.recording is not None:
            self.recording.step(launcher, grid, block, smem, args)
        with current_device(self.device):
            launcher.launch(grid, block, smem, self.stream, args)

    def stats(self, shape: tuple[int, ...], like: Any) -> Any:
        return self.bk.empty(shape, self.acc, like)

    def threads(self, source: str, kernel: str, wanted: int) -> int:
        """``wanted`` threads for a 1-D block-strided kernel, within what its registers allow."""
        most = _compile.max_block_threads(self.device, source, kernel, self.dtype, self.param_dtype)
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


# ---- programs: a call's launches recorded once per signature, replayed after ------------------
# The planning above costs tens of microseconds of Python per call, as much as the kernels of a
# small problem. Everything it decides depends only on the call's signature (shapes, strides,
# dtypes, 16-byte alignment of the pointers, the scalar arguments), so the first call with a
# signature runs it while recording the allocations and launches; later calls allocate the same
# outputs and replay the launches with the new pointers. A call that does anything else (a copy, a
# torch/CuPy operation, an input passed twice) is not recorded and always runs the full path.
class _Active(threading.local):
    recording: _Recording | None = None


_active = _Active()
_PURE_BACKEND = frozenset({"name", "ptr", "strides", "device_id", "stream", "dtype_name"})
_PROGRAMS: dict[tuple, Any] = {}
_PROGRAMS_MAX = 4096  # distinct signatures kept; the cache is cleared when it is full
_UNRECORDABLE = object()
#: Test hook: when set, a recorded call is replayed at once and this is called with both calls'
#: outputs (the GPU tests assert they are identical, so every test exercises the replay). Calls
#: that update running statistics in place are replayed only when called again.
check_replay: Callable[[tuple, tuple], None] | None = None


class _Recording:
    def __init__(self, bk: Any, tensors: list) -> None:
        self.bk = bk
        self.ok = True
        self.mutating = False  # the kernels write to an input: a replay is not idempotent
        self.objects = list(tensors)  # the inputs, then every allocation in order
        self.sources: dict[int, int] = {}  # pointer -> index into objects
        for i, t in enumerate(tensors):
            p = bk.ptr(t)
            if p in self.sources:  # the same memory passed twice: aliasing is not in the key
                self.ok = False
            if p:
                self.sources[p] = i
        self.allocations: list[tuple[str, tuple]] = []
        self.steps: list[tuple] = []

    def allocated(self, obj: Any, method: str, args: tuple) -> Any:
        p = self.bk.ptr(obj)
        if p:
            self.sources[p] = len(self.objects)
        self.objects.append(obj)
        self.allocations.append((method, args))
        return obj

    def step(self, launcher: Any, grid: int, block: tuple, smem: int, args: tuple) -> None:
        template, slots = [], []
        for i, a in enumerate(args):
            value = a.item()
            if type(a) is np.uint64 and value:
                source = self.sources.get(value)
                if source is None:  # a pointer not to an input or an allocation
                    self.ok = False
                slots.append((i, source))
            template.append(value)
        self.steps.append((launcher, grid, tuple(block), smem, tuple(template), tuple(slots)))

    def program(self, outputs: tuple) -> _Program | None:
        indices = []
        for out in outputs:
            if out is None:
                indices.append(None)
                continue
            index = next((i for i, o in enumerate(self.objects) if o is out), None)
            if index is None:
                return None
            indices.append(index)
        if not self.ok:
            return None
        # the backend's allocation methods, bound once
        allocations = tuple((getattr(self.bk, m), args) for m, args in self.allocations)
        return _Program(allocations, tuple(self.steps), tuple(indices), self.mutating)


class _RecordingBackend:
    """The backend, with allocations recorded and anything else marking the call unrecordable."""

    def __init__(self, bk: Any, recording: _Recording) -> None:
        self._bk, self._recording = bk, recording

    def empty(self, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
        out = self._bk.empty(shape, dtype, like)
        return self._recording.allocated(out, "empty", (tuple(shape), dtype))

    def zeros_int32(self, n: int, like: Any) -> Any:
        return self._recording.allocated(self._bk.zeros_int32(n, like), "zeros_int32", (n,))

    def empty_strided_like(self, x: Any) -> Any:
        out = self._bk.empty_strided_like(x)
        args = (tuple(x.shape), tuple(self._bk.strides(x)), self._bk.dtype_name(x))
        return self._recording.allocated(out, "empty_strided", args)

    def contiguous(self, x: Any) -> Any:
        out = self._bk.contiguous(x)
        if self._bk.ptr(out) != self._bk.ptr(x):  # a copy
            self._recording.ok = False
        return out

    def __getattr__(self, name: str) -> Any:
        if name not in _PURE_BACKEND:
            self._recording.ok = False
        return getattr(self._bk, name)


class _Program:
    """A recorded call: allocate, then launch with the new pointers."""

    __slots__ = ("allocations", "steps", "outputs", "mutating")

    def __init__(self, allocations: tuple, steps: tuple, outputs: tuple, mutating: bool) -> None:
        self.allocations, self.steps, self.outputs = allocations, steps, outputs
        self.mutating = mutating

    def run(self, bk: Any, device: int, tensors: list) -> tuple:
        like = tensors[0]
        objects = list(tensors)
        for allocate, args in self.allocations:
            objects.append(allocate(*args, like))
        ptr = bk.ptr
        pointers = [ptr(o) for o in objects]
        stream = bk.stream(device)
        with current_device(device):
            for launcher, grid, block, smem, template, slots in self.steps:
                args = list(template)
                for i, source in slots:
                    args[i] = pointers[source]
                launcher.launch(grid, block, smem, stream, args)
        return tuple(None if i is None else objects[i] for i in self.outputs)


def _programmed(op: Any) -> Any:
    """Run ``op`` through the program cache (see above). Its first argument is a tensor."""
    name = op.__name__

    @functools.wraps(op)
    def run(*args: Any, **kwargs: Any) -> Any:
        bk = backend_of(args[0])
        array_type, signature = bk.array_type, bk.signature
        tensors = []
        key = [name, bk.name, bk.device_id(args[0]), *kwargs.items()]
        for a in args:
            if isinstance(a, array_type):
                tensors.append(a)
                key.append(signature(a))
            else:
                key.append(a)
        key = tuple(key)
        device = key[2]
        program = _PROGRAMS.get(key)
        if program is _UNRECORDABLE or _active.recording is not None:
            return op(*args, **kwargs)
        if program is not None:
            return program.run(bk, device, tensors)
        recording = _Recording(bk, tensors)
        _active.recording = recording
        try:
            outputs = op(*args, **kwargs)
        finally:
            _active.recording = None
        if len(_PROGRAMS) >= _PROGRAMS_MAX:
            _PROGRAMS.clear()
        program = _PROGRAMS[key] = recording.program(outputs) or _UNRECORDABLE
        if check_replay is not None and program is not _UNRECORDABLE and not program.mutating:
            replayed = program.run(bk, device, tensors)
            check_replay(outputs, replayed)
            return replayed
        return outputs

    return run


def _prepare(x: Any, bk: Any) -> tuple[Any, str]:
    """x in a layout the kernels read in place (contiguous or channels_last), copying otherwise."""
    layout = _plan.classify_layout(tuple(x.shape), tuple(bk.strides(x)))
    if layout == "other":
        x = bk.contiguous(x)
        layout = "contiguous"
    return x, layout


# ---- the three passes of the strided path ------------------------------------------------------
class _Partials(NamedTuple):
    """Partial (count, mean, M2) triples of statistic sets, and where each set's shift is: the
    triples' means are relative to the set's first value K, read back by the finalize at
    x[(k // shift_div) * shift_a + (k % shift_div) * shift_b]."""

    triples: Any
    per_set: int
    shift_div: int
    shift_a: int
    shift_b: int


def _stats_rows(
    call: _Call, x: Any, num_sets: int, n_runs: int, run_len: int, run_stride: int, set_stride: int
) -> _Partials:
    """Partial triples of sets of contiguous runs (strided_norm_stats_rows)."""
    aligned = call.aligned(x, strides=(run_stride, set_stride))
    plan = _plan.plan_rows_stats(
        num_sets, n_runs * run_len, run_len, call.itemsize, aligned, call.info
    )
    triples = call.stats((num_sets * plan.ctas_per_set * 3,), x)
    i64 = np.int64
    # fmt: off
    call.launch(_STRIDED, "strided_norm_stats_rows", num_sets * plan.ctas_per_set,
                (plan.threads,), (
        call.ptr(x), call.ptr(triples), i64(n_runs), i64(run_len), i64(run_stride),
        i64(set_stride), i64(plan.chunk), i64(plan.ctas_per_set), np.int32(plan.vectorized)))
    # fmt: on
    return _Partials(triples, plan.ctas_per_set, 1, set_stride, 0)


def _stats_cols(
    call: _Call,
    x: Any,
    samples: int,
    rows: int,
    channels: int,
    sample_stride: int,
    groups: int,
    chans_per_group: int,
) -> _Partials:
    """Partial triples over channel-innermost data (strided_norm_stats_cols)."""
    aligned = call.aligned(x, strides=(sample_stride,))
    acc_size = np.dtype(call.acc).itemsize

    def smem_bytes(threads: int, vec: int, staged: bool) -> int:
        # the block's triples, overlaying (16-byte packs) the two stages of staged rows
        ring = 2 * _plan.COLS_STATS_ROWS * threads * 16 if staged else 0
        return max(threads * vec * 3 * acc_size, ring)

    resident = _compile.resident_ctas(
        call.device, _STRIDED, "strided_norm_stats_cols", call.dtype, call.param_dtype,
        _plan.COLS_THREADS, smem_bytes(_plan.COLS_THREADS, call.vec, True),
    )  # fmt: skip
    plan = _plan.plan_cols(samples, rows, channels, call.itemsize, aligned, call.info, resident)
    vec = _plan.vec_width(call.itemsize) if plan.vectorized else 1
    triples = call.stats((samples * plan.ctas_per_sample * channels * 3,), x)
    smem = smem_bytes(plan.tx * plan.ty, vec, plan.vectorized)
    i64 = np.int64
    # fmt: off
    call.launch(_STRIDED, "strided_norm_stats_cols", samples * plan.ctas_per_sample,
                (plan.tx, plan.ty), (
        call.ptr(x), call.ptr(triples), i64(samples), i64(rows), i64(channels), i64(channels),
        i64(sample_stride), i64(plan.ctas_per_sample), np.int32(groups), i64(chans_per_group),
        np.int32(plan.vectorized)), smem=smem)
    # fmt: on
    if groups > 0:  # set (n, g) starts at sample n, channel g * Cg
        return _Partials(
            triples, plan.ctas_per_sample * chans_per_group, groups, sample_stride, chans_per_group
        )
    return _Partials(triples, samples * plan.ctas_per_sample, 1, 1, 0)  # set c starts at c


def _finalize(
    call: _Call,
    x: Any,
    partials: _Partials,
    num_sets: int,
    count: int,
    eps: float,
    mean: Any,
    rstd: Any,
    var: Any,
    running_mean: Any = None,
    running_var: Any = None,
    momentum: float = 0.0,
) -> None:
    """Merge the partial triples into mean, rstd (and var); running statistics given are updated
    in the same kernel (batch norm, with the unbiased variance)."""
    grid, threads = _plan.finalize_grid(num_sets)
    unbias = count / (count - 1) if count > 1 else float("nan")
    # fmt: off
    call.launch(_STRIDED, "strided_norm_finalize", grid, (threads,), (
        call.ptr(partials.triples), np.int64(num_sets), np.int64(partials.per_set),
        np.float64(count), _scalar(call.acc, eps), call.ptr(mean), call.ptr(rstd), call.ptr(var),
        call.ptr(x), np.int64(partials.shift_div), np.int64(partials.shift_a),
        np.int64(partials.shift_b), call.ptr(running_mean), call.ptr(running_var),
        _scalar(call.acc, momentum), _scalar(call.acc, unbias)))
    # fmt: on


class _Elementwise(NamedTuple):
    """Grid of the elementwise passes (apply, backward sums, backward dx) over one layout."""

    rows: bool  # rows (NCHW) or columns (channels innermost) kernels
    grid: int
    block: tuple[int, ...]
    tail: tuple  # the layout arguments every such kernel takes last
    tiles: int  # T: partials per (n, c) of the backward sums
    samples: int  # NP: samples the partials keep apart (1 when the batch is folded into rows)
    vec: int


def _elementwise(
    call: _Call,
    layout: str,
    N: int,
    C: int,
    S: int,
    groups: int,
    cpg: int,
    aligned: bool,
    cols_ctas_per_sm: int | None = None,
) -> _Elementwise:
    """The grid of an elementwise pass; columns passes aim at ``cols_ctas_per_sm`` CTAs per SM
    (COLS_APPLY_CTAS_PER_SM by default; fewer for the backward sums, whose partials per channel
    grow with the grid)."""
    i64 = np.int64
    if layout == "contiguous":
        plan = _plan.plan_rows_apply(S, call.itemsize, aligned and S % call.vec == 0)
        tail = (
            i64(C),
            i64(S),
            i64(C * S),
            i64(S),
            np.int32(groups),
            i64(cpg),
            i64(plan.tiles_per_plane),
            i64(plan.tile_len),
            np.int32(plan.vectorized),
        )
        return _Elementwise(
            True,
            N * C * plan.tiles_per_plane,
            (plan.threads,),
            tail,
            plan.tiles_per_plane,
            N,
            call.vec if plan.vectorized else 1,
        )
    # per-sample statistics keep samples apart; per-channel ones fold the batch into the rows
    samples, rows = (N, S) if groups > 0 else (1, N * S)
    plan = _plan.plan_cols(
        samples,
        rows,
        C,
        call.itemsize,
        aligned and (S * C) % call.vec == 0,
        call.info,
        cols_ctas_per_sm or _plan.COLS_APPLY_CTAS_PER_SM,
        _plan.COLS_APPLY_THREADS,
    )
    tail = (
        i64(rows),
        i64(C),
        i64(C),
        i64(S * C),
        np.int32(groups),
        i64(cpg),
        i64(plan.ctas_per_sample),
        np.int32(plan.vectorized),
    )
    return _Elementwise(
        False,
        samples * plan.ctas_per_sample,
        (plan.tx, plan.ty),
        tail,
        plan.ctas_per_sample,
        samples,
        call.vec if plan.vectorized else 1,
    )


def _apply(
    call: _Call,
    x: Any,
    y: Any,
    weight: Any,
    bias: Any,
    mean: Any,
    rstd: Any,
    layout: str,
    N: int,
    C: int,
    S: int,
    groups: int,
    cpg: int,
) -> None:
    """y = (x - mean) * rstd * weight + bias over either layout (groups == 0: per channel)."""
    geo = _elementwise(call, layout, N, C, S, groups, cpg, call.aligned(x, y))
    kernel = "strided_norm_apply_rows" if geo.rows else "strided_norm_apply_cols"
    args = (
        call.ptr(x),
        _NULL,
        call.ptr(y),
        call.ptr(weight),
        call.ptr(bias),
        call.ptr(mean),
        call.ptr(rstd),
        _NULL,
        _NULL,
    )
    call.launch(_STRIDED, kernel, geo.grid, geo.block, args + geo.tail)


def _backward(
    call: _Call,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    layout: str,
    N: int,
    C: int,
    S: int,
    groups: int,
    cpg: int,
    training: bool,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple:
    """(dx, dweight, dbias) of y = (x - mean) * rstd * weight + bias; see strided_norm.cu."""
    need_dx, need_dw, need_db = needs_input_grad
    need_dw = need_dw and weight is not None
    dx = call.bk.empty_strided_like(x) if need_dx else None
    aligned = call.aligned(x, dy, dx)
    geo = _elementwise(call, layout, N, C, S, groups, cpg, aligned, _plan.SPLIT_CTAS_PER_SM)
    num_sets = N * groups if groups > 0 else C
    count = cpg * S if groups > 0 else N * S
    dweight = call.grads((C,), weight, x) if need_dw else None
    dbias = call.grads((C,), weight, x) if need_db else None
    u, v = (call.stats((num_sets,), x) for _ in range(2)) if need_dx else (None, None)
    if N * C * S == 0:
        for grad in (dweight, dbias):
            if grad is not None:
                call.bk.fill_zero(grad)
        return dx, dweight, dbias
    # pass 1: per (n, c, tile) sums of dy and dy * (x - mean)
    partials = call.stats((geo.samples * C * geo.tiles * 2,), x)
    smem = 0 if geo.rows else geo.block[0] * geo.block[1] * geo.vec * 2 * _ITEMSIZE[call.acc]
    kernel = "strided_norm_bwd_sums_rows" if geo.rows else "strided_norm_bwd_sums_cols"
    args = (call.ptr(x), call.ptr(dy), call.ptr(mean), call.ptr(partials))
    call.launch(_STRIDED, kernel, geo.grid, geo.block, args + geo.tail, smem=smem)
    # pass 2: dweight, dbias and the dx coefficients, merged in a fixed order
    _bwd_finalize(
        call,
        partials,
        geo.samples,
        C,
        geo.tiles,
        rstd,
        weight,
        groups,
        cpg,
        num_sets,
        count,
        training,
        dweight,
        dbias,
        u,
        v,
    )
    # pass 3: dx
    if need_dx:
        geo = _elementwise(call, layout, N, C, S, groups, cpg, aligned)
        kernel = "strided_norm_bwd_dx_rows" if geo.rows else "strided_norm_bwd_dx_cols"
        args = (
            call.ptr(x),
            call.ptr(dy),
            call.ptr(dx),
            call.ptr(weight),
            _NULL,
            call.ptr(mean),
            call.ptr(rstd),
            call.ptr(u),
            call.ptr(v),
        )
        call.launch(_STRIDED, kernel, geo.grid, geo.block, args + geo.tail)
    return dx, dweight, dbias


def _bwd_finalize(
    call: _Call,
    partials: Any,
    samples: int,
    C: int,
    tiles: int,
    rstd: Any,
    weight: Any,
    groups: int,
    cpg: int,
    num_sets: int,
    count: int,
    training: bool,
    dweight: Any,
    dbias: Any,
    u: Any,
    v: Any,
) -> None:
    """strided_norm_bwd_finalize: partials[(n*C + c)*tiles + t] (sdy, sdx) -> dweight, dbias
    (warps 0..C-1) and the dx coefficients u, v of num_sets statistic sets (the next warps)."""
    # fmt: off
    call.launch(_STRIDED, "strided_norm_bwd_finalize", -(-(C + num_sets) // 8), (256,), (
        call.ptr(partials), np.int64(samples), np.int64(C), np.int64(tiles), call.ptr(rstd),
        call.ptr(weight), np.int32(groups), np.int64(cpg), np.int64(num_sets),
        np.float64(count), np.int32(training), call.ptr(dweight), call.ptr(dbias), call.ptr(u),
        call.ptr(v)))
    # fmt: on


def _segment_launch(
    call: _Call, plan: _plan.SegmentPlan, num_segments: int, like: Any, kernel: str, args: tuple
) -> None:
    """Launch an on-chip segment kernel; a team of CTAs per segment gets its ticket counters
    (zeroed, one per segment plus the start counter) and a buffer for the slices' triples."""
    tickets = partials = None
    if plan.team > 1:
        tickets = call.bk.zeros_int32(1 + num_segments, like)
        partials = call.stats((num_segments * plan.team * 3,), like)
    call.launch(
        _SEGMENT,
        kernel,
        num_segments * plan.team,
        (call.threads(_SEGMENT, kernel, plan.threads),),
        (
            *args,
            np.int32(plan.team),
            call.ptr(tickets),
            call.ptr(partials),
            np.int32(plan.vectorized),
        ),
        smem=plan.smem,
    )


# ---- group norm (instance norm is group norm with one channel per group) ----------------------
@_programmed
def group_norm_fwd(
    x: Any,
    num_groups: int,
    weight: Any,
    bias: Any,
    eps: float,
    *,
    want_var: bool = False,
    want_stats: bool = True,
) -> tuple:
    """y, mean (N, G), rstd (N, G)[, var (N, G)] of GroupNorm over x (N, C, *spatial).

    ``want_stats=False`` (inference): mean and rstd come back as None, and the on-chip kernels
    skip writing them (two allocations fewer per call).
    """
    call = _Call(x, weight if weight is not None else bias)
    x, layout = _prepare(x, call.bk)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    G, Cg = num_groups, x.shape[1] // num_groups
    y = call.bk.empty_strided_like(x)
    mean = rstd = None
    if want_stats:
        mean, rstd = call.stats((N, G), x), call.stats((N, G), x)
    var = call.stats((N, G), x) if want_var else None
    outputs = (y, mean, rstd, var) if want_var else (y, mean, rstd)
    if N * C * S == 0:
        for stat in outputs[1:]:
            if stat is not None:
                call.bk.fill_nan(stat)
        return outputs
    if layout == "contiguous":
        seg_len = Cg * S
        aligned = call.aligned(x, y)
        plan = _plan.plan_segment(seg_len, call.itemsize, aligned, call.info)
        if plan is not None:
            # fmt: off
            _segment_launch(call, plan, N * G, x, "segment_norm_fwd_affine", (
                call.ptr(x), call.ptr(y), call.ptr(weight), call.ptr(bias), call.ptr(mean),
                call.ptr(rstd), call.ptr(var), np.int32(seg_len), np.int32(plan.slice_len),
                np.int32(S), np.int32(Cg), np.int32(G), _scalar(call.acc, eps)))
            # fmt: on
            return outputs
        partials = _stats_rows(call, x, N * G, 1, seg_len, 0, seg_len)
    else:
        partials = _stats_cols(call, x, N, S, C, S * C, G, Cg)
    if mean is None:  # the apply pass reads them
        mean, rstd = call.stats((N, G), x), call.stats((N, G), x)
    _finalize(call, x, partials, N * G, Cg * S, eps, mean, rstd, var)
    _apply(call, x, y, weight, bias, mean, rstd, layout, N, C, S, G, Cg)
    return outputs


def _match_layout(call: _Call, t: Any, ref: Any) -> Any:
    """t laid out with ref's strides (a copy only when they differ)."""
    if tuple(call.bk.strides(t)) == tuple(call.bk.strides(ref)):
        return t
    out = call.bk.empty_strided_like(ref)
    call.bk.copy_into(out, t)
    return out


@_programmed
def group_norm_bwd(
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    num_groups: int,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple:
    """(dx, dweight, dbias) of group_norm_fwd; mean/rstd are its (N, G) statistics.

    dweight and dbias come in the weight's dtype (float32/float64 accumulators when weight is None).
    """
    call = _Call(x, weight)
    x, layout = _prepare(x, call.bk)
    dy = _match_layout(call, dy, x)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    G = num_groups
    if layout == "contiguous" and G == C and needs_input_grad[0] and N * C * S > 0:
        on_chip = _instance_bwd_on_chip(call, dy, x, mean, rstd, weight, N, C, S, needs_input_grad)
        if on_chip is not None:
            return on_chip
    return _backward(
        call, dy, x, mean, rstd, weight, layout, N, C, S, G, C // G, True, needs_input_grad
    )


def _instance_bwd_on_chip(
    call: _Call,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    N: int,
    C: int,
    S: int,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple | None:
    """InstanceNorm backward with each plane's x and dy held on chip (segment_norm.cu): three
    passes over the tensors instead of five. None when a plane is too long for a team."""
    dx = call.bk.empty_strided_like(x)
    plan = _plan.plan_segment(S, call.itemsize, call.aligned(x, dy, dx), call.info, tensors=2)
    if plan is None:
        return None
    sums = call.stats((N * C * 2,), x)
    tickets = partials = None
    if plan.team > 1:
        tickets = call.bk.zeros_int32(1 + N * C, x)
        partials = call.stats((N * C * plan.team * 2,), x)
    # fmt: off
    threads = call.threads(_SEGMENT, "segment_norm_bwd_instance", plan.threads)
    call.launch(_SEGMENT, "segment_norm_bwd_instance", N * C * plan.team, (threads,), (
        call.ptr(x), call.ptr(dy), call.ptr(weight), call.ptr(mean), call.ptr(rstd), call.ptr(dx),
        call.ptr(sums), np.int32(S), np.int32(plan.slice_len), np.int32(C),
        np.int32(plan.team), call.ptr(tickets), call.ptr(partials), np.int32(plan.vectorized)),
        smem=plan.smem)
    # fmt: on
    need_dw = needs_input_grad[1] and weight is not None
    dweight = call.grads((C,), weight, x) if need_dw else None
    dbias = call.grads((C,), weight, x) if needs_input_grad[2] else None
    if dweight is not None or dbias is not None:  # sums[n, c] -> per-channel, over the batch
        _bwd_finalize(
            call, sums, N, C, 1, rstd, weight, C, 1, 0, 0, False, dweight, dbias, None, None
        )
    return dx, dweight, dbias


# ---- batch norm ---------------------------------------------------------------------------
@_programmed
def batch_norm_fwd(
    x: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple:
    """y, save_mean (C,), save_rstd (C,) of BatchNorm over x (N, C, *spatial)."""
    call = _Call(x, weight if weight is not None else bias)
    x, layout = _prepare(x, call.bk)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    y = call.bk.empty_strided_like(x)
    # running statistics the kernels update (or read) in place: those of the weight's type
    running = tuple(t for t in (running_mean, running_var) if t is not None)
    in_kernel = all(call.bk.dtype_name(t) == (call.param_dtype or call.dtype) for t in running)
    if not training:
        if in_kernel:
            mean, rstd = call.stats((C,), x), call.stats((C,), x)
            if C:
                # fmt: off
                call.launch(_STRIDED, "strided_norm_running_stats", -(-C // 256), (256,), (
                    call.ptr(running_mean), call.ptr(running_var), np.int64(C),
                    _scalar(call.acc, eps), call.ptr(mean), call.ptr(rstd)))
                # fmt: on
        else:
            mean = call.bk.astype(running_mean, call.acc)
            rstd = call.bk.rsqrt_plus(running_var, eps, call.acc)
        if _plan.prod(tuple(x.shape)):
            _apply(call, x, y, weight, bias, mean, rstd, layout, N, C, S, 0, 1)
        return y, mean, rstd
    mean, rstd, var = (call.stats((C,), x) for _ in range(3))
    count = N * S
    if count * C == 0:
        call.bk.fill_nan(mean)
        call.bk.fill_nan(rstd)
        return y, mean, rstd
    if S == 1:
        layout = "channels_last"  # (N, C): channels innermost, one row per sample
    if layout == "contiguous":
        partials = _stats_rows(call, x, C, N, S, C * S, S)
    else:
        partials = _stats_cols(call, x, 1, N * S, C, 0, 0, 1)
    if in_kernel:
        call.mutates_inputs()
        # fmt: off
        _finalize(call, x, partials, C, count, eps, mean, rstd, var, running_mean, running_var,
                  momentum)
        # fmt: on
    else:
        _finalize(call, x, partials, C, count, eps, mean, rstd, var)
        if running_mean is not None:
            call.bk.update_running(running_mean, mean, momentum)
        if running_var is not None:
            unbiased = var * (count / (count - 1)) if count > 1 else var * float("nan")
            call.bk.update_running(running_var, unbiased, momentum)
    _apply(call, x, y, weight, bias, mean, rstd, layout, N, C, S, 0, 1)
    return y, mean, rstd


@_programmed
def batch_norm_bwd(
    dy: Any,
    x: Any,
    save_mean: Any,
    save_rstd: Any,
    weight: Any,
    training: bool,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple:
    """(dx, dweight, dbias) of batch_norm_fwd given its saved (C,) mean and rstd.

    In eval mode the statistics are constants, so dx = dy * rstd * weight.
    """
    call = _Call(x, weight)
    x, layout = _prepare(x, call.bk)
    dy = _match_layout(call, dy, x)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    if S == 1:
        layout = "channels_last"
    return _backward(
        call, dy, x, save_mean, save_rstd, weight, layout, N, C, S, 0, 1, training, needs_input_grad
    )


# ---- the seed-002 tail: row norm, then (xhat + y) * y ---------------------------------------
@_programmed
def row_norm_add_mul_fwd(x: Any, other: Any, eps: float) -> tuple:
    """out = (xhat + other) * other with xhat the row-normalized x; returns (out, mean, rstd)."""
    call = _Call(x)
    x = call.bk.contiguous(x)
    other = call.bk.contiguous(other)
    D = x.shape[-1]
    rows = _plan.prod(tuple(x.shape[:-1]))
    out = call.bk.empty_strided_like(x)
    mean, rstd = call.stats(tuple(x.shape[:-1]), x), call.stats(tuple(x.shape[:-1]), x)
    if rows * D == 0:
        call.bk.fill_nan(mean)
        call.bk.fill_nan(rstd)
        return out, mean, rstd
    plan = _plan.plan_segment(D, call.itemsize, call.aligned(x, other, out), call.info)
    if plan is not None:
        # fmt: off
        _segment_launch(call, plan, rows, x, "segment_norm_fwd_add_mul", (
            call.ptr(x), call.ptr(other), call.ptr(out), call.ptr(mean), call.ptr(rstd),
            np.int32(D), np.int32(plan.slice_len), _scalar(call.acc, eps)))
        # fmt: on
        return out, mean, rstd
    # rows too long for chip memory: strided statistics, normalize, then the epilogue elementwise
    partials = _stats_rows(call, x, rows, 1, D, 0, D)
    _finalize(call, x, partials, rows, D, eps, mean, rstd, None)
    _apply(
        call,
        x.reshape(rows, 1, D),
        out.reshape(rows, 1, D),
        None,
        None,
        mean,
        rstd,
        "contiguous",
        rows,
        1,
        D,
        1,
        1,
    )
    call.opaque()
    out += other
    out *= other
    return out, mean, rstd


@_programmed
def row_norm_add_mul_bwd(dout: Any, x: Any, other: Any, mean: Any, rstd: Any) -> tuple:
    """(dx, dother) of row_norm_add_mul_fwd: out = xhat * r + r^2 with r = other, so
    dother = dout * (xhat + 2 r) and dxhat = dout * r, taken through the row norm's backward.

    One kernel when a row's (dxhat, xhat) fit in one CTA's shared memory; otherwise composed
    from elementwise operations and the strided backward.
    """
    call = _Call(x)
    bk = call.bk
    x, other, dout = bk.contiguous(x), bk.contiguous(other), bk.contiguous(dout)
    D = x.shape[-1]
    rows = _plan.prod(tuple(x.shape[:-1]))
    smem = 2 * D * _ITEMSIZE[call.acc]
    if rows * D > 0 and smem <= call.info.smem_optin - 1024:
        dx, dother = bk.empty_strided_like(x), bk.empty_strided_like(x)
        vectorized = D % call.vec == 0 and call.aligned(x, other, dout, dx, dother)
        packs = D // call.vec if vectorized else D
        wanted = min(1024, max(32, _plan.round_up(-(-packs // 4), 32)))
        threads = call.threads(_SEGMENT, "segment_norm_bwd_add_mul", wanted)
        # fmt: off
        call.launch(_SEGMENT, "segment_norm_bwd_add_mul", rows, (threads,), (
            call.ptr(x), call.ptr(other), call.ptr(dout), call.ptr(mean), call.ptr(rstd),
            call.ptr(dx), call.ptr(dother), np.int32(D), np.int32(vectorized)), smem=smem)
        # fmt: on
        return dx, dother
    xhat = (bk.astype(x, call.acc) - mean[..., None]) * rstd[..., None]
    dother = bk.astype(dout * (xhat + 2 * bk.astype(other, call.acc)), call.dtype)
    dxhat = bk.astype(bk.astype(dout, call.acc) * bk.astype(other, call.acc), call.dtype)
    dx = _backward(
        call,
        dxhat.reshape(rows, 1, D),
        x.reshape(rows, 1, D),
        mean,
        rstd,
        None,
        "contiguous",
        rows,
        1,
        D,
        1,
        1,
        True,
        (True, False, False),
    )[0]
    return dx.reshape(x.shape), dother
