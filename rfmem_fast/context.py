"""The context score: memories that know their conversation (``RFMemConfig.context_weight``,
``context_radius``, ``thread_weight``; docs "Conversations").

Definition (the config's docstring states it too). ``b_i`` is item ``i``'s base score
under the config: its exact dense score ``RN32(q . x_i)`` widened to float64, plus, with
the lexical channel on, its fusion boost ``x_i`` (:mod:`rfmem_fast.fusion`: ``b_i =
fl64(e_i + x_i)``); an item stored as several chunk rows has the largest base score of
its visible rows. Among the VISIBLE items of ``i``'s thread (the query's filters keep
them), ordered by (position, row; an item without a position after those with one),
``N(i)`` holds those at most ``r`` ranks from ``i`` (``i`` excluded) and ``T(i)`` is the
largest base score of the thread (``i`` included). In float64, in this order::

    c_row = b_row + w_n * M(i) + w_s * T(i),   M(i) = max_{j in N(i)} b_j   (0 when N(i) is empty)

for every visible row of item ``i`` (an item's best row scores the item's ``c``); an
item without a thread is a thread of its own (``T(i) = b_i``, no neighbour). The
result is the top-k of ``c`` over the visible rows, ties broken by the smaller row.

How it is computed (:func:`context_topk`), for each query on its own (so the result
does not depend on the batch):

1. The scan scores ``f`` of EVERY row of the query's segment (:class:`SegmentScores`: the
   native backend records them in the probe's own pass, ``Backend.hybrid_probe``; the
   others compute them with one matrix product per segment, ``Backend.segment_scores``),
   with the scan's proven bound ``|f - e| <= B`` (:mod:`rfmem_fast.backends.exact`).
2. Approximate base scores ``b~ = f + x`` (``|b~ - b| <= Bb = B + 2 u64 M``, ``M`` a bound of
   the magnitudes: one float64 rounding each), and from them, vectorised over the segment
   with arrays built once per (snapshot, user, r) (:class:`_Layout`): the items of each
   thread laid out in order with ``r`` ``-inf`` sentinels between threads, so the
   neighbour maximum is a sliding-window maximum (``log2 r`` shifted ``np.maximum`` calls,
   two reads), the thread maximum one ``np.maximum.reduceat``; then ``c~`` of every row.
   Each true ``c`` lies within ``Bc = (1 + w_n + w_s) (Bb + 8 u64 M')`` of ``c~``
   (``max`` is 1-Lipschitz; the float64 roundings of both evaluations counted).
3. The exact finish: with ``t`` the k-th largest ``c~``, every row of the exact top-k has
   ``c~ >= t - 2 Bc`` (the k rows of largest ``c~`` have ``c >= t - Bc``, so the k-th
   largest exact ``c`` is ``>= t - Bc``). For those candidates the exact ``c`` needs the
   exact base scores of: the candidate rows (and their items' other rows), each
   neighbour ``j`` with ``b~_j >= M~(i) - 2 Bb`` (the others cannot hold the maximum: the
   true maximum is ``>= M~ - Bb`` and such a ``j`` has ``b_j < M~ - Bb``), and each item
   of a candidate's thread with ``b~ >= T~ - 2 Bb``. Those rows get their exact dense
   scores (:func:`rfmem_fast.backends.exact.exact_pair_scores_np`, one call for the
   batch); the maxima over the exact values of these and the approximate values of the
   rest are the exact maxima; the candidates' ``c`` are evaluated as above and the top-k
   taken by (``c`` descending, row ascending).

So every backend returns the same rows and the same float64 ``c`` as a plain float64
oracle that scores every row exactly (tests/test_context.py). Cost per query: the rows'
scan scores (free on the native backend's hybrid probe), ~20 numpy calls over the
segment (a few microseconds each for 4,096 rows) and the exact scores of a few dozen rows.

Filters: a filtered query's invisible rows get ``-inf``; its layout is compacted to the
visible items (ranks among the visible items of a thread), so a filter that drops a turn
makes the turns around it neighbours.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends.base import SegmentScores
from .backends.exact import exact_pair_scores_np
from .bank import NO_POSITION, BankSnapshot
from .lexical import item_rows

U64 = 2.0**-53
#: relative inflation of the bounds (covers their own float64 evaluation)
_SLACK = 1.0 + 1e-9

__all__ = ["SegmentScores", "build_layout", "context_topk"]


@dataclass
class _Layout:
    """One user's conversation structure for a radius ``r``, from one snapshot (built once, cached).

    Attributes:
        n: rows of the segment.
        item_of: int64 [n] the local row of each row's item (chunked items,
            :func:`rfmem_fast.lexical.item_rows`), or None when every row is an item.
        chunk_rows / chunk_items: int64 the extra chunk rows and their items (empty without).
        lay: int64 [L] the local item row at each layout position (0 at the sentinels).
        sent: int64 the sentinel positions; is_sent: bool [L].
        ipos: int64 [m] the layout positions of the laid-out items (threads of at least
            two items), in layout order; irow: int64 [m] their rows; tid: int64 [m]
            their thread (block) index; tstart: int64 [nt] each block's first position
            (a block: its items, then ``r`` sentinels); the layout starts with ``r``
            sentinels.
        pos_of: int64 [n] the layout position of each laid-out item's row, -1 elsewhere.
        tid_of: int64 [L] the block of each item position (-1 at the sentinels).
    """

    n: int
    r: int
    item_of: np.ndarray | None
    chunk_rows: np.ndarray
    chunk_items: np.ndarray
    lay: np.ndarray
    sent: np.ndarray
    is_sent: np.ndarray
    ipos: np.ndarray
    irow: np.ndarray
    tid: np.ndarray
    tstart: np.ndarray
    pos_of: np.ndarray
    tid_of: np.ndarray
    item_ptr: np.ndarray | None = None  # int64 [n + 1] CSR of each item row's rows (chunked users)
    item_rows: np.ndarray | None = None

    @property
    def num_threads(self) -> int:
        return int(self.tstart.shape[0])

    def rows_of_items(self, items: np.ndarray) -> np.ndarray:
        """int64: every row of the given item rows (the items themselves without chunks)."""
        if self.item_ptr is None:
            return items
        a, b = self.item_ptr[items], self.item_ptr[items + 1]
        lens = b - a
        idx = np.repeat(a - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
        return self.item_rows[idx]


def _thread_order(threads: list, positions: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows of the threaded items sorted by (thread, position, row; no position last),
    their thread codes), threads coded in order of first appearance."""
    codes: dict = {}
    code = np.fromiter((codes.setdefault(t, len(codes)) for t in threads), np.int64, len(threads))
    pos = positions
    nopos = (pos == NO_POSITION).astype(np.int64)
    order = np.lexsort((rows, np.where(nopos == 1, 0, pos), nopos, code))
    return rows[order], code[order]


def build_layout(snap: BankSnapshot, u: int, r: int) -> _Layout:
    """The :class:`_Layout` of segment ``u`` of ``snap`` for radius ``r`` (O(n_u log n_u))."""
    a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
    n = b - a
    ids = snap.item_ids[a:b].tolist()
    if snap.lexical is not None:
        has_text = snap.lexical.has_text[a:b]
    else:
        has_text = np.fromiter((t is not None for t in (snap.texts[a:b] if snap.texts is not None else [None] * n)),
                               np.bool_, n)  # fmt: skip
    io = item_rows(ids, has_text) if n else None
    item_of = None if io is None else io.astype(np.int64)
    if item_of is None:
        items = np.arange(n, dtype=np.int64)
        chunk_rows = chunk_items = np.zeros(0, dtype=np.int64)
        item_ptr = item_rws = None
    else:
        is_item = item_of == np.arange(n)
        items = np.flatnonzero(is_item)
        chunk_rows = np.flatnonzero(~is_item)
        chunk_items = item_of[chunk_rows]
        order = np.lexsort((np.arange(n), ~is_item, item_of))  # each item's own row first, then its chunks
        cnt = np.bincount(item_of, minlength=n)
        item_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(cnt, out=item_ptr[1:])
        item_rws = order.astype(np.int64)
    thr = snap.threads[a:b] if snap.threads is not None else None
    pos = snap.positions[a:b] if snap.positions is not None else np.full(n, NO_POSITION, dtype=np.int64)
    if thr is not None:
        t_items = thr[items]
        has = np.not_equal(t_items, None)
        trows = items[has]
    else:
        trows = np.zeros(0, dtype=np.int64)
    if trows.shape[0]:
        srows, scode = _thread_order(thr[trows].tolist(), np.asarray(pos[trows], dtype=np.int64), trows)
        new = np.ones(srows.shape[0], dtype=np.bool_)
        new[1:] = scode[1:] != scode[:-1]
        tnum = np.cumsum(new) - 1
        size = np.bincount(tnum)
        multi = size[tnum] >= 2  # a thread of one item has no neighbour: laid out as a free item
        srows, tnum = srows[multi], tnum[multi]
        _, tid = np.unique(tnum, return_inverse=True)
        tid = tid.astype(np.int64).reshape(-1)
    else:
        srows = tid = np.zeros(0, dtype=np.int64)
    m = srows.shape[0]
    nt = int(tid.max()) + 1 if m else 0
    ipos = np.arange(m, dtype=np.int64) + r * (tid + 1)
    L = m + r * (nt + 1)
    lay = np.zeros(L, dtype=np.int64)
    lay[ipos] = srows
    is_sent = np.ones(L, dtype=np.bool_)
    is_sent[ipos] = False
    tstart = np.zeros(nt, dtype=np.int64)
    if m:
        first = np.ones(m, dtype=np.bool_)
        first[1:] = tid[1:] != tid[:-1]
        tstart = ipos[first]
    pos_of = np.full(n, -1, dtype=np.int64)
    pos_of[srows] = ipos
    tid_of = np.full(L, -1, dtype=np.int64)
    tid_of[ipos] = tid
    return _Layout(n=n, r=r, item_of=item_of, chunk_rows=chunk_rows, chunk_items=chunk_items, lay=lay,
                   sent=np.flatnonzero(is_sent), is_sent=is_sent, ipos=ipos, irow=srows, tid=tid, tstart=tstart,
                   pos_of=pos_of, tid_of=tid_of, item_ptr=item_ptr, item_rows=item_rws)  # fmt: skip


def _layout(memo: dict, snap: BankSnapshot, u: int, r: int) -> _Layout:
    """:func:`build_layout`, memoised in ``memo`` (a bank view's memo: one snapshot)."""
    cache = memo.setdefault("context_layouts", {})
    got = cache.get((u, r))
    if got is None:
        got = cache[(u, r)] = build_layout(snap, u, r)
    return got


def _window_max(A: np.ndarray, r: int) -> np.ndarray:
    """``W[j] = max(A[j .. j + r - 1])`` for ``j = 0 .. len(A) - r`` (log2 r + 1 maxima)."""
    cur, w = A, 1
    while 2 * w <= r:
        cur = np.maximum(cur[:-w], cur[w:])
        w *= 2
    if w < r:
        L = A.shape[0]
        cur = np.maximum(cur[: L - r + 1], cur[r - w : r - w + L - r + 1])
    return cur


@dataclass
class _Query:
    """One query's state between the approximate pass and the exact finish."""

    i: int
    a: int
    lay: Any  # (lay, is_sent, ipos, irow, tid, tstart, pos_of) of the query's (possibly compacted) layout
    A: np.ndarray
    W: np.ndarray
    cand: np.ndarray  # local candidate rows
    need: np.ndarray  # local rows needing an exact score
    vis: np.ndarray | None


def _approximate(L: _Layout, v: np.ndarray, x: np.ndarray | None, vis: np.ndarray | None, Bb: float, Bc: float,
                 k: int, w_n: float, w_s: float) -> tuple:  # fmt: skip
    """The approximate pass of one query: (candidate rows, rows to score exactly, its layout
    arrays, A, W). ``v``: float64 [n] approximate base scores (invisible rows -inf)."""
    r = L.r
    if L.item_of is not None and L.chunk_rows.shape[0]:  # an item's base score: its best (visible) row
        bi = v.copy()
        np.maximum.at(bi, L.chunk_items, v[L.chunk_rows])
    else:
        bi = v
    lay, is_sent, ipos, irow, tid, tstart, pos_of = L.lay, L.is_sent, L.ipos, L.irow, L.tid, L.tstart, L.pos_of
    if vis is not None and ipos.shape[0]:  # ranks among the visible items only: compact the layout
        vis_item = bi > -np.inf
        keep = is_sent | vis_item[lay]
        cnt = np.add.reduceat(keep, tstart, dtype=np.int64) if tstart.shape[0] else np.zeros(0, dtype=np.int64)
        lay, is_sent = lay[keep], is_sent[keep]
        ipos = np.flatnonzero(~is_sent)
        irow = lay[ipos]
        per = cnt - r  # visible items per thread
        tid = np.repeat(np.arange(per.shape[0], dtype=np.int64), per)
        tstart = r + np.concatenate(([0], np.cumsum(cnt)[:-1])).astype(np.int64) if cnt.shape[0] else tstart
        pos_of = np.full(L.n, -1, dtype=np.int64)
        pos_of[irow] = ipos
    c = v.copy()
    A = W = None
    if ipos.shape[0]:
        A = bi[lay]
        A[is_sent] = -np.inf
        if w_n > 0:
            W = _window_max(A, r)
            nm = np.maximum(W[ipos - r], W[ipos + 1])
            if vis is not None:
                nm = np.where(nm > -np.inf, nm, 0.0)  # an item alone among the visible ones of its thread
            NM = np.zeros(L.n)
            NM[irow] = nm
            if L.item_of is not None:
                NM = NM[L.item_of]
            NM *= w_n
            c += NM
        if w_s > 0:
            TT = bi.copy()
            TT[irow] = np.maximum.reduceat(A, tstart)[tid]
            if L.item_of is not None:
                TT = TT[L.item_of]
            TT *= w_s
            c += TT
    elif w_s > 0:
        TT = bi[L.item_of] if L.item_of is not None else bi.copy()
        TT *= w_s
        c += TT
    n = L.n
    kk = min(k, n)
    t = np.partition(c, n - kk)[n - kk] if kk else -np.inf
    if t == -np.inf:  # fewer than k visible rows: every one of them
        cand = np.flatnonzero(c > -np.inf)
    else:
        cand = np.flatnonzero(c >= np.nextafter(t - 2.0 * Bc, -np.inf))
    # the items whose exact base scores the candidates' exact c needs
    citems = cand if L.item_of is None else L.item_of[cand]
    parts = [citems]
    if ipos.shape[0]:
        P = pos_of[citems]
        P = P[P >= 0]
        if P.shape[0]:
            if w_n > 0:
                offs = np.concatenate((np.arange(-r, 0), np.arange(1, r + 1)))
                Wp = P[:, None] + offs[None, :]
                Aw = A[Wp]
                nm_c = np.maximum(W[P - r], W[P + 1])
                near = (Aw >= np.nextafter(nm_c - 2.0 * Bb, -np.inf)[:, None]) & ~is_sent[Wp]
                parts.append(lay[Wp[near]])
            if w_s > 0:
                tmask = np.zeros(tstart.shape[0], dtype=np.bool_)
                ct = tid[np.searchsorted(ipos, P)]
                tmask[ct] = True
                Tt = np.maximum.reduceat(A, tstart)
                Ai = A[ipos]
                near = tmask[tid] & (Ai >= np.nextafter(Tt[tid] - 2.0 * Bb, -np.inf))
                parts.append(irow[near])
    items = np.unique(np.concatenate(parts)) if len(parts) > 1 else np.unique(citems)
    need = L.rows_of_items(items)
    if vis is not None and L.item_of is not None:
        need = need[v[need] > -np.inf]
    return cand, need, (lay, is_sent, ipos, irow, tid, tstart, pos_of), A, W


def _finish(L: _Layout, st: _Query, exact_b: np.ndarray, k: int, w_n: float, w_s: float) -> tuple:
    """The exact c of one query's candidates and their top-k: (local rows, c, b)."""
    r = L.r
    lay, is_sent, ipos, irow, tid, tstart, pos_of = st.lay
    need = st.need
    n = L.n
    bx = np.full(n, np.nan)
    bx[need] = exact_b
    # the exact base score of each item among them: its best scored row
    bi_x = bx.copy()
    if L.item_of is not None and L.chunk_rows.shape[0]:
        ch = L.chunk_rows[~np.isnan(bx[L.chunk_rows])]
        if ch.shape[0]:
            np.fmax.at(bi_x, L.item_of[ch], bx[ch])
    cand = st.cand
    citems = cand if L.item_of is None else L.item_of[cand]
    c = bx[cand].copy()
    P = pos_of[citems] if ipos.shape[0] else np.full(cand.shape[0], -1, dtype=np.int64)
    inl = P >= 0
    if ipos.shape[0] and inl.any():
        A = st.A.copy()
        scored = ~np.isnan(bi_x[lay]) & ~is_sent
        A[scored] = bi_x[lay[scored]]
        Pi = P[inl]
    if w_n > 0:
        M = np.zeros(cand.shape[0])
        if ipos.shape[0] and inl.any():
            offs = np.concatenate((np.arange(-r, 0), np.arange(1, r + 1)))
            m = A[Pi[:, None] + offs[None, :]].max(axis=1)
            M[inl] = np.where(m > -np.inf, m, 0.0)
        c += w_n * M
    if w_s > 0:
        T = bi_x[citems].copy()
        if ipos.shape[0] and inl.any():
            T[inl] = np.maximum.reduceat(A, tstart)[tid[np.searchsorted(ipos, Pi)]]
        c += w_s * T
    order = np.lexsort((cand, -c))[:k]
    return cand[order], c[order], bx[cand[order]]


def context_topk(snap: BankSnapshot, memo: dict, Qh: np.ndarray, seg: np.ndarray, scan: SegmentScores,
                 boosts: list | None, config: Any, k: int, sel: Any = None,
                 xnorm: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The exact top-k of every query by its context score (module docstring).

    Args:
        snap: the snapshot the search runs on; memo: a dict living as long as it (the bank
            view's), where the per-user layouts are cached.
        Qh: float32 [b, d] the queries as searched (unit rows); seg: int64 [b] their segments.
        scan: every segment row's scan score and the scan's bound (:class:`SegmentScores`).
        boosts: None (dense only) or b entries: float64 [n_i] the fusion boost of every
            row of query i's segment (0 for no lexical hit), or None for a query without one.
        config: the RFMemConfig (``context_weight``, ``context_radius``, ``thread_weight``).
        k: the width.
        sel: the batch's :class:`rfmem_fast.filters.RowSelection`, or None.
        xnorm: an upper bound of the rows' norms (the bound's magnitudes).

    Returns:
        (rows int64 [b, k] global rows, -1 padding; c float64 [b, k] the context scores,
        NaN padding; base float64 [b, k] the base scores, -inf padding; dense float32
        [b, k] the exact dense scores, NaN padding), ordered by (c desc, row asc).
    """
    b = int(Qh.shape[0])
    w_n, w_s, r = float(config.context_weight), float(config.thread_weight), int(config.context_radius)
    off = snap.offsets
    states: list = []
    qi_parts, row_parts = [], []
    for i in range(b):
        u = int(seg[i])
        a = int(off[u])
        L = _layout(memo, snap, u, r)
        p0, p1 = int(scan.ptr[i]), int(scan.ptr[i + 1])
        v = scan.f[p0:p1].astype(np.float64)
        x = None if boosts is None else boosts[i]
        if x is not None:
            v += x
        vis = sel.allowed(i, a, L.n) if sel is not None else None
        if vis is not None:
            v[~vis] = -np.inf
        qn = float(np.sqrt(np.dot(Qh[i].astype(np.float64), Qh[i].astype(np.float64))))
        B = float(scan.bound[i])
        M = xnorm * qn * (1.0 + 1e-6) + B + (float(x.max()) if x is not None and x.shape[0] else 0.0)
        Bb = (B + 2.0 * U64 * M) * _SLACK
        Bc = (1.0 + w_n + w_s) * (Bb + 8.0 * U64 * (M + Bb)) * _SLACK
        cand, need, lay, A, W = _approximate(L, v, x, vis, Bb, Bc, k, w_n, w_s)
        states.append(_Query(i, a, lay, A, W, cand, need, vis))
        qi_parts.append(np.full(need.shape[0], i, dtype=np.int64))
        row_parts.append(need + a)
    qi = np.concatenate(qi_parts) if qi_parts else np.zeros(0, dtype=np.int64)
    rows = np.concatenate(row_parts) if row_parts else np.zeros(0, dtype=np.int64)
    e = exact_pair_scores_np(snap.vectors, Qh, qi, rows) if rows.shape[0] else np.zeros(0, dtype=np.float32)
    out_rows = np.full((b, k), -1, dtype=np.int64)
    out_c = np.full((b, k), np.nan)
    out_b = np.full((b, k), -np.inf)
    out_d = np.full((b, k), np.nan, dtype=np.float32)
    pos = 0
    for st in states:
        m = st.need.shape[0]
        ei = e[pos : pos + m]
        pos += m
        L = _layout(memo, snap, int(seg[st.i]), r)
        eb = ei.astype(np.float64)
        x = None if boosts is None else boosts[st.i]
        if x is not None:
            eb = eb + x[st.need]
        lr, c, bb = _finish(L, st, eb, k, w_n, w_s)
        j = lr.shape[0]
        out_rows[st.i, :j] = lr + st.a
        out_c[st.i, :j] = c
        out_b[st.i, :j] = bb
        dmap = np.full(L.n, np.nan, dtype=np.float32)
        dmap[st.need] = ei
        out_d[st.i, :j] = dmap[lr]
    return out_rows, out_c, out_b, out_d
