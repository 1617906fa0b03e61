"""One chunk of a search: probe, route, the two paths, the hits' scores (RFMEM_SPEC.md sections 1-5).

:func:`run_chunk` is the search's one implementation of a chunk of queries; every
:func:`rfmem_fast.search.search` / :func:`~rfmem_fast.search.search_tensors` call runs
it once per chunk of ``max_batch`` queries, except one plain host query, which
:func:`~rfmem_fast.search.search` sends through the same backend entries by the lean
entry :mod:`rfmem_fast.search_single` (equal to this path field by field). Its steps:

1. the probe (:meth:`Backend.probe <rfmem_fast.backends.base.Backend.probe>`; with the
   lexical channel on a backend with ``has_fused_topk``, ``Backend.probe_hits``, which
   records the lexical hits' keys in the dense probe's own pass and takes each query's
   fused top-k on its threads (``Backend.fused_topk`` after it for "zscore"); with the
   context score, the one-pass ``Backend.hybrid_probe``;
   :mod:`rfmem_fast.search_lexical`);
2. the routing (the config's thresholds, a router object, or the route a forced mode names);
3. the Familiarity path's list: the probe's top ``out_k``, the fused list of the lexical
   channel, or the context score's top-k (:func:`rfmem_fast.context.context_topk`);
4. the Recollection path for the queries routed there (:func:`recollect`: the backend's
   fused beam driver or the portable Python driver), its hits merged
   (``config.merge``) or re-ranked (``config.reranker``) where configured;
5. the hits' exact dense scores (known, or re-scored ``RN32(q . x)``) and lexical scores.

The orchestration is written once over an :class:`ArrayKit`, the few array operations it
needs between the backend calls:

* :class:`HostKit`: numpy arrays, for a chunk in host memory whose results go to the host
  (``search(..., output="numpy")`` on a CPU backend). The backend's host entries
  (:meth:`~rfmem_fast.backends.base.Backend.probe_host`,
  :meth:`~rfmem_fast.backends.base.Backend.recollect_host`) take and give numpy arrays, so a
  single query pays ~1 us per step rather than torch's ~3-5 us per dispatch (~10-20 us
  right after a kernel's scan has evicted the caches; bench/bench_single_query.py), and
  host reads (a count of the recollecting queries, a skipped beam driver) are free.
* :class:`DeviceKit`: torch tensors on the backend's device (``output="torch"``, GPU
  batches): nothing reads a device value on the host, except the steps that run on the
  host anyway (the lexical channel, the context score, merges and re-rankers); the hits the
  Recollection path found keep NaN dense scores unless such a step ran (no host
  synchronisation for them).

Both kits give the same rows, scores, routes and signals (tests/test_search_kits.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import recollection as _recollection
from .backends import Backend, BankView
from .backends.exact import exact_pair_scores, exact_pair_scores_np
from .config import RFMemConfig
from .context import context_topk
from .device import host_array
from .filters import RowSelection
from .routing.base import FAMILIARITY, RECOLLECTION, RULE_FORCED_DENSE, RULE_FORCED_RECOLLECTION, Router
from .routing.features import ProbeSignals
from .routing.merge import merge_paths, select_top
from .routing.profile import fold_profile, profiles_numpy, view_profiles
from .routing.rerank import candidate_features
from .routing.threshold import route, route_tensor
from .second_stage import stage_features
from .search_lexical import (
    HYBRID_DENSE_DEPTH,
    ONE_PASS_FUSIONS,
    Hybrid,
    KernelHits,
    context_probe,
    hybrid,
    lexical_hits,
    probe_fused,
)
from .threads import limit_torch_threads

__all__ = ["ArrayKit", "HostKit", "DeviceKit", "run_chunk", "recollect", "widths"]

_F32 = np.dtype(np.float32)
_NAN32 = np.float32(np.nan)


def widths(config: RFMemConfig, max_len: int, depth: int = 0) -> tuple[int, int, int]:
    """A chunk's top-k widths ``(k0, probe_k, out_k)``: the probe scans ``k0`` = the
    widest of probe_k, out_k, the beam's ``beam_width * fanout`` and a re-ranker / merge
    ``depth``, never wider than the longest queried segment ``max_len`` (a wider top-k
    is padding only) but at least ``beam_width * fanout``; probe_k and out_k capped at k0."""
    bf = config.beam_width * config.fanout
    k0 = max(min(max(config.probe_k, config.out_k, bf, depth), max_len), bf)
    return k0, min(config.probe_k, k0), min(config.out_k, k0)


def routes_host(mode: str, router: Router | None, config: RFMemConfig, b: int, probe_scores: Any, mean: Any,
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
    return filled(b, forced[0], np.int64), filled(b, forced[1], np.int64)


def filled(shape: Any, value: Any, dtype: Any) -> np.ndarray:
    """A new array of ``shape`` and ``dtype`` filled with ``value`` (np.full's work in two C calls)."""
    out = np.empty(shape, dtype=dtype)
    out.fill(value)
    return out


def fit(a: np.ndarray, k: int, width: int, value: Any) -> np.ndarray:
    """The first ``k`` columns of ``a`` [b, w >= k] as a C-contiguous [b, width >= k] array,
    right-padded with ``value`` (``a`` itself when it has exactly ``k`` = ``width`` columns:
    the backends' arrays are C-contiguous)."""
    if a.shape[1] > k:
        a = a[:, :k]
        if a.shape[0] > 1:  # (one row: the cut is C-contiguous already)
            a = np.ascontiguousarray(a)
    if a.shape[1] >= width:
        return a
    out = filled((a.shape[0], width), value, a.dtype)
    out[:, : a.shape[1]] = a
    return out


def unpadded(rows: np.ndarray) -> bool:
    """Whether ``rows`` (int64, any shape) is non-empty and holds no padding (-1)."""
    return bool(rows.size) and int(np.minimum.reduce(rows, axis=None)) >= 0


def tail_unpadded(rows: np.ndarray) -> bool:
    """:func:`unpadded` of rows [b, k] whose padding fills each row's tail (the probe's
    top-k, the beam driver's hits packed to the left, and their right-padding), read
    from the last column: one element for one query, no reduction."""
    if not rows.size:
        return False
    if rows.shape[0] == 1:
        return rows.item(-1) >= 0
    return unpadded(rows[:, -1])


class ArrayKit:
    """The array operations :func:`run_chunk` needs between the backend calls (module
    docstring): ``host`` says whether host reads are free (numpy arrays) or the arrays
    live on a device (torch tensors, no host synchronisation)."""

    host: bool = False

    def probe(self, be: Backend, view: BankView, Q: Any, seg: Any, k: int, probe_k: int, config: RFMemConfig,
              sel: RowSelection | None) -> tuple:  # fmt: skip
        """The backend's probe: (scores float32 [b, k], rows int64 [b, k], mean float64 [b],
        entropy float64 [b], count int64 [b]) in the kit's arrays."""
        raise NotImplementedError

    def recollect(self, be: Backend, view: BankView, Q: Any, seg: Any, config: RFMemConfig, level0: tuple,
                  active: Any, sel: RowSelection | None, fused: bool, need_hits: bool) -> tuple:  # fmt: skip
        """The Recollection path (:func:`recollect`): (rows [b, >= out_k], scores, rounds [b],
        dense [b, out_k] or None, hit_rows [b, m] or None) in the kit's arrays; ``active``
        None: every query; ``hit_rows`` only with ``need_hits``."""
        raise NotImplementedError

    def lift(self, a: np.ndarray) -> Any:
        """A host array as one of the kit's arrays."""
        raise NotImplementedError

    def lower(self, a: Any) -> np.ndarray:
        """One of the kit's arrays as a host array (a device-to-host copy on a device)."""
        raise NotImplementedError

    def tensor(self, a: Any) -> torch.Tensor:
        """One of the kit's arrays as a tensor (sharing memory on the host)."""
        raise NotImplementedError

    def untensor(self, t: torch.Tensor) -> Any:
        """A tensor on the kit's side (host tensor / device tensor) as one of the kit's arrays."""
        raise NotImplementedError

    def full(self, shape: tuple, value: Any, dtype: np.dtype) -> Any:
        """A new array of ``shape`` filled with ``value`` (``dtype`` a numpy dtype)."""
        raise NotImplementedError

    def fit(self, a: Any, k: int, width: int, value: Any) -> Any:
        """:func:`fit`: the first ``k`` columns of ``a``, right-padded with ``value`` to ``width``."""
        raise NotImplementedError

    def f32(self, a: Any) -> Any:
        """``a`` as float32 (itself when it is)."""
        raise NotImplementedError

    def f64(self, a: Any) -> Any:
        """``a`` as float64 on a device (the host's arrays are typed once, with the results')."""
        raise NotImplementedError

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """Elementwise ``cond ? a : b`` (broadcasting)."""
        raise NotImplementedError

    def rescore(self, view: BankView, Q: Any, dense: Any, rows: Any, ok: Any, memory_budget: int) -> Any:
        """``dense`` with its NaN entries at valid rows (``ok``) replaced by the exact scores
        ``RN32(q . x)`` (:mod:`rfmem_fast.backends.exact`)."""
        raise NotImplementedError


class HostKit(ArrayKit):
    """:class:`ArrayKit` over numpy arrays (module docstring)."""

    host = True

    def probe(self, be, view, Q, seg, k, probe_k, config, sel):  # noqa: D102 (ArrayKit)
        ps, pr, mean, ent, cnt = be.probe_host(view, Q, seg, k, probe_k, config.temperature, config.entropy, sel)
        return (ps if ps.dtype is _F32 else ps.astype(np.float32)), pr, mean, ent, cnt  # (the host path's float32)

    def recollect(self, be, view, Q, seg, config, level0, active, sel, fused, need_hits):  # noqa: D102
        if fused and not need_hits:
            return (*be.recollect_host(view, Q, seg, config, level0, active, sel), None)
        t = torch.from_numpy
        out = recollect(be, view, t(Q), t(seg), config, (t(level0[0]), t(level0[1])),
                        None if active is None else t(active), sel)  # fmt: skip
        hits = None if out.hit_rows is None or not need_hits else host_array(out.hit_rows, out.hit_rows.dtype)
        return (*out.host(), hits)

    def lift(self, a):  # noqa: D102
        return a

    def lower(self, a):  # noqa: D102
        return a

    def tensor(self, a):  # noqa: D102
        return torch.from_numpy(a)

    def untensor(self, t):  # noqa: D102
        return t.numpy()

    full = staticmethod(filled)
    fit = staticmethod(fit)

    def f32(self, a):  # noqa: D102
        return a if a.dtype is _F32 else a.astype(np.float32)

    def f64(self, a):  # noqa: D102
        return a

    where = staticmethod(np.where)

    def rescore(self, view, Q, dense, rows, ok, memory_budget):  # noqa: D102
        qi, ci = np.nonzero(ok & np.isnan(dense))
        if qi.shape[0]:
            dense[qi, ci] = exact_pair_scores_np(view.snapshot.vectors, Q, qi, rows[qi, ci])
        return dense


class DeviceKit(ArrayKit):
    """:class:`ArrayKit` over torch tensors on ``device`` (module docstring)."""

    host = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def probe(self, be, view, Q, seg, k, probe_k, config, sel):  # noqa: D102
        return be.probe(view, Q, seg, k, probe_k, config.temperature, config.entropy,
                        **({} if sel is None else {"sel": sel}))  # fmt: skip

    def recollect(self, be, view, Q, seg, config, level0, active, sel, fused, need_hits):  # noqa: D102
        if active is None:
            active = torch.ones(Q.shape[0], dtype=torch.bool, device=Q.device)
        out = recollect(be, view, Q, seg, config, level0, active, sel)
        dev = self.device
        return (out.rows.to(dev), out.scores.to(dev), out.rounds.to(dev),
                None if out.dense is None else out.dense.to(dev),
                None if out.hit_rows is None or not need_hits else out.hit_rows.to(dev))  # fmt: skip

    def lift(self, a):  # noqa: D102
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def lower(self, a):  # noqa: D102
        return a.cpu().numpy()

    def tensor(self, a):  # noqa: D102
        return a

    def untensor(self, t):  # noqa: D102
        return t.to(self.device)

    def full(self, shape, value, dtype):  # noqa: D102
        return torch.full(shape, value, dtype=_TORCH_DTYPES[np.dtype(dtype)], device=self.device)

    def fit(self, a, k, width, value):  # noqa: D102
        a = a[:, :k]
        if a.shape[1] >= width:
            return a.contiguous()
        return torch.nn.functional.pad(a, (0, width - a.shape[1]), value=value)

    def f32(self, a):  # noqa: D102
        return a.to(torch.float32)

    def f64(self, a):  # noqa: D102
        return a.to(torch.float64)

    def where(self, cond, a, b):  # noqa: D102
        return torch.where(cond, a, b)

    def rescore(self, view, Q, dense, rows, ok, memory_budget):  # noqa: D102
        need = (ok & torch.isnan(dense)).nonzero()
        if need.shape[0]:
            qi, ci = need[:, 0], need[:, 1]
            dense = dense.clone()
            dense[qi, ci] = exact_pair_scores(view.X, Q, qi, rows[qi, ci], memory_budget)
        return dense


_TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                 np.dtype(np.int64): torch.int64, np.dtype(np.bool_): torch.bool}  # fmt: skip


def chunk_threads(be: Backend, work: float | None, config: RFMemConfig, mode: str, fused: bool, texts: list | None,
                  sel: RowSelection | None, plain: bool) -> Any:  # fmt: skip
    """The torch-thread setting of a host chunk: one torch thread for a small chunk
    (:func:`rfmem_fast.threads.limit_torch_threads`, ``work`` its scan work in
    multiply-adds) unless the chunk runs no torch operation (a backend whose
    ``host_torch_free`` holds, in mode "dense" or with its fused driver, without the
    features that run torch code: ``plain``, i.e. no second stage, re-ranker, candidate
    pools, profile prior, merge or context score; query texts only through the one-pass
    hybrid kernels of a backend with ``has_fused_topk``: a score-based fusion, unfiltered;
    with the context score only through the same one-pass kernels). None: leave them."""
    if work is None:
        return None
    one_pass = be.has_fused_topk and sel is None
    lexical_ok = texts is None or (one_pass and config.lexical_weight > 0 and config.fusion != "rrf")
    torch_free = be.host_torch_free and (mode == "dense" or fused) and (
        (plain and lexical_ok) or (config.context_on and one_pass and config.merge == "none"
                                   and config.profile_weight == 0))  # fmt: skip
    return None if torch_free else limit_torch_threads(work, be.device)


def run_chunk(
    kit: ArrayKit,
    be: Backend,
    view: Any,
    Q: Any,
    seg: Any,
    max_len: int,
    config: RFMemConfig,
    mode: str,
    router: Router | None = None,
    reranker: Any = None,
    pools: list | None = None,
    texts: list | None = None,
    sel: RowSelection | None = None,
    fused: bool | None = None,
    stage: Any = None,
) -> tuple[dict[str, Any], bool | None, bool | None]:
    """One chunk of :func:`rfmem_fast.search.search_tensors` (module docstring: the steps).

    Args:
        kit: :class:`HostKit` (``Q`` / ``seg`` host arrays: float32 [c, d] C-contiguous unit
            queries, int64 [c] segment indices) or :class:`DeviceKit` (tensors on its device).
        be: the backend; view: its view of the bank.
        max_len: the longest queried segment (caps the top-k widths).
        config: RFMemConfig; mode: "rfmem" | "dense" | "recollection".
        router: a Router (mode "rfmem"; routes on the host) or None for the config's thresholds.
        reranker: a loaded re-ranker (``config.reranker``) or None.
        pools: a list ``[depth]`` to append the chunk's re-ranker candidate pools to, or None.
        texts: the chunk's query texts (the lexical channel; scores of the hits) or None.
        sel: the chunk's row selection (filtered search) or None.
        fused: ``be.fused_driver()`` when the caller read it (None: read here).
        stage: the loaded second stage (``config.second_stage``, :mod:`rfmem_fast.second_stage`)
            or None: the Familiarity path's list is taken ``stage.depth`` deep and re-ranked
            by it to ``out_k`` (needs ``texts``).

    Returns:
        (the tensor fields of :class:`rfmem_fast.search.TensorSearchResult` in the kit's arrays,
        whether the rows and the probe rows are free of padding: :func:`unpadded` when the
        host kit knows it cheaply, else None).
    """
    host = kit.host
    b = Q.shape[0]
    W, P = config.out_k, config.probe_k
    if fused is None:
        fused = mode != "dense" and be.fused_driver()
    if config.profile_weight > 0:  # the profile prior (rfmem_fast.routing.profile)
        Q = kit.untensor(fold_profile(kit.tensor(Q), kit.tensor(seg), view_profiles(view), config.profile_weight))
        if host:
            Q = np.ascontiguousarray(Q, dtype=np.float32)
    depth = reranker.depth if reranker is not None else (pools[0] if pools is not None else 0)
    k0, probe_k, out_k = widths(config, max_len, depth)
    lexical = texts is not None and config.lexical_weight > 0
    ctx = config.context_on  # the context score (rfmem_fast.context): every row's scan score too
    # the Familiarity path's list: out_k wide, or the second stage's depth (then re-ranked to out_k)
    kl, WL = (out_k, W) if stage is None else (max(out_k, min(stage.depth, max_len)), max(W, stage.depth))
    k_scan = k0
    D = max(config.lexical_depth, config.out_k, config.probe_k) if lexical else 0
    if lexical and config.fusion == "rrf":  # the dense ranked list of rrf: the top D
        k_scan = max(k0, min(D, max_len))
    # (a filtered batch fuses on the host: the one-pass kernels take no row selection)
    one_pass = lexical and be.has_fused_topk and config.fusion != "rrf" and sel is None
    if lexical and not one_pass and config.fusion != "rrf":
        # a deeper exact dense list: a lower s_K, so fewer lexical hits to re-score
        k_scan = max(k0, min(HYBRID_DENSE_DEPTH, max_len))
    if stage is not None and not lexical and not ctx:  # the probe's list is the stage's: as deep as it looks
        k_scan = max(k_scan, kl)
    seg_np = kit.lower(seg) if (lexical or ctx or texts is not None) else None
    hyb = scan = boosts = lex_rows = None
    if ctx and be.has_fused_topk and sel is None:  # the probe, the fused list and every row's scan score in one pass
        probe, hyb, scan, boosts, lex_rows = context_probe(
            be, view, kit.tensor(Q), seg_np, texts if lexical else None, config, k_scan, probe_k, max(probe_k, kl)
        )
        p_sc, p_rows, mean, ent, count = (kit.untensor(t) for t in probe)
    elif one_pass:  # the dense probe recording its hits' keys and taking the fused top-k (probe_fused)
        kh = KernelHits.of(be, view, seg_np, texts)
        k_f = max(probe_k, kl)
        k_scan = max(k_scan, min(k_f, max_len))  # (the fused top-k starts from an exact dense top-K, K >= k_f)
        probe, hyb = probe_fused(be, view, kit.lower(Q), seg_np, k_scan, probe_k, config, kh, k_f)
        p_sc, p_rows, mean, ent, count = (kit.lift(a) for a in probe)
    else:
        p_sc, p_rows, mean, ent, count = kit.probe(be, view, Q, seg, k_scan, probe_k, config, sel)
    p_sc_all, p_rows_all = p_sc, p_rows
    if k_scan != k0:  # what the other paths see: the probe of width k0 (a prefix)
        p_sc, p_rows = kit.fit(p_sc, k0, k0, 0), kit.fit(p_rows, k0, k0, 0)
    # the routing
    if mode != "rfmem":  # a forced mode: its route is known
        forced = (FAMILIARITY, RULE_FORCED_DENSE) if mode == "dense" else (RECOLLECTION, RULE_FORCED_RECOLLECTION)
        routes, rule = kit.full((b,), forced[0], np.int64), kit.full((b,), forced[1], np.int64)
    elif host or router is not None:  # numpy: a few us, where torch's dispatches cost ~0.1 ms
        ps_h = None if router is None else kit.lower(p_sc[:, :probe_k])
        routes, rule = (kit.lift(a) for a in routes_host(mode, router, config, b, ps_h, kit.lower(mean), kit.lower(ent),
                                                          kit.lower(count)))  # fmt: skip
    else:
        routes, rule = route_tensor(mean, ent, count, config)  # on the device: no host copy
    # the Familiarity path's list
    if stage is None:
        rows, scores = kit.fit(p_rows, out_k, W, -1), kit.f32(kit.fit(p_sc, out_k, W, -np.inf))
    else:  # (the probe's whole scan width when the stage looks deeper)
        kp = min(kl, p_rows_all.shape[1])
        rows, scores = kit.fit(p_rows_all, kp, WL, -1), kit.f32(kit.fit(p_sc_all, kp, WL, -np.inf))
    lex_hits = known = None
    if lexical:  # the Familiarity path's list (and the probe's) become the fused top-k
        k_f = max(probe_k, kl)
        kd = min(D, k_scan) if config.fusion == "rrf" else k_scan
        if hyb is None:
            hyb = hybrid(view, kit.tensor(Q), kit.tensor(seg), kit.tensor(p_sc_all), kit.tensor(p_rows_all), texts,
                         config, k_f, kd, be, sel, want_boosts=ctx)  # fmt: skip
            boosts, lex_rows = hyb.boost_rows, hyb.lex_rows
        lex_hits = hyb  # its hit_list() when the final hits need their lexical scores looked up
        rows = kit.lift(fit(hyb.rows, kl, WL, -1))
        scores = kit.lift(fit(hyb.fused, kl, WL, -np.inf).astype(np.float32))
        if config.fusion != "rrf" and not ctx:  # the fused list's exact dense and lexical scores are known
            known = (kit.lift(fit(hyb.dense, kl, WL, np.nan).astype(np.float32)),
                     kit.lift(fit(hyb.lex, kl, WL, np.nan).astype(np.float32)))  # fmt: skip
    elif texts is not None:  # weight 0: the texts only fill lexical_scores
        lex_hits = lexical_hits(view.snapshot, seg_np, texts, sel)
        lex_rows = [None if h is None else h[1] for h in lex_hits]
    fam_dense = scores if hyb is None else kit.lift(fit(hyb.dense, kl, WL, np.nan))
    ctx_sc = None
    if ctx:  # the Familiarity path's list: the exact top out_k by the context score
        Qh = kit.lower(Q) if host else kit.tensor(Q).detach().to(torch.float32).cpu().numpy()
        if scan is None:
            scan = be.segment_scores(view, Qh if host else kit.tensor(Q), seg_np)
        c_rows, c_ctx, c_base, c_dense, c_lex = context_topk(view.snapshot, view._memo, Qh, seg_np, scan, boosts, config,
                                                             kl, sel, view.row_norm_max, lex_rows)  # fmt: skip
        rows, scores = kit.lift(fit(c_rows, kl, WL, -1)), kit.lift(fit(c_base.astype(np.float32), kl, WL, -np.inf))
        ctx_sc = kit.lift(fit(c_ctx.astype(np.float32), kl, WL, np.nan))
        fam_dense = kit.lift(fit(c_dense, kl, WL, np.nan))
        known = (fam_dense, kit.lift(fit(c_lex, kl, WL, np.nan)))
    if stage is not None:  # the second stage: the model's out_k best of the list, in its order
        rows, scores, fam_dense, ctx_sc, known = stage_list(kit, stage, view, rows, scores, fam_dense, ctx_sc, known,
                                                            lex_hits, texts, mean, ent, out_k, W)  # fmt: skip
    # the Recollection path
    if mode == "dense":
        reco, everyone, nreco = None, False, 0
    elif mode == "recollection":
        reco, everyone, nreco = None, True, b
    else:
        reco = routes == RECOLLECTION
        nreco = int(np.count_nonzero(reco)) if host else -1  # (-1: unknown on a device)
        everyone = nreco == b
    rounds = out = hit_rows = None
    dense_known = False
    need_hits = config.merge != "none" or reranker is not None or pools is not None
    # a host chunk where no query recollects skips the beam driver's set-up (a device
    # chunk would need a host synchronisation to know: it calls the driver, which stops
    # at its first round's check)
    if nreco:
        cfg = config if out_k == config.out_k else config.replace(out_k=out_k)
        out = kit.recollect(be, view, Q, seg, cfg, (p_sc, p_rows), None if everyone else reco, sel, fused, need_hits)
        o_rows, o_sc, rounds, o_dense, hit_rows = out
        o_rows, o_sc = kit.fit(o_rows, out_k, W, -1), kit.fit(kit.f32(o_sc), out_k, W, -np.inf)
        if config.merge == "none":  # the authors' output
            rc = None if everyone else reco[:, None]
            if everyone:
                rows, scores = o_rows, o_sc
            else:
                rows, scores = kit.where(rc, o_rows, rows), kit.where(rc, o_sc, scores)
            # the driver's exact dense scores RN32(q . x): nothing to re-score (with the lexical
            # channel too: its fused list's dense scores are exact as well; not under a second
            # stage or the context score, whose lists are built otherwise)
            if o_dense is not None and (hyb is None or (stage is None and not ctx)):
                o_dense = kit.fit(o_dense, out_k, W, np.nan)
                fam_dense = o_dense if everyone else kit.where(rc, o_dense, fam_dense)
                dense_known = True
        else:
            rows, scores = merged(kit, view, Q, p_rows, hit_rows, reco, everyone, rows, scores, out_k, config)
    if rounds is None:
        rounds = kit.full((b,), 0, np.int64)
    # None: every query kept the Familiarity path, or the driver gave its hits' dense scores
    fam_ok = None
    if out is not None and not dense_known:
        fam_ok = kit.full((b,), False, np.bool_) if everyone else ~reco
    if need_hits and (reranker is not None or pools is not None):
        pool = candidate_pools(kit, view, Q, seg, p_rows[:, : max(depth, 1)], hit_rows, routes)
        if pools is not None:
            pools.append(pool)
        if reranker is not None:
            cand, keep, feats = pool
            sc = reranker.score(feats)
            order_key = np.broadcast_to(np.arange(cand.shape[1])[None, :], cand.shape)
            r_rows, r_sc = select_top(sc, sc, keep, order_key, cand, out_k)
            rows = kit.lift(fit(r_rows, out_k, W, -1))
            scores = kit.lift(fit(np.asarray(r_sc, dtype=np.float32), out_k, W, -np.inf))
            fam_ok = kit.full((b,), False, np.bool_)
    # the hits' exact dense scores and lexical scores
    full = probe_full = None
    nan = _NAN32 if host else float("nan")
    if known is not None and out is None and reranker is None:
        # the final list is the context or fused one, whose exact dense and lexical scores are known
        dense_sc, lex_sc = known
    else:
        # re-scored exactly: the hits whose dense score is not known yet (recollected,
        # re-ranked, rrf's lexical-only ones), on the host or whenever the lexical channel ran
        rescore = (host or lex_hits is not None) and not (out is None and reranker is None
                                                         and (hyb is None or config.fusion != "rrf"))  # fmt: skip
        if isinstance(lex_hits, Hybrid):
            lex_hits = lex_hits.hit_list()
        plain = host and not lexical and texts is None and reranker is None and config.merge == "none" and not ctx
        if plain:  # padding only at the tails (the probe's and the driver's lists): one element's read
            full = tail_unpadded(rows)
        if plain and fam_ok is None and full:  # no NaN to place: the known scores
            dense_sc = fam_dense.copy() if fam_dense is scores else fam_dense
        else:
            ok = rows >= 0
            keep = ok if fam_ok is None else ok & fam_ok[:, None]
            dense_sc = kit.f32(kit.where(keep, kit.f32(fam_dense), nan))
            if rescore:
                dense_sc = kit.rescore(view, Q if host else kit.tensor(Q), dense_sc, rows, ok, be.memory_budget)
        lex_sc = kit.full((b, W), np.nan, np.float32) if lex_hits is None else lexical_scores(kit, rows, lex_hits, b, W)
    if hyb is not None:
        probe_rows = kit.lift(fit(hyb.rows, probe_k, P, -1))
        probe_scores = kit.lift(fit(hyb.fused, probe_k, P, -np.inf).astype(np.float32))
    else:
        probe_rows, probe_scores = kit.fit(p_rows, probe_k, P, -1), kit.f32(kit.fit(p_sc, probe_k, P, -np.inf))
        if full is not None:  # (the plain host path: the probe's list, tail-padded)
            probe_full = full if rows is probe_rows else tail_unpadded(probe_rows)
    if ctx_sc is None:
        ctx_sc = kit.full((b, W), np.nan, np.float32)
    elif out is not None:  # a query that recollected returns that path's hits: no context score
        ctx_sc = kit.full(ctx_sc.shape, np.nan, np.float32) if everyone else kit.where(reco[:, None], nan, ctx_sc)
    fields = dict(
        rows=rows,
        scores=scores,
        route=routes,
        mean=mean if host else kit.f64(mean),
        entropy=ent if host else kit.f64(ent),
        rule=rule,
        rounds=rounds,
        probe_rows=probe_rows,
        probe_scores=probe_scores,
        dense_scores=dense_sc,
        lexical_scores=lex_sc,
        context_scores=ctx_sc,
    )
    return fields, full, probe_full


def stage_list(kit: ArrayKit, stage: Any, view: Any, rows: Any, scores: Any, dense: Any, ctx: Any, known: Any,
               lex_hits: Any, texts: list, mean: Any, ent: Any, out_k: int, width: int) -> tuple:  # fmt: skip
    """The second stage on the Familiarity path's lists (:mod:`rfmem_fast.second_stage`): each
    query's candidates ``rows`` [b, w] (first-stage order, -1 padding) with their base
    ``scores``, exact ``dense`` scores, context scores ``ctx`` (or None) and lexical scores
    (``known[1]``, else looked up in ``lex_hits``) become the model's ``out_k`` best, in its
    order (ties: first-stage order), every per-hit array permuted alike; a query whose text
    is None keeps its first-stage list (the features read the query's text).

    Args:
        kit: the chunk's array kit; stage: a loaded :class:`~rfmem_fast.second_stage.LinearStage`
            / :class:`~rfmem_fast.second_stage.TreeStage`; view: the bank view (its snapshot).
        rows: int64 [b, w] the lists (w >= out_k), scores / dense float32 [b, w], ctx float32
            [b, w] or None, known: (dense, lexical) [b, w] or None; lex_hits: the per-query
            lexical scores (:func:`rfmem_fast.search_lexical.lexical_hits`' form, or a Hybrid).
        texts: b query texts (str / None); mean, ent: float64 [b] the probe's signals.
        out_k: hits kept per query; width: the result's columns (>= out_k).

    Returns:
        (rows, scores, dense, ctx or None, (dense, lexical)) [b, width] in the kit's arrays
        (-1 / -inf / NaN padding).

    Raises:
        ValueError / TypeError: as :func:`rfmem_fast.second_stage_features.stage_features`
            (lists that break its rules: rows of several users, non-finite scores).
    """
    R = kit.lower(rows)
    b, w = R.shape
    if known is not None:
        lex = kit.lower(known[1])
    else:
        hits = lex_hits.hit_list() if isinstance(lex_hits, Hybrid) else lex_hits
        lex = kit.lower(lexical_scores(kit, rows, hits, b, w))
    dn, sc = kit.lower(dense), kit.lower(scores)
    cx = None if ctx is None else kit.lower(ctx)
    F, V = stage_features(view.snapshot, R, texts, dn, lex, sc, cx, kit.lower(mean), kit.lower(ent))
    order, _ = stage.rerank(F, V, out_k)
    plain = np.fromiter((t is None for t in texts), bool, b)
    if plain.any():  # a query without a text keeps its first-stage list
        j = np.arange(out_k)
        first = (j < w)[None, :] & (R[plain][:, np.minimum(j, w - 1)] >= 0)
        order[plain] = np.where(first, j[None, :], -1)
    pick = np.maximum(order, 0)
    pad = order < 0

    def take(a: np.ndarray, fill: Any) -> Any:
        got = np.take_along_axis(a, pick, 1)
        got[pad] = fill
        return kit.lift(fit(got, out_k, width, fill))

    dense_o = take(dn.astype(np.float32, copy=False), np.nan)
    return (take(R, -1), take(sc, -np.inf), dense_o, None if cx is None else take(cx, np.nan),
            (dense_o, take(lex.astype(np.float32, copy=False), np.nan)))  # fmt: skip


def lexical_scores(kit: ArrayKit, rows: Any, hits: list | None, b: int, width: int) -> Any:
    """float32 [b, width] the BM25 of the hits ``rows`` from the per-query lexical scores
    ``hits`` (:func:`rfmem_fast.search_lexical.lexical_hits`' form; 0.0 for a hit without a
    lexical match, NaN at padding and everywhere without ``hits``)."""
    if hits is None:
        return kit.full((b, width), np.nan, np.float32)
    r = kit.lower(rows)
    lex = filled(r.shape, np.nan, np.float32)
    ok = r >= 0
    lex[ok] = 0.0
    for i, h in enumerate(hits):
        if h is not None and ok[i].any():
            lex[i, ok[i]] = h[1][r[i, ok[i]] - h[0]]
    return kit.lift(lex)


def merged(kit: ArrayKit, view: Any, Q: Any, p_rows: Any, hit_rows: Any, reco: Any, everyone: bool, rows: Any,
           scores: Any, out_k: int, config: RFMemConfig) -> tuple[Any, Any]:  # fmt: skip
    """``rows`` / ``scores`` [b, w >= out_k] with the recollecting queries' rows replaced by
    ``config.merge`` of their probe top-k and recollection hits (on the host, batched:
    :func:`rfmem_fast.routing.merge_paths`)."""
    b = rows.shape[0]
    idx = np.arange(b) if everyone else np.flatnonzero(kit.lower(reco))
    if idx.shape[0] == 0:
        return rows, scores
    vectors = view.snapshot.vectors if view.snapshot is not None else view.X.float().cpu().numpy()
    Qh = np.asarray(kit.lower(kit.f32(Q)), dtype=np.float32)
    m_rows, m_sc = merge_paths(
        config.merge, kit.lower(p_rows)[idx], kit.lower(hit_rows)[idx], Qh[idx], vectors, out_k, config.rrf_k,
        config.rescore_weight,
    )  # fmt: skip
    r, s = kit.lower(rows).copy(), kit.lower(scores).copy()
    r[idx] = fit(np.asarray(m_rows, dtype=np.int64), out_k, r.shape[1], -1)
    s[idx] = fit(np.asarray(m_sc, dtype=np.float32), out_k, s.shape[1], -np.inf)
    return kit.lift(r), kit.lift(s)


def candidate_pools(kit: ArrayKit, view: Any, Q: Any, seg: Any, p_rows: Any, hits: Any | None,
                    routes: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The re-ranker's candidate pools of a chunk on the host (:func:`rfmem_fast.routing.candidate_features`):
    the probe's rows ``p_rows`` plus the hits of the queries that recollected."""
    vectors = view.snapshot.vectors if view.snapshot is not None else view.X.float().cpu().numpy()
    if hits is None:
        h = np.zeros((Q.shape[0], 0), dtype=np.int64)
    else:
        h = np.where((kit.lower(routes) == RECOLLECTION)[:, None], kit.lower(hits), -1)
        h = h[:, : int((h >= 0).sum(axis=1).max(initial=0))]  # hits are packed to the left
    prof = profiles_numpy(view)[kit.lower(seg)]
    return candidate_features(kit.lower(p_rows), h, np.asarray(kit.lower(Q), dtype=np.float64), prof, vectors)


def recollect(be: Backend, view: BankView, Q: torch.Tensor, qseg: torch.Tensor, config: RFMemConfig,
              level0: tuple[torch.Tensor, torch.Tensor], active: torch.Tensor | None,
              sel: RowSelection | None = None) -> Any:  # fmt: skip
    """The Recollection path of a chunk; the search chooses the beam driver.

    The backend's fused driver (:meth:`~rfmem_fast.backends.base.Backend.recollect`) when
    it has one in effect (:meth:`~rfmem_fast.backends.base.Backend.fused_driver`: the
    native backend's C++ driver unless ``beam_driver`` / ``RFMEM_BEAM_DRIVER`` say
    "python"), else the portable Python driver :func:`rfmem_fast.recollection.recollect`
    over the backend's primitives; both return the same rows, scores, rounds and hits.

    ``active``: bool [b], the queries to recollect (None: every query); ``sel``: the
    chunk's row selection (filtered search), applied by every round's top-k.

    Returns:
        :class:`~rfmem_fast.backends.base.RecollectionOutput`.
    """
    skw = {} if sel is None else {"sel": sel}
    if be.fused_driver():
        return be.recollect(view, Q, qseg, config, level0=level0, active=active, **skw)
    return _recollection.recollect(be, view, Q, qseg, config, level0, active, **skw)
