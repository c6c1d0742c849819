"""`python -m cupynorm bench` without a GPU: arguments, workload registry, arithmetic, formatting,
the no-GPU / no-torch exits, and a dry run of the whole pipeline on the CPU with fake CUDA timing.

One file past 600 lines on purpose: its dry runs and the models tests (test_bench_models_cpu.py)
share the CPU stand-in for the device (``CpuStandIn``) and the table parser defined here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from cupynorm import bench
from cupynorm.__main__ import build_parser, main

ROOT = Path(__file__).resolve().parents[1]

EXPECTED_WORKLOADS = [
    "instancenorm2d_fp32",
    "groupnorm8_fp32",
    "batchnorm2d_train_fp32",
    "row_norm_add_mul_fp32",
    "groupnorm32_fp16_cl",
    "groupnorm32_fp16",
    "batchnorm2d_train_fp16_cl",
    "instancenorm2d_affine_fwdbwd_fp32",
    "batchnorm2d_fwdbwd_fp32",
    "groupnorm32_fwdbwd_fp16",
    "layernorm_bf16",
    "rmsnorm_bf16",
    "layernorm_fwdbwd_bf16",
    "rmsnorm_fwdbwd_bf16",
    "layernorm_kb40_fp32",
    "rmsnorm2d_kb36_fp32",
    "layernorm2d_bf16",
    "layernorm2d_fwdbwd_bf16_cl",
    "add_rmsnorm_bf16",
    "batchnorm2d_add_relu_fp16_cl",
    "groupnorm32_silu_fp16",
    "groupnorm32_silu_fp16_cl",
    "groupnorm32_silu_fwdbwd_fp16",
    "groupnorm32_shift_silu_fp16",
    "groupnorm32_shift_silu_fwdbwd_fp16",
    "seed002_model_fp32",
    "module_overhead",
]


# ------------------------------------------------------------------------------------------------
# Registry and --only
# ------------------------------------------------------------------------------------------------


def test_registry_names_and_goals() -> None:
    assert [w.name for w in bench.WORKLOADS] == EXPECTED_WORKLOADS
    goals = {w.name: w.goal_ms for w in bench.WORKLOADS}
    assert goals["instancenorm2d_fp32"] == 3.9
    assert goals["batchnorm2d_train_fp32"] == 3.1
    assert goals["row_norm_add_mul_fp32"] == 0.030
    assert goals["groupnorm32_fwdbwd_fp16"] == 0.07
    assert goals["layernorm_bf16"] == goals["rmsnorm_bf16"] == 0.032
    assert goals["layernorm_fwdbwd_bf16"] == goals["rmsnorm_fwdbwd_bf16"] == 0.085
    assert goals["layernorm_kb40_fp32"] == 0.14
    assert goals["rmsnorm2d_kb36_fp32"] == 3.9
    assert goals["add_rmsnorm_bf16"] == 0.066
    for name in ("seed002_model_fp32", "module_overhead"):
        assert goals[name] is None
        assert bench.WORKLOADS_BY_NAME[name].goal_text == "<= eager"
    for workload in bench.WORKLOADS:
        assert workload.dtype in bench.TOLERANCES
        assert workload.measure in ("throughput", "overhead")


def test_registry_shapes() -> None:
    by_name = bench.WORKLOADS_BY_NAME
    assert by_name["instancenorm2d_fp32"].input_shapes == ((112, 64, 512, 512),)
    assert by_name["instancenorm2d_fp32"].shapes(quick=True) == ((28, 64, 512, 512),)
    assert by_name["batchnorm2d_train_fp32"].input_shapes == ((64, 64, 512, 512),)
    assert by_name["groupnorm32_fp16_cl"].channels_last
    assert not by_name["groupnorm32_fp16"].channels_last
    assert by_name["row_norm_add_mul_fp32"].input_shapes == ((1024, 8192), (1024, 8192))
    # small workloads keep their shape in --quick runs
    assert by_name["groupnorm32_fp16"].shapes(quick=True) == ((16, 320, 64, 64),)
    assert by_name["batchnorm2d_fwdbwd_fp32"].backward
    assert by_name["groupnorm8_fp32"].eager.describe() == "GroupNorm(8, 64)"
    assert by_name["groupnorm8_fp32"].cupynorm.namespace == "cupynorm.torch"


def test_registry_group_norm_silu_rows() -> None:
    """The fused GroupNorm + SiLU rows: the diffusion shape in both layouts, torch's unfused
    sequence against GroupNormAct (same state_dict, same output on the CPU)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    by_name = bench.WORKLOADS_BY_NAME
    nchw, cl = by_name["groupnorm32_silu_fp16"], by_name["groupnorm32_silu_fp16_cl"]
    assert nchw.input_shapes == cl.input_shapes == ((16, 320, 64, 64),)
    assert (nchw.channels_last, cl.channels_last) == (False, True)
    assert nchw.dtype == cl.dtype == "float16"
    assert by_name["groupnorm32_silu_fwdbwd_fp16"].backward
    eager, fused = bench.models.build_module(nchw.eager), bench.models.build_module(nchw.cupynorm)
    assert eager.state_dict().keys() == fused.state_dict().keys()
    torch.nn.init.normal_(eager.weight)
    torch.nn.init.normal_(eager.bias)
    fused.load_state_dict(eager.state_dict())
    x = torch.randn(2, 320, 3, 5)
    unfused = F.silu(F.group_norm(x, 32, eager.weight, eager.bias, eager.eps))
    torch.testing.assert_close(eager(x), unfused)
    torch.testing.assert_close(fused(x), unfused)


def test_select_workloads_all_by_default() -> None:
    assert bench.select_workloads(None) == list(bench.WORKLOADS)
    assert bench.select_workloads([]) == list(bench.WORKLOADS)


def test_select_workloads_comma_lists_and_repeats_in_registry_order() -> None:
    chosen = bench.select_workloads(
        ["module_overhead,groupnorm8_fp32", " instancenorm2d_fp32 ", "groupnorm8_fp32"]
    )
    assert [w.name for w in chosen] == ["instancenorm2d_fp32", "groupnorm8_fp32", "module_overhead"]


def test_select_workloads_unknown_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown workload.*nope.*choose from: instancenorm2d"):
        bench.select_workloads(["groupnorm8_fp32,nope"])


# ------------------------------------------------------------------------------------------------
# Arguments and exits
# ------------------------------------------------------------------------------------------------


def test_parser_accepts_every_option() -> None:
    args = build_parser().parse_args(
        [
            "bench",
            "--quick",
            "--only",
            "a,b",
            "--only",
            "c",
            "--json",
            "out.json",
            "--plot",
            "out.png",
            "--no-compile",
            "--reps",
            "7",
        ]
    )
    assert args.command == "bench"
    assert args.quick and args.no_compile and not args.list
    assert args.only == ["a,b", "c"]
    assert args.json == "out.json" and args.plot == "out.png"
    assert args.reps == 7


def test_parser_defaults() -> None:
    args = build_parser().parse_args(["bench"])
    assert not args.quick and not args.no_compile
    assert args.only is None and args.json is None and args.plot is None and args.reps is None


@pytest.mark.parametrize("reps", ["0", "-3", "many"])
def test_bad_reps_is_a_usage_error(reps: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--reps", reps]) == 2
    assert "positive integer" in capsys.readouterr().err


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: cupynorm" in capsys.readouterr().err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--quick", "--only", "--json", "--plot", "--no-compile", "--reps"):
        assert option in out


def test_help_needs_neither_torch_nor_cupy() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['cupy'] = None\n"
        "from cupynorm.__main__ import main\n"
        "sys.exit(main(['bench', '--help']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout


def test_python_dash_m_cupynorm_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cupynorm", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "bench" in done.stdout


def test_list_needs_no_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for name in EXPECTED_WORKLOADS:
        assert name in out


def test_unknown_workload_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--only", "nope"]) == 2
    assert "unknown workload(s): nope" in capsys.readouterr().err


def test_no_gpu_exits_2_with_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")

    class NoGpu(bench.CudaDevice):
        def is_available(self) -> bool:
            return False

    monkeypatch.setattr(bench.timing, "cuda", NoGpu())
    assert main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "torch.cuda.is_available() is False" in err


def test_no_torch_exits_2_with_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["bench"]) == 2
    assert "PyTorch is needed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Arithmetic
# ------------------------------------------------------------------------------------------------


def test_bytes_moved_forward_is_one_read_and_one_write() -> None:
    workload = bench.WORKLOADS_BY_NAME["instancenorm2d_fp32"]
    assert bench.bytes_moved(workload) == 2 * 112 * 64 * 512 * 512 * 4 == 15_032_385_536
    assert bench.bytes_moved(workload, quick=True) == 2 * 28 * 64 * 512 * 512 * 4
    batchnorm = bench.WORKLOADS_BY_NAME["batchnorm2d_train_fp32"]
    assert bench.bytes_moved(batchnorm) == 2 * 64 * 64 * 512 * 512 * 4


def test_bytes_moved_fp16_row_and_backward_workloads() -> None:
    by_name = bench.WORKLOADS_BY_NAME
    assert bench.bytes_moved(by_name["groupnorm32_fp16_cl"]) == 2 * 16 * 320 * 64 * 64 * 2
    assert bench.bytes_moved(by_name["batchnorm2d_train_fp16_cl"]) == 2 * 256 * 64 * 112 * 112 * 2
    # row norm + add + mul: read x, read y, write out
    assert bench.bytes_moved(by_name["row_norm_add_mul_fp32"]) == 3 * 1024 * 8192 * 4
    # fwd + bwd: fwd reads x, writes y; bwd reads x and dy, writes dx
    fwdbwd = by_name["instancenorm2d_affine_fwdbwd_fp32"]
    assert fwdbwd.tensor_passes == 5
    assert bench.bytes_moved(fwdbwd) == 5 * 32 * 64 * 256 * 256 * 4
    assert bench.bytes_moved(by_name["groupnorm32_fwdbwd_fp16"]) == 5 * 16 * 320 * 64 * 64 * 2
    assert bench.bytes_moved(by_name["seed002_model_fp32"]) is None
    assert bench.bytes_moved(by_name["module_overhead"]) is None


def test_throughput_and_speedup() -> None:
    assert bench.throughput_tbps(4_000_000_000, 1.0) == pytest.approx(4.0)
    # the DESIGN's first goal: 3.9 ms is 91% of 4.24 TB/s for one read + one write
    workload = bench.WORKLOADS_BY_NAME["instancenorm2d_fp32"]
    tbps = bench.throughput_tbps(bench.bytes_moved(workload), 3.9)
    assert tbps / bench.H200_COPY_TBPS == pytest.approx(0.91, abs=0.005)
    assert bench.speedup(8.0, 4.0) == 2.0
    assert bench.speedup(None, 4.0) is None
    assert bench.speedup(8.0, None) is None


def test_goal_scaling() -> None:
    workload = bench.WORKLOADS_BY_NAME["instancenorm2d_fp32"]
    h200 = "NVIDIA H200"
    assert bench.goal_ms_for_run(workload, False, 4.0, h200) == pytest.approx(3.9)
    assert bench.goal_ms_for_run(workload, True, 4.0, h200) == pytest.approx(3.9 / 4)
    slower = bench.goal_ms_for_run(workload, False, bench.H200_COPY_TBPS / 2, "NVIDIA H100")
    assert slower == pytest.approx(7.8)
    small = bench.WORKLOADS_BY_NAME["groupnorm32_fp16"]
    assert bench.goal_ms_for_run(small, True, 4.0, h200) == pytest.approx(0.025)
    relative = bench.WORKLOADS_BY_NAME["seed002_model_fp32"]
    assert bench.goal_ms_for_run(relative, False, 4.0, h200) is None


def test_choose_reps_fills_the_budget_within_bounds() -> None:
    budget = bench.TimingBudget(
        budget_ms=100.0, min_reps=5, max_reps=50, overhead_calls=10, overhead_trials=2
    )
    assert bench.choose_reps(10.0 - bench.PER_REP_OVERHEAD_MS, budget) == 10
    assert bench.choose_reps(1000.0, budget) == 5
    assert bench.choose_reps(0.0, budget) == 50


def test_l2_flush_bytes() -> None:
    assert bench.l2_flush_bytes(60 * 1024**2) == 256 * 1024**2
    assert bench.l2_flush_bytes(200 * 1024**2) == 400 * 1024**2
    assert bench.l2_flush_bytes(0) == 256 * 1024**2


# ------------------------------------------------------------------------------------------------
# Table, JSON, plot
# ------------------------------------------------------------------------------------------------


def _fake_results() -> list[bench.WorkloadResult]:
    by_name = bench.WORKLOADS_BY_NAME
    good = bench.WorkloadResult(
        workload=by_name["instancenorm2d_fp32"],
        quick=False,
        checks=[bench.TensorCheck("y", 1e-6, 0.01, True)],
        impls=[
            bench.ImplResult(bench.IMPL_EAGER, ms=8.0, reps=10, peak_extra_bytes=7_516_192_768),
            bench.ImplResult(bench.IMPL_COMPILE, ms=5.0, reps=10, compile_s=3.0),
            bench.ImplResult(bench.IMPL_CUPYNORM, ms=3.8, reps=10),
        ],
    )
    compile_failed = bench.WorkloadResult(
        workload=by_name["seed002_model_fp32"],
        quick=False,
        checks=[bench.TensorCheck("y", 1e-6, 0.01, True)],
        impls=[
            bench.ImplResult(bench.IMPL_EAGER, ms=2.0),
            bench.ImplResult(bench.IMPL_COMPILE, error="BackendCompilerFailed: a | b"),
            bench.ImplResult(bench.IMPL_CUPYNORM, ms=2.1),
        ],
    )
    wrong = bench.WorkloadResult(
        workload=by_name["groupnorm32_fp16"],
        quick=True,
        checks=[bench.TensorCheck("y", 2.5, math.inf, False)],
        impls=[
            bench.ImplResult(bench.IMPL_EAGER, ms=0.1),
            bench.ImplResult(bench.IMPL_CUPYNORM, error="WRONG: y max abs error 2.5"),
        ],
    )
    setup_failed = bench.WorkloadResult(
        workload=by_name["batchnorm2d_train_fp32"], quick=False, error="setup failed: OOM"
    )
    return [good, compile_failed, wrong, setup_failed]


def _table_cells(table: str) -> list[list[str]]:
    """Split a markdown table into cells (pipes escaped as \\| stay inside a cell)."""
    rows = []
    for line in table.splitlines():
        assert line.startswith("| ") or line.startswith("|-"), line
        cells = line.replace("\\|", "\x00").strip("|").split("|")
        rows.append([cell.strip().replace("\x00", "|") for cell in cells])
    return rows


def test_markdown_table_on_fake_numbers() -> None:
    table = bench.format_markdown_table(_fake_results(), copy_tbps=4.0, gpu_name="NVIDIA H200")
    rows = _table_cells(table)
    assert rows[0] == list(bench.TABLE_COLUMNS)
    assert all(len(row) == len(bench.TABLE_COLUMNS) for row in rows), table
    by_key = {(row[0], row[1]): row for row in rows[2:]}

    eager = by_key[("instancenorm2d_fp32", "torch eager")]
    assert eager[2] == "8"
    assert eager[3] == f"{15_032_385_536 / 8e-3 / 1e12:.2f}"  # 1.88 TB/s
    assert eager[4] == "47%"
    assert eager[5] == "1.00x" and eager[6] == "0.62x"
    assert eager[8] == "7516"  # peak extra MB
    cupynorm = by_key[("instancenorm2d_fp32", "cupynorm")]
    assert cupynorm[2] == "3.8"
    assert cupynorm[5] == "2.11x" and cupynorm[6] == "1.32x"
    assert cupynorm[7] == "3.9 (met)"

    compiled = by_key[("seed002_model_fp32", "torch.compile")]
    assert compiled[2].startswith("ERROR: BackendCompilerFailed: a | b")
    seed002 = by_key[("seed002_model_fp32", "cupynorm")]
    assert seed002[3] == "-"  # GEMM-bound: no TB/s
    assert seed002[6] == "-"  # compile failed: no ratio
    assert seed002[7] == "<= eager (missed)"

    wrong = by_key[("groupnorm32_fp16", "cupynorm")]
    assert wrong[2] == "ERROR: WRONG: y max abs error 2.5"
    assert by_key[("batchnorm2d_train_fp32", "-")][2] == "ERROR: setup failed: OOM"


def test_notes_name_the_traffic_and_the_gpu() -> None:
    notes = bench.format_notes(_fake_results(), 4.0, "NVIDIA H100 80GB HBM3", quick=True)
    assert "NVIDIA H100" in notes and "4.00 TB/s" in notes
    assert "scaled to the --quick shapes" in notes and "copy bandwidth" in notes
    assert "read x, write y" in notes


def test_failure_flags() -> None:
    good, compile_failed, wrong, setup_failed = _fake_results()
    assert not good.failed
    assert not compile_failed.failed  # torch.compile failing is not cupynorm's failure
    assert wrong.failed and wrong.cupynorm_wrong
    assert setup_failed.failed


def test_results_to_json_is_strict_json() -> None:
    report = bench.results_to_json(
        _fake_results(),
        environment={"gpu": "NVIDIA H200", "date": "2026-11-22T00:00:00+00:00", "torch": "x"},
        copy_tbps=4.0,
        quick=False,
        exit_code=1,
    )
    text = json.dumps(report, allow_nan=False)
    loaded = json.loads(text)
    assert loaded["gpu"] == "NVIDIA H200" and loaded["copy_bandwidth_tbps"] == 4.0
    first = loaded["workloads"][0]
    assert first["name"] == "instancenorm2d_fp32"
    assert first["bytes_moved"] == 15_032_385_536
    assert first["goal_met"] is True
    cupynorm = first["impls"][2]
    assert cupynorm["speedup_vs_eager"] == pytest.approx(8.0 / 3.8)
    assert loaded["workloads"][2]["checks"][0]["worst_ratio_to_tolerance"] == "inf"


def test_plot_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bench.matplotlib_available() is False


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    bench.plot_results(_fake_results(), 4.0, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------
# compare_tensors (CPU tensors)
# ------------------------------------------------------------------------------------------------


def test_compare_tensors_normalizes_by_rms() -> None:
    torch = pytest.importorskip("torch")
    tolerance = bench.TOLERANCES["float32"]
    expected = torch.rand(4, 8, 16, 16) * 1000
    # an error of 0.05 is 5e-5 of the RMS (~577): within atol = 1e-4 after normalizing
    check = bench.compare_tensors("y", expected + 0.05, expected, tolerance)
    assert check.ok and check.max_abs_error == pytest.approx(0.05, rel=1e-3)
    check = bench.compare_tensors("y", expected + 5.0, expected, tolerance)
    assert not check.ok and check.worst_ratio > 1


def test_compare_tensors_catches_nan_shape_and_dtype() -> None:
    torch = pytest.importorskip("torch")
    tolerance = bench.TOLERANCES["float32"]
    expected = torch.rand(3, 5)
    poisoned = expected.clone()
    poisoned[1, 2] = float("nan")
    assert not bench.compare_tensors("y", poisoned, expected, tolerance).ok
    assert not bench.compare_tensors("y", expected.view(5, 3), expected, tolerance).ok
    mismatch = bench.compare_tensors("y", expected.double(), expected, tolerance)
    assert not mismatch.ok and "dtype" in mismatch.note


def test_compare_tensors_across_layouts_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bench.checking, "COMPARE_CHUNK_ELEMENTS", 7)
    expected = torch.rand(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    same_values_nchw = expected.contiguous()
    check = bench.compare_tensors("y", same_values_nchw, expected, bench.TOLERANCES["float32"])
    assert check.ok and check.max_abs_error == 0.0
    assert "strides" in check.note
    shifted = expected.clone()
    shifted[1, 2, 3, 4] += 1.0
    assert not bench.compare_tensors("y", shifted, expected, bench.TOLERANCES["float32"]).ok


# ------------------------------------------------------------------------------------------------
# Dry run of the whole pipeline on the CPU (fake CUDA events, a fake cupynorm.torch)
# ------------------------------------------------------------------------------------------------


class _FakeEvent:
    """Stands in for a CUDA event: host wall clock (the CPU ops are synchronous)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def record(self, stream: object = None) -> None:
        self.seconds = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.seconds - self.seconds) * 1e3


class CpuStandIn(bench.CudaDevice):
    """The bench's device facade answered on the CPU: the bench's only door to the GPU is
    `bench.timing.cuda`, so swapping that object runs the bench here without touching torch."""

    def __init__(self) -> None:
        self.spins: list[float] = []  # the GPU's leads over the host asked for, ms

    def is_available(self) -> bool:
        return True

    def device(self):
        import torch

        return torch.device("cpu")

    def spin(self, ms: float) -> None:
        self.spins.append(ms)

    def synchronize(self) -> None:
        pass

    def event(self) -> _FakeEvent:
        return _FakeEvent()

    def properties(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(total_memory=1 << 30, L2_cache_size=1 << 20)

    def name(self) -> str:
        return "Fake GPU (CPU)"

    def reset_peak_memory_stats(self) -> None:
        pass

    def memory_allocated(self) -> int:
        return 1000

    def max_memory_allocated(self) -> int:
        return 3_000_000

    def empty_cache(self) -> None:
        pass

    def capture_graph(self, step, warmup: int):
        # No graphs on the CPU: the warm-up and the captured call run eagerly, replays call step.
        for _ in range(warmup + 1):
            step()
        return step

    def profile(self):
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU])

    def kernel_events(self, profiler) -> list[tuple[str, float]]:
        # torch's CPU ops stand in for kernels (aten::batch_norm etc. count as norm kernels).
        return [
            (event.name, float(event.self_cpu_time_total))
            for event in profiler.events()
            if event.name.startswith("aten::")
        ]


def _fake_cupynorm_torch(torch: types.ModuleType, wrong: bool) -> types.ModuleType:
    """torch.nn's modules under cupynorm.torch's names (InstanceNorm2d wrong when asked)."""
    fake = types.ModuleType("cupynorm.torch")
    fake.GroupNorm = torch.nn.GroupNorm
    fake.BatchNorm2d = torch.nn.BatchNorm2d
    fake.InstanceNorm2d = torch.nn.InstanceNorm2d

    if wrong:

        class WrongInstanceNorm2d(torch.nn.InstanceNorm2d):
            def forward(self, x):
                return super().forward(x) + 0.01

        fake.InstanceNorm2d = WrongInstanceNorm2d

    def row_norm_add_mul(x, y, eps=1e-5):
        return (torch.nn.functional.layer_norm(x, x.shape[-1:], eps=eps) + y) * y

    class RowNormAddMul(torch.nn.Module):
        def __init__(self, eps: float = 1e-5) -> None:
            super().__init__()
            self.eps = eps

        def forward(self, x, y):
            return row_norm_add_mul(x, y, self.eps)

    fake.row_norm_add_mul = row_norm_add_mul
    fake.RowNormAddMul = RowNormAddMul
    return fake


def _tiny(workload: bench.Workload) -> bench.Workload:
    """The workload at a CPU-friendly size (channels and row length kept)."""
    shapes = tuple(
        (2, shape[1], 4, 4) if len(shape) == 4 else (4, shape[1]) for shape in workload.input_shapes
    )
    if workload.name == "seed002_model_fp32":
        eager = dataclasses.replace(workload.eager, args=(32, 8192))
        cupynorm = dataclasses.replace(workload.cupynorm, args=(32, 8192))
        workload = dataclasses.replace(workload, eager=eager, cupynorm=cupynorm)
        shapes = ((4, 32), (4, 8192))
    return dataclasses.replace(workload, input_shapes=shapes, quick_input_shapes=None)


@pytest.fixture
def cpu_dry_run(monkeypatch: pytest.MonkeyPatch):
    """Make the bench run on the CPU: fake CUDA queries and events, tiny shapes and buffers."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bench.timing, "cuda", CpuStandIn())
    monkeypatch.setattr(bench.timing, "MIN_FLUSH_BYTES", 1 << 16)
    monkeypatch.setattr(bench.timing, "COPY_BANDWIDTH_BYTES", 1 << 16)
    monkeypatch.setattr(
        bench.timing,
        "QUICK_BUDGET",
        dataclasses.replace(bench.timing.QUICK_BUDGET, overhead_calls=5),
    )
    tiny = tuple(_tiny(w) for w in bench.WORKLOADS)
    monkeypatch.setattr(bench.workloads, "WORKLOADS", tiny)
    monkeypatch.setattr(bench.workloads, "WORKLOADS_BY_NAME", {w.name: w for w in tiny})

    def use_cupynorm(wrong: bool = False) -> None:
        monkeypatch.setitem(sys.modules, "cupynorm.torch", _fake_cupynorm_torch(torch, wrong))

    return use_cupynorm


DRY_RUN_WORKLOADS = (
    "instancenorm2d_fp32,row_norm_add_mul_fp32,groupnorm32_fp16_cl,batchnorm2d_fwdbwd_fp32,"
    "seed002_model_fp32,module_overhead"
)


def test_dry_run_end_to_end(
    cpu_dry_run,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys,
) -> None:
    cpu_dry_run()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    json_path = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--no-compile", "--reps", "2", "--only", DRY_RUN_WORKLOADS]
    exit_code = main(argv + ["--json", str(json_path), "--plot", str(tmp_path / "b.png")])
    captured = capsys.readouterr()
    assert exit_code == 0, captured.err
    assert "--plot needs matplotlib" in captured.err
    assert "[6/6] module_overhead done" in captured.err
    assert "check running_var after one call: ok" in captured.err
    assert "check dweight: ok" in captured.err
    # the table comes last, one row per workload and implementation
    table = captured.out[captured.out.index("| workload |") :].strip()
    rows = _table_cells(table)
    assert len(rows) == 2 + 6 * 2
    assert all("ERROR" not in cell for row in rows for cell in row), table
    report = json.loads(json_path.read_text())
    assert report["exit_code"] == 0 and report["gpu"] == "Fake GPU (CPU)"
    assert [w["name"] for w in report["workloads"]] == DRY_RUN_WORKLOADS.split(",")
    for workload in report["workloads"]:
        assert all(check["ok"] for check in workload["checks"]) and workload["checks"]
        assert [impl["impl"] for impl in workload["impls"]] == ["torch eager", "cupynorm"]
        assert all(impl["ms"] > 0 for impl in workload["impls"])


@pytest.mark.parametrize(
    "workload, lead",
    [("instancenorm2d_fp32", bench.timing.HOST_LEAD_MS), ("batchnorm2d_fwdbwd_fp32", None)],
)
def test_forward_rows_time_the_gpu_alone(cpu_dry_run, capsys, workload, lead) -> None:
    """Forward rows queue a spin before each repetition (the GPU's lead: a slow host's issue
    time never shows); forward + backward rows time the call as a loop runs it, host included."""
    cpu_dry_run()
    argv = ["bench", "--quick", "--no-compile", "--reps", "3", "--only", workload]
    assert main(argv) == 0, capsys.readouterr().err
    spins = bench.timing.cuda.spins
    if lead is None:
        assert spins == []
    else:  # each implementation: its warm-up calls untimed, then the 3 repetitions
        assert spins == [lead] * 6


def test_dry_run_leaves_torch_alone(cpu_dry_run, capsys) -> None:
    """The dry run swaps the bench's facade only: torch.cuda's own functions stay torch's."""
    torch = pytest.importorskip("torch")
    cpu_dry_run()
    torch.cuda.device_count()  # fills torch's own lazy cache (_cached_device_count) first
    before = dict(vars(torch.cuda))
    argv = ["bench", "--quick", "--no-compile", "--reps", "2", "--only", "module_overhead"]
    assert main(argv) == 0, capsys.readouterr().err
    after = vars(torch.cuda)
    assert [name for name, value in before.items() if after.get(name) is not value] == []


def test_dry_run_wrong_cupynorm_exits_1(cpu_dry_run, capsys) -> None:
    cpu_dry_run(wrong=True)
    argv = ["bench", "--quick", "--no-compile", "--reps", "2", "--only", "instancenorm2d_fp32"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "cupynorm is WRONG on instancenorm2d_fp32" in captured.err
    assert "max abs error 0.01" in captured.err
    assert "FAILED instancenorm2d_fp32" in captured.err
    assert "| instancenorm2d_fp32 | cupynorm | ERROR: WRONG" in captured.out


def test_dry_run_missing_cupynorm_is_a_row_error_and_exit_1(
    cpu_dry_run,
    monkeypatch: pytest.MonkeyPatch,
    capsys,
) -> None:
    cpu_dry_run()
    monkeypatch.setitem(sys.modules, "cupynorm.torch", None)  # import fails
    argv = ["bench", "--quick", "--no-compile", "--reps", "2", "--only", "module_overhead"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "| module_overhead | torch eager | " in captured.out
    assert "| module_overhead | cupynorm | ERROR: building the module failed" in captured.out


def test_the_environment_records_where_calls_run() -> None:
    """The JSON's ``routing``: cupynorm.torch's policies in effect when the rows ran."""
    pytest.importorskip("torch")
    import cupynorm.torch as cnt
    from cupynorm.bench import cli

    previous = cnt.set_capture_min_bytes({"group_norm": 7})
    try:
        routing = cli._routing()
    finally:
        cnt.set_capture_min_bytes(previous)
    assert routing is not None
    assert routing["capture_min_bytes"]["group_norm"] == 7
    assert routing["eager_min_bytes"] == cnt.eager_min_bytes()
    assert routing["compile_kernels"] == sorted(cnt.compile_kernels())
    assert type(routing["eager_adaptive"]) is bool
    assert json.loads(json.dumps(routing)) == routing  # into the report as it is
