"""Where rfmem_fast keeps files between runs (caches, assembled models)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_subdir(name: str, env: str) -> Path:
    """``$<env>`` if set, else ``$XDG_CACHE_HOME/rfmem_fast/<name>`` (default
    ``~/.cache/rfmem_fast/<name>``)."""
    value = os.environ.get(env)
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rfmem_fast" / name
