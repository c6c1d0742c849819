"""cupynorm: normalization layers as CUDA kernels compiled at run time by CuPy (NVRTC).

Functional API on CuPy arrays, torch CUDA tensors (zero-copy) and any DLPack array::

    import cupynorm
    y = cupynorm.group_norm(x, num_groups=8, weight=w, bias=b)

Drop-in ``torch.nn`` modules that train live in :mod:`cupynorm.torch`. Importing cupynorm imports
neither CuPy nor torch; kernels compile on first use, per device and element type.
"""

from .errors import InvalidInputError, InvalidTypeError
from .functional import (
    add_layer_norm,
    add_rms_norm,
    batch_norm,
    group_norm,
    group_norm_act,
    instance_norm,
    layer_norm,
    layer_norm2d,
    rms_norm,
    rms_norm2d,
    row_norm_add_mul,
)

__version__ = "0.1.0"

__all__ = [
    "InvalidInputError",
    "InvalidTypeError",
    "__version__",
    "add_layer_norm",
    "add_rms_norm",
    "batch_norm",
    "group_norm",
    "group_norm_act",
    "instance_norm",
    "layer_norm",
    "layer_norm2d",
    "rms_norm",
    "rms_norm2d",
    "row_norm_add_mul",
]
