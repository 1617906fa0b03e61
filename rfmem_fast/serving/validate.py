"""The argument checks of a :class:`~rfmem_fast.serving.memory.Memory`, shared with the
HTTP app and the MCP server: ids (the id model below), texts, metadata, ``k``, the
per-item lists of a write, :func:`_instant`, the ONE parser of an item's creation
time (every write door: ``add``, ``add_many``, the HTTP bodies, ``rfmem import`` lines),
and the conversation fields of an item, its ``thread`` (:func:`_check_thread1`) and
``position`` (:func:`_check_position1`), with the rule that a position needs a thread
(:func:`_check_pairs`).

Each check reads no Memory state and raises TypeError / ValueError naming the argument
(``texts[3]``, ``items[2].created_at``) and what was expected.
"""
from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ..bank import MAX_POSITION, _check_id_list, _check_metadata, _check_unicode, check_instant
from ..config import RFMemConfig
from ..filters import parse_instant
from ..lexical import CHUNK_SEP


#: the most hits one query may ask for (``k``), in Python and over HTTP
MAX_K = 1000
#: the longest user id / item id (characters)
MAX_ID_LENGTH = 256
#: the longest text of a memory or a query (characters); a memory must also fit the
#: encoder's window (``TextEncoder.max_tokens``: 256 tokens for all-MiniLM-L6-v2)
MAX_TEXT_CHARS = 100_000
#: the range of an int conversation thread id (a signed 64-bit integer: every JSON
#: client and the bank store carry it exactly)
THREAD_INT_RANGE = (-(2**63), 2**63 - 1)


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


def _check_meta1(value: Any, label: str) -> dict | None:
    """One item's metadata (a JSON object, or None), checked as the bank stores it."""
    try:
        return _check_metadata([value], 1)[0]
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("metadata[0]", label, 1)) from None


def _check_k(k: Any) -> None:
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an int in [1, {MAX_K}] or None, got {k!r}")


# ---------------------------------------------------------------------- conversations
# An item's conversation: its ``thread`` (a str of 1-MAX_ID_LENGTH characters of valid
# Unicode, or an int in THREAD_INT_RANGE; ``"1"`` and ``1`` are different threads, as in
# the bank, and both survive JSON as given) and its ``position`` in that thread (an int in
# [0, 2**63 - 1]); an item with a position needs a thread. Both optional (None: none).
# They are what the context score reads (RFMemConfig.context_weight / thread_weight,
# rfmem_fast.context) and the reserved filter fields ``thread`` / ``position``.
def _check_thread1(v: Any, where: str) -> str | int:
    """One conversation thread id as stored: a str or an int (numpy scalars converted).

    Raises:
        TypeError: not a str / int (a bool included), ``where`` named. ValueError: an
            empty or over-long str, one with a lone surrogate, an int outside
            :data:`THREAD_INT_RANGE`.
    """
    if isinstance(v, np.integer) and not isinstance(v, np.bool_):
        v = int(v)
    elif isinstance(v, np.str_):
        v = str(v)
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise TypeError(f"{where} must be a str or an int (a conversation thread id), got {type(v).__name__}")
    if isinstance(v, int):
        lo, hi = THREAD_INT_RANGE
        if not lo <= v <= hi:
            raise ValueError(f"{where} must be an int in [-2**63, 2**63 - 1] (or a str), got {v}")
        return int(v)
    if not v:
        raise ValueError(f"{where} must be a non-empty str (or an int)")
    if len(v) > MAX_ID_LENGTH:
        raise ValueError(f"{where} is {len(v)} characters long; a thread id holds at most {MAX_ID_LENGTH}")
    return _check_unicode(str(v), where)


def _check_position1(v: Any, where: str) -> int:
    """One position in a conversation thread as stored: an int in [0, 2**63 - 1].

    Raises:
        TypeError: not an int (a bool or a float included), ``where`` named.
            ValueError: a negative or too large int.
    """
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{where} must be an int >= 0 (the item's place in its thread), got {type(v).__name__}")
    v = int(v)
    if not 0 <= v <= MAX_POSITION:
        raise ValueError(f"{where} must be an int in [0, 2**63 - 1], got {v}")
    return v


def _per_item(value: Any, m: int, name: str, check: Any, single: str, scalar: tuple) -> list | None:
    """``value`` as m checked entries (None: not given): one value for every item, or a
    sequence of m values / None."""
    if value is None:
        return None
    if isinstance(value, scalar) and not isinstance(value, (bool, np.bool_)):
        v = check(value, name)
        return [v] * m
    if isinstance(value, (str, bytes, dict, bool, np.bool_)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be None, {single}, or a sequence of them (None for an item without one), "
                        f"one per item, got {type(value).__name__}")
    out = list(value)
    if len(out) != m:
        raise _count_error(name, len(out), m, single=single)
    return [None if v is None else check(v, f"{name}[{j}]") for j, v in enumerate(out)]


def _thread_list(thread: Any, m: int, name: str = "thread") -> list | None:
    """``Memory.add``'s ``thread`` as m entries (str / int / None), or None when not given:
    one thread id for every item, or m of them / None (:func:`_check_thread1`).

    Raises:
        TypeError / ValueError: naming ``thread`` or ``thread[i]``; a list of another
            length than m.
    """
    return _per_item(thread, m, name, _check_thread1, "one thread id (a str or an int)",
                     (str, int, np.integer, np.str_))


def _position_list(position: Any, m: int, name: str = "position") -> list | None:
    """``Memory.add``'s ``position`` as m entries (int >= 0 / None), or None when not given:
    one position for every item, or m of them / None (:func:`_check_position1`).

    Raises:
        TypeError / ValueError: naming ``position`` or ``position[i]``; a list of
            another length than m.
    """
    return _per_item(position, m, name, _check_position1, "one int >= 0", (int, np.integer))


def _entry_label(name: str, value: Any) -> Any:
    """``label(j)``: how a message names item ``j``'s entry of an argument ``name`` given as
    ``value``: ``name[j]`` for a sequence, ``name`` for one value shared by every item."""
    if isinstance(value, (str, int, np.integer, np.str_)) or value is None:
        return lambda j: name
    return lambda j: f"{name}[{j}]"


def _check_pairs(threads: list | None, positions: list | None, labels: Any) -> None:
    """No item may hold a position without a thread (a position orders an item within its thread).

    Args:
        threads, positions: the items' threads / positions as they will be stored (m
            entries each, or None: no item has one).
        labels: ``labels(j) -> (position label, thread label)`` naming item ``j``'s two
            fields in a message (``("position[2]", "thread[2]")``, ``("items[4].position",
            "items[4].thread")``).

    Raises:
        ValueError: naming the first such item's position and thread.
    """
    if positions is None:
        return
    for j, p in enumerate(positions):
        if p is not None and (threads is None or threads[j] is None):
            plab, tlab = labels(j)
            raise ValueError(f"{plab} is {p} but the item has no thread: a position orders an item within its "
                             f"conversation thread, so give {tlab} too")
