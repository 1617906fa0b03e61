"""Batched KMeans for many tiny problems, reproducing scikit-learn's KMeans (spec section 4).

The authors' code clusters each branch's candidates with
``sklearn.cluster.KMeans(n_clusters=k, random_state=42)``: greedy k-means++ seeding
(``2 + int(ln k)`` local trials per centre) and Lloyd iterations, ``n_init=1``. A fresh
``RandomState(seed)`` is made for every call, so every problem consumes the SAME
sequence of random numbers: one draw for the first centre, then ``2 + int(ln k)``
draws per further centre (:func:`sklearn_draws`). This module replays that recipe as
tensor operations over all problems at once (any device), so the fast backends pick
the same initial centres and, up to float rounding, the same clusters as the oracle:

* first centre: ``searchsorted(cumsum(1/n ...), u_0, side="right")``;
* centre t: candidates ``searchsorted(cumsum(D2), u * sum(D2))`` (clipped to n - 1),
  the candidate whose addition gives the smallest potential wins (first on ties);
* Lloyd: assign to the nearest centre (first on ties), centres = member means;
  stop when the labels repeat (strict convergence) or the squared centre shift is
  ``<= tol * mean(var(points))``; without strict convergence the labels are
  recomputed from the final centres (scikit-learn's last E-step).

Differences: an empty cluster keeps its previous centre (scikit-learn relocates it to
a far point); only reachable with duplicate points.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch


def n_local_trials(k: int) -> int:
    """Greedy k-means++ trials per centre, as scikit-learn: ``2 + int(ln k)``."""
    return 2 + int(math.log(k))


@lru_cache(maxsize=256)
def sklearn_draws(seed: int, k: int) -> np.ndarray:
    """float64 [1 + (k - 1) * n_local_trials(k)]: the uniforms a fresh
    ``RandomState(seed)`` gives scikit-learn's k-means++ for ``k`` clusters."""
    return np.random.RandomState(seed).random_sample(1 + (k - 1) * n_local_trials(k))


def draw_table(clusters: torch.Tensor, seed: int) -> torch.Tensor:
    """Each problem's scikit-learn draws, the table every backend's seeding reads.

    Args:
        clusters: int64 [m], cluster count of each problem (>= 1).
        seed: scikit-learn's ``random_state``.

    Returns:
        float64 [m, 1 + (c - 1) * T] on ``clusters.device`` (c = max(clusters), T its
        trial count), row i holding :func:`sklearn_draws` (seed, clusters[i]), 0-padded.
        Built by indexing one small per-k table: no loop over problems.
    """
    c_max = int(clusters.max())
    width = 1 + (c_max - 1) * n_local_trials(c_max)
    per_k = np.zeros((c_max + 1, width), dtype=np.float64)
    for k in range(1, c_max + 1):  # at most beam_width rows
        d = sklearn_draws(int(seed), k)
        per_k[k, : d.shape[0]] = d
    return torch.from_numpy(per_k).to(clusters.device)[clusters]


def _trials_per_problem(clusters: torch.Tensor) -> torch.Tensor:
    """int64 [m]: :func:`n_local_trials` of each problem's cluster count."""
    c_max = int(clusters.max())
    lut = torch.tensor([0] + [n_local_trials(k) for k in range(1, c_max + 1)], device=clusters.device)
    return lut[clusters]


def kmeanspp_init(V: torch.Tensor, counts: torch.Tensor, clusters: torch.Tensor, seed: int) -> torch.Tensor:
    """Greedy k-means++ seeding of many problems, with scikit-learn's draws (see module).

    Args:
        V: float32 [m, n, d]; problem ``i`` uses ``V[i, :counts[i]]``.
        counts: int64 [m], 1 <= counts[i] <= n.
        clusters: int64 [m], 1 <= clusters[i] <= counts[i].
        seed: the ``random_state`` of scikit-learn's KMeans (int >= 0).

    Returns:
        float32 [m, c, d] initial centres, c = max(clusters); centres at index
        >= clusters[i] are zero.
    """
    m, n, d = V.shape
    dev = V.device
    c_max = int(clusters.max()) if m else 0
    C = torch.zeros((m, c_max, d), dtype=torch.float32, device=dev)
    if m == 0 or c_max == 0:
        return C
    U = draw_table(clusters, seed)
    ar_n = torch.arange(n, device=dev)
    pmask = ar_n[None, :] < counts[:, None]
    rows_m = torch.arange(m, device=dev)
    V64 = V.to(torch.float64)
    sq = (V64 * V64).sum(dim=2)

    def d2_to(points: torch.Tensor) -> torch.Tensor:  # [m, t, d] -> [m, t, n] squared distances
        pp = (points * points).sum(dim=2)
        dist = pp[:, :, None] + sq[:, None, :] - 2.0 * torch.bmm(points, V64.transpose(1, 2))
        return dist.clamp(min=0.0).masked_fill(~pmask[:, None, :], 0.0)

    # first centre: RandomState.choice(n, p=uniform) = searchsorted(cdf, u, "right")
    w = pmask.to(torch.float64) / counts[:, None].to(torch.float64)
    cdf = torch.cumsum(w, dim=1)
    cdf = cdf / cdf.gather(1, (counts - 1)[:, None])
    cdf = cdf.masked_fill(~pmask, float("inf"))
    first = torch.searchsorted(cdf, U[:, :1].contiguous(), right=True).squeeze(1).clamp(max=n - 1)
    first = torch.minimum(first, counts - 1)
    C[:, 0] = V[rows_m, first]
    closest = d2_to(V64[rows_m, first][:, None, :]).squeeze(1)  # [m, n]
    pot = closest.sum(dim=1)
    T_max = n_local_trials(c_max)
    trials = _trials_per_problem(clusters)
    ar_t = torch.arange(T_max, device=dev)
    for t in range(1, c_max):
        live = t < clusters  # problems that still need a centre
        T = trials  # per-problem trial count
        col = 1 + (t - 1) * T[:, None] + ar_t[None, :]  # [m, T_max]
        col = torch.where(ar_t[None, :] < T[:, None], col, torch.zeros_like(col)).clamp(max=U.shape[1] - 1)
        rand = U.gather(1, col) * pot[:, None]
        cum = torch.cumsum(closest, dim=1).masked_fill(~pmask, float("inf"))
        cand = torch.searchsorted(cum, rand, right=False)
        cand = torch.minimum(cand, (counts - 1)[:, None])  # np.clip(.., n - 1)
        dc = torch.minimum(closest[:, None, :], d2_to(V64[rows_m[:, None], cand]))  # [m, T, n]
        cpot = dc.sum(dim=2).masked_fill(ar_t[None, :] >= T[:, None], float("inf"))
        best = cpot.argmin(dim=1)  # first minimum, as np.argmin
        pick = cand.gather(1, best[:, None]).squeeze(1)
        C[:, t] = torch.where(live[:, None], V[rows_m, pick], C[:, t])
        closest = torch.where(live[:, None], dc[rows_m, best], closest)
        pot = torch.where(live, cpot.gather(1, best[:, None]).squeeze(1), pot)
    return C


def lloyd(
    V: torch.Tensor, counts: torch.Tensor, clusters: torch.Tensor, iters: int, tol: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many small KMeans problems at once: :func:`kmeanspp_init`, then batched Lloyd.

    Args:
        V: float32 [m, n, d]; problem ``i`` uses ``V[i, :counts[i]]``.
        counts: int64 [m], 1 <= counts[i] <= n.
        clusters: int64 [m], 1 <= clusters[i] <= counts[i].
        iters: Lloyd iteration cap (scikit-learn's ``max_iter``).
        tol: scikit-learn's ``tol`` (relative to the mean variance of the points).
        seed: scikit-learn's ``random_state``.

    Returns:
        (labels int64 [m, n], -1 on padding; centroids float32 [m, c, d], the mean of
        each cluster's members under those labels, zero when empty or unused).
    """
    m, n, d = V.shape
    dev = V.device
    c_max = int(clusters.max()) if m else 0
    if m == 0 or c_max == 0:
        return (
            torch.full((m, n), -1, dtype=torch.int64, device=dev),
            torch.zeros((m, c_max, d), dtype=torch.float32, device=dev),
        )
    ar_c = torch.arange(c_max, device=dev)
    pmask = torch.arange(n, device=dev)[None, :] < counts[:, None]
    cmask = ar_c[None, :] < clusters[:, None]
    V64 = V.to(torch.float64)  # float64 throughout: results independent of the batch's kernels

    def assign(C: torch.Tensor) -> torch.Tensor:
        cc = (C * C).sum(dim=2)
        dist = cc[:, None, :] - 2.0 * torch.bmm(V64, C.transpose(1, 2))
        return dist.masked_fill(~cmask[:, None, :], float("inf")).argmin(dim=2).masked_fill(~pmask, -1)

    def means(labels: torch.Tensor, C_old: torch.Tensor) -> torch.Tensor:
        oh = (labels[:, :, None] == ar_c[None, None, :]).to(torch.float64)
        cnt = oh.sum(dim=1)
        mu = torch.bmm(oh.transpose(1, 2), V64) / cnt.clamp(min=1.0)[:, :, None]
        return torch.where((cnt > 0)[:, :, None], mu, C_old)

    cnt_f = counts.to(torch.float64)[:, None]
    mu = (V64 * pmask[:, :, None]).sum(dim=1) / cnt_f
    var = (((V64 - mu[:, None, :]) ** 2) * pmask[:, :, None]).sum(dim=1) / cnt_f
    tol_m = tol * var.mean(dim=1)

    C = kmeanspp_init(V, counts, clusters, seed).to(torch.float64)
    labels = torch.full((m, n), -1, dtype=torch.int64, device=dev)
    strict = torch.zeros(m, dtype=torch.bool, device=dev)
    done = torch.zeros(m, dtype=torch.bool, device=dev)
    for _ in range(int(iters)):
        new_labels = assign(C)
        C_new = means(new_labels, C)
        same = (new_labels == labels).all(dim=1)
        shift = ((C_new - C) ** 2).sum(dim=(1, 2))
        live = ~done
        labels = torch.where(live[:, None], new_labels, labels)
        C = torch.where(live[:, None, None], C_new, C)
        strict = strict | (live & same)
        done = done | same | (shift <= tol_m)
        if bool(done.all()):
            break
    labels = torch.where(strict[:, None], labels, assign(C))
    return labels, means(labels, torch.zeros_like(C)).to(torch.float32)
