"""LayerNorm / RMSNorm and the fused residual-add forms on the GPU: forward and backward against a
float64 reference on fresh random data (never zeros; the allocator poisoned with NaN first), every
dtype, one-element / odd / unaligned / team-sized / longer-than-a-team rows, zero rows, offset
data, float32 weights beside half-precision input, CuPy inputs, bitwise-reproducible gradients,
torch.compile and CUDA-graph capture.
"""

from __future__ import annotations

import math

import pytest
from conftest import cuda_available, poison_cupy_pool, poison_torch_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

if cuda_available():
    import torch
    import torch.nn.functional as F

    import cupynorm
    import cupynorm.torch as cnt

    DTYPES = {
        "float32": torch.float32,
        "float64": torch.float64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }

# outputs of unit scale: a few roundings of the dtype, plus fp32 statistics over long rows
TOL = {"float32": 3e-5, "float64": 1e-10, "float16": 4e-3, "bfloat16": 3e-2}
GRAD_TOL = {"float32": 1e-4, "float64": 1e-9, "float16": 1e-2, "bfloat16": 6e-2}

# (rows, row length): the strategy each exercises
ROWS = {
    "one_element": (5, 1),
    "odd": (7, 3),
    "short": (33, 100),
    # whole packs of at most 128: a group of lanes of a warp per row (row_norm.cu); more rows than
    # the backward's resident groups (each walks several) and a last CTA with idle groups
    "short_packs": (20001, 96),
    "one_pack": (67, 8),
    "short_wide": (300, 1024),
    "unaligned_len": (9, 1001),
    "llama": (6, 4096),
    # rows held in registers (row_norm.cu), more rows than resident CTAs: each CTA walks several
    # rows; 97 / 194 packs leave a partial warp, 513 packs four packs per thread of 160
    "many_rows": (5000, 776),
    "many_rows_wide": (2000, 4104),
    "one_cta": (3, 8192 + 8),
    "team": (2, 300_000),  # 1.2 MB of fp32: a team of CTAs
    "team_odd": (2, 300_001),
}


def rand(shape, dtype, offset=0.0, scale=1.0):
    x = torch.randn(shape, device="cuda", dtype=torch.float64) * scale + offset
    return x.to(DTYPES[dtype])


def params(D, dtype, rms, affine=True, fp32_params=False):
    if not affine:
        return None, None
    pdtype = "float32" if fp32_params else dtype
    w = (torch.rand(D, device="cuda", dtype=torch.float64) + 0.5).to(DTYPES[pdtype])
    b = None if rms else rand((D,), pdtype)
    return w, b


def reference(x, residual, w, b, rms, eps):
    """(out, sum) in float64 from the input's values (the sum rounded to the input's dtype, as
    the kernels and torch round it)."""
    total = x if residual is None else x + residual
    t, wd, bd = total.double(), None if w is None else w.double(), None if b is None else b.double()
    D = w.numel() if w is not None else x.shape[-1]
    if rms:
        out = F.rms_norm(t, (D,), wd, eps)
    else:
        out = F.layer_norm(t, (D,), wd, bd, eps)
    return out, (None if residual is None else total)


def run(x, residual, w, b, rms, eps):
    D = x.shape[-1]
    if residual is None:
        if rms:
            return cnt.rms_norm(x, (D,), w, eps), None
        return cnt.layer_norm(x, (D,), w, b, eps), None
    if rms:
        return cnt.add_rms_norm(x, residual, (D,), w, eps)
    return cnt.add_layer_norm(x, residual, (D,), w, b, eps)


def close(out, ref, tol):
    assert out.dtype in DTYPES.values() and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in output: an element was not written"
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# ---- forward ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows_id", list(ROWS))
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "add"])
def test_forward_matches_float64(dtype, rows_id, rms, residual):
    shape = ROWS[rows_id]
    x = rand(shape, dtype)
    r = rand(shape, dtype) if residual else None
    w, b = params(shape[1], dtype, rms)
    poison_torch_allocator()
    out, total = run(x, r, w, b, rms, 1e-5)
    ref, ref_total = reference(x, r, w, b, rms, 1e-5)
    close(out, ref, TOL[dtype] * 3)  # weight up to 1.5, bias ~1
    if residual:
        assert torch.equal(total, x + r)  # the sum in the input's dtype, as torch adds


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_float32_parameters_beside_half_input(dtype, rms):
    x = rand((17, 768), dtype)
    w, b = params(768, dtype, rms, fp32_params=True)
    poison_torch_allocator()
    out, _ = run(x, None, w, b, rms, 1e-5)
    assert out.dtype == DTYPES[dtype]
    close(out, reference(x, None, w, b, rms, 1e-5)[0], TOL[dtype] * 3)
    # torch's CUDA layer_norm refuses float32 parameters beside a half input: its float32 result
    torch_out = F.rms_norm(x, (768,), w) if rms else F.layer_norm(x.float(), (768,), w, b)
    torch.testing.assert_close(out, torch_out.to(out.dtype), atol=TOL[dtype] * 3, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("D", [96, 1000, 4096, 300_000])
def test_offset_data_keeps_its_digits(dtype, D):
    """Mean 1e4, std 1: the variance must not come from E[x^2] - E[x]^2."""
    x = rand((4, D), dtype, offset=1e4)
    poison_torch_allocator()
    out = cnt.layer_norm(x, D)
    close(out, F.layer_norm(x.double(), (D,)), 1e-3 if dtype == "float32" else 1e-9)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_rows_longer_than_a_team(rms):
    """KernelBench level-1 problem 40's row length (64 x 256 x 256 = 4M values), smaller batch."""
    x = rand((3, 64, 256, 256), "float32", offset=0.5)
    dims = (64, 256, 256)
    w, b = params(math.prod(dims), "float32", rms)
    w = w.reshape(dims)
    b = None if b is None else b.reshape(dims)
    poison_torch_allocator(256 << 20)
    if rms:
        out, ref = cnt.rms_norm(x, dims, w), F.rms_norm(x.double(), dims, w.double())
    else:
        out, ref = (
            cnt.layer_norm(x, dims, w, b),
            F.layer_norm(x.double(), dims, w.double(), b.double()),
        )
    close(out, ref, 1e-4)


def test_misaligned_and_strided_inputs():
    base = rand((8 * 64 + 1,), "bfloat16")
    x = base[1:].view(8, 64)  # contiguous, not 16-byte aligned: the scalar path
    w, b = params(64, "bfloat16", False)
    poison_torch_allocator()
    close(cnt.layer_norm(x, 64, w, b), reference(x, None, w, b, False, 1e-5)[0], 0.1)
    xt = rand((64, 8), "float32").t()  # rows of 64 with stride 8: copied first
    close(cnt.rms_norm(xt, 64), F.rms_norm(xt.double(), (64,)), TOL["float32"])


def test_zero_rows():
    for rms in (False, True):
        x = rand((0, 7), "float32").requires_grad_()
        w = torch.ones(7, device="cuda", requires_grad=True)
        out, _ = run(x, None, w, None, rms, 1e-5)
        assert out.shape == (0, 7)
        out.sum().backward()
        assert torch.equal(w.grad, torch.zeros(7, device="cuda"))


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_cupy_arrays(rms):
    import cupy

    x = cupy.random.standard_normal((13, 257), dtype=cupy.float32)
    r = cupy.random.standard_normal((13, 257), dtype=cupy.float32)
    w = cupy.random.uniform(0.5, 1.5, 257, dtype=cupy.float32)
    poison_cupy_pool()
    if rms:
        out, total = cupynorm.add_rms_norm(x, r, 257, w, 1e-6)
        single = cupynorm.rms_norm(x, 257, w, 1e-6)
    else:
        out, total = cupynorm.add_layer_norm(x, r, 257, w, None)
        single = cupynorm.layer_norm(x, 257, w)
    assert isinstance(out, cupy.ndarray) and isinstance(total, cupy.ndarray)
    tx, tr, tw = (torch.from_dlpack(a).double() for a in (x, r, w))
    expected = reference(tx, tr, tw, None, rms, 1e-6 if rms else 1e-5)[0]
    close(torch.from_dlpack(out), expected, 1e-4)
    close(
        torch.from_dlpack(single),
        reference(tx, None, tw, None, rms, 1e-6 if rms else 1e-5)[0],
        1e-4,
    )


# ---- backward --------------------------------------------------------------------------------
def _grads_of(fn, inputs, douts):
    outs = fn(*inputs)
    leaves = [t for t in inputs if t is not None]
    loss = sum((o.double() * d).sum() for o, d in zip(outs, douts, strict=True) if o is not None)
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "rows_id",
    [
        "one_element",
        "odd",
        "short_packs",
        "one_pack",
        "unaligned_len",
        "llama",
        "many_rows",
        "many_rows_wide",
        "team_odd",
    ],
)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "add"])
def test_backward_matches_float64(dtype, rows_id, rms, residual):
    rows, D = ROWS[rows_id]
    x = rand((rows, D), dtype).requires_grad_()
    r = rand((rows, D), dtype).requires_grad_() if residual else None
    w, b = params(D, dtype, rms)
    w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    dy = torch.randn(rows, D, device="cuda", dtype=torch.float64)
    dsum = torch.randn(rows, D, device="cuda", dtype=torch.float64) if residual else None
    douts = (dy, dsum)

    def ours(x, r, w, b):
        return run(x, r, w, b, rms, 1e-5)

    poison_torch_allocator()
    got = _grads_of(ours, (x, r, w, b), douts)
    # reference: float64 autograd through the norm of the (rounded) sum
    # the sum rounded in the dtype, as the kernels add; its gradient is that of x and of r
    total = (x + r if residual else x).detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_()
    bd = None if b is None else b.detach().double().requires_grad_()
    out = F.rms_norm(total, (D,), wd, 1e-5) if rms else F.layer_norm(total, (D,), wd, bd, 1e-5)
    loss = (out * dy).sum() + ((total * dsum).sum() if residual else 0)
    leaves = [total, wd] + ([bd] if bd is not None else [])
    expected = torch.autograd.grad(loss, leaves)
    dx_ref, dparams_ref = expected[0], expected[1:]
    tol = GRAD_TOL[dtype] * (1e3 if D == 1 else 1)  # one-element rows: noise times 1/sqrt(eps)
    grads = list(got)
    dx = grads.pop(0)
    close(dx, dx_ref, tol)
    if residual:
        assert torch.equal(grads.pop(0), dx)  # the residual gets the same gradient
    for g_ours, g_ref in zip(grads, dparams_ref, strict=True):
        close(g_ours, g_ref, tol * math.sqrt(rows))


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("D", [96, 1024])  # a group of lanes per row; a CTA per row
def test_gradients_are_bitwise_reproducible(rms, D):
    x = rand((4097, D), "bfloat16").requires_grad_()
    w, b = params(D, "bfloat16", rms)
    w.requires_grad_()
    dy = torch.randn_like(x)
    runs = []
    for _ in range(2):
        out, _ = run(x, None, w, b, rms, 1e-5)
        runs.append(torch.autograd.grad(out, (x, w), dy))
    for a, c in zip(*runs, strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize(
    "dtype, fp32_params", [("float32", False), ("bfloat16", False), ("bfloat16", True)]
)
@pytest.mark.parametrize("D", [1 << 21, (1 << 21) + 3], ids=["packs", "odd"])
def test_long_rows_forward_and_backward(rms, dtype, fp32_params, D):
    """Rows longer than a team (the strided statistics, then tile passes walked tile-major over
    the rows): output and every gradient against float64, whole packs and not."""
    x = rand((3, D), dtype).requires_grad_()
    w, b = (
        None if t is None else t.requires_grad_() for t in params(D, dtype, rms, True, fp32_params)
    )
    dy = torch.randn_like(x)
    poison_torch_allocator(256 << 20)
    out, _ = run(x, None, w, b, rms, 1e-5)
    inputs = tuple(t for t in (x, w, b) if t is not None)
    grads = torch.autograd.grad(out, inputs, dy)
    doubles = tuple(t.detach().double().requires_grad_() for t in inputs)
    ref = (
        F.rms_norm(doubles[0], (D,), doubles[1])
        if rms
        else F.layer_norm(doubles[0], (D,), *doubles[1:])
    )
    close(out, ref.detach(), TOL[dtype] * 3)
    for g, r, t in zip(grads, torch.autograd.grad(ref, doubles, dy.double()), inputs, strict=True):
        # the parameters' gradients sum 3 rows
        close(g, r, GRAD_TOL[dtype] * (1 if t is x else 3))


# ---- autocast: the float32 norm of a half-precision input, read as is ----------------------------
def _max_err(t, ref):
    return (t.double() - ref).abs().max().item() if t.numel() else 0.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "rows_id",
    # short rows (one pass, float32 y beside half x); rows of 3, 1001 (not whole packs), 4104 and
    # 8200 values (not short) take the float32 path on a copy
    ["odd", "short_packs", "one_pack", "short_wide", "unaligned_len", "many_rows_wide", "one_cta"],
)
@pytest.mark.parametrize("fp32_params", [True, False], ids=["fp32_params", "half_params"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_autocast_matches_torch_and_float64(dtype, rows_id, fp32_params, rms):
    """Under autocast layer_norm (and rms_norm) is torch's float32 norm of the half input: y
    float32, dx in the input's dtype, parameter gradients in theirs; errors against float64 no
    larger than torch's own (a few roundings: 3x its maximum, a floor of one rounding of the
    dtype for dx); the full path and the replay bit for bit equal. (rms_norm: whatever the
    installed torch's autocast makes of it, cupynorm's dtypes are torch's.)"""
    rows, D = ROWS[rows_id]
    x = rand((rows, D), dtype, offset=0.5).requires_grad_()
    w, b = (t.requires_grad_() for t in params(D, dtype, False, fp32_params=fp32_params))
    leaves = (x, w) if rms else (x, w, b)
    dy = torch.randn(rows, D, device="cuda")
    poison_torch_allocator()

    def call(fn, x, w, b):
        return fn(x, (D,), w, 1e-5) if rms else fn(x, (D,), w, b, 1e-5)

    runs = {}
    ours_fn, torch_fn = (cnt.rms_norm, F.rms_norm) if rms else (cnt.layer_norm, F.layer_norm)
    for name, fn in (("ours", ours_fn), ("torch", torch_fn)):
        runs[name] = []
        for _ in range(2):  # the full path, then the replay
            with torch.autocast("cuda", dtype=DTYPES[dtype]):
                y = call(fn, x, w, b)
            runs[name].append((y, *torch.autograd.grad(y, leaves, dy)))
    ours, theirs = runs["ours"], runs["torch"]
    for a, c in zip(ours[0], ours[1], strict=True):
        assert torch.equal(a, c)
    for a, c in zip(ours[0], theirs[0], strict=True):
        assert a.dtype == c.dtype and a.shape == c.shape
        assert not torch.isnan(a).any()
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = call(F.rms_norm if rms else F.layer_norm, xd, wd, bd)
    refs = (ref.detach(), *torch.autograd.grad(ref, (xd, wd) if rms else (xd, wd, bd), dy.double()))
    floors = (1e-6, GRAD_TOL[dtype], 1e-6 * rows, 1e-6 * rows)
    names = ("y", "dx", "dw", "db")
    for what, a, c, r, floor in zip(names, ours[0], theirs[0], refs, floors, strict=False):
        assert _max_err(a, r) <= 3 * _max_err(c, r) + floor, what


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows_id", ["short_packs", "short_wide", "odd", "many_rows_wide"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_float32_output_op_matches_float64(dtype, rows_id, rms):
    """The host op with float32 y / dy beside the half input (what the torch layer runs under
    autocast; RMSNorm's only with a torch whose autocast runs rms_norm in float32, so asked of
    the op here): y and the parameter gradients within float32 rounding of float64, dx within
    one rounding of x's dtype."""
    from cupynorm import _ops

    rows, D = ROWS[rows_id]
    x = rand((rows, D), dtype, offset=0.5)
    w, b = params(D, dtype, rms, fp32_params=True)
    dy = torch.randn(rows, D, device="cuda")
    poison_torch_allocator()
    y, _, mean, rstd = _ops.row_norm_fwd(x, None, w, b, D, 1e-5, rms, out_dtype="float32")
    needs = (True, True, not rms)
    dx, dw, db = _ops.row_norm_bwd(dy, None, x, mean, rstd, w, D, needs)
    assert y.dtype == dw.dtype == torch.float32 and dx.dtype == x.dtype
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    bd = None if rms else b.double().requires_grad_()
    ref = F.rms_norm(xd, (D,), wd, 1e-5) if rms else F.layer_norm(xd, (D,), wd, bd, 1e-5)
    leaves = (xd, wd) if rms else (xd, wd, bd)
    refs = (ref.detach(), *torch.autograd.grad(ref, leaves, dy.double()))
    ours = (y, dx, dw) if rms else (y, dx, dw, db)
    tols = (1e-5, GRAD_TOL[dtype], 1e-5, 1e-5)
    for what, a, r, tol in zip(("y", "dx", "dw", "db"), ours, refs, tols, strict=False):
        assert not torch.isnan(a).any(), what
        err = (a.double() - r).abs().max().item() / (r.abs().max().item() + 1e-30)
        assert err <= tol, f"{what}: {err:.2e} > {tol:.0e}"


def test_autocast_keeps_misaligned_zero_size_and_float64_inputs():
    """Under autocast: an input not 16-byte aligned (the float32 path on a copy), zero rows, and
    float64 input (autocast leaves it float64) give torch's dtypes and values."""
    base = rand((8 * 64 + 1,), "bfloat16")
    cases = [base[1:].view(8, 64), rand((0, 96), "bfloat16"), rand((5, 96), "float64")]
    for x in cases:
        D = x.shape[-1]
        w = torch.rand(D, device="cuda", dtype=torch.promote_types(x.dtype, torch.float32)) + 0.5
        x = x.requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, y_ref = cnt.layer_norm(x, (D,), w), F.layer_norm(x, (D,), w)
        assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        dy = torch.randn_like(y)
        (dx,), (dx_ref,) = torch.autograd.grad(y, (x,), dy), torch.autograd.grad(y_ref, (x,), dy)
        assert dx.dtype == dx_ref.dtype
        torch.testing.assert_close(dx, dx_ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fn", ["layer_norm", "layer_norm2d_cl", "layer_norm2d_nchw"])
def test_autocast_accepts_mixed_parameter_dtypes_as_torch_does(fn):
    """Torch's autocast runs layer_norm on float32 copies: a float32 weight beside a bfloat16
    bias is accepted there; cupynorm computes the same (and, without autocast, does what the
    installed torch does)."""
    x = rand((4, 24, 5, 7), "bfloat16")
    C = 24 if fn.startswith("layer_norm2d") else 7
    w = torch.rand(C, device="cuda") + 0.5
    b = torch.randn(C, device="cuda").bfloat16()
    if fn == "layer_norm2d_cl":
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    leaves = (x, w.requires_grad_(), b.requires_grad_())

    def ours():
        return cnt.layer_norm(x, (C,), w, b) if fn == "layer_norm" else cnt.layer_norm2d(x, w, b)

    def theirs():
        if fn == "layer_norm":
            return F.layer_norm(x, (C,), w, b)
        return F.layer_norm(x.movedim(1, -1), (C,), w, b).movedim(-1, 1)

    try:  # without autocast: whatever the installed torch does with these dtypes
        expected = theirs()
    except RuntimeError as error:
        with pytest.raises(type(error)):
            ours()
    else:
        torch.testing.assert_close(ours(), expected, atol=3e-2, rtol=3e-2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, y_ref = ours(), theirs()
    assert y.dtype == y_ref.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(y)
    got, want = torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy)
    for u, v in zip(got, want, strict=True):
        assert u.dtype == v.dtype
        torch.testing.assert_close(u, v, atol=3e-2, rtol=3e-2)


# ---- modules, compile, graphs ------------------------------------------------------------------
@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
def test_module_compile_fullgraph_and_cuda_graph(cls):
    torch._dynamo.reset()
    ours = getattr(cnt, cls)(768, device="cuda")
    theirs = getattr(torch.nn, cls)(768, device="cuda")
    theirs.load_state_dict(ours.state_dict())
    x = rand((8, 33, 768), "float32").requires_grad_()
    compiled = torch.compile(ours, fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, theirs(x), atol=1e-5, rtol=1e-5)
    (gx,) = torch.autograd.grad(out.sum(), (x,))
    (rx,) = torch.autograd.grad(theirs(x).sum(), (x,))
    torch.testing.assert_close(gx, rx, atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()

    static = rand((8, 33, 768), "float32")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        ours(static)  # warm up (compile, record) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        captured = ours(static)
    static.copy_(rand((8, 33, 768), "float32"))
    graph.replay()
    with torch.no_grad():
        torch.testing.assert_close(captured, theirs(static), atol=1e-5, rtol=1e-5)


def test_replace_norms_in_a_transformer_layer_trains_like_torch():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).cuda()
    ours = cnt.replace_norms(
        torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).cuda(),
        include=[torch.nn.LayerNorm],
    )
    ours.load_state_dict(layer.state_dict())
    assert isinstance(ours.norm1, cnt.LayerNorm)
    x = rand((3, 17, 64), "float32")
    out, ref = ours(x), layer(x)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(ours.named_parameters(), layer.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-3, rtol=1e-3, msg=name)
