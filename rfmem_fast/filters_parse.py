"""Parsing of the filter language (the grammar: :mod:`rfmem_fast.filters`): a filter dict
checked and read into a tree of comparisons (``_Cmp``) under ``and`` / ``or`` / ``not``
nodes (``_Bool``), every error naming the part of the filter as a subscript path, and the
canonical string two identical filters share. :func:`rfmem_fast.filters.parse_filter`
wraps the tree in a :class:`~rfmem_fast.filters.Filter`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from .bank import check_instant
from .filters_values import (_RANGES, COMPARISONS, CREATED_AT, LOGICAL, _check_json, _is_number, _type_name, _where,
                             parse_instant)


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
