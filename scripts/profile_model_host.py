"""Host time of a whole model's training step, torch's norm layers against cupynorm's, and where
cupynorm's goes.

A host-bound step (small batch) costs what its layers take to issue; this runs torchvision's
resnet50 (bf16 autocast, channels_last; or timm's vit_base / convnext_tiny: ``--model``) and
reports, per batch size, the issue time of a step (zero_grad, forward, backward, SGD step)
starting with the device idle, for each model, the difference per norm layer, the caching
allocator's cudaMalloc calls, the CUDA runtime and driver calls of a step (torch.profiler: any
call that waits for the device shows here), torch's synchronizing operations
(`torch.cuda.set_sync_debug_mode`, with the Python stack of each), the host time of each norm
layer's forward (hooks), and optionally a cProfile of the cupynorm step.

If the issue time per norm layer grows with the batch, something on the host path waits for the
device.

Usage: python scripts/profile_model_host.py [--model resnet50|vit_base|convnext_tiny]
       [--batch N ...] [--convert replace|fuse] [--steps N] [--cprofile]

(``--convert`` applies to resnet50; the timm models get their LayerNorms converted.)
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import pstats
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _program  # noqa: E402

NORM_TYPES = (torch.nn.BatchNorm2d, torch.nn.LayerNorm)  # cupynorm's modules subclass them


def _step_fn(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        optimizer.step()

    return step


def _issue_us(step, steps: int) -> tuple[float, float]:
    """(best, median) wall time to issue one step, each started with the device idle."""
    for _ in range(5):
        step()
    samples = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return min(samples), statistics.median(samples)


def _phases_us(
    model: torch.nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    steps: int,
    engine_threads: bool = True,
    idle: bool = False,
) -> dict:
    """Median issue time of each phase of a step (forward + loss, backward, optimizer step), each
    started with the device idle, and of cupynorm's own backward functions inside the backward
    (they run on the autograd engine's device thread: timed by a wrapper, summed per step).
    ``engine_threads=False``: the backward under ``torch.autograd.set_multithreading_enabled(
    False)``, every node run on the calling thread. ``idle``: each of cupynorm's backward functions
    timed with the device idle before it (a synchronize first, outside the timing): its own host
    time, with no wait for a full launch queue in it."""
    from cupynorm.torch import _autograd, _batch_norm, _channel_norm, _row_norm

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    inside = [0.0]
    functions = [
        _batch_norm._BatchNormFunction,
        _batch_norm._BatchNormActFunction,
        _row_norm._RowNormFunction,
        _channel_norm._ChannelNormFunction,
        _autograd._ReplayFunction,
    ]
    originals = [f.__dict__["backward"] for f in functions]  # the staticmethods

    def timed(backward):
        def run(ctx, *grads):
            if idle:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return backward(ctx, *grads)
            finally:
                inside[0] += time.perf_counter() - start

        return staticmethod(run)

    samples: dict[str, list[float]] = collections.defaultdict(list)
    for f, original in zip(functions, originals, strict=True):
        f.backward = timed(original.__func__)
    try:
        for i in range(steps + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), target)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            inside[0] = 0.0
            t2 = time.perf_counter()
            with torch.autograd.set_multithreading_enabled(engine_threads):
                loss.backward()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            optimizer.step()
            t5 = time.perf_counter()
            if i >= 3:
                samples["forward"].append((t1 - t0) * 1e6)
                samples["backward"].append((t3 - t2) * 1e6)
                samples["norm backward functions"].append(inside[0] * 1e6)
                samples["optimizer"].append((t5 - t4) * 1e6)
    finally:
        for f, original in zip(functions, originals, strict=True):
            f.backward = original
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in samples.items()}


def _api_calls(step, steps: int = 3) -> dict[str, tuple[float, float]]:
    """{CUDA runtime/driver call: (calls per step, host us per step)} under torch.profiler."""
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
            and name.startswith(("cuda", "cu"))
            and (not name.startswith("cudnn"))
        ):
            calls[name][0] += 1
            calls[name][1] += event.cpu_time_total
    return {k: (n / steps, us / steps) for k, (n, us) in calls.items()}


def _sync_ops(step) -> list[str]:
    """torch operations of one step that synchronize with the device, with where they came from."""
    found: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize()
        for w in caught:
            found.append(f"{w.message}")
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    if found:  # again as errors, for the stack of the first one
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError:
            found.append("".join(traceback.format_exc(limit=-12)))
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.synchronize()
    return found


def _layer_forward_us(
    model: torch.nn.Module, step, steps: int = 5, idle: bool = False
) -> list[float]:
    """Median host us of each norm layer's forward call, in model order; ``idle``: each started
    with the device idle (a synchronize in the pre-hook: the layer's own host time, no wait for
    a full launch queue in it)."""

    def start(i: int) -> None:
        if idle:
            torch.cuda.synchronize()
        starts[i] = time.perf_counter()

    times: dict[int, list[float]] = collections.defaultdict(list)
    starts: dict[int, float] = {}
    handles = []
    layers = [m for m in model.modules() if isinstance(m, NORM_TYPES)]
    for i, m in enumerate(layers):
        handles.append(m.register_forward_pre_hook(lambda _m, _a, i=i: start(i)))
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
        for h in handles:
            h.remove()
    return [statistics.median(times[i]) for i in range(len(layers))]


def _model(name: str) -> tuple[torch.nn.Module, bool]:
    """(the model on the GPU, whether it runs channels_last)."""
    if name == "resnet50":
        import torchvision

        model, channels_last = torchvision.models.resnet50(), True
    else:
        import timm

        timm_name = {"vit_base": "vit_base_patch16_224", "convnext_tiny": "convnext_tiny"}[name]
        model, channels_last = timm.create_model(timm_name), name != "vit_base"
    model = model.cuda()
    return (model.to(memory_format=torch.channels_last) if channels_last else model), channels_last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model", choices=("resnet50", "vit_base", "convnext_tiny"), default="resnet50"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--convert", choices=("replace", "fuse"), default="replace")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    theirs, channels_last = _model(args.model)
    if args.model != "resnet50":  # LayerNorm is opt-in (replace_norms' docstring)
        ours = cnt.replace_norms(copy.deepcopy(theirs), include=[torch.nn.LayerNorm])
    else:
        convert = cnt.replace_norms if args.convert == "replace" else cnt.fuse
        ours = convert(copy.deepcopy(theirs))
    converted = sum(
        any(c.__module__.startswith("cupynorm") for c in type(m).__mro__) for m in ours.modules()
    )
    assert converted, "no norm layer converted"
    layers = sum(isinstance(m, NORM_TYPES) for m in theirs.modules())
    stripped = copy.deepcopy(theirs)
    for parent in list(stripped.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, NORM_TYPES):
                setattr(parent, name, torch.nn.Identity())
    layout = "channels_last" if channels_last else "contiguous"
    print(f"{args.model} bf16 autocast {layout}, {layers} norm layers, cupynorm: {args.convert}")
    for batch in args.batch:
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        target = torch.randint(0, 1000, (batch,), device="cuda")
        steps = {
            name: _step_fn(m, x, target)
            for name, m in (("torch", theirs), ("cupynorm", ours), ("no norms", stripped))
        }

        def device_mallocs() -> int:
            return torch.cuda.memory_stats().get("num_device_alloc", 0)

        issue, mallocs = {}, {}
        for name, step in steps.items():
            before = device_mallocs()
            issue[name] = _issue_us(step, args.steps)
            mallocs[name] = device_mallocs() - before
        print(f"\n== batch {batch}: host us to issue a step (best / median), cudaMalloc calls")
        for name, (best, median) in issue.items():
            print(f"  {name:9s} {best:9.0f} / {median:9.0f}   mallocs {mallocs[name]}")
        base = issue["no norms"][1]
        for name in ("torch", "cupynorm"):
            print(
                f"  {name} per norm layer (median - no norms) / {layers}: "
                f"{(issue[name][1] - base) / layers:.0f} us"
            )
        for threads, idle in ((True, False), (False, False), (True, True)):
            phases = {
                name: _phases_us(m, x, target, args.steps, threads, idle)
                for name, m in (("torch", theirs), ("cupynorm", ours), ("no norms", stripped))
            }
            print(
                "  issue us per phase (median, device idle before each), autograd engine threads "
                f"{'on (default)' if threads else 'off'}"
                f"{', device idle before each norm backward' if idle else ''}: "
                "torch | cupynorm | no norms"
            )
            for phase in phases["torch"]:
                t, c, n = (phases[k][phase] for k in ("torch", "cupynorm", "no norms"))
                print(
                    f"    {phase:24s} {t:8.0f} | {c:8.0f} | {n:8.0f}   per norm layer "
                    f"{(t - n) / layers:6.1f} | {(c - n) / layers:6.1f}"
                )
        calls = {name: _api_calls(steps[name]) for name in ("torch", "cupynorm")}
        names = sorted(
            set(calls["torch"]) | set(calls["cupynorm"]),
            key=lambda k: -calls["cupynorm"].get(k, (0, 0))[1],
        )
        print("  CUDA API per step: calls and host us, torch | cupynorm")
        for k in names:
            t = calls["torch"].get(k, (0, 0.0))
            c = calls["cupynorm"].get(k, (0, 0.0))
            print(f"    {k:34s} {t[0]:7.1f} {t[1]:9.0f} | {c[0]:7.1f} {c[1]:9.0f}")
        for name in ("torch", "cupynorm"):
            found = _sync_ops(steps[name])
            print(f"  synchronizing torch ops in a {name} step: {len(found)}")
            for line in found[:6]:
                print("    " + line.replace("\n", "\n    "))
        for idle in (False, True):
            fwd = {
                name: _layer_forward_us(m, steps[name], idle=idle)
                for name, m in (("torch", theirs), ("cupynorm", ours))
            }
            when = ", device idle before each" if idle else ""
            print(f"  norm layer forward host us (median per layer{when}): torch | cupynorm")
            print(
                f"    sum {sum(fwd['torch']):.0f} | {sum(fwd['cupynorm']):.0f}; "
                f"median {statistics.median(fwd['torch']):.1f} | "
                f"{statistics.median(fwd['cupynorm']):.1f}; "
                f"max {max(fwd['torch']):.0f} | {max(fwd['cupynorm']):.0f}"
            )
            slow = sorted(range(len(fwd["cupynorm"])), key=lambda i: -fwd["cupynorm"][i])[:5]
            print(
                "    slowest cupynorm layers: "
                + ", ".join(
                    f"#{i} {fwd['cupynorm'][i]:.0f} (torch {fwd['torch'][i]:.0f})" for i in slow
                )
            )
    unrecordable = sum(p is _program._UNRECORDABLE for p in _program._PROGRAMS.values())
    print(f"\nprograms: {len(_program._PROGRAMS)} recorded signatures, {unrecordable} unrecordable")
    if args.cprofile:
        step = steps["cupynorm"]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(5):
            step()
        profile.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats("cupynorm", 25)


if __name__ == "__main__":
    main()
