"""Query expansion hook: extra vectors per query folded into the query (the paper's HyDE ablation).

A caller may pass, with each query ``q`` (unit), ``m >= 0`` extra vectors ``e_1..e_m``
of the same dimension, e.g. the embeddings of pseudo-documents an LLM wrote for the
question (HyDE, Gao et al. 2022). Each ``e_j`` is L2-normalised, then the query
becomes::

    q' = normalise(q + w * sum_j e_j)          w = RFMemConfig.expansion_weight

With ``w = 1`` this is HyDE's rule (the mean of the query and document embeddings; the
normalisation removes the 1 / (m + 1)); ``w = 0`` or ``m = 0`` leaves ``q`` unchanged.
:func:`rfmem_fast.search` uses ``q'`` everywhere it uses the query: the probe (so the
familiarity signals and the routing see the expanded query), the Familiarity path, the
Recollection path's original query ``q0`` (its first round and the ``+ q0`` term of
every child query, RFMEM_SPEC.md section 4) and the merges. Batched: one
``np.add.at`` over all extra vectors.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._validate import as_float_matrix, l2_normalize_rows

__all__ = ["fold_expansions"]


def fold_expansions(queries: np.ndarray, expansions: Any, weight: float = 1.0) -> np.ndarray:
    """Fold extra vectors into each query (see the module docstring).

    Args:
        queries: float32 [b, d] unit queries.
        expansions: None; a float array [b, m, d] (m extra vectors per query); or a
            sequence of b entries, each None or a float array [m_i, d] (m_i may be 0
            or differ between queries). numpy or torch.
        weight: ``w`` >= 0.

    Returns:
        float32 [b, d] unit rows (``queries`` itself when there is nothing to fold).

    Raises:
        ValueError: a wrong number of entries, a wrong dimension, NaN / Inf or a zero
            vector (the message names ``expansions[i]``).
        TypeError: a non-floating array or an entry that is not an array.
    """
    if expansions is None or weight == 0:
        return queries
    b, d = queries.shape
    if hasattr(expansions, "detach"):  # torch
        t = expansions.detach().cpu()
        expansions = (t.float() if t.is_floating_point() else t).numpy()
    if isinstance(expansions, np.ndarray) and expansions.ndim == 3:
        if expansions.shape[0] != b:
            raise ValueError(f"expansions has {expansions.shape[0]} entries but queries has {b} rows")
        flat = as_float_matrix(expansions.reshape(-1, expansions.shape[-1]), "expansions", d)
        owner = np.repeat(np.arange(b), expansions.shape[1])
    else:
        if isinstance(expansions, (str, bytes, np.ndarray)) or not hasattr(expansions, "__len__"):
            raise TypeError("expansions must be a [b, m, d] array or a sequence of b arrays [m_i, d] (or None)")
        if len(expansions) != b:
            raise ValueError(f"expansions has {len(expansions)} entries but queries has {b} rows")
        blocks, owners = [], []
        for i, e in enumerate(expansions):
            if e is None:
                continue
            m = as_float_matrix(e, f"expansions[{i}]", d)
            blocks.append(m)
            owners.append(np.full(m.shape[0], i))
        if not blocks:
            return queries
        flat = np.concatenate(blocks)
        owner = np.concatenate(owners)
    if flat.shape[0] == 0:
        return queries
    flat = l2_normalize_rows(flat, "expansions")
    acc = queries.astype(np.float64)
    np.add.at(acc, owner, float(weight) * flat.astype(np.float64))
    return l2_normalize_rows(acc.astype(np.float32), "expanded queries")
