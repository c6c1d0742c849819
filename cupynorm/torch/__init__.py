"""cupynorm for torch: functional API, drop-in ``torch.nn`` modules and model conversion.

CUDA tensors run on cupynorm's kernels (launched on torch's current stream, memory from torch's
allocator, so CUDA-graph capture works), but for two choices of where a call runs (see
:mod:`._policy`): eager calls smaller than their kind's size run torch's own op, whose host path
costs less than the kernels would save (:func:`set_eager_min_bytes`), as do larger ones while
the GPU keeps up with the host (:func:`set_eager_adaptive`) and, inside a CUDA graph capture,
calls smaller than their kind's capture size (:func:`set_capture_min_bytes`); inside
``torch.compile`` BatchNorm, LayerNorm, RMSNorm and the channel norms are traced as torch's
functional calls for Inductor to fuse, the others are custom ops (``torch.ops.cupynorm.*``) with
fake kernels and registered autograd (:func:`set_compile_kernels`) but for calls smaller than
their kind's compile size (:func:`set_compile_min_bytes`). Tensors on any other device go
through :mod:`torch.nn.functional`. Importing this package does not need CuPy; the first CUDA
call does.

Example::

    >>> import cupynorm.torch as cnt
    >>> model = cnt.replace_norms(model)              # swap torch.nn norms in place
    >>> model = cnt.fuse(model)                       # ... and fold BatchNorm2d + add + ReLU
    >>> y = cnt.group_norm(x, 32, weight, bias)       # functional, with autograd
"""

from ._hf_layers import patch_transformers
from ._hf_norms import (
    HF_NORMS,
    CohereLayerNorm,
    GemmaRMSNorm,
    Olmo2RMSNorm,
    OlmoLayerNorm,
    T5LayerNorm,
)
from ._policy import (
    capture_min_bytes,
    compile_kernels,
    compile_min_bytes,
    eager_min_bytes,
    set_capture_min_bytes,
    set_compile_kernels,
    set_compile_min_bytes,
    set_eager_adaptive,
    set_eager_min_bytes,
)
from .convert import replace_norms
from .functional import (
    add_layer_norm,
    add_rms_norm,
    batch_norm,
    batch_norm_act,
    group_norm,
    group_norm_act,
    instance_norm,
    layer_norm,
    layer_norm2d,
    llama_rms_norm,
    rms_norm,
    rms_norm2d,
    row_norm_add_mul,
)
from .fuse import fuse
from .modules import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    BatchNormAct2d,
    GroupNorm,
    GroupNormAct,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    LayerNorm2d,
    LlamaRMSNorm,
    RMSNorm,
    RMSNorm2d,
    RowNormAddMul,
)
from .sync_batchnorm import SyncBatchNorm

__all__ = [
    "HF_NORMS",
    "CohereLayerNorm",
    "GemmaRMSNorm",
    "Olmo2RMSNorm",
    "OlmoLayerNorm",
    "T5LayerNorm",
    "patch_transformers",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "BatchNormAct2d",
    "GroupNormAct",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LayerNorm",
    "LayerNorm2d",
    "LlamaRMSNorm",
    "RMSNorm",
    "RMSNorm2d",
    "RowNormAddMul",
    "add_layer_norm",
    "capture_min_bytes",
    "compile_min_bytes",
    "compile_kernels",
    "eager_min_bytes",
    "add_rms_norm",
    "SyncBatchNorm",
    "batch_norm",
    "batch_norm_act",
    "group_norm_act",
    "fuse",
    "group_norm",
    "instance_norm",
    "layer_norm",
    "layer_norm2d",
    "llama_rms_norm",
    "replace_norms",
    "rms_norm",
    "rms_norm2d",
    "row_norm_add_mul",
    "set_compile_kernels",
    "set_capture_min_bytes",
    "set_compile_min_bytes",
    "set_eager_adaptive",
    "set_eager_min_bytes",
]
