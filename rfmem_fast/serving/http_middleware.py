"""The HTTP service's Prometheus metrics (:class:`_Metrics`, the memory's counters read at
scrape time) and the ASGI middleware in front of its routes: request counts and latency
per route template, the request-body limit (413), and routing on the raw path with each
segment decoded on its own (an id may hold ``/``; :func:`_segment` gives the routed id
back, checked).
"""
from __future__ import annotations

import time
from typing import Any, Iterator
from urllib.parse import unquote, unquote_to_bytes

import orjson
from fastapi import HTTPException
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .memory import BatchEvent, Hits, Memory
from .validate import _canon_id


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
