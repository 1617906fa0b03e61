"""The lexical channel inside a search: BM25 hits fused with the exact dense list of a chunk.

What :func:`rfmem_fast.search_chunk.run_chunk` calls when ``config.lexical_weight > 0`` with
query texts (README "Hybrid retrieval"; rules and exactness proof in
:mod:`rfmem_fast.fusion`), or when the context score needs every row's scan score
(:mod:`rfmem_fast.context`):

* :func:`hybrid` / :func:`hybrid_batched` / :func:`hybrid_loop`: the fused top-k on the
  host after the dense probe (any backend, filtered queries, fusion "rrf");
* :class:`KernelHits`, :func:`hybrid_recorded`, :func:`context_probe`: the kernels of a
  backend with ``has_fused_topk`` (``Backend.bm25_hits``; ``Backend.probe_hits``, the dense
  probe recording the hits' keys, then ``Backend.fused_topk``; ``Backend.hybrid_probe`` for
  the context score);
* :func:`lexical_hits`: each query's BM25 over its user's rows (the hits' lexical scores).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .backends.base import SegmentScores, all_row_hits, segment_ptr
from .backends.exact import abs_error_term, exact_pair_scores_np, scan_error_coef
from .bank import BankSnapshot
from .config import RFMemConfig
from .filters import RowSelection
from .fusion import (
    BOOST_FACTORS,
    TOP_LEXICAL,
    BoostFactors,
    LexicalStats,
    item_mean,
    rrf,
    top_by_score_row,
    user_means,
    zscore_stats,
)

__all__ = ["HYBRID_DENSE_DEPTH", "ONE_PASS_FUSIONS", "HYBRID_MATRIX_ENTRIES", "Hybrid", "KernelHits", "context_probe",
           "hybrid", "hybrid_recorded", "lexical_hits", "probe_fused"]

#: exact dense candidates per query of the convex / adaptive fusions (at least the fused
#: width): the wider the dense list, the lower its last score ``s_K`` and the fewer
#: lexical hits pass the bound of :mod:`rfmem_fast.fusion` and need an exact re-score;
#: results do not depend on it
HYBRID_DENSE_DEPTH = 64
#: fusions whose boosts are known before the dense scan (no dense statistic in them): the
#: context score's pass (``Backend.hybrid_probe``) takes their fused top-k in the scan
#: itself; "zscore" needs the dense top-1 first (its boosts follow the probe, then
#: ``Backend.fused_topk`` fuses with the recorded scan scores, without scoring again)
ONE_PASS_FUSIONS = ("convex", "adaptive")


@dataclass
class Hybrid:
    """The fused top ``k_f`` of a chunk (host arrays [b, k_f]; -1 / -inf / NaN padding) and
    the per-query lexical scores (:func:`lexical_hits`)."""

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


def lexical_hits(snap: BankSnapshot, seg: np.ndarray, texts: list, sel: RowSelection | None = None) -> list:
    """Per query: None (no lexical hit) or (first row of its user, float64 [n_u] BM25 of the
    user's rows, the user's document count N): :class:`rfmem_fast.lexical.LexicalIndex`.
    With a selection, a filtered query's hits outside it are dropped (score 0)."""
    lex, off = snap.lexical, snap.offsets
    qterms, qcnt, qptr = lex.encode_queries(texts)
    p = qptr.tolist()
    out: list = []
    for i in range(len(texts)):
        qt, qc = qterms[p[i] : p[i + 1]], qcnt[p[i] : p[i + 1]]
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


def selected_means(view: Any, sel: RowSelection, seg: np.ndarray, means: np.ndarray) -> np.ndarray:
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


def pad_lists(parts: list, b: int, fill: Any, dtype: Any) -> np.ndarray:
    """[b, max len] array of b 1-D arrays, right-padded with ``fill``."""
    lens = np.fromiter((p.shape[0] for p in parts), np.int64, b)
    E = int(lens.max(initial=0))
    out = np.full((b, E), fill, dtype=dtype)
    if E:
        qi = np.repeat(np.arange(b), lens)
        col = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        out[qi, col] = np.concatenate(parts)
    return out


#: entries of the [queries, user rows] BM25 matrix of one step of :func:`hybrid` (bounds its memory)
HYBRID_MATRIX_ENTRIES = 1 << 22


def hybrid(view: Any, Q: torch.Tensor, qseg: torch.Tensor, p_sc: torch.Tensor, p_rows: torch.Tensor, texts: list,
           config: RFMemConfig, k_f: int, kd: int, be: Any, sel: RowSelection | None = None,
           want_boosts: bool = False) -> Hybrid:  # fmt: skip
    """The fused top ``k_f`` of every query (:mod:`rfmem_fast.fusion`, whose docstring proves it exact).

    rrf: :func:`hybrid_loop`. convex / adaptive / zscore: batched numpy over the queries,
    in steps of at most :data:`HYBRID_MATRIX_ENTRIES` BM25 entries (queries x their users'
    rows); a backend with ``has_fused_topk`` fuses in its probe's pass instead
    (:func:`rfmem_fast.search_chunk.run_chunk`, unfiltered queries). Both give the same rows and scores
    (tests/test_lexical.py). ``sel``: the filtered queries' lexical hits outside their
    selection are dropped before the fusion (the dense list ``p_sc`` / ``p_rows`` is
    already filtered); the per-query statistics (the lexical maximum and top scores,
    zscore's spreads and dense mean) are those of the matching items. ``want_boosts``: also
    the boost of every segment row of each query (``Hybrid.boost_rows``; convex / adaptive
    / zscore), the context score's."""
    if config.fusion == "rrf":
        return hybrid_loop(view, Q, qseg, p_sc, p_rows, texts, config, k_f, kd, be.memory_budget, sel)
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
        parts.append(hybrid_batched(view, Q[a:c], seg[a:c], p_sc[a:c], p_rows[a:c], texts[a:c], config, k_f, kd,
                                    part_sel, want_boosts))  # fmt: skip
        a = c
    if len(parts) == 1:
        return parts[0]
    return Hybrid(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("rows", "fused", "dense", "lex")),
                  hits=[h for p in parts for h in p.hits],
                  boost_rows=[x for p in parts for x in p.boost_rows] if want_boosts else None,
                  lex_rows=[x for p in parts for x in p.lex_rows] if want_boosts else None)  # fmt: skip


def hybrid_batched(view: Any, Q: torch.Tensor, seg: np.ndarray, p_sc: torch.Tensor, p_rows: torch.Tensor, texts: list,
                   config: RFMemConfig, k_f: int, kd: int, sel: RowSelection | None = None,
                   want_boosts: bool = False) -> Hybrid:  # fmt: skip
    """convex / adaptive / zscore fusion of b queries with one BM25 matrix V [b, longest user]
    (see :func:`hybrid_loop`); ``want_boosts``: every row's boost too (:func:`hybrid`)."""
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
    qterms, qcnt, qptr = lex.encode_queries(texts)
    p = qptr.tolist()
    for i in range(b):
        qt, qc = qterms[p[i] : p[i + 1]], qcnt[p[i] : p[i + 1]]
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
            means = selected_means(view, sel, seg, means)
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
    fac = BOOST_FACTORS[config.fusion](stats, config)  # the per-query factors, once
    boost_rows = lex_rows = None
    if want_boosts:  # every row's boost (0 where no lexical hit), as the fused scores below use it, and BM25
        BX = fac.matrix(V)
        boost_rows = [BX[i, : n_q[i]] if lex_max[i] > 0 else None for i in range(b)]
        lex_rows = [V[i, : n_q[i]] if lex_max[i] > 0 else None for i in range(b)]
    fd = np.where(valid, ps + fac.matrix(lex_d), -np.inf)
    tau = -np.partition(-fd, k_f - 1, axis=1)[:, k_f - 1] if kd >= k_f else np.full(b, -np.inf)
    s_last = np.where(valid[:, -1], ps[:, -1], -np.inf)
    M = V > 0
    qv, cv = np.nonzero(valid)
    M[qv, loc[qv, cv]] = False  # the dense list's rows: not extras
    qe, le = np.nonzero(M)  # lexical hits outside the dense list, by query then row
    lexe = V[qe, le]
    xe = fac.at(lexe, qe)
    keep = s_last[qe] + xe >= tau[qe]  # the bound of the fusion docstring
    qe, le, lexe, xe = qe[keep], le[keep], lexe[keep], xe[keep]
    re = le + a_q[qe]
    de = np.zeros(qe.shape[0])
    if qe.shape[0]:
        # screen with float32 scores f and their bound |f - RN32(q.x)| <= B(q) (any
        # summation order: depth d, rfmem_fast.backends.exact): a hit whose fused score
        # cannot reach tau even at f + B is dropped without its exact score
        Qh = Q.detach().to(torch.float32).cpu().numpy()
        f = screen_scores(snap.vectors, off, Qh, seg, qe, re)
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
    return Hybrid(rows=np.where(ok, r_sel, -1), fused=np.where(ok, f_sel, -np.inf),
                  dense=np.where(ok, dense[ri, sel], np.nan), lex=np.where(ok, lexc[ri, sel], np.nan), hits=hits,
                  boost_rows=boost_rows, lex_rows=lex_rows)  # fmt: skip


class SparseBM25:
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
class KernelHits:
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
    def of(cls, be: Any, view: Any, seg: np.ndarray, texts: list) -> "KernelHits":
        """Tokenise the b query texts and take their hits in their users' postings.

        The texts are encoded as one batch (:meth:`rfmem_fast.lexical.LexicalIndex.encode_queries`),
        the users of the queries with a known token get their postings once each (numbered in
        order of first appearance), and ``Backend.bm25_hits`` scores them. The kernel scores
        items on their own rows (the postings' rows), so the statistics (max, top, s1, s2)
        count each item once; the hits are then scattered to every row of a chunked item
        (:meth:`rfmem_fast.lexical.UserPostings.scatter_hits`).

        Args:
            be: a backend with ``has_fused_topk``; view: its bank view (with a snapshot
                holding a lexical index).
            seg: int [b] each query's segment (user index); texts: b str or None.

        Returns:
            KernelHits of the b queries (a query without a known token: no hit, ``n_docs`` 0,
            ``n_items`` its segment's rows).

        Raises:
            TypeError: ``texts[i]`` is neither a str nor None.
        """
        lex = view.snapshot.lexical
        off = view.snapshot.offsets
        b = len(texts)
        seg = np.asarray(seg, dtype=np.int64)
        qterms, qcnt, qptr = lex.encode_queries(texts)
        # the users of the queries with a known token, numbered in order of first appearance
        # (a query's slot in ``users``; -1: no known token). Python lists: one query's
        # preparation is a few numpy calls less (each several us with the caches cold)
        qp = qptr.tolist()
        slot: dict[int, int] = {}
        qu = [slot.setdefault(u, len(slot)) if qp[i + 1] > qp[i] else -1 for i, u in enumerate(seg.tolist())]
        plist = [lex.postings(u) for u in slot]
        users = [(P.terms, P.ptr, P.rows, P.weight, P.n_rows) for P in plist]
        quser = np.array(qu, dtype=np.int64)
        # per slot, then a 0 for the queries without one (quser -1)
        n_docs = np.array([P.n_docs for P in plist] + [0], dtype=np.int64)[quser]
        # the segment's rows, less a chunked user's extra chunk rows
        n_items = (off[seg + 1] - off[seg]).astype(np.int64, copy=False)
        got = list(be.bm25_hits(users, quser, qterms, qcnt, qptr))
        if any(P.chunk_ptr is not None for P in plist):
            known = quser >= 0
            n_items[known] = np.array([P.n_items for P in plist], dtype=np.int64)[quser[known]]
            hp, hr, hv = got[:3]
            rows, vals = [], []
            for i in range(b):
                r, v = hr[hp[i] : hp[i + 1]], hv[hp[i] : hp[i + 1]]
                if qu[i] >= 0:
                    r, v = plist[qu[i]].scatter_hits(r, v)
                rows.append(r)
                vals.append(v)
            ptr = np.zeros(b + 1, dtype=np.int64)
            np.cumsum([r.shape[0] for r in rows], out=ptr[1:])
            got[:3] = ptr, np.concatenate(rows).astype(np.int32, copy=False), np.concatenate(vals).astype(np.float64)
        return cls(*got, n_docs=n_docs, n_items=n_items)

    def factors(self, config: RFMemConfig, extra: tuple | None) -> BoostFactors:
        """The per-query factors of ``config.fusion``'s boost (:data:`rfmem_fast.fusion.BOOST_FACTORS`,
        once per query: scale float64 [b], den float64 [b] or None).

        Args:
            config: the RFMemConfig (``fusion`` "convex" / "adaptive" / "zscore", its weight and norm).
            extra: (lex_std, dense_gap) float64 [b] for "zscore" (:func:`zscore_extra`), else None.

        Raises:
            KeyError: ``config.fusion`` is not a score-based fusion ("rrf").
            ValueError: "zscore" without ``extra``.
        """
        stats = LexicalStats(self.lex_max, self.top, self.n_docs, *(extra or (None, None)))
        return BOOST_FACTORS[config.fusion](stats, config)

    def boosts(self, config: RFMemConfig, extra: tuple | None) -> np.ndarray:
        """float64 [H] the boost of every hit (C-contiguous): :meth:`factors` applied to the
        flat hits (:meth:`rfmem_fast.fusion.BoostFactors.flat`), bit for bit the [b, c]
        boosts of :data:`rfmem_fast.fusion.BOOSTS`.

        Raises:
            KeyError / ValueError: as :meth:`factors`.
        """
        hx = self.factors(config, extra).flat(self.hval, self.hptr)
        return np.ascontiguousarray(hx, dtype=np.float64)

    def hit_list(self, view: Any, seg: np.ndarray) -> list:
        """The per-query lexical scores in :func:`lexical_hits`' form (a sparse vector each)."""
        a_q = view.snapshot.offsets[seg]
        p, r, v = self.hptr, self.hrows, self.hval
        return [(int(a_q[i]), SparseBM25(r[p[i] : p[i + 1]], v[p[i] : p[i + 1]]), int(self.n_docs[i]))
                if p[i + 1] > p[i] else None for i in range(p.shape[0] - 1)]  # fmt: skip


def hybrid_recorded(be: Any, view: Any, Q: np.ndarray, seg: np.ndarray, p_sc: np.ndarray, p_rows: np.ndarray,
                    kh: KernelHits, hf: np.ndarray, config: RFMemConfig, k_f: int,
                    hup: np.ndarray | None = None) -> Hybrid:  # fmt: skip
    """The fused top ``k_f`` (fusions "convex", "adaptive", "zscore") on a backend with
    ``has_fused_topk``, after a probe that recorded the hits' keys (``Backend.probe_hits``:
    ``hf`` with offsets ``hup``; ``Backend.hybrid_probe``: scan scores ``hf``, ``hup`` None):
    the boosts ("zscore"'s need the exact dense top-1, :func:`hybrid_batched`'s statistics,
    sums in row order), then ``Backend.fused_topk`` fuses the probe's exact dense list
    (``p_sc`` float32 / ``p_rows`` int64 [b, K], K >= ``k_f`` or the whole segment; host
    arrays, as ``Q`` float32 [b, d]) with the hits, reading their recorded keys (no second
    scoring of a row whose key was recorded).

    Returns:
        :class:`Hybrid` of the fused top ``k_f`` (numpy, [b, k_f]).

    Raises:
        ValueError: malformed hits or keys (from the kernel, ``Backend.fused_topk``).
    """
    extra = zscore_extra(view, Q, seg, p_sc, p_rows, kh) if config.fusion not in ONE_PASS_FUSIONS else None
    hx = kh.boosts(config, extra)
    rows, fused, dense, lexv = be.fused_topk(view, Q, seg, p_sc, p_rows, kh.hptr, kh.hrows, hx, kh.hval, k_f, hf=hf,
                                             hup=hup)  # fmt: skip
    return Hybrid(rows=rows, fused=fused, dense=dense.astype(np.float64), lex=lexv, hits=lambda: kh.hit_list(view, seg))


def probe_fused(be: Any, view: Any, Q: np.ndarray, seg: np.ndarray, k: int, probe_k: int, config: RFMemConfig,
                kh: KernelHits, k_f: int) -> tuple:  # fmt: skip
    """The dense probe and the fused top ``k_f`` of b queries on a backend with
    ``has_fused_topk`` (no row selection). Fusions "convex" / "adaptive" (their boosts need
    no dense score): ONE call, ``Backend.probe_hits`` with the boosts' per-query factors
    (:meth:`KernelHits.factors`), each query's boosts and fused list taken on the scan's
    threads right after its dense list and its hits' keys.
    "zscore" (its boosts need the dense top-1): ``Backend.probe_hits`` recording the keys,
    then :func:`hybrid_recorded`. Both give ``Backend.fused_topk``'s list, bit for bit.

    Args:
        be, view: the backend and its bank view; Q: float32 [b, d] C-contiguous unit
            queries, seg: int64 [b] their segments (host arrays); k, probe_k: the probe's
            width (>= ``k_f`` or the longest queried segment) and its signals' K;
            config: the RFMemConfig (``fusion``, ``temperature``, ``entropy``); kh: the
            queries' :class:`KernelHits`; k_f: width of the fused list.

    Returns:
        ((scores float32, rows int64 [b, k], mean, entropy float64, count int64 [b]) of the
        probe, numpy; the fused list as a :class:`Hybrid`, [b, k_f]).

    Raises:
        ValueError: malformed hits (from the kernel).
    """
    if config.fusion not in ONE_PASS_FUSIONS:
        probe, hf, hup = be.probe_hits(view, Q, seg, k, probe_k, config.temperature, config.entropy, kh.hptr,
                                       kh.hrows)  # fmt: skip
        return probe, hybrid_recorded(be, view, Q, seg, probe[0], probe[1], kh, hf, config, k_f, hup)
    kf = min(k_f, k)  # (k < k_f only when every dense list holds its whole segment: the rest is padding)
    f = kh.factors(config, None)  # (the kernel applies them to the hits on its threads)
    probe, _, _, (rows, fused, dense, lexv) = be.probe_hits(
        view, Q, seg, k, probe_k, config.temperature, config.entropy, kh.hptr, kh.hrows, hval=kh.hval, kf=kf,
        hscale=np.ascontiguousarray(f.scale, dtype=np.float64),
        hden=None if f.den is None else np.ascontiguousarray(f.den, dtype=np.float64),
    )  # fmt: skip
    if kf < k_f:
        w = ((0, 0), (0, k_f - kf))
        rows, fused = np.pad(rows, w, constant_values=-1), np.pad(fused, w, constant_values=-np.inf)
        dense, lexv = np.pad(dense, w, constant_values=np.nan), np.pad(lexv, w, constant_values=np.nan)
    return probe, Hybrid(rows=rows, fused=fused, dense=dense.astype(np.float64), lex=lexv,
                         hits=lambda: kh.hit_list(view, seg))  # fmt: skip


def zscore_extra(view: Any, Q: np.ndarray | torch.Tensor, seg: np.ndarray, ps: np.ndarray, pr: np.ndarray,
                 kh: KernelHits) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(lex_std, dense_gap) of fusion "zscore" from the kernel's hits and the exact dense
    probe: :func:`rfmem_fast.fusion.zscore_stats` over each query's items (a chunked item
    once), the dense mean from the user's mean vector.

    Args:
        view: the bank view; Q: float32 [b, d] unit queries (numpy or a CPU tensor);
            seg: int64 [b] their segments; ps float32 / pr int64 [b, k]: the exact dense
            probe (k >= 1, -1 padding); kh: the queries' :class:`KernelHits`.

    Returns:
        (lex_std, dense_gap): float64 [b] each.
    """
    Qh = Q.detach().numpy() if isinstance(Q, torch.Tensor) else Q
    mean_d = np.einsum("ij,ij->i", Qh.astype(np.float64), user_means(view, seg))
    n = np.maximum(kh.n_items, 1).astype(np.float64)  # the items (a chunked item once)
    return zscore_stats(kh.s1, kh.s2, n, mean_d, ps[:, 0], pr[:, 0] >= 0)


def context_probe(be: Any, view: Any, Q: torch.Tensor, seg: np.ndarray, texts: list | None, config: RFMemConfig,
                  k: int, probe_k: int, k_f: int) -> tuple:  # fmt: skip
    """The probe of an unfiltered chunk with the context score on a backend with
    ``has_fused_topk``: ONE pass (``Backend.hybrid_probe``) gives the dense probe, the fused
    top ``k_f`` (with ``texts``) and the scan score of EVERY row of each query's segment
    (every row passed as a "hit": the kernel records each hit's scan score); no second scan.

    Returns:
        ((scores, rows, mean, entropy, count) of the probe, the fused list as a
        :class:`Hybrid` or None without texts, :class:`SegmentScores`, the boost of every
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
        kh = KernelHits.of(be, view, seg, texts)
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
            hyb = Hybrid(rows=fr, fused=ff, dense=fd.astype(np.float64), lex=fl, hits=lambda: kh.hit_list(view, seg))
        else:  # zscore: the boosts need the exact dense top-1 of the probe
            hx = kh.boosts(config, zscore_extra(view, Q, seg, p_sc.numpy(), p_rows.numpy(), kh))
            ax[flat] = hx
            rows, fused, dense, lexv = be.fused_topk(view, Q, seg, p_sc.numpy(), p_rows.numpy(), kh.hptr, kh.hrows, hx,
                                                     kh.hval, k_f, hf=np.ascontiguousarray(hf[flat]))  # fmt: skip
            hyb = Hybrid(rows=rows, fused=fused, dense=dense.astype(np.float64), lex=lexv,
                         hits=lambda: kh.hit_list(view, seg))  # fmt: skip
        hp = kh.hptr.tolist()
        boosts = ax  # aligned with the scan scores (rfmem_fast.context.context_topk)
        pl = ptr.tolist()
        lex = [aval[pl[i] : pl[i + 1]] if hp[i + 1] > hp[i] else None for i in range(b)]
    scan = SegmentScores(hf, ptr, *be.scan_score_bound(view))
    return (p_sc, p_rows, mean, ent, count), hyb, scan, boosts, (lex if texts is not None else None)


def screen_scores(X: np.ndarray, off: np.ndarray, Qh: np.ndarray, seg: np.ndarray, qe: np.ndarray,
                  re: np.ndarray) -> np.ndarray:  # fmt: skip
    """float32 scores (as float64 [m]) of the pairs (query ``qe``, row ``re``), any summation
    order (the bound of :func:`hybrid_batched` covers it): gathered rows, or, for a user
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


def hybrid_loop(view: Any, Q: torch.Tensor, qseg: torch.Tensor, p_sc: torch.Tensor, p_rows: torch.Tensor, texts: list,
                config: RFMemConfig, k_f: int, kd: int, memory_budget: int,
                sel: RowSelection | None = None) -> Hybrid:  # fmt: skip
    """The fused top ``k_f`` of every query, one query at a time (fusion "rrf"; any fusion).

    Candidates: the backend's exact dense top ``kd`` (``p_sc`` / ``p_rows``, the probe)
    plus the query's lexical hits outside it that can still enter (convex / adaptive:
    ``fl(s_kd + boost) >= tau``, re-scored exactly with
    :func:`rfmem_fast.backends.exact.exact_pair_scores`; rrf: the lexical top D, whose
    dense rank is "absent"). Host numpy; one loop over the queries for their postings."""
    snap = view.snapshot
    seg = qseg.cpu().numpy()
    b = len(texts)
    info = lexical_hits(snap, seg, texts, sel)
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
    erows = pad_lists(ex_rows, b, -1, np.int64)
    elex = pad_lists(ex_lex, b, 0.0, np.float64)
    evalid = erows >= 0
    dense_d = np.where(valid, ps, np.nan)
    dense_e = np.full(erows.shape, np.nan)
    if rrf_mode and any(x.shape[0] for x in ex_dense):
        dense_e = pad_lists([x if x.shape[0] else np.full(r.shape[0], np.nan) for x, r in zip(ex_dense, ex_rows)],
                            b, np.nan, np.float64)  # fmt: skip
    if rrf_mode:
        drank = np.where(valid, np.arange(1, kd + 1)[None, :], 0)
        fd = np.where(valid, rrf(drank, lrank_d, config.lexical_rrf_k), -np.inf)
        erank = pad_lists(ex_rank, b, 0, np.int64)
        fe = np.where(evalid, rrf(np.zeros_like(erank), erank, config.lexical_rrf_k), -np.inf)
    else:
        fac = BOOST_FACTORS[config.fusion](LexicalStats(lex_max, top, n_docs), config)
        fd = np.where(valid, ps + fac.matrix(lex_d), -np.inf)
        xe = fac.matrix(elex)
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
    return Hybrid(
        rows=np.where(ok, r_sel, -1), fused=np.where(ok, f_sel, -np.inf), dense=np.where(ok, take(dense), np.nan),
        lex=np.where(ok, take(lexc), np.nan), hits=info,
    )  # fmt: skip
