"""Running one workload: check cupynorm against torch eager, then time eager, torch.compile and
cupynorm on the same inputs."""

from __future__ import annotations

import functools
import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import models, timing
from .checking import TOLERANCES, TensorCheck, Tolerance, compare_tensors
from .results import IMPL_COMPILE, IMPL_CUPYNORM, IMPL_EAGER, ImplResult, WorkloadResult
from .specs import Workload
from .timing import (
    ESTIMATE_REPS,
    HOST_LEAD_MS,
    TimingBudget,
    choose_reps,
    time_cuda_ms,
    time_per_call_ms,
)

if TYPE_CHECKING:
    import torch


@dataclass
class RunContext:
    """Settings shared by all workloads of one run."""

    quick: bool
    compile_enabled: bool
    fixed_reps: int | None
    flush_buffer: Any  # torch.Tensor
    budget: TimingBudget
    #: called with a model row's result after each of its modes (the bench writes its JSON so
    #: far: a run stopped at a time limit keeps what it measured)
    checkpoint: Callable[[Any], None] | None = None
    #: the model rows' modes (``--modes``); None: every mode (less the compiled ones without
    #: ``compile_enabled``)
    model_modes: tuple[str, ...] | None = None


def _error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def _perturb_affine_and_running_stats(module: torch.nn.Module, seed: int) -> None:
    """Make 1-D parameters and running statistics non-trivial, so the check covers them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.dim() == 1 and parameter.is_floating_point():
                noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
                parameter.add_(0.1 * noise)
        for name, buffer in module.named_buffers():
            if name.endswith("running_mean"):
                buffer.add_(0.1 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("running_var"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))


def _make_inputs(workload: Workload, quick: bool, device: Any, seed: int) -> list[torch.Tensor]:
    """Uniform [0, 1) inputs (like KernelBench's torch.rand), allocated in their final layout."""
    import torch

    dtype = _torch_dtype(workload.dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = []
    for shape in workload.shapes(quick):
        memory_format = torch.contiguous_format
        if workload.channels_last and len(shape) == 4:
            memory_format = torch.channels_last
        tensor = torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format)
        tensor.uniform_(0.0, 1.0, generator=generator)
        inputs.append(tensor)
    if workload.backward:
        inputs[0].requires_grad_(True)
    return inputs


def _make_step(
    module: Any,
    inputs: Sequence[torch.Tensor],
    grad_output: torch.Tensor | None,
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """The timed call: forward, or forward + backward (gradients returned, never accumulated)."""
    import torch

    if grad_output is None:

        def forward() -> tuple[torch.Tensor, ...]:
            return (module(*inputs),)

        return forward

    grad_targets = [t for t in inputs if t.requires_grad]
    grad_targets += [p for p in module.parameters() if p.requires_grad]

    def forward_backward() -> tuple[torch.Tensor, ...]:
        output = module(*inputs)
        grads = torch.autograd.grad(output, grad_targets, grad_outputs=grad_output)
        return (output, *grads)

    return forward_backward


def _step_output_names(
    module: torch.nn.Module, inputs: Sequence[torch.Tensor], backward: bool
) -> list[str]:
    """Names of the tensors `_make_step`'s call returns, in order."""
    names = ["y"]
    if backward:
        names += ["dx" if i == 0 else f"dinput{i}" for i, t in enumerate(inputs) if t.requires_grad]
        names += [f"d{name}" for name, p in module.named_parameters() if p.requires_grad]
    return names


def _run_and_collect(
    module: torch.nn.Module,
    step: Callable[[], tuple[torch.Tensor, ...]],
    inputs: Sequence[torch.Tensor],
    workload: Workload,
) -> dict[str, torch.Tensor]:
    """One call; its outputs and gradients by name, plus floating buffers after the call."""
    import torch

    with torch.set_grad_enabled(workload.backward):
        values = step()
    timing.cuda.synchronize()
    names = _step_output_names(module, inputs, workload.backward)
    if len(names) != len(values):
        raise RuntimeError(f"expected {len(names)} results ({', '.join(names)}), got {len(values)}")
    collected = {name: value.detach() for name, value in zip(names, values, strict=True)}
    for name, buffer in module.named_buffers():
        if buffer.is_floating_point():
            collected[f"{name} after one call"] = buffer.detach().clone()
    return collected


def _check_cupynorm(
    eager_values: dict[str, torch.Tensor],
    cupynorm_values: dict[str, torch.Tensor],
    tolerance: Tolerance,
) -> list[TensorCheck]:
    checks = []
    for name, expected in eager_values.items():
        actual = cupynorm_values.get(name)
        if actual is None:
            checks.append(TensorCheck(name, math.inf, math.inf, False, "missing in cupynorm"))
            continue
        checks.append(compare_tensors(name, actual, expected, tolerance))
    return checks


def _check_phase(
    eager_module: torch.nn.Module,
    cupynorm_module: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    grad_output: torch.Tensor | None,
    workload: Workload,
) -> list[TensorCheck]:
    """One call of each module on the same inputs; cupynorm's results checked against eager's.

    A function of its own so the full-size outputs are freed when it returns (or raises).
    """
    expected = _run_and_collect(
        eager_module, _make_step(eager_module, inputs, grad_output), inputs, workload
    )
    actual = _run_and_collect(
        cupynorm_module, _make_step(cupynorm_module, inputs, grad_output), inputs, workload
    )
    return _check_cupynorm(expected, actual, TOLERANCES[workload.dtype])


def _measure(
    step: Callable[[], object], workload: Workload, context: RunContext, impl: str
) -> ImplResult:
    """Time an implementation whose first call (compile) already happened; peak extra memory."""
    import torch

    result = ImplResult(impl=impl)
    with torch.set_grad_enabled(workload.backward):
        if workload.measure == "overhead":
            trials = context.fixed_reps or context.budget.overhead_trials
            per_call = time_per_call_ms(step, calls=context.budget.overhead_calls, trials=trials)
            result.reps = trials
            times = per_call
        else:
            # forward rows: the GPU's time (the host's is the per-call table's); forward +
            # backward rows: as a user's loop runs them, the host's share included
            lead = 0.0 if workload.backward else HOST_LEAD_MS
            timed = functools.partial(
                time_cuda_ms, step, flush_buffer=context.flush_buffer, host_lead_ms=lead
            )
            if context.fixed_reps is not None:
                reps = context.fixed_reps
                times = timed(reps=reps)
            else:
                estimate = timed(reps=ESTIMATE_REPS)
                reps = choose_reps(statistics.median(estimate) + lead, context.budget)
                times = timed(reps=reps, warmup=0)
            result.reps = reps
        result.ms = statistics.median(times)
        result.min_ms = min(times)
        result.max_ms = max(times)
        timing.cuda.synchronize()
        timing.cuda.reset_peak_memory_stats()
        baseline = timing.cuda.memory_allocated()
        outputs = step()
        timing.cuda.synchronize()
        result.peak_extra_bytes = max(0, timing.cuda.max_memory_allocated() - baseline)
        del outputs
    return result


def _launched_kernels(step: Callable[[], object], workload: Workload) -> list[dict]:
    """cupynorm's kernels in one call of ``step``, in launch order: name (with its element
    types), grid and block, dynamic shared memory, the kernel's registers and spills per
    thread, the CTAs an SM holds (occupancy: the share of the SM's threads they are) and the
    grid's waves of them over the GPU, and the kernel's GPU µs (torch.profiler; None where its
    name is not found)."""
    import torch

    from cupynorm import _compile

    properties = torch.cuda.get_device_properties(timing.cuda.device())
    with torch.set_grad_enabled(workload.backward):
        with _compile.recorded_launches() as launches, timing.cuda.profile() as profiler:
            step()
            timing.cuda.synchronize()
    events = timing.cuda.kernel_events(profiler)
    kernels, seen = [], 0
    for launcher, grid, block, smem in launches:
        attributes = _compile.launch_attributes(launcher, block, smem)
        threads = math.prod(block)
        ctas = math.prod(grid) if type(grid) is tuple else grid
        resident = attributes["ctas_per_sm"]
        us = None
        kernel = launcher.name.split("<")[0]
        for i in range(seen, len(events)):
            if events[i][0] == kernel:
                us, seen = events[i][1], i + 1
                break
        kernels.append(
            {
                "name": launcher.name,
                "grid": list(grid) if type(grid) is tuple else [grid],
                "block": list(block),
                "dynamic_smem_bytes": smem,
                **attributes,
                "occupancy": resident * threads / properties.max_threads_per_multi_processor,
                "waves": ctas / (resident * properties.multi_processor_count) if resident else None,
                "us": us,
            }
        )
    return kernels


def _time_safely(
    impl: str,
    make_step: Callable[[], Callable[[], object]],
    workload: Workload,
    context: RunContext,
) -> ImplResult:
    """Build, first-call (compile), and time one implementation; an exception becomes the row's
    error instead of stopping the run."""
    import torch

    try:
        step = make_step()
        with torch.set_grad_enabled(workload.backward):
            started = time.perf_counter()
            step()
            timing.cuda.synchronize()
            first_call_s = time.perf_counter() - started
        result = _measure(step, workload, context, impl)
        if impl == IMPL_COMPILE:
            result.compile_s = first_call_s
        if impl == IMPL_CUPYNORM:
            try:
                result.kernels = _launched_kernels(step, workload)
            except Exception as exc:  # noqa: BLE001 - the table is extra: the row stands
                _progress(f"    the kernel table failed: {_error_text(exc)}")
        return result
    except Exception as exc:  # noqa: BLE001 - any failure of one implementation is reported
        message = _error_text(exc)
        _progress(f"    {impl} failed: {message}")
        if impl == IMPL_CUPYNORM:
            traceback.print_exc(file=sys.stderr)
        return ImplResult(impl=impl, error=message)


def run_workload(workload: Workload, context: RunContext) -> WorkloadResult:
    """Check cupynorm against torch eager, then time eager, torch.compile and cupynorm: cupynorm's
    kernels at every size (the eager policy would give a small call torch's own op; the model
    rows keep the default, as a user gets it)."""
    try:
        import cupynorm.torch as cnt
    except ImportError:  # the row reports it, as cupynorm's build error
        return _run_workload(workload, context)
    previous = cnt.set_eager_min_bytes(0)
    try:
        return _run_workload(workload, context)
    finally:
        cnt.set_eager_min_bytes(previous)


def _run_workload(workload: Workload, context: RunContext) -> WorkloadResult:
    import torch

    result = WorkloadResult(workload=workload, quick=context.quick)
    device = timing.cuda.device()
    dtype = _torch_dtype(workload.dtype)
    try:
        torch.manual_seed(0)
        eager_module = models.build_module(workload.eager)
        _perturb_affine_and_running_stats(eager_module, seed=1)
        cupynorm_module: torch.nn.Module | None = None
        cupynorm_error: str | None = None
        try:
            torch.manual_seed(0)
            cupynorm_module = models.build_module(workload.cupynorm)
            cupynorm_module.load_state_dict(eager_module.state_dict())
            cupynorm_module.to(device=device, dtype=dtype).train()
        except Exception as exc:  # noqa: BLE001 - reported as cupynorm's error
            cupynorm_error = "building the module failed: " + _error_text(exc)
            traceback.print_exc(file=sys.stderr)
            cupynorm_module = None
        eager_module.to(device=device, dtype=dtype).train()
        inputs = _make_inputs(workload, context.quick, device, seed=2)
        grad_output = None
        if workload.backward:
            generator = torch.Generator(device=device).manual_seed(3)
            grad_output = torch.empty_like(inputs[0]).normal_(generator=generator)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: report and go on
        result.error = "setup failed: " + _error_text(exc)
        traceback.print_exc(file=sys.stderr)
        return result

    # 1. Correctness, before any timing (BatchNorm's running stats start equal in both modules).
    if cupynorm_module is not None:
        try:
            result.checks = _check_phase(
                eager_module, cupynorm_module, inputs, grad_output, workload
            )
        except Exception as exc:  # noqa: BLE001 - reported as cupynorm's error
            cupynorm_error = "running it failed: " + _error_text(exc)
            traceback.print_exc(file=sys.stderr)
        for check in result.checks:
            status = "ok" if check.ok else "WRONG"
            line = (
                f"    check {check.name}: {status} (max abs error {check.max_abs_error:.3g}, "
                f"{check.worst_ratio:.3g} of the tolerance)"
            )
            if check.note:
                line += f"; {check.note}"
            _progress(line)
        if result.cupynorm_wrong:
            _progress(f"!!! cupynorm is WRONG on {workload.name}: see the checks above !!!")
            wrong = [c for c in result.checks if not c.ok]
            cupynorm_error = "WRONG: " + "; ".join(
                f"{c.name} max abs error {c.max_abs_error:.3g} {c.note}".strip() for c in wrong
            )

    # 2. Timing: eager, torch.compile, cupynorm.
    result.impls.append(
        _time_safely(
            IMPL_EAGER, lambda: _make_step(eager_module, inputs, grad_output), workload, context
        )
    )
    if context.compile_enabled:

        def make_compiled_step() -> Callable[[], object]:
            compiled = torch.compile(eager_module)
            return _make_step(compiled, inputs, grad_output)

        result.impls.append(_time_safely(IMPL_COMPILE, make_compiled_step, workload, context))
    if cupynorm_error is not None or cupynorm_module is None:
        result.impls.append(ImplResult(impl=IMPL_CUPYNORM, error=cupynorm_error or "not built"))
    else:
        module = cupynorm_module
        result.impls.append(
            _time_safely(
                IMPL_CUPYNORM, lambda: _make_step(module, inputs, grad_output), workload, context
            )
        )
    return result


def _release_device_memory() -> None:
    """Drop compiled graphs and cached blocks between workloads (the big inputs are 7.5 GB)."""
    import torch

    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 - best effort
        pass
    gc.collect()
    timing.cuda.synchronize()
    timing.cuda.empty_cache()
