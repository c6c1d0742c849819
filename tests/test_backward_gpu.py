"""Backward kernels (cupynorm._ops.*_bwd) against torch autograd in float64, and the fused
row-norm epilogue against its unfused torch composition. Gradients are bitwise reproducible."""

from __future__ import annotations

import pytest
from conftest import cuda_available, poison_torch_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

if cuda_available():
    import torch
    import torch.nn.functional as F

    from cupynorm import _ops

    DTYPES = {
        "float32": torch.float32,
        "float64": torch.float64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }

TOL = {"float32": 1e-4, "float64": 1e-9, "float16": 1e-2, "bfloat16": 6e-2}


def make(shape, dtype, memory_format="contiguous", offset=0.0):
    x = (torch.randn(shape, device="cuda", dtype=torch.float64) + offset).to(DTYPES[dtype])
    if memory_format == "channels_last":
        x = x.to(memory_format=torch.channels_last if x.ndim == 4 else torch.channels_last_3d)
    return x


def reference_grads(fn, x, w, b, dy):
    """Gradients of sum(fn(x, w, b) * dy) in float64."""
    xd = x.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_() if w is not None else None
    bd = b.detach().double().requires_grad_() if b is not None else None
    out = fn(xd, wd, bd)
    out.backward(dy.double())
    return xd.grad, None if wd is None else wd.grad, None if bd is None else bd.grad


def close(ours, ref, dtype, what):
    assert ours is not None, what
    assert not torch.isnan(ours).any(), f"NaN in {what}"
    scale = ref.abs().max().item() + 1e-30
    err = (ours.double() - ref).abs().max().item() / scale
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e}"


GN_CASES = [
    ((3, 6, 5, 7), 3, "contiguous"),
    ((2, 6, 13, 17), 6, "contiguous"),  # instance norm
    ((4, 3, 1, 1), 1, "contiguous"),
    ((3, 6, 7), 2, "contiguous"),
    ((2, 6, 3, 5, 7), 3, "contiguous"),
    ((3, 6, 5, 7), 3, "channels_last"),
    ((2, 32, 9, 10), 8, "channels_last"),
    ((2, 4, 256, 256), 4, "contiguous"),
    # Cg > 1: planes that are not whole packs (tiles and packs straddling channels), odd planes,
    # and the diffusion shape
    ((2, 16, 64, 64), 2, "contiguous"),
    ((2, 12, 75, 77), 3, "contiguous"),
    ((2, 9, 31, 1), 3, "contiguous"),
    ((4, 320, 16, 16), 32, "contiguous"),
    # columns passes with several CTAs per sample and a partial last block of rows
    ((2, 64, 67, 61), 8, "channels_last"),
    # few rows of many channels: channel tiles over the grid, groups straddling tiles
    ((2, 1026, 5, 3), 6, "channels_last"),
    # one group of all the channels (timm's GroupNorm1, PoolFormer's stages): the timm sweep of
    # 11-27 found poolformer(v2)_s12's gradients wrong in fp32 channels_last (benchmarks/NOTES.md)
    ((4, 64, 56, 56), 1, "channels_last"),
    ((4, 320, 14, 14), 1, "channels_last"),
    ((4, 512, 7, 7), 1, "channels_last"),
]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "shape,groups,memory_format",
    GN_CASES,
    ids=[f"{'x'.join(map(str, s))}-G{g}-{m}" for s, g, m in GN_CASES],
)
def test_group_norm_backward(dtype, shape, groups, memory_format):
    C = shape[1]
    x = make(shape, dtype, memory_format, offset=2.0)
    w = (torch.rand(C, device="cuda", dtype=torch.float64) + 0.5).to(DTYPES[dtype])
    b = torch.randn(C, device="cuda", dtype=torch.float64).to(DTYPES[dtype])
    dy = make(shape, dtype, memory_format)
    _, mean, rstd = _ops.group_norm_fwd(x, groups, w, b, 1e-5)
    poison_torch_allocator()
    dx, dw, db = _ops.group_norm_bwd(dy, x, mean, rstd, w, groups, (True, True, True))
    rx, rw, rb = reference_grads(lambda a, p, q: F.group_norm(a, groups, p, q, 1e-5), x, w, b, dy)
    close(dx, rx, dtype, "dx")
    close(dw, rw, dtype, "dweight")
    close(db, rb, dtype, "dbias")
    assert dx.shape == x.shape and dw.dtype == w.dtype
    if memory_format == "channels_last":
        assert dx.stride() == x.stride()


def test_group_norm_backward_without_affine_and_partial_needs():
    x, dy = make((3, 6, 9, 11), "float32"), make((3, 6, 9, 11), "float32")
    _, mean, rstd = _ops.group_norm_fwd(x, 2, None, None, 1e-5)
    dx, dw, db = _ops.group_norm_bwd(dy, x, mean, rstd, None, 2, (True, False, True))
    rx, _, _ = reference_grads(
        lambda a, p, q: F.group_norm(a, 2, None, None, 1e-5), x, None, None, dy
    )
    close(dx, rx, "float32", "dx")
    assert dw is None
    torch.testing.assert_close(db.double(), dy.double().sum((0, 2, 3)), atol=1e-4, rtol=1e-5)


BN_CASES = [
    ((4, 6, 5, 7), "contiguous"),
    ((4, 6, 5, 7), "channels_last"),
    ((3, 64, 41, 37), "channels_last"),  # several CTAs over the rows, a partial last block
    ((16, 5), "contiguous"),  # BatchNorm1d on (N, C)
    ((3, 6, 7), "contiguous"),
    ((2, 6, 3, 5, 7), "channels_last"),
    ((8, 16, 64, 64), "contiguous"),
    # few rows of many channels (resnet50's last stage): channel tiles over the grid
    ((4, 2048, 7, 7), "channels_last"),
    ((3, 1031, 5, 3), "channels_last"),
]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "shape,memory_format", BN_CASES, ids=[f"{'x'.join(map(str, s))}-{m}" for s, m in BN_CASES]
)
def test_batch_norm_backward(training, dtype, shape, memory_format):
    C = shape[1]
    x = make(shape, dtype, memory_format, offset=-1.0)
    w = (torch.rand(C, device="cuda", dtype=torch.float64) + 0.5).to(DTYPES[dtype])
    b = torch.randn(C, device="cuda", dtype=torch.float64).to(DTYPES[dtype])
    dy = make(shape, dtype, memory_format)
    rm = torch.randn(C, device="cuda")
    rv = torch.rand(C, device="cuda") + 0.5
    _, save_mean, save_rstd = _ops.batch_norm_fwd(
        x, w, b, rm.clone(), rv.clone(), training, 0.1, 1e-5
    )
    dx, dw, db = _ops.batch_norm_bwd(dy, x, save_mean, save_rstd, w, training, (True, True, True))

    def fn(a, p, q):
        return F.batch_norm(a, rm.double().clone(), rv.double().clone(), p, q, training, 0.1, 1e-5)

    rx, rw, rb = reference_grads(fn, x, w, b, dy)
    close(dx, rx, dtype, "dx")
    close(dw, rw, dtype, "dweight")
    close(db, rb, dtype, "dbias")


def test_backward_bitwise_reproducible():
    x, dy = make((8, 32, 33, 35), "float32"), make((8, 32, 33, 35), "float32")
    w = torch.rand(32, device="cuda") + 0.5
    _, mean, rstd = _ops.group_norm_fwd(x, 8, w, None, 1e-5)
    first = _ops.group_norm_bwd(dy, x, mean, rstd, w, 8, (True, True, True))
    _, bm, br = _ops.batch_norm_fwd(x, w, None, None, None, True, 0.1, 1e-5)
    first_bn = _ops.batch_norm_bwd(dy, x, bm, br, w, True, (True, True, True))
    for _ in range(5):
        again = _ops.group_norm_bwd(dy, x, mean, rstd, w, 8, (True, True, True))
        again_bn = _ops.batch_norm_bwd(dy, x, bm, br, w, True, (True, True, True))
        for a, b in zip(first + first_bn, again + again_bn, strict=False):
            assert torch.equal(a, b)


# ---- the seed-002 tail ---------------------------------------------------------------------
def unfused(x, y, eps=1e-5):
    """The seed model's tail for 2-d x (instance norm over each row's features), any rank."""
    if x.dim() == 2:
        xhat = F.instance_norm(x.unsqueeze(1).unsqueeze(1), eps=eps).squeeze(1).squeeze(1)
    else:
        xhat = F.layer_norm(x, x.shape[-1:], eps=eps)
    return (xhat + y) * y


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "shape",
    [(1024, 8192), (7, 13), (3, 5, 40), (6, 20000), (4, 1 << 20)],
    ids=["seed", "odd", "3d", "wide-row", "long-row"],
)
def test_row_norm_add_mul(dtype, shape):
    x = torch.rand(shape, device="cuda", dtype=torch.float64).to(DTYPES[dtype])
    y = torch.rand(shape, device="cuda", dtype=torch.float64).to(DTYPES[dtype])
    poison_torch_allocator()
    out, mean, rstd = _ops.row_norm_add_mul_fwd(x, y, 1e-5)
    ref = unfused(x.double(), y.double())
    close(out, ref, dtype, "out")
    dout = torch.randn(shape, device="cuda", dtype=torch.float64).to(DTYPES[dtype])
    dx, dyy = _ops.row_norm_add_mul_bwd(dout, x, y, mean, rstd)
    xd, yd = x.double().requires_grad_(), y.double().requires_grad_()
    unfused(xd, yd).backward(dout.double())
    close(dx, xd.grad, dtype, "dx")
    close(dyy, yd.grad, dtype, "dy")
