"""Queries of a :class:`~rfmem_fast.serving.memory.Memory`, from a checked argument to a
cached answer: ``_Query`` (a checked query and its cache key), the two stages of a
micro-batch (``_encode_batch``: one encode of the texts not in the embedding cache;
``_search_encoded``: one :func:`~rfmem_fast.search` per (mode, k) on ONE bank snapshot),
the collapse of a long text's chunk rows to its item, and :class:`BatchEvent`, what one
batched run cost. ``_Queries`` is a mixin of Memory, whose ``search`` / ``asearch`` /
``search_batch`` call it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from ..config import RFMemConfig
from ..filters import Filter, parse_filter
from ..lexical import CHUNK_SEP
from ..search import MODES, SearchResult, search
from .cache import QueryCache, vector_key
from .hits import Hit, Hits, _Answer, _utc
from ..bank import NO_POSITION
from .validate import _check_k, _check_text, _user_key

__all__ = ["BatchEvent"]

log = logging.getLogger("rfmem_fast.serving")


def _finite_or_none(v: Any) -> float | None:
    """``v`` as a float, None for None / NaN (an unknown channel score)."""
    return None if v is None or v != v else float(v)



@dataclass(frozen=True)
class BatchEvent:
    """What one batched run cost (passed to listeners, e.g. the HTTP metrics).

    Attributes:
        size: queries in the run (cache hits answered before it are not included).
        encoded: texts sent to the encoder (after the embedding cache).
        encode_seconds / search_seconds: wall time of the encoder call / of the
            :func:`rfmem_fast.search` calls.
        searches: :func:`rfmem_fast.search` calls made (one per (mode, k) group).
    """

    size: int
    encoded: int
    encode_seconds: float
    search_seconds: float
    searches: int


@dataclass
class _Encoded:
    """A batch after its encode stage: the queries, their vectors (None where the
    encoder failed), ``out`` (the failures' exceptions, else None), texts encoded and
    the encoder's wall time (s)."""

    queries: list
    vectors: list
    out: list
    encoded: int
    encode_seconds: float


@dataclass(frozen=True)
class _Query:
    user: Hashable
    text: str | None
    vector: np.ndarray | None  # float32 [d] as given (the search normalises it)
    k: int
    mode: str
    qkey: tuple = field(compare=False)
    filters: Filter | None = field(default=None, compare=False)


class _Queries:
    """Checking, caching, encoding and searching queries in batches (a mixin of
    :class:`~rfmem_fast.serving.memory.Memory`)."""


    def _config_for(self, k: int) -> RFMemConfig:
        cfg = self._configs.get(k)
        if cfg is None:
            if len(self._configs) > 1024:  # k + a user's chunk rows: many values over time
                self._configs = {self._config.out_k: self._config}
            cfg = self._configs[k] = self._config.replace(out_k=int(k))
        return cfg

    def _prepare(self, query: Any, user_id: Any, k: Any, mode: Any, name: str = "query", filters: Any = None,
                 fname: str = "filters") -> _Query:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        _check_k(k)
        k = self._config.out_k if k is None else int(k)
        user = _user_key(user_id)
        flt = None if filters is None else parse_filter(filters, fname)
        fk = () if flt is None else (("filters", flt.key),)  # a filtered answer is cached apart
        if isinstance(query, str):
            if not self._has_encoder:
                raise ValueError(f"{name}: this Memory has no text encoder (encoder=False); pass a vector")
            query = _check_text(query, name, what="query")
            return _Query(user, query, None, k, mode, ("text", query) + fk, flt)
        if isinstance(query, (bytes, bool, int, float, complex, np.number, np.bool_)) or query is None \
                or getattr(query, "ndim", None) == 0:
            raise TypeError(f"{name} must be a str or a 1-D vector of floats: a text (str) or a vector "
                            f"({self.dim} floats) was expected, got {type(query).__name__}")
        if name == "query" and isinstance(query, (list, tuple)) and query and isinstance(query[0], str):
            raise TypeError("query must be one str or one 1-D vector; for several queries use "
                            "Memory.search_batch(queries, user_ids)")
        arr = query if (hasattr(query, "detach") or isinstance(query, np.ndarray)) else np.asarray(query)
        if getattr(arr, "ndim", None) != 1:
            raise ValueError(f"{name} must be a str or a 1-D vector of {self.dim} floats, got shape {tuple(getattr(arr, 'shape', ()))}")
        vec = self._vectors(arr, name)[0]
        return _Query(user, None, vec, k, mode, vector_key(vec) + fk, flt)

    def _start(self, query: Any, user_id: Any, k: Any, mode: Any, filters: Any = None) -> tuple[_Query, Hits | None]:
        """A checked query and its cached answer (None on a miss)."""
        q, hit = self._start_answer(query, user_id, k, mode, filters)
        return q, (hit.materialise(cached=True) if hit is not None else None)

    def _start_answer(self, query: Any, user_id: Any, k: Any, mode: Any,
                      filters: Any = None) -> tuple[_Query, _Answer | None]:
        """A checked query and its cached (shared, immutable) answer (None on a miss)."""
        self._check_open()
        q = self._prepare(query, user_id, k, mode, filters=filters)
        return q, self._cached(q)

    def _cached(self, q: _Query) -> _Answer | None:
        key = QueryCache.result_key(q.user, self._uver.get(q.user, 0), q.qkey, q.mode, q.k)
        return self._cache.get_result(key)

    def _run_one(self, q: _Query) -> _Answer:
        out = self._run_batch([q])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def _run_batch(self, queries: list[_Query]) -> list[_Answer | BaseException]:
        """Answer a batch: one encode of the uncached texts, one search per (mode, k)."""
        return self._search_encoded(self._encode_batch(queries))

    def _encode_batch(self, queries: list[_Query]) -> _Encoded:
        """Stage 1 of a batch (an encoder worker): the query vectors, one encode of the
        texts not in the embedding cache; a text the encoder fails on fails its own
        callers only. Touches no bank state (the search stage takes the snapshot)."""
        n = len(queries)
        out: list[Any] = [None] * n
        vecs: list[np.ndarray | None] = [q.vector for q in queries]
        need: dict[str, list[int]] = {}
        for i, q in enumerate(queries):
            if q.vector is None:
                v = self._cache.embeddings.get(q.text)
                if v is not None:
                    vecs[i] = v
                else:
                    need.setdefault(q.text, []).append(i)
        encode_s = 0.0
        if need:
            t0 = time.perf_counter()
            texts = list(need)
            try:  # a bad row (zero / non-finite) fails its own callers only
                rows: list[Any] = self._encode_rows(texts, "query")
            except Exception as exc:
                if len(texts) == 1:
                    rows = [exc]
                else:  # find the culprit: encode one by one, so only its callers fail
                    rows = []
                    for text in texts:
                        try:
                            rows.append(self._encode_rows([text], "query")[0])
                        except Exception as exc1:
                            rows.append(exc1)
            for text, row in zip(texts, rows):
                if not isinstance(row, BaseException):
                    row = row.copy()
                    self._cache.embeddings.put(text, row)
                for i in need[text]:
                    if isinstance(row, BaseException):
                        out[i] = row
                    else:
                        vecs[i] = row
            encode_s = time.perf_counter() - t0
        return _Encoded(queries, vecs, out, sum(len(v) for v in need.values()), encode_s)

    def _search_encoded(self, enc: _Encoded) -> list[_Answer | BaseException]:
        """Stage 2 of a batch (the search thread): one :func:`~rfmem_fast.search` per
        (mode, k) on ONE bank snapshot taken now, answers cached, listeners told."""
        queries, vecs, out = enc.queries, enc.vectors, enc.out
        n = len(queries)
        search_s, searches = 0.0, 0
        with self._rw.read():
            snap = self.bank.snapshot()  # the one the searches below run on (writes wait for the lock)
            fields = _RowFields(snap.created_at_or_nan, snap.threads, snap.positions)
            known = {u: i for i, u in enumerate(snap.users)}
            groups: dict[tuple[str, int], list[int]] = {}
            for i, q in enumerate(queries):
                if out[i] is not None:
                    continue
                if q.user not in known or snap.num_items == 0:
                    rule = "unknown_user" if q.user not in known else "no_hits"
                    out[i] = _Answer(q.user, (), None, rule, 0.0, 0.0, 0)
                else:
                    # a user holding long texts: fetch enough rows to collapse to k items
                    k_rows = min(q.k + self._extra_rows(q.user), 1 << 20)
                    groups.setdefault((q.mode, k_rows), []).append(i)
            todo = list(groups.items())
            while todo:
                (mode, k), idx = todo.pop(0)
                t0 = time.perf_counter()
                try:
                    cfg = self._config_for(k)
                    res = self._engine(cfg, mode, [queries[i] for i in idx], [vecs[i] for i in idx])
                except Exception as exc:
                    if len(idx) > 1:  # find the culprit: search one by one, so only it fails
                        todo[:0] = [((mode, k), [i]) for i in idx]
                    else:
                        out[idx[0]] = exc
                    continue
                finally:
                    search_s += time.perf_counter() - t0
                    searches += 1
                texts = res.texts  # taken from the snapshot this search ran on
                routes, rules = res.route_names, res.rule_names
                rows = [self._collapse(res, j, texts[j], queries[i].k, fields) for j, i in enumerate(idx)]
                t0 = time.perf_counter()
                try:
                    searches += self._give_back_chunk_slots(cfg, res, rows, [queries[i] for i in idx],
                                                            [vecs[i] for i in idx], fields)
                except Exception as exc:  # pragma: no cover - defensive: fails these callers only
                    for i in idx:
                        out[i] = exc
                    continue
                finally:
                    search_s += time.perf_counter() - t0
                metas = self._metadata_of([queries[i].user for i in idx], [r[0] for r in rows])
                parent_texts: dict[Hashable, dict] = {}
                for j, i in enumerate(idx):
                    q = queries[i]
                    try:
                        ids, scores, txt, from_chunk, chan, times, conv = rows[j]
                        if q.text is None:  # a vector query: the lexical channel did not score it
                            chan = [(c[0], None, c[2]) for c in chan]
                        if any(from_chunk):  # a chunk's hit shows its item's whole text
                            pt = parent_texts.get(q.user)
                            if pt is None:
                                pt = parent_texts[q.user] = dict(zip(self.bank.item_ids_of(q.user),
                                                                     self.bank.texts_of(q.user)))
                            txt = [pt[x] if f else t for x, t, f in zip(ids, txt, from_chunk)]
                        out[i] = ans = self._answer(res, j, q.user, routes[j], rules[j], ids, scores, txt,
                                                    metas[q.user], chan, times, conv)
                    except Exception as exc:  # pragma: no cover - defensive: fails this caller only
                        out[i] = exc
                        continue
                    key = QueryCache.result_key(q.user, self._uver.get(q.user, 0), q.qkey, mode, q.k)
                    self._cache.put_result(key, ans)
        with self._stats_lock:
            c = self._counters
            c["runs"] += 1
            c["queries"] += n
            c["searches"] += searches
            c["search_seconds"] += search_s
        if self._listeners:
            ev = BatchEvent(n, enc.encoded, enc.encode_seconds, search_s, searches)
            for fn in list(self._listeners):
                try:
                    fn(ev)
                except Exception:  # a listener never breaks a search
                    log.exception("batch listener failed")
        return out

    def _engine(self, cfg: RFMemConfig, mode: str, qs: list[_Query], vecs: list[np.ndarray]) -> SearchResult:
        """One :func:`~rfmem_fast.search` of the queries ``qs`` (their vectors ``vecs``) with
        ``cfg`` in ``mode``: their texts for the lexical channel and the second stage, their filters."""
        texts = cfg.lexical_weight > 0 or cfg.second_stage is not None  # (the lexical channel, the second stage)
        lex: dict[str, Any] = {"query_texts": [q.text for q in qs]} if texts else {}
        flt = [q.filters for q in qs]
        if any(f is not None for f in flt):
            lex["filters"] = flt
        return search(self.bank, np.stack(vecs), [q.user for q in qs], config=cfg, mode=mode,
                      backend=self._backend, device=self._device, **lex)

    def _give_back_chunk_slots(self, cfg: RFMemConfig, res: SearchResult, rows: list[tuple], qs: list[_Query],
                               vecs: list[np.ndarray], fields: "_RowFields") -> int:
        """Recollection counts items, not chunk rows: the result slots that extra chunks of
        an item already returned took are given to other items (``rows`` changed in place;
        returns the number of extra engine searches made, 0 or 1).

        The engine's Recollection path fills its result list with bank rows, and a long
        text is several rows (its chunks, near one another), so sibling chunks take slots
        and recollection rounds that distinct items would have taken: collapsed to items,
        a query would get fewer items than rows (as few as 2 of 10 with 6-word chunks). For each
        query of a user holding chunked items whose route was recollection and whose
        collapsed list holds fewer than ``min(k, rows returned)`` items, the list is
        completed, after its recollected items (their order and scores kept), with the
        next items of the query's Familiarity ranking (one ``mode="dense"`` search of those
        queries: the same configuration, texts and filters) that are not in it yet and
        whose cosine (``dense_score``) is at least ``score_floor``, as the recollection
        drops lower candidates; they carry their Familiarity-path scores. Users without
        chunked items, and the engine itself, are untouched.
        """
        need = []
        for j, (q, r) in enumerate(zip(qs, rows)):
            if res.route_names[j] != "recollection" or not self._chunks.get(q.user):
                continue
            want = min(q.k, int((res.rows[j] >= 0).sum()))
            if len(r[0]) < want:
                need.append((j, want))
        if not need:
            return 0
        fam = self._engine(cfg, "dense", [qs[j] for j, _ in need], [vecs[j] for j, _ in need])
        floor = cfg.score_floor
        for jj, (j, want) in enumerate(need):
            ids, scores, txt, from_chunk, chan, times, conv = rows[j]
            have = set(ids)
            more = self._collapse(fam, jj, fam.texts[jj], max(qs[j].k, 1) + len(ids), fields)
            for extra in zip(*more):
                if len(ids) == want:
                    break
                i, score, _, _, c, _, _ = extra
                if i in have or (c[0] if c[0] is not None else score) < floor:
                    continue
                have.add(i)
                for col, v in zip((ids, scores, txt, from_chunk, chan, times, conv), extra):
                    col.append(v)
        return 1

    def _metadata_of(self, users: list[Hashable], hit_ids: list[list]) -> dict[Hashable, dict]:
        """{user: {item id: metadata or None}} for the hits of a batch: ONE bank lookup
        per user rather than one per query (the bank checks the ids and deep-copies)."""
        wanted: dict[Hashable, dict] = {}
        for user, ids in zip(users, hit_ids):
            wanted.setdefault(user, {}).update(dict.fromkeys(ids))
        return {u: dict(zip(ids, self.bank.get_metadata(u, list(ids)))) if ids else {} for u, ids in wanted.items()}

    @staticmethod
    def _collapse(res: SearchResult, j: int, texts: np.ndarray, k: int,
                  fields: "_RowFields") -> tuple[list, list, list, list, list, list, list]:
        """Query ``j``'s hit rows collapsed to items: a long text's chunk rows count as
        their item (its best-ranked row; the first k items). Returns (ids, scores,
        texts, from_chunk, channels, times, conversations): from_chunk[r] when item r's
        best row was an extra chunk (its text is then looked up); channels[r] its
        (dense, lexical, context) scores (None where unknown or off); times[r] its
        creation time (UTC datetime or None) and conversations[r] its (thread,
        position) (None where none), read from ``fields`` (the per-row columns of the
        snapshot the search ran on: one gather each, a chunk row holding its item's
        values)."""
        ok = res.rows[j] >= 0
        n = int(ok.sum())
        ids, scores, txt = res.ids[j][ok].tolist(), res.scores[j][ok].tolist(), texts[ok].tolist()

        def col(a: np.ndarray | None) -> list:
            return a[j][ok].tolist() if a is not None else [None] * n

        chan = [tuple(_finite_or_none(v) for v in trio)
                for trio in zip(col(res.dense_scores), col(res.lexical_scores), col(res.context_scores))]
        hit_rows = res.rows[j][ok]
        times = fields.created[hit_rows].tolist()
        conv = fields.conversations(hit_rows)
        if not any(isinstance(i, str) and CHUNK_SEP in i for i in ids):
            return (ids[:k], scores[:k], txt[:k], [False] * min(k, len(ids)), chan[:k],
                    [_utc(t) for t in times[:k]], conv[:k])  # fmt: skip
        out_ids, out_s, out_t, out_f, out_c, out_w, out_v, seen = [], [], [], [], [], [], [], set()
        for i, sc, t, c, w, v in zip(ids, scores, txt, chan, times, conv):
            chunk = isinstance(i, str) and CHUNK_SEP in i
            parent = i.rpartition(CHUNK_SEP)[0] if chunk else i
            if parent in seen:
                continue
            seen.add(parent)
            out_ids.append(parent)
            out_s.append(sc)
            out_t.append(None if chunk else t)
            out_f.append(chunk)
            out_c.append(c)
            out_w.append(_utc(w))
            out_v.append(v)
            if len(out_ids) == k:
                break
        return out_ids, out_s, out_t, out_f, out_c, out_w, out_v

    def _answer(self, res: SearchResult, j: int, user: Hashable, route: str, rule: str, ids: list,
                scores: list, txt: list, metas: dict, chan: list, times: list, conv: list) -> _Answer:
        """Query ``j`` of ``res`` as an immutable answer (hits with texts, metadata,
        creation times and conversations): ``ids`` / ``scores`` / ``txt`` / ``chan`` /
        ``times`` / ``conv`` its hits (:meth:`_collapse`), ``metas`` {id: metadata} of its
        user (:meth:`_metadata_of`)."""
        mean, ent, rounds = float(res.mean[j]), float(res.entropy[j]), int(res.rounds[j])
        hits = tuple(
            Hit(i, t, s, metas[i] or {}, r, user, route, rule, mean, ent, rounds, c[0], c[1], w,
                thread=v[0], position=v[1], context_score=c[2])
            for r, (i, t, s, c, w, v) in enumerate(zip(ids, txt, scores, chan, times, conv))
        )
        return _Answer(user, hits, route, rule, mean, ent, rounds)


@dataclass(frozen=True)
class _RowFields:
    """The per-row columns of one bank snapshot that a hit shows: ``created`` (float64 [n]
    creation times, NaN unknown), ``threads`` (object [n] or None: no row has one) and
    ``positions`` (int64 [n], :data:`~rfmem_fast.bank.NO_POSITION` where none, or None)."""

    created: np.ndarray
    threads: np.ndarray | None
    positions: np.ndarray | None

    def conversations(self, rows: np.ndarray) -> list[tuple[Any, int | None]]:
        """[(thread, position)] of ``rows`` (None where a row has none)."""
        n = int(rows.shape[0])
        thr = self.threads[rows].tolist() if self.threads is not None else [None] * n
        pos = ([None if p == NO_POSITION else p for p in self.positions[rows].tolist()]
               if self.positions is not None else [None] * n)
        return list(zip(thr, pos))
