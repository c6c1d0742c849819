"""`profile calls`: host µs per call of the public functional (`cupynorm.*`) on CuPy arrays,
torch tensors and JAX arrays, beside the `cupynorm.torch` module and torch's own call.

Back-to-back calls with no grad on small inputs (the GPU time is negligible), the median of 5
blocks; each case's result is first compared with torch's. JAX is optional (a column of "-"
without it). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from .common import format_table

IMAGE, ROWS = (8, 64, 32, 32), (4096, 768)


def host_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """µs per call of `fn` called back to back: the median of 5 blocks."""
    for _ in range(50):
        fn()
    sync()
    blocks = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(max(1, calls // 5)):
            fn()
        blocks.append((time.perf_counter() - started) / max(1, calls // 5) * 1e6)
        sync()
    return sorted(blocks)[2]


def cases() -> list[tuple[str, tuple[int, ...], Any, Any, Any]]:
    """(label, shape, cupynorm's call, torch's call, maker of the cupynorm.torch module or
    None)."""
    import torch.nn.functional as F

    import cupynorm
    import cupynorm.torch as cnt

    def ln2d(t: Any) -> Any:
        return F.layer_norm(t.permute(0, 2, 3, 1), (t.shape[1],)).permute(0, 3, 1, 2)

    return [
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
        ("LayerNorm2d 8x64x32x32 fp32", IMAGE, lambda a: cupynorm.layer_norm2d(a), ln2d, None),
    ]  # fmt: skip


def _row(case: tuple[str, Any, Any, Any, Any], jnp: Any, calls: int) -> list[Any]:
    """One case's cells: checked against torch's call first, then timed."""
    import cupy
    import torch

    label, shape, call, torch_call, make_module = case
    sync = torch.cuda.synchronize
    a = cupy.random.standard_normal(shape, dtype=cupy.float32)
    t = torch.from_dlpack(a)
    expected = torch_call(t)
    torch.testing.assert_close(torch.from_dlpack(call(a)), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(call(t), expected, rtol=1e-4, atol=1e-4)
    module = make_module().cuda() if make_module is not None else None
    on_jax = None
    if jnp is not None:
        xj = jnp.asarray(a.get())
        on_jax = host_us(lambda: call(xj), max(1, calls // 4), sync)
    return [
        label,
        host_us(lambda: call(a), calls, sync),
        host_us(lambda: call(t), calls, sync),
        None if module is None else host_us(lambda: module(t), calls, sync),
        host_us(lambda: torch_call(t), calls, sync),
        on_jax,
    ]


def run(args: argparse.Namespace) -> int:
    """`profile calls`."""
    import cupy
    import torch

    try:
        import jax.numpy as jnp
    except ImportError:
        jnp = None
    with torch.no_grad():
        rows = [_row(case, jnp, args.calls) for case in cases()]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CuPy {cupy.__version__}: "
        "µs per call, back to back, no grad, median of 5 blocks"
    )
    columns = ["call", "CuPy array", "torch tensor via cupynorm.*", "cupynorm.torch module",
               "torch's own", "JAX array"]  # fmt: skip
    print(format_table(columns, rows))
    return 0
