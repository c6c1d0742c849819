"""What a bench row is: the dataclasses of the kernel rows (`Workload`, `ModuleSpec`) and of the
models group (`ModelWorkload`). Plain data: nothing here imports torch or another bench module,
so the registry (`workloads`) and the model factories (`models`) both import it and not each
other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

Shape = tuple[int, ...]


def shape_text(shape: Shape) -> str:
    """`16x320x64x64`-style text."""
    return "x".join(str(d) for d in shape)


@dataclass(frozen=True)
class ModuleSpec:
    """How to build one implementation's module: `<namespace>.<class_name>(*args, **kwargs)`.

    namespace is "torch.nn", "cupynorm.torch", or "bench" for the reference modules defined in
    `cupynorm.bench.models`; `cupynorm.bench.models.build_module` builds it.
    """

    namespace: str
    class_name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        """`GroupNorm(8, 64)`-style text."""
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.class_name}({', '.join(parts)})"


@dataclass(frozen=True)
class Workload:
    """One benchmark row group: the same module call in torch eager, torch.compile, cupynorm."""

    name: str
    title: str
    eager: ModuleSpec
    cupynorm: ModuleSpec
    input_shapes: tuple[Shape, ...]  # one per module input; the first is "the big tensor"
    quick_input_shapes: tuple[Shape, ...] | None = None  # None: same as input_shapes
    dtype: str = "float32"
    channels_last: bool = False
    backward: bool = False  # time forward + backward (gradients of input and parameters)
    # Passes over a tensor of the first input's size that define TB/s; None: not bandwidth-bound.
    tensor_passes: int | None = 2
    traffic: str = "read x, write y"
    goal_ms: float | None = None  # on an H200 at the full shapes; None: a relative goal
    goal_text: str = ""  # the relative goal, e.g. "<= eager"
    measure: str = "throughput"  # or "overhead": per-call time of back-to-back calls
    note: str = ""  # what is known to limit the row (the results page shows it beside a miss)

    def shapes(self, quick: bool) -> tuple[Shape, ...]:
        """Input shapes for a full or a `--quick` run."""
        if quick and self.quick_input_shapes is not None:
            return self.quick_input_shapes
        return self.input_shapes


@dataclass(frozen=True)
class ModelWorkload:
    """A whole training step of a model, with torch's norm layers and with cupynorm's.

    The step: zero the gradients, forward (under autocast when `autocast` is set), loss, backward,
    an SGD step with momentum (with `inference`, the forward alone); in the modes of
    `cupynorm.bench.results.MODES`.
    """

    name: str
    title: str
    model: str  # key of `cupynorm.bench.models.MODEL_FACTORIES`
    input_shape: Shape  # the batch fed to each step
    dtype: str = "float32"  # of the parameters and the input
    autocast: str | None = None  # autocast dtype ("bfloat16", "float16"), None: no autocast
    channels_last: bool = False
    loss: str = "cross_entropy"  # on random labels; or "mse" against a random target
    num_classes: int = 1000  # cross_entropy only
    lr: float = 0.01
    # Batch of the fp32 / float64 accuracy check (None: the row's batch). float64 activations of
    # resnet50 at batch 256 would not fit beside the rest on an 80 GB GPU.
    accuracy_batch: int | None = None
    # The goal: cupynorm's step at least `goal_speedup` times as fast as torch's in `goal_modes`.
    goal_speedup: float | None = None
    goal_modes: tuple[str, ...] = ()
    # How cupynorm's model is made: "fuse" (`cupynorm.torch.fuse`), "llama_rms_norm"
    # (`replace_norms(include=[cupynorm.torch.LlamaRMSNorm])`: transformers' RMSNorm layers;
    # fuse has nothing to fold in a Llama decoder, benchmarks/NOTES.md), "hf_norms"
    # (`replace_norms(include=cupynorm.torch.HF_NORMS)`: every transformers formula), "layer_norms"
    # (`replace_norms(include=[torch.nn.LayerNorm])`: LayerNorm and the LayerNorm2d layers, opt-in)
    # or "fuse_layer_norms" (fuse, then the LayerNorms too: a UNet's transformer blocks), or
    # "none" (torch's model on both sides: `as_twin`).
    convert: str = "fuse"
    # transformers' decoder layers: after `convert`, `cupynorm.torch.patch_transformers` (the
    # residual add before the norm that follows it, fused into that norm's kernel)
    patch_transformers: bool = False
    layers: int = 0  # decoder layers of a transformer model (the llama factory)
    # Forward only (a VAE decoding): the step is the forward under torch.no_grad, the model in
    # eval mode; the accuracy check still takes the input gradient of the loss.
    inference: bool = False
    # The model's output shape where it is not the input's (a decoder's): the mse target's.
    output_shape: Shape | None = None
    note: str = ""  # what is known to limit the row (the results page shows it beside a miss)
    # cupynorm's model built (compiled, captured) first and first in the alternating rounds, as
    # `bench --cupynorm-first` asks (rows named NAME_cf): what the order alone moves
    cupynorm_first: bool = False

    @property
    def goal_text(self) -> str:
        """`>= 1.15x torch (eager and graphed)`, or "" without a goal."""
        if self.goal_speedup is None:
            return ""
        modes = " and ".join(self.goal_modes)
        return f">= {self.goal_speedup:g}x torch" + (f" ({modes})" if modes else "")

    def as_twin(self) -> ModelWorkload:
        """This row as an A/A run (`bench --aa`): torch's model on both sides, built, compiled
        and timed as the converted one would be; named `NAME_aa`, without a goal. Its ratios are
        what the method resolves for this row: a host-paced cell of identical models moves."""
        return replace(
            self,
            name=f"{self.name}_aa",
            title=f"A/A: {self.title}; both sides torch's model",
            convert="none",
            patch_transformers=False,
            goal_speedup=None,
            goal_modes=(),
            note="",
        )

    def built_cupynorm_first(self) -> ModelWorkload:
        """This row with cupynorm's model built and timed first (`bench --cupynorm-first`),
        named `NAME_cf`: beside the default order (and with `--aa`, beside the A/A row) it tells
        whether the order of the two models moves a cell."""
        return replace(self, name=f"{self.name}_cf", cupynorm_first=True)

    def describe_input(self) -> str:
        """`64x3x224x224 float32, bf16 autocast, channels_last`-style text."""
        text = f"{shape_text(self.input_shape)} {self.dtype}"
        if self.autocast:
            text += f", {self.autocast} autocast"
        if self.channels_last:
            text += ", channels_last"
        return text
