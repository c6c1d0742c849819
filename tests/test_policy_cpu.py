"""Which norm kinds run on cupynorm's kernels inside torch.compile (cupynorm.torch._policy):
the policy's API, and what a compiled graph holds under the default policy and under "all"
(CPU tensors sent down the CUDA route, aot_eager: no GPU, no C++ compiler)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import cupynorm.torch as cnt  # noqa: E402
from cupynorm.torch import _policy  # noqa: E402


@pytest.fixture
def policy():
    """Restores the policy the test found."""
    previous = _policy.compile_kernels()
    yield _policy
    _policy.set_compile_kernels(previous)


def test_set_compile_kernels_returns_the_previous_choice(policy) -> None:
    previous = cnt.set_compile_kernels("none")
    assert cnt.compile_kernels() == frozenset()
    assert cnt.set_compile_kernels(["group_norm", "layer_norm"]) == frozenset()
    assert cnt.compile_kernels() == {"group_norm", "layer_norm"}
    cnt.set_compile_kernels("batch_norm, rms_norm")
    assert cnt.compile_kernels() == {"batch_norm", "rms_norm"}
    cnt.set_compile_kernels("all")
    assert cnt.compile_kernels() == frozenset(policy.KINDS)
    cnt.set_compile_kernels("default")
    assert cnt.compile_kernels() == policy.DEFAULT
    cnt.set_compile_kernels(previous)
    assert cnt.compile_kernels() == previous


def test_an_unknown_kind_is_refused_and_changes_nothing(policy) -> None:
    before = cnt.compile_kernels()
    with pytest.raises(ValueError, match="unknown norm kind.*'layernorm'"):
        cnt.set_compile_kernels(["group_norm", "layernorm"])
    assert cnt.compile_kernels() == before


def test_the_default_keeps_the_group_norm_family_on_the_kernels() -> None:
    assert _policy.DEFAULT == {"group_norm", "instance_norm", "row_norm_add_mul"}
    assert _policy.DEFAULT <= _policy.KINDS.keys()


def test_eager_calls_never_ask_the_policy(policy) -> None:
    """Outside torch.compile no kind is left to Inductor, whatever the policy."""
    cnt.set_compile_kernels("none")
    assert not any(policy.inductor_takes(kind, torch.ones(1)) for kind in policy.KINDS)


@pytest.fixture
def compile_sizes():
    """Restores the compile sizes the test found."""
    previous = cnt.compile_min_bytes()
    yield
    cnt.set_compile_min_bytes(previous)


def test_the_default_compile_sizes_leave_small_group_and_instance_norms_to_inductor() -> None:
    sizes = _policy.COMPILE_DEFAULT
    assert sizes["group_norm"] == sizes["group_norm_act"] == 1 << 22
    assert sizes["instance_norm"] == 1 << 25
    assert {k for k, v in sizes.items() if v} == {"group_norm", "group_norm_act", "instance_norm"}


# module, its forward op, its kind
_SIZED = {
    "group_norm": (lambda: cnt.GroupNorm(2, 8), "group_norm_fwd", "group_norm"),
    "group_norm_act": (lambda: cnt.GroupNormAct(2, 8), "group_norm_act_fwd", "group_norm_act"),
    "instance_norm": (
        lambda: cnt.InstanceNorm2d(8, affine=True),
        "group_norm_fwd",  # without running statistics: the group norm of one channel a group
        "instance_norm",
    ),
}


@pytest.mark.parametrize("case", sorted(_SIZED))
def test_a_compiled_norm_under_its_size_is_inductors(kernels, policy, compile_sizes, case) -> None:
    """A kind on the kernels leaves its calls under the kind's compile size to Inductor
    (torch's functional call in the graph), and runs the op at and above it; both equal eager."""
    cnt.set_compile_kernels("default")
    torch.manual_seed(0)
    make, op, kind = _SIZED[case]
    norm = make()
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 8, 4, 4)  # 1 KiB of float32
    eager = norm(x)
    for size, on_kernels in ((1024, True), (1025, False), (0, True)):
        cnt.set_compile_min_bytes({kind: size})
        y, ops = _compiled_graph_ops(norm, x)
        assert any(op in o for o in ops) == on_kernels, (size, ops)
        torch.testing.assert_close(y, eager)
    torch._dynamo.reset()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = cnt.BatchNorm2d(8)
        self.gn = cnt.GroupNorm(2, 8)
        self.ln = cnt.LayerNorm(6)
        self.rms = cnt.RMSNorm(6)
        self.ln2d = cnt.LayerNorm2d(8)

    def forward(self, x):
        return self.rms(self.ln(self.ln2d(self.gn(torch.relu(self.bn(x))))))


def _compiled_graph_ops(model, x) -> tuple[torch.Tensor, set[str]]:
    """The compiled forward's output and the cupynorm ops of its graph."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    y = torch.compile(model, fullgraph=True, backend=backend)(x)
    ops = {
        str(node.target)
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "call_function" and "cupynorm" in str(node.target)
    }
    return y, ops


@pytest.mark.parametrize("choice", ["default", "all"])
def test_a_compiled_graph_holds_the_kernels_of_the_chosen_kinds(kernels, policy, choice) -> None:
    torch.manual_seed(0)
    eager = _Net()
    compiled = _Net()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(3, 8, 5, 6)
    cnt.set_compile_kernels(choice)
    y, ops = _compiled_graph_ops(compiled, x)
    torch._dynamo.reset()
    names = " ".join(sorted(ops))
    assert "group_norm" in names
    if choice == "default":
        assert not any(k in names for k in ("batch_norm", "row_norm", "channel_norm")), names
    else:
        assert "batch_norm" in names and "row_norm" in names, names
    torch.testing.assert_close(y, eager(x))
    # the running statistics were updated as eager torch's (F.batch_norm or the kernels)
    torch.testing.assert_close(compiled.bn.running_mean, eager.bn.running_mean)
    torch.testing.assert_close(compiled.bn.running_var, eager.bn.running_var)
    assert int(compiled.bn.num_batches_tracked) == int(eager.bn.num_batches_tracked) == 1


def test_changing_the_policy_recompiles(kernels, policy) -> None:
    """Dynamo guards on the policy: a graph traced under one choice is not reused under another."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(" ".join(str(node.target) for node in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(cnt.LayerNorm(6), backend=backend)
    x = torch.randn(3, 6)
    cnt.set_compile_kernels("default")
    compiled(x)
    cnt.set_compile_kernels("all")
    compiled(x)
    torch._dynamo.reset()
    assert ["row_norm" in graph for graph in graphs] == [False, True]
