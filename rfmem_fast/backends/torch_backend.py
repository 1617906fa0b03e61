"""Torch backend: every primitive is a whole-batch tensor operation (CPU or CUDA).

* segmented top-k: a float32 scan keeps the best ``k + SCAN_MARGIN`` rows of each
  query, then the exact re-scoring of :mod:`rfmem_fast.backends.exact` (every row whose
  scan score can reach the k-th exact score within the proven error bound of the
  float32 matmul is re-scored exactly; ties by the smaller row). The scan: on the
  CPU, the queries of each user of the batch are scored with one matmul against that
  user's rows (a loop over the distinct users, not over queries); on a GPU the rows of
  each query's segment are gathered into a padded [chunk, L, d] block and scored with
  one batched matmul per chunk of queries, and a batch whose queries all hit one
  segment is one plain matmul. Both are cut into blocks of queries and rows whose
  temporaries fit ``memory_budget`` bytes, with a running top-k merged across the row
  blocks, so a long segment or a huge batch never builds a [b, n] score matrix.
  A float16 / bfloat16 bank is scanned in its half-precision copy (``BankView.Xs``:
  the only copy on a GPU), each block of rows converted to float32 (exactly) just
  before its matmul; the scan keeps ``k + SCAN_MARGINS[dtype]`` candidates and the
  error bound gets the copy's input rounding; the exact re-scoring reads the float32
  rows (on the host when the backend runs on a GPU), so results are the float32
  bank's.
* batched KMeans: :func:`rfmem_fast.kmeans.lloyd`, scikit-learn's greedy k-means++
  seeding (the same random draws) and Lloyd steps for all problems at once.
* alpha-mix: broadcast arithmetic and two normalisations.
"""
from __future__ import annotations

import math

import torch

from ..kmeans import kmeanspp_init, lloyd  # noqa: F401  (kmeanspp_init re-exported)
from . import exact
from .base import DEFAULT_MEMORY_BUDGET, Backend, BankView, check_memory_budget

_EPS = 1e-12


class TorchBackend(Backend):
    """Whole-batch torch implementation of the primitives (see the module docstring).

    Args:
        device: torch device ("cpu", "cuda", ...). Default "cpu".
        memory_budget: bytes for the temporaries of one call (score blocks, gathered
            rows, float64 re-scoring); default 256 MiB (``DEFAULT_MEMORY_BUDGET``).
        topk_strategy: "auto" (per user on the CPU, gather on a GPU), "per_user" or
            "gather" (see the module docstring); results do not depend on it.
        block_bytes: former name of ``memory_budget`` (used when given).

    Raises:
        ValueError: a budget < 1 MiB; an unknown ``topk_strategy``; an unknown device,
            or a CUDA device where torch sees none.
        TypeError: a budget that is not an int.
    """

    name = "torch"
    scans_half = True

    def __init__(
        self,
        device: str | torch.device = "cpu",
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        topk_strategy: str = "auto",
        block_bytes: int | None = None,
    ) -> None:
        if topk_strategy not in ("auto", "per_user", "gather"):
            raise ValueError(f"topk_strategy must be 'auto', 'per_user' or 'gather', got {topk_strategy!r}")
        self.topk_strategy = topk_strategy
        self.memory_budget = check_memory_budget(memory_budget if block_bytes is None else block_bytes)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from e
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but this torch build sees no CUDA device")

    @property
    def block_bytes(self) -> int:
        """Former name of :attr:`memory_budget` (bytes)."""
        return self.memory_budget

    # ---------------------------------------------------------------- top-k
    def segmented_topk(self, view: BankView, Q, qseg, k, sel=None):
        """See :meth:`Backend.segmented_topk`: a float32 scan, then the exact re-scoring.

        With a selection ``sel``, the filtered queries search the compacted view of their
        selected rows (:meth:`Backend.on_selection`).

        The scan keeps ``k + SCAN_MARGIN`` candidates per query; :meth:`finish_topk`
        re-scores exactly every row that can belong to the top-k under the float32
        matmul's error bound (depth d, the input rounding of
        ``torch.get_float32_matmul_precision()``), rescanning the rare query whose
        list cannot prove it holds them all. Temporaries stay within ``memory_budget``.
        """
        if sel is not None:
            return self.on_selection(view, Q, qseg, sel, lambda v, q, s: self.segmented_topk(v, q, s, k))
        Q = Q.to(self.device, torch.float32)
        qseg = qseg.to(self.device)
        cand_s, cand_r = self._scan(view, Q, qseg, k + exact.SCAN_MARGINS[view.scan_dtype])
        return self.finish_topk(view, Q, qseg, k, cand_s, cand_r, *self.scan_terms(view))

    def scan_coef(self, d: int) -> float:
        """Relative error coefficient of this backend's float32 matmul scan of float32 rows
        (any order, depth d, the input rounding of the matmul precision settings on its
        device)."""
        return exact.scan_error_coef(d, exact.U32, exact.matmul_input_unit(self.device))

    def scan_terms(self, view: BankView) -> tuple[float, float]:
        """(coef, row_abs) of this backend's matmul scan of ``view.scan`` (float32 rows,
        or a half-precision copy: :func:`exact.scan_bound_terms`)."""
        d = int(view.X.shape[1])
        return exact.scan_bound_terms(d, view.scan_dtype, d, exact.U32, exact.matmul_input_unit(self.device))

    def finish_topk(self, view: BankView, Q, qseg, k: int, cand_s, cand_r, coef: float, row_abs: float = 0.0):
        """Exact top-k from a scan's candidates (shared by the torch, triton and cuda backends).

        Args:
            view: the bank; Q: float32 [b, d]; qseg: int64 [b] (on this device).
            k: top-k width.
            cand_s, cand_r: float32 / int64 [b, w] the scan's candidates (w > k).
            coef: the scan's relative error coefficient (:func:`exact.scan_error_coef`).
            row_abs: the scan's absolute input-rounding term (half-precision copies;
                :func:`exact.scan_bound_terms`).

        Returns:
            (scores float32 [b, k], rows int64 [b, k]) exact (see :mod:`exact`).
        """
        Q = Q.to(self.device, torch.float32)
        qseg = qseg.to(self.device)
        X, off = view.X, view.offsets
        bound = exact.query_bounds(Q, coef, view.row_norm_max, row_abs)
        seg_len = off[qseg + 1] - off[qseg]
        cand_s, cand_r = cand_s.to(self.device), cand_r.to(self.device)
        s, r, need, lower = exact.refine(X, Q, k, cand_s, cand_r, bound, self.memory_budget, seg_len)
        # a zero query (e.g. a beam slot without a branch in the recollection driver)
        # scores exactly 0 against every row: its exact top-k is the segment's first k
        # rows (ties by the smaller row), known without the rescan a full tie would need
        # (tensor selects, no host read: the one below, for the rescan, stays the only sync)
        zero = ~(Q != 0).any(dim=1)
        ar = torch.arange(k, device=self.device)[None, :]
        inside = ar < seg_len[:, None]
        r = torch.where(zero[:, None], torch.where(inside, off[qseg][:, None] + ar, -1), r)
        s = torch.where(zero[:, None], torch.where(inside, 0.0, -math.inf), s)
        need = need & ~zero
        if bool(need.any()):
            idx = need.nonzero().squeeze(1)
            s2, r2 = self.rescan_topk(view, Q[idx], qseg[idx], k, lower[idx])
            s[idx], r[idx] = s2, r2
        return s, r

    def _blocks(self, c: int, L: int, per_elem: int) -> tuple[int, int]:
        """(queries, rows) per block so that ``queries * rows * per_elem`` bytes fit the budget."""
        budget = self.memory_budget
        qc = max(1, min(c, budget // max(1, per_elem * min(L, 1 << 16))))
        rc = max(1, min(L, budget // max(1, per_elem * qc)))
        return qc, rc

    def _users(self, qseg: torch.Tensor):
        """(user, query indices) for each distinct segment of the batch, in segment order."""
        order = torch.argsort(qseg, stable=True)
        users, counts = torch.unique_consecutive(qseg[order], return_counts=True)
        pos = 0
        for u, c in zip(users.tolist(), counts.tolist()):
            yield u, order[pos : pos + c]
            pos += c

    def _scan(self, view: BankView, Q, qseg, kw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The best ``kw`` rows of each query by float32 score (any tie order): float32 /
        int64 [b, kw], ``-inf`` / -1 padding."""
        X, off = view.scan, view.offsets
        b, d = Q.shape
        cand_s = torch.full((b, kw), -math.inf, dtype=torch.float32, device=self.device)
        cand_r = torch.full((b, kw), -1, dtype=torch.int64, device=self.device)
        if not (b and X.shape[0]):
            return cand_s, cand_r
        start = off[qseg]
        lens = off[qseg + 1] - start
        L = int(lens.max())
        if L == 0:
            return cand_s, cand_r
        per_user = self.topk_strategy == "per_user" or (
            self.topk_strategy == "auto" and (self.device.type == "cpu" or bool((qseg == qseg[0]).all()))
        )
        # gathered rows (+ their float32 conversion for a half-precision copy) and scores
        per_query = L * (d + 4) * 4 if X.dtype == torch.float32 else L * (d * (X.element_size() + 4) + 16)
        if not per_user and per_query > self.memory_budget // 2:
            per_user = True  # one query's gathered block would not fit: score it in row blocks
        if per_user:
            for u, idx in self._users(qseg):
                a, e = int(off[u]), int(off[u + 1])
                if e > a:
                    s, r = self._scan_user(X, Q[idx], a, e, kw)
                    cand_s[idx, : s.shape[1]] = s
                    cand_r[idx, : r.shape[1]] = r
            return cand_s, cand_r
        chunk = max(1, (self.memory_budget // 2) // per_query)
        ar = torch.arange(L, device=self.device)
        for c0 in range(0, b, chunk):
            c1 = min(b, c0 + chunk)
            st, ln = start[c0:c1], lens[c0:c1]
            mask = ar[None, :] < ln[:, None]
            idx = torch.where(mask, st[:, None] + ar[None, :], torch.zeros_like(mask, dtype=torch.int64))
            s = torch.bmm(X[idx].to(torch.float32), Q[c0:c1, :, None]).squeeze(2).masked_fill(~mask, -math.inf)
            del idx
            vals, cols = torch.topk(s, min(kw, L), dim=1)
            cand_s[c0:c1, : vals.shape[1]] = vals
            cand_r[c0:c1, : cols.shape[1]] = torch.where(vals > -math.inf, cols + st[:, None], -1)
        return cand_s, cand_r

    def _row_block(self, X, L: int, rc: int) -> int:
        """Rows per block: ``rc``, fewer when the float32 conversion of a half-precision
        block (``rows * d * 4`` bytes) would take more than a quarter of the budget."""
        if X.dtype == torch.float32:
            return rc
        return max(1, min(rc, self.memory_budget // (16 * X.shape[1])))

    def _scan_user(self, X, Qu, a: int, e: int, kw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 top-``kw`` of the queries ``Qu`` [c, d] over rows [a, e) of ``X`` (float32,
        or a half-precision copy converted block by block), in blocks that fit the budget,
        merged with a running top-k. Returns float32 / int64 [c, <= kw]."""
        c, L = Qu.shape[0], e - a
        w = min(kw, L)
        qc, rc = self._blocks(c, L, 4 * 3)  # the score block and topk's temporaries
        rc = self._row_block(X, L, rc)
        if qc >= c and rc >= L:
            vals, cols = torch.topk(Qu @ X[a:e].to(torch.float32).T, w, dim=1)
            return vals, cols + a
        out_s = torch.empty((c, w), dtype=torch.float32, device=self.device)
        out_r = torch.empty((c, w), dtype=torch.int64, device=self.device)
        for q0 in range(0, c, qc):
            Qb = Qu[q0 : q0 + qc]
            best_s = best_r = None
            for r0 in range(a, e, rc):
                r1 = min(e, r0 + rc)
                vals, cols = torch.topk(Qb @ X[r0:r1].to(torch.float32).T, min(w, r1 - r0), dim=1)
                cols = cols + r0
                if best_s is not None:
                    vals, cols = torch.cat([best_s, vals], 1), torch.cat([best_r, cols], 1)
                    vals, pick = torch.topk(vals, w, dim=1)
                    cols = torch.gather(cols, 1, pick)
                best_s, best_r = vals, cols
            out_s[q0 : q0 + qc] = best_s
            out_r[q0 : q0 + qc] = best_r
        return out_s, out_r

    def rescan_topk(self, view: BankView, Q, qseg, k: int, lower) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact top-k of queries whose candidate list could not prove completeness.

        Rescans each query's segment in blocks (float32 matmul of ``view.scan``, this
        backend's bound ``B'``), re-scores exactly every row of scan score ``>= lower -
        B'`` and merges them into a running exact top-k (ties by the smaller row).
        Memory: one block.

        Args:
            view: the bank; Q: float32 [m, d]; qseg: int64 [m].
            k: top-k width; lower: float64 [m], a lower bound of each query's k-th
                exact score (:func:`exact.refine`).

        Returns:
            (scores float32 [m, k], rows int64 [m, k]).
        """
        X, S, off = view.X, view.scan, view.offsets
        m, d = Q.shape
        coef, row_abs = self.scan_terms(view)
        bound = exact.query_bounds(Q, coef, view.row_norm_max, row_abs)
        cut = exact.cut_scores(lower, torch.zeros_like(lower), bound)
        out_s = torch.full((m, k), -math.inf, dtype=torch.float32, device=self.device)
        out_r = torch.full((m, k), -1, dtype=torch.int64, device=self.device)
        for u, idx in self._users(qseg):
            a, e = int(off[u]), int(off[u + 1])
            # block: scores, masks, float64 re-scores and the merge's sort keys
            qc, rc = self._blocks(idx.numel(), e - a, 4 * 12)
            rc = self._row_block(S, e - a, rc)
            for q0 in range(0, idx.numel(), qc):
                sub = idx[q0 : q0 + qc]
                best_s, best_r = out_s[sub], out_r[sub]
                for r0 in range(a, e, rc):
                    r1 = min(e, r0 + rc)
                    sel = (Q[sub] @ S[r0:r1].to(torch.float32).T).to(torch.float64) >= cut[sub, None]
                    qi, ci = sel.nonzero(as_tuple=True)
                    if qi.numel() == 0:
                        continue
                    ex = torch.full(sel.shape, -math.inf, dtype=torch.float32, device=self.device)
                    ex[qi, ci] = exact.exact_pair_scores(X, Q[sub], qi, ci + r0, self.memory_budget // 4)
                    rows = torch.where(sel, torch.arange(r0, r1, device=self.device)[None, :], -1)
                    best_s, best_r = exact.order_by_score_row(
                        torch.cat([best_s, ex], 1), torch.cat([best_r, rows], 1), k
                    )
                out_s[sub], out_r[sub] = best_s, best_r
        return out_s, out_r

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
