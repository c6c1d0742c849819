"""GroupNorm (+ SiLU, + a time embedding's shift) under CUDA autocast on the GPU: cupynorm against
torch eager, forward and forward + backward, on the UNet's GroupNorm(32) shapes.

Under autocast torch runs group_norm (and the SiLU after it) in float32: a float32 copy of the
half-precision input, the norm, float32 y; the backward's float32 dx is copied back to the
input's dtype. The time is the GPU kernel time per call from torch.profiler, every kernel of the
call counted (the copies included). TB/s: of the bytes a call must move at least -- forward x
(half) and y (float32), 6 bytes per element; forward + backward that, then x, dy (float32) and
dx (half), 14 bytes.

Usage: python scripts/profile_group_norm_autocast.py [--dtype float16] [--batch 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_short_rows import kernel_ms  # noqa: E402 - GPU kernel ms per call

import cupynorm.torch as cnt  # noqa: E402

GROUPS = 32


def run_case(shape, fmt: str, kind: str, dtype: torch.dtype) -> None:
    N, C = shape[:2]
    memory_format = torch.channels_last if fmt == "cl" else torch.contiguous_format
    x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=memory_format)
    x.requires_grad_()
    w = (torch.rand(C, device="cuda") + 0.5).requires_grad_()
    b = torch.randn(C, device="cuda").requires_grad_()
    shift = torch.randn(N, C, device="cuda", dtype=dtype) if kind == "silu+shift" else None
    leaves = [x, w, b]

    def eager(x, w, b):
        with torch.autocast("cuda", dtype):
            t = x if shift is None else x + shift[:, :, None, None]
            y = F.group_norm(t, GROUPS, w, b)
            return y if kind == "plain" else F.silu(y)

    def ours(x, w, b):
        with torch.autocast("cuda", dtype):
            if kind == "plain":
                return cnt.group_norm(x, GROUPS, w, b)
            return cnt.group_norm_act(x, GROUPS, w, b, shift=shift)

    y, ref = ours(x, w, b), eager(x, w, b)
    err = (y - ref).abs().max().item()
    dy = torch.randn_like(y)
    elements = x.numel()

    def forward(fn):
        with torch.no_grad():
            fn(x, w, b)

    def training(fn):
        torch.autograd.grad(fn(x, w, b), leaves, dy)

    name = f"{'x'.join(map(str, shape))} {fmt} {kind}"
    for label, moved, step in (("fwd", 6, forward), ("fwd+bwd", 14, training)):
        ms = {key: kernel_ms(lambda fn=fn, step=step: step(fn)) for key, fn in (
            ("eager", eager), ("cupynorm", ours))}  # fmt: skip
        tbs = moved * elements / ms["cupynorm"] / 1e9
        print(f"{name:>34} {label:>8} {ms['eager']:8.4f} {ms['cupynorm']:9.4f} {tbs:6.2f}")
    print(f"{'':>34} y {y.dtype}, max |ours - eager| {err:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    n = args.batch
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  GroupNorm({GROUPS}) under "
          f"{args.dtype} autocast, float32 parameters (GPU kernel ms per call)")  # fmt: skip
    print(f"{'case':>34} {'pass':>8} {'eager':>8} {'cupynorm':>9} {'TB/s':>6}")
    for shape in ((n, 320, 64, 64), (n, 640, 32, 32), (n, 1280, 16, 16)):
        for fmt in ("cl", "nchw"):
            for kind in ("plain", "silu", "silu+shift"):
                if kind == "silu+shift" and shape[1] != 320:
                    continue
                run_case(shape, fmt, kind, dtype)


if __name__ == "__main__":
    main()
