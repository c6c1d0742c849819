"""Channel norm entries: LayerNorm / RMSNorm over dim 1 of (N, C, *spatial), per (sample, pixel)
(timm's LayerNorm2d, RmsNorm2d).

channels_last data is the row norm on its (N, *spatial, C) view (a contiguous permutation, no
copy), so this family is built on :mod:`.row_norm`; contiguous (NCHW) data takes the channels
family (channel_norm.cu), or the row norm on a channels-last copy when C is too large for it.
The two public entries only pick the route and reshape: the work is in recorded entries
(row_norm_fwd/bwd and the _channel_norm_* below), whose outputs must be their own allocations,
not views.
"""

from __future__ import annotations

from typing import Any

from .. import _channel, _interop, _plan
from .._launch import _Call
from .._program import _programmed
from .row_norm import row_norm_bwd, row_norm_fwd


def _to_rows(x: Any) -> Any:
    """The (N, *spatial, C) view of x (N, C, *spatial)."""
    order = (0, *range(2, x.ndim), 1)
    return x.permute(*order) if _interop.is_torch_tensor(x) else x.transpose(order)


def to_channels(t: Any) -> Any:
    """The (N, C, *spatial) view of t (N, *spatial, C)."""
    order = (0, t.ndim - 1, *range(1, t.ndim - 1))
    return t.permute(*order) if _interop.is_torch_tensor(t) else t.transpose(order)


#: (device, dtype, parameter dtype, C, backward) -> whether the channels family has a plan
_CHANNEL_FITS: dict[tuple, bool] = {}


def _channel_fits(x: Any, param: Any, C: int, backward: bool) -> bool:
    """_channel.fits, asked once per signature: the routers below are not recorded, so they
    run on every call and would otherwise set up a _Call and query the kernel each time."""
    bk = _interop.backend_of(x)
    dtype = bk.dtype_name(param) if param is not None else None
    key = (bk.device_id(x), bk.dtype_name(x), dtype, C, backward)
    fits = _CHANNEL_FITS.get(key)
    if fits is None:
        fits = _CHANNEL_FITS[key] = _channel.fits(_Call(x, param), C, backward)
    return fits


def _as_rows(layout: str, spatial: tuple[int, ...]) -> bool:
    """Whether x is normalized as the rows of its (N, *spatial, C) view."""
    return layout == "channels_last" or _plan.prod(spatial) == 1


def takes_rows(x: Any) -> bool:
    """Whether :func:`channel_norm_fwd` normalizes x as the rows of its (N, *spatial, C) view
    (channels_last, or one position per sample): its ``rows_out`` y is then those rows."""
    bk = _interop.backend_of(x)
    layout = _plan.classify_layout(tuple(x.shape), tuple(bk.strides(x)))
    return _as_rows(layout, tuple(x.shape[2:]))


def channel_norm_fwd(
    x: Any,
    weight: Any,
    bias: Any,
    eps: float,
    rms: bool,
    *,
    want_stats: bool = True,
    out_dtype: str | None = None,
    rows_out: bool = False,
) -> tuple:
    """(y, mean, rstd) of LayerNorm (``rms=False``) or RMSNorm over dim 1 of x (N, C, *spatial).

    y keeps x's layout (contiguous or channels_last; other strides: contiguous). mean, rstd:
    (N, *spatial) in the accumulator's dtype; mean None for RMSNorm, both None without
    ``want_stats``. weight/bias: (C,) or None. ``out_dtype``: as row_norm_fwd's (y in float32
    beside a half-precision x: read as is on channels_last data, a float32 copy otherwise).
    ``rows_out``: where :func:`takes_rows`, y as the rows it was written as (N, *spatial, C),
    not its (N, C, *spatial) view (a recorded call's outputs are its allocations).
    """
    bk = _interop.backend_of(x)
    layout = _plan.classify_layout(tuple(x.shape), tuple(bk.strides(x)))
    N, C, spatial = x.shape[0], x.shape[1], tuple(x.shape[2:])
    if layout == "other":
        x = bk.contiguous(x)
    if _as_rows(layout, spatial):
        # keyword arguments as a row norm's call passes them (a replay of these rows builds
        # its key: cupynorm/torch/_replay.py)
        extra = {"out_dtype": out_dtype} if out_dtype else {}
        # fmt: off
        y, _sum, mean, rstd = row_norm_fwd(_to_rows(x), None, weight, bias, C, eps, rms,
                                           want_stats=want_stats, **extra)
        # fmt: on
        if not rows_out:
            y = to_channels(y)
    else:
        if out_dtype not in (None, bk.dtype_name(x)):  # the channels family: on a float32 copy
            x = bk.astype(x, out_dtype)
        if _channel_fits(x, weight if weight is not None else bias, C, backward=False):
            # as the replay of NCHW channel norms keys it (cupynorm/torch/_replay.py)
            y, mean, rstd = _channel_norm_fwd(x, weight, bias, eps, rms, want_stats=want_stats)
        else:  # more channels than one CTA holds: the row norm on a channels-last copy
            rows = bk.contiguous(_to_rows(x))
            y, _sum, mean, rstd = row_norm_fwd(
                rows, None, weight, bias, C, eps, rms, want_stats=want_stats
            )
            y = bk.contiguous(to_channels(y))
    stats = (N, *spatial)
    mean = None if mean is None else mean.reshape(stats)
    rstd = None if rstd is None else rstd.reshape(stats)
    return y, mean, rstd


def channel_norm_bwd(
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple:
    """(dx | None, dweight | None, dbias | None) of channel_norm_fwd; ``mean`` None: RMSNorm.

    dx takes x's layout (contiguous or channels_last; other strides: contiguous); dy may have any
    strides (copied to x's layout when they differ). dweight/dbias: (C,) in the weight's dtype
    (the accumulator's when weight is None). dy in float32 beside a half-precision x: of the
    forward with that ``out_dtype``, dx in x's dtype.
    """
    bk = _interop.backend_of(x)
    layout = _plan.classify_layout(tuple(x.shape), tuple(bk.strides(x)))
    C = x.shape[1]
    mean = None if mean is None else mean.reshape(-1)
    rstd = rstd.reshape(-1)
    if layout == "other":
        x = bk.contiguous(x)
    if layout == "channels_last" or _plan.prod(tuple(x.shape[2:])) == 1:
        rows_dy = _to_rows(dy)
        dx, dweight, dbias = row_norm_bwd(
            rows_dy, None, _to_rows(x), mean, rstd, weight, C, needs_input_grad
        )
        return (None if dx is None else to_channels(dx)), dweight, dbias
    dtype = bk.dtype_name(x)
    if bk.dtype_name(dy) != dtype:  # a float32 dy beside half x: on a float32 copy of x
        x = bk.astype(x, bk.dtype_name(dy))
    dy = bk.contiguous(dy)
    if _channel_fits(x, weight, C, backward=True):
        dx, dweight, dbias = _channel_norm_bwd(dy, x, mean, rstd, weight, needs_input_grad)
    else:
        # fmt: off
        dx, dweight, dbias = row_norm_bwd(bk.contiguous(_to_rows(dy)), None,
                                          bk.contiguous(_to_rows(x)), mean, rstd, weight, C,
                                          needs_input_grad)
        # fmt: on
        dx = None if dx is None else bk.contiguous(to_channels(dx))
    if dx is not None and bk.dtype_name(dx) != dtype:
        dx = bk.astype(dx, dtype)
    return dx, dweight, dbias


@_programmed
def _channel_norm_fwd(
    x: Any, weight: Any, bias: Any, eps: float, rms: bool, *, want_stats: bool = True
) -> tuple:
    """(y, mean (N, S), rstd (N, S)) of x (N, C, *spatial) contiguous: channel_norm.cu."""
    call = _Call(x, weight if weight is not None else bias)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    y = call.bk.empty_strided_like(x)
    mean = call.stats((N, S), x) if want_stats and not rms else None
    rstd = call.stats((N, S), x) if want_stats else None
    if N * C * S == 0:
        for stat in (mean, rstd):
            if stat is not None:
                call.bk.fill_nan(stat)
        return y, mean, rstd
    _channel.forward(call, x, y, weight, bias, mean, rstd, C, S, eps, rms)
    return y, mean, rstd


@_programmed
def _channel_norm_bwd(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, needs_input_grad: tuple[bool, bool, bool]
) -> tuple:
    """(dx, dweight, dbias) of _channel_norm_fwd; x, dy (N, C, *spatial) contiguous, mean/rstd
    N * S values (mean None: RMSNorm)."""
    call = _Call(x, weight)
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    want_dx, want_dw, want_db = needs_input_grad
    dx = call.bk.empty_strided_like(x) if want_dx else None
    dweight = call.grads((C,), weight, x) if want_dw else None
    dbias = call.grads((C,), weight, x) if want_db else None
    if N * C * S == 0:
        for grad in (dweight, dbias):
            if grad is not None:
                call.bk.fill_zero(grad)
        return dx, dweight, dbias
    if want_dx or want_dw or want_db:
        _channel.backward(call, dy, x, mean, rstd, weight, dx, dweight, dbias, C, S)
    return dx, dweight, dbias
