"""Reference backend: numpy + scikit-learn, one problem at a time, as the authors' code.

This is the oracle of every other backend. It mirrors the RF-Mem authors' PersonaBench
retriever (RFMEM_SPEC.md sections 1 and 4): exact inner products per query (every row
of the segment scored as ``RN32(q . x)``, the real inner product rounded once to
float32, :func:`rfmem_fast.backends.exact.exact_pair_scores`), stable ordering (ties by
the smaller row), scikit-learn ``KMeans(n_clusters, random_state=seed)``
with k-means++ init and ``n_init="auto"`` on float32 points, cluster means and the mix
``normalise(alpha q + (1 - alpha) normalise(mean) + q0)`` in float32 numpy with
``v / (||v|| + 1e-12)``. Loops over queries and problems are intended here: clarity
beats speed in an oracle.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from .base import DEFAULT_MEMORY_BUDGET, Backend, BankView, check_memory_budget
from .exact import exact_pair_scores


def _l2norm(v: np.ndarray) -> np.ndarray:
    return v / (np.linalg.norm(v) + 1e-12)


class ReferenceBackend(Backend):
    """numpy + scikit-learn oracle (CPU only). See the module docstring.

    Args:
        memory_budget: bytes for the float64 temporaries of the exact scores of one
            query (its segment is scored in chunks); default 256 MiB.

    Raises:
        TypeError / ValueError: a budget that is not an int >= 1 MiB.
    """

    name = "reference"
    device = torch.device("cpu")

    def __init__(self, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        self.memory_budget = check_memory_budget(memory_budget)

    def segmented_topk(self, view: BankView, Q, qseg, k, sel=None):
        """See :meth:`Backend.segmented_topk`: per query, every row of its segment scored
        exactly, then a stable sort by descending score. With a selection ``sel`` the
        oracle of filtered search: a filtered query scores exactly its selected rows
        (filter, then brute force)."""
        X = torch.from_numpy(view.snapshot.vectors)
        off = view.snapshot.offsets
        Qt = Q.detach().cpu().to(torch.float32)
        seg = qseg.cpu().numpy()
        scores = np.full((Qt.shape[0], k), -np.inf, dtype=np.float32)
        rows = np.full((Qt.shape[0], k), -1, dtype=np.int64)
        for i in range(Qt.shape[0]):
            a, b = int(off[seg[i]]), int(off[seg[i] + 1])
            p = -1 if sel is None else int(sel.qsel[i])
            if p < 0:
                r = torch.arange(a, b, dtype=torch.int64)
            else:
                r = torch.from_numpy(np.ascontiguousarray(sel.rows[sel.off[p] : sel.off[p + 1]]))
            s = exact_pair_scores(X, Qt[i : i + 1], torch.zeros_like(r), r, self.memory_budget).numpy()
            order = np.argsort(-s, kind="stable")[:k]
            scores[i, : order.size] = s[order]
            rows[i, : order.size] = r.numpy()[order]
        return torch.from_numpy(scores), torch.from_numpy(rows)

    def probe(self, view, Q, qseg, k, probe_k, temperature, convention, sel=None):
        """See :meth:`Backend.probe`: the signals in float32 numpy, as the authors' code.

        The authors compute ``p = softmax(lam * s)`` in float32 and
        ``H = -mean(p ln p)``; "sum" and "normalized" rescale that Shannon sum.
        """
        scores, rows = self.segmented_topk(view, Q, qseg, k, sel)
        s_all = scores[:, :probe_k].numpy()
        b = s_all.shape[0]
        mean = np.zeros(b, dtype=np.float64)
        ent = np.zeros(b, dtype=np.float64)
        count = np.isfinite(s_all).sum(axis=1).astype(np.int64)
        for i in range(b):
            s = s_all[i, : count[i]]
            if s.size == 0:
                continue
            mean[i] = float(np.mean(s))
            z = np.float32(temperature) * s
            p = np.exp(z - z.max()).astype(np.float32)
            p = p / p.sum()
            with np.errstate(divide="ignore", invalid="ignore"):
                plogp = np.where(p > 0, p * np.log(p), np.float32(0.0))
            shannon = float(-plogp.sum())
            if convention == "mean":
                ent[i] = float(-plogp.mean())
            elif convention == "sum":
                ent[i] = shannon
            else:
                ent[i] = shannon / np.log(s.size) if s.size > 1 else 0.0
        return (
            scores,
            rows,
            torch.from_numpy(mean),
            torch.from_numpy(ent),
            torch.from_numpy(count),
        )

    def batched_kmeans(self, V, counts, clusters, iters, tol, seed):
        """See :meth:`Backend.batched_kmeans`: scikit-learn KMeans per problem.

        Every problem gets ``KMeans(n_clusters, random_state=seed)``, as the authors' code.
        """
        from sklearn.cluster import KMeans
        from sklearn.exceptions import ConvergenceWarning

        Vn = V.detach().cpu().numpy().astype(np.float32, copy=False)
        cnt = counts.cpu().numpy()
        kc = clusters.cpu().numpy()
        m, n, d = Vn.shape
        c_max = int(kc.max()) if m else 0
        labels = np.full((m, n), -1, dtype=np.int64)
        cents = np.zeros((m, c_max, d), dtype=np.float32)
        for i in range(m):
            pts = Vn[i, : cnt[i]]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                km = KMeans(
                    n_clusters=int(kc[i]), random_state=int(seed), max_iter=int(iters), tol=float(tol)
                )
                lab = km.fit_predict(pts)
            labels[i, : cnt[i]] = lab
            for c in range(int(kc[i])):
                members = pts[lab == c]
                if members.shape[0]:
                    cents[i, c] = members.mean(axis=0)
        return torch.from_numpy(labels), torch.from_numpy(cents)

    def alpha_mix(self, qb, centroids, q0, alpha):
        """See :meth:`Backend.alpha_mix`: float32 numpy per (branch, cluster), as the authors."""
        qn = qb.detach().cpu().numpy().astype(np.float32, copy=False)
        cn = centroids.detach().cpu().numpy().astype(np.float32, copy=False)
        q0n = q0.detach().cpu().numpy().astype(np.float32, copy=False)
        out = np.zeros_like(cn)
        for i in range(cn.shape[0]):
            for c in range(cn.shape[1]):
                cen = _l2norm(cn[i, c])
                out[i, c] = _l2norm(alpha * qn[i] + (1.0 - alpha) * cen + q0n[i])
        return torch.from_numpy(out)
