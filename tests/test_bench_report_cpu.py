"""The results page (`python -m cupynorm report`, `bench --markdown`) without a GPU: rendered from
small fabricated JSON files of the bench's layout, merged, and from a CPU dry run of the bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_cpu import _table_cells, cpu_dry_run  # noqa: F401 - the fixture

from cupynorm.__main__ import main
from cupynorm.bench import markdown

ENVIRONMENT = {
    "tool": "python -m cupynorm bench",
    "date": "2026-11-27T10:00:00+00:00",
    "gpu": "NVIDIA H100 80GB HBM3",
    "torch": "2.11.0+cu130",
    "torch_cuda": "13.0",
    "cupy": "14.2.0",
    "cupynorm": "0.1.0",
    "python": "3.12.3",
    "quick": False,
    "copy_bandwidth_tbps": 3.0,
    "exit_code": 0,
}


def _impl(impl: str, ms: float | None, **extra) -> dict:
    return {"impl": impl, "ms": ms, "error": None, **extra}


def _kernel_run(**environment) -> dict:
    """Two kernel rows: one within its goal, one missing it with a note, and one whose cupynorm
    failed."""
    met = {
        "name": "batchnorm2d_train_fp32",
        "input_shapes": [[64, 64, 512, 512]],
        "dtype": "float32",
        "channels_last": False,
        "goal_ms_this_run": 4.2,
        "goal_text": "",
        "goal_met": True,
        "note": "",
        "error": None,
        "impls": [
            _impl("torch eager", 8.0),
            _impl("torch.compile", 3.0),
            _impl(
                "cupynorm",
                2.9,
                speedup_vs_eager=8.0 / 2.9,
                speedup_vs_compile=3.0 / 2.9,
                tbps=2.96,
                pct_of_copy_bandwidth=98.7,
            ),
        ],
    }
    missed = {
        **met,
        "name": "groupnorm32_fwdbwd_fp16",
        "input_shapes": [[16, 320, 64, 64]],
        "dtype": "float16",
        "channels_last": True,
        "goal_ms_this_run": 0.1,
        "goal_met": False,
        "note": "host time: two Python calls",
        "impls": [
            _impl("torch eager", 0.3),
            _impl("cupynorm", 0.5, speedup_vs_eager=0.6, tbps=0.4, pct_of_copy_bandwidth=13.3),
        ],
    }
    broken = {
        **met,
        "name": "layernorm_bf16",
        "goal_met": None,
        "impls": [_impl("torch eager", 0.05), {**_impl("cupynorm", None), "error": "WRONG: y"}],
    }
    return {**ENVIRONMENT, **environment, "workloads": [met, missed, broken], "models": []}


def _step(mode: str, impl: str, ms: float, torch_ms: float, **extra) -> dict:
    return {"mode": mode, "impl": impl, "ms": ms, "speedup_vs_torch": torch_ms / ms, **extra}


def _model_run() -> dict:
    resnet = {
        "name": "resnet50_b64_bf16_cl",
        "title": "torchvision resnet50() training step",
        "goal_speedup": 1.15,
        "goal_modes": ["eager", "graphed"],
        "goal_text": ">= 1.15x torch (eager and graphed)",
        "note": "host-bound at this batch",
        "accuracy": {"ok": True},
        "error": None,
        "skipped": None,
        "steps": [],
    }
    for mode, theirs, ours in (
        ("eager", 18.0, 20.0),
        ("graphed", 17.0, 13.6),
        ("compile", 17.5, 30.0),
        ("reduce-overhead", 14.0, 12.5),
    ):
        host = {"host_us_per_norm_layer": None}
        if mode == "eager":
            host = {"host_us_per_norm_layer": 96.4}
        resnet["steps"].append(_step(mode, "torch", theirs, theirs, **host))
        if mode == "eager":
            host = {"host_us_per_norm_layer": 144.0}
        extra = {"note": "Inductor ran 2 graph(s) without CUDA graphs"} if "reduce" in mode else {}
        resnet["steps"].append(_step(mode, "cupynorm", ours, theirs, **host, **extra))
    skipped = {"name": "mobilenetv3_b64_bf16_cl", "skipped": "timm is not installed", "steps": []}
    return {**ENVIRONMENT, "workloads": [], "models": [resnet, skipped]}


def _sync_run() -> dict:
    rows = [
        {"variant": "torch", "ms_per_step": 102.0, "collective_ms_per_step": 26.7,
         "world": 2, "batch_per_rank": 64, "images_per_s": 1255.0},
        {"variant": "cupynorm", "ms_per_step": 87.3, "collective_ms_per_step": 48.4,
         "world": 2, "batch_per_rank": 64, "images_per_s": 1466.0},
    ]  # fmt: skip
    environment = {"tool": "scripts/bench_sync_batchnorm.py", "gpu": "2x NVIDIA H200"}
    return {**environment, "date": "2026-11-26T09:00:00+00:00", "sync_batchnorm": rows}


def _write(tmp_path: Path, name: str, data: object) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _section(page: str, title: str) -> str:
    start = page.index(title)
    end = page.find("\n## ", start + 1)
    return page[start : end if end >= 0 else None]


def _rows(section: str) -> dict[tuple[str, ...], list[str]]:
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    cells = _table_cells(table)
    return {tuple(row[:2]): row for row in cells[2:]}


def test_report_renders_every_group(tmp_path: Path, capsys) -> None:
    files = [
        _write(tmp_path, "kernels.json", _kernel_run()),
        _write(tmp_path, "models.json", _model_run()),
        _write(tmp_path, "sync.json", _sync_run()),
    ]
    out = tmp_path / "RESULTS.md"
    assert main(["report", "--markdown", str(out), *files]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    page = out.read_text()

    header = page[: page.index("## Kernels")]
    assert "`kernels.json`, `models.json`, `sync.json`" in header
    environment = _table_cells("\n".join(ln for ln in header.splitlines() if ln.startswith("|")))
    values = {row[0]: row[1] for row in environment[2:]}
    assert values["GPU"] == (
        "NVIDIA H100 80GB HBM3, copy 3.00 TB/s (kernels.json, models.json); "
        "2x NVIDIA H200 (sync.json)"
    )
    assert values["torch"] == "2.11.0+cu130 (CUDA 13.0)"
    assert values["CuPy"] == "14.2.0" and values["cupynorm"] == "0.1.0"
    assert values["date"].startswith("2026-11-27 10:00:00 UTC (kernels.json, models.json)")

    kernels = _section(page, "## Kernels")
    assert "**Floor**" in kernels and "**Goal**" in kernels
    rows = {row[0]: row for row in _rows(kernels).values()}
    assert rows["batchnorm2d_train_fp32"][1:] == [
        "64x64x512x512", "float32", "8", "3", "2.9", "2.76x", "1.03x", "2.96", "99%", "4.2", "met",
    ]  # fmt: skip
    missed = rows["groupnorm32_fwdbwd_fp16"]
    assert missed[1] == "16x320x64x64 cl" and missed[4] == "-"  # no torch.compile row
    assert missed[-1] == "**missed** [1]"
    assert rows["layernorm_bf16"][5] == "error [2]"
    assert "[1] groupnorm32_fwdbwd_fp16: host time: two Python calls" in kernels
    assert "[2] layernorm_bf16: WRONG: y" in kernels

    models = _section(page, "## Models")
    rows = _rows(models)
    assert [key for key in rows if key[0] == "resnet50_b64_bf16_cl"] == [
        ("resnet50_b64_bf16_cl", mode)
        for mode in ("eager", "graphed", "compile", "reduce-overhead")
    ]
    eager = rows[("resnet50_b64_bf16_cl", "eager")]
    assert eager[2:] == ["18", "20", "0.90x", "96", "144", "-", "-", ">= 1.15x **missed** [1]"]
    assert rows[("resnet50_b64_bf16_cl", "graphed")][2:] == [
        "17", "13.6", "1.25x", "-", "-", "-", "-", ">= 1.15x met",
    ]  # fmt: skip
    assert rows[("resnet50_b64_bf16_cl", "compile")][-1] == ""  # no goal, note already given
    reduce_overhead = rows[("resnet50_b64_bf16_cl", "reduce-overhead")]
    assert reduce_overhead[3] == "12.5 [2]" and reduce_overhead[4] == "1.12x"
    assert "[1] resnet50_b64_bf16_cl: host-bound at this batch" in models
    assert "[2] resnet50_b64_bf16_cl, reduce-overhead: Inductor ran 2 graph(s)" in models
    skipped = rows[("mobilenetv3_b64_bf16_cl", "-")]
    assert skipped[2] == "skipped" and skipped[-1] == "timm is not installed"

    two_gpus = _section(page, "## Several GPUs")
    rows = {row[0]: row for row in _rows(two_gpus).values()}
    assert rows["cupynorm SyncBatchNorm"][1:] == [
        "2", "64", "87.3", "1466", "48.4", "1.17x", "2x NVIDIA H200 (sync.json)",
    ]  # fmt: skip
    assert rows["torch SyncBatchNorm"][-2] == "1.00x"


def test_report_renders_the_kernels_each_row_launched(tmp_path: Path, capsys) -> None:
    run = _kernel_run()
    launch = {
        "name": "bn_stats<float32>",
        "grid": [148, 2],
        "block": [256],
        "dynamic_smem_bytes": 1024,
        "registers": 40,
        "local_bytes": 0,
        "static_smem_bytes": 2048,
        "ctas_per_sm": 6,
        "occupancy": 0.75,
        "waves": 0.25,
        "us": 12.34,
    }
    ours = run["workloads"][0]["impls"][2]
    ours["kernels"] = [launch, {**launch, "name": "bn_apply<float16/float32>", "us": None}]
    out = tmp_path / "RESULTS.md"
    assert main(["report", "--markdown", str(out), _write(tmp_path, "k.json", run)]) == 0
    page = out.read_text()
    section = page[page.index("### The kernels of each row") :]
    section = section[: section.find("\n## ")]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    rows = _table_cells("\n".join(lines))[2:]
    assert rows == [
        ["batchnorm2d_train_fp32", "`bn_stats<float32>`", "148x2", "256", "40", "0", "3.0",
         "6 (75%)", "0.25", "12.3"],
        ["batchnorm2d_train_fp32", "`bn_apply<float16/float32>`", "148x2", "256", "40", "0",
         "3.0", "6 (75%)", "0.25", "-"],
    ]  # fmt: skip

    # a file without kernel lists renders no such table
    plain = tmp_path / "plain.md"
    source = _write(tmp_path, "p.json", _kernel_run())
    assert main(["report", "--markdown", str(plain), source]) == 0
    assert "### The kernels of each row" not in plain.read_text()
    capsys.readouterr()


def test_report_sync_rows_of_two_world_sizes_each_against_its_own_torch(
    tmp_path: Path, capsys
) -> None:
    two = _sync_run()
    four = _sync_run()
    four["gpu"] = "4x NVIDIA H200"
    four["sync_batchnorm"] = [
        dict(row, world=4, ms_per_step=row["ms_per_step"] * 1.1) for row in four["sync_batchnorm"]
    ]
    four["sync_batchnorm"][1]["ms_per_step"] = 90.0
    files = [_write(tmp_path, "two.json", two), _write(tmp_path, "four.json", four)]
    assert main(["report", *files]) == 0
    section = _section(capsys.readouterr().out, "## Several GPUs")
    rows = {tuple(row[:2]): row for row in _rows(section).values()}
    assert rows[("cupynorm SyncBatchNorm", "2")][6:] == ["1.17x", "2x NVIDIA H200 (two.json)"]
    assert rows[("cupynorm SyncBatchNorm", "4")][6:] == ["1.25x", "4x NVIDIA H200 (four.json)"]


def test_report_merges_runs_the_later_row_replacing(tmp_path: Path, capsys) -> None:
    first = _kernel_run()
    second = _kernel_run(gpu="NVIDIA H200", copy_bandwidth_tbps=4.2)
    second["workloads"] = [dict(second["workloads"][0], impls=[_impl("torch eager", 7.0)])]
    files = [_write(tmp_path, "a.json", first), _write(tmp_path, "b.json", second)]
    assert main(["report", *files]) == 0
    page = capsys.readouterr().out
    assert (
        "Rows measured twice, the later file's kept: batchnorm2d_train_fp32 (a.json -> b.json)"
        in page
    )
    rows = {row[0]: row for row in _rows(_section(page, "## Kernels")).values()}
    assert list(rows) == ["batchnorm2d_train_fp32", "groupnorm32_fwdbwd_fp16", "layernorm_bf16"]
    assert rows["batchnorm2d_train_fp32"][3] == "7"  # b.json's
    assert "NVIDIA H100 80GB HBM3, copy 3.00 TB/s (a.json); NVIDIA H200, copy 4.20 TB/s" in page
    assert "## Models" not in page and "## Several GPUs" not in page


def test_report_merges_a_model_row_by_mode(tmp_path: Path, capsys) -> None:
    """A later run of some modes only (``bench --modes``) replaces those and keeps the earlier
    file's other modes; the row names both files. A later run of every mode replaces the row."""
    first = dict(_model_run(), date="2026-11-27T10:00:00+00:00")
    compiled = dict(_model_run(), date="2026-11-28T10:00:00+00:00")
    resnet = dict(compiled["models"][0])
    resnet["steps"] = [
        dict(step, ms=step["ms"] / 2) for step in resnet["steps"] if step["mode"] == "compile"
    ]
    compiled["models"] = [resnet]
    files = [_write(tmp_path, "a.json", first), _write(tmp_path, "b.json", compiled)]
    assert main(["report", *files]) == 0
    page = capsys.readouterr().out
    rows = _rows(_section(page, "## Models"))
    name = "resnet50_b64_bf16_cl"
    assert [mode for n, mode in rows if n == name] == [*markdown._MODE_ORDER]
    assert rows[name, "compile"][2:4] == ["8.75", "15"]  # b.json's
    assert rows[name, "eager"][2:4] == ["18", "20"]  # a.json's
    assert f"{name}, compile (a.json -> b.json)" in page
    assert "(measured: 2026-11-27, a.json; 2026-11-28, b.json)" in page
    files.append(_write(tmp_path, "c.json", first))
    assert main(["report", *files]) == 0
    page = capsys.readouterr().out
    assert rows[name, "compile"] != _rows(_section(page, "## Models"))[name, "compile"]
    assert f"{name} (b.json -> c.json)" in page
    assert "(measured: 2026-11-27, c.json)" in page
    # a file whose modes were all measured again later is no longer named
    eager = dict(
        first, models=[dict(resnet, steps=[dict(st, mode="eager") for st in resnet["steps"]])]
    )
    files = [files[0], files[1], _write(tmp_path, "d.json", eager)]
    assert main(["report", *files]) == 0
    page = capsys.readouterr().out
    assert "(measured: 2026-11-27, a.json; 2026-11-28, b.json; 2026-11-27, d.json)" in page
    files.append(_write(tmp_path, "e.json", compiled))
    assert main(["report", *files]) == 0
    assert "(measured: 2026-11-27, a.json; 2026-11-27, d.json; 2026-11-28, e.json)" in (
        capsys.readouterr().out
    )


def test_report_names_a_run_stopped_at_a_time_limit(tmp_path: Path, capsys) -> None:
    """A JSON the bench wrote while it ran (``partial``: stopped before its end) renders its
    rows, and the header says which file stopped."""
    stopped = dict(_model_run(), partial=True, exit_code=None)
    files = [_write(tmp_path, "a.json", _kernel_run()), _write(tmp_path, "m.json", stopped)]
    assert main(["report", *files]) == 0
    page = capsys.readouterr().out
    assert "| stopped | m.json: the run stopped" in page
    assert ("resnet50_b64_bf16_cl", "graphed") in _rows(_section(page, "## Models"))
    assert main(["report", files[0]]) == 0
    assert "| stopped |" not in capsys.readouterr().out


def test_report_reads_the_older_files(tmp_path: Path, capsys) -> None:
    """Files written before the JSON carried the goal apart (its text only) and the two-GPU
    script's bare list of rows still render."""
    models = _model_run()
    for model in models["models"]:
        model.pop("goal_speedup", None)
        model.pop("goal_modes", None)
    rows = _sync_run()["sync_batchnorm"]
    files = [_write(tmp_path, "m.json", models), _write(tmp_path, "s.json", rows)]
    assert main(["report", *files]) == 0
    page = capsys.readouterr().out
    graphed = _rows(_section(page, "## Models"))[("resnet50_b64_bf16_cl", "graphed")]
    assert graphed[-1] == ">= 1.15x met"
    assert "| cupynorm SyncBatchNorm |" in page


def test_report_renders_the_per_call_tables(tmp_path: Path, capsys) -> None:
    """`profile calls --json` files (with torch, and CuPy alone) add a table each, after the
    model rows, with their setup and date; a missing library's column is "-"."""
    from cupynorm.bench.profile import calls

    def row(name: str, torch_us: float | None) -> dict:
        cells = dict.fromkeys(calls.COLUMNS, None)
        cells.update(call=name, shape="8x64x32x32", cupy_us=16.5, kernels_gpu_us=21.1)
        cells.update(cupy_by_hand_gpu_us=304.8, torch_tensor_us=torch_us, torch_own_us=torch_us)
        return cells

    parts = dict(call_us=16.0, key_us=2.0, allocations_us=2.5, launches_us=4.5, rest_us=7.0,
                 allocations=1, launches=1)  # fmt: skip
    full = {"setup": "GPU X, CuPy 14", "date": "2026-11-27T06:48:00+00:00",
            "rows": [{**row("group_norm(x, 8)", 21.3), "cupy_parts": parts}]}  # fmt: skip
    alone = {"setup": "GPU X, CuPy 14", "rows": [row("group_norm(x, 8)", None)]}
    files = [
        _write(tmp_path, "m.json", _model_run()),
        _write(tmp_path, "c.json", full),
        _write(tmp_path, "c0.json", alone),
    ]
    assert main(["report", *files]) == 0
    page = capsys.readouterr().out
    section = _section(page, "## Per call: the public functional")
    assert page.index("## Models") < page.index("## Per call")
    assert "training step (measured: 2026-11-27, m.json)" in _section(page, "## Models")
    assert "GPU X, CuPy 14, 2026-11-27 06:48:00 UTC (c.json):" in section
    assert "GPU X, CuPy 14 (c0.json):" in section
    assert (
        "| group_norm(x, 8) | 8x64x32x32 | 16.5 | 21.3 | - | 21.3 | - | 21.1 | 304.8 |" in section
    )
    assert "| group_norm(x, 8) | 8x64x32x32 | 16.5 | - | - | - | - | 21.1 | 304.8 |" in section
    # the breakdown: only where a file has one (the CuPy array's parts here, no torch parts)
    assert section.count("| call | input (fp32) | array | call | key + lookup |") == 1
    assert (
        "| group_norm(x, 8) | 8x64x32x32 | CuPy array | 16.0 | 2.0 | 2.5 | 4.5 | 7.0 | 1 | 1 |"
        in (section)
    )
    assert "| torch tensor |" not in section


@pytest.mark.parametrize(
    ("content", "message"),
    [("{not json", "Expecting property name"), ('{"rows": []}', "not a report of")],
)
def test_report_rejects_a_file_it_cannot_read(tmp_path: Path, capsys, content, message) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cupynorm report: ") and "bad.json" in err and message in err


def test_report_needs_a_file(capsys) -> None:
    assert main(["report"]) == 2
    assert "FILE.json" in capsys.readouterr().err


def test_merge_keeps_each_rows_source() -> None:
    results = markdown.merge([("a", _kernel_run()), ("b", _model_run())])
    assert results.sources == ["a", "b"]
    assert {name: source for name, (source, _row) in results.kernels.items()} == {
        "batchnorm2d_train_fp32": "a",
        "groupnorm32_fwdbwd_fp16": "a",
        "layernorm_bf16": "a",
    }
    assert list(results.models) == ["resnet50_b64_bf16_cl", "mobilenetv3_b64_bf16_cl"]


def test_bench_writes_the_page_of_its_run(cpu_dry_run, tmp_path: Path, capsys) -> None:  # noqa: F811
    cpu_dry_run()
    page_path, json_path = tmp_path / "RESULTS.md", tmp_path / "run.json"
    argv = ["bench", "--quick", "--no-compile", "--reps", "2", "--only", "groupnorm32_fp16"]
    assert main(argv + ["--json", str(json_path), "--markdown", str(page_path)]) == 0
    page = page_path.read_text()
    assert "`run.json`" in page and "| GPU | Fake GPU (CPU)" in page
    rows = {row[0]: row for row in _rows(_section(page, "## Kernels")).values()}
    assert float(rows["groupnorm32_fp16"][5]) > 0  # cupynorm ms
    # the same page as `report` renders from the JSON file
    capsys.readouterr()
    assert main(["report", str(json_path)]) == 0
    assert capsys.readouterr().out == page


def test_report_renders_the_convergence_runs(tmp_path: Path, capsys) -> None:
    """scripts/convergence.py's JSON: one row per model with both implementations' final
    losses, steady and whole-run times, the verdict; a skipped model says so."""

    def run(impl: str, final: float, steady: float, wall: float) -> dict:
        return {"impl": impl, "losses": [1.0, final], "final_loss": final,
                "steady_ms_per_step": steady, "wall_s": wall}  # fmt: skip

    result = {
        "resnet18": {
            "model": "resnet18", "steps": 1000, "device": "NVIDIA H100 80GB HBM3",
            "runs": [run("torch", 0.52, 11.7, 20.7), run("torch", 0.5201, 12.5, 12.5),
                     run("cupynorm", 0.5199, 12.2, 12.2)],
            "inside_fraction": [0.995], "final_inside": [True], "converges": True,
        },
        "llama": {"model": "llama", "skipped": "transformers is missing"},
    }  # fmt: skip
    assert main(["report", _write(tmp_path, "conv.json", result)]) == 0
    section = _section(capsys.readouterr().out, "## Convergence")
    rows = {row[0]: row for row in _rows(section).values()}
    assert rows["resnet18"][3:] == [
        "0.5200, 0.5201", "0.5199", "99.5%", "11.7, 12.5 / 12.2", "20.7, 12.5 / 12.2", "yes",
        "conv.json",
    ]  # fmt: skip
    assert rows["llama"][-2:] == ["skipped", "conv.json"]


def test_report_renders_the_timm_sweep(tmp_path: Path, capsys) -> None:
    """scripts/timm_sweep.py's JSON: a row per model that ran (counts, what was left and why,
    cupynorm's errors, the verdict, both step times with their ratio); the models the run's
    time did not reach are counted, not listed."""

    def record(model: str, **fields) -> dict:
        return {"family": model.split("_")[0], "model": model, "status": "ok", "error": None,
                "norm_layers": 0, "converted": 0, "fused": 0, "left": [], "errors": {},
                "ok": None, "eager_ms": {}, "graphed_ms": {}, **fields}  # fmt: skip

    errors = {"out_cupynorm": 5e-7, "dx_cupynorm": 1.0, "pgrad_cupynorm": 6.3}
    sweep = {
        "environment": {"device_name": "NVIDIA H200", "torch": "2.11", "timm": "1.0.29",
                        "date": "2026-11-27 12:53 UTC", "conversion": "fuse"},
        "records": [
            record("convnextv2_atto", norm_layers=29, converted=17, ok=True,
                   left=[{"class": "timm.layers.GlobalResponseNorm", "count": 12,
                          "reason": "no cupynorm counterpart"}],
                   eager_ms={"torch": 30.0, "cupynorm": 32.0},
                   graphed_ms={"torch": 11.5, "cupynorm": 10.0}),
            record("poolformerv2_s12", norm_layers=29, converted=29, ok=False, errors=errors),
            record("broken", status="failed", error="build: RuntimeError: no such model"),
            record("beit_base", status="not run (time)"),
        ],
    }  # fmt: skip
    assert main(["report", _write(tmp_path, "timm.json", sweep)]) == 0
    section = _section(capsys.readouterr().out, "## timm")
    assert (
        "(timm.json); conversion: fuse; errors: mean of 1 draw(s); eager: median of 15 steps; "
        "1 families not" in section
    )
    rows = {row[0]: row for row in _rows(section).values()}
    assert set(rows) == {"`convnextv2_atto`", "`poolformerv2_s12`", "`broken`"}
    assert rows["`convnextv2_atto`"][2:] == [
        "29", "17", "0", "GlobalResponseNorm x12: no cupynorm counterpart", "- / - / -", "yes",
        "30.00 / 32.00 (0.94x)", "11.50 / 10.00 (1.15x)",
    ]  # fmt: skip
    assert rows["`poolformerv2_s12`"][6:8] == ["5.0e-07 / 1.0e+00 / 6.3e+00", "**no**"]
    assert rows["`broken`"][7] == "build: RuntimeError: no such model"
    # a failure replace_norms warned of: torch's own AvgPool2d bug, named
    sweep["environment"]["accuracy_draws"] = 3
    sweep["records"][1]["warnings"] = ["replace_norms: ... (pytorch/pytorch#188344), ..."]
    assert main(["report", _write(tmp_path, "timm.json", sweep)]) == 0
    section = _section(capsys.readouterr().out, "## timm")
    assert "errors: mean of 3 draw(s)" in section
    rows = {row[0]: row for row in _rows(section).values()}
    assert rows["`poolformerv2_s12`"][7] == (
        "**no** (torch's AvgPool2d backward, pytorch/pytorch#188344)"
    )
