"""Native backend: the primitives as C++17 CPU kernels (``rfmem_fast._native``, csrc/cpu).

* segmented top-k: one float32 pass over each query's own segment, on one of two paths
  chosen per segment by a cost rule (``_native.gemm_pays``): the scan path, where the
  queries of one user share each tile of its rows (up to 16 queries per tile, 4 rows
  per step), or the GEMM path for many queries of one long segment (a shared bank, a
  few large users): register-blocked matrix products (AVX-512 / AVX2+FMA micro-kernels
  picked at run time, a baseline one elsewhere) over tiles of rows, each score compared
  at once with its query's heap threshold, never a [b, n] matrix; both keep a bounded
  heap per query touched only when a score beats the current worst kept one;
  then the exact re-scoring of :mod:`rfmem_fast.backends.exact` (every kept row whose
  float32 score can reach the k-th exact score within the kernel's proven error bound
  is re-scored exactly; the segment is rescanned when the kept list cannot prove it
  holds them all), so all backends give the same scores and ids; ties by the smaller
  row; no [b, n] score matrix, no temporaries beyond O(b k) (the memory budget is
  never approached). :meth:`probe` fuses the familiarity signals (float64, the three
  conventions of :func:`rfmem_fast.signals.familiarity_signals`). A float16 / bfloat16
  bank is scanned in its half-precision copy (F16C conversion / a 16-bit shift to
  float32, float32 accumulation), the float32 rows being read only to re-score the
  candidates exactly (:mod:`rfmem_fast.precision`).
* batched KMeans: :func:`rfmem_fast.kmeans.lloyd` (scikit-learn's greedy k-means++ with
  the same random draws, then Lloyd with scikit-learn's stopping rules), one problem
  per work item of the kernel's threads, float64 arithmetic; labels equal the torch backend's on inputs
  without exact near-ties.
* alpha-mix: per (branch, cluster) in float64, rounded to float32.

Tensors cross into C++ without a copy (``tensor.numpy()`` of contiguous CPU
tensors); the kernels release the GIL and use at most ``num_threads`` threads
(default: :func:`rfmem_fast.threads.get_num_threads` at call time), fewer when a call's
work is too small to pay for them; the threads live for one call (no spinning pool).
"""
from __future__ import annotations

import numpy as np
import torch

from .. import _native
from ..kmeans import draw_table
from ..threads import get_num_threads
from .base import DEFAULT_MEMORY_BUDGET, Backend, BankView, check_memory_budget

#: the values of ``NativeBackend(topk_path=...)``
TOPK_PATHS = ("auto", "scan", "gemm")


def _np(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A C-contiguous CPU numpy view of ``t`` as ``dtype`` (copies only when needed)."""
    return t.detach().to("cpu", dtype).contiguous().numpy()


class NativeBackend(Backend):
    """C++ (per-call std::threads) CPU implementation of the primitives (see the module docstring).

    Args:
        num_threads: most threads per call; ``None`` (default) follows
            :func:`rfmem_fast.threads.get_num_threads` at each call. A call uses fewer
            when its work is small (a single query runs on the calling thread).
        memory_budget: bytes for temporaries (default 256 MiB); the kernels never
            come near it (O(b k) besides the outputs), it is kept for the beam driver.
        topk_path: "auto" (default: the cost rule per segment), "scan" or "gemm"
            (forced, for tests and benchmarks); results never depend on it.

    Raises:
        ValueError: ``num_threads`` < 1; a budget < 1 MiB; an unknown ``topk_path``.
        TypeError: a budget that is not an int.
    """

    name = "native"
    device = torch.device("cpu")
    scans_half = True

    def __init__(
        self, num_threads: int | None = None, memory_budget: int = DEFAULT_MEMORY_BUDGET, topk_path: str = "auto"
    ) -> None:
        if num_threads is not None and (isinstance(num_threads, bool) or int(num_threads) < 1):
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads!r}")
        if topk_path not in TOPK_PATHS:
            raise ValueError(f"topk_path must be one of {TOPK_PATHS}, got {topk_path!r}")
        self.num_threads = None if num_threads is None else int(num_threads)
        self.memory_budget = check_memory_budget(memory_budget)
        self.topk_path = topk_path

    def _threads(self) -> int:
        return self.num_threads if self.num_threads is not None else get_num_threads()

    @staticmethod
    def _bank(view: BankView) -> tuple[np.ndarray, np.ndarray]:
        return _np(view.X, torch.float32), _np(view.offsets_cpu, torch.int64)

    def _scan_args(self, view: BankView) -> dict:
        """The kernel's scan options: the half-precision copy (uint16 bits) when the view has one."""
        snap = view.snapshot
        if view.Xs is None or snap.scan is None:
            return {"path": self.topk_path}
        return {"scan": snap.scan.view(np.uint16), "scan_type": snap.dtype, "path": self.topk_path}

    # ---------------------------------------------------------------- top-k
    def segmented_topk(self, view: BankView, Q, qseg, k):
        """See :meth:`Backend.segmented_topk` (C++ kernel ``_native.segmented_topk``).

        Raises:
            ValueError: ``k`` < 1, or a segment index out of range.
        """
        X, off = self._bank(view)
        s, r = _native.segmented_topk(
            X, off, _np(Q, torch.float32), _np(qseg, torch.int64), int(k), self._threads(), view.row_norm_max,
            **self._scan_args(view),
        )
        return torch.from_numpy(s), torch.from_numpy(r)

    def probe(self, view, Q, qseg, k, probe_k, temperature, convention):
        """See :meth:`Backend.probe`: top-k and signals in one native call (``_native.probe``).

        Raises:
            ValueError: unknown convention, ``k`` or ``probe_k`` < 1.
        """
        X, off = self._bank(view)
        s, r, mean, ent, cnt = _native.probe(
            X,
            off,
            _np(Q, torch.float32),
            _np(qseg, torch.int64),
            int(k),
            int(probe_k),
            float(temperature),
            str(convention),
            self._threads(),
            view.row_norm_max,
            **self._scan_args(view),
        )
        return (
            torch.from_numpy(s),
            torch.from_numpy(r),
            torch.from_numpy(mean),
            torch.from_numpy(ent),
            torch.from_numpy(cnt),
        )

    # ---------------------------------------------------------------- KMeans
    def batched_kmeans(self, V, counts, clusters, iters, tol, seed):
        """See :meth:`Backend.batched_kmeans` (C++ kernel ``_native.batched_kmeans``).

        The uniforms of scikit-learn's seeding (``RandomState(seed)``, one sequence per
        cluster count) are drawn here and passed to the kernel as a table.

        Raises:
            ValueError: counts / clusters out of range (from the kernel).
        """
        Vn = _np(V, torch.float32)
        cn = _np(counts, torch.int64)
        kn = _np(clusters, torch.int64)
        if Vn.shape[0] and int(kn.min()) >= 1:
            draws = draw_table(torch.from_numpy(kn), int(seed)).numpy()
        else:  # empty batch or an invalid cluster count: let the kernel report it
            draws = np.zeros((Vn.shape[0], 1), dtype=np.float64)
        labels, cents = _native.batched_kmeans(
            Vn, cn, kn, int(iters), float(tol), draws, self._threads()
        )
        return torch.from_numpy(labels), torch.from_numpy(cents)

    # ---------------------------------------------------------------- mixing
    def alpha_mix(self, qb, centroids, q0, alpha):
        """See :meth:`Backend.alpha_mix` (C++ kernel ``_native.alpha_mix``)."""
        out = _native.alpha_mix(
            _np(qb, torch.float32),
            _np(centroids, torch.float32),
            _np(q0, torch.float32),
            float(alpha),
            self._threads(),
        )
        return torch.from_numpy(out)
