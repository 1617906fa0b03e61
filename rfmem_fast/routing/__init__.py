"""Routing and path merging above the engine (DESIGN.md, "routing/").

* :mod:`.features`: the probe signals a router sees and the six probe features;
* :mod:`.base`: the :class:`Router` interface (batched ``route(signals)``);
* :mod:`.threshold`: the spec's threshold router (RFMEM_SPEC.md section 2);
* :mod:`.learned`: logistic-regression and MLP routers (fitted with scikit-learn,
  evaluated with numpy);
* :mod:`.files`: versioned JSON router files;
* :mod:`.merge`: merging the probe's list with the recollection's hits
  (``RFMemConfig.merge``);
* :mod:`.calibrate`: labelling questions by their better path and fitting routers;
* :mod:`.profile`: user profiles (the profile prior, ``RFMemConfig.profile_weight``);
* :mod:`.rerank`: a learned linear re-ranker of the two paths' candidates
  (``RFMemConfig.reranker``), fitted pairwise with scikit-learn.

:func:`rfmem_fast.search` asks the config's router for the routes and
:func:`merge_paths` for the Recollection path's final list; nothing here touches a
backend.

Layers (docs "Internals / Layers"): the submodules sit below the search, except
:mod:`.calibrate`, which runs it; this package re-exports calibration too, so the
modules below the search import the submodules (``rfmem_fast.routing.base``, ...), not
the package.
"""
from __future__ import annotations

from .calibrate import (
    ROUTER_FIT_KINDS,
    Calibration,
    calibrate,
    calibrate_reranker,
    fit_router,
    path_labels,
    question_recalls,
)
from .base import ROUTER_KINDS, ProbeSettings, Router, register
from .features import FEATURE_NAMES, ProbeSignals, probe_features
from .files import (
    RERANKER_FORMAT,
    RERANKER_VERSION,
    ROUTER_FORMAT,
    ROUTER_VERSION,
    RerankerFileError,
    RouterFileError,
    load_reranker,
    load_router,
    save_reranker,
    save_router,
)
from .learned import LearnedRouter, LogisticRouter, MLPRouter, fit_learned_router
from .merge import MERGE_MODES, merge_paths
from .profile import fold_profile, user_profiles, view_profiles
from .rerank import RERANK_FEATURES, LinearReranker, candidate_features, candidate_labels, concat_pools, fit_reranker
from .threshold import ThresholdRouter

__all__ = [
    "FEATURE_NAMES",
    "MERGE_MODES",
    "RERANKER_FORMAT",
    "RERANKER_VERSION",
    "RERANK_FEATURES",
    "ROUTER_FIT_KINDS",
    "ROUTER_FORMAT",
    "ROUTER_KINDS",
    "ROUTER_VERSION",
    "Calibration",
    "LearnedRouter",
    "LinearReranker",
    "LogisticRouter",
    "MLPRouter",
    "ProbeSettings",
    "ProbeSignals",
    "Router",
    "RerankerFileError",
    "RouterFileError",
    "ThresholdRouter",
    "calibrate",
    "candidate_features",
    "candidate_labels",
    "concat_pools",
    "calibrate_reranker",
    "fit_reranker",
    "fold_profile",
    "fit_learned_router",
    "fit_router",
    "load_reranker",
    "load_router",
    "merge_paths",
    "path_labels",
    "probe_features",
    "question_recalls",
    "register",
    "save_reranker",
    "save_router",
    "user_profiles",
    "view_profiles",
]
