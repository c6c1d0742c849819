"""`python -m cupynorm bench`: torch eager vs `torch.compile` vs cupynorm, side by side.

Method (the design notes' "Benchmark method"):

* Every workload runs the three implementations in one process on the same inputs. cupynorm runs
  through the `cupynorm.torch` modules on torch tensors; `torch.compile` (default mode) wraps the
  eager module, compiles on its first call and is warmed up; compile time is never timed.
* Before any timing, cupynorm's outputs (and, for fwd+bwd rows, its gradients; for BatchNorm its
  running statistics) are compared with torch eager's. Both tensors are divided by the RMS of
  torch's tensor ("normalized"), then checked like `torch.allclose` with a tolerance from the dtype
  (`TOLERANCES`). A mismatch is a hard failure: the maximum error is printed and the exit code is 1.
* Timing: CUDA events placed around the operation only; before each repetition a buffer of at least
  twice the L2 size is overwritten to flush L2 (outside the events); warm-up first; the median of
  the repetitions is reported. Host-overhead rows (`module_overhead`) time many back-to-back calls
  between one pair of events and report the time per call.
* TB/s counts `tensor_passes` passes over the big tensor(s) (for example forward: read x, write y;
  forward+backward: read x, write y, read x, read dy, write dx = 5 passes) divided by the median
  time, and is also given as a percentage of the measured device-to-device copy bandwidth.
* fp16 workloads convert the whole module (parameters and running statistics too) to fp16, for
  all three implementations alike. Inputs are torch.rand (uniform [0, 1)), as in KernelBench.

Output: one progress line per workload (and every check) on stderr; then notes and a markdown
table on stdout, last (paste-able into benchmarks/RESULTS.md).

Exit codes: 0 all good; 1 cupynorm wrong or failing (or a workload could not be set up);
2 no torch / no CUDA GPU / bad arguments.

Importing this module is cheap: torch, CuPy and cupynorm's kernels are imported only when a
benchmark runs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.util
import json
import math
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ENVIRONMENT = 2

IMPL_EAGER = "torch eager"
IMPL_COMPILE = "torch.compile"
IMPL_CUPYNORM = "cupynorm"
IMPLEMENTATIONS = (IMPL_EAGER, IMPL_COMPILE, IMPL_CUPYNORM)

# Copy bandwidth of the lent H200 on the day the goals were set (DESIGN.md, Performance goals).
# On another GPU the goal is the same fraction of that GPU's measured copy bandwidth.
H200_COPY_TBPS = 4.24

# L2 flush: overwrite at least this much (and at least twice the L2 size) before each repetition.
MIN_FLUSH_BYTES = 256 * 1024**2
# Device-to-device copy used to measure copy bandwidth: far larger than any L2.
COPY_BANDWIDTH_BYTES = 1024**3
COPY_BANDWIDTH_REPS = 20

WARMUP_CALLS = 3
ESTIMATE_REPS = 3
# Host + flush cost of one repetition besides the timed operation (zeroing 256 MB ~ 0.07 ms).
PER_REP_OVERHEAD_MS = 0.1


@dataclass(frozen=True)
class TimingBudget:
    """How long each implementation of a throughput workload is timed (after warm-up)."""

    budget_ms: float  # wall time aimed at for the repetitions of one implementation
    min_reps: int
    max_reps: int
    overhead_calls: int  # back-to-back calls per trial of a host-overhead workload
    overhead_trials: int


FULL_BUDGET = TimingBudget(
    budget_ms=800.0, min_reps=10, max_reps=1000, overhead_calls=1000, overhead_trials=7
)
QUICK_BUDGET = TimingBudget(
    budget_ms=150.0, min_reps=5, max_reps=100, overhead_calls=300, overhead_trials=3
)


@dataclass(frozen=True)
class Tolerance:
    """`allclose`-style tolerance applied after dividing both tensors by the reference's RMS."""

    atol: float
    rtol: float


TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    # fp16 keeps 11 significant bits: one rounding step of a value near 1 is 1e-3.
    "float16": Tolerance(atol=1e-2, rtol=1e-2),
    # bf16 keeps 8 significant bits: one rounding step of a value near 1 is 8e-3.
    "bfloat16": Tolerance(atol=5e-2, rtol=5e-2),
}

ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

# Elements per chunk when comparing huge tensors, so the comparison needs no full-size temporaries.
COMPARE_CHUNK_ELEMENTS = 1 << 24


# ------------------------------------------------------------------------------------------------
# Workload registry
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModuleSpec:
    """How to build one implementation's module: `<namespace>.<class_name>(*args, **kwargs)`.

    namespace is "torch.nn", "cupynorm.torch", or "bench" for the reference models of seed 002
    defined in this file. Nothing is imported until `build` is called.
    """

    namespace: str
    class_name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def build(self) -> torch.nn.Module:
        """Construct the module (on the CPU, float32, like `torch.nn` modules)."""
        if self.namespace == "bench":
            cls = _seed002_module_classes()[self.class_name]
        else:
            cls = getattr(importlib.import_module(self.namespace), self.class_name)
        return cls(*self.args, **dict(self.kwargs))

    def describe(self) -> str:
        """`GroupNorm(8, 64)`-style text."""
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.class_name}({', '.join(parts)})"


def _same_module(class_name: str, *args: Any, **kwargs: Any) -> dict[str, ModuleSpec]:
    """The torch.nn module and its cupynorm.torch drop-in, built with the same arguments."""
    kw = tuple(kwargs.items())
    return {
        "eager": ModuleSpec("torch.nn", class_name, args, kw),
        "cupynorm": ModuleSpec("cupynorm.torch", class_name, args, kw),
    }


@dataclass(frozen=True)
class Workload:
    """One benchmark row group: the same module call in torch eager, torch.compile, cupynorm."""

    name: str
    title: str
    eager: ModuleSpec
    cupynorm: ModuleSpec
    input_shapes: tuple[Shape, ...]  # one per module input; the first is "the big tensor"
    quick_input_shapes: tuple[Shape, ...] | None = None  # None: same as input_shapes
    dtype: str = "float32"
    channels_last: bool = False
    backward: bool = False  # time forward + backward (gradients of input and parameters)
    # Passes over a tensor of the first input's size that define TB/s; None: not bandwidth-bound.
    tensor_passes: int | None = 2
    traffic: str = "read x, write y"
    goal_ms: float | None = None  # on an H200 at the full shapes; None: a relative goal
    goal_text: str = ""  # the relative goal, e.g. "<= eager"
    measure: str = "throughput"  # or "overhead": per-call time of back-to-back calls

    def shapes(self, quick: bool) -> tuple[Shape, ...]:
        """Input shapes for a full or a `--quick` run."""
        if quick and self.quick_input_shapes is not None:
            return self.quick_input_shapes
        return self.input_shapes


def _shape_text(shape: Shape) -> str:
    return "x".join(str(d) for d in shape)


_IN_NCHW = (112, 64, 512, 512)
_IN_NCHW_QUICK = (28, 64, 512, 512)
_BN_NCHW = (64, 64, 512, 512)
_BN_NCHW_QUICK = (16, 64, 512, 512)
_SEED002_ROWS = (1024, 8192)
_FWDBWD_NCHW = (32, 64, 256, 256)
_SD_GROUPNORM = (16, 320, 64, 64)
_FWDBWD_TRAFFIC = "fwd: read x, write y; bwd: read x, read dy, write dx (5 passes)"

WORKLOADS: tuple[Workload, ...] = (
    Workload(
        name="instancenorm2d_fp32",
        title="InstanceNorm2d(64) fp32 fwd",
        **_same_module("InstanceNorm2d", 64),
        input_shapes=(_IN_NCHW,),
        quick_input_shapes=(_IN_NCHW_QUICK,),
        goal_ms=3.9,
    ),
    Workload(
        name="groupnorm8_fp32",
        title="GroupNorm(8, 64) fp32 fwd",
        **_same_module("GroupNorm", 8, 64),
        input_shapes=(_IN_NCHW,),
        quick_input_shapes=(_IN_NCHW_QUICK,),
        goal_ms=3.9,
    ),
    Workload(
        name="batchnorm2d_train_fp32",
        title="BatchNorm2d(64) training fp32 fwd",
        **_same_module("BatchNorm2d", 64),
        input_shapes=(_BN_NCHW,),
        quick_input_shapes=(_BN_NCHW_QUICK,),
        goal_ms=3.1,
    ),
    Workload(
        name="row_norm_add_mul_fp32",
        title="seed-002 tail: row instance norm over 8192 features, then (x + y) * y, fp32",
        eager=ModuleSpec("bench", "Seed002Tail", (8192,), (("eps", 1e-5), ("momentum", 0.1))),
        cupynorm=ModuleSpec("cupynorm.torch", "RowNormAddMul", (), (("eps", 1e-5),)),
        input_shapes=(_SEED002_ROWS, _SEED002_ROWS),
        tensor_passes=3,
        traffic="read x, read y, write out (3 passes)",
        goal_ms=0.030,
    ),
    Workload(
        name="groupnorm32_fp16_cl",
        title="GroupNorm(32, 320) fp16 channels_last fwd",
        **_same_module("GroupNorm", 32, 320),
        input_shapes=(_SD_GROUPNORM,),
        dtype="float16",
        channels_last=True,
        goal_ms=0.025,
    ),
    Workload(
        name="groupnorm32_fp16",
        title="GroupNorm(32, 320) fp16 NCHW fwd",
        **_same_module("GroupNorm", 32, 320),
        input_shapes=(_SD_GROUPNORM,),
        dtype="float16",
        goal_ms=0.025,
    ),
    Workload(
        name="batchnorm2d_train_fp16_cl",
        title="BatchNorm2d(64) training fp16 channels_last fwd",
        **_same_module("BatchNorm2d", 64),
        input_shapes=((256, 64, 112, 112),),
        dtype="float16",
        channels_last=True,
        goal_ms=0.31,
    ),
    Workload(
        name="instancenorm2d_affine_fwdbwd_fp32",
        title="InstanceNorm2d(64, affine=True) fp32 fwd+bwd",
        **_same_module("InstanceNorm2d", 64, affine=True),
        input_shapes=(_FWDBWD_NCHW,),
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=0.75,
    ),
    Workload(
        name="batchnorm2d_fwdbwd_fp32",
        title="BatchNorm2d(64) training fp32 fwd+bwd",
        **_same_module("BatchNorm2d", 64),
        input_shapes=(_FWDBWD_NCHW,),
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=1.15,
    ),
    Workload(
        name="groupnorm32_fwdbwd_fp16",
        title="GroupNorm(32, 320) fp16 fwd+bwd",
        **_same_module("GroupNorm", 32, 320),
        input_shapes=(_SD_GROUPNORM,),
        dtype="float16",
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=0.07,
    ),
    Workload(
        name="seed002_model_fp32",
        title="seed-002 model: Linear(8192, 8192) 'bmm' + the tail, fp32, batch 1024",
        eager=ModuleSpec("bench", "Seed002Model", (8192, 8192)),
        cupynorm=ModuleSpec("bench", "Seed002ModelCupynorm", (8192, 8192)),
        input_shapes=(_SEED002_ROWS, _SEED002_ROWS),
        tensor_passes=None,
        traffic="GEMM-bound: no TB/s",
        goal_text="<= eager",
    ),
    Workload(
        name="module_overhead",
        title="InstanceNorm2d(64) fp32 8x64x32x32 module call, per-call time (host overhead)",
        **_same_module("InstanceNorm2d", 64),
        input_shapes=((8, 64, 32, 32),),
        tensor_passes=None,
        traffic="host overhead: no TB/s",
        goal_text="<= eager",
        measure="overhead",
    ),
)

WORKLOADS_BY_NAME: dict[str, Workload] = {w.name: w for w in WORKLOADS}


def select_workloads(only: Sequence[str] | None) -> list[Workload]:
    """The registry's workloads named by `--only` (repeatable, comma lists), in registry order.

    None or an empty selection means all. Raises ValueError naming unknown workloads.
    """
    if not only:
        return list(WORKLOADS)
    wanted: list[str] = []
    for item in only:
        wanted.extend(name.strip() for name in item.split(",") if name.strip())
    if not wanted:
        return list(WORKLOADS)
    unknown = [name for name in wanted if name not in WORKLOADS_BY_NAME]
    if unknown:
        raise ValueError(
            f"unknown workload(s): {', '.join(unknown)}; "
            f"choose from: {', '.join(WORKLOADS_BY_NAME)}"
        )
    chosen = set(wanted)
    return [w for w in WORKLOADS if w.name in chosen]


# ------------------------------------------------------------------------------------------------
# Arithmetic: bytes, bandwidth, goals, repetitions
# ------------------------------------------------------------------------------------------------


def bytes_moved(workload: Workload, quick: bool = False) -> int | None:
    """Bytes that define TB/s: `tensor_passes` passes over the first input; None if not counted."""
    if workload.tensor_passes is None:
        return None
    numel = math.prod(workload.shapes(quick)[0])
    return workload.tensor_passes * numel * ITEMSIZE[workload.dtype]


def throughput_tbps(nbytes: int, ms: float) -> float:
    """Terabytes (1e12 bytes) per second for `nbytes` moved in `ms` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e12


def speedup(reference_ms: float | None, ms: float | None) -> float | None:
    """How many times faster `ms` is than `reference_ms` (None when either is missing)."""
    if reference_ms is None or ms is None or ms <= 0:
        return None
    return reference_ms / ms


def goal_ms_for_run(
    workload: Workload, quick: bool, copy_tbps: float | None, gpu_name: str
) -> float | None:
    """The millisecond goal that applies to this run, or None for a relative goal.

    The goals are H200 numbers at the full shapes. A `--quick` shape scales the goal by its share
    of the bytes; another GPU scales it by H200_COPY_TBPS / its measured copy bandwidth.
    """
    if workload.goal_ms is None:
        return None
    goal = workload.goal_ms
    full_bytes = bytes_moved(workload, quick=False)
    run_bytes = bytes_moved(workload, quick=quick)
    if full_bytes and run_bytes:
        goal *= run_bytes / full_bytes
    if "H200" not in gpu_name and copy_tbps:
        goal *= H200_COPY_TBPS / copy_tbps
    return goal


def choose_reps(estimated_ms: float, budget: TimingBudget) -> int:
    """Repetitions that fill the time budget, clamped to [min_reps, max_reps]."""
    per_rep_ms = max(estimated_ms, 0.0) + PER_REP_OVERHEAD_MS
    reps = int(budget.budget_ms / per_rep_ms)
    return max(budget.min_reps, min(budget.max_reps, reps))


def l2_flush_bytes(l2_cache_bytes: int) -> int:
    """Size of the buffer overwritten before each repetition: >= 2x L2 and >= 256 MB."""
    return max(MIN_FLUSH_BYTES, 2 * max(l2_cache_bytes, 0))


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------


@dataclass
class TensorCheck:
    """cupynorm's tensor vs torch eager's."""

    name: str
    max_abs_error: float  # raw, before normalizing
    worst_ratio: float  # max |a - b| / (atol * rms(b) + rtol * |b|); passes when <= 1
    ok: bool
    note: str = ""


@dataclass
class ImplResult:
    """One implementation's timing of one workload (or the error that prevented it)."""

    impl: str
    ms: float | None = None  # median (per call for overhead workloads)
    min_ms: float | None = None
    max_ms: float | None = None
    reps: int = 0
    compile_s: float | None = None
    peak_extra_bytes: int | None = None
    error: str | None = None


@dataclass
class WorkloadResult:
    """Everything measured for one workload."""

    workload: Workload
    quick: bool
    checks: list[TensorCheck] = field(default_factory=list)
    impls: list[ImplResult] = field(default_factory=list)
    error: str | None = None  # the workload could not be set up at all
    seconds: float = 0.0

    def impl(self, name: str) -> ImplResult | None:
        """The result of implementation `name`, if it was run."""
        for result in self.impls:
            if result.impl == name:
                return result
        return None

    @property
    def cupynorm_wrong(self) -> bool:
        """cupynorm's results differ from torch eager's."""
        return any(not check.ok for check in self.checks)

    @property
    def failed(self) -> bool:
        """cupynorm is wrong or failed, or the workload could not run."""
        cupynorm = self.impl(IMPL_CUPYNORM)
        return (
            self.error is not None
            or self.cupynorm_wrong
            or cupynorm is None
            or cupynorm.error is not None
        )

    def goal_met(self, goal_ms: float | None) -> bool | None:
        """Whether cupynorm meets the workload's goal (None when unknown)."""
        cupynorm = self.impl(IMPL_CUPYNORM)
        if cupynorm is None or cupynorm.ms is None:
            return None
        if goal_ms is not None:
            return cupynorm.ms <= goal_ms
        if self.workload.goal_text.startswith("<= eager"):
            eager = self.impl(IMPL_EAGER)
            if eager is None or eager.ms is None:
                return None
            return cupynorm.ms <= eager.ms
        return None


# ------------------------------------------------------------------------------------------------
# Formatting: markdown table, JSON, plot
# ------------------------------------------------------------------------------------------------

TABLE_COLUMNS = (
    "workload",
    "impl",
    "ms",
    "TB/s",
    "% copy BW",
    "vs eager",
    "vs compile",
    "goal ms",
    "peak extra MB",
)


def _format_ms(ms: float) -> str:
    return f"{ms:.4g}" if ms < 1000 else f"{ms:.0f}"


def _format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _escape_cell(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.replace("|", "\\|")


def _goal_cell(result: WorkloadResult, goal_ms: float | None) -> str:
    if goal_ms is not None:
        text = f"{goal_ms:.3g}"
    elif result.workload.goal_text:
        text = result.workload.goal_text
    else:
        return "-"
    met = result.goal_met(goal_ms)
    if met is None:
        return text
    return f"{text} ({'met' if met else 'missed'})"


def table_rows(
    results: Sequence[WorkloadResult], copy_tbps: float | None, gpu_name: str
) -> list[list[str]]:
    """The table's cells, one row per (workload, implementation)."""
    rows: list[list[str]] = []
    for result in results:
        workload = result.workload
        nbytes = bytes_moved(workload, result.quick)
        goal = goal_ms_for_run(workload, result.quick, copy_tbps, gpu_name)
        eager = result.impl(IMPL_EAGER)
        compiled = result.impl(IMPL_COMPILE)
        if result.error is not None and not result.impls:
            rows.append([workload.name, "-", "ERROR: " + _escape_cell(result.error)] + ["-"] * 6)
            continue
        for impl in result.impls:
            row = [workload.name, impl.impl]
            if impl.ms is None:
                row.append(_escape_cell(f"ERROR: {impl.error or 'not run'}"))
                row.extend(["-"] * 4)  # TB/s, % copy BW, vs eager, vs compile
            else:
                tbps = throughput_tbps(nbytes, impl.ms) if nbytes and impl.ms > 0 else None
                row.append(_format_ms(impl.ms))
                row.append("-" if tbps is None else f"{tbps:.2f}")
                row.append(
                    "-" if tbps is None or not copy_tbps else f"{100 * tbps / copy_tbps:.0f}%"
                )
                row.append(_format_ratio(speedup(eager.ms if eager else None, impl.ms)))
                row.append(_format_ratio(speedup(compiled.ms if compiled else None, impl.ms)))
            row.append(_goal_cell(result, goal) if impl.impl == IMPL_CUPYNORM else "")
            peak = impl.peak_extra_bytes
            row.append("-" if peak is None else f"{peak / 1e6:.0f}")
            rows.append(row)
    return rows


def format_markdown_table(
    results: Sequence[WorkloadResult], copy_tbps: float | None, gpu_name: str
) -> str:
    """A markdown table of all results (paste-able into benchmarks/RESULTS.md)."""
    lines = [
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * 6 + ["---:"]) + "|",
    ]
    for row in table_rows(results, copy_tbps, gpu_name):
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_notes(
    results: Sequence[WorkloadResult], copy_tbps: float | None, gpu_name: str, quick: bool
) -> str:
    """The lines printed above the table: device, copy bandwidth and what each row counts."""
    lines = [f"GPU: {gpu_name}"]
    if copy_tbps:
        lines.append(f"copy bandwidth (device-to-device, read + write): {copy_tbps:.2f} TB/s")
    lines.append(
        "ms: median over repetitions, CUDA events around the op only, L2 flushed before each; "
        "module_overhead: per call of back-to-back calls."
    )
    goal_note = "goal ms: H200 goal"
    if quick:
        goal_note += ", scaled to the --quick shapes by bytes"
    if "H200" not in gpu_name:
        goal_note += f", scaled by {H200_COPY_TBPS} TB/s / this GPU's copy bandwidth"
    lines.append(goal_note + ".")
    for result in results:
        w = result.workload
        shapes = ", ".join(_shape_text(s) for s in w.shapes(result.quick))
        layout = " channels_last" if w.channels_last else ""
        lines.append(f"- {w.name}: {w.title}; input {shapes} {w.dtype}{layout}; TB/s: {w.traffic}")
    return "\n".join(lines)


def results_to_json(
    results: Sequence[WorkloadResult],
    *,
    environment: dict[str, Any],
    copy_tbps: float | None,
    quick: bool,
    exit_code: int,
) -> dict[str, Any]:
    """All numbers of a run as a JSON-serializable dict."""
    gpu_name = str(environment.get("gpu", ""))
    workloads = []
    for result in results:
        w = result.workload
        nbytes = bytes_moved(w, result.quick)
        goal = goal_ms_for_run(w, result.quick, copy_tbps, gpu_name)
        eager = result.impl(IMPL_EAGER)
        compiled = result.impl(IMPL_COMPILE)
        impls = []
        for impl in result.impls:
            tbps = throughput_tbps(nbytes, impl.ms) if nbytes and impl.ms else None
            impls.append(
                {
                    "impl": impl.impl,
                    "ms": impl.ms,
                    "min_ms": impl.min_ms,
                    "max_ms": impl.max_ms,
                    "reps": impl.reps,
                    "tbps": tbps,
                    "pct_of_copy_bandwidth": (
                        100 * tbps / copy_tbps if tbps is not None and copy_tbps else None
                    ),
                    "speedup_vs_eager": speedup(eager.ms if eager else None, impl.ms),
                    "speedup_vs_compile": speedup(compiled.ms if compiled else None, impl.ms),
                    "compile_s": impl.compile_s,
                    "peak_extra_bytes": impl.peak_extra_bytes,
                    "error": impl.error,
                }
            )
        workloads.append(
            {
                "name": w.name,
                "title": w.title,
                "input_shapes": [list(s) for s in w.shapes(result.quick)],
                "dtype": w.dtype,
                "channels_last": w.channels_last,
                "backward": w.backward,
                "measure": w.measure,
                "tensor_passes": w.tensor_passes,
                "traffic": w.traffic,
                "bytes_moved": nbytes,
                "goal_ms_h200_full_shape": w.goal_ms,
                "goal_ms_this_run": goal,
                "goal_text": w.goal_text,
                "goal_met": result.goal_met(goal),
                "error": result.error,
                "seconds": result.seconds,
                "checks": [
                    {
                        "name": c.name,
                        "max_abs_error": _json_float(c.max_abs_error),
                        "worst_ratio_to_tolerance": _json_float(c.worst_ratio),
                        "ok": c.ok,
                        "note": c.note,
                    }
                    for c in result.checks
                ],
                "impls": impls,
            }
        )
    return {
        "tool": "python -m cupynorm bench",
        **environment,
        "quick": quick,
        "copy_bandwidth_tbps": copy_tbps,
        "exit_code": exit_code,
        "workloads": workloads,
    }


def _json_float(value: float) -> float | str:
    """JSON has no inf/nan: write them as strings."""
    return value if math.isfinite(value) else str(value)


def matplotlib_available() -> bool:
    """Whether `--plot` can work."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


def plot_results(
    results: Sequence[WorkloadResult], copy_tbps: float | None, path: str | Path
) -> None:
    """Save a PNG bar chart of TB/s per workload and implementation (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plotted = [r for r in results if bytes_moved(r.workload, r.quick)]
    impl_names = [name for name in IMPLEMENTATIONS if any(r.impl(name) for r in plotted)]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.2 * len(plotted) + 2), 4.5))
    width = 0.8 / max(len(impl_names), 1)
    for index, impl_name in enumerate(impl_names):
        heights = []
        for result in plotted:
            impl = result.impl(impl_name)
            nbytes = bytes_moved(result.workload, result.quick)
            ok = impl is not None and impl.ms is not None and nbytes
            heights.append(throughput_tbps(nbytes, impl.ms) if ok else 0.0)
        positions = [i + (index - (len(impl_names) - 1) / 2) * width for i in range(len(plotted))]
        axes.bar(positions, heights, width=width, label=impl_name)
    if copy_tbps:
        axes.axhline(copy_tbps, color="black", linestyle="--", linewidth=1, label="copy bandwidth")
    axes.set_xticks(range(len(plotted)))
    axes.set_xticklabels([r.workload.name for r in plotted], rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("TB/s")
    axes.set_title("cupynorm bench: TB/s per workload (higher is better)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(str(path), dpi=120)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------
# Device-side helpers (torch imported lazily)
# ------------------------------------------------------------------------------------------------


def _device() -> torch.device:
    """The device benchmarked: torch's current CUDA device."""
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def make_l2_flush_buffer(device: Any = None) -> torch.Tensor:
    """A buffer of >= 2x the L2 size (and >= 256 MB) to overwrite before each repetition."""
    import torch

    if device is None:
        device = _device()
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or 0)
    return torch.empty(l2_flush_bytes(l2_bytes) // 4, dtype=torch.int32, device=device)


def time_cuda_ms(
    fn: Callable[[], object],
    *,
    reps: int,
    warmup: int = WARMUP_CALLS,
    flush_buffer: torch.Tensor | None = None,
) -> list[float]:
    """Milliseconds of each of `reps` calls of `fn`, CUDA events around the call only.

    Before each repetition `flush_buffer` (if given) is overwritten, outside the events, so the
    call starts with a cold L2. `fn`'s result is dropped at once (its memory is reused).
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        if flush_buffer is not None:
            flush_buffer.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


def time_per_call_ms(
    fn: Callable[[], object], *, calls: int, trials: int, warmup: int = 20
) -> list[float]:
    """Per-call milliseconds of `calls` back-to-back calls (one pair of events), per trial."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(trials):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return per_call


def measure_copy_bandwidth_tbps(nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / median time."""
    import torch

    if nbytes is None:
        nbytes = COPY_BANDWIDTH_BYTES
    source = torch.ones(nbytes, dtype=torch.uint8, device=_device())
    destination = torch.empty_like(source)

    def copy() -> None:
        destination.copy_(source)

    times = time_cuda_ms(copy, reps=COPY_BANDWIDTH_REPS)
    return throughput_tbps(2 * nbytes, statistics.median(times))


def _flatten_in_same_order(
    actual: torch.Tensor, expected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D views (copies only for unusual layouts) with elements in the same logical order."""
    import torch

    if actual.is_contiguous() and expected.is_contiguous():
        return actual.view(-1), expected.view(-1)
    channels_last = torch.channels_last
    if (
        actual.dim() == 4
        and actual.is_contiguous(memory_format=channels_last)
        and expected.is_contiguous(memory_format=channels_last)
    ):
        return actual.permute(0, 2, 3, 1).reshape(-1), expected.permute(0, 2, 3, 1).reshape(-1)
    return actual.reshape(-1), expected.reshape(-1)


def compare_tensors(
    name: str, actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance
) -> TensorCheck:
    """Check `actual` against `expected` after dividing both by `expected`'s RMS.

    Passes when |a - b| <= atol * rms(b) + rtol * |b| everywhere and nothing is NaN/inf. Works in
    chunks so 7.5 GB tensors need no full-size temporaries. Layout differences are noted.
    """
    import torch

    if tuple(actual.shape) != tuple(expected.shape):
        note = f"shape {tuple(actual.shape)} != torch's {tuple(expected.shape)}"
        return TensorCheck(name, math.inf, math.inf, False, note)
    if actual.dtype != expected.dtype:
        note = f"dtype {actual.dtype} != torch's {expected.dtype}"
        return TensorCheck(name, math.inf, math.inf, False, note)
    note = ""
    if actual.numel() > 1 and actual.stride() != expected.stride():
        note = f"strides {actual.stride()} differ from torch's {expected.stride()}"
    flat_actual, flat_expected = _flatten_in_same_order(actual.detach(), expected.detach())
    numel = flat_expected.numel()
    if numel == 0:
        return TensorCheck(name, 0.0, 0.0, True, note)
    sum_of_squares = torch.zeros((), dtype=torch.float64, device=expected.device)
    for start in range(0, numel, COMPARE_CHUNK_ELEMENTS):
        chunk = flat_expected[start : start + COMPARE_CHUNK_ELEMENTS].double()
        sum_of_squares += chunk.square().sum()
    rms = math.sqrt(float(sum_of_squares) / numel)
    scale = rms if math.isfinite(rms) and rms > 0 else 1.0
    max_abs = torch.zeros((), dtype=torch.float64, device=expected.device)
    worst = torch.zeros((), dtype=torch.float64, device=expected.device)
    for start in range(0, numel, COMPARE_CHUNK_ELEMENTS):
        a = flat_actual[start : start + COMPARE_CHUNK_ELEMENTS].double()
        b = flat_expected[start : start + COMPARE_CHUNK_ELEMENTS].double()
        difference = (a - b).abs()
        allowed = b.abs().mul_(tolerance.rtol).add_(tolerance.atol * scale)
        # torch.maximum and max() propagate NaN, so a NaN anywhere fails the check.
        max_abs = torch.maximum(max_abs, difference.max())
        worst = torch.maximum(worst, (difference / allowed).max())
    max_abs_error = float(max_abs)
    worst_ratio = float(worst)
    ok = math.isfinite(worst_ratio) and worst_ratio <= 1.0
    return TensorCheck(name, max_abs_error, worst_ratio, ok, note)


# ------------------------------------------------------------------------------------------------
# Reference models of seed 002 (defined on first use: they need torch)
# ------------------------------------------------------------------------------------------------

_SEED002_CLASSES: dict[str, type] = {}


def _seed002_module_classes() -> dict[str, type]:
    """Seed002Tail (eager tail), Seed002Model (eager model), Seed002ModelCupynorm."""
    if _SEED002_CLASSES:
        return _SEED002_CLASSES
    from torch import nn

    class Seed002Tail(nn.Module):
        """Seed 002's epilogue in eager torch: instance norm over each row, then (x + y) * y."""

        def __init__(self, features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
            super().__init__()
            self.instance_norm = nn.InstanceNorm2d(features, eps=eps, momentum=momentum)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = self.instance_norm(x.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
            x = x + y
            return x * y

    class Seed002Model(nn.Module):
        """Seed 002 (KernelBench level 2, 28): Linear, row instance norm, + y, * y."""

        def __init__(
            self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1
        ) -> None:
            super().__init__()
            self.bmm = nn.Linear(in_features, out_features)
            self.instance_norm = nn.InstanceNorm2d(out_features, eps=eps, momentum=momentum)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = self.bmm(x)
            x = self.instance_norm(x.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
            x = x + y
            return x * y

    class Seed002ModelCupynorm(nn.Module):
        """Seed 002 with the tail fused by `cupynorm.torch.row_norm_add_mul`."""

        def __init__(
            self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1
        ) -> None:
            super().__init__()
            cupynorm_torch = importlib.import_module("cupynorm.torch")
            self.bmm = nn.Linear(in_features, out_features)
            self.eps = eps
            self._row_norm_add_mul = cupynorm_torch.row_norm_add_mul

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self._row_norm_add_mul(self.bmm(x), y, eps=self.eps)

    _SEED002_CLASSES.update(
        Seed002Tail=Seed002Tail,
        Seed002Model=Seed002Model,
        Seed002ModelCupynorm=Seed002ModelCupynorm,
    )
    return _SEED002_CLASSES


# ------------------------------------------------------------------------------------------------
# Running one workload
# ------------------------------------------------------------------------------------------------


@dataclass
class RunContext:
    """Settings shared by all workloads of one run."""

    quick: bool
    compile_enabled: bool
    fixed_reps: int | None
    flush_buffer: Any  # torch.Tensor
    budget: TimingBudget


def _error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def _perturb_affine_and_running_stats(module: torch.nn.Module, seed: int) -> None:
    """Make 1-D parameters and running statistics non-trivial, so the check covers them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.dim() == 1 and parameter.is_floating_point():
                noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
                parameter.add_(0.1 * noise)
        for name, buffer in module.named_buffers():
            if name.endswith("running_mean"):
                buffer.add_(0.1 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("running_var"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))


def _make_inputs(workload: Workload, quick: bool, device: Any, seed: int) -> list[torch.Tensor]:
    """Uniform [0, 1) inputs (like KernelBench's torch.rand), allocated in their final layout."""
    import torch

    dtype = _torch_dtype(workload.dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = []
    for shape in workload.shapes(quick):
        memory_format = torch.contiguous_format
        if workload.channels_last and len(shape) == 4:
            memory_format = torch.channels_last
        tensor = torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format)
        tensor.uniform_(0.0, 1.0, generator=generator)
        inputs.append(tensor)
    if workload.backward:
        inputs[0].requires_grad_(True)
    return inputs


def _make_step(
    module: Any,
    inputs: Sequence[torch.Tensor],
    grad_output: torch.Tensor | None,
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """The timed call: forward, or forward + backward (gradients returned, never accumulated)."""
    import torch

    if grad_output is None:

        def forward() -> tuple[torch.Tensor, ...]:
            return (module(*inputs),)

        return forward

    grad_targets = [t for t in inputs if t.requires_grad]
    grad_targets += [p for p in module.parameters() if p.requires_grad]

    def forward_backward() -> tuple[torch.Tensor, ...]:
        output = module(*inputs)
        grads = torch.autograd.grad(output, grad_targets, grad_outputs=grad_output)
        return (output, *grads)

    return forward_backward


def _step_output_names(
    module: torch.nn.Module, inputs: Sequence[torch.Tensor], backward: bool
) -> list[str]:
    """Names of the tensors `_make_step`'s call returns, in order."""
    names = ["y"]
    if backward:
        names += ["dx" if i == 0 else f"dinput{i}" for i, t in enumerate(inputs) if t.requires_grad]
        names += [f"d{name}" for name, p in module.named_parameters() if p.requires_grad]
    return names


def _run_and_collect(
    module: torch.nn.Module,
    step: Callable[[], tuple[torch.Tensor, ...]],
    inputs: Sequence[torch.Tensor],
    workload: Workload,
) -> dict[str, torch.Tensor]:
    """One call; its outputs and gradients by name, plus floating buffers after the call."""
    import torch

    with torch.set_grad_enabled(workload.backward):
        values = step()
    torch.cuda.synchronize()
    names = _step_output_names(module, inputs, workload.backward)
    if len(names) != len(values):
        raise RuntimeError(f"expected {len(names)} results ({', '.join(names)}), got {len(values)}")
    collected = {name: value.detach() for name, value in zip(names, values, strict=True)}
    for name, buffer in module.named_buffers():
        if buffer.is_floating_point():
            collected[f"{name} after one call"] = buffer.detach().clone()
    return collected


def _check_cupynorm(
    eager_values: dict[str, torch.Tensor],
    cupynorm_values: dict[str, torch.Tensor],
    tolerance: Tolerance,
) -> list[TensorCheck]:
    checks = []
    for name, expected in eager_values.items():
        actual = cupynorm_values.get(name)
        if actual is None:
            checks.append(TensorCheck(name, math.inf, math.inf, False, "missing in cupynorm"))
            continue
        checks.append(compare_tensors(name, actual, expected, tolerance))
    return checks


def _check_phase(
    eager_module: torch.nn.Module,
    cupynorm_module: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    grad_output: torch.Tensor | None,
    workload: Workload,
) -> list[TensorCheck]:
    """One call of each module on the same inputs; cupynorm's results checked against eager's.

    A function of its own so the full-size outputs are freed when it returns (or raises).
    """
    expected = _run_and_collect(
        eager_module, _make_step(eager_module, inputs, grad_output), inputs, workload
    )
    actual = _run_and_collect(
        cupynorm_module, _make_step(cupynorm_module, inputs, grad_output), inputs, workload
    )
    return _check_cupynorm(expected, actual, TOLERANCES[workload.dtype])


def _measure(
    step: Callable[[], object], workload: Workload, context: RunContext, impl: str
) -> ImplResult:
    """Time an implementation whose first call (compile) already happened; peak extra memory."""
    import torch

    result = ImplResult(impl=impl)
    with torch.set_grad_enabled(workload.backward):
        if workload.measure == "overhead":
            trials = context.fixed_reps or context.budget.overhead_trials
            per_call = time_per_call_ms(step, calls=context.budget.overhead_calls, trials=trials)
            result.reps = trials
            times = per_call
        else:
            flush = context.flush_buffer
            if context.fixed_reps is not None:
                reps = context.fixed_reps
                times = time_cuda_ms(step, reps=reps, flush_buffer=flush)
            else:
                estimate = time_cuda_ms(step, reps=ESTIMATE_REPS, flush_buffer=flush)
                reps = choose_reps(statistics.median(estimate), context.budget)
                times = time_cuda_ms(step, reps=reps, warmup=0, flush_buffer=flush)
            result.reps = reps
        result.ms = statistics.median(times)
        result.min_ms = min(times)
        result.max_ms = max(times)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        outputs = step()
        torch.cuda.synchronize()
        result.peak_extra_bytes = max(0, torch.cuda.max_memory_allocated() - baseline)
        del outputs
    return result


def _time_safely(
    impl: str,
    make_step: Callable[[], Callable[[], object]],
    workload: Workload,
    context: RunContext,
) -> ImplResult:
    """Build, first-call (compile), and time one implementation; an exception becomes the row's
    error instead of stopping the run."""
    import torch

    try:
        step = make_step()
        with torch.set_grad_enabled(workload.backward):
            started = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - started
        result = _measure(step, workload, context, impl)
        if impl == IMPL_COMPILE:
            result.compile_s = first_call_s
        return result
    except Exception as exc:  # noqa: BLE001 - any failure of one implementation is reported
        message = _error_text(exc)
        _progress(f"    {impl} failed: {message}")
        if impl == IMPL_CUPYNORM:
            traceback.print_exc(file=sys.stderr)
        return ImplResult(impl=impl, error=message)


def run_workload(workload: Workload, context: RunContext) -> WorkloadResult:
    """Check cupynorm against torch eager, then time eager, torch.compile and cupynorm."""
    import torch

    result = WorkloadResult(workload=workload, quick=context.quick)
    device = _device()
    dtype = _torch_dtype(workload.dtype)
    try:
        torch.manual_seed(0)
        eager_module = workload.eager.build()
        _perturb_affine_and_running_stats(eager_module, seed=1)
        cupynorm_module: torch.nn.Module | None = None
        cupynorm_error: str | None = None
        try:
            torch.manual_seed(0)
            cupynorm_module = workload.cupynorm.build()
            cupynorm_module.load_state_dict(eager_module.state_dict())
            cupynorm_module.to(device=device, dtype=dtype).train()
        except Exception as exc:  # noqa: BLE001 - reported as cupynorm's error
            cupynorm_error = "building the module failed: " + _error_text(exc)
            traceback.print_exc(file=sys.stderr)
            cupynorm_module = None
        eager_module.to(device=device, dtype=dtype).train()
        inputs = _make_inputs(workload, context.quick, device, seed=2)
        grad_output = None
        if workload.backward:
            generator = torch.Generator(device=device).manual_seed(3)
            grad_output = torch.empty_like(inputs[0]).normal_(generator=generator)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: report and go on
        result.error = "setup failed: " + _error_text(exc)
        traceback.print_exc(file=sys.stderr)
        return result

    # 1. Correctness, before any timing (BatchNorm's running stats start equal in both modules).
    if cupynorm_module is not None:
        try:
            result.checks = _check_phase(
                eager_module, cupynorm_module, inputs, grad_output, workload
            )
        except Exception as exc:  # noqa: BLE001 - reported as cupynorm's error
            cupynorm_error = "running it failed: " + _error_text(exc)
            traceback.print_exc(file=sys.stderr)
        for check in result.checks:
            status = "ok" if check.ok else "WRONG"
            line = (
                f"    check {check.name}: {status} (max abs error {check.max_abs_error:.3g}, "
                f"{check.worst_ratio:.3g} of the tolerance)"
            )
            if check.note:
                line += f"; {check.note}"
            _progress(line)
        if result.cupynorm_wrong:
            _progress(f"!!! cupynorm is WRONG on {workload.name}: see the checks above !!!")
            wrong = [c for c in result.checks if not c.ok]
            cupynorm_error = "WRONG: " + "; ".join(
                f"{c.name} max abs error {c.max_abs_error:.3g} {c.note}".strip() for c in wrong
            )

    # 2. Timing: eager, torch.compile, cupynorm.
    result.impls.append(
        _time_safely(
            IMPL_EAGER, lambda: _make_step(eager_module, inputs, grad_output), workload, context
        )
    )
    if context.compile_enabled:

        def make_compiled_step() -> Callable[[], object]:
            compiled = torch.compile(eager_module)
            return _make_step(compiled, inputs, grad_output)

        result.impls.append(_time_safely(IMPL_COMPILE, make_compiled_step, workload, context))
    if cupynorm_error is not None or cupynorm_module is None:
        result.impls.append(ImplResult(impl=IMPL_CUPYNORM, error=cupynorm_error or "not built"))
    else:
        module = cupynorm_module
        result.impls.append(
            _time_safely(
                IMPL_CUPYNORM, lambda: _make_step(module, inputs, grad_output), workload, context
            )
        )
    return result


def _release_device_memory() -> None:
    """Drop compiled graphs and cached blocks between workloads (the big inputs are 7.5 GB)."""
    import torch

    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 - best effort
        pass
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _environment(torch_module: ModuleType) -> dict[str, Any]:
    """GPU name, date and versions for the JSON report."""
    try:
        cupy_version: str | None = importlib.import_module("cupy").__version__
    except Exception:  # noqa: BLE001 - CuPy missing is reported as None
        cupy_version = None
    cupynorm_version = getattr(sys.modules.get("cupynorm"), "__version__", None)
    props = torch_module.cuda.get_device_properties(torch_module.cuda.current_device())
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch_module.cuda.get_device_name(),
        "gpu_memory_bytes": int(props.total_memory),
        "l2_cache_bytes": int(getattr(props, "L2_cache_size", 0) or 0),
        "torch": torch_module.__version__,
        "torch_cuda": torch_module.version.cuda,
        "cupy": cupy_version,
        "cupynorm": cupynorm_version,
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `python -m cupynorm bench`."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller shapes (1/4 of the batch for the 7.5 GB workloads) and fewer repetitions",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only these workloads (repeatable, or a comma list); see --list",
    )
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    parser.add_argument("--json", metavar="PATH", help="write all numbers and the environment")
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG bar chart of TB/s (needs matplotlib)"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument(
        "--reps",
        type=_positive_int,
        metavar="N",
        help=(
            "repetitions per implementation (module_overhead: trials of back-to-back calls); "
            "default: enough to fill a time budget"
        ),
    )


def build_bench_parser() -> argparse.ArgumentParser:
    """A stand-alone parser for the bench options (the CLI adds them to its `bench` command)."""
    parser = argparse.ArgumentParser(prog="cupynorm bench", description=__doc__)
    add_bench_arguments(parser)
    return parser


def format_workload_list() -> str:
    """`--list` output: name, title, shapes and goal of every workload."""
    lines = []
    for w in WORKLOADS:
        shapes = ", ".join(_shape_text(s) for s in w.input_shapes)
        goal = f"goal {w.goal_ms} ms on H200" if w.goal_ms is not None else f"goal {w.goal_text}"
        lines.append(f"{w.name:36s} {w.title} [{shapes} {w.dtype}; {goal}]")
    return "\n".join(lines)


def _import_torch_with_cuda() -> tuple[ModuleType | None, str | None]:
    """torch, or a message saying why the benchmark cannot run here."""
    try:
        import torch
    except ImportError as exc:
        return None, (f"PyTorch is needed ({exc}); install it, e.g. pip install 'cupynorm[torch]'")
    if not torch.cuda.is_available():
        return None, (
            "a CUDA GPU is needed, and torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "Run it on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
    return torch, None


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed `bench` arguments; returns the exit code."""
    try:
        workloads = select_workloads(args.only)
    except ValueError as exc:
        print(f"cupynorm bench: {exc}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    if args.list:
        print(format_workload_list())
        return EXIT_OK
    torch, problem = _import_torch_with_cuda()
    if torch is None:
        print(f"cupynorm bench: {problem}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    want_plot = args.plot is not None
    if want_plot and not matplotlib_available():
        print(
            "cupynorm bench: --plot needs matplotlib, which is not installed "
            "(pip install matplotlib); running without the plot.",
            file=sys.stderr,
        )
        want_plot = False

    environment = _environment(torch)
    gpu_name = environment["gpu"]
    _progress(
        f"cupynorm bench on {gpu_name}: torch {environment['torch']}, cupy {environment['cupy']}, "
        f"{'quick' if args.quick else 'full'} run, {len(workloads)} workload(s)"
    )
    copy_tbps = measure_copy_bandwidth_tbps()
    torch.cuda.empty_cache()
    _progress(f"copy bandwidth: {copy_tbps:.2f} TB/s")
    context = RunContext(
        quick=args.quick,
        compile_enabled=not args.no_compile,
        fixed_reps=args.reps,
        flush_buffer=make_l2_flush_buffer(),
        budget=QUICK_BUDGET if args.quick else FULL_BUDGET,
    )
    results: list[WorkloadResult] = []
    with warnings.catch_warnings():
        # Seed 002 calls InstanceNorm2d(8192) on (N, 1, 1, 8192): torch warns that C != 8192.
        warnings.filterwarnings("ignore", message="input's size at dim=")
        for index, workload in enumerate(workloads, start=1):
            shapes = ", ".join(_shape_text(s) for s in workload.shapes(args.quick))
            _progress(f"[{index}/{len(workloads)}] {workload.name}: {workload.title} ({shapes})")
            started = time.perf_counter()
            try:
                result = run_workload(workload, context)
            except Exception as exc:  # noqa: BLE001 - e.g. a broken CUDA context: keep reporting
                traceback.print_exc(file=sys.stderr)
                result = WorkloadResult(workload, args.quick, error=_error_text(exc))
            result.seconds = time.perf_counter() - started
            results.append(result)
            summary = ", ".join(
                f"{impl.impl} {_format_ms(impl.ms)} ms"
                if impl.ms is not None
                else f"{impl.impl} ERROR"
                for impl in result.impls
            )
            _progress(
                f"[{index}/{len(workloads)}] {workload.name} done in {result.seconds:.1f} s: "
                f"{summary or result.error}"
            )
            del result
            try:
                _release_device_memory()
            except Exception as exc:  # noqa: BLE001 - the next workload reports the failure
                _progress(f"    releasing device memory failed: {_error_text(exc)}")

    failures = [r for r in results if r.failed]
    exit_code = EXIT_FAILED if failures else EXIT_OK
    if args.json:
        report = results_to_json(
            results,
            environment=environment,
            copy_tbps=copy_tbps,
            quick=args.quick,
            exit_code=exit_code,
        )
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _progress(f"wrote {args.json}")
    if want_plot:
        try:
            plot_results(results, copy_tbps, args.plot)
            _progress(f"wrote {args.plot}")
        except Exception as exc:  # noqa: BLE001 - the plot is optional
            _progress(f"could not write the plot: {_error_text(exc)}")
    if failures:
        _progress("")
        _progress("!" * 100)
        for result in failures:
            cupynorm = result.impl(IMPL_CUPYNORM)
            reason = result.error or (cupynorm.error if cupynorm else None) or "cupynorm failed"
            _progress(f"FAILED {result.workload.name}: {reason}")
        _progress("!" * 100)
    print(format_notes(results, copy_tbps, gpu_name, args.quick))
    print()
    print(format_markdown_table(results, copy_tbps, gpu_name), flush=True)
    return exit_code


# ------------------------------------------------------------------------------------------------
# Driver of the KernelBench-style examples (examples/*.py call this from `__main__`)
# ------------------------------------------------------------------------------------------------


def run_example_cli(example: ModuleType, argv: Sequence[str] | None = None) -> int:
    """Compare an example's `ModelNew` with its `Model` and time both.

    The example module defines `Model`, `ModelNew`, `get_inputs()`, `get_init_inputs()` and a
    module-level `batch_size` that `get_inputs` reads (so `--batch` can shrink it). Both models are
    built from the same seed, ModelNew loads Model's state_dict, both run (training mode, no grad)
    on fresh inputs; prints the max abs error and the median CUDA-event times with L2 flushed.
    Returns 0 when the outputs agree (atol = rtol = 1e-4 after normalizing), 1 when not, 2 without
    a CUDA GPU.
    """
    name = Path(getattr(example, "__file__", None) or "example").name
    parser = argparse.ArgumentParser(
        prog=name,
        description=(
            "Check ModelNew (cupynorm) against Model (torch.nn) on fresh inputs and time both "
            "(median of CUDA-event times, L2 flushed before each repetition)."
        ),
    )
    parser.add_argument("--batch", type=_positive_int, help="batch size (default: the file's)")
    parser.add_argument("--reps", type=_positive_int, default=20, help="timed repetitions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    args = parser.parse_args(argv)

    torch, problem = _import_torch_with_cuda()
    if torch is None:
        print(f"{name}: {problem}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    if args.batch is not None:
        example.batch_size = args.batch

    torch.manual_seed(args.seed)
    model = example.Model(*example.get_init_inputs()).cuda()
    torch.manual_seed(args.seed)
    model_new = example.ModelNew(*example.get_init_inputs()).cuda()
    model_new.load_state_dict(model.state_dict())
    torch.manual_seed(args.seed + 1)
    inputs = example.get_inputs()
    shapes = ", ".join(_shape_text(tuple(t.shape)) for t in inputs)
    print(f"{name}: inputs {shapes} on {torch.cuda.get_device_name()}")

    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message="input's size at dim=")
        expected = model(*inputs)
        actual = model_new(*inputs)
        check = compare_tensors("output", actual, expected, Tolerance(atol=1e-4, rtol=1e-4))
        del expected, actual
        print(
            f"max abs error vs Model: {check.max_abs_error:.3e} "
            f"({'ok' if check.ok else 'WRONG'}, {check.worst_ratio:.3g} of atol=rtol=1e-4"
            f"{'; ' + check.note if check.note else ''})"
        )
        flush = make_l2_flush_buffer()
        model_ms = statistics.median(
            time_cuda_ms(lambda: model(*inputs), reps=args.reps, flush_buffer=flush)
        )
        model_new_ms = statistics.median(
            time_cuda_ms(lambda: model_new(*inputs), reps=args.reps, flush_buffer=flush)
        )
    print(f"Model    (torch):    {model_ms:.4f} ms  (median of {args.reps}, L2 flushed)")
    print(f"ModelNew (cupynorm): {model_new_ms:.4f} ms  ({model_ms / model_new_ms:.2f}x)")
    return EXIT_OK if check.ok else EXIT_FAILED
