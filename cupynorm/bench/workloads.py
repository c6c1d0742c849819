"""The benchmark's workloads: what each row builds and feeds, its traffic and its goal.

Nothing here imports torch or another bench module but `specs` (the rows' dataclasses) and
`model_workloads` (the models group, re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .model_workloads import MODEL_WORKLOADS, MODEL_WORKLOADS_BY_NAME, SD_GROUPNORM
from .specs import ModelWorkload, ModuleSpec, Shape, Workload, shape_text

__all__ = [  # the dataclasses re-exported: `workloads` is where the bench's rows are found
    "H200_COPY_TBPS",
    "ITEMSIZE",
    "MODEL_WORKLOADS",
    "MODEL_WORKLOADS_BY_NAME",
    "WORKLOADS",
    "WORKLOADS_BY_NAME",
    "ModelWorkload",
    "ModuleSpec",
    "Shape",
    "Workload",
    "bytes_moved",
    "goal_ms_for_run",
    "select_workloads",
    "shape_text",
    "workload_groups",
]

# Copy bandwidth of the lent H200 on the day the goals were set (DESIGN.md, Performance goals).
# On another GPU the goal is the same fraction of that GPU's measured copy bandwidth.
H200_COPY_TBPS = 4.24

ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _same_module(class_name: str, *args: Any, **kwargs: Any) -> dict[str, ModuleSpec]:
    """The torch.nn module and its cupynorm.torch drop-in, built with the same arguments."""
    kw = tuple(kwargs.items())
    return {
        "eager": ModuleSpec("torch.nn", class_name, args, kw),
        "cupynorm": ModuleSpec("cupynorm.torch", class_name, args, kw),
    }


_IN_NCHW = (112, 64, 512, 512)
_IN_NCHW_QUICK = (28, 64, 512, 512)
_BN_NCHW = (64, 64, 512, 512)
_BN_NCHW_QUICK = (16, 64, 512, 512)
_SEED002_ROWS = (1024, 8192)
_FWDBWD_NCHW = (32, 64, 256, 256)
_FWDBWD_TRAFFIC = "fwd: read x, write y; bwd: read x, read dy, write dx (5 passes)"
_LLM_ROWS = (8192, 4096)  # tokens x hidden: a transformer's pre-norm input
_KB40 = (16, 64, 256, 256)
_KB36 = (112, 64, 512, 512)  # KernelBench level 1 problem 36: RMS over the 64 channels
_KB36_QUICK = (28, 64, 512, 512)
_CONVNEXT_T = (64, 96, 56, 56)  # ConvNeXt-T's first stage (LayerNorm2d after the stem) at batch 64
_BN_ADD_RELU = (256, 256, 56, 56)  # a resnet50 bottleneck's tail at batch 256
_BN_ADD_RELU_QUICK = (64, 256, 56, 56)  # KernelBench level 1 problem 40: LayerNorm((64, 256, 256))

WORKLOADS: tuple[Workload, ...] = (
    Workload(
        name="instancenorm2d_fp32",
        title="InstanceNorm2d(64) fp32 fwd",
        **_same_module("InstanceNorm2d", 64),
        input_shapes=(_IN_NCHW,),
        quick_input_shapes=(_IN_NCHW_QUICK,),
        goal_ms=3.9,
    ),
    Workload(
        name="groupnorm8_fp32",
        title="GroupNorm(8, 64) fp32 fwd",
        **_same_module("GroupNorm", 8, 64),
        input_shapes=(_IN_NCHW,),
        quick_input_shapes=(_IN_NCHW_QUICK,),
        goal_ms=3.9,
    ),
    Workload(
        name="batchnorm2d_train_fp32",
        title="BatchNorm2d(64) training fp32 fwd",
        **_same_module("BatchNorm2d", 64),
        input_shapes=(_BN_NCHW,),
        quick_input_shapes=(_BN_NCHW_QUICK,),
        goal_ms=3.1,
    ),
    Workload(
        name="row_norm_add_mul_fp32",
        title="seed-002 tail: row instance norm over 8192 features, then (x + y) * y, fp32",
        eager=ModuleSpec("bench", "Seed002Tail", (8192,), (("eps", 1e-5), ("momentum", 0.1))),
        cupynorm=ModuleSpec("cupynorm.torch", "RowNormAddMul", (), (("eps", 1e-5),)),
        input_shapes=(_SEED002_ROWS, _SEED002_ROWS),
        tensor_passes=3,
        traffic="read x, read y, write out (3 passes)",
        goal_ms=0.030,
    ),
    Workload(
        name="groupnorm32_fp16_cl",
        title="GroupNorm(32, 320) fp16 channels_last fwd",
        **_same_module("GroupNorm", 32, 320),
        input_shapes=(SD_GROUPNORM,),
        dtype="float16",
        channels_last=True,
        goal_ms=0.025,
    ),
    Workload(
        name="groupnorm32_fp16",
        title="GroupNorm(32, 320) fp16 NCHW fwd",
        **_same_module("GroupNorm", 32, 320),
        input_shapes=(SD_GROUPNORM,),
        dtype="float16",
        goal_ms=0.025,
    ),
    Workload(
        name="batchnorm2d_train_fp16_cl",
        title="BatchNorm2d(64) training fp16 channels_last fwd",
        **_same_module("BatchNorm2d", 64),
        input_shapes=((256, 64, 112, 112),),
        dtype="float16",
        channels_last=True,
        goal_ms=0.31,
    ),
    Workload(
        name="instancenorm2d_affine_fwdbwd_fp32",
        title="InstanceNorm2d(64, affine=True) fp32 fwd+bwd",
        **_same_module("InstanceNorm2d", 64, affine=True),
        input_shapes=(_FWDBWD_NCHW,),
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=0.75,
    ),
    Workload(
        name="batchnorm2d_fwdbwd_fp32",
        title="BatchNorm2d(64) training fp32 fwd+bwd",
        **_same_module("BatchNorm2d", 64),
        input_shapes=(_FWDBWD_NCHW,),
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=1.15,
    ),
    Workload(
        name="groupnorm32_fwdbwd_fp16",
        title="GroupNorm(32, 320) fp16 fwd+bwd",
        **_same_module("GroupNorm", 32, 320),
        input_shapes=(SD_GROUPNORM,),
        dtype="float16",
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=0.07,
        note=(
            "host time: a step is two Python calls with autograd's engine between them; the "
            "kernels take ~89 us on an H200 (benchmarks/NOTES.md)"
        ),
    ),
    Workload(
        name="layernorm_bf16",
        title="LayerNorm(4096) bf16 8192x4096 fwd",
        **_same_module("LayerNorm", 4096),
        input_shapes=(_LLM_ROWS,),
        dtype="bfloat16",
        goal_ms=0.032,
    ),
    Workload(
        name="rmsnorm_bf16",
        title="RMSNorm(4096) bf16 8192x4096 fwd",
        **_same_module("RMSNorm", 4096),
        input_shapes=(_LLM_ROWS,),
        dtype="bfloat16",
        goal_ms=0.032,
    ),
    Workload(
        name="layernorm_fwdbwd_bf16",
        title="LayerNorm(4096) bf16 8192x4096 fwd+bwd",
        **_same_module("LayerNorm", 4096),
        input_shapes=(_LLM_ROWS,),
        dtype="bfloat16",
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=0.085,
    ),
    Workload(
        name="rmsnorm_fwdbwd_bf16",
        title="RMSNorm(4096) bf16 8192x4096 fwd+bwd",
        **_same_module("RMSNorm", 4096),
        input_shapes=(_LLM_ROWS,),
        dtype="bfloat16",
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=0.085,
    ),
    Workload(
        name="layernorm_kb40_fp32",
        title="KernelBench L1-40: LayerNorm((64, 256, 256)) fp32 16x64x256x256 fwd",
        **_same_module("LayerNorm", (64, 256, 256)),
        input_shapes=(_KB40,),
        quick_input_shapes=((4, 64, 256, 256),),
        goal_ms=0.14,
    ),
    Workload(
        name="rmsnorm2d_kb36_fp32",
        title="KernelBench L1-36: RMS over the channels (dim 1) fp32 112x64x512x512 fwd",
        eager=ModuleSpec("bench", "ChannelRMS", (64,)),
        cupynorm=ModuleSpec("bench", "ChannelRMSCupynorm", (64,)),
        input_shapes=(_KB36,),
        quick_input_shapes=(_KB36_QUICK,),
        goal_ms=3.9,
    ),
    Workload(
        name="layernorm2d_bf16",
        title="LayerNorm2d(96) (ConvNeXt) bf16 NCHW 64x96x56x56 fwd",
        eager=ModuleSpec("bench", "PermuteLayerNorm2d", (96,), (("eps", 1e-6),)),
        cupynorm=ModuleSpec("cupynorm.torch", "LayerNorm2d", (96,), (("eps", 1e-6),)),
        input_shapes=(_CONVNEXT_T,),
        dtype="bfloat16",
        goal_text="<= eager",
    ),
    Workload(
        name="layernorm2d_fwdbwd_bf16_cl",
        title="LayerNorm2d(96) (ConvNeXt) bf16 channels_last 64x96x56x56 fwd+bwd",
        eager=ModuleSpec("bench", "PermuteLayerNorm2d", (96,), (("eps", 1e-6),)),
        cupynorm=ModuleSpec("cupynorm.torch", "LayerNorm2d", (96,), (("eps", 1e-6),)),
        input_shapes=(_CONVNEXT_T,),
        dtype="bfloat16",
        channels_last=True,
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_text="<= eager",
    ),
    Workload(
        name="add_rmsnorm_bf16",
        title="residual add + RMSNorm(4096) bf16 8192x4096 fwd (output and sum written)",
        eager=ModuleSpec("bench", "AddRMSNorm", (4096,)),
        cupynorm=ModuleSpec("bench", "AddRMSNormCupynorm", (4096,)),
        input_shapes=(_LLM_ROWS, _LLM_ROWS),
        dtype="bfloat16",
        tensor_passes=4,
        traffic="read x, read residual, write out, write sum (4 passes)",
        goal_ms=0.066,
    ),
    Workload(
        name="batchnorm2d_add_relu_fp16_cl",
        title="BatchNorm2d(256) training + residual add + ReLU fp16 channels_last fwd",
        eager=ModuleSpec("bench", "BatchNormAddReLU", (256,)),
        cupynorm=ModuleSpec("cupynorm.torch", "BatchNormAct2d", (256,)),
        input_shapes=(_BN_ADD_RELU, _BN_ADD_RELU),
        quick_input_shapes=(_BN_ADD_RELU_QUICK, _BN_ADD_RELU_QUICK),
        dtype="float16",
        channels_last=True,
        # the statistics must be complete before any output: x is read twice at this size
        tensor_passes=4,
        traffic="read x twice, read residual, write y (4 passes)",
        goal_ms=0.456,  # 4 passes at 85% of copy bandwidth
    ),
    Workload(
        name="groupnorm32_silu_fp16",
        title="GroupNorm(32, 320) + SiLU fp16 NCHW fwd",
        eager=ModuleSpec("bench", "GroupNormSiLU", (32, 320)),
        cupynorm=ModuleSpec("cupynorm.torch", "GroupNormAct", (32, 320)),
        input_shapes=(SD_GROUPNORM,),
        dtype="float16",
        goal_ms=0.025,  # as the GroupNorm row: the activation costs no pass
    ),
    Workload(
        name="groupnorm32_silu_fp16_cl",
        title="GroupNorm(32, 320) + SiLU fp16 channels_last fwd",
        eager=ModuleSpec("bench", "GroupNormSiLU", (32, 320)),
        cupynorm=ModuleSpec("cupynorm.torch", "GroupNormAct", (32, 320)),
        input_shapes=(SD_GROUPNORM,),
        dtype="float16",
        channels_last=True,
        goal_ms=0.025,
    ),
    Workload(
        name="groupnorm32_silu_fwdbwd_fp16",
        title="GroupNorm(32, 320) + SiLU fp16 fwd+bwd",
        eager=ModuleSpec("bench", "GroupNormSiLU", (32, 320)),
        cupynorm=ModuleSpec("cupynorm.torch", "GroupNormAct", (32, 320)),
        input_shapes=(SD_GROUPNORM,),
        dtype="float16",
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=0.07,  # as the GroupNorm row: SiLU's gradient is taken in the passes it makes
    ),
    Workload(
        name="groupnorm32_shift_silu_fp16",
        title="time embedding + GroupNorm(32, 320) + SiLU fp16 NCHW fwd (diffusers' norm2)",
        eager=ModuleSpec("bench", "GroupNormShiftSiLU", (32, 320)),
        cupynorm=ModuleSpec("cupynorm.torch", "GroupNormAct", (32, 320)),
        input_shapes=(SD_GROUPNORM, SD_GROUPNORM[:2]),
        dtype="float16",
        traffic="read x, write y (the (N, C) shift is added in the kernel)",
        goal_ms=0.025,  # as the GroupNorm row: the add costs no pass
    ),
    Workload(
        name="groupnorm32_shift_silu_fwdbwd_fp16",
        title="time embedding + GroupNorm(32, 320) + SiLU fp16 fwd+bwd",
        eager=ModuleSpec("bench", "GroupNormShiftSiLU", (32, 320)),
        cupynorm=ModuleSpec("cupynorm.torch", "GroupNormAct", (32, 320)),
        input_shapes=(SD_GROUPNORM, SD_GROUPNORM[:2]),
        dtype="float16",
        backward=True,
        tensor_passes=5,
        traffic=_FWDBWD_TRAFFIC,
        goal_ms=0.07,
    ),
    Workload(
        name="seed002_model_fp32",
        title="seed-002 model: Linear(8192, 8192) 'bmm' + the tail, fp32, batch 1024",
        eager=ModuleSpec("bench", "Seed002Model", (8192, 8192)),
        cupynorm=ModuleSpec("bench", "Seed002ModelCupynorm", (8192, 8192)),
        input_shapes=(_SEED002_ROWS, _SEED002_ROWS),
        tensor_passes=None,
        traffic="GEMM-bound: no TB/s",
        goal_text="<= eager",
    ),
    Workload(
        name="module_overhead",
        title="InstanceNorm2d(64) fp32 8x64x32x32 module call, per-call time (host overhead)",
        **_same_module("InstanceNorm2d", 64),
        input_shapes=((8, 64, 32, 32),),
        tensor_passes=None,
        traffic="host overhead: no TB/s",
        goal_text="<= eager",
        measure="overhead",
    ),
)

WORKLOADS_BY_NAME: dict[str, Workload] = {w.name: w for w in WORKLOADS}


def workload_groups() -> dict[str, tuple[str, ...]]:
    """Names `--only` accepts for several workloads at once: "kernels" (every workload of the
    default run) and "models" (the whole training steps, which run only when named)."""
    return {
        "kernels": tuple(w.name for w in WORKLOADS),
        "models": tuple(w.name for w in MODEL_WORKLOADS),
    }


def select_workloads(only: Sequence[str] | None) -> list[Workload | ModelWorkload]:
    """The workloads named by `--only` (repeatable, comma lists, group names), in registry order
    (the kernel workloads, then the models).

    None or an empty selection means the kernel workloads (the models group runs only when
    named). Raises ValueError naming unknown workloads.
    """
    if not only:
        return list(WORKLOADS)
    wanted: list[str] = []
    for item in only:
        wanted.extend(name.strip() for name in item.split(",") if name.strip())
    if not wanted:
        return list(WORKLOADS)
    groups = workload_groups()
    every: list[Workload | ModelWorkload] = [*WORKLOADS, *MODEL_WORKLOADS]
    known = {w.name for w in every}
    unknown = [name for name in wanted if name not in known and name not in groups]
    if unknown:
        raise ValueError(
            f"unknown workload(s): {', '.join(unknown)}; "
            f"choose from: {', '.join(w.name for w in every)}; "
            f"or a group: {', '.join(groups)}"
        )
    chosen: set[str] = set()
    for name in wanted:
        chosen.update(groups.get(name, (name,)))
    return [w for w in every if w.name in chosen]


def bytes_moved(workload: Workload, quick: bool = False) -> int | None:
    """Bytes that define TB/s: `tensor_passes` passes over the first input; None if not counted."""
    if workload.tensor_passes is None:
        return None
    numel = math.prod(workload.shapes(quick)[0])
    return workload.tensor_passes * numel * ITEMSIZE[workload.dtype]


def goal_ms_for_run(
    workload: Workload, quick: bool, copy_tbps: float | None, gpu_name: str
) -> float | None:
    """The millisecond goal that applies to this run, or None for a relative goal.

    The goals are H200 numbers at the full shapes. A `--quick` shape scales the goal by its share
    of the bytes; another GPU scales it by H200_COPY_TBPS / its measured copy bandwidth.
    """
    if workload.goal_ms is None:
        return None
    goal = workload.goal_ms
    full_bytes = bytes_moved(workload, quick=False)
    run_bytes = bytes_moved(workload, quick=quick)
    if full_bytes and run_bytes:
        goal *= run_bytes / full_bytes
    if "H200" not in gpu_name and copy_tbps:
        goal *= H200_COPY_TBPS / copy_tbps
    return goal
