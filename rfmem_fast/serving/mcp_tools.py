"""What each tool of ``rfmem mcp`` tells a client and takes: the tools' descriptions (the
text a client's model reads to choose and call a tool), the argument types of their
schemas (texts, ids, conversation threads and positions, metadata, the items of
``update_memories``), the limits per call, and the JSON of a memory a tool returns. The
tools themselves are registered by :func:`rfmem_fast.serving.mcp_server.create_server`.
"""
from __future__ import annotations

from typing import Annotated, Any, Union

from .mcp_sdk import BaseModel, BeforeValidator, ConfigDict, Field
from .memory import MAX_ID_LENGTH, MAX_TEXT_CHARS, Item

MAX_TEXTS = 256  # texts per add_memories call
MAX_TEXT = MAX_TEXT_CHARS  # characters per text / query (as Memory)
MAX_K = 100
MAX_PAGE = 200
MAX_ID = MAX_ID_LENGTH  # characters per id (as Memory)

_ADD = """Store one or more new memories (facts, preferences, events) of the current user, to be found later
with search_memories. Each text is stored as one memory (a text over the encoder's 256-token window is embedded
in overlapping chunks, still one memory); keep each one self-contained (one fact per text reads best). The write is durable when this returns.

Arguments:
- texts: one string, or a list of 1 to 256 strings (each 1 to 100000 characters).
- metadata: optional JSON object stored with every text (e.g. {"source": "chat"}), or a list of one object (or
  null) per text.
- thread: optional, the conversation the texts come from (a string or an integer id, e.g. "chat-2026-11-04"),
  one for every text or a list of one (or null) per text; memories of one conversation give each other context
  when the server ranks with the context score.
- position: optional, each text's place in its conversation (an integer >= 0, e.g. the turn number): one for
  every text or a list of one (or null) per text; a memory with a position needs a thread.

Returns {"ids": [one new id per text, in order], "count": number stored}."""

_SEARCH = """Find the current user's memories most relevant to a query (RF-Mem retrieval: a quick familiarity probe
decides between a plain similarity search and a recollection search that gathers related memories in rounds).

Arguments:
- query: what to look for, in natural language (1 to 100000 characters).
- k: how many memories to return at most (1 to 100, default 10).
- mode: "rfmem" (default, routed), "dense" (plain similarity) or "recollection" (always the multi-round search).
- filters: optional, only memories matching it can be returned (the best k among the matching ones, exactly).
  A JSON object over the memories' metadata and their "created_at" time: {"source": "chat"} (equality),
  {"tag": {"$in": ["work", "travel"]}}, {"score": {"$gte": 3, "$lt": 7}}, {"created_at": {"$gte":
  "2026-11-01T00:00:00Z"}} (ISO-8601 with an offset), {"$and": [...]}, {"$or": [...]}, {"$not": {...}},
  {"field": {"$exists": true}}; operators $eq $ne $gt $gte $lt $lte $in $nin $exists; "a.b" reads nested
  metadata. A memory without the field matches no comparison. {"thread": "chat-7"} and {"position": {"$lt": 5}}
  reach the memories' conversation.

Returns {"hits": [{"id", "text", "score", "metadata", "rank", "created_at", "thread", "position", "context_score"},
...] best first (fewer than k when the user has fewer memories; [] when none; "created_at": when the memory was
added, ISO-8601 UTC, or null when unknown; "thread" / "position": its conversation, or null; "context_score": the
score the hits are ranked by when the server ranks with the context of each memory's conversation, else null),
"route" ("familiarity" / "recollection", or null without memories), "mode", "k"}."""

_UPDATE = """Change one existing memory of the current user, keeping its id: a new text (re-embedded) and / or new
metadata. The write is durable when this returns.

Arguments:
- id: the memory's id (from add_memories, search_memories or list_memories).
- text: the new text (1 to 100000 characters), or omit to keep it.
- metadata: a JSON object that REPLACES the memory's metadata ({} clears it), or omit to keep it.
At least one of text and metadata is required.

Returns the memory as stored now: {"id", "text", "metadata", "created_at", "thread", "position"}. Error when no memory has that id."""

_DELETE = """Delete one memory of the current user, for good (it is never returned again). The deletion is durable
when this returns.

Arguments:
- id: the memory's id (from add_memories, search_memories or list_memories).

Returns {"id", "deleted": true}. Error when no memory has that id."""

_UPDATE_MANY = """Change several existing memories of the current user at once, keeping their ids: for each, a new
text (re-embedded) and / or new metadata. All or nothing: if any item is invalid or names an id that does not exist,
NOTHING is changed and the error names the item (items[i]). The write is durable when this returns.

Arguments:
- items: a list of 1 to 256 objects {"id": the memory's id, "text"?: the new text (1 to 100000 characters),
  "metadata"?: a JSON object that REPLACES the memory's metadata ({} clears it)}; each needs a text or metadata,
  and an id may appear once.

Returns {"updated": [the ids, in order], "count": number changed}."""

_DELETE_MANY = """Delete several memories of the current user at once, for good (they are never returned again).
All or nothing: if any id does not exist, NOTHING is deleted and the error names it (ids[i]). The deletion is
durable when this returns.

Arguments:
- ids: a list of 1 to 256 distinct memory ids (from add_memories, search_memories or list_memories).

Returns {"deleted": [the ids, in order], "count": number deleted}."""

_LIST = """List the current user's memories in the order they were added, one page at a time.

Arguments:
- offset: memories to skip (integer >= 0, default 0).
- limit: the most memories in this page (1 to 200, default 50).

Returns {"memories": [{"id", "text", "metadata", "created_at", "thread", "position"}, ...], "total": the user's
number of memories, "offset", "next_offset": the offset of the next page, or null after the last page}."""

_GET = """Read one memory of the current user by its id.

Arguments:
- id: the memory's id (from add_memories, search_memories or list_memories).

Returns {"id", "text", "metadata", "created_at", "thread", "position"}. Error when no memory has that id."""

TextArg = Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]


def _int_id(v: Any) -> Any:
    """The id model of Memory: a JSON integer id is its decimal string (bools stay refused)."""
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


IdArg = Annotated[str, BeforeValidator(_int_id), Field(min_length=1, max_length=MAX_ID, description="the memory's id")]
Meta = dict[str, Any]
#: a conversation thread id: a string (1-256 characters) or an integer (kept as sent: "1" and 1 are two threads)
ThreadArg = Union[Annotated[str, Field(min_length=1, max_length=MAX_ID)],
                  Annotated[int, Field(strict=True, ge=-(2**63), le=2**63 - 1)]]
#: a memory's place in its conversation (strict: 1.0, "1" and true are refused)
PositionArg = Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)]


class MemoryChange(BaseModel):
    """One item of update_memories: the memory's id and what changes."""

    model_config = ConfigDict(extra="forbid")

    id: IdArg
    text: Annotated[str | None, Field(min_length=1, max_length=MAX_TEXT, description="the new text, or omit to keep")] = None
    metadata: Annotated[Meta | None, Field(description="metadata replacing the old ({} clears), or omit to keep")] = None


def _item_json(item: Item) -> dict[str, Any]:
    # id, text, metadata, created_at (ISO-8601 UTC, or null when unknown), thread, position (null when none)
    return item.to_dict()
