"""Familiarity signals and the router (spec sections 1-2), against a plain numpy re-derivation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rfmem_fast import RFMemConfig
from rfmem_fast.routing.base import RULE_NAMES
from rfmem_fast.routing.threshold import route
from rfmem_fast.signals import familiarity_signals


def numpy_signals(s, lam, conv):
    s = np.asarray([x for x in s if np.isfinite(x)], dtype=np.float64)
    if s.size == 0:
        return 0.0, 0.0
    p = np.exp(lam * (s - s.max()))
    p /= p.sum()
    h = -sum(pi * math.log(pi) for pi in p if pi > 0)
    if conv == "mean":
        h /= s.size
    elif conv == "normalized":
        h = h / math.log(s.size) if s.size > 1 else 0.0
    return float(s.mean()), h


@pytest.mark.parametrize("conv", ["mean", "sum", "normalized"])
@pytest.mark.parametrize("lam", [1.0, 20.0, 30.0, 500.0])
def test_signals_match_numpy(conv, lam):
    rng = np.random.default_rng(3)
    s = -np.sort(-rng.uniform(-0.2, 0.9, size=(6, 10)), axis=1)
    s[1, 7:] = -np.inf  # fewer items than probe_k
    s[2, 1:] = -np.inf  # one item
    s[3, :] = -np.inf  # empty bank
    s[4, :] = 0.5  # all tied: maximum entropy
    mean, ent, count = familiarity_signals(torch.from_numpy(s), lam, conv)
    assert count.tolist() == [10, 7, 1, 0, 10, 10]
    for i in range(6):
        m, h = numpy_signals(s[i], lam, conv)
        assert mean[i].item() == pytest.approx(m, abs=1e-12)
        assert ent[i].item() == pytest.approx(h, abs=1e-9)


def test_mean_convention_maximum_is_lnK_over_K():
    _, ent, _ = familiarity_signals(torch.full((1, 10), 0.3), 20.0, "mean")
    assert ent.item() == pytest.approx(math.log(10) / 10)  # 0.2303, spec section 1


def test_signals_reject_bad_convention():
    with pytest.raises(ValueError, match="convention"):
        familiarity_signals(torch.zeros(1, 3), 20.0, "bogus")


def test_router_rules_in_order():
    cfg = RFMemConfig(theta_high=0.6, theta_low=0.2, tau=0.2)
    mean = torch.tensor([0.7, 0.6, 0.1, 0.2, 0.4, 0.4, 0.0], dtype=torch.float64)
    ent = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.1, 0.2, 0.0], dtype=torch.float64)
    count = torch.tensor([10, 10, 10, 10, 10, 10, 0])
    r, rule = route(mean, ent, count, cfg)
    assert [RULE_NAMES[x] for x in rule] == [
        "mean_high", "mean_high", "mean_low", "mean_low", "entropy_low", "entropy_high", "no_hits",
    ]  # fmt: skip
    assert r.tolist() == [0, 0, 1, 1, 0, 1, 1]
