"""Retrievers for LLM frameworks over a :class:`rfmem_fast.Memory` (optional extras).

* :mod:`rfmem_fast.integrations.langchain`: ``RFMemRetriever``, a ``langchain_core``
  ``BaseRetriever`` returning ``Document``s (extra ``langchain``).
* :mod:`rfmem_fast.integrations.llamaindex`: ``RFMemRetriever``, a ``llama_index.core``
  ``BaseRetriever`` returning ``NodeWithScore``s (extra ``llamaindex``).

Both call :meth:`Memory.search` / :meth:`Memory.asearch` (so concurrent retrievals share
micro-batches) and put the same fields in the results' metadata
(:func:`hit_metadata`).
"""
from __future__ import annotations

from typing import Any

__all__ = ["hit_metadata", "check_k_mode"]


def check_k_mode(k: Any, mode: Any) -> None:
    """Validate a retriever's ``k`` (int >= 1 or None) and ``mode`` (one of ``rfmem_fast.MODES``).

    Raises:
        ValueError: naming the bad argument.
    """
    from ..search import MODES

    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k must be an int >= 1 or None, got {k!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def hit_metadata(hit: Any) -> dict[str, Any]:
    """The metadata a framework document gets for one :class:`rfmem_fast.serving.Hit`.

    Returns:
        the item's own metadata (a copy) plus ``"score"`` (float) and ``"rfmem"``:
        {"id", "user_id", "score", "rank", "route", "rule", "mean", "entropy",
        "rounds"} (RFMEM_SPEC.md sections 1-4). These two keys replace same-named keys
        of the item's metadata.
    """
    meta = dict(hit.metadata)
    meta["score"] = hit.score
    meta["rfmem"] = {
        "id": hit.id, "user_id": hit.user_id, "score": hit.score, "rank": hit.rank, "route": hit.route,
        "rule": hit.rule, "mean": hit.mean, "entropy": hit.entropy, "rounds": hit.rounds,
    }
    return meta
