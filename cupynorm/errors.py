"""The exceptions cupynorm raises for bad arguments.

CuPy-style code catches ``ValueError``/``TypeError``; torch code catches ``RuntimeError``, which is
what ``torch.nn`` raises for most bad shapes (``running_mean should contain 4 elements not 3``,
a 1-D GroupNorm input, channels not divisible by ``num_groups``). One exception serves both: each
class below is both, so either ``except`` clause catches it, on the CuPy API and the torch API
alike. Both are exported as ``cupynorm.InvalidInputError`` and ``cupynorm.InvalidTypeError``.
"""

from __future__ import annotations

__all__ = ["InvalidInputError", "InvalidTypeError"]


class InvalidInputError(ValueError, RuntimeError):
    """An argument of the wrong shape, size, device or value (a ValueError and a RuntimeError)."""


class InvalidTypeError(TypeError, RuntimeError):
    """An argument of the wrong type or dtype (a TypeError and a RuntimeError)."""
