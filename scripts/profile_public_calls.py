"""Per-call host time of the public functional (``cupynorm.*``) on CuPy arrays, torch tensors and
JAX arrays, beside the ``cupynorm.torch`` module and torch's own call: back-to-back calls with no
grad, each result first compared with torch's. Prints a markdown table (benchmarks/RESULTS.md).

Usage: python scripts/profile_public_calls.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import cupy
import torch
import torch.nn.functional as F

import cupynorm
import cupynorm.torch as cnt


def host_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """µs per call of ``fn`` called back to back: the median of 5 blocks."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    blocks = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        blocks.append((time.perf_counter() - start) / (calls // 5) * 1e6)
        torch.cuda.synchronize()
    return sorted(blocks)[2]


def _ln2d(t: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(t.permute(0, 2, 3, 1), (t.shape[1],)).permute(0, 3, 1, 2)


IMAGE, ROWS = (8, 64, 32, 32), (4096, 768)
CASES = [  # (label, shape, cupynorm call, torch's call, cupynorm.torch module or None)
    ("GroupNorm(8) 8x64x32x32 fp32", IMAGE, lambda a: cupynorm.group_norm(a, 8),
     lambda t: F.group_norm(t, 8), lambda: cnt.GroupNorm(8, 64, affine=False)),
    ("LayerNorm 4096x768 fp32", ROWS, lambda a: cupynorm.layer_norm(a, (768,)),
     lambda t: F.layer_norm(t, (768,)), lambda: cnt.LayerNorm(768, elementwise_affine=False)),
    ("RMSNorm 4096x768 fp32", ROWS, lambda a: cupynorm.rms_norm(a, (768,)),
     lambda t: F.rms_norm(t, (768,)), lambda: cnt.RMSNorm(768, elementwise_affine=False)),
    ("InstanceNorm 8x64x32x32 fp32", IMAGE, lambda a: cupynorm.instance_norm(a),
     F.instance_norm, lambda: cnt.InstanceNorm2d(64)),
    ("BatchNorm train 8x64x32x32 fp32", IMAGE,
     lambda a: cupynorm.batch_norm(a, None, None, training=True),
     lambda t: F.batch_norm(t, None, None, training=True), None),
    ("LayerNorm2d 8x64x32x32 fp32", IMAGE, lambda a: cupynorm.layer_norm2d(a), _ln2d, None),
]  # fmt: skip


def row(label, shape, call, torch_call, make_module, jnp) -> str:
    a = cupy.random.standard_normal(shape, dtype=cupy.float32)
    t = torch.from_dlpack(a)
    expected = torch_call(t)
    torch.testing.assert_close(torch.from_dlpack(call(a)), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(call(t), expected, rtol=1e-4, atol=1e-4)
    on_cupy = host_us(lambda: call(a))
    on_torch = host_us(lambda: call(t))
    module = make_module().cuda() if make_module is not None else None
    on_module = host_us(lambda: module(t)) if module is not None else float("nan")
    torch_own = host_us(lambda: torch_call(t))
    on_jax = float("nan")
    if jnp is not None:
        xj = jnp.asarray(a.get())
        on_jax = host_us(lambda: call(xj), calls=500)
    cells = (on_cupy, on_torch, on_module, torch_own, on_jax)
    return f"| {label} | " + " | ".join(f"{c:.1f}" for c in cells) + " |"


def main() -> None:
    try:
        import jax.numpy as jnp
    except ImportError:
        jnp = None
    print("| call | CuPy array | torch tensor via cupynorm.* | cupynorm.torch module "
          "| torch's own | JAX array |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    with torch.no_grad():
        for case in CASES:
            print(row(*case, jnp))


if __name__ == "__main__":
    main()
