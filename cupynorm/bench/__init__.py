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

Importing this package is cheap: torch, CuPy and cupynorm's kernels are imported only when a
benchmark runs.
"""

from __future__ import annotations

# Modules: workloads (what each row runs), timing (the device facade, CUDA-event timing, L2
# flush, copy bandwidth), checking (cupynorm vs torch), run (one workload), results, report
# (table, notes, JSON, plot), models (models the bench defines), cli (the command line and the
# examples' driver). The names below are the package's public surface.
from .checking import TOLERANCES, TensorCheck, Tolerance, compare_tensors
from .cli import (
    EXIT_ENVIRONMENT,
    EXIT_FAILED,
    EXIT_OK,
    add_bench_arguments,
    build_bench_parser,
    format_workload_list,
    run_bench,
    run_example_cli,
)
from .report import (
    TABLE_COLUMNS,
    format_markdown_table,
    format_notes,
    matplotlib_available,
    plot_results,
    results_to_json,
    speedup,
    table_rows,
)
from .results import (
    IMPL_COMPILE,
    IMPL_CUPYNORM,
    IMPL_EAGER,
    IMPLEMENTATIONS,
    ImplResult,
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
from .workloads import (
    H200_COPY_TBPS,
    ITEMSIZE,
    WORKLOADS,
    WORKLOADS_BY_NAME,
    ModuleSpec,
    Workload,
    bytes_moved,
    goal_ms_for_run,
    select_workloads,
    shape_text,
)

__all__ = [
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
    "PER_REP_OVERHEAD_MS",
    "QUICK_BUDGET",
    "TABLE_COLUMNS",
    "TOLERANCES",
    "WORKLOADS",
    "WORKLOADS_BY_NAME",
    "CudaDevice",
    "ImplResult",
    "ModuleSpec",
    "RunContext",
    "TensorCheck",
    "TimingBudget",
    "Tolerance",
    "Workload",
    "WorkloadResult",
    "add_bench_arguments",
    "build_bench_parser",
    "bytes_moved",
    "choose_reps",
    "compare_tensors",
    "format_markdown_table",
    "format_notes",
    "format_workload_list",
    "goal_ms_for_run",
    "l2_flush_bytes",
    "make_l2_flush_buffer",
    "matplotlib_available",
    "measure_copy_bandwidth_tbps",
    "plot_results",
    "results_to_json",
    "run_bench",
    "run_example_cli",
    "run_workload",
    "select_workloads",
    "shape_text",
    "speedup",
    "table_rows",
    "throughput_tbps",
    "time_cuda_ms",
    "time_per_call_ms",
]
