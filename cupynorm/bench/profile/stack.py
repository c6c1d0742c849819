"""`profile stack`: host µs per norm layer in a stack of layers, torch's module beside cupynorm's.

A chain of N layers of one family on a small tensor, forward then backward issued back to back
with no synchronization: the autograd engine's fixed cost is paid once per step, as in a model,
so what each layer adds is its own host time. Measured per family: `nn.Identity` (the baseline,
subtracted), a bare Python `autograd.Function` with a norm's allocations and no kernels (the
floor of any norm written in Python), torch's module and cupynorm's (on a GPU twice: on its
kernels at every size, and with the default eager policy, which gives calls this small torch's
own op: what a user gets). Per layer: host µs of the
forward and of the backward (the fastest of several blocks of steps), and on a GPU the kernel µs,
kernel launches and allocations (torch.profiler, the caching allocator's counter). The same
stacks run on the CPU with faked launches (`profile cpu`).

With `--compile` each stack is compiled whole (`torch.compile(fullgraph=True)`, Inductor):
torch's layers become Inductor's kernels; cupynorm's (every kind on its kernels) are op calls in
the generated code, which calls each op's kernel directly ("cupynorm"), or the op through the
dispatcher ("cupynorm op calls", what the generated code did before): the host µs of an op call
inside a compiled graph.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .common import floor_layer_class, format_table, print_cprofile

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]
IMAGE, ROWS = (8, 64, 14, 14), (8, 196, 96)  # a resnet50 layer's form, a convnext block's rows


@dataclass(frozen=True)
class Family:
    """One norm family: its input, and how each side builds one layer of `features` features."""

    name: str
    title: str
    shape: Shape  # the GPU's input
    cpu_shape: Shape  # the CPU harness's: small (its kernels are not the point)
    channels_last: bool = False
    dtype: str = "bfloat16"  # of the input
    autocast: str | None = "bfloat16"  # None: no autocast; parameters then in `dtype` too

    @property
    def features(self) -> int:
        return self.shape[1] if len(self.shape) == 4 else self.shape[-1]


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("bn", "BatchNorm2d(64)", IMAGE, (8, 64, 2, 2), channels_last=True),
        Family("bn+act", "BatchNorm2d(64) + ReLU", IMAGE, (8, 64, 2, 2), channels_last=True),
        Family("gn", "GroupNorm(32, 64)", IMAGE, (8, 64, 2, 2), channels_last=True),
        Family("gn+act", "GroupNorm(32, 64) + SiLU", IMAGE, (8, 64, 2, 2), channels_last=True),
        Family("in", "InstanceNorm2d(64, affine)", IMAGE, (8, 64, 2, 2), channels_last=True),
        Family("ln", "LayerNorm(96)", ROWS, (8, 4, 96)),
        # RMSNorm without autocast: under it, cupynorm's RMSNorm calls torch's own rms_norm where
        # torch's autocast passes rms_norm through (cupynorm.torch.rms_norm's docstring)
        Family("rms", "RMSNorm(96), bf16 weights", ROWS, (8, 4, 96), autocast=None),
        Family("llama_rms", "LlamaRMSNorm(96), bf16 weights", ROWS, (8, 4, 96), autocast=None),
        Family("ln2d", "LayerNorm2d(96)", (8, 96, 14, 14), (8, 96, 2, 2), channels_last=True),
        Family(
            "rms2d",
            "RMSNorm2d(96), bf16 weights",
            (8, 96, 14, 14),
            (8, 96, 2, 2),
            channels_last=True,
            autocast=None,
        ),
    )
}


def layer_makers(family: str) -> dict[str, Callable[[int], torch.nn.Module]]:
    """{"torch": maker, "cupynorm": maker} of one layer of the family (torch imported here)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import cupynorm.torch as cnt

    class TorchLlamaRMSNorm(nn.Module):
        """transformers' LlamaRMSNorm formula in torch operations."""

        def __init__(self, hidden: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(hidden)), eps

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            dtype = h.dtype
            h = h.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * h.to(dtype)

    class PermuteLayerNorm2d(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.permute(0, 2, 3, 1)
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
            return x.permute(0, 3, 1, 2)

    class PermuteRMSNorm2d(nn.RMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.rms_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.eps)
            return x.permute(0, 3, 1, 2)

    makers: dict[str, tuple[Callable[[int], nn.Module], Callable[[int], nn.Module]]] = {
        "bn": (nn.BatchNorm2d, cnt.BatchNorm2d),
        "bn+act": (lambda c: nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(inplace=True)),
                   cnt.BatchNormAct2d),
        "gn": (lambda c: nn.GroupNorm(32, c), lambda c: cnt.GroupNorm(32, c)),
        "gn+act": (lambda c: nn.Sequential(nn.GroupNorm(32, c), nn.SiLU()),
                   lambda c: cnt.GroupNormAct(32, c)),
        "in": (lambda c: nn.InstanceNorm2d(c, affine=True),
               lambda c: cnt.InstanceNorm2d(c, affine=True)),
        "ln": (nn.LayerNorm, cnt.LayerNorm),
        "rms": (nn.RMSNorm, cnt.RMSNorm),
        "llama_rms": (TorchLlamaRMSNorm, cnt.LlamaRMSNorm),
        "ln2d": (PermuteLayerNorm2d, cnt.LayerNorm2d),
        "rms2d": (PermuteRMSNorm2d, cnt.RMSNorm2d),
    }  # fmt: skip
    theirs, ours = makers[family]
    return {"torch": theirs, "cupynorm": ours}


@dataclass
class StackTiming:
    """Per step of the stack: host µs of the forward and of the backward; on a GPU the kernel
    µs, kernel launches and allocations."""

    forward_us: float
    backward_us: float
    kernel_us: float | None = None
    kernels: float | None = None
    allocations: float | None = None


@dataclass
class Bench:
    """How a stack is run: on which device, synchronized how, how many steps."""

    device: str
    sync: Callable[[], None]
    steps: int = 200
    blocks: int = 5
    warmup: int = 20
    gpu_counters: bool = False  # kernels and allocations (torch.profiler, torch.cuda stats)


def make_input(family: Family, bench: Bench, cpu: bool = False) -> torch.Tensor:
    """The stack's input: standard normal, the family's dtype (float32 on the CPU harness) and
    layout, requiring grad."""
    import torch

    shape = family.cpu_shape if cpu else family.shape
    dtype = torch.float32 if cpu else getattr(torch, family.dtype)
    x = torch.randn(shape, device=bench.device, dtype=dtype)
    if family.channels_last and x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    return x.requires_grad_()


def build_stack(
    make: Callable[[int], torch.nn.Module], layers: int, family: Family, x: torch.Tensor
) -> torch.nn.Module:
    """`layers` layers in a chain, on x's device; parameters in float32 under autocast, else in
    x's dtype (a model's conditions)."""
    import torch

    stack = torch.nn.Sequential(*(make(family.features) for _ in range(layers)))
    dtype = torch.float32 if family.autocast else x.dtype
    return stack.to(device=x.device, dtype=dtype)


def _step_of(
    model: torch.nn.Module, x: torch.Tensor, autocast: str | None
) -> Callable[[list[float]], None]:
    """One training step of the stack, adding its forward and backward host seconds to `into`."""
    import torch

    def context() -> Any:
        if autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(x.device.type, dtype=getattr(torch, autocast))

    def step(into: list[float]) -> None:
        started = time.perf_counter()
        with context():
            y = model(x)
        issued = time.perf_counter()
        y.float().sum().backward()
        into[0] += issued - started
        into[1] += time.perf_counter() - issued

    return step


def time_stack(
    model: torch.nn.Module, x: torch.Tensor, family: Family, bench: Bench, cpu: bool = False
) -> StackTiming:
    """Host µs of a step's forward and backward, each the fastest of `bench.blocks` blocks of
    back-to-back steps; on a GPU also the kernels and allocations of a step."""
    step = _step_of(model, x, None if cpu else family.autocast)
    scratch = [0.0, 0.0]
    for _ in range(bench.warmup):
        step(scratch)
    bench.sync()
    per_block = max(1, bench.steps // bench.blocks)
    forward = backward = float("inf")
    for _ in range(bench.blocks):
        totals = [0.0, 0.0]
        for _ in range(per_block):
            step(totals)
        forward = min(forward, totals[0] / per_block * 1e6)
        backward = min(backward, totals[1] / per_block * 1e6)
        bench.sync()
    timing = StackTiming(forward, backward)
    if bench.gpu_counters:
        _count_on_gpu(timing, lambda: step([0.0, 0.0]))
    return timing


def _count_on_gpu(timing: StackTiming, step: Callable[[], None], steps: int = 5) -> None:
    import torch

    from cupynorm.bench import timing as bench_timing

    torch.cuda.synchronize()
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    timing.allocations = (
        torch.cuda.memory_stats().get("allocation.all.allocated", 0) - before
    ) / steps
    with bench_timing.cuda.profile() as profiler:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = bench_timing.cuda.kernel_events(profiler)
    timing.kernel_us = sum(us for _name, us in events) / steps
    timing.kernels = len(events) / steps


@dataclass
class LayerRow:
    """One layer kind of one family: per layer, over the identity stack."""

    family: str
    layer: str
    forward_us: float
    backward_us: float
    kernel_us: float | None
    kernels: float | None
    allocations: float | None

    @property
    def total_us(self) -> float:
        return self.forward_us + self.backward_us


def per_layer(family: str, layer: str, t: StackTiming, base: StackTiming, layers: int) -> LayerRow:
    """`t` less the identity stack's `base`, divided by the layers."""

    def less(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (a - b) / layers

    return LayerRow(
        family,
        layer,
        (t.forward_us - base.forward_us) / layers,
        (t.backward_us - base.backward_us) / layers,
        less(t.kernel_us, base.kernel_us),
        less(t.kernels, base.kernels),
        less(t.allocations, base.allocations),
    )


COMPILED_IMPLS = ("torch", "cupynorm", "cupynorm op calls")


@contextlib.contextmanager
def _compiled_as(impl: str) -> Any:
    """cupynorm's kernels for every kind and size inside torch.compile, called directly or
    through the op ("cupynorm op calls"); Inductor's cache off, so that each stack's code is
    generated."""
    import torch

    import cupynorm.torch as cnt
    from cupynorm.torch import _library

    previous = cnt.set_compile_kernels("all"), cnt.set_compile_min_bytes(0), _library.DIRECT_CALLS
    _library.DIRECT_CALLS = impl != "cupynorm op calls"
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            yield
    finally:
        cnt.set_compile_kernels(previous[0])
        cnt.set_compile_min_bytes(previous[1])
        _library.DIRECT_CALLS = previous[2]
        torch._dynamo.reset()


def profile_family(
    family: Family,
    layers: int,
    bench: Bench,
    impls: Sequence[str] = ("floor", "torch", "cupynorm"),
    cpu: bool = False,
    cprofile: bool = False,
    compiled: bool = False,
) -> list[LayerRow]:
    """Every layer kind of `impls` in a stack of `layers`, per layer over the identity stack;
    `compiled`: each stack compiled whole (:data:`COMPILED_IMPLS`)."""
    import torch

    if compiled:
        return _profile_compiled(family, layers, bench, impls)

    makers: dict[str, Callable[[int], torch.nn.Module]] = {
        "identity": lambda c: torch.nn.Identity(),
        "floor": floor_layer_class(),
        **layer_makers(family.name),
    }
    import cupynorm.torch as cnt

    # "cupynorm": its kernels at every size; "cupynorm default": the default eager policy, which
    # gives calls this small torch's own op (cupynorm.torch.set_eager_min_bytes)
    makers["cupynorm default"] = makers["cupynorm"]
    sizes = {"cupynorm": 0, "cupynorm default": "default"}
    x = make_input(family, bench, cpu)
    base = time_stack(build_stack(makers["identity"], layers, family, x), x, family, bench, cpu)
    rows = []
    for impl in impls:
        model = build_stack(makers[impl], layers, family, x)
        previous = cnt.set_eager_min_bytes(sizes.get(impl, "default"))
        try:
            timing = time_stack(model, x, family, bench, cpu)
        finally:
            cnt.set_eager_min_bytes(previous)
        rows.append(per_layer(family.name, impl, timing, base, layers))
        if cprofile and impl == "cupynorm":
            step = _step_of(model, x, None if cpu else family.autocast)
            title = f"{family.name} cupynorm stack steps"
            print_cprofile(functools.partial(step, [0.0, 0.0]), 50, title)
    return rows


def _profile_compiled(
    family: Family, layers: int, bench: Bench, impls: Sequence[str]
) -> list[LayerRow]:
    import torch

    makers = {"identity": lambda c: torch.nn.Identity(), **layer_makers(family.name)}
    makers["cupynorm op calls"] = makers["cupynorm"]
    x = make_input(family, bench)

    def timed(impl: str) -> StackTiming:
        model = torch.compile(build_stack(makers[impl], layers, family, x), fullgraph=True)
        with _compiled_as(impl):
            return time_stack(model, x, family, bench)

    base = timed("identity")
    return [per_layer(family.name, impl, timed(impl), base, layers) for impl in impls]


def format_rows(rows: Sequence[LayerRow], gpu: bool) -> str:
    """The table: host µs per layer (forward, backward, both, and torch's over it), and on a GPU
    the kernels, launches and allocations per layer."""
    torch_total = {r.family: r.total_us for r in rows if r.layer == "torch"}
    columns = ["family", "layer", "fwd host µs", "bwd host µs", "fwd+bwd host µs"]
    if torch_total:
        columns.append("vs torch")
    if gpu:
        columns += ["GPU µs", "launches", "allocations"]
    table = []
    for r in rows:
        reference = torch_total.get(r.family)
        ratio = f"{reference / r.total_us:.2f}x" if reference and r.total_us > 0 else "-"
        cells: list[Any] = [r.family, r.layer, r.forward_us, r.backward_us, r.total_us]
        if torch_total:
            cells.append(ratio)
        if gpu:
            cells += [r.kernel_us, r.kernels, r.allocations]
        table.append(cells)
    return format_table(columns, table, left=2)


def add_arguments(
    parser: argparse.ArgumentParser, steps: int = 200, compiled: bool = False
) -> None:
    """Options `stack` and `cpu` share; `compiled`: with `--compile` (`stack`)."""
    parser.add_argument(
        "--family",
        action="append",
        choices=["all", *FAMILIES],
        help="norm family (repeatable; default all): "
        + "; ".join(f"{f.name}: {f.title}" for f in FAMILIES.values()),
    )
    parser.add_argument("--layers", type=int, default=50, help="layers in the stack (default 50)")
    parser.add_argument("--steps", type=int, default=steps, help=f"timed steps (default {steps})")
    parser.add_argument("--cprofile", action="store_true", help="cProfile of cupynorm's stack")
    if compiled:
        parser.add_argument(
            "--compile",
            action="store_true",
            help="each stack compiled whole: host µs of a layer inside a compiled graph, "
            "cupynorm's op calling its kernel directly and through the dispatcher (try "
            "--layers 20)",
        )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the rows as JSON (`cupynorm report` renders it)"
    )


def write_json(path: str, setup: str, layers: int, rows: Sequence[LayerRow]) -> None:
    """The table's rows as ``{"stack": {"setup", "date", "layers", "rows"}}`` (what
    :mod:`cupynorm.bench.markdown` renders as RESULTS.md's host-per-layer section)."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    document = {"setup": setup, "date": date, "layers": layers, "rows": [asdict(r) for r in rows]}
    with open(path, "w") as f:
        json.dump({"stack": document}, f, indent=1)


def rows_of(document: dict[str, Any]) -> list[LayerRow]:
    """The rows of a :func:`write_json` document."""
    return [LayerRow(**row) for row in document["rows"]]


def chosen_families(names: Sequence[str] | None) -> list[Family]:
    """The families `--family` names, in registry order; none or "all": every family."""
    if not names or "all" in names:
        return list(FAMILIES.values())
    return [f for f in FAMILIES.values() if f.name in names]


def run(args: argparse.Namespace) -> int:
    """`profile stack` on the GPU."""
    import torch

    bench = Bench("cuda", torch.cuda.synchronize, steps=args.steps, gpu_counters=True)
    families = chosen_families(args.family)
    compiled = getattr(args, "compile", False)
    setup = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {args.layers} layers in a "
        f"stack{', compiled whole' if compiled else ''}, forward + backward back to back; per "
        f"layer over an nn.Identity stack"
    )
    print(setup)
    rows: list[LayerRow] = []
    for family in families:
        layout = " channels_last" if family.channels_last else ""
        amp = f", {family.autocast} autocast" if family.autocast else ""
        print(f"  {family.name}: {family.title} on {'x'.join(map(str, family.shape))} "
              f"{family.dtype}{layout}{amp}", flush=True)  # fmt: skip
        impls = COMPILED_IMPLS if compiled else ("floor", "torch", "cupynorm", "cupynorm default")
        # fmt: off
        rows += profile_family(family, args.layers, bench, impls, cprofile=args.cprofile,
                               compiled=compiled)
        # fmt: on
        if args.json:  # after every family: a run stopped at a time limit keeps them
            write_json(args.json, setup, args.layers, rows)
    print()
    print(format_rows(rows, gpu=True))
    print(
        "\nfloor: a bare Python autograd.Function with a norm's allocations and no kernels. "
        "vs torch: torch's fwd+bwd host µs / this layer's. GPU µs, launches, allocations: "
        "per layer and step."
    )
    return 0
