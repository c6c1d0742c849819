"""Where a compiled model's training step spends its GPU time, torch against cupynorm (development
tool).

One model row of the bench (default resnet50 batch 256, bf16 autocast, channels_last) under
``torch.compile`` (default mode) with torch's norms, with them converted as the bench converts
them, and (for rows the bench runs through ``fuse``) with ``replace_norms``; each: step ms (CUDA
events), host us to issue a step with the device idle before it, cupynorm op calls per step,
graph breaks, kernels per step and the heaviest kernels by GPU time (torch profiler, summed over
names). Usage: python scripts/profile_compiled_model.py [--row NAME] [--steps N] [--top K]
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm.torch as cnt  # noqa: E402
from cupynorm.bench import models, timing, train, workloads  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--row", default="resnet50_b256_bf16_cl")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    workload = workloads.MODEL_WORKLOADS_BY_NAME[args.row]
    torch.manual_seed(0)
    base = models.build_model(workload)
    batch = train._make_batch(
        workload, workload.input_shape[0], "cuda", getattr(torch, workload.dtype), seed=0
    )
    variants = {"torch": lambda m: m, "cupynorm": lambda m: train._convert(m, workload)}
    if workload.convert == "fuse":
        variants["replace_norms"] = cnt.replace_norms
    for name, convert in variants.items():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = train._on_device(
            convert(copy.deepcopy(base)), workload, "cuda", getattr(torch, workload.dtype)
        )
        step = train.TrainStep(model, workload, *batch, forward=torch.compile(model))
        step()
        torch.cuda.synchronize()
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        times = timing.time_cuda_ms(step, reps=args.steps, warmup=3)
        torch.cuda.synchronize()
        issue = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            step()
            issue.append((time.perf_counter() - started) * 1e6)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as host:
            step()
            torch.cuda.synchronize()
        ops = [e for e in host.events() if e.name.startswith("cupynorm::")]
        with timing.cuda.profile() as profiler:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        events = timing.cuda.kernel_events(profiler)
        per_name: dict[str, float] = collections.defaultdict(float)
        counts: dict[str, int] = collections.defaultdict(int)
        for kernel, us in events:
            per_name[kernel] += us / 3
            counts[kernel] += 1
        total = sum(per_name.values()) / 1e3
        print(
            f"== {name}: {statistics.median(times):.2f} ms/step, issue "
            f"{statistics.median(issue):.0f} us/step, kernels {total:.2f} ms, "
            f"{len(events) // 3} kernels/step, graph breaks {breaks}, cupynorm op calls "
            f"{len(ops)} ({sum(e.cpu_time_total for e in ops):.0f} us of host under the profiler)"
        )
        if breaks:
            for reason, n in list(torch._dynamo.utils.counters["graph_break"].items())[:5]:
                print(f"   break x{n}: {reason[:150]}")
        for kernel, us in sorted(per_name.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"   {us / 1e3:7.3f} ms  x{counts[kernel] // 3:<4d} {kernel[:110]}")
        del step, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
