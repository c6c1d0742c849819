"""scripts/timm_sweep.py without a GPU: conversion counts and the accuracy check of a few timm
models at 64x64 (cupynorm's modules run torch's ops on the CPU), the timing code on the bench's
CPU stand-in (one graph alive at a time), and a failing model recorded while the sweep goes on.
Skipped where timm is not installed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("timm")

import torch  # noqa: E402
from conftest import load_script  # noqa: E402
from test_bench_cpu import CpuStandIn  # noqa: E402
from torch import nn  # noqa: E402

sweep = load_script("timm_sweep")
CPU = sweep.SweepOptions(device="cpu", time_steps=False, accuracy_batch=2)


def _assert_accurate(record) -> None:
    assert record.status == "ok", record.error
    assert record.input_size == [3, 64, 64]
    assert set(record.errors) == {f"{k}_{i}" for k in ("out", "dx", "pgrad") for i in sweep.IMPLS}
    for kind in ("out", "dx", "pgrad"):
        ours, theirs = record.errors[f"{kind}_cupynorm"], record.errors[f"{kind}_torch"]
        assert math.isfinite(ours) and math.isfinite(theirs)
        assert ours <= 2 * theirs + 1e-6, (kind, ours, theirs)
    assert record.ok is True


def test_resnet18_every_batch_norm_converted_and_nine_fused() -> None:
    record = sweep.run_model(sweep.ModelSpec("resnet", "resnet18", 64), CPU)
    _assert_accurate(record)
    # the stem's bn1, 16 in the blocks, 3 in the downsamples; the stem's and each block's bn2
    # (with the residual add) fused with their ReLU
    assert record.norm_layers == record.converted == 20
    assert record.norm_classes == {"torch.nn.modules.batchnorm.BatchNorm2d": 20}
    assert record.fused == len(record.fusions) == 9
    assert "layer1.0.bn2 + add + relu" in record.fusions
    assert record.traced == "whole"
    assert record.left == [] and record.warnings == []


def test_convnext_layer_norms_are_opt_in() -> None:
    spec = sweep.ModelSpec("convnext", "convnext_atto", 64)
    default = sweep.run_model(spec, CPU)
    _assert_accurate(default)
    assert default.norm_layers == 17 and default.converted == 0
    assert default.left == [
        {"class": "timm.layers.norm.LayerNorm2d", "count": 17, "reason": "opt-in (--layer-norms)"}
    ]
    assert "timm.LayerNorm2d x17: opt-in" in sweep.table_row(default)

    options = sweep.SweepOptions(device="cpu", time_steps=False, accuracy_batch=2)
    options.layer_norms = True
    converted = sweep.run_model(spec, options)
    _assert_accurate(converted)
    assert converted.converted == converted.norm_layers == 17
    assert converted.left == []


def test_poolformer_group_norm1_converted_and_its_head_norm_left() -> None:
    record = sweep.run_model(sweep.ModelSpec("poolformer", "poolformer_s12", 64), CPU)
    _assert_accurate(record)
    assert record.norm_classes == {
        "timm.layers.norm.GroupNorm1": 24,
        "timm.layers.norm.LayerNorm2d": 1,
    }
    assert record.converted == 24 and record.fused == 0
    assert [(e["class"], e["count"]) for e in record.left] == [("timm.layers.norm.LayerNorm2d", 1)]


def test_norm_layers_are_told_from_their_containers() -> None:
    import timm.layers

    assert sweep.is_norm_layer(timm.layers.BatchNormAct2d(8))
    assert sweep.is_norm_layer(timm.layers.RmsNorm2d(8))  # a plain Module
    assert sweep.is_norm_layer(nn.BatchNorm1d(8))
    assert not sweep.is_norm_layer(timm.layers.ConvNormAct(3, 8, 3))
    assert not sweep.is_norm_layer(nn.Linear(3, 8))


# ---- the sweep around run_model ------------------------------------------------------------
def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 10),
    )
    model.num_classes = 10  # as timm's models say
    return model.train()


def _fake_build(spec, options):
    if spec.model == "broken":
        raise RuntimeError("no such model\nsecond line")
    return _tiny_model(), (3, 8, 8)


def test_a_failing_model_is_recorded_and_the_sweep_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sweep, "build_model", _fake_build)
    saved: list[int] = []
    specs = [sweep.ModelSpec("bad", "broken"), sweep.ModelSpec("tiny", "tiny")]
    records = sweep.sweep(specs, CPU, on_record=lambda rs: saved.append(len(rs)))
    broken, tiny = records
    assert broken.status == "failed"
    assert broken.error == "build: RuntimeError: no such model"
    assert tiny.status == "ok" and tiny.ok is True
    assert (tiny.norm_layers, tiny.converted, tiny.fused) == (1, 1, 1)
    assert saved == [1, 2]
    log = capsys.readouterr().out
    assert "| bad | `broken` |" in log and "failed (build: RuntimeError" in log
    summary = sweep.summary_line(records)
    assert summary.startswith("2 models: converted fully 1, partly 0, none converted 0")
    assert "failed 1" in summary and "accuracy ok 1 of 1 checked" in summary
    assert "norm layers converted 1 of 1 (100.0%)" in summary
    env = {"device_name": "cpu", "torch": "t", "timm": "t", "cupynorm": "c", "date": "d"}
    env.update(conversion="fuse", accuracy_batch=2, batch=32)
    table = sweep.markdown(records, env)
    assert table.count("\n| ") == 3 and summary in table  # the header and two rows


def test_the_deadline_and_the_models_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "build_model", _fake_build)
    specs = [sweep.ModelSpec("tiny", "tiny"), sweep.ModelSpec("bad", "broken")]
    late = sweep.sweep(specs, CPU, deadline=0.0)
    assert [r.status for r in late] == ["not run (time)"] * 2
    done = [sweep.ModelRecord("tiny", "tiny", converted=7)]  # kept by --resume, not rerun
    resumed = sweep.sweep(specs, CPU, done=done)
    assert resumed[0] is done[0] and [r.status for r in resumed] == ["ok", "failed"]


def test_main_writes_the_json_and_the_table_and_resumes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sweep, "build_model", _fake_build)
    out, table = tmp_path / "sweep.json", tmp_path / "sweep.md"
    argv = ["--json", str(out), "--markdown", str(table), "--device", "cpu", "--no-time"]
    assert sweep.main([*argv, "--models", "tiny"]) == 0
    assert sweep.main([*argv, "--models", "tiny,broken", "--resume"]) == 0
    document = json.loads(out.read_text())
    assert document["environment"]["device_name"] == "cpu"
    assert document["environment"]["conversion"] == "fuse"
    assert [(r["model"], r["status"]) for r in document["records"]] == [
        ("tiny", "ok"),
        ("broken", "failed"),
    ]
    assert "| - | `tiny` | 1 | 1 | 1 | - |" in table.read_text()


class _OneGraphStandIn(CpuStandIn):
    """The bench's CPU stand-in whose captures fail while an earlier graph is alive, and whose
    second capture fails anyway when asked."""

    def __init__(self, fail_second: bool) -> None:
        self.alive = 0
        self.captures = 0
        self.fail_second = fail_second

    def capture_graph(self, step, warmup: int):
        self.captures += 1
        if self.alive:
            raise RuntimeError("two graphs alive")
        if self.fail_second and self.captures == 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        step()
        device = self

        class Replay:
            def __init__(self) -> None:
                device.alive += 1

            def __call__(self) -> None:
                step()

            def __del__(self) -> None:
                device.alive -= 1

        return Replay()


@pytest.mark.parametrize("fail_second", [False, True], ids=["captured", "capture-fails"])
def test_timing_one_graph_at_a_time(monkeypatch: pytest.MonkeyPatch, fail_second: bool) -> None:
    import cupynorm.torch as cnt

    stand_in = _OneGraphStandIn(fail_second)
    monkeypatch.setattr(sweep.timing, "cuda", stand_in)
    base = _tiny_model()
    built = sweep.Built(base, cnt.fuse(_tiny_model()), (3, 8, 8))
    record = sweep.ModelRecord("tiny", "tiny")
    options = sweep.SweepOptions(device="cpu", batch=4)
    sweep.time_steps(built, record, options)
    assert set(record.eager_ms) == set(sweep.IMPLS)
    assert all(ms > 0 for ms in record.eager_ms.values())
    assert stand_in.alive == 0 and stand_in.captures == 2
    if fail_second:
        assert set(record.graphed_ms) == {"torch"}
        assert record.notes == [
            "graph cupynorm: failed (RuntimeError: operation not permitted when stream is "
            "capturing)"
        ]
        assert "graph cupynorm: failed" in sweep.table_row(record)
    else:
        assert set(record.graphed_ms) == set(sweep.IMPLS) and record.notes == []


def test_accuracy_is_the_mean_of_the_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each error is the mean over the draws; the worst parameter is the worst draw's; the row
    of a failure replace_norms warned of (torch's pool bug) names it."""
    seeds = []

    def one_draw(built, options, seed):
        seeds.append(seed)
        k = len(seeds)  # 1, 2, 3
        errors = {
            f"{kind}_{impl}": 1e-6 * k for kind in ("out", "dx", "pgrad") for impl in sweep.IMPLS
        }
        errors["pgrad_cupynorm"] = 1e-5 * (4 - k)  # the first draw is cupynorm's worst
        return errors, f"param{k}"

    monkeypatch.setattr(sweep, "_errors_of_one_draw", one_draw)
    record = sweep.ModelRecord("tiny", "tiny")
    sweep.check_accuracy(sweep.Built(nn.Identity(), nn.Identity(), (3, 8, 8)), record, CPU)
    assert len(set(seeds)) == sweep.ACCURACY_DRAWS == 3
    assert record.errors["dx_torch"] == pytest.approx(2e-6)
    assert record.errors["pgrad_cupynorm"] == pytest.approx(2e-5)
    assert record.worst_param == "param1"
    assert record.ok is False  # 2e-5 > 2 x 2e-6 + 1e-6
    assert sweep._ok_text(record) == "NO"
    record.warnings = [f"replace_norms: ... ({sweep.TORCH_POOL_BUG}) ..."]
    assert sweep.TORCH_POOL_BUG in sweep.table_row(record)


def test_convert_only_counts_without_checking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "build_model", _fake_build)
    options = sweep.SweepOptions(device="cpu", time_steps=False, check=False)
    (record,) = sweep.sweep([sweep.ModelSpec("tiny", "tiny")], options)
    assert record.status == "ok" and (record.norm_layers, record.converted) == (1, 1)
    assert record.ok is None and record.errors == {}
