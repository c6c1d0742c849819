"""GPU time of BatchNorm training on channels_last, the single launch against the split passes,
on the BatchNorm inputs of a torchvision resnet50 at one batch size (bf16, fp32 parameters).

Each measurement is 20 calls captured in one CUDA graph and replayed (no host time in it), CUDA
events around the replay, median of 7; forward alone and forward + backward. The single launch is
forced for every size here (MAX_BYTES lifted) to find where it stops paying, and the forward +
backward is also timed as cupynorm chooses by default (``_single.enabled = None``).

Usage: python scripts/profile_single_launch.py [--batch N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupynorm import _launch, _ops, _plan, _single  # noqa: E402

# (channels, spatial) of resnet50's BatchNorm inputs, each with how many layers have it
LAYERS = [
    (64, 112, 1), (64, 56, 6), (256, 56, 4), (128, 56, 1), (128, 28, 7), (512, 28, 5),
    (256, 28, 1), (256, 14, 11), (1024, 14, 7), (512, 14, 1), (512, 7, 5), (2048, 7, 4),
]  # fmt: skip
CALLS = 20


def graphed_us(fn) -> float:
    fn()  # records the calls
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def measure(batch: int, c: int, s: int) -> list[float]:
    """[forward split, forward single, fwd+bwd split, fwd+bwd single, fwd+bwd as cupynorm
    chooses by default] us per call."""
    x = torch.randn(batch, c, s, s, device="cuda", dtype=torch.bfloat16)
    x = x.to(memory_format=torch.channels_last)
    dy = torch.randn_like(x)
    w, b = torch.rand(c, device="cuda") + 0.5, torch.rand(c, device="cuda")
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")

    def forward():
        return _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)

    def step():
        _, m, r = forward()
        _ops.batch_norm_bwd(dy, x, m, r, w, True, (True, True, True))

    row = []
    for fn in (forward, step):
        for single in (False, True):
            _single.enable(single)
            row.append(graphed_us(fn))
    _single.enable(None)  # the default: the single launch where it measured faster
    row.append(graphed_us(step))
    return row, single_grid(x, w, batch * s * s, c)


def single_grid(x, w, rows: int, channels: int) -> int:
    """CTAs of the single-launch forward (one wave of its resident CTAs, as planned)."""
    call = _launch._Call(x, w)

    def smem_of(threads: int, vec: int, staged: bool) -> int:
        return _plan.stats_cols_smem(threads, vec, staged, 4)

    kernel = "single_launch_batch_norm_fwd_cols"
    plan, _smem = _single._grid(call, kernel, rows, channels, call.aligned(x), smem_of)
    return plan.ctas_per_sample


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    _single.MAX_BYTES = 1 << 40
    print(f"resnet50 BatchNorm inputs, batch {args.batch}, bf16 channels_last, fp32 parameters;")
    print("us per call (graphed): forward split / single, forward+backward split / single /")
    print("as cupynorm chooses by default")
    totals = [0.0] * 5
    for c, s, layers in LAYERS:
        row, grid = measure(args.batch, c, s)
        for i in range(5):
            totals[i] += row[i] * layers
        mb = args.batch * c * s * s * 2 / 1e6
        print(f"C={c:5d} {s:3d}x{s:<3d} {mb:6.1f} MB x{layers:2d}: fwd {row[0]:7.1f} / "
              f"{row[1]:7.1f}   fwd+bwd {row[2]:7.1f} / {row[3]:7.1f} / {row[4]:7.1f}   "
              f"CTAs {grid}")  # fmt: skip
    print(f"all 53 layers, ms per step: fwd {totals[0] / 1e3:.3f} / {totals[1] / 1e3:.3f}, "
          f"fwd+bwd {totals[2] / 1e3:.3f} / {totals[3] / 1e3:.3f} / "
          f"{totals[4] / 1e3:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
