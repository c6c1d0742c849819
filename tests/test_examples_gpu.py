"""The KernelBench-style examples: `ModelNew` (cupynorm) against `Model` (torch.nn) on the GPU.

Each example is imported from examples/ by path, its module-level sizes shrunk (batch first) so
the test is fast; both models are built from the same seed, must have the same state_dict keys in
the same order and identical initial values, then ModelNew loads Model's (perturbed) state and
both run in training mode, under `torch.no_grad()`, on fresh `torch.rand` inputs for 5 seeds:
fp32, atol = rtol = 1e-4. Running statistics must stay equal too.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

if cuda_available():
    import torch

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
SEEDS = range(5)
ATOL = RTOL = 1e-4


@dataclass(frozen=True)
class ExampleCase:
    """An example file and the module-level sizes overridden to keep the test fast."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


CASES = [
    # Batch 2 keeps the real segment / channel lengths (64 x 512 x 512 planes).
    ExampleCase("instancenorm2d", {"batch_size": 2}),
    ExampleCase("groupnorm", {"batch_size": 2}),
    ExampleCase("batchnorm2d", {"batch_size": 2}),
    # Rows keep their 8192 features; a smaller Linear input keeps construction quick.
    ExampleCase("linear_instancenorm_residual", {"batch_size": 64, "in_features": 1024}),
    # Batch 2 keeps the real row length (64 x 256 x 256 values: longer than a team holds).
    ExampleCase("layernorm", {"batch_size": 2}),
    # Batch 2 keeps the real 64 channels of 512 x 512 pixels.
    ExampleCase("rms_norm_channels", {"batch_size": 2}),
]


def load_example(name: str) -> ModuleType:
    """Import examples/<name>.py as a fresh module (so overrides never leak between tests)."""
    path = EXAMPLES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"cupynorm_example_{name}", path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shrunk_example(case: ExampleCase) -> ModuleType:
    example = load_example(case.name)
    for attribute, value in case.overrides.items():
        assert hasattr(example, attribute), f"{case.name}.py has no module-level {attribute}"
        setattr(example, attribute, value)
    return example


def build_models(example: ModuleType, seed: int = 0) -> tuple[Any, Any]:
    """Model and ModelNew built from the same seed, on the GPU, in training mode."""
    torch.manual_seed(seed)
    model = example.Model(*example.get_init_inputs()).cuda()
    torch.manual_seed(seed)
    model_new = example.ModelNew(*example.get_init_inputs()).cuda()
    return model, model_new


def perturb_state(model: Any) -> None:
    """Non-trivial affine parameters and running statistics, so the comparison covers them."""
    generator = torch.Generator(device="cuda").manual_seed(1234)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                noise = torch.randn(parameter.shape, generator=generator, device="cuda")
                parameter.add_(0.1 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.add_(0.1 * torch.randn(buffer.shape, generator=generator, device="cuda"))
            elif name.endswith("running_var"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator, device="cuda"))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_state_dict_keys_and_seeded_weights_match(case: ExampleCase) -> None:
    example = shrunk_example(case)
    model, model_new = build_models(example)
    expected = model.state_dict()
    actual = model_new.state_dict()
    assert list(actual) == list(expected), "state_dict keys (names and order) differ"
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{key} differs after seeded construction"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_model_new_matches_model(case: ExampleCase) -> None:
    example = shrunk_example(case)
    model, model_new = build_models(example)
    perturb_state(model)
    model_new.load_state_dict(model.state_dict())
    assert model.training and model_new.training
    with torch.no_grad(), warnings.catch_warnings():
        # seed 002 calls InstanceNorm2d(8192) on (N, 1, 1, 8192): torch warns that C != 8192
        warnings.filterwarnings("ignore", message="input's size at dim=")
        for seed in SEEDS:
            torch.manual_seed(seed)
            inputs = example.get_inputs()
            assert all(t.is_cuda and t.dtype == torch.float32 for t in inputs)
            expected = model(*inputs)
            actual = model_new(*inputs)
            torch.testing.assert_close(
                actual,
                expected,
                atol=ATOL,
                rtol=RTOL,
                msg=lambda message, seed=seed: f"{case.name}, seed {seed}: {message}",
            )
            model_buffers = dict(model.named_buffers())
            for name, buffer in model_new.named_buffers():
                if buffer.is_floating_point():
                    torch.testing.assert_close(
                        buffer,
                        model_buffers[name],
                        atol=ATOL,
                        rtol=RTOL,
                        msg=lambda message, n=name, s=seed: f"{case.name} {n}, seed {s}: {message}",
                    )
                else:
                    assert torch.equal(buffer, model_buffers[name]), name


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_example_main_runs(case: ExampleCase, capsys: pytest.CaptureFixture[str]) -> None:
    """The `__main__` path: compare + time at a small batch, exit code 0."""
    from cupynorm.bench import run_example_cli

    example = shrunk_example(case)
    batch = str(case.overrides.get("batch_size", 2))
    assert run_example_cli(example, ["--batch", batch, "--reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "max abs error vs Model" in out
    assert "ModelNew (cupynorm)" in out
