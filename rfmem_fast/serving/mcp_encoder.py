"""The text encoder of the Memory behind ``rfmem mcp``, loaded on a thread beside the server
(:class:`EncoderLoad`), so that the server answers the MCP handshake at once and only the
tools that embed text wait for the load.
"""
from __future__ import annotations

import sys
import threading
import time

from .mcp_sdk import ToolError, anyio
from .memory import Memory


class EncoderLoad:
    """A Memory's text encoder, loaded on a thread of its own beside the server, so that
    the server answers the MCP handshake at once instead of after the model load (~5-10 s
    of CPU: sentence-transformers, the model, the ONNX session).

    Args:
        memory: an open Memory; a vectors-only one, or one whose encoder is loaded
            already, needs no load (:attr:`done` at once).
        start: start the load now (default); False: at :meth:`start` (``create_server``
            starts it once its tools are registered, which takes a second of Python
            that a load beside it would slow down).

    The load is ``memory.encoder`` (:meth:`rfmem_fast.serving.Memory.encoder`) on a daemon
    thread named "rfmem-encoder-load"; an exception there is kept in :attr:`error` and
    printed to stderr (stdout belongs to the protocol on stdio), never raised on the thread.
    """

    def __init__(self, memory: Memory, start: bool = True) -> None:
        self._memory = memory
        self._done = threading.Event()
        #: the exception the load raised (None: loaded, still loading, or nothing to load)
        self.error: BaseException | None = None
        #: seconds the load took (None until it ended)
        self.seconds: float | None = None
        info = memory.encoder_info()
        self._thread: threading.Thread | None = None
        if info is None or info["loaded"]:
            self._done.set()
        elif start:
            self.start()

    def start(self) -> None:
        """Start the load on its thread (once; nothing when there is nothing to load)."""
        if self._thread is not None or self._done.is_set():
            return
        self._thread = threading.Thread(target=self._load, name="rfmem-encoder-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            self._memory.encoder  # noqa: B018 - loads the default encoder(s)
        except BaseException as exc:  # kept for the tools; the thread ends quietly
            self.error = exc
            print(f"rfmem mcp: error: the text encoder could not be loaded: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    @property
    def done(self) -> bool:
        """Whether the load has ended (loaded, failed, or nothing to load)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the load has ended or ``timeout`` seconds passed; returns :attr:`done`
        (False at once for a load never started)."""
        if self._thread is None and not self._done.is_set():
            return False
        return self._done.wait(timeout)

    async def ready(self) -> None:
        """Wait, without blocking the event loop, until the encoder is loaded.

        Raises:
            ToolError: the load failed (the message names the exception; the tools that
                do not embed text still work).
        """
        while not self._done.is_set():
            await anyio.sleep(0.02)
        if self.error is not None:
            raise ToolError(
                f"the text encoder could not be loaded ({type(self.error).__name__}: {self.error}), so texts cannot "
                "be embedded; list_memories, get_memory and delete_memory still work. Fix the encoder options of "
                "rfmem mcp (--encoder, --encoder-backend, --encoder-dtype) and restart it")
