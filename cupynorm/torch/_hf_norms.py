r"""Hugging Face transformers' norm layers of formulas other than Llama's, on the row norm's
kernels (:mod:`._row_norm`), with the layers' own numerics:

============================  ==========================================================  =======
cupynorm class (layers)       formula (x of dtype ``d``; in float32)                      output
============================  ==========================================================  =======
:class:`GemmaRMSNorm`         ``rms(x) * (1 + w.float())``, rounded once                  ``d``
  (Gemma, Gemma2, Gemma3,
  Qwen3-Next)
:class:`T5LayerNorm`          ``w * rms(x)``, ``rms(x)`` rounded to ``w``'s dtype first   ``w``'s
  (T5, mT5, ...)              when ``w`` is float16 / bfloat16
:class:`Olmo2RMSNorm`         ``w * rms(x)``, rounded once                                ``d``
  (OLMo 2, OLMo 3)
:class:`CohereLayerNorm`      ``w * (x - mean) * rstd`` (no bias), rounded once           ``d``
  (Cohere, Cohere2)
:class:`OlmoLayerNorm`        ``(x - mean) * rstd`` (no weight, eps 1e-5), rounded once    ``d``
  (OLMo)
============================  ==========================================================  =======

with ``rms(x) = x * rsqrt(mean(x^2) + eps)``. Each is the row norm op (RMSNorm, or LayerNorm for
the last two) with a weight transform and casts around it: Gemma's ``1 + w`` is a float32
vector made by torch (a tiny elementwise op, which also carries the weight's gradient), a float32
output of a half-precision input is the op's ``out_float32`` form, and T5's rounding to the weight's
dtype is Llama's ``cast`` where the dtypes agree. Calls the kernels do not take (CPU tensors,
float64, weights that are not a vector of the row's length) run the layer's own torch formula, op
for op (``_*_torch``: also what :func:`cupynorm.torch.replace_norms` probes a layer against).

:data:`FORMULAS` lists these with Llama's (:class:`cupynorm.torch.LlamaRMSNorm`); the Llama and
Gemma entries also have a fused residual add (``add``: ``s = x + residual`` rounded to x's dtype,
then the norm of ``s``, in one kernel) that :func:`cupynorm.torch.patch_transformers` runs inside
decoder layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks
from ._llama_rms_norm import _llama_rms_norm_torch
from ._policy import inductor_takes
from ._route import _use_kernels
from ._row_norm import _row_norm_route
from .modules import LlamaRMSNorm

__all__ = [
    "FORMULAS",
    "HF_NORMS",
    "CohereLayerNorm",
    "Formula",
    "GemmaRMSNorm",
    "Olmo2RMSNorm",
    "OlmoLayerNorm",
    "T5LayerNorm",
]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HALF = (torch.float16, torch.bfloat16)
#: OlmoLayerNorm's eps, a constant of its forward (the layer has no attribute for it)
_OLMO_EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# the layers' formulas, op for op (the reference, the fallback, what a probe compares with)
# ---------------------------------------------------------------------------------------------
def _gemma_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def _t5_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + eps)
    if weight.dtype in _HALF:
        h = h.to(weight.dtype)
    return weight * h


def _olmo2_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def _cohere_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    h = (h - mean) * torch.rsqrt(variance + eps)
    return (weight.to(torch.float32) * h).to(x.dtype)


def _olmo_torch(x: Tensor, weight: None, eps: float) -> Tensor:
    return F.layer_norm(x.to(torch.float32), (x.shape[-1],), None, None, eps=eps).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# on the kernels
# ---------------------------------------------------------------------------------------------
def _kernels_take(x: Tensor, weight: Tensor | None, eps: float, kind: str) -> bool:
    """Whether the row norm's kernels take this call (else the layer's torch formula runs): a
    CUDA tensor of a kernel dtype (eager calls of any size: each formula is several torch ops),
    a number eps, and no weight or a vector of the row's length of a kernel dtype beside it."""
    return (
        _use_kernels(x, "llama_rms_norm")
        and not inductor_takes(kind, x, "llama_rms_norm")
        and x.dtype in _KERNEL_DTYPES
        and x.dim() > 0
        and isinstance(eps, (int, float))
        and not isinstance(eps, bool)
        and (
            weight is None
            or (
                isinstance(weight, Tensor)
                and tuple(weight.shape) == (x.shape[-1],)
                and weight.dtype in _KERNEL_DTYPES
                and weight.device == x.device
            )
        )
    )


def _route(x, residual, weight, eps, rms, cast=False, to_float32=False):
    """(y, the sum or None) of the row norm over x's last dim (checked by the caller)."""
    dims = (x.shape[-1],)
    return _row_norm_route(None, None, x, residual, dims, weight, None, float(eps), rms, cast,
                           to_float32)  # fmt: skip


def _single_rounding_weight(x: Tensor, weight: Tensor) -> Tensor:
    """The weight as the op takes it (x's dtype or float32) for a formula that multiplies in
    float32: a float16 / bfloat16 weight beside another dtype's x is made float32 (exactly)."""
    return weight if weight.dtype in (x.dtype, torch.float32) else weight.float()


def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Gemma's RMSNorm: normalized in float32, times ``1 + weight`` in float32, rounded once."""
    _checks.check_tensor("gemma_rms_norm", "x", x)
    if weight is None or not _kernels_take(x, weight, eps, "rms_norm"):
        return _gemma_torch(x, weight, eps)
    return _route(x, None, 1.0 + weight.float(), eps, True)[0]


def t5_layer_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """T5's RMSNorm: ``weight * xhat`` with xhat in float32, rounded to the weight's dtype first
    when the weight is float16 / bfloat16 (the output then has the weight's dtype)."""
    _checks.check_tensor("t5_layer_norm", "x", x)
    if weight is None or not _kernels_take(x, weight, eps, "rms_norm"):
        return _t5_torch(x, weight, eps)
    if weight.dtype in _HALF:
        if weight.dtype == x.dtype:  # Llama's two roundings
            return _route(x, None, weight, eps, True, cast=True)[0]
        xhat = _route(x, None, None, eps, True, to_float32=True)[0]  # float32
        return weight * xhat.to(weight.dtype)
    return _route(x, None, weight, eps, True, to_float32=True)[0]  # float32, whatever x's dtype


def olmo2_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """OLMo 2's RMSNorm: ``weight * xhat`` in float32, rounded once to x's dtype."""
    _checks.check_tensor("olmo2_rms_norm", "x", x)
    if weight is None or not _kernels_take(x, weight, eps, "rms_norm"):
        return _olmo2_torch(x, weight, eps)
    return _route(x, None, _single_rounding_weight(x, weight), eps, True)[0]


def cohere_layer_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """Cohere's LayerNorm (no bias): ``weight * xhat`` in float32, rounded once to x's dtype."""
    _checks.check_tensor("cohere_layer_norm", "x", x)
    if weight is None or not _kernels_take(x, weight, eps, "layer_norm"):
        return _cohere_torch(x, weight, eps)
    return _route(x, None, _single_rounding_weight(x, weight), eps, False)[0]


def olmo_layer_norm(x: Tensor, weight: None = None, eps: float = _OLMO_EPS) -> Tensor:
    """OLMo's LayerNorm: no weight nor bias, in float32, rounded once to x's dtype."""
    _checks.check_tensor("olmo_layer_norm", "x", x)
    if not _kernels_take(x, None, eps, "layer_norm"):
        return _olmo_torch(x, None, eps)
    return _route(x, None, None, eps, False)[0]


# ---- the norm of a residual sum, in one kernel ------------------------------------------------
def _add_takes(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> bool:
    return (
        isinstance(x, Tensor)
        and isinstance(residual, Tensor)
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and residual.device == x.device
        and _kernels_take(x, weight, eps, "rms_norm")
    )


def add_llama_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor] | None:
    """``s = x + residual`` (in x's dtype), then Llama's RMSNorm of ``s``, in one kernel:
    ``(normed, s)``; None when the kernels do not take the call (the caller adds and normalizes
    as the layer does)."""
    if not _add_takes(x, residual, weight, eps):
        return None
    if weight.dtype == x.dtype:
        return _route(x, residual, weight, eps, True, cast=True)
    xhat, total = _route(x, residual, None, eps, True, cast=True)
    return weight * xhat, total


def add_gemma_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor] | None:
    """``s = x + residual`` (in x's dtype), then Gemma's RMSNorm of ``s``, in one kernel:
    ``(normed, s)``, or None as :func:`add_llama_rms_norm`."""
    if not _add_takes(x, residual, weight, eps):
        return None
    return _route(x, residual, 1.0 + weight.float(), eps, True)


# ---------------------------------------------------------------------------------------------
# modules: transformers' attributes, state_dict keys and repr
# ---------------------------------------------------------------------------------------------
class _WeightedNorm(torch.nn.Module):
    """A vector ``weight`` (initialized to ``_init``) and an eps under transformers' name."""

    _init = 1.0
    _eps_name = "variance_epsilon"

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        weight = torch.full((hidden_size,), self._init, device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(weight)
        setattr(self, self._eps_name, eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={getattr(self, self._eps_name)}"


class GemmaRMSNorm(_WeightedNorm):
    r"""transformers' ``GemmaRMSNorm`` (and ``Gemma2RMSNorm``, ``Gemma3RMSNorm``,
    ``Qwen3NextRMSNorm``) on cupynorm's kernels:
    ``y = round(x_f32 * rsqrt(mean(x^2) + eps) * (1 + weight.float()))`` to x's dtype.

    Attributes as transformers': ``weight`` (init 0), ``eps``. :func:`replace_norms` converts
    transformers' layers of this formula into subclasses of this class (``include`` names it).

    Args:
        dim: H, the size of the last dimension
        eps: added to the mean square. Default: 1e-6
        device, dtype: of ``weight``.
    """

    _init = 0.0
    _eps_name = "eps"

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__(dim, eps, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


class T5LayerNorm(_WeightedNorm):
    r"""transformers' ``T5LayerNorm`` (an RMSNorm) on cupynorm's kernels: ``xhat`` in float32,
    rounded to the weight's dtype when the weight is float16 / bfloat16, then ``weight * xhat``
    (a float32 weight gives a float32 output whatever the input's dtype, as the layer).

    Args:
        hidden_size: H, the size of the last dimension
        eps: added to the mean square (``variance_epsilon``). Default: 1e-6
        device, dtype: of ``weight`` (init 1).
    """

    def forward(self, hidden_states: Tensor) -> Tensor:
        return t5_layer_norm(hidden_states, self.weight, self.variance_epsilon)


class Olmo2RMSNorm(_WeightedNorm):
    r"""transformers' ``Olmo2RMSNorm`` (and ``Olmo3RMSNorm``) on cupynorm's kernels:
    ``y = round(weight * x_f32 * rsqrt(mean(x^2) + eps))`` to x's dtype, one rounding.

    Args:
        hidden_size: H, the size of the last dimension
        eps: added to the mean square (``variance_epsilon``). Default: 1e-6
        device, dtype: of ``weight`` (init 1).
    """

    def forward(self, hidden_states: Tensor) -> Tensor:
        return olmo2_rms_norm(hidden_states, self.weight, self.variance_epsilon)


class CohereLayerNorm(_WeightedNorm):
    r"""transformers' ``CohereLayerNorm`` (and ``Cohere2LayerNorm``) on cupynorm's kernels: a
    LayerNorm without bias, ``y = round(weight * (x - mean) * rstd)`` in float32, one rounding.

    Args:
        hidden_size: H, the size of the last dimension
        eps: added to the variance (``variance_epsilon``). Default: 1e-5
        device, dtype: of ``weight`` (init 1).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__(hidden_size, eps, device, dtype)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return cohere_layer_norm(hidden_states, self.weight, self.variance_epsilon)


class OlmoLayerNorm(torch.nn.Module):
    r"""transformers' ``OlmoLayerNorm`` on cupynorm's kernels: a LayerNorm with neither weight
    nor bias, in float32 with eps 1e-5, rounded to x's dtype.

    Args:
        hidden_size: H, the size of the last dimension (``normalized_shape`` is ``(H,)``)
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return olmo_layer_norm(hidden_states)


# ---------------------------------------------------------------------------------------------
# the registry replace_norms and patch_transformers read
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Formula:
    """One norm formula of transformers' layers."""

    #: cupynorm's class: the ``include`` entry of replace_norms, a base of converted classes
    module: type[torch.nn.Module]
    #: the layer's attribute that holds eps (None: a constant of the formula)
    eps_name: str | None
    #: the layer's forward, op for op: (x, weight or None, eps) -> y
    torch_fn: Callable[..., Tensor]
    #: (x, residual, weight, eps) -> (norm of the sum, the sum) on the kernels, or None
    add: Callable[..., tuple[Tensor, Tensor] | None] | None = None
    #: eps when ``eps_name`` is None
    eps: float | None = None

    def eps_of(self, layer: torch.nn.Module) -> float | None:
        return self.eps if self.eps_name is None else getattr(layer, self.eps_name, None)


FORMULAS: tuple[Formula, ...] = (
    Formula(LlamaRMSNorm, "variance_epsilon", _llama_rms_norm_torch, add_llama_rms_norm),
    Formula(GemmaRMSNorm, "eps", _gemma_torch, add_gemma_rms_norm),
    Formula(T5LayerNorm, "variance_epsilon", _t5_torch),
    Formula(Olmo2RMSNorm, "variance_epsilon", _olmo2_torch),
    Formula(CohereLayerNorm, "variance_epsilon", _cohere_torch),
    Formula(OlmoLayerNorm, None, _olmo_torch, eps=_OLMO_EPS),
)
FORMULA_OF: dict[type, Formula] = {f.module: f for f in FORMULAS}
#: Every cupynorm class of a transformers formula: ``replace_norms(model, include=HF_NORMS)``.
HF_NORMS: tuple[type[torch.nn.Module], ...] = tuple(f.module for f in FORMULAS)
