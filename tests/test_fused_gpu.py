"""The fused BatchNorm + residual add + activation (cupynorm.torch.batch_norm_act, BatchNormAct2d,
fuse) on the GPU: against the unfused sequence in float64 on fresh data, every dtype and layout,
odd sizes, offset data, training and eval; and fuse() on a torchvision resnet50 against torch."""

from __future__ import annotations

import copy

import pytest
from conftest import cuda_available, poison_torch_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

if cuda_available():
    import torch
    import torch.nn.functional as F

    import cupynorm.torch as cnt

    DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    ACTS = {"identity": lambda t: t, "relu": F.relu, "silu": F.silu}

# relative to the largest reference value; half types: one rounding of the output, and dt
# rounded once before the norm's backward (as the unfused ops do)
TOL = {"float32": 2e-5, "float64": 1e-10, "float16": 4e-3, "bfloat16": 3e-2}

CASES = [  # shape, memory format
    ((4, 5, 7, 9), "contiguous"),  # odd C and planes: the scalar paths
    ((3, 5, 7, 9), "channels_last"),
    ((8, 64, 14, 14), "channels_last"),  # a resnet50 layer's shape at a small batch
    ((4, 2048, 7, 7), "channels_last"),  # few rows of many channels: channel tiles over the grid
    ((2, 32, 33, 31), "contiguous"),
    ((16, 24), "contiguous"),  # (N, C): BatchNorm1d's form through the functional API
]


def _make(shape, dtype, fmt, offset=0.0):
    x = torch.randn(shape, device="cuda", dtype=torch.float64) + offset
    x = x.to(DTYPES.get(dtype, torch.float64))
    return x.to(memory_format=torch.channels_last) if fmt == "channels_last" else x


def _close(ours, ref, dtype, what):
    assert ours is not None, what
    assert not torch.isnan(ours).any(), f"NaN in {what}"
    scale = ref.abs().max().item() + 1e-30
    err = (ours.double() - ref.double()).abs().max().item() / scale
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("act", ["relu", "silu", "identity"])
@pytest.mark.parametrize("residual", [True, False], ids=["add", "noadd"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape,fmt", CASES, ids=[f"{'x'.join(map(str, s))}-{f}" for s, f in CASES])
def test_batch_norm_act_matches_float64(dtype, act, residual, training, shape, fmt):
    if act == "identity" and not residual:
        pytest.skip("plain batch norm: tested elsewhere")
    poison_torch_allocator()
    C = shape[1]
    x = _make(shape, dtype, fmt, offset=3.0).requires_grad_()
    z = _make(shape, dtype, fmt).requires_grad_() if residual else None
    pdtype = torch.float64 if dtype == "float64" else torch.float32
    w = (torch.rand(C, device="cuda", dtype=pdtype) + 0.5).requires_grad_()
    b = torch.randn(C, device="cuda", dtype=pdtype).requires_grad_()
    rm = torch.randn(C, device="cuda", dtype=pdtype)
    rv = torch.rand(C, device="cuda", dtype=pdtype) + 0.5
    rm_ref, rv_ref = rm.double(), rv.double()
    y = cnt.batch_norm_act(x, rm, rv, w, b, training, 0.1, 1e-5, residual=z, activation=act)
    assert y.dtype == x.dtype and y.is_contiguous(memory_format=_fmt(x))
    dy = torch.randn_like(y)
    y.backward(dy)
    # float64 reference: the unfused sequence on the same (rounded) inputs
    xd = x.detach().double().requires_grad_()
    zd = z.detach().double().requires_grad_() if residual else None
    wd, bd = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    t = F.batch_norm(xd, rm_ref, rv_ref, wd, bd, training, 0.1, 1e-5)
    t = t + zd if residual else t
    # ReLU as a multiplication by our output's mask: the same kink for both (an input within
    # rounding of 0 may land on either side, and its whole gradient with it)
    yd = t * (y.detach() > 0) if act == "relu" else ACTS[act](t)
    yd.backward(dy.double())
    _close(y.detach(), yd.detach(), dtype, "y")
    _close(x.grad, xd.grad, dtype, "dx")
    _close(w.grad, wd.grad, dtype, "dweight")
    _close(b.grad, bd.grad, dtype, "dbias")
    if residual:
        _close(z.grad, zd.grad, dtype, "dresidual")
    if training:
        _close(rm, rm_ref, dtype, "running_mean")
        _close(rv, rv_ref, dtype, "running_var")


def _fmt(x):
    return (
        torch.channels_last if x.dim() == 4 and not x.is_contiguous() else torch.contiguous_format
    )


def test_batch_norm_act_equals_unfused_cupynorm_in_float32():
    """The fused op against cupynorm's own batch norm followed by torch's add and ReLU: the same
    statistics kernels, so the forward agrees to one rounding and the backward closely."""
    torch.manual_seed(0)
    x = _make((8, 64, 28, 28), "float32", "channels_last", 1.0).requires_grad_()
    z = _make((8, 64, 28, 28), "float32", "channels_last").requires_grad_()
    fused, plain = cnt.BatchNormAct2d(64).cuda(), cnt.BatchNorm2d(64).cuda()
    y = fused(x, z)
    x2, z2 = x.detach().clone().requires_grad_(), z.detach().clone().requires_grad_()
    y2 = F.relu(plain(x2) + z2)
    torch.testing.assert_close(y, y2, rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(y)
    y.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(z.grad, z2.grad, rtol=0, atol=0)  # dy where y > 0: exact
    torch.testing.assert_close(fused.weight.grad, plain.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused.running_var, plain.running_var)


def _dense_like(x, misaligned):
    """A random tensor with x's shape and strides, its data 16-byte aligned or 2 bytes off."""
    offset = 1 if misaligned else 0
    flat = torch.empty(x.numel() + offset, device="cuda", dtype=x.dtype)[offset:]
    t = flat.as_strided(x.shape, x.stride())
    t.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype))
    return t


def _in_memory_order(t):
    """t's elements in the order a channels-innermost tensor holds them."""
    return t.permute(0, *range(2, t.dim()), 1).flatten() if t.dim() > 2 else t.flatten()


@pytest.mark.parametrize("misaligned_dy", [False, True], ids=["dy-aligned", "dy-misaligned"])
@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((8, 64, 14, 14), "bfloat16"),
        ((3, 24, 7, 9), "float16"),  # 189 rows: a partial block of rows
        ((37, 16), "bfloat16"),  # (N, C)
        ((2, 16, 3, 5, 7), "float16"),  # channels_last_3d
    ],
)
def test_relu_mask_backward_is_bitwise_the_recomputed_one(shape, dtype, misaligned_dy):
    """ReLU with a residual on 16-byte packs: the forward keeps the ReLU's mask (t > 0, a bit per
    element in x's layout) and the backward's sums pass reads it instead of the residual. The
    gradients are bit for bit those of the pass that recomputes t from the residual; a misaligned
    dy makes the backward read the mask bit by bit (its scalar path)."""
    from cupynorm import _ops

    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=DTYPES[dtype]) + 0.3
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    x = x.to(memory_format=fmt) if fmt is not None else x
    z = torch.randn_like(x)
    C = shape[1]
    w, b = torch.rand(C, device="cuda") + 0.5, torch.randn(C, device="cuda")

    def forward(keep):
        rm, rv = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")
        return _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5, z, "relu", None, keep)

    y, mean, rstd, mask = forward(True)
    y2, mean2, rstd2 = forward(False)
    assert torch.equal(y, y2) and torch.equal(mean, mean2) and torch.equal(rstd, rstd2)
    assert mask.dtype == torch.uint8 and mask.numel() * 8 == x.numel()
    # bit e of byte j: element 8j + e in x's memory order, set where t > 0 (so where y > 0)
    bits = (mask[:, None].int() >> torch.arange(8, device="cuda", dtype=torch.int32)) & 1
    assert torch.equal(bits.flatten().bool(), _in_memory_order(y) > 0)
    dy = _dense_like(x, misaligned_dy)
    needs = (True, True, True, True)
    from_mask = _ops.batch_norm_act_bwd(dy, x, mean, rstd, w, True, needs, None, b, "relu", mask)
    recomputed = _ops.batch_norm_act_bwd(dy, x, mean, rstd, w, True, needs, z, b, "relu")
    for ours, theirs in zip(from_mask, recomputed, strict=True):
        assert torch.equal(ours, theirs)


def test_batch_norm_act_saves_the_relu_mask_not_the_residual():
    """The eager BatchNormAct2d with a residual in bf16 on channels_last keeps the ReLU's mask
    for its backward (1/16 of the residual's bytes), not the residual; the residual's gradient
    is dy where the output is positive, 0 elsewhere, exactly."""
    torch.manual_seed(0)
    m = cnt.BatchNormAct2d(64).cuda().to(torch.bfloat16)
    x = _make((8, 64, 14, 14), "bfloat16", "channels_last").requires_grad_()
    z = _make((8, 64, 14, 14), "bfloat16", "channels_last").requires_grad_()
    y = m(x, z)
    saved = y.grad_fn.saved_tensors
    assert saved[4] is None and saved[6].dtype == torch.uint8  # residual, mask
    assert saved[6].numel() == x.numel() // 8
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(z.grad, torch.where(y > 0, dy, torch.zeros_like(dy)))
    assert x.grad.isfinite().all() and m.weight.grad.isfinite().all()


def test_batch_norm_act_cuda_graph_and_compile():
    torch.manual_seed(0)
    m = cnt.BatchNormAct2d(16, activation="silu").cuda()
    x = torch.randn(4, 16, 9, 9, device="cuda")
    z = torch.randn(4, 16, 9, 9, device="cuda")
    eager = m(x, z)
    compiled = torch.compile(copy.deepcopy(m), fullgraph=True)(x, z)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    # training under Inductor (the fused op stays in the graph): gradients as eager's
    xs = [t.clone().to(memory_format=torch.channels_last).requires_grad_() for t in (x, x)]
    zs = [t.clone().requires_grad_() for t in (z, z)]
    dy = torch.randn_like(x)
    m_eager, m_compiled = copy.deepcopy(m), copy.deepcopy(m)
    m_eager(xs[0], zs[0]).backward(dy)
    torch.compile(m_compiled, fullgraph=True)(xs[1], zs[1]).backward(dy)
    for a, b in ((xs[1].grad, xs[0].grad), (zs[1].grad, zs[0].grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in (
        (m_compiled.weight.grad, m_eager.weight.grad),
        (m_compiled.bias.grad, m_eager.bias.grad),
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m_compiled.running_var, m_eager.running_var)

    def fn(x, z):  # the fused custom op itself under compile
        return cnt.batch_norm_act(x, None, None, m.weight, m.bias, True, residual=z)

    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x, z), fn(x, z))
    torch._dynamo.reset()
    m.eval()
    ref = m(x, z)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m(x, z)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = m(x, z)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_fuse_resnet50_as_accurate_as_torch():
    """fuse() on torchvision's resnet50 (the GPU machine has torchvision): 49 fusions, the same
    state_dict keys; in fp32 without TF32, the output, the input gradient and every parameter's
    gradient are as close to a float64 run of torch's model as torch's own fp32 run is (resnet50
    gradients at initialisation amplify rounding: fp32 against float64 differ by percents, so
    the two fp32 runs are compared through their errors, not with each other)."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    ref = tv.models.resnet50().cuda()
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(ref), report=report)
    assert len(report) == 49 and sum("+ add" in r for r in report) == 16
    assert list(model.state_dict()) == list(ref.state_dict())
    ref64 = copy.deepcopy(ref).double()
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        x = torch.randn(4, 3, 64, 64, device="cuda", dtype=torch.float64)
        x = x.to(memory_format=torch.channels_last)
        runs = []
        for m in (model, ref, ref64):
            inp = x.to(next(m.parameters()).dtype).requires_grad_()
            out = m(inp)
            out.square().mean().backward()
            grads = {n: p.grad for n, p in m.named_parameters()}
            runs.append({"output": out.detach(), "input grad": inp.grad, **grads})
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    fused, torch32, torch64 = runs

    def err(run, names):
        diff = max((run[n].double() - torch64[n]).abs().max().item() for n in names)
        return diff / max(torch64[n].abs().max().item() for n in names)

    # the output, the input gradient, and all parameter gradients as one vector (a single
    # tensor's worst element fluctuates by 3x between two fp32 runs of this model)
    params = [n for n in torch64 if n not in ("output", "input grad")]
    for what, names in (("output", ["output"]), ("input grad", ["input grad"]), ("params", params)):
        ours, theirs = err(fused, names), err(torch32, names)
        assert ours <= 2 * theirs + 1e-5, f"{what}: {ours:.2e} against torch's {theirs:.2e}"
