"""scripts/convergence.py without a GPU: the band and verdict on fabricated curves, the data
generators, and a few training steps of each model on the CPU (tiny sizes), where cupynorm's
modules fall back to torch's functional calls and so must give torch's curve."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script

conv = load_script("convergence")

# ------------------------------------------------------------------------------------------------
# The band on fabricated curves
# ------------------------------------------------------------------------------------------------

STEPS = 400


def _torch_like_curves(runs: int = 2, noise: float = 0.05) -> list[np.ndarray]:
    """A falling loss with per-step noise, the same expectation for every run."""
    rng = np.random.default_rng(0)
    expected = 0.5 + 2.0 * np.exp(-np.arange(STEPS) / 80)
    return [expected + noise * rng.standard_normal(STEPS) for _ in range(runs)]


def test_moving_average_is_centred_and_clipped_at_the_ends() -> None:
    mean, count = conv.moving_average([1.0, 2.0, 3.0, 4.0, 5.0], 3)
    np.testing.assert_allclose(mean, [1.5, 2.0, 3.0, 4.0, 4.5])
    assert count.tolist() == [2, 3, 3, 3, 2]
    mean, _ = conv.moving_average(np.full(10, 7.0), 4)
    np.testing.assert_allclose(mean, 7.0)


def test_a_curve_between_the_torch_runs_is_inside_everywhere() -> None:
    torch_curves = _torch_like_curves()
    between = np.mean(torch_curves, axis=0)
    judged = conv.verdict(torch_curves, [between, torch_curves[0]], window=50)
    assert judged["inside_fraction"] == [1.0, 1.0]
    assert judged["final_inside"] == [True, True]
    assert judged["converges"]
    assert not judged["raw"]["torch_runs_identical"]
    assert judged["raw"]["torch_spread_max"] > 0


def test_a_curve_shifted_far_out_is_inside_nowhere() -> None:
    torch_curves = _torch_like_curves()
    for shift in (+1.0, -1.0):
        judged = conv.verdict(torch_curves, [torch_curves[0] + shift], window=50)
        assert judged["inside_fraction"] == [0.0]
        assert judged["final_inside"] == [False]
        assert not judged["converges"]
        assert judged["raw"]["cupynorm_gap_to_torch_mean"][0] == pytest.approx(1.0, abs=0.05)


def test_an_independent_run_of_the_same_expectation_is_inside() -> None:
    """Fresh noise around the same expected curve: the k standard errors of the band cover it."""
    torch_curves = _torch_like_curves(runs=3)
    judged = conv.verdict(torch_curves[:2], [torch_curves[2]], window=50)
    assert judged["inside_fraction"][0] >= conv.PASS_FRACTION
    assert judged["converges"]


def test_a_stretch_outside_counts_its_steps() -> None:
    """A gap of 0.5 over the last quarter (well outside): about a quarter of the steps out."""
    torch_curves = _torch_like_curves()
    curve = torch_curves[0].copy()
    curve[3 * STEPS // 4 :] += 0.5
    judged = conv.verdict(torch_curves, [curve], window=20)
    assert 0.70 <= judged["inside_fraction"][0] <= 0.78
    assert not judged["final_inside"][0] and not judged["converges"]


def test_the_band_is_widened_by_the_spread_or_k_standard_errors() -> None:
    """Identical noise-free torch curves: a band of zero width (the curve itself is inside);
    torch runs apart by a constant: lo and hi widened by that spread."""
    expected = 0.5 + 2.0 * np.exp(-np.arange(STEPS) / 80)
    band = conv.loss_band([expected, expected], window=1, k=3.0)
    np.testing.assert_allclose(band["lower"], expected)
    np.testing.assert_allclose(band["upper"], expected)
    judged = conv.verdict([expected, expected], [expected], window=1)
    assert judged["inside_fraction"] == [1.0] and judged["raw"]["torch_runs_identical"]
    band = conv.loss_band([expected, expected + 0.1], window=1, k=3.0)
    np.testing.assert_allclose(band["lower"], expected - 0.1)
    np.testing.assert_allclose(band["upper"], expected + 0.2)
    # noise: the margin is k standard errors of the window's mean where that is larger
    noisy = _torch_like_curves(noise=0.2)
    band = conv.loss_band(noisy, window=50, k=3.0)
    margin = band["upper"] - band["lower"] - band["spread"]
    interior = slice(100, STEPS - 100)
    np.testing.assert_allclose(
        margin[interior] / 2, np.maximum(band["spread"], 3.0 * band["se"])[interior]
    )
    assert np.mean(band["se"][interior]) == pytest.approx(0.2 / math.sqrt(51), rel=0.3)


def test_a_diverging_curve_is_outside_from_its_first_nan() -> None:
    torch_curves = _torch_like_curves()
    curve = torch_curves[0].copy()
    curve[STEPS // 2 :] = np.nan
    judged = conv.verdict(torch_curves, [curve], window=10)
    assert judged["inside_fraction"][0] == pytest.approx(0.5, abs=0.02)
    assert judged["final_inside"] == [False] and not judged["converges"]
    json.dumps(judged, allow_nan=False)  # the band's lists are JSON-safe


def test_learning_rate_warms_up_then_decays() -> None:
    lrs = [conv.learning_rate(step, 1000, 1.0) for step in range(1000)]
    assert lrs[0] == pytest.approx(1 / 50) and lrs[49] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[49:-1], lrs[50:], strict=True))
    assert lrs[-1] == pytest.approx(conv.MIN_LR_FRACTION, abs=1e-4)


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet18", "unet", "llama"])
def test_batches_are_the_same_for_the_same_seed(name: str) -> None:
    task = conv.TASKS[name]
    first, info = task.batches(3, True, torch.Generator().manual_seed(5))
    again, _ = task.batches(3, True, torch.Generator().manual_seed(5))
    other, _ = task.batches(3, True, torch.Generator().manual_seed(6))
    assert len(first) == 3 and info
    for a, b, c in zip(first, again, other, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert not all(torch.equal(x, z) for x, z in zip(a, c, strict=True))


def test_markov_chain_follows_its_successors() -> None:
    g = torch.Generator().manual_seed(0)
    successors, weights = chain = conv.markov_chain(32, g)
    tokens = conv.sample_chain(chain, 50, 20, g)
    assert tokens.shape == (50, 20) and 0 <= tokens.min() and tokens.max() < 32
    for row in tokens:
        for prev, nxt in zip(row[:-1].tolist(), row[1:].tolist(), strict=True):
            assert nxt in successors[prev].tolist()
    assert weights.sum().item() == pytest.approx(1.0) and len(weights) == 8


# ------------------------------------------------------------------------------------------------
# A few steps of each model on the CPU
# ------------------------------------------------------------------------------------------------

SMOKE_STEPS = 6


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny models run faster so on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["resnet18", "unet", "llama"])
def test_a_few_steps_on_the_cpu(name: str, tmp_path: Path, one_thread, capsys) -> None:
    requires = conv.TASKS[name].requires
    if requires is not None:
        pytest.importorskip(requires)
    argv = ["--device", "cpu", "--tiny", "--steps", str(SMOKE_STEPS), "--model", name]
    assert conv.main([*argv, "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[1].startswith(name)  # the table's row
    result = json.loads((tmp_path / "convergence.json").read_text())[name]
    for key in ("steps", "settings", "data", "conversion", "runs", "band", "raw"):
        assert key in result
    assert result["steps"] == SMOKE_STEPS and result["precision"] == "float32"
    assert [run["impl"] for run in result["runs"]] == ["torch", "torch", "cupynorm"]
    for run in result["runs"]:
        assert len(run["losses"]) == len(run["smoothed"]) == SMOKE_STEPS
        assert all(loss is not None and math.isfinite(loss) for loss in run["losses"])
        assert math.isfinite(run["final_loss"]) and run["wall_s"] > 0
    assert len(result["band"]["lower"]) == len(result["band"]["upper"]) == SMOKE_STEPS
    assert result["conversion"]["cupynorm"] > 0 and result["conversion"]["torch_left"] == 0
    # on the CPU cupynorm's modules are torch's functional calls: same weights, same data, the
    # same curve -- inside the band everywhere
    torch_losses, cupynorm_losses = result["runs"][0]["losses"], result["runs"][2]["losses"]
    np.testing.assert_allclose(cupynorm_losses, torch_losses, rtol=1e-5)
    assert result["inside_fraction"] == [1.0] and result["final_inside"] == [True]
    png = tmp_path / f"convergence_{name}.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists() and "matplotlib is missing" in captured.err
    else:
        assert png.stat().st_size > 0


def test_a_missing_package_skips_the_model(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(conv.TASKS["unet"], "requires", "no_such_package_xyz")
    argv = ["--device", "cpu", "--tiny", "--steps", "2", "--model", "unet"]
    assert conv.main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "convergence.json").read_text())["unet"]
    assert "no_such_package_xyz" in result["skipped"]
    assert "skipped" in capsys.readouterr().out
