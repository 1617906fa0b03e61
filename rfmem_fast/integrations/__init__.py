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

__all__ = ["hit_metadata", "check_k_mode", "BOOKKEEPING_KEYS", "node_id"]

#: the metadata keys a retriever adds to each result (not the item's own metadata):
#: excluded from the text an LLM or an embedding model sees (LlamaIndex)
BOOKKEEPING_KEYS = ("score", "rfmem")


def check_k_mode(k: Any, mode: Any) -> None:
    """Validate a retriever's ``k`` (an int in [1, 1000] or None: the limit of
    :meth:`Memory.search`; bool and str refused) and ``mode`` (one of ``rfmem_fast.MODES``).

    Raises:
        ValueError: naming the bad argument.
    """
    from ..search import MODES
    from ..serving.memory import MAX_K

    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K):
        raise ValueError(f"k must be an int >= 1 (at most {MAX_K}) or None, got {k!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def node_id(hit: Any) -> str:
    """A framework node / document id unique per (user, item): ``"<user>/<item>"``,
    each percent-encoded (``urllib.parse.quote(x, safe="")``), so items of different
    users (or ids that differ only by type in an older memory) never share one."""
    from urllib.parse import quote

    return f"{quote(str(hit.user_id), safe='')}/{quote(str(hit.id), safe='')}"


def hit_metadata(hit: Any) -> dict[str, Any]:
    """The metadata a framework document gets for one :class:`rfmem_fast.serving.Hit`.

    Returns:
        the item's own metadata (a copy) plus ``"score"`` (float) and ``"rfmem"``:
        {"id", "user_id", "score", "rank", "route", "rule", "mean", "entropy",
        "rounds", "dense_score", "lexical_score", "created_at", "thread", "position",
        "context_score"} (RFMEM_SPEC.md sections 1-4; the two channel scores of docs
        "Hybrid retrieval", None when unknown; ``created_at`` the item's creation time as
        an ISO-8601 UTC string, None when unknown; ``thread`` / ``position`` the item's
        conversation, None when none; ``context_score`` the score the hits are ranked by
        when the memory's configuration has the context score on, else None: docs
        "Conversations"). These two keys replace same-named keys of the item's metadata.
    """
    meta = dict(hit.metadata)
    meta["score"] = hit.score
    meta["rfmem"] = {
        "id": hit.id, "user_id": hit.user_id, "score": hit.score, "rank": hit.rank, "route": hit.route,
        "rule": hit.rule, "mean": hit.mean, "entropy": hit.entropy, "rounds": hit.rounds,
        "dense_score": hit.dense_score, "lexical_score": hit.lexical_score,
        "created_at": None if hit.created_at is None else hit.created_at.isoformat(),
        "thread": hit.thread, "position": hit.position, "context_score": hit.context_score,
    }
    return meta
