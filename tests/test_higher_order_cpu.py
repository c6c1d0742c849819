"""Higher-order autograd of cupynorm.torch on the CPU (cupynorm/torch/_higher_order.py): double
backward through the eager Functions, the custom ops and the replay Function, forward-mode AD
and torch.func transforms (the composite route), with the reference kernels standing in for the
CUDA ones (the route patched as tests/conftest.py's ``kernels``, but keeping its transform check:
the routing's real ``composite_only``). tests/test_higher_order_gpu.py: the same on CUDA.
"""

from __future__ import annotations

import math
import types

import pytest

torch = pytest.importorskip("torch")  # a CuPy-only install (CI) skips this module

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.autograd import forward_ad as fwAD  # noqa: E402
from torch_cpu_helpers import patch_route  # noqa: E402

import cupynorm.torch as cnt  # noqa: E402
from cupynorm.torch import (  # noqa: E402
    _autograd,
    _batch_norm,
    _channel_norm,
    _group_norm,
    _higher_order,
    _reference,
    _replay,
    _row_norm,
    sync_batchnorm,
)

D = torch.float64


@pytest.fixture
def on_kernels(monkeypatch):
    """CPU tensors down the kernels' route (eager Functions) unless a transform or a forward-AD
    level is active: the route's own condition, without its CUDA test."""
    kernels = lambda x, kind: not _higher_order.composite_only()  # noqa: E731
    patch_route(monkeypatch.setattr, "_use_kernels", kernels)


@pytest.fixture(params=["eager", "custom_op"])
def path(request, on_kernels, monkeypatch):
    """The eager Functions, or the custom ops (as under a dispatch mode)."""
    if request.param == "custom_op":
        patch_route(monkeypatch.setattr, "_traced", lambda x: True)
    return request.param


def _random(*shape, grad=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(shape, generator=g, dtype=D).to(device).requires_grad_(grad)


def _running_stats(device="cpu"):
    """Running statistics (new ones: the calls in training update them)."""
    return (
        torch.linspace(-0.5, 0.5, 6, dtype=D, device=device),
        torch.linspace(0.5, 1.5, 6, dtype=D, device=device),
    )


def _cases(device: str = "cpu") -> dict:
    """name -> (cupynorm's call, torch's composite of the same, the inputs' maker), float64
    tensors on ``device`` (tests/test_higher_order_gpu.py: "cuda")."""

    def _r(*shape, grad=True, seed=0):
        return _random(*shape, grad=grad, seed=seed, device=device)

    def _stats():
        return _running_stats(device)

    row = lambda: (_r(3, 4, 5), _r(5, seed=1), _r(5, seed=2))  # noqa: E731
    grid = lambda: (_r(2, 6, 3, 4), _r(6, seed=1), _r(6, seed=2))  # noqa: E731
    relu = nn.functional.relu
    silu = nn.functional.silu

    def over_channels(fn):
        return lambda x, *a: fn(x.movedim(1, -1), (x.shape[1],), *a).movedim(-1, 1)

    rm, rv = _stats()
    return {
        "layer_norm": (
            lambda x, w, b: cnt.layer_norm(x, (5,), w, b),
            lambda x, w, b: F.layer_norm(x, (5,), w, b),
            row,
        ),
        "layer_norm_2dims": (
            lambda x, w, b: cnt.layer_norm(x, (4, 5), w, b),
            lambda x, w, b: F.layer_norm(x, (4, 5), w, b),
            lambda: (_r(3, 4, 5), _r(4, 5, seed=1), _r(4, 5, seed=2)),
        ),
        "rms_norm": (
            lambda x, w: cnt.rms_norm(x, (5,), w, 1e-5),
            lambda x, w: F.rms_norm(x, (5,), w, 1e-5),
            lambda: row()[:2],
        ),
        "add_layer_norm": (
            lambda x, r, w, b: torch.cat(cnt.add_layer_norm(x, r, (5,), w, b)),
            lambda x, r, w, b: torch.cat((F.layer_norm(x + r, (5,), w, b), x + r)),
            lambda: (_r(3, 4, 5), _r(3, 4, 5, seed=3), *row()[1:]),
        ),
        "add_rms_norm": (
            lambda x, r, w: torch.cat(cnt.add_rms_norm(x, r, (5,), w, 1e-5)),
            lambda x, r, w: torch.cat((F.rms_norm(x + r, (5,), w, 1e-5), x + r)),
            lambda: (_r(3, 4, 5), _r(3, 4, 5, seed=3), row()[1]),
        ),
        "llama_rms_norm": (
            lambda x, w: cnt.llama_rms_norm(x.float(), w.float(), 1e-6).double(),
            lambda x, w: (w.float() * _llama(x.float(), 1e-6)).double(),
            lambda: row()[:2],
        ),
        "group_norm": (
            lambda x, w, b: cnt.group_norm(x, 3, w, b),
            lambda x, w, b: F.group_norm(x, 3, w, b),
            grid,
        ),
        "group_norm_channels_last": (
            lambda x, w, b: cnt.group_norm(x.to(memory_format=torch.channels_last), 2, w, b),
            lambda x, w, b: F.group_norm(x.to(memory_format=torch.channels_last), 2, w, b),
            grid,
        ),
        "group_norm_act_silu_shift": (
            lambda x, w, b, s: cnt.group_norm_act(x, 3, w, b, activation="silu", shift=s),
            lambda x, w, b, s: silu(F.group_norm(x + s[:, :, None, None], 3, w, b)),
            lambda: (*grid(), _r(2, 6, seed=4)),
        ),
        "group_norm_act_relu": (
            lambda x, w, b: cnt.group_norm_act(x, 3, w, b, activation="relu"),
            lambda x, w, b: relu(F.group_norm(x, 3, w, b)),
            grid,
        ),
        "instance_norm": (
            lambda x, w, b: cnt.instance_norm(x, weight=w, bias=b),
            lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
            grid,
        ),
        "instance_norm_running_stats": (
            lambda x, w, b: cnt.instance_norm(x, *_stats(), w, b),
            lambda x, w, b: F.instance_norm(x, *_stats(), w, b),
            grid,
        ),
        "instance_norm_running_stats_used": (
            lambda x, w, b: cnt.instance_norm(x, rm, rv, w, b, use_input_stats=False),
            lambda x, w, b: F.instance_norm(x, rm, rv, w, b, use_input_stats=False),
            grid,
        ),
        "batch_norm_training": (
            lambda x, w, b: cnt.batch_norm(x, *_stats(), w, b, training=True),
            lambda x, w, b: F.batch_norm(x, *_stats(), w, b, training=True),
            grid,
        ),
        "batch_norm_eval": (
            lambda x, w, b: cnt.batch_norm(x, rm, rv, w, b),
            lambda x, w, b: F.batch_norm(x, rm, rv, w, b),
            grid,
        ),
        "batch_norm_act_silu_residual": (
            lambda x, w, b, z: cnt.batch_norm_act(x, None, None, w, b, True, 0.1, 1e-5, z, "silu"),
            lambda x, w, b, z: silu(F.batch_norm(x, None, None, w, b, True) + z),
            lambda: (*grid(), _r(2, 6, 3, 4, seed=5)),
        ),
        "batch_norm_act_relu_eval": (
            lambda x, w, b, z: cnt.batch_norm_act(x, rm, rv, w, b, False, 0.1, 1e-5, z, "relu"),
            lambda x, w, b, z: relu(F.batch_norm(x, rm, rv, w, b) + z),
            lambda: (*grid(), _r(2, 6, 3, 4, seed=5)),
        ),
        "layer_norm2d": (
            lambda x, w, b: cnt.layer_norm2d(x, w, b),
            lambda x, w, b: over_channels(F.layer_norm)(x, w, b),
            grid,
        ),
        "rms_norm2d_channels_last": (
            lambda x, w: cnt.rms_norm2d(x.to(memory_format=torch.channels_last), w, 1e-5),
            lambda x, w: over_channels(F.rms_norm)(
                x.to(memory_format=torch.channels_last), w, 1e-5
            ),
            lambda: grid()[:2],
        ),
        "row_norm_add_mul": (
            lambda x, y: cnt.row_norm_add_mul(x, y),
            lambda x, y: (F.layer_norm(x, (5,)) + y) * y,
            lambda: (_r(3, 4, 5), _r(3, 4, 5, seed=3)),
        ),
    }


def _llama(x, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


CASES = _cases()
#: float32 inside (Llama's formula): finite differences of float64 do not apply
FLOAT32_INSIDE = {"llama_rms_norm"}


# ---------------------------------------------------------------------------------------------
# double backward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(set(CASES) - FLOAT32_INSIDE))
def test_gradgradcheck(path, name):
    ours, _theirs, make = CASES[name]
    inputs = make()
    y = ours(*inputs)
    node = type(y.grad_fn).__name__
    if path == "eager" and name not in ("add_layer_norm", "add_rms_norm"):
        assert "Function" in node or "Cat" in node, node  # the kernels' Function
    assert torch.autograd.gradgradcheck(ours, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_second_derivatives_are_torchs(on_kernels, name):
    """Gradient of a function of the first gradient (a gradient penalty, a Hessian-vector
    product): the same as torch's through its own ops."""
    ours, theirs, make = CASES[name]
    results = []
    for fn in (ours, theirs):
        inputs = make()
        y = fn(*inputs)
        dy = torch.linspace(-1, 2, y.numel(), dtype=y.dtype).reshape(y.shape)
        grads = torch.autograd.grad(y, inputs, dy, create_graph=True)
        penalty = sum((g * torch.linspace(0.5, 1.5, g.numel(), dtype=D).view(g.shape)).square()
                      .sum() for g in grads)  # fmt: skip
        second = torch.autograd.grad(penalty, inputs, allow_unused=True, materialize_grads=True)
        results.append((grads, second))
    tol = dict(rtol=1e-4, atol=1e-4) if name in FLOAT32_INSIDE else dict(rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(results[0], results[1], **tol)


def _count_calls(monkeypatch, calls: dict, key: str, module, name: str) -> None:
    """Count ``module.name``'s calls in ``calls[key]`` (the function still runs)."""
    original = getattr(module, name)

    def wrapper(*args):
        calls[key] += 1
        return original(*args)

    monkeypatch.setattr(module, name, wrapper)


def test_first_order_backward_takes_the_kernels(on_kernels, monkeypatch):
    """A first-order backward runs the backward kernel (here its CPU stand-in) and nothing of
    the composite; create_graph=True the composite and no kernel."""
    calls = {"kernel": 0, "composite": 0}

    _count_calls(monkeypatch, calls, "kernel", _row_norm, "_row_norm_bwd_reference")
    _count_calls(monkeypatch, calls, "composite", _higher_order, "_row_norm_bwd_reference")
    x, w, b = _random(3, 4, 5), _random(5), _random(5)
    y = cnt.layer_norm(x, (5,), w, b)
    assert type(y.grad_fn).__name__ == "_RowNormFunctionBackward"
    torch.autograd.grad(y.sum(), (x, w, b))
    assert calls == {"kernel": 1, "composite": 0}
    torch.autograd.grad(cnt.layer_norm(x, (5,), w, b).sum(), (x, w, b), create_graph=True)
    assert calls == {"kernel": 1, "composite": 1}


def test_double_backward_of_a_module_with_retained_graph(on_kernels):
    """A backward bound to the forward's program (BatchNorm: ctx.bound) and a second backward on
    the same graph: the first plain, the second create_graph, as torch's module."""
    ours, theirs = cnt.BatchNorm2d(6).double(), nn.BatchNorm2d(6).double()
    for layer in (ours, theirs):
        x = _random(2, 6, 3, 4)
        y = layer(x)
        (g1,) = torch.autograd.grad(y.square().sum(), x, retain_graph=True)
        (g2,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        layer.result = (g1, g2, torch.autograd.grad(g2.square().sum(), x)[0])
    torch.testing.assert_close(ours.result, theirs.result)
    torch.testing.assert_close(ours.running_var, theirs.running_var)  # updated once each


# ---- the replay Function: a replayed call's save and grads, its forward the reference -------
def _replayed(save, info, forward):
    """f(x, a, b, c): ``forward``'s outputs (the reference kernel's, standing for a recorded
    program's run) through the replay Function with the family's ``save``."""

    def call(x, a, b, c):
        detached = [t if t is None else t.detach() for t in (x, a, b, c)]
        program = types.SimpleNamespace(run=lambda *_: forward(*detached))
        replayed = _replay._Replayed(program, None, None, (), (), save, info)
        return _autograd._ReplayFunction.apply(x, a, b, c, replayed)

    return call


def _replay_cases():
    """name -> (f(x, a, b, c) through the replay Function, the inputs' maker)."""
    ref, rand = _reference, _random
    grid = lambda *last: lambda: (rand(2, 6, 3, 4), rand(6), rand(6, seed=1), *last)  # noqa: E731
    row_save, group_save = _row_norm._row_norm_replay_save, _group_norm._group_norm_replay_save
    bn_save, bn_ref = _batch_norm._batch_norm_replay_save, ref._batch_norm_fwd_reference
    return {
        "row_norm": (
            _replayed(row_save, (5, False, (5,)),
                      lambda x, r, w, b: ref._row_norm_fwd_reference(x, r, w, b, 1, 1e-5, False)),
            lambda: (rand(3, 4, 5), None, rand(5), rand(5, seed=1)),
        ),
        "add_rms_norm": (
            _replayed(row_save, (5, False, (5,)),
                      lambda x, r, w, b: ref._row_norm_fwd_reference(x, r, w, b, 1, 1e-5, True)),
            lambda: (rand(3, 4, 5), rand(3, 4, 5, seed=2), rand(5), None),
        ),
        "group_norm": (
            _replayed(group_save, (3, None),
                      lambda x, w, b, s: ref._group_norm_fwd_reference(x, 3, w, b, 1e-5)),
            grid(None),
        ),
        "group_norm_act_silu_shift": (
            _replayed(group_save, (3, "silu"),
                      lambda x, w, b, s: ref._group_norm_fwd_reference(x, 3, w, b, 1e-5,
                                                                       act="silu", shift=s)),
            lambda: grid(rand(2, 6, seed=2))(),
        ),
        "batch_norm_training": (
            _replayed(bn_save, (True, "identity"),
                      lambda x, w, b, z: bn_ref(x, w, b, None, None, True, 0.1, 1e-5)),
            grid(None),
        ),
        "batch_norm_act_silu_residual": (
            _replayed(bn_save, (True, "silu"),
                      lambda x, w, b, z: bn_ref(x, w, b, None, None, True, 0.1, 1e-5, z, "silu")),
            lambda: grid(rand(2, 6, 3, 4, seed=2))(),
        ),
        "channel_norm": (
            _replayed(_channel_norm._channel_norm_replay_save, None,
                      lambda x, w, b, _: ref._channel_norm_fwd_reference(x, w, b, 1e-5, False)),
            grid(None),
        ),
    }  # fmt: skip


REPLAY_CASES = _replay_cases()


@pytest.mark.parametrize("name", sorted(REPLAY_CASES))
def test_gradgradcheck_replay_function(name):
    fn, make = REPLAY_CASES[name]
    inputs = make()

    def first(*tensors):  # the replay Function's outputs (y, or y and the sum)
        it = iter(tensors)
        args = [None if t is None else next(it) for t in inputs]
        out = fn(*args)
        return torch.cat(out) if isinstance(out, tuple) else out

    given = [t for t in inputs if t is not None]
    assert type(first(*given).grad_fn.next_functions[0][0] if name == "add_rms_norm"
                else first(*given).grad_fn).__name__ == "_ReplayFunctionBackward"  # fmt: skip
    assert torch.autograd.gradgradcheck(first, given, eps=1e-6, atol=1e-5, rtol=1e-4)


# ---- SyncBatchNorm: torch's layer has no double backward over a process group ---------------
def test_sync_batchnorm_double_backward_raises_torchs_error(monkeypatch):
    """The synchronised Function (one process standing for the group: its collectives are
    the identity) gives torch's first-order gradients, and a second backward raises the error
    torch's SyncBatchNorm raises (its backward ops have no derivative)."""
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    x, w, b = _random(4, 6, 3), _random(6), _random(6, seed=1)
    args = (x, w, b, None, None, 1e-5, 0.1, None, 1)
    y = sync_batchnorm._SyncBatchNormFunction.apply(*args)
    expected = torch.autograd.grad(F.batch_norm(x, None, None, w, b, True).square().sum(), x)
    (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    torch.testing.assert_close(dx, expected[0])
    with pytest.raises(RuntimeError, match=r"^derivative for aten::batch_norm_backward_elemt is"):
        dx.sum().backward()
    y = sync_batchnorm._SyncBatchNormFunction.apply(*args)
    (dw,) = torch.autograd.grad(y.square().sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match=r"^derivative for aten::batch_norm_backward_reduce"):
        dw.sum().backward()


def test_sync_batchnorm_without_a_group_has_double_backward(on_kernels):
    """Without a process group SyncBatchNorm is batch norm (torch's too): double backward."""
    layer = cnt.SyncBatchNorm(6).double()
    x = _random(2, 6, 3, 4)
    assert torch.autograd.gradgradcheck(lambda t: layer(t), (x,), eps=1e-6, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# forward-mode AD and torch.func transforms: the composite route
# ---------------------------------------------------------------------------------------------
def _same_as_torch(transform, ours, theirs, *args) -> None:
    """``transform(ours)(*args)`` is ``transform(theirs)(*args)``, or raises torch's error."""
    try:
        expected = transform(theirs)(*args)
    except RuntimeError as error:
        with pytest.raises(RuntimeError) as raised:
            transform(ours)(*args)
        assert str(raised.value) == str(error)
        return
    torch.testing.assert_close(transform(ours)(*args), expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_jvp_is_torchs(on_kernels, name):
    """torch.func.jvp: torch's tangents (or torch's error: its group norm of a channels_last
    input under jvp)."""
    ours, theirs, make = CASES[name]
    inputs = tuple(t.detach() for t in make())
    tangents = tuple(torch.randn_like(t) for t in inputs)

    def jvp(fn):
        return lambda: torch.func.jvp(fn, inputs, tangents)

    _same_as_torch(jvp, ours, theirs)


@pytest.mark.parametrize("name", ["layer_norm", "group_norm", "batch_norm_eval", "rms_norm2d_"
                                  "channels_last", "row_norm_add_mul"])  # fmt: skip
def test_forward_ad_dual_level_against_finite_differences(on_kernels, name):
    ours, _theirs, make = CASES[name]
    inputs = [t.detach() for t in make()]
    tangents = [torch.randn_like(t) for t in inputs]
    with fwAD.dual_level():
        duals = [fwAD.make_dual(t, v) for t, v in zip(inputs, tangents, strict=True)]
        out = ours(*duals)
        tangent = fwAD.unpack_dual(out).tangent
    assert fwAD._current_level == -1  # the level closed: kernels again
    h = 1e-6
    plus = ours(*(t + h * v for t, v in zip(inputs, tangents, strict=True)))
    minus = ours(*(t - h * v for t, v in zip(inputs, tangents, strict=True)))
    torch.testing.assert_close(tangent, (plus - minus) / (2 * h), rtol=1e-5, atol=1e-6)


def test_without_the_composite_route_transforms_fail(monkeypatch):
    """What the composite route spares: the kernels' Function under jvp raises (so the tests
    above check the route, not a path that works anyway)."""
    patch_route(monkeypatch.setattr, "_use_kernels", lambda x, kind: True)
    x, w, b = (t.detach() for t in CASES["layer_norm"][2]())
    with pytest.raises(RuntimeError):
        torch.func.jvp(lambda t: cnt.layer_norm(t, (5,), w, b), (x,), (torch.ones_like(x),))


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_is_a_loop(on_kernels, name):
    """torch.func.vmap: a loop of plain calls (or torch's error: running statistics updated in
    place, a channels_last copy of a batched tensor)."""
    ours, theirs, make = CASES[name]
    inputs = [t.detach() for t in make()]
    stacked = [torch.stack([t * (1 + 0.1 * i) for i in range(3)]) for t in inputs]
    _same_as_torch(torch.func.vmap, ours, theirs, *stacked)
    try:
        torch.func.vmap(theirs)(*stacked)
    except RuntimeError:
        return
    loop = torch.stack([ours(*(s[i] for s in stacked)) for i in range(3)])
    torch.testing.assert_close(torch.func.vmap(ours)(*stacked), loop)


def test_vmap_of_batch_norm_training_raises_torchs_error(on_kernels):
    x = torch.randn(3, 2, 6, 4, 4)
    errors = []
    for layer in (nn.BatchNorm2d(6), cnt.BatchNorm2d(6)):
        with pytest.raises(RuntimeError) as error:
            torch.func.vmap(layer)(x)
        errors.append(str(error.value))
    assert errors[0] == errors[1]
    assert "running_mean or running_var" in errors[0]


def test_jacrev_and_hessian_of_layer_norm(on_kernels):
    x, w, b = (t.detach() for t in CASES["layer_norm"][2]())
    x = x[0, 0]
    for transform in (torch.func.jacrev, torch.func.jacfwd, torch.func.hessian):
        ours = transform(lambda t: cnt.layer_norm(t, (5,), w, b).square().sum())(x)
        theirs = transform(lambda t: F.layer_norm(t, (5,), w, b).square().sum())(x)
        torch.testing.assert_close(ours, theirs)


class _GroupNormNet(nn.Module):
    def __init__(self, norm: type) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm1 = norm(4, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.norm2 = norm(2, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.norm2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def test_per_sample_gradients_of_a_group_norm_net(on_kernels):
    """vmap(grad(functional_call)) per sample against a loop of plain backwards (which take
    the kernels' Functions)."""
    torch.manual_seed(0)
    net = _GroupNormNet(cnt.GroupNorm).double()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, target = torch.randn(4, 3, 6, 6, dtype=D), torch.tensor([0, 3, 1, 4])

    def loss(p, xi, ti):
        logits = torch.func.functional_call(net, p, (xi[None],))
        return F.cross_entropy(logits, ti[None])

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, target)
    for i in range(4):
        net.zero_grad()
        out = net(x[i : i + 1])
        assert type(out.grad_fn).__name__ != "ErrorNode"
        F.cross_entropy(out, target[i : i + 1]).backward()
        for k, p in net.named_parameters():
            torch.testing.assert_close(per_sample[k][i], p.grad)
    norm_grad_fn = net.norm1(torch.randn(1, 8, 2, 2, dtype=D, requires_grad=True)).grad_fn
    assert type(norm_grad_fn).__name__ == "_GroupNormFunctionBackward"


class _Critic(nn.Module):
    def __init__(self, norm: type) -> None:
        super().__init__()
        self.fc1, self.norm1 = nn.Linear(6, 16), norm(16)
        self.fc2, self.norm2 = nn.Linear(16, 16), norm(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        x = F.leaky_relu(self.norm1(self.fc1(x)), 0.2)
        x = F.silu(self.norm2(self.fc2(x)))
        return self.out(x)


def _wgan_gp_step(critic, real, fake, alpha):
    """One WGAN-GP critic step: Wasserstein loss plus 10 * (|grad_x critic| - 1)^2."""
    opt = torch.optim.SGD(critic.parameters(), lr=0.05)
    mixed = (alpha * real + (1 - alpha) * fake).requires_grad_()
    (g,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
    penalty = ((g.norm(dim=1) - 1) ** 2).mean()
    loss = critic(fake).mean() - critic(real).mean() + 10 * penalty
    opt.zero_grad()
    loss.backward()
    grads = [p.grad.clone() for p in critic.parameters()]
    opt.step()
    return loss.detach(), grads


def test_wgan_gp_step_with_a_layer_norm_critic_is_torchs(on_kernels):
    torch.manual_seed(1)
    ours = _Critic(cnt.LayerNorm).double()
    theirs = _Critic(nn.LayerNorm).double()
    theirs.load_state_dict(ours.state_dict())
    real, fake, alpha = torch.randn(8, 6, dtype=D), torch.randn(8, 6, dtype=D), torch.rand(8, 1)
    for _ in range(2):
        a = _wgan_gp_step(ours, real, fake, alpha.double())
        b = _wgan_gp_step(theirs, real, fake, alpha.double())
        torch.testing.assert_close(a, b)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert "RowNormFunction" in type(ours.norm1(torch.randn(2, 16, dtype=D)).grad_fn).__name__


def test_eager_function_under_a_transform_defers_to_torchs_apply():
    """Should a transform reach an eager Function (the route sends none), ``run`` is torch's
    apply, with its answer for an old-style Function (no setup_context), not the C++ apply on
    wrapped tensors."""
    x = torch.randn(2, 6, 3)
    with pytest.raises(RuntimeError, match="must override the setup_context staticmethod"):
        torch.func.grad(
            lambda t: _group_norm._GroupNormFunction.run(t, 3, None, None, 1e-5)[0].sum()
        )(x)


def test_composite_only_follows_the_transform_and_level():
    assert not _higher_order.composite_only()
    with fwAD.dual_level():
        assert _higher_order.composite_only()
    assert not _higher_order.composite_only()
    seen = []
    torch.func.vmap(lambda t: seen.append(_higher_order.composite_only()) or t)(torch.ones(2, 1))
    torch.func.grad(lambda t: seen.append(_higher_order.composite_only()) or t.sum())(torch.ones(2))
    assert seen == [True, True]


def _packed_bits(flat):
    """Booleans packed 8 to a byte, bit e of byte j for element 8j + e (the kernels' order)."""
    padded = torch.cat((flat, flat.new_zeros(-flat.numel() % 8))).reshape(-1, 8).to(torch.int32)
    return (padded << torch.arange(8, dtype=torch.int32)).sum(dim=1).to(torch.uint8)


def test_unpack_relu_mask_reads_the_kernels_bit_order():
    """Bit e of byte j is element 8j + e of x's memory order (channels_last: N, H, W, C)."""
    x = torch.randn(2, 3, 2, 3).to(memory_format=torch.channels_last)
    packed = _packed_bits((x > 0).permute(0, 2, 3, 1).reshape(-1))
    assert torch.equal(_higher_order.unpack_relu_mask(packed, x), x > 0)
    y = torch.randn(2, 3, 5)
    packed = _packed_bits((y > 0).reshape(-1))
    assert math.prod(packed.shape) == math.ceil(y.numel() / 8)
    assert torch.equal(_higher_order.unpack_relu_mask(packed, y), y > 0)
