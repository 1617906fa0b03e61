"""The Memory facade with the real offline MiniLM encoder (loaded once per session)."""
from __future__ import annotations

import numpy as np
import pytest
from _shared import shared_dir

from rfmem_fast import Memory, RFMemConfig, search


@pytest.fixture(scope="module")
def pb_small():
    """24 chunks of one PersonaBench user and the first 30 questions (texts only)."""
    shared = shared_dir()
    if shared is None:
        pytest.skip("shared data absent")
    from rfmem_fast.datasets import load_personabench

    data = load_personabench(shared / "data" / "personabench" / "eval_data_v1", noise=0.0)
    user = data.users[0]
    return user, [q.question for q in data.questions[:30]]


def test_batched_text_queries_match_one_text_encodes(pb_small, text_encoder):
    """One batched encode + search of 30 PersonaBench questions against, per question,
    a one-text encode and one search call: same ids and routes, scores within float32
    rounding of the encoder (RFMEM_SPEC.md "Vectors and scores")."""
    user, questions = pb_small
    mem = Memory(encoder=text_encoder, cache_size=0, config=RFMemConfig.paper())  # both paths, dense
    # the texts are cut to the encoder's window here, so the bank holds one row per item
    # and a direct search is the reference (chunked long texts: test_long_memory_... below)
    texts = [text_encoder._model.tokenizer.convert_tokens_to_string(
        text_encoder._model.tokenizer.tokenize(t)[:200]) for t in user.chunk_texts[:24]]
    mem.add(texts, user.key, ids=user.chunk_ids[:24])
    assert mem.bank.user_size(user.key) == 24
    batched = mem.search_batch(questions, user.key, k=5)
    worst = 0.0
    for q, hits in zip(questions, batched):
        v = text_encoder.encode([q])
        ref = search(mem.bank, v, [user.key], config=mem.config.replace(out_k=5))
        assert [h.id for h in hits] == ref.ids_list(0)
        assert hits.route == ref.route_names[0] and hits.rule == ref.rule_names[0]
        worst = max(worst, float(np.abs(np.array([h.score for h in hits]) - ref.scores[0][: len(hits)]).max(initial=0)))
    assert worst < 1e-5
    assert {h.route for h in batched} == {"familiarity", "recollection"}


def test_text_memory_end_to_end(tmp_path, text_encoder):
    mem = Memory(tmp_path / "m", encoder=text_encoder)
    mem.add(["The dog is called Rex.", "I work as a baker in Nantes.", "My favourite colour is green."], "u1")
    mem.add(["The cat is called Tom."], "u2")
    assert mem.search("What is my job?", "u1", k=1)[0].text == "I work as a baker in Nantes."
    assert mem.search("What is my dog's name?", "u2", k=3)[0].text == "The cat is called Tom."  # u2 only
    mem.close()
    again = Memory(tmp_path / "m", encoder=text_encoder)
    assert again.search("Which colour do I like?", "u1", k=1)[0].text == "My favourite colour is green."


def test_long_memory_is_chunked_so_its_end_is_found(text_encoder):
    """A memory ending in "My favourite colour is green." after ~400 tokens of filler,
    truncated at 256 tokens, would rank 3rd (score 0.125); chunked,
    it is the top hit for "What is my favourite colour?", with its whole text."""
    filler = " ".join(f"On day {i} I walked to the market and bought some bread and cheese." for i in range(30))
    long_text = filler + " My favourite colour is green."
    assert text_encoder.count_tokens([long_text])[0] > text_encoder.max_tokens
    mem = Memory(encoder=text_encoder, cache_size=0)
    mem.add([long_text, "I have a brother called Tom.", "I work as a nurse in Lyon."], "u", ids=["long", "b", "c"])
    assert mem.count("u") == 3 and mem.bank.user_size("u") > 3
    hits = mem.search("What is my favourite colour?", "u", k=3, mode="dense")
    assert hits[0].id == "long" and hits[0].text == long_text and hits[0].score > 0.3
    assert sorted(h.id for h in hits) == ["b", "c", "long"]
    parts = mem._split([long_text])[0]
    assert all(text_encoder.count_tokens([p])[0] <= text_encoder.max_tokens for p in parts)
    assert parts[-1].endswith("My favourite colour is green.") and long_text.startswith(parts[0])
    mem.delete("long", "u")
    assert mem.bank.user_size("u") == 2


def test_health_names_the_runtime_and_precision_of_the_real_encoder(text_encoder):
    """/health with the offline MiniLM (torch float32, as the session fixture builds it):
    the runtime, precision, device, model directory and dimension it runs with."""
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from rfmem_fast.encoders import default_model_path
    from rfmem_fast.serving.app import create_app

    mem = Memory(encoder=text_encoder)
    with TestClient(create_app(mem, no_auth=True)) as c:
        enc = c.get("/health").json()["encoder"]
    assert enc == {"model": str(default_model_path()), "backend": "torch", "dtype": "float32", "device": "cpu",
                   "dim": 384, "loaded": True}


@pytest.mark.parametrize("vectors", [False, True])
def test_import_without_vectors_reembeds_within_the_encoders_tolerance(tmp_path, text_encoder, vectors):
    """docs/guides/import-export.md: an export imported into a fresh memory by the same
    encoder gives the same ids, users, texts, metadata and creation times in the same
    order; without --vectors the rows are embedded again (other passes: other float32
    rounding), each component within 1e-6 of the original and cosine >= 1 - 1e-6; with
    --vectors the stored rows, bit for bit."""
    from rfmem_fast.serving.transfer import export_jsonl, import_jsonl

    rng = np.random.default_rng(7)
    words = "I my sister moved to Lyon in 2021 allergic peanuts cello plays Ana bank Tuesday coffee Japan".split()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(3, 40)))) + f" ({i})" for i in range(40)]
    src = Memory(tmp_path / "one", encoder=text_encoder, batching=False)
    src.add(texts, "alice", metadata=[{"n": i} for i in range(40)])  # one encoder call: 40 texts
    export_jsonl(src, tmp_path / "one.jsonl", vectors=vectors)
    dst = Memory(tmp_path / "two", encoder=text_encoder, batching=False)
    import_jsonl(dst, tmp_path / "one.jsonl", batch=3)  # other passes: 3 texts each
    items = lambda m: [(i.id, i.text, i.metadata, i.created_at) for i in m.get_all("alice")]  # noqa: E731
    assert items(dst) == items(src) and len(items(src)) == 40
    a, b = src.bank.snapshot(), dst.bank.snapshot()
    assert list(a.item_ids) == list(b.item_ids)
    if vectors:
        assert np.array_equal(a.vectors, b.vectors)
    else:
        assert np.abs(a.vectors - b.vectors).max() < 1e-6
        cos = (a.vectors.astype(np.float64) * b.vectors.astype(np.float64)).sum(axis=1)
        assert cos.min() >= 1 - 1e-6
    src.close()
    dst.close()
