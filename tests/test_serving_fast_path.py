"""The HTTP fast path of ``POST /v1/users/{u}/search`` (serving.app._FastSearch): every
request answered exactly as the full FastAPI route answers it (status, JSON, headers,
metrics), the requests it must hand over handed over, and ``--no-fast-path``."""
from __future__ import annotations

import json
import re

import pytest
from _serving_helpers import HashEncoder

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from rfmem_fast import Memory  # noqa: E402
from rfmem_fast.serving.app import MAX_K, MAX_TEXT, create_app  # noqa: E402
from rfmem_fast.serving.tokens import TokenStore  # noqa: E402

DIM = 16
KEY = "s3cret"
ADMIN = {"Authorization": f"Bearer {KEY}"}
USERS = ("alice", "0/bob", "e%41", "..")  # "/" and "%" in an id, a dot segment
WORDS = "lyon sister ana tea coffee paris brother cat dog rain sun".split()


@pytest.fixture
def apps(tmp_path):
    """(fast client, full client, memory, the fast app's _FastSearch, a user token of alice)
    over ONE memory (hot-query cache off, so both apps search every request)."""
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), max_wait_ms=0.5, cache_size=0)
    for u, user in enumerate(USERS):
        mem.add([f"{w} {user} {j}" for j, w in enumerate(WORDS)], user, ids=[f"{u}-{j}" for j in range(len(WORDS))],
                metadata=[{"j": j, "tags": ["a", j]} for j in range(len(WORDS))])
    tokens = TokenStore(None)
    alice_token, _ = tokens.mint("alice", "test")
    fast_app = create_app(mem, api_key=KEY, tokens=tokens)
    full_app = create_app(mem, api_key=KEY, tokens=tokens, fast_path=False)
    assert full_app.fast_search is None
    with TestClient(fast_app) as fast, TestClient(full_app) as full:
        yield fast, full, mem, fast_app.fast_search, alice_token
    mem.close()


def _seg(user: str) -> str:
    from urllib.parse import quote

    return quote(user, safe="").replace(".", "%2E")


def _ask(client, path, headers, body):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json", **headers}
    r = client.post(path, headers=headers, **kw)
    try:
        doc = r.json()
    except ValueError:
        doc = r.text
    return r.status_code, doc, {k: r.headers.get(k) for k in ("retry-after", "www-authenticate", "content-type")}


def _same(fast, full, path, headers, body):
    got, want = _ask(fast, path, headers, body), _ask(full, path, headers, body)
    assert got == want, (path, body)
    return got


def test_well_formed_searches_are_answered_by_the_fast_path_exactly_as_by_the_full_route(apps):
    fast, full, mem, fs, alice_token = apps
    n = 0
    for user in USERS:
        for q, (k, mode) in enumerate([(None, None), (1, "rfmem"), (3, "dense"), (MAX_K, "recollection"), (5, None)]):
            body = {"query": f"{WORDS[q]} {user}"}
            if k is not None:
                body["k"] = k
            if mode is not None:
                body["mode"] = mode
            status, doc, _ = _same(fast, full, f"/v1/users/{_seg(user)}/search", ADMIN, body)
            n += 1
            assert status == 200 and doc["user_id"] == user and doc["cached"] is False
            ref = mem.search(body["query"], user, k=k, mode=mode or "rfmem")  # the facade, no HTTP
            assert [h["id"] for h in doc["hits"]] == [h.id for h in ref]
            assert [h["score"] for h in doc["hits"]] == pytest.approx([h.score for h in ref])
            assert [h["metadata"] for h in doc["hits"]] == [h.metadata for h in ref]
            assert doc["route"] == ref.route and doc["rule"] == ref.rule
    # explicit nulls, a JSON content type with a charset, a user token for its own user
    for headers, body in [(ADMIN, {"query": "tea alice", "k": None, "mode": "dense", "filters": None, "vector": None}),
                          ({**ADMIN, "Content-Type": "application/json; charset=utf-8"},
                           json.dumps({"query": "lyon alice"}).encode()),
                          ({"Authorization": f"Bearer {alice_token}"}, {"query": "cat alice", "k": 2})]:
        assert _same(fast, full, "/v1/users/alice/search", headers, body)[0] == 200
        n += 1
    assert fs.served == n and fs.passed == 0


def test_requests_the_fast_path_does_not_answer_get_the_full_routes_answer(apps):
    fast, full, mem, fs, alice_token = apps
    p = "/v1/users/alice/search"
    cases = [
        # auth: none, a wrong scheme / token, another user's token
        ({}, {"query": "tea"}, 401),
        ({"Authorization": "Basic abc"}, {"query": "tea"}, 401),
        ({"Authorization": "Bearer nope"}, {"query": "tea"}, 401),
        ({"Authorization": f"Bearer {alice_token}"}, {"query": "tea"}, None),  # (to another user below)
        # bodies pydantic refuses (422) or that need the full model (vector, filters)
        (ADMIN, {"query": "tea", "k": "2"}, 422),
        (ADMIN, {"query": "tea", "k": 0}, 422),
        (ADMIN, {"query": "tea", "k": MAX_K + 1}, 422),
        (ADMIN, {"query": "tea", "k": True}, 422),
        (ADMIN, {"query": "tea", "k": 2.0}, 422),
        (ADMIN, {"query": "tea", "mode": "fast"}, 422),
        (ADMIN, {"query": "tea", "mode": None}, 422),
        (ADMIN, {"query": "tea", "extra": 1}, 422),
        (ADMIN, {"query": None}, 422),
        (ADMIN, {"query": 7}, 422),
        (ADMIN, {"query": "x" * (MAX_TEXT + 1)}, 422),
        (ADMIN, {"query": "tea", "vector": [1.0] * DIM}, 422),
        (ADMIN, ["tea"], 422),
        (ADMIN, b"{not json", 422),
        (ADMIN, b'{"query": NaN}', 422),
        (ADMIN, b'{"query": "\\ud800"}', 422),  # a lone surrogate: orjson and pydantic refuse it
        ({**ADMIN, "Content-Type": "text/plain"}, json.dumps({"query": "tea"}).encode(), 422),
        ({**ADMIN, "Content-Type": "application/x-json"}, json.dumps({"query": "tea"}).encode(), 422),
        ({**ADMIN, "Content-Type": "application/problem+json"}, json.dumps({"query": "tea"}).encode(), 200),
        ({**ADMIN, "Content-Type": ""}, json.dumps({"query": "tea"}).encode(), 422),  # no type: FastAPI reads no JSON
        (ADMIN, {"vector": [0.25] * DIM, "k": 3}, 200),
        (ADMIN, {"query": "tea alice", "filters": {"j": {"$gte": 3}}}, 200),
        (ADMIN, {"query": "tea", "filters": {"j": {"$gte": []}}}, 422),
    ]
    for headers, body, status in cases:
        path = p if status is not None else "/v1/users/0%2Fbob/search"
        got = _same(fast, full, path, headers, body)
        assert got[0] == (status or 403), (headers, body, got)
        if got[0] == 401:
            assert got[2]["www-authenticate"] == "Bearer"
    # what is not one search: the batch route, a longer path, a path with an empty segment
    assert _same(fast, full, "/v1/users/alice/search/batch", ADMIN, {"queries": ["tea"]})[0] == 200
    assert _same(fast, full, "/v1/users//search", ADMIN, {"query": "tea"})[0] in (404, 405)
    assert _same(fast, full, "/v1/users/%FF/search", ADMIN, {"query": "tea"})[0] == 400  # not UTF-8
    assert fs.served == 0
    assert fs.passed == len(cases) + 2  # + the empty segment and the %FF path (the batch route never reaches it)


def test_errors_of_the_search_itself_are_the_full_routes(apps, tmp_path):
    fast, full, mem, fs, _ = apps
    for body in ({"query": "   "}, {"query": ""}):  # the Memory refuses a blank query: 400 naming it
        status, doc, _ = _same(fast, full, "/v1/users/alice/search", ADMIN, body)
        assert status == 400 and "query" in doc["detail"]
    assert fs.served == 2
    # a full queue: 503 with Retry-After, from both paths alike
    enc = HashEncoder(DIM)
    gated = Memory(tmp_path / "g", encoder=enc, max_wait_ms=0.0, max_queue=1, cache_size=0)
    import threading

    enc.gate = threading.Event()
    try:
        fast_app, full_app = create_app(gated, no_auth=True), create_app(gated, no_auth=True, fast_path=False)
        with TestClient(fast_app) as f2, TestClient(full_app) as g2:
            t = threading.Thread(target=lambda: gated.search("first", "u", timeout=30))
            t.start()
            assert enc.entered.wait(10)  # the first search is in the encoder; the queue holds one more
            t2 = threading.Thread(target=lambda: gated.search("second", "u", timeout=30))
            t2.start()
            for _ in range(200):
                if gated.stats()["batcher"]["queue_depth"] == 1:
                    break
                threading.Event().wait(0.01)
            got_fast, got_full = (_ask(c, "/v1/users/u/search", {}, {"query": "third"}) for c in (f2, g2))
            assert got_fast == got_full and got_fast[0] == 503 and got_fast[2]["retry-after"] == "1"
            assert fast_app.fast_search.served == 1
            enc.gate.set()
            t.join(10)
            t2.join(10)
    finally:
        enc.gate.set()
        gated.close()


def _metric(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_the_fast_path_counts_its_requests_in_the_same_metrics(apps):
    fast, full, mem, fs, _ = apps
    for c in (fast, full):
        for i in range(3):
            r = c.post("/v1/users/alice/search", headers=ADMIN, json={"query": f"tea {i}", "mode": "dense"})
            assert r.status_code == 200
        assert c.post("/v1/users/alice/search", headers=ADMIN, json={"query": " "}).status_code == 400
    route = 'method="POST",route="/v1/users/{user_id}/search"'
    for c in (fast, full):
        text = c.get("/metrics").text
        assert _metric(text, "rfmem_http_requests_total", route + ',status="200"') == 3
        assert _metric(text, "rfmem_http_requests_total", route + ',status="400"') == 1
        assert _metric(text, "rfmem_http_request_duration_seconds_count", route) == 4
        assert _metric(text, "rfmem_search_queries_total",
                       'cached="false",mode="dense",route="familiarity",rule="forced_dense"') == 3
    assert fs.served == 4


def test_fast_path_option_is_checked_and_no_fast_path_reaches_serve(tmp_path, monkeypatch):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    try:
        with pytest.raises(TypeError, match="fast_path must be a bool"):
            create_app(mem, no_auth=True, fast_path="yes")
    finally:
        mem.close()
    import rfmem_fast.serving.app as app_mod
    from rfmem_fast.cli import main

    seen = {}
    monkeypatch.setattr(app_mod, "serve", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr("sys.setswitchinterval", lambda s: None)  # run() sets it for a server process
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # no re-execution
    for argv, want in ((["--no-fast-path"], False), ([], True)):
        seen.clear()
        argv = ["serve", "--path", str(tmp_path / "s"), "--no-auth", "--encoder", "none", "--dim", "4", *argv]
        assert main(argv) == 0
        assert seen["fast_path"] is want
