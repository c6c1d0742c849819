"""Plain-torch reference kernels of the cupynorm ops, and the dtype/layout rules all kernels follow.

The same math as the CUDA kernels, written with torch operations on float32 (float64 for float64
input): they back the custom ops on the CPU (CI checks the op plumbing -- schemas, fake kernels,
autograd, ``torch.compile`` -- on them without a GPU), test helpers compare against them, and
their backward is the readable derivation of the gradients. Nothing here imports CuPy.

Notation, per statistic set (a group of a sample for group norm, a channel for batch norm, a row
for the row norm) of M values:
    mean = sum(x) / M,  var = sum((x - mean)^2) / M,  rstd = 1 / sqrt(var + eps)
    xhat = (x - mean) * rstd,  y = xhat * weight[c] + bias[c]
backward, with gx = dy * weight[c] and <.> the mean over the set:
    dx = rstd * (gx - <gx> - xhat * <gx * xhat>)
    dweight[c] = sum dy * xhat,  dbias[c] = sum dy   (over every set channel c appears in)
Instance norm is group norm with G = C; its running statistics, like torch's, get the mean over
the batch of the per-instance mean and unbiased variance. Batch norm in eval normalizes with the
running statistics (dx = dy * weight * rstd). The row norm + add + mul (seed 002) is
out = (xhat + y) * y, so dx as above with gx = dout * y and dy = dout * (xhat + 2 y).
The fused batch norm epilogue is y = act(t), t = norm(x) + residual, computed in float32 with one
rounding; its backward recomputes t and takes dt = dy * act'(t) (ReLU: dy where t > 0; SiLU:
dy * s * (1 + t * (1 - s)), s = sigmoid(t)), rounds it to the input dtype -- what the unfused
activation's backward hands the norm -- and runs the batch norm backward on dt; dt is also the
residual's gradient. The fused group norm epilogue is the same with y = act(group_norm(x)) and
no residual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics and partial sums: float32, or float64 for float64 input."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _param_dtype(x: Tensor, weight: Tensor | None) -> torch.dtype:
    """dtype of dweight and dbias: the weight's; without a weight, the statistics' (the fp32/fp64
    accumulator; autograd casts dbias to the bias's dtype)."""
    return _stat_dtype(x.dtype) if weight is None else weight.dtype


def _layout(x: Tensor) -> torch.memory_format | None:
    """The memory format the kernels take ``x`` in, or None when ``x`` must be copied first."""
    if x.is_contiguous():
        return torch.contiguous_format
    ndim = x.dim()
    if ndim == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if ndim == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return None


def _channel_shape(x: Tensor) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel vector against ``x`` of shape (N, C, *spatial)."""
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


def _affine(xhat: Tensor, weight: Tensor | None, bias: Tensor | None, shape) -> Tensor:
    if weight is not None:
        xhat = xhat * weight.reshape(shape)
    if bias is not None:
        xhat = xhat + bias.reshape(shape)
    return xhat


def _update_running(running: Tensor | None, batch_stat: Tensor, momentum: float) -> None:
    """``running = (1 - momentum) * running + momentum * batch_stat``, in place."""
    if running is not None:
        running.mul_(1.0 - momentum).add_(batch_stat, alpha=momentum)


def _unbias(count: int) -> float:
    """Factor turning a biased variance over ``count`` values into the unbiased one."""
    return count / (count - 1) if count > 1 else math.nan


def _group_norm_fwd_reference(
    x: Tensor,
    num_groups: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    want_var: bool = False,
    act: str = "identity",
    shift: Tensor | None = None,
    out_float32: bool = False,
):
    """Group norm; with ``act`` (the fused op) y = act(group_norm(x)), one rounding; with a
    ``shift`` (N, C), of x + shift[n, c] (the sum in the statistics' dtype, not rounded);
    ``out_float32``: y in float32 (beside a half-precision x, autocast's)."""
    n, c = x.shape[0], x.shape[1]
    group_size = (c // num_groups) * math.prod(x.shape[2:])
    xs = _shifted(x, shift).reshape(n, num_groups, group_size)
    var, mean = torch.var_mean(xs, dim=-1, correction=0)
    rstd = torch.rsqrt(var + eps)
    xhat = ((xs - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    y = ACTIVATIONS[act](_affine(xhat, weight, bias, _channel_shape(x)))
    dtype = torch.float32 if out_float32 else x.dtype
    y = y.to(dtype=dtype, memory_format=_layout(x) or torch.contiguous_format)
    return (y, mean, rstd, var) if want_var else (y, mean, rstd)


def _shifted(x: Tensor, shift: Tensor | None) -> Tensor:
    """x in the statistics' dtype, plus shift[n, c] when given (its layout kept)."""
    xs = x.to(_stat_dtype(x.dtype))
    if shift is None:
        return xs
    return xs + shift.to(xs.dtype).reshape(*shift.shape, *([1] * (x.dim() - 2)))


def _activation_grad(dy: Tensor, t: Tensor, act: str) -> Tensor:
    """dt = dy * act'(t) for the activation's input t (float32/64), rounded to dy's dtype: what
    the unfused activation's backward hands the norm."""
    if act == "identity":
        return dy
    if act == "relu":
        return torch.where(t > 0, dy, torch.zeros_like(dy))
    s = torch.sigmoid(t)
    return (dy.to(t.dtype) * s * (1 + t * (1 - s))).to(dy.dtype)


def _group_norm_act_bwd_reference(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    num_groups: int,
    output_mask: Sequence[bool],
    act: str,
    shift: Tensor | None = None,
):
    """(dx, dweight, dbias) of y = act(group_norm(x)): t = group_norm(x) recomputed from the
    statistics, dt = dy * act'(t) rounded to x's dtype, then the group norm backward on dt.
    With the forward's shift, x + shift is normalized and dx is its gradient."""
    if act != "identity":
        n = x.shape[0]
        xs = _shifted(x, shift).reshape(n, num_groups, -1)
        xhat = ((xs - mean[..., None]) * rstd[..., None]).reshape(x.shape)
        dy = _activation_grad(dy, _affine(xhat, weight, bias, _channel_shape(x)), act)
    return _group_norm_bwd_reference(dy, x, mean, rstd, weight, num_groups, output_mask, shift)


def _group_norm_bwd_reference(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    num_groups: int,
    output_mask: Sequence[bool],
    shift: Tensor | None = None,
):
    n, c = x.shape[0], x.shape[1]
    shape4 = (n, num_groups, c // num_groups, math.prod(x.shape[2:]))
    stat = _stat_dtype(x.dtype)
    xs = _shifted(x, shift).reshape(shape4)
    dys = dy.to(stat).reshape(shape4)
    mean4 = mean.reshape(n, num_groups, 1, 1)
    rstd4 = rstd.reshape(n, num_groups, 1, 1)
    xhat = (xs - mean4) * rstd4
    dx = dweight = dbias = None
    if output_mask[0]:
        gx = dys if weight is None else dys * weight.to(stat).reshape(1, num_groups, -1, 1)
        dx = rstd4 * (
            gx
            - gx.mean(dim=(2, 3), keepdim=True)
            - xhat * (gx * xhat).mean(dim=(2, 3), keepdim=True)
        )
        fmt = _layout(x) or torch.contiguous_format
        dx = dx.reshape(x.shape).to(dtype=x.dtype, memory_format=fmt)
    if output_mask[1]:
        dweight = (dys * xhat).sum(dim=(0, 3)).reshape(c).to(_param_dtype(x, weight))
    if output_mask[2]:
        dbias = dys.sum(dim=(0, 3)).reshape(c).to(_param_dtype(x, weight))
    return dx, dweight, dbias


def _instance_norm_update(running_mean, running_var, mean, var, count, momentum):
    _update_running(running_mean, mean.mean(dim=0), momentum)
    _update_running(running_var, var.mean(dim=0) * _unbias(count), momentum)


def _instance_norm_fwd_reference(x, weight, bias, running_mean, running_var, momentum, eps):
    y, mean, rstd, var = _group_norm_fwd_reference(x, x.shape[1], weight, bias, eps, True)
    _instance_norm_update(running_mean, running_var, mean, var, math.prod(x.shape[2:]), momentum)
    return y, mean, rstd


#: The fused epilogue's activations by the names the kernels use.
ACTIVATIONS = {"identity": lambda t: t, "relu": torch.relu, "silu": torch.nn.functional.silu}


def _batch_norm_fwd_reference(
    x,
    weight,
    bias,
    running_mean,
    running_var,
    training,
    momentum,
    eps,
    residual=None,
    act="identity",
    batches_tracked=None,
):
    """Batch norm; with ``residual`` / ``act`` (the fused op) y = act(norm(x) + residual);
    ``batches_tracked`` (a module's batch counter) is incremented in training."""
    stat = _stat_dtype(x.dtype)
    shape = _channel_shape(x)
    xs = x.to(stat)
    if training:
        if batches_tracked is not None:
            batches_tracked.add_(1)
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(xs, dim=dims, correction=0)
        _update_running(running_mean, mean, momentum)
        _update_running(running_var, var * _unbias(x.numel() // max(x.shape[1], 1)), momentum)
    else:
        mean = running_mean.to(stat, copy=True)
        var = running_var.to(stat)
    rstd = torch.rsqrt(var + eps)
    y = _affine((xs - mean.reshape(shape)) * rstd.reshape(shape), weight, bias, shape)
    if residual is not None:
        y = y + residual.to(stat)
    y = ACTIVATIONS[act](y)
    y = y.to(dtype=x.dtype, memory_format=_layout(x) or torch.contiguous_format)
    return y, mean, rstd


def _batch_norm_act_bwd_reference(
    dy, x, save_mean, save_rstd, weight, training, output_mask, residual, bias, act
):
    """(dx, dweight, dbias, dresidual) of the fused op; output_mask in that order."""
    dt = dy
    if act != "identity":
        stat = _stat_dtype(x.dtype)
        shape = _channel_shape(x)
        xhat = (x.to(stat) - save_mean.reshape(shape)) * save_rstd.reshape(shape)
        t = _affine(xhat, weight, bias, shape)
        if residual is not None:
            t = t + residual.to(stat)
        if act == "relu":
            dt = torch.where(t > 0, dy, torch.zeros_like(dy))
        else:
            s = torch.sigmoid(t)
            dt = (dy.to(stat) * s * (1 + t * (1 - s))).to(dy.dtype)
    dx, dweight, dbias = _batch_norm_bwd_reference(
        dt, x, save_mean, save_rstd, weight, training, output_mask[:3]
    )
    dt = dt.to(memory_format=_layout(x) or torch.contiguous_format)
    return dx, dweight, dbias, dt if output_mask[3] else None


def _batch_norm_bwd_reference(dy, x, save_mean, save_rstd, weight, training, output_mask):
    stat = _stat_dtype(x.dtype)
    shape = _channel_shape(x)
    dims = [0, *range(2, x.dim())]
    dys = dy.to(stat)
    xhat = (x.to(stat) - save_mean.reshape(shape)) * save_rstd.reshape(shape)
    rstd = save_rstd.reshape(shape)
    dx = dweight = dbias = None
    if output_mask[0]:
        gx = dys if weight is None else dys * weight.to(stat).reshape(shape)
        if training:
            gx = gx - gx.mean(dim=dims, keepdim=True)
            gx = gx - xhat * (gx * xhat).mean(dim=dims, keepdim=True)
        dx = (gx * rstd).to(dtype=x.dtype, memory_format=_layout(x) or torch.contiguous_format)
    if output_mask[1]:
        dweight = (dys * xhat).sum(dim=dims).to(_param_dtype(x, weight))
    if output_mask[2]:
        dbias = dys.sum(dim=dims).to(_param_dtype(x, weight))
    return dx, dweight, dbias


def _row_norm_add_mul_fwd_reference(x, y, eps):
    stat = _stat_dtype(x.dtype)
    xs, ys = x.to(stat), y.to(stat)
    var, mean = torch.var_mean(xs, dim=-1, correction=0)
    rstd = torch.rsqrt(var + eps)
    xhat = (xs - mean[..., None]) * rstd[..., None]
    out = ((xhat + ys) * ys).to(dtype=x.dtype, memory_format=torch.contiguous_format)
    return out, mean, rstd


def _row_norm_add_mul_bwd_reference(dout, x, y, mean, rstd):
    stat = _stat_dtype(x.dtype)
    d, xs, ys = dout.to(stat), x.to(stat), y.to(stat)
    xhat = (xs - mean[..., None]) * rstd[..., None]
    gx = d * ys
    dx = rstd[..., None] * (
        gx - gx.mean(dim=-1, keepdim=True) - xhat * (gx * xhat).mean(dim=-1, keepdim=True)
    )
    dy = d * (xhat + 2.0 * ys)
    return dx.to(x.dtype).contiguous(), dy.to(y.dtype).contiguous()


# ---- row norms: LayerNorm / RMSNorm over the trailing ``ndim`` dims, optional residual add ----
#   rows of D = prod(x.shape[-ndim:]) values; with a residual, x is first s = x + residual
#   LayerNorm: mean, var (biased), rstd = 1 / sqrt(var + eps), xhat = (x - mean) * rstd
#   RMSNorm:   mean = 0, rstd = 1 / sqrt(<x^2> + eps), xhat = x * rstd
#   y = xhat * weight[i] + bias[i] (per position i of the row)
#   backward, g = dy * weight, <.> the mean over the row:
#     dx = rstd * (g - <g> - xhat * <g xhat>)   (RMSNorm: without <g>), plus dsum if given
#     dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy
#   cast (RMSNorm of Hugging Face's LlamaRMSNorm): xhat is rounded to x's dtype before the weight
#     multiplies it, and dweight sums dy * that rounded xhat; dx as RMSNorm's
def _row_norm_fwd_reference(x, residual, weight, bias, ndim, eps, rms, cast=False,
                            out_float32=False):  # fmt: skip
    total = None
    if residual is not None:
        total = (x + residual).contiguous()
        x = total
    stat = _stat_dtype(x.dtype)
    batch, row = x.shape[: x.dim() - ndim], x.shape[x.dim() - ndim :]
    xs = x.to(stat).reshape(-1, math.prod(row))
    if rms:
        mean = None
        rstd = torch.rsqrt(xs.square().mean(dim=1) + eps)
        xhat = xs * rstd[:, None]
        if cast:
            xhat = xhat.to(x.dtype).to(stat)
    else:
        var, mean = torch.var_mean(xs, dim=1, correction=0)
        rstd = torch.rsqrt(var + eps)
        xhat = (xs - mean[:, None]) * rstd[:, None]
        mean = mean.reshape(batch)
    if weight is not None:
        xhat = xhat * weight.to(stat).reshape(1, -1)
    if bias is not None:
        xhat = xhat + bias.to(stat).reshape(1, -1)
    y = xhat.reshape(x.shape).to(torch.float32 if out_float32 else x.dtype).contiguous()
    return y, total, mean, rstd.reshape(batch)


def _row_norm_bwd_reference(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast=False):
    stat = _stat_dtype(x.dtype)
    row = x.shape[x.dim() - ndim :]
    D = math.prod(row)
    xs, dys = x.to(stat).reshape(-1, D), dy.to(stat).reshape(-1, D)
    rs = rstd.reshape(-1, 1)
    xhat = (xs if mean is None else xs - mean.reshape(-1, 1)) * rs
    dx = dweight = dbias = None
    if output_mask[0]:
        g = dys if weight is None else dys * weight.to(stat).reshape(1, -1)
        dxs = g - xhat * (g * xhat).mean(dim=1, keepdim=True)
        if mean is not None:
            dxs = dxs - g.mean(dim=1, keepdim=True)
        dxs = rs * dxs
        if dsum is not None:
            dxs = dxs + dsum.to(stat).reshape(-1, D)
        dx = dxs.reshape(x.shape).to(x.dtype).contiguous()
    if output_mask[1]:
        if cast:
            xhat = xhat.to(x.dtype).to(stat)
        dweight = (dys * xhat).sum(dim=0).reshape(row).to(_param_dtype(x, weight))
    if output_mask[2]:
        dbias = dys.sum(dim=0).reshape(row).to(_param_dtype(x, weight))
    return dx, dweight, dbias


# ---- channel norms: LayerNorm / RMSNorm over dim 1 of (N, C, *spatial), per (sample, pixel) --
#   the row norm of the (N, *spatial, C) view, C values per row (the math above with D = C);
#   mean/rstd have shape (N, *spatial) (mean None for RMSNorm); y and dx keep x's memory format
def _channels_to_rows(x: Tensor) -> Tensor:
    return x.permute(0, *range(2, x.dim()), 1)


def _rows_to_channels(t: Tensor) -> Tensor:
    return t.permute(0, t.dim() - 1, *range(1, t.dim() - 1))


def _channel_norm_fwd_reference(x, weight, bias, eps, rms, out_float32=False):
    fmt = _layout(x) or torch.contiguous_format
    y, _total, mean, rstd = _row_norm_fwd_reference(
        _channels_to_rows(x), None, weight, bias, 1, eps, rms, False, out_float32
    )
    return _rows_to_channels(y).contiguous(memory_format=fmt), mean, rstd


def _channel_norm_bwd_reference(dy, x, mean, rstd, weight, output_mask):
    fmt = _layout(x) or torch.contiguous_format
    dx, dweight, dbias = _row_norm_bwd_reference(
        _channels_to_rows(dy), None, _channels_to_rows(x), mean, rstd, weight, 1, output_mask
    )
    if dx is not None:
        dx = _rows_to_channels(dx).contiguous(memory_format=fmt)
    return dx, dweight, dbias
