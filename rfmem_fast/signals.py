"""Familiarity signals of a probe: mean score and temperature-softmax entropy (RFMEM_SPEC.md section 1)."""
from __future__ import annotations

import math

import torch

from .config import ENTROPY_CONVENTIONS


def familiarity_signals(
    scores: torch.Tensor, temperature: float, convention: str = "mean"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean score and softmax entropy of each query's probe scores.

    With the K valid scores ``s_1 >= ... >= s_K`` of a row (padding is ``-inf``),
    ``p_i = exp(lam (s_i - s_1)) / sum_j exp(lam (s_j - s_1))`` and

    * ``"mean"`` (the reference's): ``H = -(1/K) sum p_i ln p_i`` (max ln(K)/K),
    * ``"sum"``: ``H = -sum p_i ln p_i`` (Shannon, max ln K),
    * ``"normalized"``: Shannon / ln K in [0, 1] (0 when K = 1).

    ``p ln p`` is taken as 0 where ``p`` underflows to 0. A row with no valid score
    (empty bank) has K = 0, mean 0 and H 0.

    Args:
        scores: float [b, k] probe scores per row, valid ones first in descending
            order, ``-inf`` for padding; any device.
        temperature: lam > 0.
        convention: "mean" | "sum" | "normalized".

    Returns:
        (mean [b] float64, entropy [b] float64, count [b] int64) on the scores' device.

    Raises:
        ValueError: unknown convention, or ``scores`` not 2-D.
    """
    if convention not in ENTROPY_CONVENTIONS:
        raise ValueError(f"convention must be one of {ENTROPY_CONVENTIONS}, got {convention!r}")
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D [b, k], got shape {tuple(scores.shape)}")
    s = scores.to(torch.float64)
    valid = torch.isfinite(s)
    count = valid.sum(dim=1)
    kf = count.to(torch.float64)
    s0 = torch.where(valid, s, torch.zeros_like(s))
    mean = torch.where(count > 0, s0.sum(dim=1) / kf.clamp(min=1), torch.zeros_like(kf))
    top = s0[:, :1] if s.shape[1] else s0.new_zeros((s.shape[0], 1))
    z = torch.where(valid, temperature * (s0 - top), torch.full_like(s0, -math.inf))
    p = torch.softmax(z, dim=1)
    p = torch.where(valid, p, torch.zeros_like(p))
    plogp = torch.where(p > 0, p * torch.log(p.clamp(min=1e-300)), torch.zeros_like(p))
    shannon = -plogp.sum(dim=1)
    if convention == "mean":
        ent = shannon / kf.clamp(min=1)
    elif convention == "sum":
        ent = shannon
    else:
        lnk = torch.log(kf.clamp(min=1))
        ent = torch.where(count > 1, shannon / lnk.clamp(min=1e-300), torch.zeros_like(shannon))
    ent = torch.where(count > 0, ent, torch.zeros_like(ent))
    return mean, ent, count
