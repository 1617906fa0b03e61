"""The small interface every backend implements (DESIGN.md, "The primitives every backend provides").

The beam driver (:mod:`rfmem_fast.recollection`) and the search API call only these
methods, on torch tensors living on the backend's device. A new backend is one new
file that subclasses :class:`Backend`, plus its parity test against the reference.

Filtered search (:mod:`rfmem_fast.filters`): :meth:`Backend.segmented_topk`,
:meth:`Backend.probe` and :meth:`Backend.recollect` take an optional ``sel``, a
:class:`~rfmem_fast.filters.RowSelection`: a query with a selection takes its top-k
over the selected rows of its segment only. The native backend applies it inside its
C++ scan; the others through :meth:`Backend.on_selection`: the selected rows are
gathered once per batch into a compacted view (:meth:`Backend.selection_view`, one
segment per selection, cached on the selection) that the backend's own unfiltered
kernels search, and the rows are mapped back. Both are exact by construction: the
scores are the same ``RN32(q . x)`` of the same rows, and the row order (hence the
tie order) is kept.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .. import device as _device
from ..bank import BankSnapshot, MemoryBank
from ..config import RFMemConfig
from ..device import BankView, host_array
from ..precision import HALF_DTYPES, scan_tensor
from ..filters import RowSelection
from ..signals import familiarity_signals

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "MIN_MEMORY_BUDGET",
    "Backend",
    "BankSnapshot",
    "BankView",
    "RecollectionOutput",
    "SegmentScores",
    "all_row_hits",
    "check_memory_budget",
    "recollection_capacity",
    "scan_bound_terms",
    "segment_ptr",
]

#: Default memory budget of one backend call's temporaries (bytes): score blocks,
#: gathered rows, float64 re-scoring and the beam driver's per-round tensors are cut
#: into chunks that fit it (README "Memory budget").
DEFAULT_MEMORY_BUDGET = 256 << 20
#: Smallest accepted memory budget (bytes).
MIN_MEMORY_BUDGET = 1 << 20


def check_memory_budget(value: int) -> int:
    """``value`` as an int memory budget in bytes.

    Raises:
        TypeError: not an int.
        ValueError: below :data:`MIN_MEMORY_BUDGET` (1 MiB).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"memory_budget must be an int number of bytes, got {type(value).__name__}")
    if value < MIN_MEMORY_BUDGET:
        raise ValueError(f"memory_budget must be >= {MIN_MEMORY_BUDGET} bytes (1 MiB), got {value}")
    return int(value)


@dataclass
class RecollectionOutput:
    """Result of the Recollection path for b queries: what :func:`rfmem_fast.recollection.recollect`
    (the Python beam driver) and a backend's fused driver (:meth:`Backend.recollect`) return.

    Defined with the backend interface (``rfmem_fast.recollection`` re-exports it), so that a
    backend with a fused driver needs nothing above the backends.

    Attributes:
        rows: int64 [b, out_k] global bank rows in discovery order, -1 padding.
        scores: float32 [b, out_k] the (MMR-adjusted when mmr_lambda < 1) score each
            item was discovered with, -inf padding.
        rounds: int64 [b] rounds that produced a beam (0 when none did).
        hit_rows: int64 [b, m] every row the beam discovered (first occurrences, in
            discovery order, -1 padding; ``rows`` is its first ``out_k`` columns). The
            merges of :mod:`rfmem_fast.routing.merge` read it.
        dense: float32 [b, out_k] the exact dense scores ``RN32(q . x)`` of ``rows``
            (NaN padding) when the driver computed them (the native one), else None.
    """

    rows: torch.Tensor
    scores: torch.Tensor
    rounds: torch.Tensor
    hit_rows: torch.Tensor | None = None
    dense: torch.Tensor | None = None

    def host(self) -> tuple:
        """(rows, scores, rounds, dense or None) as host numpy arrays (``hit_rows`` left out):
        what :meth:`Backend.recollect_host` returns (C-contiguous)."""
        rows, scores, rounds = (host_array(t, t.dtype) for t in (self.rows, self.scores, self.rounds))
        return rows, scores, rounds, None if self.dense is None else host_array(self.dense, self.dense.dtype)


@dataclass(frozen=True)
class SegmentScores:
    """The scan score of every row of each query's segment, query after query
    (:meth:`Backend.segment_scores`; the context score's input, :mod:`rfmem_fast.context`).

    Attributes:
        f: float32 [L] the rows' scan scores: query ``i``'s segment rows ``0 .. n_i - 1``
            at ``f[ptr[i] : ptr[i + 1]]``.
        ptr: int64 [b + 1] CSR offsets (``ptr[i + 1] - ptr[i]`` = query i's segment length).
        scale, abs_term: the scan's bound ``|f - RN32(q . x)| <= B(q) = scale ||q|| (1 + 2^-30)
            + abs_term`` for every row of the query's segment (:mod:`rfmem_fast.backends.exact`;
            ``scale`` includes the rows' largest norm).
    """

    f: np.ndarray
    ptr: np.ndarray
    scale: float
    abs_term: float

    def bounds(self, qnorm: np.ndarray) -> np.ndarray:
        """float64 [b]: ``B(q)`` of queries of norms ``qnorm`` (float64 [b])."""
        return self.scale * (qnorm * (1.0 + 2.0**-30)) + self.abs_term


def segment_ptr(offsets: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """int64 [b + 1]: CSR offsets of the b queries' segments laid one after the other."""
    lens = offsets[seg + 1] - offsets[seg]
    ptr = np.zeros(seg.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    return ptr


def all_row_hits(ptr: np.ndarray) -> np.ndarray:
    """int32 [ptr[-1]]: the local rows ``0 .. n_i - 1`` of every query's segment, one query
    after the other (the "hits" that make ``hybrid_probe`` record every row's scan score;
    read-only: one query's is shared)."""
    if ptr.shape[0] == 2:
        return _arange32(int(ptr[1]))
    lens = np.diff(ptr)
    return (np.arange(int(ptr[-1]), dtype=np.int64) - np.repeat(ptr[:-1], lens)).astype(np.int32)


@lru_cache(maxsize=64)
def _arange32(n: int) -> np.ndarray:
    out = np.arange(n, dtype=np.int32)
    out.setflags(write=False)
    return out


@lru_cache(maxsize=256)
def scan_bound_terms(d: int, xnorm: float, depth: int, input_unit: float = 0.0) -> tuple[float, float]:
    """``(scale, abs_term)`` of :class:`SegmentScores`: the bound of a float32 scan of summation
    depth ``depth`` (any order: ``depth = d``) over float32 rows of dimension d and norm <=
    ``xnorm`` (:func:`rfmem_fast.backends.exact.query_bounds`)."""
    from .exact import abs_error_term, scan_error_coef

    return scan_error_coef(depth, input_unit=input_unit) * xnorm, abs_error_term(d)


def recollection_capacity(config: RFMemConfig) -> int:
    """Result slots one query's recollection can fill: ``out_k - 1 + B (B + R - 1) F``
    (a round adds at most ``B (B + level) F`` items and the loop stops at ``out_k``)."""
    B, F, R = config.beam_width, config.fanout, config.max_rounds
    return config.out_k - 1 + B * (B + R - 1) * F


#: Backend.placement's cache: (name, id(device)) -> (device, its facts)
_PLACEMENTS: dict[tuple[str, int], tuple] = {}


class Backend:
    """Base class of the backends: the four primitives plus a view of the bank.

    Subclasses set ``name`` and ``device`` and implement :meth:`segmented_topk`,
    :meth:`batched_kmeans` and :meth:`alpha_mix`; :meth:`probe` has a default that
    composes :meth:`segmented_topk` with :func:`rfmem_fast.signals.familiarity_signals`
    and may be overridden by a fused kernel; :meth:`max_similarity` (MMR) has a
    batched-product default. A backend may provide a fused beam driver: it overrides
    :meth:`recollect` and says with :meth:`fused_driver` when it is in effect; the search
    (:func:`rfmem_fast.search.search`) makes the choice, running the portable Python driver
    :func:`rfmem_fast.recollection.recollect` over the primitives otherwise.

    ``memory_budget`` (bytes, default :data:`DEFAULT_MEMORY_BUDGET`) bounds the
    temporaries of one primitive call and of the beam driver's rounds; every backend
    takes it as a constructor argument.
    """

    name: str = "base"
    device: torch.device = torch.device("cpu")
    memory_budget: int = DEFAULT_MEMORY_BUDGET
    #: True for a backend whose scans read a half-precision bank's scan copy
    #: (``BankView.Xs``); the others scan the float32 rows of every bank.
    scans_half: bool = False
    #: True for a backend with the lexical channel's kernels :meth:`bm25_hits` and
    #: :meth:`fused_topk` (the native one); :func:`rfmem_fast.search.search` fuses on the
    #: host with numpy for the others. Both give the same rows and scores.
    has_fused_topk: bool = False
    #: True for a backend whose :meth:`probe_host` and :meth:`recollect_host` (its fused
    #: driver) run no torch operation (the native one): the search's host fast path then
    #: leaves torch's intra-op threads alone (:func:`rfmem_fast.threads.limit_torch_threads`)
    host_torch_free: bool = False

    def placement(self) -> tuple[torch.device, bool, tuple]:
        """(``self.device`` as a torch.device, whether it is the CPU, the key of :meth:`view`'s
        cache), computed once per backend name and device object (a search reads them on
        every call; ``search(..., backend="native")`` makes a new backend each time, whose
        device is the class's)."""
        dev = self.device
        key = (self.name, id(dev))
        got = _PLACEMENTS.get(key)
        if got is None or got[0] is not dev:  # (the entry holds the device: its id is not reused while cached)
            d = dev if isinstance(dev, torch.device) else torch.device(dev)
            got = (dev, (d, d.type == "cpu", ("view", self.name, str(d))))
            if len(_PLACEMENTS) >= 64:
                _PLACEMENTS.clear()
            _PLACEMENTS[key] = got
        return got[1]

    def bm25_hits(self, users: list, quser: np.ndarray, qterms: np.ndarray, qcnt: np.ndarray,
                  qptr: np.ndarray) -> tuple:  # fmt: skip
        """The BM25 hits of b queries (backends with ``has_fused_topk``; C++ ``_native.bm25_hits``).

        Args:
            users: list of (terms int32 [T], ptr int64 [T + 1], rows int32 [P], weight
                float64 [P], n_rows) of :class:`rfmem_fast.lexical.UserPostings`.
            quser: int64 [b] index into ``users`` (< 0: the query has no postings).
            qterms / qcnt / qptr: the queries' distinct known token ids (int32), their
                counts (float64) and CSR pointers (int64 [b + 1]).

        Returns:
            (hptr int64 [b + 1], hrows int32 [H] ascending local rows, hval float64 [H] BM25
            > 0, max float64 [b], top float64 [b, 10], sum float64 [b], sumsq float64 [b]).

        Raises:
            NotImplementedError: the backend has no such kernel (``has_fused_topk`` False).
        """
        raise NotImplementedError(f"backend {self.name!r} has no bm25_hits kernel (has_fused_topk is False)")

    def probe_hits(self, view: BankView, Q: np.ndarray, seg: np.ndarray, k: int, probe_k: int,
                   temperature: float, convention: str, hptr: np.ndarray, hrows: np.ndarray,
                   hval: np.ndarray | None = None, kf: int = 0, hscale: np.ndarray | None = None,
                   hden: np.ndarray | None = None) -> tuple:  # fmt: skip
        """:meth:`probe_host` that also records its lexical hits' keys in the same pass
        (backends with ``has_fused_topk``, which run on the host): the dense call's own path
        and scan copy, so that the hybrid probe costs what the dense one does plus the
        hits' lookups; with ``kf`` > 0 also each query's fused top-``kf``, taken right after
        its dense list while its segment is in cache (what :meth:`fused_topk` gives from
        this probe's lists and keys).

        Args:
            view, k, probe_k, temperature, convention: as :meth:`probe`; Q: float32 [b, d]
                C-contiguous unit queries, seg: int64 [b] segment indices (host arrays).
            hptr int64 [b + 1], hrows int32 [H]: each query's hits, ascending local rows of
                its segment (:meth:`bm25_hits`).
            hval: float64 [H] the hits' BM25, with ``kf``.
            hscale, hden: the boosts as per-query factors (float64 [b], ``hden`` [b] or
                None: :class:`rfmem_fast.fusion.BoostFactors`' scale / den), applied to
                ``hval`` by the kernel, bit for bit ``BoostFactors.flat``; with ``kf``.
            kf: width of the fused list (0: none; at most ``k``).

        Returns:
            ((scores, rows, mean, entropy, count) as :meth:`probe_host`, numpy), keys float32 [H], up
            float64 [b]) with ``keys[h] + up[i] >= RN32(q_i . x)`` for every hit x of query
            i (a scan or GEMM score with its path's bound, or an int8 key with 0); ``up[i]``
            = inf where the query's path records none: :meth:`fused_topk`'s ``hf`` / ``hup``.
            With ``kf`` > 0 a fourth item: :meth:`fused_topk`'s (rows, fused, dense, lex)
            [b, kf] of ``dense_scores`` / ``dense_rows`` = the probe's scores / rows.

        Raises:
            NotImplementedError: the backend has no such kernel.
            ValueError: ``kf`` < 0 or > ``k``; ``kf`` > 0 without ``hval`` and ``hscale``;
                boosts that are not finite and >= 0.
        """
        raise NotImplementedError(f"backend {self.name!r} has no probe_hits kernel (has_fused_topk is False)")

    def fused_topk(self, view: BankView, Q: torch.Tensor, qseg: np.ndarray, dense_scores: np.ndarray,
                   dense_rows: np.ndarray, hptr: np.ndarray, hrows: np.ndarray, hx: np.ndarray, hval: np.ndarray,
                   kf: int, hf: np.ndarray | None = None, hup: np.ndarray | None = None) -> tuple:  # fmt: skip
        """The exact fused top-``kf`` of b queries (backends with ``has_fused_topk``).

        Args:
            view: the bank view; Q: float32 [b, d] unit queries; qseg: int64 [b] their segments.
            dense_scores float32 / dense_rows int64 [b, K]: each query's exact dense top-K.
            hptr, hrows, hval: the queries' lexical hits (:meth:`bm25_hits`); hx: float64
                [H] their boosts (>= 0, :data:`rfmem_fast.fusion.BOOSTS`).
            kf: width of the result.
            hf: float32 [H] the hits' scan scores recorded by :meth:`hybrid_probe` (the
                kernel then reads them instead of scoring the hits), or None.
            hup: float64 [b] or None: with ``hf`` the keys of :meth:`probe_hits` and their
                offsets (``hf[h] + hup[i] >= RN32(q_i . x)``; inf: not recorded, the kernel
                scores that query's hits).

        Returns:
            (rows int64 [b, kf], fused float64, dense float32, lex float64): ordered by
            (fused desc, row asc), -1 / -inf / NaN padding (rfmem_fast.fusion's rule).

        Raises:
            NotImplementedError: the backend has no such kernel.
        """
        raise NotImplementedError(f"backend {self.name!r} has no fused_topk kernel (has_fused_topk is False)")

    def hybrid_probe(self, view: BankView, Q: torch.Tensor, qseg: torch.Tensor, k: int, probe_k: int,
                     temperature: float, convention: str, hptr: np.ndarray, hrows: np.ndarray, hx: np.ndarray,
                     hval: np.ndarray, kf: int) -> tuple:  # fmt: skip
        """:meth:`probe` and :meth:`fused_topk` in ONE pass over each query's segment (backends
        with ``has_fused_topk``): the dense top-k and signals of :meth:`probe`, and the exact
        fused top-``kf`` of the boosts ``hx`` of the hits (``hptr``, ``hrows``, ``hval``, as
        :meth:`fused_topk`), without the dense top-K the latter starts from. ``kf = 0``: no
        fused list (boosts that need the dense list, fusion "zscore": :meth:`fused_topk`
        with the recorded scores follows).

        Returns:
            (scores, rows, mean, entropy, count) as :meth:`probe` (torch tensors), then
            (rows, fused, dense, lex) numpy arrays [b, kf] as :meth:`fused_topk`, then hf
            float32 [H]: every hit's float32 scan score.

        Raises:
            NotImplementedError: the backend has no such kernel.
        """
        raise NotImplementedError(f"backend {self.name!r} has no hybrid_probe kernel (has_fused_topk is False)")

    def view(self, bank: MemoryBank) -> BankView:
        """The bank as this backend holds it (cached per bank version).

        The snapshot's vectors are copied to ``self.device`` once per bank version, in
        the bank's dtype; every later call with the same version gets the cached view.

        Args:
            bank: the memory bank.

        Returns:
            BankView on ``self.device`` (a half-precision bank's float32 rows stay on the
            host for a backend that scans its half copy: see :class:`BankView`).

        Raises:
            DeviceMemoryError: the vectors (the scan copy, for a backend that scans a
                half-precision bank's) and offsets would not fit in the device's free
                memory (:func:`rfmem_fast.device.check_fits`; checked before copying).
        """

        def build() -> BankView:
            snap = bank.snapshot()
            n, d = snap.vectors.shape
            half = self.scans_half and snap.dtype in HALF_DTYPES  # (an int8 copy: NativeBackend reads the snapshot's)
            on_device = snap.scan if half else snap.vectors
            _device.check_fits(
                on_device.nbytes + snap.offsets.nbytes, self.device,
                f"the bank ({n:,} x {d} {snap.dtype if half else snap.vectors.dtype}, {snap.num_users:,} users)",
            )  # fmt: skip
            offsets_cpu = torch.from_numpy(snap.offsets)
            X = torch.from_numpy(snap.vectors)
            Xs = None
            if half:
                Xs = scan_tensor(snap.scan, snap.dtype).to(self.device)  # the float32 rows stay on the host
            else:
                X = X.to(self.device)
            return BankView(X=X, offsets=offsets_cpu.to(self.device), offsets_cpu=offsets_cpu, snapshot=snap, Xs=Xs)

        return bank.cached(self.placement()[2], build)

    # ------------------------------------------------------------ primitives
    def segmented_topk(
        self, view: BankView, Q: torch.Tensor, qseg: torch.Tensor, k: int, sel: RowSelection | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k inner products of each query within its own user's segment.

        Args:
            view: the bank.
            Q: float32 [b, d] queries (unit norm in practice; not required).
            qseg: int64 [b] segment (user) index of each query.
            k: int >= 1.
            sel: optional :class:`~rfmem_fast.filters.RowSelection` of the b queries: a
                query with a selection ranks only its selected rows (module docstring);
                its tail is padding when fewer than k rows are selected.

        Returns:
            (scores float32 [b, k] descending, rows int64 [b, k] global row indices);
            where a segment has fewer than k rows the tail is score ``-inf`` and row
            ``-1``. Ties are broken by the smaller row index (spec "Vectors and scores").
            Scores are exact: ``RN32(q . x)``, the real inner product rounded once to
            float32, so a top-k is a prefix of every wider one and does not depend on
            the batch (:mod:`rfmem_fast.backends.exact`).
        """
        raise NotImplementedError

    def batched_kmeans(
        self,
        V: torch.Tensor,
        counts: torch.Tensor,
        clusters: torch.Tensor,
        iters: int,
        tol: float,
        seed: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Many small KMeans problems in one call (spec section 4).

        Args:
            V: float32 [m, n, d]; problem ``i`` uses the points ``V[i, :counts[i]]``.
            counts: int64 [m], 1 <= counts[i] <= n.
            clusters: int64 [m], 1 <= clusters[i] <= counts[i].
            iters: Lloyd iteration cap (>= 1).
            tol: convergence tolerance (relative centre shift, as scikit-learn).
            seed: scikit-learn's ``random_state``; every problem uses it afresh, as
                the authors' code does (see :mod:`rfmem_fast.kmeans`).

        Returns:
            (labels int64 [m, n] in [0, clusters[i]) for valid points and -1 for
             padding, centroids float32 [m, c, d] with c = max(clusters): the MEAN of
             the member points of each cluster under those labels, zero for an empty
             or unused cluster).
        """
        raise NotImplementedError

    def alpha_mix(
        self, qb: torch.Tensor, centroids: torch.Tensor, q0: torch.Tensor, alpha: float
    ) -> torch.Tensor:
        """The child queries of each branch (spec section 4).

        ``q_child = normalise(alpha * qb + (1 - alpha) * normalise(centroid) + q0)``
        with ``normalise(v) = v / (||v|| + 1e-12)``.

        Args:
            qb: float32 [m, d] branch queries.
            centroids: float32 [m, c, d] cluster means.
            q0: float32 [m, d] the original query of each branch.
            alpha: weight in [0, 1].

        Returns:
            float32 [m, c, d].
        """
        raise NotImplementedError

    def max_similarity(self, V: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each point's largest inner product with another point of its set (MMR, spec section 4).

        The similarity term of the beam driver's MMR score
        ``lam * s - (1 - lam) * max_{other candidate j} <v, v_j>``. The default takes
        the float64 Gram matrices with one batched product (any summation order; no
        host synchronisation); the native backend computes it in C++ with the function
        its C++ beam driver uses, so that both of its drivers agree bit for bit.

        Args:
            V: float32 [m, n, d]; set ``i`` holds the points ``V[i, :counts[i]]``.
            counts: int64 [m], 0 <= counts[i] <= n.

        Returns:
            float64 [m, n] on the backend's device: for j < counts[i], the largest
            ``<V[i, j], V[i, l]>`` over l < counts[i], l != j (``-inf`` when the point is
            alone); unspecified for j >= counts[i].
        """
        m, n, _ = V.shape
        V64 = V.to(torch.float64)
        G = torch.bmm(V64, V64.transpose(1, 2))
        valid = torch.arange(n, device=V.device)[None, :] < counts.to(V.device)[:, None]
        eye = torch.eye(n, dtype=torch.bool, device=V.device)
        G = G.masked_fill(~(valid[:, None, :] & ~eye[None]), float("-inf"))
        return G.max(dim=2).values if n else G.new_zeros((m, 0))

    def fused_driver(self) -> bool:
        """Whether :meth:`recollect` is a fused beam driver that the search should run.

        The default: True exactly when the backend's class overrides :meth:`recollect`
        (the base class has no driver, so the search runs the portable Python driver
        :func:`rfmem_fast.recollection.recollect` over the primitives of every backend
        that does not). A backend whose driver can be switched off overrides this too:
        the native backend says False while ``NativeBackend(beam_driver="python")`` /
        ``RFMEM_BEAM_DRIVER=python`` is in effect.

        Raises:
            ValueError: a backend setting that names no driver (the native backend's
                ``RFMEM_BEAM_DRIVER``).
        """
        return type(self).recollect is not Backend.recollect

    def recollect(
        self,
        view: BankView,
        q0: torch.Tensor,
        qseg: torch.Tensor,
        config: RFMemConfig,
        level0: tuple[torch.Tensor, torch.Tensor] | None = None,
        active: torch.Tensor | None = None,
        sel: RowSelection | None = None,
    ) -> RecollectionOutput:
        """A fused beam driver: the Recollection path (spec section 4) in one call.

        Overridden by a backend that has one (the native backend's C++ driver), which
        returns the rows, scores, rounds and hits of the Python driver
        :func:`rfmem_fast.recollection.recollect` (its oracle) bit for bit. The search runs
        it when :meth:`fused_driver` says so, else the Python driver over the primitives:
        ``rfmem_fast.recollection.recollect(backend, view, q0, qseg, config, level0, active)``.

        Args:
            view: the bank.
            q0: float32 [b, d] original queries (unit norm).
            qseg: int64 [b] segment (user) index of each query.
            config: the RFMemConfig (alpha, beam_width, fanout, max_rounds, mmr_lambda,
                score_floor, out_k, KMeans settings).
            level0: optional (scores [b, k0], rows [b, k0]) top-k of ``q0`` already
                computed (the probe), k0 >= beam_width * fanout.
            active: optional bool [b] on the backend's device: the queries to recollect
                (default all); the others get padding rows, ``-inf`` scores, 0 rounds.
            sel: optional RowSelection of the b queries: every round's candidates come
                from the selected rows only (``level0`` must be the probe of the same
                selection).

        Returns:
            :class:`RecollectionOutput`.

        Raises:
            NotImplementedError: this backend has no fused driver (run the Python
                driver, as the search does).
        """
        raise NotImplementedError(
            f"backend {self.name!r} has no fused beam driver: run the Python driver "
            "rfmem_fast.recollection.recollect(backend, view, q0, qseg, config, level0, active)"
        )

    def probe(
        self,
        view: BankView,
        Q: torch.Tensor,
        qseg: torch.Tensor,
        k: int,
        probe_k: int,
        temperature: float,
        convention: str,
        sel: RowSelection | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k plus the familiarity signals of the first ``probe_k`` (spec section 1).

        Args:
            view, Q, qseg, sel: as :meth:`segmented_topk` (with a selection, the signals
                are those of the selected rows' top-k).
            k: top-k width, >= probe_k.
            probe_k: K of the signals.
            temperature, convention: as :func:`rfmem_fast.signals.familiarity_signals`.

        Returns:
            (scores [b, k], rows [b, k], mean [b] float64, entropy [b] float64,
             count [b] int64 probe hits).
        """
        scores, rows = self.segmented_topk(view, Q, qseg, k, **({} if sel is None else {"sel": sel}))
        mean, ent, count = familiarity_signals(scores[:, :probe_k], temperature, convention)
        return scores, rows, mean, ent, count

    def segment_scores(self, view: BankView, Q: torch.Tensor | np.ndarray, seg: np.ndarray) -> SegmentScores:
        """The float32 scan score of EVERY row of each query's segment, with the scan's bound
        (the context score's input, :mod:`rfmem_fast.context`).

        The default: one float32 matrix product per distinct segment on the backend's
        device (``view.X``), bound for any summation order (depth d) and the matmul's input
        rounding (:func:`rfmem_fast.backends.exact.matmul_input_unit`). The native backend
        overrides it with its scan kernel.

        Args:
            view: the bank; Q: float32 [b, d] unit queries (tensor on the device or numpy);
            seg: int64 [b] host segment indices.

        Returns:
            :class:`SegmentScores` (host arrays).
        """
        seg = np.asarray(seg, dtype=np.int64)
        off = view.offsets_cpu.numpy()
        ptr = segment_ptr(off, seg)
        f = np.empty(int(ptr[-1]), dtype=np.float32)
        X = view.X
        Qt = Q if isinstance(Q, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(Q, dtype=np.float32))
        Qt = Qt.to(device=X.device, dtype=torch.float32)
        order = np.argsort(seg, kind="stable")
        us, first = np.unique(seg[order], return_index=True)
        bounds = list(first[1:]) + [order.shape[0]]
        for u, s0, s1 in zip(us.tolist(), first.tolist(), bounds):
            idx = order[s0:s1]
            a, b = int(off[u]), int(off[u + 1])
            if b == a:
                continue
            S = (Qt[torch.from_numpy(idx).to(X.device)] @ X[a:b].T).cpu().numpy()
            for j, i in enumerate(idx.tolist()):
                f[ptr[i] : ptr[i + 1]] = S[j]
        return SegmentScores(f, ptr, *self.scan_score_bound(view))

    def scan_score_bound(self, view: BankView) -> tuple[float, float]:
        """``(scale, abs_term)`` of the bound of the scan scores :meth:`segment_scores` (and, on
        a backend with ``has_fused_topk``, :meth:`hybrid_probe`'s recorded ones) give
        (:class:`SegmentScores`).

        The default: a float32 matrix product on ``view.X``'s device, any summation order
        (depth d), with the matmul's input rounding.
        """
        from .exact import matmul_input_unit

        d = int(view.X.shape[1])
        return scan_bound_terms(d, view.row_norm_max, d, matmul_input_unit(view.X.device))

    # ------------------------------------------------------------ host arrays
    def probe_host(self, view: BankView, Q: np.ndarray, seg: np.ndarray, k: int, probe_k: int, temperature: float,
                   convention: str, sel: RowSelection | None = None) -> tuple:  # fmt: skip
        """:meth:`probe` on host arrays: what the search's host fast path calls for a chunk on
        the CPU (:class:`rfmem_fast.search_chunk.HostKit`); the same values.

        Args:
            view: the bank (a CPU backend's view).
            Q: float32 [b, d] C-contiguous queries; seg: int64 [b] segment indices.
            k, probe_k, temperature, convention, sel: as :meth:`probe`.

        Returns:
            (scores [b, k], rows int64 [b, k], mean float64 [b], entropy float64 [b],
            count int64 [b]) C-contiguous numpy arrays (scores float32 but on a backend
            that returns another float type).

        The default wraps :meth:`probe` (tensors sharing the arrays' memory); the native
        backend calls its kernel directly.
        """
        out = self.probe(view, torch.from_numpy(Q), torch.from_numpy(seg), k, probe_k, temperature, convention,
                         **({} if sel is None else {"sel": sel}))  # fmt: skip
        return tuple(host_array(t, t.dtype) for t in out)

    def recollect_host(self, view: BankView, q0: np.ndarray, seg: np.ndarray, config: RFMemConfig,
                       level0: tuple[np.ndarray, np.ndarray], active: np.ndarray | None,
                       sel: RowSelection | None = None) -> tuple:  # fmt: skip
        """:meth:`recollect` (the fused driver, for a backend whose :meth:`fused_driver` is in
        effect) on host arrays, for the search's host fast path; the same values.

        Args:
            view: the bank; q0: float32 [b, d] C-contiguous queries; seg: int64 [b].
            config: as :meth:`recollect`.
            level0: the probe's (scores float32 [b, k0], rows int64 [b, k0]) host arrays.
            active: bool [b], the queries to recollect (None: every query).
            sel: as :meth:`recollect`.

        Returns:
            (rows int64 [b, m], scores float32 [b, m], rounds int64 [b], dense float32
            [b, out_k] or None) C-contiguous numpy arrays: :class:`RecollectionOutput`'s
            fields but ``hit_rows``, where rows and scores may be wider (m >= out_k: the
            native driver's discovery slots), their first out_k columns the result.

        Raises:
            ValueError: as :meth:`recollect`.

        The default wraps :meth:`recollect`.
        """
        out = self.recollect(view, torch.from_numpy(q0), torch.from_numpy(seg), config,
                             level0=(torch.from_numpy(level0[0]), torch.from_numpy(level0[1])),
                             active=None if active is None else torch.from_numpy(active),
                             **({} if sel is None else {"sel": sel}))  # fmt: skip
        return out.host()

    # ------------------------------------------------------------ filtered search
    def selection_view(self, view: BankView, sel: RowSelection) -> tuple[BankView, torch.Tensor]:
        """The compacted view of a selection's rows, and the map back to ``view``'s rows.

        Segment ``p`` of the compacted view holds the rows of selection ``p`` in their
        order (gathered once from ``view``'s float32 rows and scan copy, on the same
        devices; cached on ``sel`` per backend and view, so a batch gathers once however
        many primitive calls it makes). Its row-norm bound is ``view``'s (an upper bound
        still), so the exact re-scoring is unchanged.

        Returns:
            (BankView without a snapshot, int64 [M] global row of each compacted row on
             this backend's device).
        """
        key = ("view", self.name, str(self.device), id(view))
        got = sel._memo.get(key)
        if got is not None and got[0] is view:
            return got[1], got[2]
        rows_cpu = torch.from_numpy(sel.rows)
        X = view.X[rows_cpu.to(view.X.device)]
        Xs = None if view.Xs is None else view.Xs[rows_cpu.to(view.Xs.device)]
        off_cpu = torch.from_numpy(sel.off)
        sub = BankView(X=X, offsets=off_cpu.to(view.offsets.device), offsets_cpu=off_cpu, snapshot=None, Xs=Xs,
                       _memo={"xnorm": view.row_norm_max})  # fmt: skip
        back = rows_cpu.to(self.device)
        sel._memo[key] = (view, sub, back)
        return sub, back

    def on_selection(self, view: BankView, Q: torch.Tensor, qseg: torch.Tensor, sel: RowSelection, call) -> tuple:
        """Run a top-k primitive ``call(view, Q, qseg)`` (its result's element 1: the rows)
        with a selection: filtered queries on the compacted view
        (:meth:`selection_view`, their selection as segment), the others on ``view``;
        rows mapped back, results in the queries' order. The filtered searches of the
        torch, triton and cuda backends (the reference and native backends filter in
        their own scans)."""
        qsel = torch.from_numpy(sel.qsel)
        filt = qsel >= 0
        if not bool(filt.any()):
            return call(view, Q, qseg)
        sub, back = self.selection_view(view, sel)
        dev = Q.device

        def mapped(out: tuple) -> tuple:
            r = out[1]
            if back.shape[0] == 0:  # every selection is empty: every row is -1 (nothing to map)
                return out
            r = torch.where(r >= 0, back.to(r.device)[r.clamp(min=0)], r)
            return (out[0], r) + tuple(out[2:])

        if bool(filt.all()):
            return mapped(call(sub, Q, qsel.to(qseg.device)))
        fi = filt.nonzero().squeeze(1)
        ui = (~filt).nonzero().squeeze(1)
        part_f = mapped(call(sub, Q[fi.to(dev)], qsel[fi].to(qseg.device)))
        part_u = call(view, Q[ui.to(dev)], qseg[ui.to(qseg.device)])
        out = []
        for a, c in zip(part_f, part_u):
            t = torch.empty((Q.shape[0],) + tuple(a.shape[1:]), dtype=a.dtype, device=a.device)
            t[fi.to(a.device)] = a
            t[ui.to(a.device)] = c.to(a.device)
            out.append(t)
        return tuple(out)
