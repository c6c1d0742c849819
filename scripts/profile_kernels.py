"""Per-kernel GPU time of cupynorm's module calls (development tool, torch.profiler).

For each case, runs the cupynorm.torch module (forward, or forward + backward) a few times under
torch.profiler and prints every CUDA kernel's average time, plus the wall time per call. Cases
named "torch ..." run torch's own module on the same shape, for comparison.
Usage: python scripts/profile_kernels.py [substring of case names ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm.torch as cnt  # noqa: E402

_WANTED: list[str] = []


def case(name, module, shape, dtype, channels_last=False, backward=False, extra=None):
    if _WANTED and not any(w in name for w in _WANTED):
        return
    x = torch.rand(shape, device="cuda", dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    module = module.to("cuda", dtype)
    args = (x,) if extra is None else (x, extra.to("cuda", dtype))
    x.requires_grad_(backward)
    dy = torch.rand_like(x) if backward else None
    params = [p for p in module.parameters() if p.requires_grad]

    def step():
        out = module(*args)
        if backward:
            torch.autograd.grad(out, [x, *params], grad_outputs=dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 20 * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    print(f"== {name}: {wall:.1f} us per call (wall)")
    for event in prof.key_averages():
        if event.device_time_total > 0:
            print(
                f"   {event.device_time_total / event.count:9.1f} us x{event.count // 10:<3d}"
                f" {event.key[:90]}"
            )


def main() -> None:
    _WANTED.extend(sys.argv[1:])
    for kind, ours, theirs in (
        ("LayerNorm(4096)", cnt.LayerNorm(4096), torch.nn.LayerNorm(4096)),
        ("RMSNorm(4096)", cnt.RMSNorm(4096), torch.nn.RMSNorm(4096)),
        ("RMSNorm(2048)", cnt.RMSNorm(2048), torch.nn.RMSNorm(2048)),
    ):
        for backward in (False, True):
            what = "fwd+bwd" if backward else "fwd"
            for label, module in (("cupynorm", ours), ("torch", theirs)):
                D = module.normalized_shape[0]
                case(
                    f"{label} {kind} bf16 8192x{D} {what}",
                    module,
                    (8192, D),
                    torch.bfloat16,
                    backward=backward,
                )
    case(
        "GroupNorm(32,320) fp16 16x320x64x64 fwd",
        cnt.GroupNorm(32, 320),
        (16, 320, 64, 64),
        torch.float16,
    )
    case(
        "GroupNorm(32,320) fp16 channels_last fwd",
        cnt.GroupNorm(32, 320),
        (16, 320, 64, 64),
        torch.float16,
        channels_last=True,
    )
    case(
        "BatchNorm2d(64) fp16 channels_last 256x64x112x112 fwd",
        cnt.BatchNorm2d(64),
        (256, 64, 112, 112),
        torch.float16,
        channels_last=True,
    )
    case(
        "GroupNorm(32,320) fp16 fwd+bwd",
        cnt.GroupNorm(32, 320),
        (16, 320, 64, 64),
        torch.float16,
        backward=True,
    )
    case(
        "InstanceNorm2d(64, affine) fp32 32x64x256x256 fwd+bwd",
        cnt.InstanceNorm2d(64, affine=True),
        (32, 64, 256, 256),
        torch.float32,
        backward=True,
    )
    case(
        "BatchNorm2d(64) fp32 32x64x256x256 fwd+bwd",
        cnt.BatchNorm2d(64),
        (32, 64, 256, 256),
        torch.float32,
        backward=True,
    )
    case(
        "RowNormAddMul fp32 1024x8192",
        cnt.RowNormAddMul(),
        (1024, 8192),
        torch.float32,
        extra=torch.rand(1024, 8192),
    )


if __name__ == "__main__":
    main()
