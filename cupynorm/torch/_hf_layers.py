"""The residual add fused into the norm that follows it, inside transformers' decoder layers:
:func:`patch_transformers`.

A pre-norm decoder layer adds the attention's output to the residual stream and normalizes the
sum; cupynorm's row norm kernel does both in one pass (:func:`._hf_norms.add_llama_rms_norm`),
reading x and the residual once and writing the sum and the normed rows. transformers' layers do
the add in their ``forward``, so the layer's forward is replaced, per instance (never the class),
by one of the same structure that calls the fused op:

- ``"post_attention"`` (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma):
  ``s = residual + attn(input_layernorm(h)); y = post_attention_layernorm(s); return s + mlp(y)``;
- ``"pre_feedforward"`` (Gemma2, Gemma3): ``s = residual + post_attention_layernorm(attn(...))``,
  then ``pre_feedforward_layernorm(s)``, ``mlp``, ``post_feedforward_layernorm``, ``s + ...``.

Each layer is probed before it is patched: on a random input, the replacement with the fused op
replaced by the plain add and norm must give the installed layer's output bit for bit (the same
structure, the same calls), and with the fused op within a few roundings of the dtype.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import types
import warnings

import torch
from torch import Tensor

from . import _hf_norms

__all__ = ["patch_transformers"]

#: transformers' module -> (decoder-layer class, structure, the norm that follows the add)
_LAYERS = {
    "llama": ("LlamaDecoderLayer", "post_attention"),
    "mistral": ("MistralDecoderLayer", "post_attention"),
    "mixtral": ("MixtralDecoderLayer", "post_attention"),
    "qwen2": ("Qwen2DecoderLayer", "post_attention"),
    "qwen3": ("Qwen3DecoderLayer", "post_attention"),
    "qwen3_moe": ("Qwen3MoeDecoderLayer", "post_attention"),
    "gemma": ("GemmaDecoderLayer", "post_attention"),
    "gemma2": ("Gemma2DecoderLayer", "pre_feedforward"),
    "gemma3": ("Gemma3DecoderLayer", "pre_feedforward"),
}
_NORM_AFTER_ADD = {
    "post_attention": "post_attention_layernorm",
    "pre_feedforward": "pre_feedforward_layernorm",
}
#: the attribute a patched layer holds: (structure, formula's cupynorm class name, the forward's
#: parameter names after hidden_states, their defaults)
_STATE = "_cupynorm_fused_add"


def _known_layers() -> dict[type, str]:
    """The decoder-layer classes of the installed transformers -> their structure."""
    known = {}
    for family, (name, structure) in _LAYERS.items():
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except Exception:  # noqa: BLE001 - a family the installed version lacks, or breaks
            continue
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            known[cls] = structure
    return known


def _formula_of(norm: torch.nn.Module) -> _hf_norms.Formula | None:
    """The formula (with a fused add) ``norm`` computes: its cupynorm class's, or a probe's."""
    from .convert import _hf_candidate, _hf_formula

    for formula in _hf_norms.FORMULAS:
        if formula.add is not None and isinstance(norm, formula.module):
            return formula
    if not _hf_candidate(norm):
        return None
    formula = _hf_formula(norm)[0]
    return formula if formula is not None and formula.add is not None else None


# ---------------------------------------------------------------------------------------------
# the replacement forward
# ---------------------------------------------------------------------------------------------
def _add_norm(layer, norm: torch.nn.Module, x: Tensor, residual: Tensor, fused: bool):
    """(norm(residual + x), residual + x): on the fused kernel when it takes the call, else as
    the layer computes them (the add, then the norm module, its hooks included)."""
    if fused and not (norm._forward_hooks or norm._forward_pre_hooks):
        formula = _hf_norms.FORMULA_OF[layer.__dict__[_STATE][1]]
        if x.dtype != residual.dtype:  # autocast: the add promotes, as ``residual + x`` does
            dtype = torch.promote_types(x.dtype, residual.dtype)
            x, residual = x.to(dtype), residual.to(dtype)
        out = formula.add(x, residual, norm.weight, formula.eps_of(norm))
        if out is not None:
            return out
    total = residual + x
    return norm(total), total


def _fused_forward(self, *args, **kwargs):
    """A patched decoder layer's forward (bound to the layer: a copy of the model rebinds it)."""
    return _run(self, True, args, kwargs)


def _run(layer, fused: bool, args: tuple, kwargs: dict):
    structure, _formula, names, defaults = layer.__dict__[_STATE]
    if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
        # the class's forward checkpoints the layer: it runs as installed, unfused
        return type(layer).forward(layer, *args, **kwargs)
    if args:
        hidden_states, args = args[0], args[1:]
    else:
        hidden_states = kwargs.pop("hidden_states")
    # every other argument goes to self_attn by name, as the installed forward passes them
    attn_kwargs = dict(defaults)
    attn_kwargs.update(zip(names[: len(args)], args, strict=True))
    attn_kwargs.update(kwargs)
    residual = hidden_states
    h = layer.input_layernorm(hidden_states)
    h, _ = layer.self_attn(hidden_states=h, **attn_kwargs)
    if structure == "post_attention":
        h, total = _add_norm(layer, layer.post_attention_layernorm, h, residual, fused)
        return total + layer.mlp(h)
    h = layer.post_attention_layernorm(h)
    h, total = _add_norm(layer, layer.pre_feedforward_layernorm, h, residual, fused)
    return total + layer.post_feedforward_layernorm(layer.mlp(h))


# ---------------------------------------------------------------------------------------------
# the probe
# ---------------------------------------------------------------------------------------------
def _probe_inputs(layer) -> tuple[Tensor, dict]:
    """A random hidden state (1, 5, H) and the rotary (cos, sin) of the layer's head_dim."""
    weight = layer.input_layernorm.weight
    device, dtype, H = weight.device, weight.dtype, weight.shape[0]
    head_dim = getattr(layer.self_attn, "head_dim", None) or H
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((1, 5, H), generator=generator, device=device, dtype=dtype)
    angles = torch.randn((1, 5, head_dim), generator=generator, device=device, dtype=dtype)
    return x, {"position_embeddings": (angles.cos(), angles.sin()), "attention_mask": None}


def _why_not(layer, state: tuple) -> str:
    """Why the replacement does not compute what the installed forward computes ("" if it
    does): bit for bit with the plain add and norm, within rounding with the fused op."""
    weight = getattr(layer.input_layernorm, "weight", None)
    if weight is None or weight.device.type == "meta":
        return "no weight to probe it with (meta device?)"
    training = {m: m.training for m in layer.modules()}
    layer.eval()  # dropout off for the probe
    layer.__dict__[_STATE] = state
    try:
        x, kwargs = _probe_inputs(layer)
        with torch.no_grad():
            expected = type(layer).forward(layer, x, **kwargs)
            plain = _run(layer, False, (x,), dict(kwargs))
            fused = _run(layer, True, (x,), dict(kwargs))
    except Exception as error:  # noqa: BLE001 - a forward of another structure fails
        return f"the probe failed ({type(error).__name__}: {error})"
    finally:
        del layer.__dict__[_STATE]
        for m, mode in training.items():
            m.training = mode
    if not isinstance(expected, Tensor):
        return f"its forward returns {type(expected).__name__}, not a tensor"
    if plain.dtype != expected.dtype or not torch.equal(plain, expected):
        return "its forward computes something else than the known structure"
    if fused.dtype != expected.dtype or fused.shape != expected.shape:
        return "the fused add and norm gives another dtype or shape"
    # a few roundings of the dtype, relative to the largest output (the residual stream)
    bound = 8 * torch.finfo(expected.dtype).eps * expected.abs().max().item()
    if not bool(((fused - expected).abs() <= bound).all()):
        return "the fused add and norm differs from the layer's by more than rounding"
    return ""


def patch_transformers(model: torch.nn.Module) -> int:
    """Fuse the residual add and the norm after it inside transformers' decoder layers, in place.

    For each decoder layer of ``model`` of a class it knows -- ``LlamaDecoderLayer``,
    ``MistralDecoderLayer``, ``MixtralDecoderLayer``, ``Qwen2DecoderLayer``,
    ``Qwen3DecoderLayer``, ``Qwen3MoeDecoderLayer``, ``GemmaDecoderLayer`` (the add before
    ``post_attention_layernorm``), ``Gemma2DecoderLayer``, ``Gemma3DecoderLayer`` (the add
    before ``pre_feedforward_layernorm``) -- the layer's ``forward`` is replaced, on that
    instance only, by one of the same structure whose add and norm run as one kernel on CUDA
    (Llama's or Gemma's RMSNorm of ``attention output + residual``, returning both the normed
    rows and the sum, as :func:`cupynorm.torch.add_rms_norm`), with the layer's numerics: the
    sum rounded to the dtype, the norm's formula. The norm module may be transformers' own or
    already converted by :func:`replace_norms`; its weight and eps are read on every call.

    Before a layer is patched, a probe checks it: on a random input (and the layer's weights),
    the replacement must compute what the installed transformers' forward computes -- bit for bit
    with the plain add and norm in place of the fused op, and within a few roundings of the
    dtype with it. A layer that fails, whose norm computes another formula, or whose forward was
    already replaced, is left alone and named in a warning with the reason.

    Where the fused op does not apply the patched layer adds and normalizes as the installed one
    does: CPU tensors, a norm with hooks, and gradient checkpointing in training (the class's
    forward then runs the whole layer). Under autocast the attention's output is promoted to the
    residual's dtype before the add, as ``residual + x`` promotes. ``del layer.forward`` undoes
    a layer's patch.

    Args:
        model: a transformers model (or any module holding such layers).

    Returns:
        The number of layers patched.

    Example::

        >>> model = transformers.AutoModelForCausalLM.from_config(config).cuda()
        >>> cnt.replace_norms(model, include=cnt.HF_NORMS)   # the other norms
        >>> cnt.patch_transformers(model)                    # the adds before a norm
        32
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"patch_transformers: expected a torch.nn.Module, got {type(model)}")
    if importlib.util.find_spec("transformers") is None:
        return 0
    known = _known_layers()
    patched = 0
    left_alone: dict[str, list] = {}
    for layer in model.modules():
        structure = known.get(type(layer))
        if structure is None:
            continue
        why = ""
        if "forward" in layer.__dict__:
            if layer.__dict__.get(_STATE) is not None:
                continue  # patched before
            why = "its forward was already replaced"
        formula = None
        if not why:
            formula = _formula_of(getattr(layer, _NORM_AFTER_ADD[structure]))
            if formula is None:
                why = "its norm computes neither Llama's nor Gemma's RMSNorm"
        if not why:
            signature = inspect.signature(type(layer).forward)
            params = list(signature.parameters.values())[2:]  # after self and hidden_states
            names = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
            defaults = tuple(
                (p.name, p.default)
                for p in params
                if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty
            )
            state = (structure, formula.module, names, defaults)
            why = _why_not(layer, state)
        if why:
            name = f"{type(layer).__module__}.{type(layer).__qualname__}"
            left_alone.setdefault(name, [0, why])[0] += 1
            continue
        layer.__dict__[_STATE] = state
        layer.forward = types.MethodType(_fused_forward, layer)
        patched += 1
    if left_alone:
        names = ", ".join(f"{n} (x{count}, {why})" for n, (count, why) in left_alone.items())
        warnings.warn(
            f"patch_transformers: left these decoder layers unpatched: {names}",
            UserWarning,
            stacklevel=2,
        )
    return patched
