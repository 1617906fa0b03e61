"""Optional dependencies: lazy imports that name the extra to install.

The core install (``pip install .``) needs numpy, torch and scikit-learn only; every
other package belongs to an extra of setup.py (``EXTRAS``) and is imported where it is
used, through :func:`require`, so that a missing one says which extra brings it.
"""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require", "install_hint"]


def install_hint(extra: str) -> str:
    """The pip command that installs an extra, e.g. ``pip install "rfmem_fast[text]"``."""
    return f'pip install "rfmem_fast[{extra}]"'


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import an optional module, or explain which extra provides it.

    Args:
        module: dotted module name, e.g. "sentence_transformers".
        extra: the setup.py extra that installs it, e.g. "text".
        purpose: what needs it, for the message, e.g. "TextEncoder".

    Returns:
        the imported module.

    Raises:
        ImportError: ``module`` cannot be imported; the message names the module, the
            purpose and the install command (``pip install "rfmem_fast[extra]"``); the
            original error is chained. ``exc.name`` is the module name.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{purpose} needs the optional package {module!r}, which cannot be imported "
            f"({exc}); install it with: {install_hint(extra)}",
            name=module,
        ) from exc
