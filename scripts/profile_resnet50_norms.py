"""GPU time of resnet50's norm layers as ``fuse`` runs them, against torch's (development tool).

Every BatchNorm input of a torchvision resnet50 at one batch size (bf16 channels_last, fp32
parameters, as under bf16 autocast), in the form it takes after ``cupynorm.torch.fuse``: the
BatchNorm alone (the downsample branches), + ReLU, or + residual add + ReLU (the last BatchNorm of
each bottleneck). Forward + backward, 20 calls captured in one CUDA graph (no host time), CUDA
events around the replay, median of 7; torch's side is F.batch_norm, the add and the ReLU as
resnet50 runs them. Prints us per call per layer form and ms per training step over the model.

``--no-single`` turns the single-launch family off (the split passes only), to set beside the
default choice; ``--no-mask`` makes the + residual add + ReLU layers' backward read the residual
instead of the ReLU mask their forward keeps (as ``BatchNormAct2d`` runs them by default).

Usage: python scripts/profile_resnet50_norms.py [--batch N] [--no-single] [--no-mask]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupynorm import _ops, _single  # noqa: E402

# the same graphed timing (20 calls in one CUDA graph, median of 7) as the single-launch profile
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_single_launch import graphed_us  # noqa: E402

# (channels, spatial, layers, form) of resnet50's BatchNorm inputs; form: "bn" (downsample and
# no activation), "relu", "add_relu" (bn3 of a bottleneck)
LAYERS = [
    (64, 112, 1, "relu"), (64, 56, 6, "relu"), (256, 56, 3, "add_relu"), (256, 56, 1, "bn"),
    (128, 56, 1, "relu"), (128, 28, 7, "relu"), (512, 28, 4, "add_relu"), (512, 28, 1, "bn"),
    (256, 28, 1, "relu"), (256, 14, 11, "relu"), (1024, 14, 6, "add_relu"), (1024, 14, 1, "bn"),
    (512, 14, 1, "relu"), (512, 7, 5, "relu"), (2048, 7, 3, "add_relu"), (2048, 7, 1, "bn"),
]  # fmt: skip


def measure(batch: int, c: int, s: int, form: str, mask: bool = True) -> tuple[float, float]:
    """(cupynorm, torch) us per forward + backward."""
    x = torch.randn(batch, c, s, s, device="cuda", dtype=torch.bfloat16)
    x = x.to(memory_format=torch.channels_last)
    z = torch.randn_like(x) if form == "add_relu" else None
    dy = torch.randn_like(x)
    w, b = torch.rand(c, device="cuda") + 0.5, torch.rand(c, device="cuda")
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    act = "identity" if form == "bn" else "relu"

    keep = mask and form == "add_relu"

    def ours():
        _, m, r, *kept = _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5, z, act, None, keep)
        if form == "bn":
            _ops.batch_norm_bwd(dy, x, m, r, w, True, (True, True, True))
        else:
            needs = (True, True, True, z is not None)
            relu_mask = kept[0] if kept else None
            residual = None if relu_mask is not None else z
            _ops.batch_norm_act_bwd(dy, x, m, r, w, True, needs, residual, b, act, relu_mask)

    xt = x.detach().requires_grad_()
    zt = None if z is None else z.detach().requires_grad_()
    wt, bt = w.detach().requires_grad_(), b.detach().requires_grad_()

    def theirs():
        y = F.batch_norm(xt, rm, rv, wt, bt, True, 0.1, 1e-5)
        if zt is not None:
            y = y + zt
        if form != "bn":
            y = F.relu(y)
        inputs = (xt, wt, bt) if zt is None else (xt, wt, bt, zt)
        torch.autograd.grad(y, inputs, dy)

    return graphed_us(ours), graphed_us(theirs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--no-single", action="store_true", help="split passes only")
    parser.add_argument("--no-mask", action="store_true", help="add_relu reads the residual")
    args = parser.parse_args()
    if args.no_single:
        _single.enable(False)
    which = "split passes only" if args.no_single else "default"
    print(f"resnet50 norm layers as fuse runs them, batch {args.batch}, bf16 channels_last;")
    print(f"single launch: {which}; add_relu backward reads the "
          f"{'residual' if args.no_mask else 'ReLU mask'}")  # fmt: skip
    print("us per forward+backward (graphed): cupynorm / torch")
    ours_total = theirs_total = 0.0
    for c, s, layers, form in LAYERS:
        ours, theirs = measure(args.batch, c, s, form, not args.no_mask)
        ours_total += ours * layers
        theirs_total += theirs * layers
        mb = args.batch * c * s * s * 2 / 1e6
        print(f"C={c:5d} {s:3d}x{s:<3d} {mb:6.1f} MB {form:8s} x{layers:2d}: "
              f"{ours:7.1f} / {theirs:7.1f}")  # fmt: skip
    print(f"all 53 layers, ms per step: cupynorm {ours_total / 1e3:.3f}, "
          f"torch {theirs_total / 1e3:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
