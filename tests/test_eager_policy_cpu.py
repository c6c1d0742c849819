"""The eager size policy's API (cupynorm.torch.set_eager_min_bytes / eager_min_bytes): parsing,
the previous choice returned, refusals that change nothing, the environment variable read at
import. Where the calls go is tested on the GPU (tests/test_eager_policy_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import cupynorm.torch as cnt  # noqa: E402
from cupynorm.torch import _policy  # noqa: E402


@pytest.fixture
def restore():
    previous = cnt.eager_min_bytes()
    yield
    cnt.set_eager_min_bytes(previous)


def test_set_returns_the_previous_choice_and_takes_it_back(restore) -> None:
    before = cnt.eager_min_bytes()
    previous = cnt.set_eager_min_bytes(0)
    assert previous == before
    assert set(cnt.eager_min_bytes().values()) == {0}
    assert cnt.set_eager_min_bytes(previous) == dict.fromkeys(_policy.EAGER_DEFAULT, 0)
    assert cnt.eager_min_bytes() == before


def test_a_mapping_or_a_string_changes_only_the_kinds_it_names(restore) -> None:
    cnt.set_eager_min_bytes("default")
    cnt.set_eager_min_bytes({"layer_norm": 5})
    assert cnt.eager_min_bytes() == {**_policy.EAGER_DEFAULT, "layer_norm": 5}
    cnt.set_eager_min_bytes("rms_norm=7, group_norm=0")
    expected = {**_policy.EAGER_DEFAULT, "layer_norm": 5, "rms_norm": 7, "group_norm": 0}
    assert cnt.eager_min_bytes() == expected
    cnt.set_eager_min_bytes(" Default ")
    assert cnt.eager_min_bytes() == dict(_policy.EAGER_DEFAULT)


@pytest.mark.parametrize(
    ("sizes", "error", "match"),
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
def test_a_refused_choice_changes_nothing(sizes, error, match, restore) -> None:
    before = cnt.eager_min_bytes()
    with pytest.raises(error, match=match):
        cnt.set_eager_min_bytes(sizes)
    assert cnt.eager_min_bytes() == before


def test_the_returned_dict_is_a_copy(restore) -> None:
    cnt.set_eager_min_bytes({"layer_norm": 5})
    cnt.eager_min_bytes()["layer_norm"] = 123
    assert cnt.eager_min_bytes()["layer_norm"] == 5


def test_the_kinds_are_the_compile_policys_with_the_fused_forms_apart() -> None:
    fused = {"batch_norm_act", "group_norm_act", "llama_rms_norm"}
    assert _policy.EAGER_DEFAULT.keys() == _policy.KINDS.keys() | fused


@pytest.mark.parametrize(
    ("value", "expected", "warns"),
    [("0", 0, False), ("layer_norm=3", 3, False), ("nonsense", None, True)],
)
def test_the_environment_variable_is_read_at_import(value, expected, warns) -> None:
    code = (
        "import warnings, json\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import cupynorm.torch as cnt\n"
        "print(json.dumps([cnt.eager_min_bytes()['layer_norm'],"
        " any('CUPYNORM_EAGER_MIN_BYTES' in str(w.message) for w in caught)]))\n"
    )
    env = {**os.environ, _policy.EAGER_ENVIRONMENT: value}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    size, warned = json.loads(out.stdout.strip().splitlines()[-1])
    assert warned == warns
    if expected is None:
        assert size == _policy.EAGER_DEFAULT["layer_norm"]
    else:
        assert size == expected
