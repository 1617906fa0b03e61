"""Helpers of the serving tests: a tiny deterministic text encoder (no model load)."""
from __future__ import annotations

import hashlib
import threading

import numpy as np


class HashEncoder:
    """Deterministic stand-in for TextEncoder: a text's vector is seeded by its sha256,
    so equal texts embed equally (a query equal to an item's text scores 1.0).

    Records the size of every encode call; ``gate`` (a threading.Event), when set up,
    blocks every call until it is set (to fill the micro-batcher's queue in tests).
    """

    def __init__(self, dim: int = 16) -> None:
        self.dim = dim
        self.calls: list[int] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def vector(self, text: str) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
        v = np.random.default_rng(seed).normal(size=self.dim)
        return (v / np.linalg.norm(v)).astype(np.float32)

    def encode(self, texts):
        self.calls.append(len(texts))
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        return np.stack([self.vector(t) for t in texts]) if texts else np.zeros((0, self.dim), np.float32)
