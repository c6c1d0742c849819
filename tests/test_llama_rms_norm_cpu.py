"""Hugging Face RMSNorm layers of Llama's formula on the CPU: cupynorm's LlamaRMSNorm against
transformers' classes (attributes, state_dict, repr), the kernel route (eager Functions and custom
ops, on the reference kernels) against their forward and gradients in every dtype, replace_norms
on small transformers models (converted when named, Gemma's RMSNorm left alone with a warning),
torch.compile, and the host code's launches (a fake launcher).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_programs_cpu import launches  # noqa: F401 - the fixture
from torch import nn
from torch_cpu_helpers import patch_route

import cupynorm.torch as cnt
from cupynorm import _ops

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]


def _hf_classes() -> list[type]:
    """transformers' RMSNorm classes of Llama's formula that the installed version has."""
    import importlib

    found = []
    for module, name in [
        ("llama", "LlamaRMSNorm"),
        ("qwen2", "Qwen2RMSNorm"),
        ("mistral", "MistralRMSNorm"),
    ]:
        try:
            mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        except ImportError:
            continue
        if hasattr(mod, name):
            found.append(getattr(mod, name))
    return found


HF_CLASSES = _hf_classes()


def _hf_layer(cls, H, dtype, seed=0):
    layer = cls(H, eps=1e-5).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_((torch.rand(H, generator=g) + 0.5).to(dtype))
    return layer


def _grads(out, inputs, seed=4):
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(out.shape, generator=g).to(out.dtype)
    return torch.autograd.grad(out, inputs, dy)


# ---------------------------------------------------------------------------------------------
# the module is transformers' layer
# ---------------------------------------------------------------------------------------------
def test_module_attributes_state_dict_repr_equal_transformers():
    ours, theirs = cnt.LlamaRMSNorm(12, eps=1e-5), modeling_llama.LlamaRMSNorm(12, eps=1e-5)
    assert repr(ours) == repr(theirs)
    assert ours.variance_epsilon == theirs.variance_epsilon == 1e-5
    assert ours.state_dict().keys() == theirs.state_dict().keys() == {"weight"}
    torch.testing.assert_close(ours.weight, theirs.weight, rtol=0, atol=0)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert cnt.LlamaRMSNorm(8).variance_epsilon == modeling_llama.LlamaRMSNorm(8).variance_epsilon
    m = cnt.LlamaRMSNorm(8, dtype=torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# the kernel route (reference kernels on the CPU) computes what transformers computes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", HF_CLASSES, ids=[c.__name__ for c in HF_CLASSES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(3, 5, 40), (7, 1), (2, 33)], ids=["3x5x40", "7x1", "2x33"])
def test_kernel_route_matches_transformers(kernel_path, cls, dtype, shape):
    theirs = _hf_layer(cls, shape[-1], dtype)
    ours = cnt.LlamaRMSNorm(shape[-1], eps=1e-5, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype).requires_grad_()
    y, yr = ours(x), theirs(x)
    assert y.dtype == yr.dtype == dtype
    torch.testing.assert_close(y, yr, rtol=0, atol=0)  # same ops in the same order on the CPU
    got = _grads(y, [x, ours.weight])
    expected = _grads(yr, [x, theirs.weight])
    # transformers' autograd rounds dy * weight and dy * xhat to the dtype before reducing; ours
    # keeps them in float32: a few roundings of the dtype apart
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}[dtype]
    scale_x = shape[-1] if shape[-1] > 1 else 1e3  # one-element rows: dx is noise * 1/sqrt(eps)
    torch.testing.assert_close(got[0], expected[0], rtol=tol, atol=tol * scale_x)
    torch.testing.assert_close(got[1], expected[1], rtol=tol, atol=tol * shape[0] * 10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_kernel_route_rounds_before_the_weight(kernels, dtype):
    """Llama's two roundings are not rms_norm's one: the outputs differ somewhere, and ours is
    transformers' bit for bit; dweight sums dy * xhat with xhat rounded (float64 check)."""
    H = 64
    theirs = _hf_layer(modeling_llama.LlamaRMSNorm, H, dtype, seed=5)
    x = (torch.randn(16, H, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    ours = cnt.llama_rms_norm(x, theirs.weight.detach(), 1e-5)
    plain = cnt.rms_norm(x, (H,), theirs.weight.detach(), 1e-5)
    assert torch.equal(ours, theirs(x))
    assert not torch.equal(ours, plain)
    w = theirs.weight.detach().clone().requires_grad_()
    xg = x.clone().requires_grad_()
    dy = torch.randn(16, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    (dw,) = torch.autograd.grad(cnt.llama_rms_norm(xg, w, 1e-5), [w], dy)
    x64 = x.double()
    xhat = (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5)).to(dtype).double()
    expected = (dy.double() * xhat).sum(0)
    torch.testing.assert_close(dw.double(), expected, rtol=1e-2, atol=1e-2)


def test_kernel_route_float32_weight_beside_half_input(kernel_path):
    """weight float32, input bfloat16: the output is float32 (weight * xhat promotes), as the
    layer's; gradients reach both."""
    theirs = _hf_layer(modeling_llama.LlamaRMSNorm, 24, torch.float32)
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(6)).bfloat16()
    x.requires_grad_()
    y, yr = cnt.llama_rms_norm(x, theirs.weight, 1e-5), theirs(x)
    assert y.dtype == yr.dtype == torch.float32
    torch.testing.assert_close(y, yr, rtol=0, atol=0)
    for u, v in zip(_grads(y, [x, theirs.weight]), _grads(yr, [x, theirs.weight]), strict=True):
        torch.testing.assert_close(u, v, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_inputs_outside_the_kernels_run_the_layers_formula(kernels, monkeypatch, dtype):
    """float64 (the layer normalizes it in float32), a weight of another shape and no weight
    take transformers' own formula or its kernel equivalent; nothing raises that the layer
    would not."""
    x = torch.randn(3, 8, dtype=dtype)
    w = torch.rand(8, dtype=dtype) + 0.5
    layer = modeling_llama.LlamaRMSNorm(8).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    torch.testing.assert_close(cnt.llama_rms_norm(x, w, 1e-6), layer(x), rtol=0, atol=0)
    no_weight = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(cnt.llama_rms_norm(x, None, 1e-6), no_weight.to(dtype))
    with pytest.raises(RuntimeError) as ours:
        cnt.llama_rms_norm(x, torch.ones(5, dtype=dtype), 1e-6)
    with pytest.raises(RuntimeError) as theirs:
        torch.ones(5, dtype=dtype) * x
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(TypeError, match="expected hidden_states to be a torch.Tensor"):
        cnt.llama_rms_norm([1.0], None)


def test_kernel_route_empty_input(kernel_path):
    w = torch.rand(6, requires_grad=True)
    x = torch.randn(0, 6, requires_grad=True)
    y = cnt.llama_rms_norm(x, w, 1e-6)
    assert y.shape == (0, 6)
    dx, dw = torch.autograd.grad(y.sum(), [x, w])
    assert dx.shape == (0, 6) and torch.equal(dw, torch.zeros(6))


# ---------------------------------------------------------------------------------------------
# replace_norms on transformers models
# ---------------------------------------------------------------------------------------------
def _tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_replace_norms_converts_llama_layers_when_named(kernels):
    model = _tiny_llama()
    norms = [m for m in model.modules() if type(m) is modeling_llama.LlamaRMSNorm]
    assert len(norms) == 5  # two per layer and the final one
    with torch.no_grad():
        for m in norms:
            m.weight.uniform_(0.5, 1.5)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits
    reprs = [repr(m) for m in norms]
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict().keys())
    cnt.replace_norms(model)  # opt-in: untouched by default
    assert all(type(m) is modeling_llama.LlamaRMSNorm for m in norms)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnt.replace_norms(model, include=[cnt.LlamaRMSNorm])
    for m, r in zip(norms, reprs, strict=True):
        assert isinstance(m, cnt.LlamaRMSNorm) and isinstance(m, modeling_llama.LlamaRMSNorm)
        assert type(m).__name__ == "LlamaRMSNorm" and repr(m) == r
    assert len({type(m) for m in norms}) == 1  # one adopted class per transformers class
    assert [id(p) for p in model.parameters()] == params
    assert list(model.state_dict().keys()) == keys
    torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("cls", HF_CLASSES, ids=[c.__name__ for c in HF_CLASSES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_replace_norms_converts_each_transformers_copy(cls, dtype):
    model = nn.Sequential(nn.Linear(8, 8), cls(8, eps=1e-5)).to(dtype)
    cnt.replace_norms(model, include=cnt.LlamaRMSNorm)
    assert isinstance(model[1], cnt.LlamaRMSNorm) and isinstance(model[1], cls)
    assert model[1].variance_epsilon == 1e-5


def test_replace_norms_leaves_gemma_and_other_formulas_alone_and_says_so():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    class CastsToWeightRMSNorm(nn.Module):  # T5's order: cast to the weight's dtype
        def __init__(self, H):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(H, dtype=torch.bfloat16))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            v = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(v + self.variance_epsilon)
            return self.weight * x.to(self.weight.dtype)

    class NotANorm(nn.Module):  # no RMSNorm in the name: not a candidate, no warning
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.variance_epsilon = 1e-6

    gemma = GemmaRMSNorm(8)
    model = nn.Sequential(gemma, CastsToWeightRMSNorm(8), NotANorm())
    before = [type(m) for m in model]
    with pytest.warns(UserWarning, match="GemmaRMSNorm.*CastsToWeightRMSNorm"):
        cnt.replace_norms(model, include=[cnt.LlamaRMSNorm])
    assert [type(m) for m in model] == before


def test_replace_norms_llama_include_exclude_and_errors():
    norm = modeling_llama.LlamaRMSNorm(4)
    model = nn.Sequential(norm, nn.RMSNorm(4))
    cnt.replace_norms(model, include=[cnt.LlamaRMSNorm, nn.RMSNorm], exclude=[cnt.LlamaRMSNorm])
    assert type(norm) is modeling_llama.LlamaRMSNorm and type(model[1]) is cnt.RMSNorm
    cnt.replace_norms(model, include=[nn.RMSNorm, cnt.LlamaRMSNorm])
    assert isinstance(norm, cnt.LlamaRMSNorm)
    cnt.replace_norms(model, include=[cnt.LlamaRMSNorm])  # converted once: a no-op now
    with pytest.raises(ValueError, match="cupynorm.torch.LlamaRMSNorm"):
        cnt.replace_norms(model, include=[modeling_llama.LlamaRMSNorm])


def test_replace_norms_leaves_meta_layers_alone():
    with torch.device("meta"):
        norm = modeling_llama.LlamaRMSNorm(4)
    with pytest.warns(UserWarning, match="LlamaRMSNorm"):
        cnt.replace_norms(norm, include=[cnt.LlamaRMSNorm])
    assert type(norm) is modeling_llama.LlamaRMSNorm


def test_compile_fullgraph_matches_eager(kernels):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), modeling_llama.LlamaRMSNorm(8), nn.Linear(8, 8))
    eager = cnt.replace_norms(block, include=[cnt.LlamaRMSNorm])
    compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 5, 8, requires_grad=True)
    results = []
    for model in (eager, compiled):
        y = model(x)
        results.append((y, *torch.autograd.grad((y * y).sum(), [x, *eager.parameters()])))
    for u, v in zip(*results, strict=True):
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_functional_routes_to_torch_off_the_kernels(monkeypatch):
    """Without the kernels (CPU tensors), llama_rms_norm is transformers' formula itself."""
    patch_route(monkeypatch.setattr, "_use_kernels", lambda x, kind: False)
    layer = _hf_layer(modeling_llama.LlamaRMSNorm, 16, torch.bfloat16)
    x = torch.randn(5, 16).bfloat16()
    assert torch.equal(cnt.llama_rms_norm(x, layer.weight, 1e-5), layer(x))


# ---------------------------------------------------------------------------------------------
# host code: the cast kernels are launched (a fake launcher, no GPU)
# ---------------------------------------------------------------------------------------------
def test_cast_launches_the_cast_kernels(launches):  # noqa: F811
    x, w = torch.rand(6, 40), torch.rand(40)  # float32: 10 whole packs, the short-row kernels
    _ops.row_norm_fwd(x, None, w, None, 40, 1e-5, True, cast=True)
    assert [k for k, *_ in launches] == ["row_norm_fwd_short_rms_cast_4"]
    launches.clear()
    _ops.row_norm_fwd(x, None, w, None, 40, 1e-5, True)  # another signature: the plain kernel
    assert [k for k, *_ in launches] == ["row_norm_fwd_short_rms_4"]
    launches.clear()
    x41, w41 = torch.rand(6, 41), torch.rand(41)  # not whole packs: a CTA per row
    _ops.row_norm_fwd(x41, None, w41, None, 41, 1e-5, True, cast=True)
    assert [k for k, *_ in launches] == ["segment_norm_fwd_rms_cast"]
    launches.clear()
    D = 1 << 22  # longer than a team holds: the strided statistics, then the cast apply pass
    _ops.row_norm_fwd(torch.empty(2, D), None, torch.empty(D), None, D, 1e-5, True, cast=True)
    assert [k for k, *_ in launches][-1] == "segment_norm_apply_rows_cast"
    launches.clear()
    dy, rstd = torch.rand(6, 40), torch.rand(6)
    _ops.row_norm_bwd(dy, None, x, None, rstd, w, 40, (True, True, False), cast=True)
    assert [k for k, *_ in launches] == ["row_norm_bwd_short_cast_4", "row_norm_bwd_params"]
    launches.clear()
    dy41 = torch.rand(6, 41)
    _ops.row_norm_bwd(dy41, None, x41, None, rstd, w41, 41, (True, True, False), cast=True)
    names = [k for k, *_ in launches]
    assert "segment_norm_bwd_rows_dx_cast" in names and "segment_norm_bwd_rows_dx" not in names
    launches.clear()
    D = 2048  # whole packs: the one-pass backward in registers, with the cast
    x, dy, w, rstd = torch.rand(6, D), torch.rand(6, D), torch.rand(D), torch.rand(6)
    _ops.row_norm_bwd(dy, None, x, None, rstd, w, D, (True, True, False), cast=True)
    names = [k for k, *_ in launches]
    assert names == ["row_norm_bwd_cast_2", "row_norm_bwd_params"]
