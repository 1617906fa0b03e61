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
        name: "auto" | "reference" | "torch" | "native" (when built) | "triton" |
            "cuda" (or a :class:`Backend` instance, returned as is).
        device: torch device for device-capable backends (default: CUDA if present).

    Returns:
        Backend.

    Raises:
        ValueError: unknown backend name (the message lists the available ones), or a
            non-CPU device for the native backend.
        RuntimeError: "triton" / "cuda" where they cannot run (no CUDA device, or the
            CPU without TRITON_INTERPRET=1; the message says which).
    """
    if isinstance(name, Backend):
        return name
    if name == "auto":
        name = available()[0]
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"backend must be one of {['auto'] + available()}, got {name!r}")
    return factory(device)


__all__ = ["Backend", "BankView", "ReferenceBackend", "TorchBackend", "TritonBackend", "available", "get_backend"]
