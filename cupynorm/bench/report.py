"""Reporting a run: the markdown table, the notes above it, the JSON report and the plot."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .checking import ACCURACY_FACTOR, ACCURACY_FLOOR
from .results import (
    IMPL_COMPILE,
    IMPL_CUPYNORM,
    IMPL_EAGER,
    IMPLEMENTATIONS,
    MODE_EAGER,
    MODEL_CUPYNORM,
    MODEL_TORCH,
    ModelResult,
    StepResult,
    WorkloadResult,
)
from .timing import throughput_tbps
from .workloads import H200_COPY_TBPS, bytes_moved, goal_ms_for_run, shape_text


def speedup(reference_ms: float | None, ms: float | None) -> float | None:
    """How many times faster `ms` is than `reference_ms` (None when either is missing)."""
    if reference_ms is None or ms is None or ms <= 0:
        return None
    return reference_ms / ms


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


def format_ms(ms: float) -> str:
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
                row.append(format_ms(impl.ms))
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
        shapes = ", ".join(shape_text(s) for s in w.shapes(result.quick))
        layout = " channels_last" if w.channels_last else ""
        lines.append(f"- {w.name}: {w.title}; input {shapes} {w.dtype}{layout}; TB/s: {w.traffic}")
    return "\n".join(lines)


def results_to_json(
    results: Sequence[WorkloadResult],
    *,
    environment: dict[str, Any],
    copy_tbps: float | None,
    quick: bool,
    exit_code: int | None,
    models: Sequence[ModelResult] = (),
) -> dict[str, Any]:
    """All numbers of a run as a JSON-serializable dict (the models group under "models");
    ``exit_code`` None while the run goes on (the JSON written so far)."""
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
                    **({} if impl.kernels is None else {"kernels": impl.kernels}),
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
                "note": w.note,
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
        "models": models_to_json(models),
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
# The models group
# ------------------------------------------------------------------------------------------------

MODEL_TABLE_COLUMNS = (
    "model",
    "mode",
    "impl",
    "step ms",
    "vs torch",
    "kernel ms",
    "norm ms",
    "host us",
    "host us/norm layer",
    "norm launches/layer",
    "peak MiB",
    "out err",
    "dx err",
)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f}"


def _error_cells(result: ModelResult, step: StepResult) -> list[str]:
    """The accuracy cells of an eager row: this implementation's error against float64."""
    if step.mode != MODE_EAGER:
        return ["", ""]
    if result.accuracy is None:
        if result.accuracy_error is not None and step.impl == MODEL_CUPYNORM:
            return [_escape_cell("ERROR: " + result.accuracy_error, 60), "-"]
        return ["-", "-"]
    a = result.accuracy
    if step.impl == MODEL_TORCH:
        return [f"{a.output_torch:.2g}", f"{a.grad_torch:.2g}"]
    output = f"{a.output_cupynorm:.2g}" + ("" if a.output_ok else " (> 2x torch)")
    grad = f"{a.grad_cupynorm:.2g}" + ("" if a.grad_ok else " (> 2x torch)")
    return [output, grad]


def model_table_rows(results: Sequence[ModelResult]) -> list[list[str]]:
    """The models table's cells, one row per (model, mode, implementation)."""
    rows: list[list[str]] = []
    for result in results:
        name = result.workload.name
        if result.error is not None and not result.steps:
            rows.append([name, "-", "-", "ERROR: " + _escape_cell(result.error)] + ["-"] * 9)
            continue
        if result.skipped is not None:
            rows.append([name, "-", "-", "skipped: " + _escape_cell(result.skipped)] + ["-"] * 9)
            continue
        for step in result.steps:
            row = [name, step.mode, step.impl]
            if step.ms is None:
                row.append(_escape_cell(f"ERROR: {step.error or 'not run'}"))
                row.extend(["-"] * 7)
            else:
                reference = result.step(step.mode, MODEL_TORCH)
                row.append(format_ms(step.ms))
                row.append(_format_ratio(speedup(reference.ms if reference else None, step.ms)))
                row.append(_number(step.kernel_ms, ".4g"))
                row.append(_number(step.norm_kernel_ms, ".4g"))
                row.append(_number(step.host_us, ".0f"))
                row.append(_number(result.host_us_per_norm_layer(step), ".0f"))
                row.append(_number(step.norm_launches_per_layer(result.norm_layers), ".1f"))
                row.append(_mib(step.peak_extra_bytes))
            row.extend(_error_cells(result, step))
            rows.append(row)
    return rows


def format_models_table(results: Sequence[ModelResult]) -> str:
    """A markdown table of the models group."""
    lines = [
        "| " + " | ".join(MODEL_TABLE_COLUMNS) + " |",
        "|" + "|".join(["---"] * 3 + ["---:"] * (len(MODEL_TABLE_COLUMNS) - 3)) + "|",
    ]
    for row in model_table_rows(results):
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_models_notes(results: Sequence[ModelResult], gpu_name: str) -> str:
    """What the models table counts, and one line per model."""
    lines = [
        f"GPU: {gpu_name}",
        "Models: whole training steps (zero_grad, forward, loss, backward, SGD step), torch's "
        "norm layers vs cupynorm.torch.fuse, same initial weights and batch. "
        "step ms: median over steps, CUDA events around whole steps, after warm-up, torch's and "
        "cupynorm's steps timed in rounds that alternate them; vs torch: "
        "torch's step ms / this row's, same mode. graphed: the whole step captured in one CUDA "
        "graph (torch.cuda.graph) and replayed; compile: torch.compile(model), default mode; "
        'reduce-overhead: torch.compile(model, mode="reduce-overhead") (Inductor\'s CUDA '
        "graphs; loss and optimizer eager).",
        "Eager rows: issue times interleaved alike; kernel ms / norm ms = GPU kernel time per "
        "step, all kernels / norm kernels "
        "(torch.profiler); host us = wall time to issue one step with the device idle; host "
        "us/norm layer = (host us - host us of the same model with its norm layers replaced by "
        "nn.Identity) / norm layers, the host time of one norm layer's forward + backward; norm "
        "launches/layer = norm-kernel launches per step / norm layers. out err / dx err: "
        "max |x - ref| / max |ref| of the output and of the input gradient, fp32 with TF32 off "
        f"against torch in float64; cupynorm fails above {ACCURACY_FACTOR:g}x torch's "
        f"+ {ACCURACY_FLOOR:g}.",
    ]
    for result in results:
        w = result.workload
        line = f"- {w.name}: {w.title}; input {w.describe_input()}"
        if result.norm_layers:
            line += f"; {result.norm_layers} norm layers"
        if result.accuracy is not None:
            line += f"; accuracy check at batch {result.accuracy.batch}"
        if w.goal_text:
            line += f"; goal {w.goal_text}"
        lines.append(line)
    return "\n".join(lines)


def models_to_json(results: Sequence[ModelResult]) -> list[dict[str, Any]]:
    """The models group's numbers, JSON-serializable."""
    report = []
    for result in results:
        w = result.workload
        accuracy = None
        if result.accuracy is not None:
            a = result.accuracy
            accuracy = {
                "batch": a.batch,
                "output_max_rel_error_torch": _json_float(a.output_torch),
                "output_max_rel_error_cupynorm": _json_float(a.output_cupynorm),
                "input_grad_max_rel_error_torch": _json_float(a.grad_torch),
                "input_grad_max_rel_error_cupynorm": _json_float(a.grad_cupynorm),
                "ok": a.ok,
            }
        steps = []
        for step in result.steps:
            reference = result.step(step.mode, MODEL_TORCH)
            steps.append(
                {
                    "mode": step.mode,
                    "impl": step.impl,
                    "ms": step.ms,
                    "min_ms": step.min_ms,
                    "max_ms": step.max_ms,
                    "reps": step.reps,
                    "speedup_vs_torch": speedup(reference.ms if reference else None, step.ms),
                    "setup_s": step.setup_s,
                    "kernel_ms": step.kernel_ms,
                    "norm_kernel_ms": step.norm_kernel_ms,
                    "kernels_per_step": step.kernels,
                    "norm_kernels_per_step": step.norm_kernels,
                    "norm_launches_per_layer": step.norm_launches_per_layer(result.norm_layers),
                    "norm_kernel_ms_by_name": step.norm_kernel_ms_by_name,
                    "host_us": step.host_us,
                    "host_us_per_norm_layer": result.host_us_per_norm_layer(step),
                    "peak_extra_bytes": step.peak_extra_bytes,
                    "note": step.note,
                    "error": step.error,
                }
            )
        report.append(
            {
                "name": w.name,
                "title": w.title,
                "model": w.model,
                "input_shape": list(w.input_shape),
                "dtype": w.dtype,
                "autocast": w.autocast,
                "channels_last": w.channels_last,
                "loss": w.loss,
                "lr": w.lr,
                "norm_layers": result.norm_layers,
                "host_us_without_norms": result.host_us_without_norms,
                "goal_text": w.goal_text,
                "goal_speedup": w.goal_speedup,
                "goal_modes": list(w.goal_modes),
                "note": w.note,
                "accuracy": accuracy,
                "accuracy_error": result.accuracy_error,
                "error": result.error,
                "skipped": result.skipped,
                "failure": result.failure(),
                "seconds": result.seconds,
                "steps": steps,
            }
        )
    return report
