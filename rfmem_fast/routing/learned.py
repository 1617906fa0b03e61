"""Learned routers: logistic regression and a small MLP on the probe features (the paper's router ablation).

A learned router standardises the probe features (:mod:`rfmem_fast.routing.features`)
and computes ``p = sigmoid(f(z))``, the probability that recollection gives the better
result: ``f`` is affine for ``"logistic"`` and a ReLU MLP for ``"mlp"``. A query
recollects when ``p >= threshold`` (rule "learned_recollection"), else it takes the
Familiarity path (rule "learned_familiarity"); a query without probe hits always
recollects (rule "no_hits").

Inference is plain numpy over the whole batch (a few small matrix products), so the
package needs scikit-learn only to *fit* a router (:func:`fit_learned_router`); the
fitted weights are exported into the router and saved in its JSON file
(:mod:`rfmem_fast.routing.files`).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .base import RULE_LEARNED_FAMILIARITY, RULE_LEARNED_RECOLLECTION, ProbeSettings, Router, register
from .features import FEATURE_NAMES, ProbeSignals

__all__ = ["LearnedRouter", "LogisticRouter", "MLPRouter", "fit_learned_router"]


def _matrix(x: Any, shape: tuple[int | None, ...], name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a numeric array") from None
    if a.ndim != len(shape) or any(s is not None and s != t for s, t in zip(shape, a.shape)):
        raise ValueError(f"{name} must have shape {shape} (None = any), got {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} holds NaN or Inf")
    return a


class LearnedRouter(Router):
    """A feed-forward router on standardised probe features.

    Args:
        features: names of the input features (a subset of FEATURE_NAMES, no repeats).
        center, scale: float [f] standardisation ``z = (x - center) / scale`` (scale > 0).
        layers: list of (W [in, out], b [out]); hidden layers use ReLU, the last one
            has out = 1 and gives the logit.
        threshold: probability in (0, 1) at or above which a query recollects.
        probe: the probe settings the features were measured with.

    Raises:
        ValueError: unknown / repeated features, shapes that do not chain, a last
            layer not of width 1, non-finite weights, scale <= 0, threshold outside (0, 1).
    """

    kind = "learned"

    def __init__(
        self,
        features: Sequence[str],
        center: Any,
        scale: Any,
        layers: Sequence[tuple[Any, Any]],
        threshold: float = 0.5,
        probe: ProbeSettings | None = None,
    ) -> None:
        super().__init__(probe or ProbeSettings())
        feats = tuple(str(f) for f in features)
        bad = [f for f in feats if f not in FEATURE_NAMES]
        if bad or not feats or len(set(feats)) != len(feats):
            raise ValueError(f"features must be distinct names from {FEATURE_NAMES}, got {list(features)}")
        f = len(feats)
        self.features = feats
        self.center = _matrix(center, (f,), "center")
        self.scale = _matrix(scale, (f,), "scale")
        if np.any(self.scale <= 0):
            raise ValueError("scale must be > 0 everywhere")
        if not layers:
            raise ValueError("layers must hold at least one (W, b) pair")
        self.layers: list[tuple[np.ndarray, np.ndarray]] = []
        width = f
        for i, (W, b) in enumerate(layers):
            W = _matrix(W, (width, None), f"layers[{i}].W")
            b = _matrix(b, (W.shape[1],), f"layers[{i}].b")
            self.layers.append((W, b))
            width = W.shape[1]
        if width != 1:
            raise ValueError(f"the last layer must have 1 output (the logit), got {width}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be a probability in (0, 1), got {threshold!r}")
        self.threshold = float(threshold)

    def probability(self, signals: ProbeSignals) -> np.ndarray:
        """P(recollection is better) of every query, float64 [b] (see the module docstring)."""
        h = (signals.features(self.features) - self.center) / self.scale
        for i, (W, b) in enumerate(self.layers):
            h = h @ W + b
            if i + 1 < len(self.layers):
                h = np.maximum(h, 0.0)
        z = np.clip(h[:, 0], -500.0, 500.0)
        return 1.0 / (1.0 + np.exp(-z))

    def decide(self, signals: ProbeSignals) -> tuple[np.ndarray, np.ndarray]:
        """Recollect where :meth:`probability` >= threshold."""
        reco = self.probability(signals) >= self.threshold
        rule = np.where(reco, RULE_LEARNED_RECOLLECTION, RULE_LEARNED_FAMILIARITY).astype(np.int64)
        return reco.astype(np.int64), rule

    def params(self) -> dict[str, Any]:
        """{"features", "center", "scale", "layers": [{"W", "b"}], "threshold"} as lists."""
        return {
            "features": list(self.features),
            "center": self.center.tolist(),
            "scale": self.scale.tolist(),
            "layers": [{"W": W.tolist(), "b": b.tolist()} for W, b in self.layers],
            "threshold": self.threshold,
        }

    @classmethod
    def from_params(cls, params: dict[str, Any], probe: ProbeSettings) -> "LearnedRouter":
        """Rebuild from :meth:`params` (ValueError on a missing or malformed entry)."""
        missing = [k for k in ("features", "center", "scale", "layers", "threshold") if k not in params]
        if missing:
            raise ValueError(f"{cls.kind} router parameters lack {missing}")
        layers = params["layers"]
        if not isinstance(layers, list) or not all(isinstance(x, dict) and {"W", "b"} <= set(x) for x in layers):
            raise ValueError("layers must be a list of {'W': [[...]], 'b': [...]} objects")
        return cls(
            params["features"], params["center"], params["scale"], [(x["W"], x["b"]) for x in layers],
            params["threshold"], probe,
        )  # fmt: skip


@register
class LogisticRouter(LearnedRouter):
    """Logistic regression on the probe features (one affine layer)."""

    kind = "logistic"


@register
class MLPRouter(LearnedRouter):
    """A small ReLU multi-layer perceptron on the probe features (the paper's MLP router ablation)."""

    kind = "mlp"


def fit_learned_router(
    kind: str,
    signals: ProbeSignals,
    labels: Any,
    weights: Any = None,
    features: Sequence[str] = FEATURE_NAMES,
    probe: ProbeSettings | None = None,
    hidden: Sequence[int] = (16,),
    C: float = 1.0,
    alpha: float = 1e-3,
    threshold: float = 0.5,
    seed: int = 0,
) -> LearnedRouter:
    """Fit a logistic or MLP router with scikit-learn and export its weights.

    Args:
        kind: "logistic" (``LogisticRegression(C=C)``) or "mlp"
            (``MLPClassifier(hidden, alpha=alpha, random_state=seed)``, ReLU, lbfgs).
        signals: probe signals of the n labelled questions.
        labels: int [n], 1 where recollection is the better path, 0 where familiarity is.
        weights: float [n] >= 0 sample weights (e.g. the recall difference between the
            paths; 0 drops a question), default 1.
        features: feature names (default all of FEATURE_NAMES).
        probe: the probe settings the signals were measured with.
        hidden, C, alpha, threshold, seed: as above.

    Returns:
        LogisticRouter or MLPRouter.

    Raises:
        ValueError: unknown kind; labels / weights of the wrong length or values; fewer
            than two classes among the questions of positive weight.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.preprocessing import StandardScaler

    if kind not in ("logistic", "mlp"):
        raise ValueError(f"kind must be 'logistic' or 'mlp', got {kind!r}")
    X = signals.features(tuple(features))
    y = np.asarray(labels).astype(np.int64).ravel()
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if y.shape != (X.shape[0],) or w.shape != y.shape:
        raise ValueError(f"labels and weights need {X.shape[0]} entries, got {y.shape[0]} and {w.shape[0]}")
    if not np.isin(y, (0, 1)).all() or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("labels must be 0/1 and weights finite and >= 0")
    keep = w > 0
    if len(np.unique(y[keep])) < 2:
        raise ValueError("a learned router needs questions of both labels with positive weight")
    X, y, w = X[keep], y[keep], w[keep] / w[keep].mean()
    scaler = StandardScaler().fit(X)
    Z = scaler.transform(X)
    if kind == "logistic":
        clf = LogisticRegression(C=C, max_iter=1000).fit(Z, y, sample_weight=w)
        layers = [(clf.coef_.T, clf.intercept_)]
        cls: type[LearnedRouter] = LogisticRouter
    else:
        clf = MLPClassifier(
            hidden_layer_sizes=tuple(hidden), alpha=alpha, solver="lbfgs", max_iter=2000, random_state=seed
        ).fit(Z, y, sample_weight=w)
        layers = list(zip(clf.coefs_, clf.intercepts_))
        cls = MLPRouter
    scale = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
    return cls(tuple(features), scaler.mean_, scale, layers, threshold, probe)
