"""Probe features: what a router sees of a query (RFMEM_SPEC.md section 1, extended).

The familiarity probe returns each query's top ``probe_k`` scores ``s_1 >= ... >= s_K``
(``K`` = hits, fewer than ``probe_k`` for a small bank, ``-inf`` padding). The spec's
router reads two signals of them (mean, entropy); learned routers
(:mod:`rfmem_fast.routing.learned`) read these six, in this order:

==========  ==========================================================================
``mean``    ``(1/K) sum s_i`` (spec section 1; 0 when K = 0)
``entropy`` temperature-softmax entropy in the config's convention (spec section 1)
``top1``    ``s_1`` (0 when K = 0)
``gap12``   ``s_1 - s_2``: how much the best match stands out (0 when K < 2)
``spread``  ``s_1 - s_K``: range of the probe scores (0 when K < 2)
``count``   ``K``, the number of probe hits
==========  ==========================================================================

All are computed batched (numpy, float64) from the probe the search already ran.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FEATURE_NAMES", "ProbeSignals", "probe_features"]

#: the features a learned router may use, in their canonical order
FEATURE_NAMES = ("mean", "entropy", "top1", "gap12", "spread", "count")


def _as_np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


@dataclass(frozen=True)
class ProbeSignals:
    """What the probe measured for a batch of b queries (the input of every router).

    Attributes:
        scores: float64 [b, k] the probe's top scores, descending, ``-inf`` padding
            (k >= 1; only the first ``probe_k`` are used by the spec's signals).
        mean: float64 [b] mean probe score (spec section 1).
        entropy: float64 [b] probe entropy in the config's convention.
        count: int64 [b] probe hits K (0 for an empty bank).
    """

    scores: np.ndarray
    mean: np.ndarray
    entropy: np.ndarray
    count: np.ndarray

    @classmethod
    def from_arrays(cls, scores: Any, mean: Any, entropy: Any, count: Any) -> "ProbeSignals":
        """Build from numpy arrays or torch tensors (any device), validating the shapes.

        Raises:
            ValueError: ``scores`` not 2-D, or a signal not of length b.
        """
        s = _as_np(scores).astype(np.float64)
        if s.ndim != 2:
            raise ValueError(f"scores must be 2-D [b, k], got shape {s.shape}")
        out = [_as_np(x) for x in (mean, entropy, count)]
        for name, a in zip(("mean", "entropy", "count"), out):
            if a.shape != (s.shape[0],):
                raise ValueError(f"{name} must have shape ({s.shape[0]},), got {a.shape}")
        return cls(s, out[0].astype(np.float64), out[1].astype(np.float64), out[2].astype(np.int64))

    @classmethod
    def from_result(cls, result: Any) -> "ProbeSignals":
        """The probe signals of a :class:`rfmem_fast.SearchResult` (any mode)."""
        scores = np.asarray(result.probe_scores, dtype=np.float64)
        return cls.from_arrays(scores, result.mean, result.entropy, np.isfinite(scores).sum(axis=1))

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def features(self, names: tuple[str, ...] | list[str] = FEATURE_NAMES) -> np.ndarray:
        """The feature matrix, float64 [b, len(names)] (see :func:`probe_features`)."""
        return probe_features(self, names)

    def take(self, idx: Any) -> "ProbeSignals":
        """The signals of a subset of the queries (``idx``: index array or mask)."""
        return ProbeSignals(self.scores[idx], self.mean[idx], self.entropy[idx], self.count[idx])


def probe_features(signals: ProbeSignals, names: tuple[str, ...] | list[str] = FEATURE_NAMES) -> np.ndarray:
    """Probe features of every query (module docstring gives the definitions).

    Args:
        signals: the batch's :class:`ProbeSignals`.
        names: features to compute, a subset of FEATURE_NAMES in any order.

    Returns:
        float64 [b, len(names)], column j = feature ``names[j]``.

    Raises:
        ValueError: an unknown feature name (the message lists the known ones).
    """
    bad = [n for n in names if n not in FEATURE_NAMES]
    if bad:
        raise ValueError(f"unknown probe feature(s) {bad}; known: {FEATURE_NAMES}")
    s, cnt = signals.scores, signals.count
    b = s.shape[0]
    k = s.shape[1]
    cnt_c = np.clip(cnt, 0, k)
    s0 = np.where(np.isfinite(s), s, 0.0)
    top1 = s0[:, 0] if k else np.zeros(b)
    second = s0[:, 1] if k > 1 else np.zeros(b)
    last = s0[np.arange(b), np.clip(cnt_c - 1, 0, max(k - 1, 0))] if k else np.zeros(b)
    two = cnt_c >= 2
    cols = {
        "mean": signals.mean,
        "entropy": signals.entropy,
        "top1": np.where(cnt_c >= 1, top1, 0.0),
        "gap12": np.where(two, top1 - second, 0.0),
        "spread": np.where(two, top1 - last, 0.0),
        "count": cnt.astype(np.float64),
    }
    if not names:
        return np.zeros((b, 0))
    return np.stack([cols[n] for n in names], axis=1).astype(np.float64)
