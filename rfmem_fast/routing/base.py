"""The router interface (DESIGN.md, "routing/"): probe signals in, one path per query out.

A router decides, for a batch of queries, between the Familiarity path (return the
probe's top ``out_k``) and the Recollection path (RFMEM_SPEC.md sections 2-4). It sees
only the probe (:class:`~rfmem_fast.routing.features.ProbeSignals`), decides for the
whole batch at once with numpy, and never touches a backend. A new router is one
subclass of :class:`Router` (registered with :func:`register`) plus its test. Every
router reports its decisions with the route codes (:data:`FAMILIARITY`,
:data:`RECOLLECTION`) and rule codes (:data:`RULE_NAMES`) defined here.

Every router records the probe settings its inputs depend on (``probe_k``,
``temperature``, entropy convention): a threshold on the entropy, or a weight fitted on
it, means nothing under another temperature. :meth:`Router.check_config` refuses a
config whose probe differs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .features import ProbeSignals

__all__ = [
    "FAMILIARITY", "RECOLLECTION", "ROUTE_NAMES", "RULE_NAMES", "RULE_MEAN_HIGH", "RULE_MEAN_LOW",
    "RULE_ENTROPY_LOW", "RULE_ENTROPY_HIGH", "RULE_NO_HITS", "RULE_FORCED_DENSE", "RULE_FORCED_RECOLLECTION",
    "RULE_LEARNED_FAMILIARITY", "RULE_LEARNED_RECOLLECTION", "ProbeSettings", "Router", "register", "ROUTER_KINDS",
]

# The two paths a router chooses between (route codes), one per query.
FAMILIARITY = 0
RECOLLECTION = 1
ROUTE_NAMES = ("familiarity", "recollection")

# Which rule fired, one code per query.
RULE_MEAN_HIGH = 0  # mean >= theta_high            -> familiarity
RULE_MEAN_LOW = 1  # mean <= theta_low              -> recollection
RULE_ENTROPY_LOW = 2  # H < tau                       -> familiarity
RULE_ENTROPY_HIGH = 3  # otherwise                    -> recollection
RULE_NO_HITS = 4  # empty bank: no probe hits         -> recollection
RULE_FORCED_DENSE = 5  # mode "dense"
RULE_FORCED_RECOLLECTION = 6  # mode "recollection"
RULE_LEARNED_FAMILIARITY = 7  # a learned router (rfmem_fast.routing) chose familiarity
RULE_LEARNED_RECOLLECTION = 8  # a learned router chose recollection
RULE_NAMES = (
    "mean_high",
    "mean_low",
    "entropy_low",
    "entropy_high",
    "no_hits",
    "forced_dense",
    "forced_recollection",
    "learned_familiarity",
    "learned_recollection",
)


#: kind name -> Router subclass (filled by :func:`register`)
ROUTER_KINDS: dict[str, type["Router"]] = {}


@dataclass(frozen=True)
class ProbeSettings:
    """The probe a router's inputs were measured with (RFMEM_SPEC.md section 1).

    Attributes:
        probe_k: int >= 1, the probe's K.
        temperature: float > 0, softmax temperature of the entropy.
        entropy: "mean" | "sum" | "normalized", the entropy convention.
    """

    probe_k: int = 10
    temperature: float = 20.0
    entropy: str = "mean"

    @classmethod
    def of(cls, config: Any) -> "ProbeSettings":
        """The probe settings of an RFMemConfig."""
        return cls(int(config.probe_k), float(config.temperature), str(config.entropy))

    def to_dict(self) -> dict[str, Any]:
        """As a JSON-serialisable dict."""
        return {"probe_k": self.probe_k, "temperature": self.temperature, "entropy": self.entropy}


class Router:
    """Base class of the routers.

    Subclasses set ``kind`` and implement :meth:`decide`, :meth:`params` and
    :meth:`from_params`.

    Args:
        probe: the probe settings the router was made for.
    """

    kind: ClassVar[str] = "base"

    def __init__(self, probe: ProbeSettings) -> None:
        if not isinstance(probe, ProbeSettings):
            raise TypeError(f"probe must be a ProbeSettings, got {type(probe).__name__}")
        self.probe = probe

    # ---------------------------------------------------------------- interface
    def decide(self, signals: ProbeSignals) -> tuple[np.ndarray, np.ndarray]:
        """Route every query of a batch.

        Args:
            signals: the probe signals of b queries.

        Returns:
            (route int64 [b]: 0 familiarity / 1 recollection, rule int64 [b]: index into
            :data:`RULE_NAMES`).
        """
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """The router's parameters as a JSON-serialisable dict (see :meth:`from_params`)."""
        raise NotImplementedError

    @classmethod
    def from_params(cls, params: dict[str, Any], probe: ProbeSettings) -> "Router":
        """Rebuild a router from :meth:`params`.

        Raises:
            ValueError: a missing or malformed parameter (the message names it).
        """
        raise NotImplementedError

    # ---------------------------------------------------------------- shared
    def route(self, signals: ProbeSignals) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`decide`, with queries that have no probe hit sent to recollection
        (rule "no_hits", spec section 1: an empty bank recollects, with an empty result)."""
        routes, rules = self.decide(signals)
        empty = signals.count == 0
        routes = np.where(empty, RECOLLECTION, routes).astype(np.int64)
        rules = np.where(empty, RULE_NO_HITS, rules).astype(np.int64)
        return routes, rules

    def check_config(self, config: Any) -> None:
        """Refuse a config whose probe differs from the one the router was made for.

        Raises:
            ValueError: naming the differing fields and both values.
        """
        mine, theirs = self.probe.to_dict(), ProbeSettings.of(config).to_dict()
        diff = [f"{k}: router {mine[k]!r} vs config {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
        if diff:
            raise ValueError(
                f"the {self.kind} router was made for another probe ({'; '.join(diff)}); "
                "recalibrate it, or set these RFMemConfig fields to the router's values"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params()}, probe={self.probe})"


def register(cls: type[Router]) -> type[Router]:
    """Class decorator: make a Router subclass loadable by its ``kind`` (router files)."""
    ROUTER_KINDS[cls.kind] = cls
    return cls
