"""The text facades' default retrieval: ``RFMemConfig.recommended()`` for their encoder.

``Memory()``, ``rfmem serve`` / ``rfmem mcp`` (``--preset recommended``) and the framework
retrievers (they wrap a Memory) search hybrid dense + BM25 by default; the vector-level
engine (``RFMemConfig()``, ``search``) keeps the paper's RF-Mem, and ``config=
RFMemConfig.paper()`` / ``--preset paper`` keep it in the facades. A query given as a
vector has no text: it gets the dense top-k (what ``recommended(lexical_weight=0)``
returns). A memory directory does not store its config: reopened, it searches with the
default over its stored texts, its bank's lexical stemmer kept. References are direct
``rfmem_fast.search`` calls with an explicit config.
"""
from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _serving_helpers import HashEncoder

from rfmem_fast import Memory, RFMemConfig, search
from rfmem_fast.models import recommended_alias

DIM = 16
DATA = Path(__file__).parent / "data"


def _data(dim: int = 32, n_users: int = 4, per_user: int = 40, seed: int = 0):
    """Random items per user, and 8 queries per user: half near one of its items (the paper's
    router takes them familiar), half random (a low mean score: some recollect there)."""
    rng = np.random.default_rng(seed)
    items, queries = {}, []
    for u in range(n_users):
        X = rng.normal(size=(per_user, dim)).astype(np.float32)
        items[f"user{u}"] = X
        for j in range(4):
            queries.append((f"user{u}", X[rng.integers(per_user)] + 0.1 * rng.normal(size=dim).astype(np.float32)))
            queries.append((f"user{u}", rng.normal(size=dim).astype(np.float32)))
    return items, queries


def _fill(mem: Memory, items: dict) -> None:
    for user, X in items.items():
        mem.add([f"{user} note {i} about topic {i % 5}" for i in range(len(X))], user, vectors=X,
                ids=[f"{user}-{i}" for i in range(len(X))])  # fmt: skip


def _engine(mem: Memory, vecs, users, config: RFMemConfig, k: int, texts=None):
    """A direct search of the Memory's bank: per query (ids, scores, route)."""
    kw = {} if texts is None else {"query_texts": texts}
    res = search(mem.bank, np.asarray(vecs, np.float32), list(users), config.replace(out_k=k), mode="rfmem", **kw)
    return [(res.ids_list(j), res.scores[j][res.rows[j] >= 0].tolist(), res.route_names[j]) for j in range(len(users))]


def _got(hits):
    return [h.id for h in hits], [h.score for h in hits], hits.route


class _Named(HashEncoder):
    """A HashEncoder that says which model folder it was loaded from (as TextEncoder.model_path)."""

    def __init__(self, model_path: str, dim: int = DIM) -> None:
        super().__init__(dim)
        self.model_path = model_path


# ----------------------------------------------------------------------------- the rule
def test_recommended_alias_names_mpnet_only_for_the_mpnet_model(tmp_path):
    for enc in (None, False, "default", "none", "minilm", "/models/all-MiniLM-L6-v2", tmp_path / "my-model",
                HashEncoder(DIM), _Named("/m/bge-small-en"), [], "all-mpnet-base-v2-finetuned"):
        assert recommended_alias(enc) == "minilm", enc
    for enc in ("mpnet", "/m/all-mpnet-base-v2", "/m/all-mpnet-base-v2/", tmp_path / "All-MPNet-Base-v2",
                "/hf/sentence-transformers_all-mpnet-base-v2", _Named("/cache/all-mpnet-base-v2"),
                [_Named("/a/all-mpnet-base-v2"), _Named("/b/all-mpnet-base-v2")]):
        assert recommended_alias(enc) == "mpnet", enc


# ----------------------------------------------------------------------------- Memory
def test_memory_defaults_to_the_recommended_config_of_its_encoder():
    assert Memory(encoder=HashEncoder(DIM)).config == RFMemConfig.recommended("minilm")
    assert Memory(dim=DIM).config == RFMemConfig.recommended("minilm")  # the default MiniLM (not loaded here)
    assert Memory(encoder=False, dim=DIM).config == RFMemConfig.recommended("minilm")
    assert Memory(encoder=_Named("/m/all-mpnet-base-v2")).config == RFMemConfig.recommended("mpnet")
    assert Memory(encoder=[_Named("/m/all-mpnet-base-v2"), _Named("/m/all-mpnet-base-v2")]).config == \
        RFMemConfig.recommended("mpnet")
    cfg = Memory(encoder=HashEncoder(DIM)).config
    assert (cfg.lexical_weight, cfg.fusion, cfg.lexical_norm, cfg.theta_high, cfg.theta_low) == (0.03, "convex", "raw", -1.0, -1.0)
    # the engine's default stays the paper's
    assert RFMemConfig() == RFMemConfig.paper() and RFMemConfig().lexical_weight == 0.0
    assert Memory(encoder=HashEncoder(DIM), config=RFMemConfig.paper()).config == RFMemConfig()


def test_default_memory_searches_hybrid_and_paper_config_keeps_the_papers_rfmem():
    """Text queries: the default answers as a direct hybrid search (recommended(), the query
    texts passed); ``config=RFMemConfig.paper()`` answers as the paper's RF-Mem (both paths,
    no lexical score)."""
    items, queries = _data()
    enc = HashEncoder(32)
    default, paper = Memory(encoder=enc, batching=False), Memory(encoder=enc, batching=False, config=RFMemConfig.paper())
    for mem in (default, paper):
        _fill(mem, items)
    texts = [f"topic {n % 5} question {n}" for n in range(len(queries))]  # "topic" in every item, "<n % 5>" in some
    users = [u for u, _ in queries]
    for t, (u, v) in zip(texts, queries):
        enc.overrides[t] = v  # each text query embeds as its clustered vector
    vecs = np.stack([v for _, v in queries])
    want_h = _engine(default, vecs, users, RFMemConfig.recommended(), 5, texts)
    want_p = _engine(paper, vecs, users, RFMemConfig(), 5)
    got_h = [default.search(t, u, k=5) for t, u in zip(texts, users)]
    got_p = [paper.search(t, u, k=5) for t, u in zip(texts, users)]
    assert [_got(h) for h in got_h] == want_h
    assert [_got(h) for h in got_p] == want_p
    assert {h.route for h in got_h} == {"familiarity"}  # recommended(): never recollects
    assert {h.route for h in got_p} == {"familiarity", "recollection"}  # the paper's routing
    assert any(x.lexical_score > 0 for h in got_h for x in h) and all(x.lexical_score is not None for h in got_h for x in h)
    assert all(x.lexical_score is None for h in got_p for x in h)
    assert [_got(h) for h in got_h] != [_got(h) for h in got_p]


def test_vector_queries_on_a_default_memory_get_the_dense_top_k():
    """A vector (no text) on a hybrid Memory, alone or in a batch with text queries: the
    answer of ``recommended(lexical_weight=0)`` (dense, never recollecting), its hits'
    ``lexical_score`` None and ``score`` the cosine; the text queries of the batch stay hybrid.
    A vectors-only memory (encoder=False) answers the same way."""
    items, queries = _data()
    enc = HashEncoder(32)
    mem, bare = Memory(encoder=enc, max_wait_ms=1.0), Memory(encoder=False, dim=32, batching=False)
    for m in (mem, bare):
        _fill(m, items)
    users = [u for u, _ in queries]
    vecs = np.stack([v for _, v in queries])
    dense = _engine(mem, vecs, users, RFMemConfig.recommended(lexical_weight=0.0), 4)
    paper = _engine(mem, vecs, users, RFMemConfig(), 4)
    assert dense != paper  # the reference is not the paper's RF-Mem: some of these queries recollect there
    for m in (mem, bare):
        one = [m.search(v, u, k=4) for u, v in queries]
        assert [_got(h) for h in one] == dense
        assert all(x.lexical_score is None and x.dense_score == x.score for h in one for x in h)
        assert [_got(h) for h in m.search_batch(vecs, users, k=4)] == dense
    text = f"{users[0]} note 3 about topic 3"
    mixed = mem.search_batch([text, vecs[1], vecs[2]], [users[0], users[1], users[2]], k=4)
    assert [_got(h) for h in mixed[1:]] == dense[1:3]
    assert [_got(mixed[0])] == _engine(mem, enc.encode([text]), users[:1], RFMemConfig.recommended(), 4, [text])
    assert all(x.lexical_score > 0 for x in mixed[0])  # "user0", "note", "about", "topic": in every item
    mem.close()
    bare.close()


# ----------------------------------------------------------------------------- reopening
def _old_memory_dir(tmp_path: Path) -> Path:
    """A Memory directory as written before the default changed: memory.json (format 1, no
    config in it) naming a bank store written by rfmem_fast before its lexical index
    (tests/data/store_v1_float32: format 1, no stemmer, texts "alice note 0" ...)."""
    path = tmp_path / "old"
    path.mkdir()
    shutil.copytree(DATA / "store_v1_float32", path / "store-00000001")
    doc = {"format": "rfmem_fast.memory", "format_version": 1, "dim": 16, "store": "store-00000001", "wal_seq": 0}
    (path / "memory.json").write_text(json.dumps(doc))
    return path


def test_an_old_memory_directory_reopens_and_searches_hybrid_over_its_stored_texts(tmp_path):
    path = _old_memory_dir(tmp_path)
    exp = json.loads((DATA / "store_v1_float32.expected.json").read_text())
    enc = HashEncoder(DIM)
    with Memory(path, encoder=enc, batching=False) as mem:
        assert mem.config == RFMemConfig.recommended()
        assert mem.bank.lexical_stemmer is None  # the store's (no stemmer), not the default
        assert [i.text for i in mem.get_all("alice")] == exp["texts"][:6]
        q = "alice note 4"
        hits = mem.search(q, "alice", k=3)
        want = _engine(mem, enc.encode([q]), ["alice"], RFMemConfig.recommended(), 3, [q])
        assert [_got(hits)] == want and len(hits) == 3
        # "alice" and "note" are in every text (one-character tokens are not indexed): equal BM25 > 0
        assert hits[0].lexical_score > 0 and all(h.lexical_score == hits[0].lexical_score for h in hits)
        mem.add(["alice note 7 violin"], "alice", ids=["a7"])  # it takes writes, indexed at once
        lex = {h.id: h.lexical_score for h in mem.search("violin", "alice", k=10)}
        assert len(lex) == 7 and lex.pop("a7") > 0 and set(lex.values()) == {0.0}
    with Memory(path, encoder=enc, batching=False, config=RFMemConfig.paper()) as mem:
        hits = mem.search("alice note 4", "alice", k=3)
        assert [_got(hits)] == _engine(mem, enc.encode(["alice note 4"]), ["alice"], RFMemConfig(), 3)
        assert all(h.lexical_score is None for h in hits) and mem.count("alice") == 7


def test_a_memory_written_with_the_paper_config_reopens_with_the_default(tmp_path):
    """The config is not stored: reopened without one, the default (hybrid) searches."""
    enc = HashEncoder(DIM)
    with Memory(tmp_path / "m", encoder=enc, config=RFMemConfig.paper()) as mem:
        mem.add(["I live in Lyon", "My sister is Ana", "I like tea"], "u", ids=["a", "b", "c"])
        assert mem.search("tea", "u", k=1)[0].lexical_score is None
    with Memory(tmp_path / "m", encoder=enc) as mem:
        assert mem.config == RFMemConfig.recommended()
        lex = {h.id: h.lexical_score for h in mem.search("tea", "u", k=3)}
        assert lex["c"] > 0 and lex["a"] == lex["b"] == 0.0  # BM25 over the texts stored before


# ----------------------------------------------------------------------------- servers
def test_serve_and_mcp_default_to_the_recommended_preset():
    from rfmem_fast.cli import build_parser
    from rfmem_fast.serving.app import serve
    from rfmem_fast.serving.cli import memory_kwargs
    from rfmem_fast.serving.launch import open_memory

    p = build_parser()
    serve_args = p.parse_args(["serve", "--path", "m"])
    mcp_args = p.parse_args(["mcp", "--data-dir", "m", "--user", "alice"])
    for args in (serve_args, mcp_args):
        assert args.preset == "recommended" and memory_kwargs(args)["preset"] == "recommended"
    assert p.parse_args(["serve", "--path", "m", "--preset", "paper"]).preset == "paper"
    assert p.parse_args(["mcp", "--data-dir", "m", "--user", "a", "--preset", "paper"]).preset == "paper"
    for fn in (serve, open_memory):
        assert inspect.signature(fn).parameters["preset"].default == "recommended"


def test_open_memory_takes_the_pick_of_its_encoder(tmp_path, monkeypatch):
    import rfmem_fast.serving.launch as launch

    made = []

    def fake_text_encoder(model, **kw):  # a model directory "loads" as a HashEncoder naming it
        made.append(model)
        return _Named(str(model))

    monkeypatch.setattr(launch, "TextEncoder", fake_text_encoder)
    m = launch.open_memory(str(tmp_path / "a"), encoder="none", dim=DIM)
    assert m.config == RFMemConfig.recommended("minilm")
    m.add(None, "u", vectors=np.eye(DIM)[:3], ids=["x", "y", "z"])
    hits = m.search(np.eye(DIM)[1], "u", k=2)  # vectors only: the dense top-k
    assert [h.id for h in hits] == ["y", "x"] and hits[0].lexical_score is None
    m.close()
    m = launch.open_memory(str(tmp_path / "a"), encoder="none", preset="paper")
    assert m.config == RFMemConfig.paper()
    m.close()
    mp = tmp_path / "all-mpnet-base-v2"
    m = launch.open_memory(str(tmp_path / "b"), encoder=str(mp), encoder_workers=1)
    assert made == [str(mp)] and m.config == RFMemConfig.recommended("mpnet")
    m.close()
    m = launch.open_memory(str(tmp_path / "c"), encoder=str(tmp_path / "bge-small"), encoder_workers=1)
    assert m.config == RFMemConfig.recommended("minilm")
    m.close()
    with pytest.raises(ValueError, match="preset"):
        launch.open_memory(str(tmp_path / "d"), encoder="none", dim=DIM, preset="hybrid")


def test_a_lexical_score_of_zero_means_no_query_word_occurs_in_the_item():
    """docs/concepts.md "What a search returns": with the default (hybrid) configuration a hit
    sharing no word with the query has lexical_score 0.0 and its score is its dense_score; a
    hit sharing a word has a positive lexical_score (score = dense + 0.03 * lexical); with
    the paper's configuration (no lexical channel) lexical_score is None."""
    texts = ["the violin lessons start monday", "grandmother bakes bread", "my violin is old"]
    mem = Memory(encoder=HashEncoder(DIM), batching=False)
    mem.add(texts, "u", ids=["a", "b", "c"])
    hits = {h.id: h for h in mem.search("violin concert", "u", k=3, mode="dense")}
    assert hits["b"].lexical_score == 0.0 and hits["b"].score == pytest.approx(hits["b"].dense_score, abs=1e-6)
    for i in ("a", "c"):
        assert hits[i].lexical_score > 0
        assert hits[i].score == pytest.approx(hits[i].dense_score + 0.03 * hits[i].lexical_score, abs=1e-5)
    paper = Memory(encoder=HashEncoder(DIM), config=RFMemConfig.paper(), batching=False)
    paper.add(texts, "u")
    assert all(h.lexical_score is None for h in paper.search("violin concert", "u", k=3, mode="dense"))


def test_servers_choose_the_second_stage(tmp_path):
    """``rfmem serve / mcp --second-stage``: the preset's by default, "none", a shipped name
    or a file; a bad one fails when the memory opens, naming the field."""
    from rfmem_fast.serving.launch import open_memory

    def cfg(**kw):
        mem = open_memory(str(tmp_path / "m"), encoder="none", dim=8, batching=False, **kw)
        try:
            return mem.config
        finally:
            mem.close()

    assert cfg().second_stage == "builtin:minilm"
    assert cfg(second_stage="none").second_stage is None
    assert cfg(preset="paper").second_stage is None
    assert cfg(preset="paper", second_stage="builtin:minilm").second_stage == "builtin:minilm"
    with pytest.raises(FileNotFoundError, match="RFMemConfig.second_stage"):
        cfg(second_stage=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown builtin second stage 'nope'"):
        cfg(second_stage="builtin:nope")
    with pytest.raises(TypeError, match="second_stage must be"):
        cfg(second_stage=None)
