"""Host side of the on-chip segment family (``segment_norm.cu``): a contiguous segment (a
GroupNorm/InstanceNorm group on NCHW data, a row) held in one CTA's shared memory, or split over a
team of CTAs that exchange their slices' triples; the InstanceNorm backward with each plane's x
and dy on chip.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _plan
from ._launch import (
    _SEGMENT,
    _Call,
)
from ._strided import (
    _bwd_finalize,
)


def _segment_launch(
    call: _Call,
    plan: _plan.SegmentPlan,
    num_segments: int,
    like: Any,
    kernel: str,
    args: tuple,
    trailing: tuple = (),
) -> None:
    """Launch an on-chip segment kernel; a team of CTAs per segment gets its ticket counters
    (zeroed, one per segment plus the start counter) and a buffer for the slices' triples.
    ``trailing``: arguments after the team's (the kernel's last)."""
    tickets = partials = None
    if plan.team > 1:
        tickets = call.bk.zeros_int32(1 + num_segments, like)
        partials = call.stats((num_segments * plan.team * 3,), like)
    call.launch(
        _SEGMENT,
        kernel,
        num_segments * plan.team,
        (call.threads(_SEGMENT, kernel, plan.threads),),
        (
            *args,
            np.int32(plan.team),
            call.ptr(tickets),
            call.ptr(partials),
            np.int32(plan.vectorized),
            *trailing,
        ),
        smem=plan.smem,
    )


def _instance_bwd_on_chip(
    call: _Call,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    N: int,
    C: int,
    S: int,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple | None:
    """InstanceNorm backward with each plane's x and dy held on chip (segment_norm.cu): three
    passes over the tensors instead of five. None when a plane is too long for a team.

    Planned before dx is allocated: a dx made for a plan that then fails would be recorded
    (and allocated by every replay) beside the strided backward's own."""
    plan = _plan.plan_segment(S, call.itemsize, call.aligned(x, dy), call.info, tensors=2)
    if plan is None:
        return None
    dx = call.bk.empty_strided_like(x)
    if plan.vectorized and not call.aligned(dx):  # never: CuPy and torch align blocks to 512 B
        plan = _plan.plan_segment(S, call.itemsize, False, call.info, tensors=2)
        if plan is None:
            return None
    sums = call.stats((N * C * 2,), x)
    tickets = partials = None
    if plan.team > 1:
        tickets = call.bk.zeros_int32(1 + N * C, x)
        partials = call.stats((N * C * plan.team * 2,), x)
    # fmt: off
    threads = call.threads(_SEGMENT, "segment_norm_bwd_instance", plan.threads)
    call.launch(_SEGMENT, "segment_norm_bwd_instance", N * C * plan.team, (threads,), (
        call.ptr(x), call.ptr(dy), call.ptr(weight), call.ptr(mean), call.ptr(rstd), call.ptr(dx),
        call.ptr(sums), np.int32(S), np.int32(plan.slice_len), np.int32(C),
        np.int32(plan.team), call.ptr(tickets), call.ptr(partials), np.int32(plan.vectorized)),
        smem=plan.smem)
    # fmt: on
    need_dw = needs_input_grad[1] and weight is not None
    dweight = call.grads((C,), weight, x) if need_dw else None
    dbias = call.grads((C,), weight, x) if needs_input_grad[2] else None
    if dweight is not None or dbias is not None:  # sums[n, c] -> per-channel, over the batch
        _bwd_finalize(
            call, sums, N, C, 1, rstd, weight, C, 1, 0, 0, False, dweight, dbias, None, None
        )
    return dx, dweight, dbias
