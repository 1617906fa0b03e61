"""HTTP service over a :class:`rfmem_fast.Memory` (FastAPI + uvicorn; ``rfmem serve``).

Routes (JSON bodies validated by pydantic)::

    GET    /health                                   liveness, counts, encoder, retrieval config (no auth)
    GET    /metrics                                  Prometheus text format (no auth)
    POST   /v1/users/{user_id}/memories              {"texts": [...]} or {"vectors": [[...]]},
                                                     optional "ids", "metadata", "created_at",
                                                     "thread", "position" -> 201 {"ids"}
    GET    /v1/users/{user_id}/memories              ?offset=0&limit=100 -> {"items", "total",
                                                     "offset", "limit", "next_offset"}
    GET    /v1/users/{user_id}/memories/{item_id}    one item
    PATCH  /v1/users/{user_id}/memories/{item_id}    {"texts"?: str, "vectors"?: [...], "metadata"?,
                                                     "thread"?, "position"?} (null thread / position: clear)
    DELETE /v1/users/{user_id}/memories/{item_id}    delete one item
    POST   /v1/users/{user_id}/memories/delete       {"ids": [...]}
    DELETE /v1/users/{user_id}                       delete ALL of the user's memories ("forget me")
    POST   /v1/users/{user_id}/search                {"query": str | "vector": [...], "k"?, "mode"?, "filters"?}
    POST   /v1/users/{user_id}/search/batch          {"queries": [...] | "vectors": [[...]], "k"?, "mode"?, "filters"?}
    POST   /v1/memories:batch                        {"items": [{"user_id", "text"?, "vector"?, "id"?,
                                                     "metadata"?, "created_at"?, "thread"?,
                                                     "position"?}, ...]} -> 201 {"ids"}
    POST   /v1/memories:batchUpdate                  {"items": [{"user_id", "id", "text"?, "vector"?,
                                                     "metadata"?, "thread"?, "position"?}, ...]}
                                                     -> {"updated": n}
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

Modules: the request / response models and limits are in :mod:`rfmem_fast.serving.http_models`,
the error mapping and JSON rendering in :mod:`rfmem_fast.serving.http_responses`, the metrics
and ASGI middleware in :mod:`rfmem_fast.serving.http_middleware`, authentication in
:mod:`rfmem_fast.serving.http_auth` and the search fast path in
:mod:`rfmem_fast.serving.http_fast_search`; this module builds the app and its routes.
"""
from __future__ import annotations

import asyncio
import gc
import os
import re
import sys
from contextlib import asynccontextmanager
from typing import Annotated, Any
from urllib.parse import unquote

try:
    import orjson  # noqa: F401  (the serve extra: checked here, before the modules below import it)
    import pydantic  # noqa: F401
    from fastapi import Depends, FastAPI, HTTPException, Query
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the HTTP service needs the 'serve' extra: pip install 'rfmem_fast[serve]' "
        f"(fastapi, uvicorn, pydantic, prometheus-client, orjson); missing: {exc.name}"
    ) from exc

from .http_auth import User, Who, _admin_only, _bulk_items, _token_admin
from .http_fast_search import _App, _FastSearch
from .http_middleware import _BodyLimit, _Metrics, _MetricsMiddleware, _PathSegments, _segment
from .http_models import MAX_TEXT as MAX_TEXT
from .http_models import (MAX_PAGE, AddRequest, BatchSearchRequest, BulkAddRequest, BulkDeleteRequest,
                          BulkUpdateRequest, DeleteRequest, ItemOut, ItemPage, ItemSeg, MintRequest, SearchRequest,
                          SearchResponse, UpdateRequest)
from .http_responses import FastJSONResponse, _bulk_errors, _http_errors, _search_json, _validation_error
from .memory import MAX_K as MAX_K
from .memory import MAX_ID_LENGTH, Memory
from .tokens import TOKENS_FILE, TokenStore
from .validate import _canon_id

__all__ = ["create_app", "serve", "uvicorn_speedups", "API_KEY_ENV", "DEFAULT_MAX_BODY_BYTES"]

#: environment variable read for the admin bearer token when no api_key is given
API_KEY_ENV = "RFMEM_API_KEY"
#: default limit of a request body (bytes): ``rfmem serve --max-body-bytes``
DEFAULT_MAX_BODY_BYTES = 4 << 20
#: ``thread[0]`` / ``position[0]`` in a message of Memory.update about the one item of a PATCH
_ONE_ITEM_FIELD = re.compile(r"\b(thread|position)\[0\]")


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
                             created_at=body.created_at, thread=body.thread, position=body.position)
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
        sent = body.model_fields_set  # an explicit null thread / position clears it, a field left out keeps it
        conv = {k: [None] if getattr(body, k) is None else getattr(body, k) for k in ("thread", "position") if k in sent}
        with _http_errors():
            try:
                memory.update(item_id, user, texts=body.texts, vectors=body.vectors, metadata=body.metadata, **conv)
            except ValueError as e:  # a cleared thread / position was sent to Memory.update as [None]: the field's name
                raise ValueError(_ONE_ITEM_FIELD.sub(r"\1", str(e))) from None
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
    second_stage: str = "default",
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
        second_stage: :func:`~rfmem_fast.serving.launch.open_memory`'s (``--second-stage``).
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
                         pipeline=pipeline, encoder_workers=encoder_workers, second_stage=second_stage)
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
