"""Host-side cost per call of each layer of the torch path (development tool).

Times back-to-back calls on a small tensor (GPU time negligible), layer by layer: the kernel
launch alone, cupynorm._ops, the functional API, the cupynorm.torch function and module, and
torch's own module; then a cProfile of the module call. Usage: python scripts/profile_host.py
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm  # noqa: E402
import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _ops  # noqa: E402


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    x = torch.randn(8, 64, 32, 32, device="cuda")
    ours, theirs = cnt.InstanceNorm2d(64).cuda(), torch.nn.InstanceNorm2d(64).cuda()
    with torch.no_grad():
        rows = [
            ("torch.empty_like", lambda: torch.empty_like(x)),
            ("torch.cuda.current_stream", lambda: torch.cuda.current_stream()),
            ("_ops.group_norm_fwd", lambda: _ops.group_norm_fwd(x, 64, None, None, 1e-5)),
            ("cupynorm.instance_norm", lambda: cupynorm.instance_norm(x)),
            ("cupynorm.torch.instance_norm", lambda: cnt.instance_norm(x)),
            ("cupynorm.torch.InstanceNorm2d", lambda: ours(x)),
            ("torch.nn.InstanceNorm2d", lambda: theirs(x)),
        ]
        for name, fn in rows:
            print(f"{name:34s} {per_call_us(fn):7.1f} us/call", flush=True)
        xh = torch.rand(16, 320, 64, 64, device="cuda", dtype=torch.float16)
        gn, gn_torch = (cls(32, 320).cuda().half() for cls in (cnt.GroupNorm, torch.nn.GroupNorm))
        for name, fn in (
            ("cupynorm GroupNorm fp16", lambda: gn(xh)),
            ("torch GroupNorm fp16", lambda: gn_torch(xh)),
        ):
            print(f"{name:34s} {per_call_us(fn, 200):7.1f} us/call (no_grad)", flush=True)
    for name, fn in (
        ("cupynorm GroupNorm fp16", lambda: gn(xh)),
        ("torch GroupNorm fp16", lambda: gn_torch(xh)),
    ):
        print(f"{name:34s} {per_call_us(fn, 200):7.1f} us/call (grad)", flush=True)
    with torch.no_grad():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            ours(x)
        for _ in range(200):
            gn(xh)
        profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    # forward + backward of GroupNorm fp16 (the bench's groupnorm32_fwdbwd_fp16)
    xg = xh.clone().requires_grad_()
    dy = torch.rand_like(xg)
    params = list(gn.parameters())

    def fwd_bwd():
        torch.autograd.grad(gn(xg), [xg, *params], grad_outputs=dy)

    print(f"{'cupynorm GroupNorm fp16 fwd+bwd':34s} {per_call_us(fwd_bwd, 100):7.1f} us/call")
    params_torch = list(gn_torch.parameters())

    def fwd_bwd_torch():
        torch.autograd.grad(gn_torch(xg), [xg, *params_torch], grad_outputs=dy)

    print(f"{'torch GroupNorm fp16 fwd+bwd':34s} {per_call_us(fwd_bwd_torch, 100):7.1f} us/call")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        fwd_bwd()
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
