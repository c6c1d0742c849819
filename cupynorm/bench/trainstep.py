"""A model row's training step, shared by the bench's models group (`train`) and the profiler
(`cupynorm.bench.profile`): the loss, the batch, cupynorm's conversion of the model, the step
itself, and which kernels of a profile are norm kernels.

torch and cupynorm are imported when a function runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import timing
from .specs import ModelWorkload

if TYPE_CHECKING:
    import torch

SGD_MOMENTUM = 0.9
MSE_SCALE = 5e-4  # see training_loss

# Lower-case pieces of kernel names counted as norm kernels: torch's BatchNorm (native and
# cuDNN: batch_norm_*, welford_*, bn_*), torch's GroupNorm (RowwiseMoments, ComputeFusedParams,
# GroupNorm*Kernel lambdas, the backward's gradient kernels), torch's LayerNorm / RMSNorm
# (*layer_norm*, GammaBeta*), cupynorm's (cuda_src/*.cu: segment_norm_*, strided_norm_*,
# channel_norm_*, row_norm_*, and fused_norm_*, which also do the add and activation they
# absorbed). Layout copies a norm makes around its kernels are not counted.
NORM_KERNEL_PATTERNS = (
    "batch_norm",
    "batchnorm",
    "bn_",
    "welford",
    "group_norm",
    "groupnorm",
    "layer_norm",
    "rowwisemoments",
    "fusedparams",
    "internalgradients",
    "gammabeta",
    "segment_norm_",
    "strided_norm_",
    "fused_norm_",
    "channel_norm_",
    "row_norm_",
    "sync_norm_",
)


def is_norm_kernel(name: str) -> bool:
    """Whether a kernel's name marks it as part of a normalization layer."""
    lowered = name.lower()
    return any(pattern in lowered for pattern in NORM_KERNEL_PATTERNS)


@dataclass
class KernelSummary:
    """Kernel time and launches per step, from the profiler's kernel list."""

    kernel_ms: float
    norm_kernel_ms: float
    kernels: float
    norm_kernels: float
    norm_kernel_ms_by_name: dict[str, float]


def summarize_kernels(events: Sequence[tuple[str, float]], steps: int) -> KernelSummary:
    """Per-step totals of (name, microseconds) kernel events recorded over `steps` steps."""
    steps = max(steps, 1)
    by_name: dict[str, float] = {}
    total_us = norm_us = 0.0
    norm_count = 0
    for name, us in events:
        total_us += us
        if is_norm_kernel(name):
            norm_us += us
            norm_count += 1
            by_name[name] = by_name.get(name, 0.0) + us / 1e3 / steps
    ordered = dict(sorted(by_name.items(), key=lambda item: -item[1]))
    return KernelSummary(
        kernel_ms=total_us / 1e3 / steps,
        norm_kernel_ms=norm_us / 1e3 / steps,
        kernels=len(events) / steps,
        norm_kernels=norm_count / steps,
        norm_kernel_ms_by_name=ordered,
    )


# ------------------------------------------------------------------------------------------------
# The training step
# ------------------------------------------------------------------------------------------------


def training_loss(
    workload: ModelWorkload, output: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    import torch.nn.functional as F

    if workload.loss == "cross_entropy":
        return F.cross_entropy(output, target)
    if workload.loss == "token_cross_entropy":  # logits (batch, sequence, vocabulary)
        return F.cross_entropy(output.flatten(0, -2), target.flatten())
    # Summed and scaled so that the output's gradient is 1e-3 * (output - target): a normal fp16
    # number (a mean over 21M elements would give ~1e-7, below fp16's normal range), and parameter
    # gradients and momentum buffers far below fp16's 65504 (checked over 25 steps on the CPU at
    # the rows' channels and resolution). The target's dtype (fp32; fp64 in the accuracy check)
    # is the loss's.
    return F.mse_loss(output.to(target.dtype), target, reduction="sum") * MSE_SCALE


class TrainStep:
    """One training step on fixed tensors: zero the gradients (to None), forward (under autocast
    when the workload asks), loss, backward, SGD step; for an inference workload, the forward
    alone under torch.no_grad.

    The same callable runs eager, is captured whole for the graphed mode, and runs a compiled
    forward for the compiled modes (`mark_step`: tell Inductor's CUDA graphs where a step
    begins, for the reduce-overhead mode). Gradients set to None before the forward means the
    backward allocates them: in a capture, from the graph's pool, where every replay rewrites
    them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        workload: ModelWorkload,
        inputs: torch.Tensor,
        target: torch.Tensor,
        forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
        mark_step: bool = False,
    ) -> None:
        import torch

        self.mark_step = mark_step
        self.model = model
        self.forward = forward if forward is not None else model
        self.workload = workload
        self.inputs = inputs
        self.target = target
        self.optimizer = torch.optim.SGD(model.parameters(), lr=workload.lr, momentum=SGD_MOMENTUM)

    def __call__(self) -> None:
        import torch

        if self.mark_step:  # a new step for Inductor's CUDA graphs: last step's outputs are dead
            torch.compiler.cudagraph_mark_step_begin()
        if self.workload.inference:
            with torch.no_grad(), timing.cuda.autocast(self.workload.autocast):
                self.forward(self.inputs)
            return
        self.optimizer.zero_grad(set_to_none=True)
        with timing.cuda.autocast(self.workload.autocast):
            output = self.forward(self.inputs)
            loss = training_loss(self.workload, output, self.target)
        loss.backward()
        self.optimizer.step()


def make_batch(
    workload: ModelWorkload, batch: int, device: Any, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A standard-normal input in the workload's layout and a random target: class labels for
    cross-entropy, a standard-normal tensor of the input's shape (the workload's `output_shape`
    where it has one; in fp32, or fp64 for an fp64 input) for mse."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, *workload.input_shape[1:])
    layout = torch.channels_last if workload.channels_last else torch.contiguous_format
    inputs = torch.empty(shape, dtype=dtype, device=device, memory_format=layout)
    inputs.normal_(generator=generator)
    if workload.loss == "cross_entropy":
        target = torch.randint(
            0, workload.num_classes, (batch,), device=device, generator=generator
        )
    elif workload.loss == "token_cross_entropy":  # a label per position of the sequence
        target = torch.randint(
            0, workload.num_classes, shape[:2], device=device, generator=generator
        )
    else:
        target_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if workload.output_shape is not None:
            shape = (batch, *workload.output_shape[1:])
        target = torch.empty(shape, dtype=target_dtype, device=device, memory_format=layout)
        target.normal_(generator=generator)
    return inputs, target


def convert_model(model: torch.nn.Module, workload: ModelWorkload) -> torch.nn.Module:
    """cupynorm's model as the workload says (`ModelWorkload.convert`): `cupynorm.torch.fuse`,
    the norms converted and a BatchNorm2d's following activation and residual add folded into
    it, or transformers' RMSNorm layers (Llama's formula, or every formula of
    `cupynorm.torch.HF_NORMS`; with `patch_transformers`, the residual adds before a norm fused
    into it) or the LayerNorm layers converted, or both fuse and the LayerNorms (imported here:
    it needs torch and registers ops); "none": the model as it is (an A/A run)."""
    if workload.convert == "none":  # an A/A run (ModelWorkload.as_twin)
        return model
    cnt = importlib.import_module("cupynorm.torch")
    if workload.convert in ("llama_rms_norm", "hf_norms"):
        names = [cnt.LlamaRMSNorm] if workload.convert == "llama_rms_norm" else cnt.HF_NORMS
        model = cnt.replace_norms(model, include=names)
        if workload.patch_transformers:
            cnt.patch_transformers(model)
        return model
    layer_norm = importlib.import_module("torch").nn.LayerNorm
    if workload.convert == "layer_norms":
        return cnt.replace_norms(model, include=[layer_norm])
    if workload.convert == "fuse_layer_norms":
        return cnt.replace_norms(cnt.fuse(model), include=[layer_norm])
    return cnt.fuse(model)


def on_device(
    model: torch.nn.Module, workload: ModelWorkload, device: Any, dtype: torch.dtype
) -> torch.nn.Module:
    """The model moved to the device and dtype, in the workload's layout, in training mode (in
    eval mode for an inference workload)."""
    import torch

    model = model.to(device=device, dtype=dtype)
    if workload.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.train(not workload.inference)
