"""A learned re-ranker of the two paths' candidates (``RFMemConfig.reranker``).

For each query the *candidate pool* is the probe's top ``depth`` items ``P`` (best
first) followed by the recollection's hits ``R`` (every item the beam discovered, in
discovery order; empty when the query did not recollect), each item once (its first
occurrence). Every candidate ``v`` gets the features (float64, from the bank's vectors,
so every backend gives identical values):

===============  ===========================================================================
``cos``          ``<v, q>``: similarity to the query (the dense score)
``profile``      ``<v, p_u>``: typicality for the user, ``p_u`` the user's profile (unit mean
                 of the user's vectors, :mod:`rfmem_fast.routing.profile`)
``support``      ``<v, c>``: cluster support, ``c`` the unit mean of the recollected hits
                 (as ``merge="rescore"``; 0 for a query without hits)
``recollected``  1.0 when the recollection discovered ``v``, else 0.0
===============  ===========================================================================

A :class:`LinearReranker` scores ``sum_j w_j f_j`` over the features it names and returns
the ``out_k`` candidates of largest score (ties: pool order), ``min(out_k, pool size)``
items. It is fitted with scikit-learn (:func:`fit_reranker`: logistic regression on
pairs (relevant, non-relevant candidate) of one query, a RankNet / RankSVM-style pairwise
objective) on labelled questions run with the same configuration, and stored as a
small versioned JSON file (:mod:`rfmem_fast.routing.files`). Everything is batched
numpy over the (query, candidate) grid.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .merge import first_occurrences, in_blocks, select_top, unit_mean

__all__ = ["RERANK_FEATURES", "LinearReranker", "candidate_features", "candidate_labels", "concat_pools", "finite_vector",
           "fit_reranker", "pair_differences"]

#: the candidate features, in their canonical order (the module docstring defines them)
RERANK_FEATURES = ("cos", "profile", "support", "recollected")
_MAX_DEPTH = 1 << 16


def candidate_features(
    probe_rows: Any, hit_rows: Any, queries: Any, profiles: Any, vectors: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The candidate pools of r queries and their features (module docstring).

    Args:
        probe_rows: int64 [r, kp] the probe's rows, best first, -1 padding.
        hit_rows: int64 [r, m] recollected rows in discovery order, -1 padding (all -1
            for a query that did not recollect); m may be 0.
        queries: float [r, d] the queries as searched (unit).
        profiles: float [r, d] each query's user profile (unit or zero).
        vectors: float32 [n, d] the bank's rows (``BankSnapshot.vectors``).

    Returns:
        (cand int64 [r, L] pool rows (L = kp + m; duplicates and padding marked in
        ``keep``), keep bool [r, L], features float64 [r, L, 4] in RERANK_FEATURES order,
        0 where not kept).

    Raises:
        ValueError: shapes that do not match.
    """
    probe_rows = np.asarray(probe_rows, dtype=np.int64)
    hit_rows = np.asarray(hit_rows, dtype=np.int64)
    queries = np.asarray(queries, dtype=np.float64)
    profiles = np.asarray(profiles, dtype=np.float64)
    r = probe_rows.shape[0] if probe_rows.ndim == 2 else -1
    if (
        probe_rows.ndim != 2 or hit_rows.ndim != 2 or hit_rows.shape[0] != r
        or queries.shape != (r, vectors.shape[1]) or profiles.shape != queries.shape
    ):  # fmt: skip
        raise ValueError(
            f"probe_rows {probe_rows.shape}, hit_rows {hit_rows.shape}, queries {queries.shape} and profiles "
            f"{profiles.shape} must be 2-D, share their first dimension, and queries / profiles have d = {vectors.shape[1]}"
        )
    return in_blocks(
        lambda sl: _features_block(probe_rows[sl], hit_rows[sl], queries[sl], profiles[sl], vectors),
        r, probe_rows.shape[1] + hit_rows.shape[1], vectors.shape[1],
    )  # fmt: skip


def _features_block(probe_rows: np.ndarray, hit_rows: np.ndarray, q: np.ndarray, p: np.ndarray,
                    vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """:func:`candidate_features` on one block of queries."""
    r, kp = probe_rows.shape
    cand = np.concatenate([probe_rows, hit_rows], axis=1)
    valid = cand >= 0
    order_key = np.where(valid, np.arange(cand.shape[1])[None, :], np.iinfo(np.int64).max)
    keep, _, _ = first_occurrences(cand, valid, order_key)
    V = vectors[np.where(valid, cand, 0)].astype(np.float64)  # [r, L, d]
    hv = hit_rows >= 0
    c = unit_mean(V[:, kp:], hv)
    # an item of the pool is "recollected" when its row is among the hits
    reco = (cand[:, :, None] == np.where(hv, hit_rows, -2)[:, None, :]).any(axis=2)
    feats = np.stack(
        [np.einsum("rld,rd->rl", V, q), np.einsum("rld,rd->rl", V, p), np.einsum("rld,rd->rl", V, c), reco.astype(np.float64)],
        axis=2,
    )
    return cand, keep, np.where(keep[:, :, None], feats, 0.0)


def candidate_labels(ids: Any, keep: Any, relevant: Sequence[Any]) -> np.ndarray:
    """Relevance labels of the pools: 1 where a kept candidate is relevant to its query.

    Args:
        ids: object [r, L] the pools' item ids (:attr:`rfmem_fast.search.CandidatePools.ids`).
        keep: bool [r, L].
        relevant: r entries, each a list of relevant ids or a mapping ``{alternative:
            [ids]}`` (every listed id is relevant); ids are compared as strings.

    Returns:
        int64 [r, L] in {0, 1}.

    Raises:
        ValueError: ``relevant`` not of length r, or shapes that differ.
        TypeError: an entry of ``relevant`` that is neither a list nor a mapping.
    """
    ids = np.asarray(ids, dtype=object)
    keep = np.asarray(keep, dtype=bool)
    if ids.ndim != 2 or keep.shape != ids.shape:
        raise ValueError(f"ids and keep must be [r, L] of one shape, got {ids.shape} and {keep.shape}")
    if len(relevant) != ids.shape[0]:
        raise ValueError(f"relevant has {len(relevant)} entries but there are {ids.shape[0]} pools")
    out = np.zeros(ids.shape, dtype=np.int64)
    for i, rel in enumerate(relevant):  # host-side label building (fitting only), not the search path
        if isinstance(rel, Mapping):
            want = {str(x) for xs in rel.values() for x in xs}
        elif isinstance(rel, (str, bytes)) or not hasattr(rel, "__iter__"):
            raise TypeError(f"relevant[{i}] must be a list of ids or a mapping {{alternative: [ids]}}, got {rel!r:.60}")
        else:
            want = {str(x) for x in rel}
        out[i] = [bool(k) and str(x) in want for x, k in zip(ids[i], keep[i])]
    return out


def concat_pools(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack (features [r_i, L_i, 4], keep [r_i, L_i], labels [r_i, L_i]) of several pool sets
    along the queries, padding L with non-kept columns (the input of :func:`fit_reranker`).

    Raises:
        ValueError: no part.
    """
    if not parts:
        raise ValueError("no pools to stack")
    L = max(p[1].shape[1] for p in parts)

    def pad(a: np.ndarray, v: Any) -> np.ndarray:
        return np.pad(a, [(0, 0), (0, L - a.shape[1])] + [(0, 0)] * (a.ndim - 2), constant_values=v)

    return (
        np.concatenate([pad(np.asarray(p[0], dtype=np.float64), 0.0) for p in parts]),
        np.concatenate([pad(np.asarray(p[1], dtype=bool), False) for p in parts]),
        np.concatenate([pad(np.asarray(p[2], dtype=np.int64), 0) for p in parts]),
    )


def finite_vector(x: Any, n: int, name: str) -> np.ndarray:
    """``x`` as a float64 [n] array of finite values (a model's weights).

    Raises:
        ValueError: not convertible to numbers, another shape, a NaN / Inf; the message
            names ``name``.
    """
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of {n} numbers") from None
    if a.shape != (n,) or not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be {n} finite numbers, got {x!r:.80}")
    return a


class LinearReranker:
    """``score = sum_j w_j * feature_j`` over the candidate pool (module docstring).

    Args:
        features: names from RERANK_FEATURES (distinct, at least one).
        weights: float [len(features)], finite, not all zero.
        depth: int in [1, 65536], the probe's items in the pool (the probe is widened
            to it).
        meta: JSON-serialisable facts (what it was fitted on, CV scores).

    Raises:
        ValueError: unknown / repeated features, weights of the wrong length, non-finite
            or all zero, depth out of range.
    """

    kind = "linear"

    def __init__(self, features: Sequence[str], weights: Any, depth: int = 20, meta: dict[str, Any] | None = None) -> None:
        feats = tuple(str(f) for f in features)
        bad = [f for f in feats if f not in RERANK_FEATURES]
        if bad or not feats or len(set(feats)) != len(feats):
            raise ValueError(f"features must be distinct names from {RERANK_FEATURES}, got {list(features)}")
        w = finite_vector(weights, len(feats), "weights")
        if not np.any(w != 0):
            raise ValueError("weights must not all be zero")
        if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or not 1 <= depth <= _MAX_DEPTH:
            raise ValueError(f"depth must be an int in [1, {_MAX_DEPTH}], got {depth!r}")
        self.features = feats
        self.weights = w
        self.depth = int(depth)
        self.meta = dict(meta or {})
        self._cols = np.array([RERANK_FEATURES.index(f) for f in feats])

    @property
    def uses_recollection(self) -> bool:
        """True when a feature that only recollection provides ("support", "recollected") has a non-zero weight."""
        return any(f in ("support", "recollected") and w != 0 for f, w in zip(self.features, self.weights))

    def score(self, feats: np.ndarray) -> np.ndarray:
        """Scores float64 [r, L] of features [r, L, 4] (RERANK_FEATURES order)."""
        return feats[:, :, self._cols] @ self.weights

    def rerank(self, probe_rows: Any, hit_rows: Any, queries: Any, profiles: Any, vectors: np.ndarray,
               out_k: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """The final lists of r queries: the top ``out_k`` of each pool by :meth:`score`.

        Args:
            probe_rows, hit_rows, queries, profiles, vectors: as :func:`candidate_features`
                (only the first ``depth`` probe columns are used).
            out_k: items per query (>= 1).

        Returns:
            (rows int64 [r, out_k], -1 padding; scores float32 [r, out_k], -inf padding).
        """
        probe_rows = np.asarray(probe_rows, dtype=np.int64)[:, : self.depth]
        cand, keep, feats = candidate_features(probe_rows, hit_rows, queries, profiles, vectors)
        sc = self.score(feats)
        order_key = np.broadcast_to(np.arange(cand.shape[1])[None, :], cand.shape)
        return select_top(sc, sc, keep, order_key, cand, int(out_k))

    def params(self) -> dict[str, Any]:
        """{"features", "weights", "depth"} (JSON-serialisable)."""
        return {"features": list(self.features), "weights": self.weights.tolist(), "depth": self.depth}

    @classmethod
    def from_params(cls, params: dict[str, Any], meta: dict[str, Any] | None = None) -> "LinearReranker":
        """Rebuild from :meth:`params` (ValueError on a missing or malformed entry)."""
        missing = [k for k in ("features", "weights", "depth") if k not in params]
        if missing:
            raise ValueError(f"linear reranker parameters lack {missing}")
        if not isinstance(params["features"], list):
            raise ValueError("features must be a list of names")
        return cls(params["features"], params["weights"], params["depth"], meta)

    def __repr__(self) -> str:
        w = ", ".join(f"{f}={x:+.4g}" for f, x in zip(self.features, self.weights))
        return f"LinearReranker({w}; depth={self.depth})"


def pair_differences(X: np.ndarray, pos: np.ndarray, neg: np.ndarray,
                     cols: list | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The (relevant, non-relevant) candidate pairs of each query, for a pairwise (RankNet /
    RankSVM-style) fit: :func:`fit_reranker`'s and :func:`rfmem_fast.second_stage.fit_linear_stage`'s.

    Args:
        X: float64 [r, L, f] features of r queries' L candidates.
        pos, neg: bool [r, L] the relevant / non-relevant candidates.
        cols: the feature columns to use (default all), taken from each pair's rows.

    Returns:
        (qi int64 [P] the query of each pair, D float64 [P, f] the feature differences
        relevant minus non-relevant, sd float64 [f] their standard deviations, 1.0 where 0).

    Raises:
        ValueError: no query has both a relevant and a non-relevant candidate.
    """
    qi, a, b = np.nonzero(pos[:, :, None] & neg[:, None, :])  # [r, L, L] masks, gathered once
    if qi.size == 0:
        raise ValueError("no query has both a relevant and a non-relevant candidate: nothing to learn from")
    D = X[qi, a] - X[qi, b] if cols is None else X[qi, a][:, cols] - X[qi, b][:, cols]
    sd = D.std(axis=0)
    return qi, D, np.where(sd > 0, sd, 1.0)


def fit_reranker(
    feats: Any,
    keep: Any,
    labels: Any,
    features: Sequence[str] = ("cos", "profile"),
    depth: int = 20,
    C: float = 1.0,
    meta: dict[str, Any] | None = None,
) -> LinearReranker:
    """Fit a linear re-ranker on labelled pools with a pairwise logistic regression (scikit-learn).

    Every (relevant, non-relevant) pair of kept candidates of one query gives the
    difference of their feature vectors (standardised by its standard deviation),
    labelled 1, and its negation, labelled 0; ``LogisticRegression(C,
    fit_intercept=False)`` on these learns ``w`` with ``P(a above b) = sigmoid(w . (f_a -
    f_b))``. Queries without a relevant or without a non-relevant candidate give no pair.

    Args:
        feats: float [r, L, 4] pool features (:func:`candidate_features`).
        keep: bool [r, L]; labels: int [r, L] in {0, 1} (:func:`candidate_labels`).
        features: the feature names to use (a subset of RERANK_FEATURES).
        depth: the probe depth the pools were built with (stored in the model).
        C: inverse regularisation strength (> 0).
        meta: stored with the model.

    Returns:
        LinearReranker.

    Raises:
        ValueError: mismatched shapes, unknown features, C <= 0, or no pair to learn from.
    """
    from sklearn.linear_model import LogisticRegression

    F = np.asarray(feats, dtype=np.float64)
    K = np.asarray(keep, dtype=bool)
    Y = np.asarray(labels)
    if F.ndim != 3 or F.shape[2] != len(RERANK_FEATURES) or K.shape != F.shape[:2] or Y.shape != K.shape:
        raise ValueError(f"feats must be [r, L, {len(RERANK_FEATURES)}] and keep / labels [r, L], got {F.shape}, {K.shape}, {Y.shape}")
    bad = [f for f in features if f not in RERANK_FEATURES]
    if bad or not features:
        raise ValueError(f"features must be names from {RERANK_FEATURES}, got {list(features)}")
    if not C > 0:
        raise ValueError(f"C must be > 0, got {C}")
    cols = [RERANK_FEATURES.index(f) for f in features]
    _, D, sd = pair_differences(F, K & (Y > 0), K & (Y <= 0), cols)
    Z = np.concatenate([D / sd, -D / sd])
    y = np.r_[np.ones(len(D)), np.zeros(len(D))]
    clf = LogisticRegression(C=float(C), fit_intercept=False, max_iter=5000).fit(Z, y)
    w = clf.coef_[0] / sd
    if not np.any(w != 0):
        raise ValueError("the fitted weights are all zero (the features do not separate the pairs)")
    return LinearReranker(tuple(features), w, depth, meta)
