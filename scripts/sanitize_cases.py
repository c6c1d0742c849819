"""Small calls that run every kernel and code path once, for compute-sanitizer.

Run through scripts/sanitize.sh (memcheck, racecheck, synccheck). Each case is small, so the
instrumented run stays short; the checks are in the sanitizer's report, and the script asserts
that results match torch so a silent wrong answer fails too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupynorm  # noqa: E402
from cupynorm import _channel, _ops, _single  # noqa: E402


def close(a, b, tol=1e-4):
    err = (a.double() - b.double()).abs().max().item()
    assert err < tol, err


def main() -> None:
    for dtype in (torch.float32, torch.float16):
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        for shape, groups in (
            ((3, 6, 5, 7), 3),
            ((2, 4, 300, 300), 4),
            ((2, 3, 37, 41), 1),
            ((2, 64, 33, 35), 8),
            ((2, 1032, 5, 3), 8),
        ):
            # one CTA (aligned and unaligned) and a team of CTAs (300 x 300 fp32 = 352 KiB);
            # 64 channels: the columns passes on 16-byte packs (staged statistics); 1032 channels
            # of 15 pixels: the channel tiles dealt over the grid's y dimension
            x = torch.randn(shape, device="cuda", dtype=dtype)
            w = torch.rand(shape[1], device="cuda", dtype=dtype) + 0.5
            close(
                cupynorm.group_norm(x, groups, w), F.group_norm(x.float(), groups, w.float()), tol
            )
            xl = x.to(memory_format=torch.channels_last)  # columns: stats, finalize, apply
            close(
                cupynorm.group_norm(xl, groups, w), F.group_norm(x.float(), groups, w.float()), tol
            )
            close(
                cupynorm.batch_norm(xl, None, None, w, None, training=True),
                F.batch_norm(x.float(), None, None, w.float(), None, training=True),
                tol,
            )
            close(
                cupynorm.batch_norm(x, None, None, w, None, training=True),  # rows
                F.batch_norm(x.float(), None, None, w.float(), None, training=True),
                tol,
            )
            # running statistics updated by the finalize kernel; eval statistics from a kernel
            rm = torch.zeros(shape[1], device="cuda", dtype=dtype)
            rv = torch.ones(shape[1], device="cuda", dtype=dtype)
            for inp in (x, xl):
                cupynorm.batch_norm(inp, rm, rv, w, None, training=True)
                cupynorm.batch_norm(inp, rm, rv, w, None, training=False)
            dy = torch.randn_like(x)
            _, m, r = _ops.group_norm_fwd(x, shape[1], w, None, 1e-5)  # instance norm
            _ops.group_norm_bwd(dy, x, m, r, w, shape[1], (True, True, True))  # on chip
            for inp in (x, xl):
                _, m, r = _ops.group_norm_fwd(inp, groups, w, None, 1e-5)
                _ops.group_norm_bwd(dy, inp, m, r, w, groups, (True, True, True))
                _, m, r = _ops.batch_norm_fwd(inp, w, None, None, None, True, 0.1, 1e-5)
                _ops.batch_norm_bwd(dy, inp, m, r, w, True, (True, True, True))
            # channels_last BatchNorm: the single launch (off by default) and the split passes, with
            # running statistics, without dx, and in eval
            dyl = dy.to(memory_format=torch.channels_last)
            default = _single.enabled
            for single in (True, False):
                _single.enable(single)
                _, m, r = _ops.batch_norm_fwd(xl, w, w, rm, rv, True, 0.1, 1e-5)
                # the updated statistics into new buffers (the functional op's form)
                new = torch.empty_like(rm), torch.empty_like(rv)
                _ops.batch_norm_fwd(xl, w, w, rm, rv, True, 0.1, 1e-5, None, "identity", None,
                                    False, *new)  # fmt: skip
                _ops.batch_norm_bwd(dyl, xl, m, r, w, True, (True, True, True))
                _ops.batch_norm_bwd(dyl, xl, m, r, None, True, (False, True, True))
                _ops.batch_norm_bwd(dyl, xl, m, r, w, False, (True, False, True))
            _single.enable(default)
        # GroupNorm + SiLU of x + shift[n, c] (a time embedding): on chip with packs straddling
        # two channels, a team, the columns passes, and the strided rows in runs of one channel
        for shape, groups in (((3, 8, 3, 4), 4), ((2, 4, 300, 300), 2), ((1, 2, 700, 700), 1)):
            x, dy = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
            w = torch.rand(shape[1], device="cuda", dtype=dtype) + 0.5
            shift = torch.randn(shape[:2], device="cuda", dtype=dtype)
            for inp, d in ((x, dy), (x.to(memory_format=torch.channels_last), dy)):
                _, m, r = _ops.group_norm_fwd(inp, groups, w, w, 1e-5, shift, act="silu")
                _ops.group_norm_act_bwd(d, inp, m, r, w, w, groups, (True,) * 3, "silu", shift)
                if dtype == torch.float16:  # float32 y / dy beside the half input (autocast)
                    wf = w.float()
                    y, m, r = _ops.group_norm_fwd(inp, groups, wf, wf, 1e-5, shift, act="silu",
                                                  out_dtype="float32")  # fmt: skip
                    ref = F.group_norm(inp.float() + shift.float()[..., None, None], groups, wf, wf)
                    close(y, F.silu(ref), 1e-4)
                    df = d.float()
                    _ops.group_norm_act_bwd(df, inp, m, r, wf, wf, groups, (True,) * 3, "silu",
                                            shift)  # fmt: skip
                    _, m, r = _ops.group_norm_fwd(inp, groups, wf, None, 1e-5, out_dtype="float32")
                    _ops.group_norm_bwd(df, inp, m, r, wf, groups, (True, True, True))
        # the split path: one segment longer than a team holds (GroupNorm(1) of 8 x 512 x 512)
        x = torch.randn(1, 8, 512, 512, device="cuda", dtype=dtype)
        close(cupynorm.group_norm(x, 1), F.group_norm(x.float(), 1), tol * 3)
        # the fused epilogue, forward and backward, aligned and not
        for shape in ((64, 8192), (7, 13)):
            a, b = (torch.rand(shape, device="cuda", dtype=dtype) for _ in range(2))
            out, m, r = _ops.row_norm_add_mul_fwd(a, b, 1e-5)
            close(out, (F.layer_norm(a.float(), shape[-1:]) + b.float()) * b.float(), tol * 3)
            _ops.row_norm_add_mul_bwd(torch.rand_like(a), a, b, m, r)
        # LayerNorm / RMSNorm: the forward and the one-pass backward in registers (whole packs,
        # several rows per CTA, a partial warp; four packs per thread), the segment passes
        # (unaligned rows), and the short-row kernels (a group of lanes per row; rows walked
        # grid-stride, idle groups), and rows longer than a team (the strided statistics, the
        # tile passes walked tile-major; whole packs and not)
        long_rows = ((3, (1 << 20) + 8), (2, 1_100_001))
        for shape in (
            (600, 776),
            (40, 4104),
            (9, 1001),
            (9001, 96),
            (77, 8),
            (33, 1024),
            *long_rows,
        ):
            x, dy = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
            w = torch.rand(shape[-1], device="cuda", dtype=dtype)
            for rms in (False, True):
                y, _, m, r = _ops.row_norm_fwd(x, None, w, None if rms else w, shape[-1], 1e-5, rms)
                ref = (
                    F.rms_norm(x.float(), shape[-1:], w.float())
                    if rms
                    else F.layer_norm(x.float(), shape[-1:], w.float(), w.float())
                )
                close(y, ref, tol * 3)
                _ops.row_norm_bwd(dy, None, x, m, r, w, shape[-1], (True, True, not rms))
                _ops.row_norm_bwd(dy, x, x, m, r, None, shape[-1], (True, False, False))
                # the residual add: the sum written, then normalized
                y, total, _, _ = _ops.row_norm_fwd(x, dy, w, None, shape[-1], 1e-5, rms)
                close(total, x + dy, tol)
            if dtype in (torch.float16, torch.bfloat16):  # float32 y / dy (autocast): short
                # rows in one pass, others through the float32 copies
                wf = w.float()
                y, _, m, r = _ops.row_norm_fwd(x, None, wf, wf, shape[-1], 1e-5, False,
                                               out_dtype="float32")  # fmt: skip
                close(y, F.layer_norm(x.float(), shape[-1:], wf, wf), 1e-4)
                _ops.row_norm_bwd(dy.float(), None, x, m, r, wf, shape[-1], (True, True, True))
        # channel norms of NCHW tensors: thin tiles (one warp, several warps with shared sums,
        # scalar loads on an odd pixel count) and the wide forward; then the default restored
        for thin in (True, False):
            _channel.enable_thin(thin)
            for shape in ((2, 3, 5, 8), (2, 96, 7, 16), (3, 130, 3, 5), (1, 256, 64, 64)):
                x = torch.randn(shape, device="cuda", dtype=dtype)
                w = torch.rand(shape[1], device="cuda", dtype=dtype) + 0.5
                ref = F.layer_norm(x.float().movedim(1, -1), shape[1:2], w.float(), w.float())
                close(cupynorm.layer_norm2d(x, w, w), ref.movedim(-1, 1), tol * 3)
                ms = x.float().pow(2).mean(1, keepdim=True)
                ref = x.float() * torch.rsqrt(ms + 1e-6) * w.float()[:, None, None]
                close(cupynorm.rms_norm2d(x, w, 1e-6), ref, tol * 3)
        _channel.enable_thin(None)
        # BatchNorm + residual add + ReLU on channels_last, few rows of many channels (tiles)
        x, z, dy = (
            torch.randn(4, 2048, 7, 7, device="cuda", dtype=dtype).to(
                memory_format=torch.channels_last
            )
            for _ in range(3)
        )
        w, b = torch.rand(2048, device="cuda") + 0.5, torch.randn(2048, device="cuda")
        y, m, r, mask = _ops.batch_norm_fwd(x, w, b, None, None, True, 0.1, 1e-5, z, "relu", None,
                                            True)  # fmt: skip
        ref = F.relu(F.batch_norm(x.float(), None, None, w, b, True) + z.float())
        close(y, ref, tol * 3)
        _ops.batch_norm_act_bwd(dy, x, m, r, w, True, (True, True, True, True), z, b, "relu")
        # the ReLU mask in the residual's place (16-bit types: packs of 8), dy aligned and not
        if mask is not None:
            needs = (True, True, True, True)
            _ops.batch_norm_act_bwd(dy, x, m, r, w, True, needs, None, b, "relu", mask)
            off = torch.empty(dy.numel() + 1, device="cuda", dtype=dtype)[1:]
            off = off.as_strided(dy.shape, dy.stride()).copy_(dy)
            _ops.batch_norm_act_bwd(off, x, m, r, w, True, needs, None, b, "relu", mask)
        # SyncBatchNorm's steps around its collectives, for 3 "ranks" in one process (the sum of
        # their rows is the all_reduce): rank 1 empty; merged statistics against the whole batch
        parts = [torch.randn(n, 5, 3, 4, device="cuda", dtype=dtype) for n in (2, 0, 3)]
        rows = sum(_ops.sync_batch_norm_rows(t, i, 3)[0] for i, t in enumerate(parts))
        rm, rv = torch.zeros(5, device="cuda"), torch.ones(5, device="cuda")
        w, b = torch.rand(5, device="cuda"), torch.rand(5, device="cuda")
        for x in parts[:2]:  # the merge and apply of a rank with values and of an empty one
            y, mean, rstd, count = _ops.sync_batch_norm_merge_apply(
                x, rows, w, b, rm, rv, 1e-5, 0.1
            )
        whole = torch.cat(parts).float()
        var, ref_mean = torch.var_mean(whole, dim=(0, 2, 3), correction=0)
        close(mean, ref_mean)
        close(rstd, torch.rsqrt(var + 1e-5), 1e-3)
        assert count.item() == whole.numel() // 5
        ref = F.batch_norm(whole, None, None, w, b, True)[: parts[0].shape[0]]
        close(
            _ops.sync_batch_norm_merge_apply(parts[0], rows, w, b, None, None, 1e-5, 0.1)[0],
            ref,
            tol * 3,
        )
        totals = torch.randn(2, 5, device="cuda")
        _ops.sync_batch_norm_bwd_dx(
            torch.randn_like(parts[2]), parts[2], mean, rstd, w, totals, count
        )
    torch.cuda.synchronize()
    print("sanitize cases: all results match torch")


if __name__ == "__main__":
    main()
