"""Routing and path merging above the engine (DESIGN.md, "routing/").

* :mod:`.features`: the probe signals a router sees and the six probe features;
* :mod:`.base`: the :class:`Router` interface (batched ``route(signals)``);
* :mod:`.threshold`: the spec's threshold router (RFMEM_SPEC.md section 2);
* :mod:`.learned`: logistic-regression and MLP routers (fitted with scikit-learn,
  evaluated with numpy);
* :mod:`.files`: versioned JSON router files;
* :mod:`.merge`: merging the probe's list with the recollection's hits
  (``RFMemConfig.merge``);
* :mod:`.calibrate`: labelling questions by their better path and fitting routers.

:func:`rfmem_fast.search` asks the config's router for the routes and
:func:`merge_paths` for the Recollection path's final list; nothing here touches a
backend.
"""
from __future__ import annotations

from .calibrate import ROUTER_FIT_KINDS, Calibration, calibrate, fit_router, path_labels, question_recalls
from .base import ROUTER_KINDS, ProbeSettings, Router, register
from .features import FEATURE_NAMES, ProbeSignals, probe_features
from .files import ROUTER_FORMAT, ROUTER_VERSION, RouterFileError, load_router, save_router
from .learned import LearnedRouter, LogisticRouter, MLPRouter, fit_learned_router
from .merge import MERGE_MODES, merge_paths
from .threshold import ThresholdRouter

__all__ = [
    "FEATURE_NAMES",
    "MERGE_MODES",
    "ROUTER_FIT_KINDS",
    "ROUTER_FORMAT",
    "ROUTER_KINDS",
    "ROUTER_VERSION",
    "Calibration",
    "LearnedRouter",
    "LogisticRouter",
    "MLPRouter",
    "ProbeSettings",
    "ProbeSignals",
    "Router",
    "RouterFileError",
    "ThresholdRouter",
    "calibrate",
    "fit_learned_router",
    "fit_router",
    "load_router",
    "merge_paths",
    "path_labels",
    "probe_features",
    "question_recalls",
    "register",
    "save_router",
]
