"""The results page's sections of training runs: convergence (scripts/convergence.py) and the
timm sweep (scripts/timm_sweep.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .mdtable import fmt_number, fmt_ratio, md_cell, md_table

if TYPE_CHECKING:
    from .markdown import Results


def convergence_section(results: Results) -> list[str]:
    def joined(values: list, spec: str) -> str:
        return ", ".join(fmt_number(v, spec) for v in values) or "-"

    rows = []
    for source, result in results.convergence:
        if "skipped" in result:
            rows.append([result["model"], "-", "-", "-", "-", "-", "-", "-", "skipped", source])
            continue
        runs = {impl: [r for r in result["runs"] if r["impl"] == impl]
                for impl in ("torch", "cupynorm")}  # fmt: skip
        rows.append(
            [
                result["model"],
                str(result["steps"]),
                result.get("device", "-"),
                joined([r.get("final_loss") for r in runs["torch"]], ".4f"),
                joined([r.get("final_loss") for r in runs["cupynorm"]], ".4f"),
                joined(result.get("inside_fraction", []), ".1%"),
                " / ".join(
                    joined([r.get("steady_ms_per_step") for r in runs[impl]], ".1f")
                    for impl in ("torch", "cupynorm")
                ),
                " / ".join(
                    joined([r.get("wall_s") for r in runs[impl]], ".1f")
                    for impl in ("torch", "cupynorm")
                ),
                "yes" if result.get("converges") else "no",
                source,
            ]
        )
    columns = ("model", "steps", "GPU", "torch final loss", "cupynorm final loss",
               "steps in torch's band", "ms/step torch / cupynorm", "wall s torch / cupynorm",
               "converges", "file")  # fmt: skip
    return [
        "## Convergence",
        "",
        "`python scripts/convergence.py --out DIR`: each model trained from the same initial "
        "weights on the same batches (bf16 autocast, cuDNN nondeterministic), with torch's norms "
        "twice and cupynorm's once; the band is torch's two runs' spread, at least three "
        "standard errors of the smoothed loss; final loss: the mean of the last 50 steps. "
        "ms/step: steady state (after the warm-up steps); wall s: the whole run, the first "
        "kernel compilations included. The loss curves are the PNGs beside the JSON.",
        "",
        *md_table(columns, rows),
    ]


# what replace_norms' warning names when torch's padded channels_last AvgPool2d backward is wrong
TORCH_POOL_BUG = "pytorch/pytorch#188344"


def timm_section(results: Results) -> list[str]:
    def pair(values: dict[str, float], spec: str) -> str:
        torch_value, ours = values.get("torch"), values.get("cupynorm")
        if torch_value is None or ours is None:
            return "-"
        return f"{torch_value:{spec}} / {ours:{spec}} ({fmt_ratio(torch_value / ours)})"

    lines = [
        "## timm: one model per family",
        "",
        "`python scripts/timm_sweep.py --json FILE`: each model converted by `fuse`, its fp32 "
        "output, input gradient and worst parameter gradient checked against torch in float64 "
        "(batch 4, channels_last, TF32 off; ok: cupynorm within 2x torch's error + 1e-6), and "
        "its training step timed (batch 32, bf16 autocast, channels_last, SGD; ms torch / "
        "cupynorm, vs torch) eager and captured whole in a CUDA graph. The eager ratio carries "
        "the host's noise: families that convert nothing (the same model twice) spread "
        "0.83-1.23x eager and 0.99-1.00x graphed (benchmarks/NOTES.md). The PoolFormer failures "
        f"are torch's own: its CUDA AvgPool2d backward is wrong for a padded channels_last input "
        f"({TORCH_POOL_BUG}, torch 2.11), which cupynorm's GroupNorm hands it where torch's "
        "GroupNorm returns NCHW; `replace_norms` warns of it (README, Limits).",
    ]
    for source, data in results.timm:
        env, rows, skipped = data["environment"], [], 0
        for r in data["records"]:
            if r["status"] == "not run (time)":
                skipped += 1
                continue
            left = ", ".join(f"{e['class'].rsplit('.', 1)[-1]} x{e['count']}: {e['reason']}"
                             for e in r["left"]) or "-"  # fmt: skip
            errors = r["errors"]
            worst = " / ".join(fmt_number(errors.get(f"{kind}_cupynorm"), ".1e")
                               for kind in ("out", "dx", "pgrad"))  # fmt: skip
            ok = {True: "yes", False: "**no**"}.get(r["ok"], r["error"] or "-")
            if r["ok"] is False and any(TORCH_POOL_BUG in w for w in r.get("warnings", ())):
                ok += f" (torch's AvgPool2d backward, {TORCH_POOL_BUG})"
            rows.append([f"`{r['model']}`", r["family"], str(r["norm_layers"]),
                         str(r["converted"]), str(r["fused"]), md_cell(left), worst, ok,
                         pair(r["eager_ms"], ".2f"), pair(r["graphed_ms"], ".2f")])  # fmt: skip
        columns = ("model", "family", "norm layers", "converted", "fused", "left (why)",
                   "cupynorm err out / dx / param", "ok", "eager ms", "graphed ms")  # fmt: skip
        setup = (f"{env.get('device_name', '-')}, torch {env.get('torch', '-')}, timm "
                 f"{env.get('timm', '-')}, {env.get('date', '-')} ({source}); conversion: "
                 f"{env.get('conversion', 'fuse')}; errors: mean of "
                 f"{env.get('accuracy_draws', 1)} draw(s); eager: median of "
                 f"{env.get('eager_steps', 15)} steps; {skipped} families not reached in the "
                 "run's time:")  # fmt: skip
        lines += ["", setup, "", *md_table(columns, rows, left=2)]
    return lines
