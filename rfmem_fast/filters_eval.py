"""Evaluation of a parsed filter over one user's rows: typed columns of the rows' metadata
(``_Column``: value codes, and the numbers split for exact ranges as the module docstring of
:mod:`rfmem_fast.filters` describes, "Exact numbers"), cached per snapshot and metadata state
on the bank (``_Columns``), the comparisons evaluated with numpy into a bool mask, and
:class:`FilterTypeError`, raised when a range's bound has a type the field never holds.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .bank import NO_POSITION, BankSnapshot, MemoryBank
from .filters_parse import _Bool, _Cmp
from .filters_values import (_FLOAT_EXACT, _INT64_MAX, _INT64_MIN, _RANGES, CREATED_AT, POSITION, THREAD,
                             _string_instant, _value_key)


class FilterTypeError(TypeError):
    """A well-formed filter whose range bound has a type the queried user's values of the
    field never have (a number against a field holding only strings, ...): raised when
    the filter is evaluated, naming the part of the filter (the HTTP service answers 422)."""


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
