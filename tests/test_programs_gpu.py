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


# ---- replayed eager calls (cupynorm.torch._replay) -------------------------------------------
def _module_step(module, x, dy, residual=None):
    """(node name, y, grads, buffers) of one forward + backward of ``module``."""
    x = x.detach().requires_grad_()
    inputs = (x,) if residual is None else (x, residual.detach().requires_grad_())
    y = module(*inputs)
    y.backward(dy)
    grads = [t.grad for t in inputs] + [p.grad for p in module.parameters()]
    return type(y.grad_fn).__name__, y, grads, [b.clone() for b in module.buffers()]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", ["bn", "relu", "add_relu", "silu", "add"])
def test_replayed_module_step_is_the_full_paths_bit_for_bit(form, dtype, layout, training):
    """A module's second call with a key replays the first call's program through a Function of
    its own (cupynorm.torch._replay): output, every gradient, the running statistics and the
    batch counter equal the full path's bit for bit (fp32 parameters beside half inputs, as
    under autocast; odd sizes; 24 channels: packs of 8 for the ReLU mask)."""
    import copy

    import cupynorm.torch as cnt
    from cupynorm import _program

    torch.manual_seed(0)
    if form == "bn":
        module = cnt.BatchNorm2d(24)
    else:
        module = cnt.BatchNormAct2d(24, activation="identity" if form == "add" else form[-4:])
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
        module.bias.uniform_(-0.5, 0.5)
        module.running_mean.uniform_(-0.5, 0.5)
    module = module.cuda().train(training)
    fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
    x, dy, z = (
        torch.randn(6, 24, 7, 9, device="cuda", dtype=dtype).to(memory_format=fmt) for _ in range(3)
    )
    residual = z if form.startswith("add") else None
    full, replayed = module, copy.deepcopy(module)
    _program._PROGRAMS.clear()  # the first call below takes the full path
    first = _module_step(full, x, dy, residual)
    second = _module_step(replayed, x, dy, residual)
    assert first[0] != "_ReplayFunctionBackward"
    assert second[0] == "_ReplayFunctionBackward"
    assert torch.equal(first[1], second[1])
    assert first[1].stride() == second[1].stride()
    for a, b in zip(first[2] + first[3], second[2] + second[3], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.stride() == b.stride()
            assert torch.equal(a, b)
    # the no-grad call: a key of its own, replayed the same way
    inputs = (x,) if residual is None else (x, residual)
    nograd = [copy.deepcopy(replayed) for _ in range(2)]
    _program._PROGRAMS.clear()
    with torch.no_grad():
        outputs = [m(*inputs) for m in nograd]  # the full path, then the replay
    assert torch.equal(outputs[0], outputs[1])
    for a, b in zip(nograd[0].buffers(), nograd[1].buffers(), strict=True):
        assert torch.equal(a, b)


def test_replay_leaves_a_tensor_on_another_device_to_the_full_paths_error():
    """The devices are not in the call key: a buffer moved to the CPU after the call was
    replayed gets the full path's error, the same as on a first call."""
    import cupynorm.torch as cnt
    from cupynorm import _program

    module = cnt.BatchNorm2d(8).cuda()
    x = torch.randn(2, 8, 5, 5, device="cuda", requires_grad=True)
    for _ in range(2):
        module(x).sum().backward()
    assert type(module(x).grad_fn).__name__ == "_ReplayFunctionBackward"
    module.running_var = module.running_var.cpu()  # same dtype, shape, stride, alignment
    errors = []
    for clear in (False, True):
        if clear:
            _program._PROGRAMS.clear()
        with pytest.raises(Exception) as error:
            module(x)
        errors.append((type(error.value), str(error.value)))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_replayed_step_with_frozen_parameters_and_a_retained_graph(training):
    """Frozen weight and bias (a fine-tuned or detection backbone): the replay computes only the
    input gradient, as the full path; a retained graph's second backward (the bound program was
    dropped by the first) gives the same gradient again."""
    import copy

    import cupynorm.torch as cnt
    from cupynorm import _program

    torch.manual_seed(0)
    module = cnt.BatchNormAct2d(32).cuda().train(training)
    module.requires_grad_(False)
    x, dy, z = (
        torch.randn(4, 32, 9, 7, device="cuda", dtype=torch.bfloat16).to(
            memory_format=torch.channels_last
        )
        for _ in range(3)
    )
    full, replayed = module, copy.deepcopy(module)
    _program._PROGRAMS.clear()
    grads = []
    for m in (full, replayed):
        xg = x.detach().requires_grad_()
        y = m(xg, z)
        assert m.weight.grad is None
        (dx,) = torch.autograd.grad(y, xg, dy, retain_graph=True)
        (again,) = torch.autograd.grad(y, xg, dy)
        assert torch.equal(dx, again)
        grads.append((type(y.grad_fn).__name__, y, dx))
    assert grads[1][0] == "_ReplayFunctionBackward" != grads[0][0]
    assert torch.equal(grads[0][1], grads[1][1]) and torch.equal(grads[0][2], grads[1][2])


def _norm_calls(dtype):
    """name -> maker of (callable, input, extra tensor arguments) on the GPU: group and row
    norm calls through the modules and the functional API, odd sizes, parameters in float32
    (beside half inputs, as a model under autocast holds them) or the input's dtype."""
    import cupynorm.torch as cnt

    def rand(*shape, fmt=torch.contiguous_format):
        return torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)

    def params(module):
        with torch.no_grad():
            for p in module.parameters():
                p.uniform_(0.5, 1.5)
        return module.cuda()

    def add(fn, *args):  # a functional row norm with a residual, its weight made once
        weight = torch.rand(100, device="cuda", dtype=dtype) + 0.5
        return lambda x, r: fn(x, r, 100, weight, *args)

    cl = torch.channels_last
    return {
        "group_norm": lambda: (params(cnt.GroupNorm(4, 24)).to(dtype), rand(6, 24, 7, 9), []),
        "group_norm-cl-fp32-params": lambda: (
            params(cnt.GroupNorm(4, 24)),
            rand(6, 24, 7, 9, fmt=cl),
            [],
        ),
        "group_norm_act-shift": lambda: (
            params(cnt.GroupNormAct(4, 24)).to(dtype),
            rand(6, 24, 7, 9),
            [rand(6, 24)],
        ),
        "group_norm_act-cl": lambda: (
            params(cnt.GroupNormAct(8, 24, activation="relu")).to(dtype),
            rand(6, 24, 7, 9, fmt=cl),
            [],
        ),
        "layer_norm": lambda: (params(cnt.LayerNorm(100)).to(dtype), rand(6, 5, 100), []),
        "layer_norm-2-dims-fp32-params": lambda: (
            params(cnt.LayerNorm((5, 100))),
            rand(6, 5, 100),
            [],
        ),
        "layer_norm-long-rows": lambda: (params(cnt.LayerNorm(9000)).to(dtype), rand(3, 9000), []),
        "rms_norm": lambda: (params(cnt.RMSNorm(100)).to(dtype), rand(6, 5, 100), []),
        "llama_rms_norm": lambda: (params(cnt.LlamaRMSNorm(100)).to(dtype), rand(6, 5, 100), []),
        "llama_rms_norm-fp32-weight": lambda: (
            params(cnt.LlamaRMSNorm(100)),
            rand(6, 5, 100),
            [],
        ),
        "layer_norm2d-cl": lambda: (
            params(cnt.LayerNorm2d(24)).to(dtype),
            rand(6, 24, 7, 9, fmt=cl),
            [],
        ),
        "layer_norm2d-nchw": lambda: (
            params(cnt.LayerNorm2d(24)).to(dtype),
            rand(6, 24, 7, 9),
            [],
        ),
        "rms_norm2d-cl-fp32-params": lambda: (
            params(cnt.RMSNorm2d(24)),
            rand(6, 24, 7, 9, fmt=cl),
            [],
        ),
        "add_layer_norm": lambda: (
            add(cnt.add_layer_norm, None),
            rand(6, 5, 100),
            [rand(6, 5, 100)],
        ),
        "add_rms_norm": lambda: (
            add(cnt.add_rms_norm),
            rand(6, 5, 100),
            [rand(6, 5, 100)],
        ),
    }


def _norm_step(fn, x, extra, dys):
    """(node name, outputs, gradients of the inputs and parameters) of one forward + backward."""
    inputs = [t.detach().requires_grad_() for t in (x, *extra)]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, dys[: len(outs)])
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    return _replayed(outs[0].grad_fn), outs, [t.grad for t in (*inputs, *params)]


def _replayed(node, depth: int = 3) -> bool:
    """Whether a replay Function made the output of ``node`` or of a node just before it
    (a weight multiplied after the kernel, an autocast copy)."""
    if node is None or depth == 0:
        return False
    if type(node).__name__ == "_ReplayFunctionBackward":
        return True
    return any(_replayed(n, depth - 1) for n, _ in node.next_functions)


@pytest.mark.parametrize("autocast", [False, True], ids=["", "autocast"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(_norm_calls(torch.float32)))
def test_replayed_group_and_row_norm_steps_are_the_full_paths_bit_for_bit(case, dtype, autocast):
    """As batch norm's: a group or row norm call replayed (cupynorm.torch._replay) gives the
    full path's outputs and gradients bit for bit, with their strides and dtypes; so does the
    no-grad call. Under autocast (half inputs only) the norms run on float32 copies."""
    import copy

    from cupynorm import _program

    if autocast and dtype == torch.float32:
        pytest.skip("autocast casts half inputs")
    if autocast and "rms_norm" in case and "llama" not in case:
        pytest.skip("rms_norm under autocast is torch's")
    if autocast and case.endswith("nchw"):
        pytest.skip("a channel norm of NCHW half input under autocast runs on a copy: no replay")
    torch.manual_seed(0)
    fn, x, extra = _norm_calls(dtype)[case]()
    dys = [torch.randn_like(x), torch.randn_like(x)]
    full, replayed = fn, copy.deepcopy(fn)
    _program._PROGRAMS.clear()  # the first call below takes the full path
    with torch.autocast("cuda", dtype, enabled=autocast):
        first = _norm_step(full, x, extra, dys)
        second = _norm_step(replayed, x, extra, dys)
    assert not first[0] and second[0]
    for a, b in zip((*first[1], *first[2]), (*second[1], *second[2]), strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a, b)
    _program._PROGRAMS.clear()
    with torch.no_grad(), torch.autocast("cuda", dtype, enabled=autocast):
        outputs = [replayed(x, *extra) for _ in range(2)]  # the full path, then the replay
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in outputs), strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride()


def test_the_bench_table_of_a_calls_kernels() -> None:
    """`bench --json`'s kernel table: every launch of a call, with its kernel's attributes and
    its GPU time found in the profiler."""
    from types import SimpleNamespace

    import cupynorm.torch as cnt
    from cupynorm.bench.run import _launched_kernels

    norm = cnt.GroupNorm(8, 64).cuda()
    x = torch.randn(4, 64, 32, 32, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        return torch.autograd.grad(norm(x), (x, *norm.parameters()), dy)

    previous = cnt.set_eager_min_bytes(0)
    try:
        step()
        kernels = _launched_kernels(step, SimpleNamespace(backward=True))
    finally:
        cnt.set_eager_min_bytes(previous)
    assert len(kernels) >= 2  # forward and backward
    for k in kernels:
        assert k["name"].endswith("<float32>") and k["registers"] > 0, k
        assert k["ctas_per_sm"] >= 1 and 0 < k["occupancy"] <= 1 and k["waves"] > 0, k
        assert k["us"] is not None and k["us"] > 0, k
