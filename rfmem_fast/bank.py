"""MemoryBank: many users' memory vectors in one CSR layout (RFMEM_SPEC.md, "Vectors and scores").

What readers see
----------------
A :class:`BankSnapshot` (``bank.snapshot()``): one float32 matrix ``vectors[n, d]``
holding the LIVE rows of all users, user ``u`` owning the contiguous rows
``offsets[u] : offsets[u + 1]`` (CSR segments), the caller's item id and text of each
row, the user keys, and the bank's write counter. A bank made with
``dtype="float16"`` / ``"bfloat16"`` adds ``scan``: the same rows rounded to that type,
which the fast backends scan instead of ``vectors`` (half the bytes per query), the
float32 rows being read only to re-score the candidates exactly
(:mod:`rfmem_fast.precision`; results are those of the float32 bank); ``dtype="int8"``
adds an int8 ``scan`` (a quarter of the bytes) and its per-row ``scan_meta``, which the
native backend scans. Every row is L2-normalised on the
way in, so the inner product is the cosine score. Deleted items are never in a
snapshot, so no search mode or backend can return one. A snapshot is immutable: a
search holding it is unaffected by later writes.

Writes
------
``add`` / ``delete`` / ``update`` change per-user storage only, under one write lock,
and never touch a published snapshot:

* each user owns a ``base`` block (a read-only view into the last snapshot, or into
  the memory-mapped store after ``load(mmap=True)``) and an owned ``tail`` buffer with
  capacity doubling, so appends are amortised O(d) per row;
* ``delete`` marks tombstones (O(1) per id); a user whose tombstones outnumber its
  live rows (and are at least 64) is compacted on the spot (O(n_u d), amortised over
  those deletions);
* ``update`` overwrites a tail row in place, or records a patch for a base row (the
  base is shared with the snapshot, so it is never written); the item keeps its id
  and its row position (hence its tie-breaking rank, spec "Vectors and scores").

Cost model
----------
* write: O(m d) to validate and normalise m rows, O(m) bookkeeping; the first write to
  a user after a snapshot also copies that user's id / text lists (O(n_u)).
* snapshot: built lazily on the first read after a write (so a burst of writes costs
  one build), under the lock: one O(N d) copy into a fresh matrix (CSR segments must
  be contiguous, so every write moves the rows after it), plus O(n_u) per changed user
  for ids and texts; unchanged users' id / text arrays are copied at C speed. After
  the build every user's storage is rebased onto the new matrix (tails, tombstones and
  patches dropped), so the bank holds ONE copy of its rows in steady state and two
  while a build runs or while an old snapshot is still held by a search.
* :meth:`MemoryBank.compact` forces that build now (reclaiming tombstoned rows); it
  changes neither the version nor any search result.

Concurrency model
-----------------
One re-entrant write lock serialises writers and snapshot builds; readers take the
current snapshot without the lock (an attribute read) and work on that immutable copy
(copy-on-write). A search therefore sees exactly one bank version: never a torn mix,
never an item deleted before it started (its snapshot is at least as new as every
write that completed before the call). Users are append-only (a user whose items are
all deleted stays, with 0 items), so user indices are stable across versions.

Persistence: :meth:`MemoryBank.save` / :meth:`MemoryBank.load` (see :mod:`rfmem_fast.store`).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from datetime import date, datetime, time as clock_time, timezone
from typing import Any, Callable, Hashable, Iterable, Sequence

import numpy as np

from ._validate import as_float_matrix, check_positive_int, l2_normalize_rows
from .lexical import Analyzer, LexicalIndex, Vocabulary, concat_segments, docs_segment
from .precision import SCAN_DTYPES, check_dtype, scan_copies
from .store import read_store, write_store

log = logging.getLogger("rfmem_fast.bank")

ItemId = Hashable

#: a user is compacted on the spot once its tombstones reach this many AND outnumber its live rows
COMPACT_MIN_DEAD = 64
#: the stored position of an item without one (:attr:`BankSnapshot.positions`)
NO_POSITION = -1
#: the largest position an item may hold (positions are int64 >= 0)
MAX_POSITION = 2**63 - 1


@dataclass(frozen=True)
class BankSnapshot:
    """An immutable CSR view of a bank, as the backends consume it.

    Attributes:
        vectors: float32 [n, d], C-contiguous, unit rows; only live (not deleted)
            items. After ``MemoryBank.load(..., mmap=True)`` it may be backed by a
            copy-on-write memory map of the store's ``vectors.npy``.
        offsets: int64 [U + 1], non-decreasing, ``offsets[0] == 0``, ``offsets[U] == n``;
            user ``u`` owns rows ``offsets[u]:offsets[u+1]``.
        item_ids: object ndarray [n], the caller's item id (str or int) of each row.
        version: the bank's write counter when the snapshot was taken.
        users: the U user keys in segment order (str or int).
        texts: object ndarray [n], the text (str or None) of each row; None when
            the snapshot was made by hand without texts.
        scan: None for a float32 bank; for a float16 / bfloat16 bank the scan copy
            [n, d] of ``vectors`` rounded to that type (numpy float16, or uint16
            holding the bfloat16 bits); for an int8 bank the int8 codes [n, d]
            (:mod:`rfmem_fast.precision`).
        dtype: "float32", "float16", "bfloat16" or "int8": the type the rows are scanned in.
        lexical: the snapshot's :class:`rfmem_fast.lexical.LexicalIndex` (forward CSR
            of every row's token ids and, built on demand, per-user BM25 postings);
            None for a snapshot made by hand (no lexical channel).
        created_at: float64 [n], each row's creation time in seconds since the Unix
            epoch (UTC; :meth:`MemoryBank.add`), NaN where unknown (rows loaded from a
            store written before timestamps, format < 4); None for a snapshot made by
            hand (every time unknown: :attr:`created_at_or_nan`).
        scan_meta: float32 [n, 3] for an int8 bank (per row: the scale, an upper bound of
            the residual norm, an upper bound of the norm:
            :func:`rfmem_fast.precision.int8_scan_copy`), else None.
        threads: object [n], each row's conversation thread (str or int; None for a row
            without one: :meth:`MemoryBank.add`), or None when no row has a thread.
        positions: int64 [n], each row's position in its thread (>= 0;
            :data:`NO_POSITION` = -1 where none was given), or None when no row has one.

    Nothing here may be written: banks and searches share these arrays.
    """

    vectors: np.ndarray
    offsets: np.ndarray
    item_ids: np.ndarray
    version: int
    users: tuple = ()
    texts: np.ndarray | None = None
    scan: np.ndarray | None = None
    dtype: str = "float32"
    lexical: Any = None
    created_at: np.ndarray | None = None
    scan_meta: np.ndarray | None = None
    threads: np.ndarray | None = None
    positions: np.ndarray | None = None

    @property
    def threads_or_none(self) -> np.ndarray:
        """object [n]: :attr:`threads`, or all None when no row has a thread."""
        if self.threads is not None:
            return self.threads
        return np.full(self.num_items, None, dtype=object)

    @property
    def positions_or_missing(self) -> np.ndarray:
        """int64 [n]: :attr:`positions`, or all :data:`NO_POSITION` when no row has a position."""
        if self.positions is not None:
            return self.positions
        return np.full(self.num_items, NO_POSITION, dtype=np.int64)

    @property
    def created_at_or_nan(self) -> np.ndarray:
        """float64 [n]: :attr:`created_at`, or all NaN (unknown) when the snapshot has none."""
        if self.created_at is not None:
            return self.created_at
        return np.full(self.num_items, np.nan)

    @property
    def num_users(self) -> int:
        """Number of user segments U."""
        return int(self.offsets.shape[0] - 1)

    @property
    def num_items(self) -> int:
        """Number of live rows n."""
        return int(self.vectors.shape[0])

    @property
    def segment_lengths(self) -> np.ndarray:
        """int64 [U]: rows per user."""
        return np.diff(self.offsets)

    @property
    def scan_vectors(self) -> np.ndarray:
        """The rows a scan reads: ``scan`` for a half-precision or int8 bank, else ``vectors``."""
        return self.scan if self.scan is not None else self.vectors

    @property
    def scan_nbytes(self) -> int:
        """Bytes of :attr:`scan_vectors` (and of :attr:`scan_meta`): what a scan of every
        row reads, and what the backends hold resident for scanning (n d 4 for float32,
        n d 2 for a half-precision bank, n (d + 12) for int8)."""
        meta = 0 if self.scan_meta is None else int(self.scan_meta.nbytes)
        return int(self.scan_vectors.nbytes) + meta


# ---------------------------------------------------------------------- argument checks
def _check_user(user: Any, name: str = "user") -> Hashable:
    """A user key as stored: str or int (numpy scalars converted; bool refused)."""
    if isinstance(user, (bool, np.bool_)) or not isinstance(user, (str, int, np.integer)):
        raise TypeError(f"{name} must be a str or an int, got {type(user).__name__}")
    if isinstance(user, np.integer):
        return int(user)
    return str(user) if isinstance(user, np.str_) else user


def _check_id_list(ids: Any, name: str = "ids") -> list[ItemId]:
    """Item ids as stored: a sequence of str or int (numpy scalars converted), no duplicates."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a sequence of str or int item ids, got {type(ids).__name__}")
    out: list[ItemId] = []
    for i in ids:
        if isinstance(i, np.integer) and not isinstance(i, np.bool_):
            i = int(i)
        elif isinstance(i, np.str_):
            i = str(i)
        if isinstance(i, bool) or not isinstance(i, (str, int)):
            raise TypeError(f"{name} must hold str or int item ids, got {type(i).__name__}")
        out.append(i)
    if len(set(out)) != len(out):
        seen: set = set()
        dup = next(i for i in out if i in seen or seen.add(i))
        raise ValueError(f"{name} holds the duplicate item id {dup!r}")
    return out


def _check_ids(ids: Any, n: int, name: str = "ids") -> list[ItemId]:
    out = _check_id_list(ids, name)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but vectors has {n} rows")
    return out


def _check_unicode(text: str, name: str) -> str:
    """``text`` if it is valid Unicode (encodable as UTF-8), else ValueError naming
    ``name`` and the index of the first lone surrogate (U+D800..U+DFFF), which no
    tokenizer, JSON writer or HTTP response can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} holds a lone surrogate {text[exc.start]!r} at index {exc.start}: not valid Unicode text"
        ) from None
    return text


def _check_texts(texts: Any, n: int) -> list[str | None]:
    if texts is None:
        return [None] * n
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be a sequence of str (or None), got a single string")
    if not hasattr(texts, "__iter__"):
        raise TypeError(f"texts must be a sequence of str (or None), got {type(texts).__name__}")
    out = list(texts)
    if len(out) != n:
        raise ValueError(f"texts has {len(out)} entries but vectors has {n} rows")
    for i, t in enumerate(out):
        if t is not None and not isinstance(t, str):
            raise TypeError(f"texts must hold str or None, got {type(t).__name__}")
        if t is not None:
            _check_unicode(t, f"texts[{i}]")
    return [None if t is None else str(t) for t in out]


#: deepest nesting of lists / dicts accepted in one item's metadata
MAX_METADATA_DEPTH = 64


def _nesting_depth(obj: Any) -> int:
    """Nesting depth of dicts / lists in ``obj`` (iterative: no recursion limit)."""
    depth, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list, tuple)):
            depth = max(depth, d)
            if depth > MAX_METADATA_DEPTH:
                return depth
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return depth


def _find_value(obj: Any, pred: Any) -> tuple[str, Any] | None:
    """The first value inside ``obj`` (dicts / lists / tuples, depth first) for which
    ``pred`` holds, with its path as Python writes it (``['when']``, ``['a'][0]``); None
    when there is none. Iterative: no recursion limit."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, o = stack.pop()
        if pred(o):
            return path, o
        if isinstance(o, dict):
            stack.extend(reversed([(f"{path}[{k!r}]", v) for k, v in o.items()]))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed([(f"{path}[{i}]", v) for i, v in enumerate(o)]))
    return None


def _check_metadata(metadata: Any, n: int) -> list[dict | None]:
    """Per-item metadata as stored: m JSON objects (or None), deep-copied through JSON.

    Raises:
        TypeError: not a sequence of dicts / None.
        ValueError: wrong length, an entry nested deeper than ``MAX_METADATA_DEPTH``, or
            one that does not survive a JSON round trip unchanged (non-str keys, tuples,
            NaN / Inf, non-JSON values; a ``datetime`` / ``date`` / ``time`` is named by
            its path with the advice to store its ``.isoformat()`` string).
    """
    if metadata is None:
        return [None] * n
    if isinstance(metadata, (str, bytes, dict)) or not hasattr(metadata, "__iter__"):
        raise TypeError(f"metadata must be a sequence of dicts (or None), one per item, got {type(metadata).__name__}")
    out = list(metadata)
    if len(out) != n:
        raise ValueError(f"metadata has {len(out)} entries but there are {n} items")
    for j, m in enumerate(out):
        if m is None:
            continue
        if not isinstance(m, dict):
            raise TypeError(f"metadata[{j}] must be a dict or None, got {type(m).__name__}")
        if _nesting_depth(m) > MAX_METADATA_DEPTH:
            raise ValueError(f"metadata[{j}] nests deeper than {MAX_METADATA_DEPTH} levels")
        try:
            dumped = json.dumps(m, allow_nan=False, ensure_ascii=False)
            copied = json.loads(dumped)
        except (TypeError, ValueError, RecursionError) as exc:
            when = _find_value(m, lambda o: isinstance(o, (date, clock_time)))
            if when is not None:
                path, o = when
                raise ValueError(
                    f"metadata[{j}]{path} is a {type(o).__name__}, which JSON cannot hold: store it as a string, "
                    f"value.isoformat() ({o.isoformat()!r}); a filter with a datetime bound compares such strings "
                    "as instants (rfmem_fast.filters)"
                ) from None
            raise ValueError(f"metadata[{j}] is not JSON-serialisable: {exc}") from None
        _check_unicode(dumped, f"metadata[{j}] (as JSON)")
        if copied != m:
            raise ValueError(
                f"metadata[{j}] does not survive a JSON round trip unchanged "
                "(use str keys, lists rather than tuples, finite numbers)"
            )
        out[j] = copied
    return out


#: The instants a creation time may hold: those Python's ``datetime`` represents in UTC,
#: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999Z, as float seconds since the Unix
#: epoch: ``INSTANT_MIN <= t < INSTANT_END`` (the start of year 10000, excluded).
INSTANT_MIN = -62135596800.0
INSTANT_END = 253402300800.0
#: the accepted range as error messages and docs write it
INSTANT_RANGE = ("0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999Z, i.e. "
                 f"{INSTANT_MIN:.0f} <= seconds since the Unix epoch < {INSTANT_END:.0f}")
#: units an out-of-range time may have been written in by mistake (name, per second)
_TIME_UNITS = (("milliseconds", 1e3), ("microseconds", 1e6), ("nanoseconds", 1e9))
#: the unit hint is given for values at least this far from 0 (so not for one just past
#: either end of the range) that read as a creation time in 1900-01-01 .. 2200-01-01 (UTC)
_HINT_FROM = 1e12
_PLAUSIBLE = (-2208988800.0, 7258118400.0)


def instants_known(t: Any) -> np.ndarray:
    """bool array shaped like ``t``: True where a stored creation time (float seconds
    since the Unix epoch) is a known instant, within ``INSTANT_MIN <= t < INSTANT_END``;
    False for NaN (unknown) and for anything outside (not an instant: a value written
    before the range was checked, e.g. epoch milliseconds)."""
    t = np.asarray(t, dtype=np.float64)
    return (t >= INSTANT_MIN) & (t < INSTANT_END)


def check_instant(t: float, where: str, given: Any = None) -> float:
    """A creation time checked at the door: ``t`` when it is an instant Python's
    ``datetime`` can represent in UTC (:data:`INSTANT_RANGE`).

    The one range check of every write that takes a creation time: :meth:`MemoryBank.add`,
    :meth:`MemoryBank.update` and :meth:`MemoryBank.from_arrays` (through
    :func:`check_created_at`), and ``Memory.add`` / ``Memory.add_many``, ``rfmem import``
    and the HTTP bodies (:mod:`rfmem_fast.serving.memory`), before anything is logged.

    Args:
        t: float seconds since the Unix epoch (finite).
        where: the argument's name in the message (``created_at``, ``created_at[3]``,
            ``items[3].created_at``).
        given: the value as the caller wrote it when it was no number (a datetime, an
            ISO-8601 string), shown in the message too.

    Returns:
        ``t``.

    Raises:
        ValueError: ``t`` outside the range; the message names ``where``, gives the range
            and, when ``t`` (at least 1e12 in magnitude) reads as a time of 1900-2200 in
            milli-, micro- or nanoseconds since the epoch, what to divide it by (``1774747800000 looks like
            milliseconds since the epoch: divide by 1000 (2026-03-29T01:30:00Z)``).
    """
    if INSTANT_MIN <= t < INSTANT_END:
        return t
    shown = str(int(t)) if math.isfinite(t) and t == int(t) and abs(t) < 1e21 else repr(float(t))
    if given is not None and not isinstance(given, (int, float, np.integer, np.floating)):
        shown = f"{given!r} ({shown} seconds since the Unix epoch)"
    msg = f"{where}: {shown} is outside the instants a creation time can hold, {INSTANT_RANGE}"
    for unit, per in _TIME_UNITS if abs(t) >= _HINT_FROM else ():
        s = t / per
        if _PLAUSIBLE[0] <= s < _PLAUSIBLE[1]:
            when = datetime.fromtimestamp(s, tz=timezone.utc).isoformat().replace("+00:00", "Z")
            msg += f"; {shown} looks like {unit} since the epoch: divide by {per:.0f} ({when})"
            break
    raise ValueError(msg)


def check_created_at(created_at: Any, n: int, now: float | None = None) -> list[float]:
    """Per-item creation times as stored: n float seconds since the Unix epoch (UTC).

    Args:
        created_at: None (every item gets ``now``), one real number (every item), or a
            sequence of n real numbers (numpy arrays accepted); NaN means "unknown"
            (what a store of format < 4 loads as; it matches no ``created_at``
            comparison). Datetimes and ISO-8601 strings are converted by the facade
            (:mod:`rfmem_fast.serving.memory`), not here.
        n: the number of items.
        now: the time for None (default ``time.time()``).

    Returns:
        list of n floats (within :data:`INSTANT_RANGE`, or NaN).

    Raises:
        TypeError: not a real number or a sequence of them (bool refused).
        ValueError: wrong length, an infinite value, or one outside
            :data:`INSTANT_RANGE` (:func:`check_instant`: ``created_at`` or
            ``created_at[i]`` named, with a hint for epoch milliseconds and the like).
    """
    def one(v: Any, where: str) -> float:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"{where} must be a real number of seconds since the Unix epoch (UTC), got {type(v).__name__}")
        try:
            f = float(v)
        except OverflowError:  # an int beyond the float64 range
            f = math.inf if v > 0 else -math.inf
        if math.isinf(f):
            raise ValueError(f"{where} must be finite (or NaN: unknown), got {f!r}")
        return f if f != f else check_instant(f, where)

    if created_at is None:
        return [float(time.time()) if now is None else float(now)] * n
    if isinstance(created_at, np.ndarray) and created_at.ndim == 0:
        created_at = created_at.item()
    if isinstance(created_at, (int, float, np.integer, np.floating)) and not isinstance(created_at, (bool, np.bool_)):
        return [one(created_at, "created_at")] * n
    return _per_item(created_at, n, "created_at",
                     "None, a number of seconds since the Unix epoch (UTC) or a sequence of them", one)


def _per_item(values: Any, n: int, name: str, expected: str, one: Callable[[Any, str], Any]) -> list:
    """The n entries of a per-item sequence argument, each as ``one(value, f"{name}[i]")`` gives it.

    Raises:
        TypeError: ``values`` is a str / bytes / dict or not iterable (the message says
            ``name`` must be ``expected``), or what ``one`` raises.
        ValueError: not n entries, or what ``one`` raises.
    """
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be {expected}, got {type(values).__name__}")
    out = list(values)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but there are {n} items")
    return [one(v, f"{name}[{j}]") for j, v in enumerate(out)]


def _thread_key(v: Any, where: str) -> Hashable | None:
    """One thread as stored: None, or a str / int (numpy scalars converted; bool refused)."""
    if v is None:
        return None
    if isinstance(v, np.integer) and not isinstance(v, np.bool_):
        return int(v)
    if isinstance(v, np.str_):
        return str(v)
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise TypeError(f"{where} must be a str or an int thread id (or None), got {type(v).__name__}")
    return v


def check_threads(threads: Any, n: int) -> list:
    """Per-item conversation threads as stored: n entries, each None or a str / int.

    Args:
        threads: None (no item has a thread), one str / int (every item in that thread),
            or a sequence of n str / int / None (numpy scalars accepted). A thread is an
            id like an item id: ``"1"`` and ``1`` are different threads.
        n: the number of items.

    Returns:
        list of n (str / int / None).

    Raises:
        TypeError: a thread that is not a str / int / None (``threads[i]`` named; bool refused).
        ValueError: a sequence of another length than n.
    """
    if threads is None:
        return [None] * n
    if isinstance(threads, (str, int, np.integer, np.str_)) and not isinstance(threads, (bool, np.bool_)):
        return [_thread_key(threads, "threads")] * n
    return _per_item(threads, n, "threads",
                     "None, one str / int thread id, or a sequence of them (None for an item without a thread)",
                     _thread_key)


def check_positions(positions: Any, n: int) -> list:
    """Per-item positions in their threads as stored: n entries, each None or an int >= 0.

    Args:
        positions: None (no item has a position) or a sequence of n ints (>= 0, at most
            :data:`MAX_POSITION`) or None (numpy integers accepted; bools and floats refused).
        n: the number of items.

    Returns:
        list of n (int / None).

    Raises:
        TypeError: not a sequence, or an entry that is not an int / None (``positions[i]`` named).
        ValueError: a sequence of another length than n, or a negative / too large position.
    """
    if positions is None:
        return [None] * n
    return _per_item(positions, n, "positions",
                     "None or a sequence of ints >= 0 (None for an item without a position), one per item",
                     _position)


def _position(p: Any, where: str) -> int | None:
    """One position as stored: None, or an int in [0, MAX_POSITION] (numpy integers converted; bool refused)."""
    if p is None:
        return None
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)):
        raise TypeError(f"{where} must be an int >= 0 (or None), got {type(p).__name__}")
    p = int(p)
    if not 0 <= p <= MAX_POSITION:
        raise ValueError(f"{where} must be an int in [0, 2**63 - 1], got {p}")
    return p


def _check_thread_pairs(threads: list, positions: list, where: str = "") -> None:
    """ValueError when an item has a position but no thread (a position orders an item within its thread)."""
    for j, (t, p) in enumerate(zip(threads, positions)):
        if p is not None and t is None:
            raise ValueError(
                f"positions[{j}] is {p} but {where}threads[{j}] is None: a position orders an item within its "
                "thread, so an item with a position needs a thread"
            )


def _positions_array(positions: Sequence[int | None]) -> np.ndarray:
    """int64 [n] of positions, :data:`NO_POSITION` for None."""
    out = np.empty(len(positions), dtype=np.int64)
    if len(positions):
        out[:] = [NO_POSITION if p is None else p for p in positions]
    return out


def _object_array(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    if len(values):
        out[:] = list(values)
    return out


# ---------------------------------------------------------------------- per-user storage
class _UserRows:
    """Row storage of one user; every method runs under the bank's lock.

    Slots ``0 .. nb-1`` live in ``base`` (shared, never written), slots ``nb ..`` in
    ``tail[:n_tail]`` (owned). ``ids`` / ``texts`` / ``toks`` / ``alive`` are per slot and exist
    only while the user is ``dirty`` (changed since the last snapshot), like ``created``
    (creation times, float seconds); a clean user is described by ``base`` plus
    ``ids_arr`` / ``texts_arr`` / ``created_arr``, views into the last snapshot, and ``lex_src`` = (that snapshot's LexicalIndex, first row, end row).
    ``toks`` holds each slot's encoded text ((terms, tf) int32 arrays, or None for an
    item without text: :mod:`rfmem_fast.lexical`), computed once when the text is written.
    """

    __slots__ = (
        "base", "tail", "n_tail", "ids", "texts", "alive", "n_dead", "patches",
        "slot_of", "dirty", "ids_arr", "texts_arr", "toks", "lex_src", "created", "created_arr",
        "threads", "threads_arr", "positions", "positions_arr",
    )

    def __init__(self, dim: int) -> None:
        self.base = np.zeros((0, dim), dtype=np.float32)
        self.tail: np.ndarray | None = None
        self.n_tail = 0
        self.ids: list = []
        self.texts: list = []
        self.alive = bytearray()
        self.n_dead = 0
        self.patches: dict[int, np.ndarray] = {}
        self.slot_of: dict | None = {}
        self.dirty = True
        self.ids_arr: np.ndarray | None = None
        self.texts_arr: np.ndarray | None = None
        self.toks: list = []
        self.lex_src: tuple | None = None
        self.created: list = []
        self.created_arr: np.ndarray | None = None
        self.threads: list = []
        self.threads_arr: np.ndarray | None = None
        self.positions: list = []
        self.positions_arr: np.ndarray | None = None

    # ---------------------------------------------------------------- reading
    @property
    def n_live(self) -> int:
        if not self.dirty:
            return int(self.base.shape[0])
        return len(self.ids) - self.n_dead

    def _live(self, per_slot: list, clean: np.ndarray | None) -> list:
        if not self.dirty:
            return list(clean)
        if not self.n_dead:
            return list(per_slot)
        return [v for v, a in zip(per_slot, self.alive) if a]

    def live_ids(self) -> list:
        """Item ids of the live rows, in row order."""
        return self._live(self.ids, self.ids_arr)

    def live_texts(self) -> list:
        """Texts of the live rows (None where none was given), in row order."""
        return self._live(self.texts, self.texts_arr)

    def live_created(self) -> list:
        """Creation times (float seconds, NaN unknown) of the live rows, in row order."""
        return self._live(self.created, self.created_arr)

    def live_threads(self) -> list:
        """Threads (str / int / None) of the live rows, in row order."""
        return self._live(self.threads, self.threads_arr)

    def live_positions(self) -> list:
        """Positions (int / None) of the live rows, in row order."""
        if not self.dirty:
            return [None if p == NO_POSITION else p for p in self.positions_arr.tolist()]
        return self._live(self.positions, None)

    def live_toks(self) -> list:
        """Encoded texts ((terms, tf) or None) of the live rows, in row order."""
        if not self.dirty:
            if self.lex_src is None:
                return [None] * int(self.base.shape[0])
            index, a, b = self.lex_src
            return index.docs(a, b)
        return self._live(self.toks, None)

    def lex_segment(self) -> tuple:
        """The live rows' forward lexical CSR (ptr from 0, terms, tf, has_text)."""
        if not self.dirty and self.lex_src is not None:
            index, a, b = self.lex_src
            return index.segment(a, b)
        return docs_segment(self.live_toks())

    def slots(self) -> dict:
        """{live item id: slot}, built on demand."""
        if self.slot_of is None:
            ids = self.ids if self.dirty else self.ids_arr
            if self.dirty and self.n_dead:
                self.slot_of = {i: s for s, (i, a) in enumerate(zip(ids, self.alive)) if a}
            else:
                self.slot_of = {i: s for s, i in enumerate(ids)}
        return self.slot_of

    def fill(self, out: np.ndarray) -> None:
        """Write the live rows, in slot order, into ``out`` [n_live, d]."""
        alive = np.frombuffer(bytes(self.alive), dtype=np.bool_) if (self.dirty and self.n_dead) else None
        nb = self.base.shape[0]
        pos = 0
        parts = [(self.base, 0)]
        if self.tail is not None and self.n_tail:
            parts.append((self.tail[: self.n_tail], nb))
        for arr, s0 in parts:
            m = arr.shape[0]
            if m == 0:
                continue
            if alive is None:
                out[pos : pos + m] = arr
                pos += m
            else:
                msk = alive[s0 : s0 + m]
                c = int(msk.sum())
                np.compress(msk, arr, axis=0, out=out[pos : pos + c])
                pos += c
        if self.patches:
            slots = np.fromiter(self.patches.keys(), dtype=np.int64, count=len(self.patches))
            rows = (np.cumsum(alive) - 1)[slots] if alive is not None else slots
            out[rows] = np.stack(list(self.patches.values()))

    # ---------------------------------------------------------------- writing
    def begin_write(self) -> None:
        """Turn a clean (snapshot-backed) user into a writable one: O(n_u) list copies."""
        if self.dirty:
            return
        n = int(self.base.shape[0])
        self.ids = list(self.ids_arr)
        self.texts = list(self.texts_arr)
        self.created = list(self.created_arr)
        self.threads = list(self.threads_arr)
        self.positions = self.live_positions()
        self.toks = self.live_toks()
        self.alive = bytearray(b"\x01") * n
        self.n_dead = 0
        self.patches = {}
        self.tail = None
        self.n_tail = 0
        self.dirty = True

    def append(self, vec: np.ndarray, ids: list, texts: list, toks: list, created: list, threads: list,
               positions: list) -> None:
        m = vec.shape[0]
        if self.tail is None:
            self.tail, self.n_tail = vec, m  # vec is a fresh array owned by the bank
        else:
            need = self.n_tail + m
            if need > self.tail.shape[0]:
                grown = np.empty((max(need, 2 * self.tail.shape[0], 16), vec.shape[1]), dtype=np.float32)
                grown[: self.n_tail] = self.tail[: self.n_tail]
                self.tail = grown
            self.tail[self.n_tail : need] = vec
            self.n_tail = need
        slots = self.slots()
        s0 = len(self.ids)
        for j, i in enumerate(ids):
            slots[i] = s0 + j
        self.ids.extend(ids)
        self.texts.extend(texts)
        self.toks.extend(toks)
        self.created.extend(created)
        self.threads.extend(threads)
        self.positions.extend(positions)
        self.alive.extend(b"\x01" * m)

    def set_row(self, slot: int, row: np.ndarray) -> None:
        nb = self.base.shape[0]
        if slot < nb:
            self.patches[slot] = row  # the base is shared with a snapshot: never written
        else:
            self.tail[slot - nb] = row

    def kill(self, slot: int) -> None:
        self.alive[slot] = 0
        self.patches.pop(slot, None)
        self.n_dead += 1

    def compact(self, dim: int) -> None:
        """Drop tombstones and patches into one owned buffer: O(n_u d)."""
        out = np.empty((self.n_live, dim), dtype=np.float32)
        self.fill(out)
        self.ids, self.texts, self.toks = self.live_ids(), self.live_texts(), self.live_toks()
        self.created = self.live_created()
        self.threads, self.positions = self.live_threads(), self.live_positions()
        self.base = np.zeros((0, dim), dtype=np.float32)
        self.tail, self.n_tail = out, out.shape[0]
        self.alive = bytearray(b"\x01") * out.shape[0]
        self.n_dead = 0
        self.patches = {}
        self.slot_of = None

    def rebase(self, vectors: np.ndarray, item_ids: np.ndarray, texts: np.ndarray, lex_src: tuple | None = None,
               created: np.ndarray | None = None, threads: np.ndarray | None = None,
               positions: np.ndarray | None = None) -> None:  # fmt: skip
        """Point a user at its segment of a new snapshot (drops tail, tombstones, patches);
        ``lex_src`` = (the snapshot's LexicalIndex, first row, end row) of the segment,
        ``created`` its creation times (float64; None: unknown, NaN), ``threads`` /
        ``positions`` its threads (object) and positions (int64; None: none)."""
        if self.dirty and self.n_dead:
            self.slot_of = None  # slots shifted
        n = len(item_ids)
        self.base = vectors
        self.ids_arr, self.texts_arr = item_ids, texts
        self.created_arr = created if created is not None else np.full(n, np.nan)
        self.threads_arr = threads if threads is not None else np.full(n, None, dtype=object)
        self.positions_arr = positions if positions is not None else np.full(n, NO_POSITION, dtype=np.int64)
        self.lex_src = lex_src
        self.tail, self.n_tail = None, 0
        self.ids, self.texts, self.toks, self.alive = [], [], [], bytearray()
        self.created, self.threads, self.positions = [], [], []
        self.n_dead = 0
        self.patches = {}
        self.dirty = False


class MemoryBank:
    """Many users' memory items in one CSR layout, with incremental updates.

    Args:
        dim: vector dimension d (int >= 1).
        dtype: "float32" (default), "float16" or "bfloat16" (numpy / torch dtypes
            accepted): the type the rows are scanned in. A half-precision bank keeps a
            scan copy of its rows rounded to that type (half the bytes every query
            reads, and what the backends keep resident on their device) next to the
            float32 rows, which only the exact re-scoring of the candidates reads
            (about k rows per query); results equal the float32 bank's
            (:mod:`rfmem_fast.precision`, README "Half-precision banks"). In a bank
            loaded with ``MemoryBank.load(path, mmap=True)`` the float32 rows stay in the
            store file and only the re-scored rows' pages are read. "int8": an int8
            copy with a scale per row and two norm bounds (d + 12 bytes per row), which
            the native backend scans with integer dot products and a proven bound per
            (query, row); the other backends scan the float32 rows; results are the
            float32 bank's too (:func:`rfmem_fast.precision.int8_scan_copy`).

        lexical_stemmer: None (default) or "english": the stemmer of the bank's lexical
            (BM25) index (:mod:`rfmem_fast.lexical`; "english" needs PyStemmer, the
            ``lexical`` extra). Every item's text is tokenised once when it is written.

    Raises:
        TypeError: ``dim`` not an int (a bool, float or string).
        ValueError: ``dim`` < 1; an unknown ``dtype`` or ``lexical_stemmer``.
        ImportError: ``lexical_stemmer="english"`` without PyStemmer.

    Writes: :meth:`add`, :meth:`update`, :meth:`delete` (per-user blocks, tombstones,
    no rebuild of the whole bank per write), :meth:`compact`. Reads: :meth:`snapshot`
    (an immutable :class:`BankSnapshot` of the live rows). Persistence: :meth:`save`,
    :meth:`load`. The module docstring gives the cost and concurrency models.

    Thread safety: any number of threads may search while one or more threads write;
    every search sees one consistent snapshot (a write lock plus immutable
    copy-on-write snapshots).
    """

    def __init__(self, dim: int, dtype: Any = "float32", lexical_stemmer: str | None = None) -> None:
        self._dim = check_positive_int(dim, "dim")
        self._dtype = check_dtype(dtype)
        self._analyzer = Analyzer(lexical_stemmer)
        self._vocab = Vocabulary()
        self._lock = threading.RLock()
        self._users: list[Hashable] = []
        self._uindex: dict[Hashable, int] = {}
        self._rows: list[_UserRows] = []
        self._n_live = 0
        self._version = 0
        self._snap: BankSnapshot | None = None
        self._cache: dict[Any, Any] = {}
        self._store: tuple[str, bool] | None = None  # (path, mmap) when made by load()
        # per-item metadata, {user: {item id: dict}}, only for items that have some;
        # not part of the snapshot (only filtered searches read it, through
        # metadata_rows / metadata_cached), guarded by the lock
        self._meta: dict[Hashable, dict[ItemId, dict]] = {}
        # derived per-(snapshot, metadata) values (rfmem_fast.filters' columns): dropped
        # by every write and by set_metadata
        self._meta_cache: dict[Any, Any] = {}

    def __repr__(self) -> str:
        """``MemoryBank(dim=384, users=2, items=79, version=5, dtype=float16[, store='...', mmap=True])``.

        ``items`` counts live items (deleted ones excluded); ``store`` is the directory
        the bank was loaded from (:meth:`load`; absent otherwise), ``mmap`` whether its
        vectors were memory-mapped then. O(1); takes no lock.
        """
        parts = [
            f"dim={self._dim}", f"users={len(self._users)}", f"items={self._n_live}",
            f"version={self._version}", f"dtype={self._dtype}",
        ]  # fmt: skip
        if self._store is not None:
            parts.append(f"store={self._store[0]!r}")
            if self._store[1]:
                parts.append("mmap=True")
        return f"MemoryBank({', '.join(parts)})"


    # ------------------------------------------------------------------ building
    @classmethod
    def from_arrays(
        cls,
        vectors: Any,
        offsets: Any,
        users: Sequence[Hashable] | None = None,
        item_ids: Sequence[ItemId] | None = None,
        texts: Sequence[str | None] | None = None,
        dtype: Any = "float32",
        lexical_stemmer: str | None = None,
        created_at: Any = None,
        threads: Any = None,
        positions: Any = None,
    ) -> "MemoryBank":
        """Build a bank from a CSR layout in one call.

        Args:
            vectors: [n, d] floating array (float16/32/64, any strides); rows are
                L2-normalised.
            offsets: int [U + 1] non-decreasing, starting at 0 and ending at n; user
                ``u`` owns rows ``offsets[u]:offsets[u+1]`` (a user may own none).
            users: U distinct user keys (str or int); default ``0 .. U-1``.
            item_ids: n item ids (str or int), unique within each user; default the
                row's position inside its user's segment (0, 1, ...).
            texts: n optional texts.
            dtype: the bank's scan type (see :class:`MemoryBank`).
            lexical_stemmer: the lexical index's stemmer (see :class:`MemoryBank`).
            created_at: None (every item: now), one number, or n numbers: creation
                times in seconds since the Unix epoch, UTC (as :meth:`add`).
            threads: None, one thread id, or n threads (str / int / None), as :meth:`add`.
            positions: None or n positions (int >= 0 / None), as :meth:`add`.

        Returns:
            MemoryBank.

        Raises:
            TypeError / ValueError: as :meth:`add`, or malformed ``offsets`` / ``users``,
                or an unknown ``dtype``.
        """
        vec = as_float_matrix(vectors, "vectors")
        off = np.asarray(offsets)
        if off.ndim != 1 or off.shape[0] < 1 or not np.issubdtype(off.dtype, np.integer):
            raise ValueError(f"offsets must be a 1-D integer array [U + 1], got {off.dtype} {off.shape}")
        off = off.astype(np.int64)
        if off[0] != 0 or off[-1] != vec.shape[0] or (np.diff(off) < 0).any():
            raise ValueError(
                f"offsets must be non-decreasing from 0 to n={vec.shape[0]}, got {off[:5]}...{off[-1:]}"
            )
        n_users = off.shape[0] - 1
        if users is None:
            users = list(range(n_users))
        users = list(users)
        if len(users) != n_users:
            raise ValueError(f"users has {len(users)} entries but offsets describes {n_users} users")
        if len(set(_check_user(u, "users") for u in users)) != len(users):
            raise ValueError("users holds duplicate user keys")
        if item_ids is not None and len(item_ids) != vec.shape[0]:
            raise ValueError(f"item_ids has {len(item_ids)} entries but vectors has {vec.shape[0]} rows")
        if texts is not None and len(texts) != vec.shape[0]:
            raise ValueError(f"texts has {len(texts)} entries but vectors has {vec.shape[0]} rows")
        created = check_created_at(created_at, vec.shape[0])
        thr = check_threads(threads, vec.shape[0])
        pos = check_positions(positions, vec.shape[0])
        _check_thread_pairs(thr, pos)
        bank = cls(vec.shape[1], dtype=dtype, lexical_stemmer=lexical_stemmer)
        for u, user in enumerate(users):
            a, b = int(off[u]), int(off[u + 1])
            ids = list(item_ids[a:b]) if item_ids is not None else list(range(b - a))
            tx = list(texts[a:b]) if texts is not None else None
            bank._add_unlocked(user, vec[a:b], ids, tx, allow_empty=True, created_at=created[a:b], threads=thr[a:b],
                               positions=pos[a:b])  # fmt: skip
        return bank

    def add(
        self,
        user: Hashable,
        vectors: Any,
        ids: Sequence[ItemId],
        texts: Sequence[str | None] | None = None,
        metadata: Sequence[dict | None] | None = None,
        created_at: Any = None,
        threads: Any = None,
        positions: Any = None,
    ) -> None:
        """Append items to a user's memory (creating the user if new).

        Args:
            user: user key, str or int (bool refused; numpy scalars accepted).
            vectors: [m, d] floating array (float16/32/64, any strides, numpy or torch),
                m >= 1; each row is L2-normalised before it is stored.
            ids: m item ids (str or int; ``"1"`` and ``1`` are different ids), unique
                within the user's live items. The id of a deleted item may be reused.
            texts: m optional texts (str or None; the empty string is a valid text and
                is kept as ``""``, distinct from None).
            metadata: m optional per-item metadata dicts (or None): JSON objects (str
                keys, JSON values), stored as a deep copy, saved with the bank and read
                back by :meth:`get_metadata`. Only filtered searches read them
                (:mod:`rfmem_fast.filters`).
            created_at: the items' creation times, float64 seconds since the Unix epoch
                (UTC): None (default: now, ``time.time()``, the same for all m), one
                number for all m, or m numbers; each within :data:`INSTANT_RANGE`
                (0001-01-01 .. 9999-12-31 in UTC, :func:`check_instant`). Kept by :meth:`update` unless
                given, stored in the snapshot (:attr:`BankSnapshot.created_at`), saved
                with the bank, and filterable as the reserved field ``created_at``; NaN
                marks an unknown time.
            threads: the items' conversation threads (a session, a chat): None (default:
                no item has one), one str / int thread id for all m, or m entries (str /
                int / None). Ids like item ids (``"1"`` is not ``1``). Stored in the
                snapshot (:attr:`BankSnapshot.threads`), saved with the bank, kept by
                :meth:`update` unless given, filterable as the reserved field ``thread``;
                read by the context score (``RFMemConfig.context_weight`` /
                ``thread_weight``, docs "Conversations").
            positions: the items' positions in their threads (their turn order): None
                (default) or m entries (int >= 0, or None). Items of one thread are
                ordered by position, then by row (insertion order); an item without a
                position comes after those with one. An item with a position must have
                a thread. Filterable as the reserved field ``position``.

        Cost: amortised O(m d) (the user's tail buffer doubles); the next read builds
        a new snapshot (module docstring).

        Raises:
            TypeError: wrong type of user, ids, texts, metadata or a non-floating dtype.
            ValueError: wrong shape or dimension, no rows, NaN / Inf, a zero vector,
                mismatched lengths, a duplicate id, an id the user already holds,
                metadata that is not JSON (a ``datetime`` named, with the ``.isoformat()``
                advice), or a ``created_at`` that is infinite or outside
                :data:`INSTANT_RANGE` (``created_at[i]`` named, with a hint for epoch
                milliseconds and the like); a thread that is not a str / int / None
                (TypeError naming ``threads[i]``), a position that is not an int >= 0
                (``positions[i]`` named), a position without a thread.
            Nothing is written when an error is raised.
        """
        with self._lock:
            self._add_unlocked(user, vectors, ids, texts, allow_empty=False, metadata=metadata, created_at=created_at,
                               threads=threads, positions=positions)  # fmt: skip

    def _add_unlocked(self, user, vectors, ids, texts, allow_empty: bool, metadata=None, created_at=None,
                      threads=None, positions=None) -> None:  # fmt: skip
        user = _check_user(user)
        vec = as_float_matrix(vectors, "vectors", self._dim)
        if vec.shape[0] == 0 and not allow_empty:
            raise ValueError("vectors must hold at least one row")
        vec = l2_normalize_rows(vec, "vectors")
        id_list = _check_ids(ids, vec.shape[0])
        tx = _check_texts(texts, vec.shape[0])
        meta = _check_metadata(metadata, vec.shape[0])
        created = check_created_at(created_at, vec.shape[0])
        thr = check_threads(threads, vec.shape[0])
        pos = check_positions(positions, vec.shape[0])
        _check_thread_pairs(thr, pos)
        u = self._uindex.get(user)
        if u is not None:
            slots = self._rows[u].slots()
            clash = [i for i in id_list if i in slots]
            if clash:
                raise ValueError(f"ids: user {user!r} already holds item id {clash[0]!r}")
        else:
            u = len(self._users)
            self._rows.append(_UserRows(self._dim))
            self._users.append(user)
            self._uindex[user] = u
        if vec.shape[0]:
            toks = self._encode(tx)
            r = self._rows[u]
            r.begin_write()
            r.append(vec, id_list, tx, toks, created, thr, pos)
            self._n_live += vec.shape[0]
            self._set_metadata(user, id_list, meta)
        self._touch()

    def _encode(self, texts: list) -> list:
        """Each text tokenised and encoded ((terms, tf) int32 arrays; None for no text), under the lock."""
        an, voc = self._analyzer, self._vocab
        return [None if t is None else voc.encode_doc(an.tokens(t)) for t in texts]

    @property
    def lexical_stemmer(self) -> str | None:
        """The stemmer of the lexical index: None or "english"."""
        return self._analyzer.stemmer

    def _set_metadata(self, user: Hashable, ids: list, meta: list) -> None:
        """Store (dict) or clear (None) the metadata of ``ids`` (under the lock)."""
        store = self._meta.get(user)
        if store is None:
            if all(m is None for m in meta):
                return
            store = self._meta[user] = {}
        for i, m in zip(ids, meta):
            if m is None:
                store.pop(i, None)
            else:
                store[i] = m

    def delete(self, user: Hashable, ids: Sequence[ItemId], missing_ok: bool = False) -> int:
        """Delete items of a user; they are never returned by any later search.

        Args:
            user: an existing user key.
            ids: m >= 1 distinct item ids (str or int) the user holds.
            missing_ok: False (default): an id the user does not hold is an error
                (KeyError naming every missing id; nothing is deleted). True: such
                ids are skipped and the others deleted (an idempotent delete; when
                none is held, nothing changes, not even :attr:`version`).

        Returns:
            int: the number of items deleted (``m`` unless ``missing_ok`` skipped some).

        Cost: O(m) (tombstones); a user whose tombstones reach ``COMPACT_MIN_DEAD`` and
        outnumber its live rows is compacted on the spot (O(n_u d), amortised). The
        user stays, with 0 items when all are deleted (a search for it then gets the
        documented empty row).

        Raises:
            KeyError: unknown user (also with ``missing_ok=True``), or, with
                ``missing_ok=False``, ids the user does not hold (the message names
                them); nothing is deleted then.
            TypeError: ids not a sequence of str / int, or ``missing_ok`` not a bool.
            ValueError: no ids, or a duplicate id.
        """
        if not isinstance(missing_ok, (bool, np.bool_)):
            raise TypeError(f"missing_ok must be a bool, got {type(missing_ok).__name__}")
        with self._lock:
            u = self.user_index(user)
            id_list = _check_id_list(ids)
            if not id_list:
                raise ValueError("ids must hold at least one item id")
            if missing_ok:
                held = self._rows[u].slots()
                id_list = [i for i in id_list if i in held]
                if not id_list:
                    return 0
            r, slots = self._writable_slots(u, id_list)
            for i in id_list:
                r.kill(slots.pop(i))
            self._set_metadata(self._users[u], id_list, [None] * len(id_list))
            self._n_live -= len(id_list)
            if r.n_dead >= COMPACT_MIN_DEAD and r.n_dead > r.n_live:
                r.compact(self._dim)
            self._touch()
            return len(id_list)

    def _writable_slots(self, u: int, id_list: list) -> tuple["_UserRows", dict]:
        """User ``u``'s rows opened for writing and its {id: slot} map (under the lock).

        Raises:
            KeyError: ids the user does not hold, all named (the first 20, then a
                count); nothing is written then.
        """
        r = self._rows[u]
        slots = r.slots()
        missing = [i for i in id_list if i not in slots]
        if missing:
            if len(missing) == 1:
                what = f"item id {missing[0]!r}"
            else:
                shown = ", ".join(repr(i) for i in missing[:20])
                more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
                what = f"item ids {shown}{more} ({len(missing)} missing)"
            raise KeyError(f"ids: user {self._users[u]!r} holds no {what}")
        r.begin_write()
        return r, r.slots()

    def update(
        self,
        user: Hashable,
        ids: Sequence[ItemId],
        vectors: Any,
        texts: Sequence[str | None] | None = None,
        metadata: Sequence[dict | None] | None = None,
        created_at: Any = None,
        threads: Any = None,
        positions: Any = None,
    ) -> None:
        """Replace the vectors (and optionally texts, metadata, creation times, threads, positions) of existing items, keeping their ids.

        Args:
            user: an existing user key.
            ids: m >= 1 distinct item ids the user holds.
            vectors: [m, d] floating array, checked and L2-normalised as in :meth:`add`,
                or None to keep the items' vectors (change only the other fields; at
                least one of them must be given).
            texts: m new texts (str or None), or None to keep the current texts.
            metadata: m new metadata dicts (None entries clear an item's metadata), or
                None to keep the current metadata (:meth:`set_metadata` changes only
                metadata).
            created_at: None (default) keeps each item's creation time; one number or
                m numbers (seconds since the Unix epoch, UTC, within :data:`INSTANT_RANGE`)
                replace them.
            threads: None (default) keeps each item's thread; one thread id or m
                entries (str / int / None: None removes an item's thread) replace them.
            positions: None (default) keeps each item's position; m entries (int >= 0
                / None) replace them. The resulting items must not hold a position
                without a thread (clear both with ``threads=[None] * m,
                positions=[None] * m``).

        Each item keeps its id and its row position within the user (so ties still
        break as before). Cost: O(m d).

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
            TypeError / ValueError: as :meth:`add` (shapes, dtype, NaN / Inf, zero
                rows, lengths, duplicates); ``vectors`` None with nothing else to change
                (TypeError). Nothing is written when an error is raised.
        """
        with self._lock:
            u = self.user_index(user)
            if vectors is None:  # the other fields only: the rows are kept bit for bit
                if texts is None and metadata is None and created_at is None and threads is None and positions is None:
                    raise TypeError("vectors must be a floating [m, d] array, or None with another field to change "
                                    "(texts, metadata, created_at, threads, positions); got None and nothing else")
                vec = None
                id_list = _check_id_list(ids)
                if not id_list:
                    raise ValueError("ids must hold at least one item id")
            else:
                vec = as_float_matrix(vectors, "vectors", self._dim)
                if vec.shape[0] == 0:
                    raise ValueError("vectors must hold at least one row")
                vec = l2_normalize_rows(vec, "vectors")
                id_list = _check_ids(ids, vec.shape[0])
            m = len(id_list)
            tx = None if texts is None else _check_texts(texts, m)
            meta = None if metadata is None else _check_metadata(metadata, m)
            created = None if created_at is None else check_created_at(created_at, m)
            thr = None if threads is None else check_threads(threads, m)
            pos = None if positions is None else check_positions(positions, m)
            if (thr is None) != (pos is None):  # the items as they will be: no position without a thread
                r0 = self._rows[u]
                cur = {i: j for j, i in enumerate(r0.live_ids())}
                kept = r0.live_threads() if thr is None else r0.live_positions()
                old = [kept[cur[i]] if i in cur else None for i in id_list]
                _check_thread_pairs(old if thr is None else thr, pos if pos is not None else old,
                                    "the item's " if thr is None else "")  # fmt: skip
            elif thr is not None:
                _check_thread_pairs(thr, pos)
            r, slots = self._writable_slots(u, id_list)
            enc = self._encode(tx) if tx is not None else None
            for j, i in enumerate(id_list):
                s = slots[i]
                if vec is not None:
                    r.set_row(s, vec[j])
                if tx is not None:
                    r.texts[s] = tx[j]
                    r.toks[s] = enc[j]
                if created is not None:
                    r.created[s] = created[j]
                if thr is not None:
                    r.threads[s] = thr[j]
                if pos is not None:
                    r.positions[s] = pos[j]
            if meta is not None:
                self._set_metadata(self._users[u], id_list, meta)
            self._touch()

    def set_metadata(self, user: Hashable, ids: Sequence[ItemId], metadata: Sequence[dict | None]) -> None:
        """Replace the metadata of existing items (vectors and texts unchanged).

        Args:
            user: an existing user key.
            ids: m >= 1 distinct item ids the user holds.
            metadata: m dicts (JSON objects, as in :meth:`add`) or None (clears).

        Searches never read metadata, so neither :attr:`version` nor the snapshot
        changes. Cost: O(m) plus the JSON copy of the dicts.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
            TypeError / ValueError: malformed ids or metadata (nothing is written then).
        """
        with self._lock:
            u = self.user_index(user)
            id_list = _check_id_list(ids)
            if not id_list:
                raise ValueError("ids must hold at least one item id")
            meta = _check_metadata(metadata, len(id_list))
            slots = self._rows[u].slots()
            missing = [i for i in id_list if i not in slots]
            if missing:
                raise KeyError(f"ids: user {self._users[u]!r} holds no item id {missing[0]!r}")
            self._set_metadata(self._users[u], id_list, meta)
            self._meta_cache = {}

    def compact(self) -> int:
        """Reclaim the rows of deleted items now (build the snapshot and rebase on it).

        Tombstones are otherwise reclaimed at the next snapshot build (the first read
        after a write). Changes neither :attr:`version` nor any search result.

        Returns:
            int: the number of tombstoned rows dropped.

        Cost: one snapshot build when the bank changed since the last one (O(N d)), else O(U).
        """
        with self._lock:
            dropped = sum(r.n_dead for r in self._rows if r.dirty)
            if self._snap is None:
                self._snap = self._build_snapshot_locked()
            return dropped

    def _touch(self) -> None:
        # drop the published snapshot before the version moves (see cached())
        self._snap = None
        self._cache = {}
        self._meta_cache = {}
        self._version += 1

    # ------------------------------------------------------------------ persistence
    def save(self, path: Any) -> None:
        """Write the bank to a store directory, atomically (see :mod:`rfmem_fast.store`).

        Args:
            path: directory (created if absent; an existing store there is replaced
                only once the new one is complete and synced).

        Raises:
            StoreError: ``path`` exists but is not a store, or cannot be created or
                written into (permission, a parent that is a file, ...); OSError: I/O
                failure while writing (the previous store stays intact).
        """
        self._save(path)

    def _save(self, path: Any) -> Any:
        """:meth:`save`, returning the committed data directory (a Path)."""
        snap, metadata = self._snapshot_and_metadata()
        return write_store(path, snap, metadata, dim=self.dim, lexical_stemmer=self.lexical_stemmer)

    @classmethod
    def load(cls, path: Any, mmap: bool = False, verify: bool = True) -> "MemoryBank":
        """Read a bank written by :meth:`save`: the arrays :func:`rfmem_fast.store.read_store` reads, as a bank.

        Args:
            path: the store directory.
            mmap: map ``vectors.npy`` (copy-on-write) instead of reading it into memory.
            verify: check every file's sha256 and the rows' finiteness and norms.

        Returns:
            MemoryBank equal to the saved one (users, ids, texts, vectors, version). A
            creation time outside :data:`INSTANT_RANGE` (written by a version that did not
            check it) is read as unknown, NaN, with a warning on the ``rfmem_fast.bank``
            logger: such an item reads, searches and saves as one of an older store.

        Raises:
            StoreError (a ValueError): missing, corrupt, truncated, edited or
                newer-version store; the message names the file.
        """
        c = read_store(path, mmap=mmap, verify=verify)
        snap = BankSnapshot(c.vectors, c.offsets, c.item_ids, c.version, c.users, c.texts, c.scan, c.dtype, c.lexical,
                            c.created_at, c.scan_meta, c.threads, c.positions)  # fmt: skip
        bank = cls(c.dim, dtype=c.dtype, lexical_stemmer=c.lexical_stemmer)
        bank._install(snap, c.metadata)  # a store without a lexical index (format 1 / 2) is indexed here
        bank._store = (c.path, c.mmap)
        return bank

    def astype(self, dtype: Any) -> "MemoryBank":
        """A bank of another scan type holding this bank's current users, items and rows.

        Args:
            dtype: "float32", "float16", "bfloat16" or "int8" (see :class:`MemoryBank`).

        Returns:
            a new MemoryBank of ``dtype`` whose snapshot has this bank's float32 rows,
            offsets, users, item ids, texts and version, and a copy of the items'
            metadata. The float32 rows are SHARED with this bank's current snapshot (no
            copy: snapshots are immutable and neither bank ever writes them); the scan
            copy of a half or int8 type is computed here (O(n d)). Later writes to either bank do
            not affect the other.

        Raises:
            ValueError: an unknown ``dtype``.
        """
        dtype = check_dtype(dtype)
        with self._lock:
            snap = self.snapshot()
            meta = None
            if self._meta:
                meta = [None] * snap.num_items
                for u, user in enumerate(snap.users):
                    store = self._meta.get(user)
                    if store:
                        for r in range(int(snap.offsets[u]), int(snap.offsets[u + 1])):
                            m = store.get(snap.item_ids[r])
                            meta[r] = None if m is None else copy.deepcopy(m)
        scan, scan_meta = scan_copies(snap.vectors, dtype)
        out = MemoryBank(self._dim, dtype=dtype, lexical_stemmer=self.lexical_stemmer)
        out._install(dataclasses.replace(snap, scan=scan, dtype=dtype, scan_meta=scan_meta), meta)
        return out

    def _install(self, snap: BankSnapshot, metadata: Sequence[dict | None] | None = None) -> None:
        """Make ``snap`` the bank's content (used by the store loader; no copy), with the
        rows' metadata (list [n] of dict / None) when given."""
        if (snap.dtype != self._dtype or (snap.scan is None) != (self._dtype not in SCAN_DTYPES)
                or (snap.scan_meta is None) != (self._dtype != "int8")):
            raise ValueError(f"snapshot of dtype {snap.dtype!r} cannot be installed in a {self._dtype} bank")
        with self._lock:
            self._users = list(snap.users)
            self._uindex = {u: i for i, u in enumerate(self._users)}
            texts = snap.texts if snap.texts is not None else np.full(snap.num_items, None, dtype=object)
            if snap.texts is None:
                snap = dataclasses.replace(snap, texts=texts)
            lex = snap.lexical
            if lex is None or lex.analyzer.stemmer != self.lexical_stemmer:  # (re)build from the texts
                self._vocab = Vocabulary()
                lex = LexicalIndex.from_texts(snap.offsets, texts, self._vocab, self._analyzer, snap.item_ids)
            else:  # adopt the index with a vocabulary of our own (later writes must not share it)
                self._vocab = lex.vocab.copy()
                lex = LexicalIndex(snap.offsets, lex.ptr, lex.terms, lex.tf, lex.has_text, self._vocab,
                                   self._analyzer, lex.built_postings() if lex.item_ids is not None else None,
                                   snap.item_ids)  # fmt: skip  (postings built without the row ids: rebuilt)
            snap = dataclasses.replace(snap, lexical=lex)
            if snap.created_at is None:  # unknown creation times (a store of format < 4): NaN
                snap = dataclasses.replace(snap, created_at=np.full(snap.num_items, np.nan))
            created = snap.created_at
            odd = ~instants_known(created) & ~np.isnan(created)
            if odd.any():  # not instants (written before the range was checked): unknown, as NaN
                log.warning("%d items hold a creation time outside %s (e.g. %r): read as unknown (NaN)",
                            int(odd.sum()), INSTANT_RANGE, float(created[odd][0]))
                created = np.where(odd, np.nan, created)
                snap = dataclasses.replace(snap, created_at=created)
            thr, pos = snap.threads_or_none, snap.positions_or_missing
            self._rows = []
            for u in range(snap.num_users):
                a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
                r = _UserRows(self._dim)
                r.slot_of = None
                r.rebase(snap.vectors[a:b], snap.item_ids[a:b], texts[a:b], (lex, a, b), created[a:b], thr[a:b], pos[a:b])
                self._rows.append(r)
            self._n_live = snap.num_items
            self._version = int(snap.version)
            self._cache = {}
            self._meta_cache = {}
            self._meta = {}
            if metadata is not None:
                for u in range(snap.num_users):
                    a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
                    self._set_metadata(self._users[u], list(snap.item_ids[a:b]), list(metadata[a:b]))
            self._snap = snap

    # ------------------------------------------------------------------ reading
    @property
    def dim(self) -> int:
        """Vector dimension d."""
        return self._dim

    @property
    def dtype(self) -> str:
        """The type the rows are scanned in: "float32", "float16", "bfloat16" or "int8"."""
        return self._dtype

    @property
    def version(self) -> int:
        """Write counter: increases on every successful add / update / delete."""
        return self._version

    @property
    def users(self) -> list[Hashable]:
        """User keys in segment order (a copy); users are never removed."""
        return list(self._users)

    @property
    def num_users(self) -> int:
        """Number of users U (including users with 0 items)."""
        return len(self._users)

    @property
    def num_items(self) -> int:
        """Number of live items n over all users."""
        return self._n_live

    def __len__(self) -> int:
        return self.num_items

    def __contains__(self, user: object) -> bool:
        try:
            key = _check_user(user)
        except TypeError:
            return False
        return key in self._uindex

    def user_size(self, user: Hashable) -> int:
        """Number of live items of ``user``. Raises KeyError for an unknown user."""
        with self._lock:
            return self._rows[self.user_index(user)].n_live

    def user_index(self, user: Hashable) -> int:
        """Segment index of ``user`` (stable for the bank's lifetime).

        Raises:
            KeyError: unknown user, or a key that is not a str / int (the message names it).
        """
        try:
            key = _check_user(user)
            return self._uindex[key]
        except (KeyError, TypeError):
            raise KeyError(f"user: unknown user {user!r}") from None

    def segments_for(self, users: Iterable[Hashable], snapshot: BankSnapshot | None = None) -> np.ndarray:
        """int64 [b]: the segment index of each user key.

        Args:
            users: b user keys (str or int; numpy scalars accepted).
            snapshot: when given, a user added after that snapshot counts as unknown,
                so the indices are valid for exactly that snapshot (what a search uses).

        Raises:
            TypeError: a key that is not a str or int (bool and float refused), named
                with its position.
            KeyError: an unknown user (the message names it and its position).
        """
        return np.asarray(self.segment_list(users, snapshot), dtype=np.int64)

    def segment_list(self, users: Iterable[Hashable], snapshot: BankSnapshot | None = None) -> list[int]:
        """:meth:`segments_for` as a list of Python ints (same checks and errors).

        Raises:
            TypeError / KeyError: as :meth:`segments_for`.
        """
        limit = snapshot.num_users if snapshot is not None else None
        index = self._uindex
        out = []
        for pos, user in enumerate(users):
            t = type(user)
            key = user if (t is str or t is int) else _check_user(user, f"users[{pos}]")
            u = index.get(key)
            if u is None or (limit is not None and u >= limit):
                raise KeyError(f"users[{pos}]: unknown user {user!r}")
            out.append(u)
        return out

    def snapshot(self) -> BankSnapshot:
        """The current live rows as an immutable CSR snapshot (built once per write, then cached).

        Returns:
            BankSnapshot with vectors float32 [n, d], offsets int64 [U + 1],
            item_ids object [n], texts object [n], users (U keys), version.

        Cost: O(1) when cached; after a write, one build (module docstring) under the
        write lock. Never returns a half-built layout.
        """
        snap = self._snap
        if snap is not None:
            return snap
        with self._lock:
            if self._snap is None:
                self._snap = self._build_snapshot_locked()
            return self._snap

    def _build_snapshot_locked(self) -> BankSnapshot:
        rows = self._rows
        lengths = [r.n_live for r in rows]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        n = int(offsets[-1])
        vectors = np.empty((n, self._dim), dtype=np.float32)
        item_ids = np.empty(n, dtype=object)
        texts = np.empty(n, dtype=object)
        created = np.empty(n, dtype=np.float64)
        threads = np.empty(n, dtype=object)
        positions = np.empty(n, dtype=np.int64)
        for u, r in enumerate(rows):
            a, b = int(offsets[u]), int(offsets[u + 1])
            r.fill(vectors[a:b])
            if r.dirty:
                if b > a:
                    item_ids[a:b] = r.live_ids()
                    texts[a:b] = r.live_texts()
                    created[a:b] = r.live_created()
                    threads[a:b] = r.live_threads()
                    positions[a:b] = [NO_POSITION if p is None else p for p in r.live_positions()]
            else:
                item_ids[a:b] = r.ids_arr
                texts[a:b] = r.texts_arr
                created[a:b] = r.created_arr
                threads[a:b] = r.threads_arr
                positions[a:b] = r.positions_arr
        # the lexical forward index: clean users' segments are sliced from their last
        # snapshot's index (no re-tokenising), dirty users' from their cached per-item
        # encodings; clean users keep the postings built for them (rows are segment-local)
        carried = {}
        for u, r in enumerate(rows):
            if not r.dirty and r.lex_src is not None:
                got = r.lex_src[0]._postings.get(u)
                if got is not None:
                    carried[u] = got
        ptr, terms, tf, has = concat_segments([r.lex_segment() for r in rows])
        lex = LexicalIndex(offsets, ptr, terms, tf, has, self._vocab, self._analyzer, carried, item_ids)
        for u, r in enumerate(rows):
            a, b = int(offsets[u]), int(offsets[u + 1])
            r.rebase(vectors[a:b], item_ids[a:b], texts[a:b], (lex, a, b), created[a:b], threads[a:b], positions[a:b])
        scan, scan_meta = scan_copies(vectors, self._dtype)
        created.setflags(write=False)
        positions.setflags(write=False)
        has_thr, has_pos = bool(np.not_equal(threads, None).any()), bool((positions != NO_POSITION).any())
        return BankSnapshot(vectors, offsets, item_ids, self._version, tuple(self._users), texts, scan, self._dtype, lex,
                            created, scan_meta, threads if has_thr else None,
                            positions if has_pos else None)  # fmt: skip

    def texts_of(self, user: Hashable) -> list[str | None]:
        """The texts of ``user``'s live items in row order (None where none was given)."""
        with self._lock:
            return self._rows[self.user_index(user)].live_texts()

    def item_ids_of(self, user: Hashable) -> list[ItemId]:
        """The ids of ``user``'s live items in row order."""
        with self._lock:
            return self._rows[self.user_index(user)].live_ids()

    def has_items(self, user: Hashable, ids: Sequence[ItemId]) -> list[bool]:
        """For each id, whether ``user`` holds a live item with it (all False for a user
        never written). O(len(ids)) once the user's id map is built (O(n_u), cached
        until the user's rows move). Ids are compared as stored (``"1"`` is not ``1``).

        Raises:
            TypeError: ``ids`` not a sequence of str / int.
        """
        with self._lock:
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise TypeError(f"ids must be a sequence of str or int item ids, got {type(ids).__name__}")
            id_list = ids if isinstance(ids, list) else list(ids)
            u = self._uindex.get(_check_user(user))
            if u is None:
                return [False] * len(id_list)
            slots = self._rows[u].slots()
            return [i in slots for i in id_list]

    def created_at_of(self, user: Hashable, ids: Sequence[ItemId] | None = None) -> np.ndarray:
        """The creation times of some (or all) of ``user``'s live items.

        Args:
            user: an existing user key.
            ids: item ids the user holds, or None for all its live items in row order.

        Returns:
            float64 [m] seconds since the Unix epoch (UTC), NaN where unknown (an item
            loaded from a store of format < 4, or whose stored time was outside
            :data:`INSTANT_RANGE`: :meth:`load` reads it as NaN), aligned with ``ids``.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
        """
        with self._lock:
            u = self.user_index(user)
            r = self._rows[u]
            live = r.live_created()
            if ids is None:
                return np.asarray(live, dtype=np.float64)
            id_list = _check_id_list(ids)
            pos = {i: j for j, i in enumerate(r.live_ids())}
            missing = [i for i in id_list if i not in pos]
            if missing:
                raise KeyError(f"ids: user {self._users[u]!r} holds no item id {missing[0]!r}")
            return np.asarray([live[pos[i]] for i in id_list], dtype=np.float64)

    def _per_item(self, user: Hashable, ids: Sequence[ItemId] | None, live_of: str) -> list:
        """``_UserRows.<live_of>()`` of ``user`` for ``ids`` (None: all live items in row order), under the lock."""
        with self._lock:
            u = self.user_index(user)
            r = self._rows[u]
            live = getattr(r, live_of)()
            if ids is None:
                return live
            id_list = _check_id_list(ids)
            pos = {i: j for j, i in enumerate(r.live_ids())}
            missing = [i for i in id_list if i not in pos]
            if missing:
                raise KeyError(f"ids: user {self._users[u]!r} holds no item id {missing[0]!r}")
            return [live[pos[i]] for i in id_list]

    def threads_of(self, user: Hashable, ids: Sequence[ItemId] | None = None) -> list:
        """The conversation threads of some (or all) of ``user``'s live items (:meth:`add`).

        Args:
            user: an existing user key.
            ids: item ids the user holds, or None for all its live items in row order.

        Returns:
            list [m] of str / int, None for an item without a thread, aligned with ``ids``.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
        """
        return self._per_item(user, ids, "live_threads")

    def positions_of(self, user: Hashable, ids: Sequence[ItemId] | None = None) -> list:
        """The positions in their threads of some (or all) of ``user``'s live items (:meth:`add`).

        Args:
            user: an existing user key.
            ids: item ids the user holds, or None for all its live items in row order.

        Returns:
            list [m] of int >= 0, None for an item without a position, aligned with ``ids``.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
        """
        return self._per_item(user, ids, "live_positions")

    def metadata_rows(self, user_index: int, snapshot: BankSnapshot) -> list:
        """The metadata of the rows of segment ``user_index`` of ``snapshot``, in row order.

        Read under the lock from the bank's current metadata by the rows' item ids, so a
        row whose item was deleted (or had its metadata cleared) since the snapshot gets
        None. The dicts are the bank's own (shared, not copies): the caller must not
        modify them (:mod:`rfmem_fast.filters` only reads them).

        Args:
            user_index: a segment index of ``snapshot``.
            snapshot: a snapshot of this bank.

        Returns:
            list [n_u] of dict / None.

        Raises:
            IndexError: ``user_index`` outside the snapshot's segments.
        """
        if not 0 <= int(user_index) < snapshot.num_users:
            raise IndexError(f"user_index {user_index} is not a segment of the snapshot (0..{snapshot.num_users - 1})")
        a, b = int(snapshot.offsets[user_index]), int(snapshot.offsets[user_index + 1])
        with self._lock:
            store = self._meta.get(snapshot.users[user_index])
            if not store:
                return [None] * (b - a)
            get = store.get
            return [get(i) for i in snapshot.item_ids[a:b]]

    def metadata_cached(self, snapshot: BankSnapshot, key: Any, build: Any) -> Any:
        """A cache for values derived from ``snapshot`` and the bank's metadata (filter columns).

        An entry lives until the next write or :meth:`set_metadata`; values are cached
        only for the bank's current snapshot (an older snapshot's are built afresh).

        Args:
            snapshot: the snapshot the value belongs to.
            key: hashable key.
            build: zero-argument callable producing the value on a miss.

        Returns:
            the (possibly cached) value.
        """
        cache = self._meta_cache
        hit = cache.get(key)
        if hit is not None and hit[0] is snapshot:
            return hit[1]
        value = build()
        if self._snap is snapshot:
            cache[key] = (snapshot, value)
        return value

    def get_metadata(self, user: Hashable, ids: Sequence[ItemId] | None = None) -> list[dict | None]:
        """The metadata of some (or all) of ``user``'s live items, as deep copies.

        Args:
            user: an existing user key.
            ids: item ids the user holds, or None for all its live items in row order.

        Returns:
            list of dict (None for an item stored without metadata), aligned with ``ids``.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
        """
        with self._lock:
            u = self.user_index(user)
            if ids is None:
                id_list = self._rows[u].live_ids()
            else:
                id_list = _check_id_list(ids)
                slots = self._rows[u].slots()
                missing = [i for i in id_list if i not in slots]
                if missing:
                    raise KeyError(f"ids: user {self._users[u]!r} holds no item id {missing[0]!r}")
            store = self._meta.get(self._users[u], {})
            return [copy.deepcopy(store.get(i)) for i in id_list]

    def _snapshot_and_metadata(self) -> tuple[BankSnapshot, list | None]:
        """The snapshot and its rows' metadata (list [n] of dict / None, or None when no
        item has any), taken together under the lock (what :meth:`save` writes with :func:`rfmem_fast.store.write_store`)."""
        with self._lock:
            snap = self.snapshot()
            if not any(self._meta.values()):
                return snap, None
            meta: list = [None] * snap.num_items
            for user, store in self._meta.items():
                u = self._uindex[user]
                a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
                for row in range(a, b):
                    m = store.get(snap.item_ids[row])
                    if m is not None:
                        meta[row] = m
            return snap, meta

    def cached(self, key: Any, build: Any) -> Any:
        """Per-snapshot cache for backends (device copies of the snapshot and the like).

        Args:
            key: hashable cache key.
            build: zero-argument callable producing the value on a miss.

        Returns:
            the cached value; rebuilt whenever the bank's snapshot changes (after any
            write). An entry is tagged with the snapshot it was made from (the value's
            ``snapshot`` attribute when it has one), so a reader racing a writer can
            never be handed a view of an older snapshot than the current one.
        """
        snap = self.snapshot()
        cache = self._cache
        hit = cache.get(key)
        if hit is not None and hit[0] is snap:
            return hit[1]
        value = build()
        made_from = getattr(value, "snapshot", None)
        cache[key] = (made_from if isinstance(made_from, BankSnapshot) else snap, value)
        return value
