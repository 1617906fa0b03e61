"""A learned second stage: re-rank the first stage's top ``depth`` candidates per query.

The first stage is any Familiarity-path search (``RFMemConfig.recommended()``: dense +
convex BM25 fusion + the conversation context). Its ranked list of a query, cut at
``depth`` (N, e.g. 50), is the *candidate list*; the second stage scores every candidate
with a small model over cheap per-candidate features and returns the ``out_k`` best by
that score (ties: first-stage order). The output is always a subset of the candidates,
in a new order.

The features (:mod:`rfmem_fast.second_stage_features`, every name re-exported here) are
the first stage's scores and ranks, query-term coverage and idf mass, exact matches of
numbers, names and dates, recency, the session position and the probe's signals.

Models (stored as a small versioned JSON file, never a pickle: :func:`save_stage` /
:func:`load_stage`, the layout of :mod:`rfmem_fast.routing.files`):

* :class:`LinearStage`: ``sum_k w_k f_k`` over the features it names, fitted by
  :func:`fit_linear_stage` (scikit-learn logistic regression on the feature differences
  of (relevant, non-relevant) pairs of one query, each query's pairs weighing 1 in
  total: a RankNet / RankSVM-style pairwise objective, as
  :func:`rfmem_fast.routing.rerank.fit_reranker`);
* :class:`TreeStage`: the raw score (log-odds of relevance) of a gradient-boosted tree
  ensemble, fitted pointwise by :func:`fit_tree_stage` (scikit-learn
  ``HistGradientBoostingClassifier``) and stored as its nodes; scored here with numpy
  (every tree of the ensemble at once, level by level), equal to scikit-learn's
  ``decision_function`` to float64 rounding.

Using it on a search: :func:`stage_features` (the arrays a search has: rows, the three
scores, the query texts, the bank snapshot the search ran on) -> ``model.rerank`` ->
order; :func:`rerank_result` does it all on a :class:`rfmem_fast.search.SearchResult`
searched with ``out_k >= depth`` and returns the re-ranked result cut to ``out_k``.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from .config import BUILTIN_STAGES  # (the shipped models' names: the config checks them)
from .routing.rerank import finite_vector, pair_differences
from .second_stage_features import (
    _COL,
    _MAX_DEPTH,
    LINEAR_FEATURES,
    STAGE_FEATURES,
    TREE_FEATURES,
    features_from_result,
    query_terms,
    stage_features,
    stage_labels,
    text_terms,
)

__all__ = [
    "STAGE_FEATURES", "LINEAR_FEATURES", "TREE_FEATURES", "STAGE_FORMAT", "STAGE_VERSION", "StageFileError",
    "LinearStage", "TreeStage", "stage_features", "features_from_result", "stage_labels", "fit_linear_stage",
    "fit_tree_stage", "rerank_result", "save_stage", "load_stage", "stage_document", "query_terms", "text_terms",
    "BUILTIN_STAGES", "builtin_stage_path", "resolve_stage",
]  # fmt: skip


STAGE_FORMAT = "rfmem_fast.second_stage"
STAGE_VERSION = 1


class StageFileError(ValueError):
    """A second-stage file is unreadable, corrupt, of another format or version, or malformed."""


def _check_features(features: Sequence[str]) -> tuple[str, ...]:
    feats = tuple(str(f) for f in features)
    bad = [f for f in feats if f not in _COL]
    if bad or not feats or len(set(feats)) != len(feats):
        raise ValueError(f"features must be distinct names from STAGE_FEATURES {STAGE_FEATURES}, got {list(features)}")
    return feats


def _check_depth(depth: Any) -> int:
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or not 1 <= depth <= _MAX_DEPTH:
        raise ValueError(f"depth must be an int in [1, {_MAX_DEPTH}], got {depth!r}")
    return int(depth)


def _check_F(F: Any, valid: Any) -> tuple[np.ndarray, np.ndarray]:
    F = np.asarray(F, dtype=np.float64)
    V = np.asarray(valid, dtype=bool)
    if F.ndim != 3 or F.shape[2] != len(STAGE_FEATURES) or V.shape != F.shape[:2]:
        raise ValueError(f"features must be [b, N, {len(STAGE_FEATURES)}] and valid [b, N], got {F.shape} and {V.shape}")
    return F, V


class _Stage:
    """What both models share: ``features``, ``depth``, ``meta``, :meth:`score`, :meth:`rerank`."""

    kind = ""
    features: tuple[str, ...]
    depth: int
    meta: dict[str, Any]

    def _cols(self) -> np.ndarray:
        return np.array([_COL[f] for f in self.features])

    def _raw(self, X: np.ndarray) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError

    def score(self, F: Any, valid: Any = None) -> np.ndarray:
        """Stage scores float64 [b, N] of features [b, N, len(STAGE_FEATURES)] (-inf where not ``valid``).

        Raises:
            ValueError: features of another shape.
        """
        F = np.asarray(F, dtype=np.float64)
        V = np.ones(F.shape[:2], bool) if valid is None else valid
        F, V = _check_F(F, V)
        b, N, _ = F.shape
        s = self._raw(F[:, :, self._cols()].reshape(b * N, -1)).reshape(b, N)
        return np.where(V, s, -np.inf)

    def rerank(self, F: Any, valid: Any, out_k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``out_k`` best candidates of each list by :meth:`score` (ties: first-stage order).

        Args:
            F: float [b, N, len(STAGE_FEATURES)] (:func:`stage_features`); only the first
                ``depth`` columns are scored, the rest dropped.
            valid: bool [b, N].
            out_k: items per query (int >= 1).

        Returns:
            (order int64 [b, out_k]: column of each kept candidate in the first-stage
            list, -1 padding; scores float64 [b, out_k], -inf padding).

        Raises:
            ValueError: out_k < 1, shapes that do not match.
        """
        if isinstance(out_k, bool) or not isinstance(out_k, (int, np.integer)) or out_k < 1:
            raise ValueError(f"out_k must be an int >= 1, got {out_k!r}")
        F, V = _check_F(F, valid)
        F, V = F[:, : self.depth], V[:, : self.depth]
        s = self.score(F, V)
        b, N = V.shape
        col = np.broadcast_to(np.arange(N)[None, :], (b, N))
        fin = np.lexsort((col, -s), axis=1)[:, : int(out_k)]
        sc = np.take_along_axis(s, fin, 1)
        order = np.where(np.isfinite(sc), fin, -1)
        if order.shape[1] < out_k:
            pad = int(out_k) - order.shape[1]
            order = np.pad(order, ((0, 0), (0, pad)), constant_values=-1)
            sc = np.pad(sc, ((0, 0), (0, pad)), constant_values=-np.inf)
        return order.astype(np.int64), np.where(order >= 0, sc, -np.inf)

    def params(self) -> dict[str, Any]:  # pragma: no cover - overridden
        raise NotImplementedError


class LinearStage(_Stage):
    """``score = sum_k w_k * feature_k`` over the features it names (module docstring).

    Args:
        features: distinct names from STAGE_FEATURES (at least one).
        weights: float [len(features)], finite, not all zero.
        depth: int in [1, 65536]: the first-stage candidates it re-ranks (N).
        meta: JSON-serialisable facts (what it was fitted on, CV scores).

    Raises:
        ValueError: unknown / repeated features, weights of the wrong length, non-finite
            or all zero, depth out of range.
    """

    kind = "linear"

    def __init__(self, features: Sequence[str], weights: Any, depth: int = 50, meta: dict[str, Any] | None = None) -> None:
        self.features = _check_features(features)
        self.weights = finite_vector(weights, len(self.features), "weights")
        if not np.any(self.weights != 0):
            raise ValueError("weights must not all be zero")
        self.depth = _check_depth(depth)
        self.meta = dict(meta or {})

    def _raw(self, X: np.ndarray) -> np.ndarray:
        return X @ self.weights

    def params(self) -> dict[str, Any]:
        """{"features", "weights", "depth"} (JSON-serialisable)."""
        return {"features": list(self.features), "weights": self.weights.tolist(), "depth": self.depth}

    @classmethod
    def from_params(cls, params: Mapping[str, Any], meta: dict[str, Any] | None = None) -> "LinearStage":
        """Rebuild from :meth:`params` (ValueError on a missing or malformed entry)."""
        missing = [k for k in ("features", "weights", "depth") if k not in params]
        if missing:
            raise ValueError(f"linear stage parameters lack {missing}")
        if not isinstance(params["features"], list) or not isinstance(params["weights"], list):
            raise ValueError("features and weights must be lists")
        return cls(params["features"], params["weights"], params["depth"], meta)

    def __repr__(self) -> str:
        w = ", ".join(f"{f}={x:+.4g}" for f, x in zip(self.features, self.weights))
        return f"LinearStage({w}; depth={self.depth})"


#: the node fields a stored tree holds, per node (TreeStage)
_TREE_FIELDS = ("feature", "threshold", "left", "right", "missing_left", "value")


class TreeStage(_Stage):
    """A gradient-boosted tree ensemble's raw score: ``baseline + sum_t leaf_t(x)`` (module docstring).

    Each tree is a dict of equal-length lists ``feature`` (int: index into ``features``;
    -1 at a leaf), ``threshold`` (float: go left when ``x <= threshold``), ``left`` /
    ``right`` (int: child nodes, -1 at a leaf), ``missing_left`` (bool: where NaN goes),
    ``value`` (float: the leaf's value); node 0 is the root, children come after their parent.

    Args:
        features: distinct names from STAGE_FEATURES.
        trees: list of such dicts (at least one).
        baseline: float, the constant term.
        depth: int in [1, 65536] (N).
        meta: JSON-serialisable facts.

    Raises:
        ValueError: unknown features, a malformed tree (lists of unequal length, a child
            or feature index out of range, a cycle-prone child order, non-finite values).
    """

    kind = "trees"

    def __init__(self, features: Sequence[str], trees: Sequence[Mapping[str, Any]], baseline: float, depth: int = 50,
                 meta: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.features = _check_features(features)
        self.depth = _check_depth(depth)
        self.meta = dict(meta or {})
        if not isinstance(baseline, (int, float)) or isinstance(baseline, bool) or not math.isfinite(baseline):
            raise ValueError(f"baseline must be a finite float, got {baseline!r}")
        self.baseline = float(baseline)
        if not trees:
            raise ValueError("trees must hold at least one tree")
        nf = len(self.features)
        feat, thr, left, right, miss, val, roots = [], [], [], [], [], [], []
        base = 0
        for t, tree in enumerate(trees):
            if not isinstance(tree, Mapping) or any(k not in tree for k in _TREE_FIELDS):
                raise ValueError(f"trees[{t}] must be a mapping with {list(_TREE_FIELDS)}")
            n = len(tree["feature"])
            if n < 1 or any(len(tree[k]) != n for k in _TREE_FIELDS):
                raise ValueError(f"trees[{t}]: the node lists must be non-empty and of one length")
            f = np.asarray(tree["feature"], dtype=np.int64)
            lf = np.asarray(tree["left"], dtype=np.int64)
            rt = np.asarray(tree["right"], dtype=np.int64)
            th = np.asarray(tree["threshold"], dtype=np.float64)
            v = np.asarray(tree["value"], dtype=np.float64)
            leaf = f < 0
            ids = np.arange(n)
            if (
                (f >= nf).any() or (leaf != (lf < 0)).any() or (leaf != (rt < 0)).any()
                or ((~leaf) & ((lf <= ids) | (rt <= ids) | (lf >= n) | (rt >= n))).any()
                or not np.isfinite(v).all() or not np.isfinite(th[~leaf]).all()
            ):  # fmt: skip
                raise ValueError(f"trees[{t}]: malformed nodes (children must follow their parent, indices in range)")
            feat.append(np.where(leaf, 0, f))
            thr.append(np.where(leaf, np.inf, th))
            left.append(np.where(leaf, ids, lf) + base)
            right.append(np.where(leaf, ids, rt) + base)
            miss.append(np.asarray(tree["missing_left"], dtype=bool))
            val.append(np.where(leaf, v, 0.0))
            roots.append(base)
            base += n
        self._feat, self._thr = np.concatenate(feat), np.concatenate(thr)
        self._left, self._right = np.concatenate(left), np.concatenate(right)
        self._miss, self._val = np.concatenate(miss), np.concatenate(val)
        self._leaf = np.concatenate([np.asarray(t["feature"]) < 0 for t in trees])
        self._roots = np.asarray(roots, dtype=np.int64)
        self._trees = [{k: list(tree[k]) for k in _TREE_FIELDS} for tree in trees]

    def _raw(self, X: np.ndarray) -> np.ndarray:
        m, T = X.shape[0], self._roots.shape[0]
        node = np.tile(self._roots, m)  # [m * T]: (sample, tree) pairs, sample-major
        samp = np.repeat(np.arange(m), T)
        active = np.flatnonzero(~self._leaf[node])
        while active.size:  # one level of every unfinished (sample, tree) pair per step
            nd = node[active]
            x = X[samp[active], self._feat[nd]]
            nxt = np.where(np.where(np.isnan(x), self._miss[nd], x <= self._thr[nd]), self._left[nd], self._right[nd])
            node[active] = nxt
            active = active[~self._leaf[nxt]]
        return self.baseline + self._val[node].reshape(m, T).sum(axis=1)

    def params(self) -> dict[str, Any]:
        """{"features", "baseline", "trees", "depth"} (JSON-serialisable)."""
        return {"features": list(self.features), "baseline": self.baseline, "trees": self._trees, "depth": self.depth}

    @classmethod
    def from_params(cls, params: Mapping[str, Any], meta: dict[str, Any] | None = None) -> "TreeStage":
        """Rebuild from :meth:`params` (ValueError on a missing or malformed entry)."""
        missing = [k for k in ("features", "baseline", "trees", "depth") if k not in params]
        if missing:
            raise ValueError(f"tree stage parameters lack {missing}")
        if not isinstance(params["features"], list) or not isinstance(params["trees"], list):
            raise ValueError("features and trees must be lists")
        return cls(params["features"], params["trees"], params["baseline"], params["depth"], meta)

    def __repr__(self) -> str:
        return f"TreeStage({len(self._trees)} trees over {len(self.features)} features; depth={self.depth})"


# ------------------------------------------------------------------ fitting


def _fit_inputs(F: Any, valid: Any, labels: Any, features: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple]:
    F, V = _check_F(F, valid)
    Y = np.asarray(labels)
    if Y.shape != V.shape:
        raise ValueError(f"labels must have the shape of valid {V.shape}, got {Y.shape}")
    feats = _check_features(features)
    return F[:, :, [_COL[f] for f in feats]], V, Y > 0, feats


def fit_linear_stage(
    F: Any,
    valid: Any,
    labels: Any,
    features: Sequence[str] = LINEAR_FEATURES,
    C: float = 1.0,
    depth: int = 50,
    meta: dict[str, Any] | None = None,
) -> LinearStage:
    """Fit a :class:`LinearStage` with a pairwise logistic regression (scikit-learn).

    Every (relevant, non-relevant) pair of valid candidates of one query gives the
    difference of their feature vectors (each column divided by its standard deviation
    over all pairs), labelled 1, and its negation, labelled 0, weighted ``1 / (pairs of
    the query)`` (mean weight 1) so that each query counts once; ``LogisticRegression(C,
    fit_intercept=False)`` (Newton-Cholesky solver; the pairs' negations folded in by
    negating every other pair) learns ``w`` with ``P(a above b) = sigmoid(w . (f_a - f_b))``.
    Queries without a relevant or without a non-relevant candidate give no pair.

    Args:
        F: float [b, N, len(STAGE_FEATURES)] (:func:`stage_features`).
        valid: bool [b, N]; labels: int [b, N] in {0, 1} (:func:`stage_labels`).
        features: the names to use (default :data:`LINEAR_FEATURES`).
        C: inverse regularisation strength (> 0).
        depth: the list depth N the features were built with (stored in the model).
        meta: stored with the model.

    Returns:
        LinearStage.

    Raises:
        ValueError: mismatched shapes, unknown features, C <= 0, no pair to learn from,
            all-zero weights.
    """
    from sklearn.linear_model import LogisticRegression

    X, V, Y, feats = _fit_inputs(F, valid, labels, features)
    if isinstance(C, bool) or not isinstance(C, (int, float)) or not C > 0:
        raise ValueError(f"C must be a float > 0, got {C!r}")
    depth = _check_depth(depth)
    qi, D, sd = pair_differences(X, V & Y, V & ~Y)
    npairs = np.bincount(qi, minlength=X.shape[0])
    w8 = 1.0 / npairs[qi]
    # each pair once, every other one negated (label 0): without an intercept the loss of
    # (z, 1) equals that of (-z, 0), so this is the loss of the pairs and their negations
    # halved, i.e. the same fit with C doubled
    sign = np.where(np.arange(len(D)) % 2 == 0, 1.0, -1.0)
    Z = D / sd * sign[:, None]
    sw = w8 * (len(D) / w8.sum())  # mean weight 1: C keeps its usual scale
    clf = LogisticRegression(C=2.0 * float(C), fit_intercept=False, solver="newton-cholesky", max_iter=200)
    clf.fit(Z, (sign > 0).astype(np.int64), sample_weight=sw)
    w = clf.coef_[0] / sd
    if not np.any(w != 0):
        raise ValueError("the fitted weights are all zero (the features do not separate the pairs)")
    return LinearStage(feats, w, depth, meta)


def fit_tree_stage(
    F: Any,
    valid: Any,
    labels: Any,
    features: Sequence[str] = TREE_FEATURES,
    depth: int = 50,
    max_iter: int = 100,
    learning_rate: float = 0.1,
    max_leaf_nodes: int = 15,
    min_samples_leaf: int = 40,
    l2_regularization: float = 1.0,
    seed: int = 0,
    meta: dict[str, Any] | None = None,
) -> TreeStage:
    """Fit a :class:`TreeStage`: scikit-learn ``HistGradientBoostingClassifier`` on the valid
    candidates (pointwise: relevant or not), each query's candidates weighing 1 in total,
    no early stopping; its trees exported as data.

    Args:
        F, valid, labels: as :func:`fit_linear_stage`.
        features: the names to use (default :data:`TREE_FEATURES`).
        depth: N (stored).
        max_iter, learning_rate, max_leaf_nodes, min_samples_leaf, l2_regularization:
            the classifier's parameters.
        seed: its random_state.
        meta: stored with the model.

    Returns:
        TreeStage (its :meth:`~TreeStage.score` equals the classifier's
        ``decision_function`` on the same features).

    Raises:
        ValueError: mismatched shapes, unknown features, no valid candidate, labels of one class only.
    """
    from sklearn.ensemble import HistGradientBoostingClassifier

    X, V, Y, feats = _fit_inputs(F, valid, labels, features)
    depth = _check_depth(depth)
    x, y = X[V], Y[V]
    if y.size == 0 or y.all() or not y.any():
        raise ValueError("labels must hold both relevant and non-relevant valid candidates")
    per_q = V.sum(axis=1)
    w = (1.0 / np.maximum(per_q, 1))[:, None].repeat(V.shape[1], 1)[V]
    clf = HistGradientBoostingClassifier(
        max_iter=int(max_iter), learning_rate=float(learning_rate), max_leaf_nodes=int(max_leaf_nodes),
        min_samples_leaf=int(min_samples_leaf), l2_regularization=float(l2_regularization), early_stopping=False,
        random_state=int(seed),
    ).fit(x, y.astype(np.int64), sample_weight=w * (w.size / w.sum()))  # fmt: skip
    trees = []
    for it in clf._predictors:  # one TreePredictor per iteration (binary)
        nodes = it[0].nodes
        leaf = nodes["is_leaf"].astype(bool)
        if nodes["is_categorical"].any():  # pragma: no cover - no categorical features are declared
            raise ValueError("categorical splits are not supported")
        trees.append({
            "feature": np.where(leaf, -1, nodes["feature_idx"].astype(np.int64)).tolist(),
            "threshold": np.where(leaf, 0.0, nodes["num_threshold"]).astype(float).tolist(),
            "left": np.where(leaf, -1, nodes["left"].astype(np.int64)).tolist(),
            "right": np.where(leaf, -1, nodes["right"].astype(np.int64)).tolist(),
            "missing_left": nodes["missing_go_to_left"].astype(bool).tolist(),
            "value": np.where(leaf, nodes["value"], 0.0).astype(float).tolist(),
        })  # fmt: skip
    baseline = float(np.asarray(clf._baseline_prediction).ravel()[0])
    return TreeStage(feats, trees, baseline, depth, meta)


# ------------------------------------------------------------------ applying to a search result


def rerank_result(model: Any, result: Any, snapshot: Any, query_texts: Sequence[str | None] | None,
                  out_k: int = 10) -> Any:  # fmt: skip
    """A :class:`rfmem_fast.search.SearchResult` re-ranked by a second stage, cut to ``out_k``.

    The search must have been run with ``out_k >= model.depth`` (e.g. ``config.replace(out_k=50)``).
    Every query that took the Familiarity path gets the model's ``out_k`` best of its first
    ``depth`` hits; the per-hit fields (``ids``, ``texts``, ``rows``, ``scores``,
    ``dense_scores``, ``lexical_scores``, ``context_scores``) follow the new order;
    a query that recollected, or one without a text, keeps its first ``out_k`` hits unchanged.

    Args:
        model: a :class:`LinearStage` or :class:`TreeStage`.
        result: the SearchResult.
        snapshot: the bank snapshot the search ran on.
        query_texts: the query texts given to the search (or None).
        out_k: hits per query (int >= 1, default 10).

    Returns:
        SearchResult with ``out_k`` hits per query.

    Raises:
        ValueError: the result has fewer hits per query than ``model.depth``; as
            :func:`features_from_result`.
    """
    if not isinstance(model, _Stage):
        raise TypeError(f"model must be a LinearStage or TreeStage, got {type(model).__name__}")
    K = int(result.rows.shape[1])
    if K < model.depth:
        raise ValueError(f"result has {K} hits per query but the model re-ranks the top {model.depth}: "
                         f"search with out_k >= {model.depth}")  # fmt: skip
    F, V = features_from_result(result, snapshot, query_texts, model.depth)
    order, _ = model.rerank(F, V, out_k)
    fam = np.asarray(result.route) == 0
    if query_texts is None:  # the features read the query's text: without one, the first stage's list
        fam = np.zeros_like(fam)
    else:
        fam &= np.fromiter((t is not None for t in query_texts), bool, fam.shape[0])
    keep = np.broadcast_to(np.arange(out_k)[None, :], order.shape)
    keep = np.where(keep < K, keep, -1)
    order = np.where(fam[:, None], order, keep)

    def take(a: Any, fill: Any) -> Any:
        if a is None:
            return None
        a = np.asarray(a)
        got = np.take_along_axis(a, np.maximum(order, 0), 1)
        return np.where(order >= 0, got, np.asarray(fill, dtype=a.dtype))

    return dataclasses.replace(
        result, ids=take(result.ids, None), texts=take(result.texts, None), rows=take(result.rows, -1),
        scores=take(result.scores, -np.inf), dense_scores=take(result.dense_scores, np.nan),
        lexical_scores=take(result.lexical_scores, np.nan), context_scores=take(result.context_scores, np.nan),
    )  # fmt: skip


# ------------------------------------------------------------------ files


_KINDS = {"linear": LinearStage, "trees": TreeStage}


def stage_document(model: Any, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of a second stage: ``{"format": STAGE_FORMAT, "version":
    STAGE_VERSION, "kind": "linear" | "trees", "params": model.params(), "meta": {...}}``.

    Raises:
        TypeError: not a LinearStage / TreeStage.
    """
    if not isinstance(model, _Stage):
        raise TypeError(f"model must be a LinearStage or TreeStage, got {type(model).__name__}")
    return {"format": STAGE_FORMAT, "version": STAGE_VERSION, "kind": model.kind, "params": model.params(),
            "meta": dict(model.meta if meta is None else meta)}  # fmt: skip


def save_stage(model: Any, path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> str:
    """Write a second-stage file atomically (temporary file + rename; :func:`stage_document`).

    Args:
        model: a LinearStage or TreeStage.
        path: the JSON file (its folder must exist).
        meta: JSON-serialisable facts (default: the model's own ``meta``).

    Returns:
        the path written (str).

    Raises:
        TypeError: not a stage model, or ``meta`` not JSON-serialisable.
        OSError: the file cannot be written.
    """
    from .routing.files import _write_atomic

    return _write_atomic(stage_document(model, meta), path)


def _parse_stage(doc: Any, where: str) -> Any:
    from .routing.files import _check_header

    _check_header(doc, where, STAGE_FORMAT, STAGE_VERSION, "second-stage", ("kind", "params"), StageFileError)
    cls = _KINDS.get(doc["kind"])
    if cls is None:
        raise StageFileError(f"{where}: unknown second-stage kind {doc['kind']!r} (known: {sorted(_KINDS)})")
    if not isinstance(doc["params"], dict):
        raise StageFileError(f"{where}: 'params' must be an object")
    meta = doc.get("meta") or {}
    try:
        return cls.from_params(doc["params"], meta if isinstance(meta, dict) else {})
    except (TypeError, ValueError) as e:
        raise StageFileError(f"{where}: malformed {doc['kind']} parameters: {e}") from None


def load_stage(path: str | os.PathLike[str]) -> Any:
    """Read a second-stage file (cached per path, modification time and size).

    Returns:
        the LinearStage or TreeStage (its ``meta`` holds the file's).

    Raises:
        FileNotFoundError: no such file.
        StageFileError: (a ValueError) not JSON, another format, a newer version, an
            unknown kind, malformed parameters; the message names the file.
    """
    from .routing.files import _load_cached

    return _load_cached(path, "second-stage", _parse_stage, StageFileError)


def builtin_stage_path(name: str) -> str:
    """The file of the shipped second stage ``name`` (:data:`BUILTIN_STAGES`).

    Raises:
        ValueError: an unknown name (the message lists the shipped ones).
    """
    if name not in BUILTIN_STAGES:
        raise ValueError(f"unknown builtin second stage {name!r}: the package ships {list(BUILTIN_STAGES)}")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", f"second_stage_{name}.json")


def resolve_stage(config: Any) -> Any:
    """The second stage of an :class:`~rfmem_fast.config.RFMemConfig` (``config.second_stage``), or None.

    Args:
        config: the RFMemConfig (``second_stage``: None, ``"builtin:<name>"`` or a file path).

    Returns:
        the :class:`LinearStage` / :class:`TreeStage` (cached by :func:`load_stage`), or None.

    Raises:
        FileNotFoundError: the path names no file.
        ValueError: an unknown builtin name; a corrupt or malformed file (StageFileError);
            the message starts with "RFMemConfig.second_stage: ".
    """
    spec = config.second_stage
    if spec is None:
        return None
    got = _BUILTIN_LOADED.get(spec)  # (a shipped file never changes: no stat per search)
    if got is not None:
        return got
    try:
        if spec.startswith("builtin:"):
            got = _BUILTIN_LOADED[spec] = load_stage(builtin_stage_path(spec[len("builtin:"):]))
            return got
        return load_stage(spec)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"RFMemConfig.second_stage: {e}") from None


_BUILTIN_LOADED: dict[str, Any] = {}
