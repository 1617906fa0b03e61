"""``rfmem serve``: the HTTP service (arguments here; the app in :mod:`rfmem_fast.serving.app`)."""
from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``rfmem`` sub-command parser."""
    p = subparsers.add_parser(
        "serve",
        help="serve a memory over HTTP (FastAPI + uvicorn; needs the 'serve' extra)",
        description="Serve a rfmem_fast.Memory over HTTP: add / search / update / delete per user, "
        "/health, /metrics. Writes are durable (write-ahead log) once acknowledged.",
    )
    p.add_argument("--path", required=True, help="memory directory (created if absent)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="bearer token required on /v1 routes (default: $RFMEM_API_KEY; neither: no auth)")
    p.add_argument("--encoder", default="default",
                   help="'default' (offline all-MiniLM-L6-v2), 'none' (vectors only) or a local model directory")
    p.add_argument("--dim", type=int, default=None, help="vector dimension of a new vectors-only memory")
    p.add_argument("--backend", default="auto", help="search backend (default auto)")
    p.add_argument("--no-batching", action="store_true", help="one search call per request (no micro-batching)")
    p.add_argument("--max-batch", type=int, default=64, help="most queries per micro-batch (default 64)")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="how long a micro-batch waits to fill (default 2 ms)")
    p.add_argument("--max-queue", type=int, default=1024, help="most searches waiting before 503 (default 1024)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a search may wait before 504 (default 30)")
    p.add_argument("--cache-size", type=int, default=4096, help="hot-query cache entries (0 disables; default 4096)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the server from parsed arguments; returns the exit code."""
    try:
        from .app import serve
    except ImportError as exc:
        print(f"rfmem serve: {exc}", file=sys.stderr)
        return 2
    try:
        serve(
            args.path, host=args.host, port=args.port, api_key=args.api_key, encoder=args.encoder, dim=args.dim,
            backend=args.backend, batching=not args.no_batching, max_batch=args.max_batch,
            max_wait_ms=args.max_wait_ms, max_queue=args.max_queue, timeout=args.timeout,
            cache_size=args.cache_size, log_level=args.log_level, access_log=args.access_log,
        )
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"rfmem serve: error: {exc}", file=sys.stderr)
        return 2
    return 0
