"""The spec's threshold router as a :class:`~rfmem_fast.routing.base.Router` (RFMEM_SPEC.md section 2).

Rules, first match wins: no probe hit -> recollection; ``mean >= theta_high`` ->
familiarity; ``mean <= theta_low`` -> recollection; ``H < tau`` -> familiarity; else
recollection. :func:`rfmem_fast.router.route_by_thresholds` does the work, so this
router and the default search (thresholds taken from RFMemConfig) agree exactly. The
thresholds can be calibrated (:func:`rfmem_fast.routing.calibrate.fit_router`).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import ProbeSettings, Router, register
from .features import ProbeSignals

__all__ = ["ThresholdRouter"]


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
        from ..router import route_by_thresholds

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
