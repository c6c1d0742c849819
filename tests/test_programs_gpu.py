"""Recorded calls on the GPU: what a replayed training step costs in allocations and launches.

The host time of a call after the first is its replay (cupynorm._program), and on a GPU each
torch allocation and each launch costs a few microseconds of it (benchmarks/RESULTS.md). These
pin the counts of a BatchNorm training step as resnet50 runs it, so a change that adds one shows
here; the conftest fixture checks every replay against its recorded call bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from conftest import cuda_available

from cupynorm import _compile, _ops, _single

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]


def _allocations() -> int:
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def _count(call, monkeypatch) -> tuple[int, int, object]:
    """(allocations, launches, result) of one call."""
    launches = []

    def counting(original):
        def launch(self, *args):
            launches.append(self)
            return original(self, *args)

        return launch

    with monkeypatch.context() as patch:
        for cls in (_compile.Launcher, _compile.Memset):  # kernels and the counter's memset
            patch.setattr(cls, "launch", counting(cls.launch))
        before = _allocations()
        result = call()
        allocated = _allocations() - before
    return allocated, len(launches), result


@pytest.mark.parametrize("single_launch", [True, False], ids=["single-launch", "split"])
def test_replayed_batch_norm_training_step_allocates_outputs_and_one_workspace(
    monkeypatch, request, single_launch
):
    request.addfinalizer(lambda default=_single.enabled: _single.enable(default))
    _single.enable(single_launch)
    x = torch.randn(8, 64, 14, 14, device="cuda", dtype=torch.bfloat16)
    x = x.to(memory_format=torch.channels_last)
    w, b = torch.rand(64, device="cuda") + 0.5, torch.rand(64, device="cuda")
    rm, rv = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")
    dy = torch.randn_like(x)

    def forward():
        return _ops.batch_norm_fwd(x, w, b, rm, rv, True, 0.1, 1e-5)

    def backward(mean, rstd):
        return _ops.batch_norm_bwd(dy, x, mean, rstd, w, True, (True, True, True))

    forward()  # recorded
    allocated, launched, (y, mean, rstd) = _count(forward, monkeypatch)
    # y, mean, rstd and the single launch's workspace (partials, barrier counter), its memset
    # and launch; or y (which holds the split passes' partials until the apply pass writes it),
    # mean, rstd and three launches
    assert (allocated, launched) == ((4, 2) if single_launch else (3, 3))
    assert y.stride() == x.stride()
    backward(mean, rstd)  # recorded (and replayed once by the conftest check)
    allocated, launched, (dx, dw, db) = _count(lambda: backward(mean, rstd), monkeypatch)
    # dx, dweight, dbias, one workspace; memset and launch, or sums, finalize, dx
    assert (allocated, launched) == ((4, 2) if single_launch else (4, 3))
    ref_x = x.detach().float().requires_grad_()
    ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    ref = torch.nn.functional.batch_norm(ref_x, None, None, ref_w, ref_b, True, 0.1, 1e-5)
    ref.backward(dy.float())
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dx.float(), ref_x.grad, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(dw, ref_w.grad, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(db, ref_b.grad, atol=1e-2, rtol=1e-3)
