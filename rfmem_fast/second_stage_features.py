"""The second stage's features: what :mod:`rfmem_fast.second_stage` scores per candidate.

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
"""
from __future__ import annotations

import math
import re
import threading
import weakref
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

__all__ = ["STAGE_FEATURES", "LINEAR_FEATURES", "TREE_FEATURES", "stage_features", "features_from_result",
           "stage_labels", "query_terms", "text_terms"]

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


_NO_TERMS = (frozenset(), frozenset(), frozenset())


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
        if names or nums or dates:  # one list per feature and query (a candidate without a text: 0)
            tt = [_NO_TERMS if t is None else text_terms(t) for t in T[i, :nv].tolist()]
            for want, part, name in ((nums, 1, "num_match"), (names, 0, "name_match"), (dates, 2, "date_match")):
                if want:
                    F[i, :nv, col[name]] = [len(want & x[part]) for x in tt]
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
