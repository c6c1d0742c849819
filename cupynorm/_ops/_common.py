"""What several families' entries share: the output dtype of a mixed-precision call, a second
tensor laid out as x, and the (N, C, S) of a per-channel pass."""

from __future__ import annotations

from typing import Any

from .. import _plan
from .._launch import _Call


def _set_out_dtype(call: _Call, out_dtype: str | None) -> None:
    """The call's y (forward) or dy (backward) dtype: x's (None), or float32 beside a float16 /
    bfloat16 x (autocast's float32 norm of the half-precision values)."""
    if out_dtype is None or out_dtype == call.dtype:
        return
    if out_dtype != "float32" or call.itemsize != 2:
        raise ValueError(f"y and dy in {out_dtype} beside x in {call.dtype}: only float32 beside "
                         "a float16 or bfloat16 x (wider than x)")  # fmt: skip
    call.out_dtype = out_dtype


def _match_layout(call: _Call, t: Any, ref: Any) -> Any:
    """t laid out with ref's strides (a copy only when they differ), in t's dtype."""
    if tuple(call.bk.strides(t)) == tuple(call.bk.strides(ref)):
        return t
    out = call.bk.empty_strided_like(ref, call.bk.dtype_name(t))
    call.bk.copy_into(out, t)
    return out


def _per_channel_layout(x: Any, layout: str) -> tuple[int, int, int, str]:
    """N, C, S of x (N, C, *spatial) and the layout of its per-channel passes ((N, C) and
    S == 1 data are channels innermost, one row per sample)."""
    N, C = x.shape[0], x.shape[1]
    S = _plan.prod(tuple(x.shape[2:]))
    return N, C, S, "channels_last" if S == 1 else layout
