"""What a run measured: per implementation, per workload (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checking import TensorCheck, accuracy_ok
from .specs import ModelWorkload, Workload

IMPL_EAGER = "torch eager"
IMPL_COMPILE = "torch.compile"
IMPL_CUPYNORM = "cupynorm"
IMPLEMENTATIONS = (IMPL_EAGER, IMPL_COMPILE, IMPL_CUPYNORM)

# The models group: each mode runs the model with torch's norm layers and with cupynorm's.
MODE_EAGER = "eager"
MODE_GRAPHED = "graphed"
MODE_COMPILE = "compile"
MODE_REDUCE_OVERHEAD = "reduce-overhead"  # torch.compile(mode="reduce-overhead")
COMPILED_MODES = (MODE_COMPILE, MODE_REDUCE_OVERHEAD)
MODES = (MODE_EAGER, MODE_GRAPHED, *COMPILED_MODES)
MODEL_TORCH = "torch"
MODEL_CUPYNORM = "cupynorm"
MODEL_IMPLS = (MODEL_TORCH, MODEL_CUPYNORM)


@dataclass
class ImplResult:
    """One implementation's timing of one workload (or the error that prevented it)."""

    impl: str
    ms: float | None = None  # median (per call for overhead workloads)
    min_ms: float | None = None
    max_ms: float | None = None
    reps: int = 0
    compile_s: float | None = None
    peak_extra_bytes: int | None = None
    error: str | None = None
    # cupynorm only: the kernels one call launched (bench.run._launched_kernels)
    kernels: list[dict] | None = None


@dataclass
class WorkloadResult:
    """Everything measured for one workload."""

    workload: Workload
    quick: bool
    checks: list[TensorCheck] = field(default_factory=list)
    impls: list[ImplResult] = field(default_factory=list)
    error: str | None = None  # the workload could not be set up at all
    seconds: float = 0.0

    def impl(self, name: str) -> ImplResult | None:
        """The result of implementation `name`, if it was run."""
        for result in self.impls:
            if result.impl == name:
                return result
        return None

    @property
    def cupynorm_wrong(self) -> bool:
        """cupynorm's results differ from torch eager's."""
        return any(not check.ok for check in self.checks)

    @property
    def failed(self) -> bool:
        """cupynorm is wrong or failed, or the workload could not run."""
        cupynorm = self.impl(IMPL_CUPYNORM)
        return (
            self.error is not None
            or self.cupynorm_wrong
            or cupynorm is None
            or cupynorm.error is not None
        )

    def goal_met(self, goal_ms: float | None) -> bool | None:
        """Whether cupynorm meets the workload's goal (None when unknown)."""
        cupynorm = self.impl(IMPL_CUPYNORM)
        if cupynorm is None or cupynorm.ms is None:
            return None
        if goal_ms is not None:
            return cupynorm.ms <= goal_ms
        if self.workload.goal_text.startswith("<= eager"):
            eager = self.impl(IMPL_EAGER)
            if eager is None or eager.ms is None:
                return None
            return cupynorm.ms <= eager.ms
        return None


@dataclass
class StepResult:
    """One (mode, implementation) of a model's training step (or the error that prevented it)."""

    mode: str
    impl: str
    ms: float | None = None  # median per step
    min_ms: float | None = None
    max_ms: float | None = None
    reps: int = 0
    setup_s: float | None = None  # compile: the compiling calls; graphed: warm-up + capture
    # Eager only: from torch.profiler, per step.
    kernel_ms: float | None = None
    norm_kernel_ms: float | None = None
    kernels: float | None = None  # kernel launches per step
    norm_kernels: float | None = None  # norm-kernel launches per step
    norm_kernel_ms_by_name: dict[str, float] = field(default_factory=dict)
    host_us: float | None = None  # wall time to issue one step, no sync inside
    # eager only: the step's peak allocation beyond what was allocated before it (activations,
    # what autograd saves, gradients; the caching allocator's count)
    peak_extra_bytes: int | None = None
    error: str | None = None
    note: str = ""  # what the mode did not do as asked (reduce-overhead: graphs run ungraphed)

    def norm_launches_per_layer(self, norm_layers: int) -> float | None:
        """Norm-kernel launches per step divided by the number of norm layers."""
        if self.norm_kernels is None or norm_layers <= 0:
            return None
        return self.norm_kernels / norm_layers


@dataclass
class AccuracyCheck:
    """Max relative errors against torch in float64: torch in fp32 beside cupynorm in fp32."""

    batch: int
    output_torch: float
    output_cupynorm: float
    grad_torch: float  # of the loss with respect to the input
    grad_cupynorm: float

    @property
    def output_ok(self) -> bool:
        """cupynorm's output error is within 2x torch's (+ a floor)."""
        return accuracy_ok(self.output_cupynorm, self.output_torch)

    @property
    def grad_ok(self) -> bool:
        """cupynorm's input-gradient error is within 2x torch's (+ a floor)."""
        return accuracy_ok(self.grad_cupynorm, self.grad_torch)

    @property
    def ok(self) -> bool:
        """Both within bounds."""
        return self.output_ok and self.grad_ok


@dataclass
class ModelResult:
    """Everything measured for one model workload."""

    workload: ModelWorkload
    quick: bool
    norm_layers: int = 0
    accuracy: AccuracyCheck | None = None
    accuracy_error: str | None = None
    steps: list[StepResult] = field(default_factory=list)
    error: str | None = None  # the model could not be set up at all
    skipped: str | None = None  # why the row did not run (a package it needs is not installed)
    seconds: float = 0.0
    # eager host time to issue a step of the same model with its norm layers replaced by
    # nn.Identity: the baseline of host_us_per_norm_layer
    host_us_without_norms: float | None = None

    def step(self, mode: str, impl: str) -> StepResult | None:
        """The result of `impl` in `mode`, if it was run."""
        for result in self.steps:
            if result.mode == mode and result.impl == impl:
                return result
        return None

    def host_us_per_norm_layer(self, step: StepResult) -> float | None:
        """Host time of one norm layer's forward + backward in `step`'s training step: the
        step's issue time less that of the model without norm layers, per norm layer."""
        if step.host_us is None or self.host_us_without_norms is None or self.norm_layers <= 0:
            return None
        return (step.host_us - self.host_us_without_norms) / self.norm_layers

    def failure(self) -> str | None:
        """Why this model's row fails the run, or None: no setup, an accuracy check failed or
        could not run, or cupynorm failed in a mode where torch's step ran. A skipped row does
        not fail."""
        if self.error is not None:
            return self.error
        if self.accuracy_error is not None:
            return "accuracy check failed to run: " + self.accuracy_error
        if self.accuracy is not None and not self.accuracy.ok:
            a = self.accuracy
            return (
                "cupynorm less accurate than torch against float64: output "
                f"{a.output_cupynorm:.3g} vs torch {a.output_torch:.3g}, input gradient "
                f"{a.grad_cupynorm:.3g} vs torch {a.grad_torch:.3g} (allowed: 2x torch's)"
            )
        for mode in MODES:
            torch_step = self.step(mode, MODEL_TORCH)
            cupynorm_step = self.step(mode, MODEL_CUPYNORM)
            if torch_step is None or torch_step.error is not None:
                continue
            if cupynorm_step is None or cupynorm_step.error is not None:
                reason = cupynorm_step.error if cupynorm_step else "not run"
                return f"cupynorm failed in mode {mode}: {reason}"
        return None

    @property
    def failed(self) -> bool:
        """See `failure`."""
        return self.failure() is not None
