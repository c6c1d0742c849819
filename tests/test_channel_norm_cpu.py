"""LayerNorm / RMSNorm over the channels of (N, C, *) on the CPU: the modules against torch.nn's
LayerNorm / RMSNorm (signature, state_dict, repr), the kernel route (eager Function and custom
op, on the reference kernels) against timm's permute + layer_norm and its gradients, errors as
torch words them, fake kernels, opcheck, replace_norms on timm's and torchvision's classes, and
the plan of the NCHW thin-tile forward (its kernels run in tests/test_channel_norm_gpu.py).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cupynorm.torch as cnt
from cupynorm.errors import InvalidInputError
from cupynorm.torch import _channel_norm

PAIRS = [(cnt.LayerNorm2d, nn.LayerNorm), (cnt.RMSNorm2d, nn.RMSNorm)]


def _permuted(fn, x, *args):
    """timm's / torchvision's LayerNorm2d: the norm of the channels-last view, moved back."""
    rows = x.permute(0, *range(2, x.dim()), 1)
    out = fn(rows, (x.shape[1],), *args)
    return out.permute(0, x.dim() - 1, *range(1, x.dim() - 1))


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=["LayerNorm2d", "RMSNorm2d"])
def test_module_signature_state_dict_repr_equal_torch(ours, theirs):
    assert inspect.signature(ours.__init__) == inspect.signature(theirs.__init__)
    a, b = ours(24, eps=1e-6), theirs(24, eps=1e-6)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert repr(a) == repr(b).replace(theirs.__name__, ours.__name__)
    a.load_state_dict(b.state_dict())
    assert isinstance(a, theirs)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("affine", [False, True])
def test_kernel_route_matches_permuted_torch(kernel_path, fmt, rms, affine):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64) + 0.5
    x = x.contiguous(memory_format=fmt).requires_grad_()
    w = (torch.rand(5, generator=g, dtype=torch.float64) + 0.5).requires_grad_() if affine else None
    b = torch.randn(5, generator=g, dtype=torch.float64).requires_grad_() if affine else None
    if rms:
        out, ref = cnt.rms_norm2d(x, w, 1e-5), _permuted(F.rms_norm, x, w, 1e-5)
    else:
        out, ref = cnt.layer_norm2d(x, w, b, 1e-5), _permuted(F.layer_norm, x, w, b, 1e-5)
    assert out.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(out, ref)
    dy = torch.randn(out.shape, generator=g, dtype=torch.float64)
    leaves = [t for t in (x, w, None if rms else b) if t is not None]
    got = torch.autograd.grad(out, leaves, dy)
    expected = torch.autograd.grad(ref, leaves, dy)
    for a, e in zip(got, expected, strict=True):
        torch.testing.assert_close(a, e)
    assert got[0].is_contiguous(memory_format=fmt)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_layer_norm2d_under_autocast_is_the_float32_norm(kernel_path, monkeypatch, fmt, dtype):
    """Under autocast, layer_norm2d is torch's float32 norm of a half input (float64 stays
    float64): y in that dtype and x's memory format, dx in x's dtype and memory format."""
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: True)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 16, 3, 4, generator=g) + 0.5).to(dtype)
    x = x.contiguous(memory_format=fmt).requires_grad_()
    w, b = (torch.randn(16, generator=g).requires_grad_() for _ in range(2))
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    out = cnt.layer_norm2d(x, w, b)
    ref = _permuted(F.layer_norm, x.to(compute), w.to(compute), b.to(compute), 1e-5)
    assert out.dtype == compute and out.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn(out.shape, generator=g, dtype=compute)
    got, expected = torch.autograd.grad(out, (x, w, b), dy), torch.autograd.grad(ref, (x, w, b), dy)
    for a, e in zip(got, expected, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-2)
    assert got[0].is_contiguous(memory_format=fmt)


def test_rms_norm2d_default_eps_is_torchs(kernels):
    x = torch.randn(2, 3, 4, 4) * 1e-4
    torch.testing.assert_close(cnt.rms_norm2d(x), _permuted(F.rms_norm, x, None, None))


def test_cpu_tensors_go_to_torch():
    x = torch.randn(2, 6, 3, 3).contiguous(memory_format=torch.channels_last)
    m = cnt.LayerNorm2d(6)
    out = m(x)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, _permuted(F.layer_norm, x, m.weight, m.bias, m.eps))


def _op_samples():
    g = torch.Generator().manual_seed(5)

    def r(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64)

    fwd, bwd = _channel_norm.channel_norm_fwd_op, _channel_norm.channel_norm_bwd_op
    x = r(2, 5, 3, 4)
    return [
        ("ln", fwd, (x, r(5), r(5), 1e-5, False)),
        ("rms_cl", fwd, (x.contiguous(memory_format=torch.channels_last), None, None, 1e-6, True)),
        # autocast's float32 y beside a bf16 x (traced calls under autocast)
        ("ln_out_float32", fwd, (x.bfloat16(), r(5).float(), r(5).float(), 1e-5, False, True)),
        ("bwd_ln", bwd, (r(2, 5, 3, 4), x, r(2, 3, 4), r(2, 3, 4).abs(), r(5), [True, True, True])),
        ("bwd_rms", bwd, (r(2, 5, 3, 4), x, None, r(2, 3, 4).abs(), None, [True, False, False])),
    ]


@pytest.mark.parametrize("name, op, args", _op_samples(), ids=[s[0] for s in _op_samples()])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_gradcheck_op():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 4, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    op = _channel_norm.channel_norm_fwd_op
    assert torch.autograd.gradcheck(lambda x, w, b: op(x, w, b, 1e-5, False)[0], (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: op(x, w, None, 1e-5, True)[0], (x, w))


def test_fake_kernels_match_the_reference_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(2, 5, 3, 4).to(torch.bfloat16).contiguous(memory_format=fmt)
        for rms in (False, True):
            real = _channel_norm._channel_norm_fwd_reference(x, None, None, 1e-5, rms)
            with FakeTensorMode() as mode:
                fake = _channel_norm._channel_norm_fwd_fake(
                    mode.from_tensor(x), None, None, 1e-5, rms
                )
            for r, f in zip(real, fake, strict=True):
                assert (r is None) == (f is None)
                if r is not None:
                    assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


@pytest.mark.parametrize(
    "shape, weight_shape",
    [((2, 5, 3, 3), (4,)), ((2, 5, 3, 3), (5, 1))],
)
def test_parameter_errors_are_torchs(kernels, shape, weight_shape):
    x, w = torch.randn(shape), torch.randn(weight_shape)
    with pytest.raises(RuntimeError) as theirs:
        _permuted(F.layer_norm, x, w, None, 1e-5)
    with pytest.raises(RuntimeError) as ours:
        cnt.layer_norm2d(x, w)
    assert str(ours.value) == str(theirs.value)


def test_one_dimensional_input_is_refused(kernels):
    with pytest.raises(InvalidInputError, match="expected input of shape"):
        cnt.layer_norm2d(torch.randn(5))


def test_replace_norms_converts_timm_and_torchvision_channel_norms_when_included():
    timm_layers = pytest.importorskip("timm.layers")
    modules = [timm_layers.LayerNorm2d(8), timm_layers.RmsNorm2d(8)]
    try:
        from torchvision.models.convnext import LayerNorm2d as TorchvisionLayerNorm2d

        modules.append(TorchvisionLayerNorm2d(8, eps=1e-6))
    except ImportError:
        pass
    model = nn.Sequential(*modules, nn.LayerNorm(6), nn.Conv2d(8, 8, 1))  # LayerNorm: over W
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    x = torch.randn(2, 8, 5, 6)
    expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnt.replace_norms(model)  # not included: left alone, no warning
    assert not any(isinstance(m, (cnt.LayerNorm2d, cnt.RMSNorm2d)) for m in model)
    cnt.replace_norms(model, include=(nn.LayerNorm, nn.RMSNorm))
    assert isinstance(model[0], cnt.LayerNorm2d) and isinstance(model[0], timm_layers.LayerNorm2d)
    assert isinstance(model[1], cnt.RMSNorm2d) and isinstance(model[1], timm_layers.RmsNorm2d)
    assert all(isinstance(m, cnt.LayerNorm2d) for m in modules[2:])
    assert type(model[-2]) is cnt.LayerNorm
    torch.testing.assert_close(model(x), expected)
    cnt.replace_norms(model, include=(nn.LayerNorm, nn.RMSNorm))  # again: nothing changes
    torch.testing.assert_close(model(x), expected)


def test_a_module_computing_something_else_is_not_a_channel_norm():
    class Scaled(nn.LayerNorm):
        def forward(self, x):
            x = x.permute(0, 2, 3, 1)
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
            return 2 * x.permute(0, 3, 1, 2)

    model = nn.Sequential(Scaled(4))
    with pytest.warns(UserWarning, match="left alone"):
        cnt.replace_norms(model, include=(nn.LayerNorm,))
    assert type(model[0]) is Scaled


def test_timm_rms_norm2d_with_llama_included_is_still_a_channel_norm():
    """Its class name says RMSNorm, so the Llama probe looks at it first; not of that formula,
    it goes on to the channel-norm probe instead of being left alone."""
    timm_layers = pytest.importorskip("timm.layers")
    model = nn.Sequential(timm_layers.RmsNorm2d(8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnt.replace_norms(model, include=(nn.RMSNorm, cnt.LlamaRMSNorm))
    assert isinstance(model[0], cnt.RMSNorm2d)


# ---- the thin-tile forward's plan (cuda_src/channel_norm.cu, channel_fwd_thin) ----------------
def _thin_plan(N, C, S, itemsize, vectorized, rms, cpt=None, max_threads=256):
    from cupynorm import _channel

    kernel, cpt = _channel.thin_kernel(C, rms, vectorized, cpt)
    return _channel.plan_thin(N, C, S, itemsize, vectorized, rms, kernel, cpt, max_threads), cpt


def test_thin_plan_of_kernelbench_36_and_convnext():
    plan, cpt = _thin_plan(112, 64, 512 * 512, 4, True, rms=True)
    # 8 thread rows of 8 packs (64 channels) by 32 packs of 16 bytes: a 512-byte row per access,
    # as the grid keeps 229,376 tiles (at least THIN_WIDE_MIN_CTAS)
    assert (plan.kernel, cpt, plan.px, plan.cy) == ("channel_norm_fwd_rms_thin8", 8, 32, 8)
    assert plan.tiles == 512 * 512 // 4 // 32 and plan.smem == 2 * 8 * 32 * 4 * 4
    plan, cpt = _thin_plan(8, 64, 512 * 512, 4, True, rms=True)  # 16,384 tiles: 128 bytes
    assert (plan.px, plan.cy, plan.tiles) == (8, 8, 512 * 512 // 4 // 8)
    assert plan.smem == 2 * 2 * 8 * 4 * 4
    plan, cpt = _thin_plan(112, 64, 512 * 512, 4, True, rms=True, cpt=4)
    assert (plan.kernel, cpt, plan.px, plan.cy) == ("channel_norm_fwd_rms_thin4", 4, 16, 16)
    assert plan.tiles == 512 * 512 // 4 // 16 and plan.smem == 2 * 8 * 16 * 4 * 4
    plan, _ = _thin_plan(64, 96, 56 * 56, 2, True, rms=False)
    assert (plan.kernel, plan.px, plan.cy) == ("channel_norm_fwd_layer_thin8", 8, 12)
    assert plan.tiles == 49
    plan, cpt = _thin_plan(2, 96, 56 * 56, 2, False, rms=False)  # unaligned: single elements
    assert (plan.kernel, cpt, plan.px, plan.cy) == ("channel_norm_fwd_layer_thin_scalar", 16, 32, 6)


@pytest.mark.parametrize(
    "N, C, S, itemsize, vectorized",
    [
        (2, 3, 63, 4, False),
        (3, 1, 35, 2, False),
        (2, 64, 1024, 4, True),
        (2, 96, 196, 8, True),
        (2, 130, 60, 4, True),
        (2, 256, 32, 2, True),
        (2, 200, 9, 8, False),
        (1, 64, 4, 4, True),
        (2, 256, 7, 4, False),
    ],
)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_thin_plan_gives_every_pack_to_one_thread(N, C, S, itemsize, vectorized, rms):
    """The kernel's mapping over the plan: tile t, thread (tx, ty) holds pack
    (t mod tiles) * px + tx of channels ty + k * cy (k < cpt) of sample t // tiles. Whole
    warps, px a power of two <= 32 with 32 / px rows per warp, at most 256 threads."""
    plan, cpt = _thin_plan(N, C, S, itemsize, vectorized, rms)
    px, cy = plan.px, plan.cy
    assert 32 % px == 0 and cy % (32 // px) == 0 and px * cy <= 256
    unit = 16 // itemsize if vectorized else 1
    packs = S // unit
    owners: dict = {}
    for t in range(N * plan.tiles):
        n = t // plan.tiles
        for ty in range(cy):
            for tx in range(px):
                p = (t - n * plan.tiles) * px + tx
                if p >= packs:
                    continue
                for k in range(cpt):
                    if ty + k * cy < C:
                        key = (n, ty + k * cy, p)
                        assert key not in owners
                        owners[key] = (t, tx, ty)
    assert len(owners) == N * C * packs
    warps = px * cy // 32
    assert plan.smem == (
        0 if warps == 1 else 2 * warps * px * unit * (1 if rms else 2) * (8 if itemsize == 8 else 4)
    )


def test_thin_plan_refuses_what_does_not_fit_and_routes_by_channels(monkeypatch):
    from cupynorm import _channel

    assert _thin_plan(2, 600, 64, 4, True, rms=True)[0] is None  # 75 rows of 8 packs
    narrow, _ = _thin_plan(2, 64, 64, 4, True, rms=True, max_threads=64, cpt=4)  # a kernel's limit
    assert (narrow.px, narrow.cy) == (4, 16)
    assert _thin_plan(2**20, 64, 2**20 * 4, 4, True, rms=True)[0] is None  # 2^31 tiles
    monkeypatch.setattr(_channel, "thin", None)
    assert _channel.uses_thin(_channel.THIN_MAX_C) and not _channel.uses_thin(
        _channel.THIN_MAX_C + 1
    )
    monkeypatch.setattr(_channel, "thin", False)
    assert not _channel.uses_thin(64)
    monkeypatch.setattr(_channel, "thin", True)
    assert _channel.uses_thin(4096)


@pytest.mark.parametrize(
    "shape", [(2, 3, 4, 5), (2, 3, 1, 1), (2, 1, 4, 5), (1, 3, 1, 5), (2, 3, 4, 5, 6), (2, 3, 4)]
)
def test_the_eager_size_kind_is_the_row_norms_exactly_when_the_rows_are_dense(shape) -> None:
    """A channel norm call takes the row norm's eager size where its channels-last view is
    contiguous (the call the kernels make of it), the channel norms' own elsewhere."""
    x = torch.randn(shape)
    layouts = [x, x.transpose(-1, -2), x.movedim(1, -1).contiguous().movedim(-1, 1)]
    for t in layouts:
        expected = "rms_norm" if t.movedim(1, -1).is_contiguous() else "channel_norm"
        assert _channel_norm._size_kind(t, "rms_norm") == expected, t.stride()
