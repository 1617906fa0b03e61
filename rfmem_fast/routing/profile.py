"""User profiles: the unit mean of each user's memory vectors (the profile prior, ``RFMemConfig.profile_weight``).

The *profile* of user ``u`` is ``p_u = normalise(mean of u's item vectors)`` (zero for a
user without items), the direction of what that user's memory is mostly about. Two
consumers:

* the **profile prior** (``RFMemConfig.profile_weight = w > 0``): every query ``q`` of
  user ``u`` is searched as ``normalise(q + w * p_u)`` -- a personalised query
  expansion with the user's profile (Rocchio-style feedback from the whole memory
  instead of from retrieved items). An item's score becomes proportional to
  ``<v, q> + w * <v, p_u>``: its similarity to the question plus ``w`` times its
  *typicality* for the user, so among items that match the question about as well,
  those typical of the user's memory come first. ``w = 0`` is the authors' RF-Mem.
* the ``"profile"`` feature of the learned re-ranker (:mod:`rfmem_fast.routing.rerank`).

Profiles are computed once per bank snapshot (memoised on the backend's
:class:`~rfmem_fast.backends.base.BankView`), by segment sums in float64 over blocks of
rows (memory bounded by the block, never a float64 copy of the bank), where the bank
lives. That is one pass over the whole bank (O(n d)) on the first search after each
write: cheap for a read-mostly memory, a cost to watch for a very large bank written
between searches.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["user_profiles", "view_profiles", "fold_profile"]

#: rows summed per step
_BLOCK_ROWS = 1 << 16


def user_profiles(X: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Unit mean vector of every segment (user) of a CSR bank.

    Args:
        X: float [n, d] the bank's rows (any device).
        offsets: int64 [U + 1] CSR offsets (same device or CPU).

    Returns:
        float64 [U, d] on X's device: ``normalise(sum of the segment's rows)`` (the
        mean's direction), zero rows for empty segments.

    Raises:
        ValueError: X not 2-D, or offsets not 1-D non-decreasing from 0 to n.
    """
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D [n, d], got shape {tuple(X.shape)}")
    off = offsets.to(torch.int64).cpu()
    if off.ndim != 1 or off.numel() < 1 or int(off[0]) != 0 or int(off[-1]) != X.shape[0] or bool((off[1:] < off[:-1]).any()):
        raise ValueError("offsets must be 1-D, non-decreasing, from 0 to the number of rows")
    U, d = off.numel() - 1, X.shape[1]
    dev = X.device
    seg = torch.repeat_interleave(torch.arange(U), off[1:] - off[:-1]).to(dev)
    sums = torch.zeros((U, d), dtype=torch.float64, device=dev)
    for a in range(0, X.shape[0], _BLOCK_ROWS):
        sums.index_add_(0, seg[a : a + _BLOCK_ROWS], X[a : a + _BLOCK_ROWS].to(torch.float64))
    norms = torch.linalg.vector_norm(sums, dim=1, keepdim=True)
    return torch.where(norms > 0, sums / norms.clamp(min=1e-300), torch.zeros_like(sums))


def view_profiles(view: Any) -> torch.Tensor:
    """:func:`user_profiles` of a bank view, computed once per view (bank snapshot) and memoised.

    Args:
        view: a :class:`~rfmem_fast.backends.base.BankView`.

    Returns:
        float64 [U, d] on the view's device (do not modify).
    """
    memo = view._memo
    if "profiles" not in memo:
        memo["profiles"] = user_profiles(view.X, view.offsets_cpu)
    return memo["profiles"]


def fold_profile(Q: torch.Tensor, qseg: torch.Tensor, profiles: torch.Tensor, weight: float) -> torch.Tensor:
    """The profile prior: ``normalise(q + weight * p_u)`` for every query (module docstring).

    Computed in float64 and rounded once to float32, on the queries' device.

    Args:
        Q: float32 [b, d] unit queries.
        qseg: int64 [b] segment (user) of each query.
        profiles: float64 [U, d] (:func:`view_profiles`).
        weight: w >= 0 (0 returns ``Q`` unchanged).

    Returns:
        float32 [b, d] unit queries (a query whose sum is zero keeps its own direction).
    """
    if weight == 0.0 or Q.shape[0] == 0:
        return Q
    q64 = Q.to(torch.float64) + float(weight) * profiles.to(Q.device)[qseg.to(Q.device)]
    n = torch.linalg.vector_norm(q64, dim=1, keepdim=True)
    out = torch.where(n > 1e-12, q64 / n.clamp(min=1e-300), Q.to(torch.float64))
    return out.to(torch.float32)


def profiles_numpy(view: Any) -> np.ndarray:
    """:func:`view_profiles` as a host float64 array (memoised too)."""
    memo = view._memo
    if "profiles_np" not in memo:
        memo["profiles_np"] = view_profiles(view).cpu().numpy()
    return memo["profiles_np"]
