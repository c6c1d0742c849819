"""Quick timing of the three seed forward workloads: torch eager, torch.compile, cupynorm.

CUDA events around each call, L2 flushed before each repetition, median of the repetitions.
Prints ms and TB/s (one read + one write of the input) and checks cupynorm against eager first.
Usage: python scripts/quick_timing.py [--scale 0.25] [--no-compile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm  # noqa: E402


def time_ms(fn, reps: int = 20) -> float:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (time_ms(lambda: b.copy_(a)) * 1e-3) / 1e12


def measure(name, shape, eager, ours, compile_too: bool):
    x = torch.randn(shape, device="cuda")
    err = (ours(x) - eager(x)).abs().max().item()
    if not err < 1e-3:
        print(f"{name}: cupynorm differs from eager by {err}", file=sys.stderr)
        return None
    t_eager = time_ms(lambda: eager(x))
    t_compile = float("nan")
    if compile_too:
        compiled = torch.compile(eager)
        t_compile = time_ms(lambda: compiled(x))
    t_ours = time_ms(lambda: ours(x))
    tbs = 2 * x.numel() * x.element_size() / (t_ours * 1e-3) / 1e12
    return name, shape, t_eager, t_compile, t_ours, tbs, err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the batch size")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {bw:.2f} TB/s")
    n1, n2 = max(1, int(112 * args.scale)), max(1, int(64 * args.scale))
    workloads = [
        (
            "InstanceNorm2d fp32",
            (n1, 64, 512, 512),
            lambda x: F.instance_norm(x),
            lambda x: cupynorm.instance_norm(x),
        ),
        (
            "GroupNorm(8) fp32",
            (n1, 64, 512, 512),
            lambda x: F.group_norm(x, 8),
            lambda x: cupynorm.group_norm(x, 8),
        ),
        (
            "BatchNorm2d train fp32",
            (n2, 64, 512, 512),
            lambda x: F.batch_norm(x, None, None, training=True),
            lambda x: cupynorm.batch_norm(x, None, None, training=True),
        ),
    ]
    rows = []
    for name, shape, eager, ours in workloads:
        row = measure(name, shape, eager, ours, compile_too=not args.no_compile)
        if row is None:
            return 1
        rows.append(row)
        torch.cuda.empty_cache()
    print(
        "| workload | shape | eager ms | compile ms | cupynorm ms | cupynorm TB/s | "
        "% copy | max err |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, shape, te, tc, to, tbs, err in rows:
        print(
            f"| {name} | {'x'.join(map(str, shape))} | {te:.3f} | {tc:.3f} | {to:.3f} | "
            f"{tbs:.2f} | {100 * tbs / bw:.0f}% | {err:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
