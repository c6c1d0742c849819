"""The models group's diffusion models from diffusers' own classes (random weights, built from a
config: nothing is downloaded): Stable Diffusion 1.5's UNet predicting noise, and SD's VAE
decoding latents. diffusers is optional: without it the factories raise ModuleNotFoundError
and their rows are skipped (`models.OPTIONAL_PACKAGES`). torch and diffusers are imported on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .specs import ModelWorkload

if TYPE_CHECKING:
    import torch

# UNet2DConditionModel as in Stable Diffusion 1.5's unet/config.json (the arguments that differ
# from diffusers' defaults, and the channels and blocks spelled out).
SD15_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
}
TEXT_TOKENS = 77  # CLIP's text sequence: the cross-attention's keys and values

# AutoencoderKL as in Stable Diffusion's vae/config.json.
SD_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 512,
}

_CLASSES: dict[str, type] = {}


def _wrapper_classes() -> dict[str, type]:
    """UNetNoisePrediction and VAEDecode, defined on first use (they need torch)."""
    if _CLASSES:
        return _CLASSES
    import torch
    from torch import nn

    class UNetNoisePrediction(nn.Module):
        """A UNet2DConditionModel predicting the noise in a batch of noisy latents, at fixed
        timesteps spread over 0..999 and conditioned on fixed random text embeddings (buffers:
        the bench feeds one tensor). A smaller batch uses the first rows of both."""

        def __init__(self, unet: nn.Module, batch: int, tokens: int = TEXT_TOKENS) -> None:
            super().__init__()
            self.unet = unet
            generator = torch.Generator().manual_seed(0)
            width = unet.config.cross_attention_dim
            self.register_buffer("timesteps", torch.linspace(0, 999, batch).long())
            text = torch.randn(batch, tokens, width, generator=generator)
            self.register_buffer("encoder_hidden_states", text)

        def forward(self, latents: torch.Tensor) -> torch.Tensor:
            rows = latents.shape[0]
            timesteps, text = self.timesteps[:rows], self.encoder_hidden_states[:rows]
            return self.unet(latents, timesteps, text, return_dict=False)[0]

    class VAEDecode(nn.Module):
        """An AutoencoderKL's `decode` (post-quant conv, then the decoder): latents to images.
        Its encoder, which decoding never runs, is dropped."""

        def __init__(self, vae: nn.Module) -> None:
            super().__init__()
            vae.encoder = None
            self.vae = vae

        def forward(self, latents: torch.Tensor) -> torch.Tensor:
            return self.vae.decode(latents, return_dict=False)[0]

    _CLASSES.update(UNetNoisePrediction=UNetNoisePrediction, VAEDecode=VAEDecode)
    return _CLASSES


def unet_noise_prediction(workload: ModelWorkload, config: dict[str, Any]) -> torch.nn.Module:
    """diffusers' UNet2DConditionModel built from `config` (random weights), predicting noise
    for the workload's batch; an ImportError when diffusers is missing."""
    diffusers = importlib.import_module("diffusers")
    unet = diffusers.UNet2DConditionModel(**config)
    return _wrapper_classes()["UNetNoisePrediction"](unet, workload.input_shape[0])


def vae_decode(workload: ModelWorkload, config: dict[str, Any]) -> torch.nn.Module:
    """diffusers' AutoencoderKL built from `config` (random weights), decoding latents; an
    ImportError when diffusers is missing."""
    diffusers = importlib.import_module("diffusers")
    return _wrapper_classes()["VAEDecode"](diffusers.AutoencoderKL(**config))


def sd15_unet(workload: ModelWorkload) -> torch.nn.Module:
    """Stable Diffusion 1.5's UNet (SD15_UNET_CONFIG), random weights."""
    return unet_noise_prediction(workload, SD15_UNET_CONFIG)


def sd_vae_decoder(workload: ModelWorkload) -> torch.nn.Module:
    """Stable Diffusion's VAE (SD_VAE_CONFIG) decoding, random weights."""
    return vae_decode(workload, SD_VAE_CONFIG)
