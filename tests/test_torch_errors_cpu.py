"""Errors and warnings of cupynorm.torch on the CPU: the modules raise what torch.nn raises for
the same arguments (asked of the installed torch, on the CPU route and on the kernel route), and
the functional API says what it expected and what it got.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_cpu_helpers import PAIR_IDS, PAIRS, patch_route

import cupynorm
import cupynorm.torch as cnt


# ---------------------------------------------------------------------------------------------
# errors and warnings: module messages are torch's; functional messages say expected vs got
# ---------------------------------------------------------------------------------------------
def _error(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.type, str(info.value)


@pytest.mark.parametrize(
    "ours, theirs, shape",
    [
        (cnt.BatchNorm1d, nn.BatchNorm1d, (2, 3, 4, 5)),
        (cnt.BatchNorm2d, nn.BatchNorm2d, (2, 3, 4)),
        (cnt.BatchNorm3d, nn.BatchNorm3d, (2, 3, 4, 5)),
        (cnt.InstanceNorm1d, nn.InstanceNorm1d, (2, 3, 4, 5)),
        (cnt.InstanceNorm2d, nn.InstanceNorm2d, (2, 3)),
        (cnt.InstanceNorm3d, nn.InstanceNorm3d, (2, 3, 4, 5, 6, 7)),
    ],
)
def test_bad_input_dim_errors_equal_torch(ours, theirs, shape):
    x = torch.randn(shape)
    assert _error(ours(3), x) == _error(theirs(3), x)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["cpu", "kernel_route"])
def test_instance_norm_num_features_mismatch_like_torch(use_kernels, monkeypatch):
    if use_kernels:
        patch_route(monkeypatch.setattr, "_use_kernels", lambda x, kind: True)
    x = torch.randn(2, 4, 5, 7)
    assert _error(cnt.InstanceNorm2d(3, affine=True), x) == _error(
        nn.InstanceNorm2d(3, affine=True), x
    )
    with pytest.warns(UserWarning, match="does not match num_features") as ours:
        y = cnt.InstanceNorm2d(3)(x)
    with pytest.warns(UserWarning, match="does not match num_features") as theirs:
        yr = nn.InstanceNorm2d(3)(x)
    assert str(ours[0].message) == str(theirs[0].message)
    torch.testing.assert_close(y, yr)


def _raised(fn, *args, **kwargs) -> BaseException:
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value


def _cases_like_torch():
    """(id, cupynorm call, torch call): bad arguments that the installed torch rejects."""
    x3, x4 = torch.randn(2, 4, 3), torch.randn(2, 4)
    z4, o4, z3, o3 = torch.zeros(4), torch.ones(4), torch.zeros(3), torch.ones(3)
    funcs = [
        ("gn_1d_input", "group_norm", (torch.randn(4), 2), {}),
        ("gn_not_divisible", "group_norm", (x3, 3), {}),
        ("gn_weight_size", "group_norm", (x3, 2, o3), {}),
        ("gn_bias_shape", "group_norm", (x3, 2, None, torch.ones(4, 1)), {}),
        ("gn_one_value_per_group", "group_norm", (torch.randn(1, 3, 1), 3), {}),
        ("bn_eval_without_stats", "batch_norm", (x3, None, None), {}),
        ("bn_running_mean_size", "batch_norm", (x3, z3, o3), dict(training=True)),
        ("bn_running_var_size", "batch_norm", (x3, z4, o3), dict(training=True)),
        ("bn_weight_size", "batch_norm", (x3, z4, o4, o3), dict(training=True)),
        ("bn_bias_size", "batch_norm", (x3, z4, o4, o4, o3), dict(training=True)),
        ("bn_eps_zero_training", "batch_norm", (x3, None, None), dict(training=True, eps=0.0)),
        ("bn_eps_negative_eval", "batch_norm", (x4, z4, o4), dict(eps=-1.0)),
        (
            "bn_one_value_per_channel",
            "batch_norm",
            (torch.randn(1, 3), None, None),
            dict(training=True),
        ),
        ("in_no_stats_for_eval", "instance_norm", (x3,), dict(use_input_stats=False)),
        ("in_weight_size", "instance_norm", (x3,), dict(weight=o3)),
        ("in_running_mean_size", "instance_norm", (x3, z3, o3), {}),
        ("in_one_spatial_element", "instance_norm", (torch.randn(2, 3, 1),), {}),
    ]
    for case_id, name, args, kwargs in funcs:
        yield pytest.param(
            lambda n=name, a=args, k=kwargs: getattr(cnt, n)(*a, **k),
            lambda n=name, a=args, k=kwargs: getattr(F, n)(*a, **k),
            id=case_id,
        )
    modules = [
        ("BatchNorm1d_one_value", nn.BatchNorm1d, (3,), torch.randn(1, 3)),
        ("BatchNorm2d_channels", nn.BatchNorm2d, (3,), torch.randn(2, 4, 5, 5)),
        ("GroupNorm_1d_input", nn.GroupNorm, (2, 4), torch.randn(4)),
        ("GroupNorm_channels", nn.GroupNorm, (3, 6), x3),
        ("GroupNorm_not_divisible", nn.GroupNorm, (3, 3), x3),
        ("InstanceNorm1d_one_element", nn.InstanceNorm1d, (4,), torch.randn(2, 4, 1)),
    ]
    for case_id, cls, args, x in modules:
        ours = getattr(cnt, cls.__name__)
        yield pytest.param(
            lambda o=ours, a=args, x=x: o(*a)(x),
            lambda c=cls, a=args, x=x: c(*a)(x),
            id=case_id,
        )


@pytest.mark.parametrize("use_kernels", [False, True], ids=["cpu", "kernel_route"])
@pytest.mark.parametrize("ours, theirs", list(_cases_like_torch()))
def test_errors_are_torchs(use_kernels, ours, theirs, monkeypatch):
    """The installed torch's exception (a subclass of its type) and its message, word for word."""
    if use_kernels:
        patch_route(monkeypatch.setattr, "_use_kernels", lambda x, kind: True)
    expected = _raised(theirs)
    error = _raised(ours)
    assert isinstance(error, type(expected)), (type(error), type(expected), str(expected))
    assert str(error) == str(expected)


def test_kernel_route_errors_catchable_both_ways(kernels):
    """Value errors are ValueError and RuntimeError at once (CuPy-style and torch-style code)."""
    x, mean, var = torch.randn(2, 4, 3), torch.zeros(3), torch.ones(3)
    error = _raised(cnt.batch_norm, x, mean, var, training=True)
    assert isinstance(error, cupynorm.InvalidInputError)
    assert isinstance(error, ValueError) and isinstance(error, RuntimeError)


def test_batch_norm_eval_eps_zero_as_torch(kernels):
    """eps=0 in eval: torch's rule decides (it changed between versions); accepted like torch."""
    x, mean, var = torch.randn(2, 4, 3), torch.zeros(4), torch.ones(4)
    try:
        expected = F.batch_norm(x, mean, var, eps=0.0)
    except (ValueError, RuntimeError) as torch_error:
        assert str(_raised(cnt.batch_norm, x, mean, var, eps=0.0)) == str(torch_error)
    else:
        torch.testing.assert_close(cnt.batch_norm(x, mean, var, eps=0.0), expected)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["cpu", "kernel_route"])
@pytest.mark.parametrize(
    "call, exc, message",
    [
        (
            lambda: cnt.group_norm([1.0], 2),
            TypeError,
            "group_norm: expected input to be a torch.Tensor, got list",
        ),
        (
            lambda: cnt.row_norm_add_mul(torch.randn(2, 3), torch.randn(3, 2)),
            ValueError,
            "row_norm_add_mul: expected x and y of the same shape, got (2, 3) and (3, 2)",
        ),
        (
            lambda: cnt.row_norm_add_mul(torch.randn(2, 3), torch.randn(2, 3).double()),
            TypeError,
            "expected x and y of the same dtype, got torch.float32 and torch.float64",
        ),
        (
            lambda: cnt.row_norm_add_mul(torch.randn(2, 3), 1.0),
            TypeError,
            "expected y to be a torch.Tensor, got float",
        ),
    ],
)
def test_functional_error_messages(use_kernels, call, exc, message, monkeypatch):
    """Errors of arguments torch has no counterpart for: cupynorm's own, expected vs got."""
    if use_kernels:
        patch_route(monkeypatch.setattr, "_use_kernels", lambda x, kind: True)
    with pytest.raises(exc) as info:
        call()
    assert message in str(info.value)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: cnt.batch_norm(torch.randn(4), None, None, training=True),
            "batch_norm: expected input of shape (N, C, *), got 1D input",
        ),
        (
            lambda: cnt.instance_norm(torch.randn(2, 4, 3), torch.zeros(4), None),
            "running_mean and running_var",
        ),
    ],
)
def test_kernel_route_own_errors_where_torch_checks_on_device(kernels, call, message):
    """Checks torch makes only in its device kernels (none on meta): cupynorm's message."""
    with pytest.raises(cupynorm.InvalidInputError) as info:
        call()
    assert message in str(info.value)


def test_kernel_route_rejects_integer_input(kernels):
    with pytest.raises(
        TypeError,
        match="expected input of dtype float16, bfloat16, float32 or float64, got torch.int32",
    ) as info:
        cnt.group_norm(torch.ones(2, 4, 3, dtype=torch.int32), 2)
    assert isinstance(info.value, RuntimeError)  # torch raises a RuntimeError here


def test_kernel_route_rejects_mixed_devices(kernels):
    x = torch.randn(2, 4, 3)
    with pytest.raises(
        RuntimeError, match="expected all tensors to be on the same device as the input"
    ):
        cnt.batch_norm(x, torch.zeros(4, device="meta"), torch.ones(4), training=True)


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("kwargs", [dict(bias=False), dict(elementwise_affine=False)], ids=str)
def test_modules_accept_what_torch_accepts(ours, theirs, kwargs):
    """A constructor argument the installed torch refuses is refused alike (same error)."""
    args = (3, 6) if theirs is nn.GroupNorm else (6,)
    try:
        theirs(*args, **kwargs)
    except TypeError as expected:
        assert str(_raised(ours, *args, **kwargs)) == str(expected)
    else:
        assert type(ours(*args, **kwargs)) is ours
