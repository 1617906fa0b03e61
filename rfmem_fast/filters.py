"""Filtered search: a small filter language over item metadata and ``created_at``, compiled to row selections.

A filter is a JSON-able dict (Mongo / Chroma / mem0 style)::

    {"tag": "work"}                                   # equality
    {"tag": {"$in": ["a", "b"]}}                      # one of
    {"score": {"$gte": 3, "$lt": 7}}                  # a numeric range (operators AND-ed)
    {"created_at": {"$gte": "2026-11-01T00:00:00Z"}}  # the item's creation time
    {"$and": [f1, f2]}, {"$or": [f1, f2]}, {"$not": f}
    {"project.name": "rfmem"}                         # a dotted path into nested metadata

The grammar. A filter is a dict; its entries are AND-ed (``{}`` matches every item).
An entry is either a logical operator (``"$and"`` / ``"$or"``: a non-empty list of
filters; ``"$not"``: one filter) or ``field: condition``. A field is a metadata key,
or a dotted path (``"a.b"`` reads ``metadata["a"]["b"]``; keys containing ``"."``
cannot be filtered), or one of the reserved fields ``created_at`` (the item's creation
time), ``thread`` (its conversation thread, a str or an int) and ``position`` (its
position in that thread, an int >= 0), all set by :meth:`rfmem_fast.bank.MemoryBank.add`
(a metadata key of a reserved name is shadowed; an item without a thread or position
has no such field). A condition is a value (equality) or a dict of operators, AND-ed:

* ``$eq`` / ``$ne``: equal / not equal to a JSON value (numbers compare by value, so
  ``1 == 1.0``; ``true`` is not ``1``; lists and objects compare as whole values);
* ``$in`` / ``$nin``: equal to one of / none of a list of values;
* ``$gt`` / ``$gte`` / ``$lt`` / ``$lte``: a range. The bound is a number (compared with
  the field's numeric values exactly by value, as Python compares ints and floats: no
  rounding of either, at any magnitude), a string (compared with its string values, by code
  point: ISO-8601 dates of one format order correctly) or a timezone-aware
  ``datetime`` (compared with its ISO-8601 string values read as instants, a string
  without an offset read as UTC);
* ``$exists``: ``true`` (the item has the field) or ``false`` (it has not).

For ``created_at`` every value and bound is an instant: a number of seconds since the
Unix epoch, a timezone-aware ``datetime``, or an ISO-8601 string with a UTC offset
(``"2026-11-01T00:00:00Z"``, ``"...+02:00"``). Naive datetimes and offset-less strings
are refused (they name no instant), and so is a number outside the instants a creation
time can hold (years 1..9999 UTC: a bound in milliseconds is a ``ValueError`` that says
to divide by 1000, as a write's is).

Semantics. **An item without the field matches no comparison** (``$eq``, ``$ne``,
``$in``, ``$nin`` and the ranges alike; wrap the filter in ``$not`` to include such
items, or test ``$exists``); a value of another type than a range's bound does not
match it either (a string never matches ``{"$gt": 3}``). An item whose creation time is
unknown (loaded from a store of format < 4, :mod:`rfmem_fast.store`) has no
``created_at``. Metadata are those of the bank when the filter is compiled.

Errors (raised before any search work, naming the part of the filter as a Python
subscript path): ``ValueError`` for an unknown operator, an empty ``$and`` / ``$or``,
a non-finite number, a malformed or offset-less date; ``TypeError`` for a value of the
wrong type (``filters['score']['$gte']: expected a number, a string or a datetime, got
list``), and for a range whose bound's type the field never holds among the items of
the queried user (a number against a field whose values are all strings, and the
like).

Exact numbers. Python compares an int with a float by their exact values
(``2**53 + 1 > 9007199254740992.0``); so do the ranges, without evaluating a Python
comparison per row in the common case. A numeric column (``_Column``) splits its
values three ways: floats and ints of magnitude <= 2**53 (all exact in float64) in a
float64 array ``num``; ints of magnitude > 2**53 within int64 in an int64 array
``wide`` (nanosecond timestamps, 64-bit ids; only when there are such ints); larger
ints in a list ``huge`` (compared in Python). A bound is translated once per comparison into an equivalent bound for
each part: for ``num`` a float64 (an int bound that float64 cannot hold lies strictly
between two adjacent floats ``lo < b < hi``, so ``x > b`` is ``x >= hi`` and ``x < b``
is ``x <= lo``; beyond the float range ``hi`` / ``lo`` are the infinities / the
largest finite float), for ``wide`` an int (a non-integral float bound ``b``: ``x > b``
is ``x > floor(b)``, ``x < b`` is ``x < ceil(b)``; an int beyond int64 makes the
comparison all true or all false). A column without big ints costs what it did: one
float64 comparison. Equality (``$eq``, ``$in``, ...) is exact too: values are keyed by
Python's own ``==`` (an integral float keyed as its int inside lists and objects).
``created_at`` is float64 seconds; its bounds are read as float64.

Compilation (:func:`compile_filters`): each distinct filter is parsed once per batch;
for each (filter, user) pair of the batch it is evaluated with numpy over typed
columns of the user's rows (built once per snapshot and metadata state, cached on the
bank: :meth:`rfmem_fast.bank.MemoryBank.metadata_cached`) into the sorted list of the
rows it keeps. The result, a :class:`RowSelection`, is what the backends apply while
they take the top-k (:mod:`rfmem_fast.backends`).
"""
from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np

from .bank import INSTANT_END, NO_POSITION, BankSnapshot, MemoryBank, check_instant

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
#: a selection holding at most this fraction of its segment's rows is scanned as a row
#: list by the native kernel; a larger one is given as a per-row mask too, which the
#: kernel checks inside the GEMM scan when its queries take the GEMM path (many queries
#: of one long segment) and trades for the list otherwise (csrc/cpu/topk.cpp, kernels.h
#: SelTable)
LIST_MAX_FRACTION = 0.25

_RANGES: dict[str, Callable[[Any, Any], Any]] = {
    "$gt": operator.gt, "$gte": operator.ge, "$lt": operator.lt, "$lte": operator.le,
}  # fmt: skip
#: ints of at most this magnitude are exact in float64 (a column keeps them in ``num``)
_FLOAT_EXACT = 2**53
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class FilterTypeError(TypeError):
    """A well-formed filter whose range bound has a type the queried user's values of the
    field never have (a number against a field holding only strings, ...): raised when
    the filter is evaluated, naming the part of the filter (the HTTP service answers 422)."""


# --------------------------------------------------------------------------- values
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


# --------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class _Cmp:
    """One comparison: the field (path), the operator, the checked value, where it was written."""

    field: str
    path: tuple
    op: str
    value: Any
    where: str


@dataclass(frozen=True)
class _Bool:
    """``kind`` "and" / "or" over children, or "not" of one."""

    kind: str
    children: tuple


def _parse_path(name: Any, where: str) -> tuple:
    if not isinstance(name, str):
        raise TypeError(f"{where}: field names must be str, got {_type_name(name)}")
    if name.startswith("$"):
        raise ValueError(f"{where}: unknown operator {name!r} (filter operators: {', '.join(LOGICAL)})")
    if not name:
        raise ValueError(f"{where}: field names must not be empty")
    parts = tuple(name.split("."))
    if any(p == "" for p in parts):
        raise ValueError(f"{where}: {name!r} is not a field path (empty part between dots)")
    return parts


def _created_value(v: Any, where: str) -> float:
    """A ``created_at`` value or bound as epoch seconds; a number outside the instants a
    creation time can hold is refused like a write's (:func:`rfmem_fast.bank.check_instant`:
    a bound in milliseconds would otherwise match nothing, or everything, silently)."""
    t = parse_instant(v, where)
    return check_instant(t, where) if _is_number(v) else t


def _parse_value(field_name: str, op: str, v: Any, where: str) -> Any:
    """The checked value of one comparison (instants as floats for ``created_at``)."""
    created = field_name == CREATED_AT
    if op == "$exists":
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{where}: expected true or false, got {_type_name(v)}")
        return bool(v)
    if op in ("$in", "$nin"):
        if not isinstance(v, (list, tuple)):
            raise TypeError(f"{where}: expected a list of values, got {_type_name(v)}")
        return tuple(_parse_value(field_name, "$eq", x, f"{where}[{j}]") for j, x in enumerate(v))
    if op in _RANGES:
        if created:
            return _created_value(v, where)
        if isinstance(v, datetime):
            return ("dt", parse_instant(v, where))
        if _is_number(v):  # kept exact: an int stays an int (ranges compare by exact value)
            n = float(v) if isinstance(v, (float, np.floating)) else int(v)
            if isinstance(n, float) and not math.isfinite(n):
                raise ValueError(f"{where}: numbers must be finite, got {n!r}")
            return ("num", n)
        if isinstance(v, str):
            return ("str", v)
        raise TypeError(f"{where}: expected a number, a string or a datetime, got {_type_name(v)}")
    # $eq / $ne
    if created:
        return _created_value(v, where)
    return _check_json(v, where)


def _parse(f: Any, where: str) -> Any:
    if not isinstance(f, dict):
        raise TypeError(f"{where}: a filter must be a dict, got {_type_name(f)}")
    nodes: list = []
    for key, cond in f.items():
        w = _where(where, key)
        if key in ("$and", "$or"):
            if not isinstance(cond, (list, tuple)):
                raise TypeError(f"{w}: expected a list of filters, got {_type_name(cond)}")
            if not cond:
                raise ValueError(f"{w}: expected a non-empty list of filters")
            nodes.append(_Bool(key[1:], tuple(_parse(c, f"{w}[{j}]") for j, c in enumerate(cond))))
            continue
        if key == "$not":
            nodes.append(_Bool("not", (_parse(cond, w),)))
            continue
        path = _parse_path(key, w)
        if isinstance(cond, dict) and cond and all(isinstance(k, str) and k.startswith("$") for k in cond):
            for op, v in cond.items():
                wo = _where(w, op)
                if op not in COMPARISONS:
                    raise ValueError(f"{wo}: unknown operator {op!r} (comparisons: {', '.join(COMPARISONS)})")
                nodes.append(_Cmp(key, path, op, _parse_value(key, op, v, wo), wo))
        elif isinstance(cond, dict) and any(isinstance(k, str) and k.startswith("$") for k in cond):
            raise ValueError(f"{w}: mixes operators and plain keys; write {{'$eq': {{...}}}} to compare with an object")
        else:
            nodes.append(_Cmp(key, path, "$eq", _parse_value(key, "$eq", cond, w), w))
    if not nodes:  # {}: every item
        return None
    if len(nodes) == 1:
        return nodes[0]
    return _Bool("and", tuple(nodes))


def _canonical(f: Any) -> str:
    """A string two identical filters share (the cache key of a parsed filter)."""
    def default(o: Any) -> Any:
        if isinstance(o, datetime):
            return {"$datetime": o.isoformat()}
        if isinstance(o, (np.integer, np.floating, np.bool_)):
            return o.item()
        raise TypeError(f"not JSON: {type(o).__name__}")

    try:
        return json.dumps(f, sort_keys=True, default=default, allow_nan=True)
    except (TypeError, ValueError):
        return repr(f)


@dataclass(frozen=True)
class Filter:
    """A parsed filter: what :func:`parse_filter` returns (immutable, reusable across batches).

    Attributes:
        source: the filter dict as given.
        key: a canonical string of it (two equal filters share it).
    """

    source: Any
    key: str
    _root: Any = field(repr=False, compare=False, default=None)

    def mask(self, bank: MemoryBank, snapshot: BankSnapshot, user_index: int) -> np.ndarray:
        """bool [n_u]: which rows of segment ``user_index`` of ``snapshot`` the filter keeps.

        Raises:
            TypeError: a range whose bound's type the field never holds among this
                user's items (module docstring).
        """
        a, b = int(snapshot.offsets[user_index]), int(snapshot.offsets[user_index + 1])
        cols = _Columns(bank, snapshot, int(user_index), a, b)
        return _evaluate(self._root, cols)


def parse_filter(f: Any, where: str = "filters") -> Filter:
    """Check and parse one filter dict (the grammar of the module docstring).

    Args:
        f: the filter (a dict).
        where: how the filter is named in error messages (e.g. ``"filters[3]"``).

    Returns:
        Filter.

    Raises:
        TypeError / ValueError: a malformed filter; the message names the part as a
            subscript path (``filters['score']['$gte']: ...``).
    """
    if isinstance(f, Filter):
        return f
    key = _canonical(f)
    got = _PARSED.get((key, where))
    if got is not None:
        return got
    out = Filter(source=f, key=key, _root=_parse(f, where))
    if len(_PARSED) >= _PARSED_MAX:
        _PARSED.clear()
    _PARSED[(key, where)] = out
    return out


#: parsed filters by (canonical key, name in messages): a repeated filter is parsed once
_PARSED: dict = {}
_PARSED_MAX = 4096


# --------------------------------------------------------------------------- columns
class _Column:
    """One metadata field (path) over a user's rows: value codes and numbers.

    The numbers are split for exact ranges (module docstring): ``num`` float64 [n] holds
    the floats and the ints of magnitude <= 2**53 (NaN elsewhere); ``is_wide`` bool [n] /
    ``wide`` int64 [n] mark and hold the ints beyond 2**53 within int64 (both None when
    there are none); ``huge_rows`` int64 [h] / ``huge`` (list of int) the rows and values
    of the ints beyond int64.
    """

    __slots__ = (
        "codes", "values", "keys", "num", "is_wide", "wide", "huge_rows", "huge", "has_num", "has_str", "_inst",
    )  # fmt: skip

    def __init__(self, rows: list, path: tuple) -> None:
        n = len(rows)
        codes = np.full(n, -1, dtype=np.int64)
        keys: dict = {}
        values: list = []
        num_rows: list[int] = []
        num_vals: list = []  # exact in float64
        big: list[tuple[int, int]] = []  # (row, int) of magnitude > 2**53
        lim = _FLOAT_EXACT
        has_num = has_str = False
        single = path[0] if len(path) == 1 else None
        for j, m in enumerate(rows):
            if m is None:
                continue
            if single is not None:
                if single not in m:
                    continue
                v = m[single]
            else:
                v = m
                ok = True
                for p in path:
                    if isinstance(v, dict) and p in v:
                        v = v[p]
                    else:
                        ok = False
                        break
                if not ok:
                    continue
            k = _value_key(v)
            c = keys.get(k)
            if c is None:
                c = keys[k] = len(values)
                values.append(v)
            codes[j] = c
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if isinstance(v, float) or -lim <= v <= lim:
                    num_rows.append(j)
                    num_vals.append(v)
                else:
                    big.append((j, v))
                has_num = True
            elif isinstance(v, str):
                has_str = True
        num = np.full(n, np.nan)
        if num_rows:
            num[np.asarray(num_rows, dtype=np.int64)] = np.asarray(num_vals, dtype=np.float64)
        self.codes, self.values, self.keys, self.num = codes, values, keys, num
        wide = [(j, v) for j, v in big if _INT64_MIN <= v <= _INT64_MAX]
        huge = [(j, v) for j, v in big if not _INT64_MIN <= v <= _INT64_MAX]
        self.is_wide = self.wide = None
        if wide:
            rows_w = np.asarray([j for j, _ in wide], dtype=np.int64)
            self.is_wide = np.zeros(n, dtype=np.bool_)
            self.is_wide[rows_w] = True
            self.wide = np.zeros(n, dtype=np.int64)
            self.wide[rows_w] = np.asarray([v for _, v in wide], dtype=np.int64)
        self.huge_rows = np.asarray([j for j, _ in huge], dtype=np.int64)
        self.huge = [v for _, v in huge]
        self.has_num, self.has_str = has_num, has_str
        self._inst: np.ndarray | None = None

    def table(self, pred: Callable[[Any], bool]) -> np.ndarray:
        """bool [n_u]: ``pred`` of each row's value (evaluated once per distinct value)."""
        t = np.fromiter((bool(pred(v)) for v in self.values), np.bool_, len(self.values))
        return np.concatenate([t, [False]])[self.codes]  # code -1: the appended False

    def instants(self) -> np.ndarray:
        """float64 [n_u]: ISO-8601 string values as instants (NaN elsewhere)."""
        if self._inst is None:
            t = np.array([_string_instant(v) if isinstance(v, str) else math.nan for v in self.values] + [math.nan])
            self._inst = t[self.codes]
        return self._inst


class _Columns:
    """Lazily built, cached columns of one user's rows of one snapshot."""

    def __init__(self, bank: MemoryBank, snap: BankSnapshot, u: int, a: int, b: int) -> None:
        self.bank, self.snap, self.u, self.a, self.b = bank, snap, u, a, b
        self.n = b - a

    def created(self) -> np.ndarray:
        return self.snap.created_at_or_nan[self.a : self.b]

    def reserved(self, name: str) -> _Column:
        """The column of the reserved field ``thread`` or ``position`` (an item without one has no field)."""
        snap, a, b = self.snap, self.a, self.b

        def build() -> _Column:
            if name == THREAD:
                vals = snap.threads[a:b].tolist() if snap.threads is not None else [None] * (b - a)
                return _Column([None if v is None else {name: v} for v in vals], (name,))
            vals = snap.positions[a:b].tolist() if snap.positions is not None else [NO_POSITION] * (b - a)
            return _Column([None if v == NO_POSITION else {name: v} for v in vals], (name,))

        return self.bank.metadata_cached(snap, ("filter_reserved", self.u, name), build)

    def column(self, path: tuple) -> _Column:
        bank, snap, u = self.bank, self.snap, self.u

        def build() -> _Column:
            rows = bank.metadata_cached(snap, ("filter_rows_meta", u), lambda: bank.metadata_rows(u, snap))
            return _Column(rows, path)

        return bank.metadata_cached(snap, ("filter_column", u, path), build)


def _evaluate(node: Any, cols: _Columns) -> np.ndarray:
    if node is None:
        return np.ones(cols.n, dtype=np.bool_)
    if isinstance(node, _Bool):
        if node.kind == "not":
            return ~_evaluate(node.children[0], cols)
        out = _evaluate(node.children[0], cols)
        for c in node.children[1:]:
            m = _evaluate(c, cols)
            out = (out & m) if node.kind == "and" else (out | m)
        return out
    if node.field == CREATED_AT:
        return _eval_created(node, cols.created())
    if node.field == THREAD or node.field == POSITION:
        return _eval_meta(node, cols.reserved(node.field))
    return _eval_meta(node, cols.column(node.path))


def _eval_created(node: _Cmp, t: np.ndarray) -> np.ndarray:
    op, v = node.op, node.value
    known = ~np.isnan(t)
    if op == "$exists":
        return known if v else ~known
    if op == "$eq":
        return t == v
    if op == "$ne":
        return known & (t != v)
    if op == "$in":
        return np.isin(t, np.asarray(v, dtype=np.float64))
    if op == "$nin":
        return known & ~np.isin(t, np.asarray(v, dtype=np.float64))
    return _RANGES[op](t, v)  # NaN compares False


def _float_bound(op: str, b: int | float) -> tuple[str, float]:
    """``(op2, f)``: a float64 bound with ``op2(x, f) == op(x, b)`` for EVERY float ``x``
    (infinities included), ``b`` an int of any size or a finite float."""
    if isinstance(b, float):
        return op, b
    try:
        f = float(b)  # the nearest float
    except OverflowError:  # beyond the largest finite float
        f = math.inf if b > 0 else -math.inf
    if f == b:  # Python's int == float is exact
        return op, f
    # b lies strictly between two adjacent floats lo < b < hi; no float equals b
    if op in ("$gt", "$gte"):
        return "$gte", f if f > b else math.nextafter(f, math.inf)
    return "$lte", f if f < b else math.nextafter(f, -math.inf)


def _int_bound(op: str, b: int | float) -> tuple[str, int]:
    """``(op2, n)``: an int bound with ``op2(x, n) == op(x, b)`` for EVERY int ``x``, ``b``
    an int or a finite float."""
    if isinstance(b, int):
        return op, b
    if b.is_integer():
        return op, int(b)
    if op in ("$gt", "$gte"):  # x > b <=> x >= b <=> x > floor(b)
        return "$gt", math.floor(b)
    return "$lt", math.ceil(b)  # x < b <=> x <= b <=> x < ceil(b)


def _number_range(col: _Column, op: str, b: int | float) -> np.ndarray:
    """bool [n_u]: the rows whose number ``x`` has ``op(x, b)``, exactly (module docstring)."""
    fop, f = _float_bound(op, b)
    out = _RANGES[fop](col.num, f)  # NaN (no number, or a big int) compares False
    if col.wide is not None:
        iop, n = _int_bound(op, b)
        if n > _INT64_MAX:  # every int64 is below n
            if iop in ("$lt", "$lte"):
                out |= col.is_wide
        elif n < _INT64_MIN:  # ... above n
            if iop in ("$gt", "$gte"):
                out |= col.is_wide
        else:
            out |= col.is_wide & _RANGES[iop](col.wide, np.int64(n))
    if col.huge:  # beyond int64: Python's exact comparison
        out[col.huge_rows] = np.fromiter((_RANGES[op](x, b) for x in col.huge), np.bool_, len(col.huge))
    return out


def _eval_meta(node: _Cmp, col: _Column) -> np.ndarray:
    op, v = node.op, node.value
    present = col.codes >= 0
    if op == "$exists":
        return present if v else ~present
    if op in ("$eq", "$ne"):
        c = col.keys.get(_value_key(v))
        eq = col.codes == c if c is not None else np.zeros(col.codes.shape, dtype=np.bool_)
        return eq if op == "$eq" else present & ~eq
    if op in ("$in", "$nin"):
        cs = [col.keys[k] for k in (_value_key(x) for x in v) if k in col.keys]
        inn = np.isin(col.codes, np.asarray(cs, dtype=np.int64))
        return inn if op == "$in" else present & ~inn
    kind, bound = v
    cmp = _RANGES[op]
    if kind == "num":
        if col.has_str and not col.has_num:
            raise FilterTypeError(
                f"{node.where}: compares a number with the field {node.field!r}, whose values are strings "
                f"(give a string bound to compare strings)"
            )
        return _number_range(col, op, bound)
    if kind == "str":
        if col.has_num and not col.has_str:
            raise FilterTypeError(
                f"{node.where}: compares a string with the field {node.field!r}, whose values are numbers "
                f"(give a number bound)"
            )
        return col.table(lambda x: isinstance(x, str) and cmp(x, bound))
    # a datetime bound: ISO-8601 string values as instants
    if col.has_num and not col.has_str:
        raise FilterTypeError(
            f"{node.where}: compares a datetime with the field {node.field!r}, whose values are numbers "
            f"(give epoch seconds as a number bound)"
        )
    return cmp(col.instants(), bound)


# --------------------------------------------------------------------------- selections
@dataclass(frozen=True)
class RowSelection:
    """The rows each query of a batch may return: the compiled filters of one batch.

    Selection ``p`` is a sorted list of rows of ONE segment (``seg[p]``): the rows of
    that user that its filter keeps. A query ``i`` with ``qsel[i] == p`` returns only
    those rows; ``qsel[i] == -1`` leaves the query unfiltered (its whole segment). Every
    backend takes the top-k over the selected rows only (probe, recollection rounds and
    final list: :mod:`rfmem_fast.backends`), so a filtered query's result is the exact
    top-k of its matching items.

    Attributes:
        qsel: int64 [b] selection of each query (-1: none).
        seg: int64 [P] segment of each selection.
        off: int64 [P + 1] CSR offsets of the selections in ``rows``.
        rows: int64 [M] the selected rows (global, sorted within each selection).
        seg_len: int64 [P] the length of each selection's segment.
    """

    qsel: np.ndarray
    seg: np.ndarray
    off: np.ndarray
    rows: np.ndarray
    seg_len: np.ndarray
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_selections(self) -> int:
        """Number of selections P."""
        return int(self.seg.shape[0])

    @property
    def counts(self) -> np.ndarray:
        """int64 [P]: rows per selection."""
        got = self._memo.get("counts")
        if got is None:
            got = self._memo["counts"] = np.diff(self.off)
        return got

    def local_rows(self, qsel: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
        """Positions in :attr:`rows` (the compacted rows) of global ``rows`` [m, w] of the
        selections ``qsel`` [m] (-1 stays -1; every other row must be selected).

        Args:
            qsel: int64 [m] a selection per row of ``rows`` (>= 0).
            rows: int64 [m, w] global rows or -1.
            n: the number of rows of the bank (> every row).
        """
        keys = self._memo.get(("keys", n))
        if keys is None:  # (selection, row) as one increasing key
            keys = self._memo[("keys", n)] = np.repeat(np.arange(self.num_selections, dtype=np.int64), self.counts) * n + self.rows
        loc = np.searchsorted(keys, qsel[:, None] * n + np.maximum(rows, 0))
        return np.where(rows >= 0, loc, -1).astype(np.int64, copy=False)

    def take(self, idx: Any) -> "RowSelection":
        """The selection of the queries ``idx`` (an index array, slice or torch tensor); the
        selections table (and its cached device copies) is shared."""
        if hasattr(idx, "detach"):  # a torch tensor
            idx = idx.detach().cpu().numpy()
        return RowSelection(np.ascontiguousarray(self.qsel[idx]), self.seg, self.off, self.rows, self.seg_len, self._memo)

    def any(self) -> bool:
        """True when some query is filtered."""
        got = self.__dict__.get("_any")
        if got is None:
            got = bool((self.qsel >= 0).any())
            object.__setattr__(self, "_any", got)  # per query list (not shared with take())
        return got

    def list_mode(self) -> np.ndarray:
        """bool [P]: selections the native kernel scans as a row list (at most
        :data:`LIST_MAX_FRACTION` of their segment's rows); the others as a mask."""
        return self.counts <= LIST_MAX_FRACTION * self.seg_len

    def native_table(self, offsets: np.ndarray) -> dict:
        """The selections table in the native kernel's layout (computed once, cached):
        ``sel_seg``, ``sel_off``, ``sel_rows`` and, for the mask-mode selections, their
        masks concatenated over their segments' rows (``sel_mask`` uint8, ``sel_mask_off``
        int64 [P], -1 for a list-mode selection)."""
        got = self._memo.get("native")
        if got is None:
            lm = self.list_mode()
            mask_off = np.full(self.num_selections, -1, dtype=np.int64)
            total = int(self.seg_len[~lm].sum())
            mask = np.zeros(total, dtype=np.uint8)
            pos = 0
            for p in np.flatnonzero(~lm).tolist():
                a = int(offsets[self.seg[p]])
                mask_off[p] = pos
                mask[pos + self.rows[self.off[p] : self.off[p + 1]] - a] = 1
                pos += int(self.seg_len[p])
            got = self._memo["native"] = dict(
                sel_seg=self.seg, sel_off=self.off, sel_rows=self.rows, sel_mask=mask, sel_mask_off=mask_off
            )
        return got

    def allowed(self, i: int, a: int, n: int) -> np.ndarray | None:
        """bool [n]: the rows ``a .. a + n - 1`` (query ``i``'s segment) it may return; None: all."""
        p = int(self.qsel[i])
        if p < 0:
            return None
        m = np.zeros(n, dtype=np.bool_)
        m[self.rows[self.off[p] : self.off[p + 1]] - a] = True
        return m


def _as_filter_list(filters: Any, b: int) -> list:
    """``filters`` as b entries (None or a filter), with the name of each in messages."""
    if filters is None:
        return [None] * b
    if isinstance(filters, (dict, Filter)):
        return [filters] * b
    if isinstance(filters, (str, bytes)) or not hasattr(filters, "__len__"):
        raise TypeError(f"filters must be a dict, a sequence of b dicts / None, or None, got {_type_name(filters)}")
    out = list(filters)
    if len(out) != b:
        raise ValueError(f"filters has {len(out)} entries but there are {b} queries")
    return out


def check_filters(filters: Any, b: int) -> list:
    """Parse ``filters`` for a batch of b queries without a bank (the checks only).

    Args:
        filters: None, one filter dict (every query), or b dicts / None.
        b: the number of queries.

    Returns:
        list of b entries: None or a parsed :class:`Filter` (a filter given once is parsed once).

    Raises:
        TypeError / ValueError: malformed filters (the message names the part;
            ``filters[i]...`` for a per-query list).
    """
    shared = filters is not None and isinstance(filters, (dict, Filter))
    items = _as_filter_list(filters, b)
    parsed: dict[int, Filter] = {}
    out: list = []
    for i, f in enumerate(items):
        if f is None:
            out.append(None)
            continue
        got = parsed.get(id(f))
        if got is None:
            got = parsed[id(f)] = parse_filter(f, "filters" if shared else f"filters[{i}]")
        out.append(got)
    return out


def compile_filters(bank: MemoryBank, snapshot: BankSnapshot, seg: Any, filters: Any) -> RowSelection | None:
    """Compile a batch's filters into the :class:`RowSelection` the backends apply.

    Each distinct filter is parsed once (and kept parsed across calls); each distinct
    (filter, user) pair is evaluated once (its rows cached on the bank per snapshot and
    metadata state), and the selection of a whole batch is cached the same way, so a
    repeated batch of filters costs a few lookups.

    Args:
        bank: the bank whose metadata the filters read.
        snapshot: the snapshot the search runs on (its rows, ``created_at``).
        seg: int [b] segment index of each query.
        filters: None, one filter dict (every query), or b dicts / None (a per-query
            filter; None leaves a query unfiltered); parsed :class:`Filter` objects
            are accepted too.

    Returns:
        RowSelection, or None when no query is filtered (the unfiltered search path).

    Raises:
        TypeError / ValueError: as :func:`check_filters`, or a range whose bound's type
            the field never holds among a queried user's items.
    """
    if filters is None:  # the unfiltered search: nothing to do
        return None
    seg = np.asarray(seg, dtype=np.int64)
    b = int(seg.shape[0])
    if isinstance(filters, (dict, Filter)) and b:  # one filter for every query: parsed once, one key
        f = parse_filter(filters)
        key = ("filter_selection_all", f.key, seg.tobytes())
        return bank.metadata_cached(snapshot, key, lambda: _compile(bank, snapshot, seg, [f] * b))
    parsed = check_filters(filters, b)
    if all(f is None for f in parsed):
        return None
    key = ("filter_selection", tuple(None if f is None else f.key for f in parsed), seg.tobytes())
    return bank.metadata_cached(snapshot, key, lambda: _compile(bank, snapshot, seg, parsed))


def _compile(bank: MemoryBank, snapshot: BankSnapshot, seg: np.ndarray, parsed: list) -> RowSelection:
    """The RowSelection of parsed filters (:func:`compile_filters` without its caches)."""
    b = int(seg.shape[0])
    off = snapshot.offsets
    pairs: dict[tuple, int] = {}
    qsel = np.full(b, -1, dtype=np.int64)
    sel_seg: list[int] = []
    parts: list[np.ndarray] = []
    for i, f in enumerate(parsed):
        if f is None:
            continue
        u = int(seg[i])
        key = (f.key, u)
        p = pairs.get(key)
        if p is None:
            p = pairs[key] = len(sel_seg)
            a = int(off[u])

            def build(f=f, u=u, a=a) -> np.ndarray:
                r = np.flatnonzero(f.mask(bank, snapshot, u)).astype(np.int64) + a
                r.setflags(write=False)
                return r

            parts.append(bank.metadata_cached(snapshot, ("filter_rows", f.key, u), build))
            sel_seg.append(u)
        qsel[i] = p
    seg_arr = np.asarray(sel_seg, dtype=np.int64)
    counts = np.fromiter((x.shape[0] for x in parts), np.int64, len(parts))
    offs = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offs[1:])
    rows = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return RowSelection(qsel, seg_arr, offs, rows, (off[seg_arr + 1] - off[seg_arr]).astype(np.int64))


__all__ = [
    "COMPARISONS", "CREATED_AT", "LIST_MAX_FRACTION", "LOGICAL", "POSITION", "RESERVED_FIELDS", "THREAD", "Filter",
    "FilterTypeError", "RowSelection", "check_filters",
    "compile_filters", "parse_filter", "parse_instant",
]  # fmt: skip
