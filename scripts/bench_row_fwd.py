"""The row forward of rows of 129 to 1024 packs: a CTA per row in registers (row_norm_fwd_cta_*)
against one CTA per row staged through shared memory (segment_norm_fwd_*) (issue #38).

One shot, about two minutes on an H200 (torch.compile's compiles are most of it):

    python scripts/bench_row_fwd.py    # BENCH_COMPILE=0 skips torch.compile

LayerNorm, RMSNorm, residual add + RMSNorm and Hugging Face's LlamaRMSNorm (the cast) forwards
with ``_plan.ROW_FWD_CTA`` off and on, torch eager and torch.compile of the same beside. Times:
CUDA events around each call, L2 flushed before each, median of 30 after 3 warm-ups
(``cupynorm.bench.timing.time_cuda_ms``). Both kernels' outputs are checked against torch's
(max |error| printed; the bound: 2x torch's own error against float64 plus one rounding of the
output dtype). Percent: of 4.22 TB/s (the H200's
copy bandwidth) for x read and y written (with the residual also it read and the sum written).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _plan, _program  # noqa: E402
from cupynorm.bench.timing import time_cuda_ms  # noqa: E402

COPY_TBPS = 4.22
REPS, WARMUP = 30, 3
COMPILE = os.environ.get("BENCH_COMPILE", "1") != "0"
_FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")


def timed(fn) -> float:
    """Median ms of fn() over REPS calls, the L2 flushed before each (the bench's method)."""
    return statistics.median(time_cuda_ms(fn, reps=REPS, warmup=WARMUP, flush_buffer=_FLUSH))


def torch_norm(kind, x, r, w, b, width):
    """torch's own forward of ``kind`` (the float64 reference when given float64 tensors)."""
    if kind == "layer":
        return (F.layer_norm(x, (width,), w, b),)
    if kind == "llama":
        xf = x.float() if x.dtype != torch.float64 else x
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (w * normed.to(x.dtype),)
    s = x + r if kind == "add_rms" else x
    y = F.rms_norm(s, (width,), w, 1e-6)
    return (y, s) if kind == "add_rms" else (y,)


def main() -> int:
    torch.manual_seed(0)
    cnt.set_eager_min_bytes(0)
    cnt.set_eager_adaptive(False)
    print("| norm | rows x width | dtype | eager ms | compile ms | shared memory ms | registers ms "
          "| best % of copy | max error: torch / shared / registers |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    failed = 0
    bf16, fp32 = torch.bfloat16, torch.float32
    shapes = ((8192, 4096, bf16), (4096, 8192, bf16), (16384, 2048, bf16), (32768, 1536, bf16),
              (8192, 4096, fp32), (16384, 768, fp32), (4096, 1032, bf16))  # fmt: skip
    if os.environ.get("BENCH_SHAPES"):
        shapes = shapes[: int(os.environ["BENCH_SHAPES"])]
    for rows, width, dtype in shapes:
        for kind in ("layer", "rms", "add_rms", "llama"):
            x = torch.randn(rows, width, device="cuda", dtype=dtype)
            r = torch.randn_like(x)
            w = 1 + 0.1 * torch.randn(width, device="cuda", dtype=dtype)
            b = 0.1 * torch.randn(width, device="cuda", dtype=dtype)
            exact = torch_norm(kind, x.double(), r.double(), w.double(), b.double(), width)

            def ours(kind=kind, x=x, r=r, w=w, b=b, width=width):
                if kind == "layer":
                    return (cnt.functional.layer_norm(x, (width,), w, b),)
                if kind == "rms":
                    return (cnt.functional.rms_norm(x, (width,), w, 1e-6),)
                if kind == "llama":
                    return (cnt.functional.llama_rms_norm(x, w, 1e-6),)
                return cnt.functional.add_rms_norm(x, r, (width,), w, 1e-6)

            def theirs(kind=kind, x=x, r=r, w=w, b=b, width=width):
                return torch_norm(kind, x, r, w, b, width)

            eager = timed(theirs)
            compiled = timed(torch.compile(theirs)) if COMPILE else None
            times, errors = {}, {}
            for cta in (False, True):
                _plan.ROW_FWD_CTA = cta
                _program._PROGRAMS.clear()
                got = ours()
                errors[cta] = max(
                    (o.double() - e).abs().max().item() for o, e in zip(got, exact, strict=True)
                )
                times[cta] = timed(ours)
            torch_error = max(
                (o.double() - e).abs().max().item()
                for o, e in zip(theirs(), exact, strict=True)
            )  # fmt: skip
            bound = 2 * torch_error + torch.finfo(dtype).eps * max(
                e.abs().max().item() for e in exact
            )
            if errors[True] > bound:
                failed += 1
                where = f"{kind} {rows}x{width} {dtype}"
                print(f"ERROR {where}: {errors[True]:.3g} > {bound:.3g}", file=sys.stderr)
            passes = 4 if kind == "add_rms" else 2
            floor_ms = passes * x.numel() * x.element_size() / (COPY_TBPS * 1e9)
            pct = 100 * floor_ms / min(times.values())
            compiled_ms = "-" if compiled is None else f"{compiled:.4f}"
            print(f"| {kind} | {rows}x{width} | {str(dtype)[6:]} | {eager:.4f} | {compiled_ms} | "
                  f"{times[False]:.4f} | {times[True]:.4f} | {pct:.0f}% | "
                  f"{torch_error:.2g} / {errors[False]:.2g} / {errors[True]:.2g} |")  # fmt: skip
            torch._dynamo.reset()
    _plan.ROW_FWD_CTA = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
