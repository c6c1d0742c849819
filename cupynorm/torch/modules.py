r"""Drop-in ``torch.nn`` normalization modules running on cupynorm's kernels.

Each module subclasses its ``torch.nn`` counterpart and overrides only ``forward``, so the
constructor signature and defaults, the parameters and buffers (``weight``, ``bias``,
``running_mean``, ``running_var``, ``num_batches_tracked``), ``state_dict`` keys and loading (in
both directions), ``extra_repr``, ``reset_parameters``/``reset_running_stats`` and the input-dim
checks (``_check_input_dim``) are torch's own by construction, and
``isinstance(m, torch.nn.BatchNorm2d)`` holds. ``forward`` repeats the logic of torch's
``forward`` (the exponential average factor of ``_BatchNorm.forward``, the warnings and errors of
``_InstanceNorm.forward``: the mixins of :mod:`._module_forward`) and calls the functional API
of :mod:`cupynorm.torch`: CUDA tensors run on cupynorm's kernels, tensors on any other device
through :mod:`torch.nn.functional`.

The extra Python work per call is torch's own forward logic plus a few checks: no ``super()``
chains, no per-call allocation beyond the output and the statistics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._channel_norm import layer_norm2d, rms_norm2d
from ._group_norm import group_norm, group_norm_act
from ._llama_rms_norm import llama_rms_norm
from ._module_forward import _batch_norm_act_forward, _BatchNormForward, _InstanceNormForward
from ._row_norm import layer_norm, rms_norm
from ._row_norm_add_mul import row_norm_add_mul

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "BatchNormAct2d",
    "GroupNorm",
    "GroupNormAct",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LayerNorm",
    "LayerNorm2d",
    "LlamaRMSNorm",
    "RMSNorm",
    "RMSNorm2d",
    "RowNormAddMul",
]


_BATCH_NORM_DOC = r"""Batch normalization over a {shapes} input on cupynorm's kernels; a drop-in
    :class:`torch.nn.{name}`.

    .. math::
        y = \frac{{x - \mathrm{{E}}[x]}}{{\sqrt{{\mathrm{{Var}}[x] + \epsilon}}}} * \gamma + \beta

    Mean and variance are taken per channel over the batch and spatial dimensions (biased
    variance for normalizing; the running variance gets the unbiased one). In training the
    running statistics are updated with ``momentum`` (``None``: cumulative average over
    ``num_batches_tracked``); in eval they are used instead of the batch's.

    Args:
        num_features: number of channels :math:`C`
        eps: added to the variance for numerical stability. Default: 1e-5
        momentum: weight of the batch statistics in the running update, or ``None`` for a
            cumulative moving average. Default: 0.1
        affine: learnable per-channel ``weight`` (:math:`\gamma`, init 1) and ``bias``
            (:math:`\beta`, init 0). Default: ``True``
        track_running_stats: keep ``running_mean``/``running_var``; without them batch
            statistics are used in eval too. Default: ``True``
        device, dtype: of the parameters and buffers.
        bias: learn ``bias`` (with ``affine``), where the installed torch's class takes this
            argument. Default: ``True``

    Shape:
        - Input: {input_shape}
        - Output: same shape (and memory format) as the input

    Example::

        >>> m = cupynorm.torch.{name}({c}).cuda()
        >>> x = torch.randn({example}, device="cuda")
        >>> y = m(x)
    """

_INSTANCE_NORM_DOC = r"""Instance normalization over a {shapes} input on cupynorm's kernels; a
    drop-in :class:`torch.nn.{name}`.

    .. math::
        y = \frac{{x - \mathrm{{E}}[x]}}{{\sqrt{{\mathrm{{Var}}[x] + \epsilon}}}} * \gamma + \beta

    Mean and (biased) variance are taken per sample and channel over the spatial dimensions.
    With ``track_running_stats`` the running statistics are updated in training (mean over the
    batch of the per-instance mean and unbiased variance) and used in eval.

    Args:
        num_features: number of channels :math:`C`
        eps: added to the variance for numerical stability. Default: 1e-5
        momentum: weight of the new statistics in the running update. Default: 0.1
        affine: learnable per-channel ``weight`` and ``bias``. Default: ``False``
        track_running_stats: keep and use running statistics. Default: ``False``
        device, dtype: of the parameters and buffers.
        bias: learn ``bias`` (with ``affine``), where the installed torch's class takes this
            argument. Default: ``True``

    Shape:
        - Input: {input_shape}
        - Output: same shape (and memory format) as the input

    Example::

        >>> m = cupynorm.torch.{name}({c}, affine=True).cuda()
        >>> x = torch.randn({example}, device="cuda")
        >>> y = m(x)
    """


def _doc(template: str, name: str, shapes: str, input_shape: str, example: str) -> str:
    return template.format(name=name, shapes=shapes, input_shape=input_shape, c=3, example=example)


class BatchNorm1d(_BatchNormForward, torch.nn.BatchNorm1d):
    __doc__ = _doc(
        _BATCH_NORM_DOC,
        "BatchNorm1d",
        "2D or 3D",
        ":math:`(N, C)` or :math:`(N, C, L)`",
        "16, 3, 7",
    )


class BatchNorm2d(_BatchNormForward, torch.nn.BatchNorm2d):
    __doc__ = _doc(_BATCH_NORM_DOC, "BatchNorm2d", "4D", ":math:`(N, C, H, W)`", "16, 3, 5, 7")


class BatchNorm3d(_BatchNormForward, torch.nn.BatchNorm3d):
    __doc__ = _doc(_BATCH_NORM_DOC, "BatchNorm3d", "5D", ":math:`(N, C, D, H, W)`", "4, 3, 5, 7, 3")


class BatchNormAct2d(BatchNorm2d):
    r"""BatchNorm2d, a residual add and an activation fused:
    ``activation(batch_norm(input) + residual)`` (:func:`cupynorm.torch.batch_norm_act`).

    The ResNet bottleneck's tail (``bn3``, ``+= identity``, ReLU) and the norm-activation pairs
    of most convolutional networks in one module and one pass over the data. It is a
    :class:`BatchNorm2d` (so a :class:`torch.nn.BatchNorm2d`) with the same parameters, buffers
    and ``state_dict``; :func:`cupynorm.torch.fuse` puts it in place of a BatchNorm2d whose
    activation (and residual add) it absorbs.

    Args:
        *args, **kwargs: :class:`torch.nn.BatchNorm2d`'s.
        activation: ``"relu"``, ``"silu"`` or ``"identity"``. Default: ``"relu"``

    Shape:
        - Input, residual: :math:`(N, C, H, W)`, the same shape and dtype
        - Output: same shape (and memory format) as the input

    Example::

        >>> m = cupynorm.torch.BatchNormAct2d(64).cuda()
        >>> x, identity = torch.randn(2, 8, 64, 56, 56, device="cuda").unbind(0)
        >>> y = m(x, identity)          # relu(bn(x) + identity)
    """

    activation: str

    def __init__(self, *args, activation: str = "relu", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.activation = activation

    def forward(self, input: Tensor, residual: Tensor | None = None) -> Tensor:
        return _batch_norm_act_forward(self, input, residual, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


class InstanceNorm1d(_InstanceNormForward, torch.nn.InstanceNorm1d):
    __doc__ = _doc(
        _INSTANCE_NORM_DOC,
        "InstanceNorm1d",
        "2D (unbatched) or 3D",
        ":math:`(N, C, L)` or :math:`(C, L)`",
        "4, 3, 7",
    )


class InstanceNorm2d(_InstanceNormForward, torch.nn.InstanceNorm2d):
    __doc__ = _doc(
        _INSTANCE_NORM_DOC,
        "InstanceNorm2d",
        "3D (unbatched) or 4D",
        ":math:`(N, C, H, W)` or :math:`(C, H, W)`",
        "4, 3, 5, 7",
    )


class InstanceNorm3d(_InstanceNormForward, torch.nn.InstanceNorm3d):
    __doc__ = _doc(
        _INSTANCE_NORM_DOC,
        "InstanceNorm3d",
        "4D (unbatched) or 5D",
        ":math:`(N, C, D, H, W)` or :math:`(C, D, H, W)`",
        "4, 3, 5, 7, 3",
    )


class GroupNorm(torch.nn.GroupNorm):
    r"""Group normalization on cupynorm's kernels; a drop-in :class:`torch.nn.GroupNorm`.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    The ``num_channels`` channels are split into ``num_groups`` groups; mean and (biased)
    variance are taken per sample and group over its channels and spatial dimensions;
    :math:`\gamma`, :math:`\beta` are per channel.

    Args:
        num_groups: number of groups; must divide ``num_channels``
        num_channels: number of channels :math:`C`
        eps: added to the variance for numerical stability. Default: 1e-5
        affine: learnable per-channel ``weight`` (init 1) and ``bias`` (init 0). Default: ``True``
        device, dtype: of the parameters.
        bias: learn ``bias`` (with ``affine``), where the installed torch's class takes this
            argument. Default: ``True``

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: same shape (and memory format) as the input

    Example::

        >>> m = cupynorm.torch.GroupNorm(3, 6).cuda()
        >>> x = torch.randn(4, 6, 5, 7, device="cuda")
        >>> y = m(x)
    """

    def forward(self, input: Tensor) -> Tensor:
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


class GroupNormAct(GroupNorm):
    r"""GroupNorm and an activation fused: ``activation(group_norm(input))``
    (:func:`cupynorm.torch.group_norm_act`).

    The norm-activation pair of the diffusion ResNet block (GroupNorm(32) then SiLU) in one
    module and one pass over the data. It is a :class:`GroupNorm` (so a
    :class:`torch.nn.GroupNorm`) with the same parameters and ``state_dict``;
    :func:`cupynorm.torch.fuse` puts it in place of a GroupNorm whose activation it absorbs.

    ``forward(input, shift=None)``: with a ``shift``, ``activation(group_norm(input +
    shift[:, :, None, None]))`` (diffusers' ResnetBlock2D adds its time embedding so before
    norm2; :func:`cupynorm.torch.fuse` folds that add into this module). The add runs in the
    fused kernel when ``input`` is 4-D and ``shift`` is ``(N, C)`` of its dtype and device, and
    as written otherwise.

    Args:
        *args, **kwargs: :class:`torch.nn.GroupNorm`'s.
        activation: ``"silu"``, ``"relu"`` or ``"identity"``. Default: ``"silu"``

    Shape:
        - Input: :math:`(N, C, *)`; shift: :math:`(N, C)`
        - Output: same shape (and memory format) as the input

    Example::

        >>> m = cupynorm.torch.GroupNormAct(32, 320).cuda()
        >>> x = torch.randn(2, 320, 64, 64, device="cuda")
        >>> y = m(x)                    # silu(group_norm(x))
        >>> temb = torch.randn(2, 320, device="cuda")
        >>> y = m(x, temb)              # silu(group_norm(x + temb[:, :, None, None]))
    """

    activation: str

    def __init__(self, *args, activation: str = "silu", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.activation = activation

    def forward(self, input: Tensor, shift: Tensor | None = None) -> Tensor:
        # Under torch.compile too, as BatchNormAct2d: the activation after the norm has no
        # neighbour Inductor could fuse it into but the norm, an opaque op here, so the fused op
        # saves a pass.
        if shift is not None and not (
            input.dim() == 4
            and shift.shape == input.shape[:2]
            and shift.dtype == input.dtype
            and shift.device == input.device
        ):  # the add as written (broadcasting, type promotion), then the fused norm
            input, shift = input + shift[:, :, None, None], None
        # fmt: off
        return group_norm_act(input, self.num_groups, self.weight, self.bias, self.eps,
                              self.activation, shift)
        # fmt: on

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


class RowNormAddMul(torch.nn.Module):
    r"""The fused norm + add + mul tail: :func:`cupynorm.torch.row_norm_add_mul` as a module.

    .. math::
        \hat{x} = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}}, \qquad
        \text{out} = (\hat{x} + y) \cdot y

    over the last dimension, without parameters.

    Args:
        eps: added to the variance for numerical stability. Default: 1e-5

    Shape:
        - x, y: :math:`(*, D)`, same shape and dtype
        - Output: :math:`(*, D)`

    Example::

        >>> m = cupynorm.torch.RowNormAddMul()
        >>> x, y = torch.randn(2, 1024, 64, device="cuda").unbind(0)
        >>> out = m(x, y)
    """

    __constants__ = ["eps"]
    eps: float

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return row_norm_add_mul(x, y, self.eps)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


class LayerNorm(torch.nn.LayerNorm):
    r"""Layer normalization on cupynorm's kernels; a drop-in :class:`torch.nn.LayerNorm`.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    Mean and (biased) variance are taken over the trailing ``normalized_shape`` dimensions of
    each row; :math:`\gamma`, :math:`\beta` have shape ``normalized_shape``.

    Args:
        normalized_shape: the trailing dimensions normalized over (an int or a sequence)
        eps: added to the variance for numerical stability. Default: 1e-5
        elementwise_affine: learnable ``weight`` (init 1) and ``bias`` (init 0).
            Default: ``True``
        bias: learn ``bias`` (with ``elementwise_affine``). Default: ``True``
        device, dtype: of the parameters.

    Shape:
        - Input: :math:`(*, \text{normalized\_shape})`
        - Output: same shape

    Example::

        >>> m = cupynorm.torch.LayerNorm(768).cuda()
        >>> y = m(torch.randn(8, 128, 768, device="cuda"))
    """

    def forward(self, input: Tensor) -> Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    r"""Root-mean-square normalization on cupynorm's kernels; a drop-in
    :class:`torch.nn.RMSNorm`.

    .. math::
        y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} * \gamma

    over the trailing ``normalized_shape`` dimensions of each row.

    Args:
        normalized_shape: the trailing dimensions normalized over (an int or a sequence)
        eps: added to the mean square. Default: None, as torch: the machine epsilon of float32
            (float64 for float64 input)
        elementwise_affine: learnable ``weight`` (init 1). Default: ``True``
        device, dtype: of the parameters.

    Shape:
        - Input: :math:`(*, \text{normalized\_shape})`
        - Output: same shape

    Example::

        >>> m = cupynorm.torch.RMSNorm(4096, device="cuda", dtype=torch.bfloat16)
        >>> y = m(torch.randn(4, 2048, 4096, device="cuda", dtype=torch.bfloat16))
    """

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


class LayerNorm2d(torch.nn.LayerNorm):
    r"""Layer normalization over the channels of :math:`(N, C, *)`, per sample and position, on
    cupynorm's kernels: a drop-in for timm's and torchvision's ``LayerNorm2d`` (ConvNeXt).

    A :class:`torch.nn.LayerNorm` with ``normalized_shape = C`` (same constructor, parameters,
    ``state_dict`` and repr) whose forward normalizes dim 1 instead of the last dims:

    .. math::
        y_{n,c,s} = \frac{x_{n,c,s} - \mathrm{E}_c[x_{n,:,s}]}
            {\sqrt{\mathrm{Var}_c[x_{n,:,s}] + \epsilon}} * \gamma_c + \beta_c

    Args:
        normalized_shape: the number of channels ``C``
        eps: added to the variance for numerical stability. Default: 1e-5
        elementwise_affine: learnable ``weight`` (init 1) and ``bias`` (init 0).
            Default: ``True``
        bias: learn ``bias`` (with ``elementwise_affine``). Default: ``True``
        device, dtype: of the parameters.

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: same shape and memory format (contiguous or channels_last)

    Example::

        >>> m = cupynorm.torch.LayerNorm2d(96, eps=1e-6).cuda()
        >>> y = m(torch.randn(8, 96, 56, 56, device="cuda"))
    """

    def forward(self, input: Tensor) -> Tensor:
        return layer_norm2d(input, self.weight, self.bias, self.eps)


class RMSNorm2d(torch.nn.RMSNorm):
    r"""Root-mean-square normalization over the channels of :math:`(N, C, *)`, per sample and
    position, on cupynorm's kernels (timm's ``RmsNorm2d``): a :class:`torch.nn.RMSNorm` with
    ``normalized_shape = C`` whose forward normalizes dim 1.

    .. math::
        y_{n,c,s} = \frac{x_{n,c,s}}{\sqrt{\mathrm{E}_c[x_{n,:,s}^2] + \epsilon}} * \gamma_c

    Args:
        normalized_shape: the number of channels ``C``
        eps: added to the mean square. Default: None, as torch: the machine epsilon of float32
            (float64 for float64 input)
        elementwise_affine: learnable ``weight`` (init 1). Default: ``True``
        device, dtype: of the parameters.

    Shape:
        - Input: :math:`(N, C, *)`
        - Output: same shape and memory format

    Example::

        >>> m = cupynorm.torch.RMSNorm2d(64, eps=1e-5).cuda()
        >>> y = m(torch.randn(16, 64, 256, 256, device="cuda"))
    """

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm2d(x, self.weight, self.eps)


class LlamaRMSNorm(torch.nn.Module):
    r"""Hugging Face's ``LlamaRMSNorm`` (and its copies: ``Qwen2RMSNorm``, ``MistralRMSNorm``,
    ...) on cupynorm's kernels, with the layer's numerics (:func:`llama_rms_norm`): normalized
    in float32, rounded to the input's dtype, then multiplied by ``weight``.

    Same attributes as transformers' class: ``weight`` (init 1), ``variance_epsilon``, the
    ``state_dict`` key ``weight`` and the ``extra_repr``. :func:`replace_norms` converts
    transformers' layers of this formula into subclasses of this class (``include`` names it).

    Args:
        hidden_size: H, the size of the last dimension
        eps: added to the mean square. Default: 1e-6
        device, dtype: of ``weight``.

    Shape:
        - Input: :math:`(*, H)`
        - Output: same shape, of the dtype ``weight * input`` promotes to

    Example::

        >>> m = cupynorm.torch.LlamaRMSNorm(2048).to("cuda", torch.bfloat16)
        >>> y = m(torch.randn(4, 2048, 2048, device="cuda", dtype=torch.bfloat16))
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        return llama_rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
