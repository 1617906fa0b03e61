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
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import copy
import json
import logging
import math
import os
import queue
import re
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import numpy as np

from .._validate import as_float_matrix, l2_normalize_rows
from ..bank import (INSTANT_END, INSTANT_MIN, INSTANT_RANGE, MemoryBank, _check_id_list, _check_metadata,
                    _check_unicode, check_instant, instants_known)
from ..config import RFMemConfig
from ..filters import Filter, parse_filter, parse_instant
# CHUNK_SEP separates a parent item id from a chunk number in the bank's row ids of a long
# text's extra chunks ("<parent>\x1f<j>", j >= 1; the lexical index reads them as one item);
# refused in user-given ids
from ..lexical import CHUNK_SEP
from ..routing.files import check_config_files
from ..search import MODES, SearchResult, search
from ..store import StoreError, _fsync_dir
from ._rwlock import RWLock
from .batcher import BatcherClosedError, MicroBatcher
from .cache import QueryCache, vector_key
from .wal import WriteAheadLog, decode_array, encode_array

__all__ = ["Memory", "Hit", "Hits", "Item", "BatchEvent", "DEFAULT_DIM", "MAX_K", "MAX_ID_LENGTH", "MAX_TEXT_CHARS",
           "ITEM_FIELDS"]

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
#: question pads 63 15-token ones).
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
        rule: the router rule that fired (``rfmem_fast.routing.base.RULE_NAMES``).
        mean: mean of the probe's top-``probe_k`` scores (spec section 1).
        entropy: the probe's softmax entropy (spec section 1).
        rounds: recollection rounds used (0 on the Familiarity path).
        dense_score: the item's exact cosine to the query (float; None when unknown).
        lexical_score: the item's BM25 score for the query's text within its user's
            memory (float, 0.0 for no lexical hit; None when the search was dense-only or
            the query a vector). With a lexical channel (``RFMemConfig.lexical_weight >
            0``, docs "Hybrid retrieval") ``score`` is the fused score of the two.
        created_at: when the item was added, as :attr:`Item.created_at` (a timezone-aware
            UTC ``datetime``; None when unknown), read from the snapshot the search ran on.
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
    created_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``created_at`` as an ISO-8601 string, or None)."""
        out = asdict(self)
        out["created_at"] = None if self.created_at is None else self.created_at.isoformat()
        return out


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
    """A stored memory item: id, text (or None), metadata ({} when none) and creation time.

    Attributes:
        created_at: when the item was added (``Memory.add(created_at=...)``, default the
            time of the add), a timezone-aware UTC ``datetime``; None when unknown (an
            item of a store written before creation times were kept, or one whose stored
            time is no instant: outside :data:`rfmem_fast.bank.INSTANT_RANGE`, written
            before that range was checked).
    """

    id: Hashable
    text: str | None
    metadata: dict
    created_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``created_at`` as an ISO-8601 string, or None)."""
        out = asdict(self)
        out["created_at"] = None if self.created_at is None else self.created_at.isoformat()
        return out


def _utc(t: float) -> datetime | None:
    """Stored epoch seconds as a UTC datetime; None when unknown: NaN, or a value outside
    the instants a datetime can hold (:data:`rfmem_fast.bank.INSTANT_RANGE`), which only
    a store written before the range was checked can hold (a reader never raises)."""
    return datetime.fromtimestamp(float(t), tz=timezone.utc) if INSTANT_MIN <= t < INSTANT_END else None


def _count_error(name: str, n: int, m: int, unit: str = "item", of: str | None = None,
                 single: str | None = None) -> ValueError:
    """The error of a per-item (per-query) list of the wrong length: ``name`` has ``n``
    entries for ``m`` items, and how to give it (one per item, or ``single`` for all)."""
    count = f"there are {m} {'queries' if unit == 'query' else unit + 's'}" if of is None else f"{of} has {m}"
    alt = f", or {single} for every {unit}" if single else ""
    return ValueError(f"{name} has {n} entries but {count}: give one per {unit}{alt}")


def _created_list(created_at: Any, m: int) -> list[float]:
    """``Memory.add``'s ``created_at`` as m epoch seconds: None (now), one instant for every
    item, or m of them; an instant is a timezone-aware datetime, an ISO-8601 string with
    a UTC offset, or a number of seconds since the Unix epoch (naive datetimes and
    offset-less strings are refused: :func:`rfmem_fast.filters.parse_instant`), within
    :data:`rfmem_fast.bank.INSTANT_RANGE` (:func:`rfmem_fast.bank.check_instant`:
    ``created_at`` / ``created_at[i]`` named, with a hint for epoch milliseconds)."""
    if created_at is None:
        return [time.time()] * m
    if isinstance(created_at, (str, datetime, int, float, np.integer, np.floating)) and not isinstance(created_at, bool):
        return [_instant(created_at, "created_at")] * m
    if isinstance(created_at, (bytes, dict, bool)) or not hasattr(created_at, "__iter__"):
        raise TypeError("created_at must be None, a datetime, an ISO-8601 string, a number of seconds, or m of them, "
                        f"got {type(created_at).__name__}")
    out = list(created_at)
    if len(out) != m:
        raise _count_error("created_at", len(out), m, single="one instant")
    return [_instant(v, f"created_at[{j}]") for j, v in enumerate(out)]


def _instant(v: Any, where: str, *, offsetless_utc: bool = False) -> float:
    """One creation time of a write as float seconds since the Unix epoch: the ONE parser of
    every write door (:meth:`Memory.add`, :meth:`Memory.add_many`, the HTTP add and bulk add
    bodies, ``rfmem import`` lines).

    Args:
        v: a number of seconds since the epoch (int / float / numpy number; not a bool),
            a timezone-aware ``datetime``, or an ISO-8601 string with a UTC offset
            (:func:`rfmem_fast.filters.parse_instant`).
        where: the value's name in messages (``created_at``, ``items[3].created_at``).
        offsetless_utc: an ISO-8601 string WITHOUT an offset reads as UTC (the item
            doors: ``add_many`` items, the bulk route, import lines, whose JSON formats
            say so); False refuses it, as :meth:`Memory.add` and the filters do (it names
            no instant). A naive ``datetime`` is refused either way.

    Returns:
        float seconds, within :data:`rfmem_fast.bank.INSTANT_RANGE`.

    Raises:
        TypeError: another type (a bool included). ValueError: a string that is no
            ISO-8601 date-time, a naive value, a non-finite number, an instant outside
            the range (:func:`rfmem_fast.bank.check_instant`: with a hint for epoch
            milliseconds); each message names ``where``.
    """
    t = v
    if offsetless_utc and isinstance(v, str):
        try:
            dt = datetime.fromisoformat(v.strip())
        except ValueError:
            pass  # parse_instant names the string
        else:
            t = dt if dt.tzinfo is not None else dt.replace(tzinfo=timezone.utc)
    return check_instant(parse_instant(t, where), where, v)


def _logged_times(created_at: list | None) -> list | None:
    """A logged add record's ``created_at`` as the bank takes it: a value outside
    :data:`rfmem_fast.bank.INSTANT_RANGE` (logged before the range was checked) is an
    unknown time, NaN, so that the acknowledged write still replays."""
    if created_at is None:
        return None
    out = [v if v is None or instants_known(v) else math.nan for v in created_at]
    odd = sum(1 for v, w in zip(created_at, out) if v is not w)
    if odd:
        log.warning("a logged add holds %d creation times outside %s (e.g. %r): replayed as unknown (NaN)",
                    odd, INSTANT_RANGE, next(v for v, w in zip(created_at, out) if v is not w))
    return out


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
    filters: Filter | None = field(default=None, compare=False)


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


def _check_path(path: Any) -> Path:
    """``Memory(path)`` as a Path: a str or an ``os.PathLike`` of a str.

    Raises:
        TypeError: anything else, named ``path`` (a config or an encoder given in its
            place gets a hint to pass it by keyword)."""
    if isinstance(path, (str, os.PathLike)):
        p = os.fspath(path)
        if isinstance(p, str):
            return Path(p)
    hint = ""
    if isinstance(path, RFMemConfig):
        hint = " (a configuration: pass it as config=...)"
    elif callable(getattr(path, "encode", None)) and not isinstance(path, (str, bytes)):
        hint = " (an encoder: pass it as encoder=...)"
    raise TypeError(f"path must be a directory as a str or os.PathLike (or None for an in-memory Memory), "
                    f"got {type(path).__name__}{hint}")


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
        raise _count_error("metadata", len(out), m, single="one dict")
    return _check_metadata(out, m)


# ---------------------------------------------------------------------- bulk items
#: The fields of one item of :meth:`Memory.add_many` / :meth:`Memory.update_many` /
#: :meth:`Memory.delete_many`, which are also the keys of a line of ``rfmem export`` /
#: ``rfmem import``: field -> the bulk operations that take it. ``created_at`` (what
#: :meth:`Memory.add` takes: epoch seconds, an aware datetime or an ISO-8601 string; a
#: string without an offset read as UTC: :func:`_instant`; default: the time of the write)
#: is stored as seconds since the epoch and filterable (:mod:`rfmem_fast.filters`). A new
#: per-item field is one entry here, its checker in ``_FIELD_CHECKS`` and, to be
#: stored, its column in ``_RECORD_COLUMNS``.
ITEM_FIELDS: dict[str, tuple[str, ...]] = {
    "user_id": ("add", "update", "delete"),
    "id": ("add", "update", "delete"),
    "text": ("add", "update"),
    "vector": ("add", "update"),
    "metadata": ("add", "update"),
    "created_at": ("add",),
}
#: item field -> the key of the logged add record holding it per item (``Memory._apply``
#: hands each to the bank)
_RECORD_COLUMNS = {"text": "texts", "metadata": "metadata", "created_at": "created_at"}
_ITEM_LABEL = re.compile(r"^items\[(\d+)\](?:\.(\w+))?")


def _check_meta1(value: Any, label: str) -> dict | None:
    """One item's metadata (a JSON object, or None), checked as the bank stores it."""
    try:
        return _check_metadata([value], 1)[0]
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("metadata[0]", label, 1)) from None


def _check_vector1(mem: "Memory", value: Any, label: str) -> np.ndarray:
    """One item's vector: float32 [d] as given (not yet normalised; NaN / Inf / zero
    refused). A list of ints is taken as floats (as JSON numbers are)."""
    arr = value
    if not (isinstance(arr, np.ndarray) or hasattr(arr, "detach")):
        if isinstance(arr, (str, bytes, dict)):
            raise TypeError(f"{label} must be a list of {mem.dim} floats, got {type(arr).__name__}")
        try:
            arr = np.asarray(arr)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{label} must be a list of {mem.dim} floats: {exc}") from None
        if arr.dtype.kind in "iu":
            arr = arr.astype(np.float64)
    if getattr(arr, "ndim", None) != 1:
        raise ValueError(f"{label} must be a 1-D vector of {mem.dim} floats, got shape {tuple(getattr(arr, 'shape', ()))}")
    return mem._vectors(arr, label)[0]


#: field -> checker(memory, value, label) -> the value as stored (raises naming ``label``)
_FIELD_CHECKS: dict[str, Callable[["Memory", Any, str], Any]] = {
    "user_id": lambda mem, v, label: _canon_id(v, label),
    "id": lambda mem, v, label: _canon_id(v, label),
    "text": lambda mem, v, label: _check_text(v, label),
    "vector": _check_vector1,
    "metadata": lambda mem, v, label: _check_meta1(v, label),
    "created_at": lambda mem, v, label: _instant(v, label, offsetless_utc=True),
}


def _tag_item_error(exc: BaseException) -> None:
    """Give an error whose message names ``items[i]`` (or ``items[i].field``) the
    attributes ``index`` (int) and ``field`` (str or None), for callers that map it
    back to their own numbering (HTTP 422 locations, line numbers of an import)."""
    msg = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
    m = _ITEM_LABEL.match(msg)
    if m:
        exc.index = int(m.group(1))  # type: ignore[attr-defined]
        exc.field = m.group(2)  # type: ignore[attr-defined]


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
            self._dim_defaulted = False  # the stored memory's dimension
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
                if rec["op"] == "group":  # a bulk write: all its records, or none
                    subs = rec.get("ops")
                    if not isinstance(subs, list) or not all(isinstance(r, dict) for r in subs):
                        raise ValueError("a group record without a list of records")
                    self._check_group(subs)
                    for sub in subs:
                        self._apply(sub)
                else:
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

    def _encode_rows(self, texts: list[str], name: str,
                     labels: Sequence[str] | None = None) -> list[np.ndarray | ValueError]:
        """One encoder call for ``texts``: per text its float32 [d] embedding, or a
        ValueError naming ``labels[i]`` (default ``name[i]``, or the query text) when
        the encoder returned a zero or non-finite row for it. Raises what the encoder
        call raises."""
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
            label = labels[i] if labels is not None else f"{name}[{i}]" if name != "query" else "query"
            if not np.isfinite(rows64[i]).all() or not np.isfinite(norms[i]) or norms[i] <= 1e-12 \
                    or np.abs(rows64[i]).max() > np.finfo(np.float32).max:
                rows.append(ValueError(
                    f"{label} {text[:60]!r}: the encoder returned a zero or non-finite embedding for this text, "
                    "so it cannot be searched or stored"))
            else:
                rows.append(out[i].astype(np.float32))
        return rows

    def _encode(self, texts: list[str], name: str = "texts", labels: Sequence[str] | None = None) -> np.ndarray:
        """float32 [n, d] embeddings of ``texts`` (one encoder call).

        Raises:
            ValueError: the encoder's row for ``labels[i]`` (default ``name[i]``) is
                zero or not finite (named)."""
        rows = self._encode_rows(texts, name, labels)
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
        shape = getattr(arr, "shape", ())
        if self._dim_defaulted and len(shape) == 2 and shape[1] not in (0, self.dim):
            raise ValueError(f"{name} must have dimension {self.dim}, got {shape[1]}: this Memory has no encoder "
                             f"and no dim, so it took the default dimension {DEFAULT_DIM}; for {shape[1]}-dimensional "
                             f"vectors create it with dim={shape[1]} (Memory(..., encoder=False, dim={shape[1]}))")
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
        self._commit([record])

    @staticmethod
    def _log_form(rec: dict[str, Any]) -> dict[str, Any]:
        """A record as logged: its arrays as exact base64 float32 (a group's records too)."""
        line = dict(rec)
        for key in ("vectors", "extra_vectors"):
            if isinstance(line.get(key), np.ndarray):
                line[key] = encode_array(line[key])
        if line.get("op") == "group":
            line["ops"] = [Memory._log_form(r) for r in line["ops"]]
        return line

    def _commit(self, records: list[dict[str, Any]]) -> None:
        """Log (durably), then apply writes: one record, or several as ONE group record.

        A group (``{"seq", "op": "group", "ops": [records]}``, :mod:`rfmem_fast.serving.wal`)
        is one log line, so it is durable or absent as a whole (a torn line is cut off on
        replay), and it is applied all-or-nothing: :meth:`_check_group` proves every
        record applies (ids held / new, in order) before anything is logged, and the
        records are applied under one hold of the write lock, so no search sees a part
        of it. A record that fails anyway after the check (a bug, or MemoryError)
        leaves the in-memory bank partly written: the group is logged as aborted and
        the Memory refuses further writes (reopening a durable one restores the state
        before the group). Raises what the check or the apply raises.
        """
        with self._wmutex:
            self._check_open()
            if not records:
                raise ValueError("nothing to write")
            group = len(records) > 1
            if group:
                self._check_group(records)  # before anything is logged: a refusal writes nothing
            seq = self._seq + 1
            rec = {"seq": seq, "op": "group", "ops": records} if group else {"seq": seq, **records[0]}
            if self._wal is not None:
                try:
                    self._wal.append(self._log_form(rec))
                except (TypeError, ValueError, RecursionError) as exc:  # not JSON: nothing was written
                    raise ValueError(f"cannot log this write: {exc}") from None
                except OSError as exc:  # a partial line may be on disk: stop writing
                    self._broken = exc
                    raise
            self._seq = seq
            applied = 0
            try:
                with self._rw.write():
                    for r in (records if group else [rec]):
                        self._apply(r)
                        applied += 1
            except BaseException as exc:
                if applied:  # a group stopped half-way (cannot happen after _check_group)
                    self._broken = RuntimeError(f"a bulk write (log seq {seq}) failed after {applied} of its "
                                                f"{len(records)} records were applied: {exc!r}")
                if self._wal is not None:
                    try:
                        self._wal.append({"seq": seq, "op": "abort"})
                    except OSError as exc2:  # replay re-fails the same write: still consistent
                        self._broken = exc2
                raise
            with self._stats_lock:
                self._counters["writes"] += 1
            if self._wal is not None and self._checkpoint_bytes is not None and self._wal.nbytes > self._checkpoint_bytes:
                self._checkpoint_locked()

    def _check_group(self, records: list[dict[str, Any]]) -> None:
        """Prove that ``records`` apply in order to the bank as it is (read only): the
        ids of an ``add`` are not held, those of an ``update`` (and its dropped chunk
        rows) and of a ``delete`` are; later records see earlier ones' changes.

        Raises:
            KeyError: an id not held (named with its user). ValueError: an id already
                held, or an unknown operation.
        """
        seen: dict[str, dict[Any, bool]] = {}  # user -> {row id: held after the records so far}
        cleared: set[str] = set()

        def held(user: str, ids: list) -> list[bool]:
            known = seen.setdefault(user, {})
            ask = [i for i in ids if i not in known]
            if ask:
                known.update(zip(ask, [False] * len(ask) if user in cleared else self.bank.has_items(user, ask)))
            return [known[i] for i in ids]

        for rec in records:
            op, user, ids = rec.get("op"), rec.get("user"), list(rec.get("ids") or [])
            if len(set(ids)) != len(ids):
                raise ValueError(f"ids: a record of user {user!r} names an item id twice")
            if op == "add":
                for i, h in zip(ids, held(user, ids)):
                    if h:
                        raise ValueError(f"ids: user {user!r} already holds item id {i!r}")
                seen[user].update(dict.fromkeys(ids, True))
            elif op in ("update", "delete"):
                drop = list(rec.get("drop") or []) if op == "update" else []
                for i, h in zip(ids + drop, held(user, ids + drop)):
                    if not h:
                        raise KeyError(f"ids: user {user!r} holds no item id {i!r}")
                gone = ids if op == "delete" else drop
                seen[user].update(dict.fromkeys(gone, False))
                extra = list(rec.get("extra_ids") or []) if op == "update" else []
                for i, h in zip(extra, held(user, extra)):
                    if h:
                        raise ValueError(f"ids: user {user!r} already holds item id {i!r}")
                seen[user].update(dict.fromkeys(extra, True))
            elif op == "delete_user":
                cleared.add(user)
                seen[user] = {}
            else:
                raise ValueError(f"unknown operation {op!r} in a group of writes")

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
        if op == "add":  # (a record of an older version has no created_at: the time of the replay)
            self.bank.add(user, vec, rec["ids"], texts=rec["texts"], metadata=rec["metadata"],
                          created_at=_logged_times(rec.get("created_at")))
            self._note_chunks(chunks, rec["ids"])
        elif op == "update" and vec is None:  # metadata only (a new text always comes with its vector)
            self.bank.set_metadata(user, rec["ids"], rec["metadata"])
            cids = self._chunk_ids_of(user, rec["ids"])
            if cids:  # the chunk rows keep their item's metadata (filters)
                of = dict(zip(rec["ids"], rec["metadata"]))
                self.bank.set_metadata(user, cids, [of[c.rpartition(CHUNK_SEP)[0]] for c in cids])
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
                parents = [x.rpartition(CHUNK_SEP)[0] for x in extra]  # chunk rows: their item's metadata and time
                uniq = list(dict.fromkeys(parents))  # (an item's several chunks: one lookup)
                pmeta = dict(zip(uniq, self.bank.get_metadata(user, uniq)))
                ptime = dict(zip(uniq, self.bank.created_at_of(user, uniq).tolist()))
                self.bank.add(user, decode_array(ev) if isinstance(ev, dict) else ev, extra,
                              metadata=[pmeta[p] for p in parents],
                              created_at=[ptime[p] for p in parents])
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

    def _split(self, texts: list[str], name: str = "texts", labels: Sequence[str] | None = None) -> list[list[str]]:
        """Per text, its chunks: ``[text]`` when it fits the encoder's window (or the
        encoder does not tell one), else overlapping windows of the text itself.

        Raises:
            ValueError: a text over the window of an encoder that tells its window
                (``max_tokens``, ``count_tokens``) but cannot cut (no ``token_spans``),
                named by ``labels[i]`` (default ``name[i]``).

        A chunk holds at most ``max_tokens`` minus the special tokens of the encoder's
        tokenizer (254 for all-MiniLM-L6-v2), consecutive chunks share
        ``chunk_overlap`` tokens; each chunk is the exact substring its tokens span.
        The tokenizer used is a borrowed encoder's (never one a worker is encoding with)."""
        with self._borrow_encoder() as enc:
            return self._split_with(enc, texts, name, labels)

    def _split_with(self, enc: Any, texts: list[str], name: str,
                    labels: Sequence[str] | None = None) -> list[list[str]]:
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
                f"{labels[i] if labels is not None else f'{name}[{i}]'} is {counts[i]} tokens long, but the encoder reads at most {limit} tokens "
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

    def _embed_chunks(self, tx: list[str], labels: Sequence[str] | None = None) -> list[np.ndarray]:
        """ONE encoder call for the chunks of every text (long ones cut, :meth:`_split`):
        per text its float32 [c, d] rows (c >= 1 chunks; views into one array).

        Raises:
            ValueError: a text that cannot be cut or embeds as a zero / non-finite row,
                named by ``labels[i]`` (default ``texts[i]``)."""
        parts = self._split(tx, labels=labels)
        flat = [c for p in parts for c in p]
        names = labels if labels is not None else [f"texts[{i}]" for i in range(len(tx))]
        rows = self._encode(flat, labels=[lab for lab, p in zip(names, parts) for _ in p])
        out, r = [], 0
        for p in parts:
            out.append(rows[r:r + len(p)])
            r += len(p)
        return out

    @staticmethod
    def _chunk_layout(id_list: list[str], per_item: list[np.ndarray]) -> tuple[np.ndarray, list[str], np.ndarray | None]:
        """Items' chunk rows (:meth:`_embed_chunks`) as bank rows: (one row per item: its
        first chunk; the extra chunks' row ids ``"<id>\x1f<j>"``, j >= 1; their rows, or None)."""
        first = np.stack([c[0] for c in per_item])
        extra_ids = [f"{pid}{CHUNK_SEP}{j}" for pid, c in zip(id_list, per_item) for j in range(1, c.shape[0])]
        if not extra_ids:
            return first, [], None
        return first, extra_ids, np.concatenate([c[1:] for c in per_item if c.shape[0] > 1])

    def _encode_items(self, tx: list[str], id_list: list[str]) -> tuple[np.ndarray, list[str], np.ndarray | None]:
        """Embeddings of items' texts, long ones chunked: (one row per item: its first
        chunk; the extra chunks' row ids; their rows, or None)."""
        return self._chunk_layout(id_list, self._embed_chunks(tx))

    def add(
        self,
        texts: str | Sequence[str] | None,
        user_id: Hashable,
        ids: Sequence[Hashable] | Hashable | None = None,
        metadata: dict | Sequence[dict | None] | None = None,
        *,
        vectors: Any = None,
        created_at: Any = None,
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

        Returns:
            list of the m item ids (str).

        Raises:
            ValueError: neither texts nor vectors, mismatched lengths, a wrong
                dimension, NaN / Inf / zero vectors (a text the encoder embeds as one:
                ``texts[i]`` named), a duplicate id or one the user already holds,
                metadata that is not JSON (``metadata[i]`` named), an empty / blank
                text or one with a lone surrogate (``texts[i]``), no encoder for texts, a
                malformed, naive or out-of-range ``created_at`` (``created_at[i]`` named).
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
            raise ValueError(f"texts has {m} entries but vectors has {vec.shape[0]} rows: give one vector per text")
        if m == 0:
            raise ValueError("add needs at least one item")
        id_list = [uuid.uuid4().hex for _ in range(m)] if ids is None else _id_list(ids)
        if len(id_list) != m:
            raise _count_error("ids", len(id_list), m)
        meta = _metadata_list(metadata, m)
        created = _created_list(created_at, m)
        extra_ids: list[str] = []
        extra = None
        if vec is None:
            vec, extra_ids, extra = self._encode_items(tx, id_list)
        self._write(self._add_record(user, id_list, vec, extra_ids, extra,
                                     {"texts": tx, "metadata": meta, "created_at": created}))
        return id_list

    @staticmethod
    def _add_record(user: str, id_list: list[str], vec: np.ndarray, extra_ids: list[str], extra: np.ndarray | None,
                    columns: dict[str, list | None]) -> dict[str, Any]:
        """The logged record of an add to one user: ``vec`` [m, d] the items' rows,
        ``extra_ids`` / ``extra`` the extra chunk rows of long texts (after the items),
        ``columns`` {record key: m per-item values or None} (``texts``, ``metadata``,
        ``created_at``; a column of only None is None). A chunk row has no text of its
        own and carries its item's metadata and creation time (so that a filter sees
        the item in each of its rows)."""
        pos = {i: j for j, i in enumerate(id_list)}
        parents = [pos[x.rpartition(CHUNK_SEP)[0]] for x in extra_ids]
        rec: dict[str, Any] = {"op": "add", "user": user, "ids": id_list + extra_ids,
                               "vectors": np.concatenate([vec, extra]) if extra_ids else vec}
        for col, vals in columns.items():
            if vals is None or all(v is None for v in vals):
                rec[col] = None
            else:
                pad = [None] * len(parents) if col == "texts" else [vals[j] for j in parents]
                rec[col] = list(vals) + pad
        return rec

    def _update_record(self, user: str, id_list: list[str], tx: list[str] | None, vec: np.ndarray | None,
                       meta: list | None, extra_ids: list[str], extra: np.ndarray | None) -> dict[str, Any]:
        """The logged record of an update of one user's items (call under the write
        mutex): a new vector (given, or a new text's first chunk) drops the items' old
        chunk rows and adds ``extra_ids`` / ``extra``, the new text's other chunks."""
        rec = {"op": "update", "user": user, "ids": id_list, "texts": tx, "vectors": vec, "metadata": meta}
        if vec is not None:  # a new text / vector replaces the item's chunks
            drop = self._chunk_ids_of(user, id_list)
            if drop or extra_ids:
                rec.update(drop=drop, extra_ids=extra_ids, extra_vectors=extra)
        return rec

    def _delete_record(self, user: str, id_list: list[str]) -> dict[str, Any]:
        """The logged record of a delete of one user's items and their chunk rows
        (call under the write mutex)."""
        return {"op": "delete", "user": user, "ids": id_list + self._chunk_ids_of(user, id_list)}

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
                raise _count_error(name, n, m, of="ids")
        meta = _metadata_list(metadata, m)
        if tx is None and vec is None and meta is None:
            raise ValueError("update needs texts, vectors or metadata")
        if user not in self.bank:
            raise KeyError(f"user_id: unknown user {user!r}")
        extra_ids: list[str] = []
        extra = None
        if tx is not None and vec is None:
            vec, extra_ids, extra = self._encode_items(tx, id_list)
        with self._wmutex:
            self._write(self._update_record(user, id_list, tx, vec, meta, extra_ids, extra))

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
    def _parse_items(self, items: Any, op: str) -> list[dict[str, Any]]:
        """The items of a bulk ``op`` ("add", "update", "delete") checked field by field
        (:data:`ITEM_FIELDS`), as dicts of the fields given (a None value counts as not
        given, except ``metadata`` in an update, where it clears). Reads no state.

        Raises:
            TypeError / ValueError: naming ``items[i]`` or ``items[i].<field>``.
        """
        if isinstance(items, (str, bytes, Mapping)) or not hasattr(items, "__iter__"):
            raise TypeError(f"items must be a sequence of dicts (one per item), got {type(items).__name__}")
        items = list(items)
        if not items:
            raise ValueError(f"{op}_many needs at least one item")
        allowed = [f for f, ops in ITEM_FIELDS.items() if op in ops]
        out: list[dict[str, Any]] = []
        first: dict[tuple[str, str], int] = {}
        for i, it in enumerate(items):
            if not isinstance(it, Mapping):
                raise TypeError(f"items[{i}] must be a dict, got {type(it).__name__}")
            unknown = [k for k in it if k not in allowed]
            if unknown:
                raise ValueError(f"items[{i}] has the unknown field {unknown[0]!r}: {op}_many takes "
                                 f"{', '.join(allowed)}")
            row: dict[str, Any] = {}
            for f in allowed:
                if f not in it:
                    continue
                v = it[f]
                if v is None:
                    if f == "metadata" and op == "update":
                        row[f] = None  # clears
                    continue
                row[f] = _FIELD_CHECKS[f](self, v, f"items[{i}].{f}")
            if "user_id" not in row:
                raise ValueError(f"items[{i}].user_id is required")
            if op != "add" and "id" not in row:
                raise ValueError(f"items[{i}].id is required")
            if op == "add" and "text" not in row and "vector" not in row:
                raise ValueError(f"items[{i}]: an item needs a text or a vector")
            if op == "update" and not ("text" in row or "vector" in row or "metadata" in row):
                raise ValueError(f"items[{i}]: an update needs a text, a vector or metadata")
            if "id" in row:
                key = (row["user_id"], row["id"])
                if key in first:
                    raise ValueError(f"items[{i}].id: item {row['id']!r} of user {row['user_id']!r} is given twice "
                                     f"in this call (also items[{first[key]}])")
                first[key] = i
            out.append(row)
        return out

    @staticmethod
    def _by_user(parsed: list[dict[str, Any]]) -> dict[str, list[int]]:
        """{user: indices of its items}, users in order of first appearance."""
        out: dict[str, list[int]] = {}
        for i, it in enumerate(parsed):
            out.setdefault(it["user_id"], []).append(i)
        return out

    def _check_held(self, parsed: list[dict[str, Any]], by_user: dict[str, list[int]], op: str) -> None:
        """The ids of an add are new to their users; those of an update / delete are held.

        Raises:
            ValueError (add) / KeyError (update, delete: unknown user or item), naming
                ``items[i].id`` (or ``.user_id``).
        """
        for user, idx in by_user.items():
            if op != "add" and user not in self.bank:
                raise KeyError(f"items[{idx[0]}].user_id: unknown user {user!r}")
            ids = [parsed[i]["id"] for i in idx]
            for i, h in zip(idx, self.bank.has_items(user, ids)):
                if op == "add" and h:
                    raise ValueError(f"items[{i}].id: user {user!r} already holds item id {parsed[i]['id']!r}")
                if op != "add" and not h:
                    raise KeyError(f"items[{i}].id: user {user!r} holds no item id {parsed[i]['id']!r}")

    def _embed_items(self, parsed: list[dict[str, Any]], need: list[int]) -> dict[int, np.ndarray]:
        """{item index: its chunk rows [c, d]} for the items ``need`` (their texts, in ONE
        encoder call; long texts chunked)."""
        if not need:
            return {}
        if not self._has_encoder:
            raise ValueError(f"items[{need[0]}].text: this Memory has no text encoder (encoder=False); "
                             "give each item a vector")
        rows = self._embed_chunks([parsed[i]["text"] for i in need], labels=[f"items[{i}].text" for i in need])
        return dict(zip(need, rows))

    def _bulk(self, fn: Callable[[Any], Any], items: Any) -> Any:
        try:
            return fn(items)
        except (TypeError, ValueError, KeyError) as exc:
            _tag_item_error(exc)
            raise

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

    def _add_many(self, items: Any) -> list[str]:
        self._check_open()
        parsed = self._parse_items(items, "add")
        now = time.time()
        for it in parsed:
            it.setdefault("id", uuid.uuid4().hex)
            it.setdefault("created_at", now)
        by_user = self._by_user(parsed)
        with self._wmutex:  # fail before the encoder runs
            self._check_held(parsed, by_user, "add")
        chunks = self._embed_items(parsed, [i for i, it in enumerate(parsed) if "vector" not in it])
        with self._wmutex:
            self._check_held(parsed, by_user, "add")  # again: another write may have come in
            records = []
            for user, idx in by_user.items():
                ids = [parsed[i]["id"] for i in idx]
                vec, extra_ids, extra = self._chunk_layout(ids, [chunks[i] if i in chunks else parsed[i]["vector"][None]
                                                                 for i in idx])
                cols = {col: [parsed[i].get(f) for i in idx] for f, col in _RECORD_COLUMNS.items()}
                records.append(self._add_record(user, ids, vec, extra_ids, extra, cols))
            self._commit(records)
        return [it["id"] for it in parsed]

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

    def _update_many(self, items: Any) -> None:
        self._check_open()
        parsed = self._parse_items(items, "update")
        by_user = self._by_user(parsed)
        with self._wmutex:
            self._check_held(parsed, by_user, "update")
        chunks = self._embed_items(parsed, [i for i, it in enumerate(parsed) if "text" in it and "vector" not in it])
        with self._wmutex:
            self._check_held(parsed, by_user, "update")
            records = []
            for user, idx in by_user.items():
                kinds: dict[tuple[bool, bool, bool], list[int]] = {}  # one record per set of fields changed
                for i in idx:
                    it = parsed[i]
                    kinds.setdefault(("text" in it, "text" in it or "vector" in it, "metadata" in it), []).append(i)
                for (has_text, has_vec, has_meta), g in kinds.items():
                    ids = [parsed[i]["id"] for i in g]
                    vec, extra_ids, extra = None, [], None
                    if has_vec:
                        vec, extra_ids, extra = self._chunk_layout(
                            ids, [chunks[i] if i in chunks else parsed[i]["vector"][None] for i in g])
                    records.append(self._update_record(
                        user, ids, [parsed[i]["text"] for i in g] if has_text else None, vec,
                        [parsed[i]["metadata"] for i in g] if has_meta else None, extra_ids, extra))
            self._commit(records)

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

    def _delete_many(self, items: Any) -> None:
        self._check_open()
        parsed = self._parse_items(items, "delete")
        by_user = self._by_user(parsed)
        with self._wmutex:
            self._check_held(parsed, by_user, "delete")
            self._commit([self._delete_record(user, [parsed[i]["id"] for i in idx]) for user, idx in by_user.items()])

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
            :attr:`Item.created_at`), and
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
        return [Item(i, text_of[i], m or {}, _utc(t)) for i, m, t in zip(ids, metas, times)]

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
        return [Item(i, text_of[i], m or {}, _utc(t)) for i, m, t in zip(id_list, metas, times)]

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

    def _prepare(self, query: Any, user_id: Any, k: Any, mode: Any, name: str = "query", filters: Any = None,
                 fname: str = "filters") -> _Query:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        _check_k(k)
        k = self._config.out_k if k is None else int(k)
        user = _user_key(user_id)
        flt = None if filters is None else parse_filter(filters, fname)
        fk = () if flt is None else (("filters", flt.key),)  # a filtered answer is cached apart
        if isinstance(query, str):
            if not self._has_encoder:
                raise ValueError(f"{name}: this Memory has no text encoder (encoder=False); pass a vector")
            query = _check_text(query, name, what="query")
            return _Query(user, query, None, k, mode, ("text", query) + fk, flt)
        if isinstance(query, (bytes, bool, int, float, complex, np.number, np.bool_)) or query is None \
                or getattr(query, "ndim", None) == 0:
            raise TypeError(f"{name} must be a str or a 1-D vector of floats: a text (str) or a vector "
                            f"({self.dim} floats) was expected, got {type(query).__name__}")
        if name == "query" and isinstance(query, (list, tuple)) and query and isinstance(query[0], str):
            raise TypeError("query must be one str or one 1-D vector; for several queries use "
                            "Memory.search_batch(queries, user_ids)")
        arr = query if (hasattr(query, "detach") or isinstance(query, np.ndarray)) else np.asarray(query)
        if getattr(arr, "ndim", None) != 1:
            raise ValueError(f"{name} must be a str or a 1-D vector of {self.dim} floats, got shape {tuple(getattr(arr, 'shape', ()))}")
        vec = self._vectors(arr, name)[0]
        return _Query(user, None, vec, k, mode, vector_key(vec) + fk, flt)

    def _start(self, query: Any, user_id: Any, k: Any, mode: Any, filters: Any = None) -> tuple[_Query, Hits | None]:
        """A checked query and its cached answer (None on a miss)."""
        q, hit = self._start_answer(query, user_id, k, mode, filters)
        return q, (hit.materialise(cached=True) if hit is not None else None)

    def _start_answer(self, query: Any, user_id: Any, k: Any, mode: Any,
                      filters: Any = None) -> tuple[_Query, _Answer | None]:
        """A checked query and its cached (shared, immutable) answer (None on a miss)."""
        self._check_open()
        q = self._prepare(query, user_id, k, mode, filters=filters)
        return q, self._cached(q)

    def _cached(self, q: _Query) -> _Answer | None:
        key = QueryCache.result_key(q.user, self._uver.get(q.user, 0), q.qkey, q.mode, q.k)
        return self._cache.get_result(key)

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

    def _run_one(self, q: _Query) -> _Answer:
        out = self._run_batch([q])[0]
        if isinstance(out, BaseException):
            raise out
        return out

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
            snap = self.bank.snapshot()  # the one the searches below run on (writes wait for the lock)
            created = snap.created_at_or_nan
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
                    res = self._engine(cfg, mode, [queries[i] for i in idx], [vecs[i] for i in idx])
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
                rows = [self._collapse(res, j, texts[j], queries[i].k, created) for j, i in enumerate(idx)]
                t0 = time.perf_counter()
                try:
                    searches += self._give_back_chunk_slots(cfg, res, rows, [queries[i] for i in idx],
                                                            [vecs[i] for i in idx], created)
                except Exception as exc:  # pragma: no cover - defensive: fails these callers only
                    for i in idx:
                        out[i] = exc
                    continue
                finally:
                    search_s += time.perf_counter() - t0
                metas = self._metadata_of([queries[i].user for i in idx], [r[0] for r in rows])
                parent_texts: dict[Hashable, dict] = {}
                for j, i in enumerate(idx):
                    q = queries[i]
                    try:
                        ids, scores, txt, from_chunk, chan, times = rows[j]
                        if q.text is None:  # a vector query: the lexical channel did not score it
                            chan = [(c[0], None) for c in chan]
                        if any(from_chunk):  # a chunk's hit shows its item's whole text
                            pt = parent_texts.get(q.user)
                            if pt is None:
                                pt = parent_texts[q.user] = dict(zip(self.bank.item_ids_of(q.user),
                                                                     self.bank.texts_of(q.user)))
                            txt = [pt[x] if f else t for x, t, f in zip(ids, txt, from_chunk)]
                        out[i] = ans = self._answer(res, j, q.user, routes[j], rules[j], ids, scores, txt,
                                                    metas[q.user], chan, times)
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

    def _engine(self, cfg: RFMemConfig, mode: str, qs: list[_Query], vecs: list[np.ndarray]) -> SearchResult:
        """One :func:`~rfmem_fast.search` of the queries ``qs`` (their vectors ``vecs``) with
        ``cfg`` in ``mode``: their texts for the lexical channel, their filters."""
        lex: dict[str, Any] = {"query_texts": [q.text for q in qs]} if cfg.lexical_weight > 0 else {}
        flt = [q.filters for q in qs]
        if any(f is not None for f in flt):
            lex["filters"] = flt
        return search(self.bank, np.stack(vecs), [q.user for q in qs], config=cfg, mode=mode,
                      backend=self._backend, device=self._device, **lex)

    def _give_back_chunk_slots(self, cfg: RFMemConfig, res: SearchResult, rows: list[tuple], qs: list[_Query],
                               vecs: list[np.ndarray], created: np.ndarray) -> int:
        """Recollection counts items, not chunk rows: the result slots that extra chunks of
        an item already returned took are given to other items (``rows`` changed in place;
        returns the number of extra engine searches made, 0 or 1).

        The engine's Recollection path fills its result list with bank rows, and a long
        text is several rows (its chunks, near one another), so sibling chunks take slots
        and recollection rounds that distinct items would have taken: collapsed to items,
        a query would get fewer items than rows (as few as 2 of 10 with 6-word chunks). For each
        query of a user holding chunked items whose route was recollection and whose
        collapsed list holds fewer than ``min(k, rows returned)`` items, the list is
        completed, after its recollected items (their order and scores kept), with the
        next items of the query's Familiarity ranking (one ``mode="dense"`` search of those
        queries: the same configuration, texts and filters) that are not in it yet and
        whose cosine (``dense_score``) is at least ``score_floor``, as the recollection
        drops lower candidates; they carry their Familiarity-path scores. Users without
        chunked items, and the engine itself, are untouched.
        """
        need = []
        for j, (q, r) in enumerate(zip(qs, rows)):
            if res.route_names[j] != "recollection" or not self._chunks.get(q.user):
                continue
            want = min(q.k, int((res.rows[j] >= 0).sum()))
            if len(r[0]) < want:
                need.append((j, want))
        if not need:
            return 0
        fam = self._engine(cfg, "dense", [qs[j] for j, _ in need], [vecs[j] for j, _ in need])
        floor = cfg.score_floor
        for jj, (j, want) in enumerate(need):
            ids, scores, txt, from_chunk, chan, times = rows[j]
            have = set(ids)
            more = self._collapse(fam, jj, fam.texts[jj], max(qs[j].k, 1) + len(ids), created)
            for extra in zip(*more):
                if len(ids) == want:
                    break
                i, score, _, _, c, _ = extra
                if i in have or (c[0] if c[0] is not None else score) < floor:
                    continue
                have.add(i)
                for col, v in zip((ids, scores, txt, from_chunk, chan, times), extra):
                    col.append(v)
        return 1

    def _metadata_of(self, users: list[Hashable], hit_ids: list[list]) -> dict[Hashable, dict]:
        """{user: {item id: metadata or None}} for the hits of a batch: ONE bank lookup
        per user rather than one per query (the bank checks the ids and deep-copies)."""
        wanted: dict[Hashable, dict] = {}
        for user, ids in zip(users, hit_ids):
            wanted.setdefault(user, {}).update(dict.fromkeys(ids))
        return {u: dict(zip(ids, self.bank.get_metadata(u, list(ids)))) if ids else {} for u, ids in wanted.items()}

    @staticmethod
    def _collapse(res: SearchResult, j: int, texts: np.ndarray, k: int,
                  created: np.ndarray) -> tuple[list, list, list, list, list, list]:
        """Query ``j``'s hit rows collapsed to items: a long text's chunk rows count as
        their item (its best-ranked row; the first k items). Returns (ids, scores,
        texts, from_chunk, channels, times): from_chunk[r] when item r's best row was an
        extra chunk (its text is then looked up); channels[r] its (dense, lexical) scores
        (None where unknown); times[r] its creation time (UTC datetime or None), read
        from ``created`` (float64 [n], the creation times of the snapshot the search ran
        on: one gather, a chunk row holding its item's time)."""
        ok = res.rows[j] >= 0
        ids, scores, txt = res.ids[j][ok].tolist(), res.scores[j][ok].tolist(), texts[ok].tolist()
        chan = [tuple(_finite_or_none(v) for v in pair) for pair in zip(
            res.dense_scores[j][ok].tolist() if res.dense_scores is not None else [None] * len(ids),
            res.lexical_scores[j][ok].tolist() if res.lexical_scores is not None else [None] * len(ids),
        )]  # fmt: skip
        times = created[res.rows[j][ok]].tolist()
        if not any(isinstance(i, str) and CHUNK_SEP in i for i in ids):
            return (ids[:k], scores[:k], txt[:k], [False] * min(k, len(ids)), chan[:k],
                    [_utc(t) for t in times[:k]])  # fmt: skip
        out_ids, out_s, out_t, out_f, out_c, out_w, seen = [], [], [], [], [], [], set()
        for i, sc, t, c, w in zip(ids, scores, txt, chan, times):
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
            out_w.append(_utc(w))
            if len(out_ids) == k:
                break
        return out_ids, out_s, out_t, out_f, out_c, out_w

    def _answer(self, res: SearchResult, j: int, user: Hashable, route: str, rule: str, ids: list,
                scores: list, txt: list, metas: dict, chan: list, times: list) -> _Answer:
        """Query ``j`` of ``res`` as an immutable answer (hits with texts, metadata and
        creation times): ``ids`` / ``scores`` / ``txt`` / ``chan`` / ``times`` its hits
        (:meth:`_collapse`), ``metas`` {id: metadata} of its user (:meth:`_metadata_of`)."""
        mean, ent, rounds = float(res.mean[j]), float(res.entropy[j]), int(res.rounds[j])
        hits = tuple(
            Hit(i, t, s, metas[i] or {}, r, user, route, rule, mean, ent, rounds, c[0], c[1], w)
            for r, (i, t, s, c, w) in enumerate(zip(ids, txt, scores, chan, times))
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
