"""The eager autograd machinery that every norm family's ``autograd.Function`` shares.

Each family (:mod:`._batch_norm`, :mod:`._group_norm`, ...) writes its setup_context and
backward once, for its custom op and its eager Function alike: the backward makers take
``bwd``, the backward op (traceable, for the custom op) or the kernel itself (eager). The eager
Functions are old-style ``forward(ctx, ...)`` subclasses of :class:`_EagerFunction`: one that
defines ``setup_context`` pays for an ``inspect.signature()`` bind on every ``apply`` (measured:
+13 us per call on the dev machine's CPU). Here: that base, the backward bound to the forward's
recorded program (:func:`_keep_forward`, :func:`_bound_forward`), and the Function of a
replayed call (:class:`_ReplayFunction`). The backward is a kernel without a derivative; under
``create_graph=True`` (double backward) each Function computes its gradients with its
differentiable composite instead (:func:`_kernel_backward`, :mod:`._higher_order`).
"""

from __future__ import annotations

import functools

import torch
from torch._functorch.utils import unwrap_dead_wrappers

# ---- the backward bound at forward time (eager Functions) ------------------------------------
# Everything in the backward's recorded-call key but dy is fixed by the forward: its input,
# weight and statistics are the tensors the backward gets (cupynorm._program.call_bound). The
# forward keeps its program and the tensors it saved; the backward binds when ctx.saved_tensors
# gives back those very objects (a saved-tensor hook gives others: then the full key), and drops
# them. The references are those the saved tensors hold anyway; none are kept while saved-tensor
# hooks are active (a checkpoint, offloading: the hooks exist to let the tensors go).
_default_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _hooks_active() -> bool:
    """Whether saved-tensor hooks are active (or torch cannot say)."""
    return _default_hooks is None or _default_hooks(False) is not None


def _keep_forward(ctx, program, saved: tuple) -> None:
    """Keep the forward's recorded program and saved tensors for the backward, if any (the
    eager backwards: :func:`._batch_norm._batch_norm_backward_eager`)."""
    ctx.bound = None if program is None or _hooks_active() else (program, *saved)


class _SavedOutput:
    """What a bound backward keeps of a saved tensor that is one of the Function's outputs: its
    pointer and layout. ``ctx.saved_tensors`` hands an output back as a new tensor object, so
    identity cannot tell it, and the output itself kept in ``ctx`` would make a reference cycle
    through its ``grad_fn``."""

    __slots__ = ("signature",)

    def __init__(self, t: torch.Tensor) -> None:
        self.signature = (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)

    def matches(self, t: torch.Tensor | None) -> bool:
        return t is not None and (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) == (
            self.signature
        )


def _bound_forward(ctx, saved: tuple):
    """The forward's program :func:`_keep_forward` kept, when ``saved`` (``ctx.saved_tensors``)
    are the tensors it kept with it (a :class:`_SavedOutput` for a saved output); else None.
    The kept references are dropped: a second backward (retain_graph) takes the full path."""
    kept, ctx.bound = ctx.bound, None
    if kept is not None and all(
        a is b or (type(a) is _SavedOutput and a.matches(b))
        for a, b in zip(kept[1:], saved, strict=True)
    ):
        return kept[0]
    return None


# ---------------------------------------------------------------------------------------------
# eager fast path: autograd.Functions over the same kernels, setup_context and backward math
# ---------------------------------------------------------------------------------------------
# Host time per call: torch's ``Function.apply`` is a Python classmethod that, before the C++
# apply, checks for a setup_context, asks whether a functorch transform is active and unwraps
# dead functorch wrappers. ``_EagerFunction.run`` calls the C++ apply itself (after the same
# unwrapping) when no transform is active, else torch's (the functional API takes torch's
# composite path under transforms: ``_route._use_kernels``).
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_transforms_active = torch._C._are_functorch_transforms_active


class _EagerFunction(torch.autograd.Function):
    """Base of the eager Functions: ``Cls.run(*args)`` is ``Cls.apply(*args)``;
    ``Cls.c_apply(*args)`` is torch's C++ apply, for callers that checked for transforms and
    unwrapped dead wrappers themselves."""

    run: staticmethod
    c_apply: staticmethod

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        c_apply = _C_APPLY.__get__(None, cls)
        cls.c_apply = staticmethod(c_apply)
        apply = cls.apply

        def run(*args):
            if _transforms_active():
                return apply(*args)
            return c_apply(*unwrap_dead_wrappers(args))

        cls.run = staticmethod(run)


def _kernel_backward(kernel, composite):
    """A Function's backward: ``kernel`` (the backward on the kernels) when grad mode is off --
    every backward but one run with ``create_graph=True`` -- else ``composite``, the same
    gradients from differentiable torch operations (:mod:`._higher_order`), so that double
    backward works. (torch's ``once_differentiable`` would open a no_grad context around a
    backward that autograd already runs with grad mode off.)"""

    @functools.wraps(kernel)
    def backward(ctx, *args):
        if torch.is_grad_enabled():
            return composite(ctx, *args)
        return kernel(ctx, *args)

    return backward


def _made_backward(make, kernel_bwd, composite_bwd, *args):
    """:func:`_kernel_backward` of a family's backward maker ``make(bwd, *args)`` on its
    backward kernel (or op) and on the same differentiable backward (:mod:`._higher_order`)."""
    return _kernel_backward(make(kernel_bwd, *args), make(composite_bwd, *args))


def _dropping_bound(backward):
    """``backward`` for a Function whose ctx may keep the forward's program (``ctx.bound``,
    :func:`_keep_forward`): the reference dropped first, as the kernel's backward drops it."""

    @functools.wraps(backward)
    def wrapper(ctx, *args):
        ctx.bound = None
        return backward(ctx, *args)

    return wrapper


# ---- replayed eager calls (cupynorm.torch._replay) --------------------------------------------
# A family's ``save(ctx, call, x, a, b, c, outputs)`` saves what its full Function saves (for the
# same backward), binds the backward to the forward's program (the replay's condition: no
# saved-tensor hooks) and returns the Function's outputs; ``ctx.grads(ctx, *grad_outputs)``
# gives the gradients of x, a, b, c, and ``ctx.grads.composite`` the same differentiably (double
# backward, :mod:`._higher_order`). ``call.info``: the family's constants of the call.
class _ReplayFunction(_EagerFunction):
    """A replayed eager norm call: ``forward(ctx, x, a, b, c, call)`` runs ``call``'s recorded
    program and hands its outputs to ``call.save``, its family's (:mod:`._replay`)."""

    @staticmethod
    def forward(ctx, x, a, b, c, call):
        outputs = call.program.run(call.bk, call.device, call.tensors, call.pointers)
        return call.save(ctx, call, x, a, b, c, outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        if torch.is_grad_enabled():  # create_graph=True
            ctx.bound = None
            return (*ctx.grads.composite(ctx, *grad_outputs), None)
        return (*ctx.grads(ctx, *grad_outputs), None)
