"""Reliability on the GPU: huge tensors, hostile numbers, odd strides, streams, threads, devices,
reproducibility and randomized shapes (hypothesis).

| case | expectation |
|---|---|
| > 2**31 elements (fp16): GN, IN, BN forward; GN backward | chunked torch reference |
| one GroupNorm segment of > 2**31 elements | equals a chunked float64 reference |
| offset data, mean 1e4: fp32 mean and variance | within 1e-6 relative of float64 |
| offset data, mean 1e6 | error bounded by the fp32 mean's rounding, like torch |
| zero-size dims in every position, forward and backward | empty results, no launch, no error |
| constant slices (zero variance) | output == bias exactly, no NaN |
| fp16 values near 6e4 | finite output (statistics in fp32) |
| channels with scales 1e-3 .. 1e3 | each channel normalized to its own rounding |
| negative strides, sliced and transposed inputs | correct (copied to contiguous) |
| a CuPy stream with work queued before the call | correct |
| two Python threads on two torch streams | both correct |
| tensors on cuda:1 (two GPUs) | run on GPU 1, correct |
| same input 10 times and on another stream | bitwise identical outputs and gradients |
| random shapes / groups / dtypes / layouts | equal torch within the dtype's rounding |
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import cuda_available
from hypothesis import given, settings
from hypothesis import strategies as st

import cupynorm
from cupynorm import _ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

BIG = (3, 16, 8192, 5462)  # 2_147_745_792 elements > 2**31


def _free_gb() -> float:
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30


@pytest.mark.large
def test_more_than_2_31_elements_forward_and_backward():
    if _free_gb() < 40:
        pytest.skip("needs about 40 GB of free GPU memory")
    x = torch.randn(BIG, device="cuda", dtype=torch.float16)
    assert x.numel() > 2**31
    w = torch.rand(16, device="cuda", dtype=torch.float16) + 0.5
    for groups in (4, 16):
        y = cupynorm.group_norm(x, groups, w)
        for n in range(BIG[0]):  # chunked reference, one sample at a time in fp32
            ref = F.group_norm(x[n : n + 1].float(), groups, w.float())
            err = (y[n : n + 1].float() - ref).abs().max().item()
            assert err < 8e-3, (groups, n, err)
        del y
    rm, rv = torch.zeros(16, device="cuda"), torch.ones(16, device="cuda")
    y = cupynorm.batch_norm(x, rm, rv, training=True)
    mean = torch.stack([x[:, c].float().mean() for c in range(16)])
    torch.testing.assert_close(rm, 0.1 * mean, atol=1e-5, rtol=1e-4)
    for c in (0, 15):
        xc = x[:, c].float()
        ref = (xc - xc.mean()) / torch.sqrt(xc.var(unbiased=False) + 1e-5)
        assert (y[:, c].float() - ref).abs().max().item() < 8e-3
    del y
    dy = torch.randn_like(x)
    _, m, r = _ops.group_norm_fwd(x, 4, None, None, 1e-5)
    dx, _, db = _ops.group_norm_bwd(dy, x, m, r, None, 4, (True, False, True))
    for n in (0, BIG[0] - 1):
        xs = x[n : n + 1].float().requires_grad_()
        F.group_norm(xs, 4).backward(dy[n : n + 1].float())
        err = (dx[n : n + 1].float() - xs.grad).abs().max().item()
        assert err < 2e-2 * xs.grad.abs().max().item(), err
    torch.testing.assert_close(db, dy.float().sum((0, 2, 3)), atol=1.0, rtol=1e-3)


@pytest.mark.large
def test_one_segment_longer_than_2_31_elements():
    if _free_gb() < 30:
        pytest.skip("needs about 30 GB of free GPU memory")
    x = torch.rand((1, 4, 23171, 23171), device="cuda", dtype=torch.float16)
    assert x.numel() > 2**31
    y = cupynorm.group_norm(x, 1)
    s1 = sum(x[0, c].double().sum() for c in range(4))
    mean = s1 / x.numel()
    var = sum(((x[0, c].double() - mean) ** 2).sum() for c in range(4)) / x.numel()
    for c in (0, 3):
        ref = (x[0, c].double() - mean) / torch.sqrt(var + 1e-5)
        assert (y[0, c].double() - ref).abs().max().item() < 8e-3


@pytest.mark.parametrize(
    "shape,groups,memory_format",
    [
        ((4, 6, 33, 35), 6, "contiguous"),  # one CTA per plane
        ((2, 4, 512, 512), 4, "contiguous"),  # teams of 16
        ((2, 8, 1024, 1024), 1, "contiguous"),  # strided rows (32 MiB segments)
        ((4, 12, 33, 35), 3, "channels_last"),  # strided columns
    ],
)
def test_statistics_relative_error_offset_1e4(shape, groups, memory_format):
    """fp32 mean and variance within 1e-6 (relative) of float64 ones on data of mean 1e4, std 1."""
    x = torch.randn(shape, device="cuda", dtype=torch.float64).add(1e4).float()
    if memory_format == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    _, mean, _, var = _ops.group_norm_fwd(x, groups, None, None, 1e-5, want_var=True)
    xd = x.double().reshape(shape[0], groups, -1)
    ref_mean, ref_var = xd.mean(-1), xd.var(-1, unbiased=False)
    assert ((mean.double() - ref_mean).abs() / ref_mean.abs()).max().item() <= 1e-6
    assert ((var.double() - ref_var).abs() / ref_var).max().item() <= 1e-6
    if groups == shape[1] and memory_format == "contiguous":  # BatchNorm statistics too
        _, bm, br = _ops.batch_norm_fwd(x, None, None, None, None, True, 0.1, 1e-5)
        xc = x.double().transpose(0, 1).reshape(shape[1], -1)
        assert ((bm.double() - xc.mean(-1)).abs() / xc.mean(-1)).max().item() <= 1e-6
        bvar = 1 / br.double() ** 2 - 1e-5
        assert ((bvar - xc.var(-1, unbiased=False)).abs()).max().item() <= 1e-5


@pytest.mark.parametrize("shape", [(0, 4, 5, 5), (2, 0, 5, 5), (2, 4, 0, 5), (2, 4, 5, 0), (0, 3)])
def test_zero_size_in_every_position(shape):
    x = torch.randn(shape, device="cuda")
    C = shape[1]
    w = torch.ones(C, device="cuda")
    assert cupynorm.group_norm(x, 1 if C == 0 else 2 if C % 2 == 0 else 1, w, w).shape == shape
    assert cupynorm.batch_norm(x, None, None, w, w, training=True).shape == shape
    rm, rv = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")
    assert cupynorm.batch_norm(x, rm, rv, w, w, training=False).shape == shape
    assert torch.equal(rm, torch.zeros(C, device="cuda"))  # eval never writes running stats
    xr = torch.randn(shape, device="cuda", requires_grad=True)
    out = cupynorm.group_norm(xr, 1 if C == 0 else 2 if C % 2 == 0 else 1)
    out.sum().backward()
    assert xr.grad.shape == shape


def test_offset_1e6():
    x = torch.randn(4, 8, 33, 35, device="cuda") + 1e6
    ref = F.group_norm(x.double(), 4)
    ours = (cupynorm.group_norm(x, 4).double() - ref).abs().max().item()
    theirs = (F.group_norm(x, 4).double() - ref).abs().max().item()
    assert ours <= max(4 * theirs, 8 * 2.0**-24 * 1e6), (ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 6, 5, 7), (2, 4, 512, 512)], ids=["block", "team"])
def test_constant_slices_give_bias(dtype, shape):
    x = torch.full(shape, 3.25, device="cuda", dtype=dtype)
    b = torch.randn(shape[1], device="cuda", dtype=dtype)
    w = torch.rand(shape[1], device="cuda", dtype=dtype) + 0.5
    for out in (
        cupynorm.group_norm(x, 2, w, b),
        cupynorm.instance_norm(x, weight=w, bias=b),
        cupynorm.batch_norm(x, None, None, w, b, training=True),
    ):
        assert not torch.isnan(out).any()
        assert torch.equal(out, b.view(1, -1, *[1] * (len(shape) - 2)).expand(shape))


def test_fp16_near_max_does_not_overflow():
    x = (torch.rand(4, 6, 17, 19, device="cuda") * 2 - 1) * 6.0e4
    x = x.half()
    for out in (
        cupynorm.group_norm(x, 3),
        cupynorm.batch_norm(x, None, None, training=True),
        cupynorm.group_norm(x.to(memory_format=torch.channels_last), 3),
    ):
        assert torch.isfinite(out).all()
    torch.testing.assert_close(
        cupynorm.group_norm(x, 3).float(), F.group_norm(x.float(), 3), atol=4e-3, rtol=4e-3
    )


def test_mixed_scales_across_channels():
    scales = torch.logspace(-3, 3, 8, device="cuda").view(1, 8, 1, 1)
    x = torch.randn(4, 8, 21, 23, device="cuda", dtype=torch.float64).mul(scales).float()
    for out, ref in (
        (cupynorm.instance_norm(x), F.instance_norm(x.double())),
        (
            cupynorm.batch_norm(x, None, None, training=True),
            F.batch_norm(x.double(), None, None, training=True),
        ),
    ):
        torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=3e-5)


def test_negative_and_odd_strides_cupy():
    import cupy

    base = cupy.random.standard_normal((4, 6, 10, 12), dtype=cupy.float32)
    for view in (base[::-1], base[:, ::-1, :, ::-2], base.transpose(0, 1, 3, 2), base[:, 1:5]):
        out = cupynorm.group_norm(view, 2)
        ref = F.group_norm(torch.from_dlpack(cupy.ascontiguousarray(view)).double(), 2)
        torch.testing.assert_close(torch.from_dlpack(out).double(), ref, atol=3e-5, rtol=3e-5)


def test_cupy_stream_with_queued_work():
    import cupy

    x = cupy.random.standard_normal((8, 16, 64, 64), dtype=cupy.float32)
    ref = F.group_norm(torch.from_dlpack(x).double(), 4)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        big = cupy.random.standard_normal(1 << 26, dtype=cupy.float32)
        for _ in range(5):
            big = big * 1.0001
        y = x * 2 - x  # produced on this stream
        out = cupynorm.group_norm(y, 4)
    stream.synchronize()
    torch.testing.assert_close(torch.from_dlpack(out).double(), ref, atol=3e-5, rtol=3e-5)


def test_two_threads_two_streams():
    inputs = [torch.randn(8, 32, 48, 48, device="cuda") + i for i in range(2)]
    refs = [F.group_norm(x.double(), 8) for x in inputs]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(20):
                    results[i] = cupynorm.group_norm(inputs[i], 8)
            stream.synchronize()
        except BaseException as error:  # reported in the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        torch.testing.assert_close(results[i].double(), refs[i], atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("api", ["torch", "host"])
def test_thread_that_never_used_cuda(api):
    """A new thread has no current CUDA context until something makes one: the first launch
    there (a replayed program too) must not fail with an invalid context."""
    x = torch.randn(3, 10, 19, 23, device="cuda")
    ref = F.group_norm(x.double(), 5)
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            if api == "torch":
                outcome["y"] = cupynorm.group_norm(x, 5)
            else:  # the host layer alone: no torch call makes the context current first
                outcome["y"] = _ops.group_norm_fwd(x, 5, None, None, 1e-5)[0]
            torch.cuda.current_stream().synchronize()
        except BaseException as error:  # reported in the main thread
            outcome["error"] = error

    for _ in range(2):  # the first call records, the second replays
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        assert "error" not in outcome, outcome.get("error")
        torch.testing.assert_close(outcome.pop("y").double(), ref, atol=3e-5, rtol=3e-5)


def test_second_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x = torch.randn(4, 8, 30, 31, device="cuda:1")
    w = torch.rand(8, device="cuda:1")
    rm, rv = torch.zeros(8, device="cuda:1"), torch.ones(8, device="cuda:1")
    with torch.cuda.device(0):  # the current device is another one
        y = cupynorm.group_norm(x, 4, w)
        z = cupynorm.batch_norm(x, rm, rv, w, None, training=True)
    assert y.device == x.device and z.device == x.device
    torch.testing.assert_close(y, F.group_norm(x, 4, w), atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(
        z, F.batch_norm(x, None, None, w, None, training=True), atol=3e-5, rtol=3e-5
    )
    with pytest.raises(ValueError, match="cuda:0 but the input is on cuda:1"):
        cupynorm.group_norm(x, 4, torch.ones(8, device="cuda:0"))


def test_bitwise_reproducible_across_runs_and_streams():
    x = torch.randn(8, 64, 130, 131, device="cuda")
    xl = x.to(memory_format=torch.channels_last)
    first = [
        cupynorm.group_norm(x, 8),
        cupynorm.instance_norm(x),
        cupynorm.batch_norm(x, None, None, training=True),
        cupynorm.batch_norm(xl, None, None, training=True),
        cupynorm.group_norm(xl, 8),
    ]
    side = torch.cuda.Stream()
    for i in range(10):
        with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
            again = [
                cupynorm.group_norm(x, 8),
                cupynorm.instance_norm(x),
                cupynorm.batch_norm(x, None, None, training=True),
                cupynorm.batch_norm(xl, None, None, training=True),
                cupynorm.group_norm(xl, 8),
            ]
        torch.cuda.synchronize()
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5),
    groups=st.integers(1, 4),
    per_group=st.integers(1, 5),
    spatial=st.lists(st.integers(1, 40), min_size=0, max_size=3),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    channels_last=st.booleans(),
    affine=st.booleans(),
)
def test_property_group_and_batch_norm(n, groups, per_group, spatial, dtype, channels_last, affine):
    shape = (n, groups * per_group, *spatial)
    dt = getattr(torch, dtype)
    x = torch.randn(shape, device="cuda", dtype=torch.float64).to(dt)
    if channels_last and len(shape) in (4, 5):
        x = x.to(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
    C = shape[1]
    w = (torch.rand(C, device="cuda") + 0.5).to(dt) if affine else None
    b = torch.randn(C, device="cuda").to(dt) if affine else None
    tol = {"float32": 3e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
    wd = None if w is None else w.double()
    bd = None if b is None else b.double()
    if x.numel() > groups:  # torch needs more than one value per group
        out = cupynorm.group_norm(x, groups, w, b)
        ref = F.group_norm(x.double(), groups, wd, bd)
        torch.testing.assert_close(out.double(), ref, atol=tol * 4, rtol=tol)
    if x.numel() // C > 1:
        out = cupynorm.batch_norm(x, None, None, w, b, training=True)
        ref = F.batch_norm(x.double(), None, None, wd, bd, training=True)
        torch.testing.assert_close(out.double(), ref, atol=tol * 4, rtol=tol)
