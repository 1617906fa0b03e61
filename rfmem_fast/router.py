"""The threshold router of RF-Mem (RFMEM_SPEC.md section 2)."""
from __future__ import annotations

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
RULE_NAMES = (
    "mean_high",
    "mean_low",
    "entropy_low",
    "entropy_high",
    "no_hits",
    "forced_dense",
    "forced_recollection",
)


def route(
    mean: torch.Tensor, entropy: torch.Tensor, count: torch.Tensor, config: RFMemConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each query to the familiarity or the recollection path.

    Rules, first match wins (spec section 2)::

        no probe hits         -> recollection  (rule "no_hits")
        mean >= theta_high    -> familiarity   (rule "mean_high")
        mean <= theta_low     -> recollection  (rule "mean_low")
        H < tau               -> familiarity   (rule "entropy_low")
        else                  -> recollection  (rule "entropy_high")

    Args:
        mean: float [b] mean probe score.
        entropy: float [b] probe entropy (in the config's convention).
        count: int [b] number of probe hits (0 for an empty bank).
        config: thresholds ``theta_high``, ``theta_low``, ``tau``.

    Returns:
        (route [b] int64 with FAMILIARITY=0 / RECOLLECTION=1,
         rule [b] int64, an index into RULE_NAMES).
    """
    rule = torch.full_like(count, RULE_ENTROPY_HIGH, dtype=torch.int64)
    rule = torch.where(entropy < config.tau, torch.full_like(rule, RULE_ENTROPY_LOW), rule)
    rule = torch.where(mean <= config.theta_low, torch.full_like(rule, RULE_MEAN_LOW), rule)
    rule = torch.where(mean >= config.theta_high, torch.full_like(rule, RULE_MEAN_HIGH), rule)
    rule = torch.where(count == 0, torch.full_like(rule, RULE_NO_HITS), rule)
    fam = (rule == RULE_MEAN_HIGH) | (rule == RULE_ENTROPY_LOW)
    routes = torch.where(fam, FAMILIARITY, RECOLLECTION).to(torch.int64)
    return routes, rule
