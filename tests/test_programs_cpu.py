"""Recorded calls (cupynorm._ops programs) on the CPU: CPU torch tensors stand in for device arrays
and a fake launcher logs every launch, so the record / replay logic is checked without a GPU.

The GPU tests check the replay against the recorded call's outputs bit for bit
(tests/conftest.py); these pin the bookkeeping itself: what is recorded, what a replay launches
with which pointers, and what is never recorded.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cupynorm import _compile, _interop, _launch, _ops, _plan, _program

H200 = _plan.DeviceInfo(sm_count=132, compute_capability=90, smem_optin=232448)


class _CpuTorchBackend(_interop.TorchBackend):
    """torch's backend on CPU tensors: device 0, stream 0."""

    @staticmethod
    def device_id(x) -> int:
        return 0

    def stream(self, device_id: int) -> int:
        return 0


class _FakeLauncher:
    def __init__(self, kernel: str, log: list) -> None:
        self.kernel, self.log = kernel, log

    def launch(self, grid, block, smem, stream, args) -> None:
        values = [a.item() if hasattr(a, "item") else a for a in args]  # numpy scalars or not
        self.log.append((self.kernel, grid, tuple(block), smem, values))


@pytest.fixture
def launches(monkeypatch):
    """Route the host code to CPU tensors and a launch log; start with no recorded programs."""
    log: list = []
    backend = _CpuTorchBackend()
    monkeypatch.setattr(_interop, "backend_of", lambda x: backend)
    monkeypatch.setattr(_plan, "device_info", lambda device: H200)
    monkeypatch.setattr(
        _compile, "launcher", lambda dev, src, kernel, *rest: _FakeLauncher(kernel, log)
    )
    monkeypatch.setattr(_compile, "max_block_threads", lambda *a: 1024)
    monkeypatch.setattr(_compile, "resident_ctas", lambda *a: 2)
    monkeypatch.setattr(_compile, "current_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_program, "check_replay", None)
    monkeypatch.setattr(_program, "_PROGRAMS", {})
    return log


def _pointers(*tensors) -> set[int]:
    return {t.data_ptr() for t in tensors if t is not None}


@pytest.mark.parametrize("shape", [(2, 6, 5, 8), (2, 4, 256, 256)], ids=["one-cta", "team"])
def test_second_call_replays_with_new_pointers(launches, shape) -> None:
    w, b = torch.rand(shape[1]), torch.rand(shape[1])
    x1 = torch.rand(shape)
    y1, m1, r1 = _ops.group_norm_fwd(x1, 2, w, b, 1e-5)
    recorded = list(launches)
    (program,) = _program._PROGRAMS.values()
    assert program is not _program._UNRECORDABLE and recorded
    launches.clear()
    x2 = torch.rand(shape)
    calls = _launch._Call.__init__
    with pytest.MonkeyPatch.context() as patch:  # a replay plans nothing
        patch.setattr(_launch._Call, "__init__", lambda *a: pytest.fail("planned again"))
        y2, m2, r2 = _ops.group_norm_fwd(x2, 2, w, b, 1e-5)
    assert _launch._Call.__init__ is calls
    assert [(k, g, bl, s) for k, g, bl, s, _ in launches] == [
        (k, g, bl, s) for k, g, bl, s, _ in recorded
    ]
    assert y2.shape == x2.shape and y2.stride() == x2.stride() and m2.shape == (2, 2)
    for (_, _, _, _, first), (_, _, _, _, second) in zip(recorded, launches, strict=True):
        for a, b_ in zip(first, second, strict=True):
            if a in _pointers(x1, y1, m1, r1):  # an input's or an output's pointer moves along
                assert b_ in _pointers(x2, y2, m2, r2)
            elif a in _pointers(w, b):  # the same weight and bias
                assert b_ == a
            elif a != b_:  # any other changed value is a fresh scratch allocation (team counters)
                assert a > 4096 and b_ > 4096
    assert not _pointers(y1, m1, r1) & _pointers(y2, m2, r2)  # fresh outputs


def test_signature_changes_record_again(launches) -> None:
    x = torch.rand(2, 6, 5, 8)
    _ops.group_norm_fwd(x, 2, None, None, 1e-5)
    _ops.group_norm_fwd(x, 3, None, None, 1e-5)  # another scalar
    _ops.group_norm_fwd(x, 2, None, None, 1e-4)
    _ops.group_norm_fwd(x.to(memory_format=torch.channels_last), 2, None, None, 1e-5)
    _ops.group_norm_fwd(x.double(), 2, None, None, 1e-5)
    assert len(_program._PROGRAMS) == 5


def test_aliased_inputs_are_not_recorded(launches) -> None:
    x = torch.rand(4, 64)
    _ops.row_norm_add_mul_fwd(x, x, 1e-5)  # the same memory twice: aliasing is not in the key
    assert list(_program._PROGRAMS.values()) == [_program._UNRECORDABLE]
    launches.clear()
    _ops.row_norm_add_mul_fwd(x, x, 1e-5)  # runs the full path again
    assert launches


def test_framework_operations_make_a_call_unrecordable(launches) -> None:
    x = torch.rand(4, 6, 3, 3)
    rm, rv = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    # running statistics of another dtype than the kernels' weight type: torch updates them
    _ops.batch_norm_fwd(x, None, None, rm, rv, True, 0.1, 1e-5)
    assert list(_program._PROGRAMS.values()) == [_program._UNRECORDABLE]


def test_running_statistics_in_the_kernel_are_recorded_as_mutating(launches) -> None:
    x = torch.rand(4, 6, 3, 3)
    rm, rv = torch.zeros(6), torch.ones(6)
    _ops.batch_norm_fwd(x, None, None, rm, rv, True, 0.1, 1e-5)
    (program,) = _program._PROGRAMS.values()
    assert program is not _program._UNRECORDABLE and program.mutating
    launches.clear()
    rm2, rv2 = torch.zeros(6), torch.ones(6)
    _ops.batch_norm_fwd(torch.rand(4, 6, 3, 3), None, None, rm2, rv2, True, 0.1, 1e-5)
    finalize = [args for kernel, *_, args in launches if kernel == "strided_norm_finalize"]
    assert finalize and rm2.data_ptr() in finalize[0] and rv2.data_ptr() in finalize[0]


def test_inference_calls_pass_no_statistics(launches) -> None:
    x = torch.rand(2, 6, 5, 8)
    y, mean, rstd = _ops.group_norm_fwd(x, 2, None, None, 1e-5, want_stats=False)
    assert mean is None and rstd is None and y.shape == x.shape
    ((kernel, _, _, _, args),) = launches
    assert kernel == "segment_norm_fwd_affine"
    assert args[4] == 0 and args[5] == 0  # mean, rstd: null pointers


def test_scratch_buffers_are_one_workspace(launches) -> None:
    """A replay allocates its outputs and one workspace; each scratch buffer of the recorded call
    is a 256-byte-aligned piece of it, and the pieces do not overlap."""
    shape = (4, 6, 3, 3)
    w, b, rm, rv = torch.rand(6), torch.rand(6), torch.zeros(6), torch.ones(6)
    _ops.batch_norm_fwd(torch.rand(shape), w, b, rm, rv, True, 0.1, 1e-5)
    (program,) = _program._PROGRAMS.values()
    # outputs y, mean, rstd, then the workspace for the variance and the partial statistics
    assert len(program.allocations) == 4
    launches.clear()
    x = torch.rand(shape)
    y, mean, rstd = _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)
    known = _pointers(x, w, b, rm, rv, y, mean, rstd)
    scratch = sorted(
        {a for *_, args in launches for a in args if isinstance(a, int) and a > 4096} - known
    )
    assert len(scratch) == 2  # the variance and the partial statistics
    assert (scratch[1] - scratch[0]) % 256 == 0  # the second piece starts past the first's


def test_outputs_like_an_input_are_allocated_like_it(launches) -> None:
    x = torch.rand(3, 8, 5, 7).to(memory_format=torch.channels_last)
    _ops.group_norm_fwd(x, 2, None, None, 1e-5)
    (program,) = _program._PROGRAMS.values()
    x2 = torch.rand(3, 8, 5, 7).to(memory_format=torch.channels_last)
    y2, _, _ = _ops.group_norm_fwd(x2, 2, None, None, 1e-5)
    assert y2.stride() == x2.stride() and y2.dtype == x2.dtype
    assert any(like == 0 for _allocate, like in program.allocations)  # empty_like(x)
