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
            metadata=[{"topic": "greek", "score": "user value"}, None, {"n": 3}])
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
    assert docs[0].metadata["topic"] == "greek" and docs[0].metadata["score"] == pytest.approx(1.0)
    assert docs[0].metadata["rfmem"] == {"id": "a", "user_id": "alice", "score": ref[0].score, "rank": 0,
                                         "route": "familiarity", "rule": "forced_dense", "mean": ref.mean,
                                         "entropy": ref.entropy, "rounds": 0}

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
    assert [n.node.node_id for n in nodes] == [h.id for h in ref] and nodes[0].node.get_content() == "gamma fact"
    assert [n.score for n in nodes] == [h.score for h in ref] and nodes[0].node.metadata["n"] == 3
    assert nodes[0].node.metadata["rfmem"]["rule"] == "forced_dense"
    async_nodes = asyncio.run(r.aretrieve("beta fact"))
    assert async_nodes[0].node.node_id == "b"
    vec = HashEncoder(DIM).vector("alpha fact")  # a bundle with its own embedding is searched by vector
    by_vec = r.retrieve(QueryBundle(query_str="ignored", embedding=vec.tolist()))
    assert by_vec[0].node.node_id == "a" and by_vec[0].score == pytest.approx(1.0)
    assert [n.node.node_id for n in RFMemRetriever(memory, user_id="bob", mode="dense").retrieve("x")] == ["x"]
    with pytest.raises(TypeError, match="memory must be a rfmem_fast.Memory"):
        RFMemRetriever(object(), user_id="alice")
    with pytest.raises(ValueError, match="mode"):
        RFMemRetriever(memory, user_id="alice", mode="fast")
    with pytest.raises(ValueError, match="k must be"):
        RFMemRetriever(memory, user_id="alice", k=np.int64(0))
