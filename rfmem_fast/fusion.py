"""Fusion of the dense and lexical channels (``RFMemConfig.fusion``), on batched candidate arrays.

Every rule here is a small numpy function over arrays [b, c] of b queries' candidates
(float64; the dense score of a candidate is its exact float32 cosine ``RN32(q . x)``
widened to float64, its lexical score its float64 BM25 of :mod:`rfmem_fast.lexical`, 0
for an item that is no lexical hit or has no text). A score-based mode's boost is
per-query factors (:class:`BoostFactors`, :data:`BOOST_FACTORS`) applied elementwise to
the candidates' BM25 (:func:`apply_boost`, on a [b, c] matrix or on flat per-hit
arrays, bit for bit the same values); adding one is its factors function in
:data:`BOOST_FACTORS` and its [b, c] form in :data:`BOOSTS`, or a rule next to
:func:`rrf`; adding a confidence for "adaptive" is one function in :data:`CONFIDENCES`.

Modes (``w = config.lexical_weight > 0``):

* ``convex``: ``fused = dense + w * f``, ``f = bm25`` (``lexical_norm="raw"``) or
  ``bm25 / max_bm25(q)`` (``"max"``: the query's largest BM25 over the user's items;
  ``f = 0`` when the query has no lexical hit);
* ``adaptive``: ``fused = dense + (w * c(q)) * bm25 / max_bm25(q)`` with ``c(q)`` the
  lexical channel's confidence, :func:`sharpness` by default;
* ``zscore``: ``fused = dense + (w * g(q) / sigma(q)) * bm25``, the two channels on one
  scale (distribution-based score fusion): ``sigma(q)`` the standard deviation of the
  query's BM25 over its user's items (items without text or hit count as 0) and
  ``g(q) = max(0, top-1 dense score - mean dense score over the user's items)``, the
  dense channel's spread at the top (the mean is ``q . mean_u``, ``mean_u`` the user's
  mean vector in float64, :func:`user_means`). So one lexical standard deviation weighs
  ``w`` times the dense top gap, whatever the corpus's BM25 scale or the encoder's cosine
  scale; a query without a lexical hit gets 0. Ranking by ``zd + w' * zl`` with both
  channels standardised is the same ranking with ``sigma_dense`` in place of ``g``
  (shifts do not change a ranking); the top gap is used because it needs no second pass
  over the user's rows;
* ``rrf``: ``fused = [1 / (k + r_dense) if ranked] + [1 / (k + r_lex) if ranked]``
  (``k = lexical_rrf_k``, ranks from 1) over the dense top-``D`` and the lexical
  top-``D`` (BM25 > 0, ties by the smaller row), ``D = max(lexical_depth, out_k,
  probe_k)``; an item in neither list scores 0.

All are computed in float64, in the order written (``dense + boost``, the boost
computed first), and the fused top-k is the k largest fused scores, ties broken by the
smaller row (the spec's rule), :func:`top_by_score_row`.

Chunked items (an item stored as several rows: its own row with the whole text and
extra chunk rows, :mod:`rfmem_fast.lexical`). Everything above is per ITEM: an item's
dense score is its best chunk's cosine, its BM25 its whole text's (one document), and
every statistic counts each item once. Every row of an item carries the item's BM25,
so its boost is the item's and ``max over rows (dense_r + x_item) = best chunk's
dense + x_item``: the fused top-k of rows, collapsed to items (best row first), is the
per-item fusion. The statistics: ``max_bm25`` and sharpness's top scores over the
items; zscore's ``sigma(q)`` over the items (n = items, not rows) and its mean dense
score ``q . mean_u`` with ``mean_u`` the mean over the items of each item's mean chunk
row (:func:`item_mean`: the mean of the chunks' cosines stands in for an item's dense
score there, so the mean stays one dot product; it is the plain mean without chunked
items). rrf ranks items in the lexical list (ties by the item's own row) and rows in
the dense list; each row of an item in the dense list carries the item's lexical rank,
and a lexically ranked item with no row in the dense list is a candidate by its best
chunk (largest exact cosine, ties by the smaller row), so an item scores
``1 / (k + its best chunk's dense rank) + 1 / (k + its lexical rank)``.

Why two exact channels give the exact fused top-k (what :func:`rfmem_fast.search.search`
does on every backend). Let ``K`` be the fused width, ``S`` the backend's exact dense
top-``K`` of the query in its user's segment (ties by row; ``S`` is the whole segment
when it has at most ``K`` rows), ``s_K`` the dense score of the last item of ``S``, and
``tau`` the ``K``-th largest fused score among ``S``. For convex / adaptive / zscore the boost
``x_i = w_q f_i`` is >= 0, and 0 for an item without a lexical hit. Take an item ``i``
outside ``S``: its dense score ``d_i <= s_K`` (and ``d_i = d_j`` for ``j`` in ``S``
implies ``row_j < row_i``).

1. No lexical hit: ``fused_i = d_i``. Every ``j`` in ``S`` has ``fused_j = fl(d_j + x_j)
   >= d_j >= d_i`` (rounding is monotone and ``x_j >= 0``), with equality only when
   ``d_j = d_i``, where ``row_j < row_i`` wins the tie. So the ``K`` items of ``S`` all
   rank before ``i``: ``i`` is not in the fused top-``K``.
2. A lexical hit with ``fl(s_K + x_i) < tau``: ``fused_i = fl(d_i + x_i) <= fl(s_K +
   x_i) < tau``, and ``K`` items of ``S`` score ``>= tau``: ``i`` is not in the top-``K``.

Hence the fused top-``K`` lies in ``S`` plus the lexical hits with ``fl(s_K + x_i) >=
tau``. Those are screened with a float32 dot product ``f_i`` and its certified bound
``|f_i - d_i| <= B(q)`` (:mod:`rfmem_fast.backends.exact`, any summation order): a hit
with ``fl(up(f_i + B) + x_i) < tau`` cannot enter (same argument, ``d_i <= up(f_i +
B)``); only the rest get an exact dense score
(:func:`rfmem_fast.backends.exact.exact_pair_scores_np`: the same float32 value the
dense scan gives, so an item gets one dense score whichever channel found it).
(``search`` takes ``S`` :data:`rfmem_fast.search_lexical.HYBRID_DENSE_DEPTH` deep, at least
``K``: a lower ``s_K`` lets fewer hits through; results do not depend on it.) For rrf every
item of either list scores > 0 and every other item 0; a list of ``D >= K`` items (or
the whole segment) guarantees the top-``K`` lies in the union of the two lists, and
ranks need no dense score at all. The backends only provide the exact dense top-k they
already provide; nothing here depends on which backend computed it, so every backend
returns the same ids as the float64 full-scan oracle (tests/test_lexical.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

#: how many of a query's largest BM25 scores :class:`LexicalStats` keeps (sharpness uses ranks 1..10)
TOP_LEXICAL = 10
_RANKS = np.arange(1, TOP_LEXICAL)  # the 0-based ranks 2..10 of sharpness

__all__ = [
    "BOOSTS", "BOOST_FACTORS", "CONFIDENCES", "TOP_LEXICAL", "BoostFactors", "LexicalStats", "adaptive_boost",
    "apply_boost",
    "adaptive_factors", "convex_boost", "convex_factors", "item_mean", "max_normalised", "ratio", "rrf", "sharpness",
    "top_by_score_row", "user_means", "zscore_boost", "zscore_factors", "zscore_stats",
]  # fmt: skip


@dataclass(frozen=True)
class LexicalStats:
    """Per-query statistics of the lexical channel over the query's user's items.

    Attributes:
        lex_max: float64 [b] the largest BM25 (0: no lexical hit).
        top: float64 [b, TOP_LEXICAL] the largest BM25 scores over the user's
            documents (items with text, a chunked item once), descending, 0 where fewer hits.
        n_docs: int64 [b] the user's documents ``N``.
        lex_std: float64 [b] or None: the population standard deviation of the query's
            BM25 over all its user's items, each once (0 for items without a hit); fusion "zscore".
        dense_gap: float64 [b] or None: ``max(0, top-1 dense score - q . mean_u)``; fusion "zscore".
    """

    lex_max: np.ndarray
    top: np.ndarray
    n_docs: np.ndarray
    lex_std: np.ndarray | None = None
    dense_gap: np.ndarray | None = None

    def take(self, idx: np.ndarray) -> "LexicalStats":
        """The statistics of the queries ``idx`` (int [m]), in that order."""
        opt = {k: None if getattr(self, k) is None else getattr(self, k)[idx] for k in ("lex_std", "dense_gap")}
        return LexicalStats(self.lex_max[idx], self.top[idx], self.n_docs[idx], **opt)


def sharpness(stats: LexicalStats) -> np.ndarray:
    """The lexical channel's confidence ``c(q) = (top1 - mean of BM25 ranks 2..10) / top1``.

    Ranks over the user's documents (items with text), so a user with ``N < 10``
    documents averages ranks ``2..N`` (``c = 1`` for ``N = 1`` with a hit); ``c = 0``
    when the query has no lexical hit. The mean is summed left to right (rank 2 first)
    in float64. Range [0, 1].

    Args:
        stats: LexicalStats of b queries.

    Returns:
        float64 [b].
    """
    top = stats.top
    m = np.minimum(stats.n_docs, TOP_LEXICAL)
    ranks = np.where(_RANKS[None, :] < m[:, None], top[:, 1:TOP_LEXICAL], 0.0)
    s = np.cumsum(ranks, axis=1)[:, -1]  # left to right (rank 2 first), one after the other
    cnt = (m - 1).astype(np.float64)
    mean = np.divide(s, cnt, out=np.zeros_like(s), where=cnt > 0)
    top1 = top[:, 0]
    return np.divide(top1 - mean, top1, out=np.zeros_like(s), where=top1 > 0)


#: confidence functions of fusion "adaptive" (name -> f(LexicalStats) -> float64 [b] in [0, 1])
CONFIDENCES: dict[str, Callable[[LexicalStats], np.ndarray]] = {"sharpness": sharpness}


def ratio(lex: np.ndarray, den: np.ndarray, den_positive: bool = False) -> np.ndarray:
    """``lex / den`` elementwise, 0 where ``den <= 0`` (float64, broadcast shape of the two).

    Args:
        lex: float64 array (BM25 scores); den: float64 array broadcastable with ``lex``
            (a query's largest BM25, per entry).
        den_positive: the caller knows every ``den`` entry is > 0 (a plain division, the
            same values without the mask).
    """
    if den_positive:
        return np.divide(lex, den)
    return np.divide(lex, den, out=np.zeros(np.broadcast_shapes(lex.shape, den.shape)), where=den > 0)


def max_normalised(lex: np.ndarray, stats: LexicalStats) -> np.ndarray:
    """``lex / lex_max`` per query (float64 [b, c]); 0 for a query without a lexical hit."""
    return ratio(lex, stats.lex_max[:, None])


def apply_boost(lex: np.ndarray, scale: np.ndarray, den: np.ndarray | None, den_positive: bool = False) -> np.ndarray:
    """The boost of BM25 ``lex`` from a fusion's per-query factors laid out beside it
    (:class:`BoostFactors`): ``scale * lex``, or ``scale * ratio(lex, den)`` with ``den``.
    The one definition of every score-based fusion's boost formula.

    Args:
        lex: float64 array; scale, den: float64 arrays broadcastable with ``lex`` (the
            factors indexed or repeated per entry; den None: raw BM25); den_positive: as
            :func:`ratio`.

    Returns:
        float64 array of the broadcast shape (>= 0 for ``lex`` >= 0, ``scale`` >= 0).
    """
    f = lex if den is None else ratio(lex, den, den_positive)
    return scale * f


@dataclass(frozen=True)
class BoostFactors:
    """A score-based fusion's boost as per-query factors: ``boost = scale * lex`` or
    ``boost = scale * (lex / den)`` (0 where ``den <= 0``, :func:`ratio`), elementwise in
    the candidate's BM25 ``lex``, in float64, in that order (the division first).

    Attributes:
        scale: float64 [b] each query's weight (``w``, ``w * c(q)``, ``w * g(q) / sigma(q)``).
        den: float64 [b] each query's normaliser (``max_bm25(q)``), or None (raw BM25).
    """

    scale: np.ndarray
    den: np.ndarray | None = None

    def matrix(self, lex: np.ndarray) -> np.ndarray:
        """The boosts of b queries' candidates: ``lex`` float64 [b, c] -> float64 [b, c]."""
        return apply_boost(lex, self.scale[:, None], None if self.den is None else self.den[:, None])

    def at(self, lex: np.ndarray, q: np.ndarray) -> np.ndarray:
        """The boosts of single candidates: ``lex`` float64 [m] of the queries ``q`` (int [m],
        indices into the b queries) -> float64 [m]."""
        return apply_boost(lex, self.scale[q], None if self.den is None else self.den[q])

    def flat(self, lex: np.ndarray, ptr: np.ndarray) -> np.ndarray:
        """The boosts of b queries' candidates held flat (CSR): ``lex`` float64 [H], query
        ``i``'s entries ``lex[ptr[i]:ptr[i + 1]]`` (``ptr`` int [b + 1], from 0, to H) ->
        float64 [H], each entry bit for bit its :meth:`matrix` value.

        Raises:
            ValueError: ``ptr`` is not b + 1 pointers from 0 to ``lex``'s length.
        """
        b = self.scale.shape[0]
        ptr = np.asarray(ptr)
        if ptr.shape != (b + 1,) or ptr[0] != 0 or ptr[-1] != lex.shape[0]:
            raise ValueError(f"ptr must be {b + 1} pointers from 0 to {lex.shape[0]}, got {ptr!r:.80}")
        if b == 1:  # one query: its factors broadcast over its entries
            scale, den, used = self.scale, self.den, self.den
        else:
            lens = ptr[1:] - ptr[:-1]
            scale = np.repeat(self.scale, lens)
            den = None if self.den is None else np.repeat(self.den, lens)
            used = None if self.den is None else self.den[lens > 0]  # the queries with an entry
        # (every query with an entry has den > 0, as a hit has BM25 > 0: a plain division)
        positive = used is not None and bool((used > 0).all())
        return apply_boost(lex, scale, den, positive)


def convex_factors(stats: LexicalStats, config: Any) -> BoostFactors:
    """Fusion "convex": ``w * f`` with ``f`` raw BM25 or :func:`max_normalised` (``config.lexical_norm``).

    Args:
        stats: the b queries' LexicalStats; config: the RFMemConfig (``lexical_weight``, ``lexical_norm``).

    Returns:
        BoostFactors: scale ``w`` [b]; den ``max_bm25(q)`` [b] ("max") or None ("raw").
    """
    scale = np.full(stats.lex_max.shape[0], float(config.lexical_weight))
    return BoostFactors(scale, None if config.lexical_norm == "raw" else stats.lex_max)


def adaptive_factors(stats: LexicalStats, config: Any, confidence: str = "sharpness") -> BoostFactors:
    """Fusion "adaptive": ``(w * c(q)) * bm25 / max_bm25(q)``, ``c`` from :data:`CONFIDENCES`.

    Returns:
        BoostFactors: scale ``w * c(q)`` [b], den ``max_bm25(q)`` [b].
    """
    return BoostFactors(float(config.lexical_weight) * CONFIDENCES[confidence](stats), stats.lex_max)


def zscore_factors(stats: LexicalStats, config: Any) -> BoostFactors:
    """Fusion "zscore": ``(w * dense_gap(q) / lex_std(q)) * bm25`` (module docstring).

    Args:
        stats: LexicalStats with ``lex_std`` and ``dense_gap`` set; config: the RFMemConfig (``lexical_weight``).

    Returns:
        BoostFactors: scale ``w * max(dense_gap, 0) / lex_std`` [b] (0 where ``lex_std <= 0``), den None.

    Raises:
        ValueError: ``stats`` lacks ``lex_std`` / ``dense_gap``.
    """
    if stats.lex_std is None or stats.dense_gap is None:
        raise ValueError("fusion 'zscore' needs LexicalStats.lex_std and .dense_gap")
    sd = stats.lex_std
    wq = np.divide(float(config.lexical_weight) * np.maximum(stats.dense_gap, 0.0), sd,
                   out=np.zeros(sd.shape[0]), where=sd > 0)  # fmt: skip
    return BoostFactors(wq)


def convex_boost(lex: np.ndarray, stats: LexicalStats, config: Any) -> np.ndarray:
    """Fusion "convex" on candidates (:func:`convex_factors`).

    Args:
        lex: float64 [b, c] BM25 of the candidates (0: no hit); stats: the queries' LexicalStats;
        config: the RFMemConfig (``lexical_weight``, ``lexical_norm``).

    Returns:
        float64 [b, c] >= 0, added to the dense score.
    """
    return convex_factors(stats, config).matrix(lex)


def adaptive_boost(lex: np.ndarray, stats: LexicalStats, config: Any, confidence: str = "sharpness") -> np.ndarray:
    """Fusion "adaptive" on candidates (:func:`adaptive_factors`): ``lex`` float64 [b, c] ->
    float64 [b, c] >= 0, added to the dense score."""
    return adaptive_factors(stats, config, confidence).matrix(lex)


def zscore_boost(lex: np.ndarray, stats: LexicalStats, config: Any) -> np.ndarray:
    """Fusion "zscore" on candidates (:func:`zscore_factors`).

    Args:
        lex: float64 [b, c] BM25 of the candidates (0: no hit); stats: LexicalStats with
            ``lex_std`` and ``dense_gap`` set; config: the RFMemConfig (``lexical_weight``).

    Returns:
        float64 [b, c] >= 0 (0 for a query whose BM25 is 0 everywhere).

    Raises:
        ValueError: ``stats`` lacks ``lex_std`` / ``dense_gap``.
    """
    return zscore_factors(stats, config).matrix(lex)


def zscore_stats(s1: np.ndarray, s2: np.ndarray, n: np.ndarray, mean_d: np.ndarray, top1: np.ndarray,
                 has_top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lex_std, dense_gap)`` of :class:`LexicalStats` for fusion "zscore" (module docstring).

    Args:
        s1, s2: float64 [b] each query's sum of its BM25 and of its squares over its user's
            items (each once, on its own row), summed in row order one after the other
            (items without a hit add 0).
        n: float64 [b] the items counted (>= 1; a chunked item once).
        mean_d: float64 [b] ``q . mean_u``, the mean dense score (:func:`user_means`).
        top1: float [b] the exact top-1 dense score; has_top: bool [b] whether there is one.

    Returns:
        (population standard deviation of the BM25 >= 0, ``max(0, top1 - mean_d)`` or 0
        without a top-1), float64 [b] each.
    """
    mu = s1 / n
    lex_std = np.sqrt(np.maximum(s2 / n - mu * mu, 0.0))
    gap = np.where(has_top, np.maximum(np.asarray(top1, dtype=np.float64) - mean_d, 0.0), 0.0)
    return lex_std, gap


def item_mean(rows: np.ndarray, item_of: np.ndarray | None = None) -> np.ndarray:
    """The mean over items of each item's mean row: float64 [d].

    ``mean = sum_r x_r / (c_item(r) * n_items)`` in float64 (each product summed over the
    rows in row order), ``c_i`` the rows of item ``i`` among ``rows``: an item stored as
    several chunk rows counts once, as the mean of its chunks. Without ``item_of`` (every
    row its own item) it is the rows' plain float64 mean. No row: a zero vector.

    Args:
        rows: float32 [m, d] the rows; item_of: int [m] the item of each row (any labels),
            or None.
    """
    if rows.shape[0] == 0:
        return np.zeros(rows.shape[1])
    X = rows.astype(np.float64)
    if item_of is None:
        return X.mean(axis=0)
    _, inv, cnt = np.unique(np.asarray(item_of), return_inverse=True, return_counts=True)
    w = 1.0 / (cnt.astype(np.float64)[inv.reshape(-1)] * float(cnt.shape[0]))
    return (X * w[:, None]).sum(axis=0)


def user_means(view: Any, users: np.ndarray) -> np.ndarray:
    """float64 [m, d] mean vectors of the segments ``users`` of a bank view's snapshot.

    Each is :func:`item_mean` of the segment's rows: the mean over the user's items of
    each item's mean row (a chunked item's rows, :attr:`rfmem_fast.lexical.UserPostings.item_row`,
    count as one item; the plain row mean when no item is chunked). Summed in float64 from
    the snapshot's host vectors, once per (snapshot, user) and memoised on the view, so
    every backend gets the same values. An empty segment has a zero mean.

    Args:
        view: a :class:`~rfmem_fast.backends.base.BankView` with a snapshot.
        users: int [m] segment indices.
    """
    memo = view._memo.setdefault("user_means", {})
    snap = view.snapshot
    off = snap.offsets
    out = np.zeros((len(users), snap.vectors.shape[1]))
    for j, u in enumerate(np.asarray(users, dtype=np.int64).tolist()):
        m = memo.get(u)
        if m is None:
            a, b = int(off[u]), int(off[u + 1])
            item_of = snap.lexical.postings(u).item_row if snap.lexical is not None and b > a else None
            m = memo[u] = item_mean(snap.vectors[a:b], item_of)
        out[j] = m
    return out


#: score-based fusion modes: name -> boost(lex [b, c], LexicalStats, config) -> float64 [b, c] >= 0
BOOSTS: dict[str, Callable[..., np.ndarray]] = {"convex": convex_boost, "adaptive": adaptive_boost, "zscore": zscore_boost}
#: the same modes as per-query factors: name -> factors(LexicalStats, config) -> :class:`BoostFactors`
#: (``BOOSTS[m](lex, stats, config) == BOOST_FACTORS[m](stats, config).matrix(lex)``)
BOOST_FACTORS: dict[str, Callable[..., BoostFactors]] = {
    "convex": convex_factors, "adaptive": adaptive_factors, "zscore": zscore_factors,
}  # fmt: skip


def rrf(dense_rank: np.ndarray, lex_rank: np.ndarray, k: float) -> np.ndarray:
    """Reciprocal-rank fusion ``[1/(k + r_dense)] + [1/(k + r_lex)]``; a rank 0 means "not in that list".

    Args:
        dense_rank, lex_rank: int64 [b, c] ranks from 1 (0: absent).
        k: the rank constant (> 0).

    Returns:
        float64 [b, c] (0 for a candidate in neither list).
    """
    d = np.where(dense_rank > 0, 1.0 / (k + dense_rank.astype(np.float64)), 0.0)
    lx = np.where(lex_rank > 0, 1.0 / (k + lex_rank.astype(np.float64)), 0.0)
    return d + lx


def top_by_score_row(scores: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """Column indices of each row's k best candidates by (score descending, row ascending).

    Args:
        scores: float64 [b, c] (``-inf``: no candidate); rows: int64 [b, c] (-1: no candidate).
        k: width (<= c).

    Returns:
        int64 [b, k] indices into the columns (padding candidates sort last).
    """
    big = np.iinfo(np.int64).max
    ok = (rows >= 0) & (scores > -np.inf)
    key = np.where(ok, rows, big)
    neg = np.where(ok, -scores, np.inf)
    return np.lexsort((key, neg), axis=-1)[:, :k]
