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
  the repetitions is reported. Forward rows time the GPU alone: a 0.5 ms spin kernel is queued
  before each repetition, so the host has queued the call before the GPU reaches the first
  event, however slow the host (its time per call is `module_overhead`'s and `profile calls`');
  forward + backward rows time the call as a user's loop runs it, the host's share included.
  Host-overhead rows (`module_overhead`) time many back-to-back calls
  between one pair of events and report the time per call.
* TB/s counts `tensor_passes` passes over the big tensor(s) (for example forward: read x, write y;
  forward+backward: read x, write y, read x, read dy, write dx = 5 passes) divided by the median
  time, and is also given as a percentage of the measured device-to-device copy bandwidth.
* fp16 workloads convert the whole module (parameters and running statistics too) to fp16, for
  all three implementations alike. Inputs are torch.rand (uniform [0, 1)), as in KernelBench.

The models group (`--only models`, run only when named; a group name like any workload name):
whole training steps (zero_grad, forward, loss, backward, SGD step) of torchvision's resnet50
(BatchNorm2d; bf16 autocast, channels_last, batch 64 and 256), of timm's efficientnet_b0 (49
BatchNormAct2d) and mobilenetv3_large_100 (46 BatchNormAct2d; both bf16 autocast,
channels_last, batch 64), of timm's convnext_tiny (23 LayerNorm;
bf16 autocast, channels_last, batch 64; converted with `replace_norms(include=[nn.LayerNorm])`),
of 4 diffusers-style ResNet blocks (GroupNorm(32, 320); fp16, 16x320x64x64, channels_last and
NCHW) and of a transformers Llama decoder (its RMSNorm layers converted), each with torch's norm
layers and with `cupynorm.torch.fuse` of a copy (unless the row says otherwise), from the same
weights on the same batch, in four modes: eager, graphed (the whole step captured in one CUDA
graph), compile (`torch.compile(model)`) and reduce-overhead (`torch.compile(model,
mode="reduce-overhead")`: Inductor's CUDA graphs). Per row: step ms (median, CUDA events around
whole steps) and the speedup over torch in the same mode; eager rows add GPU kernel and
norm-kernel ms per step and kernel launches per norm layer (torch.profiler), the host time to
issue a step and, from it less that of the model with its norm layers replaced by nn.Identity,
the host time per norm layer (forward + backward). Before timing, the output and input
gradient in fp32 (TF32 off) are compared with torch in float64: cupynorm fails the row when its
error is above 2x torch's. See `cupynorm.bench.train`. `--aa` runs the chosen model rows with
torch's model on both sides (rows named NAME_aa): how far a cell of two identical models moves;
`--cupynorm-first` builds and times cupynorm's model (or the A/A twin) first (rows NAME_cf):
whether the order of the two moves a cell. `--modes compile,reduce-overhead` (any of eager,
graphed, compile, reduce-overhead) runs only those modes of the model rows.

Output: one progress line per workload (and every check) on stderr; then notes and a markdown
table on stdout, last; the models group has a table of its own after the kernel table.
`--json FILE` writes every number and the environment; `--markdown FILE` the results page
(benchmarks/RESULTS.md's layout) of the run, and `python -m cupynorm report --markdown FILE
a.json b.json ...` that of several runs' JSON files merged.

Exit codes: 0 all good; 1 cupynorm wrong, less accurate or failing (or a workload could not be
set up); 2 no torch / no CUDA GPU / bad arguments. A model row whose model needs a package that
is not installed (torchvision, timm, transformers) is skipped, and says so: it fails nothing.

Importing this package is cheap: torch, CuPy and cupynorm's kernels are imported only when a
benchmark runs.
"""

from __future__ import annotations

# Modules: specs (the rows' dataclasses), workloads (the rows), timing (the device facade,
# CUDA-event timing, L2 flush, copy bandwidth), checking (cupynorm vs torch), run (one kernel
# row), models (the modules and models the bench builds), trainstep (a model row's training
# step), train (the models group), results, report (tables, notes, JSON, plot), markdown (the
# results page from JSON files), cli (the command lines and the examples' driver), profile
# (`python -m cupynorm profile`: where the time goes). The names below are the public surface.
from .checking import TOLERANCES, TensorCheck, Tolerance, compare_tensors
from .cli import (
    EXIT_ENVIRONMENT,
    EXIT_FAILED,
    EXIT_OK,
    REPORT_DESCRIPTION,
    add_bench_arguments,
    add_report_arguments,
    build_bench_parser,
    format_workload_list,
    run_bench,
    run_example_cli,
    run_report,
)
from .report import (
    MODEL_TABLE_COLUMNS,
    TABLE_COLUMNS,
    format_markdown_table,
    format_models_notes,
    format_models_table,
    format_notes,
    matplotlib_available,
    models_to_json,
    plot_results,
    results_to_json,
    speedup,
    table_rows,
)
from .results import (
    COMPILED_MODES,
    IMPL_COMPILE,
    IMPL_CUPYNORM,
    IMPL_EAGER,
    IMPLEMENTATIONS,
    MODE_COMPILE,
    MODE_EAGER,
    MODE_GRAPHED,
    MODE_REDUCE_OVERHEAD,
    MODEL_CUPYNORM,
    MODEL_TORCH,
    MODES,
    AccuracyCheck,
    ImplResult,
    ModelResult,
    StepResult,
    WorkloadResult,
)
from .run import RunContext, run_workload
from .timing import (
    FULL_BUDGET,
    PER_REP_OVERHEAD_MS,
    QUICK_BUDGET,
    CudaDevice,
    TimingBudget,
    choose_reps,
    l2_flush_bytes,
    make_l2_flush_buffer,
    measure_copy_bandwidth_tbps,
    throughput_tbps,
    time_cuda_ms,
    time_per_call_ms,
)
from .train import run_model_workload
from .workloads import (
    H200_COPY_TBPS,
    ITEMSIZE,
    MODEL_WORKLOADS,
    MODEL_WORKLOADS_BY_NAME,
    WORKLOADS,
    WORKLOADS_BY_NAME,
    ModelWorkload,
    ModuleSpec,
    Workload,
    bytes_moved,
    goal_ms_for_run,
    select_workloads,
    shape_text,
    workload_groups,
)

__all__ = [
    "COMPILED_MODES",
    "EXIT_ENVIRONMENT",
    "EXIT_FAILED",
    "EXIT_OK",
    "FULL_BUDGET",
    "H200_COPY_TBPS",
    "IMPLEMENTATIONS",
    "IMPL_COMPILE",
    "IMPL_CUPYNORM",
    "IMPL_EAGER",
    "ITEMSIZE",
    "MODEL_CUPYNORM",
    "MODEL_TABLE_COLUMNS",
    "MODEL_TORCH",
    "MODEL_WORKLOADS",
    "MODEL_WORKLOADS_BY_NAME",
    "MODES",
    "MODE_COMPILE",
    "MODE_EAGER",
    "MODE_GRAPHED",
    "MODE_REDUCE_OVERHEAD",
    "REPORT_DESCRIPTION",
    "PER_REP_OVERHEAD_MS",
    "QUICK_BUDGET",
    "TABLE_COLUMNS",
    "TOLERANCES",
    "WORKLOADS",
    "WORKLOADS_BY_NAME",
    "AccuracyCheck",
    "add_bench_arguments",
    "add_report_arguments",
    "build_bench_parser",
    "bytes_moved",
    "choose_reps",
    "compare_tensors",
    "CudaDevice",
    "format_markdown_table",
    "format_models_notes",
    "format_models_table",
    "format_notes",
    "format_workload_list",
    "goal_ms_for_run",
    "ImplResult",
    "l2_flush_bytes",
    "make_l2_flush_buffer",
    "matplotlib_available",
    "measure_copy_bandwidth_tbps",
    "ModelResult",
    "models_to_json",
    "ModelWorkload",
    "ModuleSpec",
    "plot_results",
    "results_to_json",
    "run_bench",
    "run_example_cli",
    "run_report",
    "run_model_workload",
    "run_workload",
    "RunContext",
    "select_workloads",
    "shape_text",
    "speedup",
    "StepResult",
    "table_rows",
    "TensorCheck",
    "throughput_tbps",
    "time_cuda_ms",
    "time_per_call_ms",
    "TimingBudget",
    "Tolerance",
    "Workload",
    "workload_groups",
    "WorkloadResult",
]
