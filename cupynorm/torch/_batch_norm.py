r"""Batch norm, plain and fused with a residual add and an activation: everything of the family
from the custom ops to the public functional (its kernels on each device are in
:mod:`._batch_norm_kernels`).

Custom ops (``torch.ops.cupynorm.*``)::

    batch_norm_fwd(x, weight?, bias?, running_mean?, running_var?, training, momentum, eps)
        -> (y, save_mean, save_rstd, new_running_mean?, new_running_var?)
    batch_norm_bwd(dy, x, save_mean, save_rstd, weight?, training, output_mask)
        -> (dx?, dweight?, dbias?)
    batch_norm_act_fwd(x, weight?, bias?, running_mean?, running_var?, training, momentum, eps,
                       residual?, act) -> as batch_norm_fwd         # y = act(norm(x) + residual)
    batch_norm_act_bwd(dy, x, save_mean, save_rstd, weight?, training, output_mask, residual?,
                       bias?, act) -> (dx?, dweight?, dbias?, dresidual?)

The forward ops are functional (:mod:`._library`): they return the updated running statistics
(None where nothing is updated), which the route writes back with ``copy_``; the eager
Functions update them in place inside the kernel, and count a module's batches there too.

Top to bottom: the ops, their autograd (setup_context and backward), the eager Functions
(``autograd.Function``; the backward bound to the forward's recorded program), the replay's
save, grads and entry (:mod:`._replay`), the route, the public functionals.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from cupynorm import _program

from . import _checks, _higher_order, _library, _replay
from ._autograd import (
    _bound_forward,
    _dropping_bound,
    _EagerFunction,
    _keep_forward,
    _kernel_backward,
)
from ._batch_norm_kernels import (
    _batch_norm_act_bwd,
    _batch_norm_act_bwd_cuda,
    _batch_norm_act_bwd_fake,
    _batch_norm_act_bwd_op_args,
    _batch_norm_act_bwd_op_kernel,
    _batch_norm_bwd,
    _batch_norm_bwd_cuda,
    _batch_norm_fwd,
    _batch_norm_fwd_cuda,
    _batch_norm_fwd_fake,
    _batch_norm_fwd_op_args,
    _batch_norm_fwd_op_kernel,
    _batch_norm_fwd_program,
)
from ._policy import inductor_takes
from ._reference import (
    ACTIVATIONS,
    _batch_norm_act_bwd_reference,
    _batch_norm_bwd_reference,
    _batch_norm_fwd_reference,
    _layout,
)
from ._replay import Token, unwrap
from ._route import _traced, _use_kernels, _wants_grad
from ._tensors import _host, _norm_bwd_fake

# ---------------------------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------------------------
batch_norm_fwd_op = _library.define(
    "batch_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean,"
    " Tensor? running_var, bool training, float momentum, float eps)"
    " -> (Tensor, Tensor, Tensor, Tensor?, Tensor?)",
    _batch_norm_fwd_op_kernel(_batch_norm_fwd_cuda, into_outputs=True),
    _batch_norm_fwd_op_kernel(_batch_norm_fwd_reference),
    _batch_norm_fwd_fake,
    any_layout=True,
)
batch_norm_bwd_op = _library.define(
    "batch_norm_bwd(Tensor dy, Tensor x, Tensor save_mean, Tensor save_rstd, Tensor? weight,"
    " bool training, bool[3] output_mask) -> (Tensor?, Tensor?, Tensor?)",
    _batch_norm_bwd_cuda,
    _batch_norm_bwd_reference,
    _norm_bwd_fake,
    any_layout=True,
)
batch_norm_act_fwd_op = _library.define(
    "batch_norm_act_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor? running_mean,"
    " Tensor? running_var, bool training, float momentum, float eps, Tensor? residual,"
    " str act) -> (Tensor, Tensor, Tensor, Tensor?, Tensor?)",
    _batch_norm_fwd_op_kernel(_batch_norm_fwd_cuda, into_outputs=True),
    _batch_norm_fwd_op_kernel(_batch_norm_fwd_reference),
    _batch_norm_fwd_fake,
    any_layout=True,
)
batch_norm_act_bwd_op = _library.define(
    "batch_norm_act_bwd(Tensor dy, Tensor x, Tensor save_mean, Tensor save_rstd,"
    " Tensor? weight, bool training, bool[4] output_mask, Tensor? residual, Tensor? bias,"
    " str act) -> (Tensor?, Tensor?, Tensor?, Tensor?)",
    _batch_norm_act_bwd_op_kernel(_batch_norm_act_bwd_cuda),
    _batch_norm_act_bwd_op_kernel(_batch_norm_act_bwd_reference),
    _batch_norm_act_bwd_fake,
    any_layout=True,
)


# ---------------------------------------------------------------------------------------------
# autograd: setup_context + backward, shared by the custom ops and the eager Functions
# ---------------------------------------------------------------------------------------------
def _batch_norm_setup(ctx, inputs, output) -> tuple:
    # output: (y, save_mean, save_rstd) from the eager Function, plus the new running stats
    # (or None) from the op; returns the saved tensors
    x, weight, training = inputs[0], inputs[1], inputs[5]
    saved = (x, weight, output[1], output[2])
    ctx.save_for_backward(*saved)
    ctx.training = training
    ctx.mark_non_differentiable(*(t for t in output[1:] if t is not None))
    ctx.set_materialize_grads(False)
    return saved


def _batch_norm_act_setup(ctx, inputs, output, relu_mask=None) -> tuple:
    # inputs: batch norm's, then residual and act
    x, weight, bias, training, residual, act = (inputs[i] for i in (0, 1, 2, 5, 8, 9))
    # fmt: off
    saved = _save_batch_norm_act(ctx, x, weight, bias, residual, output[1], output[2], relu_mask,
                                 training, act)
    # fmt: on
    ctx.mark_non_differentiable(*(t for t in output[1:] if t is not None))
    ctx.set_materialize_grads(False)
    return saved


def _save_batch_norm_act(ctx, x, weight, bias, residual, mean, rstd, relu_mask, training, act):
    """Save what the fused backward reads; return the saved tensors. The activation's gradient
    recomputes its input from x, the statistics, weight, bias and the residual (no output is
    kept), or reads the ReLU mask the forward kept instead of the residual."""
    needs_t = act != "identity"
    z = residual if needs_t and relu_mask is None else None
    saved = (x, weight, mean, rstd, z, bias if needs_t else None, relu_mask)
    ctx.save_for_backward(*saved)
    ctx.training, ctx.act = training, act
    return saved


def _make_batch_norm_backward(bwd):
    def backward(ctx, dy, *_stat_grads):
        if dy is None:
            return (None,) * 8
        x, weight, save_mean, save_rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = [needs[0], needs[1], needs[2]]
        dx, dweight, dbias = bwd(dy, x, save_mean, save_rstd, weight, ctx.training, mask)
        return dx, dweight, dbias, None, None, None, None, None

    return backward


def _make_batch_norm_act_backward(bwd):
    def backward(ctx, dy, *_stat_grads):
        if dy is None:
            return (None,) * 10
        x, weight, save_mean, save_rstd, residual, bias, _relu_mask = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = [needs[0], needs[1], needs[2], needs[8]]
        # fmt: off
        dx, dweight, dbias, dres = bwd(dy, x, save_mean, save_rstd, weight, ctx.training, mask,
                                       residual, bias, ctx.act)
        # fmt: on
        return dx, dweight, dbias, None, None, None, None, None, dres, None

    return backward


# the backwards of double backward (create_graph=True), differentiable: _higher_order
_batch_norm_backward_composite = _make_batch_norm_backward(_higher_order.batch_norm_bwd)
_library.register_autograd(
    batch_norm_fwd_op,
    _kernel_backward(_make_batch_norm_backward(batch_norm_bwd_op), _batch_norm_backward_composite),
    _batch_norm_setup,
)
_library.register_autograd(
    batch_norm_act_fwd_op,
    _kernel_backward(
        _make_batch_norm_act_backward(batch_norm_act_bwd_op),
        _make_batch_norm_act_backward(_higher_order.batch_norm_act_bwd),
    ),
    _batch_norm_act_setup,
)


# ---------------------------------------------------------------------------------------------
# eager Functions: the backward bound to the forward's recorded program (_autograd._keep_forward)
# ---------------------------------------------------------------------------------------------
def _batch_norm_backward_eager(ctx, dy, *_stat_grads):
    """:func:`_make_batch_norm_backward`'s backward on the kernel, bound to the forward's
    program when the saved tensors are the forward's own (:func:`_keep_forward`)."""
    kept, ctx.bound = ctx.bound, None  # a second backward (retain_graph): the full path
    if dy is None:
        return (None,) * 9
    x, weight, save_mean, save_rstd = ctx.saved_tensors
    forward = None
    if kept is not None and kept[1] is x and kept[2] is weight:
        forward = kept[0] if kept[3] is save_mean and kept[4] is save_rstd else None
    needs = ctx.needs_input_grad
    mask = [needs[0], needs[1], needs[2]]
    # fmt: off
    dx, dweight, dbias = _batch_norm_bwd(dy, x, save_mean, save_rstd, weight, ctx.training, mask,
                                         forward)
    # fmt: on
    return dx, dweight, dbias, None, None, None, None, None, None


def _batch_norm_act_backward_eager(ctx, dy, *_stat_grads):
    """:func:`_make_batch_norm_act_backward`'s backward on the kernel, bound as in
    :func:`_batch_norm_backward_eager`."""
    if dy is None:
        ctx.bound = None
        return (None,) * 11
    dx, dweight, dbias, dres = _batch_norm_act_grads(ctx, dy, 8, False)
    return dx, dweight, dbias, None, None, None, None, None, dres, None, None


def _batch_norm_act_grads(ctx, dy, residual_at: int = 3, dense: bool = True) -> tuple:
    """(dx, dweight, dbias, dresidual) from what :func:`_save_batch_norm_act` saved, bound to the
    forward's program (``ctx.bound``, dropped here) when the saved tensors are its own; the
    residual is input ``residual_at`` of the Function. ``dense``: the forward ran on the
    arguments as given (a replay, cupynorm.torch._replay: the defaults are its), so the bound
    call takes them as they are, without the layers that make them dense and the gradients'
    layouts and dtypes match (the host op returns them so for such inputs)."""
    saved = ctx.saved_tensors
    forward = _bound_forward(ctx, saved)
    x, weight, save_mean, save_rstd, residual, bias, relu_mask = saved
    needs = ctx.needs_input_grad
    mask = (needs[0], needs[1], needs[2], needs[residual_at])
    if dense and forward is not None:
        host = _host()
        if ctx.act == "identity":
            args = (dy, x, save_mean, save_rstd, weight, ctx.training, mask[:3])
            grads = _program.call_bound(forward, host.batch_norm_bwd, args)
            return (*grads, dy if mask[3] else None)
        # fmt: off
        args = _batch_norm_act_bwd_op_args(dy, x, save_mean, save_rstd, weight, ctx.training,
                                           mask, residual, bias, ctx.act, relu_mask)
        # fmt: on
        return _program.call_bound(forward, host.batch_norm_act_bwd, args)
    if ctx.act == "identity":  # the residual's gradient is dy: plain batch norm's backward
        # fmt: off
        grads = _batch_norm_bwd(dy, x, save_mean, save_rstd, weight, ctx.training, mask[:3],
                                forward)
        # fmt: on
        return (*grads, dy if mask[3] else None)
    # fmt: off
    return _batch_norm_act_bwd(dy, x, save_mean, save_rstd, weight, ctx.training, mask, residual,
                               bias, ctx.act, forward, relu_mask)
    # fmt: on


_batch_norm_act_grads.composite = _higher_order.batch_norm_act_grads  # double backward


@_dropping_bound
def _batch_norm_backward_eager_composite(ctx, dy, *stat_grads):
    """:func:`_batch_norm_backward_eager`, differentiable (double backward)."""
    return (*_batch_norm_backward_composite(ctx, dy, *stat_grads), None)  # batches_tracked


@_dropping_bound
def _batch_norm_act_backward_eager_composite(ctx, dy, *_stat_grads):
    """:func:`_batch_norm_act_backward_eager`, differentiable (double backward)."""
    if dy is None:
        return (None,) * 11
    dx, dweight, dbias, dres = _higher_order.batch_norm_act_grads(ctx, dy, 8)
    return dx, dweight, dbias, None, None, None, None, None, dres, None, None


# ``batches_tracked``: a module's num_batches_tracked, incremented by the forward's kernels, or
# None (the backwards return a None more than there are inputs then, which autograd allows)
class _BatchNormFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps,
                batches_tracked=None):  # fmt: skip
        inputs = (x, weight, bias, running_mean, running_var, training, momentum, eps)
        output, program = _batch_norm_fwd_program(*inputs, None, "identity", batches_tracked)
        _keep_forward(ctx, program, _batch_norm_setup(ctx, inputs, output))
        return output

    backward = staticmethod(
        _kernel_backward(_batch_norm_backward_eager, _batch_norm_backward_eager_composite)
    )


class _BatchNormActFunction(_EagerFunction):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps, residual,
                act, batches_tracked=None):  # fmt: skip
        inputs = (
            x,
            weight,
            bias,
            running_mean,
            running_var,
            training,
            momentum,
            eps,
            residual,
            act,
        )
        # ReLU with a residual: the forward keeps the ReLU's mask where it can, which the backward
        # reads instead of the residual (one read of the tensor fewer)
        keep = act == "relu" and residual is not None
        output, program = _batch_norm_fwd_program(*inputs, batches_tracked, keep_mask=keep)
        relu_mask = output[3] if keep else None
        output = output[:3]
        _keep_forward(ctx, program, _batch_norm_act_setup(ctx, inputs, output, relu_mask))
        return output

    backward = staticmethod(
        _kernel_backward(_batch_norm_act_backward_eager, _batch_norm_act_backward_eager_composite)
    )


# ---------------------------------------------------------------------------------------------
# replayed eager calls (cupynorm.torch._replay)
# ---------------------------------------------------------------------------------------------
def _batch_norm_replay_save(ctx, call, x, weight, bias, residual, outputs):
    """Batch norm (+ residual + activation), ``call.info`` (training, act): y; saved as
    :class:`_BatchNormActFunction` saves."""
    y, mean, rstd, *kept = outputs
    training, act = call.info
    relu_mask = kept[0] if kept else None
    # fmt: off
    saved = _save_batch_norm_act(ctx, x, weight, bias, residual, mean, rstd, relu_mask, training,
                                 act)
    # fmt: on
    ctx.bound = (call.program, *saved)
    ctx.grads = _batch_norm_act_grads
    return y


def _replay_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps,
                       residual, act, batches_tracked,
                       grad) -> tuple[Tensor | None, Token]:  # fmt: skip
    """``act(batch_norm(x) + residual)`` replayed: (y, None); or (None, a token for
    :func:`._replay.validated`) or (None, None) when the call is not replayed
    (:func:`._replay.run`). The arguments are :func:`_batch_norm_route`'s (act "identity" and
    residual None: plain batch norm), on tensors the kernels take (CUDA), in a call nothing
    traces (``_route._traced``); ``grad``: whether the call needs autograd
    (``_route._wants_grad``)."""
    x = unwrap(x)
    if residual is not None:
        residual = unwrap(residual)
    if grad:
        weight = weight if weight is None else unwrap(weight)
        bias = bias if bias is None else unwrap(bias)
    keep = grad and act == "relu" and residual is not None
    # fmt: off
    args = _batch_norm_fwd_op_args(x, weight, bias, running_mean, running_var, training,
                                   momentum, eps, residual, act, batches_tracked, keep)
    y, token = _replay.run("batch_norm_fwd", args, {}, None, grad, _batch_norm_replay_save,
                           (training, act), (x, weight, bias, residual))
    # fmt: on
    return (y[0] if y is not None and not grad else y), token


# ---------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------
def _count_on_host(batches_tracked: Tensor | None) -> None:
    """A module's batch counter incremented by a torch op, where no cupynorm kernel does it
    (:func:`_batch_norm_route`)."""
    if batches_tracked is not None:
        batches_tracked.add_(1)


def _batch_norm_on_kernels(
    fn: str,
    args: tuple,
    batches_tracked: Tensor | None,
    residual: Tensor | None = None,
    activation: str | None = None,
    kind: str = "batch_norm",
    use_kernels: bool | None = None,
) -> bool:
    """The checks of a batch norm call (``args``: F.batch_norm's; ``activation`` given: the fused
    op's epilogue too) and whether it runs on cupynorm's kernels. A module's batch counter is
    incremented here, by a torch op, when the call is rejected or goes to torch: as torch's module
    counts it before its F.batch_norm (the kernels count the calls they run). ``use_kernels``:
    :func:`._route._use_kernels` of the input, when the caller asked it already (it is a probe of
    the GPU's progress, not asked twice)."""
    input = args[0]
    try:
        _checks.check_tensor(fn, "input", input)
        if activation is not None:
            _checks.check_epilogue(fn, input, residual, activation)
        if use_kernels is None:
            use_kernels = _use_kernels(input, kind)
        kernels = use_kernels and not inductor_takes("batch_norm", input, kind)
        if kernels:
            _checks.check_batch_norm(*args)
    except Exception:
        _count_on_host(batches_tracked)
        raise
    if not kernels:
        _count_on_host(batches_tracked)
    return kernels


def _apply_batch_norm(
    x, weight, bias, running_mean, running_var, training, momentum, eps, batches_tracked=None
):
    args = (x, weight, bias, running_mean, running_var, training, momentum, eps)
    if _traced(x):
        _count_on_host(batches_tracked)
        y, _mean, _rstd, new_mean, new_var = batch_norm_fwd_op(*args)
        if new_mean is not None:
            running_mean.copy_(new_mean)
        if new_var is not None:
            running_var.copy_(new_var)
        return y
    if _wants_grad(x, weight, bias):
        return _BatchNormFunction.run(*args, batches_tracked)[0]
    return _batch_norm_fwd(*args, None, "identity", batches_tracked)[0]


def _apply_batch_norm_act(
    x, weight, bias, running_mean, running_var, training, momentum, eps, residual, act,
    batches_tracked=None,
) -> Tensor:  # fmt: skip
    args = (x, weight, bias, running_mean, running_var, training, momentum, eps, residual, act)
    if _traced(x):
        _count_on_host(batches_tracked)
        y, _mean, _rstd, new_mean, new_var = batch_norm_act_fwd_op(*args)
        if new_mean is not None:
            running_mean.copy_(new_mean)
        if new_var is not None:
            running_var.copy_(new_var)
        return y
    if _wants_grad(x, weight, bias, residual):
        return _BatchNormActFunction.run(*args, batches_tracked)[0]
    return _batch_norm_fwd(*args, batches_tracked)[0]


# ---------------------------------------------------------------------------------------------
# functional API
# ---------------------------------------------------------------------------------------------
def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    r"""Batch normalization (:func:`torch.nn.functional.batch_norm`) on cupynorm's kernels.

    Each channel is normalized over the batch and spatial dimensions
    (``N * prod(spatial)`` values):

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    In training the batch statistics are used (biased variance) and the running statistics, if
    given, are updated in place with the unbiased variance:
    :math:`r \leftarrow (1 - \text{momentum})\, r + \text{momentum} \cdot \text{stat}`. In eval
    the running statistics are used.

    Args:
        input: tensor of shape :math:`(N, C, *)`; CUDA tensors run on cupynorm's kernels,
            tensors on other devices through :func:`torch.nn.functional.batch_norm`.
        running_mean: running mean of shape :math:`(C,)`, or None (training only).
        running_var: running variance of shape :math:`(C,)`, or None (training only).
        weight: per-channel scale :math:`\gamma` of shape :math:`(C,)`, or None.
        bias: per-channel shift :math:`\beta` of shape :math:`(C,)`, or None.
        training: use batch statistics and update the running ones. Default: ``False``
        momentum: weight of the batch statistics in the running update. Default: 0.1
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: :math:`(N, C, *)`, same memory format as the input

    Example::

        >>> x = torch.randn(8, 3, 7, 7, device="cuda")
        >>> mean, var = torch.zeros(3, device="cuda"), torch.ones(3, device="cuda")
        >>> y = cupynorm.torch.batch_norm(x, mean, var, training=True)
    """
    # fmt: off
    return _batch_norm_route("batch_norm", input, running_mean, running_var, weight, bias,
                             training, momentum, eps, None, None, None)
    # fmt: on


def _batch_norm_route(
    fn, input, running_mean, running_var, weight, bias, training, momentum, eps, batches_tracked,
    residual, activation,
) -> Tensor:  # fmt: skip
    """The route of a batch norm call, plain (``activation`` None) or fused (``fn``: the
    function's name, for the checks): a replay of the same call checked before
    (:mod:`._replay`), else the checks, then torch's functional or cupynorm's kernels, whose
    call may be replayed from then on. ``batches_tracked``: a module's batch counter
    (``num_batches_tracked``, or None) to increment: by the kernel that updates the running
    statistics (one launch fewer than torch's module, whose ``add_`` is a kernel of its own),
    else by a torch op (:func:`_batch_norm_on_kernels`). The modules call this directly."""
    y, key = None, None
    # the eager policy's kind: plain, or fused with an activation or a residual
    plain = residual is None and activation in (None, "identity")
    kind = "batch_norm" if plain else "batch_norm_act"
    # asked once (it may probe the GPU's progress); None: not a tensor, the checks' error first
    use_kernels = _use_kernels(input, kind) if type(input) is Tensor else None
    if use_kernels and not _traced(input):
        # fmt: off
        y, key = _replay_batch_norm(input, weight, bias, running_mean, running_var, training,
                                    momentum, eps, residual, activation or "identity",
                                    batches_tracked, _wants_grad(input, weight, bias, residual))
        # fmt: on
        if y is not None:
            return y
    args = (input, running_mean, running_var, weight, bias, training, momentum, eps)
    on_kernels = _batch_norm_on_kernels(
        fn, args, batches_tracked, residual, activation, kind, use_kernels
    )
    if not on_kernels:
        y = F.batch_norm(*args)
        if activation is None:
            return y
        return ACTIVATIONS[activation](y if residual is None else y + residual)
    vectors = (weight, bias, running_mean, running_var)
    if activation is None:
        y = _apply_batch_norm(input, *vectors, training, momentum, eps, batches_tracked)
    else:
        # fmt: off
        y = _apply_batch_norm_act(input, *vectors, training, momentum, eps, residual, activation,
                                  batches_tracked)
        # fmt: on
    _replay.validated(key, _layout(input) is not None, vectors)
    return y


def batch_norm_act(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    residual: Tensor | None = None,
    activation: str = "relu",
) -> Tensor:
    r"""Batch normalization, a residual add and an activation in one pass:
    ``activation(batch_norm(input, ...) + residual)``.

    The arguments before ``residual`` are :func:`batch_norm`'s. The add and the activation run
    in the normalize pass (float32, one rounding), and the backward turns the incoming gradient
    into the activation's input gradient in its first pass (the activation's input recomputed
    from ``input`` and ``residual``; for ReLU with a residual on channels_last float16/bfloat16
    data, from a mask the forward keeps instead, a bit per element), which is also the
    residual's gradient: the forward reads ``input`` and ``residual`` once and writes one
    tensor, where the unfused sequence makes three passes.

    Args:
        residual: tensor of the input's shape, dtype and device added before the activation
            (the ResNet bottleneck's identity branch), or None.
        activation: ``"relu"``, ``"silu"`` or ``"identity"``. Default: ``"relu"``

    Example::

        >>> x, identity = torch.randn(2, 8, 64, 56, 56, device="cuda").unbind(0)
        >>> mean, var = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")
        >>> y = cupynorm.torch.batch_norm_act(x, mean, var, training=True, residual=identity)
    """
    # fmt: off
    return _batch_norm_route("batch_norm_act", input, running_mean, running_var, weight, bias,
                             training, momentum, eps, None, residual, activation)
    # fmt: on
