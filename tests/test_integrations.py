"""LangChain and LlamaIndex retrievers, tested against the real langchain-core and
llama-index-core packages (not mocks)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _serving_helpers import HashEncoder

from rfmem_fast import Memory

DIM = 16


@pytest.fixture
def memory():
    enc = HashEncoder(DIM)
    mem = Memory(encoder=enc, max_wait_ms=5.0)
    mem.add(["alpha fact", "beta fact", "gamma fact"], "alice", ids=["a", "b", "c"],
            metadata=[{"topic": "greek", "score": "user value"}, None, {"n": 3}],
            created_at="2026-01-01T10:00:00+02:00")
    mem.add(["alpha fact"], "bob", ids=["x"], metadata={"owner": "bob"})
    return mem


def test_langchain_retriever(memory):
    pytest.importorskip("langchain_core")
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    from rfmem_fast.integrations.langchain import RFMemRetriever

    r = RFMemRetriever(memory=memory, user_id="alice", k=2, mode="dense")
    assert isinstance(r, BaseRetriever)
    docs = r.invoke("alpha fact")
    ref = memory.search("alpha fact", "alice", k=2, mode="dense")
    assert all(isinstance(d, Document) for d in docs) and len(docs) == 2
    assert [d.id for d in docs] == [h.id for h in ref] and docs[0].page_content == "alpha fact"
    # the Memory's default config is hybrid: score = cosine (1.0 here) + 0.03 * BM25
    assert ref[0].dense_score == pytest.approx(1.0) and ref[0].lexical_score > 0
    assert docs[0].metadata["topic"] == "greek" and docs[0].metadata["score"] == pytest.approx(1.0 + 0.03 * ref[0].lexical_score)
    assert docs[0].metadata["rfmem"] == {"id": "a", "user_id": "alice", "score": ref[0].score, "rank": 0,
                                         "route": "familiarity", "rule": "forced_dense", "mean": ref.mean,
                                         "entropy": ref.entropy, "rounds": 0, "dense_score": ref[0].dense_score,
                                         "lexical_score": ref[0].lexical_score, "created_at": "2026-01-01T08:00:00+00:00",
                                         "thread": None, "position": None, "context_score": ref[0].context_score}
    assert ref[0].context_score == pytest.approx(1.3 * ref[0].score)  # the default's context: no thread, c = b + 0.3 b

    async def many():
        return await asyncio.gather(*(r.ainvoke(q) for q in ("alpha fact", "beta fact", "gamma fact")))

    firsts = [d[0].page_content for d in asyncio.run(many())]
    assert firsts == ["alpha fact", "beta fact", "gamma fact"]
    assert [d[0].id for d in r.batch(["beta fact", "gamma fact"])] == ["b", "c"]
    bob = RFMemRetriever(memory=memory, user_id="bob", mode="dense").invoke("beta fact")
    assert [d.id for d in bob] == ["x"] and bob[0].metadata["owner"] == "bob"
    with pytest.raises(ValueError, match="mode"):
        RFMemRetriever(memory=memory, user_id="alice", mode="fast")
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        RFMemRetriever(memory=memory, user_id="alice", k=0)
    with pytest.raises(ValueError, match="memory"):
        RFMemRetriever(memory="not a memory", user_id="alice")


def test_llamaindex_retriever(memory):
    pytest.importorskip("llama_index.core")
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle

    from rfmem_fast.integrations.llamaindex import RFMemRetriever

    r = RFMemRetriever(memory, user_id="alice", k=2, mode="dense")
    assert isinstance(r, BaseRetriever)
    nodes = r.retrieve("gamma fact")
    ref = memory.search("gamma fact", "alice", k=2, mode="dense")
    assert all(isinstance(n, NodeWithScore) for n in nodes)
    assert [n.node.node_id for n in nodes] == [f"alice/{h.id}" for h in ref] and nodes[0].node.get_content() == "gamma fact"
    assert [n.node.metadata["rfmem"]["id"] for n in nodes] == [h.id for h in ref]
    assert [n.score for n in nodes] == [h.score for h in ref] and nodes[0].node.metadata["n"] == 3
    assert nodes[0].node.metadata["rfmem"]["rule"] == "forced_dense"
    assert nodes[0].node.metadata["rfmem"]["created_at"] == "2026-01-01T08:00:00+00:00"  # the hit's, as JSON text
    async_nodes = asyncio.run(r.aretrieve("beta fact"))
    assert async_nodes[0].node.node_id == "alice/b"
    vec = HashEncoder(DIM).vector("alpha fact")  # a bundle with its own embedding is searched by vector
    by_vec = r.retrieve(QueryBundle(query_str="ignored", embedding=vec.tolist()))
    assert by_vec[0].node.node_id == "alice/a" and by_vec[0].score == pytest.approx(1.0)  # dense: no text to score
    assert by_vec[0].node.metadata["rfmem"]["lexical_score"] is None
    assert [n.node.node_id for n in RFMemRetriever(memory, user_id="bob", mode="dense").retrieve("x")] == ["bob/x"]
    with pytest.raises(TypeError, match="memory must be a rfmem_fast.Memory"):
        RFMemRetriever(object(), user_id="alice")
    with pytest.raises(ValueError, match="mode"):
        RFMemRetriever(memory, user_id="alice", mode="fast")
    with pytest.raises(ValueError, match="k must be"):
        RFMemRetriever(memory, user_id="alice", k=np.int64(0))


# ----------------------------------------------------------------------------- adapters at their edges
def test_langchain_per_call_k_search_kwargs_and_strict_validation(memory):
    """invoke / ainvoke(q, k=2), search_kwargs={"k": 2} give 2 documents; a bad
    k (True, "3", 0, 10**9) is a validation error, at construction or per call."""
    pytest.importorskip("langchain_core")
    from pydantic import ValidationError

    from rfmem_fast.integrations.langchain import RFMemRetriever

    r = RFMemRetriever(memory=memory, user_id="alice", mode="dense")
    assert len(r.invoke("alpha fact")) == 3
    assert len(r.invoke("alpha fact", k=2)) == 2
    assert len(asyncio.run(r.ainvoke("alpha fact", k=1))) == 1
    assert [d.id for d in r.invoke("alpha fact", k=1, mode="dense")] == ["a"]
    sk = RFMemRetriever(memory=memory, user_id="alice", mode="dense", search_kwargs={"k": 2})
    assert len(sk.invoke("alpha fact")) == 2 and len(asyncio.run(sk.ainvoke("alpha fact"))) == 2
    assert len(sk.invoke("alpha fact", k=1)) == 1  # per call beats search_kwargs
    assert len(sk.batch(["alpha fact", "beta fact"])[1]) == 2
    for bad in (True, "3", 0, 2.0, 10**9):
        with pytest.raises(ValidationError):
            RFMemRetriever(memory=memory, user_id="alice", k=bad)
        with pytest.raises(ValueError, match="k must be an int"):
            r.invoke("alpha fact", k=bad)
        with pytest.raises(ValidationError, match="k must be an int"):
            RFMemRetriever(memory=memory, user_id="alice", search_kwargs={"k": bad})
    with pytest.raises(ValidationError, match="search_kwargs may hold 'k' and 'mode' only"):
        RFMemRetriever(memory=memory, user_id="alice", search_kwargs={"score_threshold": 0.5})
    with pytest.raises(ValueError, match="unknown keyword"):
        r.invoke("alpha fact", top_k=2)
    with pytest.raises(ValidationError):
        RFMemRetriever(memory=memory, user_id=True)
    with pytest.raises(ValidationError):
        r.k = "3"  # assignments are validated too


def test_llamaindex_content_without_bookkeeping_and_unique_node_ids(memory):
    """LLM / EMBED content holds the text and the item's own metadata, never
    score / rfmem; node ids are unique per (user, item)."""
    pytest.importorskip("llama_index.core")
    from llama_index.core.schema import MetadataMode

    from rfmem_fast.integrations.llamaindex import RFMemRetriever

    node = RFMemRetriever(memory, user_id="alice", k=1, mode="dense").retrieve("alpha fact")[0].node
    for mode in (MetadataMode.LLM, MetadataMode.EMBED):
        content = node.get_content(mode)
        assert "alpha fact" in content and "greek" in content
        assert "rfmem" not in content and "entropy" not in content and "alice" not in content
        assert "user value" not in content  # the item's own "score" key is replaced, then hidden
    assert "rfmem" in node.get_content(MetadataMode.ALL)
    memory.add(["alpha fact"], "1", ids=["1"])
    memory.add(["alpha fact"], "2", ids=["1"])
    ids = {RFMemRetriever(memory, user_id=u, k=1, mode="dense").retrieve("alpha fact")[0].node.node_id
           for u in ("1", "2", "bob")}
    assert ids == {"1/1", "2/1", "bob/x"}
    odd = memory.add(["alpha fact"], "a/b", ids=["c/d"])
    n = RFMemRetriever(memory, user_id="a/b", k=1).retrieve("alpha fact")[0].node
    assert n.node_id == "a%2Fb/c%2Fd" and n.metadata["rfmem"]["id"] == odd[0]
    with pytest.raises(ValueError, match="k must be an int"):
        RFMemRetriever(memory, user_id="alice", k="3")
    with pytest.raises(ValueError, match="k must be an int"):
        RFMemRetriever(memory, user_id="alice", k=True)
