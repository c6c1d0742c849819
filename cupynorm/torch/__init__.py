"""cupynorm for torch: functional API, drop-in ``torch.nn`` modules and model conversion.

CUDA tensors run on cupynorm's kernels (launched on torch's current stream, memory from torch's
allocator, so CUDA-graph capture works); ``torch.compile`` sees them as custom ops
(``torch.ops.cupynorm.*``) with fake kernels and registered autograd. Tensors on any other
device go through :mod:`torch.nn.functional`. Importing this package does not need CuPy; the
first CUDA call does.

Example::

    >>> import cupynorm.torch as cnt
    >>> model = cnt.replace_norms(model)              # swap torch.nn norms in place
    >>> y = cnt.group_norm(x, 32, weight, bias)       # functional, with autograd
"""

from .convert import replace_norms
from .functional import batch_norm, group_norm, instance_norm, row_norm_add_mul
from .modules import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    RowNormAddMul,
)
from .sync_batchnorm import SyncBatchNorm

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "RowNormAddMul",
    "SyncBatchNorm",
    "batch_norm",
    "group_norm",
    "instance_norm",
    "replace_norms",
    "row_norm_add_mul",
]
