"""LlamaIndex retriever over a :class:`rfmem_fast.Memory` (extra ``llamaindex``: llama-index-core).

    from rfmem_fast import Memory
    from rfmem_fast.integrations.llamaindex import RFMemRetriever
    retriever = RFMemRetriever(Memory("memdir"), user_id="alice", k=5)
    nodes = retriever.retrieve("where do I live?")     # or: await retriever.aretrieve(...)
    nodes[0].node.get_content(), nodes[0].score, nodes[0].node.metadata["rfmem"]["route"]

    from llama_index.core.vector_stores.types import MetadataFilter, MetadataFilters
    work = RFMemRetriever(mem, user_id="alice", filters=MetadataFilters(filters=[MetadataFilter(key="tag", value="work")]))
"""
from __future__ import annotations

from typing import Any, Hashable

try:
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilters
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "rfmem_fast.integrations.llamaindex needs llama-index-core: pip install 'rfmem_fast[llamaindex]'"
    ) from exc

from ..filters import parse_filter
from ..serving.memory import Hits, Memory
from . import BOOKKEEPING_KEYS, check_k_mode, hit_metadata, node_id

__all__ = ["RFMemRetriever", "metadata_filters_to_filter"]

#: LlamaIndex operators with an equivalent in rfmem_fast.filters
_OPERATORS = {
    FilterOperator.EQ: "$eq", FilterOperator.NE: "$ne", FilterOperator.GT: "$gt", FilterOperator.GTE: "$gte",
    FilterOperator.LT: "$lt", FilterOperator.LTE: "$lte", FilterOperator.IN: "$in", FilterOperator.NIN: "$nin",
}  # fmt: skip


def metadata_filters_to_filter(filters: MetadataFilters, where: str = "filters") -> dict:
    """LlamaIndex ``MetadataFilters`` as a filter of :mod:`rfmem_fast.filters`.

    ``MetadataFilter(key, value, operator)`` becomes ``{key: {op: value}}`` (``==`` ``$eq``,
    ``!=`` ``$ne``, ``>`` ``$gt``, ``>=`` ``$gte``, ``<`` ``$lt``, ``<=`` ``$lte``, ``in``
    ``$in``, ``nin`` ``$nin``; ``is_empty``: the key missing, null, ``""`` or ``[]``), the
    conditions ``and`` / ``or`` / ``not`` (LlamaIndex's "none of them matches") become
    ``$and`` / ``$or`` / ``$not`` of ``$or``; nested ``MetadataFilters`` nest. One semantic
    difference: an item without the key matches no comparison here (LlamaIndex compares
    its ``None``), so ``!=`` / ``nin`` leave such items out.

    Raises:
        ValueError: an operator without an equivalent (``any``, ``all``, ``contains``,
            ``text_match``, ...), named with its position; TypeError: not MetadataFilters.
    """
    if not isinstance(filters, MetadataFilters):
        raise TypeError(f"{where} must be a llama_index MetadataFilters, got {type(filters).__name__}")
    parts = []
    for j, f in enumerate(filters.filters):
        w = f"{where}.filters[{j}]"
        if isinstance(f, MetadataFilters):
            parts.append(metadata_filters_to_filter(f, w))
        elif f.operator == FilterOperator.IS_EMPTY:
            parts.append({"$or": [{f.key: {"$exists": False}}, {f.key: None}, {f.key: ""}, {f.key: []}]})
        elif f.operator in _OPERATORS:
            parts.append({f.key: {_OPERATORS[f.operator]: f.value}})
        else:
            raise ValueError(f"{w}: the operator {f.operator.value!r} has no equivalent in rfmem_fast filters "
                             f"(supported: {', '.join(o.value for o in _OPERATORS)}, is_empty)")
    cond = filters.condition or FilterCondition.AND
    if not parts:
        return {}
    if cond == FilterCondition.NOT:
        return {"$not": {"$or": parts}}
    if len(parts) == 1:
        return parts[0]
    return {"$or" if cond == FilterCondition.OR else "$and": parts}


class RFMemRetriever(BaseRetriever):
    """RF-Mem retrieval from one user's memory as a LlamaIndex retriever.

    Args:
        memory: the :class:`rfmem_fast.Memory` to search.
        user_id: whose memory (str or int); a retriever never reads another user's items.
        k: nodes per query (None: the memory's ``config.out_k``).
        mode: "rfmem" (default), "dense" or "recollection" (RFMEM_SPEC.md section 5).
        filters: only items matching it are retrieved (the top k of the matching items,
            exactly): LlamaIndex ``MetadataFilters`` (:func:`metadata_filters_to_filter`)
            or a filter dict of :mod:`rfmem_fast.filters` (which also reaches
            ``created_at``); checked here.
        **kwargs: passed to ``llama_index.core.retrievers.BaseRetriever``.

    Returns ``NodeWithScore``s best first: a ``TextNode`` (``id_`` = ``"<user>/<item>"``
    percent-encoded, unique per user and item (:func:`rfmem_fast.integrations.node_id`;
    the item id itself is ``metadata["rfmem"]["id"]``), ``text`` = the item's text or "",
    ``metadata`` = the item's metadata plus ``"score"`` and ``"rfmem"``) with ``score`` =
    the hit's score. The bookkeeping keys ``"score"`` and ``"rfmem"`` are excluded from
    the LLM and EMBED content (``excluded_llm_metadata_keys`` /
    ``excluded_embed_metadata_keys``): ``get_content(MetadataMode.LLM)`` carries the
    text and the item's own metadata only. A query bundle that carries an
    ``embedding`` is searched with that vector instead of its text.

    Raises:
        TypeError: ``memory`` is not a Memory. ValueError: a bad k or mode; a bad filter
            (or a MetadataFilters operator without an equivalent; the message names it).
    """

    def __init__(self, memory: Memory, user_id: Hashable, k: int | None = None, mode: str = "rfmem",
                 filters: Any = None, **kwargs: Any) -> None:
        if not isinstance(memory, Memory):
            raise TypeError(f"memory must be a rfmem_fast.Memory, got {type(memory).__name__}")
        check_k_mode(k, mode)
        if isinstance(filters, MetadataFilters):
            filters = metadata_filters_to_filter(filters)
        if filters is not None:
            parse_filter(filters)
        self.memory = memory
        self.user_id = user_id
        self.k = k
        self.mode = mode
        self.filters = filters
        super().__init__(**kwargs)

    @staticmethod
    def _query(bundle: QueryBundle) -> Any:
        return bundle.embedding if bundle.embedding is not None else bundle.query_str

    @staticmethod
    def _nodes(hits: Hits) -> list[NodeWithScore]:
        keys = list(BOOKKEEPING_KEYS)
        return [
            NodeWithScore(node=TextNode(id_=node_id(h), text=h.text or "", metadata=hit_metadata(h),
                                        excluded_llm_metadata_keys=keys, excluded_embed_metadata_keys=keys),
                          score=h.score)
            for h in hits
        ]

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._nodes(self.memory.search(self._query(query_bundle), self.user_id, k=self.k, mode=self.mode,
                                              filters=self.filters))  # fmt: skip

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = await self.memory.asearch(self._query(query_bundle), self.user_id, k=self.k, mode=self.mode,
                                         filters=self.filters)  # fmt: skip
        return self._nodes(hits)
