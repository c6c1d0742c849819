"""The size policies' API (cupynorm.torch.set_eager_min_bytes / eager_min_bytes,
set_capture_min_bytes / capture_min_bytes for calls inside a CUDA graph capture and
set_compile_min_bytes / compile_min_bytes inside torch.compile): parsing, the previous choice
returned, refusals that change nothing, the environment variables read at import. Where the
calls go is tested on the GPU (tests/test_eager_policy_gpu.py) and, compiled, on the CPU
(tests/test_policy_cpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch")

import cupynorm.torch as cnt  # noqa: E402
from cupynorm.torch import _policy  # noqa: E402


class Sizes(NamedTuple):
    """One of the size policies: eager calls, calls inside a CUDA graph capture, compiled calls."""

    set: Callable
    get: Callable
    default: Mapping[str, int]
    environment: str


SIZES = {
    "eager": Sizes(
        cnt.set_eager_min_bytes,
        cnt.eager_min_bytes,
        _policy.EAGER_DEFAULT,
        _policy.EAGER_ENVIRONMENT,
    ),
    "capture": Sizes(
        cnt.set_capture_min_bytes,
        cnt.capture_min_bytes,
        _policy.CAPTURE_DEFAULT,
        _policy.CAPTURE_ENVIRONMENT,
    ),
    "compile": Sizes(
        cnt.set_compile_min_bytes,
        cnt.compile_min_bytes,
        _policy.COMPILE_DEFAULT,
        _policy.COMPILE_ENVIRONMENT,
    ),
}


@pytest.fixture(params=list(SIZES))
def sizes(request):
    """Each size policy, its sizes (and the other's) restored after the test."""
    previous = {name: policy.get() for name, policy in SIZES.items()}
    yield SIZES[request.param]
    for name, policy in SIZES.items():
        policy.set(previous[name])


def test_set_returns_the_previous_choice_and_takes_it_back(sizes) -> None:
    before = sizes.get()
    previous = sizes.set(0)
    assert previous == before
    assert set(sizes.get().values()) == {0}
    assert sizes.set(previous) == dict.fromkeys(sizes.default, 0)
    assert sizes.get() == before


def test_the_policies_are_apart(sizes) -> None:
    others = [p for p in SIZES.values() if p is not sizes]
    before = [other.get() for other in others]
    sizes.set(12345)
    assert [other.get() for other in others] == before


def test_a_mapping_or_a_string_changes_only_the_kinds_it_names(sizes) -> None:
    sizes.set("default")
    sizes.set({"layer_norm": 5})
    assert sizes.get() == {**sizes.default, "layer_norm": 5}
    sizes.set("rms_norm=7, group_norm=0")
    expected = {**sizes.default, "layer_norm": 5, "rms_norm": 7, "group_norm": 0}
    assert sizes.get() == expected
    sizes.set(" Default ")
    assert sizes.get() == dict(sizes.default)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ({"layernorm": 1}, ValueError, "unknown norm kind.*'layernorm'"),
        ({"layer_norm": -1}, ValueError, "size in bytes >= 0 for 'layer_norm'"),
        ({"layer_norm": 1.5}, ValueError, "size in bytes >= 0"),
        ("layer_norm=big", ValueError, "expected 'default', a size in bytes"),
        ("lots", ValueError, "expected 'default', a size in bytes"),
        (True, TypeError, "expected 'default'"),
        ([("layer_norm", 1)], TypeError, "expected 'default'"),
    ],
)
def test_a_refused_choice_changes_nothing(value, error, match, sizes) -> None:
    before = sizes.get()
    with pytest.raises(error, match=match):
        sizes.set(value)
    assert sizes.get() == before


def test_the_returned_dict_is_a_copy(sizes) -> None:
    sizes.set({"layer_norm": 5})
    sizes.get()["layer_norm"] = 123
    assert sizes.get()["layer_norm"] == 5


def test_the_kinds_are_the_compile_policys_with_the_fused_forms_apart(sizes) -> None:
    fused = {"batch_norm_act", "group_norm_act", "llama_rms_norm"}
    assert sizes.default.keys() == _policy.KINDS.keys() | fused


@pytest.mark.parametrize(
    ("value", "expected", "warns"),
    [("0", 0, False), ("layer_norm=3", 3, False), ("nonsense", None, True)],
)
def test_the_environment_variable_is_read_at_import(value, expected, warns, sizes) -> None:
    code = (
        "import warnings, json\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import cupynorm.torch as cnt\n"
        f"print(json.dumps([cnt.{sizes.get.__name__}()['layer_norm'],"
        f" any({sizes.environment!r} in str(w.message) for w in caught)]))\n"
    )
    env = {**os.environ, sizes.environment: value}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    size, warned = json.loads(out.stdout.strip().splitlines()[-1])
    assert warned == warns
    if expected is None:
        assert size == sizes.default["layer_norm"]
    else:
        assert size == expected


# ---- the choice while the GPU keeps up (set_eager_adaptive) -----------------------------------
def test_set_eager_adaptive_returns_the_previous_setting_and_refuses_non_bools() -> None:
    before = _policy.EAGER_ADAPTIVE[0]
    try:
        assert cnt.set_eager_adaptive(False) is before
        assert cnt.set_eager_adaptive(True) is False
        with pytest.raises(TypeError, match="expects a bool"):
            cnt.set_eager_adaptive(1)
        assert _policy.EAGER_ADAPTIVE[0] is True
    finally:
        cnt.set_eager_adaptive(before)


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("1", True), (None, True)])
def test_the_adaptive_environment_variable_is_read_at_import(value, expected) -> None:
    env = {k: v for k, v in os.environ.items() if k != _policy.ADAPTIVE_ENVIRONMENT}
    if value is not None:
        env[_policy.ADAPTIVE_ENVIRONMENT] = value
    code = "from cupynorm.torch import _policy; print(_policy.EAGER_ADAPTIVE[0])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == str(expected)


class _FakeRuntime:
    """cupy.cuda.runtime's event calls: an event is complete unless ``pending``."""

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status: int) -> None:
            super().__init__(status)
            self.status = status

    def __init__(self, device: int = 0) -> None:
        self.device, self.pending, self.records, self.created = device, False, [], 0
        self.destroyed: list[int] = []

    def getDevice(self) -> int:
        return self.device

    def eventCreateWithFlags(self, flags: int) -> int:
        self.created += 1
        return 1000 + self.created

    def eventRecord(self, event: int, stream: int) -> None:
        self.records.append((event, stream))

    def eventQuery(self, event: int) -> int:
        return _policy._NOT_READY if self.pending else 0

    def eventDestroy(self, event: int) -> None:
        self.destroyed.append(event)


@pytest.fixture
def fake_runtime(monkeypatch):
    runtime = _FakeRuntime()
    monkeypatch.setattr(_policy._compile, "_runtime", lambda: runtime)
    monkeypatch.setattr(_policy, "_raw_stream", lambda device: 7)
    monkeypatch.setattr(_policy, "_probes", {})
    clock = [100.0]
    monkeypatch.setattr(_policy.time, "perf_counter", lambda: clock[0])
    runtime.clock = clock
    return runtime


def test_the_probe_reads_the_event_of_the_previous_call(fake_runtime) -> None:
    """The first call on a stream keeps the kernels and records; each later one answers from
    the event the previous one recorded, then records it again."""
    runtime = fake_runtime
    assert _policy.gpu_behind(0) is True  # no earlier call: the kernels, as before
    assert runtime.created == 1 and runtime.records == [(1001, 7)]
    runtime.clock[0] += 1e-3
    assert _policy.gpu_behind(0) is False  # the GPU finished the previous call's work
    runtime.pending = True
    runtime.clock[0] += 1e-3
    assert _policy.gpu_behind(0) is True
    assert runtime.created == 1 and len(runtime.records) == 3


def test_two_probes_of_one_call_give_one_answer(fake_runtime) -> None:
    runtime = fake_runtime
    _policy.gpu_behind(0)
    runtime.clock[0] += 1e-3
    assert _policy.gpu_behind(0) is False
    runtime.pending = True
    runtime.clock[0] += 5e-6  # the same call asking again (a route checks twice)
    assert _policy.gpu_behind(0) is False
    assert len(runtime.records) == 2


def test_the_probe_keeps_the_kernels_where_it_cannot_tell(fake_runtime, monkeypatch) -> None:
    """Another device current than the tensor's, or deterministic algorithms: the kernels and
    no event recorded."""
    runtime = fake_runtime
    runtime.device = 1
    assert _policy.gpu_behind(0) is True
    runtime.device = 0
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert _policy.gpu_behind(0) is True
    assert runtime.records == []


def test_a_not_ready_error_reads_as_behind(fake_runtime) -> None:
    runtime = fake_runtime

    def raising(event: int) -> int:
        raise runtime.CUDARuntimeError(_policy._NOT_READY)

    _policy.gpu_behind(0)
    runtime.eventQuery = raising
    runtime.clock[0] += 1e-3
    assert _policy.gpu_behind(0) is True


def test_the_probes_start_over_past_their_number(fake_runtime, monkeypatch) -> None:
    """One event per (device, stream): a program making streams by the hundred does not keep
    an event for each."""
    streams = iter(range(1000))
    monkeypatch.setattr(_policy, "_raw_stream", lambda device: next(streams))
    for _ in range(_policy._MAX_PROBES):
        _policy.gpu_behind(0)
    assert len(_policy._probes) == _policy._MAX_PROBES and not fake_runtime.destroyed
    _policy.gpu_behind(0)
    assert len(fake_runtime.destroyed) == _policy._MAX_PROBES and len(_policy._probes) == 1
