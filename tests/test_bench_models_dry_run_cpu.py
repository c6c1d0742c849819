"""The bench's models group (`--only models`) run on the CPU through the bench's device facade:
tiny stand-ins for the models, tiny batches, few steps, every mode; what is asserted is the
pipeline (cells, failures, skips, the order of the eager rounds), not the timings."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import warnings
from pathlib import Path

import pytest
from test_bench_cpu import CpuStandIn, _table_cells
from test_bench_models_cpu import MODEL_NAMES

from cupynorm import bench
from cupynorm.__main__ import main
from cupynorm.bench import train, trainstep
from cupynorm.bench.results import MODEL_IMPLS

# the end-to-end dry run's models (the Llama row has a dry run of its own: transformers' RMSNorm
# is elementwise torch ops, no norm kernel to count on the CPU; so have the diffusers rows, on
# tiny configs of diffusers' classes: tests/test_diffusers_cpu.py)
OWN_DRY_RUNS = ("llama", "qwen2", "gemma", "sd15_unet", "sd_vae_decoder")
DRY_RUN_NAMES = [
    name for name in MODEL_NAMES if bench.MODEL_WORKLOADS_BY_NAME[name].model not in OWN_DRY_RUNS
]

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


def _tiny_norm_act_net(workload: bench.ModelWorkload, acts=("SiLU", "SiLU", "SiLU")):
    """Stands in for efficientnet_b0 (and, with ReLU, Hardswish and Identity, mobilenetv3):
    convs with norm-act layers shaped like timm's BatchNormAct2d (BatchNorm2d, then the
    module's own drop and act submodules)."""
    from torch import nn

    class NormAct(nn.BatchNorm2d):
        def __init__(self, channels: int, act: str) -> None:
            super().__init__(channels)
            self.drop, self.act = nn.Identity(), getattr(nn, act)()

        def forward(self, x):
            return self.act(self.drop(super().forward(x)))

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        NormAct(8, acts[0]),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        NormAct(8, acts[1]),
        NormAct(8, acts[2]),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, workload.num_classes),
    )


def _tiny_mobilenet(workload: bench.ModelWorkload):
    return _tiny_norm_act_net(workload, acts=("ReLU", "Hardswish", "Identity"))


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
    if workload.model in (
        "resnet50",
        "efficientnet_b0",
        "mobilenetv3",
        "convnext_tiny",
        "vit_base",
    ):
        return dataclasses.replace(
            workload, input_shape=(2, 3, 16, 16), num_classes=10, accuracy_batch=None
        )
    # NCHW: torch 2.13's CPU GroupNorm backward segfaults on a channels_last input that needs no
    # gradient (GroupNorm(32, 64) on a channels_last 2x64x8x8, then .sum().backward()), and the
    # first block's input is the batch. fp32: the CPU's fp16 kernels are not what is tested here.
    # 4x4: still 32 values per group of GroupNorm(32, 64); the steps cost a quarter of 8x8's.
    return dataclasses.replace(
        workload, input_shape=(2, 64, 4, 4), dtype="float32", channels_last=False
    )


@pytest.fixture
def models_dry_run(monkeypatch: pytest.MonkeyPatch, frozen_heap):
    """The bench on the CPU: the device facade swapped, tiny models and batches, few steps and
    rounds (two: the second reversed, as every other round is)."""
    pytest.importorskip("torch")
    monkeypatch.setattr(bench.timing, "cuda", CpuStandIn())
    monkeypatch.setattr(bench.timing, "COPY_BANDWIDTH_BYTES", 1 << 16)
    monkeypatch.setattr(bench.timing, "MIN_FLUSH_BYTES", 1 << 16)
    tiny = tuple(
        _tiny_model_workload(w) for w in bench.MODEL_WORKLOADS if w.model not in OWN_DRY_RUNS
    )
    monkeypatch.setattr(bench.workloads, "MODEL_WORKLOADS", tiny)
    monkeypatch.setattr(train, "WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "GRAPH_WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "HOST_STEPS", 2)
    monkeypatch.setattr(train, "ROUNDS", 2)
    monkeypatch.setattr(train, "HOST_PACED_ROUNDS", 2)
    monkeypatch.setattr(train, "PROFILE_STEPS", 1)
    # dynamo traces the models on the CPU; inductor's C++ compile would take minutes
    monkeypatch.setattr(train, "COMPILE_OPTIONS", {"backend": "eager"})
    monkeypatch.setattr(train, "REDUCE_OVERHEAD_OPTIONS", {"backend": "eager"})

    def substitute_resnet50() -> None:
        monkeypatch.setitem(bench.models.MODEL_FACTORIES, "resnet50", _tiny_bn_net)
        monkeypatch.setitem(bench.models.MODEL_FACTORIES, "efficientnet_b0", _tiny_norm_act_net)
        monkeypatch.setitem(bench.models.MODEL_FACTORIES, "mobilenetv3", _tiny_mobilenet)
        monkeypatch.setitem(bench.models.MODEL_FACTORIES, "convnext_tiny", _tiny_layer_norm_net)
        monkeypatch.setitem(bench.models.MODEL_FACTORIES, "vit_base", _tiny_vit)

    return substitute_resnet50


def _models_table(out: str) -> list[list[str]]:
    return _table_cells(out[out.index("| model |") :].strip())


def test_models_dry_run_end_to_end(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    """Every model row, eager, graphed and compiled (reduce-overhead compiles the same way on
    the CPU, with no CUDA graphs: `test_models_dry_run_every_mode` runs it on two rows)."""
    torch = pytest.importorskip("torch")
    models_dry_run()
    monkeypatch.setattr(train, "COMPILED_MODES", ("compile",))
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

    assert "[12/12] unet_blocks_autocast_fp16_cl done" in captured.err
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
            assert float(row[10]) >= 0  # peak MiB of a step
        else:
            assert eager_only == ["-", "-", "-", "-", "-", "-", "", ""], row

    report = json.loads(json_path.read_text())
    assert report["exit_code"] == 0 and report["workloads"] == []
    assert [m["name"] for m in report["models"]] == DRY_RUN_NAMES
    for model in report["models"]:
        assert model["error"] is None and model["failure"] is None
        assert model["accuracy"]["ok"] and model["accuracy"]["batch"] == 2
        norm_layers = {"resnet50": 2, "convnext_tiny": 2, "vit_base": 2}
        norm_layers.update(efficientnet_b0=3, mobilenetv3=3)
        assert model["norm_layers"] == norm_layers.get(model["model"], 8)
        assert len(model["steps"]) == 6
        eager = [s for s in model["steps"] if s["mode"] == "eager"]
        assert all(s["host_us"] > 0 and s["norm_kernel_ms_by_name"] for s in eager)
        assert model["host_us_without_norms"] > 0
        assert all(s["host_us_per_norm_layer"] is not None for s in eager)
        compiled = [s for s in model["steps"] if s["mode"] == "compile"]
        assert all(
            s["setup_s"] is not None and s["reps"] == train.HOST_PACED_ROUNDS * 2 for s in compiled
        )


@pytest.mark.exhaustive  # ~25 s; the end-to-end dry run covers the eager mode by default
def test_models_dry_run_every_mode(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    """Two rows in all four modes: each mode's cells timed, with the speedup over torch's in the
    same mode, in the table and the JSON; the reduce-overhead steps mark where a step begins."""
    torch = pytest.importorskip("torch")
    models_dry_run()
    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    json_path = tmp_path / "models.json"
    names = "resnet50_b64_bf16_cl,gn_blocks_fp16_cl"
    assert main(["bench", "--reps", "2", "--only", names, "--json", str(json_path)]) == 0
    rows = {tuple(row[:3]): row for row in _models_table(capsys.readouterr().out)[2:]}
    modes = ("eager", "graphed", "compile", "reduce-overhead")
    assert set(rows) == {
        (name, mode, impl)
        for name in names.split(",")
        for mode in modes
        for impl in ("torch", "cupynorm")
    }
    for (_name, _mode, impl), row in rows.items():
        assert float(row[3]) > 0 and row[4].endswith("x")
        if impl == "torch":
            assert row[4] == "1.00x"
    report = json.loads(json_path.read_text())
    for model in report["models"]:
        steps = {(s["mode"], s["impl"]): s for s in model["steps"]}
        assert [mode for mode, impl in steps if impl == "cupynorm"] == list(modes)
        reduce_overhead = steps[("reduce-overhead", "cupynorm")]
        assert reduce_overhead["speedup_vs_torch"] == pytest.approx(
            steps[("reduce-overhead", "torch")]["ms"] / reduce_overhead["ms"]
        )
        assert reduce_overhead["note"] == "" and reduce_overhead["error"] is None
    # every reduce-overhead step run (setup, warm-up, timed), none of the other modes'
    assert len(marks) >= 2 * 2 * (2 + 2)


def test_modes_runs_the_modes_it_names(models_dry_run, tmp_path: Path, capsys) -> None:
    """`--modes compile,graphed`: those two modes of the row, in the run's order, no eager cell
    and no eager host time; an unknown mode is refused before anything runs."""
    models_dry_run()
    json_path = tmp_path / "models.json"
    argv = ["bench", "--reps", "2", "--only", "gn_blocks_fp16_cl", "--json", str(json_path)]
    assert main([*argv, "--modes", "compile,graphed"]) == 0
    out = capsys.readouterr()
    (model,) = json.loads(json_path.read_text())["models"]
    assert [(s["mode"], s["impl"]) for s in model["steps"]] == [
        (mode, impl) for mode in ("graphed", "compile") for impl in MODEL_IMPLS
    ]
    assert model["host_us_without_norms"] is None
    assert "eager host time without norm layers" not in out.err
    rows = _models_table(out.out)[2:]
    assert {row[1] for row in rows} == {"graphed", "compile"}
    assert main([*argv, "--modes", "compile,jit"]) == 2  # bad arguments
    assert "unknown mode(s) 'jit'" in capsys.readouterr().err


def test_a_run_stopped_mid_row_keeps_what_it_measured(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The JSON is written after every row and every mode of a model row: a run stopped in a
    row's graphed mode (a time limit) leaves the rows before it and that row's eager cells, the
    file marked partial."""
    models_dry_run()
    run_pair = train._run_pair_safely

    def stopped_in_the_second_row(base, workload, batch, mode, steps):
        if workload.name == "gn_blocks_fp16_cl" and mode == "graphed":
            raise KeyboardInterrupt  # what a kill leaves: nothing written after this
        return run_pair(base, workload, batch, mode, steps)

    monkeypatch.setattr(train, "_run_pair_safely", stopped_in_the_second_row)
    monkeypatch.setattr(train, "COMPILED_MODES", ())
    json_path = tmp_path / "models.json"
    names = "resnet50_b64_bf16_cl,gn_blocks_fp16_cl"
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "--reps", "2", "--only", names, "--json", str(json_path)])
    report = json.loads(json_path.read_text())
    assert report["partial"] is True and report["exit_code"] is None
    cells = {m["name"]: [(s["mode"], s["impl"]) for s in m["steps"]] for m in report["models"]}
    assert cells == {
        "resnet50_b64_bf16_cl": [
            (mode, impl) for mode in ("eager", "graphed") for impl in MODEL_IMPLS
        ],
        "gn_blocks_fp16_cl": [("eager", impl) for impl in MODEL_IMPLS],
    }
    assert all(s["ms"] > 0 for m in report["models"] for s in m["steps"])


@pytest.mark.parametrize(
    ("package", "row"),
    [("torchvision", "resnet50_b64_bf16_cl"), ("timm", "mobilenetv3_b64_bf16_cl")],
)
def test_a_missing_model_package_skips_the_row(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, capsys, package: str, row: str
) -> None:
    """A row whose model needs a package that is not installed is skipped, says why, and fails
    nothing; the other rows run."""
    # the fixture swaps the device only: the real factories import torchvision / timm; the
    # import fails, also of a submodule an earlier test imported (sys.modules answers first)
    for name in [m for m in sys.modules if m.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)
    argv = ["bench", "--reps", "2", "--no-compile", "--only", f"{row},gn_blocks_fp16"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rows = {tuple(cells[:3]): cells for cells in _models_table(captured.out)[2:]}
    assert rows[(row, "-", "-")][3] == f"skipped: {package} is not installed"
    assert f"skipped: {package} is not installed" in captured.err
    # the other model still ran, eager and graphed (no compile)
    assert {key for key in rows if key[0] == "gn_blocks_fp16"} == {
        ("gn_blocks_fp16", mode, impl)
        for mode in ("eager", "graphed")
        for impl in ("torch", "cupynorm")
    }
    assert "FAILED" not in captured.err


def test_a_model_that_cannot_be_built_is_an_error_row_and_exit_1(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    def broken(workload):
        raise ValueError("no such configuration")

    monkeypatch.setitem(bench.models.MODEL_FACTORIES, "gn_resnet_blocks", broken)
    assert main(["bench", "--reps", "2", "--no-compile", "--only", "gn_blocks_fp16"]) == 1
    captured = capsys.readouterr()
    rows = {tuple(cells[:3]): cells for cells in _models_table(captured.out)[2:]}
    assert rows[("gn_blocks_fp16", "-", "-")][3] == (
        "ERROR: setup failed: ValueError: no such configuration"
    )
    assert "FAILED gn_blocks_fp16: setup failed: ValueError" in captured.err


def test_a_compiled_mode_that_cannot_run_keeps_the_row(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """reduce-overhead failing for both models (here: no such backend) is that mode's cells,
    with the reason; the other modes and the run go on."""
    models_dry_run()
    monkeypatch.setattr(train, "REDUCE_OVERHEAD_OPTIONS", {"backend": "no_such_backend"})
    assert main(["bench", "--reps", "2", "--only", "gn_blocks_fp16_cl"]) == 0
    captured = capsys.readouterr()
    rows = {tuple(cells[:3]): cells for cells in _models_table(captured.out)[2:]}
    assert len(rows) == 8
    for impl in ("torch", "cupynorm"):
        assert rows[("gn_blocks_fp16_cl", "reduce-overhead", impl)][3].startswith("ERROR: ")
        assert "no_such_backend" in rows[("gn_blocks_fp16_cl", "reduce-overhead", impl)][3]
        assert float(rows[("gn_blocks_fp16_cl", "compile", impl)][3]) > 0
    assert "reduce-overhead cupynorm: ERROR" in captured.err


def test_reduce_overhead_marks_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reduce-overhead step tells Inductor's CUDA graphs where each step begins; the others
    do not."""
    torch = pytest.importorskip("torch")
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(bench.timing, "cuda", CpuStandIn())
    workload = _tiny_model_workload(bench.MODEL_WORKLOADS_BY_NAME["gn_blocks_fp16"])
    model = bench.models.build_model(workload)
    batch = trainstep.make_batch(workload, 2, "cpu", torch.float32, seed=0)
    trainstep.TrainStep(model, workload, *batch)()
    assert marks == []
    trainstep.TrainStep(model, workload, *batch, mark_step=True)()
    assert marks == [1]


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
    assert rows[("resnet50_b64_bf16_cl", "eager", "cupynorm")][11].endswith("(> 2x torch)")


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


def test_graphed_steps_live_one_at_a_time(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Two whole-step graphs alive in one process faulted on replay (torch 2.11, CUDA 13): the
    graphed mode captures, times and frees torch's step before it captures cupynorm's."""
    models_dry_run()
    stand_in = bench.timing.cuda
    live: set[int] = set()
    most = [0]

    class Graph:
        def __init__(self, step):
            self.step = step
            live.add(id(self))
            most[0] = max(most[0], len(live))

        def __call__(self):
            return self.step()

        def __del__(self):
            live.discard(id(self))

    monkeypatch.setattr(stand_in, "capture_graph", lambda step, warmup: Graph(step))
    argv = ["bench", "--reps", "2", "--no-compile", "--only", "gn_blocks_fp16_cl"]
    assert main(argv) == 0
    rows = {tuple(row[:3]): row for row in _models_table(capsys.readouterr().out)[2:]}
    for impl in ("torch", "cupynorm"):
        assert "ERROR" not in rows[("gn_blocks_fp16_cl", "graphed", impl)][3]
    assert most[0] == 1


_ROW = bench.MODEL_WORKLOADS_BY_NAME["resnet50_b64_bf16_cl"]  # a row the fake steps ignore


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
    monkeypatch.setattr(
        train, "_profile", lambda step, steps: trainstep.summarize_kernels([], steps)
    )


def _logged_rounds(monkeypatch: pytest.MonkeyPatch, rounds: int) -> list[str]:
    """Fake eager steps logging their implementation (:func:`_fake_eager_steps`), timed in
    `rounds` rounds of one warm-up step and two timed ones, two issue-time samples; the log."""
    log: list[str] = []
    _fake_eager_steps(monkeypatch, log)
    monkeypatch.setattr(train, "WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "HOST_STEPS", 2)
    monkeypatch.setattr(train, "HOST_PACED_ROUNDS", rounds)
    return log


def test_eager_steps_alternate_in_rounds(models_dry_run, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both eager steps are timed in rounds that alternate them, reversed every other round, and
    their issue times are interleaved the same way: host drift within a run reaches both."""
    models_dry_run()
    log = _logged_rounds(monkeypatch, rounds=3)
    results = train._run_pair(None, _ROW, None, "eager", steps=2)
    assert [(r.mode, r.impl, r.error) for r in results] == [
        ("eager", "torch", None),
        ("eager", "cupynorm", None),
    ]
    assert all(r.reps == 3 * 2 and r.host_us is not None for r in results)
    # three timing rounds of one warm-up step and two timed ones each, then two issue-time
    # samples of each, then each one's step measured for its peak memory
    t, c = "torch", "cupynorm"
    rounds = [t] * 3 + [c] * 3 + [c] * 3 + [t] * 3 + [t] * 3 + [c] * 3
    assert log == rounds + [t, c, c, t] + [t, c]


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
    results = train._run_pair_safely(None, _ROW, None, "eager", steps=2)
    assert alone == [("eager", "torch"), ("eager", "cupynorm")]
    assert [(r.impl, r.ms) for r in results] == [("torch", 1.0), ("cupynorm", 1.0)]
    assert "timed one after the other" in capsys.readouterr().err


def test_cupynorm_first_builds_and_times_cupynorm_first(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`bench --cupynorm-first`: rows named NAME_cf whose cupynorm model is built first and
    opens the alternating rounds (the default order reversed); results stay (torch, cupynorm);
    kernel rows are refused."""
    models_dry_run()
    log = _logged_rounds(monkeypatch, rounds=2)
    row = _ROW.built_cupynorm_first()
    assert row.name == "resnet50_b64_bf16_cl_cf" and row.cupynorm_first
    results = train._run_pair(None, row, None, "eager", steps=2)
    assert [r.impl for r in results] == ["torch", "cupynorm"]
    t, c = "torch", "cupynorm"
    assert log == [c] * 3 + [t] * 3 + [t] * 3 + [c] * 3 + [c, t, t, c] + [c, t]
    assert main(["bench", "--cupynorm-first", "--only", "layernorm_bf16"]) == 2
    assert "--cupynorm-first takes model rows only" in capsys.readouterr().err


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
    torch_result, cupynorm_result = train._run_pair(None, _ROW, None, "eager", steps=2)
    assert torch_result.error is None and torch_result.ms is not None
    assert cupynorm_result.error == "ValueError: cannot convert" and cupynorm_result.ms is None
    assert set(log) == {"torch"}


@pytest.mark.parametrize(
    ("family", "norm_class"),
    [("llama", "LlamaRMSNorm"), ("qwen2", "LlamaRMSNorm"), ("gemma", "GemmaRMSNorm")],
)
def test_decoder_row_dry_run(
    family: str, norm_class: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    """A decoder row alone (`--only`), on a tiny config on the CPU: transformers' model builds
    from the workload, replace_norms converts its 2 * layers + 1 RMSNorm layers (and nothing is
    left alone with a warning), every mode runs, the accuracy check passes."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setattr(bench.timing, "cuda", CpuStandIn())
    monkeypatch.setattr(bench.timing, "COPY_BANDWIDTH_BYTES", 1 << 16)
    monkeypatch.setattr(bench.timing, "MIN_FLUSH_BYTES", 1 << 16)
    name = f"{family}_8l_h2048_s2048_b4_bf16"
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
    monkeypatch.setattr(train, "REDUCE_OVERHEAD_OPTIONS", {"backend": "eager"})
    model = bench.models.build_model(tiny)
    assert bench.models.count_norm_layers(model) == 5
    import cupynorm.torch as cnt

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = trainstep.convert_model(model, tiny)
    assert sum(isinstance(m, getattr(cnt, norm_class)) for m in converted.modules()) == 5
    # both decoder layers patched (patch_transformers: the add before the norm after attention)
    assert sum("forward" in vars(m) for m in converted.modules()) == 2
    assert bench.models.count_norm_layers(bench.models.strip_norms(converted)) == 0
    json_path = tmp_path / "llama.json"
    exit_code = main(["bench", "--reps", "2", "--only", name, "--json", str(json_path)])
    captured = capsys.readouterr()
    assert exit_code == 0, captured.err
    assert "accuracy vs float64 (batch 2)" in captured.err and ": ok" in captured.err
    report = json.loads(json_path.read_text())
    (row,) = report["models"]
    assert row["name"] == name and row["error"] is None and row["failure"] is None
    assert row["norm_layers"] == 5 and len(row["steps"]) == 8
    assert all(s["error"] is None and s["ms"] > 0 for s in row["steps"])


def test_an_aa_run_times_torchs_model_against_itself(
    models_dry_run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    """`bench --aa`: each model row named NAME_aa, torch's model on both sides (no cupynorm
    layer in the timed models), no goal; kernel rows are refused."""
    torch = pytest.importorskip("torch")
    models_dry_run()
    monkeypatch.setattr(train, "COMPILED_MODES", ())
    built: list[torch.nn.Module] = []
    convert = trainstep.convert_model

    def converted(model, workload):
        out = convert(model, workload)
        built.append(out)
        return out

    monkeypatch.setattr(train, "convert_model", converted)
    json_path = tmp_path / "aa.json"
    argv = ["bench", "--aa", "--reps", "2", "--only", "resnet50_b64_bf16_cl", "--json"]
    assert main([*argv, str(json_path)]) == 0
    report = json.loads(json_path.read_text())
    (row,) = report["models"]
    assert row["name"] == "resnet50_b64_bf16_cl_aa" and row["title"].startswith("A/A: ")
    assert row.get("goal_speedup") is None and row["accuracy"]["ok"]
    assert {(s["mode"], s["impl"]) for s in row["steps"]} == {
        (mode, impl) for mode in ("eager", "graphed") for impl in MODEL_IMPLS
    }
    assert built and not any(
        type(m).__module__.startswith("cupynorm") for model in built for m in model.modules()
    )
    capsys.readouterr()
    assert main(["bench", "--aa", "--only", "layernorm_bf16"]) == 2
    assert "--aa takes model rows only" in capsys.readouterr().err
