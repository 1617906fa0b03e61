"""Serving layer: the text facade :class:`Memory`, request micro-batching, the hot-query
cache, the write-ahead log, (with the ``serve`` extra) the HTTP service and (with the
``mcp`` extra) the Model Context Protocol server :mod:`rfmem_fast.serving.mcp_server`.

Everything here calls :func:`rfmem_fast.search` and :class:`rfmem_fast.MemoryBank`
only, never a backend's internals. ``rfmem_fast.serving.app`` and its ``http_*`` modules
(FastAPI) are imported only by ``rfmem serve`` / :func:`rfmem_fast.serving.app.create_app`, the mcp SDK only by
``rfmem mcp`` / :func:`rfmem_fast.serving.mcp_server.create_server`.
"""
from __future__ import annotations

from .batcher import BatcherClosedError, MicroBatcher, QueueFullError, RequestTimeoutError
from .cache import LRUCache, QueryCache
from .memory import BatchEvent, Hit, Hits, Item, Memory, MemoryLockedError
from .wal import WriteAheadLog

__all__ = [
    "BatchEvent",
    "BatcherClosedError",
    "Hit",
    "Hits",
    "Item",
    "LRUCache",
    "Memory",
    "MemoryLockedError",
    "MicroBatcher",
    "QueryCache",
    "QueueFullError",
    "RequestTimeoutError",
    "WriteAheadLog",
]
