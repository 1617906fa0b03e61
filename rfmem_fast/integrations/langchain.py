"""LangChain retriever over a :class:`rfmem_fast.Memory` (extra ``langchain``: langchain-core).

    from rfmem_fast import Memory
    from rfmem_fast.integrations.langchain import RFMemRetriever
    retriever = RFMemRetriever(memory=Memory("memdir"), user_id="alice", k=5)
    docs = retriever.invoke("where do I live?")        # or: await retriever.ainvoke(...)
    docs[0].page_content, docs[0].metadata["score"], docs[0].metadata["rfmem"]["route"]
"""
from __future__ import annotations

from typing import Union

try:
    from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever
    from pydantic import ConfigDict, model_validator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "rfmem_fast.integrations.langchain needs langchain-core: pip install 'rfmem_fast[langchain]'"
    ) from exc

from ..serving.memory import Hits, Memory
from . import check_k_mode, hit_metadata

__all__ = ["RFMemRetriever"]


class RFMemRetriever(BaseRetriever):
    """RF-Mem retrieval from one user's memory as a LangChain retriever.

    Fields:
        memory: the :class:`rfmem_fast.Memory` to search.
        user_id: whose memory (str or int); a retriever never reads another user's items.
        k: documents per query (None: the memory's ``config.out_k``).
        mode: "rfmem" (default), "dense" or "recollection" (RFMEM_SPEC.md section 5).

    Returns ``Document``s best first: ``page_content`` is the item's text ("" for an
    item stored without text), ``id`` the item id (str), ``metadata`` the item's
    metadata plus ``"score"`` and ``"rfmem"`` (:func:`rfmem_fast.integrations.hit_metadata`).
    ``ainvoke`` awaits :meth:`Memory.asearch`, so concurrent calls share micro-batches.

    Raises (on construction): pydantic ``ValidationError`` for a memory that is not a
    Memory, a bad k or mode.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    memory: Memory
    user_id: Union[str, int]
    k: Union[int, None] = None
    mode: str = "rfmem"

    @model_validator(mode="after")
    def _check(self) -> "RFMemRetriever":
        check_k_mode(self.k, self.mode)
        return self

    @staticmethod
    def _documents(hits: Hits) -> list[Document]:
        return [Document(page_content=h.text or "", metadata=hit_metadata(h), id=str(h.id)) for h in hits]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return self._documents(self.memory.search(query, self.user_id, k=self.k, mode=self.mode))

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        return self._documents(await self.memory.asearch(query, self.user_id, k=self.k, mode=self.mode))
