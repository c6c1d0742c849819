"""Shared test helpers: GPU detection, poisoning of the allocator's memory, the replay check of
every recorded call on a GPU, and the fixtures that send CPU tensors down cupynorm.torch's CUDA
route onto the reference kernels (``kernels``, ``kernel_path``). Under pytest-xdist: each worker's
share of the cores (its thread pools), and ``once_per_run`` for work its workers share. The
default run samples the parametrized sweeps; ``--exhaustive`` runs every case
(:func:`pytest_collection_modifyitems`)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib.util
import json
import math
import os
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

# The test modules that need torch: a CuPy-only install (`pip install ".[cuda12x]" pytest
# hypothesis`, no torch) runs the others, and CI runs such an install (.ci/run). A new module
# that imports torch at its top belongs here (that CI run fails on it otherwise).
_NEEDS_TORCH = [
    "test_channel_norm_cpu.py",
    "test_convergence_cpu.py",
    "test_convert_cpu.py",
    "test_fused_cpu.py",
    "test_group_norm_act_cpu.py",
    "test_layer_norm_cpu.py",
    "test_llama_rms_norm_cpu.py",
    "test_plan_cpu.py",
    "test_programs_cpu.py",
    "test_programs_gpu.py",
    "test_reliability_gpu.py",
    "test_single_launch_gpu.py",
    "test_sync_batchnorm_cpu.py",
    "test_sync_batchnorm_gpu.py",
    "test_torch_errors_cpu.py",
    "test_torch_modules_cpu.py",
    "test_torch_modules_gpu.py",
    "test_validation_cpu.py",
]
if importlib.util.find_spec("torch") is None:
    collect_ignore = _NEEDS_TORCH

# What each pytest-xdist worker's thread pools may use: torch (and OpenMP, MKL, OpenBLAS) start
# as many threads as there are cores in every process, so 14 workers on 16 cores ran 224 threads
# whose parallel regions waited on each other's preempted threads (the bench's dry run of two tiny
# models, 2 s alone on 2 cores, took 185 s there). The variables reach the processes a test
# spawns too.
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _threads_per_xdist_worker() -> int | None:
    """The cores' share of one worker; None outside pytest-xdist (the user's setting stands)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // workers)
    with contextlib.suppress(ValueError):  # a smaller setting of the user's stands
        share = min(share, int(os.environ.get("OMP_NUM_THREADS", share)))
    return max(1, share)


def _share_the_cores_between_xdist_workers() -> None:
    threads = _threads_per_xdist_worker()
    if threads is None:
        return
    for name in _THREAD_VARIABLES:
        os.environ[name] = str(threads)
    # Inductor compiles in a pool of one process per core unless told otherwise: one per worker
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(threads)  # torch may be imported already: the variables come too late


_share_the_cores_between_xdist_workers()


# ---- the default run: a sample of every sweep --------------------------------------------------
# The full grid of the parametrized tests (dtypes x layouts x shapes x forms) takes ~23 minutes on
# one GPU without xdist; `python -m pytest -q` runs about sqrt(n) of a test's n cases, the same ones
# every run (chosen by a hash of the test id, so every parameter value has its chance), plus every
# test of one case: 7.5 minutes on an H200 (benchmarks/NOTES.md). `--exhaustive` runs all of them,
# as do scripts/gpu_check.sh and CI; so does a run that names tests (`file::test`) or filters them
# (`-k`). A test marked `exhaustive` (a long run of its own) runs only then (`--exhaustive -m
# exhaustive`: those alone).
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="run every case of the parametrized sweeps and the tests marked exhaustive "
        "(the default runs about sqrt(n) of a test's n cases)",
    )


def _runs_everything(config: pytest.Config) -> bool:
    return bool(
        config.getoption("exhaustive")
        or config.option.keyword
        or any("::" in arg for arg in config.args)
    )


def sampled(items: list) -> list:
    """The default run's share of ``items``: of each test function's n cases those whose id
    hashes below ceil(sqrt(n)) (at least one), none marked ``exhaustive``."""
    cases: dict[tuple, list] = {}
    for item in items:
        function = getattr(item, "originalname", None) or item.name  # without the parameters
        cases.setdefault((item.path, function), []).append(item)
    keep = set()
    for group in cases.values():
        group = [item for item in group if item.get_closest_marker("exhaustive") is None]
        n = len(group)
        share = math.ceil(math.sqrt(n))
        chosen = [item for item in group if zlib.crc32(item.nodeid.encode()) % n < share]
        keep.update(map(id, chosen or group[:1]))
    return [item for item in items if id(item) in keep]


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if _runs_everything(config):
        return
    kept = sampled(items)
    if len(kept) < len(items):
        chosen = set(map(id, kept))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in chosen])
        items[:] = kept


def pytest_report_header(config: pytest.Config) -> str:
    if _runs_everything(config):
        return "sweeps: every case"
    return "sweeps: sampled (about sqrt(n) of a test's n cases); --exhaustive runs every case"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


requires_gpu = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")


def timm_norm_act():
    """timm.layers.norm_act, or the test skipped (timm missing, or its own imports failing:
    timm present without torchvision)."""
    try:
        return pytest.importorskip("timm.layers.norm_act")
    except ImportError as error:
        pytest.skip(f"timm does not import: {error}")


def load_script(name: str):
    """``scripts/<name>.py`` as a module (scripts/ is no package), loaded once per process."""
    module_name = f"{name}_script"
    if module_name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def once_per_run(tmp_path_factory, name: str, compute: Callable[[Path], object]):
    """``compute(folder)``, run once per test run: under pytest-xdist the first worker that asks
    computes (a lock held meanwhile) and the others read its JSON result, so a module-scoped
    fixture that spawns processes runs once, not in every worker that runs one of its tests.
    The others fail with its exception's message."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compute(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # the run's folder, above each worker's own
    path = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.is_file():
            try:
                value = compute(tmp_path_factory.mktemp(name))
            except Exception as error:
                path.write_text(json.dumps({"error": f"{type(error).__name__}: {error}"}))
                raise
            path.write_text(json.dumps({"value": value}))
            return value
    outcome = json.loads(path.read_text())
    if "error" in outcome:
        raise RuntimeError(f"{name} (in the worker that ran it): {outcome['error']}")
    return outcome["value"]


def poison_torch_allocator(nbytes: int = 64 << 20) -> None:
    """Fill freed blocks of torch's caching allocator with NaN, so an unwritten output shows."""
    import torch

    block = torch.empty(nbytes // 4, device="cuda")
    block.fill_(float("nan"))
    del block


def poison_cupy_pool(nbytes: int = 64 << 20) -> None:
    import cupy

    block = cupy.empty(nbytes // 4, dtype=cupy.float32)
    block.fill(cupy.nan)
    del block


def _assert_identical(recorded: tuple, replayed: tuple) -> None:
    """The outputs of a call and of its replay: same dtype, shape, strides, bits."""
    assert len(recorded) == len(replayed)
    for a, b in zip(recorded, replayed, strict=True):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype
        if type(a).__module__.startswith("cupy"):
            import cupy

            assert a.strides == b.strides
            cupy.testing.assert_array_equal(a, b)
        else:
            import torch

            assert a.stride() == b.stride()
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(autouse=True, scope="session")
def _replay_every_recorded_call():
    """On a GPU, every call the host code records is replayed at once and both outputs compared,
    so each test checks the replay path (cupynorm._program) as well as the first call."""
    if not cuda_available():
        yield
        return
    from cupynorm import _program

    _program.check_replay = _assert_identical
    yield
    _program.check_replay = None


@pytest.fixture(autouse=True, scope="session")
def _every_norm_on_the_kernels():
    """The tests check cupynorm's kernels: every call on them, eager, captured and compiled at
    any size (the defaults send small calls to torch's op: tests/test_eager_policy_gpu.py, and
    to Inductor: tests/test_policy_cpu.py) and inside compiled graphs for every kind (the
    default leaves some kinds to Inductor: tests/test_policy_cpu.py), restored after the
    session."""
    try:
        from cupynorm.torch import _policy
    except ImportError:  # no torch
        yield
        return
    previous = (
        _policy.set_compile_kernels("all"),
        _policy.set_eager_min_bytes(0),
        _policy.set_capture_min_bytes(0),
        _policy.set_compile_min_bytes(0),
    )
    yield
    _policy.set_compile_kernels(previous[0])
    _policy.set_eager_min_bytes(previous[1])
    _policy.set_capture_min_bytes(previous[2])
    _policy.set_compile_min_bytes(previous[3])


@pytest.fixture(autouse=True)
def _each_test_draws_its_own_data(request):
    """Each test starts with the random generators seeded from its own id: torch's (CPU and
    CUDA), NumPy's global one, and CuPy's where a GPU is there. Its data is then the same
    whatever ran before it on its worker (the suite runs in random order under xdist; a test
    that drew without a seed once failed a tolerance on the draw another order gave it) and
    differs from any other test's. torch's and NumPy's states are restored after the test;
    CuPy's generator stays as the test left it (it has no state to save)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    numpy = sys.modules.get("numpy")
    numpy_state = None if numpy is None else numpy.random.get_state()
    if numpy is not None:
        numpy.random.seed(seed)
    torch = sys.modules.get("torch")
    if "cupy" in sys.modules and cuda_available():
        sys.modules["cupy"].random.seed(seed)
    if torch is None:
        yield
    else:
        devices = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield
    if numpy_state is not None:
        numpy.random.set_state(numpy_state)


@pytest.fixture(autouse=True)
def _large_tests_have_the_gpu_alone(request, tmp_path_factory):
    """Under pytest-xdist, a test marked ``large`` (tens of GB of GPU memory) runs while no other
    worker runs a test, and gives its cached memory back before the others go on: run beside
    them it took 126 of the H200's 140 GB and a dozen tests of other workers ran out of memory.
    Every test holds a shared lock, a large one the exclusive lock; a gate taken before either
    lets a waiting large test in before new shared holders (flock alone would starve it)."""
    if "PYTEST_XDIST_WORKER" not in os.environ or not cuda_available():
        yield
        return
    large = request.node.get_closest_marker("large") is not None
    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / "gpu.gate", "w") as gate, open(shared / "gpu.lock", "w") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if large else fcntl.LOCK_SH)
        if not large:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            if large:
                import torch

                gc.collect()
                torch.cuda.empty_cache()
        # both released as the files close


@pytest.fixture
def frozen_heap():
    """The objects that exist when the test starts are left out of the garbage collector's passes
    until it ends: the bench collects garbage between its cells (gc.collect), which in a test
    process holding torch, dynamo, transformers and diffusers scans some 300k objects each time
    (0.16 s; a quarter of the models dry run's time)."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def kernels(monkeypatch):
    """Send CPU tensors down the CUDA route (eager fast path), onto the reference kernels."""
    from torch_cpu_helpers import patch_route

    patch_route(monkeypatch.setattr, "_use_kernels", lambda x, kind: True)


@pytest.fixture(params=["eager", "custom_op"])
def kernel_path(request, monkeypatch):
    """The CUDA route on CPU tensors, through the eager Functions or the custom ops."""
    from torch_cpu_helpers import patch_route

    patch_route(monkeypatch.setattr, "_use_kernels", lambda x, kind: True)
    if request.param == "custom_op":
        patch_route(monkeypatch.setattr, "_traced", lambda x: True)
    return request.param
