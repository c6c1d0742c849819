"""cupynorm's norm backward function timed where autograd runs it -- the engine's device thread --
and called directly on the main thread (``grad_fn.apply``), same layer, same shapes.

Autograd runs the nodes of a CUDA graph on a device thread, so a Python backward runs away from
the thread that made its tensors and context; this measures what that costs one call.

Usage: python scripts/profile_backward_thread.py [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm.torch as cnt  # noqa: E402
from cupynorm.torch import _batch_norm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=600)
    args = parser.parse_args()
    torch.manual_seed(0)
    m = cnt.BatchNormAct2d(64).cuda()
    shape = (8, 64, 56, 56)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x = x.to(memory_format=torch.channels_last).requires_grad_()
    residual = torch.randn_like(x).requires_grad_()
    dy = torch.randn_like(x)
    function = _batch_norm._BatchNormActFunction
    original = function.__dict__["backward"]
    inside: list[float] = []

    def timed(ctx, *grads):
        start = time.perf_counter()
        out = original.__func__(ctx, *grads)
        inside.append(time.perf_counter() - start)
        return out

    function.backward = staticmethod(timed)
    engine, main_thread = [], []
    try:
        for i in range(args.calls):
            torch.cuda.synchronize()
            y = m(x, residual)
            if i % 2:
                y.backward(dy)
                engine.append(inside[-1])
            else:
                with torch.no_grad():  # as autograd runs a backward
                    y.grad_fn.apply(dy, None, None)
                main_thread.append(inside[-1])
    finally:
        function.backward = original
    torch.cuda.synchronize()
    skip = min(20, len(engine) // 2)
    print(
        f"norm backward function, median us: engine thread "
        f"{statistics.median(engine[skip:]) * 1e6:.1f}, main thread "
        f"{statistics.median(main_thread[skip:]) * 1e6:.1f} "
        f"(BatchNormAct2d(64), {'x'.join(map(str, shape))} bf16 channels_last)"
    )


if __name__ == "__main__":
    main()
