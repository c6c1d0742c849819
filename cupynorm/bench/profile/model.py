"""`profile model`: where a model row's training step spends its host time, torch's norm layers
beside cupynorm's.

The row's model (`python -m cupynorm bench --list`, the models group) is built as the bench builds
it: torch's, converted as the row says (`fuse` or `replace_norms`), and with its norm layers
replaced by `nn.Identity`; the step is the bench's (zero_grad, forward under the row's autocast,
loss, backward, SGD). Printed:

- the time to issue a step started with the device idle (fastest and median), the caching
  allocator's cudaMalloc calls, and the difference to the model without norms per norm layer;
- each phase of the step (forward + loss, backward, optimizer) started with the device idle, and
  inside the backward the autograd nodes that produced the norm layers' outputs (timed by hooks
  on the nodes: torch's C++ nodes and cupynorm's Python ones alike);
- each norm layer's forward host time (module hooks), with the device idle before each and not;
- the CUDA runtime and driver calls of a step (torch.profiler), and torch's operations that
  synchronize with the device (`torch.cuda.set_sync_debug_mode`);
- `--compile`: the `torch.compile`d step of each: ms per step, issue time, graph breaks, cupynorm
  op calls, kernels per step and the heaviest kernels by GPU time.

If the issue time per norm layer grows with the batch, something on the host path waits for the
device.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .common import ProfileError, format_table, print_cprofile

if TYPE_CHECKING:
    import torch

    from cupynorm.bench.specs import ModelWorkload


def _issue_us(step: Callable[[], object], steps: int) -> tuple[float, float]:
    """(fastest, median) µs to issue one step, each started with the device idle."""
    import torch

    samples = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        samples.append((time.perf_counter() - started) * 1e6)
    torch.cuda.synchronize()
    return min(samples), statistics.median(samples)


def _phases_us(step: Any, norms: list[torch.nn.Module], steps: int) -> dict[str, float]:
    """Median µs of each phase of `step` (a TrainStep), each started with the device idle, and
    of the norm layers' output nodes inside the backward (summed per step)."""
    import torch

    from cupynorm.bench import timing
    from cupynorm.bench.trainstep import training_loss

    inside = [0.0]
    starts: dict[int, float] = {}

    def on_output(module: Any, args: Any, output: Any) -> None:
        node = getattr(output, "grad_fn", None)
        if node is None:
            return
        key = id(node)
        node.register_prehook(lambda grads: starts.__setitem__(key, time.perf_counter()))
        node.register_hook(
            lambda grads_in, grads_out: inside.__setitem__(
                0, inside[0] + time.perf_counter() - starts.pop(key, time.perf_counter())
            )
        )

    handles = [m.register_forward_hook(on_output) for m in norms]
    samples: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step.optimizer.zero_grad(set_to_none=True)
            with timing.cuda.autocast(step.workload.autocast):
                loss = training_loss(step.workload, step.forward(step.inputs), step.target)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            inside[0] = 0.0
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            step.optimizer.step()
            t5 = time.perf_counter()
            if i >= 3:
                samples["forward + loss"].append((t1 - t0) * 1e6)
                samples["backward"].append((t3 - t2) * 1e6)
                samples["  norm layers' nodes"].append(inside[0] * 1e6)
                samples["optimizer"].append((t5 - t4) * 1e6)
    finally:
        for handle in handles:
            handle.remove()
    torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


def _layer_forward_us(
    norms: list[torch.nn.Module], step: Callable[[], object], steps: int, idle: bool
) -> list[float]:
    """Median host µs of each norm layer's forward call, in model order; `idle`: the device
    idle before each (a synchronize in the pre-hook, outside the time)."""
    import torch

    times: dict[int, list[float]] = collections.defaultdict(list)
    starts: dict[int, float] = {}

    def before(i: int) -> None:
        if idle:
            torch.cuda.synchronize()
        starts[i] = time.perf_counter()

    handles = []
    for i, m in enumerate(norms):
        handles.append(m.register_forward_pre_hook(lambda _m, _a, i=i: before(i)))
        handles.append(
            m.register_forward_hook(
                lambda _m, _a, _o, i=i: times[i].append((time.perf_counter() - starts[i]) * 1e6)
            )
        )
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            step()
        torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    return [statistics.median(times[i]) for i in range(len(norms))]


def _api_calls(step: Callable[[], object], steps: int = 3) -> dict[str, tuple[float, float]]:
    """{CUDA runtime / driver call: (calls per step, host µs per step)}, torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        name = event.name
        if (
            event.device_type.name == "CPU"
            and name.startswith("cu")
            and not name.startswith("cudnn")
        ):
            calls[name][0] += 1
            calls[name][1] += event.cpu_time_total
    return {k: (n / steps, us / steps) for k, (n, us) in calls.items()}


def _sync_ops(step: Callable[[], object]) -> list[str]:
    """torch operations of one step that synchronize with the device, with where they came from."""
    import torch

    found: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize()
        found = [str(w.message) for w in caught]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    if found:  # again as errors, for the Python stack of the first one
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError:
            found.append("".join(traceback.format_exc(limit=-12)))
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.synchronize()
    return found


def _models(workload: ModelWorkload) -> dict[str, torch.nn.Module]:
    """{"torch", "cupynorm", "no norms"}: the row's models on the GPU, from one set of weights."""
    import torch

    from cupynorm.bench import models
    from cupynorm.bench.trainstep import convert_model, on_device

    torch.manual_seed(0)
    try:
        base = models.build_model(workload)
    except ImportError as exc:
        raise ProfileError(f"{workload.name} cannot be built here: {exc}") from None
    variants = {
        "torch": copy.deepcopy(base),
        "cupynorm": convert_model(copy.deepcopy(base), workload),
        "no norms": models.strip_norms(copy.deepcopy(base)),
    }
    dtype = getattr(torch, workload.dtype)
    return {name: on_device(m, workload, "cuda", dtype) for name, m in variants.items()}


def _print_host(steps: dict[str, Any], args: argparse.Namespace) -> None:
    """Issue times, phases, per-layer forward times, CUDA API calls, synchronizing ops."""
    import torch

    from cupynorm.bench import models

    layers = models.count_norm_layers(steps["torch"].model)
    issue, mallocs = {}, {}
    for name, step in steps.items():
        for _ in range(5):
            step()
        before = torch.cuda.memory_stats().get("num_device_alloc", 0)
        issue[name] = _issue_us(step, args.steps)
        mallocs[name] = torch.cuda.memory_stats().get("num_device_alloc", 0) - before
    base = issue["no norms"][1]
    rows = [
        [
            name,
            fastest,
            median,
            mallocs[name],
            (median - base) / layers if name != "no norms" else None,
        ]
        for name, (fastest, median) in issue.items()
    ]
    print(f"\n== host µs to issue a step, device idle before each ({layers} norm layers)")
    print(format_table(["model", "fastest", "median", "cudaMalloc", "per norm layer"], rows))

    norms = {name: models.norm_layers(step.model) for name, step in steps.items()}
    phases = {name: _phases_us(step, norms[name], args.steps) for name, step in steps.items()}
    rows = []
    for phase in phases["torch"]:
        t, c, n = (phases[k][phase] for k in ("torch", "cupynorm", "no norms"))
        per = phase.startswith("  ")
        rows.append(
            [
                phase,
                t,
                c,
                n,
                t / layers if per else (t - n) / layers,
                c / layers if per else (c - n) / layers,
            ]
        )
    print("\n== phases, median host µs, device idle before each")
    print(
        format_table(
            ["phase", "torch", "cupynorm", "no norms", "torch per layer", "cupynorm per layer"],
            rows,
        )
    )

    for idle in (False, True):
        fwd = {
            name: _layer_forward_us(norms[name], steps[name], 5, idle)
            for name in ("torch", "cupynorm")
        }
        slow = sorted(range(len(fwd["cupynorm"])), key=lambda i: -fwd["cupynorm"][i])[:5]
        print(
            f"\n== norm layers' forward host µs{', device idle before each' if idle else ''}: "
            f"sum {sum(fwd['torch']):.0f} | {sum(fwd['cupynorm']):.0f}, median "
            f"{statistics.median(fwd['torch']):.1f} | {statistics.median(fwd['cupynorm']):.1f} "
            "(torch | cupynorm); slowest cupynorm layers: "
            + ", ".join(
                f"#{i} {fwd['cupynorm'][i]:.0f} (torch {fwd['torch'][i]:.0f})" for i in slow
            )
        )

    calls = {name: _api_calls(steps[name]) for name in ("torch", "cupynorm")}
    names = sorted(
        set(calls["torch"]) | set(calls["cupynorm"]),
        key=lambda k: -calls["cupynorm"].get(k, (0, 0.0))[1],
    )
    rows = [
        [k, *calls["torch"].get(k, (0.0, 0.0)), *calls["cupynorm"].get(k, (0.0, 0.0))]
        for k in names
    ]
    print("\n== CUDA API calls per step (torch.profiler)")
    print(format_table(["call", "torch calls", "torch µs", "cupynorm calls", "cupynorm µs"], rows))
    for name in ("torch", "cupynorm"):
        found = _sync_ops(steps[name])
        print(f"\n== synchronizing torch operations in a {name} step: {len(found)}")
        for line in found[:6]:
            print("    " + line.replace("\n", "\n    "))


def _print_compiled(
    workload: ModelWorkload, variants: dict[str, Any], batch: Any, top: int, cprofile: bool
) -> None:
    """The compiled step of torch's and cupynorm's model: time, breaks, graphs, kernels (and
    with `cprofile` where its host time goes)."""
    import torch

    from cupynorm.bench import timing
    from cupynorm.bench.trainstep import TrainStep

    for name in ("torch", "cupynorm"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = variants[name]
        step = TrainStep(model, workload, *batch, forward=torch.compile(model))
        step()
        torch.cuda.synchronize()
        breaks = torch._dynamo.utils.counters["graph_break"]
        graphs = torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)
        ms = statistics.median(timing.time_cuda_ms(step, reps=10, warmup=3))
        _fastest, issue = _issue_us(step, 10)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as host:
            step()
            torch.cuda.synchronize()
        ops = [e for e in host.events() if e.name.startswith("cupynorm::")]
        with timing.cuda.profile() as profiler:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        events = timing.cuda.kernel_events(profiler)
        per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for kernel, us in events:
            per_name[kernel][0] += us / 3
            per_name[kernel][1] += 1 / 3
        print(
            f"\n== compiled, {name}: {ms:.2f} ms/step, issue {issue:.0f} µs, kernels "
            f"{sum(v[0] for v in per_name.values()) / 1e3:.2f} ms in {len(events) / 3:.0f} "
            f"launches, graph breaks {sum(breaks.values())}, graphs compiled {graphs}, "
            f"cupynorm op calls {len(ops)}"
        )
        if cprofile:
            print_cprofile(step, 5, f"the compiled {name} step", top=15)
        for reason, count in list(breaks.items())[:5]:
            print(f"   break x{count}: {str(reason)[:150]}")
        heaviest = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
        print(
            format_table(
                ["kernel", "ms", "launches"],
                [[k[:100], f"{v[0] / 1e3:.3f}", f"{v[1]:.0f}"] for k, v in heaviest],
            )
        )
        del step
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    """`profile model`."""
    import torch

    from cupynorm.bench import workloads
    from cupynorm.bench.trainstep import TrainStep, make_batch

    try:
        workload = workloads.MODEL_WORKLOADS_BY_NAME[args.row]
    except KeyError:
        names = ", ".join(workloads.MODEL_WORKLOADS_BY_NAME)
        raise ProfileError(f"unknown model row {args.row!r}; choose from: {names}") from None
    if args.batch is not None:
        shape = (args.batch, *workload.input_shape[1:])
        workload = dataclasses.replace(workload, input_shape=shape)
    variants = _models(workload)
    batch = make_batch(workload, workload.input_shape[0], "cuda", getattr(torch, workload.dtype), 0)
    steps = {name: TrainStep(model, workload, *batch) for name, model in variants.items()}
    print(
        f"{workload.name}: {workload.title}; input {workload.describe_input()}; cupynorm: "
        f"{workload.convert}; {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    _print_host(steps, args)
    if args.cprofile:
        print_cprofile(steps["cupynorm"], 5, "cupynorm's training step")
        print_cprofile(steps["torch"], 5, "torch's training step")
    if args.compile:
        _print_compiled(workload, variants, batch, args.top, args.cprofile)
    return 0
