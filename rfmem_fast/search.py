"""Entry points: RF-Mem, dense and recollection search over a multi-tenant bank (RFMEM_SPEC.md section 5).

``search(bank, queries, users, config, mode, backend)`` runs, for the whole batch:

1. one probe: a segmented top-k of width ``max(probe_k, out_k, beam_width * fanout)``
   of every query within its own user's segment, and the familiarity signals of its
   first ``probe_k`` scores (section 1);
2. the router (section 2) in mode "rfmem"; mode "dense" sends every query to the
   Familiarity path and mode "recollection" every query to the Recollection path;
3. the Familiarity path (the probe's first ``out_k``, section 3) and the Recollection
   path (:meth:`Backend.recollect <rfmem_fast.backends.base.Backend.recollect>`: the
   Python beam driver :func:`rfmem_fast.recollection.recollect`, or the native
   backend's C++ driver; section 4, whose first round reuses the probe) for the
   queries routed there.

Every call works on ONE immutable bank snapshot (taken once, see
:class:`rfmem_fast.bank.MemoryBank`), so concurrent writes never tear a search. A
large batch is cut into chunks of ``max_batch`` queries run one after the other
(intermediate memory bounded by the chunk, results concatenated; identical to one
call per query since the backends are batch-invariant). Top-k widths are capped by
the longest user segment in the chunk, so a huge ``out_k`` / ``probe_k`` over a small
bank costs only its padded output, not an absurd intermediate.

The lexical channel (``config.lexical_weight > 0`` with ``query_texts``, README "Hybrid
retrieval"): after the probe, each query's BM25 over its user's items
(:mod:`rfmem_fast.lexical`) is fused with the probe's exact dense list on the host
(:func:`_hybrid`, rules and exactness proof in :mod:`rfmem_fast.fusion`); the probe's
familiarity signals, the routing and the Recollection path stay dense.

Filtered search (``filters=``, :mod:`rfmem_fast.filters`): the filters of a batch are
compiled once into a :class:`~rfmem_fast.filters.RowSelection` (the rows each query may
return) that every top-k call of the search applies WHILE it takes the top-k (the
backends' ``sel``): the probe (so its familiarity signals are those of the matching
items' top-k, and the routing follows them), every recollection round, and the final
list see only matching items, so a filtered query returns the exact top-k of its
user's matching items (padding only when fewer than ``out_k`` match). The lexical
channel drops the hits outside the filter before it fuses (its per-query statistics
are those of the matching hits; BM25's corpus statistics stay the user's whole
memory). The profile prior, a query transform, still uses the user's whole profile.

Device-resident batches (README "GPU"): with ``output="torch"`` the results are tensors
on the backend's device (:class:`TensorSearchResult`); torch queries are validated and
normalised where they live (one host synchronisation), the router runs on the device
(:func:`rfmem_fast.routing.threshold.route_tensor`) and no query is copied to the host. Both outputs
run the same code (:func:`search_tensors`); ``output="numpy"`` copies the finished
tensors to the host once and looks the item ids and texts up.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np
import torch

from ._validate import _NORM_EPS, unit_rows
from .backends import Backend, BankView, get_backend
from .bank import BankSnapshot, MemoryBank
from .config import RFMemConfig
from .device import host_array, to_device
from .backends.exact import abs_error_term, exact_pair_scores, exact_pair_scores_np, scan_error_coef
from .expansion import fold_expansions
from .filters import RowSelection, compile_filters
from .context import context_topk
from .backends.base import SegmentScores, all_row_hits, segment_ptr
from .fusion import BOOSTS, TOP_LEXICAL, LexicalStats, item_mean, rrf, top_by_score_row, user_means, zscore_stats
from . import recollection as _recollection
from .routing.base import (
    FAMILIARITY,
    RECOLLECTION,
    ROUTE_NAMES,
    RULE_FORCED_DENSE,
    RULE_FORCED_RECOLLECTION,
    RULE_NAMES,
    Router,
)
from .routing.features import ProbeSignals
from .routing.files import resolve_reranker, resolve_router
from .routing.merge import merge_paths, select_top
from .routing.profile import fold_profile, profiles_numpy, view_profiles
from .routing.rerank import candidate_features
from .routing.threshold import route, route_tensor
from .threads import limit_torch_threads

MODES = ("rfmem", "dense", "recollection")
_F32 = np.dtype(np.float32)
#: what :func:`search` returns: "numpy" (a SearchResult) or "torch" (a TensorSearchResult)
OUTPUTS = ("numpy", "torch")
#: default number of queries per internal chunk of :func:`search`
DEFAULT_MAX_BATCH = 8192
#: exact dense candidates per query of the convex / adaptive fusions (at least the fused
#: width): the wider the dense list, the lower its last score ``s_K`` and the fewer
#: lexical hits pass the bound of :mod:`rfmem_fast.fusion` and need an exact re-score;
#: results do not depend on it
HYBRID_DENSE_DEPTH = 64
#: fusions whose boosts are known before the dense scan (no dense statistic in them): a
#: backend with ``has_fused_topk`` takes their fused top-k in the probe's own pass
#: (``Backend.hybrid_probe``); "zscore" needs the dense top-1 first: the same pass records
#: every hit's scan score and ``Backend.fused_topk`` fuses after it, without scoring again
ONE_PASS_FUSIONS = ("convex", "adaptive")


@dataclass
class SearchResult:
    """Results of a batch of b queries.

    Every per-item field is read from the ONE bank snapshot the search ran on, so a
    result stays self-consistent whatever is written to the bank afterwards: use
    ``ids`` / ``texts`` / ``probe_texts``, never ``bank.snapshot()`` looked up by
    ``rows`` after a write.

    Attributes:
        ids: object ndarray [b, out_k], the caller's item ids; ``None`` pads a row
            whose user has fewer than ``out_k`` items, or whose recollection ran dry
            (the Recollection path can return fewer than ``out_k`` items even for a
            user holding many more; see :func:`search`).
        texts: object ndarray [b, out_k], the text (str, or None when the item was
            added without one) of each hit, from the search's own snapshot; ``None``
            pads as in ``ids``.
        rows: int64 ndarray [b, out_k], rows of the snapshot the search used (-1
            padding): SNAPSHOT-RELATIVE, valid for that snapshot only (a later write
            moves rows); not stable handles.
        scores: float32 ndarray [b, out_k]: inner-product scores on the Familiarity
            path (with the lexical channel on, ``config.lexical_weight > 0``: the fused
            score of :mod:`rfmem_fast.fusion`, rounded to float32); on the Recollection
            path the (MMR-adjusted when mmr_lambda < 1) score each item was discovered
            with, in discovery order; ``-inf`` padding.
        route: int64 ndarray [b], 0 = familiarity, 1 = recollection (``route_names``).
        mean: float64 ndarray [b], mean probe score (0 for an empty bank).
        entropy: float64 ndarray [b], probe entropy in the config's convention.
        rule: int64 ndarray [b], index into ``rfmem_fast.routing.base.RULE_NAMES``.
        rounds: int64 ndarray [b], recollection rounds used (0 on the Familiarity path).
        probe_ids: object ndarray [b, probe_k], the probe's item ids (None padding).
        probe_texts: object ndarray [b, probe_k], the probe's texts from the same
            snapshot (None padding, or an item without text).
        probe_scores: float32 ndarray [b, probe_k], the probe's scores (-inf padding).
            With the lexical channel on, the probe's list is the FUSED top ``probe_k``
            (ids, texts and scores), while ``mean`` / ``entropy`` (and the routing) stay
            those of the dense cosine probe.
        dense_scores: float32 ndarray [b, out_k], each hit's exact cosine score
            ``RN32(q . x)`` (q the query as searched: after expansions / the profile
            prior); NaN for padding.
        lexical_scores: float32 ndarray [b, out_k], each hit's BM25 score within its
            user's memory (0 for an item that is no lexical hit or has no text); NaN
            for padding and when no ``query_texts`` were given.
        context_scores: float32 ndarray [b, out_k], each hit's context score ``c``
            (``config.context_weight`` / ``thread_weight`` > 0, :mod:`rfmem_fast.context`:
            the hits are the exact top ``out_k`` by ``c`` and ``scores`` holds their base
            scores), rounded to float32; NaN for padding, when the context score is off
            and for a query that took the Recollection path.
        mode, backend: how the batch was run.
    """

    ids: np.ndarray
    rows: np.ndarray
    scores: np.ndarray
    route: np.ndarray
    mean: np.ndarray
    entropy: np.ndarray
    rule: np.ndarray
    rounds: np.ndarray
    probe_ids: np.ndarray
    probe_scores: np.ndarray
    texts: np.ndarray
    probe_texts: np.ndarray
    mode: str = "rfmem"
    backend: str = ""
    config: RFMemConfig = field(default_factory=RFMemConfig)
    dense_scores: np.ndarray | None = None
    lexical_scores: np.ndarray | None = None
    context_scores: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @property
    def route_names(self) -> list[str]:
        """Route of each query as "familiarity" / "recollection"."""
        return [ROUTE_NAMES[r] for r in self.route]

    @property
    def rule_names(self) -> list[str]:
        """Rule that fired for each query, as a name from RULE_NAMES."""
        return [RULE_NAMES[r] for r in self.rule]

    def ids_list(self, i: int) -> list[Hashable]:
        """The item ids of query ``i`` without padding."""
        return [x for x, r in zip(self.ids[i], self.rows[i]) if r >= 0]

    def texts_list(self, i: int) -> list[str | None]:
        """The texts of query ``i``'s hits without padding (None for an item without text)."""
        return [t for t, r in zip(self.texts[i], self.rows[i]) if r >= 0]


@dataclass
class TensorSearchResult:
    """Results of a batch of b queries as tensors on the search's device (``output="torch"``).

    The same fields as :class:`SearchResult` without the host-side id / text lookups;
    ``rows`` index the one snapshot the search ran on (``snapshot``), and
    :meth:`to_result` turns the whole into a :class:`SearchResult` (one copy to the host).

    Attributes:
        rows: int64 [b, out_k] snapshot rows (-1 padding).
        scores: float32 [b, out_k] (-inf padding); as :attr:`SearchResult.scores`.
        route: int64 [b] (0 familiarity, 1 recollection).
        mean: float64 [b]; entropy: float64 [b] (the config's convention).
        rule: int64 [b] index into ``rfmem_fast.routing.base.RULE_NAMES``.
        rounds: int64 [b] recollection rounds (0 on the Familiarity path).
        probe_rows: int64 [b, probe_k]; probe_scores: float32 [b, probe_k].
        dense_scores, lexical_scores, context_scores: float32 [b, out_k], as
            :class:`SearchResult`; on a device-resident batch without the lexical channel
            the dense scores of recollected hits are NaN (computing them would synchronise
            with the host).
        snapshot: the BankSnapshot the rows index (None for a view built from device
            tensors, :func:`rfmem_fast.device.view_from_tensors`: no ids to look up).
        mode, backend, config: how the batch was run.
    """

    rows: torch.Tensor
    scores: torch.Tensor
    route: torch.Tensor
    mean: torch.Tensor
    entropy: torch.Tensor
    rule: torch.Tensor
    rounds: torch.Tensor
    probe_rows: torch.Tensor
    probe_scores: torch.Tensor
    dense_scores: torch.Tensor
    lexical_scores: torch.Tensor
    context_scores: torch.Tensor
    snapshot: BankSnapshot | None = None
    mode: str = "rfmem"
    backend: str = ""
    config: RFMemConfig = field(default_factory=RFMemConfig)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @property
    def device(self) -> torch.device:
        """The device the tensors live on."""
        return self.rows.device

    def to_result(self) -> SearchResult:
        """The same results as a :class:`SearchResult` (copied to the host; ids and texts looked up).

        Raises:
            ValueError: the result has no snapshot (a search over a view built from device
                tensors has no item ids).
        """
        if self.snapshot is None:
            raise ValueError("this result has no bank snapshot (a view built from device tensors): no item ids to look up")
        host = {k: getattr(self, k).cpu().numpy() for k in _TENSOR_FIELDS}
        return SearchResult(mode=self.mode, backend=self.backend, config=self.config, **_host_fields(host, self.snapshot))


#: the tensor fields of a chunk of :func:`search_tensors`, in the order of TensorSearchResult
_TENSOR_FIELDS = (
    "rows", "scores", "route", "mean", "entropy", "rule", "rounds", "probe_rows", "probe_scores", "dense_scores",
    "lexical_scores", "context_scores",
)  # fmt: skip


def _host_fields(t: dict[str, np.ndarray], snap: BankSnapshot, full: bool | None = None,
                 probe_full: bool | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """SearchResult's arrays from host copies of the tensor fields (ids and texts from ``snap``);
    ``full`` / ``probe_full``: :func:`_unpadded` of the rows / probe rows when known."""
    item_ids = snap.item_ids
    texts = snap.texts  # None when no item has a text
    rows, probe_rows = t["rows"], t["probe_rows"]
    if full is None:
        full = _unpadded(rows)
    if probe_full is None:
        probe_full = _unpadded(probe_rows)
    return dict(
        ids=_lookup(item_ids, rows, full),
        texts=_lookup(texts, rows, full),
        rows=rows,
        probe_ids=_lookup(item_ids, probe_rows, probe_full),
        probe_texts=_lookup(texts, probe_rows, probe_full),
        **{k: _typed(t[k], dt) for k, dt in _HOST_DTYPES},
    )


#: the numeric fields of a SearchResult and their dtypes (rows int64 as the backends give it)
_HOST_DTYPES = tuple((k, np.dtype(d)) for k, d in (
    ("scores", np.float32), ("route", np.int64), ("mean", np.float64), ("entropy", np.float64), ("rule", np.int64),
    ("rounds", np.int64), ("probe_scores", np.float32), ("dense_scores", np.float32), ("lexical_scores", np.float32),
    ("context_scores", np.float32),
))  # fmt: skip


def _typed(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``a`` as ``dt`` (itself when it is one already: no call beyond the dtype check)."""
    return a if a.dtype is dt else a.astype(dt, copy=False)


def _as_queries(queries: Any, dim: int) -> np.ndarray:
    return unit_rows(queries, "queries", dim)


def _as_query_tensor(queries: torch.Tensor, dim: int, device: torch.device) -> torch.Tensor:
    """Check and L2-normalise torch queries ON ``device`` (the device path of :func:`search`).

    The same checks, messages and arithmetic as :func:`_as_queries` (float32 values, norms
    and division in float64, rounded once to float32), with ONE host synchronisation: the
    flag "some row is NaN / Inf / zero" is read once; only on an error are the details read.

    Returns:
        float32 [b, d] unit rows on ``device``.

    Raises:
        TypeError: a non-floating dtype. ValueError: not 2-D, wrong d, NaN / Inf, values
        beyond the float32 range, a zero row.
    """
    if not queries.dtype.is_floating_point:
        raise TypeError(f"queries must hold floating-point values (float16/32/64), got dtype {queries.dtype}")
    if queries.ndim != 2:
        raise ValueError(f"queries must be 2-D [n, d], got shape {tuple(queries.shape)}")
    if queries.shape[1] < 1:
        raise ValueError(f"queries must have d >= 1 columns, got shape {tuple(queries.shape)}")
    if queries.shape[1] != dim:
        raise ValueError(f"queries must have dimension {dim}, got {queries.shape[1]}")
    src = queries.detach().to(device)
    q32 = src.to(torch.float32)
    q64 = q32.to(torch.float64)
    norms = torch.linalg.vector_norm(q64, dim=1)
    finite = torch.isfinite(q32).all(dim=1)
    bad = ~finite | (norms <= _NORM_EPS)
    if q32.shape[0] and bool(bad.any()):  # the one host synchronisation of the validation
        if not bool(finite.all()):
            row = int((~finite).nonzero()[0, 0])
            if src.element_size() > 4 and bool(torch.isfinite(src[row]).all()):
                raise ValueError(f"queries row {row} holds values beyond the float32 range (|x| > 3.4e38); scale it down")
            raise ValueError(f"queries holds NaN or Inf (first in row {row})")
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"queries row {row} has zero norm (<= {_NORM_EPS:g}); it cannot be L2-normalised")
    return (q64 / norms[:, None]).to(torch.float32)


def check_search_args(mode: Any, config: Any, max_batch: Any) -> tuple[RFMemConfig, int]:
    """Check :func:`search`'s ``mode``, ``config`` and ``max_batch`` (shared with the layers above it).

    Returns:
        (the config, ``RFMemConfig()`` when None; max_batch as an int).

    Raises:
        ValueError: unknown mode; ``max_batch`` not an int >= 1.
        TypeError: a config that is not an RFMemConfig.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if config is None:
        config = RFMemConfig()
    if not isinstance(config, RFMemConfig):
        raise TypeError(f"config must be an RFMemConfig, got {type(config).__name__}")
    if isinstance(max_batch, (bool, np.bool_)) or not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if mode == "recollection" and config.context_on:
        # the context score ranks the Familiarity path's list: every query of this mode takes
        # the Recollection path, whose hits carry no context score (as a query that mode
        # "rfmem" routes there)
        config = config.replace(context_weight=0.0, thread_weight=0.0)
    return config, int(max_batch)


def check_query_texts(query_texts: Any, b: int, config: RFMemConfig) -> list | None:
    """:func:`search`'s ``query_texts`` as a list of b str / None (None when not given).

    Raises:
        ValueError: ``config.lexical_weight > 0`` without ``query_texts``, or a length other than b.
        TypeError: not a sequence of str / None.
    """
    if query_texts is None:
        if config.lexical_weight > 0:
            raise ValueError(
                "query_texts is required when config.lexical_weight > 0 (the lexical channel scores the query's text): "
                "pass one str (or None) per query"
            )
        return None
    if isinstance(query_texts, (str, bytes)) or not hasattr(query_texts, "__len__"):
        raise TypeError("query_texts must be a sequence of str (or None), one per query")
    out = list(query_texts)
    if len(out) != b:
        raise ValueError(f"query_texts has {len(out)} entries but queries has {b} rows")
    for j, t in enumerate(out):
        if t is not None and not isinstance(t, str):
            raise TypeError(f"query_texts[{j}] must be a str or None, got {type(t).__name__}")
    return out


def _prepare(bank: MemoryBank, queries: Any, users: Sequence[Hashable], config: Any, mode: str, backend: Any,
             device: Any, max_batch: Any, expansions: Any, router: Any, query_texts: Any = None,
             filters: Any = None) -> tuple:  # fmt: skip
    """:func:`search`'s checks and set-up: (config, max_batch, backend, view, Q, qseg, chunk hints, router, texts,
    the compiled filters: a RowSelection or None). ``Q`` / ``qseg``: numpy arrays for host
    queries and a CPU backend (no tensor until a chunk needs one), else tensors on the
    backend's device."""
    config, max_batch = check_search_args(mode, config, max_batch)
    if not isinstance(bank, MemoryBank):
        raise TypeError(f"bank must be a MemoryBank, got {type(bank).__name__}")
    tensor_in = isinstance(queries, torch.Tensor)
    q_np = None if tensor_in else _as_queries(queries, bank.dim)
    if tensor_in and queries.ndim != 2:  # checked again, with the others, on the device
        raise ValueError(f"queries must be 2-D [n, d], got shape {tuple(queries.shape)}")
    b = int(queries.shape[0]) if tensor_in else int(q_np.shape[0])
    if isinstance(users, (str, bytes)) or not hasattr(users, "__len__"):
        raise TypeError("users must be a sequence of user keys, one per query")
    if len(users) != b:
        raise ValueError(f"users has {len(users)} entries but queries has {b} rows")
    texts = check_query_texts(query_texts, b, config)
    router = _resolve_router(mode, config, router)
    be = get_backend(backend, device)
    dev, on_cpu, _ = be.placement()
    if tensor_in:
        Q = _as_query_tensor(queries, bank.dim, dev)
        if expansions is not None:
            Q = to_device(fold_expansions(Q.cpu().numpy(), expansions, config.expansion_weight), dev)
    else:  # host arrays stay numpy for a CPU backend (search_tensors takes both)
        Q = fold_expansions(q_np, expansions, config.expansion_weight)
        if not on_cpu:
            Q = to_device(Q, dev)
    view = be.view(bank)  # one immutable snapshot for the whole call
    snap = view.snapshot
    if snap.vectors.shape[0] == 0:
        raise ValueError("bank is empty: add items before searching")
    segs = bank.segment_list(users, snapshot=snap)
    seg = np.asarray(segs, dtype=np.int64)
    sel = compile_filters(bank, snap, seg, filters)
    qseg = seg if on_cpu and not tensor_in else to_device(seg, dev)
    if b <= max_batch and sel is None:  # one chunk: Python ints (a numpy call of a few values costs more)
        seg_len = _segment_lengths(view)
        ll = [seg_len[u] for u in segs]
        return config, max_batch, be, view, Q, qseg, [(max(ll), float(sum(ll)) * bank.dim)] if b else [], router, texts, sel
    lens = snap.offsets[seg + 1] - snap.offsets[seg]
    if sel is not None:  # a filtered query searches its selection: widths and work as for a user of that size
        lens = np.where(sel.qsel >= 0, sel.counts[np.maximum(sel.qsel, 0)] if sel.num_selections else 0, lens)
    if b <= max_batch:
        ll = lens.tolist()
        hints = [(max(ll), float(sum(ll)) * bank.dim)] if b else []
    else:
        hints = [(int(lens[c0 : c0 + max_batch].max()), float(lens[c0 : c0 + max_batch].sum()) * bank.dim) for c0 in range(0, b, max_batch)]
    return config, max_batch, be, view, Q, qseg, hints, router, texts, sel


def _segment_lengths(view: BankView) -> list[int]:
    """The rows of every user segment of ``view``'s snapshot as Python ints (memoised on
    the view, i.e. per snapshot: a write makes a new view)."""
    got = view._memo.get("segment_lengths")
    if got is None:
        got = view._memo["segment_lengths"] = np.diff(view.snapshot.offsets).tolist()
    return got


@dataclass
class CandidatePools:
    """The re-ranker's candidate pools of b queries (:func:`search_candidates`).

    Attributes:
        rows: int64 [b, L] snapshot rows of the pool (the probe's top ``depth``, then the
            recollection's hits; -1 padding).
        keep: bool [b, L] the first occurrence of each item (padding and repeats False).
        features: float64 [b, L, 4] the features of :data:`rfmem_fast.routing.RERANK_FEATURES`.
        route: int64 [b] the path each query took (1 = it recollected, so its hits are in
            the pool).
        ids: object [b, L] the caller's item ids of ``rows`` (None padding).
    """

    rows: np.ndarray
    keep: np.ndarray
    features: np.ndarray
    route: np.ndarray
    ids: np.ndarray


def search_candidates(
    bank: MemoryBank,
    queries: Any,
    users: Sequence[Hashable],
    config: RFMemConfig | None = None,
    mode: str = "rfmem",
    depth: int = 20,
    backend: str | Backend = "auto",
    device: str | None = None,
    expansions: Any = None,
    router: Router | None = None,
    query_texts: Sequence[str | None] | None = None,
    filters: Any = None,
) -> CandidatePools:
    """The candidate pools a re-ranker would see for these queries, with their features.

    Runs :func:`search` (same arguments and semantics: routing, profile prior,
    expansions) and returns, per query, the pool of :mod:`rfmem_fast.routing.rerank`:
    the probe's top ``depth`` items plus, for a query that recollected, every
    recollected hit. Used to fit a re-ranker (:func:`rfmem_fast.routing.fit_reranker`)
    on labelled questions with exactly the features the search computes.

    Args:
        bank, queries, users, config, mode, backend, device, expansions, router,
            query_texts, filters: as :func:`search` (``config.reranker`` must be None: pools are
            what a re-ranker sees, before it; the pools are built from the DENSE probe).
        depth: probe items in the pool (int >= 1).

    Returns:
        CandidatePools.

    Raises:
        ValueError: depth < 1, a config with a re-ranker, or as :func:`search`.
    """
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 1:
        raise ValueError(f"depth must be an int >= 1, got {depth!r}")
    if config is not None and getattr(config, "reranker", None) is not None:
        raise ValueError("search_candidates needs a config without a reranker (the pools are the re-ranker's input)")
    config, max_batch, be, view, Q, qseg, hints, router, texts, sel = _prepare(
        bank, queries, users, config, mode, backend, device, DEFAULT_MAX_BATCH, expansions, router, query_texts, filters
    )
    got: list = [int(depth)]
    res = search_tensors(be, view, Q, qseg, config, mode, max_batch=max_batch, chunk_hints=hints, host_output=True,
                         router=router, pools=got, query_texts=texts, selection=sel)  # fmt: skip
    parts = got[1:]
    L = max(p[0].shape[1] for p in parts)

    def cat(j: int, fill: Any) -> np.ndarray:
        return np.concatenate([
            np.pad(p[j], [(0, 0), (0, L - p[j].shape[1])] + [(0, 0)] * (p[j].ndim - 2), constant_values=fill) for p in parts
        ])  # fmt: skip

    rows, keep, feats = cat(0, -1), cat(1, False), cat(2, 0.0)
    ids = _lookup(view.snapshot.item_ids, rows)
    return CandidatePools(rows=rows, keep=keep, features=feats, route=res["route"], ids=ids)


def search(
    bank: MemoryBank,
    queries: Any,
    users: Sequence[Hashable],
    config: RFMemConfig | None = None,
    mode: str = "rfmem",
    backend: str | Backend = "auto",
    device: str | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    output: str = "numpy",
    expansions: Any = None,
    router: Router | None = None,
    query_texts: Sequence[str | None] | None = None,
    filters: Any = None,
) -> SearchResult | TensorSearchResult:
    """RF-Mem retrieval for a batch of queries, each within its own user's memory.

    Args:
        bank: the memory bank (at least one item overall).
        queries: [b, d] floating array (float16/32/64, numpy or torch, any strides);
            rows are L2-normalised here. A torch tensor is checked and normalised on
            the backend's device (a CUDA tensor is never copied to the host).
        users: b user keys; query i searches only ``users[i]``'s items.
        config: RFMemConfig (default: the spec's defaults).
        mode: "rfmem" (probe, route, routed path), "dense" (always familiarity) or
            "recollection" (always recollection).
        backend: "auto" | "native" | "torch" | "triton" | "cuda" | "reference"
            (``rfmem_fast.backends.BACKEND_NAMES``; ``available_backends()`` lists
            those that run here; "auto" takes the first), or a Backend instance.
        device: torch device for device-capable backends (default: CUDA if present).
        max_batch: queries per internal chunk (int >= 1, default 8192); bounds the
            intermediate memory of a huge batch. Results do not depend on it.
            A chunk whose scan work is small (e.g. one query) runs with one torch
            intra-op thread on the CPU (:func:`rfmem_fast.threads.limit_torch_threads`).
        output: "numpy" (default): a :class:`SearchResult` of host arrays with item ids
            and texts; "torch": a :class:`TensorSearchResult` of tensors on the
            backend's device (rows, not ids; ``.to_result()`` converts), for
            device-resident batches: torch queries stay on their device, the router
            runs there, and the whole call synchronises with the host only where
            :mod:`rfmem_fast.device` documents (once to validate the queries, once per
            recollection round, plus the backend primitives' own).
        expansions: optional extra vectors per query (the query-expansion hook, e.g.
            HyDE pseudo-document embeddings): a float array [b, m, d] or a sequence of
            b arrays [m_i, d] / None; folded into each query as
            ``normalise(q + config.expansion_weight * sum_j e_j)`` before the probe, so
            the probe, the routing, the Recollection path's original query and the
            merges all use the expanded query (:mod:`rfmem_fast.expansion`; folded on
            the host, so torch queries make one round trip when expansions are given).
        router: a :class:`rfmem_fast.routing.Router` to route with in mode "rfmem"
            (default: the router of ``config.router`` when set, else the spec's
            thresholds, evaluated on the backend's device). A router object or file
            routes on the host from the probe's signals (one device-to-host copy). On
            the Recollection path ``config.merge`` combines the hits with the probe's
            top-k (:mod:`rfmem_fast.routing.merge`; on the host).
        query_texts: b query texts (str, or None for a query without text), required
            when ``config.lexical_weight > 0``: the lexical (BM25) channel
            (:mod:`rfmem_fast.lexical`) scores each against its user's item texts, and
            the Familiarity path returns the fused top ``out_k``
            (:mod:`rfmem_fast.fusion`: exact on every backend, see its docstring). The
            probe's list (``probe_ids`` / ``probe_scores``) is fused too; the familiarity
            signals (``mean``, ``entropy``) and so the routing stay those of the DENSE
            probe (the thresholds keep their cosine meaning); the Recollection path
            scores its mixed queries densely and returns what it returns today. A query
            with no token known to its user's memory gets the dense result. With weight
            0, given texts only fill ``lexical_scores``.
        filters: None (default), one filter dict for every query, or b dicts / None (a
            per-query filter; None: unfiltered) over the items' metadata and their
            ``created_at`` (:mod:`rfmem_fast.filters`: ``{"tag": "work"}``,
            ``{"score": {"$gte": 3}}``, ``{"created_at": {"$gte": "2026-11-01T00:00:00Z"}}``,
            ``$and`` / ``$or`` / ``$not``, ...). A filtered query returns the exact top-k
            of its user's MATCHING items, in every mode and on every backend: the
            probe (and so its signals and the routing), the recollection rounds and the
            final list see only matching items (module docstring); its row is padded
            only when fewer than ``out_k`` items match (and, as always, when the
            Recollection path runs dry). The filters are compiled once per call (their
            rows cached on the bank until the next write or metadata change).

    Beyond the paper (README "Retrieval quality"): with ``config.profile_weight > 0``
    each query is folded with its user's profile before the probe (the profile prior,
    :mod:`rfmem_fast.routing.profile`; on the backend's device); with
    ``config.reranker`` every query's final list (in every mode) is the re-ranker's top
    ``out_k`` of its candidate pool (:mod:`rfmem_fast.routing.rerank`; on the host,
    float64 from the bank's vectors, so every backend returns identical lists).

    Returns:
        SearchResult (or TensorSearchResult with ``output="torch"``), whose ids, texts and probe texts come from the one snapshot the
        call used (``rows`` are relative to that snapshot). Padding (id None, text
        None, row -1, score -inf) fills the tail of a row that has fewer than
        ``out_k`` items:

        * a user with fewer than ``out_k`` items, on either path;
        * on the Recollection path, also a user with MANY items: recollection
          stops after ``max_rounds`` rounds or when a round finds nothing new (every
          candidate already returned or below ``score_floor``), as the spec's
          section 4 does, so with a large ``out_k`` (e.g. 50 with the default 4-beam,
          10-round config) a row can hold far fewer than ``out_k`` items;
        * a user with no items: an all-padding row, mean 0, entropy 0 and the rule
          "no_hits" (route recollection in mode "rfmem").

        Use ``res.ids_list(i)`` / ``res.texts_list(i)`` for a row without padding.

    Raises:
        ValueError: unknown mode, output or backend name (the message lists
            ``BACKEND_NAMES``); an empty bank (no live item in the snapshot);
            queries not 2-D, of the wrong dimension, with NaN / Inf or a zero row;
            ``users`` not of length b; ``max_batch`` < 1; ``config.lexical_weight > 0``
            without ``query_texts``, or ``query_texts`` not of length b; a malformed
            filter (unknown operator, empty ``$and``, bad date, ...; the message names
            the part, e.g. ``filters['score']['$gte']``), or ``filters`` not of length b.
        TypeError: non-floating queries; a config that is not an RFMemConfig; a
            user key that is not a str / int; a filter value of the wrong type, or a
            range whose bound's type the field never holds among the user's items.
        KeyError: an unknown user (the message names it and its position).
        DeviceMemoryError: the bank does not fit in the free memory of the backend's
            device (:func:`rfmem_fast.device.check_fits`; raised before any allocation).
        ValueError / TypeError: bad ``expansions`` (the message names the entry); a
            ``router`` that is not a Router or was made for another probe.
    """
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    config, max_batch, be, view, Q, qseg, hints, router, texts, sel = _prepare(
        bank, queries, users, config, mode, backend, device, max_batch, expansions, router, query_texts, filters
    )
    res = search_tensors(
        be, view, Q, qseg, config, mode, max_batch=max_batch, chunk_hints=hints,
        host_output=output == "numpy", router=router, query_texts=texts, selection=sel,
    )  # fmt: skip
    if output == "torch":
        return res
    return SearchResult(mode=mode, backend=be.name, config=config, **res)


def search_tensors(
    backend: Backend,
    view: BankView,
    Q: torch.Tensor,
    qseg: torch.Tensor,
    config: RFMemConfig,
    mode: str = "rfmem",
    max_batch: int = DEFAULT_MAX_BATCH,
    chunk_hints: Sequence[tuple[int, float]] | None = None,
    host_output: bool = False,
    router: Router | None = None,
    pools: list | None = None,
    query_texts: Sequence[str | None] | None = None,
    selection: RowSelection | None = None,
) -> TensorSearchResult | dict[str, np.ndarray]:
    """The engine under :func:`search`: a batch of unit queries and segment indices, on a view.

    For callers that already hold a bank view on a device and segment indices (a GPU
    server, ``bench/gpu_check.py``'s device-generated banks); :func:`search` is this plus
    the checks, the user-key lookup and the host conversion.

    Args:
        backend: the backend (its device is where everything runs).
        view: the bank as that backend holds it (``backend.view(bank)``, or
            :func:`rfmem_fast.device.view_from_tensors`).
        Q: float32 [b, d] unit-norm queries on the backend's device (not checked); for a
            CPU backend also a numpy array (what :func:`search` passes: a host chunk then
            reaches the kernels without a tensor).
        qseg: int64 [b] segment index of each query, in [0, U), same device, or numpy
            with a numpy ``Q`` (not checked).
        config: RFMemConfig; mode: "rfmem" | "dense" | "recollection".
        max_batch: queries per internal chunk (>= 1).
        chunk_hints: optional (longest queried segment, scan work in multiply-adds) of
            each chunk, host numbers: the first caps the top-k widths, the second sets the
            chunk's torch threads on the CPU (:func:`rfmem_fast.threads.limit_torch_threads`,
            one thread for a small chunk). Default: the longest segment of the whole bank
            and the current threads (results depend on neither; see the module docstring).
        host_output: False: a TensorSearchResult on the device; True: the arrays of a
            :class:`SearchResult` (ids and texts looked up in ``view.snapshot``), converted
            chunk by chunk into arrays allocated once (a huge batch is never held twice).
        router: mode "rfmem" only: None routes by the spec's thresholds of ``config`` on
            the device (:func:`rfmem_fast.routing.threshold.route_tensor`); a Router routes on the
            host from the probe's signals.
        pools: internal (:func:`search_candidates`): a list ``[depth]`` to which every
            chunk appends its re-ranker candidate pools ``(cand, keep, features)`` (host
            arrays), built with the probe's top ``depth``.
        query_texts: optional b query texts (str / None) for the lexical channel
            (required when ``config.lexical_weight > 0``; needs ``view.snapshot``).
        selection: optional filters of the b queries compiled for ``view``'s snapshot
            (:func:`rfmem_fast.filters.compile_filters`; what :func:`search`'s ``filters``
            become): each filtered query searches only its selected rows.

    Returns:
        TensorSearchResult, or the SearchResult fields as a dict (``host_output``).

    Raises:
        ValueError: ``config.lexical_weight > 0`` without ``query_texts``, or on a view
            without a bank snapshot (no texts to score).
    """
    reranker = resolve_reranker(config)
    b = int(Q.shape[0])
    query_texts = check_query_texts(query_texts, b, config)
    if query_texts is not None and (view.snapshot is None or view.snapshot.lexical is None):
        raise ValueError("query_texts needs a view of a bank snapshot with a lexical index (this view has none)")
    bank_max = 0
    if chunk_hints is None:  # offsets_cpu is a host tensor: no device synchronisation
        off = view.offsets_cpu
        bank_max = int((off[1:] - off[:-1]).max()) if off.shape[0] > 1 else 0
    parts: list[dict[str, Any]] = []
    host: dict[str, np.ndarray] = {}
    on_host = isinstance(Q, np.ndarray) or Q.device.type == "cpu"
    # a host chunk without texts, re-ranker, merge or profile prior: numpy between the backend calls
    fast = (HOST_FAST_PATH and host_output and on_host and query_texts is None and reranker is None and pools is None
            and config.profile_weight == 0 and config.merge == "none" and not config.context_on)  # fmt: skip
    # the context score on a host chunk: numpy between the backend calls too (_context_chunk_host)
    ctx_fast = (HOST_FAST_PATH and host_output and on_host and config.context_on and reranker is None and pools is None
                and config.profile_weight == 0 and config.merge == "none")  # fmt: skip
    one = b <= max_batch  # (one chunk: the whole batch, without a slice's dispatch)
    for j, c0 in enumerate(range(0, max(b, 1), max_batch)):
        ml, work = chunk_hints[j] if chunk_hints is not None and j < len(chunk_hints) else (bank_max, None)
        Qc, sc = (Q, qseg) if one else (Q[c0 : c0 + max_batch], qseg[c0 : c0 + max_batch])
        sel_c = _chunk_selection(selection, c0, max_batch)
        if fast:
            part = _host_chunk(backend, view, Qc, sc, ml, work, config, mode, router, sel_c)
        elif ctx_fast:
            tx = None if query_texts is None else query_texts[c0 : c0 + max_batch]
            # (no torch operation on a backend with the fused kernels and no filter: threads left alone)
            torch_free = (backend.host_torch_free and backend.has_fused_topk and sel_c is None
                          and (mode == "dense" or backend.fused_driver()))  # fmt: skip
            with limit_torch_threads(work, backend.device) if work is not None and not torch_free else nullcontext():
                part = _context_chunk_host(backend, view, _host_in(Qc, np.float32, torch.float32),
                                           _host_in(sc, np.int64, torch.int64), ml, config, mode, router, sel_c, tx)  # fmt: skip
        else:
            # a small chunk runs with one torch thread on the CPU (rfmem_fast.threads, README "Threads")
            with limit_torch_threads(work, backend.device) if work is not None else nullcontext():
                part = _search_chunk(
                    backend, view, _tensor_in(Qc), _tensor_in(sc), ml, config, mode, router, reranker, pools,
                    host=host_output and on_host, texts=None if query_texts is None else query_texts[c0 : c0 + max_batch],
                    sel=sel_c,
                )  # fmt: skip
        if not host_output:
            parts.append(part)
            continue
        if fast or ctx_fast:  # numpy already, and whether its rows hold padding
            part = _host_fields(part[0], view.snapshot, part[1], part[2])
        else:
            part = _host_fields({k: v.cpu().numpy() for k, v in part.items()}, view.snapshot)
        if b <= max_batch:
            return part
        if not host:  # written in place: no second copy of a huge batch
            host = {k: np.empty((b,) + a.shape[1:], dtype=a.dtype) for k, a in part.items()}
        for k, a in part.items():
            host[k][c0 : c0 + a.shape[0]] = a
    if host_output:
        return host
    cat = parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in _TENSOR_FIELDS}
    return TensorSearchResult(
        snapshot=view.snapshot, mode=mode, backend=backend.name, config=config, **cat
    )


def _chunk_selection(selection: RowSelection | None, c0: int, max_batch: int) -> RowSelection | None:
    """The selection of the chunk of queries ``c0 .. c0 + max_batch - 1`` (None when none is filtered)."""
    if selection is None:
        return None
    part = selection if c0 == 0 and max_batch >= selection.qsel.shape[0] else selection.take(slice(c0, c0 + max_batch))
    return part if part.any() else None


def _search_chunk(
    be: Backend,
    view: Any,
    Q: torch.Tensor,
    qseg: torch.Tensor,
    max_len: int,
    config: RFMemConfig,
    mode: str,
    router: Router | None = None,
    reranker: Any = None,
    pools: list | None = None,
    host: bool = False,
    texts: list | None = None,
    sel: RowSelection | None = None,
) -> dict[str, torch.Tensor]:
    """One chunk of :func:`search_tensors`: the tensor fields for unit queries ``Q`` [c, d] on the device.

    ``host``: the chunk lives in host memory and its results go to the host anyway
    (``search(..., output="numpy")`` on the CPU), so host reads are free: the spec's
    thresholds route with numpy (torch's per-operation dispatch costs ~0.1 ms on a
    one-query batch) and a chunk where no query recollects skips the beam driver. Else
    (device-resident batches) nothing here reads a device value on the host (except
    with query texts: the lexical channel runs on the host, :func:`_hybrid`)."""
    b = Q.shape[0]
    dev = Q.device
    if config.profile_weight > 0:  # the profile prior (rfmem_fast.routing.profile)
        Q = fold_profile(Q, qseg, view_profiles(view), config.profile_weight)
    depth = reranker.depth if reranker is not None else (pools[0] if pools is not None else 0)
    k0, probe_k, out_k = _widths(config, max_len, depth)
    lexical = texts is not None and config.lexical_weight > 0
    k_scan = k0
    D = max(config.lexical_depth, config.out_k, config.probe_k)
    if lexical and config.fusion == "rrf":  # the dense ranked list of rrf: the top D
        k_scan = max(k0, min(D, max_len))
    # (a filtered batch fuses on the host: the one-pass kernels take no row selection)
    one_pass = lexical and be.has_fused_topk and config.fusion != "rrf" and sel is None
    if lexical and not one_pass and config.fusion != "rrf":
        # a deeper exact dense list: a lower s_K, so fewer lexical hits to re-score
        k_scan = max(k0, min(HYBRID_DENSE_DEPTH, max_len))
    skw = {} if sel is None else {"sel": sel}  # filtered search: every top-k call applies the selection
    hyb = None
    ctx = config.context_on  # the context score (rfmem_fast.context): every row's scan score too
    scan = boosts = lex_rows = None
    if ctx and be.has_fused_topk and sel is None:  # the probe, the fused list and every row's scan score in one pass
        seg_np = qseg.cpu().numpy()
        (p_sc, p_rows, mean, ent, count), hyb, scan, boosts, lex_rows = _context_probe(
            be, view, Q, seg_np, texts if lexical else None, config, k_scan, probe_k, max(probe_k, out_k)
        )
    elif one_pass:  # the dense probe and the fused top-k in one scan (Backend.hybrid_probe)
        seg_np = qseg.cpu().numpy()
        kh = _KernelHits.of(be, view, seg_np, texts)
        before = config.fusion in ONE_PASS_FUSIONS  # boosts known before the scan
        k_f = max(probe_k, out_k)
        hx = kh.boosts(config, None) if before else np.zeros(kh.hval.shape[0])
        p_sc, p_rows, mean, ent, count, fr, ff, fd, fl, hf = be.hybrid_probe(
            view, Q, qseg, k_scan, probe_k, config.temperature, config.entropy, kh.hptr, kh.hrows, hx, kh.hval,
            k_f if before else 0,
        )
        if before:
            hyb = _Hybrid(rows=fr, fused=ff, dense=fd.astype(np.float64), lex=fl,
                          hits=lambda: kh.hit_list(view, seg_np))  # fmt: skip
        else:
            hyb = _hybrid_recorded(be, view, Q, seg_np, p_sc, p_rows, kh, hf, config, k_f)
    else:
        p_sc, p_rows, mean, ent, count = be.probe(
            view, Q, qseg, k_scan, probe_k, config.temperature, config.entropy, **skw
        )
    p_sc_all, p_rows_all = p_sc, p_rows
    if k_scan != k0:  # what the other paths see: the probe of width k0 (a prefix)
        p_sc, p_rows = p_sc[:, :k0].contiguous(), p_rows[:, :k0].contiguous()
    if mode == "rfmem" and router is not None:  # a router object / file: on the host
        routes, rule = (torch.from_numpy(a).to(dev) for a in _routes_host(mode, router, config, b, p_sc[:, :probe_k],
                                                                          mean, ent, count))  # fmt: skip
    elif mode == "rfmem" and host:  # numpy: a few us, where torch's dispatches cost ~0.1 ms
        routes, rule = (torch.from_numpy(a) for a in _routes_host(mode, None, config, b, None, mean.numpy(),
                                                                  ent.numpy(), count.numpy()))  # fmt: skip
    elif mode == "rfmem":
        routes, rule = route_tensor(mean, ent, count, config)  # on the device: no host copy
    else:
        forced = (FAMILIARITY, RULE_FORCED_DENSE) if mode == "dense" else (RECOLLECTION, RULE_FORCED_RECOLLECTION)
        routes = torch.full((b,), forced[0], dtype=torch.int64, device=dev)
        rule = torch.full((b,), forced[1], dtype=torch.int64, device=dev)
    rows = p_rows[:, :out_k]
    scores = p_sc[:, :out_k].to(torch.float32)
    lex_hits = None
    if lexical:  # the Familiarity path's list (and the probe's) become the fused top-k
        k_f = max(probe_k, out_k)
        kd = min(D, k_scan) if config.fusion == "rrf" else k_scan
        if hyb is None:
            hyb = _hybrid(view, Q, qseg, p_sc_all, p_rows_all, texts, config, k_f, kd, be, sel, want_boosts=ctx)
            boosts, lex_rows = hyb.boost_rows, hyb.lex_rows
        lex_hits = hyb  # its hit_list() when the final hits need their lexical scores looked up
        rows = torch.from_numpy(np.ascontiguousarray(hyb.rows[:, :out_k])).to(dev)
        scores = torch.from_numpy(hyb.fused[:, :out_k].astype(np.float32)).to(dev)
    elif texts is not None:  # weight 0: the texts only fill lexical_scores
        lex_hits = _lexical_hits(view.snapshot, qseg.cpu().numpy(), texts, sel)
        lex_rows = [None if h is None else h[1] for h in lex_hits]
    fam_dense = scores if hyb is None else torch.from_numpy(hyb.dense[:, :out_k]).to(dev)
    ctx_sc = ctx_known = None
    if ctx:  # the Familiarity path's list: the exact top out_k by the context score
        seg_np = qseg.cpu().numpy()
        Qh = Q.detach().to(torch.float32).cpu().numpy()
        if scan is None:
            scan = be.segment_scores(view, Q, seg_np)
        c_rows, c_ctx, c_base, c_dense, c_lex = context_topk(view.snapshot, view._memo, Qh, seg_np, scan, boosts, config,
                                                             out_k, sel, view.row_norm_max,
                                                             None if texts is None else lex_rows)  # fmt: skip
        rows = torch.from_numpy(c_rows).to(dev)
        scores = torch.from_numpy(c_base.astype(np.float32)).to(dev)
        ctx_sc = torch.from_numpy(c_ctx.astype(np.float32)).to(dev)
        fam_dense = torch.from_numpy(c_dense).to(dev)
        ctx_known = (fam_dense, torch.from_numpy(c_lex).to(dev))
    rounds = torch.zeros(b, dtype=torch.int64, device=dev)
    reco = routes == RECOLLECTION
    out = None
    dense_known = False
    # a host chunk where no query recollects skips the beam driver's set-up (a device
    # chunk would need a host synchronisation to know: it calls the driver, which stops
    # at its first round's check)
    if mode != "dense" and (not host or bool(reco.any())):
        cfg = config if out_k == config.out_k else config.replace(out_k=out_k)
        out = _recollect(be, view, Q, qseg, cfg, (p_sc, p_rows), reco, sel)
        if config.merge == "none":  # the authors' output
            rows = torch.where(reco[:, None], out.rows.to(dev), rows)
            scores = torch.where(reco[:, None], out.scores.to(dev), scores)
            if out.dense is not None and hyb is None:  # the driver's exact dense scores: nothing to re-score
                fam_dense = torch.where(reco[:, None], out.dense.to(dev), fam_dense)
                dense_known = True
        else:
            rows, scores = _merged(view, Q, p_rows, out.hit_rows, reco, rows, scores, out_k, config)
        rounds = out.rounds.to(dev)
    # None: every query kept the Familiarity path, or the driver gave its hits' dense scores
    fam_ok = ~reco if out is not None and not dense_known else None
    if reranker is not None or pools is not None:
        hits = out.hit_rows.to(dev) if out is not None else None
        pool = _pools(view, Q, qseg, p_rows[:, : max(depth, 1)], hits, routes)
        if pools is not None:
            pools.append(pool)
        if reranker is not None:
            cand, keep, feats = pool
            sc = reranker.score(feats)
            order_key = np.broadcast_to(np.arange(cand.shape[1])[None, :], cand.shape)
            r_rows, r_sc = select_top(sc, sc, keep, order_key, cand, out_k)
            rows = torch.from_numpy(r_rows).to(dev)
            scores = torch.from_numpy(r_sc).to(dev)
            fam_ok = torch.zeros(b, dtype=torch.bool, device=dev)
    # exact re-scoring of hits whose dense score is not known yet (recollected, re-ranked,
    # rrf's lexical-only ones): on the host path, or whenever the lexical channel ran
    rescore = (host or lex_hits is not None) and not (out is None and reranker is None and (hyb is None or config.fusion != "rrf"))
    if ctx_known is not None and out is None:  # the context list: its exact dense and lexical scores are known
        dense_sc, lex_sc = ctx_known
    elif hyb is not None and out is None and reranker is None and config.fusion != "rrf" and not ctx:
        # the final list is the fused one, whose exact dense and lexical scores are known
        dense_sc = torch.from_numpy(hyb.dense[:, :out_k].astype(np.float32)).to(dev)
        lex_sc = torch.from_numpy(hyb.lex[:, :out_k].astype(np.float32)).to(dev)
    else:
        if isinstance(lex_hits, _Hybrid):
            lex_hits = lex_hits.hit_list()
        dense_sc, lex_sc = _hit_scores(view, Q, rows, fam_ok, fam_dense, lex_hits, rescore, be.memory_budget,
                                       on_host=host or lex_hits is not None)  # fmt: skip
    if hyb is not None:
        probe_rows = torch.from_numpy(np.ascontiguousarray(hyb.rows[:, :probe_k])).to(dev)
        probe_scores = torch.from_numpy(hyb.fused[:, :probe_k].astype(np.float32)).to(dev)
    else:
        probe_rows, probe_scores = p_rows[:, :probe_k], p_sc[:, :probe_k].to(torch.float32)
    if ctx_sc is None:
        ctx_sc = torch.full((b, out_k), float("nan"), dtype=torch.float32, device=dev)
    elif out is not None:  # a query that recollected returns that path's hits: no context score
        ctx_sc = torch.where(reco[:, None], torch.full_like(ctx_sc, float("nan")), ctx_sc)
    return dict(
        rows=_pad_t(rows, config.out_k, -1),
        scores=_pad_t(scores, config.out_k, float("-inf")),
        route=routes,
        mean=mean.to(torch.float64),
        entropy=ent.to(torch.float64),
        rule=rule,
        rounds=rounds,
        probe_rows=_pad_t(probe_rows, config.probe_k, -1),
        probe_scores=_pad_t(probe_scores, config.probe_k, float("-inf")),
        dense_scores=_pad_t(dense_sc, config.out_k, float("nan")),
        lexical_scores=_pad_t(lex_sc, config.out_k, float("nan")),
        context_scores=_pad_t(ctx_sc, config.out_k, float("nan")),
    )


def _widths(config: RFMemConfig, max_len: int, depth: int = 0) -> tuple[int, int, int]:
    """A chunk's top-k widths ``(k0, probe_k, out_k)``: the probe scans ``k0`` = the
    widest of probe_k, out_k, the beam's ``beam_width * fanout`` and a re-ranker / merge
    ``depth``, never wider than the longest queried segment ``max_len`` (a wider top-k
    is padding only) but at least ``beam_width * fanout``; probe_k and out_k capped at k0."""
    bf = config.beam_width * config.fanout
    k0 = max(min(max(config.probe_k, config.out_k, bf, depth), max_len), bf)
    return k0, min(config.probe_k, k0), min(config.out_k, k0)


def _routes_host(mode: str, router: Router | None, config: RFMemConfig, b: int, probe_scores: Any, mean: Any,
                 entropy: Any, count: Any) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(routes, rule) int64 [b] on the host: ``router``'s (a router object / file; it
    reads the probe's top ``probe_k`` scores and signals), the config's thresholds
    (:func:`~rfmem_fast.routing.threshold.route`, numpy signals) in mode "rfmem", or
    the route a forced mode ("dense" / "recollection") names."""
    if mode == "rfmem" and router is not None:
        sig = ProbeSignals.from_arrays(probe_scores, mean, entropy, count)
        routes, rule = (np.ascontiguousarray(a, dtype=np.int64) for a in router.route(sig))
        return routes, rule
    if mode == "rfmem":
        return route(mean, entropy, count, config)
    forced = (FAMILIARITY, RULE_FORCED_DENSE) if mode == "dense" else (RECOLLECTION, RULE_FORCED_RECOLLECTION)
    return _filled(b, forced[0], np.int64), _filled(b, forced[1], np.int64)


#: A host chunk without query texts, re-ranker, merge or profile prior runs
#: :func:`_search_chunk_host` (numpy between the backend calls) instead of the general
#: tensor path of :func:`_search_chunk`; both give the same values
#: (``tests/test_search_host_path.py`` runs every mode and backend both ways). False
#: sends every chunk through the general path.
HOST_FAST_PATH = True


def _tensor_in(x: Any) -> torch.Tensor:
    """A chunk's queries / segments as a tensor (a host array shares its memory)."""
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _host_in(x: Any, dtype: type, tdtype: torch.dtype) -> np.ndarray:
    """A chunk's queries / segments as a C-contiguous host array of ``dtype`` (no copy when it is one)."""
    return np.ascontiguousarray(x, dtype=dtype) if isinstance(x, np.ndarray) else host_array(x, tdtype)


def _host_chunk(be: Backend, view: Any, Q: Any, qseg: Any, max_len: int, work: float | None, config: RFMemConfig,
                mode: str, router: Router | None, sel: RowSelection | None) -> tuple:  # fmt: skip
    """A host chunk of :func:`search_tensors` through :func:`_search_chunk_host` (host arrays
    ``Q`` / ``qseg``, or CPU tensors), with one torch thread for a small chunk unless it
    runs no torch operation (a backend whose ``host_torch_free`` holds, in mode "dense" or
    with its fused driver)."""
    Qh, seg = _host_in(Q, np.float32, torch.float32), _host_in(qseg, np.int64, torch.int64)
    fused = mode != "dense" and be.fused_driver()  # (read once: RFMEM_BEAM_DRIVER costs an environment look-up)
    if work is None or (be.host_torch_free and (mode == "dense" or fused)):
        return _search_chunk_host(be, view, Qh, seg, max_len, config, mode, router, sel, fused)
    with limit_torch_threads(work, be.device):
        return _search_chunk_host(be, view, Qh, seg, max_len, config, mode, router, sel, fused)


def _search_chunk_host(be: Backend, view: Any, Qh: np.ndarray, seg: np.ndarray, max_len: int,
                       config: RFMemConfig, mode: str, router: Router | None, sel: RowSelection | None,
                       fused: bool | None = None) -> tuple[dict[str, np.ndarray], bool, bool]:  # fmt: skip
    """:func:`_search_chunk` on a host chunk without texts, re-ranker, merge or profile
    prior: the same steps and values (probe, routing, the beam driver, the hits' exact
    dense scores) with numpy arrays between the backend calls
    (:meth:`~rfmem_fast.backends.base.Backend.probe_host`,
    :meth:`~rfmem_fast.backends.base.Backend.recollect_host`) instead of torch tensors:
    a single query pays ~1 us per step rather than torch's ~3-5 us per dispatch, and,
    right after a kernel's scan has evicted the caches, ~5 us per numpy call where a
    torch call costs 10-20 us (bench/bench_single_query.py).

    Args:
        Qh: float32 [c, d] C-contiguous unit queries; seg: int64 [c] their segments;
        fused: ``be.fused_driver()`` when the caller read it (None: read it if needed);
        the others as :func:`_search_chunk`.

    Returns:
        (:func:`_host_fields`' input: host arrays of the tensor fields; whether the rows and
        the probe rows are free of padding: :func:`_unpadded`, which the dense scores needed).
    """
    b = Qh.shape[0]
    k0, probe_k, out_k = _widths(config, max_len)
    W, P = config.out_k, config.probe_k
    ps, pr, mean_np, ent_np, cnt_np = be.probe_host(view, Qh, seg, k0, probe_k, config.temperature, config.entropy, sel)
    if ps.dtype is not _F32 and ps.dtype != _F32:
        ps = ps.astype(np.float32)
    routes, rule = _routes_host(mode, router, config, b, None if router is None else ps[:, :probe_k], mean_np, ent_np,
                                cnt_np)  # fmt: skip
    probe_rows, probe_scores = _fit(pr, probe_k, P, -1), _fit(ps, probe_k, P, -np.inf)
    rows, scores = _fit(pr, out_k, W, -1), _fit(ps, out_k, W, -np.inf)
    fam_dense = scores
    out = None
    fam_ok = None  # None: every query kept the Familiarity path, or the driver gave its hits' dense scores
    if mode == "rfmem":
        reco = routes == RECOLLECTION
        nreco = int(np.count_nonzero(reco))
    else:  # a forced mode: its route is known
        reco, nreco = None, b if mode == "recollection" else 0
    everyone = nreco == b  # (then the driver's arrays are the result: no selection)
    if nreco:
        cfg = config if out_k == config.out_k else config.replace(out_k=out_k)
        out = _recollect_host(be, view, Qh, seg, cfg, (ps, pr), None if everyone else reco, sel, fused)
        o_rows, o_scores, rounds, o_dense = (_fit(out[0], out_k, W, -1), _fit(out[1], out_k, W, -np.inf), out[2],
                                             None if out[3] is None else _fit(out[3], out_k, W, np.nan))  # fmt: skip
        if not everyone:
            rc = reco[:, None]
            o_rows, o_scores = np.where(rc, o_rows, rows), np.where(rc, o_scores, scores)
            if o_dense is not None:
                o_dense = np.where(rc, o_dense, fam_dense)
        rows, scores = o_rows, o_scores
        if o_dense is not None:
            fam_dense = o_dense
        else:
            fam_ok = np.zeros(b, dtype=np.bool_) if everyone else ~reco
    else:
        rounds = np.zeros(b, dtype=np.int64)
    full = probe_full = _tail_unpadded(probe_rows)
    if rows is not probe_rows:
        full = _tail_unpadded(rows)
    # the hits' exact dense scores: known on the Familiarity path (the probe's) and from
    # the native driver (NaN where there is no hit); the others re-scored exactly (as
    # _hit_scores on the host)
    if fam_ok is None and (full or (out is not None and everyone)):  # no NaN to place: the known scores
        dense = fam_dense.copy() if fam_dense is scores else fam_dense
    else:
        ok = rows >= 0
        keep = ok if fam_ok is None else ok & fam_ok[:, None]
        dense = np.where(keep, fam_dense, np.float32(np.nan)).astype(np.float32, copy=False)
    if out is not None and fam_ok is not None:  # (a hit without a known score: only with fam_ok)
        qi, ci = np.nonzero(ok & np.isnan(dense))
        if qi.shape[0]:
            dense[qi, ci] = exact_pair_scores_np(view.snapshot.vectors, Qh, qi, rows[qi, ci])
    fields = dict(rows=rows, scores=scores, route=routes, mean=mean_np, entropy=ent_np, rule=rule, rounds=rounds,
                  probe_rows=probe_rows, probe_scores=probe_scores, dense_scores=dense,
                  lexical_scores=_filled((b, W), np.nan, np.float32),
                  context_scores=_filled((b, W), np.nan, np.float32))  # fmt: skip
    return fields, full, probe_full


def _context_chunk_host(be: Backend, view: Any, Qh: np.ndarray, seg: np.ndarray, max_len: int, config: RFMemConfig,
                        mode: str, router: Router | None, sel: RowSelection | None,
                        texts: list | None) -> tuple[dict[str, np.ndarray], bool, bool]:  # fmt: skip
    """:func:`_search_chunk` for a host chunk with the context score on (no re-ranker, merge
    or profile prior), numpy between the backend calls: the probe (with every row's scan
    score: :func:`_context_probe` on a backend with ``has_fused_topk`` and no filter, else
    ``Backend.probe_host`` then ``Backend.segment_scores``), the fused list with the
    lexical channel, the routing, the context top-k (:func:`rfmem_fast.context.context_topk`)
    on the Familiarity path and the Recollection path for the queries routed there. The
    same values as the general path (tests/test_context.py runs both).

    Returns:
        as :func:`_search_chunk_host`.
    """
    b = Qh.shape[0]
    k0, probe_k, out_k = _widths(config, max_len)
    W, P = config.out_k, config.probe_k
    lexical = texts is not None and config.lexical_weight > 0
    k_f = max(probe_k, out_k)
    Qt = torch.from_numpy(Qh)
    hyb = boosts = lex_rows = None
    if be.has_fused_topk and sel is None:
        (ps, pr, mean, ent, cnt), hyb, scan, boosts, lex_rows = _context_probe(
            be, view, Qt, seg, texts if lexical else None, config, k0, probe_k, k_f
        )
        ps, pr, mean, ent, cnt = ps.numpy(), pr.numpy(), mean.numpy(), ent.numpy(), cnt.numpy()  # (host tensors)
    else:
        k_scan = max(k0, min(HYBRID_DENSE_DEPTH, max_len)) if lexical else k0  # (a deeper exact dense list for _hybrid)
        ps, pr, mean, ent, cnt = be.probe_host(view, Qh, seg, k_scan, probe_k, config.temperature, config.entropy, sel)
        if lexical:
            hyb = _hybrid(view, Qt, torch.from_numpy(seg), torch.from_numpy(ps), torch.from_numpy(pr), texts, config,
                          k_f, k_scan, be, sel, want_boosts=True)  # fmt: skip
            boosts, lex_rows = hyb.boost_rows, hyb.lex_rows
        scan = be.segment_scores(view, Qh, seg)
    if ps.dtype != _F32:
        ps = ps.astype(np.float32)
    if texts is not None and not lexical:  # weight 0: the texts only fill lexical_scores
        lex_rows = [None if h is None else h[1] for h in _lexical_hits(view.snapshot, seg, texts, sel)]
    routes, rule = _routes_host(mode, router, config, b, None if router is None else ps[:, :probe_k], mean, ent, cnt)
    c_rows, c_ctx, c_base, c_dense, c_lex = context_topk(
        view.snapshot, view._memo, Qh, seg, scan, boosts, config, out_k, sel, view.row_norm_max, lex_rows,
    )  # fmt: skip
    rows, scores = _fit(c_rows, out_k, W, -1), _fit(c_base.astype(np.float32), out_k, W, -np.inf)
    ctx, dense = _fit(c_ctx.astype(np.float32), out_k, W, np.nan), _fit(c_dense, out_k, W, np.nan)
    lex = _fit(c_lex, out_k, W, np.nan)
    if hyb is not None:
        probe_rows, probe_scores = _fit(hyb.rows, probe_k, P, -1), _fit(hyb.fused.astype(np.float32), probe_k, P, -np.inf)
    else:
        probe_rows, probe_scores = _fit(pr, probe_k, P, -1), _fit(ps, probe_k, P, -np.inf)
    rounds = np.zeros(b, dtype=np.int64)
    reco = routes == RECOLLECTION if mode == "rfmem" else np.zeros(b, dtype=np.bool_)
    if reco.any():  # those queries return the Recollection path's hits (no context score)
        everyone = bool(reco.all())
        cfg = config if out_k == config.out_k else config.replace(out_k=out_k)
        level0 = (np.ascontiguousarray(ps[:, :k0]), np.ascontiguousarray(pr[:, :k0]))
        o_rows, o_sc, o_rounds, o_dense = _recollect_host(be, view, Qh, seg, cfg, level0, None if everyone else reco, sel)
        rc = reco[:, None]
        o_rows = _fit(o_rows, out_k, W, -1)
        rows = np.where(rc, o_rows, rows)
        scores = np.where(rc, _fit(o_sc.astype(np.float32), out_k, W, -np.inf), scores)
        ctx = np.where(rc, np.float32(np.nan), ctx)
        rounds = np.where(reco, o_rounds, rounds)
        d_reco = _fit(o_dense, out_k, W, np.nan) if o_dense is not None else np.full((b, W), np.nan, dtype=np.float32)
        qi, ci = np.nonzero(rc & (rows >= 0) & np.isnan(d_reco))
        if qi.shape[0]:
            d_reco[qi, ci] = exact_pair_scores_np(view.snapshot.vectors, Qh, qi, rows[qi, ci])
        dense = np.where(rc, d_reco, dense)
        if lex_rows is not None:
            a_q = view.snapshot.offsets[seg]
            for i in np.flatnonzero(reco).tolist():
                ok = rows[i] >= 0
                lx = lex_rows[i]
                lex[i] = np.nan
                lex[i, ok] = 0.0 if lx is None else lx[rows[i, ok] - a_q[i]]
    fields = dict(rows=rows, scores=scores, route=routes, mean=mean, entropy=ent, rule=rule, rounds=rounds,
                  probe_rows=probe_rows, probe_scores=probe_scores, dense_scores=dense, lexical_scores=lex,
                  context_scores=ctx)  # fmt: skip
    return fields, _unpadded(rows), _unpadded(probe_rows)


def _fit(a: np.ndarray, k: int, width: int, value: Any) -> np.ndarray:
    """The first ``k`` columns of ``a`` [b, w >= k] as a C-contiguous [b, width >= k] array,
    right-padded with ``value`` (``a`` itself when it has exactly ``k`` = ``width`` columns:
    the backends' arrays are C-contiguous)."""
    if a.shape[1] > k:
        a = a[:, :k]
        if a.shape[0] > 1:  # (one row: the cut is C-contiguous already)
            a = np.ascontiguousarray(a)
    if a.shape[1] >= width:
        return a
    out = _filled((a.shape[0], width), value, a.dtype)
    out[:, : a.shape[1]] = a
    return out


def _filled(shape: tuple, value: Any, dtype: Any) -> np.ndarray:
    """A new array of ``shape`` and ``dtype`` filled with ``value`` (np.full's work in two C calls)."""
    out = np.empty(shape, dtype=dtype)
    out.fill(value)
    return out


@dataclass
class _Hybrid:
    """The fused top ``k_f`` of a chunk (host arrays [b, k_f]; -1 / -inf / NaN padding) and
    the per-query lexical scores (:func:`_lexical_hits`)."""

    rows: np.ndarray
    fused: np.ndarray
    dense: np.ndarray
    lex: np.ndarray
    hits: Any  # the list, or a zero-argument function that builds it (read through hit_list)
    boost_rows: list | None = None  # per query: float64 [n_i] every segment row's boost, or None (the context score's)
    lex_rows: list | None = None  # per query: float64 [n_i] every segment row's BM25, or None (the context score's)

    def hit_list(self) -> list:
        """The per-query lexical scores (built on first use when ``hits`` is a function)."""
        if callable(self.hits):
            self.hits = self.hits()
        return self.hits


def _lexical_hits(snap: BankSnapshot, seg: np.ndarray, texts: list, sel: RowSelection | None = None) -> list:
    """Per query: None (no lexical hit) or (first row of its user, float64 [n_u] BM25 of the
    user's rows, the user's document count N): :class:`rfmem_fast.lexical.LexicalIndex`.
    With a selection, a filtered query's hits outside it are dropped (score 0)."""
    lex, off = snap.lexical, snap.offsets
    out: list = []
    for i, t in enumerate(texts):
        qt, qc = lex.encode_query(t)
        if qt.shape[0] == 0:
            out.append(None)
            continue
        u = int(seg[i])
        P = lex.postings(u)
        vec = P.scores(qt, qc)
        if vec is not None and sel is not None:
            allow = sel.allowed(i, int(off[u]), vec.shape[0])
            if allow is not None:
                vec = np.where(allow, vec, 0.0)
                if not vec.any():
                    vec = None
        out.append(None if vec is None else (int(off[u]), vec, P.n_docs))
    return out


def _selected_means(view: Any, sel: RowSelection, seg: np.ndarray, means: np.ndarray) -> np.ndarray:
    """``means`` [b, d] (the users' mean vectors) with each filtered query's row replaced by
    the float64 mean of its selected items (:func:`rfmem_fast.fusion.item_mean` of its
    selected rows; memoised per selection; zero when none)."""
    snap = view.snapshot
    vectors = snap.vectors
    memo = sel._memo.setdefault("means", {})
    out = means.copy()
    for i in np.flatnonzero(sel.qsel >= 0).tolist():
        p = int(sel.qsel[i])
        m = memo.get(p)
        if m is None:
            r = sel.rows[sel.off[p] : sel.off[p + 1]]
            u = int(sel.seg[p])
            items = snap.lexical.postings(u).item_row if snap.lexical is not None and r.shape[0] else None
            m = memo[p] = item_mean(vectors[r], None if items is None else items[r - int(snap.offsets[u])])
        out[i] = m
    return out


def _pad_lists(parts: list, b: int, fill: Any, dtype: Any) -> np.ndarray:
    """[b, max len] array of b 1-D arrays, right-padded with ``fill``."""
    lens = np.fromiter((p.shape[0] for p in parts), np.int64, b)
    E = int(lens.max(initial=0))
    out = np.full((b, E), fill, dtype=dtype)
    if E:
        qi = np.repeat(np.arange(b), lens)
        col = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        out[qi, col] = np.concatenate(parts)
    return out


#: entries of the [queries, user rows] BM25 matrix of one step of :func:`_hybrid` (bounds its memory)
HYBRID_MATRIX_ENTRIES = 1 << 22


def _hybrid(view: Any, Q: torch.Tensor, qseg: torch.Tensor, p_sc: torch.Tensor, p_rows: torch.Tensor, texts: list,
            config: RFMemConfig, k_f: int, kd: int, be: Any, sel: RowSelection | None = None,
            want_boosts: bool = False) -> _Hybrid:  # fmt: skip
    """The fused top ``k_f`` of every query (:mod:`rfmem_fast.fusion`, whose docstring proves it exact).

    rrf: :func:`_hybrid_loop`. convex / adaptive / zscore: batched numpy over the queries,
    in steps of at most :data:`HYBRID_MATRIX_ENTRIES` BM25 entries (queries x their users'
    rows); a backend with ``has_fused_topk`` fuses in its probe's pass instead
    (:func:`_search_chunk`, unfiltered queries). Both give the same rows and scores
    (tests/test_lexical.py). ``sel``: the filtered queries' lexical hits outside their
    selection are dropped before the fusion (the dense list ``p_sc`` / ``p_rows`` is
    already filtered); the per-query statistics (the lexical maximum and top scores,
    zscore's spreads and dense mean) are those of the matching items. ``want_boosts``: also
    the boost of every segment row of each query (``_Hybrid.boost_rows``; convex / adaptive
    / zscore), the context score's."""
    if config.fusion == "rrf":
        return _hybrid_loop(view, Q, qseg, p_sc, p_rows, texts, config, k_f, kd, be.memory_budget, sel)
    snap = view.snapshot
    off = snap.offsets
    seg = qseg.cpu().numpy()
    lens = off[seg + 1] - off[seg]
    b = len(texts)
    parts, a = [], 0
    while a < b:
        c = a + 1
        while c < b and (c + 1 - a) * int(lens[a : c + 1].max()) <= HYBRID_MATRIX_ENTRIES:
            c += 1
        part_sel = None if sel is None else sel.take(slice(a, c))
        parts.append(_hybrid_batched(view, Q[a:c], seg[a:c], p_sc[a:c], p_rows[a:c], texts[a:c], config, k_f, kd,
                                     part_sel, want_boosts))  # fmt: skip
        a = c
    if len(parts) == 1:
        return parts[0]
    return _Hybrid(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("rows", "fused", "dense", "lex")),
                   hits=[h for p in parts for h in p.hits],
                   boost_rows=[x for p in parts for x in p.boost_rows] if want_boosts else None,
                   lex_rows=[x for p in parts for x in p.lex_rows] if want_boosts else None)  # fmt: skip


def _hybrid_batched(view: Any, Q: torch.Tensor, seg: np.ndarray, p_sc: torch.Tensor, p_rows: torch.Tensor, texts: list,
                    config: RFMemConfig, k_f: int, kd: int, sel: RowSelection | None = None,
                    want_boosts: bool = False) -> _Hybrid:  # fmt: skip
    """convex / adaptive / zscore fusion of b queries with one BM25 matrix V [b, longest user]
    (see :func:`_hybrid_loop`); ``want_boosts``: every row's boost too (:func:`_hybrid`)."""
    snap = view.snapshot
    lex, off = snap.lexical, snap.offsets
    b = len(texts)
    a_q = off[seg]
    n_q = off[seg + 1] - a_q
    W = max(int(n_q.max(initial=0)), 1)
    n_docs = np.zeros(b, dtype=np.int64)
    n_match = n_q.copy()  # the items (zscore's n): a segment's rows less its extra chunk rows
    chunked = []  # (query, its user's postings) of the queries whose user has chunked items
    flat, wts = [], []
    for i, t in enumerate(texts):
        qt, qc = lex.encode_query(t)
        if qt.shape[0] == 0:
            continue
        P = lex.postings(int(seg[i]))
        n_match[i] = P.n_items
        got = P.postings_for(qt, qc)
        if got is not None:
            n_docs[i] = P.n_docs
            flat.append(got[0] + i * W)
            wts.append(got[1])
            if P.item_row is not None:
                chunked.append((i, P))
    # V: each item's BM25 on its own row (the postings' rows), 0 on extra chunk rows
    if flat:  # per entry, the weights are summed in query-term order (as UserPostings.scores)
        V = np.bincount(np.concatenate(flat), weights=np.concatenate(wts), minlength=b * W).reshape(b, W)
    else:
        V = np.zeros((b, W))
    allows = {}
    if sel is not None:  # filtered queries: their hits outside the selection dropped
        for i in np.flatnonzero(sel.qsel >= 0).tolist():
            allow = allows[i] = sel.allowed(i, int(a_q[i]), int(n_q[i]))
            V[i, : n_q[i]] *= allow
            P = lex.postings(int(seg[i])) if n_q[i] else None
            n_match[i] = int(allow.sum() if P is None or P.is_item is None else (allow & P.is_item).sum())
    lex_max = V.max(axis=1)
    ps = p_sc[:, :kd].cpu().numpy().astype(np.float64)
    pr = p_rows[:, :kd].cpu().numpy()
    valid = pr >= 0
    # the per-query statistics: over items (each once, on its own row)
    top = np.zeros((b, TOP_LEXICAL))
    if config.fusion == "adaptive":
        m = min(TOP_LEXICAL, W)
        t = -np.partition(-V, m - 1, axis=1)[:, :m] if W > m else V.copy()
        top[:, :m] = -np.sort(-t, axis=1)[:, :m]
    lex_std = dense_gap = None
    if config.fusion == "zscore":  # both channels' spreads (rfmem_fast.fusion, "zscore")
        means = user_means(view, seg)
        if sel is not None:
            means = _selected_means(view, sel, seg, means)
        mean_d = np.einsum("ij,ij->i", Q.detach().to(torch.float64).cpu().numpy(), means)
        # sums in row order, sequentially (cumsum; zero padding adds nothing): the kernels' order
        lex_std, dense_gap = zscore_stats(np.cumsum(V, axis=1)[:, -1], np.cumsum(V * V, axis=1)[:, -1],
                                          np.maximum(n_match, 1).astype(np.float64), mean_d, ps[:, 0], valid[:, 0])
    for i, P in chunked:  # every row of a chunked item: the item's BM25 (rfmem_fast.lexical)
        n = int(n_q[i])
        V[i, :n] = P.scatter(V[i, :n]) if i not in allows else P.scatter(V[i, :n]) * allows[i]
    hits = [(int(a_q[i]), V[i, : n_q[i]], int(n_docs[i])) if lex_max[i] > 0 else None for i in range(b)]
    loc = np.where(valid, pr - a_q[:, None], 0)
    lex_d = np.where(valid, np.take_along_axis(V, loc, axis=1), 0.0)
    stats = LexicalStats(lex_max, top, n_docs, lex_std, dense_gap)
    boost = BOOSTS[config.fusion]
    boost_rows = lex_rows = None
    if want_boosts:  # every row's boost (0 where no lexical hit), as the fused scores below use it, and BM25
        BX = boost(V, stats, config)
        boost_rows = [BX[i, : n_q[i]] if lex_max[i] > 0 else None for i in range(b)]
        lex_rows = [V[i, : n_q[i]] if lex_max[i] > 0 else None for i in range(b)]
    fd = np.where(valid, ps + boost(lex_d, stats, config), -np.inf)
    tau = -np.partition(-fd, k_f - 1, axis=1)[:, k_f - 1] if kd >= k_f else np.full(b, -np.inf)
    s_last = np.where(valid[:, -1], ps[:, -1], -np.inf)
    M = V > 0
    qv, cv = np.nonzero(valid)
    M[qv, loc[qv, cv]] = False  # the dense list's rows: not extras
    qe, le = np.nonzero(M)  # lexical hits outside the dense list, by query then row
    lexe = V[qe, le]
    xe = boost(lexe[:, None], stats.take(qe), config)[:, 0]
    keep = s_last[qe] + xe >= tau[qe]  # the bound of the fusion docstring
    qe, le, lexe, xe = qe[keep], le[keep], lexe[keep], xe[keep]
    re = le + a_q[qe]
    de = np.zeros(qe.shape[0])
    if qe.shape[0]:
        # screen with float32 scores f and their bound |f - RN32(q.x)| <= B(q) (any
        # summation order: depth d, rfmem_fast.backends.exact): a hit whose fused score
        # cannot reach tau even at f + B is dropped without its exact score
        Qh = Q.detach().to(torch.float32).cpu().numpy()
        f = _screen_scores(snap.vectors, off, Qh, seg, qe, re)
        q64 = Qh.astype(np.float64)
        qn = np.sqrt(np.einsum("ij,ij->i", q64, q64)) * (1.0 + 2.0**-30)
        Bq = (scan_error_coef(Qh.shape[1]) * view.row_norm_max) * qn + abs_error_term(Qh.shape[1])
        near = np.nextafter(f + Bq[qe], np.inf) + xe >= tau[qe]
        qe, re, lexe, xe = qe[near], re[near], lexe[near], xe[near]
        de = exact_pair_scores_np(snap.vectors, Qh, qe, re).astype(np.float64)
    fe = de + xe
    cnt = np.bincount(qe, minlength=b)
    E = int(cnt.max(initial=0))
    col = np.arange(qe.shape[0]) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    erows = np.full((b, E), -1, dtype=np.int64)
    efused = np.full((b, E), -np.inf)
    edense = np.full((b, E), np.nan)
    elex = np.zeros((b, E))
    erows[qe, col], efused[qe, col], edense[qe, col], elex[qe, col] = re, fe, de, lexe
    rows = np.concatenate([pr, erows], axis=1)
    fused = np.concatenate([fd, efused], axis=1)
    dense = np.concatenate([np.where(valid, ps, np.nan), edense], axis=1)
    lexc = np.concatenate([lex_d, elex], axis=1)
    sel = top_by_score_row(fused, rows, k_f)
    ri = np.arange(b)[:, None]
    f_sel, r_sel = fused[ri, sel], rows[ri, sel]
    ok = (r_sel >= 0) & (f_sel > -np.inf)
    return _Hybrid(rows=np.where(ok, r_sel, -1), fused=np.where(ok, f_sel, -np.inf),
                   dense=np.where(ok, dense[ri, sel], np.nan), lex=np.where(ok, lexc[ri, sel], np.nan), hits=hits,
                   boost_rows=boost_rows, lex_rows=lex_rows)  # fmt: skip


class _SparseBM25:
    """One query's BM25 over its user's local rows, held as its hits (ascending local rows
    int32 [h], BM25 float64 [h]); ``v[idx]`` reads like the dense vector (0 elsewhere)."""

    __slots__ = ("rows", "vals")

    def __init__(self, rows: np.ndarray, vals: np.ndarray) -> None:
        self.rows, self.vals = rows, vals

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx)
        pos = np.minimum(np.searchsorted(self.rows, idx), self.rows.shape[0] - 1)
        return np.where(self.rows[pos] == idx, self.vals[pos], 0.0)


@dataclass
class _KernelHits:
    """The lexical hits of b queries from ``Backend.bm25_hits`` (CSR over the queries: hptr
    int64 [b + 1], ascending local rows hrows int32 [H], BM25 hval float64 [H]) and their
    :class:`rfmem_fast.fusion.LexicalStats` parts (s1 / s2: sums of the BM25 and of its
    squares in row order, for "zscore")."""

    hptr: np.ndarray
    hrows: np.ndarray
    hval: np.ndarray
    lex_max: np.ndarray
    top: np.ndarray
    s1: np.ndarray
    s2: np.ndarray
    n_docs: np.ndarray
    n_items: np.ndarray

    @classmethod
    def of(cls, be: Any, view: Any, seg: np.ndarray, texts: list) -> "_KernelHits":
        """Tokenise the b query texts and take their hits in their users' postings.

        The kernel scores items on their own rows (the postings' rows), so the statistics
        (max, top, s1, s2) count each item once; the hits are then scattered to every row
        of a chunked item (:meth:`rfmem_fast.lexical.UserPostings.scatter_hits`)."""
        lex = view.snapshot.lexical
        off = view.snapshot.offsets
        b = len(texts)
        slot: dict[int, int] = {}
        users: list = []
        plist: list = []
        quser = np.full(b, -1, dtype=np.int64)
        n_docs = np.zeros(b, dtype=np.int64)
        n_items = (off[seg + 1] - off[seg]).astype(np.int64)
        terms, counts = [], []
        qptr = np.zeros(b + 1, dtype=np.int64)
        for i, t in enumerate(texts):
            qt, qc = lex.encode_query(t)
            if qt.shape[0] == 0:
                qptr[i + 1] = qptr[i]
                continue
            u = int(seg[i])
            j = slot.get(u)
            if j is None:
                P = lex.postings(u)
                j = slot[u] = len(users)
                users.append((P.terms, P.ptr, P.rows, P.weight, P.n_rows))
                plist.append(P)
            n_docs[i] = plist[j].n_docs
            n_items[i] = plist[j].n_items
            quser[i] = j
            terms.append(qt)
            counts.append(qc)
            qptr[i + 1] = qptr[i] + qt.shape[0]
        if len(terms) == 1:
            qterms, qcnt = terms[0], counts[0]
        elif terms:
            qterms, qcnt = np.concatenate(terms), np.concatenate(counts)
        else:
            qterms, qcnt = np.zeros(0, dtype=np.int32), np.zeros(0)
        got = list(be.bm25_hits(users, quser, qterms, qcnt, qptr))
        if any(P.chunk_ptr is not None for P in plist):
            hp, hr, hv = got[:3]
            rows, vals = [], []
            for i in range(b):
                r, v = hr[hp[i] : hp[i + 1]], hv[hp[i] : hp[i + 1]]
                if quser[i] >= 0:
                    r, v = plist[quser[i]].scatter_hits(r, v)
                rows.append(r)
                vals.append(v)
            ptr = np.zeros(b + 1, dtype=np.int64)
            np.cumsum([r.shape[0] for r in rows], out=ptr[1:])
            got[:3] = ptr, np.concatenate(rows).astype(np.int32, copy=False), np.concatenate(vals).astype(np.float64)
        return cls(*got, n_docs=n_docs, n_items=n_items)

    def boosts(self, config: RFMemConfig, extra: tuple | None) -> np.ndarray:
        """float64 [H] the boost of every hit, :data:`rfmem_fast.fusion.BOOSTS` of ``config.fusion``;
        ``extra``: (lex_std, dense_gap) [b] for "zscore", else None."""
        stats = LexicalStats(self.lex_max, self.top, self.n_docs, *(extra or (None, None)))
        boost = BOOSTS[config.fusion]
        b = self.hptr.shape[0] - 1
        if b == 1:  # one query: its hits as one row [1, H] (no per-hit copy of its statistics)
            hx = boost(self.hval[None, :], stats, config)[0]
        elif self.hval.shape[0]:
            # queries x their hits, padded [c, E], in steps of at most HYBRID_MATRIX_ENTRIES:
            # the per-query factors (sharpness, spreads) once per query, not once per hit
            lens = np.diff(self.hptr)
            qi = np.repeat(np.arange(b), lens)
            col = np.arange(qi.shape[0]) - np.repeat(self.hptr[:-1], lens)
            E = int(lens.max())
            hx = np.empty(qi.shape[0])
            step = max(1, HYBRID_MATRIX_ENTRIES // max(E, 1))
            for a in range(0, b, step):
                c = min(b, a + step)
                h0, h1 = int(self.hptr[a]), int(self.hptr[c])
                M = np.zeros((c - a, E))
                M[qi[h0:h1] - a, col[h0:h1]] = self.hval[h0:h1]
                part = boost(M, stats.take(np.arange(a, c)), config)
                hx[h0:h1] = part[qi[h0:h1] - a, col[h0:h1]]
        else:
            hx = np.zeros(0)
        return np.ascontiguousarray(hx, dtype=np.float64)

    def hit_list(self, view: Any, seg: np.ndarray) -> list:
        """The per-query lexical scores in :func:`_lexical_hits`' form (a sparse vector each)."""
        a_q = view.snapshot.offsets[seg]
        p, r, v = self.hptr, self.hrows, self.hval
        return [(int(a_q[i]), _SparseBM25(r[p[i] : p[i + 1]], v[p[i] : p[i + 1]]), int(self.n_docs[i]))
                if p[i + 1] > p[i] else None for i in range(p.shape[0] - 1)]  # fmt: skip


def _hybrid_recorded(be: Any, view: Any, Q: torch.Tensor, seg: np.ndarray, p_sc: torch.Tensor, p_rows: torch.Tensor,
                     kh: _KernelHits, hf: np.ndarray, config: RFMemConfig, k_f: int) -> _Hybrid:  # fmt: skip
    """Fusion "zscore" on a backend with ``has_fused_topk``, after ``Backend.hybrid_probe``'s
    pass: the boosts need the exact dense top-1 (:func:`_hybrid_batched`'s statistics, sums in
    row order), then ``Backend.fused_topk`` fuses the probe's exact dense list with the hits,
    reading their recorded scan scores ``hf`` (no second scoring of any row)."""
    ps = p_sc.numpy()  # the native probe's host tensors (has_fused_topk backends run on the CPU)
    pr = p_rows.numpy()
    hx = kh.boosts(config, _zscore_extra(view, Q, seg, ps, pr, kh))
    rows, fused, dense, lexv = be.fused_topk(view, Q, seg, ps, pr, kh.hptr, kh.hrows, hx, kh.hval, k_f, hf=hf)
    return _Hybrid(rows=rows, fused=fused, dense=dense.astype(np.float64), lex=lexv, hits=lambda: kh.hit_list(view, seg))


def _zscore_extra(view: Any, Q: torch.Tensor, seg: np.ndarray, ps: np.ndarray, pr: np.ndarray,
                  kh: _KernelHits) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(lex_std, dense_gap) [b] of fusion "zscore" from the kernel's hits and the exact dense
    probe (scores ``ps`` / rows ``pr`` [b, k]): :func:`rfmem_fast.fusion.zscore_stats`."""
    mean_d = np.einsum("ij,ij->i", Q.detach().numpy().astype(np.float64), user_means(view, seg))
    n = np.maximum(kh.n_items, 1).astype(np.float64)  # the items (a chunked item once)
    return zscore_stats(kh.s1, kh.s2, n, mean_d, ps[:, 0], pr[:, 0] >= 0)


def _context_probe(be: Any, view: Any, Q: torch.Tensor, seg: np.ndarray, texts: list | None, config: RFMemConfig,
                   k: int, probe_k: int, k_f: int) -> tuple:  # fmt: skip
    """The probe of an unfiltered chunk with the context score on a backend with
    ``has_fused_topk``: ONE pass (``Backend.hybrid_probe``) gives the dense probe, the fused
    top ``k_f`` (with ``texts``) and the scan score of EVERY row of each query's segment
    (every row passed as a "hit": the kernel records each hit's scan score); no second scan.

    Returns:
        ((scores, rows, mean, entropy, count) of the probe, the fused list as a
        :class:`_Hybrid` or None without texts, :class:`SegmentScores`, the boost of every
        row (float64 [L] aligned with the scan scores) and the BM25 of every row per query
        (float64 [n_i] views, None for a query without a lexical hit), both None without texts).
    """
    off = view.snapshot.offsets
    b = seg.shape[0]
    if b == 1:
        u = int(seg[0])
        ptr = np.array([0, int(off[u + 1] - off[u])], dtype=np.int64)
    else:
        ptr = segment_ptr(off, seg)
    arows = all_row_hits(ptr)
    ax = np.zeros(arows.shape[0])
    aval = np.zeros(arows.shape[0])
    kh = flat = None
    before = texts is not None and config.fusion in ONE_PASS_FUSIONS
    if texts is not None:
        kh = _KernelHits.of(be, view, seg, texts)
        flat = ptr[:-1][np.repeat(np.arange(b), np.diff(kh.hptr))] + kh.hrows
        aval[flat] = kh.hval
        if before:
            ax[flat] = kh.boosts(config, None)
    p_sc, p_rows, mean, ent, count, fr, ff, fd, fl, hf = be.hybrid_probe(
        view, Q, torch.from_numpy(seg), k, probe_k, config.temperature, config.entropy, ptr, arows, ax, aval,
        k_f if before else 0,
    )  # fmt: skip
    hyb = boosts = None
    if texts is not None:
        if before:
            hyb = _Hybrid(rows=fr, fused=ff, dense=fd.astype(np.float64), lex=fl, hits=lambda: kh.hit_list(view, seg))
        else:  # zscore: the boosts need the exact dense top-1 of the probe
            hx = kh.boosts(config, _zscore_extra(view, Q, seg, p_sc.numpy(), p_rows.numpy(), kh))
            ax[flat] = hx
            rows, fused, dense, lexv = be.fused_topk(view, Q, seg, p_sc.numpy(), p_rows.numpy(), kh.hptr, kh.hrows, hx,
                                                     kh.hval, k_f, hf=np.ascontiguousarray(hf[flat]))  # fmt: skip
            hyb = _Hybrid(rows=rows, fused=fused, dense=dense.astype(np.float64), lex=lexv,
                          hits=lambda: kh.hit_list(view, seg))  # fmt: skip
        hp = kh.hptr.tolist()
        boosts = ax  # aligned with the scan scores (rfmem_fast.context.context_topk)
        pl = ptr.tolist()
        lex = [aval[pl[i] : pl[i + 1]] if hp[i + 1] > hp[i] else None for i in range(b)]
    scan = SegmentScores(hf, ptr, *be.scan_score_bound(view))
    return (p_sc, p_rows, mean, ent, count), hyb, scan, boosts, (lex if texts is not None else None)


def _screen_scores(X: np.ndarray, off: np.ndarray, Qh: np.ndarray, seg: np.ndarray, qe: np.ndarray,
                   re: np.ndarray) -> np.ndarray:  # fmt: skip
    """float32 scores (as float64 [m]) of the pairs (query ``qe``, row ``re``), any summation
    order (the bound of :func:`_hybrid_batched` covers it): gathered rows, or, for a user
    with at least half its segment's rows to score, one float32 matrix product of its
    queries with its segment (reads each row once instead of gathering many)."""
    m = qe.shape[0]
    us = seg[qe]
    cnt = np.bincount(us, minlength=int(us.max()) + 1)
    lens = off[1:][: cnt.shape[0]] - off[: cnt.shape[0]]
    big = np.flatnonzero(2 * cnt >= np.maximum(lens, 1) * 1)
    if big.shape[0] == 0:
        return np.einsum("ij,ij->i", X[re], Qh[qe]).astype(np.float64)
    f = np.empty(m)
    in_big = np.isin(us, big)
    small = np.flatnonzero(~in_big)
    if small.shape[0]:
        f[small] = np.einsum("ij,ij->i", X[re[small]], Qh[qe[small]])
    for u in big:
        idx = np.flatnonzero(us == u)
        a, b = int(off[u]), int(off[u + 1])
        qs = np.unique(qe[idx])
        S = Qh[qs] @ X[a:b].T
        f[idx] = S[np.searchsorted(qs, qe[idx]), re[idx] - a]
    return f


def _hybrid_loop(view: Any, Q: torch.Tensor, qseg: torch.Tensor, p_sc: torch.Tensor, p_rows: torch.Tensor, texts: list,
                 config: RFMemConfig, k_f: int, kd: int, memory_budget: int,
                 sel: RowSelection | None = None) -> _Hybrid:  # fmt: skip
    """The fused top ``k_f`` of every query, one query at a time (fusion "rrf"; any fusion).

    Candidates: the backend's exact dense top ``kd`` (``p_sc`` / ``p_rows``, the probe)
    plus the query's lexical hits outside it that can still enter (convex / adaptive:
    ``fl(s_kd + boost) >= tau``, re-scored exactly with
    :func:`rfmem_fast.backends.exact.exact_pair_scores`; rrf: the lexical top D, whose
    dense rank is "absent"). Host numpy; one loop over the queries for their postings."""
    snap = view.snapshot
    seg = qseg.cpu().numpy()
    b = len(texts)
    info = _lexical_hits(snap, seg, texts, sel)
    ps = p_sc[:, :kd].cpu().numpy().astype(np.float64)
    pr = p_rows[:, :kd].cpu().numpy()
    valid = pr >= 0
    rrf_mode = config.fusion == "rrf"
    D = max(config.lexical_depth, config.out_k, config.probe_k)
    lex_d = np.zeros((b, kd))
    lrank_d = np.zeros((b, kd), dtype=np.int64)
    lex_max, top, n_docs = np.zeros(b), np.zeros((b, TOP_LEXICAL)), np.zeros(b, dtype=np.int64)
    empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0)
    ex_rows, ex_lex, ex_rank = [empty_i] * b, [empty_f] * b, [empty_i] * b
    ex_dense = [empty_f] * b
    Qh = None
    for i in range(b):
        h = info[i]
        if h is None:
            continue
        a, vec, n_docs[i] = h
        P = snap.lexical.postings(int(seg[i]))
        loc = pr[i, valid[i]] - a  # the valid entries are a prefix
        lex_d[i, : loc.shape[0]] = vec[loc]
        hit = np.flatnonzero(vec)  # every row of a hit item (rfmem_fast.lexical: a chunked item's rows share its BM25)
        if P.is_item is not None:  # the statistics and the lexical ranks: over items, each once (its own row)
            hit_items = hit[P.is_item[hit]]
        else:
            hit_items = hit
        hs = vec[hit_items]
        lex_max[i] = hs.max()
        t = hs if hs.shape[0] <= TOP_LEXICAL else np.partition(hs, hs.shape[0] - TOP_LEXICAL)[-TOP_LEXICAL:]
        t = np.sort(t)[::-1]
        top[i, : t.shape[0]] = t
        mark = np.zeros(vec.shape[0], dtype=np.bool_)
        mark[loc] = True
        if rrf_mode:
            ranked = hit_items[np.lexsort((hit_items, -hs))[:D]]  # BM25 descending, ties by the smaller row
            rank = np.zeros(vec.shape[0], dtype=np.int64)
            rank[ranked] = np.arange(1, ranked.shape[0] + 1)
            e = ranked[~mark[ranked]]
            if P.item_row is not None:
                # an item's lexical rank goes with each of its rows in the dense list; an item
                # with none there enters by its best chunk (largest exact cosine, ties by
                # the smaller row), whose dense score is then known
                rank = P.scatter(rank)
                in_dense = np.zeros(vec.shape[0], dtype=np.bool_)
                in_dense[P.item_row[loc]] = True
                e = ranked[~in_dense[ranked]]
                de = np.full(e.shape[0], np.nan)
                for j, r in enumerate(e.tolist()):
                    rs = np.concatenate([[r], P.chunk_rows[P.chunk_ptr[r] : P.chunk_ptr[r + 1]]])
                    if rs.shape[0] > 1:
                        if Qh is None:
                            Qh = Q.detach().to(torch.float32).cpu().numpy()
                        sc = exact_pair_scores_np(snap.vectors, Qh, np.full(rs.shape[0], i), rs + a)
                        best = np.lexsort((rs, -sc.astype(np.float64)))[0]
                        e[j], de[j] = rs[best], sc[best]
                ex_dense[i] = de
            lrank_d[i, : loc.shape[0]] = rank[loc]
            ex_rank[i] = rank[e]
        else:
            e = hit[~mark[hit]]
        ex_rows[i], ex_lex[i] = e + a, vec[e]
    erows = _pad_lists(ex_rows, b, -1, np.int64)
    elex = _pad_lists(ex_lex, b, 0.0, np.float64)
    evalid = erows >= 0
    dense_d = np.where(valid, ps, np.nan)
    dense_e = np.full(erows.shape, np.nan)
    if rrf_mode and any(x.shape[0] for x in ex_dense):
        dense_e = _pad_lists([x if x.shape[0] else np.full(r.shape[0], np.nan) for x, r in zip(ex_dense, ex_rows)],
                             b, np.nan, np.float64)  # fmt: skip
    if rrf_mode:
        drank = np.where(valid, np.arange(1, kd + 1)[None, :], 0)
        fd = np.where(valid, rrf(drank, lrank_d, config.lexical_rrf_k), -np.inf)
        erank = _pad_lists(ex_rank, b, 0, np.int64)
        fe = np.where(evalid, rrf(np.zeros_like(erank), erank, config.lexical_rrf_k), -np.inf)
    else:
        stats = LexicalStats(lex_max, top, n_docs)
        boost = BOOSTS[config.fusion]
        fd = np.where(valid, ps + boost(lex_d, stats, config), -np.inf)
        xe = boost(elex, stats, config)
        tau = -np.partition(-fd, k_f - 1, axis=1)[:, k_f - 1] if kd >= k_f else np.full(b, -np.inf)
        s_last = np.where(valid[:, -1], ps[:, -1], -np.inf) if kd else np.full(b, -np.inf)
        keep = evalid & (s_last[:, None] + xe >= tau[:, None])  # the bound of the fusion docstring
        qi, ci = np.nonzero(keep)
        if qi.shape[0]:
            # screen with float32 scores f and their bound |f - RN32(q.x)| <= B(q) (any
            # summation order: depth d, rfmem_fast.backends.exact): a hit whose fused
            # score cannot reach tau even at f + B is dropped without its exact score
            r = erows[qi, ci]
            Qh = Q.detach().to(torch.float32).cpu().numpy()
            f = np.einsum("ij,ij->i", snap.vectors[r], Qh[qi]).astype(np.float64)
            # B(q) of rfmem_fast.backends.exact.query_bounds, in numpy
            qn = np.sqrt(np.einsum("ij,ij->i", Qh.astype(np.float64), Qh.astype(np.float64))) * (1.0 + 2.0**-30)
            Bq = (scan_error_coef(Qh.shape[1]) * view.row_norm_max) * qn + abs_error_term(Qh.shape[1])
            ub = np.nextafter(f + Bq[qi], np.inf)
            near = ub + xe[qi, ci] >= tau[qi]
            keep[qi[~near], ci[~near]] = False
            qi, ci, r = qi[near], ci[near], r[near]
            if qi.shape[0]:
                dense_e[qi, ci] = exact_pair_scores_np(snap.vectors, Qh, qi, r).astype(np.float64)
        fe = np.where(keep, dense_e + xe, -np.inf)
        erows = np.where(keep, erows, -1)
    rows = np.concatenate([pr, erows], axis=1)
    fused = np.concatenate([fd, fe], axis=1)
    dense = np.concatenate([dense_d, dense_e], axis=1)
    lexc = np.concatenate([lex_d, elex], axis=1)
    sel = top_by_score_row(fused, rows, k_f)

    def take(A: np.ndarray) -> np.ndarray:
        return np.take_along_axis(A, sel, axis=1)

    f_sel, r_sel = take(fused), take(rows)
    ok = (r_sel >= 0) & (f_sel > -np.inf)
    return _Hybrid(
        rows=np.where(ok, r_sel, -1), fused=np.where(ok, f_sel, -np.inf), dense=np.where(ok, take(dense), np.nan),
        lex=np.where(ok, take(lexc), np.nan), hits=info,
    )  # fmt: skip


def _hit_scores(view: Any, Q: torch.Tensor, rows: torch.Tensor, fam_ok: torch.Tensor, fam_dense: torch.Tensor,
                hits: list | None, host: bool, memory_budget: int, on_host: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dense_scores, lexical_scores) float32 [b, w] of the final hits ``rows`` (NaN padding).

    A query on the untouched Familiarity path (``fam_ok``) has its hits' dense scores in
    ``fam_dense`` (NaN where unknown); the others (and unknown ones) are re-scored exactly,
    on the host path (``host``); on the device path without texts they stay NaN (no host
    synchronisation). Lexical scores come from ``hits`` (:func:`_lexical_hits`; NaN without).
    ``on_host``: host reads are free (a host chunk, or the lexical channel ran): numpy."""
    dev = rows.device
    if on_host and dev.type == "cpu" and view.snapshot is not None:  # numpy: ~1 us per operation where torch takes ~5
        r = rows.numpy()
        ok = r >= 0
        keep = ok if fam_ok is None else ok & fam_ok.numpy()[:, None]
        dense_np = np.where(keep, fam_dense.numpy(), np.nan).astype(np.float32)
        if host:
            qi, ci = np.nonzero(ok & np.isnan(dense_np))
            if qi.shape[0]:
                Qh = Q.detach().to(torch.float32).numpy()
                dense_np[qi, ci] = exact_pair_scores_np(view.snapshot.vectors, Qh, qi, r[qi, ci])
        lex = np.full(r.shape, np.nan, dtype=np.float32)
        if hits is not None:
            lex[ok] = 0.0
            for i, h in enumerate(hits):
                if h is not None and ok[i].any():
                    lex[i, ok[i]] = h[1][r[i, ok[i]] - h[0]]
        return torch.from_numpy(dense_np), torch.from_numpy(lex)
    valid = rows >= 0
    keep_t = valid if fam_ok is None else valid & fam_ok[:, None]
    dense = fam_dense.to(torch.float32).masked_fill(~keep_t, float("nan"))
    if host:
        need = (valid & torch.isnan(dense)).nonzero()
        if need.shape[0]:
            qi, ci = need[:, 0], need[:, 1]
            dense = dense.clone()
            dense[qi, ci] = exact_pair_scores(view.X, Q, qi, rows[qi, ci], memory_budget)
    if hits is None:
        return dense, torch.full(rows.shape, float("nan"), dtype=torch.float32, device=dev)
    r = rows.cpu().numpy()
    lex = np.full(r.shape, np.nan, dtype=np.float32)
    ok = r >= 0
    lex[ok] = 0.0
    for i, h in enumerate(hits):
        if h is not None and ok[i].any():
            a, vec, _ = h
            lex[i, ok[i]] = vec[r[i, ok[i]] - a]
    return dense, torch.from_numpy(lex).to(dev)


def _merged(
    view: Any,
    Q: torch.Tensor,
    p_rows: torch.Tensor,
    hit_rows: torch.Tensor,
    reco: torch.Tensor,
    rows: torch.Tensor,
    scores: torch.Tensor,
    out_k: int,
    config: RFMemConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` / ``scores`` [b, out_k] with the recollecting queries' rows replaced by
    ``config.merge`` of their probe top-k and recollection hits (on the host, batched:
    :func:`rfmem_fast.routing.merge_paths`)."""
    idx = reco.nonzero().squeeze(1).cpu()
    if idx.numel() == 0:
        return rows, scores
    vectors = view.snapshot.vectors if view.snapshot is not None else view.X.float().cpu().numpy()
    m_rows, m_sc = merge_paths(
        config.merge, p_rows[idx].cpu().numpy(), hit_rows[idx].cpu().numpy(), Q[idx].float().cpu().numpy(),
        vectors, out_k, config.rrf_k, config.rescore_weight,
    )  # fmt: skip
    dev = rows.device
    rows, scores = rows.clone(), scores.clone()
    rows[idx.to(dev)] = torch.from_numpy(np.ascontiguousarray(m_rows, dtype=np.int64)).to(dev)
    scores[idx.to(dev)] = torch.from_numpy(np.ascontiguousarray(m_sc, dtype=np.float32)).to(dev)
    return rows, scores


def _pools(view: Any, Q: torch.Tensor, qseg: torch.Tensor, p_rows: torch.Tensor, hits: torch.Tensor | None,
           routes: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The re-ranker's candidate pools of a chunk on the host (:func:`rfmem_fast.routing.candidate_features`):
    the probe's rows ``p_rows`` plus the hits of the queries that recollected."""
    vectors = view.snapshot.vectors if view.snapshot is not None else view.X.float().cpu().numpy()
    if hits is None:
        h = np.zeros((Q.shape[0], 0), dtype=np.int64)
    else:
        h = torch.where((routes == RECOLLECTION)[:, None], hits, torch.full_like(hits, -1)).cpu().numpy()
        h = h[:, : int((h >= 0).sum(axis=1).max(initial=0))]  # hits are packed to the left
    prof = profiles_numpy(view)[qseg.cpu().numpy()]
    return candidate_features(p_rows.cpu().numpy(), h, Q.double().cpu().numpy(), prof, vectors)


def _recollect(be: Backend, view: BankView, Q: torch.Tensor, qseg: torch.Tensor, config: RFMemConfig,
               level0: tuple[torch.Tensor, torch.Tensor], active: torch.Tensor, sel: RowSelection | None = None) -> Any:
    """The Recollection path of a chunk; the search chooses the beam driver.

    The backend's fused driver (:meth:`~rfmem_fast.backends.base.Backend.recollect`) when
    it has one in effect (:meth:`~rfmem_fast.backends.base.Backend.fused_driver`: the
    native backend's C++ driver unless ``beam_driver`` / ``RFMEM_BEAM_DRIVER`` say
    "python"), else the portable Python driver :func:`rfmem_fast.recollection.recollect`
    over the backend's primitives; both return the same rows, scores, rounds and hits.

    ``sel``: the chunk's row selection (filtered search), applied by every round's top-k.

    Returns:
        :class:`~rfmem_fast.backends.base.RecollectionOutput`.
    """
    skw = {} if sel is None else {"sel": sel}
    if be.fused_driver():
        return be.recollect(view, Q, qseg, config, level0=level0, active=active, **skw)
    return _recollection.recollect(be, view, Q, qseg, config, level0, active, **skw)


def _recollect_host(be: Backend, view: BankView, Q: np.ndarray, seg: np.ndarray, config: RFMemConfig,
                    level0: tuple[np.ndarray, np.ndarray], active: np.ndarray | None,
                    sel: RowSelection | None, fused: bool | None = None) -> tuple:  # fmt: skip
    """:func:`_recollect` on host arrays (the host fast path): the backend's fused driver
    through :meth:`~rfmem_fast.backends.base.Backend.recollect_host` when in effect
    (``fused``: ``be.fused_driver()`` if already read), else the Python driver on tensors
    sharing the arrays' memory. ``active`` None: every query.

    Returns:
        (rows [b, out_k], scores, rounds [b], dense [b, out_k] or None) host arrays.
    """
    if be.fused_driver() if fused is None else fused:
        return be.recollect_host(view, Q, seg, config, level0, active, sel)
    t = torch.from_numpy
    act = None if active is None else t(active)
    return _recollect(be, view, t(Q), t(seg), config, (t(level0[0]), t(level0[1])), act, sel).host()


def _resolve_router(mode: str, config: RFMemConfig, router: Any) -> Router | None:
    """The router :func:`search` passes on: None for the spec's thresholds of ``config``
    (evaluated on the device), else a checked Router (``config.router``'s file when set)."""
    if mode != "rfmem":
        return None
    if router is None:
        return resolve_router(config) if config.router is not None else None
    if not isinstance(router, Router):
        raise TypeError(f"router must be a rfmem_fast.routing.Router, got {type(router).__name__}")
    router.check_config(config)
    return router


def _pad_t(a: torch.Tensor, width: int, value: Any) -> torch.Tensor:
    """``a`` [b, w] right-padded with ``value`` to ``width`` columns (contiguous)."""
    if a.shape[1] >= width:
        return a.contiguous()
    return torch.nn.functional.pad(a, (0, width - a.shape[1]), value=value)


def _unpadded(rows: np.ndarray) -> bool:
    """Whether ``rows`` (int64, any shape) is non-empty and holds no padding (-1)."""
    return bool(rows.size) and int(np.minimum.reduce(rows, axis=None)) >= 0


def _tail_unpadded(rows: np.ndarray) -> bool:
    """:func:`_unpadded` of rows [b, k] whose padding fills each row's tail (the host fast
    path's: the probe's top-k, the beam driver's hits packed to the left, and their
    right-padding), read from the last column: one element for one query, no reduction."""
    if not rows.size:
        return False
    if rows.shape[0] == 1:
        return rows.item(-1) >= 0
    return _unpadded(rows[:, -1])


def _lookup(item_ids: np.ndarray | None, rows: np.ndarray, full: bool | None = None) -> np.ndarray:
    """object [rows.shape]: ``item_ids[rows]`` where rows >= 0, None elsewhere (all None
    when ``item_ids`` is None). ``full``: :func:`_unpadded` of ``rows`` when known."""
    if full is None:
        full = _unpadded(rows)
    if item_ids is not None and item_ids.dtype.kind == "O" and full:  # no padding: one gather
        return item_ids[rows]
    out = np.empty(rows.shape, dtype=object)  # an empty object array holds None
    if item_ids is not None:
        ok = rows >= 0
        out[ok] = item_ids[rows[ok]]
    return out
