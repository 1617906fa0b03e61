"""The spec's threshold router (RFMEM_SPEC.md section 2): its one home.

Rules, first match wins: no probe hit -> recollection; ``mean >= theta_high`` ->
familiarity; ``mean <= theta_low`` -> recollection; ``H < tau`` -> familiarity; else
recollection. :func:`route_by_thresholds` does the work on the host, :func:`route` with
an RFMemConfig's thresholds (what the default search runs on numpy batches),
:func:`route_tensor` the same rules as tensor operations on the signals' device, and
:class:`ThresholdRouter` wraps them as a :class:`~rfmem_fast.routing.base.Router`, so the
router and the default search (thresholds taken from RFMemConfig) agree exactly. The
thresholds can be calibrated (:func:`rfmem_fast.routing.calibrate.fit_router`).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..config import RFMemConfig
from .base import (
    RULE_ENTROPY_HIGH,
    RULE_ENTROPY_LOW,
    RULE_MEAN_HIGH,
    RULE_MEAN_LOW,
    RULE_NO_HITS,
    ProbeSettings,
    Router,
    register,
)
from .features import ProbeSignals

__all__ = ["ThresholdRouter", "route", "route_by_thresholds", "route_tensor"]


def route(mean: Any, entropy: Any, count: Any, config: RFMemConfig) -> tuple[np.ndarray, np.ndarray]:
    """Route each query to the familiarity or the recollection path.

    Rules, first match wins (spec section 2)::

        no probe hits         -> recollection  (rule "no_hits")
        mean >= theta_high    -> familiarity   (rule "mean_high")
        mean <= theta_low     -> recollection  (rule "mean_low")
        H < tau               -> familiarity   (rule "entropy_low")
        else                  -> recollection  (rule "entropy_high")

    Args:
        mean: float [b] mean probe score (numpy array or torch tensor, any device).
        entropy: float [b] probe entropy (in the config's convention).
        count: int [b] number of probe hits (0 for an empty bank).
        config: thresholds ``theta_high``, ``theta_low``, ``tau``.

    Returns:
        (route int64 ndarray [b] with FAMILIARITY=0 / RECOLLECTION=1,
         rule int64 ndarray [b], an index into RULE_NAMES). Computed on the host: the
        b signals are tiny, and the results go to the caller as numpy anyway.
    """
    return route_by_thresholds(mean, entropy, count, config.theta_high, config.theta_low, config.tau)


def route_by_thresholds(
    mean: Any, entropy: Any, count: Any, theta_high: float, theta_low: float, tau: float
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`route` with the three thresholds given directly (same rules, same outputs)."""
    mean, entropy, count = _host(mean), _host(entropy), _host(count)
    if mean.shape == (1,) and entropy.shape == (1,) and count.shape == (1,):
        # one query (the latency case): the rules on Python numbers, ~10x fewer microseconds
        # than the array calls below, the same comparisons (a NaN fails each, as there)
        m, h = mean.item(0), entropy.item(0)
        r = (RULE_NO_HITS if count.item(0) == 0 else RULE_MEAN_HIGH if m >= theta_high else
             RULE_MEAN_LOW if m <= theta_low else RULE_ENTROPY_LOW if h < tau else RULE_ENTROPY_HIGH)  # fmt: skip
        return np.array([_ROUTE_OF_RULE.item(r)], dtype=np.int64), np.array([r], dtype=np.int64)
    # the rules nested by priority, the first match outermost (as route_tensor): few numpy
    # calls, which is what a one-query batch pays for
    rule = np.where(
        count == 0,
        _RULE[RULE_NO_HITS],
        np.where(
            mean >= theta_high,
            _RULE[RULE_MEAN_HIGH],
            np.where(mean <= theta_low, _RULE[RULE_MEAN_LOW],
                     np.where(entropy < tau, _RULE[RULE_ENTROPY_LOW], _RULE[RULE_ENTROPY_HIGH])),
        ),
    )  # fmt: skip
    return _ROUTE_OF_RULE[rule], rule  # FAMILIARITY = 0, RECOLLECTION = 1


#: the rule codes as int64 scalars (np.where keeps int64 whatever the platform's default int)
_RULE = np.arange(RULE_NO_HITS + 1, dtype=np.int64)
#: the route of each threshold rule (familiarity for mean_high and entropy_low)
_ROUTE_OF_RULE = np.ones(RULE_NO_HITS + 1, dtype=np.int64)
_ROUTE_OF_RULE[[RULE_MEAN_HIGH, RULE_ENTROPY_LOW]] = 0
_ROUTE_OF_RULE.setflags(write=False)


def route_tensor(
    mean: torch.Tensor, entropy: torch.Tensor, count: torch.Tensor, config: RFMemConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` on the signals' own device, without a host synchronisation.

    The same rules in the same priority (spec section 2), as tensor operations, for
    device-resident batches (``search(..., output="torch")``); tests/test_device_resident.py
    checks that it equals :func:`route` on every rule and at the thresholds.

    Args:
        mean: float [b] mean probe score (tensor, any device).
        entropy: float [b] probe entropy (the config's convention), same device.
        count: int [b] probe hits, same device.
        config: thresholds ``theta_high``, ``theta_low``, ``tau``.

    Returns:
        (route int64 [b], rule int64 [b]) on the signals' device, codes as :func:`route`.

    Raises:
        TypeError: an argument that is not a torch.Tensor.
    """
    for name, t in (("mean", mean), ("entropy", entropy), ("count", count)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    # the rules nested by priority, the first match outermost (as route()); few tensor
    # operations, each costing a dispatch on a one-query batch
    rule = torch.where(
        count == 0,
        RULE_NO_HITS,
        torch.where(
            mean >= config.theta_high,
            RULE_MEAN_HIGH,
            torch.where(
                mean <= config.theta_low,
                RULE_MEAN_LOW,
                torch.where(entropy < config.tau, RULE_ENTROPY_LOW, RULE_ENTROPY_HIGH),
            ),
        ),
    )
    # recollection for the odd rule codes (mean_low 1, entropy_high 3) and no_hits (4);
    # tests/test_device_resident.py checks the routes against route() on every rule
    return (rule % 2) + (rule == RULE_NO_HITS), rule


def _host(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@register
class ThresholdRouter(Router):
    """Route by the mean probe score and the probe entropy (spec section 2).

    Args:
        theta_high, theta_low: mean-score thresholds in [-1, 1], ``theta_low <= theta_high``.
        tau: entropy threshold >= 0 (in ``probe.entropy``'s convention).
        probe: probe settings (default: the spec's, probe_k 10, temperature 20, "mean").

    Raises:
        ValueError: a threshold out of range / not finite, or theta_low > theta_high.
    """

    kind = "threshold"

    def __init__(self, theta_high: float, theta_low: float, tau: float, probe: ProbeSettings | None = None) -> None:
        super().__init__(probe or ProbeSettings())
        vals = {"theta_high": theta_high, "theta_low": theta_low, "tau": tau}
        for name, v in vals.items():
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not math.isfinite(v):
                raise ValueError(f"ThresholdRouter.{name} must be a finite float, got {v!r}")
        if not (-1.0 <= theta_low <= theta_high <= 1.0):
            raise ValueError(
                f"ThresholdRouter needs -1 <= theta_low <= theta_high <= 1, got theta_low={theta_low}, theta_high={theta_high}"
            )
        if tau < 0:
            raise ValueError(f"ThresholdRouter.tau must be >= 0, got {tau}")
        self.theta_high, self.theta_low, self.tau = float(theta_high), float(theta_low), float(tau)

    @classmethod
    def from_config(cls, config: Any) -> "ThresholdRouter":
        """The router of an RFMemConfig's ``theta_high`` / ``theta_low`` / ``tau``."""
        return cls(config.theta_high, config.theta_low, config.tau, ProbeSettings.of(config))

    def decide(self, signals: ProbeSignals) -> tuple[np.ndarray, np.ndarray]:
        """Spec section 2's rules on every query (see the module docstring)."""
        return route_by_thresholds(signals.mean, signals.entropy, signals.count, self.theta_high, self.theta_low, self.tau)

    def params(self) -> dict[str, Any]:
        """{"theta_high", "theta_low", "tau"}."""
        return {"theta_high": self.theta_high, "theta_low": self.theta_low, "tau": self.tau}

    @classmethod
    def from_params(cls, params: dict[str, Any], probe: ProbeSettings) -> "ThresholdRouter":
        """Rebuild from :meth:`params` (ValueError on a missing or bad value)."""
        missing = [k for k in ("theta_high", "theta_low", "tau") if k not in params]
        if missing:
            raise ValueError(f"threshold router parameters lack {missing}")
        return cls(params["theta_high"], params["theta_low"], params["tau"], probe)
