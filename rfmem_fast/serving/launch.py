"""Opening the durable Memory a server serves: :func:`open_memory`, shared by ``rfmem serve``
(:func:`rfmem_fast.serving.app.serve`) and ``rfmem mcp`` (:mod:`rfmem_fast.serving.cli`).

Below both the HTTP app and the command line, so that neither imports the other.
"""
from __future__ import annotations

from typing import Any

from ..config import RFMemConfig
from ..encoders import TextEncoder, check_backend
from ..models import recommended_alias
from .memory import ENCODE_BATCH_SIZE, Memory, default_encoder_workers, encoder_threads, usable_cores

__all__ = ["open_memory", "resolve_encoder_workers"]


def resolve_encoder_workers(encoder_workers: int | str, encoder: str, batching: bool, pipeline: bool) -> int:
    """The encoder workers a server runs: ``encoder_workers`` itself, or for "auto"
    :func:`rfmem_fast.serving.memory.default_encoder_workers` (max(1, cores // 4)) with a text
    encoder, batching and the pipeline, else 1.

    Raises:
        ValueError: not an int >= 1 or "auto"; more than 1 with ``encoder`` "none",
            without batching or without the pipeline.
    """
    if encoder_workers == "auto":
        return default_encoder_workers() if encoder != "none" and batching and pipeline else 1
    if isinstance(encoder_workers, bool) or not isinstance(encoder_workers, int) or encoder_workers < 1:
        raise ValueError(f"encoder_workers must be an int >= 1 or 'auto', got {encoder_workers!r}")
    if encoder_workers > 1:
        why = ("--encoder none (no text encoder)" if encoder == "none" else "--no-batching" if not batching
               else "--no-pipeline" if not pipeline else None)
        if why:
            raise ValueError(f"encoder_workers={encoder_workers} does not go with {why}: "
                             "the workers are the pipeline's encode stage")
    return encoder_workers


def open_memory(
    path: str,
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
    timeout: float | None = 30.0,
    cache_size: int = 4096,
    pipeline: bool = True,
    encoder_workers: int | str = "auto",
    load_encoder: bool = True,
    second_stage: str = "default",
) -> Any:
    """Open (or create) the durable :class:`~rfmem_fast.serving.Memory` a server serves,
    its encoder loaded before the first request (or, with ``load_encoder=False``, by the
    caller: ``rfmem mcp`` loads it on a thread beside its server).

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
        preset: "recommended" (default: ``RFMemConfig.recommended(alias)``, hybrid dense
            + BM25 over the stored texts, docs "Hybrid retrieval"; ``alias`` "mpnet" for
            an MPNet model directory, else "minilm": :func:`rfmem_fast.models.recommended_alias`;
            with encoder "none" every query is a vector and gets the dense top-k) or
            "paper" (``RFMemConfig.paper()``: the authors' RF-Mem, dense only). The
            preset is not stored in ``path``: each start searches with the one given.
        dim: vector dimension of a new vectors-only memory.
        second_stage: "default" (the preset's: ``recommended()``'s shipped stage for
            MiniLM / MPNet, none for "paper"), "none" (the first stage only), or a
            value of ``RFMemConfig.second_stage`` ("builtin:minilm", or a model file of
            ``rfmem tune second-stage --model-out``), checked when the memory opens.
        backend, batching, max_batch, max_wait_ms, max_queue, timeout, cache_size, pipeline:
            as :class:`rfmem_fast.Memory`.
        encoder_workers: micro-batches encoded at once, each by its own encoder (int
            >= 1, or "auto": :func:`resolve_encoder_workers`); with a model directory,
            that many :class:`~rfmem_fast.encoders.TextEncoder` are loaded, each with
            :func:`rfmem_fast.serving.memory.encoder_threads` threads.
        load_encoder: True (default): the default encoder is loaded here, before this
            returns (``rfmem serve``: the server listens only once it is ready); False:
            it is not (the Memory loads it on first use, or the caller does, e.g.
            :class:`rfmem_fast.serving.mcp_server.EncoderLoad`). A model directory's
            encoders are built here either way: their dimension sizes the memory.

    Returns:
        the open Memory (the caller closes it).

    Raises:
        ValueError: a bad dtype, option, or a directory that is not a Memory; an unknown
            builtin second stage or a corrupt stage file.
        TypeError: ``second_stage`` not a str.
        FileNotFoundError: an encoder directory or a second-stage file that does not exist.
        rfmem_fast.serving.memory.MemoryLockedError: the directory is open in another process.
    """
    if preset not in ("paper", "recommended"):
        raise ValueError(f"preset must be 'paper' or 'recommended', got {preset!r}")
    config = RFMemConfig.recommended(recommended_alias(encoder)) if preset == "recommended" else RFMemConfig.paper()
    if not isinstance(second_stage, str) or not second_stage:
        raise TypeError(f"second_stage must be 'default', 'none', 'builtin:<name>' or a file path, got {second_stage!r}")
    if second_stage != "default":
        config = config.replace(second_stage=None if second_stage == "none" else second_stage)
    check_backend(encoder_backend, encoder_dtype, "encoder_backend", "encoder_dtype")
    workers = resolve_encoder_workers(encoder_workers, encoder, batching, pipeline)
    dtype: str | None = encoder_dtype
    enc_backend: str | None = encoder_backend
    if encoder == "none":
        enc: Any = False
        dtype = enc_backend = None
    elif encoder == "default":
        enc = None
    else:
        threads = encoder_threads(workers, usable_cores()) if workers > 1 else None
        enc = [TextEncoder(encoder, batch_size=ENCODE_BATCH_SIZE, show_progress=False, dtype=encoder_dtype,
                           backend=encoder_backend, num_threads=threads) for _ in range(workers)]
        dtype = enc_backend = None
    memory = Memory(path, encoder=enc, config=config, encoder_dtype=dtype, encoder_backend=enc_backend, backend=backend, dim=dim, batching=batching,
                    max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue, timeout=timeout,
                    cache_size=cache_size, pipeline=pipeline, encoder_workers=workers)
    if enc is not False and load_encoder:
        try:
            memory.encoder  # load the model now, not on the first request
        except BaseException:
            memory.close()
            raise
    return memory
