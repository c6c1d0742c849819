"""The library of the cupynorm custom ops (``torch.ops.cupynorm.*``) and the two calls every family
registers its ops with: schema, a kernel per device and a fake kernel (:func:`define`), then the
forward op's autograd (:func:`register_autograd`), so ``torch.compile(fullgraph=True)`` keeps
them in the graph. Each op is defined in its family's module, with its schema in that module's
docstring::

    group_norm_fwd, group_norm_bwd, group_norm_act_fwd, group_norm_act_bwd    _group_norm
    instance_norm_fwd (its backward: group_norm_bwd)                          _instance_norm
    batch_norm_fwd, batch_norm_bwd, batch_norm_act_fwd, batch_norm_act_bwd    _batch_norm
    row_norm_fwd, row_norm_bwd (LayerNorm / RMSNorm, Llama's with cast)       _row_norm
    row_norm_add_mul_fwd, row_norm_add_mul_bwd                                _row_norm_add_mul
    channel_norm_fwd, channel_norm_bwd                                        _channel_norm

Running statistics: ``torch.library`` refuses ``register_autograd`` on an op that mutates an
input ("Cannot register autograd formula for non-functional operator"), so the forward ops with
running statistics are functional: they return the updated statistics (None where nothing is
updated; batch norm's CUDA kernels write them into new tensors, the other kernels update copies)
and the functional layer writes them back with ``copy_``, an ordinary in-place op that
``torch.compile`` functionalizes like torch's own buffer updates. The eager fast path updates them
in place inside the kernel, no copies.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings

import torch

_lib = torch.library.Library("cupynorm", "FRAGMENT")

kernels = types.SimpleNamespace()
"""Each op's kernels by name and device (``kernels.group_norm_fwd_cuda``): what a compiled graph
calls (:func:`_direct_call`)."""


def define(
    schema: str, cuda_kernel, cpu_kernel, fake_kernel, any_layout: bool = False
) -> torch._ops.OpOverload:
    """Define the op ``torch.ops.cupynorm.<name>`` of ``schema`` with its CUDA and CPU kernels
    (``Library.impl`` on the device keys: no ``custom_op`` wrapper on the call) and its fake
    kernel; returns the op's default overload. Inductor's generated code calls the kernels
    directly (:func:`_direct_call`): they take the schema's arguments in order, with its
    defaults.

    ``any_layout``: the kernels take their tensors in any strides and return what the fake
    kernel says for those strides (the input's memory format, :func:`._tensors._empty_out`), so
    Inductor may hand the op its tensors in the layout it chose for them. Without the tag a
    custom op gets the strides it was traced with: in an NCHW model, whose convolutions Inductor
    runs channels_last, that is a copy of the input to NCHW and of the output back for every
    call."""
    name = schema[: schema.index("(")]
    _lib.define(schema, tags=(torch._C.Tag.flexible_layout,) if any_layout else ())
    _lib.impl(name, cuda_kernel, "CUDA")
    _lib.impl(name, cpu_kernel, "CPU")
    setattr(kernels, f"{name}_cuda", cuda_kernel)
    setattr(kernels, f"{name}_cpu", cpu_kernel)

    @functools.wraps(fake_kernel)
    def fake(*args, **kwargs):
        _register_direct_calls()  # tracing: Inductor's code generation may follow
        return fake_kernel(*args, **kwargs)

    torch.library.register_fake(f"cupynorm::{name}", fake, lib=_lib)
    _names.append(name)
    _register_direct_calls([name])
    return getattr(torch.ops.cupynorm, name).default


def register_autograd(op: torch._ops.OpOverload, backward, setup_context) -> None:
    """A forward op's autograd: ``backward`` (which calls the backward op) and ``setup_context``."""
    torch.library.register_autograd(op.name(), backward, setup_context=setup_context, lib=_lib)


# ---------------------------------------------------------------------------------------------
# Inside a compiled graph: the kernel called directly
# ---------------------------------------------------------------------------------------------
# Inductor's generated code calls an op it does not lower as `torch.ops.cupynorm.<op>.default(..)`:
# the dispatcher parses and boxes the arguments into a Python call, and a forward op's Python
# autograd kernel runs and redispatches though a compiled graph runs without grad. Together ~28
# of a ~57 us group norm call on an H100 host (benchmarks/NOTES.md), for nothing: the fake kernel
# checked the call when the graph was traced, and the graph hands the op plain dense tensors. So
# the generated code calls the op's kernel for its device (`cupynorm_kernels.group_norm_fwd_cuda(
# ..)`: the function the dispatcher would reach, with the same arguments). Inductor's registry of
# custom code for extern kernels is private (torch 2.11 to 2.14 have it); without it the
# generated code keeps the op call.
_OP_PREFIX = "torch.ops.cupynorm."
_IMPORT = "from cupynorm.torch._library import kernels as cupynorm_kernels"
DIRECT_CALLS = True  # False: the op calls (`profile stack --compile` measures both)
_names: list[str] = []  # every op defined
_registry: tuple = ()  # (Inductor's registry, its entry class) once registered; None: no registry


def _register_direct_calls(names: list[str] | None = None) -> None:
    """Register :func:`_direct_call` as the Python code generation of every cupynorm op once
    Inductor is loaded (its import costs ~1 s: never paid for a trace that does not compile);
    ``names``: ops defined since, registered if that happened."""
    global _registry
    if _registry == ():
        if "torch._inductor" not in sys.modules:
            return
        try:
            from torch._inductor.codegen.custom_extern_kernel_codegen import (
                CUSTOM_EXTERN_KERNEL_CODEGEN,
                CustomCodegen,
            )
        except ImportError:  # a torch without the registry: the op calls stay
            _registry = None
            return
        _registry, names = (CUSTOM_EXTERN_KERNEL_CODEGEN, CustomCodegen), _names
    if _registry and names:
        table, entry = _registry
        for name in names:
            table[f"{_OP_PREFIX}{name}.default"] = entry(python=_direct_call)


def _direct_call(node, writeline, *_) -> None:
    """Inductor's line for the fallback kernel ``node``: ``buf = cupynorm_kernels.<op>_<device>(
    args)``; Inductor's own line (the op call) for anything but the plain Python wrapper, and
    with a warning where the private API is not what this expects."""
    from torch._inductor.codegen.wrapper import ExternKernelAllocLine
    from torch._inductor.virtualized import V

    wrapper = V.graph.wrapper_code
    try:
        line = _direct_line(node, V.graph, wrapper) if DIRECT_CALLS else None
    except Exception as error:  # noqa: BLE001 - an Inductor of another shape: the op call
        line = None
        warnings.warn(
            f"cupynorm: Inductor's code calls {node.python_kernel_name} through the dispatcher "
            f"(the direct call failed: {error!r})",
            stacklevel=2,
        )
    writeline(line if line is not None else ExternKernelAllocLine(wrapper, node))


def _direct_line(node, graph, wrapper) -> str | None:
    """The direct call's line (its import added to the wrapper once), or None where Inductor's
    own line belongs: the C++ or FX wrapper, a device without a kernel."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    root = wrapper
    while getattr(root, "parent_wrapper", None) is not None:
        root = root.parent_wrapper  # a subgraph's imports are its parent's
    op = node.python_kernel_name[len(_OP_PREFIX) :].split(".")[0]
    kernel = f"{op}_{getattr(node.get_device(), 'type', '')}"
    if (
        graph.cpp_wrapper
        or getattr(graph, "fx_wrapper", False)
        or not isinstance(root, PythonWrapperCodegen)
        or not hasattr(kernels, kernel)
    ):
        return None
    args = ", ".join([*node.codegen_args(), *node.codegen_kwargs()])
    root.add_import_once(_IMPORT)
    return f"{node.get_name()} = cupynorm_kernels.{kernel}({args})"
