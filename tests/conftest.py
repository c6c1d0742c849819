"""Shared test helpers: GPU detection and poisoning of the allocator's memory."""

from __future__ import annotations

import pytest


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


requires_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")


def poison_torch_allocator(nbytes: int = 64 << 20) -> None:
    """Fill freed blocks of torch's caching allocator with NaN, so an unwritten output shows."""
    import torch

    block = torch.empty(nbytes // 4, device="cuda")
    block.fill_(float("nan"))
    del block


def poison_cupy_pool(nbytes: int = 64 << 20) -> None:
    import cupy

    block = cupy.empty(nbytes // 4, dtype=cupy.float32)
    block.fill(cupy.nan)
    del block
