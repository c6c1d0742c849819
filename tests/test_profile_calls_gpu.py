"""`python -m cupynorm profile calls` on the GPU: every case checked and timed, every column
filled where its library is installed, the JSON written. Needs CuPy and a GPU, not torch (a
CuPy-only install runs it)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from cupynorm.bench.profile.common import cupy_cuda_problem

_PROBLEM = cupy_cuda_problem()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_PROBLEM is not None, reason=str(_PROBLEM))]


def test_profile_calls_measures_every_case(tmp_path, capsys) -> None:
    from cupynorm.__main__ import main
    from cupynorm.bench.profile import calls

    path = tmp_path / "calls.json"
    assert main(["profile", "calls", "--calls", "20", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| call | input (fp32) | CuPy array |" in out
    report = json.loads(path.read_text())
    rows = report["rows"]
    assert len(rows) == 2 * len(calls.cases())
    has_jax = importlib.util.find_spec("jax") is not None
    has_torch = importlib.util.find_spec("torch") is not None
    for row in rows:
        for key in ("cupy_us", "kernels_gpu_us", "cupy_by_hand_gpu_us"):
            assert row[key] > 0, (row["call"], key)
        assert (row["jax_us"] is not None) == has_jax
        assert (row["torch_tensor_us"] is not None) == has_torch
        assert (row["torch_own_us"] is not None) == has_torch
        with_module = has_torch and not row["call"].startswith("layer_norm2d")
        assert (row["module_us"] is not None) == with_module
        # the breakdown of the replayed call: every piece timed, counted from its program
        assert (row.get("torch_parts") is not None) == has_torch
        for parts in (row["cupy_parts"], row.get("torch_parts") or row["cupy_parts"]):
            assert parts["launches"] >= 1 and parts["allocations"] >= 1, row["call"]
            for key in ("call_us", "key_us", "allocations_us", "launches_us"):
                assert parts[key] > 0, (row["call"], key)
    assert "| call | input (fp32) | array | call | key + lookup |" in out
