"""Gather per-shard :class:`~rfmem_fast.SearchResult` parts back into the caller's order.

The merge is generic over the parts' dataclass (``SearchResult`` or a subclass): every field whose value in a part is a numpy
array with one row per query of that part (ids, rows, scores, route, mean, entropy,
rule, rounds, probe_ids, probe_scores, and any array field added to ``SearchResult``
later) is scattered into one array of the caller's batch size; the other fields
(``mode``, ``backend``, ``config``) must agree across parts, except ``backend``, whose
names are joined with "+" when they differ (shards that resolved "auto" differently,
e.g. a GPU and a CPU node).

``rows`` in a gathered result are the rows of each query's own shard's bank snapshot
(-1 padding): they tell padding from items (``SearchResult.ids_list``), but are not
comparable across shards; ``ids`` are the authoritative result.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..search import SearchResult

#: non-array fields that may differ across shards; their str values are joined with "+"
JOINED_FIELDS = ("backend",)


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return bool(a == b)


def gather_results(b: int, parts: Sequence[tuple[np.ndarray, SearchResult]]) -> SearchResult:
    """Scatter per-shard results into one SearchResult of ``b`` queries.

    Args:
        b: the caller's batch size.
        parts: (positions int64 [b_s], SearchResult over those b_s queries) per shard;
            the positions of all parts together are a permutation of ``range(b)``.

    Returns:
        SearchResult whose row i is the row of the part holding position i.

    Raises:
        ValueError: no part, positions that do not cover ``range(b)`` exactly once,
            array fields whose per-query shapes differ across parts, or non-array
            fields other than ``backend`` that differ across parts.
    """
    if not parts:
        raise ValueError("gather_results needs at least one part")
    seen = np.zeros(b, dtype=np.int64)
    for pos, res in parts:
        if len(pos) != len(res):
            raise ValueError(f"a part has {len(pos)} positions but {len(res)} result rows")
        np.add.at(seen, np.asarray(pos, dtype=np.int64), 1)
    if b and not (seen == 1).all():
        raise ValueError("the parts' positions must cover every query of the batch exactly once")
    cls = type(parts[0][1])  # the parts' own dataclass: fields added to it are carried too
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        vals = [getattr(res, f.name) for _, res in parts]
        if all(isinstance(v, np.ndarray) and v.ndim >= 1 and v.shape[0] == len(pos) for v, (pos, _) in zip(vals, parts)):
            tails = {v.shape[1:] for v in vals}
            if len(tails) != 1:
                raise ValueError(f"field {f.name!r} has per-query shapes {sorted(tails)} across shards")
            dtype = np.result_type(*vals) if all(v.dtype != object for v in vals) else np.dtype(object)
            out = np.empty((b,) + vals[0].shape[1:], dtype=dtype)
            for (pos, _), v in zip(parts, vals):
                out[np.asarray(pos, dtype=np.int64)] = v
            kwargs[f.name] = out
        elif all(_same(v, vals[0]) for v in vals[1:]):
            kwargs[f.name] = vals[0]
        elif f.name in JOINED_FIELDS and all(isinstance(v, str) for v in vals):
            kwargs[f.name] = "+".join(dict.fromkeys(vals))
        else:
            raise ValueError(f"field {f.name!r} differs across shards: {vals!r}")
    return cls(**kwargs)
