"""The built distributions ship the whole package and the CUDA sources.

`cuda_src/` lives at the repo root; pyproject.toml maps it into the wheel as `cupynorm/cuda_src/`
(hatchling `force-include`) and puts it in the sdist as `cuda_src/`. This test builds both (the
wheel from the sdist, as `python -m build` does) and compares them byte for byte with the checkout.

Runs on the CPU, no GPU needed. It never skips: without the `build` package it fails.
"""

from __future__ import annotations

import email.parser
import importlib.util
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_SRC = ROOT / "cuda_src"
PACKAGE = ROOT / "cupynorm"

# What hatchling leaves out of a forced directory anyway, and what no build should ship.
_SKIP_DIRS = {"__pycache__", ".git", ".ipynb_checkpoints"}


def _walk(base: Path, suffixes: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Files under `base` by posix path relative to it, minus caches and hidden files."""
    found: dict[str, Path] = {}
    for path in sorted(base.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(base)
        if any(part in _SKIP_DIRS or part.startswith(".") for part in rel.parts):
            continue
        if path.suffix in (".pyc", ".pyo"):
            continue
        if suffixes is not None and path.suffix not in suffixes:
            continue
        found[rel.as_posix()] = path
    return found


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Build sdist + wheel (wheel from the sdist) into a temp dir; return (wheel, sdist)."""
    if importlib.util.find_spec("build") is None:
        pytest.fail(
            "the 'build' package is not installed; install the test extra: pip install -e '.[test]'"
        )
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "build", "--outdir", str(out)]
    # With the backend already installed, build without an isolated env (no download needed, so
    # this also works on a machine with no network); otherwise let `build` fetch hatchling.
    if importlib.util.find_spec("hatchling") is not None:
        cmd.append("--no-isolation")
    cmd.append(str(ROOT))
    # cwd outside the repo: a stray ./build/ folder must not shadow the `build` package.
    proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} failed with exit code {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    wheels = sorted(out.glob("cupynorm-*.whl"))
    sdists = sorted(out.glob("cupynorm-*.tar.gz"))
    assert len(wheels) == 1, f"expected one wheel in {out}, found {wheels}"
    assert len(sdists) == 1, f"expected one sdist in {out}, found {sdists}"
    return wheels[0], sdists[0]


@pytest.fixture(scope="module")
def wheel(dists: tuple[Path, Path]) -> Iterator[zipfile.ZipFile]:
    with zipfile.ZipFile(dists[0]) as zf:
        yield zf


@pytest.fixture(scope="module")
def sdist(dists: tuple[Path, Path]) -> Iterator[tarfile.TarFile]:
    with tarfile.open(dists[1]) as tf:
        yield tf


def _sdist_prefix(tf: tarfile.TarFile) -> str:
    tops = {name.split("/", 1)[0] for name in tf.getnames()}
    assert len(tops) == 1, f"sdist has more than one top-level folder: {sorted(tops)}"
    return tops.pop()


def _dist_info(zf: zipfile.ZipFile) -> str:
    infos = {n.split("/", 1)[0] for n in zf.namelist() if n.split("/", 1)[0].endswith(".dist-info")}
    assert len(infos) == 1, f"wheel has {len(infos)} .dist-info folders: {sorted(infos)}"
    return infos.pop()


def test_checkout_has_cuda_sources() -> None:
    sources = _walk(CUDA_SRC)
    assert any(name.endswith(".cu") for name in sources), f"no .cu file under {CUDA_SRC}"


def test_wheel_ships_cuda_sources_byte_identical(wheel: zipfile.ZipFile) -> None:
    sources = _walk(CUDA_SRC)
    assert sources, f"no files under {CUDA_SRC}"
    prefix = "cupynorm/cuda_src/"
    shipped = {n[len(prefix) :] for n in wheel.namelist() if n.startswith(prefix) and n != prefix}
    missing = sorted(set(sources) - shipped)
    assert not missing, f"cuda_src files missing from the wheel: {missing}"
    for rel, path in sources.items():
        assert wheel.read(prefix + rel) == path.read_bytes(), f"{prefix}{rel} differs from {path}"
    extra = sorted(shipped - set(sources))
    assert not extra, f"wheel has files under {prefix} that are not in cuda_src/: {extra}"


def test_wheel_ships_package_and_torch_subpackage(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "cupynorm/__init__.py" in names
    assert "cupynorm/torch/__init__.py" in names
    missing = sorted(
        f"cupynorm/{rel}" for rel in _walk(PACKAGE, (".py",)) if f"cupynorm/{rel}" not in names
    )
    assert not missing, f"package modules missing from the wheel: {missing}"
    dist_info = _dist_info(wheel)
    stray = sorted(n for n in names if not n.startswith(("cupynorm/", dist_info + "/")))
    assert not stray, f"wheel has files outside cupynorm/ and {dist_info}/: {stray}"
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_wheel_metadata(wheel: zipfile.ZipFile) -> None:
    dist_info = _dist_info(wheel)
    meta = email.parser.Parser().parsestr(wheel.read(f"{dist_info}/METADATA").decode())
    assert meta["Name"] == "cupynorm"
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["License-Expression"] == "MIT"
    assert f"{dist_info}/licenses/LICENSE" in wheel.namelist()
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"cuda12x", "cuda13x", "torch", "test"} <= extras, extras
    requires = " | ".join(meta.get_all("Requires-Dist") or [])
    for req in ("numpy", "cupy-cuda12x>=14.2", "cupy-cuda13x>=14.2", "torch>=2.11"):
        assert req in requires, f"{req!r} not in Requires-Dist: {requires}"
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "cupynorm = cupynorm.__main__:main" in entry_points, entry_points


def test_sdist_ships_sources(sdist: tarfile.TarFile) -> None:
    top = _sdist_prefix(sdist)
    names = set(sdist.getnames())
    for required in (
        "pyproject.toml",
        "LICENSE",
        "cupynorm/__init__.py",
        "cupynorm/torch/__init__.py",
    ):
        assert f"{top}/{required}" in names, f"{required} missing from the sdist"
    for rel, path in _walk(CUDA_SRC).items():
        member = f"{top}/cuda_src/{rel}"
        assert member in names, f"{member} missing from the sdist"
        extracted = sdist.extractfile(member)
        assert extracted is not None and extracted.read() == path.read_bytes(), member


def test_each_test_draws_from_its_own_seed(request) -> None:
    """conftest's autouse fixture: NumPy's and (where installed) torch's generators start from
    the test id's CRC-32, whatever ran before on this worker."""
    import zlib

    import numpy

    seed = zlib.crc32(request.node.nodeid.encode())
    expected = numpy.random.RandomState(seed).random_sample(3)
    assert (numpy.random.random_sample(3) == expected).all()
    torch = sys.modules.get("torch")
    if torch is not None:
        assert torch.initial_seed() == seed


def test_the_default_run_samples_every_sweep() -> None:
    """conftest's sample of the parametrized tests: about sqrt(n) of a test's n cases, the same
    ones every time, at least one per test, and none marked ``exhaustive``."""
    import math
    from pathlib import Path

    from conftest import sampled

    class Item:
        def __init__(self, name: str, case: int | None, exhaustive: bool = False) -> None:
            self.path, self.originalname = Path("tests/test_x.py"), name
            self.nodeid = f"tests/test_x.py::{name}" + ("" if case is None else f"[{case}]")
            self.exhaustive = exhaustive

        def get_closest_marker(self, name: str):
            return "marked" if name == "exhaustive" and self.exhaustive else None

    items = [Item("test_grid", i) for i in range(400)] + [Item("test_pair", i) for i in range(2)]
    items += [Item("test_one", None), Item("test_long", None, exhaustive=True)]
    kept = sampled(items)
    assert [i.nodeid for i in kept] == [i.nodeid for i in sampled(items)]
    grid = [i for i in kept if i.originalname == "test_grid"]
    assert 0.5 * math.sqrt(400) <= len(grid) <= 2 * math.sqrt(400)
    assert [i.originalname for i in kept if i.originalname != "test_grid"] == [
        "test_pair",
        "test_pair",
        "test_one",
    ]
    # a sweep whose hash picks none still runs one case
    few = [Item(f"test_rare_{k}", i) for k in range(30) for i in range(7)]
    by_test = {i.originalname for i in sampled(few)}
    assert by_test == {f"test_rare_{k}" for k in range(30)}
