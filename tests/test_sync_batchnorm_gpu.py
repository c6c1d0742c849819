"""cupynorm.torch.SyncBatchNorm on CUDA: every case of tests/sync_batchnorm_workers.py on
cupynorm's kernels -- against float64 BatchNorm on the concatenated batch and against
torch.nn.SyncBatchNorm in the same setting (fp32, fp16, bf16, channels_last, uneven and empty
ranks, process-group subsets, one collective each way, DDP), with the allocator poisoned and
every recorded call replayed and compared. Twice: 2 processes with gloo sharing one GPU, and,
where there are two GPUs, 2 processes with NCCL, one GPU each (as ``torchrun`` runs them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import cuda_available
from sync_batchnorm_workers import CASES, run_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return run_cases(WORLD, tmp_path_factory.mktemp("sync_batchnorm_gpu"), device="cuda")


@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_batchnorm_two_processes_one_gpu(results, case):
    for rank, per_case in enumerate(results):
        assert per_case.get(case) == "ok", f"rank {rank}:\n{per_case.get(case)}"


@pytest.fixture(scope="module")
def nccl_results(tmp_path_factory):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"NCCL runs one process per GPU: needs {WORLD} GPUs")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    folder = tmp_path_factory.mktemp("sync_batchnorm_nccl")
    return run_cases(WORLD, folder, device="cuda", backend="nccl")


@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_batchnorm_two_gpus_nccl(nccl_results, case):
    for rank, per_case in enumerate(nccl_results):
        assert per_case.get(case) == "ok", f"rank {rank}:\n{per_case.get(case)}"
