"""Framework-neutral host code: the entry of each op, which picks a kernel family and runs it.

One module per norm family, mirroring ``cuda_src/``:
  group_norm.py       GroupNorm / InstanceNorm forward (+ activation, + shift) and backward
  batch_norm.py       BatchNorm forward (+ residual / activation epilogue) and backward
  sync_batch_norm.py  SyncBatchNorm's rank-local steps around the collectives
  row_norm.py         LayerNorm / RMSNorm over the last dims (+ residual add, Llama cast) and the
                      seed-002 tail row_norm_add_mul
  channel_norm.py     LayerNorm / RMSNorm over dim 1 (NCHW: channel_norm.cu; channels_last: rows)
  _common.py          helpers several families share
An entry (a recorded call, :mod:`.._program`; the channel norms route to such calls) picks the
kernel family, allocates and hands down to the families' host code (:mod:`.._segment`,
:mod:`.._strided`, :mod:`.._single`, :mod:`.._channel`), over :mod:`.._plan` and
:mod:`.._launch`. Imports run only downward; channel_norm is built on row_norm.

Arguments are CuPy arrays or torch CUDA tensors (all of one kind per call), already validated by
the public layer. Outputs are allocated by the caller's framework and kernels run on that
framework's current stream. Statistics are float32 (float64 for float64 inputs). See
docs/internal-api.md for the contract.
"""

from .batch_norm import batch_norm_act_bwd, batch_norm_bwd, batch_norm_fwd
from .channel_norm import channel_norm_bwd, channel_norm_fwd, takes_rows, to_channels
from .group_norm import group_norm_act_bwd, group_norm_bwd, group_norm_fwd
from .row_norm import row_norm_add_mul_bwd, row_norm_add_mul_fwd, row_norm_bwd, row_norm_fwd
from .sync_batch_norm import (
    batch_norm_bwd_sums,
    sync_batch_norm_bwd_dx,
    sync_batch_norm_merge_apply,
    sync_batch_norm_rows,
)

__all__ = [
    "batch_norm_act_bwd",
    "batch_norm_bwd",
    "batch_norm_bwd_sums",
    "batch_norm_fwd",
    "channel_norm_bwd",
    "channel_norm_fwd",
    "group_norm_act_bwd",
    "group_norm_bwd",
    "group_norm_fwd",
    "row_norm_add_mul_bwd",
    "row_norm_add_mul_fwd",
    "row_norm_bwd",
    "row_norm_fwd",
    "sync_batch_norm_bwd_dx",
    "sync_batch_norm_merge_apply",
    "sync_batch_norm_rows",
    "takes_rows",
    "to_channels",
]
