"""cupynorm.torch on the CPU: drop-in parity with torch.nn and the op plumbing (replace_norms:
test_convert_cpu.py; errors: test_torch_errors_cpu.py; shared cases: torch_cpu_helpers.py).

Runs in CPU CI without a GPU and without CuPy. Two ways of running cupynorm's stack here:

- as shipped: on CPU tensors the modules and functions compute through torch.nn.functional, so
  they must match torch.nn exactly (outputs, gradients, running statistics);
- ``kernels`` fixture: ``_use_kernels`` patched to send CPU tensors down the CUDA route, where the
  CPU kernels of the custom ops (plain-torch reference math) stand in for the CUDA ones. That
  checks everything but the CUDA kernels themselves -- eager autograd.Functions, custom ops with
  fake kernels and registered autograd, running-statistics write-back, ``torch.compile`` -- against
  torch.nn within float tolerances.
"""

from __future__ import annotations

import copy
import inspect
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from small_cnn import SmallCNN
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch_cpu_helpers import (
    PAIR_IDS,
    PAIRS,
    _cases,
    _configs,
    _inputs,
    _make,
    _pair,
    _randomize,
    _run_steps,
)

import cupynorm.torch as cnt
from cupynorm.torch import (
    _batch_norm,
    _batch_norm_kernels,
    _group_norm,
    _instance_norm,
    _reference,
    _row_norm_add_mul,
    _tensors,
)


# ---------------------------------------------------------------------------------------------
# drop-in: signatures, defaults, state_dict, repr, reset
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ours, theirs", PAIRS, ids=PAIR_IDS)
def test_module_signature_equals_torch(ours, theirs):
    assert issubclass(ours, theirs)
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert ours.__name__ == theirs.__name__


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", ["group_norm", "instance_norm", "batch_norm"])
def test_functional_signature_equals_torch(name):
    assert _params(getattr(cnt, name)) == _params(getattr(F, name))


def test_row_norm_add_mul_module_defaults():
    m = cnt.RowNormAddMul()
    assert m.eps == 1e-5
    assert repr(m) == "RowNormAddMul(eps=1e-05)"
    assert list(m.state_dict()) == []
    assert _params(cnt.RowNormAddMul) == [("eps", inspect.Parameter.POSITIONAL_OR_KEYWORD, 1e-5)]


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=PAIR_IDS)
def test_module_defaults_and_buffers_equal_torch(ours, theirs):
    for cfg in [{}] + _configs(theirs):
        a, b = _make(ours, theirs, **cfg), _make(theirs, theirs, **cfg)
        assert repr(a) == repr(b)
        assert a.extra_repr() == b.extra_repr()
        assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
        assert [n for n, _ in a.named_buffers()] == [n for n, _ in b.named_buffers()]
        for key, value in b.state_dict().items():
            assert torch.equal(a.state_dict()[key], value), key
        assert a.training and b.training


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=PAIR_IDS)
def test_state_dict_round_trip_strict_both_ways(ours, theirs):
    for cfg in _configs(theirs):
        a, b = _pair(ours, theirs, cfg)  # b -> a
        for key, value in b.state_dict().items():
            assert torch.equal(a.state_dict()[key], value)
        c = _make(theirs, theirs, **cfg)
        c.load_state_dict(a.state_dict(), strict=True)  # a -> torch
        for key, value in a.state_dict().items():
            assert torch.equal(c.state_dict()[key], value)
        assert list(a.state_dict()) == list(b.state_dict())
        # the state_dict metadata (version) matches too
        assert a.state_dict()._metadata[""] == b.state_dict()._metadata[""]


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=PAIR_IDS)
def test_reset_parameters_and_factory_kwargs(ours, theirs):
    for cfg in _configs(theirs):
        a, b = _pair(ours, theirs, cfg, dtype=torch.float64)
        a.reset_parameters()
        b.reset_parameters()
        for key, value in b.state_dict().items():
            assert torch.equal(a.state_dict()[key], value)
            assert a.state_dict()[key].dtype == value.dtype
        m = _make(ours, theirs, device="meta", dtype=torch.float16, **cfg)
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            assert t.device.type == "meta", name
            assert t.dtype == (torch.long if name == "num_batches_tracked" else torch.float16)


def test_repr_of_a_model_equals_torch():
    def net(bn, inorm, gn):
        return nn.Sequential(bn(3, momentum=None), inorm(3, affine=True), gn(1, 3, eps=1e-3))

    ours = net(cnt.BatchNorm2d, cnt.InstanceNorm2d, cnt.GroupNorm)
    theirs = net(nn.BatchNorm2d, nn.InstanceNorm2d, nn.GroupNorm)
    assert repr(ours) == repr(theirs)


# ---------------------------------------------------------------------------------------------
# CPU forward: exactly torch.nn (computed through torch.nn.functional)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ours, theirs, cfg, shape", list(_cases()))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_cpu_forward_equals_torch(ours, theirs, cfg, shape, train):
    a, b = _pair(ours, theirs, cfg)
    xs = _inputs(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ya, ga = _run_steps(a, xs, train)
        yb, gb = _run_steps(b, xs, train)
    for u, v in zip(ya + ga, yb + gb, strict=True):
        assert torch.equal(u, v)
    for key, value in b.state_dict().items():
        assert torch.equal(a.state_dict()[key], value), key


def test_row_norm_add_mul_cpu_matches_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64) * 3 + 1
    y = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    xhat = (x - x.mean(-1, keepdim=True)) / torch.sqrt(
        x.var(-1, unbiased=False, keepdim=True) + 1e-5
    )
    torch.testing.assert_close(cnt.row_norm_add_mul(x, y), (xhat + y) * y)
    torch.testing.assert_close(cnt.RowNormAddMul()(x, y), (xhat + y) * y)


# ---------------------------------------------------------------------------------------------
# the CUDA route on the reference kernels: eager Functions and custom ops vs torch.nn
# ---------------------------------------------------------------------------------------------
def _layout_cases():
    for case in _cases():
        ours, _theirs, _cfg, shape = case.values
        yield pytest.param(*case.values, False, id=case.id + "-contiguous")
        unbatched = ours is cnt.InstanceNorm3d and len(shape) == 4
        if len(shape) in (4, 5) and not unbatched:  # channels_last needs a batched 4-D/5-D input
            yield pytest.param(*case.values, True, id=case.id + "-channels_last")


@pytest.mark.parametrize("ours, theirs, cfg, shape, channels_last", list(_layout_cases()))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_kernel_route_matches_torch(kernel_path, ours, theirs, cfg, shape, train, channels_last):
    """float64, so that 3 SGD steps with large gradients do not amplify rounding differences."""
    a, b = _pair(ours, theirs, cfg, dtype=torch.float64)
    xs = _inputs(shape, dtype=torch.float64, channels_last=channels_last)
    ya, ga = _run_steps(a, xs, train)
    yb, gb = _run_steps(b, xs, train)
    for u, v in zip(ya + ga, yb + gb, strict=True):
        torch.testing.assert_close(u, v, atol=1e-10, rtol=1e-10)
    for u in ya + ga:
        assert u.is_contiguous(memory_format=_memory_format(xs[0]))
    for key, value in b.state_dict().items():
        torch.testing.assert_close(a.state_dict()[key], value, atol=1e-10, rtol=1e-10)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=1e-10, msg=name)


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.is_contiguous():
        return torch.contiguous_format
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


def test_kernel_route_uses_expected_autograd_node(kernel_path):
    x = torch.randn(2, 6, 5, requires_grad=True)
    y = cnt.GroupNorm(3, 6)(x)
    name = type(y.grad_fn).__name__
    if kernel_path == "eager":
        assert name == "_GroupNormFunctionBackward"
    else:
        assert "GeneratedBackwardFor_cupynorm_group_norm_fwd" in name
    with torch.no_grad():
        assert cnt.GroupNorm(3, 6)(x).grad_fn is None


def test_kernel_route_no_grad_updates_running_stats(kernels):
    x = torch.randn(4, 3, 7, 1)
    for ours, theirs in [
        (cnt.BatchNorm2d, nn.BatchNorm2d),
        (cnt.InstanceNorm2d, nn.InstanceNorm2d),
    ]:
        a, b = _pair(ours, theirs, dict(track_running_stats=True, affine=True))
        with torch.no_grad():
            torch.testing.assert_close(a(x), b(x))
        torch.testing.assert_close(a.running_mean, b.running_mean)
        torch.testing.assert_close(a.running_var, b.running_var)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_kernel_route_counts_batches_like_torch(kernel_path, momentum):
    """num_batches_tracked, which the kernels increment (the cumulative average's factor needs
    it on the host first): once per training call, never in eval, and also when the call is
    rejected after torch's module has counted it (one value per channel in training)."""
    ours = [cnt.BatchNorm1d(3, momentum=momentum), cnt.BatchNormAct2d(3, momentum=momentum)]
    theirs = [nn.BatchNorm1d(3, momentum=momentum), nn.BatchNorm2d(3, momentum=momentum)]
    for a, b in zip(ours, theirs, strict=True):
        x = torch.randn(4, 3, 5, 5) if isinstance(b, nn.BatchNorm2d) else torch.randn(4, 3)
        for train in (True, True, False):
            a.train(train), b.train(train)
            torch.testing.assert_close(F.relu(b(x)) if a is ours[1] else b(x), a(x))
        a.train(), b.train()
        with pytest.raises(ValueError) as error:
            a(x[:1, :, :1, :1] if x.dim() == 4 else x[:1])
        with pytest.raises(ValueError, match=re.escape(str(error.value))):
            b(x[:1, :, :1, :1] if x.dim() == 4 else x[:1])
        assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 3
        torch.testing.assert_close(a.running_mean, b.running_mean)
        torch.testing.assert_close(a.running_var, b.running_var)


def test_batch_counter_goes_to_the_kernels_only_as_an_int64_beside_the_input():
    m = cnt.BatchNorm2d(3)
    x = torch.randn(2, 3, 4, 4)
    assert m._batch_norm_args(x, count_in_kernel=True)[-1] is m.num_batches_tracked
    assert int(m.num_batches_tracked) == 0  # left to the kernels
    assert m._batch_norm_args(x)[-1] is None and int(m.num_batches_tracked) == 1
    m.num_batches_tracked = torch.tensor(5, dtype=torch.int32)  # replaced by the user
    assert m._batch_norm_args(x, count_in_kernel=True)[-1] is None
    assert int(m.num_batches_tracked) == 6
    m.eval()
    assert m._batch_norm_args(x, count_in_kernel=True)[-1] is None
    assert int(m.num_batches_tracked) == 6


def test_batch_norm_reads_its_tensors_as_attribute_access_gives_them(kernel_path):
    """The modules read weight, bias and the buffers from the module's dicts, where
    Module.__getattr__ finds them, unless something answers first: a class attribute (a
    parametrization's property), an instance attribute or the class's own __getattr__. Each case
    against torch's module."""
    import torch.nn.utils.parametrize as parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    def zero_bias(cls):
        class ZeroBias(cls):  # its own __getattr__: the bias it gives is not the registered one
            def __getattr__(self, name):
                value = super().__getattr__(name)
                return torch.zeros_like(value) if name == "bias" else value

        return ZeroBias

    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    parametrized, plain = (_pair(cnt.BatchNorm2d, nn.BatchNorm2d, {}, torch.float64) for _ in "ab")
    overriding = _pair(zero_bias(cnt.BatchNorm2d), zero_bias(nn.BatchNorm2d), {}, torch.float64)
    for m in overriding:
        nn.init.ones_(m._parameters["bias"])
    for m in parametrized:
        parametrize.register_parametrization(m, "weight", Doubled())
    for m in plain:  # running_var held as a plain attribute: no longer a buffer
        del m.running_var
        m.running_var = torch.full((3,), 4.0, dtype=torch.float64)
    for a, b in (parametrized, plain, overriding):
        for train in (True, False):
            a.train(train), b.train(train)
            torch.testing.assert_close(a(x), b(x))
        torch.testing.assert_close(a.running_var, b.running_var)
    assert type(parametrized[0]).__name__ == "ParametrizedBatchNorm2d"


def test_kernel_route_frozen_parameters(kernel_path):
    """Weight not requiring grad: only the input gradient is computed and returned."""
    a, b = _pair(cnt.BatchNorm2d, nn.BatchNorm2d, dict(affine=True), dtype=torch.float64)
    a.weight.requires_grad_(False)
    b.weight.requires_grad_(False)
    xs = _inputs((4, 3, 5, 3), dtype=torch.float64)
    ya, ga = _run_steps(a, xs, True)
    yb, gb = _run_steps(b, xs, True)
    for u, v in zip(ya + ga, yb + gb, strict=True):
        torch.testing.assert_close(u, v)
    assert a.weight.grad is None and a.bias.grad is None  # zero_grad() set it to None


def test_kernel_route_unusual_strides(kernel_path):
    """A transposed (neither contiguous nor channels_last) input and an expanded gradient."""
    x = torch.randn(3, 4, 6, 5, dtype=torch.float64).transpose(2, 3).requires_grad_()
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    m, ref = cnt.GroupNorm(2, 4, dtype=torch.float64), nn.GroupNorm(2, 4, dtype=torch.float64)
    _randomize(ref)
    m.load_state_dict(ref.state_dict())
    dy = torch.randn(1, 4, 1, 1, dtype=torch.float64).expand(x.shape)  # stride 0 but channels
    y = m(x)
    y.backward(dy)
    gx = x.grad
    x.grad = None
    yr = ref(x)
    yr.backward(dy)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)
    assert y.is_contiguous()


@pytest.mark.parametrize("fn", ["group_norm", "instance_norm", "batch_norm"])
def test_kernel_route_functional_float64(kernel_path, fn):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 7, generator=g, dtype=torch.float64)
    w, b = (torch.randn(3, generator=g, dtype=torch.float64) for _ in range(2))
    rm, rv = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    if fn == "group_norm":
        args, kwargs = (x, 3, w, b), {}
    elif fn == "instance_norm":
        args, kwargs = (x, rm, rv, w, b), dict(use_input_stats=True, momentum=0.3)
    else:
        args, kwargs = (x, rm, rv, w, b), dict(training=True, momentum=0.3)
    ours_args, ref_args = copy.deepcopy(args), copy.deepcopy(args)
    ours = getattr(cnt, fn)(*ours_args, **kwargs)
    theirs = getattr(F, fn)(*ref_args, **kwargs)
    torch.testing.assert_close(ours, theirs)
    assert ours.dtype == torch.float64
    if fn != "group_norm":  # running stats updated in place, like torch
        assert not torch.equal(ours_args[1], args[1])
        torch.testing.assert_close(ours_args[1], ref_args[1])
        torch.testing.assert_close(ours_args[2], ref_args[2])


def test_kernel_route_instance_norm_eval_uses_running_stats(kernel_path):
    x = torch.randn(4, 3, 7, dtype=torch.float64)
    rm, rv = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    ours = cnt.instance_norm(x, rm, rv, w, None, use_input_stats=False)
    theirs = F.instance_norm(x, rm, rv, w, None, use_input_stats=False)
    torch.testing.assert_close(ours, theirs)
    (gw,) = torch.autograd.grad(ours.sum(), w)
    (gw_ref,) = torch.autograd.grad(theirs.sum(), w)
    torch.testing.assert_close(gw, gw_ref)


def test_kernel_route_row_norm_add_mul(kernel_path):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    out = cnt.RowNormAddMul(eps=1e-3)(x, y)
    xhat = F.layer_norm(x, (7,), eps=1e-3)
    ref = (xhat + y) * y
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    torch.testing.assert_close(
        torch.autograd.grad(out, (x, y), dout), torch.autograd.grad(ref, (x, y), dout)
    )


# ---------------------------------------------------------------------------------------------
# the custom ops: opcheck, gradcheck, fake tensors
# ---------------------------------------------------------------------------------------------
def _op_samples():
    g = torch.Generator().manual_seed(5)

    def r(*shape, dtype=torch.float32, grad=False):
        return torch.randn(shape, generator=g, dtype=dtype).requires_grad_(grad)

    x4 = r(3, 6, 5, 7, grad=True)
    xcl = r(3, 6, 5, 7).to(memory_format=torch.channels_last).requires_grad_()
    x3 = r(4, 3, 7, dtype=torch.float64, grad=True)
    w, b = r(6, grad=True), r(6, grad=True)
    w3, b3 = r(3, dtype=torch.float64, grad=True), r(3, dtype=torch.float64, grad=True)
    rm, rv = torch.zeros(6), torch.ones(6)
    rm3, rv3 = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    gn = _group_norm.group_norm_fwd_op
    inorm = _instance_norm.instance_norm_fwd_op
    bn = _batch_norm.batch_norm_fwd_op
    return [
        ("gn", gn, (x4, 3, w, b, 1e-5)),
        ("gn_cl", gn, (xcl, 2, None, b, 1e-5)),
        ("gn_f64_instance", gn, (x3, 3, w3, None, 1e-3)),
        ("gn_half", gn, (r(2, 6, 7).half(), 3, None, None, 1e-5)),
        ("in", inorm, (xcl, w, b, rm, rv, 0.1, 1e-5)),
        ("in_f64", inorm, (x3, None, None, rm3, rv3, 0.3, 1e-5)),
        ("bn_train", bn, (xcl, w, b, rm, rv, True, 0.1, 1e-5)),
        ("bn_train_nostats", bn, (x4, w, None, None, None, True, 0.1, 1e-5)),
        ("bn_eval", bn, (x4, w, b, rm, rv, False, 0.1, 1e-5)),
        (
            "bn_f64_2d",
            bn,
            (r(5, 3, dtype=torch.float64, grad=True), w3, b3, rm3, rv3, True, 0.1, 1e-5),
        ),
        ("bn_bf16", bn, (r(4, 6, 3).bfloat16(), None, None, rm, rv, True, 0.1, 1e-5)),
        (
            "row",
            _row_norm_add_mul.row_norm_add_mul_fwd_op,
            (r(3, 5, 7, grad=True), r(3, 5, 7, grad=True), 1e-5),
        ),
        (
            "gn_bwd",
            _group_norm.group_norm_bwd_op,
            (r(3, 6, 7), r(3, 6, 7), r(3, 3), r(3, 3).abs(), r(6), 3, [True, False, True]),
        ),
        (
            "bn_bwd",
            _batch_norm.batch_norm_bwd_op,
            (r(3, 6, 7), r(3, 6, 7), r(6), r(6).abs(), None, True, [True, False, False]),
        ),
        (
            "row_bwd",
            _row_norm_add_mul.row_norm_add_mul_bwd_op,
            (r(3, 7), r(3, 7), r(3, 7), r(3), r(3).abs()),
        ),
    ]


@pytest.mark.parametrize("name, op, args", _op_samples(), ids=[s[0] for s in _op_samples()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_gradcheck_reference_ops_both_paths():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    rm = torch.randn(6, dtype=torch.float64)
    rv = torch.rand(6, dtype=torch.float64) + 0.5

    def stats():
        return rm.clone(), rv.clone()

    funcs = {
        "gn_op": lambda x, w, b: _group_norm.group_norm_fwd_op(x, 3, w, b, 1e-5)[0],
        "gn_fn": lambda x, w, b: _group_norm._GroupNormFunction.apply(x, 3, w, b, 1e-5)[0],
        "in_op": lambda x, w, b: _instance_norm.instance_norm_fwd_op(x, w, b, *stats(), 0.1, 1e-5)[
            0
        ],
        "in_fn": lambda x, w, b: _instance_norm._InstanceNormFunction.apply(
            x, w, b, *stats(), 0.1, 1e-5
        )[0],
    }
    for training in (True, False):
        funcs[f"bn_op_{training}"] = lambda x, w, b, t=training: _batch_norm.batch_norm_fwd_op(
            x, w, b, *stats(), t, 0.1, 1e-5
        )[0]
        funcs[f"bn_fn_{training}"] = lambda x, w, b, t=training: (
            _batch_norm._BatchNormFunction.apply(x, w, b, *stats(), t, 0.1, 1e-5)[0]
        )
    for name, f in funcs.items():
        assert torch.autograd.gradcheck(f, (x, w, b)), name
    assert torch.autograd.gradcheck(
        lambda x, y: _row_norm_add_mul.row_norm_add_mul_fwd_op(x, y, 1e-5)[0], (x, y)
    )
    assert torch.autograd.gradcheck(
        lambda x, y: _row_norm_add_mul._RowNormAddMulFunction.apply(x, y, 1e-5)[0], (x, y)
    )


def test_fake_cuda_tensors_shapes_and_layouts():
    """Fake CUDA inputs (no GPU needed) take the custom-op route and get the fake kernels.

    (On a CPU-only torch build, fake CUDA tensors cannot be copied or need grad: no running-stat
    write-back and no autograd here; the CPU-fake test below covers those.)
    """
    with FakeTensorMode(), torch.no_grad():
        x = torch.empty(4, 6, 5, 7, device="cuda")
        xcl = x.to(memory_format=torch.channels_last)
        for inp in (x, xcl, x.half(), xcl.bfloat16()):
            for y in (
                cnt.group_norm(inp, 3),
                cnt.instance_norm(inp),
                cnt.batch_norm(inp, None, None, training=True),
            ):
                assert y.device.type == "cuda"
                assert y.shape == inp.shape and y.dtype == inp.dtype
                assert y.stride() == inp.stride()
        y = cnt.row_norm_add_mul(x, x)
        assert y.shape == x.shape and y.is_contiguous()
        y = cnt.batch_norm(
            torch.empty(4, 6, 7, device="cuda"),
            torch.zeros(6, device="cuda"),
            torch.ones(6, device="cuda"),
        )
        assert y.shape == (4, 6, 7)

        y, mean, rstd = _group_norm.group_norm_fwd_op(x.half(), 2, None, None, 1e-5)
        assert mean.shape == rstd.shape == (4, 2) and mean.dtype == torch.float32
        y, mean, rstd = _group_norm.group_norm_fwd_op(x.double(), 2, None, None, 1e-5)
        assert mean.dtype == torch.float64
        y, mean, rstd, nm, nv = _batch_norm.batch_norm_fwd_op(
            xcl.half(), None, None, None, None, True, 0.1, 1e-5
        )
        assert mean.shape == (6,) and mean.dtype == torch.float32 and nm is None and nv is None
        assert y.stride() == xcl.stride()
        odd = torch.empty(4, 5, 6, 7, device="cuda").transpose(2, 3)  # neither layout
        assert cnt.group_norm(odd, 5).is_contiguous()
        out, mean, rstd = _row_norm_add_mul.row_norm_add_mul_fwd_op(x, x, 1e-5)
        assert mean.shape == (4, 6, 5)


def test_fake_tensor_mode_cpu_matches_real(kernels):
    """FakeTensorMode over the modules: shapes, strides and dtypes as the real run."""

    def modules():
        return [
            cnt.BatchNorm2d(6),
            cnt.InstanceNorm2d(6, affine=True, track_running_stats=True),
            cnt.GroupNorm(3, 6),
            cnt.BatchNorm2d(6).eval(),
        ]

    x = torch.randn(2, 6, 5, 3).to(memory_format=torch.channels_last)
    real = [m(x) for m in modules()]
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x).requires_grad_()
        for m, r in zip(modules(), real, strict=True):
            y = m(fx)
            assert isinstance(y, type(fx))
            assert y.shape == r.shape and y.stride() == r.stride() and y.dtype == r.dtype
            y.sum().backward()
            assert fx.grad.stride() == x.stride()
            fx.grad = None


# ---------------------------------------------------------------------------------------------
# the CUDA kernels' glue, on a stand-in for the host code (cupynorm._ops) that follows
# docs/internal-api.md loosely: outputs in other layouts/dtypes/shapes than the fake kernels
# promise, running_mean handed back as save_mean in eval. The glue must adapt all of that.
# ---------------------------------------------------------------------------------------------
class _LooseHost:
    @staticmethod
    def group_norm_fwd(x, num_groups, weight, bias, eps, *, want_var=False, want_stats=True):
        assert x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)
        y, mean, rstd, var = _reference._group_norm_fwd_reference(
            x, num_groups, weight, bias, eps, True
        )
        y = y.contiguous()  # layout not preserved
        if not want_stats:
            mean = rstd = None
        return (y, mean, rstd, var) if want_var else (y, mean, rstd)

    @staticmethod
    def group_norm_bwd(dy, x, mean, rstd, weight, num_groups, needs_input_grad):
        assert dy.stride() == x.stride()
        dx, dw, db = _reference._group_norm_bwd_reference(
            dy, x, mean, rstd, weight, num_groups, needs_input_grad
        )
        return (
            None if dx is None else dx.contiguous(),
            None if dw is None else dw.double(),
            None if db is None else db.double(),
        )

    @staticmethod
    def batch_norm_fwd(
        x, weight, bias, running_mean, running_var, training, momentum, eps, *epilogue
    ):
        y, mean, rstd = _reference._batch_norm_fwd_reference(
            x, weight, bias, running_mean, running_var, training, momentum, eps, *epilogue
        )
        if not training:
            mean = running_mean.to(torch.float32)  # may be running_mean itself
        return y, mean, rstd

    @staticmethod
    def batch_norm_bwd(dy, x, save_mean, save_rstd, weight, training, needs_input_grad):
        return _reference._batch_norm_bwd_reference(
            dy, x, save_mean, save_rstd, weight, training, needs_input_grad
        )

    @staticmethod
    def row_norm_add_mul_fwd(x, y, eps):
        out, mean, rstd = _reference._row_norm_add_mul_fwd_reference(x, y, eps)
        return out, mean.reshape(-1), rstd.reshape(-1)  # stats flattened to (rows,)

    @staticmethod
    def row_norm_add_mul_bwd(dout, x, y, mean, rstd):
        dx, dy = _reference._row_norm_add_mul_bwd_reference(
            dout, x, y, mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])
        )
        return dx.reshape(-1, x.shape[-1]), dy


def _same_meta(real, fake, what):
    for r, f in zip(real, fake, strict=True):
        if r is None or f is None:
            assert r is None and f is None, what
            continue
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), what


def test_cuda_glue_adapts_host_outputs_to_the_fake_contract(monkeypatch):
    monkeypatch.setattr(_tensors, "_host_module", _LooseHost)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 6, 5, 7, generator=g).to(memory_format=torch.channels_last)
    odd = torch.randn(3, 6, 7, 5, generator=g).transpose(2, 3)
    w, b = torch.randn(6, generator=g), torch.randn(12, generator=g)[::2]  # b: strided
    for inp in (x, odd, x.half()):
        ww = w.to(inp.dtype)
        real = _group_norm._group_norm_fwd_cuda(inp, 3, ww, None, 1e-5)
        _same_meta(real, _group_norm._group_norm_fwd_fake(inp, 3, ww, None, 1e-5), "gn fwd")
        dy = torch.ones(()).expand(inp.shape)  # stride 0
        for mask in ([True, True, True], [True, False, False], [False, True, False]):
            for weight in (ww, None):
                args = (dy, inp, real[1], real[2], weight, 3, mask)
                _same_meta(
                    _group_norm._group_norm_bwd_cuda(*args),
                    _tensors._norm_bwd_fake(*args),
                    f"gn bwd {mask}",
                )
    rm, rv = torch.zeros(12)[::2], torch.ones(6)  # rm: strided, updated through a copy
    expected_rm = rm.clone()
    real = _batch_norm_kernels._batch_norm_fwd_cuda(x, w, b, rm, rv, True, 0.1, 1e-5)
    _reference._batch_norm_fwd_reference(x, w, b, expected_rm, torch.ones(6), True, 0.1, 1e-5)
    torch.testing.assert_close(rm, expected_rm)
    _same_meta(
        real, _batch_norm_kernels._batch_norm_fwd_fake(x, w, b, rm, rv, True, 0.1, 1e-5)[:3], "bn"
    )
    running_mean = torch.randn(6)
    op_kernel = _batch_norm_kernels._batch_norm_fwd_op_kernel(
        _batch_norm_kernels._batch_norm_fwd_cuda
    )
    y, save_mean, _, new_mean, new_var = op_kernel(x, w, b, running_mean, rv, False, 0.1, 1e-5)
    assert save_mean.data_ptr() != running_mean.data_ptr()  # no op output aliases an input
    assert new_mean is None and new_var is None
    torch.testing.assert_close(save_mean, running_mean)
    xr, yr = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    real = _row_norm_add_mul._row_norm_add_mul_fwd_cuda(xr, yr, 1e-5)
    _same_meta(real, _row_norm_add_mul._row_norm_add_mul_fwd_fake(xr, yr, 1e-5), "row fwd")
    args = (torch.randn(2, 3, 7, generator=g), xr, yr, real[1], real[2])
    _same_meta(
        _row_norm_add_mul._row_norm_add_mul_bwd_cuda(*args),
        _row_norm_add_mul._row_norm_add_mul_bwd_fake(*args),
        "row bwd",
    )


# ---------------------------------------------------------------------------------------------
# torch.compile (aot_eager: no C++ compiler needed) of a small CNN on the kernel route
# ---------------------------------------------------------------------------------------------
# SmallCNN: tests/small_cnn.py


def _train(model, xs):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs, grads = [], []
    for x in xs:
        x = x.clone().requires_grad_()
        y = model(x)
        (y * y).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
        opt.step()
        opt.zero_grad()
    return outs, grads


def test_compile_fullgraph_matches_eager(kernels):
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = SmallCNN()
    eager = cnt.replace_norms(copy.deepcopy(ref))
    compiled_model = cnt.replace_norms(copy.deepcopy(ref))
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    xs = _inputs((4, 3, 7, 5), n=3)
    for train in (True, False):
        for m in (ref, eager, compiled_model):
            m.train(train)
        out_ref, g_ref = _train(ref, xs)
        out_e, g_e = _train(eager, xs)
        out_c, g_c = _train(compiled, xs)
        for u, v, w in zip(out_e + g_e, out_c + g_c, out_ref + g_ref, strict=True):
            torch.testing.assert_close(v, u, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(u, w, atol=1e-4, rtol=1e-4)
        for key, value in eager.state_dict().items():
            torch.testing.assert_close(
                compiled_model.state_dict()[key], value, atol=1e-5, rtol=1e-5, msg=key
            )
    assert int(compiled_model.bn.num_batches_tracked) == 3


def test_compiled_batch_norm_compiles_once():
    """A batch norm module compiled before any eager call (a class the module-tensors cache
    has not seen) compiles one graph for its training steps: nothing traced guards on the
    cache, which the first eager call would fill."""

    class FreshBatchNorm(cnt.BatchNorm2d):  # a class no eager call has seen
        pass

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), FreshBatchNorm(4))
    compiled = torch.compile(model, backend="aot_eager")
    counters = torch._dynamo.utils.counters
    counters.clear()
    for x in _inputs((2, 3, 6, 6), n=3):
        compiled(x).sum().backward()
    model(x)  # an eager call fills the cache: the compiled graph must still hold
    compiled(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert int(model[1].num_batches_tracked) == 5
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# packaging of the torch adapter
# ---------------------------------------------------------------------------------------------
def test_import_does_not_need_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"  # any `import cupy` now raises ImportError
        "import cupynorm.torch as c, torch\n"
        "x = torch.randn(2, 4, 3, requires_grad=True)\n"
        "c.GroupNorm(2, 4)(x).sum().backward()\n"
        "assert torch.ops.cupynorm.group_norm_fwd.default is not None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_public_names():
    for name in cnt.__all__:
        assert getattr(cnt, name) is not None
    assert set(cnt.__all__) >= {
        "replace_norms",
        "group_norm",
        "instance_norm",
        "batch_norm",
        "row_norm_add_mul",
        "RowNormAddMul",
        "GroupNorm",
    }
