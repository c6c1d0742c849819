"""LayerNorm / RMSNorm and their fused residual-add forms on the CPU: the modules against
torch.nn's (signature, state_dict, repr), the kernel route (eager Functions and custom ops, on the
reference kernels) against torch's functions and gradients, errors asked of the installed torch,
fake kernels, torch.compile, replace_norms, and the host code's launches (a fake launcher).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from test_programs_cpu import H200, launches  # noqa: F401 - the fixture
from torch import nn
from torch_cpu_helpers import patch_route

import cupynorm.torch as cnt
from cupynorm import _compile, _ops, _plan, _program
from cupynorm.torch import _reference, _row_norm

PAIRS = [(cnt.LayerNorm, nn.LayerNorm), (cnt.RMSNorm, nn.RMSNorm)]
# (input shape, normalized_shape): one-element rows, odd rows, several normalized dims
CASES = [((4, 1), (1,)), ((3, 5, 7), (7,)), ((2, 3, 5, 6), (5, 6)), ((9,), (9,))]


def _configs(torch_cls):
    configs = [dict(elementwise_affine=True), dict(elementwise_affine=False)]
    if torch_cls is nn.LayerNorm:
        configs.append(dict(elementwise_affine=True, bias=False))
    else:
        configs.append(dict(elementwise_affine=True, eps=1e-3))
    return configs


def _randomized_pair(ours, theirs, normalized_shape, cfg, dtype=torch.float32):
    a, b = ours(normalized_shape, dtype=dtype, **cfg), theirs(normalized_shape, dtype=dtype, **cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    a.load_state_dict(b.state_dict())
    return a, b


def _grads(out, inputs, seed=4):
    """Gradients of a loss whose gradient is not constant (exercises every term of dx)."""
    g = torch.Generator().manual_seed(seed)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(loss, wanted)


# ---------------------------------------------------------------------------------------------
# the modules are torch.nn's
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LayerNorm", "RMSNorm"])
def test_module_signature_state_dict_repr_equal_torch(ours, theirs):
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert issubclass(ours, theirs)
    for cfg in _configs(theirs):
        a, b = _randomized_pair(ours, theirs, (5, 6), cfg)
        assert repr(a) == repr(b)
        assert a.state_dict().keys() == b.state_dict().keys()
        b.load_state_dict(a.state_dict(), strict=True)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_functional_signature_equals_torch(name):
    ours = inspect.signature(getattr(cnt, name)).parameters
    theirs = inspect.signature(getattr(F, name)).parameters
    assert [(p.name, p.default) for p in ours.values()] == [
        (p.name, p.default) for p in theirs.values()
    ]


# ---------------------------------------------------------------------------------------------
# the kernel route (reference kernels on the CPU) computes what torch computes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("shape, normalized", CASES, ids=[str(c[0]) for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_kernel_route_module_matches_torch(kernel_path, ours, theirs, shape, normalized, dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    for cfg in _configs(theirs):
        a, b = _randomized_pair(ours, theirs, normalized, cfg, dtype)
        g = torch.Generator().manual_seed(7)
        x = (torch.randn(shape, generator=g, dtype=dtype) * 3 + 1).requires_grad_()
        y, yr = a(x), b(x)
        torch.testing.assert_close(y, yr, **tol)
        got = _grads(y, [x, *a.parameters()])
        expected = _grads(yr, [x, *b.parameters()])
        # one-element rows: dx is rounding noise times rstd = 1 / sqrt(eps) ~ 316
        grad_tol = tol if shape[-1] > 1 else dict(atol=1e3 * tol["atol"], rtol=tol["rtol"])
        for u, v in zip(got, expected, strict=True):
            torch.testing.assert_close(u, v, **grad_tol)


@pytest.mark.parametrize(
    "dtype, param_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),  # float32 copies of the parameters are used
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_kernel_route_under_autocast_is_the_float32_norm(
    kernel_path, monkeypatch, dtype, param_dtype, rms
):
    """Under autocast, layer_norm (rms_norm, with a torch whose autocast runs it in float32) is
    torch's float32 norm of the input (float64 stays float64): y in that dtype, the input's
    gradient in the input's dtype, the parameters' in theirs."""
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: True)
    patch_route(monkeypatch.setattr, "_AUTOCAST_RMS_NORM", True)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(5, 3, 16, generator=g) * 2 + 1).to(dtype).requires_grad_()
    w, b = (torch.randn(16, generator=g).to(param_dtype).requires_grad_() for _ in range(2))
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    if rms:
        b = None
    for _ in range(2):  # the full path, then a replay
        if rms:
            y = cnt.rms_norm(x, (16,), w)
            expected = F.rms_norm(x.to(compute), (16,), w.to(compute))
        else:
            y = cnt.layer_norm(x, (16,), w, b)
            expected = F.layer_norm(x.to(compute), (16,), w.to(compute), b.to(compute))
        assert y.dtype == compute
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
        leaves = [t for t in (x, w, b) if t is not None]
        got, want = _grads(y, leaves), _grads(expected, leaves)
        for u, v in zip(got, want, strict=True):
            assert u.dtype == v.dtype
            torch.testing.assert_close(u, v, atol=1e-4, rtol=1e-2)


@pytest.mark.parametrize("fn", ["layer_norm", "layer_norm2d"])
def test_mixed_parameter_dtypes_under_autocast_as_torch_accepts_them(kernel_path, monkeypatch, fn):
    """Torch's autocast runs layer_norm on float32 copies, so a float32 weight beside a bfloat16
    bias is accepted there (without autocast, the installed torch decides): the checks judge the
    copies' dtypes under autocast, the tensors' own without."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 3, 4, generator=g).to(torch.bfloat16)
    w = torch.randn(6 if fn == "layer_norm2d" else 4, generator=g)
    b = torch.randn(w.shape, generator=g).to(torch.bfloat16)
    if fn == "layer_norm2d":
        x = x.to(memory_format=torch.channels_last)

    def call():
        if fn == "layer_norm2d":
            return cnt.layer_norm2d(x, w, b)
        return cnt.layer_norm(x, (4,), w, b)

    try:  # without autocast: whatever the installed torch does with these dtypes
        F.layer_norm(x.movedim(1, -1) if fn == "layer_norm2d" else x, w.shape, w, b)
    except RuntimeError as error:
        with pytest.raises(type(error)):
            call()
    else:
        call()
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: True)
    y = call()
    xf = x.float().movedim(1, -1) if fn == "layer_norm2d" else x.float()
    expected = F.layer_norm(xf, w.shape, w, b.float())
    if fn == "layer_norm2d":
        expected = expected.movedim(-1, 1)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_rms_norm_under_autocast_is_torchs_call_where_torch_passes_it_through(kernels, monkeypatch):
    """With a torch whose autocast has no rms_norm kernel, rms_norm and rms_norm2d under autocast
    are torch's own calls (its dtype rules then), the kernels' route untouched."""
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: True)
    patch_route(monkeypatch.setattr, "_AUTOCAST_RMS_NORM", False)
    calls = []
    rms_norm = F.rms_norm

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return rms_norm(*args, **kwargs)

    monkeypatch.setattr(F, "rms_norm", spy)
    x = torch.randn(4, 8, 3, 5, dtype=torch.bfloat16)
    y = cnt.rms_norm(x, (5,))
    assert y.dtype == torch.bfloat16 and calls == [torch.bfloat16]
    torch.testing.assert_close(y, rms_norm(x, (5,)), rtol=0, atol=0)
    y = cnt.rms_norm2d(x)
    assert y.dtype == torch.bfloat16 and len(calls) == 2


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("with_sum_grad", [False, True], ids=["out_only", "out_and_sum"])
def test_kernel_route_add_norm_matches_composition(kernel_path, rms, with_sum_grad):
    """add_*_norm(x, residual) == (norm(x + residual), x + residual), gradients included: the
    sum's gradient (from the norm and, when used, from the returned sum) reaches both inputs."""
    g = torch.Generator().manual_seed(8)
    x, res = (torch.randn(3, 4, 6, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(6, generator=g, dtype=torch.float64)
    b = None if rms else torch.randn(6, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (x, res, w, b) if t is not None]

    def reference():
        total = x + res
        out = F.rms_norm(total, (6,), w, 1e-6) if rms else F.layer_norm(total, (6,), w, b)
        return out, total

    out = cnt.add_rms_norm(x, res, 6, w, 1e-6) if rms else cnt.add_layer_norm(x, res, 6, w, b)
    expected = reference()
    for u, v in zip(out, expected, strict=True):
        torch.testing.assert_close(u, v, atol=1e-12, rtol=1e-12)
    pick = (lambda o: o) if with_sum_grad else (lambda o: o[0])
    for u, v in zip(_grads(pick(out), leaves), _grads(pick(expected), leaves), strict=True):
        torch.testing.assert_close(u, v, atol=1e-12, rtol=1e-12)


def test_kernel_route_sum_only_gradient(kernel_path):
    """Only the returned sum used: x and residual get its gradient, the weight gets none."""
    x, res = torch.randn(2, 5, requires_grad=True), torch.randn(2, 5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    _out, total = cnt.add_rms_norm(x, res, 5, w)
    dsum = torch.randn(2, 5)
    gx, gr = torch.autograd.grad(total, (x, res), dsum)
    torch.testing.assert_close(gx, dsum)
    torch.testing.assert_close(gr, dsum)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_route_rms_norm_default_eps_is_torchs(kernels, dtype):
    """eps=None: what the installed torch uses (torch 2.13: float32's machine epsilon, also for
    half-precision input); data small enough that eps shows in the result."""
    x = (torch.randn(4, 16, generator=torch.Generator().manual_seed(2)) * 1e-2).to(dtype)
    torch.testing.assert_close(
        cnt.rms_norm(x, (16,)),
        F.rms_norm(x, (16,)),
        atol=0,
        rtol=0 if dtype != torch.float32 else 1e-6,
    )
    torch.testing.assert_close(cnt.RMSNorm(16, dtype=dtype)(x), nn.RMSNorm(16, dtype=dtype)(x))


def test_kernel_route_mixed_precision_weight(kernels):
    """bf16 input with float32 weight and bias, as torch's CUDA layer_norm takes them."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, generator=g).bfloat16().requires_grad_()
    w, b = torch.randn(8, generator=g, requires_grad=True), torch.randn(8, generator=g)
    y = cnt.layer_norm(x, 8, w, b)
    assert y.dtype == torch.bfloat16
    ref = F.layer_norm(x.float(), (8,), w, b).bfloat16()
    torch.testing.assert_close(y, ref, atol=1e-2, rtol=1e-2)
    gx, gw = torch.autograd.grad(y.float().sum(), (x, w))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32


def test_non_contiguous_input_is_normalized_by_rows(kernel_path):
    x = torch.randn(6, 4, 5).transpose(0, 1).requires_grad_()  # rows of 5, not contiguous
    torch.testing.assert_close(cnt.layer_norm(x, 5), F.layer_norm(x, (5,)))


# ---------------------------------------------------------------------------------------------
# the ops: opcheck, gradcheck, fake kernels
# ---------------------------------------------------------------------------------------------
def _op_samples():
    g = torch.Generator().manual_seed(5)

    def r(*shape, dtype=torch.float32, grad=False):
        return torch.randn(shape, generator=g, dtype=dtype).requires_grad_(grad)

    fwd, bwd = _row_norm.row_norm_fwd_op, _row_norm.row_norm_bwd_op
    x, res = r(3, 5, 7, grad=True), r(3, 5, 7, grad=True)
    w, b = r(7, grad=True), r(7, grad=True)
    return [
        ("ln", fwd, (x, None, w, b, 1, 1e-5, False)),
        ("ln_2d", fwd, (x, None, r(5, 7), None, 2, 1e-5, False)),
        ("rms", fwd, (x, None, w, None, 1, 1e-6, True)),
        ("add_ln", fwd, (x, res, w, b, 1, 1e-5, False)),
        ("add_rms_half", fwd, (r(4, 6).half(), r(4, 6).half(), None, None, 1, 1e-3, True)),
        # autocast's float32 y beside a bf16 x (traced calls under autocast)
        (
            "ln_out_float32",
            fwd,
            (r(3, 5, 7).bfloat16().requires_grad_(), None, w, b, 1, 1e-5, False, False, True),
        ),  # fmt: skip
        ("bwd_ln", bwd, (r(3, 7), None, r(3, 7), r(3), r(3).abs(), r(7), 1, [True, True, True])),
        (
            "bwd_rms_dsum",
            bwd,
            (r(3, 7), r(3, 7), r(3, 7), None, r(3).abs(), None, 1, [True, False, False]),
        ),
    ]


@pytest.mark.parametrize("name, op, args", _op_samples(), ids=[s[0] for s in _op_samples()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_gradcheck_ops_and_functions():
    g = torch.Generator().manual_seed(6)

    def r(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)

    x, res, w, b = r(2, 3, 5), r(2, 3, 5), r(5), r(5)
    for rms in (False, True):
        bias = None if rms else b
        inputs = (x, res, w) if rms else (x, res, w, b)

        def via_op(x, res, w, *rest, rms=rms):
            out = _row_norm.row_norm_fwd_op(x, res, w, rest[0] if rest else None, 1, 1e-5, rms)
            return out[0], out[1]

        def via_fn(x, res, w, *rest, rms=rms):
            out = _row_norm._RowNormFunction.apply(
                x, res, w, rest[0] if rest else None, 1, 1e-5, rms
            )
            return out[0], out[1]

        assert torch.autograd.gradcheck(via_op, inputs), rms
        assert torch.autograd.gradcheck(via_fn, inputs), rms
        assert torch.autograd.gradcheck(
            lambda x, w, rms=rms, bias=bias: _row_norm.row_norm_fwd_op(
                x, None, w, bias, 1, 1e-5, rms
            )[0],
            (x, w),
        )


def _same_meta(real, fake):
    for r, f in zip(real, fake, strict=True):
        assert (r is None) == (f is None)
        if r is not None:
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_fake_kernels_match_the_reference_kernels():
    g = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        x, res = torch.randn(2, 3, 4, 5, generator=g).to(dtype), torch.randn(2, 3, 4, 5).to(dtype)
        for residual, rms, ndim in ((None, False, 2), (res, True, 1), (res, False, 3)):
            w = torch.randn(x.shape[x.dim() - ndim :], generator=g)
            args = (x, residual, w, None, ndim, 1e-5, rms)
            real = _reference._row_norm_fwd_reference(*args)
            _same_meta(real, _row_norm._row_norm_fwd_fake(*args))
            for mask in ([True, True, True], [False, True, False], [True, False, False]):
                bargs = (torch.randn_like(x), residual, x, real[2], real[3], w, ndim, mask)
                _same_meta(
                    _reference._row_norm_bwd_reference(*bargs), _row_norm._row_norm_bwd_fake(*bargs)
                )


# ---------------------------------------------------------------------------------------------
# errors: torch's own for what torch checks, cupynorm's for what the kernels need
# ---------------------------------------------------------------------------------------------
def _error(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.type, str(info.value)


@pytest.mark.parametrize(
    "shape, normalized, weight_shape",
    [((2, 3), (4,), None), ((2, 3), (2, 3, 4), None), ((2, 3), (3,), (4,)), ((3,), (1, 3), None)],
)
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_shape_errors_are_torchs(kernels, name, shape, normalized, weight_shape):
    x = torch.randn(shape)
    w = None if weight_shape is None else torch.randn(weight_shape)
    ours_type, ours_text = _error(getattr(cnt, name), x, normalized, w)
    theirs_type, theirs_text = _error(getattr(F, name), x, normalized, w)
    assert ours_text == theirs_text
    assert issubclass(ours_type, theirs_type)


def test_residual_of_another_shape_is_refused(kernels):
    with pytest.raises(ValueError, match="residual of the input's shape"):
        cnt.add_layer_norm(torch.randn(2, 4), torch.randn(1, 4), 4)


def test_half_weight_beside_float_input_is_refused(kernels):
    with pytest.raises((TypeError, ValueError, RuntimeError), match="dtype"):
        cnt.layer_norm(torch.randn(2, 4), 4, torch.randn(4).half())


# ---------------------------------------------------------------------------------------------
# torch.compile and replace_norms
# ---------------------------------------------------------------------------------------------
class _Block(nn.Module):
    """A pre-norm transformer-style block: norms, linear layers and a fused residual add."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.rms = nn.RMSNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.fc1(self.ln(x))
        out, total = cnt.add_rms_norm(h, x, self.rms.normalized_shape, self.rms.weight)
        return self.fc2(out) + total


def test_compile_fullgraph_matches_eager(kernels):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = cnt.replace_norms(_Block(), include=[nn.LayerNorm, nn.RMSNorm])
    compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 5, 8, requires_grad=True)
    for model in (eager, compiled):
        y = model(x)
        got = (y, *torch.autograd.grad((y * y).sum(), [x, *eager.parameters()]))
        if model is eager:
            expected = got
    for u, v in zip(got, expected, strict=True):
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_replace_norms_converts_layer_and_rms_norms_and_their_plain_subclasses():
    class MyLayerNorm(nn.LayerNorm):  # same forward: converted
        pass

    class ScaledRMSNorm(nn.RMSNorm):  # computes something else: left alone
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.LayerNorm(4), nn.RMSNorm([2, 4]), MyLayerNorm(4), ScaledRMSNorm(4))
    before = [id(p) for p in model.parameters()]
    untouched = nn.Sequential(nn.LayerNorm(4), nn.RMSNorm(4))
    cnt.replace_norms(untouched)  # opt-in: their training step is not faster yet
    assert [type(m) for m in untouched] == [nn.LayerNorm, nn.RMSNorm]
    with pytest.warns(UserWarning, match="ScaledRMSNorm"):
        cnt.replace_norms(model, include=[nn.LayerNorm, nn.RMSNorm])
    assert type(model[0]) is cnt.LayerNorm and type(model[1]) is cnt.RMSNorm
    assert isinstance(model[2], cnt.LayerNorm) and isinstance(model[2], MyLayerNorm)
    assert type(model[3]) is ScaledRMSNorm
    assert [id(p) for p in model.parameters()] == before
    x = torch.randn(3, 2, 4)
    torch.testing.assert_close(model[1](x), nn.RMSNorm([2, 4])(x) * model[1].weight.detach())
    cnt.replace_norms(nn.Sequential(nn.LayerNorm(4)), include=[nn.LayerNorm], exclude=[nn.RMSNorm])


# ---------------------------------------------------------------------------------------------
# host code: which kernels run, with which grids (a fake launcher, no GPU)
# ---------------------------------------------------------------------------------------------
def test_short_rows_forward_is_one_launch_of_a_group_of_lanes_per_row(launches):  # noqa: F811
    rows, D = 130, 40  # float32: 10 packs, 4 lanes per row, 64 rows per CTA of 256 threads
    x, res = torch.rand(rows, D), torch.rand(rows, D)
    w = torch.rand(D)
    y, total, mean, rstd = _ops.row_norm_fwd(x, res, w, None, D, 1e-5, True)
    ((kernel, grid, block, _smem, args),) = launches
    assert kernel == "row_norm_fwd_short_rms_4" and grid == 3 and block == (256,)
    assert mean is None and rstd.shape == (rows,) and total.shape == y.shape == x.shape
    assert args[1] == res.data_ptr() and args[2] == total.data_ptr() and args[6] == 0  # no mean
    assert args[8:10] == [rows, D]


def test_short_rows_not_of_whole_packs_take_a_cta_per_row(launches):  # noqa: F811
    x = torch.rand(6, 41)
    _ops.row_norm_fwd(x, None, None, None, 41, 1e-5, False)
    ((kernel, grid, _block, _smem, _args),) = launches
    assert kernel == "segment_norm_fwd_layer" and grid == 6


def test_short_row_plan():
    plan, short = _plan.plan_short_rows, _plan.ShortRowPlan
    assert plan(96, 2, True) == short(4, 64)  # bf16 LayerNorm2d(96): 12 packs
    assert plan(8, 2, True) == short(4, 64)  # one pack
    assert plan(192, 2, True) == short(8, 32)
    assert plan(768, 2, True) == short(32, 8)  # 96 packs
    assert plan(1024, 2, True) == short(32, 8)  # 128 packs: four per lane
    assert plan(1032, 2, True) is None  # 129 packs: the register-held backward's
    assert plan(96, 2, False) is None and plan(100, 2, True) is None
    assert _plan.plan_row_bwd(1032, 2, True) is not None


@pytest.mark.parametrize("rms", [False, True])
def test_short_rows_backward_is_one_pass_of_groups_of_lanes(launches, rms):  # noqa: F811
    rows, D = 3000, 96  # float32: 24 packs, 8 lanes per row, 32 rows per CTA
    x, dy, w = torch.rand(rows, D), torch.rand(rows, D), torch.rand(D)
    mean = None if rms else torch.rand(rows)
    _ops.row_norm_bwd(dy, None, x, mean, torch.rand(rows), w, D, (True, True, not rms))
    (kernel, grid, block, _s, args), (params, _pgrid, _pblock, _s2, pargs) = launches
    assert kernel == "row_norm_bwd_short_8" and block == (256,)
    assert grid == min(-(-rows // 32), 2 * H200.sm_count)  # resident CTAs walk the rows
    assert args[9:11] == [rows, D] and args[4] == (0 if rms else mean.data_ptr())
    assert params == "row_norm_bwd_params" and pargs[4:6] == [grid, D]
    assert (args[8] == 0) == rms and args[7] != 0


@pytest.fixture
def variants(launches, monkeypatch):  # noqa: F811
    """The launch log, and each launch's module variant: (kernel, dtype, param dtype, out dtype)."""
    seen: list = []
    fake = _compile.launcher

    def launcher(dev, src, kernel, dtype, param_dtype, out_dtype, codes):
        seen.append((kernel, dtype, param_dtype, out_dtype))
        return fake(dev, src, kernel, dtype, param_dtype, out_dtype, codes)

    monkeypatch.setattr(_compile, "launcher", launcher)
    return launches, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_output_of_short_rows_reads_the_half_input_in_one_pass(variants, dtype):
    """LayerNorm under autocast: x read as is, y (and dy) float32, dx in x's dtype, one launch
    each way (the float32 copies of x and of dx are gone)."""
    log, seen = variants
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    rows, D = 300, 768  # 96 packs of 8: 32 lanes per row
    x, w, b = torch.rand(rows, D, dtype=dtype), torch.rand(D), torch.rand(D)
    y, _sum, mean, rstd = _ops.row_norm_fwd(x, None, w, b, D, 1e-5, False, out_dtype="float32")
    assert y.dtype == torch.float32 and y.shape == x.shape and mean.dtype == torch.float32
    assert seen == [("row_norm_fwd_short_layer_32", name, "float32", "float32")]
    assert log[0][4][:4] == [x.data_ptr(), 0, 0, y.data_ptr()]
    dy = torch.rand(rows, D)
    dx, dw, db = _ops.row_norm_bwd(dy, None, x, mean, rstd, w, D, (True, True, True))
    assert dx.dtype == dtype and dw.dtype == db.dtype == torch.float32
    assert [k for k, *_ in seen[1:]] == ["row_norm_bwd_short_32", "row_norm_bwd_params"]
    assert all(v[1:] == (name, "float32", "float32") for v in seen[1:])
    assert log[1][4][:2] == [x.data_ptr(), dy.data_ptr()] and log[1][4][6] == dx.data_ptr()


@pytest.mark.parametrize(
    "D, misaligned", [(2048, False), (100, False), (768, True)], ids=["long", "odd", "misaligned"]
)
def test_float32_output_of_other_rows_runs_the_float32_path_on_a_copy(variants, D, misaligned):
    """Rows the short-row kernels do not take: x converted to float32 in a launch of its own, the
    float32 kernels, and the backward's dx converted back."""
    log, seen = variants
    rows = 6
    x = torch.rand(rows * D + 1, dtype=torch.bfloat16)[1:] if misaligned else torch.rand(rows * D)
    x = x.to(torch.bfloat16).view(rows, D)
    w = torch.rand(D)
    y, _sum, mean, rstd = _ops.row_norm_fwd(x, None, w, None, D, 1e-5, False, out_dtype="float32")
    assert y.dtype == torch.float32
    convert, *rest = seen
    assert convert == ("row_norm_to_out", "bfloat16", "float32", "float32")
    assert rest and all(v[1:] == ("float32", None, None) for v in rest)  # the float32 kernels
    copy = log[0][4][1]
    assert log[1][4][0] == copy and log[0][4][:3:2] == [x.data_ptr(), rows * D]
    seen.clear()
    dx, dw, _db = _ops.row_norm_bwd(torch.rand(rows, D), None, x, mean, rstd, w, D,
                                    (True, True, False))  # fmt: skip
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert seen[0] == ("row_norm_to_out", "bfloat16", "float32", "float32")
    assert seen[-1] == ("row_norm_from_out", "bfloat16", "float32", "float32")
    assert all(v[1:] == ("float32", None, None) for v in seen[1:-1])
    assert log[-1][4][1] == dx.data_ptr()


def test_float32_output_of_channel_norms(variants):
    """LayerNorm2d under autocast: channels_last data is the row norm read as is; contiguous
    (NCHW) data the channels family on a float32 copy, dx converted back."""
    _log, seen = variants
    w = torch.rand(96)
    x = torch.rand(2, 96, 5, 7).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y, mean, rstd = _ops.channel_norm_fwd(x, w, None, 1e-5, False, out_dtype="float32")
    assert y.dtype == torch.float32 and y.is_contiguous(memory_format=torch.channels_last)
    assert seen == [("row_norm_fwd_short_layer_4", "bfloat16", "float32", "float32")]
    dx, _dw, _db = _ops.channel_norm_bwd(torch.rand(y.shape), x, mean, rstd, w, (True, True, False))
    assert dx.dtype == torch.bfloat16 and dx.is_contiguous(memory_format=torch.channels_last)
    assert all(v[1:] == ("bfloat16", "float32", "float32") for v in seen[1:])
    seen.clear()
    x = x.contiguous()
    y, mean, rstd = _ops.channel_norm_fwd(x, w, None, 1e-5, False, out_dtype="float32")
    assert y.dtype == torch.float32 and y.is_contiguous()
    dx, _dw, _db = _ops.channel_norm_bwd(torch.rand(y.shape), x, mean, rstd, w, (True, True, False))
    assert dx.dtype == torch.bfloat16 and dx.is_contiguous()
    assert seen and all(v[1:] == ("float32", None, None) for v in seen)


def test_out_dtype_is_wider_than_the_input_with_no_residual(launches):  # noqa: F811
    x = torch.rand(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no residual"):
        _ops.row_norm_fwd(x, x, None, None, 64, 1e-5, False, out_dtype="float32")
    with pytest.raises(ValueError, match="wider"):
        _ops.row_norm_fwd(x.double(), None, None, None, 64, 1e-5, False, out_dtype="float32")


def test_long_rows_forward_uses_the_strided_statistics(launches):  # noqa: F811
    rows, D = 2, 1 << 22  # 16 MiB rows: longer than a team holds
    x = torch.empty(rows, D)
    _ops.row_norm_fwd(x, None, None, None, D, 1e-5, True, want_stats=False)
    names = [k for k, *_ in launches]
    assert names == [
        "strided_norm_stats_rows",
        "strided_norm_finalize",
        "segment_norm_rms_rstd",
        "segment_norm_apply_rows",
    ]
    _k, grid, block, _s, args = launches[-1]
    tiles, tile_len = args[7], args[8]
    assert grid == rows * tiles and tiles * tile_len >= D > (tiles - 1) * tile_len


@pytest.mark.parametrize("rms", [False, True])
def test_backward_of_whole_packs_is_one_pass_in_registers(launches, rms):  # noqa: F811
    rows, D = 3000, 2048  # float32: 512 packs of 4, two per thread of 256
    x, dy, w = torch.rand(rows, D), torch.rand(rows, D), torch.rand(D)
    mean = None if rms else torch.rand(rows)
    _ops.row_norm_bwd(dy, None, x, mean, torch.rand(rows), w, D, (True, True, not rms))
    (kernel, grid, block, _s, args), (params, pgrid, pblock, _s2, pargs) = launches
    assert kernel == "row_norm_bwd_2" and block == (256,)
    assert grid == min(rows, 2 * H200.sm_count)  # the resident CTAs walk the rows
    assert args[9:11] == [rows, D] and args[4] == (0 if rms else mean.data_ptr())
    assert params == "row_norm_bwd_params" and pblock == (32, 8) and pgrid == D // 32
    assert pargs[4:6] == [grid, D]  # one partial row per CTA, summed over all of them
    assert (args[8] == 0) == rms and args[7] != 0  # no bias gradient asked for RMSNorm


def test_row_backward_plan():
    plan, regs = _plan.plan_row_bwd, _plan.RowCtaPlan
    assert plan(4096, 2, True) == regs(2, 256)  # bf16: 512 packs
    assert plan(2048, 2, True) == regs(1, 256)
    assert plan(4096, 4, True) == regs(4, 256)
    assert plan(4104, 2, True) == regs(4, 160)  # 513 packs: a partial last warp
    assert plan(516, 4, True) == regs(1, 160)  # 129 packs
    assert plan(512, 4, True) is None  # 128 packs: the short rows' kernels take them
    assert plan(16384, 2, True) is None  # 2048 packs: more than a CTA holds
    assert plan(4096, 2, False) is None and plan(4098, 2, True) is None


def test_row_forward_plan():
    plan, regs = _plan.plan_row_fwd, _plan.RowCtaPlan
    # the fewest threads that hold the row at 4 packs each (many small CTAs per SM)
    assert plan(4096, 2, True) == regs(4, 128)  # bf16: 512 packs
    assert plan(2048, 2, True) == regs(4, 64)
    assert plan(8192, 2, True) == regs(4, 256)  # 1024 packs: the most a CTA holds
    assert plan(1032, 2, True) == regs(4, 64)  # 129 packs: two or three a thread
    assert plan(4104, 2, True) == regs(4, 160)  # 513 packs: a partial last warp
    assert plan(1024, 2, True) is None  # 128 packs: the short rows' kernels take them
    assert plan(16384, 2, True) is None  # 2048 packs: shared memory (segment_norm.cu)
    assert plan(4096, 2, False) is None and plan(4098, 2, True) is None


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "add"])
def test_long_rows_forward_is_a_cta_per_row_in_registers(launches, residual):  # noqa: F811
    rows, D = 7, 2048  # float32: 512 packs, 128 threads of 4 packs
    x, w = torch.rand(rows, D), torch.rand(D)
    r = torch.rand(rows, D) if residual else None
    y, total, _mean, rstd = _ops.row_norm_fwd(x, r, w, None, D, 1e-5, True)
    ((kernel, grid, block, _smem, args),) = launches
    assert kernel == "row_norm_fwd_cta_rms_4" and grid == rows and block == (128,)
    assert args[8:10] == [rows, D]
    assert args[1] == (r.data_ptr() if residual else 0)
    assert args[2] == (total.data_ptr() if residual else 0)
    assert args[3] == y.data_ptr() and args[7] == rstd.data_ptr()


@pytest.mark.parametrize("D", [1001, 100_003])  # not whole packs: the segment kernels
def test_backward_launches_and_grids(launches, D):  # noqa: F811
    rows = 5
    x, dy, w = torch.rand(rows, D), torch.rand(rows, D), torch.rand(D)
    mean, rstd = torch.rand(rows), torch.rand(rows)
    dx, dw, db = _ops.row_norm_bwd(dy, None, x, mean, rstd, w, D, (True, True, True))
    names = [k for k, *_ in launches]
    tiles = launches[0][4][7]
    # one CTA reduces a short row, several a long one (tiles of 256 threads x 8 values)
    assert (tiles > 1) == (D > 2048)
    expected = ["segment_norm_bwd_rows_sums", "segment_norm_bwd_rows_dx"]
    if tiles > 1:
        expected.insert(1, "segment_norm_bwd_rows_merge")
    assert names == [*expected, "row_norm_bwd_params"]
    _k, grid, _b, _s, args = launches[0]
    assert grid == rows * tiles == rows * args[7]
    _k, grid, (threads,), _s, args = launches[len(expected) - 1]
    col_tiles, rows_per_group = args[12], args[13]
    vec = 4 if args[14] else 1  # float32 packs
    assert col_tiles * threads * 2 * vec >= D  # every column owned (ROWS_BWD_PACKS = 2)
    groups = grid // col_tiles
    assert grid == col_tiles * groups and groups * rows_per_group >= rows
    assert (groups - 1) * rows_per_group < rows  # no empty group
    assert dx.shape == x.shape and dw.shape == db.shape == (D,)
    assert launches[-1][4][4] == groups  # the column sums walk every group's partial row


def test_row_norm_calls_record_and_replay(launches):  # noqa: F811
    for D in (24, 25):  # whole packs (the short-row kernels) or not (the segment kernels)
        x, dy, w, b = torch.rand(4, D), torch.rand(4, D), torch.rand(D), torch.rand(D)
        _ops.row_norm_fwd(x, None, w, b, D, 1e-5, False)
        _ops.row_norm_bwd(dy, None, x, torch.rand(4), torch.rand(4), w, D, (True, True, True))
    assert len(_program._PROGRAMS) == 4
    assert all(isinstance(p, _program._Program) for p in _program._PROGRAMS.values())


def test_bench_add_rms_norm_modules_agree_and_keep_the_sum(kernels):
    from cupynorm.bench import models

    classes = models.row_norm_module_classes()
    eager, fused = classes["AddRMSNorm"](16), classes["AddRMSNormCupynorm"](16)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    torch.testing.assert_close(fused(x, r), eager(x, r))
    torch.testing.assert_close(fused.sum, x + r)
    torch.testing.assert_close(eager.sum, x + r)
