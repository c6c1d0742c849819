"""What ``cupynorm.torch.fuse`` does to timm's models: one small model per architecture family.

Each model of ``FAMILIES`` is built seeded, random init, dropout and drop-path off (a forward is
deterministic), in training mode (BatchNorm on batch statistics). Then:

- conversion: ``fuse(copy.deepcopy(model), report=lines)`` (``--layer-norms``: the LayerNorm and
  RMSNorm layers too, opt-in in ``replace_norms``, converted first). Counted: the norm layers
  (``is_norm_layer``: torch's classes and timm's), those now cupynorm's (a cupynorm class in
  their MRO), the fusions (``len(lines)``), those left with the reason; whether fx traced the
  model whole (else only its fused parts, or none: norms converted, not fused).
- accuracy: fp32, TF32 off, the output and the gradients of ``(output * g).sum()`` (``g`` fixed,
  random) with respect to the input and the parameters (matched by name: fuse keeps them), of
  torch's model and of cupynorm's, each against torch's in float64 (max |a - ref| / max |ref|;
  ``PARAM_GRAD_FLOOR``), each the mean over ``ACCURACY_DRAWS`` inputs and ``g``. All-zero
  parameters get random values first: nothing is left untested.
  ``ok``: cupynorm's three errors (output, input gradient, worst parameter gradient) within the
  bench's bound (``checking.accuracy_ok``: 2x torch's + 1e-6); a failure that replace_norms
  warned of (torch's own AvgPool2d bug, ``TORCH_POOL_BUG``) says so.
- timing (CUDA, not with ``--no-time``): the bench's ``TrainStep`` (forward, cross-entropy on
  random labels, backward, SGD) at ``--batch``, bf16 autocast, channels_last. Eager: median of
  40 steps, torch's and cupynorm's alternated in rounds. Graphed: the whole step captured in one
  CUDA graph and replayed, one graph alive at a time (``train.ONE_GRAPH_AT_A_TIME``).

A model's failure is recorded (stage, exception, first line) and the sweep goes on; no model
starts once ``--budget-s`` is spent. Each model prints its table row as it ends; the JSON (and
markdown) are rewritten. After a sticky CUDA error the script restarts itself with ``--resume``.

    PYTHONPATH=$PWD python scripts/timm_sweep.py --json timm_sweep.json --markdown timm_sweep.md

(H200: ~200 s with ``--no-time`` for 83 families, ~10 s a family more with 15 timed steps;
``--models resnet18,vit_tiny_patch16_224``: those alone; without a GPU,
``--device cpu --no-time --accuracy-batch 2``: cupynorm's modules run torch's ops there, so
this checks the names, the conversion and the bookkeeping; ``--convert-only``: the conversion
counts alone, on any machine.)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cupynorm from this checkout
from cupynorm.bench import timing  # noqa: E402
from cupynorm.bench.checking import accuracy_ok, max_relative_error  # noqa: E402
from cupynorm.bench.markdown_training import TORCH_POOL_BUG  # noqa: E402  (replace_norms' warning names it)
from cupynorm.bench.run import _error_text  # noqa: E402  ("Type: first line")
from cupynorm.bench.specs import ModelWorkload  # noqa: E402
from cupynorm.bench.trainstep import TrainStep, make_batch  # noqa: E402


class ModelSpec(NamedTuple):
    family: str
    model: str  # a name of timm.list_models()
    size: int | None = None  # input height = width; None: the model's pretrained_cfg


# One small model per timm architecture family (family=timm name), the most used first: a sweep
# cut short by its budget loses the rarest. Names checked against timm 1.0.31.
_FAMILY_MODELS = """
resnet=resnet18 resnet-d=resnet50d efficientnet=efficientnet_b0 mobilenetv3=mobilenetv3_large_100
mobilenetv4=mobilenetv4_conv_small convnext=convnext_atto convnextv2=convnextv2_atto
vit=vit_tiny_patch16_224 deit3=deit3_small_patch16_224 swin=swin_tiny_patch4_window7_224
swinv2=swinv2_tiny_window8_256 swinv2_cr=swinv2_cr_tiny_ns_224 regnety=regnety_002
densenet=densenet121 efficientnet-gn=efficientnet_b0_gn resnetv2-bit=resnetv2_50x1_bit
ghostnet=ghostnet_100 ghostnetv2=ghostnetv2_100 levit=levit_128s poolformer=poolformer_s12
poolformerv2=poolformerv2_s12 coatnet=coatnet_nano_rw_224 maxvit=maxvit_nano_rw_256
coat=coat_lite_tiny efficientformer=efficientformer_l1 efficientformerv2=efficientformerv2_s0
edgenext=edgenext_xx_small nfnet=nf_resnet26 cspnet=cspresnet50 dla=dla34 dpn=dpn68
hrnet=hrnet_w18_small inception_v3=inception_v3 res2net=res2net50_14w_8s resnest=resnest14d
rexnet=rexnet_100 selecsls=selecsls42b sknet=skresnet18 vgg=vgg11_bn xception=xception41
byobnet=gernet_s mobilevit=mobilevit_xxs mobilevitv2=mobilevitv2_050 nest=nest_tiny pit=pit_ti_224
tnt=tnt_s_patch16_224 twins=twins_pcpvt_small visformer=visformer_tiny xcit=xcit_nano_12_p16_224
convit=convit_tiny crossvit=crossvit_tiny_240 cait=cait_xxs24_224 eva02=eva02_tiny_patch14_224
volo=volo_d1_224 mvitv2=mvitv2_tiny fastvit=fastvit_t8 repvit=repvit_m1
efficientvit_mit=efficientvit_b0 efficientvit_msra=efficientvit_m0 tiny_vit=tiny_vit_5m_224
hiera=hiera_tiny_224 mambaout=mambaout_femto rdnet=rdnet_tiny inception_next=inception_next_atto
starnet=starnet_s1 repghost=repghostnet_050 davit=davit_tiny focalnet=focalnet_tiny_srf
gcvit=gcvit_xxtiny nextvit=nextvit_small vovnet=ese_vovnet19b_dw halonet=halonet26t
botnet=botnet26t_256 tresnet=tresnet_m hgnetv2=hgnetv2_b0 pvt_v2=pvt_v2_b0 fasternet=fasternet_t0
shvit=shvit_s1 swiftformer=swiftformer_xs mlp_mixer=mixer_s16_224 vit-hybrid=vit_small_r26_s32_224
sequencer=sequencer2d_s beit=beit_base_patch16_224 convmixer=convmixer_768_32
"""
FAMILIES = [ModelSpec(*item.split("=")) for item in _FAMILY_MODELS.split()]

# Timing: steps per round x rounds (torch's and cupynorm's eager steps alternate between rounds:
# a host's speed drifts within a run, see cupynorm.bench.train.ROUNDS), warm-up steps before.
# Eager steps of a small net are host-paced and noisy: with 3 rounds (15 steps each) models that
# convert nothing, the same model on both sides, measured 0.83-1.23x (benchmarks/NOTES.md).
STEPS_PER_ROUND = 5
ROUNDS = 8
WARMUP_STEPS = 3
GRAPH_WARMUP_STEPS = 3  # eager steps on a side stream before the capture
IMPLS = ("torch", "cupynorm")
LR = 0.01
SEED = 0
# A parameter's gradient error is relative to its largest float64 value, or to this fraction of
# the model's largest when that is more: a gradient zero in exact arithmetic (a bias just before a
# norm) is rounding noise in float64 too (1e-9 to 1e-20 of the largest), its own scale meaningless.
PARAM_GRAD_FLOOR = 1e-3
ACCURACY_DRAWS = 3  # inputs and projections per model; each error is their mean

_TORCH_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)
# Words of the class names of timm's containers that hold a norm (ConvNormAct, NormMlpHead, ...).
_CONTAINER_WORDS = ("Conv", "Linear", "Mlp", "Head", "Block", "Attention")
_ROW_NORM_NAME = re.compile(r"LayerNorm|RmsNorm|RMSNorm")


def is_norm_layer(module: nn.Module) -> bool:
    """A torch norm (BatchNorm*, InstanceNorm*, GroupNorm, LayerNorm, RMSNorm, or a subclass), or
    a timm class with "Norm" in its name and no submodules but ``drop`` and ``act`` (RmsNorm2d,
    EvoNorm2d*, FilterResponseNormAct2d, GlobalResponseNorm, ...)."""
    if isinstance(module, _TORCH_NORMS):
        return True
    name, timm_class = type(module).__name__, type(module).__module__.startswith("timm.")
    if not timm_class or "Norm" not in name or any(w in name for w in _CONTAINER_WORDS):
        return False
    return all(child in ("drop", "act") for child, _ in module.named_children())


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"  # as replace_norms' warning names classes


@dataclass
class SweepOptions:
    device: str = "cuda"
    time_steps: bool = True
    batch: int = 32  # of the timed steps
    accuracy_batch: int = 4  # of the fp32 / float64 accuracy check
    layer_norms: bool = False  # convert LayerNorm / RMSNorm too (opt-in in fuse)
    check: bool = True  # the accuracy check (--convert-only: conversion counts alone)


@dataclass
class ModelRecord:
    family: str
    model: str
    status: str = "ok"  # "ok", "failed", "not run (time)"
    error: str | None = None  # "<stage>: <exception>: <first line>"
    input_size: list[int] | None = None
    norm_layers: int = 0
    norm_classes: dict[str, int] = field(default_factory=dict)
    converted: int = 0
    fused: int = 0
    fusions: list[str] = field(default_factory=list)
    traced: str = ""  # by fx: "whole", "N parts" (submodules, fused), "no"
    left: list[dict[str, Any]] = field(default_factory=list)  # {class, count, reason}
    warnings: list[str] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)  # {out,dx,pgrad}_{torch,cupynorm}
    worst_param: str | None = None  # cupynorm's worst parameter gradient
    ok: bool | None = None
    eager_ms: dict[str, float] = field(default_factory=dict)  # impl -> median ms per step
    graphed_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # "graph cupynorm: failed (...)"
    seconds: float = 0.0


# ---- building and converting --------------------------------------------------------------------
def build_model(spec: ModelSpec, options: SweepOptions) -> tuple[nn.Module, tuple[int, ...]]:
    """timm's model, seeded, dropout and drop-path off, in training mode; and its input size."""
    import timm

    size = {"img_size": spec.size} if spec.size else {}
    torch.manual_seed(SEED)
    try:
        model = timm.create_model(spec.model, drop_rate=0.0, drop_path_rate=0.0, **size)
    except TypeError:  # a model that takes none of them: timm's defaults are 0, zeroed below too
        torch.manual_seed(SEED)
        model = timm.create_model(spec.model)
    # An all-zero parameter (hiera's classifier, the last BatchNorm weight of resnet50d's blocks)
    # zeroes the gradients behind it, which the check would then compare: small random values.
    generator = torch.Generator().manual_seed(SEED)
    for p in model.parameters():
        if p.is_floating_point() and not p.any():
            p.data.normal_(0.0, 0.02, generator=generator)
    for module in model.modules():  # what drop_rate does not reach (attention dropout, ...)
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        if isinstance(getattr(module, "drop_prob", None), float):
            module.drop_prob = 0.0
    channels, height, width = model.pretrained_cfg["input_size"]
    return model.train(), (channels, spec.size or height, spec.size or width)


def convert(base: nn.Module, record: ModelRecord, options: SweepOptions) -> nn.Module:
    """cupynorm's copy of ``base`` by fuse (and the LayerNorms with --layer-norms); fills the
    conversion's part of ``record``."""
    import cupynorm.torch as cnt

    lines: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = copy.deepcopy(base)
        if options.layer_norms:  # opt-in in replace_norms; fuse's trace keeps them as leaves
            cnt.replace_norms(model, include=[nn.LayerNorm, nn.RMSNorm])
        model = cnt.fuse(model, report=lines)
    record.warnings = sorted({str(w.message) for w in caught})
    record.fusions, record.fused = lines, len(lines)
    graphs = sum(isinstance(m, fx.GraphModule) for m in model.modules())
    parts = f"{graphs} part" + "s" * (graphs > 1) if graphs else "no"
    record.traced = "whole" if isinstance(model, fx.GraphModule) else parts

    after = dict(model.named_modules())
    norms = [(name, m) for name, m in base.named_modules() if is_norm_layer(m)]
    record.norm_layers = len(norms)
    record.norm_classes = dict(Counter(qualified_name(type(m)) for _, m in norms))
    warned = " ".join(record.warnings)
    left: dict[str, list] = {}  # class -> [count, reason]
    for name, module in norms:
        converted = after.get(name)
        ours = any(c.__module__.startswith("cupynorm") for c in type(converted).__mro__)
        if converted is not None and ours:  # (an adopted timm class keeps timm's __module__)
            record.converted += 1
            continue
        cls = qualified_name(type(module))
        if converted is None:
            reason = "not in the converted model (unused by its forward)"
        elif cls in warned:
            reason = "forward differs from its torch class (replace_norms warning)"
        elif _ROW_NORM_NAME.search(type(module).__name__) and not options.layer_norms:
            reason = "opt-in (--layer-norms)"
        elif isinstance(module, _TORCH_NORMS):
            reason = "not converted"
        else:
            reason = "no cupynorm counterpart"
        left.setdefault(cls, [0, reason])[0] += 1
    record.left = [{"class": c, "count": n, "reason": r} for c, (n, r) in left.items()]
    return model


class Built(NamedTuple):
    base: nn.Module  # torch's model, on the CPU
    converted: nn.Module  # cupynorm's copy
    input_size: tuple[int, ...]  # (C, H, W)


# ---- accuracy -----------------------------------------------------------------------------------
def _to_device(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """On the device, channels_last as the timed steps (the 4-D tensors alone:
    ``model.to(memory_format=...)`` refuses a model that holds a 5-D one)."""

    def channels_last(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t

    return model.to(device=device, dtype=dtype)._apply(channels_last)


def _tensors(output: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output (a tensor, tuple, dict, ...)."""
    leaves = pytree.tree_leaves(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _gradients(
    model: nn.Module, inputs: torch.Tensor, projections: list[torch.Tensor] | None, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """(outputs, projections, input gradient, parameter gradients by name) of
    loss = sum((output * g).sum()); the g are drawn (from ``seed``, float64) when not given."""
    x = inputs.detach().clone().requires_grad_(True)
    outputs = _tensors(model(x))
    if projections is None:
        generator = torch.Generator(device=x.device).manual_seed(seed)
        projections = [
            torch.randn(o.shape, generator=generator, device=x.device, dtype=torch.float64)
            for o in outputs
        ]
    loss = sum((o * g.to(o.dtype)).sum() for o, g in zip(outputs, projections, strict=True))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x, *(p for _, p in named)], allow_unused=True)
    by_name = {n: g.detach() for (n, _), g in zip(named, grads[1:], strict=True) if g is not None}
    return [o.detach() for o in outputs], projections, grads[0].detach(), by_name


def _scaled_error(actual: torch.Tensor, reference: torch.Tensor, floor: float) -> float:
    scale = max(float(reference.abs().max()), floor)
    difference = float((actual.double() - reference).abs().max())
    return difference / scale if scale > 0 else difference


def _errors_of_one_draw(
    built: Built, options: SweepOptions, seed: int
) -> tuple[dict[str, float], str | None]:
    """Errors (``{out,dx,pgrad}_{impl}``) of torch fp32 and cupynorm fp32 against torch float64
    for one input and one projection drawn from ``seed``; and cupynorm's worst parameter."""
    device = torch.device(options.device)
    generator = torch.Generator(device=device).manual_seed(seed + 2)
    shape = (options.accuracy_batch, *built.input_size)
    x64 = torch.randn(shape, generator=generator, device=device, dtype=torch.float64)
    x64 = x64.contiguous(memory_format=torch.channels_last)
    reference = _to_device(copy.deepcopy(built.base), device, torch.float64)
    out64, projections, dx64, grads64 = _gradients(reference, x64, None, seed + 1)
    del reference
    floor = PARAM_GRAD_FLOOR * max((float(g.abs().max()) for g in grads64.values()), default=0)
    errors, worst = {}, None
    for impl, source in zip(IMPLS, built[:2], strict=True):
        model = _to_device(copy.deepcopy(source), device, torch.float32)
        outs, _, dx, grads = _gradients(model, x64.float(), projections, seed + 1)
        errors[f"out_{impl}"] = max(map(max_relative_error, outs, out64), default=0.0)
        errors[f"dx_{impl}"] = max_relative_error(dx, dx64)
        per_param = {  # a gradient missing in the converted model: an infinite error
            name: _scaled_error(grads[name], ref, floor) if name in grads else float("inf")
            for name, ref in grads64.items()
        }
        worst = max(per_param, key=per_param.__getitem__, default=None)
        errors[f"pgrad_{impl}"] = per_param[worst] if worst is not None else 0.0
        del model
    return errors, worst


def check_accuracy(built: Built, record: ModelRecord, options: SweepOptions) -> None:
    """Errors of torch fp32 and cupynorm fp32 against torch float64 (TF32 off, restored after),
    each the mean over ``ACCURACY_DRAWS`` draws of the input and the projection: one draw's
    worst parameter-gradient error is one sample of rounding noise (efficientnet_b0_gn on an
    H200: torch 1.3e-5 / 2.0e-5 / 1.3e-5 over three draws, cupynorm 3.5e-5 / 1.6e-5 / 1.1e-5)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    draws = []
    try:
        for draw in range(ACCURACY_DRAWS):
            draws.append(_errors_of_one_draw(built, options, SEED + 10 * draw))
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved
    errors = {key: statistics.fmean(e[key] for e, _ in draws) for key in draws[0][0]}
    record.errors = errors
    record.worst_param = max(draws, key=lambda d: d[0]["pgrad_cupynorm"])[1]
    record.ok = all(
        accuracy_ok(errors[f"{kind}_cupynorm"], errors[f"{kind}_torch"])
        for kind in ("out", "dx", "pgrad")
    )


# ---- timing -------------------------------------------------------------------------------------
def _failure(exc: BaseException) -> str:
    """``Type: first line`` of ``exc``; its traceback goes to stderr."""
    traceback.print_exception(exc, file=sys.stderr)
    return _error_text(exc)


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _train_step(
    source: nn.Module, workload: ModelWorkload, batch: tuple[torch.Tensor, torch.Tensor]
) -> TrainStep:
    """The bench's training step on a fresh copy of ``source`` (its first output is the
    logits: a distilled model's second head is left out of the loss)."""
    model = _to_device(copy.deepcopy(source), batch[0].device, torch.float32).train()
    return TrainStep(model, workload, *batch, forward=lambda x: _tensors(model(x))[0])


def time_steps(built: Built, record: ModelRecord, options: SweepOptions) -> None:
    """Eager and graphed step times of torch's model and cupynorm's (see the module docstring)."""
    device = torch.device(options.device)
    classes = int(getattr(built.base, "num_classes", 0) or 1000)  # timm's models all say
    shape = (options.batch, *built.input_size)
    step_options = dict(autocast="bfloat16", channels_last=True, num_classes=classes, lr=LR)
    workload = ModelWorkload(record.model, record.family, record.model, shape, **step_options)
    batch = make_batch(workload, options.batch, device, torch.float32, seed=2)
    sources = dict(zip(IMPLS, built[:2], strict=True))
    try:
        steps = {impl: _train_step(source, workload, batch) for impl, source in sources.items()}
        for step in steps.values():
            for _ in range(WARMUP_STEPS):
                step()
        times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        for round_index in range(ROUNDS):
            order = IMPLS if round_index % 2 == 0 else IMPLS[::-1]
            for impl in order:
                times[impl] += timing.time_cuda_ms(steps[impl], reps=STEPS_PER_ROUND, warmup=1)
        record.eager_ms = {impl: statistics.median(t) for impl, t in times.items()}
    except Exception as exc:  # noqa: BLE001 - the graphed mode may still run
        record.notes.append(f"eager: failed ({_failure(exc)})")
    steps = {}
    _free_device_memory()
    # Whole-step graphs one at a time: two alive at once fault on replay on torch 2.11 / CUDA 13.
    for impl, source in sources.items():
        replay: Callable[[], object] | None = None
        try:
            trainer = _train_step(source, workload, batch)
            replay = timing.cuda.capture_graph(trainer, warmup=GRAPH_WARMUP_STEPS)
            times_ms = timing.time_cuda_ms(replay, reps=ROUNDS * STEPS_PER_ROUND, warmup=2)
            record.graphed_ms[impl] = statistics.median(times_ms)
        except Exception as exc:  # noqa: BLE001 - recorded in the cell
            record.notes.append(f"graph {impl}: failed ({_failure(exc)})")
        finally:
            trainer = replay = None  # the graph and its memory pool die with its replay
            _free_device_memory()


# ---- one model, the sweep -----------------------------------------------------------------------
def run_model(spec: ModelSpec, options: SweepOptions) -> ModelRecord:
    """Build, convert, check and time one model; a failure is recorded, never raised."""
    record = ModelRecord(spec.family, spec.model)
    started = time.perf_counter()
    stage = "build"
    try:
        base, input_size = build_model(spec, options)
        record.input_size = list(input_size)
        stage = "fuse"
        converted = convert(base, record, options)
        stage = "accuracy"
        built = Built(base, converted, input_size)
        if options.check:
            check_accuracy(built, record, options)
        if options.check and options.time_steps and torch.device(options.device).type == "cuda":
            stage = "timing"
            time_steps(built, record, options)
    except Exception as exc:  # noqa: BLE001 - one model's failure must not stop the sweep
        record.status, record.error = "failed", f"{stage}: {_failure(exc)}"
    finally:
        base = converted = built = None
        _free_device_memory()
    record.seconds = round(time.perf_counter() - started, 2)
    return record


class DeviceLost(RuntimeError):
    """A sticky CUDA error (an illegal address): this process can run no more models."""


def _device_lost(device: torch.device) -> bool:
    try:  # after a sticky error, any call fails
        return device.type == "cuda" and torch.ones(1, device=device).sum().item() != 1.0
    except Exception:  # noqa: BLE001 - whatever it raises
        return True


def sweep(
    specs: Sequence[ModelSpec],
    options: SweepOptions,
    deadline: float = float("inf"),
    done: Sequence[ModelRecord] = (),
    on_record: Callable[[list[ModelRecord]], None] | None = None,
) -> list[ModelRecord]:
    """``run_model`` for every spec not in ``done``, until ``deadline`` (time.time()); raises
    DeviceLost (after ``on_record``) when a model leaves the device unusable."""
    print("\n".join(TABLE_HEADER), flush=True)  # the log is a markdown table too
    records = list(done)
    todo = [s for s in specs if s.model not in {r.model for r in records}]
    for index, spec in enumerate(todo, start=len(records) + 1):
        if time.time() >= deadline:
            record = ModelRecord(spec.family, spec.model, status="not run (time)")
        else:
            record = run_model(spec, options)
        records.append(record)
        print(f"{table_row(record)} {record.seconds:.1f} s [{index}/{len(specs)}]", flush=True)
        if on_record is not None:
            on_record(records)
        if _device_lost(torch.device(options.device)):
            raise DeviceLost(f"the device is unusable after {spec.model}")
    return records


# ---- reporting ----------------------------------------------------------------------------------
def _pair(values: dict[str, float], fmt: str, ratio: bool = False) -> str:
    """``torch / cupynorm`` (``-`` for a missing one), with ``(torch / cupynorm x)``."""
    text = " / ".join(format(values[i], fmt) if i in values else "-" for i in IMPLS)
    if ratio and all(i in values for i in IMPLS) and values["cupynorm"] > 0:
        text += f" ({values['torch'] / values['cupynorm']:.2f}x)"
    return text


def _short_class(name: str) -> str:
    """``nn.LayerNorm``, ``timm.LayerNorm2d``, ``levit.Subsample`` for the table."""
    module, _, cls = name.rpartition(".")
    if module.startswith(("torch.", "timm.layers")):
        return f"{'nn' if module.startswith('torch.') else 'timm'}.{cls}"
    return f"{module.rpartition('.')[2]}.{cls}"


def _left_text(record: ModelRecord) -> str:
    by_reason: dict[str, list[str]] = {}
    for entry in record.left:
        text = f"{_short_class(entry['class'])} x{entry['count']}"
        by_reason.setdefault(entry["reason"], []).append(text)
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())


def _ok_text(record: ModelRecord) -> str:
    if record.status != "ok":
        return record.status + (f" ({record.error})" if record.error else "")
    if record.ok is False and any(TORCH_POOL_BUG in w for w in record.warnings):
        return f"NO (torch's AvgPool2d backward, {TORCH_POOL_BUG}: see the warning)"
    return {True: "yes", False: "NO", None: "-"}[record.ok]


TABLE_HEADER = [
    "| family | model | norm layers | converted | fused | left (reason) "
    "| out err torch / cupynorm | dx err torch / cupynorm | param-grad err torch / cupynorm "
    "| ok | eager ms torch / cupynorm (ratio) | graphed ms torch / cupynorm (ratio) |",
    "|---|---|---:|---:|---|---|---|---|---|---|---|---|",
]


def table_row(r: ModelRecord) -> str:
    """The model's row of the markdown table (also its line in the log)."""
    kinds = ("out", "dx", "pgrad")
    errors = [_pair({i: r.errors[f"{k}_{i}"] for i in IMPLS}, ".1e") for k in kinds if r.errors]
    fused = f"{r.fused}" + (f" (fx traced: {r.traced})" if r.traced not in ("whole", "") else "")
    graphed = _pair(r.graphed_ms, ".2f", True) if r.graphed_ms else ""
    graphed += "".join(f" {note}" for note in r.notes if note.startswith("graph"))
    eager = _pair(r.eager_ms, ".2f", True) if r.eager_ms else ""
    eager += "".join(f" {note}" for note in r.notes if note.startswith("eager"))
    cells = [r.family, f"`{r.model}`", str(r.norm_layers), str(r.converted), fused]
    cells += [_left_text(r) or "-", *(errors or ["", "", ""]), _ok_text(r)]
    cells += [eager.strip(), graphed.strip()]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def summary_line(records: Sequence[ModelRecord]) -> str:
    ran = [r for r in records if r.status == "ok"]
    fully = sum(r.norm_layers > 0 and r.converted == r.norm_layers for r in ran)
    partly = sum(0 < r.converted < r.norm_layers for r in ran)
    none = sum(r.norm_layers > 0 and r.converted == 0 for r in ran)
    no_norms = sum(r.norm_layers == 0 for r in ran)
    failed = sum(r.status == "failed" for r in records)
    not_run = sum(r.status == "not run (time)" for r in records)
    checked = [r for r in records if r.ok is not None]
    layers = sum(r.norm_layers for r in ran)
    converted = sum(r.converted for r in ran)
    share = f" ({100 * converted / layers:.1f}%)" if layers else ""
    return (
        f"{len(records)} models: converted fully {fully}, partly {partly}, none converted "
        f"{none}, no norms {no_norms}, failed {failed}, not run (time) {not_run}; norm layers "
        f"converted {converted} of {layers}{share}; accuracy ok "
        f"{sum(bool(r.ok) for r in checked)} of {len(checked)} checked"
    )


def markdown(records: Sequence[ModelRecord], env: dict[str, Any]) -> str:
    """The table for benchmarks/RESULTS.md, under a line that says how it was measured."""
    head = (
        f"timm sweep: {env['device_name']}, torch {env['torch']}, timm {env['timm']}, cupynorm "
        f"{env['cupynorm']}, {env['date']}. Conversion: {env['conversion']}. Errors: fp32 "
        f"against float64, batch {env['accuracy_batch']}, TF32 off. Steps: batch {env['batch']},"
        " bf16 autocast, channels_last, SGD; ms per step, ratio = torch / cupynorm."
    )
    rows = [table_row(r) for r in records]
    return "\n".join([head, "", *TABLE_HEADER, *rows, "", summary_line(records), ""])


# ---- command line -------------------------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")  # never a half-written file
    partial.write_text(text)
    os.replace(partial, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--json", type=Path, required=True, help="environment and one record per model")
    add("--markdown", type=Path, help="the table for benchmarks/RESULTS.md")
    add("--models", help="comma-separated timm names (default: every model of FAMILIES)")
    add("--no-time", action="store_true", help="conversion and accuracy only")
    add("--convert-only", action="store_true", help="conversion only (no GPU needed)")
    add("--device", default="cuda")
    add("--budget-s", type=float, default=480.0, help="start no model after this many seconds")
    add("--batch", type=int, default=32, help="of the timed steps")
    add("--accuracy-batch", type=int, default=4)
    add("--layer-norms", action="store_true", help="convert LayerNorm and RMSNorm too")
    add("--resume", action="store_true", help="keep the models already in --json")
    add("--started-at", type=float, help=argparse.SUPPRESS)  # the budget's start, kept by restarts
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = args.started_at or time.time()
    options = SweepOptions(args.device, not args.no_time, args.batch, args.accuracy_batch)
    options.layer_norms = args.layer_norms
    options.check = not args.convert_only
    import timm

    import cupynorm

    device_name = torch.cuda.get_device_name() if options.device.startswith("cuda") else "cpu"
    env = {"device_name": device_name, "torch": torch.__version__, "timm": timm.__version__}
    env.update(cupynorm=cupynorm.__version__, **asdict(options))
    env.update(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    env.update(conversion="fuse" + (" + LayerNorm/RMSNorm" if args.layer_norms else ""))
    env.update(accuracy_draws=ACCURACY_DRAWS, eager_steps=ROUNDS * STEPS_PER_ROUND)
    done: list[ModelRecord] = []
    if args.resume and args.json.exists():
        done = [ModelRecord(**r) for r in json.loads(args.json.read_text())["records"]]
        done = [r for r in done if r.status != "not run (time)"]

    def save(records: list[ModelRecord]) -> None:
        document = {"environment": env, "records": [asdict(r) for r in records]}
        _write(args.json, json.dumps(document, indent=1))
        if args.markdown:
            _write(args.markdown, markdown(records, env))

    known = {spec.model: spec for spec in FAMILIES}
    names = args.models.split(",") if args.models else list(known)
    specs = [known.get(name, ModelSpec("-", name)) for name in names]
    try:
        records = sweep(specs, options, started + args.budget_s, done, save)
    except DeviceLost as exc:
        print(f"{exc}: restarting with --resume", file=sys.stderr, flush=True)
        rest = [*(sys.argv[1:] if argv is None else argv), "--resume", "--started-at", str(started)]
        os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *rest])
    print(summary_line(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
