"""LayerNorm / RMSNorm over the channels of (N, C, *) on the GPU (layer_norm2d, rms_norm2d, the
LayerNorm2d / RMSNorm2d modules): forward and backward against torch (the permute + layer_norm of
timm's LayerNorm2d) and a float64 reference on fresh random data (the allocator poisoned with NaN
first), both layouts, every dtype, odd / unaligned / many-channel shapes, offset data, float32
weights beside half input, CuPy inputs, reproducible gradients, torch.compile and CUDA graphs;
each NCHW forward kernel (thin tiles: 4 / 8 packs, single elements; register tiles) on its
own.
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
    LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}

TOL = {"float32": 3e-5, "float64": 1e-10, "float16": 4e-3, "bfloat16": 3e-2}
GRAD_TOL = {"float32": 1e-4, "float64": 1e-9, "float16": 1e-2, "bfloat16": 6e-2}

# (N, C, H, W): what each exercises
SHAPES = {
    "one_channel": (3, 1, 5, 7),
    "odd": (2, 3, 7, 9),  # S = 63: no 16-byte packs
    "convnext": (2, 96, 14, 14),  # S = 196: packs of 4 fp32 / 2 fp64, not of 8 half
    # channels_last: more rows of 96 than the backward's resident groups, a partial last CTA
    "convnext_rows": (9, 96, 47, 53),
    "kernelbench": (2, 64, 32, 32),
    "many_channels": (2, 600, 5, 8),  # 75 thread rows of 8 channels in the backward
    "one_pixel": (5, 40, 1, 1),  # the row route for both layouts
    "huge_c": (2, 4100, 3, 3),  # more channels than one CTA holds: the channels-last route
}


def rand(shape, dtype, fmt=None, offset=0.0):
    x = torch.randn(shape, device="cuda", dtype=torch.float64) + offset
    x = x.to(DTYPES[dtype])
    return x if fmt is None else x.contiguous(memory_format=fmt)


def params(C, dtype, rms, fp32_params=False):
    pdtype = "float32" if fp32_params else dtype
    w = (torch.rand(C, device="cuda", dtype=torch.float64) + 0.5).to(DTYPES[pdtype])
    b = None if rms else rand((C,), pdtype)
    return w, b


def reference(x, w, b, rms, eps):
    """float64, as timm's LayerNorm2d computes: the norm of the channels-last view."""
    rows = x.double().permute(0, *range(2, x.dim()), 1)
    C = x.shape[1]
    wd, bd = (None if t is None else t.double() for t in (w, b))
    out = F.rms_norm(rows, (C,), wd, eps) if rms else F.layer_norm(rows, (C,), wd, bd, eps)
    return out.permute(0, x.dim() - 1, *range(1, x.dim() - 1))


def run(x, w, b, rms, eps):
    return cnt.rms_norm2d(x, w, eps) if rms else cnt.layer_norm2d(x, w, b, eps)


def close(out, ref, tol):
    assert out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in output: an element was not written"
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def close_or_like_torch(out, theirs, ref, tol):
    """Within ``tol`` of the float64 ``ref``, or no farther from it than twice torch's own
    result ``theirs`` (ill-conditioned cases: a few channels of nearly equal values, where the
    half-precision rounding of dy alone moves dx by more than ``tol``)."""
    try:
        close(out, ref, tol)
    except AssertionError:
        ours_err = (out.double() - ref).abs().max().item()
        theirs_err = (theirs.double() - ref).abs().max().item()
        assert ours_err <= 2 * theirs_err, f"error {ours_err} > 2 x torch's {theirs_err}"


# ---- forward ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape_id", list(SHAPES))
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_forward_matches_float64_and_torch(dtype, shape_id, layout, rms):
    x = rand(SHAPES[shape_id], dtype, LAYOUTS[layout])
    w, b = params(x.shape[1], dtype, rms)
    poison_torch_allocator()
    out = run(x, w, b, rms, 1e-5)
    assert out.dtype == x.dtype
    assert out.is_contiguous(memory_format=LAYOUTS[layout])
    close(out, reference(x, w, b, rms, 1e-5), TOL[dtype] * 3)
    # torch itself (timm's LayerNorm2d: permute, layer_norm, permute back)
    rows = x.permute(0, 2, 3, 1)
    theirs = (
        F.rms_norm(rows, (x.shape[1],), w, 1e-5)
        if rms
        else F.layer_norm(rows, (x.shape[1],), w, b, 1e-5)
    )
    torch.testing.assert_close(out, theirs.permute(0, 3, 1, 2), atol=TOL[dtype] * 6, rtol=0)


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_stats_are_saved_per_pixel(rms):
    from cupynorm import _ops

    x = rand((3, 24, 5, 6), "float32")
    y, mean, rstd = _ops.channel_norm_fwd(x, None, None, 1e-5, rms)
    assert rstd.shape == (3, 5, 6) and rstd.dtype == torch.float32
    xd = x.double()
    ms = xd.square().mean(dim=1)
    if rms:
        torch.testing.assert_close(rstd.double(), torch.rsqrt(ms + 1e-5), rtol=1e-5, atol=0)
        assert mean is None
    else:
        var, mu = torch.var_mean(xd, dim=1, correction=0)
        torch.testing.assert_close(mean.double(), mu, rtol=0, atol=1e-6)
        torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_parameters_beside_half_input(layout, dtype):
    x = rand((2, 48, 9, 16), dtype, LAYOUTS[layout])
    w, b = params(48, dtype, False, fp32_params=True)
    poison_torch_allocator()
    out = cnt.layer_norm2d(x, w, b)
    assert out.dtype == x.dtype
    close(out, reference(x, w, b, False, 1e-5), TOL[dtype] * 3)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_offset_data_keeps_its_digits(layout, dtype):
    """Mean 1e4, std 1 per pixel: the variance is a two-pass over registers, not E[x^2]-E[x]^2."""
    _assert_offset_error_within_torchs(rand((2, 64, 16, 16), dtype, LAYOUTS[layout], offset=1e4))


def _assert_offset_error_within_torchs(x):
    """layer_norm2d of x (offset 1e4) no further from float64 than torch's own layer norm on the
    same data (fp32 holds x itself to ~1e-3 here), give or take a few float64 ulps of the
    offset."""
    poison_torch_allocator()
    ref = reference(x, None, None, False, 1e-5)
    ours = (cnt.layer_norm2d(x).double() - ref).abs().max().item()
    theirs = F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), eps=1e-5).permute(0, 3, 1, 2)
    slack = 16 * 1e4 * torch.finfo(torch.float64).eps
    assert ours <= 1.5 * (theirs.double() - ref).abs().max().item() + slack


def test_misaligned_strided_and_3d_inputs():
    base = rand((2 * 16 * 64 + 1,), "float32")
    x = base[1:].view(2, 16, 8, 8)  # contiguous, not 16-byte aligned: the scalar path
    poison_torch_allocator()
    close(cnt.rms_norm2d(x, eps=1e-6), reference(x, None, None, True, 1e-6), TOL["float32"])
    xt = rand((2, 8, 8, 16), "float32").transpose(1, 3)  # other strides: copied first
    close(cnt.layer_norm2d(xt), reference(xt, None, None, False, 1e-5), TOL["float32"])
    for fmt in (torch.contiguous_format, torch.channels_last_3d):
        x3 = rand((2, 12, 3, 5, 7), "float32", fmt)
        out = cnt.layer_norm2d(x3)
        assert out.is_contiguous(memory_format=fmt)
        close(out, reference(x3, None, None, False, 1e-5), TOL["float32"])
    x1 = rand((6, 32, 50), "float32")  # (N, C, L)
    close(cnt.layer_norm2d(x1), reference(x1, None, None, False, 1e-5), TOL["float32"])


# ---- the two NCHW forwards: thin tiles (each kernel variant) and register tiles ----------------
# (N, C, H, W): what each exercises in the thin kernels
THIN_SHAPES = {
    "c3_odd": (2, 3, 7, 9),  # one thread row, 32 lanes on the pixels; S = 63: single elements
    "c64": (2, 64, 32, 32),
    "c96_convnext": (2, 96, 14, 14),  # S = 196: packs of 4 fp32 / 2 fp64, single halves
    "c130": (2, 130, 5, 12),  # more than 128 channels: 8 packs per thread; unused thread rows
    "c256": (2, 256, 4, 8),  # the most channels the thin tiles take by default
    "s15": (2, 64, 3, 5),  # S = 15: no packs, a tile wider than the plane
    "many_tiles": (4, 64, 192, 192),  # more tiles than CTAs resident at once
}
#: variant -> (THIN_CPT4_MAX_C, THIN_WIDE_MIN_CTAS), or None: the register tiles. thin8_wide:
#: the widest tiles (up to 32 packs) at any grid size, as huge tensors get them
FWD_VARIANTS = {
    "thin4": (4096, None),
    "thin8": (0, None),
    "thin8_wide": (0, 1),
    "register_tiles": None,
}


@pytest.fixture(params=list(FWD_VARIANTS))
def fwd_variant(request, monkeypatch):
    """The NCHW forward through one kernel variant (unaligned or odd planes: thin_scalar)."""
    from cupynorm import _channel

    setting = FWD_VARIANTS[request.param]
    if setting is not None:
        cpt4_max_c, wide_min_ctas = setting
        monkeypatch.setattr(_channel, "THIN_CPT4_MAX_C", cpt4_max_c)
        if wide_min_ctas is not None:
            monkeypatch.setattr(_channel, "THIN_WIDE_MIN_CTAS", wide_min_ctas)
    _channel.enable_thin(setting is not None)
    yield request.param
    _channel.enable_thin(None)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape_id", list(THIN_SHAPES))
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_nchw_forward_variants_match_float64(fwd_variant, dtype, shape_id, rms):
    from cupynorm import _ops

    x = rand(THIN_SHAPES[shape_id], dtype, offset=0.5)
    w, b = params(x.shape[1], dtype, rms)
    poison_torch_allocator()
    y, mean, rstd = _ops.channel_norm_fwd(x, w, b, 1e-5, rms)
    close(y, reference(x, w, b, rms, 1e-5), TOL[dtype] * 3)
    xd = x.double()
    stat_tol = 1e-10 if dtype == "float64" else 1e-5
    if rms:
        assert mean is None
        expected = torch.rsqrt(xd.square().mean(dim=1) + 1e-5)
    else:
        var, mu = torch.var_mean(xd, dim=1, correction=0)
        torch.testing.assert_close(mean.double(), mu, rtol=stat_tol, atol=stat_tol)
        expected = torch.rsqrt(var + 1e-5)
    torch.testing.assert_close(rstd.double(), expected, rtol=stat_tol, atol=0)
    # inference (no statistics) writes the same y
    (y2,) = _ops.channel_norm_fwd(x, w, b, 1e-5, rms, want_stats=False)[:1]
    assert torch.equal(y, y2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nchw_forward_variants_keep_the_digits_of_offset_data(fwd_variant, dtype):
    """Mean 1e4, std 1 per pixel, for every kernel variant (64 channels; 15 pixels per plane:
    single elements, 256: packs): no larger than torch's own error on the same data."""
    for shape in ((2, 64, 16, 16), (2, 64, 3, 5)):
        _assert_offset_error_within_torchs(rand(shape, dtype, offset=1e4))


def test_nchw_forward_variants_unaligned_and_half_params(fwd_variant):
    base = rand((2 * 96 * 64 + 1,), "float32")
    x = base[1:].view(2, 96, 8, 8)  # contiguous, not 16-byte aligned: single elements
    w, b = params(96, "float32", False)
    poison_torch_allocator()
    close(cnt.layer_norm2d(x, w, b), reference(x, w, b, False, 1e-5), TOL["float32"] * 3)
    for dtype in ("float16", "bfloat16"):  # float32 weight and bias beside half input
        xh = rand((3, 96, 8, 16), dtype)
        w, b = params(96, dtype, False, fp32_params=True)
        poison_torch_allocator()
        close(cnt.layer_norm2d(xh, w, b), reference(xh, w, b, False, 1e-5), TOL[dtype] * 3)


def test_kernelbench_36_formula_on_both_forwards():
    """KernelBench L1-36's formula, x / sqrt(mean(x^2, dim=1) + eps), at a reduced batch: the
    thin forward (the default for 64 channels) and the register tiles agree with torch."""
    from cupynorm import _channel

    x = rand((4, 64, 128, 128), "float32")
    expected = x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + 1e-5)
    try:
        for on in (None, False):
            _channel.enable_thin(on)
            poison_torch_allocator()
            torch.testing.assert_close(cnt.rms_norm2d(x, eps=1e-5), expected)
    finally:
        _channel.enable_thin(None)


def test_empty_inputs():
    for rms in (False, True):
        for shape in ((0, 7, 3, 3), (2, 7, 0, 3)):
            x = rand(shape, "float32").requires_grad_()
            w = torch.ones(7, device="cuda", requires_grad=True)
            out = run(x, w, None, rms, 1e-5)
            assert out.shape == shape
            out.sum().backward()
            assert torch.equal(w.grad, torch.zeros(7, device="cuda"))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_cupy_arrays(layout):
    import cupy

    x = cupy.random.standard_normal((3, 40, 7, 11), dtype=cupy.float32)
    if layout == "nhwc":
        x = cupy.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    w = cupy.random.uniform(0.5, 1.5, 40, dtype=cupy.float32)
    poison_cupy_pool()
    out = cupynorm.layer_norm2d(x, w)
    rms = cupynorm.rms_norm2d(x, w, 1e-6)
    assert isinstance(out, cupy.ndarray) and out.strides == x.strides
    tx, tw = torch.from_dlpack(x), torch.from_dlpack(w)
    close(torch.from_dlpack(out), reference(tx, tw, None, False, 1e-5), 1e-4)
    close(torch.from_dlpack(rms), reference(tx, tw, None, True, 1e-6), 1e-4)
    # a second call of the same signature is replayed (channels_last: the recorded rows, viewed)
    x2 = cupy.multiply(x, -0.5, out=cupy.empty_like(x))
    out2 = cupynorm.layer_norm2d(x2, w)
    assert out2.strides == x.strides and out2.data.ptr != out.data.ptr
    close(torch.from_dlpack(out2), reference(torch.from_dlpack(x2), tw, None, False, 1e-5), 1e-4)
    t2 = torch.from_dlpack(x2)
    with torch.no_grad():
        outs = [cupynorm.rms_norm2d(t2, tw, 1e-6) for _ in range(2)]  # recorded, replayed
    for o in outs:
        assert o.stride() == t2.stride()
        close(o, reference(t2, tw, None, True, 1e-6), 1e-4)


# ---- backward --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "shape_id", ["odd", "convnext", "convnext_rows", "many_channels", "one_pixel", "huge_c"]
)
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_backward_matches_float64(dtype, shape_id, layout, rms):
    shape = SHAPES[shape_id]
    x = rand(shape, dtype, LAYOUTS[layout]).requires_grad_()
    w, b = params(shape[1], dtype, rms)
    leaves = [x, w.requires_grad_()] + ([] if b is None else [b.requires_grad_()])
    dy = torch.randn(shape, device="cuda", dtype=torch.float64)
    poison_torch_allocator()
    out = run(x, w, b, rms, 1e-5)
    got = torch.autograd.grad((out.double() * dy).sum(), leaves)
    assert got[0].is_contiguous(memory_format=LAYOUTS[layout])
    refs = [t.detach().double().requires_grad_() for t in leaves]
    ref_out = reference(refs[0], refs[1], refs[2] if b is not None else None, rms, 1e-5)
    expected = torch.autograd.grad((ref_out * dy).sum(), refs)
    # torch's own gradients of the same half-precision computation (timm's LayerNorm2d)
    mine = [t.detach().clone().requires_grad_() for t in leaves]
    rows = mine[0].permute(0, *range(2, x.dim()), 1)
    torch_out = (
        F.rms_norm(rows, (shape[1],), mine[1], 1e-5)
        if rms
        else F.layer_norm(rows, (shape[1],), mine[1], mine[2], 1e-5)
    ).permute(0, x.dim() - 1, *range(1, x.dim() - 1))
    theirs = torch.autograd.grad((torch_out.double() * dy).sum(), mine)
    pixels = shape[0] * math.prod(shape[2:])
    tols = [GRAD_TOL[dtype]] + [GRAD_TOL[dtype] * math.sqrt(pixels)] * (len(got) - 1)
    for g, t, e, tol in zip(got, theirs, expected, tols, strict=True):
        close_or_like_torch(g, t, e, tol)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_gradients_are_bitwise_reproducible(layout):
    x = rand((4, 96, 56, 56), "bfloat16", LAYOUTS[layout]).requires_grad_()
    w, b = params(96, "bfloat16", False)
    w.requires_grad_()
    b.requires_grad_()
    dy = torch.randn_like(x)
    runs = [torch.autograd.grad(cnt.layer_norm2d(x, w, b), (x, w, b), dy) for _ in range(2)]
    for a, c in zip(*runs, strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape_id", ["odd", "convnext_rows", "many_channels", "huge_c"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_autocast_matches_torch_and_float64(dtype, shape_id, layout, rms):
    """Under autocast layer_norm2d (rms_norm2d) is torch's float32 norm of the half input
    (channels_last rows of whole packs read as is; others on a float32 copy): y float32, dx in
    x's dtype, both in x's memory format, errors against float64 no larger than torch's own (3x,
    plus a floor of float32 rounding for y and the parameter gradients, of x's dtype for dx)."""
    shape = SHAPES[shape_id]
    C = shape[1]
    x = rand(shape, dtype, LAYOUTS[layout], offset=0.5).requires_grad_()
    w, b = (t.requires_grad_() for t in params(C, dtype, False, fp32_params=True))
    b = None if rms else b.requires_grad_()
    w.requires_grad_()
    leaves = tuple(t for t in (x, w, b) if t is not None)
    dy = torch.randn(shape, device="cuda").contiguous(memory_format=LAYOUTS[layout])
    poison_torch_allocator()

    def timm(x, w, b):  # timm's LayerNorm2d / RmsNorm2d
        t = x.permute(0, 2, 3, 1)
        t = F.rms_norm(t, (C,), w) if rms else F.layer_norm(t, (C,), w, b)
        return t.permute(0, 3, 1, 2)

    def ours_fn(x, w, b):
        return cnt.rms_norm2d(x, w) if rms else cnt.layer_norm2d(x, w, b)

    results = []
    for fn in (ours_fn, timm):
        with torch.autocast("cuda", dtype=DTYPES[dtype]):
            y = fn(x, w, b)
        results.append((y, *torch.autograd.grad(y, leaves, dy)))
    ours, theirs = results
    assert ours[0].is_contiguous(memory_format=LAYOUTS[layout])
    assert ours[1].is_contiguous(memory_format=LAYOUTS[layout])
    doubles = tuple(t.detach().double().requires_grad_() for t in leaves)
    ref = reference(doubles[0], doubles[1], None if rms else doubles[2], rms, None if rms else 1e-5)
    refs = (ref.detach(), *torch.autograd.grad(ref, doubles, dy.double()))
    count = x.numel() // C
    floors = (1e-6, GRAD_TOL[dtype], 1e-6 * count, 1e-6 * count)
    for what, a, c, r, floor in zip(
        ("y", "dx", "dw", "db"), ours, theirs, refs, floors, strict=False
    ):
        assert a.dtype == c.dtype and not torch.isnan(a).any(), what
        err, torch_err = ((t.double() - r).abs().max().item() for t in (a, c))
        assert err <= 3 * torch_err + floor, what


def test_only_weight_gradients():
    x = rand((2, 32, 12, 12), "float32")
    w, b = params(32, "float32", False)
    w.requires_grad_()
    b.requires_grad_()
    dy = torch.randn_like(x)
    gw, gb = torch.autograd.grad(cnt.layer_norm2d(x, w, b), (w, b), dy)
    wd, bd = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    rw, rb = torch.autograd.grad(reference(x, wd, bd, False, 1e-5), (wd, bd), dy.double())
    close(gw, rw, 1e-3)
    close(gb, rb, 1e-3)


# ---- modules, compile, graphs ------------------------------------------------------------------
@pytest.mark.parametrize("cls", ["LayerNorm2d", "RMSNorm2d"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_module_compile_fullgraph_and_cuda_graph(cls, layout):
    torch._dynamo.reset()
    ours = getattr(cnt, cls)(64, eps=1e-6, device="cuda")
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
    rms = cls == "RMSNorm2d"
    x = rand((4, 64, 17, 19), "float32", LAYOUTS[layout]).requires_grad_()
    compiled = torch.compile(ours, fullgraph=True)
    out = compiled(x)
    bias = None if rms else ours.bias
    ref = reference(x, ours.weight, bias, rms, 1e-6).float()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    (gx,) = torch.autograd.grad(out.sum(), (x,))
    (rx,) = torch.autograd.grad(ours(x).sum(), (x,))
    torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()

    static = rand((4, 64, 17, 19), "float32", LAYOUTS[layout])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        ours(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        captured = ours(static)
    static.copy_(rand((4, 64, 17, 19), "float32", LAYOUTS[layout]))
    graph.replay()
    with torch.no_grad():
        ref = reference(static, ours.weight, bias, rms, 1e-6).float()
        torch.testing.assert_close(captured, ref, atol=1e-5, rtol=1e-5)


def test_timm_convnext_block_converted_matches():
    timm = pytest.importorskip("timm")
    from timm.layers import LayerNorm2d as TimmLayerNorm2d

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), TimmLayerNorm2d(32), torch.nn.Conv2d(32, 8, 1)
    ).cuda()
    ours = cnt.replace_norms(
        torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), TimmLayerNorm2d(32), torch.nn.Conv2d(32, 8, 1)
        ).cuda(),
        include=(torch.nn.LayerNorm,),
    )
    ours.load_state_dict(model.state_dict())
    assert isinstance(ours[1], cnt.LayerNorm2d), timm.__version__
    x = rand((2, 3, 20, 20), "float32").float()
    # TF32 convolutions would round the norm's last-bit differences into ~1e-3 ones
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        torch.testing.assert_close(ours(x), model(x), atol=1e-5, rtol=1e-5)
        dy = torch.randn(2, 8, 20, 20, device="cuda")
        got = torch.autograd.grad(ours(x), list(ours.parameters()), dy)
        expected = torch.autograd.grad(model(x), list(model.parameters()), dy)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_autocast_compiled_matches_eager(layout):
    """torch.compile(fullgraph) of LayerNorm2d, then LayerNorm over the rows of its
    channels-last view, under bf16 autocast: the custom ops take the half input as the eager
    Functions do (float32 y, dx in bf16) and match the eager calls."""
    torch.manual_seed(8)
    C = 96
    x = rand((4, C, 7, 9), "bfloat16", LAYOUTS[layout], offset=0.5).requires_grad_()
    w, b = (t.requires_grad_() for t in params(C, "bfloat16", False, fp32_params=True))

    def fn(x, w, b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = cnt.layer_norm2d(x, w, b)
            rows = cnt.layer_norm(x.permute(0, 2, 3, 1), (C,), w, b)
        return y, rows

    def step(f):
        y, rows = f(x, w, b)
        grads = torch.autograd.grad(
            (y, rows), (x, w, b), (torch.ones_like(y), torch.ones_like(rows))
        )
        return (y, rows, *grads)

    compiled = torch.compile(fn, fullgraph=True)
    try:
        got = step(compiled)
    finally:
        torch._dynamo.reset()
    want = step(fn)
    for a, c in zip(got, want, strict=True):
        assert a.dtype == c.dtype
        torch.testing.assert_close(
            a, c, rtol=1e-2, atol=1e-2 if a.dtype == torch.bfloat16 else 1e-5
        )
    assert got[0].dtype == got[1].dtype == torch.float32 and got[2].dtype == torch.bfloat16
