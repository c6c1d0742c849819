r"""The functional API of :mod:`cupynorm.torch`: the public namespace of its functions.

Each function lives in its norm family's module with everything of the family, from its
kernels to the function, in one file read top to bottom: the kernels on each device (CUDA glue
to the host code, the CPU reference, the fake kernel), the custom ops and their registration,
the autograd (setup_context and backward), the eager Functions, the replay's save, grads and
entry, the route, the public functions:

- :mod:`._batch_norm` (its kernels: :mod:`._batch_norm_kernels`): :func:`batch_norm`,
  :func:`batch_norm_act`;
- :mod:`._group_norm`: :func:`group_norm`, :func:`group_norm_act`; :mod:`._instance_norm`
  (group norm with G = C, above group and batch norm): :func:`instance_norm`;
- :mod:`._row_norm`: :func:`layer_norm`, :func:`rms_norm`, :func:`add_layer_norm`,
  :func:`add_rms_norm`; :mod:`._llama_rms_norm` (on the row norm): :func:`llama_rms_norm`;
  :mod:`._row_norm_add_mul`: :func:`row_norm_add_mul`;
- :mod:`._channel_norm` (above the row norm, whose replay it takes for channels_last input):
  :func:`layer_norm2d`, :func:`rms_norm2d`.

Imports go one way: this namespace and the modules (:mod:`.modules` with the torch forward
logic they mix in, :mod:`._module_forward`; :mod:`.convert`, :mod:`.fuse`,
:mod:`.sync_batchnorm`) -> the family modules -> shared modules that import no
family: :mod:`._route` (which calls run on the kernels, the custom op or a replay),
:mod:`._replay` (the generic replay), :mod:`._autograd` (the eager Functions' base),
:mod:`._library` (the op library), :mod:`._tensors` (layouts around the host code),
:mod:`._checks`, :mod:`._policy`, :mod:`._reference` (the CPU kernels) -> the
framework-neutral host code (:mod:`cupynorm._program`; :mod:`cupynorm._ops`, imported on the
first CUDA call).

**Eager fast path.** A call through the dispatcher into a Python kernel with Python autograd is
expensive. Measured on the CPU of the dev machine (torch 2.13, a trivial kernel taking 3.7 us
when called directly): ``torch.library`` op with autograd 26 us per call, the same op with no
input requiring grad 9.7 us, a plain :class:`torch.autograd.Function` 8.3 us (one that defines
``setup_context`` 21 us: ``apply`` binds the signature with :mod:`inspect` on every call). So
eager calls on plain CUDA tensors go through ``_*Function`` (an old-style ``autograd.Function``
sharing the op's kernels, setup and backward code), or straight to the kernel when no gradient
is needed; the custom op is used whenever something traces: ``torch.compile``/export, tensor
subclasses (FakeTensor, ...), an active ``TorchDispatchMode``. With a 3 us stub kernel, a whole
module call then costs 9 us (InstanceNorm2d, nothing needs grad), 17 us (GroupNorm, affine,
parameters need grad) and 21 us (BatchNorm2d training). To re-measure on a GPU::

    import torch, torch.utils.benchmark as B
    import cupynorm.torch as cnt
    from cupynorm.torch import _group_norm
    x = torch.randn(8, 64, 32, 32, device="cuda", requires_grad=True)
    m, ref = cnt.InstanceNorm2d(64).cuda(), torch.nn.InstanceNorm2d(64).cuda()
    op = torch.ops.cupynorm.group_norm_fwd.default
    for stmt in ("ref(x)", "m(x)",                                               # modules
                 "op(x, 64, None, None, 1e-5)",                                  # dispatcher
                 "_group_norm._GroupNormFunction.run(x, 64, None, None, 1e-5)",  # fast path
                 "_group_norm._group_norm_fwd(x, 64, None, None, 1e-5)"):        # kernel only
        t = B.Timer(stmt, globals=globals()).blocked_autorange(min_run_time=1)
        print(f"{stmt:64s} {t.median * 1e6:7.1f} us")

**Functional API**: ``torch.nn.functional`` semantics and argument names (the fused
:func:`group_norm_act`, :func:`batch_norm_act`, :func:`add_layer_norm`, :func:`add_rms_norm`,
:func:`row_norm_add_mul` and the norms over the channels of ``(N, C, *)``, :func:`layer_norm2d`
and :func:`rms_norm2d`, follow the same conventions; :func:`llama_rms_norm` is Hugging Face's
LlamaRMSNorm formula); CUDA tensors run on cupynorm's kernels after :mod:`._checks` (bad
arguments raise torch's own error for them), any other device through
:mod:`torch.nn.functional`, so a converted model still runs on the CPU.

**Higher-order autograd** (:mod:`._higher_order`): double backward (``create_graph=True``)
works through every Function, its gradients then computed by differentiable torch operations
instead of the backward kernel; under ``torch.func`` transforms (``vmap``, ``grad``, ``jvp``,
...) and forward-mode AD the calls take :mod:`torch.nn.functional`'s path, with torch's
semantics and errors.
"""

from __future__ import annotations

from ._batch_norm import batch_norm, batch_norm_act
from ._channel_norm import layer_norm2d, rms_norm2d
from ._group_norm import group_norm, group_norm_act
from ._instance_norm import instance_norm
from ._llama_rms_norm import llama_rms_norm
from ._row_norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from ._row_norm_add_mul import row_norm_add_mul

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "batch_norm",
    "batch_norm_act",
    "group_norm",
    "group_norm_act",
    "instance_norm",
    "layer_norm",
    "layer_norm2d",
    "llama_rms_norm",
    "rms_norm",
    "rms_norm2d",
    "row_norm_add_mul",
]
