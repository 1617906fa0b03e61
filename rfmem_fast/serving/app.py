"""HTTP service over a :class:`rfmem_fast.Memory` (FastAPI + uvicorn; ``rfmem serve``).

Routes (JSON bodies validated by pydantic; every ``/v1`` route needs
``Authorization: Bearer <key>`` when an API key is set)::

    GET    /health                                   liveness, counts (no auth)
    GET    /metrics                                  Prometheus text format (no auth)
    POST   /v1/users/{user_id:path}/memories              {"texts": [...]} or {"vectors": [[...]]},
                                                     optional "ids", "metadata" -> 201 {"ids"}
    GET    /v1/users/{user_id:path}/memories              every item of the user
    GET    /v1/users/{user_id:path}/memories/{item_id}    one item
    PATCH  /v1/users/{user_id:path}/memories/{item_id}    {"text"?, "vector"?, "metadata"?}
    DELETE /v1/users/{user_id:path}/memories/{item_id}    delete one item
    POST   /v1/users/{user_id:path}/memories/delete       {"ids": [...]}
    POST   /v1/users/{user_id:path}/search                {"query": str | "vector": [...], "k"?, "mode"?}
    POST   /v1/users/{user_id:path}/search/batch          {"queries": [...] | "vectors": [[...]], "k"?, "mode"?}
    POST   /v1/checkpoint                            fold the write-ahead log into the store

User scope: every request names ONE user in its path and reads or writes only that
user's memories (the engine searches within the user's own segment). User and item
ids are strings, percent-encoded in the path (a user id may contain ``/``).

Errors: a malformed body gets 422 with pydantic's list of errors (each naming the
field by its ``loc``); a value the memory refuses (wrong dimension, duplicate id, ...)
400 with a message naming the argument; an unknown user / item 404; a missing or
wrong bearer token 401; a full search queue 503 (with ``Retry-After``); a search that
waited past its timeout 504. A write is acknowledged (2xx) only after it is in the
fsynced write-ahead log.

Metrics (``/metrics``): ``rfmem_http_requests_total{method,route,status}``,
``rfmem_http_request_duration_seconds{method,route}`` (histogram),
``rfmem_search_queries_total{mode,route,rule,cached}`` (route distribution per rule),
``rfmem_batch_size`` / ``rfmem_encode_seconds`` / ``rfmem_search_seconds`` (histograms
per batched run), ``rfmem_cache_hit_ratio{cache}`` with hit / miss counters,
``rfmem_queue_depth``, ``rfmem_items``, ``rfmem_users``, ``rfmem_writes_total``,
``rfmem_wal_bytes``, ``rfmem_encoder_info{model,dtype,device}`` (the encoder's precision;
also in ``/health``).
"""
from __future__ import annotations

import asyncio
import os
import secrets
import time
from contextlib import asynccontextmanager, contextmanager
from typing import Annotated, Any, Iterator, Literal, Union

try:
    import orjson
    from fastapi import Depends, FastAPI, HTTPException, Path, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the HTTP service needs the 'serve' extra: pip install 'rfmem_fast[serve]' "
        f"(fastapi, uvicorn, pydantic, prometheus-client, orjson); missing: {exc.name}"
    ) from exc

from .batcher import BatcherClosedError, QueueFullError, RequestTimeoutError
from .memory import BatchEvent, Hits, Memory

__all__ = ["create_app", "serve", "API_KEY_ENV"]

#: environment variable read for the bearer token when no api_key is given
API_KEY_ENV = "RFMEM_API_KEY"
MAX_ITEMS = 1024  # items per add / delete request
MAX_QUERIES = 1024  # queries per batch search
MAX_TEXT = 100_000  # characters per text
MAX_DIM = 65_536
MAX_K = 1000

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
ItemId = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Vector = Annotated[list[Finite], Field(min_length=1, max_length=MAX_DIM)]
Meta = dict[str, Any]
UserId = Annotated[str, Path(min_length=1, max_length=256, description="the user whose memory is used")]
ItemPath = Annotated[str, Path(min_length=1, max_length=256, description="an item id of that user")]
Mode = Literal["rfmem", "dense", "recollection"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not ignored


class AddRequest(_Body):
    """Items to add: texts (encoded by the server) and / or vectors, optional ids / metadata."""

    texts: list[Text] | None = Field(None, min_length=1, max_length=MAX_ITEMS)
    vectors: list[Vector] | None = Field(None, min_length=1, max_length=MAX_ITEMS)
    ids: list[ItemId] | None = Field(None, min_length=1, max_length=MAX_ITEMS)
    metadata: Union[Meta, list[Meta | None], None] = None

    @model_validator(mode="after")
    def _lengths(self) -> "AddRequest":
        if self.texts is None and self.vectors is None:
            raise ValueError("texts or vectors is required")
        m = len(self.texts) if self.texts is not None else len(self.vectors)
        for name, val in (("vectors", self.vectors), ("ids", self.ids),
                          ("metadata", self.metadata if isinstance(self.metadata, list) else None)):
            if val is not None and len(val) != m:
                raise ValueError(f"{name} has {len(val)} entries but there are {m} items")
        return self


class UpdateRequest(_Body):
    """New text (re-encoded), vector and / or metadata of one item."""

    text: Text | None = None
    vector: Vector | None = None
    metadata: Meta | None = None

    @model_validator(mode="after")
    def _something(self) -> "UpdateRequest":
        if self.text is None and self.vector is None and self.metadata is None:
            raise ValueError("text, vector or metadata is required")
        return self


class DeleteRequest(_Body):
    """Item ids to delete."""

    ids: list[ItemId] = Field(min_length=1, max_length=MAX_ITEMS)


class SearchRequest(_Body):
    """One query: a text or a vector, the number of hits k, the mode."""

    query: Text | None = None
    vector: Vector | None = None
    k: int | None = Field(None, ge=1, le=MAX_K)
    mode: Mode = "rfmem"

    @model_validator(mode="after")
    def _one(self) -> "SearchRequest":
        if (self.query is None) == (self.vector is None):
            raise ValueError("exactly one of query and vector is required")
        return self


class BatchSearchRequest(_Body):
    """Many queries of one user: texts or vectors, with one k and mode."""

    queries: list[Text] | None = Field(None, min_length=1, max_length=MAX_QUERIES)
    vectors: list[Vector] | None = Field(None, min_length=1, max_length=MAX_QUERIES)
    k: int | None = Field(None, ge=1, le=MAX_K)
    mode: Mode = "rfmem"

    @model_validator(mode="after")
    def _one(self) -> "BatchSearchRequest":
        if (self.queries is None) == (self.vectors is None):
            raise ValueError("exactly one of queries and vectors is required")
        return self


class HitOut(BaseModel):
    """One hit of a search."""

    id: Union[str, int]
    text: str | None
    score: float
    metadata: Meta
    rank: int


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
    """A stored item."""

    id: Union[str, int]
    text: str | None
    metadata: Meta


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
    except (ValueError, TypeError) as e:
        raise HTTPException(400, str(e)) from None


class FastJSONResponse(JSONResponse):
    """A JSON response serialised by orjson (~15x faster than the standard library on a
    search answer: 3 us instead of 44 us); falls back to the standard library for what
    orjson refuses (an int beyond 64 bits in metadata)."""

    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content)
        except orjson.JSONEncodeError:
            return super().render(content)


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with pydantic's errors (type, loc naming the field, msg), without echoing the
    input: a NaN in it cannot be written as JSON, and a vector would be echoed whole."""
    errors = [{"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
    return FastJSONResponse({"detail": errors}, status_code=422)


def _search_json(hits: Hits) -> dict[str, Any]:
    return {
        "user_id": str(hits.user_id), "route": hits.route, "rule": hits.rule, "mean": hits.mean,
        "entropy": hits.entropy, "rounds": hits.rounds, "cached": hits.cached,
        "hits": [{"id": h.id, "text": h.text, "score": h.score, "metadata": h.metadata, "rank": h.rank} for h in hits],
    }


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
        self.queries.labels(mode, hits.route or "none", hits.rule, "true" if hits.cached else "false").inc()


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
        enc = st["encoder"]
        if enc is not None:
            info = GaugeMetricFamily("rfmem_encoder_info", "the text encoder (value 1): model, precision, device",
                                     labels=["model", "dtype", "device"])
            info.add_metric([enc["model"], str(enc["dtype"]), str(enc["device"])], 1)
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


def create_app(memory: Memory, api_key: str | None = None, close_memory: bool = False) -> FastAPI:
    """The FastAPI app serving ``memory`` (routes, errors and metrics: module docstring).

    Args:
        memory: the Memory to serve (its micro-batching settings apply).
        api_key: bearer token required on every ``/v1`` route (None: no auth).
        close_memory: close (and so checkpoint) the memory when the app shuts down.

    Returns:
        FastAPI application (run it with uvicorn, or test it with TestClient).

    Raises:
        TypeError: ``memory`` is not a Memory; ValueError: an empty ``api_key``.
    """
    if not isinstance(memory, Memory):
        raise TypeError(f"memory must be a rfmem_fast.Memory, got {type(memory).__name__}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty str or None")
    metrics = _Metrics(memory)
    key = api_key.encode() if api_key else None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> Any:
        yield
        if close_memory:
            await asyncio.to_thread(memory.close)

    async def auth(request: Request) -> None:  # async: no hop to the thread pool per request
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key):
            raise HTTPException(401, "missing or invalid bearer token (Authorization: Bearer <key>)",
                                headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title="rfmem_fast", summary="RF-Mem memory retrieval service", lifespan=lifespan,
                  default_response_class=FastJSONResponse)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(_MetricsMiddleware, metrics=metrics)
    app.state.memory = memory
    app.state.metrics = metrics
    v1 = [Depends(auth)] if key is not None else []

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "users": memory.bank.num_users, "items": memory.bank.num_items,
                "batching": memory.batching, "encoder": memory.encoder_info()}

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/users/{user_id:path}/memories", status_code=201, dependencies=v1)
    def add(user_id: UserId, body: AddRequest) -> FastJSONResponse:
        with _http_errors():
            ids = memory.add(body.texts, user_id, ids=body.ids, metadata=body.metadata, vectors=body.vectors)
        return FastJSONResponse({"ids": ids}, status_code=201)

    @app.get("/v1/users/{user_id:path}/memories", dependencies=v1, response_model=list[ItemOut])
    def list_items(user_id: UserId) -> FastJSONResponse:
        with _http_errors():
            items = memory.get_all(user_id)
        return FastJSONResponse([it.to_dict() for it in items])

    @app.get("/v1/users/{user_id:path}/memories/{item_id:path}", dependencies=v1, response_model=ItemOut)
    def get_item(user_id: UserId, item_id: ItemPath) -> FastJSONResponse:
        with _http_errors():
            item = memory.get(item_id, user_id)[0]
        return FastJSONResponse(item.to_dict())

    @app.patch("/v1/users/{user_id:path}/memories/{item_id:path}", dependencies=v1)
    def update_item(user_id: UserId, item_id: ItemPath, body: UpdateRequest) -> dict[str, Any]:
        with _http_errors():
            memory.update(item_id, user_id, texts=body.text, vectors=body.vector,
                          metadata=body.metadata)
        return {"updated": [item_id]}

    @app.delete("/v1/users/{user_id:path}/memories/{item_id:path}", dependencies=v1)
    def delete_item(user_id: UserId, item_id: ItemPath) -> dict[str, Any]:
        with _http_errors():
            memory.delete(item_id, user_id)
        return {"deleted": [item_id]}

    @app.post("/v1/users/{user_id:path}/memories/delete", dependencies=v1)
    def delete_items(user_id: UserId, body: DeleteRequest) -> dict[str, Any]:
        with _http_errors():
            memory.delete(body.ids, user_id)
        return {"deleted": body.ids}

    @app.post("/v1/users/{user_id:path}/search", dependencies=v1, response_model=SearchResponse)
    async def search(user_id: UserId, body: SearchRequest) -> FastJSONResponse:
        query = body.query if body.query is not None else body.vector
        with _http_errors():
            hits = await memory.asearch(query, user_id, k=body.k, mode=body.mode)
        metrics.count(body.mode, hits)
        return FastJSONResponse(_search_json(hits))

    @app.post("/v1/users/{user_id:path}/search/batch", dependencies=v1)
    async def search_batch(user_id: UserId, body: BatchSearchRequest) -> FastJSONResponse:
        queries = body.queries if body.queries is not None else body.vectors
        with _http_errors():
            results = await asyncio.to_thread(memory.search_batch, queries, user_id, body.k, body.mode)
        for hits in results:
            metrics.count(body.mode, hits)
        return FastJSONResponse({"results": [_search_json(h) for h in results]})

    @app.post("/v1/checkpoint", dependencies=v1)
    def checkpoint() -> dict[str, Any]:
        with _http_errors():
            memory.save()
        return {"checkpointed": True, "items": memory.bank.num_items}

    return app


def serve(
    path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    encoder: str = "default",
    encoder_dtype: str = "auto",
    encoder_backend: str = "auto",
    dim: int | None = None,
    backend: str = "auto",
    batching: bool = True,
    max_batch: int = 64,
    max_wait_ms: float = 2.0,
    max_queue: int = 1024,
    timeout: float = 30.0,
    cache_size: int = 4096,
    log_level: str = "info",
    access_log: bool = False,
) -> None:
    """Open the memory at ``path`` and serve it with uvicorn until SIGINT / SIGTERM.

    Args:
        path: the Memory directory (created if absent).
        host, port: where to listen.
        api_key: bearer token (default: the ``RFMEM_API_KEY`` environment variable;
            neither: no auth).
        encoder: "default" (the offline all-MiniLM-L6-v2, loaded before the server
            listens), "none" (vectors only) or a local sentence-transformers directory.
        encoder_dtype: precision of the text encoder (:func:`rfmem_fast.encoders.resolve_dtype`):
            "auto" (default: bfloat16 where the CPU has native bfloat16 matmul, e.g.
            AVX512-BF16 / AMX, float32 elsewhere), "float32", "bfloat16" or "float16".
            Shown in ``/health`` and ``/metrics`` (``rfmem_encoder_info``). "int8" with an
            ``encoder_backend`` of "onnx" / "auto" only.
        encoder_backend: runtime of the text encoder (:func:`rfmem_fast.encoders.resolve_backend`):
            "auto" (default: ONNX Runtime float32 where onnxruntime / onnx are installed,
            torch elsewhere), "torch" or "onnx".
        dim: vector dimension of a new vectors-only memory.
        backend, batching, max_batch, max_wait_ms, max_queue, timeout, cache_size:
            as :class:`rfmem_fast.Memory`.
        log_level, access_log: uvicorn's logging.

    On shutdown the memory is closed (checkpointed); a killed server replays its
    write-ahead log on the next start.
    """
    import uvicorn

    from ..encoders import check_backend

    check_backend(encoder_backend, encoder_dtype, "encoder_backend", "encoder_dtype")
    dtype: str | None = encoder_dtype
    enc_backend: str | None = encoder_backend
    if encoder == "none":
        enc: Any = False
        dtype = enc_backend = None
    elif encoder == "default":
        enc = None
    else:
        from ..encoders import TextEncoder
        from .memory import ENCODE_BATCH_SIZE

        enc = TextEncoder(encoder, batch_size=ENCODE_BATCH_SIZE, show_progress=False, dtype=encoder_dtype,
                          backend=encoder_backend)
        dtype = enc_backend = None
    memory = Memory(path, encoder=enc, encoder_dtype=dtype, encoder_backend=enc_backend, backend=backend, dim=dim,
                    batching=batching,
                    max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue, timeout=timeout,
                    cache_size=cache_size)
    if enc is not False:
        memory.encoder  # load the model now, not on the first request
    key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    app = create_app(memory, api_key=key, close_memory=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log)
