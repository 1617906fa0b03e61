"""Backends: implementations of the primitives behind one interface (:class:`Backend`).

* ``reference``: numpy + scikit-learn, one problem at a time; the oracle.
* ``torch``: whole-batch tensor operations on CPU or CUDA.
* ``native``: C++ CPU kernels (per-call threads) (``rfmem_fast._native``, csrc/cpu); registered
  only when the compiled extension imports.
* ``triton``: fused Triton kernels (triton_backend.py); the "auto" choice with CUDA,
  listed last (never "auto") on a CPU under ``TRITON_INTERPRET=1``.
* ``cuda``: torch + the warp-level CUDA top-k of csrc/cuda (cuda_ext.py); listed only
  with a CUDA device, nvcc and the sources.

``available()`` lists the names that can run on this machine; ``get_backend(name)``
returns an instance (``"auto"`` picks the first of ``available()``, the fastest; on a
machine without CUDA that is native when it is built, else torch).
"""
from __future__ import annotations

from typing import Callable

import torch

from .base import Backend, BankView
from .reference import ReferenceBackend
from .torch_backend import TorchBackend
from . import cuda_ext as _cuda_ext
from . import triton_backend as _triton_backend
from .triton_backend import TritonBackend

#: Every backend name :func:`get_backend` (and so ``search(backend=...)`` and the CLI's
#: ``--backend``) accepts; the one list that docstrings, help texts and error messages
#: quote (tests/test_conveniences.py checks that they do). Which of them run on this
#: machine: :func:`available`.
BACKEND_NAMES = ("auto", "native", "torch", "triton", "cuda", "reference")

_FACTORIES: dict[str, Callable[..., Backend]] = {
    "reference": lambda device=None: ReferenceBackend(),
    "torch": lambda device=None: TorchBackend(device or ("cuda" if torch.cuda.is_available() else "cpu")),
    # triton: first on CUDA, last (never "auto") under TRITON_INTERPRET=1; cuda: last, when buildable
    "triton": lambda device=None: TritonBackend(device),
    "cuda": lambda device=None: _cuda_ext.CudaBackend(device),
}
try:  # the compiled CPU kernels are optional (RFMEM_NO_NATIVE=1, or no compiler)
    from .native import NativeBackend
except ImportError:  # pragma: no cover - depends on the build
    NativeBackend = None  # type: ignore[assignment,misc]


def _native_factory(device: str | None = None) -> Backend:
    """A :class:`NativeBackend`; ``device`` must be None or a CPU device (ValueError)."""
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"the native backend runs on the CPU only, got device {device!r}")
    return NativeBackend()


if NativeBackend is not None:
    _FACTORIES["native"] = _native_factory

# Preference order of "auto": the first available wins. With CUDA, torch on the GPU
# beats the CPU kernels; without, the native kernels beat torch on the CPU.
if torch.cuda.is_available():
    _AUTO_ORDER = ("torch", "native", "reference")
else:
    _AUTO_ORDER = ("native", "torch", "reference")


def available() -> list[str]:
    """Names of the backends usable on this machine, fastest first.

    Returns:
        list of str, e.g. ``["native", "torch", "reference"]``.
    """
    names = [n for n in _AUTO_ORDER if n in _FACTORIES]
    return _cuda_ext.extend_available(_triton_backend.extend_available(names))


def get_backend(name: str | Backend = "auto", device: str | None = None) -> Backend:
    """A backend instance by name.

    Args:
        name: one of :data:`BACKEND_NAMES`: "auto" (the first of :func:`available`),
            "native" (when built), "torch", "triton", "cuda", "reference"; or a
            :class:`Backend` instance, returned as is.
        device: torch device for device-capable backends (default: CUDA if present).

    Returns:
        Backend.

    Raises:
        ValueError: a name not in :data:`BACKEND_NAMES`, or one that is not built here
            (the message lists every name and the available ones), or a non-CPU
            device for the native backend.
        ImportError: "triton" without the triton package (names the extra).
        TypeError: ``name`` is neither a str nor a Backend.
        RuntimeError: "triton" / "cuda" where they cannot run (no CUDA device, or the
            CPU without TRITON_INTERPRET=1; the message says which).
    """
    if isinstance(name, Backend):
        return name
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str (one of {', '.join(BACKEND_NAMES)}) or a Backend, got {type(name).__name__}")
    if name == "auto":
        name = available()[0]
    factory = _FACTORIES.get(name)
    if factory is None:
        why = "is not available on this machine" if name in BACKEND_NAMES else "is not a backend name"
        raise ValueError(
            f"backend {name!r} {why}: backend must be one of {', '.join(BACKEND_NAMES)} "
            f"(available here: {', '.join(['auto'] + available())})"
        )
    return factory(device)


__all__ = ["BACKEND_NAMES", "Backend", "BankView", "ReferenceBackend", "TorchBackend", "TritonBackend", "available", "get_backend"]
