"""The bench's models group (`--only models`) without a GPU: selection, kernel accounting,
failure rules, the table and JSON, and a dry run of whole training steps on the CPU through the
bench's device facade (tiny models, no timing assertions)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import warnings
from pathlib import Path

import pytest
from test_bench_cpu import CpuStandIn, _table_cells

from cupynorm import bench
from cupynorm.__main__ import main
from cupynorm.bench import train

MODEL_NAMES = [
    "resnet50_b64_bf16_cl",
    "resnet50_b256_bf16_cl",
    "efficientnet_b0_b64_bf16_cl",
    "convnext_tiny_b64_bf16_cl",
    "vit_base_b64_bf16",
    "gn_blocks_fp16_cl",
    "gn_blocks_fp16",
    "unet_blocks_fp16",
    "unet_blocks_fp16_cl",
    "unet_blocks_autocast_fp16",
    "unet_blocks_autocast_fp16_cl",
    "llama_8l_h2048_s2048_b4_bf16",
]
# the end-to-end dry run's models (the Llama row has a dry run of its own: transformers' RMSNorm
# is elementwise torch ops, no norm kernel to count on the CPU)
DRY_RUN_NAMES = MODEL_NAMES[:-1]

# ------------------------------------------------------------------------------------------------
# Registry and selection
# ------------------------------------------------------------------------------------------------


def test_model_workloads() -> None:
    assert [w.name for w in bench.MODEL_WORKLOADS] == MODEL_NAMES
    by_name = bench.MODEL_WORKLOADS_BY_NAME
    b64, b256 = by_name["resnet50_b64_bf16_cl"], by_name["resnet50_b256_bf16_cl"]
    assert b64.input_shape == (64, 3, 224, 224) and b256.input_shape == (256, 3, 224, 224)
    assert b64.model == b256.model == "resnet50"
    assert b64.autocast == "bfloat16" and b64.channels_last and b64.loss == "cross_entropy"
    assert b256.accuracy_batch == 64
    gn_cl, gn = by_name["gn_blocks_fp16_cl"], by_name["gn_blocks_fp16"]
    assert gn_cl.input_shape == gn.input_shape == (16, 320, 64, 64)
    assert gn_cl.dtype == gn.dtype == "float16" and gn_cl.autocast is None
    assert gn_cl.channels_last and not gn.channels_last
    unet_amp = by_name["unet_blocks_autocast_fp16_cl"]
    assert unet_amp.model == "unet_resnet_blocks" and unet_amp.input_shape == gn.input_shape
    assert unet_amp.dtype == "float32" and unet_amp.autocast == "float16" and unet_amp.channels_last
    assert not by_name["unet_blocks_autocast_fp16"].channels_last
    llama = by_name["llama_8l_h2048_s2048_b4_bf16"]
    assert llama.input_shape == (4, 2048, 2048) and llama.layers == 8 and llama.dtype == "bfloat16"
    assert llama.convert == "llama_rms_norm" and llama.loss == "token_cross_entropy"
    assert llama.accuracy_batch == 1
    convnext = by_name["convnext_tiny_b64_bf16_cl"]
    assert convnext.input_shape == (64, 3, 224, 224) and convnext.autocast == "bfloat16"
    assert convnext.channels_last and convnext.convert == "layer_norms"
    vit = by_name["vit_base_b64_bf16"]
    assert vit.autocast == "bfloat16" and not vit.channels_last and vit.model == "vit_base"
    converts = {
        "llama": "llama_rms_norm",
        "convnext_tiny": "layer_norms",
        "vit_base": "layer_norms",
    }
    for workload in bench.MODEL_WORKLOADS:
        assert workload.model in bench.models.MODEL_FACTORIES
        assert workload.convert == converts.get(workload.model, "fuse")


def test_models_group_is_not_in_the_default_run() -> None:
    assert bench.select_workloads(None) == list(bench.WORKLOADS)
    chosen = bench.select_workloads(["models"])
    assert [w.name for w in chosen] == MODEL_NAMES


def test_models_group_beside_other_names_in_registry_order() -> None:
    chosen = bench.select_workloads(["gn_blocks_fp16,models", "module_overhead"])
    assert [w.name for w in chosen] == ["module_overhead", *MODEL_NAMES]
    chosen = bench.select_workloads(["gn_blocks_fp16,kernels"])
    assert [w.name for w in chosen] == [w.name for w in bench.WORKLOADS] + ["gn_blocks_fp16"]


def test_unknown_name_lists_models_and_groups() -> None:
    with pytest.raises(ValueError, match="resnet50_b64_bf16_cl.*or a group: kernels, models"):
        bench.select_workloads(["nope"])


def test_list_shows_the_models_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    counts = f"groups: kernels ({len(bench.WORKLOADS)}), models ({len(bench.MODEL_WORKLOADS)})"
    assert "--only models" in out and counts in out
    for name in MODEL_NAMES:
        assert name in out


def test_strip_norms_leaves_no_norm_layer() -> None:
    torch = pytest.importorskip("torch")
    model = bench.models.gn_resnet_blocks(bench.MODEL_WORKLOADS_BY_NAME["gn_blocks_fp16_cl"])
    x = torch.randn(1, 320, 4, 4)
    stripped = bench.models.strip_norms(model)
    assert stripped is model and bench.models.count_norm_layers(model) == 0
    assert any(isinstance(m, torch.nn.Identity) for m in model.modules())
    assert model(x).shape == x.shape


def test_gn_blocks_model_shape() -> None:
    torch = pytest.importorskip("torch")
    workload = dataclasses.replace(
        bench.MODEL_WORKLOADS_BY_NAME["gn_blocks_fp16"], input_shape=(2, 64, 8, 8)
    )
    model = bench.models.build_model(workload)
    assert bench.models.count_norm_layers(model) == 8
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert {(m.num_groups, m.num_channels) for m in norms} == {(32, 64)}
    x = torch.randn(2, 64, 8, 8)
    assert model(x).shape == x.shape


def test_unet_blocks_model_fuses_the_time_embedding() -> None:
    """The blocks with a time embedding: 8 GroupNorms, and fuse folds each block's embedding add
    before norm2 and both SiLUs (outputs and gradients as before: the CPU reference path)."""
    torch = pytest.importorskip("torch")
    import cupynorm.torch as cnt

    workload = dataclasses.replace(
        bench.MODEL_WORKLOADS_BY_NAME["unet_blocks_fp16"], input_shape=(2, 64, 8, 8)
    )
    model = bench.models.build_model(workload)
    assert bench.models.count_norm_layers(model) == 8
    x = torch.randn(2, 64, 8, 8)
    expected = model(x)
    fused_report: list[str] = []
    fused = cnt.fuse(model, report=fused_report)
    assert sorted(fused_report) == sorted(
        [f"blocks.{i}.norm1 + silu" for i in range(4)]
        + [f"blocks.{i}.norm2 + shift + silu" for i in range(4)]
    )
    torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Kernel accounting, accuracy rule, failure rule
# ------------------------------------------------------------------------------------------------

TORCH_BN = "void at::native::batch_norm_collect_statistics_channels_last_kernel<float>(...)"
CUDNN_BN = "cudnn::bn_fw_tr_1C11_singleread_spec<__nv_bfloat16, 512, true, 1, 2, 0>"
TORCH_GN = "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<c10::Half>(...)"
TORCH_GN_LAMBDA = (
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
    "at::native::(anonymous namespace)::GroupNorm1dForward<c10::Half>(...)::{lambda()#1}>(...)"
)
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"


@pytest.mark.parametrize(
    "name",
    [
        TORCH_BN,
        CUDNN_BN,
        TORCH_GN,
        TORCH_GN_LAMBDA,
        "void at::native::welford_kernel_c_last<float, float, float, 4, 4>",
        "strided_norm_stats_cols",
        "segment_norm_fwd_affine",
        "strided_norm_bwd_finalize",
    ],
)
def test_norm_kernels_are_recognized(name: str) -> None:
    assert train.is_norm_kernel(name)


@pytest.mark.parametrize("name", [GEMM, ADD, "Memcpy DtoD (Device -> Device)"])
def test_other_kernels_are_not_norm_kernels(name: str) -> None:
    assert not train.is_norm_kernel(name)


def test_cupynorm_kernel_names_match_the_patterns() -> None:
    """Every `extern "C" __global__` kernel in cuda_src counts as a norm kernel."""
    import re

    sources = Path(__file__).resolve().parents[1] / "cuda_src"
    names = set()
    for path in sources.glob("*.cu"):
        text = path.read_text()
        declared = r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)'
        names.update(name for name in re.findall(declared, text) if not name.isupper())
        names.update(re.findall(r"^\w+_ENTRY\((\w+),", text, re.MULTILINE))  # macro-made
    assert len(names) >= 10 and "row_norm_bwd_cast_4" in names
    assert [name for name in names if not train.is_norm_kernel(name)] == []


def test_summarize_kernels_per_step() -> None:
    events = [(TORCH_BN, 100.0), (GEMM, 300.0), (TORCH_BN, 50.0), (ADD, 10.0), (CUDNN_BN, 40.0)]
    summary = train.summarize_kernels(events, steps=2)
    assert summary.kernel_ms == pytest.approx(0.25)
    assert summary.norm_kernel_ms == pytest.approx(0.095)
    assert summary.kernels == 2.5 and summary.norm_kernels == 1.5
    assert list(summary.norm_kernel_ms_by_name) == [TORCH_BN, CUDNN_BN]
    assert summary.norm_kernel_ms_by_name[TORCH_BN] == pytest.approx(0.075)


def test_real_facade_keeps_cuda_kernels_only() -> None:
    pytest.importorskip("torch")
    from torch.autograd import DeviceType

    def event(name: str, device_type, us: float, annotation=False) -> types.SimpleNamespace:
        span = types.SimpleNamespace(elapsed_us=lambda: us)
        return types.SimpleNamespace(
            name=name, device_type=device_type, time_range=span, is_user_annotation=annotation
        )

    profiler = types.SimpleNamespace(
        events=lambda: [
            event("aten::batch_norm", DeviceType.CPU, 90.0),
            event(TORCH_BN, DeviceType.CUDA, 12.0),
            event("Memcpy HtoD (Pageable -> Device)", DeviceType.CUDA, 5.0),
            event("Memset (Device)", DeviceType.CUDA, 1.0),
            event("Optimizer.step#SGD.step", DeviceType.CUDA, 300.0, annotation=True),
            event("strided_norm_apply_cols", DeviceType.CUDA, 7.0),
        ]
    )
    kernels = bench.CudaDevice().kernel_events(profiler)
    assert kernels == [(TORCH_BN, 12.0), ("strided_norm_apply_cols", 7.0)]


def test_accuracy_rule() -> None:
    check = bench.AccuracyCheck(
        batch=2, output_torch=1e-5, output_cupynorm=2e-5, grad_torch=0.02, grad_cupynorm=0.01
    )
    assert check.ok
    check.output_cupynorm = 2.1e-5 + bench.checking.ACCURACY_FLOOR
    assert not check.output_ok and not check.ok
    check.output_cupynorm = 0.0
    check.grad_cupynorm = math.nan
    assert not check.grad_ok
    # errors near zero: the floor keeps equal-to-rounding results passing
    assert bench.checking.accuracy_ok(5e-7, 0.0)


def _model_result(**steps: tuple[float | None, str | None]) -> bench.ModelResult:
    """A ModelResult with steps given as mode_impl=(ms, error)."""
    result = bench.ModelResult(bench.MODEL_WORKLOADS[0], quick=False, norm_layers=53)
    for key, (ms, error) in steps.items():
        mode, impl = key.split("_")
        result.steps.append(bench.StepResult(mode, impl, ms=ms, error=error))
    return result


def test_failure_rule() -> None:
    ok = _model_result(eager_torch=(30.0, None), eager_cupynorm=(36.0, None))
    assert not ok.failed
    capture_failed = _model_result(
        graphed_torch=(20.0, None), graphed_cupynorm=(None, "RuntimeError: capture")
    )
    assert capture_failed.failure() == "cupynorm failed in mode graphed: RuntimeError: capture"
    both_failed = _model_result(
        compile_torch=(None, "BackendCompilerFailed"), compile_cupynorm=(None, "also")
    )
    assert not both_failed.failed  # torch failing too is not cupynorm's failure
    setup = bench.ModelResult(bench.MODEL_WORKLOADS[0], quick=False, error="setup failed: x")
    assert setup.failure() == "setup failed: x"
    inaccurate = _model_result(eager_torch=(30.0, None), eager_cupynorm=(36.0, None))
    inaccurate.accuracy = bench.AccuracyCheck(2, 1e-5, 1e-3, 1e-3, 1e-3)
    assert "less accurate than torch" in inaccurate.failure()


def test_models_table_and_json_on_fake_numbers() -> None:
    result = _model_result(
        eager_torch=(30.0, None),
        eager_cupynorm=(24.0, None),
        graphed_torch=(20.0, None),
        graphed_cupynorm=(None, "RuntimeError: operation not permitted when stream is capturing"),
    )
    result.accuracy = bench.AccuracyCheck(64, 2.4e-5, 2.5e-5, 0.02, 0.05)
    eager_cupynorm = result.step("eager", "cupynorm")
    eager_cupynorm.kernel_ms, eager_cupynorm.norm_kernel_ms = 14.6, 7.8
    eager_cupynorm.host_us, eager_cupynorm.norm_kernels = 24000.0, 318.0
    result.host_us_without_norms = 13400.0  # (24000 - 13400) / 53 = 200 us per norm layer
    missing = bench.ModelResult(
        bench.MODEL_WORKLOADS_BY_NAME["gn_blocks_fp16_cl"],
        quick=False,
        error="setup failed: ModuleNotFoundError: x",
    )
    rows = _table_cells(bench.format_models_table([result, missing]))
    assert rows[0] == list(bench.MODEL_TABLE_COLUMNS)
    assert all(len(row) == len(bench.MODEL_TABLE_COLUMNS) for row in rows)
    by_key = {tuple(row[:3]): row for row in rows[2:]}
    cupynorm = by_key[("resnet50_b64_bf16_cl", "eager", "cupynorm")]
    assert cupynorm[3:] == [
        "24",
        "1.25x",
        "14.6",
        "7.8",
        "24000",
        "200",
        "6.0",
        "2.5e-05",
        "0.05 (> 2x torch)",
    ]
    torch_row = by_key[("resnet50_b64_bf16_cl", "eager", "torch")]
    assert torch_row[4] == "1.00x" and torch_row[10:] == ["2.4e-05", "0.02"]
    assert torch_row[8] == "-"  # no host time measured for it
    graphed = by_key[("resnet50_b64_bf16_cl", "graphed", "cupynorm")]
    assert graphed[3].startswith("ERROR: RuntimeError: operation not permitted")
    assert graphed[10:] == ["", ""]  # accuracy only on eager rows
    assert (
        by_key[("gn_blocks_fp16_cl", "-", "-")][3] == "ERROR: setup failed: ModuleNotFoundError: x"
    )

    report = bench.results_to_json(
        [], environment={"gpu": "X"}, copy_tbps=None, quick=False, exit_code=1, models=[result]
    )
    loaded = json.loads(json.dumps(report, allow_nan=False))
    model = loaded["models"][0]
    assert model["norm_layers"] == 53 and model["accuracy"]["ok"] is False
    steps = {(s["mode"], s["impl"]): s for s in model["steps"]}
    assert steps[("eager", "cupynorm")]["speedup_vs_torch"] == pytest.approx(1.25)
    assert steps[("eager", "cupynorm")]["norm_launches_per_layer"] == pytest.approx(6.0)
    assert steps[("eager", "cupynorm")]["host_us_per_norm_layer"] == pytest.approx(200.0)
    assert model["host_us_without_norms"] == 13400.0
    assert "less accurate" in model["failure"]


# ------------------------------------------------------------------------------------------------
# Dry run on the CPU
# ------------------------------------------------------------------------------------------------


def _tiny_bn_net(workload: bench.ModelWorkload):
    """Stands in for resnet50: convs with BatchNorm2d, pooled to class logits."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, workload.num_classes),
    )


def _tiny_norm_act_net(workload: bench.ModelWorkload):
    """Stands in for efficientnet_b0: convs with norm-act layers shaped like timm's
    BatchNormAct2d (BatchNorm2d, then the module's own drop and act submodules)."""
    from torch import nn

    class NormAct(nn.BatchNorm2d):
        def __init__(self, channels: int) -> None:
            super().__init__(channels)
            self.drop, self.act = nn.Identity(), nn.SiLU()

        def forward(self, x):
            return self.act(self.drop(super().forward(x)))

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        NormAct(8),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        NormAct(8),
        NormAct(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, workload.num_classes),
    )


def _tiny_layer_norm_net(workload: bench.ModelWorkload):
    """Stands in for convnext_tiny: a LayerNorm2d-like stem norm (a torch.nn.LayerNorm subclass
    that permutes, as timm's), and a block normalizing NHWC rows with nn.LayerNorm."""
    from torch import nn

    class LayerNorm2d(nn.LayerNorm):
        def forward(self, x):
            x = x.permute(0, 2, 3, 1)
            x = nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
            return x.permute(0, 3, 1, 2)

    class Block(nn.Module):
        def __init__(self, channels: int) -> None:
            super().__init__()
            self.conv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
            self.norm = nn.LayerNorm(channels)
            self.mlp = nn.Linear(channels, channels)

        def forward(self, x):
            h = self.mlp(self.norm(self.conv(x).permute(0, 2, 3, 1)))
            return x + h.permute(0, 3, 1, 2)

    return nn.Sequential(
        nn.Conv2d(3, 8, 4, stride=4),
        LayerNorm2d(8),
        Block(8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, workload.num_classes),
    )


def _tiny_vit(workload: bench.ModelWorkload):
    """Stands in for vit_base: patches, a pre-norm MLP block with nn.LayerNorm over the tokens'
    rows, a final norm."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width, eps=1e-6)
            self.mlp = nn.Linear(width, width)

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patches = nn.Conv2d(3, 16, 4, stride=4)
            self.block = Block(16)
            self.norm = nn.LayerNorm(16, eps=1e-6)
            self.head = nn.Linear(16, workload.num_classes)

        def forward(self, x):
            tokens = self.patches(x).flatten(2).transpose(1, 2)
            return self.head(self.norm(self.block(tokens)).mean(1))

    return Net()


def _tiny_model_workload(workload: bench.ModelWorkload) -> bench.ModelWorkload:
    if workload.model in ("resnet50", "efficientnet_b0", "convnext_tiny", "vit_base"):
        return dataclasses.replace(
            workload, input_shape=(2, 3, 16, 16), num_classes=10, accuracy_batch=None
        )
    # NCHW: torch 2.13's CPU GroupNorm backward segfaults on a channels_last input that needs no
    # gradient (GroupNorm(32, 64) on a channels_last 2x64x8x8, then .sum().backward()), and the
    # first block's input is the batch. fp32: the CPU's fp16 kernels are not what is tested here.
    return dataclasses.replace(
        workload, input_shape=(2, 64, 8, 8), dtype="float32", channels_last=False
    )


@pytest.fixture
def models_dry_run(monkeypatch: pytest.MonkeyPatch):
    """The bench on the CPU: the device facade swapped, tiny models and batches, few steps."""
    pytest.importorskip("torch")
    monkeypatch.setattr(bench.timing, "cuda", CpuStandIn())
    monkeypatch.setattr(bench.timing, "COPY_BANDWIDTH_BYTES", 1 << 16)
    monkeypatch.setattr(bench.timing, "MIN_FLUSH_BYTES", 1 << 16)
    tiny = tuple(_tiny_model_workload(w) for w in bench.MODEL_WORKLOADS if w.model != "llama")
    monkeypatch.setattr(bench.workloads, "MODEL_WORKLOADS", tiny)
    monkeypatch.setattr(train, "WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "GRAPH_WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "HOST_STEPS", 2)
    # dynamo traces the models on the CPU; inductor's C++ compile would take minutes
    monkeypatch.setattr(train, "COMPILE_OPTIONS", {"backend": "eager"})

    def substitute_resnet50() -> None:
        monkeypatch.setitem(bench.models.MODEL_FACTORIES, "resnet50", _tiny_bn_net)
        monkeypatch.setitem(bench.models.MODEL_FACTORIES, "efficientnet_b0", _tiny_norm_act_net)
        monkeypatch.setitem(bench.models.MODEL_FACTORIES, "convnext_tiny", _tiny_layer_norm_net)
        monkeypatch.setitem(bench.models.MODEL_FACTORIES, "vit_base", _tiny_vit)

    return substitute_resnet50


def _models_table(out: str) -> list[list[str]]:
    return _table_cells(out[out.index("| model |") :].strip())


def test_models_dry_run_end_to_end(models_dry_run, tmp_path: Path, capsys) -> None:
    torch = pytest.importorskip("torch")
    models_dry_run()
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    # torch.cuda's functions and classes; its lazy-initialization state (`_initialized`, the
    # cached device count) may change when the run is the first to touch CUDA on a GPU machine
    before = {name: value for name, value in vars(torch.cuda).items() if callable(value)}
    json_path = tmp_path / "models.json"
    exit_code = main(["bench", "--reps", "2", "--only", "models", "--json", str(json_path)])
    captured = capsys.readouterr()
    assert exit_code == 0, captured.err
    # the bench restored what it changed, and replaced nothing of torch.cuda's
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == tf32
    after = vars(torch.cuda)
    assert [name for name, value in before.items() if after.get(name) is not value] == []

    assert "[11/11] unet_blocks_autocast_fp16_cl done" in captured.err
    assert "accuracy vs float64 (batch 2)" in captured.err and ": ok" in captured.err
    assert "| workload |" not in captured.out  # no kernel workloads: no kernel table
    assert "Models: whole training steps" in captured.out
    rows = _models_table(captured.out)
    assert len(rows) == 2 + len(DRY_RUN_NAMES) * 3 * 2
    body = rows[2:]
    assert all("ERROR" not in cell for row in body for cell in row), captured.out
    keys = [tuple(row[:3]) for row in body]
    for name in DRY_RUN_NAMES:
        for mode in ("eager", "graphed", "compile"):
            assert (name, mode, "torch") in keys and (name, mode, "cupynorm") in keys
    for row in body:
        assert float(row[3]) > 0 and row[4].endswith("x")
        eager_only = row[5:]
        if row[1] == "eager":
            assert all(cell not in ("-", "") for cell in eager_only), row
            float(row[8])  # host us per norm layer: a number (of either sign on a CPU dry run)
            assert float(row[9]) > 0  # norm launches per layer
        else:
            assert eager_only == ["-", "-", "-", "-", "-", "", ""], row

    report = json.loads(json_path.read_text())
    assert report["exit_code"] == 0 and report["workloads"] == []
    assert [m["name"] for m in report["models"]] == DRY_RUN_NAMES
    for model in report["models"]:
        assert model["error"] is None and model["failure"] is None
        assert model["accuracy"]["ok"] and model["accuracy"]["batch"] == 2
        norm_layers = {"resnet50": 2, "efficientnet_b0": 3, "convnext_tiny": 2, "vit_base": 2}
        assert model["norm_layers"] == norm_layers.get(model["model"], 8)
        assert len(model["steps"]) == 6
        eager = [s for s in model["steps"] if s["mode"] == "eager"]
        assert all(s["host_us"] > 0 and s["norm_kernel_ms_by_name"] for s in eager)
        assert model["host_us_without_norms"] > 0
        assert all(s["host_us_per_norm_layer"] is not None for s in eager)
        compiled = [s for s in model["steps"] if s["mode"] == "compile"]
        assert all(s["setup_s"] is not None and s["reps"] == 2 for s in compiled)


def test_missing_torchvision_is_an_error_row_and_exit_1(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # the fixture swaps the device only: the real resnet50 factory imports torchvision
    # import fails, also of a submodule an earlier test imported (sys.modules answers first)
    for name in [m for m in sys.modules if m.startswith("torchvision.")] + ["torchvision"]:
        monkeypatch.setitem(sys.modules, name, None)
    argv = ["bench", "--reps", "2", "--no-compile", "--only", "resnet50_b64_bf16_cl,gn_blocks_fp16"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    rows = {tuple(row[:3]): row for row in _models_table(captured.out)[2:]}
    error_row = rows[("resnet50_b64_bf16_cl", "-", "-")]
    assert error_row[3].startswith("ERROR: setup failed: ModuleNotFoundError")
    assert "torchvision" in error_row[3]
    # the other model still ran, eager and graphed (no compile)
    assert {key for key in rows if key[0] == "gn_blocks_fp16"} == {
        ("gn_blocks_fp16", mode, impl)
        for mode in ("eager", "graphed")
        for impl in ("torch", "cupynorm")
    }
    assert "FAILED resnet50_b64_bf16_cl: setup failed: ModuleNotFoundError" in captured.err


def _wrong_replace_norms(torch: types.ModuleType):
    class WrongBatchNorm2d(torch.nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) + 0.01

    def replace_norms(model):
        for module in model.modules():
            if type(module) is torch.nn.BatchNorm2d:
                module.__class__ = WrongBatchNorm2d
        return model

    return replace_norms


def test_less_accurate_cupynorm_fails_the_row(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    torch = pytest.importorskip("torch")
    models_dry_run()
    fake = types.ModuleType("cupynorm.torch")
    fake.fuse = _wrong_replace_norms(torch)
    monkeypatch.setitem(sys.modules, "cupynorm.torch", fake)
    argv = ["bench", "--reps", "2", "--no-compile", "--only", "resnet50_b64_bf16_cl"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "WORSE THAN 2x TORCH" in captured.err
    assert "FAILED resnet50_b64_bf16_cl: cupynorm less accurate than torch" in captured.err
    rows = {tuple(row[:3]): row for row in _models_table(captured.out)[2:]}
    assert rows[("resnet50_b64_bf16_cl", "eager", "cupynorm")][10].endswith("(> 2x torch)")


def test_a_failing_mode_is_that_cell_only(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    models_dry_run()
    stand_in = bench.timing.cuda

    def capture_graph(step, warmup):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(stand_in, "capture_graph", capture_graph)
    argv = ["bench", "--reps", "2", "--no-compile", "--only", "gn_blocks_fp16_cl"]
    # torch's capture fails too, so it is not cupynorm's failure
    assert main(argv) == 0
    rows = {tuple(row[:3]): row for row in _models_table(capsys.readouterr().out)[2:]}
    for impl in ("torch", "cupynorm"):
        assert rows[("gn_blocks_fp16_cl", "graphed", impl)][3].startswith(
            "ERROR: RuntimeError: operation not permitted"
        )
        assert "ERROR" not in rows[("gn_blocks_fp16_cl", "eager", impl)][3]


def _fake_eager_steps(monkeypatch: pytest.MonkeyPatch, log: list[str], oom: str | None = None):
    """`train._built_step` answering with steps that log their implementation (or raising the
    device's out-of-memory error for `oom`), and a profile with nothing in it."""
    torch = pytest.importorskip("torch")

    def built_step(base, workload, batch, mode, impl, result):
        if impl == oom:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        result.setup_s = 0.0
        return lambda: log.append(impl)

    monkeypatch.setattr(train, "_built_step", built_step)
    monkeypatch.setattr(train, "_profile", lambda step, steps: train.summarize_kernels([], steps))


def test_eager_steps_alternate_in_rounds(models_dry_run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both eager steps are timed in rounds that alternate them, reversed every other round, and
    their issue times are interleaved the same way: host drift within a run reaches both."""
    models_dry_run()
    log: list[str] = []
    _fake_eager_steps(monkeypatch, log)
    monkeypatch.setattr(train, "WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "HOST_STEPS", 2)
    monkeypatch.setattr(train, "EAGER_ROUNDS", 3)
    results = train._run_eager_pair(None, None, None, steps=2)
    assert [(r.mode, r.impl, r.error) for r in results] == [
        ("eager", "torch", None),
        ("eager", "cupynorm", None),
    ]
    assert all(r.reps == 3 * 2 and r.host_us is not None for r in results)
    # three timing rounds of one warm-up step and two timed ones each, then two issue-time
    # samples of each
    t, c = "torch", "cupynorm"
    rounds = [t] * 3 + [c] * 3 + [c] * 3 + [t] * 3 + [t] * 3 + [c] * 3
    assert log == rounds + [t, c, c, t]


def test_eager_steps_one_after_the_other_when_both_do_not_fit(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    models_dry_run()
    log: list[str] = []
    _fake_eager_steps(monkeypatch, log, oom="cupynorm")
    alone = []

    def run_step_safely(base, workload, batch, mode, impl, steps):
        alone.append((mode, impl))
        return bench.StepResult(mode=mode, impl=impl, ms=1.0)

    monkeypatch.setattr(train, "_run_step_safely", run_step_safely)
    results = train._run_eager_safely(None, None, None, steps=2)
    assert alone == [("eager", "torch"), ("eager", "cupynorm")]
    assert [(r.impl, r.ms) for r in results] == [("torch", 1.0), ("cupynorm", 1.0)]
    assert "timed one after the other" in capsys.readouterr().err


def test_a_failing_eager_cell_leaves_the_other(
    models_dry_run, monkeypatch: pytest.MonkeyPatch
) -> None:
    models_dry_run()
    log: list[str] = []
    _fake_eager_steps(monkeypatch, log)
    real = train._built_step

    def built_step(base, workload, batch, mode, impl, result):
        if impl == "cupynorm":
            raise ValueError("cannot convert")
        return real(base, workload, batch, mode, impl, result)

    monkeypatch.setattr(train, "_built_step", built_step)
    torch_result, cupynorm_result = train._run_eager_pair(None, None, None, steps=2)
    assert torch_result.error is None and torch_result.ms is not None
    assert cupynorm_result.error == "ValueError: cannot convert" and cupynorm_result.ms is None
    assert set(log) == {"torch"}


def test_llama_row_dry_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    """The Llama row alone (`--only`), on a tiny config on the CPU: transformers' model builds
    from the workload, replace_norms converts its 2 * layers + 1 RMSNorm layers (and nothing is
    left alone with a warning), every mode runs, the accuracy check passes."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setattr(bench.timing, "cuda", CpuStandIn())
    monkeypatch.setattr(bench.timing, "COPY_BANDWIDTH_BYTES", 1 << 16)
    monkeypatch.setattr(bench.timing, "MIN_FLUSH_BYTES", 1 << 16)
    name = "llama_8l_h2048_s2048_b4_bf16"
    tiny = dataclasses.replace(
        bench.MODEL_WORKLOADS_BY_NAME[name],
        input_shape=(2, 8, 256),
        num_classes=64,
        layers=2,
        dtype="float32",
        accuracy_batch=None,
    )
    monkeypatch.setattr(bench.workloads, "MODEL_WORKLOADS", (tiny,))
    monkeypatch.setattr(train, "WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "GRAPH_WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "HOST_STEPS", 2)
    monkeypatch.setattr(train, "COMPILE_OPTIONS", {"backend": "eager"})
    model = bench.models.build_model(tiny)
    assert bench.models.count_norm_layers(model) == 5
    import cupynorm.torch as cnt

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = train._convert(model, tiny)
    assert sum(isinstance(m, cnt.LlamaRMSNorm) for m in converted.modules()) == 5
    assert bench.models.count_norm_layers(bench.models.strip_norms(converted)) == 0
    json_path = tmp_path / "llama.json"
    exit_code = main(["bench", "--reps", "2", "--only", name, "--json", str(json_path)])
    captured = capsys.readouterr()
    assert exit_code == 0, captured.err
    assert "accuracy vs float64 (batch 2)" in captured.err and ": ok" in captured.err
    report = json.loads(json_path.read_text())
    (row,) = report["models"]
    assert row["name"] == name and row["error"] is None and row["failure"] is None
    assert row["norm_layers"] == 5 and len(row["steps"]) == 6
    assert all(s["error"] is None and s["ms"] > 0 for s in row["steps"])
