"""Every CUDA source compiles under NVRTC for sm_80 and sm_90, with no GPU and no CUDA headers.

Also pins the compile-cache key: a change to any header changes the source hash that goes into
the options, so CuPy's disk cache cannot hand back a stale binary.
"""

from __future__ import annotations

import shutil

import pytest
from cupy.cuda import nvrtc  # works without a GPU or driver: NVRTC is a plain library

from cupynorm import _compile

VARIANTS = [
    (source, dtype, arch)
    for source in _compile.SOURCE_FILES
    for dtype in _compile.CTYPES
    for arch in ("compute_80", "compute_90")
]


def _compile_ptx(source: str, options: tuple[str, ...], arch: str) -> str:
    program = nvrtc.createProgram(_compile.read_source(source), source, [], [])
    try:
        nvrtc.compileProgram(program, [*options, f"-arch={arch}"])
    except nvrtc.NVRTCError as error:
        log = nvrtc.getProgramLog(program)
        raise AssertionError(f"{source} failed to compile:\n{log}") from error
    ptx = nvrtc.getPTX(program)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@pytest.mark.parametrize("source,dtype,arch", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_sources_compile(source: str, dtype: str, arch: str) -> None:
    ptx = _compile_ptx(source, _compile.compile_options(dtype), arch)
    assert ".entry" in ptx


def test_mixed_precision_params_compile() -> None:
    ptx = _compile_ptx(
        "strided_norm.cu", _compile.compile_options("float16", "float32"), "compute_80"
    )
    assert "strided_norm_apply_rows" in ptx


FLOAT32_OUTPUT_KERNELS = {  # the sources with float32 y / dy beside half x (autocast's norms)
    "row_norm.cu": ("row_norm_fwd_short_layer_32", "row_norm_bwd_short_4", "row_norm_to_out"),
    "strided_norm.cu": ("strided_norm_apply_cols", "strided_norm_bwd_sums_rows"),
    "fused_norm.cu": ("fused_norm_apply_cols_silu", "fused_norm_bwd_dx_rows_silu"),
    "segment_norm.cu": ("segment_norm_fwd_affine", "segment_norm_fwd_affine_silu_shift"),
}


@pytest.mark.parametrize("source", list(FLOAT32_OUTPUT_KERNELS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_output_variant_compiles(source: str, dtype: str) -> None:
    """float32 y / dy beside half-precision x: LayerNorm (row_norm.cu) and GroupNorm (on chip,
    the strided and fused passes) under autocast."""
    options = _compile.compile_options(dtype, "float32", "float32")
    assert f"-DOUT_T={_compile.CTYPES['float32']}" in options
    ptx = _compile_ptx(source, options, "compute_90")
    for kernel in FLOAT32_OUTPUT_KERNELS[source]:
        assert kernel in ptx


def test_source_hash_covers_headers(tmp_path, monkeypatch) -> None:
    copy = tmp_path / "cuda_src"
    shutil.copytree(_compile.source_dir(), copy)
    monkeypatch.setattr(_compile, "source_dir", lambda: copy)
    _compile.source_hash.cache_clear()
    try:
        before = _compile.source_hash()
        options_before = _compile.compile_options("float32")
        with open(copy / "common.cuh", "a") as header:
            header.write("\n// a change in a header only\n")
        _compile.source_hash.cache_clear()
        assert _compile.source_hash() != before
        assert _compile.compile_options("float32") != options_before
    finally:
        _compile.source_hash.cache_clear()


def test_sources_found_in_checkout() -> None:
    directory = _compile.source_dir()
    for name in _compile.SOURCE_FILES:
        assert (directory / name).is_file()


def test_recorded_launches_records_the_launches_inside_and_forwards_them(monkeypatch) -> None:
    made = []
    monkeypatch.setattr(_compile.Launcher, "launch", lambda self, *args: made.append(args))
    launcher = object.__new__(_compile.Launcher)
    with _compile.recorded_launches() as launches:
        launcher.launch((4, 2), (128,), 512, 7, (1, 2))
    launcher.launch(1, (32,), 0, 7, ())  # after: launched, not recorded
    assert launches == [(launcher, (4, 2), (128,), 512)]
    assert made == [((4, 2), (128,), 512, 7, (1, 2)), (1, (32,), 0, 7, ())]
