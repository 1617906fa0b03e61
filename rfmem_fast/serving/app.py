"""HTTP service over a :class:`rfmem_fast.Memory` (FastAPI + uvicorn; ``rfmem serve``).

Routes (JSON bodies validated by pydantic)::

    GET    /health                                   liveness, counts, encoder, retrieval config (no auth)
    GET    /metrics                                  Prometheus text format (no auth)
    POST   /v1/users/{user_id}/memories              {"texts": [...]} or {"vectors": [[...]]},
                                                     optional "ids", "metadata", "created_at" -> 201 {"ids"}
    GET    /v1/users/{user_id}/memories              ?offset=0&limit=100 -> {"items", "total",
                                                     "offset", "limit", "next_offset"}
    GET    /v1/users/{user_id}/memories/{item_id}    one item
    PATCH  /v1/users/{user_id}/memories/{item_id}    {"texts"?: str, "vectors"?: [...], "metadata"?}
    DELETE /v1/users/{user_id}/memories/{item_id}    delete one item
    POST   /v1/users/{user_id}/memories/delete       {"ids": [...]}
    DELETE /v1/users/{user_id}                       delete ALL of the user's memories ("forget me")
    POST   /v1/users/{user_id}/search                {"query": str | "vector": [...], "k"?, "mode"?, "filters"?}
    POST   /v1/users/{user_id}/search/batch          {"queries": [...] | "vectors": [[...]], "k"?, "mode"?, "filters"?}
    POST   /v1/memories:batch                        {"items": [{"user_id", "text"?, "vector"?, "id"?,
                                                     "metadata"?, "created_at"?}, ...]} -> 201 {"ids"}
    POST   /v1/memories:batchUpdate                  {"items": [{"user_id", "id", "text"?, "vector"?,
                                                     "metadata"?}, ...]} -> {"updated": n}
    POST   /v1/memories:batchDelete                  {"items": [{"user_id", "id"}, ...]} -> {"deleted": n}
    POST   /v1/checkpoint                            fold the write-ahead log into the store (admin)
    POST   /v1/admin/tokens                          {"user_id", "label"?} -> 201 {"token", "token_id", ...}
    GET    /v1/admin/tokens                          ?user_id= -> the tokens (never their secrets)
    DELETE /v1/admin/tokens/{token_id}               revoke one token

Ids: user ids and item ids are str on the wire (1-256 characters; a Python int id is
its decimal str, :mod:`rfmem_fast.serving.memory`), each ONE path segment, percent-
encoded (``urllib.parse.quote(id, safe="")``; send ``.`` / ``..`` as ``%2E`` /
``%2E%2E``, which clients would otherwise remove as dot segments). Each segment is
decoded on its own from the raw request path, so an id may hold ``/`` (``%2F``),
``%``, ``..`` or the word ``memories`` and still names exactly one user / item: no
route can reach another user than the one its path names.

Authentication: ``Authorization: Bearer <token>`` on every ``/v1`` route. The admin
token (``api_key``) reaches every route; a user token (minted by the admin,
:mod:`rfmem_fast.serving.tokens`, stored hashed) reaches the routes of its own user
only (any other user: 403; admin routes: 403). Running without authentication needs
``no_auth=True`` (``rfmem serve --no-auth``, which warns).

User scope: every request names ONE user in its path and reads or writes only that
user's memories (the engine searches within the user's own segment). The bulk routes
(``/v1/memories:batch*``: many users' items in one all-or-nothing write,
:meth:`Memory.add_many`) name a user per item instead: the admin token may write any
user, a user token only its own (an item of another user: 403, nothing written). Reads of a user
never written answer empty (search: no hits, list: no items); writes that name items
of an unknown user answer 404 (those items do not exist); ``DELETE /v1/users/{u}`` is
idempotent (200, ``{"deleted": 0}`` for an unknown user).

Limits: a request body of at most ``max_body_bytes`` (default 4 MiB; 413 before the
body is buffered, with a Content-Length or chunked), 1024 items per add / delete, 4096
items per bulk request, 1024 queries per batch search, k in [1, 1000], 100,000 characters per text (texts over the
encoder's window, 256 tokens for all-MiniLM-L6-v2, are chunked by the Memory), ids of
1-256 characters.

Errors: a malformed body gets 422 with pydantic's list of errors (each naming the
field by its ``loc``; numbers are strict: ``"k": "2"`` is refused as in Python, and so
are ``true`` / ``false`` or a numeric string in a vector or a ``created_at``; a bad
search ``filters``, :mod:`rfmem_fast.filters`, names the part of the filter in its
``msg``: ``filters['score']['$gte']: expected a number, a string or a datetime, got
list``, and a range the user's values never match in type is 422 too); a
value the memory refuses (wrong dimension, duplicate id, empty text, ...) 400 with a
message naming the argument (on the bulk routes 422, in pydantic's form, with the
item's ``loc`` ``["body", "items", i, field]``); an unknown user / item 404; a missing or wrong bearer
token 401; a token of another user 403; a body over the limit 413; a full search
queue 503 (with ``Retry-After``); a search that waited past its timeout 504. A write is
acknowledged (2xx) only after it is in the fsynced write-ahead log.

Metrics (``/metrics``): ``rfmem_http_requests_total{method,route,status}``,
``rfmem_http_request_duration_seconds{method,route}`` (histogram),
``rfmem_search_queries_total{mode,route,rule,cached}`` (route distribution per rule),
``rfmem_batch_size`` / ``rfmem_encode_seconds`` / ``rfmem_search_seconds`` (histograms
per batched run), ``rfmem_cache_hit_ratio{cache}`` with hit / miss counters,
``rfmem_queue_depth``, ``rfmem_items``, ``rfmem_users``, ``rfmem_writes_total``,
``rfmem_wal_bytes``, ``rfmem_encoder_seconds_total`` / ``rfmem_encoded_texts_total`` (the
encoder's time and texts, writes included), ``rfmem_encoder_info{model,backend,dtype,device}`` (the encoder's
runtime and precision; also in ``/health``, with its dimension).

Health (``/health``): ``{"status": "ok", "users", "items", "batching", "encoder": {"model",
"backend", "dtype", "device", "dim", "loaded"} (null: vectors only), "config"}``, ``config``
the retrieval configuration by name and its main fields
(:meth:`rfmem_fast.RFMemConfig.summary`: ``{"preset": "recommended" | "paper" |
"paper_text" | "custom", "out_k", "lexical_weight", "fusion", ...}``).
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import os
import sys
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Iterator, Literal, Union
from urllib.parse import unquote, unquote_to_bytes

try:
    import orjson
    from fastapi import Depends, FastAPI, HTTPException, Path, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from fastapi import Query
    from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the HTTP service needs the 'serve' extra: pip install 'rfmem_fast[serve]' "
        f"(fastapi, uvicorn, pydantic, prometheus-client, orjson); missing: {exc.name}"
    ) from exc

from ..filters import FilterTypeError, check_filters, parse_filter
from .batcher import BatcherClosedError, QueueFullError, RequestTimeoutError
from .memory import MAX_ID_LENGTH, MAX_K, MAX_TEXT_CHARS, BatchEvent, Hits, Memory
from .validate import _canon_id, _count_error, _created_list
from .tokens import TOKENS_FILE, TokenStore

__all__ = ["create_app", "serve", "uvicorn_speedups", "API_KEY_ENV", "DEFAULT_MAX_BODY_BYTES"]

#: environment variable read for the admin bearer token when no api_key is given
API_KEY_ENV = "RFMEM_API_KEY"
#: default limit of a request body (bytes): ``rfmem serve --max-body-bytes``
DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_ITEMS = 1024  # items per add / delete request
MAX_BULK_ITEMS = 4096  # items per bulk request (/v1/memories:batch*)
MAX_QUERIES = 1024  # queries per batch search
MAX_TEXT = MAX_TEXT_CHARS  # characters per text
MAX_DIM = 65_536
MAX_PAGE = 1000  # items per page of GET /memories

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
ItemId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_LENGTH)]
#: a JSON number, finite; strict: ``true`` / ``false`` and numeric strings are refused (not 1.0 / "1.0")
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Vector = Annotated[list[Finite], Field(min_length=1, max_length=MAX_DIM)]
Meta = dict[str, Any]
# path segments as routed: the decoded id with "%" and "/" escaped (_PathSegments)
UserSeg = Annotated[str, Path(min_length=1, description="the user whose memory is used (percent-encoded)")]
ItemSeg = Annotated[str, Path(min_length=1, description="an item id of that user (percent-encoded)")]
Mode = Literal["rfmem", "dense", "recollection"]
K = Annotated[int, Field(strict=True, ge=1, le=MAX_K)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not ignored


class AddRequest(_Body):
    """Items to add: texts (encoded by the server) and / or vectors, optional ids / metadata."""

    texts: list[Text] | None = Field(None, min_length=1, max_length=MAX_ITEMS)
    vectors: list[Vector] | None = Field(None, min_length=1, max_length=MAX_ITEMS)
    ids: list[ItemId] | None = Field(None, min_length=1, max_length=MAX_ITEMS)
    metadata: Union[Meta, list[Meta | None], None] = None
    #: when the items were created: an ISO-8601 string with a UTC offset or epoch seconds,
    #: one for every item or one per item (default: now; Memory.add), each within
    #: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999Z (a bad one: 422 naming it)
    created_at: Union[Finite, str, list[Union[Finite, str]], None] = None

    @field_validator("created_at", mode="before")
    @classmethod
    def _created_at(cls, v: Any) -> Any:
        if v is not None:  # the value as sent, checked as Memory.add checks it (the same message; true: 422)
            try:
                _created_list(v, len(v) if isinstance(v, list) else 1)
            except (TypeError, ValueError) as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _lengths(self) -> "AddRequest":
        if self.texts is None and self.vectors is None:
            raise ValueError("texts or vectors is required")
        m = len(self.texts) if self.texts is not None else len(self.vectors)
        for name, val in (("vectors", self.vectors), ("ids", self.ids),
                          ("metadata", self.metadata if isinstance(self.metadata, list) else None),
                          ("created_at", self.created_at if isinstance(self.created_at, list) else None)):
            if val is not None and len(val) != m:
                raise _count_error(name, len(val), m)
        return self


class UpdateRequest(_Body):
    """New text (re-encoded), vector and / or metadata of one item: the names of
    :meth:`Memory.update` (``texts``, ``vectors``, ``metadata``), for one item."""

    texts: Text | None = None
    vectors: Vector | None = None
    metadata: Meta | None = None

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in (("text", "texts"), ("vector", "vectors")):
                if old in data:
                    raise ValueError(f"unknown field {old!r}: use {new!r} (the name of Memory.update and of add)")
        return data

    @model_validator(mode="after")
    def _something(self) -> "UpdateRequest":
        if self.texts is None and self.vectors is None and self.metadata is None:
            raise ValueError("texts, vectors or metadata is required")
        return self


class DeleteRequest(_Body):
    """Item ids to delete."""

    ids: list[ItemId] = Field(min_length=1, max_length=MAX_ITEMS)


class BulkAddItem(_Body):
    """One item of a bulk add: its user, a text and / or a vector, optional id,
    metadata and ``created_at`` (as :class:`AddRequest`'s: epoch seconds or ISO-8601,
    a string without an offset read as UTC; default: now; checked by
    :meth:`Memory.add_many`, a bad one a 422 at ``["body", "items", i, "created_at"]``)."""

    user_id: ItemId
    id: ItemId | None = None
    text: Text | None = None
    vector: Vector | None = None
    metadata: Meta | None = None
    created_at: Union[Finite, Annotated[str, StringConstraints(max_length=64)], None] = None

    @model_validator(mode="after")
    def _some(self) -> "BulkAddItem":
        if self.text is None and self.vector is None:
            raise ValueError("text or vector is required")
        return self


class BulkUpdateItem(_Body):
    """One item of a bulk update: its user and id, and what changes (a field left out
    is kept; ``"metadata": null`` clears)."""

    user_id: ItemId
    id: ItemId
    text: Text | None = None
    vector: Vector | None = None
    metadata: Meta | None = None

    @model_validator(mode="after")
    def _some(self) -> "BulkUpdateItem":
        if not self.model_fields_set & {"text", "vector", "metadata"}:
            raise ValueError("text, vector or metadata is required")
        return self


class BulkDeleteItem(_Body):
    """One item of a bulk delete."""

    user_id: ItemId
    id: ItemId


class BulkAddRequest(_Body):
    """Items of any users, added in one all-or-nothing write (:meth:`Memory.add_many`)."""

    items: list[BulkAddItem] = Field(min_length=1, max_length=MAX_BULK_ITEMS)


class BulkUpdateRequest(_Body):
    """Items of any users, changed in one all-or-nothing write (:meth:`Memory.update_many`)."""

    items: list[BulkUpdateItem] = Field(min_length=1, max_length=MAX_BULK_ITEMS)


class BulkDeleteRequest(_Body):
    """Items of any users, deleted in one all-or-nothing write (:meth:`Memory.delete_many`)."""

    items: list[BulkDeleteItem] = Field(min_length=1, max_length=MAX_BULK_ITEMS)


def _checked_filters(v: Any, batch: bool) -> Any:
    """A search body's ``filters``, checked by :mod:`rfmem_fast.filters` (a bad one: 422
    whose message names the part, e.g. ``filters['score']['$gte']: ...``)."""
    if v is None:
        return None
    try:
        if batch and isinstance(v, list):
            check_filters(v, len(v))
        else:
            parse_filter(v, "filters")
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    return v


class SearchRequest(_Body):
    """One query: a text or a vector, the number of hits k, the mode, optional filters
    over the items' metadata and ``created_at`` (:mod:`rfmem_fast.filters`)."""

    query: Text | None = None
    vector: Vector | None = None
    k: K | None = None
    mode: Mode = "rfmem"
    filters: dict[str, Any] | None = None

    @field_validator("filters")
    @classmethod
    def _filters(cls, v: Any) -> Any:
        return _checked_filters(v, batch=False)

    @model_validator(mode="after")
    def _one(self) -> "SearchRequest":
        if (self.query is None) == (self.vector is None):
            raise ValueError("exactly one of query and vector is required")
        return self


class BatchSearchRequest(_Body):
    """Many queries of one user: texts or vectors, with one k and mode, and filters: one
    for every query or one (or null) per query."""

    queries: list[Text] | None = Field(None, min_length=1, max_length=MAX_QUERIES)
    vectors: list[Vector] | None = Field(None, min_length=1, max_length=MAX_QUERIES)
    k: K | None = None
    mode: Mode = "rfmem"
    filters: Union[dict[str, Any], list[dict[str, Any] | None], None] = None

    @field_validator("filters")
    @classmethod
    def _filters(cls, v: Any) -> Any:
        return _checked_filters(v, batch=True)

    @model_validator(mode="after")
    def _one(self) -> "BatchSearchRequest":
        if (self.queries is None) == (self.vectors is None):
            raise ValueError("exactly one of queries and vectors is required")
        n = len(self.queries if self.queries is not None else self.vectors)
        if isinstance(self.filters, list) and len(self.filters) != n:
            raise _count_error("filters", len(self.filters), n, "query", single="one filter (or null)")
        return self


class MintRequest(_Body):
    """A user token to mint: the one user it may access, an optional label."""

    user_id: ItemId
    label: Annotated[str, StringConstraints(max_length=256)] | None = None


class HitOut(BaseModel):
    """One hit of a search (``created_at``: the item's creation time, ISO-8601 UTC as in
    :class:`ItemOut`, null when unknown)."""

    id: str
    text: str | None
    score: float
    metadata: Meta
    rank: int
    dense_score: float | None = None
    lexical_score: float | None = None
    created_at: str | None = None


class SearchResponse(BaseModel):
    """A query's hits and its familiarity signals (RFMEM_SPEC.md sections 1-2)."""

    user_id: str
    route: str | None
    rule: str
    mean: float
    entropy: float
    rounds: int
    cached: bool
    hits: list[HitOut]


class ItemOut(BaseModel):
    """A stored item (``created_at``: ISO-8601 UTC, null when unknown)."""

    id: str
    text: str | None
    metadata: Meta
    created_at: str | None = None


class ItemPage(BaseModel):
    """A page of a user's items (insertion order); ``next_offset`` None on the last page."""

    items: list[ItemOut]
    total: int
    offset: int
    limit: int
    next_offset: int | None


@contextmanager
def _http_errors() -> Iterator[None]:
    """Map the memory's errors to HTTP statuses (module docstring)."""
    try:
        yield
    except QueueFullError as e:
        raise HTTPException(503, str(e), headers={"Retry-After": "1"}) from None
    except RequestTimeoutError as e:
        raise HTTPException(504, str(e)) from None
    except BatcherClosedError as e:
        raise HTTPException(503, str(e)) from None
    except KeyError as e:
        raise HTTPException(404, str(e.args[0]) if e.args else "not found") from None
    except FilterTypeError as e:  # a filter whose range type the user's values never have
        raise HTTPException(422, str(e)) from None
    except (ValueError, TypeError) as e:
        raise HTTPException(400, str(e)) from None


@contextmanager
def _bulk_errors() -> Iterator[None]:
    """:func:`_http_errors`, but a bad item (an error with an ``index``, from
    :meth:`Memory.add_many` and co.) is a 422 in pydantic's form, located at the item."""
    with _http_errors():
        try:
            yield
        except (ValueError, TypeError) as e:
            index = getattr(e, "index", None)
            if index is None:
                raise
            field = getattr(e, "field", None)
            loc = ["body", "items", index] + ([field] if field else [])
            raise HTTPException(422, [{"type": "value_error", "loc": loc, "msg": str(e)}]) from None


def _bulk_items(who: "_Principal", items: list[BaseModel]) -> list[dict[str, Any]]:
    """The items of a bulk request as :meth:`Memory.add_many` takes them (the fields
    sent, an explicit null included), after the scope check: a user token may write
    its own user only (403 naming the first item of another user)."""
    out = []
    for i, it in enumerate(items):
        if not _may_access(who, it.user_id):
            raise HTTPException(403, f"items[{i}].user_id: this token may not access this user's memories "
                                     "(a user token writes its own user only)")
        out.append({k: getattr(it, k) for k in it.model_fields_set})
    return out


class FastJSONResponse(JSONResponse):
    """A JSON response serialised by orjson (~15x faster than the standard library on a
    search answer: 3 us instead of 44 us); falls back to the standard library for what
    orjson refuses (an int beyond 64 bits in metadata)."""

    def render(self, content: Any) -> bytes:
        return _dumps(content)


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with pydantic's errors (type, loc naming the field, msg), without echoing the
    input: a NaN in it cannot be written as JSON, and a vector would be echoed whole."""
    errors = [{"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
    return FastJSONResponse({"detail": errors}, status_code=422)


def _search_json(hits: Hits) -> dict[str, Any]:
    """One query's answer as the search routes send it (:class:`SearchResponse`)."""
    return _search_doc(hits.user_id, hits.route, hits.rule, hits.mean, hits.entropy, hits.rounds, hits.cached, hits)


def _search_doc(user: Any, route: str | None, rule: str, mean: float, entropy: float, rounds: int, cached: bool,
                hits: Any) -> dict[str, Any]:
    """The JSON object of :class:`SearchResponse` from a query's signals and its
    :class:`~rfmem_fast.serving.memory.Hit` objects (only read)."""
    return {
        "user_id": str(user), "route": route, "rule": rule, "mean": mean,
        "entropy": entropy, "rounds": rounds, "cached": cached,
        "hits": [{"id": h.id, "text": h.text, "score": h.score, "metadata": h.metadata, "rank": h.rank,
                  "dense_score": h.dense_score, "lexical_score": h.lexical_score,
                  "created_at": h.created_at} for h in hits],  # a datetime: ISO-8601 as isoformat() (_dumps)
    }


def _dumps(content: Any) -> bytes:
    """``content`` as JSON bytes: orjson, or the standard library for what orjson
    refuses (an int beyond 64 bits in metadata), as :class:`FastJSONResponse`. A
    timezone-aware ``datetime`` (a hit's ``created_at``) is written as its
    ``isoformat()`` by both (orjson in Rust: ~10x cheaper than ``isoformat()`` per hit)."""
    try:
        return orjson.dumps(content)
    except orjson.JSONEncodeError:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"),
                          default=_iso).encode()


def _iso(o: Any) -> str:
    """``json.dumps``' ``default``: a datetime as its ISO-8601 string (as orjson writes it)."""
    if isinstance(o, datetime):
        return o.isoformat()
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


class _Metrics:
    """The app's Prometheus metrics in their own registry (several apps per process are fine)."""

    def __init__(self, memory: Memory) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("rfmem_http_requests", "HTTP requests", ["method", "route", "status"], registry=reg)
        self.latency = Histogram(
            "rfmem_http_request_duration_seconds", "HTTP request latency (s)", ["method", "route"], registry=reg,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.queries = Counter("rfmem_search_queries", "search queries answered, by route and rule",
                               ["mode", "route", "rule", "cached"], registry=reg)
        self.batch = Histogram("rfmem_batch_size", "queries per batched run", registry=reg,
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        secs = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
        self.encode = Histogram("rfmem_encode_seconds", "encoder time per batched run (s)", registry=reg, buckets=secs)
        self.search = Histogram("rfmem_search_seconds", "search time per batched run (s)", registry=reg, buckets=secs)
        reg.register(_MemoryCollector(memory))
        memory.add_listener(self.on_batch)

    def on_batch(self, ev: BatchEvent) -> None:
        self.batch.observe(ev.size)
        if ev.encoded:
            self.encode.observe(ev.encode_seconds)
        if ev.searches:
            self.search.observe(ev.search_seconds)

    def count(self, mode: str, hits: Hits) -> None:
        """One answered query in ``rfmem_search_queries_total``."""
        self.count_signals(mode, hits.route, hits.rule, hits.cached)

    def count_signals(self, mode: str, route: str | None, rule: str, cached: bool) -> None:
        """:meth:`count` from the query's route, rule and cache flag."""
        self.queries.labels(mode, route or "none", rule, "true" if cached else "false").inc()


class _MemoryCollector:
    """Reads the memory's counters at scrape time (cache, queue, sizes, writes)."""

    def __init__(self, memory: Memory) -> None:
        self.memory = memory

    def collect(self) -> Iterator[Any]:
        st = self.memory.stats()
        ratio = GaugeMetricFamily("rfmem_cache_hit_ratio", "hot-query cache hits / lookups", labels=["cache"])
        hits = CounterMetricFamily("rfmem_cache_hits", "hot-query cache hits", labels=["cache"])
        misses = CounterMetricFamily("rfmem_cache_misses", "hot-query cache misses", labels=["cache"])
        for name, c in st["cache"].items():
            ratio.add_metric([name], c["hit_rate"])
            hits.add_metric([name], c["hits"])
            misses.add_metric([name], c["misses"])
        yield from (ratio, hits, misses)
        b = st["batcher"] or {}
        yield GaugeMetricFamily("rfmem_queue_depth", "searches waiting for a batch", value=b.get("queue_depth", 0))
        yield CounterMetricFamily("rfmem_queue_rejected", "searches refused on a full queue", value=b.get("rejected", 0))
        yield GaugeMetricFamily("rfmem_items", "live memory items", value=st["items"])
        yield GaugeMetricFamily("rfmem_users", "users", value=st["users"])
        yield CounterMetricFamily("rfmem_writes", "acknowledged writes", value=st["writes"])
        yield GaugeMetricFamily("rfmem_wal_bytes", "bytes in the write-ahead log", value=st["wal_bytes"])
        yield CounterMetricFamily("rfmem_encoder_seconds", "seconds spent in the text encoder (searches and writes)",
                                  value=st["encode_seconds"])
        yield CounterMetricFamily("rfmem_encoded_texts", "texts (chunks of long texts) embedded (searches and writes)",
                                  value=st["encoded"])
        enc = st["encoder"]
        if enc is not None:
            info = GaugeMetricFamily("rfmem_encoder_info", "the text encoder (value 1): model, runtime, precision, "
                                     "device", labels=["model", "backend", "dtype", "device"])
            info.add_metric([enc["model"], str(enc["backend"]), str(enc["dtype"]), str(enc["device"])], 1)
            yield info


class _MetricsMiddleware:
    """ASGI middleware counting requests and timing them per route template."""

    def __init__(self, app: Any, metrics: _Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            m = self.metrics
            m.requests.labels(scope["method"], route, str(status[0])).inc()
            m.latency.labels(scope["method"], route).observe(time.perf_counter() - t0)


async def _send_json(send: Any, status: int, detail: str, headers: tuple = ()) -> None:
    """Answer an ASGI request with ``{"detail": detail}`` (from a middleware)."""
    body = orjson.dumps({"detail": detail})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class _BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes with 413.

    A Content-Length over the limit is refused before any byte of the body is read; a
    body without one (chunked) is read while it is counted, and refused as soon as the
    count passes the limit: at most ``limit`` bytes (plus one network chunk) are ever
    held. A body within the limit is handed to the app whole."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = f"request body over the limit of {self.limit} bytes (rfmem serve --max-body-bytes)"
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, "invalid Content-Length")
                    return
                if declared > self.limit:
                    await _send_json(send, 413, too_big)
                    return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await _send_json(send, 413, too_big)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        chunks = []
        sent = [False]

        async def replay() -> dict:
            if not sent[0]:
                sent[0] = True
                return whole
            return await receive()

        await self.app(scope, replay, send)


def _escape_segment(text: str) -> str:
    return text.replace("%", "%25").replace("/", "%2F")


class _PathSegments:
    """ASGI middleware: route on the RAW path, each segment decoded on its own.

    Servers percent-decode the whole path before routing, so ``a%2Fmemories%2Fx`` would
    become three segments and reach another user. Here ``scope["path"]`` is rebuilt
    from ``raw_path``: every segment decoded (UTF-8, strict: 400 otherwise), then its
    ``%`` and ``/`` escaped again, so the router sees exactly one segment per id; the
    route's parameters are unescaped by :func:`_segment` (exactly the decoded id)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        raw = scope.get("raw_path") if scope["type"] == "http" else None
        if raw:
            root = scope.get("root_path", "").encode("latin-1")
            if root and raw.startswith(root):
                raw = raw[len(root):]
            try:
                segs = [_escape_segment(unquote_to_bytes(seg).decode("utf-8")) for seg in raw.decode("latin-1").split("/")]
            except UnicodeDecodeError:
                await _send_json(send, 400, "the request path is not valid percent-encoded UTF-8")
                return
            scope["path"] = scope.get("root_path", "") + "/".join(segs)  # in place: outer middlewares read scope["route"]
        await self.app(scope, receive, send)


def _segment(value: str, name: str) -> str:
    """An id from its routed path segment (:class:`_PathSegments`), checked (400)."""
    try:
        return _canon_id(unquote(value), name)
    except (TypeError, ValueError) as e:
        raise HTTPException(400, str(e)) from None


#: the route template of one search (the fast path's metrics label, as the router's)
_SEARCH_ROUTE = "/v1/users/{user_id}/search"
#: the fields of a search body the fast path reads itself (any other: the full route)
_FAST_FIELDS = frozenset(("query", "k", "mode", "filters", "vector"))
_MODES = ("rfmem", "dense", "recollection")  # the Mode literal's values
log = logging.getLogger("rfmem_fast.serving")


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that hands out ``body`` (already read) whole, then defers to ``receive``."""
    sent = [False]

    async def replay() -> dict:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _FastSearch:
    """The fast path of ``POST /v1/users/{user_id}/search``: a well-formed text query
    answered without FastAPI's routing, dependency resolution and pydantic model.

    It answers only a request the full route would answer from the same checks with a
    search: the path is exactly ``/v1/users/<one segment>/search`` (no root path), the
    body has a Content-Length within the limit and a JSON Content-Type
    (``application/json``, optionally with parameters; FastAPI reads no other body as JSON), the
    bearer token is valid for that user (or auth is off), and the body is a JSON
    object holding a str ``query`` (at most MAX_TEXT characters) and, optionally, ``k``
    (an int in [1, MAX_K], or null), ``mode`` (one of the modes), ``filters`` / ``vector``
    null, nothing else. Anything else -- a bad token, a body the fast JSON parser
    refuses, a vector or filtered query, any field out of range -- goes to the full
    route with the body replayed, which answers it (and its errors: 401 / 403 / 413 /
    422) exactly as it would have. Once it searches, its answer is the full route's:
    the same JSON (:func:`_search_doc`), the same error statuses (:func:`_http_errors`),
    and the same metrics (``rfmem_http_requests_total`` / the latency histogram under
    the route's template, ``rfmem_search_queries_total``).

    Counters: ``served`` (answered here) and ``passed`` (handed to the full route).
    """

    def __init__(self, memory: Memory, metrics: "_Metrics", tokens: TokenStore, admin_key: bytes | None,
                 limit: int) -> None:
        self.memory = memory
        self.metrics = metrics
        self.tokens = tokens
        self.key = admin_key
        self.limit = limit
        self._latency = metrics.latency.labels("POST", _SEARCH_ROUTE)
        self._ok = metrics.requests.labels("POST", _SEARCH_ROUTE, "200")
        self.served = 0
        self.passed = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> Any:
        """Answer the request (returns None), or return the ``receive`` with which the
        full app must answer it (the body replayed when it was read)."""
        raw = scope.get("raw_path")
        if not raw or not raw.startswith(b"/v1/users/") or not raw.endswith(b"/search") or scope.get("root_path"):
            return receive  # not a search (the common case of the other routes: nothing read)
        t0 = time.perf_counter()
        seg = raw[10:-7]
        length = ctype = auth = None
        doubled = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                doubled, length = doubled or length is not None, value
            elif name == b"content-type":
                doubled, ctype = doubled or ctype is not None, value.lower()
            elif name == b"authorization":
                doubled, auth = doubled or auth is not None, value
        if (doubled or not seg or b"/" in seg or length is None or not length.isdigit() or int(length) > self.limit
                or ctype is None or (ctype != b"application/json" and not ctype.startswith(b"application/json;"))):
            self.passed += 1  # no / a bad / a doubled header, a body over the limit: the full route decides
            return receive
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        query = self._query(seg, auth, body)
        if query is None:
            self.passed += 1
            return _replay(body, receive)
        self.served += 1
        user, text, k, mode = query
        status, extra = 200, ()
        try:
            with _http_errors():
                ans, cached = await self.memory._asearch_answer(text, user, k, mode)
            payload = _dumps(_search_doc(ans.user, ans.route, ans.rule, ans.mean, ans.entropy, ans.rounds, cached,
                                         ans.hits))
            self.metrics.count_signals(mode, ans.route, ans.rule, cached)
            ctype = b"application/json"
        except HTTPException as e:
            status, payload, ctype = e.status_code, _dumps({"detail": e.detail}), b"application/json"
            extra = tuple((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (e.headers or {}).items())
        except Exception:  # as Starlette's ServerErrorMiddleware: logged, a plain 500
            log.exception("search failed")
            status, payload, ctype = 500, b"Internal Server Error", b"text/plain; charset=utf-8"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(payload)).encode()), (b"content-type", ctype), *extra]})
        await send({"type": "http.response.body", "body": payload})
        (self._ok if status == 200 else self.metrics.requests.labels("POST", _SEARCH_ROUTE, str(status))).inc()
        self._latency.observe(time.perf_counter() - t0)
        return None

    def _query(self, seg: bytes, auth: bytes | None, body: bytes) -> tuple[str, str, int | None, str] | None:
        """(user, query text, k, mode) of a request the fast path answers, else None."""
        who = _principal_of(self.key, self.tokens, "" if auth is None else auth.decode("latin-1"))
        if who is None:
            return None
        try:
            user = _canon_id(unquote_to_bytes(seg).decode("utf-8"), "user_id")
        except (UnicodeDecodeError, TypeError, ValueError):
            return None
        if not _may_access(who, user):
            return None
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if type(doc) is not dict or not doc.keys() <= _FAST_FIELDS:
            return None
        text, k, mode = doc.get("query"), doc.get("k"), doc.get("mode", "rfmem")
        if type(text) is not str or len(text) > MAX_TEXT or doc.get("vector") is not None \
                or doc.get("filters") is not None or type(mode) is not str or mode not in _MODES:
            return None
        if k is not None and (type(k) is not int or not 1 <= k <= MAX_K):
            return None
        return user, text, k, mode


class _App(FastAPI):
    """The FastAPI app, with :class:`_FastSearch` in front of it (``fast_search``; None:
    every request through the full stack)."""

    fast_search: _FastSearch | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        fast = self.fast_search
        if fast is not None and scope["type"] == "http" and scope["method"] == "POST":
            receive = await fast(scope, receive, send)
            if receive is None:
                return
        await super().__call__(scope, receive, send)


@dataclass(frozen=True)
class _Principal:
    """Who a request is: the admin (every route) or the holder of one user's token."""

    admin: bool
    user: str | None = None


_UNAUTHORISED = "missing or invalid bearer token (Authorization: Bearer <token>)"


def _principal_of(key: bytes | None, tokens: TokenStore, authorization: str) -> _Principal | None:
    """Who sent a request with this ``Authorization`` header value ("" when absent):
    the admin (``key``, or anyone when ``key`` is None: no auth), the user of a user
    token, or None (no valid bearer token: 401)."""
    if key is None:
        return _Principal(admin=True)
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    if hmac.compare_digest(token.encode("utf-8", "surrogatepass"), key):
        return _Principal(admin=True)
    user = tokens.user_of(token)
    return None if user is None else _Principal(admin=False, user=user)


def _may_access(who: _Principal, user: str) -> bool:
    """Whether ``who`` may read / write ``user``'s memories (the admin: every user)."""
    return who.admin or hmac.compare_digest(user.encode("utf-8"), (who.user or "").encode("utf-8"))


async def _principal(request: Request) -> _Principal:  # async: no hop to the thread pool per request
    """Who sent the request: the admin token, a user token (bound to its user), or
    anyone when the app runs without auth; 401 otherwise."""
    who = _principal_of(request.app.state.admin_key, request.app.state.tokens,
                        request.headers.get("authorization", ""))
    if who is None:
        raise HTTPException(401, _UNAUTHORISED, headers={"WWW-Authenticate": "Bearer"})
    return who


Who = Annotated[_Principal, Depends(_principal)]


def _admin_only(who: Who) -> _Principal:
    """403 unless the request carries the admin token (or auth is off)."""
    if not who.admin:
        raise HTTPException(403, "this route needs the admin token")
    return who


def _token_admin(request: Request, who: Who) -> _Principal:
    """The token routes: the admin token only, and never without auth (a token minted by
    anyone on an unauthenticated server would stay valid once auth is switched on): 403."""
    if request.app.state.admin_key is None:
        raise HTTPException(403, "token administration needs the admin token: this server runs without "
                                 "authentication (--no-auth); restart it with --api-key to mint or revoke tokens")
    return _admin_only(who)


async def _scoped_user(user_id: UserSeg, who: Who) -> str:  # async: no hop to the thread pool per request
    """The path's user id, decoded; a user token may name its own user only (403)."""
    user = _segment(user_id, "user_id")
    if not _may_access(who, user):
        raise HTTPException(403, "this token may not access this user's memories")
    return user


User = Annotated[str, Depends(_scoped_user)]


def create_app(memory: Memory, api_key: str | None = None, close_memory: bool = False, *,
               no_auth: bool = False, tokens: TokenStore | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, fast_path: bool = True) -> FastAPI:
    """The FastAPI app serving ``memory`` (routes, ids, auth, limits, errors and metrics:
    module docstring).

    Args:
        memory: the Memory to serve (its micro-batching settings apply).
        api_key: the admin bearer token (every route, mints / revokes user tokens).
        close_memory: close (and so checkpoint) the memory when the app shuts down.
        no_auth: serve without authentication (every route open); required when
            ``api_key`` is None, refused with one.
        tokens: the user-token store; default: ``tokens.json`` in the memory's
            directory (durable), in memory only for a Memory without a path.
        max_body_bytes: the largest request body accepted (int >= 1; 413 beyond it).
        fast_path: answer well-formed text searches on a fast path in front of
            FastAPI (:class:`_FastSearch`: the same answers, errors and metrics, about
            half the HTTP cost); False sends every request through the full stack.

    Returns:
        FastAPI application (run it with uvicorn, or test it with TestClient).

    Raises:
        TypeError: ``memory`` is not a Memory, ``tokens`` not a TokenStore.
        ValueError: an empty / blank ``api_key``, neither ``api_key`` nor ``no_auth``
            (or both), a bad ``max_body_bytes``.
    """
    if not isinstance(memory, Memory):
        raise TypeError(f"memory must be a rfmem_fast.Memory, got {type(memory).__name__}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError("api_key must be a non-empty str (or None with no_auth=True)")
    if api_key is None and not no_auth:
        raise ValueError("no api_key: give the admin token (api_key=...) or serve without auth (no_auth=True)")
    if api_key is not None and no_auth:
        raise ValueError("api_key and no_auth=True contradict each other: pick one")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    if not isinstance(fast_path, bool):
        raise TypeError(f"fast_path must be a bool, got {type(fast_path).__name__}")
    if tokens is None:
        tokens = TokenStore(memory.path / TOKENS_FILE if memory.path is not None else None)
    elif not isinstance(tokens, TokenStore):
        raise TypeError(f"tokens must be a TokenStore, got {type(tokens).__name__}")
    metrics = _Metrics(memory)
    key = api_key.strip().encode() if api_key else None
    config_summary = memory.config.summary()  # the Memory's configuration never changes

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> Any:
        yield
        if close_memory:
            await asyncio.to_thread(memory.close)

    Admin = [Depends(_admin_only)]
    TokenAdmin = [Depends(_token_admin)]

    app = _App(title="rfmem_fast", summary="RF-Mem memory retrieval service", lifespan=lifespan,
               default_response_class=FastJSONResponse)
    if fast_path:
        app.fast_search = _FastSearch(memory, metrics, tokens, key, max_body_bytes)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    app.add_middleware(_PathSegments)
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    app.state.memory = memory
    app.state.metrics = metrics
    app.state.tokens = tokens
    app.state.admin_key = key

    @app.get("/health")
    def health() -> dict[str, Any]:
        users, items = memory.counts()
        return {"status": "ok", "users": users, "items": items,
                "batching": memory.batching, "encoder": memory.encoder_info(), "config": config_summary}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/users/{user_id}/memories", status_code=201)
    def add(user: User, body: AddRequest) -> FastJSONResponse:
        with _http_errors():
            ids = memory.add(body.texts, user, ids=body.ids, metadata=body.metadata, vectors=body.vectors,
                             created_at=body.created_at)
        return FastJSONResponse({"ids": ids}, status_code=201)

    @app.get("/v1/users/{user_id}/memories", response_model=ItemPage)
    def list_items(user: User, offset: Annotated[int, Query(ge=0)] = 0,
                   limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100) -> FastJSONResponse:
        with _http_errors():
            total = memory.count(user)
            items = memory.get_all(user, offset=offset, limit=limit)
        nxt = offset + len(items) if offset + len(items) < total else None
        return FastJSONResponse({"items": [it.to_dict() for it in items], "total": total, "offset": offset,
                                 "limit": limit, "next_offset": nxt})

    @app.get("/v1/users/{user_id}/memories/{item_id}", response_model=ItemOut)
    def get_item(user: User, item_id: ItemSeg) -> FastJSONResponse:
        item_id = _segment(item_id, "item_id")
        with _http_errors():
            item = memory.get(item_id, user)[0]
        return FastJSONResponse(item.to_dict())

    @app.patch("/v1/users/{user_id}/memories/{item_id}")
    def update_item(user: User, item_id: ItemSeg, body: UpdateRequest) -> dict[str, Any]:
        item_id = _segment(item_id, "item_id")
        with _http_errors():
            memory.update(item_id, user, texts=body.texts, vectors=body.vectors, metadata=body.metadata)
        return {"updated": [item_id]}

    @app.delete("/v1/users/{user_id}/memories/{item_id}")
    def delete_item(user: User, item_id: ItemSeg) -> dict[str, Any]:
        item_id = _segment(item_id, "item_id")
        with _http_errors():
            memory.delete(item_id, user)
        return {"deleted": [item_id]}

    @app.post("/v1/users/{user_id}/memories/delete")
    def delete_items(user: User, body: DeleteRequest) -> dict[str, Any]:
        with _http_errors():
            memory.delete(body.ids, user)
        return {"deleted": body.ids}

    @app.delete("/v1/users/{user_id}")
    def delete_user(user: User) -> dict[str, Any]:
        with _http_errors():
            n = memory.delete_user(user)
        return {"user_id": user, "deleted": n}

    @app.post("/v1/users/{user_id}/search", response_model=SearchResponse)
    async def search(user: User, body: SearchRequest) -> FastJSONResponse:
        query = body.query if body.query is not None else body.vector
        with _http_errors():
            hits = await memory.asearch(query, user, k=body.k, mode=body.mode, filters=body.filters)
        metrics.count(body.mode, hits)
        return FastJSONResponse(_search_json(hits))

    @app.post("/v1/users/{user_id}/search/batch")
    async def search_batch(user: User, body: BatchSearchRequest) -> FastJSONResponse:
        queries = body.queries if body.queries is not None else body.vectors
        with _http_errors():
            results = await asyncio.to_thread(memory.search_batch, queries, user, body.k, body.mode, body.filters)
        for hits in results:
            metrics.count(body.mode, hits)
        return FastJSONResponse({"results": [_search_json(h) for h in results]})

    @app.post("/v1/memories:batch", status_code=201)
    def add_bulk(who: Who, body: BulkAddRequest) -> FastJSONResponse:
        items = _bulk_items(who, body.items)
        with _bulk_errors():
            ids = memory.add_many(items)
        return FastJSONResponse({"ids": ids}, status_code=201)

    @app.post("/v1/memories:batchUpdate")
    def update_bulk(who: Who, body: BulkUpdateRequest) -> dict[str, Any]:
        items = _bulk_items(who, body.items)
        with _bulk_errors():
            memory.update_many(items)
        return {"updated": len(items)}

    @app.post("/v1/memories:batchDelete")
    def delete_bulk(who: Who, body: BulkDeleteRequest) -> dict[str, Any]:
        items = _bulk_items(who, body.items)
        with _bulk_errors():
            memory.delete_many(items)
        return {"deleted": len(items)}

    @app.post("/v1/checkpoint", dependencies=Admin)
    def checkpoint() -> dict[str, Any]:
        with _http_errors():
            memory.save()
        return {"checkpointed": True, "items": memory.counts()[1]}

    @app.post("/v1/admin/tokens", status_code=201, dependencies=TokenAdmin)
    def mint_token(body: MintRequest) -> FastJSONResponse:
        with _http_errors():
            user = _canon_id(body.user_id, "user_id")
            token, info = tokens.mint(user, body.label)
        return FastJSONResponse({"token": token, **info.to_dict()}, status_code=201)

    @app.get("/v1/admin/tokens", dependencies=TokenAdmin)
    def list_tokens(user_id: Annotated[str | None, Query(min_length=1, max_length=MAX_ID_LENGTH)] = None) -> FastJSONResponse:
        return FastJSONResponse({"tokens": [t.to_dict() for t in tokens.list(user_id)]})

    @app.delete("/v1/admin/tokens/{token_id}", dependencies=TokenAdmin)
    def revoke_token(token_id: ItemSeg) -> dict[str, Any]:
        if not tokens.revoke(unquote(token_id)):
            raise HTTPException(404, f"token_id: unknown token {unquote(token_id)!r}")
        return {"revoked": unquote(token_id)}

    return app


def serve(
    path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    encoder: str = "default",
    encoder_dtype: str = "auto",
    encoder_backend: str = "auto",
    preset: str = "recommended",
    dim: int | None = None,
    backend: str = "auto",
    batching: bool = True,
    max_batch: int = 64,
    max_wait_ms: float = 2.0,
    max_queue: int = 1024,
    timeout: float = 30.0,
    cache_size: int = 4096,
    pipeline: bool = True,
    encoder_workers: int | str = "auto",
    log_level: str = "info",
    access_log: bool = False,
    no_auth: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    fast_path: bool = True,
) -> None:
    """Open the memory at ``path`` and serve it with uvicorn until SIGINT / SIGTERM.

    Args:
        path: the Memory directory (created if absent); user tokens are kept in its
            ``tokens.json`` (hashed).
        host, port: where to listen.
        api_key: the admin bearer token (default: the ``RFMEM_API_KEY`` environment
            variable). An empty or blank key, from either source, is refused.
        no_auth: serve without authentication (a warning is printed); required when
            there is no key, refused with one.
        max_body_bytes: largest request body (bytes; 413 beyond it).
        encoder: "default" (the offline all-MiniLM-L6-v2, loaded before the server
            listens), "none" (vectors only) or a local sentence-transformers directory.
        encoder_dtype: precision of the text encoder (:func:`rfmem_fast.encoders.resolve_dtype`):
            "auto" (default: :func:`rfmem_fast.encoders.resolve_backend` -- with ONNX
            float32 on every CPU; with torch bfloat16 where the CPU has native bfloat16
            matmul, e.g. AVX512-BF16 / AMX, else float32), "float32", "bfloat16",
            "float16" or "int8" (only when asked for; with an ``encoder_backend`` of
            "onnx" / "auto" only). Shown in ``/health`` and ``/metrics``
            (``rfmem_encoder_info``), with the runtime.
        encoder_backend: runtime of the text encoder (:func:`rfmem_fast.encoders.resolve_backend`):
            "auto" (default: :data:`rfmem_fast.encoders.AUTO_ENCODER_RULE` -- ONNX
            Runtime float32 where onnxruntime / onnx are installed, torch elsewhere),
            "torch" or "onnx".
        preset: the retrieval configuration, "recommended" (default: hybrid dense +
            BM25, ``RFMemConfig.recommended()`` for the encoder) or "paper" (the authors'
            RF-Mem, dense only); :func:`rfmem_fast.serving.launch.open_memory`.
        dim: vector dimension of a new vectors-only memory.
        backend, batching, max_batch, max_wait_ms, max_queue, timeout, cache_size:
            as :class:`rfmem_fast.Memory`.
        pipeline, encoder_workers: the encode / search pipeline and its encoder workers
            (:func:`rfmem_fast.serving.cli.open_memory`; ``--no-pipeline``,
            ``--encoder-workers``).
        log_level, access_log: uvicorn's logging.
        fast_path: :func:`create_app`'s (``--no-fast-path``: False).

    uvicorn runs with its httptools parser and the uvloop event loop where installed
    (the ``serve`` extra), and the objects alive once the memory and its encoder are
    loaded are frozen out of the garbage collector's scans (``gc.freeze``: a full
    collection then walks only what requests allocate, not the millions of objects
    of torch / transformers, which otherwise stall every thread holding the GIL).

    On shutdown the memory is closed (checkpointed); a killed server replays its
    write-ahead log on the next start.
    """
    import uvicorn

    from ..encoders import check_backend
    from .launch import open_memory

    check_backend(encoder_backend, encoder_dtype, "encoder_backend", "encoder_dtype")  # bad options first,
    key = _resolve_api_key(api_key, no_auth)  # then the key: both refused before anything opens
    memory = open_memory(path, encoder=encoder, encoder_dtype=encoder_dtype, encoder_backend=encoder_backend,
                         preset=preset, dim=dim, backend=backend, batching=batching, max_batch=max_batch,
                         max_wait_ms=max_wait_ms, max_queue=max_queue, timeout=timeout, cache_size=cache_size,
                         pipeline=pipeline, encoder_workers=encoder_workers)
    try:
        app = create_app(memory, api_key=key, close_memory=True, no_auth=no_auth, max_body_bytes=max_body_bytes,
                         fast_path=fast_path)
    except BaseException:
        memory.close()
        raise
    if no_auth:
        print(f"rfmem serve: WARNING: authentication is OFF (--no-auth): anyone who can reach "
              f"{host}:{port} can read and change every user's memories", file=sys.stderr, flush=True)
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log, **uvicorn_speedups())


def uvicorn_speedups() -> dict[str, str]:
    """uvicorn's ``http`` / ``loop`` options: "httptools" / "uvloop" where importable
    (the C HTTP parser and event loop; uvicorn's "auto" picks the same, this makes it
    explicit and visible), else "h11" / "asyncio"."""
    out = {}
    for opt, mod, fallback in (("http", "httptools", "h11"), ("loop", "uvloop", "asyncio")):
        try:
            __import__(mod)
            out[opt] = mod
        except ImportError:
            out[opt] = fallback
    return out


def _resolve_api_key(api_key: str | None, no_auth: bool) -> str | None:
    """The admin key from ``api_key`` or ``$RFMEM_API_KEY``, checked before anything opens.

    Raises:
        ValueError: an empty / blank key from either source (auth is never silently
            off), no key without ``no_auth``, or a key with ``no_auth``.
    """
    source = "--api-key"
    if api_key is None and API_KEY_ENV in os.environ:
        api_key, source = os.environ[API_KEY_ENV], f"${API_KEY_ENV}"
    if api_key is not None and not api_key.strip():
        hint = (f"unset {API_KEY_ENV} to serve without auth (--no-auth)" if source.startswith("$")
                else "or --no-auth to serve without auth")
        raise ValueError(f"{source} is empty: give a non-empty admin token, {hint}")
    if api_key is None and not no_auth:
        raise ValueError(f"no admin token: pass --api-key or set ${API_KEY_ENV}, "
                         "or --no-auth to serve without authentication")
    if api_key is not None and no_auth:
        raise ValueError(f"--no-auth contradicts the admin token given by {source}: pick one")
    return api_key
