"""One query on the host with a plain configuration: the search's lean entry (RFMEM_SPEC.md sections 1-4).

:func:`rfmem_fast.search.search` sends a call here when it holds ONE host query
(``output="numpy"`` on a backend whose host entries run no torch operation: the native
one) whose configuration uses nothing beyond the paper's retrieval: no filters, router
object, re-ranker, second stage, profile prior, merge or context score, and the
backend's fused beam driver; and either no query text, or (mode "dense") a text for the
one-pass hybrid probe of a score-based fusion (:func:`rfmem_fast.search_lexical.probe_fused`).
Everything else goes through :func:`rfmem_fast.search_chunk.run_chunk`, the general
implementation.

The lean entry calls the same backend entries in the same order as ``run_chunk`` does for
such a query (:meth:`~rfmem_fast.backends.base.Backend.probe_host`, the routing of
:func:`rfmem_fast.search_chunk.routes_host`, :meth:`~rfmem_fast.backends.base.Backend.recollect_host`)
with the widths of :func:`rfmem_fast.search_chunk.widths`, and builds the result with the
search's own assembly (``_host_fields``); what it leaves out is the general path's
bookkeeping for the features it does not serve (the chunk loop, the kits, the feature
flags, the torch-thread setting: 25-50 us of Python a query, most of it paid with the
caches cold after the probe's scan). Its result equals the general path's field by field
(tests/test_search_single.py), and nothing of the algorithm is restated here: the probe,
the routing rule and the beam driver are the ones every search runs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .backends import Backend, BankView
from .config import RFMemConfig
from .routing.base import RECOLLECTION, Router
from .search_chunk import HostKit, filled, fit, routes_host, tail_unpadded, widths
from .search_lexical import KernelHits, probe_fused

__all__ = ["lean_applies", "single_query"]

_F32 = np.dtype(np.float32)


def lean_applies(be: Backend, config: RFMemConfig, mode: str, Q: Any, texts: list | None, sel: Any,
                 router: Router | None) -> bool:  # fmt: skip
    """Whether :func:`single_query` serves a search (module docstring): one host query
    (``Q`` a numpy array [1, d]) without filters (``sel`` None) or a router object, on a
    backend with ``host_torch_free`` (and in a mode that recollects, its fused driver in
    effect), with a config without re-ranker, second stage, profile prior, merge or
    context score; without texts, or (mode "dense", ``lexical_weight`` > 0, a score-based
    fusion, a backend with ``has_fused_topk``) with texts for the one-pass hybrid probe."""
    if not (router is None and sel is None and isinstance(Q, np.ndarray) and Q.shape[0] == 1 and be.host_torch_free
            and config.reranker is None and config.second_stage is None and config.profile_weight == 0
            and config.merge == "none" and not config.context_on):  # fmt: skip
        return False
    if texts is not None:
        return mode == "dense" and config.lexical_weight > 0 and config.fusion != "rrf" and be.has_fused_topk
    return mode == "dense" or be.fused_driver()


def single_query(be: Backend, view: BankView, Q: np.ndarray, seg: np.ndarray, config: RFMemConfig, mode: str,
                 seg_len: int, texts: list | None = None) -> tuple[dict[str, np.ndarray], bool | None, bool | None]:  # fmt: skip
    """The tensor fields of one query's search on the host (what ``run_chunk`` returns for
    it), for a call :func:`lean_applies` to.

    Args:
        be: the backend (``host_torch_free``); view: its view of the bank.
        Q: float32 [1, d] C-contiguous unit query; seg: int64 [1] its segment index.
        config: RFMemConfig; mode: "rfmem" | "dense" | "recollection".
        seg_len: the rows of the query's segment (caps the top-k widths).
        texts: None, or [the query's text (str / None)] (mode "dense"): the one-pass hybrid
            probe (:func:`rfmem_fast.search_lexical.probe_fused`), whose fused list is the result.

    Returns:
        (fields, full, probe_full) as ``run_chunk`` returns them: the fields of
        :data:`rfmem_fast.search._TENSOR_FIELDS` as numpy arrays (rows / probe_rows int64
        [1, out_k] / [1, probe_k], -1 padding; scores, probe scores float32, -inf padding;
        dense_scores float32, NaN padding; lexical and context scores NaN; route, rule,
        rounds int64 [1]; mean, entropy float64 [1]), and whether the rows / probe rows
        hold no padding (None: not known here).

    Raises:
        ValueError: as the backend's probe and driver (never for a checked search).
    """
    W, P = config.out_k, config.probe_k
    k0, probe_k, out_k = widths(config, seg_len)
    if texts is not None:
        return _hybrid_dense(be, view, Q, seg, config, k0, probe_k, out_k, seg_len, texts)
    p_sc, p_rows, mean, ent, count = be.probe_host(view, Q, seg, k0, probe_k, config.temperature, config.entropy)
    if p_sc.dtype is not _F32:
        p_sc = p_sc.astype(np.float32)
    routes, rule = routes_host(mode, None, config, 1, None, mean, ent, count)
    if int(routes[0]) == RECOLLECTION:
        cfg = config if out_k == config.out_k else config.replace(out_k=out_k)
        o_rows, o_sc, rounds, o_dense = be.recollect_host(view, Q, seg, cfg, (p_sc, p_rows), None)
        rows = fit(o_rows, out_k, W, -1)
        scores = fit(o_sc if o_sc.dtype is _F32 else o_sc.astype(np.float32), out_k, W, -np.inf)
        if o_dense is None:  # a driver without its hits' dense scores: re-scored exactly, as the general path does
            dense = HostKit().rescore(view, Q, filled(rows.shape, np.nan, np.float32), rows, rows >= 0,
                                      be.memory_budget)  # fmt: skip
        else:
            dense = fit(o_dense, out_k, W, np.nan)  # the driver's exact dense scores (NaN at padding)
    else:
        rounds = filled((1,), 0, np.int64)
        rows, scores = fit(p_rows, out_k, W, -1), fit(p_sc, out_k, W, -np.inf)
        dense = scores
    full = tail_unpadded(rows)
    if full:
        dense = dense.copy() if dense is scores else dense
    else:
        dense = np.where(rows >= 0, dense, np.float32(np.nan)).astype(np.float32, copy=False)
    probe_rows, probe_scores = fit(p_rows, probe_k, P, -1), fit(p_sc, probe_k, P, -np.inf)
    fields = dict(
        rows=rows, scores=scores, route=routes, mean=mean, entropy=ent, rule=rule, rounds=rounds,
        probe_rows=probe_rows, probe_scores=probe_scores, dense_scores=dense,
        lexical_scores=filled((1, W), np.nan, np.float32), context_scores=filled((1, W), np.nan, np.float32),
    )  # fmt: skip
    return fields, full, full if rows is probe_rows else tail_unpadded(probe_rows)


def _hybrid_dense(be: Backend, view: BankView, Q: np.ndarray, seg: np.ndarray, config: RFMemConfig, k0: int,
                  probe_k: int, out_k: int, seg_len: int, texts: list) -> tuple[dict[str, np.ndarray], None, None]:  # fmt: skip
    """:func:`single_query` with the query's text in mode "dense": the hits' keys taken in the
    dense probe's pass and the fused top-k right after it (``run_chunk``'s one-pass path),
    the result the fused list with its exact dense and lexical scores."""
    W, P = config.out_k, config.probe_k
    kh = KernelHits.of(be, view, seg, texts)
    k_f = max(probe_k, out_k)
    (p_sc, p_rows, mean, ent, count), hyb = probe_fused(be, view, Q, seg, max(k0, min(k_f, seg_len)), probe_k, config,
                                                        kh, k_f)  # fmt: skip
    routes, rule = routes_host("dense", None, config, 1, None, mean, ent, count)
    nan = np.float32(np.nan)
    fields = dict(
        rows=fit(hyb.rows, out_k, W, -1), scores=fit(hyb.fused, out_k, W, -np.inf).astype(np.float32),
        route=routes, mean=mean, entropy=ent, rule=rule, rounds=filled((1,), 0, np.int64),
        probe_rows=fit(hyb.rows, probe_k, P, -1), probe_scores=fit(hyb.fused, probe_k, P, -np.inf).astype(np.float32),
        dense_scores=fit(hyb.dense, out_k, W, nan).astype(np.float32),
        lexical_scores=fit(hyb.lex, out_k, W, nan).astype(np.float32), context_scores=filled((1, W), nan, np.float32),
    )  # fmt: skip
    return fields, None, None
