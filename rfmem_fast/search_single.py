"""One query on the host with a plain configuration: the search's lean entry (RFMEM_SPEC.md sections 1-4).

:func:`rfmem_fast.search.search` sends a call here when it holds ONE host query
(``output="numpy"`` on a backend whose host entries run no torch operation: the native
one) whose configuration uses nothing beyond the paper's retrieval and the lexical
channel: no filters, router object, re-ranker, second stage, profile prior, merge or
context score, and the backend's fused beam driver; the query's text, if any, goes
through the one-pass hybrid probe of a score-based fusion
(:func:`rfmem_fast.search_lexical.probe_fused`).
Everything else goes through :func:`rfmem_fast.search_chunk.run_chunk`, the general
implementation.

The lean entry calls the same backend entries in the same order as ``run_chunk`` does for
such a query (:meth:`~rfmem_fast.backends.base.Backend.probe_host` or the hybrid probe, the routing of
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
from .search_chunk import HostKit, filled, fit, lexical_scores, routes_host, tail_unpadded, widths
from .search_lexical import KernelHits, probe_fused

__all__ = ["lean_applies", "single_query"]

_F32 = np.dtype(np.float32)
_HOST = HostKit()  # the general path's host array operations (probe_host with its float32 scores, rescore)


def lean_applies(be: Backend, config: RFMemConfig, mode: str, Q: Any, texts: list | None, sel: Any,
                 router: Router | None) -> bool:  # fmt: skip
    """Whether :func:`single_query` serves a search (module docstring): one host query
    (``Q`` a numpy array [1, d]) without filters (``sel`` None) or a router object, on a
    backend with ``host_torch_free`` (and in a mode that recollects, its fused driver in
    effect), with a config without re-ranker, second stage, profile prior, merge or
    context score; without texts, or with texts for the one-pass hybrid probe
    (``lexical_weight`` > 0, a score-based fusion, a backend with ``has_fused_topk``).

    Args:
        be: the resolved backend; config: the checked RFMemConfig; mode: "rfmem" |
            "dense" | "recollection"; Q: the prepared queries (numpy float32 [b, d] or a
            tensor); texts: the checked query texts (list of b str / None) or None; sel:
            the compiled filters (RowSelection) or None; router: the resolved Router or None.

    Returns:
        bool. Raises nothing beyond ``be.fused_driver()``'s ValueError (a bad
        ``RFMEM_BEAM_DRIVER``, which the general path raises too).
    """
    if not (router is None and sel is None and isinstance(Q, np.ndarray) and Q.shape[0] == 1 and be.host_torch_free
            and config.reranker is None and config.second_stage is None and config.profile_weight == 0
            and config.merge == "none" and not config.context_on):  # fmt: skip
        return False
    if texts is not None and not (config.lexical_weight > 0 and config.fusion != "rrf" and be.has_fused_topk):
        return False
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
        texts: None, or [the query's text (str / None)]: the one-pass hybrid probe
            (:func:`rfmem_fast.search_lexical.probe_fused`), whose fused list is the
            Familiarity path's result and the probe's list; the Recollection path's hits
            get their lexical scores looked up.

    Returns:
        (fields, full, probe_full) as ``run_chunk`` returns them: the fields of
        :data:`rfmem_fast.search._TENSOR_FIELDS` as numpy arrays (rows / probe_rows int64
        [1, out_k] / [1, probe_k], -1 padding; scores, probe scores float32, -inf padding;
        dense_scores float32, NaN padding; lexical scores (NaN without texts) and context
        scores NaN; route, rule, rounds int64 [1]; mean, entropy float64 [1]), and whether
        the rows / probe rows hold no padding (None: not known here).

    Raises:
        ValueError: as the backend's probe and driver (never for a checked search).
    """
    W, P = config.out_k, config.probe_k
    k0, probe_k, out_k = widths(config, seg_len)
    nan = np.float32(np.nan)
    hyb = None
    if texts is None:
        p_sc, p_rows, mean, ent, count = _HOST.probe(be, view, Q, seg, k0, probe_k, config, None)
    else:  # the dense probe recording its hits' keys and taking the fused top-k
        kh = KernelHits.of(be, view, seg, texts)
        k_f = max(probe_k, out_k)
        k_scan = max(k0, min(k_f, seg_len))
        (p_sc, p_rows, mean, ent, count), hyb = probe_fused(be, view, Q, seg, k_scan, probe_k, config, kh, k_f)
        if k_scan != k0:  # what the Recollection path sees: the probe of width k0 (a prefix)
            p_sc, p_rows = fit(p_sc, k0, k0, 0), fit(p_rows, k0, k0, 0)
    routes, rule = routes_host(mode, None, config, 1, None, mean, ent, count)
    lex = None
    if int(routes[0]) == RECOLLECTION:
        cfg = config if out_k == config.out_k else config.replace(out_k=out_k)
        o_rows, o_sc, rounds, o_dense = be.recollect_host(view, Q, seg, cfg, (p_sc, p_rows), None)
        rows = fit(o_rows, out_k, W, -1)
        scores = fit(o_sc if o_sc.dtype is _F32 else o_sc.astype(np.float32), out_k, W, -np.inf)
        if o_dense is None:  # a driver without its hits' exact dense scores: re-scored, as the general path does
            dense = _HOST.rescore(view, Q, filled(rows.shape, nan, np.float32), rows, rows >= 0,
                                  be.memory_budget)  # fmt: skip
        else:  # the driver's exact dense scores RN32(q . x) (NaN at padding): what re-scoring gives
            dense = fit(o_dense, out_k, W, np.nan)
        if hyb is not None:
            lex = lexical_scores(_HOST, rows, hyb.hit_list(), 1, W)
    else:
        rounds = filled((1,), 0, np.int64)
        if hyb is None:
            rows, scores = fit(p_rows, out_k, W, -1), fit(p_sc, out_k, W, -np.inf)
            dense = scores
        else:  # the fused list and its exact dense and lexical scores
            rows, scores = fit(hyb.rows, out_k, W, -1), fit(hyb.fused, out_k, W, -np.inf).astype(np.float32)
            dense = fit(hyb.dense, out_k, W, nan).astype(np.float32)
            lex = fit(hyb.lex, out_k, W, nan).astype(np.float32)
    full = probe_full = None
    if hyb is None:
        full = tail_unpadded(rows)
        if dense is scores:  # the Familiarity path's probe scores (-inf padding): a copy, NaN at padding
            dense = dense.copy() if full else np.where(rows >= 0, dense, nan).astype(np.float32, copy=False)
        # (the Recollection path's dense scores hold NaN at padding already: the driver's or re-scored)
        probe_rows, probe_scores = fit(p_rows, probe_k, P, -1), fit(p_sc, probe_k, P, -np.inf)
        probe_full = full if rows is probe_rows else tail_unpadded(probe_rows)
    else:
        probe_rows = fit(hyb.rows, probe_k, P, -1)
        probe_scores = fit(hyb.fused, probe_k, P, -np.inf).astype(np.float32)
    fields = dict(
        rows=rows, scores=scores, route=routes, mean=mean, entropy=ent, rule=rule, rounds=rounds,
        probe_rows=probe_rows, probe_scores=probe_scores, dense_scores=dense,
        lexical_scores=filled((1, W), nan, np.float32) if lex is None else lex,
        context_scores=filled((1, W), nan, np.float32),
    )  # fmt: skip
    return fields, full, probe_full
