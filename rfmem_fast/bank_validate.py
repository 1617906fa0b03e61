"""The argument checks of a :class:`~rfmem_fast.bank.MemoryBank` write, one per kind of
per-item argument: user keys (:func:`_check_user`), item ids (:func:`_check_id_list`,
:func:`_check_ids`), texts (:func:`_check_texts`, :func:`_check_unicode`), metadata
(:func:`_check_metadata`), creation times (:func:`check_instant`,
:func:`check_created_at`, :data:`INSTANT_RANGE`), conversation threads and positions
(:func:`check_threads`, :func:`check_positions`, :func:`_check_thread_pairs`). Each
returns the values as the bank stores them, or raises TypeError / ValueError naming the
argument (``texts[3]``, ``created_at[0]``) and what was expected. The facade
(:mod:`rfmem_fast.serving.validate`) and the shards (:mod:`rfmem_fast.distributed.shard`)
call these too, so every door refuses the same values with the same words.
"""
from __future__ import annotations

import json
import math
import time
from datetime import date, datetime, time as clock_time, timezone
from typing import Any, Callable, Hashable

import numpy as np

ItemId = Hashable

#: the largest position an item may hold (positions are int64 >= 0)
MAX_POSITION = 2**63 - 1


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
