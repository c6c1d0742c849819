"""`profile calls`: what a call of the public functional (`cupynorm.*`) costs, on CuPy arrays,
torch tensors and JAX arrays, beside the `cupynorm.torch` module, torch's own call and the same
norm written by hand with CuPy's reductions.

For each public function, on a small input (host-paced: the GPU time is a few µs) and a large one
(GPU-paced), no grad:

- µs per call, calls back to back (the median of 5 blocks): on a CuPy array, on a torch tensor
  through `cupynorm.*`, through the `cupynorm.torch` module, torch's own functional, on a JAX
  array (the DLPack exchange both ways included);
- GPU µs per call of cupynorm's kernels and of the hand-written CuPy norm
  (`cupyx.profiler.benchmark`: CUDA events around each call, so on a small input the gaps
  between one call's launches count too).

Each cupynorm result is first compared with the hand-written CuPy norm (and torch's call). Runs
without torch (CuPy columns only) and without JAX; needs a CUDA GPU.

Where a replayed call's host µs go (the second table, CuPy arrays and torch tensors), each timed on
the call's own recorded program in blocks of calls too short to fill the launch queue (so the GPU
never paces them): the call key and its lookup, the outputs' allocations, the launches (the
recorded program's run less its allocations: the launches with their pointer table, the device
and the stream) and the rest (the Python between them: the public function, the replay's
checks).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from typing import Any

from .common import format_table

EPS = 1e-5
IMAGE_SMALL, IMAGE_LARGE = (8, 64, 32, 32), (16, 64, 128, 128)
ROWS_SMALL, ROWS_LARGE = (4096, 768), (8192, 4096)


# ---- the norms written by hand with CuPy's reductions (float32 in, float32 out) ---------------
# (array methods and operators only: the same code runs on NumPy arrays, as the CPU tests do)
def _standardize(v: Any, axes: tuple[int, ...]) -> Any:
    mean = v.mean(axis=axes, keepdims=True)
    var = v.var(axis=axes, keepdims=True)
    return (v - mean) * (var + EPS) ** -0.5


def _group_norm_cupy(a: Any, groups: int = 8) -> Any:
    v = a.reshape(a.shape[0], groups, -1)
    return _standardize(v, (2,)).reshape(a.shape)


def _instance_norm_cupy(a: Any) -> Any:
    return _standardize(a, tuple(range(2, a.ndim)))


def _batch_norm_cupy(a: Any) -> Any:
    return _standardize(a, (0, *range(2, a.ndim)))


def _layer_norm_cupy(a: Any) -> Any:
    return _standardize(a, (a.ndim - 1,))


def _rms_norm_cupy(a: Any) -> Any:
    return a * ((a * a).mean(axis=-1, keepdims=True) + EPS) ** -0.5


def _layer_norm2d_cupy(a: Any) -> Any:
    return _standardize(a, (1,))


@dataclasses.dataclass(frozen=True)
class Case:
    """One public function: its calls on each library, and its inputs' shapes."""

    name: str
    shapes: tuple[tuple[int, ...], tuple[int, ...]]  # small, large
    call: Callable[[Any], Any]  # cupynorm's call on any array
    by_hand: Callable[[Any], Any]  # the hand-written CuPy norm
    torch_call: Callable[[Any], Any] | None = None  # torch's own functional (given torch)
    module: Callable[[int], Any] | None = None  # the cupynorm.torch module of C / row features


def cases() -> list[Case]:
    """Every public norm function of `cupynorm` (the activation and residual forms are the same
    calls with an epilogue)."""
    import cupynorm

    def torch_functional(name: str, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        def call(t: Any) -> Any:
            import torch.nn.functional as F

            return getattr(F, name)(t, *args, **kwargs)

        return call

    def module(name: str, arguments: Callable[[int], tuple], **kwargs: Any) -> Callable[[int], Any]:
        def make(features: int) -> Any:
            import cupynorm.torch as cnt

            return getattr(cnt, name)(*arguments(features), **kwargs).cuda()

        return make

    def layer_norm2d_torch(t: Any) -> Any:
        import torch.nn.functional as F

        return F.layer_norm(t.permute(0, 2, 3, 1), (t.shape[1],), eps=EPS).permute(0, 3, 1, 2)

    return [
        Case("group_norm(x, 8)", (IMAGE_SMALL, IMAGE_LARGE), lambda a: cupynorm.group_norm(a, 8),
             _group_norm_cupy, torch_functional("group_norm", 8),
             module("GroupNorm", lambda c: (8, c), affine=False)),
        Case("instance_norm(x)", (IMAGE_SMALL, IMAGE_LARGE), cupynorm.instance_norm,
             _instance_norm_cupy, torch_functional("instance_norm"),
             module("InstanceNorm2d", lambda c: (c,))),
        Case("batch_norm(x, training=True)", (IMAGE_SMALL, IMAGE_LARGE),
             lambda a: cupynorm.batch_norm(a, None, None, training=True), _batch_norm_cupy,
             torch_functional("batch_norm", None, None, training=True),
             module("BatchNorm2d", lambda c: (c,), affine=False, track_running_stats=False)),
        Case("layer_norm(x, (C,))", (ROWS_SMALL, ROWS_LARGE),
             lambda a: cupynorm.layer_norm(a, (a.shape[-1],)), _layer_norm_cupy,
             lambda t: torch_functional("layer_norm", (t.shape[-1],))(t),
             module("LayerNorm", lambda c: (c,), elementwise_affine=False)),
        Case("rms_norm(x, (C,), eps=1e-5)", (ROWS_SMALL, ROWS_LARGE),
             lambda a: cupynorm.rms_norm(a, (a.shape[-1],), eps=EPS), _rms_norm_cupy,
             lambda t: torch_functional("rms_norm", (t.shape[-1],), eps=EPS)(t),
             module("RMSNorm", lambda c: (c,), eps=EPS, elementwise_affine=False)),
        Case("layer_norm2d(x)", (IMAGE_SMALL, IMAGE_LARGE), cupynorm.layer_norm2d,
             _layer_norm2d_cupy, layer_norm2d_torch),
    ]  # fmt: skip


# ---- timing ------------------------------------------------------------------------------------
def host_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """µs per call of `fn` called back to back: the median of 5 blocks."""
    for _ in range(min(50, calls)):
        fn()
    sync()
    blocks = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(max(1, calls // 5)):
            fn()
        sync()
        blocks.append((time.perf_counter() - started) / max(1, calls // 5) * 1e6)
    return sorted(blocks)[2]


def gpu_us(fn: Callable[[], object], calls: int) -> float:
    """Median GPU µs of one call (CUDA events around each, `cupyx.profiler.benchmark`)."""
    import numpy
    from cupyx.profiler import benchmark

    times = benchmark(fn, n_repeat=max(10, calls // 10), n_warmup=10).gpu_times[0]
    return float(numpy.median(times)) * 1e6


def _calls_for(shape: tuple[int, ...], calls: int) -> int:
    """Fewer calls on a large input (each is GPU-paced): ~the same GPU seconds per case."""
    elements = 1
    for d in shape:
        elements *= d
    return max(20, min(calls, calls * 2_000_000 // elements))


def _row(case: Case, size: int, torch: Any, jnp: Any, calls: int) -> dict[str, Any]:
    """One case on one input: checked, then timed; a column whose library is missing is None."""
    import cupy

    shape = case.shapes[size]
    calls = _calls_for(shape, calls)

    def sync() -> None:
        cupy.cuda.Device().synchronize()

    a = cupy.random.standard_normal(shape, dtype=cupy.float32)
    expected = case.by_hand(a)
    cupy.testing.assert_allclose(case.call(a), expected, rtol=1e-4, atol=1e-4)
    row: dict[str, Any] = {
        "call": case.name,
        "shape": "x".join(map(str, shape)),
        "cupy_us": host_us(lambda: case.call(a), calls, sync),
        "torch_tensor_us": None,
        "module_us": None,
        "torch_own_us": None,
        "jax_us": None,
        "kernels_gpu_us": gpu_us(lambda: case.call(a), calls),
        "cupy_by_hand_gpu_us": gpu_us(lambda: case.by_hand(a), calls),
    }
    if torch is not None:
        t = torch.from_dlpack(a)
        cupy.testing.assert_allclose(cupy.from_dlpack(case.call(t)), expected, 1e-4, 1e-4)
        row["torch_tensor_us"] = host_us(lambda: case.call(t), calls, sync)
        if case.torch_call is not None:
            cupy.testing.assert_allclose(
                cupy.from_dlpack(case.torch_call(t)), expected, rtol=1e-4, atol=1e-4
            )
            row["torch_own_us"] = host_us(lambda: case.torch_call(t), calls, sync)
        if case.module is not None:
            module = case.module(shape[1] if len(shape) > 2 else shape[-1])
            row["module_us"] = host_us(lambda: module(t), calls, sync)
    if jnp is not None:
        xj = jnp.asarray(cupy.asnumpy(a))
        row["jax_us"] = host_us(lambda: case.call(xj), max(20, calls // 4), sync)
    row["cupy_parts"] = host_parts(case.call, a, calls, sync)
    if torch is not None:
        row["torch_parts"] = host_parts(case.call, torch.from_dlpack(a), calls, sync)
    return row


def replayed_op(call: Callable[[Any], Any], x: Any) -> tuple[Any, tuple]:
    """(the recorded op, its arguments) that the public call ``call(x)`` replays: the
    functional's replay entry watched for one call."""
    from cupynorm import functional

    seen: list[tuple[Any, tuple]] = []
    replayed = functional._replayed

    def watch(op: Any, *args: Any) -> Any:
        seen.append((op, args))
        return replayed(op, *args)

    functional._replayed = watch
    try:
        call(x)
    finally:
        functional._replayed = replayed
    return seen[0]


def _blocks_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """µs per call of `fn`, host side only: blocks of 100 calls (too few to fill the launch
    queue), synchronized between blocks outside the clock; the median block."""
    for _ in range(20):
        fn()
    sync()
    blocks = []
    for _ in range(max(5, calls // 100)):
        started = time.perf_counter()
        for _ in range(100):
            fn()
        blocks.append((time.perf_counter() - started) / 100 * 1e6)
        sync()
    return sorted(blocks)[len(blocks) // 2]


def host_parts(
    call: Callable[[Any], Any], x: Any, calls: int, sync: Callable[[], None]
) -> dict[str, Any]:
    """Where the host µs of a replayed ``call(x)`` go: the call itself, its key and lookup, its
    allocations, its launches (host side), and how many of each (see the module's doc)."""
    from cupynorm import _program

    op, args = replayed_op(call, x)
    bk, key, tensors, pointers, program = _program._lookup(op.__name__, args, {})
    if type(program) is not _program._Program or _program.CHECKED not in program.validated:
        raise RuntimeError(f"{op.__name__}: the call is not replayed")
    device = key[2]

    def allocate() -> list:
        objects = list(tensors)
        for make, like in program.allocations:
            objects.append(make() if like is None else make(objects[like]))
        return objects

    parts = {
        "call_us": _blocks_us(lambda: call(x), calls, sync),
        "key_us": _blocks_us(lambda: _program._lookup(op.__name__, args, {}), calls, sync),
        "allocations_us": _blocks_us(allocate, calls, sync),
        "allocations": len(program.allocations),
        "launches": len(program._go),
    }
    # the replay itself (fresh outputs each time: a kernel may count in a zeroed buffer it is
    # given), less its allocations
    replay = _blocks_us(lambda: program.run(bk, device, tensors, pointers), calls, sync)
    parts["launches_us"] = replay - parts["allocations_us"]
    parts["rest_us"] = parts["call_us"] - parts["key_us"] - replay
    return parts


COLUMNS = {
    "call": "call",
    "shape": "input (fp32)",
    "cupy_us": "CuPy array",
    "torch_tensor_us": "torch tensor via cupynorm.*",
    "module_us": "cupynorm.torch module",
    "torch_own_us": "torch's own",
    "jax_us": "JAX array",
    "kernels_gpu_us": "GPU: cupynorm",
    "cupy_by_hand_gpu_us": "GPU: by hand in CuPy",
}


def measure(calls: int) -> tuple[str, list[dict[str, Any]]]:
    """(a line naming the setup, a row per case and input size)."""
    import cupy

    try:
        import torch
    except ImportError:
        torch = None
    try:
        import jax.numpy as jnp
    except ImportError:
        jnp = None
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    versions = [f"CuPy {cupy.__version__}"]
    if torch is not None:
        versions.append(f"torch {torch.__version__}")
    if jnp is not None:
        import jax

        versions.append(f"JAX {jax.__version__}")
    rows = []
    for case in cases():
        for size in (0, 1):
            if torch is None:
                rows.append(_row(case, size, None, jnp, calls))
                continue
            with torch.no_grad():
                rows.append(_row(case, size, torch, jnp, calls))
    return f"{name}, {', '.join(versions)}", rows


PARTS_COLUMNS = {
    "call_us": "call",
    "key_us": "key + lookup",
    "allocations_us": "allocations",
    "launches_us": "launches (host)",
    "rest_us": "rest",
    "allocations": "allocations (count)",
    "launches": "launches (count)",
}


def table(rows: list[dict[str, Any]]) -> str:
    return format_table(list(COLUMNS.values()), [[r[k] for k in COLUMNS] for r in rows], left=2)


def parts_table(rows: list[dict[str, Any]]) -> str:
    """Where a call's host µs go, per array type (rows measured before the breakdown have
    none: an empty string)."""
    lines = []
    for row in rows:
        for array, key in (("CuPy array", "cupy_parts"), ("torch tensor", "torch_parts")):
            parts = row.get(key)
            if parts:
                lines.append([row["call"], row["shape"], array, *(parts[k] for k in PARTS_COLUMNS)])
    if not lines:
        return ""
    columns = ["call", "input (fp32)", "array", *PARTS_COLUMNS.values()]
    return format_table(columns, lines, left=3)


def run(args: argparse.Namespace) -> int:
    """`profile calls`."""
    setup, rows = measure(args.calls)
    print(
        f"{setup}: µs per call, back to back, no grad, median of 5 blocks; GPU: median µs of "
        "one call's kernels (events around each call)"
    )
    print(table(rows))
    print(
        "\nWhere a replayed call's host µs go (each piece timed on the call's own program in "
        "blocks of 100 calls; launches: the program's run less its allocations; rest: the "
        "Python between the pieces):"
    )
    print(parts_table(rows))
    if args.json:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "date": date, "rows": rows}, f, indent=1)
    return 0
