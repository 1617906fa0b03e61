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

The server is split by concept: :mod:`rfmem_fast.serving.mcp_sdk` (the SDK's names,
imported once, with the install hint when missing), :mod:`rfmem_fast.serving.mcp_scope`
(token maps and the user scope), :mod:`rfmem_fast.serving.mcp_tools` (each tool's
description, argument types and limits), :mod:`rfmem_fast.serving.mcp_errors` (refusals
and schema errors as short tool errors) and :mod:`rfmem_fast.serving.mcp_encoder` (the
encoder's load beside the server); this module registers the tools and resources over
them (:func:`create_server`) and serves them (:func:`serve_mcp`). The names they define
that callers import from here are re-exported.
"""
from __future__ import annotations

import hmac
import json
import sys
from typing import Annotated, Any, Callable, Literal, TypeVar
from urllib.parse import quote

# first: without the SDK, importing this module fails here, with the install hint
from .mcp_sdk import (AuthSettings, Field, MCPResource, MCPServer, ResourceNotFoundError, ResourceSecurity, ToolAnnotations,
                      ToolError, UnexpectedToolError, ValidationError, anyio, get_access_token)
from .batcher import BatcherClosedError, QueueFullError, RequestTimeoutError
from .mcp_encoder import EncoderLoad as EncoderLoad
from .mcp_errors import _argument_errors, _bulk_tool_errors, _check_text_arg, _tool_errors
from .mcp_scope import TOKENS_ENV as TOKENS_ENV
from .mcp_scope import McpScope as McpScope
from .mcp_scope import TokenMap as TokenMap
from .mcp_scope import hash_token as hash_token
from .mcp_scope import scope_from_options as scope_from_options
from .mcp_tools import MAX_ID as MAX_ID
from .mcp_tools import (_ADD, _DELETE, _DELETE_MANY, _GET, _LIST, _SEARCH, _UPDATE, _UPDATE_MANY, MAX_K, MAX_PAGE, MAX_TEXT,
                        MAX_TEXTS, IdArg, MemoryChange, Meta, PositionArg, TextArg, ThreadArg, _item_json)
from .memory import Hits, Item, Memory

__all__ = [
    "TOKENS_ENV", "TokenMap", "McpScope", "hash_token", "scope_from_options", "create_server",
    "create_http_app", "serve_mcp", "EncoderLoad",
]

T = TypeVar("T")


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
