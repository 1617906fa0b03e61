"""The lexical channel: bm25s-compatible tokenisation and per-user BM25 ("lucene") postings.

Sits at the bank level: :mod:`rfmem_fast.bank`, :mod:`rfmem_fast.store` and
:mod:`rfmem_fast.search` import it; it imports only numpy (and PyStemmer when a stemmer
is asked for).

Tokenisation (exactly ``bm25s.tokenize(texts, lower=True, stopwords="en", stemmer=...)``
of bm25s 0.3.16): the text is lowercased (``str.lower``), split with the regex
:data:`TOKEN_PATTERN` ``(?u)\\b\\w\\w+\\b`` (scikit-learn's CountVectorizer pattern: runs
of two or more word characters), tokens in :data:`STOPWORDS_EN` (bm25s's English list,
copied here so the core install needs no bm25s) are dropped, and, with the stemmer
"english", every remaining token is replaced by its PyStemmer (Snowball) English stem.
Stopwords are removed before stemming, as bm25s does.

Scoring (bm25s ``BM25(method="lucene", k1=1.5, b=0.75)``). Each user's memory is its OWN
corpus: for user ``u``, the documents are its live items that have a text (an item
added with ``text=None`` is no document: it counts neither in ``N`` nor in ``avgdl``
and never has a lexical score or hit; an item whose text is ``""`` or only stopwords is
a document of length 0). With ``N`` the number of documents, ``df_t`` the number of
documents holding token ``t``, ``dl_d`` the token count of document ``d`` (after
stopword removal) and ``avgdl = sum(dl) / N``::

    idf_t     = log(1 + (N - df_t + 0.5) / (df_t + 0.5))
    w(t, d)   = idf_t * (tf_{t,d} / (k1 * ((1 - b) + b * dl_d / avgdl) + tf_{t,d}))
    bm25(q,d) = sum over the DISTINCT known tokens t of q, in order of first
                occurrence in q, of  qtf_t * w(t, d)

(bm25s's "lucene" term frequency part is ``tf / (k1 (1 - b + b dl / avgdl) + tf)``,
without the ``(k1 + 1)`` factor; a query token repeated ``qtf`` times counts ``qtf``
times, as bm25s adds its score once per occurrence; a query token unknown to the
user's corpus contributes nothing, as bm25s drops it). Everything is float64 (bm25s
stores float32: its scores agree to ~1e-7 relative); the sum runs in the stated order
(``np.bincount`` accumulates in input order), so the score of a document depends only
on the query and on the user's own texts: **tenant isolation** (no other user's text
changes ``N``, ``df``, ``avgdl`` or the summation order; token ids are shared across the
bank only as names). Every ``w(t, d) > 0``, so "the document contains a query token"
(a lexical *hit*) is exactly ``bm25 > 0``.

Index layout, per bank snapshot (:class:`LexicalIndex`): a forward index in CSR form
(``ptr`` int64 [n + 1]; ``terms`` int32 / ``tf`` int32 [nnz]: each row's distinct token
ids, ascending, and their counts; ``has_text`` bool [n]) beside the snapshot's vectors,
and, built lazily the first time a user is queried, that user's inverted index
(:class:`UserPostings`: sorted term ids, CSR pointers, local rows and the precomputed
``w(t, d)`` of every posting). Postings use rows LOCAL to the user's segment, so a
user unchanged between two snapshots keeps its postings (the bank carries them over);
the bank caches each item's token ids when the item is added or its text updated, so a
write to one user never re-tokenises another user's texts.

Items stored as several rows (chunked long texts). A text longer than the encoder's
window is stored by :class:`rfmem_fast.serving.Memory` as several rows of one item: the
item's own row (id ``p``, holding the WHOLE text) and its extra chunk rows, ids
``"<p>\x1f<j>"`` (:data:`CHUNK_SEP`, ``j >= 1``) without text of their own. The
lexical index treats an item as ONE document: its whole text, so the statistics above
(``N``, ``df``, ``dl``, ``avgdl``) count it once with its whole length, exactly as if it
had not been chunked, and every row of the item has the item's BM25
(:meth:`UserPostings.scores`; the postings themselves hold the item's own row only and
:attr:`UserPostings.item_row` maps each row to it). A row is an extra chunk row of item
``p`` (:func:`item_rows`) when its id is a str ``p + CHUNK_SEP + j`` with ``j`` a
positive decimal number, ``p`` contains no :data:`CHUNK_SEP`, the row has no text and
the same user holds a row with id ``p``; any other row is an item of its own.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

try:  # the native query tokenizer (csrc/cpu/tokenize.cpp); a build without it: the Python path
    from ._native import TokenIds as _TokenIds
except ImportError:  # pragma: no cover - a build without the extension
    _TokenIds = None

#: the token regex of bm25s (and scikit-learn's CountVectorizer): two or more word characters
TOKEN_PATTERN = r"(?u)\b\w\w+\b"
#: bm25s's English stopword list (``bm25s.stopwords.STOPWORDS_EN``, from NLTK), 33 words
STOPWORDS_EN = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it",
    "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these",
    "they", "this", "to", "was", "will", "with",
))  # fmt: skip
#: BM25 "lucene" constants (bm25s defaults)
K1 = 1.5
B = 0.75
#: the stemmers a bank's lexical index accepts (None: no stemming)
STEMMERS = (None, "english")
#: the extra that installs PyStemmer
STEMMER_EXTRA = "lexical"
#: separates an item id from a chunk number in the row ids of a long text's extra chunk
#: rows (``"<item>\x1f<j>"``, j >= 1; :func:`item_rows`)
CHUNK_SEP = "\x1f"

_TOKEN_RE = re.compile(TOKEN_PATTERN)
#: False makes every query text take the Python path (tests compare both); results never depend on it
USE_NATIVE_TOKENIZER = True
_NATIVE_LOCK = threading.Lock()
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
#: joins a batch's texts (:meth:`Analyzer.batch_ids`): a non-word character, so no token
#: spans it and it bounds words as a text's ends do; a batch holding it runs text by text
_MARK = "\x00"
#: :data:`TOKEN_PATTERN` or the mark (tokens as the pattern's; the marks where they are)
_MARKED_RE = re.compile(TOKEN_PATTERN + "|" + _MARK)
#: ASCII bytes -> what they are in a token: [a-z0-9_] themselves, [A-Z] lowercased (``str.lower``),
#: the mark itself, every other byte (the non-word ASCII characters) a space
_ASCII_WORDS = bytes(
    c + 32 if 65 <= c <= 90 else c if (97 <= c <= 122 or 48 <= c <= 57 or c == 95 or c == 0) else 32 for c in range(256)
)
#: ids of :meth:`Analyzer.batch_ids`: a dropped token (stopword, or a 1-character run of the
#: ASCII split, never a token of the pattern) and the mark between two texts
_DROP, _SEP = -1, -2
_SPECIAL = {**{w: _DROP for w in STOPWORDS_EN}, **{chr(c): _DROP for c in range(128) if _ASCII_WORDS[c] == c != 0},
            _MARK: _SEP}  # fmt: skip

__all__ = [
    "B", "CHUNK_SEP", "K1", "STEMMERS", "STOPWORDS_EN", "TOKEN_PATTERN", "Analyzer", "LexicalIndex", "UserPostings",
    "Vocabulary", "check_stemmer", "item_rows",
]  # fmt: skip


def check_stemmer(stemmer: Any) -> str | None:
    """``stemmer`` as a bank option: None or "english".

    Raises:
        ValueError: another value (the message names ``lexical_stemmer``).
    """
    if stemmer not in STEMMERS:
        raise ValueError(f"lexical_stemmer must be one of {STEMMERS}, got {stemmer!r}")
    return stemmer


class Analyzer:
    """bm25s's tokenizer (module docstring): lowercase, :data:`TOKEN_PATTERN`, English stopwords, optional stemmer.

    Args:
        stemmer: None or "english" (PyStemmer's Snowball English stemmer).

    Raises:
        ValueError: an unknown stemmer.
        ImportError: "english" without PyStemmer installed (names the extra ``lexical``).
    """

    def __init__(self, stemmer: str | None = None) -> None:
        self.stemmer = check_stemmer(stemmer)
        self._stem = None
        self._cache: dict[str, str] = {}
        if stemmer == "english":
            try:
                import Stemmer  # PyStemmer
            except ImportError as exc:
                raise ImportError(
                    "lexical_stemmer='english' needs the optional package 'PyStemmer', which cannot be imported "
                    f'({exc}); install it with: pip install "rfmem_fast[{STEMMER_EXTRA}]"',
                    name="Stemmer",
                ) from exc
            self._stem = Stemmer.Stemmer("english")
            self._lock = threading.Lock()  # PyStemmer objects are not thread-safe

    def tokens(self, text: str) -> list[str]:
        """The tokens of one text (list of str; empty for "" or a text of stopwords only)."""
        toks = [t for t in _TOKEN_RE.findall(text.lower()) if t not in STOPWORDS_EN]
        if self._stem is None or not toks:
            return toks
        cache = self._cache
        new = [t for t in toks if t not in cache]
        if new:
            with self._lock:
                for t, s in zip(new, self._stem.stemWords(new)):
                    cache[t] = s
        return [cache[t] for t in toks]

    def batch_ids(self, texts: Sequence[str | None], ids: dict[str, int]) -> np.ndarray | None:
        """The tokens of b texts (:meth:`tokens` of each, None as "") looked up in ``ids``,
        flat, with a mark between consecutive texts, in one pass over the batch.

        An ASCII batch is lowercased and split at its non-word characters in one C pass
        (bytes.translate, then str.split: the maximal runs of ``[a-z0-9_]``, which are
        :data:`TOKEN_PATTERN`'s tokens once the 1-character runs are dropped); another
        batch lowers each text (``str.lower``: one text's lowering never depends on its
        neighbour) and runs :data:`TOKEN_PATTERN` once over them joined by the mark, a
        non-word character. Stopwords are dropped before stemming and new tokens go through
        the stemmer's cache, as in :meth:`tokens`.

        Args:
            texts: b str or None.
            ids: token -> id (a :class:`Vocabulary`'s ``ids``).

        Returns:
            int64 [n]: per token its id, -1 (a stopword, or a token not in ``ids``) or -2
            (the mark between text i and i + 1: b - 1 of them, in order); None when a
            text holds the mark character (``"\\x00"``): tokenise those one by one.

        Raises:
            TypeError: ``texts[i]`` is neither a str nor None.
        """
        lows = ["" if t is None else t for t in texts]
        try:
            joined = (" " + _MARK + " ").join(lows)
        except TypeError:
            i = next(i for i, t in enumerate(lows) if not isinstance(t, str))
            raise TypeError(f"texts[{i}] must be a str or None, got {type(lows[i]).__name__}") from None
        if joined.count(_MARK) != len(lows) - 1:
            return None
        if joined.isascii():
            toks = joined.encode("ascii").translate(_ASCII_WORDS).decode("ascii").split()
        else:
            toks = _MARKED_RE.findall(_MARK.join([t.lower() for t in lows]))
        special, get = _SPECIAL.get, ids.get
        if self._stem is None:
            return np.array([special(t) or get(t, _DROP) for t in toks], dtype=np.int64)
        cache = self._cache
        new = [t for t in dict.fromkeys(toks) if t not in cache and special(t) is None]
        if new:
            with self._lock:
                for t, s in zip(new, self._stem.stemWords(new)):
                    cache[t] = s
        return np.array([special(t) or get(cache[t], _DROP) for t in toks], dtype=np.int64)

    def __repr__(self) -> str:
        return f"Analyzer(stemmer={self.stemmer!r})"


class Vocabulary:
    """Token -> int32 id of one bank (append-only; ids are names, never part of a score).

    Writes happen under the bank's lock; reads (query lookups) need none (a dict read).
    """

    def __init__(self, tokens: Sequence[str] = ()) -> None:
        self.tokens: list[str] = list(tokens)
        self.ids: dict[str, int] = {t: i for i, t in enumerate(self.tokens)}
        if len(self.ids) != len(self.tokens):
            raise ValueError("vocabulary tokens must be distinct")

    def __len__(self) -> int:
        return len(self.tokens)

    def native_ids(self) -> Any:
        """The native mirror of this vocabulary (``_native.TokenIds``: token -> id and the
        stopwords, for :meth:`LexicalIndex.encode_queries`), brought in step with ``tokens``
        (append-only: the tokens past its length are added); None without the extension."""
        if _TokenIds is None:
            return None
        t = self.__dict__.get("_native")
        if t is None:
            with _NATIVE_LOCK:
                t = self.__dict__.get("_native")
                if t is None:
                    t = self._native = _TokenIds(sorted(STOPWORDS_EN))
        if len(t) != len(self.tokens):
            t.sync(self.tokens)  # (one call holding the GIL: concurrent callers add each token once)
        return t

    def __getstate__(self) -> dict:
        """Pickled without the native mirror (rebuilt on first use)."""
        return {k: v for k, v in self.__dict__.items() if k != "_native"}

    def copy(self) -> "Vocabulary":
        """An independent copy (same ids)."""
        out = Vocabulary.__new__(Vocabulary)
        out.tokens, out.ids = list(self.tokens), dict(self.ids)
        return out

    def encode_doc(self, tokens: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(terms int32 [T] ascending distinct ids, tf int32 [T]) of a document's tokens, adding new tokens."""
        if not tokens:
            return _EMPTY_I32, _EMPTY_I32
        ids, toks = self.ids, self.tokens
        out = []
        for t in tokens:
            i = ids.get(t)
            if i is None:
                i = ids[t] = len(toks)
                toks.append(t)
            out.append(i)
        terms, tf = np.unique(np.asarray(out, dtype=np.int32), return_counts=True)
        return terms.astype(np.int32, copy=False), tf.astype(np.int32)

    def encode_query(self, tokens: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(term ids int32 [T], counts float64 [T]) of a query: its distinct KNOWN tokens in
        order of first occurrence and how often each occurs (unknown tokens dropped)."""
        ids = self.ids
        counts: dict[int, int] = {}
        for t in tokens:
            i = ids.get(t)
            if i is not None:
                counts[i] = counts.get(i, 0) + 1
        if not counts:
            return _EMPTY_I32, np.zeros(0, dtype=np.float64)
        return np.fromiter(counts.keys(), np.int32, len(counts)), np.fromiter(counts.values(), np.float64, len(counts))


def item_rows(ids: Sequence[Any], has_text: np.ndarray) -> np.ndarray | None:
    """The item of every row of one user's segment (module docstring, "Items stored as several rows").

    Args:
        ids: the segment's n row ids (str or int, distinct), in row order.
        has_text: bool [n], whether each row has a text.

    Returns:
        int32 [n]: the local row of each row's item (an item's own row maps to itself, an
        extra chunk row ``"<p>\x1f<j>"`` to the row of ``p``), or None when every row is an
        item of its own.
    """
    try:  # one C-speed scan for the common case (no chunk row)
        joined = "".join(ids)
    except TypeError:  # some int ids
        joined = "".join(i for i in ids if isinstance(i, str))
    if CHUNK_SEP not in joined:
        return None
    pos = {i: r for r, i in enumerate(ids)}
    out = np.arange(len(ids), dtype=np.int32)
    found = False
    for r, i in enumerate(ids):
        if not isinstance(i, str) or CHUNK_SEP not in i or has_text[r]:
            continue
        parent, _, j = i.rpartition(CHUNK_SEP)
        if CHUNK_SEP in parent or not (j.isascii() and j.isdigit()) or int(j) < 1:
            continue
        q = pos.get(parent)
        if q is not None:
            out[r] = q
            found = True
    return out if found else None


@dataclass(frozen=True)
class UserPostings:
    """One user's inverted index (rows local to its segment; built by :meth:`LexicalIndex.postings`).

    Attributes:
        n_rows: rows of the user's segment.
        n_docs: ``N``, rows with a text; avgdl: average token count of those (0 when N = 0).
        terms: int32 [T] distinct token ids of the user's documents, ascending.
        ptr: int64 [T + 1] CSR pointers into rows / weight.
        rows: int32 [P] local rows of each posting (ascending within a term); always an
            item's own row (the row holding its text).
        weight: float64 [P] ``w(t, d)`` of each posting (module docstring).
        item_row: int32 [n_rows] the local row of each row's item (:func:`item_rows`), or
            None when every row is an item of its own (no chunked item).
        is_item: bool [n_rows] the rows that are items' own rows, or None (all are).
        chunk_ptr: int64 [n_rows + 1] / chunk_rows: int32 [n_rows - n_items] CSR of each
            item's extra chunk rows (ascending), or None without chunked items.
    """

    n_rows: int
    n_docs: int
    avgdl: float
    terms: np.ndarray
    ptr: np.ndarray
    rows: np.ndarray
    weight: np.ndarray
    item_row: np.ndarray | None = None
    is_item: np.ndarray | None = None
    chunk_ptr: np.ndarray | None = None
    chunk_rows: np.ndarray | None = None

    @property
    def n_items(self) -> int:
        """Items of the segment: its rows less the extra chunk rows."""
        return self.n_rows if self.chunk_rows is None else self.n_rows - int(self.chunk_rows.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays."""
        opt = sum(a.nbytes for a in (self.item_row, self.is_item, self.chunk_ptr, self.chunk_rows) if a is not None)
        return int(self.terms.nbytes + self.ptr.nbytes + self.rows.nbytes + self.weight.nbytes + opt)

    def scatter(self, v: np.ndarray) -> np.ndarray:
        """Per-row values ``v`` [..., n_rows] given on items' own rows, as every row's: each
        row takes its item's value (``v`` itself when no item is chunked)."""
        return v if self.item_row is None else v[..., self.item_row]

    def scatter_hits(self, rows: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hits on items' own rows (ascending local rows int32 [h], values [h]) as the hits of
        every row of those items (ascending local rows int32 [h'], each row its item's value)."""
        if self.chunk_ptr is None or rows.shape[0] == 0:
            return rows, vals
        s = self.chunk_ptr[rows]
        lens = self.chunk_ptr[rows + 1] - s
        total = int(lens.sum())
        if total == 0:
            return rows, vals
        sel = np.arange(total, dtype=np.int64) + np.repeat(s - np.cumsum(lens) + lens, lens)
        r = np.concatenate([rows, self.chunk_rows[sel]])
        order = np.argsort(r, kind="stable")
        return r[order].astype(np.int32, copy=False), np.concatenate([vals, np.repeat(vals, lens)])[order]

    def scores(self, q_terms: np.ndarray, q_counts: np.ndarray) -> np.ndarray | None:
        """BM25 of every local row for a query (module docstring), or None when no row is a hit.

        Every row of a chunked item has the item's BM25 (its whole text's, :meth:`scatter`).

        Args:
            q_terms: int32 [T] the query's distinct known token ids (first-occurrence order).
            q_counts: float64 [T] their counts in the query.

        Returns:
            float64 [n_rows] (0 where no query token occurs), or None (no hit at all).
        """
        got = self.postings_for(q_terms, q_counts)
        if got is None:
            return None
        return self.scatter(np.bincount(got[0], weights=got[1], minlength=self.n_rows))

    def postings_for(self, q_terms: np.ndarray, q_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The postings of a query's terms, concatenated in query-term order: (local rows
        int32 [m], ``qtf * w(t, d)`` float64 [m]), or None when no query term occurs.
        Rows are items' own rows: summing the weights per row in this order
        (``np.bincount``) gives each item's BM25 (:meth:`scores` scatters it to every row)."""
        T = self.terms.shape[0]
        if T == 0 or q_terms.shape[0] == 0:
            return None
        idx = np.searchsorted(self.terms, q_terms)
        ok = idx < T
        ok[ok] = self.terms[idx[ok]] == q_terms[ok]
        if not ok.any():
            return None
        idx, cnt = idx[ok], q_counts[ok]
        starts, ends = self.ptr[idx], self.ptr[idx + 1]
        lens = ends - starts
        total = int(lens.sum())
        # the postings of the query's terms, concatenated in query-term order
        sel = np.arange(total, dtype=np.int64) + np.repeat(starts - np.cumsum(lens) + lens, lens)
        w = self.weight[sel]
        if (cnt != 1.0).any():
            w = w * np.repeat(cnt, lens)
        return self.rows[sel], w


def build_postings(terms: np.ndarray, tf: np.ndarray, ptr: np.ndarray, has_text: np.ndarray,
                   item_row: np.ndarray | None = None) -> UserPostings:  # fmt: skip
    """One user's :class:`UserPostings` from its slice of a forward index.

    Args:
        terms, tf: int32 [m] the user's forward entries (rows in order, terms ascending per row).
        ptr: int64 [n_u + 1] the user's forward pointers, starting at 0.
        has_text: bool [n_u].
        item_row: int32 [n_u] each row's item (:func:`item_rows`), or None (every row an
            item). Extra chunk rows have no text, so they hold no posting.

    Returns:
        UserPostings (weights by the module docstring's formulas, float64).
    """
    n_u = int(ptr.shape[0] - 1)
    chunks: dict[str, Any] = {}
    if item_row is not None:
        local_rows = np.arange(n_u, dtype=np.int32)
        is_item = item_row == local_rows
        extra = np.flatnonzero(~is_item)
        parents = item_row[extra]
        order = np.argsort(parents, kind="stable")  # grouped by item, ascending within one
        cptr = np.zeros(n_u + 1, dtype=np.int64)
        np.cumsum(np.bincount(parents, minlength=n_u), out=cptr[1:])
        chunks = dict(item_row=item_row.astype(np.int32, copy=False), is_item=is_item, chunk_ptr=cptr,
                      chunk_rows=extra[order].astype(np.int32))  # fmt: skip
    lens = np.diff(ptr)
    local = np.repeat(np.arange(n_u, dtype=np.int32), lens)
    dl = np.bincount(local, weights=tf, minlength=n_u) if n_u else np.zeros(0)
    n_docs = int(np.count_nonzero(has_text))
    avgdl = float(dl[has_text].sum() / n_docs) if n_docs else 0.0
    if terms.shape[0] == 0:
        z = np.zeros(0, dtype=np.int32)
        return UserPostings(n_u, n_docs, avgdl, z, np.zeros(1, dtype=np.int64), z, np.zeros(0), **chunks)
    order = np.argsort(terms, kind="stable")  # rows stay ascending within a term
    ts = terms[order]
    uniq, start, df = np.unique(ts, return_index=True, return_counts=True)
    N = float(n_docs)
    dff = df.astype(np.float64)
    idf = np.log(1.0 + (N - dff + 0.5) / (dff + 0.5))
    rows = local[order]
    f = tf[order].astype(np.float64)
    d = dl[rows]
    w = np.repeat(idf, df) * (f / (K1 * ((1.0 - B) + B * d / avgdl) + f))
    p = np.zeros(uniq.shape[0] + 1, dtype=np.int64)
    np.cumsum(df, out=p[1:])
    return UserPostings(n_u, n_docs, avgdl, uniq.astype(np.int32), p, rows.astype(np.int32), w, **chunks)


class LexicalIndex:
    """The lexical index of one bank snapshot (module docstring): forward CSR + lazy per-user postings.

    Args:
        offsets: int64 [U + 1] the snapshot's CSR offsets.
        ptr: int64 [n + 1]; terms: int32 [nnz]; tf: int32 [nnz]; has_text: bool [n]
            (module docstring; may be memory-mapped).
        vocab: the bank's :class:`Vocabulary`; analyzer: its :class:`Analyzer`.
        carried: optional {user index: UserPostings} reused from an older snapshot (users
            whose rows did not change).
        item_ids: object [n] the snapshot's row ids, which tell the extra chunk rows of
            chunked items (:func:`item_rows`); None: every row is an item of its own.

    Thread safety: postings are built on first use without a lock (the build is
    idempotent: a race builds the same value twice).
    """

    def __init__(self, offsets: np.ndarray, ptr: np.ndarray, terms: np.ndarray, tf: np.ndarray,
                 has_text: np.ndarray, vocab: Vocabulary, analyzer: Analyzer,
                 carried: dict[int, UserPostings] | None = None,
                 item_ids: np.ndarray | None = None) -> None:  # fmt: skip
        self.offsets = offsets
        self.ptr, self.terms, self.tf, self.has_text = ptr, terms, tf, has_text
        self.vocab, self.analyzer = vocab, analyzer
        self.item_ids = item_ids
        self._postings: dict[int, UserPostings] = dict(carried or {})

    @classmethod
    def from_docs(cls, offsets: np.ndarray, docs: Sequence[tuple[np.ndarray, np.ndarray] | None], vocab: Vocabulary,
                  analyzer: Analyzer, item_ids: np.ndarray | None = None) -> "LexicalIndex":  # fmt: skip
        """An index from per-row encoded documents ((terms, tf) or None for a row without text)."""
        ptr, terms, tf, has = _concat_docs(docs)
        return cls(offsets, ptr, terms, tf, has, vocab, analyzer, item_ids=item_ids)

    @classmethod
    def from_texts(cls, offsets: np.ndarray, texts: Iterable[str | None], vocab: Vocabulary,
                   analyzer: Analyzer, item_ids: np.ndarray | None = None) -> "LexicalIndex":  # fmt: skip
        """An index tokenising ``texts`` (object [n], str or None) into ``vocab``."""
        docs = [None if t is None else vocab.encode_doc(analyzer.tokens(t)) for t in texts]
        return cls.from_docs(offsets, docs, vocab, analyzer, item_ids)

    @property
    def num_rows(self) -> int:
        """Rows n."""
        return int(self.has_text.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the forward index plus the postings built so far."""
        fwd = self.ptr.nbytes + self.terms.nbytes + self.tf.nbytes + self.has_text.nbytes
        return int(fwd + sum(p.nbytes for p in list(self._postings.values())))

    def docs(self, a: int, b: int) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Per-row (terms, tf) views (None without text) of rows ``a:b``."""
        p, t, f, h = self.ptr, self.terms, self.tf, self.has_text
        return [(t[p[r] : p[r + 1]], f[p[r] : p[r + 1]]) if h[r] else None for r in range(a, b)]

    def segment(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ptr rebased to 0 [b - a + 1], terms, tf, has_text) of rows ``a:b``."""
        p0, p1 = int(self.ptr[a]), int(self.ptr[b])
        return self.ptr[a : b + 1] - p0, self.terms[p0:p1], self.tf[p0:p1], self.has_text[a:b]

    def postings(self, u: int) -> UserPostings:
        """User ``u``'s inverted index (built on first use, then cached for this and later snapshots)."""
        got = self._postings.get(u)
        if got is None:
            a, b = int(self.offsets[u]), int(self.offsets[u + 1])
            ptr, terms, tf, has = self.segment(a, b)
            has = np.asarray(has)
            items = None if self.item_ids is None else item_rows(self.item_ids[a:b], has)
            got = self._postings[u] = build_postings(np.asarray(terms), np.asarray(tf), np.asarray(ptr), has, items)
        return got

    def built_postings(self) -> dict[int, UserPostings]:
        """The postings built so far ({user index: UserPostings}; a copy of the dict)."""
        return dict(self._postings)

    def encode_query(self, text: str | None) -> tuple[np.ndarray, np.ndarray]:
        """A query text as (distinct known token ids int32, counts float64) (empty for None)."""
        if text is None:
            return _EMPTY_I32, np.zeros(0, dtype=np.float64)
        return self.vocab.encode_query(self.analyzer.tokens(text))

    def encode_queries(self, texts: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """b query texts encoded at once, each exactly as :meth:`encode_query` (its distinct
        known token ids in order of first occurrence, and how often each occurs), in CSR form.

        Without a stemmer, ASCII texts go through the native tokenizer (``_native.TokenIds``,
        :meth:`Vocabulary.native_ids`: the same tokens, one C++ pass; 0.7 against 3.0 ms for
        1,024 texts inside a batch search, whose scan leaves the vocabulary cold). Otherwise
        the tokens of the whole batch come from one pass (:meth:`Analyzer.batch_ids`); the
        distinct ids per text, their first-occurrence order and counts from one
        ``np.unique`` over (text, id) keys. One text, or a batch holding a ``"\\x00"``,
        goes through :meth:`encode_query`.

        Args:
            texts: b str or None (None: no token).

        Returns:
            (qterms int32 [T], qcnt float64 [T], qptr int64 [b + 1]): text i's ids
            ``qterms[qptr[i]:qptr[i + 1]]`` and their counts.

        Raises:
            TypeError: ``texts[i]`` is neither a str nor None.
        """
        b = len(texts)
        if USE_NATIVE_TOKENIZER and self.analyzer.stemmer is None and (ids := self.vocab.native_ids()) is not None:
            out = ids.encode(texts)  # (None: a text is not ASCII)
            if out is not None:
                return out
        if b == 1:
            t = texts[0]
            if t is not None and not isinstance(t, str):
                raise TypeError(f"texts[0] must be a str or None, got {type(t).__name__}")
            qt, qc = self.encode_query(t)
            return qt, qc, np.array([0, qt.shape[0]], dtype=np.int64)
        flat = self.analyzer.batch_ids(texts, self.vocab.ids)
        if flat is None:  # a text holds the mark: one by one
            parts = [self.encode_queries(texts[i : i + 1]) for i in range(b)]
            qptr = np.zeros(b + 1, dtype=np.int64)
            np.cumsum([p[0].shape[0] for p in parts], out=qptr[1:])
            if not qptr[-1]:
                return _EMPTY_I32, np.zeros(0), qptr
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), qptr
        text = np.cumsum(flat == _SEP)  # each token's text
        known = flat >= 0
        tid, text = flat[known], text[known]
        qptr = np.zeros(b + 1, dtype=np.int64)
        if tid.shape[0] == 0:
            return _EMPTY_I32, np.zeros(0), qptr
        V = int(tid.max()) + 1
        keys, first, cnt = np.unique(text * V + tid, return_index=True, return_counts=True)
        order = np.argsort(first)  # by text, then first occurrence in it
        keys = keys[order]
        np.cumsum(np.bincount(keys // V, minlength=b), out=qptr[1:])
        return (keys % V).astype(np.int32), cnt[order].astype(np.float64), qptr

    def scores(self, u: int, text: str | None) -> np.ndarray | None:
        """float64 [n_u] BM25 of user ``u``'s rows for a query text (a chunked item's rows: the
        item's), or None when no row is a hit."""
        t, c = self.encode_query(text)
        if t.shape[0] == 0:
            return None
        return self.postings(u).scores(t, c)


def _concat_docs(docs: Sequence[tuple[np.ndarray, np.ndarray] | None]) -> tuple[np.ndarray, ...]:
    """Forward CSR arrays (ptr int64 [n + 1], terms int32, tf int32, has_text bool [n]) of per-row docs."""
    n = len(docs)
    lens = np.fromiter((0 if d is None else d[0].shape[0] for d in docs), np.int64, n)
    has = np.fromiter((d is not None for d in docs), np.bool_, n)
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=ptr[1:])
    present = [d for d in docs if d is not None and d[0].shape[0]]
    if present:
        terms = np.concatenate([d[0] for d in present]).astype(np.int32, copy=False)
        tf = np.concatenate([d[1] for d in present]).astype(np.int32, copy=False)
    else:
        terms, tf = _EMPTY_I32, _EMPTY_I32
    return ptr, terms, tf, has


def concat_segments(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """Forward CSR arrays of consecutive segments, each (ptr from 0, terms, tf, has_text)."""
    n = sum(int(p[3].shape[0]) for p in parts)
    ptr = np.zeros(n + 1, dtype=np.int64)
    pos, base = 0, 0
    for p, t, _, h in parts:
        m = int(h.shape[0])
        ptr[pos + 1 : pos + m + 1] = p[1:] + base
        pos += m
        base += int(t.shape[0])
    terms = np.concatenate([np.asarray(p[1]) for p in parts]).astype(np.int32, copy=False) if parts else _EMPTY_I32
    tf = np.concatenate([np.asarray(p[2]) for p in parts]).astype(np.int32, copy=False) if parts else _EMPTY_I32
    has = np.concatenate([np.asarray(p[3]) for p in parts]).astype(np.bool_, copy=False) if parts else np.zeros(0, np.bool_)
    return ptr, terms, tf, has


def docs_segment(docs: Sequence[tuple[np.ndarray, np.ndarray] | None]) -> tuple[np.ndarray, ...]:
    """(ptr from 0, terms, tf, has_text) of per-row docs (a segment for :func:`concat_segments`)."""
    return _concat_docs(docs)
