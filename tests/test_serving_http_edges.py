"""The HTTP service at its edges: unambiguous routes for any id, per-user
tokens, no silent no-auth, a bounded request body, one id model with Python, bad
input refused at the door."""
from __future__ import annotations

import asyncio
import json
import os
from urllib.parse import quote

import pytest
from _serving_helpers import HashEncoder

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from rfmem_fast import Memory  # noqa: E402
from rfmem_fast.serving.app import _resolve_api_key, create_app  # noqa: E402
from rfmem_fast.serving.tokens import TOKENS_FILE, TokenStore  # noqa: E402

DIM = 16
ADMIN = "admin-s3cret"
A = {"Authorization": f"Bearer {ADMIN}"}


def seg(x: str) -> str:
    """An id as one path segment: percent-encoded, dots too (clients drop dot segments)."""
    return quote(x, safe="").replace(".", "%2E")


def snapshot(mem: Memory) -> dict:
    """The whole memory: {user: [(id, text, metadata)]}."""
    return {u: [(i.id, i.text, i.metadata) for i in mem.get_all(u)] for u in mem.users()}


@pytest.fixture
def app_mem(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), max_wait_ms=1.0)
    with TestClient(create_app(mem, api_key=ADMIN)) as client:
        yield client, mem
    mem.close()


# ----------------------------------------------------------------------------- routes name one user
ADVERSARIAL_USERS = ["u", "u/memories/m", "a/memories", "a", "memories", "..", ".", "u%2Fx", "%", "v/../u",
                     "search", "u/search", "x y", "日本/語"]
ADVERSARIAL_ITEMS = ["x", "m/memories/x", "memories", "..", "delete", "%2F", "a/b", "search/batch", "%"]


def _routes(user: str, item: str):
    u, i = seg(user), seg(item)
    yield "get", f"/v1/users/{u}/memories", None
    yield "get", f"/v1/users/{u}/memories/{i}", None
    yield "patch", f"/v1/users/{u}/memories/{i}", {"metadata": {"touched": True}}
    yield "post", f"/v1/users/{u}/search", {"query": "t", "k": 50, "mode": "dense"}
    yield "post", f"/v1/users/{u}/search/batch", {"queries": ["t"], "k": 50, "mode": "dense"}
    yield "post", f"/v1/users/{u}/memories", {"texts": ["new"], "ids": ["fresh"]}
    yield "post", f"/v1/users/{u}/memories/delete", {"ids": [item]}
    yield "delete", f"/v1/users/{u}/memories/{i}", None
    yield "delete", f"/v1/users/{u}", None


def test_every_route_changes_or_reads_only_the_user_it_names():
    """User ids and item ids holding '/', '%2F', '..', 'memories': every route, for every
    (user, item), changes only the named user (a whole-memory diff) and reads only it."""
    mem = Memory(encoder=HashEncoder(DIM), batching=False)
    c = TestClient(create_app(mem, api_key=ADMIN))
    for user in ADVERSARIAL_USERS:
        for item in ADVERSARIAL_ITEMS:
            mem.add([f"t {user} {item}"], user, ids=[item], metadata={"owner": user})
    for user in ADVERSARIAL_USERS:
        for item in ADVERSARIAL_ITEMS[:4]:
            for method, path, body in _routes(user, item):
                before = snapshot(mem)
                r = c.request(method, path, headers=A, json=body)
                assert r.status_code in (200, 201, 404), (method, path, r.text)
                is_list = method == "get" and path == f"/v1/users/{seg(user)}/memories"
                assert r.status_code != 404 or not is_list, (path, r.text)
                after = snapshot(mem)
                changed = {u for u in set(before) | set(after) if before.get(u) != after.get(u)}
                assert changed <= {user}, (method, path, changed)
                data = r.json()
                if r.status_code == 404:
                    continue
                if is_list:
                    assert all(it["metadata"].get("owner", user) == user for it in data["items"])
                elif method == "get":
                    assert r.status_code == 404 or data["id"] == item
                elif method == "post" and path.startswith(f"/v1/users/{seg(user)}/search"):
                    results = data["results"] if path.endswith("/batch") else [data]
                    for res in results:
                        assert res["user_id"] == user
                        assert all(h["metadata"].get("owner", user) == user for h in res["hits"])
            # refill the user for the next item
            mem.delete_user(user)
            for it in ADVERSARIAL_ITEMS:
                mem.add([f"t {user} {it}"], user, ids=[it], metadata={"owner": user})


def test_ids_and_users_that_look_like_routes_stay_unambiguous(app_mem):
    c, mem = app_mem
    mem.add(["theirs"], "u", ids=["m/memories/x"])
    mem.add(["mine"], "u/memories/m", ids=["x"])
    mem.add(["a"], "a/memories", ids=["1"])
    before = snapshot(mem)
    r = c.delete("/v1/users/u/memories/m%2Fmemories%2Fx", headers=A)
    assert r.status_code == 200 and r.json() == {"deleted": ["m/memories/x"]}
    assert snapshot(mem)["u/memories/m"] == before["u/memories/m"] and mem.get_all("u") == []
    assert c.get("/v1/users/a/memories/memories", headers=A).status_code == 404  # item "memories" of user "a"
    assert c.get("/v1/users/a%2Fmemories/memories", headers=A).json()["items"][0]["id"] == "1"
    assert c.get("/v1/users/a%FF/memories", headers=A).status_code == 400  # not UTF-8


# ----------------------------------------------------------------------------- authentication, tokens
def test_auth_is_never_silently_off(tmp_path, monkeypatch, capsys):
    mem = Memory(encoder=False, dim=DIM)
    for bad in ("", "  "):
        with pytest.raises(ValueError, match="api_key must be a non-empty str"):
            create_app(mem, api_key=bad)
    with pytest.raises(ValueError, match="no_auth=True"):
        create_app(mem)
    with pytest.raises(ValueError, match="contradict"):
        create_app(mem, api_key="k", no_auth=True)
    monkeypatch.setenv("RFMEM_API_KEY", "")
    with pytest.raises(ValueError, match=r"\$RFMEM_API_KEY is empty"):
        _resolve_api_key(None, False)
    with pytest.raises(ValueError, match=r"--api-key is empty"):
        _resolve_api_key("", False)
    monkeypatch.setenv("RFMEM_API_KEY", "from-env")
    assert _resolve_api_key(None, False) == "from-env" and _resolve_api_key("flag", False) == "flag"
    monkeypatch.delenv("RFMEM_API_KEY")
    with pytest.raises(ValueError, match="--no-auth"):
        _resolve_api_key(None, False)
    assert _resolve_api_key(None, True) is None
    from rfmem_fast.cli import main

    monkeypatch.setenv("RFMEM_API_KEY", "")
    assert main(["serve", "--path", str(tmp_path / "m"), "--encoder", "none", "--dim", "4",
                 "--keep-omp-wait-policy"]) == 2
    assert "RFMEM_API_KEY is empty" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # refused before anything was opened


def test_a_server_without_auth_mints_and_lists_no_tokens(tmp_path):
    """Without auth anyone reaches every route, but not the token store: a token minted
    there would stay valid once the server is restarted with a key."""
    mem = Memory(tmp_path / "m", encoder=False, dim=DIM)
    try:
        with TestClient(create_app(mem, no_auth=True)) as c:
            r = c.post("/v1/admin/tokens", json={"user_id": "alice"})
            assert r.status_code == 403 and "--no-auth" in r.json()["detail"]
            assert c.get("/v1/admin/tokens").status_code == 403
            assert c.delete("/v1/admin/tokens/abc").status_code == 403
            assert c.get("/v1/users/alice/memories").status_code == 200  # the rest of the API is open
        assert not (tmp_path / "m" / TOKENS_FILE).exists()
    finally:
        mem.close()


def test_an_empty_key_in_the_environment_says_to_unset_it(monkeypatch):
    monkeypatch.setenv("RFMEM_API_KEY", "")
    with pytest.raises(ValueError, match="unset RFMEM_API_KEY"):
        _resolve_api_key(None, True)


def test_no_auth_prints_a_warning(tmp_path, monkeypatch, capsys):
    import uvicorn

    from rfmem_fast.serving import app as app_mod

    monkeypatch.delenv("RFMEM_API_KEY", raising=False)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    app_mod.serve(str(tmp_path / "m"), encoder="none", dim=4, no_auth=True)
    assert "WARNING: authentication is OFF" in capsys.readouterr().err


def test_user_tokens_reach_their_own_user_only_on_every_route(app_mem, tmp_path):
    c, mem = app_mem
    for user in ("alice", "bob", "alice/x"):
        mem.add([f"{user} secret"], user, ids=["s"], metadata={"owner": user})
    r = c.post("/v1/admin/tokens", headers=A, json={"user_id": "alice", "label": "phone"})
    assert r.status_code == 201
    tok, tid = r.json()["token"], r.json()["token_id"]
    T = {"Authorization": f"Bearer {tok}"}
    raw = (mem.path / TOKENS_FILE).read_text()
    assert tok not in raw and tid in raw  # hashed at rest
    assert oct(os.stat(mem.path / TOKENS_FILE).st_mode & 0o777) == "0o600"
    for other in ("bob", "alice/x", "alice%2Fx", "ALICE", "alice "):
        for method, path, body in _routes(other, "s"):
            before = snapshot(mem)
            r = c.request(method, path.replace(seg(other), seg(other)), headers=T, json=body)
            assert r.status_code == 403, (method, path, r.status_code)
            assert snapshot(mem) == before
    for method, path, body in [("post", "/v1/checkpoint", None), ("get", "/v1/admin/tokens", None),
                               ("post", "/v1/admin/tokens", {"user_id": "bob"}),
                               ("delete", f"/v1/admin/tokens/{tid}", None)]:
        assert c.request(method, path, headers=T, json=body).status_code == 403
    # its own user: every route works
    assert c.get("/v1/users/alice/memories", headers=T).json()["items"][0]["metadata"] == {"owner": "alice"}
    assert c.post("/v1/users/alice/search", headers=T, json={"query": "alice secret"}).json()["hits"][0]["id"] == "s"
    assert c.post("/v1/users/alice/memories", headers=T, json={"texts": ["more"], "ids": ["m"]}).status_code == 201
    assert c.patch("/v1/users/alice/memories/m", headers=T, json={"metadata": {"k": 1}}).status_code == 200
    assert c.delete("/v1/users/alice/memories/m", headers=T).status_code == 200
    listed = c.get("/v1/admin/tokens", headers=A).json()["tokens"]
    assert [t["token_id"] for t in listed] == [tid] and "token" not in listed[0] and "sha256" not in listed[0]
    # durable: a new store (a restarted server) knows the token; revoking is durable too
    assert TokenStore(mem.path / TOKENS_FILE).user_of(tok) == "alice"
    assert c.delete(f"/v1/admin/tokens/{tid}", headers=A).json() == {"revoked": tid}
    assert c.get("/v1/users/alice/memories", headers=T).status_code == 401
    assert TokenStore(mem.path / TOKENS_FILE).user_of(tok) is None
    assert c.delete(f"/v1/admin/tokens/{tid}", headers=A).status_code == 404
    for h in ({}, {"Authorization": "Bearer rfm_guess"}, {"Authorization": f"Bearer {tok}x"}):
        assert c.get("/v1/users/alice/memories", headers=h).status_code == 401


# ----------------------------------------------------------------------------- body limit
def _asgi_post(app, body_chunks, content_length=None, path="/v1/users/u/memories"):
    """Call the ASGI app directly with a body received in chunks; returns (status,
    bytes of the body the app pulled)."""
    pulled = [0]
    sent = []
    chunks = iter(body_chunks)

    async def receive():
        try:
            chunk = next(chunks)
        except StopIteration:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled[0] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message):
        sent.append(message)

    headers = [(b"host", b"t"), (b"content-type", b"application/json"), (b"authorization", f"Bearer {ADMIN}".encode())]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("t", 80)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], pulled[0]


def test_bodies_over_the_limit_get_413_before_they_are_buffered():
    mem = Memory(encoder=HashEncoder(DIM))
    limit = 1 << 20
    app = create_app(mem, api_key=ADMIN, max_body_bytes=limit)
    mib = b" " * (1 << 20)

    def stream(n_mib):  # a 256 MiB body, produced lazily
        for _ in range(n_mib):
            yield mib

    status, pulled = _asgi_post(app, stream(256))  # chunked: no Content-Length
    assert status == 413 and pulled <= limit + len(mib)
    status, pulled = _asgi_post(app, stream(256), content_length=256 << 20)
    assert status == 413 and pulled == 0  # refused on the header alone
    ok = json.dumps({"texts": ["fits"]}).encode()
    assert _asgi_post(app, [ok[:5], ok[5:]])[0] == 201
    assert _asgi_post(app, [ok], content_length=len(ok))[0] == 201
    assert mem.count("u") == 2
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(mem, api_key=ADMIN, max_body_bytes=0)


def test_a_real_server_refuses_a_streamed_body_early(tmp_path):
    """uvicorn on a socket, a 256 MiB chunked body from a generator: 413 arrives while
    the client has sent only a small part; the server process grows < 64 MiB."""
    import resource
    import socket
    import threading

    import uvicorn

    mem = Memory(encoder=HashEncoder(DIM))
    app = create_app(mem, api_key=ADMIN, max_body_bytes=4 << 20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        for _ in range(200):
            if server.started:
                break
            threading.Event().wait(0.05)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sent = [0]

        def gen():
            chunk = b"[" + b"1," * (1 << 19)
            for _ in range(256):
                sent[0] += len(chunk)
                yield chunk

        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/users/u/memories", content=gen(), headers=A, timeout=30)
            status = r.status_code
        except httpx.HTTPError as exc:  # the server closed the connection while the client was still writing
            status = 413 if "reset" in str(exc).lower() or "broken" in str(exc).lower() or "closed" in str(exc).lower() \
                else repr(exc)
        assert status == 413
        assert sent[0] < 128 << 20  # the client stopped far before 256 MiB
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        assert grown_kib < 64 << 10
    finally:
        server.should_exit = True
        t.join(10)


# ----------------------------------------------------------------------------- ids, forgetting, pages, bad text, timeouts
def test_ids_round_trip_between_python_and_http(app_mem):
    c, mem = app_mem
    assert mem.add(["seven"], 7, ids=[7]) == ["7"]
    item = c.get("/v1/users/7/memories/7", headers=A)
    assert item.status_code == 200 and {k: v for k, v in item.json().items() if k != "created_at"} == {
        "id": "7", "text": "seven", "metadata": {}, "thread": None, "position": None}
    assert c.post("/v1/users/7/search", headers=A, json={"query": "seven"}).json()["hits"][0]["id"] == "7"
    r = c.post("/v1/users/8/memories", headers=A, json={"texts": ["eight"], "ids": ["8"]})
    assert r.json() == {"ids": ["8"]}
    assert mem.get(8, 8)[0].text == "eight" and mem.search("eight", 8)[0].id == "8"
    assert c.post("/v1/users/8/memories", headers=A, json={"texts": ["x"], "ids": [9]}).status_code == 422


def test_forget_me_over_http_is_durable(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    with TestClient(create_app(mem, api_key=ADMIN)) as c:
        c.post("/v1/users/gone/memories", headers=A, json={"texts": ["a", "b"]})
        c.post("/v1/users/kept/memories", headers=A, json={"texts": ["a"]})
        assert c.delete("/v1/users/gone", headers=A).json() == {"user_id": "gone", "deleted": 2}
        assert c.delete("/v1/users/gone", headers=A).json() == {"user_id": "gone", "deleted": 0}
        assert c.delete("/v1/users/never", headers=A).status_code == 200
        assert c.post("/v1/users/never/search", headers=A, json={"query": "a"}).json()["hits"] == []
    mem._lock_file.close()  # a crash: only the log holds it
    again = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    assert again.count("gone") == 0 and again.count("kept") == 1
    again.close()


def test_pages_of_a_users_items(app_mem):
    c, mem = app_mem
    mem.add([f"t{i}" for i in range(5)], "u", ids=[f"i{i}" for i in range(5)])
    p1 = c.get("/v1/users/u/memories?limit=2", headers=A).json()
    assert [it["id"] for it in p1["items"]] == ["i0", "i1"] and p1["total"] == 5 and p1["next_offset"] == 2
    p3 = c.get("/v1/users/u/memories?limit=2&offset=4", headers=A).json()
    assert [it["id"] for it in p3["items"]] == ["i4"] and p3["next_offset"] is None


def test_lone_surrogates_sent_as_json_escapes_are_refused_and_the_user_stays_readable(app_mem):
    c, mem = app_mem
    c.post("/v1/users/u/memories", headers=A, json={"texts": ["fine"], "ids": ["ok"]})
    bodies = [
        ("/v1/users/u/memories", '{"texts": ["bad \\ud800"]}', "texts"),
        ("/v1/users/u/memories", '{"vectors": [[1.0]], "texts": ["x\\udfff"]}', "texts"),
        ("/v1/users/u/memories", '{"texts": ["a"], "metadata": {"k": "v\\udfff"}}', "metadata[0] (as JSON) holds a lone surrogate"),
        ("/v1/users/u/memories", '{"texts": ["a"], "metadata": [{"v\\udfff": 1}]}', "metadata[0] (as JSON) holds a lone surrogate"),
        ("/v1/users/u/memories", '{"texts": ["a"], "ids": ["i\\ud800"]}', "ids"),
        ("/v1/users/u/search", '{"query": "q\\ud800"}', "query"),
        ("/v1/users/u/memories/ok", '{"metadata": {"k": "\\udfff"}}', "metadata[0] (as JSON) holds a lone surrogate"),
    ]
    for path, raw, msg in bodies:
        method = "patch" if path.endswith("/ok") else "post"
        r = c.request(method, path, headers={**A, "content-type": "application/json"}, content=raw.encode())
        assert r.status_code in (400, 422), (raw, r.text)
        if r.status_code == 400:  # refused by the Memory's door
            assert msg in r.json()["detail"]
        else:  # refused by pydantic's str: the loc names the field
            assert msg in r.json()["detail"][0]["loc"]
    assert c.get("/v1/users/u/memories", headers=A).status_code == 200
    assert c.post("/v1/users/u/search", headers=A, json={"query": "fine"}).status_code == 200
    assert [i.id for i in mem.get_all("u")] == ["ok"]


def test_requests_that_timed_out_over_http_free_their_slots(tmp_path):
    """Over HTTP: queue of 2, worker blocked: 2 searches time out (504); the next
    one is queued (not 503) and answered once the worker is free."""
    import threading

    enc = HashEncoder(DIM)
    mem = Memory(encoder=enc, max_batch=1, max_queue=2, max_wait_ms=0.0, cache_size=0, timeout=0.3)
    mem.add(["x"], "u")
    enc.entered.clear()
    enc.gate = threading.Event()
    app = create_app(mem, api_key=ADMIN)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=A, timeout=30) as client:
            def post(q):
                return asyncio.create_task(client.post("/v1/users/u/search", json={"query": q}))

            first = post("block")
            while not enc.entered.is_set():
                await asyncio.sleep(0.01)
            timed_out = await asyncio.gather(post("t1"), post("t2"))
            late = post("late")
            await asyncio.sleep(0.05)
            enc.gate.set()
            return [r.status_code for r in timed_out], (await late).status_code, (await first).status_code

    timed_out, late, first = asyncio.run(main())
    assert timed_out == [504, 504] and late == 200 and first in (200, 504)
    mem.close()
