"""Conversations through the facade: ``thread`` / ``position`` at every door of a Memory
(Python, the write-ahead log, checkpoints, export / import, HTTP, MCP, the framework hit
metadata, the shards) and ``Hit.context_score`` against an independent float64 evaluation
of the context score's definition (RFMemConfig's docstring), with exact float32 dense
scores and a Counter-based BM25 (tests/_lexical_oracle.py) as the base scores."""
from __future__ import annotations

import io
import json
import sqlite3

import numpy as np
import pytest
from _exact_oracle import exact_f32, unit
from _lexical_oracle import bm25_scores
from _serving_helpers import HashEncoder, WordChunkEncoder

from rfmem_fast import Memory, RFMemConfig
from rfmem_fast.integrations import hit_metadata
from rfmem_fast.serving.memory import META_FILE, WAL_FILE
from rfmem_fast.serving.transfer import export_jsonl, import_jsonl
from rfmem_fast.serving.wal import WriteAheadLog, encode_array

DIM = 16
WORDS = ["trip", "japan", "cat", "tea", "flight", "kyoto", "spring", "chess", "piano", "garden"]
CONTEXT = dict(context_weight=0.5, thread_weight=0.3, second_stage=None)  # (the first stage: the definition)


def crash(mem: Memory) -> None:
    """Drop ``mem`` as a killed process would: no close(), no checkpoint (the lock released)."""
    mem._lock_file.close()


def conv_of(mem: Memory, user: str) -> list[tuple]:
    """(id, text, metadata, thread, position) of every item of ``user``, in insertion order."""
    return [(i.id, i.text, i.metadata, i.thread, i.position) for i in mem.get_all(user)]


def seeded(mem: Memory, seed: int = 0, n: int = 24) -> list[str]:
    """n items of user "u": threads of 1-5 turns (str and int ids, positions shuffled, some
    missing), some items without a thread; texts of 3 words (BM25 hits for the queries)."""
    rng = np.random.default_rng(seed)
    texts, threads, positions = [], [], []
    j = 0
    while j < n:
        size = int(rng.integers(1, 6))
        tid = int(rng.integers(100)) if rng.random() < 0.3 else f"chat-{j}"
        for o in rng.permutation(size)[: n - j]:
            if rng.random() < 0.15:
                threads.append(None)
                positions.append(None)
            else:
                threads.append(tid)
                positions.append(None if rng.random() < 0.15 else int(o))
            texts.append(" ".join(rng.choice(WORDS, size=3)) + f" {j}")
            j += 1
    meta = [{"keep": bool(rng.random() < 0.6)} for _ in range(n)]
    return mem.add(texts, "u", ids=[f"m{i}" for i in range(n)], metadata=meta, thread=threads, position=positions)


# --------------------------------------------------------------------------- the oracle
def context_scores(base: list[float], threads: list, positions: list, visible: list[bool], w_n: float, w_s: float,
                   r: int) -> list[float | None]:
    """Each visible item's c = b + w_n * max over N(i) of b + w_s * max over the thread of b
    (float64, in that order; N(i): the visible items of i's thread at most r ranks away in
    (position, row; no position last) order, i excluded; an item without a thread is a
    thread of its own); None for an invisible item."""
    order: dict = {}
    for i, (t, p) in enumerate(zip(threads, positions)):
        if visible[i] and t is not None:
            order.setdefault(t, []).append(i)
    for t in order:
        order[t].sort(key=lambda i: (positions[i] is None, positions[i] or 0, i))
    out: list[float | None] = []
    for i in range(len(base)):
        if not visible[i]:
            out.append(None)
            continue
        if threads[i] is None:
            m, top = 0.0, base[i]
        else:
            its = order[threads[i]]
            q = its.index(i)
            near = its[max(0, q - r):q] + its[q + 1:q + 1 + r]
            m = max(base[j] for j in near) if near else 0.0
            top = max(base[j] for j in its)
        out.append(base[i] + w_n * m + w_s * top)
    return out


def oracle_hits(mem: Memory, query, k: int, visible=None) -> list[tuple[str, np.float32, np.float32]]:
    """The exact top k of user "u" by c: (id, float32 base score, float32 c), best first
    (ties by insertion order). Base: exact float32 cosine, plus 0.03 * BM25 for a text
    query (``RFMemConfig.recommended()``: convex fusion of the raw BM25)."""
    cfg = mem.config
    assert cfg.fusion == "convex" and cfg.lexical_norm == "raw"
    items = mem.get_all("u")
    snap = mem.bank.snapshot()
    a = int(snap.offsets[snap.users.index("u")])
    qv = unit(mem.encoder.vector(query) if isinstance(query, str) else np.asarray(query, np.float32))
    dense = [float(exact_f32(qv, snap.vectors[a + j])) for j in range(len(items))]
    if isinstance(query, str):
        lex = bm25_scores([it.text for it in items], query, mem.bank.lexical_stemmer)
        base = [d + cfg.lexical_weight * float(x) for d, x in zip(dense, lex)]
    else:
        base = dense
    vis = [True] * len(items) if visible is None else [bool(visible(it)) for it in items]
    c = context_scores(base, [it.thread for it in items], [it.position for it in items], vis,
                       cfg.context_weight, cfg.thread_weight, cfg.context_radius)
    ranked = sorted((j for j in range(len(items)) if vis[j]), key=lambda j: (-c[j], j))[:k]
    return [(items[j].id, np.float32(base[j]), np.float32(c[j])) for j in ranked]


def got_hits(hits) -> list[tuple[str, np.float32, np.float32]]:
    return [(h.id, np.float32(h.score), np.float32(h.context_score)) for h in hits]


# --------------------------------------------------------------------------- Python
def test_context_score_of_the_hits_is_the_definition():
    mem = Memory(encoder=HashEncoder(DIM), config=RFMemConfig.recommended(**CONTEXT), batching=False)
    seeded(mem, seed=1, n=30)
    reordered = 0
    for query in ["trip japan kyoto", "cat tea", "chess flight 7", mem.encoder.vector("garden piano")]:
        want = oracle_hits(mem, query, 8)
        assert got_hits(mem.search(query, "u", k=8, mode="dense")) == want, query
        assert got_hits(mem.search(query, "u", k=8)) == want  # mode "rfmem": the recommended router never recollects
        reordered += any(a[1] < b[1] for a, b in zip(want, want[1:]))  # a hit above one of higher base score
    assert reordered >= 2  # the context score changes these rankings
    keep = {"keep": True}
    want = oracle_hits(mem, "trip japan kyoto", 30, visible=lambda it: it.metadata["keep"])
    hits = mem.search("trip japan kyoto", "u", k=30, filters=keep)  # ranks among the matching items only
    assert got_hits(hits) == want and len(hits) == sum(it.metadata["keep"] for it in mem.get_all("u"))
    in_thread = oracle_hits(mem, "cat tea", 30, visible=lambda it: it.thread == "chat-0" and (it.position or 0) >= 1)
    assert got_hits(mem.search("cat tea", "u", k=30, filters={"thread": "chat-0", "position": {"$gte": 1}})) == in_thread
    top = mem.search("cat tea", "u", k=3)
    assert [(h.thread, h.position) for h in top] == [(i.thread, i.position) for i in mem.get([h.id for h in top], "u")]
    reco = mem.search("cat tea", "u", k=5, mode="recollection")  # the Recollection path's hits, no context score
    assert len(reco) > 0 and all(h.context_score is None for h in reco)
    mem.close()
    plain = Memory(encoder=HashEncoder(DIM), batching=False,
                   config=RFMemConfig.recommended(context_weight=0.0, thread_weight=0.0))  # context off: no c
    seeded(plain, seed=1, n=30)
    hits = plain.search("trip japan kyoto", "u", k=5)
    assert [(h.id, np.float32(h.score)) for h in hits] == [x[:2] for x in oracle_hits(plain, "trip japan kyoto", 5)]
    assert all(h.context_score is None for h in hits) and any(h.thread is not None for h in hits)
    plain.close()


def test_python_doors_threads_positions_filters_and_updates():
    mem = Memory(encoder=HashEncoder(DIM), batching=False)
    ids = mem.add(["hello", "a trip", "to Japan"], "u", thread="c1", position=[0, 1, 2])
    mem.add("my cat", "u", ids=["cat"], thread=7, position=0)
    mem.add(["no thread"], "u", ids=["loose"])
    assert conv_of(mem, "u") == [(ids[0], "hello", {}, "c1", 0), (ids[1], "a trip", {}, "c1", 1),
                                 (ids[2], "to Japan", {}, "c1", 2), ("cat", "my cat", {}, 7, 0),
                                 ("loose", "no thread", {}, None, None)]
    assert mem.get("cat", "u")[0].to_dict()["thread"] == 7  # an int thread stays an int ("7" is another thread)

    def found(flt):
        return sorted(h.id for h in mem.search("hello", "u", k=10, mode="dense", filters=flt))

    assert found({"thread": "c1"}) == sorted(ids) and found({"thread": 7}) == ["cat"] and found({"thread": "7"}) == []
    assert found({"position": {"$gte": 1}}) == sorted(ids[1:]) and found({"thread": {"$exists": False}}) == ["loose"]
    mem.update("loose", "u", thread="c2")  # a thread only: the vector and the rest are kept
    mem.update(ids[2], "u", position=5, metadata={"m": 1})
    mem.update("cat", "u", thread=[None], position=[None])  # clear both
    assert conv_of(mem, "u")[2:] == [(ids[2], "to Japan", {"m": 1}, "c1", 5), ("cat", "my cat", {}, None, None),
                                     ("loose", "no thread", {}, "c2", None)]
    mem.add_many([{"user_id": "v", "text": "one", "id": "1", "thread": "t", "position": 0},
                  {"user_id": "v", "text": "two", "id": "2", "thread": "t"}])
    mem.update_many([{"user_id": "v", "id": "2", "position": 1}, {"user_id": "v", "id": "1", "thread": None,
                                                                  "position": None}])
    assert conv_of(mem, "v") == [("1", "one", {}, None, None), ("2", "two", {}, "t", 1)]
    exported = list(mem.export_items("v"))
    assert "thread" not in exported[0] and "position" not in exported[0]
    assert (exported[1]["thread"], exported[1]["position"]) == ("t", 1)
    mem.close()


@pytest.mark.parametrize("call, exc, match", [
    (lambda m: m.add("x", "u", position=3), ValueError, r"^position is 3 but the item has no thread.*give thread too"),
    (lambda m: m.add(["x", "y"], "u", thread=["t", None], position=[0, 1]), ValueError,
     r"^position\[1\] is 1 but the item has no thread.*give thread\[1\] too"),
    (lambda m: m.add(["x", "y"], "u", thread=["t"]), ValueError, r"^thread has 1 entries but there are 2 items"),
    (lambda m: m.add("x", "u", thread=True), TypeError, r"^thread must be None, one thread id"),
    (lambda m: m.add(["x", "y"], "u", thread=["t", 1.5]), TypeError, r"^thread\[1\] must be a str or an int"),
    (lambda m: m.add("x", "u", thread=""), ValueError, r"^thread must be a non-empty str"),
    (lambda m: m.add("x", "u", thread="x" * 257), ValueError, r"^thread is 257 characters long"),
    (lambda m: m.add("x", "u", thread=2**63), ValueError, r"^thread must be an int in \[-2\*\*63"),
    (lambda m: m.add("x", "u", thread="\ud800"), ValueError, r"^thread holds a lone surrogate"),
    (lambda m: m.add("x", "u", thread="t", position=-1), ValueError, r"^position must be an int in \[0, 2\*\*63 - 1\]"),
    (lambda m: m.add("x", "u", thread="t", position=1.0), TypeError, r"^position must be None, one int >= 0"),
    (lambda m: m.add("x", "u", thread="t", position="1"), TypeError, r"^position must be None, one int >= 0"),
    (lambda m: m.add(["x", "y"], "u", thread="t", position=[0, True]), TypeError, r"^position\[1\] must be an int"),
    (lambda m: m.update("taken", "u", thread=[None]), ValueError,
     r"^thread\[0\] clears the thread of item 'taken', which keeps its position 4"),
    (lambda m: m.update("loose", "u", position=2), ValueError, r"^position is 2 but the item has no thread"),
    (lambda m: m.add_many([{"user_id": "u", "text": "x", "position": 0}]), ValueError,
     r"^items\[0\]\.position is 0 but the item has no thread.*give items\[0\]\.thread too"),
    (lambda m: m.add_many([{"user_id": "u", "text": "x", "thread": ["t"]}]), TypeError, r"^items\[0\]\.thread must be"),
    (lambda m: m.update_many([{"user_id": "u", "id": "taken", "thread": None}]), ValueError,
     r"^items\[0\]\.thread clears the thread of item 'taken'"),
])
def test_bad_input_names_the_argument_and_writes_nothing(tmp_path, call, exc, match):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), batching=False)
    mem.add(["t", "l"], "u", ids=["taken", "loose"], thread=["c", None], position=[4, None])
    before, log = conv_of(mem, "u"), (tmp_path / "m" / WAL_FILE).read_bytes()
    with pytest.raises(exc, match=match) as info:
        call(mem)
    if match.startswith("^items"):
        assert info.value.index == 0 and info.value.field in ("thread", "position")
    assert conv_of(mem, "u") == before and (tmp_path / "m" / WAL_FILE).read_bytes() == log
    mem.close()


# --------------------------------------------------------------------------- the log, checkpoints, export / import
def writes(mem: Memory) -> None:
    mem.add(["a", "b", "c"], "alice", ids=["1", "2", "3"], thread=["s", "s", 9], position=[0, 1, None])
    mem.add(None, "bob", vectors=np.random.default_rng(0).normal(size=(2, DIM)), ids=["v1", "v2"], thread="s")
    mem.update("3", "alice", thread="s", position=2)
    mem.update("2", "alice", texts="b2")  # a new text keeps the thread
    mem.update_many([{"user_id": "bob", "id": "v2", "position": 7}, {"user_id": "alice", "id": "1", "metadata": {"k": 1}}])
    mem.add_many([{"user_id": "carol", "text": "x", "id": "c1", "thread": "t", "position": 3}])


def test_crash_replays_threads_and_a_checkpoint_keeps_them(tmp_path):
    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    writes(mem)
    expected = {u: conv_of(mem, u) for u in ("alice", "bob", "carol")}
    assert expected["alice"] == [("1", "a", {"k": 1}, "s", 0), ("2", "b2", {}, "s", 1), ("3", "c", {}, "s", 2)]
    assert [c[3:] for c in expected["bob"]] == [("s", None), ("s", 7)]
    crash(mem)  # nothing but the fsynced log holds the writes
    again = Memory(tmp_path / "m", encoder=HashEncoder(DIM))
    assert {u: conv_of(again, u) for u in expected} == expected and again.stats()["replayed"] == 6
    again.close()  # a checkpoint: the bank store holds the threads (format 6), the log is empty
    third = Memory(tmp_path / "m", encoder=False)
    assert {u: conv_of(third, u) for u in expected} == expected and third.stats()["replayed"] == 0
    third.close()


def test_a_log_written_without_threads_still_replays(tmp_path):
    """Records of the form written before conversations were kept (no threads / positions keys)."""
    mem = Memory(tmp_path / "m", encoder=False, dim=DIM)
    mem.close()
    vec = np.eye(DIM, dtype=np.float32)[:2]
    wal = WriteAheadLog(tmp_path / "m" / WAL_FILE)
    wal.append({"seq": 1, "op": "add", "user": "u", "ids": ["a", "b"], "texts": ["x", None], "metadata": None,
                "vectors": encode_array(vec)})
    wal.append({"seq": 2, "op": "update", "user": "u", "ids": ["a"], "texts": None, "metadata": [{"k": 1}],
                "vectors": None})
    wal.close()
    again = Memory(tmp_path / "m", encoder=False)
    assert conv_of(again, "u") == [("a", "x", {"k": 1}, None, None), ("b", None, {}, None, None)]
    again.update("b", "u", thread="t", position=0)
    again.close()
    assert json.loads((tmp_path / "m" / META_FILE).read_text())["wal_seq"] == 3


def test_export_import_round_trip_with_threads(tmp_path):
    src = Memory(tmp_path / "src", encoder=HashEncoder(DIM), batching=False)
    writes(src)
    first = io.StringIO()
    export_jsonl(src, first, vectors=True)
    lines = [json.loads(x) for x in first.getvalue().splitlines()]
    assert [(x["id"], x.get("thread"), x.get("position")) for x in lines if x["user_id"] == "alice"] == [
        ("1", "s", 0), ("2", "s", 1), ("3", "s", 2)]
    assert {"thread": "s", "position": 7}.items() <= lines[4].items() and "position" not in lines[3]
    dst = Memory(tmp_path / "dst", encoder=HashEncoder(DIM), batching=False)
    import_jsonl(dst, io.StringIO(first.getvalue()))
    second = io.StringIO()
    export_jsonl(dst, second, vectors=True)
    assert second.getvalue() == first.getvalue()  # byte for byte, threads and positions included
    # a file without the fields imports (items without a conversation); an int thread stays an int
    old = '{"id":"o1","user_id":"x","text":"old line","metadata":{}}\n{"id":"o2","user_id":"x","text":"t","thread":5}\n'
    import_jsonl(dst, io.StringIO(old))
    assert conv_of(dst, "x") == [("o1", "old line", {}, None, None), ("o2", "t", {}, 5, None)]
    bad = '{"id":"o3","user_id":"x","text":"y","position":2}\n'
    with pytest.raises(ValueError, match=r"^line 1: position is 2 but the item has no thread"):
        import_jsonl(dst, io.StringIO(bad))
    src.close()
    dst.close()


def test_chunk_rows_follow_their_items_thread():
    """A long text's chunk rows carry its thread and position: a filter on the old thread
    finds nothing once the item moved, and the item comes back once."""
    mem = Memory(encoder=WordChunkEncoder(DIM), batching=False, chunk_overlap=2)
    long = " ".join(f"w{i}" for i in range(20))  # 5 chunk rows (windows of 6 words, 2 shared)
    mem.add([long, "short one"], "u", ids=["long", "s"], thread="a", position=[0, 1])
    assert mem.bank.user_size("u") > 2 and set(mem.bank.threads_of("u")) == {"a"}
    mem.update("long", "u", thread="b", position=3)
    assert set(zip(mem.bank.threads_of("u"), mem.bank.positions_of("u"))) == {("b", 3), ("a", 1)}
    hits = mem.search("w3 w4 w5", "u", k=5, mode="dense", filters={"thread": "a"})
    assert [h.id for h in hits] == ["s"]
    hits = mem.search("w3 w4 w5", "u", k=5, mode="dense", filters={"thread": "b"})
    assert [(h.id, h.text, h.thread, h.position) for h in hits] == [("long", long, "b", 3)]
    mem.update("long", "u", texts=long + " more words here", position=4)  # new chunk rows: the item's thread
    assert set(zip(mem.bank.threads_of("u"), mem.bank.positions_of("u"))) == {("b", 4), ("a", 1)}
    mem.close()


def test_framework_hit_metadata_carries_the_conversation():
    mem = Memory(encoder=HashEncoder(DIM), config=RFMemConfig.recommended(**CONTEXT), batching=False)
    mem.add(["alpha", "beta"], "u", ids=["a", "b"], thread="t", position=[0, 1])
    hit = mem.search("alpha", "u", k=1)[0]
    meta = hit_metadata(hit)["rfmem"]
    assert (meta["thread"], meta["position"], meta["context_score"]) == ("t", 0, hit.context_score)
    assert hit.context_score is not None and hit.to_dict()["thread"] == "t"
    mem.close()


# --------------------------------------------------------------------------- HTTP
def test_http_threads_hits_filters_patch_bulk_and_errors(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rfmem_fast.serving.app import create_app

    mem = Memory(tmp_path / "m", encoder=HashEncoder(DIM), config=RFMemConfig.recommended(**CONTEXT), max_wait_ms=1.0)
    with TestClient(create_app(mem, no_auth=True)) as c:
        r = c.post("/v1/users/u/memories", json={"texts": ["trip japan", "kyoto spring", "cat tea"],
                                                 "ids": ["1", "2", "3"], "thread": ["s", "s", 4], "position": [0, 1, None]})
        assert r.status_code == 201
        r = c.post("/v1/memories:batch", json={"items": [{"user_id": "u", "id": "4", "text": "chess piano",
                                                          "thread": "s", "position": 2}]})
        assert r.status_code == 201
        body = c.post("/v1/users/u/search", json={"query": "trip japan", "k": 4}).json()
        direct = mem.search("trip japan", "u", k=4)
        assert [(h["id"], h["thread"], h["position"], h["score"], h["context_score"]) for h in body["hits"]] == [
            (h.id, h.thread, h.position, h.score, h.context_score) for h in direct]
        assert got_hits(direct) == oracle_hits(mem, "trip japan", 4)
        flt = c.post("/v1/users/u/search", json={"query": "trip japan", "k": 4, "filters": {"thread": 4}}).json()
        assert [h["id"] for h in flt["hits"]] == ["3"]
        assert c.patch("/v1/users/u/memories/3", json={"thread": "s", "position": 3}).status_code == 200
        item = c.get("/v1/users/u/memories/3").json()
        assert (item["thread"], item["position"]) == ("s", 3)
        assert c.patch("/v1/users/u/memories/3", json={"thread": None, "position": None}).status_code == 200
        assert [(it["id"], it["thread"], it["position"]) for it in c.get("/v1/users/u/memories").json()["items"]] == [
            ("1", "s", 0), ("2", "s", 1), ("3", None, None), ("4", "s", 2)]
        r = c.post("/v1/memories:batchUpdate", json={"items": [{"user_id": "u", "id": "4", "thread": None}]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "items", 0, "thread"]
        r = c.patch("/v1/users/u/memories/4", json={"thread": None})
        assert r.status_code == 400 and r.json()["detail"].startswith("thread clears the thread of item '4'")
        for body, loc, msg in [
            ({"texts": ["x"], "position": 3}, ["body"], "position is 3 but the item has no thread"),
            ({"texts": ["x"], "thread": True}, ["body", "thread"], "thread must be None, one thread id"),
            ({"texts": ["x"], "thread": ""}, ["body", "thread"], "thread must be a non-empty str"),
            ({"texts": ["x"], "thread": "t", "position": -1}, ["body", "position"], "position must be an int in [0"),
            ({"texts": ["x"], "thread": "t", "position": 1.0}, ["body", "position"], "position must be None, one int"),
            ({"texts": ["x"], "thread": "t", "position": "1"}, ["body", "position"], "position must be None, one int"),
            ({"texts": ["x", "y"], "thread": ["t"]}, ["body"], "thread has 1 entries but there are 2 items"),
            ({"texts": ["x"], "thread": "t", "position": [0, 1]}, ["body"], "position has 2 entries"),
        ]:
            r = c.post("/v1/users/u/memories", json=body)
            assert r.status_code == 422, body
            err = r.json()["detail"][0]
            assert err["loc"] == loc and msg in err["msg"], (body, err)
        r = c.post("/v1/memories:batch", json={"items": [{"user_id": "u", "text": "x", "position": 1}]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "items", 0, "position"]
        r = c.post("/v1/memories:batch", json={"items": [{"user_id": "u", "text": "x", "thread": False}]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][:4] == ["body", "items", 0, "thread"]
    crash(mem)
    again = Memory(tmp_path / "m", encoder=HashEncoder(DIM))  # the HTTP writes replay with their threads
    assert [(i.id, i.thread, i.position) for i in again.get_all("u")] == [
        ("1", "s", 0), ("2", "s", 1), ("3", None, None), ("4", "s", 2)]
    again.close()


# --------------------------------------------------------------------------- MCP
def test_mcp_add_memories_threads_and_search_hits(tmp_path):
    pytest.importorskip("mcp")
    import anyio
    from mcp.server.mcpserver.exceptions import ToolError

    from rfmem_fast.serving.mcp_server import McpScope, create_server

    mem = Memory(encoder=HashEncoder(DIM), config=RFMemConfig.recommended(**CONTEXT), batching=False)
    server = create_server(mem, McpScope(user="u"))

    def call(tool: str, args: dict) -> dict:
        async def go():
            return await server.call_tool(tool, args)
        return anyio.run(go).structured_content

    try:
        added = call("add_memories", {"texts": ["trip japan", "kyoto spring", "cat tea"], "thread": "s",
                                      "position": [0, 1, None]})
        one = call("add_memories", {"texts": "chess piano", "thread": 4, "position": 0})
        ids = added["ids"] + one["ids"]
        found = call("search_memories", {"query": "trip japan", "k": 4})
        direct = mem.search("trip japan", "u", k=4)
        assert [(h["id"], h["thread"], h["position"], h["context_score"]) for h in found["hits"]] == [
            (h.id, h.thread, h.position, h.context_score) for h in direct]
        assert got_hits(direct) == oracle_hits(mem, "trip japan", 4)
        only = call("search_memories", {"query": "trip japan", "k": 4, "filters": {"thread": 4}})
        assert [h["id"] for h in only["hits"]] == one["ids"]
        listed = call("list_memories", {})["memories"]
        assert [(m["id"], m["thread"], m["position"]) for m in listed] == [
            (ids[0], "s", 0), (ids[1], "s", 1), (ids[2], "s", None), (ids[3], 4, 0)]
        for args, clause in [
            ({"texts": "x", "position": 2}, "position is 2 but the item has no thread"),
            ({"texts": ["x", "y"], "thread": ["s"]}, "thread: a list needs one entry per text (2), got 1"),
            ({"texts": "x", "thread": "s", "position": -1}, "position: input should be greater than or equal to 0"),
            ({"texts": "x", "thread": True}, "thread"),
        ]:
            with pytest.raises(ToolError) as err:
                call("add_memories", args)
            assert clause in str(err.value), (args, str(err.value))
        assert mem.count("u") == 4
    finally:
        mem.close()


# --------------------------------------------------------------------------- the shards
def test_shard_forwards_threads_logs_them_and_searches_with_the_context(tmp_path):
    from rfmem_fast import MemoryBank, search
    from rfmem_fast.distributed import ShardServer
    from rfmem_fast.distributed.wal import WriteAheadLog as ShardLog

    rng = np.random.default_rng(3)
    X = rng.normal(size=(12, DIM)).astype(np.float32)
    threads = ["a"] * 5 + [np.int64(3)] * 4 + [None] * 3  # (numpy ints stored as int)
    positions = [4, 3, 2, 1, 0, 0, 1, None, 2, None, None, None]
    shard = ShardServer(0, 1, DIM, home=str(tmp_path / "h"))
    shard.add("u", X[:9], [f"i{j}" for j in range(9)], threads=threads[:9], positions=positions[:9])
    shard.add("u", X[9:], [f"i{j}" for j in range(9, 12)])
    rows = shard.bank.snapshot().vectors.copy()
    shard.update("u", ["i11"], None, threads=["a"], positions=[9])  # the row kept bit for bit
    shard.close()
    again = ShardServer(0, 1, DIM, home=str(tmp_path / "h"))  # replays its log
    want_t = ["a"] * 5 + [3] * 4 + [None] * 2 + ["a"]
    want_p = positions[:11] + [9]
    assert again.bank.threads_of("u") == want_t and again.bank.positions_of("u") == want_p
    assert np.array_equal(again.bank.snapshot().vectors, rows)
    single = MemoryBank(DIM)
    single.add("u", X, [f"i{j}" for j in range(12)], threads=want_t, positions=want_p)
    cfg = RFMemConfig(out_k=6, probe_k=6, **CONTEXT)
    Q = rng.normal(size=(3, DIM)).astype(np.float32)
    res, _ = again.search(Q, ["u"] * 3, np.arange(3), cfg, "dense", None, 8)
    ref = search(single, Q, ["u"] * 3, config=cfg, mode="dense")
    assert np.array_equal(res.ids, ref.ids) and np.array_equal(res.context_scores, ref.context_scores)
    assert np.isfinite(res.context_scores).all()
    again.close()
    # a log of the table without the conversation columns gets them on open
    db = sqlite3.connect(tmp_path / "old.sqlite")
    db.execute("CREATE TABLE wal (version INTEGER PRIMARY KEY, op TEXT NOT NULL, user TEXT NOT NULL, ids TEXT NOT NULL,"
               " texts TEXT, rows INTEGER NOT NULL, dim INTEGER NOT NULL, vectors BLOB)")
    db.execute("INSERT INTO wal VALUES (1, 'add', '\"u\"', '[\"a\"]', NULL, 1, ?, ?)", (DIM, X[:1].tobytes()))
    db.commit()
    db.close()
    old = ShardLog(tmp_path / "old.sqlite")
    (rec,) = old.records(0)
    assert (rec.ids, rec.threads, rec.positions) == (["a"], None, None)
    old.close()
