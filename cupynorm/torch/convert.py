"""Swap the torch.nn normalization modules of a model for cupynorm's, in place.

Each cupynorm module subclasses its torch.nn counterpart, adds no state and overrides only
``forward``, so a module is converted by reassigning its class (``module.__class__ = ...``, as
:mod:`torch.nn.utils.parametrize` does). The module object stays the same: its parameters and
buffers are the same tensor objects (optimizers and EMA copies still hold them), device, dtype,
training mode and hooks are kept, a module shared by several parents is converted once, and the
root module itself can be converted.

Subclasses of those torch.nn classes (timm's ``GroupNorm``, a library's ``BatchNorm2d`` with an
extra attribute) are converted when their ``forward`` computes what the torch.nn class's does:
either they inherit it, or a probe says so -- on copies of the module, on random input of a small
shape, the subclass's ``forward`` and the torch.nn class's give the same output (and the same
running statistics). Such a module gets a class of its own, made once per subclass, whose bases
are cupynorm's module and the subclass (so ``isinstance`` with the subclass and its methods and
attributes still hold).

A norm-plus-activation subclass -- timm's ``BatchNormAct2d``, ``GroupNormAct``, ``GroupNorm1Act``:
the norm, then its ``drop`` and ``act`` submodules -- is converted the same way when the probe
says its ``forward`` is the torch.nn class's followed by those submodules; its class then runs
cupynorm's norm and the module's own ``drop`` and ``act`` after it. A subclass whose ``forward``
computes anything else is left alone and named in a warning: never silently changed.

Hugging Face's RMSNorm layers (``LlamaRMSNorm`` and its copies ``Qwen2RMSNorm``,
``MistralRMSNorm``, ...) are plain ``torch.nn.Module`` classes, not torch.nn norms: converted
when ``include`` names :class:`cupynorm.torch.LlamaRMSNorm` (opt-in, like the other row norms).
A candidate is a module whose class name contains ``RMSNorm`` and whose only parameter is a
vector ``weight``; it is converted when it has a float ``variance_epsilon`` and a probe says its
``forward`` computes Llama's formula (normalize in float32, round to the input's dtype, then
multiply by the weight) on copies with a random weight, on input of the weight's dtype and of
another one (so a layer that casts to the weight's dtype, T5's, is told apart). It then gets an
adopted class whose bases are cupynorm's ``LlamaRMSNorm`` and its own class (its
``extra_repr`` kept). Other candidates (Gemma's ``(1 + weight)`` multiplied in float32, ...) are
left alone and named in the warning.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable

import torch

from . import modules, sync_batchnorm

__all__ = ["replace_norms"]

_REPLACEMENTS: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
    torch.nn.InstanceNorm1d: modules.InstanceNorm1d,
    torch.nn.InstanceNorm2d: modules.InstanceNorm2d,
    torch.nn.InstanceNorm3d: modules.InstanceNorm3d,
    torch.nn.GroupNorm: modules.GroupNorm,
    torch.nn.BatchNorm1d: modules.BatchNorm1d,
    torch.nn.BatchNorm2d: modules.BatchNorm2d,
    torch.nn.BatchNorm3d: modules.BatchNorm3d,
    torch.nn.SyncBatchNorm: sync_batchnorm.SyncBatchNorm,
}
# norms over the trailing dims of each row (their probes are shaped by normalized_shape)
_ROW_NORMS: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
    torch.nn.LayerNorm: modules.LayerNorm,
    torch.nn.RMSNorm: modules.RMSNorm,
}
_REPLACEMENTS.update(_ROW_NORMS)
#: Converted only when ``include`` names them: a row norm's training step (forward + backward) is
#: still slower on cupynorm's kernels than on torch's (LayerNorm bf16 8192x4096 on an H200: 0.21
#: ms and more against torch's 0.18; benchmarks/RESULTS.md), and the forward alone ~1.07x faster.
_OPT_IN = frozenset(_ROW_NORMS)


_OURS = tuple(set(_REPLACEMENTS.values()))
# norms over the channels (dim 1) of (N, C, *): timm's and torchvision's LayerNorm2d (subclasses
# of torch.nn.LayerNorm that permute), timm's RmsNorm2d (a plain Module with RMSNorm's
# attributes). Recognised by a probe of what their forward computes, converted when ``include``
# names torch.nn.LayerNorm / torch.nn.RMSNorm (opt-in, as the row norms).
_CHANNEL_NORMS: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
    torch.nn.LayerNorm: modules.LayerNorm2d,
    torch.nn.RMSNorm: modules.RMSNorm2d,
}
_OURS = (*_OURS, *_CHANNEL_NORMS.values())
# (N, C) -> probe input shape per torch.nn class: small, several values per statistic
_PROBE_SPATIAL = {
    torch.nn.InstanceNorm1d: (5,),
    torch.nn.InstanceNorm2d: (3, 4),
    torch.nn.InstanceNorm3d: (2, 3, 2),
    torch.nn.GroupNorm: (3, 4),
    torch.nn.BatchNorm1d: (5,),
    torch.nn.BatchNorm2d: (3, 4),
    torch.nn.BatchNorm3d: (2, 3, 2),
    torch.nn.SyncBatchNorm: (3, 4),
}
#: Classes whose subclasses are converted only when they inherit ``forward``: a probe of a
#: SyncBatchNorm's forward may run a collective on one rank alone (a hang).
_UNPROBED = (torch.nn.SyncBatchNorm,)
#: Submodules a norm-plus-activation subclass applies to the norm's output, in order: none (a
#: plain norm), or timm's norm-act layers (``x = norm(x); x = self.drop(x); x = self.act(x)``).
_TAILS: tuple[tuple[str, ...], ...] = ((), ("drop", "act"))
_ADOPTED: dict[tuple[type, tuple[str, ...]], type] = {}


def _torch_base(cls: type) -> type | None:
    """The torch.nn norm class ``cls`` is or derives from (None: not a norm, or cupynorm's)."""
    if issubclass(cls, _OURS):
        return None
    return next((base for base in cls.__mro__ if base in _REPLACEMENTS), None)


def _tail(module: torch.nn.Module, base: type) -> tuple[str, ...] | None:
    """The submodules (an entry of _TAILS) that ``module.forward`` applies after computing what
    ``base.forward`` computes, or None when it computes something else."""
    for tail in _TAILS:
        if all(isinstance(getattr(module, name, None), torch.nn.Module) for name in tail):
            if _computes_like(module, base, tail):
                return tail
    return None


def _computes_like(module: torch.nn.Module, base: type, tail: tuple[str, ...] = ()) -> bool:
    """Whether ``module.forward`` gives what ``base.forward`` followed by the ``tail``
    submodules gives, on copies of the module and random input (running statistics compared
    too)."""
    if not tail and type(module).forward is base.forward:
        return True
    if base in _UNPROBED:
        return False
    param = next(module.parameters(), None)
    if param is None:
        param = next(module.buffers(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    if device.type == "meta":
        return False
    generator = torch.Generator(device=device).manual_seed(0)
    if base in _ROW_NORMS:
        shape = (2, 3, *module.normalized_shape)
    else:
        channels = module.num_channels if base is torch.nn.GroupNorm else module.num_features
        shape = (2, channels, *_PROBE_SPATIAL[base])
    probe = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    theirs, ours = copy.deepcopy(module), copy.deepcopy(module)
    try:
        with torch.no_grad():
            expected = base.forward(theirs, probe)
            for name in tail:
                expected = getattr(theirs, name)(expected)
            got = type(module).forward(ours, probe)
    except Exception:  # noqa: BLE001 - a forward that fails on the probe is not a plain norm
        return False
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return False
    if not torch.equal(got, expected):
        return False
    return all(torch.equal(a, b) for a, b in zip(ours.buffers(), theirs.buffers(), strict=True))


def _adopted(cls: type, base: type, tail: tuple[str, ...]) -> type:
    """A class of cupynorm's forward (then the ``tail`` submodules) over the subclass ``cls``
    (made once per subclass and tail)."""
    key = (cls, tail)
    if key not in _ADOPTED:
        ours = _REPLACEMENTS[base]
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        if tail:

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                out = ours.forward(self, input)
                for name in tail:
                    out = getattr(self, name)(out)
                return out

            namespace["forward"] = forward
        _ADOPTED[key] = type(cls.__name__, (ours, cls), namespace)
    return _ADOPTED[key]


def _channel_norm_of(module: torch.nn.Module, kinds: set[type]) -> type | None:
    """LayerNorm2d / RMSNorm2d when ``module`` (not a torch.nn norm class itself) holds a
    normalized_shape of one int, an eps, a weight (and bias) and nothing else, and its forward
    computes layer_norm / rms_norm over dim 1 of (N, C, H, W) input: checked on a float64 copy
    and random input against the permute + torch norm of timm's / torchvision's LayerNorm2d."""
    if type(module) in _REPLACEMENTS or isinstance(module, _OURS):
        return None
    shape, eps = getattr(module, "normalized_shape", None), getattr(module, "eps", None)
    if not (isinstance(shape, tuple) and len(shape) == 1 and isinstance(shape[0], int)):
        return None
    if not (eps is None or isinstance(eps, float)):
        return None
    if next(module.children(), None) is not None or next(module.buffers(), None) is not None:
        return None
    names = {name for name, _ in module.named_parameters()}
    if not names <= {"weight", "bias"} or not hasattr(module, "weight"):
        return None
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "meta":
        return None
    generator = torch.Generator(device=device).manual_seed(0)
    probe = torch.randn((2, shape[0], 3, 4), generator=generator, device=device)
    probe = probe.double()
    copied = copy.deepcopy(module).double()
    weight, bias = getattr(copied, "weight", None), getattr(copied, "bias", None)
    rows = probe.permute(0, 2, 3, 1)
    candidates = []
    if torch.nn.LayerNorm in kinds and eps is not None:
        layer = torch.nn.functional.layer_norm(rows, shape, weight, bias, eps)
        candidates.append((torch.nn.LayerNorm, layer))
    if torch.nn.RMSNorm in kinds and bias is None:
        candidates.append(
            (torch.nn.RMSNorm, torch.nn.functional.rms_norm(rows, shape, weight, eps))
        )
    if not candidates:
        return None
    try:
        with torch.no_grad():
            got = type(module).forward(copied, probe)
    except Exception:  # noqa: BLE001 - a forward that fails on the probe is not a channel norm
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape:
        return None
    for base, expected in candidates:
        if torch.allclose(got, expected.permute(0, 3, 1, 2), rtol=1e-10, atol=1e-10):
            return _CHANNEL_NORMS[base]
    return None


def _adopted_channel_norm(cls: type, ours: type) -> type:
    """A class of cupynorm's channel norm ``ours`` over ``cls`` (made once per class)."""
    key = (cls, ("channels",))
    if key not in _ADOPTED:
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        _ADOPTED[key] = type(cls.__name__, (ours, cls), namespace)
    return _ADOPTED[key]


# ---- Hugging Face RMSNorm layers of Llama's formula ---------------------------------------------
#: The ``include``/``exclude`` entry that stands for them (converted to adopted subclasses of it).
_LLAMA_RMS = modules.LlamaRMSNorm
_ADOPTED_LLAMA: dict[type, type] = {}


def _llama_candidate(module: torch.nn.Module) -> bool:
    """A layer that looks like a Hugging Face RMSNorm: ``RMSNorm`` in its class name, not a
    torch.nn norm nor cupynorm's, and one parameter, a vector ``weight``."""
    cls = type(module)
    if "rmsnorm" not in cls.__name__.lower() or issubclass(cls, _LLAMA_RMS):
        return False
    if _torch_base(cls) is not None or issubclass(cls, _OURS):
        return False
    params = list(module.named_parameters())
    return len(params) == 1 and params[0][0] == "weight" and params[0][1].dim() == 1


def _computes_like_llama(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` gives Llama's formula (_llama_rms_norm._llama_rms_norm_torch)
    with its ``weight`` and ``variance_epsilon``, on copies with a random weight and random
    input of the weight's dtype and of one other floating dtype."""
    from ._llama_rms_norm import _llama_rms_norm_torch

    eps = getattr(module, "variance_epsilon", None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return False
    weight = module.weight
    if weight.device.type == "meta" or not weight.is_floating_point():
        return False
    device, H = weight.device, weight.shape[0]
    generator = torch.Generator(device=device).manual_seed(0)
    other = torch.bfloat16 if weight.dtype == torch.float32 else torch.float32
    probe_module = copy.deepcopy(module)
    with torch.no_grad():
        probe_module.weight.copy_(
            torch.randn(H, generator=generator, device=device, dtype=weight.dtype)
        )
    for dtype in (weight.dtype, other):
        probe = 4 * torch.randn((2, 3, H), generator=generator, device=device, dtype=dtype) + 1
        try:
            with torch.no_grad():
                expected = _llama_rms_norm_torch(probe, probe_module.weight, eps)
                got = type(module).forward(probe_module, probe)
        except Exception:  # noqa: BLE001 - a forward that fails on the probe is not this norm
            return False
        if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype:
            return False
        if got.shape != expected.shape or not torch.equal(got, expected):
            return False
    return True


def _adopted_llama(cls: type) -> type:
    """cupynorm's LlamaRMSNorm forward over the Hugging Face class ``cls`` (made once)."""
    if cls not in _ADOPTED_LLAMA:
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "extra_repr": cls.extra_repr,
        }
        _ADOPTED_LLAMA[cls] = type(cls.__name__, (_LLAMA_RMS, cls), namespace)
    return _ADOPTED_LLAMA[cls]


def _classes(arg: str, classes: Iterable[type] | None) -> set[type]:
    if classes is None:
        return set()
    if isinstance(classes, type):
        classes = (classes,)
    chosen = set()
    for cls in classes:
        if cls is _LLAMA_RMS:
            chosen.add(cls)
            continue
        if cls not in _REPLACEMENTS:
            names = ", ".join(f"torch.nn.{c.__name__}" for c in _REPLACEMENTS)
            names += ", cupynorm.torch.LlamaRMSNorm"
            raise ValueError(f"replace_norms: {arg} takes classes among {names}; got {cls!r}")
        chosen.add(cls)
    return chosen


def replace_norms(
    model: torch.nn.Module,
    *,
    include: Iterable[type[torch.nn.Module]] | None = None,
    exclude: Iterable[type[torch.nn.Module]] | None = None,
) -> torch.nn.Module:
    """Convert every torch.nn normalization submodule of ``model`` to cupynorm's, in place.

    Modules of the types ``torch.nn.InstanceNorm1d/2d/3d``, ``GroupNorm``,
    ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, ``LayerNorm`` and ``RMSNorm`` become
    :class:`cupynorm.torch.InstanceNorm2d` etc. Subclasses of them are converted when their
    ``forward`` computes the same, or the same followed by their ``drop`` and ``act`` submodules
    (timm's norm-act layers; see the module docstring), and left alone with a warning otherwise
    (a subclass of ``SyncBatchNorm`` only when it inherits ``forward``: it is not probed, a probe
    could run a collective).
    Norms over the channels of (N, C, *) -- timm's and torchvision's ``LayerNorm2d``, timm's
    ``RmsNorm2d`` -- are recognised by a probe of their forward and become
    :class:`cupynorm.torch.LayerNorm2d` / :class:`~cupynorm.torch.RMSNorm2d` when ``include``
    names ``LayerNorm`` / ``RMSNorm``.
    The converted modules keep their parameters and buffers (the same tensor objects), device,
    dtype, training mode and hooks. On the CPU they compute exactly as before; on CUDA they run
    cupynorm's kernels. A converted subclass has a class made at conversion time: save the
    model's ``state_dict`` (as torch recommends), not the pickled module.

    Args:
        model: the model; ``model`` itself is converted too if it is a normalization module.
        include: torch.nn classes to convert, with their subclasses (default: all ten but
            ``LayerNorm`` and ``RMSNorm``, whose training step is not faster yet: name them);
            :class:`cupynorm.torch.LlamaRMSNorm` converts Hugging Face's RMSNorm layers of
            Llama's formula (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``, ...; see
            the module docstring), also opt-in.
        exclude: torch.nn classes to leave alone (applied after ``include``).

    Returns:
        ``model``, converted in place.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``include``/``exclude`` name a class other than the eleven above.

    Example::

        >>> model = torchvision.models.resnet18().cuda()
        >>> cupynorm.torch.replace_norms(model, exclude=[torch.nn.BatchNorm1d])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"replace_norms: expected a torch.nn.Module, got {type(model).__name__}")
    kinds = _classes("include", include) if include is not None else set(_REPLACEMENTS) - _OPT_IN
    kinds -= _classes("exclude", exclude)
    left_alone: dict[str, int] = {}
    llama = _LLAMA_RMS in kinds
    for module in model.modules():  # each module once, even when shared
        cls = type(module)
        # an RMSNorm layer of another library: Llama's formula, else maybe a channel norm
        # (timm's RmsNorm2d), else left alone
        other_rms = llama and _llama_candidate(module)
        if other_rms and _computes_like_llama(module):
            module.__class__ = _adopted_llama(cls)
            continue
        base = _torch_base(cls)
        if base is None or base not in kinds:
            if kinds & set(_CHANNEL_NORMS) and (channel := _channel_norm_of(module, kinds)):
                module.__class__ = _adopted_channel_norm(cls, channel)
            elif other_rms:
                name = f"{cls.__module__}.{cls.__qualname__}"
                left_alone[name] = left_alone.get(name, 0) + 1
            continue
        if cls is base:
            module.__class__ = _REPLACEMENTS[cls]
        elif (tail := _tail(module, base)) is not None:
            module.__class__ = _adopted(cls, base, tail)
        elif (channel := _channel_norm_of(module, kinds)) is not None:
            module.__class__ = _adopted_channel_norm(cls, channel)
        else:
            name = f"{cls.__module__}.{cls.__qualname__}"
            left_alone[name] = left_alone.get(name, 0) + 1
    if left_alone:
        names = ", ".join(f"{name} (x{count})" for name, count in left_alone.items())
        warnings.warn(
            "replace_norms: left alone the modules whose forward does not compute what their "
            "torch.nn norm class computes (alone, or followed by their drop and act "
            "submodules), or, for RMSNorm layers of other libraries, Llama's RMSNorm: "
            f"{names}",
            UserWarning,
            stacklevel=2,
        )
    return model
