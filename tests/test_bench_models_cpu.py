"""The bench's models group (`--only models`) without a GPU: the rows, selection, the models the
bench builds, kernel accounting, failure rules, the table and JSON. The dry runs of whole
training steps on the CPU are in test_bench_models_dry_run_cpu.py."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
from pathlib import Path

import pytest
from test_bench_cpu import _table_cells

from cupynorm import bench
from cupynorm.__main__ import main
from cupynorm.bench import trainstep

MODEL_NAMES = [
    "resnet50_b64_bf16_cl",
    "resnet50_b256_bf16_cl",
    "efficientnet_b0_b64_bf16_cl",
    "mobilenetv3_b64_bf16_cl",
    "convnext_tiny_b64_bf16_cl",
    "vit_base_b64_bf16",
    "gn_blocks_fp16_cl",
    "gn_blocks_fp16",
    "unet_blocks_fp16",
    "unet_blocks_fp16_cl",
    "unet_blocks_autocast_fp16",
    "unet_blocks_autocast_fp16_cl",
    "llama_8l_h2048_s2048_b4_bf16",
    "qwen2_8l_h2048_s2048_b4_bf16",
    "gemma_8l_h2048_s2048_b4_bf16",
    "sd15_unet_b8_autocast_fp16",
    "sd_vae_decode_b4_fp16",
]
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
    effnet, mobilenet = by_name["efficientnet_b0_b64_bf16_cl"], by_name["mobilenetv3_b64_bf16_cl"]
    assert mobilenet.model == "mobilenetv3" and mobilenet.convert == "fuse"
    # the efficientnet row's conventions: batch 64, fp32 weights under bf16 autocast, NHWC
    for field in ("input_shape", "dtype", "autocast", "channels_last", "loss", "num_classes"):
        assert getattr(mobilenet, field) == getattr(effnet, field), field
    convnext = by_name["convnext_tiny_b64_bf16_cl"]
    assert convnext.input_shape == (64, 3, 224, 224) and convnext.autocast == "bfloat16"
    assert convnext.channels_last and convnext.convert == "layer_norms"
    vit = by_name["vit_base_b64_bf16"]
    assert vit.autocast == "bfloat16" and not vit.channels_last and vit.model == "vit_base"
    converts = {
        "llama": "llama_rms_norm",
        "qwen2": "llama_rms_norm",
        "gemma": "hf_norms",
        "convnext_tiny": "layer_norms",
        "vit_base": "layer_norms",
        "sd15_unet": "fuse_layer_norms",
    }
    for workload in bench.MODEL_WORKLOADS:
        assert workload.model in bench.models.MODEL_FACTORIES
        assert workload.convert == converts.get(workload.model, "fuse")
        # the decoders' residual add before a norm fused into it (#39)
        assert workload.patch_transformers == (workload.model in ("llama", "qwen2", "gemma"))


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
    assert trainstep.is_norm_kernel(name)


@pytest.mark.parametrize("name", [GEMM, ADD, "Memcpy DtoD (Device -> Device)"])
def test_other_kernels_are_not_norm_kernels(name: str) -> None:
    assert not trainstep.is_norm_kernel(name)


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
    assert [name for name in names if not trainstep.is_norm_kernel(name)] == []


def test_summarize_kernels_per_step() -> None:
    events = [(TORCH_BN, 100.0), (GEMM, 300.0), (TORCH_BN, 50.0), (ADD, 10.0), (CUDNN_BN, 40.0)]
    summary = trainstep.summarize_kernels(events, steps=2)
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
    eager_cupynorm.peak_extra_bytes = 96 * 2**20
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
        "96",
        "2.5e-05",
        "0.05 (> 2x torch)",
    ]
    torch_row = by_key[("resnet50_b64_bf16_cl", "eager", "torch")]
    assert torch_row[4] == "1.00x" and torch_row[11:] == ["2.4e-05", "0.02"]
    assert torch_row[8] == "-" and torch_row[10] == "-"  # no host time, no peak measured for it
    graphed = by_key[("resnet50_b64_bf16_cl", "graphed", "cupynorm")]
    assert graphed[3].startswith("ERROR: RuntimeError: operation not permitted")
    assert graphed[11:] == ["", ""]  # accuracy only on eager rows
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


def test_mobilenetv3_row_builds_timms_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row's factory asks timm for mobilenetv3_large_100 with the row's classes (a stand-in
    for timm records the call; the real one needs torchvision)."""
    calls = []
    fake_timm = types.ModuleType("timm")
    fake_timm.create_model = lambda name, **kwargs: calls.append((name, kwargs)) or "model"
    monkeypatch.setitem(sys.modules, "timm", fake_timm)
    workload = bench.MODEL_WORKLOADS_BY_NAME["mobilenetv3_b64_bf16_cl"]
    assert bench.models.build_model(workload) == "model"
    assert calls == [("mobilenetv3_large_100", {"num_classes": 1000})]


def test_mobilenetv3_with_timm_converts_every_norm() -> None:
    """With timm installed: a tiny batch of the real model, every one of its 46 BatchNormAct2d
    converted by fuse (ReLU ones fused, Hardswish and Identity ones followed by their act)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("timm")
    import cupynorm.torch as cnt

    workload = dataclasses.replace(
        bench.MODEL_WORKLOADS_BY_NAME["mobilenetv3_b64_bf16_cl"], num_classes=10
    )
    model = bench.models.build_model(workload)
    assert bench.models.count_norm_layers(model) == 46
    converted = trainstep.convert_model(model, workload)
    norms = bench.models.norm_layers(converted)
    assert len(norms) == 46 and all(isinstance(m, cnt.BatchNorm2d) for m in norms)
    x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    assert converted(x).shape == (2, 10)
