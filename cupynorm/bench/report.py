"""Reporting a run: the markdown table, the notes above it, the JSON report and the plot."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .results import IMPL_COMPILE, IMPL_CUPYNORM, IMPL_EAGER, IMPLEMENTATIONS, WorkloadResult
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
