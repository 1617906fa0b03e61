"""Calibrating a router on labelled questions (``rfmem calibrate``; the paper's router ablation).

A labelled question is a query vector, its user and its relevant item ids. Both paths
are run for every question (``search`` in modes "dense" and "recollection" with the
same config, so the Recollection path includes ``config.merge``), and each question is
labelled by the path with the higher Recall@k: 1 = recollection, 0 = familiarity. A
tie (the usual case: both paths find the same relevant items) says nothing about the
routing and gets weight 0; every other question is weighted by the recall difference,
so a router is fitted to the recall it can gain or lose.

* ``"threshold"``: the spec's three thresholds (theta_high, theta_low, tau), picked by
  exhaustive search over a grid of quantiles of the training questions' mean scores
  and entropies (scikit-learn's ``ParameterGrid``): the grid point with the highest
  total routed recall; ties go to fewer recollecting questions (the cheaper router),
  then to grid order.
* ``"logistic"`` / ``"mlp"``: :func:`rfmem_fast.routing.learned.fit_learned_router`
  with those labels and weights.

Relevant ids are either a plain list (every id relevant; recall = fraction found) or a
PersonaBench mapping ``{answer alternative: [ids]}`` (one id per alternative, best
combination; :func:`rfmem_fast.metrics.recall_ndcg_at_k`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from .base import RECOLLECTION, ProbeSettings, Router
from .features import ProbeSignals
from .learned import fit_learned_router
from .threshold import ThresholdRouter, route_by_thresholds

__all__ = [
    "ROUTER_FIT_KINDS",
    "path_labels",
    "question_recalls",
    "fit_router",
    "fit_threshold_router",
    "Calibration",
    "calibrate",
    "reranker_pools",
    "calibrate_reranker",
]

#: router kinds :func:`fit_router` can fit
ROUTER_FIT_KINDS = ("threshold", "logistic", "mlp")


def path_labels(dense_recall: Any, reco_recall: Any) -> tuple[np.ndarray, np.ndarray]:
    """Label each question by its better path.

    Args:
        dense_recall, reco_recall: float [n] per-question recall of the two paths.

    Returns:
        (labels int64 [n]: 1 where recollection is better, else 0;
         weights float64 [n]: |difference|, 0 on ties).

    Raises:
        ValueError: arrays of different shapes.
    """
    d = np.asarray(dense_recall, dtype=np.float64)
    r = np.asarray(reco_recall, dtype=np.float64)
    if d.shape != r.shape or d.ndim != 1:
        raise ValueError(f"dense_recall and reco_recall must be 1-D of one length, got {d.shape} and {r.shape}")
    return (r > d).astype(np.int64), np.abs(r - d)


def _as_gt(rel: Any) -> Mapping[str, Sequence[str]]:
    if isinstance(rel, Mapping):
        return {str(a): [str(x) for x in ids] for a, ids in rel.items()}
    if isinstance(rel, (str, bytes)) or not hasattr(rel, "__iter__"):
        raise TypeError(f"relevant ids must be a list of ids or a mapping {{alternative: [ids]}}, got {rel!r:.60}")
    return {str(i): [str(x)] for i, x in enumerate(rel)}


def question_recalls(result: Any, relevant: Sequence[Any], k: int) -> np.ndarray:
    """Recall@k of every query of a SearchResult.

    Args:
        result: a :class:`rfmem_fast.SearchResult` of n queries.
        relevant: n entries, each a list of relevant ids or a mapping
            ``{alternative: [ids]}`` (ids compared as strings).
        k: cut-off >= 1.

    Returns:
        float64 [n].

    Raises:
        ValueError: ``relevant`` not of length n; TypeError: an entry of another type.
    """
    from ..metrics import recall_at_k

    if len(relevant) != len(result):
        raise ValueError(f"relevant has {len(relevant)} entries but the result has {len(result)} queries")
    return np.array(
        [recall_at_k([str(x) for x in result.ids_list(i)], _as_gt(rel), k) for i, rel in enumerate(relevant)],
        dtype=np.float64,
    )


def fit_threshold_router(
    signals: ProbeSignals,
    dense_recall: Any,
    reco_recall: Any,
    probe: ProbeSettings | None = None,
    quantiles: int = 11,
) -> ThresholdRouter:
    """The spec's thresholds that maximise the routed recall of the training questions.

    Args:
        signals: probe signals of the n questions.
        dense_recall, reco_recall: float [n] per-question recall of each path.
        probe: the probe settings of the signals.
        quantiles: grid points per threshold taken from the data (plus the
            "never" ends: theta_high 1, theta_low -1, tau 0).

    Returns:
        ThresholdRouter (see the module docstring for the search and tie rule).
    """
    from sklearn.model_selection import ParameterGrid

    d = np.asarray(dense_recall, dtype=np.float64)
    r = np.asarray(reco_recall, dtype=np.float64)
    qs = np.linspace(0.0, 1.0, quantiles)
    means, ents = signals.mean, signals.entropy
    hi = sorted(set(np.round(np.quantile(means, qs), 6).tolist()) | {1.0})
    lo = sorted(set(np.round(np.quantile(means, qs), 6).tolist()) | {-1.0})
    taus = sorted(set(np.round(np.quantile(ents, qs), 6).tolist()) | {0.0})
    best: tuple[float, int, dict[str, float]] | None = None
    for g in ParameterGrid({"theta_high": hi, "theta_low": lo, "tau": taus}):
        if g["theta_low"] > g["theta_high"]:
            continue
        routes, _ = route_by_thresholds(means, ents, signals.count, g["theta_high"], g["theta_low"], g["tau"])
        reco = routes == RECOLLECTION
        total = float(np.where(reco, r, d).sum())
        n_reco = int(reco.sum())
        if best is None or total > best[0] + 1e-12 or (abs(total - best[0]) <= 1e-12 and n_reco < best[1]):
            best = (total, n_reco, g)
    assert best is not None
    g = best[2]
    return ThresholdRouter(g["theta_high"], g["theta_low"], g["tau"], probe)


def fit_router(
    kind: str,
    signals: ProbeSignals,
    dense_recall: Any,
    reco_recall: Any,
    probe: ProbeSettings | None = None,
    seed: int = 0,
) -> Router:
    """Fit a router of ``kind`` on labelled questions (see the module docstring).

    Args:
        kind: one of ROUTER_FIT_KINDS.
        signals: probe signals of the n questions.
        dense_recall, reco_recall: float [n] per-question recall of each path.
        probe: the probe settings the signals were measured with.
        seed: random state of the MLP.

    Returns:
        the fitted Router.

    Raises:
        ValueError: unknown kind; mismatched lengths; for a learned router, no
            question where one path beats the other in each direction.
    """
    if kind not in ROUTER_FIT_KINDS:
        raise ValueError(f"kind must be one of {ROUTER_FIT_KINDS}, got {kind!r}")
    labels, weights = path_labels(dense_recall, reco_recall)
    if len(labels) != len(signals):
        raise ValueError(f"{len(signals)} questions' signals but {len(labels)} recalls")
    if kind == "threshold":
        return fit_threshold_router(signals, dense_recall, reco_recall, probe)
    return fit_learned_router(kind, signals, labels, weights, probe=probe, seed=seed)


@dataclass
class Calibration:
    """What :func:`calibrate` measured and fitted.

    Attributes:
        router: the fitted router.
        signals: probe signals of the questions.
        dense_recall, reco_recall: float64 [n] per-question Recall@k of each path.
        labels, weights: :func:`path_labels` of those.
        k: the cut-off.
    """

    router: Router
    signals: ProbeSignals
    dense_recall: np.ndarray
    reco_recall: np.ndarray
    labels: np.ndarray
    weights: np.ndarray
    k: int

    def summary(self) -> dict[str, Any]:
        """Counts and in-sample recalls (JSON-serialisable; in-sample: optimistic)."""
        routes, _ = self.router.route(self.signals)
        reco = routes == RECOLLECTION
        routed = np.where(reco, self.reco_recall, self.dense_recall)
        return {
            "questions": int(len(self.labels)),
            "recollection_better": int(((self.labels == 1) & (self.weights > 0)).sum()),
            "familiarity_better": int(((self.labels == 0) & (self.weights > 0)).sum()),
            "ties": int((self.weights == 0).sum()),
            "k": self.k,
            "dense_recall": float(self.dense_recall.mean()),
            "recollection_recall": float(self.reco_recall.mean()),
            "oracle_recall": float(np.maximum(self.dense_recall, self.reco_recall).mean()),
            "routed_recall_in_sample": float(routed.mean()),
            "fraction_recollecting_in_sample": float(reco.mean()),
        }


def calibrate(
    bank: Any,
    queries: Any,
    users: Sequence[Hashable],
    relevant: Sequence[Any],
    config: Any = None,
    kind: str = "logistic",
    k: int | None = None,
    backend: str = "auto",
    seed: int = 0,
) -> Calibration:
    """Fit a router on one's own labelled questions.

    Args:
        bank: the MemoryBank.
        queries: float [n, d] question vectors.
        users: n user keys.
        relevant: n entries, each a list of relevant item ids or a mapping
            ``{alternative: [ids]}``.
        config: RFMemConfig (its probe settings and Recollection path, merge included).
        kind: one of ROUTER_FIT_KINDS.
        k: Recall cut-off (default ``config.out_k``).
        backend: search backend.
        seed: random state of the MLP.

    Returns:
        :class:`Calibration`; save its router with
        :func:`rfmem_fast.routing.save_router`.

    Raises:
        ValueError / TypeError / KeyError: as :func:`rfmem_fast.search` and
            :func:`fit_router`.
    """
    from ..config import RFMemConfig
    from ..search import search

    config = config or RFMemConfig()
    k = k or config.out_k
    dense = search(bank, queries, users, config, mode="dense", backend=backend)
    reco = search(bank, queries, users, config, mode="recollection", backend=backend)
    d, r = question_recalls(dense, relevant, k), question_recalls(reco, relevant, k)
    signals = ProbeSignals.from_result(dense)
    probe = ProbeSettings.of(config)
    router = fit_router(kind, signals, d, r, probe, seed)
    labels, weights = path_labels(d, r)
    return Calibration(router, signals, d, r, labels, weights, k)


def reranker_pools(
    bank: Any,
    queries: Any,
    users: Sequence[Hashable],
    relevant: Sequence[Any],
    config: Any = None,
    depth: int = 20,
    mode: str = "dense",
    backend: str = "auto",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labelled candidate pools of questions, the training data of :func:`rfmem_fast.routing.fit_reranker`.

    Args:
        bank, queries, users: as :func:`rfmem_fast.search`.
        relevant: n entries, each a list of relevant item ids or a mapping
            ``{alternative: [ids]}``.
        config: RFMemConfig (without a re-ranker) the pools are built with.
        depth: probe items per pool.
        mode: the search mode the pools are built with: "dense" (no recollection),
            "recollection" (every query recollects) or "rfmem" (the config's router);
            use the re-ranker with a config that routes the same way.
        backend: search backend.

    Returns:
        (features float64 [n, L, 4], keep bool [n, L], labels int64 [n, L]).

    Raises:
        ValueError / TypeError / KeyError: as :func:`rfmem_fast.search_candidates` and
            :func:`rfmem_fast.routing.candidate_labels`.
    """
    from ..search import search_candidates
    from .rerank import candidate_labels

    pools = search_candidates(bank, queries, users, config, mode=mode, depth=depth, backend=backend)
    return pools.features, pools.keep, candidate_labels(pools.ids, pools.keep, relevant)


def calibrate_reranker(
    bank: Any,
    queries: Any,
    users: Sequence[Hashable],
    relevant: Sequence[Any],
    config: Any = None,
    features: Sequence[str] = ("cos", "profile"),
    depth: int = 20,
    mode: str = "dense",
    C: float = 1.0,
    backend: str = "auto",
    meta: dict[str, Any] | None = None,
) -> Any:
    """Fit a linear re-ranker on one's own labelled questions (in-sample; judge it on other users).

    :func:`reranker_pools` then :func:`rfmem_fast.routing.fit_reranker` (pairwise
    logistic regression).

    Args:
        bank, queries, users, relevant, config, depth, mode, backend: as :func:`reranker_pools`.
        features: names from :data:`rfmem_fast.routing.RERANK_FEATURES`.
        C: inverse regularisation strength.
        meta: stored with the model (``pool_mode`` and ``depth`` are added).

    Returns:
        :class:`rfmem_fast.routing.LinearReranker`; save it with
        :func:`rfmem_fast.routing.save_reranker` and use it as ``RFMemConfig(reranker=path)``.

    Raises:
        ValueError: as :func:`reranker_pools` and :func:`rfmem_fast.routing.fit_reranker`.
    """
    from .rerank import fit_reranker

    F, K, Y = reranker_pools(bank, queries, users, relevant, config, depth, mode, backend)
    return fit_reranker(F, K, Y, features, depth, C, meta={**(meta or {}), "pool_mode": mode, "depth": depth})
