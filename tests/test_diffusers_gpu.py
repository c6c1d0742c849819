"""diffusers' UNet2DConditionModel and AutoencoderKL (tiny configs) under `cupynorm.torch.fuse`
on the GPU: in float64 the converted model matches the original to rounding; in float32 (TF32
off) its output, input gradient and parameter gradients are as close to a float64 run of the
original as the original's own float32 run is (within 2x, as tests/test_fused_gpu.py asks of
resnet50)."""

from __future__ import annotations

import copy

import pytest
from conftest import cuda_available
from test_diffusers_cpu import TINY_UNET, TINY_VAE, _tiny_unet_row, _tiny_vae_row

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

if cuda_available():
    import torch
    from torch import nn

    import cupynorm.torch as cnt
    from cupynorm.bench import diffusers_models


def _models(kind: str):
    """(original, converted) on the GPU in float32: the tiny UNet (fuse, then its LayerNorms,
    as the bench's row) or the tiny VAE decoder (fuse)."""
    diffusers = pytest.importorskip("diffusers")
    diffusers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "unet":
        original = diffusers_models.unet_noise_prediction(_tiny_unet_row(4), TINY_UNET)
    else:
        original = diffusers_models.vae_decode(_tiny_vae_row(4), TINY_VAE)
    report: list[str] = []
    converted = cnt.fuse(copy.deepcopy(original), report=report)
    if kind == "unet":
        converted = cnt.replace_norms(converted, include=[nn.LayerNorm])
    assert len(report) == 24 if kind == "unet" else len(report) == 12
    assert list(converted.state_dict()) == list(original.state_dict())
    return original.cuda(), converted.cuda()


def _run(model, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, input gradient and parameter gradients of a loss of the output."""
    x = x.to(next(model.parameters()).dtype).requires_grad_(True)
    out = model(x)
    out.square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return {"output": out.detach(), "input grad": x.grad, **grads}


def _error(run: dict, reference: dict, names: list[str]) -> float:
    difference = max((run[n].double() - reference[n]).abs().max().item() for n in names)
    return difference / max(reference[n].abs().max().item() for n in names)


def _groups(reference: dict) -> list[tuple[str, list[str]]]:
    params = [n for n in reference if n not in ("output", "input grad")]
    return [("output", ["output"]), ("input grad", ["input grad"]), ("params", params)]


@pytest.mark.parametrize("kind", ["unet", "vae"])
def test_converted_matches_the_original_in_float64(kind: str) -> None:
    original, converted = _models(kind)
    original, converted = original.double(), converted.double()
    x = torch.randn(4, 4, 8, 8, device="cuda", dtype=torch.float64)
    ours, reference = _run(converted, x), _run(original, x)
    assert ours.keys() == reference.keys()
    for what, names in _groups(reference):
        assert _error(ours, reference, names) <= 1e-10, what


@pytest.mark.parametrize("kind", ["unet", "vae"])
def test_converted_is_as_accurate_as_torch_in_float32(kind: str) -> None:
    original, converted = _models(kind)
    reference_model = copy.deepcopy(original).double()
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        x = torch.randn(4, 4, 8, 8, device="cuda", dtype=torch.float64)
        ours, theirs, reference = (_run(m, x) for m in (converted, original, reference_model))
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    for what, names in _groups(reference):
        error, torch_error = _error(ours, reference, names), _error(theirs, reference, names)
        assert error <= 2 * torch_error + 1e-6, f"{what}: {error:.2e} against {torch_error:.2e}"
