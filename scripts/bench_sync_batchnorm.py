"""DDP training step of torchvision's resnet50 (bf16 autocast, channels_last) with
torch.nn.SyncBatchNorm against cupynorm.torch.SyncBatchNorm, and the time per step spent in
SyncBatchNorm's collectives.

    torchrun --nproc-per-node N scripts/bench_sync_batchnorm.py        # N GPUs, NCCL
    python scripts/bench_sync_batchnorm.py                            # world size 1
    python scripts/bench_sync_batchnorm.py --spawn 2 --backend gloo   # 2 processes, one GPU

Each variant: ``convert_sync_batchnorm`` (torch's or cupynorm's) on a fresh resnet50 (same
seed), DistributedDataParallel, SGD; ``--warmup`` steps; then ``--rounds`` rounds that alternate
the variants, ``--steps`` steps each, every step timed with CUDA events (median over the
rounds). "collectives" times every ``torch.distributed`` collective called
from Python during the timed steps -- SyncBatchNorm's (torch's all_gather + all_reduce, or
cupynorm's two all_reduce), not DDP's gradient all-reduce, which runs in C++ -- between CUDA
events on the current stream around each call (gloo blocks the host: its copies are inside).
At world size 1 neither layer communicates (both are plain batch norm). Not part of
``python -m cupynorm bench``: it needs a process group and torchvision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single")


class _CollectiveTimer:
    """CUDA events around every collective called through torch.distributed while active."""

    def __init__(self) -> None:
        self.active, self.pairs, self.saved = False, [], {}

    def install(self) -> None:
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.saved[name] = original

            def timed(*args, _original=original, **kwargs):
                if not self.active:
                    return _original(*args, **kwargs)
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                result = _original(*args, **kwargs)
                end.record()
                self.pairs.append((start, end))
                return result

            setattr(dist, name, timed)

    def take(self) -> tuple[float, int]:
        """(ms, calls) since the last take (after a synchronize)."""
        ms = sum(start.elapsed_time(end) for start, end in self.pairs)
        calls = len(self.pairs)
        self.pairs = []
        return ms, calls


def _model(variant: str, device: torch.device, rank: int) -> torch.nn.Module:
    import torchvision

    import cupynorm.torch as cnt

    torch.manual_seed(0)
    model = torchvision.models.resnet50()
    if variant != "unsynced":  # unsynced: torch's BatchNorm2d, each rank its own statistics
        convert = {"torch": torch.nn.SyncBatchNorm, "cupynorm": cnt.SyncBatchNorm}[variant]
        model = convert.convert_sync_batchnorm(model)
    model = model.to(device, memory_format=torch.channels_last)
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def _step_of(variant, args, device, rank):
    """One training step of ``variant``'s model (built here) on this rank's fixed batch."""
    model = _model(variant, device, rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(args.batch, 3, 224, 224, device=device, generator=g)
    x = x.contiguous(memory_format=torch.channels_last)
    target = torch.randint(0, 1000, (args.batch,), device=device, generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    return step


def _timed(step, steps: int, timer) -> tuple[list[float], list[float], int]:
    """Per step: ms (CUDA events) and ms inside the collectives; collectives per step."""
    times, coll_ms, coll_calls = [], [], 0
    for _ in range(steps):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        timer.active = True
        start.record()
        step()
        end.record()
        timer.active = False
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        ms, calls = timer.take()
        coll_ms.append(ms)
        coll_calls = calls
    return times, coll_ms, coll_calls


def _run_variants(args, device, rank, timer) -> list[dict]:
    """Every variant's model built and warmed up, then timed in ``args.rounds`` rounds that
    alternate the variants (a host that slows down mid-run slows every variant alike)."""
    steps = {variant: _step_of(variant, args, device, rank) for variant in args.variants}
    times = {variant: ([], [], 0) for variant in args.variants}
    for _ in range(args.rounds):
        for variant, step in steps.items():
            t, c, calls = _timed(step, args.steps, timer)
            times[variant] = (times[variant][0] + t, times[variant][1] + c, calls)
    return [
        {
            "variant": variant,
            "ms_per_step": statistics.median(t),
            "collective_ms_per_step": statistics.median(c),
            "collectives_per_step": calls,
        }
        for variant, (t, c, calls) in times.items()
    ]


def _main(rank: int, world: int, local_rank: int, args, init_method: str | None) -> None:
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    kwargs = {"timeout": timedelta(seconds=300), "device_id": device}
    if args.backend == "gloo":
        kwargs.pop("device_id")
    if init_method is None:
        dist.init_process_group(args.backend, **kwargs)
    else:
        dist.init_process_group(
            args.backend, init_method=init_method, rank=rank, world_size=world, **kwargs
        )
    timer = _CollectiveTimer()
    timer.install()
    rows = []
    try:
        for row in _run_variants(args, device, rank, timer):
            # the slowest rank paces the step: report the maximum over ranks
            values = torch.tensor(
                [row["ms_per_step"], row["collective_ms_per_step"]], device=device
            )
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            row["ms_per_step"], row["collective_ms_per_step"] = values.tolist()
            row.update(world=world, backend=args.backend, batch_per_rank=args.batch)
            row["images_per_s"] = 1000.0 * args.batch * world / row["ms_per_step"]
            rows.append(row)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    print(
        f"resnet50 DDP training step, bf16 autocast, channels_last, {torch.cuda.get_device_name()}"
    )
    columns = ("variant", "world", "backend", "batch/rank", "ms/step", "images/s",
               "collectives ms/step", "calls/step")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        unsynced = r["variant"] == "unsynced"
        name = "torch BatchNorm2d, unsynced" if unsynced else f"{r['variant']} SyncBatchNorm"
        cells = (
            name, r["world"], r["backend"], r["batch_per_rank"],
            f"{r['ms_per_step']:.2f}", f"{r['images_per_s']:.0f}",
            f"{r['collective_ms_per_step']:.2f}", r["collectives_per_step"],
        )  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")
    ms = {r["variant"]: r["ms_per_step"] for r in rows}
    if "torch" in ms and "cupynorm" in ms:
        print(f"cupynorm / torch step time: {ms['cupynorm'] / ms['torch']:.3f}")
    if args.json:  # read by `python -m cupynorm report` (its two-GPU table)
        with open(args.json, "w") as f:
            json.dump({**_environment(world), "sync_batchnorm": rows}, f, indent=2)


def _environment(world: int) -> dict:
    """GPU, date and versions, under the keys of `python -m cupynorm bench --json`."""
    import datetime
    import platform

    import cupynorm

    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = None
    return {
        "tool": "scripts/bench_sync_batchnorm.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": f"{world}x {torch.cuda.get_device_name()}",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": cupy_version,
        "cupynorm": cupynorm.__version__,
        "python": platform.python_version(),
    }


def _spawned(rank: int, world: int, args, init_method: str) -> None:
    _main(rank, world, rank, args, init_method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="images per rank (default 64)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds alternating the variants")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--backend", default=None, help="nccl, or gloo (default where --spawn exceeds the GPUs)"
    )
    parser.add_argument("--spawn", type=int, default=0, help="start this many processes here")
    parser.add_argument(
        "--variants", nargs="+", default=["torch", "cupynorm"],
        help="torch, cupynorm (their SyncBatchNorm), unsynced (torch's BatchNorm2d: DDP alone)",
    )  # fmt: skip
    parser.add_argument(
        "--json", default=None, help="write the rows and the environment here (rank 0)"
    )
    args = parser.parse_args()
    if args.backend is None:  # NCCL takes one GPU per process: more processes than GPUs, gloo
        args.backend = "gloo" if args.spawn > torch.cuda.device_count() else "nccl"
    if "RANK" in os.environ:  # torchrun
        world = int(os.environ["WORLD_SIZE"])
        _main(int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]), args, None)
        return
    with tempfile.TemporaryDirectory() as folder:
        init_method = f"file://{folder}/store"
        if args.spawn > 1:
            torch.multiprocessing.spawn(
                _spawned, args=(args.spawn, args, init_method), nprocs=args.spawn
            )
        else:
            _main(0, 1, 0, args, init_method)


if __name__ == "__main__":
    main()
