"""Recorded calls (cupynorm._ops programs) on the CPU: CPU torch tensors stand in for device arrays
and a fake launcher logs every launch, so the record / replay logic is checked without a GPU.

The GPU tests check the replay against the recorded call's outputs bit for bit
(tests/conftest.py); these pin the bookkeeping itself: what is recorded, what a replay launches
with which pointers, and what is never recorded.
"""

from __future__ import annotations

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


class _CurrentDevice:
    """cupy.cuda.runtime's current-device calls on a machine with device 0 only."""

    @staticmethod
    def getDevice() -> int:
        return 0

    @staticmethod
    def setDevice(device: int) -> None:
        assert device == 0


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
    monkeypatch.setattr(_compile, "_runtime", lambda: _CurrentDevice)
    monkeypatch.setattr(_compile, "has_cooperative_launch", lambda: True)
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


@pytest.mark.parametrize("single", [False, True], ids=["split", "single_launch"])
def test_running_statistics_into_outputs(launches, monkeypatch, single) -> None:
    """running_mean_out / running_var_out (the functional op under torch.compile): the kernel
    reads the old statistics and writes the new ones there; in place it writes where it reads.
    The outputs are in the key's tensors, so a replay writes into the new call's outputs."""
    from cupynorm import _single

    monkeypatch.setattr(_single, "enabled", True if single else None)
    kernel = "single_launch_batch_norm_fwd_cols" if single else "strided_norm_finalize"
    # the running statistics' (source, destination) pointers: (8, 9, -2, -1) in the finalize's
    # arguments, (8, 9, -2, -1) in the single launch's too
    where = (8, 9, -2, -1) if single else (12, 13, -2, -1)
    x, w, b, rm, rv = _bn_cl()
    for _ in range(2):  # recorded, then replayed
        launches.clear()
        outs = torch.empty_like(rm), torch.empty_like(rv)
        _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5, None, "identity", None, False, *outs)
        (args,) = [args for name, *_, args in launches if name == kernel]
        pointers = [t.data_ptr() for t in (rm, rv, *outs)]
        assert [args[i] for i in where] == pointers
    launches.clear()
    _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)
    (args,) = [args for name, *_, args in launches if name == kernel]
    assert [args[i] for i in where] == [t.data_ptr() for t in (rm, rv, rm, rv)]


def test_running_statistics_into_outputs_off_the_kernel(launches, monkeypatch) -> None:
    """Running statistics of another dtype than the kernels' parameters (updated by backend ops,
    not the finalize): the outputs get the old statistics and are updated; the inputs stay."""
    x = torch.rand(4, 6, 3, 3)
    rm, rv = torch.rand(6, dtype=torch.float64), torch.rand(6, dtype=torch.float64)
    old = rm.clone(), rv.clone()
    outs = torch.full_like(rm, float("nan")), torch.full_like(rv, float("nan"))
    updated = []
    backend = _interop.backend_of(x)
    # fmt: off
    monkeypatch.setattr(backend, "update_running",
                        lambda running, stat, momentum: updated.append((running, running.clone())))
    # fmt: on
    _ops.batch_norm_fwd(
        x, None, None, rm, rv, True, 0.1, 1e-5, None, "identity", None, False, *outs
    )
    assert len(updated) == 2 and all(u[0] is out for u, out in zip(updated, outs, strict=True))
    for (_out, before), source in zip(updated, old, strict=True):
        assert torch.equal(before, source)  # holding the old statistics when updated
    assert torch.equal(rm, old[0]) and torch.equal(rv, old[1])
    finalize = [args for kernel, *_, args in launches if kernel == "strided_norm_finalize"]
    assert finalize and finalize[0][12] == 0 and finalize[0][13] == 0  # not in the kernel


def test_batch_counter_is_incremented_by_the_statistics_kernels(launches, monkeypatch) -> None:
    """A module's num_batches_tracked goes to the kernel that updates the running statistics
    (the finalize, or the single launch), is in the program's key and pointers, and is
    incremented by a torch op where no kernel runs (an empty batch)."""
    from cupynorm import _single

    x, w, b, rm, rv = _bn_cl()
    counters = [torch.zeros((), dtype=torch.long) for _ in range(2)]
    for counter in counters:  # the second call replays the first's program
        launches.clear()
        _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5, None, "identity", counter)
        finalize = [args for kernel, *_, args in launches if kernel == "strided_norm_finalize"]
        assert finalize[0][-3] == counter.data_ptr()  # then where the statistics go
    (program,) = _program._PROGRAMS.values()
    assert program is not _program._UNRECORDABLE and program.mutating
    assert [int(c) for c in counters] == [0, 0]  # the fake kernels did not run
    launches.clear()
    _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)  # no counter: a null pointer
    assert [args for kernel, *_, args in launches if kernel == "strided_norm_finalize"][0][-3] == 0

    monkeypatch.setattr(_single, "enabled", True)
    _program._PROGRAMS.clear()  # recorded on the split path (the fixture's own dict)
    launches.clear()
    _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5, None, "identity", counters[0])
    ((kernel, *_, args),) = [launch for launch in launches if launch[0] != "memset"]
    assert kernel == "single_launch_batch_norm_fwd_cols" and args[10] == counters[0].data_ptr()

    launches.clear()
    empty = torch.rand(0, 6, 3, 3)
    _ops.batch_norm_fwd(empty, None, None, rm, rv, True, 0.1, 1e-5, None, "identity", counters[1])
    assert not launches and int(counters[1]) == 1


def test_inference_calls_pass_no_statistics(launches) -> None:
    x = torch.rand(2, 6, 5, 8)
    y, mean, rstd = _ops.group_norm_fwd(x, 2, None, None, 1e-5, want_stats=False)
    assert mean is None and rstd is None and y.shape == x.shape
    ((kernel, _, _, _, args),) = launches
    assert kernel == "segment_norm_fwd_affine"
    assert args[4] == 0 and args[5] == 0  # mean, rstd: null pointers


@pytest.mark.parametrize("hosted", [True, False], ids=["in-y", "own-allocation"])
def test_scratch_buffers_are_one_workspace(launches, hosted) -> None:
    """A replay allocates its outputs and one workspace; each scratch buffer of the recorded call
    is a 256-byte-aligned piece of it, and the pieces do not overlap. The workspace lives in y's
    memory when y is large enough: the statistics are merged before the apply pass writes y."""
    shape = (4, 6, 3, 3) if hosted else (2, 6, 1, 2)  # y: 864 bytes, or 96 (pieces: 2 x 256)
    w, b, rm, rv = torch.rand(6), torch.rand(6), torch.zeros(6), torch.ones(6)
    _ops.batch_norm_fwd(torch.rand(shape), w, b, rm, rv, True, 0.1, 1e-5)
    (program,) = _program._PROGRAMS.values()
    # outputs y, mean, rstd, and (unless y holds it) the workspace for the variance and the
    # partial statistics
    assert len(program.allocations) == (3 if hosted else 4)
    launches.clear()
    x = torch.rand(shape)
    y, mean, rstd = _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)
    known = _pointers(x, w, b, rm, rv, mean, rstd)
    used = [{a for a in args if isinstance(a, int) and a > 4096} - known for *_, args in launches]
    scratch = sorted(set().union(*used[:-1]))
    assert len(scratch) == 2  # the variance and the partial statistics
    assert (scratch[1] - scratch[0]) % 256 == 0  # the second piece starts past the first's
    assert used[-1] == {y.data_ptr()}  # the apply pass, the first and only launch on y
    in_y = [y.data_ptr() <= p < y.data_ptr() + y.numel() * 4 for p in scratch]
    assert in_y == [hosted, hosted]


def test_no_workspace_in_an_output_a_scratch_user_touches(launches, monkeypatch) -> None:
    """The single launch writes y and reads its partials in one kernel; the backward's dx pass
    reads the coefficients u, v (scratch) while writing dx: their workspaces stay apart."""
    from cupynorm import _single

    monkeypatch.setattr(_single, "enabled", True)
    x, w, b, rm, rv = _bn_cl()
    y, mean, rstd = _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)
    dy = torch.rand(x.shape).to(memory_format=torch.channels_last)
    monkeypatch.setattr(_single, "enabled", False)
    _ops.batch_norm_bwd(dy, x, mean, rstd, w, True, (True, True, True))
    fwd, bwd = _program._PROGRAMS.values()
    assert len(fwd.allocations) == 4  # y, mean, rstd, the workspace (partials, counter)
    assert len(bwd.allocations) == 4  # dx, dweight, dbias, the workspace (u, v, partials)


def test_outputs_like_an_input_are_allocated_like_it(launches) -> None:
    x = torch.rand(3, 8, 5, 7).to(memory_format=torch.channels_last)
    _ops.group_norm_fwd(x, 2, None, None, 1e-5)
    (program,) = _program._PROGRAMS.values()
    x2 = torch.rand(3, 8, 5, 7).to(memory_format=torch.channels_last)
    y2, _, _ = _ops.group_norm_fwd(x2, 2, None, None, 1e-5)
    assert y2.stride() == x2.stride() and y2.dtype == x2.dtype
    assert any(like == 0 for _allocate, like in program.allocations)  # empty_like(x)


def test_instance_norm_backward_off_chip_allocates_one_dx(launches) -> None:
    """A plane too long for the on-chip InstanceNorm backward takes the strided passes; the
    on-chip attempt allocates nothing first, so the replay allocates dx once."""
    x = torch.rand(1, 2, 600, 600)  # 1.4 MB planes of fp32: x and dy are over a team's memory
    _y, mean, rstd = _ops.group_norm_fwd(x, 2, None, None, 1e-5)
    _ops.group_norm_bwd(torch.rand_like(x), x, mean, rstd, None, 2, (True, False, False))
    bwd = [p for key, p in _program._PROGRAMS.items() if key[0] == "group_norm_bwd"]
    assert [k for k, *_ in launches][-3:] == [
        "strided_norm_bwd_sums_rows",
        "strided_norm_bwd_finalize",
        "strided_norm_bwd_dx_rows",
    ]
    assert [like for _allocate, like in bwd[0].allocations if like is not None] == [1]  # dx


@pytest.mark.parametrize("act", [None, "silu"], ids=["plain", "silu"])
def test_group_norm_backward_of_an_empty_channels_last_batch(launches, act) -> None:
    """No sample, so no grid to plan: the gradients of the parameters are zeros, no launch."""
    x = torch.rand(0, 8, 3, 3).to(memory_format=torch.channels_last)
    w, b = torch.rand(8), torch.rand(8)
    _y, mean, rstd = _ops.group_norm_fwd(x, 2, w, b, 1e-5)
    dy, needs = torch.rand_like(x), (True, True, True)
    if act is None:
        dx, dw, db = _ops.group_norm_bwd(dy, x, mean, rstd, w, 2, needs)
    else:
        dx, dw, db = _ops.group_norm_act_bwd(dy, x, mean, rstd, w, b, 2, needs, act)
    assert dx.shape == x.shape and dx.stride() == x.stride()
    assert not dw.any() and not db.any() and not launches


# ---- the single-launch family ----------------------------------------------------------------
def _bn_cl(shape=(4, 16, 5, 7)):
    x = torch.rand(shape).to(memory_format=torch.channels_last)
    c = shape[1]
    return x, torch.rand(c), torch.rand(c), torch.zeros(c), torch.ones(c)


def test_batch_norm_channels_last_training_is_one_cooperative_launch(launches, monkeypatch) -> None:
    from cupynorm import _single

    monkeypatch.setattr(_single, "enabled", True)  # off by default (see cupynorm._single)
    x, w, b, rm, rv = _bn_cl()
    y, mean, rstd = _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)
    (memset, *_, zero_args), (kernel, grid, block, smem, args) = launches
    assert memset == "memset" and kernel == "single_launch_batch_norm_fwd_cols"
    arrived = zero_args[0]
    assert zero_args[1] == 1 and args[5] == arrived  # the counter the kernel's barriers use
    assert args[:2] == [x.data_ptr(), y.data_ptr()] and args[6:10] == [
        mean.data_ptr(),
        rstd.data_ptr(),
        rm.data_ptr(),
        rv.data_ptr(),
    ]
    assert 1 <= grid <= 2 * H200.sm_count  # one wave of resident CTAs (the fixture says 2 per SM)
    assert block[0] * block[1] <= _plan.COLS_THREADS and smem > 0
    (program,) = _program._PROGRAMS.values()
    assert program.mutating  # the running statistics are updated in the kernel

    launches.clear()
    dy = torch.rand(x.shape).to(memory_format=torch.channels_last)
    dx, dw, db = _ops.batch_norm_bwd(dy, x, mean, rstd, w, True, (True, True, True))
    assert [k for k, *_ in launches] == ["memset", "single_launch_batch_norm_bwd_cols"]
    args = launches[1][-1]
    assert args[:3] == [x.data_ptr(), dy.data_ptr(), dx.data_ptr()]
    assert args[10:12] == [dw.data_ptr(), db.data_ptr()] and args[8] and args[9]  # u, v
    launches.clear()
    _ops.batch_norm_bwd(dy, x, mean, rstd, w, True, (False, True, True))
    args = launches[1][-1]
    assert args[2] == 0 and args[8] == 0 and args[9] == 0  # no dx: no dx coefficients


@pytest.mark.parametrize(
    "shape, single",
    [
        ((16, 64, 56, 56), True),  # 98 CTAs (88 needed on 132 SMs), 64 channels
        ((4, 16, 5, 7), False),  # one CTA
        ((64, 1024, 14, 14), False),  # 98 CTAs of 8 warps for 1024 channels
    ],
    ids=["fills-the-gpu", "small-grid", "many-channels"],
)
def test_single_launch_backward_by_default_where_it_pays(launches, monkeypatch, shape, single):
    from cupynorm import _single

    x, w, b, rm, rv = _bn_cl(shape)
    y, mean, rstd = _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)
    dy = torch.rand(x.shape).to(memory_format=torch.channels_last)
    for enabled, expected in ((None, single), (False, False)):
        monkeypatch.setattr(_single, "enabled", enabled)
        _program._PROGRAMS.clear()
        launches.clear()
        _ops.batch_norm_bwd(dy, x, mean, rstd, w, True, (True, True, True))
        kernels = [k for k, *_ in launches]
        if expected:
            assert kernels == ["memset", "single_launch_batch_norm_bwd_cols"]
        else:
            assert "single_launch_batch_norm_bwd_cols" not in kernels and len(kernels) == 3


def test_single_launch_is_off_by_default_bounded_and_can_be_turned_off(
    launches, monkeypatch
) -> None:
    from cupynorm import _single

    x, w, b, rm, rv = _bn_cl()
    assert _single.enabled is None  # the measured choice: never the forward
    _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)
    split = ["strided_norm_stats_cols", "strided_norm_finalize", "strided_norm_apply_cols"]
    assert [k for k, *_ in launches] == split
    monkeypatch.setattr(_single, "enabled", True)
    monkeypatch.setattr(_single, "MAX_BYTES", x.numel() * 4 - 1)
    _program._PROGRAMS.clear()  # a replay would repeat the recorded path
    launches.clear()
    _ops.batch_norm_fwd(torch.rand(x.shape).to(memory_format=torch.channels_last), w, b, rm, rv,
                        True, 0.1, 1e-5)  # fmt: skip
    assert [k for k, *_ in launches] == split
    # NCHW and GroupNorm keep their own families
    launches.clear()
    _ops.batch_norm_fwd(torch.rand(4, 16, 5, 7), w, b, rm, rv, True, 0.1, 1e-5)
    assert not any(k.startswith("single_launch") for k, *_ in launches)


def test_refused_cooperative_launch_falls_back_to_the_split_passes(launches, monkeypatch) -> None:
    from cupynorm import _single

    class Refused(RuntimeError):
        status = _compile.CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE

    class RefusingLauncher:
        def __init__(self, kernel: str) -> None:
            self.kernel = kernel

        def launch(self, grid, block, smem, stream, args) -> None:
            if self.kernel.startswith("single_launch"):
                raise Refused("too large")
            launches.append((self.kernel, grid, tuple(block), smem, [int(a) for a in args]))

    monkeypatch.setattr(_compile, "launcher", lambda dev, src, kernel, *r: RefusingLauncher(kernel))
    monkeypatch.setattr(_single, "_refused", set())
    monkeypatch.setattr(_single, "enabled", True)
    x, w, b, rm, rv = _bn_cl()
    _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)
    assert [k for k, *_ in launches][-3:] == [
        "strided_norm_stats_cols",
        "strided_norm_finalize",
        "strided_norm_apply_cols",
    ]
    assert list(_program._PROGRAMS.values()) == [_program._UNRECORDABLE]
    assert len(_single._refused) == 1
    launches.clear()
    _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)  # not tried again
    assert [k for k, *_ in launches] == [
        "strided_norm_stats_cols",
        "strided_norm_finalize",
        "strided_norm_apply_cols",
    ]


@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "noadd"])
def test_fused_batch_norm_launches_the_fused_passes(launches, with_residual) -> None:
    """act(bn(x) + z): the fused apply in the forward; in the backward the fused sums, then the
    plain dx on dt (written, the residual's gradient) or the fused dx (dt never stored)."""
    x, w, b, rm, rv = _bn_cl()
    z = torch.rand(x.shape).to(memory_format=torch.channels_last) if with_residual else None
    y, mean, rstd = _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5, z, "relu")
    apply = "fused_norm_apply_cols_add_relu" if with_residual else "fused_norm_apply_cols_relu"
    assert [k for k, *_ in launches] == ["strided_norm_stats_cols", "strided_norm_finalize", apply]
    assert launches[2][-1][-2:] == [z.data_ptr() if with_residual else 0, 0]  # residual, shift
    launches.clear()
    dy = torch.rand(x.shape).to(memory_format=torch.channels_last)
    needs = (True, True, True, with_residual)
    dx, dw, db, dz = _ops.batch_norm_act_bwd(dy, x, mean, rstd, w, True, needs, z, b, "relu")
    kernels = [k for k, *_ in launches]
    dx_kernel = "strided_norm_bwd_dx_cols" if with_residual else "fused_norm_bwd_dx_cols_relu"
    assert kernels == ["fused_norm_bwd_sums_cols_relu", "strided_norm_bwd_finalize", dx_kernel]
    sums_args, dx_args = launches[0][-1], launches[2][-1]
    assert (dz is not None) == with_residual
    if with_residual:  # the sums pass writes dt = dz, which the plain dx pass reads as its dy
        assert sums_args[-6:-4] == [z.data_ptr(), dz.data_ptr()]
        assert dx_args[1] == dz.data_ptr() and dx_args[4] == 0
    else:  # nothing stored: the fused dx reads dy and the forward's bias (t is recomputed)
        assert sums_args[-6:-4] == [0, 0]
        assert dx_args[1] == dy.data_ptr() and dx_args[4] == b.data_ptr()
    assert dx_args[2] == dx.data_ptr()
    # the identity: the plain backward on dy, which is the residual's gradient itself
    launches.clear()
    grads = _ops.batch_norm_act_bwd(dy, x, mean, rstd, w, True, needs, z, b, "identity")
    assert not any(k.startswith("fused") for k, *_ in launches)
    assert (grads[3] is dy) == with_residual


@pytest.mark.parametrize(
    "dtype, shape, kept",
    [
        (torch.bfloat16, (4, 16, 5, 7), True),
        (torch.float32, (4, 16, 5, 7), False),  # packs of 4: no mask layout
        (torch.bfloat16, (4, 12, 5, 7), False),  # 12 channels: not packs of 8
    ],
    ids=["bf16", "fp32", "unaligned-channels"],
)
def test_relu_with_a_residual_keeps_a_mask_for_the_backward(launches, dtype, shape, kept) -> None:
    """act(bn(x) + z) with ReLU on 16-byte packs of 8: the apply pass also writes the ReLU's mask
    (a bit per element), and the backward's sums pass reads it in the residual's place (z null);
    elsewhere no mask, and the backward reads the residual."""
    x, w, b, rm, rv = _bn_cl(shape)
    x = x.to(dtype)
    z = torch.rand(x.shape, dtype=dtype).to(memory_format=torch.channels_last)
    y, mean, rstd, mask = _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5, z, "relu", None,
                                              True)  # fmt: skip
    apply = launches[-1]
    if not kept:
        assert mask is None and apply[0] == "fused_norm_apply_cols_add_relu"
        return
    assert apply[0] == "fused_norm_apply_cols_add_relu_mask" and apply[-1][-1] == mask.data_ptr()
    assert mask.dtype == torch.uint8 and mask.numel() * 8 == x.numel()
    launches.clear()
    dy = torch.rand(x.shape, dtype=dtype).to(memory_format=torch.channels_last)
    needs = (True, True, True, True)
    dx, _dw, _db, dz = _ops.batch_norm_act_bwd(dy, x, mean, rstd, w, True, needs, None, b, "relu",
                                               mask)  # fmt: skip
    kernels = [k for k, *_ in launches]
    assert kernels == [
        "fused_norm_bwd_sums_cols_relu_mask",
        "strided_norm_bwd_finalize",
        "strided_norm_bwd_dx_cols",  # the plain dx pass on dt, the residual's gradient
    ]
    sums = launches[0][-1]
    assert sums[-1] == mask.data_ptr() and sums[-7:-5] == [0, dz.data_ptr()]  # z null, dt
    assert launches[2][-1][1] == dz.data_ptr() and launches[2][-1][2] == dx.data_ptr()


@pytest.mark.parametrize("empty", [False, True], ids=["rows", "empty-rank"])
def test_sync_batch_norm_steps_are_one_launch_each_around_the_collectives(launches, empty) -> None:
    """SyncBatchNorm's CUDA calls: the rank's row after the statistics passes (an empty rank:
    the row kernel alone, count 0, no statistics); the merge, then the apply with its mean and
    rstd; the dx coefficients from the summed (P, Q) and the merged count, then the dx pass."""
    x, w, b, rm, rv = _bn_cl((0 if empty else 4, 16, 5, 7))
    (rows,) = _ops.sync_batch_norm_rows(x, 1, 3)
    assert rows.shape == (3, 33) and rows.dtype == torch.float64
    kernels = [k for k, *_ in launches]
    stats = [] if empty else ["strided_norm_stats_cols", "strided_norm_finalize"]
    assert kernels == [*stats, "sync_norm_pack_row"]
    mean_ptr, var_ptr, rows_ptr, c, world, rank, count = launches[-1][-1]
    assert (rows_ptr, c, world, rank, count) == (rows.data_ptr(), 16, 3, 1, 0 if empty else 140)
    if empty:
        assert mean_ptr == var_ptr == 0
    else:  # the finalize's mean and var outputs are what the row kernel reads
        finalize_args = launches[1][-1]
        assert mean_ptr == finalize_args[5] and var_ptr == finalize_args[7]
    launches.clear()
    # the merge (running statistics in place: a mutating program), then the apply
    y, mean, rstd, count = _ops.sync_batch_norm_merge_apply(x, rows, w, b, rm, rv, 1e-5, 0.1)
    kernels = [k for k, *_ in launches]
    assert kernels == ["sync_norm_merge"] + ([] if empty else ["strided_norm_apply_cols"])
    args = launches[0][-1]
    assert args[:3] == [rows.data_ptr(), 16, 3] and args[-2:] == [rm.data_ptr(), rv.data_ptr()]
    assert y.shape == x.shape and mean.shape == rstd.shape == (16,)
    assert count.shape == (1,) and count.dtype == torch.float64
    assert [p for p in _program._PROGRAMS.values() if p.mutating]
    if empty:
        return
    assert {mean.data_ptr(), rstd.data_ptr()} <= set(launches[1][-1])  # what the apply reads
    launches.clear()
    # the coefficients into scratch, read by the dx pass
    totals, dy = torch.rand(2, 16), torch.rand(x.shape).to(memory_format=torch.channels_last)
    (dx,) = _ops.sync_batch_norm_bwd_dx(dy, x, mean, rstd, w, totals, count)
    kernels = [k for k, *_ in launches]
    assert kernels == ["sync_norm_bwd_coeffs", "strided_norm_bwd_dx_cols"]
    coeffs, dx_args = launches[0][-1], launches[1][-1]
    ptrs = [totals.data_ptr(), rstd.data_ptr(), w.data_ptr(), count.data_ptr(), 16]
    assert coeffs[:5] == ptrs
    assert set(coeffs[5:]) <= set(dx_args) and dx.data_ptr() in dx_args


@pytest.mark.parametrize("fmt", ["contiguous", "channels_last"])
def test_fused_group_norm_launches_the_fused_passes(launches, fmt) -> None:
    """silu(group_norm(x)): NCHW groups on chip in one launch (the SiLU segment kernel), other
    layouts and activations the strided passes with the fused apply; the backward is the strided
    one with the fused sums and dx, which read the forward's bias (t is recomputed)."""
    memory_format = torch.channels_last if fmt == "channels_last" else torch.contiguous_format
    x = torch.rand(2, 8, 5, 8).to(memory_format=memory_format)
    w, b = torch.rand(8), torch.rand(8)
    y, mean, rstd = _ops.group_norm_fwd(x, 4, w, b, 1e-5, act="silu")
    layout = "rows" if fmt == "contiguous" else "cols"
    if fmt == "contiguous":
        assert [k for k, *_ in launches] == ["segment_norm_fwd_affine_silu"]
        assert launches[0][-1][:4] == [x.data_ptr(), y.data_ptr(), w.data_ptr(), b.data_ptr()]
    else:
        stats = "strided_norm_stats_cols"
        apply = "fused_norm_apply_cols_silu"
        assert [k for k, *_ in launches] == [stats, "strided_norm_finalize", apply]
    launches.clear()
    _ops.group_norm_fwd(x, 4, w, b, 1e-5, act="relu")  # no on-chip ReLU: the strided passes
    assert launches[-1][0] == f"fused_norm_apply_{layout}_relu"
    launches.clear()
    dy = torch.rand(x.shape).to(memory_format=memory_format)
    dx, dw, db = _ops.group_norm_act_bwd(dy, x, mean, rstd, w, b, 4, (True, True, True), "silu")
    kernels = [k for k, *_ in launches]
    assert kernels == [
        f"fused_norm_bwd_sums_{layout}_silu",
        "strided_norm_bwd_finalize",
        f"fused_norm_bwd_dx_{layout}_silu",
    ]
    sums_args, dx_args = launches[0][-1], launches[2][-1]
    assert sums_args[-6:] == [0, 0, w.data_ptr(), b.data_ptr(), rstd.data_ptr(), 0]
    assert dx_args[:5] == [x.data_ptr(), dy.data_ptr(), dx.data_ptr(), w.data_ptr(), b.data_ptr()]
    # the identity: the plain group norm passes
    launches.clear()
    _ops.group_norm_fwd(x, 4, w, b, 1e-5, act="identity")
    _ops.group_norm_act_bwd(dy, x, mean, rstd, w, b, 4, (True, True, True), "identity")
    assert not any(k.startswith("fused") or k.endswith("silu") for k, *_ in launches)


def test_fused_group_norm_long_segments_take_the_strided_passes(launches) -> None:
    """A group too long for a team of CTAs: the strided statistics, then the fused apply."""
    x = torch.rand(1, 1, 1200, 1000)  # 4.8 MB of fp32 in one group
    _ops.group_norm_fwd(x, 1, None, None, 1e-5, act="silu")
    kernels = [k for k, *_ in launches]
    assert kernels == [
        "strided_norm_stats_rows",
        "strided_norm_finalize",
        "fused_norm_apply_rows_silu",
    ]


@pytest.mark.parametrize("case", ["on-chip", "channels_last", "long"])
def test_group_norm_shift_reaches_every_pass(launches, case) -> None:
    """group_norm(x + shift[n, c]): the on-chip _shift kernel, or every strided pass but the
    finalize, gets the shift as its last argument; long NCHW groups are reduced in runs of one
    channel each (the shift is per run)."""
    shape = (1, 2, 1200, 1000) if case == "long" else (2, 8, 5, 8)
    x = torch.rand(shape)
    if case == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    (N, C), S = shape[:2], shape[2] * shape[3]
    G = 1 if case == "long" else 4
    w, b, shift = torch.rand(C), torch.rand(C), torch.rand(N, C)
    y, mean, rstd = _ops.group_norm_fwd(x, G, w, b, 1e-5, shift, act="silu")
    kernels = [k for k, *_ in launches]
    if case == "on-chip":
        assert kernels == ["segment_norm_fwd_affine_silu_shift"]
        assert launches[0][-1][-1] == shift.data_ptr()
    else:
        assert kernels[1] == "strided_norm_finalize" and len(kernels) == 3
        assert launches[0][-1][-1] == shift.data_ptr() == launches[2][-1][-1]
    if case == "long":  # (x, partials, n_runs, run_len, run_stride, set_stride, ...)
        assert launches[0][-1][2:6] == [C // G, S, S, C // G * S]
    launches.clear()
    dy = torch.rand_like(x)
    _ops.group_norm_act_bwd(dy, x, mean, rstd, w, b, G, (True, True, True), "silu", shift)
    sums, finalize, dx = launches
    assert finalize[0] == "strided_norm_bwd_finalize"
    assert sums[-1][-1] == shift.data_ptr() == dx[-1][-1]
    # without a shift, a null in its place
    launches.clear()
    _ops.group_norm_fwd(x, G, w, b, 1e-5, act="silu")
    assert launches[0][-1][-1] == 0


# ---- a replay launches exactly what the full path launches ----------------------------------
def _cl(*shape):
    return torch.rand(shape).to(memory_format=torch.channels_last)


def _recorded_calls():
    """(op, arguments maker) of recorded calls across the families, with workspaces (partials
    at offsets), constants of every type and pointers in every position."""
    c = 16
    w, b, rm, rv = torch.rand(c), torch.rand(c), torch.zeros(c), torch.ones(c)
    stats = (torch.rand(c), torch.rand(c))
    mask = (True, True, True)
    return {
        "bn-fwd-cl": (_ops.batch_norm_fwd, lambda: (_cl(4, c, 5, 7), w, b, rm, rv, True, 0.1,
                                                    1e-5)),
        "bn-fwd-nchw": (
            _ops.batch_norm_fwd,
            lambda: (torch.rand(4, c, 5, 7), w, b, rm, rv, True, 0.1, 1e-5),
        ),
        "bn-fwd-eval": (_ops.batch_norm_fwd, lambda: (_cl(4, c, 5, 7), w, b, rm, rv, False, 0.1,
                                                      1e-5)),
        "bn-bwd-cl": (
            _ops.batch_norm_bwd,
            lambda: (_cl(4, c, 5, 7), _cl(4, c, 5, 7), *stats, w, True, mask),
        ),
        "bn-act-bwd": (
            _ops.batch_norm_act_bwd,
            lambda: (_cl(4, c, 5, 7), _cl(4, c, 5, 7), *stats, w, True, (*mask, True),
                     _cl(4, c, 5, 7), b, "relu"),
        ),
        "gn-fwd-team": (_ops.group_norm_fwd, lambda: (torch.rand(2, 4, 256, 256), 2, None, None,
                                                      1e-5)),
        "gn-act-fwd-shift-cl": (_ops.group_norm_fwd, lambda: (_cl(2, 8, 5, 8), 2, w[:8], b[:8],
                                                              1e-5, torch.rand(2, 8))),
        "gn-act-bwd-shift": (
            _ops.group_norm_act_bwd,
            lambda: (torch.rand(2, 8, 5, 8), torch.rand(2, 8, 5, 8), torch.rand(2, 2),
                     torch.rand(2, 2), w[:8], b[:8], 2, mask, "silu", torch.rand(2, 8)),
        ),
        "gn-bwd": (
            _ops.group_norm_bwd,
            lambda: (torch.rand(2, 8, 5, 8), torch.rand(2, 8, 5, 8), torch.rand(2, 2),
                     torch.rand(2, 2), torch.rand(8), 2, mask),
        ),
        "row-fwd": (
            _ops.row_norm_fwd,
            lambda: (torch.rand(6, 64), None, torch.rand(64), torch.rand(64), 64, 1e-5, False),
        ),
        "row-bwd": (
            _ops.row_norm_bwd,
            lambda: (torch.rand(6, 64), None, torch.rand(6, 64), torch.rand(6), torch.rand(6),
                     torch.rand(64), 64, mask),
        ),
    }  # fmt: skip


def _symbolic(log: list, tensors: list, outputs: tuple) -> list:
    """The launches with every pointer named after what it points at: the call's tensors by
    position, then its outputs, any other (scratch) by order of first use."""
    names = {t.data_ptr(): f"out{j}" for j, t in enumerate(outputs) if t is not None}
    names.update({t.data_ptr(): f"in{i}" for i, t in enumerate(tensors)})
    scratch: dict[int, str] = {}
    rows = []
    for kernel, grid, block, smem, values, codes in log:
        row = [
            (names.get(v) or scratch.setdefault(v, f"scratch{len(scratch)}"))
            if code == "Q" and v
            else v
            for v, code in zip(values, codes, strict=True)
        ]
        rows.append((kernel, grid, block, smem, row))
    return rows


@pytest.mark.parametrize("case", list(_recorded_calls()))
def test_replay_launches_what_the_full_path_launches(launches, monkeypatch, case) -> None:
    log: list = []

    class Logged:
        def __init__(self, kernel: str, codes: str) -> None:
            self.kernel, self.codes = kernel, codes

        def launch(self, grid, block, smem, stream, args) -> None:
            values = [a.item() if hasattr(a, "item") else a for a in args]
            log.append((self.kernel, grid, tuple(block), smem, values, self.codes))

    monkeypatch.setattr(_compile, "launcher", lambda dev, src, k, *rest: Logged(k, rest[-1]))
    # scratch in its own workspace, as the full path allocates it (in an output's memory:
    # test_scratch_buffers_are_one_workspace)
    monkeypatch.setattr(_program._Recording, "_host", lambda *args: None)
    op, make = _recorded_calls()[case]
    op(*make())  # recorded
    (program,) = _program._PROGRAMS.values()
    assert isinstance(program, _program._Program)
    args = make()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    log.clear()
    replayed = op(*args)
    replay = _symbolic(log, tensors, replayed)
    _program._PROGRAMS.clear()
    log.clear()
    full = op(*args)  # the full path on the same arguments
    assert replay == _symbolic(log, tensors, full)
    assert [None if t is None else (t.shape, t.stride(), t.dtype) for t in replayed] == [
        None if t is None else (t.shape, t.stride(), t.dtype) for t in full
    ]


# ---- the backward bound at forward time (eager autograd.Functions) ---------------------------
def route_eager_to_host_code(setattr=setattr) -> None:
    """Send the modules' eager path on CPU tensors through the CUDA host code (the Functions'
    kernels, the no-grad calls' kernels); ``setattr``: monkeypatch's, or the plain one (the
    development scripts)."""
    from torch_cpu_helpers import patch_route

    from cupynorm.torch import (
        _batch_norm,
        _batch_norm_kernels,
        _channel_norm,
        _group_norm,
        _row_norm,
    )

    patch_route(setattr, "_use_kernels", lambda x, kind: True)
    bn_kernels = _batch_norm_kernels
    setattr(_batch_norm, "_batch_norm_fwd_program", bn_kernels._batch_norm_fwd_cuda_program)
    setattr(_batch_norm, "_batch_norm_bwd", bn_kernels._batch_norm_bwd_cuda)
    setattr(_batch_norm, "_batch_norm_act_bwd", bn_kernels._batch_norm_act_bwd_cuda)
    for family, name in (  # the full Functions, each in its family's module with its kernels
        (_group_norm, "group_norm"),
        (_group_norm, "group_norm_act"),
        (_row_norm, "row_norm"),
        (_channel_norm, "channel_norm"),
    ):
        setattr(family, f"_{name}_fwd", getattr(family, f"_{name}_fwd_cuda"))
        # the backwards pick the CPU's kernel by device (some inside closures made at import)
        setattr(family, f"_{name}_bwd_reference", getattr(family, f"_{name}_bwd_cuda"))

    def output(fwd, pick):  # the no-grad calls' kernels
        return lambda *args: fwd(*args, want_stats=False)[pick]

    setattr(_group_norm, "_group_norm_output", output(_group_norm._group_norm_fwd_cuda, 0))
    setattr(_group_norm, "_group_norm_act_output", output(_group_norm._group_norm_act_fwd_cuda, 0))
    setattr(_row_norm, "_row_norm_output", output(_row_norm._row_norm_fwd_cuda, slice(0, 2)))
    setattr(_channel_norm, "_channel_norm_output", output(_channel_norm._channel_norm_fwd_cuda, 0))


@pytest.fixture
def eager(launches, monkeypatch):
    """The modules' eager path on the CUDA host code (CPU tensors, the launch log), and a count
    of the call keys built (the backward bound to its forward builds none)."""
    route_eager_to_host_code(monkeypatch.setattr)
    keys: list = []
    call_key = _interop.TorchBackend.call_key

    def counting(self, key, args):
        keys.append(key[0])
        return call_key(self, key, args)

    monkeypatch.setattr(_interop.TorchBackend, "call_key", counting)
    return launches, keys


def _step(module, x, dy, *residual):
    x = x.detach().requires_grad_()
    y = module(x, *residual)
    y.backward(dy)
    return y


@pytest.mark.parametrize("act", [False, True], ids=["bn", "bn-act"])
def test_backward_bound_at_forward_builds_no_key_and_launches_the_same(eager, act) -> None:
    import cupynorm.torch as cnt

    log, keys = eager
    module = cnt.BatchNormAct2d(16) if act else cnt.BatchNorm2d(16)
    shape = (4, 16, 5, 7)
    residual = (_cl(*shape),) if act else ()
    _step(module, _cl(*shape), _cl(*shape), *residual)  # both directions recorded
    _step(module, _cl(*shape), _cl(*shape), *residual)  # the backward binds (first time)
    keys.clear()
    log.clear()
    x, dy = _cl(*shape), _cl(*shape)
    y = _step(module, x, dy, *residual)
    forward_name = "batch_norm_fwd"
    assert keys == [forward_name]  # the backward built no key
    assert y.grad_fn.bound is None  # the forward's references are dropped by the backward
    bound = log[-3:]
    # the same backward through the full path (no recorded programs)
    _program._PROGRAMS.clear()
    log.clear()
    _step(module, x, dy, *residual)
    full = log[-3:]
    assert [(k, g, b, s) for k, g, b, s, _ in bound] == [(k, g, b, s) for k, g, b, s, _ in full]
    backward = "batch_norm_act_bwd" if act else "batch_norm_bwd"
    assert any(key[0] == backward for key in _program._PROGRAMS)


def test_bound_backward_binds_each_layout_of_dy_and_checks_alignments(eager) -> None:
    """dy with other strides (a size-1 dimension's stride: still channels_last for torch) than
    the bound call's: a bound call of its own, whose op copies dy to x's layout (never
    recorded: the op's own key each time), and the first layout's bound call stays; dy of
    another alignment: the op's own key."""
    import cupynorm.torch as cnt

    log, keys = eager
    module = cnt.BatchNorm2d(8)
    shape = (2, 8, 1, 5)
    for _ in range(3):
        _step(module, _cl(*shape), _cl(*shape))
    programs = len(_program._PROGRAMS)

    def strided():
        dy = torch.rand(80).as_strided((2, 8, 1, 5), (40, 1, 1, 8))  # H's stride 1, not 40
        assert dy.is_contiguous(memory_format=torch.channels_last)
        assert dy.stride() != _cl(*shape).stride()
        return dy

    keys.clear()
    _step(module, _cl(*shape), strided())
    assert keys == ["batch_norm_fwd", "batch_norm_bwd", "batch_norm_bwd"]  # bound, the op
    assert len(_program._PROGRAMS) == programs + 1  # the key of dy's layout: unrecordable
    keys.clear()
    _step(module, _cl(*shape), strided())
    assert keys == ["batch_norm_fwd", "batch_norm_bwd"]
    # the bound layout, 4-byte aligned
    offset = torch.rand(2 * 8 * 5 + 1)[1:].as_strided(shape, _cl(*shape).stride())
    assert offset.data_ptr() % 16
    keys.clear()
    _step(module, _cl(*shape), offset)
    assert keys == ["batch_norm_fwd", "batch_norm_bwd"]
    keys.clear()
    _step(module, _cl(*shape), _cl(*shape))  # the first bound call again
    assert keys == ["batch_norm_fwd"]


def test_layers_sharing_a_program_bind_the_layouts_of_their_dy(eager) -> None:
    """Layers of one shape share their forward's program (and its bound calls): in a chain the
    first backward is the last layer's, whose dy (the loss's gradient) may be laid out
    otherwise than the others'; the others still replay without a key."""
    import cupynorm.torch as cnt

    log, keys = eager
    chain = torch.nn.Sequential(*(cnt.BatchNorm2d(8) for _ in range(3)))
    shape = (2, 8, 3, 5)

    def step():
        x = _cl(*shape).requires_grad_()
        chain(x).backward(torch.rand(shape))  # contiguous: not x's layout

    for _ in range(3):
        step()
    keys.clear()
    step()
    # the last layer's backward: the op takes dy laid out otherwise (a copy: never recorded)
    assert keys == ["batch_norm_fwd"] * 3 + ["batch_norm_bwd"]


def test_bound_backward_does_not_outlive_a_cleared_cache(eager) -> None:
    import cupynorm.torch as cnt

    log, keys = eager
    module = cnt.BatchNorm2d(8)
    for _ in range(3):
        _step(module, _cl(2, 8, 3, 5), _cl(2, 8, 3, 5))
    x = _cl(2, 8, 3, 5).requires_grad_()
    y = module(x)
    _program._PROGRAMS.clear()  # e.g. _single.enable(): recorded paths are forgotten
    keys.clear()
    y.backward(_cl(2, 8, 3, 5))
    assert keys == ["batch_norm_bwd"]  # the bound call's program is gone: the full path
    assert any(key[0] == "batch_norm_bwd" for key in _program._PROGRAMS)


def test_saved_tensor_hooks_unbind_the_backward(eager) -> None:
    """Saved-tensor hooks hand the backward other tensors (here contiguous copies, as
    save_on_cpu does): the backward takes its own key. Under hooks active at the forward the
    forward keeps no references (the hooks are there to let the tensors go)."""
    import cupynorm.torch as cnt

    log, keys = eager
    module = cnt.BatchNorm2d(8)
    shape = (2, 8, 3, 5)
    for _ in range(3):
        _step(module, _cl(*shape), _cl(*shape))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous(), lambda t: t):
        x = _cl(*shape).requires_grad_()
        y = module(x)
    assert y.grad_fn.bound is None
    keys.clear()
    y.backward(_cl(*shape))
    assert keys == ["batch_norm_bwd"]
    # a hook on the saved tensors registered after the forward (kept references, other tensors)
    x = _cl(*shape).requires_grad_()
    y = module(x)
    assert y.grad_fn.bound is not None
    for saved in y.grad_fn._raw_saved_tensors[:4]:  # x, weight, mean, rstd (the rest: None)
        saved.register_hooks(lambda t: t.clone(), lambda t: t)
    keys.clear()
    log.clear()
    y.backward(_cl(*shape))
    assert keys == ["batch_norm_bwd"]


# ---- replayed eager calls (cupynorm.torch._replay) -------------------------------------------
def _node(y) -> str:
    return type(y.grad_fn).__name__


@pytest.mark.parametrize(
    "act, residual",
    [("identity", False), ("relu", False), ("relu", True), ("silu", False), ("identity", True)],
)
def test_a_checked_call_is_replayed_with_the_full_paths_launches(eager, act, residual) -> None:
    """The first call of a module takes the full path (checks, Function, dense layouts); later
    calls with the same key replay its program through a Function of their own: one call key
    (the forward's), and the same launches in both directions as the full path."""
    import cupynorm.torch as cnt

    log, keys = eager
    module = cnt.BatchNormAct2d(16, activation=act) if act != "identity" or residual else None
    module = module or cnt.BatchNorm2d(16)
    shape = (4, 16, 5, 7)
    z = (_cl(*shape).requires_grad_(),) if residual else ()
    y = _step(module, _cl(*shape), _cl(*shape), *z)
    assert _node(y).startswith(("_BatchNormFunction", "_BatchNormActFunction"))
    _step(module, _cl(*shape), _cl(*shape), *z)  # the backward binds
    keys.clear()
    log.clear()
    x, dy = _cl(*shape), _cl(*shape)
    y = _step(module, x, dy, *z)
    assert _node(y) == "_ReplayFunctionBackward"
    assert keys == ["batch_norm_fwd"]
    assert y.grad_fn.bound is None  # dropped by the backward
    replayed = log[:]
    _program._PROGRAMS.clear()  # the validations go with the programs
    log.clear()
    y = _step(module, x, dy, *z)
    assert _node(y) != "_ReplayFunctionBackward"
    assert [(k, g, b, s) for k, g, b, s, _ in replayed] == [(k, g, b, s) for k, g, b, s, _ in log]


def test_replay_without_grad_runs_the_program_alone(eager) -> None:
    import cupynorm.torch as cnt

    log, keys = eager
    module = cnt.BatchNorm2d(16)
    x = _cl(4, 16, 5, 7)
    with torch.no_grad():
        module(x)  # validates the no-grad call (no autograd node: a key of its own)
        keys.clear()
        log.clear()
        y = module(x)
    assert y.grad_fn is None and keys == ["batch_norm_fwd"]
    replayed = log[:]
    _program._PROGRAMS.clear()
    log.clear()
    with torch.no_grad():
        module(x)
    assert [entry[:4] for entry in replayed] == [entry[:4] for entry in log]


def test_only_calls_that_passed_the_checks_as_given_are_replayed(eager) -> None:
    """A program recorded by the host op directly (no torch checks) is not replayed, and
    neither is a call whose input the full path copies into a dense layout."""
    import cupynorm.torch as cnt

    module = cnt.BatchNorm2d(16)
    x = _cl(4, 16, 5, 7).requires_grad_()
    vectors = (module.weight.detach(), module.bias.detach(), module.running_mean)
    stats = (module.running_var, True, 0.1, 1e-5, None, "identity", module.num_batches_tracked)
    args = (x.detach(), *vectors, *stats)
    _ops.batch_norm_fwd(*args)
    key = _program._call_key("batch_norm_fwd", args, {})[1]
    assert isinstance(_program._PROGRAMS.get(key), _program._Program)
    assert _node(module(x)).startswith("_BatchNormFunction")
    assert _node(module(x)) == "_ReplayFunctionBackward"  # checked by the call before
    strided = torch.rand(4, 16, 5, 14)[..., ::2].requires_grad_()  # not dense: copied
    for _ in range(3):
        assert _node(module(strided)).startswith("_BatchNormFunction")


def test_replayed_backward_raises_torchs_error_for_an_input_modified_in_place(eager) -> None:
    """The replay saves its tensors with save_for_backward: an input changed in place after
    the forward fails the backward as torch's own BatchNorm2d does."""
    import cupynorm.torch as cnt

    module = cnt.BatchNorm2d(16)
    for _ in range(2):
        _step(module, _cl(4, 16, 5, 7), _cl(4, 16, 5, 7))
    errors = []
    for layer in (torch.nn.BatchNorm2d(16), module):
        x = _cl(4, 16, 5, 7).requires_grad_()
        h = x * 1
        y = layer(h)
        h.add_(1)
        with pytest.raises(RuntimeError) as error:
            y.backward(_cl(4, 16, 5, 7))
        errors.append(str(error.value).split(";")[0].split(":")[0])
    assert _node(y) == "_ReplayFunctionBackward"
    assert errors[0] == errors[1], errors


# ---- replayed group norm and row norm calls --------------------------------------------------
def _norm_calls():
    """name -> (the call's forward op, a maker of (callable, inputs, extra tensor arguments)):
    group and row norm calls through the modules and the functional API."""
    import cupynorm.torch as cnt

    def module(make, *shape, fmt=torch.contiguous_format, extra=()):
        return lambda: (make(), torch.rand(shape).to(memory_format=fmt), [f() for f in extra])

    def shift():
        return torch.rand(4, 16)

    def residual():
        return torch.rand(6, 5, 32)

    def rows(fn, *args):  # a functional row norm with a residual: (out, sum)
        return lambda x, r: fn(x, r, *args)

    w = torch.rand(32, requires_grad=True)
    return {
        "group_norm": ("group_norm_fwd", module(lambda: cnt.GroupNorm(4, 16), 4, 16, 5, 7)),
        "group_norm-cl": (
            "group_norm_fwd",
            module(lambda: cnt.GroupNorm(4, 16), 4, 16, 5, 7, fmt=torch.channels_last),
        ),
        "group_norm_act-shift": (
            "group_norm_fwd",
            module(lambda: cnt.GroupNormAct(4, 16), 4, 16, 5, 7, extra=(shift,)),
        ),
        "layer_norm": ("row_norm_fwd", module(lambda: cnt.LayerNorm(32), 6, 5, 32)),
        "layer_norm-2-dims": ("row_norm_fwd", module(lambda: cnt.LayerNorm((5, 32)), 6, 5, 32)),
        "layer_norm-bias-only": (
            "row_norm_fwd",
            module(lambda: lambda x: cnt.layer_norm(x, 32, None, w.detach() + 0), 6, 5, 32),
        ),
        "rms_norm": ("row_norm_fwd", module(lambda: cnt.RMSNorm(32), 6, 5, 32)),
        "llama_rms_norm": ("row_norm_fwd", module(lambda: cnt.LlamaRMSNorm(32), 6, 5, 32)),
        "add_layer_norm": (
            "row_norm_fwd",
            module(lambda: rows(cnt.add_layer_norm, 32, w), 6, 5, 32, extra=(residual,)),
        ),
        "add_rms_norm": (
            "row_norm_fwd",
            module(lambda: rows(cnt.add_rms_norm, 32, w), 6, 5, 32, extra=(residual,)),
        ),
    }


def _norm_step(fn, x, extra, dys):
    """One forward + backward: (the first output, its tensors' and the gradients' metadata)."""
    x = x.detach().requires_grad_()
    extra = [t.detach().requires_grad_() for t in extra]
    out = fn(x, *extra)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, dys[: len(outs)])
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    grads = [t.grad for t in (x, *extra, *params)]
    for p in params:
        p.grad = None
    meta = [None if t is None else (t.shape, t.stride(), t.dtype) for t in (*outs, *grads)]
    return outs[0], meta


def _full_path_after_replay(log, replayed_meta, step):
    """Drop the programs (their validations go with them) and run ``step`` again, now on the
    full path: the launches the replay logged (kernel, grid, block, shared memory) and outputs
    and gradients of the replay's metadata. Returns the full path's output."""
    replayed = log[:]
    _program._PROGRAMS.clear()
    log.clear()
    y, full_meta = step()
    assert [(k, g, b, s) for k, g, b, s, _ in replayed] == [(k, g, b, s) for k, g, b, s, _ in log]
    assert replayed_meta == full_meta
    return y


@pytest.mark.parametrize("case", list(_norm_calls()))
def test_group_and_row_norm_calls_are_replayed_with_the_full_paths_launches(eager, case) -> None:
    """As batch norm's: the first call takes the full path; later calls of the key replay its
    program (one call key, the forward's, once the backward is bound) with the full path's
    launches in both directions, outputs and gradients of the full path's shapes, strides and
    dtypes."""
    log, keys = eager
    forward, make = _norm_calls()[case]
    fn, x, extra = make()
    dys = [torch.rand_like(x), torch.rand_like(x)]  # laid out as x, as a model's would be
    y, _ = _norm_step(fn, x, extra, dys)
    assert _node(y) != "_ReplayFunctionBackward"
    _norm_step(fn, x, extra, dys)  # replayed; the backward binds
    keys.clear()
    log.clear()
    y, replayed_meta = _norm_step(fn, x, extra, dys)
    assert _node(y) == "_ReplayFunctionBackward"
    # the backward is bound (a residual form's too: the sum's gradient is a second free tensor,
    # the sum a saved output, matched by pointer and layout): no key of its own
    assert keys == [forward]
    assert y.grad_fn.bound is None  # dropped by the backward
    y = _full_path_after_replay(log, replayed_meta, lambda: _norm_step(fn, x, extra, dys))
    assert _node(y) != "_ReplayFunctionBackward"


@pytest.mark.parametrize("make", ["LayerNorm2d", "RMSNorm2d"])
def test_channel_norms_on_channels_last_are_replayed_as_their_rows(eager, make) -> None:
    """A channel norm of channels_last input is the row norm of its (N, H, W, C) view: replayed
    as that (one key, the full path's launches, outputs and gradients of its layouts) under an
    origin of its own (a validated layer_norm over the same rows does not validate it)."""
    import cupynorm.torch as cnt

    log, keys = eager
    module = getattr(cnt, make)(16)
    x = torch.rand(2, 16, 5, 7).to(memory_format=torch.channels_last)
    rows = x.permute(0, 2, 3, 1)
    dys = [torch.rand_like(x)]  # laid out as x
    rows_dy = dys[0].permute(0, 2, 3, 1)
    for _ in range(2):  # a layer_norm over the same rows, validated and replayed
        layer_norm_y, _ = _norm_step(lambda t: cnt.layer_norm(t, 16), rows, [], [rows_dy])
    assert _node(layer_norm_y) == "_ReplayFunctionBackward"
    y, _ = _norm_step(module, x, [], dys)
    assert _node(y) == "_ChannelNormFunctionBackward"  # the full path: its own checks first
    _norm_step(module, x, [], dys)  # replayed; the backward binds
    keys.clear()
    log.clear()
    y, replayed_meta = _norm_step(module, x, [], dys)
    assert _node(y) == "PermuteBackward0"
    assert type(y.grad_fn.next_functions[0][0]).__name__ == "_ReplayFunctionBackward"
    assert keys == ["row_norm_fwd"] and y.is_contiguous(memory_format=torch.channels_last)
    y = _full_path_after_replay(log, replayed_meta, lambda: _norm_step(module, x, [], dys))
    assert _node(y) == "_ChannelNormFunctionBackward"


@pytest.mark.parametrize("make", ["LayerNorm2d", "RMSNorm2d"])
def test_channel_norms_on_nchw_are_replayed_by_the_channels_family(eager, make) -> None:
    """NCHW input: the channels family's call replayed (the forward's key; the backward takes
    the full path's route), with the full path's launches, outputs and gradients."""
    import cupynorm.torch as cnt

    log, keys = eager
    module = getattr(cnt, make)(16)
    x = torch.rand(2, 16, 5, 7)
    dys = [torch.rand_like(x)]
    y, _ = _norm_step(module, x, [], dys)
    assert _node(y) == "_ChannelNormFunctionBackward"
    keys.clear()
    log.clear()
    y, replayed_meta = _norm_step(module, x, [], dys)
    assert _node(y) == "_ReplayFunctionBackward" and keys == [
        "_channel_norm_fwd",
        "_channel_norm_bwd",
    ]
    y = _full_path_after_replay(log, replayed_meta, lambda: _norm_step(module, x, [], dys))
    assert _node(y) == "_ChannelNormFunctionBackward"
    with torch.no_grad():
        module(x)  # validates the no-grad call (a key of its own)
        keys.clear()
        y = module(x)
    assert y.grad_fn is None and keys == ["_channel_norm_fwd"] and y.shape == x.shape


@pytest.mark.parametrize("case", ["group_norm-cl", "layer_norm", "add_rms_norm"])
def test_group_and_row_norm_replays_without_grad_run_the_program_alone(eager, case) -> None:
    log, keys = eager
    forward, make = _norm_calls()[case]
    fn, x, extra = make()
    with torch.no_grad():
        full = fn(x, *extra)  # validates the no-grad call (a key of its own)
        keys.clear()
        log.clear()
        out = fn(x, *extra)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(t.grad_fn is None for t in outs) and keys == [forward]
    replayed = log[:]
    _program._PROGRAMS.clear()
    log.clear()
    with torch.no_grad():
        fn(x, *extra)
    assert [entry[:4] for entry in replayed] == [entry[:4] for entry in log]
    full = full if isinstance(full, tuple) else (full,)
    assert [(t.shape, t.stride()) for t in outs] == [(t.shape, t.stride()) for t in full]


def test_a_normalized_shape_the_checks_reject_is_not_replayed(eager) -> None:
    """The normalized shape is not in the kernels' key (only the row length is): a call whose
    shape torch rejects gets torch's error even after a call with the same key was replayed."""
    import cupynorm.torch as cnt

    x = torch.rand(4, 2, 32)
    for _ in range(3):
        cnt.layer_norm(x, (2, 32))  # row length 64, no weight: validated, then replayed
    with pytest.raises(RuntimeError) as ours:
        cnt.layer_norm(x, (64,))
    with pytest.raises(RuntimeError) as torchs:
        torch.nn.functional.layer_norm(x, (64,))
    assert str(ours.value) == str(torchs.value)


def test_under_autocast_the_replay_asks_of_the_tensors_before_the_float32_copies(
    eager, monkeypatch
) -> None:
    """Autocast runs layer_norm and group_norm on float32 copies, whose key is the same for any
    input dtype: an input the checks reject before the copies (integers) is rejected after a
    replayed call too (the dtypes are the replay's origin)."""
    import cupynorm.torch as cnt

    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: True)
    calls = [
        lambda x: cnt.layer_norm(x, (32,), torch.rand(32)),
        lambda x: cnt.group_norm(x.view(6, 32, 1), 4, torch.rand(32)),
        lambda x: cnt.layer_norm2d(x.view(6, 32, 1, 1), torch.rand(32)),
    ]
    for call in calls:
        for _ in range(3):  # validated, then replayed
            assert call(torch.rand(6, 32, dtype=torch.bfloat16)).dtype == torch.float32
        with pytest.raises(TypeError, match="expected input of dtype float16"):
            call(torch.randint(0, 9, (6, 32)))


def test_only_row_norm_calls_on_contiguous_rows_are_replayed(eager) -> None:
    """A row norm's kernels take contiguous rows: a strided input, copied by the full path, is
    never replayed; a contiguous one is from its second call."""
    import cupynorm.torch as cnt

    module = cnt.LayerNorm(32)
    strided = torch.rand(6, 64)[:, ::2].requires_grad_()
    assert [_node(module(strided)) for _ in range(3)] == ["_RowNormFunctionBackward"] * 3
    x = torch.rand(6, 32).requires_grad_()
    assert [_node(module(x)) for _ in range(2)] == [
        "_RowNormFunctionBackward",
        "_ReplayFunctionBackward",
    ]
