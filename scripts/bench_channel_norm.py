"""Channel norms over NCHW: the thin-tile forward against the register tiles (issue #38).

One shot, about a minute on an H200 (torch.compile's first compile is most of it):

    python scripts/bench_channel_norm.py    # BENCH_COMPILE=0 skips torch.compile

Times (CUDA events around each call, L2 flushed before each, median of 20 after 3 warm-ups):
  1. KernelBench L1-36, x / sqrt(mean(x^2, dim=1) + eps), fp32 112x64x512x512: cupynorm.torch's
     rms_norm2d with the register tiles and with the thin tiles (the default), each thin kernel
     variant launched directly, torch.compile of the formula; 15.0 GB moved.
  2. LayerNorm2d(96) (eps 1e-6) bf16 NCHW 64x96x56x56 forward: the module both ways, the thin
     variants, torch eager (timm's permute + layer_norm), torch.compile of that.
Every result is checked against torch first. Percent: of 4.22 TB/s (the H200's copy bandwidth);
a copy of the L1-36 tensor is timed too, for this machine's own figure.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _channel, _launch  # noqa: E402
from cupynorm.torch import _policy  # noqa: E402

COPY_TBPS = 4.22
REPS, WARMUP = 20, 3
DEADLINE_S = 100  # optional items (torch.compile of the LayerNorm) are skipped past this
T0 = time.time()
_FLUSH = None


def elapsed() -> float:
    return time.time() - T0


def timed(fn) -> float:
    """Median ms of fn() over REPS calls, the L2 flushed before each."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(WARMUP):
        fn()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(REPS):
        _FLUSH.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def report(label: str, ms: float | None, nbytes: int, note: str = "") -> None:
    if ms is None:
        print(f"  {label:44s} {'-':>9s}   {note}", flush=True)
        return
    pct = nbytes / (ms * 1e-3) / (COPY_TBPS * 1e12) * 100
    print(f"  {label:44s} {ms:9.4f} ms  {pct:5.1f}%  {note}", flush=True)


def check(label: str, got: torch.Tensor, want_fn, chunks: int = 1, tol: float = 1e-5) -> bool:
    """got against want_fn(slice) over the batch in ``chunks`` pieces (bounded temporaries)."""
    worst = 0.0
    ok = True
    for part in torch.arange(got.shape[0], device="cpu").chunk(chunks):
        lo, hi = int(part[0]), int(part[-1]) + 1
        want = want_fn(lo, hi)
        g = got[lo:hi]
        if torch.isnan(g).any():
            ok = False
        err = (g.float() - want.float()).abs()
        bound = tol + tol * want.float().abs()
        ok = ok and bool((err <= bound).all())
        worst = max(worst, err.max().item())
    print(f"  check {label:38s} {'ok' if ok else 'FAILED'} (max abs err {worst:.3g})", flush=True)
    return ok


def thin_variants():
    return [
        ("thin4", dict(cpt=4)),
        ("thin8", dict(cpt=8)),
    ]


def launch_thin(x, weight, bias, eps, rms, **choice):
    """One thin-kernel variant, launched directly (no recorded call): y, and its plan."""
    y = torch.empty_like(x)
    call = _launch._Call(x, weight if weight is not None else bias)
    N, C = x.shape[0], x.shape[1]
    S = x.numel() // (N * C)
    plan = _channel.forward_thin(call, x, y, weight, bias, None, None, C, S, eps, rms, **choice)
    return y, plan


def time_copy(x: torch.Tensor) -> float:
    y = torch.empty_like(x)  # freed on return, before the norms' outputs
    return timed(lambda: y.copy_(x))


def compare_forwards(tag, run, x, w, b, eps, rms, want, nbytes, failures, **check_args):
    """cupynorm's forward both ways (``run``: the public call, register tiles then thin tiles)
    and each thin variant launched directly: each checked against ``want``, then timed."""
    for label, on in ((f"register tiles ({tag})", False), (f"thin tiles ({tag})", None)):
        _channel.enable_thin(on)
        out = run()
        ok = check(label, out, want, **check_args)
        del out  # L1-36's output is 7.5 GB: freed before the next one is made
        if not ok:
            failures.append(label)
        report(label, timed(run), nbytes)
    _channel.enable_thin(None)
    for name, choice in thin_variants():
        out, plan = launch_thin(x, w, b, eps, rms, **choice)
        if plan is None:
            report(name, None, nbytes, "no plan")
            continue
        ok = check(name, out, want, **check_args)
        del out
        if not ok:
            failures.append(f"{tag} {name}")
        note = f"px={plan.px} cy={plan.cy} smem={plan.smem}"
        report(name, timed(lambda c=choice: launch_thin(x, w, b, eps, rms, **c)), nbytes, note)


def kernelbench_36(failures: list) -> None:
    shape, eps = (112, 64, 512, 512), 1e-5
    print(f"\n== KernelBench L1-36: RMS over dim 1, fp32 {shape}", flush=True)
    x = torch.randn(shape, device="cuda")
    nbytes = 2 * x.numel() * 4
    print(
        f"  bytes moved {nbytes / 1e9:.2f} GB, floor {nbytes / COPY_TBPS / 1e9:.3f} ms", flush=True
    )

    def formula(t):
        return t / torch.sqrt(torch.mean(t**2, dim=1, keepdim=True) + eps)

    def want(lo, hi):
        return formula(x[lo:hi])

    report("copy (y.copy_(x))", time_copy(x), nbytes)

    with torch.no_grad():
        compare_forwards("rms_norm2d", lambda: cnt.rms_norm2d(x, eps=eps), x, None, None, eps,
                         True, want, nbytes, failures, chunks=8)  # fmt: skip

        if os.environ.get("BENCH_COMPILE", "1") != "0":
            t = time.time()
            compiled = torch.compile(formula)
            out = compiled(x)
            print(f"  (torch.compile took {time.time() - t:.1f} s)", flush=True)
            if not check("torch.compile", out, want, chunks=8):
                failures.append("L1-36 torch.compile")
            del out
            report("torch.compile of the formula", timed(lambda: compiled(x)), nbytes)
        else:
            report("torch.compile of the formula", None, nbytes, "skipped (BENCH_COMPILE=0)")


def layer_norm2d_96(failures: list) -> None:
    shape, eps = (64, 96, 56, 56), 1e-6
    print(f"\n== LayerNorm2d(96) bf16 NCHW {shape} forward", flush=True)
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    module = cnt.LayerNorm2d(96, eps=eps).cuda().to(torch.bfloat16)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        module.bias.normal_()
    w, b = module.weight, module.bias
    nbytes = 2 * x.numel() * 2
    print(
        f"  bytes moved {nbytes / 1e6:.1f} MB, floor {nbytes / COPY_TBPS / 1e9:.4f} ms", flush=True
    )

    def timm(t):  # timm's LayerNorm2d: permute, layer_norm, permute back
        return F.layer_norm(t.permute(0, 2, 3, 1), (96,), w, b, eps).permute(0, 3, 1, 2)

    expected = timm(x)

    def want(lo, hi):
        return expected[lo:hi]

    with torch.no_grad():
        compare_forwards("LayerNorm2d", lambda: module(x), x, w, b, eps, False, want, nbytes,
                         failures, tol=2e-2)  # fmt: skip
        report("torch eager (permute + layer_norm)", timed(lambda: timm(x)), nbytes)
        if os.environ.get("BENCH_COMPILE", "1") != "0" and elapsed() < DEADLINE_S:
            compiled = torch.compile(timm)
            if not check("torch.compile", compiled(x), want, tol=2e-2):
                failures.append("LN2d torch.compile")
            report("torch.compile (permute + layer_norm)", timed(lambda: compiled(x)), nbytes)
        else:
            report("torch.compile (permute + layer_norm)", None, nbytes, "skipped (time or env)")


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    _policy.set_eager_min_bytes(0)  # every eager call on cupynorm's kernels
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print(
        f"thin defaults: THIN_MAX_C={_channel.THIN_MAX_C} "
        f"THIN_CPT4_MAX_C={_channel.THIN_CPT4_MAX_C}",
        flush=True,
    )
    failures: list = []
    layer_norm2d_96(failures)  # the small one first: its numbers come even if the big one fails
    kernelbench_36(failures)
    print(
        f"\ntotal {elapsed():.1f} s; "
        + ("all checks ok" if not failures else f"FAILED: {', '.join(failures)}"),
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
