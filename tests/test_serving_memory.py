"""rfmem_fast.Memory: the text facade, micro-batching, the hot-query cache, isolation.

Uses vectors and a tiny deterministic encoder (tests/_serving_helpers.HashEncoder); the
real MiniLM runs in tests/test_serving_text.py. Reference answers come from
``rfmem_fast.search`` called directly, one query per call.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _serving_helpers import HashEncoder, clustered_memory_data
from hypothesis import given, settings
from hypothesis import strategies as st

from rfmem_fast import Memory, RFMemConfig, search
from rfmem_fast.serving import QueueFullError, RequestTimeoutError
from rfmem_fast.serving.batcher import MicroBatcher

DIM = 16


def new_memory(**kw) -> Memory:
    """A Memory with the paper's RF-Mem (both paths, dense), what these tests compare with the
    engine; a Memory's own default (hybrid, never recollecting) is tests/test_serving_defaults.py's."""
    kw.setdefault("encoder", HashEncoder(DIM))
    kw.setdefault("config", RFMemConfig.paper())
    return Memory(**kw)


def reference(mem: Memory, vec, user, k, mode):
    """The unbatched answer: one direct rfmem_fast.search call for this one query."""
    res = search(mem.bank, np.asarray(vec, np.float32)[None], [user], config=mem.config.replace(out_k=k), mode=mode)
    keep = res.rows[0] >= 0
    text_of = dict(zip(mem.bank.item_ids_of(user), mem.bank.texts_of(user)))
    ids = [i for i, ok in zip(res.ids[0], keep) if ok]
    return dict(ids=ids, scores=res.scores[0][keep].tolist(), texts=[text_of[i] for i in ids],
                route=res.route_names[0], rule=res.rule_names[0], mean=float(res.mean[0]),
                entropy=float(res.entropy[0]), rounds=int(res.rounds[0]))


def as_dict(hits):
    return dict(ids=[h.id for h in hits], scores=[h.score for h in hits], texts=[h.text for h in hits],
                route=hits.route, rule=hits.rule, mean=hits.mean, entropy=hits.entropy, rounds=hits.rounds)


@pytest.fixture(scope="module")
def clustered():
    return clustered_memory_data()


def fill(mem: Memory, items: dict) -> None:
    for user, X in items.items():
        mem.add([f"{user} item {i}" for i in range(len(X))], user, vectors=X,
                ids=[f"{user}-{i}" for i in range(len(X))], metadata=[{"owner": user, "i": i} for i in range(len(X))])


# ----------------------------------------------------------------------------- facade
def test_text_add_search_matches_direct_search():
    enc = HashEncoder(DIM)
    mem = new_memory(encoder=enc, batching=False)
    texts = [f"fact number {i}" for i in range(30)]
    ids = mem.add(texts, "alice", metadata={"source": "chat"})
    assert len(ids) == 30 and len(set(ids)) == 30 and all(isinstance(i, str) for i in ids)
    for mode in ("rfmem", "dense", "recollection"):
        hits = mem.search("fact number 7", "alice", k=5, mode=mode)
        ref = reference(mem, enc.vector("fact number 7"), "alice", 5, mode)
        assert as_dict(hits) == ref
        assert all(h.metadata == {"source": "chat"} and h.user_id == "alice" for h in hits)
        assert [h.rank for h in hits] == list(range(len(hits)))
    top = mem.search("fact number 7", "alice", k=1, mode="dense")[0]
    assert top.text == "fact number 7" and top.score == pytest.approx(1.0) and top.id == ids[7]


def test_vectors_instead_of_text_and_vectors_only_memory(clustered):
    items, queries = clustered
    mem = Memory(encoder=False, dim=DIM, batching=False, config=RFMemConfig.paper())
    fill(mem, items)
    user, q = queries[0]
    assert as_dict(mem.search(q, user, k=4)) == reference(mem, q, user, 4, "rfmem")
    assert as_dict(mem.search(q.tolist(), user, k=4)) == reference(mem, q, user, 4, "rfmem")  # plain list
    with pytest.raises(ValueError, match="no text encoder"):
        mem.search("a text", user)
    with pytest.raises(ValueError, match="no text encoder"):
        mem.add(["a text"], user)
    batch = mem.search_batch(np.stack([q for _, q in queries[:6]]), [u for u, _ in queries[:6]], k=3)
    for (u, q), hits in zip(queries[:6], batch):
        assert as_dict(hits) == reference(mem, q, u, 3, "rfmem")


def test_update_delete_get_all_get():
    mem = new_memory(batching=False)
    ids = mem.add(["a", "b", "c"], "u", ids=["1", "2", "3"], metadata=[{"m": 1}, None, {"m": 3}])
    assert ids == ["1", "2", "3"]
    assert [(i.id, i.text, i.metadata) for i in mem.get_all("u")] == [("1", "a", {"m": 1}), ("2", "b", {}), ("3", "c", {"m": 3})]
    mem.update("2", "u", texts="b2", metadata={"m": 2})
    assert mem.get(["2"], "u")[0].text == "b2" and mem.get("2", "u")[0].metadata == {"m": 2}
    assert mem.search("b2", "u", k=1, mode="dense")[0].id == "2"  # re-encoded with the new text
    mem.update(["3"], "u", metadata=[None])  # clears
    assert mem.get("3", "u")[0].metadata == {}
    mem.delete(["1", "3"], "u")
    assert [i.id for i in mem.get_all("u")] == ["2"]
    assert all(h.id == "2" for h in mem.search("a", "u", mode="recollection"))
    assert mem.get_all("nobody") == [] and mem.users() == ["u"]
    with pytest.raises(KeyError, match="'1'"):
        mem.get("1", "u")
    with pytest.raises(KeyError, match="holds no item id '9'"):
        mem.delete("9", "u")
    with pytest.raises(KeyError, match="unknown user"):
        mem.update("2", "ghost", texts="x")


def test_hit_metadata_is_the_callers_copy():
    mem = new_memory()
    mem.add(["x"], "u", metadata={"tags": ["a"]})
    h1 = mem.search("x", "u")
    h1[0].metadata["tags"].append("mutated")
    h2 = mem.search("x", "u")  # served from the cache
    assert h2.cached and h2[0].metadata == {"tags": ["a"]}
    assert mem.get_all("u")[0].metadata == {"tags": ["a"]}


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda m: m.search("q", "u", mode="fast"), ValueError, "mode must be one of"),
        (lambda m: m.search("q", "u", k=0), ValueError, r"k must be an int in \[1, 1000\]"),
        (lambda m: m.search("q", "u", k=2.5), ValueError, r"k must be an int in \[1, 1000\]"),
        (lambda m: m.search("q", "u", k=10**9), ValueError, r"^k must be an int in \[1, 1000\] or None, got 1000000000"),
        (lambda m: m.search("q", "u", k="2"), ValueError, r"k must be an int"),
        (lambda m: m.search(["a", "b"], "u"), TypeError, "use Memory.search_batch"),
        (lambda m: m.search("", "u"), ValueError, "query is empty or whitespace only"),
        (lambda m: m.search(" \t\n", "u"), ValueError, "query is empty or whitespace only"),
        (lambda m: m.search("bad \ud800", "u"), ValueError, "query holds a lone surrogate"),
        (lambda m: m.search_batch(["ok", "bad \udfff"], "u"), ValueError, r"queries\[1\] holds a lone surrogate"),
        (lambda m: m.search("q", "u\ud800"), ValueError, "user_id holds a lone surrogate"),
        (lambda m: m.search("q", ""), ValueError, "user_id must be a non-empty str"),
        (lambda m: m.add(["bad \ud800 text"], "u"), ValueError, r"texts\[0\] holds a lone surrogate"),
        (lambda m: m.add(["ok", "bad \ud800"], "u", vectors=np.ones((2, 16))), ValueError, r"texts\[1\] holds a lone surrogate"),
        (lambda m: m.add(["a"], "u", metadata={"k": "v\udfff"}), ValueError, r"metadata\[0\] \(as JSON\) holds a lone surrogate"),
        (lambda m: m.add(["a"], "u", metadata=[{"v\udfff": 1}]), ValueError, r"metadata\[0\] \(as JSON\) holds a lone surrogate"),
        (lambda m: m.add(["a"], "u", ids=["i\ud800"]), ValueError, r"ids\[0\] holds a lone surrogate"),
        (lambda m: m.add([""], "u"), ValueError, r"texts\[0\] is empty or whitespace only"),
        (lambda m: m.add(["ok", "  \n"], "u"), ValueError, r"texts\[1\] is empty or whitespace only"),
        (lambda m: m.add([" "], "u", vectors=np.ones((1, 16))), ValueError, r"texts\[0\] is empty"),
        (lambda m: m.update("taken", "u", texts="\t"), ValueError, r"^texts is empty or whitespace only"),
        (lambda m: m.add(["a", "b"], "u", ids=[1, "1"]), ValueError, "duplicate item id '1'"),
        (lambda m: m.add(["a"], "u", ids=[""]), ValueError, r"ids\[0\] must be a non-empty str"),
        (lambda m: m.add(["a"], "u", ids=["x" * 257]), ValueError, r"ids\[0\] is 257 characters long"),
        (lambda m: m.add(["a" * 100_001], "u"), ValueError, r"texts\[0\] is 100001 characters long"),
        (lambda m: m.get_all("u", offset=-1), ValueError, "offset must be an int >= 0"),
        (lambda m: m.get_all("u", limit=0), ValueError, "limit must be an int >= 1"),
        (lambda m: m.search("q", 1.5), TypeError, "user_id must be a str or an int"),
        (lambda m: m.search(b"q", "u"), TypeError, "query must be a str or a 1-D vector"),
        (lambda m: m.search(np.ones(3), "u"), ValueError, "query must have dimension 16"),
        (lambda m: m.search(np.zeros(16), "u"), ValueError, "query row 0 has zero norm"),
        (lambda m: m.search([[1.0] * 16], "u"), ValueError, "1-D vector"),
        (lambda m: m.search_batch(["a", "b"], ["u"]), ValueError, "user_ids has 1 entries but queries has 2"),
        (lambda m: m.search_batch(["a", 3], "u"), TypeError, r"queries\[1\] must be a str or a 1-D vector"),
        (lambda m: m.add(None, "u"), ValueError, "needs texts or vectors"),
        (lambda m: m.add(["a", "b"], "u", ids=["1"]), ValueError, "ids has 1 entries but there are 2 items"),
        (lambda m: m.add(["a"], "u", vectors=np.ones((2, 16))), ValueError, "texts has 1 entries but vectors has 2"),
        (lambda m: m.add(["a"], "u", vectors=np.full((1, 16), np.nan)), ValueError, "NaN or Inf"),
        (lambda m: m.add(["a"], "u", metadata=[{"x": {1, 2}}]), ValueError, r"^metadata\[0\] is not JSON-serialisable"),
        (lambda m: m.add(["a"], "u", metadata="tag"), TypeError, "metadata must be a dict"),
        (lambda m: m.add([1], "u"), TypeError, r"texts\[0\] must be a str"),
        (lambda m: m.add(["a", "b"], "u", ids=["x", "x"]), ValueError, "duplicate item id 'x'"),
        (lambda m: m.add(["dup"], "u", ids=["taken"]), ValueError, "already holds item id 'taken'"),
        (lambda m: m.update("taken", "u"), ValueError, "needs texts, vectors, metadata, thread or position"),
        (lambda m: m.delete([], "u"), ValueError, "at least one item id"),
    ],
)
def test_bad_input_gets_a_clear_error_and_writes_nothing(tmp_path, call, exc, match):
    mem = new_memory(path=tmp_path / "m")
    mem.add(["t"], "u", ids=["taken"])
    before = (mem.bank.version, [(i.id, i.text, i.metadata) for i in mem.get_all("u")])
    with pytest.raises(exc, match=match):
        call(mem)
    assert (mem.bank.version, [(i.id, i.text, i.metadata) for i in mem.get_all("u")]) == before
    mem.close()
    reopened = Memory(tmp_path / "m", encoder=False)
    assert [(i.id, i.text) for i in reopened.get_all("u")] == [("taken", "t")]


def test_unknown_user_and_empty_memory_answer_empty():
    mem = new_memory()
    hits = mem.search("q", "nobody")
    assert hits == [] and hits.rule == "unknown_user" and hits.route is None
    mem.add(["a"], "u", ids=["1"])
    mem.delete("1", "u")
    hits = mem.search("q", "u")
    assert hits == [] and hits.rule == "no_hits"


# ----------------------------------------------------------------------------- isolation
@settings(max_examples=20)
@given(st.lists(st.tuples(st.sampled_from(["ann", "bob", 3, 4, "3"]), st.integers(1, 5)), min_size=1, max_size=8),
       st.integers(0, 2**31 - 1))
def test_isolation_a_query_only_ever_sees_its_own_users_items(adds, seed):
    """Users with overlapping item ids and identical texts: every hit (batched, cached,
    unbatched) is the query's user's own item. Int user ids are their decimal str (the
    id model): 3 and "3" are one user."""
    rng = np.random.default_rng(seed)
    mem = new_memory(max_wait_ms=5.0)
    owner = {}
    for user, n in adds:
        got = {i.id for i in mem.get_all(user)}
        ids = [f"i{j}" for j in range(len(got), len(got) + n)]  # the same ids for every user
        mem.add(["shared text"] * n, user, ids=ids, metadata={"owner": str(user)},
                vectors=rng.normal(size=(n, DIM)))
        owner[str(user)] = owner.get(str(user), 0) + n
    users = list(owner) + ["stranger", 4]
    queries = ["shared text", "other"]
    with ThreadPoolExecutor(8) as pool:
        futs = [(u, mode, pool.submit(mem.search, q, u, 3, mode))
                for u in users for q in queries * 2 for mode in ("rfmem", "dense")]
        results = [(u, mode, f.result()) for u, mode, f in futs]
    results += [(u, "rfmem", h) for u in users for h in mem.search_batch(queries, u, k=3)]
    for user, mode, hits in results:
        user = str(user)
        assert hits.user_id == user and all(h.user_id == user for h in hits)
        assert all(h.metadata == {"owner": user} for h in hits)
        # dense returns the top-k; recollection drops candidates under score_floor
        assert len(hits) == min(3, owner.get(user, 0)) if mode == "dense" else len(hits) <= min(3, owner.get(user, 0))


# ----------------------------------------------------------------------------- batching
def test_threaded_callers_get_exactly_their_unbatched_results(clustered):
    """120 concurrent callers across 5 users, 3 modes and 2 k values, text (through the
    batched encoder) and vector queries: each answer equals one direct search call."""
    items, queries = clustered
    enc = HashEncoder(DIM)
    mem = new_memory(encoder=enc, max_batch=32, max_wait_ms=30.0, cache_size=0)
    fill(mem, items)
    calls = []
    for n, (user, vec) in enumerate(queries):
        text = f"query {n}"
        enc.overrides[text] = vec
        for mode in ("rfmem", "dense", "recollection"):
            calls.append((text if n % 2 else vec, user, 3 + 4 * (n % 2), mode, vec))
    enc.calls.clear()
    start = threading.Barrier(24, timeout=30)

    def one(n):
        query, user, k, mode, _ = calls[n]
        if n < 24:
            start.wait()  # the first 24 start together
        return mem.search(query, user, k=k, mode=mode)

    with ThreadPoolExecutor(24) as pool:
        got = list(pool.map(one, range(len(calls))))
    routes = set()
    for (query, user, k, mode, vec), hits in zip(calls, got):
        assert as_dict(hits) == reference(mem, vec, user, k, mode)
        assert all(h.metadata["owner"] == user for h in hits)
        routes.add(hits.route)
    assert routes == {"familiarity", "recollection"}
    st_ = mem.stats()["batcher"]
    assert st_["requests"] == len(calls) and st_["largest_batch"] > 1 and st_["batches"] < len(calls)
    texts = [c[0] for c in calls if isinstance(c[0], str)]
    # batched encoder calls; a text asked twice in one batch is encoded once
    assert max(enc.calls) > 1 and len(set(texts)) <= sum(enc.calls) <= len(texts)


def test_asyncio_callers_get_exactly_their_unbatched_results(clustered):
    items, queries = clustered
    enc = HashEncoder(DIM)
    mem = new_memory(encoder=enc, max_batch=64, max_wait_ms=20.0, cache_size=0)
    fill(mem, items)
    for n, (_, vec) in enumerate(queries):
        enc.overrides[f"q{n}"] = vec
    modes = ("rfmem", "dense", "recollection")

    async def main():
        return await asyncio.gather(*(mem.asearch(f"q{n}", u, k=5, mode=modes[n % 3]) for n, (u, _) in enumerate(queries)))

    got = asyncio.run(main())
    for n, ((user, vec), hits) in enumerate(zip(queries, got)):
        assert as_dict(hits) == reference(mem, vec, user, 5, modes[n % 3])
    assert mem.stats()["batcher"]["largest_batch"] > 1


def test_one_bad_request_fails_alone():
    enc = HashEncoder(DIM)
    mem = new_memory(encoder=enc, max_wait_ms=50.0)
    mem.add(["a", "b"], "u")
    fails = {"on": True}
    real = enc.encode

    def flaky(texts):
        if fails["on"] and "boom" in texts:
            raise RuntimeError("encoder exploded")
        return real(texts)

    enc.encode = flaky
    with ThreadPoolExecutor(3) as pool:
        ok = pool.submit(mem.search, np.ones(DIM), "u", mode="dense")  # a vector: not encoded
        ghost = pool.submit(mem.search, "a", "ghost")
        bad = pool.submit(mem.search, "boom", "u", mode="dense")
        assert len(ok.result()) == 2 and ghost.result().rule == "unknown_user"
        with pytest.raises(RuntimeError, match="encoder exploded"):
            bad.result()
    fails["on"] = False
    assert len(mem.search("boom", "u", mode="dense")) == 2  # the batcher keeps working


def test_full_queue_and_timeout_raise_instead_of_hanging():
    enc = HashEncoder(DIM)
    mem = new_memory(encoder=enc, max_batch=1, max_queue=2, max_wait_ms=0.0, timeout=10.0, cache_size=0)
    mem.add(None, "u", vectors=np.ones((1, DIM)))
    enc.gate = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(mem.search, "q0", "u", mode="dense")  # blocks inside the encoder
        assert enc.entered.wait(10)
        queued = [pool.submit(mem.search, f"q{i}", "u", mode="dense") for i in (1, 2)]
        deadline = 100
        while mem.stats()["batcher"]["queue_depth"] < 2 and deadline:
            threading.Event().wait(0.02)
            deadline -= 1
        with pytest.raises(QueueFullError, match="queue is full"):
            mem.search("q3", "u")
        with pytest.raises(QueueFullError):
            asyncio.run(mem.asearch("q4", "u"))
        enc.gate.set()
        assert len(first.result(10)) == 1 and all(len(f.result(10)) == 1 for f in queued)
    assert mem.stats()["batcher"]["rejected"] == 2
    enc.gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(mem.search, "q5", "u", mode="dense")
        assert enc.entered.wait(10)
        with pytest.raises(RequestTimeoutError, match="timeout=0.2"):
            mem.search("q6", "u", timeout=0.2)
        with pytest.raises(RequestTimeoutError):
            asyncio.run(mem.asearch("q7", "u", timeout=0.2))
        enc.gate.set()
        blocker.result(10)
    assert mem.stats()["batcher"]["timeouts"] == 2


def test_micro_batcher_contract():
    seen = []

    def run(items):
        seen.append(list(items))
        return [ValueError(f"bad {x}") if x < 0 else x * 10 for x in items]

    b = MicroBatcher(run, max_batch=4, max_wait_ms=50.0)
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(b.call, x) for x in (1, 2, -3, 4, 5, 6)]
        assert [f.result() for f in futs if not f.exception()] == [10, 20, 40, 50, 60]
        with pytest.raises(ValueError, match="bad -3"):
            futs[2].result()
    assert max(len(s) for s in seen) <= 4 and sorted(x for s in seen for x in s) == [-3, 1, 2, 4, 5, 6]
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.call(1)
    for bad in ({"max_batch": 0}, {"max_queue": 0}, {"max_wait_ms": -1}, {"timeout": 0}):
        with pytest.raises(ValueError):
            MicroBatcher(run, **bad)


# ----------------------------------------------------------------------------- cache
def test_cache_hits_and_per_user_invalidation():
    enc = HashEncoder(DIM)
    mem = new_memory(encoder=enc)
    mem.add(["a1", "a2"], "alice")
    mem.add(["b1"], "bob")
    first = mem.search("question", "alice", k=2)
    again = mem.search("question", "alice", k=2)
    assert not first.cached and again.cached and as_dict(first) == as_dict(again)
    assert not mem.search("question", "alice", k=1).cached  # k is part of the key
    assert not mem.search("question", "alice", k=2, mode="dense").cached  # so is the mode
    assert not mem.search("question", "bob", k=2).cached  # and the user
    assert mem.search("question", "bob", k=2).cached
    n_enc = sum(enc.calls)
    mem.add(["question"], "alice", ids=["new"])  # a write to alice drops alice's answers only
    fresh = mem.search("question", "alice", k=2)
    assert not fresh.cached and fresh[0].id == "new"
    assert mem.search("question", "bob", k=2).cached
    assert sum(enc.calls) == n_enc + 1  # the query's embedding came from the cache ("question" item encoded)
    st_ = mem.stats()["cache"]["results"]
    assert st_["hits"] == 3 and st_["misses"] == 5 and st_["hit_rate"] == pytest.approx(3 / 8)
    off = new_memory(cache_size=0)
    off.add(["x"], "u")
    assert not off.search("x", "u").cached and not off.search("x", "u").cached


def test_repeated_question_workload_hit_rate():
    mem = new_memory()
    mem.add([f"m{i}" for i in range(20)], "u")
    questions = [f"question {i}" for i in range(10)]
    for _ in range(3):
        for q in questions:
            mem.search(q, "u")
    assert mem.stats()["cache"]["results"]["hit_rate"] == pytest.approx(2 / 3)


def test_search_vector_key_is_exact():
    mem = new_memory(encoder=False, dim=DIM)
    mem.add(None, "u", vectors=np.eye(DIM)[:4] + 0.1)
    v = np.linspace(1, 2, DIM)
    assert not mem.search(v, "u").cached and mem.search(v.copy(), "u").cached
    assert not mem.search(v * 2, "u").cached  # another vector, another key (same answer)
    assert as_dict(mem.search(v * 2, "u")) == as_dict(mem.search(v, "u"))


def test_config_and_construction_errors(tmp_path):
    with pytest.raises(TypeError, match="config must be an RFMemConfig"):
        Memory(config={"out_k": 3})
    with pytest.raises(TypeError, match="encode"):
        Memory(encoder=object())
    with pytest.raises(ValueError, match="dim=8 does not match encoder.dim=16"):
        Memory(encoder=HashEncoder(16), dim=8)
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        Memory(encoder=False, max_batch=0)
    with pytest.raises(ValueError, match="backend 'gpu' is not a backend name"):
        Memory(encoder=False, dim=DIM, backend="gpu")  # at construction, not at the first search
    mem = Memory(encoder=False, dim=DIM, config=RFMemConfig(out_k=2))
    mem.add(None, "u", vectors=np.eye(DIM)[:5] + 0.01)
    assert len(mem.search(np.ones(DIM), "u")) == 2 and len(mem.search(np.ones(DIM), "u", k=4)) == 4


def test_first_use_mistakes_get_messages_that_say_what_to_do(tmp_path):
    """The messages a new user meets: a path of another type names ``path`` (a config or an
    encoder in its place: pass it by keyword); a bare number as a query says a text or a
    vector was expected; vectors of another dimension in a Memory whose dimension was
    defaulted (no encoder, no dim) say how to set it; per-item lists say "one per item"."""
    for bad, hint in ((123, "got int$"), (b"dir", "got bytes$"), (RFMemConfig.paper(), r"config=\.\.\.\)$"),
                      (HashEncoder(DIM), r"encoder=\.\.\.\)$")):
        with pytest.raises(TypeError, match=r"^path must be a directory as a str or os.PathLike .*" + hint):
            Memory(bad)
    assert not list(tmp_path.iterdir())
    mem = new_memory(batching=False)
    mem.add(["a", "b"], "u")
    for query in (5, 2.5, np.float32(1.0), np.array(3.0), True):
        with pytest.raises(TypeError, match=r"^query must be a str or a 1-D vector of floats: a text \(str\) or a "
                                            r"vector \(16 floats\) was expected, got "):
            mem.search(query, "u")
    with pytest.raises(TypeError, match=r"^queries\[0\] must be a str .* got int"):
        mem.search_batch([7], "u")
    for call, match in (
        (lambda: mem.add(["a", "b"], "u", ids=["1"]), "^ids has 1 entries but there are 2 items: give one per item$"),
        (lambda: mem.add(["a", "b"], "u", metadata=[{}]),
         "^metadata has 1 entries but there are 2 items: give one per item, or one dict for every item$"),
        (lambda: mem.add(["a", "b"], "u", created_at=[0.0]),
         "^created_at has 1 entries but there are 2 items: give one per item, or one instant for every item$"),
        (lambda: mem.add(["a"], "u", vectors=np.ones((2, DIM))), "give one vector per text$"),
        (lambda: mem.update(mem.get_all("u")[0].id, "u", texts=["x", "y"]),
         "^texts has 2 entries but ids has 1: give one per item$"),
        (lambda: mem.search_batch(["a", "b"], ["u"]),
         "^user_ids has 1 entries but queries has 2: give one per query, or one user for every query$"),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    bare = Memory(encoder=False, batching=False)  # no encoder, no dim: the default 384
    for call, name in ((lambda: bare.add(None, "u", vectors=np.ones((2, 8))), "vectors"),
                       (lambda: bare.search(np.ones(8), "u"), "query")):
        with pytest.raises(ValueError, match=rf"^{name} must have dimension 384, got 8: .*no encoder and no dim.* "
                                             r"dim=8 \(Memory\(\.\.\., encoder=False, dim=8\)\)$"):
            call()
    sized = Memory(encoder=False, dim=16, batching=False)  # a dimension chosen: the plain message
    with pytest.raises(ValueError, match=r"^vectors must have dimension 16, got 8$"):
        sized.add(None, "u", vectors=np.ones((1, 8)))
    Memory(tmp_path / "m", encoder=False).close()  # a stored memory keeps its (default) dimension
    with Memory(tmp_path / "m", encoder=False) as reopened, pytest.raises(ValueError, match=r"got 8$"):
        reopened.add(None, "u", vectors=np.ones((1, 8)))


def test_encoder_dtype_option(monkeypatch):
    """encoder_dtype reaches the default encoder (loaded lazily) and is reported by
    encoder_info / stats before and after loading; misuse is refused, naming it."""
    import rfmem_fast.serving.memory as memory_module

    made = []

    def fake_default(**kwargs):
        made.append(kwargs)
        enc = HashEncoder(DIM)
        enc.dtype, enc.device = kwargs.get("dtype", "float32"), "cpu"
        return enc

    monkeypatch.setattr(memory_module, "_default_encoder", fake_default)
    mem = Memory(dim=DIM, encoder_dtype="bfloat16")
    assert mem.encoder_info() == {"model": "all-MiniLM-L6-v2 (default, not loaded yet)", "backend": "torch",
                                  "dtype": "bfloat16", "device": "cpu", "dim": DIM, "loaded": False}
    assert made == []  # nothing loaded yet
    mem.add(["a text"], "u")
    assert made == [{"dtype": "bfloat16"}]
    assert mem.encoder_info() == {"model": "HashEncoder", "backend": None, "dtype": "bfloat16", "device": "cpu",
                                  "dim": DIM, "loaded": True}
    assert mem.stats()["encoder"]["dtype"] == "bfloat16"
    Memory(dim=DIM).add(["a text"], "u")
    assert made[-1] == {}  # no encoder_dtype: the encoder's own default (float32)
    assert Memory(encoder=False, dim=DIM).encoder_info() is None
    assert Memory(encoder=HashEncoder(DIM)).encoder_info() == {"model": "HashEncoder", "backend": None, "dtype": None,
                                                               "device": None, "dim": DIM, "loaded": True}
    with pytest.raises(ValueError, match=r"encoder_dtype must be one of .*'int8'"):
        Memory(dim=DIM, encoder_dtype="int8")
    with pytest.raises(TypeError, match="encoder_dtype must be one of"):
        Memory(dim=DIM, encoder_dtype=16)
    with pytest.raises(ValueError, match="encoder_dtype applies to the default encoder only"):
        Memory(encoder=HashEncoder(DIM), encoder_dtype="bfloat16")
    with pytest.raises(ValueError, match="encoder_dtype needs a text encoder"):
        Memory(encoder=False, dim=DIM, encoder_dtype="float32")


# ----------------------------------------------------------------------------- edges: bad queries, queues, close, copies, ids
class ZeroForBlank(HashEncoder):
    """An encoder wrapper as many are: a zero row for a text with no words."""

    def vector(self, text):
        return np.zeros(self.dim, np.float32) if not text.strip() or text == "empty-ish" else super().vector(text)


def test_a_bad_query_fails_alone_with_an_error_naming_it():
    """8 callers share a batch; the encoder gives ONE of them a zero row: only
    that caller fails, and its error names its own query (no internal batch row)."""
    enc = ZeroForBlank(DIM)
    mem = new_memory(encoder=enc, max_batch=8, max_wait_ms=200.0, cache_size=0)
    mem.add(["alpha", "beta"], "u", ids=["a", "b"])
    enc.entered.clear()
    enc.gate = threading.Event()
    with ThreadPoolExecutor(9) as pool:
        blocker = pool.submit(mem.search, "warm", "u")
        assert enc.entered.wait(10)
        texts = [f"q{i}" for i in range(7)] + ["empty-ish"]
        futs = [pool.submit(mem.search, t, "u", 2, "dense") for t in texts]
        for _ in range(1000):
            if mem.stats()["batcher"]["queue_depth"] == 8:
                break
            threading.Event().wait(0.01)
        enc.gate.set()
        blocker.result(10)
        assert all(len(f.result(10)) == 2 for f in futs[:7])
        with pytest.raises(ValueError) as err:
            futs[7].result(10)
    assert "'empty-ish'" in str(err.value) and "row" not in str(err.value)
    assert mem.stats()["batcher"]["largest_batch"] == 8  # they did share one batch
    with pytest.raises(ValueError, match=r"texts\[1\] 'empty-ish': the encoder returned a zero"):
        mem.add(["fine", "empty-ish"], "u")


def test_timed_out_and_cancelled_requests_free_their_queue_slots():
    """max_queue=4, worker blocked: 4 waiters time out (threads) or are
    cancelled (asyncio); a new search is queued (no QueueFullError) and answered."""
    enc = HashEncoder(DIM)
    mem = new_memory(encoder=enc, max_batch=1, max_queue=4, max_wait_ms=0.0, cache_size=0)
    mem.add(["x"], "u")
    enc.entered.clear()
    enc.gate = threading.Event()
    with ThreadPoolExecutor(6) as pool:
        blocker = pool.submit(mem.search, "block", "u")
        assert enc.entered.wait(10)
        waiters = [pool.submit(mem.search, f"t{i}", "u", timeout=0.2) for i in range(4)]
        for w in waiters:
            with pytest.raises(RequestTimeoutError):
                w.result(10)
        assert mem.stats()["batcher"]["queue_depth"] == 0

        async def cancelled():
            tasks = [asyncio.ensure_future(mem.asearch(f"c{i}", "u", timeout=None)) for i in range(4)]
            await asyncio.sleep(0.05)
            assert mem.stats()["batcher"]["queue_depth"] == 4
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return mem.stats()["batcher"]["queue_depth"]

        assert asyncio.run(cancelled()) == 0
        late = pool.submit(mem.search, "late", "u")  # queued: the slots were freed
        threading.Event().wait(0.05)
        assert not late.done()
        enc.gate.set()
        assert len(late.result(10)) == 1 and len(blocker.result(10)) == 1
    assert enc.calls == [1, 1, 1]  # add, block, late: the timed-out / cancelled requests never ran
    mem.close()


def test_search_racing_close_gets_batcher_closed_error_at_once():
    """Searches (threads and asyncio, timeout=None) racing close() either finish
    or raise BatcherClosedError at once; none waits forever."""
    from rfmem_fast.serving import BatcherClosedError

    for _ in range(20):
        mem = new_memory(max_wait_ms=0.5, timeout=None, cache_size=0)
        mem.add(["x"], "u")
        go = threading.Barrier(5)

        def one(i):
            go.wait()
            try:
                return len(mem.search(f"q{i}", "u"))
            except BatcherClosedError:
                return "closed"

        with ThreadPoolExecutor(5) as pool:
            futs = [pool.submit(one, i) for i in range(4)]
            go.wait()
            mem.close()
            outs = [f.result(5) for f in futs]  # a lost request would time out here
        assert set(outs) <= {1, "closed"}
        with pytest.raises(BatcherClosedError):
            mem.search("after", "u")
        with pytest.raises(BatcherClosedError):
            asyncio.run(mem.asearch("after", "u", timeout=None))
    b = MicroBatcher(lambda items: items, max_wait_ms=0.0, timeout=None)
    b.close()
    with pytest.raises(BatcherClosedError):
        b.call(1)


def test_every_caller_gets_its_own_copy_of_cached_hits():
    """Mutating returned hits (metadata, an item stored without metadata
    included) never changes a later (cached) answer or a concurrent caller's."""
    mem = new_memory(max_wait_ms=20.0)
    mem.add(["plain", "tagged"], "u", ids=["p", "t"], metadata=[None, {"tag": ["x"]}])
    first = mem.search("plain", "u", k=2, mode="dense")
    for h in first:
        h.metadata["x"] = 1
        h.metadata.get("tag", []).append("y")
    again = mem.search("plain", "u", k=2, mode="dense")
    assert again.cached and {h.id: h.metadata for h in again} == {"p": {}, "t": {"tag": ["x"]}}
    with ThreadPoolExecutor(2) as pool:
        a, b = [f.result() for f in [pool.submit(mem.search, "tagged", "u", 2, "dense") for _ in range(2)]]
    assert all(x.metadata is not y.metadata for x, y in zip(a, b))
    batch = mem.search_batch(["plain", "plain"], "u", k=2, mode="dense")
    assert batch[0][0].metadata is not batch[1][0].metadata


@pytest.mark.parametrize("durable", [False, True])
def test_one_metadata_validation_for_the_in_memory_and_the_durable_memory(tmp_path, durable):
    """The same value gets the same message naming metadata[i], before anything
    is logged, whether the Memory has a path or not."""
    import datetime
    import decimal
    import uuid as uuid_mod

    mem = new_memory(path=tmp_path / "m" if durable else None)
    mem.add(["ok"], "u", ids=["ok"])
    bad = [datetime.datetime(2024, 1, 1), datetime.date(2024, 1, 1), decimal.Decimal("1.5"), uuid_mod.uuid4(),
           {1, 2}, b"bytes", object(), 1 + 2j, float("nan"), float("inf"), (1, 2), np.float32(1.0), np.arange(2)]
    for v in bad:
        with pytest.raises(ValueError, match=r"^metadata\[1\](\['k'\] is a (datetime|date), which JSON cannot hold"
                                             r"| is not JSON-serialisable| does not survive)") as err:
            mem.add(["a", "b"], "u", metadata=[None, {"k": v}])
        assert "cannot log" not in str(err.value)
    assert [i.id for i in mem.get_all("u")] == ["ok"] and mem.stats()["writes"] == 1
    mem.close()


class Windowed(HashEncoder):
    """An encoder with a window of 8 tokens (2 special): tokens are the words."""

    max_tokens = 8

    def count_tokens(self, texts):
        return [len(t.split()) + 2 for t in texts]


class Chunkable(Windowed):
    """... that also tells each token's span, so long texts are chunked."""

    def token_spans(self, texts):
        import re

        return [[m.span() for m in re.finditer(r"\S+", t)] for t in texts]


def test_texts_over_the_window_of_an_encoder_that_cannot_cut_them_are_refused():
    """An encoder that tells its window but not its token spans gets no text
    it would truncate; the error names the text and the limit."""
    mem = new_memory(encoder=Windowed(DIM))
    mem.add(["one two three four five six"], "u", ids=["fits"])
    with pytest.raises(ValueError, match=r"texts\[1\] is 9 tokens long, but the encoder reads at most 8 tokens"):
        mem.add(["short", "one two three four five six seven"], "u")
    with pytest.raises(ValueError, match=r"texts\[0\] is 9 tokens"):
        mem.update("fits", "u", texts="one two three four five six seven")
    mem.add(["one two three four five six seven"], "u", vectors=np.ones(DIM), ids=["own"])  # own vectors: kept
    assert [i.id for i in mem.get_all("u")] == ["fits", "own"]


@pytest.mark.parametrize("durable", [False, True])
def test_long_texts_are_chunked_and_hits_collapse_to_the_item(tmp_path, durable):
    """A text over the window becomes overlapping chunks (6 text tokens each,
    overlap 2), each a row of its item; a query matching ANY chunk finds the item (its
    whole text, its metadata, once); get / get_all / count see items only; update and
    delete of the item replace / remove all its chunks; all of it survives a reopen."""
    enc = Chunkable(DIM)
    path = tmp_path / "m" if durable else None
    mem = Memory(path, encoder=enc, chunk_overlap=2, cache_size=0)
    words = [f"w{i}" for i in range(14)]
    long_text = " ".join(words)  # 14 tokens: chunks w0-w5, w4-w9, w8-w13
    chunks = [" ".join(words[0:6]), " ".join(words[4:10]), " ".join(words[8:14])]
    assert mem._split([long_text]) == [chunks]
    mem.add([long_text, "short one"], "u", ids=["long", "s"], metadata=[{"m": 1}, None])
    assert mem.bank.user_size("u") == 4 and mem.count("u") == 2
    assert mem.counts() == (1, 2) and (mem.stats()["users"], mem.stats()["items"]) == (1, 2)  # items, not rows
    assert [(i.id, i.text, i.metadata) for i in mem.get_all("u")] == [("long", long_text, {"m": 1}), ("s", "short one", {})]
    for c in chunks:  # the query equal to a chunk's text scores 1.0 on that chunk's row
        hits = mem.search(c, "u", k=2, mode="dense")
        assert [h.id for h in hits] == ["long", "s"] and hits[0].text == long_text and hits[0].metadata == {"m": 1}
        assert hits[0].dense_score == pytest.approx(1.0)  # the cosine (the default config adds BM25 to .score)
    assert [h.id for h in mem.search(chunks[2], "u", k=10, mode="dense")] == ["long", "s"]  # one hit per item
    with pytest.raises(ValueError, match="U\\+001F"):
        mem.add(["x"], "u", ids=["long\x1f1"])
    if durable:
        mem._lock_file.close()  # crash: replay rebuilds the chunks from the log
        mem = Memory(path, encoder=enc, chunk_overlap=2, cache_size=0)
        assert mem.count("u") == 2 and mem.search(chunks[1], "u", k=1, mode="dense")[0].id == "long"
    new_text = " ".join(f"v{i}" for i in range(10))  # 2 chunks now
    mem.update("long", "u", texts=new_text)
    assert mem.bank.user_size("u") == 3 and mem.get("long", "u")[0].text == new_text
    assert mem.search(chunks[2], "u", k=1, mode="dense")[0].dense_score < 0.9  # the old chunks are gone
    assert mem.search(" ".join(f"v{i}" for i in range(4, 10)), "u", k=1, mode="dense")[0].dense_score == pytest.approx(1.0)
    if durable:
        mem.close()  # checkpoint: the store holds the chunk rows, the map is rebuilt from it
        mem = Memory(path, encoder=enc, chunk_overlap=2, cache_size=0)
        assert mem.count("u") == 2 and mem._chunks["u"] == {"long": 1}
    mem.delete("long", "u")
    assert mem.bank.user_size("u") == 1 and [i.id for i in mem.get_all("u")] == ["s"]
    mem.add([long_text], "u", ids=["long"])  # the id (and its chunk rows' ids) can be used again
    assert mem.delete_user("u") == 2 and mem.bank.user_size("u") == 0
    mem.close()
    with pytest.raises(ValueError, match="chunk_overlap"):
        Memory(encoder=enc, chunk_overlap=-1)
    with pytest.raises(ValueError, match="leaves no room"):
        Memory(encoder=enc, chunk_overlap=6).add([long_text], "u")


class TopicWords(Chunkable):
    """Chunkable with bag-of-words vectors plus a shared component (every cosine > 0), so the
    chunks of one text, drawn from one small vocabulary, lie near one another."""

    def vector(self, text):
        import zlib

        v = np.zeros(self.dim)
        for w in text.split():
            v[zlib.crc32(w.encode()) % (self.dim - 1)] += 1.0
        v[-1] = 0.5 * np.linalg.norm(v)
        return (v / np.linalg.norm(v)).astype(np.float32)


@pytest.mark.parametrize("config", [RFMemConfig.paper(), None], ids=["paper", "recommended"])
def test_recollection_counts_items_not_the_chunk_rows_of_long_texts(config):
    """A long text is several bank rows (its chunks, near one another), and the engine's
    Recollection path fills its result list with rows: collapsed to items, a query would get fewer
    items than the rows recollected (2 of 10). The Memory gives the slots the extra chunks
    took to the next items of the query's Familiarity ranking (cosine >= score_floor, not
    already returned), after the recollected items, so min(k, rows recollected) distinct
    items come back. Reference: direct engine searches, collapsed here."""
    from rfmem_fast.lexical import CHUNK_SEP

    enc, k = TopicWords(64), 10
    enc.max_tokens = 8  # chunks of 6 words
    mem = Memory(encoder=enc, config=config, batching=False, chunk_overlap=1, cache_size=0)
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice([f"t{i}x{j}" for j in range(4)] + ["common"], size=24)) for i in range(30)]
    mem.add(texts, "u", ids=[f"i{i}" for i in range(30)])
    assert mem.bank.user_size("u") > 90  # 4-5 rows per item
    cfg = mem.config.replace(out_k=k + mem.bank.user_size("u") - 30)  # the rows the Memory asks for
    parent = lambda x: x.rpartition(CHUNK_SEP)[0] if CHUNK_SEP in x else x  # noqa: E731
    gained = full = 0
    for q in texts:
        lex = {"query_texts": [q]} if cfg.lexical_weight > 0 else {}
        qv = enc.encode([q])
        rec = search(mem.bank, qv, ["u"], config=cfg, mode="recollection", **lex)
        fam = search(mem.bank, qv, ["u"], config=cfg, mode="dense", **lex)
        rows = rec.ids_list(0)
        want = []
        for x in rows:
            if parent(x) not in want:
                want.append(parent(x))
        recollected = len(want)
        for x, cos in zip(fam.ids_list(0), fam.dense_scores[0]):
            if len(want) >= min(k, len(rows)):
                break
            if parent(x) not in want and cos >= cfg.score_floor:
                want.append(parent(x))
        hits = mem.search(q, "u", k=k, mode="recollection")
        assert [h.id for h in hits] == want[:k] and len(hits) == min(k, len(rows))
        assert len({h.id for h in hits}) == len(hits) and hits.route == "recollection"
        first_score: dict = {}
        for x, sc in zip(rows, rec.scores[0]):
            first_score.setdefault(parent(x), float(sc))
        assert [h.score for h in hits[:recollected]] == pytest.approx([first_score[h.id] for h in hits[:recollected]])
        gained += len(hits) - recollected
        full += len(hits) == k
    assert gained >= 50 and full >= 18  # the fix matters (105 slots, 21 of 30 queries with k items here)


def test_id_model_ints_are_their_decimal_str():
    """User ids and item ids are str; ints are converted (7 and "7" are one id)."""
    mem = new_memory()
    assert mem.add(["seven"], 7, ids=[7]) == ["7"]
    assert [i.id for i in mem.get("7", "7")] == ["7"] and mem.get(7, 7)[0].text == "seven"
    hits = mem.search("seven", "7")
    assert hits.user_id == "7" and hits[0].id == "7"
    with pytest.raises(ValueError, match="already holds item id '7'"):
        mem.add(["again"], "7", ids=["7"])
    mem.update(7, "7", texts="seven!")
    mem.delete("7", 7)
    assert mem.get_all(7) == []


def test_delete_user_forgets_every_memory_durably(tmp_path):
    """delete_user removes all of a user's items, survives a crash and a
    checkpoint; other users stay; an unknown user deletes nothing (idempotent)."""
    mem = new_memory(path=tmp_path / "m")
    mem.add(["a", "b", "c"], "gone", ids=["1", "2", "3"])
    mem.add(["a"], "kept", ids=["1"])
    assert mem.delete_user("gone") == 3 and mem.delete_user("gone") == 0 and mem.delete_user("never") == 0
    assert mem.get_all("gone") == [] and mem.search("a", "gone") == []
    assert mem.counts() == (1, 1)  # a forgotten user is no user in /health and /metrics
    mem._lock_file.close()  # crash: only the log holds it
    again = new_memory(path=tmp_path / "m")
    assert again.get_all("gone") == [] and [i.id for i in again.get_all("kept")] == ["1"]
    again.close()
    third = new_memory(path=tmp_path / "m")
    assert third.count("gone") == 0 and third.count("kept") == 1
    third.close()


def test_get_all_pages():
    mem = new_memory()
    mem.add([f"t{i}" for i in range(7)], "u", ids=[f"i{i}" for i in range(7)])
    pages = [[it.id for it in mem.get_all("u", offset=o, limit=3)] for o in (0, 3, 6, 9)]
    assert pages == [["i0", "i1", "i2"], ["i3", "i4", "i5"], ["i6"], []]
    assert [it.text for it in mem.get_all("u", offset=5)] == ["t5", "t6"]


def test_encoder_backend_option(monkeypatch):
    """encoder_backend reaches the default encoder with encoder_dtype; bad pairs and
    misuse are refused at construction, naming the argument."""
    import rfmem_fast.serving.memory as memory_module

    made = []

    def fake_default(**kwargs):
        made.append(kwargs)
        return HashEncoder(DIM)

    monkeypatch.setattr(memory_module, "_default_encoder", fake_default)
    Memory(dim=DIM, encoder_backend="onnx", encoder_dtype="int8").add(["a text"], "u")
    assert made == [{"dtype": "int8", "backend": "onnx"}]
    Memory(dim=DIM, encoder_backend="auto").add(["a text"], "u")
    assert made[-1] == {"backend": "auto"}
    with pytest.raises(ValueError, match="encoder_dtype must be one of .* with encoder_backend='torch'"):
        Memory(dim=DIM, encoder_dtype="int8")
    with pytest.raises(ValueError, match="encoder_dtype must be one of .* with encoder_backend='onnx'"):
        Memory(dim=DIM, encoder_backend="onnx", encoder_dtype="bfloat16")
    with pytest.raises(ValueError, match="encoder_backend must be one of"):
        Memory(dim=DIM, encoder_backend="tpu")
    with pytest.raises(ValueError, match="encoder_backend applies to the default encoder only"):
        Memory(encoder=HashEncoder(DIM), encoder_backend="onnx")
    with pytest.raises(ValueError, match="encoder_backend needs a text encoder"):
        Memory(encoder=False, dim=DIM, encoder_backend="onnx")
