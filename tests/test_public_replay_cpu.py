"""The lean path of the public functional API (cupynorm.functional): a call whose arguments passed
the checks once is replayed from then on, its whole call one recorded program. On the CPU: CPU
torch tensors stand in for device arrays and a fake launcher logs the launches (as in
tests/test_programs_cpu.py); the public checks' CUDA-device test is waived for them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_programs_cpu import launches  # noqa: E402,F401  (the fixture)

import cupynorm  # noqa: E402
from cupynorm import _interop, _validate  # noqa: E402


@pytest.fixture
def lean(launches, monkeypatch):  # noqa: F811
    """The public API on CPU tensors through the CUDA host code; returns (launch log, the
    backend, a list that grows by one per public argument check)."""
    backend = _interop.backend_of(torch.empty(0))
    monkeypatch.setattr(backend, "on_device", lambda xs, device: True, raising=False)
    monkeypatch.setattr(_interop, "_backend_of_type", {torch.Tensor: backend})
    checks: list = []
    check_array = _validate.check_array

    def counting(x, what="input"):
        checks.append(what)
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
            return None
        return check_array(x, what)

    monkeypatch.setattr(_validate, "check_array", counting)
    return launches, backend, checks


def _kernels(log) -> list:
    return [(kernel, grid, block, smem) for kernel, grid, block, smem, _args in log]


_CALLS = {
    "group_norm": lambda x, w, b: cupynorm.group_norm(x, 2, w, b),
    "group_norm_act": lambda x, w, b: cupynorm.group_norm_act(x, 2, w, b, activation="relu"),
    "instance_norm": lambda x, w, b: cupynorm.instance_norm(x, weight=w, bias=b),
    "batch_norm": lambda x, w, b: cupynorm.batch_norm(x, None, None, w, b, training=True),
    "layer_norm": lambda x, w, b: cupynorm.layer_norm(x.flatten(2), 15),
    "rms_norm": lambda x, w, b: cupynorm.rms_norm(x.flatten(2), (15,)),
    "layer_norm2d": lambda x, w, b: cupynorm.layer_norm2d(x, w, b),
}


@pytest.mark.parametrize("name", list(_CALLS))
def test_a_checked_call_is_replayed_without_the_checks(lean, name) -> None:
    log, _backend, checks = lean
    call = _CALLS[name]
    x, w, b = torch.rand(2, 8, 3, 5), torch.rand(8), torch.rand(8)
    first = call(x, w, b)
    recorded, n_checks = list(log), len(checks)
    assert n_checks > 0
    del log[:]
    x2 = torch.rand_like(x)
    second = call(x2, w, b)
    assert len(checks) == n_checks  # no checks: replayed
    assert _kernels(log) == _kernels(recorded)  # what the full path launched
    assert x2.data_ptr() in {a for *_k, args in log for a in args}
    assert second.shape == first.shape and second.stride() == first.stride()
    assert second.data_ptr() != first.data_ptr()  # a new output


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm2d", "rms_norm2d"])
def test_a_channels_last_channel_norm_is_replayed(lean, rms) -> None:
    """On channels_last input the kernels normalize the rows of the (N, *spatial, C) view: the
    recorded call hands back those rows and the public function views them as x's layout, so
    that call is replayed too (a view is no allocation a replay can make)."""
    log, _backend, checks = lean
    norm = cupynorm.rms_norm2d if rms else cupynorm.layer_norm2d
    x = torch.rand(2, 8, 3, 5).contiguous(memory_format=torch.channels_last)
    w = torch.rand(8)
    first = norm(x, w)
    recorded, n_checks = list(log), len(checks)
    del log[:]
    x2 = torch.rand_like(x)
    second = norm(x2, w)
    assert len(checks) == n_checks  # no checks: replayed
    assert _kernels(log) == _kernels(recorded)
    assert x2.data_ptr() in {a for *_k, args in log for a in args}
    assert second.shape == x.shape and second.stride() == first.stride() == x.stride()
    assert second.data_ptr() != first.data_ptr()


def test_a_call_on_another_device_takes_the_full_path(lean, monkeypatch) -> None:
    _log, backend, checks = lean
    x = torch.rand(2, 8, 3, 5)
    cupynorm.group_norm(x, 2)
    n_checks = len(checks)
    monkeypatch.setattr(backend, "on_device", lambda xs, device: False, raising=False)
    cupynorm.group_norm(x, 2)
    assert len(checks) > n_checks


def test_only_calls_that_passed_the_checks_are_replayed(lean) -> None:
    _log, _backend, checks = lean
    x = torch.rand(2, 8, 3, 5)
    for _ in range(2):  # the same bad call fails the checks every time
        with pytest.raises(ValueError, match="num_groups"):
            cupynorm.group_norm(x, 3)
    rows = torch.rand(4, 2, 32)
    cupynorm.layer_norm(rows, (2, 32))
    cupynorm.layer_norm(rows, (2, 32))  # replayed
    with pytest.raises(ValueError):  # same row length, another normalized shape: checked
        cupynorm.layer_norm(rows, (64,))


def test_a_list_normalized_shape_is_replayed_as_its_tuple(lean) -> None:
    _log, _backend, checks = lean
    x = torch.rand(6, 15)
    first = cupynorm.layer_norm(x, [15])
    n = len(checks)
    for shape in ([15], (15,)):
        assert cupynorm.layer_norm(x, shape).shape == first.shape
    assert len(checks) == n


def test_an_unhashable_argument_takes_the_full_path() -> None:
    from cupynorm import _program

    @_program._programmed
    def op(x, extra):
        return (x,)

    x = torch.rand(3)
    assert op.with_program(x, [1, 2]) == ((x,), None)
    assert op.replay_checked(x, [1, 2]) is None


def test_a_tensor_that_needs_grad_goes_to_autograd(lean, kernels) -> None:
    _log, _backend, _checks = lean
    x = torch.rand(2, 8, 3, 5)
    cupynorm.group_norm(x, 2)
    cupynorm.group_norm(x, 2)
    y = cupynorm.group_norm(x.clone().requires_grad_(), 2)
    assert y.grad_fn is not None
    with torch.no_grad():
        assert cupynorm.group_norm(x.clone().requires_grad_(), 2).grad_fn is None
