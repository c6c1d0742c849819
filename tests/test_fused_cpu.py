"""The fused BatchNorm + residual add + activation and fuse(), without a GPU: the kernel route on
the reference kernels (eager Function and custom op) against the unfused torch sequence, the fake
kernels against the real outputs, the module's contract, argument errors, and fuse()'s graph
rewrite on models that trace, on ones that do not, and on torchvision's resnet50 when installed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import timm_norm_act
from torch import nn

import cupynorm.torch as cnt
from cupynorm import InvalidInputError, InvalidTypeError
from cupynorm.torch import _batch_norm_kernels

ACTS = {"identity": lambda t: t, "relu": F.relu, "silu": F.silu}


def _unfused(x, rm, rv, w, b, training, residual, act):
    y = F.batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5)
    return ACTS[act](y if residual is None else y + residual)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "noadd"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_norm_act_kernel_route_matches_unfused(
    kernel_path, act, with_residual, training, dtype
):
    g = torch.Generator().manual_seed(3)
    shape = (4, 5, 6, 7)
    x = (torch.randn(shape, generator=g, dtype=dtype) + 2).to(memory_format=torch.channels_last)
    z = torch.randn(shape, generator=g, dtype=dtype) if with_residual else None
    w, b = torch.rand(5, generator=g, dtype=dtype) + 0.5, torch.randn(5, generator=g, dtype=dtype)
    rm, rv = torch.randn(5, generator=g, dtype=dtype), torch.rand(5, generator=g, dtype=dtype) + 1
    leaves = [t.clone().requires_grad_() for t in (x, w, b)] + (
        [z.clone().requires_grad_()] if with_residual else [None]
    )
    refs = [None if t is None else t.detach().clone().requires_grad_() for t in leaves]
    rm2, rv2 = rm.clone(), rv.clone()
    xs, ws, bs, zs = leaves
    y = cnt.batch_norm_act(xs, rm, rv, ws, bs, training, 0.1, 1e-5, residual=zs, activation=act)
    xr, wr, br, zr = refs
    y_ref = _unfused(xr, rm2, rv2, wr, br, training, zr, act)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(y, y_ref, **tol)
    assert y.is_contiguous(memory_format=torch.channels_last)
    dy = torch.randn(shape, generator=g, dtype=dtype)
    y.backward(dy)
    y_ref.backward(dy)
    for ours, ref in zip(leaves, refs, strict=True):
        if ours is not None:
            torch.testing.assert_close(ours.grad, ref.grad, **tol)
    torch.testing.assert_close((rm, rv), (rm2, rv2), **tol)


def test_batch_norm_act_fake_kernels_match_real():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 6, 5, 7, generator=g).to(memory_format=torch.channels_last)
    z, w, b = torch.randn_like(x), torch.randn(6, generator=g), torch.randn(6, generator=g)
    rm, rv = torch.zeros(6), torch.ones(6)
    for act in ACTS:
        args = (x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5, z, act)
        real = _batch_norm_kernels._batch_norm_fwd(*args)
        fake = _batch_norm_kernels._batch_norm_fwd_fake(*args)
        for r, f in zip(real, fake[:3], strict=True):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
        _y, mean, rstd = real
        for mask in ([True, True, True, True], [False, False, False, True], [True] * 3 + [False]):
            bwd = (torch.randn_like(x), x, mean, rstd, w, True, mask, z, b, act)
            grads = _batch_norm_kernels._batch_norm_act_bwd(*bwd)
            for r, f in zip(grads, _batch_norm_kernels._batch_norm_act_bwd_fake(*bwd), strict=True):
                assert (r is None) == (f is None)
                if r is not None:
                    assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_batch_norm_act_compiles_fullgraph_on_the_reference_kernels(kernels):
    torch._dynamo.reset()
    m = cnt.BatchNormAct2d(4, activation="silu")
    x, z = torch.randn(2, 4, 3, 5), torch.randn(2, 4, 3, 5)
    expected = m(x, z)
    m2 = copy.deepcopy(m)
    torch.testing.assert_close(
        torch.compile(m2, fullgraph=True, backend="aot_eager")(x, z), expected
    )
    torch._dynamo.reset()


def test_batch_norm_act_stays_fused_under_compile(kernels):
    """The traced module calls the fused op (norm, add and activation in one op: one pass fewer
    than leaving the add and activation to Inductor), and trains as the eager module does."""
    torch._dynamo.reset()
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm

    g = torch.Generator().manual_seed(5)
    m = cnt.BatchNormAct2d(4, activation="relu")
    x = torch.randn(2, 4, 3, 5, generator=g).requires_grad_()
    z = torch.randn(2, 4, 3, 5, generator=g).requires_grad_()
    dy = torch.randn(2, 4, 3, 5, generator=g)
    m2 = copy.deepcopy(m)
    y = m(x, z)
    y.backward(dy)
    x2, z2 = x.detach().clone().requires_grad_(), z.detach().clone().requires_grad_()
    y2 = torch.compile(m2, fullgraph=True, backend=backend)(x2, z2)
    y2.backward(dy)
    torch._dynamo.reset()
    assert any("batch_norm_act_fwd" in t for t in targets), targets
    assert not any("relu" in t or t.endswith(".add") for t in targets), targets
    torch.testing.assert_close(y2, y)
    for a, b in ((x2.grad, x.grad), (z2.grad, z.grad), (m2.weight.grad, m.weight.grad)):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(m2.running_mean, m.running_mean)


def test_batch_norm_act_argument_errors():
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(InvalidInputError, match="activation"):
        cnt.batch_norm_act(x, None, None, training=True, activation="gelu")
    with pytest.raises(InvalidInputError, match="shape"):
        cnt.batch_norm_act(x, None, None, training=True, residual=torch.randn(2, 3, 4))
    with pytest.raises(InvalidTypeError, match="dtype"):
        cnt.batch_norm_act(x, None, None, training=True, residual=x.double())
    with pytest.raises(InvalidTypeError, match="residual"):
        cnt.batch_norm_act(x, None, None, training=True, residual=1.0)
    for fn in (cnt.batch_norm, cnt.batch_norm_act):  # the input itself, before any route
        with pytest.raises(InvalidTypeError, match="expected input to be a torch.Tensor"):
            fn(x.tolist(), None, None, training=True)


def test_batch_norm_act2d_module_contract():
    m, ref = cnt.BatchNormAct2d(7, momentum=0.2, activation="silu"), nn.BatchNorm2d(7, momentum=0.2)
    assert isinstance(m, nn.BatchNorm2d) and isinstance(m, cnt.BatchNorm2d)
    assert list(m.state_dict()) == list(ref.state_dict())
    assert repr(m) == repr(ref).replace("BatchNorm2d(", "BatchNormAct2d(")[:-1] + (
        ", activation='silu')"
    )
    m.load_state_dict(ref.state_dict())
    x, z = torch.randn(3, 7, 4, 4), torch.randn(3, 7, 4, 4)
    torch.testing.assert_close(m(x, z), F.silu(ref(x) + z))
    torch.testing.assert_close(m.running_mean, ref.running_mean)


def test_batch_norm_act2d_broadcast_residual_runs_unfused(kernels):
    """An add that broadcasts (fuse() cannot tell shapes apart) is torch's add, not an error."""
    m, ref = cnt.BatchNormAct2d(3), nn.BatchNorm2d(3)
    x, bias = torch.randn(2, 3, 4, 4), torch.randn(1, 3, 1, 1)
    torch.testing.assert_close(m(x, bias), F.relu(ref(x) + bias))


class _Block(nn.Module):
    """A bottleneck-like block with every pattern fuse() knows, and some it must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv3, self.bn3 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.bn4 = nn.BatchNorm2d(4)  # output used twice: not fused
        self.bn5 = nn.BatchNorm2d(4)  # + add, no activation
        self.gn = nn.GroupNorm(2, 4)  # + SiLU: GroupNormAct
        self.relu, self.act = nn.ReLU(inplace=True), nn.SiLU()

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = F.silu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x
        out = out.relu()
        y = self.bn4(out)
        out = y * torch.sigmoid(y)
        out = x + self.bn5(out)
        return self.act(self.gn(out))


def test_fuse_rewrites_the_known_patterns_and_keeps_the_state():
    torch.manual_seed(0)
    ref = _Block()
    model = copy.deepcopy(ref)
    params = dict(model.named_parameters())
    report: list[str] = []
    fused = cnt.fuse(model, report=report)
    assert report == [
        "bn1 + relu",
        "bn2 + silu",
        "bn3 + add + relu",
        "bn5 + add + identity",
        "gn + silu",
    ]
    assert [type(m).__name__ for m in (fused.bn1, fused.bn4, fused.gn)] == [
        "BatchNormAct2d",
        "BatchNorm2d",
        "GroupNormAct",
    ]
    assert isinstance(fused.gn, cnt.GroupNorm) and isinstance(fused.bn4, cnt.BatchNorm2d)
    assert all(p is params[n] for n, p in fused.named_parameters())  # the same tensors
    assert list(fused.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 4, 6, 6)
    for train in (True, False):
        fused.train(train)
        ref.train(train)
        torch.testing.assert_close(fused(x), ref(x))
    torch.testing.assert_close(fused.state_dict(), ref.state_dict())


def test_fuse_on_the_kernel_route_trains_like_torch(kernels):
    torch.manual_seed(1)
    ref = _Block()
    fused = cnt.fuse(copy.deepcopy(ref))
    x = torch.randn(2, 4, 6, 6)
    for m in (fused, ref):
        m(x).square().sum().backward()
    grads = dict(ref.named_parameters())
    for name, p in fused.named_parameters():
        # relative to the largest entry: a conv bias before a norm has a gradient of rounding
        g = grads[name].grad
        scale = max(g.abs().max().item(), 1.0)
        assert (p.grad - g).abs().max().item() <= 1e-5 * scale, name


class _WithRowNorms(nn.Module):
    """A conv block whose output is normalized over its channels as NHWC rows (convnext's
    pattern), and an RMSNorm after."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x))).permute(0, 2, 3, 1)
        return self.rms(self.ln(y))


def test_fuse_traces_past_converted_layer_and_rms_norms():
    # row norms converted first (replace_norms with include=) are leaves of fuse's trace: traced
    # into, their argument checks would meet proxies, the trace fail and every fusion be lost
    torch.manual_seed(3)
    ref = _WithRowNorms()
    report: list[str] = []
    model = cnt.replace_norms(copy.deepcopy(ref), include=[nn.LayerNorm, nn.RMSNorm])
    fused = cnt.fuse(model, report=report)
    assert isinstance(fused, torch.fx.GraphModule) and report == ["bn + relu"]
    assert type(fused.ln) is cnt.LayerNorm and type(fused.rms) is cnt.RMSNorm
    x = torch.randn(2, 3, 6, 7)
    torch.testing.assert_close(fused(x), ref(x))


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace this
            x = self.bn(x)
        return self.block(x)


def test_fuse_falls_back_to_the_submodules_that_trace():
    torch.manual_seed(2)
    ref = _Untraceable()
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(ref), report=report)
    assert type(model) is _Untraceable and type(model.bn) is cnt.BatchNorm2d
    assert report[0] == "block.bn1 + relu" and len(report) == 5
    x = torch.randn(2, 4, 6, 6).abs()
    torch.testing.assert_close(model(x), ref(x))


def test_fuse_torchvision_resnet50():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    ref = tv.models.resnet50()
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(ref), report=report)
    assert len(report) == 49 and sum("+ add" in r for r in report) == 16
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(model(x), ref(x))


class _BatchNormTail(nn.BatchNorm2d):
    """The shape of timm's BatchNormAct2d: torch's norm, then its drop and act submodules."""

    def __init__(self, channels, act, drop=None) -> None:
        super().__init__(channels)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


@pytest.mark.parametrize(
    "act,drop,fused",
    [
        (nn.SiLU(), None, "silu"),
        (nn.ReLU(inplace=True), None, "relu"),
        (nn.GELU(), None, None),
        (nn.SiLU(), nn.Dropout(0.0), None),  # a drop module: its own tail, never fused
    ],
    ids=["silu", "relu", "gelu", "dropout"],
)
def test_fuse_batch_norm_act_subclass_runs_the_fused_op(kernels, monkeypatch, act, drop, fused):
    """A BatchNorm2d-act subclass replace_norms adopts with its tail: on the fused op when its
    act is a ReLU/SiLU module and its drop an Identity; otherwise its own tail after the norm.
    Trains as the subclass itself does (outputs, gradients, running statistics, batch count)."""
    from cupynorm.torch import _module_forward

    calls = []
    real = _module_forward._batch_norm_route

    def spy(fn, *args, **kwargs):
        if fn == "batch_norm_act":  # the fused op's route (its last argument: the activation)
            calls.append(args[-1])
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(_module_forward, "_batch_norm_route", spy)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(4, 6, 1), _BatchNormTail(6, act, drop)).double()
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(ref), report=report)
    norm = model.get_submodule("1")
    assert isinstance(norm, _BatchNormTail) and isinstance(norm, cnt.BatchNorm2d)
    for _ in range(2):
        x = torch.randn(3, 4, 5, 7, dtype=torch.float64)
        outs = [m(x) for m in (model, ref)]
        torch.testing.assert_close(outs[0], outs[1])
        for out in outs:
            out.square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(model.state_dict(), ref.state_dict())
    assert report == ([f"1 + {fused}"] if fused else [])
    assert calls == ([fused] * 2 if fused else [])


def test_fuse_timm_batch_norm_act():
    norm_act = timm_norm_act()
    torch.manual_seed(0)
    ref = nn.Sequential(
        norm_act.BatchNormAct2d(16, act_layer=nn.SiLU),
        norm_act.BatchNormAct2d(16, act_layer=nn.ReLU),
        norm_act.BatchNormAct2d(16, apply_act=False),
    )
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(ref), report=report)
    assert report == ["0 + silu", "1 + relu"]
    x = torch.randn(2, 16, 5, 5)
    torch.testing.assert_close(model(x), ref(x))
