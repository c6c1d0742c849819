"""The models group (`--only models`): whole training steps with torch's norms and cupynorm's.

For each model workload, in one process, from the same initial weights and on the same batch:

1. Accuracy, once, eager, TF32 off (the flags are restored after): the output and the gradient
   of the loss with respect to the input, of torch in fp32 and of cupynorm in fp32, each against
   torch in float64 (`checking.max_relative_error`). cupynorm fails the row when its error is
   above 2x torch's (+ a tiny floor).
2. Four modes, each with torch's model and with `cupynorm.torch.fuse(copy.deepcopy(
   model))` (or the row's other conversion), each from a fresh copy of the initial weights:
   - eager: the step as written (`TrainStep`);
   - graphed: the whole step (zero_grad, forward, loss, backward, SGD step) captured in one CUDA
     graph with `torch.cuda.graph` after eager warm-up steps on a side stream, then replayed
     (`timing.CudaDevice.capture_graph`). Whole-step capture rather than
     `torch.cuda.make_graphed_callables`: it removes all host work from the step (both eager
     runs are host-bound, which is what the graphed comparison is for), the optimizer and the
     loss are in the graph too, and it asks of the norm layers only what any capture asks
     (launch on the current stream, allocate through torch, never synchronize), which torch's
     layers and cupynorm's both meet; make_graphed_callables would leave the loss and the
     optimizer eager and adds its own constraints (no module hooks, sample arguments per
     callable, autocast cache off). SGD needs no `capturable` flag (it keeps no step counter);
     the momentum buffers are created by the warm-up steps, outside the capture. A capture that
     fails is reported in that cell.
   - compile: `torch.compile(model)` in its default mode; the optimizer stays eager.
   - reduce-overhead: `torch.compile(model, mode="reduce-overhead")`: Inductor records the
     compiled forward and backward in CUDA graphs (its cudagraph trees; each step begins with
     `torch.compiler.cudagraph_mark_step_begin`); the optimizer and the loss stay eager. Where
     Inductor declines to graph (an op it cannot capture), it runs the compiled code without
     graphs and says why: the count of such skips is the cell's `note`.
   A mode that cannot run (a capture refused, a compile error) is that cell's error, the other
   cells and the row go on; `--no-compile` leaves out both compiled modes, `--modes` runs the
   modes it names (the eager host time without norm layers only with the eager mode).
   Step time: the median of several steps, CUDA events around each whole step, after warm-up
   steps (compiling / capturing happens there and is reported apart). In every mode the two
   steps are built (compiled) together and timed in alternating rounds (`ROUNDS`, and
   `HOST_PACED_ROUNDS` in the eager and compile modes, which the host paces at small batches);
   should both not fit in device memory at once, and in the graphed mode always
   (`ONE_GRAPH_AT_A_TIME`), one after the other. In eager mode also:
   GPU kernel time and norm-kernel time per step and kernel launches per norm layer, from
   `torch.profiler` over a few steps; and host time to issue one step (wall time of the Python
   call, the device idle before it, no synchronization inside it), once more for the model with
   its norm layers replaced by `nn.Identity`: the difference per norm layer is the host time of
   one norm layer's forward and backward, torch's and cupynorm's.

An inference workload (`ModelWorkload.inference`: a VAE decoding) times the forward alone,
under torch.no_grad with the model in eval mode, in the same modes; its accuracy check is the
same (the output, and the input gradient of the loss against a target of the output's shape).

torch, torchvision and cupynorm are imported when a workload runs; a row whose model needs a
package that is not installed (torchvision, timm, transformers, diffusers:
`models.OPTIONAL_PACKAGES`) is skipped (a row that says so; the run does not fail), a model that
cannot be built otherwise becomes an error row.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import models, timing
from .checking import max_relative_error
from .results import (
    COMPILED_MODES,
    MODE_COMPILE,
    MODE_EAGER,
    MODE_GRAPHED,
    MODE_REDUCE_OVERHEAD,
    MODEL_CUPYNORM,
    MODEL_IMPLS,
    AccuracyCheck,
    ModelResult,
    StepResult,
)
from .run import RunContext, _error_text, _progress, _release_device_memory
from .specs import ModelWorkload
from .timing import time_cuda_ms
from .trainstep import (
    KernelSummary,
    TrainStep,
    convert_model,
    make_batch,
    on_device,
    summarize_kernels,
    training_loss,
)

if TYPE_CHECKING:
    import torch

# Steps timed per (mode, implementation): full run / --quick (--reps N overrides).
STEPS_FULL = 10
STEPS_QUICK = 5
WARMUP_STEPS = 3  # before timing; the compile mode compiles in the first of them
GRAPH_WARMUP_STEPS = 3  # eager steps on a side stream before the capture
HOST_STEPS = 9  # eager steps whose issue time is measured (median)
# The steps of torch and of cupynorm are timed in rounds that alternate them (in reversed order
# every other round), eager issue times interleaved the same way: both are host-bound at small
# batches, compiled or not, and a host's speed drifts within a run (resnet50 batch 64 on one
# H200: the same eager code measured 0.54x and 0.86x of torch's step when each was timed in one
# block; on one H100 two identical compiled graphs 0.79x).
ROUNDS = 3
#: Rounds of the eager and compile modes, whose steps the host paces at small batches: its speed
#: drifts in windows of about a second (convnext_tiny b64 eager, H200, 11-27: 0.85x and 1.07x in
#: consecutive 20-step windows of the same code), so these modes alternate in more rounds (of
#: `steps` steps each), for a median that the drift moves less. It still moves: two copies of
#: torch's own mobilenetv3 gave 0.94x eager and 0.87x compiled (H200, 11-28; `bench --aa`).
HOST_PACED_ROUNDS = 8
#: Whole-step graphs are captured, timed and freed one implementation at a time: with two such
#: graphs alive in one process, replaying the first faults (illegal address) on torch 2.11 /
#: CUDA 13 (H200, 2026-11-27; two captures of torch's own resnet50 step alike, so not the norm
#: layers; one at a time, torch's and cupynorm's captured in turn, replay cleanly). A graphed
#: step is GPU-paced, so the order bias the alternating rounds guard against is small there.
ONE_GRAPH_AT_A_TIME = True
PROFILE_STEPS = 2  # eager steps under torch.profiler
# torch.compile(model, **COMPILE_OPTIONS): the default mode.
COMPILE_OPTIONS: dict[str, Any] = {}
# torch.compile(model, **REDUCE_OVERHEAD_OPTIONS): Inductor with its CUDA graphs (cudagraph trees)
REDUCE_OVERHEAD_OPTIONS: dict[str, Any] = {"mode": "reduce-overhead"}


# ------------------------------------------------------------------------------------------------
# Accuracy
# ------------------------------------------------------------------------------------------------


def _output_and_input_grad(
    model: torch.nn.Module, workload: ModelWorkload, inputs: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    inputs = inputs.detach().requires_grad_(True)
    output = model(inputs)
    (grad,) = torch.autograd.grad(training_loss(workload, output, target), [inputs])
    return output.detach(), grad.detach()


def check_accuracy(base: torch.nn.Module, workload: ModelWorkload) -> AccuracyCheck:
    """Errors of torch fp32 and cupynorm fp32 against torch float64, eager, TF32 off."""
    import torch

    device = timing.cuda.device()
    batch = workload.accuracy_batch or workload.input_shape[0]
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32 = False
    cudnn.allow_tf32 = False
    try:
        inputs64, target64 = make_batch(workload, batch, device, torch.float64, seed=11)
        reference = _output_and_input_grad(
            on_device(copy.deepcopy(base), workload, device, torch.float64),
            workload,
            inputs64,
            target64,
        )
        inputs32 = inputs64.float()
        target32 = target64 if not target64.is_floating_point() else target64.float()
        errors = []
        for make in (copy.deepcopy, lambda m: convert_model(copy.deepcopy(m), workload)):
            model = on_device(make(base), workload, device, torch.float32)
            output, grad = _output_and_input_grad(model, workload, inputs32, target32)
            errors.append(
                (max_relative_error(output, reference[0]), max_relative_error(grad, reference[1]))
            )
            del model, output, grad
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved
    (output_torch, grad_torch), (output_cupynorm, grad_cupynorm) = errors
    return AccuracyCheck(
        batch=batch,
        output_torch=output_torch,
        output_cupynorm=output_cupynorm,
        grad_torch=grad_torch,
        grad_cupynorm=grad_cupynorm,
    )


# ------------------------------------------------------------------------------------------------
# Timing one (mode, implementation)
# ------------------------------------------------------------------------------------------------


def _issue_us(step: Callable[[], object]) -> float:
    """Wall time to issue one step, started with the device idle."""
    timing.cuda.synchronize()
    started = time.perf_counter()
    step()
    issued = (time.perf_counter() - started) * 1e6
    timing.cuda.synchronize()
    return issued


def _peak_extra_bytes(step: Callable[[], object]) -> int:
    """The peak a step allocates beyond what was allocated before it (both models of an eager
    pair stay allocated: what each step adds is its own)."""
    timing.cuda.synchronize()
    baseline = timing.cuda.memory_allocated()
    timing.cuda.reset_peak_memory_stats()
    step()
    timing.cuda.synchronize()
    return max(0, timing.cuda.max_memory_allocated() - baseline)


def _host_us(step: Callable[[], object], steps: int) -> float:
    """Median wall time to issue one step, starting each with the device idle."""
    return statistics.median(_issue_us(step) for _ in range(steps))


def _host_us_without_norms(
    base: torch.nn.Module, workload: ModelWorkload, batch: tuple[torch.Tensor, torch.Tensor]
) -> float:
    """Eager issue time of a step of the model with its norm layers replaced by nn.Identity."""
    import torch

    model = models.strip_norms(copy.deepcopy(base))
    model = on_device(model, workload, timing.cuda.device(), getattr(torch, workload.dtype))
    step = TrainStep(model, workload, *batch)
    for _ in range(WARMUP_STEPS):
        step()
    return _host_us(step, HOST_STEPS)


def _profile(step: Callable[[], object], steps: int) -> KernelSummary:
    timing.cuda.synchronize()
    with timing.cuda.profile() as profiler:
        for _ in range(steps):
            step()
        timing.cuda.synchronize()
    return summarize_kernels(timing.cuda.kernel_events(profiler), steps)


def _release_memory_reporting_failure() -> None:
    """`_release_device_memory`, a failure reported rather than raised (what comes next
    reports its consequence)."""
    try:
        _release_device_memory()
    except Exception as exc:  # noqa: BLE001 - best effort between cells
        _progress(f"    releasing device memory failed: {_error_text(exc)}")


def _run_step(
    base: torch.nn.Module,
    workload: ModelWorkload,
    batch: tuple[torch.Tensor, torch.Tensor],
    mode: str,
    impl: str,
    steps: int,
) -> StepResult:
    """Build a fresh copy of the model for `impl`, run `mode`, time it."""
    result = StepResult(mode=mode, impl=impl)
    step = _built_step(base, workload, batch, mode, impl, result)
    _record_times(result, time_cuda_ms(step, reps=steps, warmup=WARMUP_STEPS))
    if mode == MODE_EAGER:
        result.host_us = _host_us(step, HOST_STEPS)
        result.peak_extra_bytes = _peak_extra_bytes(step)
        _record_profile(result, step)
    return result


def _built_step(
    base: torch.nn.Module,
    workload: ModelWorkload,
    batch: tuple[torch.Tensor, torch.Tensor],
    mode: str,
    impl: str,
    result: StepResult,
) -> Callable[[], object]:
    """A fresh copy of the model for `impl`, its step for `mode`, run (or captured) once; the
    time that took is `result.setup_s`."""
    import torch

    model = copy.deepcopy(base)
    if impl == MODEL_CUPYNORM:
        model = convert_model(model, workload)
    model = on_device(model, workload, timing.cuda.device(), getattr(torch, workload.dtype))
    forward = None
    if mode == MODE_COMPILE:
        forward = torch.compile(model, **COMPILE_OPTIONS)
    elif mode == MODE_REDUCE_OVERHEAD:
        forward = torch.compile(model, **REDUCE_OVERHEAD_OPTIONS)
    trainer = TrainStep(
        model, workload, *batch, forward=forward, mark_step=mode == MODE_REDUCE_OVERHEAD
    )
    step: Callable[[], object] = trainer
    skips_before = _cudagraph_skips()
    started = time.perf_counter()
    if mode == MODE_GRAPHED:
        step = timing.cuda.capture_graph(trainer, warmup=GRAPH_WARMUP_STEPS)
    else:
        step()  # compiled modes: compile forward and backward here
        if mode == MODE_REDUCE_OVERHEAD:
            step()  # the cudagraph trees record on the second call, replay from the third
    timing.cuda.synchronize()
    result.setup_s = time.perf_counter() - started
    skipped = _cudagraph_skips() - skips_before
    if skipped:
        result.note = f"Inductor ran {skipped} graph(s) without CUDA graphs (see its log)"
    return step


def _cudagraph_skips() -> int:
    """Graphs Inductor compiled but declined to run as CUDA graphs so far (its counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return 0
    return int(counters["inductor"].get("cudagraph_skips", 0))


def _record_times(result: StepResult, times: list[float]) -> None:
    result.ms = statistics.median(times)
    result.min_ms, result.max_ms, result.reps = min(times), max(times), len(times)


def _record_profile(result: StepResult, step: Callable[[], object]) -> None:
    summary = _profile(step, PROFILE_STEPS)
    result.kernel_ms = summary.kernel_ms
    result.norm_kernel_ms = summary.norm_kernel_ms
    result.kernels = summary.kernels
    result.norm_kernels = summary.norm_kernels
    result.norm_kernel_ms_by_name = summary.norm_kernel_ms_by_name


def _run_pair(
    base: torch.nn.Module,
    workload: ModelWorkload,
    batch: tuple[torch.Tensor, torch.Tensor],
    mode: str,
    steps: int,
) -> list[StepResult]:
    """The step of each implementation in `mode`, both built (compiled, captured) first, then
    timed in rounds (`ROUNDS`; `HOST_PACED_ROUNDS` in eager and compile mode) of `steps` steps
    that alternate them (reversed every other round): a compiled step is host-paced at small
    batches as an eager one is, and timed one after the other the second of two identical
    compiled graphs measured up to 0.79x of the first (resnet50 b64, H100). Eager steps also
    get their issue times (interleaved alike), peak memory and kernel profile. A cell that
    fails is that cell's error; the other goes on alone. Raises the device's out-of-memory
    error when both do not fit at once."""
    import torch

    results = {impl: StepResult(mode=mode, impl=impl) for impl in MODEL_IMPLS}
    live: dict[str, Callable[[], object]] = {}
    impls = _build_order(workload)

    def fail(impl: str, exc: Exception) -> None:
        traceback.print_exc(file=sys.stderr)
        results[impl].error = _error_text(exc)
        live.pop(impl, None)

    for impl in impls:
        try:
            live[impl] = _built_step(base, workload, batch, mode, impl, results[impl])
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - one failing cell must not stop the other
            fail(impl, exc)
    times: dict[str, list[float]] = {impl: [] for impl in live}
    issue: dict[str, list[float]] = {impl: [] for impl in live}

    def alternating(index: int) -> list[str]:
        order = [impl for impl in impls if impl in live]
        return order if index % 2 == 0 else order[::-1]

    rounds = HOST_PACED_ROUNDS if mode in (MODE_EAGER, MODE_COMPILE) else ROUNDS
    for r in range(rounds):
        for impl in alternating(r):
            try:
                warmup = WARMUP_STEPS if r == 0 else 1
                times[impl] += time_cuda_ms(live[impl], reps=steps, warmup=warmup)
            except Exception as exc:  # noqa: BLE001
                fail(impl, exc)
    if mode == MODE_EAGER:
        for i in range(HOST_STEPS):
            for impl in alternating(i):
                try:
                    issue[impl].append(_issue_us(live[impl]))
                except Exception as exc:  # noqa: BLE001
                    fail(impl, exc)
    for impl, step in list(live.items()):
        result = results[impl]
        try:
            _record_times(result, times[impl])
            if mode == MODE_EAGER:
                result.host_us = statistics.median(issue[impl])
                result.peak_extra_bytes = _peak_extra_bytes(step)
                _record_profile(result, step)
        except Exception as exc:  # noqa: BLE001
            fail(impl, exc)
    return [results[impl] for impl in MODEL_IMPLS]


def _run_pair_safely(
    base: torch.nn.Module,
    workload: ModelWorkload,
    batch: tuple[torch.Tensor, torch.Tensor],
    mode: str,
    steps: int,
) -> list[StepResult]:
    """`_run_pair`; when both do not fit in device memory at once, each step alone
    (`_run_step_safely`), as the graphed mode always is (`ONE_GRAPH_AT_A_TIME`). Device
    memory (and compiled graphs) freed after."""
    import torch

    results = None
    if mode != MODE_GRAPHED or not ONE_GRAPH_AT_A_TIME:
        try:
            results = _run_pair(base, workload, batch, mode, steps)
        except torch.cuda.OutOfMemoryError:
            _progress(f"    both {mode} models do not fit at once: timed one after the other")
    _release_memory_reporting_failure()
    if results is None:
        results = [
            _run_step_safely(base, workload, batch, mode, impl, steps)
            for impl in _build_order(workload)
        ]
        results.sort(key=lambda r: MODEL_IMPLS.index(r.impl))
    return results


def _build_order(workload: ModelWorkload) -> tuple[str, ...]:
    """The implementations in the order they are built and first timed: torch's model first,
    or cupynorm's (`ModelWorkload.cupynorm_first`)."""
    return MODEL_IMPLS[::-1] if workload.cupynorm_first else MODEL_IMPLS


def _run_step_safely(
    base: torch.nn.Module,
    workload: ModelWorkload,
    batch: tuple[torch.Tensor, torch.Tensor],
    mode: str,
    impl: str,
    steps: int,
) -> StepResult:
    """`_run_step`, with an exception reported as the cell's error; device memory freed after."""
    try:
        result = _run_step(base, workload, batch, mode, impl, steps)
    except Exception as exc:  # noqa: BLE001 - one failing mode must not stop the others
        traceback.print_exc(file=sys.stderr)
        result = StepResult(mode=mode, impl=impl, error=_error_text(exc))
    _release_memory_reporting_failure()
    return result


def _step_line(result: StepResult) -> str:
    if result.error is not None:
        return f"    {result.mode} {result.impl}: ERROR {result.error}"
    line = f"    {result.mode} {result.impl}: {result.ms:.4g} ms/step"
    if result.setup_s is not None and result.mode != MODE_EAGER:
        line += f" (setup {result.setup_s:.1f} s)"
    if result.note:
        line += f"; {result.note}"
    if result.kernel_ms is not None:
        line += (
            f"; kernels {result.kernel_ms:.4g} ms, norm kernels {result.norm_kernel_ms:.4g} ms, "
            f"host {result.host_us:.0f} us per step"
        )
    return line


def run_model_workload(workload: ModelWorkload, context: RunContext) -> ModelResult:
    """Accuracy check, then every mode with torch's norms and cupynorm's (see the module doc)."""
    import torch

    result = ModelResult(workload=workload, quick=context.quick)
    try:
        torch.manual_seed(0)
        base = models.build_model(workload)
        result.norm_layers = models.count_norm_layers(base)
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if package not in models.OPTIONAL_PACKAGES:
            raise
        result.skipped = f"{package} is not installed"
        _progress(f"    skipped: {result.skipped}")
        return result
    except Exception as exc:  # noqa: BLE001 - e.g. a model that cannot be built: an error row
        result.error = "setup failed: " + _error_text(exc)
        _progress(f"    {result.error}")
        return result

    try:
        result.accuracy = check_accuracy(base, workload)
        a = result.accuracy
        status = "ok" if a.ok else "WORSE THAN 2x TORCH"
        _progress(
            f"    accuracy vs float64 (batch {a.batch}): output torch {a.output_torch:.3g}, "
            f"cupynorm {a.output_cupynorm:.3g}; input gradient torch {a.grad_torch:.3g}, "
            f"cupynorm {a.grad_cupynorm:.3g}: {status}"
        )
    except Exception as exc:  # noqa: BLE001 - reported, and fails the row
        result.accuracy_error = _error_text(exc)
        _progress(f"    accuracy check failed: {result.accuracy_error}")
        traceback.print_exc(file=sys.stderr)
    _release_memory_reporting_failure()

    try:
        batch = make_batch(
            workload,
            workload.input_shape[0],
            timing.cuda.device(),
            getattr(torch, workload.dtype),
            seed=2,
        )
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory
        result.error = "setup failed: " + _error_text(exc)
        return result
    modes = [
        mode
        for mode in (MODE_EAGER, MODE_GRAPHED, *COMPILED_MODES)
        if (context.model_modes is None or mode in context.model_modes)
        and (context.compile_enabled or mode not in COMPILED_MODES)
    ]
    if MODE_EAGER in modes:  # the eager cells' host time per norm layer
        try:
            result.host_us_without_norms = _host_us_without_norms(base, workload, batch)
            # fmt: off
            _progress(f"    eager host time without norm layers: "
                      f"{result.host_us_without_norms:.0f} us")
            # fmt: on
        except Exception as exc:  # noqa: BLE001 - the per-layer column stays empty
            _progress(f"    host time without norm layers failed: {_error_text(exc)}")
        _release_memory_reporting_failure()
    steps = context.fixed_reps or (STEPS_QUICK if context.quick else STEPS_FULL)
    for mode in modes:
        for step_result in _run_pair_safely(base, workload, batch, mode, steps):
            _progress(_step_line(step_result))
            result.steps.append(step_result)
        if context.checkpoint is not None:
            context.checkpoint(result)
    return result
