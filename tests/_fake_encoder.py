"""A tiny deterministic text encoder for dataset tests (no model, no download)."""
from __future__ import annotations

import re
import zlib

import numpy as np

_STOP = frozenset("a an and the is of to in my i at for what does did do how where who when with this me on it".split())


class BagOfWords:
    """Unit bag-of-words vectors: each non-stopword token hashed (crc32) into ``dim`` buckets,
    plus a small constant component (no text maps to the zero vector)."""

    model_name = "test-bag-of-words"

    def __init__(self, dim: int = 4096) -> None:
        self.dim = dim

    def encode(self, texts):
        out = np.zeros((len(texts), self.dim + 1), dtype=np.float32)
        for i, t in enumerate(texts):
            for tok in re.findall(r"[a-z0-9]+", t.lower()):
                if tok not in _STOP:
                    out[i, zlib.crc32(tok.encode()) % self.dim] += 1.0
            out[i, self.dim] = 0.05
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def patch_encoder(monkeypatch) -> BagOfWords:
    """Make every encoder name / folder resolve to a BagOfWords (for CLI tests)."""
    import rfmem_fast.datasets.embedded as emb

    enc = BagOfWords()
    monkeypatch.setattr(emb, "encoder_identity", lambda encoder: ("test-bag-of-words", "test-bag-of-words", enc))
    return enc
