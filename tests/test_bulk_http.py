"""The bulk HTTP routes: POST /v1/memories:batch, :batchUpdate,
:batchDelete -- many users' items in one all-or-nothing write, 422 located at the bad
item, per-item user scope for user tokens, the body limit."""
from __future__ import annotations

import numpy as np
import pytest
from _serving_helpers import HashEncoder

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from rfmem_fast import Memory  # noqa: E402
from rfmem_fast.serving.app import create_app  # noqa: E402

DIM = 16
ADMIN = "admin-s3cret"
A = {"Authorization": f"Bearer {ADMIN}"}


def snapshot(mem: Memory) -> dict:
    """{user: [(id, text, metadata)]} plus every bank row (bit-exact)."""
    return {u: ([(i.id, i.text, i.metadata) for i in mem.get_all(u)], mem.bank.snapshot().vectors.tobytes())
            for u in mem.users()}


@pytest.fixture
def app_mem(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), max_wait_ms=1.0)
    with TestClient(create_app(mem, api_key=ADMIN)) as client:
        yield client, mem
    mem.close()


def items(n_users=3, per_user=4):
    rng = np.random.default_rng(0)
    out = []
    for j in range(per_user):
        for u in range(n_users):
            it = {"user_id": f"user{u}", "id": f"m{j}", "text": f"user {u} fact {j}", "metadata": {"j": j}}
            if j == 1:
                it["vector"] = rng.normal(size=DIM).tolist()
            out.append(it)
    return out


def test_batch_routes_equal_the_memory_calls(app_mem):
    c, mem = app_mem
    body = items()
    r = c.post("/v1/memories:batch", headers=A, json={"items": body})
    assert r.status_code == 201 and r.json() == {"ids": [it["id"] for it in body]}
    ref = Memory(encoder=HashEncoder(DIM), batching=False)
    ref.add_many(body)
    assert snapshot(mem) == snapshot(ref)
    r = c.post("/v1/memories%3Abatch", headers=A, json={"items": [{"user_id": "new", "text": "percent-encoded colon"}]})
    assert r.status_code == 201 and mem.count("new") == 1  # ":" sent as %3A reaches the same route
    ref.add_many([{"user_id": "new", "text": "percent-encoded colon", "id": r.json()["ids"][0]}])
    upd = [{"user_id": "user0", "id": "m0", "text": "changed"}, {"user_id": "user2", "id": "m3", "metadata": None},
           {"user_id": "user1", "id": "m1", "vector": [0.5] * DIM, "metadata": {"v": 2}}]
    r = c.post("/v1/memories:batchUpdate", headers=A, json={"items": upd})
    assert r.status_code == 200 and r.json() == {"updated": 3}
    ref.update_many(upd)
    assert snapshot(mem) == snapshot(ref) and mem.get("m3", "user2")[0].metadata == {}
    dele = [{"user_id": "user0", "id": "m0"}, {"user_id": "user1", "id": "m2"}]
    r = c.post("/v1/memories:batchDelete", headers=A, json={"items": dele})
    assert r.status_code == 200 and r.json() == {"deleted": 2}
    ref.delete_many(dele)
    assert snapshot(mem) == snapshot(ref)
    hits = c.post("/v1/users/user0/search", headers=A, json={"query": "user 0 fact 2", "k": 1, "mode": "dense"}).json()
    assert hits["hits"][0]["id"] == "m2" and hits["hits"][0]["metadata"] == {"j": 2}
    metrics = c.get("/metrics").text
    assert 'route="/v1/memories:batch",status="201"' in metrics
    assert 'route="/v1/memories:batchDelete",status="200"' in metrics


BAD = [  # (route, items, status, loc of the error or a text in the detail)
    ("batch", [{"user_id": "a", "text": "ok"}, {"user_id": "b", "text": "ok"}, {"text": "no user"}], 422,
     ["body", "items", 2, "user_id"]),
    ("batch", [{"user_id": "a", "text": "ok"}, {"user_id": "b", "text": "  "}], 422, ["body", "items", 1, "text"]),
    ("batch", [{"user_id": "a", "text": "ok"}, {"user_id": "b", "vector": [1.0, 2.0]}], 422, ["body", "items", 1, "vector"]),
    ("batch", [{"user_id": "a", "text": "ok"}, {"user_id": "b", "id": "q"}], 422, ["body", "items", 1]),
    ("batch", [{"user_id": "a", "text": "ok", "id": "d"}, {"user_id": "a", "text": "x", "id": "d"}], 422,
     ["body", "items", 1, "id"]),
    ("batch", [{"user_id": "b", "text": "ok"}, {"user_id": "u", "text": "x", "id": "taken"}], 422, ["body", "items", 1, "id"]),
    ("batch", [{"user_id": "a", "text": "ok", "typo": 1}], 422, ["body", "items", 0, "typo"]),
    ("batch", [{"user_id": "a", "text": "ok", "created_at": "soon"}], 422, ["body", "items", 0, "created_at"]),
    ("batch", [{"user_id": "a", "text": "ok", "created_at": True}], 422, ["body", "items", 0, "created_at", "float"]),
    ("batch", [{"user_id": "a", "text": "ok", "created_at": 1774747800000}], 422, ["body", "items", 0, "created_at"]),
    ("batch", [], 422, ["body", "items"]),
    ("batch", [{"user_id": "a", "text": "ok"}] * 4097, 422, ["body", "items"]),
    ("batchUpdate", [{"user_id": "u", "id": "taken", "text": "x"}, {"user_id": "u", "id": "nope", "text": "y"}], 404,
     "items[1].id: user 'u' holds no item id 'nope'"),
    ("batchUpdate", [{"user_id": "u", "id": "taken"}], 422, ["body", "items", 0]),
    ("batchUpdate", [{"user_id": "ghost", "id": "taken", "text": "x"}], 404, "items[0].user_id: unknown user 'ghost'"),
    ("batchDelete", [{"user_id": "u", "id": "taken"}, {"user_id": "u", "id": "nope"}], 404, "items[1].id"),
    ("batchDelete", [{"user_id": "u", "id": "taken"}, {"user_id": "u", "id": "taken"}], 422, ["body", "items", 1, "id"]),
]


@pytest.mark.parametrize("route, body, status, where", BAD)
def test_a_bad_item_fails_the_request_at_its_index_and_writes_nothing(app_mem, route, body, status, where):
    c, mem = app_mem
    mem.add(["kept"], "u", ids=["taken"])
    before = snapshot(mem)
    r = c.post(f"/v1/memories:{route}", headers=A, json={"items": body})
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    if isinstance(where, list):
        assert any(e["loc"][:len(where)] == where for e in detail), detail
    else:
        assert where in detail
    assert snapshot(mem) == before


def test_a_user_token_writes_its_own_user_only(app_mem):
    c, mem = app_mem
    mem.add(["bob's"], "bob", ids=["b"])
    tok = c.post("/v1/admin/tokens", headers=A, json={"user_id": "alice"}).json()["token"]
    T = {"Authorization": f"Bearer {tok}"}
    r = c.post("/v1/memories:batch", headers=T, json={"items": [{"user_id": "alice", "text": "mine", "id": "x"},
                                                                  {"user_id": "alice", "text": "mine too"}]})
    assert r.status_code == 201 and mem.count("alice") == 2
    before = snapshot(mem)
    for route, body in [
        ("batch", [{"user_id": "alice", "text": "ok"}, {"user_id": "bob", "text": "sneaky"}]),
        ("batch", [{"user_id": "ALICE", "text": "not the same user"}]),
        ("batchUpdate", [{"user_id": "alice", "id": "x", "text": "ok"}, {"user_id": "bob", "id": "b", "text": "x"}]),
        ("batchDelete", [{"user_id": "bob", "id": "b"}]),
    ]:
        r = c.post(f"/v1/memories:{route}", headers=T, json={"items": body})
        assert r.status_code == 403, r.text
        assert "items[" in r.json()["detail"] and snapshot(mem) == before
    assert c.post("/v1/memories:batchUpdate", headers=T,
                  json={"items": [{"user_id": "alice", "id": "x", "metadata": {"k": 1}}]}).status_code == 200
    assert c.post("/v1/memories:batchDelete", headers=T, json={"items": [{"user_id": "alice", "id": "x"}]}).status_code == 200
    assert mem.count("alice") == 1 and mem.count("bob") == 1
    r = c.post("/v1/memories:batch", json={"items": [{"user_id": "alice", "text": "no token"}]})
    assert r.status_code == 401
    r = c.post("/v1/memories:batch", headers={"Authorization": "Bearer wrong"}, json={"items": [{"user_id": "a", "text": "x"}]})
    assert r.status_code == 401 and mem.count("alice") == 1


def test_the_body_limit_applies_to_bulk_requests(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    with TestClient(create_app(mem, api_key=ADMIN, max_body_bytes=2000)) as c:
        small = [{"user_id": "a", "text": f"t{i}"} for i in range(5)]
        assert c.post("/v1/memories:batch", headers=A, json={"items": small}).status_code == 201
        big = [{"user_id": "a", "text": "x" * 100} for _ in range(50)]
        r = c.post("/v1/memories:batch", headers=A, json={"items": big})
        assert r.status_code == 413 and mem.count("a") == 5
    mem.close()


def test_batch_created_at_takes_the_forms_of_add(app_mem):
    """A bulk item's created_at is read as the add route reads it: epoch seconds (JSON
    int / float) or ISO-8601 (an offset-less string as UTC, the item format)."""
    c, mem = app_mem
    forms = [1774747800, 1774747800.5, "2026-03-29T03:30:00+02:00", "2026-03-29T01:30:00"]
    r = c.post("/v1/memories:batch", headers=A, json={"items": [
        {"user_id": "t", "id": f"i{j}", "text": f"fact {j}", "created_at": t} for j, t in enumerate(forms)]})
    assert r.status_code == 201, r.text
    r = c.post("/v1/users/t/memories", headers=A, json={"texts": ["a", "b", "c"], "ids": ["a0", "a1", "a2"],
                                                         "created_at": forms[:3]})
    assert r.status_code == 201, r.text
    got = {i.id: i.created_at.isoformat() for i in mem.get_all("t")}
    assert [got[f"i{j}"] for j in range(4)] == ["2026-03-29T01:30:00+00:00", "2026-03-29T01:30:00.500000+00:00",
                                                  "2026-03-29T01:30:00+00:00", "2026-03-29T01:30:00+00:00"]
    assert [got[f"a{j}"] for j in range(3)] == [got[f"i{j}"] for j in range(3)]
