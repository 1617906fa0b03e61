"""The threshold router of RF-Mem (RFMEM_SPEC.md section 2), route and rule codes.

Learned routers and the router interface live in :mod:`rfmem_fast.routing`; they
report their decisions with the rule codes defined here.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .config import RFMemConfig

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
    mean, entropy, count = (_host(x) for x in (mean, entropy, count))
    rule = np.full(mean.shape, RULE_ENTROPY_HIGH, dtype=np.int64)
    # lowest priority first: each later rule overrides the earlier ones
    rule[entropy < tau] = RULE_ENTROPY_LOW
    rule[mean <= theta_low] = RULE_MEAN_LOW
    rule[mean >= theta_high] = RULE_MEAN_HIGH
    rule[count == 0] = RULE_NO_HITS
    fam = (rule == RULE_MEAN_HIGH) | (rule == RULE_ENTROPY_LOW)
    return (~fam).astype(np.int64), rule  # FAMILIARITY = 0, RECOLLECTION = 1


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
