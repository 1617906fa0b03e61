"""``rfmem mcp``: a :class:`rfmem_fast.Memory` as a Model Context Protocol server.

Built on the official ``mcp`` Python SDK (``pip install 'rfmem_fast[mcp]'``), over the
public :class:`~rfmem_fast.serving.Memory` API only, so that writes take the same durable
path as ``rfmem serve``: each is in the fsynced write-ahead log before the tool answers.

Transports: stdio (``rfmem mcp --transport stdio --user alice --data-dir DIR``; the client
starts the server as a subprocess) and streamable HTTP (``--transport http --host
127.0.0.1 --port 8765 --tokens tokens.json``; endpoint ``http://HOST:PORT/mcp``).

Tools (no tool has a user argument)::

    add_memories(texts, metadata?, thread?, position?) -> {"ids", "count"}
    search_memories(query, k=10, mode="rfmem", filters?) -> {"hits": [{"id", "text", "score", "metadata", "rank",
                                                  "created_at", "thread", "position", "context_score"}],
                                                  "route", "mode", "k"}
    update_memory(id, text?, metadata?)       -> {"id", "text", "metadata", "created_at", "thread", "position"}
    update_memories(items: [{id, text?, metadata?}]) -> {"updated": [ids], "count"}   (all or none)
    delete_memory(id)                         -> {"id", "deleted"}
    delete_memories(ids)                      -> {"deleted": [ids], "count"}            (all or none)
    list_memories(offset=0, limit=50)         -> {"memories", "total", "offset", "next_offset"}
    get_memory(id)                            -> {"id", "text", "metadata", "created_at", "thread", "position"}

Resources: ``memory://{user}/memories`` (every memory of the user, JSON) and
``memory://{user}/memories/{id}`` (one memory), readable for the scoped user only;
``resources/list`` shows the scoped user's listing.

User scope: every call acts for ONE user, fixed by the server, never by the call:

* ``--user USER``: every client of this process is that user (stdio: one user per
  server process; HTTP: no authentication, so only on a loopback host).
* ``--tokens FILE`` (HTTP; default ``$RFMEM_MCP_TOKENS``): a bearer token -> user map
  kept as sha256 hashes (:func:`hash_token`); a request without a known token gets 401
  from the SDK's bearer middleware, and a known token's user is the scope of every
  call it carries (the SDK also binds an HTTP session to the token that opened it).
  Token digests are compared with :func:`hmac.compare_digest`, against every entry.

Ids: the ids of :class:`~rfmem_fast.serving.Memory` (str, 1-256 characters): an id sent as a
JSON integer is its decimal string (``7`` and ``"7"`` name one memory), so memories written
from Python with int ids are reached here, and every id returned is a str.

Validation: :class:`~rfmem_fast.serving.Memory` checks every text, query, id and metadata
object at the door (blank texts, lone surrogates, over-long texts, non-JSON metadata); its
refusals come back as tool errors naming the tool's own argument (``text``, ``id``, ...).
Arguments that do not fit a tool's schema get one short line naming each
(``k: input should be a valid integer (got a string)``: :meth:`_RFMemMCP.call_tool`), and
the integer arguments (``k``, ``offset``, ``limit``) are strict: ``"5"``, ``5.0`` and
``true`` are refused, not read as 5 or 1 (as over HTTP).
Texts longer than the encoder's window (256 tokens for all-MiniLM-L6-v2) are chunked by the
Memory and stay one memory each.

Start-up: the server answers the MCP handshake (``initialize``, ``tools/list``) at once, while
the Memory's default text encoder loads on a thread beside it (:class:`EncoderLoad`, started
by :func:`create_server`); the tools that embed text (add_memories, search_memories, and
update_memory(ies) with a new text) wait for it, and answer a tool error naming the cause
if it could not be loaded; the others (list, get, delete, the resources) answer at once.

Another user's memories are unreachable: searches run within the scoped user's segment
of the bank, ids are looked up among that user's items only (another user's id is
"not found", exactly like an id that does not exist), and a resource URI naming another
user is refused the same way.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Mapping, TypeVar, Union
from urllib.parse import quote

try:
    import anyio
    from mcp.server.auth.middleware.auth_context import get_access_token
    from mcp.server.auth.provider import AccessToken
    from mcp.server.auth.settings import AuthSettings
    from mcp.server.mcpserver import MCPServer, ResourceSecurity
    from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError, UnexpectedToolError
    from mcp.types import Resource as MCPResource
    from mcp.types import ToolAnnotations
    from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
except ImportError as exc:  # pragma: no cover - depends on the environment
    from .._optional import install_hint

    raise ImportError(
        f"the MCP server (rfmem mcp) needs the official mcp SDK (2.x), which cannot be imported ({exc}); "
        f"install it with: {install_hint('mcp')}",
        name=exc.name,
    ) from exc

from .batcher import BatcherClosedError, QueueFullError, RequestTimeoutError
from .memory import MAX_ID_LENGTH, MAX_TEXT_CHARS, Hits, Item, Memory
from .validate import _check_text

__all__ = [
    "TOKENS_ENV", "TokenMap", "McpScope", "hash_token", "scope_from_options", "create_server",
    "create_http_app", "serve_mcp", "EncoderLoad",
]

#: environment variable read for the token map when ``--tokens`` is not given
TOKENS_ENV = "RFMEM_MCP_TOKENS"
MAX_TEXTS = 256  # texts per add_memories call
MAX_TEXT = MAX_TEXT_CHARS  # characters per text / query (as Memory)
MAX_K = 100
MAX_PAGE = 200
MAX_ID = MAX_ID_LENGTH  # characters per id (as Memory)
_LOOPBACK = ("127.0.0.1", "localhost", "::1")

T = TypeVar("T")


# ---------------------------------------------------------------------- tokens
def hash_token(token: str) -> str:
    """The sha256 hex digest a token map stores for ``token``.

    Args:
        token: the bearer token (str, non-empty).

    Returns:
        64 lowercase hex characters.

    Raises:
        ValueError: an empty or non-str token.
    """
    if not isinstance(token, str) or not token:
        raise ValueError("token must be a non-empty str")
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenMap:
    """Bearer token -> user, kept as sha256 digests of the tokens (never the tokens).

    Also the SDK's ``TokenVerifier``: :meth:`verify_token` gives an ``AccessToken`` whose
    ``client_id`` is the user.

    Args:
        entries: (sha256 hex digest, user) pairs; a user may have several tokens.

    Raises:
        ValueError: a digest that is not 64 hex characters, an empty user, a digest
            listed twice, or no entries.
    """

    def __init__(self, entries: list[tuple[str, str]]) -> None:
        seen: set[str] = set()
        out: list[tuple[bytes, str]] = []
        for i, (digest, user) in enumerate(entries):
            d = str(digest).strip().lower().removeprefix("sha256:")
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
                raise ValueError(f"tokens[{i}].sha256 must be 64 hex characters (hash_token / sha256sum of the token)")
            if not isinstance(user, str) or not user:
                raise ValueError(f"tokens[{i}].user must be a non-empty str")
            if d in seen:
                raise ValueError(f"tokens[{i}]: this token hash is listed twice")
            seen.add(d)
            out.append((d.encode("ascii"), user))
        if not out:
            raise ValueError("the token map holds no tokens")
        self._entries = out

    @classmethod
    def from_json(cls, obj: Any) -> "TokenMap":
        """A map from parsed JSON: ``{"tokens": [{"user": U, "sha256": HEX}, ...]}`` (or the list alone).

        Raises:
            ValueError: any other shape (the bad part named).
        """
        items = obj.get("tokens") if isinstance(obj, dict) else obj
        if not isinstance(items, list):
            raise ValueError('the token map must be {"tokens": [{"user": ..., "sha256": ...}, ...]}')
        entries = []
        for i, e in enumerate(items):
            if not isinstance(e, dict) or set(e) != {"user", "sha256"}:
                raise ValueError(f'tokens[{i}] must be an object with exactly the keys "user" and "sha256"')
            entries.append((e["sha256"], e["user"]))
        return cls(entries)

    @classmethod
    def load(cls, spec: str) -> "TokenMap":
        """A map from a JSON file's path, or from the JSON text itself (``spec`` starting with ``{`` or ``[``).

        Raises:
            OSError: the file cannot be read. ValueError: not JSON, or a bad map.
        """
        text = spec if spec.lstrip()[:1] in ("{", "[") else Path(spec).read_text(encoding="utf-8")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the token map is not JSON: {exc}") from None
        return cls.from_json(obj)

    def __len__(self) -> int:
        return len(self._entries)

    def user_for(self, token: str) -> str | None:
        """The user of ``token``, or None when it is not in the map.

        Every entry is compared (with :func:`hmac.compare_digest`), so the time taken does
        not depend on which entry matched, or how much of a digest did.
        """
        if not isinstance(token, str) or not token:
            return None
        digest = hashlib.sha256(token.encode("utf-8")).hexdigest().encode("ascii")
        found = None
        for d, user in self._entries:
            if hmac.compare_digest(digest, d) and found is None:
                found = user
        return found

    async def verify_token(self, token: str) -> AccessToken | None:
        """The SDK's ``TokenVerifier`` hook: an ``AccessToken`` (``client_id`` = the user) or None."""
        user = self.user_for(token)
        return None if user is None else AccessToken(token=token, client_id=user, scopes=[])


@dataclass(frozen=True)
class McpScope:
    """Whose memories a server's clients reach: a fixed ``user``, or the user of each
    client's bearer token in ``tokens`` (exactly one of the two)."""

    user: str | None = None
    tokens: TokenMap | None = None

    def __post_init__(self) -> None:
        if (self.user is None) == (self.tokens is None):
            raise ValueError("give exactly one of user (a fixed user) or tokens (bearer token -> user)")
        if self.user is not None and (not isinstance(self.user, str) or not self.user):
            raise ValueError("user must be a non-empty str")


def scope_from_options(transport: str, user: str | None = None, tokens: str | None = None,
                       host: str = "127.0.0.1", environ: Mapping[str, str] | None = None) -> McpScope:
    """The scope of ``rfmem mcp`` from its options.

    Args:
        transport: "stdio" or "http".
        user: ``--user`` (a fixed user), or None.
        tokens: ``--tokens`` (a token map file, or its JSON), or None: then
            ``$RFMEM_MCP_TOKENS`` over HTTP when no user is given.
        host: ``--host`` (a fixed user over HTTP has no authentication: loopback only).
        environ: the environment (default ``os.environ``).

    Returns:
        the McpScope.

    Raises:
        ValueError: stdio without --user, stdio with --tokens, HTTP with neither a
            user nor tokens, HTTP with --user on a non-loopback host, both given, or a
            bad token map. OSError: an unreadable token file.
    """
    env = os.environ if environ is None else environ
    if user is not None and tokens is not None:
        raise ValueError("--user and --tokens exclude each other")
    if transport == "stdio":
        if tokens is not None:
            raise ValueError("--tokens is for --transport http; a stdio server serves one --user")
        if not user:
            raise ValueError("--transport stdio needs --user USER (the one user this server process serves)")
        return McpScope(user=user)
    if transport != "http":
        raise ValueError(f"--transport must be 'stdio' or 'http', got {transport!r}")
    if user is not None:
        if host not in _LOOPBACK:
            raise ValueError(f"--user over HTTP serves without authentication; only on a loopback --host "
                             f"({', '.join(_LOOPBACK)}), not {host!r}: use --tokens")
        return McpScope(user=user)
    spec = tokens if tokens is not None else (env.get(TOKENS_ENV) or None)
    if spec is None:
        raise ValueError(f"--transport http needs --tokens FILE (or ${TOKENS_ENV}) or a fixed --user")
    return McpScope(tokens=TokenMap.load(spec))


# ---------------------------------------------------------------------- the server
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


_ITEM_REF = re.compile(r"items\[(\d+)\](?:\.id)?")


def _bulk_tool_errors(fn: Callable[[], T], ids: list[str], arg: str) -> T:
    """Run a bulk Memory call for the scoped user; its refusals become tool errors naming
    the tool's argument ``arg`` (``items[i]`` or ``ids[i]``). An id the user does not hold
    (or an unknown user) is "no memory with id", as for one item."""
    try:
        return fn()
    except KeyError as exc:
        i = getattr(exc, "index", None)
        if i is not None:
            raise ToolError(f"{arg}[{i}]: no memory with id {ids[i]!r} (nothing was changed; list_memories or "
                            "search_memories show the ids)") from None
        raise ToolError(str(exc.args[0]) if exc.args else "not found") from None
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        if arg != "items":  # delete_memories(ids): items[i].id is ids[i]
            msg = _ITEM_REF.sub(lambda m: f"{arg}[{m.group(1)}]", msg)
        raise ToolError(f"{msg} (nothing was changed)") from None


def _item_json(item: Item) -> dict[str, Any]:
    # id, text, metadata, created_at (ISO-8601 UTC, or null when unknown), thread, position (null when none)
    return item.to_dict()


def _not_found(item_id: Any) -> ToolError:
    return ToolError(f"id: no memory with id {item_id!r} (list_memories or search_memories show the ids)")


def _check_text_arg(text: str, name: str, what: str = "text") -> None:
    """A text argument checked up front by the Memory's own check (blank, lone
    surrogates, length: :func:`rfmem_fast.serving.validate._check_text`), its message as a
    tool error, so a tool refuses a text with the words of Python and HTTP."""
    try:
        _check_text(text, name, what=what)
    except (TypeError, ValueError) as exc:
        raise ToolError(str(exc)) from None


_ARG_NAME = re.compile(r"^(texts|ids)(\[0\])?(?![\w\[])")


def _tool_errors(fn: Callable[[], T], item_id: Any = None, rename: Mapping[str, str] | None = None) -> T:
    """Run a Memory call, its refusals turned into tool errors naming the argument.

    ``rename`` maps the Memory argument a message starts with (``texts`` / ``ids``,
    ``[0]`` included) to the tool's own (``text`` / ``id``) for one-item tools."""
    try:
        return fn()
    except KeyError as exc:
        if item_id is not None:
            raise _not_found(item_id) from None
        raise ToolError(str(exc.args[0]) if exc.args else "not found") from None
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        if rename:
            msg = _ARG_NAME.sub(lambda m: rename.get(m.group(1), m.group(0)), msg, count=1)
        raise ToolError(msg) from None


#: the JSON type of an argument's value, as an argument error names it
_JSON_TYPES = ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a number"), (list, "a list"),
               (dict, "an object"), (type(None), "null"))
#: pydantic errors about the value's type: the message adds the type sent
_TYPE_ERRORS = frozenset(("int_type", "int_parsing", "string_type", "float_type", "bool_type", "list_type",
                          "dict_type", "int_from_float", "model_type"))


def _json_type(v: Any) -> str:
    """The JSON type of a parsed argument value, with its article ("a string", "null")."""
    return next((name for t, name in _JSON_TYPES if isinstance(v, t)), type(v).__name__)


def _loc(loc: tuple) -> str:
    """A pydantic error location as the argument's path (``texts[1]``, ``items[0].text``),
    without the tags pydantic puts between a union's branches (``list[constrained-str]``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}" if out else part
    return out or "arguments"


def _argument_errors(exc: ValidationError, arguments: Mapping[str, Any]) -> str:
    """The arguments a tool refused, one short clause each: ``k: input should be greater
    than or equal to 1``, ``texts[0]: input should be a valid string (got an integer)``,
    ``query: required``; for an argument of several accepted shapes (a text or a list of
    texts), the errors of the shape the value was sent in."""
    by_arg: dict[Any, list[dict]] = {}
    for err in exc.errors(include_url=False):
        by_arg.setdefault(err["loc"][0] if err["loc"] else None, []).append(err)
    clauses: list[str] = []
    for arg, errs in by_arg.items():
        tags = {e["loc"][1] for e in errs if len(e["loc"]) > 1 and isinstance(e["loc"][1], str)
                and not e["loc"][1].isidentifier()}
        if len(tags) > 1:  # a union: the branch of the value's own shape (a list, or not)
            sent_list = isinstance(arguments.get(arg), list)
            same = [e for e in errs if len(e["loc"]) > 1 and e["loc"][1] in tags
                    and str(e["loc"][1]).startswith("list[") == sent_list]
            errs = same or errs
        for e in errs:
            kind = e.get("type")
            if kind == "missing":
                text = "required"
            elif kind == "extra_forbidden":
                text = "not a field this tool takes"
            else:
                msg = str(e.get("msg", "invalid"))
                text = msg[:1].lower() + msg[1:]
                if kind in _TYPE_ERRORS:
                    text += f" (got {_json_type(e.get('input'))})"
            clause = f"{_loc(tuple(e['loc']))}: {text}"
            if clause not in clauses:
                clauses.append(clause)
    return "; ".join(clauses)


class EncoderLoad:
    """A Memory's text encoder, loaded on a thread of its own beside the server, so that
    the server answers the MCP handshake at once instead of after the model load (~5-10 s
    of CPU: sentence-transformers, the model, the ONNX session).

    Args:
        memory: an open Memory; a vectors-only one, or one whose encoder is loaded
            already, needs no load (:attr:`done` at once).
        start: start the load now (default); False: at :meth:`start` (``create_server``
            starts it once its tools are registered, which takes a second of Python
            that a load beside it would slow down).

    The load is ``memory.encoder`` (:meth:`rfmem_fast.serving.Memory.encoder`) on a daemon
    thread named "rfmem-encoder-load"; an exception there is kept in :attr:`error` and
    printed to stderr (stdout belongs to the protocol on stdio), never raised on the thread.
    """

    def __init__(self, memory: Memory, start: bool = True) -> None:
        self._memory = memory
        self._done = threading.Event()
        #: the exception the load raised (None: loaded, still loading, or nothing to load)
        self.error: BaseException | None = None
        #: seconds the load took (None until it ended)
        self.seconds: float | None = None
        info = memory.encoder_info()
        self._thread: threading.Thread | None = None
        if info is None or info["loaded"]:
            self._done.set()
        elif start:
            self.start()

    def start(self) -> None:
        """Start the load on its thread (once; nothing when there is nothing to load)."""
        if self._thread is not None or self._done.is_set():
            return
        self._thread = threading.Thread(target=self._load, name="rfmem-encoder-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            self._memory.encoder  # noqa: B018 - loads the default encoder(s)
        except BaseException as exc:  # kept for the tools; the thread ends quietly
            self.error = exc
            print(f"rfmem mcp: error: the text encoder could not be loaded: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    @property
    def done(self) -> bool:
        """Whether the load has ended (loaded, failed, or nothing to load)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the load has ended or ``timeout`` seconds passed; returns :attr:`done`
        (False at once for a load never started)."""
        if self._thread is None and not self._done.is_set():
            return False
        return self._done.wait(timeout)

    async def ready(self) -> None:
        """Wait, without blocking the event loop, until the encoder is loaded.

        Raises:
            ToolError: the load failed (the message names the exception; the tools that
                do not embed text still work).
        """
        while not self._done.is_set():
            await anyio.sleep(0.02)
        if self.error is not None:
            raise ToolError(
                f"the text encoder could not be loaded ({type(self.error).__name__}: {self.error}), so texts cannot "
                "be embedded; list_memories, get_memory and delete_memory still work. Fix the encoder options of "
                "rfmem mcp (--encoder, --encoder-backend, --encoder-dtype) and restart it")


class _RFMemMCP(MCPServer):
    """MCPServer whose ``resources/list`` shows the scoped user's memory listing, and whose
    argument errors are short: :meth:`call_tool`."""

    _user_of: Callable[[], str]
    #: the text encoder's background load (:class:`EncoderLoad`)
    encoder_load: EncoderLoad

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        """The SDK's ``call_tool``, with arguments that fail the tool's schema answered by a
        short tool error, one line naming each bad argument (:func:`_argument_errors`:
        ``Error executing tool search_memories: k: input should be a valid integer (got a
        string)``) instead of pydantic's multi-line report (its input values, error types
        and documentation links). Every other failure is the SDK's own.

        Raises:
            ToolError: as ``MCPServer.call_tool`` (the SDK documents it as the override
                point: a ToolError whose ``__cause__`` is the pydantic ``ValidationError``
                of the arguments; the cause is kept, so the server's log still names the
                fields only).
        """
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(cause, ValidationError) and not isinstance(exc, UnexpectedToolError):
                raise ToolError(f"Error executing tool {name}: {_argument_errors(cause, arguments)}") from cause
            raise

    async def list_resources(self) -> list[MCPResource]:
        out = await super().list_resources()
        try:
            user = self._user_of()
        except ToolError:
            return out
        out.append(MCPResource(
            uri=f"memory://{quote(user, safe='')}/memories", name="memories",
            title="Your memories", mime_type="application/json",
            description="Every memory of the current user (id, text, metadata), in the order added.",
        ))
        return out


def create_server(memory: Memory, scope: McpScope, *, url: str = "http://127.0.0.1:8765",
                  name: str = "rfmem") -> MCPServer:
    """An MCP server (the SDK's ``MCPServer``) over ``memory``, every call scoped to one user.

    Args:
        memory: an open :class:`~rfmem_fast.serving.Memory` (the caller closes it).
        scope: the fixed user, or the token map that gives each HTTP client its user.
        url: the server's base URL (the issuer / resource URL of the SDK's auth settings
            when ``scope`` has tokens).
        name: the server name shown to clients.

    Returns:
        the MCPServer: ``.run("stdio")``, or :func:`create_http_app` for HTTP. Its
        ``encoder_load`` (:class:`EncoderLoad`) is the text encoder's load, started here on
        a thread when ``memory``'s default encoder is not loaded yet: the handshake and the
        tools that embed no text answer at once, the others wait for the load.

    Raises:
        TypeError: ``memory`` is not a Memory, ``scope`` not an McpScope.
    """
    if not isinstance(memory, Memory):
        raise TypeError(f"memory must be a rfmem_fast.Memory, got {type(memory).__name__}")
    if not isinstance(scope, McpScope):
        raise TypeError(f"scope must be an McpScope, got {type(scope).__name__}")
    kwargs: dict[str, Any] = {}
    if scope.tokens is not None:
        kwargs = dict(token_verifier=scope.tokens,
                      auth=AuthSettings(issuer_url=url, resource_server_url=None))
    from .. import __version__

    server = _RFMemMCP(
        name, title="rfmem memory", version=__version__,
        instructions="Long-term memory of the current user: store facts with add_memories, recall them with "
        "search_memories before answering questions about the user, fix or remove them with update_memory / "
        "delete_memory. Every tool acts on the current user's memories only.",
        log_level="WARNING", **kwargs,
    )

    def user_of() -> str:
        if scope.user is not None:
            return scope.user
        tok = get_access_token()  # set by the SDK's bearer middleware for this request
        if tok is None:
            raise ToolError("not authenticated: send Authorization: Bearer <token>")
        return tok.client_id

    server._user_of = user_of
    loading = server.encoder_load = EncoderLoad(memory, start=False)  # started below, tools registered

    one = {"texts": "text", "ids": "id"}  # the Memory's argument names -> the one-item tools'

    def lookup(item_id: str, user: str) -> Item:
        return _tool_errors(lambda: memory.get([item_id], user)[0], item_id, one)

    async def in_thread(fn: Callable[[], T]) -> T:
        return await anyio.to_thread.run_sync(fn)

    read_only = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)

    @server.tool(description=_ADD, annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False,
                                                                 idempotent_hint=False, open_world_hint=False))
    async def add_memories(
        texts: Annotated[TextArg | list[TextArg], Field(
            description="one text, or a list of 1 to 256 texts: each becomes one memory")],
        metadata: Annotated[Meta | list[Meta | None] | None, Field(
            description="optional JSON object stored with every text, or one object (or null) per text")] = None,
        thread: Annotated[ThreadArg | list[ThreadArg | None] | None, Field(
            description="optional conversation id (a string or an integer) of every text, or one (or null) per "
                        "text")] = None,
        position: Annotated[PositionArg | list[PositionArg | None] | None, Field(
            description="optional place of each text in its conversation (an integer >= 0, e.g. the turn "
                        "number): one for every text, or one (or null) per text; needs a thread")] = None,
    ) -> dict[str, Any]:
        user = user_of()
        tx = [texts] if isinstance(texts, str) else list(texts)
        if not tx or len(tx) > MAX_TEXTS:
            raise ToolError(f"texts: give 1 to {MAX_TEXTS} texts, got {len(tx)}")
        for i, t in enumerate(tx):
            _check_text_arg(t, f"texts[{i}]" if not isinstance(texts, str) else "texts")
        for name, value in (("metadata", metadata), ("thread", thread), ("position", position)):
            if isinstance(value, list) and len(value) != len(tx):
                raise ToolError(f"{name}: a list needs one entry per text ({len(tx)}), got {len(value)}")
        await loading.ready()
        ids = await in_thread(lambda: _tool_errors(lambda: memory.add(tx, user_id=user, metadata=metadata,
                                                                      thread=thread, position=position)))
        return {"ids": ids, "count": len(ids)}

    @server.tool(description=_SEARCH, annotations=read_only)
    async def search_memories(
        query: Annotated[str, Field(min_length=1, max_length=MAX_TEXT, description="what to look for")],
        k: Annotated[int, Field(strict=True, ge=1, le=MAX_K,
                                description=f"the most memories returned (1 to {MAX_K})")] = 10,
        mode: Annotated[Literal["rfmem", "dense", "recollection"], Field(
            description='"rfmem" (routed, default), "dense" or "recollection"')] = "rfmem",
        filters: Annotated[dict[str, Any] | None, Field(
            description='only memories matching this filter over their metadata and "created_at" '
                        '(e.g. {"source": "chat", "created_at": {"$gte": "2026-11-01T00:00:00Z"}})')] = None,
    ) -> dict[str, Any]:
        user = user_of()
        _check_text_arg(query, "query", what="query")
        await loading.ready()
        try:
            hits: Hits = await memory.asearch(query, user_id=user, k=k, mode=mode, filters=filters)
        except (ValueError, TypeError) as exc:
            raise ToolError(str(exc)) from None
        except (QueueFullError, RequestTimeoutError) as exc:
            raise ToolError(f"the memory is overloaded ({exc}); retry in a moment") from None
        except BatcherClosedError:
            raise ToolError("the memory server is shutting down") from None
        return {
            "hits": [{"id": h.id, "text": h.text, "score": h.score, "metadata": h.metadata, "rank": h.rank,
                      "created_at": None if h.created_at is None else h.created_at.isoformat(),
                      "thread": h.thread, "position": h.position, "context_score": h.context_score} for h in hits],
            "route": hits.route, "mode": mode, "k": k,
        }

    @server.tool(description=_UPDATE, annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True,
                                                                    idempotent_hint=True, open_world_hint=False))
    async def update_memory(
        id: IdArg,
        text: Annotated[str | None, Field(min_length=1, max_length=MAX_TEXT,
                                          description="the new text, or omit to keep")] = None,
        metadata: Annotated[Meta | None, Field(description="metadata replacing the old ({} clears), or omit")] = None,
    ) -> dict[str, Any]:
        user = user_of()
        if text is None and metadata is None:
            raise ToolError("text / metadata: give a new text, new metadata, or both")
        if text is not None:
            _check_text_arg(text, "text")
            await loading.ready()

        def write() -> Item:
            lookup(id, user)  # another user's id is "not found", like a missing one
            _tool_errors(lambda: memory.update([id], user_id=user, texts=None if text is None else [text],
                                               metadata=None if metadata is None else [metadata]), id, one)
            return lookup(id, user)

        return _item_json(await in_thread(write))

    @server.tool(description=_DELETE, annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True,
                                                                    idempotent_hint=False, open_world_hint=False))
    async def delete_memory(id: IdArg) -> dict[str, Any]:
        user = user_of()

        def write() -> None:
            lookup(id, user)
            _tool_errors(lambda: memory.delete([id], user_id=user), id, one)

        await in_thread(write)
        return {"id": id, "deleted": True}

    @server.tool(description=_UPDATE_MANY, annotations=ToolAnnotations(
        read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False))
    async def update_memories(
        items: Annotated[list[MemoryChange], Field(min_length=1, max_length=MAX_TEXTS, description=(
            f"1 to {MAX_TEXTS} changes: each {{id, text?, metadata?}}"))],
    ) -> dict[str, Any]:
        user = user_of()
        ids = [it.id for it in items]
        for i, it in enumerate(items):
            if it.text is None and it.metadata is None:
                raise ToolError(f"items[{i}]: give a new text, new metadata, or both")
            if it.text is not None:
                _check_text_arg(it.text, f"items[{i}].text")
        if any(it.text is not None for it in items):
            await loading.ready()
        changes = [{"user_id": user, "id": it.id, **({"text": it.text} if it.text is not None else {}),
                    **({"metadata": it.metadata} if it.metadata is not None else {})} for it in items]
        await in_thread(lambda: _bulk_tool_errors(lambda: memory.update_many(changes), ids, "items"))
        return {"updated": ids, "count": len(ids)}

    @server.tool(description=_DELETE_MANY, annotations=ToolAnnotations(
        read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=False))
    async def delete_memories(
        ids: Annotated[list[IdArg], Field(min_length=1, max_length=MAX_TEXTS, description=(
            f"1 to {MAX_TEXTS} distinct memory ids"))],
    ) -> dict[str, Any]:
        user = user_of()
        items = [{"user_id": user, "id": i} for i in ids]
        await in_thread(lambda: _bulk_tool_errors(lambda: memory.delete_many(items), ids, "ids"))
        return {"deleted": list(ids), "count": len(ids)}

    @server.tool(description=_LIST, annotations=read_only)
    async def list_memories(
        offset: Annotated[int, Field(strict=True, ge=0, description="memories to skip (>= 0)")] = 0,
        limit: Annotated[int, Field(strict=True, ge=1, le=MAX_PAGE,
                                    description=f"the most memories returned (1 to {MAX_PAGE})")] = 50,
    ) -> dict[str, Any]:
        user = user_of()

        def read() -> tuple[list[Item], int]:  # one page, never the whole listing
            return memory.get_all(user, offset=offset, limit=limit), memory.count(user)

        page, total = await in_thread(lambda: _tool_errors(read))
        nxt = offset + limit if offset + limit < total else None
        return {"memories": [_item_json(i) for i in page], "total": total, "offset": offset, "next_offset": nxt}

    @server.tool(description=_GET, annotations=read_only)
    async def get_memory(id: IdArg) -> dict[str, Any]:
        user = user_of()
        return _item_json(await in_thread(lambda: lookup(id, user)))

    security = ResourceSecurity(exempt_params={"user", "id"})  # not paths: compared / looked up, never opened

    def own(user: str) -> str:
        try:
            me = user_of()
        except ToolError as exc:
            raise ResourceNotFoundError(str(exc)) from None
        if not hmac.compare_digest(user.encode("utf-8"), me.encode("utf-8")):
            raise ResourceNotFoundError("no such resource: this client reads only its own user's memories")
        return me

    @server.resource("memory://{user}/memories", name="memories", title="A user's memories",
                     mime_type="application/json", security=security,
                     description="Every memory of the user (JSON list of {id, text, metadata}, in the order added); "
                     "only the current user's.")
    def memories_resource(user: str) -> str:
        me = own(user)
        return json.dumps([_item_json(i) for i in memory.get_all(me)], ensure_ascii=False)

    @server.resource("memory://{user}/memories/{id}", name="memory", title="One memory",
                     mime_type="application/json", security=security,
                     description="One memory of the user (JSON {id, text, metadata}); only the current user's.")
    def memory_resource(user: str, id: str) -> str:
        me = own(user)
        try:
            item = memory.get([id], me)[0]
        except (KeyError, ValueError, TypeError):
            raise ResourceNotFoundError(f"no memory with id {id!r}") from None
        return json.dumps(_item_json(item), ensure_ascii=False)

    loading.start()  # the model loads beside the server from here on
    return server


def create_http_app(server: MCPServer, host: str = "127.0.0.1") -> Any:
    """The Starlette app of the streamable HTTP transport (endpoint ``/mcp``).

    Args:
        server: from :func:`create_server` (its token map, if any, guards ``/mcp``: 401
            without a known bearer token).
        host: the interface it will listen on (a loopback host turns on the SDK's DNS
            rebinding protection).

    Returns:
        an ASGI app (run it with uvicorn; its lifespan runs the SDK's session manager).
    """
    return server.streamable_http_app(host=host)


def serve_mcp(memory: Memory, scope: McpScope, transport: str = "stdio", host: str = "127.0.0.1",
              port: int = 8765, log_level: str = "warning") -> None:
    """Serve ``memory`` over MCP until the client disconnects (stdio) or SIGINT / SIGTERM (HTTP:
    uvicorn's graceful shutdown; ``rfmem mcp`` also closes the memory on these signals over
    stdio, :func:`rfmem_fast.serving.cli.run_mcp`).

    The handshake is answered at once; a default encoder not loaded yet loads beside the
    server (:class:`EncoderLoad`), and this returns only once that load has ended. The
    caller closes ``memory`` afterwards (which checkpoints it).

    Args:
        memory: an open Memory (:func:`rfmem_fast.serving.cli.open_memory`).
        scope: from :func:`scope_from_options`.
        transport: "stdio" or "http".
        host, port: where the HTTP transport listens.
        log_level: uvicorn's log level (HTTP), on stderr.

    Raises:
        ValueError: an unknown transport.
    """
    if transport not in ("stdio", "http"):
        raise ValueError(f"transport must be 'stdio' or 'http', got {transport!r}")
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 address in brackets
    server = create_server(memory, scope, url=f"http://{netloc}")  # starts the encoder's load beside it
    try:
        if transport == "stdio":
            server.run("stdio")
        else:
            import uvicorn

            app = create_http_app(server, host)
            print(f"rfmem mcp: serving http://{netloc}/mcp", file=sys.stderr, flush=True)
            uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        server.encoder_load.wait()  # a load still running ends before the caller closes the memory
