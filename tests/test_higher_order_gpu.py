"""Higher-order autograd of cupynorm.torch on CUDA tensors, through the real route: double
backward through the eager Functions and the replayed calls (a call repeated with the same key
is replayed), the fused batch norm's ReLU mask, forward-mode AD and torch.func transforms on
torch's composite path, per-sample gradients, a gradient-penalty step; the first-order backward
still on the kernels. The CPU twin: tests/test_higher_order_cpu.py (its cases, on "cuda" here).
"""

from __future__ import annotations

import pytest
from conftest import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

if cuda_available():
    import torch
    import torch.nn.functional as F
    from test_higher_order_cpu import (
        FLOAT32_INSIDE,
        _count_calls,
        _Critic,
        _GroupNormNet,
        _same_as_torch,
        _wgan_gp_step,
    )
    from test_higher_order_cpu import _cases as _cases_on
    from torch import nn
    from torch.autograd import forward_ad as fwAD

    import cupynorm.torch as cnt
    from cupynorm.torch import _higher_order, _row_norm, sync_batchnorm

    CASES = _cases_on("cuda")
    D = torch.float64
else:
    CASES, FLOAT32_INSIDE = {}, set()

NAMES = sorted(CASES) or ["none"]


def _node(y) -> str:
    """The name of y's node, or of the node under it when that is a view's (a channels_last
    channel norm's permute) or a cat's (the tests' add norms)."""
    node = y.grad_fn
    if type(node).__name__.startswith(("Permute", "Cat")):
        node = node.next_functions[0][0]
    return type(node).__name__


@pytest.mark.parametrize("name", sorted(set(NAMES) - FLOAT32_INSIDE))
def test_gradgradcheck(name):
    """The first call takes the eager Function; gradgradcheck's own calls (same key) replay."""
    ours, _theirs, make = CASES[name]
    inputs = make()
    assert torch.autograd.gradgradcheck(ours, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_second_derivatives_are_torchs_first_call_and_replay(name):
    """A gradient penalty's gradients, the same as torch's, on the call's first run (the full
    path) and on its replays."""
    ours, theirs, make = CASES[name]
    nodes = []
    for _ in range(3):
        results = []
        for fn in (ours, theirs):
            inputs = make()
            y = fn(*inputs)
            if fn is ours:
                nodes.append(_node(y))
            dy = torch.linspace(-1, 2, y.numel(), dtype=y.dtype, device="cuda").reshape(y.shape)
            grads = torch.autograd.grad(y, inputs, dy, create_graph=True)
            penalty = sum(g.square().sum() * (i + 1) for i, g in enumerate(grads))
            second = torch.autograd.grad(penalty, inputs, allow_unused=True, materialize_grads=True)
            results.append((grads, second))
        tol = dict(rtol=1e-4, atol=1e-4) if name in FLOAT32_INSIDE else dict(rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(results[0], results[1], **tol)
    replayable = not name.startswith(("instance_norm", "row_norm_add_mul", "llama"))
    if replayable:
        assert "_ReplayFunctionBackward" in nodes[1:], nodes


def test_first_order_backward_takes_the_kernels(monkeypatch):
    calls = {"kernel": 0, "composite": 0}

    _count_calls(monkeypatch, calls, "kernel", _row_norm, "_row_norm_bwd_cuda")
    _count_calls(monkeypatch, calls, "composite", _higher_order, "_row_norm_bwd_reference")
    monkeypatch.setattr(_row_norm, "_replay_candidate", lambda tensors: False)  # the Function
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    w, b = torch.randn(256, device="cuda", requires_grad=True), torch.randn(256, device="cuda")
    y = cnt.layer_norm(x, (256,), w, b)
    assert _node(y) == "_RowNormFunctionBackward"
    torch.autograd.grad(y.square().sum(), (x, w))
    assert calls == {"kernel": 1, "composite": 0}
    y = cnt.layer_norm(x, (256,), w, b)
    torch.autograd.grad(y.square().sum(), (x, w), create_graph=True)
    assert calls == {"kernel": 1, "composite": 1}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if cuda_available() else [])
def test_double_backward_of_batch_norm_relu_with_its_kept_mask(dtype):
    """BatchNormAct2d (ReLU, residual) on channels_last half input keeps the ReLU's mask in
    place of the residual: its double backward reads the mask (unpacked bit for bit)."""
    torch.manual_seed(0)
    layer = cnt.BatchNormAct2d(32, activation="relu").cuda()
    ref = nn.BatchNorm2d(32).cuda()
    ref.load_state_dict(layer.state_dict())
    shape = (4, 32, 8, 8)
    x0 = torch.randn(shape, device="cuda").to(dtype, memory_format=torch.channels_last)
    z0 = torch.randn(shape, device="cuda").to(dtype, memory_format=torch.channels_last)
    kept = []
    for _ in range(3):  # the full path, then replays
        x, z = x0.clone().requires_grad_(), z0.clone().requires_grad_()
        y = layer(x, z)
        kept.append(y.grad_fn.saved_tensors[-1] is not None)
        (gx, gz) = torch.autograd.grad(y.float().square().sum(), (x, z), create_graph=True)
        second = torch.autograd.grad(
            gx.float().square().sum() + gz.float().sum(), (x, z, layer.weight)
        )
        xr, zr = x0.float().requires_grad_(), z0.float().requires_grad_()
        yr = F.relu(ref.float()(xr) + zr)
        (gxr, gzr) = torch.autograd.grad(yr.square().sum(), (xr, zr), create_graph=True)
        expected = torch.autograd.grad(gxr.square().sum() + gzr.sum(), (xr, zr, ref.weight))
        tol = dict(rtol=0.1, atol=0.5)
        torch.testing.assert_close(gx.float(), gxr, **tol)
        torch.testing.assert_close([s.float() for s in second], list(expected), **tol)
    assert any(kept), "no ReLU mask kept: the mask path was not exercised"


def test_sync_batchnorm_second_backward_message_is_torchs():
    """Our message for SyncBatchNorm's second backward is the one torch's backward ops raise."""
    x = torch.randn(4, 3, 5, device="cuda", requires_grad=True)
    dy = torch.randn(4, 3, 5, device="cuda")
    mean, invstd = x.detach().mean((0, 2)), torch.ones(3, device="cuda")
    w = torch.ones(3, device="cuda", requires_grad=True)
    sums = torch.batch_norm_backward_reduce(dy, x, mean, invstd, w, True, True, True)
    count = torch.full((1,), 8, dtype=torch.int32, device="cuda")
    dx = torch.batch_norm_backward_elemt(dy, x, mean, invstd, w, sums[0], sums[1], count)
    messages = []
    for grad in (dx, sums[2]):
        with pytest.raises(RuntimeError) as error:
            grad.sum().backward()
        messages.append(str(error.value))
    ours = [
        sync_batchnorm._not_differentiable(torch.ones(2, device="cuda"), op)
        for op in ("aten::batch_norm_backward_elemt", "aten::batch_norm_backward_reduce")
    ]
    for grad, message in zip(ours, messages, strict=True):
        with pytest.raises(RuntimeError) as error:
            grad.sum().backward()
        assert str(error.value) == message


# ---- forward AD and torch.func transforms: torch's composite path ----------------------------
@pytest.mark.parametrize("name", NAMES)
def test_jvp_is_torchs(name):
    ours, theirs, make = CASES[name]
    inputs = tuple(t.detach() for t in make())
    tangents = tuple(torch.randn_like(t) for t in inputs)

    def jvp(fn):
        return lambda: torch.func.jvp(fn, inputs, tangents)

    _same_as_torch(jvp, ours, theirs)


@pytest.mark.parametrize("name", NAMES)
def test_vmap_is_torchs(name):
    ours, theirs, make = CASES[name]
    inputs = [t.detach() for t in make()]
    stacked = [torch.stack([t * (1 + 0.1 * i) for i in range(3)]) for t in inputs]
    _same_as_torch(torch.func.vmap, ours, theirs, *stacked)


def test_forward_ad_dual_level_is_torchs():
    x = torch.randn(8, 64, device="cuda")
    w = torch.randn(64, device="cuda")
    v = torch.randn_like(x)
    with fwAD.dual_level():
        ours = fwAD.unpack_dual(cnt.layer_norm(fwAD.make_dual(x, v), (64,), w)).tangent
        theirs = fwAD.unpack_dual(F.layer_norm(fwAD.make_dual(x, v), (64,), w)).tangent
    torch.testing.assert_close(ours, theirs)


def test_per_sample_gradients_of_a_group_norm_net():
    torch.manual_seed(0)
    net = _GroupNormNet(cnt.GroupNorm).double().cuda()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(4, 3, 6, 6, dtype=D, device="cuda")
    target = torch.tensor([0, 3, 1, 4], device="cuda")

    def loss(p, xi, ti):
        return F.cross_entropy(torch.func.functional_call(net, p, (xi[None],)), ti[None])

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, target)
    for i in range(4):
        net.zero_grad()
        F.cross_entropy(net(x[i : i + 1]), target[i : i + 1]).backward()
        for k, p in net.named_parameters():
            torch.testing.assert_close(per_sample[k][i], p.grad)


def test_wgan_gp_step_with_a_layer_norm_critic_is_torchs():
    torch.manual_seed(1)
    ours = _Critic(cnt.LayerNorm).double().cuda()
    theirs = _Critic(nn.LayerNorm).double().cuda()
    theirs.load_state_dict(ours.state_dict())
    real = torch.randn(8, 6, dtype=D, device="cuda")
    fake = torch.randn(8, 6, dtype=D, device="cuda")
    alpha = torch.rand(8, 1, dtype=D, device="cuda")
    for _ in range(3):  # the first calls, then replays
        torch.testing.assert_close(
            _wgan_gp_step(ours, real, fake, alpha), _wgan_gp_step(theirs, real, fake, alpha)
        )
