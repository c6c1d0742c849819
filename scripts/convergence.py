"""Convergence: does a model trained with cupynorm's norms follow the loss curve of torch's?

Each model trains from the same initial weights (one model built from ``--seed``, deep-copied
per run) on the same batches (made once from ``--data-seed``, the same order for every run):
with torch's norms twice, with cupynorm's once (``--cupynorm-runs``). On CUDA: bf16 autocast,
``cudnn.deterministic=False, cudnn.benchmark=True``, so torch's two runs differ by run-to-run
noise alone. On the CPU: float32, cupynorm's modules are torch's functional calls, every curve
the same.

- ``resnet18``: torchvision's, 10 classes, 3x64x64, batch 64, channels_last, SGD; cupynorm by
  ``cupynorm.torch.fuse`` (BatchNorm2d + add + ReLU). Data: the class is a grating's orientation,
  over a distractor grating and noise, 10% of the labels random (a floor of 0.50 on the loss).
- ``unet``: a small diffusion UNet of diffusers-style ResNet blocks (GroupNorm(32), SiLU, conv,
  the time embedding added before norm2), AdamW, predicting the noise; cupynorm by ``fuse``
  (GroupNorm + SiLU, the time embedding as GroupNormAct's ``shift``).
- ``llama``: transformers' ``LlamaForCausalLM`` (hidden 256, 4 layers, 4 heads, vocabulary 512),
  AdamW; cupynorm by ``replace_norms(include=[cupynorm.torch.LlamaRMSNorm])``. Data: a random
  second-order Markov chain whose entropy rate, 1.82 nats (log 512 = 6.24), is the loss's floor.

The band: each curve smoothed by a centred moving average of W = ``--window`` steps (fewer at
the ends); at step i, with lo and hi the min and max of torch's smoothed curves,

    band_i = [lo_i - m_i, hi_i + m_i],    m_i = max(hi_i - lo_i, k * se_i),

se_i the standard error of a W-step mean (the standard deviation of torch's raw losses around
their smoothed curves in the window, both runs pooled, over sqrt(W)), k = 3 (``--k``). Two runs
give a thin spread, none where nothing is nondeterministic (torch's two Llama runs can be bitwise
equal), so the band is at least what batch noise alone moves a W-step mean; where torch's runs
drift apart, wider. A norm that trains worse leaves the band for a stretch. The final loss (mean
of the last 50 raw losses) is judged alike. ``converges``: at least 90% of the steps' smoothed
cupynorm loss inside the band, and the final loss inside.

``python scripts/convergence.py --out DIR`` (one GPU, ~5 minutes; ``--device cpu --tiny --steps
20``: a smoke test) writes DIR/convergence.json (curves, band, final losses, wall times,
verdicts) and, with matplotlib, DIR/convergence_<model>.png.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cupynorm from this checkout
from cupynorm.bench.models import unet_resnet_block_class  # noqa: E402

WINDOW = 50  # steps of the moving average
K_SE = 3.0  # band half-width at least K_SE standard errors of a WINDOW-step mean
FINAL_STEPS = 50  # the final loss: mean of the last FINAL_STEPS raw losses
PASS_FRACTION = 0.9  # converges: at least this fraction of steps inside the band
TIMING_WARMUP = 20  # steps before the steady-state timer starts (autotuning, NVRTC compiles)
MAX_BATCHES = 1000  # batches made per model; longer runs cycle through them
WARMUP_FRACTION = 0.05  # linear LR warm-up over this fraction of the steps, then cosine decay
MIN_LR_FRACTION = 0.1  # the cosine ends at this fraction of the peak LR

Batch = tuple[torch.Tensor, ...]
Curves = Sequence[Sequence[float]]  # loss curves, one loss per step


# ---- The band and the verdict (numpy only) -------------------------------------------------------
def moving_average(values: Sequence[float], window: int) -> tuple[np.ndarray, np.ndarray]:
    """Centred mean of each step's window (clipped at the ends), and how many steps it covers.
    A non-finite loss makes every mean whose window reaches past it non-finite."""
    values = np.asarray(values, dtype=np.float64)
    n, half = len(values), max(window, 1) // 2
    steps = np.arange(n)
    lo, hi = np.clip(steps - half, 0, n), np.clip(steps + half + 1, 0, n)
    with np.errstate(invalid="ignore"):
        csum = np.concatenate([[0.0], np.cumsum(values)])
        return (csum[hi] - csum[lo]) / (hi - lo), hi - lo


def loss_band(torch_curves: Curves, window: int, k: float) -> dict:
    """The band around torch's curves (module docstring): lower, upper, their spread, se."""
    smoothed, residual_sq = [], []
    for curve in torch_curves:
        mean, count = moving_average(curve, window)
        smoothed.append(mean)
        residual_sq.append(moving_average((np.asarray(curve) - mean) ** 2, window)[0])
    lo, hi = np.min(smoothed, axis=0), np.max(smoothed, axis=0)
    se = np.sqrt(np.mean(residual_sq, axis=0) / count)
    margin = np.maximum(hi - lo, k * se)
    return {"lower": lo - margin, "upper": hi + margin, "spread": hi - lo, "se": se}


def inside_fraction(curve: Sequence[float], band: dict, window: int) -> float:
    """Fraction of steps whose smoothed loss lies in the band (a non-finite one does not)."""
    smoothed = moving_average(curve, window)[0]
    return float(np.mean((smoothed >= band["lower"]) & (smoothed <= band["upper"])))


def final_loss(curve: Sequence[float], last: int = FINAL_STEPS) -> float:
    return float(np.mean(np.asarray(curve, dtype=np.float64)[-last:]))


def final_band(torch_curves: Curves, k: float, last: int) -> tuple:
    """(lower, upper) for the final loss: torch's finals widened as the band is."""
    finals = [final_loss(curve, last) for curve in torch_curves]
    tails = [np.asarray(curve, dtype=np.float64)[-last:] for curve in torch_curves]
    se = float(np.sqrt(np.mean([np.var(tail) for tail in tails]) / len(tails[0])))
    margin = max(max(finals) - min(finals), k * se)
    return min(finals) - margin, max(finals) + margin


def verdict(torch_curves: Curves, cupynorm_curves: Curves, window: int = WINDOW,
            k: float = K_SE, last: int = FINAL_STEPS) -> dict:  # fmt: skip
    """The band, and for each cupynorm curve the fraction inside it and its final loss's place."""
    band = loss_band(torch_curves, window, k)
    low, high = final_band(torch_curves, k, last)
    fractions = [inside_fraction(curve, band, window) for curve in cupynorm_curves]
    finals = [final_loss(curve, last) for curve in cupynorm_curves]
    final_inside = [bool(low <= value <= high) for value in finals]
    center = np.mean([moving_average(curve, window)[0] for curve in torch_curves], axis=0)
    gaps = [np.abs(moving_average(c, window)[0] - center) for c in cupynorm_curves]
    identical = all(np.array_equal(torch_curves[0], other) for other in torch_curves[1:])
    return json_safe({
        "band": {**{key: value.tolist() for key, value in band.items()}, "final": [low, high]},
        "inside_fraction": fractions,
        "final_inside": final_inside,
        "converges": all(f >= PASS_FRACTION for f in fractions) and all(final_inside),
        "raw": {  # the numbers behind the band, for a reader who wants to judge it
            "torch_runs_identical": identical,
            "torch_spread_mean": float(np.mean(band["spread"])),
            "torch_spread_max": float(np.max(band["spread"])),
            "se_mean": float(np.mean(band["se"])),
            "cupynorm_gap_to_torch_mean": [float(np.mean(g)) for g in gaps],
            "cupynorm_gap_to_torch_max": [float(np.max(g)) for g in gaps],
        },
    })  # fmt: skip


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (a diverged loss) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


# ---- Data, made on the CPU from its own generator ------------------------------------------------
def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=generator)


def _gratings(n: int, freqs: tuple, size: int, g: torch.Generator, angle=None) -> torch.Tensor:
    """(n, size, size): cos(2 pi f (u cos a + v sin a) + phase) over [0, 1)^2, f uniform in
    `freqs` cycles per image, a random phase, the orientation a `angle` (None: random)."""
    a = (_uniform(n, 0, math.pi, g) if angle is None else angle)[:, None, None]
    f, phase = _uniform(n, *freqs, g)[:, None, None], _uniform(n, 0, 2 * math.pi, g)[:, None, None]
    v, u = torch.meshgrid(*2 * [torch.arange(size, dtype=torch.float32) / size], indexing="ij")
    return torch.cos(2 * math.pi * f * (u * torch.cos(a) + v * torch.sin(a)) + phase)


def classification_batch(batch: int, size: int, classes: int, g: torch.Generator) -> Batch:
    """Images whose class is the orientation of a grating (jittered by a quarter of the spacing),
    in random colours, over a distractor grating of any orientation and Gaussian noise; 10% of
    the labels are random, so the loss cannot reach zero."""
    labels = torch.randint(classes, (batch,), generator=g)
    spacing = math.pi / classes
    angle = labels * spacing + _uniform(batch, -0.25, 0.25, g) * spacing
    signal, distractor = (
        _gratings(batch, (3, 8), size, g, angle),
        _gratings(batch, (2, 10), size, g),
    )
    colour = 0.5 + torch.rand(batch, 3, 1, 1, generator=g)
    images = colour * signal[:, None] + 0.5 * distractor[:, None]
    images = images + torch.randn(images.shape, generator=g)
    noisy = torch.rand(batch, generator=g) < 0.1
    labels = torch.where(noisy, torch.randint(classes, (batch,), generator=g), labels)
    return images, labels


def structured_images(batch: int, size: int, g: torch.Generator) -> torch.Tensor:
    """Two low-frequency gratings and a Gaussian blob in random colours, unit variance."""
    images = torch.zeros(batch, 3, size, size)
    for _ in range(2):
        images += (
            torch.randn(batch, 3, 1, 1, generator=g) * _gratings(batch, (1, 4), size, g)[:, None]
        )
    coords = torch.arange(size, dtype=torch.float32) / size
    cy, cx = torch.rand(batch, 1, 1, generator=g), torch.rand(batch, 1, 1, generator=g)
    width = _uniform(batch, 0.05, 0.2, g)[:, None, None]
    blob = torch.exp(-((coords[:, None] - cy) ** 2 + (coords[None, :] - cx) ** 2) / width**2)
    images += 2 * torch.randn(batch, 3, 1, 1, generator=g) * blob[:, None]
    return images / images.std(dim=(1, 2, 3), keepdim=True)


def denoising_batch(batch: int, size: int, g: torch.Generator) -> Batch:
    """(x_t, t, noise): x_t = sqrt(a) x0 + sqrt(1 - a) noise, a = cos^2(pi t / 2), t ~ U(0, 1)."""
    clean = structured_images(batch, size, g)
    t = torch.rand(batch, generator=g)
    alpha = torch.cos(math.pi / 2 * t).clamp(min=1e-3)[:, None, None, None] ** 2
    noise = torch.randn(clean.shape, generator=g)
    return alpha.sqrt() * clean + (1 - alpha).sqrt() * noise, t, noise


def markov_chain(vocab: int, g: torch.Generator, fanout: int = 8) -> tuple[torch.Tensor, ...]:
    """A random second-order chain: (successors (vocab, fanout), weights (fanout,)). A token is
    followed by one of its successors, chosen with Zipf weights over ranks shifted by the token
    two back: given the last token alone the next is nearly uniform over its successors (log 8
    nats), given the last two its entropy is the weights' (1.82 nats, the loss's floor), which a
    model reaches only by attending past the last token."""
    weights = 1.0 / torch.arange(1, fanout + 1, dtype=torch.float64)
    return torch.randint(vocab, (vocab, fanout), generator=g), weights / weights.sum()


def sample_chain(chain: tuple, rows: int, length: int, g: torch.Generator) -> torch.Tensor:
    successors, weights = chain
    tokens = torch.empty(rows, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(len(successors), (rows,), generator=g)
    ranks = torch.multinomial(weights, rows * length, replacement=True, generator=g)
    ranks = ranks.view(rows, length)
    for i in range(1, length):
        shift = tokens[:, i - 2] if i > 1 else 0
        tokens[:, i] = successors[tokens[:, i - 1], (ranks[:, i - 1] + shift) % len(weights)]
    return tokens


# ---- Models --------------------------------------------------------------------------------------
class SmallUNet(nn.Module):
    """conv_in, `blocks` ResNet blocks, a stride-2 conv to twice the channels, `blocks` blocks,
    upsampling and a conv back plus the skip, `blocks` blocks, GroupNorm + SiLU + conv_out; the
    noise level t in [0, 1] enters as diffusers' TimestepEmbedding of sinusoids of 1000 t."""

    def __init__(self, channels: int = 64, groups: int = 32, blocks: int = 2) -> None:
        super().__init__()
        half, emb = channels // 2, 4 * channels
        self.register_buffer("freqs", torch.exp(-math.log(1e4) * torch.arange(half) / half))
        self.time_embedding = nn.Sequential(
            nn.Linear(channels, emb), nn.SiLU(), nn.Linear(emb, emb)
        )
        self.conv_in = nn.Conv2d(3, channels, 3, padding=1)
        # diffusers' ResnetBlock2D (in = out channels), the bench's: the projected time embedding
        # is added before norm2, which fuse folds into GroupNormAct's shift
        block = unet_resnet_block_class()
        self.down_blocks, self.mid_blocks, self.up_blocks = (
            nn.ModuleList(block(width, emb, groups) for _ in range(blocks))
            for width in (channels, 2 * channels, channels)
        )
        self.down = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.up = nn.Conv2d(2 * channels, channels, 3, padding=1)
        self.norm_out = nn.GroupNorm(groups, channels)
        self.act = nn.SiLU()
        self.conv_out = nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        angles = (1000 * t)[:, None] * self.freqs[None, :]
        temb = self.time_embedding(torch.cat([torch.sin(angles), torch.cos(angles)], dim=1))
        h = self.conv_in(x)
        for block in self.down_blocks:
            h = block(h, temb)
        skip = h
        h = self.down(h)
        for block in self.mid_blocks:
            h = block(h, temb)
        h = self.up(self.upsample(h)) + skip
        for block in self.up_blocks:
            h = block(h, temb)
        return self.conv_out(self.act(self.norm_out(h)))


# ---- Tasks: model, data, loss, optimizer, and how cupynorm's side is made ------------------------
class Task:
    """One ``--model`` choice; a subclass defines ``build(tiny)`` (torch's model, on the CPU, in
    float32), ``batches(count, tiny, generator)`` (the batches and a description of the data) and
    ``loss(model, batch)``. cupynorm's side: ``cupynorm.torch.fuse`` unless ``convert`` says."""

    requires: str | None = None  # a package the model needs (the model is skipped without it)
    channels_last = False
    lr: float

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)

    def convert(self, model: nn.Module) -> tuple[nn.Module, list[str]]:
        import cupynorm.torch as cnt

        report: list[str] = []
        return cnt.fuse(model, report=report), report


class ResNet18(Task):
    requires, channels_last, lr = "torchvision", True, 0.05

    def build(self, tiny: bool) -> nn.Module:
        return importlib.import_module("torchvision.models").resnet18(num_classes=10)

    def batches(self, count: int, tiny: bool, g: torch.Generator) -> tuple[list[Batch], dict]:
        batch, size = (8, 32) if tiny else (64, 64)
        info = {"batch": batch, "image": [3, size, size], "classes": 10, "label_noise": 0.1}
        return [classification_batch(batch, size, 10, g) for _ in range(count)], info

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])  # images, labels

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=5e-4)


class UNet(Task):
    lr = 5e-4

    def build(self, tiny: bool) -> nn.Module:
        return SmallUNet(channels=32, blocks=1) if tiny else SmallUNet(channels=64, blocks=2)

    def batches(self, count: int, tiny: bool, g: torch.Generator) -> tuple[list[Batch], dict]:
        batch, size = (4, 16) if tiny else (32, 32)
        info = {"batch": batch, "image": [3, size, size], "objective": "noise, MSE"}
        return [denoising_batch(batch, size, g) for _ in range(count)], info

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.mse_loss(model(batch[0], batch[1]).float(), batch[2])  # x_t, t, noise


class Llama(Task):
    requires, lr = "transformers", 1e-3
    FULL = {"hidden": 256, "layers": 4, "heads": 4, "vocab": 512, "seq": 128, "batch": 32}
    TINY = {"hidden": 64, "layers": 2, "heads": 2, "vocab": 64, "seq": 16, "batch": 4}

    def build(self, tiny: bool) -> nn.Module:
        transformers = importlib.import_module("transformers")
        size = self.TINY if tiny else self.FULL
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=size["vocab"], hidden_size=size["hidden"], num_hidden_layers=size["layers"],
            intermediate_size=size["hidden"] * 11 // 4, num_attention_heads=size["heads"],
            num_key_value_heads=size["heads"], max_position_embeddings=size["seq"],
            attn_implementation="sdpa",
        ))  # fmt: skip

    def batches(self, count: int, tiny: bool, g: torch.Generator) -> tuple[list[Batch], dict]:
        size = self.TINY if tiny else self.FULL
        chain = markov_chain(size["vocab"], g)
        tokens = sample_chain(chain, count * size["batch"], size["seq"], g)
        floor = float(-(chain[1] * chain[1].log()).sum())  # duplicate successors aside
        info = {**size, "entropy_rate": floor, "log_vocab": math.log(size["vocab"])}
        return [(rows,) for rows in tokens.split(size["batch"])], info

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        (tokens,) = batch
        logits = model(input_ids=tokens, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.1, betas=(0.9, 0.95))

    def convert(self, model: nn.Module) -> tuple[nn.Module, list[str]]:
        import cupynorm.torch as cnt  # transformers' LlamaRMSNorm is opt-in, named by ours

        return cnt.replace_norms(model, include=[cnt.LlamaRMSNorm]), []


TASKS: dict[str, Task] = {"resnet18": ResNet18(), "unet": UNet(), "llama": Llama()}


# ---- Training ------------------------------------------------------------------------------------
def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over WARMUP_FRACTION of the steps, then cosine to MIN_LR_FRACTION * peak."""
    warmup = max(1, round(WARMUP_FRACTION * steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    cosine = 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def train(task: Task, model: nn.Module, batches: list[Batch], steps: int) -> dict:
    """`steps` training steps: the loss of each (kept on the device and read at the end, so the
    loop never synchronizes) and the wall times, synchronized."""
    device = next(model.parameters()).device
    on_cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if on_cuda else lambda: None
    autocast = torch.autocast("cuda", torch.bfloat16) if on_cuda else contextlib.nullcontext()
    optimizer = task.optimizer(model.parameters())
    losses = torch.empty(steps, device=device)
    model.train()
    sync()
    start = steady_start = time.perf_counter()
    for step in range(steps):
        if step == TIMING_WARMUP:
            sync()
            steady_start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, task.lr)
        with autocast:
            loss = task.loss(model, batches[step % len(batches)])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses[step] = loss.detach()
    sync()
    end = time.perf_counter()
    steady = 1e3 * (end - steady_start) / (steps - TIMING_WARMUP) if steps > TIMING_WARMUP else None
    return {"optimizer": type(optimizer).__name__, "losses": losses.cpu().tolist(),
            "wall_s": end - start, "steady_ms_per_step": steady}  # fmt: skip


def _to_device(batch: Batch, device: torch.device, channels_last: bool) -> Batch:
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return tuple(t.to(device).contiguous(memory_format=layout) if t.dim() == 4 else t.to(device)
                 for t in batch)  # fmt: skip


def _norm_counts(model: nn.Module) -> dict[str, int]:
    """cupynorm's norm modules in the model, and torch's norms left (none expected)."""
    import cupynorm.torch as cnt

    kinds = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)
    norms = [m for m in model.modules() if isinstance(m, kinds) or "RMSNorm" in type(m).__name__]
    left = sum(not isinstance(m, (cnt.BatchNorm2d, cnt.GroupNorm, cnt.LlamaRMSNorm)) for m in norms)
    return {"cupynorm": len(norms) - left, "torch_left": left}


def run_model(name: str, args: argparse.Namespace) -> dict:
    """Every run of one model, its curves and verdict (or the reason it was skipped)."""
    task, device = TASKS[name], torch.device(args.device)
    if task.requires is not None:
        try:
            importlib.import_module(task.requires)
        except ImportError as error:
            return {"model": name, "skipped": f"{task.requires} is missing: {error}"}
    count = min(args.steps, MAX_BATCHES)
    made, data_info = task.batches(count, args.tiny, torch.Generator().manual_seed(args.data_seed))
    batches = [_to_device(batch, device, task.channels_last) for batch in made]
    torch.manual_seed(args.seed)
    initial = task.build(args.tiny)  # every run starts from a deep copy of it

    runs, conversion = [], {}
    for impl in ["torch"] * args.torch_runs + ["cupynorm"] * args.cupynorm_runs:
        model = copy.deepcopy(initial).to(device)
        if task.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if impl == "cupynorm":
            model, report = task.convert(model)
            conversion = {**_norm_counts(model), "fused": report}
            if conversion["cupynorm"] == 0:
                raise RuntimeError(f"{name}: no norm was converted to cupynorm's")
        print(f"{name}: {impl} run {len(runs) + 1} ...", file=sys.stderr, flush=True)
        runs.append({"impl": impl, **train(task, model, batches, args.steps)})
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    window, last = min(args.window, args.steps), min(FINAL_STEPS, args.steps)
    curves = {impl: [r["losses"] for r in runs if r["impl"] == impl] for impl in IMPLS}
    judged = verdict(curves["torch"], curves["cupynorm"], window, args.k, last)
    for run in runs:
        run["final_loss"] = final_loss(run["losses"], last)
        run["smoothed"] = moving_average(run["losses"], window)[0].tolist()
    on_cuda = device.type == "cuda"
    settings = {"window": window, "k": args.k, "final_steps": last, "lr": task.lr}
    settings.update(pass_fraction=PASS_FRACTION, seed=args.seed, data_seed=args.data_seed)
    settings.update(distinct_batches=count, cudnn_benchmark_nondeterministic=on_cuda)
    return json_safe({
        "model": name, "steps": args.steps, "tiny": args.tiny,
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "precision": "bf16 autocast" if on_cuda else "float32",
        "settings": settings, "data": data_info, "conversion": conversion, "runs": runs, **judged,
    })  # fmt: skip


# ---- Output --------------------------------------------------------------------------------------

IMPLS = ("torch", "cupynorm")


def plot(result: dict, path: Path) -> bool:
    """Loss curves with the band, and the gap to torch's mean; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = np.arange(result["steps"])
    lower, upper = (np.array(result["band"][side], dtype=float) for side in ("lower", "upper"))
    smoothed = [np.array(r["smoothed"], dtype=float) for r in result["runs"]]
    is_torch = [run["impl"] == "torch" for run in result["runs"]]
    center = np.mean([c for c, t in zip(smoothed, is_torch, strict=True) if t], axis=0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(2, 1))
    for axis, offset in ((top, 0.0), (bottom, center)):
        axis.fill_between(steps, lower - offset, upper - offset, color="C0", alpha=0.2, lw=0)
    for index, (run, curve) in enumerate(zip(result["runs"], smoothed, strict=True)):
        number = index if is_torch[index] else index - sum(is_torch)  # within its impl
        colour, style = "C0" if is_torch[index] else "C3", "--" if number else "-"
        top.plot(steps, np.array(run["losses"], dtype=float), color=colour, alpha=0.15, lw=0.5)
        top.plot(steps, curve, color=colour, ls=style, lw=1.2, label=f"{run['impl']} {number + 1}")
        bottom.plot(steps, curve - center, color=colour, ls=style, lw=1.0)
    fractions = ", ".join(f"{100 * f:.1f}%" for f in result["inside_fraction"])
    top.set_title(f"{result['model']}: cupynorm inside torch's band on {fractions} of the steps")
    top.set(ylabel="loss (raw faint, smoothed)")
    top.legend(loc="upper right")
    bottom.set(ylabel="smoothed - torch mean", xlabel="step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _joined(values: Sequence, fmt: str) -> str:
    return ", ".join("nan" if v is None else format(v, fmt) for v in values)


def table(results: Sequence[dict]) -> str:
    """One line per model."""
    lines = [
        f"{'model':<9} {'steps':>5}  {'torch final':<16} {'cupynorm final':<14} {'in band':>7}  "
        f"{'final in':<8}  {'wall s torch / cupynorm':<23}  converges"
    ]
    for result in results:
        if "skipped" in result:
            lines.append(f"{result['model']:<9} skipped: {result['skipped']}")
            continue
        runs = {impl: [r for r in result["runs"] if r["impl"] == impl] for impl in IMPLS}
        finals = {impl: _joined([r["final_loss"] for r in runs[impl]], ".4f") for impl in IMPLS}
        walls = " / ".join(_joined([r["wall_s"] for r in runs[impl]], ".1f") for impl in IMPLS)
        lines.append(
            f"{result['model']:<9} {result['steps']:>5}  {finals['torch']:<16} "
            f"{finals['cupynorm']:<14} {_joined(result['inside_fraction'], '.1%'):>7}  "
            f"{', '.join('yes' if ok else 'no' for ok in result['final_inside']):<8}  "
            f"{walls:<23}  {'yes' if result['converges'] else 'no'}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", nargs="+", choices=list(TASKS), default=list(TASKS))
    add("--steps", type=int, default=1000)
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--tiny", action="store_true", help="small models and batches (a smoke test)")
    add("--out", type=Path, default=Path("convergence_out"))
    add("--torch-runs", type=int, default=2)
    add("--cupynorm-runs", type=int, default=1)
    add("--window", type=int, default=WINDOW, help="steps of the moving average")
    add("--k", type=float, default=K_SE, help="band: at least k standard errors")
    add("--seed", type=int, default=0, help="of the initial weights")
    add("--data-seed", type=int, default=1234, help="of the batches")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.torch_runs < 2 or args.cupynorm_runs < 1:
        parser.error("needs --steps >= 1, --torch-runs >= 2 and --cupynorm-runs >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.device(args.device).type == "cuda":
        # cuDNN's autotuned, nondeterministic algorithms: torch's two runs differ by that noise
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.benchmark = True
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.model:
        results.append(run_model(name, args))
        everything = json.dumps({r["model"]: r for r in results}, indent=1, allow_nan=False)
        (args.out / "convergence.json").write_text(everything)
        png = args.out / f"convergence_{name}.png"
        if "skipped" not in results[-1] and not plot(results[-1], png):
            print(f"{name}: matplotlib is missing, no PNG", file=sys.stderr)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
