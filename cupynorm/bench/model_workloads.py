"""The bench's models group: whole training steps of real models (run by
`cupynorm.bench.train`), each row what it builds, feeds and converts. Re-exported by
`cupynorm.bench.workloads`, where the bench finds every row.

Nothing here imports torch or another bench module but `specs` (the rows' dataclasses).
"""

from __future__ import annotations

from .specs import ModelWorkload

#: Stable Diffusion's first UNet block's GroupNorm(32, 320) input at batch 16 (the kernel rows'
#: GroupNorm shape too)
SD_GROUPNORM = (16, 320, 64, 64)

# ------------------------------------------------------------------------------------------------
# The models group: whole training steps (run by `cupynorm.bench.train`)
# ------------------------------------------------------------------------------------------------


# Why the host-bound rows (small batches, many norm layers) miss in eager and compile mode
# (benchmarks/NOTES.md, 2026-11-26): the measured floor of a norm layer in Python.
_HOST_BOUND_NOTE = (
    "host-bound at this batch: a cupynorm layer's host path is Python up to the launch (a bare "
    "autograd.Function costs about what torch's whole C++ layer does); CUDA graphs remove it"
)

_RESNET50_TITLE = "torchvision resnet50() training step (53 BatchNorm2d), bf16 autocast, SGD"
_EFFICIENTNET_TITLE = (
    "timm efficientnet_b0 training step (49 BatchNormAct2d: BatchNorm then SiLU), bf16 autocast, "
    "SGD"
)
_MOBILENETV3_TITLE = (
    "timm mobilenetv3_large_100 training step (46 BatchNormAct2d: BatchNorm then ReLU, Hardswish "
    "or nothing), bf16 autocast, SGD"
)
_CONVNEXT_TITLE = (
    "timm convnext_tiny training step (23 LayerNorm: 18 over the channels of NHWC rows, 5 "
    "LayerNorm2d), bf16 autocast, SGD"
)
_VIT_TITLE = (
    "timm vit_base_patch16_224 training step (25 LayerNorm(768) over the tokens' rows), bf16 "
    "autocast, SGD"
)
_GN_BLOCKS_TITLE = (
    "4 diffusers-style ResNet blocks (GroupNorm(32, 320), SiLU, Conv3x3, x2, + residual; "
    "8 GroupNorm) training step, fp16, SGD"
)

_UNET_BLOCKS_TITLE = (
    "4 diffusers-style ResNet blocks with a time embedding (GroupNorm(32, 320), SiLU, Conv3x3, "
    "+ projected time embedding, GroupNorm, SiLU, Conv3x3, + residual; 8 GroupNorm, 1280-wide "
    "embedding) training step, fp16, SGD"
)

_UNET_BLOCKS_AUTOCAST_TITLE = (
    "4 diffusers-style ResNet blocks with a time embedding (as above; 8 GroupNorm) training step, "
    "float32 weights under fp16 autocast (how diffusers' training scripts run), SGD"
)

_LLAMA_TITLE = (
    "transformers LlamaForCausalLM (random init, 8 layers, hidden 2048, 17 LlamaRMSNorm, vocab "
    "32000, fed embeddings; the residual add before each post-attention norm fused into it: "
    "patch_transformers) training step, bf16, SGD"
)

_QWEN2_TITLE = (
    "transformers Qwen2ForCausalLM (random init, the Llama row's shape: 8 layers, hidden 2048, 17 "
    "Qwen2RMSNorm of Llama's formula, vocab 32000, fed embeddings; patch_transformers) training "
    "step, bf16, SGD"
)
_GEMMA_TITLE = (
    "transformers GemmaForCausalLM (random init, the Llama row's shape, head size 128: 17 "
    "GemmaRMSNorm, (1 + weight) in float32, vocab 32000, fed embeddings; patch_transformers) "
    "training step, bf16, SGD"
)

_SD15_UNET_TITLE = (
    "diffusers UNet2DConditionModel in Stable Diffusion 1.5's layout (random init; 61 GroupNorm, "
    "44 fused with SiLU, 22 of them with the time embedding, 48 LayerNorm) noise-prediction "
    "training step, 64x64 latents, 77x768 text embeddings, float32 weights under fp16 autocast, "
    "SGD"
)
_SD_VAE_DECODE_TITLE = (
    "diffusers AutoencoderKL in Stable Diffusion's layout (random init), decode of 64x64 latents "
    "to 512x512 images (30 GroupNorm, 24 fused with SiLU), inference, fp16"
)

MODEL_WORKLOADS: tuple[ModelWorkload, ...] = (
    ModelWorkload(
        name="resnet50_b64_bf16_cl",
        title=_RESNET50_TITLE,
        model="resnet50",
        input_shape=(64, 3, 224, 224),
        autocast="bfloat16",
        channels_last=True,
        goal_speedup=1.15,
        goal_modes=("eager", "graphed"),
    ),
    ModelWorkload(
        name="resnet50_b256_bf16_cl",
        title=_RESNET50_TITLE,
        model="resnet50",
        input_shape=(256, 3, 224, 224),
        autocast="bfloat16",
        channels_last=True,
        accuracy_batch=64,
        goal_speedup=1.15,
        goal_modes=("eager", "graphed"),
    ),
    ModelWorkload(
        name="efficientnet_b0_b64_bf16_cl",
        title=_EFFICIENTNET_TITLE,
        model="efficientnet_b0",
        input_shape=(64, 3, 224, 224),
        autocast="bfloat16",
        channels_last=True,
        note=_HOST_BOUND_NOTE,
    ),
    ModelWorkload(
        name="mobilenetv3_b64_bf16_cl",
        title=_MOBILENETV3_TITLE,
        model="mobilenetv3",
        input_shape=(64, 3, 224, 224),
        autocast="bfloat16",
        channels_last=True,
        note=_HOST_BOUND_NOTE,
    ),
    ModelWorkload(
        name="convnext_tiny_b64_bf16_cl",
        title=_CONVNEXT_TITLE,
        model="convnext_tiny",
        input_shape=(64, 3, 224, 224),
        autocast="bfloat16",
        channels_last=True,
        accuracy_batch=16,
        convert="layer_norms",
        note=_HOST_BOUND_NOTE,
    ),
    ModelWorkload(
        name="vit_base_b64_bf16",
        title=_VIT_TITLE,
        model="vit_base",
        input_shape=(64, 3, 224, 224),
        autocast="bfloat16",
        accuracy_batch=16,
        convert="layer_norms",
        note=_HOST_BOUND_NOTE,
    ),
    ModelWorkload(
        name="gn_blocks_fp16_cl",
        title=_GN_BLOCKS_TITLE,
        model="gn_resnet_blocks",
        input_shape=SD_GROUPNORM,
        dtype="float16",
        channels_last=True,
        loss="mse",
        lr=1e-5,
    ),
    ModelWorkload(
        name="gn_blocks_fp16",
        title=_GN_BLOCKS_TITLE,
        model="gn_resnet_blocks",
        input_shape=SD_GROUPNORM,
        dtype="float16",
        loss="mse",
        lr=1e-5,
    ),
    ModelWorkload(
        name="unet_blocks_fp16",
        title=_UNET_BLOCKS_TITLE,
        model="unet_resnet_blocks",
        input_shape=SD_GROUPNORM,
        dtype="float16",
        loss="mse",
        lr=1e-5,
    ),
    ModelWorkload(
        name="unet_blocks_fp16_cl",
        title=_UNET_BLOCKS_TITLE,
        model="unet_resnet_blocks",
        input_shape=SD_GROUPNORM,
        dtype="float16",
        channels_last=True,
        loss="mse",
        lr=1e-5,
    ),
    ModelWorkload(
        name="unet_blocks_autocast_fp16",
        title=_UNET_BLOCKS_AUTOCAST_TITLE,
        model="unet_resnet_blocks",
        input_shape=SD_GROUPNORM,
        autocast="float16",
        loss="mse",
        lr=1e-5,
    ),
    ModelWorkload(
        name="unet_blocks_autocast_fp16_cl",
        title=_UNET_BLOCKS_AUTOCAST_TITLE,
        model="unet_resnet_blocks",
        input_shape=SD_GROUPNORM,
        autocast="float16",
        channels_last=True,
        loss="mse",
        lr=1e-5,
    ),
    ModelWorkload(
        name="llama_8l_h2048_s2048_b4_bf16",
        title=_LLAMA_TITLE,
        model="llama",
        input_shape=(4, 2048, 2048),  # batch, sequence, hidden: the input embeddings
        dtype="bfloat16",
        loss="token_cross_entropy",
        num_classes=32000,  # the vocabulary
        lr=1e-3,
        # float64 at batch 4 (and its fp64 attention matrices) would take ~20 GB and seconds of
        # fp64 matmuls: batch 1 shows the same per-token numerics
        accuracy_batch=1,
        convert="llama_rms_norm",
        patch_transformers=True,
        layers=8,
    ),
    *(
        ModelWorkload(
            name=f"{family}_8l_h2048_s2048_b4_bf16",
            title=title,
            model=family,
            input_shape=(4, 2048, 2048),
            dtype="bfloat16",
            loss="token_cross_entropy",
            num_classes=32000,
            lr=1e-3,
            accuracy_batch=1,  # as the Llama row
            convert=convert,
            patch_transformers=True,
            layers=8,
        )
        for family, title, convert in (
            ("qwen2", _QWEN2_TITLE, "llama_rms_norm"),
            ("gemma", _GEMMA_TITLE, "hf_norms"),
        )
    ),
    ModelWorkload(
        name="sd15_unet_b8_autocast_fp16",
        title=_SD15_UNET_TITLE,
        model="sd15_unet",
        input_shape=(8, 4, 64, 64),  # noisy latents of 512x512 images
        autocast="float16",
        loss="mse",  # against random noise
        lr=1e-5,
        # float64 at batch 8 would not fit (activations and the 4096-token attention matrices)
        accuracy_batch=1,
        convert="fuse_layer_norms",
    ),
    ModelWorkload(
        name="sd_vae_decode_b4_fp16",
        title=_SD_VAE_DECODE_TITLE,
        model="sd_vae_decoder",
        input_shape=(4, 4, 64, 64),
        dtype="float16",
        inference=True,
        loss="mse",  # the accuracy check's input gradient
        output_shape=(4, 3, 512, 512),
        accuracy_batch=1,
    ),
)

MODEL_WORKLOADS_BY_NAME: dict[str, ModelWorkload] = {w.name: w for w in MODEL_WORKLOADS}
