"""Where the shared data lives for the tests: $RFMEM_SHARED or ../shared beside the checkout."""
from __future__ import annotations

import os
from pathlib import Path


def shared_dir() -> Path | None:
    """The shared folder (data/, golden/, docs/), or None when it is absent."""
    env = os.environ.get("RFMEM_SHARED")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared"
    return path if path.is_dir() else None
