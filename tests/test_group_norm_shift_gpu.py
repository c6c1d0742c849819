"""GroupNorm (+ activation) of x + shift[n, c] -- a diffusion block's time embedding added before
its norm -- in the kernels themselves (cupynorm._ops and the CuPy functional): forward and
backward against a float64 reference of the unfused sequence, every dtype, both layouts, packs
that straddle two channels, one CTA and a team per group, groups too long for a team (the strided
rows statistics in runs of one channel), offset data, poisoned outputs. The torch layer's own
tests (autograd, the shift's gradient, custom ops, fuse) are in test_group_norm_act_gpu.py."""

from __future__ import annotations

import pytest
from conftest import cuda_available, poison_torch_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

if cuda_available():
    import torch
    import torch.nn.functional as F

    import cupynorm
    from cupynorm import _ops
    from cupynorm.errors import InvalidInputError, InvalidTypeError

    DTYPES = {
        "float32": torch.float32,
        "float64": torch.float64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }
    ACTS = {"identity": lambda t: t, "relu": F.relu, "silu": F.silu}

# relative to the largest reference value (as test_group_norm_act_gpu.py)
TOL = {"float32": 2e-5, "float64": 1e-10, "float16": 4e-3, "bfloat16": 3e-2}

CASES = [  # shape, groups, memory format
    ((4, 6, 7, 9), 3, "contiguous"),  # odd planes: the scalar on-chip path
    ((3, 8, 3, 4), 4, "contiguous"),  # planes of 12: half-type packs of 8 straddle two channels
    ((3, 6, 7, 9), 3, "channels_last"),
    ((4, 320, 8, 8), 32, "contiguous"),  # the diffusion shape, small
    ((4, 320, 8, 8), 32, "channels_last"),
    ((3, 8, 5), 2, "contiguous"),  # 3-D input
    ((2, 64, 9, 11), 1, "channels_last"),  # Cg = 64
    ((2, 4, 130, 131), 2, "contiguous"),  # a team of CTAs per segment
    ((2, 2, 600, 640), 1, "contiguous"),  # fp32: too long for a team (strided rows); half: a team
    ((1, 3, 999, 1001), 1, "contiguous"),  # fp32: strided rows, odd planes (no 16-byte packs)
]
CASE_IDS = [f"{'x'.join(map(str, s))}-g{g}-{f}" for s, g, f in CASES]


def _layout(t, fmt):
    return t.to(memory_format=torch.channels_last) if fmt == "channels_last" else t


def _err(ours, ref):
    scale = ref.abs().max().item() + 1e-30
    return (ours.double() - ref.double()).abs().max().item() / scale


def _close(ours, ref, dtype, what):
    assert not torch.isnan(ours).any(), f"NaN in {what}"
    err = _err(ours, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.2e} > {TOL[dtype]:.0e}"


def _reference(x, shift, groups, weight, bias, eps, act, dy):
    """y and (dx, dweight, dbias) of act(group_norm(x + shift)) in float64."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    s64 = shift.double().reshape(*shift.shape, *([1] * (x.dim() - 2)))
    y = ACTS[act](F.group_norm(x64 + s64, groups, w64, b64, eps))
    return y, torch.autograd.grad(y, (x64, w64, b64), dy.double())


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("act", ["silu", "relu", "identity"])
@pytest.mark.parametrize("shape,groups,fmt", CASES, ids=CASE_IDS)
def test_group_norm_shift_matches_float64(dtype, act, shape, groups, fmt):
    if act != "silu" and shape[1] not in (6, 8):
        pytest.skip("the other activations on the small cases")
    if shape[2:] == (999, 1001) and dtype != "float32":
        pytest.skip("the strided rows case is fp32's")
    poison_torch_allocator()
    N, C = shape[:2]
    dt = DTYPES[dtype]
    x = _layout((torch.randn(shape, device="cuda", dtype=torch.float64) + 3.0).to(dt), fmt)
    shift = (2 * torch.randn(N, C, device="cuda", dtype=torch.float64)).to(dt)
    pdt = torch.float32 if dtype in ("float16", "bfloat16") else dt
    weight = torch.rand(C, device="cuda", dtype=pdt) + 0.5
    bias = torch.randn(C, device="cuda", dtype=pdt)
    dy = _layout(torch.randn(shape, device="cuda", dtype=torch.float64).to(dt), fmt)
    y, mean, rstd = _ops.group_norm_fwd(x, groups, weight, bias, 1e-5, shift, act=act)
    ref, (dx_ref, dw_ref, db_ref) = _reference(x, shift, groups, weight, bias, 1e-5, act, dy)
    assert y.dtype == dt and y.stride() == x.stride()
    _close(y, ref, dtype, "y")
    needs = (True, True, True)
    dx, dw, db = _ops.group_norm_act_bwd(dy, x, mean, rstd, weight, bias, groups, needs, act, shift)
    _close(dx, dx_ref, dtype, "dx")
    _close(dw, dw_ref, dtype, "dweight")
    _close(db, db_ref, dtype, "dbias")


@pytest.mark.parametrize("fmt", ["contiguous", "channels_last"])
def test_group_norm_shift_on_offset_data(fmt):
    """Data of mean 1e4 with shifts of 1e3 in fp32: the statistics are of x + shift, relative to
    each group's first value, with their digits."""
    N, C, G = 3, 32, 8
    x = _layout(torch.randn(N, C, 17, 19, device="cuda") + 1e4, fmt)
    shift = 1e3 * torch.randn(N, C, device="cuda")
    w, b = torch.rand(C, device="cuda") + 0.5, torch.randn(C, device="cuda")
    dy = _layout(torch.randn(N, C, 17, 19, device="cuda"), fmt)
    y, mean, rstd = _ops.group_norm_fwd(x, G, w, b, 1e-5, shift, act="silu")
    ref, (dx_ref, dw_ref, _) = _reference(x, shift, G, w, b, 1e-5, "silu", dy)
    assert _err(y, ref) < 1e-4
    dx, dw, _db = _ops.group_norm_act_bwd(dy, x, mean, rstd, w, b, G, (True,) * 3, "silu", shift)
    assert _err(dx, dx_ref) < 1e-3 and _err(dw, dw_ref) < 1e-3


def test_group_norm_shift_cupy_functional():
    """The CuPy functional with a shift, and its argument errors."""
    import cupy

    N, C, G = 2, 64, 32
    x = cupy.random.standard_normal((N, C, 16, 16), dtype=cupy.float32).astype(cupy.float16)
    shift = cupy.random.standard_normal((N, C), dtype=cupy.float32).astype(cupy.float16)
    y = cupynorm.group_norm_act(x, G, None, None, 1e-5, "silu", shift)
    xt, st = torch.from_dlpack(x), torch.from_dlpack(shift)
    ref = F.silu(F.group_norm(xt.double() + st.double()[:, :, None, None], G, eps=1e-5))
    assert _err(torch.from_dlpack(y), ref) < TOL["float16"]
    # a transposed (non-contiguous) shift is copied, not misread
    y2 = cupynorm.group_norm_act(x, G, None, None, 1e-5, "silu", cupy.ascontiguousarray(shift.T).T)
    assert bool((y2 == y).all())
    with pytest.raises(InvalidInputError, match=r"shift of shape \(2, 64\)"):
        cupynorm.group_norm_act(x, G, None, None, 1e-5, "silu", shift[:, :32])
    with pytest.raises(InvalidTypeError, match="shift must have the input's dtype"):
        cupynorm.group_norm_act(x, G, None, None, 1e-5, "silu", shift.astype(cupy.float32))
