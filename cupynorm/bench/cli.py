"""The command line: `python -m cupynorm bench` (arguments, the run, the report) and the driver
of the KernelBench-style examples."""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from . import markdown, timing, train, workloads
from .checking import Tolerance, compare_tensors
from .report import (
    format_markdown_table,
    format_models_notes,
    format_models_table,
    format_ms,
    format_notes,
    matplotlib_available,
    plot_results,
    results_to_json,
)
from .results import IMPL_CUPYNORM, MODES, ModelResult, WorkloadResult
from .run import (
    RunContext,
    _error_text,
    _progress,
    _release_device_memory,
    run_workload,
)
from .timing import make_l2_flush_buffer, measure_copy_bandwidth_tbps, time_cuda_ms
from .workloads import ModelWorkload, Workload, shape_text

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ENVIRONMENT = 2


def _routing() -> dict[str, Any] | None:
    """Where cupynorm.torch's calls run in this process, as the model rows run them (the kernel
    rows put every eager call on the kernels): the eager sizes and the adaptive choice, the
    capture sizes, the kinds on the kernels inside torch.compile; None without cupynorm.torch."""
    try:
        import cupynorm.torch as cnt
        from cupynorm.torch import _policy
    except ImportError:
        return None
    return {
        "eager_min_bytes": cnt.eager_min_bytes(),
        "eager_adaptive": _policy.EAGER_ADAPTIVE[0],
        "capture_min_bytes": cnt.capture_min_bytes(),
        "compile_kernels": sorted(cnt.compile_kernels()),
    }


def _environment(torch_module: ModuleType) -> dict[str, Any]:
    """GPU name, date, versions and cupynorm's routing (:func:`_routing`) for the JSON report."""
    try:
        cupy_version: str | None = importlib.import_module("cupy").__version__
    except Exception:  # noqa: BLE001 - CuPy missing is reported as None
        cupy_version = None
    cupynorm_version = getattr(sys.modules.get("cupynorm"), "__version__", None)
    try:  # the models group's resnet50 rows need it; read without importing it
        torchvision_version: str | None = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        torchvision_version = None
    props = timing.cuda.properties()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": timing.cuda.name(),
        "gpu_memory_bytes": int(props.total_memory),
        "l2_cache_bytes": int(getattr(props, "L2_cache_size", 0) or 0),
        "torch": torch_module.__version__,
        "torch_cuda": torch_module.version.cuda,
        "cupy": cupy_version,
        "cupynorm": cupynorm_version,
        "torchvision": torchvision_version,
        "python": platform.python_version(),
        "routing": _routing(),
    }


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
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
        help=(
            "run only these workloads (repeatable, or a comma list); a group name selects "
            "several: 'models' (whole training steps of real models, only run when named), "
            "'kernels' (the default set); see --list"
        ),
    )
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    parser.add_argument("--json", metavar="PATH", help="write all numbers and the environment")
    parser.add_argument(
        "--markdown",
        metavar="PATH",
        help=(
            "write the results page (benchmarks/RESULTS.md's layout) of this run; to merge "
            "several runs' --json files: python -m cupynorm report"
        ),
    )
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG bar chart of TB/s (needs matplotlib)"
    )
    parser.add_argument(
        "--aa",
        action="store_true",
        help=(
            "A/A run of the model rows: torch's model on both sides, built, compiled and timed "
            "as the converted one (rows named NAME_aa): how far a cell of identical models moves"
        ),
    )
    parser.add_argument(
        "--cupynorm-first",
        action="store_true",
        help=(
            "model rows: build and time cupynorm's model first, torch's second (rows named "
            "NAME_cf; with --aa, the twin first): whether the order of the two moves a cell"
        ),
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip torch.compile (the models group: both compiled modes)",
    )
    parser.add_argument(
        "--modes",
        type=model_modes,
        metavar="MODES",
        help=(
            "model rows: only these modes, a comma list of "
            + ", ".join(MODES)
            + " (default: every mode; a slow row's compiled cells alone, say)"
        ),
    )
    parser.add_argument(
        "--reps",
        type=positive_int,
        metavar="N",
        help=(
            "repetitions per implementation (module_overhead: trials of back-to-back calls; "
            "models: timed training steps per mode); default: enough to fill a time budget"
        ),
    )


def model_modes(text: str) -> tuple[str, ...]:
    """``--modes``: the model rows' modes named in ``text`` (comma-separated), in run order."""
    named = {m.strip() for m in text.split(",") if m.strip()}
    unknown = sorted(named - set(MODES))
    if unknown or not named:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(map(repr, unknown))}; expected a comma list of "
            f"{', '.join(MODES)}"
            if unknown
            else "no mode named"
        )
    return tuple(m for m in MODES if m in named)


def build_bench_parser() -> argparse.ArgumentParser:
    """A stand-alone parser for the bench options (the CLI adds them to its `bench` command)."""
    from cupynorm import bench

    parser = argparse.ArgumentParser(prog="cupynorm bench", description=bench.__doc__)
    add_bench_arguments(parser)
    return parser


def format_workload_list() -> str:
    """`--list` output: name, title, shapes and goal of every workload, then the models group."""
    lines = []
    for w in workloads.WORKLOADS:
        shapes = ", ".join(shape_text(s) for s in w.input_shapes)
        goal = f"goal {w.goal_ms} ms on H200" if w.goal_ms is not None else f"goal {w.goal_text}"
        lines.append(f"{w.name:36s} {w.title} [{shapes} {w.dtype}; {goal}]")
    lines.append("")
    lines.append(
        "group models (run only when named: --only models): whole training steps, "
        "eager / graphed / compile / reduce-overhead, torch's norms vs cupynorm's"
    )
    for m in workloads.MODEL_WORKLOADS:
        goal = f"; goal {m.goal_text}" if m.goal_text else ""
        lines.append(f"{m.name:36s} {m.title} [{m.describe_input()}{goal}]")
    lines.append("")
    groups = workloads.workload_groups()
    lines.append("groups: " + ", ".join(f"{name} ({len(names)})" for name, names in groups.items()))
    return "\n".join(lines)


def _import_torch_with_cuda() -> tuple[ModuleType | None, str | None]:
    """torch, or a message saying why the benchmark cannot run here."""
    try:
        import torch
    except ImportError as exc:
        return None, (f"PyTorch is needed ({exc}); install it, e.g. pip install 'cupynorm[torch]'")
    if not timing.cuda.is_available():
        return None, (
            "a CUDA GPU is needed, and torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "Run it on a machine with an NVIDIA GPU and a CUDA build of torch."
        )
    return torch, None


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed `bench` arguments; returns the exit code."""
    try:
        selected = workloads.select_workloads(args.only)
    except ValueError as exc:
        print(f"cupynorm bench: {exc}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    if args.list:
        print(format_workload_list())
        return EXIT_OK
    # the options that remake the model rows (an A/A twin, the build order): model rows only
    for option, asked, remake in (
        ("--aa", args.aa, ModelWorkload.as_twin),
        ("--cupynorm-first", args.cupynorm_first, ModelWorkload.built_cupynorm_first),
    ):
        if not asked:
            continue
        if not all(isinstance(w, ModelWorkload) for w in selected):
            print(f"cupynorm bench: {option} takes model rows only (--only models, or ROW names)",
                  file=sys.stderr)  # fmt: skip
            return EXIT_ENVIRONMENT
        selected = [remake(w) for w in selected]
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
        f"{'quick' if args.quick else 'full'} run, {len(selected)} workload(s)"
    )
    copy_tbps = measure_copy_bandwidth_tbps()
    timing.cuda.empty_cache()
    _progress(f"copy bandwidth: {copy_tbps:.2f} TB/s")
    needs_flush = any(not isinstance(w, ModelWorkload) for w in selected)
    context = RunContext(
        quick=args.quick,
        compile_enabled=not args.no_compile,
        model_modes=args.modes,
        fixed_reps=args.reps,
        # whole training steps are not L2-flushed: they are far larger than the L2
        flush_buffer=make_l2_flush_buffer() if needs_flush else None,
        budget=timing.QUICK_BUDGET if args.quick else timing.FULL_BUDGET,
    )
    results: list[WorkloadResult] = []
    model_results: list[ModelResult] = []

    def report_of(exit_code: int | None, models: list[ModelResult]) -> dict:
        return results_to_json(
            results,
            environment=environment,
            copy_tbps=copy_tbps,
            quick=args.quick,
            exit_code=exit_code,
            models=models,
        )

    def write_json(exit_code: int | None, running: ModelResult | None = None) -> None:
        """The run's JSON so far (``exit_code`` None; a model row in progress: ``running``),
        or at its end: a run stopped at a time limit keeps every row, and every mode of a
        model row, that it finished."""
        report = report_of(exit_code, model_results + ([] if running is None else [running]))
        if exit_code is None:
            report["partial"] = True
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

    if args.json:
        context.checkpoint = lambda running: write_json(None, running)
    with warnings.catch_warnings():
        # Seed 002 calls InstanceNorm2d(8192) on (N, 1, 1, 8192): torch warns that C != 8192.
        warnings.filterwarnings("ignore", message="input's size at dim=")
        for index, workload in enumerate(selected, start=1):
            counter = f"[{index}/{len(selected)}]"
            if isinstance(workload, ModelWorkload):
                model_results.append(_run_model(workload, context, counter))
            else:
                results.append(_run_kernel_workload(workload, context, counter))
            if args.json:
                write_json(None)
            try:
                _release_device_memory()
            except Exception as exc:  # noqa: BLE001 - the next workload reports the failure
                _progress(f"    releasing device memory failed: {_error_text(exc)}")

    failures = [r for r in results if r.failed]
    model_failures = [r for r in model_results if r.failed]
    exit_code = EXIT_FAILED if failures or model_failures else EXIT_OK
    if args.json:
        write_json(exit_code)
        _progress(f"wrote {args.json}")
    if args.markdown:
        name = Path(args.json).name if args.json else "this run"
        report = json.loads(json.dumps(report_of(exit_code, model_results)))
        Path(args.markdown).write_text(markdown.render(markdown.merge([(name, report)])))
        _progress(f"wrote {args.markdown}")
    if want_plot and results:
        try:
            plot_results(results, copy_tbps, args.plot)
            _progress(f"wrote {args.plot}")
        except Exception as exc:  # noqa: BLE001 - the plot is optional
            _progress(f"could not write the plot: {_error_text(exc)}")
    if failures or model_failures:
        _progress("")
        _progress("!" * 100)
        for result in failures:
            cupynorm = result.impl(IMPL_CUPYNORM)
            reason = result.error or (cupynorm.error if cupynorm else None) or "cupynorm failed"
            _progress(f"FAILED {result.workload.name}: {reason}")
        for model_result in model_failures:
            _progress(f"FAILED {model_result.workload.name}: {model_result.failure()}")
        _progress("!" * 100)
    if results:
        print(format_notes(results, copy_tbps, gpu_name, args.quick))
        print()
        print(format_markdown_table(results, copy_tbps, gpu_name), flush=True)
    if model_results:
        if results:
            print()
        print(format_models_notes(model_results, gpu_name))
        print()
        print(format_models_table(model_results), flush=True)
    return exit_code


REPORT_DESCRIPTION = """Render the results page (benchmarks/RESULTS.md) from JSON files.

The files are what `python -m cupynorm bench --json FILE` wrote (one per GPU call: the kernels,
the models group, ...) and what `scripts/bench_sync_batchnorm.py --json FILE` wrote (two GPUs).
Rows are merged by name, a later file's row replacing an earlier one's; the header names the GPU,
date and versions of every file. Needs neither torch nor a GPU.
"""


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `python -m cupynorm report`."""
    parser.add_argument("files", nargs="+", metavar="FILE.json", help="bench --json outputs")
    parser.add_argument(
        "--markdown", metavar="PATH", help="write the page here (default: print it)"
    )


def run_report(args: argparse.Namespace) -> int:
    """`python -m cupynorm report`: merge the JSON files, render, write or print."""
    try:
        page = markdown.render(markdown.load(args.files))
    except ValueError as exc:
        print(f"cupynorm report: {exc}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    if args.markdown:
        Path(args.markdown).write_text(page)
        print(f"wrote {args.markdown}", file=sys.stderr)
    else:
        print(page, end="")
    return EXIT_OK


def _run_kernel_workload(workload: Workload, context: RunContext, counter: str) -> WorkloadResult:
    """One workload of the kernel table, with its progress lines; never raises."""
    shapes = ", ".join(shape_text(s) for s in workload.shapes(context.quick))
    _progress(f"{counter} {workload.name}: {workload.title} ({shapes})")
    started = time.perf_counter()
    try:
        result = run_workload(workload, context)
    except Exception as exc:  # noqa: BLE001 - e.g. a broken CUDA context: keep reporting
        traceback.print_exc(file=sys.stderr)
        result = WorkloadResult(workload, context.quick, error=_error_text(exc))
    result.seconds = time.perf_counter() - started
    summary = ", ".join(
        f"{impl.impl} {format_ms(impl.ms)} ms" if impl.ms is not None else f"{impl.impl} ERROR"
        for impl in result.impls
    )
    _progress(
        f"{counter} {workload.name} done in {result.seconds:.1f} s: {summary or result.error}"
    )
    return result


def _run_model(workload: ModelWorkload, context: RunContext, counter: str) -> ModelResult:
    """One workload of the models group, with its progress lines; never raises."""
    _progress(f"{counter} {workload.name}: {workload.title} ({workload.describe_input()})")
    started = time.perf_counter()
    try:
        result = train.run_model_workload(workload, context)
    except Exception as exc:  # noqa: BLE001 - e.g. a broken CUDA context: keep reporting
        traceback.print_exc(file=sys.stderr)
        result = ModelResult(workload, context.quick, error=_error_text(exc))
    result.seconds = time.perf_counter() - started
    summary = ", ".join(
        f"{step.mode} {step.impl} {format_ms(step.ms)} ms"
        if step.ms is not None
        else f"{step.mode} {step.impl} ERROR"
        for step in result.steps
    )
    outcome = summary or result.error or f"skipped: {result.skipped}"
    _progress(f"{counter} {workload.name} done in {result.seconds:.1f} s: {outcome}")
    return result


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
    parser.add_argument("--batch", type=positive_int, help="batch size (default: the file's)")
    parser.add_argument("--reps", type=positive_int, default=20, help="timed repetitions")
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
    shapes = ", ".join(shape_text(tuple(t.shape)) for t in inputs)
    print(f"{name}: inputs {shapes} on {timing.cuda.name()}")

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
