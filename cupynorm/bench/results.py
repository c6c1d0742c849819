"""What a run measured: per implementation, per workload (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .checking import TensorCheck
from .workloads import Workload

IMPL_EAGER = "torch eager"
IMPL_COMPILE = "torch.compile"
IMPL_CUPYNORM = "cupynorm"
IMPLEMENTATIONS = (IMPL_EAGER, IMPL_COMPILE, IMPL_CUPYNORM)


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
