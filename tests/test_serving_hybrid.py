"""``Memory`` with a lexical channel: hybrid search through the text facade (docs "Hybrid retrieval").

The facade must pass each text query to ``search`` as ``query_texts`` when its config is
hybrid, stem its bank like the evaluations that chose ``RFMemConfig.recommended()``, and
give every hit its dense and lexical scores; the reference is a direct ``search`` on the
Memory's own bank with the same config and texts.
"""
from __future__ import annotations

import numpy as np
import pytest

from _fake_encoder import BagOfWords
from rfmem_fast import Memory, RFMemConfig, search
from rfmem_fast.serving.memory import default_stemmer

TEXTS = ["Dinner with Maria in Lisbon on Tuesday", "I adopted a cat called Rex", "My sister runs marathons",
         "We went sailing near Porto", "Maria's birthday is in June", "I play chess on Sundays"]  # fmt: skip


class _Enc:
    """BagOfWords with 16 buckets (the dense channel blurs the words) and the ``dim`` a Memory reads."""

    dim = 17

    def __init__(self) -> None:
        self._bow = BagOfWords(dim=16)

    def encode(self, texts):
        return self._bow.encode(texts)


@pytest.fixture()
def enc():
    return _Enc()


def test_hybrid_memory_equals_a_direct_hybrid_search(enc):
    cfg = RFMemConfig.recommended(out_k=4)
    mem = Memory(encoder=enc, config=cfg)
    try:
        mem.add(TEXTS, "u", ids=[f"m{i}" for i in range(len(TEXTS))])
        mem.add(["unrelated text about Maria and Lisbon"], "other")  # another user's corpus: never seen
        assert mem.bank.lexical_stemmer == default_stemmer()
        queries = ["when did I see Maria in Lisbon?", "what pet did I adopt?"]
        got = mem.search_batch(queries, "u")
        want = search(mem.bank, enc.encode(queries), ["u", "u"], cfg, mode="rfmem", query_texts=queries)
        for i, hits in enumerate(got):
            assert [h.id for h in hits] == want.ids_list(i)
            np.testing.assert_array_equal([h.score for h in hits], want.scores[i][: len(hits)])
            np.testing.assert_array_equal([h.dense_score for h in hits], want.dense_scores[i][: len(hits)])
            np.testing.assert_array_equal([h.lexical_score for h in hits], want.lexical_scores[i][: len(hits)])
            for h in hits:  # fused = cosine + 0.03 * BM25, per hit
                assert h.score == pytest.approx(h.dense_score + cfg.lexical_weight * h.lexical_score, abs=1e-6)
        assert got[0][0].id == "m0" and got[0][0].lexical_score > 0
        # a vector query has no text: dense only, no lexical score (None: the channel did not score it)
        vec = mem.search(enc.encode(queries[:1])[0], "u")
        assert [h.id for h in vec] == search(mem.bank, enc.encode(queries[:1]), ["u"], cfg, mode="rfmem",
                                             query_texts=[None]).ids_list(0)  # fmt: skip
        assert vec and all(h.lexical_score is None for h in vec)
    finally:
        mem.close()


def test_dense_memory_has_dense_scores_and_no_lexical_scores(enc):
    mem = Memory(encoder=enc, config=RFMemConfig.paper())
    try:
        mem.add(TEXTS, "u")
        hits = mem.search("when did I see Maria in Lisbon?", "u", k=3)
        assert all(h.lexical_score is None for h in hits)
        assert [h.dense_score for h in hits] == pytest.approx([h.score for h in hits])
        assert set(hits[0].to_dict()) >= {"dense_score", "lexical_score"}
    finally:
        mem.close()


def test_durable_hybrid_memory_keeps_its_stemmer(enc, tmp_path):
    cfg = RFMemConfig.recommended(out_k=3)
    with Memory(tmp_path / "m", encoder=enc, config=cfg) as mem:
        mem.add(TEXTS, "u")
        before = [h.id for h in mem.search("sailing near porto", "u")]
        mem.save()
    with Memory(tmp_path / "m", encoder=enc, config=cfg) as mem:
        assert mem.bank.lexical_stemmer == default_stemmer()
        assert [h.id for h in mem.search("sailing near porto", "u")] == before
