"""``fuse(model)``: cupynorm's norms in place of torch's, with the activation and the residual add
that follow a BatchNorm2d folded into it (:class:`~cupynorm.torch.BatchNormAct2d`).

The model is traced with :mod:`torch.fx` (norm layers kept as leaves), and in its graph

    bn(x) -> relu | silu                         becomes  BatchNormAct2d(act)(x)
    bn(x) + r  (or r + bn(x)) -> relu | silu     becomes  BatchNormAct2d(act)(x, r)
    bn(x) + r                                     becomes  BatchNormAct2d("identity")(x, r)

and, for a GroupNorm (torch's or cupynorm's),

    gn(x) -> relu | silu                         becomes  GroupNormAct(act)(x)
    gn(x + t[:, :, None, None]) [-> relu | silu]  becomes  GroupNormAct(act or identity)(x, t)

(the second is diffusers' ResnetBlock2D adding its time embedding before norm2: the add runs in
the norm's kernels, see :func:`~cupynorm.torch.group_norm_act`'s ``shift``),

where the activation is a ``ReLU``/``SiLU`` module, ``F.relu``/``F.silu``/``torch.relu`` or the
``relu``/``relu_`` method, and the BatchNorm's output (and the sum; the GroupNorm's output, and
its shifted input) has no other user. The norm module object itself becomes the fused module
(its class is reassigned, as :func:`replace_norms` does): parameters, buffers and
``state_dict`` keys stay. Every other norm is
converted by :func:`replace_norms`; a norm-plus-activation subclass it converts with its ``drop``
and ``act`` tail (timm's ``BatchNormAct2d``, ``GroupNormAct``, ``GroupNorm1Act``) runs the fused
kernel (:func:`~cupynorm.torch.batch_norm_act`, :func:`~cupynorm.torch.group_norm_act`) when
``drop`` is an ``Identity`` and ``act`` a ``ReLU``/``SiLU`` module (checked per call).

A model whose ``forward`` does not trace (data-dependent control flow, ...) is fused submodule by
submodule: each child that traces is fused, the others are searched further down, and norms in
parts that never trace are still converted (unfused). A ``forward``'s ``*args`` and ``**kwargs``
are traced empty (diffusers' ``ResnetBlock2D.forward(input_tensor, temb, *args, **kwargs)``):
the fused module takes no extra arguments. The trace sees each argument as a tensor, so an
``if temb is not None`` takes its tensor branch: a ``forward`` whose graph changes when one of
its arguments is None (traced once more with that argument None) is not traced whole but
searched further down (diffusers' VAE calls the same ResnetBlock2D with ``temb=None``, adding
nothing; its UNet's ``UpBlock2D`` resizes to ``upsample_size`` only when that is given).
Limits: the fused parts become ``torch.fx.GraphModule`` objects (same submodules and
``state_dict``, but a generated ``forward`` and none of the original class's other methods; a
submodule with nothing to fuse is kept as it was); an add whose operands turn out to differ in
shape or dtype at run time (broadcasting) runs unfused in torch.
"""

from __future__ import annotations

import inspect
import operator
from collections import Counter

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree

from . import convert, modules
from .convert import replace_norms
from .functional import group_norm_act

__all__ = ["fuse"]

_ACT_MODULES = {torch.nn.ReLU: "relu", torch.nn.SiLU: "silu"}
_ACT_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", F.silu: "silu", torch.relu_: "relu"}
_ACT_METHODS = {"relu": "relu", "relu_": "relu"}
_ADDS = (operator.add, operator.iadd, torch.add)
_NORMS = (
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.GroupNorm,
    torch.nn.LayerNorm,  # cupynorm's row and channel norms too: their checks cannot take proxies
    torch.nn.RMSNorm,
)


class _NormLeafTracer(fx.Tracer):
    """torch.fx's tracer, with every norm module (torch's, cupynorm's, libraries') a leaf."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, _NORMS) or super().is_leaf_module(m, qualname)


def _activation(node: fx.Node, source: fx.Node, mods: dict) -> str | None:
    """The activation ``node`` applies to ``source`` alone, or None."""
    if node.op == "call_module":
        kind = _ACT_MODULES.get(type(mods[node.target]))
        return kind if kind and node.args == (source,) else None
    if node.op == "call_function" and node.target in _ACT_FUNCTIONS:
        simple = node.args == (source,) and set(node.kwargs) <= {"inplace"}
        return _ACT_FUNCTIONS[node.target] if simple else None
    if node.op == "call_method" and node.target in _ACT_METHODS:
        return _ACT_METHODS[node.target] if node.args == (source,) and not node.kwargs else None
    return None


def _residual(node: fx.Node, source: fx.Node) -> fx.Node | None:
    """The other operand when ``node`` is ``source + other`` (either order), else None."""
    plain_add = (node.op == "call_function" and node.target in _ADDS) or (
        node.op == "call_method" and node.target in ("add", "add_") and node.args[0] is source
    )
    if not plain_add or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    other = b if a is source else a if b is source else None
    return other if isinstance(other, fx.Node) and other is not source else None


_ALL = slice(None)


def _time_embedding(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(x, t, the indexing node) when ``node`` is ``x + t[:, :, None, None]`` (either order, not
    in place), else None."""
    plain_add = (node.op == "call_function" and node.target in (operator.add, torch.add)) or (
        node.op == "call_method" and node.target == "add"
    )
    if not plain_add or len(node.args) != 2 or node.kwargs:
        return None
    for x, t in (node.args, node.args[::-1]):
        if (
            isinstance(x, fx.Node)
            and isinstance(t, fx.Node)
            and t.op == "call_function"
            and t.target is operator.getitem
            and isinstance(t.args[0], fx.Node)
            and t.args[1] == (_ALL, _ALL, None, None)
        ):
            return x, t.args[0], t
    return None


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _fuse_graph(gm: fx.GraphModule, prefix: str, report: list[str] | None) -> int:
    """Rewrite the patterns of the module docstring in ``gm``'s graph; returns how many."""
    mods = dict(gm.named_modules())
    calls = Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or type(mods[node.target]) not in (
            torch.nn.BatchNorm2d,
            modules.BatchNorm2d,
        ):
            continue
        if calls[node.target] != 1:  # a module called twice: fusing one call would change both
            continue
        user = _only_user(node)
        if user is None:
            continue
        residual, act, last = None, _activation(user, node, mods), user
        if act is None:
            residual = _residual(user, node)
            if residual is None:
                continue
            after = _only_user(user)
            act = _activation(after, user, mods) if after is not None else None
            if act is None:
                act = "identity"
            else:
                last = after
        bn = mods[node.target]
        bn.__class__ = modules.BatchNormAct2d
        bn.activation = act
        args = (node.args[0],) if residual is None else (node.args[0], residual)
        with gm.graph.inserting_after(last):
            new = gm.graph.call_module(node.target, args)
        last.replace_all_uses_with(new)
        for dead in (last, user, node):
            if dead in gm.graph.nodes and not dead.users:
                gm.graph.erase_node(dead)
        fused += 1
        if report is not None:
            add = " + add" if residual is not None else ""
            report.append(f"{prefix}{node.target}{add} + {act}")
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _fuse_group_norm_graph(gm: fx.GraphModule, prefix: str, report: list[str] | None) -> int:
    """Fold the activation that alone uses a GroupNorm's output, and a time embedding added to
    its input that nothing else uses, into it (GroupNormAct)."""
    mods = dict(gm.named_modules())
    calls = Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or type(mods[node.target]) not in (
            torch.nn.GroupNorm,
            modules.GroupNorm,
        ):
            continue
        if calls[node.target] != 1 or len(node.args) != 1 or node.kwargs:
            continue
        (source,) = node.args
        shifted = None
        if isinstance(source, fx.Node) and _only_user(source) is node:
            shifted = _time_embedding(source)
        user = _only_user(node)
        act = _activation(user, node, mods) if user is not None else None
        if act is None and shifted is None:
            continue
        gn = mods[node.target]
        gn.__class__ = modules.GroupNormAct
        gn.activation = act or "identity"
        last = user if act is not None else node
        with gm.graph.inserting_after(last):
            new = gm.graph.call_module(node.target, shifted[:2] if shifted else node.args)
        last.replace_all_uses_with(new)
        for dead in (last, node, source, shifted[2] if shifted else None):
            if isinstance(dead, fx.Node) and dead in gm.graph.nodes and not dead.users:
                gm.graph.erase_node(dead)
        fused += 1
        if report is not None:
            parts = [node.target] + ["shift"] * (shifted is not None) + [act] * (act is not None)
            report.append(prefix + " + ".join(parts))
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


_FUSED_TAILS: dict[type, type] = {}  # adopted norm-with-tail class -> its fused class
_TAILED_NORMS = (modules.BatchNorm2d, modules.GroupNorm)  # the norms with a fused-act kernel


def _fused_tail_class(cls: type) -> type:
    """``cls`` (replace_norms' class of a BatchNorm2d or GroupNorm subclass with a drop and act
    tail) running the fused kernel when drop is an Identity and act a ReLU/SiLU module, else as
    before."""
    if cls not in _FUSED_TAILS:

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            act = _ACT_MODULES.get(type(self.act))
            if act is None or type(self.drop) is not torch.nn.Identity:
                return cls.forward(self, input)
            if isinstance(self, modules.BatchNorm2d):
                return modules._batch_norm_act_forward(self, input, None, act)
            # fmt: off
            return group_norm_act(input, self.num_groups, self.weight, self.bias, self.eps,
                                  act)
            # fmt: on

        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        namespace.update(__doc__=cls.__doc__, forward=forward)
        _FUSED_TAILS[cls] = type(cls.__name__, (cls,), namespace)
    return _FUSED_TAILS[cls]


def _fuse_norm_tails(model: torch.nn.Module, report: list[str] | None) -> None:
    """Put the BatchNorm2d and GroupNorm subclasses replace_norms converted with their drop and
    act tail (timm's BatchNormAct2d, GroupNormAct, GroupNorm1Act) on the fused kernel, where
    their act is a ReLU/SiLU module."""
    tails = {
        adopted
        for (_cls, tail), adopted in convert._ADOPTED.items()
        if tail == ("drop", "act") and issubclass(adopted, _TAILED_NORMS)
    }
    for name, module in model.named_modules():
        if (
            type(module) in tails
            and type(module.act) in _ACT_MODULES
            and type(module.drop) is torch.nn.Identity
        ):
            module.__class__ = _fused_tail_class(type(module))
            if report is not None:
                report.append(f"{name} + {_ACT_MODULES[type(module.act)]}")


def _structure(graph: fx.Graph) -> list[tuple[str, object]]:
    """What ``graph`` computes, up to its inputs' names and the arguments of each call."""
    is_none_check = fx._symbolic_trace._assert_is_none  # what fx adds for an argument fixed to None
    return [
        (n.op, n.target)
        for n in graph.nodes
        if n.op != "placeholder" and n.target is not is_none_check
    ]


def _plain_containers(spec: pytree.TreeSpec) -> bool:
    return spec.is_leaf() or (
        spec.type in (tuple, list, dict) and all(map(_plain_containers, spec.children()))
    )


def _named_arguments_codegen(graph: fx.Graph) -> None:
    """A graph traced with its ``*args``/``**kwargs`` fixed empty gets fx's pytree code (inputs
    and output flattened, the empty ones expected too): back to plain code, the forward taking
    its named arguments (with their defaults) and returning its output as built."""
    out_spec = graph._codegen.pytree_info.out_spec
    if not _plain_containers(out_spec):
        raise TypeError(f"an output of {out_spec.type} is not rebuilt in plain code")
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    output.args = (pytree.tree_unflatten(list(output.args[0]), out_spec),)
    graph.set_codegen(fx.graph.CodeGen())


def _trace(model: torch.nn.Module) -> fx.Graph:
    """``model``'s graph with its ``*args`` and ``**kwargs`` empty; raises where it does not
    trace or where its graph differs with an argument None (see the module docstring)."""
    parameters = inspect.signature(model.forward).parameters.values()
    named, empty = [], {}
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            empty[f"*{p.name}"] = ()
        elif p.kind is p.VAR_KEYWORD:
            empty[f"**{p.name}"] = {}
        else:
            named.append(p.name)
    graph = _NormLeafTracer().trace(model, concrete_args=empty or None)
    if empty:
        _named_arguments_codegen(graph)
    for name in named:
        try:
            with_none = _NormLeafTracer().trace(model, concrete_args={**empty, name: None})
        except Exception:  # it cannot take None: its tensor graph is the only one
            continue
        if _structure(with_none) != _structure(graph):
            raise TypeError(f"{type(model).__name__}.forward's graph depends on {name} is None")
    return graph


def _fuse(
    model: torch.nn.Module, prefix: str, report: list[str] | None, *, root: bool = True
) -> torch.nn.Module:
    try:
        graph = _trace(model)
    except Exception:  # any failure to trace: fuse the children instead
        for name, child in model.named_children():
            if not isinstance(child, _NORMS):
                setattr(model, name, _fuse(child, f"{prefix}{name}.", report, root=False))
        return model
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    gm.train(model.training)
    fused = _fuse_graph(gm, prefix, report) + _fuse_group_norm_graph(gm, prefix, report)
    # a submodule with nothing to fuse stays as it was: a LayerNorm stays one (replace_norms
    # finds it), a Linear gets no generated forward
    return gm if fused or root else model


def fuse(model: torch.nn.Module, *, report: list[str] | None = None) -> torch.nn.Module:
    """Convert ``model``'s norms to cupynorm's and fold a BatchNorm2d's following activation and
    residual add, and a GroupNorm's following activation, into it; returns the converted model
    (a :class:`torch.fx.GraphModule` where it traced: use the returned object).

    Args:
        model: the model; its norm modules are converted in place (the same module objects).
        report: a list that receives one line per fusion (``"layer1.0.bn3 + add + relu"``,
            ``"0.norm1 + silu"``).

    Example::

        >>> fused = []
        >>> model = cupynorm.torch.fuse(torchvision.models.resnet50().cuda(), report=fused)
        >>> len(fused)       # BatchNorm2d + ReLU, 16 of them with the residual add; the
        49                   # 4 downsample BatchNorms feed an add that is already fused
    """
    replace_norms(model)
    _fuse_norm_tails(model, report)
    return _fuse(model, "", report)
