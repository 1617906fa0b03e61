"""Torch backend: every primitive is a whole-batch tensor operation (CPU or CUDA).

* segmented top-k: on the CPU, the queries of each user of the batch are scored with
  one matmul against that user's rows (a loop over the distinct users, not over
  queries); on a GPU the rows of each query's segment are gathered into a padded
  [chunk, L, d] block and scored with one batched matmul per chunk of queries (the
  chunk is sized so that a block stays under ``block_bytes``), and a batch whose
  queries all hit one segment is one plain matmul. Ties are broken by the smaller row exactly:
  rows whose k-th score is tied past the cut are redone with a stable full sort.
* batched KMeans: :func:`rfmem_fast.kmeans.lloyd`, scikit-learn's greedy k-means++
  seeding (the same random draws) and Lloyd steps for all problems at once.
* alpha-mix: broadcast arithmetic and two normalisations.
"""
from __future__ import annotations

import torch

from ..kmeans import kmeanspp_init, lloyd  # noqa: F401  (kmeanspp_init re-exported)
from .base import Backend, BankView

_EPS = 1e-12
#: extra candidates selected by the float32 scan before the exact re-scoring
RESCORE_MARGIN = 8


def _stable_topk(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row of ``s`` [b, L] with ties by the smaller column (exact).

    Returns (values [b, k'], columns [b, k']) with k' = min(k, L).
    """
    L = s.shape[1]
    kk = min(k, L)
    if kk == 0:
        return s[:, :0], torch.zeros((s.shape[0], 0), dtype=torch.int64, device=s.device)
    if kk == L:
        vals, cols = torch.sort(s, dim=1, descending=True, stable=True)
        return vals, cols
    vals, cols = torch.topk(s, kk, dim=1, largest=True, sorted=True)
    # order ties inside the selection by column: sort by column, then stable by value
    cols, perm = torch.sort(cols, dim=1)
    vals = torch.gather(vals, 1, perm)
    vals, perm = torch.sort(vals, dim=1, descending=True, stable=True)
    cols = torch.gather(cols, 1, perm)
    # a tie that straddles the cut: the selection may hold a larger column than one left out
    kth = vals[:, -1:]
    n_ge = (s >= kth).sum(dim=1)
    bad = (n_ge > kk) & torch.isfinite(kth[:, 0])
    if bool(bad.any()):
        idx = bad.nonzero().squeeze(1)
        v2, c2 = torch.sort(s[idx], dim=1, descending=True, stable=True)
        vals[idx] = v2[:, :kk]
        cols[idx] = c2[:, :kk]
    return vals, cols


class TorchBackend(Backend):
    """Whole-batch torch implementation of the primitives (see the module docstring).

    Args:
        device: torch device ("cpu", "cuda", ...). Default "cpu".
        block_bytes: memory budget of one gathered [chunk, L, d] block (bytes).
        topk_strategy: "auto" (per user on the CPU, gather on a GPU), "per_user" or
            "gather" (see the module docstring); results do not depend on it.

    Raises:
        ValueError: ``block_bytes`` < 1 MiB; an unknown ``topk_strategy``; an unknown device, or a CUDA device where
            torch sees none.
    """

    name = "torch"

    def __init__(
        self, device: str | torch.device = "cpu", block_bytes: int = 256 << 20, topk_strategy: str = "auto"
    ) -> None:
        if topk_strategy not in ("auto", "per_user", "gather"):
            raise ValueError(f"topk_strategy must be 'auto', 'per_user' or 'gather', got {topk_strategy!r}")
        self.topk_strategy = topk_strategy
        if block_bytes < (1 << 20):
            raise ValueError(f"block_bytes must be >= 1 MiB, got {block_bytes}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from e
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but this torch build sees no CUDA device")
        self.block_bytes = int(block_bytes)

    # ---------------------------------------------------------------- top-k
    def segmented_topk(self, view: BankView, Q, qseg, k):
        """See :meth:`Backend.segmented_topk`.

        A float32 (b)mm selects the top ``k + RESCORE_MARGIN`` rows of each query; their
        scores are then recomputed in float64 (rounded to float32) and the top-k taken
        from those. The float32 matmul's rounding depends on the kernel the batch shape
        picks; the re-scored values do not, so a query gets the same scores whichever
        queries share its batch.
        """
        X, off = view.X, view.offsets
        b, d = Q.shape
        Q = Q.to(self.device, torch.float32)
        qseg = qseg.to(self.device)
        kw = k + RESCORE_MARGIN
        rows = torch.full((b, kw), -1, dtype=torch.int64, device=self.device)
        if b and X.shape[0]:
            start = off[qseg]
            lens = off[qseg + 1] - start
            L = int(lens.max())
            per_user = self.topk_strategy == "per_user" or (
                self.topk_strategy == "auto" and (self.device.type == "cpu" or bool((qseg == qseg[0]).all()))
            )
            if L and per_user:
                # the queries of each user in one matmul against that user's rows
                # (on the CPU this beats gathering a copy of the bank per query)
                order = torch.argsort(qseg, stable=True)
                users, counts = torch.unique_consecutive(qseg[order], return_counts=True)
                pos = 0
                for u, c in zip(users.tolist(), counts.tolist()):
                    idx = order[pos : pos + c]
                    pos += c
                    a, e = int(off[u]), int(off[u + 1])
                    if e > a:
                        _, cols = _stable_topk(Q[idx] @ X[a:e].T, kw)
                        rows[idx, : cols.shape[1]] = cols + a
            elif L:
                chunk = max(1, self.block_bytes // max(1, L * d * 4))
                ar = torch.arange(L, device=self.device)
                for c0 in range(0, b, chunk):
                    c1 = min(b, c0 + chunk)
                    st, ln = start[c0:c1], lens[c0:c1]
                    mask = ar[None, :] < ln[:, None]
                    idx = torch.where(mask, st[:, None] + ar[None, :], torch.zeros_like(mask, dtype=torch.int64))
                    s = torch.bmm(X[idx], Q[c0:c1, :, None]).squeeze(2).masked_fill(~mask, float("-inf"))
                    vals, cols = _stable_topk(s, kw)
                    rows[c0:c1, : cols.shape[1]] = torch.where(torch.isfinite(vals), cols + st[:, None], -1)
        # exact re-scoring of the candidates, then ties by the smaller row
        ok = rows >= 0
        exact = (X[rows.clamp(min=0)].double() * Q.double()[:, None, :]).sum(dim=2).float() if X.shape[0] else rows.float()
        exact = exact.masked_fill(~ok, float("-inf"))
        key_rows = torch.where(ok, rows, torch.iinfo(torch.int64).max)
        key_rows, perm = torch.sort(key_rows, dim=1)
        exact = torch.gather(exact, 1, perm)
        exact, perm = torch.sort(exact, dim=1, descending=True, stable=True)
        rows = torch.gather(torch.where(key_rows == torch.iinfo(torch.int64).max, -1, key_rows), 1, perm)
        return exact[:, :k].contiguous(), rows[:, :k].contiguous()

    # ---------------------------------------------------------------- KMeans
    def batched_kmeans(self, V, counts, clusters, iters, tol, seed):
        """See :meth:`Backend.batched_kmeans`: scikit-learn's seeding and Lloyd steps, batched."""
        return lloyd(V.to(self.device, torch.float32), counts.to(self.device), clusters.to(self.device), iters, tol, seed)

    # ---------------------------------------------------------------- mixing
    def alpha_mix(self, qb, centroids, q0, alpha):
        """See :meth:`Backend.alpha_mix` (computed in float64, returned as float32)."""
        c64 = centroids.double()
        cen = c64 / (c64.norm(dim=2, keepdim=True) + _EPS)
        q = alpha * qb.double()[:, None, :] + (1.0 - alpha) * cen + q0.double()[:, None, :]
        return (q / (q.norm(dim=2, keepdim=True) + _EPS)).float()
