"""cupynorm.torch.SyncBatchNorm on CUDA: every case of tests/sync_batchnorm_workers.py on
cupynorm's kernels -- against float64 BatchNorm on the concatenated batch and against
torch.nn.SyncBatchNorm in the same setting (fp32, fp16, bf16, channels_last, uneven and empty
ranks, process-group subsets, one collective each way, DDP), with the allocator poisoned and
every recorded call replayed and compared. With 2 processes with gloo sharing one GPU, and with
NCCL, one GPU per process (as ``torchrun`` runs them), on 2 and 4 GPUs where there are as many."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import cuda_available, once_per_run, poison_torch_allocator
from sync_batchnorm_workers import CASES, run_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

WORLD = 2
NCCL_WORLDS = (2, 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    # one spawn for every case (and, under pytest-xdist, for every worker)
    return once_per_run(
        tmp_path_factory,
        "sync_batchnorm_gpu",
        lambda folder: run_cases(WORLD, folder, device="cuda"),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_batchnorm_two_processes_one_gpu(results, case):
    for rank, per_case in enumerate(results):
        assert per_case.get(case) == "ok", f"rank {rank}:\n{per_case.get(case)}"


@pytest.fixture(scope="module", params=NCCL_WORLDS, ids=lambda world: f"{world}gpus")
def nccl_results(request, tmp_path_factory):
    world = request.param
    if torch.cuda.device_count() < world:
        pytest.skip(f"NCCL runs one process per GPU: needs {world} GPUs")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    return once_per_run(
        tmp_path_factory,
        f"sync_batchnorm_nccl{world}",
        lambda folder: run_cases(world, folder, device="cuda", backend="nccl"),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_batchnorm_nccl(nccl_results, case):
    for rank, per_case in enumerate(nccl_results):
        assert per_case.get(case) == "ok", f"rank {rank}:\n{per_case.get(case)}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("affine", [True, False])
def test_steps_around_the_collectives_match_float64_and_the_torch_operations(
    dtype, channels_last, affine
):
    """The CUDA calls around the collectives (each rank's row; the merge with the running
    update and the apply; the dx coefficients and the dx pass) for three ranks simulated in one
    process (the all_reduce is the sum of their rows), one of them empty, data offset by 1e3:
    the rows against float64 statistics, the rest against the same steps in torch operations
    (the CPU path) on the same values."""
    from cupynorm.torch import sync_batchnorm as sbn
    from cupynorm.torch._tensors import _host

    sizes, c, eps, momentum = (3, 0, 5), 7, 1e-5, 0.1
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    param = dtype if dtype == torch.float64 else torch.float32
    exact = dtype == torch.float64
    tol = {"rtol": 1e-12, "atol": 1e-12} if exact else {"rtol": 1e-5, "atol": 1e-5}
    # outputs in the input's dtype: bf16 rounds what both sides compute in float32
    out_tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else tol
    parts = [
        (torch.randn(n, c, 6, 5, device="cuda", dtype=torch.float64) * 2 + 1e3)
        .to(dtype)
        .contiguous(memory_format=fmt)
        for n in sizes
    ]
    poison_torch_allocator()
    rows = sum(_host().sync_batch_norm_rows(x, r, len(sizes))[0] for r, x in enumerate(parts))
    expected = torch.zeros(len(sizes), 2 * c + 1, dtype=torch.float64)
    for r, x in enumerate(parts):
        if x.numel():
            var, mean = torch.var_mean(x.double().cpu(), dim=(0, 2, 3), correction=0)
            expected[r] = torch.cat([torch.tensor([x.numel() / c]).double(), mean, var])
    torch.testing.assert_close(rows.cpu(), expected, **tol)

    weight = torch.randn(c, device="cuda", dtype=param) if affine else None
    bias = torch.randn(c, device="cuda", dtype=param) if affine else None
    cpu_weight = None if weight is None else weight.cpu()
    cpu_bias = None if bias is None else bias.cpu()
    running = [torch.rand(c, device="cuda", dtype=param) + 0.5 for _ in range(2)]
    ours_running = [t.clone() for t in running]
    theirs_running = [t.cpu() for t in running]
    for x in (parts[1], parts[0]):  # an empty rank's call too
        ours = sbn._normalized(x, rows, weight, bias, *ours_running, eps, momentum)
        args = (x.cpu(), rows.cpu(), cpu_weight, cpu_bias, *theirs_running, eps, momentum)
        theirs = sbn._normalized(*args)
        assert ours[0].shape == x.shape and ours[0].dtype == x.dtype
        assert ours[0].is_contiguous(memory_format=fmt)
        names = ("y", "mean", "rstd", "count")
        for name, a, b in zip(names, ours, theirs, strict=True):
            assert a.dtype == b.dtype, name
            close = out_tol if name == "y" else tol
            torch.testing.assert_close(a.cpu().reshape(b.shape), b, **close, msg=name)
        for a, b in zip(ours_running, theirs_running, strict=True):
            torch.testing.assert_close(a.cpu(), b, **tol)

    x = parts[0]
    _, mean, rstd, count = ours
    dy = torch.randn(x.shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    totals = torch.randn(2, c, device="cuda", dtype=rstd.dtype)
    dx = sbn._input_gradient(dy, x, mean, rstd, weight, totals, count)
    args = (dy.cpu(), x.cpu(), mean.cpu(), rstd.cpu(), cpu_weight, totals.cpu())
    want = sbn._input_gradient(*args, count.cpu().reshape(()))
    assert dx.dtype == x.dtype and dx.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(dx.cpu(), want, **out_tol)
