"""Optional "cuda" backend: the warp-level CUDA top-k of ``csrc/cuda`` behind the torch backend.

:class:`CudaBackend` is :class:`~rfmem_fast.backends.torch_backend.TorchBackend` (its
batched KMeans and alpha-mix) with ``segmented_topk`` replaced by
``rfmem_cuda_segmented_topk_warp`` (``csrc/cuda/segmented_topk_warp.cu``: one warp per
query, running top-k in shared memory, bitonic merges, ties by the smaller row, scores
accumulated in float64 and rounded once; k up to 16384, for large k and very long
segments where the Triton kernel's register top-k does not scale; DESIGN.md "Kernels
worth fusing"). The kernel keeps ``k + SCAN_MARGIN`` candidates, which then go through
the exact re-scoring shared with the torch backend
(:meth:`TorchBackend.finish_topk`, :mod:`rfmem_fast.backends.exact`; bound: float64
accumulation, depth d, plus the rounding to float32), so the scores and ids are exact
and equal the other backends'.

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` (nvcc
and ninja needed, about a minute, cached by torch in ``TORCH_EXTENSIONS_DIR``) from
the sources in ``csrc/cuda`` of a source checkout, or from ``$RFMEM_CUDA_SRC``. The
backend is listed by ``rfmem_fast.backends.available()`` only when a CUDA device is
present and the sources and nvcc are found; it is never chosen by "auto". Nothing in
this module compiles or imports CUDA code at import time.
"""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch

from . import exact as _exact
from .base import DEFAULT_MEMORY_BUDGET, BankView
from .torch_backend import TorchBackend

_LOCK = threading.Lock()
_EXT: list[ModuleType] = []
_SOURCES = ("bindings.cpp", "segmented_topk_warp.cu")
#: Largest k of the CUDA kernel (RFMEM_CUDA_TOPK_MAX_K in csrc/cuda/rfmem_cuda.h).
MAX_K = 16384


def source_dir() -> Path:
    """Folder of the CUDA sources: ``$RFMEM_CUDA_SRC`` or ``<checkout>/csrc/cuda``."""
    env = os.environ.get("RFMEM_CUDA_SRC")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "csrc" / "cuda"


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cands = [shutil.which("nvcc"), str(Path(home) / "bin" / "nvcc") if home else None, "/usr/local/cuda/bin/nvcc"]
    return next((c for c in cands if c and Path(c).is_file()), None)


def cuda_ext_available() -> bool:
    """True when the "cuda" backend can be built and run here (cheap checks, nothing compiled).

    Needs ``torch.cuda.is_available()``, the sources (:func:`source_dir`) and nvcc.
    """
    if not torch.cuda.is_available():
        return False
    src = source_dir()
    return all((src / f).is_file() for f in _SOURCES) and _nvcc() is not None


def extend_available(names: list[str]) -> list[str]:
    """Append "cuda" to a list of available backend names when :func:`cuda_ext_available`.

    Args:
        names: list of str.

    Returns:
        a new list of str ("cuda" last: never the "auto" choice).
    """
    names = [n for n in names if n != "cuda"]
    return names + ["cuda"] if cuda_ext_available() else names


def load_extension(verbose: bool = False) -> ModuleType:
    """Compile (first call) and import the torch extension ``rfmem_fast_cuda_ext``.

    Args:
        verbose: print the compiler output.

    Returns:
        the module, with ``segmented_topk(Q, qseg, X, offsets, k)`` and ``max_k``.

    Raises:
        RuntimeError: no CUDA device, sources or nvcc missing, or the build failed
            (the message carries the compiler's).
    """
    if _EXT:
        return _EXT[0]
    with _LOCK:
        if _EXT:
            return _EXT[0]
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda backend needs a CUDA device (torch.cuda.is_available() is False)")
        src = source_dir()
        missing = [f for f in _SOURCES if not (src / f).is_file()]
        if missing:
            raise RuntimeError(f"CUDA sources {missing} not found in {src} (set RFMEM_CUDA_SRC)")
        if _nvcc() is None:
            raise RuntimeError("nvcc not found (put it on PATH or set CUDA_HOME)")
        from torch.utils.cpp_extension import load

        try:
            mod = load(
                name="rfmem_fast_cuda_ext",
                sources=[str(src / f) for f in _SOURCES],
                extra_include_paths=[str(src)],
                extra_cflags=["-O3", "-std=c++17"],
                extra_cuda_cflags=["-O3", "-std=c++17"],
                verbose=verbose,
            )
        except Exception as e:  # build errors come as RuntimeError / subprocess errors
            raise RuntimeError(f"building the rfmem_fast CUDA extension failed: {e}") from e
        _EXT.append(mod)
        return mod


class CudaBackend(TorchBackend):
    """TorchBackend whose ``segmented_topk`` is the warp-level CUDA kernel (see the module).

    Args:
        device: a CUDA device (default "cuda").
        memory_budget: as :class:`TorchBackend` (its fallbacks and the exact re-scoring).

    Raises:
        ValueError: a non-CUDA device.
        RuntimeError: no CUDA device, or the extension cannot be built.
    """

    name = "cuda"
    #: the warp kernel scans float32 rows: a half-precision bank's float32 rows stay on
    #: the device and its scan copy is not used (no memory saving on this backend)
    scans_half = False

    def __init__(self, device: str | torch.device | None = None, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        dev = torch.device(device or "cuda")
        if dev.type != "cuda":
            raise ValueError(f"the cuda backend runs on a CUDA device, got {dev}")
        super().__init__(dev, memory_budget)
        self._ext = load_extension()

    def segmented_topk(self, view: BankView, Q, qseg, k, sel=None):
        """Warp-per-query top-k (see :meth:`Backend.segmented_topk`; ``csrc/cuda/rfmem_cuda.h``).

        Args:
            view: the bank on this CUDA device.
            Q: float [b, d]; qseg: integer [b]; k: int in [1, 16384] (wider: torch path).
            sel: optional RowSelection (filtered queries: the compacted view of their
                rows, :meth:`Backend.on_selection`).

        Returns:
            (scores float32 [b, k], rows int64 [b, k]), -inf / -1 padding, ties by the
            smaller row.

        Raises:
            TypeError / ValueError: bad types, shapes or k (from the binding, too).
        """
        if sel is not None:
            return self.on_selection(view, Q, qseg, sel, lambda v, q, s: self.segmented_topk(v, q, s, k))
        if not isinstance(Q, torch.Tensor) or not isinstance(qseg, torch.Tensor):
            raise TypeError("Q and qseg must be torch tensors")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if Q.ndim != 2 or Q.shape[1] != view.X.shape[1] or qseg.shape != (Q.shape[0],):
            raise ValueError(
                f"Q must be [b, {view.X.shape[1]}] and qseg [b], got {tuple(Q.shape)} and {tuple(qseg.shape)}"
            )
        kw = k + _exact.SCAN_MARGIN
        if kw > MAX_K:
            return super().segmented_topk(view, Q, qseg, k)
        dev = view.X.device
        Q = Q.to(dev, torch.float32).contiguous()
        qseg = qseg.to(dev, torch.int64).contiguous()
        s, r = self._ext.segmented_topk(Q, qseg, view.X, view.offsets.to(dev, torch.int64), int(kw))
        coef = _exact.scan_error_coef(Q.shape[1], _exact.U64)
        return self.finish_topk(view, Q, qseg, k, s, r, coef)


__all__ = ["CudaBackend", "cuda_ext_available", "extend_available", "load_extension", "source_dir"]
