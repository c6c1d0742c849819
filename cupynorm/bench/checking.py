"""Checking cupynorm's tensors against torch's: `allclose` after normalizing by the RMS."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Tolerance:
    """`allclose`-style tolerance applied after dividing both tensors by the reference's RMS."""

    atol: float
    rtol: float


TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    # fp16 keeps 11 significant bits: one rounding step of a value near 1 is 1e-3.
    "float16": Tolerance(atol=1e-2, rtol=1e-2),
    # bf16 keeps 8 significant bits: one rounding step of a value near 1 is 8e-3.
    "bfloat16": Tolerance(atol=5e-2, rtol=5e-2),
}


# Elements per chunk when comparing huge tensors, so the comparison needs no full-size temporaries.
COMPARE_CHUNK_ELEMENTS = 1 << 24


@dataclass
class TensorCheck:
    """cupynorm's tensor vs torch eager's."""

    name: str
    max_abs_error: float  # raw, before normalizing
    worst_ratio: float  # max |a - b| / (atol * rms(b) + rtol * |b|); passes when <= 1
    ok: bool
    note: str = ""


def _flatten_in_same_order(
    actual: torch.Tensor, expected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D views (copies only for unusual layouts) with elements in the same logical order."""
    import torch

    if actual.is_contiguous() and expected.is_contiguous():
        return actual.view(-1), expected.view(-1)
    channels_last = torch.channels_last
    if (
        actual.dim() == 4
        and actual.is_contiguous(memory_format=channels_last)
        and expected.is_contiguous(memory_format=channels_last)
    ):
        return actual.permute(0, 2, 3, 1).reshape(-1), expected.permute(0, 2, 3, 1).reshape(-1)
    return actual.reshape(-1), expected.reshape(-1)


def compare_tensors(
    name: str, actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance
) -> TensorCheck:
    """Check `actual` against `expected` after dividing both by `expected`'s RMS.

    Passes when |a - b| <= atol * rms(b) + rtol * |b| everywhere and nothing is NaN/inf. Works in
    chunks so 7.5 GB tensors need no full-size temporaries. Layout differences are noted.
    """
    import torch

    if tuple(actual.shape) != tuple(expected.shape):
        note = f"shape {tuple(actual.shape)} != torch's {tuple(expected.shape)}"
        return TensorCheck(name, math.inf, math.inf, False, note)
    if actual.dtype != expected.dtype:
        note = f"dtype {actual.dtype} != torch's {expected.dtype}"
        return TensorCheck(name, math.inf, math.inf, False, note)
    note = ""
    if actual.numel() > 1 and actual.stride() != expected.stride():
        note = f"strides {actual.stride()} differ from torch's {expected.stride()}"
    flat_actual, flat_expected = _flatten_in_same_order(actual.detach(), expected.detach())
    numel = flat_expected.numel()
    if numel == 0:
        return TensorCheck(name, 0.0, 0.0, True, note)
    sum_of_squares = torch.zeros((), dtype=torch.float64, device=expected.device)
    for start in range(0, numel, COMPARE_CHUNK_ELEMENTS):
        chunk = flat_expected[start : start + COMPARE_CHUNK_ELEMENTS].double()
        sum_of_squares += chunk.square().sum()
    rms = math.sqrt(float(sum_of_squares) / numel)
    scale = rms if math.isfinite(rms) and rms > 0 else 1.0
    max_abs = torch.zeros((), dtype=torch.float64, device=expected.device)
    worst = torch.zeros((), dtype=torch.float64, device=expected.device)
    for start in range(0, numel, COMPARE_CHUNK_ELEMENTS):
        a = flat_actual[start : start + COMPARE_CHUNK_ELEMENTS].double()
        b = flat_expected[start : start + COMPARE_CHUNK_ELEMENTS].double()
        difference = (a - b).abs()
        allowed = b.abs().mul_(tolerance.rtol).add_(tolerance.atol * scale)
        # torch.maximum and max() propagate NaN, so a NaN anywhere fails the check.
        max_abs = torch.maximum(max_abs, difference.max())
        worst = torch.maximum(worst, (difference / allowed).max())
    max_abs_error = float(max_abs)
    worst_ratio = float(worst)
    ok = math.isfinite(worst_ratio) and worst_ratio <= 1.0
    return TensorCheck(name, max_abs_error, worst_ratio, ok, note)


# ------------------------------------------------------------------------------------------------
# Accuracy of the models group: errors against a float64 run of torch
# ------------------------------------------------------------------------------------------------

# cupynorm's error may be this many times torch's (both against torch in float64), plus the floor
# (for errors near zero, e.g. when both match float64 to rounding).
ACCURACY_FACTOR = 2.0
ACCURACY_FLOOR = 1e-6


def max_relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """max |actual - reference| / max |reference|, in float64 (NaN anywhere gives NaN or inf).

    Relative to the largest reference value, not element by element: a gradient has many values
    near zero whose own relative error says nothing.
    """
    difference = (actual.detach().double() - reference.detach().double()).abs().max()
    scale = reference.detach().double().abs().max()
    return float(difference) / float(scale) if float(scale) > 0 else float(difference)


def accuracy_ok(cupynorm_error: float, torch_error: float) -> bool:
    """cupynorm's error within ACCURACY_FACTOR x torch's + ACCURACY_FLOOR (False for NaN)."""
    if not math.isfinite(cupynorm_error):
        return False
    return cupynorm_error <= ACCURACY_FACTOR * torch_error + ACCURACY_FLOOR
