"""The fused GroupNorm + activation without a GPU: the kernel route on the reference kernels (eager
Function and custom op) against the unfused torch sequence, the fake kernels against the real
outputs, torch.compile, the module's contract, argument errors against torch's, and fuse() on the
patterns it folds, the ones it must leave alone, and timm's GroupNormAct where timm imports.
"""

from __future__ import annotations

import copy
import importlib
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import timm_norm_act
from test_layer_norm_cpu import variants  # noqa: F401 - the fixture
from test_programs_cpu import launches  # noqa: F401 - the fixture
from torch import nn

import cupynorm
import cupynorm.torch as cnt
from cupynorm import InvalidInputError, _ops
from cupynorm.torch import _group_norm

ACTS = {"identity": lambda t: t, "relu": F.relu, "silu": F.silu}
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
CASES = [  # shape, groups, memory format
    ((4, 6, 5, 7), 3, "contiguous"),
    ((3, 6, 5, 7), 2, "channels_last"),
    ((2, 5, 9), 5, "contiguous"),  # Cg = 1
    ((2, 12, 3, 4), 1, "contiguous"),  # Cg = 12
]


def _input(shape, fmt, dtype, g):
    x = torch.randn(shape, generator=g, dtype=dtype) + 2  # offset data
    return x.to(memory_format=torch.channels_last) if fmt == "channels_last" else x


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,groups,fmt", CASES, ids=[f"{s}-{g}-{f}" for s, g, f in CASES])
def test_group_norm_act_kernel_route_matches_unfused(
    kernel_path, act, affine, dtype, shape, groups, fmt
):
    g = torch.Generator().manual_seed(3)
    C = shape[1]
    x = _input(shape, fmt, dtype, g)
    w = torch.rand(C, generator=g, dtype=dtype) + 0.5 if affine else None
    b = torch.randn(C, generator=g, dtype=dtype) if affine else None
    leaves = [None if t is None else t.clone().requires_grad_() for t in (x, w, b)]
    refs = [None if t is None else t.clone().requires_grad_() for t in (x, w, b)]
    y = cnt.group_norm_act(leaves[0], groups, leaves[1], leaves[2], 1e-5, activation=act)
    y_ref = ACTS[act](F.group_norm(refs[0], groups, refs[1], refs[2], 1e-5))
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(y, y_ref, **tol)
    if fmt == "channels_last":
        assert y.is_contiguous(memory_format=torch.channels_last)
    dy = torch.randn(shape, generator=g, dtype=dtype)
    y.backward(dy)
    y_ref.backward(dy)
    for ours, ref in zip(leaves, refs, strict=True):
        if ours is not None:
            torch.testing.assert_close(ours.grad, ref.grad, **tol)


def test_group_norm_act_half_precision_rounds_like_the_unfused_ops(kernels):
    """bfloat16: one rounding of the output (ours) against torch's two, within one ulp; the
    gradient within the rounding of dt."""
    g = torch.Generator().manual_seed(4)
    x = _input((2, 8, 6, 6), "contiguous", torch.float32, g).bfloat16().requires_grad_()
    w, b = torch.rand(8, generator=g) + 0.5, torch.randn(8, generator=g)
    y = cnt.group_norm_act(x, 4, w, b)
    x2 = x.detach().clone().requires_grad_()
    y2 = F.silu(F.group_norm(x2, 4, w, b))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y2, rtol=8e-3, atol=8e-3)
    dy = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=3e-2, atol=3e-2)


def test_group_norm_act_fake_kernels_match_real():
    g = torch.Generator().manual_seed(5)
    for fmt in ("contiguous", "channels_last"):
        x = _input((3, 6, 5, 7), fmt, torch.float32, g)
        w, b = torch.randn(6, generator=g), torch.randn(6, generator=g)
        for act in ACTS:
            args = (x, 3, w, b, 1e-5, act)
            real = _group_norm._group_norm_act_fwd(*args)
            fake = _group_norm._group_norm_act_fwd_fake(*args)
            for r, f in zip(real, fake, strict=True):
                assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
            _y, mean, rstd = real
            for mask in ([True, True, True], [True, False, False], [False, True, True]):
                bwd = (torch.randn_like(x), x, mean, rstd, w, b, 3, mask, act)
                grads = _group_norm._group_norm_act_bwd(*bwd)
                for r, f in zip(grads, _group_norm._group_norm_act_bwd_fake(*bwd), strict=True):
                    assert (r is None) == (f is None)
                    if r is not None:
                        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_group_norm_act_compiles_fullgraph_on_the_reference_kernels(kernels):
    torch._dynamo.reset()
    m = cnt.GroupNormAct(2, 4)
    nn.init.normal_(m.weight)
    x = torch.randn(2, 4, 3, 5, requires_grad=True)
    expected = m(x)
    expected.square().sum().backward()
    expected_grads = (x.grad.clone(), m.weight.grad.clone())
    x.grad = m.weight.grad = None
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    torch.testing.assert_close(y, expected)
    y.square().sum().backward()
    torch.testing.assert_close((x.grad, m.weight.grad), expected_grads)
    torch._dynamo.reset()


@pytest.mark.parametrize("activation", [None, "silu"])
def test_inductor_hands_the_ops_the_convolutions_layout(kernels, activation):
    """In an NCHW model Inductor may run the convolutions channels_last; the ops (tagged
    ``flexible_layout``) take that layout as it is, forward and backward, rather than a copy to
    the traced NCHW strides and back around every call: their outputs come out channels_last."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    norm = nn.GroupNorm(2, 8) if activation is None else cnt.GroupNormAct(2, 8)
    nn.init.normal_(norm.weight, generator=g)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), norm, nn.Conv2d(8, 4, 3, padding=1))
    model = cnt.replace_norms(model)
    x = torch.randn(2, 4, 6, 6, generator=g, requires_grad=True)
    expected = model(x)
    expected.square().sum().backward()
    expected_grads = (x.grad.clone(), norm.weight.grad.clone())
    x.grad = norm.weight.grad = None

    compiled = torch.compile(model, fullgraph=True, backend="inductor")

    def step():
        y = compiled(x)
        y.square().sum().backward()
        return y

    with torch._inductor.config.patch(force_layout_optimization=True, fx_graph_cache=False):
        y, code = run_and_get_code(step)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close((x.grad, model[1].weight.grad), expected_grads)
    op = "group_norm_fwd" if activation is None else "group_norm_act_fwd"
    channels_last = "(288, 1, 48, 8)"  # (2, 8, 6, 6) channels_last: y and dx
    for name in (op, op.replace("_fwd", "_bwd")):
        lines = [line for c in code for line in c.splitlines() if name in line]
        assert any(channels_last in line for line in lines), (name, lines)
    torch._dynamo.reset()


@pytest.mark.parametrize("activation", [None, "silu"])
def test_compiled_graph_calls_the_kernels_directly(kernels, activation):
    """Inductor's code calls each op's kernel for its device (``cupynorm_kernels.<op>_cpu``),
    not the op through the dispatcher and the Python autograd layer; the step equals eager."""
    from torch._inductor.codegen.custom_extern_kernel_codegen import CUSTOM_EXTERN_KERNEL_CODEGEN
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    norm = nn.GroupNorm(2, 8) if activation is None else cnt.GroupNormAct(2, 8)
    nn.init.normal_(norm.weight, generator=g)
    model = cnt.replace_norms(nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), norm))
    x = torch.randn(2, 4, 5, 7, generator=g, requires_grad=True)
    expected = model(x)
    expected.square().sum().backward()
    expected_grads = (x.grad.clone(), norm.weight.grad.clone(), norm.bias.grad.clone())
    x.grad = norm.weight.grad = norm.bias.grad = None
    compiled = torch.compile(model, fullgraph=True, backend="inductor")

    def step():
        y = compiled(x)
        y.square().sum().backward()
        return y

    with torch._inductor.config.patch(fx_graph_cache=False):
        y, code = run_and_get_code(step)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close((x.grad, norm.weight.grad, norm.bias.grad), expected_grads)
    op = "group_norm_fwd" if activation is None else "group_norm_act_fwd"
    text = "\n".join(code)
    assert "from cupynorm.torch._library import kernels as cupynorm_kernels" in text
    for name in (op, op.replace("_fwd", "_bwd")):
        assert f"cupynorm_kernels.{name}_cpu(" in text, name
        assert f"torch.ops.cupynorm.{name}.default(" not in text, name
        assert f"torch.ops.cupynorm.{name}.default" in CUSTOM_EXTERN_KERNEL_CODEGEN
    torch._dynamo.reset()


def test_a_failing_direct_call_leaves_inductors_op_call(kernels, monkeypatch):
    """Where Inductor's private API is not what the direct call expects, the generated code
    keeps the op call (and says so): the compiled step still runs, equal to eager."""
    from torch._inductor.utils import run_and_get_code

    from cupynorm.torch import _library

    def broken(*args):
        raise AttributeError("no such thing")

    monkeypatch.setattr(_library, "_direct_line", broken)
    torch._dynamo.reset()
    norm = cnt.GroupNorm(2, 8)
    x = torch.randn(2, 8, 3, 5)
    compiled = torch.compile(norm, fullgraph=True, backend="inductor")
    with torch._inductor.config.patch(fx_graph_cache=False):
        with pytest.warns(UserWarning, match="through the dispatcher.*no such thing"):
            y, code = run_and_get_code(compiled, x)
    torch.testing.assert_close(y, norm(x))
    assert "torch.ops.cupynorm.group_norm_fwd.default(" in "\n".join(code)
    torch._dynamo.reset()


def test_group_norm_act_module_contract():
    m, ref = cnt.GroupNormAct(3, 6, eps=1e-3), nn.GroupNorm(3, 6, eps=1e-3)
    assert isinstance(m, nn.GroupNorm) and isinstance(m, cnt.GroupNorm)
    assert m.activation == "silu"
    assert list(m.state_dict()) == list(ref.state_dict())
    assert repr(m) == repr(ref).replace("GroupNorm(", "GroupNormAct(")[:-1] + (
        ", activation='silu')"
    )
    nn.init.normal_(ref.weight)
    nn.init.normal_(ref.bias)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, 4, 5)
    torch.testing.assert_close(m(x), F.silu(ref(x)))
    relu = cnt.GroupNormAct(3, 6, affine=False, activation="relu")
    torch.testing.assert_close(relu(x), F.relu(F.group_norm(x, 3)))
    assert list(relu.state_dict()) == []


def test_group_norm_act_argument_errors(kernels):
    x = torch.randn(2, 4, 3)
    with pytest.raises(InvalidInputError, match="activation"):
        cnt.group_norm_act(x, 2, activation="gelu")
    # the group norm's own errors: torch's type and wording
    for args in ((x, 3), (x, 2, torch.ones(3)), (torch.randn(4), 2)):
        with pytest.raises(Exception) as ours:
            cnt.group_norm_act(*args)
        with pytest.raises(Exception) as theirs:
            F.group_norm(*args)
        assert isinstance(ours.value, theirs.type) and str(ours.value) == str(theirs.value)


def test_cupy_functional_group_norm_act_checks_the_activation():
    with pytest.raises(InvalidInputError, match="activation"):
        cupynorm.group_norm_act(torch.randn(2, 4, 3, device="meta"), 2, activation="gelu")


# ---------------------------------------------------------------------------------------------
# fuse()
# ---------------------------------------------------------------------------------------------
class _Blocks(nn.Module):
    """GroupNorm followed by each activation form fuse() knows, and two it must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.gn1, self.gn2, self.gn3 = nn.GroupNorm(2, 4), nn.GroupNorm(2, 4), nn.GroupNorm(4, 4)
        self.gn4 = nn.GroupNorm(2, 4)  # output used twice: not fused
        self.gn5 = nn.GroupNorm(1, 4)  # called twice: not fused
        self.act, self.relu = nn.SiLU(), nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv(self.act(self.gn1(x)))
        h = F.silu(self.gn2(h), inplace=True)
        h = self.relu(self.gn3(h))
        y = self.gn4(h)
        h = F.silu(y) + y
        return F.silu(self.gn5(h)) + self.gn5(x)


def test_fuse_folds_group_norm_activations_and_keeps_the_state():
    torch.manual_seed(0)
    ref = _Blocks()
    for m in ref.modules():
        if isinstance(m, nn.GroupNorm):
            nn.init.normal_(m.weight)
            nn.init.normal_(m.bias)
    report: list[str] = []
    fused = cnt.fuse(copy.deepcopy(ref), report=report)
    assert report == ["gn1 + silu", "gn2 + silu", "gn3 + relu"]
    assert [type(getattr(fused, f"gn{i}")).__name__ for i in range(1, 6)] == [
        "GroupNormAct",
        "GroupNormAct",
        "GroupNormAct",
        "GroupNorm",
        "GroupNorm",
    ]
    assert [fused.gn1.activation, fused.gn3.activation] == ["silu", "relu"]
    assert sorted(fused.state_dict()) == sorted(ref.state_dict())
    x = torch.randn(2, 4, 6, 6)
    torch.testing.assert_close(fused(x), ref(x))


def test_fuse_group_norm_on_the_kernel_route_trains_like_torch(kernels):
    torch.manual_seed(1)
    ref = _Blocks()
    fused = cnt.fuse(copy.deepcopy(ref))
    x = torch.randn(2, 4, 6, 6)
    for m in (fused, ref):
        m(x).square().sum().backward()
    grads = dict(ref.named_parameters())
    for name, p in fused.named_parameters():
        g = grads[name].grad
        scale = max(g.abs().max().item(), 1.0)
        assert (p.grad - g).abs().max().item() <= 1e-5 * scale, name


def test_fuse_bench_gn_resnet_blocks_fuses_both_norms():
    from cupynorm.bench import models

    torch.manual_seed(0)
    ref = models._gn_module_classes()["GNResnetBlocks"](64, 2)
    report: list[str] = []
    fused = cnt.fuse(copy.deepcopy(ref), report=report)
    assert report == ["0.norm1 + silu", "0.norm2 + silu", "1.norm1 + silu", "1.norm2 + silu"]
    assert list(fused.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 64, 5, 5)
    torch.testing.assert_close(fused(x), ref(x))


class _NormTail(nn.GroupNorm):
    """The shape of timm's GroupNormAct: torch's group norm, then its drop and act submodules."""

    def __init__(self, groups, channels, act, drop=None) -> None:
        super().__init__(groups, channels)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act

    def forward(self, x):
        return self.act(self.drop(F.group_norm(x, self.num_groups, self.weight, self.bias)))


@pytest.mark.parametrize(
    "act,drop,fused",
    [
        (nn.SiLU(), None, True),
        (nn.ReLU(), None, True),
        (nn.GELU(), None, False),
        (nn.SiLU(), nn.Dropout(0.0), False),  # a drop module: its own tail, never fused
    ],
    ids=["silu", "relu", "gelu", "dropout"],
)
def test_fuse_norm_act_subclass_runs_the_fused_op(monkeypatch, act, drop, fused):
    """A norm-act subclass replace_norms adopts with its tail: on the fused op when its act is a
    ReLU/SiLU module and its drop an Identity; otherwise its own tail after the norm."""
    from cupynorm.torch import functional as cnf

    calls = []
    real = cnf.group_norm_act

    def spy(*args, **kwargs):
        calls.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(importlib.import_module("cupynorm.torch.fuse"), "group_norm_act", spy)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(4, 4, 1), _NormTail(2, 4, act, drop))
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(ref), report=report)
    norm = model.get_submodule("1")
    assert isinstance(norm, _NormTail) and isinstance(norm, cnt.GroupNorm)
    x = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(model(x), ref(x))
    assert report == (["1 + " + calls[0]] if fused else [])
    assert len(calls) == int(fused)
    assert list(model.state_dict()) == list(ref.state_dict())


def test_fuse_timm_group_norm_act():
    norm_act = timm_norm_act()
    torch.manual_seed(0)
    ref = nn.Sequential(
        norm_act.GroupNormAct(16, num_groups=8, act_layer=nn.SiLU),
        norm_act.GroupNorm1Act(16, act_layer=nn.SiLU),
    )
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(ref), report=report)
    assert report == ["0 + silu", "1 + silu"]
    x = torch.randn(2, 16, 5, 5)
    torch.testing.assert_close(model(x), ref(x))


# ---------------------------------------------------------------------------------------------
# shift: the time embedding diffusers' ResnetBlock2D adds before norm2
# ---------------------------------------------------------------------------------------------
def _unfused_shifted(x, groups, w, b, act, shift):
    s = shift.reshape(*shift.shape, *([1] * (x.dim() - 2)))
    return ACTS[act](F.group_norm(x + s, groups, w, b, 1e-5))


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,groups,fmt", CASES, ids=[f"{s}-{g}-{f}" for s, g, f in CASES])
def test_group_norm_act_shift_kernel_route_matches_unfused(
    kernel_path, act, dtype, shape, groups, fmt
):
    g = torch.Generator().manual_seed(7)
    N, C = shape[:2]
    x = _input(shape, fmt, dtype, g)
    w, b = torch.rand(C, generator=g, dtype=dtype) + 0.5, torch.randn(C, generator=g, dtype=dtype)
    shift = 3 * torch.randn(N, C, generator=g, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, shift)]
    refs = [t.clone().requires_grad_() for t in (x, w, b, shift)]
    y = cnt.group_norm_act(leaves[0], groups, leaves[1], leaves[2], activation=act, shift=leaves[3])
    y_ref = _unfused_shifted(refs[0], groups, refs[1], refs[2], act, refs[3])
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(y, y_ref, **tol)
    if fmt == "channels_last":
        assert y.is_contiguous(memory_format=torch.channels_last)
    dy = torch.randn(shape, generator=g, dtype=dtype)
    y.backward(dy)
    y_ref.backward(dy)
    for ours, ref in zip(leaves, refs, strict=True):
        torch.testing.assert_close(ours.grad, ref.grad, **tol)


@pytest.mark.parametrize("needs", ["input", "shift", "weight"])
def test_group_norm_act_shift_gradients_of_what_needs_them(kernel_path, needs):
    """Only the tensors that require grad get one; the shift's needs the input's internally."""
    g = torch.Generator().manual_seed(8)
    x = _input((2, 6, 4, 5), "contiguous", torch.float64, g)
    w, shift = torch.rand(6, generator=g, dtype=torch.float64), torch.randn(2, 6, generator=g)
    shift = shift.double()
    tensors = {"input": x, "weight": w, "shift": shift}
    ours = {k: t.clone().requires_grad_(k == needs) for k, t in tensors.items()}
    refs = {k: t.clone().requires_grad_(k == needs) for k, t in tensors.items()}
    y = cnt.group_norm_act(ours["input"], 3, ours["weight"], None, shift=ours["shift"])
    _unfused_shifted(refs["input"], 3, refs["weight"], None, "silu", refs["shift"]).sum().backward()
    y.sum().backward()
    for k in tensors:
        assert (ours[k].grad is None) == (k != needs)
    torch.testing.assert_close(ours[needs].grad, refs[needs].grad)


def test_group_norm_act_shift_gradcheck(kernels):
    g = torch.Generator().manual_seed(9)
    x = _input((2, 4, 3, 3), "channels_last", torch.float64, g).requires_grad_()
    w = (torch.rand(4, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(4, generator=g, dtype=torch.float64).requires_grad_()
    shift = torch.randn(2, 4, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda *t: cnt.group_norm_act(t[0], 2, t[1], t[2], shift=t[3]), (x, w, b, shift)
    )


def test_group_norm_act_shift_fake_kernels_and_opcheck():

    g = torch.Generator().manual_seed(10)
    x = _input((3, 6, 5, 7), "channels_last", torch.float32, g).requires_grad_()
    w, b = torch.randn(6, generator=g), torch.randn(6, generator=g)
    shift = torch.randn(3, 6, generator=g)
    real = _group_norm._group_norm_act_fwd(x, 3, w, b, 1e-5, "silu", shift)
    fake = _group_norm._group_norm_act_fwd_fake(x, 3, w, b, 1e-5, "silu", shift)
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    torch.library.opcheck(_group_norm.group_norm_act_fwd_op, (x, 3, w, b, 1e-5, "silu", shift))
    shift_leaf = shift.clone().requires_grad_()
    torch.library.opcheck(
        _group_norm.group_norm_act_fwd_op, (x.detach(), 3, None, None, 1e-5, "relu", shift_leaf)
    )


def test_group_norm_act_shift_compiles_fullgraph_on_the_reference_kernels(kernels):
    torch._dynamo.reset()
    m = cnt.GroupNormAct(2, 4)
    nn.init.normal_(m.weight)
    x = torch.randn(2, 4, 3, 5, requires_grad=True)
    shift = torch.randn(2, 4, requires_grad=True)
    expected = m(x, shift)
    expected.square().sum().backward()
    expected_grads = (x.grad.clone(), shift.grad.clone(), m.weight.grad.clone())
    x.grad = shift.grad = m.weight.grad = None
    y = torch.compile(m, fullgraph=True, backend="aot_eager")(x, shift)
    torch.testing.assert_close(y, expected)
    y.square().sum().backward()
    torch.testing.assert_close((x.grad, shift.grad, m.weight.grad), expected_grads)
    torch._dynamo.reset()


def test_group_norm_act_shift_errors(kernels):
    x = torch.randn(2, 4, 3, 3)
    with pytest.raises(InvalidInputError, match=r"shift of shape \(N, C\) = \(2, 4\)"):
        cnt.group_norm_act(x, 2, shift=torch.randn(2, 3))
    with pytest.raises(cupynorm.InvalidTypeError, match="input's dtype and device"):
        cnt.group_norm_act(x, 2, shift=torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(cupynorm.InvalidTypeError, match="expected shift to be a torch.Tensor"):
        cnt.group_norm_act(x, 2, shift=1.0)


def test_group_norm_act_module_shift_as_written_when_not_fusable():
    """GroupNormAct(x, shift) is act(group_norm(x + shift[:, :, None, None])) in every case: a
    shift it cannot fuse (not (N, C), another dtype) runs the add as written."""
    g = torch.Generator().manual_seed(11)
    m = cnt.GroupNormAct(2, 4, affine=False)
    x = torch.randn(2, 4, 5, 5, generator=g)
    for shape in ((2, 4), (1, 4), (2, 1)):  # fused, then broadcast over N, over C
        shift = torch.randn(shape, generator=g)
        expected = F.silu(F.group_norm(x + shift[:, :, None, None], 2))
        torch.testing.assert_close(m(x, shift), expected)
    x3 = torch.randn(2, 4, 6, generator=g)  # 3-D input: the add as written, which torch refuses
    shift = torch.randn(2, 4, generator=g)
    with pytest.raises(RuntimeError) as theirs:
        x3 + shift[:, :, None, None]
    with pytest.raises(RuntimeError, match=re.escape(str(theirs.value))):
        m(x3, shift)
    half = cnt.GroupNormAct(2, 4, affine=False)(x.double(), shift)  # type promotion as written
    assert half.dtype == torch.float64


class _TimeBlocks(nn.Module):
    """The time-embedding add before a GroupNorm, folded; and adds fuse() must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.gn1, self.gn2 = nn.GroupNorm(2, 4), nn.GroupNorm(2, 4)
        self.gn3, self.gn4 = nn.GroupNorm(2, 4), nn.GroupNorm(2, 4)
        self.proj = nn.Linear(6, 4)

    def forward(self, x, t):
        e = self.proj(t)
        h = F.silu(self.gn1(x + e[:, :, None, None]))  # folded, with the SiLU
        h = self.gn2(e[:, :, None, None] + h)  # folded, no activation: identity
        s = h + e[:, :, None, None]
        h = F.silu(self.gn3(s)) + s  # the sum has another user: only the SiLU folds
        return F.silu(self.gn4(h + e[..., None, None]))  # another indexing: only the SiLU


def test_fuse_folds_the_time_embedding_add():
    torch.manual_seed(2)
    ref = _TimeBlocks()
    for m in ref.modules():
        if isinstance(m, nn.GroupNorm):
            nn.init.normal_(m.weight)
            nn.init.normal_(m.bias)
    report: list[str] = []
    fused = cnt.fuse(copy.deepcopy(ref), report=report)
    assert report == ["gn1 + shift + silu", "gn2 + shift", "gn3 + silu", "gn4 + silu"]
    assert fused.gn2.activation == "identity"
    assert sorted(fused.state_dict()) == sorted(ref.state_dict())
    x, t = torch.randn(3, 4, 5, 5), torch.randn(3, 6)
    torch.testing.assert_close(fused(x, t), ref(x, t))


def test_fuse_time_embedding_on_the_kernel_route_trains_like_torch(kernels):
    torch.manual_seed(3)
    ref = _TimeBlocks()
    fused = cnt.fuse(copy.deepcopy(ref))
    x, t = torch.randn(3, 4, 5, 5), torch.randn(3, 6)
    for m in (fused, ref):
        m(x, t).square().sum().backward()
    grads = dict(ref.named_parameters())
    for name, p in fused.named_parameters():
        g = grads[name].grad
        scale = max(g.abs().max().item(), 1.0)
        assert (p.grad - g).abs().max().item() <= 1e-5 * scale, name


# ---- under autocast: float32 y and dy beside the half-precision input ---------------------------
@pytest.mark.parametrize(
    "act, shift", [(None, False), ("silu", False), ("silu", True)], ids=["plain", "silu", "shift"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_kernel_route_under_autocast_is_the_float32_norm(
    kernel_path, monkeypatch, act, shift, dtype
):
    """Under autocast, group_norm (and the fused op) is torch's float32 norm of the input: y in
    float32 (float64 stays float64), the input's and the shift's gradients in their dtype, the
    parameters' in theirs; the kernels read a half-precision input (and shift) as they are, the
    eager Functions and the custom ops (traced) alike. The full path, then a replay."""
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: True)
    read = []
    reference = _group_norm._group_norm_fwd_reference

    def spy(x, *args, **kwargs):
        read.append(x.dtype)
        return reference(x, *args, **kwargs)

    monkeypatch.setattr(_group_norm, "_group_norm_fwd_reference", spy)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 8, 5, 7, generator=g) * 2 + 1).to(dtype).requires_grad_()
    s = (torch.randn(3, 8, generator=g).to(dtype).requires_grad_(),) if shift else ()
    w, b = (torch.randn(8, generator=g).requires_grad_() for _ in range(2))
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x, w, b, *s]
    for _ in range(2):
        read.clear()
        if act is None:
            y = cnt.group_norm(x, 4, w, b)
        else:
            y = cnt.group_norm_act(x, 4, w, b, activation=act, shift=s[0] if s else None)
        xs = x.to(compute) + (s[0].to(compute)[:, :, None, None] if s else 0)
        expected = F.group_norm(xs, 4, w.to(compute), b.to(compute))
        expected = expected if act is None else F.silu(expected)
        assert y.dtype == compute
        # what the kernels read (the custom op's too: its half input, no cast before it)
        assert read == [dtype if dtype in (torch.bfloat16, torch.float16) else compute]
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
        dy = torch.randn(y.shape, generator=g, dtype=y.dtype)
        got = torch.autograd.grad(y, leaves, dy)
        want = torch.autograd.grad(expected, leaves, dy)
        for u, v in zip(got, want, strict=True):
            assert u.dtype == v.dtype
            torch.testing.assert_close(u, v, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["contiguous", "channels_last"])
@pytest.mark.parametrize("act", ["identity", "silu"])
def test_float32_output_reads_the_half_input(
    variants,  # noqa: F811 - the fixture
    dtype,
    fmt,
    act,
):
    """GroupNorm under autocast on the host op: the kernels of the float32-output module variant
    read x as it is (no conversion) and write float32 y -- NCHW groups on chip in one launch,
    channels_last by the strided passes; the backward reads float32 dy and writes dx in x's
    dtype."""
    log, seen = variants
    x = torch.rand(2, 32, 6, 10, dtype=getattr(torch, dtype))
    x = x.contiguous(memory_format=FORMATS[fmt])
    w, b = torch.rand(32), torch.rand(32)
    y, mean, rstd = _ops.group_norm_fwd(x, 8, w, b, 1e-5, act=act, out_dtype="float32")
    assert y.dtype == torch.float32 and y.stride() == x.stride() and mean.dtype == torch.float32
    layout = "rows" if fmt == "contiguous" else "cols"
    fused = act != "identity"
    if fmt == "contiguous":
        on_chip = "segment_norm_fwd_affine" + ("_silu" if fused else "")
        assert [k for k, *_ in seen] == [on_chip]
        assert log[0][4][:2] == [x.data_ptr(), y.data_ptr()]
    else:
        apply = f"fused_norm_apply_cols_{act}" if fused else "strided_norm_apply_cols"
        assert [k for k, *_ in seen] == ["strided_norm_stats_cols", "strided_norm_finalize", apply]
        assert log[0][4][0] == x.data_ptr() and log[-1][4][:3] == [x.data_ptr(), 0, y.data_ptr()]
    assert all(v[1:] == (dtype, "float32", "float32") for v in seen)
    seen.clear()
    dy = torch.rand(y.shape).contiguous(memory_format=FORMATS[fmt])
    if fused:
        grads = _ops.group_norm_act_bwd(dy, x, mean, rstd, w, b, 8, (True, True, True), act)
    else:
        grads = _ops.group_norm_bwd(dy, x, mean, rstd, w, 8, (True, True, True))
    dx, dw, db = grads
    assert (
        dx.dtype == x.dtype and dx.stride() == x.stride() and dw.dtype == db.dtype == torch.float32
    )
    assert all(v[1:] == (dtype, "float32", "float32") for v in seen)
    prefix = "fused_norm" if fused else "strided_norm"
    sums, dx_pass = f"bwd_sums_{layout}", f"bwd_dx_{layout}"
    names = [k for k, *_ in seen]
    assert names[0].startswith(f"{prefix}_{sums}") and names[-1].startswith(f"{prefix}_{dx_pass}")
    assert log[-1][4][:3] == [x.data_ptr(), dy.data_ptr(), dx.data_ptr()]


def test_float32_output_instance_groups_take_the_strided_backward(variants):  # noqa: F811
    """One channel per group (G == C) on NCHW: the on-chip instance backward reads dy in x's
    dtype, so a float32 dy takes the strided passes."""
    _log, seen = variants
    x = torch.rand(2, 8, 6, 10, dtype=torch.bfloat16)
    y, mean, rstd = _ops.group_norm_fwd(x, 8, None, None, 1e-5, out_dtype="float32")
    seen.clear()
    _ops.group_norm_bwd(torch.rand(y.shape), x, mean, rstd, None, 8, (True, False, False))
    assert "segment_norm_bwd_instance" not in [k for k, *_ in seen]
    assert all(v[1:] == ("bfloat16", None, "float32") for v in seen)


@pytest.mark.parametrize("act", [None, "silu"], ids=["plain", "silu"])
def test_float32_output_ops_fake_kernels_and_opcheck(act):
    """The custom ops with out_float32 (what a traced call under autocast runs): the fake
    kernels give the real outputs' metadata (a float32 y beside bf16 x) and torch's opcheck
    passes, gradients included."""

    g = torch.Generator().manual_seed(12)
    x = _input((3, 6, 5, 7), "channels_last", torch.bfloat16, g).requires_grad_()
    w, b = (torch.randn(6, generator=g).requires_grad_() for _ in range(2))
    if act is None:
        op, args = _group_norm.group_norm_fwd_op, (x, 3, w, b, 1e-5, True)
        real = _group_norm._group_norm_fwd(x, 3, w, b, 1e-5, True)
        fake = _group_norm._group_norm_fwd_fake(*args)
    else:
        op, args = _group_norm.group_norm_act_fwd_op, (x, 3, w, b, 1e-5, act, None, True)
        real = _group_norm._group_norm_act_fwd(*args)
        fake = _group_norm._group_norm_act_fwd_fake(*args)
    assert real[0].dtype == torch.float32
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    torch.library.opcheck(op, args)


def test_float32_output_only_beside_half_precision(launches):  # noqa: F811
    x = torch.rand(2, 8, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="only float32 beside"):
        _ops.group_norm_fwd(x, 2, None, None, 1e-5, out_dtype="float64")
    with pytest.raises(ValueError, match="only float32 beside"):
        _ops.group_norm_fwd(x.float(), 2, None, None, 1e-5, out_dtype="float64")
    with pytest.raises(ValueError, match="only float32 beside"):
        _ops.group_norm_bwd(x.double(), x, None, None, None, 2, (True, False, False))
    # the row norms' float32 y / dy take the same rule
    rows = torch.rand(4, 8)
    with pytest.raises(ValueError, match="only float32 beside"):
        _ops.row_norm_bwd(rows.half(), None, rows, None, None, None, 8, (True, False, False))
