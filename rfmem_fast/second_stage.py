"""A learned second stage: re-rank the first stage's top ``depth`` candidates per query.

The first stage is any Familiarity-path search (``RFMemConfig.recommended()``: dense +
convex BM25 fusion + the conversation context). Its ranked list of a query, cut at
``depth`` (N, e.g. 50), is the *candidate list*; the second stage scores every candidate
with a small model over cheap per-candidate features and returns the ``out_k`` best by
that score (ties: first-stage order). The output is always a subset of the candidates,
in a new order.

Features (float64, :data:`STAGE_FEATURES` order; ``j`` is the candidate's 0-based place
in the first-stage list, "list" means the query's valid candidates):

======================  ======================================================================
``dense``               the exact cosine ``q . x`` (``SearchResult.dense_scores``)
``dense_gap``           ``dense`` minus the list's largest ``dense``
``dense_rank``          ``log1p(rank)`` of ``dense`` in the list (0-based, descending, ties by ``j``)
``lexical``             raw BM25 within the user's memory (``lexical_scores``; 0 without a query text)
``lexical_rel``         ``lexical`` / the list's largest ``lexical`` (0 when that is 0)
``lexical_rank``        ``log1p(rank)`` of ``lexical`` in the list
``fused``               the base score (``SearchResult.scores``: dense + fusion boost)
``fused_gap``           ``fused`` minus the list's largest ``fused``
``fused_rank``          ``log1p(rank)`` of ``fused`` in the list
``context``             the context score ``c`` (``context_scores``; ``fused`` where off / NaN)
``context_gap``         ``context`` minus the list's largest ``context``
``list_rank``           ``log1p(j)``: the first stage's own order
``coverage``            |Q ∩ D| / |Q|: Q the distinct content terms of the query, D the
                        candidate's (the bank's analyzer, :class:`rfmem_fast.lexical.Analyzer`:
                        lowercase, bm25s tokens, English stopwords out, the bank's stemmer);
                        0 for a query without content terms
``idf_mass``            sum over the terms of Q ∩ D of ``idf_t`` (BM25's idf within the user's
                        memory: ``log(1 + (N - df + 0.5) / (df + 0.5))``, ``df = 0`` for a term
                        the user never wrote)
``idf_frac``            ``idf_mass`` / the same sum over all of Q (0 when Q is empty)
``num_match``           how many distinct numbers of the query occur in the candidate text
``name_match``          how many distinct capitalised words of the query (its first word,
                        question words, titles and month / weekday names excepted) occur in
                        the candidate text (case-insensitive)
``date_match``          how many distinct month names (any case, full or 3-letter, compared by
                        their first three letters), weekday names and years (1900-2099) of
                        the query occur in the candidate text
``recency``             the candidate's rank by (``created_at``, row) within its user's
                        memory, scaled to [0, 1] (1 = the newest; a user of one item: 1);
                        rows of equal time rank by insertion order
``session_pos``         the candidate's rank by (position, row) within its thread, scaled to
                        [0, 1] (0 = first turn; 0 for an item without a thread or alone in it)
``mean_x_dense``        ``mean`` x ``dense`` (``mean``: the query's probe mean, spec section 1)
``entropy_x_dense``     ``entropy`` x ``dense`` (``entropy``: the probe entropy)
``mean_x_lexical``      ``mean`` x ``lexical_rel``
``entropy_x_lexical``   ``entropy`` x ``lexical_rel``
======================  ======================================================================

Numbers are runs of digits compared as integers (``"09"`` is ``9``); words are runs of
word characters (``\\w+``); a text's words, numbers and date words are computed once per
distinct text (an LRU cache).

Models (stored as a small versioned JSON file, never a pickle: :func:`save_stage` /
:func:`load_stage`, the layout of :mod:`rfmem_fast.routing.files`):

* :class:`LinearStage`: ``sum_k w_k f_k`` over the features it names, fitted by
  :func:`fit_linear_stage` (scikit-learn logistic regression on the feature differences
  of (relevant, non-relevant) pairs of one query, each query's pairs weighing 1 in
  total: a RankNet / RankSVM-style pairwise objective, as
  :func:`rfmem_fast.routing.rerank.fit_reranker`);
* :class:`TreeStage`: the raw score (log-odds of relevance) of a gradient-boosted tree
  ensemble, fitted pointwise by :func:`fit_tree_stage` (scikit-learn
  ``HistGradientBoostingClassifier``) and stored as its nodes; scored here with numpy
  (every tree of the ensemble at once, level by level), equal to scikit-learn's
  ``decision_function`` to float64 rounding.

Using it on a search: :func:`stage_features` (the arrays a search has: rows, the three
scores, the query texts, the bank snapshot the search ran on) -> ``model.rerank`` ->
order; :func:`rerank_result` does it all on a :class:`rfmem_fast.search.SearchResult`
searched with ``out_k >= depth`` and returns the re-ranked result cut to ``out_k``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import threading
import weakref
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = [
    "STAGE_FEATURES", "LINEAR_FEATURES", "TREE_FEATURES", "STAGE_FORMAT", "STAGE_VERSION", "StageFileError",
    "LinearStage", "TreeStage", "stage_features", "features_from_result", "stage_labels", "fit_linear_stage",
    "fit_tree_stage", "rerank_result", "save_stage", "load_stage", "stage_document", "query_terms", "text_terms",
]  # fmt: skip

#: every feature of :func:`stage_features`, in column order (module docstring)
STAGE_FEATURES = (
    "dense", "dense_gap", "dense_rank", "lexical", "lexical_rel", "lexical_rank", "fused", "fused_gap", "fused_rank",
    "context", "context_gap", "list_rank", "coverage", "idf_mass", "idf_frac", "num_match", "name_match", "date_match",
    "recency", "session_pos", "mean_x_dense", "entropy_x_dense", "mean_x_lexical", "entropy_x_lexical",
)  # fmt: skip
#: the default features of :func:`fit_linear_stage`: a pairwise model sees differences within one
#: query, so the ``*_gap`` columns (shifts of ``dense`` / ``fused`` / ``context``) and ``fused``
#: (``dense`` + w ``lexical``) add nothing to it
LINEAR_FEATURES = (
    "dense", "dense_rank", "lexical", "lexical_rank", "fused_rank", "context", "list_rank", "coverage", "idf_mass",
    "idf_frac", "num_match", "name_match", "date_match", "recency", "session_pos", "mean_x_dense", "entropy_x_dense",
    "mean_x_lexical", "entropy_x_lexical",
)  # fmt: skip
#: the default features of :func:`fit_tree_stage` (pointwise: the per-query relative forms)
TREE_FEATURES = (
    "dense", "dense_gap", "dense_rank", "lexical_rel", "lexical_rank", "fused_gap", "fused_rank", "context_gap",
    "list_rank", "coverage", "idf_frac", "num_match", "name_match", "date_match", "recency", "session_pos",
    "mean_x_dense", "entropy_x_dense",
)  # fmt: skip
STAGE_FORMAT = "rfmem_fast.second_stage"
STAGE_VERSION = 1
_COL = {f: i for i, f in enumerate(STAGE_FEATURES)}
_MAX_DEPTH = 1 << 16

_WORD = re.compile(r"\w+")
_CAPS = re.compile(r"\b[A-Z][A-Za-z]*")
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_MONTH_WORDS = {
    **{m: m for m in _MONTHS},
    **{w: w[:3] for w in ("january", "february", "march", "april", "june", "july", "august", "september",
                          "october", "november", "december", "sept")},
}  # fmt: skip
_WEEKDAYS = {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"}
#: capitalised words of a question that are no names
_NOT_NAMES = frozenset((
    "i", "i'm", "my", "me", "mine", "we", "our", "you", "your", "he", "she", "his", "her", "it", "they", "them",
    "what", "when", "where", "who", "whom", "whose", "why", "which", "how", "did", "does", "do", "is", "are", "was",
    "were", "has", "have", "had", "can", "could", "would", "should", "will", "shall", "may", "might", "the", "a", "an",
    "in", "on", "at", "of", "for", "to", "and", "or", "if", "as", "by", "with", "from", "after", "before", "during",
    "mr", "mrs", "ms", "dr", "prof", "sir", "miss", "jr", "sr", "md", "dds", "phd", "describe", "name", "list", "tell",
))  # fmt: skip


class StageFileError(ValueError):
    """A second-stage file is unreadable, corrupt, of another format or version, or malformed."""


# ------------------------------------------------------------------ text terms


def _number(w: str) -> str:
    return str(int(w)) if w.isdigit() and w.isascii() else w


@lru_cache(maxsize=1 << 16)
def text_terms(text: str) -> tuple[frozenset, frozenset, frozenset]:
    """(words, numbers, date words) of a candidate text, each a frozenset of str.

    Words: the lowercased ``\\w+`` runs (a number as its integer, ``"09"`` -> ``"9"``);
    numbers: the all-digit words (as integers); date words: month names as their first
    three letters, weekday names, and the numbers 1900-2099 (years). Cached per text.

    Raises:
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    words = {_number(w) for w in _WORD.findall(text.lower())}
    nums = frozenset(w for w in words if w.isdigit())
    dates = {_MONTH_WORDS[w] for w in words if w in _MONTH_WORDS}
    dates |= {w for w in words if w in _WEEKDAYS}
    dates |= {w for w in nums if 1900 <= int(w) <= 2099}
    return frozenset(words), nums, frozenset(dates)


def query_terms(text: str) -> tuple[frozenset, frozenset, frozenset]:
    """(names, numbers, date words) a query asks about, each a frozenset of lowercased str.

    Names: the words starting with a capital letter (``[A-Z][A-Za-z]*``, a possessive
    "'s" left out) other than the text's first word, pronouns / question words / titles
    (:data:`_NOT_NAMES`) and month / weekday names. Numbers and date words: as
    :func:`text_terms` of the query.

    Raises:
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"query text must be a str, got {type(text).__name__}")
    _, nums, dates = text_terms(text)
    names = set()
    first = _WORD.search(text)
    for m in _CAPS.finditer(text):
        if first is not None and m.start() == first.start():
            continue
        w = m.group(0).lower()
        if w in _NOT_NAMES or w in _MONTH_WORDS or w in _WEEKDAYS:
            continue
        names.add(w)
    return frozenset(names), nums, dates


# ------------------------------------------------------------------ per-user tables


class _UserTables:
    """Per (snapshot, user) arrays the features read: recency and session position of
    every row of the user's segment (float64 [n_u], module docstring)."""

    __slots__ = ("recency", "session_pos")

    def __init__(self, snapshot: Any, u: int) -> None:
        a, b = int(snapshot.offsets[u]), int(snapshot.offsets[u + 1])
        n = b - a
        local = np.arange(n)
        ca = snapshot.created_at_or_nan[a:b]
        t = np.where(np.isnan(ca), -np.inf, ca)  # an unknown time ranks as the oldest
        rec = np.empty(n)
        rec[np.lexsort((local, t))] = np.arange(n)
        self.recency = rec / (n - 1) if n > 1 else np.ones(n)
        pos = np.zeros(n)
        threads = snapshot.threads
        if threads is not None:
            th = threads[a:b]
            p = snapshot.positions_or_missing[a:b]
            groups: dict[Any, list[int]] = {}
            for i, x in enumerate(th.tolist()):  # once per (snapshot, user): cached
                if x is not None:
                    groups.setdefault(x, []).append(i)
            big = np.iinfo(np.int64).max
            for members in groups.values():
                if len(members) < 2:
                    continue
                m = np.asarray(members)
                pk = np.where(p[m] >= 0, p[m], big)  # no position: after those with one
                order = m[np.lexsort((m, pk))]
                pos[order] = np.arange(len(m)) / (len(m) - 1)
        self.session_pos = pos


_tables: dict[tuple[int, int], tuple[Any, _UserTables]] = {}
_tables_lock = threading.Lock()
_TABLES_MAX = 1024


def _user_tables(snapshot: Any, u: int) -> _UserTables:
    """:class:`_UserTables` of user index ``u``, cached per live snapshot object."""
    key = (id(snapshot), u)
    with _tables_lock:
        hit = _tables.get(key)
    if hit is not None and hit[0]() is snapshot:
        return hit[1]
    tab = _UserTables(snapshot, u)
    with _tables_lock:
        if len(_tables) >= _TABLES_MAX:
            _tables.clear()
        _tables[key] = (weakref.ref(snapshot), tab)
    return tab


# ------------------------------------------------------------------ features


def _as2d(x: Any, shape: tuple[int, int], name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a float array of shape {shape}") from None
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (as rows), got {a.shape}")
    return a


def _rank(v: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """0-based descending rank of ``v`` [b, N] among each row's valid entries (ties by column)."""
    key = np.where(valid, -v, np.inf)
    order = np.argsort(key, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(v.shape[1])[None, :].repeat(v.shape[0], 0), axis=1)
    return rank.astype(np.float64)


def _rowmax(v: np.ndarray, valid: np.ndarray) -> np.ndarray:
    m = np.where(valid, v, -np.inf).max(axis=1, initial=-np.inf)
    return np.where(np.isfinite(m), m, 0.0)[:, None]


def stage_features(
    snapshot: Any,
    rows: Any,
    query_texts: Sequence[str | None] | None,
    dense: Any,
    lexical: Any,
    fused: Any,
    context: Any = None,
    mean: Any = None,
    entropy: Any = None,
    texts: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The second-stage features of b queries' candidate lists (module docstring).

    Args:
        snapshot: the :class:`rfmem_fast.bank.BankSnapshot` the lists were searched in
            (its offsets, texts, lexical index, created_at, threads and positions).
        rows: int [b, N] snapshot rows of each query's candidates in first-stage order,
            -1 padding (after the valid ones); a query's valid rows lie in one user's segment.
        query_texts: b query texts (str or None: no lexical or text feature), or None
            (no query has a text).
        dense, lexical, fused: float [b, N] per candidate: the exact cosine, the raw BM25
            (NaN: none, read as 0) and the base score (``SearchResult.dense_scores``,
            ``lexical_scores``, ``scores``); padding entries are ignored.
        context: float [b, N] the context score (``context_scores``) or None (off); NaN
            entries read as ``fused``.
        mean, entropy: float [b] the queries' probe signals (``SearchResult.mean`` /
            ``entropy``), or None (0).
        texts: object [b, N] the candidates' texts (``SearchResult.texts``), or None (read
            from ``snapshot.texts``); None entries have no text.

    Returns:
        (features float64 [b, N, len(STAGE_FEATURES)] in STAGE_FEATURES order, 0 at
        padding; valid bool [b, N]).

    Raises:
        ValueError: shapes that do not match, rows outside the snapshot, a query's rows
            in several users' segments, padding before a valid row, ``query_texts`` of
            the wrong length, a non-finite score of a valid candidate.
        TypeError: a query text that is neither str nor None.
    """
    R = np.asarray(rows)
    if R.ndim != 2 or not np.issubdtype(R.dtype, np.integer):
        raise ValueError(f"rows must be an int array [b, N], got {R.dtype} {R.shape}")
    R = R.astype(np.int64, copy=False)
    b, N = R.shape
    n = int(snapshot.offsets[-1])
    valid = R >= 0
    if (R >= n).any():
        raise ValueError(f"rows must be < the snapshot's {n} rows (or -1 padding)")
    if (valid[:, 1:] & ~valid[:, :-1]).any():
        raise ValueError("rows: a valid row follows padding (-1 must come after a query's candidates)")
    D = _as2d(dense, (b, N), "dense")
    L = np.nan_to_num(_as2d(lexical, (b, N), "lexical"), nan=0.0)
    Fz = _as2d(fused, (b, N), "fused")
    C = Fz.copy() if context is None else _as2d(context, (b, N), "context")
    C = np.where(np.isnan(C), Fz, C)
    for name, a in (("dense", D), ("lexical", L), ("fused", Fz), ("context", C)):
        if not np.isfinite(a[valid]).all():
            raise ValueError(f"{name} must be finite for every candidate (rows >= 0)")
    D, L, Fz, C = (np.where(valid, a, 0.0) for a in (D, L, Fz, C))
    if query_texts is None:
        query_texts = [None] * b
    if len(query_texts) != b:
        raise ValueError(f"query_texts must have {b} entries (one per query), got {len(query_texts)}")
    sig = []
    for name, x in (("mean", mean), ("entropy", entropy)):
        a = np.zeros(b) if x is None else np.asarray(x, dtype=np.float64)
        if a.shape != (b,) or not np.isfinite(a).all():
            raise ValueError(f"{name} must be {b} finite floats, got shape {a.shape}")
        sig.append(a[:, None])
    mean_a, ent_a = sig
    if texts is None:
        T = np.full((b, N), None, dtype=object)
        if snapshot.texts is not None:
            T[valid] = snapshot.texts[R[valid]]
    else:
        T = np.asarray(texts, dtype=object)
        if T.shape != (b, N):
            raise ValueError(f"texts must have shape {(b, N)}, got {T.shape}")
    seg = np.searchsorted(snapshot.offsets, np.where(valid, R, 0), side="right") - 1
    user = np.where(valid[:, :1], seg[:, :1], -1)[:, 0]
    if (valid & (seg != user[:, None])).any():
        bad = int(np.flatnonzero((valid & (seg != user[:, None])).any(axis=1))[0])
        raise ValueError(f"rows of query {bad} lie in several users' segments (a candidate list is one user's)")

    F = np.zeros((b, N, len(STAGE_FEATURES)))
    col = _COL
    lmax = _rowmax(L, valid)
    lrel = np.where(lmax > 0, L / np.where(lmax > 0, lmax, 1.0), 0.0)
    F[:, :, col["dense"]] = D
    F[:, :, col["dense_gap"]] = D - _rowmax(D, valid)
    F[:, :, col["dense_rank"]] = np.log1p(_rank(D, valid))
    F[:, :, col["lexical"]] = L
    F[:, :, col["lexical_rel"]] = lrel
    F[:, :, col["lexical_rank"]] = np.log1p(_rank(L, valid))
    F[:, :, col["fused"]] = Fz
    F[:, :, col["fused_gap"]] = Fz - _rowmax(Fz, valid)
    F[:, :, col["fused_rank"]] = np.log1p(_rank(Fz, valid))
    F[:, :, col["context"]] = C
    F[:, :, col["context_gap"]] = C - _rowmax(C, valid)
    F[:, :, col["list_rank"]] = np.log1p(np.arange(N, dtype=np.float64))[None, :]
    F[:, :, col["mean_x_dense"]] = mean_a * D
    F[:, :, col["entropy_x_dense"]] = ent_a * D
    F[:, :, col["mean_x_lexical"]] = mean_a * lrel
    F[:, :, col["entropy_x_lexical"]] = ent_a * lrel

    lex = getattr(snapshot, "lexical", None)
    for i in range(b):  # per query: a few numpy calls over its user's postings and its N rows
        nv = int(valid[i].sum())
        if nv == 0:
            continue
        u = int(user[i])
        a0 = int(snapshot.offsets[u])
        loc = R[i, :nv] - a0
        tab = _user_tables(snapshot, u)
        F[i, :nv, col["recency"]] = tab.recency[loc]
        F[i, :nv, col["session_pos"]] = tab.session_pos[loc]
        qt = query_texts[i]
        if qt is None:
            continue
        if not isinstance(qt, str):
            raise TypeError(f"query_texts[{i}] must be a str or None, got {type(qt).__name__}")
        if lex is not None:
            cov, idf_m, idf_f = _term_overlap(lex, u, qt, loc)
            F[i, :nv, col["coverage"]] = cov
            F[i, :nv, col["idf_mass"]] = idf_m
            F[i, :nv, col["idf_frac"]] = idf_f
        names, nums, dates = query_terms(qt)
        if names or nums or dates:
            for j in range(nv):
                t = T[i, j]
                if t is None:
                    continue
                w, cn, cd = text_terms(t)
                F[i, j, col["num_match"]] = len(nums & cn)
                F[i, j, col["name_match"]] = len(names & w)
                F[i, j, col["date_match"]] = len(dates & cd)
    return np.where(valid[:, :, None], F, 0.0), valid


def _term_overlap(lex: Any, u: int, text: str, loc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coverage, idf_mass, idf_frac) float64 [len(loc)] of user ``u``'s local rows ``loc``
    for a query text (module docstring), from the user's BM25 postings."""
    toks = lex.analyzer.tokens(text)
    nq = len(set(toks))
    k = loc.shape[0]
    if nq == 0:
        return np.zeros(k), np.zeros(k), np.zeros(k)
    P = lex.postings(u)
    Nd = float(P.n_docs)
    qt, _ = lex.vocab.encode_query(toks)
    idf_df0 = math.log(1.0 + (Nd + 0.5) / 0.5)
    total = idf_df0 * nq
    Tn = P.terms.shape[0]
    if qt.shape[0] == 0 or Tn == 0:
        return np.zeros(k), np.zeros(k), np.zeros(k)
    idx = np.searchsorted(P.terms, qt)
    ok = idx < Tn
    ok[ok] = P.terms[idx[ok]] == qt[ok]
    if not ok.any():
        return np.zeros(k), np.zeros(k), np.zeros(k)
    idx = idx[ok]
    starts, ends = P.ptr[idx], P.ptr[idx + 1]
    lens = ends - starts
    df = lens.astype(np.float64)
    idf = np.log(1.0 + (Nd - df + 0.5) / (df + 0.5))
    total += float(idf.sum()) - idf_df0 * idf.shape[0]
    m = int(lens.sum())
    sel = np.arange(m, dtype=np.int64) + np.repeat(starts - np.cumsum(lens) + lens, lens)
    prow = P.rows[sel]
    cnt = np.bincount(prow, minlength=P.n_rows)
    mass = np.bincount(prow, weights=np.repeat(idf, lens), minlength=P.n_rows)
    item = loc if P.item_row is None else P.item_row[loc]
    cov = cnt[item] / nq
    im = mass[item]
    return cov, im, im / total if total > 0 else np.zeros(k)


def features_from_result(result: Any, snapshot: Any, query_texts: Sequence[str | None] | None,
                         depth: int | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """:func:`stage_features` of a :class:`rfmem_fast.search.SearchResult` (its first ``depth`` hits).

    Args:
        result: the SearchResult (Familiarity path: ``rows``, ``scores``, ``dense_scores``,
            ``lexical_scores``, ``context_scores``, ``texts``, ``mean``, ``entropy``).
        snapshot: the bank snapshot the search ran on (``bank.snapshot()`` when nothing
            was written since).
        query_texts: the queries' texts (as given to the search) or None.
        depth: use the first ``depth`` hits (default all ``out_k`` columns).

    Returns:
        (features float64 [b, depth, F], valid bool [b, depth]).

    Raises:
        ValueError: ``depth`` above the result's columns or < 1; the snapshot does not
            hold the result's ids at its rows (another snapshot); as :func:`stage_features`.
    """
    K = int(result.rows.shape[1])
    depth = K if depth is None else depth
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or not 1 <= depth <= K:
        raise ValueError(f"depth must be an int in [1, {K}] (the result's hits per query), got {depth!r}")
    sl = slice(0, int(depth))
    rows = np.asarray(result.rows)[:, sl]
    v = rows >= 0
    ids = snapshot.item_ids[np.where(v, rows, 0)]
    if not all(a == x for a, x in zip(ids[v].tolist(), np.asarray(result.ids)[:, sl][v].tolist())):
        raise ValueError("snapshot: its rows do not hold the result's ids (pass the snapshot the search ran on)")
    nan = np.full(rows.shape, np.nan)
    lex = nan if result.lexical_scores is None else result.lexical_scores[:, sl]
    ctx = None if result.context_scores is None else result.context_scores[:, sl]
    dense = nan if result.dense_scores is None else result.dense_scores[:, sl]
    return stage_features(snapshot, rows, query_texts, dense, lex, np.asarray(result.scores)[:, sl], ctx,
                          result.mean, result.entropy, np.asarray(result.texts)[:, sl])  # fmt: skip


def stage_labels(ids: Any, valid: Any, relevant: Sequence[Any]) -> np.ndarray:
    """Relevance labels int64 [b, N] in {0, 1} of candidate lists
    (:func:`rfmem_fast.routing.rerank.candidate_labels`: ``relevant[i]`` a list of ids or a
    mapping ``{alternative: [ids]}``, every listed id relevant, ids compared as str).

    Raises:
        ValueError / TypeError: as ``candidate_labels``.
    """
    from .routing.rerank import candidate_labels

    return candidate_labels(ids, valid, relevant)


# ------------------------------------------------------------------ models


def _check_features(features: Sequence[str]) -> tuple[str, ...]:
    feats = tuple(str(f) for f in features)
    bad = [f for f in feats if f not in _COL]
    if bad or not feats or len(set(feats)) != len(feats):
        raise ValueError(f"features must be distinct names from STAGE_FEATURES {STAGE_FEATURES}, got {list(features)}")
    return feats


def _check_depth(depth: Any) -> int:
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or not 1 <= depth <= _MAX_DEPTH:
        raise ValueError(f"depth must be an int in [1, {_MAX_DEPTH}], got {depth!r}")
    return int(depth)


def _check_F(F: Any, valid: Any) -> tuple[np.ndarray, np.ndarray]:
    F = np.asarray(F, dtype=np.float64)
    V = np.asarray(valid, dtype=bool)
    if F.ndim != 3 or F.shape[2] != len(STAGE_FEATURES) or V.shape != F.shape[:2]:
        raise ValueError(f"features must be [b, N, {len(STAGE_FEATURES)}] and valid [b, N], got {F.shape} and {V.shape}")
    return F, V


class _Stage:
    """What both models share: ``features``, ``depth``, ``meta``, :meth:`score`, :meth:`rerank`."""

    kind = ""
    features: tuple[str, ...]
    depth: int
    meta: dict[str, Any]

    def _cols(self) -> np.ndarray:
        return np.array([_COL[f] for f in self.features])

    def _raw(self, X: np.ndarray) -> np.ndarray:  # pragma: no cover - overridden
        raise NotImplementedError

    def score(self, F: Any, valid: Any = None) -> np.ndarray:
        """Stage scores float64 [b, N] of features [b, N, len(STAGE_FEATURES)] (-inf where not ``valid``).

        Raises:
            ValueError: features of another shape.
        """
        F = np.asarray(F, dtype=np.float64)
        V = np.ones(F.shape[:2], bool) if valid is None else valid
        F, V = _check_F(F, V)
        b, N, _ = F.shape
        s = self._raw(F[:, :, self._cols()].reshape(b * N, -1)).reshape(b, N)
        return np.where(V, s, -np.inf)

    def rerank(self, F: Any, valid: Any, out_k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``out_k`` best candidates of each list by :meth:`score` (ties: first-stage order).

        Args:
            F: float [b, N, len(STAGE_FEATURES)] (:func:`stage_features`); only the first
                ``depth`` columns are scored, the rest dropped.
            valid: bool [b, N].
            out_k: items per query (int >= 1).

        Returns:
            (order int64 [b, out_k]: column of each kept candidate in the first-stage
            list, -1 padding; scores float64 [b, out_k], -inf padding).

        Raises:
            ValueError: out_k < 1, shapes that do not match.
        """
        if isinstance(out_k, bool) or not isinstance(out_k, (int, np.integer)) or out_k < 1:
            raise ValueError(f"out_k must be an int >= 1, got {out_k!r}")
        F, V = _check_F(F, valid)
        F, V = F[:, : self.depth], V[:, : self.depth]
        s = self.score(F, V)
        b, N = V.shape
        col = np.broadcast_to(np.arange(N)[None, :], (b, N))
        fin = np.lexsort((col, -s), axis=1)[:, : int(out_k)]
        sc = np.take_along_axis(s, fin, 1)
        order = np.where(np.isfinite(sc), fin, -1)
        if order.shape[1] < out_k:
            pad = int(out_k) - order.shape[1]
            order = np.pad(order, ((0, 0), (0, pad)), constant_values=-1)
            sc = np.pad(sc, ((0, 0), (0, pad)), constant_values=-np.inf)
        return order.astype(np.int64), np.where(order >= 0, sc, -np.inf)

    def params(self) -> dict[str, Any]:  # pragma: no cover - overridden
        raise NotImplementedError


def _vector(x: Any, n: int, name: str) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of {n} numbers") from None
    if a.shape != (n,) or not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be {n} finite numbers, got {x!r:.80}")
    return a


class LinearStage(_Stage):
    """``score = sum_k w_k * feature_k`` over the features it names (module docstring).

    Args:
        features: distinct names from STAGE_FEATURES (at least one).
        weights: float [len(features)], finite, not all zero.
        depth: int in [1, 65536]: the first-stage candidates it re-ranks (N).
        meta: JSON-serialisable facts (what it was fitted on, CV scores).

    Raises:
        ValueError: unknown / repeated features, weights of the wrong length, non-finite
            or all zero, depth out of range.
    """

    kind = "linear"

    def __init__(self, features: Sequence[str], weights: Any, depth: int = 50, meta: dict[str, Any] | None = None) -> None:
        self.features = _check_features(features)
        self.weights = _vector(weights, len(self.features), "weights")
        if not np.any(self.weights != 0):
            raise ValueError("weights must not all be zero")
        self.depth = _check_depth(depth)
        self.meta = dict(meta or {})

    def _raw(self, X: np.ndarray) -> np.ndarray:
        return X @ self.weights

    def params(self) -> dict[str, Any]:
        """{"features", "weights", "depth"} (JSON-serialisable)."""
        return {"features": list(self.features), "weights": self.weights.tolist(), "depth": self.depth}

    @classmethod
    def from_params(cls, params: Mapping[str, Any], meta: dict[str, Any] | None = None) -> "LinearStage":
        """Rebuild from :meth:`params` (ValueError on a missing or malformed entry)."""
        missing = [k for k in ("features", "weights", "depth") if k not in params]
        if missing:
            raise ValueError(f"linear stage parameters lack {missing}")
        if not isinstance(params["features"], list) or not isinstance(params["weights"], list):
            raise ValueError("features and weights must be lists")
        return cls(params["features"], params["weights"], params["depth"], meta)

    def __repr__(self) -> str:
        w = ", ".join(f"{f}={x:+.4g}" for f, x in zip(self.features, self.weights))
        return f"LinearStage({w}; depth={self.depth})"


#: the node fields a stored tree holds, per node (TreeStage)
_TREE_FIELDS = ("feature", "threshold", "left", "right", "missing_left", "value")


class TreeStage(_Stage):
    """A gradient-boosted tree ensemble's raw score: ``baseline + sum_t leaf_t(x)`` (module docstring).

    Each tree is a dict of equal-length lists ``feature`` (int: index into ``features``;
    -1 at a leaf), ``threshold`` (float: go left when ``x <= threshold``), ``left`` /
    ``right`` (int: child nodes, -1 at a leaf), ``missing_left`` (bool: where NaN goes),
    ``value`` (float: the leaf's value); node 0 is the root, children come after their parent.

    Args:
        features: distinct names from STAGE_FEATURES.
        trees: list of such dicts (at least one).
        baseline: float, the constant term.
        depth: int in [1, 65536] (N).
        meta: JSON-serialisable facts.

    Raises:
        ValueError: unknown features, a malformed tree (lists of unequal length, a child
            or feature index out of range, a cycle-prone child order, non-finite values).
    """

    kind = "trees"

    def __init__(self, features: Sequence[str], trees: Sequence[Mapping[str, Any]], baseline: float, depth: int = 50,
                 meta: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.features = _check_features(features)
        self.depth = _check_depth(depth)
        self.meta = dict(meta or {})
        if not isinstance(baseline, (int, float)) or isinstance(baseline, bool) or not math.isfinite(baseline):
            raise ValueError(f"baseline must be a finite float, got {baseline!r}")
        self.baseline = float(baseline)
        if not trees:
            raise ValueError("trees must hold at least one tree")
        nf = len(self.features)
        feat, thr, left, right, miss, val, roots = [], [], [], [], [], [], []
        base = 0
        for t, tree in enumerate(trees):
            if not isinstance(tree, Mapping) or any(k not in tree for k in _TREE_FIELDS):
                raise ValueError(f"trees[{t}] must be a mapping with {list(_TREE_FIELDS)}")
            n = len(tree["feature"])
            if n < 1 or any(len(tree[k]) != n for k in _TREE_FIELDS):
                raise ValueError(f"trees[{t}]: the node lists must be non-empty and of one length")
            f = np.asarray(tree["feature"], dtype=np.int64)
            lf = np.asarray(tree["left"], dtype=np.int64)
            rt = np.asarray(tree["right"], dtype=np.int64)
            th = np.asarray(tree["threshold"], dtype=np.float64)
            v = np.asarray(tree["value"], dtype=np.float64)
            leaf = f < 0
            ids = np.arange(n)
            if (
                (f >= nf).any() or (leaf != (lf < 0)).any() or (leaf != (rt < 0)).any()
                or ((~leaf) & ((lf <= ids) | (rt <= ids) | (lf >= n) | (rt >= n))).any()
                or not np.isfinite(v).all() or not np.isfinite(th[~leaf]).all()
            ):  # fmt: skip
                raise ValueError(f"trees[{t}]: malformed nodes (children must follow their parent, indices in range)")
            feat.append(np.where(leaf, 0, f))
            thr.append(np.where(leaf, np.inf, th))
            left.append(np.where(leaf, ids, lf) + base)
            right.append(np.where(leaf, ids, rt) + base)
            miss.append(np.asarray(tree["missing_left"], dtype=bool))
            val.append(np.where(leaf, v, 0.0))
            roots.append(base)
            base += n
        self._feat, self._thr = np.concatenate(feat), np.concatenate(thr)
        self._left, self._right = np.concatenate(left), np.concatenate(right)
        self._miss, self._val = np.concatenate(miss), np.concatenate(val)
        self._leaf = np.concatenate([np.asarray(t["feature"]) < 0 for t in trees])
        self._roots = np.asarray(roots, dtype=np.int64)
        self._trees = [{k: list(tree[k]) for k in _TREE_FIELDS} for tree in trees]

    def _raw(self, X: np.ndarray) -> np.ndarray:
        m, T = X.shape[0], self._roots.shape[0]
        node = np.tile(self._roots, m)  # [m * T]: (sample, tree) pairs, sample-major
        samp = np.repeat(np.arange(m), T)
        active = np.flatnonzero(~self._leaf[node])
        while active.size:  # one level of every unfinished (sample, tree) pair per step
            nd = node[active]
            x = X[samp[active], self._feat[nd]]
            nxt = np.where(np.where(np.isnan(x), self._miss[nd], x <= self._thr[nd]), self._left[nd], self._right[nd])
            node[active] = nxt
            active = active[~self._leaf[nxt]]
        return self.baseline + self._val[node].reshape(m, T).sum(axis=1)

    def params(self) -> dict[str, Any]:
        """{"features", "baseline", "trees", "depth"} (JSON-serialisable)."""
        return {"features": list(self.features), "baseline": self.baseline, "trees": self._trees, "depth": self.depth}

    @classmethod
    def from_params(cls, params: Mapping[str, Any], meta: dict[str, Any] | None = None) -> "TreeStage":
        """Rebuild from :meth:`params` (ValueError on a missing or malformed entry)."""
        missing = [k for k in ("features", "baseline", "trees", "depth") if k not in params]
        if missing:
            raise ValueError(f"tree stage parameters lack {missing}")
        if not isinstance(params["features"], list) or not isinstance(params["trees"], list):
            raise ValueError("features and trees must be lists")
        return cls(params["features"], params["trees"], params["baseline"], params["depth"], meta)

    def __repr__(self) -> str:
        return f"TreeStage({len(self._trees)} trees over {len(self.features)} features; depth={self.depth})"


# ------------------------------------------------------------------ fitting


def _fit_inputs(F: Any, valid: Any, labels: Any, features: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple]:
    F, V = _check_F(F, valid)
    Y = np.asarray(labels)
    if Y.shape != V.shape:
        raise ValueError(f"labels must have the shape of valid {V.shape}, got {Y.shape}")
    feats = _check_features(features)
    return F[:, :, [_COL[f] for f in feats]], V, Y > 0, feats


def fit_linear_stage(
    F: Any,
    valid: Any,
    labels: Any,
    features: Sequence[str] = LINEAR_FEATURES,
    C: float = 1.0,
    depth: int = 50,
    meta: dict[str, Any] | None = None,
) -> LinearStage:
    """Fit a :class:`LinearStage` with a pairwise logistic regression (scikit-learn).

    Every (relevant, non-relevant) pair of valid candidates of one query gives the
    difference of their feature vectors (each column divided by its standard deviation
    over all pairs), labelled 1, and its negation, labelled 0, weighted ``1 / (pairs of
    the query)`` (mean weight 1) so that each query counts once; ``LogisticRegression(C,
    fit_intercept=False)`` (Newton-Cholesky solver; the pairs' negations folded in by
    negating every other pair) learns ``w`` with ``P(a above b) = sigmoid(w . (f_a - f_b))``.
    Queries without a relevant or without a non-relevant candidate give no pair.

    Args:
        F: float [b, N, len(STAGE_FEATURES)] (:func:`stage_features`).
        valid: bool [b, N]; labels: int [b, N] in {0, 1} (:func:`stage_labels`).
        features: the names to use (default :data:`LINEAR_FEATURES`).
        C: inverse regularisation strength (> 0).
        depth: the list depth N the features were built with (stored in the model).
        meta: stored with the model.

    Returns:
        LinearStage.

    Raises:
        ValueError: mismatched shapes, unknown features, C <= 0, no pair to learn from,
            all-zero weights.
    """
    from sklearn.linear_model import LogisticRegression

    X, V, Y, feats = _fit_inputs(F, valid, labels, features)
    if isinstance(C, bool) or not isinstance(C, (int, float)) or not C > 0:
        raise ValueError(f"C must be a float > 0, got {C!r}")
    depth = _check_depth(depth)
    pos, neg = V & Y, V & ~Y
    qi, a, bb = np.nonzero(pos[:, :, None] & neg[:, None, :])
    if qi.size == 0:
        raise ValueError("no query has both a relevant and a non-relevant candidate: nothing to learn from")
    D = X[qi, a] - X[qi, bb]
    npairs = np.bincount(qi, minlength=X.shape[0])
    w8 = 1.0 / npairs[qi]
    sd = D.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    # each pair once, every other one negated (label 0): without an intercept the loss of
    # (z, 1) equals that of (-z, 0), so this is the loss of the pairs and their negations
    # halved, i.e. the same fit with C doubled
    sign = np.where(np.arange(len(D)) % 2 == 0, 1.0, -1.0)
    Z = D / sd * sign[:, None]
    sw = w8 * (len(D) / w8.sum())  # mean weight 1: C keeps its usual scale
    clf = LogisticRegression(C=2.0 * float(C), fit_intercept=False, solver="newton-cholesky", max_iter=200)
    clf.fit(Z, (sign > 0).astype(np.int64), sample_weight=sw)
    w = clf.coef_[0] / sd
    if not np.any(w != 0):
        raise ValueError("the fitted weights are all zero (the features do not separate the pairs)")
    return LinearStage(feats, w, depth, meta)


def fit_tree_stage(
    F: Any,
    valid: Any,
    labels: Any,
    features: Sequence[str] = TREE_FEATURES,
    depth: int = 50,
    max_iter: int = 100,
    learning_rate: float = 0.1,
    max_leaf_nodes: int = 15,
    min_samples_leaf: int = 40,
    l2_regularization: float = 1.0,
    seed: int = 0,
    meta: dict[str, Any] | None = None,
) -> TreeStage:
    """Fit a :class:`TreeStage`: scikit-learn ``HistGradientBoostingClassifier`` on the valid
    candidates (pointwise: relevant or not), each query's candidates weighing 1 in total,
    no early stopping; its trees exported as data.

    Args:
        F, valid, labels: as :func:`fit_linear_stage`.
        features: the names to use (default :data:`TREE_FEATURES`).
        depth: N (stored).
        max_iter, learning_rate, max_leaf_nodes, min_samples_leaf, l2_regularization:
            the classifier's parameters.
        seed: its random_state.
        meta: stored with the model.

    Returns:
        TreeStage (its :meth:`~TreeStage.score` equals the classifier's
        ``decision_function`` on the same features).

    Raises:
        ValueError: mismatched shapes, unknown features, no valid candidate, labels of one class only.
    """
    from sklearn.ensemble import HistGradientBoostingClassifier

    X, V, Y, feats = _fit_inputs(F, valid, labels, features)
    depth = _check_depth(depth)
    x, y = X[V], Y[V]
    if y.size == 0 or y.all() or not y.any():
        raise ValueError("labels must hold both relevant and non-relevant valid candidates")
    per_q = V.sum(axis=1)
    w = (1.0 / np.maximum(per_q, 1))[:, None].repeat(V.shape[1], 1)[V]
    clf = HistGradientBoostingClassifier(
        max_iter=int(max_iter), learning_rate=float(learning_rate), max_leaf_nodes=int(max_leaf_nodes),
        min_samples_leaf=int(min_samples_leaf), l2_regularization=float(l2_regularization), early_stopping=False,
        random_state=int(seed),
    ).fit(x, y.astype(np.int64), sample_weight=w * (w.size / w.sum()))  # fmt: skip
    trees = []
    for it in clf._predictors:  # one TreePredictor per iteration (binary)
        nodes = it[0].nodes
        leaf = nodes["is_leaf"].astype(bool)
        if nodes["is_categorical"].any():  # pragma: no cover - no categorical features are declared
            raise ValueError("categorical splits are not supported")
        trees.append({
            "feature": np.where(leaf, -1, nodes["feature_idx"].astype(np.int64)).tolist(),
            "threshold": np.where(leaf, 0.0, nodes["num_threshold"]).astype(float).tolist(),
            "left": np.where(leaf, -1, nodes["left"].astype(np.int64)).tolist(),
            "right": np.where(leaf, -1, nodes["right"].astype(np.int64)).tolist(),
            "missing_left": nodes["missing_go_to_left"].astype(bool).tolist(),
            "value": np.where(leaf, nodes["value"], 0.0).astype(float).tolist(),
        })  # fmt: skip
    baseline = float(np.asarray(clf._baseline_prediction).ravel()[0])
    return TreeStage(feats, trees, baseline, depth, meta)


# ------------------------------------------------------------------ applying to a search result


def rerank_result(model: Any, result: Any, snapshot: Any, query_texts: Sequence[str | None] | None,
                  out_k: int = 10) -> Any:  # fmt: skip
    """A :class:`rfmem_fast.search.SearchResult` re-ranked by a second stage, cut to ``out_k``.

    The search must have been run with ``out_k >= model.depth`` (e.g. ``config.replace(out_k=50)``).
    Every query that took the Familiarity path gets the model's ``out_k`` best of its first
    ``depth`` hits; the per-hit fields (``ids``, ``texts``, ``rows``, ``scores``,
    ``dense_scores``, ``lexical_scores``, ``context_scores``) follow the new order;
    a query that recollected keeps its first ``out_k`` hits unchanged.

    Args:
        model: a :class:`LinearStage` or :class:`TreeStage`.
        result: the SearchResult.
        snapshot: the bank snapshot the search ran on.
        query_texts: the query texts given to the search (or None).
        out_k: hits per query (int >= 1, default 10).

    Returns:
        SearchResult with ``out_k`` hits per query.

    Raises:
        ValueError: the result has fewer hits per query than ``model.depth``; as
            :func:`features_from_result`.
    """
    if not isinstance(model, _Stage):
        raise TypeError(f"model must be a LinearStage or TreeStage, got {type(model).__name__}")
    K = int(result.rows.shape[1])
    if K < model.depth:
        raise ValueError(f"result has {K} hits per query but the model re-ranks the top {model.depth}: "
                         f"search with out_k >= {model.depth}")  # fmt: skip
    F, V = features_from_result(result, snapshot, query_texts, model.depth)
    order, _ = model.rerank(F, V, out_k)
    fam = np.asarray(result.route) == 0
    keep = np.broadcast_to(np.arange(out_k)[None, :], order.shape)
    keep = np.where(keep < K, keep, -1)
    order = np.where(fam[:, None], order, keep)

    def take(a: Any, fill: Any) -> Any:
        if a is None:
            return None
        a = np.asarray(a)
        got = np.take_along_axis(a, np.maximum(order, 0), 1)
        return np.where(order >= 0, got, np.asarray(fill, dtype=a.dtype))

    return dataclasses.replace(
        result, ids=take(result.ids, None), texts=take(result.texts, None), rows=take(result.rows, -1),
        scores=take(result.scores, -np.inf), dense_scores=take(result.dense_scores, np.nan),
        lexical_scores=take(result.lexical_scores, np.nan), context_scores=take(result.context_scores, np.nan),
    )  # fmt: skip


# ------------------------------------------------------------------ files


_KINDS = {"linear": LinearStage, "trees": TreeStage}


def stage_document(model: Any, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of a second stage: ``{"format": STAGE_FORMAT, "version":
    STAGE_VERSION, "kind": "linear" | "trees", "params": model.params(), "meta": {...}}``.

    Raises:
        TypeError: not a LinearStage / TreeStage.
    """
    if not isinstance(model, _Stage):
        raise TypeError(f"model must be a LinearStage or TreeStage, got {type(model).__name__}")
    return {"format": STAGE_FORMAT, "version": STAGE_VERSION, "kind": model.kind, "params": model.params(),
            "meta": dict(model.meta if meta is None else meta)}  # fmt: skip


def save_stage(model: Any, path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> str:
    """Write a second-stage file atomically (temporary file + rename; :func:`stage_document`).

    Args:
        model: a LinearStage or TreeStage.
        path: the JSON file (its folder must exist).
        meta: JSON-serialisable facts (default: the model's own ``meta``).

    Returns:
        the path written (str).

    Raises:
        TypeError: not a stage model, or ``meta`` not JSON-serialisable.
        OSError: the file cannot be written.
    """
    from .routing.files import _write_atomic

    return _write_atomic(stage_document(model, meta), path)


def _parse_stage(doc: Any, where: str) -> Any:
    from .routing.files import _check_header

    _check_header(doc, where, STAGE_FORMAT, STAGE_VERSION, "second-stage", ("kind", "params"), StageFileError)
    cls = _KINDS.get(doc["kind"])
    if cls is None:
        raise StageFileError(f"{where}: unknown second-stage kind {doc['kind']!r} (known: {sorted(_KINDS)})")
    if not isinstance(doc["params"], dict):
        raise StageFileError(f"{where}: 'params' must be an object")
    meta = doc.get("meta") or {}
    try:
        return cls.from_params(doc["params"], meta if isinstance(meta, dict) else {})
    except (TypeError, ValueError) as e:
        raise StageFileError(f"{where}: malformed {doc['kind']} parameters: {e}") from None


def load_stage(path: str | os.PathLike[str]) -> Any:
    """Read a second-stage file (cached per path, modification time and size).

    Returns:
        the LinearStage or TreeStage (its ``meta`` holds the file's).

    Raises:
        FileNotFoundError: no such file.
        StageFileError: (a ValueError) not JSON, another format, a newer version, an
            unknown kind, malformed parameters; the message names the file.
    """
    from .routing.files import _load_cached

    return _load_cached(path, "second-stage", _parse_stage, StageFileError)
