"""``rfmem mcp`` (rfmem_fast.serving.mcp_server), end to end with the mcp SDK's own client:

* over stdio: ``python -m rfmem_fast.cli mcp --transport stdio --user alice`` spawned by the
  SDK's ``stdio_client`` (the real offline MiniLM encoder), a session that adds, searches,
  updates, deletes, reads resources; the store reopened afterwards holds the writes;
* over streamable HTTP: ``rfmem mcp --transport http --tokens FILE`` as a subprocess, the
  SDK's ``streamable_http_client`` with a bearer token; 401 without / with a wrong token;
  SIGKILL after acknowledged writes loses none of them (the write-ahead log);
* user scope: an in-process HTTP server (a tiny deterministic encoder) with users alice and
  bob both seeded; alice's client tries to read, list, search, change and delete bob's
  memories through every tool and resource, and the whole memory is compared after every call.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import numpy as np
import pytest
from _serving_helpers import HashEncoder

pytest.importorskip("mcp")
uvicorn = pytest.importorskip("uvicorn")
import anyio  # noqa: E402
import httpx2  # noqa: E402
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

from rfmem_fast import Memory  # noqa: E402
from rfmem_fast.cli import main as rfmem_main  # noqa: E402
from rfmem_fast.serving.mcp_server import (  # noqa: E402
    McpScope, TokenMap, create_http_app, create_server, hash_token, scope_from_options,
)

ROOT = Path(__file__).resolve().parents[1]
TOOLS = {"add_memories", "search_memories", "update_memory", "delete_memory", "list_memories", "get_memory",
         "update_memories", "delete_memories"}
ALICE_TOKEN, BOB_TOKEN = "alice-token-0123456789", "bob-token-9876543210"
TIMEOUT = 60  # seconds any one client step may take


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _tokens_file(tmp_path: Path) -> Path:
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps({"tokens": [{"user": "alice", "sha256": hash_token(ALICE_TOKEN)},
                                        {"user": "bob", "sha256": hash_token(BOB_TOKEN)}]}))
    return f


def _ok(result) -> dict:
    """The structured answer of a successful tool call."""
    assert not result.is_error, result.content[0].text
    return result.structured_content


def _err(result) -> str:
    """The message of a tool call that must fail (a tool error, not a protocol crash)."""
    assert result.is_error, result.structured_content
    return result.content[0].text


@asynccontextmanager
async def _http_session(url: str, token: str | None):
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(TIMEOUT)) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write, read_timeout_seconds=TIMEOUT) as session:
                await session.initialize()
                yield session


async def _crud_session(session: ClientSession) -> dict:
    """add / search / update / get / list / delete through one client session; returns the ids."""
    tools = (await session.list_tools()).tools
    assert {t.name for t in tools} == TOOLS
    for t in tools:
        assert len(t.description) > 150, t.name  # written for a model: arguments, limits, result
        assert not any("user" in p for p in t.input_schema.get("properties", {})), t.name

    added = _ok(await session.call_tool("add_memories", {
        "texts": ["I moved to Lyon in 2021", "My sister is called Ana", "I am allergic to peanuts"],
        "metadata": {"source": "chat"}}))
    assert added["count"] == 3 and len(set(added["ids"])) == 3
    lyon, ana, peanuts = added["ids"]
    one = _ok(await session.call_tool("add_memories", {"texts": "I play the cello"}))
    assert one["count"] == 1

    found = _ok(await session.call_tool("search_memories", {"query": "Where do I live?", "k": 2, "mode": "dense"}))
    assert found["hits"][0]["id"] == lyon and found["hits"][0]["metadata"] == {"source": "chat"}
    assert len(found["hits"]) == 2 and found["mode"] == "dense" and found["k"] == 2
    routed = _ok(await session.call_tool("search_memories", {"query": "What is my sister's name?"}))
    assert routed["route"] in ("familiarity", "recollection")
    # filtered: exactly the items whose metadata match, inside the top-k (the cello has none)
    chat = _ok(await session.call_tool("search_memories", {"query": "I play the cello", "k": 10, "mode": "dense",
                                                           "filters": {"source": "chat"}}))
    assert sorted(h["id"] for h in chat["hits"]) == sorted([lyon, ana, peanuts])
    none = _ok(await session.call_tool("search_memories", {"query": "Where do I live?", "k": 10, "mode": "dense",
                                                           "filters": {"source": {"$exists": False}}}))
    assert [h["id"] for h in none["hits"]] == one["ids"]
    assert "filters" in _err(await session.call_tool("search_memories", {"query": "x",
                                                                         "filters": {"source": {"$near": 1}}}))

    upd = _ok(await session.call_tool("update_memory", {"id": ana, "text": "My sister is called Ines",
                                                        "metadata": {"source": "correction"}}))
    assert {k: v for k, v in upd.items() if k != "created_at"} == {"id": ana, "text": "My sister is called Ines",
                                                                    "metadata": {"source": "correction"}, "thread": None,
                                                                    "position": None}
    assert _ok(await session.call_tool("get_memory", {"id": ana})) == upd
    assert _ok(await session.call_tool("delete_memory", {"id": peanuts})) == {"id": peanuts, "deleted": True}
    assert "no memory with id" in _err(await session.call_tool("get_memory", {"id": peanuts}))

    page = _ok(await session.call_tool("list_memories", {"limit": 2}))
    assert page["total"] == 3 and [m["id"] for m in page["memories"]] == [lyon, ana] and page["next_offset"] == 2
    last = _ok(await session.call_tool("list_memories", {"offset": 2, "limit": 2}))
    assert [m["id"] for m in last["memories"]] == [one["ids"][0]] and last["next_offset"] is None

    # bad input: a tool error naming the argument, never a crash of the session
    assert "k" in _err(await session.call_tool("search_memories", {"query": "x", "k": 0}))
    assert "mode" in _err(await session.call_tool("search_memories", {"query": "x", "mode": "fuzzy"}))
    assert "query" in _err(await session.call_tool("search_memories", {"k": 3}))
    assert "texts" in _err(await session.call_tool("add_memories", {"texts": []}))
    assert "texts[1]" in _err(await session.call_tool("add_memories", {"texts": ["ok", "   "]}))
    assert "query" in _err(await session.call_tool("search_memories", {"query": " \n"}))
    assert "metadata" in _err(await session.call_tool("add_memories", {"texts": ["a", "b"], "metadata": [{}]}))
    assert "text / metadata" in _err(await session.call_tool("update_memory", {"id": lyon}))
    assert "limit" in _err(await session.call_tool("list_memories", {"limit": 1000}))
    return {"lyon": lyon, "ana": ana, "peanuts": peanuts, "cello": one["ids"][0]}


# ----------------------------------------------------------------------------- stdio
def test_mcp_stdio_session_adds_searches_updates_deletes_and_persists(tmp_path):
    data = tmp_path / "mem"
    params = StdioServerParameters(
        command=sys.executable, cwd=str(ROOT), env=_env(),
        args=["-m", "rfmem_fast.cli", "mcp", "--transport", "stdio", "--user", "alice", "--data-dir", str(data)],
    )

    async def session_run() -> dict:
        with anyio.fail_after(180):
            async with stdio_client(params) as (read, write):
                async with ClientSession(read, write, read_timeout_seconds=TIMEOUT) as session:
                    await session.initialize()
                    ids = await _crud_session(session)
                    listed = (await session.list_resources()).resources
                    assert [str(r.uri) for r in listed] == ["memory://alice/memories"]
                    body = json.loads((await session.read_resource("memory://alice/memories")).contents[0].text)
                    assert [m["id"] for m in body] == [ids["lyon"], ids["ana"], ids["cello"]]
                    one = json.loads((await session.read_resource(f"memory://alice/memories/{ids['ana']}")).contents[0].text)
                    assert one["text"] == "My sister is called Ines"
                    with pytest.raises(MCPError):
                        await session.read_resource("memory://bob/memories")
                    return ids

    ids = anyio.run(session_run)
    # the server process exited when the client closed; every write is in the store
    with Memory(data, encoder=False) as mem:
        items = {i.id: i for i in mem.get_all("alice")}
        assert set(items) == {ids["lyon"], ids["ana"], ids["cello"]}
        assert items[ids["ana"]].text == "My sister is called Ines"
        assert mem.users() == ["alice"]


# ----------------------------------------------------------------------------- HTTP (the CLI process)
def _start_http(data: Path, port: int, tokens: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rfmem_fast.cli", "mcp", "--transport", "http", "--host", "127.0.0.1",
           "--port", str(port), "--data-dir", str(data), "--tokens", str(tokens)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, **_env()), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"rfmem mcp exited: {proc.stdout.read().decode()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("rfmem mcp --transport http did not listen")


def test_mcp_http_bearer_session_and_sigkill_keeps_acknowledged_writes(tmp_path):
    data, port = tmp_path / "mem", _free_port()
    proc = _start_http(data, port, _tokens_file(tmp_path))
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
        hdr = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        assert httpx2.post(url, json=init, headers=hdr, timeout=10).status_code == 401
        bad = dict(hdr, Authorization="Bearer not-a-token")
        assert httpx2.post(url, json=init, headers=bad, timeout=10).status_code == 401

        async def run() -> dict:
            with anyio.fail_after(180):
                async with _http_session(url, ALICE_TOKEN) as session:
                    return await _crud_session(session)

        ids = anyio.run(run)
    finally:
        proc.send_signal(signal.SIGKILL)  # no checkpoint: the write-ahead log must hold every write
        proc.wait(30)
        proc.stdout.close()
    with Memory(data, encoder=False) as mem:
        items = {i.id: i for i in mem.get_all("alice")}
        assert set(items) == {ids["lyon"], ids["ana"], ids["cello"]}
        assert items[ids["ana"]].metadata == {"source": "correction"}


@pytest.mark.parametrize("transport, sig", [("stdio", signal.SIGTERM), ("stdio", signal.SIGINT),
                                             ("http", signal.SIGTERM)])
def test_rfmem_mcp_checkpoints_the_memory_on_sigterm_and_ctrl_c(tmp_path, transport, sig):
    """As ``rfmem serve``: SIGTERM (or Ctrl-C) closes the memory before the process ends, so
    the directory reopens from its store with an empty write-ahead log (nothing to replay):
    the writes logged before the start and a write made through the server are all there."""
    data = tmp_path / "mem"
    mem = Memory(data, encoder=False, dim=8, batching=False)
    mem.add(None, "alice", vectors=np.eye(8)[:3], ids=["a", "b", "c"])
    crash(mem)  # the writes are in the log only: the server replays them, then must checkpoint them
    cmd = [sys.executable, "-m", "rfmem_fast.cli", "mcp", "--transport", transport, "--user", "alice",
           "--data-dir", str(data), "--encoder", "none"]
    port = _free_port()
    if transport == "http":
        cmd += ["--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, **_env()), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if transport == "stdio":  # the protocol by hand: initialize, then one write through a tool
            def rpc(msg: dict) -> None:
                proc.stdin.write((json.dumps({"jsonrpc": "2.0", **msg}) + "\n").encode())
                proc.stdin.flush()

            rpc({"id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                                             "clientInfo": {"name": "t", "version": "0"}}})
            assert json.loads(proc.stdout.readline())["id"] == 1
            rpc({"method": "notifications/initialized"})
            rpc({"id": 2, "method": "tools/call", "params": {"name": "delete_memory", "arguments": {"id": "a"}}})
            answer = json.loads(proc.stdout.readline())
            assert answer["id"] == 2 and answer["result"]["structuredContent"] == {"id": "a", "deleted": True}
        else:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, "rfmem mcp did not listen"
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)

            async def delete() -> None:
                with anyio.fail_after(60):
                    async with _http_session(f"http://127.0.0.1:{port}/mcp", None) as session:
                        assert _ok(await session.call_tool("delete_memory", {"id": "a"}))["deleted"]

            anyio.run(delete)
        proc.send_signal(sig)
        assert proc.wait(60) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
    assert (data / "wal.jsonl").stat().st_size == 0  # checkpointed on the way out
    with Memory(data, encoder=False) as again:
        assert again.stats()["replayed"] == 0 and [i.id for i in again.get_all("alice")] == ["b", "c"]


def crash(mem: Memory) -> None:
    """Drop ``mem`` as a killed process would (its lock released, no checkpoint)."""
    mem._lock_file.close()


# ----------------------------------------------------------------------------- user scope
@contextmanager
def _serve_in_thread(mem: Memory, scope: McpScope):
    """The streamable HTTP app of ``create_server(mem, scope)`` under uvicorn in a thread, on a
    free loopback port; yields the endpoint URL, stops the server on exit."""
    port = _free_port()
    app = create_http_app(create_server(mem, scope, url=f"http://127.0.0.1:{port}"), "127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the MCP server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def two_users(tmp_path):
    """An in-process HTTP MCP server over a durable Memory holding alice's and bob's memories."""
    mem = Memory(tmp_path / "mem", encoder=HashEncoder(16), max_wait_ms=1.0)
    mem.add(["alice: I live in Lyon", "alice: shared id"], user_id="alice", ids=["a1", "same"])
    mem.add(["bob: my bank PIN is 4321", "bob: I live in Oslo", "bob: shared id"], user_id="bob",
            ids=["b1", "b2", "same"], metadata={"secret": True})
    scope = McpScope(tokens=TokenMap([(hash_token(ALICE_TOKEN), "alice"), (hash_token(BOB_TOKEN), "bob")]))
    try:
        with _serve_in_thread(mem, scope) as url:
            yield mem, url
    finally:
        mem.close()


def _snapshot(mem: Memory) -> dict:
    return {u: [i.to_dict() for i in mem.get_all(u)] for u in sorted(mem.users())}


def test_mcp_scope_alice_cannot_read_list_search_change_or_delete_bobs_memories(two_users):
    mem, url = two_users
    bob_before = _snapshot(mem)["bob"]
    bob_texts = {i["text"] for i in bob_before}

    async def run() -> None:
        with anyio.fail_after(120):
            async with _http_session(url, ALICE_TOKEN) as alice, _http_session(url, BOB_TOKEN) as bob:
                state = _snapshot(mem)

                async def call(tool: str, args: dict, fails: bool = False) -> dict | str:
                    """alice calls a tool; afterwards bob's memories are exactly as seeded, and alice's
                    changed only where the call says (the caller updates ``state``)."""
                    res = await alice.call_tool(tool, args)
                    out = _err(res) if fails else _ok(res)
                    assert json.dumps(out, default=str).find("bob:") < 0, (tool, out)
                    now = _snapshot(mem)
                    assert now["bob"] == bob_before, (tool, args)
                    return out, now

                # reads: nothing of bob's comes back, nothing changes
                for mode in ("rfmem", "dense", "recollection"):
                    for q in sorted(bob_texts):
                        out, now = await call("search_memories", {"query": q, "k": 100, "mode": mode})
                        assert {h["id"] for h in out["hits"]} <= {"a1", "same"} and now == state
                out, now = await call("list_memories", {"limit": 200})
                assert [m["id"] for m in out["memories"]] == ["a1", "same"] and out["total"] == 2 and now == state
                for bid in ("b1", "b2"):
                    for tool, args in (("get_memory", {"id": bid}), ("delete_memory", {"id": bid}),
                                       ("update_memory", {"id": bid, "text": "pwned", "metadata": {}}),
                                       ("delete_memories", {"ids": ["a1", bid]}),
                                       ("update_memories", {"items": [{"id": "a1", "text": "pwned"},
                                                                      {"id": bid, "metadata": {}}]})):
                        msg, now = await call(tool, args, fails=True)
                        assert "no memory with id" in msg and now == state  # all or nothing: a1 unchanged too
                # a user argument is not part of any tool: it is ignored, the scope stays alice
                msg, now = await call("get_memory", {"id": "b1", "user_id": "bob", "user": "bob"}, fails=True)
                assert now == state
                # the same id held by both users: alice reaches only her own item
                out, now = await call("get_memory", {"id": "same"})
                assert out["text"] == "alice: shared id" and now == state
                out, now = await call("update_memory", {"id": "same", "text": "alice: edited"})
                assert out["text"] == "alice: edited"
                assert [i["text"] for i in now["alice"]] == ["alice: I live in Lyon", "alice: edited"]
                state = now
                out, now = await call("delete_memory", {"id": "same"})
                assert [i["id"] for i in now["alice"]] == ["a1"]
                state = now
                out, now = await call("add_memories", {"texts": ["alice: tea, not coffee"]})
                assert [i["id"] for i in now["alice"]] == ["a1", out["ids"][0]]
                state = now
                # resources: bob's listing and items are refused, as is bob's id under alice
                for uri in ("memory://bob/memories", "memory://bob/memories/b1", "memory://alice/memories/b1",
                            "memory://bob/memories/same"):
                    with pytest.raises(MCPError):
                        await alice.read_resource(uri)
                    assert _snapshot(mem) == state
                listed = [str(r.uri) for r in (await alice.list_resources()).resources]
                assert listed == ["memory://alice/memories"]
                own = json.loads((await alice.read_resource(listed[0])).contents[0].text)
                assert own == state["alice"]
                own = json.loads((await alice.read_resource("memory://alice/memories/a1")).contents[0].text)
                assert own == state["alice"][0]
                # bob, connected at the same time, sees his own memories only
                got = _ok(await bob.call_tool("list_memories", {}))
                assert [m["id"] for m in got["memories"]] == ["b1", "b2", "same"]
                hits = _ok(await bob.call_tool("search_memories", {"query": "alice: I live in Lyon", "k": 10}))
                assert {h["id"] for h in hits["hits"]} <= {"b1", "b2", "same"}
                assert _snapshot(mem) == state

    anyio.run(run)


def test_mcp_http_session_is_bound_to_its_token(two_users):
    """Bob's token on alice's HTTP session id is refused (the SDK binds a session to its principal)."""
    _mem, url = two_users
    hdr = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
    r = httpx2.post(url, json=init, headers=dict(hdr, Authorization=f"Bearer {ALICE_TOKEN}"), timeout=10)
    assert r.status_code == 200
    sid = r.headers["mcp-session-id"]
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "list_memories", "arguments": {}}}
    session = dict(hdr, **{"mcp-session-id": sid, "mcp-protocol-version": "2025-06-18"})
    r = httpx2.post(url, json=call, headers=dict(session, Authorization=f"Bearer {BOB_TOKEN}"), timeout=10)
    assert r.status_code in (401, 403, 404), r.text
    assert "bob:" not in r.text and "alice:" not in r.text
    # the same request with the session's own token is answered (alice's memories only)
    r = httpx2.post(url, json=call, headers=dict(session, Authorization=f"Bearer {ALICE_TOKEN}"), timeout=10)
    assert r.status_code == 200 and "alice: I live in Lyon" in r.text and "bob:" not in r.text, r.text


def test_mcp_bulk_update_and_delete_tools_all_or_nothing(two_users):
    """update_memories / delete_memories over a real client session: many of the scoped
    user's memories in one write; a bad item (named by its index) changes nothing."""
    mem, url = two_users
    mem.add(["alice: one", "alice: two", "alice: three"], user_id="alice", ids=["x1", "x2", "x3"])

    async def run() -> None:
        with anyio.fail_after(120):
            async with _http_session(url, ALICE_TOKEN) as alice:
                before = _snapshot(mem)
                for args, where in (
                    ({"items": [{"id": "x1", "text": "ok"}, {"id": "x2"}]}, "items[1]"),
                    ({"items": [{"id": "x1", "text": "ok"}, {"id": "x2", "text": "  "}]}, "items[1].text"),
                    ({"items": [{"id": "x1", "text": "ok"}, {"id": "x1", "metadata": {}}]}, "items[1].id"),
                    ({"items": [{"id": "x1", "text": "ok"}, {"id": "nope", "text": "x"}]}, "items[1]: no memory with id"),
                    ({"items": [{"id": "x1", "text": "ok", "user_id": "bob"}]}, "user_id"),
                    ({"items": []}, "items"),
                ):
                    msg = _err(await alice.call_tool("update_memories", args))
                    assert where in msg, (args, msg)
                    assert _snapshot(mem) == before
                for args, where in (({"ids": ["x1", "nope"]}, "ids[1]: no memory with id 'nope'"),
                                    ({"ids": ["x1", "x1"]}, "ids[1]"), ({"ids": []}, "ids")):
                    assert where in _err(await alice.call_tool("delete_memories", args))
                    assert _snapshot(mem) == before
                out = _ok(await alice.call_tool("update_memories", {"items": [
                    {"id": "x1", "text": "alice: one, edited"}, {"id": "x2", "metadata": {"k": 2}},
                    {"id": "x3", "text": "alice: three, edited", "metadata": {"k": 3}}]}))
                assert out == {"updated": ["x1", "x2", "x3"], "count": 3}
                got = {i.id: (i.text, i.metadata) for i in mem.get_all("alice")}
                assert got["x1"] == ("alice: one, edited", {}) and got["x2"] == ("alice: two", {"k": 2})
                assert got["x3"] == ("alice: three, edited", {"k": 3})
                hits = _ok(await alice.call_tool("search_memories", {"query": "alice: one, edited", "k": 1, "mode": "dense"}))
                assert hits["hits"][0]["id"] == "x1"
                out = _ok(await alice.call_tool("delete_memories", {"ids": ["x1", "x3"]}))
                assert out == {"deleted": ["x1", "x3"], "count": 2}
                assert [i.id for i in mem.get_all("alice")] == ["a1", "same", "x2"]
                assert _snapshot(mem)["bob"] == before["bob"]

    anyio.run(run)


# ----------------------------------------------------------------------------- configuration
def test_token_map_hashes_and_compares_every_entry(tmp_path):
    tm = TokenMap.load(str(_tokens_file(tmp_path)))
    assert len(tm) == 2 and tm.user_for(ALICE_TOKEN) == "alice" and tm.user_for(BOB_TOKEN) == "bob"
    assert tm.user_for("alice") is None and tm.user_for("") is None
    assert TokenMap.load(json.dumps([{"user": "u", "sha256": "sha256:" + hash_token("t").upper()}])).user_for("t") == "u"
    for bad, part in (([], "no tokens"), ([{"user": "u", "sha256": "abc"}], "tokens[0].sha256"),
                      ([{"user": "", "sha256": hash_token("t")}], "tokens[0].user"),
                      ([{"user": "u", "token": "t"}], "tokens[0]"),
                      ([{"user": "u", "sha256": hash_token("t")}, {"user": "v", "sha256": hash_token("t")}], "tokens[1]")):
        with pytest.raises(ValueError, match=part.replace("[", r"\[").replace("]", r"\]")):
            TokenMap.from_json(bad)


def test_scope_options(tmp_path):
    tokens = str(_tokens_file(tmp_path))
    assert scope_from_options("stdio", user="alice").user == "alice"
    assert scope_from_options("http", user="alice", host="127.0.0.1").user == "alice"
    assert scope_from_options("http", tokens=tokens).tokens.user_for(BOB_TOKEN) == "bob"
    assert scope_from_options("http", environ={"RFMEM_MCP_TOKENS": tokens}).tokens is not None
    for kwargs, msg in ((dict(transport="stdio"), "--user"), (dict(transport="stdio", tokens=tokens), "--tokens"),
                        (dict(transport="http", environ={}), "--tokens"),
                        (dict(transport="http", user="a", host="0.0.0.0"), "loopback")):
        with pytest.raises(ValueError, match=msg):
            scope_from_options(**kwargs)


def test_rfmem_mcp_configuration_errors_exit_2(tmp_path, capsys):
    assert rfmem_main(["mcp", "--data-dir", str(tmp_path / "m"), "--transport", "stdio"]) == 2
    assert "--user" in capsys.readouterr().err
    assert rfmem_main(["mcp", "--data-dir", str(tmp_path / "m"), "--transport", "http",
                       "--tokens", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # refused before the memory is opened


def test_mcp_docs_commands_and_client_configs_parse():
    """The README's "MCP server" section and docs/guides/mcp.md: their ``rfmem mcp`` commands
    parse, their ``mcpServers`` configurations are JSON whose stdio args parse, every tool is named."""
    import re
    import shlex

    from rfmem_fast.cli import build_parser

    readme = re.search(r"^## MCP server\n.*?(?=^## )", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)
    guide = (ROOT / "docs" / "guides" / "mcp.md").read_text(encoding="utf-8")
    assert readme, "README.md has no '## MCP server' section"
    assert set(re.findall(r"^\| `(\w+)` \|", guide, re.M)) == TOOLS  # the guide's tool table
    for section in (readme.group(0), guide):
        assert "```python" not in section  # (tests/test_readme.py would run it)
        assert all(f"`{t}" in section for t in TOOLS)
        commands = [ln for b in re.findall(r"```bash\n(.*?)```", section, re.S) for ln in b.splitlines()
                    if ln.startswith("rfmem mcp")]
        assert len(commands) == 2
        for line in commands:
            args = build_parser().parse_args(shlex.split(line, comments=True)[1:])
            assert args.command == "mcp" and args.func.__name__ == "run_mcp"
            assert (args.user is None) != (args.tokens is None)
        configs = [json.loads(b)["mcpServers"]["rfmem"] for b in re.findall(r"```json\n(.*?)```", section, re.S)]
        stdio, http = configs
        assert stdio["command"] == "rfmem" and build_parser().parse_args(stdio["args"]).user == "alice"
        assert http["url"].endswith("/mcp") and http["headers"]["Authorization"].startswith("Bearer ")


def test_mcp_help_and_the_frameworks_guide_claim_only_what_the_mcp_server_serves(capsys):
    """``rfmem mcp --help`` speaks of no HTTP endpoint the MCP server lacks (/health, /metrics,
    HTTP statuses), where ``rfmem serve --help`` keeps them; the frameworks guide's MCP
    section points at the MCP guide and its command parses."""
    import re
    import shlex

    from rfmem_fast.cli import build_parser

    for command, has in (("mcp", False), ("serve", True)):
        with pytest.raises(SystemExit):
            rfmem_main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for claim in ("/health", "/metrics", "503", "504"):
            assert (claim in text) is has, (command, claim)
    section = re.search(r"^## MCP\n.*", (ROOT / "docs" / "guides" / "frameworks.md").read_text(encoding="utf-8"),
                        re.S | re.M).group(0)
    assert "](mcp.md)" in section and "/health" in section  # says there is none
    commands = [ln for b in re.findall(r"```bash\n(.*?)```", section, re.S) for ln in b.splitlines()
                if ln.startswith("rfmem mcp")]
    assert commands and all(build_parser().parse_args(shlex.split(c)[1:]).func.__name__ == "run_mcp" for c in commands)


def test_rfmem_mcp_warns_that_a_fixed_user_over_http_is_unauthenticated(tmp_path, capsys, monkeypatch):
    """``--transport http --user U``: a warning on stderr that the endpoint has no
    authentication; none with --tokens or over stdio (a client's own subprocess)."""
    from rfmem_fast.serving import mcp_server

    served = []
    monkeypatch.setattr(mcp_server, "serve_mcp", lambda memory, scope, **kw: served.append((scope, kw["transport"])))
    base = ["mcp", "--encoder", "none", "--dim", "8", "--keep-omp-wait-policy"]
    assert rfmem_main(base + ["--data-dir", str(tmp_path / "a"), "--transport", "http", "--user", "alice",
                              "--port", "8799"]) == 0
    err = capsys.readouterr().err
    assert "rfmem mcp: WARNING: --user over HTTP serves WITHOUT authentication" in err
    assert "http://127.0.0.1:8799/mcp" in err and "'alice'" in err and "--tokens" in err
    assert rfmem_main(base + ["--data-dir", str(tmp_path / "b"), "--transport", "stdio", "--user", "alice"]) == 0
    assert rfmem_main(base + ["--data-dir", str(tmp_path / "c"), "--transport", "http",
                              "--tokens", str(_tokens_file(tmp_path))]) == 0
    assert "WARNING" not in capsys.readouterr().err
    assert [(s.user, t) for s, t in served] == [("alice", "http"), ("alice", "stdio"), (None, "http")]


def test_mcp_numbers_are_strict_and_argument_errors_are_one_short_line():
    """Integer arguments are strict (``"k": "5"``, 5.0 and true are refused, not read as 5 / 1,
    as over HTTP); an argument that fails the tool's schema is answered by ONE short line
    naming it (no pydantic report: no "validation error for", error types, input values or
    links), for the shape the value was sent in."""
    from mcp.server.mcpserver.exceptions import ToolError

    mem = Memory(encoder=HashEncoder(16), batching=False)
    mem.add(["alice: fact"], "alice", ids=["a"])
    server = create_server(mem, McpScope(user="alice"))

    def call(tool: str, args: dict):
        async def go():
            return await server.call_tool(tool, args)
        return anyio.run(go)

    cases = [
        ("search_memories", {"query": "x", "k": "5"}, "k: input should be a valid integer (got a string)"),
        ("search_memories", {"query": "x", "k": 5.0}, "k: input should be a valid integer (got a number)"),
        ("search_memories", {"query": "x", "k": True}, "k: input should be a valid integer (got a boolean)"),
        ("search_memories", {"query": "x", "k": 0}, "k: input should be greater than or equal to 1"),
        ("search_memories", {"k": 3}, "query: required"),
        ("search_memories", {"query": "x", "mode": "fuzzy"}, "mode: input should be 'rfmem', 'dense' or 'recollection'"),
        ("list_memories", {"limit": "3"}, "limit: input should be a valid integer (got a string)"),
        ("list_memories", {"offset": 1.0}, "offset: input should be a valid integer (got a number)"),
        ("add_memories", {"texts": ["ok", 1]}, "texts[1]: input should be a valid string (got an integer)"),
        ("add_memories", {"texts": 5}, "texts: input should be a valid string (got an integer)"),
        ("update_memories", {"items": [{"id": "a", "bogus": 1}]}, "items[0].bogus: not a field this tool takes"),
        ("get_memory", {"id": True}, "id: input should be a valid string (got a boolean)"),
    ]
    try:
        for tool, args, clause in cases:
            with pytest.raises(ToolError) as err:
                call(tool, args)
            assert str(err.value) == f"Error executing tool {tool}: {clause}", (tool, args)
        assert call("search_memories", {"query": "alice: fact", "k": 2}).structured_content["k"] == 2
        assert call("list_memories", {"offset": 0, "limit": 1}).structured_content["total"] == 1
    finally:
        mem.close()


def test_rfmem_mcp_on_a_locked_directory_and_a_bad_dtype_exit_2(tmp_path, capsys):
    from rfmem_fast.serving.cli import open_memory

    mem = Memory(tmp_path / "m", encoder=False, dim=16)
    try:
        assert rfmem_main(["mcp", "--data-dir", str(tmp_path / "m"), "--user", "u", "--encoder", "none",
                           "--keep-omp-wait-policy"]) == 2
        err = capsys.readouterr().err
        assert "rfmem mcp: error:" in err and "LOCK" in err and "Traceback" not in err
    finally:
        mem.close()
    with pytest.raises(ValueError, match="encoder_dtype must be one of"):
        open_memory(str(tmp_path / "n"), encoder_dtype="fp8")
    assert not (tmp_path / "n").exists()


def test_mcp_http_with_a_fixed_user_needs_no_token(tmp_path):
    """``--user`` over HTTP (loopback only): every client is that user, no bearer token."""
    mem = Memory(tmp_path / "mem", encoder=HashEncoder(16), max_wait_ms=1.0)
    mem.add(["bob: secret"], user_id="bob")
    try:
        with _serve_in_thread(mem, McpScope(user="alice")) as url:

            async def run() -> None:
                with anyio.fail_after(60):
                    async with _http_session(url, None) as session:
                        ids = _ok(await session.call_tool("add_memories", {"texts": ["alice: hi"]}))["ids"]
                        got = _ok(await session.call_tool("list_memories", {}))
                        assert [m["id"] for m in got["memories"]] == ids

            anyio.run(run)
        assert [i.text for i in mem.get_all("alice")] == ["alice: hi"]
        assert [i.text for i in mem.get_all("bob")] == ["bob: secret"]
    finally:
        mem.close()


def test_mcp_id_model_paged_listing_and_memory_validation(tmp_path, monkeypatch):
    """Ids are Memory's: int ids written from Python are reached as their decimal string (a
    JSON integer id too); list_memories reads one page (get_all with offset / limit, count),
    never the whole listing; Memory's refusals come back naming the tool's own argument."""
    mem = Memory(tmp_path / "mem", encoder=HashEncoder(16), max_wait_ms=1.0)
    mem.add([f"alice: fact {i}" for i in range(5)], user_id="alice", ids=[7, 8, 9, 10, 11])
    pages = []
    real_get_all = mem.get_all

    def get_all(user, offset=0, limit=None):
        pages.append((offset, limit))
        return real_get_all(user, offset=offset, limit=limit)

    monkeypatch.setattr(mem, "get_all", get_all)
    try:
        with _serve_in_thread(mem, McpScope(user="alice")) as url:

            async def run() -> None:
                with anyio.fail_after(60):
                    async with _http_session(url, None) as session:
                        assert _ok(await session.call_tool("get_memory", {"id": "7"}))["text"] == "alice: fact 0"
                        assert _ok(await session.call_tool("get_memory", {"id": 8}))["id"] == "8"
                        page = _ok(await session.call_tool("list_memories", {"offset": 1, "limit": 2}))
                        assert [m["id"] for m in page["memories"]] == ["8", "9"]
                        assert page["total"] == 5 and page["next_offset"] == 3
                        assert pages == [(1, 2)]
                        assert "text is empty or whitespace only" in _err(await session.call_tool(
                            "update_memory", {"id": 7, "text": " "}))
                        msg = _err(await session.call_tool("get_memory", {"id": "a\x1fb"}))
                        assert "get_memory: id holds the character U+001F" in msg, msg
                        assert "no memory with id '12'" in _err(await session.call_tool("delete_memory", {"id": 12}))
                        assert "id" in _err(await session.call_tool("get_memory", {"id": True}))
                        hits = _ok(await session.call_tool("search_memories", {"query": "alice: fact 2", "k": 1}))
                        assert hits["hits"][0]["id"] == "9"

            anyio.run(run)
    finally:
        mem.close()


def test_mcp_hits_show_their_time_and_a_blank_text_gets_the_message_of_python_and_http(tmp_path):
    """search_memories hits carry ``created_at`` (ISO-8601 UTC, as Python's ``Hit.created_at``);
    a blank text or query is refused with the Memory's own words on all three surfaces."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rfmem_fast.serving.app import create_app

    mem = Memory(tmp_path / "mem", encoder=HashEncoder(16), max_wait_ms=1.0)
    mem.add(["alice: I live in Lyon", "alice: I like tea"], user_id="alice", ids=["lyon", "tea"],
            created_at=["2026-03-29T03:30:00+02:00", 1767225600])
    want = {"lyon": "2026-03-29T01:30:00+00:00", "tea": "2026-01-01T00:00:00+00:00"}
    assert {h.id: h.created_at.isoformat() for h in mem.search("alice: I live in Lyon", "alice", k=2)} == want
    python = {}
    with pytest.raises(ValueError) as err:
        mem.add(["ok", " \n "], "alice")
    python["texts"] = str(err.value)
    with pytest.raises(ValueError) as err:
        mem.search(" \n ", "alice")
    python["query"] = str(err.value)
    with pytest.raises(ValueError) as err:
        mem.update_many([{"user_id": "alice", "id": "tea", "text": "green tea"},
                         {"user_id": "alice", "id": "lyon", "text": "\t"}])
    python["items"] = str(err.value)
    assert python == {"texts": "texts[1] is empty or whitespace only: a text needs some words",
                      "query": "query is empty or whitespace only: a query needs some words",
                      "items": "items[1].text is empty or whitespace only: a text needs some words"}
    with TestClient(create_app(mem, no_auth=True)) as c:
        http = {"texts": c.post("/v1/users/alice/memories", json={"texts": ["ok", " \n "]}).json()["detail"],
                "query": c.post("/v1/users/alice/search", json={"query": " \n "}).json()["detail"]}
        bulk = c.post("/v1/memories:batchUpdate", json={"items": [{"user_id": "alice", "id": "tea", "text": "green tea"},
                                                                  {"user_id": "alice", "id": "lyon", "text": "\t"}]})
        http["items"] = bulk.json()["detail"][0]["msg"]
        hits = c.post("/v1/users/alice/search", json={"query": "alice: I live in Lyon", "k": 2}).json()["hits"]
        assert {h["id"]: h["created_at"] for h in hits} == want
    assert http == python
    try:
        with _serve_in_thread(mem, McpScope(user="alice")) as url:

            async def run() -> dict:
                with anyio.fail_after(60):
                    async with _http_session(url, None) as session:
                        found = _ok(await session.call_tool("search_memories", {"query": "alice: I live in Lyon", "k": 2}))
                        assert {h["id"]: h["created_at"] for h in found["hits"]} == want
                        return {
                            "texts": _err(await session.call_tool("add_memories", {"texts": ["ok", " \n "]})),
                            "query": _err(await session.call_tool("search_memories", {"query": " \n "})),
                            "items": _err(await session.call_tool("update_memories", {"items": [
                                {"id": "tea", "text": "green tea"}, {"id": "lyon", "text": "\t"}]})),
                        }

            mcp = anyio.run(run)
    finally:
        mem.close()
    for k, msg in python.items():  # the SDK puts "Error executing tool NAME: " before a tool's message
        assert mcp[k].endswith(f": {msg}"), (k, mcp[k])
    with Memory(tmp_path / "mem", encoder=HashEncoder(16)) as again:  # the refused calls wrote nothing
        assert [i.text for i in again.get(["tea", "lyon"], "alice")] == ["alice: I like tea", "alice: I live in Lyon"]
        assert again.count("alice") == 2


# ----------------------------------------------------------------------------- start-up: the encoder loads beside
def test_mcp_answers_the_handshake_while_the_encoder_loads_and_text_tools_wait(tmp_path, monkeypatch):
    """The default encoder loads on a thread beside the server (create_server starts it):
    initialize, tools/list, list_memories and get_memory answer while the load is held;
    search_memories / add_memories wait for it and then answer."""
    import rfmem_fast.serving.memory as memory_mod

    gate, started = threading.Event(), threading.Event()
    loads: list[str] = []

    def slow_default(**kwargs):  # the model load, held until the test lets it go
        loads.append(threading.current_thread().name)
        started.set()
        assert gate.wait(60)
        return HashEncoder(16)

    monkeypatch.setattr(memory_mod, "_default_encoder", slow_default)
    with Memory(tmp_path / "seed", encoder=HashEncoder(16)) as seed:
        seed.add(["alice: I live in Lyon"], user_id="alice", ids=["a1"])
    mem = Memory(tmp_path / "seed", dim=16, max_wait_ms=1.0)  # default encoder: not loaded
    assert mem.encoder_info()["loaded"] is False
    try:
        with _serve_in_thread(mem, McpScope(user="alice")) as url:

            async def run() -> None:
                with anyio.fail_after(60):
                    async with _http_session(url, None) as session:  # initialize answered
                        assert started.wait(10) and not gate.is_set()
                        assert {t.name for t in (await session.list_tools()).tools} == TOOLS
                        listed = _ok(await session.call_tool("list_memories", {}))
                        assert [m["id"] for m in listed["memories"]] == ["a1"]
                        assert _ok(await session.call_tool("get_memory", {"id": "a1"}))["text"] == "alice: I live in Lyon"
                        found: dict = {}

                        async def search() -> None:
                            found.update(_ok(await session.call_tool(
                                "search_memories", {"query": "alice: I live in Lyon", "k": 1, "mode": "dense"})))

                        async with anyio.create_task_group() as tg:
                            tg.start_soon(search)
                            await anyio.sleep(0.5)
                            assert not found and mem.encoder_info()["loaded"] is False  # waiting for the load
                            gate.set()
                        assert [h["id"] for h in found["hits"]] == ["a1"]
                        assert _ok(await session.call_tool("add_memories", {"texts": "alice: a cello"}))["count"] == 1

            anyio.run(run)
    finally:
        gate.set()
        mem.close()
    assert loads == ["rfmem-encoder-load"]  # loaded once, on the loader thread


def test_mcp_encoder_load_failure_is_a_clear_tool_error(tmp_path, monkeypatch):
    """A load that fails: the tools that embed text answer a tool error naming the cause;
    list / get / delete still work."""
    import rfmem_fast.serving.memory as memory_mod

    def broken(**kwargs):
        raise FileNotFoundError("no model at /nowhere")

    monkeypatch.setattr(memory_mod, "_default_encoder", broken)
    with Memory(tmp_path / "m", encoder=HashEncoder(16)) as seed:
        seed.add(["alice: one", "alice: two"], user_id="alice", ids=["a1", "a2"])
    mem = Memory(tmp_path / "m", dim=16, max_wait_ms=1.0)
    try:
        with _serve_in_thread(mem, McpScope(user="alice")) as url:

            async def run() -> None:
                with anyio.fail_after(60):
                    async with _http_session(url, None) as session:
                        for tool, args in (("search_memories", {"query": "one"}), ("add_memories", {"texts": "x"}),
                                           ("update_memory", {"id": "a1", "text": "new"}),
                                           ("update_memories", {"items": [{"id": "a1", "text": "new"}]})):
                            msg = _err(await session.call_tool(tool, args))
                            assert "text encoder could not be loaded" in msg and "no model at /nowhere" in msg, tool
                        assert _ok(await session.call_tool("list_memories", {}))["total"] == 2
                        assert _ok(await session.call_tool("update_memory", {"id": "a1", "metadata": {"k": 1}}))
                        assert _ok(await session.call_tool("delete_memory", {"id": "a2"}))["deleted"] is True

            anyio.run(run)
    finally:
        mem.close()
    with Memory(tmp_path / "m", encoder=False) as after:
        assert [(i.id, i.text, i.metadata) for i in after.get_all("alice")] == [("a1", "alice: one", {"k": 1})]


def test_rfmem_mcp_serves_before_loading_the_encoder(tmp_path, monkeypatch):
    """``rfmem mcp`` opens the Memory (a locked directory still exits 2 at once) and hands
    it to the server with the default encoder not loaded: the server's thread loads it."""
    import rfmem_fast.serving.mcp_server as mcp_mod
    import rfmem_fast.serving.memory as memory_mod

    events: list[str] = []

    def default(**kwargs):
        events.append("load")
        return HashEncoder(384)

    def fake_serve(memory, scope, **kwargs):
        events.append(f"serve loaded={memory.encoder_info()['loaded']}")
        load = mcp_mod.EncoderLoad(memory)  # what create_server starts
        assert load.wait(30) and load.error is None and memory.encoder_info()["loaded"]

    monkeypatch.setattr(memory_mod, "_default_encoder", default)
    monkeypatch.setattr(mcp_mod, "serve_mcp", fake_serve)
    assert rfmem_main(["mcp", "--data-dir", str(tmp_path / "m"), "--user", "alice", "--keep-omp-wait-policy"]) == 0
    assert events == ["serve loaded=False", "load"]


def test_every_tool_argument_of_the_schema_is_in_the_guide_table_and_the_readme(tmp_path):
    """docs/guides/mcp.md's tool table names every argument of each tool's input schema
    (`name` in the tool's row), and README.md's "MCP server" section lists each tool with
    every argument in its signature."""
    import re

    mem = Memory(encoder=HashEncoder(16))
    server = create_server(mem, McpScope(user="alice"))
    schema = {t.name: set(t.input_schema.get("properties", {})) for t in anyio.run(server.list_tools)}
    assert set(schema) == TOOLS
    guide = (ROOT / "docs" / "guides" / "mcp.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (.*?) \|", guide, re.M)}
    readme = re.search(r"^## MCP server\n.*?(?=^## )", (ROOT / "README.md").read_text(encoding="utf-8"),
                       re.S | re.M).group(0)
    for tool, args in schema.items():
        documented = set(re.findall(r"`(\w+)`", rows[tool]))
        assert args <= documented, (tool, args - documented)
        signature = re.search(rf"`{tool}\(([^`]*)\)`", readme)
        assert signature, f"README.md lists no {tool}(...)"
        named = set(re.findall(r"\b(\w+)(?=[?=,)]|$)", signature.group(1)))
        assert args <= named, (tool, args - named)
