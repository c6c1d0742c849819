"""Timing on the GPU: the device facade, L2 flush, CUDA-event timing, copy bandwidth, reps.

The bench reaches the GPU only through `cuda`, the one `CudaDevice` of this module, and reads it
as `timing.cuda` at call time. A CPU dry run (tests/test_bench_cpu.py) swaps that object for a
stand-in; nothing of torch's own (`torch.cuda.*`) is ever patched, so no torch cache of device
queries can keep a fake answer after the test.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# L2 flush: overwrite at least this much (and at least twice the L2 size) before each repetition.
MIN_FLUSH_BYTES = 256 * 1024**2
# Device-to-device copy used to measure copy bandwidth: far larger than any L2.
COPY_BANDWIDTH_BYTES = 1024**3
COPY_BANDWIDTH_REPS = 20

WARMUP_CALLS = 3
ESTIMATE_REPS = 3
# Host + flush cost of one repetition besides the timed operation (zeroing 256 MB ~ 0.07 ms).
PER_REP_OVERHEAD_MS = 0.1
# The GPU's lead over the host for forward rows (time_cuda_ms's `host_lead_ms`): a spin this long
# before each repetition. It must exceed the host's time to issue one repetition (the slowest
# calls measured, torch.compile's on a slow host, ~0.1-0.2 ms).
HOST_LEAD_MS = 0.5


@dataclass(frozen=True)
class TimingBudget:
    """How long each implementation of a throughput workload is timed (after warm-up)."""

    budget_ms: float  # wall time aimed at for the repetitions of one implementation
    min_reps: int
    max_reps: int
    overhead_calls: int  # back-to-back calls per trial of a host-overhead workload
    overhead_trials: int


FULL_BUDGET = TimingBudget(
    budget_ms=800.0, min_reps=10, max_reps=1000, overhead_calls=1000, overhead_trials=7
)
QUICK_BUDGET = TimingBudget(
    budget_ms=150.0, min_reps=5, max_reps=100, overhead_calls=300, overhead_trials=3
)


def throughput_tbps(nbytes: int, ms: float) -> float:
    """Terabytes (1e12 bytes) per second for `nbytes` moved in `ms` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e12


def choose_reps(estimated_ms: float, budget: TimingBudget) -> int:
    """Repetitions that fill the time budget, clamped to [min_reps, max_reps]."""
    per_rep_ms = max(estimated_ms, 0.0) + PER_REP_OVERHEAD_MS
    reps = int(budget.budget_ms / per_rep_ms)
    return max(budget.min_reps, min(budget.max_reps, reps))


def l2_flush_bytes(l2_cache_bytes: int) -> int:
    """Size of the buffer overwritten before each repetition: >= 2x L2 and >= 256 MB."""
    return max(MIN_FLUSH_BYTES, 2 * max(l2_cache_bytes, 0))


# ------------------------------------------------------------------------------------------------
# The device facade (torch imported lazily)
# ------------------------------------------------------------------------------------------------


class CudaDevice:
    """Everything the bench asks of the GPU, on torch's current CUDA device."""

    _cycles_per_ms: float | None = None  # of `spin`, measured on first use

    def is_available(self) -> bool:
        """Whether torch sees a CUDA GPU."""
        import torch

        return torch.cuda.is_available()

    def device(self) -> torch.device:
        """The device benchmarked: torch's current CUDA device."""
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def synchronize(self) -> None:
        """Wait for all work queued on the device."""
        import torch

        torch.cuda.synchronize()

    def event(self) -> Any:
        """A CUDA event that records time (`record`, `synchronize`, `elapsed_time`)."""
        import torch

        return torch.cuda.Event(enable_timing=True)

    def spin(self, ms: float) -> None:
        """Queue a kernel that keeps the GPU busy for about `ms` milliseconds and touches no
        memory (torch's `_sleep`, its clock cycles per millisecond measured on first use)."""
        import torch

        if self._cycles_per_ms is None:
            cycles = 1 << 20
            for _ in range(2):  # the first one pays any lazy start-up
                start, end = self.event(), self.event()
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
            self._cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)
        torch.cuda._sleep(max(1, int(ms * self._cycles_per_ms)))

    def properties(self) -> Any:
        """torch's device properties (`total_memory`, `L2_cache_size`, ...)."""
        import torch

        return torch.cuda.get_device_properties(torch.cuda.current_device())

    def name(self) -> str:
        """The GPU's name, e.g. "NVIDIA H200"."""
        import torch

        return torch.cuda.get_device_name()

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak of allocated memory."""
        import torch

        torch.cuda.reset_peak_memory_stats()

    def memory_allocated(self) -> int:
        """Bytes held by live tensors."""
        import torch

        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        """Peak of `memory_allocated` since the last reset."""
        import torch

        return torch.cuda.max_memory_allocated()

    def empty_cache(self) -> None:
        """Give cached, unused blocks back to the driver."""
        import torch

        torch.cuda.empty_cache()

    def autocast(self, dtype: str | None) -> AbstractContextManager[Any]:
        """Autocast on this device in `dtype` ("bfloat16", "float16"); None: no autocast.

        The weight-cast cache is off: under CUDA-graph capture a cast cached outside the capture
        would be read inside it, and every weight is used once per training step anyway.
        """
        import torch

        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device().type, dtype=getattr(torch, dtype), cache_enabled=False)

    def capture_graph(self, step: Callable[[], object], warmup: int) -> Callable[[], object]:
        """Capture `step` in a CUDA graph; returns the graph's replay.

        As in torch's "whole-network capture": `warmup` eager calls on a side stream first (lazy
        initialization, cuDNN/cuBLAS handles, cupynorm's kernel compilation and recorded calls,
        optimizer state all happen outside the capture), then one call captured with
        `torch.cuda.graph`, which records into a private memory pool. Every later replay reruns
        those kernels on the same addresses, so `step` must read and write fixed tensors only.
        """
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay

    def profile(self) -> Any:
        """A `torch.profiler.profile` context recording host ops and CUDA kernels."""
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def kernel_events(self, profiler: Any) -> list[tuple[str, float]]:
        """(name, microseconds) of every kernel the profiler saw; memcpy, memset and the GPU-side
        spans of `record_function` annotations (e.g. "Optimizer.step#SGD.step", which cover
        kernels already counted) left out, as torch's own profiler table does."""
        from torch.autograd import DeviceType

        kernels = []
        for event in profiler.events():
            if event.device_type != DeviceType.CUDA:
                continue
            if getattr(event, "is_user_annotation", False):
                continue
            if event.name.startswith(("Memcpy", "Memset")):
                continue
            kernels.append((event.name, float(event.time_range.elapsed_us())))
        return kernels


cuda = CudaDevice()


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def make_l2_flush_buffer(device: Any = None) -> torch.Tensor:
    """A buffer of >= 2x the L2 size (and >= 256 MB) to overwrite before each repetition."""
    import torch

    if device is None:
        device = cuda.device()
    l2_bytes = int(getattr(cuda.properties(), "L2_cache_size", 0) or 0)
    return torch.empty(l2_flush_bytes(l2_bytes) // 4, dtype=torch.int32, device=device)


def time_cuda_ms(
    fn: Callable[[], object],
    *,
    reps: int,
    warmup: int = WARMUP_CALLS,
    flush_buffer: torch.Tensor | None = None,
    host_lead_ms: float = 0.0,
) -> list[float]:
    """Milliseconds of each of `reps` calls of `fn`, CUDA events around the call only.

    Before each repetition `flush_buffer` (if given) is overwritten, outside the events, so the
    call starts with a cold L2. `fn`'s result is dropped at once (its memory is reused).
    `host_lead_ms`: the GPU then spins that long (`CudaDevice.spin`), so the host has queued the
    call before the GPU reaches the first event: the events time the GPU's work alone, however
    slow the host (without it, a call that takes the host longer to issue than the GPU to run
    times the host).
    """
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    starts = [cuda.event() for _ in range(reps)]
    ends = [cuda.event() for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        if flush_buffer is not None:
            flush_buffer.zero_()
        if host_lead_ms:
            cuda.spin(host_lead_ms)
        start.record()
        fn()
        end.record()
    cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


def time_per_call_ms(
    fn: Callable[[], object], *, calls: int, trials: int, warmup: int = 20
) -> list[float]:
    """Per-call milliseconds of `calls` back-to-back calls (one pair of events), per trial."""
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    per_call = []
    for _ in range(trials):
        start = cuda.event()
        end = cuda.event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return per_call


def measure_copy_bandwidth_tbps(nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / median time."""
    import torch

    if nbytes is None:
        nbytes = COPY_BANDWIDTH_BYTES
    source = torch.ones(nbytes, dtype=torch.uint8, device=cuda.device())
    destination = torch.empty_like(source)

    def copy() -> None:
        destination.copy_(source)

    times = time_cuda_ms(copy, reps=COPY_BANDWIDTH_REPS)
    return throughput_tbps(2 * nbytes, statistics.median(times))
