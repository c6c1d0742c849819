"""transformers' model families on CUDA: each family (tiny config, random weights) with its norms
converted by replace_norms and its decoder layers patched by patch_transformers, in float32 and
under bfloat16 autocast, and each formula's module in float32 / bfloat16 / float16: the errors of
logits and gradients against a float64 run are no worse than those of transformers' own model.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
from conftest import requires_gpu

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_transformers_cpu import FAMILIES, LAYERS, PATCHED, _build, _layer  # noqa: E402
from torch import nn  # noqa: E402

import cupynorm.torch as cnt  # noqa: E402

pytestmark = requires_gpu


def _run(model, family, ids, autocast):
    """(logits, gradients by name) in float64, of a loss with a non-constant gradient."""
    model.zero_grad(set_to_none=True)
    kwargs = {"decoder_input_ids": ids} if family == "t5" else {}
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        logits = model(ids, **kwargs).logits
    ramp = torch.linspace(-1, 1, logits.numel(), device=logits.device).reshape(logits.shape)
    (logits.double() * ramp + logits.double().square()).sum().backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().double(), grads


def _no_worse(ours, theirs, reference, what, dtype):
    err_ours = (ours - reference).abs().max().item()
    err_theirs = (theirs - reference).abs().max().item()
    floor = 4 * torch.finfo(dtype).eps * max(1.0, reference.abs().max().item())
    assert err_ours <= 2 * err_theirs + floor, (what, err_ours, err_theirs)


@pytest.mark.parametrize("mode", ["float32", "autocast_bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_errors_no_worse_than_transformers(family, mode):
    autocast = mode == "autocast_bf16"
    model = _build(family).cuda()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0)).cuda()
    reference = _run(copy.deepcopy(model).double(), family, ids, False)
    theirs = _run(copy.deepcopy(model), family, ids, autocast)
    ours = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        cnt.replace_norms(ours, include=[*cnt.HF_NORMS, nn.LayerNorm])
        patched = cnt.patch_transformers(ours)
    assert patched == (2 if family in PATCHED else 0)
    got = _run(ours, family, ids, autocast)
    dtype = torch.bfloat16 if autocast else torch.float32
    _no_worse(got[0], theirs[0], reference[0], "logits", dtype)
    for name, grad in reference[1].items():
        _no_worse(got[1][name], theirs[1][name], grad, name, dtype)


@pytest.mark.parametrize("module,name,ours_cls,exact", LAYERS, ids=[n for _, n, _, _ in LAYERS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])  # fmt: skip
def test_formula_module_errors_no_worse_than_the_layer(module, name, ours_cls, exact, dtype):
    theirs = _layer(module, name)(1024).cuda()
    if name != "OlmoLayerNorm":
        with torch.no_grad():
            theirs.weight.copy_(torch.rand(1024) * 0.5 + 0.75)
    reference = copy.deepcopy(theirs).double()
    theirs = theirs.to(dtype)
    ours = cnt.replace_norms(copy.deepcopy(theirs), include=ours_cls)
    assert isinstance(ours, ours_cls)
    x = torch.randn(64, 1024, device="cuda") * 3 + 1
    runs, dtypes = [], []
    for layer, xd in ((reference, x.double()), (theirs, x.to(dtype)), (ours, x.to(dtype))):
        xd = xd.clone().requires_grad_()
        y = layer(xd)
        dtypes.append(y.dtype)
        dy = torch.linspace(-1, 1, y.numel(), device="cuda", dtype=torch.float64)
        (y.double() * dy.reshape(y.shape)).sum().backward()
        runs.append((y.double(), xd.grad.double(), *(p.grad.double() for p in layer.parameters())))
    assert dtypes[1] == dtypes[2]
    for what, ref, t, o in zip(("y", "dx", "dweight"), *runs, strict=False):
        _no_worse(o, t, ref, what, dtype)
