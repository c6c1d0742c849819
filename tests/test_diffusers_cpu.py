"""diffusers' own UNet2DConditionModel and AutoencoderKL under `cupynorm.torch.fuse`, on the CPU
with every norm on the reference kernels (the `kernels` fixture): what fuse folds inside
ResnetBlock2D (norm1 -> SiLU; the time embedding added before norm2 -> SiLU), what it leaves
alone and why, outputs and gradients as before, state_dict keys unchanged; fuse's tracing of
``*args``/``**kwargs`` and of arguments that may be None (without diffusers); and the bench's
diffusion rows on tiny configs, with and without diffusers installed."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_bench_cpu import CpuStandIn  # noqa: E402
from test_bench_models_dry_run_cpu import _models_table  # noqa: E402
from torch import nn  # noqa: E402

import cupynorm.torch as cnt  # noqa: E402
from cupynorm import bench  # noqa: E402
from cupynorm.__main__ import main  # noqa: E402
from cupynorm.bench import diffusers_models, train, trainstep  # noqa: E402

UNET_ROW, VAE_ROW = "sd15_unet_b8_autocast_fp16", "sd_vae_decode_b4_fp16"

# Two resolutions, 8 groups: 12 ResnetBlock2D (2 x 2 down, 2 x 3 up, 2 in the middle), 6
# Transformer2DModel (each a GroupNorm and a BasicTransformerBlock of 3 LayerNorms).
TINY_UNET = {
    **diffusers_models.SD15_UNET_CONFIG,
    "sample_size": 8,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "block_out_channels": (32, 64),
    "cross_attention_dim": 16,
    "norm_num_groups": 8,
}
TINY_VAE = {
    **diffusers_models.SD_VAE_CONFIG,
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "block_out_channels": (32, 64),
    "norm_num_groups": 8,
    "sample_size": 16,
}


def _quiet_diffusers():
    diffusers = pytest.importorskip("diffusers")
    diffusers.utils.logging.set_verbosity_error()  # its deprecation notes, once per trace
    return diffusers


def _tiny_unet_row(batch: int = 2) -> bench.ModelWorkload:
    return dataclasses.replace(
        bench.MODEL_WORKLOADS_BY_NAME[UNET_ROW], input_shape=(batch, 4, 8, 8), accuracy_batch=None
    )


def _tiny_vae_row(batch: int = 2) -> bench.ModelWorkload:
    return dataclasses.replace(
        bench.MODEL_WORKLOADS_BY_NAME[VAE_ROW],
        input_shape=(batch, 4, 8, 8),
        output_shape=(batch, 3, 16, 16),
        dtype="float32",  # the CPU's fp16 kernels are not what is tested here
        accuracy_batch=None,
    )


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output, and the gradients of a loss of it: the input's and each parameter's."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return out.detach(), {"input": x.grad, **grads}


def _assert_same_run(fused: nn.Module, original: nn.Module, x: torch.Tensor) -> None:
    out, grads = _run(fused, x)
    ref_out, ref_grads = _run(original, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        # relative to the largest entry: a conv bias before a norm has a gradient of rounding
        scale = max(ref_grads[name].abs().max().item(), 1e-3)
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4 * scale, name


# ------------------------------------------------------------------------------------------------
# fuse inside diffusers' models
# ------------------------------------------------------------------------------------------------


def test_fuse_unet_folds_every_resnet_block(kernels) -> None:
    """Every ResnetBlock2D fused: norm1 + SiLU, and the time embedding + norm2 + SiLU (the UNet's
    forward and its cross-attention blocks do not trace: fuse reaches the ResnetBlock2D's one by
    one); the transformer blocks' GroupNorms converted unfused (a conv follows them), their
    LayerNorms converted by replace_norms; outputs and gradients as before."""
    _quiet_diffusers()
    torch.manual_seed(0)
    original = diffusers_models.unet_noise_prediction(_tiny_unet_row(), TINY_UNET)
    model = copy.deepcopy(original)
    report: list[str] = []
    model = cnt.replace_norms(cnt.fuse(model, report=report), include=[nn.LayerNorm])
    resnets = [
        *(f"down_blocks.{b}.resnets.{i}" for b in range(2) for i in range(2)),
        *(f"up_blocks.{b}.resnets.{i}" for b in range(2) for i in range(3)),
        *(f"mid_block.resnets.{i}" for i in range(2)),
    ]
    expected = [f"unet.{r}.norm1 + silu" for r in resnets]
    expected += [f"unet.{r}.norm2 + shift + silu" for r in resnets]
    assert sorted(report) == sorted(expected)
    norms = bench.models.norm_layers(model)
    fused = [m for m in norms if isinstance(m, cnt.GroupNormAct)]
    assert len(fused) == 24 and sum(m.activation == "silu" for m in fused) == 24
    # the transformer blocks' GroupNorm (6) and conv_norm_out: cupynorm's, not fused
    unfused = [m for m in norms if type(m) is cnt.GroupNorm]
    assert len(unfused) == 7
    assert sum(type(m) is cnt.LayerNorm for m in norms) == 18
    assert len(norms) == bench.models.count_norm_layers(original) == 49
    assert list(model.state_dict()) == list(original.state_dict())
    _assert_same_run(model, original, torch.randn(2, 4, 8, 8))


def test_fuse_vae_decoder_folds_the_blocks_without_a_time_embedding(kernels) -> None:
    """The decoder's up blocks: norm1 + SiLU and norm2 + SiLU in each ResnetBlock2D. Its middle
    block's ResnetBlock2D take ``temb=None`` with the time-embedding branch on (``if temb is
    not None: h = h + temb``): a graph traced with a tensor there is wrong for None, so fuse
    leaves them untraced (their norms converted, unfused); outputs and gradients as before."""
    _quiet_diffusers()
    torch.manual_seed(0)
    original = diffusers_models.vae_decode(_tiny_vae_row(), TINY_VAE)
    model = copy.deepcopy(original)
    report: list[str] = []
    model = cnt.fuse(model, report=report)
    expected = [
        f"vae.decoder.up_blocks.{b}.resnets.{i}.norm{n} + silu"
        for b in range(2)
        for i in range(3)
        for n in (1, 2)
    ]
    assert sorted(report) == sorted(expected)
    norms = bench.models.norm_layers(model)
    assert sum(isinstance(m, cnt.GroupNormAct) for m in norms) == 12
    # the middle block's 2 ResnetBlock2D and attention, conv_norm_out
    assert sum(type(m) is cnt.GroupNorm for m in norms) == 6
    assert list(model.state_dict()) == list(original.state_dict())
    assert model.eval() is model and original.eval() is original
    _assert_same_run(model, original, torch.randn(2, 4, 8, 8))


# ------------------------------------------------------------------------------------------------
# fuse's tracing of *args / **kwargs and of arguments that may be None (no diffusers needed)
# ------------------------------------------------------------------------------------------------


class _TimeBlock(nn.Module):
    """ResnetBlock2D's shape: extra ``*args``/``**kwargs`` it only checks, a time embedding that
    is added before norm2 when given."""

    def __init__(self, channels: int = 8, temb_channels: int | None = 6) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(2, channels)
        self.proj = nn.Linear(temb_channels, channels) if temb_channels else None
        self.act = nn.SiLU()

    def forward(self, x, temb, *args, **kwargs):
        if len(args) > 0 or kwargs.get("scale") is not None:
            raise TypeError("no longer taken")
        h = self.conv(self.act(self.norm1(x)))
        if self.proj is not None:
            temb = self.proj(self.act(temb))[:, :, None, None]
        if temb is not None:
            h = h + temb
        return (x + self.act(self.norm2(h))) / 2.0


class _Caller(nn.Module):
    """Calls its block in a way torch.fx cannot follow (a Python loop over a tensor's size)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, temb=None):
        for _ in range(int(x.shape[0] > 0)):
            x = self.block(x, temb)
        return x


def test_fuse_traces_a_forward_with_args_and_kwargs_empty(kernels) -> None:
    torch.manual_seed(3)
    original = _Caller(_TimeBlock())
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(original), report=report)
    assert report == ["block.norm1 + silu", "block.norm2 + shift + silu"]
    assert isinstance(model.block, torch.fx.GraphModule)
    x, temb = torch.randn(2, 8, 5, 5), torch.randn(2, 6)
    torch.testing.assert_close(model(x, temb), original(x, temb))
    with pytest.raises(TypeError):  # the fused forward takes its named arguments only
        model.block(x, temb, 1.0)


def test_fuse_leaves_a_forward_whose_graph_depends_on_a_none_argument(kernels) -> None:
    """Without a projection the block adds ``temb`` only when it is not None: traced with a
    tensor there, its graph would fail on None (as diffusers' VAE calls it). Not traced whole:
    its norms are converted, unfused, and it runs with None as before."""
    torch.manual_seed(4)
    original = _Caller(_TimeBlock(temb_channels=None))
    report: list[str] = []
    model = cnt.fuse(copy.deepcopy(original), report=report)
    assert report == [] and type(model.block) is _TimeBlock
    assert type(model.block.norm1) is cnt.GroupNorm and type(model.block.norm2) is cnt.GroupNorm
    x = torch.randn(2, 8, 5, 5)
    torch.testing.assert_close(model(x), original(x))


def test_fuse_traces_a_block_that_never_reads_none_differently() -> None:
    """With a projection, ``temb`` None would fail in the projection: one graph, traced, whose
    forward takes the named arguments (the empty ``*args``/``**kwargs`` gone)."""
    block = _TimeBlock(temb_channels=6)
    graph = sys.modules["cupynorm.torch.fuse"]._trace(block)
    assert [n.target for n in graph.nodes if n.op == "placeholder"] == ["x", "temb"]
    x, temb = torch.randn(2, 8, 5, 5), torch.randn(2, 6)
    torch.testing.assert_close(torch.fx.GraphModule(block, graph)(x, temb=temb), block(x, temb))


# ------------------------------------------------------------------------------------------------
# The bench's diffusion rows
# ------------------------------------------------------------------------------------------------


def test_diffusion_rows() -> None:
    by_name = bench.MODEL_WORKLOADS_BY_NAME
    unet, vae = by_name[UNET_ROW], by_name[VAE_ROW]
    assert unet.model == "sd15_unet" and unet.input_shape == (8, 4, 64, 64)
    assert unet.autocast == "float16" and unet.dtype == "float32" and not unet.inference
    assert unet.loss == "mse" and unet.convert == "fuse_layer_norms"
    assert vae.model == "sd_vae_decoder" and vae.input_shape == (4, 4, 64, 64)
    assert vae.inference and vae.dtype == "float16" and vae.output_shape == (4, 3, 512, 512)
    assert diffusers_models.SD15_UNET_CONFIG["block_out_channels"] == (320, 640, 1280, 1280)
    assert diffusers_models.SD_VAE_CONFIG["block_out_channels"] == (128, 256, 512, 512)


def test_inference_step_runs_the_forward_alone_without_gradients(monkeypatch) -> None:
    monkeypatch.setattr(bench.timing, "cuda", CpuStandIn())
    workload = dataclasses.replace(
        _tiny_vae_row(), model="gn_resnet_blocks", input_shape=(2, 64, 4, 4), output_shape=None
    )
    model = trainstep.on_device(bench.models.build_model(workload), workload, "cpu", torch.float32)
    assert not model.training
    grad_modes = []
    model.register_forward_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    inputs, target = trainstep.make_batch(workload, 2, "cpu", torch.float32, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    trainstep.TrainStep(model, workload, inputs, target)()
    assert grad_modes == [False]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_mse_target_takes_the_output_shape() -> None:
    _, target = trainstep.make_batch(_tiny_vae_row(), 1, "cpu", torch.float32, seed=0)
    assert target.shape == (1, 3, 16, 16)


@pytest.fixture
def tiny_diffusion_rows(monkeypatch: pytest.MonkeyPatch, frozen_heap):
    """The bench on the CPU with the two diffusion rows on tiny configs of diffusers' classes,
    few steps and rounds."""
    monkeypatch.setattr(bench.timing, "cuda", CpuStandIn())
    monkeypatch.setattr(bench.timing, "COPY_BANDWIDTH_BYTES", 1 << 16)
    monkeypatch.setattr(bench.timing, "MIN_FLUSH_BYTES", 1 << 16)
    monkeypatch.setattr(bench.workloads, "MODEL_WORKLOADS", (_tiny_unet_row(), _tiny_vae_row()))
    monkeypatch.setattr(train, "WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "GRAPH_WARMUP_STEPS", 1)
    monkeypatch.setattr(train, "HOST_STEPS", 2)
    monkeypatch.setattr(train, "ROUNDS", 2)
    monkeypatch.setattr(train, "HOST_PACED_ROUNDS", 2)
    monkeypatch.setattr(train, "PROFILE_STEPS", 1)
    monkeypatch.setattr(train, "COMPILED_MODES", ())
    factories = bench.models.MODEL_FACTORIES
    monkeypatch.setitem(
        factories, "sd15_unet", lambda w: diffusers_models.unet_noise_prediction(w, TINY_UNET)
    )
    monkeypatch.setitem(
        factories, "sd_vae_decoder", lambda w: diffusers_models.vae_decode(w, TINY_VAE)
    )


@pytest.mark.exhaustive  # ~40 s: both diffusers models through the bench
def test_diffusion_rows_dry_run(tiny_diffusion_rows, tmp_path: Path, capsys) -> None:
    """Both rows, eager and graphed: built from diffusers' classes, converted (the UNet's 24
    fusions and 18 LayerNorms), timed; the VAE's step is a forward under no_grad; the accuracy
    checks pass."""
    _quiet_diffusers()
    json_path = tmp_path / "diffusion.json"
    argv = ["bench", "--reps", "2", "--only", f"{UNET_ROW},{VAE_ROW}", "--json", str(json_path)]
    exit_code = main(argv)
    captured = capsys.readouterr()
    assert exit_code == 0, captured.err
    rows = {tuple(row[:3]) for row in _models_table(captured.out)[2:]}
    assert rows == {
        (name, mode, impl)
        for name in (UNET_ROW, VAE_ROW)
        for mode in ("eager", "graphed")
        for impl in ("torch", "cupynorm")
    }
    report = json.loads(json_path.read_text())
    by_name = {m["name"]: m for m in report["models"]}
    assert by_name[UNET_ROW]["norm_layers"] == 49 and by_name[VAE_ROW]["norm_layers"] == 18
    for model in by_name.values():
        assert model["error"] is None and model["failure"] is None and model["accuracy"]["ok"]
        assert all(s["error"] is None and s["ms"] > 0 for s in model["steps"])


def test_diffusion_rows_skip_without_diffusers(
    tiny_diffusion_rows, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Without diffusers (its import fails, also of a submodule imported earlier), both rows are
    skipped and say why; the run does not fail."""
    for name in [m for m in sys.modules if m.startswith("diffusers.")] + ["diffusers"]:
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["bench", "--reps", "2", "--only", f"{UNET_ROW},{VAE_ROW}"]) == 0
    captured = capsys.readouterr()
    rows = {tuple(cells[:3]): cells for cells in _models_table(captured.out)[2:]}
    for name in (UNET_ROW, VAE_ROW):
        assert rows[(name, "-", "-")][3] == "skipped: diffusers is not installed"
    assert "FAILED" not in captured.err
