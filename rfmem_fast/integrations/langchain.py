"""LangChain retriever over a :class:`rfmem_fast.Memory` (extra ``langchain``: langchain-core).

    from rfmem_fast import Memory
    from rfmem_fast.integrations.langchain import RFMemRetriever
    retriever = RFMemRetriever(memory=Memory("memdir"), user_id="alice", k=5)
    docs = retriever.invoke("where do I live?")        # or: await retriever.ainvoke(...)
    docs[0].page_content, docs[0].metadata["score"], docs[0].metadata["rfmem"]["route"]
    work = RFMemRetriever(memory=mem, user_id="alice", search_kwargs={"filters": {"tag": "work"}})
"""
from __future__ import annotations

from typing import Any, Union

try:
    from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever
    from pydantic import ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "rfmem_fast.integrations.langchain needs langchain-core: pip install 'rfmem_fast[langchain]'"
    ) from exc

from ..filters import parse_filter
from ..serving.memory import Hits, Memory
from . import check_k_mode, hit_metadata

__all__ = ["RFMemRetriever"]


class RFMemRetriever(BaseRetriever):
    """RF-Mem retrieval from one user's memory as a LangChain retriever.

    Fields:
        memory: the :class:`rfmem_fast.Memory` to search.
        user_id: whose memory (str or int); a retriever never reads another user's items.
        k: documents per query (an int in [1, 1000]; None: the memory's ``config.out_k``).
            Strict: ``True`` or ``"3"`` is a validation error.
        mode: "rfmem" (default), "dense" or "recollection" (RFMEM_SPEC.md section 5).
        search_kwargs: defaults for every call, as LangChain's vector-store retrievers:
            ``{"k": ..., "mode": ..., "filters": ...}`` (they override ``k`` / ``mode``);
            ``filters`` is a filter over the items' metadata and ``created_at``
            (:mod:`rfmem_fast.filters`; the documents are then the top k of the matching
            items, exactly), checked on construction.

    Per call: ``invoke(query, k=2)`` / ``ainvoke(query, k=2, mode="dense", filters={...})``
    override them (checked the same way; another keyword is a ValueError naming it).

    Returns ``Document``s best first: ``page_content`` is the item's text ("" for an
    item stored without text), ``id`` the item id (str), ``metadata`` the item's
    metadata plus ``"score"`` and ``"rfmem"`` (:func:`rfmem_fast.integrations.hit_metadata`).
    ``ainvoke`` awaits :meth:`Memory.asearch`, so concurrent calls share micro-batches.

    Raises (on construction): pydantic ``ValidationError`` for a memory that is not a
    Memory, a bad k, mode or search_kwargs.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=True)

    memory: Memory
    user_id: Union[StrictStr, StrictInt]
    k: Union[StrictInt, None] = None
    mode: str = "rfmem"
    search_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("search_kwargs")
    @classmethod
    def _search_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        extra = sorted(set(v) - {"k", "mode", "filters"})
        if extra:
            raise ValueError(f"search_kwargs may hold 'k' and 'mode' only (and 'filters'), got {extra}")
        check_k_mode(v.get("k"), v.get("mode", "rfmem"))
        if v.get("filters") is not None:
            try:
                parse_filter(v["filters"], "search_kwargs['filters']")
            except TypeError as exc:  # pydantic reports ValueErrors as validation errors
                raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _check(self) -> "RFMemRetriever":
        check_k_mode(self.k, self.mode)
        return self

    def _params(self, kwargs: dict[str, Any]) -> tuple[int | None, str, Any]:
        """(k, mode, filters) of one call: per-call keywords > search_kwargs > the fields."""
        extra = sorted(set(kwargs) - {"k", "mode", "filters"})
        if extra:
            raise ValueError(f"RFMemRetriever takes k and mode per call (and filters), got unknown keyword(s) {extra}")
        merged = {"k": self.k, "mode": self.mode, "filters": None, **self.search_kwargs, **kwargs}
        check_k_mode(merged["k"], merged["mode"])
        return merged["k"], merged["mode"], merged["filters"]

    @staticmethod
    def _documents(hits: Hits) -> list[Document]:
        return [Document(page_content=h.text or "", metadata=hit_metadata(h), id=str(h.id)) for h in hits]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **kwargs: Any) -> list[Document]:
        k, mode, filters = self._params(kwargs)
        return self._documents(self.memory.search(query, self.user_id, k=k, mode=mode, filters=filters))

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun, **kwargs: Any
    ) -> list[Document]:
        k, mode, filters = self._params(kwargs)
        return self._documents(await self.memory.asearch(query, self.user_id, k=k, mode=mode, filters=filters))
