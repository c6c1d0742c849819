"""LayerNorm / RMSNorm over short rows on the GPU: cupynorm against torch eager (and, with
--compile, torch.compile), forward and forward + backward, per row length.

Rows of 96 to 1024 values are LayerNorm2d on channels_last data (ConvNeXt: 96 to 768 channels)
and the hidden sizes of small transformers. The time is the GPU kernel time per call from
torch.profiler (a call's host time, which autograd makes comparable to its kernels at these
sizes, does not blur it), over tensors four times the L2. Prints ms and the TB/s of the bytes
each direction must move (forward: read x, write y; forward + backward: that, then read x and
dy, write dx). With --autocast: float32 parameters and the calls under CUDA autocast (y and dy
in float32: forward 3, forward + backward 7 times x's bytes).

Usage: python scripts/profile_short_rows.py [--dtype bfloat16] [--compile] [--rms] [--autocast]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupynorm.torch as cnt  # noqa: E402
from cupynorm.bench import timing  # noqa: E402

ELEMENTS = 1 << 27  # 256 MiB of bf16 per tensor
CALLS = 5


def kernel_ms(fn) -> float:
    """GPU kernel time per call of ``fn``, summed over its kernels."""
    fn()
    torch.cuda.synchronize()
    with timing.cuda.profile() as profiler:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    return sum(us for _name, us in timing.cuda.kernel_events(profiler)) / CALLS / 1e3


def cases() -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, channels_last 2d) per case."""
    rows = [(f"rows x {d}", (ELEMENTS // d, d), False) for d in (96, 192, 384, 768, 1024)]
    two_d = [(f"2d cl {n}x96x56x56", (n, 96, 56, 56), True) for n in (64, 256)]
    return [*two_d, *rows]


def run_case(name: str, shape: tuple[int, ...], two_d: bool, args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    C = shape[1] if two_d else shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if two_d:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    pdtype = torch.float32 if args.autocast else dtype
    w = torch.randn(C, device="cuda", dtype=pdtype, requires_grad=True)
    b = None if args.rms else torch.randn(C, device="cuda", dtype=pdtype, requires_grad=True)
    leaves = [t for t in (x, w, b) if t is not None]

    def under(fn):  # the call under autocast when asked
        def call(x, w, b):
            context = torch.autocast("cuda", dtype) if args.autocast else contextlib.nullcontext()
            with context:
                return fn(x, w, b)

        return call

    @under
    def eager(x, w, b):
        if two_d:  # timm's LayerNorm2d: the norm of the channels-last view
            t = x.permute(0, 2, 3, 1)
            t = F.rms_norm(t, (C,), w) if args.rms else F.layer_norm(t, (C,), w, b)
            return t.permute(0, 3, 1, 2)
        return F.rms_norm(x, (C,), w) if args.rms else F.layer_norm(x, (C,), w, b)

    @under
    def ours(x, w, b):
        if two_d:
            return cnt.rms_norm2d(x, w) if args.rms else cnt.layer_norm2d(x, w, b)
        return cnt.rms_norm(x, (C,), w) if args.rms else cnt.layer_norm(x, (C,), w, b)

    fns = {"eager": eager, "cupynorm": ours}
    if args.compile:
        fns["compile"] = torch.compile(eager)
    y = ours(x, w, b)
    err = (y.float() - eager(x, w, b).float()).abs().max().item()
    dy = torch.randn_like(y)
    nbytes = x.numel() * x.element_size()
    widen = y.element_size() // x.element_size()  # y and dy float32 beside half x: 2

    def forward(fn):
        with torch.no_grad():
            fn(x, w, b)

    def training(fn):
        torch.autograd.grad(fn(x, w, b), leaves, dy)

    moves = (1 + widen, 3 + 2 * widen)  # forward: x, y; backward: x, dy, dx
    for label, moved, step in zip(("fwd", "fwd+bwd"), moves, (forward, training), strict=True):
        ms = {key: kernel_ms(lambda fn=fn, step=step: step(fn)) for key, fn in fns.items()}
        tbs = moved * nbytes / ms["cupynorm"] / 1e9
        comp = f"{ms['compile']:8.4f}" if "compile" in ms else f"{'-':>8}"
        ours_ms = ms["cupynorm"]
        print(f"{name:>22} {label:>8} {ms['eager']:8.4f} {comp} {ours_ms:9.4f} {tbs:6.2f}")
    print(f"{'':>22} max |ours - eager| {err:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--rms", action="store_true")
    parser.add_argument("--autocast", action="store_true", help="float32 parameters, autocast")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.dtype}  ", end="")
    print("RMSNorm" if args.rms else "LayerNorm", "under autocast" if args.autocast else "", end="")
    print(" (GPU kernel ms per call)")
    print(f"{'case':>22} {'pass':>8} {'eager':>8} {'compile':>8} {'cupynorm':>9} {'TB/s':>6}")
    for name, shape, two_d in cases():
        run_case(name, shape, two_d, args)


if __name__ == "__main__":
    main()
