"""The HTTP service's request and response bodies (pydantic models) and their limits:
what :mod:`rfmem_fast.serving.app` validates before a route runs (a malformed body is a
422 naming the field), and the shapes of its JSON answers (the OpenAPI schema).

Numbers are strict (``"k": "2"``, ``true`` or a numeric string in a vector are refused),
a misspelt field is an error, and a search's ``filters`` are checked by
:mod:`rfmem_fast.filters` (the message names the part of the filter).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from ..filters import check_filters, parse_filter
from .validate import (MAX_ID_LENGTH, MAX_K, MAX_TEXT_CHARS, _check_pairs, _count_error, _created_list,
                       _entry_label, _position_list, _thread_list)


MAX_ITEMS = 1024  # items per add / delete request
MAX_BULK_ITEMS = 4096  # items per bulk request (/v1/memories:batch*)
MAX_QUERIES = 1024  # queries per batch search
MAX_TEXT = MAX_TEXT_CHARS  # characters per text
MAX_DIM = 65_536
MAX_PAGE = 1000  # items per page of GET /memories

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
ItemId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_LENGTH)]
#: a JSON number, finite; strict: ``true`` / ``false`` and numeric strings are refused (not 1.0 / "1.0")
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Vector = Annotated[list[Finite], Field(min_length=1, max_length=MAX_DIM)]
Meta = dict[str, Any]
# path segments as routed: the decoded id with "%" and "/" escaped (_PathSegments)
UserSeg = Annotated[str, Path(min_length=1, description="the user whose memory is used (percent-encoded)")]
ItemSeg = Annotated[str, Path(min_length=1, description="an item id of that user (percent-encoded)")]
Mode = Literal["rfmem", "dense", "recollection"]
K = Annotated[int, Field(strict=True, ge=1, le=MAX_K)]
#: a conversation thread id: a str (1-256 characters) or an int (signed 64-bit), kept as sent
#: ("1" and 1 are different threads); strict: ``true`` is refused
ThreadId = Union[Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_LENGTH)],
                 Annotated[int, Field(strict=True, ge=-(2**63), le=2**63 - 1)]]
#: an item's position in its conversation thread (strict: ``1.0``, ``"1"``, ``true`` are refused)
Position = Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)]


def _checked_conversation(v: Any, name: str) -> Any:
    """An add body's ``thread`` / ``position`` as sent, checked as :meth:`Memory.add` checks
    it (the same message, a 422 naming the field; :mod:`rfmem_fast.serving.validate`)."""
    if v is not None:
        check = _thread_list if name == "thread" else _position_list
        try:
            check(v, len(v) if isinstance(v, list) else 1)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
    return v


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not ignored


class AddRequest(_Body):
    """Items to add: texts (encoded by the server) and / or vectors, optional ids / metadata."""

    texts: list[Text] | None = Field(None, min_length=1, max_length=MAX_ITEMS)
    vectors: list[Vector] | None = Field(None, min_length=1, max_length=MAX_ITEMS)
    ids: list[ItemId] | None = Field(None, min_length=1, max_length=MAX_ITEMS)
    metadata: Union[Meta, list[Meta | None], None] = None
    #: when the items were created: an ISO-8601 string with a UTC offset or epoch seconds,
    #: one for every item or one per item (default: now; Memory.add), each within
    #: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999Z (a bad one: 422 naming it)
    created_at: Union[Finite, str, list[Union[Finite, str]], None] = None
    #: the items' conversation thread: one thread id for every item or one (or null) per
    #: item (Memory.add's ``thread``; default: none)
    thread: Union[ThreadId, list[Union[ThreadId, None]], None] = None
    #: each item's position in its thread, an int >= 0: one for every item or one (or null)
    #: per item (Memory.add's ``position``; an item with a position needs a thread)
    position: Union[Position, list[Union[Position, None]], None] = None

    @field_validator("thread", "position", mode="before")
    @classmethod
    def _conversation(cls, v: Any, info: Any) -> Any:
        return _checked_conversation(v, info.field_name)

    @field_validator("created_at", mode="before")
    @classmethod
    def _created_at(cls, v: Any) -> Any:
        if v is not None:  # the value as sent, checked as Memory.add checks it (the same message; true: 422)
            try:
                _created_list(v, len(v) if isinstance(v, list) else 1)
            except (TypeError, ValueError) as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _lengths(self) -> "AddRequest":
        if self.texts is None and self.vectors is None:
            raise ValueError("texts or vectors is required")
        m = len(self.texts) if self.texts is not None else len(self.vectors)
        for name, val in (("vectors", self.vectors), ("ids", self.ids),
                          ("metadata", self.metadata if isinstance(self.metadata, list) else None),
                          ("created_at", self.created_at if isinstance(self.created_at, list) else None),
                          ("thread", self.thread if isinstance(self.thread, list) else None),
                          ("position", self.position if isinstance(self.position, list) else None)):
            if val is not None and len(val) != m:
                raise _count_error(name, len(val), m)
        pl, tl = _entry_label("position", self.position), _entry_label("thread", self.thread)
        _check_pairs(_thread_list(self.thread, m), _position_list(self.position, m), lambda j: (pl(j), tl(j)))
        return self


class UpdateRequest(_Body):
    """New text (re-encoded), vector, metadata and / or conversation of one item: the
    names of :meth:`Memory.update` (``texts``, ``vectors``, ``metadata``, ``thread``,
    ``position``), for one item. ``"thread": null`` / ``"position": null`` clear the
    item's thread / position (a field left out is kept; an item with a position needs a
    thread)."""

    texts: Text | None = None
    vectors: Vector | None = None
    metadata: Meta | None = None
    thread: ThreadId | None = None
    position: Position | None = None

    @field_validator("thread", "position", mode="before")
    @classmethod
    def _conversation(cls, v: Any, info: Any) -> Any:
        return _checked_conversation(v, info.field_name)

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in (("text", "texts"), ("vector", "vectors")):
                if old in data:
                    raise ValueError(f"unknown field {old!r}: use {new!r} (the name of Memory.update and of add)")
        return data

    @model_validator(mode="after")
    def _something(self) -> "UpdateRequest":
        if (self.texts is None and self.vectors is None and self.metadata is None
                and not self.model_fields_set & {"thread", "position"}):
            raise ValueError("texts, vectors, metadata, thread or position is required")
        return self


class DeleteRequest(_Body):
    """Item ids to delete."""

    ids: list[ItemId] = Field(min_length=1, max_length=MAX_ITEMS)


class BulkAddItem(_Body):
    """One item of a bulk add: its user, a text and / or a vector, optional id,
    metadata, ``created_at`` (as :class:`AddRequest`'s: epoch seconds or ISO-8601,
    a string without an offset read as UTC; default: now; checked by
    :meth:`Memory.add_many`, a bad one a 422 at ``["body", "items", i, "created_at"]``),
    ``thread`` and ``position`` (the item's conversation, as :class:`AddRequest`'s)."""

    user_id: ItemId
    id: ItemId | None = None
    text: Text | None = None
    vector: Vector | None = None
    metadata: Meta | None = None
    created_at: Union[Finite, Annotated[str, StringConstraints(max_length=64)], None] = None
    thread: ThreadId | None = None
    position: Position | None = None

    @model_validator(mode="after")
    def _some(self) -> "BulkAddItem":
        if self.text is None and self.vector is None:
            raise ValueError("text or vector is required")
        return self


class BulkUpdateItem(_Body):
    """One item of a bulk update: its user and id, and what changes (a field left out
    is kept; ``"metadata": null``, ``"thread": null``, ``"position": null`` clear)."""

    user_id: ItemId
    id: ItemId
    text: Text | None = None
    vector: Vector | None = None
    metadata: Meta | None = None
    thread: ThreadId | None = None
    position: Position | None = None

    @model_validator(mode="after")
    def _some(self) -> "BulkUpdateItem":
        if not self.model_fields_set & {"text", "vector", "metadata", "thread", "position"}:
            raise ValueError("text, vector, metadata, thread or position is required")
        return self


class BulkDeleteItem(_Body):
    """One item of a bulk delete."""

    user_id: ItemId
    id: ItemId


class BulkAddRequest(_Body):
    """Items of any users, added in one all-or-nothing write (:meth:`Memory.add_many`)."""

    items: list[BulkAddItem] = Field(min_length=1, max_length=MAX_BULK_ITEMS)


class BulkUpdateRequest(_Body):
    """Items of any users, changed in one all-or-nothing write (:meth:`Memory.update_many`)."""

    items: list[BulkUpdateItem] = Field(min_length=1, max_length=MAX_BULK_ITEMS)


class BulkDeleteRequest(_Body):
    """Items of any users, deleted in one all-or-nothing write (:meth:`Memory.delete_many`)."""

    items: list[BulkDeleteItem] = Field(min_length=1, max_length=MAX_BULK_ITEMS)


def _checked_filters(v: Any, batch: bool) -> Any:
    """A search body's ``filters``, checked by :mod:`rfmem_fast.filters` (a bad one: 422
    whose message names the part, e.g. ``filters['score']['$gte']: ...``)."""
    if v is None:
        return None
    try:
        if batch and isinstance(v, list):
            check_filters(v, len(v))
        else:
            parse_filter(v, "filters")
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    return v


class SearchRequest(_Body):
    """One query: a text or a vector, the number of hits k, the mode, optional filters
    over the items' metadata and ``created_at`` (:mod:`rfmem_fast.filters`)."""

    query: Text | None = None
    vector: Vector | None = None
    k: K | None = None
    mode: Mode = "rfmem"
    filters: dict[str, Any] | None = None

    @field_validator("filters")
    @classmethod
    def _filters(cls, v: Any) -> Any:
        return _checked_filters(v, batch=False)

    @model_validator(mode="after")
    def _one(self) -> "SearchRequest":
        if (self.query is None) == (self.vector is None):
            raise ValueError("exactly one of query and vector is required")
        return self


class BatchSearchRequest(_Body):
    """Many queries of one user: texts or vectors, with one k and mode, and filters: one
    for every query or one (or null) per query."""

    queries: list[Text] | None = Field(None, min_length=1, max_length=MAX_QUERIES)
    vectors: list[Vector] | None = Field(None, min_length=1, max_length=MAX_QUERIES)
    k: K | None = None
    mode: Mode = "rfmem"
    filters: Union[dict[str, Any], list[dict[str, Any] | None], None] = None

    @field_validator("filters")
    @classmethod
    def _filters(cls, v: Any) -> Any:
        return _checked_filters(v, batch=True)

    @model_validator(mode="after")
    def _one(self) -> "BatchSearchRequest":
        if (self.queries is None) == (self.vectors is None):
            raise ValueError("exactly one of queries and vectors is required")
        n = len(self.queries if self.queries is not None else self.vectors)
        if isinstance(self.filters, list) and len(self.filters) != n:
            raise _count_error("filters", len(self.filters), n, "query", single="one filter (or null)")
        return self


class MintRequest(_Body):
    """A user token to mint: the one user it may access, an optional label."""

    user_id: ItemId
    label: Annotated[str, StringConstraints(max_length=256)] | None = None


class HitOut(BaseModel):
    """One hit of a search (``created_at``: the item's creation time, ISO-8601 UTC as in
    :class:`ItemOut`, null when unknown; ``thread`` / ``position``: its conversation, null
    when none; ``context_score``: its context score when the memory's configuration has
    the context score on, the hits then ranked by it, null otherwise:
    :class:`~rfmem_fast.serving.memory.Hit`)."""

    id: str
    text: str | None
    score: float
    metadata: Meta
    rank: int
    dense_score: float | None = None
    lexical_score: float | None = None
    created_at: str | None = None
    thread: Union[str, int, None] = None
    position: int | None = None
    context_score: float | None = None


class SearchResponse(BaseModel):
    """A query's hits and its familiarity signals (RFMEM_SPEC.md sections 1-2)."""

    user_id: str
    route: str | None
    rule: str
    mean: float
    entropy: float
    rounds: int
    cached: bool
    hits: list[HitOut]


class ItemOut(BaseModel):
    """A stored item (``created_at``: ISO-8601 UTC, null when unknown; ``thread`` /
    ``position``: its conversation, null when none)."""

    id: str
    text: str | None
    metadata: Meta
    created_at: str | None = None
    thread: Union[str, int, None] = None
    position: int | None = None


class ItemPage(BaseModel):
    """A page of a user's items (insertion order); ``next_offset`` None on the last page."""

    items: list[ItemOut]
    total: int
    offset: int
    limit: int
    next_offset: int | None
