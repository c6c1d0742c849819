"""`profile kernels`: the kernels of one bench workload, torch.profiler: for torch eager,
torch.compile and cupynorm, each kernel's µs and launches per call and the wall time per call
(host included). The bench says how fast a row is; this says which kernels it is made of.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

from .common import ProfileError, format_table


def kernel_table(step: Callable[[], object], calls: int) -> tuple[float, list[list[Any]]]:
    """(wall µs per call, [[kernel, µs per launch, launches per call], ...] heaviest first)."""
    import torch

    from cupynorm.bench import timing

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / calls * 1e6
    with timing.cuda.profile() as profiler:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for name, us in timing.cuda.kernel_events(profiler):
        total[name] += us
        count[name] += 1
    rows = [
        [name[:100], total[name] / count[name], f"{count[name] / calls:g}"]
        for name in sorted(total, key=lambda k: -total[k])
    ]
    return wall, rows


def run(args: argparse.Namespace) -> int:
    """`profile kernels WORKLOAD`."""
    import torch

    from cupynorm.bench import models, workloads
    from cupynorm.bench import run as bench_run

    workload = workloads.WORKLOADS_BY_NAME.get(args.workload)
    if workload is None:
        names = ", ".join(workloads.WORKLOADS_BY_NAME)
        raise ProfileError(f"unknown kernel workload {args.workload!r}; choose from: {names}")
    dtype = getattr(torch, workload.dtype)
    torch.manual_seed(0)
    eager = models.build_module(workload.eager).to("cuda", dtype).train()
    ours = models.build_module(workload.cupynorm)
    ours.load_state_dict(eager.state_dict())
    ours = ours.to("cuda", dtype).train()
    inputs = bench_run._make_inputs(workload, args.quick, "cuda", seed=2)
    grad = torch.randn_like(inputs[0]) if workload.backward else None
    modules: dict[str, Any] = {"torch eager": eager}
    if not args.no_compile:
        modules["torch.compile"] = torch.compile(eager)
    modules["cupynorm"] = ours
    shapes = ", ".join(workloads.shape_text(s) for s in workload.shapes(args.quick))
    print(f"{workload.name}: {workload.title} ({shapes}); {torch.cuda.get_device_name()}")
    with torch.set_grad_enabled(workload.backward):
        for impl, module in modules.items():
            wall, rows = kernel_table(bench_run._make_step(module, inputs, grad), args.calls)
            kernel_us = sum(float(r[1]) * float(r[2]) for r in rows)
            print(f"\n== {impl}: {wall:.1f} µs per call (wall), kernels {kernel_us:.1f} µs")
            print(format_table(["kernel", "µs per launch", "launches per call"], rows))
    return 0
