"""cupynorm.torch.replace_norms on the CPU: which modules it converts (the torch.nn norms, their
subclasses that compute the same, timm's norm layers and whole timm models), what it keeps
(parameter and buffer objects, device, dtype, training mode, hooks, state_dict) and what it
leaves alone with a warning. On CPU tensors converted modules compute through
torch.nn.functional, so converted and original models must agree exactly.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_cpu_helpers import (
    _run_steps,
)

import cupynorm
import cupynorm.torch as cnt


# ---------------------------------------------------------------------------------------------
# replace_norms
# ---------------------------------------------------------------------------------------------
def _all_norms_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3),
        nn.BatchNorm2d(6),
        nn.GroupNorm(2, 6),
        nn.InstanceNorm2d(6, affine=True, track_running_stats=True),
        nn.Sequential(nn.Flatten(2), nn.BatchNorm1d(6), nn.InstanceNorm1d(6)),
        nn.Unflatten(2, (5, 5)),
        nn.Unflatten(3, (5, 1)),
        nn.BatchNorm3d(6),
        nn.InstanceNorm3d(6),
    )


def test_replace_norms_swaps_types_and_keeps_tensors():
    torch.manual_seed(0)
    model = _all_norms_model()
    model.eval()
    model[1].train()  # mixed training modes are kept
    x = torch.randn(2, 3, 7, 7)
    params = {n: p for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    hook_calls = []
    model[2].register_forward_hook(lambda *args: hook_calls.append(1))
    training = {n: m.training for n, m in model.named_modules()}
    before = model(x)

    assert cnt.replace_norms(model) is model
    kinds = {type(m).__module__ for m in model.modules() if isinstance(m, _NORMS)}
    assert kinds == {"cupynorm.torch.modules"}
    for n, p in model.named_parameters():
        assert p is params[n]
    for n, b in model.named_buffers():
        assert b is buffers[n]
    assert {n: m.training for n, m in model.named_modules()} == training
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    assert len(hook_calls) == 2


_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm)


def test_replace_norms_include_exclude():
    model = _all_norms_model()
    cnt.replace_norms(model, include=[nn.BatchNorm2d, nn.GroupNorm], exclude=[nn.GroupNorm])
    assert type(model[1]) is cnt.BatchNorm2d
    assert type(model[2]) is nn.GroupNorm
    assert type(model[3]) is nn.InstanceNorm2d
    cnt.replace_norms(model, exclude=(nn.InstanceNorm1d,))
    assert type(model[2]) is cnt.GroupNorm
    assert type(model[3]) is cnt.InstanceNorm2d
    assert type(model[4][2]) is nn.InstanceNorm1d
    assert type(model[7]) is cnt.BatchNorm3d
    cnt.replace_norms(model, include=nn.InstanceNorm1d)  # a single class is accepted
    assert type(model[4][2]) is cnt.InstanceNorm1d


def test_replace_norms_leaves_others_alone_and_handles_root_and_shared():
    sync = nn.SyncBatchNorm(4)  # converted too (tests/test_sync_batchnorm_cpu.py)
    ours = cnt.BatchNorm2d(4)
    lazy = nn.LazyBatchNorm2d()
    shared = nn.GroupNorm(2, 4)
    model = nn.ModuleList([sync, ours, lazy, shared, nn.Sequential(shared)])
    cnt.replace_norms(model)
    assert type(sync) is cnt.SyncBatchNorm
    assert type(ours) is cnt.BatchNorm2d
    assert type(lazy) is nn.LazyBatchNorm2d
    assert type(shared) is cnt.GroupNorm and model[4][0] is shared
    root = nn.BatchNorm1d(3)
    assert cnt.replace_norms(root) is root and type(root) is cnt.BatchNorm1d


def test_replace_norms_state_dict_and_device_dtype():
    model = _all_norms_model().to(torch.float64)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    cnt.replace_norms(model)
    assert list(model.state_dict()) == list(sd)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]) and v.dtype == sd[k].dtype
    fresh = _all_norms_model().to(torch.float64)
    fresh.load_state_dict(model.state_dict(), strict=True)


def test_replace_norms_errors():
    with pytest.raises(ValueError, match="include takes classes among"):
        cnt.replace_norms(nn.Sequential(), include=[nn.LocalResponseNorm])
    with pytest.raises(ValueError, match="exclude takes classes among"):
        cnt.replace_norms(nn.Sequential(), exclude=[nn.LocalResponseNorm])
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        cnt.replace_norms([nn.BatchNorm2d(3)])


# ---------------------------------------------------------------------------------------------
# replace_norms on subclasses of the torch.nn norms (as timm, torchvision, diffusers define them)
# ---------------------------------------------------------------------------------------------
class _TaggedGroupNorm(nn.GroupNorm):
    """Inherits forward; adds an attribute (a library's own GroupNorm)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = "kept"


class _RewrittenGroupNorm(nn.GroupNorm):
    """Overrides forward with the same math (timm's GroupNorm)."""

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class _BatchNormReLU(nn.BatchNorm2d):
    """A norm and an activation in one module (timm's BatchNormAct2d): not a plain norm."""

    def forward(self, x):
        return torch.relu(super().forward(x))


class _RewrittenBatchNorm2d(nn.BatchNorm2d):
    """Overrides forward with torch's training logic (running statistics updated)."""

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        return F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training,
            self.momentum,
            self.eps,
        )


class _NormDropAct(nn.BatchNorm2d):
    """The shape of timm's BatchNormAct2d: torch's norm, then its drop and act submodules."""

    def __init__(self, num_features, drop=None, act=None):
        super().__init__(num_features)
        self.drop = drop if drop is not None else nn.Identity()
        self.act = act if act is not None else nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def test_replace_norms_converts_norm_act_subclasses():
    """A norm followed by its own drop and act submodules (timm's norm-act layers) keeps them
    after cupynorm's norm; a random drop (training Dropout) makes it no plain tail: left alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), _NormDropAct(6), _NormDropAct(6, act=nn.SiLU()))
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnt.replace_norms(model)
    for layer in model[1:]:
        assert isinstance(layer, cnt.BatchNorm2d) and isinstance(layer, _NormDropAct)
    assert type(model[1]) is type(model[2])  # one class per subclass and tail
    assert type(model[1]).forward not in (cnt.BatchNorm2d.forward, _NormDropAct.forward)
    x = torch.randn(2, 3, 7, 7)
    outs, grads = _run_steps(model, [x] * 2, train=True)
    outs_r, grads_r = _run_steps(reference, [x] * 2, train=True)
    for u, v in zip(outs + grads, outs_r + grads_r, strict=True):  # CPU: torch's own math
        torch.testing.assert_close(u, v, atol=0, rtol=0)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=0, rtol=0, msg=key)

    dropping = nn.Sequential(_NormDropAct(4, drop=nn.Dropout(0.5)))
    with pytest.warns(UserWarning, match=r"_NormDropAct \(x1\)"):
        cnt.replace_norms(dropping)
    assert type(dropping[0]) is _NormDropAct


def test_replace_norms_converts_subclasses_that_compute_the_same():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3),
        _TaggedGroupNorm(2, 6),
        _RewrittenGroupNorm(3, 6),
        _RewrittenBatchNorm2d(6),
    )
    reference = copy.deepcopy(model)
    bn_state = {k: v.clone() for k, v in model[3].state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left alone: no warning
        cnt.replace_norms(model)
    for key, value in model[3].state_dict().items():  # the probe ran on copies
        assert torch.equal(value, bn_state[key]), key
    assert isinstance(model[1], cnt.GroupNorm) and isinstance(model[1], _TaggedGroupNorm)
    assert model[1].tag == "kept"
    assert isinstance(model[2], cnt.GroupNorm) and isinstance(model[2], _RewrittenGroupNorm)
    assert isinstance(model[3], cnt.BatchNorm2d) and isinstance(model[3], _RewrittenBatchNorm2d)
    assert type(model[1]).__name__ == "_TaggedGroupNorm"
    assert type(model[1]).forward is cnt.GroupNorm.forward  # cupynorm's forward runs
    assert cnt.replace_norms(nn.Sequential(_RewrittenGroupNorm(3, 6)))[0].__class__ is type(
        model[2]
    )  # one class per subclass
    x = torch.randn(2, 3, 7, 7)
    outs, grads = _run_steps(model, [x] * 2, train=True)
    outs_r, grads_r = _run_steps(reference, [x] * 2, train=True)
    for u, v in zip(outs + grads, outs_r + grads_r, strict=True):  # CPU: torch's own math
        torch.testing.assert_close(u, v, atol=0, rtol=0)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=0, rtol=0, msg=key)


def test_replace_norms_leaves_other_subclasses_alone_and_says_so():
    model = nn.Sequential(_BatchNormReLU(4), nn.Sequential(_BatchNormReLU(4)), nn.GroupNorm(2, 4))
    with pytest.warns(UserWarning, match=r"_BatchNormReLU \(x2\)"):
        cnt.replace_norms(model)
    assert type(model[0]) is _BatchNormReLU and type(model[1][0]) is _BatchNormReLU
    assert type(model[2]) is cnt.GroupNorm


@pytest.mark.parametrize("bug", [True, False], ids=["torch-pool-bug", "fixed-torch"])
def test_replace_norms_warns_of_torch_avg_pool_bug(monkeypatch, bug):
    """A GroupNorm or InstanceNorm (NCHW out under torch, channels_last kept by ours) before a
    padded AvgPool2d: warned about exactly when the installed torch has the pool's bug."""
    from cupynorm.torch import convert

    monkeypatch.setattr(convert, "torch_avg_pool_backward_is_wrong", lambda: bug)

    def model(norm: nn.Module, padding: int = 1) -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 1), norm, nn.AvgPool2d(3, 1, padding))

    for norm in (nn.GroupNorm(1, 4), nn.InstanceNorm2d(4)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cnt.replace_norms(model(norm))
        said = [str(w.message) for w in caught if "pytorch/pytorch#188344" in str(w.message)]
        assert len(said) == int(bug), said
        if bug:
            assert "1 such pooling layer(s) and 1 converted" in said[0]
    quiet = [  # no padding, the norm left to torch, a norm that keeps the layout under torch too
        (model(nn.GroupNorm(1, 4), padding=0), None),
        (model(nn.GroupNorm(1, 4)), [nn.GroupNorm]),
        (model(nn.BatchNorm2d(4)), None),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m, exclude in quiet:
            cnt.replace_norms(m, exclude=exclude)


def test_torch_avg_pool_probe_without_cuda(monkeypatch):
    from cupynorm.torch import convert

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert convert.torch_avg_pool_backward_is_wrong.__wrapped__() is False


def test_replace_norms_include_exclude_cover_subclasses():
    model = nn.Sequential(_TaggedGroupNorm(2, 4), _RewrittenBatchNorm2d(4))
    cnt.replace_norms(model, exclude=[nn.GroupNorm])
    assert type(model[0]) is _TaggedGroupNorm
    assert isinstance(model[1], cnt.BatchNorm2d)


def test_replace_norms_timm_norms():
    """timm's own norm layers, where timm is installed (the GPU machine): its GroupNorm is a plain
    GroupNorm; BatchNormAct2d, GroupNormAct and GroupNorm1Act are a norm then their drop and act
    submodules. All are converted and compute what timm's modules compute; a BatchNormAct2d with
    a training-mode drop (random) is left alone, with a warning."""
    layers = pytest.importorskip("timm.layers")
    torch.manual_seed(0)
    model = nn.Sequential(
        layers.GroupNorm(32, num_groups=8),
        layers.BatchNormAct2d(32),
        layers.GroupNormAct(32, num_groups=8, act_layer=nn.SiLU),
        layers.GroupNorm1Act(32),
    )
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnt.replace_norms(model)
    assert isinstance(model[0], cnt.GroupNorm) and isinstance(model[0], layers.GroupNorm)
    assert isinstance(model[1], cnt.BatchNorm2d) and isinstance(model[1], layers.BatchNormAct2d)
    assert isinstance(model[2], cnt.GroupNorm) and isinstance(model[2], layers.GroupNormAct)
    assert isinstance(model[3], cnt.GroupNorm) and isinstance(model[3], layers.GroupNorm1Act)
    x = torch.randn(2, 32, 5, 6)
    outs, grads = _run_steps(model, [x] * 2, train=True)
    outs_r, grads_r = _run_steps(reference, [x] * 2, train=True)
    for u, v in zip(outs + grads, outs_r + grads_r, strict=True):  # CPU: torch's own math
        torch.testing.assert_close(u, v, atol=0, rtol=0)
    dropping = nn.Sequential(layers.BatchNormAct2d(32, drop_layer=nn.Dropout))
    with pytest.warns(UserWarning, match="BatchNormAct2d"):
        cnt.replace_norms(dropping)
    assert type(dropping[0]) is layers.BatchNormAct2d


@pytest.mark.parametrize(
    "name, norms",
    [("efficientnet_b0", 49), ("mobilenetv3_small_100", 34), ("resnet50_gn", 53)],
)
def test_replace_norms_timm_models(name, norms):
    """Whole timm models (norm-act layers, timm's GroupNorm): every norm converted, no warning,
    and on the CPU the converted model computes exactly what timm's does."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cnt.replace_norms(model)
    kinds = (cnt.BatchNorm2d, cnt.GroupNorm)
    assert sum(isinstance(m, kinds) for m in model.modules()) == norms
    x = torch.randn(2, 3, 64, 64)
    for m in (model, reference):
        m.train()
    torch.testing.assert_close(model(x), reference(x), atol=0, rtol=0)


def test_raise_like_torch_without_a_meta_kernel_says_ours():
    """When torch has no meta kernel for the call, cupynorm's own message is raised."""
    from cupynorm.torch import _checks

    def no_meta(x):
        raise NotImplementedError("no meta kernel")

    with pytest.raises(cupynorm.InvalidInputError, match="ours"):
        _checks.raise_like_torch(no_meta, (torch.randn(2),), ours="ours")
    _checks.raise_like_torch(no_meta, (torch.randn(2),))  # nothing of ours: the call goes on
