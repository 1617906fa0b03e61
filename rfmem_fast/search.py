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

The steps of a chunk of queries live in :func:`rfmem_fast.search_chunk.run_chunk` (written
once over numpy arrays on the host and torch tensors on a device), the lexical channel in
:mod:`rfmem_fast.search_lexical`; this module holds the API (:func:`search`,
:func:`search_tensors`, :func:`search_candidates`), the argument checks and the results.

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
(:func:`rfmem_fast.search_lexical.hybrid`, rules and exactness proof in :mod:`rfmem_fast.fusion`); the probe's
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
from .expansion import fold_expansions
from .filters import RowSelection, compile_filters
from .routing.base import ROUTE_NAMES, RULE_NAMES, Router
from .routing.files import resolve_reranker, resolve_router
from .second_stage import resolve_stage
from .search_chunk import ArrayKit, DeviceKit, HostKit, chunk_threads, run_chunk, unpadded as _unpadded
from .search_lexical import HYBRID_DENSE_DEPTH, HYBRID_MATRIX_ENTRIES, ONE_PASS_FUSIONS  # noqa: F401 (the search's constants)
from .search_single import lean_applies, single_query

MODES = ("rfmem", "dense", "recollection")
_HOST_KIT = HostKit()
_NO_THREADS = nullcontext()  # (reusable: a chunk that leaves the torch threads alone)
#: what :func:`search` returns: "numpy" (a SearchResult) or "torch" (a TensorSearchResult)
OUTPUTS = ("numpy", "torch")
#: default number of queries per internal chunk of :func:`search`
DEFAULT_MAX_BATCH = 8192


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
        **{k: a if (a := t[k]).dtype is dt else a.astype(dt, copy=False) for k, dt in _HOST_DTYPES},
    )


#: the numeric fields of a SearchResult and their dtypes (rows int64 as the backends give it)
_HOST_DTYPES = tuple((k, np.dtype(d)) for k, d in (
    ("scores", np.float32), ("route", np.int64), ("mean", np.float64), ("entropy", np.float64), ("rule", np.int64),
    ("rounds", np.int64), ("probe_scores", np.float32), ("dense_scores", np.float32), ("lexical_scores", np.float32),
    ("context_scores", np.float32),
))  # fmt: skip


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
    if output == "numpy" and lean_applies(be, config, mode, Q, texts, sel, router):  # one plain host query
        fields, full, probe_full = single_query(be, view, Q, qseg, config, mode, hints[0][0], texts)
        return SearchResult(mode=mode, backend=be.name, config=config,
                            **_host_fields(fields, view.snapshot, full, probe_full))  # fmt: skip
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
    stage = resolve_stage(config) if query_texts is not None else None  # (no text: the first stage's lists)
    if query_texts is not None and (view.snapshot is None or view.snapshot.lexical is None):
        raise ValueError("query_texts needs a view of a bank snapshot with a lexical index (this view has none)")
    bank_max = 0
    if chunk_hints is None:  # offsets_cpu is a host tensor: no device synchronisation
        off = view.offsets_cpu
        bank_max = int((off[1:] - off[:-1]).max()) if off.shape[0] > 1 else 0
    parts: list[dict[str, Any]] = []
    host: dict[str, np.ndarray] = {}
    on_host = isinstance(Q, np.ndarray) or Q.device.type == "cpu"
    # a chunk in host memory whose results go to the host: numpy between the backend calls
    kit: ArrayKit = _HOST_KIT if host_output and on_host else DeviceKit(backend.device)
    fused = mode != "dense" and backend.fused_driver()  # (read once: RFMEM_BEAM_DRIVER costs an environment look-up)
    plain = stage is None and reranker is None and pools is None and config.profile_weight == 0 and (
        config.merge == "none" and not config.context_on)  # fmt: skip
    one = b <= max_batch  # (one chunk: the whole batch, without a slice's dispatch)
    for j, c0 in enumerate(range(0, max(b, 1), max_batch)):
        ml, work = chunk_hints[j] if chunk_hints is not None and j < len(chunk_hints) else (bank_max, None)
        Qc, sc = (Q, qseg) if one else (Q[c0 : c0 + max_batch], qseg[c0 : c0 + max_batch])
        sel_c = _chunk_selection(selection, c0, max_batch)
        tx = None if query_texts is None else query_texts[c0 : c0 + max_batch]
        if kit.host:
            Qc, sc = _host_in(Qc, np.float32, torch.float32), _host_in(sc, np.int64, torch.int64)
        else:
            Qc, sc = _tensor_in(Qc), _tensor_in(sc)
        # a small chunk runs with one torch thread on the CPU (rfmem_fast.threads, README "Threads")
        threads = chunk_threads(backend, work, config, mode, fused, tx, sel_c, plain) if on_host else None
        with threads or _NO_THREADS:
            part, full, probe_full = run_chunk(kit, backend, view, Qc, sc, ml, config, mode, router, reranker, pools,
                                               tx, sel_c, fused, stage)  # fmt: skip
        if not host_output:
            parts.append(part)  # (device tensors: the host kit serves host outputs only)
            continue
        if not kit.host:
            part = {k: v.cpu().numpy() for k, v in part.items()}
        part = _host_fields(part, view.snapshot, full, probe_full)
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


def _tensor_in(x: Any) -> torch.Tensor:
    """A chunk's queries / segments as a tensor (a host array shares its memory)."""
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _host_in(x: Any, dtype: type, tdtype: torch.dtype) -> np.ndarray:
    """A chunk's queries / segments as a C-contiguous host array of ``dtype`` (no copy when it is one)."""
    return np.ascontiguousarray(x, dtype=dtype) if isinstance(x, np.ndarray) else host_array(x, tdtype)


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
