"""`python -m cupynorm profile` without a GPU: the arguments, the families' layers, the tables, the
exits of the GPU subcommands, and the `cpu` subcommand itself on tiny stacks (cupynorm's host
code on CPU tensors with faked launches)."""

from __future__ import annotations

import pytest

from cupynorm.__main__ import build_parser, main
from cupynorm.bench.profile import common, cpu, stack

# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------


def test_stack_arguments_and_defaults() -> None:
    args = build_parser().parse_args(["profile", "stack"])
    assert (args.command, args.profile_command) == ("profile", "stack")
    assert args.layers == 50 and args.steps == 200 and args.family is None
    assert stack.chosen_families(args.family) == list(stack.FAMILIES.values())
    args = build_parser().parse_args(
        ["profile", "stack", "--family", "ln", "--family", "bn", "--layers", "8"]
    )
    assert [f.name for f in stack.chosen_families(args.family)] == ["bn", "ln"]  # registry order
    assert args.layers == 8
    args = build_parser().parse_args(["profile", "stack", "--family", "bn", "--family", "all"])
    assert len(stack.chosen_families(args.family)) == len(stack.FAMILIES) == 10


def test_every_subcommand_parses() -> None:
    parse = build_parser().parse_args
    assert parse(["profile", "cpu", "--launches", "none", "--model"]).steps == 2000
    model = parse(["profile", "model", "--row", "gn_blocks_fp16", "--batch", "4", "--compile"])
    assert (model.row, model.batch, model.compile, model.top) == ("gn_blocks_fp16", 4, True, 12)
    assert parse(["profile", "calls", "--calls", "100"]).calls == 100
    kernels = parse(["profile", "kernels", "layernorm_bf16", "--quick", "--no-compile"])
    assert (kernels.workload, kernels.quick, kernels.no_compile) == ("layernorm_bf16", True, True)


@pytest.mark.parametrize(
    "argv",
    [
        ["profile"],
        ["profile", "nope"],
        ["profile", "stack", "--family", "nope"],
        ["profile", "kernels"],
        ["profile", "model", "--batch", "0"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    assert "usage: cupynorm profile" in capsys.readouterr().err


def test_help_lists_the_subcommands(capsys) -> None:
    assert main(["profile", "--help"]) == 0
    out = capsys.readouterr().out
    for name in ("stack", "model", "calls", "cpu", "kernels"):
        assert f"\n    {name} " in out


@pytest.mark.parametrize("argv", [["stack"], ["model"], ["calls"], ["kernels", "layernorm_bf16"]])
def test_gpu_subcommands_without_a_gpu_exit_2(argv, monkeypatch, capsys) -> None:
    monkeypatch.setattr(common, "cuda_problem", lambda: "a CUDA GPU is needed (test)")
    monkeypatch.setattr(common, "cupy_cuda_problem", lambda: "a CUDA GPU is needed (test)")
    assert main(["profile", *argv]) == 2
    assert capsys.readouterr().err == f"cupynorm profile {argv[0]}: a CUDA GPU is needed (test)\n"


def test_no_gpu_here_points_at_the_cpu_subcommand() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert "`profile cpu` runs here" in common.cuda_problem()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["model", "--row", "nope"], "unknown model row 'nope'; choose from: resnet50_b64"),
        (["kernels", "nope"], "unknown kernel workload 'nope'; choose from: instancenorm2d_fp32"),
    ],
)
def test_unknown_rows_exit_2_before_touching_the_gpu(argv, message, monkeypatch, capsys) -> None:
    pytest.importorskip("torch")
    monkeypatch.setattr(common, "cuda_problem", lambda: None)
    assert main(["profile", *argv]) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Tables and arithmetic
# ------------------------------------------------------------------------------------------------


def test_format_table() -> None:
    table = common.format_table(["name", "kind", "µs", "count"], [["a|b", "x", 1.25, None]], left=2)
    assert table.splitlines() == [
        "| name | kind | µs | count |",
        "|---|---|---:|---:|",
        "| a\\|b | x | 1.2 | - |",
    ]


def test_per_layer_is_over_the_identity_stack() -> None:
    base = stack.StackTiming(100.0, 200.0, kernel_us=10.0, kernels=2.0, allocations=1.0)
    timing = stack.StackTiming(600.0, 1200.0, kernel_us=60.0, kernels=12.0, allocations=11.0)
    row = stack.per_layer("bn", "torch", timing, base, layers=10)
    assert (row.forward_us, row.backward_us, row.total_us) == (50.0, 100.0, 150.0)
    assert (row.kernel_us, row.kernels, row.allocations) == (5.0, 1.0, 1.0)
    cpu_row = stack.per_layer("bn", "torch", stack.StackTiming(600.0, 1200.0), base, layers=10)
    assert cpu_row.kernel_us is None and cpu_row.allocations is None


def test_rows_table_has_the_ratio_to_torch_and_the_gpu_columns() -> None:
    rows = [
        stack.LayerRow("bn", "torch", 40.0, 60.0, 5.0, 2.0, 1.0),
        stack.LayerRow("bn", "cupynorm", 50.0, 75.0, 4.0, 3.0, 2.0),
        stack.LayerRow("ln", "cupynorm", 10.0, 10.0, None, None, None),
    ]
    lines = stack.format_rows(rows, gpu=True).splitlines()
    assert lines[0] == (
        "| family | layer | fwd host µs | bwd host µs | fwd+bwd host µs | vs torch | GPU µs "
        "| launches | allocations |"
    )
    assert lines[2] == "| bn | torch | 40.0 | 60.0 | 100.0 | 1.00x | 5.0 | 2.0 | 1.0 |"
    assert lines[3] == "| bn | cupynorm | 50.0 | 75.0 | 125.0 | 0.80x | 4.0 | 3.0 | 2.0 |"
    assert lines[4] == "| ln | cupynorm | 10.0 | 10.0 | 20.0 | - | - | - | - |"
    cpu_lines = stack.format_rows(rows[1:], gpu=False).splitlines()
    assert cpu_lines[0] == "| family | layer | fwd host µs | bwd host µs | fwd+bwd host µs |"


# ------------------------------------------------------------------------------------------------
# The families: torch's layer and cupynorm's compute the same thing
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(stack.FAMILIES))
def test_family_layers_match(name: str) -> None:
    """Each family pairs layers that compute the same output from the same state (cupynorm's
    modules on CPU tensors run torch's functional), so the stack compares like with like; under
    the family's conditions when a GPU would run it (channels_last)."""
    torch = pytest.importorskip("torch")
    family = stack.FAMILIES[name]
    makers = stack.layer_makers(name)
    torch.manual_seed(0)
    theirs, ours = makers["torch"](family.features), makers["cupynorm"](family.features)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    # torch's norm + activation is its two modules in a row, as a model has them
    norm = theirs[0] if isinstance(theirs, torch.nn.Sequential) else theirs
    ours.load_state_dict(norm.state_dict())
    x = torch.randn(family.cpu_shape)
    if family.channels_last:
        x = x.to(memory_format=torch.channels_last)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_time_stack_on_the_cpu() -> None:
    torch = pytest.importorskip("torch")
    family = stack.FAMILIES["gn"]
    bench = stack.Bench("cpu", lambda: None, steps=4, blocks=2, warmup=1)
    x = stack.make_input(family, bench, cpu=True)
    assert x.dtype == torch.float32 and x.requires_grad and x.shape == family.cpu_shape
    assert x.is_contiguous(memory_format=torch.channels_last)
    model = stack.build_stack(stack.layer_makers("gn")["torch"], 3, family, x)
    assert len(model) == 3
    timing = stack.time_stack(model, x, family, bench, cpu=True)
    assert timing.forward_us > 0 and timing.backward_us > 0 and timing.kernel_us is None
    assert x.grad is not None and x.grad.shape == x.shape  # the backward ran


# ------------------------------------------------------------------------------------------------
# `profile cpu`: cupynorm's host code with faked launches
# ------------------------------------------------------------------------------------------------


def _launch_counter(monkeypatch) -> list[int]:
    launches: list[int] = []
    monkeypatch.setattr(cpu._NoDriver, "launchKernel", staticmethod(lambda *a: launches.append(1)))
    return launches


def _table(out: str) -> dict[tuple[str, str], list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ")][1:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return {(row[0], row[1]): row for row in rows}


def test_cpu_subcommand_runs_cupynorms_host_code(monkeypatch, capsys) -> None:
    pytest.importorskip("torch")
    from cupynorm import _compile, _interop, _program

    launches = _launch_counter(monkeypatch)
    before = (_interop.backend_of, _compile.launcher, _program._PROGRAMS, _program.check_replay)
    argv = ["profile", "cpu", "--family", "bn+act", "--family", "ln", "--layers", "3"]
    assert main([*argv, "--steps", "10"]) == 0
    rows = _table(capsys.readouterr().out)
    assert set(rows) == {(f, layer) for f in ("bn+act", "ln") for layer in ("floor", "cupynorm")}
    for row in rows.values():
        forward, backward, total = (float(cell) for cell in row[2:5])
        assert total == pytest.approx(forward + backward, abs=0.11)
    # cupynorm's layers went through the CUDA host code to the (faked) driver
    assert len(launches) > 0
    # and everything the harness set is back
    after = (_interop.backend_of, _compile.launcher, _program._PROGRAMS, _program.check_replay)
    assert all(a is b for a, b in zip(before, after, strict=True))


def test_cpu_subcommand_without_launchers(monkeypatch, capsys) -> None:
    pytest.importorskip("torch")
    launches = _launch_counter(monkeypatch)
    argv = ["profile", "cpu", "--family", "gn", "--layers", "2", "--steps", "5"]
    assert main([*argv, "--launches", "none"]) == 0
    assert set(_table(capsys.readouterr().out)) == {("gn", "floor"), ("gn", "cupynorm")}
    assert launches == []  # no launcher at all: the driver is never reached


def test_stack_rows_as_json_render_in_results(tmp_path, monkeypatch, capsys) -> None:
    """`--json` writes the table's rows; `cupynorm report` renders them as RESULTS.md's
    host-per-layer section, the same table the command printed."""
    pytest.importorskip("torch")
    _launch_counter(monkeypatch)
    path = tmp_path / "stack.json"
    argv = ["profile", "cpu", "--family", "ln", "--layers", "2", "--steps", "5"]
    assert main([*argv, "--json", str(path)]) == 0
    printed = _table(capsys.readouterr().out)
    import json

    document = json.loads(path.read_text())["stack"]
    assert document["layers"] == 2 and "launches faked" in document["setup"]
    assert [(r.family, r.layer) for r in stack.rows_of(document)] == list(printed)
    out = tmp_path / "RESULTS.md"
    assert main(["report", "--markdown", str(out), str(path)]) == 0
    page = out.read_text()
    assert "## Host per norm layer: stacks of one family" in page and "(stack.json)" in page
    assert _table(page[page.index("## Host per norm layer") :]) == printed


def test_gpu_stacks_write_their_json_after_every_family(tmp_path, monkeypatch) -> None:
    """`profile stack --json` rewrites the file after each family: a run stopped at a time limit
    (here: in the second family) keeps the families it finished."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    done: list[str] = []

    def profile_family(family, layers, bench, impls, cprofile=False, compiled=False):
        if done:
            raise KeyboardInterrupt  # a kill: nothing written after this
        done.append(family.name)
        return [stack.LayerRow(family.name, impl, 1.0, 2.0, None, None, None) for impl in impls]

    monkeypatch.setattr(stack, "profile_family", profile_family)
    path = tmp_path / "stack.json"
    argv = ["profile", "stack", "--family", "bn", "--family", "ln", "--json", str(path)]
    with pytest.raises(KeyboardInterrupt):  # the command's body, past its check for a GPU
        stack.run(build_parser().parse_args(argv))
    import json

    rows = stack.rows_of(json.loads(path.read_text())["stack"])
    assert done == ["bn"] and {r.family for r in rows} == {"bn"} and len(rows) == 4


def test_gpu_stacks_compiled_take_the_compiled_layers(monkeypatch) -> None:
    """`profile stack --compile`: every family's stacks compiled, torch's beside cupynorm's with
    its kernels called directly and through the op."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    calls = []

    def profile_family(family, layers, bench, impls, cprofile=False, compiled=False):
        calls.append((family.name, layers, tuple(impls), compiled))
        return [stack.LayerRow(family.name, impl, 1.0, 2.0, 3.0, 4.0, 5.0) for impl in impls]

    monkeypatch.setattr(stack, "profile_family", profile_family)
    argv = ["profile", "stack", "--compile", "--family", "gn", "--layers", "20"]
    assert stack.run(build_parser().parse_args(argv)) == 0
    assert calls == [("gn", 20, ("torch", "cupynorm", "cupynorm op calls"), True)]


def test_cpu_model(monkeypatch, capsys) -> None:
    pytest.importorskip("torch")
    launches = _launch_counter(monkeypatch)
    assert main(["profile", "cpu", "--model", "--steps", "100"]) == 0
    out = capsys.readouterr().out
    assert "resnet50-shaped model (53 BatchNorm2d)" in out
    rows = {row[0]: row for row in _table(out).values()}
    assert set(rows) == {"torch (CPU kernels)", "cupynorm (fuse)", "no norms"}
    assert rows["no norms"][2] == "-" and float(rows["cupynorm (fuse)"][1]) > 0
    assert len(launches) > 0


def test_fake_device_restores_on_error() -> None:
    pytest.importorskip("torch")
    from cupynorm import _plan

    device_info = _plan.device_info
    with pytest.raises(ValueError, match="inside"), cpu.fake_device():
        assert _plan.device_info is not device_info
        raise ValueError("inside")
    assert _plan.device_info is device_info


def test_fake_device_leaves_no_launcher_in_the_cache(capsys) -> None:
    """The real launchers run uncached inside the fake device: a cached one would keep the faked
    kernel and driver for the real device's later calls in the same process (a GPU machine's
    test run)."""
    pytest.importorskip("torch")
    from cupynorm import _compile

    before = _compile.launcher.cache_info().currsize
    assert main(["profile", "cpu", "--family", "ln", "--layers", "2", "--steps", "3"]) == 0
    assert _compile.launcher.cache_info().currsize == before


def test_calls_by_hand_norms_are_torchs() -> None:
    """The hand-written CuPy norms `profile calls` checks cupynorm against (and times) compute
    what torch's functional does: run on NumPy arrays (the same array methods)."""
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    from cupynorm.bench.profile import calls

    by_name = {case.name: case for case in calls.cases()}
    assert [name.split("(")[0] for name in by_name] == [
        "group_norm", "instance_norm", "batch_norm", "layer_norm", "rms_norm", "layer_norm2d"
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    for case in by_name.values():
        a = rng.standard_normal((3, 16, 5, 4) if len(case.shapes[0]) == 4 else (6, 40))
        a = (a * 3 + 1).astype(np.float64)
        expected = case.torch_call(torch.from_numpy(a)).numpy()
        np.testing.assert_allclose(case.by_hand(a), expected, rtol=1e-6, atol=1e-6)
        assert all(len(shape) == len(case.shapes[0]) for shape in case.shapes)
