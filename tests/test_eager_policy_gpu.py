"""Small eager calls on torch's own op (cupynorm.torch.set_eager_min_bytes) on the GPU: below a
kind's size an eager call is torch's functional call (outputs, gradients and running statistics
those of torch's module), from that size on it runs cupynorm's kernels -- while the GPU is behind
the host (cupynorm.torch.set_eager_adaptive), torch's op while it keeps up; channels_last
GroupNorm always runs the kernels, a channels_last channel norm follows its row norm's size;
inside a CUDA graph capture the capture size alone decides (cupynorm.torch.set_capture_min_bytes).
The rest of the suite runs with every size on the kernels (conftest); each test here sets the
sizes it needs and restores them.
"""

from __future__ import annotations

import time

import pytest
from conftest import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")]

if cuda_available():
    import torch
    import torch.nn.functional as F

    import cupynorm.torch as cnt


@pytest.fixture
def sizes():
    """Restores the eager sizes the test found."""
    previous = cnt.eager_min_bytes()
    yield cnt.set_eager_min_bytes
    cnt.set_eager_min_bytes(previous)


@pytest.fixture
def adaptive():
    """Restores the adaptive choice the test found; the test sets its own."""
    previous = cnt.set_eager_adaptive(True)
    yield cnt.set_eager_adaptive
    cnt.set_eager_adaptive(previous)


@pytest.fixture
def torch_calls(monkeypatch):
    """Counts the calls of torch.nn.functional's norms (looked up at call time by cupynorm)."""
    counts: dict[str, int] = {}
    for name in ("batch_norm", "group_norm", "layer_norm", "rms_norm"):
        original = getattr(F, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(F, name, spy)
    return counts


# kind, (torch module, cupynorm module, the functional torch runs), input shape, channels_last
CASES = {
    "batch_norm": (
        lambda: (torch.nn.BatchNorm2d(16), cnt.BatchNorm2d(16), "batch_norm"),
        (4, 16, 9, 7),
        True,
    ),
    "batch_norm_act": (
        lambda: (
            torch.nn.Sequential(torch.nn.BatchNorm2d(16), torch.nn.ReLU()),
            cnt.BatchNormAct2d(16),
            "batch_norm",
        ),
        (4, 16, 9, 7),
        True,
    ),
    "group_norm": (
        lambda: (torch.nn.GroupNorm(4, 16), cnt.GroupNorm(4, 16), "group_norm"),
        (4, 16, 9, 7),
        False,
    ),
    "group_norm_act": (
        lambda: (
            torch.nn.Sequential(torch.nn.GroupNorm(4, 16), torch.nn.SiLU()),
            cnt.GroupNormAct(4, 16),
            "group_norm",
        ),
        (4, 16, 9, 7),
        False,
    ),
    "layer_norm": (
        lambda: (torch.nn.LayerNorm(40), cnt.LayerNorm(40), "layer_norm"),
        (6, 5, 40),
        False,
    ),
    "rms_norm": (
        lambda: (torch.nn.RMSNorm(40), cnt.RMSNorm(40), "rms_norm"),
        (6, 5, 40),
        False,
    ),
}


def _norm_of(module):
    """The norm layer of torch's side (a Sequential's first: the norm before its activation)."""
    return module[0] if isinstance(module, torch.nn.Sequential) else module


def _run(module, x):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    dy = torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)
    y.backward(dy)
    grads = [p.grad for p in module.parameters()]
    buffers = [b.clone() for b in module.buffers()]
    return y, x.grad, grads, buffers


def _case(kind: str) -> tuple:
    """One case on the GPU: (torch's module, cupynorm's with the same state, the name of the
    functional torch's side runs, an input)."""
    make, shape, channels_last = CASES[kind]
    reference, module, functional = make()
    reference.cuda()
    module.cuda().load_state_dict(_norm_of(reference).state_dict())
    x = torch.randn(shape, device="cuda")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return reference, module, functional, x


def _both_sides(kind: str, torch_calls: dict, size_over_input: int, sizes) -> tuple:
    """torch's side and cupynorm's of one case, run on the same input with ``kind``'s eager size
    set to the input's bytes plus ``size_over_input``: (torch's results, cupynorm's, the name
    of torch's functional); ``torch_calls`` counts cupynorm's side's calls only."""
    reference, module, functional, x = _case(kind)
    sizes({kind: x.numel() * x.element_size() + size_over_input})
    expected = _run(reference, x)
    torch_calls.clear()
    return expected, _run(module, x), functional


@pytest.mark.parametrize("kind", sorted(CASES))
def test_below_its_size_an_eager_call_is_torchs_own(kind, sizes, torch_calls) -> None:
    expected, got, functional = _both_sides(kind, torch_calls, 1, sizes)
    assert torch_calls.get(functional) == 1
    # torch's op on both sides: equal but for cuDNN's batch norm backward, whose channels_last
    # parameter gradients are not bitwise reproducible from run to run
    for e, g in zip(expected, got, strict=True):
        for a, b in zip(*((e, g) if isinstance(e, list) else ([e], [g])), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_from_its_size_an_eager_call_runs_the_kernels(kind, sizes, torch_calls, adaptive) -> None:
    adaptive(False)
    expected, got, functional = _both_sides(kind, torch_calls, 0, sizes)
    assert functional not in torch_calls
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-4)


def test_channels_last_group_norm_stays_on_the_kernels(sizes, torch_calls) -> None:
    """torch's group norm gives channels_last input a contiguous output; the kernels keep the
    layout a channels_last model runs in."""
    sizes({"group_norm": 1 << 40})
    module = cnt.GroupNorm(4, 16).cuda()
    x = torch.randn(4, 16, 9, 7, device="cuda").to(memory_format=torch.channels_last)
    y = module(x)
    assert "group_norm" not in torch_calls
    assert y.is_contiguous(memory_format=torch.channels_last)


def test_a_channel_slice_of_channels_last_group_norm_follows_the_size(sizes, torch_calls) -> None:
    """A channel slice of a channels_last tensor (SHViT normalizes one) is neither layout: copied
    either way, its output contiguous on both sides, so its size decides as for contiguous
    input; the output and gradients are torch's module's."""
    base = torch.randn(4, 24, 9, 7, device="cuda").to(memory_format=torch.channels_last)

    def run(module):
        leaf = base.detach().clone().requires_grad_(True)  # channels_last, as base
        x = leaf[:, :16]
        assert not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
        y = module(x)
        y.backward(torch.linspace(-1, 1, y.numel(), device="cuda").reshape(y.shape))
        return y, leaf.grad, [p.grad for p in module.parameters()]

    reference = torch.nn.GroupNorm(4, 16).cuda()
    module = cnt.GroupNorm(4, 16).cuda()
    module.load_state_dict(reference.state_dict())
    expected = run(reference)
    for size, on_kernels in ((base[:, :16].numel() * 4 + 1, False), (0, True)):
        sizes({"group_norm": size})
        torch_calls.clear()
        module.zero_grad()
        got = run(module)
        assert ("group_norm" not in torch_calls) is on_kernels
        assert got[0].is_contiguous()
        tol = 1e-5 if on_kernels else 1e-6
        torch.testing.assert_close(got[0], expected[0], rtol=tol, atol=tol)
        torch.testing.assert_close(got[1], expected[1], rtol=tol * 10, atol=tol * 10)
        for g, e in zip(got[2], expected[2], strict=True):
            torch.testing.assert_close(g, e, rtol=tol * 10, atol=tol * 10)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm2d", "rms_norm2d"])
def test_a_channels_last_channel_norm_follows_its_row_norms_size(
    rms, sizes, torch_calls, adaptive
) -> None:
    """On channels_last input a channel norm is the row norm of the channels-last view: the row
    norm's size decides, and below it the call is torch's one op on that view (as timm's
    LayerNorm2d runs it), output channels_last either way; NCHW input, where torch has no single
    op, keeps the kernels whatever the row norm's size."""
    adaptive(False)
    kind, functional = ("rms_norm", "rms_norm") if rms else ("layer_norm", "layer_norm")
    module = (cnt.RMSNorm2d(16) if rms else cnt.LayerNorm2d(16)).cuda()
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 1.5)
    x = torch.randn(4, 16, 9, 7, device="cuda").to(memory_format=torch.channels_last)
    rows = x.permute(0, 2, 3, 1)
    args = (module.weight, module.eps) if rms else (module.weight, module.bias, module.eps)
    expected = getattr(F, functional)(rows, (16,), *args).permute(0, 3, 1, 2)
    for size, on_kernels in ((x.numel() * x.element_size() + 1, False), (0, True)):
        sizes({kind: size, "channel_norm": 0})
        torch_calls.clear()
        y = module(x)
        assert (functional not in torch_calls) is on_kernels
        assert y.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    sizes({kind: 1 << 40})
    torch_calls.clear()
    y = module(x.contiguous())
    assert functional not in torch_calls
    assert y.is_contiguous()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def capture_sizes():
    """Restores the capture sizes the test found."""
    previous = cnt.capture_min_bytes()
    yield cnt.set_capture_min_bytes
    cnt.set_capture_min_bytes(previous)


def _captured(module, x, dy):
    """module(x) forward and backward: once eagerly on a side stream (the warm-up a capture
    needs), then captured in a CUDA graph and replayed once. Returns what _run returns."""
    x = x.detach().clone().requires_grad_(True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (module(x) * dy).sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    x.grad = None
    for p in module.parameters():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the loss and its gradient inside, as in a training step
        y = module(x)
        (y * dy).sum().backward()
    graph.replay()
    torch.cuda.synchronize()
    grads = [p.grad for p in module.parameters()]
    return y, x.grad, grads, [b.clone() for b in module.buffers()]


@pytest.mark.parametrize("below", [True, False], ids=["below", "at"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_captured_call_below_its_capture_size_is_torchs_own(
    kind, below, capture_sizes, torch_calls
) -> None:
    """Inside a CUDA graph capture the host is paid once: the capture size alone decides
    (torch's op below it, the kernels from it on, whatever the eager size), and the replayed
    graph gives torch's module's results either way (two steps: the warm-up and the replay)."""
    reference, module, functional, x = _case(kind)
    dy = torch.linspace(-1, 1, x.numel(), device="cuda").reshape(x.shape)
    _run(reference, x)
    reference.zero_grad(set_to_none=True)  # the replay's gradients are one step's
    expected = _run(reference, x)
    capture_sizes({kind: x.numel() * x.element_size() + int(below)})
    torch_calls.clear()
    actual = _captured(module, x, dy)
    assert (functional in torch_calls) == below
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1])
    for a, e in zip(actual[2], expected[2], strict=True):
        torch.testing.assert_close(a, e)
    for a, e in zip(actual[3], expected[3], strict=True):
        torch.testing.assert_close(a, e)


def _probe_after(queued_ms: float) -> None:
    """Record the probe's event behind ``queued_ms`` of GPU work (0: none) on an idle GPU, then
    let the host move on, so that the next call asks about that event."""
    from cupynorm.torch import _policy

    torch.cuda.synchronize()
    if queued_ms:
        torch.cuda._sleep(int(queued_ms * 2e6))  # ~2 GHz: cycles
    _policy.gpu_behind(torch.cuda.current_device())
    time.sleep(0.001)  # past the window in which two probes belong to one call


@pytest.mark.parametrize("kind", ["batch_norm_act", "layer_norm"])
def test_from_its_size_a_call_while_the_gpu_keeps_up_is_torchs_own(
    kind, sizes, torch_calls, adaptive
) -> None:
    make, shape, channels_last = CASES[kind]
    _reference, module, functional = make()
    module.cuda()
    x = torch.randn(shape, device="cuda")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    sizes({kind: x.numel() * x.element_size()})
    _probe_after(0)
    module(x)
    assert torch_calls.get(functional) == 1
    torch_calls.clear()
    _probe_after(50)  # the GPU busy for ~50 ms: behind the host
    module(x)
    torch.cuda.synchronize()
    assert functional not in torch_calls


def test_deterministic_algorithms_keep_the_size_rule(sizes, torch_calls, adaptive) -> None:
    module = cnt.LayerNorm(40).cuda()
    x = torch.randn(6, 5, 40, device="cuda")
    sizes({"layer_norm": x.numel() * x.element_size()})
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _probe_after(0)  # the GPU keeps up, but the choice must not depend on timing
        module(x)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    assert "layer_norm" not in torch_calls
