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

The parts are split by concept, and the names callers import from here are re-exported:
:mod:`rfmem_fast.filters_values` (the reserved fields, the operators, JSON values and
instants), :mod:`rfmem_fast.filters_parse` (a filter dict read into a tree),
:mod:`rfmem_fast.filters_eval` (the tree evaluated over typed columns of a user's rows) and
:mod:`rfmem_fast.filters_selection` (:class:`RowSelection`). This module keeps the public
API: :class:`Filter`, :func:`parse_filter`, :func:`check_filters` and :func:`compile_filters`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .bank import BankSnapshot, MemoryBank
from .filters_eval import FilterTypeError as FilterTypeError
from .filters_eval import _Columns, _evaluate
from .filters_parse import _canonical, _parse
from .filters_selection import LIST_MAX_FRACTION as LIST_MAX_FRACTION
from .filters_selection import RowSelection as RowSelection
from .filters_values import COMPARISONS as COMPARISONS
from .filters_values import CREATED_AT as CREATED_AT
from .filters_values import LOGICAL as LOGICAL
from .filters_values import POSITION as POSITION
from .filters_values import RESERVED_FIELDS as RESERVED_FIELDS
from .filters_values import THREAD as THREAD
from .filters_values import _type_name
from .filters_values import parse_instant as parse_instant

# every other name these concept modules took from this one stays importable from here
from .filters_eval import (_Column, _eval_created, _eval_meta, _float_bound, _int_bound,  # noqa: F401
                           _number_range)
from .filters_parse import _Bool, _Cmp, _created_value, _parse_path, _parse_value  # noqa: F401
from .filters_values import (_FLOAT_EXACT, _INT64_MAX, _INT64_MIN, _LAST_SECOND, _LAST_UTC, _RANGES,  # noqa: F401
                             _check_json, _is_number, _normal, _number, _string_instant, _timestamp, _value_key,
                             _where)


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
