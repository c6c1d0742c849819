"""transformers' model families on the CPU: replace_norms converts every norm of each family
(built from a tiny config, random weights) into the cupynorm class of its formula, and the
converted model on the reference kernels (the CUDA route on CPU tensors) gives the original's
logits and gradients within rounding; each formula's module against transformers' layer in every
dtype; the warnings for what is left alone; patch_transformers' decoder layers against the
installed ones (on the plain route and on the fused kernel), and what it leaves unpatched.
"""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import cupynorm.torch as cnt  # noqa: E402

_SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
# family -> (config class, model class, config overrides, cupynorm classes its norms become)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {cnt.LlamaRMSNorm}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, {cnt.LlamaRMSNorm}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, {cnt.LlamaRMSNorm}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8), {cnt.LlamaRMSNorm}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4),
                {cnt.LlamaRMSNorm}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8),
                  {cnt.LlamaRMSNorm}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0), {cnt.LlamaRMSNorm}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=4, moe_intermediate_size=16, kv_lora_rank=8,
                         q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                         first_k_dense_replace=1, num_experts_per_tok=2, n_group=1,
                         topk_group=1, num_key_value_heads=4),
                    {cnt.LlamaRMSNorm}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8), {cnt.GemmaRMSNorm}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8), {cnt.GemmaRMSNorm}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=8), {cnt.GemmaRMSNorm}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}, {cnt.OlmoLayerNorm}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, {cnt.Olmo2RMSNorm}),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(pad_token_id=0), {cnt.CohereLayerNorm}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}, {cnt.LayerNorm}),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(num_kv_heads=2), {cnt.LayerNorm}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, {cnt.LayerNorm}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32), {cnt.LayerNorm}),
    "bert": ("BertConfig", "BertForMaskedLM",
             dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=32), {cnt.LayerNorm}),
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                decoder_start_token_id=0), {cnt.T5LayerNorm}),
}  # fmt: skip
# families of a whole-sequence model (config keys of their own, not _SMALL's)
_OWN_CONFIG = {"gpt2", "bert", "t5"}
# decoder layers patch_transformers knows
PATCHED = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3",
]


def _build(family: str, seed: int = 0) -> nn.Module:
    config_name, model_name, overrides, _ = FAMILIES[family]
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"the installed transformers has no {model_name}")
    kwargs = dict(overrides) if family in _OWN_CONFIG else {**_SMALL, **overrides}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    # MoE experts as a loop of linears: the default grouped GEMM on CUDA takes bf16 only, and
    # the float64 reference run must go through the same formulas
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # non-trivial norm weights (Gemma's start at 0, the others at 1)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if _is_norm(module) and isinstance(weight, torch.Tensor):
                weight.copy_(torch.rand(weight.shape, generator=g) * 0.5 + 0.75)
    return model


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "rmsnorm" in name or "layernorm" in name


def _run(model: nn.Module, family: str, ids: torch.Tensor):
    """(logits, the gradient of every parameter) of a loss with a non-constant gradient."""
    model.zero_grad(set_to_none=True)
    kwargs = {"decoder_input_ids": ids} if family == "t5" else {}
    logits = model(ids, **kwargs).logits
    ramp = torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
    (logits * ramp + logits.square()).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_run(got, expected, tol=1e-5):
    """Logits within float32 rounding; gradients (the kernels' backward is not torch's
    autograd, and the loss squares the logits) within 10x that, relative to their largest."""
    torch.testing.assert_close(got[0], expected[0], rtol=tol, atol=tol)
    assert got[1].keys() == expected[1].keys()
    for name, grad in expected[1].items():
        atol = 10 * tol * max(1.0, grad.abs().max().item())
        torch.testing.assert_close(got[1][name], grad, rtol=10 * tol, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# replace_norms: every norm of every family
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_replace_norms_converts_every_norm_of_the_family(kernels, family):
    model = _build(family)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = _run(copy.deepcopy(model), family, ids)
    norms = [m for m in model.modules() if _is_norm(m) or isinstance(m, nn.LayerNorm)]
    assert norms
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        cnt.replace_norms(model, include=[*cnt.HF_NORMS, nn.LayerNorm])
    ours = {c for m in norms for c in FAMILIES[family][3] if isinstance(m, c)}
    assert ours == FAMILIES[family][3]
    assert all(isinstance(m, tuple(FAMILIES[family][3])) for m in norms)
    _assert_same_run(_run(model, family, ids), expected)


def test_qwen3_q_and_k_norms_over_head_dim_are_converted(kernels):
    model = _build("qwen3")
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_norm.weight, torch.Tensor) and attn.q_norm.weight.shape == (8,)
    cnt.replace_norms(model, include=cnt.HF_NORMS)
    assert isinstance(attn.q_norm, cnt.LlamaRMSNorm) and isinstance(attn.k_norm, cnt.LlamaRMSNorm)


# ---------------------------------------------------------------------------------------------
# each formula's module against transformers' layer, on the reference kernels
# ---------------------------------------------------------------------------------------------
def _layer(module: str, name: str):
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    if not hasattr(mod, name):
        pytest.skip(f"the installed transformers has no {name}")
    return getattr(mod, name)


# (transformers module, layer, cupynorm class, exact forward on the reference kernels)
LAYERS = [
    ("gemma", "GemmaRMSNorm", cnt.GemmaRMSNorm, True),
    ("gemma3", "Gemma3RMSNorm", cnt.GemmaRMSNorm, True),
    ("t5", "T5LayerNorm", cnt.T5LayerNorm, True),
    ("olmo2", "Olmo2RMSNorm", cnt.Olmo2RMSNorm, True),
    ("cohere", "CohereLayerNorm", cnt.CohereLayerNorm, False),  # two-pass variance in torch
    ("olmo", "OlmoLayerNorm", cnt.OlmoLayerNorm, False),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("module,name,ours_cls,exact", LAYERS, ids=[n for _, n, _, _ in LAYERS])
@pytest.mark.parametrize("x_dtype", DTYPES, ids=["x32", "xbf16", "x16"])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["w32", "wbf16"])
def test_formula_module_matches_transformers_layer(kernel_path, module, name, ours_cls, exact,
                                                    x_dtype, w_dtype):  # fmt: skip
    layer_cls = _layer(module, name)
    H = 40
    theirs = layer_cls(H) if name != "OlmoLayerNorm" else layer_cls(H)
    theirs = theirs.to(w_dtype)
    ours = copy.deepcopy(theirs)
    cnt.replace_norms(ours, include=ours_cls)
    assert isinstance(ours, ours_cls) and isinstance(ours, layer_cls)
    assert repr(ours) == repr(theirs)
    params = list(theirs.parameters())
    if params:
        with torch.no_grad():
            w = torch.rand(H, generator=torch.Generator().manual_seed(2)) + 0.5
            params[0].copy_(w.to(w_dtype))
            next(ours.parameters()).copy_(w.to(w_dtype))
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 5, H, generator=g) * 3 + 1).to(x_dtype).requires_grad_()
    y, yr = ours(x), theirs(x)
    assert y.dtype == yr.dtype
    if exact:
        torch.testing.assert_close(y, yr, rtol=0, atol=0)
    else:  # one rounding of the output's dtype apart, at most
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[y.dtype]
        torch.testing.assert_close(y, yr, rtol=tol, atol=tol)
    dy = torch.randn(y.shape, generator=g).to(y.dtype)
    ins = [x, *ours.parameters()]
    got = torch.autograd.grad(y, ins, dy)
    expected = torch.autograd.grad(yr, [x, *theirs.parameters()], dy)
    low = torch.float32 if {x_dtype, w_dtype} == {torch.float32} else torch.bfloat16
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[low]
    torch.testing.assert_close(got[0], expected[0], rtol=tol, atol=tol * H)
    for u, v in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(u, v, rtol=tol, atol=tol * 15)


def test_formula_modules_attributes_equal_transformers():
    pairs = [
        (cnt.GemmaRMSNorm(12), _layer("gemma", "GemmaRMSNorm")(12), "eps"),
        (cnt.T5LayerNorm(12), _layer("t5", "T5LayerNorm")(12), "variance_epsilon"),
        (cnt.Olmo2RMSNorm(12), _layer("olmo2", "Olmo2RMSNorm")(12), "variance_epsilon"),
        (cnt.CohereLayerNorm(12), _layer("cohere", "CohereLayerNorm")(12), "variance_epsilon"),
    ]
    for ours, theirs, eps in pairs:
        assert getattr(ours, eps) == getattr(theirs, eps)
        assert ours.state_dict().keys() == theirs.state_dict().keys() == {"weight"}
        torch.testing.assert_close(ours.weight, theirs.weight, rtol=0, atol=0)
    olmo = _layer("olmo", "OlmoLayerNorm")(12)
    assert cnt.OlmoLayerNorm(12).normalized_shape == olmo.normalized_shape


# ---------------------------------------------------------------------------------------------
# what is left alone, and why
# ---------------------------------------------------------------------------------------------
class ScaledRMSNorm(nn.Module):  # an unknown formula
    def __init__(self, H):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (2 * self.weight * h).to(x.dtype)


def test_unknown_formulas_are_left_alone_with_the_reason():
    cohere = _layer("cohere", "CohereLayerNorm")
    qk_norm = cohere(hidden_size=(4, 8))  # Cohere's QK norm: a (heads, head_dim) weight
    gemma = _layer("gemma", "GemmaRMSNorm")(8)
    model = nn.Sequential(ScaledRMSNorm(8), qk_norm, gemma)
    before = [type(m) for m in model]
    with pytest.warns(UserWarning) as record:
        cnt.replace_norms(model, include=[cnt.LlamaRMSNorm, cnt.CohereLayerNorm])
    message = str(record[0].message)
    assert "ScaledRMSNorm (x1, its forward computes none of the formulas" in message
    assert "CohereLayerNorm (x1, its weight is not a vector)" in message
    assert (
        "GemmaRMSNorm (x1, the formula of cupynorm.torch.GemmaRMSNorm, not in include)" in message
    )
    assert [type(m) for m in model] == before
    with warnings.catch_warnings():  # excluded: no word of it
        warnings.simplefilter("error", UserWarning)
        cnt.replace_norms(gemma, include=cnt.LlamaRMSNorm, exclude=cnt.GemmaRMSNorm)
    assert type(gemma) is before[2]


def test_hf_norms_are_opt_in():
    model = _build("gemma")
    cnt.replace_norms(model)
    assert not any(isinstance(m, cnt.HF_NORMS) for m in model.modules())


# ---------------------------------------------------------------------------------------------
# patch_transformers
# ---------------------------------------------------------------------------------------------
def _layers(model):
    return list(model.model.layers)


@pytest.mark.parametrize("convert", [False, True], ids=["their_norms", "converted_norms"])
@pytest.mark.parametrize("family", PATCHED)
def test_patch_transformers_matches_the_installed_layers(kernels, family, convert):
    """Fused on the reference kernels: the same logits and gradients as the original."""
    model = _build(family)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = _run(copy.deepcopy(model), family, ids)
    if convert:
        cnt.replace_norms(model, include=cnt.HF_NORMS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert cnt.patch_transformers(model) == 2
    assert all("forward" in layer.__dict__ for layer in _layers(model))
    assert cnt.patch_transformers(model) == 0  # patched once
    _assert_same_run(_run(model, family, ids), expected)


def test_patch_transformers_runs_the_fused_op(kernels, monkeypatch):
    from cupynorm.torch import _hf_norms

    residuals = []
    real = _hf_norms._row_norm_route

    def spy(*args):
        residuals.append(args[3] is not None)
        return real(*args)

    monkeypatch.setattr(_hf_norms, "_row_norm_route", spy)
    model = _build("llama")
    cnt.patch_transformers(model)
    residuals.clear()
    model(torch.randint(0, 64, (2, 7)))
    assert residuals == [True, True]  # one fused add and norm per layer


def test_patch_transformers_on_the_plain_route_is_exact():
    """CPU tensors (no kernels): the patched layer adds and normalizes as the installed one."""
    model = _build("llama")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = _run(copy.deepcopy(model), "llama", ids)
    assert cnt.patch_transformers(model) == 2
    _assert_same_run(_run(model, "llama", ids), expected, tol=0)


def test_patch_transformers_fused_route_under_autocast(kernels):
    """bfloat16 autocast: the attention's bf16 output is promoted to the float32 residual."""
    model = _build("qwen2")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = copy.deepcopy(model)(ids).logits
        cnt.patch_transformers(model)
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_patched_model_copies_undo_and_gradient_checkpointing():
    model = _build("llama")
    cnt.patch_transformers(model)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model(ids).logits
    twin = copy.deepcopy(model)
    for layer in _layers(twin):  # the copy's forward is bound to the copy
        assert layer.forward.__self__ is layer
    torch.testing.assert_close(twin(ids).logits, expected, rtol=0, atol=0)
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    assert _layers(model)[0].gradient_checkpointing
    model.train()
    logits = model(ids).logits
    logits.sum().backward()
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    layer = _layers(model)[0]
    del layer.forward
    assert cnt.patch_transformers(model) == 1


def test_layers_that_differ_are_left_unpatched_with_the_reason(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = _build("llama")
    first, second = _layers(model)
    second.post_attention_layernorm = ScaledRMSNorm(32)
    with pytest.warns(UserWarning, match=r"LlamaDecoderLayer \(x1, its norm computes neither"):
        assert cnt.patch_transformers(model) == 1
    assert "forward" in first.__dict__ and "forward" not in second.__dict__

    model = _build("llama")
    original = modeling_llama.LlamaDecoderLayer.forward

    def scaled_forward(self, hidden_states, *args, **kwargs):  # a future version, say
        return original(self, hidden_states, *args, **kwargs) * 0.5

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", scaled_forward)
    with pytest.warns(UserWarning, match="computes something else than the known structure"):
        assert cnt.patch_transformers(model) == 0
    monkeypatch.undo()

    model = _build("llama")
    _layers(model)[0].forward = lambda *a, **k: None
    with pytest.warns(UserWarning, match="its forward was already replaced"):
        assert cnt.patch_transformers(model) == 1


def test_patch_transformers_without_transformers(monkeypatch):
    model = _build("llama")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert cnt.patch_transformers(model) == 0
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        cnt.patch_transformers("model")
