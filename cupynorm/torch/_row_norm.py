r"""LayerNorm and RMSNorm over the trailing dims (the row norms), alone or after a residual add:
everything of the family from its kernels on each device to :func:`layer_norm`,
:func:`rms_norm`, :func:`add_layer_norm` and :func:`add_rms_norm`.

Per row of the trailing ``ndim`` dims (the math: :mod:`._reference`), after ``s = x + residual``
when there is a residual (the sum rounded to the input's dtype, an output: the residual
stream). Outputs are contiguous; mean/rstd have the shape of the leading dims (mean is None for
RMSNorm); dweight/dbias have the normalized shape.

Custom ops (``torch.ops.cupynorm.*``)::

    row_norm_fwd(x, residual?, weight?, bias?, ndim, eps, rms, cast=False, out_float32=False)
        -> (y, sum?, mean?, rstd)   # LayerNorm / RMSNorm (mean None) over the last ndim dims
                                    # cast: LlamaRMSNorm's rounding of xhat before the weight
    row_norm_bwd(dy, dsum?, x, mean?, rstd, weight?, ndim, output_mask, cast=False)
        -> (dx?, dweight?, dbias?)  # x: the normalized rows (the sum with a residual)

Top to bottom: the kernels, the ops, their autograd, the eager ``autograd.Function``, the
replay's save and grads (:mod:`._replay`), the route, the public functionals. Above this
module: Hugging Face's Llama RMSNorm (:mod:`._llama_rms_norm`, the row norm with ``cast``) and
the channel norms (:mod:`._channel_norm`), which replay a channels_last call as the row norm
of its channels-last view (:func:`_replay_row_norm`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cupynorm import _program

from . import _checks, _higher_order, _library, _replay
from ._autograd import _bound_forward, _EagerFunction, _kernel_backward, _SavedOutput
from ._policy import inductor_takes
from ._reference import _param_dtype, _row_norm_bwd_reference, _row_norm_fwd_reference, _stat_dtype
from ._replay import Token, unwrap
from ._route import (
    _AUTOCAST_RMS_NORM,
    _HALF,
    _default_rms_eps,
    _kernel_tensors,
    _replay_candidate,
    _traced,
    _use_kernels,
    _wants_grad,
)
from ._tensors import _cast, _host, _vec


# ---------------------------------------------------------------------------------------------
# kernels on each device
# ---------------------------------------------------------------------------------------------
def _split(x: Tensor, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(leading dims, normalized dims) of x."""
    return tuple(x.shape[: x.dim() - ndim]), tuple(x.shape[x.dim() - ndim :])


def _row_norm_fwd_op_args(x, residual, weight, bias, row_len, eps, rms, cast, want_stats,
                          out_float32=False):  # fmt: skip
    """(args, kwargs) of the host op row_norm_fwd (also the replay's call key:
    :func:`_replay_row_norm`)."""
    kwargs = {"want_stats": want_stats, "cast": True} if cast else {"want_stats": want_stats}
    if out_float32:
        kwargs["out_dtype"] = "float32"
    return (x, residual, weight, bias, row_len, eps, rms), kwargs


def _row_norm_fwd_cuda(x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False,
                       want_stats=True):  # fmt: skip
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    batch, row = _split(x, ndim)
    # fmt: off
    args, kwargs = _row_norm_fwd_op_args(x, residual, _vec(weight), _vec(bias), math.prod(row),
                                         eps, rms, cast, want_stats, out_float32)
    # fmt: on
    y, total, mean, rstd = _host().row_norm_fwd(*args, **kwargs)
    mean = None if mean is None else mean.reshape(batch)
    rstd = None if rstd is None else rstd.reshape(batch)
    return y, total, mean, rstd


def _row_norm_bwd_cuda(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast=False):
    _batch, row = _split(x, ndim)
    dsum = None if dsum is None else dsum.contiguous()
    mean = None if mean is None else mean.contiguous()
    dx, dweight, dbias = _host().row_norm_bwd(
        dy.contiguous(),
        dsum,
        x.contiguous(),
        mean,
        rstd.contiguous(),
        _vec(weight),
        math.prod(row),
        tuple(output_mask),
        **({"cast": True} if cast else {}),
    )
    pdtype = _param_dtype(x, weight)
    dx = dx.reshape(x.shape) if output_mask[0] else None
    dweight = _cast(dweight.reshape(row), pdtype) if output_mask[1] else None
    dbias = _cast(dbias.reshape(row), pdtype) if output_mask[2] else None
    return dx, dweight, dbias


def _row_norm_fwd(x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False):
    """``out_float32``: y in float32 from a float16 / bfloat16 x (layer_norm under autocast), with
    no residual; the backward then takes dy in float32 and gives dx in x's dtype."""
    args = (x, residual, weight, bias, ndim, eps, rms, cast)
    if x.is_cuda:
        return _row_norm_fwd_cuda(*args, out_float32)
    return _row_norm_fwd_reference(*args, out_float32)


def _row_norm_output(x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False):
    """(y, sum) alone (no autograd)."""
    args = (x, residual, weight, bias, ndim, eps, rms, cast)
    if x.is_cuda:
        return _row_norm_fwd_cuda(*args, out_float32, want_stats=False)[:2]
    return _row_norm_fwd_reference(*args, out_float32)[:2]


def _row_norm_bwd(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast=False):
    if x.is_cuda:
        return _row_norm_bwd_cuda(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast)
    return _row_norm_bwd_reference(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast)


def _row_norm_fwd_fake(x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False):
    batch, _row = _split(x, ndim)
    rstd = x.new_empty(batch, dtype=_stat_dtype(x.dtype))
    mean = None if rms else torch.empty_like(rstd)
    dtype = torch.float32 if out_float32 else x.dtype
    y = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    total = None if residual is None else torch.empty_like(y)
    return y, total, mean, rstd


def _row_norm_bwd_fake(dy, dsum, x, mean, rstd, weight, ndim, output_mask, cast=False):
    _batch, row = _split(x, ndim)
    pdtype = _param_dtype(x, weight)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else None,
        x.new_empty(row, dtype=pdtype) if output_mask[1] else None,
        x.new_empty(row, dtype=pdtype) if output_mask[2] else None,
    )


# ---------------------------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------------------------
row_norm_fwd_op = _library.define(
    "row_norm_fwd(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, int ndim,"
    " float eps, bool rms, bool cast=False, bool out_float32=False)"
    " -> (Tensor, Tensor?, Tensor?, Tensor)",
    _row_norm_fwd_cuda,
    _row_norm_fwd_reference,
    _row_norm_fwd_fake,
)
row_norm_bwd_op = _library.define(
    "row_norm_bwd(Tensor dy, Tensor? dsum, Tensor x, Tensor? mean, Tensor rstd,"
    " Tensor? weight, int ndim, bool[3] output_mask, bool cast=False)"
    " -> (Tensor?, Tensor?, Tensor?)",
    _row_norm_bwd_cuda,
    _row_norm_bwd_reference,
    _row_norm_bwd_fake,
)


# ---------------------------------------------------------------------------------------------
# autograd: setup_context + backward, shared by the custom ops and the eager Function
# ---------------------------------------------------------------------------------------------
def _row_norm_setup(ctx, inputs, output) -> None:
    # inputs: (x, residual, weight, bias, ndim, eps, rms[, cast[, out_float32]]); output: (y, sum,
    # mean, rstd). A float32 y beside a half x changes nothing here: dy's dtype tells the backward
    x, residual, weight, _bias, ndim, _eps, _rms = inputs[:7]
    _y, total, mean, rstd = output
    # the rows that were normalized: the sum when there is a residual
    ctx.save_for_backward(x if residual is None else total, weight, mean, rstd)
    ctx.ndim = ndim
    ctx.cast = bool(inputs[7]) if len(inputs) > 7 else False
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(*(t for t in (mean, rstd) if t is not None))
    ctx.set_materialize_grads(False)


def _make_row_norm_backward(bwd):
    """Backward of the row norm op: the gradient of the normalized rows (plus that of the sum,
    when the sum is an output) goes to x and to the residual alike."""

    def backward(ctx, dy, dsum, _dmean, _drstd):
        needs = ctx.needs_input_grad
        want_x = needs[0] or needs[1]
        normalized, weight, mean, rstd = ctx.saved_tensors
        dx = dweight = dbias = None
        if dy is not None:
            mask = [want_x, needs[2], needs[3]]
            if any(mask):
                dsum_x = dsum if want_x else None
                args = (dy, dsum_x, normalized, mean, rstd, weight, ctx.ndim, mask)
                dx, dweight, dbias = bwd(*args, ctx.cast) if ctx.cast else bwd(*args)
        elif want_x:
            dx = dsum
        return (
            dx if needs[0] else None,
            dx if needs[1] else None,
            dweight,
            dbias,
            None,
            None,
            None,
            None,
            None,
        )[: ctx.n_inputs]

    return backward


_row_norm_backward_composite = _make_row_norm_backward(_higher_order.row_norm_bwd)
_library.register_autograd(
    row_norm_fwd_op,
    _kernel_backward(_make_row_norm_backward(row_norm_bwd_op), _row_norm_backward_composite),
    _row_norm_setup,
)


# ---------------------------------------------------------------------------------------------
# eager Function
# ---------------------------------------------------------------------------------------------
class _RowNormFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False):
        inputs = (x, residual, weight, bias, ndim, eps, rms, cast, out_float32)
        output = _row_norm_fwd(*inputs)
        _row_norm_setup(ctx, inputs, output)
        return output

    backward = staticmethod(
        _kernel_backward(_make_row_norm_backward(_row_norm_bwd), _row_norm_backward_composite)
    )


# ---------------------------------------------------------------------------------------------
# replayed eager calls (cupynorm.torch._replay)
# ---------------------------------------------------------------------------------------------
def _row_norm_replay_save(ctx, call, x, residual, weight, bias, outputs):
    """Row norm (LayerNorm / RMSNorm, after a residual add when ``residual`` is given),
    ``call.info`` (row length, cast, normalized shape): y, or (y, sum) with a residual; saved
    as :class:`_RowNormFunction` saves."""
    y, total, mean, rstd = outputs
    saved = (x if residual is None else total, weight, mean, rstd)
    ctx.save_for_backward(*saved)
    ctx.row = call.info
    kept = x if residual is None else _SavedOutput(total)  # the sum is an output
    ctx.bound = (call.program, kept, weight, mean, rstd)
    ctx.grads = _row_norm_replay_grads
    if residual is None:
        return y
    ctx.set_materialize_grads(False)
    return y, total


def _row_norm_replay_grads(ctx, dy, dsum=None):
    """(dx, dresidual, dweight, dbias) of a replayed row norm: the gradient of the normalized
    rows (plus that of the sum) goes to x and the residual alike."""
    saved = ctx.saved_tensors
    forward = _bound_forward(ctx, saved)
    needs = ctx.needs_input_grad
    want_x = needs[0] or needs[1]
    dx = dweight = dbias = None
    if dy is not None:
        normalized, weight, mean, rstd = saved
        row_len, cast, dims = ctx.row
        mask = (want_x, needs[2], needs[3])
        dsum = dsum if want_x else None
        if forward is None:
            # fmt: off
            dx, dweight, dbias = _row_norm_bwd(dy, dsum, normalized, mean, rstd, weight, len(dims),
                                               mask, cast)
            # fmt: on
        else:
            args = (dy, dsum, normalized, mean, rstd, weight, row_len, mask, cast)
            # free: dy, and the sum's gradient when there is one: new tensors of each backward
            free = 1 if dsum is None else 2
            dx, dweight, dbias = _program.call_bound(forward, _host().row_norm_bwd, args, free)
            if len(dims) > 1:  # the host op's are (row_len,)
                dweight = None if dweight is None else dweight.view(dims)
                dbias = None if dbias is None else dbias.view(dims)
    elif want_x:
        dx = dsum
    return (dx if needs[0] else None), (dx if needs[1] else None), dweight, dbias


_row_norm_replay_grads.composite = _higher_order.row_norm_replay_grads  # double backward


def _replay_row_norm(x, residual, weight, bias, dims, eps, rms, cast, origin, grad,
                     out_float32=False) -> tuple[Any, Token]:  # fmt: skip
    """LayerNorm / RMSNorm over the trailing ``dims`` of x (after adding ``residual``) replayed,
    as :func:`._batch_norm._replay_batch_norm`: y (float32 with ``out_float32``), or (y, sum)
    with a residual."""
    x = unwrap(x)
    if grad:
        residual, weight, bias = (t if t is None else unwrap(t) for t in (residual, weight, bias))
    elif residual is not None:
        residual = unwrap(residual)
    row_len = dims[0] if len(dims) == 1 else math.prod(dims)
    # fmt: off
    args, kwargs = _row_norm_fwd_op_args(x, residual, weight, bias, row_len, eps, rms, cast,
                                         grad, out_float32)
    out, token = _replay.run("row_norm_fwd", args, kwargs, origin, grad, _row_norm_replay_save,
                             (row_len, cast, dims), (x, residual, weight, bias))
    # fmt: on
    if out is None or grad:
        return out, token
    return (out[0] if residual is None else out[:2]), token


# ---------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------
def _apply_row_norm(
    x, residual, weight, bias, ndim, eps, rms, cast=False, out_float32=False
) -> tuple[Tensor, Tensor | None]:
    args = (x, residual, weight, bias, ndim, eps, rms, cast)
    if _traced(x):
        return row_norm_fwd_op(*args, out_float32)[:2]
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, residual, weight, bias)
    ):
        return _RowNormFunction.run(*args, out_float32)[:2]
    return _row_norm_output(*args, out_float32)


def _dims(normalized_shape: Any) -> tuple | None:
    """``normalized_shape`` as a tuple when it is an int or a sequence (else the checks say
    what torch says of it)."""
    if type(normalized_shape) is int:
        return (normalized_shape,)
    if type(normalized_shape) in (tuple, list, torch.Size):
        return tuple(normalized_shape)
    return None


def _row_norm_route(fn, torch_fn, input, residual, normalized_shape, weight, bias, eps, rms,
                    cast=False, to_float32=False) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The route of a row norm call on cupynorm's kernels: a replay of the same call checked
    before (:mod:`._replay`), else the checks of ``fn`` against ``torch_fn`` (None: the caller
    checked; ``normalized_shape`` is then a tuple), then the kernels, whose call may be replayed
    from then on. ``eps`` None: RMSNorm's default; ``to_float32``: layer_norm under autocast, in
    float32 (a half-precision input read as is by the kernels, y in float32; float32 copies of
    the other tensors). Returns (y, the sum or None)."""
    tensors = (input, residual, weight, bias)
    dims = _dims(normalized_shape)
    # under autocast a half-precision input is read as is and y comes out in float32: as its
    # float32 copy would give, with none made (traced calls too: Inductor would run the copies
    # as kernels of their own before the op and after its backward)
    out_float32 = to_float32 and residual is None and input.dtype in _HALF
    replay = dims is not None and _replay_candidate(tensors)
    token = None
    if replay:
        tensors, origin = _kernel_tensors(tensors, dims, to_float32, int(out_float32))
        x, r, w, b = tensors
        key_eps = _default_rms_eps(x) if eps is None and rms else eps
        # fmt: off
        out, token = _replay_row_norm(x, r, w, b, dims, key_eps, rms, cast, origin,
                                      _wants_grad(x, w, b, r), out_float32)
        # fmt: on
        if out is not None:
            return (out, None) if r is None else out
    if fn is not None:
        # fmt: off
        dims = _checks.check_row_norm(fn, torch_fn, input, residual, normalized_shape, weight,
                                      bias, eps, to_float32)
        # fmt: on
    if not replay:
        tensors = _kernel_tensors(tensors, None, to_float32, int(out_float32))[0]
    x, r, w, b = tensors
    if eps is None and rms:
        eps = _default_rms_eps(x)
    out = _apply_row_norm(x, r, w, b, len(dims), eps, rms, cast, out_float32)
    _replay.validated(token, x.is_contiguous() and (r is None or r.is_contiguous()), (w, b))
    return out


# ---------------------------------------------------------------------------------------------
# functional API
# ---------------------------------------------------------------------------------------------
def layer_norm(
    input: Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Layer normalization (:func:`torch.nn.functional.layer_norm`) on cupynorm's kernels.

    Each row of the trailing ``normalized_shape`` dimensions (``D`` values) is normalized:

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    with the biased variance, accumulated in float32 (float64 for float64 input), and
    :math:`\gamma` (``weight``), :math:`\beta` (``bias``) of shape ``normalized_shape``. Under
    CUDA autocast the computation runs in float32, as torch's ``layer_norm`` does.

    Args:
        input: tensor of shape :math:`(*, \text{normalized\_shape})`; CUDA tensors (float16,
            bfloat16, float32, float64) run on cupynorm's kernels (non-contiguous input is copied
            first), tensors on other devices through :func:`torch.nn.functional.layer_norm`.
        normalized_shape: the trailing dimensions normalized over (an int or a sequence).
        weight: scale :math:`\gamma` of shape ``normalized_shape`` (the input's dtype or
            float32), or None.
        bias: shift :math:`\beta` of shape ``normalized_shape``, or None.
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - Input: :math:`(*, \text{normalized\_shape})`
        - Output: same shape, contiguous

    Example::

        >>> x = torch.randn(8, 128, 768, device="cuda", requires_grad=True)
        >>> y = cupynorm.torch.layer_norm(x, (768,))
        >>> y.sum().backward()
    """
    _checks.check_tensor("layer_norm", "input", input)
    if not _use_kernels(input, "layer_norm") or inductor_takes("layer_norm", input):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    # fmt: off
    return _row_norm_route("layer_norm", F.layer_norm, input, None, normalized_shape, weight,
                           bias, eps, False,
                           to_float32=torch.is_autocast_enabled())[0]  # as torch's autocast
    # fmt: on


def rms_norm(
    input: Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    r"""Root-mean-square normalization (:func:`torch.nn.functional.rms_norm`) on cupynorm's
    kernels.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} * \gamma

    over the trailing ``normalized_shape`` dimensions, accumulated in float32 (float64 for float64
    input). Under CUDA autocast the computation runs in float32, as torch's ``rms_norm`` does
    (with a torch whose autocast passes rms_norm through, the call is torch's own).

    Args:
        input: tensor of shape :math:`(*, \text{normalized\_shape})`.
        normalized_shape: the trailing dimensions normalized over (an int or a sequence).
        weight: scale :math:`\gamma` of shape ``normalized_shape``, or None.
        eps: added to the mean square. Default: None, as torch: the machine epsilon of the type
            the norm computes in (float32; float64 for float64 input).

    Shape:
        - Input: :math:`(*, \text{normalized\_shape})`
        - Output: same shape, contiguous

    Example::

        >>> x = torch.randn(4, 2048, 4096, device="cuda", dtype=torch.bfloat16)
        >>> y = cupynorm.torch.rms_norm(x, 4096, torch.ones(4096, device="cuda"))
    """
    _checks.check_tensor("rms_norm", "input", input)
    autocast = torch.is_autocast_enabled()
    if (
        not _use_kernels(input, "rms_norm")
        or (autocast and not _AUTOCAST_RMS_NORM)
        or inductor_takes("rms_norm", input)
    ):
        return F.rms_norm(input, normalized_shape, weight, eps)
    # fmt: off
    return _row_norm_route("rms_norm", F.rms_norm, input, None, normalized_shape, weight, None,
                           eps, True, to_float32=autocast)[0]
    # fmt: on


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    r"""``s = x + residual``, then :func:`layer_norm` of ``s``, in one kernel on CUDA.

    The pre-norm step of a transformer block, as flash-attn's and Liger's fused add + norm: the
    sum is rounded to the input's dtype (it is the residual stream the next block adds to) and
    normalized as :func:`layer_norm` does. Gradients reach ``x`` and ``residual`` alike (the
    gradient of ``s`` through the norm, plus that of the returned ``s``).

    Args:
        x, residual: tensors of the same shape :math:`(*, \text{normalized\_shape})` and dtype.
        normalized_shape, weight, bias, eps: as :func:`layer_norm`.

    Returns:
        ``(out, s)``: the normalized sum and the sum, both of x's shape, contiguous.

    Example::

        >>> out, h = cupynorm.torch.add_layer_norm(attn_out, h, 768, ln.weight, ln.bias)
    """
    _checks.check_tensor("add_layer_norm", "x", x)
    _checks.check_tensor("add_layer_norm", "residual", residual)
    if (
        not _use_kernels(x, "layer_norm")
        or torch.is_autocast_enabled()
        or inductor_takes("layer_norm", x)
    ):
        total = x + residual
        return layer_norm(total, normalized_shape, weight, bias, eps), total
    # fmt: off
    return _row_norm_route("add_layer_norm", F.layer_norm, x, residual, normalized_shape, weight,
                           bias, eps, False)
    # fmt: on


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    normalized_shape: int | list[int] | torch.Size,
    weight: Tensor | None = None,
    eps: float | None = None,
) -> tuple[Tensor, Tensor]:
    r"""``s = x + residual`` (in the input's dtype), then :func:`rms_norm` of ``s``, in one
    kernel on CUDA; gradients reach ``x`` and ``residual`` alike.

    Args:
        x, residual: tensors of the same shape :math:`(*, \text{normalized\_shape})` and dtype.
        normalized_shape, weight, eps: as :func:`rms_norm`.

    Returns:
        ``(out, s)``: the normalized sum and the sum, both of x's shape, contiguous.

    Example::

        >>> out, h = cupynorm.torch.add_rms_norm(mlp_out, h, 4096, norm.weight)
    """
    _checks.check_tensor("add_rms_norm", "x", x)
    _checks.check_tensor("add_rms_norm", "residual", residual)
    if (
        not _use_kernels(x, "rms_norm")
        or torch.is_autocast_enabled()
        or inductor_takes("rms_norm", x)
    ):
        total = x + residual
        return rms_norm(total, normalized_shape, weight, eps), total
    # fmt: off
    return _row_norm_route("add_rms_norm", F.rms_norm, x, residual, normalized_shape, weight,
                           None, eps, True)
    # fmt: on
