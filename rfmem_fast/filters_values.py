"""The filter language's vocabulary (:mod:`rfmem_fast.filters` has the grammar): the reserved
fields (``created_at``, ``thread``, ``position``) and the operators, JSON values as a filter
carries them and the keys two equal values share (numbers by exact value), and instants
(:func:`parse_instant`: numbers of seconds, aware datetimes, ISO-8601 strings with an offset).
"""
from __future__ import annotations

import json
import math
import operator
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np

from .bank import INSTANT_END

#: the reserved field: the item's creation time (:attr:`rfmem_fast.bank.BankSnapshot.created_at`)
CREATED_AT = "created_at"
#: the reserved field: the item's conversation thread (:attr:`rfmem_fast.bank.BankSnapshot.threads`)
THREAD = "thread"
#: the reserved field: the item's position in its thread (:attr:`rfmem_fast.bank.BankSnapshot.positions`)
POSITION = "position"
#: every reserved field (a metadata key of one of these names is shadowed)
RESERVED_FIELDS = (CREATED_AT, THREAD, POSITION)
#: comparison operators of a condition
COMPARISONS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$exists")
#: logical operators of a filter
LOGICAL = ("$and", "$or", "$not")

_RANGES: dict[str, Callable[[Any, Any], Any]] = {
    "$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le,
}  # fmt: skip
#: ints of at most this magnitude are exact in float64 (a column keeps them in ``num``)
_FLOAT_EXACT = 2**53
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _where(path: str, key: Any) -> str:
    return f"{path}[{key!r}]"


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return type(v).__name__


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _check_json(v: Any, where: str) -> Any:
    """A JSON value as a filter carries it (numpy scalars converted); TypeError / ValueError otherwise."""
    if isinstance(v, (np.integer,)) and not isinstance(v, np.bool_):
        return int(v)
    if isinstance(v, np.floating):
        v = float(v)
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{where}: numbers must be finite, got {v!r}")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, datetime):
        raise TypeError(f"{where}: a datetime compares only with a range operator or with {CREATED_AT!r}; got {v!r}")
    if isinstance(v, (list, tuple, dict)):
        try:
            return json.loads(json.dumps(v, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{where}: expected a JSON value, got {_type_name(v)} ({exc})") from None
    raise TypeError(f"{where}: expected a JSON value (str, number, bool, null, list, object), got {_type_name(v)}")


def _number(v: Any) -> Any:
    """A JSON number keyed by its exact value: an integral float as its int (``2.0`` -> ``2``,
    ``float(2**60)`` -> ``2**60``), every other number unchanged (two numbers get equal keys
    exactly when Python's ``==`` says they are equal, also through ``json.dumps``)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _normal(v: Any) -> Any:
    """``v`` with every number inside lists / objects compared by value (bools kept apart)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return [type(v).__name__, v]
    if isinstance(v, (int, float)):
        return ["n", _number(v)]
    if isinstance(v, list):
        return ["l", [_normal(x) for x in v]]
    return ["o", {k: _normal(x) for k, x in v.items()}]


def _value_key(v: Any) -> tuple:
    """The hashable key two equal JSON values share: numbers by value (``1 == 1.0``, inside
    lists and objects too), bools apart from numbers, objects whatever their key order."""
    if v is None:
        return ("z",)
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, (int, float)):
        return ("n", _number(v))
    if isinstance(v, str):
        return ("s", v)
    return ("j", json.dumps(_normal(v), sort_keys=True, separators=(",", ":"), ensure_ascii=False))


def parse_instant(v: Any, where: str) -> float:
    """An instant as seconds since the Unix epoch (float).

    Args:
        v: a number (seconds since the epoch), a timezone-aware ``datetime``, or an
            ISO-8601 string with a UTC offset (``"2026-11-01T00:00:00Z"``).
        where: the name of the value in error messages.

    Returns:
        float seconds. The range is not checked here (a filter bound may lie anywhere);
        a write checks it with :func:`rfmem_fast.bank.check_instant`. The last
        microseconds of year 9999, which float rounding would carry to 10000, come back
        as the largest float before it, so every datetime of that year stays in range.

    Raises:
        TypeError: another type. ValueError: a naive datetime, a string that is not an
            ISO-8601 date-time or has no offset, a non-finite number, an int beyond the
            float64 range.
    """
    if _is_number(v):
        try:
            f = float(v)
        except OverflowError:  # an int beyond the float64 range
            bits = int(v).bit_length()
            raise ValueError(f"{where}: expected a finite number of seconds, got an int of {bits} bits") from None
        if not math.isfinite(f):
            raise ValueError(f"{where}: expected a finite number of seconds, got {f!r}")
        return f
    if isinstance(v, datetime):
        if v.tzinfo is None or v.tzinfo.utcoffset(v) is None:
            raise ValueError(
                f"{where}: naive datetime {v.isoformat()!r} names no instant: give a timezone-aware datetime "
                "(e.g. datetime(..., tzinfo=timezone.utc))"
            )
        return _timestamp(v)
    if isinstance(v, str):
        try:
            dt = datetime.fromisoformat(v)
        except ValueError as exc:
            raise ValueError(f"{where}: {v!r} is not an ISO-8601 date-time ({exc})") from None
        if dt.tzinfo is None:
            raise ValueError(f"{where}: {v!r} has no UTC offset: write e.g. '{v}T00:00:00Z' or '...+00:00'"
                             if "T" not in v else f"{where}: {v!r} has no UTC offset: append 'Z' or '+HH:MM'")
        return _timestamp(dt)
    raise TypeError(
        f"{where}: expected a number of seconds since the Unix epoch, a datetime or an ISO-8601 string, "
        f"got {_type_name(v)}"
    )


#: the last instant a datetime can hold, in UTC
_LAST_UTC = datetime.max.replace(tzinfo=timezone.utc)
#: the largest float before INSTANT_END (what 9999-12-31T23:59:59.99997Z and later round to)
_LAST_SECOND = float(np.nextafter(INSTANT_END, 0.0))


def _timestamp(dt: datetime) -> float:
    """An aware datetime as float seconds since the epoch, kept below ``INSTANT_END``
    when the datetime is (float rounding carries the last microseconds of 9999 to it)."""
    t = dt.timestamp()
    return _LAST_SECOND if t == INSTANT_END and dt <= _LAST_UTC else t


def _string_instant(s: str) -> float:
    """A stored ISO-8601 string as an instant (no offset: UTC); NaN when it is not one."""
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        return math.nan
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()
