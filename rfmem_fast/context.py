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
   thread laid out in order with ``r`` ``-inf`` sentinels after each thread, then the items
   alone in their thread, so the neighbour maximum is a sliding-window maximum (``log2 r``
   shifted ``np.maximum`` calls over contiguous slices), the thread maximum one
   ``np.maximum.reduceat`` and one ``np.repeat``; ``c~`` is computed in that layout (about
   ten numpy calls over ``n + r (threads + 2)`` entries, no gather but the first).
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
oracle that scores every row exactly (tests/test_context.py). A first threshold keeps the
candidate search short: the k-th largest of the threads' best ``c~`` (and the free
items'), which k distinct entries reach, so it is at most ``t``.

Two implementations of steps 2 and 3, one result: the compiled kernel
``_native.context_topk`` (csrc/cpu/context.cpp: one pass over the layout per query, the
neighbours read directly, the k largest in a heap; ~30 us for 4,096 rows) takes the
unfiltered queries on users without chunk rows when the extension is built; the numpy code
here takes the others (filters, chunked items) and every query without the extension
(``USE_KERNEL = False`` forces it; tests/test_context.py runs both against the oracle).
The rows' scan scores are free on the native backend (the hybrid probe records them).

Filters: a filtered query's invisible rows get ``-inf``; its layout is compacted to the
visible items (ranks among the visible items of a thread), so a filter that drops a turn
makes the turns around it neighbours.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .backends.base import SegmentScores
from .backends.exact import exact_pair_scores_np
from .bank import NO_POSITION, BankSnapshot
from .lexical import item_rows
from .threads import get_num_threads

try:  # the compiled path of unfiltered queries on users without chunk rows (csrc/cpu/context.cpp)
    from . import _native

    _KERNEL = getattr(_native, "context_topk", None)
except ImportError:  # pragma: no cover - a build without the extension: numpy only
    _KERNEL = None
#: False makes every query take the numpy path (tests compare both); results never depend on it
USE_KERNEL = True
_ZERO = np.zeros(1, dtype=np.int64)
_ZERO.setflags(write=False)
_ONE = np.ones(1, dtype=np.bool_)
_ONE.setflags(write=False)

U64 = 2.0**-53
#: relative inflation of the bounds (covers their own float64 evaluation)
_SLACK = 1.0 + 1e-9

__all__ = ["SegmentScores", "build_layout", "context_topk"]


@dataclass
class _Layout:
    """One user's conversation structure for a radius ``r``, from one snapshot (built once, cached).

    Positions: ``r`` sentinels; then one block per thread of at least two items (its items
    in thread order, then ``r`` sentinels); then the free block (items alone in their
    thread, or without one, in row order) from ``fstart``; then ``r`` sentinels.

    Attributes:
        n: rows of the segment; r: the radius.
        item_of: int64 [n] the local row of each row's item (chunked items,
            :func:`rfmem_fast.lexical.item_rows`), or None when every row is an item.
        chunk_rows: int64 the extra chunk rows (empty without).
        item_ptr / item_rows: CSR of each item row's rows (chunked users; else None).
        lay: int64 [L] the item row at each position, ``n`` at the sentinels (the index of
            the ``-inf`` slot of the query's score buffer).
        tstart: int64 [nt] each thread block's first position; blen: int64 [nt] its length
            (items + r).
        fstart / nfree: the free block's first position and length.
        pos_of: int64 [n] the position of each item row, -1 for an extra chunk row.
    """

    n: int
    r: int
    item_of: np.ndarray | None
    chunk_rows: np.ndarray
    item_ptr: np.ndarray | None
    item_rows: np.ndarray | None
    lay: np.ndarray
    tstart: np.ndarray
    blen: np.ndarray
    fstart: int
    nfree: int
    pos_of: np.ndarray
    tstart_list: list = None  # type: ignore[assignment]  (tstart as Python ints)
    native: tuple = None  # type: ignore[assignment]  (the compiled path's arrays: lay int32, -1 at sentinels; tstart int32)

    def __post_init__(self) -> None:
        self.tstart_list = self.tstart.tolist()
        lay32 = np.where(self.lay == self.n, -1, self.lay).astype(np.int32)
        ts32 = self.tstart.astype(np.int32)
        one = (np.array([0, lay32.shape[0]], dtype=np.int64), np.array([0, ts32.shape[0]], dtype=np.int64),
               np.array([self.fstart], dtype=np.int64))  # fmt: skip
        self.native = (lay32, ts32, one)

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
    nopos = (positions == NO_POSITION).astype(np.int64)
    order = np.lexsort((rows, np.where(nopos == 1, 0, positions), nopos, code))
    return rows[order], code[order]


def build_layout(snap: BankSnapshot, u: int, r: int) -> _Layout:
    """The :class:`_Layout` of segment ``u`` of ``snap`` for radius ``r`` (O(n_u log n_u))."""
    a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
    n = b - a
    if snap.lexical is not None:
        has_text = snap.lexical.has_text[a:b]
    else:
        texts = snap.texts[a:b] if snap.texts is not None else [None] * n
        has_text = np.fromiter((t is not None for t in texts), np.bool_, n)
    io = item_rows(snap.item_ids[a:b].tolist(), has_text) if n else None
    item_of = None if io is None else io.astype(np.int64)
    if item_of is None:
        items = np.arange(n, dtype=np.int64)
        chunk_rows = np.zeros(0, dtype=np.int64)
        item_ptr = item_rws = None
    else:
        is_item = item_of == np.arange(n)
        items = np.flatnonzero(is_item)
        chunk_rows = np.flatnonzero(~is_item)
        item_rws = np.lexsort((np.arange(n), ~is_item, item_of)).astype(np.int64)  # each item's own row, then its chunks
        item_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(item_of, minlength=n), out=item_ptr[1:])
    thr = snap.threads[a:b] if snap.threads is not None else None
    pos = snap.positions[a:b] if snap.positions is not None else np.full(n, NO_POSITION, dtype=np.int64)
    trows = items[np.not_equal(thr[items], None)] if thr is not None else np.zeros(0, dtype=np.int64)
    if trows.shape[0]:
        srows, scode = _thread_order(thr[trows].tolist(), np.asarray(pos[trows], dtype=np.int64), trows)
        new = np.ones(srows.shape[0], dtype=np.bool_)
        new[1:] = scode[1:] != scode[:-1]
        tnum = np.cumsum(new) - 1
        multi = np.bincount(tnum)[tnum] >= 2  # a thread of one item has no neighbour: a free item
        srows, tnum = srows[multi], tnum[multi]
        tid = np.unique(tnum, return_inverse=True)[1].astype(np.int64).reshape(-1)
    else:
        srows = tid = np.zeros(0, dtype=np.int64)
    m = srows.shape[0]
    nt = int(tid.max()) + 1 if m else 0
    ipos = np.arange(m, dtype=np.int64) + r * (tid + 1)
    free = np.ones(n, dtype=np.bool_)
    free[srows] = False
    free_rows = items[free[items]]
    fstart = m + r * (nt + 1)
    nfree = int(free_rows.shape[0])
    L = fstart + nfree + r
    lay = np.full(L, n, dtype=np.int64)
    lay[ipos] = srows
    lay[fstart : fstart + nfree] = free_rows
    tstart = ipos[np.concatenate(([True], tid[1:] != tid[:-1]))] if m else np.zeros(0, dtype=np.int64)
    blen = np.diff(np.append(tstart, fstart)).astype(np.int64)
    pos_of = np.full(n, -1, dtype=np.int64)
    pos_of[srows] = ipos
    pos_of[free_rows] = np.arange(fstart, fstart + nfree)
    return _Layout(n=n, r=r, item_of=item_of, chunk_rows=chunk_rows, item_ptr=item_ptr, item_rows=item_rws, lay=lay,
                   tstart=tstart, blen=blen, fstart=fstart, nfree=nfree, pos_of=pos_of)  # fmt: skip


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
    """One query's state between the approximate pass and the exact finish (host lists of
    the few candidates; the exact finish reads nothing of the segment's size).

    Attributes:
        i, a: the query's index and its segment's first row.
        cands: [(local row, its item's position)] the candidates.
        windows: {position: (rows, approximate scores)} of each threaded candidate's 2r
            neighbour slots (row ``n`` at a sentinel).
        block_of: {position: block} of each threaded candidate; block_near: {block: item
            rows near its maximum}.
        need: int64 the local rows needing an exact score (sorted, distinct).
        fstart: the free block's first position.
    """

    i: int
    a: int
    cands: list
    windows: dict
    block_of: dict
    block_near: dict
    need: np.ndarray
    fstart: int


def _block_positions(tstart: np.ndarray, blen: np.ndarray, bk: np.ndarray) -> np.ndarray:
    """int64: every position of the thread blocks ``bk`` (their items and trailing sentinels)."""
    ln = blen[bk]
    return np.repeat(tstart[bk] - np.cumsum(ln) + ln, ln) + np.arange(int(ln.sum()))


@lru_cache(maxsize=64)
def _offsets_list(r: int) -> tuple:
    """The offsets of a position's neighbours, -r .. -1, 1 .. r."""
    return tuple(range(-r, 0)) + tuple(range(1, r + 1))


@lru_cache(maxsize=64)
def _offsets(r: int) -> np.ndarray:
    """int64 [2r]: the offsets of a position's neighbours, -r .. -1, 1 .. r."""
    out = np.concatenate((np.arange(-r, 0), np.arange(1, r + 1))).astype(np.int64)
    out.setflags(write=False)
    return out


#: a candidate list up to this long is thresholded in Python (a few microseconds); longer in numpy
_PY_CANDIDATES = 256


def _approximate(Lo: _Layout, buf: np.ndarray, vis: np.ndarray | None, Bb: float, Bc: float, k: int, w_n: float,
                 w_s: float) -> tuple:  # fmt: skip
    """The approximate pass of one query (module docstring, step 2 and the candidates of step 3).

    Args:
        buf: float64 [n + 1] approximate base scores of the rows (invisible rows -inf),
            ``buf[n] = -inf``.

    Returns:
        (cands, windows, block_of, block_near, need, fstart) of :class:`_Query`.
    """
    n, r = Lo.n, Lo.r
    chunked = Lo.item_of is not None
    bi = buf
    if chunked:  # an item's score: its best visible row
        bi = buf.copy()
        np.maximum.at(bi, Lo.item_of[Lo.chunk_rows], buf[Lo.chunk_rows])
    lay, tstart, blen, fstart, pos_of = Lo.lay, Lo.tstart, Lo.blen, Lo.fstart, Lo.pos_of
    if vis is not None and tstart.shape[0]:  # ranks among the visible items: compact the thread blocks
        part = lay[r:fstart]
        kp = (part == n) | (bi[part] > -np.inf)
        blen = np.add.reduceat(kp, tstart - r, dtype=np.int64)
        kept = part[kp]
        lay = np.concatenate((lay[:r], kept, lay[fstart:]))
        tstart = r + np.concatenate(([0], np.cumsum(blen)[:-1])).astype(np.int64)
        fstart = r + kept.shape[0]
        pos_of = np.full(n, -1, dtype=np.int64)
        p = np.flatnonzero(lay != n)
        pos_of[lay[p]] = p
    L = lay.shape[0]
    A = bi[lay]
    threads = tstart.shape[0] > 0
    nm = TT = W = Tt = None
    if w_n > 0 and threads:
        W = _window_max(A, r)
        nm = np.maximum(W[: L - 2 * r], W[r + 1 : L - r + 1])
        nm[fstart - r :] = 0.0  # a free item has no neighbour
        if vis is not None:
            nm[nm == -np.inf] = 0.0  # an item alone among the visible items of its thread
        nm *= w_n
    TTu = None
    if w_s > 0:
        if threads:
            Tt = np.maximum.reduceat(A[:fstart], tstart)
            TTu = np.repeat(Tt, blen)
            TT = TTu * w_s
            if fstart < L - r:  # a free item: its own score
                TT = np.concatenate((TT, A[fstart : L - r] * w_s))
        else:
            TT = A[r : L - r] * w_s
    own = A[r : L - r] if not chunked else buf[lay[r : L - r]]  # a row's own score (an item row: not its chunks')
    if nm is not None and not chunked:  # (nm is read again below for chunk rows)
        c = nm
        c += own
    elif nm is not None:
        c = own + nm
    else:
        c = own.copy()
    if TT is not None:
        c += TT
    rows_sp = lay[r : L - r]
    if chunked and Lo.chunk_rows.shape[0]:  # the extra chunk rows: their own score, their item's terms
        ch = Lo.chunk_rows
        P = pos_of[Lo.item_of[ch]]
        ok = P >= 0
        cc = buf[ch].copy()
        Pm = np.where(ok, P - r, 0)
        if nm is not None:
            cc += nm[Pm]
        if TT is not None:
            cc += TT[Pm]
        cc[~ok] = -np.inf
        c = np.concatenate((c, cc))
        rows_sp = np.concatenate((rows_sp, ch))
    # candidates: every entry within 2 Bc of the k-th largest approximate c. A first
    # threshold l0 <= that: the k-th largest of the threads' best entries and the free
    # items' entries (k distinct entries reach it); few entries lie above it
    cand0 = None
    mfree = L - r - fstart
    if threads and tstart.shape[0] + mfree >= k:
        best = np.maximum.reduceat(c[: fstart - r], tstart - r)
        if mfree:
            best = np.concatenate((best, c[fstart - r : L - 2 * r]))
        m0 = best.shape[0]
        l0 = float(np.partition(best, m0 - k)[m0 - k])
        if l0 > -math.inf:
            cand0 = np.flatnonzero(c >= math.nextafter(l0 - 2.0 * Bc, -math.inf))
    if cand0 is not None and cand0.shape[0] <= _PY_CANDIDATES:
        vals = c[cand0].tolist()
        t = sorted(vals, reverse=True)[min(k, len(vals)) - 1]
        cut = math.nextafter(t - 2.0 * Bc, -math.inf)
        cand = [j for j, v in zip(cand0.tolist(), vals) if v >= cut]
    else:
        vals = c if cand0 is None else c[cand0]
        m = vals.shape[0]
        kk = min(k, m)
        t = float(np.partition(vals, m - kk)[m - kk]) if kk else -math.inf
        if t == -math.inf:  # fewer than k visible rows: every one of them
            sel = np.flatnonzero(vals > -np.inf)
        else:
            sel = np.flatnonzero(vals >= math.nextafter(t - 2.0 * Bc, -math.inf))
        cand = (sel if cand0 is None else cand0[sel]).tolist()
    crow = rows_sp[cand].tolist() if len(cand) > 8 else [int(rows_sp.item(j)) for j in cand]
    if not chunked:
        cpos = [j + r for j in cand]
    else:
        io = Lo.item_of
        cpos = [int(pos_of.item(int(io.item(x)))) for x in crow]
    # the item rows whose exact scores the candidates' exact c needs: theirs, their near-maximal
    # neighbours, their threads' near-maximal items
    need = {int(lay.item(p)) for p in cpos} if chunked else set(crow)
    windows: dict = {}
    block_of: dict = {}
    block_near: dict = {}
    P = sorted({p for p in cpos if p < fstart})
    if P and W is not None:
        offs = _offsets_list(r)
        for p in P:
            rows_w = [int(lay.item(p + o)) for o in offs]
            a_w = [A.item(p + o) for o in offs]
            windows[p] = (rows_w, a_w)
            thr = math.nextafter(max(W.item(p - r), W.item(p + 1)) - 2.0 * Bb, -math.inf)
            need.update(x for x, v in zip(rows_w, a_w) if v >= thr and x != n)
    if P and Tt is not None:
        # every thread's items near its maximum (sentinels are -inf: never near), then the candidates' threads
        near = (np.flatnonzero(A[r:fstart] >= TTu - 2.0 * Bb) + r).tolist()
        ts = Lo.tstart_list if tstart is Lo.tstart else tstart.tolist()
        for p in P:
            bk = bisect_right(ts, p) - 1
            block_of[p] = bk
            if bk not in block_near:
                s0 = ts[bk]
                s1 = ts[bk + 1] if bk + 1 < len(ts) else fstart
                rows_b = [int(lay.item(q)) for q in near[bisect_left(near, s0) : bisect_left(near, s1)]]
                block_near[bk] = rows_b
                need.update(rows_b)
    if chunked:
        items = np.fromiter(need, np.int64, len(need))
        rows_n = Lo.rows_of_items(items)
        rows_n = rows_n[buf[rows_n] > -np.inf]
        need_arr = np.unique(np.concatenate((rows_n, np.asarray(crow, dtype=np.int64))))
    else:
        need_arr = np.fromiter(sorted(need), np.int64, len(need))
    return list(zip(crow, cpos)), windows, block_of, block_near, need_arr, fstart


def _finish(Lo: _Layout, st: _Query, exact_b: list, k: int, w_n: float, w_s: float) -> list:
    """The exact c of one query's candidates and their top k: [(c, local row, b)], in order.

    ``exact_b``: the exact base score of each row of ``st.need``, in that order (floats)."""
    n = Lo.n
    ex = dict(zip(st.need.tolist(), exact_b))
    if Lo.item_of is None:
        item_b = ex
    else:  # an item's exact score: its best scored (visible) row
        item_b = {}
        io = Lo.item_of
        for row, v in ex.items():
            it = int(io[row])
            if v > item_b.get(it, -math.inf):
                item_b[it] = v
    t_ex = {bk: max(item_b[x] for x in rows) for bk, rows in st.block_near.items()}
    out = []
    for row, pos in st.cands:
        b = ex[row]
        if pos < st.fstart:
            M = 0.0
            win = st.windows.get(pos)
            if win is not None:
                M = -math.inf
                for x, v in zip(*win):
                    if x != n:
                        v = item_b.get(x, v)
                        if v > M:
                            M = v
                if M == -math.inf:  # no visible neighbour
                    M = 0.0
            T = t_ex.get(st.block_of.get(pos), 0.0)
        else:
            M = 0.0
            T = item_b[row if Lo.item_of is None else int(Lo.item_of[row])]
        out.append((b + w_n * M + w_s * T, row, b))
    out.sort(key=lambda e: (-e[0], e[1]))
    return out[:k]


def context_topk(snap: BankSnapshot, memo: dict, Qh: np.ndarray, seg: np.ndarray, scan: SegmentScores,
                 boosts: list | None, config: Any, k: int, sel: Any = None, xnorm: float = 1.0,
                 lexical: list | None = None) -> tuple:  # fmt: skip
    """The exact top-k of every query by its context score (module docstring).

    Args:
        snap: the snapshot the search runs on; memo: a dict living as long as it (the bank
            view's), where the per-user layouts are cached.
        Qh: float32 [b, d] the queries as searched (unit rows); seg: int64 [b] their segments.
        scan: every segment row's scan score and the scan's bound
            (:class:`rfmem_fast.backends.base.SegmentScores`).
        boosts: None (dense only), b entries (float64 [n_i] the fusion boost of every row of
            query i's segment, 0 for no lexical hit, or None for a query without one), or
            one float64 array aligned with ``scan.f``.
        config: the RFMemConfig (``context_weight``, ``context_radius``, ``thread_weight``).
        k: the width.
        sel: the batch's :class:`rfmem_fast.filters.RowSelection`, or None.
        xnorm: an upper bound of the rows' norms (the bound's magnitudes).
        lexical: optional b entries: float64 [n_i] every row's BM25 (or None: no hit), to
            report the hits' lexical scores.

    Returns:
        (rows int64 [b, k] global rows, -1 padding; c float64 [b, k] the context scores,
        NaN padding; base float64 [b, k] the base scores, -inf padding; dense float32
        [b, k] the exact dense scores, NaN padding; lex float32 [b, k] the BM25 scores, 0
        for no hit, NaN padding and without ``lexical``), ordered by (c desc, row asc).
    """
    b = int(Qh.shape[0])
    w_n, w_s, r = float(config.context_weight), float(config.thread_weight), int(config.context_radius)
    off = snap.offsets
    flat = boosts if isinstance(boosts, np.ndarray) else None
    done = None
    if _KERNEL is not None and USE_KERNEL and b:
        done = _kernel_part(snap, memo, Qh, seg, scan, None if flat is not None else boosts, flat, r, w_n, w_s, k,
                            sel, xnorm)  # fmt: skip
    if flat is not None and (done is None or not done[0].all()):  # one array aligned with scan.f: each query's view
        boosts = [flat[scan.ptr[i] : scan.ptr[i + 1]] for i in range(b)]
    states: list = []
    qi_parts, row_parts = [], []
    todo = range(b) if done is None else np.flatnonzero(~done[0]).tolist()
    if len(todo):
        q64 = Qh.astype(np.float64)
        qn = np.sqrt(np.einsum("ij,ij->i", q64, q64))
        Bq = scan.bounds(qn)
        f = scan.f
        ptr = scan.ptr.tolist()
    for i in todo:
        u = int(seg[i])
        a = int(off[u])
        Lo = _layout(memo, snap, u, r)
        n = Lo.n
        p0 = ptr[i]
        buf = np.empty(n + 1)
        x = None if boosts is None else boosts[i]
        if x is not None:
            np.add(f[p0 : p0 + n], x, out=buf[:n])
        else:
            buf[:n] = f[p0 : p0 + n]
        buf[n] = -np.inf
        vis = sel.allowed(i, a, n) if sel is not None else None
        if vis is not None:
            buf[:n][~vis] = -np.inf
        B = float(Bq[i])
        M = xnorm * float(qn[i]) * (1.0 + 1e-6) + B + (float(x.max()) if x is not None and n else 0.0)
        Bb = (B + 2.0 * U64 * M) * _SLACK
        Bc = (1.0 + w_n + w_s) * (Bb + 8.0 * U64 * (M + Bb)) * _SLACK
        out = _approximate(Lo, buf, vis, Bb, Bc, k, w_n, w_s)
        states.append(_Query(i, a, *out))
        need = out[-2]
        qi_parts.append(np.full(need.shape[0], i, dtype=np.int64))
        row_parts.append(need + a)
    qi = np.concatenate(qi_parts) if qi_parts else np.zeros(0, dtype=np.int64)
    rows = np.concatenate(row_parts) if row_parts else np.zeros(0, dtype=np.int64)
    e = exact_pair_scores_np(snap.vectors, Qh, qi, rows) if rows.shape[0] else np.zeros(0, dtype=np.float32)
    if done is not None:
        out_rows, out_c, out_b, out_d = done[1]
    else:
        out_rows = np.full((b, k), -1, dtype=np.int64)
        out_c = np.full((b, k), np.nan)
        out_b = np.full((b, k), -np.inf)
        out_d = np.full((b, k), np.nan, dtype=np.float32)
    out_l = np.full((b, k), np.nan, dtype=np.float32)
    pos = 0
    for st in states:
        m = st.need.shape[0]
        ei = e[pos : pos + m]
        pos += m
        Lo = _layout(memo, snap, int(seg[st.i]), r)
        eb = ei.astype(np.float64)
        x = None if boosts is None else boosts[st.i]
        if x is not None:
            eb += x[st.need]
        top = _finish(Lo, st, eb.tolist(), k, w_n, w_s)
        j = len(top)
        if not j:
            continue
        lr = np.fromiter((t[1] for t in top), np.int64, j)
        out_rows[st.i, :j] = lr + st.a
        out_c[st.i, :j] = [t[0] for t in top]
        out_b[st.i, :j] = [t[2] for t in top]
        out_d[st.i, :j] = ei[np.searchsorted(st.need, lr)]
    if lexical is not None:
        for i, lx in enumerate(lexical):
            lr = out_rows[i]
            if lx is None:
                out_l[i] = np.where(lr >= 0, np.float32(0.0), np.float32(np.nan))
            else:
                a = int(off[int(seg[i])])
                out_l[i] = np.where(lr >= 0, lx[np.maximum(lr - a, 0)], np.nan)
    return out_rows, out_c, out_b, out_d, out_l


def _kernel_part(snap: BankSnapshot, memo: dict, Qh: np.ndarray, seg: np.ndarray, scan: SegmentScores,
                 boosts: list | None, flat: np.ndarray | None, r: int, w_n: float, w_s: float, k: int, sel: Any,
                 xnorm: float) -> tuple | None:  # fmt: skip
    """The queries the compiled kernel takes (``_native.context_topk``: unfiltered, on users
    without chunk rows) in one call: (bool [b] which, (rows, c, base, dense) [b, k] with
    the others padded), or None when it takes none."""
    b = int(Qh.shape[0])
    if b == 1 and sel is None:  # one query: no table to build
        Lo = _layout(memo, snap, int(seg[0]), r)
        if Lo.item_of is not None:
            return None
        lay, tstart, (lay_ptr, t_ptr, fstart) = Lo.native
        if flat is None and boosts is not None and boosts[0] is not None:
            flat = np.ascontiguousarray(boosts[0], dtype=np.float64)
        out = _KERNEL(snap.vectors, snap.offsets, np.ascontiguousarray(Qh, dtype=np.float32),
                      np.ascontiguousarray(seg, dtype=np.int64), scan.f, np.ascontiguousarray(scan.ptr, dtype=np.int64),
                      flat, _ZERO, lay, lay_ptr, tstart, t_ptr, fstart, r, w_n, w_s, k, float(scan.scale),
                      float(scan.abs_term), float(xnorm), 1)  # fmt: skip
        return _ONE, out
    ok = np.ones(b, dtype=np.bool_) if sel is None else sel.qsel < 0
    quser = np.full(b, -1, dtype=np.int64)
    layouts = []
    idx = np.flatnonzero(ok)
    users, inv = np.unique(np.asarray(seg)[idx], return_inverse=True)  # one layout per user, not per query
    j_of = np.full(len(users), -1, dtype=np.int64)
    for t, u in enumerate(users.tolist()):
        Lo = _layout(memo, snap, int(u), r)
        if Lo.item_of is None:  # users with chunk rows are left to the numpy path
            j_of[t] = len(layouts)
            layouts.append(Lo)
    quser[idx] = j_of[inv]
    ok[idx[quser[idx] < 0]] = False
    if not layouts:
        return None
    if len(layouts) == 1:
        lay, tstart, (lay_ptr, t_ptr, fstart) = layouts[0].native
    else:
        lay = np.concatenate([Lo.native[0] for Lo in layouts])
        tstart = np.concatenate([Lo.native[1] for Lo in layouts])
        lay_ptr = np.zeros(len(layouts) + 1, dtype=np.int64)
        np.cumsum([Lo.native[0].shape[0] for Lo in layouts], out=lay_ptr[1:])
        t_ptr = np.zeros(len(layouts) + 1, dtype=np.int64)
        np.cumsum([Lo.native[1].shape[0] for Lo in layouts], out=t_ptr[1:])
        fstart = np.array([Lo.fstart for Lo in layouts], dtype=np.int64)
    if flat is None and boosts is not None and any(x is not None for x in boosts):
        flat = np.zeros(scan.f.shape[0])
        for i, x in enumerate(boosts):
            if x is not None:
                flat[scan.ptr[i] : scan.ptr[i + 1]] = x
    out = _KERNEL(snap.vectors, snap.offsets, np.ascontiguousarray(Qh, dtype=np.float32),
                  np.ascontiguousarray(seg, dtype=np.int64), scan.f, np.ascontiguousarray(scan.ptr, dtype=np.int64),
                  flat, quser, lay, lay_ptr, tstart, t_ptr, fstart, r, w_n, w_s, k, float(scan.scale),
                  float(scan.abs_term), float(xnorm), get_num_threads())  # fmt: skip
    return ok, out
