"""cupynorm.torch on a CUDA GPU: modules, custom ops and autograd against torch.nn.

Every test needs a GPU (and CuPy); all are marked ``gpu`` and skipped when CUDA is unavailable.
Data is fresh random (never zeros), sizes odd (C = 3, H*W = 7) plus shapes larger than one block;
tolerances come from the dtype. The reference is torch.nn on the same device and dtype, or a
float64 computation where the test says so.

Past 600 lines: the GPU counterpart of three CPU files (test_torch_modules_cpu.py,
test_convert_cpu.py, test_torch_errors_cpu.py), kept in one file with its model-step and
comparison helpers because it has not yet run on the GPU since those were split; split it the
same way after a device run.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from small_cnn import SmallCNN
from torch import nn

import cupynorm.torch as cnt
from cupynorm.torch import _batch_norm, _group_norm, _instance_norm, _row_norm_add_mul

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _no_tf32():
    """Convolutions and matmuls of the test models in full fp32: cuDNN's default TF32 would
    put its own 1e-3 rounding into the gradients compared here."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# relative tolerance per dtype; absolute: the same times the reference's largest magnitude
# (at least 0.01, for quantities that are zero up to rounding, like a bias before a norm)
TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 1.5e-2, torch.bfloat16: 8e-2}


def _close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    what: str,
    scale: float | None = None,
) -> None:
    assert actual.shape == expected.shape, what
    assert actual.dtype == expected.dtype, what
    tol = TOL[dtype]
    if scale is None:
        scale = max(expected.detach().abs().max().item(), 1e-2) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.detach().double(),
        expected.detach().double(),
        atol=tol * scale,
        rtol=tol,
        msg=lambda m: f"{what}: {m}",
    )


# ---------------------------------------------------------------------------------------------
# the module matrix: module x affine/track_running_stats x train/eval x dtype x layout
# ---------------------------------------------------------------------------------------------
# (cupynorm class, torch class, constructor args, shapes)
MODULES = [
    (cnt.BatchNorm1d, nn.BatchNorm1d, (3,), [(5, 3, 7), (64, 3)]),
    (cnt.BatchNorm2d, nn.BatchNorm2d, (3,), [(4, 3, 7, 1), (3, 3, 33, 35)]),
    (cnt.BatchNorm3d, nn.BatchNorm3d, (3,), [(2, 3, 1, 7, 1), (2, 3, 5, 9, 7)]),
    (cnt.InstanceNorm1d, nn.InstanceNorm1d, (3,), [(4, 3, 7), (2, 3, 1031)]),
    (cnt.InstanceNorm2d, nn.InstanceNorm2d, (3,), [(4, 3, 7, 1), (2, 3, 33, 35)]),
    (cnt.InstanceNorm3d, nn.InstanceNorm3d, (3,), [(2, 3, 1, 7, 1), (2, 3, 5, 9, 7)]),
    (cnt.GroupNorm, nn.GroupNorm, (3, 6), [(4, 6, 7, 1), (2, 6, 33, 35)]),
]


def _configs(torch_cls: type) -> list[dict]:
    if torch_cls is nn.GroupNorm:
        return [dict(affine=True), dict(affine=False)]
    configs = [dict(affine=a, track_running_stats=t) for a in (True, False) for t in (True, False)]
    if torch_cls is nn.BatchNorm2d:
        configs.append(dict(affine=True, track_running_stats=True, momentum=None))
    return configs


def _matrix():
    for ours, theirs, args, shapes in MODULES:
        for i, cfg in enumerate(_configs(theirs)):
            for shape in shapes:
                for channels_last in (False, True):
                    if channels_last and len(shape) not in (4, 5):
                        continue
                    layout = "channels_last" if channels_last else "contiguous"
                    yield pytest.param(
                        ours,
                        theirs,
                        args,
                        cfg,
                        shape,
                        channels_last,
                        id=f"{ours.__name__}-cfg{i}-{'x'.join(map(str, shape))}-{layout}",
                    )


def _randomize(m: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 1.0)
        if getattr(m, "running_mean", None) is not None:
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)


def _to_layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    if not channels_last:
        return x.contiguous()
    return x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def _inputs(shape, dtype, n=3, seed=1, channels_last=False, scale=2.0, offset=0.5):
    g = torch.Generator().manual_seed(seed)
    return [
        _to_layout(
            (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(
                DEVICE, dtype
            ),
            channels_last,
        )
        for _ in range(n)
    ]


def _steps(m: nn.Module, xs, train: bool, lr: float = 0.01, grad_scale: float = 1.0):
    """SGD steps with a loss whose gradient is a ramp (not constant: the whole backward formula
    matters); returns per step (y, dx, {param name: grad})."""
    m.train(train)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr) if params else None
    record = []
    for x in xs:
        x = x.detach().clone().requires_grad_()
        y = m(x)
        ramp = torch.linspace(-1, 2, y.numel(), device=y.device).reshape(y.shape) * grad_scale
        (y.float() * ramp).sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        record.append((y.detach(), x.grad, grads))
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return record


def _compare_runs(ours, theirs, dtype, what="", model=False):
    """Per step: outputs, input grads, parameter grads; the reference (possibly in a wider
    dtype) is rounded to ours' dtype first. For a whole ``model`` the parameter gradients are
    measured against the step's largest one: some (a conv bias before a GroupNorm) are small
    differences of large sums, as ill-conditioned in torch as in cupynorm."""
    for step, ((y, dx, grads), (y_ref, dx_ref, grads_ref)) in enumerate(
        zip(ours, theirs, strict=True)
    ):
        _close(y, y_ref.to(y.dtype), dtype, f"{what} step {step} output")
        _close(dx, dx_ref.to(dx.dtype), dtype, f"{what} step {step} input grad")
        assert grads.keys() == grads_ref.keys()
        scale = max(g.abs().max().item() for g in grads_ref.values()) if model else None
        for name, g in grads.items():
            _close(g, grads_ref[name].to(g.dtype), dtype, f"{what} step {step} {name} grad", scale)


def _compare_state(a: nn.Module, b: nn.Module, dtype, model=False) -> None:
    """Parameters and buffers; for a whole ``model`` measured against the largest entry (after
    SGD steps, parameters inherit the conditioning of their gradients)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    floats = [v for v in sb.values() if v.is_floating_point()]
    scale = max(v.abs().max().item() for v in floats) if model else None
    for key, value in sa.items():
        if key.endswith("num_batches_tracked"):
            assert torch.equal(value, sb[key]), key
        else:
            _close(value, sb[key].to(value.dtype), dtype, key, scale)


@pytest.mark.parametrize("ours_cls, torch_cls, args, cfg, shape, channels_last", list(_matrix()))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_module_matches_torch(ours_cls, torch_cls, args, cfg, shape, channels_last, train, dtype):
    """3 SGD steps; the reference is torch.nn in float32 for float16/bfloat16 modules (fed the
    same rounded data and parameters), so that the tolerance measures our error alone."""
    ref_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    ref = torch_cls(*args, **cfg)
    _randomize(ref)
    ours = ours_cls(*args, **cfg).to(DEVICE, dtype)
    ours.load_state_dict(ref.state_dict())
    ref = ref.to(DEVICE, dtype).to(ref_dtype)  # the parameters ours starts from, widened
    xs = _inputs(shape, dtype, channels_last=channels_last)
    run = _steps(ours, xs, train)
    run_ref = _steps(ref, [x.to(ref_dtype) for x in xs], train)
    _compare_runs(run, run_ref, dtype)
    _compare_state(ours, ref, dtype)
    for y, dx, _ in run:  # outputs and input grads keep the input's memory format
        fmt = _memory_format(xs[0])
        assert y.is_contiguous(memory_format=fmt) and dx.is_contiguous(memory_format=fmt)


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    if x.is_contiguous():
        return torch.contiguous_format
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_norm_add_mul_matches_reference(dtype):
    xs = _inputs((33, 7, 129), dtype, n=2, seed=3)
    x, y = (t.requires_grad_() for t in xs)
    out = cnt.RowNormAddMul()(x, y)
    x64, y64 = (t.detach().double().requires_grad_() for t in (x, y))
    ref = (F.layer_norm(x64, (129,), eps=1e-5) + y64) * y64
    dout = torch.randn_like(out)
    _close(out, ref.to(dtype), dtype, "out")
    grads = torch.autograd.grad(out, (x, y), dout)
    grads_ref = torch.autograd.grad(ref, (x64, y64), dout.double())
    for g, g_ref, name in zip(grads, grads_ref, ("dx", "dy"), strict=True):
        _close(g, g_ref.to(dtype), dtype, name)


def test_large_shapes_match_float64_reference():
    """Segments/channels longer than one block (the cluster, persistent and column strategies)."""
    cases = [
        (cnt.GroupNorm(32, 64), (2, 64, 127, 129), False),
        (cnt.InstanceNorm2d(4, affine=True), (2, 4, 511, 513), False),
        (cnt.BatchNorm2d(16), (8, 16, 127, 129), False),
        (cnt.BatchNorm2d(16), (8, 16, 127, 129), True),
        (cnt.GroupNorm(32, 320), (4, 320, 63, 65), True),
    ]
    for m, shape, channels_last in cases:
        _randomize(m)
        for dtype in (torch.float32, torch.float16):
            mod = copy.deepcopy(m).to(DEVICE, dtype)
            ref = copy.deepcopy(m).to(DEVICE, torch.float64)
            (x,) = _inputs(shape, dtype, n=1, channels_last=channels_last)
            # gradient scale keeping float16 sums of dbias below 65504 and dy above subnormals
            scale = x.numel() ** -0.5
            run = _steps(mod, [x], True, lr=0.0, grad_scale=scale)
            run_ref = _steps(_torch_twin(ref), [x.double()], True, lr=0.0, grad_scale=scale)
            (y, dx, grads), (y_ref, dx_ref, grads_ref) = run[0], run_ref[0]
            what = f"{type(m).__name__}{shape} {dtype}"
            _close(y, y_ref.to(dtype), dtype, what + " output")
            _close(dx, dx_ref.to(dtype), dtype, what + " input grad")
            for name in grads:
                _close(grads[name], grads_ref[name].to(dtype), dtype, f"{what} {name} grad")


def _torch_twin(m: nn.Module) -> nn.Module:
    """A copy of a cupynorm module as its torch.nn base class (same state)."""
    twin = copy.deepcopy(m)
    twin.__class__ = next(c for c in type(m).__mro__ if c.__module__.startswith("torch.nn"))
    return twin


def test_offset_data_float32():
    """Mean 1e4, std 1: no catastrophic cancellation (checked against float64)."""
    g = torch.Generator().manual_seed(7)
    x64 = torch.randn(4, 6, 33, 35, generator=g, dtype=torch.float64) + 1e4
    x = x64.float().to(DEVICE)
    x64 = x.double()  # the float32 data, exactly
    for fn, ref in [
        (lambda t: cnt.group_norm(t, 3), lambda t: F.group_norm(t, 3)),
        (lambda t: cnt.instance_norm(t), lambda t: F.instance_norm(t)),
        (
            lambda t: cnt.batch_norm(t, None, None, training=True),
            lambda t: F.batch_norm(t, None, None, training=True),
        ),
        (
            lambda t: cnt.row_norm_add_mul(t, t * 1e-4),
            lambda t: (F.layer_norm(t, (35,)) + t * 1e-4) * (t * 1e-4),
        ),
    ]:
        for layout in (False, True):
            y = fn(_to_layout(x, layout))
            torch.testing.assert_close(y.double(), ref(x64), atol=5e-3, rtol=5e-3)


# ---------------------------------------------------------------------------------------------
# gradcheck in float64, for each op, through the custom op and the eager Function
# ---------------------------------------------------------------------------------------------
def _f64(*shape, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (
        (torch.randn(shape, generator=g, dtype=torch.float64) + 0.3).to(DEVICE).requires_grad_(grad)
    )


@pytest.mark.parametrize("path", ["custom_op", "eager"])
def test_gradcheck_float64(path):
    x, y = _f64(2, 6, 7), _f64(2, 6, 7, seed=1)
    xcl = _f64(2, 6, 3, 5).detach().to(memory_format=torch.channels_last).requires_grad_()
    w, b = _f64(6, seed=2), _f64(6, seed=3)
    rm = torch.randn(6, dtype=torch.float64, device=DEVICE)
    rv = torch.rand(6, dtype=torch.float64, device=DEVICE) + 0.5
    op = path == "custom_op"

    def stats():
        return rm.clone(), rv.clone()

    gn = _group_norm.group_norm_fwd_op if op else _group_norm._GroupNormFunction.apply
    inorm = (
        _instance_norm.instance_norm_fwd_op if op else _instance_norm._InstanceNormFunction.apply
    )
    bn = _batch_norm.batch_norm_fwd_op if op else _batch_norm._BatchNormFunction.apply
    row = (
        _row_norm_add_mul.row_norm_add_mul_fwd_op
        if op
        else _row_norm_add_mul._RowNormAddMulFunction.apply
    )
    checks = {
        "group_norm": (lambda x, w, b: gn(x, 3, w, b, 1e-5)[0], (x, w, b)),
        "group_norm_cl": (lambda x, w, b: gn(x, 2, w, b, 1e-5)[0], (xcl, w, b)),
        "instance_norm": (lambda x, w, b: gn(x, 6, w, b, 1e-5)[0], (x, w, b)),
        "instance_norm_running": (
            lambda x, w, b: inorm(x, w, b, *stats(), 0.1, 1e-5)[0],
            (x, w, b),
        ),
        "batch_norm_train": (
            lambda x, w, b: bn(x, w, b, *stats(), True, 0.1, 1e-5)[0],
            (xcl, w, b),
        ),
        "batch_norm_eval": (lambda x, w, b: bn(x, w, b, *stats(), False, 0.1, 1e-5)[0], (x, w, b)),
        "batch_norm_no_stats": (
            lambda x, w, b: bn(x, w, b, None, None, True, 0.1, 1e-5)[0],
            (x, w, b),
        ),
        "row_norm_add_mul": (lambda x, y: row(x, y, 1e-5)[0], (x, y)),
    }
    for name, (fn, inputs) in checks.items():
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4), name


def test_eager_function_and_custom_op_agree_bitwise():
    """Same kernels on both routes: identical results (and deterministic backward)."""
    (x,) = _inputs((4, 6, 33, 35), torch.float16, n=1)
    w = torch.randn(6, device=DEVICE, dtype=torch.float16, requires_grad=True)
    results = []
    for fn in (
        _group_norm.group_norm_fwd_op,
        _group_norm._GroupNormFunction.apply,
        _group_norm.group_norm_fwd_op,
    ):
        xg = x.detach().clone().requires_grad_()
        y = fn(xg, 3, w, None, 1e-5)[0]
        (dx, dw) = torch.autograd.grad(y, (xg, w), torch.ones_like(y) * 0.5 + y.detach())
        results.append((y, dx, dw))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck on the CUDA kernels
# ---------------------------------------------------------------------------------------------
def _op_samples() -> dict:
    """name -> (op, args); built inside the test (collection must not touch CUDA)."""

    def r(*shape, dtype=torch.float32, grad=False):
        g = torch.Generator().manual_seed(sum(shape))
        return (torch.randn(shape, generator=g) + 0.2).to(DEVICE, dtype).requires_grad_(grad)

    x = r(3, 6, 5, 7, grad=True)
    xcl = r(3, 6, 5, 7).to(memory_format=torch.channels_last).requires_grad_()
    w, b = r(6, grad=True), r(6, grad=True)
    rm, rv = r(6), r(6).abs() + 0.5
    samples = [
        ("gn", _group_norm.group_norm_fwd_op, (x, 3, w, b, 1e-5)),
        (
            "gn_cl_half",
            _group_norm.group_norm_fwd_op,
            (xcl.detach().half().requires_grad_(), 2, None, None, 1e-5),
        ),
        (
            "gn_f32_weight_bf16_x",
            _group_norm.group_norm_fwd_op,
            (x.detach().bfloat16().requires_grad_(), 3, w, b, 1e-5),
        ),
        (
            "gn_act_shift_cl",
            _group_norm.group_norm_act_fwd_op,
            (xcl, 3, w, b, 1e-5, "silu", r(3, 6, grad=True)),
        ),
        ("in", _instance_norm.instance_norm_fwd_op, (xcl, w, b, rm, rv, 0.1, 1e-5)),
        ("bn_train", _batch_norm.batch_norm_fwd_op, (xcl, w, b, rm, rv, True, 0.1, 1e-5)),
        (
            "bn_train_no_stats",
            _batch_norm.batch_norm_fwd_op,
            (x, None, b, None, None, True, 0.1, 1e-5),
        ),
        ("bn_eval", _batch_norm.batch_norm_fwd_op, (x, w, b, rm, rv, False, 0.1, 1e-5)),
        (
            "bn_2d",
            _batch_norm.batch_norm_fwd_op,
            (r(9, 6, grad=True), w, b, rm, rv, True, 0.1, 1e-5),
        ),
        (
            "row",
            _row_norm_add_mul.row_norm_add_mul_fwd_op,
            (r(5, 33, grad=True), r(5, 33, grad=True), 1e-5),
        ),
        (
            "gn_bwd",
            _group_norm.group_norm_bwd_op,
            (r(3, 6, 7), r(3, 6, 7), r(3, 3), r(3, 3).abs() + 0.5, r(6), 3, [True, True, True]),
        ),
        (
            "bn_bwd",
            _batch_norm.batch_norm_bwd_op,
            (r(3, 6, 7), r(3, 6, 7), r(6), r(6).abs() + 0.5, None, True, [True, False, False]),
        ),
        (
            "row_bwd",
            _row_norm_add_mul.row_norm_add_mul_bwd_op,
            (r(3, 7), r(3, 7), r(3, 7), r(3), r(3).abs() + 0.5),
        ),
    ]
    return {name: (op, args) for name, op, args in samples}


_OP_SAMPLE_NAMES = [
    "gn",
    "gn_cl_half",
    "gn_f32_weight_bf16_x",
    "gn_act_shift_cl",
    "in",
    "bn_train",
    "bn_train_no_stats",
    "bn_eval",
    "bn_2d",
    "row",
    "gn_bwd",
    "bn_bwd",
    "row_bwd",
]


@pytest.mark.parametrize("name", _OP_SAMPLE_NAMES)
def test_opcheck_cuda(name):
    samples = _op_samples()
    assert sorted(samples) == sorted(_OP_SAMPLE_NAMES)
    op, args = samples[name]
    torch.library.opcheck(op, args)


# ---------------------------------------------------------------------------------------------
# whole models: torch.compile, CUDA graphs, replace_norms, autocast, streams
# ---------------------------------------------------------------------------------------------
# SmallCNN: tests/small_cnn.py


def _model_steps(model, xs, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    record = []
    for x in xs:
        x = x.detach().clone().requires_grad_()
        y = model(x)
        (y * y).sum().backward()
        # clones: under CUDA graphs (reduce-overhead) outputs live in buffers that are reused
        named = getattr(model, "_orig_mod", model).named_parameters()  # compiled: unwrap
        record.append((y.detach().clone(), x.grad.clone(), {n: p.grad.clone() for n, p in named}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return record


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_replace_norms_cuda_same_outputs_and_grads(channels_last):
    torch.manual_seed(0)
    ref = SmallCNN().to(DEVICE)
    model = copy.deepcopy(ref)
    params = dict(model.named_parameters())
    assert cnt.replace_norms(model) is model
    assert type(model.bn) is cnt.BatchNorm2d and type(model.bn1d) is cnt.BatchNorm1d
    assert all(p is params[n] for n, p in model.named_parameters())
    xs = _inputs((4, 3, 7, 9), torch.float32, channels_last=channels_last)
    for train in (True, False):
        model.train(train)
        ref.train(train)
        _compare_runs(
            _model_steps(model, xs),
            _model_steps(ref, xs),
            torch.float32,
            f"train={train}",
            model=True,
        )
        _compare_state(model, ref, torch.float32, model=True)


def test_torch_avg_pool_probe_tells_poolformers_fate():
    """The probe of torch's padded channels_last AvgPool2d backward (pytorch/pytorch#188344)
    answers for the layer where it hurt: PoolFormer's AvgPool2d(3, 1, 1) after a GroupNorm."""
    from cupynorm.torch import convert

    torch.manual_seed(0)
    x = torch.randn(4, 64, 56, 56, device=DEVICE)
    grad = torch.randn(4, 64, 56, 56, device=DEVICE)
    pool = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
    grads = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        xi = x.contiguous(memory_format=fmt).detach().requires_grad_(True)
        pool(xi).backward(grad.contiguous(memory_format=fmt))
        grads.append(xi.grad)
    wrong = not torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    assert convert.torch_avg_pool_backward_is_wrong() is wrong


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = SmallCNN().to(DEVICE)
    eager = cnt.replace_norms(copy.deepcopy(ref))
    compiled_model = cnt.replace_norms(copy.deepcopy(ref))
    compiled = torch.compile(compiled_model, fullgraph=True)
    xs = _inputs((4, 3, 7, 9), torch.float32)
    for train in (True, False):
        for m in (ref, eager, compiled_model):
            m.train(train)
        run_eager = _model_steps(eager, xs)
        _compare_runs(
            _model_steps(compiled, xs), run_eager, torch.float32, f"train={train}", model=True
        )
        _compare_runs(
            run_eager, _model_steps(ref, xs), torch.float32, f"torch train={train}", model=True
        )
        _compare_state(compiled_model, eager, torch.float32, model=True)
    assert int(compiled_model.bn.num_batches_tracked) == 3


def test_torch_compile_reduce_overhead_matches_eager():
    """Inductor's CUDA graphs around the custom ops (running statistics written back)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = cnt.replace_norms(SmallCNN().to(DEVICE))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, mode="reduce-overhead", fullgraph=True)
    xs = _inputs((4, 3, 7, 9), torch.float32, n=5)
    _compare_runs(_model_steps(compiled, xs), _model_steps(eager, xs), torch.float32, model=True)
    _compare_state(compiled_model, eager, torch.float32, model=True)


def test_cuda_graph_capture_forward_backward():
    torch.manual_seed(0)
    model = cnt.replace_norms(SmallCNN().to(DEVICE))
    static_x = torch.randn(4, 3, 7, 9, device=DEVICE, requires_grad=True)
    # warm up on a side stream: kernels compile and caches fill outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            (model(static_x) ** 2).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    static_x.grad = None

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
        (static_y**2).sum().backward()

    eager = copy.deepcopy(model)  # the state the replays start from
    eager.zero_grad(set_to_none=True)
    for step, x in enumerate(_inputs((4, 3, 7, 9), torch.float32, n=3, seed=11)):
        with torch.no_grad():
            static_x.copy_(x)
        graph.replay()
        x_eager = x.clone().requires_grad_()
        y = eager(x_eager)
        (y**2).sum().backward()
        torch.cuda.synchronize()
        _close(static_y, y, torch.float32, f"step {step} output")
        _close(static_x.grad, x_eager.grad, torch.float32, f"step {step} input grad")
        scale = max(q.grad.abs().max().item() for q in eager.parameters())
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            _close(p.grad, q.grad, torch.float32, f"step {step} {name} grad", scale)
        eager.zero_grad(set_to_none=True)
        _compare_state(model, eager, torch.float32, model=True)


def test_autocast_matches_torch():
    """Under CUDA autocast: float16 activations with float32 parameters and running stats;
    group_norm runs in float32 (torch's autocast policy), the others in the input dtype."""
    torch.manual_seed(0)
    ref = SmallCNN().to(DEVICE)
    model = cnt.replace_norms(copy.deepcopy(ref))
    xs = _inputs((4, 3, 7, 9), torch.float32)
    runs = []
    for m in (model, ref):
        m.train()
        record = []
        for x in xs:
            x = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.float16):
                y = m(x)
            (y.float() ** 2).sum().backward()
            record.append(
                (y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()})
            )
            m.zero_grad(set_to_none=True)
        runs.append(record)
    _compare_runs(runs[0], runs[1], torch.float16, model=True)
    _compare_state(model, ref, torch.float16, model=True)
    (h,) = _inputs((4, 6, 7, 9), torch.float16, n=1)
    with torch.autocast("cuda", dtype=torch.float16):
        for ours, theirs in [(model.gn, ref.gn), (model.bn, ref.bn), (model.inorm, ref.inorm)]:
            y, y_ref = ours(h), theirs(h)
            assert y.dtype == y_ref.dtype, type(ours).__name__
            _close(y, y_ref, torch.float16, type(ours).__name__)


def test_non_default_stream():
    """Kernels run on torch's current stream: data made on a side stream is read correctly."""
    m = cnt.GroupNorm(8, 64).to(DEVICE)
    bn = cnt.BatchNorm2d(64).to(DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.randn(16, 64, 96, 97, device=DEVICE).requires_grad_()
        y = bn(m(x))
        y.sum().backward()
        dx = x.grad
    torch.cuda.current_stream().wait_stream(side)
    ref_m, ref_bn = nn.GroupNorm(8, 64).to(DEVICE), nn.BatchNorm2d(64).to(DEVICE)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = ref_bn(ref_m(x_ref))
    y_ref.sum().backward()
    _close(y, y_ref, torch.float32, "output")
    _close(dx, x_ref.grad, torch.float32, "input grad")
    _close(bn.running_var, ref_bn.running_var, torch.float32, "running_var")


def test_eval_batch_norm_leaves_running_stats_and_grads():
    m = cnt.BatchNorm2d(3).to(DEVICE)
    _randomize(m)
    m.eval()
    before = copy.deepcopy(m.state_dict())
    (x,) = _inputs((4, 3, 7, 1), torch.float32, n=1)
    x.requires_grad_()
    y = m(x)
    y.sum().backward()
    for key, value in before.items():
        assert torch.equal(m.state_dict()[key], value), key
    ref = nn.BatchNorm2d(3).to(DEVICE)
    ref.load_state_dict(before)
    ref.eval()
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).sum().backward()
    _close(x.grad, x_ref.grad, torch.float32, "input grad")
    _close(m.weight.grad, ref.weight.grad, torch.float32, "weight grad")


def test_unusual_strides_and_expanded_grad():
    x = torch.randn(3, 6, 11, 7, device=DEVICE).transpose(2, 3).requires_grad_()
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    ref = nn.GroupNorm(3, 6)
    _randomize(ref)
    ref = ref.to(DEVICE)
    m = cnt.GroupNorm(3, 6).to(DEVICE)
    m.load_state_dict(ref.state_dict())
    dy = torch.randn(1, 6, 1, 1, device=DEVICE).expand(x.shape)  # stride 0 but for channels
    y = m(x)
    y.backward(dy)
    dx, x.grad = x.grad, None
    y_ref = ref(x)
    y_ref.backward(dy)
    _close(y, y_ref, torch.float32, "output")
    _close(dx, x.grad, torch.float32, "input grad")
    _close(m.weight.grad, ref.weight.grad, torch.float32, "weight grad")


def test_float64_modules():
    for ours, theirs, args, shapes in MODULES:
        ref = theirs(*args, affine=True).to(DEVICE, torch.float64)
        _randomize(ref)
        mod = ours(*args, affine=True).to(DEVICE, torch.float64)
        mod.load_state_dict(ref.state_dict())
        xs = _inputs(shapes[-1], torch.float64)
        _compare_runs(_steps(mod, xs, True), _steps(ref, xs, True), torch.float64, ours.__name__)


# ---------------------------------------------------------------------------------------------
# errors on CUDA tensors: the installed torch's exception type and message
# ---------------------------------------------------------------------------------------------
def _raised(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda m: m.BatchNorm2d(3), (2, 4, 5, 5)),  # running_mean should contain 4 elements
        (lambda m: m.GroupNorm(2, 4), (4,)),  # a 1-D input
        (lambda m: m.GroupNorm(3, 3), (2, 4, 5)),  # channels not divisible by num_groups
        (lambda m: m.GroupNorm(2, 6), (2, 4, 5)),  # weight of the wrong size
        (lambda m: m.BatchNorm1d(3), (1, 3)),  # one value per channel in training
        (lambda m: m.InstanceNorm1d(4), (2, 4, 1)),  # one spatial element
    ],
    ids=["bn_channels", "gn_1d", "gn_divisible", "gn_weight", "bn_one_value", "in_one_element"],
)
def test_module_errors_are_torchs_on_cuda(make, shape):
    x = torch.randn(shape, device=DEVICE)
    expected = _raised(lambda: make(nn).to(DEVICE)(x))
    error = _raised(lambda: make(cnt).to(DEVICE)(x))
    assert isinstance(error, type(expected)), (type(error), type(expected))
    assert str(error) == str(expected)


class _RewrittenGroupNorm(nn.GroupNorm):
    """A library's GroupNorm overriding forward with torch's math (as timm's does)."""

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


def test_replace_norms_converted_subclass_runs_cupynorm_on_cuda():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3), _RewrittenGroupNorm(4, 8)).to(DEVICE)
    model = cnt.replace_norms(copy.deepcopy(ref))
    assert isinstance(model[1], cnt.GroupNorm) and isinstance(model[1], _RewrittenGroupNorm)
    xs = _inputs((4, 3, 9, 11), torch.float32)
    _compare_runs(_model_steps(model, xs), _model_steps(ref, xs), torch.float32, model=True)


def test_replace_norms_timm_norm_act_layers_on_cuda():
    """timm's norm-act layers (the GPU machine has timm): converted, they run cupynorm's norm
    then their own drop and act, and train as timm's modules do."""
    layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        layers.BatchNormAct2d(8),
        nn.Conv2d(8, 8, 3),
        layers.GroupNormAct(8, num_groups=4, act_layer=nn.SiLU),
    ).to(DEVICE)
    model = cnt.replace_norms(copy.deepcopy(ref))
    assert isinstance(model[1], cnt.BatchNorm2d) and isinstance(model[1], layers.BatchNormAct2d)
    assert isinstance(model[3], cnt.GroupNorm) and isinstance(model[3], layers.GroupNormAct)
    xs = _inputs((4, 3, 11, 13), torch.float32)
    # SiLU of cupynorm's GroupNorm (on a copy: a training forward counts a batch)
    y = copy.deepcopy(model)(xs[0].clone().requires_grad_())
    norm = type(y.grad_fn.next_functions[0][0]).__name__  # a replay once its key was checked
    assert norm in ("_GroupNormFunctionBackward", "_ReplayFunctionBackward")
    _compare_runs(_model_steps(model, xs), _model_steps(ref, xs), torch.float32, model=True)
    _compare_state(model, ref, torch.float32, model=True)


def test_fuse_timm_batch_norm_act_on_cuda():
    """fuse() puts timm's BatchNormAct2d (BatchNorm, then an Identity drop and a SiLU/ReLU act)
    on the fused kernel, and the model trains as timm's does (fp32: the fused kernels' other
    dtypes are tests/test_fused_gpu.py's)."""
    layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Conv2d(3, 16, 3),
        layers.BatchNormAct2d(16, act_layer=nn.SiLU),
        nn.Conv2d(16, 16, 3),
        layers.BatchNormAct2d(16),  # ReLU
    ).to(DEVICE)
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(ref), report=report)
    assert report == ["1 + silu", "3 + relu"]
    y = copy.deepcopy(model)(_inputs((4, 3, 11, 13), torch.float32)[0].requires_grad_())
    # the act runs in the norm's node (a replay's once its key was checked)
    assert type(y.grad_fn).__name__ in ("_BatchNormActFunctionBackward", "_ReplayFunctionBackward")
    xs = _inputs((4, 3, 11, 13), torch.float32)
    _compare_runs(_model_steps(model, xs), _model_steps(ref, xs), torch.float32, model=True)
    _compare_state(model, ref, torch.float32, model=True)


@pytest.mark.parametrize("single", [None, True], ids=["default", "single_launch"])
@pytest.mark.parametrize("act", [False, True], ids=["plain", "act"])
@pytest.mark.parametrize(
    "dtype,w_dtype,stats_dtype",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float16, torch.float16, torch.float16),
        (torch.bfloat16, None, torch.float32),  # statistics off the kernels (torch ops)
    ],
    ids=["fp32", "bf16_fp32_params", "fp16", "bf16_fp32_stats"],
)
def test_functional_op_writes_the_new_running_statistics(
    request, single, act, dtype, w_dtype, stats_dtype
):
    """The training forward op (what torch.compile runs) returns the updated running statistics
    in new tensors written by the kernels, the given ones unchanged: bitwise the eager
    functional's in-place update, for the split passes and the single launch."""
    from cupynorm import _single

    # enable() also forgets recorded calls, whose replays repeat the path they took
    request.addfinalizer(lambda default=_single.enabled: _single.enable(default))
    _single.enable(single)
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(8, 24, 7, 9, device="cuda", generator=g).to(dtype)
    x = x.to(memory_format=torch.channels_last)
    w = (torch.rand(24, device="cuda", generator=g) + 0.5).to(w_dtype or dtype)
    b = torch.randn(24, device="cuda", generator=g).to(w_dtype or dtype)
    if w_dtype is None:  # no parameters: the statistics' dtype is not the kernels'
        w = b = None
    rm = torch.randn(24, device="cuda", generator=g).to(stats_dtype)
    rv = (torch.rand(24, device="cuda", generator=g) + 0.5).to(stats_dtype)
    old = rm.clone(), rv.clone()
    if act:
        z = torch.randn_like(x)
        outs = _batch_norm.batch_norm_act_fwd_op(x, w, b, rm, rv, True, 0.1, 1e-5, z, "relu")
    else:
        outs = _batch_norm.batch_norm_fwd_op(x, w, b, rm, rv, True, 0.1, 1e-5)
    new_mean, new_var = outs[3], outs[4]
    assert torch.equal(rm, old[0]) and torch.equal(rv, old[1])  # the inputs are not mutated
    assert new_mean.data_ptr() not in (rm.data_ptr(), rv.data_ptr())
    eager_m, eager_v = old[0].clone(), old[1].clone()
    cnt.batch_norm(x, eager_m, eager_v, w, b, training=True, momentum=0.1, eps=1e-5)
    assert torch.equal(new_mean, eager_m) and torch.equal(new_var, eager_v)
    assert not torch.equal(new_mean, old[0])  # an update happened
    # against the update in float64
    xd = x.double()
    mean, var = xd.mean(dim=(0, 2, 3)), xd.var(dim=(0, 2, 3), unbiased=True)
    tol = 2e-3 if stats_dtype == torch.float16 else 1e-5
    expected = 0.9 * old[0].double() + 0.1 * mean, 0.9 * old[1].double() + 0.1 * var
    torch.testing.assert_close(new_mean.double(), expected[0], rtol=tol, atol=tol)
    torch.testing.assert_close(new_var.double(), expected[1], rtol=tol, atol=tol)
