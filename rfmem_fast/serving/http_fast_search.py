"""The fast path of ``POST /v1/users/{user_id}/search`` (:class:`_FastSearch`): a
well-formed text query answered in front of FastAPI, with the full route's answers,
errors and metrics; and the app class (``_App``) that puts it there.
"""
from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import unquote_to_bytes

import orjson
from fastapi import FastAPI, HTTPException

from .http_auth import _may_access, _principal_of
from .http_middleware import _Metrics
from .http_models import MAX_TEXT
from .http_responses import _dumps, _http_errors, _search_doc
from .memory import Memory
from .tokens import TokenStore
from .validate import MAX_K, _canon_id


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
