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

Hugging Face transformers' norm layers are plain ``torch.nn.Module`` classes, not torch.nn norms:
converted when ``include`` names the cupynorm class of their formula (opt-in, like the other row
norms; :data:`cupynorm.torch.HF_NORMS` names them all): :class:`cupynorm.torch.LlamaRMSNorm`
(``LlamaRMSNorm`` and its copies ``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ``MistralRMSNorm``,
``MixtralRMSNorm``, ``Phi3RMSNorm``, ``DeepseekV3RMSNorm``, ...), ``GemmaRMSNorm`` (Gemma 1-3),
``T5LayerNorm``, ``Olmo2RMSNorm``, ``CohereLayerNorm`` and ``OlmoLayerNorm`` (the formulas:
:mod:`._hf_norms`). A candidate is a module whose class name contains ``RMSNorm`` or
``LayerNorm`` and whose only parameter is ``weight`` (or which has none and a
``normalized_shape`` of one int); it is converted when a probe says its ``forward`` computes one
of those formulas with its eps attribute (``variance_epsilon``, Gemma's ``eps``): on a copy with
a random weight, on input of the weight's dtype and of another one (so the formulas that differ
only in where they round, Llama's, T5's and OLMo 2's, are told apart), the outputs equal the
formula's torch ops bit for bit. It then gets an adopted class whose bases are the cupynorm
class and its own class (its ``extra_repr`` kept). Other candidates (a weight that is not a
vector, another formula, a meta device) are left alone and named in the warning, with the
reason; so are those of a formula ``include`` does not name.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Iterable

import torch

from . import _hf_norms, modules, sync_batchnorm

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
#: Converted only when ``include`` names them: a row norm's forward + backward on cupynorm's
#: kernels still costs more host time than torch's op (H200, 11-27: LayerNorm bf16 8192x4096
#: 0.438 ms against torch's 0.183 where the host paces the calls; its kernels' GPU time, 156 µs,
#: is below torch's 172), and the forward alone is ~1.07x faster (benchmarks/NOTES.md).
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


# ---- Hugging Face norm layers (transformers' formulas: _hf_norms.FORMULAS) ---------------------
#: The ``include``/``exclude`` entries that stand for them (converted to adopted subclasses).
_HF_NORMS = frozenset(_hf_norms.HF_NORMS)
_ADOPTED_HF: dict[tuple[type, type], type] = {}


def _hf_candidate(module: torch.nn.Module) -> bool:
    """A layer that looks like a Hugging Face norm: ``RMSNorm`` or ``LayerNorm`` in its class
    name, not a torch.nn norm nor cupynorm's, and either one parameter, ``weight``, or none and
    a ``normalized_shape`` of one int (OLMo's LayerNorm)."""
    cls = type(module)
    name = cls.__name__.lower()
    if "rmsnorm" not in name and "layernorm" not in name:
        return False
    if issubclass(cls, tuple(_HF_NORMS)) or _torch_base(cls) is not None or issubclass(cls, _OURS):
        return False
    params = list(module.named_parameters())
    if not params:
        shape = getattr(module, "normalized_shape", None)
        return isinstance(shape, tuple) and len(shape) == 1 and type(shape[0]) is int
    return len(params) == 1 and params[0][0] == "weight"


def _hf_formula(module: torch.nn.Module) -> tuple[_hf_norms.Formula | None, str]:
    """(the formula of _hf_norms.FORMULAS that ``module.forward`` computes, with its weight and
    eps, or None; why not). Probed on a copy with a random weight, on random input of the
    weight's dtype and of one other floating dtype (float32 and bfloat16 without a weight): the
    outputs must be equal, bit for bit and dtype, to the formula's torch ops."""
    weight = getattr(module, "weight", None)
    if weight is not None:
        if weight.dim() != 1:
            return None, "its weight is not a vector"
        if weight.device.type == "meta":
            return None, "on the meta device, not probed"
        if not weight.is_floating_point():
            return None, "its weight is not floating point"
        device, H = weight.device, weight.shape[0]
        other = torch.bfloat16 if weight.dtype == torch.float32 else torch.float32
        dtypes = (weight.dtype, other)
    else:
        device, H = torch.device("cpu"), module.normalized_shape[0]
        dtypes = (torch.float32, torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    probe_module = copy.deepcopy(module)
    if weight is not None:
        with torch.no_grad():
            random = torch.randn(H, generator=generator, device=device, dtype=weight.dtype)
            probe_module.weight.copy_(random)
    probes = []
    for dtype in dtypes:
        probe = 4 * torch.randn((2, 3, H), generator=generator, device=device, dtype=dtype) + 1
        try:
            with torch.no_grad():
                got = type(module).forward(probe_module, probe)
        except Exception:  # noqa: BLE001 - a forward that fails on the probe is not a norm
            return None, "its forward fails on a probe input"
        if not isinstance(got, torch.Tensor):
            return None, "its forward does not return a tensor"
        probes.append((probe, got))
    for formula in _hf_norms.FORMULAS:
        eps = formula.eps_of(module)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            continue
        if (formula.module is _hf_norms.OlmoLayerNorm) != (weight is None):
            continue
        w = None if weight is None else probe_module.weight
        if all(_same(formula.torch_fn(probe, w, eps), got) for probe, got in probes):
            return formula, ""
    return None, "its forward computes none of the formulas of cupynorm.torch.HF_NORMS"


def _same(expected: torch.Tensor, got: torch.Tensor) -> bool:
    return (
        got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    )


def _adopted_hf(cls: type, ours: type) -> type:
    """cupynorm's ``ours`` forward over the Hugging Face class ``cls`` (made once per class)."""
    key = (cls, ours)
    if key not in _ADOPTED_HF:
        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "extra_repr": cls.extra_repr,
        }
        _ADOPTED_HF[key] = type(cls.__name__, (ours, cls), namespace)
    return _ADOPTED_HF[key]


# cupynorm's norms that keep a channels_last input's memory format where torch's return a
# contiguous (NCHW) tensor on CUDA: what follows them sees another layout than under torch.
_LAYOUT_KEEPING = (modules.GroupNorm, modules.InstanceNorm2d, modules.InstanceNorm3d)


@functools.cache
def torch_avg_pool_backward_is_wrong() -> bool:
    """Whether this torch's CUDA ``avg_pool2d`` backward is wrong for a channels_last input with
    padding (pytorch/pytorch#188344; torch 2.11 has it): its gradient on a small channels_last
    tensor against the same on a contiguous one. False without CUDA (the bug is in a CUDA
    kernel); computed once per process."""
    if not torch.cuda.is_available():
        return False
    x = torch.arange(2 * 5 * 5, dtype=torch.float32, device="cuda").reshape(1, 2, 5, 5)
    grad = torch.arange(2 * 5 * 5, dtype=torch.float32, device="cuda").reshape(1, 2, 5, 5)
    args = ([3, 3], [1, 1], [1, 1], False, False, None)  # kernel, stride, padding, ...
    contiguous = torch.ops.aten.avg_pool2d_backward(grad, x, *args)
    channels_last = torch.ops.aten.avg_pool2d_backward(
        grad.contiguous(memory_format=torch.channels_last),
        x.contiguous(memory_format=torch.channels_last),
        *args,
    )
    return not torch.allclose(contiguous, channels_last.contiguous())


def _warn_of_torch_pool_bug(model: torch.nn.Module) -> None:
    """Warn when a converted norm keeping channels_last may feed torch's padded AvgPool2d whose
    CUDA backward is then wrong (timm's PoolFormer: GroupNorm -> AvgPool2d(3, 1, 1)): under
    torch that pool saw the GroupNorm's NCHW output, where the bug does not show."""
    pools = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.AvgPool2d) and m.padding not in (0, (0, 0))
    ]
    norms = sum(isinstance(m, _LAYOUT_KEEPING) for m in model.modules())
    if not pools or not norms or not torch_avg_pool_backward_is_wrong():
        return
    warnings.warn(
        f"replace_norms: this torch ({torch.__version__}) computes AvgPool2d's backward wrong on "
        "CUDA for channels_last inputs with padding (pytorch/pytorch#188344), and this model has "
        f"{len(pools)} such pooling layer(s) and {norms} converted GroupNorm/InstanceNorm "
        "layer(s), which keep a channels_last input's memory format where torch's return "
        "contiguous tensors: a pool fed by one gets wrong gradients in a channels_last model. "
        "Use a torch with the fix, leave these norms to torch "
        "(replace_norms(model, exclude=[torch.nn.GroupNorm, torch.nn.InstanceNorm2d])), or "
        "make the pool's input contiguous.",
        UserWarning,
        stacklevel=3,
    )


def _classes(arg: str, classes: Iterable[type] | None) -> set[type]:
    if classes is None:
        return set()
    if isinstance(classes, type):
        classes = (classes,)
    chosen = set()
    for cls in classes:
        if cls in _HF_NORMS:
            chosen.add(cls)
            continue
        if cls not in _REPLACEMENTS:
            names = ", ".join(f"torch.nn.{c.__name__}" for c in _REPLACEMENTS)
            names += ", " + ", ".join(f"cupynorm.torch.{c.__name__}" for c in _hf_norms.HF_NORMS)
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
            the classes of :data:`cupynorm.torch.HF_NORMS` (:class:`~cupynorm.torch.LlamaRMSNorm`,
            :class:`~cupynorm.torch.GemmaRMSNorm`, ...) convert transformers' norm layers of
            their formula (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``GemmaRMSNorm``,
            ``T5LayerNorm``, ...; see the module docstring), also opt-in:
            ``include=[*cupynorm.torch.HF_NORMS, torch.nn.LayerNorm]`` converts every norm of
            transformers' main model families.
        exclude: classes to leave alone (applied after ``include``).

    Returns:
        ``model``, converted in place.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: ``include``/``exclude`` name a class other than those above.

    Example::

        >>> model = torchvision.models.resnet18().cuda()
        >>> cupynorm.torch.replace_norms(model, exclude=[torch.nn.BatchNorm1d])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"replace_norms: expected a torch.nn.Module, got {type(model).__name__}")
    kinds = _classes("include", include) if include is not None else set(_REPLACEMENTS) - _OPT_IN
    excluded = _classes("exclude", exclude)
    kinds -= excluded
    left_alone: dict[str, list] = {}  # name -> [count, why]

    def leave_alone(cls: type, why: str = "") -> None:
        name = f"{cls.__module__}.{cls.__qualname__}"
        entry = left_alone.setdefault(name, [0, why])
        entry[0] += 1

    hf_kinds = kinds & _HF_NORMS
    for module in model.modules():  # each module once, even when shared
        cls = type(module)
        # a norm layer of transformers (or another library): one of its formulas, else maybe a
        # channel norm (timm's RmsNorm2d), else left alone
        hf = bool(hf_kinds) and _hf_candidate(module)
        why = ""
        if hf:
            formula, why = _hf_formula(module)
            if formula is not None and formula.module in hf_kinds:
                module.__class__ = _adopted_hf(cls, formula.module)
                continue
            if formula is not None:
                if formula.module in excluded:
                    continue
                why = f"the formula of cupynorm.torch.{formula.module.__name__}, not in include"
        base = _torch_base(cls)
        if base is None or base not in kinds:
            if kinds & set(_CHANNEL_NORMS) and (channel := _channel_norm_of(module, kinds)):
                module.__class__ = _adopted_channel_norm(cls, channel)
            elif hf:
                leave_alone(cls, why)
            continue
        if cls is base:
            module.__class__ = _REPLACEMENTS[cls]
        elif (tail := _tail(module, base)) is not None:
            module.__class__ = _adopted(cls, base, tail)
        elif (channel := _channel_norm_of(module, kinds)) is not None:
            module.__class__ = _adopted_channel_norm(cls, channel)
        else:
            leave_alone(cls)
    if left_alone:
        names = ", ".join(
            f"{name} (x{count}{', ' + why if why else ''})"
            for name, (count, why) in left_alone.items()
        )
        warnings.warn(
            "replace_norms: left alone the modules whose forward does not compute what their "
            "torch.nn norm class computes (alone, or followed by their drop and act "
            "submodules), or, for norm layers of transformers and other libraries, the formula "
            f"of a class of cupynorm.torch.HF_NORMS in include: {names}",
            UserWarning,
            stacklevel=2,
        )
    _warn_of_torch_pool_bug(model)
    return model
