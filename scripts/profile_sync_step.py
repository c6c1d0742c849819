"""Where a DDP training step with SyncBatchNorm goes, per rank: torch.profiler over a few steps
of torchvision resnet50 (bf16 autocast, channels_last) with torch's or cupynorm's SyncBatchNorm.

    torchrun --nproc-per-node 2 scripts/profile_sync_step.py [--variant cupynorm|torch|unsynced]

Each rank prints its step time, the GPU time of all kernels and of NCCL's kernels per step (an
NCCL kernel runs from when its rank launches it until every rank has: its time is mostly
waiting), and the top operations by GPU time and by host (self CPU) time. Uses the model and
step of scripts/bench_sync_batchnorm.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync_batchnorm import _step_of  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="cupynorm")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", timeout=timedelta(seconds=300), device_id=device)
    try:
        step = _step_of(args.variant, args, device, rank)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_ms = sum(e.device_time for e in kernels) / 1e3 / args.steps
        nccl_ms = sum(e.device_time for e in kernels if "nccl" in e.name.lower())
        nccl_ms /= 1e3 * args.steps
        averages = prof.key_averages()
        by_gpu = averages.table(sort_by="device_time_total", row_limit=12)
        by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=15)
        report = (
            f"rank {rank} {args.variant}: {wall_ms:.1f} ms/step, kernels {gpu_ms:.1f} ms/step "
            f"(NCCL {nccl_ms:.1f})\n{by_gpu}\n{by_cpu}"
        )
        for r in range(dist.get_world_size()):
            if r == rank:
                print(report, flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
