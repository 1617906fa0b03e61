"""Merging the two paths' lists on the Recollection path (``RFMemConfig.merge``).

The authors' Recollection path returns only the items its beam discovered, in
discovery order (RFMEM_SPEC.md section 4), and can return fewer than ``out_k`` items
even when the user holds many more. A merge combines, for each recollecting query, the
probe's ranked list ``P`` (the query's top-k, already computed by the probe) with the
recollection's hits ``R`` (every item the beam discovered, in discovery order):

``"none"``
    the authors' output: the first ``out_k`` of ``R`` (may be short).
``"interleave"``
    ``P[0], R[0], P[1], R[1], ...``, keeping the first occurrence of an item; when one
    list runs out the other continues. Score = inner product with the query.
``"rrf"``
    reciprocal-rank fusion (Cormack, Clarke and Buettcher, SIGIR 2009): an item scores
    ``sum over the lists holding it of 1 / (rrf_k + rank)``, rank 1-based, with the
    constant ``rrf_k`` (``RFMemConfig.rrf_k``, default 60 as in that paper); sorted by
    that score, ties in interleave order. Score = the fused score.
``"rescore"``
    the union of ``P`` and ``R`` ranked by ``<v, q> + rescore_weight * <v, c>``, where
    ``q`` is the query and ``c`` the unit mean of the recollected hits' vectors (the
    "cluster support": how close an item lies to what recollection gathered, a
    Rocchio-style pseudo-relevance feedback); ties in interleave order. Without hits
    ``c = 0`` and the ranking is the probe's. Score = that value.

Every merge but "none" returns ``min(out_k, user size)`` items (``P`` alone holds that
many). Everything is batched numpy over the (query, candidate) grid: one sort for
duplicates, one for the final order, no loop over queries. Inner products are computed
in float64 from the bank's float32 vectors, so every backend gives identical lists.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..config import MERGE_MODES

__all__ = ["MERGE_MODES", "merge_paths", "first_occurrences", "select_top", "in_blocks", "unit_mean"]


def merge_paths(
    merge: str,
    probe_rows: np.ndarray,
    hit_rows: np.ndarray,
    queries: np.ndarray,
    vectors: np.ndarray,
    out_k: int,
    rrf_k: float = 60.0,
    rescore_weight: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """Merge the probe's list and the recollection's hits of r queries.

    Args:
        merge: one of MERGE_MODES other than "none" (see the module docstring).
        probe_rows: int64 [r, kp] global bank rows of each query's probe, best first,
            -1 padding (a query's probe must hold min(out_k, user size) rows).
        hit_rows: int64 [r, m] recollected rows in discovery order, -1 padding, no
            repeats within a row.
        queries: float [r, d] the (unit) queries.
        vectors: float32 [n, d] the bank's unit rows (``BankSnapshot.vectors``).
        out_k: items per query, >= 1.
        rrf_k: the RRF constant (> 0).
        rescore_weight: weight of the cluster support in "rescore" (>= 0).

    Returns:
        (rows int64 [r, out_k] with -1 padding, scores float32 [r, out_k] with -inf
        padding).

    Raises:
        ValueError: unknown merge, or shapes that do not match.
    """
    if merge not in MERGE_MODES or merge == "none":
        raise ValueError(f"merge must be one of {MERGE_MODES[1:]}, got {merge!r}")
    probe_rows = np.asarray(probe_rows, dtype=np.int64)
    hit_rows = np.asarray(hit_rows, dtype=np.int64)
    if probe_rows.ndim != 2 or hit_rows.ndim != 2 or not (probe_rows.shape[0] == hit_rows.shape[0] == queries.shape[0]):
        raise ValueError(
            f"probe_rows {probe_rows.shape}, hit_rows {hit_rows.shape} and queries {queries.shape} "
            "must be 2-D and share their first dimension"
        )
    return in_blocks(
        lambda sl: _merge_block(merge, probe_rows[sl], hit_rows[sl], queries[sl], vectors, out_k, rrf_k, rescore_weight),
        probe_rows.shape[0], probe_rows.shape[1] + hit_rows.shape[1], vectors.shape[1],
    )  # fmt: skip


def in_blocks(fn: Any, r: int, width: int, d: int) -> tuple[np.ndarray, ...]:
    """Run ``fn(slice)`` over blocks of the r queries and concatenate its array outputs.

    A block holds at most ``2**24 // (width * d)`` queries, so the [block, width, d]
    float64 gather of the candidates' vectors stays near 128 MiB.
    """
    step = max(1, (1 << 24) // max(1, width * d))
    if r <= step:
        return fn(slice(0, r))
    parts = [fn(slice(i, i + step)) for i in range(0, r, step)]
    return tuple(np.concatenate([p[j] for p in parts]) for j in range(len(parts[0])))


def unit_mean(V: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``normalise(sum of the masked rows)`` per query: float64 [r, d] from V [r, m, d] and
    mask bool [r, m] (zero where nothing is masked in)."""
    c = (V * mask[:, :, None]).sum(axis=1)
    return c / (np.linalg.norm(c, axis=1, keepdims=True) + 1e-12)


def first_occurrences(cand: np.ndarray, valid: np.ndarray, order_key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which candidates are the first occurrence of their row (by ``order_key``), batched.

    Args:
        cand: int64 [r, L] rows; valid: bool [r, L]; order_key: int64 [r, L] (smaller =
            earlier; unique within a query).

    Returns:
        (keep bool [r, L]: valid and first of its row; o int64 [r, L]: the sort
        permutation grouping equal rows, earliest first; first bool [r, L] in that order).
    """
    grp = np.where(valid, cand, np.iinfo(np.int64).max)
    o = np.lexsort((order_key, grp), axis=1)
    g_sorted = np.take_along_axis(grp, o, 1)
    first = np.ones(cand.shape, dtype=bool)
    first[:, 1:] = g_sorted[:, 1:] != g_sorted[:, :-1]
    keep = np.empty(cand.shape, dtype=bool)
    np.put_along_axis(keep, o, first, 1)
    return keep & valid, o, first


def select_top(primary: np.ndarray, score: np.ndarray, keep: np.ndarray, order_key: np.ndarray, cand: np.ndarray,
               out_k: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The ``out_k`` kept candidates of largest ``primary`` (ties: smaller ``order_key``), batched.

    Returns:
        (rows int64 [r, out_k] with -1 padding, ``score`` of them as float32 [r, out_k]
        with -inf padding).
    """
    prim = np.where(keep, primary, -np.inf)
    key2 = np.where(keep, order_key, np.iinfo(np.int64).max)
    fin = np.lexsort((key2, -prim), axis=1)[:, :out_k]
    rows = np.take_along_axis(np.where(keep, cand, -1), fin, 1)
    sc = np.take_along_axis(np.where(keep, score, -np.inf), fin, 1).astype(np.float32)
    if rows.shape[1] < out_k:
        pad = out_k - rows.shape[1]
        rows = np.pad(rows, ((0, 0), (0, pad)), constant_values=-1)
        sc = np.pad(sc, ((0, 0), (0, pad)), constant_values=-np.inf)
    return rows, sc


def _merge_block(merge: str, probe_rows: np.ndarray, hit_rows: np.ndarray, queries: np.ndarray, vectors: np.ndarray,
                 out_k: int, rrf_k: float, rescore_weight: float) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """:func:`merge_paths` on one block of queries (all of it batched; arguments as there)."""
    r, kp = probe_rows.shape
    m = hit_rows.shape[1]
    cand = np.concatenate([probe_rows, hit_rows], axis=1)  # [r, L]
    L = kp + m
    valid = cand >= 0
    rank = np.concatenate([np.arange(kp), np.arange(m)])[None, :].repeat(r, 0)  # 0-based rank in its list
    src = np.concatenate([np.zeros(kp, np.int64), np.ones(m, np.int64)])[None, :]
    order_key = np.where(valid, 2 * rank + src, np.iinfo(np.int64).max)  # interleave position

    safe = np.where(valid, cand, 0)
    V = vectors[safe].astype(np.float64)  # [r, L, d]
    q = np.asarray(queries, dtype=np.float64)
    cos = np.einsum("rld,rd->rl", V, q)
    if merge == "interleave":
        primary = np.zeros((r, L))
        score = cos
    elif merge == "rrf":
        primary = 1.0 / (float(rrf_k) + rank + 1.0)
        score = primary
    else:  # rescore
        c = unit_mean(V[:, kp:], valid[:, kp:])
        primary = cos + float(rescore_weight) * np.einsum("rld,rd->rl", V, c)
        score = primary

    keep, o, first = first_occurrences(cand, valid, order_key)
    if merge == "rrf":  # an item is in both lists at most once each: add the partner's share
        p_sorted = np.take_along_axis(primary, o, 1)
        partner = np.zeros((r, L))
        partner[:, :-1] = np.where(~first[:, 1:], p_sorted[:, 1:], 0.0)
        p_sorted = p_sorted + partner
        primary = np.empty_like(primary)
        np.put_along_axis(primary, o, p_sorted, 1)
        score = primary
    # final order: primary descending, then interleave position
    return select_top(primary, score, keep, order_key, cand, out_k)
