"""Deprecated: the threshold router and the route / rule codes moved into :mod:`rfmem_fast.routing`.

* :func:`~rfmem_fast.routing.threshold.route`, :func:`~rfmem_fast.routing.threshold.route_by_thresholds`
  and :func:`~rfmem_fast.routing.threshold.route_tensor`: :mod:`rfmem_fast.routing.threshold`,
  the one home of the spec's threshold router (with :class:`~rfmem_fast.routing.threshold.ThresholdRouter`);
* the route codes (``FAMILIARITY``, ``RECOLLECTION``, ``ROUTE_NAMES``) and rule codes
  (``RULE_*``, ``RULE_NAMES``): :mod:`rfmem_fast.routing.base`, with the Router interface
  that reports them.

The old names still work here: each access emits a :class:`DeprecationWarning` and
returns the object from its new home (the same object).
"""
from __future__ import annotations

import warnings
from typing import Any

#: old name -> the module that holds it
_MOVED = {
    "FAMILIARITY": "rfmem_fast.routing.base",
    "RECOLLECTION": "rfmem_fast.routing.base",
    "ROUTE_NAMES": "rfmem_fast.routing.base",
    "RULE_MEAN_HIGH": "rfmem_fast.routing.base",
    "RULE_MEAN_LOW": "rfmem_fast.routing.base",
    "RULE_ENTROPY_LOW": "rfmem_fast.routing.base",
    "RULE_ENTROPY_HIGH": "rfmem_fast.routing.base",
    "RULE_NO_HITS": "rfmem_fast.routing.base",
    "RULE_FORCED_DENSE": "rfmem_fast.routing.base",
    "RULE_FORCED_RECOLLECTION": "rfmem_fast.routing.base",
    "RULE_LEARNED_FAMILIARITY": "rfmem_fast.routing.base",
    "RULE_LEARNED_RECOLLECTION": "rfmem_fast.routing.base",
    "RULE_NAMES": "rfmem_fast.routing.base",
    "route": "rfmem_fast.routing.threshold",
    "route_by_thresholds": "rfmem_fast.routing.threshold",
    "route_tensor": "rfmem_fast.routing.threshold",
}

__all__ = list(_MOVED)  # ``from rfmem_fast.router import *`` still gets them (with the warnings)


def __getattr__(name: str) -> Any:
    """The moved name ``name`` from its new home, with a DeprecationWarning.

    Raises:
        AttributeError: a name this module never had.
    """
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"rfmem_fast.router.{name} moved to {home}.{name}; import it from there "
        "(rfmem_fast.router is deprecated)",
        DeprecationWarning,
        stacklevel=2,
    )
    from .routing import base, threshold

    return getattr(base if home.endswith(".base") else threshold, name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_MOVED))
