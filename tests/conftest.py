"""Shared test helpers: GPU detection, poisoning of the allocator's memory, the replay check of
every recorded call on a GPU, and the fixtures that send CPU tensors down cupynorm.torch's CUDA
route onto the reference kernels (``kernels``, ``kernel_path``)."""

from __future__ import annotations

import importlib.util

import pytest

# The test modules that need torch: a CuPy-only install (`pip install ".[cuda12x]" pytest
# hypothesis`, no torch) runs the others, and CI runs such an install (.ci/run). A new module
# that imports torch at its top belongs here (that CI run fails on it otherwise).
_NEEDS_TORCH = [
    "test_channel_norm_cpu.py",
    "test_convergence_cpu.py",
    "test_convert_cpu.py",
    "test_fused_cpu.py",
    "test_group_norm_act_cpu.py",
    "test_layer_norm_cpu.py",
    "test_llama_rms_norm_cpu.py",
    "test_plan_cpu.py",
    "test_programs_cpu.py",
    "test_programs_gpu.py",
    "test_reliability_gpu.py",
    "test_single_launch_gpu.py",
    "test_sync_batchnorm_cpu.py",
    "test_sync_batchnorm_gpu.py",
    "test_torch_errors_cpu.py",
    "test_torch_modules_cpu.py",
    "test_torch_modules_gpu.py",
    "test_validation_cpu.py",
]
if importlib.util.find_spec("torch") is None:
    collect_ignore = _NEEDS_TORCH


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


requires_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")


def timm_norm_act():
    """timm.layers.norm_act, or the test skipped (timm missing, or its own imports failing:
    timm present without torchvision)."""
    try:
        return pytest.importorskip("timm.layers.norm_act")
    except ImportError as error:
        pytest.skip(f"timm does not import: {error}")


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


def _assert_identical(recorded: tuple, replayed: tuple) -> None:
    """The outputs of a call and of its replay: same dtype, shape, strides, bits."""
    assert len(recorded) == len(replayed)
    for a, b in zip(recorded, replayed, strict=True):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype
        if type(a).__module__.startswith("cupy"):
            import cupy

            assert a.strides == b.strides
            cupy.testing.assert_array_equal(a, b)
        else:
            import torch

            assert a.stride() == b.stride()
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(autouse=True, scope="session")
def _replay_every_recorded_call():
    """On a GPU, every call the host code records is replayed at once and both outputs compared,
    so each test checks the replay path (cupynorm._program) as well as the first call."""
    if not cuda_available():
        yield
        return
    from cupynorm import _program

    _program.check_replay = _assert_identical
    yield
    _program.check_replay = None


@pytest.fixture(autouse=True, scope="session")
def _every_norm_on_the_kernels():
    """The tests check cupynorm's kernels: every call on them, eager at any size (the default
    sends small eager calls to torch's op: tests/test_eager_policy_gpu.py) and inside compiled
    graphs for every kind (the default leaves some kinds to Inductor: tests/test_policy_cpu.py),
    restored after the session."""
    try:
        from cupynorm.torch import _policy
    except ImportError:  # no torch
        yield
        return
    previous = _policy.set_compile_kernels("all"), _policy.set_eager_min_bytes(0)
    yield
    _policy.set_compile_kernels(previous[0])
    _policy.set_eager_min_bytes(previous[1])


@pytest.fixture
def kernels(monkeypatch):
    """Send CPU tensors down the CUDA route (eager fast path), onto the reference kernels."""
    from torch_cpu_helpers import patch_route

    patch_route(monkeypatch.setattr, "_use_kernels", lambda x, kind: True)


@pytest.fixture(params=["eager", "custom_op"])
def kernel_path(request, monkeypatch):
    """The CUDA route on CPU tensors, through the eager Functions or the custom ops."""
    from torch_cpu_helpers import patch_route

    patch_route(monkeypatch.setattr, "_use_kernels", lambda x, kind: True)
    if request.param == "custom_op":
        patch_route(monkeypatch.setattr, "_traced", lambda x: True)
    return request.param
