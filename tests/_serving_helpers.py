"""Helpers of the serving tests: a tiny deterministic text encoder (no model load)."""
from __future__ import annotations

import hashlib
import re
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
        self.overrides: dict[str, np.ndarray] = {}  # text -> the vector to return
        self.calls: list[int] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def vector(self, text: str) -> np.ndarray:
        if text in self.overrides:
            return self.overrides[text]
        seed = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")
        v = np.random.default_rng(seed).normal(size=self.dim)
        return (v / np.linalg.norm(v)).astype(np.float32)

    def encode(self, texts):
        self.calls.append(len(texts))
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        return np.stack([self.vector(t) for t in texts]) if texts else np.zeros((0, self.dim), np.float32)


class WordChunkEncoder(HashEncoder):
    """A HashEncoder whose tokens are the words, with a window of ``max_tokens`` tokens (2 of
    them special) and each token's span, so the Memory cuts a text of more than
    ``max_tokens - 2`` words into chunk rows (default window 8: chunks of 6 words)."""

    max_tokens = 8

    def __init__(self, dim: int = 16, max_tokens: int | None = None) -> None:
        super().__init__(dim)
        if max_tokens is not None:
            self.max_tokens = max_tokens

    def count_tokens(self, texts):
        return [len(t.split()) + 2 for t in texts]

    def token_spans(self, texts):
        return [[m.span() for m in re.finditer(r"\S+", t)] for t in texts]


def clustered_memory_data(n_users: int = 5, per_user: int = 40, dim: int = 16, seed: int = 0):
    """Items around 4 centres per user, and queries: half near an item (RF-Mem routes
    them to familiarity), half near a centre (mostly recollection).

    Returns:
        (items, queries): items {user: float32 [per_user, dim]}; queries a list of
        (user, float32 [dim]) pairs, 8 per user.
    """
    rng = np.random.default_rng(seed)
    items, queries = {}, []
    for u in range(n_users):
        user = f"user{u}"
        centres = rng.normal(size=(4, dim))
        X = centres[rng.integers(0, 4, per_user)] + 0.35 * rng.normal(size=(per_user, dim))
        items[user] = X.astype(np.float32)
        for j in range(4):
            queries.append((user, (X[rng.integers(per_user)] + 0.05 * rng.normal(size=dim)).astype(np.float32)))
            queries.append((user, (centres[j] + 0.6 * rng.normal(size=dim)).astype(np.float32)))
    return items, queries
