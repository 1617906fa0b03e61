"""Backends: implementations of the primitives behind one interface (:class:`Backend`).

* ``reference``: numpy + scikit-learn, one problem at a time; the oracle.
* ``torch``: whole-batch tensor operations on CPU or CUDA.

``available()`` lists the names that can run on this machine; ``get_backend(name)``
returns an instance (``"auto"`` picks the fastest available one).
"""
from __future__ import annotations

from typing import Callable

import torch

from .base import Backend, BankView
from .reference import ReferenceBackend
from .torch_backend import TorchBackend

_FACTORIES: dict[str, Callable[..., Backend]] = {
    "reference": lambda device=None: ReferenceBackend(),
    "torch": lambda device=None: TorchBackend(device or ("cuda" if torch.cuda.is_available() else "cpu")),
}
# Preference order of "auto": the first available wins.
_AUTO_ORDER = ("torch", "reference")


def available() -> list[str]:
    """Names of the backends usable on this machine, fastest first.

    Returns:
        list of str, e.g. ``["torch", "reference"]``.
    """
    return [n for n in _AUTO_ORDER if n in _FACTORIES]


def get_backend(name: str | Backend = "auto", device: str | None = None) -> Backend:
    """A backend instance by name.

    Args:
        name: "auto" | "reference" | "torch" (or a :class:`Backend` instance, returned
            as is).
        device: torch device for device-capable backends (default: CUDA if present).

    Returns:
        Backend.

    Raises:
        ValueError: unknown backend name (the message lists the available ones).
    """
    if isinstance(name, Backend):
        return name
    if name == "auto":
        name = available()[0]
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"backend must be one of {['auto'] + available()}, got {name!r}")
    return factory(device)


__all__ = ["Backend", "BankView", "ReferenceBackend", "TorchBackend", "available", "get_backend"]
