"""Models the bench builds (torch imported on first use).

- the kernel rows' modules (`build_module`): torch's and cupynorm's by name, and the reference
  modules of the "bench" namespace (seed 002's models, KernelBench level 2, 28; the eager side of
  the fused and channel-norm rows);
- the models group's models, by name in `MODEL_FACTORIES`: torchvision's `resnet50()`, timm's
  `efficientnet_b0`, `mobilenetv3_large_100`, `convnext_tiny` and `vit_base_patch16_224`, a
  stack of diffusers-style ResNet blocks with GroupNorm(32) (diffusers is not a dependency: the
  block is written here) and a transformers Llama decoder (random init); diffusers' own
  UNet2DConditionModel and AutoencoderKL are built in `diffusers_models`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import diffusers_models
from .specs import ModelWorkload, ModuleSpec

if TYPE_CHECKING:
    import torch

# Packages some model rows need and the bench does not: without one, those rows are skipped.
OPTIONAL_PACKAGES = ("torchvision", "timm", "transformers", "diffusers")

_SEED002_CLASSES: dict[str, type] = {}


def seed002_module_classes() -> dict[str, type]:
    """Seed002Tail (eager tail), Seed002Model (eager model), Seed002ModelCupynorm."""
    if _SEED002_CLASSES:
        return _SEED002_CLASSES
    from torch import nn

    class Seed002Tail(nn.Module):
        """Seed 002's epilogue in eager torch: instance norm over each row, then (x + y) * y."""

        def __init__(self, features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
            super().__init__()
            self.instance_norm = nn.InstanceNorm2d(features, eps=eps, momentum=momentum)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = self.instance_norm(x.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
            x = x + y
            return x * y

    class Seed002Model(nn.Module):
        """Seed 002 (KernelBench level 2, 28): Linear, row instance norm, + y, * y."""

        def __init__(
            self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1
        ) -> None:
            super().__init__()
            self.bmm = nn.Linear(in_features, out_features)
            self.instance_norm = nn.InstanceNorm2d(out_features, eps=eps, momentum=momentum)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = self.bmm(x)
            x = self.instance_norm(x.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)
            x = x + y
            return x * y

    class Seed002ModelCupynorm(nn.Module):
        """Seed 002 with the tail fused by `cupynorm.torch.row_norm_add_mul`."""

        def __init__(
            self, in_features: int, out_features: int, eps: float = 1e-5, momentum: float = 0.1
        ) -> None:
            super().__init__()
            cupynorm_torch = importlib.import_module("cupynorm.torch")
            self.bmm = nn.Linear(in_features, out_features)
            self.eps = eps
            self._row_norm_add_mul = cupynorm_torch.row_norm_add_mul

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self._row_norm_add_mul(self.bmm(x), y, eps=self.eps)

    _SEED002_CLASSES.update(
        Seed002Tail=Seed002Tail,
        Seed002Model=Seed002Model,
        Seed002ModelCupynorm=Seed002ModelCupynorm,
    )
    return _SEED002_CLASSES


# ------------------------------------------------------------------------------------------------
# The models group
# ------------------------------------------------------------------------------------------------

GN_BLOCKS = 4
GN_GROUPS = 32
TEMB_CHANNELS = 1280  # diffusers' UNet2DConditionModel: 4 x its first block's 320 channels
_GN_CLASSES: dict[str, type] = {}


def _gn_module_classes() -> dict[str, type]:
    """GNResnetBlock(s) and UNetResnetBlock(s), defined on first use (they need torch)."""
    if _GN_CLASSES:
        return _GN_CLASSES
    import math

    import torch
    from torch import nn

    class GNResnetBlock(nn.Module):
        """diffusers' ResnetBlock2D without the time embedding and dropout (in = out channels):
        GroupNorm -> SiLU -> Conv3x3 -> GroupNorm -> SiLU -> Conv3x3, plus the input."""

        def __init__(self, channels: int, groups: int = GN_GROUPS, eps: float = 1e-5) -> None:
            super().__init__()
            self.norm1 = nn.GroupNorm(groups, channels, eps=eps)
            self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
            self.norm2 = nn.GroupNorm(groups, channels, eps=eps)
            self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
            self.act = nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.conv1(self.act(self.norm1(x)))
            h = self.conv2(self.act(self.norm2(h)))
            return x + h

    class GNResnetBlocks(nn.Sequential):
        """`blocks` GNResnetBlock in a row (the shape of a UNet stage at one resolution)."""

        def __init__(self, channels: int, blocks: int = GN_BLOCKS, groups: int = GN_GROUPS) -> None:
            super().__init__(*(GNResnetBlock(channels, groups) for _ in range(blocks)))

    class UNetResnetBlock(GNResnetBlock):
        """diffusers' ResnetBlock2D with its time embedding (in = out channels, no dropout): the
        projected embedding is added before norm2, ``norm2(h + proj(silu(temb))[:, :, None,
        None])``."""

        def __init__(
            self, channels: int, temb_channels: int = TEMB_CHANNELS, groups: int = GN_GROUPS
        ) -> None:
            super().__init__(channels, groups)
            self.time_emb_proj = nn.Linear(temb_channels, channels)

        def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
            h = self.conv1(self.act(self.norm1(x)))
            h = h + self.time_emb_proj(self.act(temb))[:, :, None, None]
            h = self.conv2(self.act(self.norm2(h)))
            return x + h

    class UNetResnetBlocks(nn.Module):
        """`blocks` UNetResnetBlock in a row sharing one time embedding, as a UNet stage does:
        diffusers' TimestepEmbedding (Linear, SiLU, Linear) of the sinusoidal embedding of fixed
        timesteps, one per sample (a buffer: the batch size is the model's)."""

        def __init__(
            self,
            channels: int,
            batch: int,
            blocks: int = GN_BLOCKS,
            groups: int = GN_GROUPS,
            temb_channels: int = TEMB_CHANNELS,
        ) -> None:
            super().__init__()
            half = channels // 2
            steps = torch.linspace(0, 999, batch)[:, None]
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half) / half)[None, :]
            sinusoid = torch.cat([torch.sin(steps * freqs), torch.cos(steps * freqs)], dim=1)
            self.register_buffer("timesteps", sinusoid)
            self.time_embedding = nn.Sequential(
                nn.Linear(channels, temb_channels),
                nn.SiLU(),
                nn.Linear(temb_channels, temb_channels),
            )
            self.blocks = nn.ModuleList(
                UNetResnetBlock(channels, temb_channels, groups) for _ in range(blocks)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            temb = self.time_embedding(self.timesteps)
            for block in self.blocks:
                x = block(x, temb)
            return x

    _GN_CLASSES.update(
        GNResnetBlock=GNResnetBlock,
        GNResnetBlocks=GNResnetBlocks,
        UNetResnetBlock=UNetResnetBlock,
        UNetResnetBlocks=UNetResnetBlocks,
    )
    return _GN_CLASSES


def gn_resnet_blocks(workload: ModelWorkload) -> torch.nn.Module:
    """GN_BLOCKS diffusers-style ResNet blocks on the workload's channels."""
    return _gn_module_classes()["GNResnetBlocks"](workload.input_shape[1])


def unet_resnet_block_class() -> type:
    """The diffusers-style ResNet block with a time embedding:
    ``UNetResnetBlock(channels, temb_channels, groups)``, ``forward(x, temb)``."""
    return _gn_module_classes()["UNetResnetBlock"]


def unet_resnet_blocks(workload: ModelWorkload) -> torch.nn.Module:
    """GN_BLOCKS diffusers-style ResNet blocks with a time embedding (batch: the workload's)."""
    channels, batch = workload.input_shape[1], workload.input_shape[0]
    return _gn_module_classes()["UNetResnetBlocks"](channels, batch)


def resnet50(workload: ModelWorkload) -> torch.nn.Module:
    """torchvision's `resnet50()` (random weights); an ImportError when torchvision is missing."""
    torchvision_models = importlib.import_module("torchvision.models")
    return torchvision_models.resnet50(num_classes=workload.num_classes)


def mobilenetv3(workload: ModelWorkload) -> torch.nn.Module:
    """timm's `mobilenetv3_large_100` (random weights; its 46 norms are BatchNormAct2d: BatchNorm
    then ReLU, Hardswish or nothing); an ImportError when timm is missing."""
    timm = importlib.import_module("timm")
    return timm.create_model("mobilenetv3_large_100", num_classes=workload.num_classes)


def efficientnet_b0(workload: ModelWorkload) -> torch.nn.Module:
    """timm's `efficientnet_b0` (random weights; its 49 norms are BatchNormAct2d: BatchNorm then
    SiLU); an ImportError when timm is missing."""
    timm = importlib.import_module("timm")
    return timm.create_model("efficientnet_b0", num_classes=workload.num_classes)


_LLAMA_CLASSES: dict[str, type] = {}


def _llama_lm_class() -> type:
    """LlamaLM, defined on first use (it needs torch)."""
    if _LLAMA_CLASSES:
        return _LLAMA_CLASSES["LlamaLM"]
    from torch import nn

    class LlamaLM(nn.Module):
        """transformers' LlamaForCausalLM fed input embeddings (batch, sequence, hidden): the
        bench's batches are float tensors, and the accuracy check takes the input's gradient.
        Returns the logits (batch, sequence, vocabulary)."""

        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
            return self.lm(inputs_embeds=inputs_embeds, use_cache=False).logits

    _LLAMA_CLASSES["LlamaLM"] = LlamaLM
    return LlamaLM


def _decoder_config(transformers, config_name: str, workload: ModelWorkload, **extra):
    """The Llama row's decoder shape in another family's config: `workload.layers` layers,
    hidden size input_shape[2] (head size 128, 2 query heads per key/value head, MLP 2.75x),
    vocabulary `num_classes`, sdpa attention."""
    hidden = workload.input_shape[2]
    heads = max(1, hidden // 128)
    return getattr(transformers, config_name)(
        vocab_size=workload.num_classes,
        hidden_size=hidden,
        intermediate_size=(hidden * 11 // 4 + 63) // 64 * 64,
        num_hidden_layers=workload.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=workload.input_shape[1],
        attn_implementation="sdpa",
        **extra,
    )


def llama(workload: ModelWorkload) -> torch.nn.Module:
    """A Llama-style decoder from transformers, random init: `workload.layers` layers, hidden
    size input_shape[2] (head size 128, 2 query heads per key/value head, MLP 2.75x), vocabulary
    `num_classes`; an ImportError when transformers is missing."""
    transformers = importlib.import_module("transformers")
    config = _decoder_config(transformers, "LlamaConfig", workload)
    return _llama_lm_class()(transformers.LlamaForCausalLM(config))


def qwen2(workload: ModelWorkload) -> torch.nn.Module:
    """transformers' Qwen2ForCausalLM of the Llama row's shape (`_decoder_config`; Qwen2's
    biased q/k/v projections, its RMSNorm of Llama's formula), random init, fed embeddings."""
    transformers = importlib.import_module("transformers")
    config = _decoder_config(transformers, "Qwen2Config", workload)
    return _llama_lm_class()(transformers.Qwen2ForCausalLM(config))


def gemma(workload: ModelWorkload) -> torch.nn.Module:
    """transformers' GemmaForCausalLM of the Llama row's shape (`_decoder_config`, head size
    128; Gemma's RMSNorm: ``(1 + weight)`` in float32, rounded once), random init, fed
    embeddings."""
    transformers = importlib.import_module("transformers")
    config = _decoder_config(transformers, "GemmaConfig", workload, head_dim=128)
    return _llama_lm_class()(transformers.GemmaForCausalLM(config))


def convnext_tiny(workload: ModelWorkload) -> torch.nn.Module:
    """timm's `convnext_tiny` (random weights; its blocks normalize NHWC rows with timm's
    LayerNorm, its stem, downsamples and head with LayerNorm2d); an ImportError when timm is
    missing."""
    timm = importlib.import_module("timm")
    return timm.create_model("convnext_tiny", num_classes=workload.num_classes)


def vit_base(workload: ModelWorkload) -> torch.nn.Module:
    """timm's `vit_base_patch16_224` (random weights; 25 torch.nn.LayerNorm(768) over its 197
    tokens' rows: two per block and the final one); an ImportError when timm is missing."""
    timm = importlib.import_module("timm")
    return timm.create_model("vit_base_patch16_224", num_classes=workload.num_classes)


# The models group's models by name; each builds the model on the CPU in float32.
MODEL_FACTORIES: dict[str, Callable[[ModelWorkload], torch.nn.Module]] = {
    "resnet50": resnet50,
    "efficientnet_b0": efficientnet_b0,
    "mobilenetv3": mobilenetv3,
    "convnext_tiny": convnext_tiny,
    "vit_base": vit_base,
    "gn_resnet_blocks": gn_resnet_blocks,
    "unet_resnet_blocks": unet_resnet_blocks,
    "llama": llama,
    "qwen2": qwen2,
    "gemma": gemma,
    "sd15_unet": diffusers_models.sd15_unet,  # diffusers' own classes
    "sd_vae_decoder": diffusers_models.sd_vae_decoder,
}


def build_model(workload: ModelWorkload) -> torch.nn.Module:
    """The workload's model, built by its factory in MODEL_FACTORIES."""
    return MODEL_FACTORIES[workload.model](workload)


def build_module(spec: ModuleSpec) -> torch.nn.Module:
    """A kernel row's module (on the CPU, float32, like `torch.nn` modules): the "bench"
    namespace's classes from this module, any other namespace imported by name."""
    if spec.namespace == "bench":
        classes = {
            **seed002_module_classes(),
            **row_norm_module_classes(),
            **epilogue_module_classes(),
            **channel_norm_module_classes(),
        }
        cls = classes[spec.class_name]
    else:
        cls = getattr(importlib.import_module(spec.namespace), spec.class_name)
    return cls(*spec.args, **dict(spec.kwargs))


def _norm_kinds() -> tuple[type, ...]:
    from torch import nn

    return (
        nn.modules.batchnorm._BatchNorm,
        nn.GroupNorm,
        nn.modules.instancenorm._InstanceNorm,
        nn.LayerNorm,
    )


def _is_norm(module: torch.nn.Module, kinds: tuple[type, ...]) -> bool:
    """A norm layer: of torch's kinds, or another library's RMSNorm (transformers' have
    ``RMSNorm`` in their class name, and so have cupynorm's adopted classes of them)."""
    return isinstance(module, kinds) or "RMSNorm" in type(module).__name__


def norm_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The BatchNorm / GroupNorm / InstanceNorm / LayerNorm / RMSNorm modules of the model, in
    model order (cupynorm's modules subclass torch's, so they count too)."""
    kinds = _norm_kinds()
    return [module for module in model.modules() if _is_norm(module, kinds)]


def count_norm_layers(model: torch.nn.Module) -> int:
    """How many `norm_layers` the model has."""
    return len(norm_layers(model))


def strip_norms(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every norm layer counted by `count_norm_layers` replaced by
    `nn.Identity`, in place (the host time of a step without them is the baseline of the host
    time per norm layer)."""
    from torch import nn

    kinds = _norm_kinds()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_norm(child, kinds):
                setattr(parent, name, nn.Identity())
    return model


_ROW_NORM_CLASSES: dict[str, type] = {}


def row_norm_module_classes() -> dict[str, type]:
    """AddRMSNorm (eager: ``s = x + residual``, ``rms_norm(s)``) and AddRMSNormCupynorm (the
    fused kernel). Both return the normalized output and keep the sum in ``self.sum`` (the
    residual stream a model would carry on), so the sum is written by every implementation,
    torch.compile included."""
    if _ROW_NORM_CLASSES:
        return _ROW_NORM_CLASSES
    import torch.nn.functional as F
    from torch import nn

    import cupynorm.torch as cnt

    class AddRMSNorm(nn.RMSNorm):
        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            self.sum = x + residual
            return F.rms_norm(self.sum, self.normalized_shape, self.weight, self.eps)

    class AddRMSNormCupynorm(nn.RMSNorm):
        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            out, self.sum = cnt.add_rms_norm(
                x, residual, self.normalized_shape, self.weight, self.eps
            )
            return out

    _ROW_NORM_CLASSES.update(AddRMSNorm=AddRMSNorm, AddRMSNormCupynorm=AddRMSNormCupynorm)
    return _ROW_NORM_CLASSES


_EPILOGUE_CLASSES: dict[str, type] = {}


def epilogue_module_classes() -> dict[str, type]:
    """BatchNormAddReLU: ``relu(bn(x) + residual)`` as torch writes it (the ResNet bottleneck's
    tail), the eager side of cupynorm's BatchNormAct2d; GroupNormSiLU and GroupNormShiftSiLU,
    those of GroupNormAct."""
    if _EPILOGUE_CLASSES:
        return _EPILOGUE_CLASSES
    import torch.nn.functional as F
    from torch import nn

    class BatchNormAddReLU(nn.BatchNorm2d):
        def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return F.relu(super().forward(x) + residual)

    class GroupNormSiLU(nn.GroupNorm):
        """``silu(group_norm(x))`` as torch writes it (the diffusion ResNet block's norm and
        activation), the eager side of cupynorm's GroupNormAct."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.silu(super().forward(x))

    class GroupNormShiftSiLU(nn.GroupNorm):
        """``silu(group_norm(x + shift[:, :, None, None]))`` as diffusers' ResnetBlock2D writes
        its time embedding, norm2 and activation; the eager side of GroupNormAct with a shift."""

        def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
            return F.silu(super().forward(x + shift[:, :, None, None]))

    _EPILOGUE_CLASSES.update(
        BatchNormAddReLU=BatchNormAddReLU,
        GroupNormSiLU=GroupNormSiLU,
        GroupNormShiftSiLU=GroupNormShiftSiLU,
    )
    return _EPILOGUE_CLASSES


_CHANNEL_NORM_CLASSES: dict[str, type] = {}


def channel_norm_module_classes() -> dict[str, type]:
    """The eager side of the channel-norm rows: KernelBench level 1 problem 36's RMS over dim 1
    (ChannelRMS, its formula in torch operations) and timm's / torchvision's LayerNorm2d
    (PermuteLayerNorm2d: permute, layer_norm, permute back; the parameters of nn.LayerNorm)."""
    if _CHANNEL_NORM_CLASSES:
        return _CHANNEL_NORM_CLASSES
    import torch
    import torch.nn.functional as F
    from torch import nn

    class ChannelRMS(nn.Module):
        def __init__(self, num_features: int, eps: float = 1e-5) -> None:
            super().__init__()
            self.num_features, self.eps = num_features, eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / torch.sqrt(torch.mean(x**2, dim=1, keepdim=True) + self.eps)

    class ChannelRMSCupynorm(ChannelRMS):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            import cupynorm.torch as cnt

            return cnt.rms_norm2d(x, eps=self.eps)

    class PermuteLayerNorm2d(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.permute(0, 2, 3, 1)
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
            return x.permute(0, 3, 1, 2)

    _CHANNEL_NORM_CLASSES.update(
        ChannelRMS=ChannelRMS,
        ChannelRMSCupynorm=ChannelRMSCupynorm,
        PermuteLayerNorm2d=PermuteLayerNorm2d,
    )
    return _CHANNEL_NORM_CLASSES
