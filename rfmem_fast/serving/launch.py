"""Opening the durable Memory a server serves: :func:`open_memory`, shared by ``rfmem serve``
(:func:`rfmem_fast.serving.app.serve`) and ``rfmem mcp`` (:mod:`rfmem_fast.serving.cli`).

Below both the HTTP app and the command line, so that neither imports the other.
"""
from __future__ import annotations

from typing import Any

from ..config import RFMemConfig
from ..encoders import TextEncoder, check_backend
from .memory import ENCODE_BATCH_SIZE, Memory

__all__ = ["open_memory"]


def open_memory(
    path: str,
    encoder: str = "default",
    encoder_dtype: str = "auto",
    encoder_backend: str = "auto",
    preset: str = "paper",
    dim: int | None = None,
    backend: str = "auto",
    batching: bool = True,
    max_batch: int = 64,
    max_wait_ms: float = 2.0,
    max_queue: int = 1024,
    timeout: float | None = 30.0,
    cache_size: int = 4096,
) -> Any:
    """Open (or create) the durable :class:`~rfmem_fast.serving.Memory` a server serves,
    its encoder loaded before the first request.

    The Memory has a write-ahead log in ``path`` (fsynced per write), so a write is
    acknowledged only once it is durable. The encoder options mean what they mean for
    ``rfmem serve`` (:func:`rfmem_fast.serving.app.serve` opens its Memory with this
    function) and ``rfmem mcp`` (:mod:`rfmem_fast.serving.cli` parses them).

    Args:
        path: the Memory directory (created if absent).
        encoder: "default" (the offline all-MiniLM-L6-v2), "none" (vectors only) or a
            local sentence-transformers directory.
        encoder_dtype: "auto" | "float32" | "bfloat16" | "float16" | "int8"
            (:func:`rfmem_fast.encoders.resolve_dtype`; "int8" with an ONNX backend only);
            ignored with encoder "none".
        encoder_backend: "auto" | "torch" | "onnx" (:func:`rfmem_fast.encoders.resolve_backend`);
            ignored with encoder "none".
        preset: "paper" (``RFMemConfig.paper()``, dense) or "recommended"
            (``RFMemConfig.recommended()``: hybrid dense + BM25, docs "Hybrid retrieval").
        dim: vector dimension of a new vectors-only memory.
        backend, batching, max_batch, max_wait_ms, max_queue, timeout, cache_size:
            as :class:`rfmem_fast.Memory`.

    Returns:
        the open Memory (the caller closes it).

    Raises:
        ValueError: a bad dtype, option, or a directory that is not a Memory.
        FileNotFoundError: an encoder directory that does not exist.
        rfmem_fast.serving.memory.MemoryLockedError: the directory is open in another process.
    """
    if preset not in ("paper", "recommended"):
        raise ValueError(f"preset must be 'paper' or 'recommended', got {preset!r}")
    config = RFMemConfig.recommended() if preset == "recommended" else RFMemConfig.paper()
    check_backend(encoder_backend, encoder_dtype, "encoder_backend", "encoder_dtype")
    dtype: str | None = encoder_dtype
    enc_backend: str | None = encoder_backend
    if encoder == "none":
        enc: Any = False
        dtype = enc_backend = None
    elif encoder == "default":
        enc = None
    else:
        enc = TextEncoder(encoder, batch_size=ENCODE_BATCH_SIZE, show_progress=False, dtype=encoder_dtype,
                          backend=encoder_backend)
        dtype = enc_backend = None
    memory = Memory(path, encoder=enc, config=config, encoder_dtype=dtype, encoder_backend=enc_backend, backend=backend, dim=dim, batching=batching,
                    max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue, timeout=timeout,
                    cache_size=cache_size)
    if enc is not False:
        try:
            memory.encoder  # load the model now, not on the first request
        except BaseException:
            memory.close()
            raise
    return memory
