"""Forward InstanceNorm / GroupNorm / BatchNorm on the GPU against torch and a float64 reference.

Fresh random data for every case (never zeros), the allocator poisoned with NaN before each call
so an unwritten output element shows, odd and prime sizes, every dtype, contiguous /
channels_last / strided inputs, offset data, every kernel strategy (one CTA per segment, cluster,
split statistics), torch and CuPy inputs, non-default streams.
"""

from __future__ import annotations

import pytest
from conftest import cuda_available, poison_cupy_pool, poison_torch_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

if cuda_available():
    import torch
    import torch.nn.functional as F

    import cupynorm

    DTYPES = {
        "float32": torch.float32,
        "float64": torch.float64,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }

# atol = rtol for an output of unit scale (x - mean) * rstd: a few roundings of the dtype, plus the
# fp32 statistics over long segments
TOL = {"float32": 3e-5, "float64": 1e-10, "float16": 4e-3, "bfloat16": 3e-2}

SHAPES = {
    "1d": (3, 6, 7),
    "2d_odd": (3, 6, 5, 7),
    "3d": (2, 6, 3, 5, 7),
    "hw1": (5, 6, 1, 1),
    "prime": (2, 6, 13, 17),
    "c3": (4, 3, 11, 9),
    "wide": (2, 64, 24, 40),
}
# Few rows of many channels: the columns passes deal channel tiles over the grid (resnet50's last
# stage: 2048 channels of 7x7), whole packs and not
MANY_CHANNELS = {"c2048": (4, 2048, 7, 7), "c1031": (3, 1031, 5, 3)}


def rand(shape, dtype, *, offset=0.0, memory_format="contiguous", seed=None):
    g = torch.Generator(device="cuda")
    g.manual_seed(torch.seed() if seed is None else seed)
    x = torch.randn(shape, generator=g, device="cuda", dtype=torch.float64) + offset
    x = x.to(DTYPES[dtype])
    if memory_format == "channels_last":
        x = x.to(memory_format=torch.channels_last if x.ndim == 4 else torch.channels_last_3d)
    elif memory_format == "strided":  # every other channel of a wider tensor
        wide = torch.randn((shape[0], 2 * shape[1], *shape[2:]), device="cuda").to(x.dtype)
        wide[:, ::2] = x
        x = wide[:, ::2]
    return x


def affine(C, dtype, on):
    if not on:
        return None, None
    w = (torch.rand(C, device="cuda", dtype=torch.float64) + 0.5).to(DTYPES[dtype])
    b = torch.randn(C, device="cuda", dtype=torch.float64).to(DTYPES[dtype])
    return w, b


def check(out, ref64, dtype, scale=1.0):
    assert out.dtype == DTYPES[dtype]
    assert out.shape == ref64.shape
    assert not torch.isnan(out).any(), "NaN in output: an element was not written"
    tol = TOL[dtype] * scale
    torch.testing.assert_close(out.double(), ref64, atol=tol, rtol=tol)


def same_format(out, x):
    for fmt in (torch.channels_last, torch.channels_last_3d):
        if (
            x.dim() == (4 if fmt is torch.channels_last else 5)
            and x.is_contiguous(memory_format=fmt)
            and not x.is_contiguous()
        ):
            assert out.is_contiguous(memory_format=fmt)
            return
    assert out.is_contiguous()


def _d(t):
    return None if t is None else t.double()


# ---- GroupNorm / InstanceNorm -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape_id", list(SHAPES))
@pytest.mark.parametrize("groups_of", ["instance", "group2", "layer"])
@pytest.mark.parametrize("has_affine", [True, False], ids=["affine", "plain"])
def test_group_norm_matches_reference(dtype, shape_id, groups_of, has_affine):
    shape = SHAPES[shape_id]
    C = shape[1]
    G = {"instance": C, "group2": C // 3 if C % 3 == 0 else 1, "layer": 1}[groups_of]
    x = rand(shape, dtype)
    w, b = affine(C, dtype, has_affine)
    poison_torch_allocator()
    out = cupynorm.group_norm(x, G, w, b, eps=1e-5)
    check(out, F.group_norm(x.double(), G, _d(w), _d(b), 1e-5), dtype)
    same_format(out, x)


@pytest.mark.parametrize("memory_format", ["channels_last", "strided"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    "shape",
    [(3, 6, 5, 7), (2, 12, 9, 4, 3), (4, 320, 8, 8), (2, 64, 67, 61), (2, 1536, 6, 5)],
    # multi-cta: columns rows over several CTAs, partial block; wide: the channel tiles over the
    # grid (few rows of many channels; groups of 512 channels straddle tiles)
    ids=["2d", "3d", "sd", "multi-cta", "wide"],
)
def test_group_norm_layouts(memory_format, dtype, shape):
    x = rand(shape, dtype, memory_format=memory_format)
    C = shape[1]
    G = 3 if C % 3 == 0 else 2
    w, b = affine(C, dtype, True)
    poison_torch_allocator()
    out = cupynorm.group_norm(x, G, w, b)
    check(out, F.group_norm(x.double(), G, _d(w), _d(b), 1e-5), dtype)
    if memory_format == "channels_last":
        same_format(out, x)


@pytest.mark.parametrize(
    "shape,groups,strategy",
    [
        ((2, 4, 512, 512), 4, "team of 16 (1 MiB segments)"),
        ((3, 8, 512, 512), 1, "team of 128 (8 MiB segments)"),
        ((3, 4, 96, 96), 2, "one CTA (72 KiB segments)"),
        ((2, 3, 301, 311), 1, "team, unaligned (scalar path)"),
        ((2, 8, 1024, 1024), 1, "split statistics (32 MiB segments)"),
        ((2, 3, 1009, 1013), 1, "split, unaligned"),
    ],
)
def test_group_norm_large_segments(shape, groups, strategy):
    x = rand(shape, "float32")
    w, b = affine(shape[1], "float32", True)
    poison_torch_allocator(256 << 20)
    out = cupynorm.group_norm(x, groups, w, b)
    check(out, F.group_norm(x.double(), groups, _d(w), _d(b), 1e-5), "float32", scale=3)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(2, 6, 33, 31), (2, 4, 512, 512)], ids=["block", "cluster"])
def test_offset_data_matches_torch(dtype, shape):
    """Mean 1e4, std 1: no cancellation. The fp32 mean itself is rounded to ~1e4 * 2^-24 relative,
    which bounds the error of (x - mean) for torch and for us alike."""
    offset = 1e4
    x = rand(shape, dtype, offset=offset)
    out = cupynorm.instance_norm(x)
    ref = F.instance_norm(x.double())
    theirs = (F.instance_norm(x) - ref).abs().max().item()
    ours = (out.double() - ref).abs().max().item()
    unit = 2.0**-24 if dtype == "float32" else 2.0**-53
    assert ours <= max(4 * theirs, 8 * unit * offset, TOL[dtype]), (ours, theirs)


def test_instance_norm_running_stats_several_steps():
    C = 5
    rm, rv = torch.randn(C, device="cuda"), torch.rand(C, device="cuda") + 0.5
    rm_ref, rv_ref = rm.clone(), rv.clone()
    for _ in range(3):
        x = rand((4, C, 6, 7), "float32")
        out = cupynorm.instance_norm(x, rm, rv, momentum=0.3)
        ref = F.instance_norm(x, rm_ref, rv_ref, momentum=0.3)
        torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(rm, rm_ref)
    torch.testing.assert_close(rv, rv_ref)
    x = rand((4, C, 6, 7), "float32")
    out = cupynorm.instance_norm(x, rm, rv, use_input_stats=False)
    torch.testing.assert_close(
        out, F.instance_norm(x, rm_ref, rv_ref, use_input_stats=False), atol=3e-5, rtol=3e-5
    )


# ---- BatchNorm ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape_id", ["1d", "2d_odd", "3d", "hw1", "prime", "wide", *MANY_CHANNELS])
@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last", "strided"])
def test_batch_norm_training_matches_reference(dtype, shape_id, memory_format):
    shape = {**SHAPES, **MANY_CHANNELS}[shape_id]
    if memory_format == "channels_last" and len(shape) == 3:
        pytest.skip("no channels_last for 3-d tensors")
    C = shape[1]
    x = rand(shape, dtype, memory_format=memory_format)
    w, b = affine(C, dtype, True)
    rm = torch.randn(C, device="cuda")
    rv = torch.rand(C, device="cuda") + 0.5
    rm_ref, rv_ref = rm.double(), rv.double()
    poison_torch_allocator()
    out = cupynorm.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2)
    ref = F.batch_norm(x.double(), rm_ref, rv_ref, _d(w), _d(b), training=True, momentum=0.2)
    check(out, ref, dtype)
    torch.testing.assert_close(rm.double(), rm_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rv.double(), rv_ref, atol=1e-6, rtol=1e-5)
    if memory_format == "channels_last":
        same_format(out, x)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("stats_dtype", ["float32", "input"])
def test_batch_norm_eval(dtype, stats_dtype):
    """Running statistics of the weight's dtype are read by a kernel, others converted first;
    the second call of a signature replays the first."""
    C = 6
    w, b = affine(C, dtype, True)
    sdt = torch.float32 if stats_dtype == "float32" else DTYPES[dtype]
    rm, rv = torch.randn(C, device="cuda").to(sdt), (torch.rand(C, device="cuda") + 0.5).to(sdt)
    for _ in range(2):
        x = rand((3, C, 5, 7), dtype)
        poison_torch_allocator()
        out = cupynorm.batch_norm(x, rm, rv, w, b, training=False)
        check(out, F.batch_norm(x.double(), rm.double(), rv.double(), _d(w), _d(b)), dtype)


@pytest.mark.parametrize(
    "dtype,param_dtype", [("float32", "float32"), ("float16", "float16"), ("float16", "float32")]
)
@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_batch_norm_running_stats_several_steps(dtype, param_dtype, memory_format):
    """Running statistics updated in the finalize kernel, step after step (replayed calls)."""
    C = 7
    pdt = DTYPES[param_dtype]
    rm, rv = torch.zeros(C, device="cuda", dtype=pdt), torch.ones(C, device="cuda", dtype=pdt)
    rm_ref, rv_ref = rm.double(), rv.double()
    w, b = affine(C, param_dtype, True)
    for step in range(4):
        x = rand((8, C, 9, 11), dtype, offset=step, memory_format=memory_format)
        poison_torch_allocator()
        out = cupynorm.batch_norm(x, rm, rv, w, b, training=True, momentum=0.3)
        ref = F.batch_norm(x.double(), rm_ref, rv_ref, _d(w), _d(b), training=True, momentum=0.3)
        check(out, ref, dtype)
    tol = 1e-5 if param_dtype == "float32" else 2e-3
    torch.testing.assert_close(rm.double(), rm_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(rv.double(), rv_ref, atol=tol, rtol=tol)


def test_batch_norm_large():
    x = rand((16, 8, 256, 256), "float32", offset=3.0)
    rm, rv = torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")
    out = cupynorm.batch_norm(x, rm, rv, training=True)
    check(out, F.batch_norm(x.double(), None, None, training=True), "float32", scale=3)


def test_mixed_precision_weight():
    x = rand((4, 6, 9, 9), "float16")
    w, b = affine(6, "float32", True)
    out = cupynorm.group_norm(x, 3, w, b)
    check(out, F.group_norm(x.double(), 3, w.double(), b.double()), "float16")


# ---- zero-size, frameworks, streams -------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 4, 5, 5), (2, 4, 0, 5)])
def test_zero_size(shape):
    x = torch.randn(shape, device="cuda")
    assert cupynorm.group_norm(x, 2).shape == shape
    assert cupynorm.batch_norm(x, None, None, training=True).shape == shape


def test_cupy_inputs():
    import cupy

    x = rand((3, 6, 10, 11), "float32")
    w, b = affine(6, "float32", True)
    xc, wc, bc = (cupy.from_dlpack(t) for t in (x, w, b))
    poison_cupy_pool()
    out = cupynorm.group_norm(xc, 3, wc, bc)
    assert isinstance(out, cupy.ndarray)
    check(torch.from_dlpack(out), F.group_norm(x.double(), 3, w.double(), b.double()), "float32")
    rm, rv = cupy.zeros(6, cupy.float32), cupy.ones(6, cupy.float32)
    out = cupynorm.batch_norm(xc, rm, rv, wc, bc, training=True)
    ref = F.batch_norm(x.double(), None, None, w.double(), b.double(), training=True)
    check(torch.from_dlpack(out), ref, "float32")
    expected_rm = 0.1 * x.double().mean((0, 2, 3))
    torch.testing.assert_close(torch.from_dlpack(rm).double(), expected_rm, atol=1e-6, rtol=1e-5)


def test_cupy_channels_last_view():
    import cupy

    xc = cupy.random.standard_normal((2, 9, 10, 12), dtype=cupy.float32) + 3
    x_cl = xc.transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2)  # channel innermost
    out = cupynorm.group_norm(x_cl, 3)
    ref = F.group_norm(torch.from_dlpack(xc).double(), 3)
    check(torch.from_dlpack(out), ref, "float32")
    assert out.strides == x_cl.strides


def test_non_default_stream_with_queued_work():
    s = torch.cuda.Stream()
    x = rand((4, 6, 64, 64), "float32")
    ref = F.group_norm(x.double(), 2)
    with torch.cuda.stream(s):
        big = torch.randn(1 << 26, device="cuda")
        for _ in range(5):
            big = big * 1.0001  # queue work before our kernels on the same stream
        y = x * 2.0 - x  # produced on this stream, so only correct if we launch on it
        out = cupynorm.group_norm(y, 2)
    torch.cuda.synchronize()
    check(out, ref, "float32")


def test_dlpack_foreign_object():
    class Wrapper:  # an array type known only through DLPack
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kwargs):
            return self.t.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    import cupy

    x = rand((2, 6, 5, 5), "float32")
    out = cupynorm.group_norm(Wrapper(x), 2)
    assert isinstance(out, cupy.ndarray)
    check(torch.from_dlpack(out), F.group_norm(x.double(), 2), "float32")


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
@pytest.mark.parametrize("norm", ["group", "batch"])
def test_nan_inf_propagate_like_torch(norm, memory_format):
    """One NaN and one inf poison exactly the statistic sets torch's do, on every strategy (on
    chip, and the strided rows/columns passes with their partial merges)."""
    x = rand((2, 16, 6, 6), "float32")
    x[0, 0, 1, 1] = float("nan")
    x[1, 8, 0, 0] = float("inf")
    if memory_format == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    if norm == "group":
        out, ref = cupynorm.group_norm(x, 2), F.group_norm(x, 2)
    else:
        out = cupynorm.batch_norm(x, None, None, training=True)
        ref = F.batch_norm(x, None, None, training=True)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    finite = torch.isfinite(ref)
    assert finite.any()
    torch.testing.assert_close(out[finite], ref[finite])
