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
  float32, float32 accumulation), an int8 bank in its int8 copy (each query quantised
  to int16, exact int32 dot products, a proven bound per query and row), the float32
  rows being read only to re-score the candidates exactly (:mod:`rfmem_fast.precision`).
  The hybrid probe and the fused top-k of the lexical channel, and the C++ beam driver
  on a compacted selection (:data:`COMPACT_MIN_QUERIES`), scan the float32 rows.
* batched KMeans: :func:`rfmem_fast.kmeans.lloyd` (scikit-learn's greedy k-means++ with
  the same random draws, then Lloyd with scikit-learn's stopping rules), one problem
  per work item of the kernel's threads, float64 arithmetic; labels equal the torch backend's on inputs
  without exact near-ties.
* alpha-mix: per (branch, cluster) in float64, rounded to float32.
* MMR similarity (:meth:`NativeBackend.max_similarity`): float64 inner products of each
  candidate set, in the fixed order of csrc/cpu/recollect.cpp.
* beam driver (:meth:`NativeBackend.recollect`): the whole Recollection path in ONE C++
  call for the batch (``_native.recollect``, csrc/cpu/recollect.cpp): each query runs
  all its rounds on one thread, back to back, while its user's rows are in cache (the
  queries of one user in lockstep groups sharing each round's top-k call), with the
  three primitives above; same rows, scores and rounds as the Python driver
  :func:`rfmem_fast.recollection.recollect`, which stays the portable path and the
  oracle. ``NativeBackend(beam_driver="python")`` or the environment variable
  ``RFMEM_BEAM_DRIVER=python`` (read at each call) makes the search run the Python
  driver instead (:meth:`NativeBackend.fused_driver`). On long segments the C++ driver's
  rounds skip the rows that provably cannot reach a branch's top-k, using the probe's scan
  scores of the original query (:meth:`probe` keeps them; results are those of full
  scans), filtered or not, and it returns its hits' exact dense scores.

Filtered search (:class:`rfmem_fast.filters.RowSelection`, ``sel=`` of the three top-k
calls): the selections go to the kernels as arrays (``RowSelection.native_table``). A
selection holding at most a quarter of its segment (:data:`rfmem_fast.filters.LIST_MAX_FRACTION`)
is a row list: its queries score exactly the listed rows, so a selective filter reads
fewer rows than an unfiltered search; a larger one also carries a mask, checked where a
score would enter a query's kept list, which the kernel uses when the selection's
queries take the GEMM path (many queries of one long segment: the GEMM scan with the
mask costs what an unfiltered one does) and otherwise scores the list all the same (a
listed row costs what a scanned one does, and there are fewer). The C++ beam driver gives
every round's top-k call the selection of each branch's query (csrc/cpu/topk.cpp,
recollect.cpp), or, for a batch of at least :data:`COMPACT_MIN_QUERIES` filtered queries
to recollect, runs them on a compacted copy of their selections' rows (the rounds
re-read them; contiguous, they stay in cache); the results are the same.

Tensors cross into C++ without a copy (``tensor.numpy()`` of contiguous CPU
tensors); the kernels release the GIL and use at most ``num_threads`` threads
(default: :func:`rfmem_fast.threads.get_num_threads` at call time; the recollect that
follows a probe of the same queries runs with the count the probe read), fewer when a call's
work is too small to pay for them, when another call of the process holds the thread
pool or when no core is idle (docs/internals/threads.md); the pool's helpers sleep
between calls (nothing spins).
"""
from __future__ import annotations

import os
import threading
from functools import lru_cache

import numpy as np
import torch

from .. import _native
from ..kmeans import draw_table
from ..device import host_array as _np
from ..threads import get_num_threads
from .base import (
    DEFAULT_MEMORY_BUDGET,
    Backend,
    BankView,
    RecollectionOutput,
    SegmentScores,
    all_row_hits,
    check_memory_budget,
    recollection_capacity,
    scan_bound_terms,
    segment_ptr,
)


def native_scan_depth(d: int) -> int:
    """Roundings a product term goes through in the native scan path (16 SIMD lanes of
    ``ceil(d / 16)`` ordered products, then a 4-level tree: :mod:`rfmem_fast.backends.exact`),
    at least d (the any-order depth), so that the bound also covers every other summation order."""
    return max(int(d), (int(d) + 15) // 16 + 4)

#: the values of ``NativeBackend(topk_path=...)``
TOPK_PATHS = ("auto", "scan", "gemm")
#: beam drivers of the native backend: its C++ driver, or the portable Python one
BEAM_DRIVERS = ("native", "python")
#: environment variable read at each call when ``beam_driver`` was not given
BEAM_DRIVER_ENV = "RFMEM_BEAM_DRIVER"
#: a filtered batch with at least this many filtered queries to recollect runs the C++
#: beam driver on a compacted copy of its selections' rows; a smaller one applies the
#: selections in every round's scan (no copy). Measured (bench/bench_filters.py's
#: workload, AVX-512): 1 query 0.10 ms in the scan vs 0.14 compacted, 16 queries of one
#: user 3.6 vs 3.0 ms, 512 queries of 50 users 129 vs 68 ms; results never depend on it
COMPACT_MIN_QUERIES = 8


#: per thread: the last probe's (Q, qseg, scores tensor, scan scores, written, threads) on a
#: long segment, for the recollect of the same queries that follows it (NativeBackend.probe)
_LAST_PROBE = threading.local()


def _keep_probe(Q, seg, scores, kept, written, threads: int) -> None:
    """Remember a probe's scan scores (None: it kept none) and the thread count it ran
    with, for the recollect of the same queries that follows it on this thread: only for
    these very objects (identity checked by :func:`_probe_ref`)."""
    _LAST_PROBE.value = None if kept is None else (Q, seg, scores, kept, written, threads)


def _probe_ref(q0, seg, level0_scores) -> tuple[dict, int | None]:
    """(``_native.recollect``'s ``ref_scores`` / ``ref_ok``, the probe's thread count) when the
    last probe on this thread was of these very queries, segments and top-k scores
    (:func:`_keep_probe`), else ({}, None). The recollect then runs with the count its
    probe read (``rfmem_fast.threads.get_num_threads`` looks up an environment variable
    and torch's setting: tens of us with the caches cold after the probe's scan)."""
    last = getattr(_LAST_PROBE, "value", None)
    if last is not None and last[0] is q0 and last[1] is seg and last[2] is level0_scores:
        return {"ref_scores": last[3], "ref_ok": last[4]}, last[5]
    return {}, None


#: per config object: the config part of ``_native.recollect``'s arguments (:func:`_driver_params`)
_DRIVER_PARAMS: dict[int, tuple] = {}


def _driver_params(config) -> tuple:
    """``_native.recollect``'s arguments from ``beam_width`` to the slot width: (beam_width,
    fanout, max_rounds, out_k, alpha, mmr_lambda, score_floor, kmeans_iters, kmeans_tol, the
    k-means++ draws, the hit width), computed once per config object (a config is frozen;
    the entry holds the config, so its id cannot be reused while cached)."""
    hit = _DRIVER_PARAMS.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    c = config
    params = (c.beam_width, c.fanout, c.max_rounds, c.out_k, float(c.alpha), float(c.mmr_lambda), float(c.score_floor),
              c.kmeans_iters, float(c.kmeans_tol), _draws_by_clusters(int(c.kmeans_seed), int(c.beam_width)),
              recollection_capacity(c) + 1)  # fmt: skip
    if len(_DRIVER_PARAMS) >= 64:
        _DRIVER_PARAMS.clear()
    _DRIVER_PARAMS[id(config)] = (config, params)
    return params


def _check_driver(value: object, name: str) -> str:
    if value not in BEAM_DRIVERS:
        raise ValueError(f"{name} must be one of {BEAM_DRIVERS}, got {value!r}")
    return str(value)


@lru_cache(maxsize=64)
def _draws_by_clusters(seed: int, beam_width: int) -> np.ndarray:
    """float64 [beam_width + 1, W], row k: scikit-learn's k-means++ draws for k clusters (row 0 unused)."""
    table = draw_table(torch.arange(beam_width + 1), seed).numpy()
    table.setflags(write=False)
    return table


class NativeBackend(Backend):
    """C++ CPU implementation of the primitives (see the module docstring).

    Args:
        num_threads: most threads per call; ``None`` (default) follows
            :func:`rfmem_fast.threads.get_num_threads` at each call. A call uses fewer
            when its work is small (below 0.5 million multiply-adds per thread), when
            another call of the process holds the thread pool, or when no core is idle.
        memory_budget: bytes for temporaries (default 256 MiB); the top-k, KMeans and
            alpha-mix kernels never come near it (O(b k) besides the outputs); the C++
            beam driver uses at most ``memory_budget // workspace`` threads (a thread's
            workspace: about 0.1 MiB per query of its group of up to 16 queries of one
            user for the default config and d = 384; one thread at least, smaller
            groups when one does not fit); the Python driver cuts its batch to fit it.
        beam_driver: "native" (the C++ driver, csrc/cpu/recollect.cpp) or "python"
            (:func:`rfmem_fast.recollection.recollect` over these kernels); ``None``
            (default) reads ``RFMEM_BEAM_DRIVER`` at each call, "native" when unset.
        topk_path: "auto" (default: the cost rule per segment), "scan" or "gemm"
            (forced, for tests and benchmarks; both beam drivers' top-k calls follow
            it); results never depend on it.

    Raises:
        ValueError: ``num_threads`` < 1; a budget < 1 MiB; an unknown ``beam_driver``
            or ``topk_path``.
        TypeError: a budget that is not an int.
    """

    name = "native"
    device = torch.device("cpu")
    scans_half = True
    host_torch_free = True

    def __init__(
        self,
        num_threads: int | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        beam_driver: str | None = None,
        topk_path: str = "auto",
    ) -> None:
        if num_threads is not None and (isinstance(num_threads, bool) or int(num_threads) < 1):
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads!r}")
        if topk_path not in TOPK_PATHS:
            raise ValueError(f"topk_path must be one of {TOPK_PATHS}, got {topk_path!r}")
        self.num_threads = None if num_threads is None else int(num_threads)
        self.memory_budget = check_memory_budget(memory_budget)
        self.beam_driver = None if beam_driver is None else _check_driver(beam_driver, "beam_driver")
        self.topk_path = topk_path

    def _threads(self) -> int:
        return self.num_threads if self.num_threads is not None else get_num_threads()

    def _driver(self) -> str:
        """The beam driver in effect: ``beam_driver``, else ``RFMEM_BEAM_DRIVER``, else "native".

        Raises:
            ValueError: ``RFMEM_BEAM_DRIVER`` holds an unknown name.
        """
        if self.beam_driver is not None:
            return self.beam_driver
        env = os.environ.get(BEAM_DRIVER_ENV, "").strip()
        return _check_driver(env, BEAM_DRIVER_ENV) if env else "native"

    def fused_driver(self) -> bool:
        """See :meth:`Backend.fused_driver`: True unless the driver in effect is "python".

        Raises:
            ValueError: ``RFMEM_BEAM_DRIVER`` holds an unknown name.
        """
        return self._driver() == "native"

    @staticmethod
    def _bank(view: BankView) -> tuple[np.ndarray, np.ndarray]:
        """The view's rows (float32 [n, d]) and offsets (int64 [U + 1]) as numpy arrays (cached on the view)."""
        memo = view._memo
        arrays = memo.get("native_arrays")
        if arrays is None:
            arrays = memo["native_arrays"] = (_np(view.X, torch.float32), _np(view.offsets_cpu, torch.int64))
        return arrays

    def _scan_args(self, view: BankView) -> dict:
        """The kernel's scan options: the half-precision copy (uint16 bits) when the view has
        one, or the snapshot's int8 copy and its per-row data."""
        snap = view.snapshot
        if snap is not None and snap.scan_meta is not None:  # an int8 bank
            return {"scan": snap.scan, "scan_meta": snap.scan_meta, "scan_type": "int8", "path": self.topk_path}
        if view.Xs is None:
            return {"path": self.topk_path}
        if snap is None:  # a compacted selection view (Backend.selection_view): its own scan copy
            bits = np.ascontiguousarray(view.Xs.view(torch.int16).numpy()).view(np.uint16)
            return {"scan": bits, "scan_type": view.scan_dtype, "path": self.topk_path}
        if snap.scan is None:
            return {"path": self.topk_path}
        return {"scan": snap.scan.view(np.uint16), "scan_type": snap.dtype, "path": self.topk_path}

    @staticmethod
    def _sel_args(view: BankView, sel) -> dict:
        """The kernels' selection arguments of ``sel`` (none when it is None)."""
        if sel is None:
            return {}
        _, off = NativeBackend._bank(view)
        q = sel.qsel if sel.qsel.dtype == np.int64 and sel.qsel.flags.c_contiguous else np.ascontiguousarray(sel.qsel, dtype=np.int64)
        return {"qsel": q, **sel.native_table(off)}

    # ---------------------------------------------------------------- top-k
    def segmented_topk(self, view: BankView, Q, qseg, k, sel=None):
        """See :meth:`Backend.segmented_topk` (C++ kernel ``_native.segmented_topk``; a
        selection is applied inside the scan, module docstring).

        Raises:
            ValueError: ``k`` < 1, or a segment index out of range.
        """
        X, off = self._bank(view)
        s, r = _native.segmented_topk(
            X, off, _np(Q, torch.float32), _np(qseg, torch.int64), int(k), self._threads(), view.row_norm_max,
            **self._scan_args(view), **self._sel_args(view, sel),
        )
        return torch.from_numpy(s), torch.from_numpy(r)

    def _probe_call(self, view: BankView, Q: np.ndarray, seg: np.ndarray, k, probe_k, temperature, convention,
                    sel, **hits) -> tuple:  # fmt: skip
        """``_native.probe`` on host arrays (float32 [b, d], int64 [b]), keeping the scan
        scores: its seven outputs (nine with ``hits``: ``hit_ptr`` / ``hit_rows``) and the
        thread count it ran with."""
        X, off = self._bank(view)
        threads = self._threads()
        return _native.probe(
            X, off, Q, seg, int(k), int(probe_k), float(temperature), str(convention), threads,
            view.row_norm_max, keep_scan_scores=True, **self._scan_args(view), **self._sel_args(view, sel), **hits,
        ), threads  # fmt: skip

    def probe(self, view, Q, qseg, k, probe_k, temperature, convention, sel=None):
        """See :meth:`Backend.probe`: top-k and signals in one native call (``_native.probe``).

        On long segments (``_native.PRUNE_MIN_ROWS`` rows or more) the probe also keeps its
        scan scores of every row, which a :meth:`recollect` of the same queries on this
        thread right after (``level0`` = this probe's top-k) uses to prune its rounds
        instead of scanning the queries again (results never depend on it).

        Raises:
            ValueError: unknown convention, ``k`` or ``probe_k`` < 1.
        """
        (s, r, mean, ent, cnt, kept, written), threads = self._probe_call(
            view, _np(Q, torch.float32), _np(qseg, torch.int64), k, probe_k, temperature, convention, sel
        )
        st = torch.from_numpy(s)
        _keep_probe(Q, qseg, st, kept, written, threads)
        return st, torch.from_numpy(r), torch.from_numpy(mean), torch.from_numpy(ent), torch.from_numpy(cnt)

    def probe_host(self, view, Q, seg, k, probe_k, temperature, convention, sel=None):
        """See :meth:`Backend.probe_host`: :meth:`probe` on host arrays, the kernel called
        directly (no tensor on the way; the scan scores kept for :meth:`recollect_host` as
        :meth:`probe` keeps them for :meth:`recollect`).

        Raises:
            ValueError: unknown convention, ``k`` or ``probe_k`` < 1.
        """
        (s, r, mean, ent, cnt, kept, written), threads = self._probe_call(view, Q, seg, k, probe_k, temperature,
                                                                          convention, sel)  # fmt: skip
        _keep_probe(Q, seg, s, kept, written, threads)
        return s, r, mean, ent, cnt

    # ---------------------------------------------------------------- lexical channel
    has_fused_topk = True

    def probe_hits(self, view, Q, seg, k, probe_k, temperature, convention, hptr, hrows, hval=None, kf=0,
                   hscale=None, hden=None):  # fmt: skip
        """See :meth:`Backend.probe_hits`: :meth:`probe_host` (``_native.probe``, the dense
        call's own path: scan or GEMM, the bank's scan copy) recording its lexical hits' keys
        in the same pass (``hit_ptr`` / ``hit_rows``; kernels.h ``TopkOptions::hit_keys``)
        and, with ``kf`` > 0, taking each query's fused top-``kf`` on the scan's threads
        right after its dense list (lexical.h ``FusedTopk``); the scan scores kept for a
        :meth:`recollect_host` of the same arrays, as :meth:`probe_host` keeps them.

        Raises:
            ValueError: malformed hits or boosts, ``kf`` out of [0, k], unknown convention,
                ``k`` or ``probe_k`` < 1 (from the kernel).
        """
        fz = dict(hval=hval, kf=int(kf), hscale=hscale, hden=hden) if kf else {}
        out, threads = self._probe_call(view, Q, seg, k, probe_k, temperature, convention, None, hit_ptr=hptr,
                                        hit_rows=hrows, **fz)  # fmt: skip
        s, r, mean, ent, cnt, kept, written, keys, up = out[:9]
        _keep_probe(Q, seg, s, kept, written, threads)
        return ((s, r, mean, ent, cnt), keys, up) + ((tuple(out[9:]),) if kf else ())

    def bm25_hits(self, users, quser, qterms, qcnt, qptr):
        """See :meth:`Backend.bm25_hits` (C++ kernel ``_native.bm25_hits``, the queries in
        parts of 16 over the kernel's threads).

        Raises:
            TypeError / ValueError: malformed arrays (from the kernel).
        """
        return _native.bm25_hits(users, quser, qterms, qcnt, qptr, self._threads())

    def fused_topk(self, view, Q, qseg, dense_scores, dense_rows, hptr, hrows, hx, hval, kf, hf=None, hup=None):
        """See :meth:`Backend.fused_topk` (C++ kernel ``_native.fused_topk``: the dense list's
        boosts, then the screening and exact re-scoring of the other hits, on the kernel's threads).

        Raises:
            ValueError: malformed arrays (from the kernel).
        """
        X, off = self._bank(view)
        Qh = np.ascontiguousarray(Q, np.float32) if isinstance(Q, np.ndarray) else _np(Q, torch.float32)
        return _native.fused_topk(
            X, off, Qh, np.ascontiguousarray(qseg, np.int64), np.ascontiguousarray(dense_scores, np.float32),
            np.ascontiguousarray(dense_rows, np.int64), hptr, hrows, hx, hval, int(kf), self._threads(),
            view.row_norm_max, hf, hup,
        )

    def hybrid_probe(self, view, Q, qseg, k, probe_k, temperature, convention, hptr, hrows, hx, hval, kf):
        """See :meth:`Backend.hybrid_probe` (C++ kernel ``_native.hybrid_probe``: one float32
        pass over each segment feeding a dense and a fused heap, then both exact finishes).

        Raises:
            ValueError: malformed arrays, unknown convention (from the kernel).
        """
        X, off = self._bank(view)
        s, r, mean, ent, cnt, fr, ff, fd, fl, hf = _native.hybrid_probe(
            X, off, _np(Q, torch.float32), _np(qseg, torch.int64), int(k), int(probe_k), float(temperature),
            str(convention), hptr, hrows, hx, hval, int(kf), self._threads(), view.row_norm_max,
        )
        tensors = tuple(torch.from_numpy(a) for a in (s, r, mean, ent, cnt))
        return tensors + (fr, ff, fd, fl, hf)

    def segment_scores(self, view, Q, seg):
        """See :meth:`Backend.segment_scores`: the float32 rows' scan scores from the C++ scan
        (``_native.hybrid_probe`` with every row as a "hit", which records each hit's scan
        score; no fused list), bound for its summation order (:func:`native_scan_depth`)."""
        seg = np.ascontiguousarray(seg, dtype=np.int64)
        X, off = self._bank(view)
        ptr = segment_ptr(off, seg)
        rows = all_row_hits(ptr)
        zeros = np.zeros(rows.shape[0])
        Qh = _np(Q, torch.float32) if isinstance(Q, torch.Tensor) else np.ascontiguousarray(Q, dtype=np.float32)
        out = _native.hybrid_probe(X, off, Qh, seg, 1, 1, 1.0, "mean", ptr, rows, zeros, zeros, 0, self._threads(),
                                   view.row_norm_max)  # fmt: skip
        return SegmentScores(out[9], ptr, *self.scan_score_bound(view))

    def scan_score_bound(self, view):
        """See :meth:`Backend.scan_score_bound`: the float32 scan of ``_native.hybrid_probe``
        (:func:`native_scan_depth`, no input rounding)."""
        d = int(view.X.shape[1])
        return scan_bound_terms(d, view.row_norm_max, native_scan_depth(d))

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

    # ---------------------------------------------------------------- MMR
    def max_similarity(self, V, counts):
        """See :meth:`Backend.max_similarity` (C++ kernel ``_native.max_similarity``, the
        function the C++ beam driver uses: both drivers get the same MMR scores)."""
        out = _native.max_similarity(_np(V, torch.float32), _np(counts, torch.int64), self._threads())
        return torch.from_numpy(out)

    # ---------------------------------------------------------------- beam driver
    def _compacts(self, sel, active) -> bool:
        """Whether a recollection with selection ``sel`` runs on the compacted view
        (at least :data:`COMPACT_MIN_QUERIES` filtered queries to recollect)."""
        if sel is None or not sel.any():
            return False
        filt = sel.qsel >= 0
        if active is not None:
            filt = filt & (active if isinstance(active, np.ndarray) else _np(active, torch.bool))
        return int(np.count_nonzero(filt)) >= COMPACT_MIN_QUERIES

    def _recollect_call(self, view: BankView, q0: np.ndarray, seg: np.ndarray, config, l0s, l0r, act, sel,
                        ref: dict, threads: int | None = None) -> tuple:  # fmt: skip
        """``_native.recollect`` on host arrays: (rows [b, width], scores, rounds, dense [b, out_k]);
        ``threads``: the count to use (None: :meth:`_threads`)."""
        X, off = self._bank(view)
        return _native.recollect(
            X, off, q0, seg, l0s, l0r, *_driver_params(config), self._threads() if threads is None else threads,
            view.row_norm_max,
            self.memory_budget, act, dense=True, **self._scan_args(view), **self._sel_args(view, sel), **ref,
        )  # fmt: skip

    def recollect(self, view, q0, qseg, config, level0=None, active=None, sel=None):
        """See :meth:`Backend.recollect`: the C++ beam driver (``_native.recollect``).

        One call for the whole batch; rows, scores and rounds equal those of the Python
        driver :func:`rfmem_fast.recollection.recollect` over this backend's kernels,
        which the search runs instead when the driver in effect (``beam_driver`` /
        ``RFMEM_BEAM_DRIVER``) is "python" (:meth:`fused_driver`); this method always
        runs the C++ driver.

        Raises:
            ValueError: ``level0`` narrower than ``beam_width * fanout`` or holding a
                row outside its query's segment; ``active`` not a bool tensor of shape
                [b].
        """
        if self._compacts(sel, active):
            return self._recollect_compacted(view, q0, qseg, config, level0, active, sel)
        b = int(q0.shape[0])
        if active is not None and (
            not isinstance(active, torch.Tensor) or active.dtype != torch.bool or tuple(active.shape) != (b,)
        ):
            raise ValueError(f"active must be a bool tensor of shape [{b}]")
        act = None if active is None else _np(active, torch.bool)
        if act is not None and not np.count_nonzero(act):  # e.g. a familiar query in mode "rfmem": nothing to do
            width = recollection_capacity(config) + 1
            return RecollectionOutput(
                rows=torch.full((b, config.out_k), -1, dtype=torch.int64),
                scores=torch.full((b, config.out_k), float("-inf"), dtype=torch.float32),
                rounds=torch.zeros(b, dtype=torch.int64),
                hit_rows=torch.full((b, width), -1, dtype=torch.int64),
                dense=torch.full((b, config.out_k), float("nan"), dtype=torch.float32),
            )
        l0s = l0r = threads = None
        ref = {}
        if level0 is not None:
            l0s, l0r = _np(level0[0], torch.float32), _np(level0[1], torch.int64)
            ref, threads = _probe_ref(q0, qseg, level0[0])
        _LAST_PROBE.value = None
        rows, scores, rounds, dense = self._recollect_call(view, _np(q0, torch.float32), _np(qseg, torch.int64), config,
                                                           l0s, l0r, act, sel, ref, threads)  # fmt: skip
        return RecollectionOutput(  # (numpy slices: a torch slice costs a dispatch)
            rows=torch.from_numpy(rows[:, : config.out_k]),
            scores=torch.from_numpy(scores[:, : config.out_k]),
            rounds=torch.from_numpy(rounds),
            hit_rows=torch.from_numpy(rows),
            dense=torch.from_numpy(dense),
        )

    def recollect_host(self, view, q0, seg, config, level0, active, sel=None):
        """See :meth:`Backend.recollect_host`: :meth:`recollect` on host arrays, the kernel
        called directly (a filtered batch that runs compacted goes through :meth:`recollect`).

        Raises:
            ValueError: as :meth:`recollect` (``active`` not a bool array of shape [b]).
        """
        if self._compacts(sel, active):
            return super().recollect_host(view, q0, seg, config, level0, active, sel)
        b = q0.shape[0]
        if active is not None and (active.dtype.kind != "b" or active.shape != (b,)):
            raise ValueError(f"active must be a bool array of shape [{b}]")
        ref, threads = _probe_ref(q0, seg, level0[0])
        _LAST_PROBE.value = None
        return self._recollect_call(view, q0, seg, config, level0[0], level0[1], active, sel, ref, threads)

    def _recollect_compacted(self, view, q0, qseg, config, level0, active, sel):
        """The C++ driver for a filtered batch: the filtered queries run on the compacted
        view of their selections (:meth:`Backend.selection_view`: each selection's rows
        gathered once per batch into a contiguous segment, so the rounds, which re-read
        them up to ``beam_width * max_rounds`` times, find them in cache like a small
        user's segment; the same rows and order, hence the same result as recollecting
        with the selection applied in the scan, which ``_native.recollect`` also
        supports), the others on ``view``; rows mapped back."""

        b = int(q0.shape[0])
        qsel_np = np.ascontiguousarray(sel.qsel, dtype=np.int64)
        filt = qsel_np >= 0
        everyone = bool(filt.all())
        sub, back = self.selection_view(view, sel)
        back_np = back.numpy()
        fi = qsel_np if everyone else np.flatnonzero(filt)  # (unused as indices when everyone)
        ui = np.flatnonzero(~filt)
        n = int(view.X.shape[0])

        def part(t: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
            return t if everyone else t[torch.from_numpy(idx)]

        lv_f = lv_u = None
        if level0 is not None:  # the probe's global rows as rows of the compacted view
            s0, r0 = level0[0].to("cpu"), level0[1].to("cpu")
            rf = part(r0, fi).numpy()
            lv_f = (part(s0, fi), torch.from_numpy(sel.local_rows(qsel_np if everyone else qsel_np[fi], rf, n)))
            if not everyone:
                lv_u = (s0[torch.from_numpy(ui)], r0[torch.from_numpy(ui)])
        out_f = self.recollect(sub, part(q0, fi), torch.from_numpy(qsel_np if everyone else qsel_np[fi]), config,
                               lv_f, None if active is None else part(active, fi))  # fmt: skip

        def mapped(t: torch.Tensor) -> torch.Tensor:
            a = t.numpy()
            return torch.from_numpy(np.where(a >= 0, back_np[np.maximum(a, 0)], a))

        rows_f, hits_f = mapped(out_f.rows), mapped(out_f.hit_rows)
        if everyone:  # (the dense scores are those of the same vectors: rows of the compacted copy)
            return RecollectionOutput(rows=rows_f, scores=out_f.scores, rounds=out_f.rounds, hit_rows=hits_f,
                                      dense=out_f.dense)  # fmt: skip
        iu = torch.from_numpy(ui)
        out_u = self.recollect(view, q0[iu], qseg[iu], config, lv_u, None if active is None else active[iu])
        itf = torch.from_numpy(fi)

        def merge(f: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            out = torch.empty((b,) + tuple(f.shape[1:]), dtype=f.dtype)
            out[itf], out[iu] = f, u
            return out

        return RecollectionOutput(rows=merge(rows_f, out_u.rows), scores=merge(out_f.scores, out_u.scores),
                                  rounds=merge(out_f.rounds, out_u.rounds), hit_rows=merge(hits_f, out_u.hit_rows),
                                  dense=None if out_f.dense is None or out_u.dense is None
                                  else merge(out_f.dense, out_u.dense))  # fmt: skip
