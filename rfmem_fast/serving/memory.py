"""``rfmem_fast.Memory``: text in, RF-Mem hits out, for serving stacks.

A thread-safe facade over one :class:`~rfmem_fast.MemoryBank` and
:func:`~rfmem_fast.search` (RFMEM_SPEC.md sections 1-5), with the names mem0 /
LangChain users expect::

    from rfmem_fast import Memory
    mem = Memory("mem_dir")                       # opens (or creates) a durable memory
    ids = mem.add(["I moved to Lyon in 2021", "My sister is called Ana"], user_id="u1",
                  metadata={"source": "chat"})
    hits = mem.search("where do I live?", user_id="u1", k=5)
    hits[0].text, hits[0].score, hits[0].metadata, hits.route, hits.rule, hits.mean
    mem.add_many([{"user_id": "u2", "text": "I play chess"},          # many users, one write,
                  {"user_id": "u3", "text": "I like tea", "id": "t1"}])  # all or nothing
    mem.add(["hi, I'm planning a trip", "to Japan, in May"], user_id="u1",
            thread="chat-7", position=[0, 1])         # turns of a conversation
    mem.close()                                   # checkpoint; or use `with Memory(...)`

What it adds to the engine
--------------------------
* Text: queries and items are encoded by ``encoder`` (default: the offline
  all-MiniLM-L6-v2 :class:`~rfmem_fast.encoders.TextEncoder`, loaded on first use).
  Vectors may be passed instead (``add(vectors=...)``, a 1-D vector as the query) by
  stacks that embed elsewhere; ``encoder=False`` makes a vectors-only memory.
* Retrieval: by default ``RFMemConfig.recommended()`` for the encoder (hybrid dense +
  BM25 over the items' texts, never recollecting; docs "Hybrid retrieval"), where the
  vector-level engine (``RFMemConfig()``, :func:`~rfmem_fast.search`) keeps the paper's
  RF-Mem: ``Memory(config=RFMemConfig.paper())`` searches as the paper. A vector query
  (no text) gets the dense top-k.
* Micro-batching (:mod:`rfmem_fast.serving.batcher`): concurrent :meth:`Memory.search`
  (threads) and :meth:`Memory.asearch` (asyncio) calls are gathered for at most
  ``max_wait_ms`` or ``max_batch`` queries and run as ONE batched encode and one batched
  :func:`~rfmem_fast.search` per (mode, k) in the batch. The engine is batch-invariant
  (a query's result never depends on the batch it shares), so each caller gets exactly
  the result of an unbatched call with the same query vector. Text queries are
  embedded in a batch; an encoder may round a text's embedding differently in a batch
  than alone (sentence-transformers: at most a few float32 ulps), which can only swap
  exact near-ties.
* Pipelining (``pipeline``, default on): a batch is encoded by an encoder worker and
  searched by the search thread, so the next batch encodes while the current one
  searches; ``encoder_workers`` encoders (each its own model, with its share of the
  cores' threads) may encode batches at once (:func:`default_encoder_workers`).
  Searches run one batch at a time, in the order the batches were taken.
* Long texts (over the encoder's window) are chunked; hits collapse to the item
  (``chunk_overlap`` in :class:`Memory`).
* Conversations: an item may carry its conversation ``thread`` and its ``position`` in
  it (:meth:`Memory.add`, every write door, the log, checkpoints, export / import);
  searches with ``RFMemConfig.context_weight`` / ``thread_weight`` > 0 rank by the
  context score (:mod:`rfmem_fast.context`, ``Hit.context_score``), and filters reach
  them as the reserved fields ``thread`` / ``position`` (docs "Conversations").
* A hot-query cache (:mod:`rfmem_fast.serving.cache`): query embeddings by text, and
  whole answers by (user, that user's write version, query, mode, k); any write to a
  user invalidates that user's answers.
* Bulk writes (:meth:`Memory.add_many`, :meth:`Memory.update_many`,
  :meth:`Memory.delete_many`): items of many users in one encoder call and one log
  record (a group), all of them or none; :meth:`Memory.export_items` reads them back in
  the same form (``rfmem export`` / ``rfmem import``, :mod:`rfmem_fast.serving.transfer`).
* Durability (``path``): each write is appended to a write-ahead log and fsynced before
  the call returns (:mod:`rfmem_fast.serving.wal`), replayed on open; :meth:`Memory.save`
  checkpoints (an atomic bank store, then the log is truncated). Layout of ``path``::

      memory.json        {"format", "format_version", "dim", "store", "wal_seq"}
      store-00000003/    the bank store of the last checkpoint (rfmem_fast.store)
      wal.jsonl          writes after it (seq > wal_seq), replayed on open
      LOCK               held (flock) by the one process that has the memory open

  A crash (even SIGKILL) at any point loses no acknowledged write: ``memory.json`` is
  replaced atomically and names a complete store plus the last log record it holds.

Consistency: writes are serialised; a search sees one bank version, and its hits'
texts and metadata come from that same version (writes wait for searches in flight,
searches for the short in-memory apply of a write, not for its fsync). Write through
the Memory only: a write made directly to :attr:`Memory.bank` bypasses the log and the
cache invalidation.

The :class:`Memory` class keeps its public methods here (each with the docstring the API
reference renders); its machinery is split by concept: :mod:`rfmem_fast.serving.hits`
(``Hit`` / ``Hits`` / ``Item``), :mod:`rfmem_fast.serving.validate` (argument checks),
:mod:`rfmem_fast.serving.encoding` (encoder workers, pooled encoding),
:mod:`rfmem_fast.serving.chunking` (long texts), :mod:`rfmem_fast.serving.bulk` (bulk
items), :mod:`rfmem_fast.serving.queries` (micro-batched search) and
:mod:`rfmem_fast.serving.durability` (the directory, the log, checkpoints); the names
they define that callers import from here are re-exported. This module is longer than
the others because the public methods' docstrings are the API reference.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import os
import queue
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import numpy as np

from ..bank import MemoryBank
from ..config import RFMemConfig
from ..lexical import CHUNK_SEP
from ..routing.files import check_config_files
from ..second_stage import resolve_stage
from ._rwlock import RWLock
from .batcher import MicroBatcher
from .bulk import ITEM_FIELDS, _BulkItems
from .cache import QueryCache
from .chunking import DEFAULT_CHUNK_OVERLAP, _Chunking
from .durability import FORMAT_NAME as FORMAT_NAME
from .durability import FORMAT_VERSION as FORMAT_VERSION
from .durability import LOCK_FILE as LOCK_FILE
from .durability import META_FILE as META_FILE
from .durability import WAL_FILE as WAL_FILE
from .durability import MemoryLockedError as MemoryLockedError
from .durability import _Durable, default_stemmer
from .encoding import CORES_PER_ENCODER_WORKER as CORES_PER_ENCODER_WORKER
from .encoding import DEFAULT_DIM, ENCODE_BATCH_SIZE, _EncoderPool, encoder_threads, usable_cores
from .encoding import default_encoder_workers as default_encoder_workers
from .hits import Hit, Hits, Item, _Answer, _utc
from .queries import BatchEvent, _Queries
from .validate import (MAX_ID_LENGTH, MAX_K, MAX_TEXT_CHARS, _canon_id, _check_pairs, _check_path, _count_error,
                       _created_list, _entry_label, _id_list, _metadata_list, _position_list, _text_list,
                       _thread_list, _user_key)
from .wal import WriteAheadLog

__all__ = ["Memory", "Hit", "Hits", "Item", "BatchEvent", "DEFAULT_DIM", "MAX_K", "MAX_ID_LENGTH", "MAX_TEXT_CHARS",
           "ITEM_FIELDS"]

log = logging.getLogger("rfmem_fast.serving")


def _default_encoder(**kwargs: Any) -> Any:
    """The default text encoder (the offline all-MiniLM-L6-v2); tests may patch this.

    ``kwargs`` go to :class:`~rfmem_fast.encoders.TextEncoder` (``dtype`` when a Memory
    was given ``encoder_dtype``, ``backend`` with ``encoder_backend``, ``num_threads``
    with more than one encoder worker)."""
    from ..encoders import TextEncoder

    return TextEncoder(batch_size=ENCODE_BATCH_SIZE, show_progress=False, **kwargs)


# ---------------------------------------------------------------------- the facade
class Memory(_Queries, _BulkItems, _Chunking, _EncoderPool, _Durable):
    """Per-user text memory with RF-Mem retrieval, micro-batching, a cache and a WAL.

    Args:
        path: a directory to keep the memory in (created if absent; reopened with
            every acknowledged write when it holds one), or None for an in-memory one.
        encoder: None (default) for the offline all-MiniLM-L6-v2, loaded on first use;
            any object with ``encode(list[str]) -> float array [n, d]`` (and ideally a
            ``dim`` attribute); a list of such objects (the same model, one per encoder
            worker: each is called by one thread at a time); or False for a
            vectors-only memory.
        encoder_dtype: precision of the default encoder, "float32" (None, the
            default), "bfloat16", "float16" or "auto" (bfloat16 where the CPU / GPU
            multiplies it natively: :func:`rfmem_fast.encoders.resolve_dtype`). A
            bfloat16 embedding has cosine >= 0.99997 to the float32 one (MiniLM,
            PersonaBench) at ~2x less encoder CPU in batches; hits can differ from
            float32 ones on near-ties only. Only for the default encoder: pass
            ``TextEncoder(dtype=...)`` as ``encoder`` otherwise. "int8" with
            ``encoder_backend`` "onnx" / "auto" only.
        encoder_backend: runtime of the default encoder, "torch" (None, the
            default), "onnx" (ONNX Runtime, extra ``onnx``) or "auto"
            (:func:`rfmem_fast.encoders.resolve_backend`,
            :data:`~rfmem_fast.encoders.AUTO_ENCODER_RULE`: with ``encoder_dtype``
            "auto", ONNX float32 where onnxruntime and onnx are installed, on every
            CPU, else the torch rule of ``encoder_dtype``; int8 only when asked for).
            Only for the default encoder, like ``encoder_dtype``.
        config: RFMemConfig; ``k`` in :meth:`search` overrides its ``out_k`` per call.
            Default: ``RFMemConfig.recommended(alias)``, hybrid dense + BM25 over the
            items' texts (docs "Hybrid retrieval"), ``alias`` "mpnet" for an MPNet
            encoder and "minilm" otherwise (:func:`rfmem_fast.models.recommended_alias`).
            The vector-level engine (``RFMemConfig()``, :func:`rfmem_fast.search`) keeps
            the paper's RF-Mem; pass ``config=RFMemConfig.paper()`` for it here. A query
            given as a vector has no text: it gets the dense top-k, as
            ``recommended(lexical_weight=0)`` would return (``Hit.lexical_score`` None).
            The config is not stored in ``path``: a memory directory reopened without
            ``config`` searches with this default (hybrid over its stored texts, with the
            lexical stemmer its bank store was built with).
        backend, device: as :func:`rfmem_fast.search` ("auto": native on a CPU).
        dim: vector dimension of a new memory (default: ``encoder.dim``, else 384).
        batching: gather concurrent searches into batches (default True); False runs
            each search on its own in the caller's thread.
        pipeline: with batching, encode the next batch while the current one is
            searched (default True: encoder worker thread(s) and a search thread,
            :class:`~rfmem_fast.serving.MicroBatcher` ``prepare`` / ``pipeline``); False
            encodes and searches each batch on one thread, one batch at a time.
        encoder_workers: batches encoded at once, each by its own encoder: an int
            >= 1; "auto" (:func:`default_encoder_workers`: one per 4 cores, at least 1,
            with the default encoder, batching and the pipeline; else 1); or None
            (default): 1, or the length of ``encoder`` when it is a list. With the
            default encoder, that many are loaded, each with :func:`encoder_threads`
            intra-op threads (the cores shared out). More than 1 needs the default
            encoder or a list of that length, batching and the pipeline.
        max_batch: the most queries per batch (int >= 1, default 64).
        max_wait_ms: how long a batch waits for more queries after its first (ms,
            default 2.0).
        max_queue: the most searches waiting (default 1024); beyond it a search raises
            :class:`~rfmem_fast.serving.QueueFullError`.
        timeout: seconds a search waits for its batch (default 30.0; None: no limit);
            beyond it :class:`~rfmem_fast.serving.RequestTimeoutError`.
        cache_size: entries of the hot-query caches (default 4096; 0 disables them).
        fsync: fsync each log append (default True; see
            :class:`~rfmem_fast.serving.wal.WriteAheadLog`).
        checkpoint_bytes: checkpoint automatically once the log exceeds this many
            bytes (default 64 MiB; None: only on :meth:`save` / :meth:`close`).
        chunk_overlap: tokens shared by consecutive chunks of a long text (int >= 0,
            default 32). A text longer than the encoder's window (``max_tokens``, 256
            for all-MiniLM-L6-v2, special tokens included) is cut into chunks of the
            window less the special tokens (254), each exactly a substring of the
            text and each a bank row of its item (row ids ``"<item>\x1f<j>"``, j >= 1
            for the extra ones); hits are collapsed to the item (its best chunk's
            score, whole text and metadata; on the Recollection path the slots its
            extra chunks took go to other items, :meth:`_give_back_chunk_slots`), reads
            show items, and update / delete
            of the item replace / remove all its chunks. With a lexical channel the
            item is one document (the BM25 of its whole text, on every chunk row) and
            each fusion is taken per item: a hit's ``score`` fuses its best chunk's
            cosine (``dense_score``) with its whole text's BM25 (``lexical_score``;
            docs/guides/hybrid.md "Chunked items").

    Ids: user ids and item ids are str (1-256 characters, valid Unicode, no U+001F);
    an int is converted to its decimal str (``7`` and ``"7"`` are one id), the same
    model as the HTTP service.

    Raises:
        ValueError: ``path`` is a file or a non-empty directory that is not a Memory,
            a dimension mismatch between ``dim`` / the encoder / the stored memory,
            ``encoder_dtype`` / ``encoder_backend`` with an ``encoder`` given or a pair
            :func:`rfmem_fast.encoders.check_backend` refuses, an unknown or unbuilt ``backend``
            name (checked here, not at the first search), or an option out of range;
            a corrupt or mismatched ``config.router`` / ``config.reranker`` file
            (:func:`rfmem_fast.routing.files.check_config_files`). StoreError: a
            corrupt store or log.
        FileNotFoundError: ``config.router`` / ``config.reranker`` names no file.
        TypeError: an option of the wrong type.

    Thread-safe: any number of threads (and asyncio tasks) may search and write.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        encoder: Any = None,
        config: RFMemConfig | None = None,
        backend: str = "auto",
        device: str | None = None,
        *,
        encoder_dtype: str | None = None,
        encoder_backend: str | None = None,
        dim: int | None = None,
        batching: bool = True,
        pipeline: bool = True,
        encoder_workers: int | str | None = None,
        max_batch: int = 64,
        max_wait_ms: float = 2.0,
        max_queue: int = 1024,
        timeout: float | None = 30.0,
        cache_size: int = 4096,
        fsync: bool = True,
        checkpoint_bytes: int | None = 64 << 20,
        chunk_overlap: int = DEFAULT_CHUNK_OVERLAP,
    ) -> None:
        if config is None:  # the recommended retrieval for this encoder (hybrid dense + BM25)
            from ..models import recommended_alias

            config = RFMemConfig.recommended(recommended_alias(encoder))
        if not isinstance(config, RFMemConfig):
            raise TypeError(f"config must be an RFMemConfig, got {type(config).__name__}")
        encoders: list | None = None
        if isinstance(encoder, (list, tuple)):
            if not encoder:
                raise ValueError("encoder is an empty list: give one encoder per encoder worker")
            encoders, encoder = list(encoder), encoder[0]
            for i, e in enumerate(encoders):
                if not callable(getattr(e, "encode", None)):
                    raise TypeError(f"encoder[{i}] must have an encode(list[str]) method")
                if getattr(e, "dim", None) != getattr(encoder, "dim", None):
                    raise ValueError(f"encoder[{i}].dim={getattr(e, 'dim', None)} differs from "
                                     f"encoder[0].dim={getattr(encoder, 'dim', None)}: one model for every worker")
        if encoder is not None and encoder is not False and not callable(getattr(encoder, "encode", None)):
            raise TypeError("encoder must have an encode(list[str]) method, or be None (default) or False")
        workers = self._check_workers(encoder_workers, encoder, encoders, batching, pipeline)
        for opt, value in (("encoder_dtype", encoder_dtype), ("encoder_backend", encoder_backend)):
            if value is None:
                continue
            from ..encoders import check_backend

            check_backend(encoder_backend or "torch", encoder_dtype or "float32", "encoder_backend", "encoder_dtype")
            if encoder is not None:
                raise ValueError(
                    f"{opt} applies to the default encoder only; with encoder= given, build it with "
                    "the precision / backend wanted (TextEncoder(dtype=..., backend=...))" if encoder is not False else
                    f"{opt} needs a text encoder; this Memory has encoder=False (vectors only)"
                )
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        if isinstance(chunk_overlap, bool) or not isinstance(chunk_overlap, int) or chunk_overlap < 0:
            raise ValueError(f"chunk_overlap must be an int >= 0 (tokens), got {chunk_overlap!r}")
        self._chunk_overlap = chunk_overlap
        # {user: {parent item id: number of extra chunk rows}} (long texts only)
        self._chunks: dict[str, dict[str, int]] = {}
        if checkpoint_bytes is not None and (isinstance(checkpoint_bytes, bool) or not isinstance(checkpoint_bytes, int) or checkpoint_bytes < 1):
            raise ValueError(f"checkpoint_bytes must be an int >= 1 or None, got {checkpoint_bytes!r}")
        if isinstance(backend, str):
            from ..backends import get_backend

            get_backend(backend, device)  # an unknown or unbuilt backend fails here, not at the first search
        check_config_files(config)  # a missing / bad router or re-ranker file fails here (the config holds paths)
        resolve_stage(config)  # and a second-stage file
        self._config = config
        self._configs: dict[int, RFMemConfig] = {config.out_k: config}
        self._backend = backend
        self._device = device
        self._encoder = encoder if encoder is not False else None
        self._has_encoder = encoder is not False
        self._encoder_lock = threading.Lock()
        self._workers = workers
        # every encoder (its workers'); [0] is self._encoder. With more than one, an
        # encode call borrows a free one from the pool (one thread per encoder at a time)
        self._encoders: list = encoders if encoders is not None else ([encoder] if self._encoder is not None else [])
        self._pool: queue.SimpleQueue = queue.SimpleQueue()
        self._helper_pool: cf.ThreadPoolExecutor | None = None
        for e in self._encoders if len(self._encoders) > 1 else ():
            self._pool.put(e)
        self._encoder_kwargs: dict[str, Any] = {} if encoder_dtype is None else {"dtype": encoder_dtype}
        if encoder_backend is not None:
            self._encoder_kwargs["backend"] = encoder_backend
        self._rw = RWLock()
        self._wmutex = threading.RLock()
        self._uver: dict[Hashable, int] = {}
        self._cache = QueryCache(cache_size)
        self._listeners: list[Callable[[BatchEvent], None]] = []
        self._stats_lock = threading.Lock()
        self._counters = dict(runs=0, queries=0, encode_calls=0, encoded=0, encode_seconds=0.0,
                              searches=0, search_seconds=0.0, writes=0, replayed=0, replay_skipped=0,
                              checkpoints=0)
        self._closed = False
        self._broken: BaseException | None = None
        self._checkpoint_bytes = checkpoint_bytes
        self._seq = 0
        self._wal: WriteAheadLog | None = None
        self._path: Path | None = None
        self._lock_file: Any = None
        self._store_gen = 0
        enc_dim = getattr(self._encoder, "dim", None) if self._encoder is not None else None
        # vectors of another dimension get a hint: this Memory's dimension was not chosen
        self._dim_defaulted = encoder is False and dim is None
        if path is None:
            self.bank = MemoryBank(self._resolve_dim(dim, enc_dim, None), lexical_stemmer=default_stemmer())
        else:
            try:
                self._open(_check_path(path), dim, enc_dim, fsync)
            except BaseException:
                if self._lock_file is not None:
                    self._lock_file.close()
                raise
        self._batcher: MicroBatcher | None = None
        if batching:
            self._batcher = MicroBatcher(self._search_encoded, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                         max_queue=max_queue, timeout=timeout, prepare=self._encode_batch,
                                         workers=workers, pipeline=pipeline)
        elif timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout must be a number > 0 (seconds) or None, got {timeout!r}")


    # ------------------------------------------------------------------ properties
    @property
    def dim(self) -> int:
        """Vector dimension d."""
        return self.bank.dim

    @property
    def config(self) -> RFMemConfig:
        """The RFMemConfig searches use (``out_k`` replaced by ``k`` per call)."""
        return self._config

    @property
    def path(self) -> Path | None:
        """The memory's directory (None for an in-memory one)."""
        return self._path

    @property
    def batching(self) -> bool:
        """Whether concurrent searches are micro-batched."""
        return self._batcher is not None

    @property
    def encoder(self) -> Any:
        """The text encoder (loaded now if it is the default one); None for a vectors-only memory."""
        return self._get_encoder() if self._has_encoder else None

    def encoder_info(self) -> dict[str, Any] | None:
        """What embeds this memory's texts, without loading it (for /health, /metrics).

        Returns:
            None for a vectors-only memory, else {"model": the model directory or the
            encoder's class name, "backend": the runtime in use ("torch" or "onnx";
            the one asked, e.g. "auto", while the default encoder is not loaded yet;
            None when the encoder does not say, e.g. a custom ``encode`` object),
            "dtype": the precision in use ("float32", "bfloat16", "float16", "int8";
            the one asked while not loaded; None when the encoder does not say),
            "device": str or None, "dim": the vector dimension (int), "loaded": bool}.
            The encoder workers and the pipeline are in ``stats()["batcher"]``
            ("workers", "pipeline").
        """
        if not self._has_encoder:
            return None
        enc = self._encoder
        if enc is None:
            return {"model": "all-MiniLM-L6-v2 (default, not loaded yet)",
                    "backend": self._encoder_kwargs.get("backend", "torch"),
                    "dtype": self._encoder_kwargs.get("dtype", "float32"), "device": "cpu", "dim": self.dim,
                    "loaded": False}
        said = {k: getattr(enc, k, None) for k in ("backend", "dtype", "device")}
        return {"model": str(getattr(enc, "model_path", type(enc).__name__)),
                **{k: None if v is None else str(v) for k, v in said.items()}, "dim": self.dim, "loaded": True}

    def __repr__(self) -> str:
        return (f"Memory(path={str(self._path) if self._path else None!r}, users={self.bank.num_users}, "
                f"items={self.bank.num_items}, dim={self.dim}, batching={self.batching})")

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ encoding
    def _get_encoder(self) -> Any:
        if not self._has_encoder:
            raise ValueError("this Memory has no text encoder (encoder=False): pass vectors instead of text")
        if self._encoder is None:
            with self._encoder_lock:
                if self._encoder is None:
                    kwargs = dict(self._encoder_kwargs)
                    if self._workers > 1:  # the cores shared out between the workers' encoders
                        kwargs["num_threads"] = encoder_threads(self._workers, usable_cores())
                    encs = [_default_encoder(**kwargs) for _ in range(self._workers)]
                    for enc in encs:
                        if getattr(enc, "dim", self.dim) != self.dim:
                            raise ValueError(f"the default encoder's dimension {enc.dim} != this memory's {self.dim}")
                    for enc in encs if len(encs) > 1 else ():
                        self._pool.put(enc)
                    self._encoders = encs
                    self._encoder = encs[0]
        return self._encoder

    # ------------------------------------------------------------------ writes
    def add(
        self,
        texts: str | Sequence[str] | None,
        user_id: Hashable,
        ids: Sequence[Hashable] | Hashable | None = None,
        metadata: dict | Sequence[dict | None] | None = None,
        *,
        vectors: Any = None,
        created_at: Any = None,
        thread: Any = None,
        position: Any = None,
    ) -> list[Hashable]:
        """Store memories for a user (created on first add); durable once it returns.

        Args:
            texts: one str or m str (the items' texts: valid Unicode, not blank, at most
                MAX_TEXT_CHARS characters; one longer than the encoder's window is
                chunked, :class:`Memory` ``chunk_overlap``), or None when ``vectors`` is given.
            user_id: the user (str, or an int: its decimal str).
            ids: m unique item ids (str, or int: converted to str) or one id for one item; default: new
                uuid4 hex strings.
            metadata: one dict for every item, or m dicts / None: JSON objects stored
                with the items (and saved / reloaded with them).
            vectors: [m, d] (or [d]) floating array to store instead of encoding the
                texts (for stacks that embed elsewhere); with texts, the texts are kept
                as the items' texts.
            created_at: when the items were created (default: now): one instant for
                every item or m of them, each a timezone-aware ``datetime``, an ISO-8601
                string with a UTC offset (``"2026-11-01T09:30:00Z"``) or a number of
                seconds since the Unix epoch; naive datetimes are refused (ambiguous), and
                so is an instant outside 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999Z
                (:data:`rfmem_fast.bank.INSTANT_RANGE`; epoch milliseconds get a hint).
                Stored in UTC, logged with the write, returned as ``Item.created_at`` /
                ``Hit.created_at`` and filterable as ``filters={"created_at": {...}}``
                (:meth:`search`).
            thread: the conversation thread of the items (default: none): one thread id
                for every item or m of them (None for an item without one); a thread id
                is a str (1-256 characters) or an int (signed 64-bit), kept as given
                (``"1"`` and ``1`` are different threads). Items of one thread are
                each other's context when the config's ``context_weight`` /
                ``thread_weight`` > 0 (:mod:`rfmem_fast.context`); returned as
                ``Item.thread`` / ``Hit.thread``, filterable as ``filters={"thread": ...}``.
            position: each item's position in its thread (default: none): one int >= 0
                for every item or m of them / None. Within a thread, items are ordered by
                position (those without one after, in insertion order); neighbours are
                the items at most ``context_radius`` ranks away. An item with a position
                needs a thread. Returned as ``Item.position`` / ``Hit.position``,
                filterable as ``filters={"position": {"$lt": 10}}``.

        Returns:
            list of the m item ids (str).

        Raises:
            ValueError: neither texts nor vectors, mismatched lengths, a wrong
                dimension, NaN / Inf / zero vectors (a text the encoder embeds as one:
                ``texts[i]`` named), a duplicate id or one the user already holds,
                metadata that is not JSON (``metadata[i]`` named), an empty / blank
                text or one with a lone surrogate (``texts[i]``), no encoder for texts, a
                malformed, naive or out-of-range ``created_at`` (``created_at[i]`` named),
                an empty / over-long thread id (``thread[i]``), a negative position
                (``position[i]``), a position without a thread.
            TypeError: arguments of the wrong type (a thread that is no str / int, a
                position that is no int: named).
            OSError: the log could not be written (nothing is acknowledged).
        """
        self._check_open()
        user = _user_key(user_id)
        tx = _text_list(texts)
        vec = None if vectors is None else self._vectors(vectors)
        if tx is None and vec is None:
            raise ValueError("add needs texts or vectors")
        m = len(tx) if tx is not None else vec.shape[0]
        if vec is not None and tx is not None and vec.shape[0] != m:
            raise ValueError(f"texts has {m} entries but vectors has {vec.shape[0]} rows: give one vector per text")
        if m == 0:
            raise ValueError("add needs at least one item")
        id_list = [uuid.uuid4().hex for _ in range(m)] if ids is None else _id_list(ids)
        if len(id_list) != m:
            raise _count_error("ids", len(id_list), m)
        meta = _metadata_list(metadata, m)
        created = _created_list(created_at, m)
        thr = _thread_list(thread, m)
        pos = _position_list(position, m)
        _check_pairs(thr, pos, lambda j: (_entry_label("position", position)(j), _entry_label("thread", thread)(j)))
        extra_ids: list[str] = []
        extra = None
        if vec is None:
            vec, extra_ids, extra = self._encode_items(tx, id_list)
        self._write(self._add_record(user, id_list, vec, extra_ids, extra,
                                     {"texts": tx, "metadata": meta, "created_at": created, "threads": thr,
                                      "positions": pos}))
        return id_list


    def update(
        self,
        ids: Sequence[Hashable] | Hashable,
        user_id: Hashable,
        texts: str | Sequence[str] | None = None,
        *,
        vectors: Any = None,
        metadata: dict | Sequence[dict | None] | None = None,
        thread: Any = None,
        position: Any = None,
    ) -> None:
        """Change existing items (keeping their ids); durable once it returns.

        Args:
            ids: one item id or m ids the user holds.
            user_id: the user.
            texts: new texts (re-encoded unless ``vectors`` is given), or None to keep.
            vectors: new [m, d] vectors, or None (keep, or encode the new texts).
            metadata: a dict for every item or m dicts (None clears one), or None to keep.
            thread: one thread id for every item or m entries (None clears one item's
                thread), or None to keep (as :meth:`add`).
            position: one int >= 0 for every item or m entries (None clears one item's
                position), or None to keep. The items as they will be must not hold a
                position without a thread (to clear both: ``thread=[None] * m,
                position=[None] * m``).

        Raises:
            KeyError: unknown user or item id (named).
            ValueError / TypeError: as :meth:`add`, or nothing to change.
        """
        self._check_open()
        user = _user_key(user_id)
        id_list = _id_list(ids)
        m = len(id_list)
        tx = _text_list(texts)
        vec = None if vectors is None else self._vectors(vectors)
        for name, n in (("texts", None if tx is None else len(tx)), ("vectors", None if vec is None else vec.shape[0])):
            if n is not None and n != m:
                raise _count_error(name, n, m, of="ids")
        meta = _metadata_list(metadata, m)
        thr = _thread_list(thread, m)
        pos = _position_list(position, m)
        if tx is None and vec is None and meta is None and thr is None and pos is None:
            raise ValueError("update needs texts, vectors, metadata, thread or position")
        if user not in self.bank:
            raise KeyError(f"user_id: unknown user {user!r}")
        extra_ids: list[str] = []
        extra = None
        if tx is not None and vec is None:
            vec, extra_ids, extra = self._encode_items(tx, id_list)
        tl, pl = _entry_label("thread", thread), _entry_label("position", position)
        with self._wmutex:
            conv = self._conversation_of(user, id_list, thr, pos, lambda j: (pl(j), tl(j)))
            self._write(self._update_record(user, id_list, tx, vec, meta, extra_ids, extra, conv))

    def delete(self, ids: Sequence[Hashable] | Hashable, user_id: Hashable) -> None:
        """Delete items of a user (never returned again); durable once it returns.

        Raises:
            KeyError: unknown user or item id (named); nothing is deleted then.
            TypeError / ValueError: malformed ids.
        """
        self._check_open()
        user = _user_key(user_id)
        id_list = _id_list(ids)
        if user not in self.bank:
            raise KeyError(f"user_id: unknown user {user!r}")
        with self._wmutex:  # an item's chunks go with it (an unknown id: the bank's KeyError names it)
            self._write(self._delete_record(user, id_list))

    def delete_user(self, user_id: Hashable) -> int:
        """Delete every memory of a user ("forget me"); durable once it returns.

        Idempotent: a user without items (or never seen) deletes nothing and returns 0.

        Returns:
            int, the number of items deleted.

        Raises:
            TypeError / ValueError: a malformed user id. OSError: the log could not be written.
        """
        self._check_open()
        user = _user_key(user_id)
        with self._wmutex:
            n = self.count(user)
            if user in self.bank and self.bank.user_size(user):
                self._write({"op": "delete_user", "user": user})
        return n

    # ------------------------------------------------------------------ bulk writes
    def add_many(self, items: Sequence[Mapping[str, Any]]) -> list[str]:
        """Store many items of many users in ONE write: all of them, or none.

        Args:
            items: dicts, one per item, with the fields (:data:`ITEM_FIELDS`):
                ``user_id`` (required; str or int, as in :meth:`add`), ``text`` and / or
                ``vector`` (at least one: a [d] float vector is stored instead of
                encoding the text, which is then kept as the item's text), ``id``
                (optional: default a new uuid4 hex), ``metadata`` (a JSON object, or
                None), ``created_at`` (the forms of :meth:`add`, one parser: seconds
                since the Unix epoch, a timezone-aware ``datetime`` or an ISO-8601
                string, one without an offset read as UTC; within 0001-01-01 ..
                9999-12-31 in UTC; default: the time of the write; a long text's chunk
                rows get their item's). A None value counts as not given.

        Every text without a vector is embedded in ONE encoder call (long texts
        chunked as in :meth:`add`); each user's items become one add record and the
        records ONE log line (a group, :mod:`rfmem_fast.serving.wal`: replayed whole
        or not at all), applied under one hold of the write lock (a search sees all
        of the items or none; the bank builds one snapshot for them).

        Returns:
            list of the items' ids (str), in item order.

        Raises:
            ValueError / TypeError: a bad item, its index and field named
                (``items[3].text is empty ...``; the error has ``index`` and ``field``
                attributes); an id given twice for a user, or one the user already
                holds (``items[i].id``). Nothing is written then.
            OSError: the log could not be written (nothing is acknowledged).
        """
        return self._bulk(self._add_many, items)

    def update_many(self, items: Sequence[Mapping[str, Any]]) -> None:
        """Change many items of many users in ONE write (all of them, or none), keeping their ids.

        Args:
            items: dicts with ``user_id`` and ``id`` (required: an item the user
                holds) and at least one of ``text`` (re-encoded unless a ``vector`` is
                given), ``vector`` ([d] floats) and ``metadata`` (a JSON object that
                replaces the item's; None clears it). A field left out is kept.

        The new texts are embedded in one encoder call; the records are one log
        group, applied as in :meth:`add_many`.

        Raises:
            KeyError: an unknown user or item (``items[i].user_id`` / ``items[i].id``).
            ValueError / TypeError: a bad item (index and field named, attributes
                ``index`` / ``field``), an item given twice. Nothing is written then.
        """
        self._bulk(self._update_many, items)

    def delete_many(self, items: Sequence[Mapping[str, Any]]) -> None:
        """Delete many items of many users in ONE write: all of them, or none.

        Args:
            items: dicts ``{"user_id", "id"}`` (an item the user holds; a long text's
                chunks go with it).

        Raises:
            KeyError: an unknown user or item (``items[i].user_id`` / ``items[i].id``).
            ValueError / TypeError: a malformed item or one given twice (named).
                Nothing is deleted then.
        """
        self._bulk(self._delete_many, items)

    def export_items(self, user_id: Hashable | None = None, *, vectors: bool = False) -> Iterator[dict[str, Any]]:
        """Every live item (or one user's) as the dicts :meth:`add_many` takes: users in
        the order they were first written, each user's items in insertion order.

        Args:
            user_id: one user, or None for all (an unknown user: nothing).
            vectors: also give each item's ``vector`` (float32 [d], the stored unit
                row) -- except for a long text stored in several chunk rows, which has
                none (``add_many`` re-embeds its text). An item without a text always
                has its vector (nothing else could make it again).

        Yields:
            {"id", "user_id", "text" (None for a vector-only item), "metadata" (a dict,
            {} when none), "created_at" (ISO-8601 UTC; left out when unknown: a store
            written before creation times were kept, or a stored time that is no instant,
            :attr:`Item.created_at`), "thread" and "position" (the item's conversation,
            each left out when it has none), and
            "vector" when asked for}: one consistent version of the memory (taken under
            the read lock at the first ``next``).
        """
        only = None if user_id is None else _user_key(user_id)
        with self._rw.read():
            snap = self.bank.snapshot()
            users = [u for u in snap.users if only is None or u == only]
            metas = {u: self.bank.get_metadata(u) for u in users}
            chunked = {u: set(self._chunks.get(u) or ()) for u in users}
        pos = {u: k for k, u in enumerate(snap.users)}
        texts = snap.texts
        created = snap.created_at_or_nan
        threads, positions = snap.threads, snap.positions
        for user in users:
            k = pos[user]
            a, b = int(snap.offsets[k]), int(snap.offsets[k + 1])
            for r, meta in zip(range(a, b), metas[user]):
                iid = snap.item_ids[r]
                if isinstance(iid, str) and CHUNK_SEP in iid:
                    continue
                item = {"id": str(iid), "user_id": str(user), "text": None if texts is None else texts[r],
                        "metadata": meta or {}}
                when = _utc(created[r])
                if when is not None:  # NaN: unknown (an item of a store of format < 4)
                    item["created_at"] = when.isoformat()
                if threads is not None and threads[r] is not None:
                    item["thread"] = threads[r]
                if positions is not None and positions[r] >= 0:  # (NO_POSITION = -1: none)
                    item["position"] = int(positions[r])
                if (vectors or item["text"] is None) and iid not in chunked[user]:
                    item["vector"] = np.array(snap.vectors[r], dtype=np.float32)
                yield item

    # ------------------------------------------------------------------ reads
    def counts(self) -> tuple[int, int]:
        """(users holding at least one item, live items) of the whole memory: items as a
        caller sees them (a long text cut into chunk rows counts once; a user whose
        memories were all deleted counts as no user), what ``/health`` and ``/metrics``
        report."""
        with self._rw.read():
            snap = self.bank.snapshot()
            extra = sum(sum(v.values()) for v in self._chunks.values())
        return int(np.count_nonzero(np.diff(snap.offsets))), int(snap.num_items) - int(extra)

    def count(self, user_id: Hashable) -> int:
        """Live items of a user (0 for an unknown user)."""
        user = _user_key(user_id)
        return self.bank.user_size(user) - self._extra_rows(user) if user in self.bank else 0

    def has_items(self, user_id: Hashable, ids: Sequence[Hashable]) -> list[bool]:
        """For each id, whether the user holds a live item with it (all False for a user
        never written; ids as in :meth:`add`: an int is its decimal str).

        Raises:
            TypeError / ValueError: a malformed user id or item id (``ids[i]`` named).
        """
        user = _user_key(user_id)
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"ids must be a sequence of str or int item ids, got {type(ids).__name__}")
        return self.bank.has_items(user, [_canon_id(x, f"ids[{i}]") for i, x in enumerate(ids)])

    def get_all(self, user_id: Hashable, offset: int = 0, limit: int | None = None) -> list[Item]:
        """The live items of a user in insertion order ([] for an unknown user).

        Args:
            user_id: the user.
            offset: items to skip (int >= 0; default 0).
            limit: the most items returned (int >= 1, or None for all).

        Raises:
            ValueError: a bad offset / limit (named).
        """
        user = _user_key(user_id)
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
            raise ValueError(f"offset must be an int >= 0, got {offset!r}")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1):
            raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
        stop = None if limit is None else int(offset) + int(limit)
        with self._rw.read():
            if user not in self.bank:
                return []
            ids = self.bank.item_ids_of(user)
            if self._chunks.get(user):
                ids = [i for i in ids if not (isinstance(i, str) and CHUNK_SEP in i)]
            ids = ids[offset:stop]
            if not ids:
                return []
            text_of = dict(zip(self.bank.item_ids_of(user), self.bank.texts_of(user)))
            metas = self.bank.get_metadata(user, ids)
            times = self.bank.created_at_of(user, ids).tolist()
            threads, positions = self.bank.threads_of(user, ids), self.bank.positions_of(user, ids)
        return [Item(i, text_of[i], m or {}, _utc(t), th, p)
                for i, m, t, th, p in zip(ids, metas, times, threads, positions)]

    def get(self, ids: Sequence[Hashable] | Hashable, user_id: Hashable) -> list[Item]:
        """Some items of a user, in the order asked.

        Raises:
            KeyError: unknown user or item id (named).
        """
        user = _user_key(user_id)
        id_list = _id_list(ids)
        with self._rw.read():
            if user not in self.bank:
                raise KeyError(f"user_id: unknown user {user!r}")
            metas = self.bank.get_metadata(user, id_list)
            text_of = dict(zip(self.bank.item_ids_of(user), self.bank.texts_of(user)))
            times = self.bank.created_at_of(user, id_list).tolist()
            threads, positions = self.bank.threads_of(user, id_list), self.bank.positions_of(user, id_list)
        return [Item(i, text_of[i], m or {}, _utc(t), th, p)
                for i, m, t, th, p in zip(id_list, metas, times, threads, positions)]

    def users(self) -> list[Hashable]:
        """Every user key ever written (users whose items were all deleted included)."""
        return self.bank.users

    # ------------------------------------------------------------------ search
    def search(self, query: str | Any, user_id: Hashable, k: int | None = None, mode: str = "rfmem",
               timeout: float | None | str = "default", filters: dict | None = None) -> Hits:
        """RF-Mem retrieval of one query within one user's memory.

        Args:
            query: the query text, or a 1-D vector of d floats.
            user_id: the user whose memory is searched (no other user's items can come back).
            k: hits wanted (default ``config.out_k``).
            mode: "rfmem" (probe, route, routed path), "dense" or "recollection".
            timeout: seconds to wait for the micro-batch (default: the Memory's).
            filters: a filter over the items' metadata and ``created_at``
                (:mod:`rfmem_fast.filters`, e.g. ``{"source": "chat", "created_at":
                {"$gte": "2026-11-01T00:00:00Z"}}``): the hits are the top k of the
                MATCHING items, exactly (applied while the top-k is taken, in every mode;
                fewer than k only when fewer match). Filtered queries share micro-batches
                with the others.

        Returns:
            Hits (a list of Hit, best first, at most k; [] for a user with no
            memory) with the query's route / rule / mean / entropy / rounds.

        Raises:
            ValueError / TypeError: a bad query (empty / blank text, lone surrogate, a
                list: use :meth:`search_batch`), user, k (an int in [1, MAX_K]) or mode
                (named); a query the encoder embeds as a zero / non-finite vector (it
                fails alone, never the other requests of its micro-batch); a malformed
                filter (the message names the part: ``filters['score']['$gte']: ...``).
            QueueFullError, RequestTimeoutError: overload (batching on).
            BatcherClosedError: the Memory is closed (or closing).
        """
        q, hits = self._start(query, user_id, k, mode, filters)
        if hits is not None:
            return hits
        if self._batcher is not None:
            ans = self._batcher.call(q, timeout)
        else:
            ans = self._run_one(q)
        return ans.materialise(cached=False)

    async def asearch(self, query: str | Any, user_id: Hashable, k: int | None = None, mode: str = "rfmem",
                      timeout: float | None | str = "default", filters: dict | None = None) -> Hits:
        """Asyncio version of :meth:`search`: concurrent awaits share micro-batches."""
        ans, cached = await self._asearch_answer(query, user_id, k, mode, timeout, filters)
        return ans.materialise(cached=cached)

    async def _asearch_answer(self, query: Any, user_id: Hashable, k: int | None = None, mode: str = "rfmem",
                              timeout: float | None | str = "default",
                              filters: dict | None = None) -> tuple[_Answer, bool]:
        """:meth:`asearch` without the per-caller copy: (the immutable answer, from the
        cache?). For a caller that only reads it (the HTTP app serialises it at once);
        the answer is shared with the cache and must not be changed. Raises as
        :meth:`search`."""
        q, hit = self._start_answer(query, user_id, k, mode, filters)
        if hit is not None:
            return hit, True
        if self._batcher is not None:
            return await self._batcher.acall(q, timeout), False
        return await asyncio.to_thread(self._run_one, q), False

    def search_batch(self, queries: Sequence[Any] | Any, user_ids: Hashable | Sequence[Hashable],
                     k: int | None = None, mode: str = "rfmem", filters: Any = None) -> list[Hits]:
        """Many queries at once (one encode, one search per mode), in the caller's thread.

        Args:
            queries: b query texts and / or 1-D vectors, or a [b, d] float array.
            user_ids: one user for all, or b users (query i searches ``user_ids[i]``).
            k, mode: as :meth:`search`, for every query.
            filters: None, one filter for every query, or b filters / None (as :meth:`search`).

        Returns:
            list of b Hits, in query order.

        Raises:
            ValueError / TypeError: a bad query (named by index), user, k or mode.
        """
        self._check_open()
        if isinstance(queries, (str, bytes)):
            raise TypeError("queries must be a sequence of queries (use search() for one)")
        if isinstance(queries, np.ndarray) or hasattr(queries, "detach"):
            if queries.ndim != 2:
                raise ValueError(f"queries must be [b, d] when given as an array, got shape {tuple(queries.shape)}")
        qs = list(queries)
        if isinstance(user_ids, (str, int, np.integer, np.str_)) and not isinstance(user_ids, bool):
            users = [user_ids] * len(qs)
        else:
            users = list(user_ids)
            if len(users) != len(qs):
                raise _count_error("user_ids", len(users), len(qs), "query", of="queries", single="one user")
        if filters is None or isinstance(filters, dict):
            flist, fnames = [filters] * len(qs), ["filters"] * len(qs)
        elif isinstance(filters, (str, bytes)) or not hasattr(filters, "__len__"):
            raise TypeError(f"filters must be a dict, a sequence of b dicts / None, or None, got {type(filters).__name__}")
        else:
            flist, fnames = list(filters), [f"filters[{i}]" for i in range(len(qs))]
            if len(flist) != len(qs):
                raise _count_error("filters", len(flist), len(qs), "query", of="queries", single="one filter")
        prepared = [self._prepare(x, u, k, mode, name=f"queries[{i}]", filters=f, fname=fn)
                    for i, (x, u, f, fn) in enumerate(zip(qs, users, flist, fnames))]  # fmt: skip
        out: list[Any] = [None] * len(prepared)
        todo = []
        for i, q in enumerate(prepared):
            hit = self._cached(q)
            if hit is not None:
                out[i] = hit.materialise(cached=True)
            else:
                todo.append(i)
        if todo:
            answers = self._run_batch([prepared[i] for i in todo])
            for i, a in zip(todo, answers):
                if isinstance(a, BaseException):
                    raise a
                out[i] = a.materialise(cached=False)
        return out

    # ------------------------------------------------------------------ persistence
    def save(self) -> None:
        """Checkpoint: write the bank as a store in ``path`` and truncate the log.

        Atomic: ``memory.json`` is replaced only after the new store is complete, and
        names the last log record the store holds, so a crash at any point reopens
        with every acknowledged write. Writes wait while it runs (O(N d)).

        Raises:
            ValueError: an in-memory Memory (no path). OSError: I/O failure (the
                previous checkpoint and the log stay valid).
        """
        if self._path is None:
            raise ValueError("this Memory has no path: pass path= to Memory() to persist it")
        with self._wmutex:
            self._check_open()
            self._checkpoint_locked()

    def close(self) -> None:
        """Finish queued searches, checkpoint (when there is a path and unsaved log
        records), and refuse further calls. Idempotent."""
        if self._closed:
            return
        if self._batcher is not None:
            self._batcher.close()
        if self._helper_pool is not None:
            self._helper_pool.shutdown(wait=True)
        with self._wmutex:
            try:
                if self._wal is not None:
                    if self._wal.nbytes and self._broken is None:
                        self._checkpoint_locked()
                    self._wal.close()
            finally:
                self._closed = True
                if self._lock_file is not None:
                    self._lock_file.close()  # releases the flock
                    self._lock_file = None

    # ------------------------------------------------------------------ observability
    def add_listener(self, fn: Callable[[BatchEvent], None]) -> None:
        """Call ``fn(BatchEvent)`` after every batched run (used by the HTTP metrics)."""
        if not callable(fn):
            raise TypeError("fn must be callable")
        self._listeners.append(fn)

    def stats(self) -> dict[str, Any]:
        """Counters: users, items, runs / queries / encode / search totals (seconds),
        writes, the encoder (:meth:`encoder_info`), cache hit rates ({"results", "embeddings"}), batcher ({"batches",
        "mean_batch", "largest_batch", "queue_depth", ...}), log bytes."""
        with self._stats_lock:
            c = dict(self._counters)
        users, items = self.counts()
        c.update(users=users, items=items, cache=self._cache.stats(),
                 encoder=self.encoder_info(),
                 batcher=self._batcher.stats() if self._batcher is not None else None,
                 wal_bytes=self._wal.nbytes if self._wal is not None else 0)
        return c
