"""The results page (benchmarks/RESULTS.md) rendered from the JSON files the bench writes.

A GPU run is split into several calls (`bench --json a.json --only kernels`, `bench --json
b.json --only models`, ...), so the page merges any number of files: rows are keyed by workload
name, a later file's row replacing an earlier one's; the header names every GPU, date and version
the files carry. Files written by scripts/bench_sync_batchnorm.py (the two-GPU SyncBatchNorm
step) and by `python -m cupynorm profile calls --json` (the public functional's cost per call)
add a table of their own, as do the training runs (convergence, the timm sweep:
:mod:`.markdown_training`); the cells and tables are :mod:`.mdtable`'s. Plain data in, text out:
nothing here needs torch or a GPU.

    python -m cupynorm bench --json run.json --markdown benchmarks/RESULTS.md
    python -m cupynorm report --markdown benchmarks/RESULTS.md kernels.json models.json sync.json
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .markdown_training import convergence_section, timm_section
from .mdtable import Footnotes, fmt_ms, fmt_number, fmt_ratio, impl_of, md_cell, md_table

# What the header reports, in order: (label, keys of the bench JSON's environment).
_ENVIRONMENT = (
    ("GPU", ("gpu",)),
    ("date", ("date",)),
    ("torch", ("torch", "torch_cuda")),
    ("CuPy", ("cupy",)),
    ("cupynorm", ("cupynorm",)),
    ("Python", ("python",)),
    ("torchvision", ("torchvision",)),
)
_MODE_ORDER = ("eager", "graphed", "compile", "reduce-overhead")


@dataclass
class Results:
    """What one or more JSON files hold, merged: each row with the file it came from."""

    sources: list[str] = field(default_factory=list)
    runs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (source, bench JSON)
    kernels: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    models: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    two_gpus: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # profile calls JSON
    stacks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # profile stack JSON
    convergence: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # one per model
    timm: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # timm_sweep.py JSON
    replaced: list[str] = field(default_factory=list)  # "name (a.json -> b.json)"
    # model name -> mode -> the file it came from (rows merged by mode: `bench --modes`)
    model_modes: dict[str, dict[str, str]] = field(default_factory=dict)


def _is_sync_rows(data: Any) -> bool:
    return isinstance(data, list) and all(isinstance(r, dict) and "variant" in r for r in data)


def _is_convergence(data: Any) -> bool:
    """scripts/convergence.py's JSON: {model: its runs, verdict or skip reason}."""
    return (
        isinstance(data, dict)
        and bool(data)
        and all(isinstance(r, dict) and "model" in r and ("runs" in r or "skipped" in r)
                for r in data.values())
    )  # fmt: skip


def merge(documents: Sequence[tuple[str, Any]]) -> Results:
    """Merge (source name, loaded JSON) pairs; raises ValueError for a document that is neither
    a bench report nor SyncBatchNorm rows."""
    results = Results()
    for source, data in documents:
        results.sources.append(source)
        if isinstance(data, dict) and "sync_batchnorm" in data:
            results.runs.append((source, {k: v for k, v in data.items() if k != "sync_batchnorm"}))
            data = data["sync_batchnorm"]
        if _is_sync_rows(data):
            results.two_gpus.extend((source, row) for row in data)
            continue
        if isinstance(data, dict) and "setup" in data and "rows" in data:
            results.calls.append((source, data))
            continue
        if isinstance(data, dict) and isinstance(data.get("stack"), dict):
            results.stacks.append((source, data["stack"]))
            continue
        if _is_convergence(data):
            results.convergence.extend((source, result) for result in data.values())
            continue
        if isinstance(data, dict) and "timm" in data.get("environment", {}):
            results.timm.append((source, data))
            continue
        if not isinstance(data, dict) or not ("workloads" in data or "models" in data):
            raise ValueError(
                f"{source}: not a report of `python -m cupynorm bench --json`, rows of "
                "scripts/bench_sync_batchnorm.py --json, of `profile calls --json` or "
                "`profile stack --json`, of "
                "scripts/convergence.py nor of scripts/timm_sweep.py"
            )
        results.runs.append((source, data))
        for row in data.get("workloads") or []:
            if row["name"] in results.kernels:
                earlier = results.kernels[row["name"]][0]
                results.replaced.append(f"{row['name']} ({earlier} -> {source})")
            results.kernels[row["name"]] = (source, row)
        for row in data.get("models") or []:
            _merge_model(results, source, row)
    return results


def _merge_model(results: Results, source: str, row: dict[str, Any]) -> None:
    """A model row into ``results``: a row measured before keeps the modes this one did not
    run (``bench --modes``), the later file's steps and details replace the rest."""
    name = row["name"]
    steps = list(row.get("steps") or [])
    modes = {step["mode"] for step in steps}
    if name in results.models:
        earlier_source, earlier = results.models[name]
        kept = [step for step in earlier.get("steps") or [] if step["mode"] not in modes]
        if kept and not row.get("skipped") and not earlier.get("skipped"):
            ordered = [m for m in _MODE_ORDER if m in modes] + sorted(modes - set(_MODE_ORDER))
            results.replaced.append(
                f"{name}, {' and '.join(ordered)} ({earlier_source} -> {source})"
            )
            results.model_modes[name].update(dict.fromkeys(modes, source))
            results.models[name] = (source, {**row, "steps": kept + steps})
            return
        results.replaced.append(f"{name} ({earlier_source} -> {source})")
    results.model_modes[name] = dict.fromkeys(modes, source)
    results.models[name] = (source, row)


def _model_sources(results: Results, name: str, source: str) -> list[str]:
    """The files a model row's modes came from, in the order they were read."""
    used = set(results.model_modes.get(name, {}).values()) or {source}
    return [s for s in dict.fromkeys(results.sources) if s in used]


def load(paths: Sequence[str | Path]) -> Results:
    """Read and merge JSON files (ValueError naming the file that cannot be read)."""
    documents = []
    for path in paths:
        try:
            documents.append((Path(path).name, json.loads(Path(path).read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: {exc}") from None
    return merge(documents)


# ------------------------------------------------------------------------------------------------
# Cells
# ------------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------


def _header(results: Results) -> list[str]:
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m cupynorm report` from "
        + ", ".join(f"`{s}`" for s in results.sources)
        + "; do not edit by hand: run the bench (`python -m cupynorm bench --json FILE`, "
        "`--only models` for the models) and render again (`python -m cupynorm report "
        "--markdown benchmarks/RESULTS.md FILE ...`). The history of each number is in NOTES.md.",
        "",
        "| | |",
        "|---|---|",
    ]
    for label, keys in _ENVIRONMENT:
        values: dict[str, list[str]] = {}
        for source, run in results.runs:
            if run.get(keys[0]) is None:
                continue
            text = str(run[keys[0]])
            if label == "date":
                text = text.replace("T", " ").replace("+00:00", " UTC")
            if len(keys) > 1 and run.get(keys[1]):
                text += f" (CUDA {run[keys[1]]})"
            if label == "GPU" and isinstance(run.get("copy_bandwidth_tbps"), (int, float)):
                text += f", copy {run['copy_bandwidth_tbps']:.2f} TB/s"
            values.setdefault(text, []).append(source)
        if not values:
            continue
        if len(values) == 1:
            lines.append(f"| {label} | {md_cell(next(iter(values)))} |")
        else:
            cell = "; ".join(f"{v} ({', '.join(s)})" for v, s in values.items())
            lines.append(f"| {label} | {md_cell(cell)} |")
    if any(run.get("quick") for _source, run in results.runs):
        quick = [s for s, run in results.runs if run.get("quick")]
        lines.append(f"| shapes | `--quick` (smaller batches) in {', '.join(quick)} |")
    partial = [s for s, run in results.runs if run.get("partial")]
    if partial:
        lines.append(
            f"| stopped | {', '.join(partial)}: the run stopped (a time limit) in the row it "
            "names last; its rows and modes are those it finished |"
        )
    if results.replaced:
        lines += ["", "Rows measured twice, the later file's kept: " + "; ".join(results.replaced)]
    return lines


def _kernel_section(results: Results) -> list[str]:
    notes = Footnotes()
    rows = []
    for name, (_source, row) in results.kernels.items():
        eager, compiled, ours = (
            impl_of(row, n) for n in ("torch eager", "torch.compile", "cupynorm")
        )
        shape = "x".join(str(d) for d in (row.get("input_shapes") or [[]])[0])
        if row.get("channels_last"):
            shape += " cl"
        goal = row.get("goal_ms_this_run")
        goal_text = f"{goal:.3g}" if isinstance(goal, (int, float)) else row.get("goal_text") or "-"
        met = row.get("goal_met")
        status = {True: "met", False: "**missed**"}.get(met, "")
        if met is False and row.get("note"):
            status += " " + notes.ref(f"{name}: {row['note']}")
        error = row.get("error") or ours.get("error")
        cupynorm_ms = fmt_ms(ours.get("ms"))
        if error:
            cupynorm_ms = "error " + notes.ref(f"{name}: {error}")
        pct = ours.get("pct_of_copy_bandwidth")  # = floor time / cupynorm's time
        rows.append(
            [
                name,
                shape or "-",
                row.get("dtype", "-"),
                fmt_ms(eager.get("ms")),
                fmt_ms(compiled.get("ms")) if compiled else "-",
                cupynorm_ms,
                fmt_ratio(ours.get("speedup_vs_eager")),
                fmt_ratio(ours.get("speedup_vs_compile")),
                fmt_number(ours.get("tbps"), ".2f"),
                fmt_number(pct, ".0f") + ("%" if isinstance(pct, (int, float)) else ""),
                goal_text,
                status,
            ]
        )
    columns = ("workload", "shape", "dtype", "torch eager ms", "torch.compile ms",
               "cupynorm ms", "vs eager", "vs compile", "cupynorm TB/s", "% of floor", "goal ms",
               "goal")  # fmt: skip
    return [
        "## Kernels",
        "",
        "One module call (forward, or forward + backward for `fwdbwd` rows) on torch tensors: "
        "median of CUDA-event times around the call only, L2 flushed before each repetition, "
        "warm-up first; forward rows time the GPU alone (a 0.5 ms spin queued before each "
        "repetition lets the host queue the call first: a host slower than the kernels does not "
        "show; the host per call is the per-call table's), forward + backward rows include the "
        "host as a user's loop does; torch.compile in its default mode, compiled before "
        "timing; cupynorm's outputs and gradients checked against torch eager's before any "
        "timing. "
        "**Floor**: the bytes the row must move (one read and one write of the input for a "
        "forward, five passes for forward + backward; `python -m cupynorm bench --list`) at the "
        "GPU's measured device-to-device copy bandwidth; % of floor = floor time / cupynorm's "
        "time (100% = at the copy bandwidth). **Goal**: the H200 time set in DESIGN.md at the "
        "full shapes, scaled by copy bandwidth on another GPU and by bytes for `--quick` "
        "shapes; `<= eager`: no slower than torch eager's call. `cl`: channels_last.",
        "",
        *md_table(columns, rows, left=3),
        *notes.lines(),
        *_launch_section(results),
    ]


def _launch_section(results: Results) -> list[str]:
    """The kernels each row's cupynorm call launched (rows of files that carry them)."""
    rows = []
    for name, (_source, row) in results.kernels.items():
        for k in impl_of(row, "cupynorm").get("kernels") or ():
            waves, occupancy = k.get("waves"), k.get("occupancy")
            rows.append(
                [
                    name,
                    f"`{k['name']}`",
                    "x".join(str(g) for g in k["grid"]),
                    "x".join(str(b) for b in k["block"]),
                    str(k["registers"]),
                    str(k["local_bytes"]),
                    fmt_number((k["static_smem_bytes"] + k["dynamic_smem_bytes"]) / 1024, ".1f"),
                    f"{k['ctas_per_sm']} ({occupancy:.0%})" if occupancy is not None else "-",
                    fmt_number(waves, ".2f"),
                    fmt_number(k.get("us"), ".1f"),
                ]
            )
    if not rows:
        return []
    columns = ("workload", "kernel", "grid", "block", "registers", "spill B", "smem KiB",
               "CTAs per SM (threads)", "waves", "GPU µs")  # fmt: skip
    return [
        "",
        "### The kernels of each row",
        "",
        "cupynorm's launches in one call of the row, in order (`python -m cupynorm bench --json`"
        " records them): the kernel with its element types (input / parameters / output where "
        "they differ), grid and block, registers and local memory (spills) per thread, shared "
        "memory per CTA (static + dynamic), the CTAs an SM holds at once (and the share of the "
        "SM's threads they are), the grid in waves of those over every SM, and the kernel's GPU "
        "time (torch.profiler, one call, L2 not flushed).",
        "",
        *md_table(columns, rows, left=2),
    ]


def _model_section(results: Results) -> list[str]:
    notes = Footnotes()
    rows = []
    for name, (_source, model) in results.models.items():
        steps = {(s.get("mode"), s.get("impl")): s for s in model.get("steps") or []}
        seen = {mode for mode, _impl in steps}
        modes = [m for m in _MODE_ORDER if m in seen] + sorted(seen - set(_MODE_ORDER))
        goal, goal_modes = _model_goal(model)
        if model.get("skipped"):
            rows.append(
                [name, "-", "skipped", "skipped", "-", "-", "-", "-", "-", model["skipped"]]
            )
            continue
        if model.get("error") and not steps:
            error = "error " + notes.ref(f"{name}: {model['error']}")
            rows.append([name, "-", error, error, "-", "-", "-", "-", "-", ""])
            continue
        noted = False
        for mode in modes:
            theirs, ours = steps.get((mode, "torch"), {}), steps.get((mode, "cupynorm"), {})
            ratio = ours.get("speedup_vs_torch")
            torch_ms, cupynorm_ms = fmt_ms(theirs.get("ms")), fmt_ms(ours.get("ms"))
            if theirs.get("error"):
                torch_ms = "error " + notes.ref(f"{name}, {mode}, torch: {theirs['error']}")
            if ours.get("error"):
                cupynorm_ms = "error " + notes.ref(f"{name}, {mode}, cupynorm: {ours['error']}")
            if ours.get("note"):
                cupynorm_ms += " " + notes.ref(f"{name}, {mode}: {ours['note']}")
            goal_cell = ""
            if goal is not None and mode in goal_modes and isinstance(ratio, (int, float)):
                met = ratio >= goal
                goal_cell = f">= {goal:g}x " + ("met" if met else "**missed**")
            # a miss: below the goal where the row has one for this mode, else slower than torch
            bar = goal if goal is not None and mode in goal_modes else 1.0
            missed = isinstance(ratio, (int, float)) and ratio < bar
            if missed and model.get("note") and not noted:
                goal_cell = goal_cell or "slower than torch"
                goal_cell += " " + notes.ref(f"{name}: {model['note']}")
                noted = True
            host = [_host(theirs), _host(ours)] if mode == "eager" else ["-", "-"]
            peak = [_peak(theirs), _peak(ours)] if mode == "eager" else ["-", "-"]
            ratio_cell = fmt_ratio(ratio)
            rows.append([name, mode, torch_ms, cupynorm_ms, ratio_cell, *host, *peak, goal_cell])
        accuracy = model.get("accuracy") or {}
        if accuracy and not accuracy.get("ok", True):
            failure = model.get("failure") or "accuracy check failed"
            rows[-1][-1] += " " + notes.ref(f"{name}: {failure}")
    columns = ("model", "mode", "torch ms", "cupynorm ms", "vs torch",
               "host µs/norm layer torch", "host µs/norm layer cupynorm", "peak MiB torch",
               "peak MiB cupynorm", "goal / why")  # fmt: skip
    dates = {source: str(run.get("date", ""))[:10] for source, run in results.runs}
    titles = [
        f"- `{n}`: {m.get('title', '')} (measured: "
        + "; ".join(", ".join(filter(None, (dates[f], f))) for f in _model_sources(results, n, s))
        + ")"
        for n, (s, m) in results.models.items()
    ]
    return [
        "## Models",
        "",
        "Whole training steps (zero_grad, forward, loss, backward, SGD step) with torch's norm "
        "layers and with cupynorm's (`cupynorm.torch.fuse`, or `replace_norms` where the row "
        "says), same initial weights and batch; ms per step: median, CUDA events around whole "
        "steps, after warm-up. Modes: **eager**; **graphed**: the whole step captured in one "
        "CUDA graph and replayed; **compile**: `torch.compile(model)`; **reduce-overhead**: "
        '`torch.compile(model, mode="reduce-overhead")` (Inductor\'s CUDA graphs). vs torch: '
        "torch's ms / cupynorm's in the same mode. Host µs/norm layer (eager): the time to issue "
        "a step less that of the same model with its norm layers removed, per norm layer "
        "(forward + backward). Peak MiB (eager): what a step allocates at its peak beyond what "
        "was allocated before it (activations, saved tensors, gradients). Where cupynorm's is "
        'higher, benchmarks/NOTES.md ("Peak memory") measures why: a fused BatchNorm + add + '
        "ReLU keeps the ReLU's mask, one bit per element (resnet50); a step's peak may sit in "
        "the convolutions, whose cuDNN workspaces differ from process to process (SD's VAE "
        "decode: no norm allocation alive at its peak). Before timing, each "
        "row's output and input gradient in fp32 are "
        "checked against torch in float64 (cupynorm within 2x torch's error).",
        "",
        *md_table(columns, rows, left=2),
        *notes.lines(),
        "",
        *titles,
    ]


def _model_goal(model: dict[str, Any]) -> tuple[float | None, list[str]]:
    """(speedup, modes) of a model row's goal; from its text in files written before the JSON
    carried them apart (">= 1.15x torch (eager and graphed)")."""
    if model.get("goal_speedup") is not None:
        return model["goal_speedup"], list(model.get("goal_modes") or [])
    found = re.match(r">=\s*([0-9.]+)x torch(?: \((.*)\))?", model.get("goal_text") or "")
    if found is None:
        return None, []
    modes = [m.strip() for m in (found.group(2) or "").split(" and ") if m.strip()]
    return float(found.group(1)), modes


def _host(step: dict[str, Any]) -> str:
    return fmt_number(step.get("host_us_per_norm_layer"), ".0f")


def _peak(step: dict[str, Any]) -> str:
    peak = step.get("peak_extra_bytes")
    return fmt_number(peak / 2**20 if isinstance(peak, (int, float)) else None, ".0f")


def _two_gpu_section(results: Results) -> list[str]:
    """One row per variant of each run (file and world size), the ratio against torch's
    SyncBatchNorm of the same run."""
    torch_ms = {
        (source, row.get("world")): row.get("ms_per_step")
        for source, row in results.two_gpus
        if row.get("variant") == "torch"
    }
    gpus = {source: run.get("gpu", "-") for source, run in results.runs}
    rows = []
    for source, row in results.two_gpus:
        ms, theirs = row.get("ms_per_step"), torch_ms.get((source, row.get("world")))
        name = {"unsynced": "torch BatchNorm2d, unsynced"}.get(
            row.get("variant"), f"{row.get('variant')} SyncBatchNorm"
        )
        ratio = theirs / ms if isinstance(theirs, (int, float)) and ms else None
        rows.append(
            [
                name,
                str(row.get("world", "-")),
                str(row.get("batch_per_rank", "-")),
                fmt_ms(ms),
                fmt_number(row.get("images_per_s"), ".0f"),
                fmt_ms(row.get("collective_ms_per_step")),
                fmt_ratio(ratio) if row.get("variant") != "unsynced" else "-",
                f"{gpus.get(source, '-')} ({source})",
            ]
        )
    columns = ("variant", "GPUs", "batch/GPU", "ms/step", "images/s", "collectives ms/step",
               "vs torch", "machine (file)")  # fmt: skip
    return [
        "## Several GPUs: SyncBatchNorm",
        "",
        "DDP training step of torchvision's resnet50 (bf16 autocast, channels_last, NCCL) with "
        "torch.nn.SyncBatchNorm and with cupynorm.torch.SyncBatchNorm "
        "(`torchrun --nproc-per-node N scripts/bench_sync_batchnorm.py --json FILE`); ms per "
        "step: median over alternating rounds, the slowest rank's; collectives: the time inside "
        "SyncBatchNorm's own collectives per step; vs torch: torch's SyncBatchNorm step in the "
        "same run over this one.",
        "",
        *md_table(columns, rows),
    ]


def _calls_section(results: Results) -> list[str]:
    from .profile.calls import parts_table, table

    lines = [
        "## Per call: the public functional",
        "",
        "`python -m cupynorm profile calls --json FILE`: µs per call of each public function, "
        "called back to back with no grad (median of 5 blocks), on a small input (the host "
        "paces it) and a large one (the GPU does); GPU: the median µs of one call's kernels, "
        "CUDA events around each call, beside the same norm written by hand with CuPy's "
        "reductions (each result checked against it first). A run without torch (or JAX) "
        "leaves their columns empty.",
    ]
    for source, data in results.calls:
        date = (
            f", {data['date'].replace('T', ' ').replace('+00:00', ' UTC')}"
            if "date" in data
            else ""
        )
        lines += ["", f"{data['setup']}{date} ({source}):", "", table(data["rows"])]
        parts = parts_table(data["rows"])
        if parts:
            lines += [
                "",
                "Where a replayed call's host µs go: the call (blocks of 100 calls, host side), "
                "its key and lookup, its outputs' allocations, its launches (host side: the "
                "program's run less its allocations; in the files of 2026-11-27 the launches and "
                "their pointer table alone, the device and stream, ~0.6 µs, counted in rest), "
                "each timed on the call's own recorded program; rest: the Python between them "
                "(the public function, the replay's checks).",
                "",
                parts,
            ]
    return lines


def _stack_section(results: Results) -> list[str]:
    from .profile.stack import format_rows, rows_of

    lines = [
        "## Host per norm layer: stacks of one family",
        "",
        "`python -m cupynorm profile stack --json FILE`: a chain of layers of one family on a "
        "small tensor, forward then backward issued back to back (the autograd engine's fixed "
        "cost paid once per step, as in a model); per layer over an `nn.Identity` chain: host "
        "µs of the forward and of the backward (the fastest of several blocks of steps), and "
        "the kernels' GPU µs, launches and allocations. floor: a bare Python "
        "`autograd.Function` with a norm's allocations and no kernels; cupynorm: its kernels at "
        "every size; cupynorm default: the default eager policy (calls this small run torch's "
        'op). Stacks "compiled whole" (`--compile`): each chain compiled by Inductor, '
        "every kind on cupynorm's kernels; cupynorm: the generated code calls each op's kernel "
        "directly; cupynorm op calls: the op through the dispatcher. vs torch: torch's forward "
        "+ backward host µs over the layer's. Host time moves with the machine's host: compare "
        "rows of one run only.",
    ]
    for source, data in results.stacks:
        date = data.get("date", "").replace("T", " ").replace("+00:00", " UTC")
        gpu = any(row.get("kernel_us") is not None for row in data["rows"])
        lines += ["", f"{data['setup']}, {date} ({source}):", "", format_rows(rows_of(data), gpu)]
    return lines


def render(results: Results) -> str:
    """The whole page."""
    lines = _header(results)
    if results.kernels:
        lines += ["", *_kernel_section(results)]
    if results.models:
        lines += ["", *_model_section(results)]
    if results.two_gpus:
        lines += ["", *_two_gpu_section(results)]
    if results.calls:
        lines += ["", *_calls_section(results)]
    if results.stacks:
        lines += ["", *_stack_section(results)]
    if results.convergence:
        lines += ["", *convergence_section(results)]
    if results.timm:
        lines += ["", *timm_section(results)]
    return "\n".join(lines).rstrip() + "\n"
