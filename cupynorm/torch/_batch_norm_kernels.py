r"""The batch norm kernels on each device, plain and fused (``act(batch_norm(x) + residual)``).

Per channel c over the M = N * prod(spatial) values x[:, c, ...]::

    training: mean, var (biased) of the batch; running stats get the unbiased var * M / (M - 1)
    eval:     mean = running_mean, var = running_var
    rstd = 1 / sqrt(var + eps),  y = (x - mean) * rstd * weight + bias
    backward: training as group norm (the sums over n and spatial); eval dx = dy * weight * rstd

The fused epilogue ``y = act(t)``, ``t = norm(x) + residual``, runs in float32 with one
rounding; its backward recomputes t (or reads the ReLU mask the forward kept) and takes
``dt = dy * act'(t)``, which is also the residual's gradient (the math: :mod:`._reference`).

``_batch_norm_*_cuda`` call the host code :mod:`cupynorm._ops` on the layouts of
:mod:`._tensors`; the reference kernels (:mod:`._reference`) back the ops on the CPU;
``_batch_norm_fwd`` / ``_batch_norm_bwd`` / ``_batch_norm_act_bwd`` pick one by the input's
device; ``*_op_kernel`` adapt a kernel to its custom op (running statistics returned, no output
aliasing an input); ``*_fake`` are the fake kernels. The ops, their autograd and the functional
are in :mod:`._batch_norm` (together past 600 lines: the kernels are this file).
"""

from __future__ import annotations

import torch

from cupynorm import _program  # no CuPy: the recorded calls' bookkeeping

from ._reference import (
    _batch_norm_act_bwd_reference,
    _batch_norm_bwd_reference,
    _batch_norm_fwd_reference,
    _stat_dtype,
)
from ._tensors import _dense, _empty_out, _finish_bwd, _host, _norm_bwd_fake, _vec, _write_back


def _batch_norm_fwd_op_args(x, weight, bias, running_mean, running_var, training, momentum,
                            eps, residual, act, batches_tracked, keep_mask,
                            running_out=None) -> tuple:  # fmt: skip
    """The host op batch_norm_fwd's arguments (also the replay's call key:
    :func:`._batch_norm._replay_batch_norm`)."""
    args = (x, weight, bias, running_mean, running_var, training, momentum, eps, residual, act,
            batches_tracked)  # fmt: skip
    if running_out is not None:
        return (*args, keep_mask, *running_out)
    return (*args, True) if keep_mask else args


def _batch_norm_fwd_host(op, x, weight, bias, running_mean, running_var, training, momentum, eps,
                         residual, act, batches_tracked, keep_mask=False,
                         running_out=None):  # fmt: skip
    """``op`` (the host's batch_norm_fwd or its with_program) on x made dense, with the running
    statistics written back; (op's result, x's memory format). ``keep_mask``: op's ReLU mask as
    a fourth output (or None). ``running_out``: contiguous (new running mean, new running var)
    the updated statistics go to, the given ones left as they are."""
    x, fmt = _dense(x)
    mean, var = _vec(running_mean), _vec(running_var)
    # fmt: off
    result = op(*_batch_norm_fwd_op_args(x, _vec(weight), _vec(bias), mean, var, training,
                                         momentum, eps, residual, act, batches_tracked, keep_mask,
                                         running_out))
    # fmt: on
    if training and running_out is None:
        _write_back(running_mean, mean)
        _write_back(running_var, var)
    return result, fmt


def _batch_norm_fwd_cuda_program(
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
    keep_mask=False,
):
    """(y, save_mean, save_rstd) of batch norm (with ``residual`` / ``act`` the fused op
    y = act(norm(x) + residual)), and the recorded program that made them or None;
    ``batches_tracked``: a module's batch counter, incremented in training. ``keep_mask``: the
    ReLU mask (or None) after save_rstd, for the fused backward."""
    # fmt: off
    (outputs, program), fmt = _batch_norm_fwd_host(
        _host().batch_norm_fwd.with_program, x, weight, bias, running_mean, running_var, training,
        momentum, eps, residual, act, batches_tracked, keep_mask)
    # fmt: on
    return (outputs[0].contiguous(memory_format=fmt), *outputs[1:]), program


def _batch_norm_fwd_cuda(
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
    running_out=None,
):
    """Batch norm; with ``residual`` / ``act`` the fused op y = act(norm(x) + residual);
    ``batches_tracked``: a module's batch counter, incremented in training; ``running_out``:
    where the updated running statistics go (:func:`_batch_norm_fwd_host`), default in place."""
    # fmt: off
    (y, save_mean, save_rstd), fmt = _batch_norm_fwd_host(
        _host().batch_norm_fwd, x, weight, bias, running_mean, running_var, training, momentum,
        eps, residual, act, batches_tracked, running_out=running_out)
    # fmt: on
    return y.contiguous(memory_format=fmt), save_mean, save_rstd


def _batch_norm_bwd_cuda(dy, x, save_mean, save_rstd, weight, training, output_mask, forward=None):
    """``forward``: the forward's recorded program, when every tensor but dy is the forward's
    own (the eager autograd.Function: _autograd._keep_forward)."""
    x, fmt = _dense(x)
    dy = dy.contiguous(memory_format=fmt)
    args = (dy, x, save_mean, save_rstd, _vec(weight), training, tuple(output_mask))
    op = _host().batch_norm_bwd
    dx, dweight, dbias = op(*args) if forward is None else _program.call_bound(forward, op, args)
    return _finish_bwd(dx, dweight, dbias, x, weight, fmt, output_mask)


def _batch_norm_act_bwd_op_args(dy, x, save_mean, save_rstd, weight, training, output_mask,
                                residual, bias, act, relu_mask) -> tuple:  # fmt: skip
    """The host op batch_norm_act_bwd's arguments (also built by the replayed backward,
    cupynorm.torch._batch_norm._batch_norm_act_grads: one key for both)."""
    args = (dy, x, save_mean, save_rstd, weight, training, output_mask, residual, bias, act)
    return args if relu_mask is None else (*args, relu_mask)


def _batch_norm_act_bwd_cuda(
    dy, x, save_mean, save_rstd, weight, training, output_mask, residual, bias, act, forward=None,
    relu_mask=None,
):  # fmt: skip
    """(dx, dweight, dbias, dresidual) of the fused op; output_mask in that order; ``forward``
    as for :func:`_batch_norm_bwd_cuda`; ``relu_mask``: the forward's, read instead of the
    residual (which may then be None)."""
    x, fmt = _dense(x)
    dy = dy.contiguous(memory_format=fmt)
    mask = tuple(output_mask)
    # fmt: off
    args = _batch_norm_act_bwd_op_args(dy, x, save_mean, save_rstd, _vec(weight), training, mask,
                                       residual, _vec(bias), act, relu_mask)
    # fmt: on
    op = _host().batch_norm_act_bwd
    grads = op(*args) if forward is None else _program.call_bound(forward, op, args)
    dx, dweight, dbias, dres = grads
    dx, dweight, dbias = _finish_bwd(dx, dweight, dbias, x, weight, fmt, mask[:3])
    return dx, dweight, dbias, dres


def _batch_norm_fwd(x, weight, bias, running_mean, running_var, training, momentum, eps, *epi):
    """Batch norm; ``epi`` = (residual, act[, batches_tracked]) for the fused op and a module's
    batch counter."""
    if x.is_cuda:
        return _batch_norm_fwd_cuda(
            x, weight, bias, running_mean, running_var, training, momentum, eps, *epi
        )
    return _batch_norm_fwd_reference(
        x, weight, bias, running_mean, running_var, training, momentum, eps, *epi
    )


def _batch_norm_fwd_program(x, weight, bias, running_mean, running_var, training, momentum, eps,
                            *epi, keep_mask=False):  # fmt: skip
    """:func:`_batch_norm_fwd` and the recorded program that made its outputs, or None;
    ``keep_mask``: the ReLU mask (None where none is kept: on the CPU) after the statistics."""
    args = (x, weight, bias, running_mean, running_var, training, momentum, eps, *epi)
    if x.is_cuda:
        return _batch_norm_fwd_cuda_program(*args, keep_mask=keep_mask)
    outputs = _batch_norm_fwd_reference(*args)
    return ((*outputs, None) if keep_mask else outputs), None


def _batch_norm_bwd(dy, x, save_mean, save_rstd, weight, training, output_mask, forward=None):
    args = (dy, x, save_mean, save_rstd, weight, training, output_mask)
    if x.is_cuda:
        return _batch_norm_bwd_cuda(*args, forward)
    return _batch_norm_bwd_reference(*args)


def _batch_norm_act_bwd(
    dy, x, save_mean, save_rstd, weight, training, output_mask, residual, bias, act, forward=None,
    relu_mask=None,
):  # fmt: skip
    args = (dy, x, save_mean, save_rstd, weight, training, output_mask, residual, bias, act)
    if x.is_cuda:
        return _batch_norm_act_bwd_cuda(*args, forward, relu_mask)
    return _batch_norm_act_bwd_reference(*args)  # no mask is kept on the CPU


def _batch_norm_fwd_op_kernel(fwd, into_outputs: bool = False):
    """The op's kernel: ``fwd`` updating copies of the running stats, returned as outputs;
    ``into_outputs``: ``fwd`` writes the updated statistics into new tensors itself (its
    ``running_out``), no copy of the old ones made first (the CUDA kernels)."""

    def kernel(x, weight, bias, running_mean, running_var, training, momentum, eps, *epi):
        if not training:
            y, save_mean, save_rstd = fwd(
                x, weight, bias, running_mean, running_var, False, momentum, eps, *epi
            )
            if save_mean.data_ptr() == running_mean.data_ptr():
                # the host code may hand back running_mean itself as save_mean (fine in eager,
                # like torch's own eval backward); an op's output must not alias an input
                save_mean = save_mean.clone()
            return y, save_mean, save_rstd, None, None
        if into_outputs:
            new_mean = None if running_mean is None else torch.empty_like(running_mean)
            new_var = None if running_var is None else torch.empty_like(running_var)
            # fmt: off
            y, save_mean, save_rstd = fwd(x, weight, bias, running_mean, running_var, True,
                                          momentum, eps, *epi, running_out=(new_mean, new_var))
            # fmt: on
            return y, save_mean, save_rstd, new_mean, new_var
        new_mean = None if running_mean is None else running_mean.clone()
        new_var = None if running_var is None else running_var.clone()
        y, save_mean, save_rstd = fwd(x, weight, bias, new_mean, new_var, True, momentum, eps, *epi)
        return y, save_mean, save_rstd, new_mean, new_var

    return kernel


def _batch_norm_act_bwd_op_kernel(bwd):
    """The op's kernel: ``bwd`` with the residual's gradient never aliasing dy (the identity
    hands dy itself back, fine in eager; an op's output must not alias an input)."""

    def kernel(dy, x, save_mean, save_rstd, weight, training, output_mask, residual, bias, act):
        grads = bwd(dy, x, save_mean, save_rstd, weight, training, output_mask, residual, bias, act)
        dres = grads[3]
        if dres is not None and dres.data_ptr() == dy.data_ptr():
            dres = dres.clone()
        return (*grads[:3], dres)

    return kernel


def _batch_norm_fwd_fake(x, weight, bias, running_mean, running_var, training, momentum, eps, *epi):
    stats = x.new_empty((x.shape[1],), dtype=_stat_dtype(x.dtype))
    new_mean = torch.empty_like(running_mean) if training and running_mean is not None else None
    new_var = torch.empty_like(running_var) if training and running_var is not None else None
    return _empty_out(x), stats, torch.empty_like(stats), new_mean, new_var


def _batch_norm_act_bwd_fake(
    dy, x, save_mean, save_rstd, weight, training, output_mask, residual, bias, act
):
    return (
        *_norm_bwd_fake(dy, x, save_mean, save_rstd, weight, training, output_mask[:3]),
        _empty_out(x) if output_mask[3] else None,
    )
