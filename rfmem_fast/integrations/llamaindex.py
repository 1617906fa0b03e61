"""LlamaIndex retriever over a :class:`rfmem_fast.Memory` (extra ``llamaindex``: llama-index-core).

    from rfmem_fast import Memory
    from rfmem_fast.integrations.llamaindex import RFMemRetriever
    retriever = RFMemRetriever(Memory("memdir"), user_id="alice", k=5)
    nodes = retriever.retrieve("where do I live?")     # or: await retriever.aretrieve(...)
    nodes[0].node.get_content(), nodes[0].score, nodes[0].node.metadata["rfmem"]["route"]
"""
from __future__ import annotations

from typing import Any, Hashable

try:
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "rfmem_fast.integrations.llamaindex needs llama-index-core: pip install 'rfmem_fast[llamaindex]'"
    ) from exc

from ..serving.memory import Hits, Memory
from . import BOOKKEEPING_KEYS, check_k_mode, hit_metadata, node_id

__all__ = ["RFMemRetriever"]


class RFMemRetriever(BaseRetriever):
    """RF-Mem retrieval from one user's memory as a LlamaIndex retriever.

    Args:
        memory: the :class:`rfmem_fast.Memory` to search.
        user_id: whose memory (str or int); a retriever never reads another user's items.
        k: nodes per query (None: the memory's ``config.out_k``).
        mode: "rfmem" (default), "dense" or "recollection" (RFMEM_SPEC.md section 5).
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
        TypeError: ``memory`` is not a Memory. ValueError: a bad k or mode.
    """

    def __init__(self, memory: Memory, user_id: Hashable, k: int | None = None, mode: str = "rfmem",
                 **kwargs: Any) -> None:
        if not isinstance(memory, Memory):
            raise TypeError(f"memory must be a rfmem_fast.Memory, got {type(memory).__name__}")
        check_k_mode(k, mode)
        self.memory = memory
        self.user_id = user_id
        self.k = k
        self.mode = mode
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
        return self._nodes(self.memory.search(self._query(query_bundle), self.user_id, k=self.k, mode=self.mode))

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = await self.memory.asearch(self._query(query_bundle), self.user_id, k=self.k, mode=self.mode)
        return self._nodes(hits)
