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
    mem.close()                                   # checkpoint; or use `with Memory(...)`

What it adds to the engine
--------------------------
* Text: queries and items are encoded by ``encoder`` (default: the offline
  all-MiniLM-L6-v2 :class:`~rfmem_fast.encoders.TextEncoder`, loaded on first use).
  Vectors may be passed instead (``add(vectors=...)``, a 1-D vector as the query) by
  stacks that embed elsewhere; ``encoder=False`` makes a vectors-only memory.
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
* A hot-query cache (:mod:`rfmem_fast.serving.cache`): query embeddings by text, and
  whole answers by (user, that user's write version, query, mode, k); any write to a
  user invalidates that user's answers.
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
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import copy
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from .._validate import as_float_matrix, l2_normalize_rows
from ..bank import MemoryBank, _check_id_list, _check_metadata, _check_unicode
from ..config import RFMemConfig
from ..search import MODES, SearchResult, search
from ..store import StoreError, _fsync_dir
from ._rwlock import RWLock
from .batcher import BatcherClosedError, MicroBatcher
from .cache import QueryCache, vector_key
from .wal import WriteAheadLog, decode_array, encode_array

__all__ = ["Memory", "Hit", "Hits", "Item", "BatchEvent", "DEFAULT_DIM", "MAX_K", "MAX_ID_LENGTH", "MAX_TEXT_CHARS"]

log = logging.getLogger("rfmem_fast.serving")

#: dimension of the default encoder (all-MiniLM-L6-v2)
DEFAULT_DIM = 384
#: the most hits one query may ask for (``k``), in Python and over HTTP
MAX_K = 1000
#: the longest user id / item id (characters)
MAX_ID_LENGTH = 256
#: the longest text of a memory or a query (characters); a memory must also fit the
#: encoder's window (``TextEncoder.max_tokens``: 256 tokens for all-MiniLM-L6-v2)
MAX_TEXT_CHARS = 100_000
#: separates a parent item id from a chunk number in the bank's row ids of a long text's
#: extra chunks (``"<parent>\x1f<j>"``, j >= 1); refused in user-given ids
CHUNK_SEP = "\x1f"
#: tokens shared by consecutive chunks of a long text (default of ``chunk_overlap``)
DEFAULT_CHUNK_OVERLAP = 32
META_FILE = "memory.json"
WAL_FILE = "wal.jsonl"
LOCK_FILE = "LOCK"
FORMAT_NAME = "rfmem_fast.memory"
FORMAT_VERSION = 1
_STORE_PREFIX = "store-"


#: texts per forward pass of the default encoder. sentence-transformers sorts a call's
#: texts by length and pads each pass to its longest text: small passes keep padding
#: low, so a micro-batch of 64 questions costs ~2.7x less CPU per question than 64
#: single encodes, where passes of 64 cost MORE than single encodes (one 85-token
#: question pads 63 15-token ones; issue 9 notes).
ENCODE_BATCH_SIZE = 8


def _default_encoder(**kwargs: Any) -> Any:
    """The default text encoder (the offline all-MiniLM-L6-v2); tests may patch this.

    ``kwargs`` go to :class:`~rfmem_fast.encoders.TextEncoder` (``dtype`` when a Memory
    was given ``encoder_dtype``, ``backend`` with ``encoder_backend``, ``num_threads``
    with more than one encoder worker)."""
    from ..encoders import TextEncoder

    return TextEncoder(batch_size=ENCODE_BATCH_SIZE, show_progress=False, **kwargs)


#: cores per encoder worker of "auto" (:func:`default_encoder_workers`)
CORES_PER_ENCODER_WORKER = 4


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS tells it,
    else ``os.cpu_count()``); int >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def default_encoder_workers(cores: int | None = None) -> int:
    """Encoder workers of ``encoder_workers="auto"`` (``rfmem serve`` default): the rule is
    one worker per :data:`CORES_PER_ENCODER_WORKER` (4) cores, at least one:
    ``max(1, cores // 4)``, so 1 up to 7 cores (each worker then gets
    :func:`encoder_threads`, all the cores, as ONNX Runtime / torch intra-op threads).

    Why (``docs/benchmarks/serving.md``, 2 cores): an encoder's intra-op threads run
    without the GIL, but each extra worker is a Python thread that needs the GIL back
    between its ONNX passes, next to the event loop and the search thread. Alone, two
    workers with one thread each encode faster than one worker with two (1.43 vs 1.62
    ms per question in batches of 32), but in the server on two shared cores the
    second worker served 14-36 % fewer closed-loop requests per second at 64 clients
    in five of seven runs (3 % and 19 % more in the other two) and won on open-loop
    tails in only some. Beyond 2 cores this rule is
    not measured: it keeps each worker's pass on 4 or more threads.

    Args:
        cores: the cores to plan for (default :func:`usable_cores`); int >= 1.

    Raises:
        ValueError: ``cores`` is not an int >= 1.
    """
    if cores is None:
        cores = usable_cores()
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be an int >= 1, got {cores!r}")
    return max(1, cores // CORES_PER_ENCODER_WORKER)


def encoder_threads(workers: int, cores: int | None = None) -> int:
    """Intra-op threads of each of ``workers`` default encoders: the cores shared out,
    ``max(1, threads // workers)`` with ``threads`` = ``torch.get_num_threads()`` (what
    one encoder uses alone; it follows ``OMP_NUM_THREADS``), capped at ``cores``, so
    that the workers together never run more encoder threads than one encoder would."""
    import torch

    threads = max(1, int(torch.get_num_threads()))
    if cores is not None:
        threads = min(threads, cores)
    return max(1, threads // workers)


class MemoryLockedError(RuntimeError):
    """A Memory directory already open in another process or Memory (its lock file is
    held): one open Memory per directory."""


# ---------------------------------------------------------------------- results
def _finite_or_none(v: Any) -> float | None:
    """``v`` as a float, None for None / NaN (an unknown channel score)."""
    return None if v is None or v != v else float(v)


def default_stemmer() -> str | None:
    """The lexical stemmer of a new Memory's bank: "english" (PyStemmer's Snowball English,
    what ``RFMemConfig.recommended()`` was tuned with) when PyStemmer is installed (the
    ``text`` / ``serve`` / ``mcp`` / ``lexical`` extras bring it), else None (no stemming).
    A bank keeps its stemmer in its store, so a reopened Memory scores as it did."""
    try:
        import Stemmer  # noqa: F401  (PyStemmer)
    except ImportError:
        return None
    return "english"


# ---------------------------------------------------------------------- results (types)
@dataclass(frozen=True)
class Hit:
    """One retrieved memory item.

    Attributes:
        id: the item id (str; an int given at add time is its decimal str).
        text: the item's text (None when it was added as a vector without text).
        score: float; the inner product (cosine) on the Familiarity path, the
            (MMR-adjusted) discovery score on the Recollection path (RFMEM_SPEC.md 3-4).
        metadata: the item's metadata dict ({} when none); the caller's own copy.
        rank: 0-based position in the query's result.
        user_id: the user whose memory it came from (always the query's user).
        route: the query's path, "familiarity" or "recollection" (spec section 2).
        rule: the router rule that fired (``rfmem_fast.router.RULE_NAMES``).
        mean: mean of the probe's top-``probe_k`` scores (spec section 1).
        entropy: the probe's softmax entropy (spec section 1).
        rounds: recollection rounds used (0 on the Familiarity path).
        dense_score: the item's exact cosine to the query (float; None when unknown).
        lexical_score: the item's BM25 score for the query's text within its user's
            memory (float, 0.0 for no lexical hit; None when the search was dense-only or
            the query a vector). With a lexical channel (``RFMemConfig.lexical_weight >
            0``, docs "Hybrid retrieval") ``score`` is the fused score of the two.
    """

    id: Hashable
    text: str | None
    score: float
    metadata: dict
    rank: int
    user_id: Hashable
    route: str | None
    rule: str
    mean: float
    entropy: float
    rounds: int
    dense_score: float | None = None
    lexical_score: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


class Hits(list):
    """The hits of one query (a ``list[Hit]``, best first) plus the query's own signals.

    Attributes:
        user_id: the query's user.
        route: "familiarity" / "recollection", or None when the user has no memory.
        rule: the router rule (``RULE_NAMES``), "unknown_user" for a user never seen,
            "no_hits" when the whole bank is empty.
        mean, entropy: the probe's familiarity signals (0.0 without items).
        rounds: recollection rounds used.
        cached: True when the answer came from the hot-query cache.
    """

    def __init__(self, hits: Sequence[Hit] = (), *, user_id: Hashable, route: str | None, rule: str,
                 mean: float, entropy: float, rounds: int, cached: bool = False) -> None:
        super().__init__(hits)
        self.user_id = user_id
        self.route = route
        self.rule = rule
        self.mean = mean
        self.entropy = entropy
        self.rounds = rounds
        self.cached = cached

    def to_dict(self) -> dict[str, Any]:
        """{"user_id", "route", "rule", "mean", "entropy", "rounds", "cached", "hits": [...]}."""
        return {
            "user_id": self.user_id, "route": self.route, "rule": self.rule, "mean": self.mean,
            "entropy": self.entropy, "rounds": self.rounds, "cached": self.cached,
            "hits": [h.to_dict() for h in self],
        }


@dataclass(frozen=True)
class Item:
    """A stored memory item: id, text (or None) and metadata ({} when none)."""

    id: Hashable
    text: str | None
    metadata: dict

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


@dataclass(frozen=True)
class BatchEvent:
    """What one batched run cost (passed to listeners, e.g. the HTTP metrics).

    Attributes:
        size: queries in the run (cache hits answered before it are not included).
        encoded: texts sent to the encoder (after the embedding cache).
        encode_seconds / search_seconds: wall time of the encoder call / of the
            :func:`rfmem_fast.search` calls.
        searches: :func:`rfmem_fast.search` calls made (one per (mode, k) group).
    """

    size: int
    encoded: int
    encode_seconds: float
    search_seconds: float
    searches: int


@dataclass(frozen=True)
class _Answer:
    """A query's answer as cached: immutable hits plus the query's signals."""

    user: Hashable
    hits: tuple
    route: str | None
    rule: str
    mean: float
    entropy: float
    rounds: int

    def materialise(self, cached: bool) -> Hits:
        # every caller gets its own metadata dicts (an empty one included): a caller
        # mutating its hits never changes the cached answer or another caller's hits
        hits = [replace(h, metadata=copy.deepcopy(h.metadata)) for h in self.hits]
        return Hits(hits, user_id=self.user, route=self.route, rule=self.rule, mean=self.mean,
                    entropy=self.entropy, rounds=self.rounds, cached=cached)


@dataclass
class _Encoded:
    """A batch after its encode stage: the queries, their vectors (None where the
    encoder failed), ``out`` (the failures' exceptions, else None), texts encoded and
    the encoder's wall time (s)."""

    queries: list
    vectors: list
    out: list
    encoded: int
    encode_seconds: float


@dataclass(frozen=True)
class _Query:
    user: Hashable
    text: str | None
    vector: np.ndarray | None  # float32 [d] as given (the search normalises it)
    k: int
    mode: str
    qkey: tuple = field(compare=False)


# ---------------------------------------------------------------------- argument checks
# The id model (the same in Python and over HTTP): user ids and item ids are non-empty
# str of at most MAX_ID_LENGTH characters of valid Unicode; a Python int (or numpy
# integer) is converted to its decimal str, so ``7`` and ``"7"`` name the same user /
# item (and ``add(ids=[1, "1"])`` is a duplicate). Every id a Memory returns is a str.
def _canon_id(x: Any, name: str) -> str:
    """One user / item id as stored: a str (ints converted), checked (module id model)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a str or an int, got {type(x).__name__}")
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if not isinstance(x, str):
        raise TypeError(f"{name} must be a str or an int, got {type(x).__name__}")
    x = str(x)
    if not x:
        raise ValueError(f"{name} must be a non-empty str")
    if CHUNK_SEP in x:
        raise ValueError(f"{name} holds the character U+001F, reserved for the chunks of long texts")
    if len(x) > MAX_ID_LENGTH:
        raise ValueError(f"{name} is {len(x)} characters long; ids hold at most {MAX_ID_LENGTH}")
    return _check_unicode(x, name)


def _user_key(user: Any, name: str = "user_id") -> str:
    return _canon_id(user, name)


def _check_text(t: Any, name: str, *, what: str = "text") -> str:
    """A memory text or a query text: a non-blank str of valid Unicode, at most
    MAX_TEXT_CHARS characters."""
    if not isinstance(t, str):
        raise TypeError(f"{name} must be a str, got {type(t).__name__}")
    _check_unicode(t, name)
    if not t.strip():
        raise ValueError(f"{name} is empty or whitespace only: a {what} needs some words")
    if len(t) > MAX_TEXT_CHARS:
        raise ValueError(f"{name} is {len(t)} characters long; at most {MAX_TEXT_CHARS}")
    return str(t)


def _text_list(texts: Any, name: str = "texts") -> list[str] | None:
    if texts is None:
        return None
    if isinstance(texts, str):
        return [_check_text(texts, name)]
    if isinstance(texts, bytes) or not hasattr(texts, "__iter__"):
        raise TypeError(f"{name} must be a str or a sequence of str, got {type(texts).__name__}")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise TypeError(f"{name}[{i}] must be a str, got {type(t).__name__}")
        out[i] = _check_text(t, f"{name}[{i}]")
    return out


def _id_list(ids: Any, name: str = "ids") -> list[str]:
    """A single id (str / int) or a sequence of distinct ids, as a non-empty list of str."""
    if isinstance(ids, (str, int, np.integer, np.str_)) and not isinstance(ids, (bool, np.bool_)):
        ids = [ids]
    if isinstance(ids, (bytes, dict)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be an id or a sequence of str or int item ids, got {type(ids).__name__}")
    out = [_canon_id(x, f"{name}[{i}]") for i, x in enumerate(ids)]
    out = _check_id_list(out, name)  # duplicates (after int -> str)
    if not out:
        raise ValueError(f"{name} must hold at least one item id")
    return out


def _metadata_list(metadata: Any, m: int) -> list | None:
    """None, one dict for every item, or m dicts / None; checked as stored (JSON objects
    of valid Unicode: :func:`rfmem_fast.bank._check_metadata`), before anything is logged,
    so the in-memory and the durable Memory refuse the same values with the same message."""
    if metadata is None:
        return None
    if isinstance(metadata, dict):
        return _check_metadata([metadata], 1) * m  # the bank stores a copy per item
    if isinstance(metadata, (str, bytes)) or not hasattr(metadata, "__iter__"):
        raise TypeError(f"metadata must be a dict, a sequence of dicts (or None) or None, got {type(metadata).__name__}")
    out = list(metadata)
    if len(out) != m:
        raise ValueError(f"metadata has {len(out)} entries but there are {m} items")
    return _check_metadata(out, m)


def _check_k(k: Any) -> None:
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an int in [1, {MAX_K}] or None, got {k!r}")


# ---------------------------------------------------------------------- the facade
class Memory:
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
            (:func:`rfmem_fast.encoders.resolve_backend`: ONNX float32 where it is
            installed). Only for the default encoder, like ``encoder_dtype``.
        config: RFMemConfig (default: the spec's defaults); ``k`` in :meth:`search`
            overrides its ``out_k`` per call.
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
            score, whole text and metadata), reads show items, and update / delete
            of the item replace / remove all its chunks.

    Ids: user ids and item ids are str (1-256 characters, valid Unicode, no U+001F);
    an int is converted to its decimal str (``7`` and ``"7"`` are one id), the same
    model as the HTTP service.

    Raises:
        ValueError: ``path`` is a file or a non-empty directory that is not a Memory,
            a dimension mismatch between ``dim`` / the encoder / the stored memory,
            ``encoder_dtype`` / ``encoder_backend`` with an ``encoder`` given or a pair
            :func:`rfmem_fast.encoders.check_backend` refuses, an unknown or unbuilt ``backend``
            name (checked here, not at the first search), or an option out of range.
            StoreError: a corrupt store or log.
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
        if config is None:
            config = RFMemConfig()
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
        if path is None:
            self.bank = MemoryBank(self._resolve_dim(dim, enc_dim, None), lexical_stemmer=default_stemmer())
        else:
            try:
                self._open(Path(os.fspath(path)), dim, enc_dim, fsync)
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

    @staticmethod
    def _check_workers(workers: Any, encoder: Any, encoders: list | None, batching: bool, pipeline: bool) -> int:
        """The number of encoder workers (``encoder_workers`` checked against the rest).

        Raises:
            ValueError / TypeError: a bad value, or more than one worker without the
                default encoder (or a list of encoders), batching or the pipeline.
        """
        if not isinstance(pipeline, bool):
            raise TypeError(f"pipeline must be a bool, got {type(pipeline).__name__}")
        if workers is None or workers == "auto":
            if encoders is not None:
                return len(encoders)
            if workers is None or encoder is not None or not batching or not pipeline:
                return 1  # the default, one given encoder, or no pipeline: one worker
            return default_encoder_workers()
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"encoder_workers must be an int >= 1, 'auto' or None, got {workers!r}")
        if encoders is not None and workers != len(encoders):
            raise ValueError(f"encoder_workers={workers} but encoder is a list of {len(encoders)}: one per worker")
        if workers > 1:
            if encoder is False:
                raise ValueError(f"encoder_workers={workers} needs a text encoder; this Memory has encoder=False")
            if encoder is not None and encoders is None:
                raise ValueError(f"encoder_workers={workers} needs one encoder per worker: pass encoder=[...] "
                                 f"({workers} encoders) or the default encoder (encoder=None)")
            if not batching or not pipeline:
                raise ValueError(f"encoder_workers={workers} needs batching=True and pipeline=True "
                                 "(the workers are the pipeline's encode stage)")
        return workers

    # ------------------------------------------------------------------ opening
    @staticmethod
    def _resolve_dim(dim: int | None, enc_dim: Any, stored: int | None) -> int:
        """The memory's dimension from the stored memory, ``dim`` and the encoder's."""
        for name, val in (("dim", dim), ("encoder.dim", enc_dim)):
            if val is not None and stored is not None and int(val) != stored:
                raise ValueError(f"{name}={val} does not match the stored memory's dimension {stored}")
        if dim is not None and enc_dim is not None and int(enc_dim) != dim:
            raise ValueError(f"dim={dim} does not match encoder.dim={enc_dim}")
        if stored is not None:
            return stored
        return int(dim if dim is not None else enc_dim if enc_dim is not None else DEFAULT_DIM)

    def _open(self, path: Path, dim: int | None, enc_dim: Any, fsync: bool) -> None:
        if path.exists() and not path.is_dir():
            raise ValueError(f"path {str(path)!r} is a file, expected a Memory directory")
        meta_path = path / META_FILE
        self._path = path
        if meta_path.is_file():
            self._take_lock(path)
            meta = self._read_meta(meta_path)
            stored_dim = meta["dim"]
            self._resolve_dim(dim, enc_dim, stored_dim)
            store = meta["store"]
            self.bank = MemoryBank.load(path / store) if store else MemoryBank(stored_dim, lexical_stemmer=default_stemmer())
            if self.bank.dim != stored_dim:
                raise StoreError(path / store, f"holds dimension {self.bank.dim}, {META_FILE} says {stored_dim}")
            self._store_gen = int(store[len(_STORE_PREFIX):]) if store else 0
            self._seq = meta["wal_seq"]
        else:
            if path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir()):
                raise ValueError(
                    f"path {str(path)!r} is a non-empty directory without {META_FILE} (not a Memory); "
                    "use an empty or new directory"
                )
            path.mkdir(parents=True, exist_ok=True)
            self._take_lock(path)
            self.bank = MemoryBank(self._resolve_dim(dim, enc_dim, None), lexical_stemmer=default_stemmer())
            self._write_meta(None)
            store = None
        for entry in path.iterdir():  # leftovers of an interrupted checkpoint
            if entry.name.startswith(_STORE_PREFIX) and entry.name != store and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(f".{META_FILE}.tmp-"):
                entry.unlink(missing_ok=True)
        self._index_chunks()
        self._wal = WriteAheadLog(path / WAL_FILE, fsync=fsync)
        self._replay(self._seq)

    def _take_lock(self, path: Path) -> None:
        """Hold ``path/LOCK`` (an exclusive flock) while open: a second process (or a
        second Memory in this one) on the same directory would interleave log appends.

        Raises:
            MemoryLockedError (a RuntimeError): the directory is open elsewhere.
        """
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on POSIX: no cross-process guard
            return
        f = open(path / LOCK_FILE, "a+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise MemoryLockedError(
                f"the memory at {str(path)!r} is open in another process or Memory (its {LOCK_FILE} is held); "
                "close that one first"
            ) from None
        self._lock_file = f

    def _read_meta(self, meta_path: Path) -> dict[str, Any]:
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StoreError(meta_path, f"cannot be read: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            raise StoreError(meta_path, f"is not an {FORMAT_NAME} file")
        if meta.get("format_version") != FORMAT_VERSION:
            raise StoreError(meta_path, f"format_version {meta.get('format_version')!r} is not {FORMAT_VERSION}")
        d, store, seq = meta.get("dim"), meta.get("store"), meta.get("wal_seq")
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise StoreError(meta_path, f"dim must be an int >= 1, got {d!r}")
        if store is not None and (not isinstance(store, str) or not store.startswith(_STORE_PREFIX) or "/" in store):
            raise StoreError(meta_path, f"invalid store name {store!r}")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise StoreError(meta_path, f"wal_seq must be an int >= 0, got {seq!r}")
        return meta

    def _write_meta(self, store: str | None) -> None:
        """Replace memory.json atomically (temp file, fsync, rename, fsync dir)."""
        assert self._path is not None
        doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "dim": self.bank.dim,
               "store": store, "wal_seq": self._seq}
        tmp = self._path / f".{META_FILE}.tmp-{uuid.uuid4().hex[:12]}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path / META_FILE)
        _fsync_dir(self._path)

    def _replay(self, done_seq: int) -> None:
        """Apply the log's records with seq > done_seq that were not aborted."""
        assert self._wal is not None
        records = list(self._wal.replay())
        aborted = {r["seq"] for r in records if r["op"] == "abort"}
        for rec in records:
            seq = rec["seq"]
            self._seq = max(self._seq, seq)
            if rec["op"] == "abort" or seq <= done_seq or seq in aborted:
                continue
            try:
                self._apply(rec)
                self._counters["replayed"] += 1
            except (ValueError, TypeError, KeyError) as exc:  # it failed the same way when logged
                self._counters["replay_skipped"] += 1
                log.warning("skipping logged write seq=%s that does not apply: %s", seq, exc)

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
            encoder's class name, "dtype": the precision in use ("float32",
            "bfloat16", "float16"; the one asked, e.g. "auto", while the default
            encoder is not loaded yet; None when the encoder does not say),
            "device": str or None, "loaded": bool}. The encoder workers and the
            pipeline are in ``stats()["batcher"]`` ("workers", "pipeline").
        """
        if not self._has_encoder:
            return None
        enc = self._encoder
        if enc is None:
            return {"model": "all-MiniLM-L6-v2 (default, not loaded yet)",
                    "dtype": self._encoder_kwargs.get("dtype", "float32"), "device": "cpu", "loaded": False}
        dtype, device = getattr(enc, "dtype", None), getattr(enc, "device", None)
        return {"model": str(getattr(enc, "model_path", type(enc).__name__)),
                "dtype": None if dtype is None else str(dtype), "device": None if device is None else str(device),
                "loaded": True}

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

    @contextlib.contextmanager
    def _borrow_encoder(self) -> Any:
        """An encoder for one encode call: the only one, or a free one of the workers'
        (waits while all are busy); given back when the block ends."""
        enc = self._get_encoder()
        if len(self._encoders) < 2:
            yield enc
            return
        enc = self._pool.get()
        try:
            yield enc
        finally:
            self._pool.put(enc)

    def _encode_with(self, enc: Any, texts: list[str]) -> np.ndarray:
        """``enc.encode(texts)`` as a checked float array [len(texts), d].

        Raises:
            ValueError / TypeError: an output of the wrong shape / type."""
        raw = enc.encode(texts)
        if hasattr(raw, "detach"):
            raw = raw.detach().cpu().float().numpy()
        out = np.asarray(raw)
        if out.ndim != 2 or out.shape[0] != len(texts) or out.shape[1] != self.dim:
            raise ValueError(f"the encoder returned shape {out.shape}, expected ({len(texts)}, {self.dim})")
        if not np.issubdtype(out.dtype, np.floating):
            raise TypeError(f"the encoder returned {out.dtype} values, expected floats")
        return out

    def _encode_shared(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts`` with a borrowed encoder, and with every other encoder idle now
        (work sharing: with ``encoder_workers`` > 1 a lone batch is split over the idle
        encoders, each part encoded at once, so one batch in flight still uses every
        worker's threads; busy workers are never waited for, and never more encoder
        threads run than the workers have). The parts are balanced by text length
        (length-sorted texts dealt round-robin); row i is ``texts[i]``'s embedding.

        Raises:
            What an encoder call raises (every part is finished first), ValueError /
            TypeError as :meth:`_encode_with`."""
        with self._borrow_encoder() as enc:
            idle = self._borrow_idle(len(texts) - 1)
            if not idle:
                return self._encode_with(enc, texts)
            try:
                order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
                k = len(idle) + 1
                parts = [order[j::k] for j in range(k)]
                futs = [self._helpers().submit(self._encode_with, e, [texts[i] for i in idx])
                        for e, idx in zip(idle, parts[1:])]
                try:
                    outs = [self._encode_with(enc, [texts[i] for i in parts[0]])]
                finally:
                    cf.wait(futs)  # every part done before its encoder goes back to the pool
                outs += [f.result() for f in futs]
            finally:
                for e in idle:
                    self._pool.put(e)
        out = np.empty((len(texts), self.dim), dtype=np.result_type(*outs))
        for idx, part in zip(parts, outs):
            out[idx] = part
        return out

    def _borrow_idle(self, most: int) -> list:
        """Up to ``most`` encoders free right now (never waits); give them back to the pool."""
        got: list = []
        if len(self._encoders) < 2:
            return got
        while len(got) < most:
            try:
                got.append(self._pool.get_nowait())
            except queue.Empty:
                break
        return got

    def _helpers(self) -> cf.ThreadPoolExecutor:
        """Threads that run the extra parts of a shared encode (one per extra encoder)."""
        if self._helper_pool is None:
            with self._encoder_lock:
                if self._helper_pool is None:
                    self._helper_pool = cf.ThreadPoolExecutor(max(1, len(self._encoders) - 1),
                                                              thread_name_prefix="rfmem-encode-helper")
        return self._helper_pool

    def _encode_rows(self, texts: list[str], name: str) -> list[np.ndarray | ValueError]:
        """One encoder call for ``texts``: per text its float32 [d] embedding, or a
        ValueError naming ``name[i]`` (or the query text) when the encoder returned a
        zero or non-finite row for it. Raises what the encoder call raises."""
        t0 = time.perf_counter()
        out = self._encode_shared(texts)
        dt = time.perf_counter() - t0
        with self._stats_lock:
            c = self._counters
            c["encode_calls"] += 1
            c["encoded"] += len(texts)
            c["encode_seconds"] += dt
        with np.errstate(over="ignore", invalid="ignore"):
            rows64 = out.astype(np.float64)
            norms = np.sqrt(np.einsum("ij,ij->i", rows64, rows64))
        rows: list[Any] = []
        for i, text in enumerate(texts):
            label = f"{name}[{i}]" if name != "query" else "query"
            if not np.isfinite(rows64[i]).all() or not np.isfinite(norms[i]) or norms[i] <= 1e-12 \
                    or np.abs(rows64[i]).max() > np.finfo(np.float32).max:
                rows.append(ValueError(
                    f"{label} {text[:60]!r}: the encoder returned a zero or non-finite embedding for this text, "
                    "so it cannot be searched or stored"))
            else:
                rows.append(out[i].astype(np.float32))
        return rows

    def _encode(self, texts: list[str], name: str = "texts") -> np.ndarray:
        """float32 [n, d] embeddings of ``texts`` (one encoder call).

        Raises:
            ValueError: the encoder's row for ``name[i]`` is zero or not finite (named)."""
        rows = self._encode_rows(texts, name)
        for r in rows:
            if isinstance(r, BaseException):
                raise r
        return np.stack(rows) if rows else np.zeros((0, self.dim), np.float32)

    def _vectors(self, vectors: Any, name: str = "vectors") -> np.ndarray:
        """float32 [m, d] from a [m, d] or [d] array (rows checked, not yet normalised)."""
        arr = vectors
        if isinstance(arr, (str, bytes)):
            raise TypeError(f"{name} must be a float array, got {type(arr).__name__}")
        if not (hasattr(arr, "detach") or isinstance(arr, np.ndarray)):
            try:
                arr = np.asarray(arr)
            except (ValueError, TypeError) as exc:  # ragged nested lists
                raise ValueError(f"{name} must be a [m, d] or [d] array of floats: {exc}") from None
        if getattr(arr, "ndim", None) == 1:
            arr = arr[None, :]
        out = as_float_matrix(arr, name, self.dim)
        l2_normalize_rows(out, name)  # refuses zero rows now, before anything is logged
        return out

    # ------------------------------------------------------------------ writes
    def _check_open(self) -> None:
        if self._closed:
            raise BatcherClosedError("this Memory is closed")
        if self._broken is not None:
            raise RuntimeError(f"this Memory stopped accepting writes after a log failure: {self._broken}")

    def _write(self, record: dict[str, Any]) -> None:
        """Log (durably), then apply one write; an apply that fails is logged as aborted."""
        with self._wmutex:
            self._check_open()
            seq = self._seq + 1
            rec = {"seq": seq, **record}
            if self._wal is not None:
                line = dict(rec)
                if line.get("vectors") is not None:
                    line["vectors"] = encode_array(line["vectors"])
                if line.get("extra_vectors") is not None:
                    line["extra_vectors"] = encode_array(line["extra_vectors"])
                try:
                    self._wal.append(line)
                except (TypeError, ValueError, RecursionError) as exc:  # not JSON: nothing was written
                    raise ValueError(f"cannot log this write: {exc}") from None
                except OSError as exc:  # a partial line may be on disk: stop writing
                    self._broken = exc
                    raise
            self._seq = seq
            try:
                with self._rw.write():
                    self._apply(rec)
            except BaseException:
                if self._wal is not None:
                    try:
                        self._wal.append({"seq": seq, "op": "abort"})
                    except OSError as exc:  # replay re-fails the same write: still consistent
                        self._broken = exc
                raise
            with self._stats_lock:
                self._counters["writes"] += 1
            if self._wal is not None and self._checkpoint_bytes is not None and self._wal.nbytes > self._checkpoint_bytes:
                self._checkpoint_locked()

    def _apply(self, rec: dict[str, Any]) -> None:
        """Apply one logged write to the bank (live or replayed); bump the user's version."""
        op, user = rec["op"], rec["user"]
        if isinstance(user, int):  # a record of an older version (int keys): the id model's str
            user = str(user)
        if rec.get("ids") is not None and any(isinstance(i, int) for i in rec["ids"]):
            rec = dict(rec, ids=[str(i) if isinstance(i, int) else i for i in rec["ids"]])
        vec = rec.get("vectors")
        if isinstance(vec, dict):
            vec = decode_array(vec)
        chunks = self._chunks.setdefault(user, {})
        if op == "add":
            self.bank.add(user, vec, rec["ids"], texts=rec["texts"], metadata=rec["metadata"])
            self._note_chunks(chunks, rec["ids"])
        elif op == "update" and vec is None:  # metadata only (a new text always comes with its vector)
            self.bank.set_metadata(user, rec["ids"], rec["metadata"])
        elif op == "update":
            drop, extra = rec.get("drop") or [], rec.get("extra_ids") or []
            if drop or extra:  # check first: the update must not fail after its old chunks went
                held = set(self.bank.item_ids_of(user)) if user in self.bank else set()
                missing = [i for i in rec["ids"] if i not in held]
                if missing:
                    raise KeyError(f"ids: user {user!r} holds no item id {missing[0]!r}")
            if drop:
                self.bank.delete(user, drop)
            self.bank.update(user, rec["ids"], vec, texts=rec["texts"], metadata=rec["metadata"])
            for i in rec["ids"]:
                chunks.pop(i, None)
            if extra:
                ev = rec["extra_vectors"]
                self.bank.add(user, decode_array(ev) if isinstance(ev, dict) else ev, extra)
                self._note_chunks(chunks, extra)
        elif op == "delete":
            self.bank.delete(user, rec["ids"])
            for i in rec["ids"]:
                if CHUNK_SEP not in i:
                    chunks.pop(i, None)
        elif op == "delete_user":  # every live item of the user ("forget me")
            if user in self.bank and self.bank.user_size(user):
                self.bank.delete(user, self.bank.item_ids_of(user))
            chunks.clear()
        else:
            raise ValueError(f"unknown logged operation {op!r}")
        self._uver[user] = self._uver.get(user, 0) + 1
        self._cache.invalidate(user)

    # ------------------------------------------------------------------ long texts
    @staticmethod
    def _note_chunks(chunks: dict[str, int], ids: list) -> None:
        for i in ids:
            if isinstance(i, str) and CHUNK_SEP in i:
                parent, _, j = i.rpartition(CHUNK_SEP)
                chunks[parent] = max(chunks.get(parent, 0), int(j))

    def _index_chunks(self) -> None:
        """Rebuild the chunk map from the bank's row ids (on open, before the replay)."""
        self._chunks = {}
        for user in self.bank.users:
            ids = [i for i in self.bank.item_ids_of(user) if isinstance(i, str) and CHUNK_SEP in i]
            if ids:
                self._note_chunks(self._chunks.setdefault(user, {}), ids)

    def _extra_rows(self, user: Hashable) -> int:
        """Bank rows of ``user`` that are extra chunks of long texts (not items)."""
        c = self._chunks.get(user)
        return sum(c.values()) if c else 0

    def _chunk_ids_of(self, user: Hashable, ids: list) -> list[str]:
        """The extra chunk rows of the items ``ids`` of ``user``."""
        c = self._chunks.get(user) or {}
        return [f"{p}{CHUNK_SEP}{j}" for p in ids for j in range(1, c.get(p, 0) + 1)]

    def _split(self, texts: list[str], name: str = "texts") -> list[list[str]]:
        """Per text, its chunks: ``[text]`` when it fits the encoder's window (or the
        encoder does not tell one), else overlapping windows of the text itself.

        Raises:
            ValueError: a text over the window of an encoder that tells its window
                (``max_tokens``, ``count_tokens``) but cannot cut (no ``token_spans``).

        A chunk holds at most ``max_tokens`` minus the special tokens of the encoder's
        tokenizer (254 for all-MiniLM-L6-v2), consecutive chunks share
        ``chunk_overlap`` tokens; each chunk is the exact substring its tokens span.
        The tokenizer used is a borrowed encoder's (never one a worker is encoding with)."""
        with self._borrow_encoder() as enc:
            return self._split_with(enc, texts, name)

    def _split_with(self, enc: Any, texts: list[str], name: str) -> list[list[str]]:
        """:meth:`_split` with the tokenizer of ``enc``."""
        limit, count = getattr(enc, "max_tokens", None), getattr(enc, "count_tokens", None)
        spans_of = getattr(enc, "token_spans", None)
        if limit is None or not callable(count):
            return [[t] for t in texts]
        counts = count(texts)
        long = [i for i, n in enumerate(counts) if n > limit]
        out = [[t] for t in texts]
        if not long:
            return out
        if not callable(spans_of):  # a window but no way to cut: refuse rather than truncate
            i = long[0]
            raise ValueError(
                f"{name}[{i}] is {counts[i]} tokens long, but the encoder reads at most {limit} tokens "
                f"(special tokens included) and would silently ignore the rest; this encoder has no "
                f"token_spans() to chunk it: split it into memories of at most {limit} tokens")
        size = int(limit) - int(count([""])[0])  # room for the text's own tokens
        step = size - self._chunk_overlap
        if step < 1:
            raise ValueError(f"chunk_overlap={self._chunk_overlap} leaves no room in the encoder's window of "
                             f"{size} text tokens: use a smaller chunk_overlap")
        for i, spans in zip(long, spans_of([texts[i] for i in long])):
            t, parts = texts[i], []
            for a in range(0, len(spans), step):
                win = spans[a:a + size]
                parts.append(t[win[0][0]:win[-1][1]])
                if a + size >= len(spans):
                    break
            out[i] = parts
        return out

    def _encode_items(self, tx: list[str], id_list: list[str]) -> tuple[np.ndarray, list[str], np.ndarray | None]:
        """Embeddings of items' texts, long ones chunked: (one row per item: its first
        chunk; the extra chunks' row ids; their rows, or None)."""
        parts = self._split(tx)
        flat = [c for p in parts for c in p]
        rows = self._encode(flat)
        if len(flat) == len(tx):
            return rows, [], None
        first, extra_ids, extra_rows, r = [], [], [], 0
        for pid, p in zip(id_list, parts):
            first.append(rows[r])
            for j in range(1, len(p)):
                extra_ids.append(f"{pid}{CHUNK_SEP}{j}")
                extra_rows.append(rows[r + j])
            r += len(p)
        return np.stack(first), extra_ids, np.stack(extra_rows)

    def add(
        self,
        texts: str | Sequence[str] | None,
        user_id: Hashable,
        ids: Sequence[Hashable] | Hashable | None = None,
        metadata: dict | Sequence[dict | None] | None = None,
        *,
        vectors: Any = None,
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

        Returns:
            list of the m item ids (str).

        Raises:
            ValueError: neither texts nor vectors, mismatched lengths, a wrong
                dimension, NaN / Inf / zero vectors (a text the encoder embeds as one:
                ``texts[i]`` named), a duplicate id or one the user already holds,
                metadata that is not JSON (``metadata[i]`` named), an empty / blank
                text or one with a lone surrogate (``texts[i]``), no encoder for texts.
            TypeError: arguments of the wrong type.
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
            raise ValueError(f"texts has {m} entries but vectors has {vec.shape[0]} rows")
        if m == 0:
            raise ValueError("add needs at least one item")
        id_list = [uuid.uuid4().hex for _ in range(m)] if ids is None else _id_list(ids)
        if len(id_list) != m:
            raise ValueError(f"ids has {len(id_list)} entries but there are {m} items")
        meta = _metadata_list(metadata, m)
        extra_ids: list[str] = []
        if vec is None:
            vec, extra_ids, extra = self._encode_items(tx, id_list)
        texts_out = tx if tx is not None else [None] * m
        if extra_ids:  # a long text: its extra chunks are rows of their own, after the items
            vec = np.concatenate([vec, extra])
            texts_out = texts_out + [None] * len(extra_ids)
            meta = None if meta is None else meta + [None] * len(extra_ids)
        self._write({"op": "add", "user": user, "ids": id_list + extra_ids, "texts": texts_out,
                     "vectors": vec, "metadata": meta})
        return id_list

    def update(
        self,
        ids: Sequence[Hashable] | Hashable,
        user_id: Hashable,
        texts: str | Sequence[str] | None = None,
        *,
        vectors: Any = None,
        metadata: dict | Sequence[dict | None] | None = None,
    ) -> None:
        """Change existing items (keeping their ids); durable once it returns.

        Args:
            ids: one item id or m ids the user holds.
            user_id: the user.
            texts: new texts (re-encoded unless ``vectors`` is given), or None to keep.
            vectors: new [m, d] vectors, or None (keep, or encode the new texts).
            metadata: a dict for every item or m dicts (None clears one), or None to keep.

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
                raise ValueError(f"{name} has {n} entries but ids has {m}")
        meta = _metadata_list(metadata, m)
        if tx is None and vec is None and meta is None:
            raise ValueError("update needs texts, vectors or metadata")
        if user not in self.bank:
            raise KeyError(f"user_id: unknown user {user!r}")
        extra_ids: list[str] = []
        extra = None
        if tx is not None and vec is None:
            vec, extra_ids, extra = self._encode_items(tx, id_list)
        rec = {"op": "update", "user": user, "ids": id_list, "texts": tx, "vectors": vec, "metadata": meta}
        if vec is not None:  # a new text / vector replaces the item's chunks
            with self._wmutex:
                drop = self._chunk_ids_of(user, id_list)
                if drop or extra_ids:
                    rec.update(drop=drop, extra_ids=extra_ids, extra_vectors=extra)
                self._write(rec)
            return
        self._write(rec)

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
            self._write({"op": "delete", "user": user, "ids": id_list + self._chunk_ids_of(user, id_list)})

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
        return [Item(i, text_of[i], m or {}) for i, m in zip(ids, metas)]

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
        return [Item(i, text_of[i], m or {}) for i, m in zip(id_list, metas)]

    def users(self) -> list[Hashable]:
        """Every user key ever written (users whose items were all deleted included)."""
        return self.bank.users

    # ------------------------------------------------------------------ search
    def _config_for(self, k: int) -> RFMemConfig:
        cfg = self._configs.get(k)
        if cfg is None:
            if len(self._configs) > 1024:  # k + a user's chunk rows: many values over time
                self._configs = {self._config.out_k: self._config}
            cfg = self._configs[k] = self._config.replace(out_k=int(k))
        return cfg

    def _prepare(self, query: Any, user_id: Any, k: Any, mode: Any, name: str = "query") -> _Query:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        _check_k(k)
        k = self._config.out_k if k is None else int(k)
        user = _user_key(user_id)
        if isinstance(query, str):
            if not self._has_encoder:
                raise ValueError(f"{name}: this Memory has no text encoder (encoder=False); pass a vector")
            query = _check_text(query, name, what="query")
            return _Query(user, query, None, k, mode, ("text", query))
        if isinstance(query, bytes) or query is None:
            raise TypeError(f"{name} must be a str or a 1-D vector of floats, got {type(query).__name__}")
        if name == "query" and isinstance(query, (list, tuple)) and query and isinstance(query[0], str):
            raise TypeError("query must be one str or one 1-D vector; for several queries use "
                            "Memory.search_batch(queries, user_ids)")
        arr = query if (hasattr(query, "detach") or isinstance(query, np.ndarray)) else np.asarray(query)
        if getattr(arr, "ndim", None) != 1:
            raise ValueError(f"{name} must be a str or a 1-D vector of {self.dim} floats, got shape {tuple(getattr(arr, 'shape', ()))}")
        vec = self._vectors(arr, name)[0]
        return _Query(user, None, vec, k, mode, vector_key(vec))

    def _start(self, query: Any, user_id: Any, k: Any, mode: Any) -> tuple[_Query, Hits | None]:
        """A checked query and its cached answer (None on a miss)."""
        self._check_open()
        q = self._prepare(query, user_id, k, mode)
        hit = self._cached(q)
        return q, (hit.materialise(cached=True) if hit is not None else None)

    def _cached(self, q: _Query) -> _Answer | None:
        key = QueryCache.result_key(q.user, self._uver.get(q.user, 0), q.qkey, q.mode, q.k)
        return self._cache.get_result(key)

    def search(self, query: str | Any, user_id: Hashable, k: int | None = None, mode: str = "rfmem",
               timeout: float | None | str = "default") -> Hits:
        """RF-Mem retrieval of one query within one user's memory.

        Args:
            query: the query text, or a 1-D vector of d floats.
            user_id: the user whose memory is searched (no other user's items can come back).
            k: hits wanted (default ``config.out_k``).
            mode: "rfmem" (probe, route, routed path), "dense" or "recollection".
            timeout: seconds to wait for the micro-batch (default: the Memory's).

        Returns:
            Hits (a list of Hit, best first, at most k; [] for a user with no
            memory) with the query's route / rule / mean / entropy / rounds.

        Raises:
            ValueError / TypeError: a bad query (empty / blank text, lone surrogate, a
                list: use :meth:`search_batch`), user, k (an int in [1, MAX_K]) or mode
                (named); a query the encoder embeds as a zero / non-finite vector (it
                fails alone, never the other requests of its micro-batch).
            QueueFullError, RequestTimeoutError: overload (batching on).
            BatcherClosedError: the Memory is closed (or closing).
        """
        q, hits = self._start(query, user_id, k, mode)
        if hits is not None:
            return hits
        if self._batcher is not None:
            ans = self._batcher.call(q, timeout)
        else:
            ans = self._run_one(q)
        return ans.materialise(cached=False)

    async def asearch(self, query: str | Any, user_id: Hashable, k: int | None = None, mode: str = "rfmem",
                      timeout: float | None | str = "default") -> Hits:
        """Asyncio version of :meth:`search`: concurrent awaits share micro-batches."""
        q, hits = self._start(query, user_id, k, mode)
        if hits is not None:
            return hits
        if self._batcher is not None:
            ans = await self._batcher.acall(q, timeout)
        else:
            ans = await asyncio.to_thread(self._run_one, q)
        return ans.materialise(cached=False)

    def _run_one(self, q: _Query) -> _Answer:
        out = self._run_batch([q])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def search_batch(self, queries: Sequence[Any] | Any, user_ids: Hashable | Sequence[Hashable],
                     k: int | None = None, mode: str = "rfmem") -> list[Hits]:
        """Many queries at once (one encode, one search per mode), in the caller's thread.

        Args:
            queries: b query texts and / or 1-D vectors, or a [b, d] float array.
            user_ids: one user for all, or b users (query i searches ``user_ids[i]``).
            k, mode: as :meth:`search`, for every query.

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
                raise ValueError(f"user_ids has {len(users)} entries but queries has {len(qs)}")
        prepared = [self._prepare(x, u, k, mode, name=f"queries[{i}]") for i, (x, u) in enumerate(zip(qs, users))]
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

    def _run_batch(self, queries: list[_Query]) -> list[_Answer | BaseException]:
        """Answer a batch: one encode of the uncached texts, one search per (mode, k)."""
        return self._search_encoded(self._encode_batch(queries))

    def _encode_batch(self, queries: list[_Query]) -> _Encoded:
        """Stage 1 of a batch (an encoder worker): the query vectors, one encode of the
        texts not in the embedding cache; a text the encoder fails on fails its own
        callers only. Touches no bank state (the search stage takes the snapshot)."""
        n = len(queries)
        out: list[Any] = [None] * n
        vecs: list[np.ndarray | None] = [q.vector for q in queries]
        need: dict[str, list[int]] = {}
        for i, q in enumerate(queries):
            if q.vector is None:
                v = self._cache.embeddings.get(q.text)
                if v is not None:
                    vecs[i] = v
                else:
                    need.setdefault(q.text, []).append(i)
        encode_s = 0.0
        if need:
            t0 = time.perf_counter()
            texts = list(need)
            try:  # a bad row (zero / non-finite) fails its own callers only
                rows: list[Any] = self._encode_rows(texts, "query")
            except Exception as exc:
                if len(texts) == 1:
                    rows = [exc]
                else:  # find the culprit: encode one by one, so only its callers fail
                    rows = []
                    for text in texts:
                        try:
                            rows.append(self._encode_rows([text], "query")[0])
                        except Exception as exc1:
                            rows.append(exc1)
            for text, row in zip(texts, rows):
                if not isinstance(row, BaseException):
                    row = row.copy()
                    self._cache.embeddings.put(text, row)
                for i in need[text]:
                    if isinstance(row, BaseException):
                        out[i] = row
                    else:
                        vecs[i] = row
            encode_s = time.perf_counter() - t0
        return _Encoded(queries, vecs, out, sum(len(v) for v in need.values()), encode_s)

    def _search_encoded(self, enc: _Encoded) -> list[_Answer | BaseException]:
        """Stage 2 of a batch (the search thread): one :func:`~rfmem_fast.search` per
        (mode, k) on ONE bank snapshot taken now, answers cached, listeners told."""
        queries, vecs, out = enc.queries, enc.vectors, enc.out
        n = len(queries)
        search_s, searches = 0.0, 0
        with self._rw.read():
            snap = self.bank.snapshot()
            known = {u: i for i, u in enumerate(snap.users)}
            groups: dict[tuple[str, int], list[int]] = {}
            for i, q in enumerate(queries):
                if out[i] is not None:
                    continue
                if q.user not in known or snap.num_items == 0:
                    rule = "unknown_user" if q.user not in known else "no_hits"
                    out[i] = _Answer(q.user, (), None, rule, 0.0, 0.0, 0)
                else:
                    # a user holding long texts: fetch enough rows to collapse to k items
                    k_rows = min(q.k + self._extra_rows(q.user), 1 << 20)
                    groups.setdefault((q.mode, k_rows), []).append(i)
            todo = list(groups.items())
            while todo:
                (mode, k), idx = todo.pop(0)
                t0 = time.perf_counter()
                try:
                    cfg = self._config_for(k)
                    lex = {"query_texts": [queries[i].text for i in idx]} if cfg.lexical_weight > 0 else {}
                    res = search(self.bank, np.stack([vecs[i] for i in idx]), [queries[i].user for i in idx],
                                 config=cfg, mode=mode, backend=self._backend, device=self._device, **lex)
                except Exception as exc:
                    if len(idx) > 1:  # find the culprit: search one by one, so only it fails
                        todo[:0] = [((mode, k), [i]) for i in idx]
                    else:
                        out[idx[0]] = exc
                    continue
                finally:
                    search_s += time.perf_counter() - t0
                    searches += 1
                texts = res.texts  # taken from the snapshot this search ran on
                routes, rules = res.route_names, res.rule_names
                rows = [self._collapse(res, j, texts[j], queries[i].k) for j, i in enumerate(idx)]
                metas = self._metadata_of([queries[i].user for i in idx], [r[0] for r in rows])
                parent_texts: dict[Hashable, dict] = {}
                for j, i in enumerate(idx):
                    q = queries[i]
                    try:
                        ids, scores, txt, from_chunk, chan = rows[j]
                        if any(from_chunk):  # a chunk's hit shows its item's whole text
                            pt = parent_texts.get(q.user)
                            if pt is None:
                                pt = parent_texts[q.user] = dict(zip(self.bank.item_ids_of(q.user),
                                                                     self.bank.texts_of(q.user)))
                            txt = [pt[x] if f else t for x, t, f in zip(ids, txt, from_chunk)]
                        out[i] = ans = self._answer(res, j, q.user, routes[j], rules[j], ids, scores, txt,
                                                    metas[q.user], chan)
                    except Exception as exc:  # pragma: no cover - defensive: fails this caller only
                        out[i] = exc
                        continue
                    key = QueryCache.result_key(q.user, self._uver.get(q.user, 0), q.qkey, mode, q.k)
                    self._cache.put_result(key, ans)
        with self._stats_lock:
            c = self._counters
            c["runs"] += 1
            c["queries"] += n
            c["searches"] += searches
            c["search_seconds"] += search_s
        if self._listeners:
            ev = BatchEvent(n, enc.encoded, enc.encode_seconds, search_s, searches)
            for fn in list(self._listeners):
                try:
                    fn(ev)
                except Exception:  # a listener never breaks a search
                    log.exception("batch listener failed")
        return out

    def _metadata_of(self, users: list[Hashable], hit_ids: list[list]) -> dict[Hashable, dict]:
        """{user: {item id: metadata or None}} for the hits of a batch: ONE bank lookup
        per user rather than one per query (the bank checks the ids and deep-copies)."""
        wanted: dict[Hashable, dict] = {}
        for user, ids in zip(users, hit_ids):
            wanted.setdefault(user, {}).update(dict.fromkeys(ids))
        return {u: dict(zip(ids, self.bank.get_metadata(u, list(ids)))) if ids else {} for u, ids in wanted.items()}

    @staticmethod
    def _collapse(res: SearchResult, j: int, texts: np.ndarray, k: int) -> tuple[list, list, list, list, list]:
        """Query ``j``'s hit rows collapsed to items: a long text's chunk rows count as
        their item (its best-ranked row; the first k items). Returns (ids, scores,
        texts, from_chunk, channels): from_chunk[r] when item r's best row was an extra
        chunk (its text is then looked up); channels[r] its (dense, lexical) scores
        (None where unknown)."""
        ok = res.rows[j] >= 0
        ids, scores, txt = res.ids[j][ok].tolist(), res.scores[j][ok].tolist(), texts[ok].tolist()
        chan = [tuple(_finite_or_none(v) for v in pair) for pair in zip(
            res.dense_scores[j][ok].tolist() if res.dense_scores is not None else [None] * len(ids),
            res.lexical_scores[j][ok].tolist() if res.lexical_scores is not None else [None] * len(ids),
        )]  # fmt: skip
        if not any(isinstance(i, str) and CHUNK_SEP in i for i in ids):
            return ids[:k], scores[:k], txt[:k], [False] * min(k, len(ids)), chan[:k]
        out_ids, out_s, out_t, out_f, out_c, seen = [], [], [], [], [], set()
        for i, sc, t, c in zip(ids, scores, txt, chan):
            chunk = isinstance(i, str) and CHUNK_SEP in i
            parent = i.rpartition(CHUNK_SEP)[0] if chunk else i
            if parent in seen:
                continue
            seen.add(parent)
            out_ids.append(parent)
            out_s.append(sc)
            out_t.append(None if chunk else t)
            out_f.append(chunk)
            out_c.append(c)
            if len(out_ids) == k:
                break
        return out_ids, out_s, out_t, out_f, out_c

    def _answer(self, res: SearchResult, j: int, user: Hashable, route: str, rule: str, ids: list,
                scores: list, txt: list, metas: dict, chan: list) -> _Answer:
        """Query ``j`` of ``res`` as an immutable answer (hits with texts and metadata):
        ``ids`` / ``scores`` / ``txt`` its hits (:meth:`_collapse`), ``metas`` {id:
        metadata} of its user (:meth:`_metadata_of`)."""
        mean, ent, rounds = float(res.mean[j]), float(res.entropy[j]), int(res.rounds[j])
        hits = tuple(
            Hit(i, t, s, metas[i] or {}, r, user, route, rule, mean, ent, rounds, c[0], c[1])
            for r, (i, t, s, c) in enumerate(zip(ids, txt, scores, chan))
        )
        return _Answer(user, hits, route, rule, mean, ent, rounds)

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

    def _checkpoint_locked(self) -> None:
        assert self._path is not None and self._wal is not None
        gen = self._store_gen + 1
        name = f"{_STORE_PREFIX}{gen:08d}"
        self.bank.save(self._path / name)
        self._write_meta(name)
        self._wal.reset()
        for entry in self._path.iterdir():
            if entry.name.startswith(_STORE_PREFIX) and entry.name != name and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
        self._store_gen = gen
        with self._stats_lock:
            self._counters["checkpoints"] += 1

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
