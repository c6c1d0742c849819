"""cupynorm.torch on the CPU: drop-in parity with torch.nn, the op plumbing, replace_norms.

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
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from small_cnn import SmallCNN
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import cupynorm
import cupynorm.torch as cnt
from cupynorm.torch import _autograd, _kernels, _library, _reference
from cupynorm.torch import functional as cnf

PAIRS = [
    (cnt.BatchNorm1d, nn.BatchNorm1d),
    (cnt.BatchNorm2d, nn.BatchNorm2d),
    (cnt.BatchNorm3d, nn.BatchNorm3d),
    (cnt.InstanceNorm1d, nn.InstanceNorm1d),
    (cnt.InstanceNorm2d, nn.InstanceNorm2d),
    (cnt.InstanceNorm3d, nn.InstanceNorm3d),
    (cnt.GroupNorm, nn.GroupNorm),
]
PAIR_IDS = [ours.__name__ for ours, _ in PAIRS]

# (N, C, *spatial) inputs per module kind: odd sizes, C = 3 (6 for two groups of 3)
SHAPES = {
    "BatchNorm1d": [(5, 3), (5, 3, 7)],
    "BatchNorm2d": [(4, 3, 7, 1), (2, 3, 5, 3)],
    "BatchNorm3d": [(2, 3, 1, 7, 1), (2, 3, 3, 1, 5)],
    "InstanceNorm1d": [(4, 3, 7), (3, 7)],
    "InstanceNorm2d": [(4, 3, 7, 1), (3, 5, 3)],
    "InstanceNorm3d": [(2, 3, 1, 7, 1), (3, 3, 1, 5)],
    "GroupNorm": [(4, 6, 7), (3, 6, 5, 3)],
}


def _takes_bias(torch_cls: type) -> bool:
    """Whether the installed torch's class has the ``bias`` argument (newer torch only)."""
    return "bias" in inspect.signature(torch_cls).parameters


def _configs(torch_cls: type) -> list[dict]:
    """Constructor kwargs covering affine/bias/track_running_stats/momentum (bias=False only
    where the installed torch has it)."""
    if torch_cls is nn.GroupNorm:
        configs = [dict(affine=True), dict(affine=False)]
        no_bias = dict(affine=True, bias=False)
    else:
        configs = [
            dict(affine=a, track_running_stats=t, momentum=m)
            for a in (True, False)
            for t in (True, False)
            for m in (0.1, None)
        ]
        no_bias = dict(affine=True, bias=False, track_running_stats=True)
    return configs + ([no_bias] if _takes_bias(torch_cls) else [])


def _make(cls: type, torch_cls: type, **kwargs) -> nn.Module:
    if torch_cls is nn.GroupNorm:
        return cls(3, 6, **kwargs)
    return cls(3, **kwargs)


def _cases():
    for ours, theirs in PAIRS:
        for i, cfg in enumerate(_configs(theirs)):
            for shape in SHAPES[ours.__name__]:
                yield pytest.param(ours, theirs, cfg, shape, id=f"{ours.__name__}-cfg{i}-{shape}")


def _randomize(m: nn.Module, seed: int = 0) -> None:
    """Non-default parameters and running statistics (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        if getattr(m, "running_mean", None) is not None:
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)


def _pair(ours: type, theirs: type, cfg: dict, dtype=torch.float32):
    a = _make(ours, theirs, dtype=dtype, **cfg)
    b = _make(theirs, theirs, dtype=dtype, **cfg)
    _randomize(b)
    a.load_state_dict(b.state_dict())
    return a, b


def _run_steps(m: nn.Module, xs: list[torch.Tensor], train: bool):
    """3 SGD steps: returns outputs, input grads and the module after training."""
    m.train(train)
    opt = torch.optim.SGD(m.parameters(), lr=0.1) if list(m.parameters()) else None
    outs, grads = [], []
    for x in xs:
        x = x.clone().requires_grad_()
        y = m(x)
        # a loss whose gradient is not constant (exercises the full backward formula)
        ramp = torch.linspace(-1, 2, y.numel(), dtype=y.dtype).reshape(y.shape)
        (y * ramp + y**2).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
        if opt is not None:
            opt.step()
            opt.zero_grad()
    return outs, grads


def _inputs(shape, n=3, dtype=torch.float32, seed=1, channels_last=False):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=g, dtype=dtype) * 2 + 0.5 for _ in range(n)]
    if channels_last:
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        xs = [x.to(memory_format=fmt) for x in xs]
    return xs


@pytest.fixture
def kernels(monkeypatch):
    """Send CPU tensors down the CUDA route (eager fast path), onto the reference kernels."""
    monkeypatch.setattr(cnf, "_use_kernels", lambda x: True)


@pytest.fixture(params=["eager", "custom_op"])
def kernel_path(request, monkeypatch):
    """The CUDA route on CPU tensors, through the eager Functions or the custom ops."""
    monkeypatch.setattr(cnf, "_use_kernels", lambda x: True)
    if request.param == "custom_op":
        monkeypatch.setattr(cnf, "_traced", lambda x: True)
    return request.param


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
    gn = _library.group_norm_fwd_op
    inorm = _library.instance_norm_fwd_op
    bn = _library.batch_norm_fwd_op
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
            _library.row_norm_add_mul_fwd_op,
            (r(3, 5, 7, grad=True), r(3, 5, 7, grad=True), 1e-5),
        ),
        (
            "gn_bwd",
            _library.group_norm_bwd_op,
            (r(3, 6, 7), r(3, 6, 7), r(3, 3), r(3, 3).abs(), r(6), 3, [True, False, True]),
        ),
        (
            "bn_bwd",
            _library.batch_norm_bwd_op,
            (r(3, 6, 7), r(3, 6, 7), r(6), r(6).abs(), None, True, [True, False, False]),
        ),
        (
            "row_bwd",
            _library.row_norm_add_mul_bwd_op,
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
        "gn_op": lambda x, w, b: _library.group_norm_fwd_op(x, 3, w, b, 1e-5)[0],
        "gn_fn": lambda x, w, b: _autograd._GroupNormFunction.apply(x, 3, w, b, 1e-5)[0],
        "in_op": lambda x, w, b: _library.instance_norm_fwd_op(x, w, b, *stats(), 0.1, 1e-5)[0],
        "in_fn": lambda x, w, b: _autograd._InstanceNormFunction.apply(
            x, w, b, *stats(), 0.1, 1e-5
        )[0],
    }
    for training in (True, False):
        funcs[f"bn_op_{training}"] = lambda x, w, b, t=training: _library.batch_norm_fwd_op(
            x, w, b, *stats(), t, 0.1, 1e-5
        )[0]
        funcs[f"bn_fn_{training}"] = lambda x, w, b, t=training: _autograd._BatchNormFunction.apply(
            x, w, b, *stats(), t, 0.1, 1e-5
        )[0]
    for name, f in funcs.items():
        assert torch.autograd.gradcheck(f, (x, w, b)), name
    assert torch.autograd.gradcheck(
        lambda x, y: _library.row_norm_add_mul_fwd_op(x, y, 1e-5)[0], (x, y)
    )
    assert torch.autograd.gradcheck(
        lambda x, y: _autograd._RowNormAddMulFunction.apply(x, y, 1e-5)[0], (x, y)
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

        y, mean, rstd = _library.group_norm_fwd_op(x.half(), 2, None, None, 1e-5)
        assert mean.shape == rstd.shape == (4, 2) and mean.dtype == torch.float32
        y, mean, rstd = _library.group_norm_fwd_op(x.double(), 2, None, None, 1e-5)
        assert mean.dtype == torch.float64
        y, mean, rstd, nm, nv = _library.batch_norm_fwd_op(
            xcl.half(), None, None, None, None, True, 0.1, 1e-5
        )
        assert mean.shape == (6,) and mean.dtype == torch.float32 and nm is None and nv is None
        assert y.stride() == xcl.stride()
        odd = torch.empty(4, 5, 6, 7, device="cuda").transpose(2, 3)  # neither layout
        assert cnt.group_norm(odd, 5).is_contiguous()
        out, mean, rstd = _library.row_norm_add_mul_fwd_op(x, x, 1e-5)
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
    def batch_norm_fwd(x, weight, bias, running_mean, running_var, training, momentum, eps):
        y, mean, rstd = _reference._batch_norm_fwd_reference(
            x, weight, bias, running_mean, running_var, training, momentum, eps
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
    monkeypatch.setattr(_kernels, "_host_module", _LooseHost)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 6, 5, 7, generator=g).to(memory_format=torch.channels_last)
    odd = torch.randn(3, 6, 7, 5, generator=g).transpose(2, 3)
    w, b = torch.randn(6, generator=g), torch.randn(12, generator=g)[::2]  # b: strided
    for inp in (x, odd, x.half()):
        ww = w.to(inp.dtype)
        real = _kernels._group_norm_fwd_cuda(inp, 3, ww, None, 1e-5)
        _same_meta(real, _kernels._group_norm_fwd_fake(inp, 3, ww, None, 1e-5), "gn fwd")
        dy = torch.ones(()).expand(inp.shape)  # stride 0
        for mask in ([True, True, True], [True, False, False], [False, True, False]):
            for weight in (ww, None):
                args = (dy, inp, real[1], real[2], weight, 3, mask)
                _same_meta(
                    _kernels._group_norm_bwd_cuda(*args),
                    _kernels._norm_bwd_fake(*args),
                    f"gn bwd {mask}",
                )
    rm, rv = torch.zeros(12)[::2], torch.ones(6)  # rm: strided, updated through a copy
    expected_rm = rm.clone()
    real = _kernels._batch_norm_fwd_cuda(x, w, b, rm, rv, True, 0.1, 1e-5)
    _reference._batch_norm_fwd_reference(x, w, b, expected_rm, torch.ones(6), True, 0.1, 1e-5)
    torch.testing.assert_close(rm, expected_rm)
    _same_meta(real, _kernels._batch_norm_fwd_fake(x, w, b, rm, rv, True, 0.1, 1e-5)[:3], "bn")
    running_mean = torch.randn(6)
    op_kernel = _kernels._batch_norm_fwd_op_kernel(_kernels._batch_norm_fwd_cuda)
    y, save_mean, _, new_mean, new_var = op_kernel(x, w, b, running_mean, rv, False, 0.1, 1e-5)
    assert save_mean.data_ptr() != running_mean.data_ptr()  # no op output aliases an input
    assert new_mean is None and new_var is None
    torch.testing.assert_close(save_mean, running_mean)
    xr, yr = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    real = _kernels._row_norm_add_mul_fwd_cuda(xr, yr, 1e-5)
    _same_meta(real, _kernels._row_norm_add_mul_fwd_fake(xr, yr, 1e-5), "row fwd")
    args = (torch.randn(2, 3, 7, generator=g), xr, yr, real[1], real[2])
    _same_meta(
        _kernels._row_norm_add_mul_bwd_cuda(*args),
        _kernels._row_norm_add_mul_bwd_fake(*args),
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


# ---------------------------------------------------------------------------------------------
# replace_norms
# ---------------------------------------------------------------------------------------------
def _all_norms_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3),
        nn.BatchNorm2d(6),
        nn.GroupNorm(2, 6),
        nn.InstanceNorm2d(6, affine=True, track_running_stats=True),
        nn.Sequential(nn.Flatten(2), nn.BatchNorm1d(6), nn.InstanceNorm1d(6)),
        nn.Unflatten(2, (5, 5)),
        nn.Unflatten(3, (5, 1)),
        nn.BatchNorm3d(6),
        nn.InstanceNorm3d(6),
    )


def test_replace_norms_swaps_types_and_keeps_tensors():
    torch.manual_seed(0)
    model = _all_norms_model()
    model.eval()
    model[1].train()  # mixed training modes are kept
    x = torch.randn(2, 3, 7, 7)
    params = {n: p for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    hook_calls = []
    model[2].register_forward_hook(lambda *args: hook_calls.append(1))
    training = {n: m.training for n, m in model.named_modules()}
    before = model(x)

    assert cnt.replace_norms(model) is model
    kinds = {type(m).__module__ for m in model.modules() if isinstance(m, _NORMS)}
    assert kinds == {"cupynorm.torch.modules"}
    for n, p in model.named_parameters():
        assert p is params[n]
    for n, b in model.named_buffers():
        assert b is buffers[n]
    assert {n: m.training for n, m in model.named_modules()} == training
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    assert len(hook_calls) == 2


_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm)


def test_replace_norms_include_exclude():
    model = _all_norms_model()
    cnt.replace_norms(model, include=[nn.BatchNorm2d, nn.GroupNorm], exclude=[nn.GroupNorm])
    assert type(model[1]) is cnt.BatchNorm2d
    assert type(model[2]) is nn.GroupNorm
    assert type(model[3]) is nn.InstanceNorm2d
    cnt.replace_norms(model, exclude=(nn.InstanceNorm1d,))
    assert type(model[2]) is cnt.GroupNorm
    assert type(model[3]) is cnt.InstanceNorm2d
    assert type(model[4][2]) is nn.InstanceNorm1d
    assert type(model[7]) is cnt.BatchNorm3d
    cnt.replace_norms(model, include=nn.InstanceNorm1d)  # a single class is accepted
    assert type(model[4][2]) is cnt.InstanceNorm1d


def test_replace_norms_leaves_others_alone_and_handles_root_and_shared():
    sync = nn.SyncBatchNorm(4)
    ours = cnt.BatchNorm2d(4)
    lazy = nn.LazyBatchNorm2d()
    shared = nn.GroupNorm(2, 4)
    model = nn.ModuleList([sync, ours, lazy, shared, nn.Sequential(shared)])
    cnt.replace_norms(model)
    assert type(sync) is nn.SyncBatchNorm
    assert type(ours) is cnt.BatchNorm2d
    assert type(lazy) is nn.LazyBatchNorm2d
    assert type(shared) is cnt.GroupNorm and model[4][0] is shared
    root = nn.BatchNorm1d(3)
    assert cnt.replace_norms(root) is root and type(root) is cnt.BatchNorm1d


def test_replace_norms_state_dict_and_device_dtype():
    model = _all_norms_model().to(torch.float64)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    cnt.replace_norms(model)
    assert list(model.state_dict()) == list(sd)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]) and v.dtype == sd[k].dtype
    fresh = _all_norms_model().to(torch.float64)
    fresh.load_state_dict(model.state_dict(), strict=True)


def test_replace_norms_errors():
    with pytest.raises(ValueError, match="include takes classes among"):
        cnt.replace_norms(nn.Sequential(), include=[nn.LayerNorm])
    with pytest.raises(ValueError, match="exclude takes classes among"):
        cnt.replace_norms(nn.Sequential(), exclude=[nn.SyncBatchNorm])
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        cnt.replace_norms([nn.BatchNorm2d(3)])


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
        monkeypatch.setattr(cnf, "_use_kernels", lambda x: True)
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
        monkeypatch.setattr(cnf, "_use_kernels", lambda x: True)
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
        monkeypatch.setattr(cnf, "_use_kernels", lambda x: True)
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


# ---------------------------------------------------------------------------------------------
# replace_norms on subclasses of the torch.nn norms (as timm, torchvision, diffusers define them)
# ---------------------------------------------------------------------------------------------
class _TaggedGroupNorm(nn.GroupNorm):
    """Inherits forward; adds an attribute (a library's own GroupNorm)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = "kept"


class _RewrittenGroupNorm(nn.GroupNorm):
    """Overrides forward with the same math (timm's GroupNorm)."""

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class _BatchNormReLU(nn.BatchNorm2d):
    """A norm and an activation in one module (timm's BatchNormAct2d): not a plain norm."""

    def forward(self, x):
        return torch.relu(super().forward(x))


class _RewrittenBatchNorm2d(nn.BatchNorm2d):
    """Overrides forward with torch's training logic (running statistics updated)."""

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        return F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training,
            self.momentum,
            self.eps,
        )


class _NormDropAct(nn.BatchNorm2d):
    """The shape of timm's BatchNormAct2d: torch's norm, then its drop and act submodules."""

    def __init__(self, num_features, drop=None, act=None):
        super().__init__(num_features)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.ReLU(inplace=True)

    def forward(self, x):
        x = F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training,
            self.momentum,
            self.eps,
        )
        if self.training:
            self.num_batches_tracked.add_(1)
        return self.act(self.drop(x))


def test_replace_norms_converts_norm_act_subclasses():
    """A norm followed by its own drop and act submodules (timm's norm-act layers) keeps them
    after cupynorm's norm; a random drop (training Dropout) makes it no plain tail: left alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), _NormDropAct(6), _NormDropAct(6, act=nn.SiLU()))
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnt.replace_norms(model)
    for layer in model[1:]:
        assert isinstance(layer, cnt.BatchNorm2d) and isinstance(layer, _NormDropAct)
    assert type(model[1]) is type(model[2])  # one class per subclass and tail
    assert type(model[1]).forward not in (cnt.BatchNorm2d.forward, _NormDropAct.forward)
    x = torch.randn(2, 3, 7, 7)
    outs, grads = _run_steps(model, [x] * 2, train=True)
    outs_r, grads_r = _run_steps(reference, [x] * 2, train=True)
    for u, v in zip(outs + grads, outs_r + grads_r, strict=True):  # CPU: torch's own math
        torch.testing.assert_close(u, v, atol=0, rtol=0)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=0, rtol=0, msg=key)

    dropping = nn.Sequential(_NormDropAct(4, drop=nn.Dropout(0.5)))
    with pytest.warns(UserWarning, match=r"_NormDropAct \(x1\)"):
        cnt.replace_norms(dropping)
    assert type(dropping[0]) is _NormDropAct


def test_replace_norms_converts_subclasses_that_compute_the_same():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3),
        _TaggedGroupNorm(2, 6),
        _RewrittenGroupNorm(3, 6),
        _RewrittenBatchNorm2d(6),
    )
    reference = copy.deepcopy(model)
    bn_state = {k: v.clone() for k, v in model[3].state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left alone: no warning
        cnt.replace_norms(model)
    for key, value in model[3].state_dict().items():  # the probe ran on copies
        assert torch.equal(value, bn_state[key]), key
    assert isinstance(model[1], cnt.GroupNorm) and isinstance(model[1], _TaggedGroupNorm)
    assert model[1].tag == "kept"
    assert isinstance(model[2], cnt.GroupNorm) and isinstance(model[2], _RewrittenGroupNorm)
    assert isinstance(model[3], cnt.BatchNorm2d) and isinstance(model[3], _RewrittenBatchNorm2d)
    assert type(model[1]).__name__ == "_TaggedGroupNorm"
    assert type(model[1]).forward is cnt.GroupNorm.forward  # cupynorm's forward runs
    assert cnt.replace_norms(nn.Sequential(_RewrittenGroupNorm(3, 6)))[0].__class__ is type(
        model[2]
    )  # one class per subclass
    x = torch.randn(2, 3, 7, 7)
    outs, grads = _run_steps(model, [x] * 2, train=True)
    outs_r, grads_r = _run_steps(reference, [x] * 2, train=True)
    for u, v in zip(outs + grads, outs_r + grads_r, strict=True):  # CPU: torch's own math
        torch.testing.assert_close(u, v, atol=0, rtol=0)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=0, rtol=0, msg=key)


def test_replace_norms_leaves_other_subclasses_alone_and_says_so():
    model = nn.Sequential(_BatchNormReLU(4), nn.Sequential(_BatchNormReLU(4)), nn.GroupNorm(2, 4))
    with pytest.warns(UserWarning, match=r"_BatchNormReLU \(x2\)"):
        cnt.replace_norms(model)
    assert type(model[0]) is _BatchNormReLU and type(model[1][0]) is _BatchNormReLU
    assert type(model[2]) is cnt.GroupNorm


def test_replace_norms_include_exclude_cover_subclasses():
    model = nn.Sequential(_TaggedGroupNorm(2, 4), _RewrittenBatchNorm2d(4))
    cnt.replace_norms(model, exclude=[nn.GroupNorm])
    assert type(model[0]) is _TaggedGroupNorm
    assert isinstance(model[1], cnt.BatchNorm2d)


def test_replace_norms_timm_norms():
    """timm's own norm layers, where timm is installed (the GPU machine): its GroupNorm is a plain
    GroupNorm; BatchNormAct2d, GroupNormAct and GroupNorm1Act are a norm then their drop and act
    submodules. All are converted and compute what timm's modules compute; a BatchNormAct2d with
    a training-mode drop (random) is left alone, with a warning."""
    layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    model = nn.Sequential(
        layers.GroupNorm(32, num_groups=8),
        layers.BatchNormAct2d(32),
        layers.GroupNormAct(32, num_groups=8, act_layer=nn.SiLU),
        layers.GroupNorm1Act(32),
    )
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnt.replace_norms(model)
    assert isinstance(model[0], cnt.GroupNorm) and isinstance(model[0], layers.GroupNorm)
    assert isinstance(model[1], cnt.BatchNorm2d) and isinstance(model[1], layers.BatchNormAct2d)
    assert isinstance(model[2], cnt.GroupNorm) and isinstance(model[2], layers.GroupNormAct)
    assert isinstance(model[3], cnt.GroupNorm) and isinstance(model[3], layers.GroupNorm1Act)
    x = torch.randn(2, 32, 5, 6)
    outs, grads = _run_steps(model, [x] * 2, train=True)
    outs_r, grads_r = _run_steps(reference, [x] * 2, train=True)
    for u, v in zip(outs + grads, outs_r + grads_r, strict=True):  # CPU: torch's own math
        torch.testing.assert_close(u, v, atol=0, rtol=0)
    dropping = nn.Sequential(layers.BatchNormAct2d(32, drop_layer=nn.Dropout))
    with pytest.warns(UserWarning, match="BatchNormAct2d"):
        cnt.replace_norms(dropping)
    assert type(dropping[0]) is layers.BatchNormAct2d


@pytest.mark.parametrize(
    "name, norms",
    [("efficientnet_b0", 49), ("mobilenetv3_small_100", 34), ("resnet50_gn", 53)],
)
def test_replace_norms_timm_models(name, norms):
    """Whole timm models (norm-act layers, timm's GroupNorm): every norm converted, no warning,
    and on the CPU the converted model computes exactly what timm's does."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnt.replace_norms(model)
    kinds = (cnt.BatchNorm2d, cnt.GroupNorm)
    assert sum(isinstance(m, kinds) for m in model.modules()) == norms
    x = torch.randn(2, 3, 64, 64)
    for m in (model, reference):
        m.train()
    torch.testing.assert_close(model(x), reference(x), atol=0, rtol=0)


def test_raise_like_torch_without_a_meta_kernel_says_ours():
    """When torch has no meta kernel for the call, cupynorm's own message is raised."""
    from cupynorm.torch import _checks

    def no_meta(x):
        raise NotImplementedError("no meta kernel")

    with pytest.raises(cupynorm.InvalidInputError, match="ours"):
        _checks.raise_like_torch(no_meta, (torch.randn(2),), ours="ours")
    _checks.raise_like_torch(no_meta, (torch.randn(2),))  # nothing of ours: the call goes on
