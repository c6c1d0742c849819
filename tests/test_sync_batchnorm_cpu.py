"""cupynorm.torch.SyncBatchNorm on the CPU: the module against torch.nn.SyncBatchNorm (signature,
state_dict, repr, conversion), and the synchronised training step on 3 gloo processes against
BatchNorm on the concatenated batch (tests/sync_batchnorm_workers.py: uneven and empty ranks,
channels_last, fp16/bf16, process-group subsets, one collective each way and none in eval)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from conftest import once_per_run
from sync_batchnorm_workers import CASES, run_cases
from torch import nn

import cupynorm.torch as cnt

WORLD = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    # one spawn for every case (and, under pytest-xdist, for every worker)
    return once_per_run(tmp_path_factory, "sync_batchnorm", lambda folder: run_cases(WORLD, folder))


# one spawn of three processes for all cases (~2 minutes on one GPU machine without xdist);
# tests/test_sync_batchnorm_gpu.py spawns its own by default
@pytest.mark.exhaustive
@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_batchnorm_distributed(results, case):
    for rank, per_case in enumerate(results):
        assert per_case.get(case) == "ok", f"rank {rank}:\n{per_case.get(case)}"


# ---------------------------------------------------------------------------------------------
# the module as torch's (no process group needed)
# ---------------------------------------------------------------------------------------------
def test_sync_batchnorm_signature_state_dict_repr():
    assert inspect.signature(cnt.SyncBatchNorm) == inspect.signature(nn.SyncBatchNorm)
    ours, theirs = cnt.SyncBatchNorm(5, momentum=None), nn.SyncBatchNorm(5, momentum=None)
    assert isinstance(ours, nn.SyncBatchNorm)
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    theirs.running_mean.uniform_()
    ours.load_state_dict(theirs.state_dict())
    assert torch.equal(ours.running_mean, theirs.running_mean)
    assert cnt.SyncBatchNorm(5, process_group="g").process_group == "g"


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batchnorm_without_process_group_is_torchs(training, momentum):
    """No initialised process group: torch's module is plain batch norm, so is ours."""
    assert not dist.is_initialized()
    ours, theirs = cnt.SyncBatchNorm(4, momentum=momentum), nn.SyncBatchNorm(4, momentum=momentum)
    ours.train(training)
    theirs.train(training)
    for _ in range(2):
        x = torch.randn(3, 4, 5, 2)
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    for a, b in zip(ours.buffers(), theirs.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_sync_batchnorm_input_errors_are_torchs():
    for x in (torch.randn(4), torch.randn(2, 0, 3)):
        with pytest.raises(ValueError) as theirs:
            nn.SyncBatchNorm(4)(x)
        with pytest.raises(ValueError) as ours:
            cnt.SyncBatchNorm(4)(x)
        assert str(ours.value) == str(theirs.value)


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.BatchNorm1d(4, affine=False), cnt.BatchNorm3d(4, momentum=None)),
        nn.SyncBatchNorm(4, track_running_stats=False),
        nn.GroupNorm(2, 4),
    )


def test_convert_sync_batchnorm_shares_state_like_torchs():
    model = _model().eval()
    theirs = nn.SyncBatchNorm.convert_sync_batchnorm(_model().eval(), process_group="group")
    ours = cnt.SyncBatchNorm.convert_sync_batchnorm(model, process_group="group")
    assert ours is model
    kinds = [type(m) for m in ours.modules()]
    assert kinds.count(cnt.SyncBatchNorm) == 4 and nn.GroupNorm in kinds
    for mine, torchs in zip(ours.modules(), theirs.modules(), strict=True):
        if isinstance(torchs, nn.SyncBatchNorm):
            assert repr(mine) == repr(torchs) and mine.process_group == "group"
            assert not mine.training
    assert list(ours.state_dict()) == list(theirs.state_dict())
    takes_bias = "bias" in inspect.signature(nn.BatchNorm2d).parameters
    for old in (nn.BatchNorm2d(4), *([nn.BatchNorm2d(4, bias=False)] if takes_bias else [])):
        new = cnt.SyncBatchNorm.convert_sync_batchnorm(old)
        assert type(new) is cnt.SyncBatchNorm and repr(new) == repr(
            nn.SyncBatchNorm.convert_sync_batchnorm(old)
        )
        assert new.weight is old.weight and new.bias is old.bias
        assert new.running_mean is old.running_mean and new.running_var is old.running_var
        assert new.num_batches_tracked is old.num_batches_tracked


def test_replace_norms_swaps_torch_sync_batchnorm_in_place():
    sync = nn.SyncBatchNorm(4)
    weight = sync.weight
    model = nn.Sequential(nn.Conv2d(3, 4, 1), sync)
    cnt.replace_norms(model)
    assert model[1] is sync and type(sync) is cnt.SyncBatchNorm and sync.weight is weight
    cnt.replace_norms(model, exclude=[nn.SyncBatchNorm])  # accepted as a class to name


class _ScaledSync(nn.SyncBatchNorm):
    """A subclass computing something else: never probed (a probe could communicate)."""

    def forward(self, input):
        return super().forward(input) * 2


class _TaggedSync(nn.SyncBatchNorm):
    tag = "library"


def test_replace_norms_sync_subclasses():
    tagged, scaled = _TaggedSync(3), _ScaledSync(3)
    with pytest.warns(UserWarning, match="_ScaledSync"):
        cnt.replace_norms(nn.Sequential(tagged, scaled))
    assert isinstance(tagged, cnt.SyncBatchNorm) and tagged.tag == "library"
    assert type(scaled) is _ScaledSync
