"""Where a norm call on CUDA tensors runs: cupynorm's kernels or torch's own op.

Eager (see the second half of this module), a call smaller than its kind's size runs torch's
op: :func:`set_eager_min_bytes`. Inside a compiled graph a cupynorm op is an
opaque call that Inductor cannot fuse with its neighbours (the residual add, the activation, a
cast, the ReLU mask and the residual gradient in the backward), and each such call costs host
time that Inductor's generated launcher does not. Where Inductor's own norm kernels plus the
fusion they allow beat that, the kind is traced as torch's own functional call instead, so that
Inductor compiles it. Measured (H200, torch 2.11, 2026-11-27, model training steps compiled,
cupynorm on its kernels against torch): resnet50 b64 0.89x and efficientnet_b0 0.51x (batch
norm), convnext_tiny 0.50x (layer norm over rows and channels), Llama 0.98x (RMSNorm); group
norm (diffusion UNet blocks) 1.04x: Inductor's group norm is the weak spot. See
benchmarks/NOTES.md ("torch.compile per norm kind") for the measurements.

The default keeps the group norm family (GroupNorm, GroupNormAct, InstanceNorm) and the fused
row norm + add + multiply on the kernels. Change it before compiling with
:func:`set_compile_kernels` or the environment variable ``CUPYNORM_COMPILE_KERNELS``
(``all``, ``none``, ``default`` or a comma-separated list of kinds); a graph compiled under one
policy is recompiled when the policy changes (Dynamo guards on it). A kind on the kernels still
leaves its calls smaller than its compile size to Inductor (:func:`set_compile_min_bytes`:
group norm's under 4 MiB).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Mapping

import torch

from .. import _compile

#: the norm kinds the policy decides, each the functional calls it covers
KINDS = {
    "batch_norm": "batch_norm, batch_norm_act (BatchNorm*d, BatchNormAct2d, fuse's fused blocks)",
    "group_norm": "group_norm, group_norm_act (GroupNorm, GroupNormAct)",
    "instance_norm": "instance_norm (InstanceNorm*d)",
    "layer_norm": "layer_norm, add_layer_norm (LayerNorm)",
    "rms_norm": (
        "rms_norm, add_rms_norm, llama_rms_norm (RMSNorm, LlamaRMSNorm and transformers' other "
        "formulas: GemmaRMSNorm, T5LayerNorm, Olmo2RMSNorm, CohereLayerNorm, OlmoLayerNorm)"
    ),
    "channel_norm": "layer_norm2d, rms_norm2d (LayerNorm2d, RMSNorm2d)",
    "row_norm_add_mul": "row_norm_add_mul (RowNormAddMul)",
}
#: the kinds on cupynorm's kernels inside torch.compile by default (see above)
DEFAULT = frozenset({"group_norm", "instance_norm", "row_norm_add_mul"})
ENVIRONMENT = "CUPYNORM_COMPILE_KERNELS"


def _parse(kinds: str | Iterable[str]) -> frozenset[str]:
    if isinstance(kinds, str):
        word = kinds.strip().lower()
        if word == "all":
            return frozenset(KINDS)
        if word == "none":
            return frozenset()
        if word == "default":
            return DEFAULT
        kinds = [k.strip() for k in word.split(",") if k.strip()]
    chosen = frozenset(kinds)
    unknown = sorted(chosen - KINDS.keys())
    if unknown:
        raise ValueError(
            f"unknown norm kind(s) {', '.join(map(repr, unknown))}; expected 'all', 'none', "
            f"'default' or kinds among {', '.join(map(repr, KINDS))}"
        )
    return chosen


# kind -> on the kernels inside torch.compile; a dict Dynamo guards on, changed in place
_ON_KERNELS: dict[str, bool] = dict.fromkeys(KINDS, False)


def set_compile_kernels(kinds: str | Iterable[str]) -> frozenset[str]:
    """Choose the norm kinds that run on cupynorm's kernels inside ``torch.compile`` (the others
    are traced as torch's own functional calls, for Inductor to compile and fuse); returns the
    previous choice, which this function takes back.

    ``kinds``: ``"all"``, ``"none"``, ``"default"``, a comma-separated string or an iterable of
    the names in :data:`KINDS`. Eager calls are not affected.

    Example::

        >>> import cupynorm.torch as cnt
        >>> previous = cnt.set_compile_kernels("all")     # every norm on cupynorm's kernels
        >>> cnt.set_compile_kernels(previous)
    """
    chosen = _parse(kinds)
    previous = compile_kernels()
    for kind in KINDS:
        _ON_KERNELS[kind] = kind in chosen
    return previous


def compile_kernels() -> frozenset[str]:
    """The norm kinds that run on cupynorm's kernels inside ``torch.compile`` now."""
    return frozenset(kind for kind, on in _ON_KERNELS.items() if on)


def inductor_takes(kind: str, x: torch.Tensor, size_kind: str | None = None) -> bool:
    """Whether a call of this kind on input ``x`` is being compiled and is left to Inductor
    (traced as torch's own functional call): its kind is not on the kernels
    (:func:`set_compile_kernels`), or ``x`` is smaller than the size of ``size_kind`` (``kind``
    when None; :func:`set_compile_min_bytes`)."""
    if not torch.compiler.is_compiling():
        return False
    if not _ON_KERNELS[kind]:
        return True
    least = COMPILE_MIN_BYTES[size_kind or kind]
    return bool(least) and x.numel() * x.element_size() < least


# ---- eager: small calls on torch's own op ------------------------------------------------------
# An eager call costs the host more on cupynorm's Python path than on torch's C++ one, and the
# kernels save GPU time in proportion to the bytes they move. Where the saving is smaller than
# the host time added, a step paced by the host (small batches, small nets) gets slower, and one
# paced by the GPU gains less than a host-paced one would lose: below these input sizes an eager
# call runs torch's own op (the minimax choice per call). Measured on one H100 host (torch 2.11,
# 2026-11-27; benchmarks/NOTES.md "Small eager calls on torch's own op"): host time per layer,
# forward + backward, cupynorm minus torch, in 50-layer stacks: batch norm +75..+90 us, batch
# norm + ReLU +0..+55, group norm +15..+25, group norm + SiLU -15, layer norm +80, RMS norm +75;
# GPU time saved per forward + backward (torch.profiler): batch norm bf16 channels_last 26 MB
# 43 us, 102 MB 154 us, fp32 51 MB 14 us, 205 MB 110 us; batch norm + ReLU bf16 26 MB 76 us;
# group norm fp16 3.2 MB 30 us, fp32 3.2 MB 9 us, 12.8 MB 29 us; layer norm bf16 32 MB 7 us,
# 64 MB 63 us (H100, 11-27 later: 177 us of kernels against torch's ~240), 128 MB 135 us, fp32
# 39 MB 39 us, 200 MB 316 us; RMS norm bf16 64 MB 57 us, 128 MB 143 us: the row norms reach their
# host cost between 64 and 128 MB. A CUDA graph capture pays the host once: its calls have
# sizes of their own (CAPTURE_DEFAULT below); inside torch.compile the policy above decides.
#: kind -> the input size in bytes from which an eager call runs on cupynorm's kernels
EAGER_DEFAULT: Mapping[str, int] = {
    "batch_norm": 1 << 26,  # batch_norm, batch_norm_act with neither residual nor activation
    "batch_norm_act": 1 << 24,  # batch_norm_act with a residual or an activation
    "group_norm": 1 << 22,  # group_norm but on dense channels_last input (the kernels)
    # always the kernels: given the adaptive choice below at every size (1), the diffusion
    # blocks under fp16 autocast fell to 0.91x eager (H200, 2026-11-27; 1.22x with the kernels,
    # H100, 11-26) while SD-1.5's UNet step went 0.96x -> 1.01x on another host
    "group_norm_act": 0,
    "instance_norm": 0,
    "layer_norm": 1 << 27,  # layer_norm, add_layer_norm
    "rms_norm": 1 << 27,  # rms_norm, add_rms_norm
    "llama_rms_norm": 0,  # transformers' formulas (cupynorm.torch.HF_NORMS): several torch ops each
    # layer_norm2d, rms_norm2d on NCHW input: torch has no single op for them (channels_last
    # input is the row norm of its channels-last view: the row norms' sizes decide)
    "channel_norm": 0,
    "row_norm_add_mul": 0,
}
EAGER_ENVIRONMENT = "CUPYNORM_EAGER_MIN_BYTES"
# kind -> bytes; changed in place (the functional reads it on every call)
EAGER_MIN_BYTES: dict[str, int] = dict(EAGER_DEFAULT)


def _parse_sizes(
    sizes: str | int | Mapping[str, int],
    current: Mapping[str, int] | None = None,
    default: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """``sizes`` (see :func:`set_eager_min_bytes`) over ``current``; ``default``: the sizes of
    ``"default"`` (both the eager ones when not given)."""
    current = EAGER_MIN_BYTES if current is None else current
    default = EAGER_DEFAULT if default is None else default
    if isinstance(sizes, str):
        word = sizes.strip().lower()
        if word == "default":
            return dict(default)
        try:
            if "=" in word:
                pairs = [item.split("=", 1) for item in word.split(",") if item.strip()]
                sizes = {kind.strip(): int(size) for kind, size in pairs}
            else:
                sizes = int(word)
        except ValueError:
            raise ValueError(
                f"expected 'default', a size in bytes or 'kind=bytes,...', got {sizes!r}"
            ) from None
    if type(sizes) is int:
        sizes = dict.fromkeys(default, sizes)
    if not isinstance(sizes, Mapping):
        raise TypeError(
            f"expected 'default', a size in bytes or a mapping of kinds to sizes, got {sizes!r}"
        )
    unknown = sorted(set(sizes) - default.keys())
    if unknown:
        raise ValueError(
            f"unknown norm kind(s) {', '.join(map(repr, unknown))}; expected kinds among "
            f"{', '.join(map(repr, default))}"
        )
    chosen = dict(current)
    for kind, size in sizes.items():
        if type(size) is not int or size < 0:
            raise ValueError(f"expected a size in bytes >= 0 for {kind!r}, got {size!r}")
        chosen[kind] = size
    return chosen


def _replace_sizes(
    table: dict[str, int], default: Mapping[str, int], sizes: str | int | Mapping[str, int]
) -> dict[str, int]:
    """Update one size policy's ``table`` in place with ``sizes`` (its ``default`` for
    "default"); returns what it held before. A refused choice changes nothing."""
    chosen = _parse_sizes(sizes, table, default)
    previous = dict(table)
    table.update(chosen)
    return previous


def set_eager_min_bytes(sizes: str | int | Mapping[str, int]) -> dict[str, int]:
    """Choose, per norm kind, the input size (bytes) from which an eager CUDA call runs on
    cupynorm's kernels; smaller calls run torch's own op, whose C++ host path costs less than
    the GPU time the kernels would save (see :data:`EAGER_DEFAULT`). Returns the previous
    choice, which this function takes back. Calls inside a CUDA graph capture or
    ``torch.compile`` are not affected.

    ``sizes``: ``"default"``; a size for every kind (``0``: every eager call on the kernels);
    a mapping of kinds to sizes, or a string ``"kind=bytes,..."`` (kinds not named keep theirs).

    Example::

        >>> import cupynorm.torch as cnt
        >>> previous = cnt.set_eager_min_bytes(0)      # every eager call on cupynorm's kernels
        >>> cnt.set_eager_min_bytes(previous)
    """
    return _replace_sizes(EAGER_MIN_BYTES, EAGER_DEFAULT, sizes)


def eager_min_bytes() -> dict[str, int]:
    """Per norm kind, the input size (bytes) from which an eager call runs on the kernels."""
    return dict(EAGER_MIN_BYTES)


# ---- CUDA graph capture: small calls on torch's own op -----------------------------------------
# A captured call's host time is paid once, at capture; each replay is GPU time alone. Where
# torch's op takes less GPU time than the kernels (small calls, whose launches and tails weigh
# more than their bytes), a captured call below its kind's size runs torch's op. Measured (H200,
# torch 2.11, 2026-11-27, timm training steps captured whole, batch 32, bf16 autocast,
# channels_last, `fuse`; ms per step, torch's model 5.93 / 7.98 / 5.96 / 3.59), with the batch
# norm kinds' capture size at 0 / 1 MiB / 4 MiB / 16 MiB / never: shvit_s1 7.42 / 5.95 / 5.74 /
# 5.82 / 5.82, efficientvit_m0 9.62 / 7.52 / 7.45 / 7.47 / 7.46, mobilenetv3_large_100 5.58 /
# 5.58 / 5.55 / 5.77 / 5.96, resnet18 3.26 / 3.25 / 3.33 / 3.40 / 3.59. At 4 MiB every one is
# at least 1.03x torch's (at 0: 0.80x and 0.83x for the first two). The other kinds keep the
# kernels: no captured model row measured them behind.
#: kind -> the input size in bytes from which a call inside a CUDA graph capture runs the kernels
CAPTURE_DEFAULT: Mapping[str, int] = {
    **dict.fromkeys(EAGER_DEFAULT, 0),
    "batch_norm": 1 << 22,
    "batch_norm_act": 1 << 22,
}
CAPTURE_ENVIRONMENT = "CUPYNORM_CAPTURE_MIN_BYTES"
# kind -> bytes; changed in place (the functional reads it on every captured call)
CAPTURE_MIN_BYTES: dict[str, int] = dict(CAPTURE_DEFAULT)


def set_capture_min_bytes(sizes: str | int | Mapping[str, int]) -> dict[str, int]:
    """Choose, per norm kind, the input size (bytes) from which a call inside a CUDA graph
    capture runs on cupynorm's kernels; smaller captured calls run torch's own op, which takes
    less GPU time there (see :data:`CAPTURE_DEFAULT`). Returns the previous choice, which this
    function takes back. ``sizes`` as :func:`set_eager_min_bytes` takes them (``0``: every
    captured call on the kernels). Eager calls and ``torch.compile`` are not affected.
    """
    return _replace_sizes(CAPTURE_MIN_BYTES, CAPTURE_DEFAULT, sizes)


def capture_min_bytes() -> dict[str, int]:
    """Per norm kind, the input size (bytes) from which a captured call runs on the kernels."""
    return dict(CAPTURE_MIN_BYTES)


# ---- torch.compile: small calls to Inductor ----------------------------------------------------
# Inside a compiled graph a kind on the kernels still gives its small calls to Inductor, whose
# fused kernels take less GPU time there (a small norm's time is its launches and tails) and
# whose generated launcher costs less host time than the op's call. Measured (H200, torch 2.11,
# 2026-11-28, fp16 input under fp16 autocast, NCHW, one compiled module, forward + backward,
# GPU µs by torch.profiler, Inductor / cupynorm): GroupNorm(32) + SiLU 8x1280x8x8 (1.25 MiB)
# 15.7 / 27.5, 8x1280x16x16 (5 MiB) 35.2 / 32.0, 8x640x32x32 (10 MiB) 71.0 / 46.5, 8x320x64x64
# (20 MiB) 138.4 / 80.7, 8x64x14x14 (0.19 MiB) 8.6 / 12.3; GroupNorm(32) 8x64x14x14 8.3 / 10.5,
# 8x1280x8x8 11.8 / 25.3. InstanceNorm2d(affine) fp16 under autocast (H200, 2026-11-28, same
# method): 8x64x14x14 (0.19 MiB) 24.5 / 30.5, 8x64x32x32 (1 MiB) 20.9 / 24.4, 8x128x64x64
# (8 MiB) 52.3 / 53.8, 8x64x128x128 (16 MiB) 88.0 / 92.3, 8x64x256x256 (64 MiB) 371.7 / 357.8:
# the kernels pass Inductor between 16 and 64 MiB. row_norm_add_mul (fp32, rows of 768-4096)
# stays on the kernels at every size: its forward alone is 2.2x Inductor's (the kernel bench),
# its forward + backward 7-20% slower (1.5-128 MiB), a training use not seen in a model.
#: kind -> the input size in bytes from which a compiled call of a kind on the kernels runs them
COMPILE_DEFAULT: Mapping[str, int] = {
    **dict.fromkeys(EAGER_DEFAULT, 0),
    "group_norm": 1 << 22,
    "group_norm_act": 1 << 22,
    "instance_norm": 1 << 25,
}
COMPILE_ENVIRONMENT = "CUPYNORM_COMPILE_MIN_BYTES"
# kind -> bytes; changed in place (read while tracing: Dynamo guards on it)
COMPILE_MIN_BYTES: dict[str, int] = dict(COMPILE_DEFAULT)


def set_compile_min_bytes(sizes: str | int | Mapping[str, int]) -> dict[str, int]:
    """Choose, per norm kind, the input size (bytes) from which a call inside ``torch.compile``
    of a kind on the kernels (:func:`set_compile_kernels`) runs them; smaller calls are traced
    as torch's own functional call for Inductor, whose kernels take less GPU time there (see
    :data:`COMPILE_DEFAULT`). Returns the previous choice, which this function takes back.
    ``sizes`` as :func:`set_eager_min_bytes` takes them (``0``: every compiled call of a kind
    on the kernels runs them). Choose before compiling; a graph compiled under one choice
    recompiles when it changes. Eager and captured calls are not affected.
    """
    return _replace_sizes(COMPILE_MIN_BYTES, COMPILE_DEFAULT, sizes)


def compile_min_bytes() -> dict[str, int]:
    """Per norm kind, the input size (bytes) from which a compiled call runs on the kernels."""
    return dict(COMPILE_MIN_BYTES)


# ---- eager: a call the policy gives the kernels, when the host paces the step -----------------
# A call at or above its kind's size saves GPU time on the kernels but still costs more host
# time. Where the GPU is behind the host (a GPU-paced step) that host time is hidden and the
# saving is the step's; where the GPU keeps up (a host-paced step: small batches, small nets) it
# is the step's loss. The probe: an event recorded on the stream at the previous such call; not
# yet complete means the GPU is at least one call's host time behind. Calls where it is
# complete run torch's own op. Off under deterministic algorithms (the choice must not depend
# on timing) and for streams of another device than the current one.
# Measured (H200, torch 2.11, 2026-11-27, resnet50 eager steps, `fuse`, alternating rounds):
# batch 64 (host-paced) 0.92x torch with every call at or above its size on the kernels, 1.01x
# with this choice (the probe said "keeping up" at 205 of 221 calls); batch 256 (GPU-paced)
# 1.45x and 1.44x (235 of 237 "behind").
#: whether the choice above is made (:func:`set_eager_adaptive`; CUPYNORM_EAGER_ADAPTIVE=0: off)
ADAPTIVE_ENVIRONMENT = "CUPYNORM_EAGER_ADAPTIVE"
EAGER_ADAPTIVE = [os.environ.get(ADAPTIVE_ENVIRONMENT, "1").strip() != "0"]
_NOT_READY = 600  # cudaErrorNotReady
_ONE_CALL_S = 20e-6  # probes closer than this belong to one call (a route asks twice)
_probes: dict[tuple[int, int], list] = {}  # (device, stream) -> [event, time, answer]
_MAX_PROBES = 64
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def gpu_behind(device: int) -> bool:
    """Whether the GPU has not finished the work queued on ``device``'s current stream up to
    the previous call that asked (True where the probe cannot tell: the kernels, as before)."""
    runtime = _compile._runtime()
    if _raw_stream is None or torch.are_deterministic_algorithms_enabled():
        return True
    if runtime.getDevice() != device:
        return True
    stream = _raw_stream(device)
    now = time.perf_counter()
    probe = _probes.get((device, stream))
    if probe is None:
        if len(_probes) >= _MAX_PROBES:  # streams made and dropped by the hundred: start over
            for event, *_ in _probes.values():
                runtime.eventDestroy(event)
            _probes.clear()
        probe = _probes[device, stream] = [runtime.eventCreateWithFlags(2), 0.0, True]
    elif now - probe[1] < _ONE_CALL_S:
        return probe[2]
    else:
        try:
            probe[2] = runtime.eventQuery(probe[0]) == _NOT_READY
        except runtime.CUDARuntimeError as error:
            probe[2] = error.status == _NOT_READY
    runtime.eventRecord(probe[0], stream)
    probe[1] = now
    return probe[2]


def set_eager_adaptive(on: bool) -> bool:
    """Whether an eager call at or above its kind's size (:func:`set_eager_min_bytes`) runs
    torch's own op while the GPU keeps up with the host (the default, ``True``), or always
    runs cupynorm's kernels (``False``). Returns the previous setting. Where the host paces a
    step, the kernels' GPU saving is lost and their extra host time is not; the choice is read
    from an event recorded at the previous such call on the stream. Deterministic algorithms
    (``torch.use_deterministic_algorithms``) turn it off, so that results do not depend on
    timing. Environment: ``CUPYNORM_EAGER_ADAPTIVE=0`` starts with it off.
    """
    if type(on) is not bool:
        raise TypeError(f"set_eager_adaptive() expects a bool, got {type(on).__name__}")
    previous, EAGER_ADAPTIVE[0] = EAGER_ADAPTIVE[0], on
    return previous


try:
    set_compile_kernels(os.environ.get(ENVIRONMENT, "default"))
except ValueError as error:
    warnings.warn(f"{ENVIRONMENT} ignored: {error}", stacklevel=1)
    set_compile_kernels(DEFAULT)

try:
    set_eager_min_bytes(os.environ.get(EAGER_ENVIRONMENT, "default"))
except (TypeError, ValueError) as error:
    warnings.warn(f"{EAGER_ENVIRONMENT} ignored: {error}", stacklevel=1)

try:
    set_capture_min_bytes(os.environ.get(CAPTURE_ENVIRONMENT, "default"))
except (TypeError, ValueError) as error:
    warnings.warn(f"{CAPTURE_ENVIRONMENT} ignored: {error}", stacklevel=1)

try:
    set_compile_min_bytes(os.environ.get(COMPILE_ENVIRONMENT, "default"))
except (TypeError, ValueError) as error:
    warnings.warn(f"{COMPILE_ENVIRONMENT} ignored: {error}", stacklevel=1)
