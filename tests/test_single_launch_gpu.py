"""The single-launch family on the GPU: BatchNorm training on channels-innermost data in one
cooperative launch per direction (cupynorm._single), against float64 and against the split
passes it replaces, at odd sizes, in every dtype, with running statistics, and model-sized.

| case | expectation |
|---|---|
| bf16 with fp32 parameters, fp16, fp32, fp64 | near float64, no further than the split path |
| C = 5 (scalar path, a partial warp per block) | as above |
| (N, C) input (S = 1), 5-D channels_last_3d | as above |
| running statistics | updated as torch updates them |
| eval-mode backward | dx = dy * rstd * weight, as torch |
| the same input twice | bitwise identical outputs and gradients |
| a resnet50 layer at batch 32 (12.8 MB bf16) | as above; one launch per direction |
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cuda_available

import cupynorm.torch as cnt
from cupynorm import _compile, _single

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

# shape, dtype, parameter dtype
CASES = [
    ((8, 64, 14, 14), torch.bfloat16, torch.float32),  # a resnet50 layer's form
    ((3, 5, 7, 9), torch.float32, torch.float32),  # C = 5: scalar loads, block 5 x 51
    ((16, 48, 9, 9), torch.float16, torch.float16),
    ((4, 16, 6, 6), torch.float64, torch.float64),
    ((37, 24), torch.float32, torch.float32),  # (N, C): one row per sample
    ((2, 24, 3, 5, 7), torch.bfloat16, torch.bfloat16),  # channels_last_3d
    ((32, 256, 28, 28), torch.bfloat16, torch.float32),  # model-sized
]
TOL = {torch.float32: 1e-4, torch.float64: 1e-12, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def single_launches(monkeypatch):
    """The family on (it is off by default: cupynorm._single), and the single-launch kernels
    launched (cooperative launches) counted."""
    default = _single.enabled
    _single.enable(True)
    count = []
    original = _compile.Launcher.launch

    def launch(self, *args):
        if self.cooperative:
            count.append(1)
        return original(self, *args)

    monkeypatch.setattr(_compile.Launcher, "launch", launch)
    yield count
    _single.enable(default)


def _channels_last(x):
    if x.ndim == 4:
        return x.to(memory_format=torch.channels_last)
    if x.ndim == 5:
        return x.to(memory_format=torch.channels_last_3d)
    return x


def _run(x, dy, w, b, rm, rv, training=True):
    x = x.detach().requires_grad_()
    w, b = w.detach().requires_grad_(), b.detach().requires_grad_()
    y = cnt.batch_norm(x, rm, rv, w, b, training=training, momentum=0.1, eps=1e-5)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def _err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _inputs(shape, dtype, pdtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    c = shape[1]
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + 3).to(dtype)  # offset data
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
    w = (torch.rand(c, device="cuda", generator=g) + 0.5).to(pdtype)
    b = torch.randn(c, device="cuda", generator=g).to(pdtype)
    return _channels_last(x), _channels_last(dy), w, b


@pytest.mark.parametrize("shape,dtype,pdtype", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_single_launch_matches_float64_and_the_split_passes(shape, dtype, pdtype, single_launches):
    x, dy, w, b = _inputs(shape, dtype, pdtype)
    c = shape[1]
    results = {}
    for single in (True, False):
        _single.enable(single)  # the fixture restores the default
        rm, rv = (
            torch.zeros(c, device="cuda", dtype=pdtype),
            torch.ones(c, device="cuda", dtype=pdtype),
        )
        before = len(single_launches)
        results[single] = (*_run(x, dy, w, b, rm, rv), rm, rv)
        # forward and backward (the conftest check replays a recorded call once more)
        launched = len(single_launches) - before
        assert launched >= 2 if single else launched == 0
    xd, dyd = x.double().requires_grad_(), dy.double()
    wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
    rmd, rvd = torch.zeros(c, device="cuda", dtype=torch.float64), torch.ones_like(wd.detach())
    yd = F.batch_norm(xd, rmd, rvd, wd, bd, True, 0.1, 1e-5)
    yd.backward(dyd)
    reference = (yd.detach(), xd.grad, wd.grad, bd.grad, rmd, rvd)
    names = ("y", "dx", "dweight", "dbias", "running_mean", "running_var")
    for name, single, split, ref in zip(
        names, results[True], results[False], reference, strict=True
    ):
        tol = TOL[dtype] if name in ("y", "dx") else max(TOL[dtype], TOL[pdtype])
        e_single, e_split = _err(single, ref), _err(split, ref)
        assert e_single <= tol, (name, e_single, tol)
        assert e_single <= 2 * e_split + tol / 10, (name, e_single, e_split)


def test_single_launch_eval_backward_and_reproducibility(single_launches):
    x, dy, w, b = _inputs((8, 64, 14, 14), torch.float32, torch.float32, seed=1)
    rm, rv = torch.randn(64, device="cuda"), torch.rand(64, device="cuda") + 0.5
    y, dx, dw, db = _run(x, dy, w, b, rm, rv, training=False)  # eval: the backward is one
    assert single_launches
    xd = x.double().requires_grad_()
    wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
    F.batch_norm(xd, rm.double(), rv.double(), wd, bd, False, 0.1, 1e-5).backward(dy.double())
    assert _err(dx, xd.grad) < 1e-5 and _err(dw, wd.grad) < 1e-5 and _err(db, bd.grad) < 1e-5
    first = _run(x, dy, w, b, None, None)
    again = _run(x, dy, w, b, None, None)
    for a, b_ in zip(first, again, strict=True):
        assert torch.equal(a, b_)


def test_single_launch_under_cuda_graph_capture(single_launches):
    x, dy, w, b = _inputs((8, 64, 14, 14), torch.bfloat16, torch.float32, seed=2)
    rm, rv = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")
    static_x = x.clone().requires_grad_()
    wp, bp = w.clone().requires_grad_(), b.clone().requires_grad_()

    def step():
        y = cnt.batch_norm(static_x, rm, rv, wp, bp, training=True)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # records the calls outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    static_x.grad = wp.grad = bp.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    launched = len(single_launches)
    for seed in (3, 4):
        new_x = _inputs((8, 64, 14, 14), torch.bfloat16, torch.float32, seed=seed)[0]
        with torch.no_grad():
            static_x.copy_(new_x)
            for t in (static_x.grad, wp.grad, bp.grad):
                t.zero_()
        graph.replay()
        y, dx, dw, db = _run(new_x, dy, w, b, None, None)
        torch.cuda.synchronize()
        assert torch.equal(static_y, y) and torch.equal(static_x.grad, dx)
        torch.testing.assert_close(wp.grad, dw, rtol=0, atol=0)
        torch.testing.assert_close(bp.grad, db, rtol=0, atol=0)
    assert len(single_launches) > launched  # the eager runs took the single launch too
