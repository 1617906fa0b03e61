"""The HTTP service: routes, user scope, auth, 4xx on bad input, metrics, and the real
``rfmem serve`` process (killed with SIGKILL after acknowledged writes)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from _serving_helpers import HashEncoder

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from rfmem_fast import Memory  # noqa: E402
from rfmem_fast.serving.app import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DIM = 16
KEY = "s3cret"
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def served(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), max_wait_ms=1.0)
    with TestClient(create_app(mem, api_key=KEY)) as client:
        yield client, mem
    mem.close()


def test_crud_and_search_over_http(served):
    c, mem = served
    r = c.post("/v1/users/alice/memories", headers=H,
               json={"texts": ["I live in Lyon", "My sister is Ana", "I like tea"], "ids": ["a", "b", "c"],
                     "metadata": {"source": "chat"}, "created_at": "2026-03-29T03:30:00+02:00"})
    assert r.status_code == 201 and r.json() == {"ids": ["a", "b", "c"]}
    r = c.post("/v1/users/alice/memories", headers=H, json={"vectors": [[1.0] + [0.0] * 15], "metadata": [None]})
    assert r.status_code == 201 and len(r.json()["ids"]) == 1
    r = c.post("/v1/users/alice/search", headers=H, json={"query": "My sister is Ana", "k": 2, "mode": "dense"})
    body = r.json()
    top = body["hits"][0]  # the default config: cosine + 0.03 * BM25 (RFMemConfig.recommended()), context on
    assert r.status_code == 200 and top["lexical_score"] > 0 and top == {
        "id": "b", "text": "My sister is Ana", "score": pytest.approx(1.0 + 0.03 * top["lexical_score"]),
        "metadata": {"source": "chat"}, "rank": 0, "dense_score": pytest.approx(1.0), "lexical_score": top["lexical_score"],
        "created_at": "2026-03-29T01:30:00+00:00", "thread": None, "position": None,
        "context_score": pytest.approx(1.3 * top["score"])}  # no thread: c = b + 0.3 b
    assert body["route"] == "familiarity" and body["rule"] == "forced_dense" and len(body["hits"]) == 2
    direct = mem.search("My sister is Ana", "alice", k=2, mode="dense")
    assert [h["id"] for h in body["hits"]] == [h.id for h in direct]
    r = c.post("/v1/users/alice/search", headers=H, json={"vector": [1.0] + [0.0] * 15, "k": 1, "mode": "dense"})
    assert r.json()["hits"][0]["text"] is None
    r = c.post("/v1/users/alice/search/batch", headers=H, json={"queries": ["I like tea", "I live in Lyon"], "k": 1, "mode": "dense"})
    assert [res["hits"][0]["id"] for res in r.json()["results"]] == ["c", "a"]
    assert c.patch("/v1/users/alice/memories/c", headers=H, json={"texts": "I like coffee", "metadata": {"v": 2}}).status_code == 200
    item = c.get("/v1/users/alice/memories/c", headers=H).json()
    assert datetime.fromisoformat(item.pop("created_at")).tzinfo is not None  # ISO-8601, UTC
    assert item == {"id": "c", "text": "I like coffee", "metadata": {"v": 2}, "thread": None, "position": None}
    assert c.delete("/v1/users/alice/memories/a", headers=H).json() == {"deleted": ["a"]}
    assert c.post("/v1/users/alice/memories/delete", headers=H, json={"ids": ["b"]}).json() == {"deleted": ["b"]}
    assert [it["id"] for it in c.get("/v1/users/alice/memories", headers=H).json()["items"]][:1] == ["c"]
    assert c.post("/v1/checkpoint", headers=H).json()["checkpointed"] is True
    health = c.get("/health").json()
    assert health["status"] == "ok" and health["items"] == 2


def test_user_scope_a_request_never_reads_another_users_memories(served):
    c, _ = served
    c.post("/v1/users/alice/memories", headers=H, json={"texts": ["alice secret"], "ids": ["s1"]})
    c.post("/v1/users/0%2Fbob/memories", headers=H, json={"texts": ["bob note"], "ids": ["n1"]})  # a "/" in the id
    for mode in ("rfmem", "dense", "recollection"):
        hits = c.post("/v1/users/0%2Fbob/search", headers=H, json={"query": "alice secret", "k": 5, "mode": mode}).json()
        assert hits["user_id"] == "0/bob" and {h["id"] for h in hits["hits"]} <= {"n1"}
    assert c.post("/v1/users/mallory/search", headers=H, json={"query": "alice secret"}).json()["hits"] == []
    assert c.get("/v1/users/mallory/memories", headers=H).json()["items"] == []
    assert c.get("/v1/users/0%2Fbob/memories/s1", headers=H).status_code == 404
    assert c.delete("/v1/users/0%2Fbob/memories/s1", headers=H).status_code == 404
    assert c.patch("/v1/users/mallory/memories/s1", headers=H, json={"texts": "x"}).status_code == 404
    assert [it["id"] for it in c.get("/v1/users/alice/memories", headers=H).json()["items"]] == ["s1"]


def test_bearer_token(served):
    c, _ = served
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = c.post("/v1/users/u/search", headers=headers, json={"query": "x"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert c.get("/v1/users/u/memories", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def nested(depth):
    out = 1
    for _ in range(depth):
        out = {"a": out}
    return out


BAD = [
    ("post", "/v1/users/u/memories", {}, 422, "texts or vectors is required"),
    ("post", "/v1/users/u/memories", {"texts": "one string"}, 422, "texts"),
    ("post", "/v1/users/u/memories", {"texts": [1, 2]}, 422, "texts"),
    ("post", "/v1/users/u/memories", {"texts": ["a"], "ids": ["1", "2"]}, 422, "ids has 2 entries"),
    ("post", "/v1/users/u/memories", {"texts": ["a"], "ids": [5]}, 422, "ids"),
    ("post", "/v1/users/u/memories", {"texts": ["a"], "metadata": [{"a": 1}, {}]}, 422, "metadata has 2 entries"),
    ("post", "/v1/users/u/memories", {"texts": ["a"], "text": "typo"}, 422, "text"),
    ("post", "/v1/users/u/memories", {"texts": []}, 422, "texts"),
    ("post", "/v1/users/u/memories", {"vectors": [[1.0, 2.0]]}, 400, "vectors must have dimension 16"),
    ("post", "/v1/users/u/memories", {"vectors": [[0.0] * 16]}, 400, "zero norm"),
    ("post", "/v1/users/u/memories", {"vectors": [[1.0] * 15 + [float("nan")]]}, 422, "vectors"),
    ("post", "/v1/users/u/memories", {"texts": ["a"], "ids": ["taken"]}, 400, "already holds item id 'taken'"),
    ("post", "/v1/users/u/search", {}, 422, "exactly one of query and vector"),
    ("post", "/v1/users/u/search", {"query": "x", "vector": [1.0]}, 422, "exactly one of query and vector"),
    ("post", "/v1/users/u/search", {"query": "x", "k": 0}, 422, "k"),
    ("post", "/v1/users/u/search", {"query": "x", "k": 100000}, 422, "k"),
    ("post", "/v1/users/u/search", {"query": "x", "mode": "fast"}, 422, "mode"),
    ("post", "/v1/users/u/search", {"query": ["x"]}, 422, "query"),
    ("post", "/v1/users/u/search", {"vector": [1.0, 2.0]}, 400, "dimension 16"),
    ("post", "/v1/users/u/search/batch", {"queries": []}, 422, "queries"),
    ("post", "/v1/users/u/search/batch", {"vectors": [[1.0] * 3]}, 400, "dimension 16"),
    ("patch", "/v1/users/u/memories/taken", {}, 422, "texts, vectors, metadata, thread or position is required"),
    ("patch", "/v1/users/u/memories/taken", {"text": "x"}, 422, "use 'texts'"),
    ("patch", "/v1/users/u/memories/taken", {"vector": [1.0] * 16}, 422, "use 'vectors'"),
    ("patch", "/v1/users/u/memories/taken", {"texts": "  "}, 400, "texts is empty or whitespace only"),
    ("patch", "/v1/users/u/memories/nope", {"texts": "x"}, 404, "holds no item id 'nope'"),
    ("post", "/v1/users/u/search", {"query": "x", "k": "2"}, 422, "k"),
    ("post", "/v1/users/u/search", {"query": "x", "k": 2.0}, 422, "k"),
    ("post", "/v1/users/u/search", {"query": "x", "k": True}, 422, "k"),
    ("post", "/v1/users/u/search/batch", {"queries": ["x"], "k": "2"}, 422, "k"),
    # JSON true / false are no numbers: not 1.0 / 0.0 in a creation time or a vector (nor a numeric string)
    ("post", "/v1/users/u/memories", {"texts": ["a"], "created_at": True}, 422, "created_at must be None"),
    ("post", "/v1/users/u/memories", {"texts": ["a", "b"], "created_at": [1774747800, False]}, 422,
     "created_at[1]: expected a number of seconds"),
    ("post", "/v1/users/u/memories", {"vectors": [[True] + [0.0] * 15]}, 422, '"loc":["body","vectors",0,0]'),
    ("post", "/v1/users/u/memories", {"vectors": [["1.0"] + [0.0] * 15]}, 422, '"loc":["body","vectors",0,0]'),
    ("patch", "/v1/users/u/memories/taken", {"vectors": [1.0] * 15 + [False]}, 422, '"loc":["body","vectors",15]'),
    ("post", "/v1/users/u/search", {"vector": [True] + [0.0] * 15}, 422, '"loc":["body","vector",0]'),
    ("post", "/v1/users/u/search/batch", {"vectors": [[0.0] * 15 + [True]]}, 422, '"loc":["body","vectors",0,15]'),
    ("post", "/v1/memories:batch", {"items": [{"user_id": "u", "vector": [True] * 16}]}, 422,
     '"loc":["body","items",0,"vector",0]'),
    ("post", "/v1/memories:batchUpdate", {"items": [{"user_id": "u", "id": "taken", "vector": [True] * 16}]}, 422,
     '"loc":["body","items",0,"vector",0]'),
    ("post", "/v1/users/u/search", {"query": ""}, 400, "query is empty or whitespace only"),
    ("post", "/v1/users/u/search", {"query": " \n"}, 400, "query is empty or whitespace only"),
    ("post", "/v1/users/u/search/batch", {"queries": ["ok", ""]}, 400, "queries[1] is empty"),
    ("post", "/v1/users/u/memories", {"texts": [""]}, 400, "texts[0] is empty or whitespace only"),
    ("post", "/v1/users/u/memories", {"texts": ["ok", "\t "]}, 400, "texts[1] is empty or whitespace only"),
    ("get", "/v1/users/u/memories?limit=0", None, 422, "limit"),
    ("get", "/v1/users/u/memories?offset=-1", None, 422, "offset"),
    ("get", "/v1/users/u/memories?limit=1001", None, 422, "limit"),
    ("post", "/v1/users/u/memories/delete", {"ids": []}, 422, "ids"),
    ("post", "/v1/users/u/memories/delete", {"ids": ["taken", "nope"]}, 404, "nope"),
    ("delete", "/v1/users/ghost/memories/x", None, 404, "unknown user 'ghost'"),
    ("post", "/v1/users/u/memories", {"texts": ["a"], "metadata": nested(500)}, 400, "metadata[0] nests deeper"),
]


@pytest.mark.parametrize("method, path, body, status, field", BAD)
def test_bad_input_gets_a_4xx_naming_the_field_and_loses_nothing(served, method, path, body, status, field):
    c, mem = served
    c.post("/v1/users/u/memories", headers=H, json={"texts": ["kept"], "ids": ["taken"]})
    if body is None:
        r = c.request(method, path, headers=H)
    else:
        # json.dumps writes NaN as the bare token NaN, as a careless client would
        r = c.request(method, path, headers={**H, "content-type": "application/json"},
                      content=json.dumps(body, allow_nan=True))
    assert r.status_code == status, r.text
    assert field in r.text
    assert [(i.id, i.text) for i in mem.get_all("u")] == [("taken", "kept")]


def test_malformed_json_is_422(served):
    c, _ = served
    r = c.post("/v1/users/u/search", headers={**H, "content-type": "application/json"}, content=b"{not json")
    assert r.status_code == 422 and "json" in r.text.lower()


def test_metrics(served):
    c, _ = served
    c.post("/v1/users/u/memories", headers=H, json={"texts": ["a", "b"]})
    for _ in range(3):
        c.post("/v1/users/u/search", headers=H, json={"query": "a", "mode": "dense"})
    c.post("/v1/users/u/search", headers=H, json={"query": "zz", "k": 0})
    text = c.get("/metrics").text
    assert 'rfmem_http_requests_total{method="POST",route="/v1/users/{user_id}/search",status="200"} 3.0' in text
    assert 'rfmem_http_requests_total{method="POST",route="/v1/users/{user_id}/search",status="422"} 1.0' in text
    assert 'rfmem_http_request_duration_seconds_count{method="POST",route="/v1/users/{user_id}/search"} 4.0' in text
    assert 'rfmem_search_queries_total{cached="false",mode="dense",route="familiarity",rule="forced_dense"} 1.0' in text
    assert 'rfmem_search_queries_total{cached="true",mode="dense",route="familiarity",rule="forced_dense"} 2.0' in text
    assert 'rfmem_cache_hit_ratio{cache="results"} 0.6666666666666666' in text
    assert "rfmem_batch_size_count 1.0" in text and "rfmem_encode_seconds_count 1.0" in text
    assert "rfmem_items 2.0" in text and "rfmem_writes_total 1.0" in text and "rfmem_queue_depth 0.0" in text


def test_overload_is_503_not_a_hang(tmp_path):
    enc = HashEncoder(DIM)
    mem = Memory(tmp_path / "m", encoder=enc, max_batch=1, max_queue=1, max_wait_ms=0.0, cache_size=0)
    mem.add(None, "u", vectors=np.ones((1, DIM)))
    enc.gate = threading.Event()
    app = create_app(mem, no_auth=True)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            def post(i):
                return asyncio.create_task(client.post("/v1/users/u/search", json={"query": f"q{i}", "mode": "dense"}))

            tasks = [post(0)]
            while not enc.entered.is_set():  # the first request is inside the (blocked) encoder
                await asyncio.sleep(0.01)
            tasks += [post(i) for i in (1, 2, 3)]  # one fits in the queue, two do not
            await asyncio.sleep(0.3)
            enc.gate.set()
            return await asyncio.gather(*tasks)

    codes = sorted(r.status_code for r in asyncio.run(main()))
    assert codes == [200, 200, 503, 503]
    mem.close()


# ----------------------------------------------------------------------------- the real process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(path: Path, port: int, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rfmem_fast.cli", "serve", "--path", str(path), "--port", str(port),
           "--encoder", "none", "--dim", str(DIM), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"rfmem serve exited: {proc.stdout.read().decode()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("rfmem serve did not answer /health")


def test_rfmem_serve_killed_with_sigkill_restarts_with_every_acknowledged_write(tmp_path):
    env = dict(os.environ, RFMEM_API_KEY=KEY, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT))
    port = _free_port()
    proc = _start(tmp_path / "mem", port, env)
    base = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    acked = {}
    try:
        assert httpx.post(f"{base}/v1/users/u/memories", json={"vectors": [[1.0] * DIM]}).status_code == 401
        with httpx.Client(base_url=base, headers=H) as c:
            for i in range(20):
                user = f"user{i % 3}"
                r = c.post(f"/v1/users/{user}/memories", json={"vectors": rng.normal(size=(2, DIM)).tolist(),
                                                            "texts": [f"t{i}a", f"t{i}b"], "metadata": {"i": i}})
                assert r.status_code == 201
                acked.setdefault(user, []).extend(r.json()["ids"])
            victim = acked["user0"].pop(0)
            assert c.delete(f"/v1/users/user0/memories/{victim}").status_code == 200
            assert c.patch(f"/v1/users/user1/memories/{acked['user1'][0]}", json={"metadata": {"edited": True}}).status_code == 200
            before = {u: c.get(f"/v1/users/{u}/memories").json() for u in acked}
    finally:
        proc.send_signal(signal.SIGKILL)  # no shutdown hook, no checkpoint
        proc.wait(30)
    assert not any(p.name.startswith("store-") for p in (tmp_path / "mem").iterdir())  # only the log holds them
    proc = _start(tmp_path / "mem", port, env)
    try:
        with httpx.Client(base_url=base, headers=H) as c:
            after = {u: c.get(f"/v1/users/{u}/memories").json() for u in acked}
            assert after == before
            assert {u: [it["id"] for it in page["items"]] for u, page in after.items()} == acked
            assert after["user1"]["items"][0]["metadata"] == {"edited": True}
            hits = c.post("/v1/users/user2/search", json={"vector": [1.0] * DIM, "k": 3, "mode": "dense"}).json()["hits"]
            assert len(hits) == 3 and {h["id"] for h in hits} <= set(acked["user2"])
    finally:
        proc.send_signal(signal.SIGTERM)  # graceful: checkpoints on the way out
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its shutdown
    assert any(p.name.startswith("store-") for p in (tmp_path / "mem").iterdir())
    assert (tmp_path / "mem" / "wal.jsonl").stat().st_size == 0


def test_health_and_metrics_report_the_encoder_runtime_and_precision(tmp_path, monkeypatch):
    """/health's "encoder" names the runtime ("backend"), precision, device and dimension
    the encoder runs with, as the encoder says them; None where a custom encoder does not
    say; the asked values while the default encoder is not loaded yet."""
    import rfmem_fast.serving.memory as memory_module

    enc = HashEncoder(DIM)
    enc.backend, enc.dtype, enc.device = "onnx", "float32", "cpu"
    mem = Memory(tmp_path / "m", encoder=enc)
    with TestClient(create_app(mem, no_auth=True)) as c:
        assert c.get("/health").json()["encoder"] == {"model": "HashEncoder", "backend": "onnx", "dtype": "float32",
                                                      "device": "cpu", "dim": DIM, "loaded": True}
        assert ('rfmem_encoder_info{backend="onnx",device="cpu",dtype="float32",model="HashEncoder"} 1.0'
                in c.get("/metrics").text)
    mem.close()
    custom = Memory(encoder=HashEncoder(DIM))  # an encode() object that says nothing of its runtime
    with TestClient(create_app(custom, no_auth=True)) as c:
        assert c.get("/health").json()["encoder"] == {"model": "HashEncoder", "backend": None, "dtype": None,
                                                      "device": None, "dim": DIM, "loaded": True}
        assert 'rfmem_encoder_info{backend="None",device="None",dtype="None",model="HashEncoder"} 1.0' in c.get(
            "/metrics").text
    monkeypatch.setattr(memory_module, "_default_encoder", lambda **kw: pytest.fail("loaded by /health"))
    lazy = Memory(dim=DIM, encoder_backend="auto", encoder_dtype="auto")
    with TestClient(create_app(lazy, no_auth=True)) as c:
        assert c.get("/health").json()["encoder"] == {
            "model": "all-MiniLM-L6-v2 (default, not loaded yet)", "backend": "auto", "dtype": "auto",
            "device": "cpu", "dim": DIM, "loaded": False}
    vec_only = Memory(encoder=False, dim=DIM)
    with TestClient(create_app(vec_only, no_auth=True)) as c:
        assert c.get("/health").json()["encoder"] is None
        assert "rfmem_encoder_info" not in c.get("/metrics").text


def test_health_reports_the_retrieval_configuration_by_name(tmp_path):
    """/health's "config": the Memory's configuration by preset name and its main fields
    (RFMemConfig.summary), for the default (recommended), the paper's and a custom one."""
    from rfmem_fast import RFMemConfig

    for config, preset in ((None, "recommended"), (RFMemConfig.paper(), "paper"),
                           (RFMemConfig.paper(score_floor=-0.5, out_k=7), "custom")):
        mem = Memory(encoder=HashEncoder(DIM), config=config)
        with TestClient(create_app(mem, no_auth=True)) as c:
            got = c.get("/health").json()["config"]
        want = (config or RFMemConfig.recommended()).to_dict()
        assert got["preset"] == preset
        assert {k: v for k, v in got.items() if k not in ("preset", "router", "reranker", "second_stage")} == {
            k: want[k] for k in ("out_k", "lexical_weight", "fusion", "probe_k", "theta_high", "theta_low", "tau",
                                 "max_rounds", "score_floor", "merge", "context_weight", "context_radius",
                                 "thread_weight")}
        assert got["router"] is False and got["reranker"] is False
        assert got["second_stage"] is (want["second_stage"] is not None) is (preset == "recommended")
        mem.close()


def test_json_responses_keep_what_orjson_refuses(served):
    """Answers are serialised by orjson; an int beyond 64 bits in metadata (valid JSON,
    refused by orjson) falls back to the standard library instead of a 500."""
    c, _ = served
    big = 2**70
    r = c.post("/v1/users/u/memories", headers=H, json={"texts": ["a"], "ids": ["x"], "metadata": {"n": big, "s": "é"}})
    assert r.status_code == 201
    r = c.get("/v1/users/u/memories/x", headers=H)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert {k: v for k, v in r.json().items() if k != "created_at"} == {"id": "x", "text": "a", "metadata": {"n": big, "s": "é"},
                                                                                "thread": None, "position": None}
    r = c.post("/v1/users/u/search", headers=H, json={"query": "a", "k": 1, "mode": "dense"})
    assert r.status_code == 200 and r.json()["hits"][0]["metadata"] == {"n": big, "s": "é"}


def test_serve_refuses_a_bad_encoder_dtype(tmp_path, capsys):
    from rfmem_fast.cli import main
    from rfmem_fast.serving.app import serve

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--path", str(tmp_path / "m"), "--encoder-dtype", "fp8"])
    assert exc.value.code == 2 and "--encoder-dtype" in capsys.readouterr().err
    with pytest.raises(ValueError, match="encoder_dtype must be one of"):
        serve(str(tmp_path / "m"), encoder_dtype="fp8")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--path", str(tmp_path / "m"), "--encoder-backend", "tpu"])
    assert exc.value.code == 2 and "--encoder-backend" in capsys.readouterr().err
    with pytest.raises(ValueError, match="encoder_dtype must be one of .* with encoder_backend='torch'"):
        serve(str(tmp_path / "m"), encoder_backend="torch", encoder_dtype="int8")
    assert not (tmp_path / "m").exists()  # refused before anything was opened
