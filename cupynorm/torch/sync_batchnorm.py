r"""Batch norm with statistics synchronised over ``torch.distributed``: :class:`SyncBatchNorm`.

Data-parallel training (DDP) gives each process a slice of the batch; a synchronised batch norm
normalizes with the statistics of the whole batch of its process group. Per channel ``c``, with
rank ``i`` holding ``n_i`` values of mean ``m_i`` and biased variance ``v_i``:

.. math::
    n = \sum_i n_i, \quad \mu = \frac{1}{n} \sum_i n_i m_i, \quad
    \sigma^2 = \frac{1}{n} \sum_i n_i \left(v_i + (m_i - \mu)^2\right)

(Chan's merge of the (count, mean, M2 = v * count) triples, never E[x²] − E[x]² on raw values),
``y = (x - mu) * rstd * weight + bias`` with ``rstd = 1 / sqrt(sigma^2 + eps)``, and the running
statistics updated as torch does (the unbiased variance over the global count ``n``). Backward,
with ``xhat = (x - mu) * rstd`` and ``P = sum dy``, ``Q = sum dy * xhat`` over *every* rank's
values of the channel:

.. math::
    dx = \mathrm{rstd} \cdot w \cdot (dy - P / n - \hat{x} \, Q / n)
       = (x - \mu) u + v + dy \cdot \mathrm{rstd} \cdot w, \quad
    u = -\mathrm{rstd}^2 w Q / n, \quad v = -\mathrm{rstd}\, w P / n

while ``dweight = Q`` and ``dbias = P`` are the rank's own sums, as torch's: DDP averages them.

**Per forward, one collective**: an ``all_reduce(SUM)`` of a zeroed ``(world, 2C + 1)`` float64
buffer in which each rank has written its row ``(n_i, m_i[C], v_i[C])``. Adding zeros is exact,
so the sum *is* every rank's row: an all-gather, done by the collective that every backend
offers on CUDA tensors (NCCL, and gloo, which has no ``all_gather_into_tensor``; its list
``all_gather`` would need ``world`` outputs and a stack). The rows must stay apart because batch
sizes differ between ranks (a rank may have none: its row has ``n_i = 0`` and weighs nothing);
summed moments would need E[x²]. It moves ``world`` times an all-gather's bytes, ``8 * world *
(2C + 1)`` -- 262 KB for C = 2048 on 8 ranks: latency-bound either way. Float64 keeps counts
exact past 2**24 values per channel and the merge's rounding below float32's; the merge walks
the rows in rank order (deterministic).
**Per backward, one collective** (when the input needs a gradient, as torch): an
``all_reduce(SUM)`` of ``(P, Q)`` packed in one ``(2, C)`` buffer of the statistics' dtype.

The rank-local passes are cupynorm's strided kernels, fp32 accumulation (fp64 for float64
input), fixed-order merges, no float atomics: a rank's sums are bitwise reproducible, and the
sums over ranks as reproducible as the backend's all_reduce. On CUDA the steps around the
collectives are one kernel each (``cuda_src/sync_norm.cu``: the rank's row, the merge with the
running update, the dx coefficients), and each side of a collective is one recorded call
(``cupynorm._ops.sync_batch_norm_rows``, ``sync_batch_norm_merge_apply``,
``batch_norm_bwd_sums``, ``sync_batch_norm_bwd_dx``), where a chain of ~30 torch operations per
layer and step paced every rank's host. On CPU
tensors the same passes are plain torch operations, so the layer runs with the gloo backend on
the CPU (and is tested there) -- where ``torch.nn.SyncBatchNorm`` refuses CPU input.
``DistributedDataParallel`` itself refuses SyncBatchNorm layers on the CPU (its check sees the
torch base class): average the gradients with ``all_reduce`` there.
Other devices get ``torch.nn.SyncBatchNorm``'s own forward (and its error).

Like torch's: no communication in eval mode, without an initialised process group, or in a
group of one process (then it is :func:`cupynorm.torch.batch_norm`); every rank of the group
must call the layer the same number of times in training. Under ``torch.compile`` the
synchronised forward runs eagerly (a graph break).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import _checks
from ._reference import _channel_shape, _layout, _stat_dtype
from ._tensors import _dense, _host, _vec, _write_back
from .functional import batch_norm
from .modules import _BatchNormForward

__all__ = ["SyncBatchNorm"]


# ---------------------------------------------------------------------------------------------
# rank-local passes: cupynorm's kernels on CUDA, the same math in torch operations elsewhere
# ---------------------------------------------------------------------------------------------
def _reduce_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _local_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel (mean, biased var) of this rank's non-empty x, in the statistics' dtype
    (torch operations: the CUDA path writes them into its row in :func:`_gather_stats`)."""
    var, mean = torch.var_mean(x.to(_stat_dtype(x.dtype)), dim=_reduce_dims(x), correction=0)
    return mean, var


def _local_apply(x: Tensor, weight, bias, mean: Tensor, rstd: Tensor) -> Tensor:
    """y = (x - mean) * rstd * weight + bias, in x's dtype and memory format (torch operations;
    on CUDA :func:`_normalized` runs the kernels)."""
    shape = _channel_shape(x)
    y = (x.to(mean.dtype) - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        y = y * weight.to(mean.dtype).reshape(shape)
    if bias is not None:
        y = y + bias.to(mean.dtype).reshape(shape)
    return y.to(dtype=x.dtype, memory_format=_layout(x) or torch.contiguous_format)


def _local_bwd_sums(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel (sum dy, sum dy * xhat) over this rank's non-empty x."""
    if x.is_cuda:
        x, fmt = _dense(x)
        return _host().batch_norm_bwd_sums(dy.contiguous(memory_format=fmt), x, mean, rstd)
    shape, dims = _channel_shape(x), _reduce_dims(x)
    dys = dy.to(mean.dtype)
    xhat = (x.to(mean.dtype) - mean.reshape(shape)) * rstd.reshape(shape)
    return dys.sum(dim=dims), (dys * xhat).sum(dim=dims)


def _local_dx(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight, u, v) -> Tensor:
    """dx = (x - mean) * u + v + dy * rstd * weight, in x's dtype and memory format (torch
    operations; on CUDA :func:`_input_gradient` runs the kernels)."""
    shape = _channel_shape(x)
    gain = rstd if weight is None else rstd * weight.to(rstd.dtype)
    dx = (x.to(rstd.dtype) - mean.reshape(shape)) * u.reshape(shape) + v.reshape(shape)
    dx = dx + dy.to(rstd.dtype) * gain.reshape(shape)
    return dx.to(dtype=x.dtype, memory_format=_layout(x) or torch.contiguous_format)


# ---------------------------------------------------------------------------------------------
# the collectives and the merge
# ---------------------------------------------------------------------------------------------
def _gather_stats(x: Tensor, group: Any, world_size: int) -> Tensor:
    """Every rank's row (n_i, mean_i[C], var_i[C]) as a (world, 2C + 1) float64 tensor: one
    all_reduce of a zeroed buffer holding this rank's row in its slot."""
    rank = dist.get_rank(group)
    if x.is_cuda:  # the statistics' kernels, then one that writes the row and zeros the rest
        (rows,) = _host().sync_batch_norm_rows(_dense(x)[0], rank, world_size)
    else:
        c = x.shape[1]
        rows = torch.zeros((world_size, 2 * c + 1), dtype=torch.float64, device=x.device)
        count = x.numel() // c
        if count:  # an empty rank leaves its row zero: count 0 weighs nothing in the merge
            mean, var = _local_stats(x)
            row = rows[rank]
            row[0] = count
            row[1 : c + 1] = mean
            row[c + 1 :] = var
    dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    return rows


def _merge(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Chan's merge of the rows' (count, mean, var) triples: (mean, biased var, count) of the
    union, float64, summed over ranks in rank order."""
    c = (rows.shape[1] - 1) // 2
    counts, means, variances = rows[:, :1], rows[:, 1 : c + 1], rows[:, c + 1 :]
    count = counts.sum()
    mean = (counts * means).sum(dim=0) / count
    m2 = (counts * (variances + (means - mean).square())).sum(dim=0)
    return mean, m2 / count, count


def _update_running(running: Tensor | None, value: Tensor, momentum: float) -> None:
    """running = (1 - momentum) * running + momentum * value, computed in float64."""
    if running is not None:
        running.copy_(running.to(value.dtype) * (1.0 - momentum) + value * momentum)


# ---------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------
def _normalized(x, rows, weight, bias, running_mean, running_var, eps, momentum):
    """(y, mean, rstd, count): the statistics of the union from the gathered rows (mean, rstd in
    the statistics' dtype, the global count in float64), the running statistics updated (the
    unbiased variance over the global count), and this rank's x normalized with them."""
    if x.is_cuda:  # one recorded call: the merge kernel (running update, rstd), then the apply
        x, fmt = _dense(x)
        rm, rv = _vec(running_mean), _vec(running_var)
        y, mean, rstd, count = _host().sync_batch_norm_merge_apply(
            x, rows, _vec(weight), _vec(bias), rm, rv, eps, momentum
        )
        if running_mean is not None:
            _write_back(running_mean, rm)
        if running_var is not None:
            _write_back(running_var, rv)
        return y.contiguous(memory_format=fmt), mean, rstd, count
    stat = _stat_dtype(x.dtype)
    mean, var, count = _merge(rows)
    _update_running(running_mean, mean, momentum)
    _update_running(running_var, var * (count / (count - 1)), momentum)
    mean, rstd = mean.to(stat), torch.rsqrt(var + eps).to(stat)
    y = _local_apply(x, weight, bias, mean, rstd) if x.numel() else torch.empty_like(x)
    return y, mean, rstd, count


def _input_gradient(dy, x, mean, rstd, weight, totals: Tensor, count: Tensor) -> Tensor:
    """dx of this rank's non-empty x from the sums over every rank, totals = (sum dy,
    sum dy * xhat): the coefficients u = -rstd * gain * Q / n, v = -gain * P / n (gain = rstd *
    weight), then the dx pass."""
    if x.is_cuda:  # one recorded call: the coefficients' kernel, then the dx pass
        x, fmt = _dense(x)
        dy = dy.contiguous(memory_format=fmt)
        args = (dy, x, mean, rstd, _vec(weight), totals, count)
        (dx,) = _host().sync_batch_norm_bwd_dx(*args)
        return dx.contiguous(memory_format=fmt)
    n = count.to(rstd.dtype)
    gain = rstd if weight is None else rstd * weight.to(rstd.dtype)
    u, v = -rstd * gain * totals[1] / n, -gain * totals[0] / n
    return _local_dx(dy, x, mean, rstd, weight, u, v)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, world):
        rows = _gather_stats(x, group, world)
        args = (x, rows, weight, bias, running_mean, running_var, eps, momentum)
        y, mean, rstd, count = _normalized(*args)
        ctx.save_for_backward(x, weight, mean, rstd, count)
        ctx.group = group
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    def backward(ctx, dy):
        if not torch.is_grad_enabled():
            return _sync_batch_norm_backward(ctx, dy)
        # create_graph=True: torch's layer computes these gradients with ops that have no
        # derivative; so here, whose second backward raises torch's error for them
        with torch.no_grad():
            grads = _sync_batch_norm_backward(ctx, dy)
        if not any(t is not None and t.requires_grad for t in (dy, *ctx.saved_tensors)):
            return grads
        dx, dweight, dbias = grads[:3]
        dx = _not_differentiable(dx, "aten::batch_norm_backward_elemt")
        dweight = _not_differentiable(dweight, "aten::batch_norm_backward_reduce")
        dbias = _not_differentiable(dbias, "aten::batch_norm_backward_reduce")
        return dx, dweight, dbias, *grads[3:]


def _not_differentiable(grad: Tensor | None, op: str) -> Tensor | None:
    """``grad`` behind a node whose backward raises torch's error for ``op``'s derivative."""
    if grad is None:
        return None
    grad = grad.detach().requires_grad_()
    return torch._C._functions.DelayedError(f"derivative for {op} is not implemented", 1)(grad)


def _sync_batch_norm_backward(ctx, dy):
    """The synchronised backward (one collective when the input needs a gradient)."""
    x, weight, mean, rstd, count = ctx.saved_tensors
    need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
    if dy is None:
        dy = torch.zeros_like(x)
    if x.numel():
        sum_dy, sum_dy_xhat = _local_bwd_sums(dy, x, mean, rstd)
    else:  # still takes part in the collective below
        sum_dy = sum_dy_xhat = mean.new_zeros(mean.shape)
    dx = dweight = dbias = None
    if need_dx:
        totals = torch.stack((sum_dy, sum_dy_xhat))
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=ctx.group)
        if x.numel():
            dx = _input_gradient(dy, x, mean, rstd, weight, totals, count)
        else:
            dx = torch.zeros_like(x)
    grad_dtype = rstd.dtype if weight is None else weight.dtype
    if need_dweight:
        dweight = sum_dy_xhat.to(grad_dtype)
    if need_dbias:
        dbias = sum_dy.to(grad_dtype)
    return dx, dweight, dbias, None, None, None, None, None, None


@torch.compiler.disable
def _sync_batch_norm_eager(*args: Any) -> Tensor:
    """The synchronised forward, run eagerly when ``torch.compile`` traces the module (the
    kernels and the collectives are opaque to it)."""
    return _SyncBatchNormFunction.apply(*args)


def _sync_batch_norm(x, weight, bias, running_mean, running_var, eps, momentum, group, world):
    """Training forward synchronised over ``group`` (of ``world`` > 1 processes)."""
    vectors = (weight, bias, running_mean, running_var)
    problem = _checks._vectors_problem("sync_batch_norm", x.shape[1], *vectors)
    if problem is not None:
        args = (x, running_mean, running_var, weight, bias, True, momentum, eps)
        _checks.raise_like_torch(F.batch_norm, args, ours=problem)
    _checks.check_kernel_inputs("sync_batch_norm", x, weight, bias, running_mean, running_var)
    args = (x, weight, bias, running_mean, running_var, eps, momentum, group, world)
    if torch.compiler.is_compiling():
        return _sync_batch_norm_eager(*args)
    return _SyncBatchNormFunction.apply(*args)


# ---------------------------------------------------------------------------------------------
# the module
# ---------------------------------------------------------------------------------------------
_SYNCED_DEVICES = ("cuda", "cpu")


class SyncBatchNorm(_BatchNormForward, torch.nn.SyncBatchNorm):
    r"""Batch normalization with statistics synchronised over a process group, on cupynorm's
    kernels; a drop-in :class:`torch.nn.SyncBatchNorm`.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    Mean and (biased) variance are taken per channel over the batch and spatial dimensions of
    *every* process of ``process_group`` (default: the whole world) in training; the running
    statistics (unbiased variance over the global count) are updated identically on every rank
    and used in eval, which communicates nothing. Weight and bias gradients are the rank's own
    (DDP averages them); the input gradient uses the sums over the group. Ranks may hold
    different batch sizes, an empty batch included. One ``all_reduce`` per training forward and
    one per backward: see :mod:`cupynorm.torch.sync_batchnorm` for which and why.

    Unlike torch's class it also synchronises CPU tensors (gloo), with plain torch operations
    (without DDP, which refuses SyncBatchNorm layers on the CPU).

    Args:
        num_features: number of channels :math:`C`
        eps: added to the variance for numerical stability. Default: 1e-5
        momentum: weight of the batch statistics in the running update, or ``None`` for a
            cumulative moving average. Default: 0.1
        affine: learnable per-channel ``weight`` (init 1) and ``bias`` (init 0). Default: ``True``
        track_running_stats: keep ``running_mean``/``running_var``; without them batch
            statistics are used in eval too. Default: ``True``
        process_group: the group whose statistics are merged; ``None``: the whole world.
        device, dtype: of the parameters and buffers.
        bias: learn ``bias`` (with ``affine``), where the installed torch's class takes this
            argument. Default: ``True``

    Shape:
        - Input: :math:`(N, C, +)`
        - Output: same shape (and memory format) as the input

    Example::

        >>> torch.distributed.init_process_group("nccl")
        >>> model = cupynorm.torch.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
        >>> model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    """

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input``, synchronising the batch statistics in training."""
        synced = dist.is_available() and dist.is_initialized()
        if synced and input.device.type not in _SYNCED_DEVICES:
            return torch.nn.SyncBatchNorm.forward(self, input)  # torch's own, and its error
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        args = self._batch_norm_args(input, check=False)  # torch's factor and buffers
        _, running_mean, running_var, _, _, bn_training, exponential_average_factor, _, _ = args
        if bn_training and self.training and synced:  # no communication in eval
            group = self.process_group if self.process_group else dist.group.WORLD
            world = dist.get_world_size(group)
            if world > 1:
                # fmt: off
                return _sync_batch_norm(input, self.weight, self.bias, running_mean,
                                        running_var, self.eps, exponential_average_factor,
                                        group, world)
                # fmt: on
        return batch_norm(*args[:8])

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: Any = None
    ) -> torch.nn.Module:
        """Convert every batch norm layer of ``module`` to :class:`cupynorm.torch.SyncBatchNorm`.

        ``torch.nn.BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm`` and cupynorm's batch norms
        (any ``torch.nn.modules.batchnorm._BatchNorm``) become new layers that share the old
        ones' parameters and buffers (the same tensor objects) and training mode, as
        :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm` does.

        Args:
            module: the model (or one batch norm layer).
            process_group: the group to synchronise over; ``None``: the whole world.

        Returns:
            ``module`` with its batch norm children replaced, or a new layer when ``module``
            itself is a batch norm.

        Example::

            >>> model = cupynorm.torch.SyncBatchNorm.convert_sync_batchnorm(resnet50())
        """
        converted = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            # only where needed: an older torch's class may not take ``bias``
            no_bias = {"bias": False} if module.affine and module.bias is None else {}
            converted = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
                **no_bias,
            )
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
