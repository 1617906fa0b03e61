"""csrc/cuda builds without a GPU: CI catches a CUDA build break.

* every ``csrc/cuda/*.cu`` compiles with ``nvcc -std=c++17 -c -arch=sm_90``;
* the C ABI header ``rfmem_cuda.h`` is valid C and C++ on its own (no CUDA header);
* ``csrc/cuda/CMakeLists.txt`` configures and builds the static library
  ``rfmem_cuda_kernels`` for the default architectures (80;90) when cmake is present.

Skipped when nvcc is neither on PATH nor at /usr/local/cuda/bin/nvcc. Nothing here
runs a kernel: that needs a GPU (see rfmem_fast/backends/cuda_ext.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
CU_FILES = sorted(CUDA_DIR.glob("*.cu"))


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


NVCC = _nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda/bin)")


def _run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_cuda_sources_exist():
    assert CU_FILES, f"no .cu file in {CUDA_DIR}"
    assert (CUDA_DIR / "rfmem_cuda.h").is_file()
    assert (CUDA_DIR / "CMakeLists.txt").is_file()
    assert (CUDA_DIR / "bindings.cpp").is_file()


@needs_nvcc
@pytest.mark.parametrize("src", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cu_file_compiles_for_sm90(src, tmp_path):
    out = tmp_path / (src.stem + ".o")
    res = _run([NVCC, "-std=c++17", "-c", "-arch=sm_90", "-O3", "-I", str(CUDA_DIR), str(src), "-o", str(out)])
    assert res.returncode == 0, f"nvcc failed on {src.name}:\n{res.stdout}\n{res.stderr}"
    assert out.is_file() and out.stat().st_size > 0


@pytest.mark.parametrize("lang,compiler", [("c", "cc"), ("c++", "c++")])
def test_header_is_plain_c_and_cpp(lang, compiler, tmp_path):
    cc = shutil.which(compiler) or shutil.which("gcc" if lang == "c" else "g++")
    if cc is None:
        pytest.skip(f"no {lang} compiler")
    src = tmp_path / ("use.c" if lang == "c" else "use.cpp")
    src.write_text(
        '#include "rfmem_cuda.h"\n'
        "int main(void) {\n"
        "  int (*f)(const float*, const int64_t*, int64_t, const float*, const int64_t*, int64_t,\n"
        "           int64_t, int64_t, float*, int64_t*, void*) = rfmem_cuda_segmented_topk_warp;\n"
        "  (void)f; return RFMEM_CUDA_TOPK_MAX_K > 0 ? 0 : 1;\n"
        "}\n"
    )
    std = "-std=c99" if lang == "c" else "-std=c++17"
    res = _run([cc, std, "-Wall", "-Werror", "-fsyntax-only", "-I", str(CUDA_DIR), str(src)])
    assert res.returncode == 0, res.stderr


@needs_nvcc
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not found")
def test_cmake_builds_static_library(tmp_path):
    env = dict(os.environ)
    env.setdefault("CUDACXX", NVCC)
    env.pop("CUDAARCHS", None)
    build = tmp_path / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    res = _run(["cmake", "-S", str(CUDA_DIR), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release"], env=env)
    assert res.returncode == 0, f"configure failed:\n{res.stdout}\n{res.stderr}"
    res = _run(["cmake", "--build", str(build), "--target", "rfmem_cuda_kernels"], env=env)
    assert res.returncode == 0, f"build failed:\n{res.stdout}\n{res.stderr}"
    libs = list(build.rglob("librfmem_cuda_kernels.a")) + list(build.rglob("rfmem_cuda_kernels.lib"))
    assert libs, "static library not produced"
    cache = (build / "CMakeCache.txt").read_text()
    assert "RFMEM_CUDA_ARCHITECTURES:STRING=80;90" in cache
