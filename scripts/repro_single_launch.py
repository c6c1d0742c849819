"""Where the single-launch BatchNorm and the split passes part ways in a small model.

The model of tests/test_torch_modules_gpu.py::test_replace_norms_cuda_same_outputs_and_grads
(SmallCNN, channels_last, fp32, TF32 off): three training steps then three eval steps of SGD, once
with cupynorm's single-launch family on and once off, from the same weights and inputs. Every
norm layer's input gradient is captured by a hook at every step; printed per step and layer:
the largest difference between the two runs relative to the layer's largest gradient, and, for
the single-launch run, the same against a float64 copy of the layer's backward given the very
same inputs (a bug shows there; rounding amplified through the model shows only between runs).

Usage: python scripts/repro_single_launch.py [--device cpu]  (cpu: torch's norms, a dry run)
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]
from small_cnn import SmallCNN  # noqa: E402

import cupynorm.torch as cnt  # noqa: E402
from cupynorm import _single  # noqa: E402


def _torch_class(m) -> type:
    return next(c for c in type(m).__mro__ if c.__module__.startswith("torch.nn"))


def run(model, xs, single: bool):
    """Per step: {layer: (input grad, float64 input grad of the layer given the same inputs)}."""
    _single.enable(single)
    grads: list[dict] = []
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm)):
            saved = {}

            def before(m, args, saved=saved):  # the layer as it is before this forward, in fp64
                saved["x"] = args[0].detach().clone()
                saved["layer"] = copy.deepcopy(m).double()

            def after(m, grad_in, grad_out, name=name, saved=saved):
                with torch.enable_grad():  # hooks run with grad mode off
                    xd = saved["x"].double().requires_grad_()
                    yd = _torch_class(m).forward(saved["layer"], xd)
                    (ref,) = torch.autograd.grad(yd, xd, grad_out[0].double())
                grads[-1][name] = (grad_in[0].detach().clone(), ref)

            hooks.append(m.register_forward_pre_hook(before))
            hooks.append(m.register_full_backward_hook(after))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for train in (True, False):
        model.train(train)
        for x in xs:
            grads.append({})
            x = x.detach().clone().requires_grad_()
            (model(x) ** 2).sum().backward()
            grads[-1]["input"] = (x.grad.clone(), None)  # the model's
            opt.step()
            opt.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return grads


def main() -> None:
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = cnt.replace_norms(SmallCNN().to(device))
    g = torch.Generator().manual_seed(1)
    xs = [
        (torch.randn(4, 3, 7, 9, generator=g, dtype=torch.float64) * 2 + 0.5)
        .to(device, torch.float32)
        .to(memory_format=torch.channels_last)
        for _ in range(3)
    ]
    single = run(copy.deepcopy(model), xs, True)
    split = run(copy.deepcopy(model), xs, False)

    def rel(a, b) -> float:
        return ((a.double() - b.double()).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    for step, (a, b) in enumerate(zip(single, split, strict=True)):
        mode = "train" if step < 3 else "eval"
        for name in a:
            (ga, ra), (gb, rb) = a[name], b[name]
            line = f"step {step} ({mode}) {name:8s} input grad: single vs split {rel(ga, gb):.2e}"
            if ra is not None:
                line += f"; vs float64: single {rel(ga, ra):.2e}, split {rel(gb, rb):.2e}"
            print(line)


if __name__ == "__main__":
    main()
